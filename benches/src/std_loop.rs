//! The plain-syscall reference of `kiln-bench engine` and `net`: the same operations as the
//! engine's fops, as `std::fs` calls on OS threads, with as many threads as the target it is
//! compared with runs fops on, so a ratio compares equal thread counts.
//!
//! Not a workload of its own: the workloads say which operation each file gets.

use std::time::Instant;

use hdrhistogram::Histogram;

use crate::report::{histogram, nanos};

/// Threads of a std loop compared with a target that runs fops on `target_threads` threads
/// and keeps `depth` fops in flight: one thread per fop in flight, at most one per target
/// thread. Each std thread keeps one operation going, so neither side has more threads busy.
pub fn threads_for(depth: usize, target_threads: usize) -> usize {
    depth.min(target_threads).max(1)
}

/// Runs `op(i)` for every `i < files` on `threads` threads, thread `t` taking files
/// `t, t + threads, …` one at a time. Returns operations per second over the whole run
/// (thread start included) and, when `latency` is set, each operation's latency (left out
/// otherwise: the clock reads would slow the fastest reference ops by a few percent).
pub fn run<F>(
    threads: usize,
    files: usize,
    latency: bool,
    op: F,
) -> anyhow::Result<(f64, Option<Histogram<u64>>)>
where
    F: Fn(usize) -> std::io::Result<()> + Sync,
{
    let threads = threads.max(1);
    let start = Instant::now();
    let per_thread = std::thread::scope(|s| {
        let op = &op;
        let running: Vec<_> = (0..threads)
            .map(|t| s.spawn(move || one_thread(t, threads, files, latency, op)))
            .collect();
        running
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| anyhow::anyhow!("a std loop thread panicked"))?
            })
            .collect::<anyhow::Result<Vec<_>>>()
    })?;
    let rate = files as f64 / start.elapsed().as_secs_f64();
    let mut merged = None;
    for h in per_thread.into_iter().flatten() {
        merged.get_or_insert(histogram()?).add(h)?;
    }
    Ok((rate, merged))
}

fn one_thread<F>(
    t: usize,
    threads: usize,
    files: usize,
    latency: bool,
    op: &F,
) -> anyhow::Result<Option<Histogram<u64>>>
where
    F: Fn(usize) -> std::io::Result<()>,
{
    let mut h = latency.then(histogram).transpose()?;
    for i in (t..files).step_by(threads) {
        let started = h.as_ref().map(|_| Instant::now());
        op(i).map_err(|e| anyhow::anyhow!("file {i}: {e}"))?;
        if let (Some(h), Some(started)) = (h.as_mut(), started) {
            h.record(nanos(started.elapsed()))?;
        }
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    #[test]
    fn every_file_once_across_the_threads() {
        let seen = Mutex::new(vec![0u32; 103]);
        let (rate, h) = run(4, 103, true, |i| {
            seen.lock().expect("lock")[i] += 1;
            Ok(())
        })
        .expect("run");
        assert!(rate > 0.0);
        assert!(seen.into_inner().expect("lock").iter().all(|&n| n == 1));
        assert_eq!(h.expect("latency asked").len(), 103);
    }

    #[test]
    fn no_latency_unless_asked_and_errors_name_the_file() {
        let (_, h) = run(2, 10, false, |_| Ok(())).expect("run");
        assert!(h.is_none());
        let e = run(3, 10, false, |i| match i {
            7 => Err(std::io::Error::other("boom")),
            _ => Ok(()),
        })
        .expect_err("file 7 fails");
        assert!(e.to_string().contains("file 7"), "{e}");
    }

    #[test]
    fn threads_follow_depth_up_to_the_target_threads() {
        assert_eq!(threads_for(1, 2), 1);
        assert_eq!(threads_for(16, 2), 2);
        assert_eq!(threads_for(16, 6), 6);
        assert_eq!(threads_for(4, 6), 4);
        assert_eq!(threads_for(0, 2), 1);
    }
}
