//! What the mount's tasks share — the layer below, the options, the inode table, the open
//! handles and the deferred creates — and the fops on nodes: LOOKUP with deferred and negative
//! entries, GETATTR and SETATTR through handles, GETXATTR with absent names remembered, and
//! the others that must find a deferred create on the brick first.

use std::ffi::OsStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fuser::{Errno, FileAttr, FileHandle};
use kiln_wire::{
    Creds, ErrorCode, FileType, FopReply, FopRequest, FsStats, Gfid, Iatt, Name, SetAttr,
    XattrName, XattrPresence,
};

use super::MountOptions;
use super::behind::Behind;
use super::convert::{Result, attr_of, errno, file_attr, name_of, unexpected};
use super::file_leases::FileLeases;
use super::handles::{Handles, Open};
use super::inodes::Inodes;
use super::leases::{Answer, Leases};
use super::made::MadeFiles;
use super::pages::Stamp;
use super::pending::{ParentAttr, PendingCreates};
use super::prefetch::Prefetch;
use super::space::SPACE_CHECK_INTERVAL;
use crate::{Error, FdFop, Layer};

/// What the tasks share; `L` is the client stack below the mount.
#[derive(Debug)]
pub(super) struct Shared<L: Layer> {
    pub(super) layer: L,
    pub(super) options: MountOptions,
    pub(super) inodes: Inodes,
    pub(super) handles: Handles<L::Fd>,
    pub(super) pending: PendingCreates,
    pub(super) leases: Leases,
    pub(super) files: FileLeases,
    pub(super) behind: Behind,
    pub(super) prefetch: Prefetch,
    /// The content of small files made here, answering their reads.
    pub(super) made: MadeFiles,
    /// Tells the kernel to drop what it caches (set once the FUSE session exists).
    pub(super) kernel: std::sync::OnceLock<fuser::Notifier>,
    /// The kernel drops a file's pages only when the mount tells it ([`super::pages`]; set
    /// at INIT).
    pub(super) pages_told: AtomicBool,
}

/// The kernel's cache lifetimes for one reply.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ttl {
    pub(super) attr: Duration,
    pub(super) entry: Duration,
}

impl<L: Layer> Shared<L> {
    pub(super) fn new(layer: L, options: MountOptions) -> Shared<L> {
        Shared {
            layer,
            behind: Behind::new(options.behind_bytes_max, options.behind_free_mib << 20),
            options,
            inodes: Inodes::new(),
            handles: Handles::new(),
            pending: PendingCreates::default(),
            leases: Leases::default(),
            files: FileLeases::default(),
            prefetch: Prefetch::default(),
            made: MadeFiles::default(),
            kernel: std::sync::OnceLock::new(),
            pages_told: AtomicBool::new(false),
        }
    }

    /// Has the kernel drop its cached attributes of `gfids` (those it still holds), and the
    /// mount what it knows of their xattrs and permission bits; returns once it has. Off the runtime's threads: the write to `/dev/fuse` may wait for the
    /// kernel.
    pub(super) async fn invalidate_attrs(&self, gfids: &[Gfid]) {
        // An offset below zero: attributes only, no page cache range.
        self.invalidate_inodes(gfids, -1).await;
    }

    /// Has the kernel drop its cached attributes and pages of files `gfids`, as
    /// [`Shared::invalidate_attrs`].
    pub(super) async fn invalidate_files(&self, gfids: &[Gfid]) {
        // From offset 0, every page.
        self.invalidate_inodes(gfids, 0).await;
    }

    async fn invalidate_inodes(&self, gfids: &[Gfid], offset: i64) {
        let Some(kernel) = self.kernel.get().cloned() else {
            return;
        };
        let inos: Vec<u64> = gfids.iter().filter_map(|g| self.inodes.ino_of(g)).collect();
        if inos.is_empty() {
            return;
        }
        for &ino in &inos {
            self.inodes.forget_attrs(ino);
        }
        let dropped = tokio::task::spawn_blocking(move || {
            for ino in inos {
                let _ = kernel.inval_inode(fuser::INodeNo(ino), offset, 0);
            }
        });
        let _ = dropped.await;
    }

