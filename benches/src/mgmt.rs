//! `kiln-bench mgmt`: the management path — an option change as a user makes it, and the
//! configuration store under it — against the durability floor of the scratch disk, all in one
//! run on the scratch directory.
//!
//! Workloads (each phase is `sets` operations, after a few unmeasured warm-up ones):
//!
//! * `mgmt.floor` — the references, each on a file of its own in the scratch directory, with
//!   as many bytes as one store commit appends to the log (measured first on a store of its
//!   own: `params.bytes`):
//!   * `append_fdatasync` — one `write` of those bytes to a file opened for appending, then
//!     `fdatasync`: the one durable operation a store commit makes, bare. The reference of
//!     every row.
//!   * `replace_fsync` — the same bytes replacing a file durably (write a temporary file,
//!     fsync it, rename it over the target, fsync the directory: `kiln_admin::durable`, how
//!     Kiln saves a whole file): two durable operations.
//! * `mgmt.commit` / `store` — [`LogStore::<Cluster>`](LogStore) opened on a fresh directory, one
//!   [`Change::Create`] of a volume, then sequential commits of one [`Change::Set`] each,
//!   timing each `commit().await` (one log append and one fdatasync). `params.fsyncs` is the
//!   store's own count ([`LogStore::stats`]) over the measured commits.
//! * `mgmt.commit` / `store_group` — the same number of commits on another fresh store from
//!   `tasks` concurrent tasks (default 16), so the writer thread groups them: one write and
//!   one fdatasync per group. Reports commits/s, per-commit p50/p99 (a commit that waits for a
//!   group takes at least one fdatasync) and `fsyncs`/`batches` in `params`.
//! * `mgmt.spawn` / `true`, `kiln-version` — what a command costs before it reaches the
//!   daemon, spawned, reaped and timed as the sets are: `true` (this harness's spawn, exec and
//!   reap of the smallest program) and `kiln --version` (kiln's exec, dynamic linking,
//!   runtime start and argument parsing; no socket). `kiln-cli` less `kiln-version` is the
//!   socket round trip and the daemon's work.
//! * `mgmt.set` / `kiln-cli` — `kiln volume set v network.inflight-max <n>` end to end as a
//!   user runs it: a real `kiln-mgmtd` (state directory and socket in the scratch directory)
//!   with one volume `v` whose brick directory is in the scratch directory, and each set a new
//!   `kiln` process (`KILN_MGMT_SOCKET` set), timed from spawn to exit; `n` cycles so every
//!   set is a real change. The volume is created, not started: the set is parse, commit and
//!   answer.
//! * `mgmt.set` / `kiln-cli-started` — the same after `kiln volume start v` and once
//!   `kiln volume --json status v` shows the brick running and a set has reached it: each set
//!   also pushes the live options to the running brick over its control socket.
//!   `params.applied_live` counts the sets whose answer says the brick applied them.
//!
//! `ratio` = the floor's p50 / this p50 (>1 = faster than the floor), against
//! `append_fdatasync` for every row and, for the store's rows, once more against
//! `replace_fsync`. A sequential store commit is one append and one fdatasync, so against
//! `append_fdatasync` it can at best tie: the difference is what the store adds (encoding,
//! the hand-off to its writer thread and back). For `store_group` "this p50" is the time per
//! commit of the whole run (wall time ÷ commits, i.e. the ratio is commits/s × the floor's
//! p50), because a commit that waits in a group is never quicker than one fdatasync; the
//! group's throughput is what beats the floor. The CLI sets add a process start and a socket
//! round trip.
//!
//! The binaries `kiln-mgmtd`, `kiln` and `kiln-brickd` are taken from beside the running
//! `kiln-bench` (`cargo build --release` builds them all). The brick gets a UDP port that was
//! free a moment before. At the end `kiln-mgmtd` gets SIGTERM (it stops its brick) and is
//! waited for, SIGKILL after a bounded wait. Every loop is bounded by a count and every wait
//! by a time.
//!
//! A `gluster` note says whether the `gluster` command is on PATH: with a running glusterd a
//! `gluster volume set` comparison is possible, but this workload never sets one up.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hdrhistogram::Histogram;
use kiln_admin::options;
use kiln_admin::volume::{Brick, Volume, VolumeState};
use kiln_mgmt::store::{LOG_FILE, LogStore, StoreOptions, StoreStats};
use kiln_mgmt::volume::{BRICK_PORT_BASE, Change, Cluster};
use rustix::process::{Pid, Signal};
use serde_json::json;
use tokio::task::JoinSet;

