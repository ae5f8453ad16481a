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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use kiln_admin::command::{
    BrickReport, BrickStatus, ClusterStatus, EXCHANGE, HostReport, OptionValue, ProfileAction,
    RemoveAction, Request, Response, TaskAction,
};
use kiln_admin::exchange::ExchangeError;
use kiln_admin::options;
use kiln_admin::pki::{self, Role};
use kiln_admin::volume::{Brick, BrickRole, Volume, VolumeState};
use tokio::net::{UnixListener, UnixStream};

use crate::fanout::{self, Query};
use crate::membership;
use crate::store::etcd::{EtcdStore, EtcdTarget};
use crate::store::{CommitError, ConfigStore, LogStore, StoreOptions};
use crate::supervisor::{CurrentConfig, Launch, Supervisor};
use crate::tasks::Tasks;
use crate::volume::{BRICK_PORT_BASE, Change, Cluster, ConfigError};

/// The options `kiln volume profile VOL start|stop` switches.
const PROFILE_OPTIONS: [&str; 2] = [
    "diagnostics.count-fop-hits",
    "diagnostics.latency-measurement",
];

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

/// How long `volume set` waits for the bricks of other hosts to report a change applied.
const REMOTE_APPLY_WAIT: Duration = Duration::from_secs(5);
/// How long `remove-brick … stop` waits for the rebalance to finish the file it is moving.
const TASK_STOP_WAIT: Duration = Duration::from_secs(120);
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
    if config.host.is_none() {
        anyhow::bail!("a daemon of a cluster on etcd needs its host's name (--host)");
    }
    let store = EtcdStore::<Cluster>::open(target.clone())
        .await
        .context("cannot open the configuration in etcd")?;
    crate::cluster::check_ca(store.etcd(), tls_dir).await?;
    membership::register(store.etcd(), config.host.as_deref().unwrap_or_default()).await?;
    tracing::info!(
        cluster = %target.cluster,
        generation = store.generation(),
        "configuration loaded from etcd"
    );
    Ok(ConfigStore::Etcd(Box::new(store)))
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
            CommitError::Store(e @ crate::store::StoreError::Etcd { .. }) => anyhow::Error::from(e)
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

    // Keeping the bricks here what the configuration says.

    /// Reconciles after every new generation (another daemon's commits included) until the
    /// daemon stops.
    async fn reconcile_forever(
        self: Arc<Self>,
        mut generations: tokio::sync::watch::Receiver<u64>,
    ) {
        loop {
            // (Again when a removed brick's grace ends.)
            let grace_ends = self.reconciling.lock().await.values().min().copied();
            let grace_ends = grace_ends.map(|seen| seen + REMOVED_BRICK_GRACE);
            tokio::select! {
                changed = generations.changed() => if changed.is_err() {
                    return;
                },
                () = sleep_until(grace_ends) => {}
            }
            self.reconcile().await;
        }
    }

    /// Brings the bricks of this host in line with the configuration: those of started
    /// volumes run (made and formatted first if new), the others stop, and running ones get
    /// live options changed elsewhere.
    async fn reconcile(&self) {
        let mut removed = self.reconciling.lock().await;
        let seen_before = std::mem::take(&mut *removed);
        let (cluster, generation) = self.store.read(|c, g| (c.clone(), g));
        let foreign = self
            .store
            .etcd()
            .map_or(0, |etcd| etcd.foreign_generation());
        let previous = *self.applied.borrow();
        let before = self.supervisor.running_names();
        let mut pushed = false;
        let mut wanted = HashSet::new();
        for volume in cluster.volumes.values() {
            if volume.state != VolumeState::Started {
                continue;
            }
            for i in self.supervisor.local_bricks(volume) {
                let name = Brick::name(&volume.name, i);
                // (Formatting runs a process and issuing makes a key: off the runtime's
                // threads' way.)
                if !self.supervisor.is_running(&name)
                    && let Err(e) = tokio::task::block_in_place(|| {
                        self.prepare_brick(&volume.name, i, &volume.bricks[i])
                    })
                {
                    tracing::error!(brick = %name, error = %format!("{e:#}"), "cannot prepare brick");
                }
                wanted.insert(name);
            }
            self.keep_removed_awhile(volume, &seen_before, &mut removed, &mut wanted);
            self.supervisor.start_volume(volume);
            if self.supervisor.options_changed(volume) {
                self.supervisor.push(volume, generation).await;
                pushed = true;
            }
        }
        self.supervisor.stop_unwanted(&wanted).await;
        // The host's report is renewed at once when its bricks changed, or when they were
        // given options another daemon committed (its `volume set` waits for the report);
        // otherwise at its next tick, sparing etcd a write (half the writes of a `volume set`
        // made here on a started volume).
        let acted = (pushed && foreign > previous) || self.supervisor.running_names() != before;
        self.applied.send_if_modified(|applied| {
            *applied = generation;
            acted
        });
    }

    /// Adds to `wanted` the bricks of `volume` removed while running here less than
    /// [`REMOVED_BRICK_GRACE`] ago, noting in `removed` when each was first seen removed
    /// (`seen_before`, or now).
    fn keep_removed_awhile(
        &self,
        volume: &Volume,
        seen_before: &HashMap<String, Instant>,
        removed: &mut HashMap<String, Instant>,
        wanted: &mut HashSet<String>,
    ) {
        for (i, brick) in volume.bricks.iter().enumerate() {
            let name = Brick::name(&volume.name, i);
            if brick.role.in_service()
                || !self.supervisor.is_local(brick)
                || !self.supervisor.is_running(&name)
            {
                continue;
            }
            let seen = seen_before.get(&name).copied().unwrap_or_else(Instant::now);
            if seen.elapsed() < REMOVED_BRICK_GRACE {
                removed.insert(name.clone(), seen);
                wanted.insert(name);
            }
        }
    }

    /// This host as its daemon reports it into etcd: its bricks, each probed.
    async fn host_report(&self) -> HostReport {
        let volumes: Vec<Volume> = self
            .store
            .read(|cluster, _| cluster.volumes.values().cloned().collect());
        // Every brick probed at once: a hung one costs one timeout, well within the lease.
        let checked = futures_util::future::join_all(
            volumes.iter().map(|v| self.supervisor.checked_status(v)),
        )
        .await;
        let mut bricks = BTreeMap::new();
        for (volume, status) in volumes.iter().zip(checked) {
            for (i, brick) in status.into_iter().enumerate() {
                if self.supervisor.is_local(&volume.bricks[i]) {
                    bricks.insert(Brick::name(&volume.name, i), brick);
                }
            }
        }
        HostReport {
            host: self.config.host.clone().unwrap_or_default(),
            listen_ip: self.config.listen_ip,
            daemon_pid: std::process::id(),
            generation: *self.applied.borrow(),
            bricks,
        }
    }

    /// Every host whose daemon reports (this one alone without etcd).
    async fn host_reports(&self) -> anyhow::Result<Vec<HostReport>> {
        match self.store.etcd() {
            Some(etcd) => crate::cluster::hosts(etcd.etcd()).await,
            None => Ok(vec![self.host_report().await]),
        }
    }

    async fn cluster_status(&self) -> anyhow::Result<Response> {
        let store = match self.store.etcd() {
            Some(etcd) => format!("etcd {}", etcd.etcd().target().endpoints.join(",")),
            None => "embedded".to_owned(),
        };
        let hosts = self.host_reports().await?;
        let (down, leader) = match self.store.etcd() {
            Some(etcd) => (
                membership::members(etcd.etcd())
                    .await?
                    .into_iter()
                    .filter(|member| !hosts.iter().any(|h| &h.host == member))
                    .collect(),
                crate::tasks::leader(etcd.etcd()).await?,
            ),
            None => (Vec::new(), self.config.host.clone()),
        };
        Ok(Response::Cluster(ClusterStatus {
            store,
            generation: self.store.generation(),
            hosts,
            down,
            leader,
        }))
    }

    async fn token(&self, valid_secs: u64) -> anyhow::Result<Response> {
        let etcd = self.cluster_etcd()?;
        let tls_dir = self.config.state_dir.join("tls");
        if !pki::holds_ca_key(&tls_dir) {
            anyhow::bail!(
                "this host does not hold the cluster CA's key: make the token on one that does"
            );
        }
        let cluster = &etcd.etcd().target().cluster;
        let valid = Duration::from_secs(valid_secs);
        let token = kiln_admin::join::Token::new(&tls_dir, cluster, valid)?;
        Ok(Response::Token {
            token: token.to_string(),
            valid_secs,
        })
    }

    /// Leaves the cluster if no volume has a brick here: the host is no longer a member,
    /// its report stops, its cluster file goes, and the daemon stops.
    async fn leave(&self) -> anyhow::Result<Response> {
        let etcd = self.cluster_etcd()?;
        let bricks: Vec<String> = self.store.read(|cluster, _| {
            let volumes = cluster.volumes.values();
            volumes
                .flat_map(|v| {
                    let local = self.supervisor.local_bricks(v);
                    local.map(|i| Brick::name(&v.name, i))
                })
                .collect()
        });
        if !bricks.is_empty() {
            anyhow::bail!(
                "bricks of this host are in volumes ({}): delete them or move their data first",
                bricks.join(", ")
            );
        }
        let host = self.config.host.as_deref().unwrap_or_default();
        let serial = self.revoke_everywhere(etcd, host).await?;
        if let Some(reporter) = crate::lock(&self.reporter).take() {
            reporter.abort();
        }
        membership::leave(etcd.etcd(), host).await?;
        membership::ClusterFile::remove(&self.config.state_dir)?;
        Ok(done(
            self.store.generation(),
            format!(
                "host {host} left cluster {}; its client certificate ({serial}) is revoked in \
                 every volume; its daemon stops (it starts on the embedded store next time)",
                etcd.etcd().target().cluster
            ),
        ))
    }

    /// Revokes this host's client certificate in every volume: recorded first, so volumes
    /// created from then on take it (`membership::revoked`), then added to each volume's
    /// `auth.revoked` as it is now (pushed live), until none lacks it; its serial.
    async fn revoke_everywhere(
        &self,
        etcd: &EtcdStore<Cluster>,
        host: &str,
    ) -> anyhow::Result<String> {
        let tls_dir = self.config.state_dir.join("tls");
        let cert = pki::identity_files(&tls_dir, &Role::Client, pki::ADMIN_CLIENT).cert;
        let serial = pki::serial_of(&cert)
            .with_context(|| format!("the serial of this host's certificate {}", cert.display()))?;
        membership::revoke(etcd.etcd(), &serial, host).await?;
        // (Again for a volume created while the record was written.)
        for _ in 0..REVOKE_ROUNDS {
            let lacking: Vec<(String, String)> = self.store.read(|cluster, _| {
                let revoked = |v: &Volume| v.options.get(REVOKED).cloned().unwrap_or_default();
                let volumes = cluster
                    .volumes
                    .values()
                    .map(|v| (v.name.clone(), revoked(v)));
                volumes
                    .filter(|(_, r)| !r.split(',').any(|s| s == serial))
                    .collect()
            });
            if lacking.is_empty() {
                return Ok(serial);
            }
            for (name, revoked) in lacking {
                let revoked = with_revoked(&revoked, std::slice::from_ref(&serial))?;
                self.set_option(&name, REVOKED, &revoked).await?;
            }
        }
        anyhow::bail!("volumes kept appearing without this host's certificate revoked: try again")
    }

    /// `kiln volume rebalance NAME start|fix-layout|status|stop` (and `heal`): run by this
    /// daemon, or on a cluster by the elected one (`tasks`).
    async fn rebalance(&self, name: &str, action: TaskAction) -> anyhow::Result<Response> {
        let status = match action.starts() {
            Some(kind) => {
                must_be_started(&self.volume(name)?)?;
                self.tasks.start(name, kind).await?
            }
            None if action == TaskAction::Status => self.tasks.status(name).await?,
            None => self.tasks.stop(name).await?,
        };
        Ok(Response::Rebalance(status))
    }

    /// `kiln volume remove-brick NAME BRICK start|status|stop|commit`.
    async fn remove_brick(
        &self,
        name: &str,
        spec: &Path,
        action: RemoveAction,
    ) -> anyhow::Result<Response> {
        let (host, path) = self.brick_place(spec)?;
        let volume = self.volume(name)?;
        let index = volume
            .bricks_in_service()
            .find(|(_, b)| b.host == host && b.path == path)
            .map(|(i, _)| i)
            .with_context(|| format!("volume {name} has no brick {}", spec.display()))?;
        let brick = volume.bricks[index].display();
        let role = |role| Change::SetBrickRole {
            volume: name.to_owned(),
            index,
            role,
        };
        // The last task's status is forgotten when the brick starts or stops leaving: a
        // removal is committed only on a rebalance that began with the brick leaving.
        match action {
            RemoveAction::Start => {
                must_be_started(&volume)?;
                self.no_task_running(name).await?;
                self.tasks.forget(name).await?;
                if volume.bricks[index].role != BrickRole::Leaving {
                    self.commit(role(BrickRole::Leaving)).await?;
                }
                self.rebalance(name, TaskAction::Start).await
            }
            RemoveAction::Status => self.rebalance(name, TaskAction::Status).await,
            RemoveAction::Stop => {
                self.store.read(|cluster, _| {
                    crate::store::State::check(cluster, &role(BrickRole::Serving))
                })?;
                if self.tasks.is_live(name).await? {
                    // (One that ended meanwhile has nothing to stop.)
                    if let Err(e) = self.tasks.stop(name).await {
                        tracing::info!(volume = %name, error = %format!("{e:#}"), "no task to stop");
                    }
                    self.tasks.wait_until_ended(name, TASK_STOP_WAIT).await?;
                }
                self.tasks.forget(name).await?;
                let generation = self.commit(role(BrickRole::Serving)).await?;
                Ok(done(
                    generation,
                    format!(
                        "brick {brick} of volume {name} serves again; the files moved off it \
                         stay where they are"
                    ),
                ))
            }
            RemoveAction::Commit => {
                let last = self.tasks.status(name).await.ok();
                if !last.as_ref().is_some_and(|s| s.emptied(index)) {
                    let how = match last {
                        Some(s) if s.is_live() => "its rebalance is still running".to_owned(),
                        Some(s) if s.leaving.contains(&index) => format!(
                            "its last rebalance {} with {} entries left on it and {} failed",
                            s.state, s.report.left_on_leaving, s.report.failed
                        ),
                        _ => "no rebalance has emptied it".to_owned(),
                    };
                    anyhow::bail!(
                        "brick {brick} still holds files of volume {name} ({how}): run \
                         `kiln volume remove-brick {name} {brick} start` until it completes"
                    );
                }
                let generation = self.commit(role(BrickRole::Removed)).await?;
                self.reconcile().await;
                Ok(done(
                    generation,
                    format!(
                        "brick {brick} removed from volume {name}; it holds none of the \
                         volume's files now and its directory may be deleted"
                    ),
                ))
            }
            // The files on it leave the volume; a rebalance lays every directory out over
            // the bricks left and removes the link files that pointed at it.
            RemoveAction::Force => {
                self.no_task_running(name).await?;
                self.tasks.forget(name).await?;
                if volume.bricks[index].role == BrickRole::Serving {
                    self.commit(role(BrickRole::Leaving)).await?;
                }
                let generation = self.commit(role(BrickRole::Removed)).await?;
                self.reconcile().await;
                if volume.state != VolumeState::Started {
                    return Ok(done(
                        generation,
                        format!(
                            "brick {brick} removed from volume {name} with the files on it; \
                             run `kiln volume rebalance {name} start` once the volume is \
                             started"
                        ),
                    ));
                }
                self.rebalance(name, TaskAction::Start).await
            }
        }
    }

    /// Refuses while a rebalance or heal of volume `name` runs.
    async fn no_task_running(&self, name: &str) -> anyhow::Result<()> {
        if self.tasks.is_live(name).await? {
            anyhow::bail!(
                "a rebalance or heal of {name} is running: `kiln volume rebalance {name} stop` \
                 it first"
            );
        }
        Ok(())
    }

    fn cluster_etcd(&self) -> anyhow::Result<&EtcdStore<Cluster>> {
        self.store
            .etcd()
            .context("this daemon keeps its configuration on this host, not in a cluster on etcd")
    }

    // The volume's lifecycle: create, delete, start, stop.

    async fn create_volume(
        &self,
        name: &str,
        bricks: &[PathBuf],
        port: Option<u16>,
    ) -> anyhow::Result<Response> {
        let mut volume = self.prepare_volume(name, bricks, port)?;
        // The client certificates of hosts that left the cluster are refused here too.
        if let Some(etcd) = self.store.etcd() {
            let serials = membership::revoked(etcd.etcd()).await?;
            if !serials.is_empty() {
                let revoked = with_revoked("", &serials)?;
                volume.options.insert(REVOKED.to_owned(), revoked);
            }
        }
        let generation = self.commit(Change::Create(volume)).await?;
        Ok(done(
            generation,
            format!("volume {name} created; start it with `kiln volume start {name}`"),
        ))
    }

    async fn add_brick(
        &self,
        name: &str,
        spec: PathBuf,
        port: Option<u16>,
    ) -> anyhow::Result<Response> {
        let (host, path) = self.brick_place(&spec)?;
        let (brick, change, index) = self.store.read(|cluster, _| {
            let port = port.unwrap_or_else(|| self.free_port(cluster, host.as_deref(), &[]));
            let brick = Brick::new(host, path, port);
            let change = Change::AddBrick {
                volume: name.to_owned(),
                brick: brick.clone(),
            };
            crate::store::State::check(cluster, &change)?;
            Ok::<_, ConfigError>((brick, change, cluster.volume(name)?.bricks.len()))
        })?;
        if self.supervisor.is_local(&brick) {
            self.prepare_brick(name, index, &brick)?;
        }
        let (shown, port) = (brick.display(), brick.port);
        let generation = self.commit(change).await?;
        self.reconcile().await;
        Ok(done(
            generation,
            format!(
                "brick {shown} added to volume {name} as brick {index} (port {port}); \
                 `kiln volume rebalance {name} fix-layout` gives it a share of every directory"
            ),
        ))
    }

    /// The host and path a brick given as `HOST:PATH` or `PATH` (this host) lives at. A
    /// single-node daemon serves only its own host's.
    fn brick_place(&self, spec: &Path) -> anyhow::Result<(Option<String>, PathBuf)> {
        let (host, path) = Brick::split_spec(spec);
        match (host, &self.config.host) {
            (None, own) => Ok((own.clone(), path)),
            (Some(host), Some(own)) if self.store.etcd().is_some() || &host == own => {
                Ok((Some(host), path))
            }
            (Some(host), _) => anyhow::bail!(
                "brick {} is on host {host}: a volume over several hosts needs a cluster on \
                 etcd (`kiln-mgmtd --etcd URL --host NAME`)",
                spec.display()
            ),
        }
    }

    async fn delete_volume(&self, name: &str) -> anyhow::Result<Response> {
        self.refuse_while_rebalancing(name).await?;
        let generation = self
            .commit(Change::Delete {
                volume: name.to_owned(),
            })
            .await?;
        if let Err(e) = self.tasks.forget(name).await {
            tracing::warn!(volume = %name, error = %format!("{e:#}"), "the last task's record is left");
        }
        Ok(done(
            generation,
            format!("volume {name} deleted; its brick directories and data are left on disk"),
        ))
    }

    /// A volume is not stopped or deleted under its rebalance or heal.
    async fn refuse_while_rebalancing(&self, name: &str) -> anyhow::Result<()> {
        if self.tasks.is_live(name).await? {
            anyhow::bail!(
                "a rebalance or heal of {name} is asked or running: `kiln volume rebalance \
                 {name} stop` first"
            );
        }
        Ok(())
    }

    async fn start_volume(&self, name: &str) -> anyhow::Result<Response> {
        let generation = self
            .commit(Change::Start {
                volume: name.to_owned(),
            })
            .await?;
        self.reconcile().await;
        Ok(done(generation, format!("volume {name} started")))
    }

    /// Answers once this host's bricks of the volume have stopped (the reconciliation the
    /// commit sets off waits, so it cannot take them and answer for them); other hosts'
    /// daemons stop theirs as they see the change.
    async fn stop_volume(&self, name: &str) -> anyhow::Result<Response> {
        self.refuse_while_rebalancing(name).await?;
        let _reconciliation = self.reconciling.lock().await;
        let generation = self
            .commit(Change::Stop {
                volume: name.to_owned(),
            })
            .await?;
        self.supervisor.stop_volume(&self.volume(name)?).await;
        Ok(done(generation, format!("volume {name} stopped")))
    }

    // Options: set, get, reset.

    async fn set_option(&self, name: &str, key: &str, value: &str) -> anyhow::Result<Response> {
        let value = options::find(key)?.parse(value)?;
        let generation = self
            .commit(Change::Set {
                volume: name.to_owned(),
                key: key.to_owned(),
                value: value.clone(),
            })
            .await?;
        let apply = options::find(key)?.apply;
        let note = self.apply_to_bricks(name, generation, apply).await?;
        Ok(done(
            generation,
            format!("{key} = {value} on volume {name}{note}"),
        ))
    }

    fn get_options(&self, name: &str, key: Option<&str>) -> anyhow::Result<Response> {
        let volume = self.volume(name)?;
        let keys: Vec<&str> = match key {
            Some(k) => vec![options::find(k)?.key],
            None => options::OPTIONS.iter().map(|o| o.key).collect(),
        };
        let options = keys
            .into_iter()
            .map(|k| OptionValue {
                key: k.to_owned(),
                value: options::effective(&volume.options, k).to_string(),
                set: volume.options.contains_key(k),
            })
            .collect();
        Ok(Response::Options { options })
    }

    async fn reset_option(&self, name: &str, key: Option<String>) -> anyhow::Result<Response> {
        let generation = self
            .commit(Change::Reset {
                volume: name.to_owned(),
                key: key.clone(),
            })
            .await?;
        let apply = match &key {
            Some(k) => options::find(k)?.apply,
            None => options::Apply::Live,
        };
        let note = self.apply_to_bricks(name, generation, apply).await?;
        let what = key.unwrap_or_else(|| "every option".to_owned());
        Ok(done(
            generation,
            format!("{what} reset to the default on volume {name}{note}"),
        ))
    }

    // Reports: info, status, profile, statedump.

    fn volume_info(&self, name: Option<&str>) -> anyhow::Result<Response> {
        Ok(self.store.read(|c, generation| {
            let volumes = match name {
                Some(n) => vec![c.volume(n)?.clone()],
                None => c.volumes.values().cloned().collect(),
            };
            Ok::<_, ConfigError>(Response::Volumes {
                generation,
                volumes,
            })
        })?)
    }

    /// Each brick's status: this host's probed here, other hosts' as their daemons report.
    async fn volume_status(&self, name: &str) -> anyhow::Result<Response> {
        let volume = self.volume(name)?;
        let mut bricks = self.supervisor.checked_status(&volume).await;
        if self.store.etcd().is_some() {
            let reports = self.host_reports().await?;
            for (i, status) in bricks.iter_mut().enumerate() {
                let brick = &volume.bricks[i];
                if !self.supervisor.is_local(brick) && brick.role.in_service() {
                    *status = remote_status(&reports, &Brick::name(name, i), brick);
                }
            }
        }
        Ok(Response::Status { bricks })
    }

    async fn profile(&self, name: &str, action: ProfileAction) -> anyhow::Result<Response> {
        let volume = self.volume(name)?;
        if volume.state != VolumeState::Started {
            anyhow::bail!("volume {name} is not started");
        }
        let generation = match action {
            ProfileAction::Info => self.store.read(|_, generation| generation),
            ProfileAction::Start | ProfileAction::Stop => {
                self.switch_profiling(name, action == ProfileAction::Start)
                    .await?
            }
        };
        let local = self.supervisor.profiles(&volume).await;
        Ok(Response::Profiles {
            generation,
            bricks: self.cluster_wide(&volume, Query::Profile, local).await?,
        })
    }

    /// The reports of every brick of `volume`: `local`, one per brick, as this host's bricks
    /// answered, with those of the other hosts' bricks as their daemons answer (on a cluster).
    async fn cluster_wide<T: serde::de::DeserializeOwned>(
        &self,
        volume: &Volume,
        query: Query,
        mut local: Vec<BrickReport<T>>,
    ) -> anyhow::Result<Vec<BrickReport<T>>> {
        let Some(etcd) = self.store.etcd() else {
            return Ok(local);
        };
        assert_eq!(local.len(), volume.bricks.len(), "one report per brick");
        let remote = |b: &&Brick| !self.supervisor.is_local(b);
        let hosts: std::collections::BTreeSet<String> = volume
            .bricks
            .iter()
            .filter(remote)
            .filter_map(|b| b.host.clone())
            .collect();
        let hosts: Vec<String> = hosts.into_iter().collect();
        let mut answers = fanout::ask_hosts::<T>(etcd.etcd(), query, &volume.name, &hosts).await?;
        for (i, brick) in volume.bricks.iter().enumerate() {
            if self.supervisor.is_local(brick) || !brick.role.in_service() {
                continue;
            }
            let host = brick.host.clone().unwrap_or_default();
            let name = Brick::name(&volume.name, i);
            let answered = answers.get_mut(&host);
            let error = match &answered {
                Some(_) => format!("host {host} does not run it"),
                None => format!(
                    "host {host} did not answer within {:?}",
                    fanout::ANSWER_WAIT
                ),
            };
            let found = answered.and_then(|reports| {
                Some(reports.swap_remove(reports.iter().position(|r| r.brick == name)?))
            });
            local[i] = found.unwrap_or_else(|| BrickReport {
                brick: name,
                path: brick.path.clone(),
                report: None,
                error: Some(error),
            });
        }
        Ok(local)
    }

    /// `query` answered for the bricks of `volume` this host runs (another host asks), as
    /// JSON.
    async fn local_reports(&self, query: Query, volume: &str) -> serde_json::Value {
        let Ok(volume) = self.volume(volume) else {
            return serde_json::Value::Array(Vec::new());
        };
        let json = match query {
            Query::Profile => serde_json::to_value(
                self.local_only(&volume, self.supervisor.profiles(&volume).await),
            ),
            Query::Statedump => serde_json::to_value(
                self.local_only(&volume, self.supervisor.statedumps(&volume).await),
            ),
        };
        json.expect("reports encode")
    }

    /// The reports, one per brick of `volume`, of the bricks this host runs.
    fn local_only<T>(&self, volume: &Volume, reports: Vec<BrickReport<T>>) -> Vec<BrickReport<T>> {
        let bricks = volume.bricks.iter();
        bricks
            .zip(reports)
            .filter(|(brick, _)| self.supervisor.is_local(brick))
            .map(|(_, report)| report)
            .collect()
    }

    /// Sets the profiling options on or off and pushes them to the bricks; returns the
    /// generation of the last change.
    async fn switch_profiling(&self, name: &str, on: bool) -> anyhow::Result<u64> {
        let value = if on { "on" } else { "off" };
        let mut generation = 0;
        for key in PROFILE_OPTIONS {
            generation = self
                .commit(Change::Set {
                    volume: name.to_owned(),
                    key: key.to_owned(),
                    value: value.to_owned(),
                })
                .await?;
        }
        self.supervisor.push(&self.volume(name)?, generation).await;
        Ok(generation)
    }

    async fn statedump(&self, name: &str) -> anyhow::Result<Response> {
        let volume = self.volume(name)?;
        let local = self.supervisor.statedumps(&volume).await;
        let mut bricks = self.cluster_wide(&volume, Query::Statedump, local).await?;
        // Beside what each brick runs: every option of the volume as configured now.
        let configured: BTreeMap<String, String> = options::OPTIONS
            .iter()
            .map(|o| {
                let value = options::effective(&volume.options, o.key);
                (o.key.to_owned(), value.to_owned())
            })
            .collect();
        for report in bricks.iter_mut().filter_map(|b| b.report.as_mut()) {
            report.volume_options = Some(configured.clone());
        }
        Ok(Response::Statedumps {
            generation: self.store.read(|_, generation| generation),
            bricks,
        })
    }

    /// After a committed option change: pushes live options to a started volume's bricks and
    /// says which did not take them; restart options wait for the next brick start.
    async fn apply_to_bricks(
        &self,
        name: &str,
        generation: u64,
        apply: options::Apply,
    ) -> anyhow::Result<String> {
        let volume = self.volume(name)?;
        match apply {
            options::Apply::Mount => return Ok("; mounts use it from their next mount".into()),
            _ if volume.state != VolumeState::Started => return Ok(String::new()),
            options::Apply::Restart => {
                return Ok(
                    "; the bricks use it from their next start (`kiln volume stop` and `start`)"
                        .into(),
                );
            }
            options::Apply::Live => {}
        }
        let mut results = self.supervisor.push(&volume, generation).await;
        results.extend(self.remote_applied(&volume, generation).await?);
        let missing: Vec<String> = results
            .into_iter()
            .filter_map(|(brick, r)| r.err().map(|why| format!("{brick} ({why})")))
            .collect();
        Ok(match missing.is_empty() {
            true => format!(
                "; applied by {} running brick(s)",
                volume.bricks_in_service().count()
            ),
            false => format!(
                "; saved, but not yet applied by {}: they get it when they restart",
                missing.join(", ")
            ),
        })
    }

    /// Per brick of `volume` on other hosts: the generation its host's daemon has applied,
    /// once at `generation` or later (waiting up to [`REMOTE_APPLY_WAIT`] for the hosts that
    /// report), or why not.
    async fn remote_applied(
        &self,
        volume: &Volume,
        generation: u64,
    ) -> anyhow::Result<Vec<(String, Result<u64, String>)>> {
        let remote: Vec<(String, &Brick)> = volume
            .bricks_in_service()
            .map(|(i, brick)| (Brick::name(&volume.name, i), brick))
            .filter(|(_, brick)| !self.supervisor.is_local(brick))
            .collect();
        let Some(etcd) = self.store.etcd().filter(|_| !remote.is_empty()) else {
            return Ok(Vec::new());
        };
        let caught_up = |reports: &[HostReport]| {
            remote.iter().all(|(_, brick)| {
                report_of(reports, brick).is_none_or(|r| r.generation >= generation)
            })
        };
        let deadline = Instant::now() + REMOTE_APPLY_WAIT;
        let reports = crate::cluster::wait_for_hosts(etcd.etcd(), caught_up, deadline).await?;
        let results = remote
            .iter()
            .map(|(name, brick)| {
                let status = remote_status(&reports, name, brick);
                let applied = report_of(&reports, brick).map_or(0, |r| r.generation);
                let result = match status.pid {
                    Some(_) if applied >= generation => Ok(applied),
                    Some(_) => Err(format!("its host has applied generation {applied}")),
                    None => Err(format!("{}: {}", status.state, status.health)),
                };
                (name.clone(), result)
            })
            .collect();
        Ok(results)
    }

    /// The port a new brick of `host` gets when none is given: the lowest from
    /// [`BRICK_PORT_BASE`] that no brick of `cluster`, none of `taken` and no process here
    /// holds.
    fn free_port(&self, cluster: &Cluster, host: Option<&str>, taken: &[u16]) -> u16 {
        cluster.free_port(host, BRICK_PORT_BASE, taken, |p| {
            self.supervisor.port_is_free(host, p)
        })
    }

    /// Checks a new volume, formats its brick directories and issues their certificates.
    fn prepare_volume(
        &self,
        name: &str,
        specs: &[PathBuf],
        port: Option<u16>,
    ) -> anyhow::Result<Volume> {
        let places = specs
            .iter()
            .map(|spec| self.brick_place(spec))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let volume = self.store.read(|cluster, _| {
            let mut bricks: Vec<Brick> = Vec::with_capacity(places.len());
            for (i, (host, path)) in places.into_iter().enumerate() {
                let taken: Vec<u16> = bricks
                    .iter()
                    .filter(|b| b.host == host)
                    .map(|b| b.port)
                    .collect();
                let port = match port {
                    Some(first) => first.saturating_add(u16::try_from(i).unwrap_or(u16::MAX)),
                    None => self.free_port(cluster, host.as_deref(), &taken),
                };
                bricks.push(Brick::new(host, path, port));
            }
            let volume = Volume {
                name: name.to_owned(),
                id: uuid(),
                bricks,
                options: Default::default(),
                state: VolumeState::Created,
            };
            crate::store::State::check(cluster, &Change::Create(volume.clone()))?;
            Ok::<_, ConfigError>(volume)
        })?;
        for (i, brick) in volume.bricks.iter().enumerate() {
            if self.supervisor.is_local(brick) {
                self.prepare_brick(name, i, brick)?;
            }
        }
        Ok(volume)
    }

    /// Makes and formats brick `index` of volume `name` if it is not a brick yet, and issues
    /// its certificate.
    fn prepare_brick(&self, name: &str, index: usize, brick: &Brick) -> anyhow::Result<()> {
        if !brick.path.join(".glusterfs").exists() {
            std::fs::create_dir_all(&brick.path)
                .with_context(|| format!("cannot create {}", brick.path.display()))?;
            let out = std::process::Command::new(&self.config.brickd)
                .arg("format")
                .arg(&brick.path)
                .output()
                .with_context(|| format!("cannot run {}", self.config.brickd.display()))?;
            if !out.status.success() {
                anyhow::bail!("{}", String::from_utf8_lossy(&out.stderr).trim());
            }
        }
        let mut hosts = vec!["localhost".into(), "127.0.0.1".into(), "::1".into()];
        hosts.extend(self.config.host.clone());
        hosts.push(self.config.listen_ip.to_string());
        hosts.dedup();
        // Issued once, and again only when it no longer serves (another CA, soon expired, a
        // host name missing): a brick keeps its identity across restarts.
        let tls_dir = self.config.state_dir.join("tls");
        let role = Role::Brick {
            hosts: hosts.clone(),
        };
        let brick_name = Brick::name(name, index);
        if pki::is_current(&tls_dir, &role, &brick_name) {
            return Ok(());
        }
        if pki::holds_ca_key(&tls_dir) {
            pki::issue(&tls_dir, &role, &brick_name, pki::CERT_VALIDITY_DAYS)?;
            return Ok(());
        }
        // A host that joined without the CA's key serves its bricks with the certificate it
        // was given at the join.
        if !pki::is_current(&tls_dir, &role, pki::HOST_IDENTITY) {
            anyhow::bail!(
                "this host cannot issue brick certificates (no CA key) and its host certificate \
                 is missing, expires within {} days or does not name all of {:?}: join again \
                 with `kiln cluster join … --name` for each",
                pki::RENEW_BEFORE_DAYS,
                hosts
            );
        }
        let host = pki::identity_files(&tls_dir, &role, pki::HOST_IDENTITY);
        let read = |path: &Path| {
            std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
        };
        pki::install(
            &tls_dir,
            &role,
            &brick_name,
            &read(&host.key)?,
            &read(&host.cert)?,
        )?;
        Ok(())
    }
}

