//! `kiln_client::distribute` checked against real GlusterFS: a three-brick distributed
//! volume, files with varied names (rsync temporary names, UTF-8, invalid UTF-8, long)
//! created through two FUSE mounts — one client in the C.UTF-8 locale, one in the C locale,
//! which GlusterFS's rsync rewrite tells apart — and every file found on the brick that the
//! layouts read back from the bricks' `trusted.glusterfs.dht` and Kiln's hash say it
//! belongs on. The layouts themselves must be the ones `Layout::new_directory` builds.
//!
//! Needs root and Debian's `glusterfs-server` (`glusterd`, `gluster`, `glusterfs`,
//! `mount.glusterfs`). Without them the test says why and passes — or fails, when
//! `KILN_REQUIRE_GLUSTERFS=1`. It starts `glusterd -N` if none runs (and stops it after),
//! uses one that runs (and leaves it running), and always stops and deletes its volume,
//! unmounts and removes its directories (a guard's `Drop`). Every command is bounded.

use std::ffi::OsStr;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use kiln_client::distribute::{
    COMMIT_HASH_INVALID, DiskLayout, Layout, Munging, XATTR_NAME, first_brick, name_hash,
    size_chunks, weights_for,
};
use rustix::process::{Pid, Signal};

/// Longest `gluster` CLI command (its own `--timeout` is a little shorter).
const GLUSTER_TIMEOUT: Duration = Duration::from_secs(40);
const GLUSTER_CLI_TIMEOUT_S: u64 = 30;
/// How long glusterd may take to answer, and the bricks to come online.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest mount or unmount.
const MOUNT_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest time to create every file through a mount.
const CREATE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a process may take to go after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);
const POLL_INTERVAL: Duration = Duration::from_millis(100);
/// Bricks in the volume.
const BRICKS: usize = 3;
/// The xattr GlusterFS puts on a link file: the entry on the hashed brick that points to
/// the brick holding the data (when the hashed brick was too full to take it).
const LINKTO_XATTR: &str = "trusted.glusterfs.dht.linkto";
/// Seed of the generated names (fixed: a failure replays).
const NAMES_SEED: u64 = 0x6b69_6c6e_6468_7431;

#[test]
fn files_land_on_the_bricks_kiln_predicts() -> anyhow::Result<()> {
    if let Some(why) = cannot_run_glusterfs() {
        if std::env::var("KILN_REQUIRE_GLUSTERFS").as_deref() == Ok("1") {
            bail!(
                "KILN_REQUIRE_GLUSTERFS=1, but GlusterFS cannot run here: {why} \
                 (install Debian's glusterfs-server and run the test as root)"
            );
        }
        eprintln!("skipped: glusterfs-server not installed or not usable ({why})");
        return Ok(());
    }
    let mut gluster = Gluster::set_up()?;
    let utf8 = gluster.mount("C.UTF-8")?;
    let c = gluster.mount("C")?;

    let (utf8_names, c_names) = names();
    create(&utf8, &utf8_names)?;
    create(&c, &c_names)?;
    std::fs::create_dir(utf8.join("sub")).context("mkdir sub")?;
    let sub_names: Vec<Vec<u8>> = utf8_names.iter().step_by(3).cloned().collect();
    create(&utf8.join("sub"), &sub_names)?;

    let root = gluster.layout("", b"/", COMMIT_HASH_INVALID)?;
    let sub = gluster.layout("sub", b"/sub", 0)?;
    let mut checked = 0;
    for (dir, layout, names, munging) in [
        ("", &root, &utf8_names, Munging::RsyncUtf8),
        ("", &root, &c_names, Munging::RsyncBytes),
        ("sub", &sub, &sub_names, Munging::RsyncUtf8),
    ] {
        checked += gluster.check_placement(dir, layout, names, munging)?;
    }
    eprintln!(
        "checked {checked} files on {} (root {:?}, sub {:?})",
        gluster.volume,
        ranges(&root),
        ranges(&sub)
    );
    gluster.tear_down()
}

/// Why GlusterFS cannot run here, if it cannot.
fn cannot_run_glusterfs() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("not root: mounting and trusted.* xattrs need it".into());
    }
    ["glusterd", "gluster", "glusterfs", "mount.glusterfs"]
        .into_iter()
        .find(|program| which(program).is_none())
        .map(|program| format!("{program} not found"))
}

/// A program on PATH, or in the sbin directories a non-login root shell may lack.
fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

