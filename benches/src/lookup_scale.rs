//! `kiln-bench lookup-scale`: LOOKUP latency as the brick's handle index grows. GlusterFS
//! keeps every object's handle in `.glusterfs/XX/YY/<gfid>`; with tens of millions of them
//! the kernel's path walks dominated its lookups. Kiln resolves every name from a directory
//! fd it holds (`*at(dirfd, one_name)`), so its lookups should stay flat as the index grows.
//!
//! The brick (a fresh one in the scratch directory) is filled by the io_uring engine at
//! queue depth `--depth`: `--fanout` empty regular files per directory `d{k}`, each made by
//! MKNOD — the same GFID xattr, handle hard link and intent record as a create. At each
//! checkpoint (`--checkpoints`, up to `--max-entries`; default 1k … 2M) filling stops, the
//! file system is synced, and a sample of `--samples` files, drawn uniformly from those
//! made so far (from `--seed`), is looked up four ways:
//!
//! * `local` by name — `fstatat(brick root fd, "d{k}/f{i}", AT_SYMLINK_NOFOLLOW)`;
//! * `local` by GFID — the same of `.glusterfs/XX/YY/<gfid>`;
//! * `engine` by name — LOOKUP (parent GFID + name) through a fresh engine on the brick;
//! * `engine` by GFID — STAT of the GFID (the handle) through a fresh engine;
//!
//! each first **cold** — after `echo 3 > /proc/sys/vm/drop_caches`, and for the engine a
//! new engine started after that (Brick::open + Engine::start: the brick's GFID and
//! directory caches empty; its 256 `.glusterfs/XX` fds are opened at start, as they always
//! are) — then **warm**: the same sample again, in the same order. Lookups are sequential,
//! one in flight, the engine's from a task on one of its ring workers.
//!
//! Results: one record per (checkpoint, target, by, cache) with p50/p90/p99/p99.9 and
//! lookups/s; the reference is `local` with the same by and cache, `ratio` = its p50 ÷ this
//! p50. `lookup_scale_populate` notes give the fill rate per segment. `--plot` draws p50
//! against the entry count, by name and by GFID, cold and warm, for both targets.
//!
//! A 2-million-entry brick needs over 2 million inodes: the run checks the scratch file
//! system's free inodes first. Use `--loop-fs-mib` with `--loop-fs-inodes` (e.g.
//! `--loop-fs-mib 8192 --loop-fs-inodes 3000000`). Root only (bricks, drop_caches).

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use hdrhistogram::Histogram;
use kiln_dataplane::Brick;
use kiln_dataplane::engine::{Engine, EngineConfig, EngineKind};
use kiln_wire::*;
use serde_json::json;

use crate::bricks::{Destination, open_engine, run_tasks, seeded_gfid};
use crate::plot::{self, LineChart, Panel, Series};
use crate::progress::Progress;
use crate::report::{Record, Reporter, histogram, micros, nanos};
use crate::rng::Rng;
use crate::scratch::{Scratch, drop_caches, sync_file_systems};

/// What to run.
#[derive(Debug, Clone)]
pub struct LookupScaleBench {
    pub max_entries: usize,
    /// Entry counts to measure at (above `max_entries` dropped; `max_entries` always added).
    pub checkpoints: Vec<usize>,
    pub samples: usize,
    /// Files per directory.
    pub fanout: usize,
    /// MKNODs in flight while filling.
    pub depth: usize,
    pub seed: u64,
    /// Plot files to draw (.svg or .png each).
    pub plots: Vec<PathBuf>,
}

pub const DEFAULT_MAX_ENTRIES: usize = 2_000_000;
pub const DEFAULT_CHECKPOINTS: [usize; 5] = [1000, 10_000, 100_000, 1_000_000, 2_000_000];
pub const DEFAULT_SEED: u64 = 0x6c6f_6f6b;
/// Second-level handle directories (`XX/YY`) a full index has, besides the files.
const HANDLE_DIRS: u64 = 65_536;
/// Inodes kept free beyond the estimate (intent records, scratch files).
const INODES_SPARE: u64 = 10_000;

/// How a file is found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum By {
    Name,
    Gfid,
}

impl By {
    fn name(self) -> &'static str {
        match self {
            By::Name => "name",
            By::Gfid => "gfid",
        }
    }
}

