//! Every workload runs in test mode on tiny sizes, so the benchmarks cannot rot. Nothing here
//! looks at timings; it checks the output has every target and parses.

use std::process::Command;

#[test]
fn engine_workload_runs_and_reports_every_target() {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln-bench"))
        .args([
            "engine",
            "--files",
            "60",
            "--dirs",
            "3",
            "--depths",
            "1,8",
            "--open-sweep",
            "5,50",
            "--open-samples",
            "20",
            "--json",
        ])
        .output()
        .expect("run kiln-bench");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON Lines"))
        .collect();
    assert!(lines[0].get("environment").is_some());
    let records = &lines[1..];
    for target in ["std_loop", "blocking", "uring"] {
        for workload in [
            "engine.create",
            "engine.stat",
            "engine.open_close",
            "engine.unlink",
            "engine.open_latency",
        ] {
            assert!(
                records
                    .iter()
                    .any(|r| r["target"] == target && r["workload"] == workload),
                "no {workload} result for {target}"
            );
        }
    }
    for r in records {
        assert!(r["ratio"].as_f64().is_some_and(|x| x > 0.0), "{r}");
        assert!(r["reference"].is_string());
    }
    // The ring reports its io_uring_enter calls per fop.
    assert!(
        records
            .iter()
            .any(|r| r["target"] == "uring" && r["enters_per_op"].as_f64().is_some())
    );
}

#[test]
fn net_workload_runs_and_reports_every_target() {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln-bench"))
        .args([
            "net",
            "--files",
            "200",
            "--pings",
            "200",
            "--bulk-mib",
            "8",
            "--json",
        ])
        .output()
        .expect("run kiln-bench");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON Lines"))
        .collect();
    assert!(lines[0].get("environment").is_some());
    let net = lines
        .iter()
        .find_map(|l| l.get("net"))
        .expect("the net set-up line");
    assert!(net["server"].is_string());
    // UDP counters are notes, not results.
    assert!(lines.iter().any(|l| l.get("udp").is_some()));
    let records: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l.get("workload").is_some())
        .collect();
    let has = |workload: &str, target: &str, reference: &str| {
        records.iter().any(|r| {
            r["workload"] == workload && r["target"] == target && r["reference"] == reference
        })
    };
    for (workload, target, reference) in [
        ("net.create", "std_loop", "std_loop"),
        ("net.create", "engine_direct", "std_loop"),
        ("net.create", "quic", "std_loop"),
        ("net.create", "quic", "engine_direct"),
        ("net.ping", "tcp", "tcp"),
        ("net.ping", "quic", "tcp"),
        ("net.bulk", "tcp", "tcp"),
        ("net.bulk_write", "quic", "tcp"),
        ("net.bulk_read", "quic", "tcp"),
    ] {
        assert!(
            has(workload, target, reference),
            "no {workload} result for {target} against {reference}"
        );
    }
    // Every concurrency level of the PUTs, and both UDP payload caps of the bulk runs.
    for c in [1, 16, 128] {
        assert!(records.iter().any(|r| r["workload"] == "net.create"
            && r["target"] == "quic"
            && r["params"]["concurrency"] == c));
    }
    for cap in [kiln_wire::quic::UDP_PAYLOAD_MAX_BYTES, 1452] {
        for workload in ["net.bulk_write", "net.bulk_read"] {
            assert!(
                records
                    .iter()
                    .any(|r| r["workload"] == workload && r["params"]["udp_payload"] == cap),
                "no {workload} with udp_payload {cap}"
            );
        }
    }
    let positive = |v: &serde_json::Value| v.as_f64().is_some_and(|x| x > 0.0);
    for r in &records {
        assert!(positive(&r["ratio"]), "{r}");
        assert!(
            positive(&r["ops_per_s"]) || positive(&r["mib_per_s"]),
            "no rate: {r}"
        );
        if r["workload"] != "net.bulk" {
            assert!(positive(&r["p50_us"]) && positive(&r["p99_us"]), "{r}");
        }
    }
}

