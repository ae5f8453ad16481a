//! Setting the brick's own xattrs (`trusted.gfid`): on an open file through the ring, or on a
//! name without following it (`lsetxattr`, which io_uring lacks: on the pool). Reading one
//! for a client, on the worker.

use std::ffi::CString;

use io_uring::{opcode, squeue};
use rustix::fs::XattrFlags;

use bytes::Bytes;
use kiln_wire::limits::XATTR_VALUE_LEN_MAX_BYTES;
use rustix::io::Errno;

use super::{Buf, DirFd, Done, FileRef, RingOp, StepResult, len32, on_file, proc_path, value};

/// How much of a value [`GetXattr`] reads first, in bytes; a longer one is read again into
/// [`XATTR_VALUE_LEN_MAX_BYTES`].
const GET_FIRST_READ_BYTES: usize = 4 * 1024;

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

/// `getxattr` of the object at `path` (a `/proc/self/fd/N/…` path whose fd the caller keeps
/// open), following it or not (`lgetxattr`): the value.
#[derive(Debug)]
pub struct GetXattr {
    pub path: CString,
    pub follow: bool,
    pub xattr: CString,
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

impl RingOp for GetXattr {
    const OPCODE: Option<(u8, &'static str)> = None;

    /// An object the brick has just resolved: its xattrs are in its inode or one block, a few
    /// microseconds, cheaper than a trip to the pool.
    fn inline(&self) -> bool {
        true
    }

    fn sqe(&self, _buf: &mut Buf, _slot: Option<u32>) -> squeue::Entry {
        super::invariant("getxattr of a path goes inline");
        opcode::Nop::new().build()
    }

    fn blocking(self) -> StepResult {
        let get = |buf: &mut [u8]| match self.follow {
            true => rustix::fs::getxattr(&*self.path, &*self.xattr, buf),
            false => rustix::fs::lgetxattr(&*self.path, &*self.xattr, buf),
        };
        let mut buf = vec![0u8; GET_FIRST_READ_BYTES];
        let len = match get(&mut buf) {
            Err(Errno::RANGE) => {
                buf = vec![0u8; XATTR_VALUE_LEN_MAX_BYTES];
                get(&mut buf)?
            }
            len => len?,
        };
        buf.truncate(len);
        Ok(Done::Data(Bytes::from(buf)))
    }
}