use crate::process::{
    Bins, KILL_TIMEOUT, Ran, STOP_TIMEOUT, log_tail, pid_of, run_captured, wait_exit,
};
use crate::report::{Record, Reporter, histogram, micros, nanos};
use crate::scratch::Scratch;

/// What to run.
#[derive(Debug, Clone)]
pub struct MgmtBench {
    /// Operations measured per phase (CLI sets, store commits, floor replacements).
    pub sets: usize,
    /// Tasks committing at once in the group-commit run.
    pub tasks: usize,
}

/// The option every phase changes (live: pushed to running bricks).
const KEY: &str = "network.inflight-max";
/// Its values cycle through 1..=VALUES.
const VALUES: usize = 4096;
const VOLUME_NAME: &str = "v";
/// The floor every row is measured against: one append and one fdatasync.
const APPEND_FLOOR: &str = "append_fdatasync";
/// The floor of replacing a file durably: temp file, fsync, rename, directory fsync.
const REPLACE_FLOOR: &str = "replace_fsync";
/// Longest run of one `kiln` command.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);
/// How long `kiln-mgmtd` may take to listen on its socket.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(20);
/// How long the started brick may take to run and take a push.
const BRICK_TIMEOUT: Duration = Duration::from_secs(30);
/// Pause between polls of the daemon's socket or the brick's status.
const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// Largest path a Unix socket address holds (`sun_path` less its NUL).
const SOCKET_PATH_MAX_BYTES: usize = 107;
/// Attempts at finding a free port.
const PORT_TRIES: usize = 50;

/// Operations before measuring (cold caches, first file creation), not recorded.
fn warmup(n: usize) -> usize {
    (n / 10).clamp(1, 20)
}

/// The value of the `i`-th set: consecutive sets always differ.
fn value(i: usize) -> String {
    (i % VALUES + 1).to_string()
}

/// A reference the rows are measured against: its name and p50 in microseconds.
#[derive(Debug, Clone, Copy)]
struct Floor {
    name: &'static str,
    p50_us: f64,
}

impl Floor {
    /// The floor `name`, from its latencies.
    fn of(name: &'static str, h: &Histogram<u64>) -> Floor {
        Floor {
            name,
            p50_us: micros(h, 0.5),
        }
    }
}

/// One latency result against `floor`: ratio = floor p50 / this p50.
fn latency_record(
    workload: &str,
    target: &str,
    params: serde_json::Value,
    rate: f64,
    h: &Histogram<u64>,
    floor: Floor,
) -> Record {
    let mut r = Record::new(workload, target, params, floor.name);
    r.ops_per_s = Some(rate);
    r.set_latency(h);
    r.ratio = Some(floor.p50_us / micros(h, 0.5));
    r
}

