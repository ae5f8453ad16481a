//! Listings and small files fetched ahead.
//!
//! * **Listings, ahead of a walk.** When a listing shows the kernel subdirectories, the
//!   mount lists the first [`PREFETCH_SUBDIRS_MAX`] of them before anything opens them, each
//!   under a read lease, and keeps those listings ([`super::leases`]): the `find`, `ls -lR`,
//!   `du` or `rm -rf` that descends next opens them without a round trip while the mount
//!   fetches the next ones, instead of waiting for one round trip per directory in turn.
//!   The subdirectories past those wait ([`Later`]): each OPENDIR of one of them lists the
//!   next one ahead, so the walk keeps finding its next directories listed however many a
//!   directory holds, and an `ls` of a large directory lists no more than the first ahead.
//!   Only where a kept listing answers an OPENDIR: with leases, and with the kernel
//!   checking permissions itself.
//! * **Listings, ahead of lookups.** The second name the brick is asked about within
//!   [`MISSES_WINDOW`] in a directory whose entries the mount does not all know (held by no
//!   lease, or by one that has not listed it) lists that directory the same way
//!   ([`Shared::lookup_missed`]): a program looking many names up there without listing it
//!   (`git status`, `make`, a reader of a spool) finds the next ones answered from the
//!   listing kept (those asked while it is under way go to the brick, as before). A
//!   directory not kept (its listing takes more than one reply) is not listed for this again
//!   within [`RELIST_AFTER`].
//! * **Small files, ahead of a program reading a directory's files in the order it listed
//!   them** (`tar -c`, `cp -r`, `grep -r`). When a file's first read follows the one before
//!   in the directory's kept listing (or is its first file), the mount also fetches the next
//!   [`FILES_AHEAD_MAX`] small files there, each with one GET, so the program finds each next
//!   file's content waiting. A program reading in another order fetches nothing ahead.
//!   Only where the brick recalls the directory's read lease before another client changes
//!   a file the listing returned (`LISTED_ATTRS`): content fetched ahead is taken only while
//!   the mount still holds the lease it was fetched under and has changed nothing itself
//!   since, so it is what the brick holds when the file is opened (close-to-open).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kiln_wire::{Creds, DirEntryXattrs, FileType, Gfid};
use tokio::sync::{Semaphore, SetOnce, watch};

use super::handles::GET_AHEAD_BYTES;
use super::shared::Shared;
use crate::Layer;

/// Subdirectories of one listing fetched ahead before anything opens them; past those, one
/// more is as the walk opens one ([`Later`]). A kept listing may answer only within the
/// kernel's attribute lifetime where the brick lacks `LISTED_ATTRS` (`super::leases`): a
/// walk must reach these first.
pub(super) const PREFETCH_SUBDIRS_MAX: usize = 16;

/// Why directories are listed ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ahead {
    /// A listing showed them: not once the walk opened (or removed) them itself.
    OfWalk,
    /// Names in them were looked up ([`Shared::lookup_missed`]).
    OfLookups,
}

/// Subdirectories waiting to be listed ahead ([`Later`]), at most; past it they are
/// forgotten.
const LATER_MAX: usize = 65_536;

/// Names the brick is asked about in one directory whose entries the mount does not all
/// know, within [`MISSES_WINDOW`] of the first, that list the directory ahead.
const MISSES_BEFORE_LISTING: u32 = 2;
/// How close together those questions must come.
const MISSES_WINDOW: Duration = Duration::from_secs(1);
/// How long after a directory was listed for its lookups they may list it again.
const RELIST_AFTER: Duration = Duration::from_secs(10);
/// Directories whose questions are counted, at most; past it the counts start over.
const MISSED_DIRS_MAX: usize = 4096;

/// Listings the whole mount fetches ahead at once.
const PREFETCH_INFLIGHT_MAX: usize = 4;

/// Small files fetched ahead of the one a program reads, at most.
pub(super) const FILES_AHEAD_MAX: usize = 8;

/// Files fetched ahead and not read yet that the mount keeps, at most (the oldest go first):
/// each smaller than [`GET_AHEAD_BYTES`], 8 MiB in all.
const FILES_AHEAD_KEPT_MAX: usize = 4 * FILES_AHEAD_MAX;

