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
//! and volume targets every GFID is derived from `--seed`.
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

use std::io::{Read as _, Write as _};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use hdrhistogram::Histogram;
use kiln_client::BrickClient;
use kiln_dataplane::Brick;
use kiln_dataplane::engine::{Engine, EngineConfig};
use kiln_dataplane::server::Server;
use kiln_wire::limits::IO_SIZE_MAX_BYTES;
use kiln_wire::quic::UDP_PAYLOAD_MAX_BYTES;
use kiln_wire::*;
use serde_json::json;

use crate::bricks::{
    BrickOption, Caller, Destination, Served, open_engine, run_tasks, seeded_gfid,
};
use crate::mount::KilnMount;
use crate::plot::{self, BarChart};
use crate::progress::Progress;
use crate::report::{Record, Reporter, histogram, nanos};
use crate::scratch::{Scratch, fs_type};

/// What to run.
#[derive(Debug, Clone)]
pub struct SmallfileBench {
    pub ops: Vec<Op>,
    pub targets: Vec<TargetSpec>,
    /// Workers at once: OS threads on the syscall targets, tasks on the others.
    pub threads: usize,
    /// Files per thread.
    pub files: usize,
    pub file_bytes: usize,
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

/// One smallfile operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Op {
    Create,
    Read,
    Append,
    Stat,
    Chmod,
    Rename,
    Delete,
    Mkdir,
    Rmdir,
    Readdir,
    LsL,
    Setxattr,
    Getxattr,
}

impl Op {
    /// The default sequence: each op's precondition is left by the ones before it.
    pub const SEQUENCE: [Op; 13] = [
        Op::Create,
        Op::Stat,
        Op::Read,
        Op::Append,
        Op::Chmod,
        Op::Setxattr,
        Op::Getxattr,
        Op::LsL,
        Op::Readdir,
        Op::Rename,
        Op::Delete,
        Op::Mkdir,
        Op::Rmdir,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Op::Create => "create",
            Op::Read => "read",
            Op::Append => "append",
            Op::Stat => "stat",
            Op::Chmod => "chmod",
            Op::Rename => "rename",
            Op::Delete => "delete",
            Op::Mkdir => "mkdir",
            Op::Rmdir => "rmdir",
            Op::Readdir => "readdir",
            Op::LsL => "ls-l",
            Op::Setxattr => "setxattr",
            Op::Getxattr => "getxattr",
        }
    }

    /// Listing ops go directory by directory; the others file by file.
    fn per_directory(self) -> bool {
        matches!(self, Op::Readdir | Op::LsL)
    }
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
/// The extended attribute set and read back, and its value's size.
const XATTR_NAME: &str = "user.kiln-bench";
const XATTR_VALUE_BYTES: usize = 64;
/// The mode chmod sets.
const CHMOD_MODE: u32 = 0o640;
/// Bytes asked for per READDIR/READDIRP.
const READDIR_CHUNK_BYTES: u32 = 64 * 1024;
/// The suffix rename adds (and a second rename takes away).
const RENAMED_SUFFIX: &str = ".renamed";
/// How long the in-process server gets to drain at the end.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// One step of the plan: an op and what the files look like when it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    pub op: Op,
    /// False for a step that only sets up a later op's precondition (or cleans up).
    pub measured: bool,
    /// The files carry the renamed name when the step starts.
    renamed: bool,
    /// Every file's size when the step starts.
    size: usize,
}

