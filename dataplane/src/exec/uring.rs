//! The io_uring executor: one ring per worker thread, driven by that thread's tokio
//! current-thread runtime. This is the only module that touches `io-uring`, and with it the
//! only `unsafe` code of the brick.
//!
//! * A chain of steps becomes linked SQEs (`IOSQE_IO_LINK`); every chain pushed during one
//!   turn of the event loop is submitted by a single `io_uring_enter`, made by a task that runs
//!   after the turn's other ready tasks.
//! * Owned buffers: a chain's steps (names, data, statx buffers, fds) live in the ring's slab
//!   until the last CQE arrives, even if the fop that pushed them was dropped meanwhile.
//! * Files opened and closed inside one chain (PUT, the GFID step of MKDIR) are direct
//!   descriptors in the ring's registered file table; files kept open across requests are plain
//!   fds, because `statx`, `lseek` and `getdents` cannot address direct descriptors.
//! * A step runs as the caller through a registered personality (one per distinct caller,
//!   captured once, kept in an LRU).
//! * Steps with no opcode on this kernel (probed at start) and calls io_uring has no opcode for
//!   run on a small bounded blocking pool.
#![allow(unsafe_code)]

use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::future::Future;
use std::num::NonZeroUsize;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use io_uring::{IoUring, Probe, opcode, squeue, types};
use kiln_wire::Creds;
use lru::LruCache;
use rustix::io::Errno;
use slab::Slab;
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, oneshot};

use super::Exec;
use crate::step::{Done, FileRef, Op, Stat, Step, StepResult, Who, raw};

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
}

impl Default for RingConfig {
    fn default() -> Self {
        RingConfig {
            ring_entries: 1024,
            fixed_files: 4096,
            blocking_threads: 4,
            blocking_queue_max: 1024,
            personalities_max: NonZeroUsize::new(256).unwrap_or(NonZeroUsize::MIN),
        }
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// A bounded pool of threads for work that blocks.
#[derive(Debug, Clone)]
pub struct BlockingPool {
    jobs: mpsc::Sender<Job>,
}

impl BlockingPool {
    pub fn new(threads: usize, queue_max: usize) -> std::io::Result<BlockingPool> {
        let (tx, rx) = mpsc::channel::<Job>(queue_max.max(1));
        super::spawn_queue_threads("kiln-blocking", threads, rx, |job: Job| job())?;
        Ok(BlockingPool { jobs: tx })
    }

    pub async fn run<T: Send + 'static>(&self, work: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move || {
            let _ = tx.send(work());
        });
        if self.jobs.send(job).await.is_err() {
            // The pool is gone only at shutdown; nothing can run any more.
            std::process::abort();
        }
        match rx.await {
            Ok(v) => v,
            // The job panicked: surface it in this task as well.
            Err(_) => panic!("a blocking job panicked"),
        }
    }
}

/// Per-step buffers the kernel writes into.
#[derive(Debug)]
enum Buf {
    None,
    Statx(Box<libc::statx>),
    Read(Vec<u8>),
}

#[derive(Debug)]
struct ChainSlot {
    steps: Vec<Step>,
    bufs: Vec<Buf>,
    fixed: Vec<Option<u32>>,
    results: Vec<Option<i32>>,
    remaining: usize,
    waker: Option<Waker>,
    abandoned: bool,
}

pub use kiln_admin::control::RingStats;

/// A caller's identity as the kernel sees it: uid, gid, supplementary groups.
type CredsKey = (u32, u32, Vec<u32>);

struct RingState {
    ring: RefCell<IoUring>,
    chains: RefCell<Slab<ChainSlot>>,
    fixed_free: RefCell<Vec<u32>>,
    submit_scheduled: Cell<bool>,
    /// Personalities evicted from the cache, unregistered after the next submit.
    retired: RefCell<Vec<u16>>,
    personalities: RefCell<LruCache<CredsKey, u16>>,
    supported: HashSet<u8>,
    stats: Cell<RingStats>,
}

impl Drop for RingState {
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

impl std::fmt::Debug for RingState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingState")
            .field("chains", &self.chains.borrow().len())
            .field("stats", &self.stats.get())
            .finish()
    }
}

