//! Open handles: what stands behind each FUSE file handle, and when it gets its fd on the
//! layer below.
//!
//! A handle gets its fd at open, or later:
//!
//! * **Open-behind** (GlusterFS's name): a plain read-only open of a file a lease covers (the
//!   file's read lease, held or taken by the open, or its directory's over a kept listing or
//!   the mount's own description) is answered without opening it below, as its opener, until
//!   the handle's first use ([`Shared::late_fd`]) — a read from the kernel's page cache costs
//!   the brick nothing. Its first read from the start is one GET of up to
//!   [`GET_AHEAD_BYTES`], whatever the kernel asked: the rest answers the handle's next
//!   reads, so a file of that size is read whole with one round trip and no fd. Another
//!   client's removal of the file recalls the lease first, and the recall gives the handles
//!   on it their fds ([`Shared::anchor_handles_on`]); a file no lease covers is opened below
//!   at once, so that an open of a file gone from the brick fails (ESTALE: the kernel looks
//!   the name up again) rather than its first read.
//! * **Deferred creates**: a small write-only create is answered by the mount and sent as one
//!   PUT at close ([`super::pending`]); its handles get their fds after the PUT.
//! * **Kept listings**: a directory held under a lease whose last listing the mount keeps
//!   ([`super::leases`]) is opened and listed without the brick; its fd is opened only if
//!   the kernel asks for more than the kept listing (a seek, or a listing that went stale).
//! * **Anchoring**: before a fop that may remove a name, every handle still without an fd gets
//!   one ([`Shared::anchor_handles`]), so an open file outlives its unlink.
//!
//! **Write-behind** (GlusterFS's name): writes to a file the mount describes itself (made
//! under its write lease on the directory, which is still held) are answered at once and
//! gathered per handle while they continue each other, up to [`UNSENT_BYTES_MAX`], then
//! sent as one WRITE: tar's 10 KiB writes of a large file cost one round trip per MiB
//! instead of one each. Anything that must see the data on the brick sends it first: a read
//! or fd fop on the file, a fop on its node ([`Shared::settle`]), its close and fsync, a
//! directory fsync, the unmount, and a recall of any lease (before the lease goes back, so
//! another client sees the data). A WRITE the brick refuses fails the write that sent it,
//! or else the file's next `close` or `fsync`. Handles opened `O_SYNC`, `O_DSYNC` or
//! `O_DIRECT` write through.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fuser::{Errno, FileAttr, FileHandle, FopenFlags, LockOwner};
use kiln_wire::limits::IO_SIZE_MAX_BYTES;
use kiln_wire::{
    AccessMode, Batch, Creds, DirEntryXattrs, ErrorCode, FopReply, FopRequest, Gfid, Iatt, Lease,
    LeaseKind, Lock, LockCmd, Mode, OpenFlags, ReadSize, ReaddirSize, SetAttr,
};

use super::convert::{
    Result, errno, fopen_flags, name_of, open_mode, requested_access, seek_what, unexpected,
};
use super::inodes::ChangeMark;
use super::leases::{Answer, LISTED_ENTRIES_KEPT_MAX, Mark};
use super::pages::Stamp;
use super::pending::{DEFERRED_BYTES_MAX, Pending, killed_suidgid};
use super::shared::{Shared, Ttl, store_pages};
use crate::path::new_gfid;
use crate::{Error, FdFop, Layer, LayerExt};

/// What an open learned of a file's read lease.
#[derive(Debug, Clone, Copy)]
struct FileLease {
    /// A lease (the file's, or its directory's over a kept listing) covers the file: another
    /// client's change or removal of it is recalled first.
    covered: bool,
    /// What the kernel cached of the file before must go (a lease taken now over pages of no
    /// version the brick showed, or a recall under way).
    drop_cache: bool,
}

impl FileLease {
    /// Nothing asked: the kernel's caches stay as they are.
    fn kept(covered: bool) -> FileLease {
        FileLease {
            covered,
            drop_cache: false,
        }
    }
}

/// The kernel's `FMODE_EXEC` as FUSE passes it in an OPEN's flags: the file is opened to be
/// run. While it is open the kernel refuses writers (ETXTBSY).
const EXEC_OPEN: i32 = 0x20;

/// Bytes of directory entries fetched from the brick per READDIRP; the kernel takes them a
/// page at a time from the handle's buffer.
const READDIR_FETCH_BYTES: u32 = 128 * 1024;

/// Bytes a handle's first read from the start asks the brick for at least (the kernel's
/// first read of a file is often shorter).
pub(super) const GET_AHEAD_BYTES: u32 = 256 * 1024;
/// Bytes read ahead that the mount's handles keep at once; past it, a first read gets what
/// the kernel asked only.
const AHEAD_BYTES_MAX: usize = 64 << 20;

/// Bytes of continuing writes a handle gathers before they go as one WRITE.
const UNSENT_BYTES_MAX: usize = IO_SIZE_MAX_BYTES;
/// Bytes written behind that the mount's handles hold at once; past it, writes go through.
const UNSENT_TOTAL_BYTES_MAX: usize = 64 << 20;
/// How long a write answered behind (gathered, or a deferred create's) waits at most for
/// the writes that continue it or its file's close before it is sent anyway.
const BEHIND_AGE_MAX: Duration = Duration::from_secs(1);
/// Bytes the deferred creates may hold at once, counted at their most
/// ([`DEFERRED_BYTES_MAX`] each) from create to release: past it a file is made on the
/// brick at its create. Those in held directories are closed without a FLUSH (unless the
/// writeback cache is on), their closers not waiting for the queue behind to have room.
const DEFERRED_TOTAL_BYTES_MAX: usize = 64 << 20;

/// An open file or directory behind a FUSE file handle; `F` is the layer's fd.
#[derive(Debug)]
pub(super) struct Open<F> {
    /// Set at open, or on first use for a deferred create (once it is on the brick).
    pub(super) fd: tokio::sync::OnceCell<F>,
    pub(super) ino: u64,
    /// How, and as whom, to open the file on the brick when the fd is made late.
    access: AccessMode,
    flags: OpenFlags,
    late_creds: Creds,
    /// Opened to run the program in it ([`EXEC_OPEN`]).
    executing: bool,
    /// A directory: its late fd comes from OPENDIR.
    directory: bool,
    /// Directories only: entries fetched but not yet given to the kernel.
    listing: tokio::sync::Mutex<Listing>,
    /// What the first read fetched beyond what the kernel asked.
    ahead: Mutex<Option<Ahead>>,
    /// Writes answered but not yet sent (locked while they are sent, so writes reach the
    /// brick in order).
    unsent: tokio::sync::Mutex<Option<Unsent>>,
    /// The kernel sends no FLUSH when it is closed (`FOPEN_NOFLUSH`, [`Shared::no_flush`],
    /// and a deferred create's in a held directory): what its close would do happens at its
    /// release ([`Shared::close_unflushed`], [`Shared::store_released`]).
    no_flush: bool,
    /// Owners that took POSIX locks through a `no_flush` handle.
    lock_owners: Mutex<Vec<u64>>,
    /// A deferred create's share of [`DEFERRED_TOTAL_BYTES_MAX`].
    deferred_share: Option<Budgeted>,
}

/// A handle just opened: its number and the flags the kernel is to keep it with.
#[derive(Debug)]
pub(super) struct Opened {
    pub(super) fh: FileHandle,
    pub(super) flags: FopenFlags,
}

/// Writes through one handle answered but not yet sent: bytes from `offset` on, as `creds`
/// wrote them, the first at `since`.
#[derive(Debug)]
struct Unsent {
    creds: Creds,
    offset: u64,
    data: bytes::BytesMut,
    since: Instant,
    _budget: Budgeted,
}

impl Unsent {
    /// Takes `data`, written at `offset` by `creds`, when it continues these bytes and fits.
    fn append(&mut self, creds: &Creds, offset: u64, data: &[u8]) -> bool {
        let continues = self.offset + self.data.len() as u64 == offset && self.creds == *creds;
        let fits = self.data.len() + data.len() <= UNSENT_BYTES_MAX;
        if continues && fits {
            self.data.extend_from_slice(data);
        }
        continues && fits
    }
}

/// The start of a file, read by a handle's first read: it answers the handle's next reads
/// while nothing changed through the mount.
#[derive(Debug)]
struct Ahead {
    data: Bytes,
    /// The file ended within `data`.
    eof: bool,
    /// The mount's change count ([`super::leases::Leases::changes`]) before the read.
    changes: u64,
    _budget: Budgeted,
}

/// Bytes counted in the mount's read-ahead total while this lives.
#[derive(Debug)]
struct Budgeted {
    bytes: usize,
    total: Arc<AtomicUsize>,
}

impl Budgeted {
    /// `bytes` more in `total`, unless that would pass `max`.
    fn reserve(total: &Arc<AtomicUsize>, bytes: usize, max: usize) -> Option<Budgeted> {
        total
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                held.checked_add(bytes).filter(|&n| n <= max)
            })
            .ok()?;
        Some(Budgeted {
            bytes,
            total: total.clone(),
        })
    }
}