/// Runs the whole benchmark, printing records as they are measured.
pub fn run(
    bench: &MgmtBench,
    scratch: &Scratch,
    out: &mut Reporter,
) -> anyhow::Result<Vec<Record>> {
    let sets = bench.sets.max(1);
    let tasks = bench.tasks.max(1);
    let bins = Bins::beside_this_executable()?;
    let mgmtd = bins.find("kiln-mgmtd")?;
    let root = std::path::absolute(scratch.path().join("mgmt"))?;
    std::fs::create_dir_all(&root).with_context(|| format!("cannot create {}", root.display()))?;
    note_gluster(out);
    let store_options = StoreOptions::default();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let commit_bytes = rt.block_on(commit_bytes(
        &root.join("store-probe"),
        &root.join("store-brick"),
    ))?;
    out.note(
        "mgmt",
        &json!({
            "binaries": bins.dir.display().to_string(),
            "key": KEY,
            "sets": sets,
            "group_tasks": tasks,
            "store": { "compact_after_bytes": store_options.compact_after_bytes,
                       "queue_max": store_options.queue_max,
                       "bytes_per_commit": commit_bytes },
            "floors": {
                APPEND_FLOOR: format!("write {commit_bytes} B to a file opened for appending, fdatasync"),
                REPLACE_FLOOR: format!("write {commit_bytes} B to a temp name, fsync, rename over the target, fsync the directory"),
            },
        }),
    );
    let mut records = Vec::new();

    // (c) The references first.
    let (append, replace) = floors(&root.join("floor"), sets, commit_bytes, out, &mut records)?;

    // (b) The store alone: sequential, then grouped.
    let (rate, h, stats) = rt.block_on(store_sequential(
        &root.join("store-seq"),
        &root.join("store-brick"),
        sets,
        store_options,
    ))?;
    for floor in [append, replace] {
        let r = latency_record(
            "mgmt.commit",
            "store",
            json!({ "commits": sets, "tasks": 1, "fsyncs": stats.fsyncs, "batches": stats.batches }),
            rate,
            &h,
            floor,
        );
        out.print(&r);
        records.push(r);
    }

    let (rate, h, stats) = rt.block_on(store_group(
        &root.join("store-group"),
        &root.join("store-brick"),
        sets,
        tasks,
        store_options,
    ))?;
    for floor in [append, replace] {
        let mut r = latency_record(
            "mgmt.commit",
            "store_group",
            json!({ "commits": sets, "tasks": tasks, "fsyncs": stats.fsyncs, "batches": stats.batches }),
            rate,
            &h,
            floor,
        );
        // A grouped commit waits at least one fdatasync; what beats the floor is throughput.
        r.ratio = Some(rate * floor.p50_us / 1e6);
        out.print(&r);
        records.push(r);
    }
    drop(rt);

    // (a) `kiln volume set` through a real kiln-mgmtd.
    records.extend(cli(&bins, &mgmtd, &root, sets, append, out)?);
    Ok(records)
}

/// (c) Both floors, `bytes` each, `n` samples each: their rows printed and pushed onto
/// `records`, the floors returned.
fn floors(
    dir: &Path,
    n: usize,
    bytes: usize,
    out: &mut Reporter,
    records: &mut Vec<Record>,
) -> anyhow::Result<(Floor, Floor)> {
    std::fs::create_dir_all(dir)?;
    let data = vec![b'k'; bytes];
    let append_file = dir.join("log");
    let mut log = std::fs::File::options()
        .append(true)
        .create(true)
        .open(&append_file)
        .with_context(|| format!("cannot open {}", append_file.display()))?;
    let append = timed(n, || {
        use std::io::Write as _;
        log.write_all(&data)?;
        log.sync_data()
    })
    .with_context(|| format!("appending to {}", append_file.display()))?;
    let target = dir.join("config.json");
    let replace = timed(n, || {
        kiln_admin::durable::replace_file(&target, &data, 0o600).map_err(|e| e.error)
    })
    .with_context(|| format!("replacing {}", target.display()))?;
    let mut floors = Vec::new();
    for (name, (rate, h)) in [(APPEND_FLOOR, append), (REPLACE_FLOOR, replace)] {
        let floor = Floor::of(name, &h);
        let r = latency_record(
            "mgmt.floor",
            name,
            json!({ "samples": n, "bytes": bytes }),
            rate,
            &h,
            floor,
        );
        out.print(&r);
        records.push(r);
        floors.push(floor);
    }
    Ok((floors[0], floors[1]))
}

