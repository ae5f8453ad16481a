//! A volume's cluster-wide task: `kiln volume rebalance VOLUME start|status|stop` — every file
//! of a distributed volume moved to the brick its name hashes to (`Distribute::rebalance`)
//! while clients keep using it — and `rebalance VOLUME fix-layout` (also `kiln volume heal`):
//! every directory looked up, which heals it (`Distribute::heal_tree`); `remove-brick` runs a
//! rebalance too.
//!
//! The management daemon runs it — on a cluster, the elected daemon, whichever host is asked
//! (`kiln_mgmt::tasks`) — as this command's `start|fix-layout --for-daemon`
//! ([`run_for_daemon`]) in a process of its own, which holds a lock file next to the daemon's
//! socket (one task per volume and host) and writes its progress there after each directory.
//! `start` asks for it and follows it with a progress bar until it ends (Ctrl-C stops
//! following, not the task); `stop` asks it to stop after the file it is moving and waits
//! until it has.

use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kiln_admin::command::{RebalanceStatus, RemoveAction, Request, Response, TaskAction, TaskKind};
use kiln_client::BrickClient;
use kiln_client::distribute::{Distribute, HealReport, Member, RebalanceReport};
use kiln_wire::Creds;

use crate::Global;

/// How long `stop` waits for the task to finish the file (directory) it is at.
const STOP_WAIT: Duration = Duration::from_secs(120);
/// How often a follower asks the daemon how the task is doing.
const FOLLOW_POLL: Duration = Duration::from_millis(100);
/// How long a runner goes on without a beat from its daemon (`kiln_mgmt::tasks`, which beats
/// every 500 ms and stops beating well before its leader lease could expire).
const RUNNER_FENCE: Duration = Duration::from_secs(2);
/// How long a follower waits for a task asked for to start, and rides out a daemon
/// that does not answer.
const FOLLOW_PATIENCE: Duration = Duration::from_secs(60);