/// The io_uring executor of one worker thread.
#[derive(Debug, Clone)]
pub struct UringExec {
    state: Rc<RingState>,
    pool: BlockingPool,
}

/// Opcodes the executor uses; any the kernel lacks sends that step to the pool.
const OPCODES: [(u8, &str); 13] = [
    (opcode::Statx::CODE, "statx"),
    (opcode::OpenAt::CODE, "openat"),
    (opcode::MkDirAt::CODE, "mkdirat"),
    (opcode::SymlinkAt::CODE, "symlinkat"),
    (opcode::LinkAt::CODE, "linkat"),
    (opcode::RenameAt::CODE, "renameat"),
    (opcode::UnlinkAt::CODE, "unlinkat"),
    (opcode::FSetXattr::CODE, "fsetxattr"),
    (opcode::Write::CODE, "write"),
    (opcode::Read::CODE, "read"),
    (opcode::Fsync::CODE, "fsync"),
    (opcode::Close::CODE, "close"),
    (opcode::Fallocate::CODE, "fallocate"),
];

impl UringExec {
    /// Sets up this thread's ring and spawns its completion driver on the current
    /// `LocalSet`. Must run inside the worker's runtime.
    pub fn new(config: &RingConfig, pool: BlockingPool) -> std::io::Result<UringExec> {
        // SUBMIT_ALL: one failing SQE must not stop the submission of the chains behind it.
        let ring = IoUring::builder()
            .setup_submit_all()
            .setup_cqsize(config.ring_entries * 2)
            .build(config.ring_entries)?;
        // The registered table counts against RLIMIT_NOFILE; leave room for plain fds.
        let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(1024);
        let fixed_files = config
            .fixed_files
            .min(u32::try_from(nofile / 4).unwrap_or(u32::MAX))
            .max(16);
        ring.submitter().register_files_sparse(fixed_files)?;
        let mut probe = Probe::new();
        ring.submitter().register_probe(&mut probe)?;
        let supported: HashSet<u8> = OPCODES
            .iter()
            .map(|(c, _)| *c)
            .filter(|c| probe.is_supported(*c))
            .collect();
        let missing: Vec<&str> = OPCODES
            .iter()
            .filter(|(c, _)| !supported.contains(c))
            .map(|(_, n)| *n)
            .collect();
        if !missing.is_empty() {
            tracing::warn!(
                ?missing,
                "this kernel's io_uring lacks these opcodes; they run on the blocking pool"
            );
        }
        let state = Rc::new(RingState {
            ring: RefCell::new(ring),
            chains: RefCell::new(Slab::new()),
            fixed_free: RefCell::new((0..fixed_files).rev().collect()),
            submit_scheduled: Cell::new(false),
            retired: RefCell::new(Vec::new()),
            personalities: RefCell::new(LruCache::new(config.personalities_max)),
            supported,
            stats: Cell::new(RingStats::default()),
        });
        let raw_ring = RingFd(state.ring.borrow().as_raw_fd());
        // SAFETY: the ring fd stays open as long as `state` lives, and the driver task owns
        // both the `AsyncFd` and a reference to `state`, so the fd outlives its registration.
        let fd =
            unsafe { AsyncFd::register_with_interest(raw_ring, tokio::io::Interest::READABLE) }
                .map_err(|e| std::io::Error::other(e.to_string()))?;
        tokio::task::spawn_local(drive(state.clone(), fd));
        Ok(UringExec { state, pool })
    }

    pub fn stats(&self) -> RingStats {
        self.state.stats.get()
    }

    fn bump(&self, f: impl FnOnce(&mut RingStats)) {
        let mut s = self.state.stats.get();
        f(&mut s);
        self.state.stats.set(s);
    }