/// The steps that run `ops` in order, with unmeasured set-up steps where an op's
/// precondition is missing and clean-up steps at the end.
pub fn plan(ops: &[Op], file_bytes: usize) -> Vec<Step> {
    let mut steps = Vec::new();
    let (mut files, mut renamed, mut xattr, mut size, mut dirs) = (false, false, false, 0, false);
    let mut push = |op, measured, renamed, size| {
        steps.push(Step {
            op,
            measured,
            renamed,
            size,
        });
    };
    for &op in ops {
        match op {
            Op::Create | Op::Delete => {}
            Op::Mkdir if dirs => push(Op::Rmdir, false, renamed, size),
            Op::Rmdir if !dirs => push(Op::Mkdir, false, renamed, size),
            Op::Mkdir | Op::Rmdir => {}
            _ if !files => {
                push(Op::Create, false, false, 0);
                (files, renamed, xattr, size) = (true, false, false, file_bytes);
            }
            _ => {}
        }
        match op {
            Op::Create if files => push(Op::Delete, false, renamed, size),
            Op::Delete if !files => {
                push(Op::Create, false, false, 0);
                (files, renamed, xattr, size) = (true, false, false, file_bytes);
            }
            Op::Getxattr if !xattr => push(Op::Setxattr, false, renamed, size),
            _ => {}
        }
        push(op, true, renamed, size);
        match op {
            Op::Create => (files, renamed, xattr, size) = (true, false, false, file_bytes),
            Op::Delete => (files, xattr) = (false, false),
            Op::Append => size += file_bytes,
            Op::Rename => renamed = !renamed,
            Op::Setxattr | Op::Getxattr => xattr = true,
            Op::Mkdir => dirs = true,
            Op::Rmdir => dirs = false,
            _ => {}
        }
    }
    if files {
        push(Op::Delete, false, renamed, size);
    }
    if dirs {
        push(Op::Rmdir, false, renamed, size);
    }
    steps
}

/// Where everything is, the same on every target.
#[derive(Debug, Clone)]
struct Layout {
    files: usize,
    fanout: usize,
    file_bytes: usize,
    seed: u64,
}

/// What a GFID is for (its stream of the seed).
#[derive(Debug, Clone, Copy)]
enum Kind {
    Top = 1,
    FileDir = 2,
    File = 3,
    MkdirDir = 4,
    Mkdir = 5,
}

impl Layout {
    /// Directories of files per thread (and of mkdir's directories).
    fn dirs(&self) -> usize {
        self.files.div_ceil(self.fanout).max(1)
    }

    fn files_in(&self, k: usize) -> usize {
        self.fanout.min(self.files - k * self.fanout)
    }

    fn top(t: usize) -> String {
        format!("t{t:03}")
    }

    fn dir(k: usize) -> String {
        format!("d{k:05}")
    }

    fn mkdir_dir(k: usize) -> String {
        format!("m{k:05}")
    }

    fn file(i: usize, renamed: bool) -> String {
        match renamed {
            false => format!("f{i:07}"),
            true => format!("f{i:07}{RENAMED_SUFFIX}"),
        }
    }

    fn subdir(i: usize) -> String {
        format!("s{i:07}")
    }

    /// The GFID of object `i` of `kind` in thread `t`, from the seed.
    fn gfid(&self, kind: Kind, t: usize, i: usize) -> Gfid {
        seeded_gfid(self.seed, (kind as u64) << 56 | (t as u64) << 32 | i as u64)
    }
}

/// One measured (or set-up) pass of an op over every thread's files.
#[derive(Debug)]
struct Pass {
    elapsed: Duration,
    latency: Histogram<u64>,
}

/// A target being measured.
trait Runner {
    fn run(&mut self, step: &Step) -> anyhow::Result<Pass>;
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
    let layout = Layout {
        files,
        fanout,
        file_bytes: bench.file_bytes,
        seed: bench.seed,
    };
    let steps = plan(&bench.ops, bench.file_bytes);
    let describe = |s: &Step| match s.measured {
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
            "fanout": fanout, "dirs_per_thread": layout.dirs(), "fsync": bench.fsync,
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
            let index = rates.len();
            r.ratio = rate / reference.get(index).copied().unwrap_or(rate);
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
    if !bench.plots.is_empty() {
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
    }
    Ok(records)
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
        TargetSpec::Local => Box::new(Syscalls::start(
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
            Box::new(Syscalls::start(base, layout, threads, bench.fsync, None)?)
        }
        TargetSpec::KilnMount => {
            let dir = fresh("kiln-mount")?;
            let mount = KilnMount::start(&dir, &bench.mount_options)?;
            let base = mount.path().to_owned();
            Box::new(Syscalls::start(
                base,
                layout,
                threads,
                bench.fsync,
                Some(mount),
            )?)
        }
        TargetSpec::Engine => Box::new(Fops::start_engine(
            &fresh("engine")?.join("brick"),
            config,
            layout,
            threads,
            bench.fsync,
        )?),
        TargetSpec::Volume => Box::new(Fops::start_volume(
            &fresh("volume")?,
            config,
            scratch,
            layout,
            threads,
            bench.fsync,
        )?),
    })
}

