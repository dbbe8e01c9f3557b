//! Ring membership and the per-call flow of one fast-path collective.
//! (Being written.)