    /// Whether the ring runs this op (else the pool does).
    fn on_ring(&self, op: &Op) -> bool {
        let code = match op {
            Op::Statx { .. }
            | Op::Fstat {
                file: FileRef::Fd(_),
            } => opcode::Statx::CODE,
            Op::Open { .. } => opcode::OpenAt::CODE,
            Op::Mkdir { .. } => opcode::MkDirAt::CODE,
            Op::Symlink { .. } => opcode::SymlinkAt::CODE,
            Op::Link { .. } => opcode::LinkAt::CODE,
            Op::Rename { .. } => opcode::RenameAt::CODE,
            Op::Unlink { .. } => opcode::UnlinkAt::CODE,
            Op::FSetXattr { .. } => opcode::FSetXattr::CODE,
            Op::Write { .. } => opcode::Write::CODE,
            Op::Read { .. } => opcode::Read::CODE,
            Op::Fsync { .. } => opcode::Fsync::CODE,
            Op::Close {
                file: FileRef::Fixed(_) | FileRef::Chain,
            } => opcode::Close::CODE,
            Op::Fallocate { .. } => opcode::Fallocate::CODE,
            _ => return false,
        };
        self.state.supported.contains(&code)
    }

    /// The registered personality for `creds`, registering it on first use.
    fn personality(&self, creds: &Creds) -> Result<Option<u16>, Errno> {
        if creds.uid == 0 {
            return Ok(None);
        }
        let key = (creds.uid, creds.gid, creds.groups.as_slice().to_vec());
        if let Some(id) = self.state.personalities.borrow_mut().get(&key) {
            return Ok(Some(*id));
        }
        let id = {
            let _as = crate::creds::ActAs::new(creds)?;
            self.state
                .ring
                .borrow()
                .submitter()
                .register_personality()
                .map_err(|e| io_errno(&e))?
        };
        if let Some((_, old)) = self.state.personalities.borrow_mut().push(key, id)
            && old != id
        {
            // SQEs pushed this turn may still name it: unregister after the next submit.
            self.state.retired.borrow_mut().push(old);
        }
        Ok(Some(id))
    }

    /// Pushes one segment of ring steps as a linked chain and waits for all its CQEs.
    async fn ring_segment(&self, mut steps: Vec<Step>) -> Vec<StepResult> {
        let n = steps.len();
        // Direct descriptors for fixed opens; later steps' `Chain` files name that slot.
        let mut fixed = vec![None; n];
        let mut chain_slot = None;
        for (i, step) in steps.iter_mut().enumerate() {
            if let Op::Open { fixed: true, .. } = step.op {
                chain_slot = self.state.fixed_free.borrow_mut().pop();
                fixed[i] = chain_slot;
                if chain_slot.is_none() {
                    // No free slot: nothing runs, as the kernel would refuse at a full table.
                    self.release_slots(&fixed);
                    return fail_all(n, Errno::NFILE);
                }
            } else if let Some(slot) = chain_slot {
                step.op.resolve_chain_file(Some(&FileRef::Fixed(slot)));
            }
        }
        let mut personalities = Vec::with_capacity(n);
        for step in &steps {
            match &step.who {
                Who::Brick => personalities.push(None),
                Who::Caller(creds) => match self.personality(creds) {
                    Ok(p) => personalities.push(p),
                    Err(e) => {
                        self.release_slots(&fixed);
                        return fail_all(n, e);
                    }
                },
            }
        }
        let bufs = steps.iter().map(|s| match &s.op {
            Op::Statx { .. } | Op::Fstat { .. } => {
                // SAFETY: `libc::statx` is plain old data; all-zero is a valid value.
                Buf::Statx(Box::new(unsafe { std::mem::zeroed() }))
            }
            Op::Read { len, .. } => Buf::Read(vec![0u8; *len]),
            _ => Buf::None,
        });
        let slot = ChainSlot {
            bufs: bufs.collect(),
            fixed,
            results: vec![None; n],
            remaining: n,
            waker: None,
            abandoned: false,
            steps,
        };
        let key = self.state.chains.borrow_mut().insert(slot);
        {
            let mut chains = self.state.chains.borrow_mut();
            let slot = &mut chains[key];
            let entries: Vec<squeue::Entry> = (0..n)
                .map(|i| {
                    let mut e = sqe(&slot.steps[i].op, &mut slot.bufs[i], slot.fixed[i])
                        .user_data((key as u64) << 16 | i as u64);
                    if i + 1 < n {
                        // Only a barrier breaks the chain (see `step`); a hard link keeps
                        // going after any result, a plain link stops after a failed open.
                        let stops = slot.steps[i].barrier;
                        e = e.flags(if stops {
                            squeue::Flags::IO_LINK
                        } else {
                            squeue::Flags::IO_HARDLINK
                        });
                    }
                    if let Some(p) = personalities[i] {
                        e = e.personality(p);
                    }
                    e
                })
                .collect();
            let mut ring = self.state.ring.borrow_mut();
            let room = {
                let sq = ring.submission();
                sq.capacity() - sq.len()
            };
            if room < n {
                // Full: submit what is queued first. A chain never spans two submissions'
                // boundaries because it is pushed whole below.
                let _ = ring.submit();
                self.bump(|s| s.enters += 1);
            }
            // SAFETY: every pointer in `entries` (names, buffers, statx structs) points into
            // `slot`, which stays in the slab, unmoved, until its last CQE has arrived; fds
            // named by the steps are kept open by the `Arc`s the steps hold.
            if unsafe { ring.submission().push_multiple(&entries) }.is_err() {
                drop(ring);
                drop(chains);
                let slot = self.state.chains.borrow_mut().remove(key);
                self.release_slots(&slot.fixed);
                return fail_all(n, Errno::AGAIN);
            }
        }
        self.bump(|s| {
            s.sqes += n as u64;
            s.chains += 1;
        });
        crate::profile::charge(|c| c.sqes += n as u64);
        self.schedule_submit();
        let (steps, bufs, fixed, results) = ChainWait {
            state: self.state.clone(),
            key,
            done: false,
        }
        .await;
        let mut out = Vec::with_capacity(n);
        for (i, ((step, buf), res)) in steps.into_iter().zip(bufs).zip(results).enumerate() {
            out.push(
                self.complete(step, buf, fixed[i], res.unwrap_or(-libc::ECANCELED))
                    .await,
            );
        }
        out
    }

