//! The ring itself: the only `unsafe` code of the brick. It pushes SQEs that point into
//! chains it owns, reaps CQEs, turns new fds into owned values, and keeps every buffer alive
//! until the kernel is done with it, even when the fop that pushed it was dropped.
#![allow(unsafe_code)]

use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::future::Future;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use io_uring::{IoUring, Probe, opcode, squeue, types};
use rustix::io::Errno;
use slab::Slab;
use tokio::io::unix::AsyncFd;

use super::RingStats;
use crate::op::{Buf, BufKind, Completion, Op, Step};

/// One chain in flight: its steps and buffers stay here, unmoved, until its last CQE.
#[derive(Debug)]
struct ChainSlot {
    steps: Vec<Step>,
    bufs: Vec<Buf>,
    /// Each step's direct-descriptor slot (a fixed open's destination).
    fixed: Vec<Option<u32>>,
    results: Vec<Option<i32>>,
    remaining: usize,
    waker: Option<Waker>,
    abandoned: bool,
}

/// What one step of a chain came back with: its op and buffer, and the completion or error.
pub(super) type StepOutcome = (Step, Buf, Result<Completion, Errno>);

/// A ring and the chains in flight on it; one per worker thread.
pub(super) struct Ring {
    ring: RefCell<IoUring>,
    chains: RefCell<Slab<ChainSlot>>,
    fixed_free: RefCell<Vec<u32>>,
    submit_scheduled: Cell<bool>,
    /// Personalities evicted from the cache, unregistered after the next submit.
    retired: RefCell<Vec<u16>>,
    supported: HashSet<u8>,
    stats: Cell<RingStats>,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("chains", &self.chains.borrow().len())
            .field("stats", &self.stats.get())
            .finish()
    }
}

impl Ring {
    /// Sets up a ring with `entries` SQEs and `fixed_files` direct-descriptor slots, probes
    /// which opcodes the kernel has, and spawns its completion driver on the current
    /// `LocalSet`. Must run inside the worker's runtime.
    pub(super) fn start(entries: u32, fixed_files: u32) -> std::io::Result<Rc<Ring>> {
        // SUBMIT_ALL: one failing SQE must not stop the submission of the chains behind it.
        let ring = IoUring::builder()
            .setup_submit_all()
            .setup_cqsize(entries * 2)
            .build(entries)?;
        ring.submitter().register_files_sparse(fixed_files)?;
        let mut probe = Probe::new();
        ring.submitter().register_probe(&mut probe)?;
        let supported = Op::OPCODES
            .iter()
            .map(|(code, _)| *code)
            .filter(|code| probe.is_supported(*code))
            .collect();
        let ring = Rc::new(Ring {
            ring: RefCell::new(ring),
            chains: RefCell::new(Slab::new()),
            fixed_free: RefCell::new((0..fixed_files).rev().collect()),
            submit_scheduled: Cell::new(false),
            retired: RefCell::new(Vec::new()),
            supported,
            stats: Cell::new(RingStats::default()),
        });
        let raw_ring = RingFd(ring.ring.borrow().as_raw_fd());
        // SAFETY: the ring fd stays open as long as `ring` lives, and the driver task owns
        // both the `AsyncFd` and a reference to `ring`, so the fd outlives its registration.
        let fd =
            unsafe { AsyncFd::register_with_interest(raw_ring, tokio::io::Interest::READABLE) }
                .map_err(|e| std::io::Error::other(e.to_string()))?;
        tokio::task::spawn_local(drive(ring.clone(), fd));
        Ok(ring)
    }

    pub(super) fn supports(&self, code: u8) -> bool {
        self.supported.contains(&code)
    }

    pub(super) fn stats(&self) -> RingStats {
        self.stats.get()
    }

    pub(super) fn bump(&self, f: impl FnOnce(&mut RingStats)) {
        let mut s = self.stats.get();
        f(&mut s);
        self.stats.set(s);
    }

