//! Cluster-wide tasks — a volume's rebalance or fix-layout (`kiln volume heal`) — run by one
//! daemon at a time, one per volume.
//!
//! The task itself is `kiln volume rebalance VOLUME start|fix-layout --for-daemon`, a process
//! this daemon starts (the *runner*), which talks to this daemon's socket and writes its
//! status beside it after each directory (`rebalance_status_file`: `wanted` written by the
//! daemon before the runner starts, then by the runner alone). The daemon writes a byte to
//! the runner's stdin every [`BEAT_EVERY`]; a runner that hears nothing for `RUNNER_FENCE`
//! (2 s), or reads the end of its stdin (its daemon is gone), exits at once — a move it
//! leaves half done is finished or undone by the next rebalance.
//!
//! On one host the daemon runs the task when asked. On a cluster on etcd, any daemon takes
//! the command and records it; the *leader* runs it:
//!
//! ```text
//! <prefix>leader                the leader's host name, under its lease: the daemons take
//!                               it when they find it free (a lease-based election)
//! <prefix>tasks/rebalance/<v>   volume v's task (`RebalanceStatus`): `wanted` when asked,
//!                               then its runner's status as the leader copies it; `stop` set
//!                               by whoever is asked to stop it
//! ```
//!
//! The leader starts a runner for each live task that has none, copies the runner's status
//! into etcd, and signals it when a stop is asked. It beats its runners only while its lease
//! is surely valid (renewed less than the lease's time ago, by its own clock, with a margin),
//! so a leader cut off from etcd, or frozen, has its runners gone before its lease expires; a
//! new leader waits one lease time more before it continues a task another host ran (from
//! the start: a rebalance is idempotent).

use std::collections::HashMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};
use kiln_admin::command::{RebalanceStatus, TaskKind, rebalance_status_file};
use rustix::process::Signal;

use crate::lock;
use crate::store::etcd::Etcd;

/// How long the leader's lease outlives its last renewal: a dead leader's tasks continue on
/// another daemon within about twice this.
pub const LEADER_LEASE_TTL: Duration = Duration::from_secs(5);
/// How often the leader renews its lease and looks at the tasks, a follower looks for a free
/// leader key, and a daemon beats its runners.
pub const BEAT_EVERY: Duration = Duration::from_millis(500);
/// Longest wait for one renewal of the leader's lease.
const RENEW_TIMEOUT: Duration = Duration::from_millis(1500);
/// How long before its lease's end by its own clock a leader stops beating its runners (more
/// than a runner's fence: they are gone before the lease is).
const LEASE_MARGIN: Duration = Duration::from_millis(2500);

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
    /// Its stdin: a byte per beat.
    beats: Option<std::process::ChildStdin>,
    /// Signalled to stop (it finishes the file it is moving).
    stopping: bool,
}

impl Tasks {
    fn status_file(&self, volume: &str) -> PathBuf {
        rebalance_status_file(self.socket.parent().unwrap_or(Path::new(".")), volume)
    }

    fn log_file(&self, volume: &str) -> PathBuf {
        self.log_dir.join(format!("rebalance-{volume}.log"))
    }

