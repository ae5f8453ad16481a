//! Fop semantics, written once for every executor: each fop resolves its GFIDs to held
//! directory fds ([`resolve`]), builds a [`chain::Chain`] of single-name steps, runs it, and
//! turns the results into the reply a local Linux file system would give, errno included.
//!
//! One module per family: [`attr`] (lookup, stat, access, readlink, setattr, statfs),
//! [`namespace`] (create, mkdir, mknod, symlink, put, link, unlink, rmdir, rename — with the
//! intent protocol of `docs/disk-layout.md`), [`files`] (open, read, write, fsync, fallocate,
//! seek, locks, release), [`dirs`] (opendir, readdir, readdirp), [`xattr`] and [`lease`]
//! (LEASE; the lease check around every fop is [`Fops::call_with`], which also has the fops
//! that change a name take turns on it: [`name_turns`]).

mod attr;
mod chain;
mod dirs;
mod files;
mod lease;
mod moving_dirs;
mod name_turns;
mod namespace;
mod resolve;
mod xattr;

use std::collections::{BTreeMap, HashMap};
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use kiln_wire::*;
use rustix::io::Errno;

use self::chain::{Chain, FromDone, Results};
use self::lease::Removed;
use self::moving_dirs::MovingDirs;
use self::name_turns::NameTurns;
pub(crate) use self::namespace::spawn_dir_record_sweeper;
use self::resolve::Named;
use crate::brick::Brick;
use crate::cache::{CacheState, DirCache, GfidCache};
use crate::exec::Exec;
use crate::fdtable::{FdTable, OpenKind, SessionId};
use crate::leases::{self, Access, LeaseSettings, Leases, Refused, Targets};
use crate::locks::LockTable;
use crate::op::{FileRef, Stat, Step, StepResult};
use crate::profile::{self, Profile};

/// Sizes of the tables of one set of fops, in entries.
#[derive(Debug, Clone)]
pub struct FopsConfig {
    /// inode → GFID entries (`network.inode-lru-limit`), per worker.
    pub gfid_cache_entries: NonZeroUsize,
    /// Directory fds held open (`storage.dirfd-cache-entries`), for the whole brick.
    pub dirfd_cache_entries: NonZeroUsize,
    pub open_files_per_client_max: usize,
    /// POSIX lock ranges one session may hold; ENOLCK past it.
    pub locks_per_client_max: usize,
    /// `storage.fsync-policy write-through`: every WRITE and PUT is synced (`fdatasync`, in
    /// the same chain) before it is acknowledged.
    pub write_through: bool,
    /// `features.leases*`: the brick's directory leases (shared by every worker).
    pub leases: LeaseSettings,
}

