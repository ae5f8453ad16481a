//! `statx` of a name, and of an open file. Both run inline on the worker (see `exec::uring`):
//! on a warm dentry cache a `statx` takes about a microsecond, while the ring punts it to an
//! io-wq thread and back.

use std::ffi::CString;
use std::os::fd::{AsFd, BorrowedFd};

use io_uring::{opcode, squeue, types};
use rustix::fs::{AtFlags, StatxFlags};

use super::{Buf, BufKind, Completed, Completion, DirFd, Done, FileRef, RingOp, Stat, StepResult};

const STATX: Option<(u8, &str)> = Some((opcode::Statx::CODE, "statx"));
/// What every stat asks for: the basic fields, and the birth time the GFID cache keys on.
const MASK: u32 = libc::STATX_BASIC_STATS | libc::STATX_BTIME;

/// `statx(dir, name)`, not following a final symlink when `nofollow`.
#[derive(Debug)]
pub struct Statx {
    pub dir: DirFd,
    pub name: CString,
    pub nofollow: bool,
}

/// `statx(fd, "", AT_EMPTY_PATH)` of an open file or directory.
#[derive(Debug)]
pub struct Fstat {
    pub file: FileRef,
}

impl Statx {
    /// `lstat`-like: the name itself, never what a symlink points at.
    pub fn of(dir: &DirFd, name: &CString) -> Statx {
        Statx {
            dir: dir.clone(),
            name: name.clone(),
            nofollow: true,
        }
    }
}

impl Fstat {
    pub fn dir(dir: &DirFd) -> Fstat {
        Fstat {
            file: FileRef::Fd(dir.clone()),
        }
    }
}

fn statx_ptr(buf: &mut Buf) -> *mut types::statx {
    match buf {
        Buf::Statx(st) => (&raw mut **st).cast(),
        _ => std::ptr::null_mut(),
    }
}

fn completed(buf: Buf) -> Completed {
    Completed::Done(match buf {
        Buf::Statx(st) => Ok(Done::Stat(Stat::from_libc(&st))),
        _ => Err(super::invariant("a statx completed without its buffer")),
    })
}

fn stat_at(dir: BorrowedFd<'_>, name: &std::ffi::CStr, flags: AtFlags) -> StepResult {
    statx_at(dir, name, flags).map(Done::Stat)
}

fn statx_at(
    dir: BorrowedFd<'_>,
    name: &std::ffi::CStr,
    flags: AtFlags,
) -> Result<Stat, rustix::io::Errno> {
    let mask = StatxFlags::BASIC_STATS | StatxFlags::BTIME;
    let st = rustix::fs::statx(dir, name, flags, mask)?;
    Ok(Stat::from_rustix(&st))
}

/// [`Statx::of`] as a plain system call on the calling thread (a pool thread's batch).
pub fn lstat_at(dir: &DirFd, name: &std::ffi::CStr) -> Result<Stat, rustix::io::Errno> {
    let flags = AtFlags::SYMLINK_NOFOLLOW | AtFlags::STATX_SYNC_AS_STAT;
    statx_at(dir.as_fd(), name, flags)
}

impl RingOp for Statx {
    const OPCODE: Option<(u8, &'static str)> = STATX;

    fn inline(&self) -> bool {
        true
    }

    fn buf(&self) -> BufKind {
        BufKind::Statx
    }

    fn sqe(&self, buf: &mut Buf, _slot: Option<u32>) -> squeue::Entry {
        let nofollow = if self.nofollow {
            libc::AT_SYMLINK_NOFOLLOW
        } else {
            0
        };
        opcode::Statx::new(
            types::Fd(super::raw(&self.dir)),
            self.name.as_ptr(),
            statx_ptr(buf),
        )
        .flags(libc::AT_STATX_SYNC_AS_STAT | nofollow)
        .mask(MASK)
        .build()
    }

    fn complete(self, _done: Completion, buf: Buf) -> Completed {
        completed(buf)
    }

    fn blocking(self) -> StepResult {
        let nofollow = if self.nofollow {
            AtFlags::SYMLINK_NOFOLLOW
        } else {
            AtFlags::empty()
        };
        stat_at(
            self.dir.as_fd(),
            &self.name,
            nofollow | AtFlags::STATX_SYNC_AS_STAT,
        )
    }
}

impl RingOp for Fstat {
    const OPCODE: Option<(u8, &'static str)> = STATX;

    /// `statx` cannot address a direct descriptor.
    fn on_ring(&self) -> bool {
        matches!(self.file, FileRef::Fd(_))
    }

    fn inline(&self) -> bool {
        matches!(self.file, FileRef::Fd(_))
    }

    fn buf(&self) -> BufKind {
        BufKind::Statx
    }

    fn sqe(&self, buf: &mut Buf, _slot: Option<u32>) -> squeue::Entry {
        let fd = match &self.file {
            FileRef::Fd(fd) => std::os::fd::AsRawFd::as_raw_fd(&**fd),
            _ => {
                super::invariant("fstat of a direct descriptor on the ring");
                -1
            }
        };
        opcode::Statx::new(types::Fd(fd), c"".as_ptr(), statx_ptr(buf))
            .flags(libc::AT_EMPTY_PATH)
            .mask(MASK)
            .build()
    }

    fn complete(self, _done: Completion, buf: Buf) -> Completed {
        completed(buf)
    }

    fn blocking(self) -> StepResult {
        stat_at(super::plain(&self.file)?, c"", AtFlags::EMPTY_PATH)
    }

    fn file_mut(&mut self) -> Option<&mut FileRef> {
        Some(&mut self.file)
    }
}