    /// Puts `data`, the whole content of node `ino`, into the kernel's page cache
    /// (`FUSE_NOTIFY_STORE`) when the file's only handle closes, so reading it back needs no
    /// READ: a write-through write leaves out of the cache every page it covers only in part
    /// (a small file's last page, or a page two writes share). With other handles open, a
    /// write through one of them could be under way, and nothing is stored.
    ///
    /// Called before the close returns, so no later writer's bytes can be overwritten by it.
    /// The store waits for the lock of any page a write of the file holds meanwhile (another
    /// thread of the closer, on the same fd), and only the FUSE thread can read that write's
    /// request: the store therefore runs on a runtime thread, which the runtime gives up for
    /// the time ([`block_in_place`]), never on the FUSE thread.
    ///
    /// [`block_in_place`]: tokio::task::block_in_place
    pub(super) async fn store_content(&self, ino: u64, data: Bytes) {
        if data.is_empty() || self.handles.open_on(ino) != 1 {
            return;
        }
        if tokio::task::try_id().is_none() {
            // A request's first steps, run on the FUSE thread (`KilnFs::run`): the rest goes
            // on as a task of the runtime.
            tokio::task::yield_now().await;
        }
        let Some(kernel) = self.kernel.get().cloned() else {
            return;
        };
        let store = move || store_pages(&kernel, ino, &data);
        let multi_thread = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        if multi_thread {
            tokio::task::block_in_place(store);
        } else {
            let _ = tokio::task::spawn_blocking(store).await;
        }
    }

    /// Has the kernel drop what it caches of `names` in directory `dir` (entries and
    /// absences); returns once it has, off the runtime's threads like
    /// [`Shared::invalidate_attrs`].
    pub(super) async fn invalidate_entries(&self, dir: &Gfid, names: Vec<Name>) {
        let (Some(kernel), Some(parent)) = (self.kernel.get().cloned(), self.inodes.ino_of(dir))
        else {
            return;
        };
        if names.is_empty() {
            return;
        }
        let dropped = tokio::task::spawn_blocking(move || {
            use std::os::unix::ffi::OsStrExt;
            for name in names {
                let name = OsStr::from_bytes(name.as_bytes());
                let _ = kernel.inval_entry(fuser::INodeNo(parent), name);
            }
        });
        let _ = dropped.await;
    }

    /// The GFID of node `ino`; ESTALE for a node the kernel has forgotten.
    pub(super) fn gfid(&self, ino: u64) -> Result<Gfid> {
        self.inodes.gfid(ino).ok_or(Errno::ESTALE)
    }

    fn ttl(&self) -> Ttl {
        Ttl {
            attr: self.options.attr_timeout,
            entry: self.options.entry_timeout,
        }
    }

    /// `iatt` as the attributes of node `ino`.
    pub(super) fn attr(&self, ino: u64, iatt: &Iatt) -> (FileAttr, Duration) {
        (self.told(ino, iatt), self.options.attr_timeout)
    }

    /// An entry handed to the kernel: counts a lookup of its node.
    pub(super) fn entry(&self, iatt: &Iatt) -> (FileAttr, Ttl) {
        let ino = self.inodes.remember(iatt.gfid);
        (self.told(ino, iatt), self.ttl())
    }

    /// The attributes the kernel is told of node `ino`, which the brick describes as `iatt`.
    fn told(&self, ino: u64, iatt: &Iatt) -> FileAttr {
        let iatt = self.described(ino, iatt);
        self.note_dir(ino, &iatt);
        file_attr(ino, &iatt)
    }

