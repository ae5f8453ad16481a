//! Start-up repair of interrupted namespace fops, and `kiln-brickd check`.
//!
//! Every multi-step namespace fop writes an intent record into `.glusterfs/kiln-pending`
//! before its first step and removes it after its last (see `docs/disk-layout.md`). The record
//! is made by the same file system as the steps, and ext4 and XFS journal metadata in order,
//! so a record is on disk whenever any later step of its fop is: no fdatasync is needed on the
//! create path. At start-up [`repair`] settles every record found, deterministically:
//!
//! | record | meaning | settled by |
//! |---|---|---|
//! | `new-<gfid>` → `<parent>/<name>` | a create/mkdir/mknod/symlink in flight | name present: finish (GFID, handle); absent: undo |
//! | `del-<gfid>` (the moved handle) | an rmdir, an unlink of one of several names, or a replacing rename in flight | object still named: put the handle back; else delete |
//! | `dir-<gfid>` → the directory's GFID | creates of files, or unlinks of last names, in that directory | every non-directory there gets its handle |
//! | `mv-<gfid>` → new handle target | a directory rename in flight | directory at the new place: install as handle; else delete |
//!
//! [`check`] walks the whole brick (named tree and handle index) and finds what no record
//! covers: objects without a GFID, missing or wrong handles, stale handles, dangling directory
//! handles — and repairs them when asked.

use std::ffi::CString;
use std::os::fd::AsFd;
use std::sync::Arc;

use kiln_wire::Gfid;
use rustix::fs::{AtFlags, Mode, OFlags, StatxFlags};
use rustix::io::Errno;

use crate::brick::intent::{self, RecordKind, names_in, parse_record};
use crate::brick::layout::{open_dir_by_gfid, read_gfid};
use crate::brick::{Brick, GFID_XATTR, GLUSTERFS_DIR, new_gfid};
use crate::op::{DirFd, cstr, proc_path};

/// What start-up repair did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RepairReport {
    /// Fops whose commit had happened: their remaining steps were done.
    pub completed: usize,
    /// Fops whose commit had not happened: their early steps were undone.
    pub rolled_back: usize,
}

fn lstat(dir: impl AsFd, name: &CString) -> Result<rustix::fs::Statx, Errno> {
    rustix::fs::statx(
        dir,
        &**name,
        AtFlags::SYMLINK_NOFOLLOW,
        StatxFlags::BASIC_STATS,
    )
}

fn is_dir(st: &rustix::fs::Statx) -> bool {
    u32::from(st.stx_mode) & libc::S_IFMT == libc::S_IFDIR
}

fn is_symlink(st: &rustix::fs::Statx) -> bool {
    u32::from(st.stx_mode) & libc::S_IFMT == libc::S_IFLNK
}

fn ignore_missing(r: Result<(), Errno>) -> Result<(), Errno> {
    match r {
        Err(Errno::NOENT | Errno::EXIST) => Ok(()),
        other => other,
    }
}

/// Makes `gfid`'s handle for the object `parent_dir/name` when it is missing.
fn ensure_handle(
    brick: &Brick,
    gfid: &Gfid,
    parent: &Gfid,
    parent_dir: &DirFd,
    name: &[u8],
    dir: bool,
) -> Result<(), Errno> {
    brick.ensure_handle_parent(gfid)?;
    let handle = Brick::handle_name(gfid);
    let made = match dir {
        true => rustix::fs::symlinkat(
            cstr(&Brick::dir_handle_target(parent, name)).as_c_str(),
            brick.handle_dir(gfid),
            &*handle,
        ),
        false => rustix::fs::linkat(
            parent_dir,
            cstr(name).as_c_str(),
            brick.handle_dir(gfid),
            &*handle,
            AtFlags::empty(),
        ),
    };
    ignore_missing(made)
}

