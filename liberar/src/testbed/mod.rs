//! The emulated Ethernet cluster: network namespaces on a bridge, and a
//! launcher that runs MPI rank i inside host i. (Being written.)
