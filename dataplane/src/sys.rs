//! System calls rustix does not wrap yet: `getxattrat(2)` and `listxattrat(2)` (Linux 6.13),
//! the xattr calls that take a directory fd and a name. Without them an xattr of a name in a
//! held directory is reached through `/proc/self/fd/N/name`, a walk of seven path components
//! through procfs for every entry a cold listing reports (a sixth of the brick's CPU in a tree
//! walk); with them the walk is the one name. On an older kernel (`ENOSYS`) both fall back to
//! that path, once decided for the process.
//!
//! Both act on the name itself, never following a final symlink (`AT_SYMLINK_NOFOLLOW`, as
//! `lgetxattr`/`llistxattr` do); an empty name means the directory.
#![allow(unsafe_code)]

use std::ffi::CStr;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::io::Errno;
use rustix::path::Arg;

use crate::op::{DirFd, proc_path};

/// `getxattrat`'s and `listxattrat`'s numbers: calls added since Linux 5.1 take the same
/// number on every architecture but alpha.
const SYS_GETXATTRAT: libc::c_long = 464;
const SYS_LISTXATTRAT: libc::c_long = 465;

/// `struct xattr_args` of `getxattrat(2)`: where the value goes and how much fits.
#[repr(C, align(8))]
struct XattrArgs {
    value: u64,
    size: u32,
    flags: u32,
}

/// Set once a call answered `ENOSYS`: the kernel predates the `*xattrat` calls.
static XATTRAT_MISSING: AtomicBool = AtomicBool::new(false);

/// `lgetxattr` of `attr` on `name` in `dir` into `value`: the value's length.
pub fn lgetxattr_at(
    dir: &DirFd,
    name: &CStr,
    attr: &str,
    value: &mut [u8],
) -> Result<usize, Errno> {
    let at = |value: &mut [u8]| {
        let args = XattrArgs {
            value: value.as_mut_ptr() as u64,
            size: u32::try_from(value.len()).unwrap_or(u32::MAX),
            flags: 0,
        };
        attr.into_with_c_str(|attr| {
            // SAFETY: `name` and `attr` are NUL-terminated; `args` points at `value`, which
            // outlives the call and is at least `args.size` bytes long; the kernel writes at
            // most that many; `dir` is an open fd for the call's length.
            result(unsafe {
                libc::syscall(
                    SYS_GETXATTRAT,
                    dir.as_raw_fd(),
                    at_name(name).as_ptr(),
                    libc::AT_SYMLINK_NOFOLLOW,
                    attr.as_ptr(),
                    &args as *const XattrArgs,
                    size_of::<XattrArgs>(),
                )
            })
        })
    };
    at_or_proc(value, at, |value| {
        rustix::fs::lgetxattr(&*proc_path(dir, name), attr, value)
    })
}

/// `llistxattr` of `name` in `dir` into `list`: the list's length.
pub fn llistxattr_at(dir: &DirFd, name: &CStr, list: &mut [u8]) -> Result<usize, Errno> {
    let at = |list: &mut [u8]| {
        // SAFETY: `name` is NUL-terminated; the kernel writes at most `list.len()` bytes into
        // `list`, which outlives the call; `dir` is an open fd for the call's length.
        result(unsafe {
            libc::syscall(
                SYS_LISTXATTRAT,
                dir.as_raw_fd(),
                at_name(name).as_ptr(),
                libc::AT_SYMLINK_NOFOLLOW,
                list.as_mut_ptr(),
                list.len(),
            )
        })
    };
    at_or_proc(list, at, |list| {
        rustix::fs::llistxattr(&*proc_path(dir, name), list)
    })
}

/// `at` into `buf`, or `proc` (the `/proc/self/fd` path) once the kernel said it lacks the
/// `*xattrat` calls.
fn at_or_proc(
    buf: &mut [u8],
    at: impl FnOnce(&mut [u8]) -> Result<usize, Errno>,
    proc: impl FnOnce(&mut [u8]) -> Result<usize, Errno>,
) -> Result<usize, Errno> {
    if !XATTRAT_MISSING.load(Ordering::Relaxed) {
        match at(buf) {
            Err(Errno::NOSYS) => XATTRAT_MISSING.store(true, Ordering::Relaxed),
            done => return done,
        }
    }
    proc(buf)
}

/// The directory itself for an empty name (`.`, not followed further), as [`proc_path`] does.
fn at_name(name: &CStr) -> &CStr {
    if name.is_empty() { c"." } else { name }
}

/// A raw system call's return: a length, or the errno it set.
fn result(ret: libc::c_long) -> Result<usize, Errno> {
    usize::try_from(ret)
        .map_err(|_| Errno::from_io_error(&std::io::Error::last_os_error()).unwrap_or(Errno::IO))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rustix::fs::{Mode, OFlags, XattrFlags};

    use super::*;

    /// Both calls answer as the `/proc/self/fd` path does: the same values and lists, for a
    /// file, a dangling symlink (not followed) and the directory itself, and the same errors.
    #[test]
    fn the_at_calls_answer_as_the_proc_path_does() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let flags = OFlags::DIRECTORY | OFlags::RDONLY;
        let dir: DirFd =
            Arc::new(rustix::fs::open(tmp.path(), flags, Mode::empty()).expect("open"));
        std::fs::write(tmp.path().join("f"), b"x").expect("file");
        std::os::unix::fs::symlink("nowhere", tmp.path().join("l")).expect("symlink");
        for (name, value) in [(c"f", "file"), (c"l", "link"), (c"", "dir")] {
            let path = proc_path(&dir, name);
            rustix::fs::lsetxattr(&*path, "trusted.k", value.as_bytes(), XattrFlags::empty())
                .expect("set (as root)");
        }
        for name in [c"f", c"l", c"", c"missing"] {
            let path = proc_path(&dir, name);
            let (mut a, mut b) = ([0u8; 64], [0u8; 64]);
            let got = lgetxattr_at(&dir, name, "trusted.k", &mut a);
            let want = rustix::fs::lgetxattr(&*path, "trusted.k", &mut b);
            assert_eq!(got, want, "{name:?}");
            assert_eq!(a, b, "{name:?}");
            let got = llistxattr_at(&dir, name, &mut a);
            let want = rustix::fs::llistxattr(&*path, &mut b);
            assert_eq!(got, want, "{name:?}");
            assert_eq!(a, b, "{name:?}");
        }
        let absent = lgetxattr_at(&dir, c"f", "trusted.absent", &mut [0u8; 8]);
        assert_eq!(absent, Err(Errno::NODATA));
        let small = lgetxattr_at(&dir, c"f", "trusted.k", &mut [0u8; 2]);
        assert_eq!(small, Err(Errno::RANGE));
        assert!(!XATTRAT_MISSING.load(Ordering::Relaxed) || kernel_predates_xattrat());
    }

    /// Whether this kernel lacks the calls (before 6.13), where the fallback was what ran.
    fn kernel_predates_xattrat() -> bool {
        let release = rustix::system::uname()
            .release()
            .to_string_lossy()
            .into_owned();
        let mut parts = release
            .split(['.', '-'])
            .map(|p| p.parse::<u32>().unwrap_or(0));
        (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) < (6, 13)
    }
}