#[test]
fn mgmt_workload_runs_and_reports_every_target() {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln-bench"))
        .args(["mgmt", "--sets", "20", "--json"])
        .output()
        .expect("run kiln-bench");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON Lines"))
        .collect();
    assert!(lines[0].get("environment").is_some());
    // Whether gluster is installed or not, the run says so.
    let gluster = lines
        .iter()
        .find_map(|l| l.get("gluster"))
        .expect("the gluster note");
    assert!(gluster["note"].is_string(), "{gluster}");
    let stop = lines
        .iter()
        .find_map(|l| l.get("mgmtd_stop"))
        .expect("the kiln-mgmtd stop note");
    assert_eq!(stop["sigkill"], false, "{stop}");
    let records: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l.get("workload").is_some())
        .collect();
    for (workload, target) in [
        ("mgmt.fsync_floor", "fsync_floor"),
        ("mgmt.commit", "store"),
        ("mgmt.commit", "store_group"),
        ("mgmt.set", "kiln-cli"),
        ("mgmt.set", "kiln-cli-started"),
    ] {
        assert!(
            records
                .iter()
                .any(|r| r["workload"] == workload && r["target"] == target),
            "no {workload} result for {target}"
        );
    }
    let positive = |v: &serde_json::Value| v.as_f64().is_some_and(|x| x > 0.0);
    for r in &records {
        assert_eq!(r["reference"], "fsync_floor", "{r}");
        assert!(positive(&r["ratio"]), "{r}");
        assert!(positive(&r["ops_per_s"]), "{r}");
        assert!(positive(&r["p50_us"]) && positive(&r["p99_us"]), "{r}");
    }
    // The group run reports the store's own fsync count, and the started run's sets reached
    // the brick.
    let group = records
        .iter()
        .find(|r| r["target"] == "store_group")
        .expect("store_group");
    assert!(
        group["params"]["fsyncs"].as_u64().is_some_and(|f| f >= 1),
        "{group}"
    );
    let started = records
        .iter()
        .find(|r| r["target"] == "kiln-cli-started")
        .expect("kiln-cli-started");
    assert!(
        started["params"]["applied_live"]
            .as_u64()
            .is_some_and(|n| n >= 1),
        "{started}"
    );
}

#[test]
fn mount_workload_runs_and_reports_every_phase() {
    // The Kiln target mounts FUSE and the phases drop the kernel's caches: root only.
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: kiln-bench mount needs root (FUSE mounts, drop_caches)");
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_kiln-bench"))
        .args([
            "mount",
            "--files",
            "200",
            "--dirs",
            "20",
            "--targets",
            "local,kiln",
            "--json",
        ])
        .output()
        .expect("run kiln-bench");
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON Lines"))
        .collect();
    assert!(lines[0].get("environment").is_some());
    let tree = lines
        .iter()
        .find_map(|l| l.get("tree"))
        .expect("the tree note");
    assert_eq!(tree["files"], 200, "{tree}");
    assert_eq!(tree["dirs"], 20, "{tree}");
    let records: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l.get("workload").is_some())
        .collect();
    let positive = |v: &serde_json::Value| v.as_f64().is_some_and(|x| x > 0.0);
    for workload in [
        "mount.untar",
        "mount.stat",
        "mount.ls_lR",
        "mount.read",
        "mount.rm",
    ] {
        for (target, reference) in [("local", "local"), ("kiln", "local")] {
            let r = records
                .iter()
                .find(|r| {
                    r["workload"] == workload
                        && r["target"] == target
                        && r["reference"] == reference
                })
                .unwrap_or_else(|| panic!("no {workload} result for {target} against {reference}"));
            assert!(positive(&r["ratio"]), "{r}");
            assert!(positive(&r["ops_per_s"]), "{r}");
            assert!(positive(&r["params"]["seconds"]), "{r}");
        }
    }
    // Every phase is summarized, and the Kiln mount and its brick stopped cleanly.
    let summaries = lines
        .iter()
        .filter_map(|l| l.get("mount_summary"))
        .filter(|s| positive(&s["kiln_over_local"]))
        .count();
    assert_eq!(summaries, 5);
    let stop = lines
        .iter()
        .filter_map(|l| l.get("mount_stop"))
        .find(|s| s["target"] == "kiln")
        .expect("the kiln stop note");
    assert_eq!(stop["unmount"]["status"], "exit status: 0", "{stop}");
    assert_eq!(stop["brickd"]["sigkill"], false, "{stop}");
}

