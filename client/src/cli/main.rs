//! `kiln`: the one command users type.
//!
//! ```text
//! kiln up [DATA_DIR]                       serve a one-brick volume from DATA_DIR/brick
//! kiln ca init                             create the cluster CA
//! kiln cluster init|join|token|leave|status   a cluster of hosts on etcd
//! kiln cert issue --brick NAME [--host H]… | --client NAME
//! kiln volume create|start|stop|delete|info|list|status|set|get|reset …   (via kiln-mgmtd)
//! kiln volume profile NAME start|info|stop   kiln volume statedump NAME
//! kiln mount VOLUME|HOST:PORT MOUNTPOINT [-o …] [-f]   kiln umount [-l] MOUNTPOINT
//! kiln bench WORKLOAD [options]            the `kiln-bench` workloads
//! kiln ls [-l] | stat | cat | put | get | mkdir [-p] | rm [-r] | mv | ln [-s] | xattr …
//! ```
//! File commands reach the brick at `--brick-addr` (`KILN_BRICK`) with the client certificate
//! `--client` (`KILN_CLIENT`) from `--tls-dir` (`KILN_TLS_DIR`).

mod files;
mod mount;
mod rebalance;
mod up;
mod volume;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use kiln_admin::command::TaskKind;
use kiln_admin::pki::{self, Role};

// No global allocator of its own (the daemons and the brick use mimalloc): `kiln` starts for
// every admin command, and here it starts ~1 ms sooner on the system's allocator
// (`perf stat -r 100 kiln --version`: 1.7 against 2.8 ms of CPU), while the mount's workloads
// ran no slower on it (`kiln-bench mount`, within run-to-run noise). The static build on musl
// (`scripts/build-static-kiln`) takes mimalloc: musl's allocator would serialise the mount's
// threads, and the command starts ~0.1 ms later for it.
#[cfg(target_env = "musl")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Where the TLS material lives unless `--tls-dir` or `KILN_TLS_DIR` says otherwise.
const DEFAULT_TLS_DIR: &str = "/var/lib/kiln/tls";

#[derive(Parser)]
#[command(name = "kiln", about = "Kiln: a GlusterFS-style brick server", version)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: Command,
}

#[derive(Args, Clone)]
struct Global {
    /// Directory with ca.crt, ca.key and the issued certificates.
    #[arg(long, env = "KILN_TLS_DIR", default_value = DEFAULT_TLS_DIR, global = true)]
    tls_dir: PathBuf,
    /// The brick's UDP address.
    #[arg(
        long,
        env = "KILN_BRICK",
        default_value = "127.0.0.1:26100",
        global = true
    )]
    brick_addr: SocketAddr,
    /// The name the brick's certificate must carry; default: the brick's address.
    #[arg(long, env = "KILN_SERVER_NAME", global = true)]
    server_name: Option<String>,
    /// This client's certificate name (`kiln cert issue --client NAME`).
    #[arg(long, env = "KILN_CLIENT", default_value = kiln_admin::pki::ADMIN_CLIENT, global = true)]
    client: String,
    /// The management daemon's socket.
    #[arg(long, env = "KILN_MGMT_SOCKET", default_value = kiln_admin::command::DEFAULT_SOCKET, global = true)]
    socket: PathBuf,
    /// QUIC connections to each brick (a mount's `connections` option).
    #[arg(skip = 1usize)]
    connections: usize,
}

#[derive(Subcommand)]
enum Command {
    /// Serve a one-brick volume from DATA_DIR/brick on 127.0.0.1:26100, creating the brick
    /// and TLS material on first use; runs until Ctrl-C.
    Up {
        #[arg(default_value = "./kiln-data")]
        data_dir: PathBuf,
        #[arg(long, default_value = "127.0.0.1:26100")]
        listen: SocketAddr,
    },
    /// The cluster CA.
    #[command(subcommand)]
    Ca(CaCommand),
    /// Certificates signed by the cluster CA.
    #[command(subcommand)]
    Cert(CertCommand),
    /// Volumes of the management daemon (`kiln-mgmtd`).
    Volume(VolumeArgs),
    /// The management daemons: a cluster of hosts sharing one configuration in etcd.
    Cluster {
        /// Print the daemon's answer as JSON.
        #[arg(long)]
        json: bool,
        #[command(subcommand)]
        command: ClusterCommand,
    },
    /// Mount a volume (FUSE); returns once mounted unless -f.
    Mount(mount::MountArgs),
    /// Unmount a Kiln mount.
    Umount(mount::UmountArgs),
    /// Kiln's workloads with references and ratios (runs `kiln-bench`; `kiln bench --help`).
    #[command(disable_help_flag = true)]
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    #[command(flatten)]
    File(files::FileCommand),
}