impl Default for FopsConfig {
    fn default() -> Self {
        FopsConfig {
            gfid_cache_entries: NonZeroUsize::new(1 << 20).unwrap_or(NonZeroUsize::MIN),
            dirfd_cache_entries: NonZeroUsize::new(4096).unwrap_or(NonZeroUsize::MIN),
            open_files_per_client_max: 16_384,
            locks_per_client_max: 4096,
            write_through: false,
            leases: LeaseSettings::default(),
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

/// The fop implementation over one executor: one per ring worker, or one for the whole
/// blocking engine.
#[derive(Debug)]
pub struct Fops<E> {
    brick: Arc<Brick>,
    exec: E,
    config: FopsConfig,
    gfids: Mutex<GfidCache>,
    /// Each open session. A session is opened explicitly and removed when it ends, so a fop
    /// still in flight for an ended session cannot open a file for it that nobody would ever
    /// release (it gets EBADF), and nothing is left behind.
    sessions: Mutex<HashMap<SessionId, OpenSession>>,
    shared: Arc<BrickState>,
    /// This worker's count of fops that passed the lease gate unchecked.
    lease_slot: Arc<leases::Slot>,
    crash_point: Mutex<Option<CrashPoint>>,
}

/// A session open on one [`Fops`]: its fds, and what its replies carry.
#[derive(Debug)]
struct OpenSession {
    fds: FdTable,
    parent_attrs: ParentAttrs,
}

/// Whether a session's namespace replies (CREATE, MKDIR, MKNOD, SYMLINK, PUT, LINK, UNLINK,
/// RMDIR, RENAME) carry their parent directories' attributes before and after the fop: an
/// `fstat` of each parent before and after, which a client that never reads them turns off
/// (capability `NO_PARENT_ATTRS`; the replies then carry [`Iatt::omitted_dir`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParentAttrs {
    Stat,
    Omit,
}

/// What every worker of a brick shares: the profile, session ids, POSIX locks (clients on
/// different workers contend for the same files), directory leases, the GFIDs with a
/// removal of a name under way, and the poisoned flag.
#[derive(Debug)]
pub struct BrickState {
    /// Per-fop counters and histograms (`diagnostics.*`).
    pub profile: Profile,
    next_session: AtomicU64,
    locks: Mutex<LockTable>,
    /// The turns namespace fops take on the names they change.
    name_turns: NameTurns,
    /// Directories a RENAME is moving (their handles being replaced).
    moving_dirs: MovingDirs,
    /// Held directory fds by GFID, one cache for every worker: a directory removed through
    /// one worker is gone from all (a worker's own cache kept serving it).
    dirs: Mutex<DirCache>,
    /// Directory leases and the gate every fop passes.
    pub leases: Leases,
    /// GFIDs with removals of names under way or waiting (their handles may be gone or parked
    /// in records, and may come back), each with the turn its removals take one at a time and
    /// how many there are: a create must not take such a GFID meanwhile (two objects, one
    /// GFID).
    removals: Mutex<HashMap<Gfid, (RemovalTurn, u32)>>,
    /// Directories where files are being created or unlinked, with their `dir` records.
    dir_records: Mutex<HashMap<Gfid, namespace::DirRecord>>,
    /// Set by an fsync error: data may be lost, so writes are refused until restart.
    poisoned: AtomicBool,
}

impl BrickState {
    /// Shared state for a brick with the limits and lease settings of `config`.
    pub fn new(config: &FopsConfig) -> BrickState {
        BrickState {
            profile: Profile::default(),
            next_session: AtomicU64::new(1),
            locks: Mutex::new(LockTable::new(config.locks_per_client_max)),
            name_turns: NameTurns::new(),
            moving_dirs: MovingDirs::default(),
            dirs: Mutex::new(DirCache::new(config.dirfd_cache_entries)),
            leases: Leases::new(config.leases),
            removals: Mutex::new(HashMap::new()),
            dir_records: Mutex::new(HashMap::new()),
            poisoned: AtomicBool::new(false),
        }
    }

    /// The held directory fds' cache (brick-wide), for state dumps.
    pub fn dirfd_cache_state(&self) -> CacheState {
        lock(&self.dirs).state()
    }

    /// A new session id, unique on this brick.
    pub fn new_session_id(&self) -> SessionId {
        self.next_session.fetch_add(1, Ordering::Relaxed)
    }

    /// Waits until no other removal of a name of `gfid` is under way, then marks one as
    /// under way until the guard goes: removals of one object's names run one at a time, each
    /// seeing the link count the one before left.
    async fn removing(&self, gfid: Gfid) -> Removing<'_> {
        let turn = {
            let mut removals = lock(&self.removals);
            let (turn, counted) = removals.entry(gfid).or_default();
            *counted += 1;
            turn.clone()
        };
        let counted = Counted { state: self, gfid };
        Removing {
            _turn: turn.lock_owned().await,
            _counted: counted,
        }
    }

    /// Whether a removal of a name of `gfid` is under way or waiting.
    fn is_being_removed(&self, gfid: &Gfid) -> bool {
        lock(&self.removals).contains_key(gfid)
    }
}

/// The turn removals of one object's names take.
type RemovalTurn = Arc<tokio::sync::Mutex<()>>;

/// A removal's turn on its object (see [`BrickState::removing`]): the turn is released
/// before the count (fields drop in order).
#[derive(Debug)]
struct Removing<'a> {
    _turn: tokio::sync::OwnedMutexGuard<()>,
    _counted: Counted<'a>,
}

