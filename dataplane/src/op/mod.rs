//! Ops: the single-name system calls a fop is made of, as owned values, each defined in one
//! place — its io_uring SQE, whether it runs inline on the worker, and its plain-syscall form
//! (in the spirit of monoio's `driver/op/*.rs`).
//!
//! A fop builds a chain of [`Step`]s (an op, whose credentials it runs with, and whether it is
//! the fop's commit point); an executor (`crate::exec`) runs the chain — the blocking executor
//! one syscall after another, the io_uring executor as linked SQEs. Steps run in order whatever
//! the result of the one before, except after a failed *barrier* step: then the rest report
//! `ECANCELED` without running. Both executors keep exactly that rule, so a fop's logic is
//! written once. (io_uring cancels a link chain only after a failed open, read or write;
//! namespace and xattr opcodes do not break links, so the ring executor ends a submission after
//! any other barrier.)
//!
//! Ops own their names and buffers and keep the directory fds they use alive, so the ring can
//! hold them until the kernel is done even if the fop went away. Building an SQE is safe code;
//! pushing it (and everything else `unsafe`) happens only in `exec::uring`.
//!
//! Adding an op: a struct and its [`RingOp`] impl in the family's file, and its name in the
//! `ops!` list below.

mod attr;
mod io;
mod namespace;
mod open;
mod stat;
mod xattr;

use std::ffi::{CStr, CString};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use bytes::Bytes;
use io_uring::squeue;
use kiln_wire::{Creds, FileType, Gfid, Iatt, Mode, Timespec};
use rustix::io::Errno;

pub use attr::{SetAttrs, set_attrs};
pub(crate) use io::read_buf;
pub use io::{Fallocate, Fsync, Ftruncate, Read, Write};
pub use namespace::{Link, LinkFile, Mkdir, Mknod, Rename, Symlink, Unlink};
pub use open::{Close, Open};
pub use stat::{Fstat, Statx, lstat_at};
pub use xattr::{FSetXattr, GetXattr, ObjectPath, RemoveXattr, SetXattr, SetXattrAt, read_xattr};

/// A directory fd shared by caches and in-flight steps.
pub type DirFd = Arc<OwnedFd>;

/// An open file as the executor knows it: a plain fd (shared, so an in-flight step keeps it
/// open even if the file is released meanwhile), or a slot in the ring's registered file table
/// (a direct descriptor).
#[derive(Debug, Clone)]
pub enum FileRef {
    Fd(Arc<OwnedFd>),
    Fixed(u32),
    /// The file opened by an earlier `Open` step of the same chain.
    Chain,
}

/// Whose credentials a step runs with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Who {
    /// The brick itself (root): housekeeping under `.glusterfs`, `trusted.*` xattrs.
    Brick,
    /// The caller: every step a local process would have made itself.
    Caller(Creds),
}

/// A step: an op, whose credentials it runs with, and whether its failure stops the chain.
#[derive(Debug)]
pub struct Step {
    pub op: Op,
    pub who: Who,
    pub barrier: bool,
}

impl Step {
    pub fn brick(op: impl Into<Op>) -> Step {
        Step {
            op: op.into(),
            who: Who::Brick,
            barrier: false,
        }
    }

    pub fn caller(op: impl Into<Op>, creds: &Creds) -> Step {
        Step {
            op: op.into(),
            who: Who::Caller(creds.clone()),
            barrier: false,
        }
    }

    /// Marks the commit point: if it fails, the steps after it do not run.
    pub fn barrier(mut self) -> Step {
        self.barrier = true;
        self
    }
}

/// What a step returned.
#[derive(Debug)]
pub enum Done {
    /// No value (mkdir, link, close, …), or a byte count.
    Value(u64),
    Stat(Stat),
    /// A newly opened file.
    Opened(FileRef),
    Data(Bytes),
}

pub type StepResult = Result<Done, Errno>;

/// The buffer the kernel writes an SQE's output into, owned by the chain until its CQE.
#[derive(Debug)]
pub enum Buf {
    None,
    Statx(Box<libc::statx>),
    Read(Vec<u8>),
}

/// Which [`Buf`] an op needs; the ring driver allocates it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufKind {
    None,
    Statx,
    Read(usize),
}

/// What a successful CQE gave an op.
#[derive(Debug)]
pub enum Completion {
    /// The result value (a byte count, or 0).
    Value(u32),
    /// A new plain fd (a non-fixed open), owned from here on.
    Fd(OwnedFd),
    /// A new direct descriptor in this slot (a fixed open).
    Fixed(u32),
}

