//! Steps: the single-name system calls a fop is made of, as owned values.
//!
//! A fop builds a chain of steps; an executor runs the chain — the blocking executor one
//! syscall after another, the io_uring executor as linked SQEs. Steps run in order whatever
//! the result of the one before, except after a failed *barrier* step (a fop's commit point):
//! then the rest report `ECANCELED` without running. Both executors keep exactly that rule, so
//! a fop's logic is written once. (io_uring cancels a link chain only after a failed open,
//! read or write; namespace and xattr opcodes do not break links, so the ring executor ends a
//! submission after any other barrier.)
//! Steps own their names and buffers, and keep the directory fds they use alive, so the ring
//! can hold them until the kernel is done even if the caller went away.

use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use bytes::Bytes;
use kiln_wire::{Creds, FileType, Gfid, Iatt, Mode, Timespec};
use rustix::io::Errno;

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

/// One system call.
#[derive(Debug)]
pub enum Op {
    Statx {
        dir: DirFd,
        name: CString,
        nofollow: bool,
    },
    /// `fstat` of an open file (`statx` with `AT_EMPTY_PATH`).
    Fstat {
        file: FileRef,
    },
    /// `openat`; `fixed` asks the ring for a direct descriptor (ignored by the blocking
    /// executor, which always returns a plain fd).
    Open {
        dir: DirFd,
        name: CString,
        flags: i32,
        mode: u32,
        fixed: bool,
    },
    Mkdir {
        dir: DirFd,
        name: CString,
        mode: u32,
    },
    Mknod {
        dir: DirFd,
        name: CString,
        mode: u32,
        rdev: u64,
    },
    Symlink {
        target: CString,
        dir: DirFd,
        name: CString,
    },
    Link {
        old_dir: DirFd,
        old_name: CString,
        new_dir: DirFd,
        new_name: CString,
    },
    Rename {
        old_dir: DirFd,
        old_name: CString,
        new_dir: DirFd,
        new_name: CString,
        flags: u32,
    },
    Unlink {
        dir: DirFd,
        name: CString,
        dir_flag: bool,
    },
    FSetXattr {
        file: FileRef,
        name: CString,
        value: Vec<u8>,
        flags: i32,
    },
    /// Sets an xattr on `dir/name` itself, not following a symlink (`lsetxattr`).
    SetXattrAt {
        dir: DirFd,
        name: CString,
        xattr: CString,
        value: Vec<u8>,
        flags: i32,
    },
    Write {
        file: FileRef,
        offset: u64,
        data: Bytes,
    },
    Read {
        file: FileRef,
        offset: u64,
        len: usize,
    },
    Fsync {
        file: FileRef,
        datasync: bool,
    },
    Fallocate {
        file: FileRef,
        mode: i32,
        offset: u64,
        len: u64,
    },
    Close {
        file: FileRef,
    },
}

/// A step: an op, whose credentials it runs with, and whether its failure stops the chain.
#[derive(Debug)]
pub struct Step {
    pub op: Op,
    pub who: Who,
    pub barrier: bool,
}

impl Step {
    pub fn brick(op: Op) -> Step {
        Step {
            op,
            who: Who::Brick,
            barrier: false,
        }
    }

    pub fn caller(op: Op, creds: &Creds) -> Step {
        Step {
            op,
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

/// Converts a `statx` result (rustix's or libc's: the fields have the same names) to [`Stat`].
macro_rules! stat_from_statx {
    ($s:expr) => {{
        let s = $s;
        let ts = |sec: i64, nsec: u32| {
            kiln_wire::Timespec::new(sec, nsec.min(999_999_999)).unwrap_or_default()
        };
        $crate::step::Stat {
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
pub(crate) use stat_from_statx;

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

    pub(crate) fn from_rustix(s: &rustix::fs::Statx) -> Stat {
        stat_from_statx!(s)
    }
}

pub(crate) fn cstr(bytes: &[u8]) -> CString {
    // Names were validated by the wire types (no NUL); an internal name never has one either.
    CString::new(bytes).unwrap_or_default()
}

/// The raw fd of a shared directory fd.
pub(crate) fn raw(dir: &DirFd) -> RawFd {
    dir.as_raw_fd()
}

impl Op {
    /// Replaces [`FileRef::Chain`] by the file an earlier step of the chain opened.
    pub fn resolve_chain_file(&mut self, opened: Option<&FileRef>) {
        let (Op::Fstat { file }
        | Op::FSetXattr { file, .. }
        | Op::Write { file, .. }
        | Op::Read { file, .. }
        | Op::Fsync { file, .. }
        | Op::Fallocate { file, .. }
        | Op::Close { file }) = self
        else {
            return;
        };
        if let (FileRef::Chain, Some(opened)) = (&*file, opened) {
            *file = opened.clone();
        }
    }
}

/// `/proc/self/fd/<dir>/<name>` (or `…/<dir>/.`): how path-only calls (`lsetxattr`, `lgetxattr`) reach a name
/// relative to a held directory fd. The magic link is the directory itself, so the walk is one
/// component, like every other name operation.
pub fn proc_path(dir: &DirFd, name: &std::ffi::CStr) -> CString {
    let mut p = format!("/proc/self/fd/{}/", raw(dir)).into_bytes();
    // An empty name means the directory itself: `.` inside it, so that the `l*` calls, which
    // do not follow a final symlink, act on the directory and not on the magic link.
    match name.to_bytes() {
        b"" => p.push(b'.'),
        name => p.extend_from_slice(name),
    }
    cstr(&p)
}