/// Runs `op` `warmup(n)` times unmeasured, then `n` times timed: ops/s and each latency.
fn timed(
    n: usize,
    mut op: impl FnMut() -> std::io::Result<()>,
) -> anyhow::Result<(f64, Histogram<u64>)> {
    for _ in 0..warmup(n) {
        op()?;
    }
    let mut h = histogram()?;
    let start = Instant::now();
    for _ in 0..n {
        let t = Instant::now();
        op()?;
        h.record(nanos(t.elapsed()))?;
    }
    Ok((n as f64 / start.elapsed().as_secs_f64(), h))
}

/// Bytes one option change appends to the store's log, measured on a fresh store in `dir`.
async fn commit_bytes(dir: &Path, brick: &Path) -> anyhow::Result<usize> {
    let store = fresh_store(dir, brick, StoreOptions::default()).await?;
    let log = dir.join(LOG_FILE);
    let len = || -> anyhow::Result<u64> {
        Ok(std::fs::metadata(&log)
            .with_context(|| format!("the store's log {}", log.display()))?
            .len())
    };
    let before = len()?;
    timed_commit(&store, set_change(0)?).await?;
    let grown = len()?.checked_sub(before).filter(|&b| b > 0);
    let grown = grown.context("one commit did not grow the store's log")?;
    Ok(usize::try_from(grown)?)
}

/// A fresh store with volume `v` created in it.
async fn fresh_store(
    dir: &Path,
    brick: &Path,
    options: StoreOptions,
) -> anyhow::Result<LogStore<Cluster>> {
    if dir.exists() {
        bail!("{} already exists; the store must be fresh", dir.display());
    }
    let (store, _) = LogStore::<Cluster>::open(dir, options)
        .with_context(|| format!("opening a store in {}", dir.display()))?;
    let volume = Volume {
        name: VOLUME_NAME.into(),
        id: "00000000-0000-4000-8000-00000000b0b0".into(),
        bricks: vec![Brick {
            host: None,
            path: brick.to_owned(),
            port: BRICK_PORT_BASE,
        }],
        options: Default::default(),
        state: VolumeState::Created,
    };
    store
        .commit(vec![Change::Create(volume)])
        .await
        .context("creating the volume in the store")?;
    Ok(store)
}

/// The `i`-th option change, in canonical form.
fn set_change(i: usize) -> anyhow::Result<Change> {
    Ok(Change::Set {
        volume: VOLUME_NAME.into(),
        key: KEY.into(),
        value: options::find(KEY)?.parse(&value(i))?,
    })
}

/// Commits one change and returns how long `commit().await` took.
async fn timed_commit(store: &LogStore<Cluster>, change: Change) -> anyhow::Result<Duration> {
    let t = Instant::now();
    store.commit(vec![change]).await.context("commit")?;
    Ok(t.elapsed())
}

fn stats_since(after: StoreStats, before: StoreStats) -> StoreStats {
    StoreStats {
        commits: after.commits - before.commits,
        batches: after.batches - before.batches,
        fsyncs: after.fsyncs - before.fsyncs,
    }
}