/// One removal of `gfid` counted as under way or waiting, for as long as this lives (also
/// when the fop is dropped while it waits for its turn).
#[derive(Debug)]
struct Counted<'a> {
    state: &'a BrickState,
    gfid: Gfid,
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        let mut removals = lock(&self.state.removals);
        if let Some((_, counted)) = removals.get_mut(&self.gfid) {
            *counted -= 1;
            if *counted == 0 {
                removals.remove(&self.gfid);
            }
        }
    }
}

/// The sessions and caches of one [`Fops`], for state dumps.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FopsState {
    /// Open fds of each session, by session id.
    pub fd_tables: BTreeMap<SessionId, usize>,
    pub gfid_cache: CacheState,
}

type R<T> = Result<T, Errno>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means another fop panicked; the tables stay consistent because
    // every update is a single insert or remove.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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

impl<E: Exec> Fops<E> {
    pub fn new(brick: Arc<Brick>, shared: Arc<BrickState>, exec: E, config: FopsConfig) -> Fops<E> {
        Fops {
            gfids: Mutex::new(GfidCache::new(config.gfid_cache_entries)),
            sessions: Mutex::new(HashMap::new()),
            lease_slot: shared.leases.slot(),
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

    /// The brick's leases (shared by every worker).
    pub fn leases(&self) -> &Leases {
        &self.shared.leases
    }

    /// Arms (or clears) the crash hook; for crash-injection tests.
    pub fn set_crash_point(&self, point: Option<CrashPoint>) {
        *lock(&self.crash_point) = point;
    }

    /// Sessions, fd tables and caches.
    pub fn state(&self) -> FopsState {
        let fd_tables = lock(&self.sessions)
            .iter()
            .map(|(&id, session)| (id, session.fds.len()))
            .collect();
        FopsState {
            fd_tables,
            gfid_cache: lock(&self.gfids).state(),
        }
    }

    /// Opens a new session here and returns its id.
    pub fn open_new_session(&self, parent_attrs: ParentAttrs) -> SessionId {
        let id = self.shared.new_session_id();
        self.open_session(id, parent_attrs);
        id
    }

    /// Opens session `session` here: fops of it may open files from now on.
    pub fn open_session(&self, session: SessionId, parent_attrs: ParentAttrs) {
        let open = OpenSession {
            fds: FdTable::new(self.config.open_files_per_client_max),
            parent_attrs,
        };
        let replaced = lock(&self.sessions).insert(session, open);
        debug_assert!(replaced.is_none(), "session {session} opened twice");
    }

    /// What `session`'s namespace replies carry (all of it for a session not open here).
    fn parent_attrs(&self, session: SessionId) -> ParentAttrs {
        lock(&self.sessions)
            .get(&session)
            .map_or(ParentAttrs::Stat, |open| open.parent_attrs)
    }

    /// Ends a session: its fds are released, its locks and leases dropped. Returns the files
    /// the caller must close through the executor (direct descriptors).
    pub fn end_session(&self, session: SessionId) -> Vec<FileRef> {
        self.shared.leases.end_session(session);
        // Under the sessions guard (lock order: sessions, then locks), so no LK can slip a lock
        // in between the removal and the release.
        let mut sessions = lock(&self.sessions);
        let ended = sessions.remove(&session);
        let mut locks = lock(&self.shared.locks);
        locks.cancel_waits(session);
        locks.release_session(session);
        drop(locks);
        drop(sessions);
        let Some(mut ended) = ended else {
            return Vec::new();
        };
        ended
            .fds
            .drain()
            .into_iter()
            .filter_map(|f| match f.kind {
                OpenKind::File { file, .. } => Some(file),
                OpenKind::Dir { .. } => None,
            })
            .collect()
    }

    /// Executes one fop for `session` as `creds` once no other session's lease is in its way,
    /// recorded in the brick's profile.
    pub async fn call(&self, session: SessionId, creds: &Creds, fop: FopRequest) -> R<FopReply> {
        self.call_with(session, fop, |fop| self.call_measured(session, creds, fop))
            .await
    }

    /// The lease check around one fop of `session`, which `run` executes (and measures): the
    /// ring runs it here, the blocking engine on its pool. While no lease is held anywhere the
    /// check is the gate's counter ([`Leases::enter`]); otherwise the fop waits, holding no
    /// thread, until the leases it conflicts with are back ([`Leases::admit`]). LEASE has its
    /// own rules, and LK (which may wait for a lock without bound) is checked but never holds
    /// a grant off.
    pub async fn call_with<F: Future<Output = R<FopReply>>>(
        &self,
        session: SessionId,
        mut fop: FopRequest,
        run: impl FnOnce(FopRequest) -> F,
    ) -> R<FopReply> {
        let leases = &self.shared.leases;
        if let FopRequest::OpendirList(r) = &mut fop {
            // Its lease first, as LEASE takes one (under no fop of its own), so that the
            // entries it reads are read under it; the request carries on what was granted.
            r.lease = self.lease_before_listing(session, r.gfid, r.lease).await;
        }
        let register = match fop {
            FopRequest::Lease(_) => return run(fop).await,
            FopRequest::Lk(_) if !leases.is_armed() => return run(fop).await,
            FopRequest::Lk(_) => false,
            _ => true,
        };
        if register && let Some(_unchecked) = leases.enter(&self.lease_slot) {
            let _turn = self.shared.name_turns.take(&fop).await;
            return run(fop).await;
        }
        // Removals look their object up only when the check asks for it (`Refused::Unresolved`).
        let mut objects = false;
        let admitted = loop {
            let targets = self.lease_targets(session, &fop, objects).await;
            match leases.admit(session, targets, register).await {
                Ok(admitted) => break admitted,
                Err(Refused::Stale) => return self.refused(fop.code(), Errno::STALE).await,
                // Another session took a lease since: targets with the object looked up.
                Err(Refused::Unresolved) => objects = true,
            }
        };
        let turn = self.shared.name_turns.take(&fop).await;
        let result = run(fop).await;
        drop(turn);
        admitted.finish(result.is_ok());
        result
    }

    /// The directories `fop` touches: its fd's object, and what it would remove (looked up
    /// as the brick): a directory, or — when `objects` — another object, whose link count
    /// it changes; and, when `objects`, the files a RENAME moves. Without `objects` an UNLINK
    /// looks nothing up and a replacing RENAME only whether its target is a directory: the
    /// targets are then unresolved.
    async fn lease_targets(&self, session: SessionId, fop: &FopRequest, objects: bool) -> Targets {
        let touches = leases::touches(fop);
        let mut dirs = touches.dirs;
        if let Some((fd, access)) = touches.fd
            && let Ok(file) = self.open_file(session, fd)
        {
            dirs.push((file.gfid, access));
        }
        // A moved directory's one name is in a parent the fop changes already.
        let moved = if objects { &touches.moves[..] } else { &[] };
        for (parent, name) in moved {
            if let Removed::Object(gfid) = self.removed_at(parent, name, true).await {
                dirs.push((gfid, Access::Change));
            }
        }
        let removes = touches.removes.as_ref();
        let targets = self.removal_targets(fop, dirs, removes, objects).await;
        match touches.moves.is_empty() || objects {
            true => targets,
            false => targets.unresolved(),
        }
    }

    /// `dirs`, and what the fop would remove at `removes`, as [`Fops::lease_targets`] says.
    async fn removal_targets(
        &self,
        fop: &FopRequest,
        mut dirs: Vec<(Gfid, Access)>,
        removes: Option<&(Gfid, Name)>,
        objects: bool,
    ) -> Targets {
        let Some((parent, name)) = removes else {
            return Targets::new(dirs, None);
        };
        let never_a_dir = matches!(fop, FopRequest::Unlink(_) | FopRequest::UnlinkSettled(_));
        let removed = match never_a_dir && !objects {
            true => Removed::Unresolved,
            false => self.removed_at(parent, name, objects).await,
        };
        match removed {
            Removed::Dir(gfid) => Targets::new(dirs, Some(gfid)),
            Removed::Object(gfid) => {
                dirs.push((gfid, Access::Change));
                Targets::new(dirs, None)
            }
            Removed::Unresolved => Targets::new(dirs, None).unresolved(),
            Removed::Nothing => Targets::new(dirs, None),
        }
    }

    /// A fop the lease check refused, counted in the profile as the fop's error.
    async fn refused(&self, code: FopCode, e: Errno) -> R<FopReply> {
        let profile = &self.shared.profile;
        match profile.is_on() {
            true => profile.measure(code, 0, async { Err(e) }).await,
            false => Err(e),
        }
    }

    /// Executes one fop for `session` as `creds` (no lease check), recorded in the brick's
    /// profile.
    pub async fn call_measured(
        &self,
        session: SessionId,
        creds: &Creds,
        fop: FopRequest,
    ) -> R<FopReply> {
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
            Q::LookupXattrs(r) => {
                A::LookupXattrs(self.lookup_xattrs(creds, &r.parent, &r.name).await?)
            }
            Q::Stat(r) => A::Stat(self.stat(&r.gfid).await?),
            Q::Access(r) => A::Access(self.access(creds, &r.gfid, r.mask).await?),
            Q::Readlink(r) => A::Readlink(self.readlink(&r.gfid).await?),
            Q::Statfs(r) => A::Statfs(self.statfs(&r.gfid).await?),
            Q::Setattr(r) => A::Setattr(self.setattr(creds, Named::Gfid(&r.gfid), r.attr).await?),
            Q::Truncate(r) => A::Truncate(self.truncate(creds, &r.gfid, r.size).await?),
            Q::Mknod(r) => A::Mknod(self.mknod(creds, r, self.parent_attrs(session)).await?),
            Q::Mkdir(r) => A::Mkdir(self.mkdir(creds, r, self.parent_attrs(session)).await?),
            Q::Symlink(r) => A::Symlink(self.symlink(creds, r, self.parent_attrs(session)).await?),
            Q::Create(r) => A::Create(self.create(session, creds, r).await?),
            Q::Put(r) => {
                let parents = self.parent_attrs(session);
                A::Put(self.put(creds, r, parents, false).await?)
            }
            Q::PutSynced(r) => {
                let parents = self.parent_attrs(session);
                A::PutSynced(self.put(creds, r.put, parents, true).await?)
            }
            Q::Unlink(r) => {
                let parents = self.parent_attrs(session);
                A::Unlink(self.unlink(creds, &r.parent, &r.name, parents).await?)
            }
            Q::UnlinkSettled(r) => {
                let parents = self.parent_attrs(session);
                A::UnlinkSettled(
                    self.unlink_settled(creds, &r.parent, &r.name, parents)
                        .await?,
                )
            }
            Q::Rmdir(r) => {
                let parents = self.parent_attrs(session);
                A::Rmdir(self.rmdir(creds, &r.parent, &r.name, parents).await?)
            }
            Q::Rename(r) => A::Rename(self.rename(creds, r, self.parent_attrs(session)).await?),
            Q::Link(r) => A::Link(self.link(creds, r, self.parent_attrs(session)).await?),
            Q::Setxattr(r) => {
                let object = Named::Gfid(&r.gfid);
                let (value, mode) = (r.value.as_bytes(), r.mode);
                A::Setxattr(self.setxattr(creds, object, &r.name, value, mode).await?)
            }
            Q::Removexattr(r) => A::Removexattr(
                self.removexattr(creds, Named::Gfid(&r.gfid), &r.name)
                    .await?,
            ),
            Q::Getxattr(r) => {
                A::Getxattr(self.getxattr(creds, Named::Gfid(&r.gfid), &r.name).await?)
            }
            Q::Listxattr(r) => A::Listxattr(self.listxattr(creds, Named::Gfid(&r.gfid)).await?),
            Q::Open(r) => A::Open(
                self.open(session, creds, &r.gfid, r.access, r.flags)
                    .await?,
            ),
            Q::Opendir(r) => A::Opendir(self.opendir(session, creds, &r.gfid).await?),
            Q::OpendirList(r) => A::OpendirList(self.opendir_list(session, creds, r).await?),
            Q::Get(r) => A::Get(self.get(creds, r).await?),
            Q::Lease(r) => A::Lease(self.lease(session, r).await?),
            fd_fop => self.execute_on_fd(session, creds, fd_fop).await?,
        })
    }

