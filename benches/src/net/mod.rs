//! `kiln-bench net`: the brick over QUIC, client and server in this one process, against
//! references measured in the same run.
//!
//! Set-up: a fresh brick in the scratch directory served by the engine (io_uring by default;
//! the blocking engine gets as many pool threads as the io_uring engine has in all, see
//! [`engine_config`]) and [`Server`] on `127.0.0.1:0`, with mutual TLS material made by `kiln_admin::pki` (CA,
//! brick certificate for `127.0.0.1`/`localhost`, client certificate `bench`). The brick's
//! QUIC endpoints run on the engine's worker threads; the client ([`BrickClient`], one connection
//! shared by every task) runs on its own tokio runtime — a current-thread runtime on the main
//! thread unless `--client-threads` asks for a multi-thread one. The PUTs and PINGs share one
//! connection, its UDP payload capped at `udp_payload` on both ends (default
//! [`UDP_PAYLOAD_MAX_BYTES`]).
//!
//! Workloads:
//!
//! * `net.create` — PUT of small files (create + write + close in one round trip,
//!   [`Paths::put_at`]) into a few directories, `files` per concurrency level, by
//!   `concurrency` tasks sharing the connection (or round robin over `connections` clients on
//!   consecutive ports, which the brick steers to its endpoints in turn). References:
//!   `std_loop`, `File::create` + `write_all` of as many files on the same file system, on as
//!   many OS threads as the brick's engine runs fops on (one per PUT in flight, up to that: a
//!   std row per thread count, each PUT row against the one of its thread count); and
//!   `engine_direct`, the same PUTs at the same concurrency through an engine [`Session`] per
//!   connection (round robin) from the client runtime (no network, no TLS, no codec).
//!   p50/p99 are per PUT. Every row prints its thread counts:
//!   `threads` (the engine's fop threads, or the std loop's), `pool_threads` (the io_uring
//!   engine's blocking pool), `client_threads` (the client runtime's; a current-thread
//!   runtime is one).
//! * `net.ping` — `ping` sequential PINGs ([`BrickClient::ping`]: one stream, one request frame,
//!   one reply frame), against a 64-byte ping-pong on one TCP connection over loopback with
//!   `TCP_NODELAY`, its far end on a thread of its own like the brick's endpoints.
//!   `ratio` = TCP's p50 ÷ QUIC's p50, so above 1 means faster than TCP; 0.5 means a PING
//!   takes twice as long as the bare TCP round trip.
//! * `net.bulk_write` / `net.bulk_read` — one file of `bulk_mib` MiB written then read in
//!   1 MiB requests, up to `bulk_inflight` in flight, over a client of `connections`
//!   connections (one per value of `bulk_connections`; above one, the requests are spread
//!   over them and the client runtime has a thread per core); reads are checked against what
//!   was written, the file is removed afterwards. Once per UDP payload cap in
//!   `bulk_udp_payloads` (default the 64 KiB loopback maximum, then 1452, a typical Ethernet
//!   path), each on a fresh server and client. The reference `net.bulk`/`tcp` copies the
//!   same bytes in 1 MiB writes over as many TCP connections on loopback (a share each), each
//!   to a reader thread.
//!   `ratio` = QUIC MiB/s ÷ TCP MiB/s. Nothing is fsynced: the brick's writes land in the page
//!   cache, and the read comes from there.
//!
//! After every QUIC phase a `udp` note gives the change in the kernel's UDP counters
//! (`/proc/net/snmp`, the whole network namespace): datagrams and the drop counters. With
//! UDP GSO/GRO a batch may be counted once, so datagram counts are approximate. A send the
//! kernel refuses outright (EMSGSIZE, which quinn-udp drops silently as an expected MTU
//! probe failure) is in no counter: it shows only as loss inside quinn.

