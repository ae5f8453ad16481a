//! GFID resolution: from a GFID to a held directory fd (the root, or the GFID → `O_PATH` fd
//! cache), from a name to its GFID (the inode → GFID cache, else its xattr), and from a fop's
//! fd id to the session's open file.

use std::ffi::CString;

use kiln_wire::{Creds, FdId, Gfid, Name};
use rustix::io::Errno;

use super::{Fops, R, lock};
use crate::brick::layout::{open_dir_by_gfid, read_gfid, read_or_heal_gfid};
use crate::brick::{Brick, GLUSTERFS_DIR};
use crate::cache::InodeKey;
use crate::exec::Exec;
use crate::fdtable::{OpenFile, OpenKind, SessionId};
use crate::op::{self, DirFd, FileRef, ObjectPath, Stat, Step, cstr};

/// The mode a rebalance's move leaves on the file it moved away, before it removes its name
/// (GlusterFS's link-file look).
const MOVED_AWAY_MODE: u32 = 0o1000;

/// What an attribute or xattr fop names: an object by its GFID, or one the session holds open
/// (an fd fop: POSIX has it act on the open file, named or not).
#[derive(Debug, Clone, Copy)]
pub(super) enum Named<'a> {
    Gfid(&'a Gfid),
    Open(&'a OpenFile),
}

impl Named<'_> {
    pub(super) fn gfid(&self) -> &Gfid {
        match self {
            Named::Gfid(gfid) => gfid,
            Named::Open(open) => &open.gfid,
        }
    }

    /// The brick's plain fd of an open regular file (not a direct descriptor, which only its
    /// ring can use).
    fn open_file(&self) -> Option<&DirFd> {
        match self {
            Named::Open(OpenFile {
                kind:
                    OpenKind::File {
                        file: FileRef::Fd(fd),
                        ..
                    },
                ..
            }) => Some(fd),
            _ => None,
        }
    }
}

/// An object held by an `O_PATH` fd of its own, and its attributes when it was pinned.
#[derive(Debug)]
pub(super) struct Pinned {
    pub(super) fd: DirFd,
    pub(super) stat: Stat,
}

impl<E: Exec> Fops<E> {
    /// The held `O_PATH` fd of directory `gfid`, from the cache or opened by its handle.
    pub(super) async fn dir(&self, gfid: &Gfid) -> R<DirFd> {
        if gfid.is_root() {
            return Ok(self.brick.root.clone());
        }
        if let Some(dir) = lock(&self.shared.dirs).get(gfid) {
            return Ok(dir);
        }
        // A RENAME replacing its handle meanwhile: looked up again once the move ended.
        const MOVES_WAITED_MAX: usize = 4;
        let mut moves = 0;
        let dir = loop {
            let since = self.shared.moving_dirs.ended();
            let (brick, g) = (self.brick.clone(), *gfid);
            let opened = self.exec.blocking(move || open_dir_by_gfid(&brick, &g, 0));
            match opened.await {
                Err(Errno::STALE)
                    if moves < MOVES_WAITED_MAX
                        && self.shared.moving_dirs.look_again(since).await =>
                {
                    moves += 1;
                }
                opened => break opened?,
            }
        };
        lock(&self.shared.dirs).insert(*gfid, dir.clone());
        Ok(dir)
    }

    /// Holds `dir` as directory `gfid`'s fd (a MKDIR's own open of the directory it made).
    pub(super) fn hold_dir(&self, gfid: Gfid, dir: DirFd) {
        lock(&self.shared.dirs).insert(gfid, dir);
    }

    /// Forgets directory `gfid`'s held fd (it was removed).
    pub(super) fn forget_dir(&self, gfid: &Gfid) {
        lock(&self.shared.dirs).remove(gfid);
    }

    /// The GFID of `dir/name` (whose `statx` is `stat`): cached by inode, else read from its
    /// xattr; an object without one (copied into the brick behind Kiln's back) gets one.
    pub(super) async fn gfid_at(
        &self,
        parent: &Gfid,
        dir: &DirFd,
        name: &[u8],
        stat: &Stat,
    ) -> R<Gfid> {
        let key = InodeKey::of(stat);
        if let Some(g) = lock(&self.gfids).get(&key) {
            return Ok(g);
        }
        let brick = self.brick.clone();
        let (dir, name, parent, is_dir) = (dir.clone(), cstr(name), *parent, stat.is_dir());
        let gfid = self
            .exec
            .blocking(move || read_or_heal_gfid(&brick, &parent, &dir, &name, is_dir))
            .await?;
        lock(&self.gfids).insert(key, gfid);
        Ok(gfid)
    }

