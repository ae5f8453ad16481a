//! The io_uring executor: one ring per worker thread, driven by that thread's tokio
//! current-thread runtime.
//!
//! * A chain of steps becomes linked SQEs; every chain pushed during one turn of the event
//!   loop is submitted by a single `io_uring_enter`, made by a task that runs after the turn's
//!   other ready tasks.
//! * Owned buffers: a chain's steps (names, data, statx buffers, fds) live in the ring's slab
//!   until the last CQE arrives, even if the fop that pushed them was dropped meanwhile
//!   ([`ring`], the only `unsafe` code of the brick).
//! * Files opened and closed inside one chain are direct descriptors in the ring's registered
//!   file table; files kept open across requests are plain fds.
//! * A step runs as the caller through a registered personality (one per distinct caller,
//!   captured once, kept in an LRU).
//! * Ops that run inline (`statx` and plain closes: see `op::stat`) run on the worker at either
//!   end of a chain (a chain of nothing else runs there whole, at once); one between ring
//!   steps stays in the ring, so a chain is still one submission. Ops with no opcode on this
//!   kernel (probed at start) and calls io_uring has no opcode for run on a small bounded
//!   blocking pool.
//! * A worker with nothing else in flight runs a chain of quick steps (`op::RingOp::quick`)
//!   as plain system calls: with no other work to overlap, the ring's hand-offs to io-wq
//!   threads would only add latency.

mod ring;

use std::cell::{Cell, RefCell};
use std::num::NonZeroUsize;
use std::rc::Rc;

use kiln_wire::Creds;
use lru::LruCache;
use rustix::io::Errno;

use self::ring::{Ring, StepOutcome};
use super::Exec;
use super::pool::BlockingPool;
use crate::op::{Completed, Done, FileRef, Op, Step, StepResult, Who};

/// Ring sizes and pool bounds.
#[derive(Debug, Clone)]
pub struct RingConfig {
    /// Submission queue entries (the completion queue gets twice as many).
    pub ring_entries: u32,
    /// Direct-descriptor slots registered per ring.
    pub fixed_files: u32,
    /// Threads of the blocking pool shared by the workers.
    pub blocking_threads: usize,
    /// Jobs the blocking pool queues before callers wait.
    pub blocking_queue_max: usize,
    /// Callers whose credentials are kept as registered personalities.
    pub personalities_max: NonZeroUsize,
    /// Whether a worker with nothing else in flight runs quick chains as plain system calls.
    pub idle_inline: bool,
}

impl Default for RingConfig {
    fn default() -> Self {
        RingConfig {
            ring_entries: 1024,
            fixed_files: 4096,
            blocking_threads: 4,
            blocking_queue_max: 1024,
            personalities_max: NonZeroUsize::new(256).unwrap_or(NonZeroUsize::MIN),
            idle_inline: true,
        }
    }
}

pub use kiln_admin::control::RingStats;

/// A caller's identity as the kernel sees it: uid, gid, supplementary groups.
type CredsKey = (u32, u32, Vec<u32>);

/// The io_uring executor of one worker thread.
#[derive(Debug, Clone)]
pub struct UringExec {
    ring: Rc<Ring>,
    personalities: Rc<RefCell<LruCache<CredsKey, u16>>>,
    pool: BlockingPool,
    /// Chains this worker is running.
    running: Rc<Cell<usize>>,
    idle_inline: bool,
}

/// One chain counted in [`UringExec::running`] while this lives.
struct Running(Rc<Cell<usize>>);

impl Running {
    fn enter(running: &Rc<Cell<usize>>) -> Running {
        running.set(running.get() + 1);
        Running(running.clone())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.set(self.0.get() - 1);
    }
}