/// The mount's listings and files fetched ahead.
#[derive(Debug)]
pub(super) struct Prefetch {
    inflight: Semaphore,
    later: Mutex<Later>,
    /// Each directory being listed ahead; its channel closes once the listing is kept (or
    /// failed, or the fetch was dropped).
    listing: Mutex<HashMap<Gfid, watch::Receiver<()>>>,
    files: Mutex<FilesAhead>,
    /// Directories whose entries the mount does not all know, and how many names the brick
    /// was asked about there since when.
    missed: Mutex<HashMap<Gfid, (u32, Instant)>>,
}

impl Default for Prefetch {
    fn default() -> Prefetch {
        Prefetch {
            inflight: Semaphore::new(PREFETCH_INFLIGHT_MAX),
            later: Mutex::default(),
            listing: Mutex::default(),
            files: Mutex::default(),
            missed: Mutex::default(),
        }
    }
}

/// Subdirectories shown by listings and not listed ahead yet: an OPENDIR of one shown in
/// the same directory lists the next of them ahead.
#[derive(Debug, Default)]
struct Later {
    /// By directory listed: its subdirectories (node and GFID) waiting, in listing order.
    by_dir: HashMap<Gfid, VecDeque<(u64, Gfid)>>,
    /// The directory each subdirectory shown (listed ahead or waiting) was shown in.
    shown_in: HashMap<Gfid, Gfid>,
}

impl Later {
    /// Notes `subdirs`, just shown in `dir`; those to list ahead now: the first
    /// [`PREFETCH_SUBDIRS_MAX`] not shown before, unless some of `dir`'s wait already.
    fn shown(&mut self, dir: Gfid, subdirs: Vec<(u64, Gfid)>) -> Vec<(u64, Gfid)> {
        if self.shown_in.len() + subdirs.len() > LATER_MAX {
            *self = Later::default();
        }
        // Those shown before (`rm -rf` lists each directory twice) are noted already.
        let subdirs: Vec<_> = (subdirs.into_iter())
            .filter(|(_, gfid)| self.shown_in.insert(*gfid, dir).is_none())
            .collect();
        let waiting = self.by_dir.entry(dir).or_default();
        let now = if waiting.is_empty() {
            subdirs.len().min(PREFETCH_SUBDIRS_MAX)
        } else {
            0
        };
        let mut subdirs = subdirs.into_iter();
        let ahead: Vec<_> = subdirs.by_ref().take(now).collect();
        waiting.extend(subdirs);
        if waiting.is_empty() {
            self.by_dir.remove(&dir);
        }
        ahead
    }

    /// Whether subdirectory `gfid`, shown by a listing, is still to be opened by a walk: a
    /// fetch ahead the walk overtook (it opened the directory, or removed it, first) is not
    /// made.
    fn unopened(&self, gfid: &Gfid) -> bool {
        self.shown_in.contains_key(gfid)
    }

    /// A walk opens `gfid`: the next subdirectory waiting where it was shown, if any.
    fn opened(&mut self, gfid: &Gfid) -> Option<(u64, Gfid)> {
        let dir = self.shown_in.remove(gfid)?;
        let waiting = self.by_dir.get_mut(&dir)?;
        let next = waiting.pop_front();
        if waiting.is_empty() {
            self.by_dir.remove(&dir);
        }
        next
    }
}

/// The content of a file fetched ahead, set once its GET is answered (`None`: it failed).
type FileSlot = Arc<SetOnce<Option<FileAhead>>>;

/// Files fetched ahead, by GFID, until a read takes them.
#[derive(Debug, Default)]
struct FilesAhead {
    slots: HashMap<Gfid, FileSlot>,
    /// The GFIDs in `slots`, oldest first.
    order: VecDeque<Gfid>,
    /// The files of the last first reads, oldest first: never fetched ahead again.
    read: VecDeque<Gfid>,
    /// The directory and file of the last first read.
    last: Option<(Gfid, Gfid)>,
    /// The mount's change count at the last first read.
    changes_seen: u64,
}