/// (b) `n` sequential commits of one option change each.
async fn store_sequential(
    dir: &Path,
    brick: &Path,
    n: usize,
    options: StoreOptions,
) -> anyhow::Result<(f64, Histogram<u64>, StoreStats)> {
    let store = fresh_store(dir, brick, options).await?;
    let warm = warmup(n);
    for i in 0..warm {
        timed_commit(&store, set_change(i)?).await?;
    }
    let before = store.stats();
    let mut h = histogram()?;
    let start = Instant::now();
    for i in warm..warm + n {
        let elapsed = timed_commit(&store, set_change(i)?).await?;
        h.record(nanos(elapsed))?;
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    Ok((rate, h, stats_since(store.stats(), before)))
}

/// (b) `n` commits from `tasks` concurrent tasks on one store (group commit).
async fn store_group(
    dir: &Path,
    brick: &Path,
    n: usize,
    tasks: usize,
    options: StoreOptions,
) -> anyhow::Result<(f64, Histogram<u64>, StoreStats)> {
    let store = Arc::new(fresh_store(dir, brick, options).await?);
    let warm = warmup(n);
    for i in 0..warm {
        timed_commit(&store, set_change(i)?).await?;
    }
    let before = store.stats();
    let start = Instant::now();
    let mut running = JoinSet::new();
    for k in 0..tasks {
        let store = store.clone();
        running.spawn(async move {
            let mut h = histogram()?;
            for i in (k..n).step_by(tasks) {
                let elapsed = timed_commit(&store, set_change(warm + i)?).await?;
                h.record(nanos(elapsed))?;
            }
            anyhow::Ok(h)
        });
    }
    let mut h = histogram()?;
    while let Some(done) = running.join_next().await {
        h.add(done??)?;
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    Ok((rate, h, stats_since(store.stats(), before)))
}

/// (d) Whether `gluster` is on PATH.
fn note_gluster(out: &mut Reporter) {
    use std::os::unix::fs::PermissionsExt;
    let found = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join("gluster"))
            .find(|p| {
                std::fs::metadata(p)
                    .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            })
    });
    let note = match &found {
        Some(p) => json!({
            "found": p.display().to_string(),
            "note": "GlusterFS comparison possible (`gluster volume set` against a running glusterd); not run: kiln-bench does not set up glusterd",
        }),
        None => json!({
            "found": null,
            "note": "gluster not found on PATH: no GlusterFS comparison",
        }),
    };
    out.note("gluster", &note);
}

