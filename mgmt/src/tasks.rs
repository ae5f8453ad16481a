//! Cluster-wide tasks — a volume's rebalance — run by one daemon at a time.
//!
//! The task itself is `kiln volume rebalance VOLUME start --for-daemon`, a process this daemon
//! starts (the *runner*), which talks to this daemon's socket, writes its status beside it
//! after each directory (`rebalance_status_file`) and dies with the daemon (it gets SIGKILL
//! then: a move it leaves half done is finished or undone by the next rebalance).
//!
//! On one host the daemon runs the task when asked. On a cluster on etcd, any daemon takes
//! the command and records it; the *leader* runs it:
//!
//! ```text
//! <prefix>leader                the leader's host name, under its lease: the daemons take
//!                               it in turn as they find it free (a lease-based election)
//! <prefix>tasks/rebalance/<v>   volume v's rebalance (`RebalanceStatus`): `wanted` when asked,
//!                               then its runner's status as the leader copies it; `stop` set
//!                               by whoever is asked to stop it
//! ```
//!
//! The leader starts a runner for each live task that has none on its host — a task of a
//! leader that died continues here, from the start (a rebalance is idempotent) — copies the
//! runner's status into etcd, and signals it when a stop is asked. A leader that loses its
//! lease kills its runners before another can take over (fencing by the lease's time).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context as _, bail};
use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};
use kiln_admin::command::{RebalanceReport, RebalanceStatus, rebalance_status_file};
use rustix::process::Signal;

use crate::lock;
use crate::store::etcd::Etcd;

/// How long the leader's lease outlives its last keep-alive, in seconds: a dead leader's
/// tasks continue on another daemon within about this.
pub const LEADER_LEASE_TTL_SECS: i64 = 5;
/// How often the leader renews its lease and looks at the tasks (and a follower tries to
/// become the leader).
pub const LEAD_EVERY: Duration = Duration::from_millis(500);

/// What runs the tasks of this daemon.
#[derive(Debug)]
pub struct Tasks {
    /// The `kiln` executable.
    pub kiln: PathBuf,
    /// The daemon's socket: runners ask it, and write their status beside it.
    pub socket: PathBuf,
    pub tls_dir: PathBuf,
    pub log_dir: PathBuf,
    /// Where a brick of this host listens (how a runner reaches bricks of a single host).
    pub listen_ip: std::net::IpAddr,
    /// This host's name in a cluster.
    pub host: Option<String>,
    pub etcd: Option<Etcd>,
    /// The runners on this host, by volume.
    pub runners: Mutex<HashMap<String, Runner>>,
}

/// A runner process of this host.
#[derive(Debug)]
pub struct Runner {
    child: std::process::Child,
    /// Signalled to stop (it finishes the file it is moving).
    stopping: bool,
}

impl Tasks {
    fn status_file(&self, volume: &str) -> PathBuf {
        rebalance_status_file(self.socket.parent().unwrap_or(Path::new(".")), volume)
    }

    /// The status the runner of `volume` last wrote.
    fn read_status_file(&self, volume: &str) -> anyhow::Result<Option<RebalanceStatus>> {
        let path = self.status_file(volume);
        match std::fs::read(&path) {
            Ok(bytes) => Ok(Some(serde_json::from_slice(&bytes).with_context(|| {
                format!("{} is not a rebalance status", path.display())
            })?)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
        }
    }

    /// Starts a runner for `volume` here; its status says `wanted` until it runs.
    fn spawn(&self, volume: &str) -> anyhow::Result<RebalanceStatus> {
        let wanted = wanted(volume, self.host.clone());
        let json = serde_json::to_vec(&wanted).expect("a status encodes");
        kiln_admin::durable::replace_file(&self.status_file(volume), &json, 0o644)?;
        let log = self.log_dir.join(format!("rebalance-{volume}.log"));
        let log = std::fs::File::create(&log)
            .with_context(|| format!("cannot create {}", log.display()))?;
        let child = std::process::Command::new(&self.kiln)
            .args(["volume", "rebalance", volume, "start", "--for-daemon"])
            .env("KILN_MGMT_SOCKET", &self.socket)
            .env("KILN_TLS_DIR", &self.tls_dir)
            .env("KILN_CLIENT", kiln_admin::pki::ADMIN_CLIENT)
            .env(
                "KILN_BRICK",
                std::net::SocketAddr::new(self.listen_ip, 0).to_string(),
            )
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("cannot run {}", self.kiln.display()))?;
        tracing::info!(%volume, pid = child.id(), "started a rebalance");
        let runner = Runner {
            child,
            stopping: false,
        };
        lock(&self.runners).insert(volume.to_owned(), runner);
        Ok(wanted)
    }

    /// The runner of `volume` here: `None` when there is none, else whether it runs (one
    /// that ended is reaped and forgotten).
    fn reap(&self, volume: &str) -> Option<bool> {
        let mut runners = lock(&self.runners);
        let runner = runners.get_mut(volume)?;
        if matches!(runner.child.try_wait(), Ok(None)) {
            return Some(true);
        }
        runners.remove(volume);
        Some(false)
    }

