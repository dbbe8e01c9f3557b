//! This host's XDP datapath: loading, attaching, and driving it.
//! (Being written; see docs/datapath.md for the contract.)
