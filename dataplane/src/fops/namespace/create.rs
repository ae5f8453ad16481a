//! Making names: CREATE, PUT, MKDIR, MKNOD, SYMLINK, and LINK of an existing object.

use std::ffi::CString;

use bytes::Bytes;
use kiln_wire::{
    AccessMode, Create, CreateReply, Creds, EntryReply, FileType, FopCode, Gfid, Link, LookupReply,
    Mkdir, Mknod, Name, OpenFlags, Put, SetAttr, Symlink,
};
use rustix::io::Errno;

use super::super::chain::{At, Chain, Results};
use super::super::resolve::Named;
use super::super::{Fops, ParentAttrs, R, iatt};
use super::{files, parent_iatt};
use crate::brick::Brick;
use crate::brick::GFID_XATTR;
use crate::brick::intent::{self, RecordKind, record_name};
use crate::cache::InodeKey;
use crate::exec::Exec;
use crate::fdtable::SessionId;
use crate::op::{self, DirFd, FileRef, Stat, Step, cstr};

/// What a new entry is.
#[derive(Debug, Clone)]
enum NewKind {
    File {
        flags: i32,
        mode: u32,
        data: Option<Bytes>,
        /// Set after the data, before the name, where the file is made unnamed (a PUT's).
        attr: SetAttr,
        keep_open: bool,
    },
    Dir {
        mode: u32,
    },
    Node {
        mode: u32,
        rdev: u64,
    },
    Symlink {
        target: CString,
    },
}

impl NewKind {
    /// The type of object this makes: a retry is recognised only by an object of that type.
    fn file_type(&self) -> Option<FileType> {
        match self {
            NewKind::File { .. } => Some(FileType::Regular),
            NewKind::Dir { .. } => Some(FileType::Directory),
            NewKind::Node { mode, .. } => FileType::from_mode_bits(*mode),
            NewKind::Symlink { .. } => Some(FileType::Symlink),
        }
    }

    /// Whether the chain opens the new object (to set its GFID through the fd).
    fn opens(&self) -> bool {
        matches!(self, NewKind::File { .. } | NewKind::Dir { .. })
    }

    /// Whether the chain's open outlives it: a CREATE's file, for the caller; a directory's,
    /// for the brick's held directories (the next fop there would open it again).
    fn keeps_open(&self) -> bool {
        matches!(
            self,
            NewKind::File {
                keep_open: true,
                ..
            } | NewKind::Dir { .. }
        )
    }
}

/// What a create fop asked for: the fop, the name, the new object's GFID, and whether the
/// reply carries the parent's attributes.
#[derive(Debug)]
struct NewName<'a> {
    fop: FopCode,
    parent: &'a Gfid,
    name: &'a Name,
    gfid: Gfid,
    parents: ParentAttrs,
}

/// Where a new entry goes and who it is.
#[derive(Debug)]
struct NewEntry {
    parent: Gfid,
    dir: DirFd,
    name: CString,
    gfid: Gfid,
    record: CString,
    parents: ParentAttrs,
}

/// The steps of an entry chain whose results the fop reads back.
#[derive(Debug)]
struct EntrySteps {
    pre: Option<At<Stat>>,
    record: At<()>,
    /// The caller's create: the commit point.
    commit: At<()>,
    /// The new object opened (a file's create itself, or a directory's GFID open).
    opened: Option<At<FileRef>>,
    handle: At<()>,
    close: Option<At<()>>,
    stat: At<Stat>,
    post: Option<At<Stat>>,
}

impl<E: Exec> Fops<E> {
    pub(in crate::fops) async fn mknod(
        &self,
        creds: &Creds,
        r: Mknod,
        parents: ParentAttrs,
    ) -> R<EntryReply> {
        let mode = FileType::from(r.node_type).to_mode_bits() | (r.mode.bits() & !r.umask.bits());
        let kind = NewKind::Node { mode, rdev: r.rdev };
        let new = NewName {
            fop: FopCode::Mknod,
            parent: &r.parent,
            name: &r.name,
            gfid: r.gfid,
            parents,
        };
        Ok(self.make_entry(creds, &new, kind).await?.0)
    }