fn line(status: &RebalanceStatus) -> String {
    let r = &status.report;
    let host = status
        .host
        .as_ref()
        .map(|h| format!(" on {h}"))
        .unwrap_or_default();
    if status.kind == TaskKind::FixLayout {
        return format!(
            "{}: fix-layout {}{host} — {} directories looked at, {} missing copies made, {} \
             layouts healed, {} failed, {:.1} s",
            status.volume,
            status.state,
            r.dirs,
            r.copies_made,
            r.layouts_healed,
            r.failed,
            status.elapsed_secs
        );
    }
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

/// How far this runner got: its task, its report so far, and the bricks it empties.
#[derive(Default)]
struct Progress {
    kind: TaskKind,
    report: RebalanceReport,
    leaving: Vec<usize>,
}

/// What this runner says of its task.
fn new_status(
    volume: &str,
    state: &str,
    progress: &Progress,
    elapsed: Duration,
) -> RebalanceStatus {
    RebalanceStatus {
        pid: std::process::id(),
        state: state.to_owned(),
        report: progress.report,
        elapsed_secs: elapsed.as_secs_f64(),
        leaving: progress.leaving.clone(),
        ..RebalanceStatus::wanted(volume, progress.kind)
    }
}

/// Where a volume's task keeps its lock and progress.
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

    /// The lock, taken; `None` when a task holds it.
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

/// `rebalance VOLUME start|fix-layout`: asks the daemon to run it, and follows it until it
/// ends.
pub(crate) fn start(global: &Global, name: &str, kind: TaskKind, json: bool) -> anyhow::Result<()> {
    ask(global, name, kind.start())?;
    follow(global, name, json, true, None)
}

/// `remove-brick VOLUME BRICK start|status|stop|commit|force`: `start` follows the rebalance
/// that empties the brick until it ends, `force` the one over the bricks left.
pub(crate) fn remove_brick(
    global: &Global,
    name: &str,
    brick: &Path,
    action: crate::volume::RemoveArg,
    json: bool,
) -> anyhow::Result<()> {
    use crate::volume::RemoveArg;
    let request = Request::VolumeRemoveBrick {
        name: name.to_owned(),
        brick: crate::volume::brick_spec(brick)?,
        action: match action {
            RemoveArg::Start => RemoveAction::Start,
            RemoveArg::Status => RemoveAction::Status,
            RemoveArg::Stop => RemoveAction::Stop,
            RemoveArg::Commit => RemoveAction::Commit,
            RemoveArg::Force => RemoveAction::Force,
        },
    };
    match (action, crate::volume::call(&global.socket, &request)?) {
        (RemoveArg::Start | RemoveArg::Force, Response::Rebalance(_)) => {
            follow(global, name, json, true, None)
        }
        (_, Response::Rebalance(status)) => print(&status, json),
        (_, other) => crate::volume::print_answer(other, json, false),
    }
}

/// `rebalance VOLUME status`.
pub(crate) fn status(global: &Global, name: &str, json: bool) -> anyhow::Result<()> {
    print(&ask(global, name, TaskAction::Status)?, json)
}

/// `rebalance VOLUME stop`: asks the task to stop after the file (directory) it is at, and
/// waits until it has.
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

/// Polls the task of `name` until it ends (or `stop_by`), with a progress bar if
/// `bar`; prints how it ended, an error if it failed.
fn follow(
    global: &Global,
    name: &str,
    json: bool,
    bar: bool,
    stop_by: Option<Instant>,
) -> anyhow::Result<()> {
    let progress = match bar {
        true => indicatif::ProgressBar::new_spinner(),
        false => indicatif::ProgressBar::hidden(),
    };
    progress.set_style(
        indicatif::ProgressStyle::with_template("{spinner} [{elapsed_precise}] {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    let asked = Instant::now();
    let mut answered = Instant::now();
    let status = loop {
        // (A daemon that restarts, or an etcd member that fails over, is waited out.)
        let status = match ask(global, name, TaskAction::Status) {
            Ok(status) => status,
            Err(e) if answered.elapsed() > FOLLOW_PATIENCE => return Err(e),
            Err(_) => {
                std::thread::sleep(FOLLOW_POLL);
                continue;
            }
        };
        answered = Instant::now();
        if !status.is_live() {
            break status;
        }
        if stop_by.is_some_and(|d| Instant::now() > d) {
            bail!("the task of {name} did not stop within {STOP_WAIT:?}");
        }
        if status.state == "wanted" && asked.elapsed() > FOLLOW_PATIENCE {
            bail!(
                "the task of {name} did not start within {FOLLOW_PATIENCE:?}: is a \
                 daemon leading (`kiln cluster status`)?"
            );
        }
        let r = &status.report;
        progress.set_message(match status.kind {
            TaskKind::Rebalance => format!(
                "{}: {} directories, {} files, {} moved ({} MiB)",
                status.state,
                r.dirs,
                r.files,
                r.moved,
                r.bytes_moved >> 20
            ),
            TaskKind::FixLayout => format!(
                "fix-layout {}: {} directories, {} layouts healed",
                status.state, r.dirs, r.layouts_healed
            ),
        });
        progress.tick();
        std::thread::sleep(FOLLOW_POLL);
    };
    progress.finish_and_clear();
    print(&status, json)?;
    let why = status.error.as_deref().unwrap_or("see the log");
    let left = status.report.left_on_leaving;
    if left > 0 {
        bail!("{left} entries are left on the bricks leaving {name} (see the log)");
    }
    match (status.state.as_str(), status.report.failed) {
        ("completed" | "stopped", 0) => Ok(()),
        ("completed" | "stopped", failed) => {
            bail!(
                "{failed} files or directories of {name} could not be rebalanced or healed ({why})"
            )
        }
        (state, _) => bail!("the task of {name} {state}: {why}"),
    }
}

/// `rebalance VOLUME start|fix-layout --for-daemon`: the task itself, run here for the daemon
/// that started this process, until it is done or stopped (SIGINT or SIGTERM); exits when
/// that daemon is gone.
pub(crate) fn run_for_daemon(global: &Global, name: &str, kind: TaskKind) -> anyhow::Result<()> {
    // Listened for first, so a `stop` never kills it, even before it starts moving files.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    let (interrupt, terminate) = runtime
        .block_on(async {
            use tokio::signal::unix::{SignalKind, signal};
            Ok::<_, std::io::Error>((
                signal(SignalKind::interrupt())?,
                signal(SignalKind::terminate())?,
            ))
        })
        .context("cannot listen for SIGINT and SIGTERM")?;
    exit_without_beats();
    let files = Files::of(global, name);
    let started = Instant::now();
    let last = std::sync::Mutex::new(Progress {
        kind,
        ..Progress::default()
    });
    let result = run_here(
        global,
        name,
        &files,
        &runtime,
        (interrupt, terminate),
        &last,
    );
    let last = last.into_inner().unwrap_or_else(|p| p.into_inner());
    let state = match &result {
        Ok(true) => "stopped",
        Ok(false) if last.report.failed == 0 => "completed",
        Ok(false) | Err(_) => "failed",
    };
    let status = RebalanceStatus {
        error: result.as_ref().err().map(|e| format!("{e:#}")),
        ..new_status(name, state, &last, started.elapsed())
    };
    if let Err(e) = files.write(&status) {
        eprintln!("kiln: the task's last status was not written: {e:#}");
    }
    result.map(|_| ())
}

/// The task of `name`, its progress written to `files` (and kept in `last`): whether
/// a signal stopped it.
fn run_here(
    global: &Global,
    name: &str,
    files: &Files,
    runtime: &tokio::runtime::Runtime,
    (interrupt, terminate): (tokio::signal::unix::Signal, tokio::signal::unix::Signal),
    last: &std::sync::Mutex<Progress>,
) -> anyhow::Result<bool> {
    let Some(_lock) = files.try_lock()? else {
        bail!("a task of {name} is running on this host");
    };
    let volume = crate::mount::resolve_volume(global, name)?;
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let progress = |report: &RebalanceReport| {
        let mut last = last.lock().unwrap_or_else(|p| p.into_inner());
        last.report = *report;
        new_status(name, "running", &last, started.elapsed())
    };
    runtime.block_on(async {
        let signals = tokio::spawn(stop_on_signal(interrupt, terminate, stop.clone()));
        let done = on_distributed(global, name, &volume.bricks, async |d| {
            let kind = {
                let mut last = last.lock().unwrap_or_else(|p| p.into_inner());
                if last.kind == TaskKind::Rebalance {
                    last.leaving = d.leaving();
                }
                last.kind
            };
            files
                .write(&progress(&RebalanceReport::default()))
                .map_err(|e| kiln_client::Error::Misuse(format!("the task's status: {e:#}")))?;
            let mut report = |r: &RebalanceReport| {
                if let Err(e) = files.write(&progress(r)) {
                    tracing::warn!(error = %e, "progress not written");
                }
            };
            match kind {
                TaskKind::Rebalance => d.rebalance(&stop, &mut report).await.map(drop),
                TaskKind::FixLayout => {
                    let mut healed = |h: &HealReport| report(&fix_layout_report(h));
                    let h = d
                        .heal_tree_reporting(&Creds::root(), &stop, &mut healed)
                        .await?;
                    report(&fix_layout_report(&h));
                    Ok(())
                }
            }
        })
        .await;
        signals.abort();
        done
    })?;
    Ok(stop.load(Ordering::Relaxed))
}

/// What a fix-layout says of how far it got.
fn fix_layout_report(healed: &HealReport) -> RebalanceReport {
    RebalanceReport {
        dirs: healed.dirs,
        copies_made: healed.copies_made,
        layouts_healed: healed.layouts_healed,
        failed: healed.failed,
        ..RebalanceReport::default()
    }
}

/// Runs `work` on the distribution layer over every brick of volume `name` (`members`),
/// connected for it and closed after.
async fn on_distributed<T>(
    global: &Global,
    name: &str,
    members: &[Member<SocketAddr>],
    work: impl AsyncFnOnce(&Distribute<BrickClient>) -> Result<T, kiln_client::Error>,
) -> anyhow::Result<T> {
    let members = crate::files::connect_members(global, members)
        .await
        .with_context(|| format!("cannot reach the bricks of {name}"))?;
    let bricks: Vec<BrickClient> = members.iter().filter_map(Member::brick).cloned().collect();
    let distribute = Distribute::of_members(members, name)?;
    let done = work(&distribute).await;
    for brick in bricks {
        brick.close().await;
    }
    done.with_context(|| format!("on volume {name}"))
}

/// Exits this process at once when its daemon stops beating (a byte on stdin at least every
/// [`RUNNER_FENCE`]) or is gone (the end of stdin): a task runs for one daemon, and
/// another may start it again — fenced by the daemon's lease.
fn exit_without_beats() {
    use std::io::Read as _;
    let last_beat = Arc::new(std::sync::Mutex::new(Instant::now()));
    let heard = last_beat.clone();
    std::thread::spawn(move || {
        let mut byte = [0; 64];
        loop {
            match std::io::stdin().read(&mut byte) {
                Ok(0) | Err(_) => {
                    eprintln!("kiln: the daemon that started this task is gone");
                    std::process::exit(3);
                }
                Ok(_) => *heard.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now(),
            }
        }
    });
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(RUNNER_FENCE / 4);
            let since = last_beat
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .elapsed();
            if since > RUNNER_FENCE {
                eprintln!("kiln: no beat from the daemon for {since:?}: stopping at once");
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
