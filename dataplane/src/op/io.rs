//! Data on open files: `pwrite`, `pread`, `fsync`/`fdatasync`, `fallocate`, `ftruncate`.

use bytes::Bytes;
use io_uring::{opcode, squeue, types};
use rustix::buffer::spare_capacity;

use super::{
    Buf, BufKind, Completed, Completion, Done, FileRef, Op, RingOp, StepResult, len32, on_file,
    plain, value,
};

/// `pwrite(file, data, offset)`, all of it.
#[derive(Debug)]
pub struct Write {
    pub file: FileRef,
    pub offset: u64,
    pub data: Bytes,
}

/// `pread(file, len, offset)`; fewer bytes at the end of the file.
#[derive(Debug)]
pub struct Read {
    pub file: FileRef,
    pub offset: u64,
    pub len: usize,
}

/// `fdatasync` when `datasync`, else `fsync`.
#[derive(Debug)]
pub struct Fsync {
    pub file: FileRef,
    pub datasync: bool,
}

/// `fallocate(file, mode, offset, len)` with `FALLOC_FL_*` mode bits.
#[derive(Debug)]
pub struct Fallocate {
    pub file: FileRef,
    pub mode: i32,
    pub offset: u64,
    pub len: u64,
}

/// `ftruncate(file, len)` (io_uring has it since Linux 6.9; older kernels run it on the pool).
#[derive(Debug)]
pub struct Ftruncate {
    pub file: FileRef,
    pub len: u64,
}

/// The largest write a worker with nothing else in flight makes as a plain system call.
const QUICK_WRITE_BYTES: usize = 64 * 1024;