impl UringExec {
    /// Sets up this thread's ring and its completion driver. Must run inside the worker's
    /// runtime, on its `LocalSet`.
    pub fn new(config: &RingConfig, pool: BlockingPool) -> std::io::Result<UringExec> {
        // The registered table counts against RLIMIT_NOFILE; leave room for plain fds.
        let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(1024);
        let fixed_files = config
            .fixed_files
            .min(u32::try_from(nofile / 4).unwrap_or(u32::MAX))
            .max(16);
        let ring = Ring::start(config.ring_entries, fixed_files)?;
        let mut missing: Vec<&str> = Op::OPCODES
            .iter()
            .filter(|(code, _)| !ring.supports(*code))
            .map(|(_, name)| *name)
            .collect();
        missing.dedup();
        if !missing.is_empty() {
            tracing::warn!(
                ?missing,
                "this kernel's io_uring lacks these opcodes; they run on the blocking pool"
            );
        }
        Ok(UringExec {
            ring,
            personalities: Rc::new(RefCell::new(LruCache::new(config.personalities_max))),
            pool,
            running: Rc::default(),
            idle_inline: config.idle_inline,
        })
    }

    pub fn stats(&self) -> RingStats {
        self.ring.stats()
    }

    /// Whether the ring runs this op (else the pool does).
    fn on_ring(&self, op: &Op) -> bool {
        op.opcode().is_some_and(|code| self.ring.supports(code))
    }

    /// The registered personality for `creds`, registering it on first use.
    fn personality(&self, creds: &Creds) -> Result<Option<u16>, Errno> {
        if creds.uid == 0 {
            return Ok(None);
        }
        let key = (creds.uid, creds.gid, creds.groups.as_slice().to_vec());
        if let Some(id) = self.personalities.borrow_mut().get(&key) {
            return Ok(Some(*id));
        }
        let id = {
            let _as = crate::creds::ActAs::new(creds)?;
            self.ring
                .register_personality()
                .map_err(|e| Errno::from_io_error(&e).unwrap_or(Errno::IO))?
        };
        if let Some((_, old)) = self.personalities.borrow_mut().push(key, id)
            && old != id
        {
            self.ring.retire_personality(old);
        }
        Ok(Some(id))
    }

    /// Pushes one segment of ring steps as a linked chain and waits for all its results.
    async fn ring_segment(&self, mut steps: Vec<Step>) -> Vec<StepResult> {
        let n = steps.len();
        // Direct descriptors for fixed opens; later steps' `Chain` files name that slot.
        let mut fixed = vec![None; n];
        let mut chain_slot = None;
        for (i, step) in steps.iter_mut().enumerate() {
            if step.op.opens_fixed() {
                chain_slot = self.ring.take_slot();
                fixed[i] = chain_slot;
                if chain_slot.is_none() {
                    // No free slot: nothing runs, as the kernel would refuse at a full table.
                    self.ring.free_slots(fixed.iter().flatten().copied());
                    return fail_all(n, Errno::NFILE);
                }
            } else if let Some(slot) = chain_slot {
                step.op.resolve_chain_file(&FileRef::Fixed(slot));
            }
        }
        let mut personalities = Vec::with_capacity(n);
        for step in &steps {
            match &step.who {
                Who::Brick => personalities.push(None),
                Who::Caller(creds) => match self.personality(creds) {
                    Ok(p) => personalities.push(p),
                    Err(e) => {
                        self.ring.free_slots(fixed.iter().flatten().copied());
                        return fail_all(n, e);
                    }
                },
            }
        }
        let outcomes = self.ring.run_chain(steps, &personalities, fixed).await;
        let mut out = Vec::with_capacity(n);
        for outcome in outcomes {
            out.push(self.complete(outcome).await);
        }
        out
    }

    /// Turns one step's outcome into its result, finishing a partial one on the pool.
    async fn complete(&self, (step, buf, outcome): StepOutcome) -> StepResult {
        let slot = step.op.frees_slot();
        let done = match outcome {
            Ok(done) => done,
            Err(e) => return Err(e),
        };
        match step.op.complete(done, buf) {
            Completed::Done(result) => {
                if result.is_ok() {
                    self.ring.free_slots(slot);
                }
                result
            }
            Completed::Partial { done, rest } => {
                let rest = Step {
                    op: rest,
                    who: step.who,
                    barrier: step.barrier,
                };
                match self.on_pool(rest).await? {
                    Done::Value(more) => Ok(Done::Value(done + more)),
                    _ => Err(crate::op::invariant(
                        "a partial op finished with a non-value",
                    )),
                }
            }
        }
    }