/// What an op made of its CQE.
#[derive(Debug)]
pub enum Completed {
    Done(StepResult),
    /// Only part was done (a short write): `done` so far, and the op that finishes the rest,
    /// run by the executor as the same caller.
    Partial {
        done: u64,
        rest: Op,
    },
}

/// One op's definition: everything an executor needs to run it.
pub trait RingOp: Sized {
    /// The io_uring opcode this op uses and its name (probed at start), or `None` when
    /// io_uring has none: the step then runs on the blocking pool.
    const OPCODE: Option<(u8, &'static str)>;

    /// Whether the ring can run this particular op (e.g. an fstat of a direct descriptor
    /// cannot), given that the kernel has [`RingOp::OPCODE`].
    fn on_ring(&self) -> bool {
        Self::OPCODE.is_some()
    }

    /// Whether it runs inline on the worker thread rather than through the ring (see
    /// `exec::uring`): only calls that never block for long.
    fn inline(&self) -> bool {
        false
    }

    /// Whether it never blocks for long on a healthy local file system, so that a worker with
    /// nothing else in flight may make it a plain system call (see `exec::uring`): not syncs,
    /// reads that may wait for the disk, or size changes of large files.
    fn quick(&self) -> bool {
        true
    }

    fn buf(&self) -> BufKind {
        BufKind::None
    }

    /// The SQE, pointing into `self` and `buf`; `slot` is the direct-descriptor slot of a
    /// fixed open, or of the file an earlier fixed open of the chain made.
    fn sqe(&self, buf: &mut Buf, slot: Option<u32>) -> squeue::Entry;

    /// Turns a successful CQE into the step's result.
    fn complete(self, done: Completion, _buf: Buf) -> Completed {
        match done {
            Completion::Value(n) => Completed::Done(Ok(Done::Value(u64::from(n)))),
            other => Completed::Done(Err(invariant(&format!("{other:?} for a non-open op")))),
        }
    }

    /// The plain system call.
    fn blocking(self) -> StepResult;

    /// The file this op works on, when it may be [`FileRef::Chain`].
    fn file_mut(&mut self) -> Option<&mut FileRef> {
        None
    }

    /// Replaces [`FileRef::Chain`] by the file an earlier step of the chain opened.
    fn resolve_chain_file(&mut self, opened: &FileRef) {
        if let Some(file) = self.file_mut()
            && matches!(file, FileRef::Chain)
        {
            *file = opened.clone();
        }
    }

    /// Whether io_uring cancels the linked steps after it when it fails (`IOSQE_IO_LINK`): only
    /// opens, reads and writes do on the kernels measured; a failed namespace or xattr op lets
    /// the chain go on, so a barrier of that kind must end its submission instead.
    fn cancels_links_on_failure(&self) -> bool {
        false
    }

    /// Whether it opens a file: its CQE result is a new fd (or fills a direct descriptor).
    fn opens_file(&self) -> bool {
        false
    }

    /// Whether it opens a direct descriptor (the ring driver reserves a slot for it).
    fn opens_fixed(&self) -> bool {
        false
    }

    /// The direct-descriptor slot this op frees when it succeeds (a close of one).
    fn frees_slot(&self) -> Option<u32> {
        None
    }
}

/// Declares [`Op`], one variant per op type, and forwards every [`RingOp`] method to it.
macro_rules! ops {
    ($($name:ident),* $(,)?) => {
        /// One system call.
        #[derive(Debug)]
        pub enum Op {
            $($name($name)),*
        }

        $(impl From<$name> for Op {
            fn from(op: $name) -> Op {
                Op::$name(op)
            }
        })*

        impl Op {
            /// Every opcode an op may use, with its name, for the start-up probe.
            pub const OPCODES: &[(u8, &'static str)] = &{
                const ALL: [Option<(u8, &str)>; [$(stringify!($name)),*].len()] =
                    [$(<$name as RingOp>::OPCODE),*];
                const N: usize = count_some(&ALL);
                let mut out = [(0u8, ""); N];
                let (mut i, mut j) = (0, 0);
                while i < ALL.len() {
                    if let Some(code) = ALL[i] {
                        out[j] = code;
                        j += 1;
                    }
                    i += 1;
                }
                out
            };

            /// This op's opcode, if io_uring has one for it.
            pub fn opcode(&self) -> Option<u8> {
                match self {
                    $(Op::$name(op) => <$name as RingOp>::OPCODE
                        .filter(|_| op.on_ring())
                        .map(|(code, _)| code)),*
                }
            }

            pub fn inline(&self) -> bool {
                match self { $(Op::$name(op) => op.inline()),* }
            }

            pub fn quick(&self) -> bool {
                match self { $(Op::$name(op) => op.quick()),* }
            }

            pub fn buf(&self) -> BufKind {
                match self { $(Op::$name(op) => op.buf()),* }
            }

            pub fn sqe(&self, buf: &mut Buf, slot: Option<u32>) -> squeue::Entry {
                match self { $(Op::$name(op) => op.sqe(buf, slot)),* }
            }

            pub fn complete(self, done: Completion, buf: Buf) -> Completed {
                match self { $(Op::$name(op) => op.complete(done, buf)),* }
            }

            pub fn blocking(self) -> StepResult {
                match self { $(Op::$name(op) => op.blocking()),* }
            }

            pub fn cancels_links_on_failure(&self) -> bool {
                match self { $(Op::$name(op) => op.cancels_links_on_failure()),* }
            }

            pub fn opens_file(&self) -> bool {
                match self { $(Op::$name(op) => op.opens_file()),* }
            }

            pub fn opens_fixed(&self) -> bool {
                match self { $(Op::$name(op) => op.opens_fixed()),* }
            }

            pub fn frees_slot(&self) -> Option<u32> {
                match self { $(Op::$name(op) => op.frees_slot()),* }
            }

            /// Replaces [`FileRef::Chain`] by the file an earlier step of the chain opened.
            pub fn resolve_chain_file(&mut self, opened: &FileRef) {
                match self { $(Op::$name(op) => op.resolve_chain_file(opened)),* }
            }
        }
    };
}

ops!(
    Statx,
    Fstat,
    Open,
    Close,
    Mkdir,
    Mknod,
    Symlink,
    Link,
    LinkFile,
    Rename,
    Unlink,
    FSetXattr,
    SetXattrAt,
    GetXattr,
    SetXattr,
    RemoveXattr,
    SetAttrs,
    Write,
    Read,
    Fsync,
    Fallocate,
    Ftruncate,
);

const fn count_some(codes: &[Option<(u8, &str)>]) -> usize {
    let (mut i, mut n) = (0, 0);
    while i < codes.len() {
        if codes[i].is_some() {
            n += 1;
        }
        i += 1;
    }
    n
}

/// A broken invariant of the brick's own code (never a client's or the disk's doing): fails
/// loudly in tests and debug builds, and in release logs it and answers EIO rather than
/// taking the brick down.
#[track_caller]
pub fn invariant(what: &str) -> Errno {
    debug_assert!(false, "broken invariant: {what}");
    tracing::error!(%what, location = %std::panic::Location::caller(), "broken invariant");
    Errno::IO
}

/// Converts a `statx` result (rustix's or libc's: the fields have the same names) to [`Stat`].
macro_rules! stat_from_statx {
    ($s:expr) => {{
        let s = $s;
        let ts = |sec: i64, nsec: u32| {
            kiln_wire::Timespec::new(sec, nsec.min(999_999_999)).unwrap_or_default()
        };
        $crate::op::Stat {
            ino: s.stx_ino,
            mode: u32::from(s.stx_mode),
            nlink: s.stx_nlink,
            uid: s.stx_uid,
            gid: s.stx_gid,
            rdev: rustix::fs::makedev(s.stx_rdev_major, s.stx_rdev_minor),
            size: s.stx_size,
            blocks: s.stx_blocks,
            blksize: s.stx_blksize,
            atime: ts(s.stx_atime.tv_sec, s.stx_atime.tv_nsec),
            mtime: ts(s.stx_mtime.tv_sec, s.stx_mtime.tv_nsec),
            ctime: ts(s.stx_ctime.tv_sec, s.stx_ctime.tv_nsec),
            btime: match s.stx_mask & libc::STATX_BTIME {
                0 => kiln_wire::Timespec::default(),
                _ => ts(s.stx_btime.tv_sec, s.stx_btime.tv_nsec),
            },
        }
    }};
}

/// The part of `statx` a fop needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stat {
    pub ino: u64,
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u64,
    pub size: u64,
    pub blocks: u64,
    pub blksize: u32,
    pub atime: Timespec,
    pub mtime: Timespec,
    pub ctime: Timespec,
    /// Birth time when the file system reports one (zero otherwise); with `ino` it names an
    /// inode across reuse of inode numbers, which is what the GFID cache is keyed by.
    pub btime: Timespec,
}

impl Stat {
    pub fn file_type(&self) -> Option<FileType> {
        FileType::from_mode_bits(self.mode)
    }

