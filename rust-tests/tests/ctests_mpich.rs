//! Every c-tests program under MPICH, with and without liberar.so, on 4
//! hosts. MPICH's small messages over UCX tcp are slow here (minutes per
//! host count on 2 cores), so one host count; `fastpath.rs` runs MPICH on 3.

use rust_tests::{check_all_ctests, Mpi, Routing};

#[test]
fn mpich_4_hosts() {
    check_all_ctests(Mpi::Mpich, 4, Routing::Threshold);
}