/// A UDP port on 127.0.0.1 that was free (for UDP and TCP, as a brick binds both) just now.
fn free_port() -> anyhow::Result<u16> {
    for _ in 0..PORT_TRIES {
        let udp = std::net::UdpSocket::bind("127.0.0.1:0")?;
        let port = udp.local_addr()?.port();
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no free port on 127.0.0.1 after {PORT_TRIES} tries")
}

fn check_socket_path(path: &Path) -> anyhow::Result<()> {
    if path.as_os_str().len() > SOCKET_PATH_MAX_BYTES {
        bail!(
            "{} is longer than a Unix socket path may be ({SOCKET_PATH_MAX_BYTES} bytes); use a shorter --scratch",
            path.display()
        );
    }
    Ok(())
}

/// A running `kiln-mgmtd`, stopped (SIGTERM, bounded wait, SIGKILL) when dropped.
struct Mgmtd {
    child: Option<Child>,
    kiln: PathBuf,
    socket: PathBuf,
    log: PathBuf,
}

/// How `kiln-mgmtd` ended.
struct Stopped {
    status: Option<ExitStatus>,
    killed: bool,
    took: Duration,
}

impl Mgmtd {
    fn start(bins: &Bins, mgmtd_bin: &Path, dir: &Path) -> anyhow::Result<Mgmtd> {
        let state = dir.join("state");
        let socket = dir.join("run/mgmtd.sock");
        check_socket_path(&socket)?;
        check_socket_path(
            &state
                .join("run")
                .join(format!("{}.sock", Brick::name(VOLUME_NAME, 0))),
        )?;
        let log = dir.join("mgmtd.log");
        let log_file = std::fs::File::options()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("cannot open {}", log.display()))?;
        let child = Command::new(mgmtd_bin)
            .arg("--state-dir")
            .arg(&state)
            .arg("--socket")
            .arg(&socket)
            .arg("--brickd")
            .arg(&bins.brickd)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .with_context(|| format!("cannot run {}", mgmtd_bin.display()))?;
        let mut mgmtd = Mgmtd {
            child: Some(child),
            kiln: bins.kiln.clone(),
            socket,
            log,
        };
        let deadline = Instant::now() + LISTEN_TIMEOUT;
        while std::os::unix::net::UnixStream::connect(&mgmtd.socket).is_err() {
            if let Some(child) = mgmtd.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                mgmtd.child = None;
                bail!(
                    "kiln-mgmtd exited ({status}) before listening:\n{}",
                    log_tail(&mgmtd.log)
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "kiln-mgmtd did not listen on {} within {LISTEN_TIMEOUT:?}:\n{}",
                    mgmtd.socket.display(),
                    log_tail(&mgmtd.log)
                );
            }
            std::thread::sleep(POLL_INTERVAL);
        }
        Ok(mgmtd)
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Runs `kiln <args>` against this daemon.
    fn kiln(&self, args: &[&str]) -> anyhow::Result<Ran> {
        run_captured(
            Command::new(&self.kiln)
                .args(args)
                .env("KILN_MGMT_SOCKET", &self.socket),
            COMMAND_TIMEOUT,
        )
    }

    /// Runs `kiln <args>` and fails unless it succeeds.
    fn ok(&self, args: &[&str]) -> anyhow::Result<Ran> {
        let ran = self.kiln(args)?;
        if !ran.status.success() {
            bail!(
                "kiln {} failed ({}): {}\nkiln-mgmtd's log:\n{}",
                args.join(" "),
                ran.status,
                ran.stderr.trim(),
                log_tail(&self.log)
            );
        }
        Ok(ran)
    }

    /// SIGTERM, then waits (bounded); SIGKILL if it does not go.
    fn stop(&mut self) -> anyhow::Result<Stopped> {
        let Some(mut child) = self.child.take() else {
            bail!("kiln-mgmtd is not running");
        };
        let start = Instant::now();
        rustix::process::kill_process(pid_of(&child)?, Signal::TERM)
            .context("cannot send SIGTERM to kiln-mgmtd")?;
        let mut killed = false;
        if !wait_exit(&child, STOP_TIMEOUT, || false)? {
            killed = true;
            let _ = child.kill();
            wait_exit(&child, KILL_TIMEOUT, || false)?;
        }
        let status = child.try_wait()?;
        Ok(Stopped {
            status,
            killed,
            took: start.elapsed(),
        })
    }
}

impl Drop for Mgmtd {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.stop();
        }
    }
}