mod bulk;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use hdrhistogram::Histogram;
use kiln_client::{BrickClient, Paths};
use kiln_dataplane::ParentAttrs;
use kiln_dataplane::engine::{EngineConfig, EngineKind, Session};
use kiln_wire::limits::IO_SIZE_MAX_BYTES;
use kiln_wire::quic::UDP_PAYLOAD_MAX_BYTES;
use kiln_wire::*;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinSet;

use crate::bricks::{Served, engine_config, fop_threads, with_threads};
use crate::report::{Record, Reporter, histogram, micros, nanos};
use crate::scratch::Scratch;
use crate::std_loop;

/// What to run.
#[derive(Debug, Clone)]
pub struct NetBench {
    /// Files PUT per concurrency level (and by the std loop, once).
    pub files: usize,
    pub dirs: usize,
    pub file_bytes: usize,
    pub concurrency: Vec<usize>,
    pub pings: usize,
    pub bulk_mib: usize,
    pub bulk_inflight: usize,
    /// Client connections of the bulk runs, one run each.
    pub bulk_connections: Vec<usize>,
    /// UDP payload cap of the connection the PUTs and PINGs use.
    pub udp_payload: u16,
    /// UDP payload caps for the bulk runs, one run each.
    pub bulk_udp_payloads: Vec<u16>,
    pub engine: EngineKind,
    /// Worker threads of the client's runtime; 0 = current-thread runtime.
    pub client_threads: usize,
    /// Ring workers that run a QUIC endpoint (1 = one shared endpoint; 0 = all workers).
    pub endpoints: usize,
    /// Client connections the PUTs are spread over (round robin).
    pub connections: usize,
}

/// Bytes each way in the TCP ping-pong.
const TCP_PING_BYTES: usize = 64;
/// Smallest UDP payload QUIC allows.
const UDP_PAYLOAD_MIN_BYTES: u16 = 1200;
/// How long a TCP reference peer waits for its connection.
const ACCEPT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the servers get to drain at the end.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// A latency histogram shared by the tasks of one phase (one lock per operation, so memory
/// stays one histogram whatever the concurrency).
type SharedHistogram = Arc<Mutex<Histogram<u64>>>;

fn record_into(h: &SharedHistogram, elapsed: Duration) -> anyhow::Result<()> {
    h.lock()
        .map_err(|_| anyhow::anyhow!("histogram lock poisoned"))?
        .record(nanos(elapsed))?;
    Ok(())
}

fn take(h: SharedHistogram) -> anyhow::Result<Histogram<u64>> {
    Arc::try_unwrap(h)
        .map_err(|_| anyhow::anyhow!("histogram still shared"))?
        .into_inner()
        .map_err(|_| anyhow::anyhow!("histogram lock poisoned"))
}

fn file_name(i: usize) -> anyhow::Result<Name> {
    Ok(Name::new(format!("f{i:07}"))?)
}

fn client_runtime(threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    match threads {
        0 => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        n => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(n)
            .thread_name("kiln-bench-client")
            .enable_all()
            .build(),
    }
}

/// The kernel's UDP counters (`/proc/net/snmp`), by name.
fn udp_counters() -> Option<Vec<(String, i64)>> {
    let text = std::fs::read_to_string("/proc/net/snmp").ok()?;
    let mut lines = text.lines().filter(|l| l.starts_with("Udp:"));
    let names = lines.next()?.split_whitespace().skip(1);
    let values = lines.next()?.split_whitespace().skip(1);
    Some(
        names
            .zip(values)
            .filter_map(|(n, v)| Some((n.to_owned(), v.parse().ok()?)))
            .collect(),
    )
}

/// Notes the change in the UDP counters since `before` for `phase`.
fn note_udp(out: &mut Reporter, phase: &str, before: Option<&Vec<(String, i64)>>) {
    if let (Some(before), Some(now)) = (before, udp_counters().as_ref()) {
        let delta = |name: &str| {
            let get = |c: &Vec<(String, i64)>| c.iter().find(|(n, _)| n == name).map(|(_, v)| *v);
            get(now).zip(get(before)).map(|(a, b)| a - b)
        };
        let mut counters = serde_json::Map::new();
        for name in [
            "OutDatagrams",
            "InDatagrams",
            "InErrors",
            "RcvbufErrors",
            "SndbufErrors",
        ] {
            if let Some(d) = delta(name) {
                counters.insert(name.to_owned(), json!(d));
            }
        }
        out.note("udp", &json!({ "phase": phase, "delta": counters }));
    }
}