/// The directory named by a handle target (`../../PA/RG/<parent>/<name>`) if it exists there
/// and carries `gfid`.
fn dir_at_target(brick: &Brick, target: &[u8], gfid: &Gfid) -> bool {
    let Some((parent, name)) = Brick::parse_dir_handle_target(target) else {
        return false;
    };
    let Ok(parent_dir) = open_dir_by_gfid(brick, &parent, 0) else {
        return false;
    };
    matches!(read_gfid(&parent_dir, &cstr(&name)), Ok(Some(g)) if g == *gfid)
}

/// A record's name and, when Kiln made it, what it says.
type Record = (Vec<u8>, Option<(RecordKind, Gfid)>);

/// Settles every intent record left by fops a crash interrupted. Runs before the engine
/// starts, so nothing races with it.
pub fn repair(brick: &Brick) -> Result<RepairReport, Errno> {
    let mut report = RepairReport::default();
    // Directory moves first, so every parent a `new` or `del` record names resolves through
    // its final handle; then removals, then creates.
    let mut records: Vec<Record> = names_in(&brick.pending)?
        .into_iter()
        .map(|r| {
            let parsed = parse_record(&r);
            (r, parsed)
        })
        .collect();
    let moves = records
        .iter()
        .filter_map(|(r, p)| match p {
            Some((RecordKind::Mv, gfid)) => Some((r.clone(), *gfid)),
            _ => None,
        })
        .collect();
    settle_moves(brick, moves, &mut report)?;
    records.retain(|(_, p)| !matches!(p, Some((RecordKind::Mv, _))));
    records.sort_by_key(|(_, p)| !matches!(p, Some((RecordKind::Del, _))));
    for (record, parsed) in records {
        let record_c = cstr(&record);
        let text = String::from_utf8_lossy(&record).into_owned();
        let completed = match parsed {
            Some((RecordKind::New, gfid)) => settle_new(brick, &record_c, &gfid)?,
            Some((RecordKind::Del, gfid)) => settle_del(brick, &record_c, &gfid)?,
            Some((RecordKind::Dir, gfid)) => settle_dir(brick, &record_c, &gfid)?,
            _ => {
                tracing::warn!(record = %text, "unknown intent record removed");
                remove_record(brick, &record_c)?;
                continue;
            }
        };
        tracing::info!(record = %text, completed, "settled an interrupted fop");
        match completed {
            true => report.completed += 1,
            false => report.rolled_back += 1,
        }
    }
    Ok(report)
}

/// Settles directory renames. A move inside a moved directory resolves only once the outer one
/// is installed, so moves are settled in passes while they make progress; the rest did not
/// happen.
fn settle_moves(
    brick: &Brick,
    mut moves: Vec<(Vec<u8>, Gfid)>,
    report: &mut RepairReport,
) -> Result<(), Errno> {
    loop {
        let before = moves.len();
        let mut left = Vec::new();
        for (record, gfid) in moves {
            let record_c = cstr(&record);
            let target = rustix::fs::readlinkat(&brick.pending, &*record_c, Vec::new())?;
            if dir_at_target(brick, target.as_bytes(), &gfid) {
                install_or_drop(brick, &record_c, &gfid, true)?;
                tracing::info!(record = %String::from_utf8_lossy(&record), "settled an interrupted rename");
                report.completed += 1;
            } else {
                left.push((record, gfid));
            }
        }
        moves = left;
        if moves.is_empty() || moves.len() == before {
            break;
        }
    }
    for (record, gfid) in moves {
        install_or_drop(brick, &cstr(&record), &gfid, false)?;
        report.rolled_back += 1;
    }
    Ok(())
}

fn remove_record(brick: &Brick, record: &CString) -> Result<(), Errno> {
    ignore_missing(rustix::fs::unlinkat(
        &brick.pending,
        &**record,
        AtFlags::empty(),
    ))
}