impl Drop for Budgeted {
    fn drop(&mut self) {
        self.total.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

impl<F> Open<F> {
    /// A handle on node `ino`, with its fd or (`None`) one to open as `late_creds` with
    /// `access` and `flags` at first use.
    fn new(
        fd: Option<F>,
        ino: u64,
        access: AccessMode,
        flags: OpenFlags,
        late_creds: &Creds,
    ) -> Open<F> {
        Open {
            fd: tokio::sync::OnceCell::new_with(fd),
            ino,
            access,
            flags,
            late_creds: late_creds.clone(),
            executing: false,
            directory: false,
            listing: tokio::sync::Mutex::new(Listing::default()),
            ahead: Mutex::new(None),
            unsent: tokio::sync::Mutex::new(None),
            no_flush: false,
            lock_owners: Mutex::new(Vec::new()),
            deferred_share: None,
        }
    }

    /// The flags the kernel keeps this handle with, opened with kernel `flags`.
    fn fopen_flags(&self, flags: i32) -> FopenFlags {
        let mut fopen = fopen_flags(flags);
        if self.no_flush {
            fopen |= FopenFlags::FOPEN_NOFLUSH;
        }
        if self.writes_direct() {
            fopen |= FopenFlags::FOPEN_DIRECT_IO;
        }
        fopen
    }

    /// Whether the kernel sends each write(2) through this handle as it comes, as one WRITE,
    /// past its page cache: a deferred create's in a held directory. Write-through would
    /// split a write at every page it fills only in part, and look up `security.capability`
    /// before the first. The release fills the file's pages at once
    /// ([`Shared::store_released`]); a write-only handle is never mapped. The kernel leaves
    /// the set-ID bits to the mount ([`Shared::write`]).
    fn writes_direct(&self) -> bool {
        self.no_flush && self.deferred_share.is_some()
    }

    /// `size` bytes at `offset` from what the first read fetched, if it has them and the
    /// mount's change count is still `changes`; past the file's end, what is left of it.
    fn read_ahead(&self, offset: u64, size: u32, changes: u64) -> Option<Bytes> {
        let ahead = self.ahead.lock().unwrap_or_else(|p| p.into_inner());
        let ahead = ahead.as_ref().filter(|a| a.changes == changes)?;
        let len = ahead.data.len() as u64;
        let end = offset.checked_add(u64::from(size))?;
        let range = match (end <= len, ahead.eof) {
            (true, _) => offset..end,
            (false, true) => offset.min(len)..len,
            (false, false) => return None,
        };
        let range = usize::try_from(range.start).ok()?..usize::try_from(range.end).ok()?;
        Some(ahead.data.slice(range))
    }
}

#[derive(Debug, Default)]
struct Listing {
    /// The offset the kernel passes to continue at the first entry not yet given.
    from: u64,
    /// The entries fetched (shared with the listing the mount keeps, if it does); those
    /// before `next` were given to the kernel.
    entries: Arc<[DirEntryXattrs]>,
    next: usize,
    /// No entries follow the fetched ones.
    eof: bool,
    /// What a listing from the start of a held directory has fetched so far.
    whole: Option<Whole>,
}

/// A listing from the start of a directory held with a lease, followed across replies.
#[derive(Debug, Default)]
struct Whole {
    /// Where the hold was when it began and every entry fetched so far, while the listing
    /// may still be kept ([`LISTED_ENTRIES_KEPT_MAX`] entries at most).
    kept: Option<(Mark, Vec<DirEntryXattrs>)>,
    /// The hold's generation when it began and every name fetched so far, while the
    /// directory's entries are not known yet (they are these at the end).
    names: Option<(u64, Vec<(kiln_wire::Name, Gfid)>)>,
}

impl Listing {
    /// The next entry to give the kernel, if one was fetched.
    fn pending(&self) -> Option<&DirEntryXattrs> {
        self.entries.get(self.next)
    }
}

/// The mount's file handles: FUSE's `fh` → the open file or directory.
#[derive(Debug)]
pub(super) struct Handles<F> {
    files: Mutex<HashMap<u64, Arc<Open<F>>>>,
    next_fh: AtomicU64,
    /// Bytes the handles keep read ahead, at most [`AHEAD_BYTES_MAX`].
    ahead_bytes: Arc<AtomicUsize>,
    /// Bytes the handles hold written behind, at most [`UNSENT_TOTAL_BYTES_MAX`].
    unsent_bytes: Arc<AtomicUsize>,
    /// Bytes of deferred creates, at most [`DEFERRED_TOTAL_BYTES_MAX`].
    deferred_bytes: Arc<AtomicUsize>,
    /// The handles holding writes not yet sent: kept here until those are on the brick, past
    /// the handle's release too, so that a fop on the file finds them (and waits for them).
    with_unsent: Mutex<HashMap<u64, Arc<Open<F>>>>,
    /// Removals of names under way ([`Removal`]): a handle added meanwhile takes its fd at
    /// once rather than at its first use, when its file may be gone from the brick.
    removals: Arc<AtomicUsize>,
    /// Removals begun so far.
    removals_begun: AtomicU64,
}

/// Where removals of names stood when an open began ([`Handles::removal_mark`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct RemovalMark {
    begun: u64,
    under_way: bool,
}

/// A removal of names under way, from before it looks for the handles in its way until the
/// brick has answered it (dropped then). An open file must outlive an unlink, as on a local
/// file system: a handle opened before the removal looked is given its fd by the removal
/// ([`Shared::anchor_handles`]) or keeps the removal off the queue; one added after takes its
/// fd at once ([`Handles::insert`]), so no handle is left to open a file the brick no
/// longer has.
#[derive(Debug)]
pub(super) struct Removal(Arc<AtomicUsize>);

impl Drop for Removal {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl<F> Handles<F> {
    pub(super) fn new() -> Handles<F> {
        Handles {
            files: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            ahead_bytes: Arc::new(AtomicUsize::new(0)),
            unsent_bytes: Arc::new(AtomicUsize::new(0)),
            deferred_bytes: Arc::new(AtomicUsize::new(0)),
            with_unsent: Mutex::new(HashMap::new()),
            removals: Arc::new(AtomicUsize::new(0)),
            removals_begun: AtomicU64::new(0),
        }
    }

    /// Where removals of names stand, as an open begins.
    pub(super) fn removal_mark(&self) -> RemovalMark {
        RemovalMark {
            begun: self.removals_begun.load(Ordering::SeqCst),
            under_way: self.removals.load(Ordering::SeqCst) > 0,
        }
    }

    /// Notes a removal of names under way, before it looks for the handles in its way.
    pub(super) fn removal(&self) -> Removal {
        // Under the table's lock: a handle added before is in the table when the removal
        // looks, one added after sees the count (`insert`).
        let _table = self.lock();
        self.removals.fetch_add(1, Ordering::SeqCst);
        self.removals_begun.fetch_add(1, Ordering::SeqCst);
        Removal(self.removals.clone())
    }

    /// Whether handle `fh` holds writes not yet sent.
    pub(super) fn has_unsent(&self, fh: FileHandle) -> bool {
        self.unsent_lock().contains_key(&fh.0)
    }

    /// Notes that handle `fh` (`open`) holds writes not yet sent.
    fn note_unsent(&self, fh: u64, open: &Arc<Open<F>>) {
        self.unsent_lock().insert(fh, open.clone());
    }

    /// Notes that what handle `fh` held is on the brick (or refused).
    fn note_sent(&self, fh: u64) {
        self.unsent_lock().remove(&fh);
    }

    /// The handles holding writes not yet sent (or being sent): on node `ino`, or all.
    fn with_unsent(&self, ino: Option<u64>) -> Vec<(u64, Arc<Open<F>>)> {
        self.unsent_lock()
            .iter()
            .filter(|(_, open)| ino.is_none_or(|ino| ino == open.ino))
            .map(|(&fh, open)| (fh, open.clone()))
            .collect()
    }