/// Notes what the client's connection sent and received per call since `before` over
/// `calls` calls: datagrams (and send/receive system calls), and the frames that carry
/// something besides the calls' own STREAM frames (ACKs, stream and flow-control credit).
fn note_transport(
    out: &mut Reporter,
    phase: &str,
    before: Option<quinn::ConnectionStats>,
    client: &BrickClient,
    calls: usize,
) {
    let (Some(before), Some(now)) = (before, client.transport_stats()) else {
        return;
    };
    let per_call = |now: u64, before: u64| (now - before) as f64 / calls.max(1) as f64;
    let frames = |now: &quinn::FrameStats, before: &quinn::FrameStats| {
        json!({
            "stream": per_call(now.stream, before.stream),
            "ack": per_call(now.acks, before.acks),
            "max_streams_bidi": per_call(now.max_streams_bidi, before.max_streams_bidi),
            "max_data": per_call(now.max_data, before.max_data),
            "max_stream_data": per_call(now.max_stream_data, before.max_stream_data),
            "ping": per_call(now.ping, before.ping),
        })
    };
    out.note(
        "quic",
        &json!({
            "phase": phase,
            "side": "client",
            "per_call": {
                "datagrams_sent": per_call(now.udp_tx.datagrams, before.udp_tx.datagrams),
                "send_calls": per_call(now.udp_tx.ios, before.udp_tx.ios),
                "datagrams_received": per_call(now.udp_rx.datagrams, before.udp_rx.datagrams),
                "receive_calls": per_call(now.udp_rx.ios, before.udp_rx.ios),
                "frames_sent": frames(&now.frame_tx, &before.frame_tx),
                "frames_received": frames(&now.frame_rx, &before.frame_rx),
            },
            "rtt_us": now.path.rtt.as_secs_f64() * 1e6,
        }),
    );
}

fn setup(bench: &NetBench, scratch: &Scratch, config: &EngineConfig) -> anyhow::Result<Served> {
    Served::start(
        &scratch.path().join("brick"),
        &scratch.path(),
        config,
        bench.endpoints,
    )
}

