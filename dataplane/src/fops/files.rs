//! Open files: OPEN, READ (and GET, a read with no fd), WRITE, FSTAT, FSYNC, FALLOCATE (and
//! DISCARD, ZEROFILL), FTRUNCATE, SEEK, LK, FLUSH, RELEASE. A file is reached through the
//! session's fd table; data changes run as the caller.

use std::sync::atomic::Ordering;

use bytes::Bytes;
use kiln_wire::{
    AccessMode, AttrChange, AttrReply, Creds, Discard, Fallocate, FdId, Get, Gfid, Lk, LkReply,
    LockCmd, OpenFlags, OpenReply, Payload, Read, ReadReply, Seek, SeekReply, SeekWhat, Write,
    Zerofill,
};
use rustix::io::Errno;

use super::chain::Chain;
use super::{Fops, R, iatt, lock};
use crate::brick::Brick;
use crate::exec::Exec;
use crate::fdtable::{OpenFile, OpenKind, SessionId};
use crate::op::{self, FileRef, Stat, Step};

/// What FALLOCATE, DISCARD and ZEROFILL ask of `fallocate(2)`.
#[derive(Debug, Clone, Copy)]
pub(super) struct FallocateRange {
    mode: i32,
    offset: u64,
    len: u64,
}

impl From<Fallocate> for FallocateRange {
    fn from(r: Fallocate) -> FallocateRange {
        let mode = if r.keep_size {
            libc::FALLOC_FL_KEEP_SIZE
        } else {
            0
        };
        FallocateRange {
            mode,
            offset: r.offset,
            len: r.len,
        }
    }
}

impl From<Discard> for FallocateRange {
    fn from(r: Discard) -> FallocateRange {
        FallocateRange {
            mode: libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset: r.offset,
            len: r.len,
        }
    }
}

impl From<Zerofill> for FallocateRange {
    fn from(r: Zerofill) -> FallocateRange {
        FallocateRange {
            mode: libc::FALLOC_FL_ZERO_RANGE,
            offset: r.offset,
            len: r.len,
        }
    }
}

/// ESTALE for a file whose handle went between its look and its open, or its open and its
/// stat (its last name removed meanwhile), as for one gone before: the client looks the
/// name up again.
fn gone_is_stale(e: Errno) -> Errno {
    match e {
        Errno::NOENT => Errno::STALE,
        e => e,
    }
}

impl<E: Exec> Fops<E> {
    pub(super) async fn open(
        &self,
        session: SessionId,
        creds: &Creds,
        gfid: &Gfid,
        access: AccessMode,
        flags: OpenFlags,
    ) -> R<OpenReply> {
        let open = self.open_op(gfid, access, flags, false).await?;
        let file: FileRef = self
            .run_one(Step::caller(open, creds))
            .await
            .map_err(gone_is_stale)?;
        let fd = self
            .keep_open(session, *gfid, file, access != AccessMode::ReadOnly)
            .await?;
        Ok(OpenReply { fd })
    }

    /// GET: OPEN for reading, READ and RELEASE of file `gfid` in one chain on a direct
    /// descriptor, as the caller.
    pub(super) async fn get(&self, creds: &Creds, r: Get) -> R<ReadReply> {
        let open = self
            .open_op(&r.gfid, AccessMode::ReadOnly, OpenFlags::empty(), true)
            .await?;
        let (handle_dir, handle) = (open.dir.clone(), open.name.clone());
        let mut chain = Chain::new();
        let opened = chain.push::<FileRef>(Step::caller(open, creds));
        let data = chain.push::<Bytes>(Step::brick(op::Read {
            file: FileRef::Chain,
            offset: r.offset,
            len: r.size.get() as usize,
        }));
        // By name: a direct descriptor cannot be statx'ed.
        let stat = chain.push::<Stat>(Step::brick(op::Statx::of(&handle_dir, &handle)));
        let close = chain.push::<()>(Step::brick(op::Close {
            file: FileRef::Chain,
        }));
        let mut results = self.run(chain).await;
        results.take(opened).map_err(gone_is_stale)?;
        results.take(close)?;
        let data = results.take(data)?;
        let data = Payload::new(data).map_err(|_| op::invariant("a read over the limit"))?;
        Ok(ReadReply {
            data,
            iatt: iatt(&results.take(stat).map_err(gone_is_stale)?, r.gfid),
        })
    }

