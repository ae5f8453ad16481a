//! Setting the brick's own xattrs (`trusted.gfid`): on an open file through the ring, or on a
//! name without following it (`lsetxattr`, which io_uring lacks: on the pool).

use std::ffi::CString;

use io_uring::{opcode, squeue};
use rustix::fs::XattrFlags;

use super::{Buf, DirFd, FileRef, RingOp, StepResult, len32, on_file, proc_path, value};

/// `fsetxattr(file, name, value, flags)`.
#[derive(Debug)]
pub struct FSetXattr {
    pub file: FileRef,
    pub name: CString,
    pub value: Vec<u8>,
    pub flags: i32,
}

/// Sets an xattr on `dir/name` itself, not following a symlink (`lsetxattr`).
#[derive(Debug)]
pub struct SetXattrAt {
    pub dir: DirFd,
    pub name: CString,
    pub xattr: CString,
    pub value: Vec<u8>,
    pub flags: i32,
}

impl RingOp for FSetXattr {
    const OPCODE: Option<(u8, &'static str)> = Some((opcode::FSetXattr::CODE, "fsetxattr"));

    /// On a plain fd (a new unnamed file's GFID) it is a few microseconds in the inode, cheaper
    /// than a trip through an io-wq thread; a direct descriptor needs the ring.
    fn inline(&self) -> bool {
        matches!(self.file, FileRef::Fd(_))
    }

    fn sqe(&self, _buf: &mut Buf, slot: Option<u32>) -> squeue::Entry {
        let (name, value) = (self.name.as_ptr(), self.value.as_ptr().cast());
        let len = len32(self.value.len());
        on_file!(super::target(&self.file, slot), |fd| {
            opcode::FSetXattr::new(fd, name, value, len)
                .flags(self.flags)
                .build()
        })
    }

    fn blocking(self) -> StepResult {
        let flags = XattrFlags::from_bits_retain(self.flags.cast_unsigned());
        value(rustix::fs::fsetxattr(
            super::plain(&self.file)?,
            &*self.name,
            &self.value,
            flags,
        ))
    }

    fn file_mut(&mut self) -> Option<&mut FileRef> {
        Some(&mut self.file)
    }
}

impl RingOp for SetXattrAt {
    const OPCODE: Option<(u8, &'static str)> = None;

    fn sqe(&self, _buf: &mut Buf, _slot: Option<u32>) -> squeue::Entry {
        super::invariant("lsetxattr has no io_uring opcode");
        opcode::Nop::new().build()
    }

    fn blocking(self) -> StepResult {
        let path = proc_path(&self.dir, &self.name);
        let flags = XattrFlags::from_bits_retain(self.flags.cast_unsigned());
        value(rustix::fs::lsetxattr(
            &*path,
            &*self.xattr,
            &self.value,
            flags,
        ))
    }
}
