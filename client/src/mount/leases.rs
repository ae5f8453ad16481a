//! The directories this mount holds a lease on, and what it knows of them.
//!
//! * A **write** lease on a directory the mount made itself (MKDIR, with LEASE in the same
//!   batch) comes with every entry known: the brick recalls the lease before any other client
//!   may look inside. A directory the mount lists gets a **read** lease (asked with the
//!   OPENDIR_LIST that opens it, which takes it before it reads the first entries), and its
//!   entries are known once a listing from the start reaches the end with
//!   the lease still held. A change made here in a directory not held for writing (listed
//!   or not) asks for the write lease with it ([`Leases::asks_write`]).
//! * Where the entries are not all known, the names the brick answered under the lease are
//!   ([`Leases::learn`]): an absence, or a file's name, stays true until the lease goes,
//!   as no other client may change the directory without its recall.
//! * Where the entries are known the mount answers LOOKUP itself (a name it does not have
//!   does not exist). Under a write lease it also makes and removes names itself, queueing
//!   the changes behind ([`super::behind`]). The objects made there are described here
//!   ([`Local`]) until the brick has answered the changes to them; a held directory itself
//!   is described for as long as it is held (another client's change to it, or a look at
//!   it under a write lease, is recalled first), so its attributes cost no round trip.
//! * A held directory's last whole listing from the start is kept ([`Leases::keep_listing`])
//!   to answer the next one without the brick (GNU `rm -rf` lists every directory twice; a
//!   `find` then an `ls -lR` of a tree lists every directory again), and the LOOKUPs and
//!   GETATTRs of what it lists, until a change through the mount to the directory or to an
//!   object it lists ([`Leases::note_change`]; an `rm -rf` emptying one directory keeps the
//!   listings of the next ones, fetched ahead). Where the brick's
//!   lease covers the attributes its listings returned (capability `LISTED_ATTRS`: another
//!   client's change to one of those objects recalls it) it is kept until the lease goes;
//!   otherwise, and where it lists a file with several names (whose link count a removal
//!   elsewhere changes without touching this directory), for as long as the kernel would
//!   keep its entries' attributes itself.
//! * A recall, a refused lease or a lost session ends a directory's hold: its entries, its
//!   kept listing and the descriptions of its objects are forgotten, and fops there go to
//!   the brick again (after the changes queued before them).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use kiln_wire::{DirEntryXattrs, FileType, Gfid, Iatt, LeaseKind, Mode, Name, Timespec};

/// An object made under a lease, as the mount describes it until the brick does.
#[derive(Debug, Clone)]
pub(super) struct Local {
    pub(super) iatt: Iatt,
}

#[derive(Debug)]
struct Held {
    kind: LeaseKind,
    /// Entries of the directory: all of them when `complete`, else those learned.
    entries: HashMap<Name, Gfid>,
    complete: bool,
    /// While not `complete`: names known free (the brick answered "none" under the lease, or
    /// the mount removed them); at most [`LEARNED_NAMES_MAX`].
    absent: HashSet<Name>,
    /// A name removed here was not noted in `absent` (past its bound): a name not known may
    /// have changes queued, so the brick is asked about it only after them.
    unnoted: bool,
    /// While not `complete`: the names changed here, each with the generation it moved the
    /// hold to, for a listing under way to count them in ([`Leases::listed`]); every change
    /// past generation `logged_after` is there. At most [`CHANGED_NAMES_MAX`].
    changed_names: VecDeque<(u64, Name)>,
    logged_after: u64,
    /// Moves on (to a number no hold had before) with every change to `entries` or the
    /// directory's description: a listing that began before one does not make the entries
    /// complete.
    generation: u64,
    /// Names the kernel was told of besides `entries` (an entry or an absence the brick
    /// answered, or an absence the lease did), to be dropped from its cache when the lease
    /// goes; at most [`TOLD_NAMES_MAX`].
    told: HashSet<Name>,
    /// The last whole listing, to answer the next one.
    listing: Option<Kept>,
}

impl Held {
    fn new(kind: LeaseKind, complete: bool, generation: u64) -> Held {
        Held {
            kind,
            entries: HashMap::new(),
            complete,
            absent: HashSet::new(),
            unnoted: false,
            changed_names: VecDeque::new(),
            logged_after: generation,
            generation,
            told: HashSet::new(),
            listing: None,
        }
    }

    /// Whether one more learned name may be noted (entries not all known, room left).
    fn may_learn(&self) -> bool {
        !self.complete && self.entries.len() + self.absent.len() < LEARNED_NAMES_MAX
    }

    /// Notes that `name` changed here at the hold's generation, while the entries are not
    /// all known.
    fn log_change(&mut self, name: &Name) {
        if self.complete {
            return;
        }
        if self.changed_names.len() >= CHANGED_NAMES_MAX
            && let Some((dropped, _)) = self.changed_names.pop_front()
        {
            self.logged_after = dropped;
        }
        self.changed_names
            .push_back((self.generation, name.clone()));
    }

    /// The entries a listing that began at `generation` found (`listed`), with the changes
    /// made here since counted in; `None` when one of them cannot be (not logged, or the
    /// name is not known now).
    fn entries_since(
        &self,
        generation: u64,
        listed: Vec<(Name, Gfid)>,
    ) -> Option<HashMap<Name, Gfid>> {
        let mut entries: HashMap<Name, Gfid> = listed.into_iter().collect();
        if self.generation == generation {
            return Some(entries);
        }
        if generation < self.logged_after {
            return None;
        }
        let since = self.changed_names.iter().filter(|(g, _)| *g > generation);
        for (_, name) in since {
            match self.entries.get(name) {
                Some(gfid) => entries.insert(name.clone(), *gfid),
                None if self.absent.contains(name) => entries.remove(name),
                None => return None,
            };
        }
        Some(entries)
    }

    /// The entries are all known from now on.
    fn make_complete(&mut self, entries: HashMap<Name, Gfid>) {
        let before = std::mem::replace(&mut self.entries, entries);
        // Names the kernel may have cached and the listing did not show stay noted.
        let gone = before.into_keys().filter(|n| !self.entries.contains_key(n));
        self.told.extend(gone);
        self.complete = true;
        self.absent = HashSet::new();
        self.changed_names = VecDeque::new();
    }
}