    /// Turns one CQE result into a step result, releasing or recording direct descriptors.
    async fn complete(&self, step: Step, buf: Buf, fixed: Option<u32>, res: i32) -> StepResult {
        if res < 0 {
            if let Some(slot) = fixed {
                self.state.fixed_free.borrow_mut().push(slot);
            }
            return Err(Errno::from_raw_os_error(-res));
        }
        let n = res.cast_unsigned();
        match (step.op, buf) {
            (Op::Statx { .. } | Op::Fstat { .. }, Buf::Statx(st)) => {
                Ok(Done::Stat(stat_from_libc(&st)))
            }
            (Op::Open { .. }, _) => Ok(Done::Opened(match fixed {
                Some(slot) => FileRef::Fixed(slot),
                // SAFETY: a successful non-fixed OPENAT returns a new fd that nothing else
                // owns; it is wrapped exactly once.
                None => FileRef::Fd(Arc::new(unsafe { OwnedFd::from_raw_fd(res) })),
            })),
            (Op::Read { .. }, Buf::Read(mut data)) => {
                data.truncate(n as usize);
                Ok(Done::Data(Bytes::from(data)))
            }
            (Op::Write { file, offset, data }, _) if (n as usize) < data.len() => {
                // A short write (rare on local files): finish it with plain pwrite.
                let done = n as usize;
                match file {
                    FileRef::Fd(fd) => {
                        let rest = super::blocking::run_step(Step::brick(Op::Write {
                            file: FileRef::Fd(fd),
                            offset: offset + done as u64,
                            data: data.slice(done..),
                        }));
                        rest.map(|d| match d {
                            Done::Value(more) => Done::Value(done as u64 + more),
                            other => other,
                        })
                    }
                    _ => Err(Errno::NOSPC),
                }
            }
            (
                Op::Close {
                    file: FileRef::Fixed(slot),
                },
                _,
            ) => {
                self.state.fixed_free.borrow_mut().push(slot);
                Ok(Done::Value(0))
            }
            _ => Ok(Done::Value(u64::from(n))),
        }
    }

    fn release_slots(&self, fixed: &[Option<u32>]) {
        self.state
            .fixed_free
            .borrow_mut()
            .extend(fixed.iter().flatten());
    }

