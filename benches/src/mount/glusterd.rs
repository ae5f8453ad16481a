//! GlusterFS set up for the glusterfs target (`kiln-bench mount --glusterfs-setup`) and for
//! the `gluster volume set` row of `kiln-bench mgmt`. For the mount, Debian's
//! `glusterfs-server` is installed with `apt-get` when `glusterd`, `gluster` or `glusterfs`
//! is missing (`mgmt` installs nothing: [`Glusterd::set_up_installed`]). Then `glusterd -N`
//! is started in the background unless a glusterd already runs (no systemd needed), with a
//! working directory of its own in the scratch directory — the host's (`/var/lib/glusterd`)
//! would bring back every volume defined there before and start their bricks beside the
//! measured one — and a
//! single-brick volume created with `force` (its brick in the scratch directory) on the
//! first address of this host glusterd accepts as its own (the host name, then
//! `hostname -I`; glusterd refuses `127.0.0.1` and `localhost` for a brick) and started,
//! with its default options. The mount target then mounts `HOST:/VOLUME` with
//! `glusterfs -N` as it mounts a named volume.
//!
//! [`Glusterd::tear_down`] — or dropping it, on any error — stops and deletes the volume,
//! ends its brick process if the volume stop left it, and stops the glusterd this run
//! started; a glusterd that was already running is left running. Every command is bounded.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rustix::process::{Pid, Signal};
use serde_json::json;

use crate::process::Daemon;
use crate::process::{Ran, check_stop, log_tail, run_bounded, run_captured, version, which};

/// Longest `apt-get` run.
const INSTALL_TIMEOUT: Duration = Duration::from_secs(1200);
/// Longest `gluster` command (the CLI's own `--timeout` is a little shorter).
const GLUSTER_TIMEOUT: Duration = Duration::from_secs(130);
const GLUSTER_CLI_TIMEOUT_S: u64 = 120;
/// How long glusterd may take to answer, and a started volume's brick to come online.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the brick process may take to go after SIGTERM.
const BRICK_STOP_TIMEOUT: Duration = Duration::from_secs(15);
/// Pause between polls of glusterd.
const POLL_INTERVAL: Duration = Duration::from_millis(250);
/// The package that brings glusterd, the `gluster` CLI and the FUSE client.
const PACKAGE: &str = "glusterfs-server";
/// The set-up's log (each `gluster` command and what it said), in the logs directory.
const SETUP_LOG: &str = "glusterfs-setup.log";

/// A volume this run set up, and the glusterd serving it.
#[derive(Debug)]
pub(crate) struct Glusterd {
    volume: String,
    /// The address of this host the brick is on (and the volfile server).
    host: Option<String>,
    brick: PathBuf,
    /// glusterd, when this run started it.
    daemon: Option<Daemon>,
    created: bool,
    started: bool,
    brick_pid: Option<Pid>,
    log: PathBuf,
    detail: serde_json::Value,
    torn_down: bool,
}

impl Glusterd {
    /// Installs, starts and creates what is missing; the error says why GlusterFS cannot
    /// run here (what was set up so far is torn down when the value is dropped).
    pub(super) fn set_up(root: &Path, logs: &Path) -> anyhow::Result<Glusterd> {
        let installed = install_if_missing(&logs.join(SETUP_LOG))?;
        Glusterd::start_and_create(root, logs, installed.as_deref())
    }

    /// [`Glusterd::set_up`] where `glusterd` and `gluster` are installed, installing
    /// nothing: the error says what is missing or why GlusterFS cannot run here.
    pub(crate) fn set_up_installed(root: &Path, logs: &Path) -> anyhow::Result<Glusterd> {
        if let Some(missing) = ["glusterd", "gluster"]
            .into_iter()
            .find(|p| which(p).is_none())
        {
            bail!("{missing} is not on PATH");
        }
        Glusterd::start_and_create(root, logs, None)
    }

