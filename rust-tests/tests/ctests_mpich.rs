//! Every c-tests program under MPICH, with and without liberar.so. MPICH's
//! small messages over UCX tcp are slow here, so fewer host counts.

use rust_tests::{check_all_ctests, Mpi};

#[test]
fn mpich_3_hosts() {
    check_all_ctests(Mpi::Mpich, 3);
}

#[test]
fn mpich_4_hosts() {
    check_all_ctests(Mpi::Mpich, 4);
}
