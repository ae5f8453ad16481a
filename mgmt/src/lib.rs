//! Kiln cluster management: the management daemon `kiln-mgmtd` and what it is made of — the
//! cluster's identities ([`pki`]), the durable configuration store ([`store`]: one durable
//! write per transaction, group commit, compaction, torn tails dropped at open), the volume
//! configuration and its typed changes ([`volume`]), the typed option table ([`options`]), the
//! brick supervisor with live option pushes ([`supervisor`]), the command protocol
//! ([`protocol`]) and the daemon that serves it ([`daemon`]).
//!
//! It does no data I/O and never touches a brick's files; bricks are separate processes.

pub mod daemon;
pub mod options;
pub mod pki;
pub mod protocol;
pub mod store;
pub mod supervisor;
pub mod volume;