/// Runs `job(t)` on `threads` OS threads released together; returns their results and the
/// time from the first one's start to the last one's end. Each thread reads the clock
/// itself: on 2 cores the thread that released them may not run again until they are done.
fn run_threads<T: Send>(
    threads: usize,
    job: impl Fn(usize) -> anyhow::Result<T> + Sync,
) -> anyhow::Result<(Vec<T>, Duration)> {
    let barrier = Barrier::new(threads);
    let ran = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (barrier, job) = (&barrier, &job);
                s.spawn(move || {
                    barrier.wait();
                    let start = Instant::now();
                    let result = job(t);
                    (start, Instant::now(), result)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| anyhow::anyhow!("a worker thread panicked"))
            })
            .collect::<anyhow::Result<Vec<_>>>()
    })?;
    let first = ran.iter().map(|r| r.0).min();
    let last = ran.iter().map(|r| r.1).max();
    let elapsed = match (first, last) {
        (Some(first), Some(last)) => last - first,
        _ => Duration::ZERO,
    };
    let results = ran
        .into_iter()
        .map(|r| r.2)
        .collect::<anyhow::Result<Vec<T>>>()?;
    Ok((results, elapsed))
}

fn merge(histograms: Vec<Histogram<u64>>) -> anyhow::Result<Histogram<u64>> {
    let mut all = histogram()?;
    for h in histograms {
        all.add(&h)?;
    }
    Ok(all)
}

/// The syscall targets: `local`, `path=DIR` and `kiln-mount`.
struct Syscalls {
    base: PathBuf,
    layout: Layout,
    threads: usize,
    fsync: bool,
    data: Vec<u8>,
    xattr: Vec<u8>,
    mount: Option<KilnMount>,
    /// The type of the file system under `base`.
    fs: String,
}

impl Syscalls {
    fn start(
        base: PathBuf,
        layout: &Layout,
        threads: usize,
        fsync: bool,
        mount: Option<KilnMount>,
    ) -> anyhow::Result<Syscalls> {
        for t in 0..threads {
            let top = base.join(Layout::top(t));
            for k in 0..layout.dirs() {
                for dir in [Layout::dir(k), Layout::mkdir_dir(k)] {
                    let path = top.join(dir);
                    std::fs::create_dir_all(&path)
                        .with_context(|| format!("cannot create {}", path.display()))?;
                }
            }
        }
        Ok(Syscalls {
            fs: fs_type(&base),
            base,
            layout: layout.clone(),
            threads,
            fsync,
            data: vec![0x5a; layout.file_bytes],
            xattr: vec![0xa5; XATTR_VALUE_BYTES],
            mount,
        })
    }

    /// `step` on thread `t`'s files, one at a time.
    fn thread(&self, t: usize, step: &Step) -> anyhow::Result<Histogram<u64>> {
        let top = self.base.join(Layout::top(t));
        let mut h = histogram()?;
        let mut buf = Vec::with_capacity(step.size + 1);
        let fanout = self.layout.fanout;
        if step.op.per_directory() {
            for k in 0..self.layout.dirs() {
                let start = Instant::now();
                let entries = self.list(&top.join(Layout::dir(k)), step.op == Op::LsL)?;
                h.record(nanos(start.elapsed()))?;
                let want = self.layout.files_in(k);
                if entries != want {
                    bail!("directory {k} of thread {t}: {entries} entries, not {want}");
                }
            }
            return Ok(h);
        }
        for i in 0..self.layout.files {
            let dir = top.join(Layout::dir(i / fanout));
            let path = dir.join(Layout::file(i, step.renamed));
            let start = Instant::now();
            self.file_op(step, i, &dir, &path, &mut buf)
                .with_context(|| format!("{}", path.display()))?;
            h.record(nanos(start.elapsed()))?;
        }
        Ok(h)
    }

