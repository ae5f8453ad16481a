//! `kiln-mgmtd`: the configuration store, the volume commands and the brick supervisor behind
//! one root-only Unix socket.
//!
//! State directory layout:
//!
//! ```text
//! <state>/store/       the durable configuration (see `store`)
//! <state>/tls/         the cluster CA, every brick's certificate and the `admin` client's
//! <state>/logs/        one log per brick
//! <state>/cluster.json the cluster on etcd this host is a member of (`membership`)
//! ```

mod cluster;
mod lifecycle;
mod rebalance;
mod reconcile;
mod reports;
mod volume_options;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kiln_admin::command::{EXCHANGE, Request, Response};
use kiln_admin::exchange::ExchangeError;
use kiln_admin::pki::{self, Role};
use kiln_admin::volume::Volume;
use tokio::net::{UnixListener, UnixStream};

use crate::fanout;
use crate::membership;
use crate::store::etcd::{EtcdStore, EtcdTarget};
use crate::store::{CommitError, ConfigStore, LogStore, StoreError, StoreOptions};
use crate::supervisor::{CurrentConfig, Launch, Supervisor};
use crate::tasks::Tasks;
use crate::volume::{Change, Cluster};

#[derive(Debug, Clone)]
pub struct DaemonConfig {
    pub state_dir: PathBuf,
    pub socket: PathBuf,
    pub brickd: PathBuf,
    /// The `kiln` executable, which runs a rebalance for the daemon.
    pub kiln: PathBuf,
    pub listen_ip: std::net::IpAddr,
    /// This host's name in a cluster (how other hosts and clients reach it); required with
    /// etcd, where every brick names its host.
    pub host: Option<String>,
    /// The cluster's configuration in etcd; `None`: the embedded store (one host).
    pub etcd: Option<EtcdTarget>,
}

/// How long a brick removed from its volume runs on: mounts stop using it within their
/// brick refresh (1 s, `kiln_client::distribute::BRICKS_REFRESH`), and the ones a moment
/// late still reach it meanwhile.
const REMOVED_BRICK_GRACE: Duration = Duration::from_secs(3);

struct Daemon {
    config: DaemonConfig,
    store: Arc<ConfigStore<Cluster>>,
    supervisor: Arc<Supervisor>,
    /// One reconciliation of the bricks here with the configuration at a time. Held with it:
    /// the bricks running here removed from their volume, each with when this daemon first
    /// saw it removed (it runs on for [`REMOVED_BRICK_GRACE`]).
    reconciling: tokio::sync::Mutex<HashMap<String, Instant>>,
    /// The generation the bricks here were last brought up to.
    applied: tokio::sync::watch::Sender<u64>,
    /// The task reporting this host into etcd (stopped when the host leaves).
    reporter: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Told once the host's leave of its cluster is answered: the daemon stops.
    left: tokio::sync::Notify,
    tasks: Arc<Tasks>,
}

