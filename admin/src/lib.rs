//! Kiln's control plane as types and small helpers, shared by the brick (`kiln-dataplane`),
//! the management daemon (`kiln-mgmt`) and the client and CLI (`kiln-client`):
//!
//! * [`pki`]: the cluster CA and the brick and client certificates it signs;
//! * [`join`]: the one-time token a host joins a cluster with, and the sealed messages of a
//!   join;
//! * [`options`]: the typed volume option table, with how each option reaches a brick (its
//!   `kiln-brickd serve` flag) and the typed [`BrickSettings`](options::BrickSettings) a brick
//!   runs with;
//! * [`control`]: what the daemon and a brick say on the brick's control socket (live options,
//!   status, profile, state dump);
//! * [`command`] and [`volume`]: what `kiln` and `kiln-mgmtd` say on the daemon's command
//!   socket, and the volume descriptions it carries;
//! * [`exchange`]: the one JSON line in, one JSON line out exchange both sockets use, with a size
//!   limit and a timeout, in an async and a blocking form;
//! * [`durable`]: replacing a file durably (temporary file, fsync, rename, directory fsync).
//!
//! It is not the daemon: no configuration store, no state machine of changes, no supervision
//! (that is `kiln-mgmt`), and not the data path (no fops, no QUIC; that is `kiln-wire` and the
//! brick). It depends on no other Kiln crate, so every one of them may depend on it.

#![forbid(unsafe_code)]

pub mod command;
pub mod control;
pub mod durable;
pub mod exchange;
pub mod join;
pub mod options;
pub mod pki;
pub mod volume;

use std::path::PathBuf;

/// The workspace binary `name`: beside the running executable (how cargo and packages lay
/// them out), else from PATH.
pub fn find_binary(name: &str) -> Option<PathBuf> {
    let beside = std::env::current_exe().ok()?.with_file_name(name);
    if beside.exists() {
        return Some(beside);
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(name))
        .find(|p| p.exists())
}
