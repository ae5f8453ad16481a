//! `kiln-bench openfds`: the latency of one more open while N files are already held open,
//! N swept up to as many as the process may hold. GlusterFS's fd table was O(n) and open
//! latency grew with open files; Kiln's fd tables are slabs, so this curve should be flat.
//!
//! First the soft `RLIMIT_NOFILE` is raised to the hard limit; the largest N is that limit
//! less [`FD_HEADROOM`] (the brick's own descriptors: 256 handle directories, cached parent
//! directories, rings, sockets), or `--max-held` when lower. `--held` values above it are
//! dropped and the largest N is always measured. Counts go up in one pass: each target
//! opens more files until N are held, then times `--samples` opens of one more file, each
//! followed by a close that is not timed.
//!
//! Targets (`--targets`; the reference is `local`):
//!
//! * `local` — `File::open` of a plain file in the scratch directory while N `File`s of the
//!   same directory stay open (the kernel's fd table).
//! * `engine` — OPEN (and RELEASE) by GFID through the io_uring engine, called on one of its
//!   ring workers, while the same session holds N files open.
//! * `volume` — the same through a [`kiln_client::BrickClient`] over QUIC with mutual TLS to a
//!   brick served in this process; the N files are held by the client's one connection.
//!
//! Every file is empty, made before the sweep (PUT on the bricks) and removed after it.
//! Results per N:
//! p50/p90/p99/p99.9 of the open, `ops_per_s` = opens (with their closes) per second, and
//! `ratio` = local's p50 ÷ this p50 at the same N. An `openfds_flatness` note gives each
//! target's p50 and p99 at the largest N over those at the smallest (1.0 is flat).
//! `--plot` draws p50 and p99 against N for every target.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use bytes::Bytes;
use hdrhistogram::Histogram;
use kiln_dataplane::engine::{EngineConfig, EngineKind};
use kiln_wire::quic::UDP_PAYLOAD_MAX_BYTES;
use kiln_wire::*;
use serde_json::json;

use crate::bricks::{
    Caller, Destination, Served, engine_config, run_tasks, seeded_gfid, start_engine,
};
use crate::plot::{self, LineChart, Panel, Series};
use crate::progress::Progress;
use crate::report::{Record, Reporter, histogram, micros, nanos};
use crate::scratch::Scratch;

/// What to run.
#[derive(Debug, Clone)]
pub struct OpenfdsBench {
    /// Files held open at each point (sorted and capped at the largest allowed).
    pub held: Vec<usize>,
    /// A lower bound than the process limit on the largest count, if given.
    pub max_held: Option<usize>,
    pub samples: usize,
    pub targets: Vec<OpenTarget>,
    /// Plot files to draw (.svg or .png each).
    pub plots: Vec<PathBuf>,
}

/// Where files are held and opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum OpenTarget {
    Local,
    Engine,
    Volume,
}

impl OpenTarget {
    pub fn name(self) -> &'static str {
        match self {
            OpenTarget::Local => "local",
            OpenTarget::Engine => "engine",
            OpenTarget::Volume => "volume",
        }
    }
}

/// The default counts (the limit is added).
pub const DEFAULT_HELD: [usize; 7] = [0, 10, 100, 1000, 10_000, 100_000, 1_000_000];
/// Descriptors the brick and the benchmark need besides the held files.
pub const FD_HEADROOM: usize = 700;
/// Tasks making the files on a brick.
const PUT_TASKS: usize = 16;
/// The GFIDs of the files (no random choice is made: a fixed seed).
const GFID_SEED: u64 = 0x6f70_656e;

/// One held-open count's result.
#[derive(Debug)]
pub struct SweepPoint {
    /// The open of one more file, in nanoseconds.
    pub latency: Histogram<u64>,
    /// Opens (with their closes) per second during the samples.
    pub opens_per_s: f64,
}

