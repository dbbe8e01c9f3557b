//! Every c-tests program under Open MPI, with and without liberar.so:
//! same results, exit 0, one stats line per rank (see rust_tests::check_ctest),
//! and once with liberar's default routing.

use rust_tests::{check_all_ctests, Mpi, Routing};

#[test]
fn openmpi_2_hosts() {
    check_all_ctests(Mpi::Openmpi, 2, Routing::Threshold);
}

#[test]
fn openmpi_3_hosts() {
    check_all_ctests(Mpi::Openmpi, 3, Routing::Threshold);
}

#[test]
fn openmpi_4_hosts() {
    check_all_ctests(Mpi::Openmpi, 4, Routing::Threshold);
}

#[test]
fn openmpi_8_hosts() {
    check_all_ctests(Mpi::Openmpi, 8, Routing::Threshold);
}

/// As a user runs it: liberar's default routing (by measurement, with
/// trials through MPI), which the runs above replace with the threshold.
/// It found what they missed in session 37: a registered broadcast buffer
/// freed before a fork crashed the child (bcast_roots' run_freed now
/// reproduces it under both).
#[test]
fn openmpi_4_hosts_default_routing() {
    check_all_ctests(Mpi::Openmpi, 4, Routing::Default);
}