    /// What the kernel is told of node `ino`, which the brick describes as `iatt`: the
    /// mount's own description where it keeps one (an object made, or a directory held,
    /// under a lease), so that one mount never shows two versions of an object (the brick's
    /// times differ from the mount's by the moments it took to catch up, and tar's "file
    /// changed as we read it" compares them). A file the brick describes otherwise than the
    /// kernel's pages of it has them dropped, soon (a GETATTR's or LOOKUP's answer has them
    /// dropped first: [`Shared::drop_stale_pages`]).
    fn described(&self, ino: u64, iatt: &Iatt) -> Iatt {
        match self.leases.local(&iatt.gfid) {
            Some(local) => local.iatt,
            None => {
                if self.pages_stale(ino, iatt) {
                    self.drop_pages_soon(ino);
                }
                iatt.clone()
            }
        }
    }

    /// Whether the brick's `iatt` of node `ino` shows another version of its data than the
    /// kernel's pages of it hold; the pages are taken as matching it from now on.
    fn pages_stale(&self, ino: u64, iatt: &Iatt) -> bool {
        self.pages_told.load(Ordering::Relaxed)
            && iatt.file_type == FileType::Regular
            // A deferred create's description is the mount's own, of the pages written here;
            // its PUT's answer gives the pages their first version.
            && !self.pending.contains(ino)
            && self.inodes.pages_seen(ino, Stamp::of(iatt))
    }

    /// Drops the kernel's pages of node `ino` if the brick's `iatt` shows another version of
    /// its data than they hold; returns once they are gone (off the runtime's threads: the
    /// kernel waits for the locks of pages being read, whose READs other tasks answer).
    pub(super) async fn drop_stale_pages(&self, ino: u64, iatt: &Iatt) {
        if self.leases.local(&iatt.gfid).is_none()
            && self.pages_stale(ino, iatt)
            && let Some(gfid) = self.inodes.gfid(ino)
        {
            self.invalidate_files(&[gfid]).await;
        }
    }

    /// Has the kernel drop its pages of node `ino` without waiting for it (an answer on the
    /// FUSE thread cannot wait: the kernel may wait on a READ only that thread reads).
    pub(super) fn drop_pages_soon(&self, ino: u64) {
        let Some(kernel) = self.kernel.get().cloned() else {
            return;
        };
        let invalidate = move || {
            let _ = kernel.inval_inode(fuser::INodeNo(ino), 0, 0);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => _ = runtime.spawn_blocking(invalidate),
            Err(_) => _ = std::thread::spawn(invalidate),
        }
    }

    /// Notes what `reply`, the brick's answer to a fop of this mount, changed of a file's data
    /// (a WRITE, truncate, allocation, new times, or a PUT that made the file).
    pub(super) fn note_data_change(&self, reply: &FopReply) {
        match reply {
            FopReply::Write(r)
            | FopReply::Setattr(r)
            | FopReply::Fsetattr(r)
            | FopReply::Truncate(r)
            | FopReply::Ftruncate(r)
            | FopReply::Fallocate(r)
            | FopReply::Discard(r)
            | FopReply::Zerofill(r) => self.note_data_changed(Some(&r.pre), &r.post),
            FopReply::Put(r) | FopReply::PutSynced(r) => self.note_data_changed(None, &r.iatt),
            _ => {}
        }
    }

    /// Notes error `e`, about to reach the application or kept for it: a refusal for want
    /// of space holds changes back from being answered ahead ([`Behind::short_of_space`]).
    pub(super) fn refused(&self, e: Errno) -> Errno {
        self.behind.note_refusal(e.code());
        e
    }

    /// This mount changed a file's data on the brick from `before` (`None`: it made the file)
    /// to `after`. The kernel's pages hold the change (it came through them); they go if the
    /// brick had changed since the version they match.
    pub(super) fn note_data_changed(&self, before: Option<&Iatt>, after: &Iatt) {
        if !self.pages_told.load(Ordering::Relaxed) {
            return;
        }
        let before = before.map(Stamp::of);
        if let Some(ino) = self
            .inodes
            .pages_changed(&after.gfid, before, Stamp::of(after))
        {
            self.drop_pages_soon(ino);
        }
    }

