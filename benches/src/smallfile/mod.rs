//! `kiln-bench smallfile`: many small files put through one operation after another, in the
//! spirit of the `smallfile` tool, on several targets in one run.
//!
//! Operations (`--ops`, in order; default the full sequence below, where each one finds what
//! the one before left):
//!
//! | op | on each of `--files` files per thread (or directory) | fops (engine, volume) |
//! |---|---|---|
//! | `create` | create (exclusive), write `--file-bytes`, [fsync], close | PUT ([`O_SYNC`] with `--fsync`) |
//! | `stat` | `lstat` by path | LOOKUP parent + name |
//! | `read` | open, read it all (length checked), close | OPEN, READ…, RELEASE |
//! | `append` | open `O_APPEND`, write `--file-bytes`, [fsync], close | OPEN, WRITE, [FSYNC], RELEASE |
//! | `chmod` | `chmod 0640` | SETATTR mode |
//! | `setxattr` | `lsetxattr user.kiln-bench` (64 bytes) | SETXATTR |
//! | `getxattr` | `lgetxattr` (length checked) | GETXATTR |
//! | `ls-l` | per directory: `readdir` + `lstat` of every entry | OPENDIR, READDIRP…, RELEASEDIR |
//! | `readdir` | per directory: `readdir` (entry count checked) | OPENDIR, READDIR…, RELEASEDIR |
//! | `rename` | rename to `NAME.renamed` in the same directory (again: back) | RENAME |
//! | `delete` | unlink | UNLINK |
//! | `mkdir` | make a directory (in a tree of its own beside the files) | MKDIR |
//! | `rmdir` | remove it | RMDIR |
//!
//! An op whose precondition is missing (`--ops read` alone, `create` twice) gets the op that
//! sets it up run first, unmeasured; the `smallfile` note lists the whole plan. Files are
//! removed (unmeasured) at the end, so every target ends empty.
//!
//! Layout on every target: `t{thread}/d{k}/f{i}` with `--fanout` files per directory `d{k}`
//! (made as needed, before the first op), and `t{thread}/m{k}/s{i}` for mkdir/rmdir.
//! `--threads` workers each own one `t{thread}` and go through their files one at a time:
//! OS threads on the syscall targets, tasks on the engine and volume targets. On the engine
//! and volume targets every GFID is derived from `--seed`. On the syscall targets each
//! worker ends each op's pass with an fsync of its `t{thread}` directory, inside the pass's
//! time: a mount that answers ahead of its server (Kiln's, under leases) is timed until the
//! pass's changes are on the server, and the next pass does not pay for them.
//!
//! Targets (`--targets`, measured in the order given; every ratio is against the first):
//!
//! * `local` — plain syscalls (std::fs, rustix) on a directory in the scratch directory.
//! * `path=DIR` — the same code on a fresh directory under `DIR` (any mount: GlusterFS,
//!   bindfs, a Kiln mount set up by hand), removed afterwards.
//! * `kiln-mount` — the same code on a Kiln FUSE mount of a fresh brick that kiln-bench sets
//!   up as `kiln-bench mount` does (`kiln-brickd serve` + `kiln mount`, built beside
//!   kiln-bench; `--mount-options` passed to `kiln mount`).
//! * `engine` — the io_uring engine called directly on a fresh brick in the scratch
//!   directory: each worker is a task on a ring worker thread with a session of its own.
//! * `volume` — a fresh brick served over QUIC with mutual TLS in this process, the workers
//!   being tasks sharing one [`kiln_client::BrickClient`] connection.
//!
//! Results, per op and target: `ops_per_s` = files per second over all threads (for
//! `ls-l`/`readdir` too: entries listed per second), p50/p90/p99/p99.9 latency of one op
//! (for `ls-l`/`readdir`: of listing one directory; `latency_per` in `params` says which),
//! `ratio` = ops/s ÷ the first target's. `--plot` draws ops/s bars per op and target.
//!
//! This module is the driver (targets, runs, records, plots); `plan` holds the ops, the plan
//! of steps and the layout, and a step runs on a target through `syscall_runner` or
//! `fop_runner`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use hdrhistogram::Histogram;
use kiln_dataplane::engine::EngineConfig;
use kiln_wire::limits::IO_SIZE_MAX_BYTES;
use serde_json::json;

