//! `kiln-bench mount`: a tree of many small files put through the commands people run on a
//! file system — untar, `find`, `ls -lR`, read everything, `rm -rf` — on the local directory,
//! a passthrough FUSE mount (`bindfs`, the FUSE floor), the Kiln mount and, where it is set
//! up, a GlusterFS FUSE mount, all on the scratch disk in one run.
//!
//! The tree: by default Debian's `linux-source` tarball (`/usr/src/linux-source-*.tar.*`)
//! when it is installed, decompressed once into a plain tar; otherwise (or with `--files` /
//! `--dirs`) a generated tree of the same shape, made from one seed: `dirs` directories
//! nested as a random recursive tree biased toward the top (depth ~4–12), `files` files
//! spread evenly over them (~16 a directory by default) with log-normal sizes (median 4 KiB,
//! σ = 1.3, at most 1 MiB: mean ~9.5 KiB, ~0.75 GiB for 80 000 files), packed once with
//! `tar -cf`. The `tree` note gives the counts `tar -tvf` finds in the tarball.
//!
//! Phases, each an external command on `DIR` (a fresh `t/` in the target's directory),
//! timed from spawn to exit:
//!
//! * `mount.untar` — `tar -xf tree.tar -C DIR` (as root tar also restores owners and mtimes).
//! * `mount.stat` — `find DIR -printf '%s\n'`: an `lstat` of every entry; the lines are
//!   counted and must equal the tarball's entries.
//! * `mount.ls_lR` — `ls -lR DIR > /dev/null` (`lstat` and, for the ACL mark, xattrs).
//! * `mount.read` — `tar -cf - DIR`, its output read and counted by kiln-bench (GNU tar
//!   does not read files when writing to /dev/null); the stream must hold at least every
//!   file byte.
//! * `mount.rm` — `rm -rf DIR`.
//!
//! Before every phase the scratch file system and the mount are synced (`syncfs`) and, as
//! root, the kernel's page, dentry and inode caches are dropped (`/proc/sys/vm/drop_caches`),
//! so every phase starts cold on every target (a FUSE server's own caches are not dropped).
//! `--keep-caches` skips that; the `mount` note says which was done. Nothing is fsynced:
//! `untar` ends when tar exits, with the data in the page cache behind each target.
//!
//! Results: `seconds` is in `params`; `ops_per_s` is files per second; `mib_per_s` is the
//! tar stream's MiB per second (untar, read). `ratio` = reference seconds ÷ this target's
//! seconds, so above 1 is faster. Every target has a row against `local`; `kiln` and
//! `glusterfs` have a second one against `bindfs` (their FUSE floor). At the end a
//! `mount_summary` note per phase gives every target's seconds and Kiln's slowdown against
//! both references, and a `mount_goal` note the untar goal: Kiln within 2× of bindfs.
//!
//! Targets (`--targets`, default every one; one that cannot run is skipped with a
//! `skipped` note):
//!
//! * `local` — a directory in the scratch directory.
//! * `bindfs` — `bindfs -f [-o BINDFS_OPTIONS] SRC MNT`, SRC in the scratch directory;
//!   needs the `bindfs` package (kiln-bench never installs anything).
//! * `kiln` — a fresh brick in the scratch directory served by `kiln-brickd serve` on
//!   `127.0.0.1:0` (mutual TLS material from `kiln_admin::pki`), mounted by
//!   `kiln mount ADDR MNT -f [-o MOUNT_OPTIONS]`; `kiln` and `kiln-brickd` are taken from
//!   beside kiln-bench. Unmounted with `kiln umount`; the mount's server and the brick must
//!   then exit 0, or the run fails.
//! * `glusterfs` — `glusterfs -N --volfile-server=SERVER --volfile-id=VOLUME MNT` of a volume
//!   named by `--glusterfs-volume SERVER:/VOLUME` (a single-brick volume on this disk, set up
//!   beforehand: kiln-bench does not run glusterd). Skipped without it.
//!
//! Every wait is bounded. SIGINT, SIGTERM or SIGHUP stop the run between two polls (a
//! running phase command is killed); every mount is unmounted and every process stopped on
//! the way out, error or not (guards; a mount that will not go is detached lazily).

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader, Read as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kiln_admin::pki::{self, Role};
use rustix::process::Signal;
use serde_json::json;

use crate::process::{log_tail, pid_of, wait_exit};
use crate::report::{Record, Reporter};
use crate::rng::Rng;
use crate::scratch::{Scratch, drop_caches, sync_file_systems};

/// What to run.
#[derive(Debug, Clone)]
pub struct MountBench {
    pub tree: TreeSource,
    /// Targets asked for, in any order; measured local, bindfs, kiln, glusterfs.
    pub targets: Vec<Target>,
    /// `-o` options of `kiln mount` (e.g. `writeback-cache=on`).
    pub mount_options: Vec<String>,
    /// `-o` options of `bindfs`.
    pub bindfs_options: Vec<String>,
    /// `SERVER:/VOLUME` of an existing GlusterFS volume to mount.
    pub glusterfs_volume: Option<String>,
    /// Sync and drop the kernel's caches before every phase (as root).
    pub drop_caches: bool,
    /// Longest run of one phase's command.
    pub phase_timeout: Duration,
}

/// Where the tree comes from.
#[derive(Debug, Clone)]
pub enum TreeSource {
    Generated(TreeShape),
    /// A (possibly compressed) tarball, such as Debian's `linux-source`.
    Tarball(PathBuf),
}

/// A generated tree.
#[derive(Debug, Clone, Copy)]
pub struct TreeShape {
    pub files: usize,
    /// Directories, the top one included.
    pub dirs: usize,
    pub seed: u64,
}

/// A file system the phases run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Target {
    Local,
    Bindfs,
    Kiln,
    Glusterfs,
}

impl Target {
    pub const ALL: [Target; 4] = [
        Target::Local,
        Target::Bindfs,
        Target::Kiln,
        Target::Glusterfs,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Target::Local => "local",
            Target::Bindfs => "bindfs",
            Target::Kiln => "kiln",
            Target::Glusterfs => "glusterfs",
        }
    }
}

