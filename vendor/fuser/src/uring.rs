//! FUSE over io_uring (Linux 6.14 and later; added to this copy of fuser for Kiln).
//!
//! With the `fuse` module's `enable_uring` on and `FUSE_OVER_IO_URING` negotiated at INIT,
//! the kernel hands requests to the server through io_uring instead of `read(2)` on
//! `/dev/fuse`: one queue per possible CPU, and a request goes to the queue of the CPU its
//! caller runs on. Each queue here is a thread pinned to that CPU with a ring of its own, so a
//! request is taken, and answered when the answer is known at once, on the CPU that made it:
//! the caller's wake-up is a local one rather than a cross-CPU one.
//!
//! Each queue entry is a header buffer (`struct fuse_uring_req_header`) and a payload buffer,
//! registered with `FUSE_IO_URING_CMD_REGISTER`; the command completes when a request is in
//! them. The reply is written into the same buffers and sent with
//! `FUSE_IO_URING_CMD_COMMIT_AND_FETCH`, which also waits for the entry's next request. The
//! request's first argument (the operation's fixed header) arrives in `op_in`, the rest in
//! the payload; they are put back together here into the layout `read(2)` gives, so the
//! parser and dispatch are the same as on the device. A reply may be sent from any thread:
//! pushes to a queue's submission ring are serialized by a lock, and only the queue's thread
//! submits (another thread's push wakes it through an eventfd), so the kernel's per-entry
//! work always runs on the queue's CPU.
//!
//! FORGETs, INTERRUPTs and notifications still travel through `/dev/fuse`, so the session's
//! device reader keeps running beside the queues.

use std::alloc::Layout;
use std::io;
use std::io::IoSlice;
use std::os::fd::AsFd;
use std::os::fd::AsRawFd;
use std::os::fd::FromRawFd;
use std::os::fd::OwnedFd;
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;

use io_uring::IoUring;
use io_uring::opcode;
use io_uring::squeue;
use io_uring::types;
use log::error;
use log::warn;

use crate::Filesystem;
use crate::channel::Channel;
use crate::channel::ChannelSender;
use crate::ll::fuse_abi::fuse_opcode;
use crate::request::ReplyTo;
use crate::request::RequestWithSender;
use crate::session::SessionEventLoop;

/// Entries per queue: requests one CPU's callers may have with the server at once before
/// the kernel queues more.
const QUEUE_DEPTH: usize = 16;
/// `FUSE_IO_URING_CMD_REGISTER`: register an entry's buffers and wait for a request.
const CMD_REGISTER: u32 = 1;
/// `FUSE_IO_URING_CMD_COMMIT_AND_FETCH`: send the reply in an entry and wait for the next.
const CMD_COMMIT_AND_FETCH: u32 = 2;
/// `sizeof(struct fuse_in_header)`.
const IN_HEADER_BYTES: usize = 40;
/// `sizeof(struct fuse_out_header)`.
const OUT_HEADER_BYTES: usize = 16;
/// `struct fuse_uring_req_header`: `in_out[128]`, `op_in[128]`, `fuse_uring_ent_in_out`.
const OP_IN_OFFSET: usize = 128;
const OP_IN_BYTES: usize = 128;
const ENT_IN_OUT_OFFSET: usize = 256;
const HEADER_BYTES: usize = 288;
/// Header buffers are a page: the kernel may pin them.
const HEADER_ALLOC_BYTES: usize = 4096;
/// The user data of the read of the queue's wake-up eventfd.
const WAKE: u64 = u64::MAX;
/// The smallest payload buffer the kernel accepts (`FUSE_MIN_READ_BUFFER`).
const PAYLOAD_MIN_BYTES: usize = 8192;

std::thread_local! {
    /// The queue the current thread serves (null on any other thread).
    static SERVING: std::cell::Cell<*const Queue> = const { std::cell::Cell::new(std::ptr::null()) };
}

/// `IORING_ENTER_GETEVENTS`: wait for completions.
const IORING_ENTER_GETEVENTS: u32 = 1;

const _: () = assert!(size_of::<squeue::Entry128>() == 128);

