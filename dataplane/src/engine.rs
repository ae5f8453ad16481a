//! The engine: worker threads that execute fops for client sessions.
//!
//! * `uring`: one worker thread per core by default, each with its own ring and tokio
//!   current-thread runtime; a session is pinned to one worker, whose fd table, caches and
//!   ring it uses without locks shared with other workers. Many fops of a session are in
//!   flight at once, each a task on the worker.
//! * `blocking`: a pool of threads making ordinary syscalls, sharing one set of tables. It is
//!   the reference the ring is measured against and the fallback where io_uring is disabled.
//!
//! [`Session::call`] is the API the server uses: a fop in, a reply out, from any thread.

use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kiln_wire::{Creds, ErrorCode, FopReply, FopRequest};
use tokio::sync::{mpsc, oneshot};

use crate::brick::Brick;
use crate::cache::CacheState;
use crate::exec::blocking::BlockingExec;
use crate::exec::uring::{BlockingPool, RingConfig, RingStats, UringExec};
use crate::fops::{BrickState, CrashPoint, Fops, FopsConfig, SessionId};
use crate::profile::Profile;
use crate::step::{Op, Step};

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
    /// Worker threads (`server.event-threads`); the ring engine's default is one per core.
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

#[allow(
    clippy::large_enum_variant,
    reason = "requests are moved once into a channel"
)]
enum Request {
    Fop {
        session: SessionId,
        creds: Creds,
        fop: FopRequest,
        reply: oneshot::Sender<Result<FopReply, ErrorCode>>,
    },
    EndSession {
        session: SessionId,
    },
    State {
        reply: oneshot::Sender<EngineState>,
    },
    CrashPoint {
        point: Option<CrashPoint>,
        done: oneshot::Sender<()>,
    },
    Run(WorkerJob),
}

/// A job run on a ring worker's own thread (see [`Engine::run_on_worker`]).
type WorkerJob = Box<dyn FnOnce(LocalEngine) + Send>;

/// The engine as seen from inside one ring worker's thread: fops are called directly, with no
/// channel and no thread switch. This is how a server running its connections on the worker
/// threads uses the engine; [`Session`] is for callers on other threads.
#[derive(Debug, Clone)]
pub struct LocalEngine {
    fops: Rc<Fops<UringExec>>,
}

impl LocalEngine {
    /// Executes one fop for `session` (a [`Engine::session_id`]) as `creds`.
    pub async fn call(
        &self,
        session: SessionId,
        creds: &Creds,
        fop: FopRequest,
    ) -> Result<FopReply, ErrorCode> {
        self.fops.call(session, creds, fop).await.map_err(to_code)
    }

    /// Ends a session: closes its files and drops its locks.
    pub async fn end_session(&self, session: SessionId) {
        for file in self.fops.end_session(session) {
            let _ = crate::exec::Exec::run(self.fops.exec(), vec![Step::brick(Op::Close { file })])
                .await;
        }
    }
}

#[derive(Debug)]
struct Inner {
    workers: Vec<mpsc::Sender<Request>>,
    next_session: AtomicU64,
    kind: EngineKind,
    shared: Arc<BrickState>,
}

/// The engine's sessions, fd tables, caches and ring counters: one worker's, or summed over
/// the workers by [`Engine::state`].
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EngineState {
    /// Open fds of each session, by session id.
    pub fd_tables: BTreeMap<SessionId, usize>,
    pub gfid_cache: CacheState,
    pub dirfd_cache: CacheState,
    pub ring: RingStats,
}

impl EngineState {
    pub fn open_fds(&self) -> usize {
        self.fd_tables.values().sum()
    }

    fn add(&mut self, other: EngineState) {
        self.fd_tables.extend(other.fd_tables);
        self.gfid_cache += other.gfid_cache;
        self.dirfd_cache += other.dirfd_cache;
        self.ring += other.ring;
    }
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Request")
    }
}