/// Runs kiln-bench with `args` (plus `--json`); returns its JSON lines, failing on a non-zero
/// exit or output that is not JSON Lines.
fn run_json(args: &[&str]) -> Vec<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln-bench"))
        .args(args)
        .arg("--json")
        .output()
        .expect("run kiln-bench");
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // No progress bar (carriage returns, terminal escapes) drawn on a stderr that is a pipe.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains('\r') && !stderr.contains('\u{1b}'),
        "terminal output on a pipe: {stderr:?}"
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

fn records(lines: &[serde_json::Value]) -> Vec<&serde_json::Value> {
    lines
        .iter()
        .filter(|l| l.get("workload").is_some())
        .collect()
}

/// Every latency quantile is there, above zero and in order.
fn assert_latencies(r: &serde_json::Value) {
    let q: Vec<f64> = ["p50_us", "p90_us", "p99_us", "p999_us"]
        .iter()
        .map(|k| r[k].as_f64().unwrap_or_else(|| panic!("no {k}: {r}")))
        .collect();
    assert!(q[0] > 0.0, "{r}");
    assert!(
        q.windows(2).all(|w| w[0] <= w[1]),
        "quantiles out of order: {r}"
    );
}

/// A plot file that is there and is what its name says.
fn assert_plot(path: &std::path::Path) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    match path.extension().and_then(|e| e.to_str()) {
        Some("svg") => assert!(bytes.starts_with(b"<svg") && bytes.len() > 1000),
        _ => assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n") && bytes.len() > 1000),
    }
}

const SMALLFILE_OPS: [&str; 13] = [
    "create", "stat", "read", "append", "chmod", "setxattr", "getxattr", "ls-l", "readdir",
    "rename", "delete", "mkdir", "rmdir",
];

#[test]
fn smallfile_workload_runs_every_op_on_every_target() {
    // The engine formats bricks (trusted xattrs) and kiln-mount mounts FUSE: root only.
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: kiln-bench smallfile needs root (bricks, FUSE)");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let elsewhere = dir.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).expect("mkdir");
    let plot = dir.path().join("smallfile.svg");
    let targets = format!(
        "local,engine,volume,path={},kiln-mount",
        elsewhere.display()
    );
    let lines = run_json(&[
        "smallfile",
        "--threads",
        "2",
        "--files",
        "30",
        "--fanout",
        "8",
        "--file-bytes",
        "1000",
        "--targets",
        &targets,
        "--plot",
        plot.to_str().expect("utf-8 path"),
    ]);
    assert_eq!(lines[0]["environment"]["seed"], 0x736d_616c_6c66_u64);
    let records = records(&lines);
    let path_target = format!("path={}", elsewhere.display());
    for target in ["local", "engine", "volume", &path_target, "kiln-mount"] {
        for op in SMALLFILE_OPS {
            let workload = format!("smallfile.{op}");
            let r = records
                .iter()
                .find(|r| r["workload"] == workload.as_str() && r["target"] == target)
                .unwrap_or_else(|| panic!("no {workload} result for {target}"));
            assert_eq!(r["reference"], "local", "{r}");
            assert!(r["ratio"].as_f64().is_some_and(|x| x > 0.0), "{r}");
            assert!(r["ops_per_s"].as_f64().is_some_and(|x| x > 0.0), "{r}");
            assert_latencies(r);
            if target == "local" {
                assert_eq!(r["ratio"], 1.0, "{r}");
            }
        }
    }
    assert_eq!(records.len(), 5 * SMALLFILE_OPS.len());
    assert_plot(&plot);
    let svg = std::fs::read_to_string(&plot).expect("svg");
    assert!(svg.contains("\nkiln-mount\n") && svg.contains("\ngetxattr\n"));
    // The path= target removed its work directory; kiln-mount stopped cleanly.
    assert_eq!(std::fs::read_dir(&elsewhere).expect("ls").count(), 0);
    let mount = lines
        .iter()
        .filter_map(|l| l.get("smallfile_target"))
        .find(|n| n["target"] == "kiln-mount")
        .expect("the kiln-mount stop note");
    assert_eq!(mount["stopped"]["brickd"]["sigkill"], false, "{mount}");
    assert_eq!(mount["fs"], "fuse", "{mount}");
}

