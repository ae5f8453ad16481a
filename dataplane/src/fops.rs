//! Fop semantics, written once for every executor: each fop resolves its GFIDs to held
//! directory fds, builds a chain of single-name [`Step`]s, runs it, and turns the results into
//! the reply a local Linux file system would give, errno included.
//!
//! Namespace fops follow the intent protocol of `docs/disk-layout.md`: an intent record in
//! `.glusterfs/kiln-pending` first, then the caller-visible step that commits, then the
//! housekeeping (GFID xattr, handle), then the record is removed — all one linked chain.

use std::collections::HashMap;
use std::ffi::CString;
use std::num::NonZeroUsize;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use kiln_wire::*;
use rustix::fs::{AtFlags, Mode as FsMode, OFlags, ResolveFlags};
use rustix::io::Errno;

use crate::brick::{Brick, GFID_XATTR};
use crate::cache::{DirCache, GfidCache, InodeKey};
use crate::engine::EngineState;
use crate::exec::Exec;
use crate::exec::uring::RingStats;
use crate::fdtable::{FdTable, OpenFile, OpenKind};
use crate::locks::LockTable;
use crate::profile::{self, Profile};
use crate::step::{DirFd, Done, FileRef, Op, Stat, Step, StepResult, cstr, proc_path};

/// Identifies one client session on a brick.
pub type SessionId = u64;

/// Sizes of the per-engine tables, in entries.
#[derive(Debug, Clone)]
pub struct FopsConfig {
    pub gfid_cache_entries: NonZeroUsize,
    pub dirfd_cache_entries: NonZeroUsize,
    pub open_files_per_client_max: usize,
    /// `storage.fsync-policy write-through`: every WRITE and PUT is synced (`fdatasync`, in
    /// the same chain) before it is acknowledged.
    pub write_through: bool,
}

impl Default for FopsConfig {
    fn default() -> Self {
        FopsConfig {
            gfid_cache_entries: NonZeroUsize::new(1 << 20).unwrap_or(NonZeroUsize::MIN),
            dirfd_cache_entries: NonZeroUsize::new(4096).unwrap_or(NonZeroUsize::MIN),
            open_files_per_client_max: 16_384,
            write_through: false,
        }
    }
}

/// A test hook: stop the named fop after this many steps of its chain, as if the brick had
/// been killed there (no rollback, no cleanup).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CrashPoint {
    pub fop: FopCode,
    pub after_steps: usize,
}

/// The fop implementation over one executor.
#[derive(Debug)]
pub struct Fops<E> {
    brick: Arc<Brick>,
    exec: E,
    config: FopsConfig,
    gfids: Mutex<GfidCache>,
    dirs: Mutex<DirCache>,
    /// Each session's fd table; `None` once the session ended, so a fop still in flight
    /// cannot open a file for it that nobody would ever release.
    sessions: Mutex<HashMap<SessionId, Option<FdTable>>>,
    shared: Arc<BrickState>,
    crash_point: Mutex<Option<CrashPoint>>,
}

/// What every worker of a brick shares: POSIX locks (clients on different workers contend
/// for the same files) and the poisoned flag.
#[derive(Debug, Default)]
pub struct BrickState {
    /// Per-fop counters and histograms (`diagnostics.*`).
    pub profile: Profile,
    locks: Mutex<LockTable>,
    /// Set by an fsync error: data may be lost, so writes are refused until restart.
    poisoned: AtomicBool,
}

type R<T> = Result<T, Errno>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means another fop panicked; the tables stay consistent because
    // every update is a single insert or remove.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn stat_of(r: StepResult) -> R<Stat> {
    match r? {
        Done::Stat(s) => Ok(s),
        _ => Err(Errno::IO),
    }
}

fn file_of(r: StepResult) -> R<FileRef> {
    match r? {
        Done::Opened(f) => Ok(f),
        _ => Err(Errno::IO),
    }
}

/// The attributes a client sees: a non-directory's handle is a hard link the client never
/// sees, so it is not counted.
pub fn iatt(stat: &Stat, gfid: Gfid) -> Iatt {
    let mut iatt = stat.to_iatt(gfid);
    if !stat.is_dir() && stat.nlink >= 2 {
        iatt.nlink -= 1;
    }
    iatt
}

/// An intent record's name: `<kind>-<gfid>-<nonce>`. The nonce keeps two fops on the same
/// GFID (a retry racing the original, two renames of one directory) from sharing a record.
fn record_name(kind: &str, gfid: &Gfid) -> CString {
    use std::sync::atomic::AtomicU64;
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nonce = NEXT.fetch_add(1, Ordering::Relaxed);
    cstr(format!("{kind}-{gfid}-{nonce:x}").as_bytes())
}