/// A running engine. Cheap to clone; stops when the last clone and session are gone.
#[derive(Debug, Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

/// One client's session: its own fd table on the brick, released when it is dropped.
#[derive(Debug)]
pub struct Session {
    id: SessionId,
    worker: mpsc::Sender<Request>,
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
        let shared = Arc::new(BrickState::default());
        let (workers, kind) = match config.kind {
            EngineKind::Uring => match start_uring(brick, &shared, config) {
                Ok(workers) => (workers, EngineKind::Uring),
                // io_uring disabled (`kernel.io_uring_disabled`), filtered by seccomp, too old
                // for the features used, or short of locked memory: serve with the blocking
                // engine rather than not at all.
                Err(e) => {
                    tracing::warn!(error = %e, "io_uring is unavailable; using the blocking engine");
                    (
                        start_blocking(brick, &shared, config)?,
                        EngineKind::Blocking,
                    )
                }
            },
            EngineKind::Blocking => (
                start_blocking(brick, &shared, config)?,
                EngineKind::Blocking,
            ),
        };
        Ok(Engine {
            inner: Arc::new(Inner {
                workers,
                next_session: AtomicU64::new(1),
                kind,
                shared,
            }),
        })
    }

    pub fn kind(&self) -> EngineKind {
        self.inner.kind
    }

    /// Worker threads (each with its own ring on the io_uring engine).
    pub fn workers(&self) -> usize {
        self.inner.workers.len()
    }

    /// A new session id, for use with [`LocalEngine::call`].
    pub fn session_id(&self) -> SessionId {
        self.inner.next_session.fetch_add(1, Ordering::Relaxed)
    }

    /// Runs `job` on ring worker `worker`'s thread with that worker's [`LocalEngine`]; the job
    /// may spawn local tasks there. ENOSYS on the blocking engine, which has no such threads.
    pub async fn run_on_worker(
        &self,
        worker: usize,
        job: impl FnOnce(LocalEngine) + Send + 'static,
    ) -> Result<(), ErrorCode> {
        if self.inner.kind != EngineKind::Uring {
            return Err(ErrorCode::NoSys);
        }
        let tx = self.inner.workers.get(worker).ok_or(ErrorCode::Inval)?;
        tx.send(Request::Run(Box::new(job)))
            .await
            .map_err(|_| ErrorCode::NotConnected)
    }

    /// Opens a session, pinned to one worker (round robin).
    pub fn session(&self) -> Session {
        let id = self.inner.next_session.fetch_add(1, Ordering::Relaxed);
        let worker = self.inner.workers[(id as usize) % self.inner.workers.len()].clone();
        Session { id, worker }
    }

    /// Ring counters summed over the workers (zero for the blocking engine).
    pub async fn ring_stats(&self) -> RingStats {
        self.state().await.ring
    }

    /// Sessions, fd tables, caches and ring counters, summed over the workers.
    pub async fn state(&self) -> EngineState {
        let mut total = EngineState::default();
        for w in &self.inner.workers {
            let (tx, rx) = oneshot::channel();
            if w.send(Request::State { reply: tx }).await.is_ok()
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

    /// Arms a crash point on every worker (crash-injection tests).
    pub async fn set_crash_point(&self, point: Option<CrashPoint>) {
        for w in &self.inner.workers {
            let (done, applied) = oneshot::channel();
            if w.send(Request::CrashPoint { point, done }).await.is_ok() {
                let _ = applied.await;
            }
        }
    }
}

impl Session {
    pub fn id(&self) -> SessionId {
        self.id
    }

    /// Executes one fop as `creds`. Many calls of one session may be in flight at once.
    pub async fn call(&self, creds: Creds, fop: FopRequest) -> Result<FopReply, ErrorCode> {
        let (tx, rx) = oneshot::channel();
        let request = Request::Fop {
            session: self.id,
            creds,
            fop,
            reply: tx,
        };
        self.worker
            .send(request)
            .await
            .map_err(|_| ErrorCode::NotConnected)?;
        rx.await.map_err(|_| ErrorCode::Io)?
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // A full queue must not lose the release: fall back to a blocking-free spawn.
        if let Err(mpsc::error::TrySendError::Full(req)) = self
            .worker
            .try_send(Request::EndSession { session: self.id })
        {
            let worker = self.worker.clone();
            std::thread::spawn(move || {
                let _ = worker.blocking_send(req);
            });
        }
    }
}

fn start_uring(
    brick: &Arc<Brick>,
    shared: &Arc<BrickState>,
    config: &EngineConfig,
) -> std::io::Result<Vec<mpsc::Sender<Request>>> {
    let pool = BlockingPool::new(config.ring.blocking_threads, config.ring.blocking_queue_max)?;
    let mut senders = Vec::new();
    for i in 0..config.workers.max(1) {
        let (tx, rx) = mpsc::channel(config.queue_max.max(1));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (brick, config, pool, shared) =
            (brick.clone(), config.clone(), pool.clone(), shared.clone());
        std::thread::Builder::new()
            .name(format!("kiln-worker-{i}"))
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let local = tokio::task::LocalSet::new();
                local.block_on(&runtime, async move {
                    let exec = match UringExec::new(&config.ring, pool) {
                        Ok(exec) => exec,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let _ = ready_tx.send(Ok(()));
                    let fops = Rc::new(Fops::new(brick, shared, exec, config.fops.clone()));
                    serve_uring(fops, rx).await;
                });
            })?;
        ready_rx
            .recv()
            .map_err(|_| std::io::Error::other("worker thread died at start"))??;
        senders.push(tx);
    }
    Ok(senders)
}