    /// The status the runner of `volume` last wrote.
    fn read_status_file(&self, volume: &str) -> anyhow::Result<Option<RebalanceStatus>> {
        let path = self.status_file(volume);
        match std::fs::read(&path) {
            Ok(bytes) => {
                Ok(Some(serde_json::from_slice(&bytes).with_context(|| {
                    format!("{} is not a task status", path.display())
                })?))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
        }
    }

    /// Starts a runner of task `kind` for `volume` here, unless one runs; its status says
    /// `wanted` until it writes its own.
    fn spawn(&self, volume: &str, kind: TaskKind) -> anyhow::Result<RebalanceStatus> {
        let mut runners = lock(&self.runners);
        if let Some(runner) = runners.get_mut(volume) {
            if matches!(runner.child.try_wait(), Ok(None)) {
                bail!(running(volume));
            }
            runners.remove(volume);
        }
        // The last run's status replaced; from here the runner is its only writer.
        let mut wanted = RebalanceStatus::wanted(volume, kind);
        wanted.host.clone_from(&self.host);
        let json = serde_json::to_vec(&wanted).expect("a status encodes");
        kiln_admin::durable::replace_file(&self.status_file(volume), &json, 0o644)
            .context("cannot replace the last task's status")?;
        let log = self.log_file(volume);
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("cannot open {}", log.display()))?;
        let mut child = std::process::Command::new(&self.kiln)
            .args(["volume", "rebalance", volume, kind.action(), "--for-daemon"])
            .env("KILN_MGMT_SOCKET", &self.socket)
            .env("KILN_TLS_DIR", &self.tls_dir)
            .env("KILN_CLIENT", kiln_admin::pki::ADMIN_CLIENT)
            .env(
                "KILN_BRICK",
                std::net::SocketAddr::new(self.listen_ip, 0).to_string(),
            )
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("cannot run {}", self.kiln.display()))?;
        tracing::info!(%volume, ?kind, pid = child.id(), "started a task");
        let runner = Runner {
            beats: child.stdin.take(),
            child,
            stopping: false,
        };
        runners.insert(volume.to_owned(), runner);
        Ok(wanted)
    }

    /// The runner of `volume` here: `None` when there is none, else its exit status, `None`
    /// while it runs (one that ended is reaped and forgotten).
    fn reap(&self, volume: &str) -> Option<Option<std::process::ExitStatus>> {
        let mut runners = lock(&self.runners);
        let runner = runners.get_mut(volume)?;
        match runner.child.try_wait() {
            Ok(None) => Some(None),
            ended => {
                runners.remove(volume);
                Some(Some(ended.ok().flatten().unwrap_or_default()))
            }
        }
    }

    /// A beat to every runner here (they exit when the beats stop), and ended ones reaped.
    fn beat_all(&self) {
        let mut runners = lock(&self.runners);
        for runner in runners.values_mut() {
            if let Some(beats) = &mut runner.beats {
                let _ = beats.write_all(b".");
            }
        }
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
            tracing::warn!(%volume, "killed a rebalance or heal");
            let _ = runner.child.kill();
            let _ = runner.child.wait();
        }
    }

    /// The status of the runner here as it last wrote it, `wanted` before it wrote one;
    /// `interrupted` or `failed` when it says it runs but has ended.
    fn local_status(&self, volume: &str) -> anyhow::Result<Option<RebalanceStatus>> {
        self.local_status_of(volume, self.reap(volume))
    }

    /// [`Tasks::local_status`] with its runner here as [`Tasks::reap`] found it.
    fn local_status_of(
        &self,
        volume: &str,
        here: Option<Option<std::process::ExitStatus>>,
    ) -> anyhow::Result<Option<RebalanceStatus>> {
        let mut status = match (self.read_status_file(volume)?, here) {
            (Some(status), _) => status,
            // (The daemon writes `wanted` before it starts a runner: a write that failed.)
            (None, Some(_)) => RebalanceStatus::wanted(volume, TaskKind::default()),
            (None, None) => return Ok(None),
        };
        if let (true, Some(Some(exit))) = (status.is_live(), here) {
            status.state = if exit.success() {
                "interrupted"
            } else {
                "failed"
            }
            .to_owned();
            status.error.get_or_insert_with(|| {
                format!(
                    "its process ended ({exit}); see {}",
                    self.log_file(volume).display()
                )
            });
        } else if status.is_live() && here.is_none() {
            status.state = "interrupted".to_owned();
            status
                .error
                .get_or_insert_with(|| "its daemon restarted".to_owned());
        }
        status.host.clone_from(&self.host);
        Ok(Some(status))
    }

    // What a command asks.

    /// `rebalance VOLUME start` or `fix-layout` (the volume exists and is started).
    pub async fn start(&self, volume: &str, kind: TaskKind) -> anyhow::Result<RebalanceStatus> {
        let Some(etcd) = &self.etcd else {
            return self.spawn(volume, kind);
        };
        let (record, revision) = read_record(etcd, volume).await?;
        if record.as_ref().is_some_and(RebalanceStatus::is_live) {
            bail!(running(volume));
        }
        let wanted = RebalanceStatus::wanted(volume, kind);
        if !write_record(etcd, &wanted, revision, None).await? {
            bail!("the task of {volume} changed meanwhile: ask again");
        }
        Ok(wanted)
    }

    /// `rebalance VOLUME status`.
    pub async fn status(&self, volume: &str) -> anyhow::Result<RebalanceStatus> {
        self.last(volume)
            .await?
            .with_context(|| format!("no rebalance or heal of {volume} has run"))
    }

    /// The status of `volume`'s last task; `None` when none has run.
    async fn last(&self, volume: &str) -> anyhow::Result<Option<RebalanceStatus>> {
        match &self.etcd {
            Some(etcd) => Ok(read_record(etcd, volume).await?.0),
            None => self.local_status(volume),
        }
    }

    /// `rebalance VOLUME stop`: the runner stops after the file it is moving.
    pub async fn stop(&self, volume: &str) -> anyhow::Result<RebalanceStatus> {
        let not_running = || anyhow::anyhow!("no rebalance or heal of {volume} is running");
        let Some(etcd) = &self.etcd else {
            let here = self.reap(volume);
            if here != Some(None) {
                return Err(not_running());
            }
            self.stop_here(volume);
            let mut status = self
                .local_status_of(volume, here)?
                .ok_or_else(not_running)?;
            status.stop = true;
            return Ok(status);
        };
        loop {
            let (record, revision) = read_record(etcd, volume).await?;
            let mut record = record
                .filter(RebalanceStatus::is_live)
                .ok_or_else(not_running)?;
            record.stop = true;
            if write_record(etcd, &record, revision, None).await? {
                return Ok(record);
            }
        }
    }

    /// Whether a task of `volume` is asked or runs (a volume with one is not stopped or
    /// deleted, and none of its bricks changes role).
    pub async fn is_live(&self, volume: &str) -> anyhow::Result<bool> {
        Ok(self.last(volume).await?.is_some_and(|s| s.is_live()))
    }

    /// Waits until the task of `volume` has ended (a stop was asked), for at most `patience`.
    pub async fn wait_until_ended(&self, volume: &str, patience: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + patience;
        while self.is_live(volume).await? {
            if Instant::now() > deadline {
                bail!("the task of {volume} did not stop within {patience:?}");
            }
            tokio::time::sleep(BEAT_EVERY).await;
        }
        Ok(())
    }

    /// Forgets the last task of `volume` (deleted, or a brick's role changed).
    pub async fn forget(&self, volume: &str) -> anyhow::Result<()> {
        let _ = std::fs::remove_file(self.status_file(volume));
        if let Some(etcd) = &self.etcd {
            let key = task_key(etcd, volume);
            etcd.txn(Txn::new().and_then([TxnOp::delete(key, None)]))
                .await?;
        }
        Ok(())
    }

    // The beats, and the leader.

    /// Beats this host's runners while the daemon runs; on a cluster, takes part in the
    /// election and leads while elected.
    pub async fn run_forever(&self) {
        let Some(etcd) = &self.etcd else {
            loop {
                self.beat_all();
                tokio::time::sleep(BEAT_EVERY).await;
            }
        };
        let host = self.host.clone().unwrap_or_default();
        loop {
            match campaign(etcd, &host).await {
                Ok((lease, valid_until)) => {
                    tracing::info!(%host, "leading the cluster-wide tasks");
                    let why = self.lead(etcd, lease, valid_until).await;
                    tracing::warn!(error = %format!("{why:#}"), "no longer leading");
                    self.kill_all();
                    let _ = tokio::time::timeout(RENEW_TIMEOUT, etcd.revoke(lease)).await;
                }
                Err(e) => tracing::warn!(error = %format!("{e:#}"), "the election"),
            }
            tokio::time::sleep(BEAT_EVERY).await;
        }
    }

    /// Leads until the lease is no longer surely valid by this host's clock.
    async fn lead(&self, etcd: &Etcd, lease: i64, mut valid_until: Instant) -> anyhow::Error {
        let since = Instant::now();
        loop {
            let sent = Instant::now();
            match tokio::time::timeout(RENEW_TIMEOUT, etcd.keep_alive(lease)).await {
                Ok(Ok(Some(ttl))) => valid_until = sent + ttl,
                Ok(Ok(None)) => return anyhow::anyhow!("the leader's lease expired"),
                // (A renewal that failed may succeed next time, while the lease lasts.)
                Ok(Err(e)) => tracing::warn!(error = %e, "renewing the leader's lease"),
                Err(_) => tracing::warn!("renewing the leader's lease: no answer"),
            }
            let Some(sure_until) = valid_until.checked_sub(LEASE_MARGIN) else {
                return anyhow::anyhow!("the leader's lease is too short");
            };
            if Instant::now() >= sure_until {
                return anyhow::anyhow!("the leader's lease was not renewed in time");
            }
            self.beat_all();
            let drive = self.drive(etcd, lease, since, sure_until);
            if tokio::time::timeout_at(sure_until.into(), drive)
                .await
                .is_err()
            {
                tracing::warn!("etcd is slow: the tasks were not all looked at");
            }
            tokio::time::sleep(BEAT_EVERY).await;
        }
    }

    /// One look at every task: start what has no runner (while the lease is sure, and a
    /// task another host ran only a lease time after taking the lead), copy each runner's
    /// status into etcd, pass stops on. A task that cannot be driven is logged and marked.
    async fn drive(&self, etcd: &Etcd, lease: i64, since: Instant, sure_until: Instant) {
        let records = match records(etcd).await {
            Ok(records) => records,
            Err(e) => return tracing::warn!(error = %format!("{e:#}"), "reading the tasks"),
        };
        for (volume, record, revision) in records {
            let ran_elsewhere = record.host.is_some() && record.host != self.host;
            if ran_elsewhere && since.elapsed() < LEADER_LEASE_TTL {
                continue;
            }
            let next = match self.next_record(&volume, &record, Instant::now() < sure_until) {
                Ok(next) => next,
                Err(e) => {
                    tracing::warn!(%volume, error = %format!("{e:#}"), "a task failed");
                    RebalanceStatus {
                        state: "failed".to_owned(),
                        host: self.host.clone(),
                        error: Some(format!("{e:#}")),
                        ..record.clone()
                    }
                }
            };
            if next != record {
                match write_record(etcd, &next, revision, Some(lease)).await {
                    Ok(true) => {}
                    Ok(false) => tracing::debug!(%volume, "the task changed meanwhile"),
                    Err(e) => tracing::warn!(%volume, error = %e, "copying a task's status"),
                }
            }
        }
    }

    /// What the record of `volume`'s task becomes after this look.
    fn next_record(
        &self,
        volume: &str,
        record: &RebalanceStatus,
        may_start: bool,
    ) -> anyhow::Result<RebalanceStatus> {
        // A new run asked for (the last one here, if any, forgotten once it has exited), or
        // the run of the runner here (running, or just ended), or a run not here.
        let fresh = record.state == "wanted" && record.host.is_none();
        let here = self.reap(volume);
        if fresh && here == Some(None) {
            return Ok(record.clone());
        }
        if !fresh && here.is_some() {
            if record.stop {
                self.stop_here(volume);
            }
            let status = self.local_status_of(volume, here)?;
            let mut status = status.unwrap_or_else(|| record.clone());
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
        if !may_start {
            return Ok(record.clone());
        }
        // Live and not run here: it starts, or continues from a leader that is gone.
        if let Some(before) = record
            .host
            .as_ref()
            .filter(|h| Some(*h) != self.host.as_ref())
        {
            tracing::warn!(%volume, %before, "the task continues here");
        }
        self.spawn(volume, record.kind)
    }
}

