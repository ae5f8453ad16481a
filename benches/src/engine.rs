//! `kiln-bench engine`: the brick engine called directly (no network), against plain
//! `std::fs` loops with as many threads on the same file system.
//!
//! Phases, each over `files` files spread across `dirs` directories: create (PUT: create +
//! 4 KiB write + close), stat (LOOKUP by name), open/close (OPEN + RELEASE), unlink — at each
//! queue depth (fops in flight), on three targets, each on a fresh brick:
//!
//! * `uring` — the io_uring engine as `kiln-brickd` runs it: one worker per core (`threads`)
//!   and the blocking pool they share (`pool_threads`), driven by tasks on the workers' own
//!   threads as the QUIC server drives it. A worker with nothing else in flight runs a chain
//!   of quick steps as plain system calls (`RingConfig::idle_inline`).
//! * `uring-ring` — the same with `idle_inline` off: every chain goes to the ring.
//! * `blocking` — the blocking engine, its pool as many threads as the io_uring engine has
//!   in all (workers + pool), called from this thread.
//!
//! The reference, `std_loop`, does the same operations as `std::fs` calls (create + write +
//! close, `symlink_metadata`, open + close, `remove_file`) on OS threads, one operation in
//! flight each: at each depth once per thread count the targets need, one thread per fop in
//! flight up to the target's `threads` ([`std_loop::threads_for`]). Each target's ratio is
//! against the std row of its thread count at the same depth, measured just before it.
//!
//! A second reference, `layout_loop`, makes for create and unlink the system calls the
//! GlusterFS layout itself asks for, with nothing of the engine around them: create is an
//! `O_TMPFILE` file, its `trusted.gfid`, the write, the name and the handle
//! (`.glusterfs/XX/YY/<gfid>`) linked from the fd; unlink removes the handle and the name. Its
//! rows (against the std loop, same threads) say how much of a target's distance from the std
//! loop the layout accounts for, and the placement notes put it beside the targets.
//!
//! After each depth an `engine.placement` note per phase puts the targets' ops/s side by side
//! with where each io_uring target's work ran, per file of the phase (its ring counters):
//! chains run inline on an idle worker, chains that went to the ring, calls on the blocking
//! pool, `io_uring_enter` calls. Then an open-latency sweep: p50/p99 of one more open while N
//! files are already held open (the sweep of `kiln-bench openfds`, for std::fs and both
//! engines).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use bytes::Bytes;
use hdrhistogram::Histogram;
use kiln_admin::control::RingStats;
use kiln_dataplane::engine::{Engine, EngineConfig, EngineKind};
use kiln_dataplane::{Brick, ParentAttrs};
use kiln_wire::*;
use serde::Serialize;
use serde_json::json;

use crate::bricks::{Destination, engine_config, fop_threads, start_engine, with_threads};
use crate::openfds;
use crate::progress::Progress;
use crate::report::{Record, Reporter, micros};
use crate::scratch::Scratch;
use crate::std_loop;

/// What to run.
#[derive(Debug, Clone)]
pub struct EngineBench {
    pub files: usize,
    pub dirs: usize,
    pub depths: Vec<usize>,
    pub file_bytes: usize,
    /// Held-open counts for the latency sweep; `0` stands for "as many as the process may hold".
    pub open_sweep: Vec<usize>,
    pub open_samples: usize,
}

const PHASES: [&str; 4] = ["create", "stat", "open_close", "unlink"];

/// An engine as this workload runs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Blocking,
    Uring,
    /// The io_uring engine with `idle_inline` off.
    UringRing,
}

impl Target {
    const ALL: [Target; 3] = [Target::Blocking, Target::Uring, Target::UringRing];