impl FilesAhead {
    /// Notes the first read of `file`, listed in `dir` after `previous` (the file before it
    /// there, if any): whether it follows the last first read in the listing's order.
    fn read_after(&mut self, dir: Gfid, previous: Option<Gfid>, file: Gfid) -> bool {
        let in_order = previous.is_none_or(|p| self.last == Some((dir, p)));
        self.last = Some((dir, file));
        if self.read.len() >= FILES_AHEAD_KEPT_MAX {
            self.read.pop_front();
        }
        self.read.push_back(file);
        in_order
    }

    /// Whether the mount changed nothing since the last first read (at `changes` now): a
    /// program that writes through the mount between its reads (`cp -r` within it) would
    /// find what was fetched for it stale.
    fn quiet(&mut self, changes: u64) -> bool {
        std::mem::replace(&mut self.changes_seen, changes) == changes
    }

    /// A new slot for `gfid`'s content; `None` when it is fetched or read already.
    fn start(&mut self, gfid: Gfid) -> Option<FileSlot> {
        if self.slots.contains_key(&gfid) || self.read.contains(&gfid) {
            return None;
        }
        while self.order.len() >= FILES_AHEAD_KEPT_MAX {
            if let Some(oldest) = self.order.pop_front() {
                self.slots.remove(&oldest);
            }
        }
        let slot = FileSlot::default();
        self.slots.insert(gfid, slot.clone());
        self.order.push_back(gfid);
        Some(slot)
    }

    fn take(&mut self, gfid: &Gfid) -> Option<FileSlot> {
        let slot = self.slots.remove(gfid)?;
        self.order.retain(|g| g != gfid);
        Some(slot)
    }
}

/// A whole small file's content, and what it is valid under.
#[derive(Debug)]
struct FileAhead {
    data: Bytes,
    /// The directory whose read lease it was fetched under, and that hold's generation.
    dir: Gfid,
    generation: u64,
    /// The mount's change count when it was asked.
    changes: u64,
}

impl Prefetch {
    /// Waits until directory `gfid` is no longer being listed ahead: an OPENDIR that overtook
    /// its walk's prefetch takes the listing kept instead of asking for it again.
    pub(super) async fn wait_for(&self, gfid: &Gfid) {
        let listing = self.lock().get(gfid).cloned();
        if let Some(mut listing) = listing {
            // Nothing is ever sent: this returns when the fetch's sender goes.
            let _ = listing.changed().await;
        }
    }