    pub(in crate::fops) async fn mkdir(
        &self,
        creds: &Creds,
        r: Mkdir,
        parents: ParentAttrs,
    ) -> R<EntryReply> {
        let kind = NewKind::Dir {
            mode: r.mode.bits() & !r.umask.bits(),
        };
        let new = NewName {
            fop: FopCode::Mkdir,
            parent: &r.parent,
            name: &r.name,
            gfid: r.gfid,
            parents,
        };
        let (reply, opened) = self.make_entry(creds, &new, kind).await?;
        if let Some(FileRef::Fd(dir)) = opened {
            self.hold_dir(r.gfid, dir);
        }
        Ok(reply)
    }

    pub(in crate::fops) async fn symlink(
        &self,
        creds: &Creds,
        r: Symlink,
        parents: ParentAttrs,
    ) -> R<EntryReply> {
        let kind = NewKind::Symlink {
            target: cstr(r.target.as_bytes()),
        };
        let new = NewName {
            fop: FopCode::Symlink,
            parent: &r.parent,
            name: &r.name,
            gfid: r.gfid,
            parents,
        };
        Ok(self.make_entry(creds, &new, kind).await?.0)
    }

    /// Creates `parent/name` with identity `gfid`: intent record → caller's create (commit) →
    /// GFID xattr → data → handle → stat → record removed, in one chain.
    async fn make_entry(
        &self,
        creds: &Creds,
        new: &NewName<'_>,
        kind: NewKind,
    ) -> R<(EntryReply, Option<FileRef>)> {
        let (fop, parent, name, gfid) = (new.fop, new.parent, new.name, new.gfid);
        Self::check_entry(parent, name)?;
        if self.shared.is_being_removed(&gfid) {
            // Its object is being removed and may keep it.
            return Err(Errno::EXIST);
        }
        let dir = self.dir(parent).await?;
        self.brick.ensure_handle_parent(&gfid)?;
        // A GFID already in use: a retry of this create (same name), or a client reusing an
        // identity (EEXIST, and nothing of the other object is touched).
        let taken = op::Statx::of(self.brick.handle_dir(&gfid), &Brick::handle_name(&gfid));
        if self.run1(Step::brick(taken)).await.is_ok() {
            let same = self.same_entry(creds, parent, name, gfid, &kind).await;
            return same.ok().flatten().map(|e| (e, None)).ok_or(Errno::EXIST);
        }
        if let NewKind::File {
            flags,
            mode,
            data,
            attr,
            ..
        } = &kind
            && self.makes_unnamed(*flags)
        {
            let name_c = cstr(name.as_bytes());
            let file = files::NewFile {
                parent: *parent,
                dir: &dir,
                name: &name_c,
                gfid,
                flags: *flags,
                mode: *mode,
                data: data.clone(),
                attr: *attr,
                parents: new.parents,
            };
            return match self.make_file(fop, creds, &file).await {
                Ok((reply, opened)) => Ok((reply, Some(opened).filter(|_| kind.keeps_open()))),
                Err(Errno::EXIST) => self.retried(creds, parent, name, gfid, &kind).await,
                Err(e) => Err(e),
            };
        }
        let entry = NewEntry {
            parent: *parent,
            dir,
            name: cstr(name.as_bytes()),
            gfid,
            record: record_name(RecordKind::New, &gfid),
            parents: new.parents,
        };
        let (chain, steps) = self.entry_chain(creds, &entry, &kind);
        let mut results = self.run_namespace(fop, chain).await?;
        if let Some(e) = results.error(steps.commit) {
            if results.ok(steps.record) {
                self.unlink_quietly(&self.brick.pending, &entry.record, false)
                    .await;
            }
            return match e {
                Errno::EXIST => self.retried(creds, parent, name, gfid, &kind).await,
                e => Err(e),
            };
        }
        let opened = steps.opened.and_then(|at| results.take(at).ok());
        self.excuse_healed_handle(&mut results, steps.handle, steps.stat, &gfid)
            .await;
        if let Some(e) = results.first_error() {
            self.undo_entry(&entry, &kind, &steps, &results, opened)
                .await;
            return Err(e);
        }
        let stat = results.take(steps.stat)?;
        self.remember_gfid(&stat, gfid);
        let reply = EntryReply {
            iatt: iatt(&stat, gfid),
            pre_parent: parent_iatt(&mut results, steps.pre, *parent)?,
            post_parent: parent_iatt(&mut results, steps.post, *parent)?,
        };
        Ok((reply, opened.filter(|_| kind.keeps_open())))
    }

