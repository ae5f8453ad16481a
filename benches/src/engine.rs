//! `kiln-bench engine`: the brick engine called directly (no network), against a plain
//! single-thread `std::fs` loop on the same file system.
//!
//! Phases, each over `files` files spread across `dirs` directories: create (PUT: create +
//! 4 KiB write + close), stat (LOOKUP by name), open/close (OPEN + RELEASE), unlink — at each
//! queue depth (fops in flight), for the io_uring engine and the blocking engine. Then an
//! open-latency sweep: p50/p99 of one more open while N files are already held open (the
//! sweep of `kiln-bench openfds`, for std::fs and both engines).

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use bytes::Bytes;
use hdrhistogram::Histogram;
use kiln_dataplane::engine::{Engine, EngineKind};
use kiln_wire::*;
use serde_json::json;

use crate::bricks::{Destination, start_engine};
use crate::openfds;
use crate::progress::Progress;
use crate::report::{Record, Reporter, micros};
use crate::scratch::Scratch;

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

fn name(i: usize) -> Name {
    Name::new(format!("f{i:07}")).unwrap_or_else(|_| unreachable!("short ascii name"))
}

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

/// The std loop: one thread, plain syscalls, the same files.
fn std_phase(
    base: &std::path::Path,
    phase: &str,
    files: usize,
    dirs: usize,
    data: &[u8],
) -> anyhow::Result<f64> {
    use std::io::Write as _;
    let path = |i: usize| base.join(format!("d{}", i % dirs)).join(format!("f{i:07}"));
    let start = Instant::now();
    for i in 0..files {
        match phase {
            "create" => std::fs::File::create(path(i))?.write_all(data)?,
            "stat" => {
                std::fs::symlink_metadata(path(i))?;
            }
            "open_close" => drop(std::fs::File::open(path(i))?),
            _ => std::fs::remove_file(path(i))?,
        }
    }
    Ok(files as f64 / start.elapsed().as_secs_f64())
}

