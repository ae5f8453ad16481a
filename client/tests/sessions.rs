//! Sessions over time: what a connection leaves behind when it ends, many clients at once, a
//! brick killed under writes, a graceful stop, and a brick's life tied to its parent's.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{Cluster, runtime};
use kiln_client::{BrickClient, Error, Layer, LayerExt, Paths};
use kiln_wire::{AccessMode, Creds, ErrorCode, Gfid, Lock, LockCmd, LockKind, OpenFlags};

fn lock(kind: LockKind, owner: u64) -> Lock {
    Lock {
        kind,
        start: 0,
        len: 0,
        pid: 1,
        owner,
    }
}

/// Waits (bounded) until `f` is true.
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_closed_session_releases_its_files_and_locks() {
    let cluster = Cluster::new();
    let brickd = cluster.start("127.0.0.1:0", &["--root-allow", "alice,bob"]);
    let rt = runtime();
    let creds = Creds::root();
    let (alice, bob) = rt.block_on(async {
        let alice = cluster.connect(brickd.addr, "alice").await;
        let bob = cluster.connect(brickd.addr, "bob").await;
        (alice, bob)
    });
    let before = brickd.open_fds();
    let (fds, shared) = rt.block_on(async {
        let mut fds = Vec::new();
        for i in 0..50 {
            let iatt = alice
                .put(&creds, &format!("/f{i}"), Bytes::from_static(b"x"), 0o644)
                .await
                .expect("put");
            let fd = alice
                .open(&creds, iatt.gfid, AccessMode::ReadWrite, OpenFlags::empty())
                .await
                .expect("open");
            fds.push(fd);
        }
        alice
            .lk(&creds, &fds[0], LockCmd::Set, lock(LockKind::Write, 1))
            .await
            .expect("alice locks f0");
        let shared = bob
            .open(
                &creds,
                fds[0].gfid(),
                AccessMode::ReadWrite,
                OpenFlags::empty(),
            )
            .await
            .expect("bob opens f0");
        let held = bob
            .lk(&creds, &shared, LockCmd::Get, lock(LockKind::Write, 2))
            .await
            .expect("test");
        assert_eq!(held.kind, LockKind::Write, "bob sees alice's lock");
        (fds, shared)
    });
    assert!(
        brickd.open_fds() >= before + 50,
        "50 open files on the brick"
    );
    // Alice goes away without releasing anything.
    drop(fds);
    rt.block_on(alice.close());
    eventually("alice's files to close", || brickd.open_fds() <= before + 1);
    rt.block_on(async {
        bob.lk(&creds, &shared, LockCmd::Set, lock(LockKind::Write, 2))
            .await
            .expect("alice's lock died with her session");
        bob.release(&creds, shared).await.expect("release");
        bob.close().await;
    });
}

