//! Runs the brick processes of started volumes and keeps them running: a brick that exits is
//! started again after a backoff (1 s, doubling to 30 s; back to 1 s after a minute of
//! running); a stopped volume's bricks get SIGTERM, and SIGKILL if they do not drain in time.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kiln_admin::command::{BrickReport, BrickStatus};
use kiln_admin::control::{self, ControlAnswer, ControlRequest, ProfileReport, Statedump};
use kiln_admin::exchange::LineExchange;
use kiln_admin::options;
use kiln_admin::volume::{Brick, Volume};
use tokio::sync::watch;

use crate::lock;

/// First wait before restarting a brick that exited.
pub const RESTART_BACKOFF_MIN: Duration = Duration::from_secs(1);
/// Longest wait before restarting a brick.
pub const RESTART_BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A brick that ran this long before exiting starts again after the shortest wait.
pub const STABLE_RUN: Duration = Duration::from_secs(60);
/// How long a stopping brick may drain before it is killed.
pub const STOP_GRACE: Duration = Duration::from_secs(15);

/// Where the supervisor finds what bricks need.
#[derive(Debug, Clone)]
pub struct Launch {
    /// The `kiln-brickd` executable.
    pub brickd: PathBuf,
    /// The directory with the CA and the bricks' certificates.
    pub tls_dir: PathBuf,
    /// Each brick logs to `<log_dir>/<brick name>.log`.
    pub log_dir: PathBuf,
    /// The address bricks listen on.
    pub listen_ip: std::net::IpAddr,
    /// Each brick's control socket is `<run_dir>/<brick name>.sock`.
    pub run_dir: PathBuf,
    /// This host's name in a cluster: the supervisor runs the bricks that live here.
    pub host: Option<String>,
    /// Bricks outlive the daemon (a cluster's): they run in their own process group, are
    /// left running when the daemon exits or dies, and a daemon that starts adopts those
    /// still running. Otherwise (one host, `kiln up`) they die with it.
    pub bricks_outlive_daemon: bool,
}

impl Launch {
    fn control_socket(&self, brick_name: &str) -> PathBuf {
        self.run_dir.join(format!("{brick_name}.sock"))
    }

    /// Where the pid of the brick started last is kept.
    fn pid_file(&self, brick_name: &str) -> PathBuf {
        self.run_dir.join(format!("{brick_name}.pid"))
    }

    /// The `kiln-brickd` process pid file `name` names, if it still runs that brick.
    fn brick_process(&self, name: &str) -> Option<(u32, Vec<String>)> {
        let pid: u32 = std::fs::read_to_string(self.pid_file(name))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let args: Vec<String> = cmdline
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let is_brickd = args.first().is_some_and(|exe| exe.ends_with("kiln-brickd"));
        let serves = args.windows(2).any(|w| w[0] == "--name" && w[1] == name);
        (is_brickd && serves).then_some((pid, args))
    }

    /// The brick a previous daemon left running as `expected` arguments say (the same brick
    /// directory and address, whatever the generation and options): its pid and the
    /// generation it runs, once its control socket answers (tried a few times: a busy brick
    /// is still the brick).
    async fn running_brick(&self, name: &str, expected: &[String]) -> Option<(u32, u64)> {
        let (pid, args) = self.brick_process(name)?;
        let same_place = |flag: &str| {
            let value =
                |args: &[String]| args.windows(2).find(|w| w[0] == flag).map(|w| w[1].clone());
            value(&args[1..]) == value(expected)
        };
        if args.get(2) != expected.get(1) || !same_place("--listen") || !same_place("--volume") {
            return None;
        }
        let probe = control::EXCHANGE.with_exchange_timeout(HEALTH_TIMEOUT);
        for _ in 0..ADOPT_PROBES {
            if let Ok(answer) =
                ask(&self.control_socket(name), &ControlRequest::Status, probe).await
                && let Ok(generation) = generation_of(&answer)
            {
                return Some((pid, generation));
            }
        }
        None
    }
}