/// Files in the default generated tree (about the Linux kernel source's count).
pub const DEFAULT_FILES: usize = 80_000;
/// Directories in the default generated tree.
pub const DEFAULT_DIRS: usize = 5_000;
/// The default seed of the generated tree.
pub const DEFAULT_SEED: u64 = 0x6b69_6c6e;
/// Where Debian's `linux-source` package puts its tarball.
const LINUX_SOURCE_DIR: &str = "/usr/src";
/// Median size of a generated file.
const FILE_BYTES_MEDIAN: f64 = 4096.0;
/// σ of the log-normal sizes (the tail: ~1 file in 100 above 80 KiB).
const FILE_BYTES_SIGMA: f64 = 1.3;
/// Largest generated file.
const FILE_BYTES_MAX: usize = 1 << 20;
/// The generated tree's top directory, inside the tarball.
const TREE_TOP: &str = "tree";
/// The directory each target's phases work in (`DIR`).
const WORK_DIR: &str = "t";
/// Name of the client and brick certificates of the Kiln target.
const CLIENT_NAME: &str = "admin";
const BRICK_NAME: &str = "b";
/// Longest preparation step (generating, packing or decompressing the tree).
const PREPARE_TIMEOUT: Duration = Duration::from_secs(3600);
/// Longest short command (format, umount, version).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a mount may take to appear, and its server to exit after the unmount.
const MOUNT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long `kiln-brickd` may take to print its address.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a server may take to stop after SIGTERM (the brick drains for up to 10 s).
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a process may take to go after SIGKILL.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause between polls of a mount table or the stop flag.
const POLL_INTERVAL: Duration = Duration::from_millis(20);
/// Longest single wait on a child before the stop flag is looked at again.
const WAIT_SLICE: Duration = Duration::from_millis(100);
/// Buffer for reading a phase's output.
const READ_BUFFER_BYTES: usize = 1 << 20;

/// Set once SIGINT, SIGTERM or SIGHUP arrived: the run stops at its next poll.
static STOP: AtomicBool = AtomicBool::new(false);

fn stopping() -> bool {
    STOP.load(Ordering::Relaxed)
}

fn check_stop() -> anyhow::Result<()> {
    if stopping() {
        bail!("interrupted by a signal; cleaning up");
    }
    Ok(())
}

/// Resolves `--files`, `--dirs` and `--linux-source` (`auto`, `off` or a path): an explicit
/// size or `off` generates a tree; `auto` takes the installed `linux-source` tarball if there
/// is one.
pub fn tree_source(
    files: Option<usize>,
    dirs: Option<usize>,
    seed: u64,
    linux_source: &str,
) -> anyhow::Result<TreeSource> {
    let generated = TreeSource::Generated(TreeShape {
        files: files.unwrap_or(DEFAULT_FILES),
        dirs: dirs.unwrap_or(DEFAULT_DIRS).max(1),
        seed,
    });
    let sized = files.is_some() || dirs.is_some();
    match linux_source {
        "off" | "no" => Ok(generated),
        "auto" if sized => Ok(generated),
        "auto" => Ok(linux_source_tarball().map_or(generated, TreeSource::Tarball)),
        path if sized => {
            bail!("--linux-source {path} and --files/--dirs: choose a tarball or a generated tree")
        }
        path => {
            let path = PathBuf::from(path);
            if !path.is_file() {
                bail!("--linux-source {}: no such file", path.display());
            }
            Ok(TreeSource::Tarball(path))
        }
    }
}

/// The newest `/usr/src/linux-source-*.tar.*`, if Debian's `linux-source` is installed.
pub fn linux_source_tarball() -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(LINUX_SOURCE_DIR)
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("linux-source-") && n.contains(".tar"))
                && p.is_file()
        })
        .collect();
    found.sort();
    found.pop()
}

/// One measured phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    Untar,
    Stat,
    Ls,
    Read,
    Rm,
}

impl Phase {
    const ALL: [Phase; 5] = [Phase::Untar, Phase::Stat, Phase::Ls, Phase::Read, Phase::Rm];

    fn workload(self) -> &'static str {
        match self {
            Phase::Untar => "mount.untar",
            Phase::Stat => "mount.stat",
            Phase::Ls => "mount.ls_lR",
            Phase::Read => "mount.read",
            Phase::Rm => "mount.rm",
        }
    }

    fn name(self) -> &'static str {
        self.workload().trim_start_matches("mount.")
    }

    /// What runs, for the set-up note.
    fn command_line(self) -> &'static str {
        match self {
            Phase::Untar => "tar -xf tree.tar -C DIR",
            Phase::Stat => "find DIR -printf '%s\\n' (lines counted)",
            Phase::Ls => "ls -lR DIR > /dev/null",
            Phase::Read => "tar -cf - DIR (stream read and counted by kiln-bench)",
            Phase::Rm => "rm -rf DIR",
        }
    }
}

/// The tarball every target extracts, and what is in it.
#[derive(Debug)]
struct Tree {
    tarball: PathBuf,
    tar_bytes: u64,
    files: u64,
    dirs: u64,
    /// Bytes of the regular files.
    file_bytes: u64,
}

/// Runs the whole benchmark, printing records as they are measured.
pub fn run(
    bench: &MountBench,
    scratch: &Scratch,
    out: &mut Reporter,
) -> anyhow::Result<Vec<Record>> {
    watch_signals()?;
    let root = scratch.path().join("mount");
    std::fs::create_dir_all(&root).with_context(|| format!("cannot create {}", root.display()))?;
    // Mount tables list canonical paths.
    let root = root.canonicalize()?;
    let logs = root.join("logs");
    std::fs::create_dir(&logs)?;

    let mut targets = Vec::new();
    for target in Target::ALL {
        if !bench.targets.contains(&target) {
            continue;
        }
        match available(bench, target) {
            Ok(()) => targets.push(target),
            Err(why) => out.note("skipped", &json!({ "target": target.name(), "why": why })),
        }
    }

    let tree = prepare_tree(bench, &root, &logs, out)?;
    let caches = Caches::new(bench.drop_caches);
    out.note(
        "mount",
        &json!({
            "targets": targets.iter().map(|t| t.name()).collect::<Vec<_>>(),
            "phases": Phase::ALL.iter().map(|p| json!({ p.name(): p.command_line() })).collect::<Vec<_>>(),
            "caches": caches.describe(),
            "kiln_mount_options": bench.mount_options.join(","),
            "bindfs_options": bench.bindfs_options.join(","),
            "ratio": "reference seconds / target seconds (above 1 = faster); seconds in params",
        }),
    );

    let mut records = Vec::new();
    let mut seconds: BTreeMap<(Phase, Target), f64> = BTreeMap::new();
    let mut caches = caches;
    for target in targets {
        check_stop()?;
        let place = Place::start(bench, target, &root, &logs)?;
        out.note("mount_target", &place.describe());
        for phase in Phase::ALL {
            check_stop()?;
            caches.drop_before(&[&root, &place.base], out);
            let measured = run_phase(phase, &place.base, &tree, &logs, target, bench)?;
            seconds.insert((phase, target), measured.seconds);
            for r in phase_records(phase, target, &tree, &measured, &seconds) {
                out.print(&r);
                records.push(r);
            }
        }
        let stopped = place.finish()?;
        out.note("mount_stop", &stopped);
    }
    summarize(&seconds, out);
    Ok(records)
}