    /// Registers the calling thread's current credentials as a personality.
    pub(super) fn register_personality(&self) -> std::io::Result<u16> {
        self.ring.borrow().submitter().register_personality()
    }

    /// Unregisters `id` after the next submit (SQEs pushed this turn may still name it).
    pub(super) fn retire_personality(&self, id: u16) {
        self.retired.borrow_mut().push(id);
    }

    pub(super) fn take_slot(&self) -> Option<u32> {
        self.fixed_free.borrow_mut().pop()
    }

    pub(super) fn free_slots(&self, slots: impl IntoIterator<Item = u32>) {
        self.fixed_free.borrow_mut().extend(slots);
    }

    /// Pushes `steps` as one linked chain (each with its personality and fixed slot), submits
    /// with the loop turn's other chains, and waits for every CQE.
    pub(super) async fn run_chain(
        self: &Rc<Self>,
        steps: Vec<Step>,
        personalities: &[Option<u16>],
        fixed: Vec<Option<u32>>,
    ) -> Vec<StepOutcome> {
        let n = steps.len();
        debug_assert!(n > 0 && personalities.len() == n && fixed.len() == n);
        let bufs = steps.iter().map(|s| new_buf(s.op.buf())).collect();
        let key = self.chains.borrow_mut().insert(ChainSlot {
            steps,
            bufs,
            fixed,
            results: vec![None; n],
            remaining: n,
            waker: None,
            abandoned: false,
        });
        if let Err(e) = self.push(key, personalities) {
            let slot = self.chains.borrow_mut().remove(key);
            self.free_slots(slot.fixed.iter().flatten().copied());
            return slot
                .steps
                .into_iter()
                .zip(slot.bufs)
                .map(|(step, buf)| (step, buf, Err(e)))
                .collect();
        }
        self.bump(|s| {
            s.sqes += n as u64;
            s.chains += 1;
        });
        crate::profile::charge(|c| c.sqes += n as u64);
        self.schedule_submit();
        let slot = ChainWait {
            ring: self.clone(),
            key,
            done: false,
        }
        .await;
        let mut out = Vec::with_capacity(n);
        for (i, (step, mut buf)) in slot.steps.into_iter().zip(slot.bufs).enumerate() {
            let result = slot.results[i].unwrap_or(-libc::ECANCELED);
            mark_filled(&mut buf, result);
            let completion = self.completion(result, slot.fixed[i], step.op.opens_file());
            out.push((step, buf, completion));
        }
        out
    }

    /// Builds and pushes the SQEs of chain `key`; a full queue is submitted first.
    fn push(&self, key: usize, personalities: &[Option<u16>]) -> Result<(), Errno> {
        let mut chains = self.chains.borrow_mut();
        let slot = &mut chains[key];
        let n = slot.steps.len();
        let entries: Vec<squeue::Entry> = (0..n)
            .map(|i| {
                let step = &slot.steps[i];
                let mut e = step
                    .op
                    .sqe(&mut slot.bufs[i], slot.fixed[i])
                    .user_data((key as u64) << 16 | i as u64);
                if i + 1 < n {
                    // Only a barrier breaks the chain (see `op`); a hard link keeps going
                    // after any result, a plain link stops after a failed open.
                    e = e.flags(if step.barrier {
                        squeue::Flags::IO_LINK
                    } else {
                        squeue::Flags::IO_HARDLINK
                    });
                }
                match personalities[i] {
                    Some(p) => e.personality(p),
                    None => e,
                }
            })
            .collect();
        let mut ring = self.ring.borrow_mut();
        let room = {
            let sq = ring.submission();
            sq.capacity() - sq.len()
        };
        if room < n {
            // A chain is pushed whole, never split across two submissions.
            let _ = ring.submit();
            self.bump(|s| s.enters += 1);
        }
        // SAFETY: every pointer in `entries` (names, buffers, statx structs) points into the
        // chain's slot, which stays in the slab, unmoved, until its last CQE has arrived; fds
        // named by the steps are kept open by the `Arc`s the steps hold.
        unsafe { ring.submission().push_multiple(&entries) }.map_err(|_| Errno::AGAIN)
    }

