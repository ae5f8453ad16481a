//! `kiln-brickd`: the brick process.
//!
//! ```text
//! kiln-brickd format BRICK_DIR      make an empty directory a Kiln brick, or adopt a
//!                                   GlusterFS brick in place (its files stay; GlusterFS's
//!                                   trusted.glusterfs.mdata times are removed)
//! kiln-brickd check [--repair] BRICK_DIR
//!                                   find (and repair) stale handles, missing gfids,
//!                                   dangling directory handles, interrupted fops
//! kiln-brickd serve BRICK_DIR --listen ADDR --tls-dir DIR --name NAME [options]
//!                                   repair interrupted fops, then serve clients over QUIC
//!                                   until SIGTERM or SIGINT
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use kiln_admin::control::StartSettings;
use kiln_admin::options::BrickSettings;
use kiln_admin::pki;
use kiln_dataplane::server::access::parse_names;
use kiln_dataplane::server::{
    AuthAllow, ConnectionLimits, LiveConfig, RootSquash, Server, ServerConfig,
};
use kiln_dataplane::{Brick, Engine, EngineConfig, metrics, recovery};

mod control;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "kiln-brickd", about = "The Kiln brick server", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Make an empty directory (or an existing GlusterFS brick) a Kiln brick.
    ///
    /// A GlusterFS brick (`.glusterfs/` and the root gfid on its root) is adopted in place: no
    /// file is copied or moved, and `trusted.glusterfs.mdata` is removed from every object, so
    /// GlusterFS, if it serves the brick again, shows the times Kiln keeps on the inodes. Run it
    /// while nothing serves the brick, and again each time the brick comes back from GlusterFS.
    /// Any other directory that holds data is refused.
    Format { brick_dir: PathBuf },
    /// Find (and with --repair, fix) stale handles, missing gfids and interrupted fops.
    Check {
        #[arg(long)]
        repair: bool,
        brick_dir: PathBuf,
    },
    /// Serve the brick to clients over QUIC with mutual TLS.
    Serve(Box<ServeArgs>),
}