    /// Starts glusterd unless one runs, then creates and starts the volume (brick in `root`);
    /// `installed` is what the set-up installed, for [`Glusterd::describe`].
    fn start_and_create(
        root: &Path,
        logs: &Path,
        installed: Option<&str>,
    ) -> anyhow::Result<Glusterd> {
        let log = logs.join(SETUP_LOG);
        let mut g = Glusterd {
            volume: format!("kilnbench{}", std::process::id()),
            host: None,
            brick: root.join("glusterfs-brick"),
            daemon: None,
            created: false,
            started: false,
            brick_pid: None,
            log,
            detail: json!({ "installed": installed }),
            torn_down: false,
        };
        let running = !glusterd_pids().is_empty();
        if !running {
            let state = root.join("glusterd");
            std::fs::create_dir_all(&state)
                .with_context(|| format!("cannot create {}", state.display()))?;
            let mut cmd = Command::new("glusterd");
            cmd.arg("-N")
                .arg(format!(
                    "--xlator-option=management.working-directory={}",
                    state.display()
                ))
                .arg(format!(
                    "--log-file={}",
                    logs.join("glusterd.log").display()
                ))
                .stdout(std::process::Stdio::null());
            g.daemon = Some(Daemon::spawn("glusterd", &mut cmd, &g.log)?);
        }
        g.detail["glusterd"] = json!(match running {
            true => "already running: used, left running",
            false =>
                "started by kiln-bench (glusterd -N, its own working directory), stopped at the end",
        });
        g.detail["version"] = json!(version("glusterd"));
        g.wait_answering()?;
        g.create()?;
        g.start()?;
        Ok(g)
    }

    /// `HOST:/VOLUME`, for the glusterfs target.
    pub(super) fn spec(&self) -> String {
        format!(
            "{}:/{}",
            self.host.as_deref().unwrap_or_default(),
            self.volume
        )
    }

    pub(crate) fn describe(&self) -> serde_json::Value {
        let mut d = self.detail.clone();
        d["volume"] = json!(self.spec());
        d["brick"] = json!(self.brick.display().to_string());
        d
    }

    /// The volume's name.
    pub(crate) fn volume(&self) -> &str {
        &self.volume
    }

    /// `gluster volume set VOLUME KEY VALUE`, one `gluster` process spawned and reaped
    /// (bounded): from spawn to reaped exit, or an error with its output. Logged only when it
    /// fails, so a long run does not grow the log.
    pub(crate) fn set(&self, key: &str, value: &str) -> anyhow::Result<Duration> {
        let args = ["volume", "set", &self.volume, key, value];
        let ran = gluster_ran(&args)?;
        if !ran.status.success() {
            self.log_command(&args, &said(&ran));
            bail!(failure(&args, &ran));
        }
        Ok(ran.elapsed)
    }

    /// Runs `gluster --mode=script ARGS` (bounded), logged; its output, or an error with it.
    fn gluster(&self, args: &[&str]) -> anyhow::Result<String> {
        let ran = gluster_ran(args)?;
        let said = said(&ran);
        self.log_command(args, &said);
        if !ran.status.success() {
            bail!(failure(args, &ran));
        }
        Ok(said)
    }

    /// Appends `gluster ARGS` and what it said to the set-up's log (best effort).
    fn log_command(&self, args: &[&str], said: &str) {
        let _ = append(
            &self.log,
            &format!("$ gluster {}\n{said}\n", args.join(" ")),
        );
    }

