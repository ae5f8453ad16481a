//! The brick client: a QUIC connection to one brick (and, when asked, lanes beside it for
//! bulk I/O), the bottom [`Layer`] of every client stack (what GlusterFS's protocol/client
//! translator is).
//!
//! * Any number of tasks call through one [`BrickClient`] at once, each with its own
//!   credentials; each call is its own QUIC stream, and the brick's stream credit bounds how
//!   many are in flight.
//! * When the connection breaks, the call in flight fails with [`Error::Disconnected`] (it may
//!   or may not have run), and the next call reconnects and says HELLO again.
//! * An [`Fd`] belongs to the client, not to a connection: one opened before a reconnect is
//!   opened again by its GFID on first use, with the same access mode (never `TRUNC` or
//!   `EXCL` again), as whoever uses it first. When that is not possible — the file is gone,
//!   or the fd held POSIX locks, which died with the old session — it fails with EBADF; it
//!   never reaches another file, because the GFID names the file.
//! * With [`ConnectOptions::connections`] above 1, large READs and WRITEs are spread over
//!   extra connections ([`lanes`]).

mod lanes;

use lanes::Lanes;
pub use lanes::{CONNECTIONS_MAX, LANE_IO_MIN_BYTES};

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kiln_admin::pki::{self, Identity, Role};
use kiln_wire::quic::{self, CloseCode};
use kiln_wire::{
    AccessMode, Batch, BatchReply, BodyChecksum, Call, Capabilities, Creds, EntryReply, ErrorCode,
    Event, FdId, FileType, FopCode, FopReply, FopRequest, Gfid, Hello, HelloReply, Label, LockCmd,
    LockKind, Message, OpenFlags, Outcome, PROTOCOL_VERSION, Reply, Request,
};
use quinn::crypto::rustls::QuicClientConfig;

use crate::error::Error;
use crate::layer::{FdFop, Layer, LayerEvent, batch_one_by_one, opendir_list_apart};

/// Events a slow subscriber may fall behind by before it is told it lagged.
const EVENTS_QUEUED_MAX: usize = 4096;

/// Where a brick is and who this client is.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    pub addr: SocketAddr,
    /// The name the brick's certificate must carry (a DNS name or the address).
    pub server_name: String,
    pub identity: Identity,
    /// The client's name (the common name of its certificate).
    pub client_name: String,
    /// Largest UDP payload sent or accepted.
    pub udp_payload_max_bytes: u16,
    /// A brick silent this long is gone: calls in flight and connection attempts fail.
    pub idle_timeout: std::time::Duration,
    /// QUIC connections to the brick, 1 to [`CONNECTIONS_MAX`]: the main one, and lanes for
    /// large READs and WRITEs ([`lanes`]).
    pub connections: usize,
    /// The UDP port of the client's first connection, the others on the ports after it, where
    /// they are free (else any); 0 = any. The brick sends a client on port `p` to its endpoint
    /// `p % endpoints`, so clients on consecutive ports reach different workers.
    pub local_port: u16,
    /// What the client offers at HELLO: [`Capabilities::OFFERED`], or less to speak as an
    /// older client would (the fops a brick then lacks go as the older fops they stand for).
    pub capabilities: Capabilities,
}

impl ConnectOptions {
    /// Options for client `client_name` with the CA and certificate in `tls_dir` (as
    /// `kiln ca init` and `kiln cert issue --client` write them).
    pub fn from_tls_dir(
        addr: SocketAddr,
        tls_dir: &Path,
        client_name: &str,
    ) -> Result<ConnectOptions, Error> {
        let files = pki::identity_files(tls_dir, &Role::Client, client_name);
        let identity = pki::load_identity(&pki::ca_files(tls_dir).cert, &files)
            .map_err(|e| Error::Tls(e.to_string()))?;
        Ok(ConnectOptions {
            addr,
            server_name: addr.ip().to_string(),
            identity,
            client_name: client_name.to_owned(),
            udp_payload_max_bytes: quic::UDP_PAYLOAD_MAX_BYTES,
            idle_timeout: quic::IDLE_TIMEOUT,
            connections: 1,
            local_port: 0,
            capabilities: Capabilities::OFFERED,
        })
    }
}

/// A client of one brick. Cheap to clone; clones share the connection.
#[derive(Debug, Clone)]
pub struct BrickClient {
    inner: Arc<Inner>,
}

/// Tells brick clients apart, so an [`Fd`] is only used by the client that opened it.
static CLIENT_IDS: AtomicU64 = AtomicU64::new(1);

#[derive(Debug)]
struct Inner {
    /// Process-unique; every [`Fd`] this client makes carries it.
    id: u64,
    options: ConnectOptions,
    endpoint: quinn::Endpoint,
    client_config: quinn::ClientConfig,
    live: Mutex<Option<Live>>,
    /// Held while connecting, so concurrent callers wait for one new connection.
    connecting: tokio::sync::Mutex<()>,
    epochs: AtomicU64,
    next_request: AtomicU64,
    /// Recalls from the brick, and the loss of a session's leases, for the layers above.
    events: tokio::sync::broadcast::Sender<LayerEvent>,
    lanes: Lanes,
}

