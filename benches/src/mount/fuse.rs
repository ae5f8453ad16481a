//! The FUSE mounts `kiln-bench mount` measures and their lifecycle: the servers behind them
//! (`bindfs`, `glusterfs`, `kiln mount` with its `kiln-brickd`, `mfsmount` with a MooseFS
//! master and chunkserver, `juicefs mount`), waiting for a mount to show
//! in the mount table, unmounting, and stopping every server with a bound; [`KilnMount`]
//! lends the Kiln target to the other workloads. The Kiln target's brick can keep a fop
//! profile, read on its control socket ([`Place::control`]).

use std::os::unix::fs::DirBuilderExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kiln_client::mountinfo;
use serde_json::json;

use super::moosefs::MooseFs;
use super::{MountBench, Target, juicefs};
/// The executables the Kiln target runs, from beside kiln-bench.
pub(super) use crate::process::Bins;
use crate::process::Daemon;
use crate::process::{brickd_address, check_stop, log_tail, loopback_pki, run_bounded, version};

/// Name of the client and brick certificates of the Kiln target.
const CLIENT_NAME: &str = "admin";
const BRICK_NAME: &str = "b";
/// Longest short command (format, umount, version).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a mount may take to appear, and its server to exit after the unmount.
const MOUNT_TIMEOUT: Duration = Duration::from_secs(30);
/// Pause between polls of a mount table or the stop flag.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// Name of the Kiln brick's control socket, in the target's directory.
const CONTROL_SOCKET: &str = "brickd.sock";

/// Whether a file system of type `fstype` is mounted exactly on `point` (canonical).
fn is_mounted(point: &Path, fstype: &str) -> bool {
    mountinfo::read_self().is_ok_and(|mounts| mounts.iter().any(|m| m.is_at(point, fstype)))
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

/// Whether the Kiln brick counts and times its fops (the profile `kiln volume profile`
/// reads). Off for the other workloads' mounts, whose numbers compare with earlier runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Profiling {
    On,
    Off,
}

/// A target ready for the phases: the directory they work in, and what serves it.
#[derive(Debug)]
pub(super) struct Place {
    target: Target,
    /// The directory `t/` is made in.
    pub(super) base: PathBuf,
    /// The mount (dropped before `brickds`: fields drop in order).
    mount: Option<FuseMount>,
    /// The Kiln targets' brick servers.
    brickds: Vec<Daemon>,
    /// The moosefs target's master and chunkserver.
    moosefs: Option<MooseFs>,
    /// The Kiln brick's control socket, when it keeps a fop profile.
    control: Option<PathBuf>,
    detail: serde_json::Value,
}

impl Place {
    /// Starts `target` in `root/NAME`; `glusterfs_volume` (`SERVER:/VOLUME`) is the volume
    /// the glusterfs target mounts.
    pub(super) fn start(
        bench: &MountBench,
        target: Target,
        glusterfs_volume: Option<&str>,
        root: &Path,
        logs: &Path,
    ) -> anyhow::Result<Place> {
        let dir = root.join(target.name());
        std::fs::create_dir(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let mut place = Place {
            target,
            base: dir.clone(),
            mount: None,
            brickds: Vec::new(),
            moosefs: None,
            control: None,
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
                place.serve("bindfs", cmd, &mnt, "fuse", logs)?;
                place.base = mnt;
                place.detail = json!({ "bindfs": version("bindfs"), "options": bench.bindfs_options.join(","),
                                       "backing": src.display().to_string() });
            }
            Target::Kiln => {
                place.start_kiln(&bench.mount_options, Profiling::On, 1, &dir, logs)?;
            }
            Target::KilnDevFuse => {
                let mut options = bench.mount_options.clone();
                options.push("fuse-uring=off".to_owned());
                place.start_kiln(&options, Profiling::Off, 1, &dir, logs)?;
            }
            Target::KilnDist => {
                let options = &bench.mount_options;
                place.start_kiln(options, Profiling::Off, super::DIST_BRICKS, &dir, logs)?;
            }
            Target::Glusterfs => {
                let volume = glusterfs_volume.unwrap_or_default();
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
                place.serve("glusterfs", cmd, &mnt, "fuse.glusterfs", logs)?;
                // The volume may hold other things: work in a fresh directory of its own.
                let base = mnt.join(format!("kiln-bench-{}", std::process::id()));
                std::fs::create_dir(&base)
                    .with_context(|| format!("cannot create {}", base.display()))?;
                place.base = base;
                place.detail = json!({ "glusterfs": version("glusterfs"), "volume": volume });
            }
            Target::Moosefs => {
                let mnt = dir.join("mnt");
                std::fs::create_dir(&mnt)?;
                let cmd = place
                    .moosefs
                    .insert(MooseFs::start(&dir, logs)?)
                    .mount_command(&mnt);
                place.serve("mfsmount", cmd, &mnt, "fuse", logs)?;
                if let Some(servers) = place.moosefs.as_mut() {
                    servers.ready(&mnt, logs)?;
                }
                place.base = mnt;
                place.detail = MooseFs::describe();
            }
            Target::Juicefs => {
                juicefs::format(&dir, logs)?;
                let mnt = dir.join("mnt");
                std::fs::create_dir(&mnt)?;
                let cmd = juicefs::mount_command(&dir, &mnt);
                place.serve("juicefs", cmd, &mnt, "fuse.juicefs", logs)?;
                place.base = mnt;
                place.detail = juicefs::describe();
            }
        }
        Ok(place)
    }