fn running(volume: &str) -> String {
    format!("a task of {volume} is running; `kiln volume rebalance {volume} status`")
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

fn task_key(etcd: &Etcd, volume: &str) -> String {
    format!("{}{volume}", task_prefix(etcd))
}

fn leader_key(etcd: &Etcd) -> String {
    format!("{}leader", etcd.target().prefix())
}

/// The task record of `volume` and its mod revision (0: none).
async fn read_record(etcd: &Etcd, volume: &str) -> anyhow::Result<(Option<RebalanceStatus>, i64)> {
    let key = task_key(etcd, volume);
    let answer = etcd.get(&key, None).await?;
    match answer.kvs().first() {
        Some(kv) => Ok((
            Some(serde_json::from_slice(kv.value()).context("a task record")?),
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
        let Some(volume) = kv.key_str().ok().and_then(|k| k.strip_prefix(&prefix)) else {
            continue;
        };
        match serde_json::from_slice(kv.value()) {
            Ok(record) => records.push((volume.to_owned(), record, kv.mod_revision())),
            Err(e) => tracing::warn!(%volume, error = %e, "an unreadable task record"),
        }
    }
    Ok(records)
}

/// Writes `record` if its key is still at mod revision `revision` (0: absent) and, for the
/// leader's writes, the leader key is still under its `lease`; whether it was.
async fn write_record(
    etcd: &Etcd,
    record: &RebalanceStatus,
    revision: i64,
    lease: Option<i64>,
) -> anyhow::Result<bool> {
    let key = task_key(etcd, &record.volume);
    let json = serde_json::to_vec(record).expect("a status encodes");
    let mut when = vec![Compare::mod_revision(
        key.clone(),
        CompareOp::Equal,
        revision,
    )];
    if let Some(lease) = lease {
        when.push(Compare::lease(leader_key(etcd), CompareOp::Equal, lease));
    }
    let txn = Txn::new()
        .when(when)
        .and_then([TxnOp::put(key, json, None)]);
    Ok(etcd.txn(txn).await?.succeeded())
}

/// The host whose daemon leads, if one does.
pub async fn leader(etcd: &Etcd) -> anyhow::Result<Option<String>> {
    let answer = etcd.get(&leader_key(etcd), None).await?;
    Ok(answer
        .kvs()
        .first()
        .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()))
}

/// Becomes the leader: waits until the leader key is free and takes it under a new lease;
/// the lease, and until when it is valid by this host's clock.
async fn campaign(etcd: &Etcd, host: &str) -> anyhow::Result<(i64, Instant)> {
    let key = leader_key(etcd);
    loop {
        if leader(etcd).await?.is_some() {
            tokio::time::sleep(BEAT_EVERY).await;
            continue;
        }
        let sent = Instant::now();
        let ttl = i64::try_from(LEADER_LEASE_TTL.as_secs()).expect("a few seconds");
        let lease = etcd.grant(ttl).await?;
        let take = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key.clone(),
                host,
                Some(PutOptions::new().with_lease(lease)),
            )]);
        if etcd.txn(take).await?.succeeded() {
            return Ok((lease, sent + LEADER_LEASE_TTL));
        }
        // Another daemon was quicker: this lease is not needed (it expires by itself if the
        // revoke fails).
        let _ = etcd.revoke(lease).await;
    }
}