/// One connection; `epoch` counts connections made by this client.
#[derive(Debug, Clone)]
struct Conn {
    connection: quinn::Connection,
    epoch: u64,
}

/// The current connection, past HELLO.
#[derive(Debug, Clone)]
struct Live {
    conn: Conn,
    hello: HelloReply,
}

impl Live {
    /// Whether this session's frames carry body checksums.
    fn crc(&self) -> BodyChecksum {
        self.hello.capabilities.body_checksum()
    }
}

/// An open file or directory on a brick, valid across reconnects (see the module docs).
/// Release it with [`Layer::release`]; one that is dropped is released when the connection
/// ends.
#[derive(Debug)]
pub struct Fd {
    /// The [`BrickClient`] that opened it.
    client: u64,
    gfid: Gfid,
    kind: FdKind,
    /// (connection epoch, the brick's id for it in that connection's session)
    state: Mutex<(u64, FdId)>,
    locked: AtomicBool,
    /// The file's inode number once a reply named it (0 until then): a reopen by GFID after
    /// a reconnect must reach the same inode, not an object that took over the GFID.
    ino: AtomicU64,
    /// The file opened on each lane of its client once a large request went there, or
    /// `None` where the brick refused to open it (its requests then stay on the main one).
    on_lanes: Box<[tokio::sync::OnceCell<Option<Fd>>]>,
}

#[derive(Debug, Clone, Copy)]
enum FdKind {
    File {
        access: AccessMode,
        flags: OpenFlags,
    },
    Dir,
}

impl Fd {
    pub fn gfid(&self) -> Gfid {
        self.gfid
    }
}

impl BrickClient {
    /// Connects to the brick and says HELLO, on each of `options.connections`.
    pub async fn connect(options: ConnectOptions) -> Result<BrickClient, Error> {
        let (lanes, port) = Lanes::connect(&options).await?;
        BrickClient::connect_one(options, lanes, port).await
    }

    /// Connects one connection, with its own endpoint, and says HELLO. Its UDP port is `port`
    /// where that is free (the brick steers consecutive ports to different endpoints), else
    /// any.
    async fn connect_one(
        options: ConnectOptions,
        lanes: Lanes,
        port: Option<u16>,
    ) -> Result<BrickClient, Error> {
        let client_config = quinn_config(&options)?;
        let bind: SocketAddr = match options.addr {
            SocketAddr::V4(_) => "0.0.0.0:0",
            SocketAddr::V6(_) => "[::]:0",
        }
        .parse()
        .map_err(|_| Error::Tls("bad bind address".into()))?;
        let asked = port.map(|port| quic::udp_socket(SocketAddr::new(bind.ip(), port), false));
        let socket = match asked {
            Some(Ok(socket)) => socket,
            _ => quic::udp_socket(bind, false).map_err(|e| connect_error(&options, e))?,
        };
        let endpoint = quinn::Endpoint::new(
            quic::endpoint_config(),
            None,
            socket,
            quic::QuicRuntime::new(quic::Spawn::Runtime),
        )
        .map_err(|e| connect_error(&options, e))?;
        let client = BrickClient {
            inner: Arc::new(Inner {
                id: CLIENT_IDS.fetch_add(1, Ordering::Relaxed),
                options,
                endpoint,
                client_config,
                live: Mutex::new(None),
                connecting: tokio::sync::Mutex::new(()),
                epochs: AtomicU64::new(0),
                next_request: AtomicU64::new(1),
                events: tokio::sync::broadcast::Sender::new(EVENTS_QUEUED_MAX),
                lanes,
            }),
        };
        client.live().await?;
        Ok(client)
    }

    /// The UDP port of this client's (main) connection: its last, lanes first.
    pub fn local_port(&self) -> Option<u16> {
        self.inner.endpoint.local_addr().ok().map(|a| a.port())
    }

    /// What the brick said at HELLO on the current connection.
    pub async fn hello(&self) -> Result<HelloReply, Error> {
        Ok(self.live().await?.hello)
    }

    /// The current connection's transport counters (datagrams, frames by type, round-trip
    /// estimate), or `None` while disconnected: for benchmarks that count what a call costs.
    pub fn transport_stats(&self) -> Option<quinn::ConnectionStats> {
        self.current().map(|live| live.conn.connection.stats())
    }

    /// Closes the connections; calls in flight fail.
    pub async fn close(&self) {
        for lane in self.inner.lanes.clients() {
            lane.close_one().await;
        }
        self.close_one().await;
    }