/// The names created through each mount: (C.UTF-8 client, C client). About 200 for the
/// first, every kind of name DHT treats specially; a few with invalid UTF-8 for the second.
fn names() -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let mut utf8: Vec<Vec<u8>> = Vec::new();
    let mut rng = NAMES_SEED;
    let mut next = move || {
        // xorshift64: deterministic, no dependency.
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let ascii = b"abcdefghijklmnopqrstuvwxyz0123456789_-";
    for len in (1..=40).chain([47, 48, 49, 63, 64, 65, 128, 200, 255]) {
        utf8.push(
            (0..len)
                .map(|_| ascii[next() as usize % ascii.len()])
                .collect(),
        );
    }
    for base in [
        "foo",
        "report.pdf",
        "archive.tar.gz",
        "日本語.txt",
        "x",
        "é",
    ] {
        for suffix in ["x1y2", "AbCdEf", "Q", "000000"] {
            utf8.push(format!(".{base}.{suffix}").into_bytes());
        }
    }
    let fixed: [&[u8]; 30] = [
        b".bashrc",
        b"..x",
        b"...x",
        b".a.",
        b".a.b.",
        b".x.y.z",
        b".git",
        b".config.old",
        b".new\nline.tmp",
        "café".as_bytes(),
        "naïve.txt".as_bytes(),
        "日本語".as_bytes(),
        "Ελληνικά".as_bytes(),
        "emoji😀".as_bytes(),
        "中文文件名称测试".as_bytes(),
        "ångström.dat".as_bytes(),
        b"README.md",
        b"hello world",
        b"\xff",
        b"ab\x80",
        b"ok\xe9",
        b"qqqq\xc3",
        b".\xff.x",
        b".a\xff.b",
        b".a.\xfe",
        b".zz.\xc3",
        b".\xc0\xaf.x",
        b".\xed\xa0\x80.x",
        b".\xf4\x90\x80\x80.x",
        b".euro\xe2\x82\xac.\xe2\x82\xac",
    ];
    utf8.extend(fixed.iter().map(|n| n.to_vec()));
    utf8.push("é".repeat(127).into_bytes());
    utf8.push("日".repeat(85).into_bytes());
    utf8.push(format!(".{}.tmp", "d".repeat(200)).into_bytes());
    let alphabet: Vec<char> = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789._-éü日"
        .chars()
        .collect();
    while utf8.len() < 200 {
        let len = 1 + next() as usize % 40;
        let name: String = (0..len)
            .map(|_| alphabet[next() as usize % alphabet.len()])
            .collect();
        utf8.push(name.into_bytes());
    }
    let c: Vec<Vec<u8>> = [
        &b".\xff.y"[..],
        b".a.\xfd",
        b".a\xfe.c",
        b".c\xfc\xfb.d",
        b".\xf8\x87\x80\x80\x80.q",
        b".\xed\xa0\x80.z",
        b".plain.c1",
        b".plain.c2",
        b"\xfe\xfd\xfc",
    ]
    .iter()
    .map(|n| n.to_vec())
    .collect();
    utf8.retain(|n| n != b"." && n != b".." && !c.contains(n));
    utf8.sort();
    utf8.dedup();
    (utf8, c)
}

/// Creates a one-byte file per name in `dir`, bounded: a stuck FUSE call fails the test
/// instead of hanging it.
fn create(dir: &Path, names: &[Vec<u8>]) -> anyhow::Result<()> {
    let (dir, names) = (dir.to_owned(), names.to_vec());
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || {
        let result = names.iter().try_for_each(|name| {
            let path = dir.join(OsStr::from_bytes(name));
            std::fs::write(&path, b"x").with_context(|| format!("create {}", path.display()))
        });
        let _ = done.send(result);
    });
    finished
        .recv_timeout(CREATE_TIMEOUT)
        .context("creating files through the mount did not finish in time")?
}

fn ranges(layout: &Layout) -> Vec<String> {
    (0..layout.brick_count())
        .map(|b| match layout.range(b) {
            Some(r) => format!("{:08x}-{:08x}", r.start(), r.stop()),
            None => "none".into(),
        })
        .collect()
}

/// The volume this test set up, and the glusterd serving it.
struct Gluster {
    volume: String,
    host: String,
    bricks: Vec<PathBuf>,
    logs: PathBuf,
    /// glusterd, when this test started it.
    glusterd: Option<Child>,
    created: bool,
    started: bool,
    brick_pids: Vec<Pid>,
    mounts: Vec<PathBuf>,
    commands: usize,
    torn_down: bool,
    /// Bricks, mount points and logs; removed last, after the teardown.
    dir: tempfile::TempDir,
}

