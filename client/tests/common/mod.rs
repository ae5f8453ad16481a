//! A real `kiln-brickd` on loopback with its TLS material, for end-to-end tests.
#![allow(
    dead_code,
    unreachable_pub,
    reason = "each test file uses a different part"
)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kiln_admin::pki::{self, Role};
use kiln_client::{BrickClient, ConnectOptions};

/// The next number of a xorshift64 sequence: deterministic (a test's seed replays it), no
/// dependency.
pub fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// A binary of this workspace, built beside the test executable by `cargo test`.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: run the workspace's tests (`./scripts/test`), which build every binary",
        path.display()
    );
    path
}

/// A formatted brick and a TLS directory with a CA, a brick certificate `b` and client
/// certificates `alice` and `bob`.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub tls: PathBuf,
    pub brick: PathBuf,
}

impl Cluster {
    pub fn new() -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let tls = dir.path().join("tls");
        pki::init_ca(&tls).expect("ca");
        let hosts = vec!["127.0.0.1".into(), "localhost".into()];
        pki::issue(&tls, &Role::Brick { hosts }, "b", 1).expect("brick cert");
        for client in ["alice", "bob"] {
            pki::issue(&tls, &Role::Client, client, 1).expect("client cert");
        }
        let brick = format_brick(&dir.path().join("brick"));
        Cluster { dir, tls, brick }
    }

    /// Formats one more brick, `brick-N`, beside the first (for a distributed volume).
    pub fn add_brick(&self, n: usize) -> PathBuf {
        format_brick(&self.brick_dir(n))
    }

    /// Brick `n` of a distributed volume: the first, or `brick-N` beside it.
    pub fn brick_dir(&self, n: usize) -> PathBuf {
        match n {
            0 => self.brick.clone(),
            n => self.dir.path().join(format!("brick-{n}")),
        }
    }

    /// Starts `kiln-brickd serve` on `listen` with `extra` arguments and waits until it
    /// listens. Client `alice` is trusted with root (`--root-allow alice`) unless `extra`
    /// says otherwise about root squashing; `bob` is squashed.
    pub fn start(&self, listen: &str, extra: &[&str]) -> Brickd {
        self.start_brick(&self.brick, listen, extra)
    }

    /// [`Cluster::start`] for brick directory `brick`.
    pub fn start_brick(&self, brick: &Path, listen: &str, extra: &[&str]) -> Brickd {
        let squash_set = extra
            .iter()
            .any(|a| matches!(*a, "--root-allow" | "--root-squash"));
        let trust: &[&str] = if squash_set {
            &[]
        } else {
            &["--root-allow", "alice"]
        };
        let log = self.dir.path().join(format!(
            "brickd-{}.log",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        ));
        let mut child = Command::new(bin("kiln-brickd"))
            .arg("serve")
            .arg(brick)
            .args(["--listen", listen, "--name", "b", "--tls-dir"])
            .arg(&self.tls)
            .args(trust)
            .args(extra)
            .env("RUST_LOG", "info,kiln_dataplane::server=debug")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("spawn kiln-brickd");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the listening line");
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| {
                panic!(
                    "kiln-brickd did not start: {line:?}\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )
            })
            .parse()
            .expect("address");
        let brickd = Brickd { child, addr, log };
        // The engine asked for (io_uring unless `--engine blocking`) must be the one that
        // runs: these tests never pass on a silent fallback.
        let blocking = extra.windows(2).any(|w| w == ["--engine", "blocking"]);
        let want = if blocking { "blocking" } else { "uring" };
        assert_eq!(brickd.engine(), want, "the brick runs another engine");
        brickd
    }

    pub fn options(&self, addr: SocketAddr, client: &str) -> ConnectOptions {
        ConnectOptions::from_tls_dir(addr, &self.tls, client).expect("client identity")
    }

    pub async fn connect(&self, addr: SocketAddr, client: &str) -> BrickClient {
        BrickClient::connect(self.options(addr, client))
            .await
            .expect("connect")
    }
}

/// Makes directory `brick` and formats it as a brick.
pub fn format_brick(brick: &Path) -> PathBuf {
    std::fs::create_dir(brick).expect("brick dir");
    let status = Command::new(bin("kiln-brickd"))
        .arg("format")
        .arg(brick)
        .stdout(Stdio::null())
        .status()
        .expect("format");
    assert!(status.success());
    brick.to_path_buf()
}

