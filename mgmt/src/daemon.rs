//! `kiln-mgmtd`: the configuration store, the volume commands and the brick supervisor behind
//! one root-only Unix socket.
//!
//! State directory layout:
//!
//! ```text
//! <state>/store/       the durable configuration (see `store`)
//! <state>/tls/         the cluster CA, every brick's certificate and the `admin` client's
//! <state>/logs/        one log per brick
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use kiln_admin::command::{EXCHANGE, OptionValue, ProfileAction, Request, Response};
use kiln_admin::exchange::ExchangeError;
use kiln_admin::options;
use kiln_admin::pki::{self, Role};
use kiln_admin::volume::{Brick, Volume, VolumeState};
use tokio::net::{UnixListener, UnixStream};

use crate::store::{CommitError, Store, StoreOptions};
use crate::supervisor::{CurrentConfig, Launch, Supervisor};
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
    pub listen_ip: std::net::IpAddr,
}

struct Daemon {
    config: DaemonConfig,
    store: Arc<Store<Cluster>>,
    supervisor: Arc<Supervisor>,
}

/// Opens the store, starts the bricks of started volumes, and serves the socket until
/// `shutdown` completes; then stops the bricks.
pub async fn run(config: DaemonConfig, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let tls_dir = config.state_dir.join("tls");
    let log_dir = config.state_dir.join("logs");
    std::fs::create_dir_all(&log_dir)
        .with_context(|| format!("cannot create {}", log_dir.display()))?;
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
    let (store, report) =
        Store::<Cluster>::open(&config.state_dir.join("store"), StoreOptions::default())
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
    let store = Arc::new(store);
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
            tls_dir,
            log_dir,
            listen_ip: config.listen_ip,
            run_dir,
        },
        current,
    );
    let daemon = Arc::new(Daemon {
        config,
        store,
        supervisor,
    });
    daemon.store.read(|cluster, _| {
        for volume in cluster.volumes.values() {
            if volume.state == VolumeState::Started {
                daemon.supervisor.start_volume(volume);
            }
        }
    });

    let listener = bind_socket(&daemon.config.socket)?;
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
        }
    }
    tracing::info!("stopping bricks");
    daemon.supervisor.stop_all().await;
    let _ = std::fs::remove_file(&daemon.config.socket);
    Ok(())
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
        let response = match EXCHANGE.read_request::<Request>(&mut stream).await {
            Ok(request) => self.handle(request).await,
            Err(e) => Response::Error {
                message: format!("bad request: {e}"),
            },
        };
        EXCHANGE.write_answer(&mut stream, &response).await
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
        }
    }

    // The volume's lifecycle: create, delete, start, stop.

    async fn create_volume(
        &self,
        name: &str,
        bricks: &[PathBuf],
        port: Option<u16>,
    ) -> anyhow::Result<Response> {
        let volume = self.prepare_volume(name, bricks, port)?;
        let generation = self.commit(Change::Create(volume)).await?;
        Ok(done(
            generation,
            format!("volume {name} created; start it with `kiln volume start {name}`"),
        ))
    }

    async fn add_brick(
        &self,
        name: &str,
        path: PathBuf,
        port: Option<u16>,
    ) -> anyhow::Result<Response> {
        let (brick, change, index) = self.store.read(|cluster, _| {
            let brick = Brick {
                path,
                port: port.unwrap_or_else(|| cluster.free_port(BRICK_PORT_BASE, &[])),
            };
            let change = Change::AddBrick {
                volume: name.to_owned(),
                brick: brick.clone(),
            };
            crate::store::State::check(cluster, &change)?;
            Ok::<_, ConfigError>((brick, change, cluster.volume(name)?.bricks.len()))
        })?;
        self.prepare_brick(name, index, &brick)?;
        let (path, port) = (brick.path.display().to_string(), brick.port);
        let generation = self.commit(change).await?;
        let volume = self.volume(name)?;
        if volume.state == VolumeState::Started {
            self.supervisor.start_volume(&volume);
        }
        Ok(done(
            generation,
            format!(
                "brick {path} added to volume {name} as brick {index} (port {port}); \
                 `kiln volume rebalance {name} fix-layout` gives it a share of every directory"
            ),
        ))
    }

    async fn delete_volume(&self, name: &str) -> anyhow::Result<Response> {
        let generation = self
            .commit(Change::Delete {
                volume: name.to_owned(),
            })
            .await?;
        Ok(done(
            generation,
            format!("volume {name} deleted; its brick directories and data are left on disk"),
        ))
    }

    async fn start_volume(&self, name: &str) -> anyhow::Result<Response> {
        let generation = self
            .commit(Change::Start {
                volume: name.to_owned(),
            })
            .await?;
        self.supervisor.start_volume(&self.volume(name)?);
        Ok(done(generation, format!("volume {name} started")))
    }

    async fn stop_volume(&self, name: &str) -> anyhow::Result<Response> {
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

    async fn volume_status(&self, name: &str) -> anyhow::Result<Response> {
        Ok(Response::Status {
            bricks: self.supervisor.checked_status(&self.volume(name)?).await,
        })
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
        Ok(Response::Profiles {
            generation,
            bricks: self.supervisor.profiles(&volume).await,
        })
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
        let mut bricks = self.supervisor.statedumps(&volume).await;
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
        let results = self.supervisor.push(&volume, generation).await;
        let missing: Vec<String> = results
            .into_iter()
            .filter_map(|(brick, r)| r.err().map(|why| format!("{brick} ({why})")))
            .collect();
        Ok(match missing.is_empty() {
            true => format!("; applied by {} running brick(s)", volume.bricks.len()),
            false => format!(
                "; saved, but not yet applied by {}: they get it when they restart",
                missing.join(", ")
            ),
        })
    }

    /// Checks a new volume, formats its brick directories and issues their certificates.
    fn prepare_volume(
        &self,
        name: &str,
        bricks: &[PathBuf],
        port: Option<u16>,
    ) -> anyhow::Result<Volume> {
        let mut ports: Vec<u16> = Vec::new();
        let volume = self.store.read(|cluster, _| {
            let first = port.unwrap_or_else(|| cluster.free_port(BRICK_PORT_BASE, &[]));
            for (i, _) in bricks.iter().enumerate() {
                let wanted = first.saturating_add(u16::try_from(i).unwrap_or(u16::MAX));
                ports.push(match port {
                    Some(_) => wanted,
                    None => cluster.free_port(wanted, &ports),
                });
            }
            let volume = Volume {
                name: name.to_owned(),
                id: uuid(),
                bricks: bricks
                    .iter()
                    .zip(&ports)
                    .map(|(path, &port)| Brick {
                        path: path.clone(),
                        port,
                    })
                    .collect(),
                options: Default::default(),
                state: VolumeState::Created,
            };
            crate::store::State::check(cluster, &Change::Create(volume.clone()))?;
            Ok::<_, ConfigError>(volume)
        })?;
        for (i, brick) in volume.bricks.iter().enumerate() {
            self.prepare_brick(name, i, brick)?;
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
        let hosts = vec!["localhost".into(), "127.0.0.1".into(), "::1".into()];
        let tls_dir = self.config.state_dir.join("tls");
        pki::issue(
            &tls_dir,
            &Role::Brick { hosts },
            &Brick::name(name, index),
            pki::CERT_VALIDITY_DAYS,
        )?;
        Ok(())
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
