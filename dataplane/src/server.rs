//! The QUIC server: clients reach the engine through here. The only module that touches quinn
//! or rustls.
//!
//! * **Where it runs.** On the io_uring engine, each of the first `endpoints` ring workers runs
//!   its own quinn endpoint on its own tokio runtime, all bound to one UDP port with
//!   `SO_REUSEPORT`; the kernel hashes each client's address to one of them, and that
//!   connection's fops go straight to that worker's engine with no thread hop. On the blocking
//!   engine one `kiln-net` thread runs the endpoint and hands fops to the pool.
//! * **Who gets in.** TLS 1.3 with client certificates required: a client's certificate must
//!   chain to the cluster CA, be in its validity window and carry the client-auth usage, and
//!   its name (common name) must be in `auth.allow`. Refusals are logged with the reason.
//! * **Per connection.** One session (its own fd table and locks, released when the connection
//!   ends), HELLO first, then one stream per call, at most `inflight_max` at once (QUIC stream
//!   credit is the backpressure). A frame that does not decode resets its own stream only.
//! * **Shutdown.** [`Server::shutdown`] stops accepting, lets every call in flight finish and
//!   reply, ends the sessions and closes connections with a reason.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use kiln_admin::pki::{self, Identity};
use kiln_wire::quic::{self, CloseCode, StreamCode};
use kiln_wire::{
    BrickId, Call, CallCode, Capabilities, ErrorCode, HelloReply, Label, Limits, Message, Outcome,
    PROTOCOL_VERSION, Reply, Request,
};
use quinn::crypto::rustls::QuicServerConfig;
use rustls::server::WebPkiClientVerifier;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinSet;

use crate::engine::{Engine, LocalEngine};
use crate::fdtable::SessionId;

/// How long a new connection may take to send its HELLO.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long calls of a connection that is gone may still run before they are dropped and the
/// session's files and locks released.
pub const ORPHAN_CALL_GRACE: Duration = Duration::from_secs(30);

/// One connection's session on its worker's engine.
struct SessionHandle {
    local: LocalEngine,
    id: SessionId,
}

/// Client names allowed on this brick (`auth.allow`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum AuthAllow {
    /// Every client with a certificate from the cluster CA (the default).
    #[default]
    All,
    /// Only these client names.
    Names(Vec<String>),
}