    /// [`Fops::gfid_at`] of every `(name, stat)` in `dir` (a directory listing), in order:
    /// those not cached are read in one call on the blocking pool, not one call each.
    pub(super) async fn gfids_at(
        &self,
        parent: &Gfid,
        dir: &DirFd,
        named: &[(Name, Stat)],
    ) -> Vec<R<Gfid>> {
        let mut found: Vec<R<Gfid>> = {
            let mut cached = lock(&self.gfids);
            let mut get = |stat: &Stat| cached.get(&InodeKey::of(stat)).ok_or(Errno::NOENT);
            named.iter().map(|(_, stat)| get(stat)).collect()
        };
        let missing: Vec<(usize, CString, bool)> = (named.iter().zip(&found).enumerate())
            .filter(|(_, (_, cached))| cached.is_err())
            .map(|(i, ((name, stat), _))| (i, cstr(name.as_bytes()), stat.is_dir()))
            .collect();
        if missing.is_empty() {
            return found;
        }
        let (brick, dir, parent) = (self.brick.clone(), dir.clone(), *parent);
        let read = self
            .exec
            .blocking(move || {
                Ok(missing
                    .into_iter()
                    .map(|(i, name, is_dir)| {
                        (i, read_or_heal_gfid(&brick, &parent, &dir, &name, is_dir))
                    })
                    .collect::<Vec<_>>())
            })
            .await;
        match read {
            Ok(read) => {
                let mut cached = lock(&self.gfids);
                for (i, gfid) in read {
                    if let Ok(g) = gfid {
                        cached.insert(InodeKey::of(&named[i].1), g);
                    }
                    found[i] = gfid;
                }
            }
            Err(e) => found
                .iter_mut()
                .filter(|f| f.is_err())
                .for_each(|f| *f = Err(e)),
        }
        found
    }

    /// Remembers that the object `stat` describes carries `gfid`.
    pub(super) fn remember_gfid(&self, stat: &Stat, gfid: Gfid) {
        lock(&self.gfids).insert(InodeKey::of(stat), gfid);
    }

    pub(super) async fn fstat_dir(&self, dir: &DirFd) -> R<Stat> {
        self.run_one(Step::brick(op::Fstat::dir(dir))).await
    }

    /// `statx` of the object `gfid`, following a directory's handle symlink.
    pub(super) async fn stat_gfid(&self, gfid: &Gfid) -> R<Stat> {
        if gfid.is_root() || lock(&self.shared.dirs).get(gfid).is_some() {
            return Ok(self.pin_dir(gfid).await?.stat);
        }
        let step = Step::brick(op::Statx::of(
            self.brick.handle_dir(gfid),
            &Brick::handle_name(gfid),
        ));
        let stat: Stat = match self.run_one(step).await {
            Err(Errno::NOENT | Errno::NOTDIR) => return Err(Errno::STALE),
            other => other?,
        };
        if !stat.is_symlink() {
            return Ok(stat);
        }
        // A symlink handle is either a user's symlink (a hard link carrying the GFID) or a
        // directory's handle (a separate symlink with no GFID of its own).
        match self.is_own_handle(gfid).await {
            true => Ok(stat),
            false => Ok(self.pin_dir(gfid).await?.stat),
        }
    }

    /// A path that reaches `object`: an open regular file through the brick's fd, anything
    /// else as [`Fops::object_path`]. The caller moves it into the blocking job that uses it,
    /// which keeps its fd N open, so N cannot be reused for another object before the call.
    pub(super) async fn named_path(&self, object: Named<'_>) -> R<ObjectPath> {
        match object.open_file() {
            Some(file) => Ok(ObjectPath::Open(self.pin_open(file).await?.fd)),
            None => self.object_path(object.gfid()).await,
        }
    }

    /// A path that reaches the object `gfid` itself: a directory through its own held fd, no
    /// search permission on it needed; anything else through its handle, never followed.
    pub(super) async fn object_path(&self, gfid: &Gfid) -> R<ObjectPath> {
        let stat = self.stat_gfid(gfid).await?;
        if stat.is_dir() {
            return Ok(ObjectPath::Dir(self.dir(gfid).await?));
        }
        self.brick.ensure_handle_parent(gfid)?;
        Ok(ObjectPath::Handle(
            self.brick.handle_dir(gfid).clone(),
            Brick::handle_name(gfid),
        ))
    }

    /// Holds `object`: an open regular file by the brick's fd of it, anything else as
    /// [`Fops::pin`].
    pub(super) async fn pin_named(&self, object: Named<'_>) -> R<Pinned> {
        match object.open_file() {
            Some(file) => self.pin_open(file).await,
            None => self.pin(object.gfid()).await,
        }
    }