/// A page-aligned buffer the kernel reads and writes between a command's submission and its
/// completion; the queue owns it otherwise.
#[derive(Debug)]
struct Buffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is plain memory; who may touch it when is the entry protocol's rule
// (the kernel between submit and completion, the request's one reply in between).
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

impl Buffer {
    fn new(len: usize) -> io::Result<Buffer> {
        let layout = Self::layout(len)?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| io::Error::from(io::ErrorKind::OutOfMemory))?;
        Ok(Buffer { ptr, len })
    }

    fn layout(len: usize) -> io::Result<Layout> {
        Layout::from_size_align(len.max(1), 4096).map_err(io::Error::other)
    }

    /// The buffer's bytes.
    ///
    /// # Safety
    /// The kernel must not be writing to the buffer (its command has completed).
    unsafe fn bytes(&self) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// Copies `src` into the buffer at `at`.
    ///
    /// # Safety
    /// The kernel must not be using the buffer, and no one else may touch this range.
    unsafe fn write(&self, at: usize, src: &[u8]) {
        assert!(at + src.len() <= self.len, "write past the buffer's end");
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(at), src.len());
        }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let layout = Self::layout(self.len).expect("made from this layout");
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

/// One queue entry: its two buffers and the request it holds.
#[derive(Debug)]
struct Entry {
    header: Buffer,
    payload: Buffer,
    /// The iovecs `FUSE_IO_URING_CMD_REGISTER` points at.
    iov: [libc::iovec; 2],
    /// The kernel's id of the request in the entry (zero before the first).
    commit_id: AtomicU64,
}

// SAFETY: the iovecs only point at the entry's own buffers.
unsafe impl Send for Entry {}
unsafe impl Sync for Entry {}

impl Entry {
    fn new(payload_bytes: usize) -> io::Result<Entry> {
        let header = Buffer::new(HEADER_ALLOC_BYTES)?;
        let payload = Buffer::new(payload_bytes)?;
        let iov = [
            libc::iovec {
                iov_base: header.ptr.as_ptr().cast(),
                iov_len: HEADER_BYTES,
            },
            libc::iovec {
                iov_base: payload.ptr.as_ptr().cast(),
                iov_len: payload.len,
            },
        ];
        Ok(Entry {
            header,
            payload,
            iov,
            commit_id: AtomicU64::new(0),
        })
    }
}

/// One CPU's queue: its ring, its entries and the way to wake its thread.
pub(crate) struct Queue {
    qid: u16,
    ring: IoUring<squeue::Entry128>,
    /// Serializes pushes to the submission ring (the queue's thread and every replier).
    submitting: Mutex<()>,
    entries: Box<[Entry]>,
    device: ChannelSender,
    device_fd: RawFd,
    /// An eventfd the queue's thread always has a read on: written to have it submit what
    /// another thread pushed, or to stop.
    wake: OwnedFd,
    /// Where that read puts the eventfd's count.
    wake_count: Buffer,
    stopping: AtomicBool,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue").field("qid", &self.qid).finish_non_exhaustive()
    }
}