    /// Notes the brick's answer to a WRITE of node `ino`: the blocks it took count against
    /// the volume's free space; a refused one leaves in the kernel's pages what the brick
    /// does not hold.
    pub(super) fn note_written(
        &self,
        ino: u64,
        written: &std::result::Result<kiln_wire::AttrChange, Error>,
    ) {
        match written {
            Ok(r) => {
                // Blocks count 512 bytes.
                let taken = r.post.blocks.saturating_sub(r.pre.blocks) * 512;
                self.behind.space.written(taken);
                self.note_data_changed(Some(&r.pre), &r.post);
            }
            Err(_) if self.pages_told.load(Ordering::Relaxed) => {
                self.inodes.pages_dropped(ino);
                self.drop_pages_soon(ino);
            }
            Err(_) => {}
        }
    }

    /// Keeps a directory's permission bits and owner for deciding deferred creates in it.
    fn note_dir(&self, ino: u64, iatt: &Iatt) {
        if iatt.file_type == FileType::Directory {
            let attr = ParentAttr {
                mode: iatt.mode.bits(),
                uid: iatt.uid,
                gid: iatt.gid,
            };
            let until = Instant::now() + self.options.attr_timeout;
            self.inodes.note_dir(ino, attr, until);
        }
    }

    /// The node id of `gfid` for a plain READDIR entry (which is not a lookup).
    pub(super) fn peek_ino(&self, gfid: Gfid) -> u64 {
        let ino = self.inodes.remember(gfid);
        self.inodes.forget(ino, 1);
        ino
    }

    /// The entry a fop that makes a name (MKNOD, MKDIR, SYMLINK, LINK) answered.
    pub(super) fn new_entry(
        &self,
        reply: std::result::Result<FopReply, Error>,
    ) -> Result<(FileAttr, Ttl)> {
        match reply {
            Ok(
                FopReply::Mknod(r)
                | FopReply::Mkdir(r)
                | FopReply::Symlink(r)
                | FopReply::Link(r)
                | FopReply::Put(r),
            ) => Ok(self.entry(&r.iatt)),
            Ok(other) => Err(unexpected(&other)),
            Err(e) => Err(errno(e)),
        }
    }

    /// A refused change made behind to node `ino`, as its errno (once).
    pub(super) fn take_behind_failure(&self, ino: u64) -> Result<()> {
        match self
            .gfid(ino)
            .ok()
            .and_then(|g| self.behind.take_failure(&g))
        {
            Some(errno) => Err(Errno::from_i32(errno)),
            None => Ok(()),
        }
    }