    /// A CQE's result as a [`Completion`]: new fds become owned values, fixed slots of failed
    /// opens go back to the free list.
    fn completion(
        &self,
        result: i32,
        fixed: Option<u32>,
        opens: bool,
    ) -> Result<Completion, Errno> {
        if result < 0 {
            self.free_slots(fixed);
            return Err(Errno::from_raw_os_error(-result));
        }
        Ok(match fixed {
            Some(slot) => Completion::Fixed(slot),
            // SAFETY: a successful non-fixed OPENAT returns a new fd that nothing else owns;
            // it is wrapped exactly once, here, for the fop that pushed the open.
            None if opens => Completion::Fd(unsafe { OwnedFd::from_raw_fd(result) }),
            None => Completion::Value(result.cast_unsigned()),
        })
    }

    /// Makes sure one submit task is queued behind this turn's ready tasks.
    fn schedule_submit(self: &Rc<Self>) {
        if self.submit_scheduled.replace(true) {
            return;
        }
        let ring = self.clone();
        tokio::task::spawn_local(async move {
            // Runs after the tasks already ready in this turn, so their chains share one
            // io_uring_enter.
            ring.submit_scheduled.set(false);
            if ring.submit() {
                // Submission stopped early (a full completion queue): try again next turn.
                ring.schedule_submit();
            }
        });
    }

    /// One `io_uring_enter`; whether SQEs are left unsubmitted.
    fn submit(&self) -> bool {
        let mut ring = self.ring.borrow_mut();
        if let Err(e) = ring.submit() {
            tracing::error!(error = %e, "io_uring_enter failed");
        }
        self.bump(|s| s.enters += 1);
        // The kernel has taken the credentials of every submitted SQE: personalities evicted
        // meanwhile can go now.
        for id in self.retired.borrow_mut().drain(..) {
            let _ = ring.submitter().unregister_personality(id);
        }
        !ring.submission().is_empty()
    }

    /// Records one CQE; wakes the chain's fop at its last one, or frees an abandoned chain.
    fn reap(&self, ring: &mut IoUring, user_data: u64, result: i32) {
        let key = (user_data >> 16) as usize;
        let index = (user_data & 0xffff) as usize;
        let mut chains = self.chains.borrow_mut();
        let Some(slot) = chains.get_mut(key) else {
            return;
        };
        slot.results[index] = Some(result);
        slot.remaining -= 1;
        if slot.remaining > 0 {
            return;
        }
        if !slot.abandoned {
            if let Some(w) = slot.waker.take() {
                w.wake();
            }
            return;
        }
        let slot = chains.remove(key);
        drop(chains);
        self.close_abandoned(ring, &slot);
    }

    /// Files opened by a chain whose fop is gone are closed with it.
    fn close_abandoned(&self, ring: &mut IoUring, slot: &ChainSlot) {
        for (i, step) in slot.steps.iter().enumerate() {
            let Some(r) = slot.results[i].filter(|_| step.op.opens_file()) else {
                continue;
            };
            match slot.fixed[i] {
                Some(s) => {
                    if r >= 0 {
                        let _ = ring.submitter().register_files_update(s, &[-1]);
                    }
                    self.free_slots([s]);
                }
                // SAFETY: a successful non-fixed OPENAT returned a new fd that no one else
                // owns (its fop is gone); it is closed exactly once here.
                None if r >= 0 => drop(unsafe { OwnedFd::from_raw_fd(r) }),
                None => {}
            }
        }
    }
}

/// A read's buffer takes the length the kernel filled: `result` bytes from its start.
fn mark_filled(buf: &mut Buf, result: i32) {
    if let (Buf::Read(data), Ok(n)) = (buf, usize::try_from(result)) {
        assert!(
            data.is_empty() && n <= data.capacity(),
            "a read past its buffer"
        );
        // SAFETY: the READ's SQE gave the kernel the buffer's capacity, and its CQE says it
        // wrote `n` bytes of it from the start.
        unsafe { data.set_len(n) };
    }
}