impl RingOp for Write {
    const OPCODE: Option<(u8, &'static str)> = Some((opcode::Write::CODE, "write"));

    /// A small buffered write lands in the page cache.
    fn quick(&self) -> bool {
        self.data.len() <= QUICK_WRITE_BYTES
    }

    fn cancels_links_on_failure(&self) -> bool {
        true
    }

    fn sqe(&self, _buf: &mut Buf, slot: Option<u32>) -> squeue::Entry {
        let (ptr, len) = (self.data.as_ptr(), len32(self.data.len()));
        on_file!(super::target(&self.file, slot), |fd| {
            opcode::Write::new(fd, ptr, len).offset(self.offset).build()
        })
    }

    /// A short write (rare on local files) is finished by the plain call, as the same caller
    /// (so quota and reserved blocks apply to the rest too); a direct descriptor cannot be
    /// reached that way, so it reports the space it ran out of.
    fn complete(self, done: Completion, _buf: Buf) -> Completed {
        let written = match done {
            Completion::Value(n) => n as usize,
            _ => return Completed::Done(Err(super::invariant("a write returned a file"))),
        };
        if written >= self.data.len() {
            return Completed::Done(Ok(Done::Value(written as u64)));
        }
        match self.file {
            FileRef::Fd(_) => Completed::Partial {
                done: written as u64,
                rest: Op::Write(Write {
                    offset: self.offset + written as u64,
                    data: self.data.slice(written..),
                    file: self.file,
                }),
            },
            _ => Completed::Done(Err(rustix::io::Errno::NOSPC)),
        }
    }

    fn blocking(self) -> StepResult {
        let fd = plain(&self.file)?;
        let mut done = 0;
        while done < self.data.len() {
            let n = rustix::io::pwrite(fd, &self.data[done..], self.offset + done as u64)?;
            if n == 0 {
                return Err(rustix::io::Errno::NOSPC);
            }
            done += n;
        }
        Ok(Done::Value(done as u64))
    }

    fn file_mut(&mut self) -> Option<&mut FileRef> {
        Some(&mut self.file)
    }
}

/// The buffer of a read of up to `len` bytes: capacity only. The read fills it; nothing
/// zeroes it first (a GET asks 256 KiB of a file that may hold 4).
pub(crate) fn read_buf(len: usize) -> Vec<u8> {
    Vec::with_capacity(len)
}

/// A read's bytes as a reply carries them. A buffer the read filled less than half is copied
/// out, so the reply does not hold the whole buffer while it waits to be sent.
fn read_bytes(data: Vec<u8>) -> Bytes {
    if data.len() < data.capacity() / 2 {
        Bytes::copy_from_slice(&data)
    } else {
        Bytes::from(data)
    }
}

impl RingOp for Read {
    const OPCODE: Option<(u8, &'static str)> = Some((opcode::Read::CODE, "read"));

    fn quick(&self) -> bool {
        false
    }

    fn cancels_links_on_failure(&self) -> bool {
        true
    }

    fn buf(&self) -> BufKind {
        BufKind::Read(self.len)
    }

    fn sqe(&self, buf: &mut Buf, slot: Option<u32>) -> squeue::Entry {
        let (ptr, len) = match buf {
            // Into the spare capacity (`read_buf` made it `len` exactly): the kernel writes
            // the bytes, nothing zeroes them first.
            Buf::Read(v) => (v.as_mut_ptr(), len32(self.len.min(v.capacity()))),
            _ => (std::ptr::null_mut(), 0),
        };
        on_file!(super::target(&self.file, slot), |fd| {
            opcode::Read::new(fd, ptr, len).offset(self.offset).build()
        })
    }

    fn complete(self, done: Completion, buf: Buf) -> Completed {
        Completed::Done(match (done, buf) {
            // The ring set the buffer's length to the bytes the kernel wrote.
            (Completion::Value(n), Buf::Read(data)) if data.len() == n as usize => {
                Ok(Done::Data(read_bytes(data)))
            }
            _ => Err(super::invariant("a read completed without its buffer")),
        })
    }

    fn blocking(self) -> StepResult {
        let fd = plain(&self.file)?;
        let mut buf = read_buf(self.len);
        while buf.len() < self.len {
            let at = self.offset + buf.len() as u64;
            if rustix::io::pread(fd, spare_capacity(&mut buf), at)? == 0 {
                break;
            }
        }
        Ok(Done::Data(read_bytes(buf)))
    }

    fn file_mut(&mut self) -> Option<&mut FileRef> {
        Some(&mut self.file)
    }
}

impl RingOp for Fsync {
    const OPCODE: Option<(u8, &'static str)> = Some((opcode::Fsync::CODE, "fsync"));

    fn quick(&self) -> bool {
        false
    }

    fn sqe(&self, _buf: &mut Buf, slot: Option<u32>) -> squeue::Entry {
        let flags = if self.datasync {
            types::FsyncFlags::DATASYNC
        } else {
            types::FsyncFlags::empty()
        };
        on_file!(super::target(&self.file, slot), |fd| {
            opcode::Fsync::new(fd).flags(flags).build()
        })
    }

    fn blocking(self) -> StepResult {
        let fd = plain(&self.file)?;
        value(if self.datasync {
            rustix::fs::fdatasync(fd)
        } else {
            rustix::fs::fsync(fd)
        })
    }

    fn file_mut(&mut self) -> Option<&mut FileRef> {
        Some(&mut self.file)
    }
}

impl RingOp for Fallocate {
    const OPCODE: Option<(u8, &'static str)> = Some((opcode::Fallocate::CODE, "fallocate"));

    fn quick(&self) -> bool {
        false
    }

    fn sqe(&self, _buf: &mut Buf, slot: Option<u32>) -> squeue::Entry {
        on_file!(super::target(&self.file, slot), |fd| {
            opcode::Fallocate::new(fd, self.len)
                .offset(self.offset)
                .mode(self.mode)
                .build()
        })
    }

    fn blocking(self) -> StepResult {
        let mode = rustix::fs::FallocateFlags::from_bits_retain(self.mode.cast_unsigned());
        value(rustix::fs::fallocate(
            plain(&self.file)?,
            mode,
            self.offset,
            self.len,
        ))
    }

    fn file_mut(&mut self) -> Option<&mut FileRef> {
        Some(&mut self.file)
    }
}

impl RingOp for Ftruncate {
    const OPCODE: Option<(u8, &'static str)> = Some((opcode::Ftruncate::CODE, "ftruncate"));

    fn quick(&self) -> bool {
        false
    }

    fn sqe(&self, _buf: &mut Buf, slot: Option<u32>) -> squeue::Entry {
        on_file!(super::target(&self.file, slot), |fd| {
            opcode::Ftruncate::new(fd, self.len).build()
        })
    }

    fn blocking(self) -> StepResult {
        value(rustix::fs::ftruncate(plain(&self.file)?, self.len))
    }

    fn file_mut(&mut self) -> Option<&mut FileRef> {
        Some(&mut self.file)
    }
}
