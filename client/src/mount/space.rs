//! The volume's free space, as the mount weighs it before answering a change ahead: a change
//! answered ahead and refused later for want of space reaches the program only at the
//! object's next `fsync` or `close` — after a `close`, never — so a mount answers nothing
//! ahead while the volume's free space, less what it has queued since it last asked, is
//! below a floor (`performance.behind-free-mib`). Changes then go to the brick while the
//! program waits, and a full volume is an error at the call, as CephFS's clients write
//! synchronously once the cluster is nearly full.
//!
//! The mount asks (STATFS) at its start, then each [`SPACE_CHECK_INTERVAL`] in which it
//! queued something, wrote into new blocks, or found the space low. Every change queued
//! counts at once, at the most it may take on disk
//! ([`disk_bytes`]); the floor is there for what is not queued yet (deferred files' data,
//! writes gathered behind: 64 MiB each at most) and for other clients.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kiln_wire::FsStats;

/// How often a mount that queues changes asks for the volume's free space.
pub(super) const SPACE_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// The least a brick's new object or change takes on disk: a file system block.
const BLOCK_BYTES: u64 = 4096;

/// The most a queued change of `wire_bytes` on the wire may take on disk: its bytes rounded
/// up to blocks, and a block more for its object (an inode's directory entry, its handle).
pub(super) fn disk_bytes(wire_bytes: usize) -> u64 {
    (wire_bytes as u64).next_multiple_of(BLOCK_BYTES) + BLOCK_BYTES
}

/// What the mount knows of the volume's free space.
#[derive(Debug)]
pub(super) struct Space {
    /// Free bytes below which nothing is answered ahead; 0: changes are always answered
    /// ahead.
    floor: u64,
    /// Disk bytes of every change queued since the mount began.
    queued: AtomicU64,
    /// Of those, the bytes of the changes the brick has answered.
    answered: AtomicU64,
    /// The last STATFS's free bytes, less what was queued and unanswered when it was sent,
    /// and `queued` then; none before the first answer.
    known: Mutex<Option<(u64, u64)>>,
}

/// The queue when a STATFS is sent.
#[derive(Debug, Clone, Copy)]
pub(super) struct Asked {
    pub(super) queued: u64,
    owed: u64,
}

impl Space {
    pub(super) fn new(floor_bytes: u64) -> Space {
        Space {
            floor: floor_bytes,
            queued: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            known: Mutex::new(None),
        }
    }

    /// Whether the mount weighs free space at all.
    pub(super) fn watched(&self) -> bool {
        self.floor > 0
    }

    /// Notes a change of `bytes` on disk at most, queued.
    pub(super) fn queued(&self, bytes: u64) {
        self.queued.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Notes `bytes` the brick took for data sent outside the queue (a WRITE): they count
    /// against the space last found, and call for a new look.
    pub(super) fn written(&self, bytes: u64) {
        self.queued(bytes);
        self.answered(bytes);
    }

    /// Notes a queued change of `bytes` answered by the brick.
    pub(super) fn answered(&self, bytes: u64) {
        self.answered.fetch_add(bytes, Ordering::Relaxed);
    }

    /// The queue as a STATFS is sent.
    pub(super) fn asking(&self) -> Asked {
        let queued = self.queued.load(Ordering::Relaxed);
        let answered = self.answered.load(Ordering::Relaxed);
        Asked {
            queued,
            owed: queued.saturating_sub(answered),
        }
    }

    /// The STATFS sent at `asked` found `stats`.
    pub(super) fn found(&self, asked: Asked, stats: &FsStats) {
        let unit = if stats.frsize > 0 {
            stats.frsize
        } else {
            stats.bsize
        };
        let free = stats.bavail.saturating_mul(unit);
        let known = (free.saturating_sub(asked.owed), asked.queued);
        *self.known.lock().unwrap_or_else(|p| p.into_inner()) = Some(known);
    }

    /// Whether the free space last found, less what was queued since, is below the floor
    /// (not before the first STATFS has answered).
    pub(super) fn is_low(&self) -> bool {
        if self.floor == 0 {
            return false;
        }
        let known = *self.known.lock().unwrap_or_else(|p| p.into_inner());
        let Some((free, queued_then)) = known else {
            return false;
        };
        let since = self
            .queued
            .load(Ordering::Relaxed)
            .saturating_sub(queued_then);
        free.saturating_sub(since) < self.floor
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(bavail: u64) -> FsStats {
        FsStats {
            bsize: 4096,
            frsize: 4096,
            blocks: 1 << 20,
            bfree: bavail,
            bavail,
            files: 1 << 20,
            ffree: 1 << 20,
            favail: 1 << 20,
            fsid: 0,
            flags: 0,
            namemax: 255,
        }
    }

    #[test]
    fn what_is_queued_since_a_statfs_counts_against_what_it_found() {
        let space = Space::new(100 * BLOCK_BYTES);
        assert!(!space.is_low(), "nothing known yet");
        space.queued(disk_bytes(10));
        space.found(space.asking(), &stats(102));
        assert!(!space.is_low(), "102 blocks less the 2 owed");
        space.queued(disk_bytes(1));
        assert!(space.is_low(), "2 blocks more queued since");
        space.answered(disk_bytes(10));
        space.answered(disk_bytes(1));
        space.found(space.asking(), &stats(100));
        assert!(!space.is_low(), "all answered, 100 free");
        assert_eq!(disk_bytes(4096), 2 * BLOCK_BYTES);
        assert!(!Space::new(0).is_low(), "a floor of 0 is never low");
    }
}
