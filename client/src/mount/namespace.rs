//! Namespace fops — MKDIR, MKNOD, SYMLINK, LINK, UNLINK, RMDIR, RENAME, and the close that
//! sends a small new file — answered by the mount under a directory's write lease and sent
//! behind ([`super::behind`]), or run on the brick after the queued changes they depend on.
//!
//! A fop is answered here only when the mount knows its outcome: the directory is held
//! ([`super::leases`]), the names it needs are known to be there or absent, the caller's
//! permission follows from the directory's mode bits, and no open handle needs the brick's
//! file first. Anything else goes to the brick, and what it changes in a held directory is
//! recorded there too, so a held directory's entries stay exact.
//!
//! This module also runs the two tasks of a mount with leases: the sender of queued changes
//! and the listener for the brick's recalls.

use std::sync::Arc;

use fuser::{Errno, FileAttr};
use kiln_wire::{
    Creds, FileType, FopReply, FopRequest, Gfid, Iatt, Lease, LeaseKind, Name, Recall, RenameMode,
    SetAttr, TimeSet, XattrPresence,
};

use super::behind;
use super::convert::{Result, errno};
use super::leases::{Answer, KeptListing, new_iatt, now};
use super::pending::ParentAttr;
use super::shared::{Shared, Ttl};
use crate::{Error, Layer, LayerEvent};

/// How long queued changes wait for an unreachable brick before they fail.
const BRICK_AWAY_LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

/// How long a recall lets the files of the directory still being written be closed before it
/// sends them as they are: one written at once (tar, cp) is then whole when another client
/// first sees it, not cut where its writer was.
const RECALL_CLOSE_GRACE: std::time::Duration = std::time::Duration::from_millis(50);

/// What a write lease asked with a fop is for.
#[derive(Debug, Clone, Copy)]
enum Want {
    /// The directory the fop makes: held, with no entries, once granted.
    NewDir,
    /// An existing directory the fop changes: held for writing, with what the mount knows
    /// of its entries, once granted.
    Existing,
}

/// A namespace fop as the mount sees it: which names in which directories it needs.
#[derive(Debug, Clone)]
enum Change {
    Make {
        parent: Gfid,
        name: Name,
        gfid: Gfid,
    },
    Unlink {
        parent: Gfid,
        name: Name,
    },
    Rmdir {
        parent: Gfid,
        name: Name,
    },
    Rename {
        parent: Gfid,
        name: Name,
        new_parent: Gfid,
        new_name: Name,
        mode: RenameMode,
    },
}

impl Change {
    fn of(fop: &FopRequest) -> Option<Change> {
        Some(match fop {
            FopRequest::Mkdir(r) => Change::Make {
                parent: r.parent,
                name: r.name.clone(),
                gfid: r.gfid,
            },
            FopRequest::Mknod(r) => Change::Make {
                parent: r.parent,
                name: r.name.clone(),
                gfid: r.gfid,
            },
            FopRequest::Symlink(r) => Change::Make {
                parent: r.parent,
                name: r.name.clone(),
                gfid: r.gfid,
            },
            FopRequest::Link(r) => Change::Make {
                parent: r.new_parent,
                name: r.new_name.clone(),
                gfid: r.gfid,
            },
            FopRequest::Unlink(r) => Change::Unlink {
                parent: r.parent,
                name: r.name.clone(),
            },
            FopRequest::Rmdir(r) => Change::Rmdir {
                parent: r.parent,
                name: r.name.clone(),
            },
            FopRequest::Rename(r) => Change::Rename {
                parent: r.old_parent,
                name: r.old_name.clone(),
                new_parent: r.new_parent,
                new_name: r.new_name.clone(),
                mode: r.mode,
            },
            _ => return None,
        })
    }

    /// The directories whose queued changes must reach the brick before this fop does.
    fn parents(&self) -> Vec<Gfid> {
        match self {
            Change::Make { parent, .. }
            | Change::Unlink { parent, .. }
            | Change::Rmdir { parent, .. } => vec![*parent],
            Change::Rename {
                parent, new_parent, ..
            } => vec![*parent, *new_parent],
        }
    }
}

impl<L: Layer> Shared<L> {
    /// Whether this mount may answer fops under leases: the option is on and the brick
    /// grants them.
    pub(super) fn uses_leases(&self) -> bool {
        self.options.leases && self.layer.leases()
    }

