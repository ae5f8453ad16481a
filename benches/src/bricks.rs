//! The bricks the workloads measure, set up one way for all of them: a fresh brick with its
//! engine; the same brick served over QUIC in this process (mutual TLS material from
//! `kiln_admin::pki`, a [`BrickClient`] connected to it); and [`Caller`], which sends one
//! fop sequence to either, so a workload writes its fops once for the `engine` and `volume`
//! targets.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;

use anyhow::Context;
use kiln_admin::options::BrickSettings;
use kiln_admin::pki::{self, Role};
use kiln_client::{BrickClient, ConnectOptions};
use kiln_dataplane::engine::{Engine, EngineConfig, EngineKind, LocalEngine, Session};
use kiln_dataplane::server::{Server, ServerConfig};
use kiln_dataplane::{Brick, ParentAttrs, SessionId};
use kiln_wire::{Creds, FopReply, FopRequest, Gfid};

use crate::rng::Rng;

/// The client identity's name.
const CLIENT_NAME: &str = "bench";
const BRICK_NAME: &str = "bench-brick";

/// The engine of `kind` the workloads compare: the io_uring engine as `kiln-brickd` runs it
/// (one worker per core, and the blocking pool they share for calls io_uring has no opcode
/// for); the blocking engine with as many pool threads as the io_uring engine has threads in
/// all ([`threads_total`]), so neither engine wins by having more threads.
pub fn engine_config(kind: EngineKind) -> EngineConfig {
    let mut config = EngineConfig {
        kind,
        ..EngineConfig::default()
    };
    if kind == EngineKind::Blocking {
        config.workers = threads_total(&EngineConfig::default());
    }
    config
}

/// Threads an engine of `config` runs fops on: the ring workers, or the blocking pool (the
/// blocking engine's network thread runs no fops).
pub fn fop_threads(config: &EngineConfig) -> usize {
    config.workers
}

/// Every thread an engine of `config` runs fops or their system calls on: the ring workers
/// and their blocking pool, or the blocking engine's pool. io_uring's io-wq threads are not
/// counted: the kernel starts them as it punts work, and they are not the engine's to size.
pub fn threads_total(config: &EngineConfig) -> usize {
    match config.kind {
        EngineKind::Uring => config.workers + config.ring.blocking_threads,
        EngineKind::Blocking => config.workers,
    }
}

/// `params` with the thread counts of an engine of `config` added: `threads` (those running
/// fops) and, for the io_uring engine, `pool_threads` (its blocking pool).
pub fn with_threads(mut params: serde_json::Value, config: &EngineConfig) -> serde_json::Value {
    params["threads"] = fop_threads(config).into();
    if config.kind == EngineKind::Uring {
        params["pool_threads"] = config.ring.blocking_threads.into();
    }
    params
}

/// Formats `path` as a brick, opens it and starts an engine of `config` on it.
pub fn start_engine(path: &Path, config: &EngineConfig) -> anyhow::Result<(Arc<Brick>, Engine)> {
    Brick::format(path)?;
    open_engine(path, config)
}

/// Opens an existing brick and starts a fresh engine on it (empty caches and fd tables).
pub fn open_engine(path: &Path, config: &EngineConfig) -> anyhow::Result<(Arc<Brick>, Engine)> {
    let brick = Arc::new(Brick::open(path)?);
    let engine = Engine::start(&brick, config)?;
    Ok((brick, engine))
}

/// A brick with its engine, ready to be served over QUIC: its TLS material (a throwaway CA,
/// a brick certificate for `127.0.0.1`/`localhost`, a client certificate) in a directory of
/// its own.
#[derive(Debug)]
pub struct Served {
    pub brick: Arc<Brick>,
    pub engine: Engine,
    tls_dir: tempfile::TempDir,
    brick_identity: pki::Identity,
    /// Ring workers that run a QUIC endpoint (0 = every worker).
    endpoints: usize,
}

