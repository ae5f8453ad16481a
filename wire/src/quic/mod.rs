//! How messages travel on QUIC (feature `quic`): the mapping both ends share.
//!
//! * Every call is one bidirectional stream: the client writes one request frame and finishes
//!   its side; the brick writes one reply frame and finishes. QUIC multiplexes the streams, so
//!   a slow 1 MiB read never holds up a `stat` behind it, and the brick's limit on concurrent
//!   streams *is* the in-flight limit: a client at the limit waits for stream credit
//!   (backpressure) instead of queueing without bound.
//! * The first call on a connection is HELLO; the brick answers nothing else before it.
//! * Events (INVALIDATE) come on unidirectional streams from the brick, one frame each.
//! * A stream whose frame does not decode is reset with [`StreamCode::BadFrame`]; other
//!   streams and the connection carry on.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use quinn::{RecvStream, SendStream, VarInt};

use crate::limits::{FRAME_BODY_LEN_MAX_BYTES, FRAME_HEADER_LEN_BYTES};
use crate::{BodyChecksum, DecodeError, EncodeError, Header, Message};

mod runtime;
mod steer;

pub use runtime::{QuicRuntime, Spawn};
pub use steer::steer_by_source_port;

/// The TLS application protocol name. Versions are negotiated by HELLO, not by ALPN, so a
/// client of another version gets a clear answer instead of a failed handshake.
pub const ALPN: &[u8] = b"kiln";

/// The largest UDP payload either end sends or accepts: what the loopback's 64 KiB MTU carries
/// over IPv6 (65 536 less a 40-byte IPv6 and an 8-byte UDP header; IPv4 would allow 65 507).
/// Path MTU discovery finds what a real network carries.
pub const UDP_PAYLOAD_MAX_BYTES: u16 = 65_488;

/// Largest datagram for which segmentation offload (GSO) stays on. quinn hands the kernel up
/// to 10 datagrams per GSO send and the kernel refuses a send over 64 KiB (EMSGSIZE), which
/// quinn takes for a failed MTU probe: the whole batch is lost and the path falls back to
/// 1200 bytes. So large-datagram paths (loopback, jumbo frames) send one datagram per call,
/// and only Ethernet-sized ones use GSO.
pub const GSO_DATAGRAM_MAX_BYTES: u16 = 6_553;

/// A peer silent for this long is gone: the connection fails and its calls get an error (a
/// killed brick is noticed this fast). Keep-alives keep idle but live connections open.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a stream was reset or stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum StreamCode {
    /// The frame on this stream did not decode.
    BadFrame = 1,
    /// The brick is shutting down and did not take this call.
    ShuttingDown = 2,
}

impl From<StreamCode> for VarInt {
    fn from(code: StreamCode) -> VarInt {
        VarInt::from_u32(code as u32)
    }
}

/// Why a connection was closed (the QUIC application close code).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum CloseCode {
    /// Closed by its owner; nothing went wrong.
    Done = 0,
    /// The peer speaks a protocol version or sent a first call this end cannot serve.
    Protocol = 1,
    /// The client's identity is not allowed on this brick (`auth.allow`).
    NotAllowed = 2,
    /// The brick is shutting down.
    ShuttingDown = 3,
    /// The brick, or this client's certificate, is at its connection limit.
    TooManyConnections = 4,
}

impl From<CloseCode> for VarInt {
    fn from(code: CloseCode) -> VarInt {
        VarInt::from_u32(code as u32)
    }
}

/// The streams one end lets its peer open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerStreams {
    /// A brick accepts this many calls in flight (`network.inflight-max`) and no events.
    Calls(u32),
    /// A client accepts event streams and no calls.
    Events,
}

/// Event streams a client accepts at once.
pub const EVENT_STREAMS_MAX: u32 = 64;

/// Transport parameters both ends use. `peer` bounds what the other end may open (for a
/// brick, the calls in flight on one connection); path MTU discovery probes up to
/// `udp_payload_max` bytes; a peer silent for `idle_timeout` is gone (keep-alives go out at
/// a quarter of it).
pub fn transport_config(
    peer: PeerStreams,
    udp_payload_max: u16,
    idle_timeout: Duration,
) -> Arc<quinn::TransportConfig> {
    let (calls, events) = match peer {
        PeerStreams::Calls(n) => (n, 0),
        PeerStreams::Events => (0, EVENT_STREAMS_MAX),
    };
    const FRAME_MAX_BYTES: u32 = (FRAME_HEADER_LEN_BYTES + FRAME_BODY_LEN_MAX_BYTES) as u32;
    let frame_max = FRAME_MAX_BYTES;
    let mut t = quinn::TransportConfig::default();
    t.max_concurrent_bidi_streams(VarInt::from_u32(calls))
        .max_concurrent_uni_streams(VarInt::from_u32(events))
        // One whole frame fits in a stream's window, so a 1 MiB write never stalls on
        // per-stream credit; the connection window bounds what all streams hold together.
        .stream_receive_window(VarInt::from_u32(frame_max))
        .receive_window(VarInt::from_u32(32 * frame_max))
        .send_window(32 * u64::from(frame_max))
        .max_idle_timeout(idle_timeout.try_into().ok())
        .keep_alive_interval(Some(idle_timeout / 4))
        .mtu_discovery_config(Some({
            let mut mtu = quinn::MtuDiscoveryConfig::default();
            mtu.upper_bound(udp_payload_max);
            mtu
        }))
        .enable_segmentation_offload(udp_payload_max <= GSO_DATAGRAM_MAX_BYTES);
    Arc::new(t)
}

