//! `kiln-mgmtd`: the management daemon. Holds the volume configuration in its state directory
//! (or, with `--etcd` or after `kiln-mgmtd init|join` — what `kiln cluster init|join` run —,
//! in etcd, shared with the daemons of the other hosts), runs the bricks of started volumes
//! that live on its host, and takes commands from `kiln volume …` on a root-only Unix socket.
//! Stops its bricks and exits on SIGTERM or SIGINT.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kiln_admin::command::DEFAULT_SOCKET;
use kiln_mgmt::daemon::{self, DaemonConfig};
use kiln_mgmt::membership::{self, ClusterFile};
use kiln_mgmt::store::etcd::EtcdTarget;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "kiln-mgmtd",
    about = "The Kiln management daemon",
    version,
    args_conflicts_with_subcommands = true
)]
struct Args {
    /// Configuration store, TLS material and brick logs.
    #[arg(
        long,
        env = "KILN_STATE_DIR",
        default_value = "/var/lib/kiln",
        global = true
    )]
    state_dir: PathBuf,
    #[command(subcommand)]
    setup: Option<Setup>,
    /// The command socket (mode 0600).
    #[arg(long, env = "KILN_MGMT_SOCKET", default_value = DEFAULT_SOCKET)]
    socket: PathBuf,
    /// The brick executable; default: `kiln-brickd` beside this one, else from PATH.
    #[arg(long)]
    brickd: Option<PathBuf>,
    /// Address the bricks listen on.
    #[arg(long, default_value = "127.0.0.1")]
    listen_ip: std::net::IpAddr,
    /// Keep the configuration in etcd, shared with the other hosts' daemons: the members'
    /// client URLs (`http://HOST:2379`), comma-separated. Default: the cluster the state
    /// directory's `cluster.json` names (`kiln cluster init|join`), else the embedded store.
    #[arg(long, env = "KILN_ETCD", value_delimiter = ',', requires = "host")]
    etcd: Vec<String>,
    /// The cluster's name in etcd (its keys are under `/kiln/<cluster>/`).
    #[arg(long, env = "KILN_CLUSTER", default_value = "kiln")]
    cluster: String,
    /// This host's name in the cluster: how clients and other hosts reach its bricks (an
    /// address, or a name they resolve). Bricks given as `HOST:PATH` live on host HOST.
    #[arg(long, env = "KILN_HOST")]
    host: Option<String>,
}

/// Setting up this host's membership of a cluster (run once, before the daemon starts).
#[derive(Subcommand)]
enum Setup {
    /// Make this host the first of a cluster on etcd (its CA made if it has none) and record
    /// the cluster in the state directory; `--embedded` forgets any cluster instead.
    Init {
        /// The etcd members' client URLs, comma-separated.
        #[arg(
            long,
            value_delimiter = ',',
            required_unless_present = "embedded",
            requires = "host"
        )]
        etcd: Vec<String>,
        /// Keep the configuration on this host (the default of a new daemon).
        #[arg(long, conflicts_with_all = ["etcd", "host"])]
        embedded: bool,
        /// The cluster's name.
        #[arg(long, default_value = "kiln")]
        cluster: String,
        /// This host's name in the cluster: how clients and other hosts reach its bricks.
        #[arg(long)]
        host: Option<String>,
    },
    /// Join a cluster with a token from `kiln cluster token`: this host's keys are made here,
    /// a host with the cluster CA's key signs them.
    Join {
        /// A member host (its etcd at `http://HOST:2379`) or an etcd client URL; repeatable.
        #[arg(required = true)]
        via: Vec<String>,
        /// The one-time token.
        #[arg(long, env = "KILN_JOIN_TOKEN")]
        token: kiln_admin::join::Token,
        /// This host's name in the cluster.
        #[arg(long)]
        host: String,
        /// More names or addresses its bricks are reached at (beside the host's name and
        /// the loopback ones); repeatable.
        #[arg(long = "name")]
        names: Vec<String>,
    },
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
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kiln-mgmtd: cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = match args.setup {
        Some(setup) => runtime.block_on(set_up(&args.state_dir, setup)),
        None => runtime.block_on(serve(args)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kiln-mgmtd: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn set_up(state_dir: &std::path::Path, setup: Setup) -> anyhow::Result<()> {
    match setup {
        Setup::Init { embedded: true, .. } => {
            if let Some(file) = ClusterFile::load(state_dir)? {
                anyhow::bail!(
                    "this host is a member of cluster {}: `kiln cluster leave` first",
                    file.cluster
                );
            }
            println!(
                "this host's daemon keeps its configuration in {}",
                state_dir.display()
            );
        }
        Setup::Init {
            etcd,
            cluster,
            host,
            ..
        } => {
            let file = ClusterFile {
                cluster,
                etcd,
                host: host.expect("clap requires --host with --etcd"),
            };
            membership::init(state_dir, &file).await?;
            println!(
                "cluster {} on etcd {}: this host ({}) is its first member; start kiln-mgmtd",
                file.cluster,
                file.etcd.join(","),
                file.host
            );
        }
        Setup::Join {
            via,
            token,
            host,
            names,
        } => {
            let via = via.into_iter().map(|v| etcd_url(&v)).collect();
            let mut all: Vec<String> = Vec::new();
            let defaults = [host.as_str(), "localhost", "127.0.0.1", "::1"];
            for name in defaults.into_iter().chain(names.iter().map(String::as_str)) {
                if !all.iter().any(|n| n == name) {
                    all.push(name.to_owned());
                }
            }
            let file = membership::join(state_dir, via, &token, &host, all).await?;
            println!(
                "joined cluster {} as host {}; start kiln-mgmtd",
                file.cluster, file.host
            );
        }
    }
    Ok(())
}

/// An etcd client URL: as given, or `http://HOST:2379` for a host name or address.
fn etcd_url(via: &str) -> String {
    match (via.contains("://"), via.parse::<std::net::Ipv6Addr>()) {
        (true, _) => via.to_owned(),
        (false, Ok(ip)) => format!("http://[{ip}]:2379"),
        (false, Err(_)) => format!("http://{via}:2379"),
    }
}

async fn serve(args: Args) -> anyhow::Result<()> {
    let brickd = args
        .brickd
        .or_else(|| kiln_admin::find_binary("kiln-brickd"))
        .unwrap_or_else(|| PathBuf::from("kiln-brickd"));
    let kiln = kiln_admin::find_binary("kiln").unwrap_or_else(|| PathBuf::from("kiln"));
    // The flags win over the state directory's cluster file, and do not mix with it.
    let (etcd, host) = match (args.etcd.is_empty(), ClusterFile::load(&args.state_dir)?) {
        (true, Some(file)) if args.host.as_ref().is_some_and(|h| *h != file.host) => {
            anyhow::bail!(
                "--host {} is not this host's name in cluster {} ({}, in {})",
                args.host.unwrap_or_default(),
                file.cluster,
                file.host,
                membership::CLUSTER_FILE
            )
        }
        (true, Some(file)) => (Some(file.target()), Some(file.host)),
        (true, None) => (None, args.host),
        (false, _) => {
            let target = EtcdTarget {
                endpoints: args.etcd,
                cluster: args.cluster,
            };
            (Some(target), args.host)
        }
    };
    let config = DaemonConfig {
        state_dir: args.state_dir,
        socket: args.socket,
        brickd,
        kiln,
        listen_ip: args.listen_ip,
        host,
        etcd,
    };
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let shutdown = async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    };
    daemon::run(config, shutdown).await
}
