//! The client stack's one interface: every layer of the client implements [`Layer`], as every
//! GlusterFS translator speaks the same fop table.
//!
//! The bottom of a stack is a [`crate::BrickClient`] (one QUIC connection to one brick); a
//! layer that wraps another holds the layer below and implements [`Layer`] again, so the FUSE
//! mount, the path helpers ([`crate::Paths`]) and the CLI run unchanged on whatever stack a
//! volume needs. [`LayerExt`] adds typed one-fop helpers to every layer.

use std::fmt::Debug;
use std::future::Future;

use bytes::Bytes;
use kiln_wire::{
    AccessMode, Batch, BatchReply, Creds, EntryReply, ErrorCode, FdId, FopCode, FopReply,
    FopRequest, FsStats, Gfid, Iatt, LeaseKind, Lock, LockCmd, Name, OpenFlags, ReaddirSize,
    ReaddirpXattrsReply, Recall,
};
use tokio::sync::broadcast;

use crate::error::Error;

/// The highest offset of a directory listing that no layer gives an entry: the mount lists
/// `.` and `..` (which no brick lists) at offsets 1 and 2. A brick's offsets are its file
/// system's cookies, none of which is 1 or 2 past the file system's own `.` and `..` (a
/// cookie says where the next entry begins: ext4 and XFS count bytes or hashes, btrfs an
/// index from 2); distribution numbers its own from above this.
pub const DOT_OFFSET_MAX: u64 = 2;

