//! QUIC between two in-process endpoints on `quic::QuicRuntime`:
//!
//! * calls spaced apart cost one datagram each way (a stream dropped before its end was read
//!   would send STOP_SENDING after the call, and the peer would acknowledge it alone);
//! * a stream crosses an endpoint whose sends find the socket's buffer full: each blocked send
//!   waits for room (the socket is not watched for writing otherwise) instead of failing or
//!   hanging. Needs root: it makes a network namespace whose loopback holds datagrams in a
//!   token-bucket queue, so they stay charged to the sender's tiny send buffer until the queue
//!   lets them go.

// `unshare(CLONE_NEWNET)` is unsafe in rustix only for `CLONE_FILES`.
#![allow(unsafe_code)]

use std::net::{SocketAddr, UdpSocket};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use kiln_wire::quic::{self, QuicRuntime, Spawn};
use kiln_wire::{BodyChecksum, Call, Message, Outcome, Ping, Reply, Request};
use quinn::rustls::pki_types::{CertificateDer, PrivatePkcs8KeyDer};

/// Bytes sent: ~90 datagrams, each of which a 4 KiB send buffer holds at most two of.
const SENT_BYTES: usize = 128 * 1024;
/// Calls made one after the other, with a pause between them.
const CALLS: u64 = 20;
/// Longer than a round trip, far shorter than quinn's 25 ms `max_ack_delay`: each call's
/// acknowledgement can ride in the next call's first datagram.
const PAUSE: Duration = Duration::from_millis(2);
/// Past this the wait is taken for a hang.
const TEST_TIMEOUT: Duration = Duration::from_secs(30);

#[test]
fn calls_spaced_apart_cost_one_datagram_each_way() {
    let runtime = current_thread();
    tokio::task::LocalSet::new().block_on(&runtime, async {
        tokio::time::timeout(TEST_TIMEOUT, spaced_calls())
            .await
            .expect("the calls finished");
    });
}

async fn spaced_calls() {
    let (server, cert) = server_endpoint(UdpSocket::bind("127.0.0.1:0").expect("bind"));
    let server_addr = server.local_addr().expect("address");
    let answering = tokio::task::spawn_local(async move {
        let connection = accept(&server).await;
        for _ in 0..CALLS {
            let (mut send, mut recv) = connection.accept_bi().await.expect("a call");
            let Message::Request(Request {
                id,
                call: Call::Ping(ping),
            }) = quic::read_message(&mut recv, BodyChecksum::Required)
                .await
                .expect("a request")
            else {
                panic!("not a PING");
            };
            let reply = Message::Reply(Reply {
                id,
                outcome: Outcome::Ping(ping),
            });
            quic::write_message(&mut send, &reply, BodyChecksum::Required)
                .await
                .expect("the reply");
        }
        connection
    });
    let (_client, connection) = client_connection(
        UdpSocket::bind("127.0.0.1:0").expect("bind"),
        server_addr,
        cert,
    )
    .await;
    // The first calls settle the path (MTU probes): only the later ones are counted.
    let mut first = connection.stats();
    for id in 0..CALLS {
        if id == CALLS / 2 {
            first = connection.stats();
        }
        let (mut send, mut recv) = connection.open_bi().await.expect("a stream");
        let call = Call::Ping(Ping { nonce: id });
        quic::write_message(
            &mut send,
            &Message::Request(Request { id, call }),
            BodyChecksum::Required,
        )
        .await
        .expect("the request");
        let reply = quic::read_message(&mut recv, BodyChecksum::Required)
            .await
            .expect("the reply");
        assert!(matches!(reply, Message::Reply(Reply { id: got, .. }) if got == id));
        tokio::time::sleep(PAUSE).await;
    }
    let server_side = answering.await.expect("the server").stats();
    let stats = connection.stats();
    assert_eq!(
        stats.frame_tx.stop_sending, 0,
        "the client stopped a stream it had read"
    );
    assert_eq!(
        server_side.frame_tx.stop_sending, 0,
        "the brick stopped a stream it had read"
    );
    let counted = CALLS - CALLS / 2;
    let sent = stats.udp_tx.datagrams - first.udp_tx.datagrams;
    assert!(
        sent <= counted + 2,
        "{sent} datagrams sent for {counted} calls"
    );
    let received = stats.udp_rx.datagrams - first.udp_rx.datagrams;
    assert!(
        received <= counted + 2,
        "{received} datagrams received for {counted} calls"
    );
}