    /// Whether this mount takes read leases on the files it reads: with leases, the option
    /// on, and the bricks granting them.
    pub(super) fn uses_file_leases(&self) -> bool {
        self.uses_leases() && self.options.file_leases && self.layer.file_leases()
    }

    /// The listing kept of held directory `dir`, if one may answer now
    /// ([`super::leases::Leases::kept_listing`]).
    pub(super) fn kept_listing(&self, dir: &Gfid) -> Option<Arc<KeptListing>> {
        let covered = self.options.listed_attrs && self.layer.listed_attrs();
        let max_age = self.options.attr_timeout;
        self.leases.kept_listing(dir, max_age, covered)
    }

    /// Whether kept listings answer the LOOKUPs and GETATTRs of what they list: with leases,
    /// where the kernel checks permissions itself (the brick is not asked).
    pub(super) fn answers_from_listings(&self) -> bool {
        self.uses_leases() && self.options.default_permissions
    }

    /// What the kept listing of held directory `dir` says of `gfid` (its attributes and
    /// probed xattrs), while it may answer.
    pub(super) fn listed(&self, dir: &Gfid, gfid: &Gfid) -> Option<(Iatt, XattrPresence)> {
        if !self.answers_from_listings() {
            return None;
        }
        let kept = self.kept_listing(dir)?;
        let entry = kept.entry(gfid)?;
        Some((entry.iatt.clone(), entry.xattrs))
    }

    /// MKNOD, MKDIR, SYMLINK or LINK (`fop`) as `c`: the new entry.
    pub(super) async fn make_name(&self, c: &Creds, fop: FopRequest) -> Result<(FileAttr, Ttl)> {
        let Some(Change::Make { parent, name, gfid }) = Change::of(&fop) else {
            return Err(Errno::EINVAL);
        };
        if let Some(iatt) = self.make_behind(c, &fop, &parent, &name).await? {
            return Ok(self.entry(&iatt));
        }
        self.settle_dir(None).await;
        self.behind.settle(&parent).await;
        // A new directory comes with its write lease, in the same round trip.
        let mut wants = self.write_leases_for(&[parent]);
        if matches!(fop, FopRequest::Mkdir(_)) && self.uses_leases() {
            wants.push((gfid, Want::NewDir));
        }
        let is_dir = matches!(fop, FopRequest::Mkdir(_));
        let is_link = matches!(fop, FopRequest::Link(_));
        if is_link {
            // Its reply carries the file's attributes.
            self.send_undescribed_writes().await;
        }
        let reply = self.call_with_leases(c, fop, &wants).await;
        if reply.is_ok() {
            self.leases.add_entry(&parent, &name, gfid);
            self.touch_dir(&parent, i32::from(is_dir));
            if is_link {
                self.linked(&gfid, &parent);
            }
        }
        self.new_entry(reply)
    }

    /// Object `gfid` got a name in `dir` on the brick: one link more in the mount's
    /// description, kept only if `dir` is held (else another client may reach the object
    /// there without a recall).
    fn linked(&self, gfid: &Gfid, dir: &Gfid) {
        if !self.leases.holds(dir) {
            self.leases.forget_local(gfid);
            return;
        }
        let now = now();
        self.leases.update_local(gfid, |iatt| {
            iatt.nlink += 1;
            iatt.ctime = now;
        });
    }

    /// The write leases to ask with a change in `dirs`: those the mount does not hold for
    /// writing (the change is where the mount starts writing there).
    fn write_leases_for(&self, dirs: &[Gfid]) -> Vec<(Gfid, Want)> {
        if !self.uses_leases() {
            return Vec::new();
        }
        dirs.iter()
            .filter(|d| self.leases.asks_write(d))
            .map(|d| (*d, Want::Existing))
            .collect()
    }

