//! A cluster of three hosts on this machine: each a network namespace on a bridge, running a
//! member of one etcd cluster (Debian's `etcd-server`) and a `kiln-mgmtd` that keeps the
//! configuration there. The first host makes the cluster (`kiln cluster init`), the others
//! join it with one-time tokens and never hold the CA's key. Volumes span the hosts; any
//! host's daemon takes any command; daemons and etcd members are killed, and a host is cut off
//! its network, while changes go on.
//!
//! Needs root (namespaces) and etcd: where etcd is missing the tests are skipped, unless
//! `KILN_REQUIRE_ETCD` is set (the test command sets it), which makes them fail.

mod common;
mod mount_common;

use std::ffi::OsString;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::bin;
use kiln_admin::command::{BrickStatus, Response};
use kiln_mgmt::etcd_server::{EtcdServer, Member, etcd_for_test};

const HOSTS: usize = 3;
const CLUSTER: &str = "test";

/// Three namespaced hosts with an etcd member and a daemon each.
struct Hosts {
    dir: tempfile::TempDir,
    bridge: String,
    etcd: PathBuf,
    members: Vec<Member>,
    hosts: Vec<Host>,
}

struct Host {
    ns: String,
    /// The root namespace's end of the host's link (down: the host is cut off).
    link: String,
    ip: Ipv4Addr,
    state: PathBuf,
    socket: PathBuf,
    member: Option<EtcdServer>,
    daemon: Option<Child>,
}

impl Host {
    fn name(&self) -> String {
        self.ip.to_string()
    }

    fn wrapper(&self) -> Vec<OsString> {
        ["ip", "netns", "exec", &self.ns]
            .into_iter()
            .map(OsString::from)
            .collect()
    }
}