/// Runs the whole benchmark, printing records as they are measured.
pub fn run(bench: &NetBench, scratch: &Scratch, out: &mut Reporter) -> anyhow::Result<Vec<Record>> {
    if bench.file_bytes > IO_SIZE_MAX_BYTES {
        bail!("--file-bytes: a PUT carries at most {IO_SIZE_MAX_BYTES} bytes");
    }
    if let Some(p) = bench
        .bulk_udp_payloads
        .iter()
        .chain([&bench.udp_payload])
        .find(|&&p| !(UDP_PAYLOAD_MIN_BYTES..=UDP_PAYLOAD_MAX_BYTES).contains(&p))
    {
        bail!("UDP payload cap {p} is outside {UDP_PAYLOAD_MIN_BYTES}..={UDP_PAYLOAD_MAX_BYTES}");
    }
    let config = engine_config(bench.engine);
    let setup = setup(bench, scratch, &config)?;
    let rt = client_runtime(bench.client_threads)?;
    let (server, volume) = rt.block_on(setup.serve_and_connect(bench.udp_payload))?;
    let ping_frame = Message::Request(Request {
        id: 1,
        call: Call::Ping(Ping { nonce: 1 }),
    })
    .encode()?
    .len();
    out.note(
        "net",
        &json!({
            "engine": setup.engine.kind().name(),
            "engine_workers": setup.engine.workers(),
            "engine_threads": with_threads(json!({}), &config),
            "endpoints": match bench.endpoints {
                0 => setup.engine.workers(),
                n => n.min(setup.engine.workers()),
            },
            "server": server.local_addr().to_string(),
            "client_runtime": match bench.client_threads {
                0 => "current-thread".to_owned(),
                n => format!("multi-thread, {n} workers"),
            },
            "udp_payload": bench.udp_payload,
            "ping_frame_bytes": ping_frame,
            "transport": "QUIC over UDP on loopback, TLS 1.3 with client certificates",
        }),
    );

    let mut records = Vec::new();
    // More connections for the PUTs, each a client on the port after the last one's, which
    // the brick steers to its next endpoint.
    let mut volumes = vec![volume.clone()];
    for _ in 1..bench.connections.max(1) {
        let mut options = setup.client_options(server.local_addr(), bench.udp_payload)?;
        let last = volumes.last().and_then(BrickClient::local_port);
        options.local_port = last.and_then(|p| p.checked_add(1)).unwrap_or(0);
        volumes.push(rt.block_on(BrickClient::connect(options))?);
    }
    let volumes = Arc::new(volumes);
    let threads = Threads {
        engine: &config,
        client: bench.client_threads.max(1),
    };
    records.extend(create(bench, scratch, &setup, threads, &rt, &volumes, out)?);
    records.extend(ping(bench, &rt, &volume, ping_frame, out)?);
    records.extend(bulk::bulk(bench, &setup, &rt, (server, volume), out)?);
    Ok(records)
}