    /// Runs `cmd`, a FUSE server in the foreground (logging to `logs/NAME.log`), and waits
    /// until its mount of type `fstype` on `point` shows.
    fn serve(
        &mut self,
        name: &'static str,
        mut cmd: Command,
        point: &Path,
        fstype: &'static str,
        logs: &Path,
    ) -> anyhow::Result<()> {
        let server = Daemon::spawn(name, &mut cmd, &logs.join(format!("{name}.log")))?;
        let mount = self.mount.insert(FuseMount {
            point: point.to_owned(),
            fstype,
            server,
            unmount_cmd: None,
        });
        mount.wait_mounted()
    }

    /// `bricks` fresh bricks, `kiln-brickd serve` of each on loopback, and `kiln mount -f` of
    /// them (a distributed volume when there are several). The first keeps a fop profile
    /// when `profiling` is on.
    fn start_kiln(
        &mut self,
        mount_options: &[String],
        profiling: Profiling,
        bricks: usize,
        dir: &Path,
        logs: &Path,
    ) -> anyhow::Result<()> {
        let bins = Bins::beside_this_executable()?;
        let tls = dir.join("tls");
        loopback_pki(&tls, BRICK_NAME, CLIENT_NAME)?;
        let mut addrs = Vec::with_capacity(bricks);
        let mut brick_dirs = Vec::with_capacity(bricks);
        for n in 0..bricks {
            let profile = profiling == Profiling::On && n == 0;
            let (addr, brick) = self.start_brickd(&bins, &tls, n, profile, dir, logs)?;
            addrs.push(addr);
            brick_dirs.push(brick);
        }

        let mnt = dir.join("mnt");
        std::fs::create_dir(&mnt)?;
        let mut cmd = Command::new(&bins.kiln);
        cmd.arg("--tls-dir")
            .arg(&tls)
            .args(["--client", CLIENT_NAME, "mount"])
            .arg(addrs.join(","))
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
            "bricks": brick_dirs,
            "brickds": addrs,
            "mount_options": mount_options.join(","),
            "binaries": bins.kiln.parent().map(|p| p.display().to_string()),
            "brick_profile": match profiling {
                Profiling::On => "--count-fop-hits --latency-measurement, read on --control",
                Profiling::Off => "off",
            },
        });
        Ok(())
    }

    /// Brick `n` of a Kiln target, fresh, served on loopback (with a fop profile read on a
    /// control socket when `profile`): its address and its directory.
    fn start_brickd(
        &mut self,
        bins: &Bins,
        tls: &Path,
        n: usize,
        profile: bool,
        dir: &Path,
        logs: &Path,
    ) -> anyhow::Result<(String, String)> {
        let (brick, brick_log) = match n {
            0 => (dir.join("brick"), logs.join("kiln-brickd.log")),
            n => (
                dir.join(format!("brick-{n}")),
                logs.join(format!("kiln-brickd-{n}.log")),
            ),
        };
        std::fs::create_dir(&brick)?;
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
            .arg(tls)
            .args(["--root-allow", CLIENT_NAME])
            .stdout(Stdio::piped());
        if profile {
            // The brick refuses a control socket in a directory others may enter.
            let private = dir.join("control");
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&private)
                .with_context(|| format!("cannot create {}", private.display()))?;
            let socket = private.join(CONTROL_SOCKET);
            cmd.arg("--control")
                .arg(&socket)
                .args(["--count-fop-hits", "--latency-measurement"]);
            self.control = Some(socket);
        }
        let mut brickd = Daemon::spawn("kiln-brickd", &mut cmd, &brick_log)?;
        let stdout = brickd.take_stdout().context("no pipe from kiln-brickd")?;
        let addr = brickd_address(stdout, &brick_log)?.to_string();
        self.brickds.push(brickd);
        Ok((addr, brick.display().to_string()))
    }

    /// The Kiln brick's control socket, where its fop profile is read; None for the other
    /// targets.
    pub(super) fn control(&self) -> Option<&Path> {
        self.control.as_deref()
    }

    pub(super) fn describe(&self) -> serde_json::Value {
        json!({ "target": self.target.name(), "dir": self.base.display().to_string(),
                "detail": self.detail })
    }

    /// Unmounts and stops everything; fails unless every server exited 0.
    pub(super) fn finish(mut self) -> anyhow::Result<serde_json::Value> {
        let mut note = json!({ "target": self.target.name(), "brickds": [] });
        if self.target == Target::Glusterfs {
            // Remove the work directory (empty after rm) before the unmount.
            let _ = std::fs::remove_dir(&self.base);
        }
        if let Some(mount) = self.mount.as_mut() {
            note["unmount"] = mount.finish()?;
        }
        if let Some(moosefs) = self.moosefs.as_mut() {
            note["servers"] = moosefs.stop()?;
        }
        for brickd in &mut self.brickds {
            let (status, killed) = brickd.stop()?;
            let stopped = json!({ "status": status.map(|s| s.to_string()), "sigkill": killed });
            if let Some(stops) = note["brickds"].as_array_mut() {
                stops.push(stopped);
            }
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
            brickds: Vec::new(),
            moosefs: None,
            control: None,
            detail: json!({}),
        };
        place.start_kiln(mount_options, Profiling::Off, 1, &dir, &logs)?;
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
