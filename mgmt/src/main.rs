//! `kiln-mgmtd`: the management daemon. Holds the volume configuration in its state directory
//! (or, with `--etcd`, in etcd, shared with the daemons of the other hosts), runs the bricks of
//! started volumes that live on its host, and takes commands from `kiln volume …` on a
//! root-only Unix socket. Stops its bricks and exits on SIGTERM or SIGINT.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kiln_admin::command::DEFAULT_SOCKET;
use kiln_mgmt::daemon::{self, DaemonConfig};
use kiln_mgmt::store::etcd::EtcdTarget;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "kiln-mgmtd", about = "The Kiln management daemon", version)]
struct Args {
    /// Configuration store, TLS material and brick logs.
    #[arg(long, env = "KILN_STATE_DIR", default_value = "/var/lib/kiln")]
    state_dir: PathBuf,
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
    /// client URLs (`http://HOST:2379`), comma-separated. Default: the embedded store.
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
    let brickd = args
        .brickd
        .or_else(|| kiln_admin::find_binary("kiln-brickd"))
        .unwrap_or_else(|| PathBuf::from("kiln-brickd"));
    let config = DaemonConfig {
        state_dir: args.state_dir,
        socket: args.socket,
        brickd,
        listen_ip: args.listen_ip,
        host: args.host,
        etcd: (!args.etcd.is_empty()).then_some(EtcdTarget {
            endpoints: args.etcd,
            cluster: args.cluster,
        }),
    };
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
    let result = runtime.block_on(async {
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
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kiln-mgmtd: {e:#}");
            ExitCode::FAILURE
        }
    }
}