    /// The open of regular file `gfid` by its handle, once it is known to be one.
    async fn open_op(
        &self,
        gfid: &Gfid,
        access: AccessMode,
        flags: OpenFlags,
        fixed: bool,
    ) -> R<op::Open> {
        let stat = self.stat_gfid(gfid).await?;
        if stat.is_dir() {
            return Err(Errno::ISDIR);
        }
        if stat.is_symlink() {
            return Err(Errno::LOOP);
        }
        if !stat.is_regular() {
            // FIFOs, sockets and devices are opened by the client's kernel, never on the
            // brick: opening the server's device nodes or blocking a thread on a FIFO is not
            // a fop.
            return Err(Errno::NXIO);
        }
        self.brick.ensure_handle_parent(gfid)?;
        // Never through a symlink. (Not O_NONBLOCK: io_uring would then answer EAGAIN for data
        // not in the page cache instead of waiting for it.)
        let flags = access.to_libc() | (flags.to_libc() & !libc::O_EXCL) | libc::O_NOFOLLOW;
        Ok(op::Open {
            dir: self.brick.handle_dir(gfid).clone(),
            name: Brick::handle_name(gfid),
            flags,
            mode: 0,
            fixed,
        })
    }

    /// Adds a just-opened file to the session's table; closes it when that fails.
    pub(super) async fn keep_open(
        &self,
        session: SessionId,
        gfid: Gfid,
        file: FileRef,
        writable: bool,
    ) -> R<FdId> {
        let kind = OpenKind::File {
            file: file.clone(),
            writable,
        };
        match self.insert_open(session, OpenFile { gfid, kind }) {
            Ok(fd) => Ok(fd),
            Err(e) => {
                let _ = self.run1(Step::brick(op::Close { file })).await;
                Err(e)
            }
        }
    }

    /// The open regular file `fd`: its GFID, the file, and whether it was opened for writing.
    fn file(&self, session: SessionId, fd: FdId) -> R<(Gfid, FileRef, bool)> {
        match self.open_file(session, fd)? {
            OpenFile {
                gfid,
                kind: OpenKind::File { file, writable },
            } => Ok((gfid, file, writable)),
            OpenFile {
                kind: OpenKind::Dir { .. },
                ..
            } => Err(Errno::ISDIR),
        }
    }

    pub(super) fn is_poisoned(&self) -> bool {
        self.shared.poisoned.load(Ordering::Relaxed)
    }

    pub(super) async fn fstat(&self, session: SessionId, fd: FdId) -> R<AttrReply> {
        let open = self.open_file(session, fd)?;
        let file = match &open.kind {
            OpenKind::File { file, .. } => file.clone(),
            OpenKind::Dir { dir, .. } => FileRef::Fd(dir.clone()),
        };
        let stat: Stat = self.run_one(Step::brick(op::Fstat { file })).await?;
        Ok(AttrReply {
            iatt: iatt(&stat, open.gfid),
        })
    }

    pub(super) async fn read(&self, session: SessionId, r: Read) -> R<ReadReply> {
        let (gfid, file, _) = self.file(session, r.fd)?;
        let mut chain = Chain::new();
        let data = chain.push::<Bytes>(Step::brick(op::Read {
            file: file.clone(),
            offset: r.offset,
            len: r.size.get() as usize,
        }));
        let stat = chain.push::<Stat>(Step::brick(op::Fstat { file }));
        let mut results = self.run(chain).await;
        let data = results.take(data)?;
        let stat = results.take(stat)?;
        let data = Payload::new(data).map_err(|_| op::invariant("a read over the limit"))?;
        Ok(ReadReply {
            data,
            iatt: iatt(&stat, gfid),
        })
    }