/// The brick pids `kiln volume --json status` reports once every brick runs.
fn running_bricks(m: &Mgmtd, deadline: Instant) -> anyhow::Result<Vec<u32>> {
    loop {
        let ran = m.ok(&["volume", "--json", "status", VOLUME_NAME])?;
        let status: serde_json::Value = serde_json::from_str(ran.stdout.trim())
            .with_context(|| format!("`kiln volume --json status`: {}", ran.stdout.trim()))?;
        let bricks = status["bricks"].as_array().cloned().unwrap_or_default();
        let pids: Vec<u32> = bricks
            .iter()
            .filter(|b| b["state"] == "running")
            .filter_map(|b| b["pid"].as_u64().and_then(|p| u32::try_from(p).ok()))
            .collect();
        if !bricks.is_empty() && pids.len() == bricks.len() {
            return Ok(pids);
        }
        if Instant::now() >= deadline {
            bail!(
                "the brick of volume {VOLUME_NAME} is not running after {BRICK_TIMEOUT:?}: {}",
                ran.stdout.trim()
            );
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// Whether a `kiln volume set` answer says the running bricks applied the change.
fn applied_live(ran: &Ran) -> bool {
    ran.stdout.contains("; applied by")
}

/// `n` measured `kiln volume set` processes, values from `*next` on. Returns sets/s, the
/// latency of each and how many were applied by a running brick.
fn cli_sets(m: &Mgmtd, n: usize, next: &mut usize) -> anyhow::Result<(f64, Histogram<u64>, usize)> {
    let mut h = histogram()?;
    let mut applied = 0;
    let start = Instant::now();
    for _ in 0..n {
        let v = value(*next);
        *next += 1;
        let ran = m.ok(&["volume", "set", VOLUME_NAME, KEY, &v])?;
        h.record(nanos(ran.elapsed))?;
        applied += usize::from(applied_live(&ran));
    }
    Ok((n as f64 / start.elapsed().as_secs_f64(), h, applied))
}

/// (a) What a command costs before it talks to the daemon, spawned, reaped and timed as the
/// sets are: `true` (the smallest program: this harness's spawn, exec and reap) and
/// `kiln --version` (kiln's exec, dynamic linking, runtime start and argument parsing, no
/// socket).
fn spawn_floors(
    m: &Mgmtd,
    sets: usize,
    floor: Floor,
    out: &mut Reporter,
) -> anyhow::Result<Vec<Record>> {
    let true_run = || -> anyhow::Result<Duration> {
        let ran = run_captured(&mut Command::new("true"), COMMAND_TIMEOUT)?;
        if !ran.status.success() {
            bail!("`true` failed ({})", ran.status);
        }
        Ok(ran.elapsed)
    };
    let version_run = || Ok(m.ok(&["--version"])?.elapsed);
    let mut records = Vec::new();
    for (target, run) in [
        ("true", &true_run as &dyn Fn() -> anyhow::Result<Duration>),
        ("kiln-version", &version_run),
    ] {
        for _ in 0..warmup(sets) {
            run()?;
        }
        let mut h = histogram()?;
        let start = Instant::now();
        for _ in 0..sets {
            h.record(nanos(run()?))?;
        }
        let rate = sets as f64 / start.elapsed().as_secs_f64();
        let r = latency_record(
            "mgmt.spawn",
            target,
            json!({ "runs": sets }),
            rate,
            &h,
            floor,
        );
        out.print(&r);
        records.push(r);
    }
    Ok(records)
}

/// (a) `kiln volume set` through a real `kiln-mgmtd`, with the volume created, then started.
fn cli(
    bins: &Bins,
    mgmtd_bin: &Path,
    root: &Path,
    sets: usize,
    floor: Floor,
    out: &mut Reporter,
) -> anyhow::Result<Vec<Record>> {
    let dir = root.join("mgmtd");
    std::fs::create_dir_all(&dir)?;
    let brick = dir.join("bricks/b0");
    let mut m = start_with_volume(bins, mgmtd_bin, &dir, &brick, out)?;
    let mut records = Vec::new();
    let mut next = 0;
    let warm = warmup(sets);

    records.extend(spawn_floors(&m, sets, floor, out)?);

    // Created, not started: parse, commit, answer.
    for _ in 0..warm {
        m.ok(&["volume", "set", VOLUME_NAME, KEY, &value(next)])?;
        next += 1;
    }
    let (rate, h, _) = cli_sets(&m, sets, &mut next)?;
    let r = latency_record(
        "mgmt.set",
        "kiln-cli",
        json!({ "sets": sets, "key": KEY, "volume": "created" }),
        rate,
        &h,
        floor,
    );
    out.print(&r);
    records.push(r);

    // Started: each set is also pushed to the running brick.
    m.ok(&["volume", "start", VOLUME_NAME])?;
    let deadline = Instant::now() + BRICK_TIMEOUT;
    let brick_pids = running_bricks(&m, deadline)?;
    warm_up_live(&m, &dir, warm, &mut next, deadline)?;
    let (rate, h, applied) = cli_sets(&m, sets, &mut next)?;
    let r = latency_record(
        "mgmt.set",
        "kiln-cli-started",
        json!({ "sets": sets, "key": KEY, "volume": "started", "bricks": brick_pids.len(),
                "applied_live": applied }),
        rate,
        &h,
        floor,
    );
    out.print(&r);
    records.push(r);

    stop_cleanly(&mut m, &brick_pids, &brick, out)?;
    Ok(records)
}

/// Starts `kiln-mgmtd` in `dir` and creates volume `v` on `brick` with a free port.
fn start_with_volume(
    bins: &Bins,
    mgmtd_bin: &Path,
    dir: &Path,
    brick: &Path,
    out: &mut Reporter,
) -> anyhow::Result<Mgmtd> {
    let brick_s = brick.to_str().context("the scratch path is not UTF-8")?;
    let port = free_port()?;
    let m = Mgmtd::start(bins, mgmtd_bin, dir)?;
    out.note(
        "mgmtd",
        &json!({
            "pid": m.pid(),
            "socket": m.socket.display().to_string(),
            "brick": brick_s,
            "brick_port": port,
        }),
    );
    m.ok(&[
        "volume",
        "create",
        VOLUME_NAME,
        brick_s,
        "--port",
        &port.to_string(),
    ])?;
    Ok(m)
}

/// Sets values from `*next` on until one is applied by the started brick, then `warm`
/// more applied ones (or until `deadline`). "running" means spawned; the first sets may
/// find the control socket not yet there.
fn warm_up_live(
    m: &Mgmtd,
    dir: &Path,
    warm: usize,
    next: &mut usize,
    deadline: Instant,
) -> anyhow::Result<()> {
    let mut warmed = 0;
    let mut reached = false;
    let max_tries = usize::try_from(BRICK_TIMEOUT.as_millis() / POLL_INTERVAL.as_millis())
        .unwrap_or(usize::MAX);
    for _ in 0..max_tries {
        let ran = m.ok(&["volume", "set", VOLUME_NAME, KEY, &value(*next)])?;
        *next += 1;
        if applied_live(&ran) {
            reached = true;
            warmed += 1;
            if warmed >= warm {
                break;
            }
        } else if Instant::now() >= deadline {
            break;
        } else {
            std::thread::sleep(POLL_INTERVAL);
        }
    }
    if !reached {
        bail!(
            "no `kiln volume set` reached the running brick within {BRICK_TIMEOUT:?} (see {})",
            dir.join("state/logs")
                .join(format!("{}.log", Brick::name(VOLUME_NAME, 0)))
                .display()
        );
    }
    Ok(())
}

/// Stops `kiln-mgmtd` with SIGTERM and notes how; kills bricks it left running, and fails
/// unless it stopped cleanly and took its bricks with it.
fn stop_cleanly(
    m: &mut Mgmtd,
    brick_pids: &[u32],
    brick: &Path,
    out: &mut Reporter,
) -> anyhow::Result<()> {
    let stopped = m.stop()?;
    let left: Vec<u32> = brick_pids
        .iter()
        .copied()
        .filter(|pid| brick_still_running(*pid, brick))
        .collect();
    out.note(
        "mgmtd_stop",
        &json!({
            "status": stopped.status.map(|s| s.to_string()),
            "sigkill": stopped.killed,
            "ms": stopped.took.as_millis(),
            "bricks_left_running": left,
        }),
    );
    for &pid in &left {
        if let Some(pid) = i32::try_from(pid).ok().and_then(Pid::from_raw) {
            let _ = rustix::process::kill_process(pid, Signal::KILL);
        }
    }
    if stopped.killed || !stopped.status.is_some_and(|s| s.success()) || !left.is_empty() {
        bail!(
            "kiln-mgmtd did not stop cleanly on SIGTERM (status {:?}, SIGKILL needed: {}, bricks left running: {left:?}):\n{}",
            stopped.status.map(|s| s.to_string()),
            stopped.killed,
            log_tail(&m.log)
        );
    }
    Ok(())
}

/// Whether `pid` is still a live `kiln-brickd` serving `brick` (a reaped pid may be reused).
fn brick_still_running(pid: u32, brick: &Path) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| {
        cmdline
            .split(|&b| b == 0)
            .any(|arg| arg == brick.as_os_str().as_encoded_bytes())
    })
}
