//! `openat` relative to a held directory fd, and `close`.
//!
//! A file opened and closed inside one chain (PUT, MKDIR's GFID step) is a direct descriptor
//! in the ring's registered file table (`fixed`); a file kept open across requests is a plain
//! fd, because `statx`, `lseek`, `getdents` and the blocking pool cannot address direct
//! descriptors.

use std::ffi::CString;
use std::sync::Arc;

use io_uring::{opcode, squeue, types};
use rustix::fs::{Mode, OFlags};

use super::{Buf, Completed, Completion, DirFd, Done, FileRef, RingOp, StepResult};

/// `openat(dir, name, flags, mode)`; `fixed` asks the ring for a direct descriptor (the
/// blocking path always returns a plain fd).
#[derive(Debug)]
pub struct Open {
    pub dir: DirFd,
    pub name: CString,
    pub flags: i32,
    pub mode: u32,
    pub fixed: bool,
}

/// Closes a file: a direct descriptor through the ring, a plain fd by dropping the step's
/// reference (the fd closes once no other step holds it).
#[derive(Debug)]
pub struct Close {
    pub file: FileRef,
}

impl Open {
    /// `dir/name` itself (never what a symlink points at), for an `O_PATH` fd to hold it by.
    pub fn path(dir: &DirFd, name: &CString) -> Open {
        Open {
            dir: dir.clone(),
            name: name.clone(),
            flags: libc::O_PATH | libc::O_NOFOLLOW,
            mode: 0,
            fixed: false,
        }
    }
}

impl RingOp for Open {
    const OPCODE: Option<(u8, &'static str)> = Some((opcode::OpenAt::CODE, "openat"));

    fn sqe(&self, _buf: &mut Buf, slot: Option<u32>) -> squeue::Entry {
        let open = opcode::OpenAt::new(types::Fd(super::raw(&self.dir)), self.name.as_ptr())
            .mode(self.mode);
        let slot = slot
            .filter(|_| self.fixed)
            .and_then(|s| types::DestinationSlot::try_from_slot_target(s).ok());
        match slot {
            // O_CLOEXEC and a direct descriptor do not mix (EINVAL).
            Some(slot) => open
                .flags(self.flags & !libc::O_CLOEXEC)
                .file_index(Some(slot))
                .build(),
            None => open.flags(self.flags | libc::O_CLOEXEC).build(),
        }
    }

    fn complete(self, done: Completion, _buf: Buf) -> Completed {
        Completed::Done(match done {
            Completion::Fd(fd) => Ok(Done::Opened(FileRef::Fd(Arc::new(fd)))),
            Completion::Fixed(slot) => Ok(Done::Opened(FileRef::Fixed(slot))),
            Completion::Value(_) => Err(super::invariant("an open completed without a file")),
        })
    }

    fn blocking(self) -> StepResult {
        let flags = OFlags::from_bits_retain(self.flags.cast_unsigned()) | OFlags::CLOEXEC;
        let mode = Mode::from_raw_mode(self.mode);
        let fd = rustix::fs::openat(&self.dir, &*self.name, flags, mode)?;
        Ok(Done::Opened(FileRef::Fd(Arc::new(fd))))
    }

    fn cancels_links_on_failure(&self) -> bool {
        true
    }

    fn opens_file(&self) -> bool {
        true
    }

    fn opens_fixed(&self) -> bool {
        self.fixed
    }
}

impl RingOp for Close {
    const OPCODE: Option<(u8, &'static str)> = Some((opcode::Close::CODE, "close"));

    /// Only a direct descriptor needs the ring.
    fn on_ring(&self) -> bool {
        !matches!(self.file, FileRef::Fd(_))
    }

    fn inline(&self) -> bool {
        matches!(self.file, FileRef::Fd(_))
    }

    fn sqe(&self, _buf: &mut Buf, slot: Option<u32>) -> squeue::Entry {
        let slot = match self.file {
            FileRef::Fixed(s) => s,
            _ => slot.unwrap_or_else(|| {
                super::invariant("close of a chain file without an open before it");
                u32::MAX
            }),
        };
        opcode::Close::new(types::Fixed(slot)).build()
    }

    fn blocking(self) -> StepResult {
        super::plain(&self.file).map(|_| Done::Value(0))
    }

    fn file_mut(&mut self) -> Option<&mut FileRef> {
        Some(&mut self.file)
    }

    fn frees_slot(&self) -> Option<u32> {
        match self.file {
            FileRef::Fixed(slot) => Some(slot),
            _ => None,
        }
    }
}
