//! `kiln volume …`: commands for the management daemon over its Unix socket. Output is aligned
//! for people; `--json` prints the daemon's answer as one JSON object for scripts.

use std::path::{Path, PathBuf};

use anyhow::bail;
use clap::Subcommand;
use kiln_admin::command::{BrickReport, EXCHANGE, ProfileAction, Request, Response};
use kiln_admin::control::ProfileReport;
use kiln_admin::exchange::ExchangeError;
use kiln_admin::options;

#[derive(Subcommand)]
pub(crate) enum VolumeCommand {
    /// Create a volume from brick directories (made and formatted if missing).
    Create {
        name: String,
        #[arg(required = true)]
        bricks: Vec<PathBuf>,
        /// The first brick's UDP port (the others follow); default: the lowest free ones.
        #[arg(long)]
        port: Option<u16>,
    },
    /// Add a brick directory (made and formatted if missing) after the volume's others; a
    /// started volume starts it at once. `rebalance VOL fix-layout` then gives it a share
    /// of every directory.
    AddBrick {
        name: String,
        brick: PathBuf,
        /// Its UDP port; default: the lowest free one.
        #[arg(long)]
        port: Option<u16>,
    },
    /// Take a brick out of the volume without losing a file: `start` makes it leave (no
    /// directory gives it a share any more) and has the management daemon rebalance the
    /// volume, which moves every file off it, followed with a progress bar; `status` shows
    /// that rebalance; `stop` stops it and the brick serves again; `commit` removes the brick
    /// once a rebalance completed with nothing left on it (its directory may then be deleted).
    RemoveBrick {
        name: String,
        /// `HOST:PATH`, or a path of this host.
        brick: PathBuf,
        #[arg(value_enum)]
        action: RemoveArg,
    },
    /// Start the volume's bricks (and keep them running).
    Start { name: String },
    /// Stop the volume's bricks.
    Stop { name: String },
    /// Forget a stopped volume (its brick directories stay on disk).
    Delete { name: String },
    /// Show volumes: bricks, ports, options set, state.
    Info { name: Option<String> },
    /// Volume names.
    List,
    /// Per brick: pid, port, state, uptime, restarts.
    Status { name: String },
    /// Set an option (`kiln volume set help` lists them).
    Set {
        name: String,
        key: Option<String>,
        value: Option<String>,
    },
    /// Show an option, or `all`.
    Get {
        name: String,
        #[arg(default_value = "all")]
        key: String,
    },
    /// Put an option, or `all`, back to its default.
    Reset { name: String, key: String },
    /// Per-fop profile of the bricks: `start` switches counters and latency histograms on
    /// (from zero), `info` prints calls, errors and latency per fop, `stop` switches them off.
    Profile {
        name: String,
        #[arg(value_enum)]
        action: ProfileArg,
    },
    /// Every running brick's state as JSON: connections, fd tables, caches, ring counters,
    /// profile, the options it runs and the configuration generation.
    Statedump { name: String },
    /// Look up every directory of a distributed volume, which heals it: copies missing on a
    /// brick are made, layouts with holes or overlaps rebuilt over every serving brick. The
    /// management daemon runs it (on a cluster, the elected one) as `rebalance … fix-layout`;
    /// this follows it until done.
    Heal { name: String },
    /// Spread a volume over bricks added since its directories were laid out: `fix-layout`
    /// gives every directory a layout over every brick (new names go to the new bricks;
    /// existing files stay where they are and are still found); `start` has the management
    /// daemon (on a cluster, the elected one) do that and then move every file to the brick
    /// its name hashes to while clients keep using it, and follows it with a progress bar
    /// until done or stopped (`stop`; Ctrl-C only stops following); `status` shows the
    /// progress of the running or last rebalance or heal, and the host running it.
    Rebalance {
        name: String,
        #[arg(value_enum)]
        action: RebalanceArg,
        /// Run the task in this process (how the daemon runs it).
        #[arg(long, hide = true)]
        for_daemon: bool,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum RebalanceArg {
    FixLayout,
    Start,
    Status,
    Stop,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum RemoveArg {
    /// Mark the brick leaving and move everything off it.
    Start,
    /// That move's progress.
    Status,
    /// Stop the move; the brick serves again.
    Stop,
    /// Remove the brick, once a move left nothing on it.
    Commit,
    /// Remove the brick now, without moving its files (they leave the volume): for a brick
    /// whose host is gone.
    Force,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum ProfileArg {
    Start,
    Info,
    Stop,
}

pub(crate) fn run(socket: &Path, json: bool, command: VolumeCommand) -> anyhow::Result<()> {
    let all = |key: String| (key != "all").then_some(key);
    let request = match command {
        VolumeCommand::Create { name, bricks, port } => {
            let bricks = bricks
                .iter()
                .map(|b| brick_spec(b))
                .collect::<Result<_, _>>()?;
            Request::VolumeCreate { name, bricks, port }
        }
        VolumeCommand::Start { name } => Request::VolumeStart { name },
        VolumeCommand::Stop { name } => Request::VolumeStop { name },
        VolumeCommand::Delete { name } => Request::VolumeDelete { name },
        VolumeCommand::Info { name } => Request::VolumeInfo { name },
        VolumeCommand::List => Request::VolumeInfo { name: None },
        VolumeCommand::Status { name } => Request::VolumeStatus { name },
        VolumeCommand::Set { name, key, value } => match (name.as_str(), key, value) {
            ("help", None, None) => {
                print!("{}", options::help_table());
                return Ok(());
            }
            (_, Some(key), Some(value)) => Request::VolumeSet { name, key, value },
            _ => bail!("usage: kiln volume set NAME KEY VALUE | kiln volume set help"),
        },
        VolumeCommand::Get { name, key } => Request::VolumeGet {
            name,
            key: all(key),
        },
        VolumeCommand::Reset { name, key } => Request::VolumeReset {
            name,
            key: all(key),
        },
        VolumeCommand::Profile { name, action } => Request::VolumeProfile {
            name,
            action: match action {
                ProfileArg::Start => ProfileAction::Start,
                ProfileArg::Info => ProfileAction::Info,
                ProfileArg::Stop => ProfileAction::Stop,
            },
        },
        VolumeCommand::Statedump { name } => Request::VolumeStatedump { name },
        VolumeCommand::AddBrick { name, brick, port } => Request::VolumeAddBrick {
            name,
            brick: brick_spec(&brick)?,
            port,
        },
        VolumeCommand::Heal { .. }
        | VolumeCommand::Rebalance { .. }
        | VolumeCommand::RemoveBrick { .. } => {
            bail!(
                "`kiln volume heal`, `rebalance` and `remove-brick` are dispatched by \
                 crate::rebalance"
            )
        }
    };
    ask_and_print(socket, json, &request)
}

/// Asks the daemon `request` and prints its answer (as JSON with `json`).
pub(crate) fn ask_and_print(socket: &Path, json: bool, request: &Request) -> anyhow::Result<()> {
    let list_only = matches!(request, Request::VolumeInfo { name: None });
    print_answer(call(socket, request)?, json, list_only)
}

/// Prints the daemon's answer `response` (as JSON with `json`); an error answer is an error.
pub(crate) fn print_answer(response: Response, json: bool, list_only: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(&response)?);
        return match response {
            Response::Error { message } => bail!("{message}"),
            _ => Ok(()),
        };
    }
    print(response, list_only)
}

/// A brick as the daemon takes it: `HOST:PATH` as given, a path of this host made absolute.
pub(crate) fn brick_spec(brick: &Path) -> anyhow::Result<PathBuf> {
    match kiln_admin::volume::Brick::split_spec(brick) {
        (Some(_), _) => Ok(brick.to_owned()),
        (None, path) => Ok(std::env::current_dir()?.join(path)),
    }
}

/// One request to the daemon and its answer.
pub(crate) fn call(socket: &Path, request: &Request) -> anyhow::Result<Response> {
    EXCHANGE.ask_blocking(socket, request).map_err(|e| match e {
        ExchangeError::Unreachable(_) => anyhow::Error::from(e).context(format!(
            "cannot reach kiln-mgmtd at {} (is it running? see `kiln-mgmtd --help`)",
            socket.display()
        )),
        ExchangeError::Decode(_) => anyhow::Error::from(e)
            .context("kiln-mgmtd gave an answer this kiln does not understand"),
        e => anyhow::Error::from(e).context("no answer from kiln-mgmtd"),
    })
}

fn print(response: Response, list_only: bool) -> anyhow::Result<()> {
    match response {
        Response::Done { message, .. } => println!("{message}"),
        Response::Error { message } => bail!("{message}"),
        Response::Volumes { volumes, .. } if list_only => {
            for v in volumes {
                println!("{}", v.name);
            }
        }
        Response::Volumes { volumes, .. } => {
            for (n, v) in volumes.iter().enumerate() {
                if n > 0 {
                    println!();
                }
                println!("Volume:  {}", v.name);
                println!("ID:      {}", v.id);
                println!("State:   {}", v.state);
                println!("Bricks:  {}", v.bricks.len());
                for (i, b) in v.bricks.iter().enumerate() {
                    let role = match b.role.is_serving() {
                        true => String::new(),
                        false => format!("  ({})", b.role),
                    };
                    println!("  b{i}  port {:<5}  {}{role}", b.port, b.display());
                }
                if !v.options.is_empty() {
                    println!("Options set:");
                    for (k, value) in &v.options {
                        println!("  {k} = {value}");
                    }
                }
            }
        }
        Response::Options { options } => {
            let width = options.iter().map(|o| o.key.len()).max().unwrap_or(0);
            for o in options {
                let source = if o.set { "" } else { "  (default)" };
                println!("{:<width$}  {}{source}", o.key, o.value);
            }
        }
        Response::Status { bricks } => {
            println!(
                "{:<40} {:>5} {:>8} {:<10} {:>8} {:>8} {:>10}  health",
                "brick", "port", "pid", "state", "uptime", "restarts", "generation"
            );
            for b in bricks {
                let pid = b.pid.map_or("-".to_owned(), |p| p.to_string());
                let generation = b.generation.map_or("-".to_owned(), |g| g.to_string());
                let brick = kiln_admin::volume::Brick::place(b.host.as_deref(), &b.path);
                println!(
                    "{:<40} {:>5} {:>8} {:<10} {:>7}s {:>8} {:>10}  {}",
                    brick, b.port, pid, b.state, b.uptime_secs, b.restarts, generation, b.health
                );
            }
        }
        Response::Rebalance(status) => crate::rebalance::print(&status, false)?,
        Response::Cluster(cluster) => {
            println!("Store:       {}", cluster.store);
            println!("Generation:  {}", cluster.generation);
            if let Some(leader) = &cluster.leader {
                println!("Leader:      {leader} (runs the cluster-wide tasks)");
            }
            println!(
                "{:<24} {:<16} {:>8} {:>10} {:>7}",
                "host", "address", "daemon", "generation", "bricks"
            );
            for h in cluster.hosts {
                let running = h.bricks.values().filter(|b| b.pid.is_some()).count();
                println!(
                    "{:<24} {:<16} {:>8} {:>10} {:>3}/{:<3}",
                    h.host,
                    h.listen_ip,
                    h.daemon_pid,
                    h.generation,
                    running,
                    h.bricks.len()
                );
            }
            for host in cluster.down {
                println!("{host:<24} {:<16} {:>8}", "-", "down");
            }
        }
        Response::Token { token, valid_secs } => {
            println!("{token}");
            eprintln!(
                "(valid once, for {valid_secs} s: on the new host, \
                 `kiln cluster join THIS_HOST --host NEW_HOST --token …`)"
            );
        }
        Response::Profiles { bricks, .. } => {
            for (i, b) in bricks.iter().enumerate() {
                if i > 0 {
                    println!();
                }
                print_profile(b);
            }
        }
        // Read by scripts as often as by people: JSON either way.
        Response::Statedumps { bricks, .. } => {
            println!("{}", serde_json::to_string_pretty(&bricks)?);
        }
    }
    Ok(())
}

/// One brick's profile as a table, GlusterFS's `volume profile info` in spirit.
fn print_profile(b: &BrickReport<ProfileReport>) {
    println!("Brick: {} ({})", b.brick, b.path.display());
    let Some(report) = &b.report else {
        let error = b.error.as_deref().unwrap_or("no answer");
        println!("  no profile: {error}");
        return;
    };
    let on_off = |on: bool, for_s: f64| match on {
        true => format!("on for {for_s:.1} s"),
        false => "off".to_owned(),
    };
    println!(
        "Counting {}, timing {}",
        on_off(report.counting, report.counting_for_s),
        on_off(report.timing, report.timing_for_s)
    );
    if report.fops.is_empty() {
        println!("  no fops recorded (start with `kiln volume profile NAME start`)");
        return;
    }
    println!(
        "  {:<13} {:>10} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9} {:>12}",
        "fop",
        "calls",
        "errors",
        "avg µs",
        "min µs",
        "max µs",
        "p50 µs",
        "p99 µs",
        "steps/call",
        "sqes/call",
        "bytes"
    );
    for f in &report.fops {
        let us = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1}"));
        let l = f.latency.as_ref();
        let per_call = |n: u64| match f.calls {
            0 => "-".to_owned(),
            calls => format!("{:.2}", n as f64 / calls as f64),
        };
        println!(
            "  {:<13} {:>10} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>9} {:>12}",
            f.fop,
            f.calls,
            f.errors,
            us(l.map(|l| l.avg_us)),
            us(l.map(|l| l.min_us)),
            us(l.map(|l| l.max_us)),
            us(l.map(|l| l.p50_us)),
            us(l.map(|l| l.p99_us)),
            per_call(f.steps),
            per_call(f.sqes),
            f.bytes
        );
    }
    if !report.errors.is_empty() {
        let errors: Vec<String> = report
            .errors
            .iter()
            .map(|(e, n)| format!("{e} {n}"))
            .collect();
        println!("  errors: {}", errors.join(", "));
    }
}
