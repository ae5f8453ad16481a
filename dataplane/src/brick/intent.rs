//! Intent records: how a multi-step namespace fop survives a crash (`docs/disk-layout.md`).
//!
//! A record lives in `.glusterfs/kiln-pending`, named `<kind>-<gfid>-<nonce>`:
//!
//! | kind | the record is | made by |
//! |---|---|---|
//! | `new` | a symlink to `<parent gfid>/<name>` | create, mkdir, mknod, symlink |
//! | `del` | the object's handle, moved here | rmdir, unlink of a name of a file with others, a replacing rename |
//! | `mv` | a symlink to the directory's new handle target | rename of a directory |
//! | `dir` | a symlink to a directory's GFID | creates of regular files in that directory (made whole as unnamed files, then named) and unlinks of files' last names there (the handle goes first): a crash can leave a file there without its handle |
//!
//! This module names and parses records; the fops make them (`crate::fops::namespace`) and
//! start-up repair settles them (`crate::recovery`).

use std::ffi::CString;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};

use kiln_wire::Gfid;
use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;

use super::Brick;
use crate::op::{DirFd, cstr};

/// What an interrupted fop was doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordKind {
    /// A create: the record points at `<parent>/<name>`.
    New,
    /// A removal: the record is the object's handle.
    Del,
    /// A directory rename: the record points at the new handle target.
    Mv,
    /// Regular files are being created, or files unlinked, in a directory: the record points
    /// at its GFID, and repair gives every file there its handle.
    Dir,
}

impl RecordKind {
    fn prefix(self) -> &'static str {
        match self {
            RecordKind::New => "new",
            RecordKind::Del => "del",
            RecordKind::Mv => "mv",
            RecordKind::Dir => "dir",
        }
    }
}

/// A fresh record name for `kind` on `gfid`. The nonce keeps two fops on the same GFID (a
/// retry racing the original, two renames of one directory) from sharing a record.
pub fn record_name(kind: RecordKind, gfid: &Gfid) -> CString {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nonce = NEXT.fetch_add(1, Ordering::Relaxed);
    cstr(format!("{}-{gfid}-{nonce:x}", kind.prefix()).as_bytes())
}

/// Splits a record name into its kind and GFID; `None` for a name Kiln did not make.
pub fn parse_record(name: &[u8]) -> Option<(RecordKind, Gfid)> {
    let name = std::str::from_utf8(name).ok()?;
    let (kind, rest) = name.split_once('-')?;
    let kind = [
        RecordKind::New,
        RecordKind::Del,
        RecordKind::Mv,
        RecordKind::Dir,
    ]
    .into_iter()
    .find(|k| k.prefix() == kind)?;
    Some((kind, rest.get(..36)?.parse().ok()?))
}

/// What a `new` record points at: `<parent gfid>/<name>`.
pub fn new_target(parent: &Gfid, name: &[u8]) -> Vec<u8> {
    let mut target = parent.to_string().into_bytes();
    target.push(b'/');
    target.extend_from_slice(name);
    target
}

/// Parses a `new` record's target back into (parent, name).
pub fn parse_new_target(target: &[u8]) -> Option<(Gfid, Vec<u8>)> {
    let at = target.iter().position(|&b| b == b'/')?;
    let parent: Gfid = std::str::from_utf8(&target[..at]).ok()?.parse().ok()?;
    Some((parent, target[at + 1..].to_vec()))
}

/// Whether a create of `parent/name` is in flight (its `new` record exists): the object there
/// has no GFID yet because it is being made, not because it was copied in.
pub fn create_in_flight(brick: &Brick, parent: &Gfid, name: &[u8]) -> Result<bool, Errno> {
    let target = new_target(parent, name);
    for record in names_in(&brick.pending)? {
        if matches!(parse_record(&record), Some((RecordKind::New, _))) {
            let found =
                rustix::fs::readlinkat(&brick.pending, cstr(&record).as_c_str(), Vec::new());
            if found.is_ok_and(|t| t.as_bytes() == target.as_slice()) {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// Every name in `dir` but `.` and `..`.
pub fn names_in(dir: &DirFd) -> Result<Vec<Vec<u8>>, Errno> {
    let fd = rustix::fs::openat(
        dir,
        c".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut buf = vec![std::mem::MaybeUninit::<u8>::uninit(); 64 * 1024];
    let mut raw = rustix::fs::RawDir::new(fd.as_fd(), &mut buf);
    let mut names = Vec::new();
    while let Some(entry) = raw.next() {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(name.to_vec());
        }
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_parse_back() {
        let gfid: Gfid = "0a1b2c3d-0000-4000-8000-000000000009"
            .parse()
            .expect("valid");
        for kind in [
            RecordKind::New,
            RecordKind::Del,
            RecordKind::Mv,
            RecordKind::Dir,
        ] {
            let name = record_name(kind, &gfid);
            assert_eq!(parse_record(name.as_bytes()), Some((kind, gfid)));
        }
        assert_eq!(parse_record(b"other-0a1b2c3d"), None);
        let target = new_target(&gfid, b"a name");
        assert_eq!(parse_new_target(&target), Some((gfid, b"a name".to_vec())));
    }
}
