//! One result line: JSON Lines for scripts, an aligned table for people; and the latency
//! histograms the workloads fill (HdrHistogram, nanoseconds, 3 significant digits).

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// One (workload, target, parameters) result. `ratio` is this target's throughput divided by
/// the reference's (operations or bytes per second), so above 1 is faster; for a latency it is
/// the reference's p50 divided by this p50, so above 1 is faster too. A ratio the workload did
/// not compute stays `None` (`"ratio": null`), so it can never pass for a measured 1; the
/// reference's own row sets 1 itself.
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
    pub p90_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p99_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p999_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enters_per_op: Option<f64>,
    pub reference: String,
    pub ratio: Option<f64>,
}

impl Record {
    /// A record with no measurement and no ratio yet.
    pub fn new(workload: &str, target: &str, params: serde_json::Value, reference: &str) -> Record {
        Record {
            workload: workload.into(),
            target: target.into(),
            params,
            ops_per_s: None,
            mib_per_s: None,
            p50_us: None,
            p90_us: None,
            p99_us: None,
            p999_us: None,
            enters_per_op: None,
            reference: reference.into(),
            ratio: None,
        }
    }

    /// Sets p50, p90, p99 and p99.9 from a histogram of nanoseconds.
    pub fn set_latency(&mut self, h: &Histogram<u64>) {
        self.p50_us = Some(micros(h, 0.5));
        self.p90_us = Some(micros(h, 0.9));
        self.p99_us = Some(micros(h, 0.99));
        self.p999_us = Some(micros(h, 0.999));
    }
}

/// A ratio with two decimals, or three significant digits when it is below 0.1 (0.004 is
/// not 0.00); `-` when there is none.
fn ratio_text(ratio: Option<f64>) -> String {
    let Some(ratio) = ratio else {
        return "-".to_owned();
    };
    match ratio.abs() {
        r if r >= 0.1 || r == 0.0 => format!("{ratio:.2}"),
        r => {
            let decimals = (2.0 - r.log10().floor()).clamp(0.0, 12.0) as usize;
            format!("{ratio:.decimals$}")
        }
    }
}

/// An empty latency histogram (nanoseconds, 3 significant digits, growing as needed).
pub fn histogram() -> anyhow::Result<Histogram<u64>> {
    Ok(Histogram::new(3)?)
}

/// The quantile `q` of a histogram of nanoseconds, in microseconds.
pub fn micros(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

/// `d` in nanoseconds, saturating; at least 1 (a histogram cannot hold 0).
pub fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1)
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
                "{:<20} {:<13} {:<36} {:>10} {:>8} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8}  reference",
                "workload",
                "target",
                "params",
                "ops/s",
                "MiB/s",
                "p50 µs",
                "p90 µs",
                "p99 µs",
                "p99.9 µs",
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
            "{:<20} {:<13} {:<36} {:>10} {:>8} {:>9} {:>9} {:>9} {:>9} {:>8} {:>7}x  {}",
            r.workload,
            r.target,
            params,
            opt(r.ops_per_s, 0),
            opt(r.mib_per_s, 0),
            opt(r.p50_us, 1),
            opt(r.p90_us, 1),
            opt(r.p99_us, 1),
            opt(r.p999_us, 1),
            opt(r.enters_per_op, 2),
            ratio_text(r.ratio),
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

/// What the run was, for reproducibility: kernel, cores, file system, version, and the seed
/// of the workloads that make random choices.
pub fn environment(scratch_fs: &str, seed: Option<u64>) -> serde_json::Value {
    let kernel = rustix::system::uname();
    let mut env = serde_json::json!({
        "kiln": env!("CARGO_PKG_VERSION"),
        "kernel": kernel.release().to_string_lossy(),
        "cores": std::thread::available_parallelism().map_or(1, usize::from),
        "scratch_fs": scratch_fs,
        "command": std::env::args().collect::<Vec<_>>().join(" "),
    });
    if let Some(seed) = seed {
        env["seed"] = serde_json::json!(seed);
    }
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_quantiles_are_in_microseconds_and_ordered() {
        let mut h = histogram().expect("histogram");
        for ns in 1..=10_000u64 {
            h.record(ns * 100).expect("record");
        }
        let mut r = Record::new("w", "t", serde_json::json!({}), "t");
        r.set_latency(&h);
        let p50 = r.p50_us.expect("p50");
        assert!((495.0..=505.0).contains(&p50), "p50 {p50}");
        let ps = [r.p50_us, r.p90_us, r.p99_us, r.p999_us].map(|p| p.expect("set"));
        assert!(ps.windows(2).all(|w| w[0] < w[1]), "{ps:?}");
        assert_eq!(nanos(Duration::ZERO), 1);
    }

    #[test]
    fn small_ratios_keep_three_digits() {
        assert_eq!(ratio_text(Some(1.0)), "1.00");
        assert_eq!(ratio_text(Some(0.25)), "0.25");
        assert_eq!(ratio_text(Some(0.0312)), "0.0312");
        assert_eq!(ratio_text(Some(0.004_56)), "0.00456");
        assert_eq!(ratio_text(Some(0.0)), "0.00");
        assert_eq!(ratio_text(None), "-");
    }

    #[test]
    fn absent_fields_are_left_out_of_the_json() {
        let mut r = Record::new("w", "t", serde_json::json!({}), "t");
        r.ratio = Some(1.0);
        let text = serde_json::to_string(&r).expect("json");
        assert!(
            !text.contains("p90_us") && text.contains("\"ratio\":1.0"),
            "{text}"
        );
    }

    #[test]
    fn a_ratio_not_computed_is_null_not_one() {
        let r = Record::new("w", "t", serde_json::json!({}), "u");
        let json: serde_json::Value = serde_json::to_value(&r).expect("json");
        assert_eq!(json.get("ratio"), Some(&serde_json::Value::Null), "{json}");
    }
}
