//! Every c-tests program under Open MPI, with and without liberar.so:
//! same results, exit 0, one stats line per rank (see rust_tests::check_ctest).

use rust_tests::{check_all_ctests, Mpi};

#[test]
fn openmpi_2_hosts() {
    check_all_ctests(Mpi::Openmpi, 2);
}

#[test]
fn openmpi_3_hosts() {
    check_all_ctests(Mpi::Openmpi, 3);
}

#[test]
fn openmpi_4_hosts() {
    check_all_ctests(Mpi::Openmpi, 4);
}

#[test]
fn openmpi_8_hosts() {
    check_all_ctests(Mpi::Openmpi, 8);
}