    fn name(self) -> &'static str {
        match self {
            Target::Blocking => "blocking",
            Target::Uring => "uring",
            Target::UringRing => "uring-ring",
        }
    }

    /// The engine, a session holding at most `open_max` files open.
    fn config(self, open_max: usize) -> EngineConfig {
        let mut config = match self {
            Target::Blocking => engine_config(EngineKind::Blocking),
            Target::Uring | Target::UringRing => engine_config(EngineKind::Uring),
        };
        config.ring.idle_inline = self != Target::UringRing;
        config.fops.open_files_per_client_max = open_max;
        config
    }
}

/// Where the io_uring engine ran a phase's work, per file of the phase (from its ring
/// counters; an open_close file is two fops, OPEN and RELEASE).
#[derive(Debug, Clone, Copy, Serialize)]
struct Placement {
    /// Chains of quick steps run as plain system calls by an otherwise idle worker.
    inline_chains: f64,
    /// Chains that went to the ring as linked SQEs.
    ring_chains: f64,
    /// Calls run on the blocking pool.
    pool_calls: f64,
    /// `io_uring_enter` calls.
    enters: f64,
}

impl Placement {
    fn between(before: &RingStats, after: &RingStats, files: usize) -> Placement {
        let per_file = |after: u64, before: u64| (after - before) as f64 / files.max(1) as f64;
        Placement {
            inline_chains: per_file(after.idle_chains, before.idle_chains),
            ring_chains: per_file(after.chains, before.chains),
            pool_calls: per_file(after.pool_jobs, before.pool_jobs),
            enters: per_file(after.enters, before.enters),
        }
    }
}

fn name(i: usize) -> Name {
    Name::new(format!("f{i:07}")).unwrap_or_else(|_| unreachable!("short ascii name"))
}

/// The salt of file GFIDs: the targets' files and the layout loop's share them, and with them
/// how the handles spread over `.glusterfs/XX/YY`.
const FILE_SALT: u8 = 0xf1;

fn gfid(i: usize, salt: u8) -> Gfid {
    let mut b = [0u8; 16];
    b[0] = salt;
    b[1] = (i % 251) as u8;
    b[8..].copy_from_slice(&(i as u64 + 2).to_be_bytes());
    Gfid::from_bytes(b).unwrap_or(Gfid::ROOT)
}

fn root() -> Creds {
    Creds::root()
}

/// A reference made of plain system calls on OS threads (see the module doc).
#[derive(Debug, Clone, Copy)]
enum Reference {
    /// What `std::fs` makes of each phase.
    Std,
    /// The calls the GlusterFS layout asks for on create and unlink.
    Layout,
}

impl Reference {
    fn name(self) -> &'static str {
        match self {
            Reference::Std => "std_loop",
            Reference::Layout => "layout_loop",
        }
    }

    /// Its phases: the layout adds no call to stat or open_close.
    fn phases(self) -> &'static [&'static str] {
        match self {
            Reference::Std => &PHASES,
            Reference::Layout => &["create", "unlink"],
        }
    }

    /// Its name in the rows' `reference` and the placement notes, on `threads` threads.
    fn row(self, threads: usize) -> String {
        format!("{} threads={threads}", self.name())
    }

    /// One phase on `threads` threads over the files under `base`, file `i` in directory
    /// `d{i % dirs}` with the GFID the targets' file `i` has: files per second.
    fn run(
        self,
        base: &std::path::Path,
        phase: &str,
        files: usize,
        dirs: usize,
        threads: usize,
        data: &[u8],
    ) -> anyhow::Result<f64> {
        let dir = |i: usize| base.join(format!("d{}", i % dirs));
        let handle = |i: usize| base.join(Brick::handle_path(&gfid(i, FILE_SALT)));
        if let (Reference::Layout, "create") = (self, phase) {
            for i in 0..files {
                if let Some(parent) = handle(i).parent() {
                    std::fs::create_dir_all(parent)?;
                }
            }
        }
        let (ops, _) = std_loop::run(threads, files, false, |i| {
            let path = dir(i).join(format!("f{i:07}"));
            match self {
                Reference::Std => std_op(phase, &path, data),
                Reference::Layout => layout_op(phase, &gfid(i, FILE_SALT), &path, &handle(i), data),
            }
        })
        .with_context(|| format!("{} {phase}", self.name()))?;
        Ok(ops)
    }
}

