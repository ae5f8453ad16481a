//! The QUIC server: clients reach the engine through here. The only module that touches quinn
//! or rustls.
//!
//! * **Where it runs.** On the io_uring engine, each of the first `endpoints` ring workers runs
//!   its own quinn endpoint on its own tokio runtime, all bound to one UDP port with
//!   `SO_REUSEPORT`; a datagram from source port `p` goes to endpoint `p % endpoints`
//!   ([`quic::steer_by_source_port`], so a client's lanes on consecutive ports reach
//!   different workers; the kernel's address hash where the program cannot be attached), and
//!   that connection's fops go straight to that worker's engine with no thread hop. On the blocking
//!   engine one `kiln-net` thread runs the endpoint and hands fops to the pool.
//! * **Who gets in, as whom** ([`access`]). TLS 1.3 with client certificates required: a
//!   client's certificate must chain to the cluster CA, be in its validity window and carry the
//!   client-auth usage, its name (common name) must be in `auth.allow`, and the brick and that
//!   name must be under their connection limits. Calls from a client not trusted with root
//!   (`server.root-allow`) run with uid and gid 0 squashed. Refusals are logged with the
//!   reason and told to the client at HELLO.
//! * **Per connection** ([`connection`]). One session (its own fd table, locks and leases,
//!   released when the connection ends), HELLO first (the capabilities of
//!   [`Capabilities::OFFERED`](kiln_wire::Capabilities::OFFERED) the client offers too), then
//!   one stream
//!   per call, at most `inflight_max` at once (QUIC stream credit is the backpressure), each request whole within the request timeout; a BATCH runs its
//!   fops in order as that many calls. A frame that does not decode resets its own stream
//!   only. RECALL events go out on unidirectional streams, one each, at most as many at once
//!   as a client accepts.
//! * **Shutdown.** [`Server::shutdown`] stops accepting, lets every call in flight finish and
//!   reply, ends the sessions and closes connections with a reason.

pub mod access;
mod connection;

use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use kiln_admin::pki::Identity;
use kiln_wire::quic;
use kiln_wire::{BrickId, Capabilities, ErrorCode, HelloReply, Label, Limits, PROTOCOL_VERSION};
use quinn::crypto::rustls::QuicServerConfig;
use rustls::server::WebPkiClientVerifier;
use tokio::sync::{oneshot, watch};

pub use self::access::{AuthAllow, ConnectionLimits, RootSquash};
pub use self::connection::{ConnectionInfo, Connections};
use self::connection::{Context, Live, serve_endpoint};
use crate::engine::{Engine, LocalEngine};

/// How long a new connection may take to send its HELLO.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long calls of a connection that is gone may still run before they are dropped and the
/// session's files and locks released.
pub const ORPHAN_CALL_GRACE: Duration = Duration::from_secs(30);
/// How long a call's request may take to arrive once its stream is open, by default.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// What a running brick changes without a restart (pushed by kiln-mgmtd).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveConfig {
    pub auth_allow: AuthAllow,
    /// `auth.revoked`: serial numbers (lowercase hex, as `pki::peer_serial` writes them) of
    /// certificates refused at connect; connections holding one are closed when it changes.
    pub revoked: Vec<String>,
    /// Calls in flight per connection (`network.inflight-max`), for connections opened from
    /// the change on.
    pub inflight_max: u32,
    pub root_squash: RootSquash,
    pub connections: ConnectionLimits,
}