/// Probes of a brick left running before it is given up for a new one.
const ADOPT_PROBES: usize = 3;

/// The current configuration of a volume and its generation, read at every brick start so a
/// restarted brick runs what was committed last.
pub type CurrentConfig = Arc<dyn Fn(&str) -> Option<(Volume, u64)> + Send + Sync>;

/// How long a health probe of one brick may take. (A push or a query may take
/// [`control::EXCHANGE`]'s `exchange_timeout`.)
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a started brick may take to answer on its control socket before a catch-up
/// push is given up (it then gets the change at its next start).
const CATCH_UP_WAIT: Duration = Duration::from_secs(30);
/// How often a starting brick's control socket is tried.
const CATCH_UP_POLL: Duration = Duration::from_millis(50);

pub struct Supervisor {
    launch: Launch,
    current: CurrentConfig,
    bricks: Mutex<HashMap<String, Running>>,
    /// Each volume's live brick options as last pushed to (or started with) its bricks here.
    pushed: Mutex<HashMap<String, BTreeMap<String, String>>>,
    /// Held for a whole push: a `volume set`'s push and the reconcile its commit wakes would
    /// otherwise both push the same generation to every brick at once.
    pushing: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Supervisor")
            .field("launch", &self.launch)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct Running {
    stop: watch::Sender<bool>,
    run: Arc<Mutex<Run>>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Debug, Clone)]
struct Run {
    pid: Option<u32>,
    state: &'static str,
    since: Instant,
    restarts: u32,
    /// The configuration generation the brick runs.
    generation: u64,
}

impl Supervisor {
    pub fn new(launch: Launch, current: CurrentConfig) -> Arc<Supervisor> {
        Arc::new(Supervisor {
            launch,
            current,
            bricks: Mutex::new(HashMap::new()),
            pushed: Mutex::new(HashMap::new()),
            pushing: tokio::sync::Mutex::new(()),
        })
    }

    /// Whether `brick` lives on this host.
    pub fn is_local(&self, brick: &Brick) -> bool {
        brick.host == self.launch.host
    }

    /// Whether a new brick of `host` could listen on `port`: always for another host's
    /// (its daemon finds out when it starts the brick); here, unless a process holds the
    /// port's UDP (QUIC) or TCP (the brick's claim) socket now, bound as the brick binds
    /// them. A port handed to a brick not started yet is not seen: another daemon on this
    /// machine may still hand it out too.
    pub fn port_is_free(&self, host: Option<&str>, port: u16) -> bool {
        use rustix::net::{AddressFamily, SocketType};
        if host != self.launch.host.as_deref() {
            return true;
        }
        let addr = std::net::SocketAddr::new(self.launch.listen_ip, port);
        let family = match addr {
            std::net::SocketAddr::V4(_) => AddressFamily::INET,
            std::net::SocketAddr::V6(_) => AddressFamily::INET6,
        };
        [SocketType::DGRAM, SocketType::STREAM]
            .into_iter()
            .all(|kind| {
                let bound = rustix::net::socket(family, kind, None)
                    .and_then(|socket| rustix::net::bind(&socket, &addr));
                bound != Err(rustix::io::Errno::ADDRINUSE)
            })
    }