    fn unsent_lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Open<F>>>> {
        self.with_unsent.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds `open`; its handle number.
    fn add(&self, open: Open<F>) -> u64 {
        self.insert(open, None).0
    }

    /// Adds `open`, opened with kernel `flags`; with whether it must take its fd now (see
    /// [`Handles::insert`]).
    fn add_opened(&self, open: Open<F>, flags: i32, mark: Option<RemovalMark>) -> (Opened, bool) {
        let flags = open.fopen_flags(flags);
        let (fh, fd_now) = self.insert(open, mark);
        let opened = Opened {
            fh: FileHandle(fh),
            flags,
        };
        (opened, fd_now)
    }

    /// Adds `open`: its handle number, and — given `mark`, where removals of names stood when
    /// the open began — whether it must take its fd now: it has none, and a removal was under
    /// way at some moment since (a file the open waited for may be gone from the brick).
    fn insert(&self, open: Open<F>, mark: Option<RemovalMark>) -> (u64, bool) {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let late = open.fd.get().is_none();
        let mut table = self.lock();
        table.insert(fh, Arc::new(open));
        // Read under the table's lock: see `Handles::removal`.
        let removing = mark.is_some_and(|mark| {
            mark.under_way
                || self.removals.load(Ordering::SeqCst) > 0
                || self.removals_begun.load(Ordering::SeqCst) != mark.begun
        });
        drop(table);
        (fh, late && removing)
    }

    /// Notes that `owner` takes POSIX locks through handle `fh`: a handle closed without a
    /// FLUSH has the brick drop them at its release.
    pub(super) fn note_lock_owner(&self, fh: FileHandle, owner: LockOwner) {
        let Some(open) = self.get(fh).ok().filter(|open| open.no_flush) else {
            return;
        };
        let mut owners = open.lock_owners.lock().unwrap_or_else(|p| p.into_inner());
        if !owners.contains(&owner.0) {
            owners.push(owner.0);
        }
    }

    /// Handle `fh`; EBADF for one the mount does not know.
    pub(super) fn get(&self, fh: FileHandle) -> Result<Arc<Open<F>>> {
        self.lock().get(&fh.0).cloned().ok_or(Errno::EBADF)
    }

    /// Forgets handle `fh`.
    pub(super) fn take(&self, fh: FileHandle) -> Option<Arc<Open<F>>> {
        self.lock().remove(&fh.0)
    }

    /// Whether a program runs node `ino` from this mount.
    fn executing(&self, ino: u64) -> bool {
        self.lock().values().any(|o| o.ino == ino && o.executing)
    }

    /// How many handles are open on node `ino`.
    pub(super) fn open_on(&self, ino: u64) -> usize {
        self.lock().values().filter(|o| o.ino == ino).count()
    }

    /// Any handle open on node `ino`.
    pub(super) fn any_on(&self, ino: u64) -> Option<Arc<Open<F>>> {
        self.lock().values().find(|o| o.ino == ino).cloned()
    }

    /// The handles still without an fd, except those on nodes `skip`.
    fn without_fd(&self, skip: &[u64]) -> Vec<Arc<Open<F>>> {
        self.lock()
            .values()
            .filter(|o| o.fd.get().is_none() && !skip.contains(&o.ino))
            .cloned()
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Open<F>>>> {
        self.files.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<L: Layer> Shared<L> {
    /// Whether the kernel may close a handle on node `ino` opened with kernel `flags` as
    /// `access` without a FLUSH (`FOPEN_NOFLUSH`; with the writeback cache it sends one
    /// regardless), sparing the closer a FUSE request it would wait for: a read-only handle
    /// has nothing to send or report at its close. A file that has had POSIX locks through
    /// the mount keeps its FLUSH, so its locks go at the close ([`Shared::close_unflushed`]).
    /// A handle that writes keeps it, its close reporting a refused deferred create — but
    /// for a deferred create in a held directory, whose PUT goes behind the close anyway
    /// ([`Shared::create_handle`]).
    fn no_flush(&self, ino: u64, access: AccessMode, flags: i32) -> bool {
        !self.options.writeback_cache
            && access == AccessMode::ReadOnly
            && flags & libc::O_TRUNC == 0
            && !self.inodes.is_locked(ino)
    }

    /// OPEN of node `ino` with kernel `flags`, as `c`; the new handle.
    pub(super) async fn open_handle(
        self: &Arc<Self>,
        c: &Creds,
        ino: u64,
        flags: i32,
    ) -> Result<Opened> {
        let gfid = self.gfid(ino)?;
        let removals = self.handles.removal_mark();
        let recalls = self.recalls_seen();
        if flags & libc::O_TRUNC != 0 && self.handles.executing(ino) {
            // The kernel refuses it too, but only once the file system has opened — and
            // truncated — the file: the brick must not cut a running program short.
            return Err(Errno::ETXTBSY);
        }
        self.settle(ino).await?;
        let (access, open_flags) = open_mode(flags, self.options.writeback_cache);
        let late = self.opens_late(access, open_flags);
        let opened = async {
            match late {
                true => Ok(None),
                false => {
                    Some(self.open_below(c, gfid, flags, access, open_flags).await).transpose()
                }
            }
        };
        // The kernel asks for security.capability before the first write through the handle
        // (to drop it): learnt beside the open, not after it.
        let probe = async {
            if access != AccessMode::ReadOnly && !self.inodes.probed_known(ino) {
                self.probe_xattrs(c, ino).await;
            }
        };
        let (fd, lease, ()) = tokio::join!(opened, self.lease_file(c, gfid, access), probe);
        let fd = match (fd?, lease) {
            (Some(fd), _) => Some(fd),
            // Gone from the brick since the kernel looked it up: the open fails, and the
            // kernel looks the name up again.
            (None, Err(gone)) => return Err(gone),
            (None, Ok(lease)) if lease.covered => None,
            // Nothing would tell the mount of another client's removal before the first
            // read: the fd now, so that the open fails if the file is gone already, as it
            // would on a local disk, and the handle outlives a later removal.
            (None, Ok(_)) => Some(self.open_below(c, gfid, flags, access, open_flags).await?),
        };
        let leased_now = lease.is_ok_and(|lease| lease.drop_cache);
        if access != AccessMode::ReadOnly {
            // Writes (or O_TRUNC) change it on the brick.
            self.forget_described(ino);
        }
        if open_flags.contains(OpenFlags::TRUNC) {
            // The kernel emptied its pages too: none left that could be stale.
            self.inodes.pages_dropped(ino);
        }
        let open = Open {
            executing: flags & EXEC_OPEN != 0,
            no_flush: self.no_flush(ino, access, flags),
            ..Open::new(fd, ino, access, open_flags, c)
        };
        let (mut opened, fd_now) = self.handles.add_opened(open, flags, Some(removals));
        // A recall since the open began may have been for another client's removal of the
        // file, and gave fds only to the handles in the table then.
        if fd_now || self.recalls_seen() != recalls {
            // A removal under way may take the file from the brick: its fd now, or the
            // open fails as one after the removal would.
            let open = self.handles.get(opened.fh)?;
            if let Err(e) = self.late_fd(&open).await {
                self.handles.take(opened.fh);
                return Err(e);
            }
        }
        if leased_now {
            // The pages the kernel kept may predate the lease: read again under it.
            opened.flags.remove(FopenFlags::FOPEN_KEEP_CACHE);
        }
        Ok(opened)
    }

    /// Asks a read lease on file `gfid`, opened for `access`, where the mount holds none and
    /// nothing else keeps the kernel's caches of it true ([`super::file_leases`]); ESTALE
    /// when the brick no longer has the file. The kernel's attributes of a file leased now
    /// are dropped here; its pages by the open.
    async fn lease_file(
        self: &Arc<Self>,
        c: &Creds,
        gfid: Gfid,
        access: AccessMode,
    ) -> Result<FileLease> {
        let covered = self.lease_covers(&gfid);
        if access != AccessMode::ReadOnly || covered || !self.may_ask_file_lease(&gfid) {
            return Ok(FileLease::kept(covered));
        }
        // The program that opens waits for its own changes: all answered before the ask.
        self.take_file_lease(c, gfid, self.inodes.change_mark())
            .await
    }

    /// After the release of a handle that wrote file `ino`: its read lease, asked now rather
    /// than at the next open for reading, so that reading back what the mount wrote waits
    /// for nothing — where the kernel may keep pages this mount wrote (the brick shows their
    /// version under the lease: [`Shared::ask_file_lease`]); else the pages go. `mark` is
    /// where the changes through the mount stood when the release came: the program goes on
    /// meanwhile, and the grant's attributes answer its stats only while the file has no
    /// change after it. A file whose lease the mount holds already (rewritten) gets its
    /// attributes as the brick has them now, noted as a grant's would be. Not with
    /// `release-leases` off.
    async fn lease_written(self: &Arc<Self>, c: &Creds, ino: u64, mark: ChangeMark) {
        let Some(gfid) = self.inodes.gfid(ino) else {
            return;
        };
        if !self.options.release_leases || !self.inodes.pages_written(ino) {
            return;
        }
        let held = self.files.grant_of(&gfid);
        if held.is_none() && !self.may_lease_file(&gfid) {
            return;
        }
        // Changes to it queued behind (a chmod made under a directory lease) go first.
        if self.settle(ino).await.is_err() {
            return;
        }
        if let Some(grant) = held {
            self.note_held_attrs(c, ino, gfid, grant, mark).await;
        } else if self
            .take_file_lease(c, gfid, mark)
            .await
            .is_ok_and(|l| l.drop_cache)
        {
            self.invalidate_files(&[gfid]).await;
        }
    }

    /// STAT of file `gfid` (node `ino`) held under `grant`, noted to answer its stats as of
    /// `mark` ([`Shared::note_leased_attrs`]).
    async fn note_held_attrs(&self, c: &Creds, ino: u64, gfid: Gfid, grant: u64, mark: ChangeMark) {
        let stat = self.layer.call(c, kiln_wire::Stat { gfid }.into()).await;
        if let Ok(FopReply::Stat(r)) = stat {
            self.note_leased_attrs(ino, gfid, grant, r.iatt, mark);
        }
    }

    /// Notes `iatt`, asked under `grant` as of `mark`, to answer the stats of file `gfid`
    /// (node `ino`) that follow — unless writes through another handle are still unsent.
    fn note_leased_attrs(&self, ino: u64, gfid: Gfid, grant: u64, iatt: Iatt, mark: ChangeMark) {
        if self.handles.with_unsent(Some(ino)).is_empty() {
            self.files.note_attrs(&gfid, grant, iatt, mark);
        }
    }

    /// Whether a read lease on file `gfid` is worth asking: file leases are on, the mount
    /// holds none, nothing else keeps the kernel's caches of it true, and the brick did not
    /// refuse one lately.
    fn may_lease_file(&self, gfid: &Gfid) -> bool {
        !self.lease_covers(gfid) && self.may_ask_file_lease(gfid)
    }

    /// Whether a lease covers file `gfid`: its own read lease, or what
    /// [`Shared::cached_truly`] says.
    fn lease_covers(&self, gfid: &Gfid) -> bool {
        self.files.holds(gfid) || self.cached_truly(gfid)
    }

    /// Whether a read lease on file `gfid` may be asked: file leases are on, and the brick
    /// did not refuse one lately (nor is its recall being answered).
    fn may_ask_file_lease(&self, gfid: &Gfid) -> bool {
        self.uses_file_leases() && self.files.may_ask(gfid)
    }

    /// Asks and takes a read lease on file `gfid` (ESTALE when the brick no longer has it).
    /// The kernel's attributes of it are dropped here. Every change made through the mount
    /// before `mark` has been answered: the attributes the grant gives are as of it.
    async fn take_file_lease(
        self: &Arc<Self>,
        c: &Creds,
        gfid: Gfid,
        mark: ChangeMark,
    ) -> Result<FileLease> {
        let asked = self.files.asked();
        let (granted, version) = self.ask_file_lease(c, gfid).await;
        let uncovered = |drop_cache| {
            Ok(FileLease {
                covered: false,
                drop_cache,
            })
        };
        let covered = |drop_cache| {
            Ok(FileLease {
                covered: true,
                drop_cache,
            })
        };
        match granted {
            Ok(FopReply::Lease(r)) if r.kind == LeaseKind::Read => {}
            // Refused (another client changed it lately): as without leases.
            Ok(_) => {
                self.files.refused(gfid);
                return uncovered(false);
            }
            Err(Error::Fop(ErrorCode::Stale | ErrorCode::NoEnt)) => return Err(Errno::ESTALE),
            Err(_) => return uncovered(false),
        }
        let grant = match self.files.take(gfid, asked) {
            Ok((grant, None)) => grant,
            // Room made: the least lately opened goes back, off this open's way.
            Ok((grant, Some(evicted))) => {
                let s = self.clone();
                tokio::spawn(async move { s.give_back_file(evicted).await });
                grant
            }
            // A recall came since it was asked: it goes back, and the file is changing.
            Err(()) => {
                self.give_back_file(gfid).await;
                return uncovered(true);
            }
        };
        self.invalidate_attrs(&[gfid]).await;
        let Some((ino, iatt)) = version else {
            return covered(true);
        };
        // They answer the stats that follow (a read reaching the end asks the size).
        self.note_leased_attrs(ino, gfid, grant, iatt.clone(), mark);
        // Pages this mount wrote stay where the brick, under the lease, shows their version.
        covered(self.inodes.pages_seen(ino, Stamp::of(&iatt)))
    }

    /// LEASE (read) of file `gfid`, as `c`. Where the kernel may hold pages this mount wrote
    /// ([`super::pages`]), a STAT goes after it in the same BATCH, which the brick runs in
    /// order: the file's node and its attributes under the lease come with the answer, in one
    /// round trip (a STAT sent beside the LEASE could be answered before the grant).
    async fn ask_file_lease(
        &self,
        c: &Creds,
        gfid: Gfid,
    ) -> (std::result::Result<FopReply, Error>, Option<(u64, Iatt)>) {
        let lease: FopRequest = Lease {
            gfid,
            kind: LeaseKind::Read,
        }
        .into();
        let written = self.inodes.ino_of(&gfid);
        let Some(ino) = written.filter(|&ino| self.inodes.pages_written(ino)) else {
            return (self.layer.call(c, lease).await, None);
        };
        let mut batch = Batch::new(c.clone());
        for fop in [lease, kiln_wire::Stat { gfid }.into()] {
            batch.push(fop).expect("two fops that name no fd batch");
        }
        let mut results = match self.layer.batch(batch).await {
            Ok(reply) => reply.results.into_iter(),
            Err(e) => return (Err(e), None),
        };
        let granted = match results.next() {
            Some(granted) => granted.map_err(Error::Fop),
            None => Err(Error::Protocol("a BATCH of two answered none".into())),
        };
        let version = match results.next() {
            Some(Ok(FopReply::Stat(r))) => Some((ino, r.iatt)),
            _ => None,
        };
        (granted, version)
    }

    /// Whether the mount answers for what the kernel caches of `gfid` by other means than a
    /// lease on it: it made it under a lease, or a kept listing under a lease that covers its
    /// attributes (`LISTED_ATTRS`) shows it.
    fn cached_truly(&self, gfid: &Gfid) -> bool {
        self.leases.local(gfid).is_some()
            || self
                .leases
                .listing_of(gfid)
                .is_some_and(|dir| self.listed(&dir, gfid).is_some() && self.layer.listed_attrs())
    }

    /// Opens `gfid` below for an OPEN with kernel `flags`, as `access` with `open_flags`.
    async fn open_below(
        &self,
        c: &Creds,
        gfid: Gfid,
        flags: i32,
        access: AccessMode,
        open_flags: OpenFlags,
    ) -> Result<L::Fd> {
        match self.layer.open(c, gfid, access, open_flags).await {
            // The writeback cache reads pages of write-only files; a caller allowed
            // only to write gets what it asked for.
            Err(Error::Fop(ErrorCode::Access)) if access != requested_access(flags) => {
                let access = requested_access(flags);
                self.layer.open(c, gfid, access, open_flags).await
            }
            other => other,
        }
        .map_err(errno)
    }

    /// OPENDIR of node `ino`, as `c`; the new handle. A held directory with a kept listing
    /// is opened late, the listing answered from what the mount kept, when the kernel checks
    /// permissions itself (as for [`Shared::opens_late`]).
    pub(super) async fn opendir_handle(&self, c: &Creds, ino: u64) -> Result<u64> {
        let gfid = self.gfid(ino)?;
        if self.prefetches() {
            self.prefetch.wait_for(&gfid).await;
        }
        let kept = match self.options.default_permissions {
            true => self.kept_listing(&gfid),
            false => None,
        };
        let (fd, listing) = match kept {
            Some(kept) => {
                let listing = Listing {
                    entries: kept.entries.clone(),
                    eof: true,
                    ..Listing::default()
                };
                (None, listing)
            }
            None => {
                let (fd, listing) = self.opendir_below(c, ino, gfid).await?;
                (Some(fd), listing)
            }
        };
        let open = Open {
            directory: true,
            listing: tokio::sync::Mutex::new(listing),
            ..Open::new(fd, ino, AccessMode::ReadOnly, OpenFlags::empty(), c)
        };
        Ok(self.handles.add(open))
    }

    /// Opens directory `gfid` (node `ino`) below, as `c`, with its first entries and — when
    /// the mount holds no lease there — a read lease taken before they are read (the listing
    /// can then tell the mount every entry): the fd, and the listing the handle starts with.
    async fn opendir_below(&self, c: &Creds, ino: u64, gfid: Gfid) -> Result<(L::Fd, Listing)> {
        // Where the hold stands before the changes queued are sent: those made after are
        // counted in by the hold, those before are on the brick when it lists.
        let held = self.leases.listing_mark(&gfid);
        // A listing shows the files created here that are still deferred, and the sizes of
        // those written here.
        self.settle_dir(Some(gfid)).await;
        self.send_undescribed_writes().await;
        let lease = match self.uses_leases() && !self.leases.has_lease(&gfid) {
            true => LeaseKind::Read,
            false => LeaseKind::None,
        };
        let (changes, recalls) = (self.leases.changes(), self.leases.recalls());
        let size = ReaddirSize::new(READDIR_FETCH_BYTES).ok_or(Errno::EINVAL)?;
        let listed = self.layer.opendir_list(c, gfid, size, lease).await;
        let (fd, granted, first) = listed.map_err(errno)?;
        let taken = granted != LeaseKind::None && self.leases.take_grant(&gfid, recalls);
        if taken {
            self.leases.hold_read(gfid);
        }
        // The hold the entries were read under: the one before, or the one granted with them
        // if no change to it was noted since they were asked — never one another
        // listing's grant made meanwhile, which may postdate these entries.
        let granted_with_them = || {
            taken
                .then(|| self.leases.listing_mark_unchanged(&gfid, changes))
                .flatten()
        };
        let mark = held.or_else(granted_with_them);
        Ok((fd, self.take_entries(ino, 0, mark, None, first)))
    }

    /// Lists directory `gfid` (node `ino`) below as `c`, as an OPENDIR would, for the listing
    /// it keeps ([`super::prefetch`]), and closes it again.
    pub(super) async fn list_below(&self, c: &Creds, ino: u64, gfid: Gfid) -> Result<()> {
        let (fd, _) = self.opendir_below(c, ino, gfid).await?;
        if let Err(e) = self.layer.release(c, fd).await {
            tracing::debug!(error = %e, "release failed; the fd goes with the session");
        }
        Ok(())
    }

    /// CREATE of `name` in node `parent` with kernel `mode`, `umask` and `flags`, as `c`:
    /// on the brick, or — a small write-only file in a directory whose permissions allow it
    /// — deferred to one PUT at close. The new entry and its handle.
    pub(super) async fn create_handle(
        &self,
        c: &Creds,
        parent: u64,
        name: &OsStr,
        (mode, umask, flags): (u32, u32, i32),
    ) -> Result<(FileAttr, Ttl, Opened)> {
        let (access, open_flags) = open_mode(flags, self.options.writeback_cache);
        let excl = if flags & libc::O_EXCL != 0 {
            OpenFlags::EXCL
        } else {
            OpenFlags::empty()
        };
        let create = kiln_wire::Create {
            parent: self.gfid(parent)?,
            name: name_of(name)?,
            gfid: new_gfid(),
            access,
            flags: open_flags | excl,
            mode: Mode::from_st_mode(mode),
            umask: Mode::from_st_mode(umask),
        };
        let (parent_gfid, name) = (create.parent, create.name.clone());
        // In a held directory the mount may know whether the name is taken. A create is
        // answered here only of a name known free there: another client's create of it
        // recalls the lease first, and the recall sends this file to the brick before the
        // lease goes back, so the brick never refuses the name later (an `O_EXCL` create
        // that two clients were both told succeeded, or a plain one told EEXIST at close).
        let answer = self.leases.lookup(&parent_gfid, &name);
        let taken = matches!(answer, Answer::Present(_));
        let known_free = answer == Answer::Absent;
        if taken && flags & libc::O_EXCL != 0 {
            return Err(Errno::EEXIST);
        }
        let synchronous = OpenFlags::SYNC.bits() | OpenFlags::DSYNC.bits();
        let deferrable = self.options.deferred_create
            && known_free
            && !self.behind.short_of_space()
            && requested_access(flags) == AccessMode::WriteOnly
            && flags & libc::O_DIRECT == 0
            && open_flags.bits() & synchronous == 0;
        let parent_attr = self
            .inodes
            .dir_attr(parent)
            .filter(|p| deferrable && p.allows_create(c));
        // A deferred create holds its data under a total; with none left, the file is made
        // on the brick now.
        let share = parent_attr.as_ref().and_then(|_| {
            let total = &self.handles.deferred_bytes;
            Budgeted::reserve(total, DEFERRED_BYTES_MAX, DEFERRED_TOTAL_BYTES_MAX)
        });
        let (iatt, fd) = match parent_attr {
            Some(parent_attr) if share.is_some() => {
                let pending = Pending::new(create, parent_attr, c.clone());
                let iatt = pending.iatt();
                (iatt, Err(pending))
            }
            _ => {
                self.behind.settle(&parent_gfid).await;
                let (fd, created) = self.layer.create(c, create).await.map_err(errno)?;
                (created.iatt, Ok(fd))
            }
        };
        self.leases.add_entry(&parent_gfid, &name, iatt.gfid);
        self.touch_dir(&parent_gfid, 0);
        let (attr, mut ttl) = self.entry(&iatt);
        self.inodes.mark_bare(attr.ino.0, Instant::now() + ttl.attr);
        let fd = match fd {
            Ok(fd) => Some(fd),
            Err(pending) => {
                self.pending.insert(attr.ino.0, pending);
                // The kernel asks again (and a stat sends the file) rather than keep
                // times the brick will not have.
                ttl.attr = Duration::ZERO;
                None
            }
        };
        // A late open must not truncate what the PUT wrote.
        let reopen = OpenFlags::from_bits(open_flags.bits() & !OpenFlags::TRUNC.bits())
            .unwrap_or(OpenFlags::empty());
        // A deferred create's handle is opened late as root: the create granted it
        // its access, whatever mode the file was given. In a held directory its close would
        // only queue the PUT behind: the release does that, and the closer is spared a FUSE
        // request it would wait for. Elsewhere, and with the writeback cache (the kernel
        // writes the file's pages back at its FLUSH), the close sends the PUT.
        let no_flush =
            share.is_some() && !self.options.writeback_cache && self.leases.holds(&parent_gfid);
        let open = Open {
            no_flush,
            deferred_share: share,
            ..Open::new(fd, attr.ino.0, access, reopen, &Creds::root())
        };
        // A deferred create's handle gets no fd before its file is on the brick.
        Ok((attr, ttl, self.handles.add_opened(open, flags, None).0))
    }

    /// How many recalls (of directory and file leases) the mount has seen.
    fn recalls_seen(&self) -> u64 {
        self.leases.recalls() + self.files.asked()
    }

    /// Whether an open may be answered at once and made on the brick at the handle's first
    /// use (GlusterFS's open-behind): a plain read-only open, when the kernel has checked the
    /// caller's permission itself (`default_permissions`) — and a lease covers the file
    /// ([`Shared::open_handle`]). A read served from the kernel's page cache then costs the
    /// brick nothing; a removal gives such handles their fds first, through this mount
    /// ([`Removal`]) or another (the recall of the lease).
    fn opens_late(&self, access: AccessMode, flags: OpenFlags) -> bool {
        self.options.default_permissions && access == AccessMode::ReadOnly && flags.bits() == 0
    }

    /// READ through handle `fh`: from a deferred create's gathered data, or below.
    pub(super) async fn read(
        &self,
        c: &Creds,
        fh: FileHandle,
        offset: u64,
        size: u32,
    ) -> Result<Bytes> {
        let open = self.handles.get(fh)?;
        let size = size.min(IO_SIZE_MAX_BYTES as u32);
        if let Some(data) = open.read_ahead(offset, size, self.leases.changes()) {
            return Ok(data);
        }
        if let Some(data) = self.made_content(open.ino) {
            let start = usize::try_from(offset).map_or(data.len(), |o| o.min(data.len()));
            let end = data.len().min(start + size as usize);
            return Ok(data.slice(start..end));
        }
        if let Some(slot) = self.pending.get(open.ino)
            && let Some(pending) = slot.lock().await.as_ref()
        {
            return Ok(pending.read(offset, size));
        }
        if offset == 0 && open.access == AccessMode::ReadOnly && open.fd.get().is_none() {
            return self.read_without_fd(&open, size).await;
        }
        self.send_writes_behind(Some(open.ino)).await;
        let fd = self.fd(&open).await?;
        self.layer.read(c, fd, offset, size).await.map_err(errno)
    }

    /// The first read of a read-only handle opened late, from the start, as one GET of at
    /// least [`GET_AHEAD_BYTES`] (GlusterFS's quick-read): a small file read once costs one
    /// round trip and is never opened on the brick; what the kernel did not ask yet is kept
    /// for the handle's next reads; a larger file gets its fd at its first read past that.
    async fn read_without_fd(&self, open: &Open<L::Fd>, size: u32) -> Result<Bytes> {
        self.settle(open.ino).await?;
        let asked = size.max(GET_AHEAD_BYTES).min(IO_SIZE_MAX_BYTES as u32);
        let gfid = self.inodes.gfid(open.ino).ok_or(Errno::ESTALE)?;
        let changes = self.leases.changes();
        // The whole file when it was fetched ahead: less than anything asked here.
        let data = match self.file_ahead(&gfid).await {
            Some(data) => data,
            None => self.get(&open.late_creds, gfid, asked).await?,
        };
        let wanted = data.len().min(size as usize);
        if data.len() > wanted
            && let Some(budget) =
                Budgeted::reserve(&self.handles.ahead_bytes, data.len(), AHEAD_BYTES_MAX)
        {
            let eof = data.len() < asked as usize;
            let ahead = Ahead {
                data: data.clone(),
                eof,
                changes,
                _budget: budget,
            };
            *open.ahead.lock().unwrap_or_else(|p| p.into_inner()) = Some(ahead);
        }
        Ok(data.slice(..wanted))
    }

    /// GET of the first `asked` bytes of `gfid` as `c`.
    pub(super) async fn get(&self, c: &Creds, gfid: Gfid, asked: u32) -> Result<Bytes> {
        let get = kiln_wire::Get {
            gfid,
            offset: 0,
            size: ReadSize::new(asked).ok_or(Errno::EINVAL)?,
        };
        match self.layer.call(c, get.into()).await {
            Ok(FopReply::Get(r)) => Ok(r.data.into_bytes()),
            Ok(other) => Err(unexpected(&other)),
            Err(e) => Err(errno(e)),
        }
    }

    /// WRITE through handle `fh`: gathered by a deferred create while it stays small, else
    /// below. `kill_suidgid`: the writer lacks `CAP_FSETID` (the kernel's
    /// `FUSE_WRITE_KILL_SUIDGID`). The bytes written.
    pub(super) async fn write(
        &self,
        c: &Creds,
        fh: FileHandle,
        offset: u64,
        data: Bytes,
        kill_suidgid: bool,
    ) -> Result<u32> {
        let open = self.handles.get(fh)?;
        let len = u32::try_from(data.len()).map_err(|_| Errno::EINVAL)?;
        // Through its page cache the kernel drops the set-ID bits itself.
        let kill_suidgid = kill_suidgid && open.writes_direct();
        let mut deferred = false;
        if let Some(slot) = self.pending.get(open.ino) {
            match slot.lock().await.as_mut() {
                Some(pending) => {
                    deferred = true;
                    if kill_suidgid {
                        pending.kill_suidgid();
                    }
                    if pending.write(offset, &data) {
                        return Ok(len);
                    }
                }
                // Sent while this write waited (by an fsync): the content the mount kept of
                // it is not the file's any more.
                None => self.forget_made(open.ino),
            }
        }
        if kill_suidgid && !deferred {
            self.kill_suidgid(c, open.ino, fh).await?;
        }
        let fd = self.fd(&open).await?;
        if self.write_behind(c, fh, &open, offset, &data).await? {
            return Ok(len);
        }
        let written = self.layer.write(c, fd, offset, data).await;
        self.forget_described(open.ino);
        self.note_written(open.ino, &written);
        written.map_err(errno)?;
        Ok(len)
    }

    /// Drops the set-user-ID bit of node `ino`, and its set-group-ID bit where group
    /// execute is set, before a write through handle `fh` by `c`, who lacks `CAP_FSETID`:
    /// what the kernel does for a write to a local file.
    async fn kill_suidgid(&self, c: &Creds, ino: u64, fh: FileHandle) -> Result<()> {
        let mode = self.stat(c, ino, Some(fh)).await?.mode;
        let kept = killed_suidgid(mode);
        if kept != mode {
            let attr = SetAttr {
                mode: Some(kept),
                ..SetAttr::default()
            };
            self.setattr(&Creds::root(), ino, Some(fh), attr).await?;
        }
        Ok(())
    }

    /// Gathers `data`, written at `offset` through handle `fh` (`open`) by `c`, to go later
    /// with the writes that continue it, when the mount describes the file itself or writes
    /// behind ([`super::MountOptions::write_behind`]); whether it did. What the handle
    /// gathered before and `data` does not continue is sent first, and its refusal is this
    /// write's error.
    async fn write_behind(
        &self,
        c: &Creds,
        fh: FileHandle,
        open: &Arc<Open<L::Fd>>,
        offset: u64,
        data: &Bytes,
    ) -> Result<bool> {
        let gfid = self.gfid(open.ino)?;
        // Writes gathered by the file's other handles came first.
        for (other, other_open) in self.handles.with_unsent(Some(open.ino)) {
            if other != fh.0 {
                self.send_handle_writes(other, &other_open).await;
            }
        }
        let mut unsent = open.unsent.lock().await;
        let gathered = match unsent.as_mut() {
            Some(held) => held.append(c, offset, data),
            None => false,
        };
        if !gathered {
            if let Some(earlier) = unsent.take() {
                let sent = self.send_unsent(open, earlier).await;
                self.handles.note_sent(fh.0);
                sent?;
            }
            // O_SYNC, O_DSYNC and O_DIRECT writes are on the brick when they return.
            let synchronous = [OpenFlags::SYNC, OpenFlags::DSYNC, OpenFlags::DIRECT];
            let may_gather = !synchronous.iter().any(|&f| open.flags.contains(f))
                && data.len() < UNSENT_BYTES_MAX
                && (self.options.write_behind || self.leases.local(&gfid).is_some())
                && !self.behind.short_of_space();
            let budget = may_gather
                .then(|| {
                    let total = &self.handles.unsent_bytes;
                    Budgeted::reserve(total, UNSENT_BYTES_MAX, UNSENT_TOTAL_BYTES_MAX)
                })
                .flatten();
            let Some(budget) = budget else {
                return Ok(false);
            };
            *unsent = Some(Unsent {
                creds: c.clone(),
                offset,
                data: bytes::BytesMut::from(&data[..]),
                since: Instant::now(),
                _budget: budget,
            });
            self.handles.note_unsent(fh.0, open);
        }
        let end = offset + data.len() as u64;
        self.leases.update_local(&gfid, |iatt| {
            iatt.size = iatt.size.max(end);
            iatt.mtime = super::leases::now();
            iatt.ctime = iatt.mtime;
        });
        Ok(true)
    }

    /// Sends writes gathered by handle `open` as one WRITE (it has its fd: writes are
    /// gathered only once it has).
    async fn send_unsent(&self, open: &Open<L::Fd>, unsent: Unsent) -> Result<()> {
        let fd = open.fd.get().ok_or(Errno::EBADF)?;
        let Unsent {
            creds,
            offset,
            data,
            ..
        } = unsent;
        let written = self.layer.write(&creds, fd, offset, data.freeze()).await;
        self.note_written(open.ino, &written);
        written.map(drop).map_err(errno)
    }

    /// Sends the writes gathered by the handles on node `ino` (all nodes: `None`); a WRITE the
    /// brick refuses is kept for the file's next `close` or `fsync` to report.
    pub(super) async fn send_writes_behind(&self, ino: Option<u64>) {
        for (fh, open) in self.handles.with_unsent(ino) {
            self.send_handle_writes(fh, &open).await;
        }
    }

    /// Sends the writes gathered for the files the mount does not describe itself, before a
    /// fop whose reply may carry their attributes (a LOOKUP, a listing, a LINK): the brick
    /// must not tell the kernel a size or time older than what it wrote. The files the
    /// mount describes are answered from that description instead.
    pub(super) async fn send_undescribed_writes(&self) {
        for (fh, open) in self.handles.with_unsent(None) {
            let described = self
                .inodes
                .gfid(open.ino)
                .and_then(|g| self.leases.local(&g));
            if described.is_none() {
                self.send_handle_writes(fh, &open).await;
            }
        }
    }

    /// Sends, every half [`BEHIND_AGE_MAX`] until the mount ends, the writes gathered behind
    /// and the creates deferred at least that long ago: a file a program keeps open (a log)
    /// reaches the brick, and other clients, that long after its writes at most — not at
    /// its close or a MiB later — and a killed mount loses no more than that of it.
    pub(super) async fn send_old_writes(self: Arc<Self>) {
        let mut every = tokio::time::interval(BEHIND_AGE_MAX / 2);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            for (fh, open) in self.handles.with_unsent(None) {
                let old = open.unsent.try_lock().is_ok_and(|unsent| {
                    unsent
                        .as_ref()
                        .is_some_and(|u| u.since.elapsed() >= BEHIND_AGE_MAX)
                });
                if old {
                    self.send_handle_writes(fh, &open).await;
                }
            }
            for ino in self.pending.older_than(BEHIND_AGE_MAX) {
                // A refusal is kept for the file's close.
                let _ = self.settle(ino).await;
            }
        }
    }

    /// Sends the writes gathered by handle `fh` (`open`), keeping a refusal for the file's
    /// next `close` or `fsync`.
    async fn send_handle_writes(&self, fh: u64, open: &Open<L::Fd>) {
        let mut unsent = open.unsent.lock().await;
        let Some(held) = unsent.take() else {
            return;
        };
        let sent = self.send_unsent(open, held).await;
        // Only now: a fop on the file that looks meanwhile waits for the lock above.
        self.handles.note_sent(fh);
        if let Err(e) = sent
            && let Some(gfid) = self.inodes.gfid(open.ino)
        {
            tracing::warn!(error = ?e, "data written behind was refused by the brick");
            self.behind.note_failure(gfid, e.code());
        }
    }

    /// Forgets the mount's description of node `ino`: the brick changed it.
    pub(super) fn forget_described(&self, ino: u64) {
        if let Some(gfid) = self.inodes.gfid(ino) {
            self.made.forget(&gfid);
            self.leases.forget_local(&gfid);
        }
    }

    /// Forgets the content the mount kept of node `ino` ([`super::made`]).
    fn forget_made(&self, ino: u64) {
        if let Some(gfid) = self.inodes.gfid(ino) {
            self.made.forget(&gfid);
        }
    }

    /// The content of node `ino` as the mount made it, while the mount still describes the
    /// file ([`super::made`]).
    fn made_content(&self, ino: u64) -> Option<Bytes> {
        let gfid = self.inodes.gfid(ino)?;
        let data = self.made.get(&gfid)?;
        let described = self.leases.local(&gfid)?;
        (described.iatt.size == data.len() as u64).then_some(data)
    }

    /// Runs the fd fop `fop` through handle `open`.
    pub(super) async fn call_handle(
        &self,
        c: &Creds,
        open: &Open<L::Fd>,
        fop: FdFop,
    ) -> Result<FopReply> {
        self.send_writes_behind(Some(open.ino)).await;
        let fd = self.fd(open).await?;
        self.layer.call_fd(c, fd, fop).await.map_err(errno)
    }

    /// FLUSH (a close) of handle `fh` on node `ino` by `c`: the first close sends a deferred
    /// create, and a refusal is this close's error; a file with POSIX locks taken through the
    /// mount (`locked`) has the brick drop those of `lock_owner`.
    pub(super) async fn flush(
        &self,
        c: &Creds,
        ino: u64,
        fh: FileHandle,
        lock_owner: LockOwner,
        locked: bool,
    ) -> Result<()> {
        self.send_writes_behind(Some(ino)).await;
        if let Some(content) = self.close_behind(ino).await {
            self.store_content(ino, content).await;
        } else if let Some(content) = self.settle(ino).await? {
            self.store_content(ino, content).await;
        }
        if let Some(errno) = self.pending.take_failure(ino) {
            return Err(Errno::from_i32(errno));
        }
        if let Some(errno) = self
            .gfid(ino)
            .ok()
            .and_then(|g| self.behind.take_failure(&g))
        {
            return Err(Errno::from_i32(errno));
        }
        if !locked {
            return Ok(());
        }
        let open = self.handles.get(fh)?;
        let lock_owner = lock_owner.0;
        let fop = FdFop::new(|fd| kiln_wire::Flush { fd, lock_owner }.into());
        self.call_handle(c, &open, fop).await.map(drop)
    }

    /// GETLK: the lock that would conflict with `lock` on handle `open`'s file, or one of
    /// kind `Unlock`.
    pub(super) async fn getlk(&self, c: &Creds, open: &Open<L::Fd>, lock: Lock) -> Result<Lock> {
        let fd = self.fd(open).await?;
        self.layer
            .lk(c, fd, LockCmd::Get, lock)
            .await
            .map_err(errno)
    }

    /// lseek(2) with SEEK_DATA or SEEK_HOLE (`whence`) on handle `open`: the offset found.
    pub(super) async fn seek(
        &self,
        c: &Creds,
        open: &Open<L::Fd>,
        offset: i64,
        whence: i32,
    ) -> Result<i64> {
        let what = seek_what(whence)?;
        let offset = u64::try_from(offset).map_err(|_| Errno::ENXIO)?;
        let fop = FdFop::new(|fd| kiln_wire::Seek { fd, offset, what }.into());
        match self.call_handle(c, open, fop).await? {
            FopReply::Seek(r) => i64::try_from(r.offset).map_err(|_| Errno::ENXIO),
            other => Err(unexpected(&other)),
        }
    }

    /// The fd behind `open`, made on first use for a deferred create (which sends the
    /// create first).
    pub(super) async fn fd<'a>(&self, open: &'a Open<L::Fd>) -> Result<&'a L::Fd> {
        if let Some(fd) = open.fd.get() {
            return Ok(fd);
        }
        match open.directory {
            // A listing shows the files created here that are still deferred.
            true => self.settle_dir(Some(self.gfid(open.ino)?)).await,
            false => drop(self.settle(open.ino).await?),
        }
        self.late_fd(open).await
    }

    /// Opens the fd of a handle opened late: a deferred create's, once the file is there
    /// (as root: the create already granted the handle its access, whatever the mode given
    /// to the file says), or a read-only open's or a directory's at its first use (as its
    /// opener).
    async fn late_fd<'a>(&self, open: &'a Open<L::Fd>) -> Result<&'a L::Fd> {
        open.fd
            .get_or_try_init(|| async {
                let gfid = self.inodes.gfid(open.ino).ok_or(Errno::ESTALE)?;
                let creds = &open.late_creds;
                match open.directory {
                    true => self.layer.opendir(creds, gfid).await,
                    false => self.layer.open(creds, gfid, open.access, open.flags).await,
                }
                .map_err(errno)
            })
            .await
    }

