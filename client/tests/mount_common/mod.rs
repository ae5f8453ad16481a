//! A real brick and a real `kiln mount` of it, for the FUSE tests.
#![allow(
    dead_code,
    unreachable_pub,
    reason = "each test file uses a different part"
)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub use crate::common::is_kiln_mount;
use crate::common::{Brickd, Cluster, bin};

/// How long a mount may take to appear or go.
const MOUNT_TIMEOUT: Duration = Duration::from_secs(30);

/// A brick, and `kiln mount -f` of it on a fresh directory.
pub struct Mounted {
    pub cluster: Cluster,
    pub brickd: Option<Brickd>,
    /// A distributed volume's other bricks, after `brickd`'s, in brick order.
    pub more_brickds: Vec<Brickd>,
    pub mountpoint: PathBuf,
    pub server: Option<Child>,
    pub log: PathBuf,
}

impl Mounted {
    /// Starts a brick and mounts it in the foreground with `options` (`-o`).
    pub fn new(options: &[&str]) -> Mounted {
        Mounted::with_brick(&[], options)
    }

    /// Starts a brick with `brick_args` and mounts it in the foreground with `options`.
    pub fn with_brick(brick_args: &[&str], options: &[&str]) -> Mounted {
        let cluster = Cluster::new();
        let brickd = cluster.start("127.0.0.1:0", brick_args);
        let mountpoint = cluster.dir.path().join("mnt");
        std::fs::create_dir(&mountpoint).expect("mountpoint");
        let log = cluster.dir.path().join("mount.log");
        let mut mounted = Mounted {
            cluster,
            brickd: Some(brickd),
            more_brickds: Vec::new(),
            mountpoint,
            server: None,
            log,
        };
        mounted.mount(options);
        mounted
    }

    /// A distributed volume of `bricks` bricks (the first is `brickd` and `cluster.brick`,
    /// the others `brick-N` beside it), mounted with `options`.
    pub fn distributed(bricks: usize, options: &[&str]) -> Mounted {
        Mounted::distributed_with(bricks, |_| Vec::new(), options)
    }

    /// [`Mounted::distributed`] with brick `n` started with `brick_args(n)`.
    pub fn distributed_with(
        bricks: usize,
        brick_args: impl Fn(usize) -> Vec<String>,
        options: &[&str],
    ) -> Mounted {
        let first = brick_args(0);
        let mut mounted = Mounted::with_brick(&strs(&first), &[]);
        mounted.unmount();
        for n in 1..bricks {
            let brick = mounted.cluster.add_brick(n);
            let brickd = mounted
                .cluster
                .start_brick(&brick, "127.0.0.1:0", &strs(&brick_args(n)));
            mounted.more_brickds.push(brickd);
        }
        mounted.mount(options);
        mounted
    }

    /// The brick directories of the volume, in brick order.
    pub fn brick_dirs(&self) -> Vec<PathBuf> {
        let bricks = 1 + self.more_brickds.len();
        (0..bricks).map(|n| self.cluster.brick_dir(n)).collect()
    }