/// One layer of the client stack: the fops the mount and the path helpers send, with the
/// caller's credentials on every call (a layer is shared by every caller of a mount).
///
/// The fops come in four kinds, each through its own method, so a wrapping layer sees what a
/// fop addresses before it decides where the fop goes:
///
/// * [`call`](Layer::call): a fop that names no fd and opens nothing — an entry fop (a name
///   in a parent directory: LOOKUP, MKDIR, UNLINK, RENAME, PUT, …) or an inode fop (a GFID:
///   STAT, SETATTR, GETXATTR, …).
/// * [`open`](Layer::open), [`create`](Layer::create), [`opendir`](Layer::opendir): fops that
///   open, answered with the layer's own handle, [`Layer::Fd`].
/// * [`call_fd`](Layer::call_fd): a fop on an open fd, as an [`FdFop`] — the wire request
///   whose fd id is left for the brick client to fill in from its own fd.
/// * [`release`](Layer::release): the end of an fd (RELEASE or RELEASEDIR).
///
/// Where the next layers go:
///
/// * **Distribution** (a volume's bricks behind one namespace) sits between the mount and
///   path helpers above and one brick client per brick below. It routes each `call` by what
///   the fop names — an entry fop by the hash of its name in the parent's layout, an inode fop
///   by its GFID's brick, MKDIR and RMDIR to every brick — and its `Fd` holds the fd (or, for
///   a directory, the fds) of the brick clients below; `call_fd` forwards the [`FdFop`]
///   unchanged, or rewrites it first (a READDIRP cookie that says which brick to continue on,
///   through [`FdFop::request_mut`]).
/// * **Leases and caching** sit above distribution, nearest the mount. They look at each fop
///   ([`FdFop::request`] for fd fops) and answer some themselves — a LOOKUP or STAT from a
///   directory lease's entries, an FSTAT from cached attributes, a CREATE under a write lease
///   at once, sent below in the background — and pass the rest down.
pub trait Layer: Send + Sync + 'static {
    /// This layer's handle on an open file or directory. Only this layer can use it; a
    /// wrapping layer keeps the handle of the layer below inside its own.
    type Fd: Debug + Send + Sync + 'static;

    /// Runs a fop that names no fd and opens nothing, as `creds`.
    fn call(
        &self,
        creds: &Creds,
        fop: FopRequest,
    ) -> impl Future<Output = Result<FopReply, Error>> + Send;

    /// Opens file `gfid`.
    fn open(
        &self,
        creds: &Creds,
        gfid: Gfid,
        access: AccessMode,
        flags: OpenFlags,
    ) -> impl Future<Output = Result<Self::Fd, Error>> + Send;

    /// Creates a name with a new object (its GFID chosen by the caller) and opens it; the new
    /// entry's attributes and its parent's before and after.
    fn create(
        &self,
        creds: &Creds,
        create: kiln_wire::Create,
    ) -> impl Future<Output = Result<(Self::Fd, EntryReply), Error>> + Send;

    /// Opens directory `gfid` for reading.
    fn opendir(
        &self,
        creds: &Creds,
        gfid: Gfid,
    ) -> impl Future<Output = Result<Self::Fd, Error>> + Send;

    /// Opens directory `gfid` with its first `size` bytes of entries (READDIRP_XATTRS from the
    /// start) and, unless `lease` is none, that lease on it taken before they are read: the
    /// fd, the lease granted, the entries. By default as LEASE beside OPENDIR, then
    /// READDIRP_XATTRS ([`opendir_list_apart`]); a brick takes them as one OPENDIR_LIST.
    fn opendir_list(
        &self,
        creds: &Creds,
        gfid: Gfid,
        size: ReaddirSize,
        lease: LeaseKind,
    ) -> impl Future<Output = Result<(Self::Fd, LeaseKind, ReaddirpXattrsReply), Error>> + Send
    {
        opendir_list_apart(self, creds, gfid, size, lease)
    }

    /// Runs a fop on the open file or directory `fd` (anything but its release).
    fn call_fd(
        &self,
        creds: &Creds,
        fd: &Self::Fd,
        fop: FdFop,
    ) -> impl Future<Output = Result<FopReply, Error>> + Send;

    /// Ends `fd` (RELEASE or RELEASEDIR).
    fn release(
        &self,
        creds: &Creds,
        fd: Self::Fd,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// Runs the fops of `batch` in order, each as if sent alone, and answers each (a failed
    /// fop does not stop the rest): one round trip where the brick takes BATCH.
    fn batch(&self, batch: Batch) -> impl Future<Output = Result<BatchReply, Error>> + Send;

    /// Whether the layers below can hold directory leases (LEASE, and RECALL events).
    fn leases(&self) -> bool;

    /// Whether a directory lease below also covers the attributes its listings returned
    /// (capability `LISTED_ATTRS`): they may be kept until it is recalled.
    fn listed_attrs(&self) -> bool;

    /// Whether the layers below grant read leases on files (capability `FILE_LEASES`).
    fn file_leases(&self) -> bool {
        false
    }

    /// Whether this layer takes UNLINK_SETTLED (capability `UNLINK_SETTLED`), which removes a
    /// name in one round trip unless it is a distribution link file or a file being moved.
    /// Only a brick client does; the distribution layer sends it to the bricks below.
    fn unlink_settled(&self) -> bool {
        false
    }

    /// STATFS of each brick below that takes new objects, apart: where a distributed
    /// volume's STATFS sums them, a change lands on one brick, and the fullest decides
    /// whether it fits.
    fn statfs_each(
        &self,
        creds: &Creds,
    ) -> impl Future<Output = Result<Vec<FsStats>, Error>> + Send {
        async move {
            let statfs = kiln_wire::Statfs { gfid: Gfid::ROOT };
            match self.call(creds, statfs.into()).await? {
                FopReply::Statfs(r) => Ok(vec![r.stats]),
                _ => Err(unexpected("STATFS")),
            }
        }
    }

    /// The events from below: lease recalls, and the loss of every lease with the session
    /// that held them. A receiver that falls behind (`Lagged`) must assume its leases lost.
    fn events(&self) -> broadcast::Receiver<LayerEvent>;
}

/// Runs the fops of `batch` through `layer`'s [`Layer::call`], one after another: the answer
/// to a BATCH where no single request can carry it (a brick without BATCH, fops bound for
/// several bricks). A fop's failure is its result; a broken connection ends the batch.
pub async fn batch_one_by_one<L: Layer + ?Sized>(
    layer: &L,
    batch: &Batch,
) -> Result<BatchReply, Error> {
    let mut results = Vec::with_capacity(batch.len());
    for fop in batch.fops() {
        results.push(match layer.call(&batch.creds, fop.clone()).await {
            Ok(reply) => Ok(reply),
            Err(Error::Fop(code)) => Err(code),
            Err(e) => return Err(e),
        });
    }
    Ok(BatchReply { results })
}