impl SweepPoint {
    /// The point of `samples` opens timed into `latency`, the first started at `start`.
    fn timed(latency: Histogram<u64>, samples: usize, start: Instant) -> SweepPoint {
        SweepPoint {
            latency,
            opens_per_s: samples as f64 / start.elapsed().as_secs_f64().max(1e-9),
        }
    }
}

/// Raises the soft open-file limit to the hard one; returns (soft before, the limit now).
pub fn raise_nofile_limit() -> anyhow::Result<(u64, u64)> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let soft = limit.current.unwrap_or(1024);
    let Some(hard) = limit.maximum else {
        return Ok((soft, soft));
    };
    if hard > soft {
        setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(hard),
                maximum: Some(hard),
            },
        )
        .context("raising RLIMIT_NOFILE to its hard limit")?;
    }
    Ok((soft, hard.max(soft)))
}

/// The most files this process may hold open beside the brick: the soft limit less the
/// headroom.
pub fn held_max() -> usize {
    let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(1024);
    usize::try_from(soft)
        .unwrap_or(usize::MAX)
        .saturating_sub(FD_HEADROOM)
        .max(10)
}

/// The counts of `held` up to `max` (larger ones dropped), sorted, without repeats.
pub fn counts(held: &[usize], max: usize) -> Vec<usize> {
    let mut counts: Vec<usize> = held.iter().copied().filter(|&n| n <= max).collect();
    counts.sort_unstable();
    counts.dedup();
    counts
}

/// Makes `files` empty plain files `f0`… in `dir`.
pub fn make_local_files(dir: &Path, files: usize, progress: &Progress) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    for i in 0..files {
        std::fs::File::create(dir.join(format!("f{i}")))?;
        progress.inc(1);
    }
    Ok(())
}

/// Plain files: for each count (ascending), holds that many of `dir`'s files open and times
/// `samples` opens of one more (file `f{last}`, closed after each, untimed). Returns one
/// histogram per count, and the opens (with their closes) per second.
pub fn local_sweep(
    dir: &Path,
    counts: &[usize],
    samples: usize,
    progress: &Progress,
) -> anyhow::Result<Vec<SweepPoint>> {
    let last = counts.last().copied().unwrap_or(0);
    let extra = dir.join(format!("f{last}"));
    let mut held: Vec<std::fs::File> = Vec::with_capacity(last);
    let mut results = Vec::with_capacity(counts.len());
    for &n in counts {
        while held.len() < n {
            let path = dir.join(format!("f{}", held.len()));
            held.push(
                std::fs::File::open(&path)
                    .with_context(|| format!("holding {} files open", held.len() + 1))?,
            );
            progress.inc(1);
        }
        let mut h = histogram()?;
        let start = Instant::now();
        for _ in 0..samples {
            let t = Instant::now();
            let file = std::fs::File::open(&extra)?;
            h.record(nanos(t.elapsed()))?;
            drop(file);
        }
        progress.inc(samples as u64);
        results.push(SweepPoint::timed(h, samples, start));
    }
    Ok(results)
}

/// Makes `files` empty files `f{i}` in the brick root with GFIDs from a fixed seed, from
/// [`PUT_TASKS`] tasks at once; returns their GFIDs in order.
pub fn make_brick_files(
    rt: &tokio::runtime::Runtime,
    destination: Destination<'_>,
    files: usize,
    progress: &Progress,
) -> anyhow::Result<Arc<Vec<Gfid>>> {
    let gfids: Arc<Vec<Gfid>> = Arc::new(
        (0..files)
            .map(|i| seeded_gfid(GFID_SEED, i as u64))
            .collect(),
    );
    let tasks = PUT_TASKS.min(files).max(1);
    let (ids, progress_tasks) = (gfids.clone(), progress.clone());
    run_tasks(rt, destination, tasks, move |k, caller| {
        let (ids, progress) = (ids.clone(), progress_tasks.clone());
        async move {
            for i in (k..ids.len()).step_by(tasks) {
                let put = Put {
                    parent: Gfid::ROOT,
                    name: Name::new(format!("f{i:07}"))?,
                    gfid: ids[i],
                    mode: Mode::new(0o644).context("mode")?,
                    umask: Mode::new(0).context("mode")?,
                    flags: OpenFlags::empty(),
                    data: Payload::new(Bytes::new())?,
                    attr: SetAttr::default(),
                };
                caller
                    .call(put)
                    .await
                    .with_context(|| format!("file {i}"))?;
                progress.inc(1);
            }
            Ok(())
        }
    })?;
    Ok(gfids)
}