/// Creates of regular files or unlinks of files were going on in directory `dir_gfid`: a new
/// file is made whole as an unnamed file (GFID and data) and then named, and a file's last
/// name goes after its handle, so a crash can have left a named file without its handle, never
/// a name without its GFID. Every non-directory there gets its handle; the record goes.
/// Whether any handle was missing.
fn settle_dir(brick: &Brick, record: &CString, dir_gfid: &Gfid) -> Result<bool, Errno> {
    let Ok(dir) = open_dir_by_gfid(brick, dir_gfid, 0) else {
        // The directory went after the creates: nothing left to name.
        remove_record(brick, record)?;
        return Ok(false);
    };
    let mut healed = false;
    for name in names_in(&dir)? {
        if dir_gfid.is_root() && name == GLUSTERFS_DIR.as_bytes() {
            continue;
        }
        let name_c = cstr(&name);
        let file = lstat(&dir, &name_c)
            .is_ok_and(|st| u32::from(st.stx_mode) & libc::S_IFMT != libc::S_IFDIR);
        let Some(gfid) = file
            .then(|| read_gfid(&dir, &name_c))
            .transpose()?
            .flatten()
        else {
            continue;
        };
        let handle = lstat(brick.handle_dir(&gfid), &Brick::handle_name(&gfid));
        if handle.is_err() {
            ensure_handle(brick, &gfid, dir_gfid, &dir, &name, false)?;
            healed = true;
        }
    }
    remove_record(brick, record)?;
    Ok(healed)
}

fn settle_new(brick: &Brick, record: &CString, gfid: &Gfid) -> Result<bool, Errno> {
    let target = rustix::fs::readlinkat(&brick.pending, &**record, Vec::new())?;
    let Some((parent, name)) = intent::parse_new_target(target.as_bytes()) else {
        remove_record(brick, record)?;
        return Ok(false);
    };
    let name_c = cstr(&name);
    let parent_dir = open_dir_by_gfid(brick, &parent, 0).ok();
    let object = parent_dir
        .as_ref()
        .and_then(|d| lstat(d, &name_c).ok().map(|st| (d.clone(), st)));
    let Some((parent_dir, st)) = object else {
        // Not committed: nothing carries the name; remove a handle the fop may have made.
        remove_orphan_handle(brick, gfid)?;
        remove_record(brick, record)?;
        return Ok(false);
    };
    let path = proc_path(&parent_dir, &name_c);
    let committed = match read_gfid(&parent_dir, &name_c)? {
        None => {
            ignore_missing(rustix::fs::lsetxattr(
                &*path,
                GFID_XATTR,
                gfid.as_bytes(),
                rustix::fs::XattrFlags::CREATE,
            ))?;
            true
        }
        Some(found) => found == *gfid,
    };
    if committed {
        ensure_handle(brick, gfid, &parent, &parent_dir, &name, is_dir(&st))?;
    } else {
        // The name belonged to another object (the create failed with EEXIST).
        remove_orphan_handle(brick, gfid)?;
    }
    remove_record(brick, record)?;
    Ok(committed)
}

/// Removes `gfid`'s handle when nothing else names the object.
fn remove_orphan_handle(brick: &Brick, gfid: &Gfid) -> Result<(), Errno> {
    let handle = Brick::handle_name(gfid);
    let Ok(st) = lstat(brick.handle_dir(gfid), &handle) else {
        return Ok(());
    };
    let own = read_gfid(brick.handle_dir(gfid), &handle).ok().flatten() == Some(*gfid);
    let orphan = if is_symlink(&st) && !own {
        let target = rustix::fs::readlinkat(brick.handle_dir(gfid), &*handle, Vec::new())?;
        !dir_at_target(brick, target.as_bytes(), gfid)
    } else {
        st.stx_nlink <= 1
    };
    if orphan {
        ignore_missing(rustix::fs::unlinkat(
            brick.handle_dir(gfid),
            &*handle,
            AtFlags::empty(),
        ))?;
    }
    Ok(())
}

fn settle_del(brick: &Brick, record: &CString, gfid: &Gfid) -> Result<bool, Errno> {
    let pending = &brick.pending;
    let st = lstat(pending, record)?;
    let own = read_gfid(pending, record)?.is_some_and(|g| g == *gfid);
    let still_named = if is_symlink(&st) && !own {
        let target = rustix::fs::readlinkat(pending, &**record, Vec::new())?;
        dir_at_target(brick, target.as_bytes(), gfid)
    } else {
        st.stx_nlink >= 2
    };
    // Not committed (a name is left): the handle goes back; committed: it goes.
    install_or_drop(brick, record, gfid, still_named)?;
    Ok(!still_named)
}

