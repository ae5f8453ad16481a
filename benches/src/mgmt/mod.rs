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
//! * `mgmt.commit` / `store` — [`LogStore::<Cluster>`][LogStore] opened on a fresh directory, one
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
//! * With `--static-kiln PATH`, `kiln-version-static`, `kiln-cli-static` and
//!   `kiln-cli-started-static`: the same with that `kiln` (the static build), each command
//!   alternating with the default build's so both see the same daemon and disk.
//!
//! With `--store etcd` the run starts one etcd member (`etcd` on PATH or Debian's; the run
//! fails when it is not installed) on free loopback ports, its data directory in the scratch
//! directory: etcd's write-ahead log and its fdatasyncs are on the disk the floors measure
//! (and compete with them for it). The floors are the same as in the embedded run (the bytes
//! of one embedded-log commit), so the two runs' ratios compare. What changes:
//!
//! * `mgmt.commit` / `store` and `store_group` measure an [`EtcdStore::<Cluster>`][EtcdStore]
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
//!
//! This module is the driver (the options, the rows and the floors they are measured
//! against, the run); `store` holds the floors and the store's commits, `cli` the spawned
//! commands and the `volume set` phases through a real kiln-mgmtd, `etcd` the etcd member of
//! `--store etcd`, and `gluster` the GlusterFS comparison.
//!
//! [LogStore]: kiln_mgmt::store::LogStore
//! [`LogStore::stats`]: kiln_mgmt::store::LogStore::stats
//! [EtcdStore]: kiln_mgmt::store::etcd::EtcdStore
//! [`Change::Create`]: kiln_mgmt::volume::Change::Create
//! [`Change::Set`]: kiln_mgmt::volume::Change::Set

use std::time::{Duration, Instant};

use anyhow::Context;
use hdrhistogram::Histogram;
use kiln_mgmt::store::StoreOptions;
use serde_json::json;

use crate::process::Bins;
use crate::report::{Record, Reporter, histogram, micros, nanos};
use crate::scratch::Scratch;

mod cli;
mod etcd;
mod gluster;
mod store;

use cli::cli;
use etcd::start_etcd;
use gluster::gluster;
use store::{StoreSite, commit_bytes, floors, store_rows};

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
    /// A second `kiln` (the static build) timed beside the first: rows `*-static`.
    pub static_kiln: Option<std::path::PathBuf>,
}

/// Which configuration store the commit and set phases run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum MgmtStore {
    /// The daemon's embedded log ([`LogStore`]), in the scratch directory.
    ///
    /// [`LogStore`]: kiln_mgmt::store::LogStore
    #[default]
    Embedded,
    /// One etcd member the run starts, its data in the scratch directory ([`EtcdStore`]).
    ///
    /// [`EtcdStore`]: kiln_mgmt::store::etcd::EtcdStore
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
/// Longest run of one `kiln` command.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

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

/// The p50s of the kiln CLI's set rows, which the `gluster-cli` row is compared with.
#[derive(Debug, Clone, Copy)]
struct KilnSets {
    /// `kiln-cli`: the volume created, not started.
    created_p50_us: f64,
    /// `kiln-cli-started`: each set also pushed to the running brick.
    started_p50_us: f64,
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
    // Missing executables fail the run before it measures anything.
    bins.find("kiln-mgmtd")?;
    if let Some(kiln) = bench.static_kiln.as_ref().filter(|kiln| !kiln.is_file()) {
        anyhow::bail!(
            "--static-kiln {} is not a file: build it with scripts/build-static-kiln",
            kiln.display()
        );
    }
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
        bench.static_kiln.as_deref(),
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