use crate::bricks::BrickOption;
use crate::mount::KilnMount;
use crate::plot::{self, BarChart};
use crate::progress::Progress;
use crate::report::{Record, Reporter, histogram};
use crate::scratch::Scratch;

mod fop_runner;
mod plan;
mod syscall_runner;

pub use plan::{PlanStep, SmallfileOp, plan};

use fop_runner::FopRunner;
use plan::Layout;
use syscall_runner::SyscallRunner;

/// What to run.
#[derive(Debug, Clone)]
pub struct SmallfileBench {
    pub ops: Vec<SmallfileOp>,
    pub targets: Vec<TargetSpec>,
    /// Workers at once: OS threads on the syscall targets, tasks on the others.
    pub threads: usize,
    /// Files per thread.
    pub files: usize,
    pub file_bytes: usize,
    /// Bytes per write(2) of a create or append on the syscall targets (`None`: the whole
    /// file in one).
    pub record_bytes: Option<usize>,
    /// Files per directory.
    pub fanout: usize,
    /// fsync after every create and append.
    pub fsync: bool,
    pub seed: u64,
    /// `-o` options of `kiln mount` for the `kiln-mount` target.
    pub mount_options: Vec<String>,
    /// Values of one brick option: the `engine` and `volume` targets run once per value.
    pub vary: Vec<BrickOption>,
    /// Plot files to draw (.svg or .png each).
    pub plots: Vec<PathBuf>,
}

/// A target as given on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetSpec {
    Local,
    Engine,
    Volume,
    KilnMount,
    Path(PathBuf),
}

impl std::str::FromStr for TargetSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<TargetSpec, String> {
        match s {
            "local" => Ok(TargetSpec::Local),
            "engine" => Ok(TargetSpec::Engine),
            "volume" => Ok(TargetSpec::Volume),
            "kiln-mount" => Ok(TargetSpec::KilnMount),
            _ => match s.strip_prefix("path=") {
                Some(dir) if !dir.is_empty() => Ok(TargetSpec::Path(PathBuf::from(dir))),
                _ => Err(format!(
                    "unknown target {s:?}: local, engine, volume, kiln-mount or path=DIR"
                )),
            },
        }
    }
}

impl TargetSpec {
    pub fn name(&self) -> String {
        match self {
            TargetSpec::Local => "local".into(),
            TargetSpec::Engine => "engine".into(),
            TargetSpec::Volume => "volume".into(),
            TargetSpec::KilnMount => "kiln-mount".into(),
            TargetSpec::Path(p) => format!("path={}", p.display()),
        }
    }
}

/// The default seed.
pub const DEFAULT_SEED: u64 = 0x736d_616c_6c66;

/// One measured (or set-up) pass of an op over every thread's files.
#[derive(Debug)]
struct Pass {
    elapsed: Duration,
    latency: Histogram<u64>,
}

/// A target being measured.
trait Runner {
    fn run(&mut self, step: &PlanStep) -> anyhow::Result<Pass>;
    /// Removes what the run left and stops what it started.
    fn finish(self: Box<Self>) -> anyhow::Result<serde_json::Value>;
}