    /// The indexes of `volume`'s bricks in service that live on this host.
    pub fn local_bricks<'v>(&self, volume: &'v Volume) -> impl Iterator<Item = usize> + 'v {
        let host = self.launch.host.clone();
        let local = move |(i, b): (usize, &Brick)| (b.host == host).then_some(i);
        volume.bricks_in_service().filter_map(local)
    }

    /// The bricks run (or being restarted) here.
    pub fn running_names(&self) -> HashSet<String> {
        lock(&self.bricks).keys().cloned().collect()
    }

    /// Whether brick `name` runs (or is being restarted) here.
    pub fn is_running(&self, name: &str) -> bool {
        lock(&self.bricks).contains_key(name)
    }

    /// Starts every brick of `volume` on this host that is not running yet.
    pub fn start_volume(&self, volume: &Volume) {
        let Ok(mut bricks) = self.bricks.lock() else {
            return;
        };
        lock(&self.pushed)
            .entry(volume.name.clone())
            .or_insert_with(|| options::live_brick_options(&volume.options));
        for i in self.local_bricks(volume) {
            let name = Brick::name(&volume.name, i);
            if bricks.contains_key(&name) {
                continue;
            }
            let (stop, stopped) = watch::channel(false);
            let run = Arc::new(Mutex::new(Run {
                pid: None,
                state: "starting",
                since: Instant::now(),
                restarts: 0,
                generation: 0,
            }));
            let task = tokio::spawn(watch_brick(
                self.launch.clone(),
                self.current.clone(),
                (volume.name.clone(), i),
                run.clone(),
                stopped,
            ));
            bricks.insert(name, Running { stop, run, task });
        }
    }

    /// Stops every brick of `volume` (SIGTERM, then SIGKILL after [`STOP_GRACE`]).
    pub async fn stop_volume(&self, volume: &Volume) {
        let stopping: Vec<Running> = match self.bricks.lock() {
            Ok(mut bricks) => (0..volume.bricks.len())
                .filter_map(|i| bricks.remove(&Brick::name(&volume.name, i)))
                .collect(),
            Err(_) => return,
        };
        for running in &stopping {
            let _ = running.stop.send(true);
        }
        for running in stopping {
            let _ = running.task.await;
        }
    }

    /// Stops the bricks running here that are not in `wanted` (their volume was stopped or
    /// deleted elsewhere).
    pub async fn stop_unwanted(&self, wanted: &HashSet<String>) {
        let stopping: Vec<Running> = match self.bricks.lock() {
            Ok(mut bricks) => {
                let names: Vec<String> = bricks
                    .keys()
                    .filter(|n| !wanted.contains(*n))
                    .cloned()
                    .collect();
                names.iter().filter_map(|n| bricks.remove(n)).collect()
            }
            Err(_) => return,
        };
        for running in &stopping {
            let _ = running.stop.send(true);
        }
        for running in stopping {
            let _ = running.task.await;
        }
    }

    /// Stops the bricks a previous daemon left running that this one does not run (their
    /// volume was stopped, deleted or changed while no daemon watched): SIGTERM, and the
    /// brick drains and exits by itself.
    pub async fn stop_orphans(&self) {
        let Ok(entries) = std::fs::read_dir(&self.launch.run_dir) else {
            return;
        };
        for path in entries.filter_map(|e| e.ok().map(|e| e.path())) {
            let Some(name) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".pid"))
            else {
                continue;
            };
            if self.is_running(name) {
                continue;
            }
            if let Some((pid, _)) = self.launch.brick_process(name)
                && let Some(pid) = rustix::process::Pid::from_raw(pid as i32)
            {
                tracing::warn!(brick = %name, pid = pid.as_raw_nonzero().get(), "stopping a brick no volume here runs");
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            }
            let _ = std::fs::remove_file(&path);
        }
    }

    /// Whether `volume`'s live options differ from those its bricks here run.
    pub fn options_changed(&self, volume: &Volume) -> bool {
        lock(&self.pushed)
            .get(&volume.name)
            .is_some_and(|pushed| *pushed != options::live_brick_options(&volume.options))
    }

    /// Stops watching the bricks and leaves them running (for the next daemon to adopt).
    pub fn leave_all(&self) {
        for (_, running) in lock(&self.bricks).drain() {
            running.task.abort();
        }
    }

    /// Stops every brick.
    pub async fn stop_all(&self) {
        let all: Vec<Running> = match self.bricks.lock() {
            Ok(mut bricks) => bricks.drain().map(|(_, r)| r).collect(),
            Err(_) => return,
        };
        for running in &all {
            let _ = running.stop.send(true);
        }
        for running in all {
            let _ = running.task.await;
        }
    }

    /// Each brick of `volume`: its process, state and uptime.
    pub fn status(&self, volume: &Volume) -> Vec<BrickStatus> {
        let bricks = self.bricks.lock().ok();
        volume
            .bricks
            .iter()
            .enumerate()
            .map(|(i, brick)| {
                let run = bricks
                    .as_ref()
                    .and_then(|b| b.get(&Brick::name(&volume.name, i)))
                    .and_then(|r| r.run.lock().ok().map(|r| r.clone()));
                BrickStatus {
                    host: brick.host.clone(),
                    path: brick.path.clone(),
                    port: brick.port,
                    role: brick.role,
                    pid: run.as_ref().and_then(|r| r.pid),
                    state: match brick.role.in_service() {
                        true => run.as_ref().map_or("stopped", |r| r.state).to_owned(),
                        false => brick.role.to_string(),
                    },
                    uptime_secs: run
                        .as_ref()
                        .filter(|r| r.pid.is_some())
                        .map_or(0, |r| r.since.elapsed().as_secs()),
                    restarts: run.as_ref().map_or(0, |r| r.restarts),
                    generation: run.filter(|r| r.pid.is_some()).map(|r| r.generation),
                    health: "-".to_owned(),
                }
            })
            .collect()
    }

    /// [`Supervisor::status`] with each running brick probed on its control socket.
    /// The bricks are probed at once: a hung one costs [`HEALTH_TIMEOUT`], not one each.
    pub async fn checked_status(&self, volume: &Volume) -> Vec<BrickStatus> {
        let mut status = self.status(volume);
        let probe = control::EXCHANGE.with_exchange_timeout(HEALTH_TIMEOUT);
        let probes = status
            .iter_mut()
            .enumerate()
            .filter(|(_, b)| b.pid.is_some());
        futures_util::future::join_all(probes.map(|(i, brick)| async move {
            let socket = self.launch.control_socket(&Brick::name(&volume.name, i));
            brick.health = match ask(&socket, &ControlRequest::Status, probe).await {
                Ok(answer) => match generation_of(&answer) {
                    Ok(_) => "ok".to_owned(),
                    Err(why) => format!("unresponsive: {why}"),
                },
                Err(why) => format!("unresponsive: {why}"),
            };
        }))
        .await;
        status
    }

    /// Every running brick's profile, asked on its control socket.
    pub async fn profiles(&self, volume: &Volume) -> Vec<BrickReport<ProfileReport>> {
        self.query(volume, &ControlRequest::Profile, |answer| match answer {
            ControlAnswer::Profile { profile, .. } => Some(profile),
            _ => None,
        })
        .await
    }

    /// Every running brick's state dump, asked on its control socket.
    pub async fn statedumps(&self, volume: &Volume) -> Vec<BrickReport<Statedump>> {
        self.query(volume, &ControlRequest::Statedump, |answer| match answer {
            ControlAnswer::Statedump { statedump, .. } => Some(*statedump),
            _ => None,
        })
        .await
    }

    /// Asks every running brick of `volume` `request`; `pick` takes the report out of the
    /// answer it expects.
    async fn query<T>(
        &self,
        volume: &Volume,
        request: &ControlRequest,
        pick: impl Fn(ControlAnswer) -> Option<T>,
    ) -> Vec<BrickReport<T>> {
        let status = self.status(volume);
        let mut reports = Vec::with_capacity(status.len());
        for (i, brick) in status.into_iter().enumerate() {
            let name = Brick::name(&volume.name, i);
            let answer = match brick.pid {
                None => Err(format!("not running ({})", brick.state)),
                Some(_) => ask(
                    &self.launch.control_socket(&name),
                    request,
                    control::EXCHANGE,
                )
                .await
                .and_then(|a| pick(a).ok_or_else(|| unexpected(request))),
            };
            let (report, error) = match answer {
                Ok(report) => (Some(report), None),
                Err(e) => (None, Some(e)),
            };
            reports.push(BrickReport {
                brick: name,
                path: brick.path,
                report,
                error,
            });
        }
        reports
    }

    /// Pushes the live options of `volume` at `generation` to its running bricks that run an
    /// older generation. Returns, per brick, the generation it now runs or why it did not
    /// take the push.
    pub async fn push(
        &self,
        volume: &Volume,
        generation: u64,
    ) -> Vec<(String, Result<u64, String>)> {
        let push = live_push(volume, generation);
        let _pushing = self.pushing.lock().await;
        let mut results = Vec::new();
        for i in self.local_bricks(volume) {
            let name = Brick::name(&volume.name, i);
            if let Some(runs) = self.generation_at_least(&name, generation) {
                results.push((name, Ok(runs)));
                continue;
            }
            let socket = self.launch.control_socket(&name);
            let result = ask(&socket, &push, control::EXCHANGE)
                .await
                .and_then(|answer| generation_of(&answer));
            if let Ok(applied) = result
                && let Ok(bricks) = self.bricks.lock()
                && let Some(running) = bricks.get(&name)
                && let Ok(mut run) = running.run.lock()
            {
                run.generation = applied;
            }
            results.push((name, result));
        }
        if results.iter().all(|(_, r)| r.is_ok()) {
            lock(&self.pushed).insert(
                volume.name.clone(),
                options::live_brick_options(&volume.options),
            );
        }
        results
    }

    /// The generation brick `name` runs, if it is `generation` or later (a push took it there
    /// already).
    fn generation_at_least(&self, name: &str, generation: u64) -> Option<u64> {
        let bricks = lock(&self.bricks);
        let runs = lock(&bricks.get(name)?.run).generation;
        (runs >= generation).then_some(runs)
    }
}

