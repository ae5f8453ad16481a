//! The engine: executes fops for client sessions on the brick's [`Workers`].
//!
//! * `uring`: one worker per core by default, each with its own ring, fops, fd tables and
//!   caches (the GFID and directory-fd cache limits are per worker); a session is pinned to one
//!   worker. Many fops of a session are in flight at once, each a task on its worker.
//! * `blocking`: a pool of threads making ordinary syscalls, sharing one set of tables. It is
//!   the reference the ring is measured against and the fallback where io_uring is disabled.
//!   Its one worker thread runs the network; fops go to the pool.
//!
//! Code on a worker thread (the QUIC server's connections) calls fops through that worker's
//! [`LocalEngine`] with no channel and no thread switch ([`Engine::run_on_worker`]); callers on
//! other threads use a [`Session`].

use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::Arc;

use kiln_admin::options::{BrickSettings, FsyncPolicy, ServerEngine};
use kiln_wire::{Batch, BatchReply, Creds, ErrorCode, FopReply, FopRequest};
use tokio::sync::oneshot;

use crate::brick::Brick;
use crate::cache::CacheState;
use crate::exec::blocking::BlockingExec;
use crate::exec::pool::BlockingPool;
use crate::exec::uring::{RingConfig, RingStats, UringExec};
use crate::fdtable::SessionId;
use crate::fops::{BrickState, CrashPoint, Fops, FopsConfig, FopsState, ParentAttrs};
use crate::leases::{LeaseSettings, LeaseStats, Leases, RecallEvents};
use crate::op::{self, Step};
use crate::profile::Profile;
use crate::workers::Workers;

/// Which executor runs the fops (`server.engine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    Uring,
    Blocking,
}

impl EngineKind {
    /// The `server.engine` value: `uring` or `blocking`.
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Uring => "uring",
            EngineKind::Blocking => "blocking",
        }
    }
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub kind: EngineKind,
    /// Threads (`server.event-threads`): ring workers, or the blocking engine's pool; the
    /// default is one per core.
    pub workers: usize,
    /// Requests queued per worker before callers wait (backpressure, not an unbounded queue).
    pub queue_max: usize,
    pub fops: FopsConfig,
    pub ring: RingConfig,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            kind: EngineKind::Uring,
            workers: std::thread::available_parallelism().map_or(1, usize::from),
            queue_max: 4096,
            fops: FopsConfig::default(),
            ring: RingConfig::default(),
        }
    }
}

/// The engine as the brick options say: the one mapping from the option table's typed
/// settings to an engine, for `kiln-brickd` and for the benches that start bricks themselves.
impl From<&BrickSettings> for EngineConfig {
    fn from(settings: &BrickSettings) -> EngineConfig {
        let mut config = EngineConfig {
            kind: match settings.engine {
                ServerEngine::Uring => EngineKind::Uring,
                ServerEngine::Blocking => EngineKind::Blocking,
            },
            ..EngineConfig::default()
        };
        if let Some(workers) = settings.workers {
            config.workers = workers.get();
        }
        config.fops.gfid_cache_entries = settings.gfid_cache_entries;
        config.fops.dirfd_cache_entries = settings.dirfd_cache_entries;
        config.fops.write_through = settings.fsync_policy == FsyncPolicy::WriteThrough;
        config.fops.open_files_per_client_max = settings.open_files_per_client_max;
        config.fops.locks_per_client_max = settings.locks_per_client_max;
        config.fops.leases = LeaseSettings::from(settings);
        config.ring.ring_entries = settings.ring_entries;
        config
    }
}

/// The engine as seen from inside one worker thread: fops are called directly, with no
/// channel and no thread switch on the io_uring engine (the blocking engine hands each fop
/// to its pool).
#[derive(Debug, Clone)]
pub enum LocalEngine {
    Ring(Rc<Fops<UringExec>>),
    Blocking(BlockingEngine),
}