    /// The chain that makes `entry`.
    fn entry_chain(&self, creds: &Creds, entry: &NewEntry, kind: &NewKind) -> (Chain, EntrySteps) {
        let (dir, name) = (&entry.dir, &entry.name);
        let mut chain = Chain::new();
        let pre = entry.parents.push(&mut chain, dir);
        let record = chain.push(Step::brick(op::Symlink {
            target: cstr(&intent::new_target(&entry.parent, name.as_bytes())),
            dir: self.brick.pending.clone(),
            name: entry.record.clone(),
        }));
        let (commit, opened) = push_commit(&mut chain, creds, dir, name, kind);
        let xattr = cstr(GFID_XATTR.as_bytes());
        let (value, create) = (entry.gfid.as_bytes().to_vec(), libc::XATTR_CREATE);
        chain.push::<()>(Step::brick(match kind.opens() {
            true => op::Op::from(op::FSetXattr {
                file: FileRef::Chain,
                name: xattr,
                value,
                flags: create,
            }),
            false => op::Op::from(op::SetXattrAt {
                dir: dir.clone(),
                name: name.clone(),
                xattr,
                value,
                flags: create,
            }),
        }));
        if let NewKind::File {
            data: Some(data), ..
        } = kind
        {
            self.push_data(&mut chain, creds, data.clone(), false);
        }
        let handle = chain.push(self.handle_step(entry, kind));
        let close = (kind.opens() && !kind.keeps_open()).then(|| {
            chain.push(Step::brick(op::Close {
                file: FileRef::Chain,
            }))
        });
        chain.push::<()>(Step::brick(op::Unlink {
            dir: self.brick.pending.clone(),
            name: entry.record.clone(),
            dir_flag: false,
        }));
        // Stats last: by name (a direct descriptor cannot be statx'ed), and at the end of the
        // chain, where the ring executor runs them inline.
        let stat = chain.push(Step::brick(op::Statx::of(dir, name)));
        let post = entry.parents.push(&mut chain, dir);
        let steps = EntrySteps {
            pre,
            record,
            commit,
            opened,
            handle,
            close,
            stat,
            post,
        };
        (chain, steps)
    }

    /// The new object's handle: a hard link, or for a directory a symlink to its name.
    fn handle_step(&self, entry: &NewEntry, kind: &NewKind) -> Step {
        let (handle_dir, handle) = (
            self.brick.handle_dir(&entry.gfid).clone(),
            Brick::handle_name(&entry.gfid),
        );
        Step::brick(match kind {
            NewKind::Dir { .. } => op::Op::from(op::Symlink {
                target: cstr(&Brick::dir_handle_target(
                    &entry.parent,
                    entry.name.as_bytes(),
                )),
                dir: handle_dir,
                name: handle,
            }),
            _ => op::Op::from(op::Link {
                old_dir: entry.dir.clone(),
                old_name: entry.name.clone(),
                new_dir: handle_dir,
                new_name: handle,
            }),
        })
    }

    /// Excuses the handle step of a create that met EEXIST because the handle it was to
    /// make names the object made: a lookup of the new name between its naming and its
    /// handle found the handle missing and made it
    /// ([`read_or_heal_gfid`](crate::brick::layout::read_or_heal_gfid)). Anything else
    /// under that name stays the create's error, and the create is undone.
    pub(super) async fn excuse_healed_handle(
        &self,
        results: &mut Results,
        handle: At<()>,
        made: At<Stat>,
        gfid: &Gfid,
    ) {
        let Some(made) = results.stat(made) else {
            return;
        };
        if results.error(handle) != Some(Errno::EXIST) {
            return;
        }
        let handle_stat = op::Statx {
            dir: self.brick.handle_dir(gfid).clone(),
            name: Brick::handle_name(gfid),
            // A directory's handle is a symlink to it.
            nofollow: !made.is_dir(),
        };
        let same = (self.run_one::<Stat>(Step::brick(handle_stat)).await)
            .is_ok_and(|found| InodeKey::of(&found) == InodeKey::of(made));
        if same {
            results.excuse(handle);
        }
    }

    /// Writes `data` at 0 into the chain's file, as the caller (synced under write-through);
    /// a failed write stops the chain when it is a `barrier`. A failed sync does not: what
    /// follows is undone.
    pub(super) fn push_data(&self, chain: &mut Chain, creds: &Creds, data: Bytes, barrier: bool) {
        let write = op::Write {
            file: FileRef::Chain,
            offset: 0,
            data,
        };
        let write = Step::caller(write, creds);
        chain.push::<()>(if barrier { write.barrier() } else { write });
        if self.config.write_through {
            chain.push::<()>(Step::brick(op::Fsync {
                file: FileRef::Chain,
                datasync: true,
            }));
        }
    }

