//! Every workload runs in test mode on tiny sizes, so the benchmarks cannot rot. Nothing here
//! looks at timings; it checks the output has every target, parses, and that every ratio is
//! there and is what the same run's numbers make it (a ratio never computed is `null`).
//!
//! The workloads that format bricks (trusted xattrs), mount FUSE or drop the kernel's caches
//! need root, as CI has; their tests are in [`needs_root`] and fail when not run as root,
//! never pass unrun. To leave them out visibly (counted as filtered out), run
//! `cargo test -p kiln-bench --test smoke -- --skip needs_root::`.

use std::process::Command;

use serde_json::Value;

/// Fails the calling test unless it runs as root: a test that cannot run must not pass.
fn require_root(why: &str) {
    assert!(
        rustix::process::geteuid().is_root(),
        "{why}: this test needs root, as CI has. Run it as root, or leave the root tests out \
         visibly (counted as filtered out): `cargo test -p kiln-bench --test smoke -- --skip \
         needs_root::`"
    );
}

/// A number of a record (or note), which must be there.
fn num(r: &Value, key: &str) -> f64 {
    r[key]
        .as_f64()
        .unwrap_or_else(|| panic!("no number {key:?}: {r}"))
}

/// A record's ratio: computed (not null), finite and above zero.
fn ratio(r: &Value) -> f64 {
    let x = num(r, "ratio");
    assert!(x.is_finite() && x > 0.0, "ratio {x}: {r}");
    x
}

/// A record's ratio is `want`, computed from the same run's numbers (equal up to the
/// rounding of a trip through JSON).
fn assert_ratio(r: &Value, want: f64) {
    let got = ratio(r);
    assert!(
        (got - want).abs() <= 1e-9 * want.abs(),
        "ratio {got}, but the run's numbers make it {want}: {r}"
    );
}

/// The one record that `pred` picks.
fn find<'a>(records: &[&'a Value], what: &str, pred: impl Fn(&Value) -> bool) -> &'a Value {
    let found: Vec<&Value> = records.iter().copied().filter(|r| pred(r)).collect();
    match found[..] {
        [one] => one,
        _ => panic!("{} records for {what}, not one", found.len()),
    }
}

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
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON Lines"))
        .collect();
    assert!(lines[0].get("environment").is_some());
    let records = records(&lines);
    for target in ["std_loop", "blocking", "uring", "uring-ring"] {
        for workload in [
            "engine.create",
            "engine.stat",
            "engine.open_close",
            "engine.unlink",
        ] {
            for depth in [1, 8] {
                assert!(
                    records.iter().any(|r| r["target"] == target
                        && r["workload"] == workload
                        && r["params"]["depth"] == depth),
                    "no {workload} result for {target} at depth {depth}"
                );
            }
        }
    }
    // The layout's own system calls, for the phases the layout adds calls to only.
    for depth in [1, 8] {
        let layout = |workload: &str| {
            records.iter().any(|r| {
                r["target"] == "layout_loop"
                    && r["workload"] == workload
                    && r["params"]["depth"] == depth
            })
        };
        assert!(
            layout("engine.create") && layout("engine.unlink"),
            "depth {depth}"
        );
        assert!(
            !layout("engine.stat") && !layout("engine.open_close"),
            "depth {depth}"
        );
    }
    for target in ["std_loop", "blocking", "uring"] {
        assert!(
            records
                .iter()
                .any(|r| r["target"] == target && r["workload"] == "engine.open_latency"),
            "no open latency result for {target}"
        );
    }
    for r in &records {
        ratio(r);
        assert!(r["reference"].is_string());
    }
    assert_engine_threads(&records);
    // Each engine's rate against the std loop's of its thread count at the same depth.
    for r in records
        .iter()
        .filter(|r| r["workload"] != "engine.open_latency")
    {
        let threads = num(&r["params"], "threads");
        let reference = r["reference"].as_str().expect("reference");
        let std_loop = find(&records, reference, |s| {
            s["workload"] == r["workload"]
                && s["target"] == "std_loop"
                && s["params"]["depth"] == r["params"]["depth"]
                && s["reference"] == reference
        });
        let std_threads = num(&std_loop["params"], "threads");
        assert_eq!(reference, format!("std_loop threads={std_threads}"), "{r}");
        if r["target"] == "std_loop" {
            assert_ratio(r, 1.0);
        } else {
            // One std thread per fop in flight, up to the engine's fop threads.
            let depth = num(&r["params"], "depth");
            assert_eq!(std_threads, depth.min(threads), "{r}");
            assert_ratio(r, num(r, "ops_per_s") / num(std_loop, "ops_per_s"));
        }
    }
    assert_placement_notes(&lines, &[1, 8]);
    // Open latency against the same target's first (fewest files held) p50.
    for target in ["std_loop", "blocking", "uring"] {
        let rows: Vec<&Value> = records
            .iter()
            .copied()
            .filter(|r| r["workload"] == "engine.open_latency" && r["target"] == target)
            .collect();
        let first = num(rows.first().expect("open latency rows"), "p50_us");
        for r in rows {
            let reference = format!("{target} at the smallest held_open");
            assert_eq!(r["reference"], reference.as_str(), "{r}");
            assert_ratio(r, first / num(r, "p50_us"));
        }
    }
    // The ring reports its io_uring_enter calls per fop.
    assert!(
        records
            .iter()
            .any(|r| r["target"] == "uring" && r["enters_per_op"].as_f64().is_some())
    );
}