    /// Waits (bounded) until glusterd answers the CLI; fails if the one started exits.
    fn wait_answering(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            check_stop()?;
            let Err(last) = self.gluster(&["pool", "list"]) else {
                return Ok(());
            };
            if let Some(status) = self.daemon.as_mut().and_then(|d| d.exited()) {
                bail!(
                    "glusterd -N exited ({status}) before answering:\n{}",
                    log_tail(&self.log)
                );
            }
            if Instant::now() >= deadline {
                bail!("glusterd did not answer within {READY_TIMEOUT:?}: {last:#}");
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// Creates the volume on the first address of this host glusterd accepts for a brick.
    fn create(&mut self) -> anyhow::Result<()> {
        std::fs::create_dir(&self.brick)
            .with_context(|| format!("cannot create {}", self.brick.display()))?;
        let mut refused = Vec::new();
        for host in host_candidates() {
            let brick = format!("{host}:{}", self.brick.display());
            match self.gluster(&["volume", "create", &self.volume, &brick, "force"]) {
                Ok(_) => {
                    self.host = Some(host);
                    self.created = true;
                    return Ok(());
                }
                Err(e) => refused.push(format!("{host}: {e:#}")),
            }
        }
        bail!(
            "glusterd created no volume on any address of this host:\n{}",
            refused.join("\n")
        )
    }

    /// Starts the volume and waits (bounded) until its brick is online.
    fn start(&mut self) -> anyhow::Result<()> {
        self.gluster(&["volume", "start", &self.volume])?;
        self.started = true;
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            check_stop()?;
            let status = self.gluster(&["volume", "status", &self.volume, "--xml"])?;
            if let Some(pid) = online_brick_pid(&status) {
                self.brick_pid = Pid::from_raw(pid);
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "the brick of {} was not online within {READY_TIMEOUT:?}:\n{status}",
                    self.volume
                );
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// Stops and deletes the volume and stops what this run started; what happened, step by
    /// step (a failed step is reported, the next ones still run).
    pub(crate) fn tear_down(&mut self) -> serde_json::Value {
        self.torn_down = true;
        let mut note = json!({ "volume": self.volume });
        let outcome = |r: anyhow::Result<String>| match r {
            Ok(_) => json!("ok"),
            Err(e) => json!(format!("{e:#}")),
        };
        if self.started {
            note["stop"] = outcome(self.gluster(&["volume", "stop", &self.volume, "force"]));
        }
        if self.created {
            note["delete"] = outcome(self.gluster(&["volume", "delete", &self.volume]));
        }
        if let Some(pid) = self.brick_pid.take() {
            note["brick_process"] = json!(end_brick_process(pid));
        }
        if let Some(daemon) = self.daemon.as_mut() {
            note["glusterd"] = match daemon.stop() {
                Ok((status, killed)) => {
                    json!({ "status": status.map(|s| s.to_string()), "sigkill": killed })
                }
                Err(e) => json!(format!("{e:#}")),
            };
        }
        note
    }
}

impl Drop for Glusterd {
    fn drop(&mut self) {
        if !self.torn_down {
            let _ = self.tear_down();
        }
    }
}

/// Runs `gluster --mode=script ARGS` (bounded, no prompts, the CLI's own timeout a little
/// shorter); a failure is no error here (see [`Ran::status`]).
fn gluster_ran(args: &[&str]) -> anyhow::Result<Ran> {
    let mut cmd = Command::new("gluster");
    cmd.arg("--mode=script")
        .arg(format!("--timeout={GLUSTER_CLI_TIMEOUT_S}"))
        .args(args)
        .env("LC_ALL", "C");
    run_captured(&mut cmd, GLUSTER_TIMEOUT).with_context(|| format!("gluster {}", args.join(" ")))
}

/// What a `gluster` command wrote, both streams.
fn said(ran: &Ran) -> String {
    format!("{}{}", ran.stdout, ran.stderr).trim().to_owned()
}

/// The error of a failed `gluster ARGS`.
fn failure(args: &[&str], ran: &Ran) -> String {
    format!(
        "gluster {} failed ({}): {}",
        args.join(" "),
        ran.status,
        said(ran)
    )
}

/// Installs Debian's glusterfs-server with apt-get (after an `apt-get update` if the first
/// try fails) when one of its programs is missing; what was installed, if anything.
fn install_if_missing(log: &Path) -> anyhow::Result<Option<String>> {
    let missing: Vec<&str> = ["glusterd", "gluster", "glusterfs"]
        .into_iter()
        .filter(|p| which(p).is_none())
        .collect();
    if missing.is_empty() {
        return Ok(None);
    }
    if which("apt-get").is_none() {
        bail!(
            "{} not on PATH, and no apt-get to install Debian's {PACKAGE}",
            missing.join(", ")
        );
    }
    let apt = |args: &[&str]| {
        let mut cmd = Command::new("apt-get");
        cmd.args(args).env("DEBIAN_FRONTEND", "noninteractive");
        run_bounded(&mut cmd, None, log, INSTALL_TIMEOUT)
    };
    let install = ["install", "-y", "-q", "--no-install-recommends", PACKAGE];
    if apt(&install).is_err() {
        apt(&["update", "-q"]).context("apt-get update")?;
        apt(&install).with_context(|| format!("apt-get install {PACKAGE}"))?;
    }
    if let Some(still) = ["glusterd", "gluster", "glusterfs"]
        .into_iter()
        .find(|p| which(p).is_none())
    {
        bail!("{still} is still not on PATH after installing {PACKAGE}");
    }
    Ok(Some(format!("{PACKAGE} ({})", version("glusterfs"))))
}

/// Processes named `glusterd`.
fn glusterd_pids() -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.trim() == "glusterd")
        })
        .collect()
}