    /// LOOKUP of `name` in node `parent`, as `c`: a deferred create's entry, the brick's, or
    /// `None` for a negative entry the kernel may cache.
    pub(super) async fn lookup(
        self: &Arc<Self>,
        c: &Creds,
        parent: u64,
        name: &OsStr,
    ) -> Result<Option<(FileAttr, Ttl)>> {
        let lookup = kiln_wire::LookupXattrs {
            parent: self.gfid(parent)?,
            name: name_of(name)?,
        };
        if let Some(iatt) = self.pending.find(lookup.parent, &lookup.name).await {
            return Ok(Some(self.entry(&iatt)));
        }
        if let Some(answer) = self.lookup_here(&lookup.parent, &lookup.name) {
            return answer;
        }
        self.lookup_missed(c, parent, lookup.parent);
        if !self.leases.asks_before_queued(&lookup.parent) {
            self.behind.settle(&lookup.parent).await;
        }
        self.send_undescribed_writes().await;
        let (parent, name) = (lookup.parent, lookup.name.clone());
        // Asked under a lease of a directory whose entries are not all known: the answer
        // is learned.
        let held = self.leases.generation(&parent);
        let learn = |found| {
            if let Some(generation) = held {
                self.leases.learn(&parent, generation, &name, found);
            }
        };
        match self.layer.call(c, lookup.into()).await {
            Ok(FopReply::LookupXattrs(r)) => {
                if r.iatt.file_type != FileType::Directory {
                    learn(Some(r.iatt.gfid));
                }
                if let Some(ino) = self.inodes.ino_of(&r.iatt.gfid) {
                    // Stale pages go before the kernel has the entry (and reads on).
                    self.drop_stale_pages(ino, &r.iatt).await;
                }
                let (attr, mut ttl) = self.entry(&r.iatt);
                self.note_xattrs(attr.ino.0, r.xattrs);
                if !self.leases.tell(&parent, &name) {
                    ttl.entry = Duration::ZERO;
                }
                Ok(Some((attr, ttl)))
            }
            Ok(other) => Err(unexpected(&other)),
            Err(Error::Fop(ErrorCode::NoEnt)) => {
                learn(None);
                self.absent(&parent, &name)
            }
            Err(e) => Err(errno(e)),
        }
    }

    /// LOOKUP of `name` in directory `parent` answered from what the mount holds: a held
    /// directory's entries, the description of an object made here, a kept listing; `None`
    /// when the brick must answer.
    fn lookup_here(&self, parent: &Gfid, name: &Name) -> Option<Result<Option<(FileAttr, Ttl)>>> {
        match self.leases.lookup(parent, name) {
            // A held directory knows all its names.
            Answer::Absent => Some(self.absent(parent, name)),
            Answer::Present(gfid) => {
                if let Some(local) = self.leases.local(&gfid) {
                    return Some(Ok(Some(self.entry(&local.iatt))));
                }
                let (iatt, xattrs) = self.listed(parent, &gfid)?;
                let (attr, ttl) = self.entry(&iatt);
                self.note_xattrs(attr.ino.0, xattrs);
                if iatt.file_type == FileType::Regular {
                    self.inodes.note_listed_in(attr.ino.0, *parent);
                }
                Some(Ok(Some((attr, ttl))))
            }
            Answer::Unknown => None,
        }
    }

    /// The answer to a LOOKUP of `name` in `parent`, which does not exist: a negative entry
    /// where the kernel may cache one (and the name is noted for the lease's recall), else
    /// ENOENT.
    fn absent(&self, parent: &Gfid, name: &Name) -> Result<Option<(FileAttr, Ttl)>> {
        let negative = !self.options.negative_timeout.is_zero();
        match negative && self.leases.tell(parent, name) {
            true => Ok(None),
            false => Err(Errno::ENOENT),
        }
    }