/// Why `target` cannot run here, if it cannot.
fn available(bench: &MountBench, target: Target) -> Result<(), String> {
    let fuse = || match Path::new("/dev/fuse").exists() {
        true => Ok(()),
        false => Err("/dev/fuse is missing (no FUSE in this kernel or container)".to_owned()),
    };
    match target {
        Target::Local => Ok(()),
        Target::Bindfs => {
            which("bindfs").ok_or("bindfs is not installed (Debian package `bindfs`)")?;
            fuse()
        }
        Target::Kiln => {
            Bins::beside_this_executable().map_err(|e| format!("{e:#}"))?;
            fuse()
        }
        Target::Glusterfs => {
            let Some(glusterfs) = which("glusterfs") else {
                return Err("GlusterFS is not installed (no `glusterfs` on PATH)".to_owned());
            };
            if bench.glusterfs_volume.is_none() {
                return Err(format!(
                    "{} found, but no --glusterfs-volume SERVER:/VOLUME (a single-brick volume on \
                     this disk): kiln-bench mounts a volume, it does not set up glusterd",
                    glusterfs.display()
                ));
            }
            fuse()
        }
    }
}

/// An executable on PATH.
fn which(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Makes `root/tree.tar` (generated, or the linux-source tarball decompressed) and counts it.
fn prepare_tree(
    bench: &MountBench,
    root: &Path,
    logs: &Path,
    out: &mut Reporter,
) -> anyhow::Result<Tree> {
    let tarball = root.join("tree.tar");
    let start = Instant::now();
    let source = match &bench.tree {
        TreeSource::Generated(shape) => {
            let gen_dir = root.join("gen");
            generate(*shape, &gen_dir)?;
            let mut tar = Command::new("tar");
            tar.arg("-cf")
                .arg(&tarball)
                .arg("-C")
                .arg(&gen_dir)
                .arg(TREE_TOP);
            run_bounded(&mut tar, None, &logs.join("prepare.log"), PREPARE_TIMEOUT)?;
            std::fs::remove_dir_all(&gen_dir)
                .with_context(|| format!("cannot remove {}", gen_dir.display()))?;
            json!({ "generated": { "files": shape.files, "dirs": shape.dirs, "seed": shape.seed,
                    "size": format!("log-normal, median {FILE_BYTES_MEDIAN} B, sigma {FILE_BYTES_SIGMA}, at most {FILE_BYTES_MAX} B") } })
        }
        TreeSource::Tarball(path) => {
            decompress(path, &tarball, logs)?;
            json!({ "tarball": path.display().to_string() })
        }
    };
    let prepared_s = start.elapsed().as_secs_f64();
    let tree = count_tarball(&tarball)?;
    out.note(
        "tree",
        &json!({
            "source": source,
            "files": tree.files,
            "dirs": tree.dirs,
            "file_bytes": tree.file_bytes,
            "tar_bytes": tree.tar_bytes,
            "prepared_s": round(prepared_s),
        }),
    );
    Ok(tree)
}

/// A generated file's size: log-normal around the median, capped.
fn file_size(rng: &mut Rng) -> usize {
    let size = FILE_BYTES_MEDIAN * (FILE_BYTES_SIGMA * rng.normal()).exp();
    (size.round() as usize).min(FILE_BYTES_MAX)
}

/// Source-like endings, so names look like a source tree.
const EXTENSIONS: [&str; 6] = [".c", ".h", ".c", ".h", ".S", ".txt"];

/// Writes the generated tree under `dir/tree`: directory `i` hangs under one of the
/// directories before it (chosen as `i·u²`, so near the top), files land in random
/// directories. Every choice comes from `shape.seed`.
fn generate(shape: TreeShape, dir: &Path) -> anyhow::Result<()> {
    let mut rng = Rng::new(shape.seed);
    let dirs = shape.dirs.max(1);
    let mut paths: Vec<PathBuf> = Vec::with_capacity(dirs);
    let top = dir.join(TREE_TOP);
    std::fs::create_dir_all(&top).with_context(|| format!("cannot create {}", top.display()))?;
    paths.push(top);
    for i in 1..dirs {
        let u = rng.unit();
        let parent = ((i as f64) * u * u) as usize;
        let path = paths[parent.min(i - 1)].join(format!("d{i:04}"));
        std::fs::create_dir(&path).with_context(|| format!("cannot create {}", path.display()))?;
        paths.push(path);
    }
    // Text to cut files from: words and newlines.
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz_(){};=     \n";
    let text: Vec<u8> = (0..2 * FILE_BYTES_MAX)
        .map(|_| ALPHABET[rng.below(ALPHABET.len())])
        .collect();
    for j in 0..shape.files {
        if j % 1024 == 0 {
            check_stop()?;
        }
        let d = rng.below(dirs);
        let size = file_size(&mut rng);
        let offset = rng.below(text.len() - size + 1);
        let path = paths[d].join(format!("f{j:06}{}", EXTENSIONS[j % EXTENSIONS.len()]));
        std::fs::write(&path, &text[offset..offset + size])
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// Decompresses `src` (by its extension) into the plain tar `dst`.
fn decompress(src: &Path, dst: &Path, logs: &Path) -> anyhow::Result<()> {
    let name = src.to_string_lossy();
    let tool = [
        (".xz", "xz"),
        (".bz2", "bzip2"),
        (".gz", "gzip"),
        (".zst", "zstd"),
    ]
    .into_iter()
    .find(|(ext, _)| name.ends_with(ext))
    .map(|(_, tool)| tool);
    match tool {
        None => {
            std::fs::copy(src, dst)
                .with_context(|| format!("cannot copy {} to {}", src.display(), dst.display()))?;
        }
        Some(tool) => {
            let file = std::fs::File::create(dst)
                .with_context(|| format!("cannot create {}", dst.display()))?;
            let mut cmd = Command::new(tool);
            cmd.arg("-dc").arg(src);
            run_bounded(
                &mut cmd,
                Some(file),
                &logs.join("prepare.log"),
                PREPARE_TIMEOUT,
            )?;
        }
    }
    Ok(())
}

/// Counts the entries of `tarball` from `tar -tvf`: directories, everything else as files
/// (regular files, links), and the bytes of the regular files.
fn count_tarball(tarball: &Path) -> anyhow::Result<Tree> {
    let listing = Command::new("tar")
        .arg("-tvf")
        .arg(tarball)
        .env("LC_ALL", "C")
        .stdin(Stdio::null())
        .output()
        .context("cannot run tar -tvf")?;
    if !listing.status.success() {
        bail!(
            "tar -tvf {}: {}",
            tarball.display(),
            String::from_utf8_lossy(&listing.stderr).trim()
        );
    }
    let (mut files, mut dirs, mut file_bytes) = (0u64, 0u64, 0u64);
    for line in String::from_utf8_lossy(&listing.stdout).lines() {
        // `-rw-r--r-- root/root 1234 2024-01-01 12:00 path`
        let mut fields = line.split_whitespace();
        let (Some(mode), Some(size)) = (fields.next(), fields.nth(1)) else {
            continue;
        };
        match mode.as_bytes().first() {
            Some(b'd') => dirs += 1,
            Some(b'-') => {
                files += 1;
                file_bytes += size.parse::<u64>().unwrap_or(0);
            }
            Some(_) => files += 1,
            None => {}
        }
    }
    if files + dirs == 0 {
        bail!("{} holds no entries", tarball.display());
    }
    Ok(Tree {
        tar_bytes: std::fs::metadata(tarball)?.len(),
        tarball: tarball.to_owned(),
        files,
        dirs,
        file_bytes,
    })
}

/// Syncing and dropping the kernel's caches before a phase.
#[derive(Debug)]
struct Caches {
    drop: bool,
    /// Why dropping failed, once it did (then it is not tried again).
    failed: Option<String>,
}

impl Caches {
    fn new(drop: bool) -> Caches {
        let failed = match (drop, rustix::process::geteuid().is_root()) {
            (true, false) => Some("not root".to_owned()),
            _ => None,
        };
        Caches { drop, failed }
    }

    fn describe(&self) -> String {
        match (self.drop, &self.failed) {
            (false, _) => "kept (--keep-caches): phases after the untar may start warm".into(),
            (true, Some(why)) => {
                format!("not dropped ({why}): phases after the untar may start warm")
            }
            (true, None) => {
                "syncfs, then echo 3 > /proc/sys/vm/drop_caches before every phase".into()
            }
        }
    }

    /// Syncs the file systems of `paths` and, if asked and allowed, drops the caches.
    fn drop_before(&mut self, paths: &[&Path], out: &mut Reporter) {
        sync_file_systems(paths);
        if !self.drop || self.failed.is_some() {
            return;
        }
        if let Err(e) = drop_caches() {
            self.failed = Some(e.to_string());
            out.note("caches", &json!(self.describe()));
        }
    }
}

/// A phase's time and what its output held.
#[derive(Debug)]
struct Measured {
    seconds: f64,
    /// Bytes of the tar stream (untar: the tarball's, read: what tar wrote).
    stream_bytes: Option<u64>,
}

/// What a phase's standard output is used for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sink {
    Null,
    CountLines,
    CountBytes,
}

/// Runs `phase` on `base/t`, checks what it saw, and returns its time.
fn run_phase(
    phase: Phase,
    base: &Path,
    tree: &Tree,
    logs: &Path,
    target: Target,
    bench: &MountBench,
) -> anyhow::Result<Measured> {
    let dir = base.join(WORK_DIR);
    let mut cmd;
    let sink;
    match phase {
        Phase::Untar => {
            std::fs::create_dir(&dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            cmd = Command::new("tar");
            cmd.arg("-xf").arg(&tree.tarball).arg("-C").arg(&dir);
            sink = Sink::Null;
        }
        Phase::Stat => {
            cmd = Command::new("find");
            cmd.arg(&dir).arg("-printf").arg("%s\\n");
            sink = Sink::CountLines;
        }
        Phase::Ls => {
            cmd = Command::new("ls");
            cmd.arg("-lR").arg(&dir);
            sink = Sink::Null;
        }
        Phase::Read => {
            cmd = Command::new("tar");
            cmd.arg("-cf").arg("-").arg("-C").arg(base).arg(WORK_DIR);
            sink = Sink::CountBytes;
        }
        Phase::Rm => {
            cmd = Command::new("rm");
            cmd.arg("-rf").arg(&dir);
            sink = Sink::Null;
        }
    }
    cmd.env("LC_ALL", "C");
    let log = logs.join(format!("{}-{}.log", target.name(), phase.name()));
    let (elapsed, count) = timed(&mut cmd, sink, &log, bench.phase_timeout)
        .with_context(|| format!("{} on {}", phase.workload(), target.name()))?;
    let seconds = elapsed.as_secs_f64();
    match phase {
        Phase::Stat => {
            // `find` prints DIR itself too.
            let want = tree.files + tree.dirs + 1;
            if count != want {
                bail!(
                    "{} on {}: find saw {count} entries, the tarball has {want} (with DIR)",
                    phase.workload(),
                    target.name()
                );
            }
        }
        Phase::Read if count < tree.file_bytes => bail!(
            "{} on {}: tar read {count} bytes, fewer than the {} bytes of the files",
            phase.workload(),
            target.name(),
            tree.file_bytes
        ),
        Phase::Rm if dir.exists() => bail!(
            "{} on {}: {} is still there after rm -rf",
            phase.workload(),
            target.name(),
            dir.display()
        ),
        _ => {}
    }
    Ok(Measured {
        seconds,
        stream_bytes: match phase {
            Phase::Untar => Some(tree.tar_bytes),
            Phase::Read => Some(count),
            _ => None,
        },
    })
}

/// Runs `cmd` to its end, bounded by `timeout` and the stop flag; standard error goes to
/// `log`. Returns the time from spawn to exit (and the end of its output) and the count
/// `sink` asks for.
fn timed(
    cmd: &mut Command,
    sink: Sink,
    log: &Path,
    timeout: Duration,
) -> anyhow::Result<(Duration, u64)> {
    let log_file =
        std::fs::File::create(log).with_context(|| format!("cannot create {}", log.display()))?;
    cmd.stdin(Stdio::null()).stderr(log_file);
    cmd.stdout(match sink {
        Sink::Null => Stdio::null(),
        Sink::CountLines | Sink::CountBytes => Stdio::piped(),
    });
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot run {:?}", cmd.get_program()))?;
    // The output is read on a thread of its own so this one can watch the clock and the stop
    // flag (and kill the command, which ends the output).
    let reader = child.stdout.take().map(|mut stdout| {
        std::thread::spawn(move || -> std::io::Result<u64> {
            let mut buf = vec![0u8; READ_BUFFER_BYTES];
            let mut count = 0u64;
            loop {
                match stdout.read(&mut buf) {
                    Ok(0) => return Ok(count),
                    Ok(n) => {
                        count += match sink {
                            Sink::CountLines => {
                                buf[..n].iter().filter(|&&b| b == b'\n').count() as u64
                            }
                            _ => n as u64,
                        };
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
        })
    });
    let status = wait_child(&mut child, timeout, true);
    let count = match reader {
        Some(r) => r
            .join()
            .map_err(|_| anyhow::anyhow!("the output reader panicked"))??,
        None => 0,
    };
    let elapsed = start.elapsed();
    let status = status.with_context(|| format!("{cmd:?}"))?;
    if !status.success() {
        interrupted(status)?;
        bail!("{cmd:?} failed ({status}):\n{}", log_tail(log));
    }
    Ok((elapsed, count))
}

/// Runs a preparation or housekeeping command to its end, its output into `stdout` (or
/// nowhere) and its errors appended to `log`.
fn run_bounded(
    cmd: &mut Command,
    stdout: Option<std::fs::File>,
    log: &Path,
    timeout: Duration,
) -> anyhow::Result<()> {
    let log_file = std::fs::File::options()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("cannot open {}", log.display()))?;
    cmd.stdin(Stdio::null())
        .stdout(stdout.map_or_else(Stdio::null, Stdio::from))
        .stderr(log_file)
        .env("LC_ALL", "C");
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot run {:?}", cmd.get_program()))?;
    let status = wait_child(&mut child, timeout, true).with_context(|| format!("{cmd:?}"))?;
    if !status.success() {
        interrupted(status)?;
        bail!("{cmd:?} failed ({status}):\n{}", log_tail(log));
    }
    Ok(())
}

/// Waits for `child` to exit and reaps it; kills it after `timeout` (or once the stop flag is
/// set, with `honour_stop`) and fails.
fn wait_child(
    child: &mut Child,
    timeout: Duration,
    honour_stop: bool,
) -> anyhow::Result<ExitStatus> {
    if wait_exit(child, timeout, || honour_stop && stopping())? {
        return Ok(child.wait()?);
    }
    let _ = child.kill();
    let _ = wait_exit(child, KILL_TIMEOUT, || false);
    let _ = child.try_wait();
    check_stop()?;
    bail!("did not finish within {timeout:?}; killed")
}

/// Fails as interrupted if `status` is a command's death by the signal that is stopping this
/// run: one sent to the whole process group (Ctrl-C, `timeout`) reaches the command too,
/// maybe a moment before the watcher thread sets the flag.
fn interrupted(status: ExitStatus) -> anyhow::Result<()> {
    use std::os::unix::process::ExitStatusExt;
    let by_stop_signal = status
        .signal()
        .is_some_and(|s| [libc::SIGINT, libc::SIGTERM, libc::SIGHUP].contains(&s));
    if by_stop_signal {
        std::thread::sleep(WAIT_SLICE);
    }
    check_stop()
}

/// Sets the stop flag on SIGINT, SIGTERM or SIGHUP, from a thread of its own, so a run cut
/// short (Ctrl-C, `timeout`) still unmounts and stops what it started.
fn watch_signals() -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Registered before this returns, so no signal slips through before the thread runs.
    let (mut term, mut int, mut hup) = rt.block_on(async {
        anyhow::Ok((
            signal(SignalKind::terminate())?,
            signal(SignalKind::interrupt())?,
            signal(SignalKind::hangup())?,
        ))
    })?;
    std::thread::Builder::new()
        .name("kiln-bench-signals".into())
        .spawn(move || {
            rt.block_on(async {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                    _ = hup.recv() => {}
                }
            });
            STOP.store(true, Ordering::Relaxed);
        })?;
    Ok(())
}

/// The executables the Kiln target runs, from beside kiln-bench.
#[derive(Debug)]
struct Bins {
    kiln: PathBuf,
    brickd: PathBuf,
}

impl Bins {
    fn beside_this_executable() -> anyhow::Result<Bins> {
        let exe = std::env::current_exe().context("cannot find the kiln-bench executable")?;
        let find = |name: &str| {
            let path = exe.with_file_name(name);
            if !path.is_file() {
                bail!(
                    "{} is missing: the kiln target runs the kiln and kiln-brickd built beside \
                     kiln-bench; build them with `cargo build --release --bins` (or `cargo build \
                     --bins` for a debug kiln-bench)",
                    path.display()
                );
            }
            Ok(path)
        };
        Ok(Bins {
            kiln: find("kiln")?,
            brickd: find("kiln-brickd")?,
        })
    }
}

/// A server process, stopped (SIGTERM, bounded wait, SIGKILL) when dropped.
#[derive(Debug)]
struct Daemon {
    name: &'static str,
    child: Option<Child>,
    log: PathBuf,
}

impl Daemon {
    fn spawn(name: &'static str, cmd: &mut Command, log: &Path) -> anyhow::Result<Daemon> {
        let log_file = std::fs::File::options()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("cannot open {}", log.display()))?;
        let child = cmd
            .stdin(Stdio::null())
            .stderr(log_file)
            .spawn()
            .with_context(|| format!("cannot run {name}"))?;
        Ok(Daemon {
            name,
            child: Some(child),
            log: log.to_owned(),
        })
    }

    /// Its exit status if it has exited.
    fn exited(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Waits (bounded) for it to exit by itself; its status, or None if it did not.
    fn wait(&mut self, timeout: Duration) -> anyhow::Result<Option<ExitStatus>> {
        let Some(child) = self.child.as_mut() else {
            bail!("{} is not running", self.name);
        };
        if !wait_exit(child, timeout, || false)? {
            return Ok(None);
        }
        let status = child.wait()?;
        self.child = None;
        Ok(Some(status))
    }

    /// SIGTERM, a bounded wait, then SIGKILL. Returns its status and whether it was killed.
    fn stop(&mut self) -> anyhow::Result<(Option<ExitStatus>, bool)> {
        let Some(child) = self.child.as_mut() else {
            bail!("{} is not running", self.name);
        };
        if let Ok(Some(status)) = child.try_wait() {
            self.child = None;
            return Ok((Some(status), false));
        }
        let _ = rustix::process::kill_process(pid_of(child)?, Signal::TERM);
        if let Some(status) = self.wait(STOP_TIMEOUT)? {
            return Ok((Some(status), false));
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = wait_exit(&child, KILL_TIMEOUT, || false);
            let _ = child.try_wait();
        }
        Ok((None, true))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.stop();
        }
    }
}

/// Whether a file system of type `fstype` is mounted exactly on `point` (canonical).
fn is_mounted(point: &Path, fstype: &str) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let want = escape_mountinfo(point);
    info.lines().any(|line| {
        let Some((left, right)) = line.split_once(" - ") else {
            return false;
        };
        left.split(' ').nth(4) == Some(want.as_str()) && right.split(' ').next() == Some(fstype)
    })
}

/// A path as mountinfo writes it: space, tab, newline and backslash as `\ooo`.
fn escape_mountinfo(path: &Path) -> String {
    let mut out = String::new();
    for c in path.to_string_lossy().chars() {
        match c {
            ' ' | '\t' | '\n' | '\\' => out.push_str(&format!("\\{:03o}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// A FUSE mount served by a foreground process: unmounted (lazily if need be) and its
/// server stopped when dropped.
#[derive(Debug)]
struct FuseMount {
    point: PathBuf,
    fstype: &'static str,
    server: Daemon,
    /// The command that unmounts it (`kiln umount`), or None for umount(2).
    unmount_cmd: Option<Command>,
}

impl FuseMount {
    /// Waits (bounded) until the mount is there; fails if its server exits first.
    fn wait_mounted(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + MOUNT_TIMEOUT;
        while !is_mounted(&self.point, self.fstype) {
            check_stop()?;
            if let Some(status) = self.server.exited() {
                bail!(
                    "{} exited ({status}) before mounting {}:\n{}",
                    self.server.name,
                    self.point.display(),
                    log_tail(&self.server.log)
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "no {} mount on {} after {MOUNT_TIMEOUT:?}:\n{}",
                    self.fstype,
                    self.point.display(),
                    log_tail(&self.server.log)
                );
            }
            std::thread::sleep(POLL_INTERVAL);
        }
        Ok(())
    }

    /// Unmounts, then waits for the server to exit by itself; fails unless it exits 0.
    fn finish(&mut self) -> anyhow::Result<serde_json::Value> {
        let start = Instant::now();
        match self.unmount_cmd.as_mut() {
            Some(cmd) => {
                let log = self.server.log.clone();
                run_bounded(cmd, None, &log, COMMAND_TIMEOUT)
                    .with_context(|| format!("unmounting {}", self.point.display()))?;
            }
            None => rustix::mount::unmount(&self.point, rustix::mount::UnmountFlags::empty())
                .with_context(|| format!("cannot unmount {}", self.point.display()))?,
        }
        let status = self.server.wait(MOUNT_TIMEOUT)?;
        let Some(status) = status else {
            bail!(
                "{} did not exit within {MOUNT_TIMEOUT:?} of the unmount:\n{}",
                self.server.name,
                log_tail(&self.server.log)
            );
        };
        // GlusterFS's FUSE client ends itself with status 15 (its SIGTERM path) on every
        // unmount, clean or not.
        let glusterfs_done = self.fstype == "fuse.glusterfs" && status.code() == Some(15);
        if !status.success() && !glusterfs_done {
            bail!(
                "{} exited {status} after the unmount:\n{}",
                self.server.name,
                log_tail(&self.server.log)
            );
        }
        Ok(
            json!({ "server": self.server.name, "status": status.to_string(),
                   "ms": start.elapsed().as_millis() }),
        )
    }
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        if is_mounted(&self.point, self.fstype) {
            // Something failed: detach it now (it ends when nothing holds it), then the
            // server's guard stops the server.
            let _ = rustix::mount::unmount(&self.point, rustix::mount::UnmountFlags::DETACH);
        }
    }
}

/// A target ready for the phases: the directory they work in, and what serves it.
#[derive(Debug)]
struct Place {
    target: Target,
    /// The directory `t/` is made in.
    base: PathBuf,
    /// The mount (dropped before `brickd`: fields drop in order).
    mount: Option<FuseMount>,
    /// The Kiln target's brick server.
    brickd: Option<Daemon>,
    detail: serde_json::Value,
}

impl Place {
    fn start(
        bench: &MountBench,
        target: Target,
        root: &Path,
        logs: &Path,
    ) -> anyhow::Result<Place> {
        let dir = root.join(target.name());
        std::fs::create_dir(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let mut place = Place {
            target,
            base: dir.clone(),
            mount: None,
            brickd: None,
            detail: json!({}),
        };
        match target {
            Target::Local => {}
            Target::Bindfs => {
                let (src, mnt) = (dir.join("src"), dir.join("mnt"));
                std::fs::create_dir(&src)?;
                std::fs::create_dir(&mnt)?;
                let mut cmd = Command::new("bindfs");
                cmd.arg("-f");
                if !bench.bindfs_options.is_empty() {
                    cmd.arg("-o").arg(bench.bindfs_options.join(","));
                }
                cmd.arg(&src).arg(&mnt).stdout(Stdio::null());
                let server = Daemon::spawn("bindfs", &mut cmd, &logs.join("bindfs.log"))?;
                let mount = place.mount.insert(FuseMount {
                    point: mnt.clone(),
                    fstype: "fuse",
                    server,
                    unmount_cmd: None,
                });
                mount.wait_mounted()?;
                place.base = mnt;
                place.detail = json!({ "bindfs": version("bindfs"), "options": bench.bindfs_options.join(","),
                                       "backing": src.display().to_string() });
            }
            Target::Kiln => place.start_kiln(&bench.mount_options, &dir, logs)?,
            Target::Glusterfs => {
                let volume = bench.glusterfs_volume.as_deref().unwrap_or_default();
                let (server, volume_id) = volume.split_once(":/").with_context(|| {
                    format!("--glusterfs-volume {volume}: expected SERVER:/VOLUME")
                })?;
                let mnt = dir.join("mnt");
                std::fs::create_dir(&mnt)?;
                let mut cmd = Command::new("glusterfs");
                cmd.arg("-N")
                    .arg(format!("--volfile-server={server}"))
                    .arg(format!("--volfile-id={volume_id}"))
                    .arg(format!(
                        "--log-file={}",
                        logs.join("glusterfs-client.log").display()
                    ))
                    .arg(&mnt)
                    .stdout(Stdio::null());
                let daemon = Daemon::spawn("glusterfs", &mut cmd, &logs.join("glusterfs.log"))?;
                let mount = place.mount.insert(FuseMount {
                    point: mnt.clone(),
                    fstype: "fuse.glusterfs",
                    server: daemon,
                    unmount_cmd: None,
                });
                mount.wait_mounted()?;
                // The volume may hold other things: work in a fresh directory of its own.
                let base = mnt.join(format!("kiln-bench-{}", std::process::id()));
                std::fs::create_dir(&base)
                    .with_context(|| format!("cannot create {}", base.display()))?;
                place.base = base;
                place.detail = json!({ "glusterfs": version("glusterfs"), "volume": volume });
            }
        }
        Ok(place)
    }

    /// A fresh brick, `kiln-brickd serve` on loopback, and `kiln mount -f` of it.
    fn start_kiln(
        &mut self,
        mount_options: &[String],
        dir: &Path,
        logs: &Path,
    ) -> anyhow::Result<()> {
        let bins = Bins::beside_this_executable()?;
        let tls = dir.join("tls");
        pki::init_ca(&tls).context("cluster CA")?;
        let brick_role = Role::Brick {
            hosts: vec!["127.0.0.1".into(), "localhost".into()],
        };
        pki::issue(&tls, &brick_role, BRICK_NAME, 1).context("brick certificate")?;
        pki::issue(&tls, &Role::Client, CLIENT_NAME, 1).context("client certificate")?;
        let brick = dir.join("brick");
        std::fs::create_dir(&brick)?;
        let brick_log = logs.join("kiln-brickd.log");
        run_bounded(
            Command::new(&bins.brickd).arg("format").arg(&brick),
            None,
            &brick_log,
            COMMAND_TIMEOUT,
        )?;

        let mut cmd = Command::new(&bins.brickd);
        cmd.arg("serve")
            .arg(&brick)
            .args(["--listen", "127.0.0.1:0", "--name", BRICK_NAME, "--tls-dir"])
            .arg(&tls)
            .stdout(Stdio::piped());
        let mut brickd = Daemon::spawn("kiln-brickd", &mut cmd, &brick_log)?;
        let stdout = brickd
            .child
            .as_mut()
            .and_then(|c| c.stdout.take())
            .context("no pipe from kiln-brickd")?;
        // The first line is the address; the rest of its output is drained (there is none
        // so far) so the brick never blocks on a full pipe.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let _ = tx.send(lines.next().and_then(Result::ok));
            for _ in lines {}
        });
        let deadline = Instant::now() + LISTEN_TIMEOUT;
        let line = loop {
            check_stop()?;
            match rx.recv_timeout(WAIT_SLICE) {
                Ok(line) => break line.unwrap_or_default(),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) if Instant::now() < deadline => {}
                Err(_) => break String::new(),
            }
        };
        let addr = line.trim().strip_prefix("listening on ").with_context(|| {
            format!(
                "kiln-brickd did not start ({line:?}):\n{}",
                log_tail(&brick_log)
            )
        })?;
        let addr: std::net::SocketAddr = addr.parse().context("kiln-brickd's address")?;
        self.brickd = Some(brickd);

        let mnt = dir.join("mnt");
        std::fs::create_dir(&mnt)?;
        let mut cmd = Command::new(&bins.kiln);
        cmd.arg("--tls-dir")
            .arg(&tls)
            .args(["--client", CLIENT_NAME, "mount"])
            .arg(addr.to_string())
            .arg(&mnt)
            .arg("-f");
        for option in mount_options {
            cmd.arg("-o").arg(option);
        }
        cmd.stdout(Stdio::null());
        let server = Daemon::spawn("kiln mount", &mut cmd, &logs.join("kiln-mount.log"))?;
        let mut unmount = Command::new(&bins.kiln);
        unmount.arg("umount").arg(&mnt);
        let mount = self.mount.insert(FuseMount {
            point: mnt.clone(),
            fstype: "fuse.kiln",
            server,
            unmount_cmd: Some(unmount),
        });
        mount.wait_mounted()?;
        self.base = mnt;
        self.detail = json!({
            "brick": brick.display().to_string(),
            "brickd": addr.to_string(),
            "mount_options": mount_options.join(","),
            "binaries": bins.kiln.parent().map(|p| p.display().to_string()),
        });
        Ok(())
    }

    fn describe(&self) -> serde_json::Value {
        json!({ "target": self.target.name(), "dir": self.base.display().to_string(),
                "detail": self.detail })
    }

    /// Unmounts and stops everything; fails unless every server exited 0.
    fn finish(mut self) -> anyhow::Result<serde_json::Value> {
        let mut note = json!({ "target": self.target.name() });
        if self.target == Target::Glusterfs {
            // Remove the work directory (empty after rm) before the unmount.
            let _ = std::fs::remove_dir(&self.base);
        }
        if let Some(mount) = self.mount.as_mut() {
            note["unmount"] = mount.finish()?;
        }
        if let Some(brickd) = self.brickd.as_mut() {
            let (status, killed) = brickd.stop()?;
            note["brickd"] = json!({ "status": status.map(|s| s.to_string()), "sigkill": killed });
            if killed || !status.is_some_and(|s| s.success()) {
                bail!(
                    "kiln-brickd did not stop cleanly on SIGTERM (status {status:?}, SIGKILL \
                     needed: {killed}):\n{}",
                    log_tail(&brickd.log)
                );
            }
        }
        Ok(note)
    }
}

/// A Kiln FUSE mount of a fresh brick for the other workloads (`smallfile --targets
/// kiln-mount`): `kiln-brickd serve` and `kiln mount -f` started exactly as the `kiln` target
/// here starts them, logs in `DIR/logs`. [`KilnMount::finish`] unmounts it and stops both,
/// failing unless they exit cleanly; dropping it unmounts and stops them anyway.
#[derive(Debug)]
pub struct KilnMount {
    place: Place,
}

impl KilnMount {
    pub fn start(dir: &Path, mount_options: &[String]) -> anyhow::Result<KilnMount> {
        if !Path::new("/dev/fuse").exists() {
            bail!("/dev/fuse is missing (no FUSE in this kernel or container)");
        }
        // Mount tables list canonical paths.
        let dir = dir.canonicalize()?;
        let logs = dir.join("logs");
        std::fs::create_dir_all(&logs)?;
        let mut place = Place {
            target: Target::Kiln,
            base: dir.clone(),
            mount: None,
            brickd: None,
            detail: json!({}),
        };
        place.start_kiln(mount_options, &dir, &logs)?;
        Ok(KilnMount { place })
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        &self.place.base
    }

    /// Unmounts, stops the servers and says how they ended.
    pub fn finish(self) -> anyhow::Result<serde_json::Value> {
        let detail = self.place.detail.clone();
        let mut note = self.place.finish()?;
        note["detail"] = detail;
        Ok(note)
    }
}

/// The first line of `NAME --version`.
fn version(name: &str) -> String {
    Command::new(name)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .ok()
        .map(|o| {
            let text = [o.stdout, o.stderr].concat();
            String::from_utf8_lossy(&text)
                .lines()
                .next()
                .unwrap_or_default()
                .trim()
                .to_owned()
        })
        .unwrap_or_default()
}

/// `x` to 0.1 ms.
fn round(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

/// The references a target is compared with: local, and bindfs for the other FUSE mounts.
fn references(target: Target) -> &'static [Target] {
    match target {
        Target::Local | Target::Bindfs => &[Target::Local],
        Target::Kiln | Target::Glusterfs => &[Target::Local, Target::Bindfs],
    }
}

/// The rows of one measured phase: one per reference that was measured (a target with none
/// is its own reference).
fn phase_records(
    phase: Phase,
    target: Target,
    tree: &Tree,
    measured: &Measured,
    seconds: &BTreeMap<(Phase, Target), f64>,
) -> Vec<Record> {
    let secs = measured.seconds.max(1e-9);
    let row = |reference: Target, ratio: f64| {
        let params =
            json!({ "files": tree.files, "dirs": tree.dirs, "seconds": round(measured.seconds) });
        let mut r = Record::new(phase.workload(), target.name(), params, reference.name());
        r.ops_per_s = Some(tree.files as f64 / secs);
        r.mib_per_s = measured
            .stream_bytes
            .map(|b| b as f64 / (1u64 << 20) as f64 / secs);
        r.ratio = ratio;
        r
    };
    let rows: Vec<Record> = references(target)
        .iter()
        .filter_map(|&reference| {
            let ref_secs = match reference == target {
                true => measured.seconds,
                false => *seconds.get(&(phase, reference))?,
            };
            Some(row(reference, ref_secs / secs))
        })
        .collect();
    match rows.is_empty() {
        true => vec![row(target, 1.0)],
        false => rows,
    }
}

/// One note per phase with every target's seconds and the slowdowns against the references,
/// and the untar goal.
fn summarize(seconds: &BTreeMap<(Phase, Target), f64>, out: &mut Reporter) {
    for phase in Phase::ALL {
        let of = |t: Target| seconds.get(&(phase, t)).copied();
        let mut note = serde_json::Map::new();
        note.insert("phase".into(), json!(phase.name()));
        for target in Target::ALL {
            if let Some(s) = of(target) {
                note.insert(format!("{}_s", target.name()), json!(round(s)));
            }
        }
        for target in [Target::Bindfs, Target::Kiln, Target::Glusterfs] {
            for &reference in references(target) {
                if let (Some(t), Some(r)) = (of(target), of(reference))
                    && reference != target
                {
                    note.insert(
                        format!("{}_over_{}", target.name(), reference.name()),
                        json!((t / r.max(1e-9) * 100.0).round() / 100.0),
                    );
                }
            }
        }
        if note.len() > 1 {
            out.note("mount_summary", &serde_json::Value::Object(note));
        }
    }
    let untar = |t: Target| seconds.get(&(Phase::Untar, t)).copied();
    if let (Some(kiln), Some(bindfs)) = (untar(Target::Kiln), untar(Target::Bindfs)) {
        let over = kiln / bindfs.max(1e-9);
        out.note(
            "mount_goal",
            &json!({
                "goal": "untar on the Kiln mount within 2x of the bindfs passthrough",
                "kiln_over_bindfs": (over * 100.0).round() / 100.0,
                "met": over <= 2.0,
            }),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_sizes_have_the_asked_median_and_a_tail() {
        let mut rng = Rng::new(DEFAULT_SEED);
        let mut sizes: Vec<usize> = (0..20_000).map(|_| file_size(&mut rng)).collect();
        sizes.sort_unstable();
        let median = sizes[sizes.len() / 2];
        assert!((3500..4700).contains(&median), "median {median}");
        assert!(sizes[sizes.len() * 99 / 100] > 50_000, "no tail");
        assert!(sizes.iter().all(|&s| s <= FILE_BYTES_MAX));
    }

    #[test]
    fn mountinfo_paths_are_escaped() {
        assert_eq!(escape_mountinfo(Path::new("/a b\\c")), "/a\\040b\\134c");
        assert_eq!(escape_mountinfo(Path::new("/plain")), "/plain");
    }

    #[test]
    fn sizes_or_off_generate_and_a_missing_path_fails() {
        let t = tree_source(Some(10), None, 1, "auto").expect("sized");
        assert!(matches!(t, TreeSource::Generated(s) if s.files == 10 && s.dirs == DEFAULT_DIRS));
        assert!(matches!(
            tree_source(None, None, 1, "off").expect("off"),
            TreeSource::Generated(_)
        ));
        assert!(tree_source(None, None, 1, "/nonexistent/linux.tar.xz").is_err());
        assert!(tree_source(Some(1), None, 1, "/nonexistent/linux.tar.xz").is_err());
    }
}
