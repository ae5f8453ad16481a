//! (a) `mgmt.spawn` and `mgmt.set` / `kiln-cli`, `kiln-cli-started`: spawned commands, and
//! `kiln volume set` end to end through a real `kiln-mgmtd` (on its embedded store or on
//! etcd), the volume created, then started.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hdrhistogram::Histogram;
use kiln_admin::volume::Brick;
use rustix::process::{Pid, Signal};
use serde_json::json;

use super::{
    COMMAND_TIMEOUT, Floor, KEY, KilnSets, Rows, VOLUME_NAME, latency_record, sampled, value,
    warmup,
};
use crate::process::{
    Bins, KILL_TIMEOUT, Ran, STOP_TIMEOUT, log_tail, pid_of, run_captured, wait_exit,
};
use crate::report::{histogram, micros, nanos};

/// The cluster name of the daemon on etcd (fresh: the run's etcd starts empty).
const MGMTD_CLUSTER: &str = "mgmtd";
/// The host name of the daemon on etcd: its bricks, and it, are on loopback.
const MGMTD_HOST: &str = "127.0.0.1";
/// How long `kiln-mgmtd` may take to listen on its socket.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(20);
/// How long the started brick may take to run and take a push.
const BRICK_TIMEOUT: Duration = Duration::from_secs(30);
/// Pause between polls of the daemon's socket or the brick's status.
const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// Largest path a Unix socket address holds (`sun_path` less its NUL).
const SOCKET_PATH_MAX_BYTES: usize = 107;
/// Attempts at finding a free port.
const PORT_TRIES: usize = 50;

