//! The Kiln brick: serves fops on one brick directory.
//!
//! It owns the GlusterFS-compatible on-disk layout (`trusted.gfid` xattrs, `.glusterfs/XX/YY`
//! handles, see [`brick`]), the fop semantics written once ([`fops`]) over the single-name
//! system calls they are made of ([`op`]) and two executors — the io_uring engine and the
//! blocking engine ([`exec`]) — running on the brick's worker threads ([`workers`], driven by
//! [`engine`]), the per-client fd tables, the GFID and directory-fd caches, start-up repair and
//! the check command ([`recovery`]), directory leases ([`leases`]), and the QUIC server
//! ([`server`]). Its `unsafe` code is fenced in the ring module (`exec::uring::ring`) and in
//! [`sys`], two xattr system calls rustix does not wrap yet.
//!
//! It is not the protocol (that is `kiln-wire`), not configuration storage (that is
//! `kiln-mgmt`), and not a client.

pub mod brick;
pub mod cache;
pub mod creds;
pub mod engine;
pub mod exec;
pub mod fdtable;
pub mod fops;
pub mod leases;
pub mod locks;
pub mod metrics;
pub mod op;
pub mod profile;
pub mod recovery;
pub mod server;
pub mod sys;
pub mod workers;

pub use brick::{Brick, BrickError};
pub use engine::{Engine, EngineConfig, EngineKind, EngineState, LocalEngine, Session};
pub use fdtable::SessionId;
pub use fops::{CrashPoint, FopsConfig, ParentAttrs};