    /// Holds the open regular file `file`; ESTALE for what a finished move left behind (no
    /// name, a moved-away mode): the client then follows the file to where it is now rather
    /// than change a copy nobody reaches.
    async fn pin_open(&self, file: &DirFd) -> R<Pinned> {
        let stat = self.fstat_dir(file).await?;
        if stat.nlink == 0 && stat.mode & 0o7777 == MOVED_AWAY_MODE {
            return Err(Errno::STALE);
        }
        Ok(Pinned {
            fd: file.clone(),
            stat,
        })
    }

    /// Holds the object `gfid` by an `O_PATH` fd of its own, with its attributes: calls made
    /// through it reach this inode whatever happens to its names, and never what a symlink
    /// points at.
    pub(super) async fn pin(&self, gfid: &Gfid) -> R<Pinned> {
        if gfid.is_root() || lock(&self.shared.dirs).get(gfid).is_some() {
            return self.pin_dir(gfid).await;
        }
        let open = op::Open::path(self.brick.handle_dir(gfid), &Brick::handle_name(gfid));
        let fd = match self.hold(Step::brick(open)).await {
            Err(Errno::NOENT | Errno::NOTDIR) => return Err(Errno::STALE),
            held => held?,
        };
        let stat = self.fstat_dir(&fd).await?;
        if stat.is_symlink() && !self.is_own_handle(gfid).await {
            // A directory's handle: a symlink with no GFID of its own.
            return self.pin_dir(gfid).await;
        }
        Ok(Pinned { fd, stat })
    }

    /// `dir/name` itself (never what a symlink points at), held by an `O_PATH` fd and looked
    /// up as the caller.
    pub(super) async fn hold_as(&self, creds: &Creds, dir: &DirFd, name: &CString) -> R<DirFd> {
        self.hold(Step::caller(op::Open::path(dir, name), creds))
            .await
    }

    /// Runs an `O_PATH` open ([`op::Open::path`]): the plain fd it gives.
    async fn hold(&self, open: Step) -> R<DirFd> {
        match self.run_one::<FileRef>(open).await? {
            FileRef::Fd(fd) => Ok(fd),
            _ => Err(op::invariant("a plain open gave a direct descriptor")),
        }
    }

    /// Directory `gfid` by its held fd; ESTALE once it is removed (an fd opened before an
    /// RMDIR and cached after it is forgotten here).
    async fn pin_dir(&self, gfid: &Gfid) -> R<Pinned> {
        let fd = self.dir(gfid).await?;
        let stat = self.fstat_dir(&fd).await?;
        if stat.nlink == 0 {
            self.forget_dir(gfid);
            return Err(Errno::STALE);
        }
        Ok(Pinned { fd, stat })
    }

    /// Whether `gfid`'s handle carries `gfid` itself (a file's or a user's symlink's hard
    /// link), rather than being a directory's handle symlink.
    async fn is_own_handle(&self, gfid: &Gfid) -> bool {
        let brick = self.brick.clone();
        let g = *gfid;
        let own = self
            .exec
            .blocking(move || read_gfid(brick.handle_dir(&g), &Brick::handle_name(&g)))
            .await;
        own == Ok(Some(*gfid))
    }

    /// Refuses names a client may not use in the root: `.glusterfs` is the brick's own.
    pub(super) fn check_entry(parent: &Gfid, name: &Name) -> R<()> {
        match parent.is_root() && name.as_bytes() == GLUSTERFS_DIR.as_bytes() {
            true => Err(Errno::PERM),
            false => Ok(()),
        }
    }

    pub(super) fn open_file(&self, session: SessionId, fd: FdId) -> R<OpenFile> {
        let sessions = lock(&self.sessions);
        sessions
            .get(&session)
            .ok_or(Errno::BADF)?
            .fds
            .get(fd)
            .cloned()
    }

    /// Adds an open file to the session's table; EBADF when the session is not open (it
    /// ended while the fop ran), EMFILE at the session's limit.
    /// EMFILE when `session` could open no more files.
    pub(super) fn check_room(&self, session: SessionId) -> R<()> {
        lock(&self.sessions)
            .get(&session)
            .ok_or(Errno::BADF)?
            .fds
            .check_room()
    }

    pub(super) fn insert_open(&self, session: SessionId, file: OpenFile) -> R<FdId> {
        let mut sessions = lock(&self.sessions);
        sessions
            .get_mut(&session)
            .ok_or(Errno::BADF)?
            .fds
            .insert(file)
    }
}
