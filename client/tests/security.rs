//! Who gets in, and what bad input does: mutual TLS, auth.allow, protocol versions, malformed
//! and oversized frames from a raw QUIC client.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use common::{Cluster, runtime};
use kiln_admin::pki::{self, Role};
use kiln_client::brick::quinn_config;
use kiln_client::{BrickClient, ConnectOptions, Error};
use kiln_wire::quic::{self, StreamCode};
use kiln_wire::{
    BodyChecksum, Call, CallCode, Capabilities, ErrorCode, Header, Hello, Label, Message, Outcome,
    Ping, Reply, Request,
};

/// Connects with `options` and expects to be kept out.
async fn refused(options: ConnectOptions) -> Error {
    match BrickClient::connect(options).await {
        Ok(v) => match v.ping().await {
            Ok(()) => panic!("a client that should be refused got a call through"),
            Err(e) => e,
        },
        Err(e) => e,
    }
}

#[test]
fn only_certified_allowed_clients_get_in() {
    let cluster = Cluster::new();
    let brickd = cluster.start("127.0.0.1:0", &["--auth-allow", "alice,carol"]);
    let other = tempfile::tempdir().expect("tempdir");
    pki::init_ca(other.path()).expect("other ca");
    let outsider = pki::issue(other.path(), &Role::Client, "alice", 1).expect("cert");
    let now = time::OffsetDateTime::now_utc();
    let expired = pki::issue_valid_between(
        &cluster.tls,
        &Role::Client,
        "carol",
        now - time::Duration::days(10),
        now - time::Duration::days(1),
    )
    .expect("expired cert");
    let self_signed = rcgen::generate_simple_self_signed(vec!["alice".into()]).expect("cert");

    runtime().block_on(async {
        // The allowed client works.
        let alice = cluster.connect(brickd.addr, "alice").await;
        alice.ping().await.expect("alice is in");

        // A client of the same CA not in auth.allow is refused with the reason.
        let e = refused(cluster.options(brickd.addr, "bob")).await;
        assert!(
            matches!(&e, Error::Refused(why) if why.contains("auth.allow")),
            "{e:?}"
        );

        // A certificate from another CA, a self-signed one, an expired one.
        let mut options = cluster.options(brickd.addr, "alice");
        options.identity = pki::Identity {
            ca: options.identity.ca.clone(),
            ..pki::load_identity(&pki::ca_files(other.path()).cert, &outsider).expect("load")
        };
        refused(options).await;
        let mut options = cluster.options(brickd.addr, "alice");
        options.identity.chain = vec![self_signed.cert.der().clone()];
        options.identity.key =
            rustls_pki_types::PrivateKeyDer::Pkcs8(self_signed.signing_key.serialize_der().into());
        refused(options).await;
        let mut options = cluster.options(brickd.addr, "carol");
        options.identity =
            pki::load_identity(&pki::ca_files(&cluster.tls).cert, &expired).expect("load");
        refused(options).await;

        // No certificate at all.
        let e = raw_hello(brickd.addr, no_client_cert(&cluster)).await;
        assert!(e.is_err(), "a client without a certificate got a reply");

        // The allowed client was not disturbed.
        alice.ping().await.expect("alice still in");
        alice.close().await;
    });

    let logs = brickd.wait_for_log("peer sent no certificates");
    for why in [
        "client is not in auth.allow",
        // A self-signed certificate.
        "UnknownIssuer",
        // Another CA's certificate (that CA has the same name as the cluster's).
        "BadSignature",
        "certificate expired",
        "peer sent no certificates",
    ] {
        assert!(logs.contains(why), "the brick did not log {why:?}:\n{logs}");
    }
}

/// A TLS configuration that trusts the cluster CA but presents no client certificate.
fn no_client_cert(cluster: &Cluster) -> quinn::ClientConfig {
    let options = cluster.options("127.0.0.1:1".parse().expect("addr"), "alice");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(options.identity.ca).expect("root");
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("tls13")
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![quic::ALPN.to_vec()];
    quinn::ClientConfig::new(Arc::new(
        quinn::crypto::rustls::QuicClientConfig::try_from(tls).expect("quic"),
    ))
}

/// A raw connection (no HELLO yet).
async fn raw_connect(
    addr: SocketAddr,
    config: quinn::ClientConfig,
) -> Result<quinn::Connection, String> {
    let mut endpoint =
        quinn::Endpoint::client("127.0.0.1:0".parse().expect("addr")).map_err(|e| e.to_string())?;
    endpoint.set_default_client_config(config);
    endpoint
        .connect(addr, "127.0.0.1")
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())
}