    /// Sends node `ino`'s deferred create to the brick, if it has one still waiting. The
    /// handles open on it get their fds on first use, or from [`Shared::anchor_handles`]
    /// before a fop that could remove the file: most are about to be released (a create's
    /// PUT is sent at its close), and opening them now would cost two round trips per file.
    /// The content it sent, if it sent one.
    pub(super) async fn settle(&self, ino: u64) -> Result<Option<Bytes>> {
        self.settle_with(ino, false).await
    }

    /// [`Shared::settle`] for an fsync: a deferred create goes as PUT_SYNCED, the file fsynced
    /// on the brick as it is made. `true` when it went so: everything written to the file is
    /// durable, and the fsync needs nothing more.
    pub(super) async fn settle_synced(&self, ino: u64) -> Result<bool> {
        Ok(self.settle_with(ino, true).await?.is_some())
    }

    async fn settle_with(&self, ino: u64, synced: bool) -> Result<Option<Bytes>> {
        self.send_writes_behind(Some(ino)).await;
        let mut content_sent = None;
        if let Some(slot) = self.pending.get(ino) {
            // Its directory may itself be queued.
            let parent = slot.lock().await.as_ref().map(|p| p.parent);
            if let Some(parent) = parent {
                self.behind.settle(&parent).await;
            }
            let mark = self.inodes.change_mark();
            let sent = self.pending.settle(&self.layer, ino, synced).await;
            let sent = sent.map_err(|e| {
                if let Some(parent) = parent {
                    self.behind.note_refused_in(parent);
                }
                self.refused(errno(e))
            })?;
            if let Some((iatt, content)) = sent {
                self.note_data_changed(None, &iatt);
                // Made under the directory's write lease: the mount describes it while it
                // holds the lease (its writes can then go behind) and answers its reads from
                // the content it sent, as it does for the files it sends at close — a file
                // synced before its close (a mail delivered) is read back without the brick
                // too — unless a change to it was answered meanwhile (a write that waited for
                // the PUT drops the content itself when it runs).
                if parent.is_some_and(|p| self.leases.holds(&p)) {
                    if self.inodes.unchanged_since(ino, mark) {
                        self.made.keep(iatt.gfid, content.clone());
                    }
                    self.leases.describe(iatt);
                }
                content_sent = Some(content);
            }
        }
        if let Some(gfid) = self.inodes.gfid(ino) {
            self.behind.settle(&gfid).await;
        }
        Ok(content_sent)
    }

