//! Setting the brick's own xattrs (`trusted.gfid`): on an open file through the ring, or on a
//! name without following it (`lsetxattr`, which io_uring lacks: on the pool). A client's
//! xattr calls, by path ([`ObjectPath`]), on the worker: an object the brick has just
//! resolved has its xattrs in its inode or one block, a few microseconds, cheaper than a trip
//! to the pool.

use std::ffi::CString;

use io_uring::{opcode, squeue};
use rustix::fs::XattrFlags;

use bytes::Bytes;
use kiln_wire::limits::XATTR_VALUE_LEN_MAX_BYTES;
use rustix::io::Errno;

use super::{
    Buf, DirFd, Done, FileRef, RingOp, StepResult, fd_path, len32, on_file, proc_path, value,
};

/// How much of a value or a list of names [`read_xattr`] takes first, in bytes; a longer one
/// is read again into [`XATTR_VALUE_LEN_MAX_BYTES`].
const FIRST_READ_BYTES: usize = 4 * 1024;

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

/// How a path-only call (xattrs, access) reaches an object; it holds the fd the path goes
/// through.
#[derive(Debug, Clone)]
pub enum ObjectPath {
    /// A directory, through `/proc/self/fd/N` of its held fd: the magic link is followed and
    /// ends at the directory, with no lookup of `.` in it (which would need search permission
    /// its owner may have taken away).
    Dir(DirFd),
    /// Anything else, through its handle in a held handle directory; a final symlink is not
    /// followed.
    Handle(DirFd, CString),
    /// A regular file a client holds open, through `/proc/self/fd/N` of the brick's fd: the
    /// file whatever happened to its names since (unlinked, or moved off by a rebalance).
    Open(DirFd),
}

impl ObjectPath {
    /// The path, and whether calls on it follow a final symlink.
    pub fn proc_path(&self) -> (CString, bool) {
        match self {
            ObjectPath::Dir(dir) => (fd_path(dir), true),
            ObjectPath::Handle(dir, name) => (proc_path(dir, name), false),
            ObjectPath::Open(file) => (fd_path(file), true),
        }
    }
}

/// `getxattr` (`lgetxattr` where the path is not followed): the value.
#[derive(Debug)]
pub struct GetXattr {
    pub object: ObjectPath,
    pub xattr: CString,
}

/// `setxattr` (`lsetxattr` where the path is not followed).
#[derive(Debug)]
pub struct SetXattr {
    pub object: ObjectPath,
    pub xattr: CString,
    pub value: Vec<u8>,
    pub flags: XattrFlags,
}

/// `removexattr` (`lremovexattr` where the path is not followed).
#[derive(Debug)]
pub struct RemoveXattr {
    pub object: ObjectPath,
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

/// The [`RingOp`] of a client's xattr call on a path: inline, with no ring opcode.
macro_rules! path_xattr_op {
    ($name:ident, $what:literal, |$op:ident| $call:expr) => {
        impl RingOp for $name {
            const OPCODE: Option<(u8, &'static str)> = None;

            fn inline(&self) -> bool {
                true
            }

            fn sqe(&self, _buf: &mut Buf, _slot: Option<u32>) -> squeue::Entry {
                super::invariant(concat!($what, " of a path goes inline"));
                opcode::Nop::new().build()
            }

            fn blocking(self) -> StepResult {
                let $op = self;
                $call
            }
        }
    };
}

path_xattr_op!(GetXattr, "getxattr", |op| {
    let (path, follow) = op.object.proc_path();
    let value = read_xattr(|buf| match follow {
        true => rustix::fs::getxattr(&*path, &*op.xattr, buf),
        false => rustix::fs::lgetxattr(&*path, &*op.xattr, buf),
    })?;
    Ok(Done::Data(Bytes::from(value)))
});

path_xattr_op!(SetXattr, "setxattr", |op| {
    let (path, follow) = op.object.proc_path();
    value(match follow {
        true => rustix::fs::setxattr(&*path, &*op.xattr, &op.value, op.flags),
        false => rustix::fs::lsetxattr(&*path, &*op.xattr, &op.value, op.flags),
    })
});

path_xattr_op!(RemoveXattr, "removexattr", |op| {
    let (path, follow) = op.object.proc_path();
    value(match follow {
        true => rustix::fs::removexattr(&*path, &*op.xattr),
        false => rustix::fs::lremovexattr(&*path, &*op.xattr),
    })
});

/// What `read` (a `getxattr` or `listxattr` call) puts in a buffer: into [`FIRST_READ_BYTES`]
/// first, and into the largest an xattr may be only when that is too short.
pub fn read_xattr(read: impl Fn(&mut [u8]) -> Result<usize, Errno>) -> Result<Vec<u8>, Errno> {
    let mut buf = vec![0u8; FIRST_READ_BYTES];
    let len = match read(&mut buf) {
        Err(Errno::RANGE) => {
            buf = vec![0u8; XATTR_VALUE_LEN_MAX_BYTES];
            read(&mut buf)?
        }
        len => len?,
    };
    buf.truncate(len);
    Ok(buf)
}