fn fop_for(phase: &str, i: usize, dirs: &[Gfid], data: &Bytes, ids: &[Gfid]) -> FopRequest {
    let parent = dirs[i % dirs.len()];
    match phase {
        "create" => Put {
            parent,
            name: name(i),
            gfid: ids[i],
            mode: Mode::new(0o644).unwrap_or_else(|| unreachable!()),
            umask: Mode::new(0).unwrap_or_else(|| unreachable!()),
            flags: OpenFlags::empty(),
            data: Payload::new(data.clone()).unwrap_or_else(|_| unreachable!("4 KiB")),
            attr: SetAttr::default(),
        }
        .into(),
        "stat" => Lookup {
            parent,
            name: name(i),
        }
        .into(),
        "open_close" => Open {
            gfid: ids[i],
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

/// Runs one phase on the io_uring engine the way the server will: `depth` tasks spread over
/// the ring workers, running on the workers' own threads (no channel, no thread switch per
/// fop), each with its own session and one fop in flight.
async fn uring_phase(
    engine: &Engine,
    phase: &str,
    files: usize,
    depth: usize,
    dirs: &Arc<Vec<Gfid>>,
    ids: &Arc<Vec<Gfid>>,
    data: &Bytes,
) -> anyhow::Result<f64> {
    let workers = engine.workers();
    let start = Instant::now();
    let mut finished = Vec::new();
    for w in 0..workers {
        let tasks: Vec<usize> = (0..depth).filter(|k| k % workers == w).collect();
        let (dirs, ids, data, phase) = (dirs.clone(), ids.clone(), data.clone(), phase.to_owned());
        let (tx, rx) = tokio::sync::oneshot::channel::<anyhow::Result<()>>();
        engine
            .run_on_worker(w, move |local| {
                let local = local.clone();
                tokio::task::spawn_local(async move {
                    let mut set = tokio::task::JoinSet::new();
                    for k in tasks {
                        let session = local.open_session();
                        let (local, dirs, ids, data, phase) = (
                            local.clone(),
                            dirs.clone(),
                            ids.clone(),
                            data.clone(),
                            phase.clone(),
                        );
                        set.spawn_local(async move {
                            for i in (k..files).step_by(depth) {
                                match local
                                    .call(session, &root(), fop_for(&phase, i, &dirs, &data, &ids))
                                    .await
                                {
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
    Ok(files as f64 / start.elapsed().as_secs_f64())
}

/// Runs one phase at queue depth `depth` from this thread: `depth` tasks, each with its own
/// session, each keeping one fop in flight.
async fn engine_phase(
    engine: &Engine,
    phase: &str,
    files: usize,
    depth: usize,
    dirs: &Arc<Vec<Gfid>>,
    ids: &Arc<Vec<Gfid>>,
    data: &Bytes,
) -> anyhow::Result<f64> {
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for k in 0..depth {
        let session = engine.session();
        let (dirs, ids, data, phase) = (dirs.clone(), ids.clone(), data.clone(), phase.to_owned());
        tasks.spawn_local(async move {
            for i in (k..files).step_by(depth) {
                let reply = session
                    .call(root(), fop_for(&phase, i, &dirs, &data, &ids))
                    .await;
                match (reply, phase.as_str()) {
                    (Ok(FopReply::Open(o)), _) => {
                        session
                            .call(root(), Release { fd: o.fd }.into())
                            .await
                            .map_err(|e| anyhow::anyhow!("release: {e}"))?;
                    }
                    (Ok(_), _) => {}
                    (Err(e), p) => anyhow::bail!("{p} of file {i}: {e}"),
                }
            }
            Ok(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    Ok(files as f64 / start.elapsed().as_secs_f64())
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
    let local = tokio::task::LocalSet::new();
    let data = Bytes::from(vec![0x5a; bench.file_bytes]);
    let mut records = Vec::new();

    // The reference: a single-thread std::fs loop on the same file system.
    let std_dir = scratch.path().join("std");
    for d in 0..bench.dirs {
        std::fs::create_dir_all(std_dir.join(format!("d{d}")))?;
    }
    let mut reference = std::collections::HashMap::new();
    for phase in PHASES {
        let ops = std_phase(&std_dir, phase, bench.files, bench.dirs, &data)?;
        reference.insert(phase, ops);
        let mut r = Record::new(
            &format!("engine.{phase}"),
            "std_loop",
            json!({ "files": bench.files, "dirs": bench.dirs, "depth": 1 }),
            "std_loop",
        );
        r.ops_per_s = Some(ops);
        // The reference's own row.
        r.ratio = Some(1.0);
        out.print(&r);
        records.push(r);
    }

    for &depth in &bench.depths {
        for kind in [EngineKind::Blocking, EngineKind::Uring] {
            let path = scratch.path().join(format!("{}-q{depth}", kind.name()));
            let (_brick, engine) = start_engine(&path, kind, depth, bench.files + 16)?;
            let dirs: Vec<Gfid> = (0..bench.dirs).map(|d| gfid(d, 0xd1)).collect();
            let ids: Arc<Vec<Gfid>> = Arc::new((0..bench.files).map(|i| gfid(i, 0xf1)).collect());
            let session = engine.session();
            for (d, g) in dirs.iter().enumerate() {
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
            let dirs = Arc::new(dirs);
            for phase in PHASES {
                let before = rt.block_on(engine.ring_stats());
                let ops = match kind {
                    EngineKind::Uring => rt.block_on(uring_phase(
                        &engine,
                        phase,
                        bench.files,
                        depth,
                        &dirs,
                        &ids,
                        &data,
                    ))?,
                    EngineKind::Blocking => local.block_on(
                        &rt,
                        engine_phase(&engine, phase, bench.files, depth, &dirs, &ids, &data),
                    )?,
                };
                let after = rt.block_on(engine.ring_stats());
                let enters = (kind == EngineKind::Uring)
                    .then(|| (after.enters - before.enters) as f64 / bench.files as f64);
                let mut r = Record::new(
                    &format!("engine.{phase}"),
                    kind.name(),
                    json!({ "files": bench.files, "dirs": bench.dirs, "depth": depth }),
                    "std_loop",
                );
                r.ops_per_s = Some(ops);
                r.enters_per_op = enters;
                r.ratio = Some(ops / reference[phase]);
                out.print(&r);
                records.push(r);
            }
        }
    }
    records.extend(open_sweep(bench, scratch, out, &rt)?);
    Ok(records)
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
        let (_brick, engine) = start_engine(&path, kind, 2, files + 16)?;
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
