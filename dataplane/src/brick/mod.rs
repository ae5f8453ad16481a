//! The brick on disk: GlusterFS's posix layout, opened once and held as directory fds.
//!
//! ```text
//! <brick>/                      the named tree, as clients see it; trusted.gfid = …01
//! <brick>/.glusterfs/XX/YY/<gfid>   hard link (non-directories) or relative symlink
//!                                   ../../PA/RG/<parent-gfid>/<name> (directories)
//! <brick>/.glusterfs/00/00/<root>   symlink ../../.. (the root)
//! <brick>/.glusterfs/kiln-pending/  intent records of namespace fops in flight (recovery.rs)
//! ```
//!
//! The brick root, `.glusterfs`, the pending directory and the 256 `.glusterfs/XX` directories
//! are opened once, `O_PATH`, and every name operation is relative to one of them. GFIDs are
//! resolved on this layout by [`layout`]; interrupted namespace fops are named by [`intent`];
//! a GlusterFS brick is made a Kiln brick in place by [`adopt`].

pub mod adopt;
pub mod intent;
pub mod layout;

use std::ffi::CString;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_wire::{BrickId, Gfid};
use rustix::fs::{AtFlags, Mode, OFlags, StatxFlags, XattrFlags};
use rustix::io::Errno;

use crate::op::DirFd;

/// The xattr holding an object's GFID (16 raw bytes), as in GlusterFS.
pub const GFID_XATTR: &str = "trusted.gfid";
/// The xattr on the brick root holding the brick id (16 raw bytes).
pub const BRICK_ID_XATTR: &str = "trusted.kiln.brick-id";
/// GlusterFS's volume id on the brick root; a GlusterFS brick is adopted when it has one.
pub const GLUSTER_VOLUME_ID_XATTR: &str = "trusted.glusterfs.volume-id";
/// The housekeeping directory under the brick root. Clients never see or name it.
pub const GLUSTERFS_DIR: &str = ".glusterfs";
/// Where intent records of in-flight namespace fops live.
pub const PENDING_DIR: &str = "kiln-pending";

/// Why a brick could not be formatted or opened.
#[derive(Debug, thiserror::Error)]
pub enum BrickError {
    #[error("brick directory {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{0} is not a brick (no trusted.gfid on its root); format it first with `kiln-brickd format`"
    )]
    NotABrick(PathBuf),
    #[error("{path}: the root's trusted.gfid is {found}, not the root gfid")]
    WrongRootGfid { path: PathBuf, found: String },
    #[error(
        "{0} is not empty; refusing to format a directory that holds data (only a GlusterFS \
         brick is adopted: .glusterfs/ and the root gfid in trusted.gfid on its root)"
    )]
    NotEmpty(PathBuf),
    #[error(
        "{0}: directories were renamed while the brick was being adopted; stop whatever serves \
         it and format it again"
    )]
    TreeChanged(PathBuf),
    #[error("the brick needs root (CAP_SYS_ADMIN) for trusted.* xattrs and per-caller credentials")]
    NotRoot,
}

/// What `format` made of a directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Formatted {
    pub id: BrickId,
    /// What adopting it did, when it was a GlusterFS (or Kiln) brick already.
    pub adopted: Option<adopt::Adoption>,
}

/// An open brick: its identity and the directory fds every fop works relative to.
#[derive(Debug)]
pub struct Brick {
    pub path: PathBuf,
    pub id: BrickId,
    /// The brick root, `O_PATH | O_DIRECTORY`.
    pub root: DirFd,
    /// `.glusterfs/XX` for XX = 00..ff, `O_PATH | O_DIRECTORY`.
    handle_dirs: Vec<DirFd>,
    /// `.glusterfs/kiln-pending`.
    pub pending: DirFd,
    /// Which `XX/YY` directories are known to exist (one bit per YY, lazily made).
    handle_parents: Vec<std::sync::atomic::AtomicU64>,
    /// Whether the file system makes unnamed files (`O_TMPFILE`): new regular files are then
    /// made whole before they get their name (`crate::fops::namespace`).
    pub tmpfile: bool,
    /// Whether the brick may name an open file from its fd (`linkat(AT_EMPTY_PATH)`, which
    /// needs `CAP_DAC_READ_SEARCH`); else it goes through `/proc/self/fd/N`.
    pub link_by_fd: bool,
}

fn io_err(path: &Path) -> impl Fn(Errno) -> BrickError + '_ {
    move |e| BrickError::Io {
        path: path.to_owned(),
        source: e.into(),
    }
}