    fn schedule_submit(&self) {
        Self::reschedule(&self.state);
    }

    /// Makes sure one submit task is queued behind this turn's ready tasks.
    fn reschedule(state: &Rc<RingState>) {
        if state.submit_scheduled.replace(true) {
            return;
        }
        let state = state.clone();
        tokio::task::spawn_local(async move {
            // Runs after the tasks already ready in this turn, so their chains share one
            // io_uring_enter.
            state.submit_scheduled.set(false);
            let mut ring = state.ring.borrow_mut();
            let submitted = ring.submit();
            let mut s = state.stats.get();
            s.enters += 1;
            state.stats.set(s);
            if let Err(e) = submitted {
                tracing::error!(error = %e, "io_uring_enter failed");
            }
            // The kernel has taken the credentials of every submitted SQE: personalities
            // evicted meanwhile can go now.
            for id in state.retired.borrow_mut().drain(..) {
                let _ = ring.submitter().unregister_personality(id);
            }
            let left = !ring.submission().is_empty();
            drop(ring);
            if left {
                // Submission stopped early (a full completion queue): try again next turn.
                UringExec::reschedule(&state);
            }
        });
    }
}

/// The result of a segment that never reached the kernel: every step failed with `e`.
fn fail_all(n: usize, e: Errno) -> Vec<StepResult> {
    (0..n).map(|_| Err(e)).collect()
}

fn io_errno(e: &std::io::Error) -> Errno {
    Errno::from_io_error(e).unwrap_or(Errno::IO)
}