fn new_buf(kind: BufKind) -> Buf {
    match kind {
        BufKind::None => Buf::None,
        // SAFETY: `libc::statx` is plain old data; all-zero is a valid value.
        BufKind::Statx => Buf::Statx(Box::new(unsafe { std::mem::zeroed() })),
        BufKind::Read(len) => Buf::Read(crate::op::read_buf(len)),
    }
}

impl Drop for Ring {
    /// A worker shutting down may still have SQEs in the kernel: cancel what can be cancelled
    /// and wait (bounded) for their completions before the buffers they point into are freed.
    /// Whatever is still in flight after that (an open stuck on a slow device) is leaked
    /// rather than freed under the kernel.
    fn drop(&mut self) {
        const CANCEL_MARKER: u64 = u64::MAX;
        const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
        let mut remaining: usize = self.chains.get_mut().iter().map(|(_, c)| c.remaining).sum();
        if remaining == 0 {
            return;
        }
        let ring = self.ring.get_mut();
        let cancel = opcode::AsyncCancel2::new(types::CancelBuilder::any())
            .build()
            .user_data(CANCEL_MARKER);
        // SAFETY: a cancel SQE carries no pointers into memory that could be freed.
        let _ = unsafe { ring.submission().push(&cancel) };
        let deadline = std::time::Instant::now() + DRAIN_TIMEOUT;
        while remaining > 0 && std::time::Instant::now() < deadline {
            let tick = types::Timespec::new().nsec(100_000_000);
            let args = types::SubmitArgs::new().timespec(&tick);
            match ring.submitter().submit_with_args(1, &args) {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::ETIME | libc::EINTR | libc::EBUSY)
                    ) => {}
                Err(_) => break,
            }
            let done = ring
                .completion()
                .filter(|c| c.user_data() != CANCEL_MARKER)
                .count();
            remaining = remaining.saturating_sub(done);
        }
        if remaining > 0 {
            std::mem::forget(std::mem::take(self.chains.get_mut()));
        }
    }
}

/// Waits for every CQE of one chain; if dropped early, leaves the chain to the driver.
struct ChainWait {
    ring: Rc<Ring>,
    key: usize,
    done: bool,
}

impl Future for ChainWait {
    type Output = ChainSlot;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<ChainSlot> {
        let mut chains = self.ring.chains.borrow_mut();
        let slot = &mut chains[self.key];
        if slot.remaining > 0 {
            slot.waker = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let slot = chains.remove(self.key);
        drop(chains);
        self.done = true;
        Poll::Ready(slot)
    }
}

impl Drop for ChainWait {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut chains = self.ring.chains.borrow_mut();
        if chains[self.key].remaining == 0 {
            let slot = chains.remove(self.key);
            drop(chains);
            // Completed but never collected: its opened files must not leak.
            self.ring
                .close_abandoned(&mut self.ring.ring.borrow_mut(), &slot);
        } else {
            // The kernel still uses the chain's buffers: the driver frees it at the last CQE.
            chains[self.key].abandoned = true;
        }
    }
}

struct RingFd(RawFd);

impl AsRawFd for RingFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// Reaps completions whenever the ring's fd is readable.
async fn drive(ring: Rc<Ring>, fd: AsyncFd<RingFd>) {
    loop {
        let mut guard = match fd.readable().await {
            Ok(g) => g,
            Err(e) => {
                tracing::error!(error = %e, "io_uring completion driver stopped");
                return;
            }
        };
        let mut io = ring.ring.borrow_mut();
        let cqes: Vec<(u64, i32)> = io
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (user_data, result) in cqes {
            ring.reap(&mut io, user_data, result);
        }
        drop(io);
        guard.clear_ready();
    }
}