    pub fn is_dir(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFDIR
    }

    pub fn is_symlink(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFLNK
    }

    pub fn is_regular(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFREG
    }

    /// The `Iatt` a reply carries: these attributes plus the object's GFID.
    pub fn to_iatt(&self, gfid: Gfid) -> Iatt {
        Iatt {
            gfid,
            ino: self.ino,
            file_type: self.file_type().unwrap_or(FileType::Regular),
            mode: Mode::from_st_mode(self.mode),
            nlink: self.nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: self.rdev,
            size: self.size,
            blocks: self.blocks,
            blksize: self.blksize,
            atime: self.atime,
            mtime: self.mtime,
            ctime: self.ctime,
        }
    }

    pub fn from_rustix(s: &rustix::fs::Statx) -> Stat {
        stat_from_statx!(s)
    }

    pub fn from_libc(s: &libc::statx) -> Stat {
        stat_from_statx!(s)
    }
}

pub fn cstr(bytes: &[u8]) -> CString {
    // Names were validated by the wire types (no NUL); an internal name never has one either.
    CString::new(bytes).unwrap_or_default()
}

/// The raw fd of a shared directory fd.
fn raw(dir: &DirFd) -> RawFd {
    dir.as_raw_fd()
}

/// `/proc/self/fd/N`: a path to the object `fd` holds (the magic link ends at it).
pub fn fd_path(fd: &impl AsRawFd) -> CString {
    cstr(format!("/proc/self/fd/{}", fd.as_raw_fd()).as_bytes())
}

/// `/proc/self/fd/<dir>/<name>` (or `…/<dir>/.`): how path-only calls (`lsetxattr`,
/// `lgetxattr`) reach a name relative to a held directory fd. The magic link is the directory
/// itself, so the walk is one component, like every other name operation.
pub fn proc_path(dir: &DirFd, name: &CStr) -> CString {
    let mut p = format!("/proc/self/fd/{}/", raw(dir)).into_bytes();
    // An empty name means the directory itself: `.` inside it, so that the `l*` calls, which
    // do not follow a final symlink, act on the directory and not on the magic link.
    match name.to_bytes() {
        b"" => p.push(b'.'),
        name => p.extend_from_slice(name),
    }
    cstr(&p)
}

/// The plain fd of a file; fixed slots belong to a ring and never reach the blocking path.
fn plain(file: &FileRef) -> Result<std::os::fd::BorrowedFd<'_>, Errno> {
    use std::os::fd::AsFd;
    match file {
        FileRef::Fd(fd) => Ok(fd.as_fd()),
        FileRef::Fixed(_) | FileRef::Chain => Err(Errno::BADF),
    }
}