impl Served {
    /// A fresh brick in `brick_dir` (TLS material beside it, in `tls_under`) with an engine
    /// of `config`.
    pub fn start(
        brick_dir: &Path,
        tls_under: &Path,
        config: &EngineConfig,
        endpoints: usize,
    ) -> anyhow::Result<Served> {
        let tls_dir = tempfile::tempdir_in(tls_under)?;
        pki::init_ca(tls_dir.path()).context("cluster CA")?;
        let brick_role = Role::Brick {
            hosts: vec!["127.0.0.1".into(), "localhost".into()],
        };
        let brick_files =
            pki::issue(tls_dir.path(), &brick_role, BRICK_NAME, 1).context("brick certificate")?;
        pki::issue(tls_dir.path(), &Role::Client, CLIENT_NAME, 1).context("client certificate")?;
        let brick_identity = pki::load_identity(&pki::ca_files(tls_dir.path()).cert, &brick_files)
            .context("brick identity")?;
        Brick::format(brick_dir)?;
        let (brick, engine) = open_engine(brick_dir, config)?;
        Ok(Served {
            brick,
            engine,
            tls_dir,
            brick_identity,
            endpoints,
        })
    }

    /// The bench client's options for the server at `addr`, UDP payloads capped at
    /// `udp_payload`.
    pub fn client_options(
        &self,
        addr: SocketAddr,
        udp_payload: u16,
    ) -> anyhow::Result<ConnectOptions> {
        let mut options = ConnectOptions::from_tls_dir(addr, self.tls_dir.path(), CLIENT_NAME)?;
        options.udp_payload_max_bytes = udp_payload;
        Ok(options)
    }

    /// Starts a server on a new port with UDP payloads capped at `udp_payload`, and connects
    /// a client to it with the same cap. Run inside the client runtime.
    pub async fn serve_and_connect(
        &self,
        udp_payload: u16,
    ) -> anyhow::Result<(Server, BrickClient)> {
        self.serve_and_connect_with(udp_payload, 1).await
    }

    /// [`Served::serve_and_connect`] with a client of `connections` connections (bulk lanes).
    pub async fn serve_and_connect_with(
        &self,
        udp_payload: u16,
        connections: usize,
    ) -> anyhow::Result<(Server, BrickClient)> {
        let listen: SocketAddr = "127.0.0.1:0".parse()?;
        let mut config = ServerConfig::new(listen, self.brick_identity.clone());
        config.volume = "bench".into();
        config.udp_payload_max_bytes = udp_payload;
        // The bench acts as root; its certificate is trusted with it.
        config.live.root_squash.root_allow = vec![CLIENT_NAME.to_owned()];
        if self.endpoints > 0 {
            config.endpoints = self.endpoints;
        }
        let server = Server::start(&self.engine, self.brick.id, config).await?;
        let mut options = self.client_options(server.local_addr(), udp_payload)?;
        options.connections = connections;
        let volume = BrickClient::connect(options)
            .await
            .with_context(|| format!("connecting to {}", server.local_addr()))?;
        Ok((server, volume))
    }
}

/// Where one task's fops go: the io_uring engine from one of its ring workers (no channel,
/// no thread switch, the way the QUIC server calls it), an engine session from this thread
/// (the blocking engine), or the client over QUIC. Fops run as root.
#[derive(Debug, Clone)]
pub enum Caller {
    Worker {
        local: LocalEngine,
        session: SessionId,
    },
    Session(Rc<Session>),
    Volume(BrickClient),
}

impl Caller {
    pub async fn call(&self, fop: impl Into<FopRequest>) -> anyhow::Result<FopReply> {
        let fop = fop.into();
        let code = fop.code();
        let reply = match self {
            Caller::Worker { local, session } => local
                .call(*session, &Creds::root(), fop)
                .await
                .map_err(|e| anyhow::anyhow!("{e}")),
            Caller::Session(session) => session
                .call(Creds::root(), fop)
                .await
                .map_err(|e| anyhow::anyhow!("{e}")),
            Caller::Volume(volume) => volume
                .call_raw(&Creds::root(), fop)
                .await
                .map_err(anyhow::Error::from),
        };
        reply.with_context(|| code.name())
    }
}