/// The blocking engine's shared fops and the pool that runs them.
#[derive(Debug, Clone)]
pub struct BlockingEngine {
    fops: Arc<Fops<BlockingExec>>,
    pool: BlockingPool,
}

impl LocalEngine {
    /// Opens a new session on this worker, its namespace replies carrying `parents`; end it
    /// with [`LocalEngine::end_session`].
    pub fn open_session(&self, parents: ParentAttrs) -> SessionId {
        match self {
            LocalEngine::Ring(fops) => fops.open_new_session(parents),
            LocalEngine::Blocking(engine) => engine.fops.open_new_session(parents),
        }
    }

    /// The brick's leases: sessions that negotiated them are attached here.
    pub fn leases(&self) -> &Leases {
        match self {
            LocalEngine::Ring(fops) => fops.leases(),
            LocalEngine::Blocking(engine) => engine.fops.leases(),
        }
    }

    /// Executes a BATCH for `session`: each fop in order, as if sent alone with the batch's
    /// credentials (lease checks included); a failed one does not stop the rest. ENOTSUP for
    /// a session that did not negotiate leases.
    pub async fn batch(&self, session: SessionId, batch: Batch) -> Result<BatchReply, ErrorCode> {
        if !self.leases().is_attached(session) {
            return Err(ErrorCode::NotSupported);
        }
        let creds = batch.creds.clone();
        let mut results = Vec::with_capacity(batch.len());
        for fop in batch.into_fops() {
            results.push(self.call(session, &creds, fop).await);
        }
        Ok(BatchReply { results })
    }

    /// Executes one fop for `session` (from [`LocalEngine::open_session`]) as `creds`.
    pub async fn call(
        &self,
        session: SessionId,
        creds: &Creds,
        fop: FopRequest,
    ) -> Result<FopReply, ErrorCode> {
        match self {
            LocalEngine::Ring(fops) => fops.call(session, creds, fop).await.map_err(to_code),
            LocalEngine::Blocking(engine) => engine.call(session, creds.clone(), fop).await,
        }
    }

    /// Stops the session's lock waits (EINTR): its connection is gone, so nothing may keep it
    /// from ending.
    pub fn cancel_lock_waits(&self, session: SessionId) {
        match self {
            LocalEngine::Ring(fops) => fops.cancel_lock_waits(session),
            LocalEngine::Blocking(engine) => engine.fops.cancel_lock_waits(session),
        }
    }

    /// Ends a session: closes its files and drops its locks.
    pub async fn end_session(&self, session: SessionId) {
        match self {
            LocalEngine::Ring(fops) => {
                for file in fops.end_session(session) {
                    let close = Step::brick(op::Close { file });
                    let _ = crate::exec::Exec::run(fops.exec(), vec![close]).await;
                }
            }
            // Plain fds close when the last reference goes.
            LocalEngine::Blocking(engine) => drop(engine.fops.end_session(session)),
        }
    }

    fn state(&self) -> EngineState {
        match self {
            LocalEngine::Ring(fops) => EngineState::new(fops.state(), fops.exec().stats()),
            LocalEngine::Blocking(engine) => {
                EngineState::new(engine.fops.state(), RingStats::default())
            }
        }
    }

    fn set_crash_point(&self, point: Option<CrashPoint>) {
        match self {
            LocalEngine::Ring(fops) => fops.set_crash_point(point),
            LocalEngine::Blocking(engine) => engine.fops.set_crash_point(point),
        }
    }
}

impl BlockingEngine {
    /// Runs one fop: the lease check (and a wait for a recall) on the calling task, the fop on
    /// the pool.
    async fn call(
        &self,
        session: SessionId,
        creds: Creds,
        fop: FopRequest,
    ) -> Result<FopReply, ErrorCode> {
        let run = |fop: FopRequest| async move {
            if let FopRequest::Lk(_) | FopRequest::Lease(_) = fop {
                // LK makes no system call (the lock table is in memory), LEASE one stat: they
                // run, and a blocked F_SETLKW or an arming grant waits, on the calling task
                // instead of holding a pool thread.
                return self.fops.call_measured(session, &creds, fop).await;
            }
            let (fops, creds) = (self.fops.clone(), creds.clone());
            self.pool
                .run(move || block_on(fops.call_measured(session, &creds, fop)))
                .await
        };
        self.fops
            .call_with(session, fop, run)
            .await
            .map_err(to_code)
    }