    /// Asks, in the background, for the write lease on directory `ino`, where the mount
    /// made a file without it (a create, whose PUT goes alone).
    pub(super) fn ask_write_lease(self: &Arc<Self>, c: &Creds, ino: u64) {
        let Some(dir) = self.inodes.gfid(ino) else {
            return;
        };
        if !self.uses_leases() || !self.leases.asks_write(&dir) {
            return;
        }
        let (s, c) = (self.clone(), c.clone());
        tokio::spawn(async move {
            let recalls = s.leases.recalls();
            let lease = Lease {
                gfid: dir,
                kind: LeaseKind::Write,
            };
            let granted = s.layer.call(&c, lease.into()).await;
            if matches!(granted, Ok(FopReply::Lease(r)) if r.kind == LeaseKind::Write)
                && s.leases.take_grant(&dir, recalls)
            {
                s.leases.hold_write(dir);
            }
        });
    }

    /// Runs `fop`, asking in the same batch for the write leases `wants`; the fop's reply.
    async fn call_with_leases(
        &self,
        c: &Creds,
        fop: FopRequest,
        wants: &[(Gfid, Want)],
    ) -> std::result::Result<FopReply, Error> {
        if wants.is_empty() {
            return self.layer.call(c, fop).await;
        }
        let mut batch = kiln_wire::Batch::new(c.clone());
        let leases = wants.iter().map(|(gfid, _)| {
            FopRequest::from(Lease {
                gfid: *gfid,
                kind: LeaseKind::Write,
            })
        });
        for fop in std::iter::once(fop).chain(leases) {
            batch.push(fop).map_err(|e| Error::Misuse(e.to_string()))?;
        }
        let recalls = self.leases.recalls();
        let mut results = self.layer.batch(batch).await?.results.into_iter();
        let reply = results
            .next()
            .ok_or(Error::Fop(kiln_wire::ErrorCode::Io))??;
        for ((gfid, want), granted) in wants.iter().zip(results) {
            if matches!(granted, Ok(FopReply::Lease(r)) if r.kind == LeaseKind::Write)
                && self.leases.take_grant(gfid, recalls)
            {
                match want {
                    Want::NewDir => self.leases.hold_new(*gfid),
                    Want::Existing => self.leases.hold_write(*gfid),
                }
            }
        }
        Ok(reply)
    }

    /// Answers a make in a held directory here and queues it; `None` when the brick must.
    async fn make_behind(
        &self,
        c: &Creds,
        fop: &FopRequest,
        parent: &Gfid,
        name: &Name,
    ) -> Result<Option<Iatt>> {
        if !self.uses_leases() || matches!(fop, FopRequest::Link(_)) {
            return Ok(None);
        }
        let Some(dir) = self.writable_held_dir(c, parent) else {
            return Ok(None);
        };
        match self.leases.lookup(parent, name) {
            Answer::Absent => {}
            Answer::Present(_) => return Err(Errno::EEXIST),
            // Entries not all known: the brick says.
            Answer::Unknown => return Ok(None),
        }
        let gid = if dir.mode & libc::S_ISGID != 0 {
            dir.gid
        } else {
            c.gid
        };
        let iatt = match fop {
            FopRequest::Mkdir(r) => {
                // A set-group-ID directory's subdirectories inherit the bit.
                let sgid = dir.mode & libc::S_ISGID;
                let mode = (r.mode.bits() & !r.umask.bits()) | sgid;
                new_iatt(r.gfid, FileType::Directory, mode, c.uid, gid, 0)
            }
            FopRequest::Symlink(r) => {
                let size = r.target.len() as u64;
                new_iatt(r.gfid, FileType::Symlink, 0o777, c.uid, gid, size)
            }
            FopRequest::Mknod(r) => {
                let mode = r.mode.bits() & !r.umask.bits();
                let mut iatt = new_iatt(r.gfid, r.node_type.into(), mode, c.uid, gid, 0);
                iatt.rdev = r.rdev;
                iatt
            }
            _ => return Ok(None),
        };
        let gfid = iatt.gfid;
        self.leases.add_entry(parent, name, gfid);
        self.leases.describe(iatt.clone());
        let is_dir = iatt.file_type == FileType::Directory;
        self.touch_dir(parent, if is_dir { 1 } else { 0 });
        self.behind.push(c, fop.clone(), &[gfid, *parent]).await;
        if is_dir {
            self.leases.hold_new(gfid);
            let lease = Lease {
                gfid,
                kind: LeaseKind::Write,
            };
            self.behind.push(c, lease.into(), &[gfid]).await;
        }
        Ok(Some(iatt))
    }

