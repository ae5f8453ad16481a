//! MooseFS for the moosefs target: a master and one chunkserver (Debian's `moosefs-master`,
//! `moosefs-chunkserver` and `moosefs-client`, installed beforehand: the run installs
//! nothing) started in the foreground with their metadata, chunks and configuration in the
//! target's directory, on ports of their own ([`PORTS`]) of this host's first IPv4 address
//! that is not loopback (a chunkserver refuses a master on loopback; the master exports to
//! that address only), then mounted with `mfsmount -f` and its default options; every file
//! kept in one copy (goal 1) and a removed file gone at once (trash time 0), as on the other
//! targets. [`MooseFs::stop`] ends the servers after the unmount (the master saves its
//! metadata on SIGTERM).

use std::net::{Ipv4Addr, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::json;

use crate::process::{Daemon, check_stop, log_tail, run_bounded};

/// The programs the target runs, and the packages they come in.
pub(super) const PROGRAMS: [&str; 5] = [
    "mfsmaster",
    "mfschunkserver",
    "mfsmount",
    "mfssetgoal",
    "mfssettrashtime",
];
pub(super) const PACKAGES: &str = "moosefs-master, moosefs-chunkserver, moosefs-client";
/// The empty metadata a new master starts from (from `moosefs-master`).
const EMPTY_METADATA: &str = "/var/lib/mfs/metadata.mfs.empty";
/// The master's ports for metaloggers, chunkservers and clients, and the chunkserver's.
const PORTS: [u16; 4] = [19419, 19420, 19421, 19422];
/// How long the master may take to listen, and the chunkserver to take a first write.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);

/// A master and its chunkserver.
#[derive(Debug)]
pub(super) struct MooseFs {
    /// The address the servers listen on.
    host: Ipv4Addr,
    servers: Vec<Daemon>,
}

impl MooseFs {
    /// Writes the configuration into `dir` and starts the master and the chunkserver.
    pub(super) fn start(dir: &Path, logs: &Path) -> anyhow::Result<MooseFs> {
        let [ml, cs, cl, chunks] = PORTS;
        let host = host_address()?;
        let (master, chunkserver, hdd) = (dir.join("master"), dir.join("cs"), dir.join("hdd"));
        for d in [&master, &chunkserver, &hdd] {
            std::fs::create_dir(d).with_context(|| format!("cannot create {}", d.display()))?;
        }
        std::fs::copy(EMPTY_METADATA, master.join("metadata.mfs"))
            .with_context(|| format!("cannot copy {EMPTY_METADATA}"))?;
        let (exports, topology, hdds) = (
            dir.join("mfsexports.cfg"),
            dir.join("mfstopology.cfg"),
            dir.join("mfshdd.cfg"),
        );
        let as_root = "WORKING_USER = root\nWORKING_GROUP = root\n";
        let files = [
            (&exports, format!("{host} / rw,alldirs,maproot=0\n")),
            (&topology, String::new()),
            (&hdds, format!("{}\n", hdd.display())),
            (
                &dir.join("mfsmaster.cfg"),
                format!(
                    "{as_root}DATA_PATH = {}\nEXPORTS_FILENAME = {}\nTOPOLOGY_FILENAME = {}\n\
                     MATOML_LISTEN_HOST = {host}\nMATOML_LISTEN_PORT = {ml}\n\
                     MATOCS_LISTEN_HOST = {host}\nMATOCS_LISTEN_PORT = {cs}\n\
                     MATOCL_LISTEN_HOST = {host}\nMATOCL_LISTEN_PORT = {cl}\n",
                    master.display(),
                    exports.display(),
                    topology.display(),
                ),
            ),
            (
                &dir.join("mfschunkserver.cfg"),
                format!(
                    "{as_root}DATA_PATH = {}\nHDD_CONF_FILENAME = {}\n\
                     MASTER_HOST = {host}\nMASTER_PORT = {cs}\nBIND_HOST = {host}\n\
                     CSSERV_LISTEN_HOST = {host}\nCSSERV_LISTEN_PORT = {chunks}\n",
                    chunkserver.display(),
                    hdds.display(),
                ),
            ),
        ];
        for (path, text) in files {
            std::fs::write(path, text)
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
        let mut moosefs = MooseFs {
            host,
            servers: Vec::new(),
        };
        // The chunkserver and the mount connect once the master listens.
        moosefs.spawn("mfsmaster", dir, logs)?;
        moosefs.wait_listening(cs)?;
        moosefs.wait_listening(cl)?;
        moosefs.spawn("mfschunkserver", dir, logs)?;
        Ok(moosefs)
    }

    /// Starts server `program` with its configuration in `dir` (`PROGRAM.cfg`).
    fn spawn(&mut self, program: &'static str, dir: &Path, logs: &Path) -> anyhow::Result<()> {
        let mut cmd = Command::new(program);
        cmd.arg("-c")
            .arg(dir.join(format!("{program}.cfg")))
            .args(["-f", "start"])
            .stdout(Stdio::null());
        let log = logs.join(format!("{program}.log"));
        self.servers.push(Daemon::spawn(program, &mut cmd, &log)?);
        Ok(())
    }

    /// Waits (bounded) until the master listens on port `port`, failing if a server exits
    /// first.
    fn wait_listening(&mut self, port: u16) -> anyhow::Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        while TcpStream::connect((self.host, port)).is_err() {
            check_stop()?;
            self.check_running()?;
            if Instant::now() >= deadline {
                bail!(
                    "nothing listens on {}:{port} after {READY_TIMEOUT:?}",
                    self.host
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Fails if a server has exited.
    fn check_running(&mut self) -> anyhow::Result<()> {
        for server in &mut self.servers {
            if let Some(status) = server.exited() {
                bail!(
                    "{} exited ({status}):\n{}",
                    server.name,
                    log_tail(&server.log)
                );
            }
        }
        Ok(())
    }

    /// The command that mounts the file system on `mnt` (`mfsmount -f`).
    pub(super) fn mount_command(&self, mnt: &Path) -> Command {
        let mut cmd = Command::new("mfsmount");
        cmd.arg("-f")
            .args(["-H", &self.host.to_string(), "-P", &PORTS[2].to_string()])
            .arg(mnt)
            .stdout(Stdio::null());
        cmd
    }

    /// Once `mnt` is mounted: goal 1 and trash time 0 on its root, and a first file written
    /// and synced, which succeeds only once the chunkserver has registered with the master
    /// (bounded).
    pub(super) fn ready(&mut self, mnt: &Path, logs: &Path) -> anyhow::Result<()> {
        let log = logs.join("moosefs-setup.log");
        for (tool, value) in [("mfssetgoal", "1"), ("mfssettrashtime", "0")] {
            let mut cmd = Command::new(tool);
            cmd.args(["-r", value]).arg(mnt);
            run_bounded(&mut cmd, None, &log, COMMAND_TIMEOUT)
                .with_context(|| format!("{tool} -r {value}"))?;
        }
        let probe = mnt.join(".kiln-bench-probe");
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            check_stop()?;
            self.check_running()?;
            let mut write = Command::new("sh");
            write.args(["-c", r#"echo ready > "$1" && sync "$1""#, "sh"]);
            write.arg(&probe);
            if run_bounded(&mut write, None, &log, Duration::from_secs(10)).is_ok() {
                break;
            }
            if Instant::now() >= deadline {
                bail!("no chunkserver took a write within {READY_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        std::fs::remove_file(&probe).with_context(|| format!("cannot remove {}", probe.display()))
    }

    /// What the target runs, for its note.
    pub(super) fn describe() -> serde_json::Value {
        json!({ "moosefs": crate::process::version_with("mfsmaster", "-v"),
                "servers": "mfsmaster and one mfschunkserver on this host, goal 1, trash time 0",
                "mount": "mfsmount -f (default options)" })
    }

    /// Stops the servers (after the unmount); their exit statuses.
    pub(super) fn stop(&mut self) -> anyhow::Result<serde_json::Value> {
        let mut stops = Vec::new();
        // The chunkserver first, then the master, which saves its metadata.
        for server in self.servers.iter_mut().rev() {
            let (status, killed) = server.stop()?;
            stops.push(
                json!({ "server": server.name, "status": status.map(|s| s.to_string()),
                               "sigkill": killed }),
            );
        }
        Ok(json!(stops))
    }
}

/// This host's first IPv4 address that is not loopback (of those `hostname -I` lists).
pub(super) fn host_address() -> anyhow::Result<Ipv4Addr> {
    super::glusterd::host_candidates()
        .iter()
        .filter_map(|a| a.parse::<Ipv4Addr>().ok())
        .find(|a| !a.is_loopback())
        .context("no IPv4 address but loopback (hostname -I), and a chunkserver needs one")
}