    /// A step around the commit failed (e.g. ENOSPC for the record or the xattr): undo what
    /// this chain made, and only that, newest first.
    async fn undo_entry(
        &self,
        entry: &NewEntry,
        kind: &NewKind,
        steps: &EntrySteps,
        results: &Results,
        opened: Option<FileRef>,
    ) {
        let closed = steps.close.is_some_and(|at| results.ok(at));
        if let Some(file) = opened.filter(|_| !closed) {
            let _ = self.run1(Step::brick(op::Close { file })).await;
        }
        if results.ok(steps.handle) {
            let handle_dir = self.brick.handle_dir(&entry.gfid).clone();
            self.unlink_quietly(&handle_dir, &Brick::handle_name(&entry.gfid), false)
                .await;
        }
        let is_dir = matches!(kind, NewKind::Dir { .. });
        self.unlink_quietly(&entry.dir, &entry.name, is_dir).await;
        if results.ok(steps.record) {
            self.unlink_quietly(&self.brick.pending, &entry.record, false)
                .await;
        }
    }

    /// A create whose name is taken: a retry of one that already happened carries the same
    /// GFID and gets its reply; anything else is EEXIST. (Another create of the name is never
    /// half-made here: creates take turns on their names, `fops/name_turns.rs`.)
    async fn retried(
        &self,
        creds: &Creds,
        parent: &Gfid,
        name: &Name,
        gfid: Gfid,
        kind: &NewKind,
    ) -> R<(EntryReply, Option<FileRef>)> {
        let same = self.same_entry(creds, parent, name, gfid, kind).await?;
        same.map(|reply| (reply, None)).ok_or(Errno::EXIST)
    }

    /// The reply to a create that already happened (a retry with the same GFID and of the
    /// same type), or `None` when the name holds another object.
    async fn same_entry(
        &self,
        creds: &Creds,
        parent: &Gfid,
        name: &Name,
        gfid: Gfid,
        kind: &NewKind,
    ) -> R<Option<EntryReply>> {
        let existing = self.lookup(creds, parent, name).await?;
        let same = existing.iatt.gfid == gfid && Some(existing.iatt.file_type) == kind.file_type();
        Ok(same.then(|| retried_reply(existing)))
    }

    pub(in crate::fops) async fn create(
        &self,
        session: SessionId,
        creds: &Creds,
        r: Create,
    ) -> R<CreateReply> {
        // EMFILE before anything is made, as a local create fails.
        self.check_room(session)?;
        let flags = r.access.to_libc() | (r.flags.to_libc() & !libc::O_EXCL);
        let kind = NewKind::File {
            flags,
            mode: r.mode.bits() & !r.umask.bits(),
            data: None,
            attr: SetAttr::default(),
            keep_open: true,
        };
        let new = NewName {
            fop: FopCode::Create,
            parent: &r.parent,
            name: &r.name,
            gfid: r.gfid,
            parents: self.parent_attrs(session),
        };
        let made = self.make_entry(creds, &new, kind).await;
        let (entry, file) = match made {
            Ok(done) => done,
            // Without O_EXCL, CREATE of an existing name opens it, like open(O_CREAT).
            Err(Errno::EXIST) if !r.flags.contains(OpenFlags::EXCL) => {
                return self.open_existing(session, creds, &r).await;
            }
            Err(e) => return Err(e),
        };
        let fd = match file {
            Some(file) => {
                let writable = r.access != AccessMode::ReadOnly;
                let kept = self.keep_open(session, entry.iatt.gfid, file, writable);
                match kept.await {
                    Ok(fd) => fd,
                    Err(e) => {
                        // Another open of the session took the last slot meanwhile.
                        self.remove_made(&r.parent, &r.name, &r.gfid).await;
                        return Err(e);
                    }
                }
            }
            // A retried create: open what the first attempt made.
            None => {
                self.open(session, creds, &entry.iatt.gfid, r.access, r.flags)
                    .await?
                    .fd
            }
        };
        Ok(CreateReply {
            fd,
            iatt: entry.iatt,
            pre_parent: entry.pre_parent,
            post_parent: entry.post_parent,
        })
    }