/// Parses a count with an optional `k` (thousand) or `M` (million) suffix: `2M`, `100k`.
pub fn parse_count(s: &str) -> Result<usize, String> {
    let (digits, unit) = match s.strip_suffix(['k', 'K']) {
        Some(d) => (d, 1_000),
        None => match s.strip_suffix('M') {
            Some(d) => (d, 1_000_000),
            None => (s, 1),
        },
    };
    digits
        .trim()
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(unit))
        .ok_or_else(|| format!("{s:?} is not a count (like 5000, 100k or 2M)"))
}

/// Where file `i` is.
#[derive(Debug, Clone, Copy)]
struct Layout {
    fanout: usize,
    seed: u64,
}

impl Layout {
    fn dir(&self, i: usize) -> usize {
        i / self.fanout
    }

    fn dir_name(k: usize) -> String {
        format!("d{k:05}")
    }

    fn file_name(i: usize) -> String {
        format!("f{i:08}")
    }

    fn dir_gfid(&self, k: usize) -> Gfid {
        seeded_gfid(self.seed, 1 << 56 | k as u64)
    }

    fn file_gfid(&self, i: usize) -> Gfid {
        seeded_gfid(self.seed, 2 << 56 | i as u64)
    }
}

/// The checkpoints to measure at: those up to `max`, sorted, and `max`.
pub fn checkpoints(asked: &[usize], max: usize) -> Vec<usize> {
    let mut points: Vec<usize> = asked
        .iter()
        .copied()
        .filter(|&n| n > 0 && n < max)
        .collect();
    points.push(max);
    points.sort_unstable();
    points.dedup();
    points
}

/// Runs the whole benchmark, printing records as they are measured.
pub fn run(
    bench: &LookupScaleBench,
    scratch: &Scratch,
    out: &mut Reporter,
) -> anyhow::Result<Vec<Record>> {
    for path in &bench.plots {
        plot::check_path(path)?;
    }
    if !rustix::process::geteuid().is_root() {
        bail!("lookup-scale needs root: bricks (trusted xattrs) and dropping the kernel's caches");
    }
    let max = bench.max_entries.max(1);
    let points = checkpoints(&bench.checkpoints, max);
    let layout = Layout {
        fanout: bench.fanout.max(1),
        seed: bench.seed,
    };
    let (samples, depth) = (bench.samples.max(1), bench.depth.max(1));
    let brick_dir = scratch.path().join("lookup-scale").join("brick");
    std::fs::create_dir_all(&brick_dir)?;
    let dirs = max.div_ceil(layout.fanout);
    check_inodes(&brick_dir, max, dirs)?;
    out.note(
        "lookup_scale",
        &json!({
            "max_entries": max, "checkpoints": points, "samples": samples,
            "fanout": layout.fanout, "dirs": dirs, "fill_depth": depth, "seed": bench.seed,
            "fill": "empty regular files by MKNOD through the io_uring engine",
            "cold": "syncfs, echo 3 > /proc/sys/vm/drop_caches, then (engine) a fresh engine",
            "warm": "the same sample again, in the same order",
            "local": "fstatat(brick root fd, d{k}/f{i} or .glusterfs/XX/YY/<gfid>, AT_SYMLINK_NOFOLLOW)",
            "ratio": "local p50 / this p50, same lookup kind and cache state",
        }),
    );
    let measure_steps = (points.len() * 8 * samples) as u64;
    let progress = Progress::new("lookup-scale", max as u64 + measure_steps);
    let fixture = Fixture::new(brick_dir, layout, samples, depth, bench.seed)?;
    let mut results = Results::default();
    let (mut made, mut dirs_made) = (0, 0);
    for &point in &points {
        dirs_made = fixture.fill_to(point, made, dirs_made, &progress, out)?;
        made = point;
        fixture.measure(point, &mut results, &progress, out)?;
    }
    progress.finish();
    draw(&bench.plots, &results.curves, samples, layout.fanout, out)?;
    Ok(results.records)
}

/// The formatted brick and what every checkpoint fills and measures it with.
struct Fixture {
    rt: tokio::runtime::Runtime,
    config: EngineConfig,
    brick_dir: PathBuf,
    /// The brick root, for the `local` lookups.
    root_fd: OwnedFd,
    layout: Layout,
    samples: usize,
    depth: usize,
    seed: u64,
}

/// What the checkpoints measured so far.
#[derive(Default)]
struct Results {
    records: Vec<Record>,
    /// p50 against entries, per lookup kind, one series per target and cache state.
    curves: Vec<(By, Series)>,
}