/// The report of the host `brick` lives on, if that host reports.
fn report_of<'r>(reports: &'r [HostReport], brick: &Brick) -> Option<&'r HostReport> {
    let host = brick.host.as_deref().unwrap_or_default();
    reports.iter().find(|r| r.host == host)
}

/// Brick `name` of another host, as its daemon reports it; down when the host does not
/// report (its daemon or the host is gone, or it cannot reach etcd).
fn remote_status(reports: &[HostReport], name: &str, brick: &Brick) -> BrickStatus {
    let host = brick.host.as_deref().unwrap_or_default();
    let report = report_of(reports, brick);
    let health = match report {
        Some(_) => format!("host {host} does not run it"),
        None => format!("host {host} does not report"),
    };
    match report.and_then(|r| r.bricks.get(name)) {
        Some(status) => status.clone(),
        None => BrickStatus {
            host: brick.host.clone(),
            path: brick.path.clone(),
            port: brick.port,
            role: brick.role,
            pid: None,
            state: "down".to_owned(),
            uptime_secs: 0,
            restarts: 0,
            generation: None,
            health,
        },
    }
}

/// A task runs on a started volume only (its runner reaches the bricks).
fn must_be_started(volume: &Volume) -> anyhow::Result<()> {
    match volume.state {
        VolumeState::Started => Ok(()),
        state => {
            let name = &volume.name;
            anyhow::bail!("volume {name} is {state}; `kiln volume start {name}` first")
        }
    }
}

/// The option that lists revoked client certificates.
const REVOKED: &str = "auth.revoked";
/// Passes over the volumes that revoke a leaving host's certificate (a volume created during
/// one is seen by the next).
const REVOKE_ROUNDS: usize = 3;

/// `auth.revoked`'s value `current` with `serials` added, in canonical form.
fn with_revoked(current: &str, serials: &[String]) -> anyhow::Result<String> {
    let all: Vec<&str> = std::iter::once(current)
        .filter(|c| !c.is_empty())
        .chain(serials.iter().map(String::as_str))
        .collect();
    Ok(options::find(REVOKED)?.parse(&all.join(","))?)
}

/// Sleeps until `when`; forever without one.
async fn sleep_until(when: Option<Instant>) {
    match when {
        Some(when) => tokio::time::sleep_until(when.into()).await,
        None => std::future::pending().await,
    }
}

/// The answer to a command that committed a change.
fn done(generation: u64, message: String) -> Response {
    Response::Done {
        generation,
        message,
    }
}

/// A random version-4 UUID, in the form GlusterFS prints volume ids. (If the kernel cannot
/// give random bytes, `uuid` panics rather than hand out a predictable id.)
fn uuid() -> String {
    uuid::Uuid::new_v4().hyphenated().to_string()
}