    /// Removes `parent/name` if it is still the object `gfid` this fop made.
    async fn remove_made(&self, parent: &Gfid, name: &Name, gfid: &Gfid) {
        let brick = Creds::root();
        if self
            .lookup(&brick, parent, name)
            .await
            .is_ok_and(|found| found.iatt.gfid == *gfid)
        {
            let _ = self.unlink(&brick, parent, name, ParentAttrs::Omit).await;
        }
    }

    /// CREATE without O_EXCL of a name that exists: opens it.
    async fn open_existing(&self, session: SessionId, creds: &Creds, r: &Create) -> R<CreateReply> {
        let found = match self.lookup(creds, &r.parent, &r.name).await {
            // No such name: the EEXIST was the GFID's, which another object holds.
            Err(Errno::NOENT) => return Err(Errno::EXIST),
            found => found?,
        };
        let fd = self
            .open(session, creds, &found.iatt.gfid, r.access, r.flags)
            .await?
            .fd;
        Ok(CreateReply {
            fd,
            iatt: found.iatt,
            pre_parent: found.parent.clone(),
            post_parent: found.parent,
        })
    }

    /// PUT, or PUT_SYNCED (`synced`): answered once the file is also fsynced — a retry's too,
    /// as the first attempt may have been lost before its fsync.
    pub(in crate::fops) async fn put(
        &self,
        creds: &Creds,
        r: Put,
        parents: ParentAttrs,
        synced: bool,
    ) -> R<EntryReply> {
        if self.is_poisoned() {
            return Err(Errno::IO);
        }
        let flags = libc::O_WRONLY | r.flags.to_libc() & !libc::O_EXCL;
        let data = Some(r.data.clone().into_bytes()).filter(|d| !d.is_empty());
        // A file made unnamed gets its attributes before its name: one chain, and never named
        // without them.
        let attr_in_chain = self.makes_unnamed(flags);
        let kind = NewKind::File {
            flags,
            mode: r.mode.bits() & !r.umask.bits(),
            data,
            attr: if attr_in_chain {
                r.attr
            } else {
                SetAttr::default()
            },
            keep_open: false,
        };
        let new = NewName {
            fop: match synced {
                true => FopCode::PutSynced,
                false => FopCode::Put,
            },
            parent: &r.parent,
            name: &r.name,
            gfid: r.gfid,
            parents,
        };
        let (mut entry, file) = self.make_entry(creds, &new, kind).await?;
        debug_assert!(file.is_none(), "a PUT keeps no file open");
        let mut rewritten = false;
        if entry.iatt.size != r.data.len() as u64 {
            // A retried PUT found the file made by the first attempt: write the data again.
            entry.iatt = self
                .rewrite(creds, &r.gfid, r.data.clone().into_bytes())
                .await?;
            rewritten = true;
        }
        if !r.attr.is_empty() && (!attr_in_chain || rewritten) {
            entry.iatt = self
                .setattr(creds, Named::Gfid(&r.gfid), r.attr)
                .await?
                .post;
        }
        if synced {
            self.sync_file(&r.gfid).await?;
        }
        Ok(entry)
    }

    /// fsync(2) of regular file `gfid` through its handle: its data and metadata, and on
    /// ext4 and XFS the names made before it (one journal). A failed fsync poisons the brick.
    async fn sync_file(&self, gfid: &Gfid) -> R<()> {
        let mut chain = Chain::new();
        let open = chain.push::<FileRef>(Step::brick(op::Open {
            dir: self.brick.handle_dir(gfid).clone(),
            name: Brick::handle_name(gfid),
            flags: libc::O_RDONLY | libc::O_NOFOLLOW,
            mode: 0,
            fixed: true,
        }));
        let fsync = chain.push::<()>(Step::brick(op::Fsync {
            file: FileRef::Chain,
            datasync: false,
        }));
        let close = chain.push::<()>(Step::brick(op::Close {
            file: FileRef::Chain,
        }));
        let mut results = self.run(chain).await;
        results.take(open)?;
        let synced = self.poison_on_fsync_error(results.take(fsync));
        results.take(close)?;
        synced
    }

