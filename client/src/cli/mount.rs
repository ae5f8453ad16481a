//! `kiln mount`, `kiln umount`, and `mount.kiln` (the helper `mount -t kiln` and
//! `/etc/fstab` run).
//!
//! ```text
//! kiln mount VOLUME|HOST:PORT[,HOST:PORT…] MOUNTPOINT [-o opt[,opt…]] [-f]
//! mount -t kiln VOLUME MOUNTPOINT -o tls-dir=/var/lib/kiln/tls,client=alice
//! kiln umount [-l] MOUNTPOINT
//! ```
//! A volume name is looked up in `kiln-mgmtd` (its bricks and the options mounts read:
//! `performance.*`, `features.acl`, `features.selinux`); a brick address is mounted directly.
//! A volume of several bricks (or several addresses, in the volume's brick order) is mounted
//! as one distributed volume (`kiln_client::distribute`). Without `-f` the command returns
//! once the volume is mounted and a background process serves it, logging to `--log-file`.
//!
//! `kiln umount` returns once the process that served the mount has sent the changes it had
//! answered itself and not yet sent, closed its brick connections (their leases go with
//! them) and exited: that process holds a shared `flock` on the directory it mounted over
//! (opened before the mount covers it) until it exits, and `kiln umount` waits, bounded,
//! until it can lock it exclusively. It does not wait when another mount namespace still has
//! a copy of the mount (one made while it was mounted), which the process goes on serving.

use std::future::Future;
use std::io::{BufRead as _, BufReader, Write as _};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use kiln_admin::command::{Request, Response};
use kiln_admin::options;
use kiln_admin::volume::VolumeState;
use kiln_client::BrickClient;
use kiln_client::distribute::{BrickSource, Distribute, Listed, Member};
use kiln_client::mount::{self, MountOptions};
use rustix::fs::{FlockOperation, flock};

use crate::Global;

/// What a background mount logs to unless told otherwise.
const DEFAULT_LOG_FILE: &str = "/var/log/kiln/mount.log";
/// The line a background mount's server prints when the mount is up.
const READY: &str = "kiln-mount-ready";
/// How often the server looks whether it was unmounted from outside.
const UNMOUNT_POLL: Duration = Duration::from_millis(50);
/// How often `kiln umount` looks whether the serving process is gone.
const SERVER_EXIT_POLL: Duration = Duration::from_millis(10);
/// How long `kiln umount` waits for the serving process beyond its drain limit (closing its
/// brick connections, exiting).
const SERVER_EXIT_MARGIN: Duration = Duration::from_secs(10);
/// How long `kiln umount` waits quietly for the serving process before saying so.
const SERVER_EXIT_QUIET: Duration = Duration::from_secs(1);

#[derive(Args)]
pub(crate) struct MountArgs {
    /// A volume of kiln-mgmtd, or a brick's HOST:PORT, or the bricks of a distributed
    /// volume as HOST:PORT,HOST:PORT,… in the volume's brick order.
    source: String,
    /// An existing directory.
    mountpoint: PathBuf,
    /// Comma-separated options: attr-timeout-ms=N, entry-timeout-ms=N,
    /// negative-timeout-ms=N, writeback-cache[=on|off], deferred-create[=on|off],
    /// leases[=on|off], behind-bytes-max=N, behind-free-mib=N (free space below which
    /// nothing is answered ahead), read-ahead-kib=N, connections=N (to each brick;
    /// large reads and writes are spread over them), default-permissions[=on|off],
    /// selinux[=on|off] and acl[=on|off] (both off by default), ro, rw, suid, dev (both off
    /// by default), noexec, noatime; tls-dir=DIR, client=NAME, server-name=NAME,
    /// socket=PATH, log-file=PATH. fstab-only options (defaults, _netdev, nofail, x-…) are
    /// ignored.
    #[arg(short = 'o', value_delimiter = ',')]
    options: Vec<String>,
    /// Serve in the foreground (logging to stderr) until unmounted or signalled.
    #[arg(short = 'f', long)]
    foreground: bool,
    /// Where a background mount logs.
    #[arg(long, default_value = DEFAULT_LOG_FILE)]
    log_file: PathBuf,
    /// Internal: this process is the background server of a mount.
    #[arg(long, hide = true)]
    serve_background: bool,
}

#[derive(Args)]
pub(crate) struct UmountArgs {
    /// Detach now even if files are open; the mount ends when they are closed.
    #[arg(short = 'l', long)]
    lazy: bool,
    mountpoint: PathBuf,
}