    fn runs_here(&self, volume: &str) -> bool {
        self.reap(volume) == Some(true)
    }

    /// Asks the runner of `volume` here to stop after the file it is moving.
    fn stop_here(&self, volume: &str) {
        if let Some(runner) = lock(&self.runners).get_mut(volume)
            && !runner.stopping
        {
            signal(&runner.child, Signal::INT);
            runner.stopping = true;
        }
    }

    /// Kills every runner here: this daemon stops or no longer leads (on a cluster, the
    /// leader starts them again).
    pub fn kill_all(&self) {
        for (volume, mut runner) in lock(&self.runners).drain() {
            tracing::warn!(%volume, "killed a rebalance");
            let _ = runner.child.kill();
            let _ = runner.child.wait();
        }
    }

    /// The status of the runner here as it last wrote it; `interrupted` when it says it
    /// runs but has ended.
    fn local_status(&self, volume: &str) -> anyhow::Result<Option<RebalanceStatus>> {
        let running = self.runs_here(volume);
        let mut status = self.read_status_file(volume)?;
        if let Some(status) = &mut status {
            if status.is_live() && !running {
                status.state = "interrupted".to_owned();
            }
            status.host.clone_from(&self.host);
        }
        Ok(status)
    }

    // What a command asks.

    /// `rebalance VOLUME start` (the volume exists and is started).
    pub async fn start(&self, volume: &str) -> anyhow::Result<RebalanceStatus> {
        let Some(etcd) = &self.etcd else {
            if self.runs_here(volume) {
                bail!(running(volume));
            }
            return self.spawn(volume);
        };
        let (record, revision) = read_record(etcd, volume).await?;
        if record.as_ref().is_some_and(RebalanceStatus::is_live) {
            bail!(running(volume));
        }
        let wanted = wanted(volume, None);
        if !write_record(etcd, &wanted, revision).await? {
            bail!("the rebalance of {volume} changed meanwhile: ask again");
        }
        Ok(wanted)
    }

    /// `rebalance VOLUME status`.
    pub async fn status(&self, volume: &str) -> anyhow::Result<RebalanceStatus> {
        let status = match &self.etcd {
            Some(etcd) => read_record(etcd, volume).await?.0,
            None => self.local_status(volume)?,
        };
        status.with_context(|| format!("no rebalance of {volume} has run"))
    }

    /// `rebalance VOLUME stop`: the runner stops after the file it is moving.
    pub async fn stop(&self, volume: &str) -> anyhow::Result<RebalanceStatus> {
        let not_running = || anyhow::anyhow!("no rebalance of {volume} is running");
        let Some(etcd) = &self.etcd else {
            if !self.runs_here(volume) {
                return Err(not_running());
            }
            self.stop_here(volume);
            return self.local_status(volume)?.ok_or_else(not_running);
        };
        loop {
            let (record, revision) = read_record(etcd, volume).await?;
            let mut record = record
                .filter(RebalanceStatus::is_live)
                .ok_or_else(not_running)?;
            record.stop = true;
            if write_record(etcd, &record, revision).await? {
                return Ok(record);
            }
        }
    }

    // The leader.

    /// Takes part in the election while the daemon runs; leads while elected. (A cluster
    /// on etcd only.)
    pub async fn lead_forever(&self) {
        let Some(etcd) = &self.etcd else {
            return;
        };
        let host = self.host.clone().unwrap_or_default();
        loop {
            match campaign(etcd, &host).await {
                Ok(lease) => {
                    tracing::info!(%host, "leading the cluster-wide tasks");
                    let why = self.lead(etcd, lease).await;
                    tracing::warn!(error = %format!("{why:#}"), "no longer leading");
                    self.kill_all();
                }
                Err(e) => tracing::warn!(error = %format!("{e:#}"), "the election"),
            }
            tokio::time::sleep(LEAD_EVERY).await;
        }
    }

    /// Leads until the lease is lost (a keep-alive fails or finds it expired).
    async fn lead(&self, etcd: &Etcd, lease: i64) -> anyhow::Error {
        loop {
            if let Err(e) = keep_alive(etcd, lease).await {
                return e;
            }
            if let Err(e) = self.drive(etcd).await {
                tracing::warn!(error = %format!("{e:#}"), "running the cluster-wide tasks");
            }
            tokio::time::sleep(LEAD_EVERY).await;
        }
    }

    /// One look at every task: start what has no runner here, copy each runner's status
    /// into etcd, pass stops on.
    async fn drive(&self, etcd: &Etcd) -> anyhow::Result<()> {
        for (volume, record, revision) in records(etcd).await? {
            let next = self.next_record(&volume, &record)?;
            if next != record && !write_record(etcd, &next, revision).await? {
                tracing::debug!(%volume, "the task changed meanwhile; next time");
            }
        }
        Ok(())
    }