/// Runs `files` PUTs through `put` from `concurrency` tasks, each with one in flight.
/// Returns PUTs per second and the per-PUT latency.
async fn put_phase<P, Fut>(
    files: usize,
    concurrency: usize,
    dirs: &Arc<Vec<Gfid>>,
    data: &Bytes,
    put: P,
) -> anyhow::Result<(f64, Histogram<u64>)>
where
    P: Fn(Gfid, Name, Bytes) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let latency: SharedHistogram = Arc::new(Mutex::new(histogram()?));
    let concurrency = concurrency.max(1);
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    for k in 0..concurrency {
        let (dirs, data, put, latency) = (dirs.clone(), data.clone(), put.clone(), latency.clone());
        tasks.spawn(async move {
            for i in (k..files).step_by(concurrency) {
                let name = file_name(i)?;
                let t = Instant::now();
                put(dirs[i % dirs.len()], name, data.clone())
                    .await
                    .with_context(|| format!("PUT of file {i}"))?;
                record_into(&latency, t.elapsed())?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    let rate = files as f64 / start.elapsed().as_secs_f64();
    Ok((rate, take(latency)?))
}

/// The threads of the PUT phases: the brick engine's, and the client runtime's (a
/// current-thread runtime counts as one).
#[derive(Debug, Clone, Copy)]
struct Threads<'a> {
    engine: &'a EngineConfig,
    client: usize,
}

impl Threads<'_> {
    /// Threads of the std loop compared with `concurrency` PUTs in flight.
    fn std_loop(&self, concurrency: usize) -> usize {
        std_loop::threads_for(concurrency, fop_threads(self.engine))
    }
}

/// The name of the std loop reference on `threads` threads.
fn std_reference(threads: usize) -> String {
    format!("std_loop threads={threads}")
}

/// (a) small-file PUTs: std loops, engine called directly, QUIC.
fn create(
    bench: &NetBench,
    scratch: &Scratch,
    setup: &Served,
    threads: Threads<'_>,
    rt: &tokio::runtime::Runtime,
    volumes: &Arc<Vec<BrickClient>>,
    out: &mut Reporter,
) -> anyhow::Result<Vec<Record>> {
    let volume = &volumes[0];
    let data = Bytes::from(vec![0x5a; bench.file_bytes]);
    let dirs = bench.dirs.max(1);
    let params = |concurrency: usize| {
        let params = json!({ "files": bench.files, "dirs": dirs, "bytes": bench.file_bytes,
                "concurrency": concurrency, "connections": bench.connections.max(1),
                "client_threads": threads.client });
        with_threads(params, threads.engine)
    };
    let mut records = Vec::new();

    // The references: plain syscalls on as many threads as the engine runs fops on (one per
    // PUT in flight, up to that), the same number of files each.
    let std_threads: BTreeSet<usize> = bench
        .concurrency
        .iter()
        .map(|&c| threads.std_loop(c.max(1)))
        .collect();
    let mut std_rates = BTreeMap::new();
    for &n in &std_threads {
        let r = std_create(bench, scratch, dirs, n, &data)?;
        std_rates.insert(n, r.ops_per_s.context("the std loop's rate")?);
        out.print(&r);
        records.push(r);
    }

    for &concurrency in &bench.concurrency {
        let concurrency = concurrency.max(1);
        // The engine, called directly from the client runtime through a session per
        // connection (as a connection is a session on the brick; sessions go to the workers
        // in turn, as the connections' ports do), round robin.
        let sessions: Arc<Vec<Session>> = Arc::new(
            (0..volumes.len())
                .map(|_| setup.engine.session_with(ParentAttrs::Omit))
                .collect(),
        );
        let direct_dirs = rt.block_on(engine_dirs(&sessions[0], concurrency, dirs))?;
        let put = {
            let (sessions, next) = (sessions.clone(), Arc::new(AtomicUsize::new(0)));
            move |parent: Gfid, name: Name, data: Bytes| {
                let turn = next.fetch_add(1, Ordering::Relaxed) % sessions.len();
                let sessions = sessions.clone();
                async move { engine_put(&sessions[turn], parent, name, data).await }
            }
        };
        let (direct_rate, h) = rt.block_on(put_phase(
            bench.files,
            concurrency,
            &direct_dirs,
            &data,
            put,
        ))?;
        drop(sessions);
        let std_threads = threads.std_loop(concurrency);
        let std_rate = *std_rates
            .get(&std_threads)
            .context("a std loop for every concurrency")?;
        let mut r = Record::new(
            "net.create",
            "engine_direct",
            params(concurrency),
            &std_reference(std_threads),
        );
        r.ops_per_s = Some(direct_rate);
        r.set_latency(&h);
        r.ratio = Some(direct_rate / std_rate);
        out.print(&r);
        records.push(r);

        // The same PUTs through the client, over QUIC.
        let quic_dirs = rt.block_on(async {
            let mut gfids = Vec::with_capacity(dirs);
            for d in 0..dirs {
                let iatt = volume
                    .mkdir_all(&Creds::root(), &format!("/quic-c{concurrency}/d{d}"), 0o755)
                    .await?;
                gfids.push(iatt.gfid);
            }
            anyhow::Ok(Arc::new(gfids))
        })?;
        let udp = udp_counters();
        let put = {
            // Round robin over the connections (one, unless --connections asks for more).
            let (volumes, next) = (volumes.clone(), Arc::new(AtomicUsize::new(0)));
            move |parent: Gfid, name: Name, data: Bytes| {
                let volume = volumes[next.fetch_add(1, Ordering::Relaxed) % volumes.len()].clone();
                async move {
                    volume
                        .put_at(&Creds::root(), parent, name, data, 0o644)
                        .await?;
                    anyhow::Ok(())
                }
            }
        };
        let (quic_rate, h) =
            rt.block_on(put_phase(bench.files, concurrency, &quic_dirs, &data, put))?;
        note_udp(
            out,
            &format!("net.create quic concurrency={concurrency}"),
            udp.as_ref(),
        );
        let mut r = Record::new(
            "net.create",
            "quic",
            params(concurrency),
            &std_reference(std_threads),
        );
        r.ops_per_s = Some(quic_rate);
        r.set_latency(&h);
        r.ratio = Some(quic_rate / std_rate);
        out.print(&r);
        records.push(r.clone());
        r.reference = "engine_direct".into();
        r.ratio = Some(quic_rate / direct_rate);
        out.print(&r);
        records.push(r);
    }
    Ok(records)
}

/// The std loop's row: `File::create` + `write_all` of `bench.files` files on `threads`
/// threads, in a directory of its own.
fn std_create(
    bench: &NetBench,
    scratch: &Scratch,
    dirs: usize,
    threads: usize,
    data: &[u8],
) -> anyhow::Result<Record> {
    use std::io::Write as _;
    let base = scratch.path().join(format!("std-t{threads}"));
    for d in 0..dirs {
        std::fs::create_dir_all(base.join(format!("d{d}")))?;
    }
    let path = |i: usize| base.join(format!("d{}", i % dirs)).join(format!("f{i:07}"));
    let (rate, h) = std_loop::run(threads, bench.files, true, |i| {
        std::fs::File::create(path(i))?.write_all(data)
    })
    .context("std loop create")?;
    let h = h.context("the std loop's latency")?;
    let params = json!({ "files": bench.files, "dirs": dirs, "bytes": bench.file_bytes,
                         "threads": threads });
    let mut r = Record::new("net.create", "std_loop", params, &std_reference(threads));
    r.ops_per_s = Some(rate);
    r.set_latency(&h);
    r.ratio = Some(1.0);
    Ok(r)
}

/// Makes `dirs` directories under a new `/direct-cN` through `session`.
async fn engine_dirs(
    session: &Session,
    concurrency: usize,
    dirs: usize,
) -> anyhow::Result<Arc<Vec<Gfid>>> {
    let mode = |bits| Mode::new(bits).context("mode");
    let mkdir = |parent, name: String| -> anyhow::Result<FopRequest> {
        Ok(Mkdir {
            parent,
            name: Name::new(name)?,
            gfid: kiln_client::path::new_gfid(),
            mode: mode(0o755)?,
            umask: mode(0)?,
        }
        .into())
    };
    let gfid_of = |reply: Result<FopReply, ErrorCode>| match reply {
        Ok(FopReply::Mkdir(r)) => Ok(r.iatt.gfid),
        other => Err(anyhow::anyhow!("mkdir: {other:?}")),
    };
    let top = gfid_of(
        session
            .call(
                Creds::root(),
                mkdir(Gfid::ROOT, format!("direct-c{concurrency}"))?,
            )
            .await,
    )?;
    let mut gfids = Vec::with_capacity(dirs);
    for d in 0..dirs {
        gfids.push(gfid_of(
            session
                .call(Creds::root(), mkdir(top, format!("d{d}"))?)
                .await,
        )?);
    }
    Ok(Arc::new(gfids))
}

async fn engine_put(
    session: &Session,
    parent: Gfid,
    name: Name,
    data: Bytes,
) -> anyhow::Result<()> {
    let put = Put {
        parent,
        name,
        gfid: kiln_client::path::new_gfid(),
        mode: Mode::new(0o644).context("mode")?,
        umask: Mode::new(0).context("mode")?,
        flags: OpenFlags::empty(),
        data: Payload::new(data).map_err(|e| anyhow::anyhow!("payload: {e:?}"))?,
        attr: SetAttr::default(),
    };
    match session.call(Creds::root(), put.into()).await {
        Ok(FopReply::Put(_)) => Ok(()),
        other => Err(anyhow::anyhow!("PUT: {other:?}")),
    }
}

/// Runs `serve` on a thread of its own with a current-thread runtime (as the brick's
/// endpoints run on their own threads), on the first connection to `listener`.
fn spawn_tcp_peer<F, Fut>(
    listener: std::net::TcpListener,
    serve: F,
) -> std::thread::JoinHandle<anyhow::Result<()>>
where
    F: FnOnce(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: Future<Output = anyhow::Result<()>>,
{
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async move {
            listener.set_nonblocking(true)?;
            let listener = tokio::net::TcpListener::from_std(listener)?;
            let (stream, _) = tokio::time::timeout(ACCEPT_TIMEOUT, listener.accept())
                .await
                .context("no connection to the TCP reference peer")??;
            stream.set_nodelay(true)?;
            serve(stream).await
        })
    })
}

