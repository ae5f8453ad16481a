//! Runs members of a local etcd cluster (Debian's `etcd-server`, v3 API) for the tests and
//! the benchmark (`deploy/cluster.sh` starts its own): each member is an `etcd` process with
//! its own data directory, stopped (SIGKILL) when dropped.

use std::ffi::OsString;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

/// How long a member may take to listen for clients.
const START_WAIT: Duration = Duration::from_secs(30);
/// Set to make the tests fail, instead of skip, where etcd is not installed (CI sets it).
pub const REQUIRE_ETCD_ENV: &str = "KILN_REQUIRE_ETCD";

/// The `etcd` executable: on PATH, or Debian's.
pub fn etcd_binary() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join("etcd"));
    on_path
        .chain([PathBuf::from("/usr/bin/etcd")])
        .find(|p| p.is_file())
}

/// The `etcd` executable for a test, or `None` (and a note) when it may be skipped; panics
/// when [`REQUIRE_ETCD_ENV`] is set and etcd is missing.
pub fn etcd_for_test(test: &str) -> Option<PathBuf> {
    let found = etcd_binary();
    if found.is_none() {
        assert!(
            std::env::var_os(REQUIRE_ETCD_ENV).is_none(),
            "{test}: etcd is not installed (apt-get install etcd-server) and {REQUIRE_ETCD_ENV} is set"
        );
        eprintln!("{test}: skipped: etcd is not installed (apt-get install etcd-server)");
    }
    found
}

/// One member of an etcd cluster.
#[derive(Debug, Clone)]
pub struct Member {
    pub name: String,
    pub client: SocketAddr,
    pub peer: SocketAddr,
}

impl Member {
    /// The member of a one-member cluster on free loopback ports, not started.
    pub fn single() -> anyhow::Result<Member> {
        Ok(Member {
            name: "solo".to_owned(),
            client: free_loopback_port()?,
            peer: free_loopback_port()?,
        })
    }

    pub fn client_url(&self) -> String {
        format!("http://{}", self.client)
    }

    fn peer_url(&self) -> String {
        format!("http://{}", self.peer)
    }
}

/// A running member; SIGKILLed when dropped.
#[derive(Debug)]
pub struct EtcdServer {
    pub member: Member,
    child: Child,
    pub data_dir: PathBuf,
}