    fn file_op(
        &self,
        step: &Step,
        i: usize,
        dir: &Path,
        path: &Path,
        buf: &mut Vec<u8>,
    ) -> anyhow::Result<()> {
        match step.op {
            Op::Create => {
                let mut f = std::fs::File::options()
                    .write(true)
                    .create_new(true)
                    .open(path)?;
                f.write_all(&self.data)?;
                if self.fsync {
                    f.sync_all()?;
                }
            }
            Op::Read => {
                buf.clear();
                let n = std::fs::File::open(path)?.read_to_end(buf)?;
                if n != step.size {
                    bail!("read {n} bytes, not {}", step.size);
                }
            }
            Op::Append => {
                let mut f = std::fs::File::options().append(true).open(path)?;
                f.write_all(&self.data)?;
                if self.fsync {
                    f.sync_all()?;
                }
            }
            Op::Stat => {
                std::fs::symlink_metadata(path)?;
            }
            Op::Chmod => {
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(CHMOD_MODE))?;
            }
            Op::Setxattr => rustix::fs::lsetxattr(
                path,
                XATTR_NAME,
                &self.xattr,
                rustix::fs::XattrFlags::empty(),
            )?,
            Op::Getxattr => {
                let mut value = [0u8; XATTR_VALUE_BYTES + 1];
                let n = rustix::fs::lgetxattr(path, XATTR_NAME, &mut value[..])?;
                if n != XATTR_VALUE_BYTES {
                    bail!("{XATTR_NAME} has {n} bytes, not {XATTR_VALUE_BYTES}");
                }
            }
            Op::Rename => std::fs::rename(path, dir.join(Layout::file(i, !step.renamed)))?,
            Op::Delete => std::fs::remove_file(path)?,
            Op::Mkdir | Op::Rmdir => {
                let sub = dir
                    .with_file_name(Layout::mkdir_dir(i / self.layout.fanout))
                    .join(Layout::subdir(i));
                match step.op {
                    Op::Mkdir => std::fs::create_dir(sub)?,
                    _ => std::fs::remove_dir(sub)?,
                }
            }
            Op::Readdir | Op::LsL => unreachable!("listed per directory"),
        }
        Ok(())
    }

    /// Lists `dir` (and `lstat`s every entry for `ls -l`); returns the entry count.
    fn list(&self, dir: &Path, stat_each: bool) -> anyhow::Result<usize> {
        let mut entries = 0;
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            if stat_each {
                std::fs::symlink_metadata(entry.path())?;
            }
            entries += 1;
        }
        Ok(entries)
    }
}

impl Runner for Syscalls {
    fn run(&mut self, step: &Step) -> anyhow::Result<Pass> {
        let (histograms, elapsed) = run_threads(self.threads, |t| self.thread(t, step))?;
        Ok(Pass {
            elapsed,
            latency: merge(histograms)?,
        })
    }

    fn finish(self: Box<Self>) -> anyhow::Result<serde_json::Value> {
        let Syscalls {
            base, mount, fs, ..
        } = *self;
        match mount {
            Some(mount) => {
                std::fs::remove_dir_all(&base)
                    .or_else(|_| empty_dir(&base))
                    .with_context(|| format!("cannot empty {}", base.display()))?;
                let stopped = mount.finish()?;
                Ok(json!({ "target": "kiln-mount", "fs": fs, "stopped": stopped }))
            }
            None => {
                std::fs::remove_dir_all(&base)
                    .with_context(|| format!("cannot remove {}", base.display()))?;
                Ok(json!({ "dir": base.display().to_string(), "fs": fs, "removed": true }))
            }
        }
    }
}

