//! SETATTR's system calls on an object held by an fd: an `O_PATH` fd (SETATTR by GFID, on the
//! pool) or a new file's open fd (a PUT's attributes, inline, before the file is named).

use std::os::fd::BorrowedFd;

use io_uring::{opcode, squeue};
use kiln_wire::{SetAttr, TimeSet};
use rustix::fs::{AtFlags, Mode, OFlags};
use rustix::io::Errno;

use super::{Buf, Done, FileRef, RingOp, StepResult};

/// Sets `attr` on `file`: size, owner (which clears set-id bits), mode, then times — the
/// order that keeps explicit values.
#[derive(Debug)]
pub struct SetAttrs {
    pub file: FileRef,
    pub attr: SetAttr,
}

impl RingOp for SetAttrs {
    const OPCODE: Option<(u8, &'static str)> = None;

    /// On a plain fd (a new file's) a few inode updates, cheaper than a trip to the pool.
    fn inline(&self) -> bool {
        matches!(self.file, FileRef::Fd(_)) && self.attr.size.is_none()
    }

    fn quick(&self) -> bool {
        self.attr.size.is_none()
    }

    fn sqe(&self, _buf: &mut Buf, _slot: Option<u32>) -> squeue::Entry {
        super::invariant("setattr has no io_uring opcode");
        opcode::Nop::new().build()
    }

    fn blocking(self) -> StepResult {
        set_attrs(super::plain(&self.file)?, &self.attr)?;
        Ok(Done::Value(0))
    }

    fn file_mut(&mut self) -> Option<&mut FileRef> {
        Some(&mut self.file)
    }
}

/// SETATTR's calls on the object `fd` holds, as the calling thread's credentials allow.
/// `/proc/self/fd/N` ends at the object itself; it is followed only for what has no
/// `AT_EMPTY_PATH` form: a truncate, and a mode on an `O_PATH` fd (an open file, such as a
/// PUT's new one, takes `fchmod`). Callers never pass a symlink with a mode.
pub fn set_attrs(fd: BorrowedFd<'_>, attr: &SetAttr) -> Result<(), Errno> {
    if let Some(size) = attr.size {
        let flags = OFlags::WRONLY | OFlags::CLOEXEC | OFlags::NONBLOCK;
        let file = rustix::fs::open(&*super::fd_path(&fd), flags, Mode::empty())?;
        rustix::fs::ftruncate(&file, size)?;
    }
    if attr.uid.is_some() || attr.gid.is_some() {
        let uid = attr.uid.map(rustix::process::Uid::from_raw);
        let gid = attr.gid.map(rustix::process::Gid::from_raw);
        rustix::fs::chownat(fd, c"", uid, gid, AtFlags::EMPTY_PATH)?;
    }
    if let Some(mode) = attr.mode {
        let mode = Mode::from_raw_mode(mode.bits());
        match rustix::fs::fchmod(fd, mode) {
            Err(Errno::BADF) => rustix::fs::chmod(&*super::fd_path(&fd), mode)?,
            done => done?,
        }
    }
    if attr.atime.is_some() || attr.mtime.is_some() {
        let times = rustix::fs::Timestamps {
            last_access: timespec(attr.atime),
            last_modification: timespec(attr.mtime),
        };
        rustix::fs::utimensat(fd, c"", &times, AtFlags::EMPTY_PATH)?;
    }
    Ok(())
}

/// A time to set as `utimensat` takes it: unchanged, now, or a value.
fn timespec(t: Option<TimeSet>) -> rustix::fs::Timespec {
    match t {
        None => rustix::fs::Timespec {
            tv_sec: 0,
            tv_nsec: rustix::fs::UTIME_OMIT,
        },
        Some(TimeSet::Now) => rustix::fs::Timespec {
            tv_sec: 0,
            tv_nsec: rustix::fs::UTIME_NOW,
        },
        Some(TimeSet::At(t)) => rustix::fs::Timespec {
            tv_sec: t.sec(),
            tv_nsec: i64::from(t.nsec()),
        },
    }
}
