//! The Kiln client: the async client library (what `libgfapi` is to GlusterFS) and the `kiln`
//! command users type.
//!
//! The client is a stack of layers that all implement one fop trait, [`Layer`], with the
//! caller's credentials on every call. Today a stack is one [`BrickClient`]: a QUIC connection
//! with mutual TLS to one brick ([`BrickClient::connect`]). The fop API is GFID-based (like
//! gfapi's handle API), with typed helpers ([`LayerExt`]) and path helpers ([`Paths`]) on
//! every layer, and the FUSE mount ([`mount`]) on top. It speaks to bricks only through
//! `kiln-wire` messages and never links the brick's code.

pub mod brick;
pub mod distribute;
pub mod error;
pub mod layer;
pub mod mount;
pub mod mountinfo;
pub mod path;

pub use brick::{BrickClient, CONNECTIONS_MAX, ConnectOptions, Fd, LANE_IO_MIN_BYTES};
pub use error::Error;
pub use layer::{FdFop, Layer, LayerEvent, LayerExt};
pub use path::Paths;