impl EtcdServer {
    /// Starts `member` of the cluster `members` (which lists it too), its data in
    /// `data_dir`, run through `wrapper` (e.g. `ip netns exec NS`; empty: directly), and
    /// waits until it listens for clients — reachable from here, so a member in a network
    /// namespace is waited for only if its address is routed to.
    pub fn start(
        etcd: &Path,
        member: &Member,
        members: &[Member],
        data_dir: &Path,
        wrapper: &[OsString],
    ) -> anyhow::Result<EtcdServer> {
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer_url()))
            .collect::<Vec<_>>()
            .join(",");
        let log = std::fs::File::create(data_dir.with_extension("log"))
            .with_context(|| format!("log of etcd member {}", member.name))?;
        let mut command = match wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(etcd);
                c
            }
            None => Command::new(etcd),
        };
        command
            .arg("--name")
            .arg(&member.name)
            .arg("--data-dir")
            .arg(data_dir)
            .arg("--listen-client-urls")
            .arg(member.client_url())
            .arg("--advertise-client-urls")
            .arg(member.client_url())
            .arg("--listen-peer-urls")
            .arg(member.peer_url())
            .arg("--initial-advertise-peer-urls")
            .arg(member.peer_url())
            .arg("--initial-cluster")
            .arg(&initial_cluster)
            .arg("--initial-cluster-state")
            .arg("new")
            // Elections within a second or two on a loaded two-core machine.
            .args(["--heartbeat-interval", "100", "--election-timeout", "1000"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        let child = command
            .spawn()
            .with_context(|| format!("cannot run {}", etcd.display()))?;
        let mut server = EtcdServer {
            member: member.clone(),
            child,
            data_dir: data_dir.to_owned(),
        };
        server.wait_listening()?;
        Ok(server)
    }

    /// A one-member cluster on free loopback ports.
    pub fn single(etcd: &Path, data_dir: &Path) -> anyhow::Result<EtcdServer> {
        EtcdServer::start_single(etcd, &Member::single()?, data_dir)
    }

    /// `member` as a one-member cluster, once it has elected itself and answers (a member
    /// listens before it has a leader, and refuses requests until then).
    pub fn start_single(etcd: &Path, member: &Member, data_dir: &Path) -> anyhow::Result<Self> {
        let mut server =
            EtcdServer::start(etcd, member, std::slice::from_ref(member), data_dir, &[])?;
        server.wait_healthy()?;
        Ok(server)
    }

    /// A one-member cluster for test `test`, its data in `data_dir`; `None` where etcd is
    /// not installed (and may be missing: see [`etcd_for_test`]).
    pub fn single_for_test(test: &str, data_dir: &Path) -> Option<EtcdServer> {
        let etcd = etcd_for_test(test)?;
        Some(EtcdServer::single(&etcd, data_dir).expect("a test's etcd member"))
    }

    /// Where cluster `cluster` lives on this member.
    pub fn target(&self, cluster: &str) -> crate::store::etcd::EtcdTarget {
        crate::store::etcd::EtcdTarget {
            endpoints: vec![self.member.client_url()],
            cluster: cluster.to_owned(),
        }
    }

    fn wait_listening(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + START_WAIT;
        loop {
            if TcpStream::connect_timeout(&self.member.client, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "etcd member {} exited ({status}); see {}",
                    self.member.name,
                    self.data_dir.with_extension("log").display()
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "etcd member {} does not listen on {} after {START_WAIT:?}",
                    self.member.name,
                    self.member.client
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until the member says it is healthy (`/health`: it has a leader).
    fn wait_healthy(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + START_WAIT;
        while !self.healthy() {
            if let Some(status) = self.child.try_wait()? {
                bail!("etcd member {} exited ({status})", self.member.name);
            }
            if Instant::now() >= deadline {
                bail!(
                    "etcd member {} is not healthy after {START_WAIT:?}; see {}",
                    self.member.name,
                    self.data_dir.with_extension("log").display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Whether the member's `/health` says so.
    fn healthy(&self) -> bool {
        use std::io::{Read, Write};
        let timeout = Duration::from_secs(1);
        let Ok(mut stream) = TcpStream::connect_timeout(&self.member.client, timeout) else {
            return false;
        };
        let mut answer = String::new();
        let _ = stream.set_read_timeout(Some(timeout));
        stream.write_all(b"GET /health HTTP/1.0\r\n\r\n").is_ok()
            && stream.read_to_string(&mut answer).is_ok()
            && answer.contains(r#""health":"true""#)
    }

    /// Kills the member at once (as a crash would).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Loopback ports a single member is given: below Linux's ephemeral range (32768 and up by
/// default), so no connection's local port can take one between its pick and the member's
/// bind (a member that lost its port that way exited, and the test's next call found nobody).
const MEMBER_PORTS: std::ops::Range<u16> = 20_000..32_000;

/// A loopback TCP address no one listens on now, from [`MEMBER_PORTS`], never given twice by
/// this process (its tests start members at once).
fn free_loopback_port() -> anyhow::Result<SocketAddr> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let span = u32::from(MEMBER_PORTS.end - MEMBER_PORTS.start);
    // Processes start apart in the range, so two of them rarely probe the same ports.
    let start = std::process::id().wrapping_mul(7_919) % span;
    for _ in 0..span {
        let offset = (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        let port = MEMBER_PORTS.start + u16::try_from(offset).expect("below the span");
        if let Ok(listener) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            return Ok(listener.local_addr()?);
        }
    }
    bail!("no free loopback port in {MEMBER_PORTS:?}")
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
    }
}
