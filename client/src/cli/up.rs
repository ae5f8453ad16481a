//! `kiln up`: one command from a fresh clone to a served volume. It runs `kiln-mgmtd` with its
//! state (embedded store, TLS material, brick logs) in `DATA_DIR/state`, makes the one-brick
//! volume `local` on `DATA_DIR/brick` if it does not exist, starts it, says how to reach it,
//! and runs until Ctrl-C or SIGTERM, which it passes to the daemon (which stops the brick).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kiln_admin::command::{Request, Response};
use kiln_admin::volume::VolumeState;

use crate::volume::call;

/// The volume `kiln up` serves.
const VOLUME: &str = "local";
/// How long the daemon and the brick may take to come up.
const START_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) fn run(data_dir: &Path, listen: SocketAddr) -> anyhow::Result<()> {
    // Root-only: it holds the daemon's socket, the cluster CA's key and the brick.
    kiln_admin::durable::private_dir(data_dir)?;
    let data_dir = data_dir.canonicalize()?;
    let state = data_dir.join("state");
    let socket = data_dir.join("mgmtd.sock");
    let brick = data_dir.join("brick");

    let mut mgmtd = Command::new(sibling_binary("kiln-mgmtd")?)
        .arg("--state-dir")
        .arg(&state)
        .arg("--socket")
        .arg(&socket)
        .arg("--listen-ip")
        .arg(listen.ip().to_string())
        .spawn()
        .context("cannot start kiln-mgmtd")?;
    let result = bring_up(&socket, &brick, listen, &mut mgmtd).and_then(|port| {
        let tls = state.join("tls");
        println!(
            "volume {VOLUME} is served from {} on {}:{port}",
            brick.display(),
            listen.ip()
        );
        println!("in another shell:");
        println!(
            "  export KILN_MGMT_SOCKET={} KILN_TLS_DIR={} KILN_BRICK={}:{port}",
            socket.display(),
            tls.display(),
            listen.ip()
        );
        println!("  kiln put ./README.md /readme && kiln ls -l /");
        println!("  kiln volume status {VOLUME}");
        wait_for_signal(&mut mgmtd)
    });
    if result.is_err() {
        let _ = mgmtd.kill();
        let _ = mgmtd.wait();
    }
    result
}

/// Waits for the daemon, creates the volume if needed, starts it and waits for its brick;
/// returns the brick's port.
fn bring_up(
    socket: &Path,
    brick: &Path,
    listen: SocketAddr,
    mgmtd: &mut std::process::Child,
) -> anyhow::Result<u16> {
    let deadline = Instant::now() + START_TIMEOUT;
    while std::os::unix::net::UnixStream::connect(socket).is_err() {
        if let Some(status) = mgmtd.try_wait()? {
            bail!("kiln-mgmtd exited with {status}");
        }
        if Instant::now() > deadline {
            bail!("kiln-mgmtd did not open {} in time", socket.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let exists = matches!(
        call(
            socket,
            &Request::VolumeInfo {
                name: Some(VOLUME.into())
            }
        )?,
        Response::Volumes { .. }
    );
    if !exists {
        let port = (listen.port() != 0).then_some(listen.port());
        expect_done(call(
            socket,
            &Request::VolumeCreate {
                name: VOLUME.into(),
                bricks: vec![brick.to_path_buf()],
                port,
            },
        )?)?;
        // The operator's own `admin` certificate acts as root on this host's volume (its
        // mount, the file commands); every other client is squashed.
        expect_done(call(
            socket,
            &Request::VolumeSet {
                name: VOLUME.into(),
                key: "server.root-allow".into(),
                value: kiln_admin::pki::ADMIN_CLIENT.into(),
            },
        )?)?;
    }
    if let Response::Volumes { volumes, .. } = call(
        socket,
        &Request::VolumeInfo {
            name: Some(VOLUME.into()),
        },
    )? && volumes
        .first()
        .is_some_and(|v| v.state != VolumeState::Started)
    {
        expect_done(call(
            socket,
            &Request::VolumeStart {
                name: VOLUME.into(),
            },
        )?)?;
    }
    loop {
        if let Response::Status { bricks } = call(
            socket,
            &Request::VolumeStatus {
                name: VOLUME.into(),
            },
        )? && let Some(b) = bricks.first()
            && b.state == "running"
            && b.generation.is_some()
        {
            // The brick process runs; give its server a moment to bind before saying so.
            if std::net::UdpSocket::bind(SocketAddr::new(listen.ip(), b.port)).is_err() {
                return Ok(b.port);
            }
        }
        if Instant::now() > deadline {
            bail!("the brick did not start; see its log under the state directory's logs/");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn expect_done(response: Response) -> anyhow::Result<()> {
    match response {
        Response::Error { message } => bail!("{message}"),
        _ => Ok(()),
    }
}

/// Runs until SIGINT or SIGTERM, then has the daemon stop (and stop its brick).
fn wait_for_signal(mgmtd: &mut std::process::Child) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        anyhow::Ok(())
    })?;
    if let Some(pid) = rustix::process::Pid::from_raw(i32::try_from(mgmtd.id())?) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
    let status = mgmtd.wait()?;
    if !status.success() {
        bail!("kiln-mgmtd exited with {status}");
    }
    Ok(())
}

/// Replaces this process with `name` (beside `kiln` or in PATH) run with `args`.
pub(crate) fn exec_sibling(name: &str, args: &[std::ffi::OsString]) -> anyhow::Result<()> {
    use std::os::unix::process::CommandExt as _;
    let error = Command::new(sibling_binary(name)?).args(args).exec();
    Err(error).with_context(|| format!("cannot run {name}"))
}

/// A workspace binary, or a message saying how to build it.
fn sibling_binary(name: &str) -> anyhow::Result<PathBuf> {
    kiln_admin::find_binary(name).with_context(|| {
        format!("{name} not found beside kiln or in PATH; build it with `cargo build --release`")
    })
}