/// Endpoint parameters both ends use: accept datagrams up to [`UDP_PAYLOAD_MAX_BYTES`].
pub fn endpoint_config() -> quinn::EndpointConfig {
    let mut config = quinn::EndpointConfig::default();
    // The constant is within QUIC's bounds (1200..=65527), so this cannot fail.
    let _ = config.max_udp_payload_size(UDP_PAYLOAD_MAX_BYTES);
    config
}

/// Socket buffer size asked for on each UDP socket, in bytes: a burst of 1 MiB writes from
/// many streams overflows the kernel's default and costs retransmissions.
pub const UDP_BUFFER_BYTES: usize = 8 * 1024 * 1024;

/// A UDP socket bound to `addr` for an endpoint, with large buffers (forced past
/// `net.core.rmem_max` when the process may). With `reuse_port`, several endpoints share the
/// port and the kernel spreads clients over them by address.
pub fn udp_socket(addr: SocketAddr, reuse_port: bool) -> std::io::Result<std::net::UdpSocket> {
    use rustix::net::{AddressFamily, SocketType, sockopt};
    let family = match addr {
        SocketAddr::V4(_) => AddressFamily::INET,
        SocketAddr::V6(_) => AddressFamily::INET6,
    };
    let fd = rustix::net::socket(family, SocketType::DGRAM, None)?;
    if reuse_port {
        sockopt::set_socket_reuseport(&fd, true)?;
    }
    if sockopt::set_socket_recv_buffer_size_force(&fd, UDP_BUFFER_BYTES).is_err() {
        sockopt::set_socket_recv_buffer_size(&fd, UDP_BUFFER_BYTES)?;
    }
    if sockopt::set_socket_send_buffer_size_force(&fd, UDP_BUFFER_BYTES).is_err() {
        sockopt::set_socket_send_buffer_size(&fd, UDP_BUFFER_BYTES)?;
    }
    rustix::net::bind(&fd, &addr)?;
    Ok(std::net::UdpSocket::from(fd))
}

/// Reading or writing one frame on a stream failed.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("the stream ended before a whole frame arrived")]
    Truncated,
    #[error("bad frame: {0}")]
    Decode(#[from] DecodeError),
    #[error("cannot encode: {0}")]
    Encode(#[from] EncodeError),
    #[error("stream read failed: {0}")]
    Read(#[from] quinn::ReadError),
    #[error("stream write failed: {0}")]
    Write(#[from] quinn::WriteError),
    #[error("stream already closed")]
    Closed(#[from] quinn::ClosedStream),
}

/// Writes `message` as one frame (with its body checksum or without, as the session
/// negotiated) and finishes the stream. Payload chunks go to quinn as the same `Bytes`,
/// uncopied.
pub async fn write_message(
    send: &mut SendStream,
    message: &Message,
    crc: BodyChecksum,
) -> Result<(), StreamError> {
    let frame = message.encode_with(crc)?;
    let mut chunks = Vec::with_capacity(frame.body.len() + 1);
    chunks.push(Bytes::copy_from_slice(&frame.header));
    chunks.extend(frame.body);
    send.write_all_chunks(&mut chunks).await?;
    send.finish()?;
    Ok(())
}

/// Reads one frame from `recv`. The length is checked against the protocol limit before
/// anything is allocated, and memory is taken only as bytes arrive (a peer that announces a
/// 1 MiB body and sends one byte holds one byte); a body that arrives in one QUIC chunk is
/// kept without a copy. A body without a checksum is taken where `crc` allows it.
pub async fn read_message(
    recv: &mut RecvStream,
    crc: BodyChecksum,
) -> Result<Message, StreamError> {
    let mut head = [0u8; FRAME_HEADER_LEN_BYTES];
    read_exact(recv, &mut head).await?;
    let header = Header::decode(&head)?;
    let body = read_body(recv, header.body_len as usize).await?;
    take_end(recv);
    Ok(Message::decode_with(&header, body, crc)?)
}

/// Takes the stream's end if it came with the frame, as it does when the peer finishes right
/// after writing (both ends do): a stream dropped before its end was read sends STOP_SENDING,
/// which goes out in a packet of its own once the call is over and costs the peer an ACK in
/// another, two datagrams each way per call instead of one. Never waits: a peer that has not
/// finished yet is answered all the same.
fn take_end(recv: &mut RecvStream) {
    let mut end = std::pin::pin!(recv.read_chunk(1, true));
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    // Bytes past the frame, or no end yet: the stream is dropped unread, as before.
    let _ = end.as_mut().poll(&mut cx);
}

async fn read_exact(recv: &mut RecvStream, buf: &mut [u8]) -> Result<(), StreamError> {
    let mut filled = 0;
    while filled < buf.len() {
        match recv.read(&mut buf[filled..]).await? {
            Some(n) => filled += n,
            None => return Err(StreamError::Truncated),
        }
    }
    Ok(())
}

async fn read_body(recv: &mut RecvStream, len: usize) -> Result<Bytes, StreamError> {
    if len == 0 {
        return Ok(Bytes::new());
    }
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut received = 0;
    while received < len {
        let chunk = recv
            .read_chunk(len - received, true)
            .await?
            .ok_or(StreamError::Truncated)?
            .bytes;
        received += chunk.len();
        chunks.push(chunk);
    }
    if let [one] = chunks.as_slice() {
        return Ok(one.clone());
    }
    // Every byte is here: one copy into a buffer of exactly that size.
    let mut body = BytesMut::with_capacity(len);
    for chunk in chunks {
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}