    /// The first close of a deferred create in a held directory, of a name it knew free: its
    /// PUT is queued behind instead of sent, and the close returns at once; the file's
    /// content. `None` when it must be sent now.
    async fn close_behind(&self, ino: u64) -> Option<Bytes> {
        let slot = self.pending.get(ino)?;
        let parent = slot.lock().await.as_ref().map(|p| p.parent);
        if !parent.is_some_and(|p| self.leases.holds(&p)) {
            return None;
        }
        let pending = self.pending.take(ino).await?;
        let (creds, iatt) = (pending.creds().clone(), pending.iatt());
        let put = pending.into_put().ok()?;
        let touches = [iatt.gfid, put.parent];
        let content = put.data.clone().into_bytes();
        self.made.keep(iatt.gfid, content.clone());
        self.leases.describe(iatt);
        self.behind.push(&creds, put.into(), &touches).await;
        Some(content)
    }

    /// At the release of handle `open` (already forgotten by the table), one of a deferred
    /// create in a held directory closed without a FLUSH: puts the file's content into the
    /// kernel's page cache, as the FLUSH would have ([`Shared::store_content`]). Here, on
    /// the FUSE thread, before it reads the kernel's next request: with no handle left on the
    /// file, nothing can hold a lock on its pages while waiting for this thread, and no open
    /// or truncate that follows can be overtaken by the store.
    pub(super) fn store_released(&self, open: &Open<L::Fd>) {
        if !open.no_flush || self.handles.open_on(open.ino) != 0 {
            return;
        }
        let Some(slot) = self.pending.get(open.ino) else {
            return;
        };
        // Held by a task sending the file: it is no longer the close's to store.
        let Ok(pending) = slot.try_lock() else {
            return;
        };
        if let (Some(pending), Some(kernel)) = (pending.as_ref(), self.kernel.get())
            && self.leases.holds(&pending.parent)
        {
            store_pages(kernel, open.ino, pending.data());
        }
    }