/// The push of `volume`'s live options at `generation`.
fn live_push(volume: &Volume, generation: u64) -> ControlRequest {
    ControlRequest::Push {
        generation,
        options: options::live_brick_options(&volume.options),
    }
}

/// Brings a brick that has just started up to date: a live change committed while it was
/// starting (after its arguments were made, before its control socket listened, so the
/// change's push found no socket) is pushed once the socket answers.
async fn catch_up(
    socket: PathBuf,
    current: CurrentConfig,
    volume: String,
    started_at: u64,
    run: Arc<Mutex<Run>>,
) {
    let deadline = Instant::now() + CATCH_UP_WAIT;
    while ask(&socket, &ControlRequest::Status, control::EXCHANGE)
        .await
        .is_err()
    {
        if Instant::now() >= deadline {
            return;
        }
        tokio::time::sleep(CATCH_UP_POLL).await;
    }
    let Some((config, generation)) = current(&volume) else {
        return;
    };
    if generation == started_at {
        return;
    }
    let push = live_push(&config, generation);
    if let Ok(applied) = ask(&socket, &push, control::EXCHANGE)
        .await
        .and_then(|answer| generation_of(&answer))
    {
        update(&run, |r| r.generation = applied);
    }
}

/// One request over a brick's control socket: its answer, or why there is none (the error
/// it answered included).
async fn ask(
    socket: &Path,
    request: &ControlRequest,
    exchange: LineExchange,
) -> Result<ControlAnswer, String> {
    match exchange.ask(socket, request).await {
        Ok(ControlAnswer::Error { message }) => Err(message),
        Ok(answer) => Ok(answer),
        Err(e) => Err(e.to_string()),
    }
}