    /// The attributes of node `ino`: through handle `fh` when the kernel names one, else by
    /// GFID; a file with no name left (unlinked while open) is reached through a handle.
    pub(super) async fn stat(&self, c: &Creds, ino: u64, fh: Option<FileHandle>) -> Result<Iatt> {
        let fstat = |open: Arc<Open<L::Fd>>| async move {
            let fop = FdFop::new(|fd| kiln_wire::Fstat { fd }.into());
            attr_of(self.layer.call_fd(c, self.fd(&open).await?, fop).await)
        };
        // An object made under a lease whose changes are still queued: as the mount has it.
        if let Some(local) = self.inodes.gfid(ino).and_then(|g| self.leases.local(&g)) {
            return Ok(local.iatt);
        }
        // A deferred create in a held directory is described as it will be sent (its PUT
        // stores these times); elsewhere a stat sends it, and the brick's times are the file's.
        if let Some(slot) = self.pending.get(ino)
            && let Some(pending) = slot.lock().await.as_ref()
            && self.leases.holds(&pending.parent)
        {
            return Ok(pending.iatt());
        }
        // A file as the kept listing it was listed in has it.
        let listed_in = self.inodes.listed_in(ino).zip(self.inodes.gfid(ino));
        if let Some((iatt, _)) = listed_in.and_then(|(dir, gfid)| self.listed(&dir, &gfid)) {
            return Ok(iatt);
        }
        // A file as the brick gave it under its lease, not changed here since.
        let leased = self
            .inodes
            .gfid(ino)
            .and_then(|gfid| self.files.attrs(&gfid));
        if let Some((iatt, mark)) = leased
            && self.inodes.unchanged_since(ino, mark)
        {
            return Ok(iatt);
        }
        self.settle(ino).await?;
        // Through the handle's fd where it has one; one opened behind is not opened on the
        // brick for this (the kernel asks a file's size at every read that reaches its end).
        let open = fh.and_then(|fh| self.handles.get(fh).ok());
        if let Some(open) = open.filter(|open| open.fd.initialized()) {
            return fstat(open).await;
        }
        let gfid = self.gfid(ino)?;
        // A held directory's description, once read, lasts the lease.
        let held = self.leases.generation(&gfid);
        match self.layer.call(c, kiln_wire::Stat { gfid }.into()).await {
            Err(Error::Fop(ErrorCode::Stale | ErrorCode::NoEnt))
                if self.handles.any_on(ino).is_some() =>
            {
                fstat(self.handles.any_on(ino).ok_or(Errno::ESTALE)?).await
            }
            reply => {
                let iatt = attr_of(reply)?;
                if let Some(generation) = held
                    && !self.behind.is_dirty(&gfid)
                {
                    self.leases.describe_held(generation, iatt.clone());
                }
                Ok(iatt)
            }
        }
    }

    /// Changes the attributes of node `ino`. A size change through a handle is
    /// ftruncate(2): the handle's write access allows it, whatever the file's mode says.
    pub(super) async fn setattr(
        &self,
        c: &Creds,
        ino: u64,
        fh: Option<FileHandle>,
        mut attr: SetAttr,
    ) -> Result<Iatt> {
        if let Some(slot) = self.pending.get(ino)
            && let Some(pending) = slot.lock().await.as_mut()
            && pending.setattr(c, attr)
        {
            return Ok(pending.iatt());
        }
        // Data written behind goes before a change queued behind: a truncate or new times
        // must not be overtaken by it.
        self.send_writes_behind(Some(ino)).await;
        if let Some(iatt) = self.setattr_behind(c, &self.gfid(ino)?, attr).await {
            return Ok(iatt);
        }
        self.settle(ino).await?;
        let open = fh.and_then(|fh| self.handles.get(fh).ok());
        let mut truncated = None;
        if let (Some(open), Some(size)) = (&open, attr.size) {
            let fop = FdFop::new(|fd| kiln_wire::Ftruncate { fd, size }.into());
            let reply = self.layer.call_fd(c, self.fd(open).await?, fop).await;
            if let Ok(changed) = &reply {
                self.note_data_change(changed);
            }
            // The brick describes the file from now on (its size moved).
            self.leases.forget_local(&self.gfid(ino)?);
            truncated = Some(attr_of(reply)?);
            attr.size = None;
        }
        if attr.is_empty() {
            // Nothing else, or only a ctime change (the brick keeps its own ctime).
            return match truncated {
                Some(iatt) => Ok(iatt),
                None => self.stat(c, ino, fh).await,
            };
        }
        let gfid = self.gfid(ino)?;
        let reply = match &open {
            Some(open) => {
                let fop = FdFop::new(|fd| kiln_wire::Fsetattr { fd, attr }.into());
                self.layer.call_fd(c, self.fd(open).await?, fop).await
            }
            None => {
                let setattr = kiln_wire::Setattr { gfid, attr };
                self.call_node(c, ino, setattr.into()).await
            }
        };
        if let Ok(changed) = &reply {
            self.note_data_change(changed);
        }
        self.leases.forget_local(&gfid);
        attr_of(reply)
    }

