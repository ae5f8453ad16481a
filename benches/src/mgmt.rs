//! `kiln-bench mgmt`: the management path — an option change as a user makes it, and the
//! configuration store under it — against the durability floor of the scratch disk, all in one
//! run on the scratch directory. `--store` picks the configuration store: `embedded` (the
//! default: the daemon's own log) or `etcd` (one etcd member the run starts; see below).
//!
//! Workloads (each phase is `sets` operations, after a few unmeasured warm-up ones; every
//! row's `params.store` names the run's store, so the two runs can be told apart):
//!
//! * `mgmt.floor` — the references, each on a file of its own in the scratch directory, with
//!   as many bytes as one store commit appends to the embedded log (measured first on a log
//!   store of its own, in both runs: `params.bytes`):
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
//! With `--store etcd` the run starts one etcd member (`etcd` on PATH or Debian's; the run
//! fails when it is not installed) on free loopback ports, its data directory in the scratch
//! directory: etcd's write-ahead log and its fdatasyncs are on the disk the floors measure
//! (and compete with them for it). The floors are the same as in the embedded run (the bytes
//! of one embedded-log commit), so the two runs' ratios compare. What changes:
//!
//! * `mgmt.commit` / `store` and `store_group` measure an [`EtcdStore::<Cluster>`](EtcdStore)
//!   on a fresh cluster name (key prefix) instead of the log. A commit is one etcd
//!   transaction: a gRPC round trip on loopback, a compare-and-set on the commit key that
//!   writes the volume's whole object and the commit record, which etcd appends to its
//!   write-ahead log and fdatasyncs before it answers (one member is its own quorum; its
//!   key-value backend commits in the background, with fsyncs of its own). `store_group`'s
//!   committers share one store, which sends one daemon's commits to etcd one at a time (as
//!   a daemon does), so they queue in the store rather than race on the commit key. etcd's
//!   own fsyncs are not counted here: `fsyncs` and `batches` are null.
//! * `mgmt.set` runs `kiln-mgmtd --etcd URL --host 127.0.0.1 --cluster NAME` (a fresh
//!   name): each set is an etcd transaction and the daemon's own work.
//!
//! `ratio` = the floor's p50 / this p50 (>1 = faster than the floor), against
//! `append_fdatasync` for every row and, for the store's rows, once more against
//! `replace_fsync`. A sequential commit is one append and one fdatasync (on etcd: one
//! write-ahead log append and fdatasync), so against `append_fdatasync` it can at best tie:
//! the difference is what the store adds (the embedded log's encoding and the hand-off to its
//! writer thread and back; etcd's round trip, raft and transaction). For `store_group` "this
//! p50" is the time per commit of the whole run (wall time ÷ commits, i.e. the ratio is
//! commits/s × the floor's p50), because a commit that waits in a group is never quicker than
//! one fdatasync; the group's throughput is what beats the floor. The CLI sets add a process
//! start and a socket round trip.
//!
//! The binaries `kiln-mgmtd`, `kiln` and `kiln-brickd` are taken from beside the running
//! `kiln-bench` (`cargo build --release` builds them all). The brick gets a UDP port that was
//! free a moment before. At the end `kiln-mgmtd` gets SIGTERM and is waited for, SIGKILL
//! after a bounded wait; on the embedded store it stops its brick itself, while on etcd a
//! daemon's bricks outlive it, so the volume is stopped first (`kiln volume stop v`). Either
//! way the run fails if a brick is left running. etcd is killed when the run ends. Every loop
//! is bounded by a count and every wait by a time.
//!
//! Last, in the same run and once kiln-mgmtd and etcd are stopped, GlusterFS's own
//! `volume set`, where `gluster` and `glusterd` are installed (nothing is installed) and
//! `--no-glusterfs` is not given:
//!
//! * `mgmt.set` / `gluster-cli` — glusterd started unless one runs, a one-brick volume
//!   created (`gluster volume create NAME HOST:BRICK force`, the brick in the scratch
//!   directory) and started, then each set `gluster --mode=script volume set NAME
//!   performance.io-thread-count <n>` (a live option: the running brick reconfigures; `n`
//!   cycles through 1..=64 so every set is a real change), spawned, reaped and timed as the
//!   kiln CLI's sets, after the same warm-up. Against the floor like the other rows;
//!   `params.kiln_cli_vs_gluster` is its p50 ÷ the same run's `kiln-cli` p50 (>1 = Kiln's
//!   set is faster), `kiln_cli_started_vs_gluster` the same against `kiln-cli-started`
//!   (both volumes running). The volume is then stopped (`--mode=script`) and deleted, and
//!   glusterd stopped if this run started it (`mount::glusterd`).
//!
//! A `gluster` note says what was set up, or why there is no `gluster-cli` row (no `gluster`
//! on PATH, `--no-glusterfs`, or the set-up failed: the run does not fail for it).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hdrhistogram::Histogram;
use kiln_admin::options;
use kiln_admin::volume::{Brick, Volume, VolumeState};
use kiln_mgmt::etcd_server::{EtcdServer, etcd_binary};
use kiln_mgmt::store::etcd::{EtcdStore, EtcdTarget};
use kiln_mgmt::store::{ConfigStore, LOG_FILE, LogStore, StoreOptions, StoreStats};
use kiln_mgmt::volume::{BRICK_PORT_BASE, Change, Cluster};
use rustix::process::{Pid, Signal};
use serde_json::json;
use tokio::task::JoinSet;