/// The SQE file operand for `file`: a plain fd or a direct descriptor.
fn target(file: &FileRef, slot: Option<u32>) -> Target {
    match file {
        FileRef::Fd(fd) => Target::Fd(io_uring::types::Fd(fd.as_raw_fd())),
        FileRef::Fixed(s) => Target::Fixed(io_uring::types::Fixed(*s)),
        FileRef::Chain => Target::Fixed(io_uring::types::Fixed(slot.unwrap_or_else(|| {
            invariant("a chain file without an open before it");
            u32::MAX
        }))),
    }
}

/// A plain fd or a direct descriptor, as opcode builders take them.
enum Target {
    Fd(io_uring::types::Fd),
    Fixed(io_uring::types::Fixed),
}

/// Builds an opcode on either kind of file operand: `on_file!(target, |fd| Opcode::new(fd, …))`.
macro_rules! on_file {
    ($target:expr, |$fd:ident| $build:expr) => {
        match $target {
            $crate::op::Target::Fd($fd) => $build,
            $crate::op::Target::Fixed($fd) => $build,
        }
    };
}
use on_file;

/// A `u32` length for an SQE; buffers are bounded far below 4 GiB by the wire limits.
fn len32(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

/// The result of a system call that returns nothing.
fn value(r: Result<(), Errno>) -> StepResult {
    r.map(|()| Done::Value(0))
}
