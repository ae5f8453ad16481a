//! The `kiln` command as a user runs it: file commands against a real brick, coreutils-style
//! errors and exit codes, and the CA and certificate commands.

mod common;

use std::process::{Command, Output};

use common::{Cluster, bin};

fn kiln(cluster: &Cluster, addr: &str, args: &[&str]) -> Output {
    Command::new(bin("kiln"))
        .args(args)
        .env("KILN_TLS_DIR", &cluster.tls)
        .env("KILN_BRICK", addr)
        .env("KILN_CLIENT", "alice")
        .output()
        .expect("run kiln")
}

/// Runs `kiln args` and returns its standard output; it must succeed.
fn ok(cluster: &Cluster, addr: &str, args: &[&str]) -> String {
    let out = kiln(cluster, addr, args);
    assert!(
        out.status.success(),
        "kiln {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// Runs `kiln args`, which must fail with exit status 1, and returns its one-line message.
fn fails(cluster: &Cluster, addr: &str, args: &[&str]) -> String {
    let out = kiln(cluster, addr, args);
    assert_eq!(out.status.code(), Some(1), "kiln {args:?}");
    let err = String::from_utf8(out.stderr).expect("utf-8");
    assert_eq!(err.lines().count(), 1, "one line: {err:?}");
    err.trim_end().to_owned()
}

#[test]
fn file_commands_work_like_coreutils() {
    let cluster = Cluster::new();
    let brickd = cluster.start("127.0.0.1:0", &[]);
    let addr = brickd.addr.to_string();
    let a = addr.as_str();
    let local = cluster.dir.path().join("local.txt");
    std::fs::write(&local, b"hello from disk\n").expect("local file");
    let big = cluster.dir.path().join("big.bin");
    let big_data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 256) as u8).collect();
    std::fs::write(&big, &big_data).expect("big file");

    ok(&cluster, a, &["mkdir", "-p", "/docs/old"]);
    ok(
        &cluster,
        a,
        &["put", local.to_str().expect("utf-8"), "/docs/a.txt"],
    );
    ok(&cluster, a, &["put", big.to_str().expect("utf-8"), "/docs"]);
    assert_eq!(
        ok(&cluster, a, &["cat", "/docs/a.txt"]),
        "hello from disk\n"
    );
    assert_eq!(ok(&cluster, a, &["ls", "/docs"]), "a.txt\nbig.bin\nold\n");
    let long = ok(&cluster, a, &["ls", "-l", "/docs"]);
    assert!(
        long.lines()
            .any(|l| l.starts_with("drwxr-xr-x") && l.ends_with(" old")),
        "{long}"
    );
    assert!(
        long.lines()
            .any(|l| l.contains(" 3000000 ") && l.ends_with(" big.bin")),
        "{long}"
    );
    let stat = ok(&cluster, a, &["stat", "/docs/a.txt"]);
    assert!(
        stat.contains("Size: 16") && stat.contains("regular file") && stat.contains("GFID: "),
        "{stat}"
    );

    let fetched = cluster.dir.path().join("fetched.bin");
    ok(
        &cluster,
        a,
        &["get", "/docs/big.bin", fetched.to_str().expect("utf-8")],
    );
    assert_eq!(std::fs::read(&fetched).expect("fetched"), big_data);

    ok(&cluster, a, &["mv", "/docs/a.txt", "/docs/old"]);
    ok(&cluster, a, &["ln", "-s", "old/a.txt", "/docs/link"]);
    ok(&cluster, a, &["ln", "/docs/old/a.txt", "/hard"]);
    assert_eq!(ok(&cluster, a, &["cat", "/hard"]), "hello from disk\n");
    assert!(
        ok(&cluster, a, &["ls", "-l", "/docs"])
            .lines()
            .any(|l| l.starts_with('l') && l.ends_with(" link"))
    );

    ok(
        &cluster,
        a,
        &["xattr", "set", "/hard", "user.colour", "blue"],
    );
    assert_eq!(
        ok(&cluster, a, &["xattr", "get", "/hard", "user.colour"]),
        "blue\n"
    );
    assert_eq!(
        ok(&cluster, a, &["xattr", "list", "/hard"]),
        "user.colour\n"
    );
    ok(&cluster, a, &["xattr", "rm", "/hard", "user.colour"]);
    assert_eq!(ok(&cluster, a, &["xattr", "list", "/hard"]), "");

    // Errors read like coreutils and exit 1.
    assert_eq!(
        fails(&cluster, a, &["stat", "/nope"]),
        "kiln: cannot stat '/nope': No such file or directory"
    );
    assert_eq!(
        fails(&cluster, a, &["mkdir", "/docs"]),
        "kiln: cannot create directory '/docs': File exists"
    );
    assert_eq!(
        fails(&cluster, a, &["rm", "/docs"]),
        "kiln: cannot remove '/docs': Is a directory"
    );
    assert_eq!(
        fails(&cluster, a, &["cat", "/docs"]),
        "kiln: /docs: Is a directory"
    );
    assert_eq!(
        fails(&cluster, a, &["ls", "/hard/x"]),
        "kiln: cannot access '/hard/x': Not a directory"
    );
    assert!(
        fails(&cluster, a, &["xattr", "get", "/hard", "user.none"])
            .starts_with("kiln: '/hard': No data available")
    );

    ok(&cluster, a, &["rm", "-r", "/docs"]);
    ok(&cluster, a, &["rm", "/hard"]);
    assert_eq!(ok(&cluster, a, &["ls", "/"]), "");

    // A brick that is not there: one line, exit 1.
    drop(brickd);
    let down = fails(&cluster, a, &["ls", "/"]);
    assert!(
        down.starts_with(&format!("kiln: cannot connect to {a}")),
        "{down}"
    );
}