use crate::mount::glusterd::Glusterd;
use crate::process::{
    Bins, KILL_TIMEOUT, Ran, STOP_TIMEOUT, check_stop, log_tail, pid_of, run_captured, wait_exit,
    which,
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
    /// The configuration store under the commits and the daemon.
    pub store: MgmtStore,
    /// Measure `gluster volume set` too, where GlusterFS is installed.
    pub glusterfs: bool,
}

/// Which configuration store the commit and set phases run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum MgmtStore {
    /// The daemon's embedded log ([`LogStore`]), in the scratch directory.
    #[default]
    Embedded,
    /// One etcd member the run starts, its data in the scratch directory ([`EtcdStore`]).
    Etcd,
}

impl MgmtStore {
    /// Its name, as on the command line and in every row's `params.store`.
    pub fn name(self) -> &'static str {
        match self {
            MgmtStore::Embedded => "embedded",
            MgmtStore::Etcd => "etcd",
        }
    }
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
/// The store phases' names: their directories in the scratch directory, or their cluster
/// names in etcd (each fresh).
const STORE_PROBE: &str = "store-probe";
const STORE_SEQUENTIAL: &str = "store-seq";
const STORE_GROUP: &str = "store-group";
/// GlusterFS's option the `gluster-cli` row changes: live (a started volume's brick
/// reconfigures when it changes).
const GLUSTER_KEY: &str = "performance.io-thread-count";
/// Its values cycle through 1..=GLUSTER_VALUES (GlusterFS takes 1 to 64).
const GLUSTER_VALUES: usize = 64;
/// The cluster name of the daemon on etcd (fresh: the run's etcd starts empty).
const MGMTD_CLUSTER: &str = "mgmtd";
/// The host name of the daemon on etcd: its bricks, and it, are on loopback.
const MGMTD_HOST: &str = "127.0.0.1";
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

/// The value of the `i`-th `gluster volume set`: consecutive sets always differ.
fn gluster_value(i: usize) -> String {
    (i % GLUSTER_VALUES + 1).to_string()
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

/// The rows of a run, each printed as it is measured and kept, its params naming the store.
struct Rows<'a> {
    store: MgmtStore,
    out: &'a mut Reporter,
    records: Vec<Record>,
}

impl Rows<'_> {
    fn push(&mut self, mut r: Record) {
        assert!(r.params.is_object(), "params must be an object: {r:?}");
        r.params["store"] = json!(self.store.name());
        self.out.print(&r);
        self.records.push(r);
    }

    fn note(&mut self, key: &str, value: &serde_json::Value) {
        self.out.note(key, value);
    }
}