/// A brick: the sweep of [`local_sweep`] by OPEN/RELEASE of `gfids` in one session (one
/// task on a ring worker, or one client connection). The last GFID is the one more file.
pub fn brick_sweep(
    rt: &tokio::runtime::Runtime,
    destination: Destination<'_>,
    gfids: Arc<Vec<Gfid>>,
    counts: &[usize],
    samples: usize,
    progress: &Progress,
) -> anyhow::Result<Vec<SweepPoint>> {
    let (counts, progress) = (counts.to_vec(), progress.clone());
    let mut results = run_tasks(rt, destination, 1, move |_, caller| {
        let (gfids, counts, progress) = (gfids.clone(), counts.clone(), progress.clone());
        async move { sweep_task(&caller, &gfids, &counts, samples, &progress).await }
    })?;
    results.pop().context("the sweep task returned nothing")
}

async fn open(caller: &Caller, gfid: Gfid) -> anyhow::Result<FdId> {
    let open = Open {
        gfid,
        access: AccessMode::ReadOnly,
        flags: OpenFlags::empty(),
    };
    match caller.call(open).await? {
        FopReply::Open(o) => Ok(o.fd),
        other => bail!("OPEN answered {:?}", other.code()),
    }
}

async fn sweep_task(
    caller: &Caller,
    gfids: &[Gfid],
    counts: &[usize],
    samples: usize,
    progress: &Progress,
) -> anyhow::Result<Vec<SweepPoint>> {
    let extra = *gfids.last().context("no files")?;
    let mut held = 0;
    let mut results = Vec::with_capacity(counts.len());
    for &n in counts {
        while held < n {
            let gfid = *gfids.get(held).context("fewer files than counts")?;
            // Held until the session ends (the task's, or the connection's).
            open(caller, gfid)
                .await
                .with_context(|| format!("holding {} files open", held + 1))?;
            held += 1;
            progress.inc(1);
        }
        let mut h = histogram()?;
        let start = Instant::now();
        for _ in 0..samples {
            let t = Instant::now();
            let fd = open(caller, extra).await?;
            h.record(nanos(t.elapsed()))?;
            caller.call(Release { fd }).await?;
        }
        progress.inc(samples as u64);
        results.push(SweepPoint::timed(h, samples, start));
    }
    Ok(results)
}