/// Where a listing of a held directory began: what must not have moved when it ends for it
/// to be kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Mark {
    generation: u64,
    changes: u64,
    at: Instant,
}

/// A whole listing of a held directory, as the brick gave it.
#[derive(Debug)]
struct Kept {
    began: Mark,
    listing: Arc<KeptListing>,
    /// It lists a file with more than one name.
    linked: bool,
}

/// The entries of a kept listing, and where each object is among them.
#[derive(Debug)]
pub(super) struct KeptListing {
    pub(super) entries: Arc<[DirEntryXattrs]>,
    /// Where each GFID first is in `entries`: found at the first question, not scanned for
    /// at every one (a directory may list many files).
    by_gfid: OnceLock<HashMap<Gfid, usize>>,
}

impl KeptListing {
    fn new(entries: Arc<[DirEntryXattrs]>) -> KeptListing {
        KeptListing {
            entries,
            by_gfid: OnceLock::new(),
        }
    }

    /// Where `gfid` first is in the listing.
    pub(super) fn position(&self, gfid: &Gfid) -> Option<usize> {
        let by_gfid = self.by_gfid.get_or_init(|| {
            let mut at = HashMap::with_capacity(self.entries.len());
            for (i, e) in self.entries.iter().enumerate() {
                at.entry(e.iatt.gfid).or_insert(i);
            }
            at
        });
        by_gfid.get(gfid).copied()
    }

    /// The entry of `gfid`.
    pub(super) fn entry(&self, gfid: &Gfid) -> Option<&DirEntryXattrs> {
        self.entries.get(self.position(gfid)?)
    }
}

#[derive(Debug, Default)]
struct State {
    dirs: HashMap<Gfid, Held>,
    local: HashMap<Gfid, Local>,
    /// Directories by the number of their last recall: a grant whose reply comes after a
    /// recall of its directory (they travel on different streams) must not be taken, held
    /// or not when the recall came (a listing asked twice at once got two grants).
    recalled: HashMap<Gfid, u64>,
    /// Recalls seen so far.
    recalls: u64,
    /// Directories a write lease was last asked for, and when: not asked again within
    /// [`WRITE_ASK_INTERVAL`] (the brick refuses while another client holds or lately
    /// recalled a lease there).
    write_asked: HashMap<Gfid, Instant>,
    /// The first recall `recalled` still knows of (earlier ones were dropped at its bound).
    recalled_since: u64,
    /// The last generation given to a hold.
    last_generation: u64,
    /// Kept listings, oldest first, by directory, the generation they were kept at and
    /// their length.
    kept: VecDeque<(Gfid, u64, usize)>,
    /// The lengths in `kept` (an entry for each listing, one for each of its entries): at
    /// most [`LISTED_ENTRIES_KEPT_MAX`].
    kept_entries: usize,
    /// Each object a kept listing shows (one without a file of several names) and the
    /// directory listed: a change noted to the object drops that listing.
    listed_by: HashMap<Gfid, Gfid>,
    /// The last objects noted changed (`None`: anything), by the change count that noted
    /// them, oldest first: what a listing under way must not show to be kept. At most
    /// [`RECENT_CHANGES_MAX`].
    recent: VecDeque<(u64, Option<Gfid>)>,
    /// The first change count whose objects `recent` holds whole (earlier ones were dropped
    /// at its bound).
    recent_from: u64,
}

impl State {
    fn next_generation(&mut self) -> u64 {
        self.last_generation += 1;
        self.last_generation
    }

    /// Whether nothing noted changed since change count `since` was `dir` or (when given) an
    /// object `listing` shows.
    fn untouched_since(&self, since: u64, dir: &Gfid, listing: Option<&KeptListing>) -> bool {
        let shown = |g: &Gfid| g == dir || listing.is_some_and(|l| l.position(g).is_some());
        since + 1 >= self.recent_from
            && (self.recent.iter().rev())
                .take_while(|(count, _)| *count > since)
                .all(|(_, g)| g.as_ref().is_some_and(|g| !shown(g)))
    }

    /// Remembers that change `count` may have changed `object` (`None`: anything).
    fn log_change(&mut self, count: u64, object: Option<Gfid>) {
        if self.recent.len() >= RECENT_CHANGES_MAX
            && let Some((dropped, _)) = self.recent.pop_front()
        {
            self.recent_from = dropped + 1;
        }
        self.recent.push_back((count, object));
    }

    /// Drops the listing kept of `dir`, if there is one (its length stays counted in
    /// `kept_entries` until its turn in `kept` comes).
    fn drop_listing(&mut self, dir: &Gfid) {
        let Some(kept) = self.dirs.get_mut(dir).and_then(|held| held.listing.take()) else {
            return;
        };
        if !kept.linked {
            for e in kept.listing.entries.iter() {
                if self.listed_by.get(&e.iatt.gfid) == Some(dir) {
                    self.listed_by.remove(&e.iatt.gfid);
                }
            }
        }
    }

    /// Drops every kept listing.
    fn drop_listings(&mut self) {
        for held in self.dirs.values_mut() {
            held.listing = None;
        }
        self.listed_by.clear();
        self.kept.clear();
        self.kept_entries = 0;
    }

    /// Moves held directory `dir`'s generation on; its hold, if there is one.
    fn changed(&mut self, dir: &Gfid) -> Option<&mut Held> {
        let generation = self.next_generation();
        let held = self.dirs.get_mut(dir)?;
        held.generation = generation;
        Some(held)
    }
}