fn open_dir(dir: BorrowedFd<'_>, name: &str) -> Result<OwnedFd, Errno> {
    rustix::fs::openat(
        dir,
        name,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

fn mkdir_exist_ok(dir: BorrowedFd<'_>, name: &str, mode: u32) -> Result<(), Errno> {
    match rustix::fs::mkdirat(dir, name, Mode::from_raw_mode(mode)) {
        Ok(()) | Err(Errno::EXIST) => Ok(()),
        Err(e) => Err(e),
    }
}

/// The root fd's view of a path for `*xattr` calls that take paths (`/proc/self/fd/N`).
fn fd_path(fd: BorrowedFd<'_>) -> String {
    use std::os::fd::AsRawFd;
    format!("/proc/self/fd/{}", fd.as_raw_fd())
}

fn read_root_gfid(root: BorrowedFd<'_>) -> Result<Option<[u8; 16]>, Errno> {
    let mut buf = [0u8; 16];
    match rustix::fs::getxattr(fd_path(root), GFID_XATTR, &mut buf[..]) {
        Ok(16) => Ok(Some(buf)),
        Ok(_) => Ok(Some([0; 16])),
        Err(Errno::NODATA) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Whether directory `root` (at `path`) carries the root GFID: `false` when it carries no
/// GFID, [`BrickError::WrongRootGfid`] when it carries another.
fn has_root_gfid(root: BorrowedFd<'_>, path: &Path) -> Result<bool, BrickError> {
    match read_root_gfid(root).map_err(io_err(path))? {
        None => Ok(false),
        Some(g) if g == *Gfid::ROOT.as_bytes() => Ok(true),
        Some(g) => Err(BrickError::WrongRootGfid {
            path: path.to_owned(),
            found: Gfid::from_bytes(g).map_or("null".to_owned(), |g| g.to_string()),
        }),
    }
}

impl Brick {
    /// Formats an empty directory (or a new one) as a Kiln brick: the root GFID, the brick id,
    /// `.glusterfs` with its 256 first-level handle directories and the root's handle. The
    /// second-level `XX/YY` directories are made lazily, on first use.
    ///
    /// A directory GlusterFS laid out as a brick (`.glusterfs/` and the root GFID on its root)
    /// is adopted in place instead ([`adopt`]): every file stays, GlusterFS's times
    /// (`trusted.glusterfs.mdata`) are removed, the housekeeping above is made, and the brick
    /// id is kept (a Kiln brick's) or taken from the volume id. Formatting a brick again is
    /// harmless. Any other directory that holds data is refused.
    pub fn format(path: &Path) -> Result<Formatted, BrickError> {
        require_root()?;
        std::fs::create_dir_all(path).map_err(|source| BrickError::Io {
            path: path.to_owned(),
            source,
        })?;
        let mut entries = std::fs::read_dir(path).map_err(|source| BrickError::Io {
            path: path.to_owned(),
            source,
        })?;
        let err = io_err(path);
        let root = rustix::fs::open(
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(&err)?;
        let proc_path = fd_path(root.as_fd());
        if entries.next().is_some() {
            let adoption = adopt::adopt(root.as_fd(), path)?;
            make_housekeeping(root.as_fd()).map_err(&err)?;
            // Last, so a brick with a Kiln id has been adopted whole.
            let id = brick_id_or_adopt(&proc_path).map_err(&err)?;
            rustix::fs::fsync(&root).map_err(&err)?;
            return Ok(Formatted {
                id,
                adopted: Some(adoption),
            });
        }
        let id = BrickId(uuid::Uuid::new_v4().into_bytes());
        rustix::fs::setxattr(
            &proc_path,
            GFID_XATTR,
            Gfid::ROOT.as_bytes(),
            XattrFlags::CREATE,
        )
        .map_err(&err)?;
        rustix::fs::setxattr(&proc_path, BRICK_ID_XATTR, &id.0, XattrFlags::CREATE)
            .map_err(&err)?;
        make_housekeeping(root.as_fd()).map_err(&err)?;
        rustix::fs::fsync(&root).map_err(&err)?;
        Ok(Formatted { id, adopted: None })
    }

    /// Opens a brick formatted by Kiln or written by GlusterFS (adopting it: a GlusterFS brick
    /// gets a Kiln brick id and the pending directory, nothing else changes).
    pub fn open(path: &Path) -> Result<Brick, BrickError> {
        require_root()?;
        let err = io_err(path);
        let root_rd = rustix::fs::open(
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(&err)?;
        if !has_root_gfid(root_rd.as_fd(), path)? {
            return Err(BrickError::NotABrick(path.to_owned()));
        }
        let id = brick_id_or_adopt(&fd_path(root_rd.as_fd())).map_err(&err)?;
        make_housekeeping(root_rd.as_fd()).map_err(&err)?;
        let root = open_dir(root_rd.as_fd(), ".").map_err(&err)?;
        let glusterfs = open_dir(root.as_fd(), GLUSTERFS_DIR).map_err(&err)?;
        let handle_dirs = (0..=255u8)
            .map(|xx| open_dir(glusterfs.as_fd(), &format!("{xx:02x}")).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()
            .map_err(&err)?;
        let pending = Arc::new(open_dir(glusterfs.as_fd(), PENDING_DIR).map_err(&err)?);
        let handle_parents = (0..65536 / 64)
            .map(|_| std::sync::atomic::AtomicU64::new(0))
            .collect();
        let tmpfile = makes_unnamed_files(&pending);
        let link_by_fd = may_link_by_fd();
        Ok(Brick {
            path: path.to_owned(),
            id,
            root: Arc::new(root),
            handle_dirs,
            pending,
            handle_parents,
            tmpfile,
            link_by_fd,
        })
    }

    /// The `.glusterfs/XX` directory holding `gfid`'s handle.
    pub fn handle_dir(&self, gfid: &Gfid) -> &DirFd {
        &self.handle_dirs[usize::from(gfid.as_bytes()[0])]
    }

    /// `gfid`'s handle relative to [`Brick::handle_dir`]: `YY/<gfid>`.
    pub fn handle_name(gfid: &Gfid) -> CString {
        let text = gfid.text();
        // YY is the hex of the GFID's second byte, the text's characters 2 and 3.
        let mut name = Vec::with_capacity(3 + text.len() + 1);
        name.extend_from_slice(&text[2..4]);
        name.push(b'/');
        name.extend_from_slice(&text);
        CString::new(name).unwrap_or_default()
    }

    /// `gfid`'s handle relative to the brick root: `.glusterfs/XX/YY/<gfid>`.
    pub fn handle_path(gfid: &Gfid) -> String {
        let b = gfid.as_bytes();
        format!("{GLUSTERFS_DIR}/{:02x}/{:02x}/{gfid}", b[0], b[1])
    }

    /// The target of a directory's handle symlink: `../../PA/RG/<parent>/<name>`.
    pub fn dir_handle_target(parent: &Gfid, name: &[u8]) -> Vec<u8> {
        let b = parent.as_bytes();
        let mut t = format!("../../{:02x}/{:02x}/{parent}/", b[0], b[1]).into_bytes();
        t.extend_from_slice(name);
        t
    }

    /// Parses a directory handle's target back into (parent gfid, name).
    pub fn parse_dir_handle_target(target: &[u8]) -> Option<(Gfid, Vec<u8>)> {
        let rest = target.strip_prefix(b"../../")?;
        // "PA/RG/" + 36-byte uuid + "/" + name
        let uuid = rest.get(6..42)?;
        let name = rest.get(43..)?;
        if rest.get(42) != Some(&b'/') || name.is_empty() {
            return None;
        }
        let gfid: Gfid = std::str::from_utf8(uuid).ok()?.parse().ok()?;
        Some((gfid, name.to_vec()))
    }

    /// Makes the `YY` directory under `XX` when it is missing (lazy second level); after the
    /// first time it costs one atomic load.
    pub fn ensure_handle_parent(&self, gfid: &Gfid) -> Result<(), Errno> {
        use std::sync::atomic::Ordering;
        let [xx, yy, ..] = *gfid.as_bytes();
        let bit = usize::from(xx) << 8 | usize::from(yy);
        let word = &self.handle_parents[bit / 64];
        if word.load(Ordering::Relaxed) & (1 << (bit % 64)) != 0 {
            return Ok(());
        }
        let name = format!("{yy:02x}");
        let dir = self.handle_dir(gfid);
        // Looked at first, so a read-only fop that meets a ready directory writes nothing.
        let mode = match rustix::fs::statx(dir, &name, AtFlags::SYMLINK_NOFOLLOW, StatxFlags::MODE)
        {
            Ok(st) => Some(u32::from(st.stx_mode) & 0o7777),
            Err(Errno::NOENT) => None,
            Err(e) => return Err(e),
        };
        if mode.is_none() {
            mkdir_exist_ok(dir.as_fd(), &name, HANDLE_DIR_MODE)?;
        }
        // GlusterFS makes them 0700; callers need search permission (see HANDLE_DIR_MODE).
        if mode != Some(HANDLE_DIR_MODE) {
            let mode = Mode::from_raw_mode(HANDLE_DIR_MODE);
            rustix::fs::chmodat(dir, &name, mode, AtFlags::empty())?;
        }
        word.fetch_or(1 << (bit % 64), Ordering::Relaxed);
        Ok(())
    }
}

/// The brick id on the root at `root_path`; a brick without one (GlusterFS's) gets its volume
/// id when it has one, else a new one.
fn brick_id_or_adopt(root_path: &str) -> Result<BrickId, Errno> {
    let mut id = [0u8; 16];
    match rustix::fs::getxattr(root_path, BRICK_ID_XATTR, &mut id[..]) {
        Ok(16) => return Ok(BrickId(id)),
        Ok(_) | Err(Errno::NODATA) => {}
        Err(e) => return Err(e),
    }
    let mut volume = [0u8; 16];
    let new = match rustix::fs::getxattr(root_path, GLUSTER_VOLUME_ID_XATTR, &mut volume[..]) {
        Ok(16) => volume,
        _ => uuid::Uuid::new_v4().into_bytes(),
    };
    rustix::fs::setxattr(root_path, BRICK_ID_XATTR, &new, XattrFlags::empty())?;
    Ok(BrickId(new))
}

/// Mode of `.glusterfs/XX` and `XX/YY`: searchable by everyone, listable by root only. Callers'
/// user-visible steps run with their own credentials and reach objects by handle, so they need
/// search permission here; `.glusterfs` itself stays 0700, so no local user can walk in.
pub const HANDLE_DIR_MODE: u32 = 0o711;

fn make_housekeeping(root: BorrowedFd<'_>) -> Result<(), Errno> {
    mkdir_exist_ok(root, GLUSTERFS_DIR, 0o700)?;
    let glusterfs = open_dir(root, GLUSTERFS_DIR)?;
    for xx in 0..=255u8 {
        let name = format!("{xx:02x}");
        mkdir_exist_ok(glusterfs.as_fd(), &name, HANDLE_DIR_MODE)?;
        // A GlusterFS brick has them 0700; widen to search-only for callers.
        rustix::fs::chmodat(
            &glusterfs,
            &name,
            Mode::from_raw_mode(HANDLE_DIR_MODE),
            AtFlags::empty(),
        )?;
    }
    mkdir_exist_ok(glusterfs.as_fd(), PENDING_DIR, 0o700)?;
    mkdir_exist_ok(glusterfs.as_fd(), "00/00", HANDLE_DIR_MODE)?;
    match rustix::fs::symlinkat("../../..", &glusterfs, format!("00/00/{}", Gfid::ROOT)) {
        Ok(()) | Err(Errno::EXIST) => {}
        Err(e) => return Err(e),
    }
    rustix::fs::fsync(rustix::fs::openat(
        &glusterfs,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?)?;
    Ok(())
}

/// Whether `dir`'s file system supports `O_TMPFILE` (ext4, XFS, btrfs and tmpfs do).
fn makes_unnamed_files(dir: &DirFd) -> bool {
    let flags = OFlags::TMPFILE | OFlags::WRONLY | OFlags::CLOEXEC;
    let made = rustix::fs::openat(dir, c".", flags, Mode::from_raw_mode(0o600));
    if let Err(e) = &made {
        tracing::info!(error = %e, "no O_TMPFILE on the brick's file system: creates use intent records");
    }
    made.is_ok()
}

fn may_link_by_fd() -> bool {
    use rustix::thread::{CapabilitySet, capabilities};
    let may =
        capabilities(None).is_ok_and(|c| c.effective.contains(CapabilitySet::DAC_READ_SEARCH));
    if !may {
        tracing::info!("no CAP_DAC_READ_SEARCH: new files are linked through /proc/self/fd");
    }
    may
}

fn require_root() -> Result<(), BrickError> {
    match rustix::process::geteuid().is_root() {
        true => Ok(()),
        false => Err(BrickError::NotRoot),
    }
}

/// A new random GFID (a version-4 UUID, never the null one).
pub fn new_gfid() -> Gfid {
    let bytes = uuid::Uuid::new_v4().into_bytes();
    // A v4 UUID has its version bits set, so it is never null.
    Gfid::from_bytes(bytes).unwrap_or(Gfid::ROOT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dir_handle_target_roundtrip() {
        let parent: Gfid = "0a1b2c3d-0000-4000-8000-000000000009"
            .parse()
            .expect("valid");
        let t = Brick::dir_handle_target(&parent, b"some dir");
        assert_eq!(
            t,
            b"../../0a/1b/0a1b2c3d-0000-4000-8000-000000000009/some dir".to_vec()
        );
        assert_eq!(
            Brick::parse_dir_handle_target(&t),
            Some((parent, b"some dir".to_vec()))
        );
        assert_eq!(Brick::parse_dir_handle_target(b"../../.."), None);
        assert_eq!(
            Brick::handle_path(&parent),
            ".glusterfs/0a/1b/0a1b2c3d-0000-4000-8000-000000000009"
        );
        assert_eq!(
            Brick::handle_name(&parent).as_bytes(),
            b"1b/0a1b2c3d-0000-4000-8000-000000000009"
        );
    }
}