/// Builds the SQE for one op.
fn sqe(op: &Op, buf: &mut Buf, fixed_slot: Option<u32>) -> squeue::Entry {
    let fd = |f: &FileRef| -> types::Fixed {
        match f {
            FileRef::Fixed(s) => types::Fixed(*s),
            _ => types::Fixed(u32::MAX),
        }
    };
    let stx = |b: &mut Buf| -> *mut types::statx {
        match b {
            Buf::Statx(st) => (&raw mut **st).cast(),
            _ => std::ptr::null_mut(),
        }
    };
    let mask = libc::STATX_BASIC_STATS | libc::STATX_BTIME;
    match op {
        Op::Statx {
            dir,
            name,
            nofollow,
        } => {
            let flags = libc::AT_STATX_SYNC_AS_STAT
                | if *nofollow {
                    libc::AT_SYMLINK_NOFOLLOW
                } else {
                    0
                };
            opcode::Statx::new(types::Fd(raw(dir)), name.as_ptr(), stx(buf))
                .flags(flags)
                .mask(mask)
                .build()
        }
        Op::Fstat {
            file: FileRef::Fd(f),
        } => opcode::Statx::new(types::Fd(f.as_raw_fd()), c"".as_ptr(), stx(buf))
            .flags(libc::AT_EMPTY_PATH)
            .mask(mask)
            .build(),
        Op::Open {
            dir,
            name,
            flags,
            mode,
            ..
        } => {
            let open = opcode::OpenAt::new(types::Fd(raw(dir)), name.as_ptr()).mode(*mode);
            match fixed_slot.and_then(|s| types::DestinationSlot::try_from_slot_target(s).ok()) {
                // O_CLOEXEC and a direct descriptor do not mix (EINVAL).
                Some(slot) => open
                    .flags(*flags & !libc::O_CLOEXEC)
                    .file_index(Some(slot))
                    .build(),
                None => open.flags(*flags | libc::O_CLOEXEC).build(),
            }
        }
        Op::Mkdir { dir, name, mode } => opcode::MkDirAt::new(types::Fd(raw(dir)), name.as_ptr())
            .mode(*mode)
            .build(),
        Op::Symlink { target, dir, name } => {
            opcode::SymlinkAt::new(types::Fd(raw(dir)), target.as_ptr(), name.as_ptr()).build()
        }
        Op::Link {
            old_dir,
            old_name,
            new_dir,
            new_name,
        } => opcode::LinkAt::new(
            types::Fd(raw(old_dir)),
            old_name.as_ptr(),
            types::Fd(raw(new_dir)),
            new_name.as_ptr(),
        )
        .build(),
        Op::Rename {
            old_dir,
            old_name,
            new_dir,
            new_name,
            flags,
        } => opcode::RenameAt::new(
            types::Fd(raw(old_dir)),
            old_name.as_ptr(),
            types::Fd(raw(new_dir)),
            new_name.as_ptr(),
        )
        .flags(*flags)
        .build(),
        Op::Unlink {
            dir,
            name,
            dir_flag,
        } => {
            let flags = if *dir_flag { libc::AT_REMOVEDIR } else { 0 };
            opcode::UnlinkAt::new(types::Fd(raw(dir)), name.as_ptr())
                .flags(flags)
                .build()
        }
        Op::FSetXattr {
            file,
            name,
            value,
            flags,
        } => {
            let len = u32::try_from(value.len()).unwrap_or(u32::MAX);
            match file {
                FileRef::Fd(f) => opcode::FSetXattr::new(
                    types::Fd(f.as_raw_fd()),
                    name.as_ptr(),
                    value.as_ptr().cast(),
                    len,
                ),
                other => {
                    opcode::FSetXattr::new(fd(other), name.as_ptr(), value.as_ptr().cast(), len)
                }
            }
            .flags(*flags)
            .build()
        }
        Op::Write { file, offset, data } => {
            let len = u32::try_from(data.len()).unwrap_or(u32::MAX);
            match file {
                FileRef::Fd(f) => opcode::Write::new(types::Fd(f.as_raw_fd()), data.as_ptr(), len),
                other => opcode::Write::new(fd(other), data.as_ptr(), len),
            }
            .offset(*offset)
            .build()
        }
        Op::Read { file, offset, .. } => {
            let (ptr, len) = match buf {
                Buf::Read(v) => (v.as_mut_ptr(), u32::try_from(v.len()).unwrap_or(u32::MAX)),
                _ => (std::ptr::null_mut(), 0),
            };
            match file {
                FileRef::Fd(f) => opcode::Read::new(types::Fd(f.as_raw_fd()), ptr, len),
                other => opcode::Read::new(fd(other), ptr, len),
            }
            .offset(*offset)
            .build()
        }
        Op::Fsync { file, datasync } => {
            let flags = if *datasync {
                types::FsyncFlags::DATASYNC
            } else {
                types::FsyncFlags::empty()
            };
            match file {
                FileRef::Fd(f) => opcode::Fsync::new(types::Fd(f.as_raw_fd())),
                other => opcode::Fsync::new(fd(other)),
            }
            .flags(flags)
            .build()
        }
        Op::Fallocate {
            file,
            mode,
            offset,
            len,
        } => match file {
            FileRef::Fd(f) => opcode::Fallocate::new(types::Fd(f.as_raw_fd()), *len),
            other => opcode::Fallocate::new(fd(other), *len),
        }
        .offset(*offset)
        .mode(*mode)
        .build(),
        Op::Close { file } => opcode::Close::new(fd(file)).build(),
        // Never reached: `on_ring` sends everything else to the pool.
        Op::Fstat { .. } | Op::Mknod { .. } | Op::SetXattrAt { .. } => opcode::Nop::new().build(),
    }
}

fn stat_from_libc(s: &libc::statx) -> Stat {
    crate::step::stat_from_statx!(s)
}

/// Waits for every CQE of one chain; if dropped early, leaves the chain to the driver.
struct ChainWait {
    state: Rc<RingState>,
    key: usize,
    done: bool,
}

type ChainOutput = (Vec<Step>, Vec<Buf>, Vec<Option<u32>>, Vec<Option<i32>>);

