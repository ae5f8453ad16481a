//! Write-behind of namespace changes: what the mount answered itself under a directory's write
//! lease ([`super::leases`]), sent to the brick later in the order the application made it.
//!
//! One queue for the whole mount, sent as BATCH requests one at a time: the brick runs a
//! batch's fops in order, and a batch goes only when the one before has been answered, so
//! what the brick holds is always a prefix of what the application did. A fop that must see
//! queued changes on the brick (a listing, a sync create in the same directory, an fsync)
//! waits until the last queued change to the objects it names has been answered
//! ([`Behind::settle`]).
//!
//! Errors come late: a queued change the brick refuses is logged and kept for the next
//! `fsync` or `close` of the object (and `fsync` of its directory) to report, as NFS and
//! CephFS report write-back errors. The bytes queued are bounded: an application that gets
//! ahead of the brick waits at the bound.
//!
//! A refusal for want of space (ENOSPC, EDQUOT), of a change made behind or of one the
//! application waited for, stops the mount answering changes ahead for
//! [`SPACE_REFUSAL_HOLD`] ([`Behind::short_of_space`]): they go to the brick while the
//! application waits, so a program filling the disk hears of it at the call that meets it,
//! as NFS writes synchronously after a write error. So does a volume nearly full
//! ([`super::space`]).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kiln_wire::limits::{BATCH_FOPS_MAX, FRAME_BODY_LEN_MAX_BYTES};
use kiln_wire::{Batch, Creds, ErrorCode, FopReply, FopRequest, Gfid};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, watch};

use super::handles::Removal;
use super::space::{Space, disk_bytes};
use crate::Error;

/// What one queued fop costs besides its names, target and data, in bytes: its fixed fields
/// on the wire (at most ~150), or its bookkeeping in memory.
const FOP_OVERHEAD_BYTES: usize = 256;

/// Bytes of fops one batch carries at most: a frame, less room for the batch's own fields.
const BATCH_BYTES_MAX: usize = FRAME_BODY_LEN_MAX_BYTES - 4096;

/// How long after the brick's last refusal for want of space the mount answers no change
/// ahead.
const SPACE_REFUSAL_HOLD: Duration = Duration::from_secs(2);

/// A change waiting to be sent.
#[derive(Debug)]
pub(super) struct Queued {
    seq: u64,
    pub(super) creds: Creds,
    pub(super) fop: FopRequest,
    /// The objects it changes (the object first, then its parent directories): a fop naming
    /// one of them waits for it, and its error is reported there.
    touches: Vec<Gfid>,
    /// Its size on the wire, at most.
    wire_bytes: usize,
    /// The most it takes on disk.
    disk_bytes: u64,
    _room: OwnedSemaphorePermit,
    /// A removal of names, noted until the brick has answered it.
    _removal: Option<Removal>,
}

impl Queued {
    /// The objects it changes, the object first.
    pub(super) fn touches(&self) -> &[Gfid] {
        &self.touches
    }
}

#[derive(Debug, Default)]
struct State {
    next_seq: u64,
    queue: VecDeque<Queued>,
    /// The last sequence number queued for each object.
    dirty: HashMap<Gfid, u64>,
    /// The first error of each object's queued changes, until reported.
    failed: HashMap<Gfid, i32>,
    /// The objects of refused changes, whose leases the mount is to give back
    /// ([`Behind::refused_in`]).
    refused_in: Vec<Gfid>,
}

/// The mount's queue of changes not yet on the brick.
#[derive(Debug)]
pub(super) struct Behind {
    state: Mutex<State>,
    /// Bytes the queue may hold; a push waits for room.
    room: Arc<Semaphore>,
    room_bytes: usize,
    /// Wakes the sender.
    queued: Notify,
    /// The highest sequence number the brick has answered.
    answered: watch::Sender<u64>,
    /// When the brick last refused a change for want of space.
    space_refused: Mutex<Option<Instant>>,
    /// The volume's free space, as the queue weighs it.
    pub(super) space: Space,
    /// Wakes [`Behind::refused_in`].
    refused: Notify,
}

impl Behind {
    /// A queue of `bytes_max` bytes on the wire at most, which answers nothing ahead below
    /// `free_floor_bytes` of free space on the volume.
    pub(super) fn new(bytes_max: usize, free_floor_bytes: u64) -> Behind {
        Behind {
            state: Mutex::new(State {
                next_seq: 1,
                ..State::default()
            }),
            room: Arc::new(Semaphore::new(bytes_max)),
            room_bytes: bytes_max,
            queued: Notify::new(),
            answered: watch::Sender::new(0),
            space_refused: Mutex::new(None),
            space: Space::new(free_floor_bytes),
            refused: Notify::new(),
        }
    }