    /// The permission bits of held directory `dir` when `c` may make and remove names in it
    /// without asking: write and search permission, and no sticky bit (whose rule needs the
    /// owners of the entries); none while the brick refuses changes for want of space.
    fn writable_held_dir(&self, c: &Creds, dir: &Gfid) -> Option<ParentAttr> {
        if !self.leases.holds(dir) || self.behind.short_of_space() {
            return None;
        }
        let ino = self.inodes.ino_of(dir)?;
        self.inodes
            .dir_attr(ino)
            .filter(|a| a.mode & libc::S_ISVTX == 0 && a.allows_create(c))
    }

    /// Bumps the mount's description of directory `dir` after a change of its entries:
    /// times now, `links` more (or fewer) subdirectories.
    pub(super) fn touch_dir(&self, dir: &Gfid, links: i32) {
        let now = now();
        self.leases.update_local(dir, |iatt| {
            iatt.mtime = now;
            iatt.ctime = now;
            iatt.nlink = iatt.nlink.saturating_add_signed(links);
        });
    }

    /// Moves the ctime in the mount's description of `gfid` on (a rename, an xattr set or
    /// removed).
    pub(super) fn touch_ctime(&self, gfid: &Gfid) {
        let now = now();
        self.leases.update_local(gfid, |iatt| iatt.ctime = now);
    }

    /// Object `gfid` lost a name: one link fewer in the mount's description, which goes
    /// with its last link.
    fn unlinked(&self, gfid: &Gfid) {
        let now = now();
        let left = self.leases.update_local(gfid, |iatt| {
            iatt.nlink = iatt.nlink.saturating_sub(1);
            iatt.ctime = now;
        });
        if left.is_some_and(|iatt| iatt.nlink == 0) {
            self.leases.forget_local(gfid);
        }
    }

    /// Whether the mount describes `gfid` as a directory (`None`: it does not describe it).
    fn is_local_dir(&self, gfid: &Gfid) -> Option<bool> {
        let local = self.leases.local(gfid)?;
        Some(local.iatt.file_type == FileType::Directory)
    }

    /// UNLINK, RMDIR or RENAME (`fop`) as `c`.
    pub(super) async fn change_names(&self, c: &Creds, fop: FopRequest) -> Result<()> {
        let Some(change) = Change::of(&fop) else {
            return Err(Errno::EINVAL);
        };
        if self.uses_leases() && self.change_behind(c, &fop, &change).await? {
            return Ok(());
        }
        // On the brick: the deferred creates and queued changes first, and, where the change
        // may take a file away, every open handle gets its fd (a removed file must stay
        // readable through it), those opened while the removal runs too.
        self.settle_dir(None).await;
        for parent in change.parents() {
            self.behind.settle(&parent).await;
        }
        let removal = self
            .may_remove_a_file(&change)
            .then(|| self.handles.removal());
        if removal.is_some() {
            self.anchor_handles().await;
        }
        let wants = self.write_leases_for(&change.parents());
        self.call_with_leases(c, fop, &wants).await.map_err(errno)?;
        let removed = self.note_changed(&change);
        self.give_back_removed(removed).await;
        Ok(())
    }

    /// Gives back the read lease this mount holds on file `removed`, if any, whose name it
    /// just removed: the file may be gone from the brick, whose removal by this mount
    /// recalled nothing, and a lease on a gone file covers nothing (an open of it answered
    /// without the brick would fail at its first read). Queued behind the removal.
    async fn give_back_removed(&self, removed: Option<Gfid>) {
        let Some(gfid) = removed.filter(|g| self.files.forget(g)) else {
            return;
        };
        let lease = Lease {
            gfid,
            kind: LeaseKind::None,
        };
        self.behind
            .push(&Creds::root(), lease.into(), &[gfid])
            .await;
    }