/// [`Layer::opendir_list`] as separate fops: LEASE beside OPENDIR, then READDIRP_XATTRS from
/// the start once both are answered (so the entries are read under the lease). When either
/// fails the fd is released and the lease given back, as the brick does for OPENDIR_LIST.
pub async fn opendir_list_apart<L: Layer + ?Sized>(
    layer: &L,
    creds: &Creds,
    gfid: Gfid,
    size: ReaddirSize,
    lease: LeaseKind,
) -> Result<(L::Fd, LeaseKind, ReaddirpXattrsReply), Error> {
    let ask = |kind| layer.call(creds, kiln_wire::Lease { gfid, kind }.into());
    let leased = async {
        match lease {
            LeaseKind::None => LeaseKind::None,
            kind => match ask(kind).await {
                Ok(FopReply::Lease(r)) => r.kind,
                _ => LeaseKind::None,
            },
        }
    };
    let (granted, opened) = tokio::join!(leased, layer.opendir(creds, gfid));
    let (fd, error) = match opened {
        Ok(fd) => {
            let fop = FdFop::new(|fd| {
                kiln_wire::ReaddirpXattrs {
                    fd,
                    offset: 0,
                    size,
                }
                .into()
            });
            match layer.call_fd(creds, &fd, fop).await {
                Ok(FopReply::ReaddirpXattrs(listing)) => return Ok((fd, granted, listing)),
                Ok(_) => (Some(fd), unexpected("READDIRP_XATTRS")),
                Err(e) => (Some(fd), e),
            }
        }
        Err(e) => (None, e),
    };
    // Failed: nothing stays open or held that the caller would not know of.
    if let Some(fd) = fd {
        let _ = layer.release(creds, fd).await;
    }
    if granted != LeaseKind::None {
        let _ = ask(LeaseKind::None).await;
    }
    Err(error)
}

/// What the layers below tell the layers above without being asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerEvent {
    /// Give back the lease on a directory, after sending what is pending there.
    Recall(Recall),
    /// The session that held the leases ended (the connection broke): they are all gone.
    LeasesLost,
}

/// A fop on an open file or directory, on its way down the stack: the wire request it will be,
/// built around an fd id that only the brick client knows, which it puts in last.
///
/// A layer inspects or rewrites the fop as the one wire enum ([`FdFop::request`],
/// [`FdFop::request_mut`]), so routing rules are written once for fd and GFID fops alike.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FdFop(FopRequest);

/// The fd id an [`FdFop`] carries until the brick client replaces it; never sent.
const FD_FILLED_IN_BELOW: FdId = FdId {
    slot: u32::MAX,
    generation: u32::MAX,
};

impl FdFop {
    /// The fop `build` makes around the fd id, e.g. `FdFop::new(|fd| Fstat { fd }.into())`.
    /// `build` must make a fop that names an fd: one that does not is refused by the brick
    /// client ([`Error::Misuse`]).
    pub fn new(build: impl FnOnce(FdId) -> FopRequest) -> FdFop {
        let fop = build(FD_FILLED_IN_BELOW);
        debug_assert!(fop.fd().is_some(), "{} names no fd", fop.code().name());
        FdFop(fop)
    }

    pub fn code(&self) -> FopCode {
        self.0.code()
    }

    /// The fop, for a layer that routes it or answers it itself. Its fd id means nothing
    /// above the brick client.
    pub fn request(&self) -> &FopRequest {
        &self.0
    }

    /// The fop, for a layer that changes it on its way down (say, a directory offset).
    pub fn request_mut(&mut self) -> &mut FopRequest {
        &mut self.0
    }

    /// The wire request on the brick's fd `fd`; `None` when the fop names no fd.
    pub fn on(self, fd: FdId) -> Option<FopRequest> {
        let mut fop = self.0;
        fop.set_fd(fd).then_some(fop)
    }
}

/// Typed helpers for single fops, on every layer.
pub trait LayerExt: Layer {
    /// LOOKUP of one name in a directory.
    fn lookup(
        &self,
        creds: &Creds,
        parent: Gfid,
        name: &Name,
    ) -> impl Future<Output = Result<Iatt, Error>> + Send {
        let fop = kiln_wire::Lookup {
            parent,
            name: name.clone(),
        };
        async move {
            match self.call(creds, fop.into()).await? {
                FopReply::Lookup(r) => Ok(r.iatt),
                _ => Err(unexpected("LOOKUP")),
            }
        }
    }

