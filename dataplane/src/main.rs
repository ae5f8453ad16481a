//! `kiln-brickd`: the brick process.
//!
//! ```text
//! kiln-brickd format BRICK_DIR      make an empty directory a Kiln brick
//! kiln-brickd check [--repair] BRICK_DIR
//!                                   find (and repair) stale handles, missing gfids,
//!                                   dangling directory handles, interrupted fops
//! kiln-brickd serve BRICK_DIR --listen ADDR --tls-dir DIR --name NAME [options]
//!                                   repair interrupted fops, then serve clients over QUIC
//!                                   until SIGTERM or SIGINT
//! ```

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use kiln_dataplane::server::{AuthAllow, Server, ServerConfig};
use kiln_dataplane::{Brick, Engine, EngineConfig, EngineKind, metrics, recovery};
use kiln_mgmt::pki;

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
    #[arg(long, default_value = "127.0.0.1:24007")]
    listen: SocketAddr,
    /// Directory with ca.crt and this brick's brick-NAME.crt and brick-NAME.key.
    #[arg(long, env = "KILN_TLS_DIR")]
    tls_dir: PathBuf,
    /// The brick's certificate name (`kiln cert issue --brick NAME`).
    #[arg(long, default_value = "brick")]
    name: String,
    /// Client names allowed in: `*` or a comma-separated list (auth.allow).
    #[arg(long, default_value = "*")]
    auth_allow: String,
    /// Executor for fops (server.engine).
    #[arg(long, value_enum, default_value_t = EngineArg::Uring)]
    engine: EngineArg,
    /// Worker threads (server.event-threads); default one per core.
    #[arg(long)]
    workers: Option<usize>,
    /// Cached inode → GFID entries (network.inode-lru-limit).
    #[arg(long)]
    gfid_cache_entries: Option<usize>,
    /// Directory fds held open (storage.dirfd-cache-entries).
    #[arg(long)]
    dirfd_cache_entries: Option<usize>,
    /// Submission queue entries of each worker's ring (server.ring-entries).
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(16..=32_768))]
    ring_entries: u32,
    /// Calls in flight per connection (network.inflight-max).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=4096))]
    inflight_max: u32,
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
    /// When written data is durable (storage.fsync-policy): when clients fsync, or before
    /// every WRITE and PUT is acknowledged.
    #[arg(long, value_enum, default_value_t = FsyncPolicy::AsRequested)]
    fsync_policy: FsyncPolicy,
    /// Count calls per fop from the start (diagnostics.count-fop-hits; switched live by
    /// pushes on the control socket).
    #[arg(long)]
    count_fop_hits: bool,
    /// Time every fop from the start (diagnostics.latency-measurement).
    #[arg(long)]
    latency_measurement: bool,
    /// Serve Prometheus metrics over HTTP at this TCP address (diagnostics.metrics-listen);
    /// off when not given.
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// Stop (as on SIGTERM) when the parent process dies: set by kiln-mgmtd, so a brick never
    /// outlives its supervisor and a restarted supervisor starts it afresh.
    #[arg(long)]
    die_with_parent: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum FsyncPolicy {
    AsRequested,
    WriteThrough,
}

