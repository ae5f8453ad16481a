//! Kiln cluster management: the cluster's identities ([`pki`]) today; the management daemon
//! (`kiln-mgmtd`: durable volume configuration committed with one durable write per
//! transaction, the typed option table, brick supervision and live configuration push) is
//! the management issue's work and not here yet.
//!
//! It does no data I/O and never touches a brick's files; bricks are separate processes.

pub mod pki;
