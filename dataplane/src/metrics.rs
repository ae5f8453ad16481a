//! The brick's Prometheus endpoint: `GET /metrics` answers the Prometheus text format (0.0.4)
//! with the profile's per-fop counters and latency histograms, errors by errno, sessions and
//! open fds, cache sizes and hits, ring counters, and directory leases. Off unless
//! `--metrics-listen` (the volume option `diagnostics.metrics-listen`) gives an address.
//!
//! The HTTP side is the least a scraper needs: one `GET` per connection, answered and closed.
//! Anything else gets 404 or 405; a request head over [`REQUEST_HEAD_MAX_BYTES`] or slower
//! than [`REQUEST_TIMEOUT`] is dropped.

use std::fmt::Write as _;
use std::time::Duration;

use kiln_wire::FopCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use kiln_admin::control::{FopProfile, ProfileReport};

use crate::cache::CacheState;
use crate::engine::{Engine, EngineState};
use crate::leases::LeaseStats;
use crate::profile::Profile;
use crate::server::Connections;

/// Longest request head read, in bytes.
pub const REQUEST_HEAD_MAX_BYTES: usize = 8 * 1024;
/// How long a scraper may take to send its request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause after a failed accept.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);
/// Upper bounds of the latency histogram's buckets, in seconds: 1 µs to 10 s.
pub const LATENCY_BUCKETS_S: &[f64] = &[
    1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
    0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

/// Scrapes answered at once; more wait in the listen backlog, so slow or many scrapers
/// cost a bounded number of tasks and fds.
pub const SCRAPES_MAX: usize = 4;

/// Serves `GET /metrics` on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, engine: Engine, connections: Connections) {
    let scrapes = std::sync::Arc::new(tokio::sync::Semaphore::new(SCRAPES_MAX));
    loop {
        let Ok(scrape) = scrapes.clone().acquire_owned().await else {
            return;
        };
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            // Out of fds, most likely: let some close instead of spinning.
            Err(e) => {
                tracing::warn!(error = %e, "metrics: cannot accept");
                tokio::time::sleep(ACCEPT_RETRY).await;
                continue;
            }
        };
        let (engine, connections) = (engine.clone(), connections.clone());
        tokio::spawn(async move {
            let answer = answer(stream, &engine, &connections);
            let _ = tokio::time::timeout(REQUEST_TIMEOUT, answer).await;
            drop(scrape);
        });
    }
}

