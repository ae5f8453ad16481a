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