/// `kiln mount`.
pub(crate) fn run(global: &Global, mut args: MountArgs) -> anyhow::Result<()> {
    let mut global = global.clone();
    let mut options = MountOptions {
        fsname: args.source.clone(),
        ..MountOptions::default()
    };
    let mut overrides = Vec::new();
    for item in std::mem::take(&mut args.options) {
        let (key, value) = match item.split_once('=') {
            Some((k, v)) => (k.to_owned(), Some(v.to_owned())),
            None => (item.clone(), None),
        };
        let need =
            |v: Option<String>| v.with_context(|| format!("mount option {key} needs a value"));
        match key.as_str() {
            "tls-dir" => global.tls_dir = need(value)?.into(),
            "client" => global.client = need(value)?,
            "server-name" => global.server_name = Some(need(value)?),
            "socket" => global.socket = need(value)?.into(),
            "log-file" => args.log_file = need(value)?.into(),
            "" => {}
            _ => {
                // Checked now, so a typo fails before anything starts.
                options.set(&key, value.as_deref())?;
                overrides.push((key, value));
            }
        }
    }
    if !args.foreground && !args.serve_background {
        return start_background(&global, &args, &overrides);
    }
    if args.serve_background {
        // Leave the caller's session so its end does not take the mount down.
        let _ = rustix::process::setsid();
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kiln-mount")
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    let result = runtime.block_on(serve(&global, &args, options, &overrides));
    if let Err(e) = &result
        && args.serve_background
    {
        // The waiting `kiln mount` prints it.
        println!("{e:#}");
    }
    result
}

/// Mounts and serves until unmounted from outside or told to stop.
async fn serve(
    global: &Global,
    args: &MountArgs,
    mut options: MountOptions,
    overrides: &[(String, Option<String>)],
) -> anyhow::Result<()> {
    let mountpoint = &args.mountpoint;
    check_mountpoint(mountpoint)?;
    // Held until this process is done with the mount; see the module doc.
    let _serving = hold_mountpoint(mountpoint);
    let (members, by_name) = match parse_addrs(&args.source) {
        Some(addrs) => (addrs.into_iter().map(Member::Serving).collect(), false),
        None => {
            let volume = resolve_volume(global, &args.source)?;
            // The volume's settings, then this mount's own on top.
            for (key, value) in volume.options {
                options.set(&key, Some(&value))?;
            }
            for (key, value) in overrides {
                options.set(key, value.as_deref())?;
            }
            (volume.bricks, true)
        }
    };
    // The client stack this volume needs: a brick client per brick, and over several a
    // distribution layer.
    let global = &Global {
        connections: options.connections,
        ..global.clone()
    };
    let members: Vec<Member<BrickClient>> =
        crate::files::connect_members(global, &members)
            .await
            .with_context(|| format!("cannot mount {}", args.source))?;
    let bricks: Vec<BrickClient> = members.iter().filter_map(Member::brick).cloned().collect();
    let runtime = tokio::runtime::Handle::current();
    let added = Arc::new(Mutex::new(Vec::new()));
    let mounted = match (members.as_slice(), bricks.first()) {
        ([Member::Serving(brick)], _) => mount::mount(runtime, brick.clone(), mountpoint, options),
        ([_, _, ..], Some(first)) => {
            let volume = first.hello().await?.volume.to_string();
            let mut distribute = Distribute::of_members(members, &volume)?;
            if by_name {
                distribute = distribute.with_source(VolumeBricks {
                    global: global.clone(),
                    volume: args.source.clone(),
                    added: added.clone(),
                });
                tokio::spawn(distribute.refresh_forever());
            }
            mount::mount(runtime, distribute, mountpoint, options)
        }
        _ => bail!("no brick in service to mount"),
    }
    .with_context(|| format!("cannot mount on {}", mountpoint.display()))?;
    tracing::info!(source = %args.source, mountpoint = %mounted.mountpoint().display(), "mounted");
    if args.serve_background {
        println!("{READY}");
        let _ = std::io::stdout().flush();
        if let Ok(null) = std::fs::File::create("/dev/null") {
            let _ = rustix::stdio::dup2_stdout(&null);
        }
    }
    let stop = wait_for_stop(&mounted).await;
    tracing::info!(reason = stop, "unmounting");
    let result = tokio::task::spawn_blocking(move || mounted.unmount())
        .await
        .context("the unmount task failed")?;
    tracing::info!(result = ?result, "the FUSE session ended");
    let added = std::mem::take(&mut *added.lock().unwrap_or_else(|p| p.into_inner()));
    for brick in bricks.into_iter().chain(added) {
        brick.close().await;
    }
    tracing::info!("disconnected from the bricks");
    result.context("unmount")
}

/// The bricks of a volume mounted by name as the management daemon lists them: those added
/// while it is mounted (`kiln volume add-brick`) and every brick's role (`remove-brick`);
/// each brick client made is kept in `added`, to be closed at the end.
struct VolumeBricks {
    global: Global,
    volume: String,
    added: Arc<Mutex<Vec<BrickClient>>>,
}

impl BrickSource<BrickClient> for VolumeBricks {
    fn members(
        &self,
        known: usize,
    ) -> Pin<Box<dyn Future<Output = Result<Listed<BrickClient>, kiln_client::Error>> + Send + '_>>
    {
        Box::pin(async move {
            let unreachable = |e: anyhow::Error| kiln_client::Error::Connect {
                addr: format!("kiln-mgmtd for volume {}", self.volume),
                reason: format!("{e:#}"),
            };
            let (global, volume) = (self.global.clone(), self.volume.clone());
            let listed = tokio::task::spawn_blocking(move || resolve_volume(&global, &volume))
                .await
                .map_err(|e| unreachable(e.into()))?
                .map_err(unreachable)?;
            let mut roles: Vec<_> = listed.bricks.iter().map(Member::role).collect();
            let new = listed.bricks.get(known..).unwrap_or_default();
            // Bricks added but out of reach are asked for again later; the roles of the
            // others are news meanwhile.
            let added = match crate::files::connect_members(&self.global, new).await {
                Ok(added) => added,
                Err(e) => {
                    tracing::warn!(error = %format!("{e:#}"), "new bricks out of reach");
                    roles.truncate(known);
                    Vec::new()
                }
            };
            if !added.is_empty() {
                tracing::info!(added = added.len(), "the volume has new bricks");
            }
            let mut kept = self.added.lock().unwrap_or_else(|p| p.into_inner());
            kept.extend(added.iter().filter_map(Member::brick).cloned());
            Ok(Listed { roles, added })
        })
    }
}

/// The brick addresses `source` names (one, or several comma-separated); `None` when it is
/// not a list of addresses (then a volume name).
fn parse_addrs(source: &str) -> Option<Vec<SocketAddr>> {
    source.split(',').map(|a| a.parse().ok()).collect()
}

/// Waits for SIGTERM, SIGINT or SIGHUP, or for the mount to be taken away from outside.
async fn wait_for_stop(mounted: &mount::Mounted) -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int), Ok(mut hup)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) else {
        tracing::error!("cannot watch signals; serving until unmounted");
        while !mounted.is_finished() {
            tokio::time::sleep(UNMOUNT_POLL).await;
        }
        return "unmounted";
    };
    loop {
        tokio::select! {
            _ = term.recv() => return "SIGTERM",
            _ = int.recv() => return "SIGINT",
            _ = hup.recv() => return "SIGHUP",
            () = tokio::time::sleep(UNMOUNT_POLL) => {
                if mounted.is_finished() {
                    return "unmounted";
                }
            }
        }
    }
}

