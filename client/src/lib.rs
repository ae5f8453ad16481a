//! The Kiln client: the async client library (what `libgfapi` is to GlusterFS) and the `kiln`
//! command users type.
//!
//! [`Volume::connect`] opens a QUIC connection with mutual TLS to a brick; the fop API is
//! GFID-based (like gfapi's handle API), with path helpers on top ([`path`]). It speaks to
//! bricks only through `kiln-wire` messages and never links the brick's code.

pub mod error;
pub mod mount;
pub mod mountinfo;
pub mod path;
pub mod volume;

pub use error::Error;
pub use volume::{ConnectOptions, Fd, Volume};
