//! `kiln volume rebalance VOLUME start|status|stop`: every file of a distributed volume moved
//! to the brick its name hashes to (`Distribute::rebalance`), while clients keep using it.
//!
//! The management daemon runs it — on a cluster, the elected daemon, whichever host is asked
//! (`kiln_mgmt::tasks`) — as this command's `start --for-daemon` ([`run_for_daemon`]) in a
//! process of its own, which holds a lock file next to the daemon's socket (one rebalance per
//! volume and host) and writes its progress there after each directory. `start` asks for it and
//! follows it with a progress bar until it ends (Ctrl-C stops following, not the rebalance);
//! `stop` asks it to stop after the file it is moving and waits until it has.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kiln_admin::command::{RebalanceStatus, Request, Response, TaskAction};
use kiln_client::distribute::RebalanceReport;

use crate::Global;

/// How long `stop` waits for the rebalance to finish the file it is moving.
const STOP_WAIT: Duration = Duration::from_secs(120);
/// How often a follower asks the daemon how the rebalance is doing.
const FOLLOW_POLL: Duration = Duration::from_millis(100);
/// How often a runner checks that the daemon that started it is still there.
const PARENT_CHECK: Duration = Duration::from_millis(500);

fn line(status: &RebalanceStatus) -> String {
    let r = &status.report;
    let host = status
        .host
        .as_ref()
        .map(|h| format!(" on {h}"))
        .unwrap_or_default();
    format!(
        "{}: {}{host} — {} directories, {} files looked at, {} moved ({} bytes), {} stale link \
         files removed, {} left in place, {} failed, {:.1} s",
        status.volume,
        status.state,
        r.dirs,
        r.files,
        r.moved,
        r.bytes_moved,
        r.link_files_removed,
        r.skipped,
        r.failed,
        status.elapsed_secs
    )
}

fn new_status(
    volume: &str,
    state: &str,
    report: &RebalanceReport,
    elapsed: Duration,
) -> RebalanceStatus {
    RebalanceStatus {
        volume: volume.to_owned(),
        host: None,
        pid: std::process::id(),
        state: state.to_owned(),
        report: *report,
        elapsed_secs: elapsed.as_secs_f64(),
        stop: false,
    }
}

/// Where a volume's rebalance keeps its lock and progress.
struct Files {
    lock: PathBuf,
    status: PathBuf,
}

impl Files {
    fn of(global: &Global, volume: &str) -> Files {
        let dir = global.socket.parent().unwrap_or(Path::new("."));
        Files {
            lock: dir.join(format!("rebalance-{volume}.lock")),
            status: kiln_admin::command::rebalance_status_file(dir, volume),
        }
    }

    /// The lock, taken; `None` when a rebalance holds it.
    fn try_lock(&self) -> anyhow::Result<Option<File>> {
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&self.lock)
            .with_context(|| format!("cannot open {}", self.lock.display()))?;
        match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => Ok(Some(file)),
            Err(rustix::io::Errno::WOULDBLOCK) => Ok(None),
            Err(e) => Err(e).with_context(|| format!("cannot lock {}", self.lock.display())),
        }
    }

    fn write(&self, status: &RebalanceStatus) -> anyhow::Result<()> {
        let json = serde_json::to_vec_pretty(status)?;
        kiln_admin::durable::replace_file(&self.status, &json, 0o644)
            .with_context(|| format!("cannot write {}", self.status.display()))
    }
}

/// `rebalance VOLUME start`: asks the daemon to run it, and follows it until it ends.
pub(crate) fn start(global: &Global, name: &str, json: bool) -> anyhow::Result<()> {
    ask(global, name, TaskAction::Start)?;
    follow(global, name, json, true, None)
}

/// `rebalance VOLUME status`.
pub(crate) fn status(global: &Global, name: &str, json: bool) -> anyhow::Result<()> {
    print(&ask(global, name, TaskAction::Status)?, json)
}

/// `rebalance VOLUME stop`: asks the rebalance to stop after the file it is moving, and waits
/// until it has.
pub(crate) fn stop(global: &Global, name: &str, json: bool) -> anyhow::Result<()> {
    ask(global, name, TaskAction::Stop)?;
    follow(global, name, json, false, Some(Instant::now() + STOP_WAIT))
}

fn ask(global: &Global, name: &str, action: TaskAction) -> anyhow::Result<RebalanceStatus> {
    let request = Request::Rebalance {
        name: name.to_owned(),
        action,
    };
    match crate::volume::call(&global.socket, &request)? {
        Response::Rebalance(status) => Ok(status),
        Response::Error { message } => bail!("{message}"),
        other => bail!("kiln-mgmtd answered {other:?}"),
    }
}

