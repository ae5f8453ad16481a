//! FUSE ↔ wire: the kernel's numbers, flags and times as Kiln's wire types and back, the
//! caller of a request as [`Creds`], a client error as the errno the kernel is given, and
//! results as fuser's replies.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use fuser::{
    AccessFlags, Errno, FileAttr, FopenFlags, Generation, INodeNo, LockOwner, RenameFlags,
    ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry,
    ReplyLock, ReplyLseek, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow,
};
use kiln_wire::limits::GROUPS_MAX;
use kiln_wire::{
    AccessMask, AccessMode, Creds, FileType, FopReply, Groups, Iatt, Lock, LockKind, Name,
    NodeType, OpenFlags, RenameMode, SeekWhat, TimeSet, Timespec, XattrName, XattrSetMode,
};

use super::shared::Ttl;
use crate::Error;
use crate::layer::{DOT_OFFSET_MAX, FdFop};

/// What a mount's fop ends in: a value for the reply, or the errno the kernel is given.
pub(super) type Result<T> = std::result::Result<T, Errno>;

/// Node generations never change: node ids are derived from GFIDs, which are never reused.
pub(super) const GEN: Generation = Generation(0);

/// The end of a POSIX lock that runs to the end of the file (the kernel's `OFFSET_MAX`).
pub(super) const LOCK_END_OF_FILE: u64 = i64::MAX as u64;

/// The caller of `req`, with its supplementary groups, which FUSE does not pass: they come
/// from `/proc` (root's are not needed: it passes every permission check).
pub(super) fn creds(req: &Request) -> Creds {
    let groups = if req.uid() == 0 {
        Groups::default()
    } else {
        supplementary_groups(req.pid())
    };
    Creds {
        uid: req.uid(),
        gid: req.gid(),
        groups,
        pid: req.pid(),
    }
}