impl Default for LiveConfig {
    fn default() -> Self {
        LiveConfig {
            auth_allow: AuthAllow::All,
            revoked: Vec::new(),
            inflight_max: 256,
            root_squash: RootSquash::default(),
            connections: ConnectionLimits::default(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// The brick's certificate and key, and the cluster CA that clients must chain to.
    pub identity: Identity,
    /// What may change while serving ([`Server::reconfigure`]).
    pub live: LiveConfig,
    /// Ring workers that run an endpoint (1 = one shared endpoint); capped at the workers.
    pub endpoints: usize,
    /// The volume name told to clients in the HELLO reply.
    pub volume: String,
    /// Largest UDP payload sent or accepted; path MTU discovery works up to it.
    pub udp_payload_max_bytes: u16,
    /// How long a call's request may take to arrive once its stream is open.
    pub request_timeout: Duration,
}

impl ServerConfig {
    /// A configuration with the secure defaults: every client of the CA allowed, root
    /// squashed for all of them.
    pub fn new(listen: SocketAddr, identity: Identity) -> ServerConfig {
        ServerConfig {
            listen,
            identity,
            live: LiveConfig::default(),
            endpoints: usize::MAX,
            volume: String::new(),
            udp_payload_max_bytes: quic::UDP_PAYLOAD_MAX_BYTES,
            request_timeout: REQUEST_TIMEOUT,
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

/// The UDP sockets of the endpoints, all on one port, and the TCP socket claiming it.
type Sockets = (
    Vec<std::net::UdpSocket>,
    SocketAddr,
    Option<rustix::fd::OwnedFd>,
);

impl Server {
    /// Binds the endpoints and starts serving `engine` for `brick_id`.
    pub async fn start(
        engine: &Engine,
        brick_id: BrickId,
        config: ServerConfig,
    ) -> Result<Server, ServerError> {
        let hello = HelloReply {
            version: PROTOCOL_VERSION,
            // Intersected with each client's offer at its HELLO.
            capabilities: Capabilities::OFFERED,
            brick_id,
            volume: Label::new(config.volume.clone().into_bytes())?,
            limits: Limits {
                inflight_max: config.live.inflight_max,
                ..Limits::protocol()
            },
        };
        // Each worker thread runs at most one endpoint (the blocking engine has one).
        let count = config.endpoints.clamp(1, engine.workers());
        let (sockets, local_addr, port_guard) = bind(config.listen, count)?;
        let live = Arc::new(RwLock::new(Live {
            config: config.live.clone(),
            hello,
        }));
        let mut server = Server {
            local_addr,
            endpoints: Vec::with_capacity(count),
            live,
            connections: Connections::default(),
            shutdown: watch::channel(None).0,
            stopped: Vec::with_capacity(count),
            _port_guard: port_guard,
            config,
        };
        let admission = access::Admission::default();
        for (worker, socket) in sockets.into_iter().enumerate() {
            server
                .start_endpoint(engine, worker, socket, &admission)
                .await?;
        }
        tracing::info!(%local_addr, endpoints = count, "serving");
        Ok(server)
    }

    /// Starts one endpoint on `socket`, driven by worker `worker`'s thread.
    async fn start_endpoint(
        &mut self,
        engine: &Engine,
        worker: usize,
        socket: std::net::UdpSocket,
        admission: &access::Admission,
    ) -> Result<(), ServerError> {
        let server_config = quinn_config(&self.config)?;
        let (ready, started) = oneshot::channel();
        let (done, stopped) = oneshot::channel();
        self.stopped.push(stopped);
        let context = ContextParts {
            engine: engine.clone(),
            live: self.live.clone(),
            connections: self.connections.clone(),
            admission: admission.clone(),
            shutdown: self.shutdown.subscribe(),
            request_timeout: self.config.request_timeout,
        };
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
            let context = Rc::new(context.on(local));
            tokio::task::spawn_local(async move {
                serve_endpoint(endpoint, context).await;
                let _ = done.send(());
            });
        };
        engine
            .run_on_worker(worker, job)
            .await
            .map_err(ServerError::Engine)?;
        let endpoint = started
            .await
            .map_err(|_| ServerError::Thread(std::io::Error::other("endpoint thread died")))?
            .map_err(|error| ServerError::Listen {
                addr: self.local_addr,
                error,
            })?;
        self.endpoints.push(endpoint);
        Ok(())
    }

    /// The clients connected now.
    pub fn connections(&self) -> &Connections {
        &self.connections
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Applies live options: connections whose client `auth.allow` no longer allows, or whose
    /// certificate `auth.revoked` lists, are closed; root squashing applies from the next call; `network.inflight-max` and the
    /// connection limits from the next connection on.
    pub fn reconfigure(&mut self, live: LiveConfig) -> Result<(), ServerError> {
        if live.inflight_max != self.config.live.inflight_max {
            self.config.live.inflight_max = live.inflight_max;
            let quinn_config = quinn_config(&self.config)?;
            for endpoint in &self.endpoints {
                endpoint.set_server_config(Some(quinn_config.clone()));
            }
        }
        self.config.live = live.clone();
        {
            let mut current = self
                .live
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            current.hello.limits.inflight_max = live.inflight_max;
            current.config = live;
        }
        self.connections.close_disallowed(&self.config.live);
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

/// What an endpoint's [`Context`] is made of before it reaches its worker thread.
struct ContextParts {
    engine: Engine,
    live: Arc<RwLock<Live>>,
    connections: Connections,
    admission: access::Admission,
    shutdown: watch::Receiver<Option<Duration>>,
    request_timeout: Duration,
}

impl ContextParts {
    fn on(self, local: &LocalEngine) -> Context {
        Context {
            _engine: self.engine,
            local: local.clone(),
            live: self.live,
            connections: self.connections,
            admission: self.admission,
            shutdown: self.shutdown,
            request_timeout: self.request_timeout,
        }
    }
}

/// How many ports the kernel may pick for a brick asked to listen on port 0 before one is
/// free in both spaces (the UDP port it picks may be a TCP port in use).
const PORT_PICKS_MAX: usize = 16;

/// Binds `count` UDP sockets on one port (the first picks it when asked for port 0). With
/// more than one, `SO_REUSEPORT` would also let another root process join the group and take
/// a share of the clients, so the port is claimed for this process by a bound TCP socket on
/// the same number (TCP and UDP ports are separate spaces; nothing else needs it). Asked for
/// port 0, a port whose TCP twin is taken is given back and another picked.
fn bind(listen: SocketAddr, count: usize) -> Result<Sockets, ServerError> {
    let mut picks = 1;
    loop {
        match bind_once(listen, count) {
            Err(ServerError::Listen { error, .. })
                if listen.port() == 0
                    && error.kind() == std::io::ErrorKind::AddrInUse
                    && picks < PORT_PICKS_MAX =>
            {
                picks += 1;
            }
            bound => return bound,
        }
    }
}

fn bind_once(listen: SocketAddr, count: usize) -> Result<Sockets, ServerError> {
    let mut sockets = Vec::with_capacity(count);
    let mut port_guard = None;
    let mut local_addr = listen;
    let listen_error = |addr| move |error| ServerError::Listen { addr, error };
    for _ in 0..count {
        let socket = quic::udp_socket(local_addr, count > 1).map_err(listen_error(local_addr))?;
        local_addr = socket.local_addr().map_err(ServerError::Thread)?;
        if count > 1 && port_guard.is_none() {
            port_guard = Some(claim_port(local_addr).map_err(listen_error(local_addr))?);
        }
        sockets.push(socket);
    }
    if count > 1
        && let Err(e) = quic::steer_by_source_port(&sockets[0], count)
    {
        tracing::warn!(error = %e, "cannot steer clients to endpoints by source port; the kernel hashes them");
    }
    Ok((sockets, local_addr, port_guard))
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
        quic::PeerStreams::Calls(config.live.inflight_max),
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
        quic::QuicRuntime::new(quic::Spawn::Local),
    )
}