/// Removes everything inside `dir` (a mount point, which itself stays).
fn empty_dir(dir: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        match path.is_dir() {
            true => std::fs::remove_dir_all(&path)?,
            false => std::fs::remove_file(&path)?,
        }
    }
    Ok(())
}

/// The fop targets: the engine called directly, or a client over QUIC.
struct Fops {
    rt: tokio::runtime::Runtime,
    engine: Engine,
    /// The brick (kept open until the end).
    _brick: Arc<Brick>,
    /// Over QUIC: the server and the connected client.
    served: Option<(Server, BrickClient)>,
    layout: Arc<Layout>,
    threads: usize,
    fsync: bool,
    data: Bytes,
}

impl Fops {
    fn start_engine(
        brick_dir: &Path,
        config: &EngineConfig,
        layout: &Layout,
        threads: usize,
        fsync: bool,
    ) -> anyhow::Result<Fops> {
        Brick::format(brick_dir)?;
        let (brick, engine) = open_engine(brick_dir, config)?;
        Fops::new(
            client_runtime()?,
            engine,
            brick,
            None,
            layout,
            threads,
            fsync,
        )
    }

    fn start_volume(
        dir: &Path,
        config: &EngineConfig,
        scratch: &Scratch,
        layout: &Layout,
        threads: usize,
        fsync: bool,
    ) -> anyhow::Result<Fops> {
        let served = Served::start(&dir.join("brick"), &scratch.path(), config, 0)?;
        // The client's connection is driven by the runtime it was made on: every later call
        // runs on the same one.
        let rt = client_runtime()?;
        let (server, volume) = rt.block_on(served.serve_and_connect(UDP_PAYLOAD_MAX_BYTES))?;
        let Served { brick, engine, .. } = served;
        Fops::new(
            rt,
            engine,
            brick,
            Some((server, volume)),
            layout,
            threads,
            fsync,
        )
    }

    fn new(
        rt: tokio::runtime::Runtime,
        engine: Engine,
        brick: Arc<Brick>,
        served: Option<(Server, BrickClient)>,
        layout: &Layout,
        threads: usize,
        fsync: bool,
    ) -> anyhow::Result<Fops> {
        let fops = Fops {
            rt,
            engine,
            _brick: brick,
            served,
            layout: Arc::new(layout.clone()),
            threads,
            fsync,
            data: Bytes::from(vec![0x5a; layout.file_bytes]),
        };
        let layout = fops.layout.clone();
        fops.tasks(move |t, caller| {
            let layout = layout.clone();
            async move { make_dirs(&caller, &layout, t).await }
        })?;
        Ok(fops)
    }

    fn tasks<T, F, Fut>(&self, job: F) -> anyhow::Result<Vec<T>>
    where
        T: Send + 'static,
        F: Fn(usize, Caller) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = anyhow::Result<T>> + 'static,
    {
        let destination = match &self.served {
            Some((_, volume)) => Destination::Volume(volume),
            None => Destination::Engine(&self.engine),
        };
        run_tasks(&self.rt, destination, self.threads, job)
    }
}

fn client_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

fn mode(bits: u32) -> anyhow::Result<Mode> {
    Mode::new(bits).context("mode bits")
}

fn name(s: String) -> anyhow::Result<Name> {
    Ok(Name::new(s)?)
}