    pub(super) async fn write(&self, session: SessionId, creds: &Creds, r: Write) -> R<AttrChange> {
        if self.is_poisoned() {
            return Err(Errno::IO);
        }
        let (gfid, file, writable) = self.file(session, r.fd)?;
        if !writable {
            return Err(Errno::BADF);
        }
        let write = op::Write {
            file: file.clone(),
            offset: r.offset,
            data: r.data.into_bytes(),
        };
        let mut steps = vec![Step::caller(write, creds)];
        if self.config.write_through {
            steps.push(Step::brick(op::Fsync {
                file: file.clone(),
                datasync: true,
            }));
        }
        self.change(gfid, file, steps).await
    }

    /// Runs `change` between two `fstat`s of `file`, in one chain. Data changes run as the
    /// caller, so the kernel clears set-id bits and enforces quotas and reserved blocks as it
    /// would for the caller's own write. A failed fsync among them poisons the brick.
    async fn change(&self, gfid: Gfid, file: FileRef, change: Vec<Step>) -> R<AttrChange> {
        let mut chain = Chain::new();
        let pre = chain.push::<Stat>(Step::brick(op::Fstat { file: file.clone() }));
        let changes: Vec<_> = change
            .into_iter()
            .map(|step| {
                let sync = matches!(step.op, op::Op::Fsync(_));
                (chain.push::<()>(step), sync)
            })
            .collect();
        let post = chain.push::<Stat>(Step::brick(op::Fstat { file }));
        let mut results = self.run(chain).await;
        let pre = results.take(pre)?;
        for (at, sync) in changes {
            match sync {
                true => self.poison_on_fsync_error(results.take(at))?,
                false => results.take(at)?,
            }
        }
        Ok(AttrChange {
            pre: iatt(&pre, gfid),
            post: iatt(&results.take(post)?, gfid),
        })
    }

    pub(super) async fn fsync(
        &self,
        session: SessionId,
        fd: FdId,
        datasync: bool,
    ) -> R<AttrChange> {
        let (gfid, file, _) = self.file(session, fd)?;
        let fsync = Step::brick(op::Fsync {
            file: file.clone(),
            datasync,
        });
        self.change(gfid, file, vec![fsync]).await
    }

    /// An fsync error means acknowledged data may be gone; retrying could report success
    /// over lost pages, so the brick refuses writes until it is restarted and checked.
    pub(super) fn poison_on_fsync_error<T>(&self, result: R<T>) -> R<T> {
        if let Err(e) = &result
            && !matches!(*e, Errno::BADF | Errno::INVAL | Errno::ISDIR)
        {
            self.shared.poisoned.store(true, Ordering::Relaxed);
            tracing::error!(error = %e, "fsync failed: the brick refuses writes until restart");
        }
        result
    }

    pub(super) async fn release(
        &self,
        session: SessionId,
        fd: FdId,
        dir: bool,
    ) -> R<kiln_wire::Done> {
        let open = {
            let mut sessions = lock(&self.sessions);
            let table = &mut sessions.get_mut(&session).ok_or(Errno::BADF)?.fds;
            match (&table.get(fd)?.kind, dir) {
                (OpenKind::Dir { .. }, false) => return Err(Errno::ISDIR),
                (OpenKind::File { .. }, true) => return Err(Errno::NOTDIR),
                _ => {}
            }
            let open = table.remove(fd)?;
            // The session's last fd on the file is gone: none of its lock owners can hold
            // locks there any more (FLUSH already dropped each closing owner's).
            if table.open_on(&open.gfid) == 0 {
                lock(&self.shared.locks).release(session, None, &open.gfid);
            }
            open
        };
        if let OpenKind::File { file, .. } = open.kind {
            self.run1(Step::brick(op::Close { file })).await?;
        }
        Ok(kiln_wire::Done {})
    }

    /// Stops the lock waits of `session`, which is ending (its connection is gone).
    pub fn cancel_lock_waits(&self, session: SessionId) {
        lock(&self.shared.locks).cancel_waits(session);
    }