/// Runs the whole benchmark, printing records as they are measured.
pub fn run(
    bench: &SmallfileBench,
    scratch: &Scratch,
    out: &mut Reporter,
) -> anyhow::Result<Vec<Record>> {
    if bench.ops.is_empty() || bench.targets.is_empty() {
        bail!("--ops and --targets must name at least one each");
    }
    for path in &bench.plots {
        plot::check_path(path)?;
    }
    let (threads, files, fanout) = (
        bench.threads.max(1),
        bench.files.max(1),
        bench.fanout.max(1),
    );
    let brick_targets = bench
        .targets
        .iter()
        .any(|t| matches!(t, TargetSpec::Engine | TargetSpec::Volume));
    if brick_targets && bench.file_bytes > IO_SIZE_MAX_BYTES {
        bail!("--file-bytes: one PUT or WRITE carries at most {IO_SIZE_MAX_BYTES} bytes");
    }
    if bench.record_bytes == Some(0) {
        bail!("--record-bytes must be at least 1");
    }
    let layout = Layout {
        files,
        fanout,
        file_bytes: bench.file_bytes,
        record_bytes: bench.record_bytes.unwrap_or(bench.file_bytes).max(1),
        seed: bench.seed,
    };
    let steps = plan(&bench.ops, bench.file_bytes);
    let describe = |s: &PlanStep| match s.measured {
        true => s.op.name().to_owned(),
        false => format!("({})", s.op.name()),
    };
    out.note(
        "smallfile",
        &json!({
            "targets": bench.targets.iter().map(TargetSpec::name).collect::<Vec<_>>(),
            "plan": steps.iter().map(describe).collect::<Vec<_>>(),
            "unmeasured": "steps in parentheses set up a precondition or clean up",
            "threads": threads, "files_per_thread": files, "file_bytes": bench.file_bytes,
            "record_bytes": layout.record_bytes, "fanout": fanout, "dirs_per_thread": layout.dirs(), "fsync": bench.fsync,
            "seed": bench.seed,
            "ratio": format!("ops/s / {}'s ops/s", bench.targets[0].name()),
        }),
    );
    let measured = steps.iter().filter(|s| s.measured).count();
    let runs = expand(&bench.targets, &bench.vary);
    let reference_name = runs[0].0.clone();
    let progress = Progress::new(
        "smallfile",
        (runs.len() * steps.len() * threads * files) as u64,
    );
    let root = scratch.path().join("smallfile");
    std::fs::create_dir_all(&root)?;
    let mut records = Vec::new();
    let mut reference: Vec<f64> = Vec::with_capacity(measured);
    let mut bars: Vec<(String, Vec<Option<f64>>)> = Vec::new();
    for (n, (name, spec, option)) in runs.iter().enumerate() {
        progress.set_message(format!("{name}: setting up"));
        let mut config = EngineConfig::default();
        if let Some(option) = option {
            option.apply(&mut config)?;
        }
        let dir = root.join(format!("{n}-{}", spec.name().replace('/', "_")));
        let mut runner = start(spec, bench, &layout, threads, &dir, &config, scratch)?;
        let mut rates = Vec::with_capacity(measured);
        for step in &steps {
            progress.set_message(format!("{name}: {}", describe(step)));
            let pass = runner
                .run(step)
                .with_context(|| format!("{} on {name}", step.op.name()))?;
            progress.inc((threads * files) as u64);
            if !step.measured {
                continue;
            }
            let rate = (threads * files) as f64 / pass.elapsed.as_secs_f64().max(1e-9);
            let mut r = Record::new(
                &format!("smallfile.{}", step.op.name()),
                name,
                json!({ "threads": threads, "files": files, "file_bytes": bench.file_bytes,
                        "fanout": fanout, "fsync": bench.fsync,
                        "latency_per": if step.op.per_directory() { "directory" } else { "file" } }),
                &reference_name,
            );
            r.ops_per_s = Some(rate);
            r.set_latency(&pass.latency);
            // The first run is the reference: its own rates are not known before it ends.
            let index = rates.len();
            r.ratio = Some(
                reference
                    .get(index)
                    .map_or(1.0, |reference| rate / reference),
            );
            rates.push(rate);
            progress.print(out, &r);
            records.push(r);
        }
        let stopped = runner.finish()?;
        progress.note(out, "smallfile_target", &stopped);
        if reference.is_empty() {
            reference = rates.clone();
        }
        bars.push((name.clone(), rates.into_iter().map(Some).collect()));
    }
    progress.finish();
    draw_plots(bench, threads, &layout, &steps, bars, out)?;
    Ok(records)
}

