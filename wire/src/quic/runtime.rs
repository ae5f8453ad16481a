//! quinn's I/O on tokio, as [`quinn::TokioRuntime`] does it, less two costs a round trip paid
//! there (`docs/benchmarks.md`, "one `epoll_wait` per round trip on the brick, not three"):
//!
//! * **The socket is watched for reading only.** tokio's `UdpSocket` asks epoll for write
//!   readiness too, edge-triggered, and every datagram sent wakes the socket's waiters with
//!   `EPOLLOUT` when the kernel frees it: one more `epoll_wait` per send that finds only that.
//!   A UDP send almost never blocks (it fails with `EAGAIN` when the send buffer is full), so
//!   write readiness is asked for only then, on a duplicate of the descriptor, and dropped
//!   once the socket is writable again.
//! * **[`Spawn::Local`]: the endpoint's and connections' drivers run on the current thread's
//!   `LocalSet`** (the brick's workers), with the tasks that serve the calls. Spawned on the
//!   runtime instead, a datagram that wakes a call's task crosses from the runtime's queue to
//!   the `LocalSet`'s, and the scheduler polls the driver once more without blocking in between.

#![allow(unsafe_code)]

use std::fmt;
use std::future::Future;
use std::io;
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Instant;

use quinn::udp::{RecvMeta, Transmit, UdpSocketState};
use quinn::{AsyncTimer, AsyncUdpSocket, Runtime, UdpPoller};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// Where quinn's driver tasks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spawn {
    /// On the tokio runtime (`tokio::spawn`).
    Runtime,
    /// On the current thread's `LocalSet` (`tokio::task::spawn_local`): the endpoint must be
    /// made, and its connections opened, on a thread inside one.
    Local,
}

/// A [`quinn::Runtime`] on tokio whose sockets are watched for reading only.
#[derive(Debug, Clone, Copy)]
pub struct QuicRuntime {
    spawn: Spawn,
}

impl QuicRuntime {
    pub fn new(spawn: Spawn) -> Arc<QuicRuntime> {
        Arc::new(QuicRuntime { spawn })
    }
}

impl Runtime for QuicRuntime {
    fn new_timer(&self, at: Instant) -> Pin<Box<dyn AsyncTimer>> {
        quinn::TokioRuntime.new_timer(at)
    }

    fn spawn(&self, future: Pin<Box<dyn Future<Output = ()> + Send>>) {
        match self.spawn {
            Spawn::Runtime => drop(tokio::spawn(future)),
            Spawn::Local => drop(tokio::task::spawn_local(future)),
        }
    }

    fn wrap_udp_socket(&self, socket: std::net::UdpSocket) -> io::Result<Arc<dyn AsyncUdpSocket>> {
        socket.set_nonblocking(true)?;
        let state = UdpSocketState::new((&socket).into())?;
        // SAFETY: the `AsyncFd` owns the socket, which it never replaces, so the descriptor
        // stays open and the same for the registration's whole life.
        let io = unsafe { AsyncFd::register_with_interest(socket, Interest::READABLE) }?;
        Ok(Arc::new(UdpSocket {
            io,
            state,
            blocked: AtomicBool::new(false),
        }))
    }

    fn now(&self) -> Instant {
        quinn::TokioRuntime.now()
    }
}

/// A UDP socket registered with the runtime for reading only.
struct UdpSocket {
    io: AsyncFd<std::net::UdpSocket>,
    state: UdpSocketState,
    /// A send found the buffer full since the socket was last seen writable.
    blocked: AtomicBool,
}

impl fmt::Debug for UdpSocket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UdpSocket")
            .field("io", self.io.get_ref())
            .field("blocked", &self.blocked)
            .finish_non_exhaustive()
    }
}

impl AsyncUdpSocket for UdpSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        Box::pin(WritePoller {
            socket: self,
            watch: None,
        })
    }

    fn try_send(&self, transmit: &Transmit<'_>) -> io::Result<()> {
        let sent = self.state.send(self.io.get_ref().into(), transmit);
        if matches!(&sent, Err(e) if e.kind() == io::ErrorKind::WouldBlock) {
            self.blocked.store(true, Ordering::Release);
        }
        sent
    }

    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [io::IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.io.poll_read_ready(cx))?;
            if let Ok(received) =
                guard.try_io(|io| self.state.recv(io.get_ref().into(), bufs, meta))
            {
                return Poll::Ready(received);
            }
        }
    }

    fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.io.get_ref().local_addr()
    }

    fn may_fragment(&self) -> bool {
        self.state.may_fragment()
    }

    fn max_transmit_segments(&self) -> usize {
        self.state.max_gso_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.state.gro_segments()
    }
}

/// One task's wait for the socket to take datagrams again.
struct WritePoller {
    socket: Arc<UdpSocket>,
    /// While a send is blocked: a duplicate of the socket's descriptor registered for write
    /// readiness (epoll tells the two registrations apart by descriptor).
    watch: Option<AsyncFd<OwnedFd>>,
}

impl fmt::Debug for WritePoller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WritePoller")
            .field("socket", &self.socket)
            .field("watching", &self.watch.is_some())
            .finish()
    }
}

impl UdpPoller for WritePoller {
    fn poll_writable(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.socket.blocked.load(Ordering::Acquire) {
            this.watch = None;
            return Poll::Ready(Ok(()));
        }
        if this.watch.is_none() {
            // Registering looks at the socket's state then, so a buffer emptied since the
            // failed send is not missed.
            let fd = OwnedFd::from(this.socket.io.get_ref().try_clone()?);
            // SAFETY: as for the socket: the `AsyncFd` owns the duplicate.
            let watch = unsafe { AsyncFd::register_with_interest(fd, Interest::WRITABLE) }?;
            this.watch = Some(watch);
        }
        let watch = this.watch.as_ref().expect("set above");
        // The next send finds out whether the room lasts: a failure blocks it again.
        drop(ready!(watch.poll_write_ready(cx))?);
        this.socket.blocked.store(false, Ordering::Release);
        this.watch = None;
        Poll::Ready(Ok(()))
    }
}