    /// Answers a removal or rename here and queues it, when every name it needs is in a held
    /// directory and no open handle is in the way; `false` when the brick must.
    async fn change_behind(&self, c: &Creds, fop: &FopRequest, change: &Change) -> Result<bool> {
        for parent in change.parents() {
            if self.writable_held_dir(c, &parent).is_none() {
                return Ok(false);
            }
        }
        // Noted before it looks for open handles, kept until the brick has answered it.
        let removal = self.handles.removal();
        let (object, gone) = match change {
            Change::Make { .. } => return Ok(false),
            Change::Unlink { parent, name } => match self.leases.lookup(parent, name) {
                Answer::Present(g) if !self.is_open(&g) => (g, None),
                Answer::Absent => return Err(Errno::ENOENT),
                _ => return Ok(false),
            },
            Change::Rmdir { parent, name } => match self.leases.lookup(parent, name) {
                Answer::Present(g) if self.leases.is_empty(&g) => (g, None),
                Answer::Present(g) if self.leases.knows_all(&g) => return Err(Errno::ENOTEMPTY),
                Answer::Absent => return Err(Errno::ENOENT),
                _ => return Ok(false),
            },
            Change::Rename {
                parent,
                name,
                new_parent,
                new_name,
                mode,
            } => {
                // A file still open may be renamed behind (its handles reach it by GFID),
                // once its create is on the brick or queued before the rename.
                let source = match self.leases.lookup(parent, name) {
                    Answer::Present(g) if !self.is_deferred(&g) => g,
                    Answer::Absent => return Err(Errno::ENOENT),
                    _ => return Ok(false),
                };
                match (self.leases.lookup(new_parent, new_name), mode) {
                    (Answer::Absent, RenameMode::Replace | RenameMode::NoReplace) => (source, None),
                    (Answer::Present(_), RenameMode::NoReplace) => return Err(Errno::EEXIST),
                    // Replacing a file nobody has open, or an empty directory held here.
                    (Answer::Present(t), RenameMode::Replace)
                        if t != source
                            && !self.is_open(&t)
                            && (!self.leases.holds(&t) || self.leases.is_empty(&t)) =>
                    {
                        (source, Some(t))
                    }
                    _ => return Ok(false),
                }
            }
        };
        let mut touches = vec![object];
        touches.extend(gone);
        touches.extend(change.parents());
        let removed = self.note_changed(change);
        // A rename that replaces nothing takes no file away.
        let takes_a_file = !matches!(change, Change::Rename { .. }) || gone.is_some();
        let removal = takes_a_file.then_some(removal);
        self.behind
            .push_removal(c, fop.clone(), &touches, removal)
            .await;
        self.give_back_removed(removed).await;
        Ok(true)
    }

    /// Whether `change` may take a name's file away: all but a rename that replaces no
    /// name (an exchange, or onto a name taken by nothing or known free).
    fn may_remove_a_file(&self, change: &Change) -> bool {
        match change {
            Change::Rename {
                new_parent,
                new_name,
                mode,
                ..
            } => {
                *mode == RenameMode::Replace
                    && !matches!(self.leases.lookup(new_parent, new_name), Answer::Absent)
            }
            _ => true,
        }
    }

    /// Records in the held directories what `change` did there; the object whose name it
    /// removed, where the mount knew it (it may have no name left).
    fn note_changed(&self, change: &Change) -> Option<Gfid> {
        let mut removed = None;
        match change {
            Change::Make { .. } => {}
            Change::Unlink { parent, name } => {
                if let Some(g) = self.leases.remove_entry(parent, name) {
                    self.unlinked(&g);
                    removed = Some(g);
                }
                self.touch_dir(parent, 0);
            }
            Change::Rmdir { parent, name } => {
                if let Some(g) = self.leases.remove_entry(parent, name) {
                    self.leases.release(&g);
                    self.leases.forget_local(&g);
                }
                self.touch_dir(parent, -1);
            }
            Change::Rename {
                parent,
                name,
                new_parent,
                new_name,
                mode: RenameMode::Exchange,
            } => {
                let source = self.leases.remove_entry(parent, name);
                let target = self.leases.remove_entry(new_parent, new_name);
                if let (Some(source), Some(target)) = (source, target) {
                    self.leases.add_entry(new_parent, new_name, source);
                    self.leases.add_entry(parent, name, target);
                    self.touch_ctime(&source);
                    self.touch_ctime(&target);
                    if parent != new_parent {
                        // Link counts move with a directory's `..`: the brick counts them.
                        for gfid in [&source, &target, parent, new_parent] {
                            self.leases.forget_local(gfid);
                        }
                    }
                } else {
                    // Names this mount did not know: it knows nothing there any more.
                    self.leases.release(parent);
                    self.leases.release(new_parent);
                }
                self.touch_dir(parent, 0);
                self.touch_dir(new_parent, 0);
            }
            Change::Rename {
                parent,
                name,
                new_parent,
                new_name,
                ..
            } => {
                let source = self.leases.remove_entry(parent, name);
                let moved_dir = source.and_then(|g| self.is_local_dir(&g));
                self.touch_dir(parent, 0);
                self.touch_dir(new_parent, 0);
                if let Some(replaced) = self.leases.remove_entry(new_parent, new_name) {
                    match self.is_local_dir(&replaced) {
                        Some(true) => self.touch_dir(new_parent, -1),
                        Some(false) => {}
                        // What it was is not known here: the brick counts the links.
                        None => self.leases.forget_local(new_parent),
                    }
                    self.leases.release(&replaced);
                    self.unlinked(&replaced);
                    removed = Some(replaced);
                }
                match source {
                    Some(source) => {
                        self.leases.add_entry(new_parent, new_name, source);
                        self.touch_ctime(&source);
                        if !self.leases.holds(new_parent) {
                            // Described only where no other client reaches it unrecalled.
                            self.leases.forget_local(&source);
                        }
                    }
                    None => self.leases.forget_name(new_parent, new_name),
                }
                if parent != new_parent {
                    match moved_dir {
                        // Its `..` moves: one link fewer here, one more there.
                        Some(true) => {
                            self.touch_dir(parent, -1);
                            self.touch_dir(new_parent, 1);
                        }
                        Some(false) => {}
                        None => {
                            self.leases.forget_local(parent);
                            self.leases.forget_local(new_parent);
                        }
                    }
                }
            }
        }
        removed
    }