/// Opens the store, starts the bricks of started volumes, and serves the socket until
/// `shutdown` completes; then stops the bricks.
pub async fn run(config: DaemonConfig, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    // First, so a second daemon started by mistake touches nothing (bricks of a cluster
    // outlive the daemon that starts them).
    let listener = bind_socket(&config.socket)?;
    let tls_dir = config.state_dir.join("tls");
    let log_dir = config.state_dir.join("logs");
    std::fs::create_dir_all(&log_dir)
        .with_context(|| format!("cannot create {}", log_dir.display()))?;
    // A cluster's daemons share one CA, which the store checks (and the first one makes).
    let store = Arc::new(open_store(&config, &tls_dir).await?);
    if !pki::ca_files(&tls_dir).cert.exists() {
        pki::init_ca(&tls_dir)?;
    }
    if !pki::identity_files(&tls_dir, &Role::Client, pki::ADMIN_CLIENT)
        .cert
        .exists()
    {
        pki::issue(
            &tls_dir,
            &Role::Client,
            pki::ADMIN_CLIENT,
            pki::CERT_VALIDITY_DAYS,
        )?;
    }
    // The bricks' control sockets: root-only, like the daemon's own.
    let run_dir = config.state_dir.join("run");
    kiln_admin::durable::private_dir(&run_dir)?;
    let current: CurrentConfig = {
        let store = store.clone();
        Arc::new(move |name: &str| store.read(|c, g| c.volumes.get(name).cloned().map(|v| (v, g))))
    };
    let supervisor = Supervisor::new(
        Launch {
            brickd: config.brickd.clone(),
            tls_dir: tls_dir.clone(),
            log_dir: log_dir.clone(),
            listen_ip: config.listen_ip,
            run_dir,
            host: config.host.clone(),
            bricks_outlive_daemon: config.etcd.is_some(),
        },
        current,
    );
    let tasks = Arc::new(Tasks {
        kiln: config.kiln.clone(),
        socket: config.socket.clone(),
        tls_dir,
        log_dir,
        listen_ip: config.listen_ip,
        host: config.host.clone(),
        etcd: store.etcd().map(|etcd| etcd.etcd().clone()),
        runners: Default::default(),
    });
    let daemon = Arc::new(Daemon {
        config,
        store,
        supervisor,
        reconciling: tokio::sync::Mutex::new(HashMap::new()),
        applied: tokio::sync::watch::Sender::new(0),
        reporter: std::sync::Mutex::new(None),
        left: tokio::sync::Notify::new(),
        tasks: tasks.clone(),
    });
    // Subscribed before the first reconciliation, so no generation falls between them.
    let generations = daemon.store.subscribe();
    daemon.reconcile().await;
    daemon.supervisor.stop_orphans().await;
    let reconciler = tokio::spawn(daemon.clone().reconcile_forever(generations));
    let (mut answering, mut asking) = (None, None);
    let leading = {
        let tasks = tasks.clone();
        tokio::spawn(async move { tasks.run_forever().await })
    };
    if let Some(etcd) = daemon.store.etcd() {
        let etcd = etcd.etcd().clone();
        let reporting = daemon.clone();
        let host = reporting.config.host.clone().unwrap_or_default();
        let applied = daemon.applied.subscribe();
        let reporter = tokio::spawn(crate::cluster::report_forever(
            etcd.clone(),
            host.clone(),
            async move || reporting.host_report().await,
            applied,
        ));
        *crate::lock(&daemon.reporter) = Some(reporter);
        let asked = daemon.clone();
        asking = Some(tokio::spawn(fanout::answer_asks_forever(
            etcd.clone(),
            host.clone(),
            async move |query, volume: &str| asked.local_reports(query, volume).await,
        )));
        // A host that may issue certificates answers the joins of new hosts.
        let tls_dir = daemon.config.state_dir.join("tls");
        if pki::holds_ca_key(&tls_dir) {
            answering = Some(tokio::spawn(membership::answer_joins_forever(
                etcd, tls_dir, host,
            )));
        }
    }

    tracing::info!(socket = %daemon.config.socket.display(), "listening");
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let daemon = daemon.clone();
                    tokio::spawn(async move {
                        if let Err(e) = daemon.serve(stream).await {
                            tracing::debug!(error = %e, "client connection");
                        }
                    });
                }
                Err(e) => tracing::warn!(error = %e, "accept failed"),
            },
            () = &mut shutdown => break,
            () = daemon.left.notified() => break,
        }
    }
    reconciler.abort();
    leading.abort();
    for task in [crate::lock(&daemon.reporter).take(), answering, asking]
        .into_iter()
        .flatten()
    {
        task.abort();
    }
    tasks.kill_all();
    if daemon.config.etcd.is_some() {
        tracing::info!("leaving the bricks running (the next daemon adopts them)");
        daemon.supervisor.leave_all();
    } else {
        tracing::info!("stopping bricks");
        daemon.supervisor.stop_all().await;
    }
    let _ = std::fs::remove_file(&daemon.config.socket);
    Ok(())
}

/// Opens the configuration store the daemon is told to use.
async fn open_store(config: &DaemonConfig, tls_dir: &Path) -> anyhow::Result<ConfigStore<Cluster>> {
    let Some(target) = &config.etcd else {
        let dir = config.state_dir.join("store");
        let (store, report) = LogStore::<Cluster>::open(&dir, StoreOptions::default())
            .context("cannot open the configuration store")?;
        if let Some(dropped) = &report.dropped_tail {
            tracing::warn!(
                offset = dropped.offset,
                bytes = dropped.bytes,
                reason = %dropped.reason,
                "dropped a torn or corrupt record at the end of the store"
            );
        }
        tracing::info!(generation = report.generation, "configuration loaded");
        return Ok(ConfigStore::Log(store));
    };
    let Some(host) = config.host.as_deref() else {
        anyhow::bail!("a daemon of a cluster on etcd needs its host's name (--host)");
    };
    let (deadline, mut pause) = (Instant::now() + ETCD_START_WAIT, ETCD_START_PAUSE_MIN);
    let store = loop {
        match open_etcd_store(target, tls_dir, host).await {
            Err(e) if unanswered(&e) && Instant::now() + pause < deadline => {
                tracing::warn!(error = %format!("{e:#}"), "etcd does not answer yet; trying again in {pause:?}");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(ETCD_START_PAUSE_MAX);
            }
            opened => break opened?,
        }
    };
    tracing::info!(
        cluster = %target.cluster,
        generation = store.generation(),
        "configuration loaded from etcd"
    );
    Ok(ConfigStore::Etcd(Box::new(store)))
}