impl Fixture {
    /// Formats the brick in `brick_dir`.
    fn new(
        brick_dir: PathBuf,
        layout: Layout,
        samples: usize,
        depth: usize,
        seed: u64,
    ) -> anyhow::Result<Fixture> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let config = EngineConfig {
            kind: EngineKind::Uring,
            ..EngineConfig::default()
        };
        Brick::format(&brick_dir)?;
        let root_fd = rustix::fs::open(
            &brick_dir,
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .with_context(|| format!("cannot open {}", brick_dir.display()))?;
        Ok(Fixture {
            rt,
            config,
            brick_dir,
            root_fd,
            layout,
            samples,
            depth,
            seed,
        })
    }

    /// Fills the brick from `made` to `point` files (and the directories they need beyond
    /// the `dirs_made` there are), notes the fill rate and syncs. Returns the directories
    /// made so far.
    fn fill_to(
        &self,
        point: usize,
        made: usize,
        dirs_made: usize,
        progress: &Progress,
        out: &mut Reporter,
    ) -> anyhow::Result<usize> {
        progress.set_message(format!("filling to {point}"));
        let start = Instant::now();
        let dirs_made = {
            let (_brick, engine) = open_engine(&self.brick_dir, &self.config)?;
            let dirs = point.div_ceil(self.layout.fanout);
            let dirs_made = make_dirs(&self.rt, &engine, self.layout, dirs_made, dirs)?;
            fill(
                &self.rt,
                &engine,
                self.layout,
                made..point,
                self.depth,
                progress,
            )?;
            dirs_made
        };
        let seconds = start.elapsed().as_secs_f64();
        progress.note(
            out,
            "lookup_scale_populate",
            &json!({ "entries": point, "made": point - made, "seconds": (seconds * 1000.0).round() / 1000.0,
                     "creates_per_s": ((point - made) as f64 / seconds.max(1e-9)).round() }),
        );
        sync_file_systems(&[&self.brick_dir]);
        Ok(dirs_made)
    }

    /// Looks up a sample of the `point` files made so far each way, on each target, cold
    /// then warm; prints and keeps a record of each pass.
    fn measure(
        &self,
        point: usize,
        results: &mut Results,
        progress: &Progress,
        out: &mut Reporter,
    ) -> anyhow::Result<()> {
        let mut rng = Rng::stream(self.seed, point as u64);
        let sample: Arc<Vec<usize>> =
            Arc::new((0..self.samples).map(|_| rng.below(point)).collect());
        for by in [By::Name, By::Gfid] {
            for target in ["local", "engine"] {
                progress.set_message(format!("{point} entries: {target} by {}", by.name()));
                drop_caches().context("dropping the kernel's caches (echo 3 > drop_caches)")?;
                let [cold, warm] = self.lookups(target, &sample, by)?;
                progress.inc(2 * self.samples as u64);
                for (cache, pass) in [("cold", cold), ("warm", warm)] {
                    let mut r = self.record(point, target, by, cache, &pass);
                    let p50_us = micros(&pass.0, 0.5);
                    r.ratio = results.ratio(target, &r.params, p50_us);
                    results.add_point(by, format!("{target} {cache}"), (point as f64, p50_us));
                    progress.print(out, &r);
                    results.records.push(r);
                }
            }
        }
        Ok(())
    }

    /// Both passes over `sample` on `target`; the engine is a fresh one.
    fn lookups(&self, target: &str, sample: &Arc<Vec<usize>>, by: By) -> anyhow::Result<[Pass; 2]> {
        match target {
            "local" => local_lookups(&self.root_fd, self.layout, sample, by),
            _ => {
                let (_brick, engine) = open_engine(&self.brick_dir, &self.config)?;
                engine_lookups(&self.rt, &engine, self.layout, sample, by)
            }
        }
    }

    /// The record of one pass, without its ratio.
    fn record(&self, point: usize, target: &str, by: By, cache: &str, pass: &Pass) -> Record {
        let (h, rate) = pass;
        let mut r = Record::new(
            "lookup-scale",
            target,
            json!({ "entries": point, "by": by.name(), "cache": cache,
                    "samples": self.samples, "fanout": self.layout.fanout }),
            "local",
        );
        r.ops_per_s = Some(*rate);
        r.set_latency(h);
        r
    }
}

