//! Read leases on files (capability `FILE_LEASES`): what keeps a file's cached pages and
//! attributes true across mounts where no directory lease does.
//!
//! * A file opened for reading that no held directory's listing describes (and that the
//!   mount did not make) gets a read lease with its first open ([`FileLeases::asked`], then
//!   [`FileLeases::take`]). The kernel's pages and attributes of it, cached before the
//!   grant, may predate another client's change: that open drops them, and what the
//!   kernel reads from then on is read under the lease. Later opens keep them.
//! * The brick recalls the lease before another client changes the file (its data, size,
//!   mode, times, xattrs or links through it): the mount has the kernel drop the file's pages
//!   and attributes, then gives the lease back, so the next read there sees the change.
//! * The attributes the brick gave with a grant (where asked: [`super::pages`]) answer the
//!   file's stats while the lease is held and the file was not changed through the mount
//!   since the [`ChangeMark`] they were asked at, nor any file removed or renamed
//!   ([`FileLeases::attrs`]): another client's change recalls the lease first.
//! * A file whose lease the brick refused (another client changed it lately) is not asked
//!   about again for [`REFUSED_FOR`].
//! * At most [`FILE_LEASES_MAX`] are held; the least lately opened goes back first (its
//!   kernel caches dropped the same way). A recall that overtakes its grant's reply (they
//!   travel on different streams) stops that grant from being taken: each ask notes how many
//!   recalls the mount had seen, and a grant asked before any later one is given back.

use std::num::NonZeroUsize;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kiln_wire::{Gfid, Iatt};

use super::inodes::ChangeMark;

/// Files held under a read lease at most.
pub(super) const FILE_LEASES_MAX: usize = 4096;
/// How long a file whose lease the brick refused (another client changed it lately) is not
/// asked about again; files remembered so at most.
const REFUSED_FOR: Duration = Duration::from_secs(1);
const REFUSED_MAX: usize = 1024;

/// The files this mount holds a read lease on.
#[derive(Debug)]
pub(super) struct FileLeases {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// Each file held, with the attributes the brick gave under the lease and the mark of
    /// the changes through the mount they are as of, if noted.
    held: lru::LruCache<Gfid, Option<(Iatt, ChangeMark)>>,
    /// Files whose lease the brick refused, and when.
    refused: lru::LruCache<Gfid, Instant>,
    /// File recalls seen so far.
    recalls: u64,
}

impl Default for FileLeases {
    fn default() -> FileLeases {
        let capacity = |n| NonZeroUsize::new(n).expect("not zero");
        FileLeases {
            state: Mutex::new(State {
                held: lru::LruCache::new(capacity(FILE_LEASES_MAX)),
                refused: lru::LruCache::new(capacity(REFUSED_MAX)),
                recalls: 0,
            }),
        }
    }
}

impl FileLeases {
    /// Whether the mount holds a read lease on file `gfid` (which then counts as lately
    /// opened).
    pub(super) fn holds(&self, gfid: &Gfid) -> bool {
        self.lock().held.get(gfid).is_some()
    }

    /// Whether a lease on `gfid` may be asked now: not within [`REFUSED_FOR`] of a refusal.
    pub(super) fn may_ask(&self, gfid: &Gfid) -> bool {
        let mut state = self.lock();
        match state.refused.peek(gfid) {
            Some(at) if at.elapsed() < REFUSED_FOR => false,
            Some(_) => {
                state.refused.pop(gfid);
                true
            }
            None => true,
        }
    }

    /// The brick refused a lease on `gfid`.
    pub(super) fn refused(&self, gfid: Gfid) {
        self.lock().refused.put(gfid, Instant::now());
    }

    /// Notes a lease (or a held file's attributes) about to be asked: the mark its answer is
    /// taken with.
    pub(super) fn asked(&self) -> u64 {
        self.lock().recalls
    }

