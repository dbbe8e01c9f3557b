//! Float ↔ integer conversion at the edges of the in-kernel ring.
//! (Being written.)
