//! Distribution's pure part: which brick of a volume a name belongs to, as GlusterFS's DHT
//! (`xlators/cluster/dht/`) decides it, so a Kiln volume and a GlusterFS volume agree on
//! where every file lives.
//!
//! [`Distribute`] is the layer of the client stack that does it; the rest is pure.
//!
//! Each directory has a [`Layout`]: per brick, one range of the 32-bit hash space, stored on
//! that brick's copy of the directory in the `trusted.glusterfs.dht` xattr ([`DiskLayout`]).
//! A name lives on the brick whose range holds its [`hash`](name_hash). This module builds
//! layouts for new directories (equal, or weighted by brick size), rebuilds them when bricks
//! are added, reads and writes the xattr, and finds holes and overlaps. It does no I/O: the
//! distribution layer of the client stack reads the xattrs, asks this module, and sends the
//! fops.
//!
//! Not modelled: `cluster.extra-hash-regex` (a user's regex tried before the rsync one) and
//! `cluster.directory-layout-spread` (layouts over fewer bricks than the volume has).

pub mod hash;
mod layer;
pub mod layout;

pub use hash::{Munging, dm_hash, name_hash};
pub use layer::{
    BRICKS_REFRESH, BrickSource, DirFds, DistFd, Distribute, FileFd, HealReport, LAYOUT_TTL,
    LINKTO_XATTR, Listed, Member, RebalanceReport,
};
pub use layout::{
    Anomalies, BRICKS_MAX, COMMIT_HASH_COMMITTED, COMMIT_HASH_INVALID, DiskLayout, HashRange,
    HashType, Layout, XATTR_LEN, XATTR_NAME, first_brick, size_chunks, weights_for,
};

/// Why a layout could not be decoded or built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A `trusted.glusterfs.dht` value is four 32-bit words.
    #[error("a trusted.glusterfs.dht value is {XATTR_LEN} bytes, this one is {len}")]
    XattrLength { len: usize },
    /// GlusterFS writes hash type 0 (its own layouts) or 1 (layouts a user set by hand).
    #[error("unknown DHT hash type {value} in trusted.glusterfs.dht")]
    HashType { value: u32 },
    /// A range that stops before it starts; GlusterFS never writes one.
    #[error("hash range {start:#010x}-{stop:#010x} stops before it starts")]
    InvertedRange { start: u32, stop: u32 },
    /// A layout covers 1 to [`BRICKS_MAX`] bricks.
    #[error("{bricks} bricks: a layout has 1 to {BRICKS_MAX}")]
    BrickCount { bricks: usize },
    /// The brick a new layout starts at is not one of its bricks.
    #[error("brick {brick} is not among the layout's {bricks} bricks")]
    NoSuchBrick { brick: usize, bricks: usize },
    /// Every brick has weight 0: nobody could hold a name.
    #[error("no brick has a share of the hash space")]
    NoShares,
    /// A rebalanced layout needs a weight for every brick of the layout it replaces.
    #[error("{weights} weights for a layout of {bricks} bricks")]
    TooFewWeights { weights: usize, bricks: usize },
    /// The ranges leave some hashes with no brick or give some to two bricks.
    #[error("the layout has {} hole(s) and {} overlap(s)", .0.holes, .0.overlaps)]
    Anomalies(Anomalies),
}