    /// Replaces the content of regular file `gfid` by `data`, as the caller. Never through a
    /// symlink, never a device or FIFO.
    async fn rewrite(&self, creds: &Creds, gfid: &Gfid, data: Bytes) -> R<kiln_wire::Iatt> {
        let (handle_dir, handle) = (self.brick.handle_dir(gfid), Brick::handle_name(gfid));
        let stat: Stat = self
            .run_one(Step::brick(op::Statx::of(handle_dir, &handle)))
            .await?;
        if !stat.is_regular() {
            return Err(Errno::EXIST);
        }
        let mut chain = Chain::new();
        let open = chain.push::<FileRef>(Step::caller(
            op::Open {
                dir: handle_dir.clone(),
                name: handle.clone(),
                flags: libc::O_WRONLY | libc::O_TRUNC | libc::O_NOFOLLOW,
                mode: 0,
                fixed: true,
            },
            creds,
        ));
        self.push_data(&mut chain, creds, data, false);
        let stat = chain.push::<Stat>(Step::brick(op::Statx::of(handle_dir, &handle)));
        let close = chain.push::<()>(Step::brick(op::Close {
            file: FileRef::Chain,
        }));
        let mut results = self.run(chain).await;
        results.take(open)?;
        results.take(close)?;
        if let Some(e) = results.first_error() {
            return Err(e);
        }
        Ok(iatt(&results.take(stat)?, *gfid))
    }

    pub(in crate::fops) async fn link(
        &self,
        creds: &Creds,
        r: Link,
        parents: ParentAttrs,
    ) -> R<EntryReply> {
        Self::check_entry(&r.new_parent, &r.new_name)?;
        if self.stat_gfid(&r.gfid).await?.is_dir() {
            return Err(Errno::PERM);
        }
        let dir = self.dir(&r.new_parent).await?;
        let new = cstr(r.new_name.as_bytes());
        let mut chain = Chain::new();
        let pre = parents.push(&mut chain, &dir);
        let link = op::Link {
            old_dir: self.brick.handle_dir(&r.gfid).clone(),
            old_name: Brick::handle_name(&r.gfid),
            new_dir: dir.clone(),
            new_name: new.clone(),
        };
        let linked = chain.push::<()>(Step::caller(link, creds));
        let stat = chain.push::<Stat>(Step::brick(op::Statx::of(&dir, &new)));
        let post = parents.push(&mut chain, &dir);
        let mut results = self.run_namespace(FopCode::Link, chain).await?;
        results.take(linked)?;
        Ok(EntryReply {
            iatt: iatt(&results.take(stat)?, r.gfid),
            pre_parent: parent_iatt(&mut results, pre, r.new_parent)?,
            post_parent: parent_iatt(&mut results, post, r.new_parent)?,
        })
    }
}

/// Pushes the caller's create of `dir/name` (the chain's barrier) and, for files and
/// directories, the open that sets the GFID through an fd.
fn push_commit(
    chain: &mut Chain,
    creds: &Creds,
    dir: &DirFd,
    name: &CString,
    kind: &NewKind,
) -> (At<()>, Option<At<FileRef>>) {
    let (dir, name) = (dir.clone(), name.clone());
    match kind {
        NewKind::File {
            flags,
            mode,
            keep_open,
            ..
        } => {
            // A file that stays open is a plain fd (see `op::open`); one closed in the chain
            // is a direct descriptor.
            let open = op::Open {
                dir,
                name,
                flags: flags | libc::O_CREAT | libc::O_EXCL,
                mode: *mode,
                fixed: !keep_open,
            };
            let opened = chain.push::<FileRef>(Step::caller(open, creds).barrier());
            (opened.erased(), Some(opened))
        }
        NewKind::Dir { mode } => {
            let mkdir = op::Mkdir {
                dir: dir.clone(),
                name: name.clone(),
                mode: *mode,
            };
            let commit = chain.push(Step::caller(mkdir, creds).barrier());
            // A plain fd: held as the new directory's afterwards.
            let open = op::Open {
                dir,
                name,
                flags: libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
                mode: 0,
                fixed: false,
            };
            (commit, Some(chain.push(Step::brick(open))))
        }
        NewKind::Node { mode, rdev } => {
            let mknod = op::Mknod {
                dir,
                name,
                mode: *mode,
                rdev: *rdev,
            };
            (chain.push(Step::caller(mknod, creds).barrier()), None)
        }
        NewKind::Symlink { target } => {
            let symlink = op::Symlink {
                target: target.clone(),
                dir,
                name,
            };
            (chain.push(Step::caller(symlink, creds).barrier()), None)
        }
    }
}

/// The reply to a create that already happened: the object as it is now.
fn retried_reply(existing: LookupReply) -> EntryReply {
    let parent = existing.parent;
    EntryReply {
        iatt: existing.iatt,
        pre_parent: parent.clone(),
        post_parent: parent,
    }
}