    async fn close_one(&self) {
        let live = self.inner.live.lock().map(|mut l| l.take()).unwrap_or(None);
        if let Some(live) = live {
            live.conn
                .connection
                .close(CloseCode::Done.into(), b"client done");
        }
        self.inner.endpoint.wait_idle().await;
    }

    /// Sends any fop as it is, fd ids and all, as `creds`: for tools that drive the brick's
    /// sessions directly (benchmarks comparing with the engine). An fd id from an OPEN sent
    /// this way is the current connection's and dies with it; the [`Layer`] methods keep fds
    /// valid across reconnects.
    pub async fn call_raw(&self, creds: &Creds, fop: FopRequest) -> Result<FopReply, Error> {
        let live = self.live().await?;
        self.call_on(&live, creds, fop).await
    }

    /// Sends `fop` on `live`; a fop the brick does not take (it lacks the capability) goes as
    /// the older fop it stands for, and its reply comes back in the asked fop's shape.
    async fn call_on(
        &self,
        live: &Live,
        creds: &Creds,
        fop: FopRequest,
    ) -> Result<FopReply, Error> {
        let has = |capability| live.hello.capabilities.contains(capability);
        match fop {
            FopRequest::LookupXattrs(r) if !has(Capabilities::XATTR_PRESENCE) => {
                let lookup = kiln_wire::Lookup {
                    parent: r.parent,
                    name: r.name,
                };
                match self.send(live, creds, lookup.into()).await? {
                    FopReply::Lookup(r) => Ok(FopReply::LookupXattrs(r.into())),
                    _ => Err(unexpected("LOOKUP")),
                }
            }
            FopRequest::ReaddirpXattrs(r) if !has(Capabilities::XATTR_PRESENCE) => {
                let (fd, offset, size) = (r.fd, r.offset, r.size);
                let readdirp = kiln_wire::Readdirp { fd, offset, size };
                match self.send(live, creds, readdirp.into()).await? {
                    FopReply::Readdirp(r) => Ok(FopReply::ReaddirpXattrs(r.into())),
                    _ => Err(unexpected("READDIRP")),
                }
            }
            FopRequest::Get(r) if !has(Capabilities::GET) => {
                let (offset, size) = (r.offset, r.size);
                let read = |fd| kiln_wire::Read { fd, offset, size }.into();
                match self.on_read_only_fd(live, creds, r.gfid, read).await? {
                    FopReply::Read(r) => Ok(FopReply::Get(r)),
                    _ => Err(unexpected("READ")),
                }
            }
            FopRequest::UnlinkSettled(r) if !has(Capabilities::UNLINK_SETTLED) => {
                let lookup = kiln_wire::Lookup {
                    parent: r.parent,
                    name: r.name.clone(),
                };
                let FopReply::Lookup(found) = self.send(live, creds, lookup.into()).await? else {
                    return Err(unexpected("LOOKUP"));
                };
                let sticky = found.iatt.mode.bits() & libc::S_ISVTX != 0;
                if found.iatt.file_type == FileType::Regular && sticky {
                    return Err(Error::Fop(ErrorCode::CrossDevice));
                }
                let unlink = kiln_wire::Unlink {
                    parent: r.parent,
                    name: r.name,
                };
                match self.send(live, creds, unlink.into()).await? {
                    FopReply::Unlink(r) => Ok(FopReply::UnlinkSettled(r)),
                    _ => Err(unexpected("UNLINK")),
                }
            }
            FopRequest::PutSynced(r) if !has(Capabilities::PUT_SYNCED) => {
                let gfid = r.put.gfid;
                let FopReply::Put(made) = self.send(live, creds, r.put.into()).await? else {
                    return Err(unexpected("PUT"));
                };
                // As root: whoever made the file may not be allowed to open it again.
                let fsync = |fd| {
                    let datasync = false;
                    kiln_wire::Fsync { fd, datasync }.into()
                };
                self.on_read_only_fd(live, &Creds::root(), gfid, fsync)
                    .await?;
                Ok(FopReply::PutSynced(made))
            }
            fop => self.send(live, creds, fop).await,
        }
    }

    /// OPEN of regular file `gfid` for reading as `creds`, the fop `fop` makes of the fd,
    /// and RELEASE: a fop on a file by GFID where the brick lacks the one-round-trip form
    /// (GET's READ, PUT_SYNCED's FSYNC). The fop's reply, whatever the release's.
    async fn on_read_only_fd(
        &self,
        live: &Live,
        creds: &Creds,
        gfid: Gfid,
        fop: impl FnOnce(FdId) -> FopRequest,
    ) -> Result<FopReply, Error> {
        let open = kiln_wire::Open {
            gfid,
            access: AccessMode::ReadOnly,
            flags: OpenFlags::empty(),
        };
        let FopReply::Open(opened) = self.send(live, creds, open.into()).await? else {
            return Err(unexpected("OPEN"));
        };
        let fd = opened.fd;
        let reply = self.send(live, creds, fop(fd)).await;
        if let Err(e) = self
            .send(live, creds, kiln_wire::Release { fd }.into())
            .await
        {
            // The fop's reply stands; the fd goes with the session at the latest.
            tracing::debug!(error = %e, "release after a fop on a GFID's fd failed");
        }
        reply
    }

