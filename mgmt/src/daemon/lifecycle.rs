//! The volume's lifecycle: create, add-brick, delete, start, stop; and the bricks here made,
//! formatted and given their certificates.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use kiln_admin::command::Response;
use kiln_admin::pki::{self, Role};
use kiln_admin::volume::{Brick, Volume, VolumeState};

use super::cluster::{REVOKED, with_revoked};
use super::{Daemon, done};
use crate::membership;
use crate::volume::{BRICK_PORT_BASE, Change, Cluster, ConfigError};

impl Daemon {
    pub(super) async fn create_volume(
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

    pub(super) async fn add_brick(
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
    pub(super) fn brick_place(&self, spec: &Path) -> anyhow::Result<(Option<String>, PathBuf)> {
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

    pub(super) async fn delete_volume(&self, name: &str) -> anyhow::Result<Response> {
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

    pub(super) async fn start_volume(&self, name: &str) -> anyhow::Result<Response> {
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
    pub(super) async fn stop_volume(&self, name: &str) -> anyhow::Result<Response> {
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
    pub(super) fn prepare_brick(
        &self,
        name: &str,
        index: usize,
        brick: &Brick,
    ) -> anyhow::Result<()> {
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

/// A random version-4 UUID, in the form GlusterFS prints volume ids. (If the kernel cannot
/// give random bytes, `uuid` panics rather than hand out a predictable id.)
fn uuid() -> String {
    uuid::Uuid::new_v4().hyphenated().to_string()
}