    async fn on_pool(&self, step: Step) -> StepResult {
        self.ring.bump(|s| s.pool_jobs += 1);
        crate::profile::charge(|c| c.pool_jobs += 1);
        self.pool.run(move || super::blocking::run_step(step)).await
    }

    /// The next segment of `rest` for the ring: consecutive ring steps, ending where a later
    /// step needs this one's result first (a plain fd is known only once its open completes)
    /// or at a barrier that io_uring's links would not stop at. Empty when the next step runs
    /// inline or on the pool.
    fn next_segment(
        &self,
        rest: &mut std::iter::Peekable<std::vec::IntoIter<Step>>,
        opened: Option<&FileRef>,
        first: usize,
        tail: usize,
    ) -> Vec<Step> {
        let mut segment = Vec::new();
        while let Some(step) = rest.peek_mut() {
            if let Some(file) = opened {
                step.op.resolve_chain_file(file);
            }
            let index = first + segment.len();
            let inline = step.op.inline() && (segment.is_empty() || index >= tail);
            if inline || !self.on_ring(&step.op) {
                break;
            }
            let Some(step) = rest.next() else { break };
            // Only an open's, a read's or a write's failure cancels linked SQEs: end the
            // submission after any other barrier, and after an open whose plain fd later
            // steps need.
            let ends = (step.op.opens_file() && !step.op.opens_fixed())
                || (step.barrier && !step.op.cancels_links_on_failure());
            segment.push(step);
            if ends {
                break;
            }
        }
        segment
    }
}

/// The result of a segment that never reached the kernel: every step failed with `e`.
fn fail_all(n: usize, e: Errno) -> Vec<StepResult> {
    (0..n).map(|_| Err(e)).collect()
}

impl Exec for UringExec {
    async fn run(&self, steps: Vec<Step>) -> Vec<StepResult> {
        if steps.iter().all(|s| s.op.inline()) {
            // Nothing to overlap (a LOOKUP's two statx): no yield, no ring.
            return super::blocking::run_chain(steps);
        }
        let _running = Running::enter(&self.running);
        let idle = self.running.get() == 1;
        if self.idle_inline && idle && steps.iter().all(|s| s.op.quick()) {
            // Fops ready on this worker start first (a chain run inline never yields, so
            // without this every chain would find the worker idle); if one reaches the ring
            // or waits here, the worker is busy and the ring overlaps the work. A worker
            // with chains in flight is busy already: no yield.
            tokio::task::yield_now().await;
            if self.running.get() == 1 {
                self.ring.bump(|s| s.idle_chains += 1);
                return super::blocking::run_chain(steps);
            }
        }
        let n = steps.len();
        // From here on every step runs inline.
        let tail = steps
            .iter()
            .rposition(|s| !s.op.inline())
            .map_or(0, |i| i + 1);
        let mut out: Vec<StepResult> = Vec::with_capacity(n);
        let mut opened: Option<FileRef> = None;
        let mut rest = steps.into_iter().peekable();
        let mut stopped = false;
        while out.len() < n {
            if stopped {
                rest.next();
                out.push(Err(Errno::CANCELED));
                continue;
            }
            let segment = self.next_segment(&mut rest, opened.as_ref(), out.len(), tail);
            let (results, barriers) = if segment.is_empty() {
                let Some(step) = rest.next() else { break };
                let barrier = step.barrier;
                let result = if step.op.inline() {
                    super::blocking::run_step(step)
                } else {
                    self.on_pool(step).await
                };
                (vec![result], vec![barrier])
            } else {
                let barriers: Vec<bool> = segment.iter().map(|s| s.barrier).collect();
                (self.ring_segment(segment).await, barriers)
            };
            for (r, barrier) in results.into_iter().zip(barriers) {
                if let Ok(Done::Opened(f)) = &r {
                    opened = Some(f.clone());
                }
                stopped |= barrier && r.is_err();
                out.push(r);
            }
        }
        out
    }

    async fn blocking<T: Send + 'static>(&self, work: impl FnOnce() -> T + Send + 'static) -> T {
        self.ring.bump(|s| s.pool_jobs += 1);
        crate::profile::charge(|c| c.pool_jobs += 1);
        self.pool.run(work).await
    }
}
