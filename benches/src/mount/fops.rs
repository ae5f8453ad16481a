//! What the Kiln target's brick did during a phase: its fop profile (`--count-fop-hits
//! --latency-measurement`, the counters `kiln volume profile` shows), read on its control
//! socket just before and just after the phase, and the difference per file.
//!
//! The profile counts every fop the brick served, each fop of a BATCH as one; it does not
//! count the BATCH requests themselves. So the round trips of a phase lie between the fops
//! the mount only ever sends alone (each is a request of its own) and all fops (each would
//! be one if no BATCH carried several); the note gives both per file. The brick's busy time
//! is the sum of its per-fop latencies (count × mean of each histogram, within 1%).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, bail};
use kiln_admin::control::{ControlAnswer, ControlRequest, EXCHANGE, ProfileReport};
use kiln_wire::FopCode;
use serde_json::json;

use super::round;

/// The fops the Kiln mount may send inside a BATCH: the changes it queues behind a write
/// lease (makes, removals, renames, SETATTR, a small file's PUT) and LEASE, which rides with
/// the MKDIR that made its directory. Every other fop goes as a request of its own.
const MAY_RIDE_IN_A_BATCH: [FopCode; 10] = [
    FopCode::Mknod,
    FopCode::Mkdir,
    FopCode::Symlink,
    FopCode::Link,
    FopCode::Unlink,
    FopCode::Rmdir,
    FopCode::Rename,
    FopCode::Setattr,
    FopCode::Put,
    FopCode::Lease,
];

/// The brick's counters at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct FopCounts {
    /// Calls by fop name.
    calls: BTreeMap<String, u64>,
    errors: u64,
    /// Sum of the timed fops' latencies, in µs.
    busy_us: f64,
}

impl FopCounts {
    /// Reads the profile of the brick behind `socket`.
    pub(super) fn read(socket: &Path) -> anyhow::Result<FopCounts> {
        let answer: ControlAnswer = EXCHANGE
            .ask_blocking(socket, &ControlRequest::Profile)
            .with_context(|| format!("cannot read the brick profile on {}", socket.display()))?;
        match answer {
            ControlAnswer::Profile { profile, .. } => FopCounts::of(&profile),
            other => bail!("the brick answered {other:?} to a profile request"),
        }
    }

    fn of(profile: &ProfileReport) -> anyhow::Result<FopCounts> {
        if !profile.counting {
            bail!("the brick does not count its fops (no --count-fop-hits)");
        }
        let mut counts = FopCounts::default();
        for fop in &profile.fops {
            counts.calls.insert(fop.fop.clone(), fop.calls);
            counts.errors += fop.errors;
            if let Some(latency) = &fop.latency {
                counts.busy_us += latency.count as f64 * latency.avg_us;
            }
        }
        Ok(counts)
    }

    /// What was served between `before` and `self`, as the phase's note: fops by name,
    /// totals, and per file (`files` of the phase) the bounds of the round trips.
    pub(super) fn since(&self, before: &FopCounts, files: u64, seconds: f64) -> serde_json::Value {
        let mut fops = BTreeMap::new();
        let (mut total, mut alone) = (0u64, 0u64);
        for (name, &after) in &self.calls {
            let n = after.saturating_sub(before.calls.get(name).copied().unwrap_or(0));
            if n == 0 {
                continue;
            }
            fops.insert(name.clone(), n);
            total += n;
            if !MAY_RIDE_IN_A_BATCH.iter().any(|f| f.name() == name) {
                alone += n;
            }
        }
        let per_file = |n: u64| round(n as f64 / files.max(1) as f64);
        json!({
            "files": files,
            "fops": fops,
            "fops_total": total,
            "fop_errors": self.errors.saturating_sub(before.errors),
            "fops_per_file": per_file(total),
            "alone_fops_per_file": per_file(alone),
            "brick_busy_s": round((self.busy_us - before.busy_us).max(0.0) / 1e6),
            "phase_s": round(seconds),
        })
    }
}

#[cfg(test)]
mod tests {
    use kiln_admin::control::{FopProfile, LatencySummary};

    use super::*;

    fn fop(name: &str, calls: u64, avg_us: f64) -> FopProfile {
        FopProfile {
            fop: name.to_owned(),
            calls,
            errors: calls / 10,
            bytes: 0,
            steps: 0,
            sqes: 0,
            pool_jobs: 0,
            intents: 0,
            latency: Some(LatencySummary {
                count: calls,
                avg_us,
                min_us: 0.0,
                max_us: 0.0,
                p50_us: 0.0,
                p90_us: 0.0,
                p99_us: 0.0,
                p999_us: 0.0,
            }),
        }
    }

    fn report(fops: Vec<FopProfile>) -> ProfileReport {
        ProfileReport {
            counting: true,
            timing: true,
            counting_for_s: 1.0,
            timing_for_s: 1.0,
            fops,
            errors: BTreeMap::new(),
        }
    }

    #[test]
    fn a_phase_is_the_difference_and_batched_fops_bound_the_round_trips() {
        let before = FopCounts::of(&report(vec![fop("LOOKUP", 10, 5.0)])).expect("counting");
        let after = FopCounts::of(&report(vec![
            fop("LOOKUP", 30, 5.0),
            fop("PUT", 20, 50.0),
            fop("GETXATTR", 10, 2.0),
        ]))
        .expect("counting");
        let note = after.since(&before, 20, 1.5);
        assert_eq!(
            note["fops"],
            json!({ "LOOKUP": 20, "PUT": 20, "GETXATTR": 10 })
        );
        assert_eq!(note["fops_total"], 50);
        // Errors: (3 + 2 + 1) after, 1 before.
        assert_eq!(note["fop_errors"], 5);
        assert_eq!(note["fops_per_file"], 2.5);
        // LOOKUP and GETXATTR are requests of their own; PUT may ride in a BATCH.
        assert_eq!(note["alone_fops_per_file"], 1.5);
        // (30·5 + 20·50 + 10·2 − 10·5) µs.
        assert_eq!(note["brick_busy_s"], 0.0011);
    }

    #[test]
    fn a_brick_that_does_not_count_is_an_error() {
        let mut off = report(vec![]);
        off.counting = false;
        assert!(FopCounts::of(&off).is_err());
    }
}