#[test]
fn smallfile_sets_up_missing_preconditions_unmeasured() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: kiln-bench smallfile needs root (bricks)");
        return;
    }
    let lines = run_json(&[
        "smallfile",
        "--ops",
        "getxattr,rmdir",
        "--targets",
        "engine,local",
        "--threads",
        "1",
        "--files",
        "10",
    ]);
    let plan = lines
        .iter()
        .find_map(|l| l.get("smallfile"))
        .expect("the smallfile note");
    assert_eq!(
        plan["plan"],
        serde_json::json!([
            "(create)",
            "(setxattr)",
            "getxattr",
            "(mkdir)",
            "rmdir",
            "(delete)"
        ])
    );
    let records = records(&lines);
    let measured: Vec<(&str, &str)> = records
        .iter()
        .map(|r| {
            (
                r["workload"].as_str().unwrap_or_default(),
                r["target"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        measured,
        [
            ("smallfile.getxattr", "engine"),
            ("smallfile.rmdir", "engine"),
            ("smallfile.getxattr", "local"),
            ("smallfile.rmdir", "local"),
        ]
    );
    // The first target listed is the reference.
    assert!(records.iter().all(|r| r["reference"] == "engine"));
}

#[test]
fn openfds_workload_sweeps_every_target_up_to_the_cap() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: kiln-bench openfds needs root (bricks)");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let plot = dir.path().join("openfds.png");
    let lines = run_json(&[
        "openfds",
        "--held",
        "0,10,100,5000",
        "--max-held",
        "150",
        "--samples",
        "50",
        "--plot",
        plot.to_str().expect("utf-8 path"),
    ]);
    let note = lines
        .iter()
        .find_map(|l| l.get("openfds"))
        .expect("the openfds note");
    // The soft limit was raised to the hard one; 5000 is above the cap and dropped.
    let hard = rustix::process::getrlimit(rustix::process::Resource::Nofile).maximum;
    assert_eq!(note["rlimit_nofile"]["now"].as_u64(), hard, "{note}");
    assert_eq!(note["held"], serde_json::json!([0, 10, 100, 150]), "{note}");
    let records = records(&lines);
    for target in ["local", "engine", "volume"] {
        for held in [0, 10, 100, 150] {
            let r = records
                .iter()
                .find(|r| r["target"] == target && r["params"]["held_open"] == held)
                .unwrap_or_else(|| panic!("no openfds result for {target} at {held}"));
            assert_eq!(r["workload"], "openfds");
            assert_eq!(r["reference"], "local", "{r}");
            assert!(r["ratio"].as_f64().is_some_and(|x| x > 0.0), "{r}");
            assert!(r["ops_per_s"].as_f64().is_some_and(|x| x > 0.0), "{r}");
            assert_latencies(r);
        }
    }
    assert_eq!(records.len(), 12);
    let flatness = lines
        .iter()
        .find_map(|l| l.get("openfds_flatness"))
        .expect("the flatness note");
    for target in ["local", "engine", "volume"] {
        let growth = &flatness[target]["p50_at_max_over_p50_at_min"];
        assert!(growth.as_f64().is_some_and(|x| x > 0.0), "{flatness}");
    }
    assert_plot(&plot);
}

#[test]
fn lookup_scale_workload_reports_every_checkpoint_cold_and_warm() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: kiln-bench lookup-scale needs root (bricks, drop_caches)");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let (plot, png) = (dir.path().join("lookup.svg"), dir.path().join("lookup.png"));
    let lines = run_json(&[
        "lookup-scale",
        "--max-entries",
        "2k",
        "--checkpoints",
        "500,5M",
        "--samples",
        "40",
        "--fanout",
        "100",
        "--seed",
        "7",
        "--plot",
        plot.to_str().expect("utf-8 path"),
        "--plot",
        png.to_str().expect("utf-8 path"),
    ]);
    assert_eq!(lines[0]["environment"]["seed"], 7);
    let note = lines
        .iter()
        .find_map(|l| l.get("lookup_scale"))
        .expect("the lookup_scale note");
    assert_eq!(
        note["checkpoints"],
        serde_json::json!([500, 2000]),
        "{note}"
    );
    // Filling reports each segment: 500 files, then 1500 more.
    let filled: Vec<u64> = lines
        .iter()
        .filter_map(|l| l.get("lookup_scale_populate"))
        .filter_map(|p| p["made"].as_u64())
        .collect();
    assert_eq!(filled, [500, 1500]);
    let records = records(&lines);
    for entries in [500, 2000] {
        for target in ["local", "engine"] {
            for by in ["name", "gfid"] {
                for cache in ["cold", "warm"] {
                    let r = records
                        .iter()
                        .find(|r| {
                            let p = &r["params"];
                            r["target"] == target
                                && p["entries"] == entries
                                && p["by"] == by
                                && p["cache"] == cache
                        })
                        .unwrap_or_else(|| {
                            panic!("no {target} lookup by {by} ({cache}) at {entries}")
                        });
                    assert_eq!(r["workload"], "lookup-scale");
                    assert_eq!(r["reference"], "local", "{r}");
                    assert!(r["ratio"].as_f64().is_some_and(|x| x > 0.0), "{r}");
                    assert_eq!(r["params"]["samples"], 40, "{r}");
                    assert_latencies(r);
                }
            }
        }
    }
    assert_eq!(records.len(), 16);
    assert_plot(&plot);
    assert_plot(&png);
}

