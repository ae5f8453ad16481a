//! The FUSE file system: each kernel request becomes one fop (or none, when the answer is
//! already known) on the client stack below the mount.
//!
//! fuser calls these methods on a FUSE thread: with FUSE over io_uring, the thread of the
//! caller's CPU (one per CPU, so two requests may run at once), else the one reader of
//! `/dev/fuse`. Each copies what it needs out of the request and answers at once, or spawns
//! a task on the mount's tokio runtime and returns, so many requests are in flight at once
//! and the client pipelines them over QUIC. The task sends the reply. What a
//! task does beyond one fop lives with the state it works on: open handles in
//! [`super::handles`], nodes in [`super::shared`]; the kernel's types become wire types in
//! [`super::convert`].
//!
//! Every fop runs as the caller (uid, gid, supplementary groups, pid), so the brick checks
//! permissions as a local file system would; `default_permissions` adds the kernel's own
//! check in front. A small write-only create may be answered here and sent later as one PUT
//! ([`super::pending`]); every fop that must find such a file on the brick sends it first.

use std::ffi::OsStr;
use std::future::Future;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use fuser::{
    AccessFlags, Errno, FileHandle, FopenFlags, INodeNo, InitFlags, KernelConfig, LockOwner,
    OpenFlags as FuseOpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyLock, ReplyLseek, ReplyOpen, ReplyStatfs,
    ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use kiln_wire::limits::IO_SIZE_MAX_BYTES;
use kiln_wire::{FileType, FopRequest, LockCmd, Mode, SetAttr, SymlinkTarget, XattrValue};
use tokio::runtime::Handle;

use super::MountOptions;
use super::convert::{
    Fail, GEN, Result, access_mask, creds, dot_attr, dots_from, errno, fallocate_fops, file_kind,
    fuse_lock, name_of, negative_attr, node_type, os, rename_mode, reply_entry, reply_xattr,
    time_set, wire_lock, xattr_name, xattr_set_mode,
};
use super::shared::Shared;
use crate::path::new_gfid;
use crate::{FdFop, Layer};

/// FUSE requests the kernel may have in flight in the background (reads ahead, writeback).
const BACKGROUND_MAX: u16 = 64;

/// The file system fuser drives, over client stack `L`.
#[derive(Debug)]
pub(crate) struct KilnFs<L: Layer> {
    runtime: Handle,
    shared: Arc<Shared<L>>,
    /// The sender of changes made behind, the listener for recalls, and the sender of
    /// what waited behind a second.
    tasks: [tokio::task::JoinHandle<()>; 4],
}

/// How long an unmount waits for the changes made behind to reach the brick.
pub const UNMOUNT_DRAIN_LIMIT: Duration = Duration::from_secs(60);

impl<L: Layer> Drop for KilnFs<L> {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl<L: Layer> KilnFs<L> {
    pub(crate) fn new(runtime: Handle, layer: L, options: MountOptions) -> KilnFs<L> {
        let shared = Arc::new(Shared::new(layer, options));
        let tasks = [
            runtime.spawn(shared.clone().send_behind()),
            runtime.spawn(shared.clone().follow_events()),
            runtime.spawn(shared.clone().send_old_writes()),
            runtime.spawn(shared.clone().watch_free_space()),
        ];
        KilnFs {
            runtime,
            shared,
            tasks,
        }
    }

    /// Runs `work` ([`KilnFs::run`]) and answers with `ok` or its error.
    fn spawn<R: Fail + Send + 'static, T: Send + 'static>(
        &self,
        reply: R,
        work: impl Future<Output = Result<T>> + Send + 'static,
        ok: impl FnOnce(R, T) + Send + 'static,
    ) {
        let shared = self.shared();
        self.run(async move {
            match work.await {
                Ok(value) => ok(reply, value),
                Err(e) => reply.fail(shared.refused(e)),
            }
        });
    }

    /// [`KilnFs::spawn`] for a request that changes something: `changing` is numbered again
    /// once `work` is done, before the answer goes.
    fn spawn_changing<R: Fail + Send + 'static, T: Send + 'static>(
        &self,
        changing: impl Into<Option<Changing<L>>>,
        reply: R,
        work: impl Future<Output = Result<T>> + Send + 'static,
        ok: impl FnOnce(R, T) + Send + 'static,
    ) {
        let changing = changing.into();
        let work = async move {
            let done = work.await;
            drop(changing);
            done
        };
        self.spawn(reply, work, ok);
    }

    /// Runs `task` for a request: its first steps at once on the FUSE thread, the rest (from
    /// its first wait on) as a task of the runtime. A request the mount answers itself (a
    /// held directory's lookup, a change queued behind, a kept listing, a deferred create's
    /// write) then wakes no other thread; the FUSE thread never blocks, as a task that must
    /// wait moves to the runtime.
    fn run(&self, task: impl Future<Output = ()> + Send + 'static) {
        let _entered = self.runtime.enter();
        if let Some(task) = poll_here(Box::pin(task)) {
            // Polled again there at once: what woke the no-op waker meanwhile is not lost.
            self.runtime.spawn(task);
        }
    }

    pub(super) fn shared(&self) -> Arc<Shared<L>> {
        self.shared.clone()
    }

    /// Whether xattr `name` is one this mount does not carry ([`MountOptions::carries_xattr`]).
    fn unsupported_xattr(&self, name: &OsStr) -> bool {
        !self.shared.options.carries_xattr(name.as_bytes())
    }

    /// Notes a fop that may change nodes `inos` (the objects and the directories whose
    /// entries it changes), before it runs: no listing the mount kept that shows one of them
    /// answers after it. A node the mount does not know may be anything. The change is
    /// numbered now and again once answered ([`Changing`]).
    fn note_change(&self, changed: &[INodeNo]) -> Changing<L> {
        assert!(
            changed.len() <= CHANGED_NODES_MAX,
            "a fop changes at most two nodes"
        );
        let mut inos = [None; CHANGED_NODES_MAX];
        for (slot, ino) in inos.iter_mut().zip(changed) {
            *slot = Some(ino.0);
        }
        self.shared
            .inodes
            .note_change(inos.iter().flatten().copied());
        for &ino in inos.iter().flatten() {
            match self.shared.inodes.gfid(ino) {
                Some(gfid) => {
                    self.shared.made.forget(&gfid);
                    self.shared.leases.note_change(gfid);
                }
                None => {
                    self.shared.leases.note_any_change();
                    break;
                }
            }
        }
        Changing {
            shared: self.shared(),
            inos,
            blind: false,
        }
    }

    /// Runs the fop `build` makes on node `ino` as the caller of `req`, once the node is on
    /// the brick as this mount has it, and answers "done".
    fn run_done(
        &self,
        req: &Request,
        reply: ReplyEmpty,
        ino: u64,
        changing: Option<Changing<L>>,
        build: impl FnOnce(&Shared<L>) -> Result<FopRequest> + Send + 'static,
    ) {
        let (s, c) = (self.shared(), creds(req));
        self.spawn_changing(
            changing,
            reply,
            async move {
                s.settle(ino).await?;
                let fop = build(&s)?;
                s.call_node(&c, ino, fop).await.map(drop).map_err(errno)
            },
            |reply, ()| reply.ok(),
        );
    }

    /// Runs the fop `build` makes (one that makes a name: MKNOD, MKDIR, SYMLINK, LINK) as the
    /// caller of `req` and answers with the new entry.
    fn make_entry(
        &self,
        req: &Request,
        reply: ReplyEntry,
        changes: &[INodeNo],
        build: impl FnOnce(&Shared<L>) -> Result<FopRequest> + Send + 'static,
    ) {
        let changing = self.note_change(changes);
        let (s, c) = (self.shared(), creds(req));
        self.spawn_changing(
            changing,
            reply,
            async move {
                let fop = build(&s)?;
                s.make_name(&c, fop).await
            },
            reply_entry,
        );
    }

    /// Runs the fop `build` makes (one that removes or renames names: UNLINK, RMDIR, RENAME)
    /// as the caller of `req` and answers "done".
    fn change_entry(
        &self,
        req: &Request,
        reply: ReplyEmpty,
        changes: &[INodeNo],
        build: impl FnOnce(&Shared<L>) -> Result<FopRequest> + Send + 'static,
    ) {
        // The file removed or renamed changes too (its links, its ctime), by its name.
        let changing = self.note_change(changes).blind();
        let (s, c) = (self.shared(), creds(req));
        self.spawn_changing(
            changing,
            reply,
            async move {
                let fop = build(&s)?;
                s.change_names(&c, fop).await
            },
            |reply, ()| reply.ok(),
        );
    }

    /// Runs the fd fop `build` makes on handle `fh` as the caller of `req`, and answers
    /// "done".
    fn run_on_handle(
        &self,
        req: &Request,
        fh: FileHandle,
        reply: ReplyEmpty,
        build: impl FnOnce() -> Result<FdFop> + Send + 'static,
    ) {
        let (s, c) = (self.shared(), creds(req));
        self.spawn(
            reply,
            async move {
                let open = s.handles.get(fh)?;
                s.call_handle(&c, &open, build()?).await.map(drop)
            },
            |reply, ()| reply.ok(),
        );
    }

    /// Forgets handle `fh` and releases its fd below in the background: the kernel does not
    /// wait for a RELEASE either.
    fn release_handle(&self, req: &Request, fh: FileHandle) {
        let Some(open) = self.shared.handles.take(fh) else {
            return;
        };
        self.shared.store_released(&open);
        // Every change this program made before its close was answered by now (a write
        // through this handle is sent below, before anything is asked).
        let mark = self.shared.inodes.change_mark();
        let (s, c) = (self.shared(), creds(req));
        self.run(async move { s.release_handle(&c, fh, open, mark).await });
    }
}

/// Nodes one fop changes at most: a rename's two directories, a link's file and directory.
const CHANGED_NODES_MAX: usize = 2;

/// A change on its way through the mount ([`KilnFs::note_change`]), numbered again when it
/// drops — once the fop is answered, before the answer goes. Attributes a file lease's STAT
/// read while the change was on its way may predate it on the brick: numbered at its answer
/// too, the change counts as after any mark taken meanwhile
/// ([`unchanged_since`](super::inodes::Inodes::unchanged_since)).
#[must_use]
struct Changing<L: Layer> {
    shared: Arc<Shared<L>>,
    /// The nodes it changes (no allocation per request: a write is one).
    inos: [Option<u64>; CHANGED_NODES_MAX],
    /// It also changes a file the mount can name only by its name.
    blind: bool,
}

impl<L: Layer> Changing<L> {
    /// The change also changes a file by its name
    /// ([`note_blind_change`](super::inodes::Inodes::note_blind_change)).
    fn blind(mut self) -> Changing<L> {
        self.shared.inodes.note_blind_change();
        self.blind = true;
        self
    }
}

impl<L: Layer> Drop for Changing<L> {
    fn drop(&mut self) {
        self.shared
            .inodes
            .note_change(self.inos.iter().flatten().copied());
        if self.blind {
            self.shared.inodes.note_blind_change();
        }
    }
}

/// Polls `task` once on this thread: `Some(task)` when it waits and must go on elsewhere,
/// `None` once it is done — or panicked. A panic is caught: the request's reply, dropped
/// with the task, answers it EIO, and the thread (a FUSE queue's, whose requests the kernel
/// would otherwise wait for forever, its callers unkillable) serves the next request.
fn poll_here<F: Future<Output = ()>>(
    mut task: std::pin::Pin<Box<F>>,
) -> Option<std::pin::Pin<Box<F>>> {
    let mut first = std::task::Context::from_waker(std::task::Waker::noop());
    let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        task.as_mut().poll(&mut first)
    }));
    match polled {
        Ok(std::task::Poll::Pending) => Some(task),
        Ok(std::task::Poll::Ready(())) => None,
        Err(_) => {
            tracing::error!("a request's handler panicked; the request is answered EIO");
            None
        }
    }
}