#[test]
fn a_hundred_clients_at_once() {
    const CLIENTS: usize = 100;
    const FILES: usize = 8;
    let cluster = Cluster::new();
    let brickd = cluster.start("127.0.0.1:0", &["--root-allow", "alice,bob"]);
    runtime().block_on(async {
        let mut tasks = tokio::task::JoinSet::new();
        for c in 0..CLIENTS {
            let options = cluster.options(brickd.addr, if c % 2 == 0 { "alice" } else { "bob" });
            tasks.spawn(async move {
                let v = BrickClient::connect(options).await.expect("connect");
                let creds = Creds::root();
                let dir = format!("/client{c}");
                v.mkdir(&creds, &dir, 0o755).await.expect("mkdir");
                for f in 0..FILES {
                    let data = Bytes::from(format!("client {c} file {f}").repeat(f + 1));
                    v.put(&creds, &format!("{dir}/f{f}"), data, 0o644)
                        .await
                        .expect("put");
                }
                v.mv_for_test(&format!("{dir}/f0"), &format!("{dir}/renamed"))
                    .await;
                let mut names: Vec<String> = v
                    .read_dir(&creds, v.resolve(&creds, &dir).await.expect("dir").gfid)
                    .await
                    .expect("readdir")
                    .into_iter()
                    .map(|e| e.name.to_string())
                    .collect();
                names.sort();
                let mut expected: Vec<String> = (1..FILES).map(|f| format!("f{f}")).collect();
                expected.push("renamed".into());
                expected.sort();
                assert_eq!(names, expected, "client {c}");
                for f in 1..FILES {
                    let got = v
                        .read_to_end(&creds, &format!("{dir}/f{f}"))
                        .await
                        .expect("read");
                    assert_eq!(got, format!("client {c} file {f}").repeat(f + 1).as_bytes());
                }
                let st = v
                    .resolve(&creds, &format!("{dir}/renamed"))
                    .await
                    .expect("stat");
                assert_eq!(st.size, format!("client {c} file 0").len() as u64);
                v.remove_all(&creds, &dir).await.expect("rm -r");
                v.close().await;
                c
            });
        }
        let mut done = 0;
        while let Some(result) = tasks.join_next().await {
            result.expect("client task");
            done += 1;
        }
        assert_eq!(done, CLIENTS);
    });
    let left: Vec<_> = std::fs::read_dir(&cluster.brick)
        .expect("brick")
        .map(|e| e.expect("entry").file_name())
        .filter(|n| n != ".glusterfs")
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// A rename through the raw fop, for the test above.
trait MvForTest {
    async fn mv_for_test(&self, from: &str, to: &str);
}

impl MvForTest for BrickClient {
    async fn mv_for_test(&self, from: &str, to: &str) {
        let creds = Creds::root();
        let (old_parent, old_name) = self.resolve_parent(&creds, from).await.expect("from");
        let (new_parent, new_name) = self.resolve_parent(&creds, to).await.expect("to");
        let rename = kiln_wire::Rename {
            old_parent,
            old_name,
            new_parent,
            new_name,
            mode: kiln_wire::RenameMode::NoReplace,
        };
        self.call(&creds, rename.into()).await.expect("rename");
    }
}

#[test]
fn a_killed_brick_keeps_what_was_fsynced_and_clients_carry_on() {
    const CHUNK: usize = 64 * 1024;
    let cluster = Cluster::new();
    let first = cluster.start("127.0.0.1:0", &[]);
    let addr = first.addr.to_string();
    let rt = runtime();
    // A short idle timeout, so the killed brick is noticed in seconds.
    let mut options = cluster.options(first.addr, "alice");
    options.idle_timeout = Duration::from_secs(3);
    let v = rt.block_on(BrickClient::connect(options)).expect("connect");
    let creds = Creds::root();
    let chunk = |i: usize| Bytes::from(vec![(i % 251) as u8; CHUNK]);

    // Write and fsync chunk by chunk from a task; kill the brick while it runs.
    let (fd, locked_fd, gfid) = rt.block_on(async {
        let fd = v.create_file(&creds, "/log", 0o644).await.expect("create");
        let gfid = fd.gfid();
        let locked = v
            .open(&creds, gfid, AccessMode::ReadOnly, OpenFlags::empty())
            .await
            .expect("open");
        v.lk(&creds, &locked, LockCmd::Set, lock(LockKind::Read, 9))
            .await
            .expect("lock");
        (fd, locked, gfid)
    });
    let fd = std::sync::Arc::new(fd);
    let writer = {
        let (v, fd, creds) = (v.clone(), fd.clone(), creds.clone());
        rt.spawn(async move {
            let mut acked = 0;
            for i in 0..10_000 {
                let written = v.write(&creds, &fd, (i * CHUNK) as u64, chunk(i)).await;
                if let Err(e) = written.and(v.fsync(&creds, &fd, true).await) {
                    return (acked, e);
                }
                acked = i + 1;
            }
            panic!("the brick was never killed");
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    first.kill9();
    let (acked, error) = rt.block_on(writer).expect("writer");
    assert!(acked > 0, "some writes were acknowledged before the kill");
    assert!(
        matches!(error, Error::Disconnected(_) | Error::Connect { .. }),
        "the writer saw the brick go: {error:?}"
    );

    // While the brick is down, calls fail cleanly.
    let down = rt
        .block_on(v.stat(&creds, Gfid::ROOT))
        .expect_err("brick is down");
    assert!(matches!(down, Error::Connect { .. }), "{down:?}");

    let second = cluster.start(&addr, &[]);
    rt.block_on(async {
        // Everything acknowledged by fsync is there.
        let content = v
            .read_to_end(&creds, "/log")
            .await
            .expect("read after restart");
        assert!(
            content.len() >= acked * CHUNK,
            "{} < {}",
            content.len(),
            acked * CHUNK
        );
        for i in 0..acked {
            assert!(
                content[i * CHUNK..(i + 1) * CHUNK]
                    .iter()
                    .all(|&b| b == (i % 251) as u8),
                "chunk {i} damaged"
            );
        }
        // The fd opened before the crash is opened again by its GFID and still writes the
        // same file; the one that held a lock is refused (its lock died with the brick).
        v.write(&creds, &fd, 0, Bytes::from_static(b"again"))
            .await
            .expect("write through the reopened fd");
        assert_eq!(
            v.read(&creds, &locked_fd, 0, 5)
                .await
                .expect_err("stale locked fd")
                .code(),
            Some(ErrorCode::BadFd)
        );
        let iatt = v.resolve(&creds, "/log").await.expect("stat");
        assert_eq!(iatt.gfid, gfid);
        assert_eq!(
            &v.read_to_end(&creds, "/log").await.expect("read")[..5],
            b"again"
        );
        v.close().await;
    });
    drop(second);
}

#[test]
fn sigterm_lets_calls_in_flight_finish() {
    let cluster = Cluster::new();
    let brickd = cluster.start("127.0.0.1:0", &[]);
    let rt = runtime();
    let v = rt.block_on(cluster.connect(brickd.addr, "alice"));
    let finished = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let puts = {
        let (v, finished) = (v.clone(), finished.clone());
        rt.spawn(async move {
            let mut tasks = tokio::task::JoinSet::new();
            for i in 0..2000 {
                let (v, finished) = (v.clone(), finished.clone());
                tasks.spawn(async move {
                    let creds = Creds::root();
                    let path = format!("/p{i}");
                    let result = v
                        .put(&creds, &path, Bytes::from(vec![7u8; 4096]), 0o644)
                        .await;
                    finished.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    (i, result)
                });
            }
            let mut results = Vec::new();
            while let Some(r) = tasks.join_next().await {
                results.push(r.expect("task"));
            }
            results
        })
    };
    // Stop the brick while most puts are still queued or in flight.
    eventually("the first puts", || {
        finished.load(std::sync::atomic::Ordering::Relaxed) >= 10
    });
    let status = brickd.terminate();
    assert!(status.success(), "kiln-brickd exited with {status}");
    let results = rt.block_on(puts).expect("puts");
    let mut ok = 0;
    for (i, result) in results {
        match result {
            Ok(_) => {
                ok += 1;
                let on_disk = std::fs::read(cluster.brick.join(format!("p{i}"))).expect("acked");
                assert_eq!(on_disk.len(), 4096);
            }
            // Calls not yet taken when the brick stopped fail with the brick's reason.
            Err(Error::Disconnected(why) | Error::Connect { reason: why, .. }) => {
                assert!(!why.is_empty());
            }
            Err(e) => panic!("put {i}: {e:?}"),
        }
    }
    assert!(ok > 0, "some puts finished before the stop");
}

/// `--die-with-parent`, as kiln-mgmtd starts its bricks: the brick outlives the thread that
/// spawned it (a tokio runtime ends idle threads), and stops once its parent process is gone.
#[test]
fn a_brick_stops_with_its_parent_process_not_with_the_spawning_thread() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let cluster = Cluster::new();
    let mut brickd = std::thread::scope(|s| {
        s.spawn(|| cluster.start("127.0.0.1:0", &["--die-with-parent"]))
            .join()
            .expect("the spawning thread")
    });
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        brickd.child.try_wait().expect("wait").is_none(),
        "the brick stopped when the thread that spawned it ended: {}",
        brickd.logs()
    );
    let rt = runtime();
    let v = rt.block_on(cluster.connect(brickd.addr, "alice"));
    rt.block_on(v.ping()).expect("ping");
    rt.block_on(v.close());
    assert!(brickd.terminate().success());

    // Started by a shell that exits when its input ends.
    let mut sh = Command::new("sh")
        .arg("-c")
        .arg(r#""$0" "$@" & echo "pid $!"; read _; true"#)
        .arg(common::bin("kiln-brickd"))
        .arg("serve")
        .arg(&cluster.brick)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--name",
            "b",
            "--die-with-parent",
        ])
        .arg("--tls-dir")
        .arg(&cluster.tls)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("sh");
    let (mut pid, mut listening) = (None, false);
    for line in BufReader::new(sh.stdout.take().expect("stdout")).lines() {
        let line = line.expect("a line");
        pid = pid.or_else(|| line.strip_prefix("pid ").map(str::to_owned));
        listening |= line.starts_with("listening on ");
        if pid.is_some() && listening {
            break;
        }
    }
    let pid = pid.expect("the brick's pid");
    assert!(listening, "the brick did not start");
    drop(sh.stdin.take());
    assert!(sh.wait().expect("sh").success());
    let deadline = Instant::now() + Duration::from_secs(30);
    // Gone, or a zombie waiting for the process that adopted it.
    while std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|stat| !stat.rsplit(')').next().is_some_and(|s| s.starts_with(" Z")))
    {
        assert!(Instant::now() < deadline, "brick {pid} outlived its parent");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn calls_beyond_the_inflight_limit_wait_instead_of_failing() {
    let cluster = Cluster::new();
    let brickd = cluster.start("127.0.0.1:0", &["--inflight-max", "4"]);
    runtime().block_on(async {
        let v = cluster.connect(brickd.addr, "alice").await;
        assert_eq!(v.hello().await.expect("hello").limits.inflight_max, 4);
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..300 {
            let v = v.clone();
            tasks.spawn(async move {
                let creds = Creds::root();
                v.put(
                    &creds,
                    &format!("/q{i}"),
                    Bytes::from(vec![1u8; 1024]),
                    0o644,
                )
                .await
                .map(|iatt| iatt.size)
            });
        }
        let mut done = 0;
        while let Some(r) = tasks.join_next().await {
            assert_eq!(r.expect("task").expect("put"), 1024);
            done += 1;
        }
        assert_eq!(done, 300);
        v.close().await;
    });
}

#[test]
fn a_brick_and_a_port_have_one_server() {
    let cluster = Cluster::new();
    let brickd = cluster.start("127.0.0.1:0", &["--workers", "2", "--endpoints", "2"]);
    let serve = |brick: &std::path::Path, listen: &str| {
        std::process::Command::new(common::bin("kiln-brickd"))
            .arg("serve")
            .arg(brick)
            .args(["--listen", listen, "--name", "b", "--tls-dir"])
            .arg(&cluster.tls)
            .output()
            .expect("run kiln-brickd")
    };
    // The same brick on another port.
    let again = serve(&cluster.brick, "127.0.0.1:0");
    assert!(!again.status.success());
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(
        err.contains("already served by another kiln-brickd"),
        "{err}"
    );
    // Another brick on the same port: refused, even though the endpoints use SO_REUSEPORT.
    let other = cluster.dir.path().join("other");
    std::fs::create_dir(&other).expect("dir");
    let format = std::process::Command::new(common::bin("kiln-brickd"))
        .arg("format")
        .arg(&other)
        .output()
        .expect("format");
    assert!(format.status.success());
    let clash = serve(&other, &brickd.addr.to_string());
    assert!(!clash.status.success());
    let err = String::from_utf8_lossy(&clash.stderr);
    assert!(
        err.contains("cannot listen on") && err.contains("in use"),
        "{err}"
    );
    // The first brick still serves.
    runtime().block_on(async {
        let v = cluster.connect(brickd.addr, "alice").await;
        v.ping().await.expect("ping");
        v.close().await;
    });
    common::assert_brick_checks_clean(&cluster.brick);
}

/// An fd opened before a brick restart is opened again by its GFID; if another object has
/// taken that GFID meanwhile (its file was removed, a client reused the id), the fd fails
/// with EBADF instead of reaching the newcomer.
#[test]
fn a_reopened_fd_never_reaches_an_object_that_took_its_gfid() {
    let cluster = Cluster::new();
    let first = cluster.start("127.0.0.1:0", &[]);
    let addr = first.addr.to_string();
    let rt = runtime();
    let mut options = cluster.options(first.addr, "alice");
    options.idle_timeout = Duration::from_secs(3);
    let v = rt.block_on(BrickClient::connect(options)).expect("connect");
    let creds = Creds::root();
    let fd = rt.block_on(async {
        let fd = v.create_file(&creds, "/mine", 0o644).await.expect("create");
        v.write(&creds, &fd, 0, Bytes::from_static(b"secret"))
            .await
            .expect("write");
        fd
    });
    first.kill9();
    let second = cluster.start(&addr, &[]);
    rt.block_on(async {
        // The file goes, and a new one is made with the same GFID. The old inode is held
        // open here so the new file cannot get its number: the client tells objects apart by
        // inode number, and one freed and reused at once is a hole it cannot see (the brick
        // sends no inode generation yet).
        let _ = v.stat(&creds, Gfid::ROOT).await;
        v.stat(&creds, Gfid::ROOT).await.expect("reconnected");
        let _old_inode = std::fs::File::open(cluster.brick.join("mine")).expect("the old file");
        v.remove_all(&creds, "/mine").await.expect("unlink");
        let put = kiln_wire::Put {
            parent: Gfid::ROOT,
            name: kiln_wire::Name::new("theirs".to_owned()).expect("name"),
            gfid: fd.gfid(),
            mode: kiln_wire::Mode::new(0o644).expect("mode"),
            umask: kiln_wire::Mode::new(0).expect("mode"),
            flags: OpenFlags::empty(),
            data: kiln_wire::Payload::new(Bytes::from_static(b"other")).expect("small"),
            attr: kiln_wire::SetAttr::default(),
        };
        v.call(&creds, put.into())
            .await
            .expect("a new file takes the GFID");
        let e = v
            .write(&creds, &fd, 0, Bytes::from_static(b"leak"))
            .await
            .expect_err("the old fd must not reach the new file");
        assert_eq!(e.code(), Some(ErrorCode::BadFd), "{e:?}");
        assert_eq!(
            v.read_to_end(&creds, "/theirs").await.expect("read"),
            b"other",
            "the newcomer is untouched"
        );
        v.close().await;
    });
    drop(second);
}

/// The brick's descriptors of the file at `path` on the brick (by inode: the brick opens
/// files through their GFID handles).
fn brick_fds_of(brickd: &common::Brickd, path: &std::path::Path) -> usize {
    use std::os::unix::fs::MetadataExt;
    let file = std::fs::metadata(path).expect("the file on the brick");
    let Ok(fds) = std::fs::read_dir(format!("/proc/{}/fd", brickd.pid())) else {
        return 0;
    };
    fds.filter_map(Result::ok)
        .filter_map(|fd| std::fs::metadata(fd.path()).ok())
        .filter(|m| (m.dev(), m.ino()) == (file.dev(), file.ino()))
        .count()
}

/// 1 MiB chunk `i`, different for every `i` below 251.
fn mib_chunk(i: usize) -> Bytes {
    let salt = (i % 251) as u8;
    (0..1usize << 20)
        .map(|b| (b % 253) as u8 ^ salt)
        .collect::<Vec<u8>>()
        .into()
}

/// Writes MiB `0..mibs` of `fd` (chunk `i` at MiB `i`), all at once.
async fn write_mibs(v: &BrickClient, fd: &kiln_client::Fd, mibs: usize) {
    let creds = Creds::root();
    let writes = (0..mibs).map(|i| v.write(&creds, fd, (i as u64) << 20, mib_chunk(i)));
    for written in futures_util::future::join_all(writes).await {
        written.expect("write");
    }
}

/// Reads MiB `0..mibs` of `fd` back: each as [`write_mibs`] wrote it.
async fn read_mibs(v: &BrickClient, fd: &kiln_client::Fd, mibs: usize) {
    for i in 0..mibs {
        let got = v
            .read(&Creds::root(), fd, (i as u64) << 20, 1 << 20)
            .await
            .expect("read");
        assert!(got == mib_chunk(i), "MiB {i} reads back as written");
    }
}

#[test]
fn a_client_spreads_large_reads_and_writes_over_its_connections() {
    let cluster = Cluster::new();
    let brickd = cluster.start("127.0.0.1:0", &["--root-allow", "alice"]);
    let rt = runtime();
    let creds = Creds::root();
    let mut options = cluster.options(brickd.addr, "alice");
    for refused in [0, kiln_client::CONNECTIONS_MAX + 1] {
        options.connections = refused;
        let e = rt
            .block_on(BrickClient::connect(options.clone()))
            .expect_err("a connection count out of range");
        assert!(matches!(e, Error::Misuse(_)), "{e:?}");
    }
    options.connections = 3;
    let v = rt.block_on(BrickClient::connect(options)).expect("connect");
    let path = cluster.brick.join("big");
    let (writer, reader) = rt.block_on(async {
        let writer = v.create_file(&creds, "/big", 0o644).await.expect("create");
        write_mibs(&v, &writer, 6).await;
        // Small I/O stays on the main connection.
        v.write(&creds, &writer, 6 << 20, Bytes::from_static(b"tail"))
            .await
            .expect("small write");
        let reader = v
            .open(
                &creds,
                writer.gfid(),
                AccessMode::ReadOnly,
                OpenFlags::empty(),
            )
            .await
            .expect("open");
        read_mibs(&v, &reader, 6).await;
        (writer, reader)
    });
    let open = brick_fds_of(&brickd, &path);
    let held = open
        .checked_sub(6)
        .unwrap_or_else(|| panic!("{open} descriptors of the file, not 6 or 7"));
    assert!(
        held <= 1,
        "{open} descriptors: each fd open on the main session and on both lanes"
    );
    rt.block_on(async {
        v.release(&creds, writer).await.expect("release");
        v.release(&creds, reader).await.expect("release");
    });
    // The brick may keep an `O_PATH` descriptor of the file in its GFID cache.
    eventually("the lanes' files to close", || {
        brick_fds_of(&brickd, &path) <= held
    });
    assert_eq!(
        std::fs::metadata(&path).expect("on the brick").len(),
        (6 << 20) + 4
    );
    rt.block_on(async {
        // A file removed while open cannot be opened by GFID on a lane: its large I/O goes
        // over the main connection, and nothing fails.
        let created = v.create_file(&creds, "/gone", 0o644).await.expect("create");
        let fd = v
            .open(
                &creds,
                created.gfid(),
                AccessMode::ReadWrite,
                OpenFlags::empty(),
            )
            .await
            .expect("open");
        v.release(&creds, created).await.expect("release");
        v.remove_all(&creds, "/gone").await.expect("unlink");
        write_mibs(&v, &fd, 3).await;
        read_mibs(&v, &fd, 3).await;
        v.release(&creds, fd).await.expect("release");
        v.close().await;
    });
}

/// `local_port` puts the client's connection on that UDP port (a port just freed, so free),
/// and a client of several connections puts them on the ports after it, the main one last.
#[test]
fn a_client_binds_the_ports_it_is_given() {
    let cluster = Cluster::new();
    let brickd = cluster.start("127.0.0.1:0", &[]);
    let rt = runtime();
    let free_port = || {
        std::net::UdpSocket::bind("0.0.0.0:0")
            .and_then(|s| s.local_addr())
            .expect("a free port")
            .port()
    };
    let mut options = cluster.options(brickd.addr, "alice");
    options.local_port = free_port();
    let v = rt
        .block_on(BrickClient::connect(options.clone()))
        .expect("connect");
    assert_eq!(v.local_port(), Some(options.local_port));
    rt.block_on(v.close());
    // The lanes take the given port and the next; the main connection the one after.
    let first = (0..100)
        .map(|_| free_port())
        .find(|&p| {
            p < u16::MAX - 2
                && (1..3).all(|i| std::net::UdpSocket::bind(("0.0.0.0", p + i)).is_ok())
        })
        .expect("three free ports in a row");
    options.local_port = first;
    options.connections = 3;
    let v = rt.block_on(BrickClient::connect(options)).expect("connect");
    assert_eq!(v.local_port(), Some(first + 2));
    rt.block_on(v.close());
}