/// What a group of tasks sends its fops to.
#[derive(Debug, Clone, Copy)]
pub enum Destination<'a> {
    Engine(&'a Engine),
    Volume(&'a BrickClient),
}

/// Runs `tasks` tasks at once, task `t` as `job(t, caller)`, and returns their results in
/// task order. On the io_uring engine task `t` runs on ring worker `t mod workers` with a
/// session of its own (ended when the task ends); on the blocking engine each task gets a
/// session and runs on `rt` on this thread; over QUIC the tasks share the volume's one
/// connection and run on `rt` on this thread.
pub fn run_tasks<T, F, Fut>(
    rt: &tokio::runtime::Runtime,
    destination: Destination<'_>,
    tasks: usize,
    job: F,
) -> anyhow::Result<Vec<T>>
where
    T: Send + 'static,
    F: Fn(usize, Caller) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = anyhow::Result<T>> + 'static,
{
    match destination {
        Destination::Engine(engine) if engine.kind() == EngineKind::Uring => {
            let mut done = Vec::with_capacity(tasks);
            for t in 0..tasks {
                let (tx, rx) = tokio::sync::oneshot::channel();
                let job = job.clone();
                rt.block_on(engine.run_on_worker(t % engine.workers(), move |local| {
                    let local = local.clone();
                    let session = local.open_session(ParentAttrs::Omit);
                    tokio::task::spawn_local(async move {
                        let caller = Caller::Worker {
                            local: local.clone(),
                            session,
                        };
                        let result = job(t, caller).await;
                        local.end_session(session).await;
                        let _ = tx.send(result);
                    });
                }))
                .map_err(|e| anyhow::anyhow!("run on a ring worker: {e}"))?;
                done.push(rx);
            }
            rt.block_on(async {
                let mut results = Vec::with_capacity(tasks);
                for rx in done {
                    results.push(rx.await.context("a task on a ring worker died")??);
                }
                Ok(results)
            })
        }
        Destination::Engine(engine) => local_tasks(rt, tasks, job, || {
            Caller::Session(Rc::new(engine.session_with(ParentAttrs::Omit)))
        }),
        Destination::Volume(volume) => {
            local_tasks(rt, tasks, job, || Caller::Volume(volume.clone()))
        }
    }
}

fn local_tasks<T, F, Fut>(
    rt: &tokio::runtime::Runtime,
    tasks: usize,
    job: F,
    caller: impl Fn() -> Caller,
) -> anyhow::Result<Vec<T>>
where
    F: Fn(usize, Caller) -> Fut,
    Fut: Future<Output = anyhow::Result<T>> + 'static,
    T: 'static,
{
    let local = tokio::task::LocalSet::new();
    local.block_on(rt, async {
        let handles: Vec<_> = (0..tasks)
            .map(|t| tokio::task::spawn_local(job(t, caller())))
            .collect();
        let mut results = Vec::with_capacity(tasks);
        for handle in handles {
            results.push(handle.await??);
        }
        Ok(results)
    })
}

/// A GFID drawn from `seed`'s stream `stream` (a version-4 UUID, so never null).
pub fn seeded_gfid(seed: u64, stream: u64) -> Gfid {
    Gfid::from_bytes(Rng::stream(seed, stream).uuid_bytes())
        .unwrap_or_else(|| unreachable!("a version-4 UUID is never all zeros"))
}

/// Brick options of `kiln volume set` that kiln-bench applies to the bricks it starts itself
/// (`--vary`), each value checked by the option table as `kiln volume set` checks it.
pub const VARIABLE_OPTIONS: [&str; 6] = [
    "network.inode-lru-limit",
    "server.engine",
    "server.event-threads",
    "server.ring-entries",
    "storage.dirfd-cache-entries",
    "storage.fsync-policy",
];

/// One value of a brick option (`--vary KEY=V1,V2,…` gives one per value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrickOption {
    pub key: &'static str,
    /// In the option table's canonical form.
    pub value: String,
}

