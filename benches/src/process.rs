//! Child processes the workloads start: commands run to their end with a bound (and timed),
//! the stop flag that SIGINT, SIGTERM or SIGHUP set so a run cut short still cleans up,
//! waiting on children, finding executables (Kiln's own beside kiln-bench, others on PATH),
//! and quoting their logs.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rustix::process::{Pid, PidfdFlags};

/// Bytes of a log quoted in an error.
const LOG_TAIL_BYTES: u64 = 2048;
/// Longest single poll before `give_up` (or the stop flag) is asked again.
pub const WAIT_SLICE: Duration = Duration::from_millis(100);
/// How long a server may take to stop after SIGTERM (`kiln-brickd` drains for up to 10 s,
/// `kiln-mgmtd` gives its bricks 15 s).
pub const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a process may take to go after SIGKILL.
pub const KILL_TIMEOUT: Duration = Duration::from_secs(5);
/// Buffer for reading a command's output.
const READ_BUFFER_BYTES: usize = 1 << 20;

/// Set once SIGINT, SIGTERM or SIGHUP arrived: the run stops at its next poll.
static STOP: AtomicBool = AtomicBool::new(false);

/// Whether the run is being stopped ([`watch_signals`]).
pub fn stopping() -> bool {
    STOP.load(Ordering::Relaxed)
}

/// Fails once the run is being stopped.
pub fn check_stop() -> anyhow::Result<()> {
    if stopping() {
        bail!("interrupted by a signal; cleaning up");
    }
    Ok(())
}

pub fn pid_of(child: &Child) -> anyhow::Result<Pid> {
    i32::try_from(child.id())
        .ok()
        .and_then(Pid::from_raw)
        .context("child process id")
}

/// Waits until `child` exits (without reaping it) or `timeout` passes; true if it exited.
/// Gives up early (false) once `give_up` says so (a run being stopped).
pub fn wait_exit(
    child: &Child,
    timeout: Duration,
    give_up: impl Fn() -> bool,
) -> anyhow::Result<bool> {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let pidfd =
        rustix::process::pidfd_open(pid_of(child)?, PidfdFlags::empty()).context("pidfd_open")?;
    let deadline = Instant::now() + timeout;
    loop {
        if give_up() {
            return Ok(false);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let slice = Timespec::try_from(left.min(WAIT_SLICE))?;
        let mut fds = [PollFd::new(&pidfd, PollFlags::IN)];
        match rustix::event::poll(&mut fds, Some(&slice)) {
            Ok(0) if left.is_zero() => return Ok(false),
            // Time left, or a signal: poll again.
            Ok(0) | Err(rustix::io::Errno::INTR) => continue,
            Ok(_) => return Ok(true),
            Err(e) => return Err(e).context("poll on a pidfd"),
        }
    }
}

/// The last bytes of a log file, for an error message.
pub fn log_tail(path: &Path) -> String {
    use std::io::{Seek as _, SeekFrom};
    let Ok(mut file) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map_or(0, |m| m.len());
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(LOG_TAIL_BYTES)));
    let mut bytes = Vec::new();
    let _ = file.take(LOG_TAIL_BYTES).read_to_end(&mut bytes);
    String::from_utf8_lossy(&bytes).trim().to_owned()
}

/// What a command's standard output is used for ([`run_timed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sink {
    Null,
    CountLines,
    CountBytes,
}