/// `kiln ARGS` as the `admin` of the host whose daemon listens on `socket` with state
/// directory `state`.
fn kiln_of(socket: &Path, state: &Path, args: &[&str]) -> Output {
    Command::new(bin("kiln"))
        .args(args)
        .env("KILN_MGMT_SOCKET", socket)
        .env("KILN_STATE_DIR", state)
        .env("KILN_TLS_DIR", state.join("tls"))
        .output()
        .expect("kiln")
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Hosts {
    /// Three hosts on a fresh bridge; `test` (a small number) keeps the names and the
    /// subnet of concurrent tests apart.
    fn start(name: &str, test: u8) -> Option<Hosts> {
        let etcd = etcd_for_test(name)?;
        let tag = format!("{}{test}", std::process::id() % 10_000);
        let third = u8::try_from(std::process::id() % 250).expect("< 250");
        let bridge = format!("kb{tag}");
        ip(&["link", "add", &bridge, "type", "bridge"]);
        let hosts_dir = tempfile::tempdir().expect("tempdir");
        let mut hosts = Hosts {
            dir: hosts_dir,
            bridge: bridge.clone(),
            etcd,
            members: Vec::new(),
            hosts: Vec::new(),
        };
        let gateway = format!("10.{}.{third}.254/24", 200 + test);
        ip(&["addr", "add", &gateway, "dev", &bridge]);
        ip(&["link", "set", &bridge, "up"]);
        for i in 0..HOSTS {
            let ns = format!("kiln-{tag}-{i}");
            let link = format!("kv{tag}{i}");
            let addr = Ipv4Addr::new(10, 200 + test, third, 1 + i as u8);
            ip(&["netns", "add", &ns]);
            ip(&[
                "link", "add", &link, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ]);
            ip(&["link", "set", &link, "master", &bridge, "up"]);
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                "eth0",
            ]);
            ip(&["-n", &ns, "link", "set", "eth0", "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
            let dir = hosts.dir.path().join(format!("host{i}"));
            std::fs::create_dir_all(&dir).expect("host dir");
            hosts.members.push(Member {
                name: format!("m{i}"),
                client: SocketAddr::from((addr, 2379)),
                peer: SocketAddr::from((addr, 2380)),
            });
            hosts.hosts.push(Host {
                ns,
                link,
                ip: addr,
                state: dir.join("state"),
                socket: dir.join("run/mgmtd.sock"),
                member: None,
                daemon: None,
            });
        }
        for i in 0..HOSTS {
            hosts.start_member(i);
        }
        // The first host makes the cluster (and its CA); each other joins with a token the
        // first one gives, and gets its certificates without the CA's key.
        let first = hosts.hosts[0].name();
        let endpoints = hosts.endpoints();
        hosts.kiln_ok(
            0,
            &[
                "cluster",
                "init",
                "--etcd",
                &endpoints,
                "--host",
                &first,
                "--cluster",
                CLUSTER,
            ],
        );
        hosts.start_daemon(0);
        for i in 1..HOSTS {
            let token = hosts.kiln_ok(0, &["cluster", "token"]);
            let name = hosts.hosts[i].name();
            hosts.kiln_ok(
                i,
                &[
                    "cluster",
                    "join",
                    &first,
                    "--host",
                    &name,
                    "--token",
                    token.trim(),
                ],
            );
            assert!(!hosts.hosts[i].state.join("tls/ca.key").exists());
            hosts.start_daemon(i);
        }
        Some(hosts)
    }

    fn endpoints(&self) -> String {
        self.members
            .iter()
            .map(Member::client_url)
            .collect::<Vec<_>>()
            .join(",")
    }

    fn start_member(&mut self, i: usize) {
        let host = &self.hosts[i];
        let data = self.dir.path().join(format!("host{i}/etcd"));
        let server = EtcdServer::start(
            &self.etcd,
            &self.members[i],
            &self.members,
            &data,
            &host.wrapper(),
        )
        .expect("etcd member");
        self.hosts[i].member = Some(server);
    }

    /// Starts host `i`'s daemon on the cluster its state directory records.
    fn start_daemon(&mut self, i: usize) {
        let host = &mut self.hosts[i];
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(host.state.with_extension("log"))
            .expect("log");
        let wrapper = host.wrapper();
        let (program, netns) = wrapper.split_first().expect("a wrapper");
        let daemon = Command::new(program)
            .args(netns)
            .arg(bin("kiln-mgmtd"))
            .arg("--state-dir")
            .arg(&host.state)
            .arg("--socket")
            .arg(&host.socket)
            .args(["--listen-ip", &host.name()])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("kiln-mgmtd");
        host.daemon = Some(daemon);
        // Ready once it answers (it listens before it has opened the store).
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.kiln(i, &["cluster", "status"]).status.success() {
            assert!(
                Instant::now() < deadline,
                "kiln-mgmtd of host {i} did not start:\n{}",
                self.daemon_log(i)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill_daemon(&mut self, i: usize) {
        if let Some(mut daemon) = self.hosts[i].daemon.take() {
            let _ = daemon.kill();
            let _ = daemon.wait();
        }
    }

    /// SIGTERM to host `i`'s daemon (as `systemctl restart` sends), and waits for its exit.
    fn stop_daemon(&mut self, i: usize) {
        let mut daemon = self.hosts[i].daemon.take().expect("a running daemon");
        common::signal(daemon.id() as i32, rustix::process::Signal::TERM);
        let status = daemon.wait().expect("wait for kiln-mgmtd");
        assert!(status.success(), "kiln-mgmtd exited {status}");
    }

    fn daemon_log(&self, i: usize) -> String {
        std::fs::read_to_string(self.hosts[i].state.with_extension("log")).unwrap_or_default()
    }

    /// `kiln ARGS` against host `i`'s daemon, as its `admin`.
    fn kiln(&self, i: usize, args: &[&str]) -> Output {
        kiln_of(&self.hosts[i].socket, &self.hosts[i].state, args)
    }

    fn kiln_ok(&self, i: usize, args: &[&str]) -> String {
        let out = self.kiln(i, args);
        assert!(
            out.status.success(),
            "kiln {args:?} on host {i}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `kiln umount MNT` on host `i`, asked again while the mount is busy
    /// ([`common::while_busy`]).
    fn umount(&self, i: usize, mnt: &Path) {
        let mnt = mnt.to_str().expect("utf-8");
        let out = common::while_busy(|| self.kiln(i, &["umount", mnt]));
        assert!(
            out.status.success(),
            "kiln umount on host {i}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn json(&self, i: usize, args: &[&str]) -> Response {
        let mut all = vec!["volume", "--json"];
        all.extend_from_slice(args);
        self.json_of(i, &all)
    }

    fn json_of(&self, i: usize, args: &[&str]) -> Response {
        serde_json::from_str(&self.kiln_ok(i, args)).expect("JSON answer")
    }

    fn status(&self, i: usize, volume: &str) -> Vec<BrickStatus> {
        match self.json(i, &["status", volume]) {
            Response::Status { bricks } => bricks,
            other => panic!("{other:?}"),
        }
    }

    /// Waits until `ok` holds for host `i`'s view of `volume`'s bricks.
    fn wait_status(&self, i: usize, volume: &str, ok: impl Fn(&[BrickStatus]) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let bricks = self.status(i, volume);
            if ok(&bricks) {
                return;
            }
            assert!(Instant::now() < deadline, "host {i} sees {bricks:#?}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn option(&self, i: usize, volume: &str, key: &str) -> String {
        let out = self.kiln_ok(i, &["volume", "get", volume, key]);
        out.split_whitespace().nth(1).unwrap_or_default().to_owned()
    }

    /// Option `key` of `volume` on host `i` once it is `want`, or as it is after 10 s (each
    /// daemon's copy follows the others' commits by its watch).
    fn option_once(&self, i: usize, volume: &str, key: &str, want: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let value = self.option(i, volume, key);
            if value == want || Instant::now() >= deadline {
                return value;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A volume with one brick on each host, started, its `admin` root on the mount.
    fn volume(&self, name: &str) -> Vec<PathBuf> {
        let bricks: Vec<PathBuf> = (0..HOSTS)
            .map(|i| self.dir.path().join(format!("host{i}/{name}")))
            .collect();
        let specs: Vec<String> = bricks
            .iter()
            .zip(&self.hosts)
            .map(|(path, host)| format!("{}:{}", host.name(), path.display()))
            .collect();
        let mut args = vec!["volume", "create", name];
        args.extend(specs.iter().map(String::as_str));
        self.kiln_ok(0, &args);
        self.kiln_ok(1, &["volume", "set", name, "server.root-allow", "admin"]);
        self.kiln_ok(1, &["volume", "start", name]);
        bricks
    }

    fn set_link(&self, i: usize, up: bool) {
        ip(&[
            "link",
            "set",
            &self.hosts[i].link,
            if up { "up" } else { "down" },
        ]);
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for i in 0..HOSTS {
            self.kill_daemon(i);
        }
        // The bricks outlive their daemons: stop them by their pid files.
        for host in &self.hosts {
            for entry in std::fs::read_dir(host.state.join("run"))
                .into_iter()
                .flatten()
            {
                let path = entry.map(|e| e.path()).unwrap_or_default();
                if path.extension().is_some_and(|e| e == "pid")
                    && let Ok(pid) = std::fs::read_to_string(&path)
                    && std::fs::read(format!("/proc/{}/cmdline", pid.trim()))
                        .is_ok_and(|c| c.windows(11).any(|w| w == b"kiln-brickd"))
                    && let Some(pid) = pid
                        .trim()
                        .parse()
                        .ok()
                        .and_then(rustix::process::Pid::from_raw)
                {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                }
            }
        }
        for host in &mut self.hosts {
            host.member = None;
            let _ = Command::new("ip").args(["netns", "del", &host.ns]).status();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.bridge])
            .status();
    }
}

fn running(bricks: &[BrickStatus]) -> bool {
    bricks
        .iter()
        .all(|b| b.pid.is_some() && b.state == "running")
}

fn pids(bricks: &[BrickStatus]) -> Vec<Option<u32>> {
    bricks.iter().map(|b| b.pid).collect()
}

#[test]
fn three_hosts_share_one_configuration_and_serve_one_volume() {
    let Some(mut hosts) = Hosts::start("three_hosts_share_one_configuration", 1) else {
        return;
    };
    let bricks = hosts.volume("v");
    // Created on host 0, started on host 1: every host's daemon runs its own brick, and
    // probes it: any host sees every brick answer.
    hosts.wait_status(2, "v", running);
    hosts.wait_status(2, "v", |b| b.iter().all(|b| b.health == "ok"));
    let set = hosts.kiln_ok(2, &["volume", "set", "v", "network.inflight-max", "64"]);
    assert!(set.contains("applied by 3 running brick(s)"), "{set}");
    assert_eq!(hosts.option(0, "v", "network.inflight-max"), "64");
    let cluster = hosts.kiln_ok(1, &["cluster", "status"]);
    for host in &hosts.hosts {
        assert!(cluster.contains(&host.name()), "{cluster}");
    }
    // A volume-wide profile and state dump from any host: every host's daemon answers for
    // its own bricks.
    match hosts.json(2, &["profile", "v", "start"]) {
        Response::Profiles { bricks, .. } => {
            assert_eq!(bricks.len(), HOSTS);
            assert!(bricks.iter().all(|b| b.report.is_some()), "{bricks:#?}");
        }
        other => panic!("{other:?}"),
    }
    match hosts.json(0, &["statedump", "v"]) {
        Response::Statedumps { bricks, .. } => {
            assert!(bricks.iter().all(|b| b.report.is_some()), "{bricks:#?}");
        }
        other => panic!("{other:?}"),
    }

    // A mount reaches each brick at its host.
    let mnt = hosts.dir.path().join("mnt");
    std::fs::create_dir(&mnt).expect("mountpoint");
    hosts.kiln_ok(0, &["mount", "v", mnt.to_str().expect("utf-8")]);
    for n in 0..30 {
        std::fs::write(mnt.join(format!("f{n}")), format!("file {n}")).expect("write");
    }
    let holding = bricks
        .iter()
        .filter(|b| {
            std::fs::read_dir(b)
                .expect("brick")
                .filter_map(Result::ok)
                .any(|e| e.file_name().to_string_lossy().starts_with('f'))
        })
        .count();
    assert!(holding >= 2, "30 files on {holding} brick(s)");

    // Host 1's daemon dies: its brick keeps serving, and its next daemon adopts it.
    let before = hosts.status(0, "v");
    hosts.kill_daemon(1);
    for n in 0..30 {
        let back = std::fs::read_to_string(mnt.join(format!("f{n}"))).expect("read");
        assert_eq!(back, format!("file {n}"));
    }
    hosts.wait_status(0, "v", |b| b[1].state == "down");
    match hosts.json_of(0, &["cluster", "--json", "status"]) {
        Response::Cluster(cluster) => assert_eq!(cluster.down, [hosts.hosts[1].name()]),
        other => panic!("{other:?}"),
    }
    // A change made meanwhile reaches the orphaned brick once a daemon adopts it.
    let changed = match hosts.json(0, &["set", "v", "network.inflight-max", "32"]) {
        Response::Done { generation, .. } => generation,
        other => panic!("{other:?}"),
    };
    hosts.start_daemon(1);
    hosts.wait_status(0, "v", |b| running(b) && pids(b) == pids(&before));
    assert!(hosts.daemon_log(1).contains("adopted the running brick"));
    hosts.wait_status(0, "v", |b| b[1].generation >= Some(changed));
    // A daemon restarted as an operator does (SIGTERM, start) leaves its brick running.
    hosts.stop_daemon(0);
    assert_eq!(
        std::fs::read_to_string(mnt.join("f0")).expect("read"),
        "file 0"
    );
    hosts.start_daemon(0);
    hosts.wait_status(2, "v", |b| running(b) && pids(b) == pids(&before));
    hosts.umount(0, &mnt);

    // Stopped from host 2: every host stops its brick.
    hosts.kiln_ok(2, &["volume", "stop", "v"]);
    hosts.wait_status(0, "v", |b| b.iter().all(|b| b.pid.is_none()));
}

#[test]
fn acknowledged_changes_survive_a_killed_daemon_and_etcd_member() {
    let Some(mut hosts) = Hosts::start("acknowledged_changes_survive", 2) else {
        return;
    };
    hosts.volume("v");
    hosts.wait_status(0, "v", running);
    let before = pids(&hosts.status(0, "v"));
    const KEYS: [&str; 3] = [
        "network.inflight-max",
        "network.connections-max",
        "features.lease-contention-ms",
    ];
    // (generation, key, value) of every acknowledged set.
    let mut acknowledged: Vec<(u64, &str, String)> = Vec::new();
    let mut seed: u64 = 0x5eed_c0de;
    let mut next = || common::xorshift(&mut seed);
    for round in 0..60 {
        if round == 20 {
            hosts.kill_daemon(2);
            hosts.hosts[1].member.as_mut().expect("member").kill();
        }
        let on = (next() % 3) as usize;
        let key = KEYS[(next() % 3) as usize];
        let value = (1 + next() % 4000).to_string();
        let out = hosts.kiln(on, &["volume", "--json", "set", "v", key, &value]);
        if let Ok(Response::Done { generation, .. }) = serde_json::from_slice(&out.stdout) {
            acknowledged.push((generation, key, value));
        } else {
            // Only the killed daemon may refuse.
            assert!(
                round >= 20 && on == 2,
                "round {round} on host {on}: {out:?}"
            );
        }
    }
    acknowledged.sort();
    let last = |key: &str| -> String {
        let (_, _, value) = acknowledged
            .iter()
            .rev()
            .find(|(_, k, _)| *k == key)
            .expect("a set of every key");
        value.clone()
    };
    for key in KEYS {
        assert_eq!(
            hosts.option_once(0, "v", key, &last(key)),
            last(key),
            "{key} on host 0"
        );
        assert_eq!(
            hosts.option_once(1, "v", key, &last(key)),
            last(key),
            "{key} on host 1"
        );
    }
    // The killed member and daemon come back and agree; no brick was restarted.
    hosts.start_member(1);
    hosts.start_daemon(2);
    for key in KEYS {
        assert_eq!(hosts.option(2, "v", key), last(key), "{key} on host 2");
    }
    hosts.wait_status(2, "v", |b| running(b) && pids(b) == before);
}

#[test]
fn a_partitioned_host_cannot_commit_and_catches_up() {
    let Some(hosts) = Hosts::start("a_partitioned_host_cannot_commit", 3) else {
        return;
    };
    hosts.volume("v");
    hosts.set_link(2, false);
    let refused = hosts.kiln(2, &["volume", "set", "v", "network.inflight-max", "99"]);
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains("etcd"), "{said}");
    hosts.kiln_ok(0, &["volume", "set", "v", "network.inflight-max", "77"]);
    assert_eq!(hosts.option(2, "v", "network.inflight-max"), "256");
    hosts.set_link(2, true);
    let deadline = Instant::now() + Duration::from_secs(30);
    while hosts.option(2, "v", "network.inflight-max") != "77" {
        assert!(Instant::now() < deadline, "host 2 did not catch up");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_rebalance_runs_on_the_elected_daemon_and_continues_when_it_dies() {
    let Some(mut hosts) = Hosts::start("a_rebalance_runs_on_the_elected", 4) else {
        return;
    };
    // A volume on hosts 0 and 1, filled through a mount; then a brick of host 2 added.
    let brick = |i: usize| {
        let path = hosts.dir.path().join(format!("host{i}/r"));
        format!("{}:{}", hosts.hosts[i].name(), path.display())
    };
    hosts.kiln_ok(0, &["volume", "create", "r", &brick(0), &brick(1)]);
    hosts.kiln_ok(0, &["volume", "set", "r", "server.root-allow", "admin"]);
    hosts.kiln_ok(0, &["volume", "start", "r"]);
    hosts.wait_status(0, "r", |b| b.iter().all(|b| b.health == "ok"));
    // One daemon leads; the volume is mounted, and its rebalance asked, through another host
    // (a mount asks its host's daemon for bricks added since it mounted).
    let leader = |hosts: &Hosts, i: usize| match hosts.json_of(i, &["cluster", "--json", "status"])
    {
        Response::Cluster(cluster) => cluster.leader,
        other => panic!("{other:?}"),
    };
    let first_leader = leader(&hosts, 0).expect("a leader");
    let l = hosts
        .hosts
        .iter()
        .position(|h| h.name() == first_leader)
        .expect("the leader is a host");
    let asker = (l + 1) % HOSTS;
    let leaving = brick(asker);
    let mnt = hosts.dir.path().join("mnt-r");
    std::fs::create_dir(&mnt).expect("mountpoint");
    hosts.kiln_ok(asker, &["mount", "r", mnt.to_str().expect("utf-8")]);
    for d in 0..8 {
        std::fs::create_dir(mnt.join(format!("d{d}"))).expect("mkdir");
        for n in 0..40 {
            let path = mnt.join(format!("d{d}/f{n}"));
            std::fs::write(path, format!("file {d}/{n}")).expect("write");
        }
    }
    hosts.kiln_ok(2, &["volume", "add-brick", "r", &brick(2)]);
    hosts.wait_status(0, "r", |b| {
        b.len() == 3 && b.iter().all(|b| b.health == "ok")
    });

    let host = &hosts.hosts[asker];
    let follower = Command::new(bin("kiln"))
        .args(["volume", "--json", "rebalance", "r", "start"])
        .env("KILN_MGMT_SOCKET", &host.socket)
        .env("KILN_TLS_DIR", host.state.join("tls"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kiln volume rebalance start");
    // (No status until the follower has asked.)
    let rebalance = |hosts: &Hosts, i: usize| {
        let out = hosts.kiln(i, &["volume", "--json", "rebalance", "r", "status"]);
        serde_json::from_slice::<kiln_admin::command::RebalanceStatus>(&out.stdout).ok()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let running = loop {
        match rebalance(&hosts, asker) {
            Some(status) if status.state == "running" => break status,
            other => assert!(Instant::now() < deadline, "{other:?}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(running.host.as_deref(), Some(first_leader.as_str()));
    let second = hosts.kiln((asker + 1) % HOSTS, &["volume", "rebalance", "r", "start"]);
    let said = String::from_utf8_lossy(&second.stderr);
    assert!(said.contains("a task of r is running"), "{said}");

    // The leader's daemon dies mid-rebalance (its runner frozen first, so the rebalance
    // cannot end before): the runner, thawed, finds its daemon gone and exits; another daemon
    // is elected and runs the rebalance to the end, never beside the old runner; the follower
    // on the asking host sees it complete.
    let old_runner = i32::try_from(running.pid).expect("a pid");
    common::signal(old_runner, rustix::process::Signal::STOP);
    hosts.kill_daemon(l);
    common::signal(old_runner, rustix::process::Signal::CONT);
    let alive = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            !stat
                .rsplit(')')
                .next()
                .unwrap_or_default()
                .starts_with(" Z")
        })
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = rebalance(&hosts, asker);
        if now
            .as_ref()
            .is_some_and(|s| s.host.as_deref() != Some(first_leader.as_str()))
        {
            assert!(
                !alive(old_runner),
                "a second runner while the first lives: {now:?}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no other host took the rebalance: {now:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut follower = follower;
    let deadline = Instant::now() + Duration::from_secs(90);
    while follower.try_wait().expect("wait").is_none() {
        assert!(Instant::now() < deadline, "the follower did not end");
        std::thread::sleep(Duration::from_millis(100));
    }
    let done = follower.wait_with_output().expect("the follower");
    let said = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.success(), "{said}");
    let done: kiln_admin::command::RebalanceStatus =
        serde_json::from_slice(&done.stdout).expect("JSON status");
    assert_eq!((done.state.as_str(), done.report.failed), ("completed", 0));
    assert_ne!(
        done.host.as_deref(),
        Some(first_leader.as_str()),
        "{done:?}"
    );
    assert_eq!(done.report.files, 320, "{done:?}");
    assert_ne!(
        leader(&hosts, asker).as_deref(),
        Some(first_leader.as_str())
    );
    for d in 0..8 {
        for n in 0..40 {
            let back = std::fs::read_to_string(mnt.join(format!("d{d}/f{n}"))).expect("read");
            assert_eq!(back, format!("file {d}/{n}"));
        }
    }
    let on_new = walkdir_files(&hosts.dir.path().join("host2/r"));
    assert!(on_new > 0, "no file moved to the new brick");
    // A heal asked of any host runs on the leader too.
    let healed = hosts.kiln_ok(asker, &["volume", "--json", "heal", "r"]);
    let healed: kiln_admin::command::RebalanceStatus =
        serde_json::from_str(&healed).expect("JSON status");
    assert_eq!(healed.kind, kiln_admin::command::TaskKind::FixLayout);
    assert_eq!(
        (healed.state.as_str(), healed.report.dirs),
        ("completed", 9)
    );
    assert_eq!(healed.host, leader(&hosts, asker), "{healed:?}");
    // The asking host's brick removed: its files move off it (on the leader), then it
    // stops, and every file still reads through the mount.
    let remove = |action| ["volume", "--json", "remove-brick", "r", &leaving, action];
    let drained = hosts.kiln_ok(asker, &remove("start"));
    let drained: kiln_admin::command::RebalanceStatus =
        serde_json::from_str(&drained).expect("JSON status");
    assert_eq!(
        (drained.state.as_str(), drained.report.left_on_leaving),
        ("completed", 0),
        "{drained:?}"
    );
    assert_eq!(drained.leaving, [asker]);
    hosts.kiln_ok(asker, &remove("commit"));
    hosts.wait_status(asker, "r", |b| {
        b[asker].state == "removed" && b[asker].pid.is_none()
    });
    let left = walkdir_files(&hosts.dir.path().join(format!("host{asker}/r")));
    assert_eq!(left, 0, "files left on the removed brick");
    for d in 0..8 {
        for n in 0..40 {
            let back = std::fs::read_to_string(mnt.join(format!("d{d}/f{n}"))).expect("read");
            assert_eq!(back, format!("file {d}/{n}"));
        }
    }
    hosts.umount(asker, &mnt);
    // (`ip netns exec` runs the command in a mount namespace of its own.)
    let _ = Command::new("umount").arg("-l").arg(&mnt).status();
}

/// Regular files under `dir`, `.glusterfs` left out.
fn walkdir_files(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter(|e| e.file_name() != ".glusterfs")
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => walkdir_files(&e.path()),
            Ok(t) if t.is_file() => 1,
            _ => 0,
        })
        .sum()
}

/// Runs `daemon`, which must exit with an error within 30 s; what it said.
/// A volume of four bricks, two on each of two hosts, mounted outside both: pjdfstest, fsx
/// and real programs (tar, cp, git, rm) see one POSIX file system, its files on every brick.
#[test]
fn four_bricks_on_two_hosts_pass_the_mount_suites() {
    let Some(hosts) = Hosts::start("four_bricks_on_two_hosts", 5) else {
        return;
    };
    let bricks: Vec<PathBuf> = (0..4)
        .map(|i| hosts.dir.path().join(format!("host{}/w{i}", i / 2)))
        .collect();
    let specs: Vec<String> = (0..4)
        .map(|i| format!("{}:{}", hosts.hosts[i / 2].name(), bricks[i].display()))
        .collect();
    let mut create = vec!["volume", "create", "w"];
    create.extend(specs.iter().map(String::as_str));
    hosts.kiln_ok(0, &create);
    hosts.kiln_ok(1, &["volume", "set", "w", "server.root-allow", "admin"]);
    hosts.kiln_ok(1, &["volume", "start", "w"]);
    hosts.wait_status(2, "w", running);
    let mnt = hosts.dir.path().join("mnt");
    std::fs::create_dir(&mnt).expect("mountpoint");
    hosts.kiln_ok(2, &["mount", "w", mnt.to_str().expect("utf-8")]);

    mount_common::pjdfstest_passes_in(&mnt.join("pjd"));
    mount_common::fsx_passes(&mnt.join("fsx.dat"), 3000, 5);
    let tarball = hosts.dir.path().join("src.tar");
    let script = format!(
        "mkdir src && for d in $(seq 1 8); do mkdir src/d$d; \
         for f in $(seq 1 40); do echo \"$d/$f\" > src/d$d/f$f; done; done && \
         ln -s d1/f1 src/link && ln src/d2/f2 src/d3/hard && \
         tar -cf {tar} -C src . && mkdir untar && tar -xf {tar} -C untar && \
         diff -r src untar && cp -a src copy && diff -r src copy && \
         git init -q repo && cp -a src/. repo/ && cd repo && git add -A && \
         git -c user.name=k -c user.email=k@k commit -qm one && git mv d1 d9 && \
         git -c user.name=k -c user.email=k@k commit -qm two && git fsck --strict --no-progress > /dev/null && \
         git log --oneline | wc -l",
        tar = tarball.display()
    );
    assert_eq!(mount_common::sh_ok(&mnt, &script), "2\n");
    let files_on = |brick: &PathBuf| {
        (1..=8)
            .map(|d| std::fs::read_dir(brick.join(format!("src/d{d}"))).map_or(0, Iterator::count))
            .sum::<usize>()
    };
    let spread: Vec<usize> = bricks.iter().map(files_on).collect();
    assert!(spread.iter().all(|&n| n > 0), "files per brick: {spread:?}");
    let cleaned = mount_common::sh_ok(
        &mnt,
        "rm -rf src untar copy repo pjd fsx.dat && ls -A | wc -l",
    );
    assert_eq!(cleaned, "0\n");
    for brick in &bricks {
        assert!(
            std::fs::read_dir(brick)
                .expect("brick")
                .filter_map(Result::ok)
                .all(|e| e.file_name() == ".glusterfs"),
            "{} keeps entries after rm -rf",
            brick.display()
        );
    }
    hosts.umount(2, &mnt);
    // (`ip netns exec` runs the command in a mount namespace of its own.)
    let _ = Command::new("umount").arg("-l").arg(&mnt).status();
}

fn refused(mut daemon: Command) -> String {
    let mut child = daemon.spawn().expect("kiln-mgmtd");
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!("kiln-mgmtd started, or hung, instead of refusing");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("output");
    assert!(!out.status.success(), "kiln-mgmtd exited 0");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_daemon_without_the_clusters_ca_refuses_to_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(server) =
        EtcdServer::single_for_test("a_daemon_without_the_clusters_ca", &dir.path().join("etcd"))
    else {
        return;
    };
    let daemon = |name: &str| {
        let state = dir.path().join(name);
        let socket = dir.path().join(format!("{name}-run/mgmtd.sock"));
        let mut command = loopback_daemon(&state, &socket, "ca", &server.member.client_url());
        command.stderr(Stdio::piped());
        (command, state)
    };
    // The first daemon makes the cluster's CA and records it. Its log goes to a file: a
    // pipe nobody reads would stop it once full.
    let (mut first, first_state) = daemon("first");
    let first_log = dir.path().join("first.log");
    first.stderr(std::fs::File::create(&first_log).expect("log"));
    let mut first = first.spawn().expect("kiln-mgmtd");
    wait_while_running(&mut first, &first_log, "making a CA", &|| {
        first_state.join("tls/ca.crt").exists()
    });
    // One with no CA, and one with a CA of its own, are refused with what to do.
    let (bare, _) = daemon("bare");
    let said = refused(bare);
    assert!(said.contains("no copy of cluster ca's CA"), "{said}");
    let (stranger, stranger_state) = daemon("stranger");
    kiln_admin::pki::init_ca(&stranger_state.join("tls")).expect("a CA of its own");
    let said = refused(stranger);
    assert!(said.contains("is not cluster ca's"), "{said}");
    let _ = first.kill();
    let _ = first.wait();
}

/// A daemon started before its etcd (as an init system may start them) says it waits, and
/// starts once etcd answers.
#[test]
fn a_daemon_started_before_its_etcd_waits_for_it() {
    let Some(etcd) = etcd_for_test("a_daemon_started_before_its_etcd") else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let member = Member::single().expect("free ports");
    let (state, socket) = (dir.path().join("state"), dir.path().join("run/mgmtd.sock"));
    let log = dir.path().join("daemon.log");
    let mut daemon = loopback_daemon(&state, &socket, "late", &member.client_url())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("kiln-mgmtd");
    let said = || std::fs::read_to_string(&log).unwrap_or_default();
    wait_while_running(&mut daemon, &log, "saying it waits", &|| {
        said().contains("etcd does not answer yet")
    });
    let data = dir.path().join("etcd");
    let _server = EtcdServer::start_single(&etcd, &member, &data).expect("etcd");
    let answers = || {
        kiln_of(&socket, &state, &["cluster", "status"])
            .status
            .success()
    };
    wait_while_running(&mut daemon, &log, "answering", &answers);
    let _ = daemon.kill();
    let _ = daemon.wait();
}

/// `kiln-mgmtd` for host 127.0.0.1 of cluster `cluster` on the etcd at `etcd_url`, its state
/// in `state` and its socket at `socket`; its stdout dropped.
fn loopback_daemon(state: &Path, socket: &Path, cluster: &str, etcd_url: &str) -> Command {
    let mut command = Command::new(bin("kiln-mgmtd"));
    command
        .arg("--state-dir")
        .arg(state)
        .arg("--socket")
        .arg(socket)
        .args(["--host", "127.0.0.1", "--cluster", cluster])
        .args(["--etcd", etcd_url])
        .stdout(Stdio::null());
    command
}

/// Waits (30 s at most) until `done`, failing with `daemon`'s log at `log` if it exits
/// first or the time runs out.
fn wait_while_running(daemon: &mut Child, log: &Path, what: &str, done: &dyn Fn() -> bool) {
    let said = || std::fs::read_to_string(log).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        if let Ok(Some(status)) = daemon.try_wait() {
            panic!("the daemon exited ({status}) before {what}:\n{}", said());
        }
        assert!(Instant::now() < deadline, "not {what}:\n{}", said());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A host of a cluster on the loopback etcd `url`: its state directory and socket.
struct LoopbackHost {
    state: PathBuf,
    socket: PathBuf,
    ip: &'static str,
    daemon: Option<Child>,
}

impl LoopbackHost {
    fn new(dir: &Path, ip: &'static str) -> LoopbackHost {
        LoopbackHost {
            state: dir.join(ip),
            socket: dir.join(format!("{ip}-run/mgmtd.sock")),
            ip,
            daemon: None,
        }
    }

    fn kiln(&self, args: &[&str]) -> Output {
        kiln_of(&self.socket, &self.state, args)
    }

    fn kiln_ok(&self, args: &[&str]) -> String {
        let out = self.kiln(args);
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "kiln {args:?} on {}: {said}", self.ip);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// What `kiln ARGS` said when it failed, as it must.
    fn kiln_refused(&self, args: &[&str]) -> String {
        let out = self.kiln(args);
        assert!(
            !out.status.success(),
            "kiln {args:?} on {} succeeded",
            self.ip
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    }

    fn start_daemon(&mut self) {
        let daemon = Command::new(bin("kiln-mgmtd"))
            .arg("--state-dir")
            .arg(&self.state)
            .arg("--socket")
            .arg(&self.socket)
            .args(["--listen-ip", self.ip])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.state.with_extension("log")).expect("log"))
            .spawn()
            .expect("kiln-mgmtd");
        self.daemon = Some(daemon);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.kiln(&["cluster", "status"]).status.success() {
            assert!(
                Instant::now() < deadline,
                "kiln-mgmtd on {} did not start: {}",
                self.ip,
                std::fs::read_to_string(self.state.with_extension("log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill_daemon(&mut self) {
        if let Some(mut daemon) = self.daemon.take() {
            let _ = daemon.kill();
            let _ = daemon.wait();
        }
    }

    /// The port of the first brick of `volume`, once it answers (bounded wait).
    fn healthy_port(&self, volume: &str) -> u16 {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let status = match serde_json::from_str(
                &self.kiln_ok(&["volume", "--json", "status", volume]),
            ) {
                Ok(Response::Status { bricks }) => bricks,
                other => panic!("{other:?}"),
            };
            if status[0].health == "ok" {
                return status[0].port;
            }
            assert!(Instant::now() < deadline, "{status:#?}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn cluster(&self) -> kiln_admin::command::ClusterStatus {
        match serde_json::from_str(&self.kiln_ok(&["cluster", "--json", "status"])) {
            Ok(Response::Cluster(cluster)) => cluster,
            other => panic!("{other:?}"),
        }
    }

    /// Waits until `ok` holds for this host's view of the cluster.
    fn wait_cluster(&self, ok: impl Fn(&kiln_admin::command::ClusterStatus) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let cluster = self.cluster();
            if ok(&cluster) {
                return;
            }
            assert!(Instant::now() < deadline, "{} sees {cluster:#?}", self.ip);
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for LoopbackHost {
    fn drop(&mut self) {
        self.kill_daemon();
    }
}

fn reports(cluster: &kiln_admin::command::ClusterStatus, host: &str) -> bool {
    cluster.hosts.iter().any(|h| h.host == host)
}

#[test]
fn a_host_joins_once_with_a_token_serves_bricks_and_leaves() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(server) =
        EtcdServer::single_for_test("a_host_joins_once_with_a_token", &dir.path().join("etcd"))
    else {
        return;
    };
    let url = server.member.client_url();
    let mut first = LoopbackHost::new(dir.path(), "127.0.0.1");
    let mut second = LoopbackHost::new(dir.path(), "127.0.0.2");
    let third = LoopbackHost::new(dir.path(), "127.0.0.3");
    first.kiln_ok(&[
        "cluster",
        "init",
        "--etcd",
        &url,
        "--host",
        first.ip,
        "--cluster",
        "j",
    ]);
    first.start_daemon();
    let said = first.kiln_refused(&["cluster", "init", "--etcd", &url, "--host", "x"]);
    assert!(said.contains("member of cluster j already"), "{said}");

    // Tokens that are not the cluster's: malformed, made up, or of another cluster.
    let join = |host: &LoopbackHost, token: &str| {
        host.kiln(&["cluster", "join", &url, "--host", host.ip, "--token", token])
    };
    let said = String::from_utf8_lossy(&join(&second, "kiln1-j-12").stderr).into_owned();
    assert!(said.contains("not a join token"), "{said}");
    let made_up = format!("kiln1-j-{}-99999999999-{}", "0".repeat(16), "0".repeat(64));
    let said = String::from_utf8_lossy(&join(&second, &made_up).stderr).into_owned();
    assert!(said.contains("refused") && said.contains("seal"), "{said}");
    assert!(!second.state.join("cluster.json").exists());

    // A real token joins one host, once.
    let token = first.kiln_ok(&["cluster", "token", "--valid-secs", "600"]);
    let token = token.trim();
    let joined = join(&second, token);
    assert!(
        joined.status.success(),
        "{}",
        String::from_utf8_lossy(&joined.stderr)
    );
    let tls = second.state.join("tls");
    assert!(!tls.join("ca.key").exists(), "the CA's key was copied");
    let brick = kiln_admin::pki::Role::Brick {
        hosts: vec![second.ip.into(), "localhost".into()],
    };
    assert!(kiln_admin::pki::is_current(
        &tls,
        &brick,
        kiln_admin::pki::HOST_IDENTITY
    ));
    let client = kiln_admin::pki::Role::Client;
    assert!(kiln_admin::pki::is_current(
        &tls,
        &client,
        kiln_admin::pki::ADMIN_CLIENT
    ));
    let said = String::from_utf8_lossy(&join(&third, token).stderr).into_owned();
    assert!(said.contains("used already"), "{said}");
    assert!(!third.state.join("cluster.json").exists());
    assert!(!third.state.join("tls/brick-host.crt").exists());
    let short = first.kiln_ok(&["cluster", "token", "--valid-secs", "1"]);
    std::thread::sleep(Duration::from_millis(2100));
    let said = String::from_utf8_lossy(&join(&third, short.trim()).stderr).into_owned();
    assert!(said.contains("expired"), "{said}");

    // The joined host serves a brick with its host certificate; its admin reaches it.
    second.start_daemon();
    first.wait_cluster(|c| reports(c, second.ip));
    // A member's name is not given to another host.
    let token = first.kiln_ok(&["cluster", "token"]);
    let out = third.kiln(&[
        "cluster",
        "join",
        &url,
        "--host",
        second.ip,
        "--token",
        token.trim(),
    ]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("host 127.0.0.2 is a member already"),
        "{said}"
    );
    let brick_dir = dir.path().join("bricks/v");
    let spec = format!("{}:{}", second.ip, brick_dir.display());
    first.kiln_ok(&["volume", "create", "v", &spec]);
    first.kiln_ok(&["volume", "start", "v"]);
    let port = first.healthy_port("v");
    let addr = format!("{}:{port}", second.ip);
    let listed = second.kiln_ok(&["--brick-addr", &addr, "ls", "/"]);
    assert!(listed.is_empty(), "{listed}");
    let said = second.kiln_refused(&["cluster", "leave"]);
    assert!(
        said.contains("bricks of this host are in volumes (v-b0)"),
        "{said}"
    );
    first.kiln_ok(&["volume", "stop", "v"]);
    first.kiln_ok(&["volume", "delete", "v"]);

    // A volume of the first host, which the second reaches until it leaves.
    let kept = format!("{}:{}", first.ip, dir.path().join("bricks/u").display());
    first.kiln_ok(&["volume", "create", "u", &kept]);
    first.kiln_ok(&["volume", "start", "u"]);
    let port = first.healthy_port("u");
    let kept_addr = format!("{}:{port}", first.ip);
    second.kiln_ok(&["--brick-addr", &kept_addr, "ls", "/"]);

    // A member whose daemon dies shows as down; it leaves once back.
    second.kill_daemon();
    first.wait_cluster(|c| c.down == [second.ip]);
    second.start_daemon();
    first.wait_cluster(|c| reports(c, second.ip) && c.down.is_empty());
    let said = second.kiln_ok(&["cluster", "leave"]);
    assert!(said.contains("left cluster j"), "{said}");
    // (Left in its guard until it has exited: a failed wait kills it on drop.)
    let deadline = Instant::now() + Duration::from_secs(30);
    let daemon = second.daemon.as_mut().expect("a daemon");
    while daemon.try_wait().expect("wait").is_none() {
        assert!(
            Instant::now() < deadline,
            "the daemon did not stop after leaving"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!second.state.join("cluster.json").exists());
    first.wait_cluster(|c| !reports(c, second.ip) && c.down.is_empty());
    // Its certificate is refused by the volumes there were, and by those made since.
    let said = second.kiln_refused(&["--brick-addr", &kept_addr, "ls", "/"]);
    assert!(said.contains("revoked"), "{said}");
    let cert = kiln_admin::pki::identity_files(
        &second.state.join("tls"),
        &kiln_admin::pki::Role::Client,
        kiln_admin::pki::ADMIN_CLIENT,
    )
    .cert;
    let serial = kiln_admin::pki::serial_of(&cert).expect("the second host's serial");
    first.kiln_ok(&[
        "volume",
        "create",
        "w",
        &format!("{}:{}", first.ip, dir.path().join("bricks/w").display()),
    ]);
    let revoked = first.kiln_ok(&["volume", "get", "w", "auth.revoked"]);
    assert!(revoked.contains(&serial), "{revoked}");
    // (Bricks outlive their daemon.)
    first.kiln_ok(&["volume", "stop", "u"]);
}