#[derive(clap::Args)]
struct ServeArgs {
    brick_dir: PathBuf,
    /// UDP address to listen on (port 0 picks a free port; the address is printed).
    #[arg(long, default_value = "127.0.0.1:26100")]
    listen: SocketAddr,
    /// Directory with ca.crt and this brick's brick-NAME.crt and brick-NAME.key.
    #[arg(long, env = "KILN_TLS_DIR")]
    tls_dir: PathBuf,
    /// The brick's certificate name (`kiln cert issue --brick NAME`).
    #[arg(long, default_value = "brick")]
    name: String,
    /// The volume options a brick takes, one flag each, with the option table's defaults,
    /// values and help (`kiln volume set help`).
    #[command(flatten)]
    options: BrickSettings,
    /// Ring workers that each run a QUIC endpoint on the shared port; default all.
    #[arg(long)]
    endpoints: Option<usize>,
    /// Volume name told to clients; default: the brick directory's name.
    #[arg(long)]
    volume: Option<String>,
    /// Seconds to let calls in flight finish after SIGTERM.
    #[arg(long, default_value_t = 10)]
    shutdown_grace_secs: u64,
    /// A Unix socket (mode 0600) on which kiln-mgmtd pushes live options.
    #[arg(long)]
    control: Option<PathBuf>,
    /// The configuration generation these arguments come from (reported back on pushes).
    #[arg(long, default_value_t = 0)]
    generation: u64,
    /// Stop (as on SIGTERM) when the parent process dies: set by kiln-mgmtd, so a brick never
    /// outlives its supervisor and a restarted supervisor starts it afresh.
    #[arg(long)]
    die_with_parent: bool,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let result = match Cli::parse().command {
        Command::Format { brick_dir } => format(&brick_dir),
        Command::Check { repair, brick_dir } => check(&brick_dir, repair),
        Command::Serve(args) => serve(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kiln-brickd: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn format(dir: &std::path::Path) -> anyhow::Result<()> {
    let formatted = Brick::format(dir)?;
    match formatted.adopted {
        None => println!("formatted {} as brick {}", dir.display(), formatted.id),
        Some(adoption) => println!(
            "adopted {} in place as brick {}: {adoption}",
            dir.display(),
            formatted.id
        ),
    }
    Ok(())
}

fn check(dir: &std::path::Path, repair: bool) -> anyhow::Result<()> {
    let brick = Brick::open(dir)?;
    let report = recovery::check(&brick, repair).map_err(std::io::Error::from)?;
    println!("{report}");
    if report.problems() > 0 && !repair {
        anyhow::bail!(
            "{} problems found; run with --repair to fix them",
            report.problems()
        );
    }
    Ok(())
}

/// An exclusive lock on the brick's `.glusterfs/kiln-brickd.lock`, held while serving.
fn lock_brick(brick: &Brick) -> anyhow::Result<std::fs::File> {
    let path = brick.path.join(".glusterfs/kiln-brickd.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(file),
        Err(rustix::io::Errno::WOULDBLOCK) => anyhow::bail!(
            "brick {} is already served by another kiln-brickd",
            brick.path.display()
        ),
        Err(e) => Err(e).with_context(|| format!("cannot lock {}", path.display())),
    }
}

fn serve(args: &ServeArgs) -> anyhow::Result<()> {
    let parent = args.die_with_parent.then(watch_parent).transpose()?;
    let files = pki::identity_files(
        &args.tls_dir,
        &pki::Role::Brick { hosts: vec![] },
        &args.name,
    );
    let identity = pki::load_identity(&pki::ca_files(&args.tls_dir).cert, &files)?;
    let settings = &args.options;
    let live = live_config(settings)?;

    let brick = Arc::new(
        Brick::open(&args.brick_dir)
            .with_context(|| format!("cannot open brick {}", args.brick_dir.display()))?,
    );
    // One server per brick: a second one would "repair" the first's fops in flight.
    let _lock = lock_brick(&brick)?;
    let repaired = recovery::repair(&brick).map_err(std::io::Error::from)?;
    tracing::info!(brick = %brick.id, ?repaired, "brick open");

    let engine = Engine::start(&brick, &engine_config(settings))?;
    // Tests and operators read which engine really runs (io_uring may fall back).
    tracing::info!(engine = %engine.kind().name(), workers = engine.workers(), "engine started");
    engine
        .profile()
        .set(settings.count_fop_hits, settings.latency_measurement);
    let mut config = ServerConfig::new(args.listen, identity);
    config.live = live;
    config.endpoints = args.endpoints.unwrap_or(usize::MAX);
    config.volume = args.volume.clone().unwrap_or_else(|| {
        let dir = args
            .brick_dir
            .canonicalize()
            .unwrap_or(args.brick_dir.clone());
        dir.file_name()
            .map_or("kiln".into(), |n| n.to_string_lossy().into_owned())
    });
    let start = StartSettings {
        brick: brick.path.clone(),
        brick_id: brick.id.to_string(),
        options: settings.clone(),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(run(args, engine, brick.id, config, start, parent))
}

/// Fires when this process's parent has exited ([`watch_parent`]).
type ParentExit = tokio::sync::oneshot::Receiver<()>;

/// Watches this process's parent through a pidfd, on a thread of its own. Not
/// `PR_SET_PDEATHSIG`: that signal comes when the parent *thread* that spawned this process
/// ends, and a tokio runtime ends its idle threads (a brick spawned on one got SIGTERM about
/// ten seconds later, with its clients' calls in flight).
fn watch_parent() -> anyhow::Result<ParentExit> {
    use rustix::event::{PollFd, PollFlags, poll};
    let parent = rustix::process::getppid().context("no parent process")?;
    let pidfd = rustix::process::pidfd_open(parent, rustix::process::PidfdFlags::empty())
        .context("cannot watch the parent process")?;
    // The parent may have died, and this process been adopted, before the pidfd was opened.
    if parent.as_raw_nonzero().get() == 1 || rustix::process::getppid() != Some(parent) {
        anyhow::bail!("the parent process is gone; not serving");
    }
    let (exited, exit) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("parent-watch".into())
        .spawn(move || {
            // Readable once the process has exited.
            let mut fds = [PollFd::new(&pidfd, PollFlags::IN)];
            let polled = loop {
                match poll(&mut fds, None) {
                    Err(rustix::io::Errno::INTR) => continue,
                    polled => break polled,
                }
            };
            if let Err(e) = polled {
                tracing::error!(error = %e, "cannot watch the parent process: stopping");
            }
            let _ = exited.send(());
        })?;
    Ok(exit)
}

/// Resolves when the parent watched by `exit` has exited; never without one.
async fn parent_exit(exit: &mut Option<ParentExit>) {
    match exit {
        Some(exit) => drop(exit.await),
        None => std::future::pending().await,
    }
}

/// The engine as the brick options say.
fn engine_config(settings: &BrickSettings) -> EngineConfig {
    EngineConfig::from(settings)
}

/// What the server changes while running, as the brick options say.
fn live_config(settings: &BrickSettings) -> anyhow::Result<LiveConfig> {
    Ok(LiveConfig {
        auth_allow: AuthAllow::parse(&settings.auth_allow).context("auth.allow")?,
        revoked: settings
            .revoked
            .split(',')
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect(),
        inflight_max: settings.inflight_max,
        root_squash: RootSquash {
            enabled: settings.root_squash,
            anon_uid: settings.anon_uid,
            anon_gid: settings.anon_gid,
            root_allow: parse_names(&settings.root_allow).context("server.root-allow")?,
        },
        connections: ConnectionLimits {
            per_brick: settings.connections_max,
            per_client: settings.connections_per_client_max,
        },
    })
}

/// Serves until SIGTERM or SIGINT, answering the control socket meanwhile, then drains.
async fn run(
    args: &ServeArgs,
    engine: Engine,
    brick_id: kiln_wire::BrickId,
    config: ServerConfig,
    start: StartSettings,
    mut parent: Option<ParentExit>,
) -> anyhow::Result<()> {
    // Bound first: a brick that cannot serve what it was asked to does not serve at all.
    let metrics = match start.options.metrics_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot serve metrics on {addr}"))?,
        ),
        None => None,
    };
    let server = Server::start(&engine, brick_id, config).await?;
    // Scripts and tests read the address from this line (the port may have been 0).
    println!("listening on {}", server.local_addr());
    if let Some(listener) = metrics {
        let local = listener.local_addr()?;
        tracing::info!(%local, "serving Prometheus metrics at /metrics");
        let connections = server.connections().clone();
        tokio::spawn(metrics::serve(listener, engine.clone(), connections));
    }

    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let control = match &args.control {
        Some(path) => Some(control::bind(path)?),
        None => None,
    };
    let mut running = control::Running {
        server,
        engine,
        generation: args.generation,
        settings: start.options.clone(),
        start,
        started: std::time::Instant::now(),
    };
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            () = parent_exit(&mut parent) => {
                tracing::warn!("the parent process exited");
                break;
            }
            Some(accepted) = async { Some(control.as_ref()?.accept().await) } => {
                if let Ok((stream, _)) = accepted {
                    control::serve(stream, &mut running).await;
                }
            }
        }
    }
    tracing::info!("shutting down: draining calls in flight");
    running
        .server
        .shutdown(Duration::from_secs(args.shutdown_grace_secs))
        .await;
    tracing::info!("stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_dataplane::EngineKind;

    fn serve_args(extra: &[&str]) -> ServeArgs {
        let base = ["kiln-brickd", "serve", "/bricks/b0", "--tls-dir", "/tls"];
        let cli = Cli::try_parse_from(base.iter().chain(extra)).expect("valid arguments");
        match cli.command {
            Command::Serve(args) => *args,
            _ => panic!("not serve"),
        }
    }

    #[test]
    fn every_flag_name_still_works_and_reaches_the_engine() {
        let args = serve_args(&[
            "--listen",
            "127.0.0.1:0",
            "--name",
            "b",
            "--volume",
            "v",
            "--control",
            "/run/b.sock",
            "--generation",
            "7",
            "--shutdown-grace-secs",
            "1",
            "--endpoints",
            "1",
            "--die-with-parent",
            "--auth-allow",
            "alice, bob",
            "--engine",
            "blocking",
            "--workers",
            "2",
            "--inflight-max",
            "4",
            "--gfid-cache-entries",
            "2048",
            "--dirfd-cache-entries",
            "32",
            "--ring-entries",
            "64",
            "--fsync-policy",
            "write-through",
            "--count-fop-hits",
            "--latency-measurement",
            "--metrics-listen",
            "127.0.0.1:9713",
        ]);
        let settings = &args.options;
        assert_eq!(settings.auth_allow, "alice,bob");
        assert_eq!(settings.inflight_max, 4);
        assert!(settings.count_fop_hits && settings.latency_measurement);
        assert_eq!(settings.metrics_listen, "127.0.0.1:9713".parse().ok());
        assert_eq!(args.generation, 7);
        let config = engine_config(settings);
        assert_eq!(config.kind, EngineKind::Blocking);
        assert_eq!(config.workers, 2);
        assert_eq!(config.fops.gfid_cache_entries.get(), 2048);
        assert_eq!(config.fops.dirfd_cache_entries.get(), 32);
        assert_eq!(config.ring.ring_entries, 64);
        assert!(config.fops.write_through);
    }

    #[test]
    fn defaults_are_the_option_tables() {
        let args = serve_args(&[]);
        let table = BrickSettings::from_options(&Default::default()).expect("defaults");
        assert_eq!(args.options, table);
        let config = engine_config(&args.options);
        let default = EngineConfig::default();
        assert_eq!(config.workers, default.workers, "one worker per core");
        assert_eq!(
            config.fops.gfid_cache_entries,
            default.fops.gfid_cache_entries
        );
        assert_eq!(config.ring.ring_entries, default.ring.ring_entries);
        assert!(
            Cli::try_parse_from([
                "kiln-brickd",
                "serve",
                "/b",
                "--tls-dir",
                "/t",
                "--ring-entries",
                "8"
            ])
            .is_err()
        );
    }
}
