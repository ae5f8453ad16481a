//! One result line: JSON Lines for scripts, an aligned table for people.

use serde::Serialize;

/// One (workload, target, parameters) result. `ratio` is this target's throughput divided by
/// the reference's, so above 1 is faster.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    pub workload: String,
    pub target: String,
    pub params: serde_json::Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ops_per_s: Option<f64>,
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
                "{:<10} {:<10} {:<28} {:>12} {:>9} {:>9} {:>8} {:>8}",
                "workload", "target", "params", "ops/s", "p50 µs", "p99 µs", "enter/op", "ratio"
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
            "{:<10} {:<10} {:<28} {:>12} {:>9} {:>9} {:>8} {:>7.2}x",
            r.workload,
            r.target,
            params,
            opt(r.ops_per_s, 0),
            opt(r.p50_us, 1),
            opt(r.p99_us, 1),
            opt(r.enters_per_op, 2),
            r.ratio
        );
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