    /// Sends the deferred creates in directory `parent` (every one when `None`) before a fop
    /// that must see them on the brick. A refusal is kept for the file's close to report.
    pub(super) async fn settle_dir(&self, parent: Option<Gfid>) {
        match &parent {
            Some(gfid) => self.behind.settle(gfid).await,
            None => self.behind.drain().await,
        }
        if self.pending.is_empty() {
            return;
        }
        for ino in self.pending.in_dir(parent).await {
            let _ = self.settle(ino).await;
        }
    }

    /// Gives every open handle still without an fd (one of a settled deferred create) its
    /// fd, before a fop that may remove a name: an open file must outlive an unlink, and
    /// a handle opened later by GFID would find the file gone.
    pub(super) async fn anchor_handles(&self) {
        // Creates made since the caller settled them stay deferred: their files are not on
        // the brick to be removed.
        let waiting = match self.pending.is_empty() {
            true => Vec::new(),
            false => self.pending.in_dir(None).await,
        };
        for open in self.handles.without_fd(&waiting) {
            if let Err(e) = self.late_fd(&open).await {
                tracing::warn!(?e, "cannot open a settled create");
            }
        }
    }

    /// Gives the handles on `gfids` still without an fd their fds, before a lease that
    /// covers those files goes back: another client is about to change or remove them, and
    /// an open file must outlive its removal there as here.
    pub(super) async fn anchor_handles_on(&self, gfids: &[Gfid]) {
        let inos: Vec<u64> = gfids.iter().filter_map(|g| self.inodes.ino_of(g)).collect();
        for open in self.handles.without_fd(&[]) {
            if !open.directory
                && inos.contains(&open.ino)
                && let Err(e) = self.late_fd(&open).await
            {
                tracing::debug!(?e, "a handle lost its file before a recall");
            }
        }
    }