fn join_peer(peer: std::thread::JoinHandle<anyhow::Result<()>>) -> anyhow::Result<()> {
    peer.join()
        .map_err(|_| anyhow::anyhow!("TCP reference peer panicked"))?
}

async fn tcp_connect(addr: SocketAddr) -> anyhow::Result<tokio::net::TcpStream> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// PINGs (or TCP round trips) before measuring: connection warm-up, not recorded.
fn warmup(n: usize) -> usize {
    (n / 10).clamp(1, 1000)
}

/// Runs `round_trip` `warm + pings` times and times the last `pings`. Returns round trips
/// per second and the latency of each.
async fn timed_round_trips(
    warm: usize,
    pings: usize,
    mut round_trip: impl AsyncFnMut(usize) -> anyhow::Result<()>,
) -> anyhow::Result<(f64, Histogram<u64>)> {
    let mut h = histogram()?;
    let mut start = Instant::now();
    for i in 0..warm + pings {
        if i == warm {
            start = Instant::now();
        }
        let t = Instant::now();
        round_trip(i).await?;
        if i >= warm {
            h.record(nanos(t.elapsed()))?;
        }
    }
    Ok((pings as f64 / start.elapsed().as_secs_f64(), h))
}

/// (b) round trips: QUIC PING against a TCP ping-pong of 64 bytes.
fn ping(
    bench: &NetBench,
    rt: &tokio::runtime::Runtime,
    volume: &BrickClient,
    frame_bytes: usize,
    out: &mut Reporter,
) -> anyhow::Result<Vec<Record>> {
    let (pings, warm) = (bench.pings.max(1), warmup(bench.pings));

    // The reference: 64 bytes each way on one TCP connection.
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let peer = spawn_tcp_peer(listener, move |mut stream| async move {
        let mut buf = [0u8; TCP_PING_BYTES];
        for _ in 0..warm + pings {
            stream.read_exact(&mut buf).await?;
            stream.write_all(&buf).await?;
        }
        anyhow::Ok(())
    });
    let (tcp_rate, tcp) = rt.block_on(async {
        let mut stream = tcp_connect(addr).await?;
        let mut buf = [0x5au8; TCP_PING_BYTES];
        timed_round_trips(warm, pings, async |_| -> anyhow::Result<()> {
            stream.write_all(&buf).await?;
            stream.read_exact(&mut buf).await?;
            Ok(())
        })
        .await
    })?;
    join_peer(peer)?;
    let tcp_p50 = micros(&tcp, 0.5);
    let mut records = Vec::new();
    let mut r = Record::new(
        "net.ping",
        "tcp",
        json!({ "pings": pings, "bytes": TCP_PING_BYTES, "nodelay": true }),
        "tcp",
    );
    r.ops_per_s = Some(tcp_rate);
    r.set_latency(&tcp);
    r.ratio = Some(1.0);
    out.print(&r);
    records.push(r);

    let udp = udp_counters();
    let transport = volume.transport_stats();
    let (quic_rate, quic) = rt.block_on(timed_round_trips(
        warm,
        pings,
        async |i| -> anyhow::Result<()> {
            volume.ping().await.with_context(|| format!("PING {i}"))?;
            Ok(())
        },
    ))?;
    note_udp(out, "net.ping quic", udp.as_ref());
    note_transport(out, "net.ping quic", transport, volume, warm + pings);
    let mut r = Record::new(
        "net.ping",
        "quic",
        json!({ "pings": pings, "frame_bytes": frame_bytes }),
        "tcp",
    );
    r.ops_per_s = Some(quic_rate);
    r.set_latency(&quic);
    r.ratio = Some(tcp_p50 / micros(&quic, 0.5));
    out.print(&r);
    records.push(r);
    Ok(records)
}