impl Gluster {
    fn set_up() -> anyhow::Result<Gluster> {
        let dir = tempfile::tempdir()?;
        let logs = dir.path().join("logs");
        std::fs::create_dir(&logs)?;
        let bricks: Vec<PathBuf> = (0..BRICKS)
            .map(|i| dir.path().join(format!("brick{i}")))
            .collect();
        for brick in &bricks {
            std::fs::create_dir(brick)?;
        }
        let mut g = Gluster {
            volume: format!("kilndht{}", std::process::id()),
            host: String::new(),
            bricks,
            logs,
            glusterd: None,
            created: false,
            started: false,
            brick_pids: Vec::new(),
            mounts: Vec::new(),
            commands: 0,
            torn_down: false,
            dir,
        };
        if !process_named("glusterd") {
            let log = g.logs.join("glusterd.log");
            let glusterd = Command::new(which("glusterd").context("glusterd")?)
                .arg("-N")
                .arg(format!("--log-file={}", log.display()))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("start glusterd -N")?;
            g.glusterd = Some(glusterd);
        }
        g.wait_for_glusterd()?;
        g.create_volume()?;
        g.start_volume()?;
        Ok(g)
    }

    /// Runs `cmd` (bounded), its output going to a log file; that output, or an error with it.
    fn run(&mut self, cmd: &mut Command, timeout: Duration) -> anyhow::Result<String> {
        self.commands += 1;
        let log_path = self.logs.join(format!("command-{:03}.log", self.commands));
        let shown = format!("{cmd:?}");
        let log = std::fs::File::create(&log_path)?;
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let mut child = cmd.spawn().with_context(|| format!("cannot run {shown}"))?;
        let status = wait_bounded(&mut child, timeout);
        let mut output = String::new();
        std::fs::File::open(&log_path)?.read_to_string(&mut output)?;
        match status {
            Some(status) if status.success() => Ok(output),
            Some(status) => bail!("{shown} failed ({status}): {}", output.trim()),
            None => bail!(
                "{shown} did not finish within {timeout:?}: {}",
                output.trim()
            ),
        }
    }

    fn gluster(&mut self, args: &[&str]) -> anyhow::Result<String> {
        let mut cmd = Command::new(which("gluster").context("gluster")?);
        cmd.arg("--mode=script")
            .arg(format!("--timeout={GLUSTER_CLI_TIMEOUT_S}"))
            .args(args)
            .env("LC_ALL", "C");
        self.run(&mut cmd, GLUSTER_TIMEOUT)
    }