#[derive(Subcommand)]
enum ClusterCommand {
    /// The configuration store and every member host: its daemon, generation and bricks,
    /// or down.
    Status,
    /// Make this host the first of a cluster on etcd, before its daemon starts (runs
    /// `kiln-mgmtd init`; `kiln cluster init --help` for its options).
    #[command(disable_help_flag = true)]
    Init {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// Print a one-time token a new host joins with (this host must hold the CA's key).
    Token {
        /// How long it stays valid, in seconds.
        #[arg(long, default_value_t = kiln_admin::join::TOKEN_VALIDITY.as_secs())]
        valid_secs: u64,
    },
    /// Join a cluster with a token, before this host's daemon starts (runs
    /// `kiln-mgmtd join`; `kiln cluster join --help` for its options).
    #[command(disable_help_flag = true)]
    Join {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// Leave the cluster (no volume may have a brick on this host); the daemon stops.
    Leave,
}

#[derive(Subcommand)]
enum CaCommand {
    /// Create the cluster CA in the TLS directory (refuses to replace one).
    Init,
}

#[derive(Subcommand)]
enum CertCommand {
    /// Issue a brick or client certificate.
    Issue {
        /// A brick certificate with this name.
        #[arg(long, conflicts_with = "client", required_unless_present = "client")]
        brick: Option<String>,
        /// Host names or addresses the brick is reached at (repeatable).
        #[arg(long = "host", requires = "brick", default_values = ["localhost", "127.0.0.1", "::1"])]
        hosts: Vec<String>,
        /// A client certificate with this name (what auth.allow lists).
        #[arg(long)]
        client: Option<String>,
        /// Days the certificate is valid.
        #[arg(long, default_value_t = pki::CERT_VALIDITY_DAYS)]
        days: u32,
    },
    /// Print a certificate's serial number (what `auth.revoked` lists to revoke it).
    Serial {
        /// The certificate file (PEM).
        cert: PathBuf,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = match mount_helper_args() {
        Ok(Some(args)) => Cli::parse_from(args),
        Ok(None) => parse(),
        Err(e) => {
            eprintln!("{e:#}");
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Command::Up { data_dir, listen } => up::run(&data_dir, listen),
        Command::Ca(CaCommand::Init) => pki::init_ca(&cli.global.tls_dir)
            .map(|files| println!("created the cluster CA: {}", files.cert.display()))
            .map_err(anyhow::Error::from),
        Command::Cert(CertCommand::Issue {
            brick,
            hosts,
            client,
            days,
        }) => {
            let (role, name) = match (brick, client) {
                (Some(name), _) => (Role::Brick { hosts }, name),
                (None, Some(name)) => (Role::Client, name),
                (None, None) => unreachable_usage(),
            };
            pki::issue(&cli.global.tls_dir, &role, &name, days)
                .and_then(|files| {
                    let serial = pki::serial_of(&files.cert)?;
                    println!(
                        "issued {} and {} (serial {serial})",
                        files.cert.display(),
                        files.key.display()
                    );
                    Ok(())
                })
                .map_err(anyhow::Error::from)
        }
        Command::Cert(CertCommand::Serial { cert }) => pki::serial_of(&cert)
            .map(|serial| println!("{serial}"))
            .map_err(anyhow::Error::from),
        Command::Volume(VolumeArgs {
            json,
            command: volume::VolumeCommand::Heal { name },
        }) => rebalance::start(&cli.global, &name, TaskKind::FixLayout, json),
        Command::Volume(VolumeArgs {
            json,
            command:
                volume::VolumeCommand::Rebalance {
                    name,
                    action,
                    for_daemon,
                },
        }) => {
            let kind = match action {
                volume::RebalanceArg::FixLayout => TaskKind::FixLayout,
                _ => TaskKind::Rebalance,
            };
            match action {
                volume::RebalanceArg::Start | volume::RebalanceArg::FixLayout if for_daemon => {
                    rebalance::run_for_daemon(&cli.global, &name, kind)
                }
                volume::RebalanceArg::Start | volume::RebalanceArg::FixLayout => {
                    rebalance::start(&cli.global, &name, kind, json)
                }
                volume::RebalanceArg::Status => rebalance::status(&cli.global, &name, json),
                volume::RebalanceArg::Stop => rebalance::stop(&cli.global, &name, json),
            }
        }
        Command::Volume(VolumeArgs {
            json,
            command:
                volume::VolumeCommand::RemoveBrick {
                    name,
                    brick,
                    action,
                },
        }) => rebalance::remove_brick(&cli.global, &name, &brick, action, json),
        Command::Volume(VolumeArgs { json, command }) => {
            volume::run(&cli.global.socket, json, command)
        }
        Command::Cluster { json, command } => {
            use kiln_admin::command::Request;
            let request = match command {
                ClusterCommand::Init { args } => return exit(setup("init", args)),
                ClusterCommand::Join { args } => return exit(setup("join", args)),
                ClusterCommand::Status => Request::ClusterStatus,
                ClusterCommand::Token { valid_secs } => Request::ClusterToken { valid_secs },
                ClusterCommand::Leave => Request::ClusterLeave,
            };
            volume::ask_and_print(&cli.global.socket, json, &request)
        }
        Command::Mount(args) => mount::run(&cli.global, args),
        Command::Umount(args) => mount::umount(&args),
        Command::Bench { args } => up::exec_sibling("kiln-bench", &args),
        Command::File(command) => return files::run(&cli.global, command),
    };
    exit(result)
}

fn exit(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kiln: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `kiln-mgmtd SUBCOMMAND ARGS…`: setting up the daemon's membership is the daemon's own
/// code (it speaks to etcd; `kiln` does not).
fn setup(subcommand: &str, args: Vec<std::ffi::OsString>) -> anyhow::Result<()> {
    let mut all = vec![std::ffi::OsString::from(subcommand)];
    all.extend(args);
    up::exec_sibling("kiln-mgmtd", &all)
}

/// `kiln volume …` (run by scripts, one process per change) parsed with the `volume` part of
/// the command tree alone: clap builds every subcommand it is given before it parses, and
/// the whole tree is most of a `kiln volume set`'s own time.
#[derive(Parser)]
#[command(name = "kiln", bin_name = "kiln", version)]
struct VolumeCli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: VolumeOnly,
}

#[derive(Subcommand)]
enum VolumeOnly {
    /// Volumes of the management daemon (`kiln-mgmtd`).
    Volume(VolumeArgs),
}

/// `kiln volume`'s own arguments.
#[derive(Args)]
struct VolumeArgs {
    /// Print the daemon's answer as JSON.
    #[arg(long)]
    json: bool,
    #[command(subcommand)]
    command: volume::VolumeCommand,
}

/// The command line: `kiln volume …` through [`VolumeCli`], anything else (or a `volume`
/// line it refuses, for the whole tree's usage and errors) through [`Cli`].
fn parse() -> Cli {
    if std::env::args_os()
        .nth(1)
        .is_some_and(|word| word == "volume")
        && let Ok(VolumeCli { global, command }) = VolumeCli::try_parse()
    {
        let VolumeOnly::Volume(volume) = command;
        return Cli {
            global,
            command: Command::Volume(volume),
        };
    }
    Cli::parse()
}

/// When run as `mount.kiln` (a link to `kiln`, which mount(8) runs for `-t kiln`), the
/// `kiln mount` arguments it stands for; a fake mount (`-f`) exits at once.
fn mount_helper_args() -> anyhow::Result<Option<Vec<String>>> {
    let mut args = std::env::args();
    let name = args.next().unwrap_or_default();
    if !name.ends_with("mount.kiln") {
        return Ok(None);
    }
    let rest: Vec<String> = args.collect();
    match mount::helper_args(&rest)? {
        Some(args) => Ok(Some(args)),
        None => std::process::exit(0),
    }
}

/// clap enforces `--brick` or `--client`; reaching here means it did not.
fn unreachable_usage() -> ! {
    eprintln!("kiln: cert issue needs --brick NAME or --client NAME");
    std::process::exit(2)
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::{Cli, VolumeCli};

    #[test]
    fn the_volume_parser_takes_what_the_whole_one_takes() {
        VolumeCli::command().debug_assert();
        let lines: [(&[&str], bool); 6] = [
            (
                &["kiln", "volume", "set", "v", "network.inflight-max", "64"],
                true,
            ),
            (&["kiln", "volume", "--json", "status", "v"], true),
            (&["kiln", "volume", "list", "--socket", "/run/x.sock"], true),
            (&["kiln", "volume", "set"], false),
            (&["kiln", "volume", "bogus"], false),
            (
                &["kiln", "volume", "set", "v", "k", "x", "--no-such-flag"],
                false,
            ),
        ];
        for (line, valid) in lines {
            assert_eq!(VolumeCli::try_parse_from(line).is_ok(), valid, "{line:?}");
            assert_eq!(Cli::try_parse_from(line).is_ok(), valid, "{line:?}");
        }
    }
}