#[test]
fn a_stream_crosses_a_socket_whose_send_buffer_is_full() {
    assert!(
        rustix::process::geteuid().is_root(),
        "this test makes a network namespace and needs root"
    );
    std::thread::spawn(|| {
        // SAFETY: only the network namespace is unshared, not the descriptor table.
        unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNET) }
            .expect("a network namespace of this thread's own");
        run(&["ip", "link", "set", "lo", "up"]);
        run(&[
            "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "8mbit", "burst", "16kb",
            "latency", "1s",
        ]);
        let blocked_before = udp_sndbuf_errors();
        let runtime = current_thread();
        let received = tokio::task::LocalSet::new().block_on(&runtime, async {
            tokio::time::timeout(TEST_TIMEOUT, transfer())
                .await
                .expect("the transfer finished")
        });
        assert_eq!(
            received,
            pattern(SENT_BYTES),
            "the bytes arrived whole, in order"
        );
        assert!(
            udp_sndbuf_errors() > blocked_before,
            "no send found the buffer full: the wait was not exercised"
        );
    })
    .join()
    .expect("the test thread");
}

/// Sends [`SENT_BYTES`] from a client endpoint with a tiny send buffer to a server endpoint
/// whose drivers run on this thread's `LocalSet`; what the server read.
async fn transfer() -> Vec<u8> {
    let (server, cert) = server_endpoint(UdpSocket::bind("127.0.0.1:0").expect("bind"));
    let server_addr = server.local_addr().expect("address");
    let reader = tokio::task::spawn_local(async move {
        let connection = accept(&server).await;
        let (_, mut recv) = connection.accept_bi().await.expect("a stream");
        recv.read_to_end(2 * SENT_BYTES).await.expect("read")
    });
    let socket = UdpSocket::bind("127.0.0.1:0").expect("bind");
    rustix::net::sockopt::set_socket_send_buffer_size(&socket, 4096).expect("small buffer");
    let (_client, connection) = client_connection(socket, server_addr, cert).await;
    let (mut send, _recv) = connection.open_bi().await.expect("a stream");
    send.write_all(&pattern(SENT_BYTES)).await.expect("write");
    send.finish().expect("finish");
    let received = reader.await.expect("the reader");
    connection.close(0u32.into(), b"done");
    received
}

/// A server endpoint on `socket` with a throwaway certificate, its drivers on the current
/// `LocalSet`, as on a brick's worker; the certificate, for the client to trust.
fn server_endpoint(socket: UdpSocket) -> (quinn::Endpoint, CertificateDer<'static>) {
    let key = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).expect("cert");
    let cert = CertificateDer::from(key.cert.der().to_vec());
    let config = quinn::ServerConfig::with_single_cert(
        vec![cert.clone()],
        PrivatePkcs8KeyDer::from(key.signing_key.serialize_der()).into(),
    )
    .expect("server config");
    let endpoint = quinn::Endpoint::new(
        quic::endpoint_config(),
        Some(config),
        socket,
        QuicRuntime::new(Spawn::Local),
    )
    .expect("server endpoint");
    (endpoint, cert)
}

/// The next connection `server` accepts, handshake done.
async fn accept(server: &quinn::Endpoint) -> quinn::Connection {
    server
        .accept()
        .await
        .expect("incoming")
        .await
        .expect("handshake")
}

/// A client endpoint on `socket`, its drivers on the runtime, connected to `server`.
async fn client_connection(
    socket: UdpSocket,
    server: SocketAddr,
    cert: CertificateDer<'static>,
) -> (quinn::Endpoint, quinn::Connection) {
    let mut endpoint = quinn::Endpoint::new(
        quic::endpoint_config(),
        None,
        socket,
        QuicRuntime::new(Spawn::Runtime),
    )
    .expect("client endpoint");
    let mut roots = quinn::rustls::RootCertStore::empty();
    roots.add(cert).expect("root");
    endpoint.set_default_client_config(
        quinn::ClientConfig::with_root_certificates(Arc::new(roots)).expect("client config"),
    );
    let connection = endpoint
        .connect(server, "localhost")
        .expect("connect")
        .await
        .expect("handshake");
    (endpoint, connection)
}

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

fn run(command: &[&str]) {
    let status = Command::new(command[0])
        .args(&command[1..])
        .status()
        .unwrap_or_else(|e| panic!("{}: {e}", command[0]));
    assert!(status.success(), "{command:?}: {status}");
}

/// UDP sends refused for want of buffer room in this thread's network namespace so far.
fn udp_sndbuf_errors() -> u64 {
    let snmp = std::fs::read_to_string("/proc/thread-self/net/snmp").expect("snmp");
    let mut udp = snmp.lines().filter(|line| line.starts_with("Udp: "));
    let (names, values) = (udp.next().expect("names"), udp.next().expect("values"));
    let column = names
        .split_whitespace()
        .position(|name| name == "SndbufErrors")
        .expect("a SndbufErrors column");
    values
        .split_whitespace()
        .nth(column)
        .expect("a value")
        .parse()
        .expect("a count")
}
