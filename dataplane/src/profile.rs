//! The brick's per-fop profile: calls, errors, bytes, executor steps and intent commits per
//! fop, errors by errno, and a latency histogram per fop. `diagnostics.count-fop-hits` turns
//! the counters on, `diagnostics.latency-measurement` the histograms; both switch live, and a
//! switch from off to on starts that part afresh (this is `kiln volume profile VOL start`).
//!
//! One [`Profile`] is shared by every worker of a brick. Counters are relaxed atomics (a
//! reader sees each one exact, not all of them at one instant); a histogram is an
//! HdrHistogram behind its fop's own mutex, allocated at the fop's first timed call. Off, a
//! fop pays two relaxed loads ([`Profile::is_on`], checked by the caller).

use std::cell::Cell;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use kiln_admin::control::{FopProfile, LatencySummary, ProfileReport};
use kiln_wire::{ErrorCode, FopCode, FopReply, FopRequest, PutSynced};
use rustix::io::Errno;

/// Longest latency a histogram holds, in nanoseconds (one hour); longer calls count as this.
const LATENCY_MAX_NS: u64 = 3_600_000_000_000;
/// Significant decimal digits of a histogram: values are kept within 1%.
const LATENCY_SIGFIG: u8 = 2;

/// What one fop cost, gathered while it runs (see [`Profile::measure`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct Cost {
    /// Steps of the fop's chains (one syscall's worth each, wherever it runs).
    pub steps: u64,
    /// Of those, the ones submitted to io_uring as SQEs.
    pub sqes: u64,
    /// Calls run on the blocking pool (those with no io_uring opcode).
    pub pool_jobs: u64,
    /// Namespace chains committed through an intent record.
    pub intents: u64,
}

tokio::task_local! {
    /// The cost of the fop the current task runs, when counting is on.
    static COST: Cell<Cost>;
}

/// Adds to the running fop's cost; nothing when counting is off or outside a fop.
pub fn charge(f: impl FnOnce(&mut Cost)) {
    let _ = COST.try_with(|cell| {
        let mut cost = cell.get();
        f(&mut cost);
        cell.set(cost);
    });
}

#[derive(Debug, Default)]
struct FopCounters {
    calls: AtomicU64,
    errors: AtomicU64,
    /// Data bytes moved: read for READ, written for WRITE and PUT.
    bytes: AtomicU64,
    steps: AtomicU64,
    sqes: AtomicU64,
    pool_jobs: AtomicU64,
    intents: AtomicU64,
    latency: Mutex<Option<Histogram<u64>>>,
}

/// Per-fop counters and histograms of one brick.
#[derive(Debug)]
pub struct Profile {
    counting: AtomicBool,
    timing: AtomicBool,
    fops: Box<[FopCounters]>,
    errors: Box<[AtomicU64]>,
    /// When counting and timing were last switched on.
    since: Mutex<(Instant, Instant)>,
}

impl Default for Profile {
    fn default() -> Profile {
        let now = Instant::now();
        Profile {
            counting: AtomicBool::new(false),
            timing: AtomicBool::new(false),
            fops: FopCode::ALL
                .iter()
                .map(|_| FopCounters::default())
                .collect(),
            errors: ErrorCode::ALL.iter().map(|_| AtomicU64::new(0)).collect(),
            since: Mutex::new((now, now)),
        }
    }
}

/// Data bytes a reply carries (a READ's data).
pub trait DataBytes {
    fn data_bytes(&self) -> u64;
}

impl DataBytes for FopReply {
    fn data_bytes(&self) -> u64 {
        match self {
            FopReply::Read(r) => r.data.len() as u64,
            _ => 0,
        }
    }
}

/// Data bytes a request carries (a WRITE's or PUT's data).
pub fn request_bytes(fop: &FopRequest) -> u64 {
    match fop {
        FopRequest::Write(w) => w.data.len() as u64,
        FopRequest::Put(p) | FopRequest::PutSynced(PutSynced { put: p }) => p.data.len() as u64,
        _ => 0,
    }
}

