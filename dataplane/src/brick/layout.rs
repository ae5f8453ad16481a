//! Resolving GFIDs on the brick's layout: reading an object's `trusted.gfid`, opening a
//! directory by its handle (beneath the brick root, never through a magic link), and healing
//! an object that lacks a GFID or a handle. Plain blocking calls: the fops run them on the
//! blocking pool, start-up repair and `check` directly.

use std::ffi::{CStr, CString};
use std::sync::Arc;

use kiln_wire::{Gfid, Name};
use rustix::fs::{AtFlags, Mode as FsMode, OFlags, ResolveFlags};
use rustix::io::Errno;

use super::{Brick, GFID_XATTR, intent};
use crate::op::{DirFd, cstr, proc_path};
use crate::sys;

type R<T> = Result<T, Errno>;

/// Reads `trusted.gfid` of `name` in `dir` (not following a final symlink; an empty name is
/// `dir` itself).
pub fn read_gfid(dir: &DirFd, name: &CStr) -> R<Option<Gfid>> {
    let mut buf = [0u8; 16];
    match sys::lgetxattr_at(dir, name, GFID_XATTR, &mut buf[..]) {
        Ok(16) => Ok(Gfid::from_bytes(buf)),
        Ok(_) | Err(Errno::NODATA) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Symlink nesting the kernel follows before ELOOP; deeper directories resolve one level at a
/// time through their parents.
const RESOLVE_DEPTH_MAX: usize = 4096;

/// Opens directory `gfid` by its handle: `openat2` beneath the brick root with no magic links
/// (nothing can escape the brick), then checks the directory really carries `gfid`.
pub fn open_dir_by_gfid(brick: &Brick, gfid: &Gfid, depth: usize) -> R<DirFd> {
    if gfid.is_root() {
        return Ok(brick.root.clone());
    }
    if depth > RESOLVE_DEPTH_MAX {
        return Err(Errno::LOOP);
    }
    let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
    let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS;
    // RESOLVE_BENEATH answers EAGAIN when a rename anywhere raced with the walk through the
    // handle's `..` components; retry a few times, then walk one level at a time.
    const RACED_RETRIES: usize = 8;
    let mut attempt = 0;
    let fd = loop {
        match rustix::fs::openat2(
            &brick.root,
            Brick::handle_path(gfid),
            flags,
            FsMode::empty(),
            resolve,
        ) {
            Ok(fd) => break fd,
            Err(Errno::NOENT) => return Err(not_a_dir_or_stale(brick, gfid)),
            // A user's symlink pointing out of the brick (refused by RESOLVE_BENEATH) or at a
            // non-directory.
            Err(Errno::XDEV | Errno::NOTDIR) => return Err(not_a_dir_or_stale(brick, gfid)),
            Err(Errno::AGAIN) if attempt < RACED_RETRIES => attempt += 1,
            // Deeper than the kernel's symlink limit, or renames keep racing: resolve the
            // parent, then one name.
            Err(Errno::LOOP | Errno::AGAIN) => match open_through_parent(brick, gfid, depth) {
                Ok(fd) => break fd,
                Err(Errno::NOENT) => return Err(not_a_dir_or_stale(brick, gfid)),
                Err(e) => return Err(e),
            },
            Err(e) => return Err(e),
        }
    };
    let dir = Arc::new(fd);
    match read_gfid(&dir, c"")? {
        Some(found) if found == *gfid => Ok(dir),
        _ => Err(not_a_dir_or_stale(brick, gfid)),
    }
}

/// Opens directory `gfid` as `<its parent>/<its name>`, read from its handle symlink.
fn open_through_parent(brick: &Brick, gfid: &Gfid, depth: usize) -> R<std::os::fd::OwnedFd> {
    let handle = Brick::handle_name(gfid);
    // Only a handle the brick made (a symlink without a GFID of its own) names a parent and a
    // name; a user's symlink carries its own GFID and text the client chose.
    if read_gfid(brick.handle_dir(gfid), &handle)? == Some(*gfid) {
        return Err(Errno::NOTDIR);
    }
    let target = rustix::fs::readlinkat(brick.handle_dir(gfid), &*handle, Vec::new())?;
    let (parent, name) = Brick::parse_dir_handle_target(target.as_bytes()).ok_or(Errno::STALE)?;
    if Name::new(name.clone()).is_err() {
        return Err(Errno::STALE);
    }
    let parent = open_dir_by_gfid(brick, &parent, depth + 1)?;
    let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW;
    rustix::fs::openat(&parent, cstr(&name).as_c_str(), flags, FsMode::empty())
}

/// Why `gfid` did not resolve to a directory: ENOTDIR when its handle is the object itself (a
/// file or a user's symlink, which carries the GFID), ESTALE when there is no such object.
fn not_a_dir_or_stale(brick: &Brick, gfid: &Gfid) -> Errno {
    let handle = Brick::handle_name(gfid);
    match rustix::fs::statx(
        brick.handle_dir(gfid),
        &*handle,
        AtFlags::SYMLINK_NOFOLLOW,
        rustix::fs::StatxFlags::TYPE,
    ) {
        Ok(st) if u32::from(st.stx_mode) & libc::S_IFMT != libc::S_IFLNK => Errno::NOTDIR,
        Ok(_) if read_gfid(brick.handle_dir(gfid), &handle) == Ok(Some(*gfid)) => Errno::NOTDIR,
        _ => Errno::STALE,
    }
}

/// Reads the GFID of `dir/name`; an object without one gets a new GFID and handle (it was put
/// into the brick behind Kiln's back), and a missing handle is made again.
pub fn read_or_heal_gfid(
    brick: &Brick,
    parent: &Gfid,
    dir: &DirFd,
    name: &CString,
    is_dir: bool,
) -> R<Gfid> {
    let gfid = match read_gfid(dir, name)? {
        Some(g) => g,
        // Being created right now: its GFID is on the way; the name does not exist yet.
        None if intent::create_in_flight(brick, parent, name.as_bytes())? => {
            return Err(Errno::NOENT);
        }
        None => {
            let g = super::new_gfid();
            match rustix::fs::lsetxattr(
                &*proc_path(dir, name),
                GFID_XATTR,
                g.as_bytes(),
                rustix::fs::XattrFlags::CREATE,
            ) {
                Ok(()) => {}
                // Another fop assigned one first: use it.
                Err(Errno::EXIST) => return read_gfid(dir, name)?.ok_or(Errno::IO),
                Err(e) => return Err(e),
            }
            tracing::info!(gfid = %g, "assigned a gfid to an object that had none");
            g
        }
    };
    brick.ensure_handle_parent(&gfid)?;
    let handle = Brick::handle_name(&gfid);
    match rustix::fs::statx(
        brick.handle_dir(&gfid),
        &*handle,
        AtFlags::SYMLINK_NOFOLLOW,
        rustix::fs::StatxFlags::TYPE,
    ) {
        Ok(_) => {}
        Err(Errno::NOENT) => {
            let made = match is_dir {
                true => rustix::fs::symlinkat(
                    cstr(&Brick::dir_handle_target(parent, name.as_bytes())).as_c_str(),
                    brick.handle_dir(&gfid),
                    &*handle,
                ),
                false => rustix::fs::linkat(
                    dir,
                    &**name,
                    brick.handle_dir(&gfid),
                    &*handle,
                    AtFlags::empty(),
                ),
            };
            match made {
                Ok(()) | Err(Errno::EXIST) => tracing::info!(%gfid, "re-made a missing handle"),
                Err(e) => return Err(e),
            }
        }
        Err(e) => return Err(e),
    }
    Ok(gfid)
}