/// The generation a brick runs, from its answer to a push or a status probe.
fn generation_of(answer: &ControlAnswer) -> Result<u64, String> {
    match answer {
        ControlAnswer::Generation { generation } => Ok(*generation),
        _ => Err("an answer without the generation it runs".to_owned()),
    }
}

fn unexpected(request: &ControlRequest) -> String {
    format!("an answer that does not fit the request {request:?}")
}

/// `kiln-brickd serve` arguments for brick `index` of `volume` at `generation`: where and as
/// whom it serves, then every brick option from the option table.
fn brick_args(launch: &Launch, volume: &Volume, index: usize, generation: u64) -> Vec<String> {
    let name = Brick::name(&volume.name, index);
    let brick = &volume.bricks[index];
    let mut args = vec![
        "serve".to_owned(),
        brick.path.display().to_string(),
        "--listen".to_owned(),
        std::net::SocketAddr::new(launch.listen_ip, brick.port).to_string(),
        "--tls-dir".to_owned(),
        launch.tls_dir.display().to_string(),
        "--name".to_owned(),
        name.clone(),
        "--volume".to_owned(),
        volume.name.clone(),
        "--control".to_owned(),
        launch.control_socket(&name).display().to_string(),
        "--generation".to_owned(),
        generation.to_string(),
    ];
    if !launch.bricks_outlive_daemon {
        args.push("--die-with-parent".to_owned());
    }
    args.extend(options::brick_args(&volume.options, index));
    args
}