    /// Notes that the brick refused a change answered ahead in directory `dir` (or of
    /// directory `dir`): what the mount told of it may not be what the brick holds, so the
    /// mount gives the directory's lease back and the brick answers for it again.
    pub(super) fn note_refused_in(&self, dir: Gfid) {
        self.lock().refused_in.push(dir);
        self.refused.notify_one();
    }

    /// Waits for refused changes ([`Behind::note_refused_in`]); the objects they touched.
    pub(super) async fn refused_in(&self) -> Vec<Gfid> {
        loop {
            let taken = std::mem::take(&mut self.lock().refused_in);
            if !taken.is_empty() {
                return taken;
            }
            self.refused.notified().await;
        }
    }

    /// Notes a refusal by the brick (`errno`), of a change made behind or not: one for want
    /// of space holds changes back from being answered ahead.
    pub(super) fn note_refusal(&self, errno: i32) {
        if matches!(errno, libc::ENOSPC | libc::EDQUOT) {
            *self.space_refused.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        }
    }

    /// Whether the mount answers no change ahead for want of space: the brick refused one
    /// in the last [`SPACE_REFUSAL_HOLD`], or the volume is nearly full ([`Space::is_low`]).
    pub(super) fn short_of_space(&self) -> bool {
        let refused = self
            .space_refused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some_and(|at| at.elapsed() < SPACE_REFUSAL_HOLD);
        refused || self.space.is_low()
    }

    /// Queues `fop`, run as `creds`, changing `touches` (the object first); waits while the
    /// queue is full. Its sequence number.
    pub(super) async fn push(&self, creds: &Creds, fop: FopRequest, touches: &[Gfid]) -> u64 {
        self.push_removal(creds, fop, touches, None).await
    }

    /// [`Behind::push`] of a removal of names, whose `removal` is kept until the brick has
    /// answered it.
    pub(super) async fn push_removal(
        &self,
        creds: &Creds,
        fop: FopRequest,
        touches: &[Gfid],
        removal: Option<Removal>,
    ) -> u64 {
        debug_assert!(fop.batchable(), "{} cannot be queued", fop.code().name());
        let wire_bytes = wire_bytes(&fop);
        let disk_bytes = disk_bytes(wire_bytes);
        let cost = wire_bytes.min(self.room_bytes);
        let room = self
            .room
            .clone()
            .acquire_many_owned(u32::try_from(cost).unwrap_or(u32::MAX))
            .await
            .expect("the queue's semaphore is never closed");
        let seq = {
            let mut state = self.lock();
            let seq = state.next_seq;
            state.next_seq += 1;
            for gfid in touches {
                state.dirty.insert(*gfid, seq);
            }
            state.queue.push_back(Queued {
                seq,
                creds: creds.clone(),
                fop,
                touches: touches.to_vec(),
                wire_bytes,
                disk_bytes,
                _room: room,
                _removal: removal,
            });
            seq
        };
        self.space.queued(disk_bytes);
        self.queued.notify_one();
        seq
    }

    /// Whether anything is queued or being sent.
    #[cfg(test)]
    pub(super) fn is_idle(&self) -> bool {
        let state = self.lock();
        state.queue.is_empty() && *self.answered.borrow() + 1 >= state.next_seq
    }

    /// Whether a change to `gfid` is queued or being sent.
    pub(super) fn is_dirty(&self, gfid: &Gfid) -> bool {
        self.lock().dirty.contains_key(gfid)
    }

    /// Waits until the brick has answered every change queued for `gfid` so far.
    pub(super) async fn settle(&self, gfid: &Gfid) {
        let seq = self.lock().dirty.get(gfid).copied();
        if let Some(seq) = seq {
            self.wait(seq).await;
        }
    }

    /// Waits until the brick has answered everything queued so far.
    pub(super) async fn drain(&self) {
        let last = self.lock().next_seq - 1;
        self.wait(last).await;
    }

    async fn wait(&self, seq: u64) {
        let mut answered = self.answered.subscribe();
        let _ = answered.wait_for(|&done| done >= seq).await;
    }

    /// The error of a queued change to `gfid` the brick refused, once.
    pub(super) fn take_failure(&self, gfid: &Gfid) -> Option<i32> {
        self.lock().failed.remove(gfid)
    }

    /// Whether no refused change waits to be reported.
    pub(super) fn has_no_failures(&self) -> bool {
        self.lock().failed.is_empty()
    }

    /// The first error of any queued change not yet reported, once (an unmount's or a
    /// directory fsync's report).
    pub(super) fn take_any_failure(&self) -> Option<i32> {
        let mut state = self.lock();
        let gfid = *state.failed.keys().next()?;
        state.failed.remove(&gfid)
    }