/// What `std::fs` makes of `phase` on the file at `path`.
fn std_op(phase: &str, path: &std::path::Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    match phase {
        "create" => std::fs::File::create(path)?.write_all(data),
        "stat" => std::fs::symlink_metadata(path).map(drop),
        "open_close" => std::fs::File::open(path).map(drop),
        _ => std::fs::remove_file(path),
    }
}

/// The layout's calls for `phase` on file `id`, named `path`, with its handle at `handle`:
/// create makes it unnamed in its directory, gives it its GFID and data, then both names.
fn layout_op(
    phase: &str,
    id: &Gfid,
    path: &std::path::Path,
    handle: &std::path::Path,
    data: &[u8],
) -> std::io::Result<()> {
    use rustix::fs::{AtFlags, CWD, XattrFlags};
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    if phase == "unlink" {
        std::fs::remove_file(handle)?;
        return std::fs::remove_file(path);
    }
    let dir = path.parent().unwrap_or(path);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .mode(0o644)
        .custom_flags(libc::O_TMPFILE)
        .open(dir)?;
    rustix::fs::fsetxattr(&file, "trusted.gfid", id.as_bytes(), XattrFlags::CREATE)?;
    file.write_all(data)?;
    rustix::fs::linkat(&file, "", CWD, path, AtFlags::EMPTY_PATH)?;
    rustix::fs::linkat(&file, "", CWD, handle, AtFlags::EMPTY_PATH)?;
    Ok(())
}

/// The files of one target's phases: `count` files spread over the directories `dirs`,
/// file `i` named `f{i:07}` with GFID `ids[i]` and `data` as its content.
#[derive(Debug, Clone)]
struct Files {
    count: usize,
    dirs: Arc<Vec<Gfid>>,
    ids: Arc<Vec<Gfid>>,
    data: Bytes,
}

impl Files {
    /// The fop of `phase` on file `i`.
    fn fop(&self, phase: &str, i: usize) -> FopRequest {
        let parent = self.dirs[i % self.dirs.len()];
        match phase {
            "create" => Put {
                parent,
                name: name(i),
                gfid: self.ids[i],
                mode: Mode::new(0o644).unwrap_or_else(|| unreachable!()),
                umask: Mode::new(0).unwrap_or_else(|| unreachable!()),
                flags: OpenFlags::empty(),
                data: Payload::new(self.data.clone()).unwrap_or_else(|_| unreachable!("4 KiB")),
                attr: SetAttr::default(),
            }
            .into(),
            "stat" => Lookup {
                parent,
                name: name(i),
            }
            .into(),
            "open_close" => Open {
                gfid: self.ids[i],
                access: AccessMode::ReadOnly,
                flags: OpenFlags::empty(),
            }
            .into(),
            _ => Unlink {
                parent,
                name: name(i),
            }
            .into(),
        }
    }
}

/// One phase on `engine` at depth `depth`: on the io_uring engine from its workers' own
/// threads, on the blocking engine from this thread. Returns files per second.
fn engine_phase(
    rt: &tokio::runtime::Runtime,
    engine: &Engine,
    phase: &'static str,
    depth: usize,
    files: &Files,
) -> anyhow::Result<f64> {
    let start = Instant::now();
    match engine.kind() {
        EngineKind::Uring => rt.block_on(uring_phase(engine, phase, depth, files))?,
        EngineKind::Blocking => {
            let local = tokio::task::LocalSet::new();
            local.block_on(rt, session_phase(engine, phase, depth, files))?;
        }
    }
    Ok(files.count as f64 / start.elapsed().as_secs_f64())
}

