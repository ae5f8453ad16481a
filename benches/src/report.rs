//! One result line: JSON Lines for scripts, an aligned table for people.

use serde::Serialize;

/// One (workload, target, parameters) result. `ratio` is this target's throughput divided by
/// the reference's (operations or bytes per second), so above 1 is faster; for a latency it is
/// the reference's p50 divided by this p50, so above 1 is faster too.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    pub workload: String,
    pub target: String,
    pub params: serde_json::Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ops_per_s: Option<f64>,
    /// Throughput of bulk transfers, in MiB (2^20 bytes) per second.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mib_per_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p50_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p99_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enters_per_op: Option<f64>,
    pub reference: String,
    pub ratio: f64,
}

/// Prints records as they come: JSON Lines, or table rows after a header.
#[derive(Debug)]
pub struct Reporter {
    json: bool,
    header_printed: bool,
}

impl Reporter {
    pub fn new(json: bool) -> Reporter {
        Reporter {
            json,
            header_printed: false,
        }
    }

    pub fn print(&mut self, r: &Record) {
        if self.json {
            println!("{}", serde_json::to_string(r).unwrap_or_default());
            return;
        }
        if !self.header_printed {
            println!(
                "{:<16} {:<13} {:<36} {:>10} {:>8} {:>9} {:>9} {:>8} {:>8}  reference",
                "workload",
                "target",
                "params",
                "ops/s",
                "MiB/s",
                "p50 µs",
                "p99 µs",
                "enter/op",
                "ratio"
            );
            self.header_printed = true;
        }
        let opt = |v: Option<f64>, prec: usize| v.map_or("-".to_owned(), |v| format!("{v:.prec$}"));
        let params = r.params.as_object().map_or(String::new(), |o| {
            o.iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(" ")
        });
        println!(
            "{:<16} {:<13} {:<36} {:>10} {:>8} {:>9} {:>9} {:>8} {:>7.2}x  {}",
            r.workload,
            r.target,
            params,
            opt(r.ops_per_s, 0),
            opt(r.mib_per_s, 0),
            opt(r.p50_us, 1),
            opt(r.p99_us, 1),
            opt(r.enters_per_op, 2),
            r.ratio,
            r.reference
        );
    }

    /// Prints a line that is not a result (a workload's set-up, a counter worth knowing):
    /// `{"key": value}` in JSON Lines, `# key: value` in the table.
    pub fn note(&mut self, key: &str, value: &serde_json::Value) {
        if self.json {
            println!("{}", serde_json::json!({ key: value }));
        } else {
            println!("# {key}: {value}");
        }
    }
}

/// What the run was, for reproducibility: kernel, cores, file system, version.
pub fn environment(scratch_fs: &str) -> serde_json::Value {
    let kernel = rustix::system::uname();
    serde_json::json!({
        "kiln": env!("CARGO_PKG_VERSION"),
        "kernel": kernel.release().to_string_lossy(),
        "cores": std::thread::available_parallelism().map_or(1, usize::from),
        "scratch_fs": scratch_fs,
        "command": std::env::args().collect::<Vec<_>>().join(" "),
    })
}