#[test]
fn lookup_scale_refuses_a_file_system_without_the_inodes() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: kiln-bench lookup-scale needs root");
        return;
    }
    // A 64 MiB ext4 has 16 384 inodes: far too few for a million entries.
    let out = Command::new(env!("CARGO_BIN_EXE_kiln-bench"))
        .args(["lookup-scale", "--max-entries", "1M", "--loop-fs-mib", "64"])
        .output()
        .expect("run kiln-bench");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--loop-fs-inodes"), "{stderr}");
}

#[test]
fn smallfile_varies_a_brick_option_per_run() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: kiln-bench smallfile needs root (bricks)");
        return;
    }
    let lines = run_json(&[
        "smallfile",
        "--ops",
        "create",
        "--targets",
        "engine,volume",
        "--threads",
        "2",
        "--files",
        "10",
        "--vary",
        "storage.fsync-policy=as-requested,WRITE-THROUGH",
    ]);
    let records = records(&lines);
    let names: Vec<&str> = records
        .iter()
        .filter_map(|r| r["target"].as_str())
        .collect();
    assert_eq!(
        names,
        [
            "engine[storage.fsync-policy=as-requested]",
            "engine[storage.fsync-policy=write-through]",
            "volume[storage.fsync-policy=as-requested]",
            "volume[storage.fsync-policy=write-through]",
        ],
        "one run per value, in canonical form"
    );
    assert!(
        records
            .iter()
            .all(|r| r["reference"] == "engine[storage.fsync-policy=as-requested]")
    );
    for r in &records {
        assert_latencies(r);
    }

    // Options the bench cannot apply, and bad values, are refused as `kiln volume set` would.
    for (vary, says) in [
        (
            "auth.allow=bob",
            "not an option of the bricks kiln-bench starts",
        ),
        ("server.event-threads=1,99", "an integer from 0 to 64"),
        (
            "server.evnt-threads=1",
            "did you mean 'server.event-threads'",
        ),
        ("server.engine", "KEY=VALUE"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kiln-bench"))
            .args(["smallfile", "--targets", "engine", "--vary", vary])
            .output()
            .expect("run kiln-bench");
        assert!(!out.status.success(), "{vary}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{vary}: {err}");
    }
}