fn supplementary_groups(pid: u32) -> Groups {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let groups = status
        .lines()
        .find_map(|line| line.strip_prefix("Groups:"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|g| g.parse().ok())
        .take(GROUPS_MAX)
        .collect();
    Groups::new(groups).unwrap_or_default()
}

/// How the kernel should treat a file opened with `flags`: O_DIRECT bypasses its page cache
/// (the brick's own cache still serves it: the brick cannot honour O_DIRECT's alignment
/// rules for buffers it did not allocate, and O_DIRECT promises no durability anyway); other
/// opens keep what is cached, which goes when the file changes elsewhere ([`super::pages`]).
pub(super) fn fopen_flags(flags: i32) -> FopenFlags {
    if flags & libc::O_DIRECT != 0 {
        FopenFlags::FOPEN_DIRECT_IO
    } else {
        FopenFlags::FOPEN_KEEP_CACHE
    }
}

pub(super) fn requested_access(flags: i32) -> AccessMode {
    match flags & libc::O_ACCMODE {
        libc::O_WRONLY => AccessMode::WriteOnly,
        libc::O_RDWR => AccessMode::ReadWrite,
        _ => AccessMode::ReadOnly,
    }
}

/// The access mode and flags an open with kernel `flags` asks the brick for.
pub(super) fn open_mode(flags: i32, writeback_cache: bool) -> (AccessMode, OpenFlags) {
    let mut access = requested_access(flags);
    let mut wire = OpenFlags::empty();
    for (bit, flag) in [
        (libc::O_APPEND, OpenFlags::APPEND),
        (libc::O_TRUNC, OpenFlags::TRUNC),
        (libc::O_SYNC, OpenFlags::SYNC),
        (libc::O_DSYNC, OpenFlags::DSYNC),
        (libc::O_NOATIME, OpenFlags::NOATIME),
    ] {
        if flags & bit == bit {
            wire = wire | flag;
        }
    }
    if writeback_cache {
        // The kernel reads pages of write-only files to fill its cache, and appends at
        // the size it knows itself.
        if access == AccessMode::WriteOnly {
            access = AccessMode::ReadWrite;
        }
        wire = OpenFlags::from_bits(wire.bits() & !OpenFlags::APPEND.bits())
            .unwrap_or(OpenFlags::empty());
    }
    (access, wire)
}

pub(super) fn name_of(name: &OsStr) -> Result<Name> {
    Name::new(Bytes::copy_from_slice(name.as_bytes())).map_err(|e| Errno::from_i32(e.errno()))
}

pub(super) fn xattr_name(name: &OsStr) -> Result<XattrName> {
    XattrName::new(Bytes::copy_from_slice(name.as_bytes())).map_err(|e| Errno::from_i32(e.errno()))
}

pub(super) fn os(name: &Name) -> &OsStr {
    OsStr::from_bytes(name.as_bytes())
}

/// What MKNOD makes for kernel `mode`'s file type; directories and symlinks have their own
/// fops.
pub(super) fn node_type(mode: u32) -> Result<NodeType> {
    match FileType::from_mode_bits(mode) {
        Some(FileType::Regular) => Ok(NodeType::Regular),
        Some(FileType::Fifo) => Ok(NodeType::Fifo),
        Some(FileType::Socket) => Ok(NodeType::Socket),
        Some(FileType::CharDevice) => Ok(NodeType::CharDevice),
        Some(FileType::BlockDevice) => Ok(NodeType::BlockDevice),
        _ => Err(Errno::EINVAL),
    }
}

pub(super) fn rename_mode(flags: RenameFlags) -> Result<RenameMode> {
    if flags.is_empty() {
        Ok(RenameMode::Replace)
    } else if flags == RenameFlags::RENAME_NOREPLACE {
        Ok(RenameMode::NoReplace)
    } else if flags == RenameFlags::RENAME_EXCHANGE {
        Ok(RenameMode::Exchange)
    } else {
        Err(Errno::EINVAL)
    }
}

/// setxattr(2)'s flags.
pub(super) fn xattr_set_mode(flags: i32) -> Result<XattrSetMode> {
    match flags {
        0 => Ok(XattrSetMode::Upsert),
        libc::XATTR_CREATE => Ok(XattrSetMode::Create),
        libc::XATTR_REPLACE => Ok(XattrSetMode::Replace),
        _ => Err(Errno::EINVAL),
    }
}

pub(super) fn access_mask(mask: AccessFlags) -> AccessMask {
    let mut bits = AccessMask::empty();
    for (flag, bit) in [
        (AccessFlags::R_OK, AccessMask::READ),
        (AccessFlags::W_OK, AccessMask::WRITE),
        (AccessFlags::X_OK, AccessMask::EXECUTE),
    ] {
        if mask.contains(flag) {
            bits = bits | bit;
        }
    }
    bits
}

/// fallocate(2) with `mode` as fops, in order: an allocation, a hole punched (only with
/// `FALLOC_FL_KEEP_SIZE`, as Linux requires), a range zeroed (ZEROFILL, which may grow the
/// file), or a range zeroed within the size (`ZERO_RANGE | KEEP_SIZE`: the hole punched, then
/// the range allocated again, size kept, as ext4 does it in one call); anything else is
/// EOPNOTSUPP, every time, so a program that probes a mode finds what works.
pub(super) fn fallocate_fops(mode: i32, offset: u64, len: u64) -> Result<Vec<FdFop>> {
    let keep_size = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
    let allocate = move |keep_size| {
        FdFop::new(move |fd| {
            kiln_wire::Fallocate {
                fd,
                keep_size,
                offset,
                len,
            }
            .into()
        })
    };
    let punch = move || FdFop::new(move |fd| kiln_wire::Discard { fd, offset, len }.into());
    let zero = move || FdFop::new(move |fd| kiln_wire::Zerofill { fd, offset, len }.into());
    match (mode & !libc::FALLOC_FL_KEEP_SIZE, keep_size) {
        (0, _) => Ok(vec![allocate(keep_size)]),
        (libc::FALLOC_FL_PUNCH_HOLE, true) => Ok(vec![punch()]),
        (libc::FALLOC_FL_ZERO_RANGE, false) => Ok(vec![zero()]),
        (libc::FALLOC_FL_ZERO_RANGE, true) => Ok(vec![punch(), allocate(true)]),
        _ => Err(Errno::from_i32(libc::EOPNOTSUPP)),
    }
}

/// lseek(2)'s `whence`: only SEEK_DATA and SEEK_HOLE reach a file system.
pub(super) fn seek_what(whence: i32) -> Result<SeekWhat> {
    match whence {
        libc::SEEK_DATA => Ok(SeekWhat::Data),
        libc::SEEK_HOLE => Ok(SeekWhat::Hole),
        _ => Err(Errno::EINVAL),
    }
}

pub(super) fn time_set(t: TimeOrNow) -> TimeSet {
    match t {
        TimeOrNow::Now => TimeSet::Now,
        TimeOrNow::SpecificTime(t) => {
            let (sec, nsec) = match t.duration_since(UNIX_EPOCH) {
                Ok(d) => (
                    i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
                    d.subsec_nanos(),
                ),
                Err(before) => {
                    // Before 1970: whole seconds down, nanoseconds up.
                    let d = before.duration();
                    let sec = -i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
                    match d.subsec_nanos() {
                        0 => (sec, 0),
                        n => (sec - 1, Timespec::NSEC_PER_SEC - n),
                    }
                }
            };
            Timespec::new(sec, nsec).map_or(TimeSet::Now, TimeSet::At)
        }
    }
}

fn system_time(t: Timespec) -> SystemTime {
    let nanos = Duration::from_nanos(u64::from(t.nsec()));
    match u64::try_from(t.sec()) {
        Ok(sec) => UNIX_EPOCH + Duration::from_secs(sec) + nanos,
        Err(_) => UNIX_EPOCH - Duration::from_secs(t.sec().unsigned_abs()) + nanos,
    }
}

pub(super) fn file_kind(t: FileType) -> fuser::FileType {
    match t {
        FileType::Regular => fuser::FileType::RegularFile,
        FileType::Directory => fuser::FileType::Directory,
        FileType::Symlink => fuser::FileType::Symlink,
        FileType::BlockDevice => fuser::FileType::BlockDevice,
        FileType::CharDevice => fuser::FileType::CharDevice,
        FileType::Fifo => fuser::FileType::NamedPipe,
        FileType::Socket => fuser::FileType::Socket,
    }
}

pub(super) fn file_attr(ino: u64, iatt: &Iatt) -> FileAttr {
    FileAttr {
        ino: INodeNo(ino),
        size: iatt.size,
        blocks: iatt.blocks,
        atime: system_time(iatt.atime),
        mtime: system_time(iatt.mtime),
        ctime: system_time(iatt.ctime),
        crtime: UNIX_EPOCH,
        kind: file_kind(iatt.file_type),
        perm: iatt.mode.bits() as u16,
        nlink: iatt.nlink,
        uid: iatt.uid,
        gid: iatt.gid,
        // The kernel's dev_t encoding (new_encode_dev) fits 32 bits for every device
        // number a local file system hands out.
        rdev: u32::try_from(iatt.rdev).unwrap_or(u32::MAX),
        blksize: iatt.blksize,
        flags: 0,
    }
}

/// The attributes of a negative entry: node 0 says "no such name".
pub(super) fn negative_attr() -> FileAttr {
    FileAttr {
        ino: INodeNo(0),
        size: 0,
        blocks: 0,
        atime: UNIX_EPOCH,
        mtime: UNIX_EPOCH,
        ctime: UNIX_EPOCH,
        crtime: UNIX_EPOCH,
        kind: fuser::FileType::RegularFile,
        perm: 0,
        nlink: 0,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 0,
        flags: 0,
    }
}

/// `.` and `..`, which no brick lists: a listing's first two entries, each with the offset
/// after it (no layer gives an entry those offsets).
const DOTS: [(&str, u64); 2] = [(".", DOT_OFFSET_MAX - 1), ("..", DOT_OFFSET_MAX)];

/// The inode number libfuse lists for an entry whose number it does not know.
const UNKNOWN_INO: u64 = 0xffff_ffff;

/// What is left of `.` and `..` to list from the kernel's `offset`, and the offset the
/// layers' listing goes on from.
pub(super) fn dots_from(offset: u64) -> (&'static [(&'static str, u64)], u64) {
    match usize::try_from(offset) {
        Ok(n) if n <= DOTS.len() => (&DOTS[n..], 0),
        _ => (&[], offset),
    }
}