/// Thread `t`'s top directory, its file directories and its mkdir directories.
async fn make_dirs(caller: &Caller, layout: &Layout, t: usize) -> anyhow::Result<()> {
    let mkdir = |parent, name: String, gfid| -> anyhow::Result<FopRequest> {
        Ok(Mkdir {
            parent,
            name: Name::new(name)?,
            gfid,
            mode: mode(0o755)?,
            umask: mode(0)?,
        }
        .into())
    };
    let top = layout.gfid(Kind::Top, t, 0);
    caller.call(mkdir(Gfid::ROOT, Layout::top(t), top)?).await?;
    for k in 0..layout.dirs() {
        let dir = mkdir(top, Layout::dir(k), layout.gfid(Kind::FileDir, t, k))?;
        caller.call(dir).await?;
        let dir = mkdir(top, Layout::mkdir_dir(k), layout.gfid(Kind::MkdirDir, t, k))?;
        caller.call(dir).await?;
    }
    Ok(())
}

/// What one fop task needs (cheap to clone into every task).
#[derive(Debug, Clone)]
struct FopJob {
    layout: Arc<Layout>,
    step: Step,
    fsync: bool,
    data: Bytes,
}

impl FopJob {
    /// `step` on thread `t`'s files, one at a time.
    async fn thread(&self, caller: &Caller, t: usize) -> anyhow::Result<Histogram<u64>> {
        let layout = &self.layout;
        let mut h = histogram()?;
        if self.step.op.per_directory() {
            for k in 0..layout.dirs() {
                let dir = layout.gfid(Kind::FileDir, t, k);
                let start = Instant::now();
                let entries = list(caller, dir, self.step.op == Op::LsL).await?;
                h.record(nanos(start.elapsed()))?;
                let want = layout.files_in(k);
                if entries != want {
                    bail!("directory {k} of thread {t}: {entries} entries, not {want}");
                }
            }
            return Ok(h);
        }
        for i in 0..layout.files {
            let start = Instant::now();
            self.file_op(caller, t, i)
                .await
                .with_context(|| format!("file {i} of thread {t}"))?;
            h.record(nanos(start.elapsed()))?;
        }
        Ok(h)
    }