/// A UDP port on 127.0.0.1 that was free (for UDP and TCP, as a brick binds both) just now.
fn free_port() -> anyhow::Result<u16> {
    for _ in 0..PORT_TRIES {
        let udp = std::net::UdpSocket::bind("127.0.0.1:0")?;
        let port = udp.local_addr()?.port();
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no free port on 127.0.0.1 after {PORT_TRIES} tries")
}

fn check_socket_path(path: &Path) -> anyhow::Result<()> {
    if path.as_os_str().len() > SOCKET_PATH_MAX_BYTES {
        bail!(
            "{} is longer than a Unix socket path may be ({SOCKET_PATH_MAX_BYTES} bytes); use a shorter --scratch",
            path.display()
        );
    }
    Ok(())
}

/// A running `kiln-mgmtd`, stopped (SIGTERM, bounded wait, SIGKILL) when dropped; on etcd,
/// whose daemons leave their bricks running, its volume is stopped first.
struct Mgmtd {
    child: Option<Child>,
    kiln: PathBuf,
    socket: PathBuf,
    log: PathBuf,
    /// The configuration is in etcd: the bricks outlive the daemon.
    on_etcd: bool,
}

/// How `kiln-mgmtd` ended.
struct Stopped {
    status: Option<ExitStatus>,
    killed: bool,
    took: Duration,
}

impl Mgmtd {
    /// Starts `kiln-mgmtd` in `dir`: on its embedded store, or on the etcd at `etcd` as
    /// host [`MGMTD_HOST`] of cluster [`MGMTD_CLUSTER`].
    fn start(bins: &Bins, dir: &Path, etcd: Option<&str>) -> anyhow::Result<Mgmtd> {
        let mgmtd_bin = bins.find("kiln-mgmtd")?;
        let state = dir.join("state");
        let socket = dir.join("run/mgmtd.sock");
        check_socket_path(&socket)?;
        check_socket_path(
            &state
                .join("run")
                .join(format!("{}.sock", Brick::name(VOLUME_NAME, 0))),
        )?;
        let log = dir.join("mgmtd.log");
        let log_file = std::fs::File::options()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("cannot open {}", log.display()))?;
        let mut command = Command::new(&mgmtd_bin);
        command
            .arg("--state-dir")
            .arg(&state)
            .arg("--socket")
            .arg(&socket)
            .arg("--brickd")
            .arg(&bins.brickd)
            // The store is this run's choice, never the environment's.
            .env_remove("KILN_ETCD")
            .env_remove("KILN_HOST")
            .env_remove("KILN_CLUSTER");
        if let Some(endpoint) = etcd {
            command
                .args(["--etcd", endpoint, "--cluster", MGMTD_CLUSTER])
                .args(["--host", MGMTD_HOST, "--listen-ip", MGMTD_HOST]);
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .with_context(|| format!("cannot run {}", mgmtd_bin.display()))?;
        let mut mgmtd = Mgmtd {
            child: Some(child),
            kiln: bins.kiln.clone(),
            socket,
            log,
            on_etcd: etcd.is_some(),
        };
        let deadline = Instant::now() + LISTEN_TIMEOUT;
        while std::os::unix::net::UnixStream::connect(&mgmtd.socket).is_err() {
            if let Some(child) = mgmtd.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                mgmtd.child = None;
                bail!(
                    "kiln-mgmtd exited ({status}) before listening:\n{}",
                    log_tail(&mgmtd.log)
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "kiln-mgmtd did not listen on {} within {LISTEN_TIMEOUT:?}:\n{}",
                    mgmtd.socket.display(),
                    log_tail(&mgmtd.log)
                );
            }
            std::thread::sleep(POLL_INTERVAL);
        }
        Ok(mgmtd)
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Runs `kiln <args>` against this daemon.
    fn kiln(&self, args: &[&str]) -> anyhow::Result<Ran> {
        self.run(&self.kiln, args)
    }

    /// Runs executable `kiln` with `args` against this daemon.
    fn run(&self, kiln: &Path, args: &[&str]) -> anyhow::Result<Ran> {
        run_captured(
            Command::new(kiln)
                .args(args)
                .env("KILN_MGMT_SOCKET", &self.socket),
            COMMAND_TIMEOUT,
        )
    }

    /// Runs `kiln <args>` and fails unless it succeeds.
    fn ok(&self, args: &[&str]) -> anyhow::Result<Ran> {
        self.ok_with(&self.kiln, args)
    }

    /// Runs executable `kiln` with `args` and fails unless it succeeds.
    fn ok_with(&self, kiln: &Path, args: &[&str]) -> anyhow::Result<Ran> {
        let ran = self.run(kiln, args)?;
        if !ran.status.success() {
            bail!(
                "{} {} failed ({}): {}\nkiln-mgmtd's log:\n{}",
                kiln.display(),
                args.join(" "),
                ran.status,
                ran.stderr.trim(),
                log_tail(&self.log)
            );
        }
        Ok(ran)
    }

    /// SIGTERM, then waits (bounded); SIGKILL if it does not go.
    fn stop(&mut self) -> anyhow::Result<Stopped> {
        let Some(mut child) = self.child.take() else {
            bail!("kiln-mgmtd is not running");
        };
        let start = Instant::now();
        rustix::process::kill_process(pid_of(&child)?, Signal::TERM)
            .context("cannot send SIGTERM to kiln-mgmtd")?;
        let mut killed = false;
        if !wait_exit(&child, STOP_TIMEOUT, || false)? {
            killed = true;
            let _ = child.kill();
            wait_exit(&child, KILL_TIMEOUT, || false)?;
        }
        let status = child.try_wait()?;
        Ok(Stopped {
            status,
            killed,
            took: start.elapsed(),
        })
    }
}

impl Drop for Mgmtd {
    fn drop(&mut self) {
        if self.child.is_some() {
            if self.on_etcd {
                // Its bricks would outlive it (the run failed before `stop_cleanly`).
                let _ = self.kiln(&["volume", "stop", VOLUME_NAME]);
            }
            let _ = self.stop();
        }
    }
}

/// The brick pids `kiln volume --json status` reports once every brick runs.
fn running_bricks(m: &Mgmtd, deadline: Instant) -> anyhow::Result<Vec<u32>> {
    loop {
        let ran = m.ok(&["volume", "--json", "status", VOLUME_NAME])?;
        let status: serde_json::Value = serde_json::from_str(ran.stdout.trim())
            .with_context(|| format!("`kiln volume --json status`: {}", ran.stdout.trim()))?;
        let bricks = status["bricks"].as_array().cloned().unwrap_or_default();
        let pids: Vec<u32> = bricks
            .iter()
            .filter(|b| b["state"] == "running")
            .filter_map(|b| b["pid"].as_u64().and_then(|p| u32::try_from(p).ok()))
            .collect();
        if !bricks.is_empty() && pids.len() == bricks.len() {
            return Ok(pids);
        }
        if Instant::now() >= deadline {
            bail!(
                "the brick of volume {VOLUME_NAME} is not running after {BRICK_TIMEOUT:?}: {}",
                ran.stdout.trim()
            );
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// Whether a `kiln volume set` answer says the running bricks applied the change.
fn applied_live(ran: &Ran) -> bool {
    ran.stdout.contains("; applied by")
}

/// What one `kiln` executable's measured sets gave.
struct Sets {
    latency: Histogram<u64>,
    /// How many a running brick applied.
    applied: usize,
    /// Their time, spawn to exit, all together.
    took: Duration,
}

impl Sets {
    /// Sets per second of that executable's own time.
    fn rate(&self) -> f64 {
        self.latency.len() as f64 / self.took.as_secs_f64()
    }
}

/// `n` measured `kiln volume set` processes per executable of `kilns`, taking turns, values
/// from `*next` on.
fn cli_sets(m: &Mgmtd, kilns: &[&Path], n: usize, next: &mut usize) -> anyhow::Result<Vec<Sets>> {
    let mut sets = Vec::with_capacity(kilns.len());
    for _ in kilns {
        sets.push(Sets {
            latency: histogram()?,
            applied: 0,
            took: Duration::ZERO,
        });
    }
    for _ in 0..n {
        for (kiln, s) in kilns.iter().zip(&mut sets) {
            let v = value(*next);
            *next += 1;
            let ran = m.ok_with(kiln, &["volume", "set", VOLUME_NAME, KEY, &v])?;
            s.latency.record(nanos(ran.elapsed))?;
            s.applied += usize::from(applied_live(&ran));
            s.took += ran.elapsed;
        }
    }
    Ok(sets)
}

/// (a) What a command costs before it talks to the daemon, spawned, reaped and timed as the
/// sets are: `true` (the smallest program: this harness's spawn, exec and reap) and
/// `kiln --version` of each build (kiln's exec, dynamic linking, runtime start and argument
/// parsing, no socket).
fn spawn_floors(
    m: &Mgmtd,
    kilns: &[(&Path, &str)],
    sets: usize,
    floor: Floor,
    rows: &mut Rows<'_>,
) -> anyhow::Result<()> {
    let true_run = || -> anyhow::Result<Duration> {
        let ran = run_captured(&mut Command::new("true"), COMMAND_TIMEOUT)?;
        if !ran.status.success() {
            bail!("`true` failed ({})", ran.status);
        }
        Ok(ran.elapsed)
    };
    let (rate, h) = sampled(sets, |_| true_run())?;
    rows.push(latency_record(
        "mgmt.spawn",
        "true",
        json!({ "runs": sets }),
        rate,
        &h,
        floor,
    ));
    for &(kiln, suffix) in kilns {
        let (rate, h) = sampled(sets, |_| Ok(m.ok_with(kiln, &["--version"])?.elapsed))?;
        rows.push(latency_record(
            "mgmt.spawn",
            &format!("kiln-version{suffix}"),
            json!({ "runs": sets, "kiln": kiln.display().to_string() }),
            rate,
            &h,
            floor,
        ));
    }
    Ok(())
}

/// (a) `kiln volume set` through a real `kiln-mgmtd` (on the etcd at `etcd`, if given), with
/// the volume created, then started, by the `kiln` beside kiln-bench and, taking turns with
/// it, by `static_kiln`; the first one's p50s.
pub(super) fn cli(
    bins: &Bins,
    static_kiln: Option<&Path>,
    root: &Path,
    etcd: Option<&str>,
    sets: usize,
    floor: Floor,
    rows: &mut Rows<'_>,
) -> anyhow::Result<KilnSets> {
    let dir = root.join("mgmtd");
    std::fs::create_dir_all(&dir)?;
    let brick = dir.join("bricks/b0");
    let mut m = start_with_volume(bins, &dir, etcd, &brick, rows)?;
    let mut next = 0;
    let warm = warmup(sets);
    let mut kilns = vec![(bins.kiln.as_path(), "")];
    kilns.extend(static_kiln.map(|kiln| (kiln, "-static")));
    let paths: Vec<&Path> = kilns.iter().map(|&(kiln, _)| kiln).collect();

    spawn_floors(&m, &kilns, sets, floor, rows)?;

    // Created, not started: parse, commit, answer.
    for _ in 0..warm {
        for kiln in &paths {
            m.ok_with(kiln, &["volume", "set", VOLUME_NAME, KEY, &value(next)])?;
            next += 1;
        }
    }
    let created = cli_sets(&m, &paths, sets, &mut next)?;
    for (s, &(kiln, suffix)) in created.iter().zip(&kilns) {
        rows.push(latency_record(
            "mgmt.set",
            &format!("kiln-cli{suffix}"),
            json!({ "sets": sets, "key": KEY, "volume": "created", "kiln": kiln.display().to_string() }),
            s.rate(),
            &s.latency,
            floor,
        ));
    }

    // Started: each set is also pushed to the running brick.
    m.ok(&["volume", "start", VOLUME_NAME])?;
    let deadline = Instant::now() + BRICK_TIMEOUT;
    let brick_pids = running_bricks(&m, deadline)?;
    warm_up_live(&m, &dir, warm, &mut next, deadline)?;
    let started = cli_sets(&m, &paths, sets, &mut next)?;
    for (s, &(kiln, suffix)) in started.iter().zip(&kilns) {
        rows.push(latency_record(
            "mgmt.set",
            &format!("kiln-cli-started{suffix}"),
            json!({ "sets": sets, "key": KEY, "volume": "started", "bricks": brick_pids.len(),
                    "applied_live": s.applied, "kiln": kiln.display().to_string() }),
            s.rate(),
            &s.latency,
            floor,
        ));
    }

    stop_cleanly(&mut m, &brick_pids, &brick, rows)?;
    Ok(KilnSets {
        created_p50_us: micros(&created[0].latency, 0.5),
        started_p50_us: micros(&started[0].latency, 0.5),
    })
}

/// Starts `kiln-mgmtd` in `dir` (on the etcd at `etcd`, if given) and creates volume `v` on
/// `brick` with a free port.
fn start_with_volume(
    bins: &Bins,
    dir: &Path,
    etcd: Option<&str>,
    brick: &Path,
    rows: &mut Rows<'_>,
) -> anyhow::Result<Mgmtd> {
    let brick_s = brick.to_str().context("the scratch path is not UTF-8")?;
    let port = free_port()?;
    let m = Mgmtd::start(bins, dir, etcd)?;
    rows.note(
        "mgmtd",
        &json!({
            "pid": m.pid(),
            "socket": m.socket.display().to_string(),
            "etcd": etcd.map(|endpoint| json!({ "endpoint": endpoint, "cluster": MGMTD_CLUSTER, "host": MGMTD_HOST })),
            "brick": brick_s,
            "brick_port": port,
        }),
    );
    m.ok(&[
        "volume",
        "create",
        VOLUME_NAME,
        brick_s,
        "--port",
        &port.to_string(),
    ])?;
    Ok(m)
}

/// Sets values from `*next` on until one is applied by the started brick, then `warm`
/// more applied ones (or until `deadline`). "running" means spawned; the first sets may
/// find the control socket not yet there.
fn warm_up_live(
    m: &Mgmtd,
    dir: &Path,
    warm: usize,
    next: &mut usize,
    deadline: Instant,
) -> anyhow::Result<()> {
    let mut warmed = 0;
    let mut reached = false;
    let max_tries = usize::try_from(BRICK_TIMEOUT.as_millis() / POLL_INTERVAL.as_millis())
        .unwrap_or(usize::MAX);
    for _ in 0..max_tries {
        let ran = m.ok(&["volume", "set", VOLUME_NAME, KEY, &value(*next)])?;
        *next += 1;
        if applied_live(&ran) {
            reached = true;
            warmed += 1;
            if warmed >= warm {
                break;
            }
        } else if Instant::now() >= deadline {
            break;
        } else {
            std::thread::sleep(POLL_INTERVAL);
        }
    }
    if !reached {
        bail!(
            "no `kiln volume set` reached the running brick within {BRICK_TIMEOUT:?} (see {})",
            dir.join("state/logs")
                .join(format!("{}.log", Brick::name(VOLUME_NAME, 0)))
                .display()
        );
    }
    Ok(())
}

/// Stops `kiln-mgmtd` with SIGTERM and notes how; kills bricks it left running, and fails
/// unless it stopped cleanly and its bricks stopped. On etcd, where bricks outlive their
/// daemon, the volume is stopped first (`kiln volume stop`); on the embedded store the
/// daemon takes its bricks with it.
fn stop_cleanly(
    m: &mut Mgmtd,
    brick_pids: &[u32],
    brick: &Path,
    rows: &mut Rows<'_>,
) -> anyhow::Result<()> {
    if m.on_etcd {
        m.ok(&["volume", "stop", VOLUME_NAME])?;
    }
    let stopped = m.stop()?;
    let left: Vec<u32> = brick_pids
        .iter()
        .copied()
        .filter(|pid| brick_still_running(*pid, brick))
        .collect();
    rows.note(
        "mgmtd_stop",
        &json!({
            "volume_stopped_first": m.on_etcd,
            "status": stopped.status.map(|s| s.to_string()),
            "sigkill": stopped.killed,
            "ms": stopped.took.as_millis(),
            "bricks_left_running": left,
        }),
    );
    for &pid in &left {
        if let Some(pid) = i32::try_from(pid).ok().and_then(Pid::from_raw) {
            let _ = rustix::process::kill_process(pid, Signal::KILL);
        }
    }
    if stopped.killed || !stopped.status.is_some_and(|s| s.success()) || !left.is_empty() {
        bail!(
            "kiln-mgmtd did not stop cleanly on SIGTERM (status {:?}, SIGKILL needed: {}, bricks left running: {left:?}):\n{}",
            stopped.status.map(|s| s.to_string()),
            stopped.killed,
            log_tail(&m.log)
        );
    }
    Ok(())
}

/// Whether `pid` is still a live `kiln-brickd` serving `brick` (a reaped pid may be reused).
fn brick_still_running(pid: u32, brick: &Path) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| {
        cmdline
            .split(|&b| b == 0)
            .any(|arg| arg == brick.as_os_str().as_encoded_bytes())
    })
}
