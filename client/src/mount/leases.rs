//! The directories this mount holds a write lease on, and what it knows of them.
//!
//! A held directory is one the mount made itself (MKDIR, with LEASE in the same batch), so it
//! knows every entry in it: the brick recalls the lease before any other client may look
//! inside. In a held directory the mount answers LOOKUP from its entries (a name it does not
//! have does not exist), and makes and removes names itself, queueing the changes behind
//! ([`super::behind`]). The objects made there are described here too ([`Local`]): their
//! attributes are the mount's until a fop on the brick changes them.
//!
//! A recall, a refused lease or a lost session ends a directory's hold: its entries and the
//! descriptions of its objects are forgotten, and fops there go to the brick again (after
//! the changes queued before them).

use std::collections::HashMap;
use std::sync::Mutex;

use kiln_wire::{FileType, Gfid, Iatt, Mode, Name, Timespec};

/// An object made under a lease, as the mount describes it until the brick does.
#[derive(Debug, Clone)]
pub(super) struct Local {
    pub(super) iatt: Iatt,
}

#[derive(Debug, Default)]
struct Held {
    /// Every entry of the directory: name → object.
    entries: HashMap<Name, Gfid>,
}

#[derive(Debug, Default)]
struct State {
    dirs: HashMap<Gfid, Held>,
    local: HashMap<Gfid, Local>,
}

/// What a held directory says about a name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Answer {
    /// The directory is not held: ask the brick.
    Unknown,
    /// No such entry.
    Absent,
    /// The entry's object.
    Present(Gfid),
}

#[derive(Debug, Default)]
pub(super) struct Leases {
    state: Mutex<State>,
}

impl Leases {
    /// Whether the mount holds `dir`'s write lease and knows its entries.
    pub(super) fn holds(&self, dir: &Gfid) -> bool {
        self.lock().dirs.contains_key(dir)
    }

    /// Starts holding `dir`, which has no entries (the mount just made it).
    pub(super) fn hold_new(&self, dir: Gfid) {
        self.lock().dirs.insert(dir, Held::default());
    }

    /// Ends the hold on `dir` (recalled, refused or removed): its entries and its objects'
    /// descriptions are forgotten.
    pub(super) fn release(&self, dir: &Gfid) {
        let mut state = self.lock();
        if let Some(held) = state.dirs.remove(dir) {
            for child in held.entries.values() {
                state.local.remove(child);
            }
        }
    }

    /// Ends every hold (the session that held the leases is gone).
    pub(super) fn release_all(&self) {
        let mut state = self.lock();
        state.dirs.clear();
        state.local.clear();
    }

    /// What held directory `dir` has under `name`.
    pub(super) fn lookup(&self, dir: &Gfid, name: &Name) -> Answer {
        match self.lock().dirs.get(dir) {
            None => Answer::Unknown,
            Some(held) => held
                .entries
                .get(name)
                .map_or(Answer::Absent, |g| Answer::Present(*g)),
        }
    }

    /// Whether held directory `dir` has no entries.
    pub(super) fn is_empty(&self, dir: &Gfid) -> bool {
        self.lock()
            .dirs
            .get(dir)
            .is_some_and(|held| held.entries.is_empty())
    }

    /// Records `name` → `gfid` in `dir` if it is held (a name made there, here or on the
    /// brick).
    pub(super) fn add_entry(&self, dir: &Gfid, name: &Name, gfid: Gfid) {
        if let Some(held) = self.lock().dirs.get_mut(dir) {
            held.entries.insert(name.clone(), gfid);
        }
    }

    /// Forgets `name` in `dir` if it is held; the object it named.
    pub(super) fn remove_entry(&self, dir: &Gfid, name: &Name) -> Option<Gfid> {
        self.lock().dirs.get_mut(dir)?.entries.remove(name)
    }

    /// Describes `gfid`, made under a lease, as `iatt`.
    pub(super) fn describe(&self, iatt: Iatt) {
        self.lock().local.insert(iatt.gfid, Local { iatt });
    }

    /// The mount's description of `gfid`, if it has one.
    pub(super) fn local(&self, gfid: &Gfid) -> Option<Local> {
        self.lock().local.get(gfid).cloned()
    }

    /// Forgets the description of `gfid`: the brick describes it from now on.
    pub(super) fn forget_local(&self, gfid: &Gfid) {
        self.lock().local.remove(gfid);
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
}
