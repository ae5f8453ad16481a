//! (c) bulk: one file written, then read, in 1 MiB requests over QUIC, once per client
//! connection count and UDP payload cap, against the same bytes copied over as many TCP
//! connections on loopback.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use bytes::Bytes;
use hdrhistogram::Histogram;
use kiln_client::{BrickClient, CONNECTIONS_MAX, Fd, Layer, LayerExt, Paths};
use kiln_dataplane::server::Server;
use kiln_wire::limits::IO_SIZE_MAX_BYTES;
use kiln_wire::*;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinSet;

use super::{
    NetBench, SHUTDOWN_GRACE, client_runtime, join_peer, note_udp, spawn_tcp_peer, tcp_connect,
    udp_counters,
};
use crate::bricks::Served;
use crate::report::{Record, Reporter, histogram, nanos};

/// Bytes per bulk request (the protocol's largest READ or WRITE).
const BULK_REQUEST_BYTES: usize = IO_SIZE_MAX_BYTES;

/// The content of bulk request `i` (so a read that returns the wrong chunk is caught).
fn bulk_chunk(i: usize) -> Bytes {
    let salt = (i % 251) as u8;
    Bytes::from(
        (0..BULK_REQUEST_BYTES)
            .map(|b| (b % 253) as u8 ^ salt)
            .collect::<Vec<u8>>(),
    )
}

/// Chunks cycle through this many patterns (memory stays bounded whatever `bulk_mib`).
const BULK_PATTERNS: usize = 4;

/// (c) bulk: per connection count, a TCP copy over as many connections, then QUIC write +
/// read once per UDP payload cap.
pub(super) fn bulk(
    bench: &NetBench,
    setup: &Served,
    rt: &tokio::runtime::Runtime,
    first: (Server, BrickClient),
    out: &mut Reporter,
) -> anyhow::Result<Vec<Record>> {
    let mib = bench.bulk_mib.max(1);
    // The first connection (create, ping) is done; each bulk run gets a fresh server and
    // connection, so both caps start from the same state (path MTU discovery from scratch).
    let (server, volume) = first;
    rt.block_on(async {
        volume.close().await;
        server.shutdown(SHUTDOWN_GRACE).await;
    });
    let chunks: Arc<Vec<Bytes>> = Arc::new((0..BULK_PATTERNS).map(bulk_chunk).collect());
    let mut records = Vec::new();
    for &connections in &bench.bulk_connections {
        if !(1..=CONNECTIONS_MAX).contains(&connections) {
            bail!("{connections} bulk connections: 1 to {CONNECTIONS_MAX} are allowed");
        }
        // One connection runs on the bench's client runtime; several, whose drivers are
        // tasks of their own, on a runtime with a thread per core, the TCP reference too.
        let threads = match connections {
            1 => bench.client_threads,
            _ => std::thread::available_parallelism().map_or(2, usize::from),
        };
        let own = (connections > 1)
            .then(|| client_runtime(threads))
            .transpose()?;
        let rt = own.as_ref().unwrap_or(rt);
        let run = BulkRun {
            mib,
            connections,
            client_threads: threads.max(1),
        };
        records.extend(run.measure(bench, setup, rt, &chunks, out)?);
    }
    Ok(records)
}

/// One connection count's bulk runs.
struct BulkRun {
    mib: usize,
    connections: usize,
    /// The client runtime's threads (a current-thread runtime is one).
    client_threads: usize,
}

impl BulkRun {
    fn params(&self) -> serde_json::Value {
        json!({ "mib": self.mib, "request_kib": BULK_REQUEST_BYTES / 1024,
                "connections": self.connections, "client_threads": self.client_threads })
    }

