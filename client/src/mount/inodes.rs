//! The mount's inode table: FUSE node ids for GFIDs, with the kernel's lookup counts.
//!
//! A node id is the GFID's low 64 bits (as GlusterFS's FUSE bridge does), so `st_ino` stays
//! the same across remounts and hard links share one; the root is node 1. Two live GFIDs that
//! would share an id (or one that would be 0 or 1) get the next free id instead.
//!
//! Every reply that hands the kernel an entry (LOOKUP, CREATE, MKNOD, MKDIR, SYMLINK, LINK,
//! each READDIRPLUS entry) counts one lookup; FORGET gives counts back, and a node whose
//! count reaches zero is dropped. The count is taken before the reply is sent, so a FORGET
//! can never arrive for a lookup the table has not counted.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use kiln_wire::{Gfid, XattrPresence};

use super::pages::{Pages, Stamp};
use super::pending::ParentAttr;

/// The root directory's node id (`FUSE_ROOT_ID`).
pub(crate) const ROOT_INO: u64 = 1;

#[derive(Debug)]
pub(crate) struct Inodes {
    map: Mutex<Map>,
}

#[derive(Debug, Default)]
struct Map {
    by_ino: HashMap<u64, Node>,
    by_gfid: HashMap<Gfid, u64>,
    /// Requests that change something through the mount are numbered as they come and again
    /// as they are answered: the number of the last one.
    last_change: u64,
    /// Of those, the ones that changed files the mount cannot name ([`ChangeMark::blind`]).
    blind_changes: u64,
}

/// Where the changes made through the mount stood at one moment: the number of the last one
/// (each node notes the number of its own last change) and how many of them changed files
/// the mount could not name (a removal or rename changes the removed or renamed file's links
/// and ctime; a node the mount does not know may be anything).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ChangeMark {
    last: u64,
    blind: u64,
}

#[derive(Debug)]
struct Node {
    gfid: Gfid,
    /// Lookups the kernel holds; the root's is never counted down to zero.
    nlookup: u64,
    /// A POSIX lock was taken on this file through the mount, so a FLUSH (a close) must reach
    /// the brick to drop the closer's locks.
    locked: bool,
    /// Until then the file is known to have no `security.*` xattrs: this mount created it
    /// and has set none since.
    bare_until: Option<Instant>,
    /// Extended attributes the brick said the object does not have, each until a time.
    absent_xattrs: Vec<(Box<[u8]>, Instant)>,
    /// Which of the names programs probe on every file (`ls -l` asks two) the object has, as
    /// the brick told, until a time.
    probed: Option<(XattrPresence, Instant)>,
    /// A directory's permission bits and owner, as last seen, until a time.
    dir_attr: Option<(ParentAttr, Instant)>,
    /// The directory whose listing last showed this file to the kernel.
    listed_in: Option<Gfid>,
    /// What the kernel's pages of this file match.
    pages: Pages,
    /// The number of the last change made to it through the mount ([`Inodes::note_change`]);
    /// a node made anew takes the last number of all (the file may have changed through a
    /// node the kernel has forgotten since).
    changed_at: u64,
}

impl Inodes {
    pub(crate) fn new() -> Inodes {
        let mut map = Map::default();
        map.by_ino.insert(
            ROOT_INO,
            Node {
                gfid: Gfid::ROOT,
                nlookup: 1,
                locked: false,
                bare_until: None,
                absent_xattrs: Vec::new(),
                probed: None,
                dir_attr: None,
                listed_in: None,
                pages: Pages::default(),
                changed_at: 0,
            },
        );
        map.by_gfid.insert(Gfid::ROOT, ROOT_INO);
        Inodes {
            map: Mutex::new(map),
        }
    }

    /// The GFID of node `ino`, if the kernel may still use it.
    pub(crate) fn gfid(&self, ino: u64) -> Option<Gfid> {
        self.lock().by_ino.get(&ino).map(|n| n.gfid)
    }

    /// The node id of `gfid`, if the kernel holds it (counts nothing).
    pub(crate) fn ino_of(&self, gfid: &Gfid) -> Option<u64> {
        self.lock().by_gfid.get(gfid).copied()
    }

    /// Counts one lookup of `gfid` and returns its node id.
    pub(crate) fn remember(&self, gfid: Gfid) -> u64 {
        let mut map = self.lock();
        if let Some(&ino) = map.by_gfid.get(&gfid) {
            if let Some(node) = map.by_ino.get_mut(&ino) {
                node.nlookup += 1;
            }
            return ino;
        }
        let changed_at = map.last_change;
        let mut ino = preferred_ino(gfid);
        while ino <= ROOT_INO || map.by_ino.contains_key(&ino) {
            ino = ino.wrapping_add(1);
        }
        map.by_ino.insert(
            ino,
            Node {
                gfid,
                nlookup: 1,
                locked: false,
                bare_until: None,
                absent_xattrs: Vec::new(),
                probed: None,
                dir_attr: None,
                listed_in: None,
                pages: Pages::default(),
                changed_at,
            },
        );
        map.by_gfid.insert(gfid, ino);
        ino
    }