#[derive(Clone, Copy, ValueEnum)]
enum EngineArg {
    Uring,
    Blocking,
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
        Command::Format { brick_dir } => Brick::format(&brick_dir)
            .map(|id| println!("formatted {} as brick {id}", brick_dir.display()))
            .map_err(anyhow::Error::from),
        Command::Check { repair, brick_dir } => check(&brick_dir, repair),
        Command::Serve(args) => serve(*args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kiln-brickd: {e:#}");
            ExitCode::FAILURE
        }
    }
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

/// A boolean as the option table writes it.
fn on_off(on: bool) -> String {
    if on { "on" } else { "off" }.to_owned()
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

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    if args.die_with_parent {
        rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::TERM))?;
        // The parent may have died before the call above.
        if rustix::process::getppid().is_none_or(|p| p.as_raw_nonzero().get() == 1) {
            anyhow::bail!("the parent process is gone; not serving");
        }
    }
    let files = pki::identity_files(
        &args.tls_dir,
        &pki::Role::Brick { hosts: vec![] },
        &args.name,
    );
    let identity = pki::load_identity(&pki::ca_files(&args.tls_dir).cert, &files)?;
    let auth_allow = AuthAllow::parse(&args.auth_allow).context("--auth-allow")?;

    let brick = Arc::new(
        Brick::open(&args.brick_dir)
            .with_context(|| format!("cannot open brick {}", args.brick_dir.display()))?,
    );
    // One server per brick: a second one would "repair" the first's fops in flight.
    let _lock = lock_brick(&brick)?;
    let repaired = recovery::repair(&brick).map_err(std::io::Error::from)?;
    tracing::info!(brick = %brick.id, ?repaired, "brick open");

    let mut engine_config = EngineConfig {
        kind: match args.engine {
            EngineArg::Uring => EngineKind::Uring,
            EngineArg::Blocking => EngineKind::Blocking,
        },
        ..EngineConfig::default()
    };
    if let Some(workers) = args.workers {
        engine_config.workers = workers.max(1);
    }
    if let Some(n) = args
        .gfid_cache_entries
        .and_then(std::num::NonZeroUsize::new)
    {
        engine_config.fops.gfid_cache_entries = n;
    }
    if let Some(n) = args
        .dirfd_cache_entries
        .and_then(std::num::NonZeroUsize::new)
    {
        engine_config.fops.dirfd_cache_entries = n;
    }
    engine_config.ring.ring_entries = args.ring_entries;
    engine_config.fops.write_through = matches!(args.fsync_policy, FsyncPolicy::WriteThrough);
    let engine = Engine::start(&brick, &engine_config)?;
    engine
        .profile()
        .set(args.count_fop_hits, args.latency_measurement);
    let settings = serde_json::json!({
        "brick": brick.path,
        "brick_id": brick.id.to_string(),
        "ring_entries": args.ring_entries,
        "gfid_cache_entries": engine_config.fops.gfid_cache_entries,
        "dirfd_cache_entries": engine_config.fops.dirfd_cache_entries,
        "inflight_max": args.inflight_max,
        "write_through": engine_config.fops.write_through,
        "auth_allow": args.auth_allow,
        "metrics_listen": args.metrics_listen,
    });

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let mut config = ServerConfig::new(args.listen, identity);
        config.auth_allow = auth_allow;
        config.inflight_max = args.inflight_max;
        config.endpoints = args.endpoints.unwrap_or(usize::MAX);
        config.volume = args.volume.unwrap_or_else(|| {
            let dir = args
                .brick_dir
                .canonicalize()
                .unwrap_or(args.brick_dir.clone());
            dir.file_name()
                .map_or("kiln".into(), |n| n.to_string_lossy().into_owned())
        });
        // Bound first: a brick that cannot serve what it was asked to does not serve at all.
        let metrics = match args.metrics_listen {
            Some(addr) => Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("cannot serve metrics on {addr}"))?,
            ),
            None => None,
        };
        let server = Server::start(&engine, brick.id, config).await?;
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
            engine: engine.clone(),
            generation: args.generation,
            settings,
            live: BTreeMap::from([
                ("auth.allow".to_owned(), args.auth_allow.clone()),
                (
                    "network.inflight-max".to_owned(),
                    args.inflight_max.to_string(),
                ),
                (
                    "diagnostics.count-fop-hits".to_owned(),
                    on_off(args.count_fop_hits),
                ),
                (
                    "diagnostics.latency-measurement".to_owned(),
                    on_off(args.latency_measurement),
                ),
            ]),
            started: std::time::Instant::now(),
        };
        loop {
            tokio::select! {
                _ = term.recv() => break,
                _ = int.recv() => break,
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
        anyhow::Ok(())
    })
}
