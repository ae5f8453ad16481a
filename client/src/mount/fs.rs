//! The FUSE file system: each kernel request becomes one fop (or none, when the answer is
//! already known) on the volume.
//!
//! fuser calls these methods on its reader thread; each one copies what it needs out of the
//! request, spawns a task on the mount's tokio runtime and returns, so many requests are in
//! flight at once and the client pipelines them over QUIC. The task sends the reply.
//!
//! Every fop runs as the caller (uid, gid, supplementary groups, pid), so the brick checks
//! permissions as a local file system would; `default_permissions` adds the kernel's own
//! check in front. A small write-only create may be answered here and sent later as one PUT
//! ([`super::pending`]); every fop that must find such a file on the brick sends it first.

use std::collections::{HashMap, VecDeque};
use std::ffi::OsStr;
use std::future::Future;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use fuser::{
    AccessFlags, Errno, FileAttr, FileHandle, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, OpenFlags as FuseOpenFlags, RenameFlags, ReplyAttr, ReplyCreate,
    ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyLock, ReplyLseek,
    ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use kiln_wire::limits::{GROUPS_MAX, IO_SIZE_MAX_BYTES};
use kiln_wire::{
    AccessMask, AccessMode, Creds, DirEntryPlus, ErrorCode, FileType, FopReply, FopRequest, Gfid,
    Groups, Iatt, Lock, LockCmd, LockKind, Mode, Name, NodeType, OpenFlags, ReaddirSize,
    RenameMode, SeekWhat, SetAttr, SymlinkTarget, TimeSet, Timespec, XattrName, XattrSetMode,
    XattrValue,
};
use tokio::runtime::Handle;

use super::MountOptions;
use super::inodes::Inodes;
use super::pending::{ParentAttr, Pending, PendingCreates};
use crate::path::new_gfid;
use crate::{Error, Fd, Volume};

/// Bytes of directory entries fetched from the brick per READDIRP; the kernel takes them a
/// page at a time from the handle's buffer.
const READDIR_FETCH_BYTES: u32 = 128 * 1024;
/// FUSE requests the kernel may have in flight in the background (reads ahead, writeback).
const BACKGROUND_MAX: u16 = 64;
/// The end of a POSIX lock that runs to the end of the file (the kernel's `OFFSET_MAX`).
const LOCK_END_OF_FILE: u64 = i64::MAX as u64;

/// The file system fuser drives.
#[derive(Debug)]
pub(crate) struct KilnFs {
    runtime: Handle,
    shared: Arc<Shared>,
}

/// What the tasks share.
#[derive(Debug)]
struct Shared {
    volume: Volume,
    options: MountOptions,
    inodes: Inodes,
    files: Mutex<HashMap<u64, Arc<Open>>>,
    next_fh: AtomicU64,
    pending: PendingCreates,
}

/// An open file or directory behind a FUSE file handle.
#[derive(Debug)]
struct Open {
    /// Set at open, or on first use for a deferred create (once it is on the brick).
    fd: tokio::sync::OnceCell<Fd>,
    ino: u64,
    /// How, and as whom, to open the file on the brick when the fd is made late.
    access: AccessMode,
    flags: OpenFlags,
    late_creds: Creds,
    /// Directories only: entries fetched but not yet given to the kernel.
    listing: tokio::sync::Mutex<Listing>,
}

#[derive(Debug, Default)]
struct Listing {
    /// The offset the kernel passes to continue at the first buffered entry.
    from: u64,
    entries: VecDeque<DirEntryPlus>,
    /// No entries follow the buffered ones.
    eof: bool,
}

type Result<T> = std::result::Result<T, Errno>;

impl KilnFs {
    pub(crate) fn new(runtime: Handle, volume: Volume, options: MountOptions) -> KilnFs {
        KilnFs {
            runtime,
            shared: Arc::new(Shared {
                volume,
                options,
                inodes: Inodes::new(),
                files: Mutex::new(HashMap::new()),
                next_fh: AtomicU64::new(1),
                pending: PendingCreates::default(),
            }),
        }
    }

    /// Runs `work` as a task and answers with `ok` or its error.
    fn spawn<R: Fail + Send + 'static, T: Send + 'static>(
        &self,
        reply: R,
        work: impl Future<Output = Result<T>> + Send + 'static,
        ok: impl FnOnce(R, T) + Send + 'static,
    ) {
        self.runtime.spawn(async move {
            match work.await {
                Ok(value) => ok(reply, value),
                Err(e) => reply.fail(e),
            }
        });
    }

    fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }

    /// Runs the fop `build` makes as the caller of `req`, after sending the deferred creates
    /// it must see, and answers "done".
    fn run_done(
        &self,
        req: &Request,
        reply: ReplyEmpty,
        settle: Settle,
        build: impl FnOnce(&Shared) -> Result<FopRequest> + Send + 'static,
    ) {
        let (s, v) = (self.shared(), self.volume(req));
        self.spawn(
            reply,
            async move {
                match settle {
                    Settle::Node(ino) => s.settle(&v, ino).await?,
                    Settle::All => {
                        s.settle_dir(&v, None).await;
                        s.anchor_handles().await;
                    }
                }
                let fop = build(&s)?;
                v.call(fop).await.map(drop).map_err(errno)
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
        build: impl FnOnce(&Shared) -> Result<FopRequest> + Send + 'static,
    ) {
        let (s, v) = (self.shared(), self.volume(req));
        self.spawn(
            reply,
            async move {
                s.settle_dir(&v, None).await;
                let fop = build(&s)?;
                s.new_entry(v.call(fop).await)
            },
            reply_entry,
        );
    }
}

/// Which deferred creates a fop must find on the brick.
#[derive(Debug, Clone, Copy)]
enum Settle {
    /// The node's own (it reads or changes the file).
    Node(u64),
    /// All of them, and every open handle gets its brick fd (it changes a directory, where
    /// a deferred name could be involved, and may remove a file still open).
    All,
}

/// The error half of every fuser reply type.
trait Fail {
    fn fail(self, e: Errno);
}

macro_rules! fail {
    ($($t:ty),*) => {$(
        impl Fail for $t {
            fn fail(self, e: Errno) {
                self.error(e);
            }
        }
    )*};
}
fail!(
    ReplyAttr,
    ReplyCreate,
    ReplyData,
    ReplyDirectory,
    ReplyDirectoryPlus,
    ReplyEmpty,
    ReplyEntry,
    ReplyLock,
    ReplyLseek,
    ReplyOpen,
    ReplyStatfs,
    ReplyWrite,
    ReplyXattr
);

impl fuser::Filesystem for KilnFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let io_max = IO_SIZE_MAX_BYTES as u32;
        // Each setter answers with the nearest value the kernel takes when it refuses ours.
        let _ = config.set_max_write(io_max);
        let _ = config.set_max_readahead(io_max);
        let _ = config.set_max_background(BACKGROUND_MAX);
        let _ = config.set_congestion_threshold(BACKGROUND_MAX * 3 / 4);
        let mut wanted = InitFlags::FUSE_POSIX_LOCKS
            | InitFlags::FUSE_ATOMIC_O_TRUNC
            | InitFlags::FUSE_DO_READDIRPLUS
            | InitFlags::FUSE_PARALLEL_DIROPS
            | InitFlags::FUSE_AUTO_INVAL_DATA
            | InitFlags::FUSE_CACHE_SYMLINKS
            // The brick writes, truncates and chowns as the caller, so its own kernel clears
            // set-id bits and capabilities; the FUSE kernel need not ask first (and with v2
            // it stops asking for security.capability before every write).
            | InitFlags::FUSE_HANDLE_KILLPRIV
            | InitFlags::FUSE_HANDLE_KILLPRIV_V2
            | InitFlags::FUSE_MAX_PAGES;
        if self.shared.options.writeback_cache {
            wanted |= InitFlags::FUSE_WRITEBACK_CACHE;
        }
        let available = wanted & config.capabilities();
        if available != wanted {
            tracing::warn!(missing = ?(wanted & !available), "the kernel lacks FUSE features");
        }
        config
            .add_capabilities(available)
            .map_err(|missing| std::io::Error::other(format!("FUSE features {missing:?}")))
    }

    fn lookup(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let (s, v, name) = (self.shared(), self.volume(req), name_of(name));
        let negative = self.shared.options.negative_timeout;
        self.spawn(
            reply,
            async move {
                let lookup = kiln_wire::Lookup {
                    parent: s.gfid(parent)?,
                    name: name?,
                };
                if let Some(iatt) = s.pending.find(lookup.parent, &lookup.name).await {
                    return Ok(Some(s.entry(&iatt)));
                }
                match v.call(lookup).await {
                    Ok(FopReply::Lookup(r)) => Ok(Some(s.entry(&r.iatt))),
                    Ok(other) => Err(unexpected(&other)),
                    Err(Error::Fop(ErrorCode::NoEnt)) if !negative.is_zero() => Ok(None),
                    Err(e) => Err(errno(e)),
                }
            },
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
        let (s, v) = (self.shared(), self.volume(req));
        self.spawn(
            reply,
            async move {
                let iatt = s.stat(&v, ino.0, fh).await?;
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
        let (s, v) = (self.shared(), self.volume(req));
        let attr = SetAttr {
            mode: mode.map(Mode::from_st_mode),
            uid,
            gid,
            size,
            atime: atime.map(time_set),
            mtime: mtime.map(time_set),
        };
        self.spawn(
            reply,
            async move {
                let iatt = s.setattr(&v, ino.0, fh, attr).await?;
                let (attr, ttl) = s.attr(ino.0, &iatt);
                let deferred = s.pending.get(ino.0).is_some();
                Ok((attr, if deferred { Duration::ZERO } else { ttl }))
            },
            |reply, (attr, ttl)| reply.attr(&ttl, &attr),
        );
    }

    fn readlink(&self, req: &Request, ino: INodeNo, reply: ReplyData) {
        let (s, v) = (self.shared(), self.volume(req));
        self.spawn(
            reply,
            async move {
                s.settle(&v, ino.0).await?;
                match v.call(kiln_wire::Readlink { gfid: s.gfid(ino)? }).await {
                    Ok(FopReply::Readlink(r)) => Ok(r.target.into_bytes()),
                    Ok(other) => Err(unexpected(&other)),
                    Err(e) => Err(errno(e)),
                }
            },
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
        self.make_entry(req, reply, move |s| {
            let node_type = match FileType::from_mode_bits(mode) {
                Some(FileType::Regular) => NodeType::Regular,
                Some(FileType::Fifo) => NodeType::Fifo,
                Some(FileType::Socket) => NodeType::Socket,
                Some(FileType::CharDevice) => NodeType::CharDevice,
                Some(FileType::BlockDevice) => NodeType::BlockDevice,
                _ => return Err(Errno::EINVAL),
            };
            Ok(kiln_wire::Mknod {
                parent: s.gfid(parent)?,
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
        self.make_entry(req, reply, move |s| {
            Ok(kiln_wire::Mkdir {
                parent: s.gfid(parent)?,
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
        self.run_done(req, reply, Settle::All, move |s| {
            Ok(kiln_wire::Unlink {
                parent: s.gfid(parent)?,
                name: name?,
            }
            .into())
        });
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let name = name_of(name);
        self.run_done(req, reply, Settle::All, move |s| {
            Ok(kiln_wire::Rmdir {
                parent: s.gfid(parent)?,
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
        self.make_entry(req, reply, move |s| {
            Ok(kiln_wire::Symlink {
                parent: s.gfid(parent)?,
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
        self.run_done(req, reply, Settle::All, move |s| {
            let mode = if flags.is_empty() {
                RenameMode::Replace
            } else if flags == RenameFlags::RENAME_NOREPLACE {
                RenameMode::NoReplace
            } else if flags == RenameFlags::RENAME_EXCHANGE {
                RenameMode::Exchange
            } else {
                return Err(Errno::EINVAL);
            };
            Ok(kiln_wire::Rename {
                old_parent: s.gfid(parent)?,
                old_name: old_name?,
                new_parent: s.gfid(newparent)?,
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
        self.make_entry(req, reply, move |s| {
            Ok(kiln_wire::Link {
                gfid: s.gfid(ino)?,
                new_parent: s.gfid(newparent)?,
                new_name: name?,
            }
            .into())
        });
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: FuseOpenFlags, reply: ReplyOpen) {
        let (s, v) = (self.shared(), self.volume(req));
        self.spawn(
            reply,
            async move {
                let gfid = s.gfid(ino)?;
                s.settle(&v, ino.0).await?;
                let (access, open_flags) = s.open_mode(flags.0);
                if s.opens_late(access, open_flags) {
                    return Ok(s.add_open(None, ino.0, access, open_flags, v.creds()));
                }
                let fd = match v.open(gfid, access, open_flags).await {
                    // The writeback cache reads pages of write-only files; a caller allowed
                    // only to write gets what it asked for.
                    Err(Error::Fop(ErrorCode::Access)) if access != requested_access(flags.0) => {
                        v.open(gfid, requested_access(flags.0), open_flags).await
                    }
                    other => other,
                }
                .map_err(errno)?;
                Ok(s.add_open(Some(fd), ino.0, access, open_flags, v.creds()))
            },
            move |reply, fh| reply.opened(FileHandle(fh), fopen_flags(flags.0)),
        );
    }

    fn read(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: FuseOpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let (s, v) = (self.shared(), self.volume(req));
        self.spawn(
            reply,
            async move {
                let open = s.open(fh)?;
                let size = size.min(IO_SIZE_MAX_BYTES as u32);
                if let Some(slot) = s.pending.get(open.ino)
                    && let Some(pending) = slot.lock().await.as_ref()
                {
                    return Ok(pending.read(offset, size));
                }
                v.read(s.fd(&v, &open).await?, offset, size)
                    .await
                    .map_err(errno)
            },
            |reply, data| reply.data(&data),
        );
    }

    fn write(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: FuseOpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let (s, v) = (self.shared(), self.volume(req));
        let data = Bytes::copy_from_slice(data);
        self.spawn(
            reply,
            async move {
                let open = s.open(fh)?;
                let len = u32::try_from(data.len()).map_err(|_| Errno::EINVAL)?;
                if let Some(slot) = s.pending.get(open.ino)
                    && let Some(pending) = slot.lock().await.as_mut()
                    && pending.write(offset, &data)
                {
                    return Ok(len);
                }
                v.write(s.fd(&v, &open).await?, offset, data)
                    .await
                    .map_err(errno)?;
                Ok(len)
            },
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
        if !locked && self.shared.pending.is_idle() {
            reply.ok();
            return;
        }
        let (s, v) = (self.shared(), self.volume(req));
        self.spawn(
            reply,
            async move {
                // The first close sends a deferred create; a refusal is this close's error.
                s.settle(&v, ino.0).await?;
                if let Some(errno) = s.pending.take_failure(ino.0) {
                    return Err(Errno::from_i32(errno));
                }
                if !locked {
                    return Ok(());
                }
                let open = s.open(fh)?;
                let lock_owner = lock_owner.0;
                v.call_fd(s.fd(&v, &open).await?, |fd| {
                    kiln_wire::Flush { fd, lock_owner }.into()
                })
                .await
                .map(drop)
                .map_err(errno)
            },
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
        _ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let (s, v) = (self.shared(), self.volume(req));
        self.spawn(
            reply,
            async move {
                let open = s.open(fh)?;
                v.fsync(s.fd(&v, &open).await?, datasync)
                    .await
                    .map_err(errno)
            },
            |reply, ()| reply.ok(),
        );
    }

    fn opendir(&self, req: &Request, ino: INodeNo, _flags: FuseOpenFlags, reply: ReplyOpen) {
        let (s, v) = (self.shared(), self.volume(req));
        self.spawn(
            reply,
            async move {
                let gfid = s.gfid(ino)?;
                // A listing shows the files created here that are still deferred.
                s.settle_dir(&v, Some(gfid)).await;
                let fd = v.opendir(gfid).await.map_err(errno)?;
                let (access, flags) = (AccessMode::ReadOnly, OpenFlags::empty());
                Ok(s.add_open(Some(fd), ino.0, access, flags, v.creds()))
            },
            |reply, fh| reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE),
        );
    }

    fn readdir(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        reply: ReplyDirectory,
    ) {
        let (s, v) = (self.shared(), self.volume(req));
        self.runtime.spawn(async move {
            let mut reply = reply;
            let result = s
                .list(&v, fh, offset, |e| {
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
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        reply: ReplyDirectoryPlus,
    ) {
        let (s, v) = (self.shared(), self.volume(req));
        self.runtime.spawn(async move {
            let mut reply = reply;
            let result = s
                .list(&v, fh, offset, |e| {
                    // Each entry the kernel takes counts as a lookup; one that does not fit
                    // is given back.
                    let (attr, ttl) = s.entry(&e.iatt);
                    let full = reply.add(attr.ino, e.offset, os(&e.name), &ttl.attr, &attr, GEN);
                    if full {
                        s.inodes.forget(attr.ino.0, 1);
                    }
                    full
                })
                .await;
            match result {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(e),
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
        let (s, v) = (self.shared(), self.volume(req));
        self.spawn(
            reply,
            async move {
                let open = s.open(fh)?;
                v.call_fd(s.fd(&v, &open).await?, |fd| {
                    kiln_wire::Fsyncdir { fd, datasync }.into()
                })
                .await
                .map(drop)
                .map_err(errno)
            },
            |reply, ()| reply.ok(),
        );
    }

    fn statfs(&self, req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let v = self.volume(req);
        self.spawn(
            reply,
            async move {
                match v.call(kiln_wire::Statfs { gfid: Gfid::ROOT }).await {
                    Ok(FopReply::Statfs(r)) => Ok(r.stats),
                    Ok(other) => Err(unexpected(&other)),
                    Err(e) => Err(errno(e)),
                }
            },
            |reply, st| {
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
            },
        );
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
        self.shared.inodes.forget_xattr(ino.0, name.as_bytes());
        let name = xattr_name(name);
        let value = XattrValue::new(Bytes::copy_from_slice(value))
            .map_err(|_| Errno::from_i32(libc::E2BIG));
        self.run_done(req, reply, Settle::Node(ino.0), move |s| {
            let mode = match flags {
                0 => XattrSetMode::Upsert,
                libc::XATTR_CREATE => XattrSetMode::Create,
                libc::XATTR_REPLACE => XattrSetMode::Replace,
                _ => return Err(Errno::EINVAL),
            };
            Ok(kiln_wire::Setxattr {
                gfid: s.gfid(ino)?,
                name: name?,
                value: value?,
                mode,
            }
            .into())
        });
    }

    fn getxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        if self.shared.inodes.xattr_is_absent(ino.0, name.as_bytes()) {
            reply.error(Errno::NO_XATTR);
            return;
        }
        let (s, v, name) = (self.shared(), self.volume(req), xattr_name(name));
        self.spawn(
            reply,
            async move {
                let name = name?;
                s.settle(&v, ino.0).await?;
                let get = kiln_wire::Getxattr {
                    gfid: s.gfid(ino)?,
                    name: name.clone(),
                };
                match v.call(get).await {
                    Ok(FopReply::Getxattr(r)) => Ok(r.value.into_bytes()),
                    Ok(other) => Err(unexpected(&other)),
                    Err(Error::Fop(ErrorCode::NoData)) => {
                        let until = Instant::now() + s.options.attr_timeout;
                        s.inodes.note_absent_xattr(ino.0, name.as_bytes(), until);
                        Err(Errno::NO_XATTR)
                    }
                    Err(e) => Err(errno(e)),
                }
            },
            move |reply, value| reply_xattr(reply, size, &value),
        );
    }

    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let (s, v) = (self.shared(), self.volume(req));
        self.spawn(
            reply,
            async move {
                s.settle(&v, ino.0).await?;
                match v.call(kiln_wire::Listxattr { gfid: s.gfid(ino)? }).await {
                    Ok(FopReply::Listxattr(r)) => {
                        Ok(r.entries.iter().fold(Vec::new(), |mut list, name| {
                            list.extend_from_slice(name.as_bytes());
                            list.push(0);
                            list
                        }))
                    }
                    Ok(other) => Err(unexpected(&other)),
                    Err(e) => Err(errno(e)),
                }
            },
            move |reply, list| reply_xattr(reply, size, &list),
        );
    }

    fn removexattr(&self, req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let name = xattr_name(name);
        self.run_done(req, reply, Settle::Node(ino.0), move |s| {
            Ok(kiln_wire::Removexattr {
                gfid: s.gfid(ino)?,
                name: name?,
            }
            .into())
        });
    }

    fn access(&self, req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        self.run_done(req, reply, Settle::Node(ino.0), move |s| {
            let mut bits = AccessMask::empty();
            for (flag, bit) in [
                (AccessFlags::R_OK, AccessMask::READ),
                (AccessFlags::W_OK, AccessMask::WRITE),
                (AccessFlags::X_OK, AccessMask::EXECUTE),
            ] {
                if mask.contains(flag) {
                    bits = bits | bit;
                }
            }
            Ok(kiln_wire::Access {
                gfid: s.gfid(ino)?,
                mask: bits,
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
        let (s, v, name) = (self.shared(), self.volume(req), name_of(name));
        self.spawn(
            reply,
            async move {
                let (access, open_flags) = s.open_mode(flags);
                let excl = if flags & libc::O_EXCL != 0 {
                    OpenFlags::EXCL
                } else {
                    OpenFlags::empty()
                };
                let create = kiln_wire::Create {
                    parent: s.gfid(parent)?,
                    name: name?,
                    gfid: new_gfid(),
                    access,
                    flags: open_flags | excl,
                    mode: Mode::from_st_mode(mode),
                    umask: Mode::from_st_mode(umask),
                };
                let synchronous = OpenFlags::SYNC.bits() | OpenFlags::DSYNC.bits();
                let parent_attr = s
                    .inodes
                    .dir_attr(parent.0)
                    .filter(|p| p.allows_create(v.creds()));
                let (iatt, fd) = match parent_attr {
                    Some(parent_attr)
                        if s.options.deferred_create
                            && requested_access(flags) == AccessMode::WriteOnly
                            && flags & libc::O_DIRECT == 0
                            && open_flags.bits() & synchronous == 0 =>
                    {
                        let pending = Pending::new(create, parent_attr, v.creds().clone());
                        let iatt = pending.iatt();
                        (iatt, Err(pending))
                    }
                    _ => {
                        let (fd, created) = v.create(create).await.map_err(errno)?;
                        (created.iatt, Ok(fd))
                    }
                };
                let (attr, mut ttl) = s.entry(&iatt);
                s.inodes.mark_bare(attr.ino.0, Instant::now() + ttl.attr);
                let fd = match fd {
                    Ok(fd) => Some(fd),
                    Err(pending) => {
                        s.pending.insert(attr.ino.0, pending);
                        // The kernel asks again (and a stat sends the file) rather than keep
                        // times the brick will not have.
                        ttl.attr = Duration::ZERO;
                        None
                    }
                };
                // A late open must not truncate what the PUT wrote.
                let reopen = OpenFlags::from_bits(open_flags.bits() & !OpenFlags::TRUNC.bits())
                    .unwrap_or(OpenFlags::empty());
                // A deferred create's handle is opened late as root: the create granted it
                // its access, whatever mode the file was given.
                let fh = s.add_open(fd, attr.ino.0, access, reopen, &Creds::root());
                Ok((attr, ttl, fh))
            },
            move |reply, (attr, ttl, fh)| {
                reply.created(&ttl.entry, &attr, GEN, FileHandle(fh), fopen_flags(flags));
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
        let (s, v) = (self.shared(), self.volume(req));
        self.spawn(
            reply,
            async move {
                let open = s.open(fh)?;
                let lock = wire_lock(typ, start, end, pid, lock_owner)?;
                v.lk(s.fd(&v, &open).await?, LockCmd::Get, lock)
                    .await
                    .map_err(errno)
            },
            |reply, lock| {
                let typ = match lock.kind {
                    LockKind::Read => libc::F_RDLCK,
                    LockKind::Write => libc::F_WRLCK,
                    LockKind::Unlock => libc::F_UNLCK,
                };
                let end = match lock.len {
                    0 => LOCK_END_OF_FILE,
                    len => lock.start.saturating_add(len - 1),
                };
                reply.locked(lock.start, end, typ, lock.pid);
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
        let (s, v) = (self.shared(), self.volume(req));
        self.shared.inodes.mark_locked(ino.0);
        self.spawn(
            reply,
            async move {
                let open = s.open(fh)?;
                let lock = wire_lock(typ, start, end, pid, lock_owner)?;
                let cmd = if sleep {
                    LockCmd::SetWait
                } else {
                    LockCmd::Set
                };
                v.lk(s.fd(&v, &open).await?, cmd, lock)
                    .await
                    .map(drop)
                    .map_err(errno)
            },
            |reply, ()| reply.ok(),
        );
    }

    fn fallocate(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let (s, v) = (self.shared(), self.volume(req));
        self.spawn(
            reply,
            async move {
                let open = s.open(fh)?;
                let keep_size = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
                let fop = move |fd| -> FopRequest {
                    match mode & !libc::FALLOC_FL_KEEP_SIZE {
                        0 => kiln_wire::Fallocate {
                            fd,
                            keep_size,
                            offset,
                            len: length,
                        }
                        .into(),
                        libc::FALLOC_FL_PUNCH_HOLE => kiln_wire::Discard {
                            fd,
                            offset,
                            len: length,
                        }
                        .into(),
                        _ => kiln_wire::Zerofill {
                            fd,
                            offset,
                            len: length,
                        }
                        .into(),
                    }
                };
                let supported = match mode & !libc::FALLOC_FL_KEEP_SIZE {
                    0 => true,
                    libc::FALLOC_FL_PUNCH_HOLE => keep_size,
                    libc::FALLOC_FL_ZERO_RANGE => !keep_size,
                    _ => false,
                };
                if !supported {
                    return Err(Errno::from_i32(libc::EOPNOTSUPP));
                }
                v.call_fd(s.fd(&v, &open).await?, fop)
                    .await
                    .map(drop)
                    .map_err(errno)
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
        let (s, v) = (self.shared(), self.volume(req));
        self.spawn(
            reply,
            async move {
                let open = s.open(fh)?;
                let what = match whence {
                    libc::SEEK_DATA => SeekWhat::Data,
                    libc::SEEK_HOLE => SeekWhat::Hole,
                    _ => return Err(Errno::EINVAL),
                };
                let offset = u64::try_from(offset).map_err(|_| Errno::ENXIO)?;
                match v
                    .call_fd(s.fd(&v, &open).await?, |fd| {
                        kiln_wire::Seek { fd, offset, what }.into()
                    })
                    .await
                {
                    Ok(FopReply::Seek(r)) => i64::try_from(r.offset).map_err(|_| Errno::ENXIO),
                    Ok(other) => Err(unexpected(&other)),
                    Err(e) => Err(errno(e)),
                }
            },
            |reply, offset| reply.offset(offset),
        );
    }
}

impl KilnFs {
    /// The volume acting as the caller of `req`.
    fn volume(&self, req: &Request) -> Volume {
        self.shared.volume.with_creds(creds(req))
    }

    /// Forgets handle `fh` and releases its fd on the brick in the background: the kernel
    /// does not wait for a RELEASE either.
    fn release_handle(&self, req: &Request, fh: FileHandle) {
        let Some(open) = self.shared.take_open(fh) else {
            return;
        };
        let (s, v) = (self.shared(), self.volume(req));
        self.runtime.spawn(async move {
            // Normally the close (FLUSH) has sent a deferred create already.
            if s.settle(&v, open.ino).await.is_ok() {
                s.pending.take_failure(open.ino);
            }
            if let Ok(open) = Arc::try_unwrap(open)
                && let Some(fd) = open.fd.into_inner()
                && let Err(e) = v.release(fd).await
            {
                tracing::debug!(error = %e, "release failed; the fd goes with the session");
            }
        });
    }
}

/// The kernel's cache lifetimes for one reply.
#[derive(Debug, Clone, Copy)]
struct Ttl {
    attr: Duration,
    entry: Duration,
}

/// Node generations never change: node ids are derived from GFIDs, which are never reused.
const GEN: Generation = Generation(0);

impl Shared {
    fn gfid(&self, ino: INodeNo) -> Result<Gfid> {
        self.inodes.gfid(ino.0).ok_or(Errno::ESTALE)
    }

    fn ttl(&self) -> Ttl {
        Ttl {
            attr: self.options.attr_timeout,
            entry: self.options.entry_timeout,
        }
    }

    /// `iatt` as the attributes of node `ino`.
    fn attr(&self, ino: u64, iatt: &Iatt) -> (FileAttr, Duration) {
        self.note_dir(ino, iatt);
        (file_attr(ino, iatt), self.options.attr_timeout)
    }

    /// An entry handed to the kernel: counts a lookup of its node.
    fn entry(&self, iatt: &Iatt) -> (FileAttr, Ttl) {
        let ino = self.inodes.remember(iatt.gfid);
        self.note_dir(ino, iatt);
        (file_attr(ino, iatt), self.ttl())
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
    fn peek_ino(&self, gfid: Gfid) -> u64 {
        let ino = self.inodes.remember(gfid);
        self.inodes.forget(ino, 1);
        ino
    }

    fn new_entry(&self, reply: std::result::Result<FopReply, Error>) -> Result<(FileAttr, Ttl)> {
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

    fn add_open(
        &self,
        fd: Option<Fd>,
        ino: u64,
        access: AccessMode,
        flags: OpenFlags,
        late_creds: &Creds,
    ) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let open = Arc::new(Open {
            fd: tokio::sync::OnceCell::new_with(fd),
            ino,
            access,
            flags,
            late_creds: late_creds.clone(),
            listing: tokio::sync::Mutex::new(Listing::default()),
        });
        self.files_lock().insert(fh, open);
        fh
    }

    fn open(&self, fh: FileHandle) -> Result<Arc<Open>> {
        self.files_lock().get(&fh.0).cloned().ok_or(Errno::EBADF)
    }

    /// The brick fd behind `open`, made on first use for a deferred create (which sends the
    /// create first).
    async fn fd<'a>(&self, v: &Volume, open: &'a Open) -> Result<&'a Fd> {
        if let Some(fd) = open.fd.get() {
            return Ok(fd);
        }
        self.settle(v, open.ino).await?;
        self.late_fd(open).await
    }

    /// Opens the brick fd of a handle opened late: a deferred create's, once the file is
    /// there (as root: the create already granted the handle its access, whatever the mode
    /// given to the file says), or a read-only open's at its first use (as its opener).
    async fn late_fd<'a>(&self, open: &'a Open) -> Result<&'a Fd> {
        open.fd
            .get_or_try_init(|| async {
                let gfid = self.inodes.gfid(open.ino).ok_or(Errno::ESTALE)?;
                let opener = self.volume.with_creds(open.late_creds.clone());
                opener
                    .open(gfid, open.access, open.flags)
                    .await
                    .map_err(errno)
            })
            .await
    }

    /// Sends node `ino`'s deferred create to the brick, if it has one still waiting. The
    /// handles open on it get their brick fds on first use, or from [`Shared::anchor_handles`]
    /// before a fop that could remove the file: most are about to be released (a create's
    /// PUT is sent at its close), and opening them now would cost two round trips per file.
    async fn settle(&self, v: &Volume, ino: u64) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        self.pending.settle(v, ino).await.map_err(errno)?;
        Ok(())
    }

    /// Gives every open handle still without a brick fd (one of a settled deferred create)
    /// its fd, before a fop that may remove a name: an open file must outlive an unlink, and
    /// a handle opened later by GFID would find the file gone.
    async fn anchor_handles(&self) {
        // Creates made since the caller settled them stay deferred: their files are not on
        // the brick to be removed.
        let waiting = match self.pending.is_empty() {
            true => Vec::new(),
            false => self.pending.in_dir(None).await,
        };
        let opens: Vec<_> = self
            .files_lock()
            .values()
            .filter(|o| o.fd.get().is_none() && !waiting.contains(&o.ino))
            .cloned()
            .collect();
        for open in opens {
            if let Err(e) = self.late_fd(&open).await {
                tracing::warn!(?e, "cannot open a settled create");
            }
        }
    }

    /// Sends the deferred creates in directory `parent` (every one when `None`) before a fop
    /// that must see them on the brick. A refusal is kept for the file's close to report.
    async fn settle_dir(&self, v: &Volume, parent: Option<Gfid>) {
        if self.pending.is_empty() {
            return;
        }
        for ino in self.pending.in_dir(parent).await {
            let _ = self.settle(v, ino).await;
        }
    }

    /// Any handle open on node `ino`.
    fn open_of(&self, ino: u64) -> Option<Arc<Open>> {
        self.files_lock().values().find(|o| o.ino == ino).cloned()
    }

    /// The attributes of node `ino`: through handle `fh` when the kernel names one, else by
    /// GFID; a file with no name left (unlinked while open) is reached through a handle.
    async fn stat(&self, v: &Volume, ino: u64, fh: Option<FileHandle>) -> Result<Iatt> {
        let fstat = |open: Arc<Open>| async move {
            attr_of(
                v.call_fd(self.fd(v, &open).await?, |fd| {
                    kiln_wire::Fstat { fd }.into()
                })
                .await,
            )
        };
        // A stat sends a deferred create: from then on the brick's times are the file's.
        self.settle(v, ino).await?;
        if let Some(open) = fh.and_then(|fh| self.open(fh).ok()) {
            return fstat(open).await;
        }
        let gfid = self.inodes.gfid(ino).ok_or(Errno::ESTALE)?;
        match v.call(kiln_wire::Stat { gfid }).await {
            Err(Error::Fop(ErrorCode::Stale | ErrorCode::NoEnt)) if self.open_of(ino).is_some() => {
                fstat(self.open_of(ino).ok_or(Errno::ESTALE)?).await
            }
            reply => attr_of(reply),
        }
    }

    /// Changes the attributes of node `ino`. A size change through a handle is
    /// ftruncate(2): the handle's write access allows it, whatever the file's mode says.
    async fn setattr(
        &self,
        v: &Volume,
        ino: u64,
        fh: Option<FileHandle>,
        mut attr: SetAttr,
    ) -> Result<Iatt> {
        if let Some(slot) = self.pending.get(ino)
            && let Some(pending) = slot.lock().await.as_mut()
            && pending.setattr(v.creds(), attr)
        {
            return Ok(pending.iatt());
        }
        self.settle(v, ino).await?;
        let open = fh.and_then(|fh| self.open(fh).ok());
        let mut truncated = None;
        if let (Some(open), Some(size)) = (&open, attr.size) {
            let reply = v
                .call_fd(self.fd(v, open).await?, |fd| {
                    kiln_wire::Ftruncate { fd, size }.into()
                })
                .await;
            truncated = Some(attr_of(reply)?);
            attr.size = None;
        }
        if attr.is_empty() {
            // Nothing else, or only a ctime change (the brick keeps its own ctime).
            return match truncated {
                Some(iatt) => Ok(iatt),
                None => self.stat(v, ino, fh).await,
            };
        }
        let reply = match &open {
            Some(open) => {
                v.call_fd(self.fd(v, open).await?, |fd| {
                    kiln_wire::Fsetattr { fd, attr }.into()
                })
                .await
            }
            None => {
                let gfid = self.inodes.gfid(ino).ok_or(Errno::ESTALE)?;
                v.call(kiln_wire::Setattr { gfid, attr }).await
            }
        };
        attr_of(reply)
    }

    fn take_open(&self, fh: FileHandle) -> Option<Arc<Open>> {
        self.files_lock().remove(&fh.0)
    }

    fn files_lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Open>>> {
        self.files.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The access mode and flags an open with kernel `flags` asks the brick for.
    /// Whether an open is answered at once and made on the brick at the handle's first use
    /// (GlusterFS's open-behind): a plain read-only open, when the kernel has checked the
    /// caller's permission itself (`default_permissions`). A read served from the kernel's
    /// page cache then costs the brick nothing, and a file removed by another client in
    /// between fails the first read (ESTALE) instead of the open.
    fn opens_late(&self, access: AccessMode, flags: OpenFlags) -> bool {
        self.options.default_permissions && access == AccessMode::ReadOnly && flags.bits() == 0
    }

    fn open_mode(&self, flags: i32) -> (AccessMode, OpenFlags) {
        let mut access = requested_access(flags);
        let mut wire = OpenFlags::empty();
        for (bit, flag) in [
            (libc::O_APPEND, OpenFlags::APPEND),
            (libc::O_TRUNC, OpenFlags::TRUNC),
            (libc::O_SYNC, OpenFlags::SYNC),
            (libc::O_DSYNC, OpenFlags::DSYNC),
            (libc::O_NOATIME, OpenFlags::NOATIME),
        ] {
            if flags & bit == bit {
                wire = wire | flag;
            }
        }
        if self.options.writeback_cache {
            // The kernel reads pages of write-only files to fill its cache, and appends at
            // the size it knows itself.
            if access == AccessMode::WriteOnly {
                access = AccessMode::ReadWrite;
            }
            wire = OpenFlags::from_bits(wire.bits() & !OpenFlags::APPEND.bits())
                .unwrap_or(OpenFlags::empty());
        }
        (access, wire)
    }

    /// Gives the kernel the entries of directory handle `fh` from `offset` until `add`
    /// says its buffer is full or the directory ends.
    async fn list(
        &self,
        v: &Volume,
        fh: FileHandle,
        offset: u64,
        mut add: impl FnMut(&DirEntryPlus) -> bool,
    ) -> Result<()> {
        let open = self.open(fh)?;
        let mut listing = open.listing.lock().await;
        let mut offset = offset;
        loop {
            if listing.from != offset || (listing.entries.is_empty() && !listing.eof) {
                let size = ReaddirSize::new(READDIR_FETCH_BYTES).ok_or(Errno::EINVAL)?;
                let reply = v
                    .call_fd(self.fd(v, &open).await?, |fd| {
                        kiln_wire::Readdirp { fd, offset, size }.into()
                    })
                    .await;
                let FopReply::Readdirp(r) = reply.map_err(errno)? else {
                    return Err(Errno::EIO);
                };
                *listing = Listing {
                    from: offset,
                    entries: r.entries.into(),
                    eof: r.eof,
                };
                if listing.entries.is_empty() {
                    return Ok(());
                }
            }
            // Empty here means the directory ended.
            let Some(entry) = listing.entries.front() else {
                return Ok(());
            };
            if add(entry) {
                return Ok(());
            }
            offset = entry.offset;
            listing.entries.pop_front();
            listing.from = offset;
        }
    }
}

fn reply_entry(reply: ReplyEntry, (attr, ttl): (FileAttr, Ttl)) {
    reply.entry_with_ttls(&ttl.attr, &ttl.entry, &attr, GEN);
}

/// Answers a GETXATTR or LISTXATTR: the size when asked for it (`size` 0), else the bytes if
/// they fit.
fn reply_xattr(reply: ReplyXattr, size: u32, value: &[u8]) {
    let len = u32::try_from(value.len()).unwrap_or(u32::MAX);
    if size == 0 {
        reply.size(len);
    } else if len > size {
        reply.error(Errno::from_i32(libc::ERANGE));
    } else {
        reply.data(value);
    }
}

/// The caller of `req`, with its supplementary groups, which FUSE does not pass: they come
/// from `/proc` (root's are not needed: it passes every permission check).
fn creds(req: &Request) -> Creds {
    let groups = if req.uid() == 0 {
        Groups::default()
    } else {
        supplementary_groups(req.pid())
    };
    Creds {
        uid: req.uid(),
        gid: req.gid(),
        groups,
        pid: req.pid(),
    }
}

fn supplementary_groups(pid: u32) -> Groups {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let groups = status
        .lines()
        .find_map(|line| line.strip_prefix("Groups:"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|g| g.parse().ok())
        .take(GROUPS_MAX)
        .collect();
    Groups::new(groups).unwrap_or_default()
}

/// How the kernel should treat a file opened with `flags`: O_DIRECT bypasses its page cache
/// (the brick's own cache still serves it: the brick cannot honour O_DIRECT's alignment
/// rules for buffers it did not allocate, and O_DIRECT promises no durability anyway); other
/// opens keep what is cached, which the kernel drops when the file's mtime or size changes.
fn fopen_flags(flags: i32) -> FopenFlags {
    if flags & libc::O_DIRECT != 0 {
        FopenFlags::FOPEN_DIRECT_IO
    } else {
        FopenFlags::FOPEN_KEEP_CACHE
    }
}

fn requested_access(flags: i32) -> AccessMode {
    match flags & libc::O_ACCMODE {
        libc::O_WRONLY => AccessMode::WriteOnly,
        libc::O_RDWR => AccessMode::ReadWrite,
        _ => AccessMode::ReadOnly,
    }
}

fn name_of(name: &OsStr) -> Result<Name> {
    Name::new(Bytes::copy_from_slice(name.as_bytes())).map_err(|e| Errno::from_i32(e.errno()))
}

fn xattr_name(name: &OsStr) -> Result<XattrName> {
    XattrName::new(Bytes::copy_from_slice(name.as_bytes())).map_err(|e| Errno::from_i32(e.errno()))
}

fn os(name: &Name) -> &OsStr {
    OsStr::from_bytes(name.as_bytes())
}

fn time_set(t: TimeOrNow) -> TimeSet {
    match t {
        TimeOrNow::Now => TimeSet::Now,
        TimeOrNow::SpecificTime(t) => {
            let (sec, nsec) = match t.duration_since(UNIX_EPOCH) {
                Ok(d) => (
                    i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
                    d.subsec_nanos(),
                ),
                Err(before) => {
                    // Before 1970: whole seconds down, nanoseconds up.
                    let d = before.duration();
                    let sec = -i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
                    match d.subsec_nanos() {
                        0 => (sec, 0),
                        n => (sec - 1, Timespec::NSEC_PER_SEC - n),
                    }
                }
            };
            Timespec::new(sec, nsec).map_or(TimeSet::Now, TimeSet::At)
        }
    }
}

fn system_time(t: Timespec) -> SystemTime {
    let nanos = Duration::from_nanos(u64::from(t.nsec()));
    match u64::try_from(t.sec()) {
        Ok(sec) => UNIX_EPOCH + Duration::from_secs(sec) + nanos,
        Err(_) => UNIX_EPOCH - Duration::from_secs(t.sec().unsigned_abs()) + nanos,
    }
}

fn file_kind(t: FileType) -> fuser::FileType {
    match t {
        FileType::Regular => fuser::FileType::RegularFile,
        FileType::Directory => fuser::FileType::Directory,
        FileType::Symlink => fuser::FileType::Symlink,
        FileType::BlockDevice => fuser::FileType::BlockDevice,
        FileType::CharDevice => fuser::FileType::CharDevice,
        FileType::Fifo => fuser::FileType::NamedPipe,
        FileType::Socket => fuser::FileType::Socket,
    }
}

fn file_attr(ino: u64, iatt: &Iatt) -> FileAttr {
    FileAttr {
        ino: INodeNo(ino),
        size: iatt.size,
        blocks: iatt.blocks,
        atime: system_time(iatt.atime),
        mtime: system_time(iatt.mtime),
        ctime: system_time(iatt.ctime),
        crtime: UNIX_EPOCH,
        kind: file_kind(iatt.file_type),
        perm: iatt.mode.bits() as u16,
        nlink: iatt.nlink,
        uid: iatt.uid,
        gid: iatt.gid,
        // The kernel's dev_t encoding (new_encode_dev) fits 32 bits for every device
        // number a local file system hands out.
        rdev: u32::try_from(iatt.rdev).unwrap_or(u32::MAX),
        blksize: iatt.blksize,
        flags: 0,
    }
}

/// The attributes of a negative entry: node 0 says "no such name".
fn negative_attr() -> FileAttr {
    FileAttr {
        ino: INodeNo(0),
        size: 0,
        blocks: 0,
        atime: UNIX_EPOCH,
        mtime: UNIX_EPOCH,
        ctime: UNIX_EPOCH,
        crtime: UNIX_EPOCH,
        kind: fuser::FileType::RegularFile,
        perm: 0,
        nlink: 0,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 0,
        flags: 0,
    }
}

fn attr_of(reply: std::result::Result<FopReply, Error>) -> Result<Iatt> {
    match reply.map_err(errno)? {
        FopReply::Stat(r) | FopReply::Fstat(r) => Ok(r.iatt),
        FopReply::Setattr(r) | FopReply::Fsetattr(r) | FopReply::Ftruncate(r) => Ok(r.post),
        other => Err(unexpected(&other)),
    }
}

/// The errno the caller sees: the brick's own, or EIO when the volume could not be reached
/// (the call may or may not have run).
fn errno(e: Error) -> Errno {
    match e {
        Error::Fop(code) => Errno::from_i32(code.to_errno()),
        e => {
            tracing::warn!(error = %e, "fop failed: EIO");
            Errno::EIO
        }
    }
}

fn unexpected(reply: &FopReply) -> Errno {
    tracing::error!(
        fop = reply.code().name(),
        "the brick answered with another fop"
    );
    Errno::EIO
}

/// A POSIX lock from FUSE's form (inclusive end, `OFFSET_MAX` for "to the end").
fn wire_lock(typ: i32, start: u64, end: u64, pid: u32, owner: LockOwner) -> Result<Lock> {
    let kind = match typ {
        libc::F_RDLCK => LockKind::Read,
        libc::F_WRLCK => LockKind::Write,
        libc::F_UNLCK => LockKind::Unlock,
        _ => return Err(Errno::EINVAL),
    };
    let len = if end >= LOCK_END_OF_FILE {
        0
    } else {
        end.checked_sub(start).map(|d| d + 1).ok_or(Errno::EINVAL)?
    };
    Ok(Lock {
        kind,
        start,
        len,
        pid,
        owner: owner.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_roundtrip_across_the_epoch() {
        for (sec, nsec) in [(0, 0), (1_700_000_000, 5), (-1, 999_999_999), (-100, 0)] {
            let t = Timespec::new(sec, nsec).expect("valid");
            assert_eq!(
                time_set(TimeOrNow::SpecificTime(system_time(t))),
                TimeSet::At(t)
            );
        }
    }

    #[test]
    fn locks_convert_with_inclusive_ends() {
        let owner = LockOwner(7);
        let lock = wire_lock(libc::F_WRLCK, 10, 19, 3, owner).expect("valid");
        assert_eq!((lock.start, lock.len, lock.kind), (10, 10, LockKind::Write));
        let whole = wire_lock(libc::F_RDLCK, 0, LOCK_END_OF_FILE, 3, owner).expect("valid");
        assert_eq!(whole.len, 0);
        assert!(wire_lock(libc::F_RDLCK, 10, 5, 3, owner).is_err());
        assert!(wire_lock(99, 0, 1, 3, owner).is_err());
    }

    #[test]
    fn groups_of_this_process_are_read() {
        let mine = supplementary_groups(std::process::id());
        let expected = rustix::process::getgroups().expect("getgroups");
        assert_eq!(mine.as_slice().len(), expected.len().min(GROUPS_MAX));
    }
}