    /// FLUSH: the closing lock owner's POSIX locks on the file go.
    pub(super) fn flush(&self, session: SessionId, fd: FdId, owner: u64) -> R<kiln_wire::Done> {
        let gfid = self.open_file(session, fd)?.gfid;
        lock(&self.shared.locks).release(session, Some(owner), &gfid);
        Ok(kiln_wire::Done {})
    }

    pub(super) async fn fallocate(
        &self,
        session: SessionId,
        creds: &Creds,
        fd: FdId,
        range: FallocateRange,
    ) -> R<AttrChange> {
        let (gfid, file, writable) = self.file(session, fd)?;
        if !writable {
            return Err(Errno::BADF);
        }
        let fallocate = op::Fallocate {
            file: file.clone(),
            mode: range.mode,
            offset: range.offset,
            len: range.len,
        };
        self.change(gfid, file, vec![Step::caller(fallocate, creds)])
            .await
    }

    /// FTRUNCATE on the open file, as the caller: the kernel clears set-id bits and checks
    /// quotas as for the caller's own call, and an unlinked file is still reached.
    pub(super) async fn ftruncate(
        &self,
        session: SessionId,
        creds: &Creds,
        fd: FdId,
        size: u64,
    ) -> R<AttrChange> {
        let (gfid, file, writable) = self.file(session, fd)?;
        if !writable {
            return Err(Errno::INVAL);
        }
        let truncate = op::Ftruncate {
            file: file.clone(),
            len: size,
        };
        self.change(gfid, file, vec![Step::caller(truncate, creds)])
            .await
    }

    pub(super) async fn seek(&self, session: SessionId, r: Seek) -> R<SeekReply> {
        let (gfid, file, _) = self.file(session, r.fd)?;
        let fd = match file {
            FileRef::Fd(fd) => fd,
            // lseek needs a plain fd: reopen the same inode by its handle.
            _ => {
                let open = op::Open {
                    dir: self.brick.handle_dir(&gfid).clone(),
                    name: Brick::handle_name(&gfid),
                    flags: libc::O_RDONLY | libc::O_NOFOLLOW,
                    mode: 0,
                    fixed: false,
                };
                match self.run_one::<FileRef>(Step::brick(open)).await? {
                    FileRef::Fd(fd) => fd,
                    _ => return Err(op::invariant("a plain open gave a direct descriptor")),
                }
            }
        };
        let (what, offset) = (r.what, r.offset);
        self.exec
            .blocking(move || {
                let pos = match what {
                    SeekWhat::Data => rustix::fs::SeekFrom::Data(offset),
                    SeekWhat::Hole => rustix::fs::SeekFrom::Hole(offset),
                };
                rustix::fs::seek(&fd, pos).map(|offset| SeekReply { offset })
            })
            .await
    }

    /// LK. A blocking set (F_SETLKW) waits on the file's waiter queue, woken by every unlock
    /// and release on the file; it holds no thread, and ends with EBADF when its fd is
    /// released, or EINTR when its session is ending ([`Fops::cancel_lock_waits`]).
    pub(super) async fn lk(&self, session: SessionId, r: Lk) -> R<LkReply> {
        let (gfid, _, _) = self.file(session, r.fd)?;
        loop {
            // Under the sessions guard: a waiter whose fd was released or whose session ended
            // meanwhile must not take a lock nobody would release.
            let wait = {
                let sessions = lock(&self.sessions);
                sessions.get(&session).ok_or(Errno::BADF)?.fds.get(r.fd)?;
                let mut locks = lock(&self.shared.locks);
                if locks.is_cancelled(session) {
                    return Err(Errno::INTR);
                }
                match (locks.apply(session, gfid, r.cmd, &r.lock), r.cmd) {
                    (Err(Errno::AGAIN), LockCmd::SetWait) => {
                        // Registered before the guards go, so no wake-up is lost in between.
                        let mut wait = Box::pin(locks.waiter(gfid).notified_owned());
                        wait.as_mut().enable();
                        wait
                    }
                    (result, _) => return result.map(|lock| LkReply { lock }),
                }
            };
            wait.await;
        }
    }
}