/// What a listing of directory `dir` shows of `.` or `..` (`dot`): the directory itself, or
/// its parent, which the mount knows only of the root (itself; elsewhere the unknown inode).
/// The kernel takes neither as a lookup, so only the number and type count.
pub(super) fn dot_attr(dir: INodeNo, dot: &str) -> FileAttr {
    let ino = match dot {
        "." => dir,
        _ if dir == INodeNo::ROOT => dir,
        _ => INodeNo(UNKNOWN_INO),
    };
    FileAttr {
        ino,
        kind: fuser::FileType::Directory,
        ..negative_attr()
    }
}

pub(super) fn attr_of(reply: std::result::Result<FopReply, Error>) -> Result<Iatt> {
    match reply.map_err(errno)? {
        FopReply::Stat(r) | FopReply::Fstat(r) => Ok(r.iatt),
        FopReply::Setattr(r) | FopReply::Fsetattr(r) | FopReply::Ftruncate(r) => Ok(r.post),
        other => Err(unexpected(&other)),
    }
}

/// The errno the caller sees: the brick's own, or EIO when the volume could not be reached
/// (the call may or may not have run).
pub(super) fn errno(e: Error) -> Errno {
    match e {
        Error::Fop(code) => Errno::from_i32(code.to_errno()),
        e => {
            tracing::warn!(error = %e, "fop failed: EIO");
            Errno::EIO
        }
    }
}