    /// Gives back `n` lookups of `ino`; the node goes when none are left.
    pub(crate) fn forget(&self, ino: u64, n: u64) {
        let mut map = self.lock();
        let Some(node) = map.by_ino.get_mut(&ino) else {
            return;
        };
        node.nlookup = node.nlookup.saturating_sub(n);
        if node.nlookup == 0 && ino != ROOT_INO {
            let gfid = node.gfid;
            map.by_ino.remove(&ino);
            map.by_gfid.remove(&gfid);
        }
    }

    /// The brick shows file `ino` as `seen`: whether the kernel's pages of it must go
    /// ([`Pages::seen`]).
    pub(crate) fn pages_seen(&self, ino: u64, seen: Stamp) -> bool {
        self.with_pages(ino, |p| p.seen(seen)).unwrap_or(false)
    }

    /// This mount changed file `gfid`'s data on the brick from `before` to `after`: the node
    /// whose pages must go, if they must ([`Pages::changed`]).
    pub(crate) fn pages_changed(
        &self,
        gfid: &Gfid,
        before: Option<Stamp>,
        after: Stamp,
    ) -> Option<u64> {
        let ino = self.ino_of(gfid)?;
        self.with_pages(ino, |p| p.changed(before, after))
            .filter(|&stale| stale)
            .map(|_| ino)
    }

    /// The kernel's pages of `ino` went (or hold what the brick refused).
    pub(crate) fn pages_dropped(&self, ino: u64) {
        self.with_pages(ino, Pages::dropped);
    }

    /// Numbers a request that changes nodes `inos`, as it comes and again as it is answered;
    /// one the mount does not know makes it a blind change.
    pub(crate) fn note_change(&self, inos: impl IntoIterator<Item = u64>) {
        let mut map = self.lock();
        map.last_change += 1;
        let seq = map.last_change;
        for ino in inos {
            match map.by_ino.get_mut(&ino) {
                Some(node) => node.changed_at = seq,
                None => {
                    map.blind_changes += 1;
                    return;
                }
            }
        }
    }

    /// Notes a change to a file the mount can name only by its name ([`ChangeMark::blind`]).
    pub(crate) fn note_blind_change(&self) {
        self.lock().blind_changes += 1;
    }

    /// Where the changes made through the mount stand now.
    pub(crate) fn change_mark(&self) -> ChangeMark {
        let map = self.lock();
        ChangeMark {
            last: map.last_change,
            blind: map.blind_changes,
        }
    }

    /// Whether file `ino` is as it was at `mark` as far as changes through the mount go.
    pub(crate) fn unchanged_since(&self, ino: u64, mark: ChangeMark) -> bool {
        let map = self.lock();
        map.blind_changes == mark.blind
            && map
                .by_ino
                .get(&ino)
                .is_some_and(|node| node.changed_at <= mark.last)
    }

    /// Whether the kernel may hold pages this mount wrote to `ino`, of a known version.
    pub(crate) fn pages_written(&self, ino: u64) -> bool {
        self.with_pages(ino, |p| p.written().is_some()) == Some(true)
    }

    fn with_pages<T>(&self, ino: u64, f: impl FnOnce(&mut Pages) -> T) -> Option<T> {
        self.lock().by_ino.get_mut(&ino).map(|n| f(&mut n.pages))
    }

    /// Marks `ino` as having had a POSIX lock taken through the mount.
    pub(crate) fn mark_locked(&self, ino: u64) {
        if let Some(node) = self.lock().by_ino.get_mut(&ino) {
            node.locked = true;
        }
    }

    pub(crate) fn is_locked(&self, ino: u64) -> bool {
        self.lock().by_ino.get(&ino).is_some_and(|n| n.locked)
    }

    /// Records that `ino`, just created by this mount, has no `security.*` xattrs until
    /// `until` (the kernel asks for `security.capability` before each write and chown).
    pub(crate) fn mark_bare(&self, ino: u64, until: Instant) {
        if let Some(node) = self.lock().by_ino.get_mut(&ino) {
            node.bare_until = Some(until);
        }
    }

    /// Records directory `ino`'s permission bits and owner, trusted until `until`.
    pub(crate) fn note_dir(&self, ino: u64, attr: ParentAttr, until: Instant) {
        if let Some(node) = self.lock().by_ino.get_mut(&ino) {
            node.dir_attr = Some((attr, until));
        }
    }