/// Runs one phase on the io_uring engine the way the server does: `depth` tasks spread over
/// the ring workers, running on the workers' own threads (no channel, no thread switch per
/// fop), each with its own session and one fop in flight.
async fn uring_phase(
    engine: &Engine,
    phase: &'static str,
    depth: usize,
    files: &Files,
) -> anyhow::Result<()> {
    let workers = engine.workers();
    let mut finished = Vec::new();
    for w in 0..workers {
        let tasks: Vec<usize> = (0..depth).filter(|k| k % workers == w).collect();
        let files = files.clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<anyhow::Result<()>>();
        engine
            .run_on_worker(w, move |local| {
                let local = local.clone();
                tokio::task::spawn_local(async move {
                    let mut set = tokio::task::JoinSet::new();
                    for k in tasks {
                        let session = local.open_session(ParentAttrs::Omit);
                        let (local, files) = (local.clone(), files.clone());
                        set.spawn_local(async move {
                            for i in (k..files.count).step_by(depth) {
                                match local.call(session, &root(), files.fop(phase, i)).await {
                                    Ok(FopReply::Open(o)) => {
                                        local
                                            .call(session, &root(), Release { fd: o.fd }.into())
                                            .await
                                            .map_err(|e| anyhow::anyhow!("release: {e}"))?;
                                    }
                                    Ok(_) => {}
                                    Err(e) => anyhow::bail!("{phase} of file {i}: {e}"),
                                }
                            }
                            local.end_session(session).await;
                            Ok(())
                        });
                    }
                    let mut result = Ok(());
                    while let Some(done) = set.join_next().await {
                        if let Err(e) = done.map_err(anyhow::Error::from).and_then(|r| r) {
                            result = Err(e);
                        }
                    }
                    let _ = tx.send(result);
                });
            })
            .await
            .map_err(|e| anyhow::anyhow!("run on worker: {e}"))?;
        finished.push(rx);
    }
    for rx in finished {
        rx.await??;
    }
    Ok(())
}

