//! The Kiln client: the async client library (what `libgfapi` is to GlusterFS), the FUSE
//! mount and the `kiln` command users type.
//!
//! It speaks to bricks only through `kiln-wire` messages and never links the brick's code.