    async fn batch(&self, session: SessionId, batch: Batch) -> Result<BatchReply, ErrorCode> {
        LocalEngine::Blocking(self.clone())
            .batch(session, batch)
            .await
    }
}

/// The engine's sessions, fd tables, caches and ring counters: one worker's, or summed over
/// the workers by [`Engine::state`].
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EngineState {
    /// Open fds of each session, by session id.
    pub fd_tables: BTreeMap<SessionId, usize>,
    pub gfid_cache: CacheState,
    /// The held directory fds (brick-wide, not per worker).
    pub dirfd_cache: CacheState,
    pub ring: RingStats,
    /// The brick's leases (brick-wide, not per worker).
    pub leases: LeaseStats,
}

impl EngineState {
    fn new(fops: FopsState, ring: RingStats) -> EngineState {
        EngineState {
            fd_tables: fops.fd_tables,
            gfid_cache: fops.gfid_cache,
            dirfd_cache: CacheState::default(),
            ring,
            leases: LeaseStats::default(),
        }
    }

    pub fn open_fds(&self) -> usize {
        self.fd_tables.values().sum()
    }

    fn add(&mut self, other: EngineState) {
        self.fd_tables.extend(other.fd_tables);
        self.gfid_cache += other.gfid_cache;
        self.ring += other.ring;
    }
}

/// A running engine. Cheap to clone; its threads stop when the last clone and session are
/// gone.
#[derive(Debug, Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    workers: Workers<LocalEngine>,
    /// The blocking engine's fops, reached from any thread without a worker hop.
    blocking: Option<BlockingEngine>,
    kind: EngineKind,
    shared: Arc<BrickState>,
}

/// One client's session: its own fd table on the brick, released when it is dropped.
#[derive(Debug)]
pub struct Session {
    id: SessionId,
    engine: Engine,
}

fn to_code(e: rustix::io::Errno) -> ErrorCode {
    ErrorCode::from_errno(e.raw_os_error())
}

impl Engine {
    /// Starts the workers for an open brick.
    pub fn start(brick: &Arc<Brick>, config: &EngineConfig) -> std::io::Result<Engine> {
        // Fops apply their caller's umask themselves (`mode & !umask`); the process's own
        // must not mask again (it is shared by every thread, so this is the one place).
        rustix::process::umask(rustix::fs::Mode::empty());
        let shared = Arc::new(BrickState::new(&config.fops));
        crate::fops::spawn_dir_record_sweeper(brick, &shared)?;
        let (workers, blocking, kind) = match config.kind {
            EngineKind::Uring => match start_uring(brick, &shared, config) {
                Ok(workers) => (workers, None, EngineKind::Uring),
                // io_uring disabled (`kernel.io_uring_disabled`), filtered by seccomp, too old
                // for the features used, or short of locked memory: serve with the blocking
                // engine rather than not at all.
                Err(e) => {
                    tracing::warn!(error = %e, "io_uring is unavailable; using the blocking engine");
                    let (workers, engine) = start_blocking(brick, &shared, config)?;
                    (workers, Some(engine), EngineKind::Blocking)
                }
            },
            EngineKind::Blocking => {
                let (workers, engine) = start_blocking(brick, &shared, config)?;
                (workers, Some(engine), EngineKind::Blocking)
            }
        };
        Ok(Engine {
            inner: Arc::new(Inner {
                workers,
                blocking,
                kind,
                shared,
            }),
        })
    }

    pub fn kind(&self) -> EngineKind {
        self.inner.kind
    }