impl AuthAllow {
    /// Parses `*` or a comma-separated list of client names.
    pub fn parse(list: &str) -> Result<AuthAllow, pki::PkiError> {
        if list.trim() == "*" {
            return Ok(AuthAllow::All);
        }
        let names = list
            .split(',')
            .map(str::trim)
            .map(|n| pki::check_name(n).map(|()| n.to_owned()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(AuthAllow::Names(names))
    }

    pub fn allows(&self, name: &str) -> bool {
        match self {
            AuthAllow::All => true,
            AuthAllow::Names(names) => names.iter().any(|n| n == name),
        }
    }
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// The brick's certificate and key, and the cluster CA that clients must chain to.
    pub identity: Identity,
    pub auth_allow: AuthAllow,
    /// Calls in flight per connection (`network.inflight-max`).
    pub inflight_max: u32,
    /// Ring workers that run an endpoint (1 = one shared endpoint); capped at the workers.
    pub endpoints: usize,
    /// The volume name told to clients in the HELLO reply.
    pub volume: String,
    /// Largest UDP payload sent or accepted; path MTU discovery works up to it.
    pub udp_payload_max_bytes: u16,
}

impl ServerConfig {
    pub fn new(listen: SocketAddr, identity: Identity) -> ServerConfig {
        ServerConfig {
            listen,
            identity,
            auth_allow: AuthAllow::All,
            inflight_max: 256,
            endpoints: usize::MAX,
            volume: String::new(),
            udp_payload_max_bytes: quic::UDP_PAYLOAD_MAX_BYTES,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
    #[error("client verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    #[error("QUIC configuration: {0}")]
    Quic(#[from] quinn::crypto::rustls::NoInitialCipherSuite),
    #[error("cannot listen on {addr}: {error}")]
    Listen {
        addr: SocketAddr,
        error: std::io::Error,
    },
    #[error("bad volume name: {0}")]
    Volume(#[from] kiln_wire::NameError),
    #[error("engine: {0}")]
    Engine(ErrorCode),
    #[error("server thread: {0}")]
    Thread(std::io::Error),
}

/// A running server. Dropping it without [`Server::shutdown`] leaves the endpoints running
/// until the process exits.
#[derive(Debug)]
pub struct Server {
    local_addr: SocketAddr,
    config: ServerConfig,
    endpoints: Vec<quinn::Endpoint>,
    live: Arc<RwLock<Live>>,
    connections: Connections,
    shutdown: watch::Sender<Option<Duration>>,
    stopped: Vec<oneshot::Receiver<()>>,
    _port_guard: Option<rustix::fd::OwnedFd>,
}

/// What every connection of one endpoint shares.
struct Context {
    /// Held so the engine's workers (this endpoint's thread among them) outlive the endpoint.
    _engine: Engine,
    local: LocalEngine,
    live: Arc<RwLock<Live>>,
    connections: Connections,
    shutdown: watch::Receiver<Option<Duration>>,
}

/// The connected clients of every endpoint, by session. Cheap to clone; clones share it.
#[derive(Debug, Clone, Default)]
pub struct Connections(Arc<Mutex<BTreeMap<SessionId, ConnectionInfo>>>);

impl Connections {
    /// The clients connected now, by session.
    pub fn list(&self) -> Vec<ConnectionInfo> {
        self.lock().values().cloned().collect()
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<SessionId, ConnectionInfo>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

pub use kiln_admin::control::ConnectionInfo;

/// What [`Server::reconfigure`] changes while serving; read by each new connection.
#[derive(Debug, Clone)]
struct Live {
    auth_allow: AuthAllow,
    hello: HelloReply,
}

impl Server {
    /// Binds the endpoints and starts serving `engine` for `brick_id`.
    pub async fn start(
        engine: &Engine,
        brick_id: BrickId,
        config: ServerConfig,
    ) -> Result<Server, ServerError> {
        let server_config = quinn_config(&config)?;
        let hello = HelloReply {
            version: PROTOCOL_VERSION,
            capabilities: Capabilities::NONE,
            brick_id,
            volume: Label::new(config.volume.clone().into_bytes())?,
            limits: Limits {
                inflight_max: config.inflight_max,
                ..Limits::protocol()
            },
        };
        // Each worker thread runs at most one endpoint (the blocking engine has one).
        let endpoints = config.endpoints.clamp(1, engine.workers());
        // The first socket picks the port when asked for port 0; the others share it.
        // `SO_REUSEPORT` would also let another root process join the group and take a share
        // of the clients, so the port is claimed for this process by a bound TCP socket on the
        // same number (TCP and UDP ports are separate spaces; nothing else needs it).
        let mut sockets = Vec::with_capacity(endpoints);
        let mut port_guard = None;
        let mut local_addr = config.listen;
        for _ in 0..endpoints {
            let socket = quic::udp_socket(local_addr, endpoints > 1).map_err(|error| {
                ServerError::Listen {
                    addr: local_addr,
                    error,
                }
            })?;
            local_addr = socket.local_addr().map_err(ServerError::Thread)?;
            if endpoints > 1 && port_guard.is_none() {
                port_guard = Some(claim_port(local_addr).map_err(|error| ServerError::Listen {
                    addr: local_addr,
                    error,
                })?);
            }
            sockets.push(socket);
        }

        let live = Arc::new(RwLock::new(Live {
            auth_allow: config.auth_allow.clone(),
            hello,
        }));
        let connections = Connections::default();
        let (shutdown, shutdown_rx) = watch::channel(None);
        let mut stopped = Vec::with_capacity(endpoints);
        let mut handles = Vec::with_capacity(endpoints);
        for (worker, socket) in sockets.into_iter().enumerate() {
            let (ready, started) = oneshot::channel();
            let (done, stopped_rx) = oneshot::channel();
            stopped.push(stopped_rx);
            let (server_config, live, connections, shutdown) = (
                server_config.clone(),
                live.clone(),
                connections.clone(),
                shutdown_rx.clone(),
            );
            let engine_handle = engine.clone();
            // Runs on the worker thread that will drive the endpoint, inside its runtime.
            let job = move |local: &LocalEngine| {
                let endpoint = match endpoint(server_config, socket) {
                    Ok(endpoint) => endpoint,
                    Err(e) => {
                        let _ = ready.send(Err(e));
                        return;
                    }
                };
                let _ = ready.send(Ok(endpoint.clone()));
                let context = Rc::new(Context {
                    _engine: engine_handle,
                    local: local.clone(),
                    live,
                    connections,
                    shutdown,
                });
                tokio::task::spawn_local(async move {
                    serve_endpoint(endpoint, context).await;
                    let _ = done.send(());
                });
            };
            engine
                .run_on_worker(worker, job)
                .await
                .map_err(ServerError::Engine)?;
            handles.push(
                started
                    .await
                    .map_err(|_| {
                        ServerError::Thread(std::io::Error::other("endpoint thread died"))
                    })?
                    .map_err(|error| ServerError::Listen {
                        addr: local_addr,
                        error,
                    })?,
            );
        }
        tracing::info!(%local_addr, endpoints, "serving");
        Ok(Server {
            local_addr,
            config,
            endpoints: handles,
            live,
            connections,
            shutdown,
            stopped,
            _port_guard: port_guard,
        })
    }

    /// The clients connected now.
    pub fn connections(&self) -> &Connections {
        &self.connections
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Applies live options: `auth.allow` from the next connection on (connections already
    /// open keep their session), `network.inflight-max` for connections opened from now on.
    pub fn reconfigure(
        &mut self,
        auth_allow: AuthAllow,
        inflight_max: u32,
    ) -> Result<(), ServerError> {
        if inflight_max != self.config.inflight_max {
            self.config.inflight_max = inflight_max;
            let quinn_config = quinn_config(&self.config)?;
            for endpoint in &self.endpoints {
                endpoint.set_server_config(Some(quinn_config.clone()));
            }
        }
        self.config.auth_allow = auth_allow.clone();
        if let Ok(mut live) = self.live.write() {
            live.auth_allow = auth_allow;
            live.hello.limits.inflight_max = inflight_max;
        }
        Ok(())
    }

    /// Stops accepting, lets calls in flight finish (for at most `grace`), ends every session
    /// and closes every connection with a reason.
    pub async fn shutdown(self, grace: Duration) {
        let _ = self.shutdown.send(Some(grace));
        for stopped in self.stopped {
            let _ = stopped.await;
        }
    }
}

/// A TCP socket bound (not listening) to `addr`, so a second brick on the same UDP port fails
/// with "address in use" instead of silently joining the `SO_REUSEPORT` group.
fn claim_port(addr: SocketAddr) -> std::io::Result<rustix::fd::OwnedFd> {
    use rustix::net::{AddressFamily, SocketType};
    let family = match addr {
        SocketAddr::V4(_) => AddressFamily::INET,
        SocketAddr::V6(_) => AddressFamily::INET6,
    };
    let fd = rustix::net::socket(family, SocketType::STREAM, None)?;
    rustix::net::bind(&fd, &addr)?;
    Ok(fd)
}

fn quinn_config(config: &ServerConfig) -> Result<quinn::ServerConfig, ServerError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(config.identity.ca.clone())?;
    let verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone()).build()?;
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            config.identity.chain.clone(),
            config.identity.key.clone_key(),
        )?;
    tls.alpn_protocols = vec![quic::ALPN.to_vec()];
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(QuicServerConfig::try_from(tls)?));
    server.transport_config(quic::transport_config(
        quic::PeerStreams::Calls(config.inflight_max),
        config.udp_payload_max_bytes,
        quic::IDLE_TIMEOUT,
    ));
    // A migrated connection would hash to another endpoint's socket.
    server.migration(false);
    Ok(server)
}

fn endpoint(
    config: quinn::ServerConfig,
    socket: std::net::UdpSocket,
) -> std::io::Result<quinn::Endpoint> {
    quinn::Endpoint::new(
        quic::endpoint_config(),
        Some(config),
        socket,
        Arc::new(quinn::TokioRuntime),
    )
}

async fn serve_endpoint(endpoint: quinn::Endpoint, context: Rc<Context>) {
    let mut shutdown = context.shutdown.clone();
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            incoming = endpoint.accept() => match incoming {
                Some(incoming) => {
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
    let Some(client) = peer_name(&connection) else {
        tracing::warn!(%remote, "connection refused: the client certificate has no name");
        connection.close(
            CloseCode::NotAllowed.into(),
            b"client certificate has no name",
        );
        return;
    };
    let live = context.live.read().map(|l| l.clone());
    let Ok(live) = live else {
        connection.close(CloseCode::ShuttingDown.into(), b"brick state poisoned");
        return;
    };
    // A client not in auth.allow is refused at HELLO, so the refusal and its reason reach
    // it instead of racing the end of its TLS handshake.
    let refusal = (!live.auth_allow.allows(&client)).then(|| {
        tracing::warn!(%remote, %client, "connection refused: client is not in auth.allow");
        format!("client '{client}' is not allowed on this volume (auth.allow)")
    });
    if let Err((code, reason)) = handshake(&connection, &live.hello, refusal).await {
        tracing::warn!(%remote, %client, %reason, "connection closed at HELLO");
        connection.close(code.into(), reason.as_bytes());
        return;
    }
    tracing::debug!(%remote, %client, "session open");

    let session = Rc::new(SessionHandle {
        local: context.local.clone(),
        id: context.local.open_session(),
    });
    let since_unix_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let id = session.id;
    let info = ConnectionInfo {
        session: id,
        client: client.clone(),
        remote,
        since_unix_s,
    };
    context.connections.lock().insert(id, info);
    let mut shutdown = context.shutdown.clone();
    let mut calls = JoinSet::new();
    let grace = loop {
        tokio::select! {
            stream = connection.accept_bi() => match stream {
                Ok((send, recv)) => {
                    calls.spawn_local(serve_call(send, recv, session.clone()));
                }
                Err(e) => {
                    tracing::debug!(%remote, %client, error = %e, "connection ended");
                    break None;
                }
            },
            Some(_) = calls.join_next(), if !calls.is_empty() => {}
            grace = shutdown.wait_for(Option::is_some) => break grace.ok().and_then(|g| *g),
        }
    };
    // Calls in flight finish (and reply, if the client is still there) before the session's
    // files are closed; lock waits stop at once, and a call still running after the grace
    // period is dropped.
    session.local.cancel_lock_waits(session.id);
    let drained = async { while calls.join_next().await.is_some() {} };
    let limit = grace.unwrap_or(ORPHAN_CALL_GRACE);
    if tokio::time::timeout(limit, drained).await.is_err() {
        tracing::warn!(%remote, %client, ?limit, "calls still running after the grace period: dropped");
        calls.abort_all();
        while calls.join_next().await.is_some() {}
    }
    context.connections.lock().remove(&id);
    match Rc::try_unwrap(session) {
        Ok(session) => session.local.end_session(session.id).await,
        Err(_) => tracing::error!(%remote, %client, "session still referenced; not ended"),
    }
    if grace.is_some() {
        connection.close(CloseCode::ShuttingDown.into(), b"brick shutting down");
    }
}

/// The client's name: the common name of its certificate, already verified by TLS.
fn peer_name(connection: &quinn::Connection) -> Option<String> {
    let chain = connection
        .peer_identity()?
        .downcast::<Vec<rustls_pki_types::CertificateDer<'static>>>()
        .ok()?;
    pki::peer_name(chain.first()?)
}

/// Answers the connection's first call, which must be HELLO.
/// Answers the connection's first call, which must be HELLO. A refusal (`refused`, or a
/// version the brick does not speak) is answered with an error reply that reaches the client
/// before the connection is closed with the returned code and reason.
async fn handshake(
    connection: &quinn::Connection,
    hello_reply: &HelloReply,
    refused: Option<String>,
) -> Result<(), (CloseCode, String)> {
    let protocol = |reason: String| (CloseCode::Protocol, reason);
    let (mut send, mut recv) = tokio::time::timeout(HELLO_TIMEOUT, connection.accept_bi())
        .await
        .map_err(|_| protocol("no HELLO in time".to_owned()))?
        .map_err(|e| protocol(e.to_string()))?;
    let error = |error| Outcome::Error {
        call: CallCode::Hello,
        error,
    };
    let (id, outcome, refusal) = match quic::read_message(&mut recv).await {
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
            (Ok(_), Some(reason)) => (
                id,
                error(ErrorCode::Access),
                Some((CloseCode::NotAllowed, reason)),
            ),
            (Ok(_), None) => (id, Outcome::Hello(hello_reply.clone()), None),
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
    quic::write_message(&mut send, &Message::Reply(Reply { id, outcome }))
        .await
        .map_err(|e| protocol(e.to_string()))?;
    match refusal {
        None => Ok(()),
        Some(refusal) => {
            // Closing discards unsent data: let the answer arrive first (bounded).
            let _ = tokio::time::timeout(HELLO_TIMEOUT, send.stopped()).await;
            Err(refusal)
        }
    }
}

async fn serve_call(
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    session: Rc<SessionHandle>,
) {
    let request = match quic::read_message(&mut recv).await {
        Ok(Message::Request(request)) => request,
        Ok(_) => return reset(send, recv, "not a request"),
        Err(e) => return reset(send, recv, &e.to_string()),
    };
    let outcome = match request.call {
        Call::Fop { creds, fop } => {
            let code = CallCode::Fop(fop.code());
            match session.local.call(session.id, &creds, fop).await {
                Ok(reply) => Outcome::Fop(reply),
                Err(error) => Outcome::Error { call: code, error },
            }
        }
        Call::Ping(ping) => Outcome::Ping(ping),
        Call::Hello(_) => Outcome::Error {
            call: CallCode::Hello,
            error: ErrorCode::Inval,
        },
    };
    let reply = Message::Reply(Reply {
        id: request.id,
        outcome,
    });
    if let Err(e) = quic::write_message(&mut send, &reply).await {
        tracing::debug!(error = %e, "reply not delivered");
    }
}

fn reset(mut send: quinn::SendStream, mut recv: quinn::RecvStream, why: &str) {
    tracing::debug!(%why, "bad frame: stream reset");
    let _ = send.reset(StreamCode::BadFrame.into());
    let _ = recv.stop(StreamCode::BadFrame.into());
}