/// This host's names for a brick: its host name, then the addresses `hostname -I` lists.
pub(super) fn host_candidates() -> Vec<String> {
    let mut hosts = vec![
        rustix::system::uname()
            .nodename()
            .to_string_lossy()
            .into_owned(),
    ];
    if let Ok(ran) = run_captured(Command::new("hostname").arg("-I"), GLUSTER_TIMEOUT)
        && ran.status.success()
    {
        hosts.extend(ran.stdout.split_whitespace().map(str::to_owned));
    }
    hosts.retain(|h| !h.is_empty());
    hosts.dedup();
    hosts
}

/// The pid of the brick process in `gluster volume status VOL --xml`, once it is online.
fn online_brick_pid(xml: &str) -> Option<i32> {
    let node = &xml[xml.find("<node>")?..];
    let node = &node[..node.find("</node>")?];
    let field = |name: &str| {
        let open = format!("<{name}>");
        let start = node.find(&open)? + open.len();
        let len = node[start..].find('<')?;
        Some(node[start..start + len].trim().to_owned())
    };
    if field("status")? != "1" {
        return None;
    }
    field("pid")?.parse().ok().filter(|&pid| pid > 0)
}

/// Ends the volume's brick process (`glusterfsd`) if the volume stop left it: SIGTERM, a
/// bounded wait, SIGKILL. Checks the name first, so a reused pid is left alone.
fn end_brick_process(pid: Pid) -> String {
    let alive = || {
        std::fs::read_to_string(format!("/proc/{}/comm", pid.as_raw_nonzero()))
            .is_ok_and(|c| c.trim() == "glusterfsd")
    };
    if !alive() {
        return "gone".into();
    }
    let _ = rustix::process::kill_process(pid, Signal::TERM);
    let deadline = Instant::now() + BRICK_STOP_TIMEOUT;
    while alive() && Instant::now() < deadline {
        std::thread::sleep(POLL_INTERVAL);
    }
    if !alive() {
        return "left by the volume stop; ended by SIGTERM".into();
    }
    let _ = rustix::process::kill_process(pid, Signal::KILL);
    "left by the volume stop; SIGKILL".into()
}

fn append(log: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    std::fs::File::options()
        .create(true)
        .append(true)
        .open(log)?
        .write_all(text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_brick_pid_is_read_once_it_is_online() {
        let xml = |status: u8| {
            format!(
                "<cliOutput><volStatus><volumes><volume><volName>v</volName><node>\
                 <hostname>vm</hostname><path>/b</path><status>{status}</status>\
                 <port>49152</port><pid>4242</pid></node></volume></volumes></volStatus>\
                 </cliOutput>"
            )
        };
        assert_eq!(online_brick_pid(&xml(1)), Some(4242));
        assert_eq!(online_brick_pid(&xml(0)), None);
        assert_eq!(online_brick_pid("<cliOutput/>"), None);
    }
}
