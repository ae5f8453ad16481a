//! One endpoint's connections: admission (limits, `auth.allow`), HELLO, then one task per
//! call stream, each fop run as the squashed caller on the connection's session, and one
//! unidirectional stream per event (RECALL) the brick pushes to a session that negotiated
//! leases.

use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use kiln_admin::pki;
use kiln_wire::quic::{self, CloseCode, StreamCode};
use kiln_wire::{
    BodyChecksum, Call, CallCode, Capabilities, ErrorCode, Event, HelloReply, Message, Outcome,
    PROTOCOL_VERSION, Recall, Reply, Request,
};
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::access::{Admission, Full};
use super::{HELLO_TIMEOUT, LiveConfig, ORPHAN_CALL_GRACE};
use crate::engine::{Engine, LocalEngine};
use crate::fdtable::SessionId;
use crate::fops::ParentAttrs;
use crate::leases::RecallEvents;

/// What every connection of one endpoint shares.
pub(super) struct Context {
    /// Held so the engine's workers (this endpoint's thread among them) outlive the endpoint.
    pub(super) _engine: Engine,
    pub(super) local: LocalEngine,
    pub(super) live: Arc<RwLock<Live>>,
    pub(super) connections: Connections,
    pub(super) admission: Admission,
    pub(super) shutdown: watch::Receiver<Option<Duration>>,
    /// How long a call's request may take to arrive once its stream is open.
    pub(super) request_timeout: Duration,
}

/// What [`super::Server::reconfigure`] changes while serving: the live options and the
/// HELLO answer that carries some of them.
#[derive(Debug, Clone)]
pub(super) struct Live {
    pub(super) config: LiveConfig,
    pub(super) hello: HelloReply,
}

/// The connected clients of every endpoint, by session. Cheap to clone; clones share it.
#[derive(Debug, Clone, Default)]
pub struct Connections(Arc<Mutex<BTreeMap<SessionId, Connected>>>);

/// A connection as the server keeps it: what a state dump shows, and the handle that closes
/// it when its client is no longer allowed.
#[derive(Debug, Clone)]
struct Connected {
    info: ConnectionInfo,
    /// The client certificate's serial number.
    serial: String,
    connection: quinn::Connection,
}

pub use kiln_admin::control::ConnectionInfo;