async fn answer(
    mut stream: TcpStream,
    engine: &Engine,
    connections: &Connections,
) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf).await?;
        if n == 0 || head.len() + n > REQUEST_HEAD_MAX_BYTES {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut words = line.split(|&b| b == b' ');
    let (method, path) = (words.next().unwrap_or_default(), words.next());
    let path = path.map(|p| p.split(|&b| b == b'?').next().unwrap_or_default());
    let (status, body) = match (method, path) {
        (b"GET", Some(b"/metrics")) => {
            let state = engine.state().await;
            (
                "200 OK",
                render(engine.profile(), &state, connections.len()),
            )
        }
        (b"GET", _) => ("404 Not Found", "try /metrics\n".to_owned()),
        _ => ("405 Method Not Allowed", "GET /metrics only\n".to_owned()),
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(reply.as_bytes()).await?;
    stream.shutdown().await
}

/// How a metric's value is read from its source.
type Field<T> = fn(&T) -> u64;

/// One metric family's header.
fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// The whole page.
pub fn render(profile: &Profile, state: &EngineState, connections: usize) -> String {
    let mut out = String::with_capacity(16 * 1024);
    let report = profile.report();
    render_profile_switches(&mut out, &report);
    render_fop_counters(&mut out, &report);
    render_errors(&mut out, &report);
    render_latency(&mut out, profile);
    render_sessions(&mut out, state, connections);
    render_caches(&mut out, state);
    render_ring(&mut out, state);
    render_leases(&mut out, &state.leases);
    out
}

/// Whether counting and timing are on.
fn render_profile_switches(out: &mut String, report: &ProfileReport) {
    family(
        out,
        "kiln_profile_enabled",
        "gauge",
        "Whether per-fop counting (diagnostics.count-fop-hits) and timing \
         (diagnostics.latency-measurement) are on.",
    );
    let _ = writeln!(
        out,
        "kiln_profile_enabled{{part=\"counting\"}} {}\nkiln_profile_enabled{{part=\"timing\"}} {}",
        u8::from(report.counting),
        u8::from(report.timing)
    );
}

/// The profile's counters, one family each, by fop.
fn render_fop_counters(out: &mut String, report: &ProfileReport) {
    let per_fop: [(&str, &str, Field<FopProfile>); 7] = [
        ("kiln_fop_calls_total", "Fops served, by fop.", |f| f.calls),
        ("kiln_fop_errors_total", "Fops that failed, by fop.", |f| {
            f.errors
        }),
        (
            "kiln_fop_bytes_total",
            "Data bytes moved: read by READ, written by WRITE and PUT.",
            |f| f.bytes,
        ),
        (
            "kiln_fop_steps_total",
            "Executor steps (one syscall's worth each), by fop.",
            |f| f.steps,
        ),
        (
            "kiln_fop_sqes_total",
            "Steps submitted to io_uring, by fop.",
            |f| f.sqes,
        ),
        (
            "kiln_fop_pool_jobs_total",
            "Calls run on the blocking pool (no io_uring opcode), by fop.",
            |f| f.pool_jobs,
        ),
        (
            "kiln_fop_intent_commits_total",
            "Namespace changes committed through an intent record, by fop.",
            |f| f.intents,
        ),
    ];
    for (name, help, value) in per_fop {
        family(out, name, "counter", help);
        for f in &report.fops {
            let _ = writeln!(out, "{name}{{fop=\"{}\"}} {}", f.fop, value(f));
        }
    }
}

fn render_errors(out: &mut String, report: &ProfileReport) {
    family(
        out,
        "kiln_errors_total",
        "counter",
        "Failed fops, by errno.",
    );
    for (errno, n) in &report.errors {
        let _ = writeln!(out, "kiln_errors_total{{errno=\"{errno}\"}} {n}");
    }
}

/// Sessions and the fds they hold open.
fn render_sessions(out: &mut String, state: &EngineState, connections: usize) {
    family(
        out,
        "kiln_sessions",
        "gauge",
        "Clients connected (one session each).",
    );
    let _ = writeln!(out, "kiln_sessions {connections}");
    family(
        out,
        "kiln_open_fds",
        "gauge",
        "Files and directories open, all sessions.",
    );
    let _ = writeln!(out, "kiln_open_fds {}", state.open_fds());
}

/// The GFID and dirfd caches, one family per measure.
fn render_caches(out: &mut String, state: &EngineState) {
    let caches = [("gfid", &state.gfid_cache), ("dirfd", &state.dirfd_cache)];
    let cache_families: [(&str, &str, &str, Field<CacheState>); 4] = [
        ("kiln_cache_entries", "gauge", "Entries held.", |c| {
            c.entries as u64
        }),
        (
            "kiln_cache_capacity",
            "gauge",
            "Entries it may hold.",
            |c| c.capacity as u64,
        ),
        ("kiln_cache_hits_total", "counter", "Lookups found.", |c| {
            c.hits
        }),
        (
            "kiln_cache_misses_total",
            "counter",
            "Lookups not found.",
            |c| c.misses,
        ),
    ];
    for (name, kind, help, value) in cache_families {
        family(out, name, kind, help);
        for (cache, c) in caches {
            let _ = writeln!(out, "{name}{{cache=\"{cache}\"}} {}", value(c));
        }
    }
}

fn render_ring(out: &mut String, state: &EngineState) {
    let ring = [
        (
            "kiln_ring_enters_total",
            "io_uring_enter calls.",
            state.ring.enters,
        ),
        ("kiln_ring_sqes_total", "SQEs submitted.", state.ring.sqes),
        (
            "kiln_ring_chains_total",
            "Linked chains submitted.",
            state.ring.chains,
        ),
        (
            "kiln_ring_pool_jobs_total",
            "Calls run on the blocking pool.",
            state.ring.pool_jobs,
        ),
    ];
    for (name, help, value) in ring {
        family(out, name, "counter", help);
        let _ = writeln!(out, "{name} {value}");
    }
}

/// Directory leases: held now, and what happened to them since start.
fn render_leases(out: &mut String, leases: &LeaseStats) {
    family(
        out,
        "kiln_leases_held",
        "gauge",
        "Directory leases held by clients now.",
    );
    let _ = writeln!(out, "kiln_leases_held {}", leases.held);
    let counters = [
        ("kiln_lease_grants_total", "Leases granted.", leases.grants),
        (
            "kiln_lease_recalls_total",
            "Leases recalled because another client's fop conflicted.",
            leases.recalls,
        ),
        (
            "kiln_lease_returns_total",
            "Leases given back (or downgraded) by their holders.",
            leases.returns,
        ),
        (
            "kiln_lease_revocations_total",
            "Recalled leases revoked for not coming back in time.",
            leases.revocations,
        ),
        (
            "kiln_lease_waits_total",
            "Fops that waited for a recall.",
            leases.waits,
        ),
    ];
    for (name, help, value) in counters {
        family(out, name, "counter", help);
        let _ = writeln!(out, "{name} {value}");
    }
}

fn render_latency(out: &mut String, profile: &Profile) {
    let name = "kiln_fop_latency_seconds";
    family(
        out,
        name,
        "histogram",
        "Fop latency in the brick, from request to reply (diagnostics.latency-measurement).",
    );
    let bounds: Vec<Duration> = LATENCY_BUCKETS_S
        .iter()
        .map(|&s| Duration::from_secs_f64(s))
        .collect();
    for (fop, cumulative, count, sum_s) in profile.latency_buckets(&bounds) {
        let fop = FopCode::name(fop);
        for (le, n) in LATENCY_BUCKETS_S.iter().zip(cumulative) {
            let _ = writeln!(out, "{name}_bucket{{fop=\"{fop}\",le=\"{le}\"}} {n}");
        }
        let _ = writeln!(out, "{name}_bucket{{fop=\"{fop}\",le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum{{fop=\"{fop}\"}} {sum_s}");
        let _ = writeln!(out, "{name}_count{{fop=\"{fop}\"}} {count}");
    }
}