    /// Takes the grant of a read lease on `gfid` asked at mark `asked`: `Err(())` when a
    /// recall came since (the grant must go back); else the file the mount lets go of to
    /// make room, if any, whose lease goes back.
    pub(super) fn take(&self, gfid: Gfid, asked: u64) -> Result<Option<Gfid>, ()> {
        let mut state = self.lock();
        if state.recalls != asked {
            return Err(());
        }
        let pushed = state.held.push(gfid, None);
        Ok(pushed.map(|(evicted, _)| evicted).filter(|e| *e != gfid))
    }

    /// Notes `iatt`, the brick's attributes of held file `gfid` under its lease, as of
    /// `mark`: every change made through the mount before it had been answered when they
    /// were asked, at `asked` ([`FileLeases::asked`]). Attributes asked before a recall may
    /// predate the change it was for: not noted.
    pub(super) fn note_attrs(&self, gfid: &Gfid, iatt: Iatt, mark: ChangeMark, asked: u64) {
        let mut state = self.lock();
        if state.recalls != asked {
            return;
        }
        if let Some(noted) = state.held.peek_mut(gfid) {
            *noted = Some((iatt, mark));
        }
    }

    /// The attributes noted of held file `gfid` and the mark they are as of.
    pub(super) fn attrs(&self, gfid: &Gfid) -> Option<(Iatt, ChangeMark)> {
        self.lock().held.peek(gfid).cloned().flatten()
    }

    /// A recall of `gfid` came: a grant asked before is not taken; whether the mount held it.
    pub(super) fn recalled(&self, gfid: &Gfid) -> bool {
        let mut state = self.lock();
        state.recalls += 1;
        state.held.pop(gfid).is_some()
    }

    /// Every lease is gone (the session that held them ended): the files held.
    pub(super) fn release_all(&self) -> Vec<Gfid> {
        let mut state = self.lock();
        state.recalls += 1;
        let held = state.held.iter().map(|(gfid, _)| *gfid).collect();
        state.held.clear();
        held
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gfid(n: u32) -> Gfid {
        let mut bytes = [0u8; 16];
        bytes[..4].copy_from_slice(&n.to_be_bytes());
        bytes[15] = 1;
        Gfid::from_bytes(bytes).expect("not null")
    }

    #[test]
    fn a_grant_is_taken_unless_a_recall_came_since_it_was_asked() {
        let leases = FileLeases::default();
        let asked = leases.asked();
        assert_eq!(leases.take(gfid(1), asked), Ok(None));
        assert!(leases.holds(&gfid(1)));
        let asked = leases.asked();
        assert!(!leases.recalled(&gfid(2)), "not held");
        assert_eq!(leases.take(gfid(2), asked), Err(()), "a recall overtook it");
        assert!(leases.recalled(&gfid(1)));
        assert!(!leases.holds(&gfid(1)));
    }

    #[test]
    fn a_refused_file_is_not_asked_about_again_at_once() {
        let leases = FileLeases::default();
        assert!(leases.may_ask(&gfid(1)));
        leases.refused(gfid(1));
        assert!(!leases.may_ask(&gfid(1)));
        assert!(leases.may_ask(&gfid(2)));
    }

    #[test]
    fn the_least_lately_opened_goes_first_and_all_go_with_the_session() {
        let leases = FileLeases::default();
        for n in 0..FILE_LEASES_MAX as u32 {
            assert_eq!(leases.take(gfid(n), leases.asked()), Ok(None));
        }
        assert!(leases.holds(&gfid(0)), "opened again: now the latest");
        assert_eq!(
            leases.take(gfid(0), leases.asked()),
            Ok(None),
            "held already"
        );
        let next = FILE_LEASES_MAX as u32;
        assert_eq!(leases.take(gfid(next), leases.asked()), Ok(Some(gfid(1))));
        assert_eq!(leases.release_all().len(), FILE_LEASES_MAX);
        assert!(!leases.holds(&gfid(0)));
    }
}