    /// What `kiln mount` is given: the brick's address, or the bricks' comma-separated.
    pub fn addr(&self) -> String {
        let first = self.brickd.as_ref().expect("brick running");
        std::iter::once(first)
            .chain(&self.more_brickds)
            .map(|b| b.addr.to_string())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `kiln --tls-dir … --client alice` plus `args`.
    pub fn kiln(&self) -> Command {
        let mut command = Command::new(bin("kiln"));
        command
            .arg("--tls-dir")
            .arg(&self.cluster.tls)
            .args(["--client", "alice"]);
        command
    }

    /// Runs `kiln mount -f` and waits until the mount is there.
    pub fn mount(&mut self, options: &[&str]) {
        let mut command = self.kiln();
        command
            .arg("mount")
            .arg(self.addr())
            .arg(&self.mountpoint)
            .arg("-f");
        for o in options {
            command.args(["-o", o]);
        }
        let server = command
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&self.log).expect("log"))
            .spawn()
            .expect("kiln mount");
        self.server = Some(server);
        self.wait_mounted(true);
    }

    /// Waits (bounded) until the mount point is (or is not) a Kiln mount.
    pub fn wait_mounted(&mut self, want: bool) {
        let deadline = Instant::now() + MOUNT_TIMEOUT;
        while is_kiln_mount(&self.mountpoint) != want {
            if let Some(server) = &mut self.server
                && let Ok(Some(status)) = server.try_wait()
                && want
            {
                panic!("kiln mount exited ({status}):\n{}", self.logs());
            }
            assert!(
                Instant::now() < deadline,
                "mount {} not {}:\n{}",
                self.mountpoint.display(),
                if want { "up" } else { "gone" },
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A path inside the mount.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.mountpoint.join(rel)
    }

    /// The brick directory's copy of `rel` (to check what reached the brick), once the mount
    /// has sent what it answered itself: an fsync of the mount's root drains the changes it
    /// queued behind its leases (a close does not wait for them).
    pub fn on_brick(&self, rel: &str) -> PathBuf {
        if is_kiln_mount(&self.mountpoint) {
            std::fs::File::open(&self.mountpoint)
                .and_then(|root| root.sync_all())
                .expect("fsync of the mount's root");
        }
        self.cluster.brick.join(rel)
    }

    /// Unmounts with `kiln umount` and waits for the server to exit 0.
    pub fn unmount(&mut self) {
        let out = crate::common::kiln_umount(&self.mountpoint);
        assert!(out.status.success(), "umount: {}", text(&out));
        self.wait_server_exit();
    }

    /// Waits (bounded) for the mount's server to exit, and checks it exited 0.
    pub fn wait_server_exit(&mut self) {
        let mut server = self.server.take().expect("server");
        let deadline = Instant::now() + MOUNT_TIMEOUT;
        loop {
            if let Some(status) = server.try_wait().expect("wait") {
                assert!(
                    status.success(),
                    "kiln mount exited {status}:\n{}",
                    self.logs()
                );
                return;
            }
            assert!(
                Instant::now() < deadline,
                "kiln mount did not exit:\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Mounted {
    /// A second mount of the same brick, as another client process, on a new directory.
    pub fn another(&self, name: &str, options: &[&str]) -> OtherMount {
        let mountpoint = self.cluster.dir.path().join(name);
        std::fs::create_dir(&mountpoint).expect("mountpoint");
        let log = self.cluster.dir.path().join(format!("{name}.log"));
        let mut command = self.kiln();
        command
            .arg("mount")
            .arg(self.addr())
            .arg(&mountpoint)
            .arg("-f");
        for o in options {
            command.args(["-o", o]);
        }
        let server = command
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("kiln mount");
        let other = OtherMount {
            mountpoint,
            server: Some(server),
            log,
        };
        let deadline = Instant::now() + MOUNT_TIMEOUT;
        while !is_kiln_mount(&other.mountpoint) {
            assert!(
                Instant::now() < deadline,
                "mount {name} not up:\n{}",
                other.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        other
    }

    /// The pid of the mount's server process.
    pub fn pid(&self) -> i32 {
        self.server.as_ref().map_or(0, |s| s.id() as i32)
    }
}

/// Another mount of a [`Mounted`]'s brick; unmounted and stopped when dropped.
pub struct OtherMount {
    pub mountpoint: PathBuf,
    pub server: Option<Child>,
    pub log: PathBuf,
}

impl OtherMount {
    pub fn path(&self, rel: &str) -> PathBuf {
        self.mountpoint.join(rel)
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> i32 {
        self.server.as_ref().map_or(0, |s| s.id() as i32)
    }
}

impl Drop for OtherMount {
    fn drop(&mut self) {
        tear_down(&self.mountpoint, &mut self.server);
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        tear_down(&self.mountpoint, &mut self.server);
    }
}

/// Detaches a mount still there and kills its server, whatever state a test left them in.
fn tear_down(mountpoint: &Path, server: &mut Option<Child>) {
    if is_kiln_mount(mountpoint) {
        let _ = rustix::mount::unmount(mountpoint, rustix::mount::UnmountFlags::DETACH);
    }
    if let Some(mut server) = server.take() {
        let _ = server.kill();
        let _ = server.wait();
    }
}

/// Runs a shell command line (in `dir`), returning its output.
pub fn sh(dir: &Path, script: &str) -> Output {
    Command::new("sh")
        .arg("-c")
        .arg(script)
        .current_dir(dir)
        .output()
        .expect("sh")
}

/// Runs a shell command line and panics with its output when it fails.
pub fn sh_ok(dir: &Path, script: &str) -> String {
    let out = sh(dir, script);
    assert!(out.status.success(), "`{script}` failed:\n{}", text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A test tool installed by `scripts/test-tools` (pjdfstest, fsx) into `target/tools/bin`, or
/// found on PATH.
pub fn tool(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let target = exe.ancestors().nth(3).expect("target/<profile>/deps/<exe>");
    let local = target.join("tools").join("bin").join(name);
    if local.exists() {
        return local;
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join(name))
        .find(|p| p.exists());
    on_path.unwrap_or_else(|| {
        panic!("{name} is not installed: run scripts/test-tools (./scripts/test does)")
    })
}

/// Runs pjdfstest in a fresh directory of mount `m` and checks every case passes.
pub fn pjdfstest_passes(m: &Mounted) {
    pjdfstest_passes_in(&m.path("pjd"));
}

/// Runs pjdfstest in `work`, a fresh directory it makes on the mount, and checks every case
/// passes.
pub fn pjdfstest_passes_in(work: &Path) {
    std::fs::create_dir(work).expect("mkdir");
    let other_fs = tempfile::tempdir().expect("tempdir");
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/posix/pjdfstest.toml");
    let out = Command::new(tool("pjdfstest"))
        .arg("-c")
        .arg(&config)
        .arg("-p")
        .arg(work)
        .arg("-s")
        .arg(other_fs.path())
        .output()
        .expect("pjdfstest");
    let report = text(&out);
    let summary = report
        .lines()
        .find(|l| l.starts_with("Summary:"))
        .unwrap_or("no summary")
        .to_owned();
    println!("pjdfstest: {summary}");
    assert!(
        out.status.success() && summary.starts_with("Summary: 0 failed"),
        "pjdfstest failed:\n{report}"
    );
}

/// Runs fsx (every operation it has, mmap included) for `ops` operations of seed `seed` on
/// `file`, and checks it finds no corruption.
pub fn fsx_passes(file: &Path, ops: u32, seed: u32) {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("fsx.toml");
    std::fs::write(&config, FSX_CONFIG).expect("fsx config");
    let out = Command::new(tool("fsx"))
        .arg("-f")
        .arg(&config)
        .args(["-N", &ops.to_string(), "-S", &seed.to_string(), "-P"])
        .arg(dir.path())
        .arg(file)
        .output()
        .expect("fsx");
    assert!(
        out.status.success() && text(&out).contains("All operations completed A-OK!"),
        "fsx (seed {seed}) on {}:\n{}",
        file.display(),
        text(&out)
    );
}

/// Every operation fsx has, reads and writes through mmap included.
const FSX_CONFIG: &str = "flen = 262144
[opsize]
max = 65536
[weights]
read = 10
write = 10
mapread = 10
mapwrite = 10
truncate = 1
close_open = 1
invalidate = 1
fsync = 1
fdatasync = 1
posix_fallocate = 1
punch_hole = 1
copy_file_range = 1
sendfile = 1
posix_fadvise = 1
";

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}