    /// The TCP reference, then a QUIC write and read per UDP payload cap, each on a fresh
    /// server and client.
    fn measure(
        &self,
        bench: &NetBench,
        setup: &Served,
        rt: &tokio::runtime::Runtime,
        chunks: &Arc<Vec<Bytes>>,
        out: &mut Reporter,
    ) -> anyhow::Result<Vec<Record>> {
        let (mib, connections) = (self.mib, self.connections);
        let tcp_rate = tcp_bulk(rt, mib, connections)?;
        let mut r = Record::new("net.bulk", "tcp", self.params(), "tcp");
        r.mib_per_s = Some(tcp_rate);
        r.ratio = Some(1.0);
        out.print(&r);
        let mut records = vec![r];
        for &udp_payload in &bench.bulk_udp_payloads {
            let (server, volume) =
                rt.block_on(setup.serve_and_connect_with(udp_payload, connections))?;
            let mut params = self.params();
            params["inflight"] = json!(bench.bulk_inflight.max(1));
            params["udp_payload"] = json!(udp_payload);
            let run = QuicBulk {
                rt,
                volume: &volume,
                mib,
                inflight: bench.bulk_inflight,
                chunks,
                path: format!("/bulk-{udp_payload}-{connections}"),
                phase: |dir: &str| {
                    format!(
                        "net.bulk_{dir} quic udp_payload={udp_payload} connections={connections}"
                    )
                },
            };
            let (gfid, write_rate, h) = run.write(out)?;
            let r = bulk_record("net.bulk_write", params.clone(), write_rate, &h, tcp_rate);
            out.print(&r);
            records.push(r);
            let (read_rate, h) = run.read(gfid, out)?;
            let r = bulk_record("net.bulk_read", params, read_rate, &h, tcp_rate);
            out.print(&r);
            records.push(r);

            rt.block_on(async {
                volume.close().await;
                server.shutdown(SHUTDOWN_GRACE).await;
            });
        }
        Ok(records)
    }
}

/// The reference: `mib` MiB over `connections` TCP connections (a share each) in 1 MiB
/// writes, each to a reader thread that acknowledges its last byte. Returns MiB/s.
fn tcp_bulk(rt: &tokio::runtime::Runtime, mib: usize, connections: usize) -> anyhow::Result<f64> {
    let shares: Vec<usize> = (0..connections)
        .map(|i| mib / connections + usize::from(i < mib % connections))
        .collect();
    let mut peers = Vec::with_capacity(connections);
    let mut addrs = Vec::with_capacity(connections);
    for &share in &shares {
        let total = share * BULK_REQUEST_BYTES;
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        addrs.push(listener.local_addr()?);
        peers.push(spawn_tcp_peer(listener, move |mut stream| async move {
            let mut buf = vec![0u8; BULK_REQUEST_BYTES];
            let mut got = 0;
            // Every read returns at least one byte, so this is at most `total` reads.
            while got < total {
                match stream.read(&mut buf).await? {
                    0 => bail!("TCP copy ended after {got} of {total} bytes"),
                    n => got += n,
                }
            }
            stream.write_all(&[1]).await?;
            anyhow::Ok(())
        }));
    }
    let tcp_rate = rt.block_on(async {
        let mut streams = Vec::with_capacity(connections);
        for addr in addrs {
            streams.push(tcp_connect(addr).await?);
        }
        let buf = bulk_chunk(0);
        let start = Instant::now();
        let mut writers = JoinSet::new();
        for (mut stream, share) in streams.into_iter().zip(shares) {
            let buf = buf.clone();
            writers.spawn(async move {
                for _ in 0..share {
                    stream.write_all(&buf).await?;
                }
                let mut ack = [0u8; 1];
                stream.read_exact(&mut ack).await?;
                anyhow::Ok(())
            });
        }
        while let Some(done) = writers.join_next().await {
            done??;
        }
        anyhow::Ok(mib as f64 / start.elapsed().as_secs_f64())
    })?;
    for peer in peers {
        join_peer(peer)?;
    }
    Ok(tcp_rate)
}

/// The record of a QUIC bulk phase, its ratio to TCP's MiB/s.
fn bulk_record(
    bench: &str,
    params: serde_json::Value,
    rate: f64,
    h: &Histogram<u64>,
    tcp_rate: f64,
) -> Record {
    let mut r = Record::new(bench, "quic", params, "tcp");
    r.mib_per_s = Some(rate);
    r.set_latency(h);
    r.ratio = Some(rate / tcp_rate);
    r
}

/// One bulk run over a fresh connection: a file written, then read back and removed.
struct QuicBulk<'a, P> {
    rt: &'a tokio::runtime::Runtime,
    volume: &'a BrickClient,
    mib: usize,
    inflight: usize,
    chunks: &'a Arc<Vec<Bytes>>,
    path: String,
    /// The `udp` note's phase for a direction.
    phase: P,
}

