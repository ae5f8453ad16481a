//! The volume's free space, as the mount weighs it before answering a change ahead: a change
//! answered ahead and refused later for want of space reaches the program only at the
//! object's next `fsync` or `close` — after a `close`, never — so a mount answers nothing
//! ahead while the fullest brick's free space or free inodes, less what the mount has queued
//! since it last asked, is below a floor (`performance.behind-free-mib`, [`INODES_FLOOR`]).
//! Changes then go to the brick while the program waits, and a full brick is an error at the
//! call, as CephFS's clients write synchronously once the cluster is nearly full.
//!
//! The mount asks each brick (STATFS) at its start, then each [`SPACE_CHECK_INTERVAL`] in
//! which it queued something, wrote into new blocks, or found the space low. Every change
//! queued counts at once, at the most it may take on disk ([`disk_bytes`],
//! [`INODES_PER_CHANGE`]), against every brick: a change lands on one brick of a distributed
//! volume, and which one is not weighed here. The floors are there for what is not queued
//! yet (deferred files' data, writes gathered behind: 64 MiB each at most; new files still
//! open) and for other clients.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kiln_wire::FsStats;

/// How often a mount that queues changes asks for the volume's free space.
pub(super) const SPACE_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// The least a brick's new object or change takes on disk: a file system block.
const BLOCK_BYTES: u64 = 4096;

/// The most inodes a queued change takes on a brick: its new object's, and a new
/// directory's handle (a symlink in `.glusterfs`).
const INODES_PER_CHANGE: u64 = 2;

/// Free inodes on a brick below which nothing is answered ahead, while free space is
/// watched.
const INODES_FLOOR: u64 = 512;

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
    /// Every change queued since the mount began.
    changes: AtomicU64,
    /// Of those, the changes the brick has answered.
    changes_answered: AtomicU64,
    /// What the last STATFS found, less what was owed when it was sent; none before the
    /// first answer.
    known: Mutex<Option<Known>>,
}

/// The queue when a STATFS is sent.
#[derive(Debug, Clone, Copy)]
pub(super) struct Asked {
    pub(super) queued: u64,
    owed: u64,
    changes: u64,
    changes_owed: u64,
}

/// The fullest brick's room, less what was queued and unanswered when the STATFS was sent.
#[derive(Debug, Clone, Copy)]
struct Known {
    free_bytes: u64,
    free_inodes: u64,
    asked: Asked,
}

