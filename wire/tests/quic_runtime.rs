//! `quic::QuicRuntime` on real sockets: a stream crosses an endpoint whose sends find the
//! socket's buffer full, and each blocked send waits for room (its socket is not watched for
//! writing otherwise) instead of failing or hanging. Needs root: it makes a network namespace
//! whose loopback holds datagrams in a token-bucket queue, so they stay charged to the sender's
//! tiny send buffer until the queue lets them go.

// `unshare(CLONE_NEWNET)` is unsafe in rustix only for `CLONE_FILES`.
#![allow(unsafe_code)]

use std::net::{SocketAddr, UdpSocket};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use kiln_wire::quic::{self, QuicRuntime, Spawn};
use quinn::rustls::pki_types::{CertificateDer, PrivatePkcs8KeyDer};

/// Bytes sent: ~90 datagrams, each of which a 4 KiB send buffer holds at most two of.
const SENT_BYTES: usize = 128 * 1024;
/// The transfer takes ~0.13 s through the bucket; past this the wait is taken for a hang.
const TRANSFER_TIMEOUT: Duration = Duration::from_secs(30);

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
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let received = tokio::task::LocalSet::new().block_on(&runtime, async {
            tokio::time::timeout(TRANSFER_TIMEOUT, transfer())
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
    let key = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).expect("cert");
    let cert = CertificateDer::from(key.cert.der().to_vec());
    let server_config = quinn::ServerConfig::with_single_cert(
        vec![cert.clone()],
        PrivatePkcs8KeyDer::from(key.signing_key.serialize_der()).into(),
    )
    .expect("server config");
    let server = quinn::Endpoint::new(
        quic::endpoint_config(),
        Some(server_config),
        UdpSocket::bind("127.0.0.1:0").expect("bind"),
        QuicRuntime::new(Spawn::Local),
    )
    .expect("server endpoint");
    let server_addr: SocketAddr = server.local_addr().expect("address");
    let reader = tokio::task::spawn_local(async move {
        let connection = server
            .accept()
            .await
            .expect("incoming")
            .await
            .expect("handshake");
        let (_, mut recv) = connection.accept_bi().await.expect("a stream");
        recv.read_to_end(2 * SENT_BYTES).await.expect("read")
    });

    let socket = UdpSocket::bind("127.0.0.1:0").expect("bind");
    rustix::net::sockopt::set_socket_send_buffer_size(&socket, 4096).expect("small buffer");
    let mut client = quinn::Endpoint::new(
        quic::endpoint_config(),
        None,
        socket,
        QuicRuntime::new(Spawn::Runtime),
    )
    .expect("client endpoint");
    let mut roots = quinn::rustls::RootCertStore::empty();
    roots.add(cert).expect("root");
    client.set_default_client_config(
        quinn::ClientConfig::with_root_certificates(Arc::new(roots)).expect("client config"),
    );
    let connection = client
        .connect(server_addr, "localhost")
        .expect("connect")
        .await
        .expect("handshake");
    let (mut send, _recv) = connection.open_bi().await.expect("a stream");
    send.write_all(&pattern(SENT_BYTES)).await.expect("write");
    send.finish().expect("finish");
    let received = reader.await.expect("the reader");
    connection.close(0u32.into(), b"done");
    received
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