/// How long a daemon of a cluster keeps trying etcd at its start — an etcd started beside
/// it by the init system, or a cluster electing a leader — before it gives up.
const ETCD_START_WAIT: Duration = Duration::from_secs(60);
/// The first and the longest pause between two tries.
const ETCD_START_PAUSE_MIN: Duration = Duration::from_millis(100);
const ETCD_START_PAUSE_MAX: Duration = Duration::from_secs(5);

/// The configuration in etcd at `target`, once this host's CA is the cluster's (or the
/// cluster's first) and `host` is a member.
async fn open_etcd_store(
    target: &EtcdTarget,
    tls_dir: &Path,
    host: &str,
) -> anyhow::Result<EtcdStore<Cluster>> {
    let store = EtcdStore::<Cluster>::open(target.clone())
        .await
        .context("cannot open the configuration in etcd")?;
    crate::cluster::check_ca(store.etcd(), tls_dir).await?;
    membership::register(store.etcd(), host).await?;
    Ok(store)
}

/// Whether `e` came of etcd not answering, so trying again may succeed.
fn unanswered(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<StoreError>(),
            Some(StoreError::EtcdUnanswered { .. })
        )
    })
}

/// Binds the command socket, root-only ([`kiln_admin::exchange::bind_private`]), unless
/// another daemon answers there.
fn bind_socket(path: &Path) -> anyhow::Result<UnixListener> {
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        anyhow::bail!("another kiln-mgmtd is listening on {}", path.display());
    }
    Ok(kiln_admin::exchange::bind_private(path)?)
}

impl Daemon {
    async fn serve(&self, mut stream: UnixStream) -> Result<(), ExchangeError> {
        let (leave, response) = match EXCHANGE.read_request::<Request>(&mut stream).await {
            Ok(request) => (request == Request::ClusterLeave, self.handle(request).await),
            Err(e) => {
                let message = format!("bad request: {e}");
                (false, Response::Error { message })
            }
        };
        let written = EXCHANGE.write_answer(&mut stream, &response).await;
        // (Only once the host's leave is answered does the daemon stop.)
        if leave && matches!(response, Response::Done { .. }) {
            self.left.notify_one();
        }
        written
    }

    async fn handle(&self, request: Request) -> Response {
        match self.handle_inner(request).await {
            Ok(response) => response,
            Err(e) => Response::Error {
                message: format!("{e:#}"),
            },
        }
    }

    async fn commit(&self, change: Change) -> anyhow::Result<u64> {
        self.store.commit(vec![change]).await.map_err(|e| match e {
            CommitError::Rejected(e) => anyhow::Error::from(e),
            CommitError::Store(
                e @ (StoreError::Etcd { .. } | StoreError::EtcdUnanswered { .. }),
            ) => anyhow::Error::from(e)
                .context("the change may or may not have been saved (etcd did not answer)"),
            CommitError::Store(e) => anyhow::Error::from(e).context("the change was not saved"),
        })
    }

    fn volume(&self, name: &str) -> anyhow::Result<Volume> {
        Ok(self.store.read(|c, _| c.volume(name).cloned())?)
    }

    async fn handle_inner(&self, request: Request) -> anyhow::Result<Response> {
        match request {
            Request::VolumeCreate { name, bricks, port } => {
                self.create_volume(&name, &bricks, port).await
            }
            Request::VolumeAddBrick { name, brick, port } => {
                self.add_brick(&name, brick, port).await
            }
            Request::VolumeDelete { name } => self.delete_volume(&name).await,
            Request::VolumeStart { name } => self.start_volume(&name).await,
            Request::VolumeStop { name } => self.stop_volume(&name).await,
            Request::VolumeInfo { name } => self.volume_info(name.as_deref()),
            Request::VolumeStatus { name } => self.volume_status(&name).await,
            Request::VolumeSet { name, key, value } => self.set_option(&name, &key, &value).await,
            Request::VolumeGet { name, key } => self.get_options(&name, key.as_deref()),
            Request::VolumeReset { name, key } => self.reset_option(&name, key).await,
            Request::VolumeProfile { name, action } => self.profile(&name, action).await,
            Request::VolumeStatedump { name } => self.statedump(&name).await,
            Request::ClusterStatus => self.cluster_status().await,
            Request::ClusterToken { valid_secs } => self.token(valid_secs).await,
            Request::ClusterLeave => self.leave().await,
            Request::Rebalance { name, action } => self.rebalance(&name, action).await,
            Request::VolumeRemoveBrick {
                name,
                brick,
                action,
            } => self.remove_brick(&name, &brick, action).await,
        }
    }
}

/// The answer to a command that committed a change.
fn done(generation: u64, message: String) -> Response {
    Response::Done {
        generation,
        message,
    }
}