/// Recalled directories remembered at most; past it they are forgotten, and every grant
/// asked before is refused.
const RECALLED_MAX: usize = 4096;
/// Names per held directory the kernel may cache besides the entries the lease knows; past
/// it, answers there are given uncached.
const TOLD_NAMES_MAX: usize = 4096;
/// Names a hold whose entries are not all known learns at most (entries and absences); past
/// it, the brick is asked about the others.
const LEARNED_NAMES_MAX: usize = 16_384;
/// Names changed here logged per hold whose entries are not all known; past it a listing
/// that began before the oldest does not complete them.
const CHANGED_NAMES_MAX: usize = 1024;
/// How long after asking for a directory's write lease the mount does not ask again.
const WRITE_ASK_INTERVAL: Duration = Duration::from_secs(1);
/// Directories `write_asked` remembers before the old asks are swept out.
const WRITE_ASKED_MAX: usize = 4096;
/// Entries of kept listings (each listing counting one more); past it the oldest listings are
/// dropped, and a longer listing is not kept. At an estimated ~250 bytes an entry, ~32 MiB at
/// most.
pub(super) const LISTED_ENTRIES_KEPT_MAX: usize = 131_072;
/// Objects noted changed that are remembered for the listings under way; a listing that
/// began before the oldest is not kept.
const RECENT_CHANGES_MAX: usize = 4096;

/// What a held directory says about a name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Answer {
    /// The entries are not known: ask the brick.
    Unknown,
    /// No such entry.
    Absent,
    /// The entry's object.
    Present(Gfid),
}

#[derive(Debug, Default)]
pub(super) struct Leases {
    state: Mutex<State>,
    /// Counts the fops through the mount that may change an object: a handle's read-ahead,
    /// and a kept listing that shows a file of several names, are answered only while it has
    /// not moved. Moved under the lock; read outside it: every write and every read looks at
    /// it.
    changes: AtomicU64,
}

impl Leases {
    /// Whether the mount holds `dir`'s write lease (it may change the entries itself).
    pub(super) fn holds(&self, dir: &Gfid) -> bool {
        self.lock()
            .dirs
            .get(dir)
            .is_some_and(|held| held.kind == LeaseKind::Write)
    }

    /// Whether the mount holds any lease on `dir`.
    pub(super) fn has_lease(&self, dir: &Gfid) -> bool {
        self.lock().dirs.contains_key(dir)
    }

    /// Whether a change made here in `dir` should ask for its write lease: not held for
    /// writing, and not asked within [`WRITE_ASK_INTERVAL`] (noted as asked now).
    pub(super) fn asks_write(&self, dir: &Gfid) -> bool {
        let mut state = self.lock();
        if state
            .dirs
            .get(dir)
            .is_some_and(|h| h.kind == LeaseKind::Write)
        {
            return false;
        }
        let now = Instant::now();
        let recent = |at: &Instant| now.duration_since(*at) < WRITE_ASK_INTERVAL;
        if state.write_asked.get(dir).is_some_and(recent) {
            return false;
        }
        if state.write_asked.len() >= WRITE_ASKED_MAX {
            state.write_asked.retain(|_, at| recent(at));
        }
        state.write_asked.insert(*dir, now);
        true
    }

    /// Whether the brick may be asked about a name held directory `dir` does not know
    /// before the changes queued there are sent: every name they change is known (made or
    /// removed here), so none is this one.
    pub(super) fn asks_before_queued(&self, dir: &Gfid) -> bool {
        let state = self.lock();
        state
            .dirs
            .get(dir)
            .is_some_and(|held| !held.complete && !held.unnoted)
    }

    /// Whether the mount holds a lease on `dir` and knows all its entries.
    pub(super) fn knows_all(&self, dir: &Gfid) -> bool {
        self.lock().dirs.get(dir).is_some_and(|held| held.complete)
    }

    /// Starts holding `dir`'s write lease; it has no entries (the mount just made it).
    pub(super) fn hold_new(&self, dir: Gfid) {
        let mut state = self.lock();
        let held = Held::new(LeaseKind::Write, true, state.next_generation());
        state.dirs.insert(dir, held);
    }

    /// Starts holding a read lease on `dir`, its entries not known yet.
    pub(super) fn hold_read(&self, dir: Gfid) {
        let mut state = self.lock();
        if !state.dirs.contains_key(&dir) {
            let held = Held::new(LeaseKind::Read, false, state.next_generation());
            state.dirs.insert(dir, held);
        }
    }

    /// The write lease was granted on `dir`, an existing directory: held for reading, it is
    /// held for writing now, with what it knew; else held with its entries not known.
    pub(super) fn hold_write(&self, dir: Gfid) {
        let mut state = self.lock();
        match state.dirs.get_mut(&dir) {
            Some(held) => held.kind = LeaseKind::Write,
            None => {
                let held = Held::new(LeaseKind::Write, false, state.next_generation());
                state.dirs.insert(dir, held);
            }
        }
    }

    /// The brick answered `name` in `dir` with `found` (`None`: no such name) to a question
    /// asked at hold generation `generation`: noted if the hold has not changed since and
    /// does not know all its entries. A directory found is not noted (its removal needs to
    /// know it empty, a rename over it too).
    pub(super) fn learn(&self, dir: &Gfid, generation: u64, name: &Name, found: Option<Gfid>) {
        let mut state = self.lock();
        let Some(held) = state.dirs.get_mut(dir) else {
            return;
        };
        if held.generation != generation || !held.may_learn() {
            return;
        }
        match found {
            Some(gfid) => {
                held.entries.insert(name.clone(), gfid);
            }
            None => {
                held.absent.insert(name.clone());
            }
        }
    }

    /// The generation a listing of `dir` that began at `mark` completes the entries at
    /// ([`Leases::listed`]): `None` unless the mount holds a lease on `dir` and does not know
    /// its entries yet.
    pub(super) fn listing_began(&self, dir: &Gfid, mark: &Mark) -> Option<u64> {
        let state = self.lock();
        let held = state.dirs.get(dir)?;
        (!held.complete).then_some(mark.generation)
    }

    /// A listing of `dir` that began at `generation` reached the end with `entries`: they
    /// are all of them, with the names changed here since counted in — unless the hold
    /// changed in a way that cannot be (it is another hold, or a change was not logged).
    /// A listing begins after the changes queued before it are on the brick.
    pub(super) fn listed(&self, dir: &Gfid, generation: u64, entries: Vec<(Name, Gfid)>) {
        let mut state = self.lock();
        let Some(held) = state.dirs.get_mut(dir).filter(|h| !h.complete) else {
            return;
        };
        if let Some(entries) = held.entries_since(generation, entries) {
            held.make_complete(entries);
        }
    }