    /// The next batch to send: the oldest changes, as many as one BATCH of one caller holds.
    /// Waits while nothing is queued.
    pub(super) async fn next_batch(&self) -> (Batch, Vec<Queued>) {
        loop {
            let notified = self.queued.notified();
            if let Some(batch) = self.take_batch() {
                return batch;
            }
            notified.await;
        }
    }

    fn take_batch(&self) -> Option<(Batch, Vec<Queued>)> {
        let mut state = self.lock();
        let creds = state.queue.front()?.creds.clone();
        let mut batch = Batch::new(creds.clone());
        let mut taken = Vec::new();
        let mut bytes = 0;
        while let Some(next) = state.queue.front() {
            let fits = bytes + next.wire_bytes <= BATCH_BYTES_MAX;
            if next.creds != creds || taken.len() == BATCH_FOPS_MAX || (!taken.is_empty() && !fits)
            {
                break;
            }
            let Some(next) = state.queue.pop_front() else {
                break;
            };
            bytes += next.wire_bytes;
            if batch.push(next.fop.clone()).is_err() {
                // `push` checked batchable, and the count is bounded above.
                unreachable!("a queued fop that does not fit a batch");
            }
            taken.push(next);
        }
        Some((batch, taken))
    }

    /// Records the brick's answers to a batch taken with [`Behind::next_batch`]: errors are
    /// kept for their objects, and waiters for these changes go on.
    pub(super) fn answered(&self, sent: &[Queued], results: &[Result<(), Error>]) {
        let mut state = self.lock();
        for (queued, result) in sent.iter().zip(results) {
            self.space.answered(queued.disk_bytes);
            if let Err(e) = result {
                let errno = e.errno();
                self.note_refusal(errno);
                tracing::warn!(fop = queued.fop.code().name(), error = %e, "a change made behind failed on the brick");
                for gfid in &queued.touches {
                    state.failed.entry(*gfid).or_insert(errno);
                }
                state.refused_in.extend(&queued.touches);
                self.refused.notify_one();
            }
            for gfid in &queued.touches {
                if state.dirty.get(gfid) == Some(&queued.seq) {
                    state.dirty.remove(gfid);
                }
            }
        }
        if let Some(last) = sent.last() {
            self.answered.send_replace(last.seq);
        }
    }