    async fn send(&self, live: &Live, creds: &Creds, fop: FopRequest) -> Result<FopReply, Error> {
        let code = fop.code();
        let call = Call::Fop {
            creds: creds.clone(),
            fop,
        };
        match self.round_trip(&live.conn, call, live.crc()).await? {
            Outcome::Fop(reply) if reply.code() == code => Ok(reply),
            Outcome::Error { error, .. } => Err(Error::Fop(error)),
            other => Err(Error::Protocol(format!(
                "a {:?} reply to {}",
                other.code(),
                code.name()
            ))),
        }
    }

    /// Sends a PING and waits for its echo.
    pub async fn ping(&self) -> Result<(), Error> {
        let live = self.live().await?;
        let nonce = self.inner.next_request.load(Ordering::Relaxed);
        match self
            .round_trip(
                &live.conn,
                Call::Ping(kiln_wire::Ping { nonce }),
                live.crc(),
            )
            .await?
        {
            Outcome::Ping(p) if p.nonce == nonce => Ok(()),
            other => Err(Error::Protocol(format!("bad PING answer {other:?}"))),
        }
    }

    async fn round_trip(
        &self,
        conn: &Conn,
        call: Call,
        crc: BodyChecksum,
    ) -> Result<Outcome, Error> {
        let id = self.inner.next_request.fetch_add(1, Ordering::Relaxed);
        let (mut send, mut recv) = conn
            .connection
            .open_bi()
            .await
            .map_err(|e| self.lost(conn, e.to_string()))?;
        let request = Message::Request(Request { id, call });
        quic::write_message(&mut send, &request, crc)
            .await
            .map_err(|e| self.stream_error(conn, e))?;
        match quic::read_message(&mut recv, crc)
            .await
            .map_err(|e| self.stream_error(conn, e))?
        {
            Message::Reply(Reply { id: rid, outcome }) if rid == id => Ok(outcome),
            other => Err(Error::Protocol(format!(
                "expected the reply to request {id}, got {other:?}"
            ))),
        }
    }

    fn stream_error(&self, conn: &Conn, e: quic::StreamError) -> Error {
        match e {
            quic::StreamError::Read(quinn::ReadError::ConnectionLost(c))
            | quic::StreamError::Write(quinn::WriteError::ConnectionLost(c)) => {
                self.lost(conn, c.to_string())
            }
            quic::StreamError::Read(quinn::ReadError::Reset(code))
            | quic::StreamError::Write(quinn::WriteError::Stopped(code)) => Error::Protocol(
                format!("the brick refused the request (stream code {code})"),
            ),
            // A truncated reply means the brick went away mid-reply.
            quic::StreamError::Truncated if conn.connection.close_reason().is_some() => {
                self.lost(conn, "connection closed".into())
            }
            e => Error::Protocol(e.to_string()),
        }
    }

    /// Forgets `conn` (if it is still current) so the next call reconnects.
    fn lost(&self, conn: &Conn, reason: String) -> Error {
        if let Ok(mut current) = self.inner.live.lock()
            && current.as_ref().is_some_and(|c| c.conn.epoch == conn.epoch)
        {
            *current = None;
        }
        match conn.connection.close_reason() {
            Some(quinn::ConnectionError::ApplicationClosed(close)) => {
                Error::Disconnected(format!("{}", String::from_utf8_lossy(&close.reason)))
            }
            _ => Error::Disconnected(reason),
        }
    }

    /// The current connection, connecting (once, for all waiting callers) if there is none.
    async fn live(&self) -> Result<Live, Error> {
        if let Some(live) = self.current() {
            return Ok(live);
        }
        let _connecting = self.inner.connecting.lock().await;
        if let Some(live) = self.current() {
            return Ok(live);
        }
        let live = self.connect_once().await?;
        if let Ok(mut current) = self.inner.live.lock() {
            *current = Some(live.clone());
        }
        Ok(live)
    }

    /// Whether the current connection's brick took every capability in `wanted`.
    fn offers(&self, wanted: Capabilities) -> bool {
        self.current()
            .is_some_and(|live| live.hello.capabilities.contains(wanted))
    }

    fn current(&self) -> Option<Live> {
        let live = self.inner.live.lock().ok()?.clone()?;
        live.conn
            .connection
            .close_reason()
            .is_none()
            .then_some(live)
    }