    /// Notes a fop that may change `object` (an object, or a directory whose entries it
    /// changes): the listing that shows it and the listing of it are dropped, and one under
    /// way that shows it is not kept.
    pub(super) fn note_change(&self, object: Gfid) {
        let mut state = self.lock();
        let count = self.changes.fetch_add(1, Ordering::SeqCst) + 1;
        state.log_change(count, Some(object));
        state.drop_listing(&object);
        if let Some(dir) = state.listed_by.get(&object).copied() {
            state.drop_listing(&dir);
        }
    }

    /// Notes a fop that may change any object: every listing is dropped, and none under way
    /// is kept.
    pub(super) fn note_any_change(&self) {
        let mut state = self.lock();
        let count = self.changes.fetch_add(1, Ordering::SeqCst) + 1;
        state.log_change(count, None);
        state.drop_listings();
    }

    /// How many fops that may change an object the mount has noted.
    pub(super) fn changes(&self) -> u64 {
        self.changes.load(Ordering::SeqCst)
    }

    /// Where a listing of `dir` from its start begins, to keep it ([`Leases::keep_listing`]);
    /// `None` unless `dir` is held.
    pub(super) fn listing_mark(&self, dir: &Gfid) -> Option<Mark> {
        let changes = self.changes();
        let generation = self.lock().dirs.get(dir)?.generation;
        Some(Mark {
            generation,
            changes,
            at: Instant::now(),
        })
    }

    /// Where a listing of `dir` asked when the mount had noted `changes` changes began, for
    /// a hold taken while it was read: `None` if a change to `dir` was noted since.
    pub(super) fn listing_mark_unchanged(&self, dir: &Gfid, changes: u64) -> Option<Mark> {
        let state = self.lock();
        let generation = state.dirs.get(dir)?.generation;
        state.untouched_since(changes, dir, None).then(|| Mark {
            generation,
            changes,
            at: Instant::now(),
        })
    }

    /// Keeps `entries`, a whole listing of held directory `dir` that began at `began`,
    /// unless the hold changed meanwhile or a change was noted to `dir` or to an object it
    /// shows (to anything, where it shows a file of several names).
    pub(super) fn keep_listing(&self, dir: &Gfid, began: Mark, entries: Arc<[DirEntryXattrs]>) {
        let mut state = self.lock();
        let changes = self.changes();
        if state
            .dirs
            .get(dir)
            .is_none_or(|held| held.generation != began.generation)
        {
            return;
        }
        let linked =
            (entries.iter()).any(|e| e.iatt.file_type != FileType::Directory && e.iatt.nlink > 1);
        let listing = Arc::new(KeptListing::new(entries));
        let untouched = changes == began.changes
            || (!linked && state.untouched_since(began.changes, dir, Some(&listing)));
        if !untouched {
            return;
        }
        state.drop_listing(dir);
        if !linked {
            for e in listing.entries.iter() {
                state.listed_by.insert(e.iatt.gfid, *dir);
            }
        }
        let len = listing.entries.len() + 1;
        if let Some(held) = state.dirs.get_mut(dir) {
            held.listing = Some(Kept {
                began,
                listing,
                linked,
            });
        }
        state.kept.push_back((*dir, began.generation, len));
        state.kept_entries += len;
        while state.kept_entries > LISTED_ENTRIES_KEPT_MAX
            && let Some((oldest, generation, len)) = state.kept.pop_front()
        {
            state.kept_entries -= len;
            let current = (state.dirs.get(&oldest))
                .and_then(|held| held.listing.as_ref())
                .is_some_and(|k| k.began.generation == generation);
            if current {
                state.drop_listing(&oldest);
            }
        }
    }

    /// The listing kept of held directory `dir`, if nothing changed since it began and it
    /// began less than `max_age` ago — or at any time, when the lease covers the attributes
    /// (`covered`) and no file it lists has several names.
    pub(super) fn kept_listing(
        &self,
        dir: &Gfid,
        max_age: Duration,
        covered: bool,
    ) -> Option<Arc<KeptListing>> {
        let changes = self.changes();
        let state = self.lock();
        let held = state.dirs.get(dir)?;
        let kept = held.listing.as_ref()?;
        let fresh = (covered && !kept.linked) || kept.began.at.elapsed() < max_age;
        // A change noted to what it shows dropped it; where it shows a file of several
        // names, any change might have been to one of the others.
        let unchanged = kept.began.generation == held.generation
            && (!kept.linked || kept.began.changes == changes);
        (fresh && unchanged).then(|| kept.listing.clone())
    }

    /// What the mount describes in held directory `dir`: the directory and the objects made
    /// in it.
    pub(super) fn described_in(&self, dir: &Gfid) -> Vec<Gfid> {
        let state = self.lock();
        let Some(held) = state.dirs.get(dir) else {
            return Vec::new();
        };
        std::iter::once(dir)
            .chain(held.entries.values())
            .filter(|g| state.local.contains_key(*g))
            .copied()
            .collect()
    }

    /// The objects the listing kept of held directory `dir` shows: what the brick recalls
    /// `dir`'s lease for before another client changes one (`LISTED_ATTRS`).
    pub(super) fn listed_in(&self, dir: &Gfid) -> Vec<Gfid> {
        let state = self.lock();
        let kept = state.dirs.get(dir).and_then(|held| held.listing.as_ref());
        kept.map_or_else(Vec::new, |kept| {
            kept.listing.entries.iter().map(|e| e.iatt.gfid).collect()
        })
    }

    /// The held directory whose kept listing shows `object` (one without a file of several
    /// names), if one does.
    pub(super) fn listing_of(&self, object: &Gfid) -> Option<Gfid> {
        self.lock().listed_by.get(object).copied()
    }

    /// Ends the hold on `dir` (recalled, refused or removed): its entries and its objects'
    /// descriptions are forgotten.
    pub(super) fn release(&self, dir: &Gfid) -> Option<LeaseKind> {
        let mut state = self.lock();
        state.drop_listing(dir);
        let held = state.dirs.remove(dir)?;
        for child in held.entries.values() {
            state.local.remove(child);
        }
        state.local.remove(dir);
        Some(held.kind)
    }

    /// How many recalls the mount has seen: read before a lease is asked, for
    /// [`Leases::take_grant`].
    pub(super) fn recalls(&self) -> u64 {
        self.lock().recalls
    }