    /// Directory `ino`'s permission bits and owner, if seen recently enough.
    pub(crate) fn dir_attr(&self, ino: u64) -> Option<ParentAttr> {
        let now = Instant::now();
        self.lock()
            .by_ino
            .get(&ino)
            .and_then(|n| n.dir_attr)
            .and_then(|(attr, until)| (now < until).then_some(attr))
    }

    /// Records that `ino` has no xattr `name` until `until`.
    pub(crate) fn note_absent_xattr(&self, ino: u64, name: &[u8], until: Instant) {
        if let Some(node) = self.lock().by_ino.get_mut(&ino) {
            node.absent_xattrs.retain(|(n, _)| **n != *name);
            node.absent_xattrs.push((name.into(), until));
        }
    }

    /// Records that file `ino` was shown to the kernel from directory `dir`'s listing (in the
    /// listing, or in a LOOKUP the kept listing answered).
    pub(crate) fn note_listed_in(&self, ino: u64, dir: Gfid) {
        if let Some(node) = self.lock().by_ino.get_mut(&ino) {
            node.listed_in = Some(dir);
        }
    }

    /// The directory whose listing last showed file `ino` to the kernel.
    pub(crate) fn listed_in(&self, ino: u64) -> Option<Gfid> {
        self.lock().by_ino.get(&ino).and_then(|n| n.listed_in)
    }

    /// Records which probed xattrs `ino` has, trusted until `until`.
    pub(crate) fn note_probed(&self, ino: u64, presence: XattrPresence, until: Instant) {
        if let Some(node) = self.lock().by_ino.get_mut(&ino) {
            node.probed = Some((presence, until));
        }
    }

    /// Whether the presence of every probed xattr of `ino` is known now.
    pub(crate) fn probed_known(&self, ino: u64) -> bool {
        let now = Instant::now();
        self.lock()
            .by_ino
            .get(&ino)
            .is_some_and(|n| n.probed.is_some_and(|(_, until)| now < until))
    }

    /// Forgets what is known of `ino`'s xattr `name` (it is being set).
    pub(crate) fn forget_xattr(&self, ino: u64, name: &[u8]) {
        if let Some(node) = self.lock().by_ino.get_mut(&ino) {
            node.absent_xattrs.retain(|(n, _)| **n != *name);
            if name.starts_with(b"security.") {
                node.bare_until = None;
            }
            if let Some((presence, _)) = &mut node.probed {
                *presence = *presence | XattrPresence::of_names([name]);
            }
        }
    }

    /// Forgets what is known of `ino`'s xattrs and, for a directory, its permission bits:
    /// another client may have changed them (the kernel is told to drop the attributes it
    /// caches at the same time).
    pub(crate) fn forget_attrs(&self, ino: u64) {
        if let Some(node) = self.lock().by_ino.get_mut(&ino) {
            node.bare_until = None;
            node.absent_xattrs.clear();
            node.probed = None;
            node.dir_attr = None;
        }
    }

    /// Whether `ino` is known to have no xattr `name` now.
    pub(crate) fn xattr_is_absent(&self, ino: u64, name: &[u8]) -> bool {
        let now = Instant::now();
        self.lock().by_ino.get(&ino).is_some_and(|n| {
            (name.starts_with(b"security.") && n.bare_until.is_some_and(|until| now < until))
                || n.absent_xattrs
                    .iter()
                    .any(|(absent, until)| **absent == *name && now < *until)
                || n.probed.is_some_and(|(presence, until)| {
                    now < until && presence.absent().any(|absent| absent == name)
                })
        })
    }