impl BrickOption {
    /// `KEY=V1,V2,…` → one option per value.
    pub fn parse_vary(spec: &str) -> anyhow::Result<Vec<BrickOption>> {
        let (key, values) = spec
            .split_once('=')
            .context("--vary takes KEY=VALUE,VALUE,…")?;
        let def = kiln_admin::options::find(key.trim())?;
        let key = VARIABLE_OPTIONS
            .into_iter()
            .find(|k| *k == def.key)
            .with_context(|| {
                format!(
                    "--vary: {} is not an option of the bricks kiln-bench starts; one of {}",
                    def.key,
                    VARIABLE_OPTIONS.join(", ")
                )
            })?;
        values
            .split(',')
            .map(|v| {
                let value = def.parse(v)?;
                Ok(BrickOption { key, value })
            })
            .collect()
    }

    /// Makes `config` the engine `kiln-brickd` runs with this option and every other brick
    /// option at the table's default: the table reads the options into [`BrickSettings`],
    /// which the dataplane maps to an engine as `kiln-brickd` does.
    pub fn apply(&self, config: &mut EngineConfig) -> anyhow::Result<()> {
        let options = BTreeMap::from([(self.key.to_owned(), self.value.clone())]);
        *config = EngineConfig::from(&BrickSettings::from_options(&options)?);
        Ok(())
    }
}

impl std::fmt::Display for BrickOption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}", self.key, self.value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variable_option_applies() {
        let applied = |key: &str, value: &str| {
            let options = BrickOption::parse_vary(&format!("{key}={value}")).expect(key);
            let mut config = EngineConfig::default();
            options[0].apply(&mut config).expect(key);
            config
        };
        let config = applied("network.inode-lru-limit", "2048");
        assert_eq!(config.fops.gfid_cache_entries.get(), 2048);
        let config = applied("server.engine", "blocking");
        assert_eq!(config.kind, EngineKind::Blocking);
        let config = applied("server.event-threads", "3");
        assert_eq!(config.workers, 3);
        let config = applied("server.ring-entries", "64");
        assert_eq!(config.ring.ring_entries, 64);
        let config = applied("storage.dirfd-cache-entries", "32");
        assert_eq!(config.fops.dirfd_cache_entries.get(), 32);
        let config = applied("storage.fsync-policy", "write-through");
        assert!(config.fops.write_through);
        assert_eq!(VARIABLE_OPTIONS.len(), 6, "each one is applied above");
    }

    #[test]
    fn the_blocking_engine_gets_every_thread_of_the_ring_engine() {
        let ring = engine_config(EngineKind::Uring);
        let blocking = engine_config(EngineKind::Blocking);
        assert_eq!(ring.workers, EngineConfig::default().workers);
        assert_eq!(
            fop_threads(&blocking),
            ring.workers + ring.ring.blocking_threads
        );
        assert_eq!(threads_total(&blocking), threads_total(&ring));
        let params = with_threads(serde_json::json!({ "depth": 16 }), &ring);
        assert_eq!(params["threads"], ring.workers);
        assert_eq!(params["pool_threads"], ring.ring.blocking_threads);
        let params = with_threads(serde_json::json!({ "depth": 16 }), &blocking);
        assert_eq!(params["threads"], threads_total(&ring));
        assert!(params.get("pool_threads").is_none());
    }

    #[test]
    fn other_options_keep_the_engine_defaults() {
        let mut config = EngineConfig::default();
        let options = BrickOption::parse_vary("server.engine=blocking").expect("vary");
        options[0].apply(&mut config).expect("apply");
        let default = EngineConfig::default();
        assert_eq!(config.workers, default.workers);
        assert_eq!(config.queue_max, default.queue_max);
        assert_eq!(
            config.fops.gfid_cache_entries,
            default.fops.gfid_cache_entries
        );
        assert_eq!(
            config.fops.dirfd_cache_entries,
            default.fops.dirfd_cache_entries
        );
        assert_eq!(
            config.fops.open_files_per_client_max,
            default.fops.open_files_per_client_max
        );
        assert_eq!(
            config.fops.locks_per_client_max,
            default.fops.locks_per_client_max
        );
        assert_eq!(config.fops.write_through, default.fops.write_through);
        assert_eq!(config.ring.ring_entries, default.ring.ring_entries);
    }
}
