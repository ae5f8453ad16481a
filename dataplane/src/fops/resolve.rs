//! GFID resolution: from a GFID to a held directory fd (the root, or the GFID → `O_PATH` fd
//! cache), from a name to its GFID (the inode → GFID cache, else its xattr), and from a fop's
//! fd id to the session's open file.

use std::ffi::CString;

use kiln_wire::{FdId, Gfid, Name};
use rustix::io::Errno;

use super::{Fops, R, lock};
use crate::brick::layout::{open_dir_by_gfid, read_gfid, read_or_heal_gfid};
use crate::brick::{Brick, GLUSTERFS_DIR};
use crate::cache::InodeKey;
use crate::exec::Exec;
use crate::fdtable::{FdTable, OpenFile, SessionId};
use crate::op::{self, DirFd, Stat, Step, cstr, proc_path};

impl<E: Exec> Fops<E> {
    /// The held `O_PATH` fd of directory `gfid`, from the cache or opened by its handle.
    pub(super) async fn dir(&self, gfid: &Gfid) -> R<DirFd> {
        if gfid.is_root() {
            return Ok(self.brick.root.clone());
        }
        if let Some(dir) = lock(&self.dirs).get(gfid) {
            return Ok(dir);
        }
        let brick = self.brick.clone();
        let g = *gfid;
        let dir = self
            .exec
            .blocking(move || open_dir_by_gfid(&brick, &g, 0))
            .await?;
        lock(&self.dirs).insert(*gfid, dir.clone());
        Ok(dir)
    }

    /// Forgets directory `gfid`'s held fd (it was removed).
    pub(super) fn forget_dir(&self, gfid: &Gfid) {
        lock(&self.dirs).remove(gfid);
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

    /// Remembers that the object `stat` describes carries `gfid`.
    pub(super) fn remember_gfid(&self, stat: &Stat, gfid: Gfid) {
        lock(&self.gfids).insert(InodeKey::of(stat), gfid);
    }

    pub(super) async fn fstat_dir(&self, dir: &DirFd) -> R<Stat> {
        self.run_one(Step::brick(op::Fstat::dir(dir))).await
    }

    /// `statx` of the object `gfid`, following a directory's handle symlink.
    pub(super) async fn stat_gfid(&self, gfid: &Gfid) -> R<Stat> {
        if gfid.is_root() || lock(&self.dirs).get(gfid).is_some() {
            return self.fstat_dir(&self.dir(gfid).await?).await;
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
        let brick = self.brick.clone();
        let g = *gfid;
        let own = self
            .exec
            .blocking(move || read_gfid(&proc_path(brick.handle_dir(&g), &Brick::handle_name(&g))))
            .await;
        match own {
            Ok(Some(found)) if found == *gfid => Ok(stat),
            _ => self.fstat_dir(&self.dir(gfid).await?).await,
        }
    }

    /// A directory fd and name that reach the object `gfid` itself: its handle for
    /// non-directories, the directory's own fd (and an empty name) for directories.
    pub(super) async fn object_path(&self, gfid: &Gfid) -> R<(DirFd, CString)> {
        let stat = self.stat_gfid(gfid).await?;
        if stat.is_dir() {
            return Ok((self.dir(gfid).await?, CString::default()));
        }
        self.brick.ensure_handle_parent(gfid)?;
        Ok((
            self.brick.handle_dir(gfid).clone(),
            Brick::handle_name(gfid),
        ))
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
            .and_then(Option::as_ref)
            .ok_or(Errno::BADF)?
            .get(fd)
            .cloned()
    }

    /// Adds an open file to the session's table; EBADF when the session has ended.
    pub(super) fn insert_open(&self, session: SessionId, file: OpenFile) -> R<FdId> {
        let limit = self.config.open_files_per_client_max;
        let mut sessions = lock(&self.sessions);
        let table = sessions
            .entry(session)
            .or_insert_with(|| Some(FdTable::new(limit)));
        table.as_mut().ok_or(Errno::BADF)?.insert(file)
    }
}