    /// Worker threads: the ring workers, or the blocking engine's one network thread.
    pub fn workers(&self) -> usize {
        self.inner.workers.len()
    }

    /// Runs `job` on worker `worker`'s thread with that worker's [`LocalEngine`]; the job may
    /// spawn local tasks there.
    pub async fn run_on_worker(
        &self,
        worker: usize,
        job: impl FnOnce(&LocalEngine) + Send + 'static,
    ) -> Result<(), ErrorCode> {
        self.inner
            .workers
            .send(worker, job)
            .await
            .map_err(|_| ErrorCode::NotConnected)
    }

    /// Opens a session, pinned to one worker (round robin), whose namespace replies carry
    /// their parents' attributes.
    pub fn session(&self) -> Session {
        self.session_with(ParentAttrs::Stat)
    }

    /// Opens a session, pinned to one worker (round robin), whose namespace replies carry
    /// `parents`.
    pub fn session_with(&self, parents: ParentAttrs) -> Session {
        let id = self.inner.shared.new_session_id();
        match &self.inner.blocking {
            Some(engine) => engine.fops.open_session(id, parents),
            // Queued before any call of the session: the worker's queue keeps order.
            None => self
                .inner
                .workers
                .send_detached(self.worker_of(id), move |local| {
                    if let LocalEngine::Ring(fops) = local {
                        fops.open_session(id, parents);
                    }
                }),
        }
        Session {
            id,
            engine: self.clone(),
        }
    }

    /// Ring counters summed over the workers (zero for the blocking engine).
    pub async fn ring_stats(&self) -> RingStats {
        self.state().await.ring
    }

    /// Sessions, fd tables, caches and ring counters, summed over the workers, and the
    /// brick's leases.
    pub async fn state(&self) -> EngineState {
        let leases = self.leases().stats();
        let dirfd_cache = self.inner.shared.dirfd_cache_state();
        if let Some(engine) = &self.inner.blocking {
            return EngineState {
                dirfd_cache,
                leases,
                ..LocalEngine::Blocking(engine.clone()).state()
            };
        }
        let mut total = EngineState {
            dirfd_cache,
            leases,
            ..EngineState::default()
        };
        for worker in 0..self.workers() {
            let (tx, rx) = oneshot::channel();
            let job = move |local: &LocalEngine| drop(tx.send(local.state()));
            if self.inner.workers.send(worker, job).await.is_ok()
                && let Ok(s) = rx.await
            {
                total.add(s);
            }
        }
        total
    }

    /// The brick's per-fop profile, shared by every worker.
    pub fn profile(&self) -> &Profile {
        &self.inner.shared.profile
    }

    /// The brick's leases, shared by every worker (settings change live here).
    pub fn leases(&self) -> &Leases {
        &self.inner.shared.leases
    }

    /// Opens a session that negotiated leases (as a QUIC client offering `LEASES`): it may
    /// send LEASE and BATCH, and its RECALL events come out of the returned queue.
    pub fn lease_session(&self) -> (Session, RecallEvents) {
        let session = self.session();
        let events = self.leases().attach(session.id);
        (session, events)
    }

    /// Arms a crash point on every worker (crash-injection tests).
    pub async fn set_crash_point(&self, point: Option<CrashPoint>) {
        for worker in 0..self.workers() {
            let (done, applied) = oneshot::channel();
            let job = move |local: &LocalEngine| {
                local.set_crash_point(point);
                let _ = done.send(());
            };
            if self.inner.workers.send(worker, job).await.is_ok() {
                let _ = applied.await;
            }
        }
    }

    /// The worker a session is pinned to.
    fn worker_of(&self, session: SessionId) -> usize {
        (session as usize) % self.workers()
    }
}

impl Session {
    pub fn id(&self) -> SessionId {
        self.id
    }