    fn wait_for_glusterd(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let Err(last) = self.gluster(&["pool", "list"]) else {
                return Ok(());
            };
            if let Some(status) = self
                .glusterd
                .as_mut()
                .and_then(|d| d.try_wait().ok().flatten())
            {
                bail!("glusterd -N exited ({status}) before answering: {last:#}");
            }
            ensure!(
                Instant::now() < deadline,
                "glusterd did not answer within {READY_TIMEOUT:?}: {last:#}"
            );
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// Creates the volume on the first name of this host glusterd takes for a brick (it
    /// refuses 127.0.0.1 and localhost).
    fn create_volume(&mut self) -> anyhow::Result<()> {
        let mut refused = Vec::new();
        for host in self.host_candidates() {
            let volume = self.volume.clone();
            let bricks: Vec<String> = self
                .bricks
                .iter()
                .map(|b| format!("{host}:{}", b.display()))
                .collect();
            let mut args = vec!["volume", "create", &volume];
            args.extend(bricks.iter().map(String::as_str));
            args.push("force");
            match self.gluster(&args) {
                Ok(_) => {
                    self.host = host;
                    self.created = true;
                    return Ok(());
                }
                Err(e) => refused.push(format!("{host}: {e:#}")),
            }
        }
        bail!(
            "glusterd created the volume on no name of this host:\n{}",
            refused.join("\n")
        )
    }

    /// This host's names for a brick: its host name, then the addresses `hostname -I` lists.
    fn host_candidates(&mut self) -> Vec<String> {
        let mut hosts = vec![
            rustix::system::uname()
                .nodename()
                .to_string_lossy()
                .into_owned(),
        ];
        if let Ok(addresses) = self.run(Command::new("hostname").arg("-I"), GLUSTER_TIMEOUT) {
            hosts.extend(addresses.split_whitespace().map(str::to_owned));
        }
        hosts.retain(|h| !h.is_empty());
        hosts.dedup();
        hosts
    }

    /// Starts the volume and waits (bounded) until all its bricks are online.
    fn start_volume(&mut self) -> anyhow::Result<()> {
        let volume = self.volume.clone();
        self.gluster(&["volume", "start", &volume])?;
        self.started = true;
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let status = self.gluster(&["volume", "status", &volume, "--xml"])?;
            let online = online_brick_pids(&status);
            if online.len() == BRICKS {
                self.brick_pids = online;
                return Ok(());
            }
            ensure!(
                Instant::now() < deadline,
                "{} of {BRICKS} bricks online after {READY_TIMEOUT:?}:\n{status}",
                online.len()
            );
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// Mounts the volume with its FUSE client in `locale` (which glibc must have: in another
    /// one the client would match the rsync regex differently); the mount point.
    fn mount(&mut self, locale: &str) -> anyhow::Result<PathBuf> {
        let normal = |l: &str| l.to_ascii_lowercase().replace('-', "");
        let known = self.run(Command::new("locale").arg("-a"), MOUNT_TIMEOUT)?;
        ensure!(
            known.lines().any(|l| normal(l) == normal(locale)),
            "locale {locale} is not available (`locale -a`): the test needs it for the client"
        );
        let point = self.dir.path().join(format!("mount-{locale}"));
        std::fs::create_dir(&point)?;
        let log = self.logs.join(format!("mount-{locale}.log"));
        let mut cmd = Command::new(which("mount").context("mount")?);
        cmd.args(["-t", "glusterfs", "-o"])
            .arg(format!("log-file={}", log.display()))
            .arg(format!("{}:/{}", self.host, self.volume))
            .arg(&point)
            .env("LC_ALL", locale);
        self.run(&mut cmd, MOUNT_TIMEOUT)?;
        self.mounts.push(point.clone());
        Ok(point)
    }

    /// The layout of `dir` (relative to the volume root; `path` is its path from the root)
    /// as the bricks store it, checked against the one Kiln builds for a new directory.
    fn layout(&self, dir: &str, path: &[u8], commit_hash: u32) -> anyhow::Result<Layout> {
        let mut disk = Vec::new();
        for brick in &self.bricks {
            let at = brick.join(dir);
            let mut value = [0u8; 64];
            let len = rustix::fs::getxattr(&at, XATTR_NAME, &mut value[..])
                .with_context(|| format!("getxattr {XATTR_NAME} on {}", at.display()))?;
            disk.push(Some(DiskLayout::decode(&value[..len])?));
        }
        let layout = Layout::from_disk(&disk)?;
        layout.check()?;
        // GlusterFS weighs by size (`cluster.weighted-rebalance` on) when it knows the bricks'
        // sizes by then, else equally; the bricks share one file system, but the float
        // arithmetic of a weighted share can differ from an equal one by a hash.
        let stat = rustix::fs::statvfs(&self.bricks[0])?;
        let size = size_chunks(stat.f_blocks, stat.f_bsize);
        let first = first_brick(path, BRICKS)?;
        let candidates = [
            weights_for(&[Some(size); BRICKS], true),
            weights_for(&[Some(size); BRICKS], false),
        ];
        let built: Vec<Layout> = candidates
            .iter()
            .map(|weights| Layout::new_directory(weights, first, commit_hash))
            .collect::<Result<_, _>>()?;
        ensure!(
            built.contains(&layout),
            "GlusterFS laid {} out as {:?}, Kiln as {:?}",
            path.escape_ascii(),
            ranges(&layout),
            ranges(&built[0])
        );
        Ok(layout)
    }

    /// Checks that each of `names` in `dir` is on the brick `layout` hashes it to; how many
    /// it checked.
    fn check_placement(
        &self,
        dir: &str,
        layout: &Layout,
        names: &[Vec<u8>],
        munging: Munging,
    ) -> anyhow::Result<usize> {
        let mut wrong = Vec::new();
        for name in names {
            let found = self.hashed_brick_on_disk(dir, name)?;
            let predicted = layout.hashed_brick(name, munging);
            if found != predicted {
                wrong.push(format!(
                    "{} (hash {:08x}, {munging:?}): on brick {found:?}, Kiln says {predicted:?}",
                    name.escape_ascii(),
                    name_hash(name, munging),
                ));
            }
        }
        ensure!(
            wrong.is_empty(),
            "{} of {} names in /{dir} are not where Kiln predicts (layout {:?}):\n{}",
            wrong.len(),
            names.len(),
            ranges(layout),
            wrong.join("\n")
        );
        Ok(names.len())
    }

    /// The brick GlusterFS hashed `name` in `dir` to: the one with a link file for it, else
    /// the one brick that holds it.
    fn hashed_brick_on_disk(&self, dir: &str, name: &[u8]) -> anyhow::Result<Option<usize>> {
        let mut holders = Vec::new();
        for (b, brick) in self.bricks.iter().enumerate() {
            let path = brick.join(dir).join(OsStr::from_bytes(name));
            if std::fs::symlink_metadata(&path).is_err() {
                continue;
            }
            if rustix::fs::lgetxattr(&path, LINKTO_XATTR, &mut [0u8; 256][..]).is_ok() {
                return Ok(Some(b));
            }
            holders.push(b);
        }
        ensure!(
            holders.len() <= 1,
            "{} is on bricks {holders:?}",
            name.escape_ascii()
        );
        Ok(holders.first().copied())
    }

    /// Unmounts, stops and deletes the volume, and stops what this test started; every step
    /// runs even if one before it failed, and the first failure is returned.
    fn tear_down(&mut self) -> anyhow::Result<()> {
        self.torn_down = true;
        let mut failures = Vec::new();
        let mounts = std::mem::take(&mut self.mounts);
        for point in mounts.iter().rev() {
            let mut umount = Command::new("umount");
            if let Err(e) = self.run(umount.arg(point), MOUNT_TIMEOUT) {
                failures.push(format!("{e:#}"));
                let mut lazy = Command::new("umount");
                let _ = self.run(lazy.arg("-l").arg(point), MOUNT_TIMEOUT);
            }
        }
        let volume = self.volume.clone();
        if std::mem::take(&mut self.started)
            && let Err(e) = self.gluster(&["volume", "stop", &volume, "force"])
        {
            failures.push(format!("{e:#}"));
        }
        if std::mem::take(&mut self.created)
            && let Err(e) = self.gluster(&["volume", "delete", &volume])
        {
            failures.push(format!("{e:#}"));
        }
        for pid in std::mem::take(&mut self.brick_pids) {
            end_process(pid, "glusterfsd");
        }
        if let Some(mut glusterd) = self.glusterd.take() {
            stop_child(&mut glusterd);
        }
        match failures.first() {
            None => Ok(()),
            Some(first) => bail!("tearing GlusterFS down: {first}"),
        }
    }
}

impl Drop for Gluster {
    fn drop(&mut self) {
        if !self.torn_down
            && let Err(e) = self.tear_down()
        {
            eprintln!("{e:#}");
        }
    }
}

/// Waits for `child` to exit; kills it after `timeout`. Its status, if it exited in time.
fn wait_bounded(child: &mut Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(POLL_INTERVAL),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

/// SIGTERM, a bounded wait, then SIGKILL, for a process this test spawned.
fn stop_child(child: &mut Child) {
    if let Some(pid) = i32::try_from(child.id()).ok().and_then(Pid::from_raw) {
        let _ = rustix::process::kill_process(pid, Signal::TERM);
    }
    let _ = wait_bounded(child, STOP_TIMEOUT);
}

/// Ends `pid` if it is still a process named `name` (a volume stop normally ends its brick
/// processes; a reused pid is left alone).
fn end_process(pid: Pid, name: &str) {
    let alive = || {
        std::fs::read_to_string(format!("/proc/{}/comm", pid.as_raw_nonzero()))
            .is_ok_and(|comm| comm.trim() == name)
    };
    if !alive() {
        return;
    }
    let _ = rustix::process::kill_process(pid, Signal::TERM);
    let deadline = Instant::now() + STOP_TIMEOUT;
    while alive() && Instant::now() < deadline {
        std::thread::sleep(POLL_INTERVAL);
    }
    if alive() {
        let _ = rustix::process::kill_process(pid, Signal::KILL);
    }
}

/// Whether a process named `name` runs.
fn process_named(name: &str) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    entries.filter_map(Result::ok).any(|entry| {
        std::fs::read_to_string(entry.path().join("comm")).is_ok_and(|comm| comm.trim() == name)
    })
}

/// The pids of the online bricks in `gluster volume status VOL --xml`.
fn online_brick_pids(xml: &str) -> Vec<Pid> {
    xml.split("<node>")
        .skip(1)
        .filter_map(|node| {
            let node = &node[..node.find("</node>")?];
            let field = |name: &str| {
                let open = format!("<{name}>");
                let start = node.find(&open)? + open.len();
                let len = node[start..].find('<')?;
                Some(node[start..start + len].trim())
            };
            if field("status")? != "1" {
                return None;
            }
            Pid::from_raw(field("pid")?.parse().ok()?)
        })
        .collect()
}
