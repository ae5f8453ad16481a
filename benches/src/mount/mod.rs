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
//! * `mount.untar` — `tar -xf tree.tar -C DIR && sync DIR` (as root tar also restores owners
//!   and mtimes; the fsync of DIR waits until a mount has sent what it answered itself).
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
//! `--keep-caches` skips that; the `mount` note says which was done. Files are not fsynced:
//! `untar` ends when the fsync of DIR returns, with the data in the page cache behind each
//! target.
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
//!
//! This module is the workload (phases, records, summary); `tree` makes and counts the
//! tarball, `fuse` starts and stops the targets' mounts and servers, and [`crate::process`]
//! bounds every command and watches for the stop signals.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::json;

use crate::process::{Sink, check_stop, run_timed, watch_signals, which};
use crate::report::{Record, Reporter};
use crate::scratch::{Scratch, drop_caches, sync_file_systems};

mod fuse;
mod tree;

pub use fuse::KilnMount;
pub use tree::{
    DEFAULT_DIRS, DEFAULT_FILES, DEFAULT_SEED, TreeShape, TreeSource, linux_source_tarball,
    tree_source,
};

use fuse::{Bins, Place};
use tree::{Tree, prepare_tree};

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

/// The directory each target's phases work in (`DIR`).
const WORK_DIR: &str = "t";

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
            Phase::Untar => "tar -xf tree.tar -C DIR && sync DIR",
            Phase::Stat => "find DIR -printf '%s\\n' (lines counted)",
            Phase::Ls => "ls -lR DIR > /dev/null",
            Phase::Read => "tar -cf - DIR (stream read and counted by kiln-bench)",
            Phase::Rm => "rm -rf DIR",
        }
    }
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

    let tree = prepare_tree(&bench.tree, &root, &logs, out)?;
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
            // Then an fsync of DIR: the one call that makes a FUSE mount send what it
            // answered itself (syncfs never reaches a FUSE server), and a journal commit on
            // a local file system.
            cmd = Command::new("sh");
            cmd.args(["-c", r#"tar -xf "$1" -C "$2" && sync "$2""#, "sh"])
                .arg(&tree.tarball)
                .arg(&dir);
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
    let (elapsed, count) = run_timed(&mut cmd, sink, &log, bench.phase_timeout)
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

/// `x` to 0.1 ms.
pub(super) fn round(x: f64) -> f64 {
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
        r.ratio = Some(ratio);
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