    async fn connect_once(&self) -> Result<Live, Error> {
        let options = &self.inner.options;
        let connection = self
            .inner
            .endpoint
            .connect_with(
                self.inner.client_config.clone(),
                options.addr,
                &options.server_name,
            )
            .map_err(|e| connect_error(options, e))?
            .await
            .map_err(|e| refused_or_connect(options, e))?;
        let hello = Hello {
            version_min: PROTOCOL_VERSION,
            version_max: PROTOCOL_VERSION,
            capabilities: options.capabilities,
            client_name: Label::new(options.client_name.clone().into_bytes())
                .map_err(|e| Error::Tls(format!("client name: {e}")))?,
        };
        let conn = Conn {
            connection: connection.clone(),
            epoch: self.inner.epochs.fetch_add(1, Ordering::Relaxed) + 1,
        };
        let outcome = self
            .round_trip(&conn, Call::Hello(hello), BodyChecksum::Required)
            .await
            .map_err(|e| match connection.close_reason() {
                Some(reason) => refused_or_connect(options, reason),
                None => e,
            })?;
        match outcome {
            Outcome::Hello(hello) => {
                let live = Live { conn, hello };
                if live.hello.capabilities.contains(Capabilities::LEASES) {
                    let events = self.inner.events.clone();
                    tokio::spawn(read_events(connection, events, live.crc()));
                }
                Ok(live)
            }
            Outcome::Error { error, .. } => Err(hello_refused(options, &connection, error).await),
            other => Err(Error::Protocol(format!("bad HELLO answer {other:?}"))),
        }
    }

    /// `fd`'s id on `live`'s session, opening it again there (as `creds`) if it was opened on
    /// an older connection.
    async fn fd_id(&self, live: &Live, creds: &Creds, fd: &Fd) -> Result<FdId, Error> {
        if fd.client != self.inner.id {
            return Err(Error::Fop(ErrorCode::BadFd));
        }
        let (epoch, id) = *fd.state.lock().map_err(|_| Error::Fop(ErrorCode::BadFd))?;
        if epoch == live.conn.epoch {
            return Ok(id);
        }
        if fd.locked.load(Ordering::Relaxed) {
            return Err(Error::Fop(ErrorCode::BadFd));
        }
        let reopen = match fd.kind {
            FdKind::File { access, flags } => {
                let keep = flags.bits() & !(OpenFlags::TRUNC.bits() | OpenFlags::EXCL.bits());
                FopRequest::Open(kiln_wire::Open {
                    gfid: fd.gfid,
                    access,
                    flags: OpenFlags::from_bits(keep).unwrap_or(OpenFlags::empty()),
                })
            }
            FdKind::Dir => FopRequest::Opendir(kiln_wire::Opendir { gfid: fd.gfid }),
        };
        let id = match self.call_on(live, creds, reopen).await {
            Ok(FopReply::Open(r) | FopReply::Opendir(r)) => r.fd,
            Ok(_) => return Err(Error::Protocol("bad reopen reply".into())),
            Err(Error::Fop(_)) => return Err(Error::Fop(ErrorCode::BadFd)),
            Err(e) => return Err(e),
        };
        self.check_same_inode(live, creds, fd, id).await?;
        if let Ok(mut state) = fd.state.lock() {
            *state = (live.conn.epoch, id);
        }
        Ok(id)
    }

    /// After a reopen by GFID: the file must be the inode `fd` had (when known), else the new
    /// fd goes and the old one is stale (EBADF).
    async fn check_same_inode(
        &self,
        live: &Live,
        creds: &Creds,
        fd: &Fd,
        id: FdId,
    ) -> Result<(), Error> {
        let ino = fd.ino.load(Ordering::Relaxed);
        if ino == 0 || matches!(fd.kind, FdKind::Dir) {
            return Ok(());
        }
        let fstat = FopRequest::Fstat(kiln_wire::Fstat { fd: id });
        match self.call_on(live, creds, fstat).await {
            Ok(FopReply::Fstat(r)) if r.iatt.ino == ino => Ok(()),
            Ok(_) | Err(Error::Fop(_)) => {
                let release = FopRequest::Release(kiln_wire::Release { fd: id });
                let _ = self.call_on(live, creds, release).await;
                Err(Error::Fop(ErrorCode::BadFd))
            }
            Err(e) => Err(e),
        }
    }

    fn new_fd(&self, live: &Live, gfid: Gfid, kind: FdKind, id: FdId) -> Fd {
        self.fd_at(gfid, kind, (live.conn.epoch, id), 0)
    }

    /// An fd of this client in state `state` (connection epoch, the brick's id), with a slot
    /// per lane.
    fn fd_at(&self, gfid: Gfid, kind: FdKind, state: (u64, FdId), ino: u64) -> Fd {
        Fd {
            client: self.inner.id,
            gfid,
            kind,
            state: Mutex::new(state),
            locked: AtomicBool::new(false),
            ino: AtomicU64::new(ino),
            on_lanes: (0..self.inner.lanes.clients().len())
                .map(|_| tokio::sync::OnceCell::new())
                .collect(),
        }
    }