    /// GETXATTR of `name` on node `ino`, as `c`. A name the brick says is absent is
    /// remembered as absent for the attribute lifetime. A name programs probe on every file
    /// ([`XattrPresence::PROBED`]: `ls -l` asks two, `cp -a` and `tar` more), when LOOKUP or
    /// READDIRP did not tell its absence, is looked for in a LISTXATTR first, which tells the
    /// absence of all of them in one round trip.
    pub(super) async fn getxattr(&self, c: &Creds, ino: u64, name: XattrName) -> Result<Bytes> {
        self.settle(ino).await?;
        if XattrPresence::is_probed(name.as_bytes()) && !self.inodes.probed_known(ino) {
            self.probe_xattrs(c, ino).await;
        }
        if self.inodes.xattr_is_absent(ino, name.as_bytes()) {
            return Err(Errno::NO_XATTR);
        }
        let get = kiln_wire::Getxattr {
            gfid: self.gfid(ino)?,
            name: name.clone(),
        };
        match self.call_node(c, ino, get.into()).await {
            Ok(FopReply::Getxattr(r) | FopReply::Fgetxattr(r)) => Ok(r.value.into_bytes()),
            Ok(other) => Err(unexpected(&other)),
            Err(Error::Fop(ErrorCode::NoData)) => {
                let until = Instant::now() + self.options.attr_timeout;
                self.inodes.note_absent_xattr(ino, name.as_bytes(), until);
                Err(Errno::NO_XATTR)
            }
            Err(e) => Err(errno(e)),
        }
    }

    /// Remembers which of the probed xattrs node `ino` lacks (as a LOOKUP or READDIRP told),
    /// for the attribute lifetime.
    pub(super) fn note_xattrs(&self, ino: u64, xattrs: XattrPresence) {
        // All present is what a brick that could not tell says: worth a LISTXATTR to learn.
        if xattrs != XattrPresence::UNKNOWN {
            let until = Instant::now() + self.options.attr_timeout;
            self.inodes.note_probed(ino, xattrs, until);
        }
    }

    /// Lists node `ino`'s xattrs and remembers which of the probed ones it has, for the
    /// attribute lifetime (nothing, if the list does not come).
    pub(super) async fn probe_xattrs(&self, c: &Creds, ino: u64) {
        let Ok(gfid) = self.gfid(ino) else {
            return;
        };
        let list = self.layer.call(c, kiln_wire::Listxattr { gfid }.into());
        if let Ok(FopReply::Listxattr(r)) = list.await {
            let present = XattrPresence::of_names(r.entries.iter().map(XattrName::as_bytes));
            let until = Instant::now() + self.options.attr_timeout;
            self.inodes.note_probed(ino, present, until);
        }
    }

    /// READLINK of node `ino`, as `c`.
    pub(super) async fn readlink(&self, c: &Creds, ino: u64) -> Result<Bytes> {
        self.settle(ino).await?;
        let readlink = kiln_wire::Readlink {
            gfid: self.gfid(ino)?,
        };
        match self.layer.call(c, readlink.into()).await {
            Ok(FopReply::Readlink(r)) => Ok(r.target.into_bytes()),
            Ok(other) => Err(unexpected(&other)),
            Err(e) => Err(errno(e)),
        }
    }

    /// LISTXATTR of node `ino`, as `c`.
    pub(super) async fn listxattr(&self, c: &Creds, ino: u64) -> Result<Vec<XattrName>> {
        self.settle(ino).await?;
        let list = kiln_wire::Listxattr {
            gfid: self.gfid(ino)?,
        };
        match self.layer.call(c, list.into()).await {
            Ok(FopReply::Listxattr(r)) => Ok(r.entries),
            Ok(other) => Err(unexpected(&other)),
            Err(e) => Err(errno(e)),
        }
    }