    /// Ends handle `open` (already forgotten by the table) once its tasks are done: sends
    /// a deferred create the close has not, and releases the fd below; then, where it wrote,
    /// takes the file's read lease (`mark`: where the changes through the mount stood when
    /// the release came).
    pub(super) async fn release_handle(
        self: &Arc<Self>,
        c: &Creds,
        fh: FileHandle,
        open: Arc<Open<L::Fd>>,
        mark: ChangeMark,
    ) {
        let ino = open.ino;
        let wrote = open.access != AccessMode::ReadOnly && !open.directory;
        self.send_handle_writes(fh.0, &open).await;
        if open.no_flush {
            self.close_unflushed(c, &open).await;
            self.close_behind(open.ino).await;
        }
        // Normally the close (FLUSH) has sent a deferred create already, or queued its PUT
        // behind, which nothing here waits for: a release waiting for its file's PUT would
        // be woken at every batch answered before it, as would every other such release.
        let sent = match self.pending.get(open.ino) {
            Some(_) => self.settle(open.ino).await,
            None => Ok(None),
        };
        if sent.is_ok() {
            self.pending.take_failure(open.ino);
        }
        if let Some(open) = sole(open).await
            && let Some(fd) = open.fd.into_inner()
            && let Err(e) = self.layer.release(c, fd).await
        {
            tracing::debug!(error = %e, "release failed; the fd goes with the session");
        }
        if wrote {
            self.lease_written(c, ino, mark).await;
        }
    }