/// Starts this command again as a background server and waits until it has mounted (or
/// failed, which it reports).
fn start_background(
    global: &Global,
    args: &MountArgs,
    overrides: &[(String, Option<String>)],
) -> anyhow::Result<()> {
    if let Some(dir) = args.log_file.parent() {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create the log directory {}", dir.display()))?;
    }
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&args.log_file)
        .with_context(|| format!("cannot open the log file {}", args.log_file.display()))?;
    let mut command = Command::new(std::env::current_exe().context("cannot find kiln itself")?);
    command
        .arg("--tls-dir")
        .arg(&global.tls_dir)
        .arg("--client")
        .arg(&global.client)
        .arg("--socket")
        .arg(&global.socket)
        .arg("--brick-addr")
        .arg(global.brick_addr.to_string());
    if let Some(name) = &global.server_name {
        command.arg("--server-name").arg(name);
    }
    command
        .arg("mount")
        .arg(&args.source)
        .arg(&args.mountpoint)
        .arg("--serve-background")
        .arg("--log-file")
        .arg(&args.log_file);
    for (key, value) in overrides {
        command.arg("-o").arg(match value {
            Some(v) => format!("{key}={v}"),
            None => key.clone(),
        });
    }
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .context("cannot start the mount's background server")?;
    let stdout = child.stdout.take().context("no pipe to the server")?;
    let mut said = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap_or_default();
        if line == READY {
            return Ok(());
        }
        said.push(line);
    }
    let status = child.wait().context("the mount's server")?;
    match said.is_empty() {
        true => bail!(
            "the mount's server exited ({status}) before mounting; see {}",
            args.log_file.display()
        ),
        false => bail!("{}", said.join("\n")),
    }
}