impl Results {
    /// The p50 of `local`'s same pass ÷ `p50_us`. Local is measured first at every
    /// checkpoint: it is its own reference.
    fn ratio(&self, target: &str, params: &serde_json::Value, p50_us: f64) -> Option<f64> {
        let reference = self
            .records
            .iter()
            .rev()
            .find(|x: &&Record| x.target == "local" && x.params == *params);
        match target {
            "local" => Some(1.0),
            _ => reference.and_then(|x| x.p50_us).map(|p50| p50 / p50_us),
        }
    }

    /// Adds a point to the curve `name` of lookups `by`.
    fn add_point(&mut self, by: By, name: String, at: (f64, f64)) {
        match self
            .curves
            .iter_mut()
            .find(|(b, s)| *b == by && s.name == name)
        {
            Some((_, series)) => series.points.push(at),
            None => self.curves.push((
                by,
                Series {
                    name,
                    points: vec![at],
                },
            )),
        }
    }
}

/// Draws p50 against the entry count, by name and by GFID, into each plot file.
fn draw(
    plots: &[PathBuf],
    curves: &[(By, Series)],
    samples: usize,
    fanout: usize,
    out: &mut Reporter,
) -> anyhow::Result<()> {
    if plots.is_empty() {
        return Ok(());
    }
    let panel = |by: By, title: &str| Panel {
        title: title.into(),
        series: curves
            .iter()
            .filter(|(b, _)| *b == by)
            .map(|(_, series)| series.clone())
            .collect(),
    };
    let chart = LineChart {
        title: format!(
            "lookup-scale: p50 of {samples} random lookups as the handle index grows \
             ({fanout} per directory)"
        ),
        x_desc: "entries on the brick".into(),
        y_desc: "lookup latency p50, µs".into(),
        panels: vec![
            panel(By::Name, "by name (LOOKUP parent + name)"),
            panel(By::Gfid, "by GFID (the handle)"),
        ],
    };
    for path in plots {
        plot::lines(path, &chart)?;
        out.note("plot", &json!(path.display().to_string()));
    }
    Ok(())
}

/// Fails early when the brick's file system has too few free inodes for `entries` files in
/// `dirs` directories and a full handle index.
fn check_inodes(dir: &Path, entries: usize, dirs: usize) -> anyhow::Result<()> {
    let stats = rustix::fs::statvfs(dir).context("statvfs of the scratch file system")?;
    let needed = entries as u64 + dirs as u64 + HANDLE_DIRS + INODES_SPARE;
    if stats.f_favail < needed {
        bail!(
            "{entries} entries need about {needed} free inodes; the scratch file system has {}. \
             Give it more: --loop-fs-mib MIB --loop-fs-inodes {} (e.g. --loop-fs-mib 8192 for \
             2M entries)",
            stats.f_favail,
            needed + needed / 2
        );
    }
    Ok(())
}

/// Makes directories `from..to` in the brick root (one task; few of them).
fn make_dirs(
    rt: &tokio::runtime::Runtime,
    engine: &Engine,
    layout: Layout,
    from: usize,
    to: usize,
) -> anyhow::Result<usize> {
    if from >= to {
        return Ok(from);
    }
    run_tasks(
        rt,
        Destination::Engine(engine),
        1,
        move |_, caller| async move {
            for k in from..to {
                let mkdir = Mkdir {
                    parent: Gfid::ROOT,
                    name: Name::new(Layout::dir_name(k))?,
                    gfid: layout.dir_gfid(k),
                    mode: Mode::new(0o755).context("mode")?,
                    umask: Mode::new(0).context("mode")?,
                };
                caller
                    .call(mkdir)
                    .await
                    .with_context(|| format!("directory {k}"))?;
            }
            Ok(())
        },
    )?;
    Ok(to)
}

/// Makes files `range` with `depth` MKNODs in flight.
fn fill(
    rt: &tokio::runtime::Runtime,
    engine: &Engine,
    layout: Layout,
    range: std::ops::Range<usize>,
    depth: usize,
    progress: &Progress,
) -> anyhow::Result<()> {
    let progress = progress.clone();
    let tasks = depth.min(range.len()).max(1);
    run_tasks(rt, Destination::Engine(engine), tasks, move |k, caller| {
        let (range, progress) = (range.clone(), progress.clone());
        async move {
            for i in (range.start + k..range.end).step_by(tasks) {
                let mknod = Mknod {
                    parent: layout.dir_gfid(layout.dir(i)),
                    name: Name::new(Layout::file_name(i))?,
                    gfid: layout.file_gfid(i),
                    node_type: NodeType::Regular,
                    mode: Mode::new(0o644).context("mode")?,
                    umask: Mode::new(0).context("mode")?,
                    rdev: 0,
                };
                caller
                    .call(mknod)
                    .await
                    .with_context(|| format!("file {i}"))?;
                progress.inc(1);
            }
            Ok(())
        }
    })?;
    Ok(())
}