/// Renames `record` into place as `gfid`'s handle (`install`), or removes it.
fn install_or_drop(
    brick: &Brick,
    record: &CString,
    gfid: &Gfid,
    install: bool,
) -> Result<(), Errno> {
    let pending = &brick.pending;
    if install {
        brick.ensure_handle_parent(gfid)?;
        let handle = Brick::handle_name(gfid);
        rustix::fs::renameat(pending, &**record, brick.handle_dir(gfid), &*handle)
    } else {
        ignore_missing(rustix::fs::unlinkat(pending, &**record, AtFlags::empty()))
    }
}

/// What `check` found (and, when repairing, fixed).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CheckReport {
    pub objects: usize,
    pub handles: usize,
    pub missing_gfid: usize,
    pub missing_handle: usize,
    pub wrong_handle: usize,
    pub stale_handle: usize,
    pub dangling_dir_handle: usize,
    pub pending_records: usize,
    pub repaired: bool,
}

impl CheckReport {
    /// Problems found (0 for a consistent brick).
    pub fn problems(&self) -> usize {
        self.missing_gfid
            + self.missing_handle
            + self.wrong_handle
            + self.stale_handle
            + self.dangling_dir_handle
            + self.pending_records
    }
}

impl std::fmt::Display for CheckReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let verb = if self.repaired { "repaired" } else { "found" };
        writeln!(f, "objects checked        {}", self.objects)?;
        writeln!(f, "handles checked        {}", self.handles)?;
        writeln!(f, "pending intent records {} {verb}", self.pending_records)?;
        writeln!(f, "objects without gfid   {} {verb}", self.missing_gfid)?;
        writeln!(f, "missing handles        {} {verb}", self.missing_handle)?;
        writeln!(f, "wrong handles          {} {verb}", self.wrong_handle)?;
        writeln!(f, "stale handles          {} {verb}", self.stale_handle)?;
        write!(
            f,
            "dangling dir handles   {} {verb}",
            self.dangling_dir_handle
        )
    }
}

/// Checks the whole brick; with `repair`, fixes what it finds (settling intent records first).
pub fn check(brick: &Brick, repair_found: bool) -> Result<CheckReport, Errno> {
    let mut report = CheckReport {
        repaired: repair_found,
        ..CheckReport::default()
    };
    // `dir` records mark directories with creates under way (a live brick keeps them a
    // moment after its last create there): not a problem by themselves, and the walk below
    // finds any handle one would have to make.
    report.pending_records = names_in(&brick.pending)?
        .iter()
        .filter(|r| !matches!(parse_record(r), Some((RecordKind::Dir, _))))
        .count();
    if repair_found && report.pending_records > 0 {
        repair(brick)?;
    }
    // The named tree, depth first, holding one fd per level being walked. A directory whose
    // GFID is missing (and not being repaired) is still walked; its children's directory
    // handles cannot be compared then.
    let mut stack: Vec<(Option<Gfid>, DirFd)> = vec![(Some(Gfid::ROOT), brick.root.clone())];
    while let Some((parent, dir)) = stack.pop() {
        for name in names_in(&dir)? {
            if parent == Some(Gfid::ROOT) && name == GLUSTERFS_DIR.as_bytes() {
                continue;
            }
            report.objects += 1;
            let name_c = cstr(&name);
            let Ok(st) = lstat(&dir, &name_c) else {
                continue;
            };
            let path = proc_path(&dir, &name_c);
            let gfid = match read_gfid(&dir, &name_c)? {
                Some(g) => Some(g),
                None => {
                    report.missing_gfid += 1;
                    repair_found
                        .then(|| {
                            let g = new_gfid();
                            rustix::fs::lsetxattr(
                                &*path,
                                GFID_XATTR,
                                g.as_bytes(),
                                rustix::fs::XattrFlags::CREATE,
                            )?;
                            Ok::<_, Errno>(g)
                        })
                        .transpose()?
                }
            };
            // A directory's handle names its parent, so it can be checked only under a parent
            // with a GFID; a file's handle is a hard link and needs no parent.
            if let Some(gfid) = gfid
                && (parent.is_some() || !is_dir(&st))
            {
                let parent = parent.unwrap_or(Gfid::ROOT);
                check_handle(
                    brick,
                    &mut report,
                    repair_found,
                    &gfid,
                    &parent,
                    &dir,
                    &name,
                    &st,
                )?;
            }
            if is_dir(&st) {
                let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
                let child = rustix::fs::openat(&dir, &*name_c, flags, Mode::empty())?;
                stack.push((gfid, Arc::new(child)));
            }
        }
    }
    check_index(brick, &mut report, repair_found)?;
    Ok(report)
}