fn hello(min: u8, max: u8) -> Message {
    Message::Request(Request {
        id: 1,
        call: Call::Hello(Hello {
            version_min: min,
            version_max: max,
            capabilities: Capabilities::NONE,
            client_name: Label::new(&b"raw"[..]).expect("label"),
        }),
    })
}

/// One call on a new stream; the reply or why there was none.
async fn round_trip(connection: &quinn::Connection, frame: &[Bytes]) -> Result<Message, String> {
    let (mut send, mut recv) = connection.open_bi().await.map_err(|e| e.to_string())?;
    send.write_all_chunks(&mut frame.to_vec())
        .await
        .map_err(|e| e.to_string())?;
    send.finish().map_err(|e| e.to_string())?;
    quic::read_message(&mut recv, BodyChecksum::Required)
        .await
        .map_err(|e| e.to_string())
}

fn frame(message: &Message) -> Vec<Bytes> {
    let encoded = message.encode().expect("encode");
    let mut chunks = vec![Bytes::copy_from_slice(&encoded.header)];
    chunks.extend(encoded.body);
    chunks
}

async fn raw_hello(addr: SocketAddr, config: quinn::ClientConfig) -> Result<Message, String> {
    let connection = raw_connect(addr, config).await?;
    round_trip(&connection, &frame(&hello(1, 1))).await
}

fn valid_config(cluster: &Cluster, addr: SocketAddr) -> quinn::ClientConfig {
    quinn_config(&cluster.options(addr, "alice")).expect("config")
}

#[test]
fn an_unknown_protocol_version_gets_a_clear_answer() {
    let cluster = Cluster::new();
    let brickd = cluster.start("127.0.0.1:0", &[]);
    runtime().block_on(async {
        // HELLO offering only versions this brick does not speak.
        let connection = raw_connect(brickd.addr, valid_config(&cluster, brickd.addr))
            .await
            .expect("connect");
        let reply = round_trip(&connection, &frame(&hello(2, 3)))
            .await
            .unwrap_or_else(|e| panic!("no answer: {e}\n{}", brickd.logs()));
        assert_eq!(
            reply,
            Message::Reply(Reply {
                id: 1,
                outcome: Outcome::Error {
                    call: CallCode::Hello,
                    error: ErrorCode::ProtoNotSupported
                }
            })
        );
        let closed = connection.closed().await;
        assert!(closed.to_string().contains("protocol versions"), "{closed}");

        // A frame header of another version.
        let connection = raw_connect(brickd.addr, valid_config(&cluster, brickd.addr))
            .await
            .expect("connect");
        let mut chunks = frame(&hello(1, 1));
        let mut header = chunks[0].to_vec();
        header[4] = 9;
        chunks[0] = Bytes::from(header);
        let reply = round_trip(&connection, &chunks).await.expect("an answer");
        assert!(
            matches!(
                reply,
                Message::Reply(Reply {
                    outcome: Outcome::Error {
                        error: ErrorCode::ProtoNotSupported,
                        ..
                    },
                    ..
                })
            ),
            "{reply:?}"
        );
        let closed = connection.closed().await;
        assert!(closed.to_string().contains("version 9"), "{closed}");
    });
}

