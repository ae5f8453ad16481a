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

use std::collections::HashSet;
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
    /// Each file held.
    held: lru::LruCache<Gfid, Held>,
    /// Files whose lease the brick refused, and when.
    refused: lru::LruCache<Gfid, Instant>,
    /// Files whose recall came and whose lease is not back yet: the brick still counts the
    /// lease as this mount's, and would answer an ask with it, but it is about to go.
    recalling: HashSet<Gfid>,
    /// File recalls seen so far.
    recalls: u64,
    /// Grants taken so far.
    grants: u64,
}

/// A lease the mount holds on a file.
#[derive(Debug)]
struct Held {
    /// Which grant it is (the number of grants taken before it): attributes asked under an
    /// earlier one of the same file, given back since, are not this one's.
    grant: u64,
    /// The attributes the brick gave under the lease and the mark of the changes through the
    /// mount they are as of, if noted.
    attrs: Option<(Iatt, ChangeMark)>,
}

impl Default for FileLeases {
    fn default() -> FileLeases {
        let capacity = |n| NonZeroUsize::new(n).expect("not zero");
        FileLeases {
            state: Mutex::new(State {
                held: lru::LruCache::new(capacity(FILE_LEASES_MAX)),
                refused: lru::LruCache::new(capacity(REFUSED_MAX)),
                recalling: HashSet::new(),
                recalls: 0,
                grants: 0,
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

    /// Whether a lease on `gfid` may be asked now: not while its recall is answered, nor
    /// within [`REFUSED_FOR`] of a refusal.
    pub(super) fn may_ask(&self, gfid: &Gfid) -> bool {
        let mut state = self.lock();
        if state.recalling.contains(gfid) {
            return false;
        }
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

    /// Notes a lease about to be asked: the mark its grant is taken with.
    pub(super) fn asked(&self) -> u64 {
        self.lock().recalls
    }

    /// Takes the grant of a read lease on `gfid` asked at mark `asked`: `Err(())` when a
    /// recall came since (the grant must go back); else which grant it is, and the file the
    /// mount lets go of to make room, if any, whose lease goes back.
    pub(super) fn take(&self, gfid: Gfid, asked: u64) -> Result<(u64, Option<Gfid>), ()> {
        let mut state = self.lock();
        if state.recalls != asked {
            return Err(());
        }
        let grant = state.grants;
        state.grants += 1;
        let pushed = state.held.push(gfid, Held { grant, attrs: None });
        Ok((
            grant,
            pushed.map(|(evicted, _)| evicted).filter(|e| *e != gfid),
        ))
    }

    /// Which grant the mount holds file `gfid` under, if any (the file then counts as
    /// lately opened).
    pub(super) fn grant_of(&self, gfid: &Gfid) -> Option<u64> {
        self.lock().held.get(gfid).map(|held| held.grant)
    }

    /// Notes `iatt`, the brick's attributes of file `gfid` asked under grant `grant`, as of
    /// `mark` (every change made through the mount before it had been answered when they
    /// were asked) — if the file is still held under that grant: a recall takes the lease
    /// away, and the attributes may predate the change it was for.
    pub(super) fn note_attrs(&self, gfid: &Gfid, grant: u64, iatt: Iatt, mark: ChangeMark) {
        if let Some(held) = self.lock().held.peek_mut(gfid)
            && held.grant == grant
        {
            held.attrs = Some((iatt, mark));
        }
    }

    /// The attributes noted of held file `gfid` and the mark they are as of.
    pub(super) fn attrs(&self, gfid: &Gfid) -> Option<(Iatt, ChangeMark)> {
        self.lock()
            .held
            .peek(gfid)
            .and_then(|held| held.attrs.clone())
    }

    /// A recall of `gfid` came: a grant asked before is not taken; whether the mount held it
    /// (then [`FileLeases::given_back`] follows).
    pub(super) fn recalled(&self, gfid: &Gfid) -> bool {
        let mut state = self.lock();
        state.recalls += 1;
        let held = state.held.pop(gfid).is_some();
        if held {
            state.recalling.insert(*gfid);
        }
        held
    }

    /// The recalled lease on `gfid` went back. A grant asked before is not taken either: the
    /// brick answers an ask with the lease it still counts as this mount's, the one that went.
    pub(super) fn given_back(&self, gfid: &Gfid) {
        let mut state = self.lock();
        state.recalls += 1;
        state.recalling.remove(gfid);
    }

    /// Forgets the lease on `gfid` (to be given back); whether the mount held one.
    pub(super) fn forget(&self, gfid: &Gfid) -> bool {
        self.lock().held.pop(gfid).is_some()
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
        assert_eq!(leases.take(gfid(1), asked), Ok((0, None)));
        assert!(leases.holds(&gfid(1)));
        let asked = leases.asked();
        assert!(!leases.recalled(&gfid(2)), "not held");
        assert_eq!(leases.take(gfid(2), asked), Err(()), "a recall overtook it");
        assert!(leases.recalled(&gfid(1)));
        assert!(!leases.holds(&gfid(1)));
    }

    #[test]
    fn no_grant_is_taken_while_a_recalled_lease_goes_back() {
        let leases = FileLeases::default();
        assert!(leases.take(gfid(1), leases.asked()).is_ok());
        assert!(leases.recalled(&gfid(1)));
        assert!(!leases.may_ask(&gfid(1)), "its recall is being answered");
        // Asked anyway, the brick would answer with the lease about to go.
        let asked = leases.asked();
        leases.given_back(&gfid(1));
        assert_eq!(leases.take(gfid(1), asked), Err(()));
        assert!(!leases.holds(&gfid(1)));
        assert!(leases.may_ask(&gfid(1)), "back: the brick decides");
        assert!(leases.take(gfid(1), leases.asked()).is_ok());
    }

    #[test]
    fn attributes_are_noted_under_the_grant_they_were_asked_under() {
        let leases = FileLeases::default();
        let iatt =
            super::super::leases::new_iatt(gfid(1), kiln_wire::FileType::Regular, 0o644, 0, 0, 0);
        let mark = crate::mount::inodes::Inodes::new().change_mark();
        let (first, _) = leases.take(gfid(1), leases.asked()).expect("taken");
        assert_eq!(leases.grant_of(&gfid(1)), Some(first));
        leases.note_attrs(&gfid(1), first, iatt.clone(), mark);
        assert!(leases.attrs(&gfid(1)).is_some());
        // Recalled and taken again: attributes asked under the first grant are not noted.
        assert!(leases.recalled(&gfid(1)));
        assert_eq!(leases.grant_of(&gfid(1)), None);
        let (second, _) = leases.take(gfid(1), leases.asked()).expect("taken");
        leases.note_attrs(&gfid(1), first, iatt.clone(), mark);
        assert!(leases.attrs(&gfid(1)).is_none());
        leases.note_attrs(&gfid(1), second, iatt, mark);
        assert!(leases.attrs(&gfid(1)).is_some());
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
        let evicted = |n| {
            leases
                .take(gfid(n), leases.asked())
                .map(|(_, evicted)| evicted)
        };
        for n in 0..FILE_LEASES_MAX as u32 {
            assert_eq!(evicted(n), Ok(None));
        }
        assert!(leases.holds(&gfid(0)), "opened again: now the latest");
        assert_eq!(evicted(0), Ok(None), "held already");
        let next = FILE_LEASES_MAX as u32;
        assert_eq!(evicted(next), Ok(Some(gfid(1))));
        assert_eq!(leases.release_all().len(), FILE_LEASES_MAX);
        assert!(!leases.holds(&gfid(0)));
    }
}