#[test]
fn ca_and_cert_commands() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tls = dir.path().join("tls");
    let run = |args: &[&str]| {
        Command::new(bin("kiln"))
            .args(args)
            .env("KILN_TLS_DIR", &tls)
            .output()
            .expect("run kiln")
    };
    let out = run(&["cert", "issue", "--client", "alice"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("kiln ca init"));
    assert!(run(&["ca", "init"]).status.success());
    let again = run(&["ca", "init"]);
    assert_eq!(again.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));
    assert!(
        run(&["cert", "issue", "--brick", "b1", "--host", "10.0.0.1"])
            .status
            .success()
    );
    assert!(
        run(&["cert", "issue", "--client", "alice"])
            .status
            .success()
    );
    let bad = run(&["cert", "issue", "--client", "../evil"]);
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("bad identity name"));
    let usage = run(&["cert", "issue"]);
    assert_eq!(usage.status.code(), Some(2));
    for f in [
        "ca.crt",
        "ca.key",
        "brick-b1.crt",
        "brick-b1.key",
        "client-alice.crt",
        "client-alice.key",
    ] {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(tls.join(f))
            .expect(f)
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600, "{f}");
    }
}

#[test]
fn kiln_up_serves_a_volume_from_a_directory() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let mut up = Command::new(bin("kiln"))
        .args(["up", "--listen", "127.0.0.1:0"])
        .arg(&data)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("kiln up");
    // Read its output on a thread, so a kiln up that never says where it serves fails the
    // test in bounded time instead of hanging it.
    let stdout = up.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let addr = loop {
        let line = rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("kiln up printed where it serves");
        if let Some((_, addr)) = line.split_once("KILN_BRICK=") {
            break addr.trim().to_owned();
        }
    };
    let run = |args: &[&str]| {
        Command::new(bin("kiln"))
            .args(args)
            .env("KILN_TLS_DIR", data.join("state/tls"))
            .env("KILN_BRICK", &addr)
            .env("KILN_MGMT_SOCKET", data.join("mgmtd.sock"))
            .output()
            .expect("run kiln")
    };
    let readme = dir.path().join("readme");
    std::fs::write(&readme, b"served\n").expect("local");
    assert!(
        run(&["put", readme.to_str().expect("utf-8"), "/readme"])
            .status
            .success()
    );
    assert_eq!(run(&["cat", "/readme"]).stdout, b"served\n");
    assert!(
        String::from_utf8_lossy(&run(&["volume", "status", "local"]).stdout).contains("running")
    );
    // SIGTERM goes to the daemon, which stops the brick; everything exits cleanly.
    let pid = rustix::process::Pid::from_raw(i32::try_from(up.id()).expect("pid")).expect("pid");
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).expect("kill");
    assert!(up.wait().expect("wait").success());
    assert_eq!(
        std::fs::read(data.join("brick/readme")).expect("on disk"),
        b"served\n"
    );
}

#[test]
fn a_metrics_address_in_use_stops_the_brick_with_a_clear_error() {
    let cluster = Cluster::new();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let out = Command::new(bin("kiln-brickd"))
        .arg("serve")
        .arg(&cluster.brick)
        .args(["--listen", "127.0.0.1:0", "--name", "b", "--tls-dir"])
        .arg(&cluster.tls)
        .args(["--metrics-listen", &addr])
        .output()
        .expect("run kiln-brickd");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("cannot serve metrics on {addr}")),
        "{err}"
    );
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("listening on"),
        "nothing is served"
    );
}

#[test]
fn kiln_bench_runs_the_bench_workloads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(bin("kiln"))
        .args([
            "bench",
            "smallfile",
            "--targets",
            "local",
            "--ops",
            "create,stat",
        ])
        .args(["--threads", "1", "--files", "5", "--json", "--scratch"])
        .arg(dir.path())
        .output()
        .expect("run kiln bench");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let workloads: Vec<String> = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["workload"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(
        workloads,
        ["smallfile.create", "smallfile.stat"],
        "{stdout}"
    );
    // Its arguments are kiln-bench's, errors included.
    let out = Command::new(bin("kiln"))
        .args(["bench", "no-such-workload"])
        .output()
        .expect("run kiln bench");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("kiln-bench"));
}
