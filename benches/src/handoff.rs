//! What waking a thread costs on this machine, on another CPU and on the same one: every
//! FUSE request pays it twice (the FUSE thread woken by the caller, the caller by the reply),
//! so it bounds what any FUSE mount can do per request. On a VM whose idle CPUs halt instead
//! of polling (`cpuidle-haltpoll` with `guest_halt_poll_ns` 0), a wake-up on an idle CPU is
//! a VM exit and an interrupt, several times a switch on the same CPU; the mount benchmark
//! prints both with the machine's idle settings, so its ratios can be read against them.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Instant;

use serde_json::json;

/// Round trips timed for each placement (after as many to warm up).
const ROUND_TRIPS: u32 = 2_000;

/// The handoff costs and the idle settings behind them, as a JSON object: mean round trip
/// of one byte between two threads on CPUs 0 and 1, and with both on CPU 0 (each round
/// trip is two wake-ups).
pub fn measure() -> serde_json::Value {
    let cross = match std::thread::available_parallelism().map_or(1, usize::from) {
        1 => None,
        _ => round_trip_us(0, 1).ok(),
    };
    json!({
        "cross_cpu_round_trip_us": cross,
        "same_cpu_round_trip_us": round_trip_us(0, 0).ok(),
        "cpuidle_driver": sysfs("/sys/devices/system/cpu/cpuidle/current_driver"),
        "cpuidle_governor": sysfs("/sys/devices/system/cpu/cpuidle/current_governor_ro")
            .or_else(|| sysfs("/sys/devices/system/cpu/cpuidle/current_governor")),
        "guest_halt_poll_ns": sysfs("/sys/module/haltpoll/parameters/guest_halt_poll_ns"),
        // "Y": a Kiln mount takes requests through io_uring, a queue per CPU, so a request
        // answered at once costs a switch on the caller's CPU rather than a cross-CPU wake-up.
        "fuse_enable_uring": sysfs("/sys/module/fuse/parameters/enable_uring"),
    })
}

/// Mean µs (to 0.1) of a byte's round trip between a thread on CPU `a` and one on CPU `b`.
fn round_trip_us(a: usize, b: usize) -> std::io::Result<f64> {
    let (mut near, mut far) = UnixStream::pair()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        pin(b)?;
        let mut byte = [0u8];
        for _ in 0..2 * ROUND_TRIPS {
            far.read_exact(&mut byte)?;
            far.write_all(&byte)?;
        }
        Ok(())
    });
    let timed = std::thread::spawn(move || -> std::io::Result<f64> {
        pin(a)?;
        let mut bounce = |n: u32| -> std::io::Result<()> {
            let mut byte = [7u8];
            for _ in 0..n {
                near.write_all(&byte)?;
                near.read_exact(&mut byte)?;
            }
            Ok(())
        };
        bounce(ROUND_TRIPS)?;
        let start = Instant::now();
        bounce(ROUND_TRIPS)?;
        let us = start.elapsed().as_secs_f64() * 1e6 / f64::from(ROUND_TRIPS);
        Ok((us * 10.0).round() / 10.0)
    });
    let mean = timed
        .join()
        .map_err(|_| std::io::Error::other("panicked"))??;
    echo.join()
        .map_err(|_| std::io::Error::other("panicked"))??;
    Ok(mean)
}

/// Keeps the calling thread on CPU `cpu`.
fn pin(cpu: usize) -> std::io::Result<()> {
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    rustix::thread::sched_setaffinity(None, &set)?;
    Ok(())
}

/// The trimmed content of a sysfs file, if it exists.
fn sysfs(path: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_trip_on_one_cpu_takes_a_positive_time() {
        let us = round_trip_us(0, 0).expect("round trip");
        assert!(us > 0.0 && us < 100_000.0, "{us} µs");
    }
}