/// A pass over the sample: its latency histogram and lookups per second.
type Pass = (Histogram<u64>, f64);

/// `fstatat` of every sampled file from the brick root's fd: cold, then warm.
fn local_lookups(
    root: &OwnedFd,
    layout: Layout,
    sample: &[usize],
    by: By,
) -> anyhow::Result<[Pass; 2]> {
    let paths: Vec<String> = sample
        .iter()
        .map(|&i| match by {
            By::Name => format!(
                "{}/{}",
                Layout::dir_name(layout.dir(i)),
                Layout::file_name(i)
            ),
            By::Gfid => Brick::handle_path(&layout.file_gfid(i)),
        })
        .collect();
    let pass = || -> anyhow::Result<Pass> {
        let mut h = histogram()?;
        let start = Instant::now();
        for path in &paths {
            let t = Instant::now();
            rustix::fs::statat(root, path, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
                .with_context(|| format!("fstatat {path}"))?;
            h.record(nanos(t.elapsed()))?;
        }
        Ok((
            h,
            paths.len() as f64 / start.elapsed().as_secs_f64().max(1e-9),
        ))
    };
    Ok([pass()?, pass()?])
}

/// LOOKUP (by name) or STAT (by GFID) of every sampled file, one at a time from a task on a
/// ring worker: cold (the engine is new), then warm.
fn engine_lookups(
    rt: &tokio::runtime::Runtime,
    engine: &Engine,
    layout: Layout,
    sample: &Arc<Vec<usize>>,
    by: By,
) -> anyhow::Result<[Pass; 2]> {
    let sample = sample.clone();
    let mut passes = run_tasks(rt, Destination::Engine(engine), 1, move |_, caller| {
        let sample = sample.clone();
        async move {
            let mut passes = Vec::with_capacity(2);
            for _ in 0..2 {
                let mut h = histogram()?;
                let start = Instant::now();
                for &i in sample.iter() {
                    let gfid = layout.file_gfid(i);
                    let fop: FopRequest = match by {
                        By::Name => Lookup {
                            parent: layout.dir_gfid(layout.dir(i)),
                            name: Name::new(Layout::file_name(i))?,
                        }
                        .into(),
                        By::Gfid => Stat { gfid }.into(),
                    };
                    let t = Instant::now();
                    let reply = caller
                        .call(fop)
                        .await
                        .with_context(|| format!("file {i}"))?;
                    h.record(nanos(t.elapsed()))?;
                    let found = match reply {
                        FopReply::Lookup(r) => r.iatt.gfid,
                        FopReply::Stat(r) => r.iatt.gfid,
                        other => bail!("{} answered", other.code().name()),
                    };
                    if found != gfid {
                        bail!("file {i} has GFID {found}, not {gfid}");
                    }
                }
                let rate = sample.len() as f64 / start.elapsed().as_secs_f64().max(1e-9);
                passes.push((h, rate));
            }
            Ok(passes)
        }
    })?;
    let mut passes = passes.pop().context("the lookup task returned nothing")?;
    let warm = passes.pop().context("no warm pass")?;
    let cold = passes.pop().context("no cold pass")?;
    Ok([cold, warm])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_take_k_and_m() {
        assert_eq!(parse_count("2M"), Ok(2_000_000));
        assert_eq!(parse_count("100k"), Ok(100_000));
        assert_eq!(parse_count("1500"), Ok(1500));
        assert!(parse_count("2G").is_err());
        assert!(parse_count("k").is_err());
    }

    #[test]
    fn checkpoints_end_at_the_maximum() {
        assert_eq!(
            checkpoints(&DEFAULT_CHECKPOINTS, 150_000),
            [1000, 10_000, 100_000, 150_000]
        );
        assert_eq!(checkpoints(&[0, 5, 5], 5), [5]);
    }
}
