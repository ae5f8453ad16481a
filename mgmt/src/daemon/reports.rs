//! Reports: info, status, profile, statedump, each brick's from the host that runs it; and this
//! host's own report into etcd, which the other hosts read.

use std::collections::BTreeMap;

use kiln_admin::command::{BrickReport, BrickStatus, HostReport, ProfileAction, Response};
use kiln_admin::options;
use kiln_admin::volume::{Brick, Volume, VolumeState};

use super::Daemon;
use crate::fanout::{self, Query};
use crate::volume::{Change, ConfigError};

/// The options `kiln volume profile VOL start|stop` switches.
const PROFILE_OPTIONS: [&str; 2] = [
    "diagnostics.count-fop-hits",
    "diagnostics.latency-measurement",
];

impl Daemon {
    /// This host as its daemon reports it into etcd: its bricks, each probed.
    pub(super) async fn host_report(&self) -> HostReport {
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
    pub(super) async fn host_reports(&self) -> anyhow::Result<Vec<HostReport>> {
        match self.store.etcd() {
            Some(etcd) => crate::cluster::hosts(etcd.etcd()).await,
            None => Ok(vec![self.host_report().await]),
        }
    }

    pub(super) fn volume_info(&self, name: Option<&str>) -> anyhow::Result<Response> {
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
    pub(super) async fn volume_status(&self, name: &str) -> anyhow::Result<Response> {
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

    pub(super) async fn profile(
        &self,
        name: &str,
        action: ProfileAction,
    ) -> anyhow::Result<Response> {
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
    pub(super) async fn local_reports(&self, query: Query, volume: &str) -> serde_json::Value {
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

    pub(super) async fn statedump(&self, name: &str) -> anyhow::Result<Response> {
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
}

/// The report of the host `brick` lives on, if that host reports.
pub(super) fn report_of<'r>(reports: &'r [HostReport], brick: &Brick) -> Option<&'r HostReport> {
    let host = brick.host.as_deref().unwrap_or_default();
    reports.iter().find(|r| r.host == host)
}

/// Brick `name` of another host, as its daemon reports it; down when the host does not
/// report (its daemon or the host is gone, or it cannot reach etcd).
pub(super) fn remote_status(reports: &[HostReport], name: &str, brick: &Brick) -> BrickStatus {
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