impl<L: Layer> fuser::Filesystem for KilnFs<L> {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let io_max = IO_SIZE_MAX_BYTES as u32;
        // Each setter answers with the nearest value the kernel takes when it refuses ours.
        let _ = config.set_max_write(io_max);
        let _ = config.set_max_readahead(io_max);
        let _ = config.set_max_background(BACKGROUND_MAX);
        let _ = config.set_congestion_threshold(BACKGROUND_MAX * 3 / 4);
        // Every page the kernel keeps is covered by a lease only where files are leased.
        let pages_told = self.shared.uses_file_leases()
            && config
                .capabilities()
                .contains(InitFlags::FUSE_EXPLICIT_INVAL_DATA);
        let wanted = self.shared.options.kernel_features(pages_told);
        let available = wanted & config.capabilities();
        if available != wanted {
            tracing::warn!(missing = ?(wanted & !available), "the kernel lacks FUSE features");
        }
        config
            .add_capabilities(available)
            .map_err(|missing| std::io::Error::other(format!("FUSE features {missing:?}")))?;
        self.shared.pages_told.store(pages_told, Ordering::Relaxed);
        if self.shared.options.fuse_uring {
            match config.add_capabilities(InitFlags::FUSE_OVER_IO_URING) {
                Ok(()) => tracing::info!("the kernel's requests come through io_uring"),
                Err(_) => tracing::info!(
                    "FUSE over io_uring is not offered (Linux 6.14+ with the fuse module's \
                     enable_uring on): requests come through /dev/fuse"
                ),
            }
        }
        Ok(())
    }

    /// The unmount: what is queued behind reaches the brick (bounded); a change the brick
    /// refused is logged, as nobody is left to report it to.
    fn destroy(&mut self) {
        let (shared, behind, runtime) = (&self.shared, &self.shared.behind, &self.runtime);
        // On a thread of its own: the session may end on one of the runtime's (an unmount
        // run with `spawn_blocking`), where `block_on` would panic.
        let drained = std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    runtime.block_on(async {
                        let drained = async {
                            shared.send_writes_behind(None).await;
                            behind.drain().await;
                        };
                        tokio::time::timeout(UNMOUNT_DRAIN_LIMIT, drained).await
                    })
                })
                .join()
        })
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        if drained.is_err() {
            tracing::error!("unmounted with changes not yet on the brick (they are lost)");
        }
        while let Some(errno) = behind.take_any_failure() {
            tracing::error!(errno, "a change made behind was refused by the brick");
        }
    }

    fn lookup(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let (s, c, name) = (self.shared(), creds(req), name.to_owned());
        let negative = self.shared.options.negative_timeout;
        self.spawn(
            reply,
            async move { s.lookup(&c, parent.0, &name).await },
            move |reply, found| match found {
                Some((attr, ttl)) => reply.entry_with_ttls(&ttl.attr, &ttl.entry, &attr, GEN),
                // A negative entry (node 0): the kernel answers ENOENT itself until it
                // times out, or until this mount creates the name.
                None => reply.entry_with_ttls(&Duration::ZERO, &negative, &negative_attr(), GEN),
            },
        );
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.shared.inodes.forget(ino.0, nlookup);
    }

    fn getattr(&self, req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        let (s, c) = (self.shared(), creds(req));
        self.spawn(
            reply,
            async move {
                let iatt = s.stat(&c, ino.0, fh).await?;
                // Stale pages go before the kernel has the attributes (and reads on).
                s.drop_stale_pages(ino.0, &iatt).await;
                Ok(s.attr(ino.0, &iatt))
            },
            |reply, (attr, ttl)| reply.attr(&ttl, &attr),
        );
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let changing = self.note_change(&[ino]);
        let (s, c) = (self.shared(), creds(req));
        let attr = SetAttr {
            mode: mode.map(Mode::from_st_mode),
            uid,
            gid,
            size,
            atime: atime.map(time_set),
            mtime: mtime.map(time_set),
        };
        self.spawn_changing(
            changing,
            reply,
            async move {
                let iatt = s.setattr(&c, ino.0, fh, attr).await?;
                let (attr, ttl) = s.attr(ino.0, &iatt);
                let deferred = s.pending.get(ino.0).is_some();
                Ok((attr, if deferred { Duration::ZERO } else { ttl }))
            },
            |reply, (attr, ttl)| reply.attr(&ttl, &attr),
        );
    }

    fn readlink(&self, req: &Request, ino: INodeNo, reply: ReplyData) {
        let (s, c) = (self.shared(), creds(req));
        self.spawn(
            reply,
            async move { s.readlink(&c, ino.0).await },
            |reply, target| reply.data(&target),
        );
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let name = name_of(name);
        self.make_entry(req, reply, &[parent], move |s| {
            let node_type = node_type(mode)?;
            Ok(kiln_wire::Mknod {
                parent: s.gfid(parent.0)?,
                name: name?,
                gfid: new_gfid(),
                node_type,
                mode: Mode::from_st_mode(mode),
                umask: Mode::from_st_mode(umask),
                rdev: u64::from(rdev),
            }
            .into())
        });
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let name = name_of(name);
        self.make_entry(req, reply, &[parent], move |s| {
            Ok(kiln_wire::Mkdir {
                parent: s.gfid(parent.0)?,
                name: name?,
                gfid: new_gfid(),
                mode: Mode::from_st_mode(mode),
                umask: Mode::from_st_mode(umask),
            }
            .into())
        });
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let name = name_of(name);
        self.change_entry(req, reply, &[parent], move |s| {
            Ok(kiln_wire::Unlink {
                parent: s.gfid(parent.0)?,
                name: name?,
            }
            .into())
        });
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let name = name_of(name);
        self.change_entry(req, reply, &[parent], move |s| {
            Ok(kiln_wire::Rmdir {
                parent: s.gfid(parent.0)?,
                name: name?,
            }
            .into())
        });
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let name = name_of(link_name);
        let target = SymlinkTarget::new(Bytes::copy_from_slice(target.as_os_str().as_bytes()))
            .map_err(|e| Errno::from_i32(e.errno()));
        self.make_entry(req, reply, &[parent], move |s| {
            Ok(kiln_wire::Symlink {
                parent: s.gfid(parent.0)?,
                name: name?,
                gfid: new_gfid(),
                target: target?,
            }
            .into())
        });
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let (old_name, new_name) = (name_of(name), name_of(newname));
        self.change_entry(req, reply, &[parent, newparent], move |s| {
            let mode = rename_mode(flags)?;
            Ok(kiln_wire::Rename {
                old_parent: s.gfid(parent.0)?,
                old_name: old_name?,
                new_parent: s.gfid(newparent.0)?,
                new_name: new_name?,
                mode,
            }
            .into())
        });
    }

    fn link(
        &self,
        req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let name = name_of(newname);
        self.make_entry(req, reply, &[ino, newparent], move |s| {
            Ok(kiln_wire::Link {
                gfid: s.gfid(ino.0)?,
                new_parent: s.gfid(newparent.0)?,
                new_name: name?,
            }
            .into())
        });
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: FuseOpenFlags, reply: ReplyOpen) {
        let changes = flags.0 & libc::O_ACCMODE != libc::O_RDONLY || flags.0 & libc::O_TRUNC != 0;
        let changing = changes.then(|| self.note_change(&[ino]));
        let (s, c) = (self.shared(), creds(req));
        self.spawn_changing(
            changing,
            reply,
            async move { s.open_handle(&c, ino.0, flags.0).await },
            |reply, opened| reply.opened(opened.fh, opened.flags),
        );
    }

    fn read(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: FuseOpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let (s, c) = (self.shared(), creds(req));
        self.spawn(
            reply,
            async move {
                if offset == 0 {
                    s.read_files_ahead(&c, ino.0);
                }
                s.read(&c, fh, offset, size).await
            },
            |reply, data| reply.data(&data),
        );
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: FuseOpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let changing = self.note_change(&[ino]);
        let (s, c) = (self.shared(), creds(req));
        let data = Bytes::copy_from_slice(data);
        let kill_suidgid = write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID);
        self.spawn_changing(
            changing,
            reply,
            async move { s.write(&c, fh, offset, data, kill_suidgid).await },
            |reply, len| reply.written(len),
        );
    }

    fn flush(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // Writes are acknowledged by the brick before the kernel hears of them, so a close
        // pushes nothing but a deferred create; otherwise it matters only to the closer's
        // POSIX locks.
        let locked = self.shared.inodes.is_locked(ino.0);
        if !locked
            && self.shared.pending.is_idle()
            && self.shared.behind.has_no_failures()
            && !self.shared.handles.has_unsent(fh)
        {
            reply.ok();
            return;
        }
        // It may send a deferred create.
        let changing = self.note_change(&[ino]);
        let (s, c) = (self.shared(), creds(req));
        self.spawn_changing(
            changing,
            reply,
            async move { s.flush(&c, ino.0, fh, lock_owner, locked).await },
            |reply, ()| reply.ok(),
        );
    }

    fn release(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: FuseOpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.release_handle(req, fh);
        reply.ok();
    }

    fn fsync(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let (s, c) = (self.shared(), creds(req));
        self.spawn(
            reply,
            async move {
                // What is queued for the file reaches the brick first, and a change the brick
                // refused is this fsync's error. A deferred create goes as a PUT that syncs
                // the file: all it needs (a mail delivered: one round trip, not three).
                let synced = s.settle_synced(ino.0).await?;
                s.take_behind_failure(ino.0)?;
                if synced {
                    return Ok(());
                }
                let open = s.handles.get(fh)?;
                let fop = FdFop::new(|fd| kiln_wire::Fsync { fd, datasync }.into());
                s.call_handle(&c, &open, fop).await.map(drop)
            },
            |reply, ()| reply.ok(),
        );
    }

    fn opendir(&self, req: &Request, ino: INodeNo, _flags: FuseOpenFlags, reply: ReplyOpen) {
        let (s, c) = (self.shared(), creds(req));
        self.spawn(
            reply,
            async move {
                if s.prefetches() {
                    s.walk_opens(&c, ino.0);
                }
                s.opendir_handle(&c, ino.0).await
            },
            |reply, fh| reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE),
        );
    }

    fn readdir(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        reply: ReplyDirectory,
    ) {
        let (s, c) = (self.shared(), creds(req));
        self.run(async move {
            let mut reply = reply;
            let (dots, offset) = dots_from(offset);
            for &(dot, next) in dots {
                if reply.add(
                    dot_attr(ino, dot).ino,
                    next,
                    fuser::FileType::Directory,
                    dot,
                ) {
                    return reply.ok();
                }
            }
            let result = s
                .list(&c, fh, offset, |e| {
                    let kind = file_kind(e.iatt.file_type);
                    reply.add(
                        INodeNo(s.peek_ino(e.iatt.gfid)),
                        e.offset,
                        kind,
                        os(&e.name),
                    )
                })
                .await;
            match result {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(e),
            }
        });
    }

    fn readdirplus(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        reply: ReplyDirectoryPlus,
    ) {
        let (s, c) = (self.shared(), creds(req));
        self.run(async move {
            let mut reply = reply;
            let (prefetches, dir) = (s.prefetches(), s.inodes.gfid(ino.0));
            // Where a file's kept listing is found again (its GETATTR, its read-ahead).
            let listed_in = dir.filter(|_| s.answers_from_listings());
            let mut ahead = Vec::new();
            let (dots, offset) = dots_from(offset);
            for &(dot, next) in dots {
                let attr = dot_attr(ino, dot);
                if reply.add(attr.ino, next, dot, &Duration::ZERO, &attr, GEN) {
                    return reply.ok();
                }
            }
            let result = s
                .list(&c, fh, offset, |e| {
                    // Each entry the kernel takes counts as a lookup; one that does not fit
                    // is given back.
                    let (attr, ttl) = s.entry(&e.iatt);
                    s.note_xattrs(attr.ino.0, e.xattrs);
                    let full = reply.add(attr.ino, e.offset, os(&e.name), &ttl.attr, &attr, GEN);
                    if full {
                        s.inodes.forget(attr.ino.0, 1);
                    } else if let Some(dir) = listed_in
                        && e.iatt.file_type == FileType::Regular
                    {
                        s.inodes.note_listed_in(attr.ino.0, dir);
                    } else if prefetches
                        && e.iatt.file_type == FileType::Directory
                        && !matches!(e.name.as_bytes(), b"." | b"..")
                    {
                        ahead.push((attr.ino.0, e.iatt.gfid));
                    }
                    full
                })
                .await;
            match result {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(e),
            }
            if let Some(dir) = dir
                && !ahead.is_empty()
            {
                s.subdirs_shown(&c, dir, ahead);
            }
        });
    }

    fn releasedir(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: FuseOpenFlags,
        reply: ReplyEmpty,
    ) {
        self.release_handle(req, fh);
        reply.ok();
    }

    fn fsyncdir(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let (s, c) = (self.shared(), creds(req));
        self.spawn(
            reply,
            async move {
                // Everything queued reaches the brick first (a directory's fsync is how an
                // application waits for the changes made behind), and the first change the
                // brick refused is this fsync's error.
                s.send_writes_behind(None).await;
                s.behind.drain().await;
                if let Some(errno) = s.behind.take_any_failure() {
                    return Err(Errno::from_i32(errno));
                }
                let open = s.handles.get(fh)?;
                let fop = FdFop::new(|fd| kiln_wire::Fsyncdir { fd, datasync }.into());
                s.call_handle(&c, &open, fop).await.map(drop)
            },
            |reply, ()| reply.ok(),
        );
    }

    fn statfs(&self, req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let (s, c) = (self.shared(), creds(req));
        self.spawn(reply, async move { s.statfs(&c).await }, |reply, st| {
            let small = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
            reply.statfs(
                st.blocks,
                st.bfree,
                st.bavail,
                st.files,
                st.ffree,
                small(st.bsize),
                small(st.namemax),
                small(st.frsize),
            );
        });
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        if self.unsupported_xattr(name) {
            reply.error(Errno::from_i32(libc::EOPNOTSUPP));
            return;
        }
        let changing = self.note_change(&[ino]);
        self.shared.inodes.forget_xattr(ino.0, name.as_bytes());
        let name = xattr_name(name);
        let value = XattrValue::new(Bytes::copy_from_slice(value))
            .map_err(|_| Errno::from_i32(libc::E2BIG));
        self.run_done(req, reply, ino.0, Some(changing), move |s| {
            let mode = xattr_set_mode(flags)?;
            let gfid = s.gfid(ino.0)?;
            s.touch_ctime(&gfid);
            Ok(kiln_wire::Setxattr {
                gfid,
                name: name?,
                value: value?,
                mode,
            }
            .into())
        });
    }

    fn getxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        if self.unsupported_xattr(name) {
            reply.error(Errno::from_i32(libc::EOPNOTSUPP));
            return;
        }
        if self.shared.inodes.xattr_is_absent(ino.0, name.as_bytes()) {
            reply.error(Errno::NO_XATTR);
            return;
        }
        let (s, c, name) = (self.shared(), creds(req), xattr_name(name));
        self.spawn(
            reply,
            async move { s.getxattr(&c, ino.0, name?).await },
            move |reply, value| reply_xattr(reply, size, &value),
        );
    }

    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let (s, c) = (self.shared(), creds(req));
        self.spawn(
            reply,
            async move {
                let mut names = s.listxattr(&c, ino.0).await?;
                names.retain(|name| s.options.carries_xattr(name.as_bytes()));
                Ok(names.into_iter().fold(Vec::new(), |mut list, name| {
                    list.extend_from_slice(name.as_bytes());
                    list.push(0);
                    list
                }))
            },
            move |reply, list| reply_xattr(reply, size, &list),
        );
    }

    fn removexattr(&self, req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        if self.unsupported_xattr(name) {
            reply.error(Errno::from_i32(libc::EOPNOTSUPP));
            return;
        }
        let changing = self.note_change(&[ino]);
        self.shared.inodes.forget_xattr(ino.0, name.as_bytes());
        let name = xattr_name(name);
        self.run_done(req, reply, ino.0, Some(changing), move |s| {
            let gfid = s.gfid(ino.0)?;
            s.touch_ctime(&gfid);
            Ok(kiln_wire::Removexattr { gfid, name: name? }.into())
        });
    }

    fn access(&self, req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        self.run_done(req, reply, ino.0, None, move |s| {
            Ok(kiln_wire::Access {
                gfid: s.gfid(ino.0)?,
                mask: access_mask(mask),
            }
            .into())
        });
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let mut changing = self.note_change(&[parent]);
        if flags & (libc::O_TRUNC | libc::O_EXCL) == libc::O_TRUNC {
            // The name may be a file another client made meanwhile: emptied, by its name.
            changing = changing.blind();
        }
        let (s, c, name) = (self.shared(), creds(req), name.to_owned());
        self.spawn_changing(
            changing,
            reply,
            async move {
                let created = s.create_handle(&c, parent.0, &name, (mode, umask, flags));
                let created = created.await;
                if created.is_ok() {
                    s.ask_write_lease(&c, parent.0);
                }
                created
            },
            |reply, (attr, ttl, opened)| {
                reply.created(&ttl.entry, &attr, GEN, opened.fh, opened.flags);
            },
        );
    }

    fn getlk(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        reply: ReplyLock,
    ) {
        let (s, c) = (self.shared(), creds(req));
        self.spawn(
            reply,
            async move {
                let open = s.handles.get(fh)?;
                let lock = wire_lock(typ, start, end, pid, lock_owner)?;
                s.getlk(&c, &open, lock).await
            },
            |reply, lock| {
                let (start, end, typ, pid) = fuse_lock(&lock);
                reply.locked(start, end, typ, pid);
            },
        );
    }

    fn setlk(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        sleep: bool,
        reply: ReplyEmpty,
    ) {
        self.shared.inodes.mark_locked(ino.0);
        self.shared.handles.note_lock_owner(fh, lock_owner);
        self.run_on_handle(req, fh, reply, move || {
            let lock = wire_lock(typ, start, end, pid, lock_owner)?;
            let cmd = if sleep {
                LockCmd::SetWait
            } else {
                LockCmd::Set
            };
            Ok(FdFop::new(|fd| kiln_wire::Lk { fd, cmd, lock }.into()))
        });
    }

    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let changing = self.note_change(&[ino]);
        let (s, c) = (self.shared(), creds(req));
        self.spawn_changing(
            changing,
            reply,
            async move {
                let open = s.handles.get(fh)?;
                let allocated = async {
                    for fop in fallocate_fops(mode, offset, length)? {
                        s.call_handle(&c, &open, fop).await?;
                    }
                    Ok(())
                };
                let result = allocated.await;
                s.forget_described(open.ino);
                result
            },
            |reply, ()| reply.ok(),
        );
    }

    fn lseek(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        let (s, c) = (self.shared(), creds(req));
        self.spawn(
            reply,
            async move {
                let open = s.handles.get(fh)?;
                s.seek(&c, &open, offset, whence).await
            },
            |reply, offset| reply.offset(offset),
        );
    }

    /// No ioctl is a file's here: ENOTTY, as a local file system answers the terminal ioctl
    /// (`TCGETS`) that Python's and C's stdio ask of every file they open, and nothing logged.
    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: fuser::IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: fuser::ReplyIoctl,
    ) {
        reply.error(Errno::ENOTTY);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    /// Stands for a request's reply: fuser answers EIO when one is dropped unsent.
    struct Reply<'a>(&'a AtomicBool);

    impl Drop for Reply<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_handler_that_panics_drops_its_reply_and_the_thread_goes_on() {
        let dropped = AtomicBool::new(false);
        let reply = Reply(&dropped);
        let left = poll_here(Box::pin(async move {
            let _reply = reply;
            panic!("a handler's bug");
        }));
        assert!(left.is_none());
        assert!(dropped.load(Ordering::SeqCst), "the reply answers EIO");

        let waits = poll_here(Box::pin(std::future::pending::<()>()));
        assert!(waits.is_some(), "a waiting task goes on elsewhere");
        assert!(poll_here(Box::pin(async {})).is_none());
    }
}