    /// The fops that name an open fd of the session.
    async fn execute_on_fd(&self, s: SessionId, creds: &Creds, fop: FopRequest) -> R<FopReply> {
        use FopReply as A;
        use FopRequest as Q;
        Ok(match fop {
            Q::Fstat(r) => A::Fstat(self.fstat(s, r.fd).await?),
            Q::Read(r) => A::Read(self.read(s, r).await?),
            Q::Write(r) => A::Write(self.write(s, creds, r).await?),
            Q::Flush(r) => A::Flush(self.flush(s, r.fd, r.lock_owner)?),
            Q::Fsync(r) => A::Fsync(self.fsync(s, r.fd, r.datasync).await?),
            Q::Release(r) => A::Release(self.release(s, r.fd, false).await?),
            Q::Readdir(r) => A::Readdir(self.readdir(s, r.fd, r.offset, r.size.get()).await?),
            Q::Readdirp(r) => A::Readdirp(
                self.readdirp(s, creds, r.fd, r.offset, r.size.get())
                    .await?,
            ),
            Q::ReaddirpXattrs(r) => A::ReaddirpXattrs(
                self.readdirp_xattrs(s, creds, r.fd, r.offset, r.size.get())
                    .await?,
            ),
            Q::Releasedir(r) => A::Releasedir(self.release(s, r.fd, true).await?),
            Q::Fsyncdir(r) => A::Fsyncdir(self.fsyncdir(s, r.fd, r.datasync).await?),
            Q::Fsetxattr(r) => {
                let open = self.open_file(s, r.fd)?;
                let (value, mode) = (r.value.as_bytes(), r.mode);
                let set = self.setxattr(creds, Named::Open(&open), &r.name, value, mode);
                A::Fsetxattr(set.await?)
            }
            Q::Fgetxattr(r) => {
                let open = self.open_file(s, r.fd)?;
                A::Fgetxattr(self.getxattr(creds, Named::Open(&open), &r.name).await?)
            }
            Q::Fremovexattr(r) => {
                let open = self.open_file(s, r.fd)?;
                A::Fremovexattr(self.removexattr(creds, Named::Open(&open), &r.name).await?)
            }
            Q::Fsetattr(r) => {
                let open = self.open_file(s, r.fd)?;
                A::Fsetattr(self.setattr(creds, Named::Open(&open), r.attr).await?)
            }
            Q::Ftruncate(r) => A::Ftruncate(self.ftruncate(s, creds, r.fd, r.size).await?),
            Q::Fallocate(r) => A::Fallocate(self.fallocate(s, creds, r.fd, r.into()).await?),
            Q::Discard(r) => A::Discard(self.fallocate(s, creds, r.fd, r.into()).await?),
            Q::Zerofill(r) => A::Zerofill(self.fallocate(s, creds, r.fd, r.into()).await?),
            Q::Seek(r) => A::Seek(self.seek(s, r).await?),
            Q::Lk(r) => A::Lk(self.lk(s, r).await?),
            other => {
                return Err(crate::op::invariant(&format!(
                    "{:?} is no fd fop",
                    other.code()
                )));
            }
        })
    }

    // ---- running chains ----

    /// Runs a chain; its results are read back by the handles [`Chain::push`] gave.
    async fn run(&self, chain: Chain) -> Results {
        let steps = chain.len();
        profile::charge(|c| c.steps += steps as u64);
        Results::new(self.exec.run(chain.into_steps()).await, steps)
    }

    /// Runs one step.
    async fn run1(&self, step: Step) -> StepResult {
        profile::charge(|c| c.steps += 1);
        let mut results = self.exec.run(vec![step]).await;
        debug_assert_eq!(results.len(), 1, "an executor lost a result");
        results
            .pop()
            .unwrap_or_else(|| Err(crate::op::invariant("an executor lost a result")))
    }

    /// Runs one step and reads its result as a `T`.
    async fn run_one<T: FromDone>(&self, step: Step) -> R<T> {
        let mut chain = Chain::new();
        let at = chain.push::<T>(step);
        self.run(chain).await.take(at)
    }
}