#[allow(clippy::too_many_arguments, reason = "one object's full context")]
fn check_handle(
    brick: &Brick,
    report: &mut CheckReport,
    fix: bool,
    gfid: &Gfid,
    parent: &Gfid,
    dir: &DirFd,
    name: &[u8],
    st: &rustix::fs::Statx,
) -> Result<(), Errno> {
    brick.ensure_handle_parent(gfid)?;
    let handle = Brick::handle_name(gfid);
    let wrong = match lstat(brick.handle_dir(gfid), &handle) {
        Err(Errno::NOENT) => {
            report.missing_handle += 1;
            if fix {
                ensure_handle(brick, gfid, parent, dir, name, is_dir(st))?;
            }
            return Ok(());
        }
        Err(e) => return Err(e),
        Ok(h) if is_dir(st) => {
            let target = rustix::fs::readlinkat(brick.handle_dir(gfid), &*handle, Vec::new())?;
            !is_symlink(&h)
                || target.as_bytes() != Brick::dir_handle_target(parent, name).as_slice()
        }
        Ok(h) => h.stx_ino != st.stx_ino,
    };
    if wrong {
        report.wrong_handle += 1;
        if fix {
            ignore_missing(rustix::fs::unlinkat(
                brick.handle_dir(gfid),
                &*handle,
                AtFlags::empty(),
            ))?;
            ensure_handle(brick, gfid, parent, dir, name, is_dir(st))?;
        }
    }
    Ok(())
}

/// Scans `.glusterfs/XX/YY` for handles whose object is gone.
fn check_index(brick: &Brick, report: &mut CheckReport, fix: bool) -> Result<(), Errno> {
    for xx in 0..=255u8 {
        let xx_dir = brick
            .handle_dir(
                &Gfid::from_bytes([xx, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1])
                    .ok_or(Errno::IO)?,
            )
            .clone();
        for yy in names_in(&xx_dir)? {
            let Ok(yy_fd) = rustix::fs::openat(
                &xx_dir,
                cstr(&yy).as_c_str(),
                OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            ) else {
                continue;
            };
            let yy_dir: DirFd = Arc::new(yy_fd);
            for name in names_in(&yy_dir)? {
                let Some(gfid) = std::str::from_utf8(&name)
                    .ok()
                    .and_then(|s| s.parse::<Gfid>().ok())
                else {
                    continue;
                };
                if gfid.is_root() {
                    continue;
                }
                report.handles += 1;
                let name_c = cstr(&name);
                let Ok(st) = lstat(&yy_dir, &name_c) else {
                    continue;
                };
                let own = read_gfid(&yy_dir, &name_c)? == Some(gfid);
                let (bad, counter) = if is_symlink(&st) && !own {
                    (
                        open_dir_by_gfid(brick, &gfid, 0).is_err(),
                        &mut report.dangling_dir_handle,
                    )
                } else {
                    (st.stx_nlink <= 1, &mut report.stale_handle)
                };
                if bad {
                    *counter += 1;
                    if fix {
                        ignore_missing(rustix::fs::unlinkat(&yy_dir, &*name_c, AtFlags::empty()))?;
                    }
                }
            }
        }
    }
    Ok(())
}