#[test]
fn bad_frames_reset_only_their_own_stream() {
    let cluster = Cluster::new();
    let brickd = cluster.start("127.0.0.1:0", &[]);
    runtime().block_on(async {
        let bystander = cluster.connect(brickd.addr, "bob").await;
        let connection = raw_connect(brickd.addr, valid_config(&cluster, brickd.addr))
            .await
            .expect("connect");
        assert!(matches!(
            round_trip(&connection, &frame(&hello(1, 1))).await,
            Ok(Message::Reply(Reply {
                outcome: Outcome::Hello(_),
                ..
            }))
        ));

        let ping = Message::Request(Request {
            id: 2,
            call: Call::Ping(Ping { nonce: 42 }),
        });
        let good = frame(&ping);
        let oversized = {
            let mut header =
                Header::decode(good[0][..].try_into().expect("32 bytes")).expect("header");
            header.body_len = 64 * 1024 * 1024;
            vec![Bytes::copy_from_slice(&header.encode())]
        };
        let truncated = {
            let whole: Vec<u8> = good.iter().flat_map(|c| c.to_vec()).collect();
            vec![Bytes::from(whole[..whole.len() - 3].to_vec())]
        };
        let flipped = {
            let mut whole: Vec<u8> = good.iter().flat_map(|c| c.to_vec()).collect();
            let last = whole.len() - 1;
            whole[last] ^= 0x40;
            vec![Bytes::from(whole)]
        };
        let reply_kind = frame(&Message::Reply(Reply {
            id: 3,
            outcome: Outcome::Ping(Ping { nonce: 1 }),
        }));
        let garbage = vec![Bytes::from(vec![0xA5u8; 300])];
        for (what, bad) in [
            ("oversized", oversized),
            ("truncated", truncated),
            ("checksum", flipped),
            ("reply kind", reply_kind),
            ("garbage", garbage),
            ("empty", vec![]),
        ] {
            let e = round_trip(&connection, &bad)
                .await
                .expect_err("a bad frame gets no reply");
            let reset = format!("{}", StreamCode::BadFrame as u32);
            assert!(e.contains("reset") && e.contains(&reset), "{what}: {e}");
        }
        // The same connection still serves good calls, and so does the other client.
        let reply = round_trip(&connection, &good).await.expect("ping");
        assert!(matches!(
            reply,
            Message::Reply(Reply {
                outcome: Outcome::Ping(Ping { nonce: 42 }),
                ..
            })
        ));
        bystander.ping().await.expect("the other client is fine");
        bystander.close().await;
    });
}

/// Pushes live options to the brick's control socket at `generation`.
async fn push(socket: &std::path::Path, generation: u64, options: &[(&str, &str)]) {
    use kiln_admin::control::{ControlAnswer, ControlRequest, EXCHANGE};
    let options = options
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let request = ControlRequest::Push {
        generation,
        options,
    };
    let answer: ControlAnswer = EXCHANGE.ask(socket, &request).await.expect("push");
    assert_eq!(
        answer,
        ControlAnswer::Generation { generation },
        "{answer:?}"
    );
}

/// Changing `auth.allow` or revoking a certificate closes the connections no longer let in
/// and keeps them out; the others carry on. A push older than the brick's generation is
/// ignored.
#[test]
fn revoked_and_disallowed_clients_are_cut_off_live() {
    let cluster = Cluster::new();
    let socket = cluster.dir.path().join("run/b.sock");
    let socket_arg = socket.to_str().expect("utf-8");
    let brickd = cluster.start(
        "127.0.0.1:0",
        &["--control", socket_arg, "--generation", "1"],
    );
    let serial = |client| {
        pki::serial_of(&pki::identity_files(&cluster.tls, &Role::Client, client).cert)
            .expect("serial")
    };
    runtime().block_on(async {
        let alice = cluster.connect(brickd.addr, "alice").await;
        let bob = cluster.connect(brickd.addr, "bob").await;
        alice.ping().await.expect("alice");
        bob.ping().await.expect("bob");

        push(&socket, 2, &[("auth.allow", "alice")]).await;
        let e = bob.ping().await.expect_err("bob is cut off");
        assert!(
            matches!(e, Error::Disconnected(_) | Error::Refused(_)),
            "{e:?}"
        );
        let e = refused(cluster.options(brickd.addr, "bob")).await;
        assert!(
            matches!(&e, Error::Refused(why) if why.contains("auth.allow")),
            "{e:?}"
        );
        alice.ping().await.expect("alice carries on");

        push(
            &socket,
            3,
            &[("auth.allow", "*"), ("auth.revoked", &serial("alice"))],
        )
        .await;
        let e = alice
            .ping()
            .await
            .expect_err("alice's certificate is revoked");
        assert!(
            matches!(e, Error::Disconnected(_) | Error::Refused(_)),
            "{e:?}"
        );
        let e = refused(cluster.options(brickd.addr, "alice")).await;
        assert!(
            matches!(&e, Error::Refused(why) if why.contains("revoked")),
            "{e:?}"
        );
        let bob = cluster.connect(brickd.addr, "bob").await;
        bob.ping().await.expect("bob is back");

        // A late push of generation 2 does not bring back an older auth.allow.
        use kiln_admin::control::{ControlAnswer, ControlRequest, EXCHANGE};
        let stale = ControlRequest::Push {
            generation: 2,
            options: [("auth.allow".to_owned(), "alice".to_owned())].into(),
        };
        let answer: ControlAnswer = EXCHANGE.ask(&socket, &stale).await.expect("push");
        assert_eq!(answer, ControlAnswer::Generation { generation: 3 });
        bob.ping().await.expect("bob is still allowed");
    });
}