/// Where the store phases make their fresh stores.
enum StoreSite {
    /// A [`LogStore`] in a new directory under `root`, one per phase.
    Log {
        root: PathBuf,
        options: StoreOptions,
    },
    /// An [`EtcdStore`] under a new cluster name, one per phase, in the etcd at `endpoint`.
    Etcd { endpoint: String },
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
    // Started before the daemon that uses it, so it is killed after it.
    let etcd = match bench.store {
        MgmtStore::Embedded => None,
        MgmtStore::Etcd => Some(start_etcd(&root, out)?),
    };
    let store_options = StoreOptions::default();
    let site = match &etcd {
        None => StoreSite::Log {
            root: root.clone(),
            options: store_options,
        },
        Some(server) => StoreSite::Etcd {
            endpoint: server.member.client_url(),
        },
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let brick = root.join("store-brick");
    let commit_bytes = rt.block_on(commit_bytes(&root, &brick))?;
    out.note(
        "mgmt",
        &json!({
            "binaries": bins.dir.display().to_string(),
            "key": KEY,
            "sets": sets,
            "group_tasks": tasks,
            "store": store_note(bench.store, store_options, commit_bytes),
            "floors": {
                APPEND_FLOOR: format!("write {commit_bytes} B to a file opened for appending, fdatasync"),
                REPLACE_FLOOR: format!("write {commit_bytes} B to a temp name, fsync, rename over the target, fsync the directory"),
            },
        }),
    );
    let mut rows = Rows {
        store: bench.store,
        out,
        records: Vec::new(),
    };

    // (c) The references first.
    let floors = floors(&root.join("floor"), sets, commit_bytes, &mut rows)?;

    // (b) The store alone: sequential, then grouped.
    rt.block_on(store_rows(&site, &brick, sets, tasks, floors, &mut rows))?;
    drop(rt);

    // (a) `kiln volume set` through a real kiln-mgmtd.
    let endpoint = etcd.as_ref().map(|server| server.member.client_url());
    let kiln = cli(
        &bins,
        &mgmtd,
        &root,
        endpoint.as_deref(),
        sets,
        floors[0],
        &mut rows,
    )?;
    drop(etcd);

    // (d) `gluster volume set`, where GlusterFS is installed.
    gluster(&root, bench.glusterfs, sets, floors[0], kiln, &mut rows)?;
    Ok(rows.records)
}

/// What the `mgmt` note says of the store. `bytes_per_commit` is an embedded-log commit's in
/// both runs: the floors write that many bytes.
fn store_note(store: MgmtStore, options: StoreOptions, commit_bytes: usize) -> serde_json::Value {
    match store {
        MgmtStore::Embedded => json!({
            "kind": store.name(),
            "compact_after_bytes": options.compact_after_bytes,
            "queue_max": options.queue_max,
            "bytes_per_commit": commit_bytes,
        }),
        MgmtStore::Etcd => json!({
            "kind": store.name(),
            "bytes_per_commit": commit_bytes,
            "bytes_per_commit_of": "one commit to the embedded log (the floors' size in both runs); an etcd transaction writes the volume's whole object and the commit record",
        }),
    }
}

/// One etcd member with its data directory in `root` (on the scratch disk, as the floors
/// are), noted.
fn start_etcd(root: &Path, out: &mut Reporter) -> anyhow::Result<EtcdServer> {
    let Some(binary) = etcd_binary() else {
        bail!("etcd is not installed (apt-get install etcd-server)");
    };
    let version = run_captured(Command::new(&binary).arg("--version"), COMMAND_TIMEOUT)?;
    let data_dir = root.join("etcd");
    let server = EtcdServer::single(&binary, &data_dir).with_context(|| {
        format!(
            "cannot start {} in {}",
            binary.display(),
            data_dir.display()
        )
    })?;
    out.note(
        "etcd",
        &json!({
            "binary": binary.display().to_string(),
            "version": version.stdout.lines().next().unwrap_or_default().trim(),
            "endpoint": server.member.client_url(),
            "data_dir": data_dir.display().to_string(),
            "log": data_dir.with_extension("log").display().to_string(),
        }),
    );
    Ok(server)
}

/// (b) The store's rows: sequential commits against both floors, then grouped ones.
async fn store_rows(
    site: &StoreSite,
    brick: &Path,
    sets: usize,
    tasks: usize,
    floors: [Floor; 2],
    rows: &mut Rows<'_>,
) -> anyhow::Result<()> {
    let sequential = store_sequential(site, brick, sets).await?;
    for floor in floors {
        rows.push(latency_record(
            "mgmt.commit",
            "store",
            sequential.params(sets, 1),
            sequential.rate,
            &sequential.latency,
            floor,
        ));
    }
    let group = store_group(site, brick, sets, tasks).await?;
    for floor in floors {
        let mut r = latency_record(
            "mgmt.commit",
            "store_group",
            group.params(sets, tasks),
            group.rate,
            &group.latency,
            floor,
        );
        // A grouped commit waits at least one fdatasync; what beats the floor is throughput.
        r.ratio = Some(group.rate * floor.p50_us / 1e6);
        rows.push(r);
    }
    Ok(())
}

/// (c) Both floors, `bytes` each, `n` samples each: their rows pushed, the floors returned
/// (the append first).
fn floors(dir: &Path, n: usize, bytes: usize, rows: &mut Rows<'_>) -> anyhow::Result<[Floor; 2]> {
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
    let floor = |name: &'static str, (rate, h): (f64, Histogram<u64>), rows: &mut Rows<'_>| {
        let floor = Floor::of(name, &h);
        rows.push(latency_record(
            "mgmt.floor",
            name,
            json!({ "samples": n, "bytes": bytes }),
            rate,
            &h,
            floor,
        ));
        floor
    };
    Ok([
        floor(APPEND_FLOOR, append, rows),
        floor(REPLACE_FLOOR, replace, rows),
    ])
}

/// Runs `op` `warmup(n)` times unmeasured, then `n` times timed: ops/s and each latency.
fn timed(
    n: usize,
    mut op: impl FnMut() -> std::io::Result<()>,
) -> anyhow::Result<(f64, Histogram<u64>)> {
    sampled(n, |_| {
        let t = Instant::now();
        op()?;
        Ok(t.elapsed())
    })
}

/// Runs `op(i)` for `i` in `0..warmup(n)` unmeasured, then for the next `n` values, each
/// returning the latency it measured: ops/s over those `n`, and their latencies.
fn sampled(
    n: usize,
    mut op: impl FnMut(usize) -> anyhow::Result<Duration>,
) -> anyhow::Result<(f64, Histogram<u64>)> {
    let warm = warmup(n);
    for i in 0..warm {
        op(i)?;
    }
    let mut h = histogram()?;
    let start = Instant::now();
    for i in warm..warm + n {
        h.record(nanos(op(i)?))?;
    }
    Ok((n as f64 / start.elapsed().as_secs_f64(), h))
}

/// Bytes one option change appends to the embedded store's log, measured on a fresh log
/// store under `root` (whatever store the run measures: the floors are the same in both).
async fn commit_bytes(root: &Path, brick: &Path) -> anyhow::Result<usize> {
    let site = StoreSite::Log {
        root: root.to_owned(),
        options: StoreOptions::default(),
    };
    let store = fresh_store(&site, STORE_PROBE, brick).await?;
    let log = root.join(STORE_PROBE).join(LOG_FILE);
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

/// A fresh store named `name` at `site` with volume `v` created in it.
async fn fresh_store(
    site: &StoreSite,
    name: &str,
    brick: &Path,
) -> anyhow::Result<ConfigStore<Cluster>> {
    let store = match site {
        StoreSite::Log { root, options } => {
            let dir = root.join(name);
            if dir.exists() {
                bail!("{} already exists; the store must be fresh", dir.display());
            }
            let (store, _) = LogStore::<Cluster>::open(&dir, *options)
                .with_context(|| format!("opening a store in {}", dir.display()))?;
            ConfigStore::Log(store)
        }
        StoreSite::Etcd { endpoint } => {
            let target = EtcdTarget {
                endpoints: vec![endpoint.clone()],
                cluster: name.to_owned(),
            };
            let store = EtcdStore::<Cluster>::open(target)
                .await
                .with_context(|| format!("opening cluster {name} in etcd at {endpoint}"))?;
            if store.generation() != 0 {
                bail!("cluster {name} in etcd at {endpoint} is not empty; the store must be fresh");
            }
            ConfigStore::Etcd(Box::new(store))
        }
    };
    let volume = Volume {
        name: VOLUME_NAME.into(),
        id: "00000000-0000-4000-8000-00000000b0b0".into(),
        bricks: vec![Brick::new(None, brick.to_owned(), BRICK_PORT_BASE)],
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

/// One commit of `change`, timed.
async fn timed_commit(store: &ConfigStore<Cluster>, change: Change) -> anyhow::Result<Duration> {
    let t = Instant::now();
    store.commit(vec![change]).await.context("commit")?;
    Ok(t.elapsed())
}

/// The embedded log's own counts (etcd's are not seen from here).
fn log_stats(store: &ConfigStore<Cluster>) -> Option<StoreStats> {
    match store {
        ConfigStore::Log(store) => Some(store.stats()),
        ConfigStore::Etcd(_) => None,
    }
}

/// The counts between `before` and `after`, when the store keeps them.
fn stats_since(after: Option<StoreStats>, before: Option<StoreStats>) -> Option<StoreStats> {
    let (after, before) = after.zip(before)?;
    Some(StoreStats {
        commits: after.commits - before.commits,
        batches: after.batches - before.batches,
        fsyncs: after.fsyncs - before.fsyncs,
    })
}

/// The measured commits of one store phase.
struct Commits {
    /// Commits per second over the phase.
    rate: f64,
    /// Each commit's latency.
    latency: Histogram<u64>,
    /// The embedded log's counts over the phase; `None` on etcd.
    stats: Option<StoreStats>,
}

impl Commits {
    fn params(&self, commits: usize, tasks: usize) -> serde_json::Value {
        json!({ "commits": commits, "tasks": tasks,
                "fsyncs": self.stats.map(|s| s.fsyncs), "batches": self.stats.map(|s| s.batches) })
    }
}

/// (b) `n` sequential commits of one option change each.
async fn store_sequential(site: &StoreSite, brick: &Path, n: usize) -> anyhow::Result<Commits> {
    let store = fresh_store(site, STORE_SEQUENTIAL, brick).await?;
    let warm = warmup(n);
    for i in 0..warm {
        timed_commit(&store, set_change(i)?).await?;
    }
    let before = log_stats(&store);
    let mut latency = histogram()?;
    let start = Instant::now();
    for i in warm..warm + n {
        latency.record(nanos(timed_commit(&store, set_change(i)?).await?))?;
    }
    Ok(Commits {
        rate: n as f64 / start.elapsed().as_secs_f64(),
        latency,
        stats: stats_since(log_stats(&store), before),
    })
}

/// (b) `n` commits from `tasks` concurrent tasks on one store (group commit).
async fn store_group(
    site: &StoreSite,
    brick: &Path,
    n: usize,
    tasks: usize,
) -> anyhow::Result<Commits> {
    let store = Arc::new(fresh_store(site, STORE_GROUP, brick).await?);
    let warm = warmup(n);
    for i in 0..warm {
        timed_commit(&store, set_change(i)?).await?;
    }
    let before = log_stats(&store);
    let start = Instant::now();
    let mut running = JoinSet::new();
    for k in 0..tasks {
        let store = store.clone();
        running.spawn(async move {
            let mut latency = histogram()?;
            for i in (k..n).step_by(tasks) {
                latency.record(nanos(timed_commit(&store, set_change(warm + i)?).await?))?;
            }
            anyhow::Ok(latency)
        });
    }
    let mut latency = histogram()?;
    while let Some(done) = running.join_next().await {
        latency.add(done??)?;
    }
    Ok(Commits {
        rate: n as f64 / start.elapsed().as_secs_f64(),
        latency,
        stats: stats_since(log_stats(&store), before),
    })
}

/// (d) `gluster volume set` on a one-brick GlusterFS volume in `root`, timed as the kiln
/// CLI's sets and compared with `kiln`'s p50s; noted and skipped where `gluster` is not on
/// PATH, with `--no-glusterfs` (`enabled` false), or where GlusterFS cannot be set up.
fn gluster(
    root: &Path,
    enabled: bool,
    sets: usize,
    floor: Floor,
    kiln: KilnSets,
    rows: &mut Rows<'_>,
) -> anyhow::Result<()> {
    let found = which("gluster").map(|p| p.display().to_string());
    let note = |note: String, setup: serde_json::Value| json!({ "found": found, "note": note, "setup": setup });
    if found.is_none() {
        let why = "gluster not found on PATH: no GlusterFS comparison";
        rows.note("gluster", &note(why.into(), json!(null)));
        return Ok(());
    }
    if !enabled {
        let why = "--no-glusterfs: no GlusterFS comparison";
        rows.note("gluster", &note(why.into(), json!(null)));
        return Ok(());
    }
    let dir = root.join("glusterfs");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    // Torn down when dropped, on every path out of here.
    let mut g = match Glusterd::set_up_installed(&dir, &dir) {
        Ok(g) => g,
        Err(e) => {
            check_stop()?;
            let why = format!("GlusterFS could not be set up, no comparison: {e:#}");
            rows.note("gluster", &note(why, json!(null)));
            return Ok(());
        }
    };
    let what = format!("`gluster volume set {} {GLUSTER_KEY} <n>`", g.volume());
    rows.note("gluster", &note(what, g.describe()));
    let (rate, h) = gluster_sets(&g, sets)?;
    let p50_us = micros(&h, 0.5);
    rows.push(latency_record(
        "mgmt.set",
        "gluster-cli",
        json!({ "sets": sets, "key": GLUSTER_KEY, "volume": "started", "bricks": 1,
                "kiln_cli_vs_gluster": p50_us / kiln.created_p50_us,
                "kiln_cli_started_vs_gluster": p50_us / kiln.started_p50_us }),
        rate,
        &h,
        floor,
    ));
    rows.note("gluster_teardown", &g.tear_down());
    Ok(())
}

/// `n` measured `gluster volume set` processes after `warmup(n)` unmeasured ones: sets/s and
/// the latency of each.
fn gluster_sets(g: &Glusterd, n: usize) -> anyhow::Result<(f64, Histogram<u64>)> {
    sampled(n, |i| g.set(GLUSTER_KEY, &gluster_value(i)))
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

/// A running `kiln-mgmtd`, stopped (SIGTERM, bounded wait, SIGKILL) when dropped; on etcd,
/// whose daemons leave their bricks running, its volume is stopped first.
struct Mgmtd {
    child: Option<Child>,
    kiln: PathBuf,
    socket: PathBuf,
    log: PathBuf,
    /// The configuration is in etcd: the bricks outlive the daemon.
    on_etcd: bool,
}

/// How `kiln-mgmtd` ended.
struct Stopped {
    status: Option<ExitStatus>,
    killed: bool,
    took: Duration,
}

impl Mgmtd {
    /// Starts `kiln-mgmtd` in `dir`: on its embedded store, or on the etcd at `etcd` as
    /// host [`MGMTD_HOST`] of cluster [`MGMTD_CLUSTER`].
    fn start(
        bins: &Bins,
        mgmtd_bin: &Path,
        dir: &Path,
        etcd: Option<&str>,
    ) -> anyhow::Result<Mgmtd> {
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
        let mut command = Command::new(mgmtd_bin);
        command
            .arg("--state-dir")
            .arg(&state)
            .arg("--socket")
            .arg(&socket)
            .arg("--brickd")
            .arg(&bins.brickd)
            // The store is this run's choice, never the environment's.
            .env_remove("KILN_ETCD")
            .env_remove("KILN_HOST")
            .env_remove("KILN_CLUSTER");
        if let Some(endpoint) = etcd {
            command
                .args(["--etcd", endpoint, "--cluster", MGMTD_CLUSTER])
                .args(["--host", MGMTD_HOST, "--listen-ip", MGMTD_HOST]);
        }
        let child = command
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
            on_etcd: etcd.is_some(),
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
            if self.on_etcd {
                // Its bricks would outlive it (the run failed before `stop_cleanly`).
                let _ = self.kiln(&["volume", "stop", VOLUME_NAME]);
            }
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
fn spawn_floors(m: &Mgmtd, sets: usize, floor: Floor, rows: &mut Rows<'_>) -> anyhow::Result<()> {
    let true_run = || -> anyhow::Result<Duration> {
        let ran = run_captured(&mut Command::new("true"), COMMAND_TIMEOUT)?;
        if !ran.status.success() {
            bail!("`true` failed ({})", ran.status);
        }
        Ok(ran.elapsed)
    };
    let version_run = || Ok(m.ok(&["--version"])?.elapsed);
    for (target, run) in [
        ("true", &true_run as &dyn Fn() -> anyhow::Result<Duration>),
        ("kiln-version", &version_run),
    ] {
        let (rate, h) = sampled(sets, |_| run())?;
        rows.push(latency_record(
            "mgmt.spawn",
            target,
            json!({ "runs": sets }),
            rate,
            &h,
            floor,
        ));
    }
    Ok(())
}

/// The p50s of the kiln CLI's set rows, which the `gluster-cli` row is compared with.
#[derive(Debug, Clone, Copy)]
struct KilnSets {
    /// `kiln-cli`: the volume created, not started.
    created_p50_us: f64,
    /// `kiln-cli-started`: each set also pushed to the running brick.
    started_p50_us: f64,
}

/// (a) `kiln volume set` through a real `kiln-mgmtd` (on the etcd at `etcd`, if given), with
/// the volume created, then started; their p50s.
fn cli(
    bins: &Bins,
    mgmtd_bin: &Path,
    root: &Path,
    etcd: Option<&str>,
    sets: usize,
    floor: Floor,
    rows: &mut Rows<'_>,
) -> anyhow::Result<KilnSets> {
    let dir = root.join("mgmtd");
    std::fs::create_dir_all(&dir)?;
    let brick = dir.join("bricks/b0");
    let mut m = start_with_volume(bins, mgmtd_bin, &dir, etcd, &brick, rows)?;
    let mut next = 0;
    let warm = warmup(sets);

    spawn_floors(&m, sets, floor, rows)?;

    // Created, not started: parse, commit, answer.
    for _ in 0..warm {
        m.ok(&["volume", "set", VOLUME_NAME, KEY, &value(next)])?;
        next += 1;
    }
    let (rate, h, _) = cli_sets(&m, sets, &mut next)?;
    let created_p50_us = micros(&h, 0.5);
    rows.push(latency_record(
        "mgmt.set",
        "kiln-cli",
        json!({ "sets": sets, "key": KEY, "volume": "created" }),
        rate,
        &h,
        floor,
    ));

    // Started: each set is also pushed to the running brick.
    m.ok(&["volume", "start", VOLUME_NAME])?;
    let deadline = Instant::now() + BRICK_TIMEOUT;
    let brick_pids = running_bricks(&m, deadline)?;
    warm_up_live(&m, &dir, warm, &mut next, deadline)?;
    let (rate, h, applied) = cli_sets(&m, sets, &mut next)?;
    let started_p50_us = micros(&h, 0.5);
    rows.push(latency_record(
        "mgmt.set",
        "kiln-cli-started",
        json!({ "sets": sets, "key": KEY, "volume": "started", "bricks": brick_pids.len(),
                "applied_live": applied }),
        rate,
        &h,
        floor,
    ));

    stop_cleanly(&mut m, &brick_pids, &brick, rows)?;
    Ok(KilnSets {
        created_p50_us,
        started_p50_us,
    })
}

/// Starts `kiln-mgmtd` in `dir` (on the etcd at `etcd`, if given) and creates volume `v` on
/// `brick` with a free port.
fn start_with_volume(
    bins: &Bins,
    mgmtd_bin: &Path,
    dir: &Path,
    etcd: Option<&str>,
    brick: &Path,
    rows: &mut Rows<'_>,
) -> anyhow::Result<Mgmtd> {
    let brick_s = brick.to_str().context("the scratch path is not UTF-8")?;
    let port = free_port()?;
    let m = Mgmtd::start(bins, mgmtd_bin, dir, etcd)?;
    rows.note(
        "mgmtd",
        &json!({
            "pid": m.pid(),
            "socket": m.socket.display().to_string(),
            "etcd": etcd.map(|endpoint| json!({ "endpoint": endpoint, "cluster": MGMTD_CLUSTER, "host": MGMTD_HOST })),
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
/// unless it stopped cleanly and its bricks stopped. On etcd, where bricks outlive their
/// daemon, the volume is stopped first (`kiln volume stop`); on the embedded store the
/// daemon takes its bricks with it.
fn stop_cleanly(
    m: &mut Mgmtd,
    brick_pids: &[u32],
    brick: &Path,
    rows: &mut Rows<'_>,
) -> anyhow::Result<()> {
    if m.on_etcd {
        m.ok(&["volume", "stop", VOLUME_NAME])?;
    }
    let stopped = m.stop()?;
    let left: Vec<u32> = brick_pids
        .iter()
        .copied()
        .filter(|pid| brick_still_running(*pid, brick))
        .collect();
    rows.note(
        "mgmtd_stop",
        &json!({
            "volume_stopped_first": m.on_etcd,
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