    /// Counts a question to the brick about a name in directory `dir` (whose entries the
    /// mount does not all know) at `now`; whether it is the one that lists `dir` ahead.
    fn missed(&self, dir: Gfid, now: Instant) -> bool {
        let mut missed = self.missed.lock().unwrap_or_else(|p| p.into_inner());
        if missed.len() >= MISSED_DIRS_MAX {
            missed.clear();
        }
        let (count, since) = missed.entry(dir).or_insert((0, now));
        let listed = *count >= MISSES_BEFORE_LISTING;
        let over = now.duration_since(*since);
        if (!listed && over > MISSES_WINDOW) || (listed && over > RELIST_AFTER) {
            (*count, *since) = (0, now);
        }
        *count += 1;
        *count == MISSES_BEFORE_LISTING
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Gfid, watch::Receiver<()>>> {
        self.listing.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<L: Layer> Shared<L> {
    /// Whether this mount fetches listings ahead.
    pub(super) fn prefetches(&self) -> bool {
        self.options.listing_prefetch && self.options.default_permissions && self.uses_leases()
    }

    /// Whether this mount fetches small files ahead: as it fetches listings, where the brick
    /// recalls a listing's lease before another client changes what it returned.
    pub(super) fn reads_files_ahead(&self) -> bool {
        self.options.file_prefetch
            && self.prefetches()
            && self.options.listed_attrs
            && self.layer.listed_attrs()
    }

    /// At the first read of node `ino` by `c`: when it follows, in the kept listing of the
    /// directory the kernel listed it in, the file whose first read came before (or is the
    /// listing's first), fetches as `c` the next small files there not fetched or read yet.
    pub(super) fn read_files_ahead(self: &Arc<Self>, c: &Creds, ino: u64) {
        if !self.reads_files_ahead() {
            return;
        }
        let (Some(dir), Some(gfid)) = (self.inodes.listed_in(ino), self.inodes.gfid(ino)) else {
            return;
        };
        let (Some(generation), changes) = (self.leases.generation(&dir), self.leases.changes())
        else {
            return;
        };
        let Some(listing) = self.kept_listing(&dir) else {
            return;
        };
        let Some(at) = listing.position(&gfid) else {
            return;
        };
        let listing = &listing.entries;
        let is_file = |e: &&DirEntryXattrs| e.iatt.file_type == FileType::Regular;
        let previous = listing[..at]
            .iter()
            .rev()
            .find(is_file)
            .map(|e| e.iatt.gfid);
        let slots: Vec<(Gfid, FileSlot)> = {
            let mut files = self.files_ahead();
            let in_order = files.read_after(dir, previous, gfid);
            if !files.quiet(changes) || !in_order {
                return;
            }
            listing[at + 1..]
                .iter()
                .filter(is_file)
                .filter(|e| (1..u64::from(GET_AHEAD_BYTES)).contains(&e.iatt.size))
                .take(FILES_AHEAD_MAX)
                .filter_map(|e| Some((e.iatt.gfid, files.start(e.iatt.gfid)?)))
                .collect()
        };
        for (file, slot) in slots {
            let (s, c) = (self.clone(), c.clone());
            tokio::spawn(async move {
                let data = s.get_whole(&c, file).await;
                let ahead = data.map(|data| FileAhead {
                    data,
                    dir,
                    generation,
                    changes,
                });
                let _ = slot.set(ahead);
            });
        }
    }

    /// The whole content of small file `gfid` as `c` reads it: one GET of
    /// [`GET_AHEAD_BYTES`] that returns less. `None` if the brick refused or the file is not
    /// small.
    async fn get_whole(&self, c: &Creds, gfid: Gfid) -> Option<Bytes> {
        let data = self.get(c, gfid, GET_AHEAD_BYTES).await.ok()?;
        (data.len() < GET_AHEAD_BYTES as usize).then_some(data)
    }

    /// The whole content of small file `gfid` fetched ahead (waiting for its GET if it is
    /// under way), if it is still what the brick holds: the mount holds the read lease it
    /// was fetched under and has changed nothing since it was asked.
    pub(super) async fn file_ahead(&self, gfid: &Gfid) -> Option<Bytes> {
        let slot = self.files_ahead().take(gfid)?;
        let ahead = slot.wait().await.as_ref()?;
        let held = self.leases.generation(&ahead.dir) == Some(ahead.generation);
        (held && self.leases.changes() == ahead.changes).then(|| ahead.data.clone())
    }

    fn files_ahead(&self) -> std::sync::MutexGuard<'_, FilesAhead> {
        self.prefetch
            .files
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Subdirectories `subdirs` (node and GFID) were just shown to the kernel in directory
    /// `dir`, as `c`: lists the first of them ahead, and notes the rest for later
    /// ([`Later`]).
    pub(super) fn subdirs_shown(self: &Arc<Self>, c: &Creds, dir: Gfid, subdirs: Vec<(u64, Gfid)>) {
        let ahead = self.later().shown(dir, subdirs);
        if !ahead.is_empty() {
            tokio::spawn(
                self.clone()
                    .prefetch_listings(c.clone(), ahead, Ahead::OfWalk),
            );
        }
    }

    /// The brick is about to be asked, as `c`, about a name in directory node `ino` (`dir`):
    /// where the mount does not know all its entries, the second such question within
    /// [`MISSES_WINDOW`] lists `dir` ahead.
    pub(super) fn lookup_missed(self: &Arc<Self>, c: &Creds, ino: u64, dir: Gfid) {
        if !self.prefetches()
            || self.leases.knows_all(&dir)
            || !self.prefetch.missed(dir, Instant::now())
        {
            return;
        }
        let listing = self
            .clone()
            .prefetch_listings(c.clone(), vec![(ino, dir)], Ahead::OfLookups);
        tokio::spawn(listing);
    }

    /// A walk opens directory node `ino`, as `c`: lists ahead the next subdirectory waiting
    /// where it was shown.
    pub(super) fn walk_opens(self: &Arc<Self>, c: &Creds, ino: u64) {
        let Some(gfid) = self.inodes.gfid(ino) else {
            return;
        };
        if let Some(next) = self.later().opened(&gfid) {
            let listing = self
                .clone()
                .prefetch_listings(c.clone(), vec![next], Ahead::OfWalk);
            tokio::spawn(listing);
        }
    }

    fn later(&self) -> std::sync::MutexGuard<'_, Later> {
        self.prefetch
            .later
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Lists directories `dirs` (node and GFID) as `c`, one after the other, and keeps each
    /// listing; a failure only means nothing is kept. Changes through the mount meanwhile
    /// drop only the listings that show what they change: an `rm -rf` finds the next
    /// directories' listings kept while it empties one.
    async fn prefetch_listings(self: Arc<Self>, c: Creds, dirs: Vec<(u64, Gfid)>, why: Ahead) {
        for (ino, gfid) in dirs {
            let Ok(_turn) = self.prefetch.inflight.acquire().await else {
                return;
            };
            if why == Ahead::OfWalk && !self.later().unopened(&gfid) {
                continue;
            }
            // Kept until the listing is: an OPENDIR of the directory waits for it to go.
            let (_listing, listing) = watch::channel(());
            {
                let mut being_listed = self.prefetch.lock();
                let kept = self.kept_listing(&gfid);
                if kept.is_some() || being_listed.contains_key(&gfid) {
                    continue;
                }
                being_listed.insert(gfid, listing);
            }
            if let Err(errno) = self.list_below(&c, ino, gfid).await {
                tracing::debug!(%gfid, ?errno, "a listing fetched ahead failed");
            }
            self.prefetch.lock().remove(&gfid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gfid(n: u16) -> Gfid {
        let mut bytes = [0; 16];
        bytes[14..].copy_from_slice(&n.to_be_bytes());
        bytes[0] = 1;
        Gfid::from_bytes(bytes).expect("a non-null gfid")
    }

    fn subdirs(range: std::ops::Range<u16>) -> Vec<(u64, Gfid)> {
        range.map(|n| (u64::from(n), gfid(n))).collect()
    }

    #[test]
    fn a_walk_opening_subdirectories_lists_the_next_ones_ahead() {
        let mut later = Later::default();
        let (dir, other) = (gfid(1000), gfid(2000));
        let max = PREFETCH_SUBDIRS_MAX as u16;
        // The first ones go at once, the rest wait, in order.
        let now = later.shown(dir, subdirs(0..max + 3));
        assert_eq!(now, subdirs(0..max));
        // Shown again (a second listing, a later reply): nothing new goes or waits twice.
        assert!(later.shown(dir, subdirs(0..max + 3)).is_empty());
        assert_eq!(later.by_dir[&dir].len(), 3);
        // A later reply of the same listing waits behind what waits already.
        assert!(later.shown(dir, subdirs(max + 3..max + 5)).is_empty());
        // Each opened subdirectory shown there lists the next one waiting, once; one the
        // walk opened is not fetched ahead any more.
        assert!(later.unopened(&gfid(0)) && later.unopened(&gfid(max)));
        assert_eq!(later.opened(&gfid(0)), Some((u64::from(max), gfid(max))));
        assert!(!later.unopened(&gfid(0)) && later.unopened(&gfid(max)));
        assert_eq!(later.opened(&gfid(0)), None, "opened before");
        assert_eq!(later.opened(&gfid(5000)), None, "shown nowhere");
        for n in 1..5 {
            assert_eq!(later.opened(&gfid(n)).map(|(_, g)| g), Some(gfid(max + n)));
        }
        assert_eq!(later.opened(&gfid(6)), None, "none left");
        assert!(later.by_dir.is_empty());
        // Another directory's subdirectories go at once while none of its own wait.
        assert_eq!(later.shown(other, subdirs(3000..3002)).len(), 2);
    }
}