    /// Executes one fop as `creds`. Many calls of one session may be in flight at once.
    pub async fn call(&self, creds: Creds, fop: FopRequest) -> Result<FopReply, ErrorCode> {
        let inner = &self.engine.inner;
        if let Some(engine) = &inner.blocking {
            return engine.call(self.id, creds, fop).await;
        }
        let session = self.id;
        self.on_worker(move |local| async move { local.call(session, &creds, fop).await })
            .await
    }
}

impl Session {
    /// Executes a BATCH ([`LocalEngine::batch`]).
    pub async fn batch(&self, batch: Batch) -> Result<BatchReply, ErrorCode> {
        let inner = &self.engine.inner;
        if let Some(engine) = &inner.blocking {
            return engine.batch(self.id, batch).await;
        }
        let session = self.id;
        self.on_worker(move |local| async move { local.batch(session, batch).await })
            .await
    }

    /// Runs `work` as a task on the ring worker the session is pinned to; its answer.
    async fn on_worker<T, F, Fut>(&self, work: F) -> Result<T, ErrorCode>
    where
        T: Send + 'static,
        F: FnOnce(LocalEngine) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, ErrorCode>> + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let job = move |local: &LocalEngine| {
            let local = local.clone();
            tokio::task::spawn_local(async move {
                let _ = tx.send(work(local).await);
            });
        };
        self.engine
            .inner
            .workers
            .send(self.engine.worker_of(self.id), job)
            .await
            .map_err(|_| ErrorCode::NotConnected)?;
        rx.await.map_err(|_| ErrorCode::Io)?
    }

    /// Stops the session's lock waits (they answer EINTR): for a caller about to end the
    /// session while calls are still in flight.
    pub fn cancel_lock_waits(&self) {
        let session = self.id;
        match &self.engine.inner.blocking {
            Some(engine) => engine.fops.cancel_lock_waits(session),
            None => self.engine.inner.workers.send_detached(
                self.engine.worker_of(session),
                move |local| {
                    local.cancel_lock_waits(session);
                },
            ),
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let session = self.id;
        let inner = &self.engine.inner;
        if let Some(engine) = &inner.blocking {
            drop(engine.fops.end_session(session));
            return;
        }
        // A full queue must not lose the release.
        inner
            .workers
            .send_detached(self.engine.worker_of(session), move |local| {
                let local = local.clone();
                tokio::task::spawn_local(async move { local.end_session(session).await });
            });
    }
}

fn start_uring(
    brick: &Arc<Brick>,
    shared: &Arc<BrickState>,
    config: &EngineConfig,
) -> std::io::Result<Workers<LocalEngine>> {
    let pool = BlockingPool::new(config.ring.blocking_threads, config.ring.blocking_queue_max)?;
    let (brick, shared, config) = (brick.clone(), shared.clone(), config.clone());
    let init = move |_worker: usize| {
        let exec = UringExec::new(&config.ring, pool.clone())?;
        let fops = Fops::new(brick.clone(), shared.clone(), exec, config.fops.clone());
        Ok(LocalEngine::Ring(Rc::new(fops)))
    };
    Workers::start("kiln-worker", config.workers, config.queue_max, init)
}

fn start_blocking(
    brick: &Arc<Brick>,
    shared: &Arc<BrickState>,
    config: &EngineConfig,
) -> std::io::Result<(Workers<LocalEngine>, BlockingEngine)> {
    let fops = Fops::new(
        brick.clone(),
        shared.clone(),
        BlockingExec,
        config.fops.clone(),
    );
    let engine = BlockingEngine {
        fops: Arc::new(fops),
        pool: BlockingPool::named("kiln-blocking-worker", config.workers, config.queue_max)?,
    };
    // One thread runs the network; the pool runs the fops.
    let local = engine.clone();
    let init = move |_| Ok(LocalEngine::Blocking(local.clone()));
    let workers = Workers::start("kiln-net", 1, config.queue_max, init)?;
    Ok((workers, engine))
}

/// Drives a future of the blocking executor, whose every await is already complete.
fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = std::pin::pin!(future);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    loop {
        if let std::task::Poll::Ready(v) = future.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::yield_now();
    }
}