/// Runs the whole benchmark, printing records as they are measured.
pub fn run(
    bench: &OpenfdsBench,
    scratch: &Scratch,
    out: &mut Reporter,
) -> anyhow::Result<Vec<Record>> {
    for path in &bench.plots {
        plot::check_path(path)?;
    }
    let mut targets = bench.targets.clone();
    targets.sort_unstable();
    targets.dedup();
    if targets.is_empty() {
        bail!("--targets must name at least one target");
    }
    let (soft_before, limit) = raise_nofile_limit()?;
    let max = bench.max_held.map_or(held_max(), |m| m.min(held_max()));
    // The largest count the limit allows is always measured.
    let counts = counts(&[&bench.held[..], &[max]].concat(), max);
    let samples = bench.samples.max(1);
    out.note(
        "openfds",
        &json!({
            "rlimit_nofile": { "soft_before": soft_before, "now": limit },
            "headroom": FD_HEADROOM, "max_held": max, "held": counts, "samples": samples,
            "targets": targets.iter().map(|t| t.name()).collect::<Vec<_>>(),
            "timed": "the open of one more file; its close follows, untimed",
            "ratio": "local p50 / this p50 at the same held count",
        }),
    );
    let per_target = (2 * (max + 1) + samples * counts.len()) as u64;
    let progress = Progress::new("openfds", per_target * targets.len() as u64);
    let root = scratch.path().join("openfds");
    std::fs::create_dir_all(&root)?;
    let sweep = Sweep::new(scratch, max, &counts, samples, &progress)?;
    let mut measured: Vec<(OpenTarget, Vec<SweepPoint>)> = Vec::new();
    let mut records = Vec::new();
    for &target in &targets {
        let dir = root.join(target.name());
        let results = sweep.target(target, &dir)?;
        // Each target's files go once it is measured: at the limit, three targets' files and
        // the bricks' handle directories together overflow a small loop file system's inodes.
        progress.set_message(format!("{}: removing its files", target.name()));
        std::fs::remove_dir_all(&dir)
            .with_context(|| format!("cannot remove {}", dir.display()))?;
        let reference = measured
            .iter()
            .find(|(t, _)| *t == OpenTarget::Local)
            .map(|(_, r)| &r[..]);
        records.extend(sweep.records(target, &results, reference, out));
        measured.push((target, results));
    }
    progress.finish();
    note_flatness(out, &counts, &measured);
    for path in &bench.plots {
        draw(path, &counts, &measured, samples)?;
        out.note("plot", &json!(path.display().to_string()));
    }
    Ok(records)
}

/// What every target's sweep shares.
struct Sweep<'a> {
    rt: tokio::runtime::Runtime,
    scratch: &'a Scratch,
    /// Files made per target: one more than the largest count, the one opened while the
    /// others are held.
    files: usize,
    counts: &'a [usize],
    samples: usize,
    engine_config: EngineConfig,
    progress: &'a Progress,
}

impl<'a> Sweep<'a> {
    fn new(
        scratch: &'a Scratch,
        max: usize,
        counts: &'a [usize],
        samples: usize,
        progress: &'a Progress,
    ) -> anyhow::Result<Sweep<'a>> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let files = max + 1;
        let mut engine_config = engine_config(EngineKind::Uring);
        engine_config.fops.open_files_per_client_max = files + 16;
        Ok(Sweep {
            rt,
            scratch,
            files,
            counts,
            samples,
            engine_config,
            progress,
        })
    }

    /// Makes the target's files in `dir` and sweeps the held counts over them.
    fn target(&self, target: OpenTarget, dir: &Path) -> anyhow::Result<Vec<SweepPoint>> {
        let (rt, files, progress) = (&self.rt, self.files, self.progress);
        let (counts, samples) = (self.counts, self.samples);
        progress.set_message(format!("{}: making {files} files", target.name()));
        Ok(match target {
            OpenTarget::Local => {
                make_local_files(dir, files, progress)?;
                progress.set_message("local: sweeping");
                local_sweep(dir, counts, samples, progress)?
            }
            OpenTarget::Engine => {
                let (_brick, engine) = start_engine(dir, &self.engine_config)?;
                let gfids = make_brick_files(rt, Destination::Engine(&engine), files, progress)?;
                progress.set_message("engine: sweeping");
                brick_sweep(
                    rt,
                    Destination::Engine(&engine),
                    gfids,
                    counts,
                    samples,
                    progress,
                )?
            }
            OpenTarget::Volume => {
                let served = Served::start(dir, &self.scratch.path(), &self.engine_config, 0)?;
                let (server, volume) =
                    rt.block_on(served.serve_and_connect(UDP_PAYLOAD_MAX_BYTES))?;
                let destination = Destination::Volume(&volume);
                let gfids = make_brick_files(rt, destination, files, progress)?;
                progress.set_message("volume: sweeping");
                let results = brick_sweep(rt, destination, gfids, counts, samples, progress);
                rt.block_on(async {
                    volume.close().await;
                    server.shutdown(std::time::Duration::from_secs(5)).await;
                });
                results?
            }
        })
    }

    /// Prints and returns a record per held count of a target's sweep, its ratio to the
    /// local sweep's (`reference`) p50.
    fn records(
        &self,
        target: OpenTarget,
        results: &[SweepPoint],
        reference: Option<&[SweepPoint]>,
        out: &mut Reporter,
    ) -> Vec<Record> {
        let mut records = Vec::new();
        for (i, point) in results.iter().enumerate() {
            let reference_name = match reference {
                Some(_) => "local",
                None => target.name(),
            };
            let mut r = Record::new(
                "openfds",
                target.name(),
                json!({ "held_open": self.counts[i], "samples": self.samples }),
                reference_name,
            );
            r.ops_per_s = Some(point.opens_per_s);
            r.set_latency(&point.latency);
            // Without a local sweep (yet) the target is its own reference.
            r.ratio = Some(reference.map_or(1.0, |reference| {
                micros(&reference[i].latency, 0.5) / micros(&point.latency, 0.5)
            }));
            self.progress.print(out, &r);
            records.push(r);
        }
        records
    }
}