/// Refuses a mount point that is missing, not a directory, or already a Kiln mount.
fn check_mountpoint(mountpoint: &Path) -> anyhow::Result<()> {
    let meta = std::fs::metadata(mountpoint)
        .with_context(|| format!("mount point {}", mountpoint.display()))?;
    if !meta.is_dir() {
        bail!("mount point {} is not a directory", mountpoint.display());
    }
    let canonical = mountpoint.canonicalize()?;
    if kiln_mount_device(&canonical)?.is_some() {
        bail!("{} is already a Kiln mount", mountpoint.display());
    }
    Ok(())
}

/// What a mount needs of a volume of kiln-mgmtd.
pub(crate) struct VolumeToMount {
    /// The bricks' addresses and roles, in brick order.
    pub(crate) bricks: Vec<Member<SocketAddr>>,
    /// Its `performance.*` settings, without the prefix (the mount options they are).
    options: Vec<(String, String)>,
}

/// Volume `name`, from kiln-mgmtd.
pub(crate) fn resolve_volume(global: &Global, name: &str) -> anyhow::Result<VolumeToMount> {
    let request = Request::VolumeInfo {
        name: Some(name.to_owned()),
    };
    let volume = match crate::volume::call(&global.socket, &request)? {
        Response::Volumes { volumes, .. } => volumes
            .into_iter()
            .next()
            .with_context(|| format!("no volume {name}"))?,
        Response::Error { message } => bail!("{message}"),
        other => bail!("kiln-mgmtd answered {other:?}"),
    };
    if volume.state != VolumeState::Started {
        bail!(
            "volume {name} is {}; `kiln volume start {name}` first",
            volume.state
        );
    }
    let member = |brick: &kiln_admin::volume::Brick| match brick.role.in_service() {
        true => Ok(Member::new(brick_address(global, brick)?, brick.role)),
        false => Ok(Member::Removed),
    };
    let bricks = volume
        .bricks
        .iter()
        .map(member)
        .collect::<anyhow::Result<_>>()?;
    let options = volume
        .options
        .iter()
        .filter(|(k, _)| options::find(k).is_ok_and(|def| def.apply == options::Apply::Mount))
        .filter_map(|(k, v)| Some((k.split_once('.')?.1.to_owned(), v.clone())))
        .collect();
    Ok(VolumeToMount { bricks, options })
}

/// Where `brick` listens: its host's address (resolved if a name), or — a brick of a
/// single-node daemon — the daemon's brick address.
fn brick_address(global: &Global, brick: &kiln_admin::volume::Brick) -> anyhow::Result<SocketAddr> {
    use std::net::ToSocketAddrs as _;
    let Some(host) = &brick.host else {
        return Ok(SocketAddr::new(global.brick_addr.ip(), brick.port));
    };
    (host.as_str(), brick.port)
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve brick host {host}"))?
        .next()
        .with_context(|| format!("brick host {host} has no address"))
}

/// `kiln umount`.
pub(crate) fn umount(args: &UmountArgs) -> anyhow::Result<()> {
    use rustix::mount::{UnmountFlags, unmount};
    let path = args
        .mountpoint
        .canonicalize()
        .with_context(|| format!("{}", args.mountpoint.display()))?;
    let Some(device) = kiln_mount_device(&path)? else {
        bail!("{} is not a Kiln mount", args.mountpoint.display());
    };
    let flags = match args.lazy {
        true => UnmountFlags::DETACH,
        false => UnmountFlags::empty(),
    };
    match unmount(&path, flags) {
        // A lazy unmount ends when the last file on it is closed: nothing to wait for now.
        Ok(()) if args.lazy => Ok(()),
        Ok(()) => match kiln_client::mountinfo::other_namespace_with(&device) {
            Some(pid) => {
                eprintln!(
                    "kiln umount: {} is still mounted in the mount namespace of process {pid} \
                     (it was made after the mount); its process serves that copy until it \
                     goes, so this does not wait for it",
                    args.mountpoint.display()
                );
                Ok(())
            }
            None => wait_for_server_exit(&path),
        },
        Err(rustix::io::Errno::BUSY) => bail!(
            "cannot unmount {}: target is busy (files or directories on it are in use; \
             `kiln umount --lazy` detaches it now and ends it when they are closed)",
            args.mountpoint.display()
        ),
        Err(e) => Err(e).with_context(|| format!("cannot unmount {}", args.mountpoint.display())),
    }
}

