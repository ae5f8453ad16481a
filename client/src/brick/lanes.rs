//! Bulk lanes: the extra connections of a [`BrickClient`] made with
//! [`ConnectOptions::connections`] above 1.
//!
//! One QUIC connection is driven by one task at each end, so it moves at most what one core
//! encrypts, decrypts and copies. Large READs and WRITEs (at least [`LANE_IO_MIN_BYTES`]) are
//! spread round robin over the main connection and the lanes. Each has a UDP socket of its
//! own, on consecutive ports where they are free, and the brick steers consecutive ports to
//! different endpoint workers (`kiln_wire::quic::steer_by_source_port`). Everything else
//! (namespace fops, small I/O, locks, fsync, leases and their recalls) stays on the main
//! connection.
//!
//! A lane is a brick client with a session of its own. A file is opened on a lane by its GFID
//! at its first large request there, as after a reconnect: the same access mode, never
//! `TRUNC` or `EXCL` again, and the same inode when the main fd knows it. A lane the brick
//! will not open it on leaves that fd's requests on the main connection. The lane fds are
//! released with the main fd. Data written through a lane is in the same inode, so an
//! `fsync` on the main fd covers it once the WRITE was answered.
//!
//! What a lane does not share with the main session: its identity for leases. A WRITE through
//! a lane to a file the main session listed under a directory lease is another session's
//! change to the brick, and recalls that lease (correct, but a lost lease).

use std::sync::atomic::{AtomicUsize, Ordering};

use kiln_wire::FopRequest;

use super::{BrickClient, ConnectOptions, Fd, FdKind};
use crate::error::Error;

/// READs and WRITEs of at least this many bytes take a lane; smaller ones stay on the main
/// connection, where their round trip is shortest.
pub const LANE_IO_MIN_BYTES: usize = 256 * 1024;

/// Most connections one brick client makes to its brick (the main one included).
pub const CONNECTIONS_MAX: usize = 16;

/// The lanes of one brick client (none when it has one connection).
#[derive(Debug, Default)]
pub(super) struct Lanes {
    clients: Vec<BrickClient>,
    /// Large requests so far: request `n` goes to lane `n % (lanes + 1)`, 0 the main one.
    next: AtomicUsize,
}

impl Lanes {
    /// Connects the `options.connections - 1` lanes, each with its own endpoint, from
    /// `options.local_port` on, each on the port after the last one's where it can. Returns
    /// them and the port the main connection should take.
    pub(super) async fn connect(options: &ConnectOptions) -> Result<(Lanes, Option<u16>), Error> {
        if !(1..=CONNECTIONS_MAX).contains(&options.connections) {
            return Err(Error::Misuse(format!(
                "{} connections to a brick; 1 to {CONNECTIONS_MAX} are allowed",
                options.connections
            )));
        }
        let mut clients = Vec::with_capacity(options.connections - 1);
        let mut port = (options.local_port != 0).then_some(options.local_port);
        for _ in 1..options.connections {
            let lane = BrickClient::connect_one(options.clone(), Lanes::default(), port);
            let lane = lane.await?;
            port = lane.local_port().and_then(|p| p.checked_add(1));
            clients.push(lane);
        }
        let lanes = Lanes {
            clients,
            next: AtomicUsize::new(0),
        };
        Ok((lanes, port))
    }

    pub(super) fn clients(&self) -> &[BrickClient] {
        &self.clients
    }

    /// The lane `fop` on `fd` takes, or `None` for the main connection.
    pub(super) fn pick(&self, fd: &Fd, fop: &FopRequest) -> Option<usize> {
        if self.clients.is_empty() {
            return None;
        }
        let bytes = match fop {
            FopRequest::Read(r) => r.size.get() as usize,
            FopRequest::Write(w) => w.data.len(),
            _ => return None,
        };
        if bytes < LANE_IO_MIN_BYTES || !matches!(fd.kind, FdKind::File { .. }) {
            return None;
        }
        let turn = self.next.fetch_add(1, Ordering::Relaxed) % (self.clients.len() + 1);
        turn.checked_sub(1)
    }
}