    /// What the record of `volume`'s task becomes after this look.
    fn next_record(
        &self,
        volume: &str,
        record: &RebalanceStatus,
    ) -> anyhow::Result<RebalanceStatus> {
        let here = self.reap(volume);
        if here.is_some() {
            // Its runner here runs, or has just ended: the record is what it says.
            if record.stop {
                self.stop_here(volume);
            }
            let mut status = self.local_status(volume)?.unwrap_or_else(|| record.clone());
            status.stop = record.stop;
            return Ok(status);
        }
        if !record.is_live() {
            return Ok(record.clone());
        }
        if record.stop {
            return Ok(RebalanceStatus {
                state: "stopped".to_owned(),
                ..record.clone()
            });
        }
        // Live and not run here: it starts, or continues from a leader that is gone.
        if let Some(before) = record
            .host
            .as_ref()
            .filter(|h| Some(*h) != self.host.as_ref())
        {
            tracing::warn!(%volume, %before, "the rebalance continues here");
        }
        self.spawn(volume)
    }
}

fn running(volume: &str) -> String {
    format!("a rebalance of {volume} is running; `kiln volume rebalance {volume} status`")
}

fn wanted(volume: &str, host: Option<String>) -> RebalanceStatus {
    RebalanceStatus {
        volume: volume.to_owned(),
        host,
        pid: 0,
        state: "wanted".to_owned(),
        report: RebalanceReport::default(),
        elapsed_secs: 0.0,
        stop: false,
    }
}

fn signal(child: &std::process::Child, signal: Signal) {
    if let Some(pid) = i32::try_from(child.id())
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    {
        let _ = rustix::process::kill_process(pid, signal);
    }
}

fn task_prefix(etcd: &Etcd) -> String {
    format!("{}tasks/rebalance/", etcd.target().prefix())
}

/// The task record of `volume` and its mod revision (0: none).
async fn read_record(etcd: &Etcd, volume: &str) -> anyhow::Result<(Option<RebalanceStatus>, i64)> {
    let key = format!("{}{volume}", task_prefix(etcd));
    let answer = etcd.get(&key, None).await?;
    match answer.kvs().first() {
        Some(kv) => Ok((
            Some(serde_json::from_slice(kv.value()).context("a rebalance record")?),
            kv.mod_revision(),
        )),
        None => Ok((None, 0)),
    }
}

/// Every task record, with its volume and mod revision (unreadable ones logged and left).
async fn records(etcd: &Etcd) -> anyhow::Result<Vec<(String, RebalanceStatus, i64)>> {
    let prefix = task_prefix(etcd);
    let answer = etcd
        .get(&prefix, Some(GetOptions::new().with_prefix()))
        .await?;
    let mut records = Vec::new();
    for kv in answer.kvs() {
        let volume = String::from_utf8_lossy(kv.key().get(prefix.len()..).unwrap_or_default());
        match serde_json::from_slice(kv.value()) {
            Ok(record) => records.push((volume.into_owned(), record, kv.mod_revision())),
            Err(e) => tracing::warn!(%volume, error = %e, "an unreadable rebalance record"),
        }
    }
    Ok(records)
}

/// Writes `record` if its key is still at mod revision `revision` (0: absent); whether it was.
async fn write_record(
    etcd: &Etcd,
    record: &RebalanceStatus,
    revision: i64,
) -> anyhow::Result<bool> {
    let key = format!("{}{}", task_prefix(etcd), record.volume);
    let json = serde_json::to_vec(record).expect("a status encodes");
    let txn = Txn::new()
        .when([Compare::mod_revision(
            key.clone(),
            CompareOp::Equal,
            revision,
        )])
        .and_then([TxnOp::put(key, json, None)]);
    Ok(etcd.txn(txn).await?.succeeded())
}

fn leader_key(etcd: &Etcd) -> String {
    format!("{}leader", etcd.target().prefix())
}

/// The host whose daemon leads, if one does.
pub async fn leader(etcd: &Etcd) -> anyhow::Result<Option<String>> {
    let answer = etcd.get(&leader_key(etcd), None).await?;
    Ok(answer
        .kvs()
        .first()
        .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()))
}

/// Becomes the leader: waits until the leader key is free and takes it under a new lease.
async fn campaign(etcd: &Etcd, host: &str) -> anyhow::Result<i64> {
    let key = leader_key(etcd);
    loop {
        let lease = etcd
            .call(|mut client| async move { client.lease_grant(LEADER_LEASE_TTL_SECS, None).await })
            .await?
            .id();
        let take = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key.clone(),
                host,
                Some(PutOptions::new().with_lease(lease)),
            )]);
        if etcd.txn(take).await?.succeeded() {
            return Ok(lease);
        }
        // Someone leads: this lease is not needed (it expires by itself if the revoke fails).
        let _ = etcd
            .call(|mut client| async move { client.lease_revoke(lease).await })
            .await;
        tokio::time::sleep(LEAD_EVERY).await;
    }
}

/// Renews `lease`; an error when it has expired (another daemon may lead now).
async fn keep_alive(etcd: &Etcd, lease: i64) -> anyhow::Result<()> {
    let answer = etcd
        .call(|mut client| async move {
            let (mut keeper, mut answers) = client.lease_keep_alive(lease).await?;
            keeper.keep_alive().await?;
            answers.message().await
        })
        .await?;
    match answer {
        Some(answer) if answer.ttl() > 0 => Ok(()),
        _ => bail!("the leader's lease expired"),
    }
}