impl Queue {
    fn new(qid: u16, ch: &Channel, payload_bytes: usize) -> io::Result<Queue> {
        let entries = (0..QUEUE_DEPTH)
            .map(|_| Entry::new(payload_bytes))
            .collect::<io::Result<Box<[Entry]>>>()?;
        let ring = IoUring::<squeue::Entry128>::builder()
            .setup_cqsize((QUEUE_DEPTH as u32 + 1) * 2)
            .build((QUEUE_DEPTH as u32 + 1).next_power_of_two())?;
        // SAFETY: eventfd(2) returns a new descriptor or -1.
        let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if wake < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Queue {
            qid,
            ring,
            submitting: Mutex::new(()),
            entries,
            device: ch.sender(),
            device_fd: ch.as_fd().as_raw_fd(),
            // SAFETY: a new descriptor this queue now owns.
            wake: unsafe { OwnedFd::from_raw_fd(wake) },
            wake_count: Buffer::new(8)?,
            stopping: AtomicBool::new(false),
        })
    }

    /// Pushes `sqe` for the queue's thread to submit with its next wait. A reply made while
    /// dispatching thus costs no system call of its own, and the thread goes to sleep in the
    /// call that wakes the requester. Another thread (a reply from the runtime) wakes the
    /// queue's thread to submit it: an entry's command is always the queue thread's, so the
    /// kernel's work for the entry's next request runs on that thread, not on whichever
    /// thread happened to answer the last one.
    fn push(&self, sqe: &squeue::Entry128) -> io::Result<()> {
        let _pushing = self.submitting.lock().unwrap_or_else(|e| e.into_inner());
        {
            // SAFETY: every push holds `submitting`, so no other submission-queue borrow is
            // live; the SQE's buffers live as long as the queue.
            let mut sq = unsafe { self.ring.submission_shared() };
            unsafe { sq.push(sqe) }.map_err(|_| io::Error::other("io_uring queue full"))?;
        }
        if !SERVING.with(|serving| std::ptr::eq(serving.get(), self)) {
            self.wake();
        }
        Ok(())
    }

    /// Wakes the queue's thread.
    fn wake(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to an eventfd this queue owns.
        let _ = unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// Reads the wake-up eventfd (again).
    fn arm_wake(&self) -> io::Result<()> {
        let read = opcode::Read::new(types::Fd(self.wake.as_raw_fd()), self.wake_count.ptr.as_ptr(), 8)
            .build()
            .user_data(WAKE);
        self.push(&read.into())
    }

    /// Submits what the queue's thread pushed and waits for at least one completion.
    fn submit_and_wait(&self) -> io::Result<()> {
        let pending = {
            let _pushing = self.submitting.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: as in `push`.
            unsafe { self.ring.submission_shared() }.len() as u32
        };
        // SAFETY: no arguments; SQEs pushed meanwhile by other threads are complete entries
        // (the tail moves after them), which their own submit then finds taken.
        let entered = unsafe {
            self.ring
                .submitter()
                .enter::<libc::sigset_t>(pending, 1, IORING_ENTER_GETEVENTS, None)
        };
        match entered {
            Err(e) if e.raw_os_error() != Some(libc::EINTR) => Err(e),
            _ => Ok(()),
        }
    }

    /// The command for entry `index` with `cmd_op`, `struct fuse_uring_cmd_req` as its data.
    fn command(&self, index: usize, cmd_op: u32, commit_id: u64) -> squeue::Entry128 {
        let mut cmd = [0u8; 80];
        cmd[8..16].copy_from_slice(&commit_id.to_ne_bytes());
        cmd[16..18].copy_from_slice(&self.qid.to_ne_bytes());
        opcode::UringCmd80::new(types::Fd(self.device_fd), cmd_op)
            .cmd(cmd)
            .addr(Some(self.entries[index].iov.as_ptr() as u64))
            .build()
            .user_data(index as u64)
    }

    /// Registers entry `index` (or registers it again after an interrupted command).
    fn register(&self, index: usize) -> io::Result<()> {
        let sqe = with_len(self.command(index, CMD_REGISTER, 0), 2);
        self.push(&sqe)
    }

    /// Sends the reply in entry `index` and waits there for the next request.
    fn commit(&self, index: usize) -> io::Result<()> {
        let commit_id = self.entries[index].commit_id.load(Ordering::Acquire);
        self.push(&self.command(index, CMD_COMMIT_AND_FETCH, commit_id))
    }

    /// Registers every entry and the read of the wake-up eventfd (on the queue's thread,
    /// submitted by its first wait).
    fn start(&self) -> io::Result<()> {
        for index in 0..self.entries.len() {
            self.register(index)?;
        }
        self.arm_wake()
    }

    /// Has the queue's thread end.
    fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        self.wake();
    }

    /// The queue's thread: waits for requests and dispatches each one, until stopped or the
    /// connection ends.
    fn serve<FS: Filesystem>(self: &Arc<Queue>, se: &SessionEventLoop<FS>) -> io::Result<()> {
        pin_to_cpu(self.qid);
        SERVING.with(|serving| serving.set(Arc::as_ptr(self)));
        self.start()?;
        let mut request = vec![0u64; (IN_HEADER_BYTES + OP_IN_BYTES + self.payload_bytes()) / 8 + 1];
        let mut done = Vec::with_capacity(QUEUE_DEPTH + 1);
        loop {
            self.submit_and_wait()?;
            // SAFETY: only this thread reads the completion ring.
            done.extend(unsafe { self.ring.completion_shared() }.map(|c| (c.user_data(), c.result())));
            for (user_data, result) in done.drain(..) {
                if user_data == WAKE {
                    if self.stopping.load(Ordering::Acquire) {
                        return Ok(());
                    }
                    self.arm_wake()?;
                    continue;
                }
                let index = user_data as usize;
                match -result {
                    ok if ok <= 0 => self.dispatch(index, se, &mut request),
                    libc::EAGAIN | libc::EINTR => self.again(index)?,
                    // The connection ended (unmount or abort).
                    libc::ENOTCONN | libc::ECONNABORTED | libc::ENODEV => return Ok(()),
                    errno => self.failed(index, io::Error::from_raw_os_error(errno))?,
                }
            }
        }
    }

    fn payload_bytes(&self) -> usize {
        self.entries[0].payload.len
    }

    /// Entry `index`'s command failed. A refused registration ends the queue (the kernel
    /// then never switches to io_uring, and the device serves); a refused commit loses that
    /// reply, and the entry is registered anew so the queue keeps all its entries.
    fn failed(&self, index: usize, e: io::Error) -> io::Result<()> {
        let entry = &self.entries[index];
        if entry.commit_id.swap(0, Ordering::AcqRel) == 0 {
            return Err(e);
        }
        error!("FUSE io_uring queue {}: a reply was refused: {e}", self.qid);
        self.register(index)
    }

    /// Sends an interrupted command of entry `index` again.
    fn again(&self, index: usize) -> io::Result<()> {
        if self.entries[index].commit_id.load(Ordering::Acquire) == 0 {
            self.register(index)
        } else {
            self.commit(index)
        }
    }

    /// Puts the request in entry `index` back into `read(2)`'s layout in `scratch` and
    /// dispatches it; a request that does not parse is answered EIO.
    fn dispatch<FS: Filesystem>(
        self: &Arc<Queue>,
        index: usize,
        se: &SessionEventLoop<FS>,
        scratch: &mut [u64],
    ) {
        let entry = &self.entries[index];
        let reply = || RingReply {
            queue: self.clone(),
            index,
        };
        // SAFETY: the entry's command completed: the kernel is done with its buffers.
        let (header, payload) = unsafe { (entry.header.bytes(), entry.payload.bytes()) };
        let unique = u64::from_ne_bytes(header[8..16].try_into().expect("8 bytes"));
        let commit_id = u64::from_ne_bytes(
            header[ENT_IN_OUT_OFFSET + 8..ENT_IN_OUT_OFFSET + 16]
                .try_into()
                .expect("8 bytes"),
        );
        entry.commit_id.store(commit_id, Ordering::Release);
        let Some(len) = assemble(header, payload, scratch) else {
            error!("io_uring request {unique} does not fit its layout");
            reply().error(unique, libc::EIO);
            return;
        };
        // SAFETY: `scratch` is a live, initialized `u64` buffer; viewed as its bytes.
        let bytes =
            unsafe { std::slice::from_raw_parts(scratch.as_ptr().cast::<u8>(), scratch.len() * 8) };
        match RequestWithSender::replying_to(ReplyTo::Ring(reply()), &bytes[..len]) {
            Some(req) => req.dispatch(se),
            None => return reply().error(unique, libc::EIO),
        }
        // A request the file system answers nothing still holds its entry until committed,
        // and its sender waits until then: the kernel sends a FORGET as a request of its own
        // when READDIRPLUS cannot link an entry it returned, from inside the listing.
        let opcode = u32::from_ne_bytes(header[4..8].try_into().expect("4 bytes"));
        if takes_no_reply(opcode) {
            reply().error(unique, 0);
        }
    }
}