/// Runs one phase at queue depth `depth` from this thread: `depth` tasks, each with its own
/// engine session, each keeping one fop in flight.
async fn session_phase(
    engine: &Engine,
    phase: &'static str,
    depth: usize,
    files: &Files,
) -> anyhow::Result<()> {
    let mut tasks = tokio::task::JoinSet::new();
    for k in 0..depth {
        let session = engine.session_with(ParentAttrs::Omit);
        let files = files.clone();
        tasks.spawn_local(async move {
            for i in (k..files.count).step_by(depth) {
                match session.call(root(), files.fop(phase, i)).await {
                    Ok(FopReply::Open(o)) => {
                        session
                            .call(root(), Release { fd: o.fd }.into())
                            .await
                            .map_err(|e| anyhow::anyhow!("release: {e}"))?;
                    }
                    Ok(_) => {}
                    Err(e) => anyhow::bail!("{phase} of file {i}: {e}"),
                }
            }
            Ok(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    Ok(())
}

/// Runs the whole benchmark, printing records as they are measured.
pub fn run(
    bench: &EngineBench,
    scratch: &Scratch,
    out: &mut Reporter,
) -> anyhow::Result<Vec<Record>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let data = Bytes::from(vec![0x5a; bench.file_bytes]);
    let mut records = Vec::new();
    for &depth in &bench.depths {
        records.extend(depth_rows(bench, scratch, &rt, depth.max(1), &data, out)?);
    }
    records.extend(open_sweep(bench, scratch, out, &rt)?);
    Ok(records)
}

/// The std rows and every target's rows at one depth, then the placement notes.
fn depth_rows(
    bench: &EngineBench,
    scratch: &Scratch,
    rt: &tokio::runtime::Runtime,
    depth: usize,
    data: &Bytes,
    out: &mut Reporter,
) -> anyhow::Result<Vec<Record>> {
    let targets = Target::ALL.map(|t| (t, t.config(bench.files + 16)));
    let std_threads: BTreeSet<usize> = targets
        .iter()
        .map(|(_, config)| std_loop::threads_for(depth, fop_threads(config)))
        .collect();
    let mut records = Vec::new();
    let mut table = PlacementTable::new(depth);
    for &threads in &std_threads {
        for reference in [Reference::Std, Reference::Layout] {
            let base = scratch
                .path()
                .join(format!("{}-q{depth}-t{threads}", reference.name()));
            for d in 0..bench.dirs {
                std::fs::create_dir_all(base.join(format!("d{d}")))?;
            }
            for &phase in reference.phases() {
                let ops = reference.run(&base, phase, bench.files, bench.dirs, threads, data)?;
                // The std loop of this thread count is every reference's reference, its own
                // row's too.
                table.insert(phase, reference.row(threads), ops, None);
                let std = std_reference(threads);
                let mut r = Record::new(
                    &format!("engine.{phase}"),
                    reference.name(),
                    json!({ "files": bench.files, "dirs": bench.dirs, "depth": depth,
                            "threads": threads }),
                    &std,
                );
                r.ops_per_s = Some(ops);
                r.ratio = Some(ops / table.ops(phase, &std)?);
                out.print(&r);
                records.push(r);
            }
        }
    }
    for (target, config) in targets {
        let threads = std_loop::threads_for(depth, fop_threads(&config));
        let path = scratch.path().join(format!("{}-q{depth}", target.name()));
        let (_brick, engine) = start_engine(&path, &config)?;
        let files = Files {
            count: bench.files,
            dirs: Arc::new(make_dirs(rt, &engine, bench.dirs)?),
            ids: Arc::new((0..bench.files).map(|i| gfid(i, FILE_SALT)).collect()),
            data: data.clone(),
        };
        for phase in PHASES {
            let before = rt.block_on(engine.ring_stats());
            let ops = engine_phase(rt, &engine, phase, depth, &files)?;
            let after = rt.block_on(engine.ring_stats());
            let placement = (engine.kind() == EngineKind::Uring)
                .then(|| Placement::between(&before, &after, bench.files));
            let reference = std_reference(threads);
            let params = json!({ "files": bench.files, "dirs": bench.dirs, "depth": depth });
            let mut r = Record::new(
                &format!("engine.{phase}"),
                target.name(),
                with_threads(params, &config),
                &reference,
            );
            r.ops_per_s = Some(ops);
            r.enters_per_op = placement.map(|p| p.enters);
            r.ratio = Some(ops / table.ops(phase, &reference)?);
            out.print(&r);
            records.push(r);
            table.insert(phase, target.name().to_owned(), ops, placement);
        }
    }
    table.print(out);
    Ok(records)
}

/// The name of the std loop reference on `threads` threads.
fn std_reference(threads: usize) -> String {
    Reference::Std.row(threads)
}

/// Makes the `dirs` directories the phases spread their files over; returns their GFIDs.
fn make_dirs(
    rt: &tokio::runtime::Runtime,
    engine: &Engine,
    dirs: usize,
) -> anyhow::Result<Vec<Gfid>> {
    let gfids: Vec<Gfid> = (0..dirs).map(|d| gfid(d, 0xd1)).collect();
    let session = engine.session_with(ParentAttrs::Omit);
    for (d, g) in gfids.iter().enumerate() {
        let mkdir = Mkdir {
            parent: Gfid::ROOT,
            name: Name::new(format!("d{d}"))?,
            gfid: *g,
            mode: Mode::new(0o755).context("mode")?,
            umask: Mode::new(0).context("mode")?,
        };
        rt.block_on(session.call(root(), mkdir.into()))
            .map_err(|e| anyhow::anyhow!("mkdir: {e}"))?;
    }
    Ok(gfids)
}

/// One depth's results side by side, per phase: each target's and std row's ops/s, and
/// where the io_uring targets' work ran.
struct PlacementTable {
    depth: usize,
    /// (phase, target or std reference, ops/s, placement), in the order measured.
    rows: Vec<(&'static str, String, f64, Option<Placement>)>,
}

impl PlacementTable {
    fn new(depth: usize) -> PlacementTable {
        PlacementTable {
            depth,
            rows: Vec::new(),
        }
    }

    fn insert(
        &mut self,
        phase: &'static str,
        target: String,
        ops: f64,
        placement: Option<Placement>,
    ) {
        self.rows.push((phase, target, ops, placement));
    }

    /// The ops/s measured for `target` in `phase`.
    fn ops(&self, phase: &str, target: &str) -> anyhow::Result<f64> {
        self.rows
            .iter()
            .find(|(p, t, _, _)| *p == phase && t == target)
            .map(|row| row.2)
            .with_context(|| format!("no {target} result for {phase} at depth {}", self.depth))
    }

    /// One `engine.placement` note per phase.
    fn print(&self, out: &mut Reporter) {
        for phase in PHASES {
            let mut ops = serde_json::Map::new();
            let mut per_file = serde_json::Map::new();
            for (_, target, rate, placement) in self.rows.iter().filter(|r| r.0 == phase) {
                ops.insert(target.clone(), json!(rate.round()));
                if let Some(p) = placement {
                    per_file.insert(target.clone(), json!(p));
                }
            }
            out.note(
                "engine.placement",
                &json!({ "op": phase, "depth": self.depth, "ops_per_s": ops,
                         "per_file": per_file }),
            );
        }
    }
}

/// p50/p99 of one more open (its release untimed) while `held` files stay open, through
/// the shared sweep of `kiln-bench openfds`.
fn open_sweep(
    bench: &EngineBench,
    scratch: &Scratch,
    out: &mut Reporter,
    rt: &tokio::runtime::Runtime,
) -> anyhow::Result<Vec<Record>> {
    let max = openfds::held_max();
    // 0 (and anything above the limit) stands for "as many as the process may hold".
    let asked: Vec<usize> = bench
        .open_sweep
        .iter()
        .map(|&n| if n == 0 || n > max { max } else { n })
        .collect();
    let counts = openfds::counts(&asked, max);
    let files = counts.last().copied().unwrap_or(0) + 1;
    let mut records = Vec::new();
    let mut base_p50: std::collections::HashMap<&str, f64> = std::collections::HashMap::new();
    let quiet = Progress::hidden();

    let dir = scratch.path().join("std-open");
    openfds::make_local_files(&dir, files, &quiet)?;
    let std_results = openfds::local_sweep(&dir, &counts, bench.open_samples, &quiet)?;
    for (&held, point) in counts.iter().zip(&std_results) {
        records.push(sweep_record(
            "std_loop",
            held,
            &point.latency,
            &mut base_p50,
            out,
        ));
    }

    for kind in [EngineKind::Blocking, EngineKind::Uring] {
        let path = scratch.path().join(format!("{}-open", kind.name()));
        let mut config = engine_config(kind);
        config.fops.open_files_per_client_max = files + 16;
        let (_brick, engine) = start_engine(&path, &config)?;
        let destination = Destination::Engine(&engine);
        let gfids = openfds::make_brick_files(rt, destination, files, &quiet)?;
        let results =
            openfds::brick_sweep(rt, destination, gfids, &counts, bench.open_samples, &quiet)?;
        for (&held, point) in counts.iter().zip(&results) {
            let target = kind.name();
            records.push(sweep_record(
                target,
                held,
                &point.latency,
                &mut base_p50,
                out,
            ));
        }
    }
    Ok(records)
}

fn sweep_record(
    target: &'static str,
    held: usize,
    h: &Histogram<u64>,
    base: &mut std::collections::HashMap<&'static str, f64>,
    out: &mut Reporter,
) -> Record {
    let p50 = micros(h, 0.5);
    let first = *base.entry(target).or_insert(p50);
    // Against the same target with the fewest files held: 1.0 means flat.
    let mut r = Record::new(
        "engine.open_latency",
        target,
        json!({ "held_open": held }),
        &format!("{target} at the smallest held_open"),
    );
    r.set_latency(h);
    r.ratio = Some(first / p50);
    out.print(&r);
    r
}