impl Space {
    pub(super) fn new(floor_bytes: u64) -> Space {
        Space {
            floor: floor_bytes,
            queued: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            changes: AtomicU64::new(0),
            changes_answered: AtomicU64::new(0),
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
        self.changes.fetch_add(1, Ordering::Relaxed);
    }

    /// Notes `bytes` the brick took for data sent outside the queue (a WRITE): they count
    /// against the space last found, and call for a new look.
    pub(super) fn written(&self, bytes: u64) {
        self.queued.fetch_add(bytes, Ordering::Relaxed);
        self.answered.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Notes a queued change of `bytes` answered by the brick.
    pub(super) fn answered(&self, bytes: u64) {
        self.answered.fetch_add(bytes, Ordering::Relaxed);
        self.changes_answered.fetch_add(1, Ordering::Relaxed);
    }

    /// The queue as a STATFS is sent.
    pub(super) fn asking(&self) -> Asked {
        // Answers are counted after what they answer, so read them first.
        let answered = self.answered.load(Ordering::Relaxed);
        let changes_answered = self.changes_answered.load(Ordering::Relaxed);
        let queued = self.queued.load(Ordering::Relaxed);
        let changes = self.changes.load(Ordering::Relaxed);
        Asked {
            queued,
            owed: queued.saturating_sub(answered),
            changes,
            changes_owed: changes.saturating_sub(changes_answered),
        }
    }

    /// The STATFS of each brick, sent at `asked`, found `bricks`.
    pub(super) fn found(&self, asked: Asked, bricks: &[FsStats]) {
        let free_bytes = bricks.iter().map(free_bytes).min().unwrap_or(u64::MAX);
        let free_inodes = bricks.iter().map(free_inodes).min().unwrap_or(u64::MAX);
        let known = Known {
            free_bytes: free_bytes.saturating_sub(asked.owed),
            free_inodes: free_inodes
                .saturating_sub(asked.changes_owed.saturating_mul(INODES_PER_CHANGE)),
            asked,
        };
        *self.known.lock().unwrap_or_else(|p| p.into_inner()) = Some(known);
    }

    /// Whether the free space or inodes last found, less what was queued since, is below
    /// its floor on a brick (not before the first STATFS has answered).
    pub(super) fn is_low(&self) -> bool {
        if self.floor == 0 {
            return false;
        }
        let known = *self.known.lock().unwrap_or_else(|p| p.into_inner());
        let Some(known) = known else {
            return false;
        };
        let bytes_since = self
            .queued
            .load(Ordering::Relaxed)
            .saturating_sub(known.asked.queued);
        let changes_since = self
            .changes
            .load(Ordering::Relaxed)
            .saturating_sub(known.asked.changes);
        let inodes_since = changes_since.saturating_mul(INODES_PER_CHANGE);
        known.free_bytes.saturating_sub(bytes_since) < self.floor
            || known.free_inodes.saturating_sub(inodes_since) < INODES_FLOOR
    }
}

/// The bytes a brick has free for its users.
fn free_bytes(stats: &FsStats) -> u64 {
    let unit = if stats.frsize > 0 {
        stats.frsize
    } else {
        stats.bsize
    };
    stats.bavail.saturating_mul(unit)
}

/// The inodes a brick has free for its users; without bound where its file system counts
/// none (`files` 0: btrfs makes inodes as it needs them).
fn free_inodes(stats: &FsStats) -> u64 {
    if stats.files == 0 {
        u64::MAX
    } else {
        stats.favail
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(bavail: u64, favail: u64) -> FsStats {
        FsStats {
            bsize: 4096,
            frsize: 4096,
            blocks: 1 << 20,
            bfree: bavail,
            bavail,
            files: 1 << 20,
            ffree: favail,
            favail,
            fsid: 0,
            flags: 0,
            namemax: 255,
        }
    }

    #[test]
    fn what_is_queued_since_a_statfs_counts_against_what_it_found() {
        let plenty = 1 << 20;
        let space = Space::new(100 * BLOCK_BYTES);
        assert!(!space.is_low(), "nothing known yet");
        space.queued(disk_bytes(10));
        space.found(space.asking(), &[stats(102, plenty)]);
        assert!(!space.is_low(), "102 blocks less the 2 owed");
        space.queued(disk_bytes(1));
        assert!(space.is_low(), "2 blocks more queued since");
        space.answered(disk_bytes(10));
        space.answered(disk_bytes(1));
        space.found(space.asking(), &[stats(100, plenty)]);
        assert!(!space.is_low(), "all answered, 100 free");
        assert_eq!(disk_bytes(4096), 2 * BLOCK_BYTES);
        assert!(!Space::new(0).is_low(), "a floor of 0 is never low");
    }

    #[test]
    fn the_fullest_brick_decides_in_bytes_and_in_inodes() {
        let plenty = 1 << 20;
        let space = Space::new(100 * BLOCK_BYTES);
        space.found(space.asking(), &[stats(plenty, plenty), stats(99, plenty)]);
        assert!(space.is_low(), "one brick below the floor of bytes");

        let inodes = INODES_FLOOR + 2 * INODES_PER_CHANGE - 1;
        space.found(
            space.asking(),
            &[stats(plenty, plenty), stats(plenty, inodes)],
        );
        assert!(
            !space.is_low(),
            "two changes from below the floor of inodes"
        );
        space.queued(disk_bytes(0));
        space.found(
            space.asking(),
            &[stats(plenty, plenty), stats(plenty, inodes)],
        );
        assert!(!space.is_low(), "one change owed");
        space.queued(disk_bytes(0));
        assert!(space.is_low(), "and one more queued since");

        let unbounded = FsStats {
            files: 0,
            favail: 0,
            ffree: 0,
            ..stats(plenty, 0)
        };
        space.answered(disk_bytes(0));
        space.answered(disk_bytes(0));
        space.found(space.asking(), &[unbounded]);
        assert!(!space.is_low(), "a file system that counts no inodes");
    }
}