    async fn file_op(&self, caller: &Caller, t: usize, i: usize) -> anyhow::Result<()> {
        let (layout, step) = (&self.layout, &self.step);
        let parent = layout.gfid(Kind::FileDir, t, i / layout.fanout);
        let gfid = layout.gfid(Kind::File, t, i);
        let file_name = || name(Layout::file(i, step.renamed));
        match step.op {
            Op::Create => {
                let put = Put {
                    parent,
                    name: file_name()?,
                    gfid,
                    mode: mode(0o644)?,
                    umask: mode(0)?,
                    // O_SYNC: the write is on stable storage when the PUT returns, as a
                    // write + fsync is.
                    flags: match self.fsync {
                        true => OpenFlags::SYNC,
                        false => OpenFlags::empty(),
                    },
                    data: Payload::new(self.data.clone())?,
                    attr: SetAttr::default(),
                };
                caller.call(put).await?;
            }
            Op::Read => {
                let fd = open(caller, gfid, AccessMode::ReadOnly, OpenFlags::empty()).await?;
                let mut got = 0;
                let result = async {
                    loop {
                        let want = (step.size + 1 - got).min(IO_SIZE_MAX_BYTES);
                        let size = ReadSize::saturating(want as u64);
                        let offset = got as u64;
                        match caller.call(Read { fd, offset, size }).await? {
                            FopReply::Read(r) if r.data.is_empty() => return Ok(()),
                            FopReply::Read(r) => got += r.data.len(),
                            other => bail!("READ answered {:?}", other.code()),
                        }
                    }
                }
                .await;
                caller.call(Release { fd }).await?;
                result?;
                if got != step.size {
                    bail!("read {got} bytes, not {}", step.size);
                }
            }
            Op::Append => {
                let fd = open(caller, gfid, AccessMode::WriteOnly, OpenFlags::APPEND).await?;
                let data = Payload::new(self.data.clone())?;
                let offset = step.size as u64;
                let written = caller.call(Write { fd, offset, data }).await;
                let synced = match (written.is_ok(), self.fsync) {
                    (true, true) => caller
                        .call(Fsync {
                            fd,
                            datasync: false,
                        })
                        .await
                        .map(drop),
                    _ => Ok(()),
                };
                caller.call(Release { fd }).await?;
                written?;
                synced?;
            }
            Op::Stat => {
                let name = file_name()?;
                caller.call(Lookup { parent, name }).await?;
            }
            Op::Chmod => {
                let attr = SetAttr {
                    mode: Some(mode(CHMOD_MODE)?),
                    ..SetAttr::default()
                };
                caller.call(Setattr { gfid, attr }).await?;
            }
            Op::Setxattr => {
                let set = Setxattr {
                    gfid,
                    name: XattrName::new(XATTR_NAME)?,
                    value: XattrValue::new(vec![0xa5; XATTR_VALUE_BYTES])?,
                    mode: XattrSetMode::Upsert,
                };
                caller.call(set).await?;
            }
            Op::Getxattr => {
                let get = Getxattr {
                    gfid,
                    name: XattrName::new(XATTR_NAME)?,
                };
                match caller.call(get).await? {
                    FopReply::Getxattr(r) if r.value.len() == XATTR_VALUE_BYTES => {}
                    other => bail!("GETXATTR answered {other:?}"),
                }
            }
            Op::Rename => {
                let rename = Rename {
                    old_parent: parent,
                    old_name: file_name()?,
                    new_parent: parent,
                    new_name: name(Layout::file(i, !step.renamed))?,
                    mode: RenameMode::Replace,
                };
                caller.call(rename).await?;
            }
            Op::Delete => {
                let name = file_name()?;
                caller.call(Unlink { parent, name }).await?;
            }
            Op::Mkdir | Op::Rmdir => {
                let parent = layout.gfid(Kind::MkdirDir, t, i / layout.fanout);
                let name = name(Layout::subdir(i))?;
                match step.op {
                    Op::Mkdir => {
                        let gfid = layout.gfid(Kind::Mkdir, t, i);
                        let (mode, umask) = (mode(0o755)?, mode(0)?);
                        let mkdir = Mkdir {
                            parent,
                            name,
                            gfid,
                            mode,
                            umask,
                        };
                        caller.call(mkdir).await?;
                    }
                    _ => drop(caller.call(Rmdir { parent, name }).await?),
                }
            }
            Op::Readdir | Op::LsL => unreachable!("listed per directory"),
        }
        Ok(())
    }
}

async fn open(
    caller: &Caller,
    gfid: Gfid,
    access: AccessMode,
    flags: OpenFlags,
) -> anyhow::Result<FdId> {
    match caller
        .call(Open {
            gfid,
            access,
            flags,
        })
        .await?
    {
        FopReply::Open(o) => Ok(o.fd),
        other => bail!("OPEN answered {:?}", other.code()),
    }
}

/// Lists directory `gfid` with READDIRP (`plus`, the attributes too: `ls -l`) or READDIR;
/// returns the entry count without `.` and `..`.
async fn list(caller: &Caller, gfid: Gfid, plus: bool) -> anyhow::Result<usize> {
    let fd = match caller.call(Opendir { gfid }).await? {
        FopReply::Opendir(o) => o.fd,
        other => bail!("OPENDIR answered {:?}", other.code()),
    };
    let size = ReaddirSize::new(READDIR_CHUNK_BYTES).context("readdir size")?;
    let counted = async {
        let (mut offset, mut entries) = (0, 0);
        loop {
            let (eof, names): (bool, Vec<(u64, Name)>) = match plus {
                true => match caller.call(Readdirp { fd, offset, size }).await? {
                    FopReply::Readdirp(r) => {
                        let names = r.entries.into_iter().map(|e| (e.offset, e.name));
                        (r.eof, names.collect())
                    }
                    other => bail!("READDIRP answered {:?}", other.code()),
                },
                false => match caller.call(Readdir { fd, offset, size }).await? {
                    FopReply::Readdir(r) => {
                        let names = r.entries.into_iter().map(|e| (e.offset, e.name));
                        (r.eof, names.collect())
                    }
                    other => bail!("READDIR answered {:?}", other.code()),
                },
            };
            for (next, name) in &names {
                offset = *next;
                if !matches!(name.as_bytes(), b"." | b"..") {
                    entries += 1;
                }
            }
            if eof || names.is_empty() {
                return Ok(entries);
            }
        }
    }
    .await;
    caller.call(Releasedir { fd }).await?;
    counted
}