/// Whether requests of `opcode` get no reply from the file system (`FUSE_FORGET`,
/// `FUSE_BATCH_FORGET`).
fn takes_no_reply(opcode: u32) -> bool {
    opcode == fuse_opcode::FUSE_FORGET as u32 || opcode == fuse_opcode::FUSE_BATCH_FORGET as u32
}

/// Copies a request's in-header, operation header and payload into `scratch`, one after the
/// other as `read(2)` gives them; returns the request's length, or `None` when the lengths
/// the kernel wrote do not add up.
fn assemble(header: &[u8], payload: &[u8], scratch: &mut [u64]) -> Option<usize> {
    let len = u32::from_ne_bytes(header[0..4].try_into().expect("4 bytes")) as usize;
    let payload_len = u32::from_ne_bytes(
        header[ENT_IN_OUT_OFFSET + 16..ENT_IN_OUT_OFFSET + 20]
            .try_into()
            .expect("4 bytes"),
    ) as usize;
    let op_len = len.checked_sub(IN_HEADER_BYTES + payload_len)?;
    if op_len > OP_IN_BYTES || payload_len > payload.len() || len > scratch.len() * 8 {
        return None;
    }
    // SAFETY: viewing a `u64` buffer as bytes; `len` fits, checked above.
    let out = unsafe { std::slice::from_raw_parts_mut(scratch.as_mut_ptr().cast::<u8>(), len) };
    out[..IN_HEADER_BYTES].copy_from_slice(&header[..IN_HEADER_BYTES]);
    out[IN_HEADER_BYTES..IN_HEADER_BYTES + op_len]
        .copy_from_slice(&header[OP_IN_OFFSET..OP_IN_OFFSET + op_len]);
    out[IN_HEADER_BYTES + op_len..].copy_from_slice(&payload[..payload_len]);
    Some(len)
}