/// The directory a mount covers, opened before it is covered and locked shared for as long
/// as the serving process holds the fd (`None`, logged, where the file system takes no
/// `flock`: `kiln umount` then does not wait).
fn hold_mountpoint(mountpoint: &Path) -> Option<std::fs::File> {
    let held = std::fs::File::open(mountpoint).and_then(|dir| {
        flock(&dir, FlockOperation::LockShared)?;
        Ok(dir)
    });
    match held {
        Ok(dir) => Some(dir),
        Err(e) => {
            tracing::warn!(error = %e, "cannot lock the mount point: `kiln umount` will not wait");
            None
        }
    }
}

/// Waits until every process that served a mount over `mountpoint` (now uncovered) has
/// exited, bounded by the mount's drain limit plus [`SERVER_EXIT_MARGIN`].
fn wait_for_server_exit(mountpoint: &Path) -> anyhow::Result<()> {
    let dir = std::fs::File::open(mountpoint)
        .with_context(|| format!("{} after the unmount", mountpoint.display()))?;
    let start = Instant::now();
    let limit = mount::UNMOUNT_DRAIN_LIMIT + SERVER_EXIT_MARGIN;
    let mut said = false;
    loop {
        match flock(&dir, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(()),
            Err(rustix::io::Errno::WOULDBLOCK) => {}
            // No locks here (the server could not take one either).
            Err(_) => return Ok(()),
        }
        let waited = start.elapsed();
        if waited >= limit {
            bail!(
                "{} is unmounted, but its process is still running after {} s: changes it \
                 answered itself may not be on the bricks yet (see its log)",
                mountpoint.display(),
                waited.as_secs()
            );
        }
        if !said && waited >= SERVER_EXIT_QUIET {
            eprintln!(
                "kiln umount: waiting for the mount's process to send its pending changes and exit"
            );
            said = true;
        }
        std::thread::sleep(SERVER_EXIT_POLL);
    }
}

/// The device (`MAJOR:MINOR`) of the Kiln mount on `mountpoint` (canonical), if there is one.
fn kiln_mount_device(mountpoint: &Path) -> anyhow::Result<Option<String>> {
    let mounts = kiln_client::mountinfo::read_self().context("/proc/self/mountinfo")?;
    Ok(mounts
        .into_iter()
        .find(|m| m.is_at(mountpoint, "fuse.kiln"))
        .map(|m| m.device))
}

/// The arguments of `mount.kiln SPEC DIR [-sfnv] [-N NS] [-o OPTS] [-t TYPE]`, as mount(8)
/// passes them, turned into `kiln mount SPEC DIR -o OPTS`; `None` for a fake mount (`-f`).
pub(crate) fn helper_args(args: &[String]) -> anyhow::Result<Option<Vec<String>>> {
    let mut positional = Vec::new();
    let mut options = None;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "-o" => options = Some(it.next().context("-o needs options")?.clone()),
            "-t" | "-N" => {
                it.next();
            }
            "-f" => return Ok(None),
            // sloppy, no mtab, verbose: nothing to do for a FUSE mount.
            "-s" | "-n" | "-v" => {}
            a if a.starts_with('-') => bail!("mount.kiln: unknown flag {a}"),
            a => positional.push(a.to_owned()),
        }
    }
    let [source, mountpoint] = positional.as_slice() else {
        bail!("usage: mount.kiln VOLUME|HOST:PORT MOUNTPOINT [-o OPTIONS]");
    };
    let mut out = vec![
        "kiln".to_owned(),
        "mount".to_owned(),
        source.clone(),
        mountpoint.clone(),
    ];
    if let Some(options) = options {
        out.push("-o".to_owned());
        out.push(options);
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn helper_arguments_become_a_mount_command() {
        let args: Vec<String> = ["vol", "/mnt/v", "-n", "-o", "rw,client=alice", "-t", "kiln"]
            .map(String::from)
            .into();
        assert_eq!(
            helper_args(&args).expect("valid").expect("not fake"),
            ["kiln", "mount", "vol", "/mnt/v", "-o", "rw,client=alice"]
        );
        assert_eq!(helper_args(&["-f".to_owned()]).expect("valid"), None);
        assert!(helper_args(&["only-one".to_owned()]).is_err());
        assert!(helper_args(&["a".into(), "b".into(), "-x".into()]).is_err());
    }
}