    /// Whether a handle is open on object `gfid` (its removal must wait for the brick).
    fn is_open(&self, gfid: &Gfid) -> bool {
        self.inodes
            .ino_of(gfid)
            .is_some_and(|ino| self.handles.any_on(ino).is_some())
    }

    /// Whether object `gfid` is a file made here whose create is not yet sent (or is being
    /// sent): a change to its name must wait for it.
    fn is_deferred(&self, gfid: &Gfid) -> bool {
        self.inodes
            .ino_of(gfid)
            .is_some_and(|ino| self.pending.contains(ino))
    }

    /// SETATTR of `gfid`, made under a lease and still queued, answered here: the creator or
    /// root changing mode, times, or (root) owners. `None` when the brick must answer.
    pub(super) async fn setattr_behind(
        &self,
        c: &Creds,
        gfid: &Gfid,
        attr: SetAttr,
    ) -> Option<Iatt> {
        let local = self.leases.local(gfid)?;
        let creator = c.uid == 0 || c.uid == local.iatt.uid;
        let owners = attr.uid.is_none() && attr.gid.is_none();
        if !creator || attr.size.is_some() || (c.uid != 0 && !owners) {
            return None;
        }
        let now = now();
        let at = |t: TimeSet| match t {
            TimeSet::Now => TimeSet::At(now),
            at => at,
        };
        let attr = SetAttr {
            atime: attr.atime.map(at),
            mtime: attr.mtime.map(at),
            ..attr
        };
        let iatt = self.leases.update_local(gfid, |iatt| {
            apply(iatt, &attr);
            iatt.ctime = now;
        })?;
        let setattr = kiln_wire::Setattr { gfid: *gfid, attr };
        self.behind.push(c, setattr.into(), &[*gfid]).await;
        Some(iatt)
    }

    /// Sends the queued changes, one batch at a time, until the mount goes.
    pub(super) async fn send_behind(self: Arc<Self>) {
        loop {
            let (batch, sent) = self.behind.next_batch().await;
            let (results, repeated) = match self.send_batch(batch).await {
                Ok((reply, repeated)) => (checked(&sent, reply.results), repeated),
                Err(e) => (behind::all_failed(&sent, &e), false),
            };
            for (queued, result) in sent.iter().zip(&results) {
                if let Ok(reply) = result {
                    self.note_data_change(reply);
                }
                if let FopRequest::Lease(asked) = &queued.fop
                    && asked.kind != LeaseKind::None
                    && !matches!(result, Ok(FopReply::Lease(r)) if r.kind == asked.kind)
                {
                    self.leases.release(&asked.gfid);
                }
            }
            let outcomes: Vec<_> = sent
                .iter()
                .zip(results)
                .map(|(queued, result)| outcome(&queued.fop, result, repeated))
                .collect();
            self.behind.answered(&sent, &outcomes);
            // A removal's object is the brick's to describe again. What was made or
            // changed here keeps the mount's description (it is the brick's now), as long as
            // its directory is held and nothing changes it on the brick.
            for (queued, outcome) in sent.iter().zip(&outcomes) {
                if outcome.is_err() {
                    for gfid in queued.touches() {
                        if !self.behind.is_dirty(gfid) {
                            self.leases.forget_local(gfid);
                        }
                    }
                }
            }
        }
    }