/// Sets the SQE's `len` field, which `UringCmd80` has no setter for; REGISTER's is the
/// number of iovecs.
fn with_len(sqe: squeue::Entry128, len: u32) -> squeue::Entry128 {
    // SAFETY: `Entry128` is `repr(C)`: a 64-byte `io_uring_sqe` (whose `len` is at byte 24)
    // and 64 more bytes; the size is asserted above.
    let mut bytes: [u8; 128] = unsafe { std::mem::transmute(sqe) };
    bytes[24..28].copy_from_slice(&len.to_ne_bytes());
    unsafe { std::mem::transmute(bytes) }
}

/// Runs the calling thread on CPU `cpu` only, so its queue's requests are served where they
/// are made. A CPU that is offline keeps the thread unpinned.
fn pin_to_cpu(cpu: u16) {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET stays within it for cpu < 1024.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if usize::from(cpu) >= 8 * size_of::<libc::cpu_set_t>() {
            return;
        }
        libc::CPU_SET(usize::from(cpu), &mut set);
        if libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) != 0 {
            warn!(
                "io_uring queue {cpu}: not pinned to its CPU: {}",
                io::Error::last_os_error()
            );
        }
    }
}

/// The CPUs the kernel makes queues for (`num_possible_cpus()`).
fn possible_cpus() -> usize {
    std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|list| {
            let last = list.trim().rsplit([',', '-']).next()?;
            last.parse::<usize>().ok().map(|n| n + 1)
        })
        .unwrap_or_else(|| {
            // SAFETY: sysconf has no preconditions.
            let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) };
            usize::try_from(n).unwrap_or(1).max(1)
        })
}

/// Where a request taken from a queue entry is answered.
#[derive(Debug, Clone)]
pub(crate) struct RingReply {
    queue: Arc<Queue>,
    index: usize,
}