impl Profile {
    /// Switches counting and timing; a part switched on from off starts from zero.
    pub fn set(&self, counting: bool, timing: bool) {
        let mut since = self.since.lock().unwrap_or_else(|e| e.into_inner());
        if counting && !self.counting.load(Relaxed) {
            for fop in &self.fops {
                for c in [
                    &fop.calls,
                    &fop.errors,
                    &fop.bytes,
                    &fop.steps,
                    &fop.sqes,
                    &fop.pool_jobs,
                    &fop.intents,
                ] {
                    c.store(0, Relaxed);
                }
            }
            for e in &self.errors {
                e.store(0, Relaxed);
            }
            since.0 = Instant::now();
        }
        if timing && !self.timing.load(Relaxed) {
            for fop in &self.fops {
                *fop.latency.lock().unwrap_or_else(|e| e.into_inner()) = None;
            }
            since.1 = Instant::now();
        }
        self.counting.store(counting, Relaxed);
        self.timing.store(timing, Relaxed);
    }

    /// Whether counting or timing is on.
    pub fn is_on(&self) -> bool {
        self.counting() || self.timing()
    }

    pub fn counting(&self) -> bool {
        self.counting.load(Relaxed)
    }

    pub fn timing(&self) -> bool {
        self.timing.load(Relaxed)
    }

    /// Runs `call`, fop `code`, and records it as the switches say.
    pub async fn measure<T: DataBytes>(
        &self,
        code: FopCode,
        request_bytes: u64,
        call: impl Future<Output = Result<T, Errno>>,
    ) -> Result<T, Errno> {
        let (counting, timing) = (self.counting(), self.timing());
        let start = timing.then(Instant::now);
        let (result, cost) = if counting {
            COST.scope(Cell::new(Cost::default()), async {
                let result = call.await;
                (result, COST.with(Cell::get))
            })
            .await
        } else {
            (call.await, Cost::default())
        };
        let fop = &self.fops[code.index()];
        if let Some(start) = start {
            let ns = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
            let mut latency = fop.latency.lock().unwrap_or_else(|e| e.into_inner());
            if latency.is_none() {
                *latency = new_histogram();
            }
            if let Some(h) = latency.as_mut() {
                h.saturating_record(ns.clamp(1, LATENCY_MAX_NS));
            }
        }
        if counting {
            fop.calls.fetch_add(1, Relaxed);
            fop.steps.fetch_add(cost.steps, Relaxed);
            fop.sqes.fetch_add(cost.sqes, Relaxed);
            fop.pool_jobs.fetch_add(cost.pool_jobs, Relaxed);
            fop.intents.fetch_add(cost.intents, Relaxed);
            match &result {
                Ok(reply) => {
                    fop.bytes
                        .fetch_add(request_bytes + reply.data_bytes(), Relaxed);
                }
                Err(e) => {
                    fop.errors.fetch_add(1, Relaxed);
                    self.errors[ErrorCode::from_errno(e.raw_os_error()).index()]
                        .fetch_add(1, Relaxed);
                }
            }
        }
        result
    }

    /// Everything measured so far.
    pub fn report(&self) -> ProfileReport {
        let since = *self.since.lock().unwrap_or_else(|e| e.into_inner());
        let fops = FopCode::ALL
            .iter()
            .zip(&self.fops)
            .filter_map(|(&code, c)| {
                let latency = c
                    .latency
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .as_ref()
                    .filter(|h| !h.is_empty())
                    .map(summary);
                let calls = c.calls.load(Relaxed);
                (calls > 0 || latency.is_some()).then(|| FopProfile {
                    fop: code.name().to_owned(),
                    calls,
                    errors: c.errors.load(Relaxed),
                    bytes: c.bytes.load(Relaxed),
                    steps: c.steps.load(Relaxed),
                    sqes: c.sqes.load(Relaxed),
                    pool_jobs: c.pool_jobs.load(Relaxed),
                    intents: c.intents.load(Relaxed),
                    latency,
                })
            })
            .collect();
        let errors = ErrorCode::ALL
            .iter()
            .zip(&self.errors)
            .filter_map(|(code, n)| {
                let n = n.load(Relaxed);
                (n > 0).then(|| (code.errno_name().to_owned(), n))
            })
            .collect();
        ProfileReport {
            counting: self.counting(),
            timing: self.timing(),
            counting_for_s: since.0.elapsed().as_secs_f64(),
            timing_for_s: since.1.elapsed().as_secs_f64(),
            fops,
            errors,
        }
    }

