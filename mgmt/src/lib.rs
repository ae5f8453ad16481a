//! Kiln cluster management: the management daemon `kiln-mgmtd` and what it is made of — the
//! configuration store ([`store`]: the embedded log — one durable write per transaction,
//! group commit, compaction, torn tails dropped at open — or etcd, shared by a cluster's
//! daemons), the volume configuration and its typed changes ([`volume`]), the brick
//! supervisor with live option pushes ([`supervisor`]), what a cluster's daemons share in
//! etcd beside the configuration ([`cluster`]), asking every host about its bricks
//! ([`fanout`]), which hosts are members and how one joins
//! ([`membership`]), the cluster-wide tasks one elected daemon runs ([`tasks`]) and the daemon
//! that serves the command socket ([`daemon`]).
//!
//! What the daemon shares with bricks and clients — the cluster's identities, the option
//! table, both sockets' protocols, the volume descriptions — is in `kiln-admin`. It does no
//! data I/O and never touches a brick's files; bricks are separate processes.

#![forbid(unsafe_code)]

pub mod cluster;
pub mod daemon;
pub mod etcd_server;
pub mod fanout;
pub mod membership;
pub mod store;
pub mod supervisor;
pub mod tasks;
pub mod volume;

/// `mutex`, locked; a lock a panicking thread left is taken as it is (what it guards is
/// replaced whole, never left half changed).
pub(crate) fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