/// Runs `cmd` to its end, bounded by `timeout` and the stop flag; standard error goes to
/// `log`. Returns the time from spawn to exit (and the end of its output) and the count
/// `sink` asks for.
pub fn run_timed(
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
pub fn run_bounded(
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

/// A finished command ([`run_captured`]).
#[derive(Debug)]
pub struct Ran {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    /// From just before the spawn to the reaped exit.
    pub elapsed: Duration,
}

/// Runs `cmd` to its end, its output captured, killing it after `timeout`; a command that
/// fails is no error here (see [`Ran::status`]).
pub fn run_captured(cmd: &mut Command, timeout: Duration) -> anyhow::Result<Ran> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot run {:?}", cmd.get_program()))?;
    let status = wait_child(&mut child, timeout, false).with_context(|| format!("{cmd:?}"))?;
    let elapsed = start.elapsed();
    // The child has exited: the pipes hold what it wrote (a few lines) and then end.
    let mut stdout = String::new();
    let mut stderr = String::new();
    if let Some(mut s) = child.stdout.take() {
        s.read_to_string(&mut stdout)?;
    }
    if let Some(mut s) = child.stderr.take() {
        s.read_to_string(&mut stderr)?;
    }
    Ok(Ran {
        status,
        stdout,
        stderr,
        elapsed,
    })
}

/// Waits for `child` to exit and reaps it; kills it after `timeout` (or once the stop flag is
/// set, with `honour_stop`) and fails.
pub fn wait_child(
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
pub fn interrupted(status: ExitStatus) -> anyhow::Result<()> {
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
pub fn watch_signals() -> anyhow::Result<()> {
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

/// Kiln's executables, from the directory of the running kiln-bench (where cargo builds
/// them all), each checked to be there.
#[derive(Debug)]
pub struct Bins {
    /// Their directory.
    pub dir: PathBuf,
    pub kiln: PathBuf,
    pub brickd: PathBuf,
}

impl Bins {
    /// `kiln` and `kiln-brickd`.
    pub fn beside_this_executable() -> anyhow::Result<Bins> {
        let exe = std::env::current_exe().context("cannot find the kiln-bench executable")?;
        let dir = exe
            .parent()
            .context("the kiln-bench executable has no directory")?
            .to_owned();
        Ok(Bins {
            kiln: find_beside(&dir, "kiln")?,
            brickd: find_beside(&dir, "kiln-brickd")?,
            dir,
        })
    }

    /// Another executable of that directory (`kiln-mgmtd`).
    pub fn find(&self, name: &str) -> anyhow::Result<PathBuf> {
        find_beside(&self.dir, name)
    }
}

fn find_beside(dir: &Path, name: &str) -> anyhow::Result<PathBuf> {
    let path = dir.join(name);
    if !path.is_file() {
        bail!(
            "{} is missing: kiln-bench runs the Kiln executables built beside it; build them \
             with `cargo build --release --bins` (or `cargo build --bins` for a debug kiln-bench)",
            path.display()
        );
    }
    Ok(path)
}

/// An executable on PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// The first line of `NAME --version`.
pub fn version(name: &str) -> String {
    version_with(name, "--version")
}

/// The first line of `NAME FLAG`, for a program whose version flag is not `--version`; empty
/// if it cannot run.
pub fn version_with(name: &str, flag: &str) -> String {
    Command::new(name)
        .arg(flag)
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

/// How long a `kiln-brickd serve` may take to print the address it listens on.
const BRICKD_LISTEN_TIMEOUT: Duration = Duration::from_secs(30);

/// The address a starting `kiln-brickd serve` prints first on `stdout` (`listening on ADDR`),
/// waited for at most [`BRICKD_LISTEN_TIMEOUT`]; the rest of its output is drained so the
/// brick never blocks on a full pipe. The error shows the tail of its log `log`.
pub fn brickd_address(
    stdout: std::process::ChildStdout,
    log: &Path,
) -> anyhow::Result<std::net::SocketAddr> {
    use std::io::BufRead as _;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = std::io::BufReader::new(stdout).lines();
        let _ = tx.send(lines.next().and_then(Result::ok));
        for _ in lines {}
    });
    let deadline = Instant::now() + BRICKD_LISTEN_TIMEOUT;
    let line = loop {
        check_stop()?;
        match rx.recv_timeout(WAIT_SLICE) {
            Ok(line) => break line.unwrap_or_default(),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) if Instant::now() < deadline => {}
            Err(_) => break String::new(),
        }
    };
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .with_context(|| format!("kiln-brickd did not start ({line:?}):\n{}", log_tail(log)))?;
    addr.parse().context("kiln-brickd's address")
}

/// A fresh cluster CA in `tls`, a certificate for brick `brick` reached on loopback and one
/// for client `client` (valid a day: a benchmark's).
pub fn loopback_pki(tls: &Path, brick: &str, client: &str) -> anyhow::Result<()> {
    use kiln_admin::pki::{self, Role};
    pki::init_ca(tls).context("cluster CA")?;
    let brick_role = Role::Brick {
        hosts: vec!["127.0.0.1".into(), "localhost".into()],
    };
    pki::issue(tls, &brick_role, brick, 1).context("brick certificate")?;
    pki::issue(tls, &Role::Client, client, 1).context("client certificate")?;
    Ok(())
}

/// A server process, stopped (SIGTERM, bounded wait, SIGKILL) when dropped.
#[derive(Debug)]
pub struct Daemon {
    pub name: &'static str,
    child: Option<Child>,
    /// Where its standard error goes.
    pub log: PathBuf,
}

impl Daemon {
    pub fn spawn(name: &'static str, cmd: &mut Command, log: &Path) -> anyhow::Result<Daemon> {
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

    /// Its standard output, when it was spawned with a pipe there (once).
    pub fn take_stdout(&mut self) -> Option<std::process::ChildStdout> {
        self.child.as_mut().and_then(|c| c.stdout.take())
    }

    /// Its exit status if it has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Waits (bounded) for it to exit by itself; its status, or None if it did not.
    pub fn wait(&mut self, timeout: Duration) -> anyhow::Result<Option<ExitStatus>> {
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
    pub fn stop(&mut self) -> anyhow::Result<(Option<ExitStatus>, bool)> {
        let Some(child) = self.child.as_mut() else {
            bail!("{} is not running", self.name);
        };
        if let Ok(Some(status)) = child.try_wait() {
            self.child = None;
            return Ok((Some(status), false));
        }
        let _ = rustix::process::kill_process(pid_of(child)?, rustix::process::Signal::TERM);
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
