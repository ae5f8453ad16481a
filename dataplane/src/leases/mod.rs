//! Directory leases (`docs/wire.md`, "Leases"): which session holds which lease on which
//! directory, the recalls under way, the revoked marks, and the check every fop passes before
//! it runs. One [`Leases`] is shared by every worker of a brick.
//!
//! * **Grants** ([`Leases::grant`]) never recall: a lease is granted only when nothing is in
//!   the way — no other session's conflicting lease, no recall of that directory under way,
//!   no recall there caused by another session within `features.lease-contention-ms`, no
//!   other session's conflicting fop running there. Otherwise the answer is less than asked.
//! * **The check** ([`Leases::admit`]) finds the other sessions' leases a fop conflicts with
//!   (a write lease: any fop; a read lease: a fop that changes the directory), sends each
//!   holder a RECALL once, and waits — on a [`Notify`], holding no thread — until every one is
//!   back: returned by LEASE, its session ended, or revoked `features.lease-recall-timeout-ms`
//!   after the recall. A session whose write lease was revoked gets ESTALE for fops changing
//!   that directory until it sends LEASE for it again; a revoked read lease leaves no mark.
//!   A fop that passed the check is registered as running there until it ends, so no lease
//!   is granted under it.
//! * **Free when unused.** While no lease and no revoked mark exist the gate is disarmed and a
//!   fop pays an atomic add and sub on its worker's own counter and three loads
//!   ([`Leases::enter`]). The first grant arms it, then waits until every fop that passed the
//!   disarmed gate has ended (they are counted per epoch parity, as SRCU does), so no lease is
//!   granted under a fop that was never checked.
//!
//! The parts: what a fop touches ([`touches()`], [`Targets`]), the plain-data lease table
//! (`table`), the gate in front of every fop (`gate`), and the shared [`Leases`] that joins
//! them (`shared`).
//!
//! [`Notify`]: tokio::sync::Notify

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use kiln_admin::options::BrickSettings;
use kiln_wire::Recall;
use tokio::sync::mpsc;

mod gate;
mod listed;
mod shared;
mod table;
mod touches;

pub use gate::{Slot, Unarmed};
pub use listed::Cover;
pub use shared::{Admitted, Leases, Refused};
pub use touches::{Access, Targets, Touches, touches};

/// Leases one session may hold at once; past it, LEASE answers none.
pub const LEASES_PER_SESSION_MAX: usize = 65_536;
/// RECALL events queued for one session's connection; a recall that finds the queue full is
/// not sent, and its lease is revoked when the recall times out.
pub const RECALLS_QUEUED_MAX: usize = 1024;
/// How long a grant that arms the gate waits for fops that passed it disarmed; past it, the
/// answer is none (a later LEASE tries again).
pub const DRAIN_WAIT_MAX: Duration = Duration::from_secs(1);
/// How often an arming grant looks whether those fops have ended.
const DRAIN_POLL: Duration = Duration::from_millis(1);
/// A holder still sending fops is giving back what was recalled (its changes queued before
/// the recall go first): each fop moves the recall's deadline to a full timeout away, up to
/// this many timeouts after the recall.
pub const RECALL_TIMEOUTS_MAX: u32 = 12;
/// Directories remembered (for their last recall, or a fop running there) before the idle
/// ones are swept out; the sweep runs again when the table has doubled since.
const DIRS_SWEEP_MIN: usize = 1024;

/// `features.leases`, `features.lease-recall-timeout-ms`, `features.lease-contention-ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseSettings {
    /// Off: every LEASE is answered none (leases held keep being honoured until returned).
    pub enabled: bool,
    /// How long a recalled lease may stay out before it is revoked.
    pub recall_timeout: Duration,
    /// How long after a recall caused by another session a directory's leases are refused.
    pub contention: Duration,
}

impl Default for LeaseSettings {
    fn default() -> Self {
        LeaseSettings {
            enabled: true,
            recall_timeout: Duration::from_millis(5000),
            contention: Duration::from_millis(1000),
        }
    }
}

impl From<&BrickSettings> for LeaseSettings {
    fn from(settings: &BrickSettings) -> LeaseSettings {
        LeaseSettings {
            enabled: settings.leases,
            recall_timeout: Duration::from_millis(settings.lease_recall_timeout_ms),
            contention: Duration::from_millis(settings.lease_contention_ms),
        }
    }
}

/// A session's RECALL events, for its connection to send.
pub type RecallEvents = mpsc::Receiver<Recall>;

/// What lease activity a brick has seen: counters since start, and the leases held now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LeaseStats {
    pub grants: u64,
    pub recalls: u64,
    /// Leases given back by LEASE (to none, or a downgrade).
    pub returns: u64,
    pub revocations: u64,
    /// Fops that waited for a recall.
    pub waits: u64,
    /// Leases held now.
    pub held: u64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update leaves the table whole before it can panic (counters are adjusted with
    // the entries they count), so a poisoned lock still holds a usable table.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