pub(super) fn unexpected(reply: &FopReply) -> Errno {
    tracing::error!(
        fop = reply.code().name(),
        "the brick answered with another fop"
    );
    Errno::EIO
}

/// A POSIX lock from FUSE's form (inclusive end, `OFFSET_MAX` for "to the end").
pub(super) fn wire_lock(
    typ: i32,
    start: u64,
    end: u64,
    pid: u32,
    owner: LockOwner,
) -> Result<Lock> {
    let kind = match typ {
        libc::F_RDLCK => LockKind::Read,
        libc::F_WRLCK => LockKind::Write,
        libc::F_UNLCK => LockKind::Unlock,
        _ => return Err(Errno::EINVAL),
    };
    let len = if end >= LOCK_END_OF_FILE {
        0
    } else {
        end.checked_sub(start).map(|d| d + 1).ok_or(Errno::EINVAL)?
    };
    Ok(Lock {
        kind,
        start,
        len,
        pid,
        owner: owner.0,
    })
}

/// A wire lock in FUSE's form: start, inclusive end, type and pid.
pub(super) fn fuse_lock(lock: &Lock) -> (u64, u64, i32, u32) {
    let typ = match lock.kind {
        LockKind::Read => libc::F_RDLCK,
        LockKind::Write => libc::F_WRLCK,
        LockKind::Unlock => libc::F_UNLCK,
    };
    let end = match lock.len {
        0 => LOCK_END_OF_FILE,
        len => lock.start.saturating_add(len - 1),
    };
    (lock.start, end, typ, lock.pid)
}

/// The error half of every fuser reply type.
pub(super) trait Fail {
    fn fail(self, e: Errno);
}

macro_rules! fail {
    ($($t:ty),*) => {$(
        impl Fail for $t {
            fn fail(self, e: Errno) {
                self.error(e);
            }
        }
    )*};
}
fail!(
    ReplyAttr,
    ReplyCreate,
    ReplyData,
    ReplyDirectory,
    ReplyDirectoryPlus,
    ReplyEmpty,
    ReplyEntry,
    ReplyLock,
    ReplyLseek,
    ReplyOpen,
    ReplyStatfs,
    ReplyWrite,
    ReplyXattr
);

pub(super) fn reply_entry(reply: ReplyEntry, (attr, ttl): (FileAttr, Ttl)) {
    reply.entry_with_ttls(&ttl.attr, &ttl.entry, &attr, GEN);
}

/// Answers a GETXATTR or LISTXATTR: the size when asked for it (`size` 0), else the bytes if
/// they fit.
pub(super) fn reply_xattr(reply: ReplyXattr, size: u32, value: &[u8]) {
    let len = u32::try_from(value.len()).unwrap_or(u32::MAX);
    if size == 0 {
        reply.size(len);
    } else if len > size {
        reply.error(Errno::from_i32(libc::ERANGE));
    } else {
        reply.data(value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_roundtrip_across_the_epoch() {
        for (sec, nsec) in [(0, 0), (1_700_000_000, 5), (-1, 999_999_999), (-100, 0)] {
            let t = Timespec::new(sec, nsec).expect("valid");
            assert_eq!(
                time_set(TimeOrNow::SpecificTime(system_time(t))),
                TimeSet::At(t)
            );
        }
    }

    #[test]
    fn locks_convert_with_inclusive_ends() {
        let owner = LockOwner(7);
        let lock = wire_lock(libc::F_WRLCK, 10, 19, 3, owner).expect("valid");
        assert_eq!((lock.start, lock.len, lock.kind), (10, 10, LockKind::Write));
        assert_eq!(fuse_lock(&lock), (10, 19, libc::F_WRLCK, 3));
        let whole = wire_lock(libc::F_RDLCK, 0, LOCK_END_OF_FILE, 3, owner).expect("valid");
        assert_eq!(whole.len, 0);
        assert_eq!(fuse_lock(&whole).1, LOCK_END_OF_FILE);
        assert!(wire_lock(libc::F_RDLCK, 10, 5, 3, owner).is_err());
        assert!(wire_lock(99, 0, 1, 3, owner).is_err());
    }

    #[test]
    fn groups_of_this_process_are_read() {
        let mine = supplementary_groups(std::process::id());
        let expected = rustix::process::getgroups().expect("getgroups");
        assert_eq!(mine.as_slice().len(), expected.len().min(GROUPS_MAX));
    }
}