/// What a new entry is.
#[derive(Debug, Clone)]
enum NewKind {
    File {
        flags: i32,
        mode: u32,
        data: Option<Bytes>,
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

impl<E: Exec> Fops<E> {
    pub fn new(brick: Arc<Brick>, shared: Arc<BrickState>, exec: E, config: FopsConfig) -> Fops<E> {
        Fops {
            gfids: Mutex::new(GfidCache::new(config.gfid_cache_entries)),
            dirs: Mutex::new(DirCache::new(config.dirfd_cache_entries)),
            sessions: Mutex::new(HashMap::new()),
            shared,
            crash_point: Mutex::new(None),
            brick,
            exec,
            config,
        }
    }

    pub fn exec(&self) -> &E {
        &self.exec
    }

    /// Arms (or clears) the crash hook; for crash-injection tests.
    pub fn set_crash_point(&self, point: Option<CrashPoint>) {
        *lock(&self.crash_point) = point;
    }

    /// Sessions, fd tables and caches of this worker (the ring counters are the engine's).
    pub fn state(&self) -> EngineState {
        let fd_tables = lock(&self.sessions)
            .iter()
            .filter_map(|(&id, table)| Some((id, table.as_ref()?.len())))
            .collect();
        EngineState {
            fd_tables,
            gfid_cache: lock(&self.gfids).state(),
            dirfd_cache: lock(&self.dirs).state(),
            ring: RingStats::default(),
        }
    }

    /// Ends a session: its fds are released and its locks dropped. Returns the files the
    /// caller must close through the executor (direct descriptors).
    pub fn end_session(&self, session: SessionId) -> Vec<FileRef> {
        // Under the sessions guard (lock order: sessions, then locks), so no LK can slip a lock
        // in between the tombstone and the release.
        let mut sessions = lock(&self.sessions);
        let ended = sessions.insert(session, None);
        lock(&self.shared.locks).release_session(session);
        drop(sessions);
        let Some(Some(mut table)) = ended else {
            return Vec::new();
        };
        table
            .drain()
            .into_iter()
            .filter_map(|f| match f.kind {
                OpenKind::File { file, .. } => Some(file),
                OpenKind::Dir { .. } => None,
            })
            .collect()
    }

    /// Executes one fop for `session` as `creds`, recorded in the brick's profile.
    pub async fn call(&self, session: SessionId, creds: &Creds, fop: FopRequest) -> R<FopReply> {
        let profile = &self.shared.profile;
        if !profile.is_on() {
            return self.execute(session, creds, fop).await;
        }
        let (code, bytes) = (fop.code(), profile::request_bytes(&fop));
        profile
            .measure(code, bytes, self.execute(session, creds, fop))
            .await
    }

    async fn execute(&self, session: SessionId, creds: &Creds, fop: FopRequest) -> R<FopReply> {
        use FopReply as A;
        use FopRequest as Q;
        Ok(match fop {
            Q::Lookup(r) => A::Lookup(self.lookup(creds, &r.parent, &r.name).await?),
            Q::Stat(r) => A::Stat(AttrReply {
                iatt: iatt(&self.stat_gfid(&r.gfid).await?, r.gfid),
            }),
            Q::Fstat(r) => {
                let f = self.open_file(session, r.fd)?;
                A::Fstat(AttrReply {
                    iatt: self.fstat_open(&f).await?,
                })
            }
            Q::Access(r) => A::Access(
                self.access(creds, &r.gfid, r.mask)
                    .await
                    .map(|()| kiln_wire::Done {})?,
            ),
            Q::Readlink(r) => A::Readlink(self.readlink(&r.gfid).await?),
            Q::Mknod(r) => {
                let mode =
                    FileType::from(r.node_type).to_mode_bits() | (r.mode.bits() & !r.umask.bits());
                let kind = NewKind::Node { mode, rdev: r.rdev };
                let (stat, _) = self
                    .make_entry(FopCode::Mknod, creds, &r.parent, &r.name, r.gfid, kind)
                    .await?;
                A::Mknod(stat)
            }
            Q::Mkdir(r) => {
                let kind = NewKind::Dir {
                    mode: r.mode.bits() & !r.umask.bits(),
                };
                A::Mkdir(
                    self.make_entry(FopCode::Mkdir, creds, &r.parent, &r.name, r.gfid, kind)
                        .await?
                        .0,
                )
            }
            Q::Symlink(r) => {
                let kind = NewKind::Symlink {
                    target: cstr(r.target.as_bytes()),
                };
                A::Symlink(
                    self.make_entry(FopCode::Symlink, creds, &r.parent, &r.name, r.gfid, kind)
                        .await?
                        .0,
                )
            }
            Q::Create(r) => A::Create(self.create(session, creds, r).await?),
            Q::Put(r) => A::Put(self.put(creds, r).await?),
            Q::Unlink(r) => A::Unlink(
                self.remove(FopCode::Unlink, creds, &r.parent, &r.name)
                    .await?,
            ),
            Q::Rmdir(r) => A::Rmdir(
                self.remove(FopCode::Rmdir, creds, &r.parent, &r.name)
                    .await?,
            ),
            Q::Rename(r) => A::Rename(self.rename(creds, r).await?),
            Q::Link(r) => A::Link(self.link(creds, r).await?),
            Q::Open(r) => A::Open(
                self.open(session, creds, &r.gfid, r.access, r.flags)
                    .await?,
            ),
            Q::Read(r) => A::Read(self.read(session, r).await?),
            Q::Write(r) => A::Write(self.write(session, creds, r).await?),
            Q::Flush(r) => {
                let gfid = self.open_file(session, r.fd)?.gfid;
                lock(&self.shared.locks).release(session, Some(r.lock_owner), &gfid);
                A::Flush(kiln_wire::Done {})
            }
            Q::Fsync(r) => A::Fsync(self.fsync(session, r.fd, r.datasync).await?),
            Q::Release(r) => {
                self.release(session, r.fd, false).await?;
                A::Release(kiln_wire::Done {})
            }
            Q::Opendir(r) => A::Opendir(self.opendir(session, creds, &r.gfid).await?),
            Q::Readdir(r) => A::Readdir(self.readdir(session, r.fd, r.offset, r.size.get()).await?),
            Q::Readdirp(r) => {
                A::Readdirp(self.readdirp(session, r.fd, r.offset, r.size.get()).await?)
            }
            Q::Releasedir(r) => {
                self.release(session, r.fd, true).await?;
                A::Releasedir(kiln_wire::Done {})
            }
            Q::Fsyncdir(r) => {
                let f = self.open_file(session, r.fd)?;
                let OpenKind::Dir { dir, .. } = f.kind else {
                    return Err(Errno::NOTDIR);
                };
                self.fsync_plain(dir, r.datasync).await?;
                A::Fsyncdir(kiln_wire::Done {})
            }
            Q::Statfs(r) => A::Statfs(self.statfs(&r.gfid).await?),
            Q::Setxattr(r) => A::Setxattr(
                self.setxattr(creds, &r.gfid, Some((&r.name, r.value.as_bytes(), r.mode)))
                    .await
                    .map(|()| kiln_wire::Done {})?,
            ),
            Q::Removexattr(r) => A::Removexattr(
                self.removexattr(creds, &r.gfid, &r.name)
                    .await
                    .map(|()| kiln_wire::Done {})?,
            ),
            Q::Getxattr(r) => A::Getxattr(self.getxattr(creds, &r.gfid, &r.name).await?),
            Q::Listxattr(r) => A::Listxattr(self.listxattr(creds, &r.gfid).await?),
            Q::Fsetxattr(r) => {
                let g = self.open_file(session, r.fd)?.gfid;
                A::Fsetxattr(
                    self.setxattr(creds, &g, Some((&r.name, r.value.as_bytes(), r.mode)))
                        .await
                        .map(|()| kiln_wire::Done {})?,
                )
            }
            Q::Fgetxattr(r) => {
                let g = self.open_file(session, r.fd)?.gfid;
                A::Fgetxattr(self.getxattr(creds, &g, &r.name).await?)
            }
            Q::Fremovexattr(r) => {
                let g = self.open_file(session, r.fd)?.gfid;
                A::Fremovexattr(
                    self.removexattr(creds, &g, &r.name)
                        .await
                        .map(|()| kiln_wire::Done {})?,
                )
            }
            Q::Setattr(r) => A::Setattr(self.setattr(creds, &r.gfid, r.attr).await?),
            Q::Fsetattr(r) => {
                let g = self.open_file(session, r.fd)?.gfid;
                A::Fsetattr(self.setattr(creds, &g, r.attr).await?)
            }
            Q::Truncate(r) => {
                let attr = SetAttr {
                    size: Some(r.size),
                    ..SetAttr::default()
                };
                A::Truncate(self.setattr(creds, &r.gfid, attr).await?)
            }
            Q::Ftruncate(r) => {
                let f = self.open_file(session, r.fd)?;
                if !matches!(f.kind, OpenKind::File { writable: true, .. }) {
                    return Err(Errno::INVAL);
                }
                let attr = SetAttr {
                    size: Some(r.size),
                    ..SetAttr::default()
                };
                A::Ftruncate(self.setattr(&Creds::root(), &f.gfid, attr).await?)
            }
            Q::Fallocate(r) => {
                let mode = if r.keep_size {
                    libc::FALLOC_FL_KEEP_SIZE
                } else {
                    0
                };
                A::Fallocate(
                    self.fallocate(session, creds, r.fd, mode, r.offset, r.len)
                        .await?,
                )
            }
            Q::Discard(r) => {
                let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
                A::Discard(
                    self.fallocate(session, creds, r.fd, mode, r.offset, r.len)
                        .await?,
                )
            }
            Q::Zerofill(r) => A::Zerofill(
                self.fallocate(
                    session,
                    creds,
                    r.fd,
                    libc::FALLOC_FL_ZERO_RANGE,
                    r.offset,
                    r.len,
                )
                .await?,
            ),
            Q::Seek(r) => A::Seek(self.seek(session, r).await?),
            Q::Lk(r) => A::Lk(self.lk(session, r).await?),
        })
    }

    // ---- resolution ----

    /// The held `O_PATH` fd of directory `gfid`, from the cache or opened by its handle.
    async fn dir(&self, gfid: &Gfid) -> R<DirFd> {
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

    /// The GFID of `dir/name` (whose `statx` is `stat`): cached by inode, else read from its
    /// xattr; an object without one (copied into the brick behind Kiln's back) gets one.
    async fn gfid_at(&self, parent: &Gfid, dir: &DirFd, name: &[u8], stat: &Stat) -> R<Gfid> {
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

    async fn run(&self, steps: Vec<Step>) -> Vec<StepResult> {
        profile::charge(|c| c.steps += steps.len() as u64);
        self.exec.run(steps).await
    }

    async fn run1(&self, step: Step) -> StepResult {
        self.run(vec![step]).await.pop().unwrap_or(Err(Errno::IO))
    }

    async fn fstat_dir(&self, dir: &DirFd) -> R<Stat> {
        stat_of(
            self.run1(Step::brick(Op::Fstat {
                file: FileRef::Fd(dir.clone()),
            }))
            .await,
        )
    }

    /// `statx` of the object `gfid`, following a directory's handle symlink.
    async fn stat_gfid(&self, gfid: &Gfid) -> R<Stat> {
        if gfid.is_root() || lock(&self.dirs).get(gfid).is_some() {
            return self.fstat_dir(&self.dir(gfid).await?).await;
        }
        let step = Step::brick(Op::Statx {
            dir: self.brick.handle_dir(gfid).clone(),
            name: Brick::handle_name(gfid),
            nofollow: true,
        });
        let stat = match stat_of(self.run1(step).await) {
            Err(Errno::NOENT | Errno::NOTDIR) => return Err(Errno::STALE),
            other => other?,
        };
        if stat.mode & libc::S_IFMT != libc::S_IFLNK {
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

    /// Refuses names a client may not use in the root: `.glusterfs` is the brick's own.
    fn check_entry(parent: &Gfid, name: &Name) -> R<()> {
        match parent.is_root() && name.as_bytes() == crate::brick::GLUSTERFS_DIR.as_bytes() {
            true => Err(Errno::PERM),
            false => Ok(()),
        }
    }

    fn open_file(&self, session: SessionId, fd: FdId) -> R<OpenFile> {
        let sessions = lock(&self.sessions);
        sessions
            .get(&session)
            .and_then(Option::as_ref)
            .ok_or(Errno::BADF)?
            .get(fd)
            .cloned()
    }

    /// Adds an open file to the session's table; EBADF when the session has ended.
    fn insert_open(&self, session: SessionId, file: OpenFile) -> R<FdId> {
        let limit = self.config.open_files_per_client_max;
        let mut sessions = lock(&self.sessions);
        let table = sessions
            .entry(session)
            .or_insert_with(|| Some(FdTable::new(limit)));
        table.as_mut().ok_or(Errno::BADF)?.insert(file)
    }

    // ---- inode fops ----

    async fn lookup(&self, creds: &Creds, parent: &Gfid, name: &Name) -> R<LookupReply> {
        Self::check_entry(parent, name)?;
        let dir = self.dir(parent).await?;
        let steps = vec![
            Step::caller(
                Op::Statx {
                    dir: dir.clone(),
                    name: cstr(name.as_bytes()),
                    nofollow: true,
                },
                creds,
            ),
            Step::brick(Op::Fstat {
                file: FileRef::Fd(dir.clone()),
            }),
        ];
        let mut results = self.run(steps).await.into_iter();
        let stat = stat_of(results.next().unwrap_or(Err(Errno::IO)))?;
        let parent_stat = stat_of(results.next().unwrap_or(Err(Errno::IO)))?;
        let gfid = self.gfid_at(parent, &dir, name.as_bytes(), &stat).await?;
        Ok(LookupReply {
            iatt: iatt(&stat, gfid),
            parent: iatt(&parent_stat, *parent),
        })
    }

    async fn access(&self, creds: &Creds, gfid: &Gfid, mask: AccessMask) -> R<()> {
        let (dir, name) = self.object_path(gfid).await?;
        let creds = creds.clone();
        self.exec
            .blocking(move || {
                let _as = crate::creds::ActAs::new(&creds)?;
                let mut access = rustix::fs::Access::EXISTS;
                for (bit, a) in [
                    (AccessMask::READ, rustix::fs::Access::READ_OK),
                    (AccessMask::WRITE, rustix::fs::Access::WRITE_OK),
                    (AccessMask::EXECUTE, rustix::fs::Access::EXEC_OK),
                ] {
                    if mask.contains(bit) {
                        access |= a;
                    }
                }
                // A directory is checked as "." of its own fd: faccessat2 refuses
                // AT_EMPTY_PATH with AT_EACCESS on these kernels (EINVAL).
                if name.is_empty() {
                    rustix::fs::accessat(&dir, c".", access, AtFlags::EACCESS)
                } else {
                    let flags = AtFlags::EACCESS | AtFlags::SYMLINK_NOFOLLOW;
                    rustix::fs::accessat(&dir, &*name, access, flags)
                }
            })
            .await
    }

    /// A directory fd and name that reach the object `gfid` itself: its handle for
    /// non-directories, the directory's own fd (and an empty name) for directories.
    async fn object_path(&self, gfid: &Gfid) -> R<(DirFd, CString)> {
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

    async fn readlink(&self, gfid: &Gfid) -> R<ReadlinkReply> {
        let stat = self.stat_gfid(gfid).await?;
        if stat.mode & libc::S_IFMT != libc::S_IFLNK {
            return Err(Errno::INVAL);
        }
        let dir = self.brick.handle_dir(gfid).clone();
        let name = Brick::handle_name(gfid);
        let target = self
            .exec
            .blocking(move || rustix::fs::readlinkat(&dir, &*name, Vec::new()))
            .await?;
        let target = SymlinkTarget::new(target.into_bytes()).map_err(|_| Errno::NAMETOOLONG)?;
        Ok(ReadlinkReply {
            target,
            iatt: iatt(&stat, *gfid),
        })
    }
}

// ---- namespace fops ----

impl<E: Exec> Fops<E> {
    fn crash_point_for(&self, fop: FopCode) -> Option<usize> {
        lock(&self.crash_point)
            .filter(|p| p.fop == fop)
            .map(|p| p.after_steps)
    }

    /// Runs a namespace chain, or — when a crash point is armed for `fop` — only its first
    /// steps, reporting EIO as a killed brick would (no rollback).
    async fn run_namespace(&self, fop: FopCode, mut steps: Vec<Step>) -> R<Vec<StepResult>> {
        if let Some(n) = self.crash_point_for(fop) {
            steps.truncate(n);
            let _ = self.run(steps).await;
            return Err(Errno::IO);
        }
        profile::charge(|c| c.intents += 1);
        Ok(self.run(steps).await)
    }

    async fn unlink_quietly(&self, dir: &DirFd, name: &CString, dir_flag: bool) {
        let _ = self
            .run1(Step::brick(Op::Unlink {
                dir: dir.clone(),
                name: name.clone(),
                dir_flag,
            }))
            .await;
    }

    /// Creates `parent/name` with identity `gfid`: intent record → caller's create (commit) →
    /// GFID xattr → data → handle → stat → record removed, in one chain.
    async fn make_entry(
        &self,
        fop: FopCode,
        creds: &Creds,
        parent: &Gfid,
        name: &Name,
        gfid: Gfid,
        kind: NewKind,
    ) -> R<(EntryReply, Option<FileRef>)> {
        Self::check_entry(parent, name)?;
        let dir = self.dir(parent).await?;
        self.brick.ensure_handle_parent(&gfid)?;
        let n = cstr(name.as_bytes());
        let record = record_name("new", &gfid);
        let pending = self.brick.pending.clone();
        let handle_dir = self.brick.handle_dir(&gfid).clone();
        let handle = Brick::handle_name(&gfid);
        let mut intent = parent.to_string().into_bytes();
        intent.push(b'/');
        intent.extend_from_slice(name.as_bytes());
        let xattr = cstr(GFID_XATTR.as_bytes());
        let value = gfid.as_bytes().to_vec();
        let create = libc::XATTR_CREATE;
        let opens = matches!(kind, NewKind::File { .. } | NewKind::Dir { .. });
        // A GFID already in use: a retry of this create (same name), or a client reusing an
        // identity (EEXIST, and nothing of the other object is touched).
        let taken = Step::brick(Op::Statx {
            dir: handle_dir.clone(),
            name: handle.clone(),
            nofollow: true,
        });
        if self.run1(taken).await.is_ok() {
            return match self.lookup(creds, parent, name).await {
                Ok(existing) if existing.iatt.gfid == gfid => Ok((Self::retried(existing), None)),
                _ => Err(Errno::EXIST),
            };
        }

        let mut steps = vec![
            Step::brick(Op::Fstat {
                file: FileRef::Fd(dir.clone()),
            }),
            Step::brick(Op::Symlink {
                target: cstr(&intent),
                dir: pending.clone(),
                name: record.clone(),
            }),
        ];
        const COMMIT: usize = 2;
        match &kind {
            NewKind::File {
                flags,
                mode,
                keep_open,
                ..
            } => {
                let flags = flags | libc::O_CREAT | libc::O_EXCL;
                // A file that stays open is a plain fd (see exec::uring); one closed in the
                // chain is a direct descriptor.
                let fixed = !keep_open;
                steps.push(
                    Step::caller(
                        Op::Open {
                            dir: dir.clone(),
                            name: n.clone(),
                            flags,
                            mode: *mode,
                            fixed,
                        },
                        creds,
                    )
                    .barrier(),
                );
            }
            NewKind::Dir { mode } => {
                steps.push(
                    Step::caller(
                        Op::Mkdir {
                            dir: dir.clone(),
                            name: n.clone(),
                            mode: *mode,
                        },
                        creds,
                    )
                    .barrier(),
                );
                let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW;
                steps.push(Step::brick(Op::Open {
                    dir: dir.clone(),
                    name: n.clone(),
                    flags,
                    mode: 0,
                    fixed: true,
                }));
            }
            NewKind::Node { mode, rdev } => {
                steps.push(
                    Step::caller(
                        Op::Mknod {
                            dir: dir.clone(),
                            name: n.clone(),
                            mode: *mode,
                            rdev: *rdev,
                        },
                        creds,
                    )
                    .barrier(),
                );
            }
            NewKind::Symlink { target } => {
                steps.push(
                    Step::caller(
                        Op::Symlink {
                            target: target.clone(),
                            dir: dir.clone(),
                            name: n.clone(),
                        },
                        creds,
                    )
                    .barrier(),
                );
            }
        }
        let open_index = (COMMIT..steps.len()).find(|&i| matches!(steps[i].op, Op::Open { .. }));
        steps.push(Step::brick(match opens {
            true => Op::FSetXattr {
                file: FileRef::Chain,
                name: xattr,
                value,
                flags: create,
            },
            false => Op::SetXattrAt {
                dir: dir.clone(),
                name: n.clone(),
                xattr,
                value,
                flags: create,
            },
        }));
        if let NewKind::File {
            data: Some(data), ..
        } = &kind
        {
            let write = Op::Write {
                file: FileRef::Chain,
                offset: 0,
                data: data.clone(),
            };
            steps.push(Step::caller(write, creds));
            if self.config.write_through {
                steps.push(Step::brick(Op::Fsync {
                    file: FileRef::Chain,
                    datasync: true,
                }));
            }
        }
        let handle_index = steps.len();
        steps.push(Step::brick(match kind {
            NewKind::Dir { .. } => Op::Symlink {
                target: cstr(&Brick::dir_handle_target(parent, name.as_bytes())),
                dir: handle_dir.clone(),
                name: handle.clone(),
            },
            _ => Op::Link {
                old_dir: dir.clone(),
                old_name: n.clone(),
                new_dir: handle_dir.clone(),
                new_name: handle.clone(),
            },
        }));
        let keep_open = matches!(
            kind,
            NewKind::File {
                keep_open: true,
                ..
            }
        );
        let close_index = (opens && !keep_open).then(|| {
            steps.push(Step::brick(Op::Close {
                file: FileRef::Chain,
            }));
            steps.len() - 1
        });
        steps.push(Step::brick(Op::Unlink {
            dir: pending.clone(),
            name: record.clone(),
            dir_flag: false,
        }));
        // Stats last: by name (a direct descriptor cannot be statx'ed), and at the end of the
        // chain, where the ring executor runs them inline.
        let stat_index = steps.len();
        steps.push(Step::brick(Op::Statx {
            dir: dir.clone(),
            name: n.clone(),
            nofollow: true,
        }));
        steps.push(Step::brick(Op::Fstat {
            file: FileRef::Fd(dir.clone()),
        }));

        let mut results = self.run_namespace(fop, steps).await?;
        let is_dir = matches!(kind, NewKind::Dir { .. });
        let opened = open_index.and_then(|i| match &results[i] {
            Ok(Done::Opened(f)) => Some(f.clone()),
            _ => None,
        });
        let recorded = results[1].is_ok();
        if let Err(e) = results[COMMIT] {
            if recorded {
                self.unlink_quietly(&pending, &record, false).await;
            }
            if e == Errno::EXIST {
                // A retry of a create that already happened carries the same GFID.
                let existing = self.lookup(creds, parent, name).await?;
                if existing.iatt.gfid == gfid {
                    return Ok((Self::retried(existing), None));
                }
            }
            return Err(e);
        }
        if let Some(e) = results.iter().find_map(|r| r.as_ref().err().copied()) {
            // A step around the commit failed (e.g. ENOSPC for the record or the xattr): undo
            // what this chain made, and only that, newest first.
            let closed = close_index.is_some_and(|i| results[i].is_ok());
            if let Some(file) = opened.filter(|_| !closed) {
                let _ = self.run1(Step::brick(Op::Close { file })).await;
            }
            if results[handle_index].is_ok() {
                self.unlink_quietly(&handle_dir, &handle, false).await;
            }
            self.unlink_quietly(&dir, &n, is_dir).await;
            if recorded {
                self.unlink_quietly(&pending, &record, false).await;
            }
            return Err(e);
        }
        let post = stat_of(results.pop().unwrap_or(Err(Errno::IO)))?;
        let pre = stat_of(std::mem::replace(&mut results[0], Err(Errno::IO)))?;
        let stat = stat_of(std::mem::replace(&mut results[stat_index], Err(Errno::IO)))?;
        lock(&self.gfids).insert(InodeKey::of(&stat), gfid);
        let reply = EntryReply {
            iatt: iatt(&stat, gfid),
            pre_parent: iatt(&pre, *parent),
            post_parent: iatt(&post, *parent),
        };
        Ok((reply, if keep_open { opened } else { None }))
    }

    /// The reply to a create that already happened (a retry with the same GFID).
    fn retried(existing: LookupReply) -> EntryReply {
        let parent = existing.parent;
        EntryReply {
            iatt: existing.iatt,
            pre_parent: parent.clone(),
            post_parent: parent,
        }
    }

    async fn create(&self, session: SessionId, creds: &Creds, r: Create) -> R<CreateReply> {
        let flags = r.access.to_libc() | (r.flags.to_libc() & !libc::O_EXCL);
        let mode = r.mode.bits() & !r.umask.bits();
        let kind = NewKind::File {
            flags,
            mode,
            data: None,
            keep_open: true,
        };
        let made = self
            .make_entry(FopCode::Create, creds, &r.parent, &r.name, r.gfid, kind)
            .await;
        let (entry, file) = match made {
            Ok(done) => done,
            // Without O_EXCL, CREATE of an existing name opens it, like open(O_CREAT).
            Err(Errno::EXIST) if !r.flags.contains(OpenFlags::EXCL) => {
                let found = self.lookup(creds, &r.parent, &r.name).await?;
                let fd = self
                    .open(session, creds, &found.iatt.gfid, r.access, r.flags)
                    .await?
                    .fd;
                let parent = found.parent;
                return Ok(CreateReply {
                    fd,
                    iatt: found.iatt,
                    pre_parent: parent.clone(),
                    post_parent: parent,
                });
            }
            Err(e) => return Err(e),
        };
        let fd = match file {
            Some(file) => {
                self.keep_open(
                    session,
                    entry.iatt.gfid,
                    file,
                    r.access != AccessMode::ReadOnly,
                )
                .await?
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

    async fn keep_open(
        &self,
        session: SessionId,
        gfid: Gfid,
        file: FileRef,
        writable: bool,
    ) -> R<FdId> {
        match self.insert_open(
            session,
            OpenFile {
                gfid,
                kind: OpenKind::File {
                    file: file.clone(),
                    writable,
                },
            },
        ) {
            Ok(fd) => Ok(fd),
            Err(e) => {
                let _ = self.run1(Step::brick(Op::Close { file })).await;
                Err(e)
            }
        }
    }

    async fn put(&self, creds: &Creds, r: Put) -> R<EntryReply> {
        if self.shared.poisoned.load(Ordering::Relaxed) {
            return Err(Errno::IO);
        }
        let flags = libc::O_WRONLY | r.flags.to_libc() & !libc::O_EXCL;
        let mode = r.mode.bits() & !r.umask.bits();
        let data = Some(r.data.clone().into_bytes()).filter(|d| !d.is_empty());
        let kind = NewKind::File {
            flags,
            mode,
            data,
            keep_open: false,
        };
        let (mut entry, file) = self
            .make_entry(FopCode::Put, creds, &r.parent, &r.name, r.gfid, kind)
            .await?;
        debug_assert!(file.is_none());
        if entry.iatt.size != r.data.len() as u64 {
            // A retried PUT found the file made by the first attempt: write the data again.
            let dir = self.brick.handle_dir(&r.gfid).clone();
            let open = Op::Open {
                dir,
                name: Brick::handle_name(&r.gfid),
                flags: libc::O_WRONLY | libc::O_TRUNC,
                mode: 0,
                fixed: true,
            };
            let mut steps = vec![
                Step::caller(open, creds),
                Step::caller(
                    Op::Write {
                        file: FileRef::Chain,
                        offset: 0,
                        data: r.data.clone().into_bytes(),
                    },
                    creds,
                ),
            ];
            if self.config.write_through {
                steps.push(Step::brick(Op::Fsync {
                    file: FileRef::Chain,
                    datasync: true,
                }));
            }
            steps.extend([
                Step::brick(Op::Statx {
                    dir: self.brick.handle_dir(&r.gfid).clone(),
                    name: Brick::handle_name(&r.gfid),
                    nofollow: true,
                }),
                Step::brick(Op::Close {
                    file: FileRef::Chain,
                }),
            ]);
            let mut results = self.run(steps).await;
            let (close, stat) = (results.pop(), results.pop());
            for step in results.into_iter().map(Some).chain([close]) {
                step.unwrap_or(Err(Errno::IO))?;
            }
            entry.iatt = iatt(&stat_of(stat.unwrap_or(Err(Errno::IO)))?, r.gfid);
        }
        if !r.attr.is_empty() {
            entry.iatt = self.setattr(creds, &r.gfid, r.attr).await?.post;
        }
        Ok(entry)
    }

    /// UNLINK and RMDIR: the handle moves into the pending directory (the intent record), the
    /// caller's unlink commits, the record goes.
    async fn remove(
        &self,
        fop: FopCode,
        creds: &Creds,
        parent: &Gfid,
        name: &Name,
    ) -> R<RemoveReply> {
        Self::check_entry(parent, name)?;
        let dir = self.dir(parent).await?;
        let n = cstr(name.as_bytes());
        let stat = stat_of(
            self.run1(Step::caller(
                Op::Statx {
                    dir: dir.clone(),
                    name: n.clone(),
                    nofollow: true,
                },
                creds,
            ))
            .await,
        )?;
        let is_dir = stat.is_dir();
        match (fop, is_dir) {
            (FopCode::Unlink, true) => return Err(Errno::ISDIR),
            (FopCode::Rmdir, false) => return Err(Errno::NOTDIR),
            _ => {}
        }
        let gfid = self.gfid_at(parent, &dir, name.as_bytes(), &stat).await?;
        // The handle moves into a record first; after the commit it comes back when names are
        // left (a file's other hard links) and goes otherwise (`settle_removed`).
        let handle_dir = self.brick.handle_dir(&gfid).clone();
        let handle = Brick::handle_name(&gfid);
        let pending = self.brick.pending.clone();
        let record = record_name("del", &gfid);
        let steps = vec![
            Step::brick(Op::Fstat {
                file: FileRef::Fd(dir.clone()),
            }),
            Step::brick(Op::Rename {
                old_dir: handle_dir,
                old_name: handle,
                new_dir: pending,
                new_name: record.clone(),
                flags: 0,
            }),
            Step::caller(
                Op::Unlink {
                    dir: dir.clone(),
                    name: n,
                    dir_flag: is_dir,
                },
                creds,
            )
            .barrier(),
            Step::brick(Op::Fstat {
                file: FileRef::Fd(dir.clone()),
            }),
        ];
        let mut results = self.run_namespace(fop, steps).await?;
        // No handle to move (a damaged brick, or a racing removal of another name that moved
        // it first) is no reason to refuse the removal.
        let moved = results[1].is_ok();
        if let Err(e) = results[2] {
            if moved {
                self.handle_back(&gfid, &record).await;
            }
            return Err(e);
        }
        if moved {
            self.settle_removed(&gfid, is_dir, &record).await;
        }
        if is_dir {
            lock(&self.dirs).remove(&gfid);
        }
        let post = stat_of(results.pop().unwrap_or(Err(Errno::IO)))?;
        let pre = stat_of(std::mem::replace(&mut results[0], Err(Errno::IO)))?;
        Ok(RemoveReply {
            pre_parent: iatt(&pre, *parent),
            post_parent: iatt(&post, *parent),
        })
    }

    async fn rename(&self, creds: &Creds, r: Rename) -> R<RenameReply> {
        Self::check_entry(&r.old_parent, &r.old_name)?;
        Self::check_entry(&r.new_parent, &r.new_name)?;
        let src_dir = self.dir(&r.old_parent).await?;
        let dst_dir = self.dir(&r.new_parent).await?;
        let (old, new) = (cstr(r.old_name.as_bytes()), cstr(r.new_name.as_bytes()));
        let probe = vec![Step::caller(
            Op::Statx {
                dir: src_dir.clone(),
                name: old.clone(),
                nofollow: true,
            },
            creds,
        )];
        let src = stat_of(self.run(probe).await.pop().unwrap_or(Err(Errno::IO)))?;
        let src_gfid = self
            .gfid_at(&r.old_parent, &src_dir, r.old_name.as_bytes(), &src)
            .await?;
        let dst = match stat_of(
            self.run1(Step::caller(
                Op::Statx {
                    dir: dst_dir.clone(),
                    name: new.clone(),
                    nofollow: true,
                },
                creds,
            ))
            .await,
        ) {
            Ok(st) => Some((
                st,
                self.gfid_at(&r.new_parent, &dst_dir, r.new_name.as_bytes(), &st)
                    .await?,
            )),
            Err(Errno::NOENT) => None,
            Err(e) => return Err(e),
        };
        let pending = self.brick.pending.clone();
        let mut steps = vec![
            Step::brick(Op::Fstat {
                file: FileRef::Fd(src_dir.clone()),
            }),
            Step::brick(Op::Fstat {
                file: FileRef::Fd(dst_dir.clone()),
            }),
        ];
        // Directories whose handle must follow them: (gfid, new parent, new name, record).
        let mut moved_dirs: Vec<(Gfid, Gfid, Vec<u8>, CString)> = Vec::new();
        if src.is_dir() {
            let record = record_name("mv", &src_gfid);
            moved_dirs.push((
                src_gfid,
                r.new_parent,
                r.new_name.as_bytes().to_vec(),
                record,
            ));
        }
        // A replaced target loses a name: its handle moves to a record, and after the commit
        // goes back or away depending on whether a name is left (see `settle_removed`).
        let mut victim: Option<(Gfid, bool, CString)> = None;
        if let Some((dst_stat, dst_gfid)) = &dst
            && *dst_gfid != src_gfid
        {
            match r.mode {
                RenameMode::Exchange if dst_stat.is_dir() => {
                    let record = record_name("mv", dst_gfid);
                    moved_dirs.push((
                        *dst_gfid,
                        r.old_parent,
                        r.old_name.as_bytes().to_vec(),
                        record,
                    ));
                }
                RenameMode::Replace => {
                    victim = Some((*dst_gfid, dst_stat.is_dir(), record_name("del", dst_gfid)));
                }
                _ => {}
            }
        }
        for (_, p, name, record) in &moved_dirs {
            let target = cstr(&Brick::dir_handle_target(p, name));
            steps.push(Step::brick(Op::Symlink {
                target,
                dir: pending.clone(),
                name: record.clone(),
            }));
        }
        let victim_step = steps.len();
        if let Some((v, _, record)) = &victim {
            steps.push(Step::brick(Op::Rename {
                old_dir: self.brick.handle_dir(v).clone(),
                old_name: Brick::handle_name(v),
                new_dir: pending.clone(),
                new_name: record.clone(),
                flags: 0,
            }));
        }
        let commit = steps.len();
        let flags = match r.mode {
            RenameMode::Replace => 0,
            RenameMode::NoReplace => libc::RENAME_NOREPLACE,
            RenameMode::Exchange => libc::RENAME_EXCHANGE,
        };
        let rename = Op::Rename {
            old_dir: src_dir.clone(),
            old_name: old,
            new_dir: dst_dir.clone(),
            new_name: new.clone(),
            flags,
        };
        steps.push(Step::caller(rename, creds).barrier());
        for (g, _, _, record) in &moved_dirs {
            steps.push(Step::brick(Op::Rename {
                old_dir: pending.clone(),
                old_name: record.clone(),
                new_dir: self.brick.handle_dir(g).clone(),
                new_name: Brick::handle_name(g),
                flags: 0,
            }));
        }
        let stat_index = steps.len();
        steps.push(Step::brick(Op::Statx {
            dir: dst_dir.clone(),
            name: new,
            nofollow: true,
        }));
        steps.push(Step::brick(Op::Fstat {
            file: FileRef::Fd(src_dir.clone()),
        }));
        steps.push(Step::brick(Op::Fstat {
            file: FileRef::Fd(dst_dir.clone()),
        }));
        let mut results = self.run_namespace(FopCode::Rename, steps).await?;
        let recorded: Vec<bool> = (0..moved_dirs.len())
            .map(|i| results[2 + i].is_ok())
            .collect();
        let victim = victim.filter(|_| results[victim_step].is_ok());
        if let Err(e) = results[commit] {
            for ((_, _, _, record), made) in moved_dirs.iter().zip(&recorded) {
                if *made {
                    self.unlink_quietly(&pending, record, false).await;
                }
            }
            if let Some((v, _, record)) = &victim {
                self.handle_back(v, record).await;
            }
            return Err(e);
        }
        if let Some(e) = results[commit..stat_index]
            .iter()
            .find_map(|r| r.as_ref().err().copied())
        {
            // The rename happened but a handle could not follow (ENOSPC, EIO): the name is
            // right and `kiln-brickd check --repair` fixes the handle.
            tracing::warn!(error = %e, "rename committed but a handle update failed");
        }
        if let Some((v, is_dir, record)) = &victim {
            self.settle_removed(v, *is_dir, record).await;
            if *is_dir {
                lock(&self.dirs).remove(v);
            }
        }
        let mut take = |i: usize| stat_of(std::mem::replace(&mut results[i], Err(Errno::IO)));
        let n = stat_index;
        let (stat, post_old, post_new) = (take(n)?, take(n + 1)?, take(n + 2)?);
        let (pre_old, pre_new) = (take(0)?, take(1)?);
        Ok(RenameReply {
            iatt: iatt(&stat, src_gfid),
            pre_old_parent: iatt(&pre_old, r.old_parent),
            post_old_parent: iatt(&post_old, r.old_parent),
            pre_new_parent: iatt(&pre_new, r.new_parent),
            post_new_parent: iatt(&post_new, r.new_parent),
        })
    }

    /// Moves a handle parked in `record` back into place (the removal did not happen).
    async fn handle_back(&self, gfid: &Gfid, record: &CString) {
        let back = Op::Rename {
            old_dir: self.brick.pending.clone(),
            old_name: record.clone(),
            new_dir: self.brick.handle_dir(gfid).clone(),
            new_name: Brick::handle_name(gfid),
            flags: 0,
        };
        let _ = self.run1(Step::brick(back)).await;
    }

    /// After a committed removal of one name of `gfid`, whose handle was parked in `record`:
    /// a file with names left (other hard links, counted now, after the commit, so a LINK or
    /// UNLINK racing with this one cannot mislead it) gets its handle back; otherwise the
    /// record goes, and with it the handle.
    async fn settle_removed(&self, gfid: &Gfid, is_dir: bool, record: &CString) {
        let pending = self.brick.pending.clone();
        if !is_dir {
            let probe = Step::brick(Op::Statx {
                dir: pending.clone(),
                name: record.clone(),
                nofollow: true,
            });
            if stat_of(self.run1(probe).await).is_ok_and(|st| st.nlink >= 2) {
                self.handle_back(gfid, record).await;
                // A removal of the last other name may have raced in between: a handle that
                // is now the only link goes (a missing handle is healed on lookup; an orphan
                // would keep the file alive).
                let dir = self.brick.handle_dir(gfid).clone();
                let handle = Brick::handle_name(gfid);
                let probe = Step::brick(Op::Statx {
                    dir: dir.clone(),
                    name: handle.clone(),
                    nofollow: true,
                });
                if stat_of(self.run1(probe).await).is_ok_and(|st| st.nlink <= 1) {
                    self.unlink_quietly(&dir, &handle, false).await;
                }
                return;
            }
        }
        self.unlink_quietly(&pending, record, false).await;
    }

    async fn link(&self, creds: &Creds, r: Link) -> R<EntryReply> {
        Self::check_entry(&r.new_parent, &r.new_name)?;
        if self.stat_gfid(&r.gfid).await?.is_dir() {
            return Err(Errno::PERM);
        }
        let dir = self.dir(&r.new_parent).await?;
        let new = cstr(r.new_name.as_bytes());
        let steps = vec![
            Step::brick(Op::Fstat {
                file: FileRef::Fd(dir.clone()),
            }),
            Step::caller(
                Op::Link {
                    old_dir: self.brick.handle_dir(&r.gfid).clone(),
                    old_name: Brick::handle_name(&r.gfid),
                    new_dir: dir.clone(),
                    new_name: new.clone(),
                },
                creds,
            ),
            Step::brick(Op::Statx {
                dir: dir.clone(),
                name: new,
                nofollow: true,
            }),
            Step::brick(Op::Fstat {
                file: FileRef::Fd(dir.clone()),
            }),
        ];
        let mut r2 = self.run_namespace(FopCode::Link, steps).await?.into_iter();
        let pre = stat_of(r2.next().unwrap_or(Err(Errno::IO)))?;
        r2.next().unwrap_or(Err(Errno::IO))?;
        let stat = stat_of(r2.next().unwrap_or(Err(Errno::IO)))?;
        let post = stat_of(r2.next().unwrap_or(Err(Errno::IO)))?;
        Ok(EntryReply {
            iatt: iatt(&stat, r.gfid),
            pre_parent: iatt(&pre, r.new_parent),
            post_parent: iatt(&post, r.new_parent),
        })
    }
}

// ---- open files ----

impl<E: Exec> Fops<E> {
    async fn open(
        &self,
        session: SessionId,
        creds: &Creds,
        gfid: &Gfid,
        access: AccessMode,
        flags: OpenFlags,
    ) -> R<OpenReply> {
        let stat = self.stat_gfid(gfid).await?;
        if stat.is_dir() {
            return Err(Errno::ISDIR);
        }
        match stat.mode & libc::S_IFMT {
            libc::S_IFLNK => return Err(Errno::LOOP),
            libc::S_IFREG => {}
            // FIFOs, sockets and devices are opened by the client's kernel, never on the
            // brick: opening the server's device nodes or blocking a thread on a FIFO is not
            // a fop.
            _ => return Err(Errno::NXIO),
        }
        self.brick.ensure_handle_parent(gfid)?;
        let flags = access.to_libc() | (flags.to_libc() & !libc::O_EXCL) | libc::O_NOFOLLOW;
        let open = Op::Open {
            dir: self.brick.handle_dir(gfid).clone(),
            name: Brick::handle_name(gfid),
            flags,
            mode: 0,
            fixed: false,
        };
        let file = file_of(self.run1(Step::caller(open, creds)).await)?;
        let fd = self
            .keep_open(session, *gfid, file, access != AccessMode::ReadOnly)
            .await?;
        Ok(OpenReply { fd })
    }

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

    async fn fstat_open(&self, f: &OpenFile) -> R<Iatt> {
        let file = match &f.kind {
            OpenKind::File { file, .. } => file.clone(),
            OpenKind::Dir { dir, .. } => FileRef::Fd(dir.clone()),
        };
        Ok(iatt(
            &stat_of(self.run1(Step::brick(Op::Fstat { file })).await)?,
            f.gfid,
        ))
    }

    async fn read(&self, session: SessionId, r: Read) -> R<ReadReply> {
        let (gfid, file, _) = self.file(session, r.fd)?;
        let steps = vec![
            Step::brick(Op::Read {
                file: file.clone(),
                offset: r.offset,
                len: r.size.get() as usize,
            }),
            Step::brick(Op::Fstat { file }),
        ];
        let mut out = self.run(steps).await.into_iter();
        let Done::Data(data) = out.next().unwrap_or(Err(Errno::IO))? else {
            return Err(Errno::IO);
        };
        let stat = stat_of(out.next().unwrap_or(Err(Errno::IO)))?;
        let data = Payload::new(data).map_err(|_| Errno::IO)?;
        Ok(ReadReply {
            data,
            iatt: iatt(&stat, gfid),
        })
    }

    async fn write(&self, session: SessionId, creds: &Creds, r: Write) -> R<AttrChange> {
        if self.shared.poisoned.load(Ordering::Relaxed) {
            return Err(Errno::IO);
        }
        let (gfid, file, writable) = self.file(session, r.fd)?;
        if !writable {
            return Err(Errno::BADF);
        }
        let data = r.data.into_bytes();
        let write = Op::Write {
            file: file.clone(),
            offset: r.offset,
            data,
        };
        let mut steps = vec![Step::caller(write, creds)];
        if self.config.write_through {
            steps.push(Step::brick(Op::Fsync {
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
        let syncs: Vec<bool> = change
            .iter()
            .map(|s| matches!(s.op, Op::Fsync { .. }))
            .collect();
        let mut steps = Vec::with_capacity(change.len() + 2);
        steps.push(Step::brick(Op::Fstat { file: file.clone() }));
        steps.extend(change);
        steps.push(Step::brick(Op::Fstat { file }));
        let mut out = self.run(steps).await.into_iter();
        let pre = stat_of(out.next().unwrap_or(Err(Errno::IO)))?;
        for sync in syncs {
            let result = out.next().unwrap_or(Err(Errno::IO));
            if sync {
                self.poison_on_fsync_error(result)?;
            } else {
                result?;
            }
        }
        let post = stat_of(out.next().unwrap_or(Err(Errno::IO)))?;
        Ok(AttrChange {
            pre: iatt(&pre, gfid),
            post: iatt(&post, gfid),
        })
    }

    async fn fsync(&self, session: SessionId, fd: FdId, datasync: bool) -> R<AttrChange> {
        let (gfid, file, _) = self.file(session, fd)?;
        let fsync = Step::brick(Op::Fsync {
            file: file.clone(),
            datasync,
        });
        self.change(gfid, file, vec![fsync]).await
    }

    /// An fsync error means acknowledged data may be gone; retrying could report success
    /// over lost pages, so the brick refuses writes until it is restarted and checked.
    fn poison_on_fsync_error<T>(&self, result: R<T>) -> R<T> {
        if let Err(e) = &result
            && !matches!(*e, Errno::BADF | Errno::INVAL | Errno::ISDIR)
        {
            self.shared.poisoned.store(true, Ordering::Relaxed);
            tracing::error!(error = %e, "fsync failed: the brick refuses writes until restart");
        }
        result
    }

    async fn fsync_plain(&self, dir: DirFd, datasync: bool) -> R<()> {
        let result = self
            .run1(Step::brick(Op::Fsync {
                file: FileRef::Fd(dir),
                datasync,
            }))
            .await
            .map(drop);
        self.poison_on_fsync_error(result)
    }

    async fn release(&self, session: SessionId, fd: FdId, dir: bool) -> R<()> {
        let open = {
            let mut sessions = lock(&self.sessions);
            let table = sessions
                .get_mut(&session)
                .and_then(Option::as_mut)
                .ok_or(Errno::BADF)?;
            match (&table.get(fd)?.kind, dir) {
                (OpenKind::Dir { .. }, false) => return Err(Errno::ISDIR),
                (OpenKind::File { .. }, true) => return Err(Errno::NOTDIR),
                _ => {
                    let open = table.remove(fd)?;
                    // The session's last fd on the file is gone: none of its lock owners can
                    // hold locks there any more (FLUSH already dropped each closing owner's).
                    if table.open_on(&open.gfid) == 0 {
                        lock(&self.shared.locks).release(session, None, &open.gfid);
                    }
                    open
                }
            }
        };
        if let OpenKind::File { file, .. } = open.kind {
            self.run1(Step::brick(Op::Close { file })).await?;
        }
        Ok(())
    }

    async fn fallocate(
        &self,
        session: SessionId,
        creds: &Creds,
        fd: FdId,
        mode: i32,
        offset: u64,
        len: u64,
    ) -> R<AttrChange> {
        let (gfid, file, writable) = self.file(session, fd)?;
        if !writable {
            return Err(Errno::BADF);
        }
        let fallocate = Op::Fallocate {
            file: file.clone(),
            mode,
            offset,
            len,
        };
        self.change(gfid, file, vec![Step::caller(fallocate, creds)])
            .await
    }

    async fn seek(&self, session: SessionId, r: Seek) -> R<SeekReply> {
        let (gfid, file, _) = self.file(session, r.fd)?;
        let fd = match file {
            FileRef::Fd(fd) => fd,
            // lseek needs a plain fd: reopen the same inode by its handle.
            _ => {
                let open = Op::Open {
                    dir: self.brick.handle_dir(&gfid).clone(),
                    name: Brick::handle_name(&gfid),
                    flags: libc::O_RDONLY | libc::O_NOFOLLOW,
                    mode: 0,
                    fixed: false,
                };
                match file_of(self.run1(Step::brick(open)).await)? {
                    FileRef::Fd(fd) => fd,
                    _ => return Err(Errno::IO),
                }
            }
        };
        let what = r.what;
        let offset = r.offset;
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

    async fn lk(&self, session: SessionId, r: Lk) -> R<LkReply> {
        let (gfid, _, _) = self.file(session, r.fd)?;
        // F_SETLKW waits in bounded slices so a lost holder cannot pin a worker forever.
        const WAIT_SLICES: u32 = 6000;
        for _ in 0..WAIT_SLICES {
            // Under the sessions guard: a waiter whose fd was released or whose session ended
            // meanwhile must not take a lock nobody would release.
            let result = {
                let sessions = lock(&self.sessions);
                let table = sessions
                    .get(&session)
                    .and_then(Option::as_ref)
                    .ok_or(Errno::BADF)?;
                table.get(r.fd)?;
                lock(&self.shared.locks).apply(session, gfid, r.cmd, &r.lock)
            };
            match (result, r.cmd) {
                (Err(Errno::AGAIN), LockCmd::SetWait) => {
                    self.exec
                        .blocking(|| std::thread::sleep(std::time::Duration::from_millis(10)))
                        .await;
                }
                (result, _) => return result.map(|lock| LkReply { lock }),
            }
        }
        Err(Errno::DEADLK)
    }

    // ---- directories ----

    async fn opendir(&self, session: SessionId, creds: &Creds, gfid: &Gfid) -> R<OpenReply> {
        let dir = self.dir(gfid).await?;
        let flags = libc::O_RDONLY | libc::O_DIRECTORY;
        let open = Op::Open {
            dir,
            name: cstr(b"."),
            flags,
            mode: 0,
            fixed: false,
        };
        let FileRef::Fd(dir) = file_of(self.run1(Step::caller(open, creds)).await)? else {
            return Err(Errno::IO);
        };
        let stream = Arc::new(Mutex::new(()));
        let fd = self.insert_open(
            session,
            OpenFile {
                gfid: *gfid,
                kind: OpenKind::Dir { dir, stream },
            },
        )?;
        Ok(OpenReply { fd })
    }

    fn dir_fd(&self, session: SessionId, fd: FdId) -> R<(Gfid, DirFd, Arc<Mutex<()>>)> {
        match self.open_file(session, fd)? {
            OpenFile {
                gfid,
                kind: OpenKind::Dir { dir, stream },
            } => Ok((gfid, dir, stream)),
            _ => Err(Errno::NOTDIR),
        }
    }

    async fn readdir(
        &self,
        session: SessionId,
        fd: FdId,
        offset: u64,
        size: u32,
    ) -> R<ReaddirReply> {
        let (gfid, dir, stream) = self.dir_fd(session, fd)?;
        let (names, eof) = self
            .exec
            .blocking(move || read_dir(&dir, &stream, gfid.is_root(), offset, size as usize, 24))
            .await?;
        let entries = names
            .into_iter()
            .filter_map(|e| {
                let name = Name::new(e.name).ok()?;
                Some(DirEntry {
                    offset: e.cookie,
                    ino: e.ino,
                    file_type: e.file_type.unwrap_or(FileType::Regular),
                    name,
                })
            })
            .collect();
        Ok(ReaddirReply { entries, eof })
    }

    async fn readdirp(
        &self,
        session: SessionId,
        fd: FdId,
        offset: u64,
        size: u32,
    ) -> R<ReaddirpReply> {
        let (gfid, dir, stream) = self.dir_fd(session, fd)?;
        let listing = dir.clone();
        let (names, eof) = self
            .exec
            .blocking(move || {
                read_dir(
                    &listing,
                    &stream,
                    gfid.is_root(),
                    offset,
                    size as usize,
                    140,
                )
            })
            .await?;
        let steps = names
            .iter()
            .map(|e| {
                Step::brick(Op::Statx {
                    dir: dir.clone(),
                    name: cstr(&e.name),
                    nofollow: true,
                })
            })
            .collect::<Vec<_>>();
        // Stat each entry on its own: one that vanished meanwhile must not cancel the rest.
        let mut entries = Vec::with_capacity(names.len());
        for (e, step) in names.into_iter().zip(steps) {
            let Ok(stat) = stat_of(self.run1(step).await) else {
                continue;
            };
            let Ok(name) = Name::new(e.name) else {
                continue;
            };
            let Ok(g) = self.gfid_at(&gfid, &dir, name.as_bytes(), &stat).await else {
                continue;
            };
            entries.push(DirEntryPlus {
                offset: e.cookie,
                name,
                iatt: iatt(&stat, g),
            });
        }
        Ok(ReaddirpReply { entries, eof })
    }

    async fn statfs(&self, gfid: &Gfid) -> R<StatfsReply> {
        let dir = self.dir_of_any(gfid).await?;
        self.exec
            .blocking(move || {
                let s = rustix::fs::fstatvfs(&dir)?;
                Ok(StatfsReply {
                    stats: FsStats {
                        bsize: s.f_bsize,
                        frsize: s.f_frsize,
                        blocks: s.f_blocks,
                        bfree: s.f_bfree,
                        bavail: s.f_bavail,
                        files: s.f_files,
                        ffree: s.f_ffree,
                        favail: s.f_favail,
                        fsid: s.f_fsid,
                        flags: s.f_flag.bits(),
                        namemax: s.f_namemax,
                    },
                })
            })
            .await
    }

    /// Any fd on the brick's file system near `gfid` (statfs needs only the file system).
    async fn dir_of_any(&self, gfid: &Gfid) -> R<DirFd> {
        self.stat_gfid(gfid).await?;
        Ok(self.brick.root.clone())
    }

    // ---- xattrs and attributes ----

    /// Names clients may read but never change: the brick's own bookkeeping.
    fn protected(name: &XattrName) -> bool {
        let n = name.as_bytes();
        n == GFID_XATTR.as_bytes()
            || n.starts_with(b"trusted.glusterfs.")
            || n.starts_with(b"trusted.kiln.")
    }

    /// The `/proc/self/fd/N/...` path an xattr call uses for `gfid`, with the directory fd
    /// it goes through: the caller moves both into the blocking job, so fd N cannot be closed
    /// and reused for another object before the call runs.
    async fn xattr_path(&self, gfid: &Gfid) -> R<(DirFd, CString)> {
        let (dir, name) = self.object_path(gfid).await?;
        let path = proc_path(&dir, &name);
        Ok((dir, path))
    }

    async fn setxattr(
        &self,
        creds: &Creds,
        gfid: &Gfid,
        set: Option<(&XattrName, &[u8], XattrSetMode)>,
    ) -> R<()> {
        let Some((name, value, mode)) = set else {
            return Ok(());
        };
        if Self::protected(name) {
            return Err(Errno::PERM);
        }
        let (dir, path) = self.xattr_path(gfid).await?;
        let (creds, name, value) = (creds.clone(), cstr(name.as_bytes()), value.to_vec());
        let flags = match mode {
            XattrSetMode::Upsert => rustix::fs::XattrFlags::empty(),
            XattrSetMode::Create => rustix::fs::XattrFlags::CREATE,
            XattrSetMode::Replace => rustix::fs::XattrFlags::REPLACE,
        };
        self.exec
            .blocking(move || {
                let _held = dir;
                let _as = crate::creds::ActAs::new(&creds)?;
                rustix::fs::lsetxattr(&*path, &*name, &value, flags)
            })
            .await
    }

    async fn removexattr(&self, creds: &Creds, gfid: &Gfid, name: &XattrName) -> R<()> {
        if Self::protected(name) {
            return Err(Errno::PERM);
        }
        let (dir, path) = self.xattr_path(gfid).await?;
        let (creds, name) = (creds.clone(), cstr(name.as_bytes()));
        self.exec
            .blocking(move || {
                let _held = dir;
                let _as = crate::creds::ActAs::new(&creds)?;
                rustix::fs::lremovexattr(&*path, &*name)
            })
            .await
    }

    async fn getxattr(&self, creds: &Creds, gfid: &Gfid, name: &XattrName) -> R<XattrReply> {
        let (dir, path) = self.xattr_path(gfid).await?;
        let (creds, name) = (creds.clone(), cstr(name.as_bytes()));
        let value = self
            .exec
            .blocking(move || {
                let _held = dir;
                let _as = crate::creds::ActAs::new(&creds)?;
                let mut buf = vec![0u8; limits::XATTR_VALUE_LEN_MAX_BYTES];
                let n = rustix::fs::lgetxattr(&*path, &*name, &mut buf[..])?;
                buf.truncate(n);
                Ok::<_, Errno>(buf)
            })
            .await?;
        Ok(XattrReply {
            value: XattrValue::new(value).map_err(|_| Errno::TOOBIG)?,
        })
    }

    async fn listxattr(&self, creds: &Creds, gfid: &Gfid) -> R<ListxattrReply> {
        let (dir, path) = self.xattr_path(gfid).await?;
        let creds = creds.clone();
        let list = self
            .exec
            .blocking(move || {
                let _held = dir;
                let _as = crate::creds::ActAs::new(&creds)?;
                let mut buf = vec![0u8; limits::XATTR_VALUE_LEN_MAX_BYTES];
                let n = rustix::fs::llistxattr(&*path, &mut buf[..])?;
                buf.truncate(n);
                Ok::<_, Errno>(buf)
            })
            .await?;
        let entries = list
            .split(|&b| b == 0)
            .filter_map(|n| XattrName::new(Bytes::copy_from_slice(n)).ok())
            .filter(|n| !Self::protected(n))
            .collect();
        Ok(ListxattrReply { entries, eof: true })
    }

    async fn setattr(&self, creds: &Creds, gfid: &Gfid, attr: SetAttr) -> R<AttrChange> {
        let pre = self.stat_gfid(gfid).await?;
        let symlink = pre.mode & libc::S_IFMT == libc::S_IFLNK;
        if symlink && (attr.mode.is_some() || attr.size.is_some()) {
            return Err(if attr.mode.is_some() {
                Errno::OPNOTSUPP
            } else {
                Errno::INVAL
            });
        }
        if pre.is_dir() && attr.size.is_some() {
            return Err(Errno::ISDIR);
        }
        let (dir, name) = self.object_path(gfid).await?;
        let creds = creds.clone();
        self.exec
            .blocking(move || apply_setattr(&creds, &dir, &name, &attr))
            .await?;
        let post = self.stat_gfid(gfid).await?;
        Ok(AttrChange {
            pre: iatt(&pre, *gfid),
            post: iatt(&post, *gfid),
        })
    }
}

/// SETATTR's system calls, as the caller, in the order that keeps explicit values: size,
/// owner (which clears set-id bits), mode, then times.
fn apply_setattr(creds: &Creds, dir: &DirFd, name: &CString, attr: &SetAttr) -> R<()> {
    let _as = crate::creds::ActAs::new(creds)?;
    // A directory is reached through its own fd (empty name), anything else through its
    // handle without following it.
    let path = proc_path(dir, name);
    let nofollow = if name.is_empty() {
        AtFlags::empty()
    } else {
        AtFlags::SYMLINK_NOFOLLOW
    };
    if let Some(size) = attr.size {
        let file = rustix::fs::open(
            &*path,
            OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
            FsMode::empty(),
        )?;
        rustix::fs::ftruncate(&file, size)?;
    }
    if attr.uid.is_some() || attr.gid.is_some() {
        let uid = attr.uid.map(rustix::process::Uid::from_raw);
        let gid = attr.gid.map(rustix::process::Gid::from_raw);
        rustix::fs::chownat(rustix::fs::CWD, &*path, uid, gid, nofollow)?;
    }
    if let Some(mode) = attr.mode {
        rustix::fs::chmod(&*path, FsMode::from_raw_mode(mode.bits()))?;
    }
    if attr.atime.is_some() || attr.mtime.is_some() {
        let ts = |t: Option<TimeSet>| match t {
            None => rustix::fs::Timespec {
                tv_sec: 0,
                tv_nsec: rustix::fs::UTIME_OMIT,
            },
            Some(TimeSet::Now) => rustix::fs::Timespec {
                tv_sec: 0,
                tv_nsec: rustix::fs::UTIME_NOW,
            },
            Some(TimeSet::At(t)) => rustix::fs::Timespec {
                tv_sec: t.sec(),
                tv_nsec: i64::from(t.nsec()),
            },
        };
        let times = rustix::fs::Timestamps {
            last_access: ts(attr.atime),
            last_modification: ts(attr.mtime),
        };
        rustix::fs::utimensat(rustix::fs::CWD, &*path, &times, nofollow)?;
    }
    Ok(())
}

/// One directory entry read by `getdents64`.
#[derive(Debug)]
pub struct RawEntry {
    pub name: Vec<u8>,
    pub ino: u64,
    pub cookie: u64,
    pub file_type: Option<FileType>,
}

/// Reads entries of `dir` from cookie `offset` until about `size` bytes of reply (each entry
/// costs its name plus `per_entry` bytes), hiding `.`, `..` and, in the root, `.glusterfs`.
/// Returns the entries and whether the end was reached.
pub fn read_dir(
    dir: &DirFd,
    stream: &Mutex<()>,
    is_root: bool,
    offset: u64,
    size: usize,
    per_entry: usize,
) -> R<(Vec<RawEntry>, bool)> {
    use std::mem::MaybeUninit;
    // The fd's position is shared: one READDIR at a time seeks and reads it.
    let _stream = lock(stream);
    rustix::fs::seek(dir, rustix::fs::SeekFrom::Start(offset))?;
    let mut buf = vec![MaybeUninit::<u8>::uninit(); 32 * 1024];
    let mut raw = rustix::fs::RawDir::new(dir.as_fd(), &mut buf);
    let mut out = Vec::new();
    let mut used = 0;
    while let Some(entry) = raw.next() {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name == b"."
            || name == b".."
            || (is_root && name == crate::brick::GLUSTERFS_DIR.as_bytes())
        {
            continue;
        }
        let cost = name.len() + per_entry;
        if used + cost > size && !out.is_empty() {
            // Stop before this entry; the caller continues from the previous cookie.
            return Ok((out, false));
        }
        used += cost;
        let file_type = match entry.file_type() {
            rustix::fs::FileType::RegularFile => Some(FileType::Regular),
            rustix::fs::FileType::Directory => Some(FileType::Directory),
            rustix::fs::FileType::Symlink => Some(FileType::Symlink),
            rustix::fs::FileType::Fifo => Some(FileType::Fifo),
            rustix::fs::FileType::Socket => Some(FileType::Socket),
            rustix::fs::FileType::CharacterDevice => Some(FileType::CharDevice),
            rustix::fs::FileType::BlockDevice => Some(FileType::BlockDevice),
            _ => None,
        };
        out.push(RawEntry {
            name: name.to_vec(),
            ino: entry.ino(),
            cookie: entry.next_entry_cookie(),
            file_type,
        });
    }
    Ok((out, true))
}

// ---- handle resolution (blocking helpers) ----

/// Reads `trusted.gfid` of the object at `path` (not following a final symlink).
pub fn read_gfid(path: &CString) -> R<Option<Gfid>> {
    let mut buf = [0u8; 16];
    match rustix::fs::lgetxattr(&**path, GFID_XATTR, &mut buf[..]) {
        Ok(16) => Ok(Gfid::from_bytes(buf)),
        Ok(_) | Err(Errno::NODATA) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Symlink nesting the kernel follows before ELOOP; deeper directories resolve one level at a
/// time through their parents.
const RESOLVE_DEPTH_MAX: usize = 4096;

/// Opens directory `gfid` by its handle: `openat2` beneath the brick root with no magic links
/// (nothing can escape the brick), then checks the directory really carries `gfid`.
pub fn open_dir_by_gfid(brick: &Brick, gfid: &Gfid, depth: usize) -> R<DirFd> {
    if gfid.is_root() {
        return Ok(brick.root.clone());
    }
    if depth > RESOLVE_DEPTH_MAX {
        return Err(Errno::LOOP);
    }
    let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
    let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS;
    // RESOLVE_BENEATH answers EAGAIN when a rename anywhere raced with the walk through the
    // handle's `..` components; retry a few times, then walk one level at a time.
    const RACED_RETRIES: usize = 8;
    let mut attempt = 0;
    let fd = loop {
        match rustix::fs::openat2(
            &brick.root,
            Brick::handle_path(gfid),
            flags,
            FsMode::empty(),
            resolve,
        ) {
            Ok(fd) => break fd,
            Err(Errno::NOENT) => return Err(not_a_dir_or_stale(brick, gfid)),
            // A user's symlink pointing out of the brick (refused by RESOLVE_BENEATH) or at a
            // non-directory.
            Err(Errno::XDEV | Errno::NOTDIR) => return Err(not_a_dir_or_stale(brick, gfid)),
            Err(Errno::AGAIN) if attempt < RACED_RETRIES => attempt += 1,
            // Deeper than the kernel's symlink limit, or renames keep racing: resolve the
            // parent, then one name.
            Err(Errno::LOOP | Errno::AGAIN) => match open_through_parent(brick, gfid, depth) {
                Ok(fd) => break fd,
                Err(Errno::NOENT) => return Err(not_a_dir_or_stale(brick, gfid)),
                Err(e) => return Err(e),
            },
            Err(e) => return Err(e),
        }
    };
    let dir = Arc::new(fd);
    match read_gfid(&proc_path(&dir, c""))? {
        Some(found) if found == *gfid => Ok(dir),
        _ => Err(not_a_dir_or_stale(brick, gfid)),
    }
}

/// Opens directory `gfid` as `<its parent>/<its name>`, read from its handle symlink.
fn open_through_parent(brick: &Brick, gfid: &Gfid, depth: usize) -> R<std::os::fd::OwnedFd> {
    let handle = Brick::handle_name(gfid);
    // Only a handle the brick made (a symlink without a GFID of its own) names a parent and a
    // name; a user's symlink carries its own GFID and text the client chose.
    if read_gfid(&proc_path(brick.handle_dir(gfid), &handle))? == Some(*gfid) {
        return Err(Errno::NOTDIR);
    }
    let target = rustix::fs::readlinkat(brick.handle_dir(gfid), &*handle, Vec::new())?;
    let (parent, name) = Brick::parse_dir_handle_target(target.as_bytes()).ok_or(Errno::STALE)?;
    if Name::new(name.clone()).is_err() {
        return Err(Errno::STALE);
    }
    let parent = open_dir_by_gfid(brick, &parent, depth + 1)?;
    let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW;
    rustix::fs::openat(&parent, cstr(&name).as_c_str(), flags, FsMode::empty())
}

/// Why `gfid` did not resolve to a directory: ENOTDIR when its handle is the object itself (a
/// file or a user's symlink, which carries the GFID), ESTALE when there is no such object.
fn not_a_dir_or_stale(brick: &Brick, gfid: &Gfid) -> Errno {
    let handle = Brick::handle_name(gfid);
    match rustix::fs::statx(
        brick.handle_dir(gfid),
        &*handle,
        AtFlags::SYMLINK_NOFOLLOW,
        rustix::fs::StatxFlags::TYPE,
    ) {
        Ok(st) if u32::from(st.stx_mode) & libc::S_IFMT != libc::S_IFLNK => Errno::NOTDIR,
        Ok(_) if read_gfid(&proc_path(brick.handle_dir(gfid), &handle)) == Ok(Some(*gfid)) => {
            Errno::NOTDIR
        }
        _ => Errno::STALE,
    }
}

/// Reads the GFID of `dir/name`; an object without one gets a new GFID and handle (it was put
/// into the brick behind Kiln's back), and a missing handle is made again.
pub fn read_or_heal_gfid(
    brick: &Brick,
    parent: &Gfid,
    dir: &DirFd,
    name: &CString,
    is_dir: bool,
) -> R<Gfid> {
    let path = proc_path(dir, name);
    let gfid = match read_gfid(&path)? {
        Some(g) => g,
        // Being created right now: its GFID is on the way; the name does not exist yet.
        None if crate::recovery::create_in_flight(brick, parent, name.as_bytes())? => {
            return Err(Errno::NOENT);
        }
        None => {
            let g = Gfid::from_bytes(crate::brick::random_uuid_bytes()).ok_or(Errno::IO)?;
            match rustix::fs::lsetxattr(
                &*path,
                GFID_XATTR,
                g.as_bytes(),
                rustix::fs::XattrFlags::CREATE,
            ) {
                Ok(()) => {}
                // Another fop assigned one first: use it.
                Err(Errno::EXIST) => return read_gfid(&path)?.ok_or(Errno::IO),
                Err(e) => return Err(e),
            }
            tracing::info!(gfid = %g, "assigned a gfid to an object that had none");
            g
        }
    };
    brick.ensure_handle_parent(&gfid)?;
    let handle = Brick::handle_name(&gfid);
    match rustix::fs::statx(
        brick.handle_dir(&gfid),
        &*handle,
        AtFlags::SYMLINK_NOFOLLOW,
        rustix::fs::StatxFlags::TYPE,
    ) {
        Ok(_) => {}
        Err(Errno::NOENT) => {
            let made = match is_dir {
                true => rustix::fs::symlinkat(
                    cstr(&Brick::dir_handle_target(parent, name.as_bytes())).as_c_str(),
                    brick.handle_dir(&gfid),
                    &*handle,
                ),
                false => rustix::fs::linkat(
                    dir,
                    &**name,
                    brick.handle_dir(&gfid),
                    &*handle,
                    AtFlags::empty(),
                ),
            };
            match made {
                Ok(()) | Err(Errno::EXIST) => tracing::info!(%gfid, "re-made a missing handle"),
                Err(e) => return Err(e),
            }
        }
        Err(e) => return Err(e),
    }
    Ok(gfid)
}