/// Polls the rebalance of `name` until it ends (or `deadline`), with a progress bar if
/// `bar`; prints how it ended, an error if it failed.
fn follow(
    global: &Global,
    name: &str,
    json: bool,
    bar: bool,
    deadline: Option<Instant>,
) -> anyhow::Result<()> {
    let progress = match bar {
        true => indicatif::ProgressBar::new_spinner(),
        false => indicatif::ProgressBar::hidden(),
    };
    progress.set_style(
        indicatif::ProgressStyle::with_template("{spinner} [{elapsed_precise}] {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    let status = loop {
        let status = ask(global, name, TaskAction::Status)?;
        if !status.is_live() {
            break status;
        }
        if deadline.is_some_and(|d| Instant::now() > d) {
            bail!("the rebalance of {name} did not stop within {STOP_WAIT:?}");
        }
        let r = &status.report;
        progress.set_message(format!(
            "{}: {} directories, {} files, {} moved ({} MiB)",
            status.state,
            r.dirs,
            r.files,
            r.moved,
            r.bytes_moved >> 20
        ));
        progress.tick();
        std::thread::sleep(FOLLOW_POLL);
    };
    progress.finish_and_clear();
    print(&status, json)?;
    match (status.state.as_str(), status.report.failed) {
        ("completed" | "stopped", 0) => Ok(()),
        ("completed" | "stopped", failed) => {
            bail!("{failed} files or directories of {name} could not be rebalanced (see the log)")
        }
        (state, _) => {
            bail!("the rebalance of {name} {state} (see its log on the host that ran it)")
        }
    }
}

/// `rebalance VOLUME start --for-daemon`: the rebalance itself, run here for the daemon that
/// started this process, until it is done or stopped (SIGINT or SIGTERM); exits when that
/// daemon is gone.
pub(crate) fn run_for_daemon(global: &Global, name: &str) -> anyhow::Result<()> {
    exit_with_parent();
    let volume = crate::mount::resolve_volume(global, name)?;
    let files = Files::of(global, name);
    let Some(_lock) = files.try_lock()? else {
        bail!("a rebalance of {name} is running on this host");
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    // Listened for before the status says "running", so a `stop` never kills it mid-move.
    let (interrupt, terminate) = runtime
        .block_on(async {
            use tokio::signal::unix::{SignalKind, signal};
            Ok::<_, std::io::Error>((
                signal(SignalKind::interrupt())?,
                signal(SignalKind::terminate())?,
            ))
        })
        .context("cannot listen for SIGINT and SIGTERM")?;
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let running = |r: &RebalanceReport| new_status(name, "running", r, started.elapsed());
    files.write(&running(&RebalanceReport::default()))?;
    let result = runtime.block_on(async {
        let signals = tokio::spawn(stop_on_signal(interrupt, terminate, stop.clone()));
        let mut progress = |r: &RebalanceReport| {
            if let Err(e) = files.write(&running(r)) {
                tracing::warn!(error = %e, "rebalance: progress not written");
            }
        };
        let report = crate::heal::on_distributed(global, name, &volume.bricks, async |d| {
            d.rebalance(&stop, &mut progress).await
        })
        .await;
        signals.abort();
        report
    });
    let (state, report) = match &result {
        Ok(report) if stop.load(Ordering::Relaxed) => ("stopped", *report),
        Ok(report) if report.failed == 0 => ("completed", *report),
        Ok(report) => ("failed", *report),
        Err(_) => ("failed", RebalanceReport::default()),
    };
    files.write(&new_status(name, state, &report, started.elapsed()))?;
    result.map(|_| ())
}

/// Exits this process when its parent (the daemon that started it) is gone: a rebalance runs
/// for one daemon, and another may start it again. (Polled: a parent-death signal follows the
/// parent's thread, not its process.)
fn exit_with_parent() {
    let parent = rustix::process::getppid();
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(PARENT_CHECK);
            if rustix::process::getppid() != parent {
                eprintln!("kiln: the daemon that started this rebalance is gone; stopping");
                std::process::exit(3);
            }
        }
    });
}

pub(crate) fn print(status: &RebalanceStatus, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(status)?);
    } else {
        println!("{}", line(status));
    }
    Ok(())
}

/// Sets `stop` at the first SIGINT or SIGTERM.
async fn stop_on_signal(
    mut interrupt: tokio::signal::unix::Signal,
    mut terminate: tokio::signal::unix::Signal,
    stop: Arc<AtomicBool>,
) {
    tokio::select! {
        _ = interrupt.recv() => {}
        _ = terminate.recv() => {}
    }
    stop.store(true, Ordering::Relaxed);
}