    /// `fop`, which names node `ino` by its GFID, as `c`. A file whose last name is gone is
    /// no longer found on the brick by its GFID; while this mount holds it open, a fop with
    /// an fd form ([`fd_form`]) goes through one of its handles instead, as calls on an open
    /// file reach it (`fchmod`, `fsetxattr` of an unlinked file: the kernel passes no handle
    /// with them).
    pub(super) async fn call_node(
        &self,
        c: &Creds,
        ino: u64,
        fop: FopRequest,
    ) -> std::result::Result<FopReply, Error> {
        let by_fd = fd_form(&fop);
        match self.layer.call(c, fop).await {
            Err(Error::Fop(code @ (ErrorCode::Stale | ErrorCode::NoEnt))) => {
                let (Some(by_fd), Some(open)) = (by_fd, self.handles.any_on(ino)) else {
                    return Err(Error::Fop(code));
                };
                let fd = self.fd(&open).await.map_err(|_| Error::Fop(code))?;
                self.layer.call_fd(c, fd, by_fd).await
            }
            reply => reply,
        }
    }

    /// Learns each brick's free space ([`super::space`]) now, then each
    /// [`SPACE_CHECK_INTERVAL`] in which changes were queued behind or the space was low
    /// (nothing is queued then: what was owed at the last STATFS may be on the brick now),
    /// until the mount ends.
    pub(super) async fn watch_free_space(self: Arc<Self>) {
        if !self.behind.space.watched() {
            return;
        }
        let mut every = tokio::time::interval(SPACE_CHECK_INTERVAL);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last = None;
        loop {
            every.tick().await;
            let asked = self.behind.space.asking();
            if last == Some(asked.queued) && !self.behind.space.is_low() {
                continue;
            }
            match self.layer.statfs_each(&Creds::root()).await {
                Ok(bricks) => {
                    self.behind.space.found(asked, &bricks);
                    last = Some(asked.queued);
                }
                Err(e) => tracing::debug!(error = ?e, "the volume's free space is not known"),
            }
        }
    }

    /// STATFS of the volume, as `c`.
    pub(super) async fn statfs(&self, c: &Creds) -> Result<FsStats> {
        let statfs = kiln_wire::Statfs { gfid: Gfid::ROOT };
        match self.layer.call(c, statfs.into()).await {
            Ok(FopReply::Statfs(r)) => Ok(r.stats),
            Ok(other) => Err(unexpected(&other)),
            Err(e) => Err(errno(e)),
        }
    }
}

/// The fd form of `fop`, a fop that names an object by its GFID, where the wire has one.
fn fd_form(fop: &FopRequest) -> Option<FdFop> {
    let fop = match fop {
        FopRequest::Setattr(r) => {
            let attr = r.attr;
            FdFop::new(|fd| kiln_wire::Fsetattr { fd, attr }.into())
        }
        FopRequest::Getxattr(r) => {
            let name = r.name.clone();
            FdFop::new(|fd| kiln_wire::Fgetxattr { fd, name }.into())
        }
        FopRequest::Setxattr(r) => {
            let (name, value, mode) = (r.name.clone(), r.value.clone(), r.mode);
            FdFop::new(|fd| {
                kiln_wire::Fsetxattr {
                    fd,
                    name,
                    value,
                    mode,
                }
                .into()
            })
        }
        FopRequest::Removexattr(r) => {
            let name = r.name.clone();
            FdFop::new(|fd| kiln_wire::Fremovexattr { fd, name }.into())
        }
        _ => return None,
    };
    Some(fop)
}

/// Puts `data` into the kernel's page cache as the content of node `ino` from offset 0, now,
/// on this thread.
pub(super) fn store_pages(kernel: &fuser::Notifier, ino: u64, data: &[u8]) {
    if let Err(e) = kernel.store(fuser::INodeNo(ino), 0, data) {
        tracing::debug!(ino, error = %e, "the kernel took no pages of a new file");
    }
}