    /// STAT of an object by GFID.
    fn stat(&self, creds: &Creds, gfid: Gfid) -> impl Future<Output = Result<Iatt, Error>> + Send {
        async move {
            match self.call(creds, kiln_wire::Stat { gfid }.into()).await? {
                FopReply::Stat(r) => Ok(r.iatt),
                _ => Err(unexpected("STAT")),
            }
        }
    }

    /// Reads up to `size` bytes at `offset`; fewer at the end of the file.
    fn read(
        &self,
        creds: &Creds,
        fd: &Self::Fd,
        offset: u64,
        size: u32,
    ) -> impl Future<Output = Result<Bytes, Error>> + Send {
        async move {
            let size = kiln_wire::ReadSize::new(size).ok_or(Error::Fop(ErrorCode::Inval))?;
            let fop = FdFop::new(|fd| kiln_wire::Read { fd, offset, size }.into());
            match self.call_fd(creds, fd, fop).await? {
                FopReply::Read(r) => Ok(r.data.into_bytes()),
                _ => Err(unexpected("READ")),
            }
        }
    }

    /// Writes `data` (at most 1 MiB) at `offset`; the file's attributes before and after.
    fn write(
        &self,
        creds: &Creds,
        fd: &Self::Fd,
        offset: u64,
        data: Bytes,
    ) -> impl Future<Output = Result<kiln_wire::AttrChange, Error>> + Send {
        async move {
            let data = kiln_wire::Payload::new(data)
                .map_err(|e| Error::Fop(ErrorCode::from_errno(e.errno())))?;
            let fop = FdFop::new(|fd| kiln_wire::Write { fd, offset, data }.into());
            match self.call_fd(creds, fd, fop).await? {
                FopReply::Write(r) => Ok(r),
                _ => Err(unexpected("WRITE")),
            }
        }
    }

    /// Flushes `fd`'s data (and with `datasync == false`, its metadata) to stable storage.
    fn fsync(
        &self,
        creds: &Creds,
        fd: &Self::Fd,
        datasync: bool,
    ) -> impl Future<Output = Result<(), Error>> + Send {
        let fop = FdFop::new(|fd| kiln_wire::Fsync { fd, datasync }.into());
        async move { self.call_fd(creds, fd, fop).await.map(drop) }
    }

    /// A POSIX record lock operation on `fd`; for [`LockCmd::Get`], the conflicting lock.
    fn lk(
        &self,
        creds: &Creds,
        fd: &Self::Fd,
        cmd: LockCmd,
        lock: Lock,
    ) -> impl Future<Output = Result<Lock, Error>> + Send {
        let fop = FdFop::new(|fd| kiln_wire::Lk { fd, cmd, lock }.into());
        async move {
            match self.call_fd(creds, fd, fop).await? {
                FopReply::Lk(r) => Ok(r.lock),
                _ => Err(unexpected("LK")),
            }
        }
    }
}

impl<L: Layer + ?Sized> LayerExt for L {}

fn unexpected(fop: &str) -> Error {
    Error::Protocol(format!("unexpected reply to {fop}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_fd_fop_gets_the_brick_fd_last() {
        let fop = FdFop::new(|fd| kiln_wire::Fstat { fd }.into());
        assert_eq!(fop.code(), FopCode::Fstat);
        let id = FdId {
            slot: 3,
            generation: 9,
        };
        assert_eq!(
            fop.on(id),
            Some(FopRequest::Fstat(kiln_wire::Fstat { fd: id }))
        );
    }

    #[test]
    fn a_rewritten_fop_that_names_no_fd_is_not_sent() {
        let mut fop = FdFop::new(|fd| kiln_wire::Fstat { fd }.into());
        *fop.request_mut() = kiln_wire::Stat { gfid: Gfid::ROOT }.into();
        let id = FdId {
            slot: 0,
            generation: 0,
        };
        assert_eq!(fop.on(id), None);
    }
}
