//! The Kiln management daemon (`kiln-mgmtd`): durable volume configuration committed with
//! one durable write per transaction, the typed option table, brick supervision and live
//! configuration push.
//!
//! It does no data I/O and never touches a brick's files; bricks are separate processes.
//! Not implemented yet: see the management issue.