/// Draws ops/s bars per op and target into every `--plot` file.
fn draw_plots(
    bench: &SmallfileBench,
    threads: usize,
    layout: &Layout,
    steps: &[PlanStep],
    bars: Vec<(String, Vec<Option<f64>>)>,
    out: &mut Reporter,
) -> anyhow::Result<()> {
    let (files, fanout) = (layout.files, layout.fanout);
    if bench.plots.is_empty() {
        return Ok(());
    }
    let chart = BarChart {
        title: format!(
            "smallfile: {threads} threads x {files} files of {} B, fanout {fanout}{}",
            bench.file_bytes,
            if bench.fsync { ", fsync" } else { "" }
        ),
        y_desc: "ops/s (files/s; log scale)".into(),
        groups: steps
            .iter()
            .filter(|s| s.measured)
            .map(|s| s.op.name().to_owned())
            .collect(),
        series: bars,
    };
    for path in &bench.plots {
        plot::bars(path, &chart)?;
        out.note("plot", &json!(path.display().to_string()));
    }
    Ok(())
}

/// The runs: each target once, and the `engine` and `volume` targets once per value of the
/// varied option, named `engine[KEY=VALUE]`.
fn expand(
    targets: &[TargetSpec],
    vary: &[BrickOption],
) -> Vec<(String, TargetSpec, Option<BrickOption>)> {
    let mut runs = Vec::new();
    for spec in targets {
        if vary.is_empty() || !matches!(spec, TargetSpec::Engine | TargetSpec::Volume) {
            runs.push((spec.name(), spec.clone(), None));
            continue;
        }
        for option in vary {
            let name = format!("{}[{option}]", spec.name());
            runs.push((name, spec.clone(), Some(option.clone())));
        }
    }
    runs
}

fn start(
    spec: &TargetSpec,
    bench: &SmallfileBench,
    layout: &Layout,
    threads: usize,
    dir: &Path,
    config: &EngineConfig,
    scratch: &Scratch,
) -> anyhow::Result<Box<dyn Runner>> {
    let fresh = |name: &str| -> anyhow::Result<PathBuf> {
        let dir = dir.join(name);
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        Ok(dir)
    };
    Ok(match spec {
        TargetSpec::Local => Box::new(SyscallRunner::start(
            fresh("local")?,
            layout,
            threads,
            bench.fsync,
            None,
        )?),
        TargetSpec::Path(dir) => {
            if !dir.is_dir() {
                bail!("path={}: not a directory", dir.display());
            }
            let base = dir.join(format!("kiln-bench-smallfile-{}", std::process::id()));
            std::fs::create_dir(&base)
                .with_context(|| format!("cannot create {}", base.display()))?;
            Box::new(SyscallRunner::start(
                base,
                layout,
                threads,
                bench.fsync,
                None,
            )?)
        }
        TargetSpec::KilnMount => {
            let dir = fresh("kiln-mount")?;
            let mount = KilnMount::start(&dir, &bench.mount_options)?;
            let base = mount.path().to_owned();
            Box::new(SyscallRunner::start(
                base,
                layout,
                threads,
                bench.fsync,
                Some(mount),
            )?)
        }
        TargetSpec::Engine => Box::new(FopRunner::start_engine(
            &fresh("engine")?.join("brick"),
            config,
            layout,
            threads,
            bench.fsync,
        )?),
        TargetSpec::Volume => Box::new(FopRunner::start_volume(
            &fresh("volume")?,
            config,
            scratch,
            layout,
            threads,
            bench.fsync,
        )?),
    })
}

fn merge(histograms: Vec<Histogram<u64>>) -> anyhow::Result<Histogram<u64>> {
    let mut all = histogram()?;
    for h in histograms {
        all.add(&h)?;
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse() {
        assert_eq!("local".parse(), Ok(TargetSpec::Local));
        assert_eq!(
            "path=/mnt/x".parse(),
            Ok(TargetSpec::Path(PathBuf::from("/mnt/x")))
        );
        assert!("path=".parse::<TargetSpec>().is_err());
        assert!("nfs".parse::<TargetSpec>().is_err());
    }
}