    /// Sends `batch`, again and again while the brick cannot be reached (it may be
    /// restarting), for at most [`BRICK_AWAY_LIMIT`]. Whether it was sent more than once
    /// after a connection broke under it (it may have run).
    async fn send_batch(
        &self,
        batch: kiln_wire::Batch,
    ) -> std::result::Result<(kiln_wire::BatchReply, bool), Error> {
        let started = std::time::Instant::now();
        let mut pause = std::time::Duration::from_millis(50);
        let mut repeated = false;
        loop {
            match self.layer.batch(batch.clone()).await {
                Ok(reply) => return Ok((reply, repeated)),
                Err(e @ (Error::Disconnected(_) | Error::Connect { .. }))
                    if started.elapsed() < BRICK_AWAY_LIMIT =>
                {
                    // Names made are recognised by their GFIDs when sent again; a removal
                    // already done is no error ([`outcome`]).
                    repeated |= matches!(e, Error::Disconnected(_));
                    tracing::debug!(error = %e, "changes made behind wait for the brick");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(std::time::Duration::from_secs(2));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Waits, at most [`RECALL_CLOSE_GRACE`], until no deferred create in directory `dir` is
    /// open.
    async fn let_writers_close(&self, dir: Gfid) {
        let deadline = std::time::Instant::now() + RECALL_CLOSE_GRACE;
        while !self.pending.is_empty() && std::time::Instant::now() < deadline {
            let deferred = self.pending.in_dir(Some(dir)).await;
            if deferred.iter().all(|&ino| self.handles.open_on(ino) == 0) {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    /// Answers the recall of `recall`'s lease: what was changed under it goes to the brick,
    /// what the kernel was told from it goes stale, and the lease goes back.
    async fn give_back(&self, recall: Recall) {
        // Files made here and still deferred, open or not, go to the brick first, after what
        // is queued behind: their creators were told they exist, and the close of one closed
        // without a FLUSH could not report a create refused once the lease is gone.
        self.let_writers_close(recall.gfid).await;
        self.settle_dir(Some(recall.gfid)).await;
        // What the kernel was told from the mount's descriptions and entries goes stale with
        // the lease: another client is about to change it.
        let mut described = self.leases.described_in(&recall.gfid);
        // The objects its listing showed too: the recall may be for a change to one of them.
        described.extend(self.leases.listed_in(&recall.gfid));
        self.anchor_handles_on(&described).await;
        let names = self.leases.names_told(&recall.gfid);
        let held = self.leases.release(&recall.gfid);
        // Data written behind reaches the brick before the lease goes back, so the recalling
        // client sees it (writes from now on go through).
        self.send_writes_behind(None).await;
        self.invalidate_attrs(&described).await;
        self.invalidate_entries(&recall.gfid, names).await;
        let lease = Lease {
            gfid: recall.gfid,
            kind: recall.kind,
        };
        match held {
            // Changes made under it go first.
            Some(LeaseKind::Write) => {
                let touches = [recall.gfid];
                self.behind
                    .push(&Creds::root(), lease.into(), &touches)
                    .await;
            }
            // Nothing was changed under a read lease, or nothing is held (a grant whose reply
            // has not arrived yet is not taken when it does): back at once.
            Some(_) | None => {
                let _ = self.layer.call(&Creds::root(), lease.into()).await;
            }
        }
        // Noted again once the lease is given back (or queued behind, where a listing waits
        // for it): a grant asked before could be of the lease just given back.
        self.leases.recalled(recall.gfid);
    }

    /// Gives back the read lease on a file: what the kernel caches of it goes first, so its
    /// next read sees the change the recall is for.
    pub(super) async fn give_back_file(&self, gfid: Gfid) {
        self.anchor_handles_on(&[gfid]).await;
        self.invalidate_files(&[gfid]).await;
        let lease = Lease {
            gfid,
            kind: LeaseKind::None,
        };
        let _ = self.layer.call(&Creds::root(), lease.into()).await;
    }

    /// Gives back the read lease on a file its recall took ([`Shared::give_back_file`]).
    async fn give_back_recalled_file(&self, gfid: Gfid) {
        self.give_back_file(gfid).await;
        self.files.given_back(&gfid);
    }

    /// Follows the events from below until the mount goes: a recalled directory is no longer
    /// held, and its lease goes back after the changes queued before the recall. Recalls are
    /// answered concurrently: a burst of them (another client walking a tree this one is
    /// writing) gives each lease back in the time of the slowest, not of their sum, which
    /// would outlast the brick's recall bound and see the leases revoked.
    pub(super) async fn follow_events(self: Arc<Self>) {
        use futures_util::StreamExt;
        use futures_util::future::Either;
        let mut events = self.layer.events();
        let mut giving_back = futures_util::stream::FuturesUnordered::new();
        loop {
            let event = tokio::select! {
                event = events.recv() => event,
                Some(()) = giving_back.next(), if !giving_back.is_empty() => continue,
                // A change answered ahead there was refused: the brick answers for the
                // directory again, as after a recall.
                refused = self.behind.refused_in() => {
                    for gfid in refused {
                        if self.leases.holds(&gfid) {
                            self.leases.recalled(gfid);
                            let kind = LeaseKind::None;
                            giving_back.push(Either::Right(self.give_back(Recall { gfid, kind })));
                        }
                    }
                    continue;
                }
            };
            match event {
                Ok(LayerEvent::Recall(recall)) => {
                    // A grant of this file or directory whose reply comes from now on is not
                    // taken.
                    if self.files.recalled(&recall.gfid) {
                        giving_back.push(Either::Left(self.give_back_recalled_file(recall.gfid)));
                    } else {
                        self.leases.recalled(recall.gfid);
                        giving_back.push(Either::Right(self.give_back(recall)));
                    }
                }
                Ok(LayerEvent::LeasesLost)
                | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                    let files = self.files.release_all();
                    self.invalidate_files(&files).await;
                    let names = self.leases.all_names_told();
                    let described = self.leases.release_all();
                    self.send_writes_behind(None).await;
                    self.invalidate_attrs(&described).await;
                    for (dir, names) in names {
                        self.invalidate_entries(&dir, names).await;
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            }
        }
    }
}

/// `results` when there is one per fop sent; otherwise every fop failed (a protocol error).
fn checked(
    sent: &[behind::Queued],
    results: Vec<std::result::Result<FopReply, kiln_wire::ErrorCode>>,
) -> Vec<std::result::Result<FopReply, Error>> {
    if results.len() != sent.len() {
        let e = Error::Protocol(format!(
            "{} answers to a batch of {}",
            results.len(),
            sent.len()
        ));
        return behind::all_failed(sent, &e);
    }
    behind::results(results)
}

/// What a queued fop's `result` means for the application: a removal or rename sent again
/// after a broken connection whose name is gone had run the first time.
fn outcome(
    fop: &FopRequest,
    result: std::result::Result<FopReply, Error>,
    repeated: bool,
) -> std::result::Result<(), Error> {
    match (fop, result) {
        (
            FopRequest::Unlink(_) | FopRequest::Rmdir(_) | FopRequest::Rename(_),
            Err(Error::Fop(kiln_wire::ErrorCode::NoEnt)),
        ) if repeated => Ok(()),
        (_, result) => result.map(drop),
    }
}

/// Applies `attr`'s mode, owners and times to `iatt`.
fn apply(iatt: &mut Iatt, attr: &SetAttr) {
    if let Some(mode) = attr.mode {
        iatt.mode = mode;
    }
    if let Some(uid) = attr.uid {
        iatt.uid = uid;
    }
    if let Some(gid) = attr.gid {
        iatt.gid = gid;
    }
    if let Some(TimeSet::At(t)) = attr.atime {
        iatt.atime = t;
    }
    if let Some(TimeSet::At(t)) = attr.mtime {
        iatt.mtime = t;
    }
}