    /// Calls of each fop whose latency is at most each bound, for a Prometheus histogram:
    /// `(fop, [(bound, cumulative count)], count, sum of latencies)`, timed fops only.
    pub fn latency_buckets(&self, bounds: &[Duration]) -> Vec<(FopCode, Vec<u64>, u64, f64)> {
        FopCode::ALL
            .iter()
            .zip(&self.fops)
            .filter_map(|(&code, c)| {
                let guard = c.latency.lock().unwrap_or_else(|e| e.into_inner());
                let h = guard.as_ref().filter(|h| !h.is_empty())?;
                let cumulative = bounds
                    .iter()
                    .map(|b| {
                        let ns = u64::try_from(b.as_nanos()).unwrap_or(u64::MAX);
                        h.count_between(0, h.highest_equivalent(ns.min(LATENCY_MAX_NS)))
                    })
                    .collect();
                let sum_s = h.mean() * h.len() as f64 / 1e9;
                Some((code, cumulative, h.len(), sum_s))
            })
            .collect()
    }
}

fn new_histogram() -> Option<Histogram<u64>> {
    Histogram::new_with_bounds(1, LATENCY_MAX_NS, LATENCY_SIGFIG).ok()
}

/// A histogram summed up in microseconds.
fn summary(h: &Histogram<u64>) -> LatencySummary {
    let us = |ns: u64| ns as f64 / 1000.0;
    LatencySummary {
        count: h.len(),
        avg_us: h.mean() / 1000.0,
        min_us: us(h.min()),
        max_us: us(h.max()),
        p50_us: us(h.value_at_quantile(0.5)),
        p90_us: us(h.value_at_quantile(0.9)),
        p99_us: us(h.value_at_quantile(0.99)),
        p999_us: us(h.value_at_quantile(0.999)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Reply(u64);
    impl DataBytes for Reply {
        fn data_bytes(&self) -> u64 {
            self.0
        }
    }

    fn ok(bytes: u64) -> impl Future<Output = Result<Reply, Errno>> {
        std::future::ready(Ok(Reply(bytes)))
    }

    fn run<F: Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
            .block_on(f)
    }

    #[test]
    fn off_records_nothing_and_on_counts_every_call() {
        let p = Profile::default();
        run(p.measure(FopCode::Read, 0, ok(10))).ok();
        assert!(p.report().fops.is_empty());

        p.set(true, true);
        run(async {
            for _ in 0..3 {
                p.measure(FopCode::Read, 0, ok(10)).await.ok();
            }
            p.measure(FopCode::Write, 4096, async {
                charge(|c| c.steps += 2);
                Ok::<_, Errno>(Reply(0))
            })
            .await
            .ok();
            let failed: Result<Reply, Errno> = Err(Errno::NOENT);
            p.measure(FopCode::Lookup, 0, std::future::ready(failed))
                .await
                .ok();
        });
        let r = p.report();
        let fop = |name: &str| r.fops.iter().find(|f| f.fop == name).expect(name);
        assert_eq!((fop("READ").calls, fop("READ").bytes), (3, 30));
        assert_eq!(fop("READ").latency.as_ref().map(|l| l.count), Some(3));
        assert_eq!((fop("WRITE").bytes, fop("WRITE").steps), (4096, 2));
        assert_eq!((fop("LOOKUP").calls, fop("LOOKUP").errors), (1, 1));
        assert_eq!(r.errors.get("ENOENT"), Some(&1));
        let buckets = p.latency_buckets(&[Duration::from_secs(3600)]);
        assert_eq!(buckets.iter().map(|b| b.2).sum::<u64>(), 5);

        // Off keeps the numbers; on again starts afresh.
        p.set(false, false);
        assert_eq!(p.report().fops.len(), 3);
        p.set(true, false);
        let r = p.report();
        assert!(r.fops.iter().all(|f| f.calls == 0), "{r:?}");
        assert!(r.fops.iter().all(|f| f.latency.is_some()), "{r:?}");
        p.set(true, true);
        assert!(p.report().fops.is_empty());
    }
}