async fn serve_uring(fops: Rc<Fops<UringExec>>, mut rx: mpsc::Receiver<Request>) {
    while let Some(request) = rx.recv().await {
        match request {
            Request::Fop {
                session,
                creds,
                fop,
                reply,
            } => {
                let fops = fops.clone();
                tokio::task::spawn_local(async move {
                    let result = fops.call(session, &creds, fop).await.map_err(to_code);
                    let _ = reply.send(result);
                });
            }
            Request::EndSession { session } => {
                let local = LocalEngine { fops: fops.clone() };
                tokio::task::spawn_local(async move { local.end_session(session).await });
            }
            Request::Run(job) => job(LocalEngine { fops: fops.clone() }),
            Request::State { reply } => {
                let mut state = fops.state();
                state.ring = fops.exec().stats();
                let _ = reply.send(state);
            }
            Request::CrashPoint { point, done } => {
                fops.set_crash_point(point);
                let _ = done.send(());
            }
        }
    }
}

fn start_blocking(
    brick: &Arc<Brick>,
    shared: &Arc<BrickState>,
    config: &EngineConfig,
) -> std::io::Result<Vec<mpsc::Sender<Request>>> {
    let fops = Arc::new(Fops::new(
        brick.clone(),
        shared.clone(),
        BlockingExec,
        config.fops.clone(),
    ));
    let (tx, rx) = mpsc::channel::<Request>(config.queue_max.max(1));
    let serve = move |request: Request| match request {
        Request::Fop {
            session,
            creds,
            fop,
            reply,
        } => {
            let _ = reply.send(block_on(fops.call(session, &creds, fop)).map_err(to_code));
        }
        Request::EndSession { session } => drop(fops.end_session(session)),
        Request::State { reply } => {
            let _ = reply.send(fops.state());
        }
        Request::CrashPoint { point, done } => {
            fops.set_crash_point(point);
            let _ = done.send(());
        }
        // Only ring workers run jobs (`run_on_worker` refuses this engine).
        Request::Run(_) => {}
    };
    crate::exec::spawn_queue_threads("kiln-blocking-worker", config.workers, rx, serve)?;
    // One queue shared by all threads: every session reaches every thread.
    Ok(vec![tx])
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