impl Future for ChainWait {
    type Output = ChainOutput;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<ChainOutput> {
        let mut chains = self.state.chains.borrow_mut();
        let slot = &mut chains[self.key];
        if slot.remaining > 0 {
            slot.waker = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let slot = chains.remove(self.key);
        drop(chains);
        self.done = true;
        Poll::Ready((slot.steps, slot.bufs, slot.fixed, slot.results))
    }
}

impl Drop for ChainWait {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut chains = self.state.chains.borrow_mut();
        if chains[self.key].remaining == 0 {
            chains.remove(self.key);
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
async fn drive(state: Rc<RingState>, fd: AsyncFd<RingFd>) {
    loop {
        let mut guard = match fd.readable().await {
            Ok(g) => g,
            Err(e) => {
                tracing::error!(error = %e, "io_uring completion driver stopped");
                return;
            }
        };
        let mut ring = state.ring.borrow_mut();
        let mut chains = state.chains.borrow_mut();
        let cqes: Vec<(u64, i32)> = ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (user_data, result) in cqes {
            let key = (user_data >> 16) as usize;
            let index = (user_data & 0xffff) as usize;
            let Some(slot) = chains.get_mut(key) else {
                continue;
            };
            slot.results[index] = Some(result);
            slot.remaining -= 1;
            if slot.remaining == 0 {
                if slot.abandoned {
                    let slot = chains.remove(key);
                    // Files opened by an abandoned chain are closed with it.
                    for (i, step) in slot.steps.iter().enumerate() {
                        let (Op::Open { .. }, Some(r)) = (&step.op, slot.results[i]) else {
                            continue;
                        };
                        match slot.fixed[i] {
                            Some(s) => {
                                if r >= 0 {
                                    let _ = ring.submitter().register_files_update(s, &[-1]);
                                }
                                state.fixed_free.borrow_mut().push(s);
                            }
                            // SAFETY: a successful non-fixed OPENAT returned a new fd that no
                            // one else owns (its fop is gone); it is closed exactly once here.
                            None if r >= 0 => drop(unsafe { OwnedFd::from_raw_fd(r) }),
                            None => {}
                        }
                    }
                } else if let Some(w) = slot.waker.take() {
                    w.wake();
                }
            }
        }
        drop(chains);
        drop(ring);
        guard.clear_ready();
    }
}

/// Stats of names and fds run inline on the worker thread: on a warm dentry cache `statx`
/// takes about a microsecond, while the ring punts it to an io-wq thread and back (measured:
/// a LOOKUP at queue depth 1 went from 127 µs to a fraction of that). A stat at the start or
/// the end of a chain runs inline; one between ring steps stays in the ring, so a chain is
/// still one submission.
fn runs_inline(op: &Op) -> bool {
    matches!(
        op,
        Op::Statx { .. }
            | Op::Fstat {
                file: FileRef::Fd(_)
            }
            | Op::Close {
                file: FileRef::Fd(_)
            }
    )
}

impl Exec for UringExec {
    async fn run(&self, steps: Vec<Step>) -> Vec<StepResult> {
        let n = steps.len();
        // From here on every step runs inline.
        let tail = steps
            .iter()
            .rposition(|s| !runs_inline(&s.op))
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
            let mut segment = Vec::new();
            while let Some(step) = rest.peek_mut() {
                if let Some(file) = &opened {
                    step.op.resolve_chain_file(Some(file));
                }
                let index = out.len() + segment.len();
                let inline = runs_inline(&step.op) && (segment.is_empty() || index >= tail);
                if inline || !self.on_ring(&step.op) {
                    break;
                }
                let Some(step) = rest.next() else { break };
                // A plain fd is known only once its open completes, and only an open's failure
                // cancels linked SQEs: end the submission there, and after any other barrier.
                let ends = matches!(step.op, Op::Open { fixed: false, .. })
                    || (step.barrier && !matches!(step.op, Op::Open { .. }));
                segment.push(step);
                if ends {
                    break;
                }
            }
            let (results, barriers) = if segment.is_empty() {
                let Some(step) = rest.next() else { break };
                let barrier = step.barrier;
                let result = if runs_inline(&step.op) {
                    super::blocking::run_step(step)
                } else {
                    self.bump(|s| s.pool_jobs += 1);
                    crate::profile::charge(|c| c.pool_jobs += 1);
                    self.pool.run(move || super::blocking::run_step(step)).await
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
        self.bump(|s| s.pool_jobs += 1);
        crate::profile::charge(|c| c.pool_jobs += 1);
        self.pool.run(work).await
    }
}