/// Runs one brick until `stopped` says so, restarting it when it exits.
async fn watch_brick(
    launch: Launch,
    current: CurrentConfig,
    (volume, index): (String, usize),
    run: Arc<Mutex<Run>>,
    mut stopped: watch::Receiver<bool>,
) {
    let name = Brick::name(&volume, index);
    let mut backoff = RESTART_BACKOFF_MIN;
    if launch.bricks_outlive_daemon
        && let Some((config, generation)) = current(&volume).filter(|(v, _)| index < v.bricks.len())
        && let Some((pid, runs)) = launch
            .running_brick(&name, &brick_args(&launch, &config, index, generation))
            .await
    {
        update(&run, |r| {
            r.pid = Some(pid);
            r.state = "running";
            r.since = Instant::now();
            r.generation = runs;
        });
        tracing::info!(brick = %name, pid, generation = runs, "adopted the running brick");
        // Changes made while no daemon watched it.
        let socket = launch.control_socket(&name);
        catch_up(socket, current.clone(), volume.clone(), runs, run.clone()).await;
        if !watch_adopted(pid, &name, &mut stopped).await {
            update(&run, |r| {
                r.pid = None;
                r.state = "stopped";
            });
            return;
        }
    }
    loop {
        let Some((config, generation)) = current(&volume).filter(|(v, _)| index < v.bricks.len())
        else {
            update(&run, |r| r.state = "stopped");
            return;
        };
        let args = brick_args(&launch, &config, index, generation);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(launch.log_dir.join(format!("{name}.log")));
        let mut command = tokio::process::Command::new(&launch.brickd);
        command
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .kill_on_drop(!launch.bricks_outlive_daemon);
        if launch.bricks_outlive_daemon {
            // Not in the daemon's process group: a signal to the daemon's group (Ctrl-C)
            // is not one to its bricks.
            command.process_group(0);
        }
        if let Ok(log) = log {
            command.stderr(log);
        }
        let started = Instant::now();
        match command.spawn() {
            Ok(mut child) => {
                let pid = child.id();
                if let Some(pid) = pid
                    && let Err(e) = std::fs::write(launch.pid_file(&name), format!("{pid}\n"))
                {
                    tracing::warn!(brick = %name, error = %e, "cannot write the brick's pid file");
                }
                update(&run, |r| {
                    r.pid = pid;
                    r.state = "running";
                    r.since = Instant::now();
                    r.generation = generation;
                });
                tracing::info!(brick = %name, pid, "brick started");
                let socket = launch.control_socket(&name);
                let catch_up = catch_up(
                    socket,
                    current.clone(),
                    volume.clone(),
                    generation,
                    run.clone(),
                );
                tokio::pin!(catch_up);
                let mut caught_up = false;
                loop {
                    tokio::select! {
                        exit = child.wait() => {
                            let how = exit.map_or_else(|e| e.to_string(), |s| s.to_string());
                            tracing::warn!(brick = %name, %how, ?backoff, "brick exited; restarting");
                            break;
                        }
                        () = stop_requested(&mut stopped) => {
                            terminate(&mut child).await;
                            update(&run, |r| { r.pid = None; r.state = "stopped"; });
                            tracing::info!(brick = %name, "brick stopped");
                            return;
                        }
                        () = &mut catch_up, if !caught_up => caught_up = true,
                    }
                }
            }
            Err(e) => tracing::error!(brick = %name, error = %e, "cannot start brick"),
        }
        if started.elapsed() >= STABLE_RUN {
            backoff = RESTART_BACKOFF_MIN;
        }
        update(&run, |r| {
            r.pid = None;
            r.state = "restarting";
            r.restarts += 1;
        });
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            () = stop_requested(&mut stopped) => {
                update(&run, |r| r.state = "stopped");
                return;
            }
        }
        backoff = (backoff * 2).min(RESTART_BACKOFF_MAX);
    }
}