/// How much each target's p50 and p99 grew from the fewest held files to the most.
fn note_flatness(out: &mut Reporter, counts: &[usize], measured: &[(OpenTarget, Vec<SweepPoint>)]) {
    let growth = |results: &[SweepPoint], q| match (results.first(), results.last()) {
        (Some(first), Some(last)) => micros(&last.latency, q) / micros(&first.latency, q),
        _ => 1.0,
    };
    let mut flatness = serde_json::Map::new();
    for (target, results) in measured {
        flatness.insert(
            target.name().into(),
            json!({
                "p50_at_max_over_p50_at_min": (growth(results, 0.5) * 100.0).round() / 100.0,
                "p99_at_max_over_p99_at_min": (growth(results, 0.99) * 100.0).round() / 100.0,
                "min_held": counts.first(), "max_held": counts.last(),
            }),
        );
    }
    out.note("openfds_flatness", &serde_json::Value::Object(flatness));
}

fn draw(
    path: &Path,
    counts: &[usize],
    measured: &[(OpenTarget, Vec<SweepPoint>)],
    samples: usize,
) -> anyhow::Result<()> {
    let panel = |title: &str, q: f64| Panel {
        title: title.into(),
        series: measured
            .iter()
            .map(|(target, results)| Series {
                name: target.name().into(),
                points: counts
                    .iter()
                    .zip(results)
                    .map(|(&n, point)| (n.max(1) as f64, micros(&point.latency, q)))
                    .collect(),
            })
            .collect(),
    };
    let chart = LineChart {
        title: format!("openfds: one more open while N files are held open ({samples} samples)"),
        x_desc: "files held open, N (0 drawn at 1)".into(),
        y_desc: "open latency, µs".into(),
        panels: vec![panel("p50", 0.5), panel("p99", 0.99)],
    };
    plot::lines(path, &chart)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_capped_and_sorted() {
        assert_eq!(counts(&DEFAULT_HELD, 19_300), [0, 10, 100, 1000, 10_000]);
        assert_eq!(counts(&[50, 5, 5, 400, 100], 100), [5, 50, 100]);
        assert!(counts(&[], 7).is_empty());
    }

    #[test]
    fn the_limit_is_raised_to_the_hard_limit() {
        let (_, now) = raise_nofile_limit().expect("setrlimit");
        let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        assert_eq!(limit.current, Some(now));
        assert_eq!(limit.current, limit.maximum);
        assert_eq!(
            held_max(),
            (now as usize).saturating_sub(FD_HEADROOM).max(10)
        );
    }
}