    /// Keeps `errno`, the refusal of a change to `gfid` made behind outside this queue (data
    /// written behind, [`super::handles`]), for the next `fsync` or `close` to report.
    pub(super) fn note_failure(&self, gfid: Gfid, errno: i32) {
        self.note_refusal(errno);
        self.lock().failed.entry(gfid).or_insert(errno);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// At most the bytes `fop` takes on the wire: its fixed fields, names, target, value and data.
fn wire_bytes(fop: &FopRequest) -> usize {
    let variable = match fop {
        FopRequest::Put(r) | FopRequest::PutSynced(kiln_wire::PutSynced { put: r }) => {
            r.name.len() + r.data.len()
        }
        FopRequest::Symlink(r) => r.name.len() + r.target.len(),
        FopRequest::Rename(r) => r.old_name.len() + r.new_name.len(),
        FopRequest::Setxattr(r) => r.name.len() + r.value.len(),
        FopRequest::Mkdir(kiln_wire::Mkdir { name, .. })
        | FopRequest::Mknod(kiln_wire::Mknod { name, .. })
        | FopRequest::Unlink(kiln_wire::Unlink { name, .. })
        | FopRequest::Rmdir(kiln_wire::Rmdir { name, .. })
        | FopRequest::Lookup(kiln_wire::Lookup { name, .. }) => name.len(),
        FopRequest::Link(r) => r.new_name.len(),
        _ => 0,
    };
    FOP_OVERHEAD_BYTES + variable
}

/// The errors a batch's fops get when the whole batch failed (`e`), one per fop.
pub(super) fn all_failed<T>(sent: &[Queued], e: &Error) -> Vec<Result<T, Error>> {
    sent.iter().map(|_| Err(e.clone())).collect()
}

/// The per-fop results of a BATCH reply as client errors.
pub(super) fn results(reply: Vec<Result<FopReply, ErrorCode>>) -> Vec<Result<FopReply, Error>> {
    reply.into_iter().map(|r| r.map_err(Error::Fop)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_wire::{Mkdir, Mode, Name, Unlink};

    fn gfid(n: u8) -> Gfid {
        Gfid::from_bytes([n; 16]).expect("gfid")
    }

    fn mkdir(n: u8) -> FopRequest {
        Mkdir {
            parent: Gfid::ROOT,
            name: Name::new(format!("d{n}")).expect("name"),
            gfid: gfid(n),
            mode: Mode::new(0o755).expect("mode"),
            umask: Mode::new(0).expect("mode"),
        }
        .into()
    }

    #[tokio::test]
    async fn batches_keep_order_and_split_by_caller() {
        let behind = Behind::new(1 << 20, 0);
        let (root, user) = (
            Creds::root(),
            Creds {
                uid: 7,
                ..Creds::root()
            },
        );
        behind.push(&root, mkdir(1), &[gfid(1), Gfid::ROOT]).await;
        behind.push(&root, mkdir(2), &[gfid(2), Gfid::ROOT]).await;
        behind.push(&user, mkdir(3), &[gfid(3), Gfid::ROOT]).await;
        let (batch, sent) = behind.next_batch().await;
        assert_eq!(batch.fops(), &[mkdir(1), mkdir(2)]);
        assert!(!behind.is_idle());
        behind.answered(&sent, &[Ok(()), Err(Error::Fop(ErrorCode::Exist))]);
        assert_eq!(behind.take_failure(&gfid(2)), Some(libc::EEXIST));
        assert_eq!(behind.take_failure(&gfid(2)), None, "reported once");
        let (batch, sent) = behind.next_batch().await;
        assert_eq!(batch.creds, user);
        behind.answered(&sent, &all_failed(&sent, &Error::Fop(ErrorCode::Io)));
        assert!(behind.is_idle());
        // The parent was touched by both: one of their errors each for it and gfid 3.
        assert!(behind.take_any_failure().is_some());
        assert!(behind.take_any_failure().is_some());
        assert_eq!(behind.take_any_failure(), None);
    }

    #[tokio::test]
    async fn a_refusal_for_want_of_space_holds_changes_back_and_names_what_it_touched() {
        let behind = Behind::new(1 << 20, 0);
        let root = Creds::root();
        behind.push(&root, mkdir(1), &[gfid(1), Gfid::ROOT]).await;
        let (_, sent) = behind.next_batch().await;
        behind.answered(&sent, &all_failed(&sent, &Error::Fop(ErrorCode::Exist)));
        assert!(!behind.short_of_space(), "EEXIST is no want of space");
        assert_eq!(behind.refused_in().await, [gfid(1), Gfid::ROOT]);
        behind.push(&root, mkdir(2), &[gfid(2), Gfid::ROOT]).await;
        let (_, sent) = behind.next_batch().await;
        behind.answered(&sent, &all_failed(&sent, &Error::Fop(ErrorCode::NoSpace)));
        assert!(behind.short_of_space());
        assert_eq!(behind.refused_in().await, [gfid(2), Gfid::ROOT]);
        behind.note_refusal(libc::EDQUOT);
        assert!(behind.short_of_space());
    }

    #[tokio::test]
    async fn settle_waits_for_the_objects_last_change_only() {
        let behind = Arc::new(Behind::new(1 << 20, 0));
        let root = Creds::root();
        behind.push(&root, mkdir(1), &[gfid(1)]).await;
        let unlink = Unlink {
            parent: gfid(1),
            name: Name::new("x").expect("name"),
        };
        behind.push(&root, unlink.into(), &[gfid(1)]).await;
        // Nothing queued for gfid 9: no wait.
        behind.settle(&gfid(9)).await;
        let waiter = tokio::spawn({
            let behind = behind.clone();
            async move { behind.settle(&gfid(1)).await }
        });
        let (_, sent) = behind.next_batch().await;
        assert_eq!(sent.len(), 2);
        assert!(!waiter.is_finished());
        behind.answered(&sent, &all_failed(&sent, &Error::Fop(ErrorCode::NoEnt)));
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("settled")
            .expect("task");
    }

    #[tokio::test]
    async fn a_full_queue_makes_the_pusher_wait() {
        let behind = Arc::new(Behind::new(2 * wire_bytes(&mkdir(1)), 0));
        let root = Creds::root();
        behind.push(&root, mkdir(1), &[gfid(1)]).await;
        behind.push(&root, mkdir(2), &[gfid(2)]).await;
        let third = tokio::spawn({
            let behind = behind.clone();
            async move { behind.push(&Creds::root(), mkdir(3), &[gfid(3)]).await }
        });
        tokio::task::yield_now().await;
        assert!(!third.is_finished(), "waits for room");
        let (_, sent) = behind.next_batch().await;
        behind.answered(&sent, &all_failed(&sent, &Error::Fop(ErrorCode::Io)));
        drop(sent);
        tokio::time::timeout(Duration::from_secs(5), third)
            .await
            .expect("room made")
            .expect("task");
    }
}