/// How often an adopted brick (not this daemon's child, so not waited for) is checked.
const ADOPTED_POLL: Duration = Duration::from_millis(250);

/// Watches adopted brick `pid` until it exits (`true`: start it again) or is asked to
/// stop (`false`, after SIGTERM and, past [`STOP_GRACE`], SIGKILL). Through a pidfd: it
/// names this process for good (a pid reused later is never signalled), and it polls
/// readable once the process has exited, zombie or not.
async fn watch_adopted(pid: u32, name: &str, stopped: &mut watch::Receiver<bool>) -> bool {
    use rustix::process::{Pid, PidfdFlags, Signal, pidfd_open, pidfd_send_signal};
    let Some(pidfd) =
        Pid::from_raw(pid as i32).and_then(|p| pidfd_open(p, PidfdFlags::empty()).ok())
    else {
        tracing::warn!(brick = %name, pid, "adopted brick is gone; restarting");
        return true;
    };
    let exited = || {
        let mut fds = [rustix::event::PollFd::new(
            &pidfd,
            rustix::event::PollFlags::IN,
        )];
        let now = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        rustix::event::poll(&mut fds, Some(&now)).map_or(true, |ready| ready > 0)
    };
    loop {
        tokio::select! {
            () = tokio::time::sleep(ADOPTED_POLL) => {
                if exited() {
                    tracing::warn!(brick = %name, pid, "adopted brick exited; restarting");
                    return true;
                }
            }
            () = stop_requested(stopped) => {
                let _ = pidfd_send_signal(&pidfd, Signal::TERM);
                let deadline = Instant::now() + STOP_GRACE;
                while !exited() && Instant::now() < deadline {
                    tokio::time::sleep(ADOPTED_POLL).await;
                }
                if !exited() {
                    let _ = pidfd_send_signal(&pidfd, Signal::KILL);
                }
                tracing::info!(brick = %name, "brick stopped");
                return false;
            }
        }
    }
}

/// Completes when the brick is asked to stop (or the supervisor is gone).
async fn stop_requested(stopped: &mut watch::Receiver<bool>) {
    let _ = stopped.wait_for(|s| *s).await;
}

fn update(run: &Mutex<Run>, f: impl FnOnce(&mut Run)) {
    if let Ok(mut r) = run.lock() {
        f(&mut r);
    }
}

/// SIGTERM, a bounded wait for the drain, then SIGKILL.
async fn terminate(child: &mut tokio::process::Child) {
    if let Some(pid) = child
        .id()
        .and_then(|p| rustix::process::Pid::from_raw(p as i32))
    {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
    if tokio::time::timeout(STOP_GRACE, child.wait())
        .await
        .is_err()
    {
        let _ = child.kill().await;
    }
}