    /// Nodes the kernel holds (the root included).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().by_ino.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Map> {
        // A panic while holding the lock leaves the map consistent (every update is one step).
        self.map
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The node id a GFID gets unless it is taken: its low 64 bits.
fn preferred_ino(gfid: Gfid) -> u64 {
    let bytes = gfid.as_bytes();
    let mut low = [0; 8];
    low.copy_from_slice(&bytes[8..]);
    u64::from_be_bytes(low)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gfid(low: u64, high: u64) -> Gfid {
        let mut bytes = [0; 16];
        bytes[..8].copy_from_slice(&high.to_be_bytes());
        bytes[8..].copy_from_slice(&low.to_be_bytes());
        Gfid::from_bytes(bytes).expect("a non-null gfid")
    }

    #[test]
    fn lookups_are_counted_and_forgotten() {
        let inodes = Inodes::new();
        let g = gfid(77, 5);
        let ino = inodes.remember(g);
        assert_eq!(ino, 77);
        assert_eq!(inodes.remember(g), 77);
        inodes.forget(ino, 1);
        assert_eq!(inodes.gfid(ino), Some(g));
        inodes.forget(ino, 1);
        assert_eq!(inodes.gfid(ino), None);
        assert_eq!(inodes.len(), 1);
    }

    #[test]
    fn colliding_and_reserved_ids_move_on() {
        let inodes = Inodes::new();
        let (a, b) = (gfid(9, 1), gfid(9, 2));
        assert_eq!(inodes.remember(a), 9);
        assert_eq!(inodes.remember(b), 10);
        assert_eq!(inodes.gfid(9), Some(a));
        assert_eq!(inodes.gfid(10), Some(b));
        assert_eq!(inodes.remember(gfid(1, 3)), 2);
        assert_eq!(inodes.remember(gfid(0, 4)), 3);
    }

    #[test]
    fn the_root_is_never_dropped() {
        let inodes = Inodes::new();
        inodes.forget(ROOT_INO, 100);
        assert_eq!(inodes.gfid(ROOT_INO), Some(Gfid::ROOT));
        assert_eq!(inodes.remember(Gfid::ROOT), ROOT_INO);
    }

    #[test]
    fn a_file_is_unchanged_since_a_mark_until_a_change_to_it_is_numbered_after() {
        let inodes = Inodes::new();
        let (file, other) = (inodes.remember(gfid(50, 1)), inodes.remember(gfid(51, 1)));
        inodes.note_change([file]);
        let mark = inodes.change_mark();
        assert!(inodes.unchanged_since(file, mark));
        inodes.note_change([other]);
        assert!(inodes.unchanged_since(file, mark), "another file's change");

        // A change that came before the mark and was answered after it: numbered again at
        // its answer, it counts against the mark.
        inodes.note_change([file]);
        let mark = inodes.change_mark();
        assert!(inodes.unchanged_since(file, mark));
        inodes.note_change([file]);
        assert!(!inodes.unchanged_since(file, mark));

        // A change by a name counts against every file; so does one to a node not known.
        let mark = inodes.change_mark();
        inodes.note_blind_change();
        assert!(!inodes.unchanged_since(other, mark));
        let mark = inodes.change_mark();
        inodes.note_change([999]);
        assert!(!inodes.unchanged_since(other, mark));

        // A node made anew may have changed (through a node of its own) while it was
        // forgotten: any change since the mark counts against it.
        let mark = inodes.change_mark();
        inodes.forget(other, 1);
        assert!(!inodes.unchanged_since(other, mark), "not known");
        inodes.note_change([file]);
        let again = inodes.remember(gfid(51, 1));
        assert!(!inodes.unchanged_since(again, mark));
    }

    #[test]
    fn lock_marks_live_with_the_node() {
        let inodes = Inodes::new();
        let ino = inodes.remember(gfid(42, 1));
        assert!(!inodes.is_locked(ino));
        inodes.mark_locked(ino);
        assert!(inodes.is_locked(ino));
        inodes.forget(ino, 1);
        assert!(!inodes.is_locked(ino));
    }

    #[test]
    fn absent_xattrs_expire_and_are_forgotten_when_set() {
        let inodes = Inodes::new();
        let ino = inodes.remember(gfid(43, 1));
        let later = Instant::now() + std::time::Duration::from_secs(60);
        let caps = b"security.capability";
        assert!(!inodes.xattr_is_absent(ino, caps));
        inodes.mark_bare(ino, later);
        assert!(inodes.xattr_is_absent(ino, caps));
        assert!(!inodes.xattr_is_absent(ino, b"user.x"));
        inodes.forget_xattr(ino, b"security.selinux");
        assert!(!inodes.xattr_is_absent(ino, caps));
        inodes.note_absent_xattr(ino, b"user.x", later);
        assert!(inodes.xattr_is_absent(ino, b"user.x"));
        inodes.forget_xattr(ino, b"user.x");
        assert!(!inodes.xattr_is_absent(ino, b"user.x"));
        inodes.note_absent_xattr(ino, b"user.y", Instant::now());
        assert!(!inodes.xattr_is_absent(ino, b"user.y"));

        // The probed names, as a LOOKUP told them: absent until set here or out of date.
        let acl = b"system.posix_acl_access";
        assert!(!inodes.probed_known(ino));
        inodes.note_probed(ino, XattrPresence::SELINUX, later);
        assert!(inodes.probed_known(ino));
        assert!(inodes.xattr_is_absent(ino, acl));
        assert!(!inodes.xattr_is_absent(ino, b"security.selinux"));
        inodes.forget_xattr(ino, acl);
        assert!(!inodes.xattr_is_absent(ino, acl));
        inodes.note_probed(ino, XattrPresence::empty(), Instant::now());
        assert!(!inodes.probed_known(ino));
        assert!(!inodes.xattr_is_absent(ino, acl));
    }
}