impl<P: Fn(&str) -> String> QuicBulk<'_, P> {
    /// Creates the file and writes it; checks its size. Returns its GFID, MiB/s and the
    /// latency of each WRITE.
    fn write(&self, out: &mut Reporter) -> anyhow::Result<(Gfid, f64, Histogram<u64>)> {
        let total = self.mib * BULK_REQUEST_BYTES;
        let fd = self
            .rt
            .block_on(self.volume.create_file(&Creds::root(), &self.path, 0o644))?;
        let gfid = fd.gfid();
        let (write_rate, h) =
            self.requests(fd, "write", out, |volume, fd, chunk, i| async move {
                volume
                    .write(&Creds::root(), &fd, (i * BULK_REQUEST_BYTES) as u64, chunk)
                    .await
                    .with_context(|| format!("WRITE of MiB {i}"))?;
                anyhow::Ok(())
            })?;
        let size = self
            .rt
            .block_on(self.volume.stat(&Creds::root(), gfid))?
            .size;
        if size != total as u64 {
            bail!("bulk file has {size} bytes, not {total}");
        }
        Ok((gfid, write_rate, h))
    }

    /// Reads the file back, checking every MiB, and removes it. Returns MiB/s and the
    /// latency of each READ.
    fn read(&self, gfid: Gfid, out: &mut Reporter) -> anyhow::Result<(f64, Histogram<u64>)> {
        let fd = self.rt.block_on(self.volume.open(
            &Creds::root(),
            gfid,
            AccessMode::ReadOnly,
            OpenFlags::empty(),
        ))?;
        let (read_rate, h) = self.requests(fd, "read", out, |volume, fd, chunk, i| async move {
            let got = volume
                .read(
                    &Creds::root(),
                    &fd,
                    (i * BULK_REQUEST_BYTES) as u64,
                    BULK_REQUEST_BYTES as u32,
                )
                .await
                .with_context(|| format!("READ of MiB {i}"))?;
            if got != chunk {
                bail!("READ of MiB {i}: {} bytes, not what was written", got.len());
            }
            anyhow::Ok(())
        })?;
        self.rt
            .block_on(self.volume.remove_all(&Creds::root(), &self.path))?;
        Ok((read_rate, h))
    }

    /// Runs the 1 MiB requests `0..mib` through `io` (given the client, the shared `fd`, the
    /// chunk written at that MiB and the MiB's index), notes the UDP counters of `direction`
    /// and releases `fd`. Returns MiB/s and the latency of each request.
    fn requests<F, Fut>(
        &self,
        fd: Fd,
        direction: &str,
        out: &mut Reporter,
        io: F,
    ) -> anyhow::Result<(f64, Histogram<u64>)>
    where
        F: Fn(BrickClient, Arc<Fd>, Bytes, usize) -> Fut,
        Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let fd = Arc::new(fd);
        let udp = udp_counters();
        let (rate, h) = self.rt.block_on(bulk_io(self.mib, self.inflight, {
            let (volume, fd, chunks) = (self.volume.clone(), fd.clone(), self.chunks.clone());
            move |i| {
                let chunk = chunks[i % BULK_PATTERNS].clone();
                io(volume.clone(), fd.clone(), chunk, i)
            }
        }))?;
        note_udp(out, &(self.phase)(direction), udp.as_ref());
        let fd = Arc::try_unwrap(fd).map_err(|_| anyhow::anyhow!("bulk fd still shared"))?;
        self.rt.block_on(self.volume.release(&Creds::root(), fd))?;
        Ok((rate, h))
    }
}

/// Runs requests `0..mib` through `io`, at most `inflight` at once. Returns MiB/s and the
/// latency of each request.
async fn bulk_io<F, Fut>(
    mib: usize,
    inflight: usize,
    io: F,
) -> anyhow::Result<(f64, Histogram<u64>)>
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let inflight = inflight.max(1);
    let mut h = histogram()?;
    let mut tasks = JoinSet::new();
    let start = Instant::now();
    for i in 0..mib {
        if tasks.len() >= inflight
            && let Some(done) = tasks.join_next().await
        {
            h.record(nanos(done??))?;
        }
        let request = io(i);
        tasks.spawn(async move {
            let t = Instant::now();
            request.await?;
            anyhow::Ok(t.elapsed())
        });
    }
    while let Some(done) = tasks.join_next().await {
        h.record(nanos(done??))?;
    }
    Ok((mib as f64 / start.elapsed().as_secs_f64(), h))
}