    /// Notes a recall of `dir`, held or not, for [`Leases::take_grant`].
    pub(super) fn recalled(&self, dir: Gfid) {
        let mut state = self.lock();
        state.recalls += 1;
        if state.recalled.len() >= RECALLED_MAX {
            state.recalled.clear();
            state.recalled_since = state.recalls;
        }
        let number = state.recalls;
        state.recalled.insert(dir, number);
    }

    /// Whether a lease granted on `dir`, asked when the mount had seen `recalls` recalls, may
    /// be taken: not when `dir` was recalled since (the grant may predate the recall).
    pub(super) fn take_grant(&self, dir: &Gfid, recalls: u64) -> bool {
        let state = self.lock();
        recalls + 1 >= state.recalled_since
            && state
                .recalled
                .get(dir)
                .is_none_or(|&number| number <= recalls)
    }

    /// Ends every hold (the session that held the leases is gone); what the mount described.
    pub(super) fn release_all(&self) -> Vec<Gfid> {
        let mut state = self.lock();
        state.drop_listings();
        state.dirs.clear();
        state.local.drain().map(|(gfid, _)| gfid).collect()
    }

    /// Notes that the kernel is told of `name` in `dir` (an entry or an absence it caches);
    /// whether it may cache it — false when `dir` is held and too many names are noted
    /// already, so that the answer must go uncached (its recall could not drop it). An entry
    /// the hold knows needs no note: the recall drops every one (and one that goes is noted
    /// then).
    pub(super) fn tell(&self, dir: &Gfid, name: &Name) -> bool {
        match self.lock().dirs.get_mut(dir) {
            None => true,
            Some(held) if held.entries.contains_key(name) => true,
            Some(held) if held.told.len() < TOLD_NAMES_MAX => {
                held.told.insert(name.clone());
                true
            }
            Some(held) => held.told.contains(name),
        }
    }

    /// The names in held directory `dir` the kernel may cache (as entries or as absent):
    /// what it must forget when the lease goes.
    pub(super) fn names_told(&self, dir: &Gfid) -> Vec<Name> {
        let state = self.lock();
        let Some(held) = state.dirs.get(dir) else {
            return Vec::new();
        };
        held.entries.keys().chain(&held.told).cloned().collect()
    }

    /// [`Leases::names_told`] of every held directory.
    pub(super) fn all_names_told(&self) -> Vec<(Gfid, Vec<Name>)> {
        let dirs: Vec<Gfid> = self.lock().dirs.keys().copied().collect();
        dirs.into_iter()
            .map(|dir| (dir, self.names_told(&dir)))
            .collect()
    }

    /// What held directory `dir` has under `name`.
    pub(super) fn lookup(&self, dir: &Gfid, name: &Name) -> Answer {
        match self.lock().dirs.get(dir) {
            None => Answer::Unknown,
            Some(held) => match held.entries.get(name) {
                Some(g) => Answer::Present(*g),
                None if held.complete || held.absent.contains(name) => Answer::Absent,
                None => Answer::Unknown,
            },
        }
    }

    /// Whether held directory `dir` is known to have no entries.
    pub(super) fn is_empty(&self, dir: &Gfid) -> bool {
        self.lock()
            .dirs
            .get(dir)
            .is_some_and(|held| held.complete && held.entries.is_empty())
    }

    /// Records `name` → `gfid` in `dir` if it is held (a name made there, here or on the
    /// brick).
    pub(super) fn add_entry(&self, dir: &Gfid, name: &Name, gfid: Gfid) {
        if let Some(held) = self.lock().changed(dir) {
            held.absent.remove(name);
            held.entries.insert(name.clone(), gfid);
            held.log_change(name);
        }
    }

    /// Forgets what held directory `dir` knew of `name`, which names an object the mount
    /// does not know (a rename of a name it did not know moved it there): the brick is asked.
    /// The other entries stay known, the absences not.
    pub(super) fn forget_name(&self, dir: &Gfid, name: &Name) {
        let mut state = self.lock();
        let Some(held) = state.changed(dir) else {
            return;
        };
        held.entries.remove(name);
        held.absent.remove(name);
        if held.complete {
            // The names it removed were absent as not listed: they are not noted.
            held.complete = false;
            held.unnoted = true;
            held.logged_after = held.generation;
        }
        held.log_change(name);
        held.told.insert(name.clone());
    }

    /// Forgets `name` in `dir` if it is held; the object it named. The kernel may have cached
    /// the name: it is noted as told, past [`TOLD_NAMES_MAX`] too.
    pub(super) fn remove_entry(&self, dir: &Gfid, name: &Name) -> Option<Gfid> {
        let mut state = self.lock();
        let held = state.changed(dir)?;
        if held.may_learn() {
            held.absent.insert(name.clone());
        } else if !held.complete {
            held.unnoted = true;
        }
        held.log_change(name);
        let gone = held.entries.remove(name)?;
        held.told.insert(name.clone());
        Some(gone)
    }

    /// Describes `gfid`, made under a lease, as `iatt`.
    pub(super) fn describe(&self, iatt: Iatt) {
        self.lock().local.insert(iatt.gfid, Local { iatt });
    }

    /// The mount's description of `gfid`, if it has one.
    pub(super) fn local(&self, gfid: &Gfid) -> Option<Local> {
        self.lock().local.get(gfid).cloned()
    }

    /// Forgets the description of `gfid`: the brick describes it from now on. A held
    /// directory's generation moves on, so a description read from the brick before is not
    /// taken ([`Leases::describe_held`]).
    pub(super) fn forget_local(&self, gfid: &Gfid) {
        let mut state = self.lock();
        state.local.remove(gfid);
        state.changed(gfid);
    }

    /// The generation of held directory `dir`: it moves on with every change of its entries
    /// or its description.
    pub(super) fn generation(&self, dir: &Gfid) -> Option<u64> {
        self.lock().dirs.get(dir).map(|held| held.generation)
    }