/// The blocking engine has as many threads as the io_uring engines have in all (workers and
/// blocking pool); every row prints its thread count.
fn assert_engine_threads(records: &[&Value]) {
    let phases = || {
        records
            .iter()
            .filter(|r| r["workload"] != "engine.open_latency")
    };
    let threads_of = |target: &str| {
        let rows: Vec<&&Value> = phases().filter(|r| r["target"] == target).collect();
        let first = rows.first().unwrap_or_else(|| panic!("no {target} rows"));
        let threads = num(&first["params"], "threads");
        assert!(rows.iter().all(|r| num(&r["params"], "threads") == threads));
        (threads, first["params"]["pool_threads"].as_f64())
    };
    let (blocking, no_pool) = threads_of("blocking");
    assert_eq!(no_pool, None);
    for ring in ["uring", "uring-ring"] {
        let (workers, pool) = threads_of(ring);
        let pool = pool.unwrap_or_else(|| panic!("{ring} rows print pool_threads"));
        assert_eq!(workers + pool, blocking, "{ring}");
    }
    assert!(phases().all(|r| num(&r["params"], "threads") >= 1.0));
}

/// One `engine.placement` note per phase and depth, with every target's and the std loops'
/// rates, and where each io_uring target's work ran; with `idle_inline` off nothing runs
/// inline.
fn assert_placement_notes(lines: &[Value], depths: &[u64]) {
    let notes: Vec<&Value> = lines
        .iter()
        .filter_map(|l| l.get("engine.placement"))
        .collect();
    assert_eq!(notes.len(), 4 * depths.len(), "{notes:?}");
    for &depth in depths {
        for op in ["create", "stat", "open_close", "unlink"] {
            let note = notes
                .iter()
                .find(|n| n["op"] == op && n["depth"] == depth)
                .unwrap_or_else(|| panic!("no placement note for {op} at depth {depth}"));
            for target in ["blocking", "uring", "uring-ring"] {
                assert!(num(&note["ops_per_s"], target) > 0.0, "{target}: {note}");
            }
            let rates = note["ops_per_s"].as_object().expect("ops_per_s");
            assert!(
                rates.keys().any(|k| k.starts_with("std_loop threads=")),
                "no std loop: {note}"
            );
            for target in ["uring", "uring-ring"] {
                let per_file = &note["per_file"][target];
                for key in ["inline_chains", "ring_chains", "pool_calls", "enters"] {
                    assert!(num(per_file, key) >= 0.0, "{key}: {note}");
                }
            }
            assert_eq!(num(&note["per_file"]["uring-ring"], "inline_chains"), 0.0);
            assert!(note["per_file"].get("blocking").is_none(), "{note}");
        }
    }
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
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
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
    let records = records(&lines);
    let has = |workload: &str, target: &str, reference: &str| {
        records.iter().any(|r| {
            r["workload"] == workload && r["target"] == target && r["reference"] == reference
        })
    };
    for (workload, target, reference) in [
        ("net.create", "std_loop", "std_loop threads=1"),
        ("net.create", "engine_direct", "std_loop threads=1"),
        ("net.create", "quic", "std_loop threads=1"),
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
    for connections in [1, 4] {
        for cap in [kiln_wire::quic::UDP_PAYLOAD_MAX_BYTES, 1452] {
            for workload in ["net.bulk_write", "net.bulk_read"] {
                assert!(
                    records.iter().any(|r| r["workload"] == workload
                        && r["params"]["udp_payload"] == cap
                        && r["params"]["connections"] == connections),
                    "no {workload} with udp_payload {cap} over {connections} connections"
                );
            }
        }
    }
    let positive = |v: &Value| v.as_f64().is_some_and(|x| x > 0.0);
    for r in &records {
        ratio(r);
        assert!(
            positive(&r["ops_per_s"]) || positive(&r["mib_per_s"]),
            "no rate: {r}"
        );
        if r["workload"] != "net.bulk" {
            assert!(positive(&r["p50_us"]) && positive(&r["p99_us"]), "{r}");
        }
    }
    assert_net_ratios(&records);
}

/// Every net ratio is what the rates (or p50s) of the same run make it.
fn assert_net_ratios(records: &[&Value]) {
    let row = |workload: &str, target: &str| {
        find(records, &format!("{workload} {target}"), |r| {
            r["workload"] == workload && r["target"] == target
        })
    };
    let std_loop = |threads: f64| {
        find(records, &format!("std_loop threads={threads}"), |r| {
            r["workload"] == "net.create"
                && r["target"] == "std_loop"
                && num(&r["params"], "threads") == threads
        })
    };
    for r in records
        .iter()
        .filter(|r| r["workload"] == "net.create" && r["target"] == "std_loop")
    {
        let threads = num(&r["params"], "threads");
        assert_eq!(r["reference"], format!("std_loop threads={threads}"), "{r}");
        assert_ratio(r, 1.0);
    }
    for r in records
        .iter()
        .filter(|r| r["workload"] == "net.create" && r["target"] != "std_loop")
    {
        let concurrency = &r["params"]["concurrency"];
        // One std thread per PUT in flight, up to the engine's fop threads.
        let std_threads = num(&r["params"], "threads").min(num(&r["params"], "concurrency"));
        assert!(num(&r["params"], "client_threads") >= 1.0, "{r}");
        let reference = match r["reference"].as_str() {
            Some(name) if name.starts_with("std_loop") => {
                assert_eq!(name, format!("std_loop threads={std_threads}"), "{r}");
                std_loop(std_threads)
            }
            Some("engine_direct") => find(records, "net.create engine_direct", |d| {
                d["workload"] == "net.create"
                    && d["target"] == "engine_direct"
                    && d["params"]["concurrency"] == *concurrency
            }),
            _ => panic!("unexpected reference: {r}"),
        };
        assert_ratio(r, num(r, "ops_per_s") / num(reference, "ops_per_s"));
    }
    let (tcp, quic) = (row("net.ping", "tcp"), row("net.ping", "quic"));
    assert_ratio(tcp, 1.0);
    assert_ratio(quic, num(tcp, "p50_us") / num(quic, "p50_us"));
    // Each bulk row against the TCP copy over as many connections.
    for r in records
        .iter()
        .filter(|r| r["workload"] == "net.bulk_write" || r["workload"] == "net.bulk_read")
    {
        let connections = &r["params"]["connections"];
        let tcp = find(records, &format!("net.bulk tcp {connections}"), |t| {
            t["workload"] == "net.bulk" && t["params"]["connections"] == *connections
        });
        assert_eq!(tcp["target"], "tcp", "{tcp}");
        assert_ratio(tcp, 1.0);
        assert_ratio(r, num(r, "mib_per_s") / num(tcp, "mib_per_s"));
    }
}

/// Set (the test command sets it) to fail where the mgmt run has no `gluster volume set` row.
const REQUIRE_GLUSTERFS_ENV: &str = "KILN_REQUIRE_GLUSTERFS";

/// The mgmt workload on its embedded store with the `gluster volume set` comparison (its row
/// required with `KILN_REQUIRE_GLUSTERFS`, else only where the run set GlusterFS up), then
/// on etcd without it (`--no-glusterfs`, to keep the test short; skipped with a note where
/// etcd is not installed, unless `KILN_REQUIRE_ETCD` is set).
#[test]
fn mgmt_workload_runs_and_reports_every_target() {
    let lines = run_json(&["mgmt", "--sets", "20"]);
    assert_mgmt_run(&lines, "embedded");
    assert_gluster_row(&lines);
    let test = "mgmt_workload_runs_and_reports_every_target --store etcd";
    if kiln_mgmt::etcd_server::etcd_for_test(test).is_some() {
        let lines = run_json(&["mgmt", "--sets", "20", "--store", "etcd", "--no-glusterfs"]);
        let etcd = lines
            .iter()
            .find_map(|l| l.get("etcd"))
            .expect("the etcd note");
        assert!(etcd["endpoint"].is_string(), "{etcd}");
        assert_mgmt_run(&lines, "etcd");
        let records = records(&lines);
        assert!(!records.iter().any(|r| r["target"] == "gluster-cli"));
        let gluster = lines.iter().find_map(|l| l.get("gluster"));
        let note = gluster.and_then(|g| g["note"].as_str()).unwrap_or_default();
        assert!(
            note.contains("--no-glusterfs") || note.contains("not found"),
            "{gluster:?}"
        );
    }
}

/// The `gluster-cli` row, where the run has one (it must with `KILN_REQUIRE_GLUSTERFS`):
/// compared with the same run's `kiln-cli` p50s, and GlusterFS torn down after it.
fn assert_gluster_row(lines: &[Value]) {
    let records = records(lines);
    let Some(gluster) = records.iter().find(|r| r["target"] == "gluster-cli") else {
        let note = lines.iter().find_map(|l| l.get("gluster"));
        assert!(
            std::env::var_os(REQUIRE_GLUSTERFS_ENV).is_none(),
            "{REQUIRE_GLUSTERFS_ENV} is set, but the mgmt run has no gluster-cli row: {note:?}"
        );
        eprintln!("mgmt: no gluster-cli row: {note:?}");
        return;
    };
    // Its ratio against the floor is checked with every row's in `assert_mgmt_run`.
    assert_eq!(gluster["workload"], "mgmt.set", "{gluster}");
    assert_eq!(gluster["reference"], "append_fdatasync", "{gluster}");
    assert_eq!(num(&gluster["params"], "sets"), 20.0, "{gluster}");
    let p50 = num(gluster, "p50_us");
    for (key, target) in [
        ("kiln_cli_vs_gluster", "kiln-cli"),
        ("kiln_cli_started_vs_gluster", "kiln-cli-started"),
    ] {
        let kiln = find(&records, target, |r| r["target"] == target);
        let want = p50 / num(kiln, "p50_us");
        let got = num(&gluster["params"], key);
        assert!(
            (got - want).abs() <= 1e-9 * want,
            "{key} {got}, but the run's p50s make it {want}: {gluster}"
        );
    }
    let teardown = lines
        .iter()
        .find_map(|l| l.get("gluster_teardown"))
        .expect("the GlusterFS teardown note");
    assert_eq!(teardown["stop"], "ok", "{teardown}");
    assert_eq!(teardown["delete"], "ok", "{teardown}");
}

/// One mgmt run on `store` reported every target, each row naming the store, with ratios
/// the run's own numbers make, and stopped its daemon and brick cleanly.
fn assert_mgmt_run(lines: &[Value], store: &str) {
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
    assert_eq!(stop["volume_stopped_first"], store == "etcd", "{stop}");
    let records = records(lines);
    for (workload, target) in [
        ("mgmt.floor", "append_fdatasync"),
        ("mgmt.floor", "replace_fsync"),
        ("mgmt.commit", "store"),
        ("mgmt.commit", "store_group"),
        ("mgmt.spawn", "true"),
        ("mgmt.spawn", "kiln-version"),
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
    let positive = |v: &Value| v.as_f64().is_some_and(|x| x > 0.0);
    let floor_p50 = |name: &str| {
        let floor = find(&records, name, |r| {
            r["workload"] == "mgmt.floor" && r["target"] == name
        });
        num(floor, "p50_us")
    };
    // Both floors write the bytes of one store commit.
    let note = lines
        .iter()
        .find_map(|l| l.get("mgmt"))
        .expect("the mgmt note");
    assert_eq!(note["store"]["kind"], store, "{note}");
    let bytes = num(&note["store"], "bytes_per_commit");
    assert!(bytes > 0.0);
    for r in &records {
        assert_eq!(r["params"]["store"], store, "{r}");
        assert!(positive(&r["ops_per_s"]), "{r}");
        assert!(positive(&r["p50_us"]) && positive(&r["p99_us"]), "{r}");
        let reference = r["reference"].as_str().expect("reference");
        // Latency against the floor's p50; the group's throughput against one fsync each.
        match r["target"].as_str() {
            Some(floor @ ("append_fdatasync" | "replace_fsync")) => {
                assert_eq!(reference, floor, "{r}");
                assert_eq!(num(&r["params"], "bytes"), bytes, "{r}");
                assert_ratio(r, 1.0);
            }
            Some("store_group") => {
                assert_ratio(r, num(r, "ops_per_s") * floor_p50(reference) / 1e6);
            }
            _ => assert_ratio(r, floor_p50(reference) / num(r, "p50_us")),
        }
    }
    // The store's rows against each floor; the CLI's against the append.
    for target in ["store", "store_group"] {
        for floor in ["append_fdatasync", "replace_fsync"] {
            find(&records, &format!("{target} against {floor}"), |r| {
                r["target"] == target && r["reference"] == floor
            });
        }
    }
    for target in ["true", "kiln-version", "kiln-cli", "kiln-cli-started"] {
        let r = find(&records, target, |r| r["target"] == target);
        assert_eq!(r["reference"], "append_fdatasync", "{r}");
    }
    // The group run reports the embedded store's own fsync count (etcd's are not seen: null),
    // and the started run's sets reached the brick.
    let group = records
        .iter()
        .find(|r| r["target"] == "store_group")
        .expect("store_group");
    let fsyncs = &group["params"]["fsyncs"];
    match store {
        "etcd" => assert!(fsyncs.is_null(), "{group}"),
        _ => assert!(fsyncs.as_u64().is_some_and(|f| f >= 1), "{group}"),
    }
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

/// Runs kiln-bench with `args` (plus `--json`); returns its JSON lines, failing on a non-zero
/// exit or output that is not JSON Lines.
fn run_json(args: &[&str]) -> Vec<Value> {
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

fn records(lines: &[Value]) -> Vec<&Value> {
    lines
        .iter()
        .filter(|l| l.get("workload").is_some())
        .collect()
}

/// Every latency quantile is there, above zero and in order.
fn assert_latencies(r: &Value) {
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

/// Every ratio is the record's ops/s over the ops/s of `reference` (the target listed first)
/// for the same workload.
fn assert_ratios_against_first(records: &[&Value], reference: &str) {
    for r in records {
        assert_eq!(r["reference"], reference, "{r}");
        let workload = &r["workload"];
        let first = find(records, &format!("{workload} on {reference}"), |x| {
            x["workload"] == *workload && x["target"] == reference
        });
        assert_ratio(r, num(r, "ops_per_s") / num(first, "ops_per_s"));
    }
}

/// The tests of the workloads that need root: they fail when not run as root.
mod needs_root {
    use super::*;

    #[test]
    fn rebalance_workload_moves_files_and_reports_a_ratio() {
        require_root("kiln-bench rebalance formats bricks (trusted xattrs)");
        let lines = run_json(&["rebalance", "--files", "200", "--dirs", "5"]);
        let records = records(&lines);
        let reference = find(&records, "the reference", |r| {
            r["target"] == "std_copy_unlink"
        });
        let kiln = find(&records, "kiln", |r| r["target"] == "kiln");
        assert_ratio(reference, 1.0);
        assert_ratio(kiln, num(kiln, "ops_per_s") / num(reference, "ops_per_s"));
        let moved = lines
            .iter()
            .find_map(|l| l.get("rebalance_kiln"))
            .expect("the rebalance_kiln note");
        assert!(num(moved, "moved") > 0.0, "{moved}");
        assert_eq!(
            num(moved, "moved"),
            num(&reference["params"], "files"),
            "{moved}"
        );
        assert_eq!(
            (num(moved, "skipped"), num(moved, "failed")),
            (0.0, 0.0),
            "{moved}"
        );
        assert_eq!(num(moved, "files_read_back"), 200.0, "{moved}");
    }

    #[test]
    fn mount_workload_runs_and_reports_every_phase() {
        require_root("kiln-bench mount mounts FUSE and drops the kernel's caches");
        let out = Command::new(env!("CARGO_BIN_EXE_kiln-bench"))
            .args([
                "mount",
                "--files",
                "200",
                "--dirs",
                "20",
                "--targets",
                "local,kiln",
                "--mails",
                "60",
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
        let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
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
        let records = records(&lines);
        let positive = |v: &Value| v.as_f64().is_some_and(|x| x > 0.0);
        // Every file of the tree is in the repository (fewer than --git-files).
        let repo = lines
            .iter()
            .find_map(|l| l.get("git_repo"))
            .expect("the git_repo note");
        assert_eq!(repo["files"], 200, "{repo}");
        for workload in [
            "mount.untar",
            "mount.stat",
            "mount.ls_lR",
            "mount.read",
            "mount.git_clone",
            "mount.mail_deliver",
            "mount.mail_read",
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
                    .unwrap_or_else(|| {
                        panic!("no {workload} result for {target} against {reference}")
                    });
                assert!(positive(&r["ops_per_s"]), "{r}");
                assert!(positive(&r["params"]["seconds"]), "{r}");
            }
            // Reference seconds over these seconds: the files/s of both, in the same ratio.
            let row = |target: &str| {
                find(&records, &format!("{workload} {target}"), |r| {
                    r["workload"] == workload && r["target"] == target
                })
            };
            let (local, kiln) = (row("local"), row("kiln"));
            assert_ratio(local, 1.0);
            assert_ratio(kiln, num(kiln, "ops_per_s") / num(local, "ops_per_s"));
        }
        // Every phase is summarized with Kiln's slowdown (the inverse of its ratio, to two
        // decimals), and the Kiln mount and its brick stopped cleanly.
        let summaries: Vec<&Value> = lines
            .iter()
            .filter_map(|l| l.get("mount_summary"))
            .collect();
        assert_eq!(summaries.len(), 8);
        for summary in summaries {
            let phase = summary["phase"].as_str().expect("phase");
            let workload = format!("mount.{phase}");
            let kiln = find(&records, &workload, |r| {
                r["workload"] == workload.as_str() && r["target"] == "kiln"
            });
            let slowdown = num(summary, "kiln_over_local");
            assert!(
                (slowdown - 1.0 / ratio(kiln)).abs() <= 0.005 + 1e-9,
                "{summary} against {kiln}"
            );
        }
        // The clone's files are the repository's; rm removed the tree and the clone.
        let files = |workload: &str| {
            let r = find(&records, workload, |r| {
                r["workload"] == workload && r["target"] == "local"
            });
            num(&r["params"], "files")
        };
        assert_eq!(files("mount.git_clone"), 200.0);
        assert_eq!(files("mount.mail_deliver"), 60.0);
        assert_eq!(files("mount.mail_read"), 60.0);
        assert!(
            files("mount.rm") > 460.0,
            "the clone's .git and the mails are removed too"
        );
        // Every Kiln phase has the brick's fops, what is sent alone a part of them; the
        // untar costs at least one fop per file, and at most one PUT.
        let fops: Vec<&Value> = lines.iter().filter_map(|l| l.get("mount_fops")).collect();
        assert_eq!(fops.len(), 8, "{fops:?}");
        for note in &fops {
            assert!(note.get("error").is_none(), "{note}");
            assert!(
                num(note, "alone_fops_per_file") <= num(note, "fops_per_file"),
                "{note}"
            );
        }
        let untar = fops
            .iter()
            .find(|n| n["phase"] == "untar")
            .expect("untar fops");
        assert!(num(untar, "fops_per_file") >= 1.0, "{untar}");
        assert!(untar["fops"]["PUT"].as_u64().unwrap_or(0) <= 200, "{untar}");
        // Counted as git ends: the unmeasured count of the checkout after it lists every
        // directory git made; git itself lists hardly any.
        let clone = fops
            .iter()
            .find(|n| n["phase"] == "git_clone")
            .expect("git_clone fops");
        let count = |code: &str| clone["fops"][code].as_u64().unwrap_or(0);
        assert!(count("OPENDIR_LIST") < count("MKDIR"), "{clone}");
        // Each mail, fsynced before its close, is made and synced by one PUT_SYNCED.
        let deliver = fops
            .iter()
            .find(|n| n["phase"] == "mail_deliver")
            .expect("mail_deliver fops");
        let count = |code: &str| deliver["fops"][code].as_u64().unwrap_or(0);
        assert_eq!(count("PUT_SYNCED"), 60, "{deliver}");
        assert_eq!(
            count("FSYNC") + count("OPEN") + count("PUT"),
            0,
            "{deliver}"
        );
        let goals = lines
            .iter()
            .filter(|l| l.get("mount_goal").is_some())
            .count();
        assert_eq!(goals, 4);
        let stop = lines
            .iter()
            .filter_map(|l| l.get("mount_stop"))
            .find(|s| s["target"] == "kiln")
            .expect("the kiln stop note");
        assert_eq!(stop["unmount"]["status"], "exit status: 0", "{stop}");
        let brickds = stop["brickds"]
            .as_array()
            .expect("the brick servers' stops");
        assert!(!brickds.is_empty(), "{stop}");
        assert!(brickds.iter().all(|b| b["sigkill"] == false), "{stop}");
    }

    /// MooseFS and JuiceFS as `kiln-bench mount` sets them up (installed by
    /// `scripts/test-tools`; `juicefs` in `target/tools/bin`): every phase measured on both,
    /// and both stopped cleanly.
    #[test]
    fn mount_workload_runs_on_moosefs_and_juicefs() {
        require_root("kiln-bench mount mounts FUSE and drops the kernel's caches");
        let exe = std::env::current_exe().expect("test executable");
        let tools = exe.ancestors().nth(3).expect("target/<profile>/deps/<exe>");
        let path = std::env::join_paths(std::iter::once(tools.join("tools").join("bin")).chain(
            std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
        ))
        .expect("PATH");
        let out = Command::new(env!("CARGO_BIN_EXE_kiln-bench"))
            .args([
                "mount",
                "--files",
                "100",
                "--dirs",
                "10",
                "--git-files",
                "50",
            ])
            .args([
                "--mails",
                "20",
                "--targets",
                "local,moosefs,juicefs",
                "--json",
            ])
            .env("PATH", path)
            .output()
            .expect("run kiln-bench");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let lines: Vec<Value> = stdout
            .lines()
            .map(|l| serde_json::from_str(l).expect("JSON Lines"))
            .collect();
        let skipped: Vec<&Value> = lines.iter().filter_map(|l| l.get("skipped")).collect();
        assert!(skipped.is_empty(), "{skipped:?}");
        let records = records(&lines);
        for phase in [
            "untar",
            "stat",
            "ls_lR",
            "read",
            "git_clone",
            "mail_deliver",
            "mail_read",
            "rm",
        ] {
            let workload = format!("mount.{phase}");
            for target in ["moosefs", "juicefs"] {
                let r = find(&records, &format!("{workload} {target}"), |r| {
                    r["workload"] == workload.as_str()
                        && r["target"] == target
                        && r["reference"] == "local"
                });
                assert!(num(r, "ops_per_s") > 0.0, "{r}");
            }
        }
        for target in ["moosefs", "juicefs"] {
            let stop = lines
                .iter()
                .filter_map(|l| l.get("mount_stop"))
                .find(|s| s["target"] == target)
                .unwrap_or_else(|| panic!("no {target} stop note"));
            assert_eq!(stop["unmount"]["status"], "exit status: 0", "{stop}");
        }
    }

    #[test]
    fn smallfile_workload_runs_every_op_on_every_target() {
        require_root("kiln-bench smallfile formats bricks (trusted xattrs) and mounts FUSE");
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
            // Four writes per create and append (read checks every byte arrived).
            "--record-bytes",
            "300",
            "--targets",
            &targets,
            "--plot",
            plot.to_str().expect("utf-8 path"),
        ]);
        assert_eq!(lines[0]["environment"]["seed"], 0x736d_616c_6c66_u64);
        let note = lines.iter().find_map(|l| l.get("smallfile"));
        assert_eq!(note.expect("the smallfile note")["record_bytes"], 300);
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
                assert!(r["ops_per_s"].as_f64().is_some_and(|x| x > 0.0), "{r}");
                assert_latencies(r);
                if target == "local" {
                    assert_eq!(r["ratio"], 1.0, "{r}");
                }
            }
        }
        assert_ratios_against_first(&records, "local");
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
        assert_eq!(mount["stopped"]["brickds"][0]["sigkill"], false, "{mount}");
        assert_eq!(mount["fs"], "fuse", "{mount}");
    }

    #[test]
    fn smallfile_sets_up_missing_preconditions_unmeasured() {
        require_root("kiln-bench smallfile formats bricks (trusted xattrs)");
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
        assert_ratios_against_first(&records, "engine");
    }

    #[test]
    fn openfds_workload_sweeps_every_target_up_to_the_cap() {
        require_root("kiln-bench openfds formats bricks (trusted xattrs)");
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
        let p50_at = |target: &str, held: u64| {
            let r = find(&records, &format!("openfds {target} at {held}"), |r| {
                r["target"] == target && r["params"]["held_open"] == held
            });
            num(r, "p50_us")
        };
        for target in ["local", "engine", "volume"] {
            for held in [0, 10, 100, 150] {
                let r = records
                    .iter()
                    .find(|r| r["target"] == target && r["params"]["held_open"] == held)
                    .unwrap_or_else(|| panic!("no openfds result for {target} at {held}"));
                assert_eq!(r["workload"], "openfds");
                assert_eq!(r["reference"], "local", "{r}");
                assert!(r["ops_per_s"].as_f64().is_some_and(|x| x > 0.0), "{r}");
                assert_latencies(r);
                // Local's p50 with as many files held over this p50.
                let local = p50_at("local", held);
                assert_ratio(r, local / num(r, "p50_us"));
            }
        }
        assert_eq!(records.len(), 12);
        let flatness = lines
            .iter()
            .find_map(|l| l.get("openfds_flatness"))
            .expect("the flatness note");
        // Each target's p50 with the most files held over its p50 with the fewest, to two
        // decimals.
        for target in ["local", "engine", "volume"] {
            let growth = num(&flatness[target], "p50_at_max_over_p50_at_min");
            let measured = p50_at(target, 150) / p50_at(target, 0);
            assert!(
                (growth - measured).abs() <= 0.005 + 1e-9,
                "{flatness}: {target} grew {measured}"
            );
        }
        assert_plot(&plot);
    }

    #[test]
    fn lookup_scale_workload_reports_every_checkpoint_cold_and_warm() {
        require_root("kiln-bench lookup-scale formats bricks and drops the kernel's caches");
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
                        assert_eq!(r["params"]["samples"], 40, "{r}");
                        assert_latencies(r);
                        // Local's p50 for the same lookups over this p50.
                        let local = find(&records, "the local lookups", |x| {
                            x["target"] == "local" && x["params"] == r["params"]
                        });
                        assert_ratio(r, num(local, "p50_us") / num(r, "p50_us"));
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
        require_root("kiln-bench lookup-scale --loop-fs-mib mounts a loop file system");
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
        require_root("kiln-bench smallfile formats bricks (trusted xattrs)");
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
        assert_ratios_against_first(&records, "engine[storage.fsync-policy=as-requested]");
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
}
