//! The blocking executor: each step is one ordinary system call on the calling thread. It is
//! the reference the io_uring engine is measured against, and the fallback where io_uring is
//! unavailable.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;

use bytes::Bytes;
use rustix::fs::{AtFlags, Mode, OFlags, RenameFlags, StatxFlags, XattrFlags};
use rustix::io::Errno;

use super::Exec;
use crate::creds::ActAs;
use crate::step::{Done, FileRef, Op, Stat, Step, StepResult, Who};

/// Runs every step inline.
#[derive(Debug, Default, Clone, Copy)]
pub struct BlockingExec;

impl Exec for BlockingExec {
    async fn run(&self, steps: Vec<Step>) -> Vec<StepResult> {
        run_chain(steps)
    }

    async fn blocking<T: Send + 'static>(&self, work: impl FnOnce() -> T + Send + 'static) -> T {
        crate::profile::charge(|c| c.pool_jobs += 1);
        work()
    }
}

/// Runs a chain: every step in order, except that a failed barrier cancels the rest.
pub fn run_chain(steps: Vec<Step>) -> Vec<StepResult> {
    let mut failed = false;
    let mut opened: Option<FileRef> = None;
    steps
        .into_iter()
        .map(|mut step| {
            if failed {
                return Err(Errno::CANCELED);
            }
            step.op.resolve_chain_file(opened.as_ref());
            let barrier = step.barrier;
            let result = run_step(step);
            if let Ok(Done::Opened(file)) = &result {
                opened = Some(file.clone());
            }
            failed = barrier && result.is_err();
            result
        })
        .collect()
}

/// Runs one step with its credentials.
pub fn run_step(step: Step) -> StepResult {
    let _as = match &step.who {
        Who::Brick => None,
        Who::Caller(creds) => Some(ActAs::new(creds)?),
    };
    run_op(step.op)
}

/// The plain fd of a file; fixed slots belong to a ring and never reach this executor.
fn plain(file: &FileRef) -> Result<BorrowedFd<'_>, Errno> {
    match file {
        FileRef::Fd(fd) => Ok(fd.as_fd()),
        FileRef::Fixed(_) | FileRef::Chain => Err(Errno::BADF),
    }
}

fn stat_at(dir: BorrowedFd<'_>, name: &std::ffi::CStr, flags: AtFlags) -> StepResult {
    let mask = StatxFlags::BASIC_STATS | StatxFlags::BTIME;
    let st = rustix::fs::statx(dir, name, flags, mask)?;
    Ok(Done::Stat(Stat::from_rustix(&st)))
}

fn run_op(op: Op) -> StepResult {
    match op {
        Op::Statx {
            dir,
            name,
            nofollow,
        } => {
            let flags = if nofollow {
                AtFlags::SYMLINK_NOFOLLOW
            } else {
                AtFlags::empty()
            };
            stat_at(dir.as_fd(), &name, flags | AtFlags::STATX_SYNC_AS_STAT)
        }
        Op::Fstat { file } => stat_at(plain(&file)?, c"", AtFlags::EMPTY_PATH),
        Op::Open {
            dir,
            name,
            flags,
            mode,
            fixed: _,
        } => {
            let flags = OFlags::from_bits_retain(flags.cast_unsigned()) | OFlags::CLOEXEC;
            let fd = rustix::fs::openat(&dir, &*name, flags, Mode::from_raw_mode(mode))?;
            Ok(Done::Opened(FileRef::Fd(Arc::new(fd))))
        }
        Op::Mkdir { dir, name, mode } => {
            rustix::fs::mkdirat(&dir, &*name, Mode::from_raw_mode(mode))?;
            Ok(Done::Value(0))
        }
        Op::Mknod {
            dir,
            name,
            mode,
            rdev,
        } => {
            let kind = rustix::fs::FileType::from_raw_mode(mode);
            let perm = Mode::from_raw_mode(mode & 0o7777);
            rustix::fs::mknodat(&dir, &*name, kind, perm, rdev)?;
            Ok(Done::Value(0))
        }
        Op::SetXattrAt {
            dir,
            name,
            xattr,
            value,
            flags,
        } => {
            let path = crate::step::proc_path(&dir, &name);
            let flags = XattrFlags::from_bits_retain(flags.cast_unsigned());
            rustix::fs::lsetxattr(&*path, &*xattr, &value, flags)?;
            Ok(Done::Value(0))
        }
        Op::Fallocate {
            file,
            mode,
            offset,
            len,
        } => {
            let mode = rustix::fs::FallocateFlags::from_bits_retain(mode.cast_unsigned());
            rustix::fs::fallocate(plain(&file)?, mode, offset, len)?;
            Ok(Done::Value(0))
        }
        Op::Symlink { target, dir, name } => {
            rustix::fs::symlinkat(&*target, &dir, &*name)?;
            Ok(Done::Value(0))
        }
        Op::Link {
            old_dir,
            old_name,
            new_dir,
            new_name,
        } => {
            rustix::fs::linkat(&old_dir, &*old_name, &new_dir, &*new_name, AtFlags::empty())?;
            Ok(Done::Value(0))
        }
        Op::Rename {
            old_dir,
            old_name,
            new_dir,
            new_name,
            flags,
        } => {
            let flags = RenameFlags::from_bits_retain(flags);
            rustix::fs::renameat_with(&old_dir, &*old_name, &new_dir, &*new_name, flags)?;
            Ok(Done::Value(0))
        }
        Op::Unlink {
            dir,
            name,
            dir_flag,
        } => {
            let flags = if dir_flag {
                AtFlags::REMOVEDIR
            } else {
                AtFlags::empty()
            };
            rustix::fs::unlinkat(&dir, &*name, flags)?;
            Ok(Done::Value(0))
        }
        Op::FSetXattr {
            file,
            name,
            value,
            flags,
        } => {
            let flags = XattrFlags::from_bits_retain(flags.cast_unsigned());
            rustix::fs::fsetxattr(plain(&file)?, &*name, &value, flags)?;
            Ok(Done::Value(0))
        }
        Op::Write { file, offset, data } => {
            let fd = plain(&file)?;
            let mut done = 0;
            while done < data.len() {
                let n = rustix::io::pwrite(fd, &data[done..], offset + done as u64)?;
                if n == 0 {
                    return Err(Errno::NOSPC);
                }
                done += n;
            }
            Ok(Done::Value(done as u64))
        }
        Op::Read { file, offset, len } => {
            let fd = plain(&file)?;
            let mut buf = vec![0u8; len];
            let mut done = 0;
            while done < len {
                let n = rustix::io::pread(fd, &mut buf[done..], offset + done as u64)?;
                if n == 0 {
                    break;
                }
                done += n;
            }
            buf.truncate(done);
            Ok(Done::Data(Bytes::from(buf)))
        }
        Op::Fsync { file, datasync } => {
            let fd = plain(&file)?;
            if datasync {
                rustix::fs::fdatasync(fd)?;
            } else {
                rustix::fs::fsync(fd)?;
            }
            Ok(Done::Value(0))
        }
        // Dropping the step's reference closes the fd once no other step holds it.
        Op::Close { file } => plain(&file).map(|_| Done::Value(0)),
    }
}
