//! `kiln volume rebalance VOLUME start|status|stop`: every file of a distributed volume moved
//! to the brick its name hashes to (`Distribute::rebalance`), while clients keep using it.
//!
//! The rebalance runs in the `start` command's process, with a progress bar, until it is done
//! or stopped (Ctrl-C, SIGTERM, or `stop` from another shell). It holds a lock file next to the
//! management daemon's socket, so one rebalance runs per volume, and writes its progress
//! there after each directory for `status`.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kiln_client::distribute::RebalanceReport;
use serde::{Deserialize, Serialize};

use crate::Global;

/// How long `stop` waits for the rebalance to finish the file it is moving.
const STOP_WAIT: Duration = Duration::from_secs(120);
const STOP_POLL: Duration = Duration::from_millis(100);

/// What `status` shows: the last progress a rebalance wrote.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Status {
    volume: String,
    pid: u32,
    /// `running`, `completed`, `stopped` or `failed`.
    state: String,
    #[serde(flatten)]
    report: RebalanceReport,
    elapsed_secs: f64,
}

impl Status {
    fn new(volume: &str, state: &str, report: &RebalanceReport, elapsed: Duration) -> Status {
        Status {
            volume: volume.to_owned(),
            pid: std::process::id(),
            state: state.to_owned(),
            report: *report,
            elapsed_secs: elapsed.as_secs_f64(),
        }
    }

    fn line(&self) -> String {
        let r = &self.report;
        format!(
            "{}: {} — {} directories, {} files looked at, {} moved ({} bytes), {} stale link \
             files removed, {} left in place, {} failed, {:.1} s",
            self.volume,
            self.state,
            r.dirs,
            r.files,
            r.moved,
            r.bytes_moved,
            r.link_files_removed,
            r.skipped,
            r.failed,
            self.elapsed_secs
        )
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
            status: dir.join(format!("rebalance-{volume}.json")),
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

    fn running(&self) -> anyhow::Result<bool> {
        Ok(self.lock.exists() && self.try_lock()?.is_none())
    }

    fn write(&self, status: &Status) -> anyhow::Result<()> {
        let json = serde_json::to_vec_pretty(status)?;
        kiln_admin::durable::replace_file(&self.status, &json, 0o644)
            .with_context(|| format!("cannot write {}", self.status.display()))
    }

    fn read(&self) -> anyhow::Result<Option<Status>> {
        match std::fs::read(&self.status) {
            Ok(bytes) => Ok(Some(serde_json::from_slice(&bytes).with_context(|| {
                format!("{} is not a rebalance status", self.status.display())
            })?)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("cannot read {}", self.status.display())),
        }
    }
}

/// `rebalance VOLUME start`: runs the rebalance here until it is done or stopped.
pub(crate) fn start(global: &Global, name: &str, json: bool) -> anyhow::Result<()> {
    let volume = crate::mount::resolve_volume(global, name)?;
    let files = Files::of(global, name);
    let Some(_lock) = files.try_lock()? else {
        bail!("a rebalance of {name} is running; `kiln volume rebalance {name} status`");
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
    let bar = indicatif::ProgressBar::new_spinner();
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} [{elapsed_precise}] {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    let running = |r: &RebalanceReport| Status::new(name, "running", r, started.elapsed());
    files.write(&running(&RebalanceReport::default()))?;
    let result = runtime.block_on(async {
        let signals = tokio::spawn(stop_on_signal(interrupt, terminate, stop.clone()));
        let mut progress = |r: &RebalanceReport| {
            let status = running(r);
            bar.set_message(format!(
                "{} directories, {} files, {} moved ({} MiB)",
                r.dirs,
                r.files,
                r.moved,
                r.bytes_moved >> 20
            ));
            bar.tick();
            if let Err(e) = files.write(&status) {
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
    bar.finish_and_clear();
    let report = match result {
        Ok(report) => report,
        Err(e) => {
            let failed = Status::new(
                name,
                "failed",
                &RebalanceReport::default(),
                started.elapsed(),
            );
            let _ = files.write(&failed);
            return Err(e);
        }
    };
    let state = match (stop.load(Ordering::Relaxed), report.failed) {
        (true, _) => "stopped",
        (false, 0) => "completed",
        (false, _) => "failed",
    };
    let status = Status::new(name, state, &report, started.elapsed());
    files.write(&status)?;
    print(&status, json)?;
    if report.failed > 0 {
        bail!(
            "{} files or directories of {name} could not be rebalanced (see the log)",
            report.failed
        );
    }
    Ok(())
}

/// `rebalance VOLUME status`.
pub(crate) fn status(global: &Global, name: &str, json: bool) -> anyhow::Result<()> {
    let files = Files::of(global, name);
    let Some(mut status) = files.read()? else {
        bail!("no rebalance of {name} has run here");
    };
    if status.state == "running" && !files.running()? {
        // Killed before it could say how it ended.
        status.state = "interrupted".to_owned();
    }
    print(&status, json)
}

/// `rebalance VOLUME stop`: asks the running rebalance to stop after the file it is moving,
/// and waits until it has.
pub(crate) fn stop(global: &Global, name: &str, json: bool) -> anyhow::Result<()> {
    let files = Files::of(global, name);
    let status = files.read()?;
    let (Some(status), true) = (status, files.running()?) else {
        bail!("no rebalance of {name} is running");
    };
    let pid = rustix::process::Pid::from_raw(i32::try_from(status.pid)?)
        .context("the rebalance status names no process")?;
    rustix::process::kill_process(pid, rustix::process::Signal::INT)
        .with_context(|| format!("cannot signal the rebalance (pid {pid:?})"))?;
    let deadline = Instant::now() + STOP_WAIT;
    while files.running()? {
        if Instant::now() > deadline {
            bail!("the rebalance of {name} did not stop within {STOP_WAIT:?}");
        }
        std::thread::sleep(STOP_POLL);
    }
    match files.read()? {
        Some(status) => print(&status, json),
        None => Ok(()),
    }
}

fn print(status: &Status, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(status)?);
    } else {
        println!("{}", status.line());
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