impl Connections {
    /// The clients connected now, by session.
    pub fn list(&self) -> Vec<ConnectionInfo> {
        self.lock().values().map(|c| c.info.clone()).collect()
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Closes every connection `config` no longer lets in: its client is not in
    /// `auth.allow`, or its certificate is in `auth.revoked`.
    pub(super) fn close_disallowed(&self, config: &LiveConfig) {
        for c in self.lock().values() {
            if let Err((_, close, reason)) = check_access(config, &c.info.client, &c.serial) {
                tracing::warn!(client = %c.info.client, %reason, "connection closed");
                c.connection.close(close.into(), reason.as_bytes());
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<SessionId, Connected>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// One connection's session on its worker's engine, and who it is.
struct Session {
    local: LocalEngine,
    id: SessionId,
    client: String,
    live: Arc<RwLock<Live>>,
    request_timeout: Duration,
    /// Whether its frames carry body checksums (capability `UNCHECKED_BODIES`).
    crc: BodyChecksum,
}

pub(super) async fn serve_endpoint(endpoint: quinn::Endpoint, context: Rc<Context>) {
    let mut shutdown = context.shutdown.clone();
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            incoming = endpoint.accept() => match incoming {
                Some(incoming) => {
                    let limits = read(&context.live).config.connections;
                    // A full brick spends no TLS handshake on a connection it would refuse.
                    if context.admission.brick_full(limits) {
                        tracing::warn!(remote = %incoming.remote_address(), "connection refused: the brick is at network.connections-max");
                        incoming.refuse();
                        continue;
                    }
                    connections.spawn_local(serve_connection(incoming, context.clone()));
                }
                None => break,
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            _ = shutdown.wait_for(Option::is_some) => break,
        }
    }
    // Refuse new connections; the live ones drain on their own.
    endpoint.set_server_config(None);
    while connections.join_next().await.is_some() {}
    endpoint.close(CloseCode::ShuttingDown.into(), b"brick shutting down");
    let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
}

async fn serve_connection(incoming: quinn::Incoming, context: Rc<Context>) {
    let remote = incoming.remote_address();
    let connection = match incoming.await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(%remote, error = %e, "connection refused during TLS handshake");
            return;
        }
    };
    let Some((client, serial)) = peer_identity(&connection) else {
        tracing::warn!(%remote, "connection refused: the client certificate has no name");
        connection.close(
            CloseCode::NotAllowed.into(),
            b"client certificate has no name",
        );
        return;
    };
    let live = read(&context.live).clone();
    // A refusal is answered at HELLO, so it and its reason reach the client instead of
    // racing the end of its TLS handshake.
    let admitted = match admit(&context, &live.config, &client, &serial) {
        Ok(admitted) => Some(admitted),
        Err(refusal) => {
            let _ = handshake(&connection, &live.hello, Some(refusal)).await;
            return;
        }
    };
    let capabilities = match handshake(&connection, &live.hello, None).await {
        Ok(capabilities) => capabilities,
        Err((code, reason)) => {
            tracing::warn!(%remote, %client, %reason, "connection closed at HELLO");
            connection.close(code.into(), reason.as_bytes());
            return;
        }
    };
    tracing::debug!(%remote, %client, ?capabilities, "session open");
    let session = Rc::new(Session {
        local: context.local.clone(),
        id: context.local.open_session(parent_attrs(capabilities)),
        client: client.clone(),
        live: context.live.clone(),
        request_timeout: context.request_timeout,
        crc: capabilities.body_checksum(),
    });
    let info = ConnectionInfo {
        session: session.id,
        client,
        remote,
        since_unix_s: unix_now_s(),
    };
    let connected = Connected {
        info,
        serial,
        connection: connection.clone(),
    };
    // Attached before the first call: a LEASE may come next.
    let events = capabilities
        .contains(Capabilities::LEASES)
        .then(|| context.local.leases().attach(session.id));
    context.connections.lock().insert(session.id, connected);
    serve_session(&connection, session, events, &context).await;
    drop(admitted);
}

/// What the namespace replies of a session with `capabilities` carry.
fn parent_attrs(capabilities: Capabilities) -> ParentAttrs {
    match capabilities.contains(Capabilities::NO_PARENT_ATTRS) {
        true => ParentAttrs::Omit,
        false => ParentAttrs::Stat,
    }
}

/// Whether `config` lets client `client` with certificate `serial` in: not when
/// `auth.allow` leaves it out or `auth.revoked` lists its certificate.
fn check_access(config: &LiveConfig, client: &str, serial: &str) -> Result<(), Refusal> {
    if config.revoked.iter().any(|r| r == serial) {
        let reason = format!("the certificate {serial} of client '{client}' is revoked");
        return Err((ErrorCode::Access, CloseCode::NotAllowed, reason));
    }
    if !config.auth_allow.allows(client) {
        let reason = format!("client '{client}' is not allowed on this volume (auth.allow)");
        return Err((ErrorCode::Access, CloseCode::NotAllowed, reason));
    }
    Ok(())
}

/// Refuses a client `auth.allow` leaves out or whose certificate is revoked, or one past a
/// connection limit: the error, the close code and the reason HELLO answers with.
fn admit(
    context: &Context,
    config: &LiveConfig,
    client: &str,
    serial: &str,
) -> Result<super::access::Admitted, Refusal> {
    if let Err(refusal) = check_access(config, client, serial) {
        if config.auth_allow.allows(client) {
            tracing::warn!(%client, %serial, "connection refused: the certificate is revoked");
        } else {
            tracing::warn!(%client, "connection refused: client is not in auth.allow");
        }
        return Err(refusal);
    }
    context
        .admission
        .admit(client, config.connections)
        .map_err(|full| {
            let reason = match full {
                Full::Brick => format!(
                    "the brick has {} connections, its limit (network.connections-max)",
                    config.connections.per_brick
                ),
                Full::Client => format!(
                    "client '{client}' has {} connections, its limit \
                     (network.connections-per-client-max)",
                    config.connections.per_client
                ),
            };
            tracing::warn!(%client, %reason, "connection refused");
            (ErrorCode::Busy, CloseCode::TooManyConnections, reason)
        })
}

/// Serves the session's calls (and pushes its events) until the connection ends or the
/// brick shuts down, then ends the session.
async fn serve_session(
    connection: &quinn::Connection,
    session: Rc<Session>,
    mut events: Option<RecallEvents>,
    context: &Context,
) {
    let mut shutdown = context.shutdown.clone();
    let mut calls = JoinSet::new();
    let mut pushes = JoinSet::new();
    let grace = loop {
        tokio::select! {
            stream = connection.accept_bi() => match stream {
                Ok((send, recv)) => {
                    calls.spawn_local(serve_call(send, recv, session.clone()));
                }
                Err(e) => {
                    tracing::debug!(client = %session.client, error = %e, "connection ended");
                    break None;
                }
            },
            Some(recall) = next_event(&mut events), if pushes.len() < EVENT_PUSHES_MAX => {
                let timeout = context.local.leases().settings().recall_timeout;
                pushes.spawn_local(push_recall(connection.clone(), recall, timeout));
            }
            Some(_) = pushes.join_next(), if !pushes.is_empty() => {}
            Some(_) = calls.join_next(), if !calls.is_empty() => {}
            grace = shutdown.wait_for(Option::is_some) => break grace.ok().and_then(|g| *g),
        }
    };
    pushes.abort_all();
    // Calls in flight finish (and reply, if the client is still there) before the session's
    // files are closed; lock waits stop at once, and a call still running after the grace
    // period is dropped.
    session.local.cancel_lock_waits(session.id);
    let drained = async { while calls.join_next().await.is_some() {} };
    let limit = grace.unwrap_or(ORPHAN_CALL_GRACE);
    if tokio::time::timeout(limit, drained).await.is_err() {
        tracing::warn!(client = %session.client, ?limit, "calls still running after the grace period: dropped");
        calls.abort_all();
        while calls.join_next().await.is_some() {}
    }
    context.connections.lock().remove(&session.id);
    match Rc::try_unwrap(session) {
        Ok(session) => session.local.end_session(session.id).await,
        Err(_) => tracing::error!("session still referenced; not ended"),
    }
    if grace.is_some() {
        connection.close(CloseCode::ShuttingDown.into(), b"brick shutting down");
    }
}

/// Events pushed at once on one connection: as many as a client accepts streams for.
const EVENT_PUSHES_MAX: usize = quic::EVENT_STREAMS_MAX as usize;

/// The session's next event, if it negotiated events; pending forever otherwise.
async fn next_event(events: &mut Option<RecallEvents>) -> Option<Recall> {
    match events {
        Some(events) => events.recv().await,
        None => std::future::pending().await,
    }
}

/// Sends one RECALL on a unidirectional stream of its own, giving up after `timeout` (the
/// recall's own deadline: by then the lease is revoked anyway). A client that does not take
/// it is one that does not answer: its lease is revoked when the recall runs out.
async fn push_recall(connection: quinn::Connection, recall: Recall, timeout: Duration) {
    let gfid = recall.gfid;
    let push = async {
        let mut send = connection
            .open_uni()
            .await
            .map_err(quinn::WriteError::ConnectionLost)?;
        // Events are rare and small: always with their checksum, which every client takes.
        let event = Message::Event(Event::Recall(recall));
        quic::write_message(&mut send, &event, BodyChecksum::Required).await?;
        Ok::<_, quic::StreamError>(())
    };
    match tokio::time::timeout(timeout, push).await {
        Ok(Ok(())) => tracing::debug!(%gfid, "recall delivered"),
        Ok(Err(e)) => tracing::debug!(%gfid, error = %e, "recall not delivered"),
        Err(_) => tracing::debug!(%gfid, "recall not delivered in time"),
    }
}

/// A refusal at HELLO: the error the HELLO gets, then the close code and reason.
type Refusal = (ErrorCode, CloseCode, String);

/// The client's name (the common name of its certificate, already verified by TLS) and the
/// certificate's serial number.
fn peer_identity(connection: &quinn::Connection) -> Option<(String, String)> {
    let chain = connection
        .peer_identity()?
        .downcast::<Vec<rustls_pki_types::CertificateDer<'static>>>()
        .ok()?;
    let cert = chain.first()?;
    Some((pki::peer_name(cert)?, pki::peer_serial(cert)?))
}

/// Answers the connection's first call, which must be HELLO, with the capabilities both ends
/// offer; returns them. A refusal (`refused`, or a version the brick does not speak) is
/// answered with an error reply that reaches the client before the connection is closed with
/// the refusal's code and reason.
async fn handshake(
    connection: &quinn::Connection,
    hello_reply: &HelloReply,
    refused: Option<Refusal>,
) -> Result<Capabilities, (CloseCode, String)> {
    let protocol = |reason: String| (CloseCode::Protocol, reason);
    let (mut send, mut recv) = tokio::time::timeout(HELLO_TIMEOUT, connection.accept_bi())
        .await
        .map_err(|_| protocol("no HELLO in time".to_owned()))?
        .map_err(|e| protocol(e.to_string()))?;
    let error = |error| Outcome::Error {
        call: CallCode::Hello,
        error,
    };
    let read = tokio::time::timeout(
        HELLO_TIMEOUT,
        quic::read_message(&mut recv, BodyChecksum::Required),
    )
    .await
    .map_err(|_| protocol("no HELLO in time".to_owned()))?;
    let mut capabilities = Capabilities::NONE;
    let (id, outcome, refusal) = match read {
        Ok(Message::Request(Request {
            id,
            call: Call::Hello(hello),
        })) => match (hello.negotiate(), refused) {
            (Err(code), _) => (
                id,
                error(code),
                Some(protocol(format!(
                    "the client's protocol versions {}..={} do not include {PROTOCOL_VERSION}, \
                     the only one this brick speaks",
                    hello.version_min, hello.version_max
                ))),
            ),
            (Ok(_), Some((code, close, reason))) => (id, error(code), Some((close, reason))),
            (Ok(_), None) => {
                capabilities = hello_reply.capabilities.intersection(hello.capabilities);
                let reply = HelloReply {
                    capabilities,
                    ..hello_reply.clone()
                };
                (id, Outcome::Hello(reply), None)
            }
        },
        // A frame of another version still gets an answer this brick can write.
        Err(quic::StreamError::Decode(e @ kiln_wire::DecodeError::UnsupportedVersion(_))) => (
            0,
            error(ErrorCode::ProtoNotSupported),
            Some(protocol(e.to_string())),
        ),
        Ok(_) => return Err(protocol("the first call must be HELLO".to_owned())),
        Err(e) => return Err(protocol(e.to_string())),
    };
    let reply = Message::Reply(Reply { id, outcome });
    quic::write_message(&mut send, &reply, BodyChecksum::Required)
        .await
        .map_err(|e| protocol(e.to_string()))?;
    let Some((close, reason)) = refusal else {
        return Ok(capabilities);
    };
    // Closing discards unsent data: let the answer arrive first (bounded).
    let _ = tokio::time::timeout(HELLO_TIMEOUT, send.stopped()).await;
    connection.close(close.into(), reason.as_bytes());
    Err((close, reason))
}

async fn serve_call(
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    session: Rc<Session>,
) {
    // A request must arrive whole in time: a peer that opens streams and trickles bytes
    // holds nothing for long.
    let arrived = tokio::time::timeout(
        session.request_timeout,
        quic::read_message(&mut recv, session.crc),
    )
    .await;
    let request = match arrived {
        Ok(Ok(Message::Request(request))) => request,
        Ok(Ok(_)) => return reset(send, recv, "not a request"),
        Ok(Err(e)) => return reset(send, recv, &e.to_string()),
        Err(_) => return reset(send, recv, "the request did not arrive in time"),
    };
    let outcome = match request.call {
        Call::Fop { creds, fop } => {
            let code = CallCode::Fop(fop.code());
            let creds = read(&session.live)
                .config
                .root_squash
                .apply(&session.client, creds);
            match session.local.call(session.id, &creds, fop).await {
                Ok(reply) => Outcome::Fop(reply),
                Err(error) => Outcome::Error { call: code, error },
            }
        }
        Call::Ping(ping) => Outcome::Ping(ping),
        Call::Batch(mut batch) => {
            batch.creds = read(&session.live)
                .config
                .root_squash
                .apply(&session.client, batch.creds);
            match session.local.batch(session.id, batch).await {
                Ok(reply) => Outcome::Batch(reply),
                Err(error) => Outcome::Error {
                    call: CallCode::Batch,
                    error,
                },
            }
        }
        Call::Hello(_) => Outcome::Error {
            call: CallCode::Hello,
            error: ErrorCode::Inval,
        },
    };
    let reply = Message::Reply(Reply {
        id: request.id,
        outcome,
    });
    if let Err(e) = quic::write_message(&mut send, &reply, session.crc).await {
        tracing::debug!(error = %e, "reply not delivered");
    }
}

fn reset(mut send: quinn::SendStream, mut recv: quinn::RecvStream, why: &str) {
    tracing::debug!(%why, "bad frame: stream reset");
    let _ = send.reset(StreamCode::BadFrame.into());
    let _ = recv.stop(StreamCode::BadFrame.into());
}

/// The live state; a poisoned lock (a panic while writing it) still holds a whole value.
pub(super) fn read(live: &RwLock<Live>) -> std::sync::RwLockReadGuard<'_, Live> {
    live.read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn unix_now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