    /// `fd` (of the client this one is a lane of) opened on this client's session by its GFID,
    /// as `creds`; `None` if the brick refuses (the file is gone, or `creds` may not open it).
    async fn adopt(&self, creds: &Creds, fd: &Fd) -> Result<Option<Fd>, Error> {
        // Epoch 0 is no connection's: `fd_id` opens it by its GFID.
        let unopened = (
            0,
            FdId {
                slot: 0,
                generation: 0,
            },
        );
        let ino = fd.ino.load(Ordering::Relaxed);
        let adopted = self.fd_at(fd.gfid, fd.kind, unopened, ino);
        let live = self.live().await?;
        match self.fd_id(&live, creds, &adopted).await {
            Ok(_) => Ok(Some(adopted)),
            Err(Error::Fop(e)) => {
                tracing::debug!(error = %e, gfid = %fd.gfid, "a lane cannot open the file");
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Sends `fop` on `fd` over lane `lane`, or over the main connection if the file cannot
    /// be opened there (or the lane cannot be reached to open it, tried again next time).
    async fn call_fd_on_lane(
        &self,
        lane: usize,
        creds: &Creds,
        fd: &Fd,
        fop: FdFop,
    ) -> Result<FopReply, Error> {
        let client = &self.inner.lanes.clients()[lane];
        let opened = fd.on_lanes[lane]
            .get_or_try_init(|| client.adopt(creds, fd))
            .await;
        match opened {
            Ok(Some(on_lane)) => client.call_fd_here(creds, on_lane, fop).await,
            Ok(None) => self.call_fd_here(creds, fd, fop).await,
            Err(e) => {
                tracing::debug!(error = %e, lane, "lane unreachable; main connection");
                self.call_fd_here(creds, fd, fop).await
            }
        }
    }

    /// Sends `fop` on `fd` over this client's own connection. Opens `fd` again first if the
    /// connection it was opened on is gone. An fd that takes a POSIX lock is marked: locks are
    /// not carried over a reconnect, so after one it fails with EBADF.
    async fn call_fd_here(&self, creds: &Creds, fd: &Fd, fop: FdFop) -> Result<FopReply, Error> {
        let takes_lock = matches!(
            fop.request(),
            FopRequest::Lk(lk) if lk.cmd != LockCmd::Get && lk.lock.kind != LockKind::Unlock
        );
        let code = fop.code();
        let live = self.live().await?;
        let id = self.fd_id(&live, creds, fd).await?;
        let request = fop
            .on(id)
            .ok_or_else(|| Error::Misuse(format!("{} names no fd", code.name())))?;
        let reply = self.call_on(&live, creds, request).await?;
        if takes_lock {
            fd.locked.store(true, Ordering::Relaxed);
        }
        if let Some(ino) = inode_of(&reply) {
            let _ = fd
                .ino
                .compare_exchange(0, ino, Ordering::Relaxed, Ordering::Relaxed);
        }
        Ok(reply)
    }

    /// Releases `fd` on this client's own session; an fd of an older connection died with it
    /// and needs nothing.
    async fn release_here(&self, creds: &Creds, fd: &Fd) -> Result<(), Error> {
        let live = self.live().await?;
        if fd.client != self.inner.id {
            return Err(Error::Fop(ErrorCode::BadFd));
        }
        let (epoch, id) = *fd.state.lock().map_err(|_| Error::Fop(ErrorCode::BadFd))?;
        if epoch != live.conn.epoch {
            return Ok(());
        }
        let fop = match fd.kind {
            FdKind::File { .. } => FopRequest::Release(kiln_wire::Release { fd: id }),
            FdKind::Dir => FopRequest::Releasedir(kiln_wire::Releasedir { fd: id }),
        };
        self.call_on(&live, creds, fop).await.map(drop)
    }
}

/// The bottom of the stack: each fop goes to the brick over the current connection (made
/// again first if it broke), with the fd ids of that connection's session. Each fop runs from
/// the heap, as the distribution layer's do: its state stays out of the futures above.
impl Layer for BrickClient {
    type Fd = Fd;

    fn call(
        &self,
        creds: &Creds,
        fop: FopRequest,
    ) -> impl Future<Output = Result<FopReply, Error>> + Send {
        Box::pin(async move {
            let opens = matches!(
                fop.code(),
                FopCode::Open | FopCode::Create | FopCode::Opendir | FopCode::OpendirList
            );
            if opens || fop.fd().is_some() {
                return Err(Error::Misuse(format!(
                    "{} through Layer::call, which takes fops that name no fd and open nothing",
                    fop.code().name()
                )));
            }
            self.call_raw(creds, fop).await
        })
    }

    fn open(
        &self,
        creds: &Creds,
        gfid: Gfid,
        access: AccessMode,
        flags: OpenFlags,
    ) -> impl Future<Output = Result<Fd, Error>> + Send {
        Box::pin(async move {
            let live = self.live().await?;
            let fop = kiln_wire::Open {
                gfid,
                access,
                flags,
            };
            match self.call_on(&live, creds, fop.into()).await? {
                FopReply::Open(r) => {
                    Ok(self.new_fd(&live, gfid, FdKind::File { access, flags }, r.fd))
                }
                _ => Err(unexpected("OPEN")),
            }
        })
    }

    fn create(
        &self,
        creds: &Creds,
        create: kiln_wire::Create,
    ) -> impl Future<Output = Result<(Fd, EntryReply), Error>> + Send {
        Box::pin(async move {
            let live = self.live().await?;
            let (gfid, access, flags) = (create.gfid, create.access, create.flags);
            match self.call_on(&live, creds, create.into()).await? {
                FopReply::Create(r) => {
                    let fd = self.new_fd(&live, gfid, FdKind::File { access, flags }, r.fd);
                    fd.ino.store(r.iatt.ino, Ordering::Relaxed);
                    let entry = EntryReply {
                        iatt: r.iatt,
                        pre_parent: r.pre_parent,
                        post_parent: r.post_parent,
                    };
                    Ok((fd, entry))
                }
                _ => Err(unexpected("CREATE")),
            }
        })
    }

    fn opendir(&self, creds: &Creds, gfid: Gfid) -> impl Future<Output = Result<Fd, Error>> + Send {
        Box::pin(async move {
            let live = self.live().await?;
            let fop = kiln_wire::Opendir { gfid };
            match self.call_on(&live, creds, fop.into()).await? {
                FopReply::Opendir(r) => Ok(self.new_fd(&live, gfid, FdKind::Dir, r.fd)),
                _ => Err(unexpected("OPENDIR")),
            }
        })
    }

    fn opendir_list(
        &self,
        creds: &Creds,
        gfid: Gfid,
        size: kiln_wire::ReaddirSize,
        lease: kiln_wire::LeaseKind,
    ) -> impl Future<
        Output = Result<(Fd, kiln_wire::LeaseKind, kiln_wire::ReaddirpXattrsReply), Error>,
    > + Send {
        Box::pin(async move {
            let live = self.live().await?;
            if !live.hello.capabilities.contains(Capabilities::OPENDIR_LIST) {
                return opendir_list_apart(self, creds, gfid, size, lease).await;
            }
            let fop = kiln_wire::OpendirList { gfid, size, lease };
            match self.call_on(&live, creds, fop.into()).await? {
                FopReply::OpendirList(r) => {
                    let fd = self.new_fd(&live, gfid, FdKind::Dir, r.fd);
                    Ok((fd, r.lease, r.listing))
                }
                _ => Err(unexpected("OPENDIR_LIST")),
            }
        })
    }

    /// A large READ or WRITE may go over a lane ([`lanes`]); everything else over the main
    /// connection ([`BrickClient::call_fd_here`]).
    fn call_fd(
        &self,
        creds: &Creds,
        fd: &Fd,
        fop: FdFop,
    ) -> impl Future<Output = Result<FopReply, Error>> + Send {
        Box::pin(async move {
            if matches!(fop.code(), FopCode::Release | FopCode::Releasedir) {
                return Err(Error::Misuse(format!(
                    "{} through Layer::call_fd; Layer::release ends an fd",
                    fop.code().name()
                )));
            }
            if fd.client == self.inner.id
                && let Some(lane) = self.inner.lanes.pick(fd, fop.request())
            {
                return self.call_fd_on_lane(lane, creds, fd, fop).await;
            }
            self.call_fd_here(creds, fd, fop).await
        })
    }

    /// Releases the file on the main session and on every lane it was opened on; the first
    /// failure is the answer, after every release was tried.
    fn release(&self, creds: &Creds, fd: Fd) -> impl Future<Output = Result<(), Error>> + Send {
        Box::pin(async move {
            let mut released = self.release_here(creds, &fd).await;
            for (client, on_lane) in self.inner.lanes.clients().iter().zip(fd.on_lanes) {
                if let Some(on_lane) = on_lane.into_inner().flatten() {
                    let lane_released = client.release_here(creds, &on_lane).await;
                    released = released.and(lane_released);
                }
            }
            released
        })
    }

    fn batch(&self, batch: Batch) -> impl Future<Output = Result<BatchReply, Error>> + Send {
        Box::pin(async move {
            let live = self.live().await?;
            if !live.hello.capabilities.contains(Capabilities::LEASES) {
                // A brick without BATCH gets the fops one by one, in order.
                return batch_one_by_one(self, &batch).await;
            }
            match self
                .round_trip(&live.conn, Call::Batch(batch), live.crc())
                .await?
            {
                Outcome::Batch(reply) => Ok(reply),
                Outcome::Error { error, .. } => Err(Error::Fop(error)),
                other => Err(Error::Protocol(format!(
                    "a {:?} reply to BATCH",
                    other.code()
                ))),
            }
        })
    }

    fn leases(&self) -> bool {
        self.offers(Capabilities::LEASES)
    }

    fn listed_attrs(&self) -> bool {
        self.offers(Capabilities::LEASES.union(Capabilities::LISTED_ATTRS))
    }

    fn file_leases(&self) -> bool {
        self.offers(Capabilities::LEASES.union(Capabilities::FILE_LEASES))
    }

    fn unlink_settled(&self) -> bool {
        self.offers(Capabilities::UNLINK_SETTLED)
    }

    fn events(&self) -> tokio::sync::broadcast::Receiver<LayerEvent> {
        self.inner.events.subscribe()
    }
}
/// The inode number an fd fop's reply names, if any.
fn inode_of(reply: &FopReply) -> Option<u64> {
    match reply {
        FopReply::Fstat(r) => Some(r.iatt.ino),
        FopReply::Read(r) => Some(r.iatt.ino),
        FopReply::Write(r)
        | FopReply::Fsync(r)
        | FopReply::Fsetattr(r)
        | FopReply::Ftruncate(r)
        | FopReply::Fallocate(r)
        | FopReply::Discard(r)
        | FopReply::Zerofill(r) => Some(r.post.ino),
        _ => None,
    }
}

/// How long a refused HELLO waits for the brick to close the connection with its reason.
const REFUSAL_REASON_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Passes the brick's events on `connection` (one frame per unidirectional stream) to the
/// layers above until the connection ends, and then says its leases are lost.
async fn read_events(
    connection: quinn::Connection,
    events: tokio::sync::broadcast::Sender<LayerEvent>,
    crc: BodyChecksum,
) {
    while let Ok(mut stream) = connection.accept_uni().await {
        match quic::read_message(&mut stream, crc).await {
            Ok(Message::Event(Event::Recall(recall))) => {
                let _ = events.send(LayerEvent::Recall(recall));
            }
            Ok(Message::Event(Event::Invalidate(_))) => {}
            Ok(other) => tracing::warn!(?other, "not an event on an event stream"),
            Err(e) => tracing::warn!(error = %e, "a bad event frame"),
        }
    }
    let _ = events.send(LayerEvent::LeasesLost);
}

/// A HELLO the brick answered with `error`: the reason the brick closes the connection with
/// (auth.allow, a revoked certificate, a connection limit), or one made from the error.
async fn hello_refused(
    options: &ConnectOptions,
    connection: &quinn::Connection,
    error: ErrorCode,
) -> Error {
    let closed = tokio::time::timeout(REFUSAL_REASON_WAIT, connection.closed()).await;
    if let Ok(quinn::ConnectionError::ApplicationClosed(close)) = closed {
        return Error::Refused(String::from_utf8_lossy(&close.reason).into_owned());
    }
    Error::Refused(match error {
        ErrorCode::ProtoNotSupported => {
            format!("the brick does not speak protocol version {PROTOCOL_VERSION}")
        }
        // The brick answers EACCES at HELLO to a client not in `auth.allow`.
        ErrorCode::Access => format!(
            "client '{}' is not allowed on this volume (auth.allow)",
            options.client_name
        ),
        error => format!(
            "HELLO refused: {}",
            crate::error::errno_text(error.to_errno())
        ),
    })
}

fn unexpected(fop: &str) -> Error {
    Error::Protocol(format!("unexpected reply to {fop}"))
}

fn connect_error(options: &ConnectOptions, e: impl std::fmt::Display) -> Error {
    Error::Connect {
        addr: options.addr.to_string(),
        reason: e.to_string(),
    }
}

/// A connection the brick closed on purpose says why; anything else is a connect failure.
fn refused_or_connect(options: &ConnectOptions, e: quinn::ConnectionError) -> Error {
    match e {
        quinn::ConnectionError::ApplicationClosed(close) => {
            Error::Refused(String::from_utf8_lossy(&close.reason).into_owned())
        }
        e => connect_error(options, e),
    }
}

/// The QUIC client configuration for `options`: TLS 1.3 with the client certificate, the
/// cluster CA as the only root, Kiln's ALPN and transport parameters.
pub fn quinn_config(options: &ConnectOptions) -> Result<quinn::ClientConfig, Error> {
    let tls_error = |e: &dyn std::fmt::Display| Error::Tls(e.to_string());
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(options.identity.ca.clone())
        .map_err(|e| tls_error(&e))?;
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| tls_error(&e))?
        .with_root_certificates(roots)
        .with_client_auth_cert(
            options.identity.chain.clone(),
            options.identity.key.clone_key(),
        )
        .map_err(|e| tls_error(&e))?;
    tls.alpn_protocols = vec![quic::ALPN.to_vec()];
    let crypto = QuicClientConfig::try_from(tls).map_err(|e| tls_error(&e))?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(quic::transport_config(
        quic::PeerStreams::Events,
        options.udp_payload_max_bytes,
        options.idle_timeout,
    ));
    Ok(config)
}