impl RingReply {
    /// Writes the reply in `data` (out-header first) into the entry and commits it.
    pub(crate) fn send(&self, data: &[IoSlice<'_>]) -> io::Result<()> {
        let entry = &self.queue.entries[self.index];
        let total: usize = data.iter().map(|s| s.len()).sum();
        if total < OUT_HEADER_BYTES || total - OUT_HEADER_BYTES > entry.payload.len {
            // Answered all the same, or the entry (and its caller) would wait forever.
            let mut head = [0u8; OUT_HEADER_BYTES];
            for (to, from) in head.iter_mut().zip(data.iter().flat_map(|s| s.iter())) {
                *to = *from;
            }
            self.error(u64::from_ne_bytes(head[8..16].try_into().expect("8 bytes")), libc::EIO);
            return Err(io::Error::other(format!(
                "a reply of {total} bytes does not fit an io_uring entry: answered EIO"
            )));
        }
        let mut at = 0;
        for slice in data {
            let mut slice: &[u8] = slice;
            // SAFETY: the entry holds this request until the commit below; one reply each.
            unsafe {
                if at < OUT_HEADER_BYTES {
                    let head = slice.len().min(OUT_HEADER_BYTES - at);
                    entry.header.write(at, &slice[..head]);
                    at += head;
                    slice = &slice[head..];
                }
                entry.payload.write(at - OUT_HEADER_BYTES, slice);
            }
            at += slice.len();
        }
        let payload_len = (total - OUT_HEADER_BYTES) as u32;
        // SAFETY: as above; `payload_sz` of `fuse_uring_ent_in_out`.
        unsafe {
            entry
                .header
                .write(ENT_IN_OUT_OFFSET + 16, &payload_len.to_ne_bytes());
        }
        self.queue.commit(self.index)
    }

    /// Answers request `unique` with `errno` only (0: done, with nothing to say).
    fn error(&self, unique: u64, errno: i32) {
        let mut out = [0u8; OUT_HEADER_BYTES];
        out[0..4].copy_from_slice(&(OUT_HEADER_BYTES as u32).to_ne_bytes());
        out[4..8].copy_from_slice(&(-errno).to_ne_bytes());
        out[8..16].copy_from_slice(&unique.to_ne_bytes());
        if let Err(e) = self.send(&[IoSlice::new(&out)]) {
            error!("io_uring error reply to {unique}: {e}");
        }
    }

    /// The FUSE device, for what only it carries (backing files).
    pub(crate) fn channel(&self) -> &ChannelSender {
        &self.queue.device
    }
}

/// The running queues of a session.
#[derive(Debug)]
pub(crate) struct Rings {
    queues: Vec<Arc<Queue>>,
    threads: Vec<JoinHandle<()>>,
}

impl Rings {
    /// Starts one queue per possible CPU, each serving requests with the session loop
    /// `event_loop` makes. If one cannot start, the ones started are stopped: the kernel only
    /// switches to io_uring once every queue has registered, so the device keeps serving.
    pub(crate) fn start<FS: Filesystem>(
        ch: &Channel,
        payload_bytes: usize,
        event_loop: impl Fn(String) -> SessionEventLoop<FS>,
    ) -> io::Result<Rings> {
        let mut rings = Rings {
            queues: Vec::new(),
            threads: Vec::new(),
        };
        let payload_bytes = payload_bytes.max(PAYLOAD_MIN_BYTES);
        for qid in 0..possible_cpus() {
            if let Err(e) = rings.start_queue(qid, ch, payload_bytes, &event_loop) {
                rings.stop();
                return Err(e);
            }
        }
        Ok(rings)
    }

    /// Starts queue `qid` and its thread.
    fn start_queue<FS: Filesystem>(
        &mut self,
        qid: usize,
        ch: &Channel,
        payload_bytes: usize,
        event_loop: impl Fn(String) -> SessionEventLoop<FS>,
    ) -> io::Result<()> {
        let qid = u16::try_from(qid).map_err(io::Error::other)?;
        let queue = Arc::new(Queue::new(qid, ch, payload_bytes)?);
        let name = format!("fuser-ring-{qid}");
        let se = event_loop(name.clone());
        let serving = queue.clone();
        let thread = std::thread::Builder::new().name(name).spawn(move || {
            if let Err(e) = serving.serve(&se) {
                error!("FUSE io_uring queue {}: {e}", serving.qid);
            }
        });
        self.queues.push(queue);
        self.threads.push(thread?);
        Ok(())
    }

    /// Stops every queue's thread and waits for them.
    pub(crate) fn stop(&mut self) {
        for queue in &self.queues {
            queue.stop();
        }
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