/// A running brick process; killed when dropped.
pub struct Brickd {
    pub child: Child,
    pub addr: SocketAddr,
    pub log: PathBuf,
}

impl Brickd {
    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).expect("pid")
    }

    /// The engine the brick runs (`uring` or `blocking`), as it logged at start.
    pub fn engine(&self) -> String {
        let logs = self.wait_for_log("engine started");
        logs.lines()
            .find(|l| l.contains("engine started"))
            .and_then(|l| l.split("engine=").nth(1))
            .and_then(|rest| rest.split_whitespace().next())
            .expect("the engine in the log")
            .to_owned()
    }

    /// Everything the brick has logged so far.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits (bounded) until the log contains `needle`.
    pub fn wait_for_log(&self, needle: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let logs = self.logs();
            if logs.contains(needle) || Instant::now() > deadline {
                return logs;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `kill -9`.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then the exit status (bounded wait).
    pub fn terminate(mut self) -> std::process::ExitStatus {
        signal(self.pid(), rustix::process::Signal::TERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "kiln-brickd ignored SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Open file descriptors of the brick process.
    pub fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(Iterator::count)
            .unwrap_or(0)
    }
}

impl Drop for Brickd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn signal(pid: i32, sig: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(pid).expect("pid");
    rustix::process::kill_process(pid, sig).expect("kill");
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Runs `kiln-brickd check` on `brick`: it must find nothing wrong.
pub fn assert_brick_checks_clean(brick: &Path) {
    let check = Command::new(bin("kiln-brickd"))
        .arg("check")
        .arg(brick)
        .output()
        .expect("kiln-brickd check");
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stdout)
    );
}

/// One `GET /metrics` from a brick's Prometheus endpoint, parsed as Prometheus text.
pub fn scrape(addr: &str) -> prometheus_parse::Scrape {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).expect("connect to metrics");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\n\r\n").expect("request");
    let mut reply = String::new();
    stream.read_to_string(&mut reply).expect("reply");
    let (head, body) = reply.split_once("\r\n\r\n").expect("an HTTP reply");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    let lines = body.lines().map(|l| Ok(l.to_owned()));
    prometheus_parse::Scrape::parse(lines).expect("Prometheus text")
}

/// How many of `fop` a brick has served, from its `kiln_fop_calls_total` (0 before the first).
pub fn fop_calls(scrape: &prometheus_parse::Scrape, fop: &str) -> f64 {
    let found = scrape
        .samples
        .iter()
        .find(|s| s.metric == "kiln_fop_calls_total" && s.labels.get("fop") == Some(fop));
    match found.map(|s| &s.value) {
        Some(prometheus_parse::Value::Counter(v)) => *v,
        None => 0.0,
        Some(other) => panic!("kiln_fop_calls_total{{fop={fop}}}: {other:?}"),
    }
}

/// A loopback address no one listens on now, for a server the test starts next.
pub fn free_loopback_addr() -> String {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    probe.local_addr().expect("local address").to_string()
}

/// `kiln umount MOUNTPOINT`, asked again while the mount is busy ([`while_busy`]).
pub fn kiln_umount(mountpoint: &Path) -> std::process::Output {
    while_busy(|| {
        Command::new(bin("kiln"))
            .arg("umount")
            .arg(mountpoint)
            .output()
            .expect("kiln umount")
    })
}

/// Runs `umount` (a `kiln umount`) again (for 10 s at most) while it answers "target is
/// busy": a process a parallel test spawns holds copies of this process's open descriptors
/// until it execs, so a file this test has just closed can still pin the mount for a moment.
pub fn while_busy(mut umount: impl FnMut() -> std::process::Output) -> std::process::Output {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = umount();
        let busy = String::from_utf8_lossy(&out.stderr).contains("target is busy");
        if out.status.success() || !busy || Instant::now() > deadline {
            return out;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Whether `path` is a Kiln FUSE mount now.
pub fn is_kiln_mount(path: &Path) -> bool {
    kiln_client::mountinfo::read_self()
        .expect("/proc/self/mountinfo")
        .iter()
        .any(|m| m.is_at(path, "fuse.kiln"))
}