impl Runner for Fops {
    fn run(&mut self, step: &Step) -> anyhow::Result<Pass> {
        let job = FopJob {
            layout: self.layout.clone(),
            step: *step,
            fsync: self.fsync,
            data: self.data.clone(),
        };
        let start = Instant::now();
        let histograms = self.tasks(move |t, caller| {
            let job = job.clone();
            async move { job.thread(&caller, t).await }
        })?;
        let elapsed = start.elapsed();
        Ok(Pass {
            elapsed,
            latency: merge(histograms)?,
        })
    }

    fn finish(self: Box<Self>) -> anyhow::Result<serde_json::Value> {
        let Fops {
            rt, engine, served, ..
        } = *self;
        let note = json!({
            "target": match served { Some(_) => "volume", None => "engine" },
            "engine": engine.kind().name(), "engine_workers": engine.workers(),
        });
        if let Some((server, volume)) = served {
            rt.block_on(async {
                volume.close().await;
                server.shutdown(SHUTDOWN_GRACE).await;
            });
        }
        Ok(note)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ops(plan: &[Step]) -> Vec<String> {
        plan.iter()
            .map(|s| match s.measured {
                true => s.op.name().to_owned(),
                false => format!("({})", s.op.name()),
            })
            .collect()
    }

    #[test]
    fn the_default_sequence_needs_no_set_up_and_cleans_nothing_up() {
        let steps = plan(&Op::SEQUENCE, 10);
        assert!(steps.iter().all(|s| s.measured), "{:?}", ops(&steps));
        assert_eq!(steps.len(), Op::SEQUENCE.len());
        let at = |op| steps.iter().find(|s| s.op == op).expect("op in plan");
        assert_eq!(at(Op::Read).size, 10);
        assert_eq!(at(Op::Getxattr).size, 20, "after one append");
        assert!(!at(Op::Rename).renamed && at(Op::Delete).renamed);
    }

    #[test]
    fn missing_preconditions_are_set_up_unmeasured() {
        assert_eq!(ops(&plan(&[Op::Read], 4)), ["(create)", "read", "(delete)"]);
        assert_eq!(
            ops(&plan(&[Op::Getxattr, Op::Rmdir], 4)),
            [
                "(create)",
                "(setxattr)",
                "getxattr",
                "(mkdir)",
                "rmdir",
                "(delete)"
            ]
        );
        assert_eq!(
            ops(&plan(&[Op::Create, Op::Create, Op::Mkdir], 4)),
            [
                "create", "(delete)", "create", "mkdir", "(delete)", "(rmdir)"
            ]
        );
        assert_eq!(ops(&plan(&[Op::Delete], 4)), ["(create)", "delete"]);
        let twice = plan(&[Op::Rename, Op::Rename, Op::Stat], 4);
        let renamed: Vec<bool> = twice.iter().map(|s| s.renamed).collect();
        assert_eq!(renamed, [false, false, true, false, false]);
    }

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

    #[test]
    fn layout_spreads_files_over_directories() {
        let layout = Layout {
            files: 25,
            fanout: 10,
            file_bytes: 1,
            seed: 1,
        };
        assert_eq!(layout.dirs(), 3);
        assert_eq!(
            (0..3).map(|k| layout.files_in(k)).collect::<Vec<_>>(),
            [10, 10, 5]
        );
        assert_ne!(layout.gfid(Kind::File, 0, 1), layout.gfid(Kind::File, 1, 0));
        assert_eq!(layout.gfid(Kind::Top, 2, 0), layout.gfid(Kind::Top, 2, 0));
    }
}