    /// Describes held directory `dir` as the brick did (`iatt`, asked at `generation` with
    /// nothing of it queued): kept while the lease is, as no other client can change the
    /// directory without its recall. Not taken if the hold changed meanwhile.
    pub(super) fn describe_held(&self, generation: u64, iatt: Iatt) {
        let mut state = self.lock();
        if state
            .dirs
            .get(&iatt.gfid)
            .is_some_and(|held| held.generation == generation)
        {
            state.local.insert(iatt.gfid, Local { iatt });
        }
    }

    /// Changes the description of `gfid` with `change`, if there is one; the result.
    pub(super) fn update_local(&self, gfid: &Gfid, change: impl FnOnce(&mut Iatt)) -> Option<Iatt> {
        let mut state = self.lock();
        let local = state.local.get_mut(gfid)?;
        change(&mut local.iatt);
        Some(local.iatt.clone())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The attributes of a new object made by `uid`/`gid` in a directory, as a local file system
/// would give them: `kind`, permission bits `mode`, `size` bytes (a symlink's target), now.
pub(super) fn new_iatt(
    gfid: Gfid,
    kind: FileType,
    mode: u32,
    uid: u32,
    gid: u32,
    size: u64,
) -> Iatt {
    let now = now();
    let (nlink, size) = match kind {
        FileType::Directory => (2, 4096),
        _ => (1, size),
    };
    // As ext4 and XFS count them: whole 4 KiB blocks, none for a short symlink (kept in the
    // inode).
    let blocks = match kind {
        FileType::Symlink if size < 60 => 0,
        _ => size.div_ceil(4096) * 8,
    };
    Iatt {
        gfid,
        ino: 0,
        file_type: kind,
        mode: Mode::from_st_mode(mode),
        nlink,
        uid,
        gid,
        rdev: 0,
        size,
        blocks,
        blksize: 4096,
        atime: now,
        mtime: now,
        ctime: now,
    }
}

/// The current time as the wire carries it.
pub(super) fn now() -> Timespec {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    Timespec::new(
        i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        d.subsec_nanos(),
    )
    .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gfid(n: u8) -> Gfid {
        Gfid::from_bytes([n; 16]).expect("gfid")
    }

    fn name(s: &str) -> Name {
        Name::new(s.to_owned()).expect("name")
    }

    #[test]
    fn names_told_are_bounded_and_listed_for_the_recall() {
        let leases = Leases::default();
        assert!(
            leases.tell(&gfid(1), &name("x")),
            "not held: nothing to track"
        );
        assert!(leases.names_told(&gfid(1)).is_empty());
        leases.hold_new(gfid(1));
        leases.add_entry(&gfid(1), &name("a"), gfid(2));
        for i in 0..TOLD_NAMES_MAX {
            assert!(leases.tell(&gfid(1), &name(&format!("n{i}"))));
        }
        assert!(!leases.tell(&gfid(1), &name("one-too-many")));
        assert!(leases.tell(&gfid(1), &name("n7")), "already noted");
        assert!(leases.tell(&gfid(1), &name("a")), "an entry the hold knows");
        let told = leases.names_told(&gfid(1));
        assert_eq!(told.len(), TOLD_NAMES_MAX + 1);
        assert!(told.contains(&name("a")) && told.contains(&name("n0")));
        assert_eq!(leases.all_names_told().len(), 1);
        assert_eq!(leases.remove_entry(&gfid(1), &name("a")), Some(gfid(2)));
        assert!(
            leases.names_told(&gfid(1)).contains(&name("a")),
            "an entry that goes stays noted, past the bound"
        );
        leases.release(&gfid(1));
        assert!(leases.names_told(&gfid(1)).is_empty());
    }

    #[test]
    fn a_held_directory_answers_for_every_name() {
        let leases = Leases::default();
        assert_eq!(leases.lookup(&gfid(1), &name("a")), Answer::Unknown);
        leases.hold_new(gfid(1));
        assert_eq!(leases.lookup(&gfid(1), &name("a")), Answer::Absent);
        leases.add_entry(&gfid(1), &name("a"), gfid(2));
        assert_eq!(
            leases.lookup(&gfid(1), &name("a")),
            Answer::Present(gfid(2))
        );
        assert!(!leases.is_empty(&gfid(1)));
        assert_eq!(leases.remove_entry(&gfid(1), &name("a")), Some(gfid(2)));
        assert!(leases.is_empty(&gfid(1)));
    }

    #[test]
    fn a_read_lease_knows_the_entries_once_a_whole_listing_ends() {
        let leases = Leases::default();
        leases.hold_read(gfid(1));
        assert!(!leases.holds(&gfid(1)), "reading only");
        assert_eq!(leases.lookup(&gfid(1), &name("a")), Answer::Unknown);
        let mark = leases.listing_mark(&gfid(1)).expect("held");
        let began = leases.listing_began(&gfid(1), &mark).expect("incomplete");
        // A change made here during the listing is counted in.
        leases.add_entry(&gfid(1), &name("new"), gfid(9));
        leases.listed(&gfid(1), began, vec![(name("a"), gfid(2))]);
        assert_eq!(
            leases.lookup(&gfid(1), &name("a")),
            Answer::Present(gfid(2))
        );
        assert_eq!(
            leases.lookup(&gfid(1), &name("new")),
            Answer::Present(gfid(9))
        );
        assert_eq!(leases.lookup(&gfid(1), &name("b")), Answer::Absent);
        assert!(leases.listing_began(&gfid(1), &mark).is_none(), "known");
        assert!(leases.asks_write(&gfid(1)));
        leases.hold_write(gfid(1));
        assert!(leases.holds(&gfid(1)) && leases.knows_all(&gfid(1)));
        assert_eq!(leases.lookup(&gfid(1), &name("b")), Answer::Absent);
    }

    #[test]
    fn a_listing_counts_in_the_changes_made_while_it_ran() {
        let leases = Leases::default();
        leases.hold_write(gfid(1));
        let mark = leases.listing_mark(&gfid(1)).expect("held");
        let began = leases
            .listing_began(&gfid(1), &mark)
            .expect("not all known");
        // Made and removed here while the listing ran, which may or may not show them.
        leases.add_entry(&gfid(1), &name("new"), gfid(7));
        leases.remove_entry(&gfid(1), &name("old"));
        let listed = vec![(name("old"), gfid(2)), (name("kept"), gfid(3))];
        leases.listed(&gfid(1), began, listed);
        assert!(leases.knows_all(&gfid(1)));
        let answers = ["new", "old", "kept", "other"].map(|n| leases.lookup(&gfid(1), &name(n)));
        assert_eq!(
            answers,
            [
                Answer::Present(gfid(7)),
                Answer::Absent,
                Answer::Present(gfid(3)),
                Answer::Absent
            ]
        );
        // A name moved in from an object the mount did not know cannot be counted in.
        leases.release(&gfid(1));
        leases.hold_write(gfid(1));
        let mark = leases.listing_mark(&gfid(1)).expect("held");
        let began = leases
            .listing_began(&gfid(1), &mark)
            .expect("not all known");
        leases.forget_name(&gfid(1), &name("moved"));
        leases.listed(&gfid(1), began, vec![]);
        assert!(!leases.knows_all(&gfid(1)));
        // Nor the changes of another hold.
        let mark = leases.listing_mark(&gfid(1)).expect("held");
        let began = leases
            .listing_began(&gfid(1), &mark)
            .expect("not all known");
        leases.release(&gfid(1));
        leases.hold_write(gfid(1));
        leases.add_entry(&gfid(1), &name("x"), gfid(8));
        leases.listed(&gfid(1), began, vec![]);
        assert!(!leases.knows_all(&gfid(1)));
    }

    #[test]
    fn a_write_lease_asked_is_not_asked_again_at_once() {
        let leases = Leases::default();
        assert!(leases.asks_write(&gfid(1)));
        assert!(!leases.asks_write(&gfid(1)), "asked already");
        assert!(leases.asks_write(&gfid(2)), "another directory");
        leases.hold_write(gfid(3));
        assert!(!leases.asks_write(&gfid(3)), "held");
    }

    #[test]
    fn a_hold_of_unknown_entries_learns_what_the_brick_answered_under_it() {
        let leases = Leases::default();
        leases.hold_write(gfid(1));
        assert!(leases.holds(&gfid(1)) && !leases.knows_all(&gfid(1)));
        assert_eq!(leases.lookup(&gfid(1), &name("a")), Answer::Unknown);
        let asked = leases.generation(&gfid(1)).expect("held");
        leases.learn(&gfid(1), asked, &name("a"), None);
        leases.learn(&gfid(1), asked, &name("f"), Some(gfid(2)));
        assert_eq!(leases.lookup(&gfid(1), &name("a")), Answer::Absent);
        assert_eq!(
            leases.lookup(&gfid(1), &name("f")),
            Answer::Present(gfid(2))
        );
        assert!(!leases.is_empty(&gfid(1)), "other names are not known");
        // Made, then removed, here.
        leases.add_entry(&gfid(1), &name("a"), gfid(3));
        assert_eq!(
            leases.lookup(&gfid(1), &name("a")),
            Answer::Present(gfid(3))
        );
        assert_eq!(leases.remove_entry(&gfid(1), &name("f")), Some(gfid(2)));
        assert_eq!(leases.lookup(&gfid(1), &name("f")), Answer::Absent);
        // An answer to a question asked before a change here is not learned.
        let before = leases.generation(&gfid(1)).expect("held");
        leases.add_entry(&gfid(1), &name("c"), gfid(4));
        leases.learn(&gfid(1), before, &name("b"), None);
        assert_eq!(leases.lookup(&gfid(1), &name("b")), Answer::Unknown);
        // Nor one about a directory no longer held.
        let held = leases.generation(&gfid(1)).expect("held");
        leases.release(&gfid(1));
        leases.learn(&gfid(1), held, &name("b"), None);
        assert_eq!(leases.lookup(&gfid(1), &name("b")), Answer::Unknown);
    }

    fn entry(n: &str) -> DirEntryXattrs {
        DirEntryXattrs {
            offset: 1,
            name: name(n),
            iatt: new_iatt(gfid(9), FileType::Regular, 0o644, 0, 0, 0),
            xattrs: Default::default(),
        }
    }

    #[test]
    fn a_listing_is_kept_while_nothing_changed_and_for_as_long_as_it_is_covered() {
        let leases = Leases::default();
        let long = Duration::from_secs(60);
        assert!(leases.listing_mark(&gfid(1)).is_none(), "not held");
        leases.hold_read(gfid(1));
        // A change through the mount to what it shows while it was read: not kept.
        let mark = leases.listing_mark(&gfid(1)).expect("held");
        leases.note_change(gfid(9));
        leases.keep_listing(&gfid(1), mark, [entry("a")].into());
        assert!(leases.kept_listing(&gfid(1), long, false).is_none());
        // Kept, and answered until the next change or past its age.
        let mark = leases.listing_mark(&gfid(1)).expect("held");
        leases.keep_listing(&gfid(1), mark, [entry("a")].into());
        let kept = leases.kept_listing(&gfid(1), long, false).expect("kept");
        assert_eq!(kept.entries.len(), 1);
        let a = kept.entries[0].iatt.gfid;
        assert_eq!(kept.position(&a), Some(0));
        assert!(kept.entry(&gfid(99)).is_none(), "not listed");
        assert!(
            leases
                .kept_listing(&gfid(1), Duration::ZERO, false)
                .is_none(),
            "too old"
        );
        assert!(
            (leases.kept_listing(&gfid(1), Duration::ZERO, true)).is_some(),
            "the lease covers the attributes: kept until it goes"
        );
        leases.note_change(gfid(9));
        assert!(
            leases.kept_listing(&gfid(1), long, true).is_none(),
            "changed since"
        );
        // A hold released and taken again does not take a listing read under the first.
        let mark = leases.listing_mark(&gfid(1)).expect("held");
        leases.release(&gfid(1));
        leases.hold_read(gfid(1));
        leases.keep_listing(&gfid(1), mark, [entry("a")].into());
        assert!(
            leases.kept_listing(&gfid(1), long, true).is_none(),
            "another hold"
        );
        // A file with two names: a removal of the other one would not recall this lease.
        let mut linked = entry("b");
        linked.iatt.nlink = 2;
        let mark = leases.listing_mark(&gfid(1)).expect("held");
        leases.keep_listing(&gfid(1), mark, [entry("a"), linked].into());
        assert!(leases.kept_listing(&gfid(1), long, true).is_some());
        assert!(
            leases
                .kept_listing(&gfid(1), Duration::ZERO, true)
                .is_none(),
            "only for the attribute lifetime"
        );
    }

    #[test]
    fn only_changes_to_what_a_listing_shows_drop_it() {
        let leases = Leases::default();
        let long = Duration::from_secs(60);
        let (dir, other) = (gfid(1), gfid(2));
        leases.hold_read(dir);
        leases.hold_read(other);
        let keep = |dir: &Gfid, mark: Mark, entries: &[DirEntryXattrs]| {
            leases.keep_listing(dir, mark, entries.to_vec().into());
            leases.kept_listing(dir, long, true).is_some()
        };
        // Changes elsewhere while it is read, and after: kept, and it answers.
        let mark = leases.listing_mark(&dir).expect("held");
        leases.note_change(other);
        leases.note_change(gfid(50));
        assert!(keep(&dir, mark, &[entry("a")]), "changes elsewhere");
        leases.note_change(gfid(51));
        assert!(leases.kept_listing(&dir, long, true).is_some());
        // A change to the directory itself (its entries) while it is read, or after.
        let mark = leases.listing_mark(&dir).expect("held");
        leases.note_change(dir);
        assert!(!keep(&dir, mark, &[entry("a")]), "the directory changed");
        let mark = leases.listing_mark(&dir).expect("held");
        assert!(keep(&dir, mark, &[entry("a")]));
        leases.note_change(dir);
        assert!(leases.kept_listing(&dir, long, true).is_none());
        // A change to an object it shows drops it, and only it.
        let mark = leases.listing_mark(&dir).expect("held");
        assert!(keep(&dir, mark, &[entry("a")]));
        let mut b = entry("b");
        b.iatt.gfid = gfid(10);
        let mark = leases.listing_mark(&other).expect("held");
        assert!(keep(&other, mark, &[b]));
        leases.note_change(gfid(9));
        assert!(leases.kept_listing(&dir, long, true).is_none());
        assert!(leases.kept_listing(&other, long, true).is_some());
        // A change that may be to anything drops every listing, and one under way.
        let mark = leases.listing_mark(&dir).expect("held");
        leases.note_any_change();
        assert!(leases.kept_listing(&other, long, true).is_none());
        assert!(!keep(&dir, mark, &[entry("a")]), "anything changed");
        // A listing with a file of several names goes with any change.
        let mut linked = entry("c");
        linked.iatt.nlink = 2;
        let mark = leases.listing_mark(&dir).expect("held");
        assert!(keep(&dir, mark, &[linked]));
        leases.note_change(gfid(52));
        assert!(leases.kept_listing(&dir, long, true).is_none());
        // One that began before the changes remembered is not kept.
        let mark = leases.listing_mark(&dir).expect("held");
        for _ in 0..=RECENT_CHANGES_MAX {
            leases.note_change(gfid(60));
        }
        assert!(!keep(&dir, mark, &[entry("a")]), "too many changes since");
        // A hold taken with a listing takes it if nothing was noted to the directory since
        // it was asked.
        let asked = leases.changes();
        leases.note_change(gfid(53));
        let mark = leases
            .listing_mark_unchanged(&dir, asked)
            .expect("untouched");
        assert!(keep(&dir, mark, &[entry("a")]));
        leases.note_change(dir);
        assert!(leases.listing_mark_unchanged(&dir, asked).is_none());
    }

    #[test]
    fn kept_listings_are_bounded() {
        let leases = Leases::default();
        let long = Duration::from_secs(60);
        // Two listings fill the bound, each counting one more than its entries.
        let half: Arc<[DirEntryXattrs]> = vec![entry("a"); LISTED_ENTRIES_KEPT_MAX / 2 - 1].into();
        let dirs = [gfid(10), gfid(11), gfid(12)];
        for dir in &dirs {
            leases.hold_read(*dir);
            let mark = leases.listing_mark(dir).expect("held");
            leases.keep_listing(dir, mark, half.clone());
        }
        assert!(
            leases.kept_listing(&dirs[0], long, true).is_none(),
            "the oldest went"
        );
        assert!(
            dirs[1..]
                .iter()
                .all(|d| leases.kept_listing(d, long, true).is_some())
        );
    }

    #[test]
    fn releasing_a_directory_forgets_its_objects() {
        let leases = Leases::default();
        leases.hold_new(gfid(1));
        leases.add_entry(&gfid(1), &name("a"), gfid(2));
        leases.describe(new_iatt(gfid(2), FileType::Regular, 0o644, 1, 1, 0));
        leases.describe(new_iatt(gfid(3), FileType::Regular, 0o644, 1, 1, 0));
        leases.release(&gfid(1));
        assert!(!leases.holds(&gfid(1)));
        assert!(
            leases.local(&gfid(2)).is_none(),
            "a child of the released directory"
        );
        assert!(leases.local(&gfid(3)).is_some(), "not in it");
        leases.release_all();
        assert!(leases.local(&gfid(3)).is_none());
    }

    #[test]
    fn a_grant_asked_before_a_recall_of_its_directory_is_not_taken() {
        let leases = Leases::default();
        let (first, second) = (leases.recalls(), leases.recalls());
        assert!(leases.take_grant(&gfid(1), first));
        // The first grant is held and recalled; the second's reply comes after the recall.
        leases.hold_read(gfid(1));
        leases.recalled(gfid(1));
        leases.release(&gfid(1));
        assert!(
            !leases.take_grant(&gfid(1), second),
            "granted before the recall"
        );
        assert!(leases.take_grant(&gfid(2), second), "another directory's");
        assert!(
            leases.take_grant(&gfid(1), leases.recalls()),
            "asked after it"
        );
        // Past the bound, what was asked before the oldest recall still known is refused.
        let before = leases.recalls();
        for n in 0..=RECALLED_MAX {
            leases.recalled(Gfid::from_bytes((n as u128 + 10).to_le_bytes()).expect("not nil"));
        }
        assert!(!leases.take_grant(&gfid(3), before));
        assert!(leases.take_grant(&gfid(3), leases.recalls()));
    }
}