    /// What the close of handle `open` would have done had the kernel sent a FLUSH
    /// ([`Open::no_flush`]): the brick drops the locks taken through the handle. Such a lock
    /// therefore lasts until the release of the handle it was taken through (which follows
    /// its last close at once, asynchronously), not until the close of any of the owner's
    /// fds on the file as POSIX has it; the file's later handles close with a FLUSH.
    async fn close_unflushed(&self, c: &Creds, open: &Open<L::Fd>) {
        let owners =
            std::mem::take(&mut *open.lock_owners.lock().unwrap_or_else(|p| p.into_inner()));
        for lock_owner in owners {
            let fop = FdFop::new(move |fd| kiln_wire::Flush { fd, lock_owner }.into());
            if let Err(e) = self.call_handle(c, open, fop).await {
                // The brick drops them with the mount's last fd on the file.
                tracing::debug!(error = ?e, "dropping a closed handle's locks failed");
            }
        }
    }

    /// The listing directory handle on node `ino` goes on with after `reply`, fetched at
    /// `offset`: `mark` is where the hold was when a fetch from the start began, `so_far`
    /// what a listing from the start had fetched before ([`Shared::learn_entries`]).
    fn take_entries(
        &self,
        ino: u64,
        offset: u64,
        mark: Option<Mark>,
        so_far: Option<Whole>,
        reply: kiln_wire::ReaddirpXattrsReply,
    ) -> Listing {
        let entries: Arc<[DirEntryXattrs]> = reply.entries.into();
        let whole = self.learn_entries(ino, offset, mark, so_far, &entries, reply.eof);
        Listing {
            from: offset,
            entries,
            next: 0,
            eof: reply.eof,
            whole,
        }
    }

    /// Follows a listing of directory `ino` from its start while it holds a lease there,
    /// with `entries` fetched at `offset` (`eof`: the last of them). A whole listing is kept
    /// to answer the next one ([`super::leases`]), and its names are the directory's entries
    /// for the lease. What the listing has fetched so far, until its end.
    fn learn_entries(
        &self,
        ino: u64,
        offset: u64,
        mark: Option<Mark>,
        so_far: Option<Whole>,
        entries: &Arc<[DirEntryXattrs]>,
        eof: bool,
    ) -> Option<Whole> {
        let dir = self.inodes.gfid(ino)?;
        let mut whole = match (offset, so_far) {
            (0, _) => Whole {
                kept: mark.map(|mark| (mark, Vec::new())),
                // Only while the entries are not known yet.
                names: mark
                    .and_then(|mark| Some((self.leases.listing_began(&dir, &mark)?, Vec::new()))),
            },
            (_, so_far) => so_far?,
        };
        let in_one_reply = offset == 0 && eof;
        if let Some((_, fetched)) = &mut whole.kept
            && !in_one_reply
        {
            match fetched.len() + entries.len() <= LISTED_ENTRIES_KEPT_MAX {
                true => fetched.extend(entries.iter().cloned()),
                false => whole.kept = None,
            }
        }
        if let Some((_, seen)) = &mut whole.names {
            let named = entries
                .iter()
                .filter(|e| !matches!(e.name.as_bytes(), b"." | b".."))
                .map(|e| (e.name.clone(), e.iatt.gfid));
            seen.extend(named);
        }
        if !eof {
            return (whole.kept.is_some() || whole.names.is_some()).then_some(whole);
        }
        if let Some((mark, fetched)) = whole.kept {
            let all = match in_one_reply {
                true => entries.clone(),
                false => fetched.into(),
            };
            self.leases.keep_listing(&dir, mark, all);
        }
        if let Some((began, seen)) = whole.names {
            self.leases.listed(&dir, began, seen);
        }
        None
    }

    /// One READDIRP_XATTRS through directory handle `open` from `offset`; from the start of
    /// a held directory, also where its hold was when it began.
    async fn fetch_entries(
        &self,
        c: &Creds,
        open: &Open<L::Fd>,
        offset: u64,
    ) -> Result<(kiln_wire::ReaddirpXattrsReply, Option<Mark>)> {
        let dir = self.gfid(open.ino)?;
        let mark = (offset == 0)
            .then(|| self.leases.listing_mark(&dir))
            .flatten();
        if mark.is_some() {
            // What the listing keeps must hold the deferred creates made before it.
            self.settle_dir(Some(dir)).await;
        }
        self.send_undescribed_writes().await;
        let size = ReaddirSize::new(READDIR_FETCH_BYTES).ok_or(Errno::EINVAL)?;
        let fop = FdFop::new(|fd| kiln_wire::ReaddirpXattrs { fd, offset, size }.into());
        let reply = self.layer.call_fd(c, self.fd(open).await?, fop).await;
        let FopReply::ReaddirpXattrs(r) = reply.map_err(errno)? else {
            return Err(Errno::EIO);
        };
        Ok((r, mark))
    }

    /// Gives the kernel the entries of directory handle `fh` from `offset` until `add`
    /// says its buffer is full or the directory ends.
    pub(super) async fn list(
        &self,
        c: &Creds,
        fh: FileHandle,
        offset: u64,
        mut add: impl FnMut(&DirEntryXattrs) -> bool,
    ) -> Result<()> {
        let open = self.handles.get(fh)?;
        let mut listing = open.listing.lock().await;
        let mut offset = offset;
        loop {
            let drained = listing.pending().is_none();
            if listing.from != offset || (drained && !listing.eof) {
                let (r, mark) = self.fetch_entries(c, &open, offset).await?;
                // Only a fetch right after the last one continues a listing.
                let continues = drained && listing.from == offset && !listing.eof;
                let so_far = listing.whole.take().filter(|_| continues);
                *listing = self.take_entries(open.ino, offset, mark, so_far, r);
            }
            // None here means the directory ended.
            let Some(entry) = listing.pending() else {
                return Ok(());
            };
            if add(entry) {
                return Ok(());
            }
            offset = entry.offset;
            listing.next += 1;
            listing.from = offset;
        }
    }
}

/// Times a released handle's last holders get to let it go, a millisecond apart: tasks that
/// looked at its writes not yet sent ([`Handles::with_unsent`]) drop it once those are sent.
const RELEASE_WAITS: u32 = 1000;

/// `open` once no other task holds it, or `None` if one still does after [`RELEASE_WAITS`]
/// (its fd then goes with the session).
async fn sole<F>(mut open: Arc<Open<F>>) -> Option<Open<F>> {
    for _ in 0..RELEASE_WAITS {
        match Arc::try_unwrap(open) {
            Ok(open) => return Some(open),
            Err(shared) => open = shared,
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tracing::warn!("a released handle is still in use; its fd goes with the session");
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_ahead(data: &'static [u8], eof: bool, changes: u64) -> Open<()> {
        let total = Arc::new(AtomicUsize::new(0));
        let open = Open::new(
            None,
            1,
            AccessMode::ReadOnly,
            OpenFlags::empty(),
            &Creds::root(),
        );
        let ahead = Ahead {
            data: Bytes::from_static(data),
            eof,
            changes,
            _budget: Budgeted::reserve(&total, data.len(), AHEAD_BYTES_MAX).expect("room"),
        };
        *open.ahead.lock().expect("lock") = Some(ahead);
        open
    }

    #[test]
    fn read_ahead_answers_only_what_it_holds_while_nothing_changed() {
        let whole = with_ahead(b"0123456789", true, 7);
        assert_eq!(whole.read_ahead(2, 3, 7).as_deref(), Some(&b"234"[..]));
        assert_eq!(whole.read_ahead(8, 100, 7).as_deref(), Some(&b"89"[..]));
        assert_eq!(
            whole.read_ahead(10, 4, 7).as_deref(),
            Some(&b""[..]),
            "end of file"
        );
        assert_eq!(
            whole.read_ahead(50, 4, 7).as_deref(),
            Some(&b""[..]),
            "past it"
        );
        assert_eq!(whole.read_ahead(0, 3, 8), None, "a change since");
        let part = with_ahead(b"0123456789", false, 7);
        assert_eq!(
            part.read_ahead(0, 10, 7).as_deref(),
            Some(&b"0123456789"[..])
        );
        assert_eq!(part.read_ahead(8, 4, 7), None, "the file goes on");
    }

    #[test]
    fn read_ahead_is_bounded_mount_wide() {
        let total = Arc::new(AtomicUsize::new(0));
        let held = Budgeted::reserve(&total, AHEAD_BYTES_MAX - 10, AHEAD_BYTES_MAX).expect("room");
        assert!(Budgeted::reserve(&total, 11, AHEAD_BYTES_MAX).is_none());
        let more = Budgeted::reserve(&total, 10, AHEAD_BYTES_MAX).expect("just fits");
        drop((held, more));
        assert_eq!(total.load(Ordering::Relaxed), 0);
    }
}
