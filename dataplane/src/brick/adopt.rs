//! Adopting a GlusterFS brick in place: what `kiln-brickd format` does to a directory that
//! GlusterFS laid out (`.glusterfs/` and the root GFID on its root), instead of refusing it.
//!
//! Every file stays where it is; nothing is copied. The one change to the named tree is that
//! `trusted.glusterfs.mdata` is removed from every object. GlusterFS 10 keeps an object's times
//! there (its `features.ctime`, on by default), on what it made or changed and on every
//! directory it looked up, and reports them instead of the inode's. Kiln never updates that
//! xattr, so once Kiln had written to a file or added a name to a directory, GlusterFS serving
//! the brick again would show the time of its own last change. Without the xattr, GlusterFS
//! takes the times from the inode, which Kiln keeps current.
//!
//! The walk holds one directory open at a time and remembers, per level above it, where to
//! resume reading (a `telldir` cookie) and which directory it was: memory and file
//! descriptors do not grow with the size of the brick, only 16 bytes with each level of depth.

use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::fs::{AtFlags, Dir, FileType, Mode, OFlags, StatxFlags};
use rustix::io::Errno;

use super::{BrickError, GLUSTERFS_DIR, has_root_gfid, io_err};

/// GlusterFS's per-object times (its ctime feature): version, flags, then ctime, mtime and
/// atime as big-endian seconds and nanoseconds.
pub const MDATA_XATTR: &str = "trusted.glusterfs.mdata";

/// What adopting a GlusterFS brick did to its named tree.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Adoption {
    /// Objects of the named tree visited, the root included.
    pub objects: u64,
    /// Of those, how many carried [`MDATA_XATTR`] (now removed).
    pub mdata_removed: u64,
}

impl std::fmt::Display for Adoption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} objects kept in place, {MDATA_XATTR} removed from {}",
            self.objects, self.mdata_removed
        )
    }
}

/// Adopts the non-empty directory `root` (at `path`) when GlusterFS (or Kiln) laid it out as a
/// brick: strips [`MDATA_XATTR`] from the root and every object of the named tree. Refuses
/// anything else that holds data.
pub(super) fn adopt(root: BorrowedFd<'_>, path: &Path) -> Result<Adoption, BrickError> {
    let err = io_err(path);
    // `.glusterfs` (GLUSTERFS_DIR), a directory, beside the root GFID.
    if !(has_root_gfid(root, path)?
        && is_dir(root, c".glusterfs", FileType::Unknown).map_err(&err)?)
    {
        return Err(BrickError::NotEmpty(path.to_owned()));
    }
    let adoption = strip_mdata(root, path)?;
    // One flush for every removal: a crash before it leaves some xattrs, and a second format
    // removes them.
    rustix::fs::syncfs(root).map_err(&err)?;
    Ok(adoption)
}

/// Where the walk left a directory to go down into one of its subdirectories.
#[derive(Debug, Clone, Copy)]
struct Resume {
    /// The `telldir` cookie just past the subdirectory's entry.
    offset: i64,
    /// The directory itself, checked when the walk comes back up through `..`.
    dir: DirId,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct DirId {
    dev: u64,
    ino: u64,
}

impl DirId {
    fn of(dir: BorrowedFd<'_>) -> Result<DirId, Errno> {
        let st = rustix::fs::fstat(dir)?;
        Ok(DirId {
            dev: st.st_dev,
            ino: st.st_ino,
        })
    }
}

/// Removes [`MDATA_XATTR`] from `root` and every object under it but `.glusterfs`, depth
/// first, one open directory at a time.
fn strip_mdata(root: BorrowedFd<'_>, path: &Path) -> Result<Adoption, BrickError> {
    let err = io_err(path);
    let mut adoption = Adoption::default();
    adoption.note(remove_mdata(root, c".").map_err(&err)?);
    let mut dir = Dir::new(open_readable(root, c".").map_err(&err)?).map_err(&err)?;
    let mut here = DirId::of(root).map_err(&err)?;
    let mut above: Vec<Resume> = Vec::new();
    loop {
        let entry = match dir.read() {
            Some(entry) => entry.map_err(&err)?,
            None => {
                let Some(resume) = above.pop() else {
                    return Ok(adoption);
                };
                dir = back_up(&dir, resume).map_err(|e| match e {
                    Errno::STALE => BrickError::TreeChanged(path.to_owned()),
                    e => err(e),
                })?;
                here = resume.dir;
                continue;
            }
        };
        let name = entry.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        if above.is_empty() && name.to_bytes() == GLUSTERFS_DIR.as_bytes() {
            continue;
        }
        let fd = dir.fd().map_err(&err)?;
        match remove_mdata(fd, name) {
            Ok(removed) => adoption.note(removed),
            // Removed since it was listed: nothing of it to adopt.
            Err(Errno::NOENT) => continue,
            Err(e) => return Err(err(e)),
        }
        if !is_dir(fd, name, entry.file_type()).map_err(&err)? {
            continue;
        }
        let child = match open_readable(fd, name) {
            Ok(child) => child,
            Err(Errno::NOENT | Errno::NOTDIR | Errno::LOOP) => continue,
            Err(e) => return Err(err(e)),
        };
        above.push(Resume {
            offset: entry.offset(),
            dir: here,
        });
        here = DirId::of(child.as_fd()).map_err(&err)?;
        dir = Dir::new(child).map_err(&err)?;
    }
}

impl Adoption {
    fn note(&mut self, removed: bool) {
        self.objects += 1;
        self.mdata_removed += u64::from(removed);
    }
}

/// Removes [`MDATA_XATTR`] from `name` in `dir` (not following a symlink); whether it had one.
fn remove_mdata(dir: BorrowedFd<'_>, name: &CStr) -> Result<bool, Errno> {
    let mut path = format!("/proc/self/fd/{}/", dir.as_raw_fd()).into_bytes();
    path.extend_from_slice(name.to_bytes());
    // A name read from a directory holds no NUL.
    let path = CString::new(path).map_err(|_| Errno::INVAL)?;
    match rustix::fs::lremovexattr(path.as_c_str(), MDATA_XATTR) {
        Ok(()) => Ok(true),
        Err(Errno::NODATA) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Whether `name` in `dir` is a directory (a symlink to one is not), by its directory entry's
/// type when the file system gives it.
fn is_dir(dir: BorrowedFd<'_>, name: &CStr, listed: FileType) -> Result<bool, Errno> {
    if listed != FileType::Unknown {
        return Ok(listed == FileType::Directory);
    }
    match rustix::fs::statx(dir, name, AtFlags::SYMLINK_NOFOLLOW, StatxFlags::TYPE) {
        Ok(st) => Ok(FileType::from_raw_mode(st.stx_mode.into()) == FileType::Directory),
        Err(Errno::NOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

fn open_readable(dir: BorrowedFd<'_>, name: &CStr) -> Result<OwnedFd, Errno> {
    rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

/// The parent of the directory `dir` reads, positioned where `resume` says; ESTALE when `..`
/// is no longer the directory the walk came down from (something renamed it meanwhile).
fn back_up(dir: &Dir, resume: Resume) -> Result<Dir, Errno> {
    let parent = rustix::fs::openat(
        dir.fd()?,
        c"..",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    if DirId::of(parent.as_fd())? != resume.dir {
        return Err(Errno::STALE);
    }
    let mut parent = Dir::new(parent)?;
    parent.seek(resume.offset)?;
    Ok(parent)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use rustix::fs::XattrFlags;

    use super::*;
    use kiln_wire::Gfid;

    use crate::brick::{BRICK_ID_XATTR, Brick, GFID_XATTR, GLUSTER_VOLUME_ID_XATTR};

    /// An mdata value as GlusterFS 10 writes it: version 1, flags 7 (all three times set),
    /// then ctime, mtime, atime as big-endian seconds and nanoseconds.
    fn mdata(sec: i64) -> Vec<u8> {
        let mut v = vec![1u8];
        v.extend_from_slice(&7u64.to_be_bytes());
        for _ in 0..3 {
            v.extend_from_slice(&sec.to_be_bytes());
            v.extend_from_slice(&0i64.to_be_bytes());
        }
        v
    }

    fn set(path: &Path, name: &str, value: &[u8]) {
        rustix::fs::lsetxattr(path, name, value, XattrFlags::empty())
            .unwrap_or_else(|e| panic!("set {name} on {}: {e}", path.display()));
    }

    fn has_mdata(path: &Path) -> bool {
        let mut buf = [0u8; 128];
        match rustix::fs::lgetxattr(path, MDATA_XATTR, &mut buf[..]) {
            Ok(_) => true,
            Err(Errno::NODATA) => false,
            Err(e) => panic!("getxattr on {}: {e}", path.display()),
        }
    }

    /// A directory made to look like a GlusterFS 10 brick: root GFID and volume id on the
    /// root, `.glusterfs/XX/YY` 0700 with handles, and mdata on every object — nested
    /// directories (deeper than the walk's first level), a file with a second name, a symlink,
    /// a link file and a file in `.glusterfs` that must be left alone. The paths that carry
    /// mdata, the handle of the file, and the file in `.glusterfs`.
    fn glusterfs_brick(brick: &Path) -> (Vec<std::path::PathBuf>, std::path::PathBuf) {
        std::fs::create_dir(brick).expect("brick");
        let file_gfid = "5a1e0000-0000-4000-8000-00000000f11e";
        let handles = brick.join(".glusterfs/5a/1e");
        std::fs::create_dir_all(&handles).expect("handle dirs");
        std::fs::create_dir_all(brick.join(".glusterfs/indices")).expect("indices");
        let mut deep = brick.join("a");
        for level in 0..6 {
            std::fs::create_dir(&deep).expect("mkdir");
            for i in 0..3 {
                std::fs::write(deep.join(format!("f{level}-{i}")), b"data").expect("write");
            }
            deep = deep.join(format!("d{level}"));
        }
        std::fs::create_dir(brick.join("empty")).expect("mkdir");
        std::fs::write(brick.join("file"), b"written by glusterfs").expect("write");
        std::fs::hard_link(brick.join("file"), handles.join(file_gfid)).expect("handle");
        std::os::unix::fs::symlink("file", brick.join("link")).expect("symlink");
        std::fs::write(brick.join("a/linkfile"), b"").expect("link file");
        let internal = brick.join(".glusterfs/indices/xattrop");
        std::fs::write(&internal, b"").expect("internal");
        let mut objects = vec![brick.to_owned()];
        let mut dirs = vec![brick.to_owned()];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).expect("read_dir") {
                let entry = entry.expect("entry");
                if entry.file_name() == GLUSTERFS_DIR {
                    continue;
                }
                if entry.file_type().expect("type").is_dir() {
                    dirs.push(entry.path());
                }
                objects.push(entry.path());
            }
        }
        for object in objects.iter().chain([&internal]) {
            set(object, MDATA_XATTR, &mdata(1_700_000_000));
        }
        set(brick, GFID_XATTR, Gfid::ROOT.as_bytes());
        set(brick, GLUSTER_VOLUME_ID_XATTR, &[7; 16]);
        (objects, internal)
    }

    #[test]
    fn format_adopts_a_glusterfs_brick_in_place() {
        let dir = tempfile::tempdir().expect("tempdir");
        let brick = dir.path().join("brick");
        let (objects, internal) = glusterfs_brick(&brick);
        let file_ino = std::fs::metadata(brick.join("file")).expect("stat").ino();
        let formatted = Brick::format(&brick).expect("format adopts a GlusterFS brick");
        let adoption = formatted.adopted.expect("adopted, not formatted afresh");
        assert_eq!(
            adoption,
            Adoption {
                objects: objects.len() as u64,
                mdata_removed: objects.len() as u64,
            }
        );
        assert_eq!(
            formatted.id.0, [7; 16],
            "the volume id becomes the brick id"
        );
        for object in &objects {
            assert!(!has_mdata(object), "{} keeps its mdata", object.display());
        }
        assert!(has_mdata(&internal), "format went into .glusterfs");
        // Nothing was copied or moved: same inode, same content, same handle.
        let meta = std::fs::metadata(brick.join("file")).expect("stat");
        assert_eq!((meta.ino(), meta.nlink()), (file_ino, 2));
        assert_eq!(
            std::fs::read(brick.join("file")).expect("read"),
            b"written by glusterfs"
        );
        assert_eq!(
            std::fs::read_link(brick.join("link")).expect("readlink"),
            Path::new("file")
        );
        let opened = Brick::open(&brick).expect("open the adopted brick");
        assert_eq!(opened.id, formatted.id);
        let mut id = [0u8; 16];
        rustix::fs::getxattr(&brick, BRICK_ID_XATTR, &mut id[..]).expect("brick id");
        assert_eq!(id, [7; 16]);

        // Formatting again (after GlusterFS served the brick once more, say) keeps the brick id
        // and strips what GlusterFS wrote since.
        set(&brick.join("file"), MDATA_XATTR, &mdata(1_800_000_000));
        let again = Brick::format(&brick).expect("format again");
        assert_eq!(again.id, formatted.id);
        assert_eq!(again.adopted.map(|a| a.mdata_removed), Some(1));
        assert!(!has_mdata(&brick.join("file")));
    }

    #[test]
    fn format_refuses_data_that_is_not_a_glusterfs_brick() {
        let dir = tempfile::tempdir().expect("tempdir");
        // Files, and even a `.glusterfs` directory, without the root GFID.
        let plain = dir.path().join("plain");
        std::fs::create_dir_all(plain.join(GLUSTERFS_DIR)).expect("mkdir");
        std::fs::write(plain.join("data"), b"x").expect("write");
        set(&plain.join("data"), MDATA_XATTR, &mdata(1));
        let refused = Brick::format(&plain).expect_err("not a brick");
        assert!(matches!(refused, BrickError::NotEmpty(_)), "{refused}");
        assert!(
            refused
                .to_string()
                .contains("is not empty; refusing to format"),
            "{refused}"
        );
        assert!(
            has_mdata(&plain.join("data")),
            "a refused format changed data"
        );
        // The root GFID without `.glusterfs`.
        let no_index = dir.path().join("no-index");
        std::fs::create_dir(&no_index).expect("mkdir");
        std::fs::write(no_index.join("data"), b"x").expect("write");
        set(&no_index, GFID_XATTR, Gfid::ROOT.as_bytes());
        let refused = Brick::format(&no_index).expect_err("no .glusterfs");
        assert!(matches!(refused, BrickError::NotEmpty(_)), "{refused}");
        // Another GFID on the root: not a brick root (a subdirectory of one, say).
        let subdir = dir.path().join("subdir");
        std::fs::create_dir_all(subdir.join(GLUSTERFS_DIR)).expect("mkdir");
        set(&subdir, GFID_XATTR, &[9; 16]);
        let refused = Brick::format(&subdir).expect_err("wrong root gfid");
        assert!(
            matches!(refused, BrickError::WrongRootGfid { .. }),
            "{refused}"
        );
        // An empty directory is still formatted afresh.
        let empty = dir.path().join("empty");
        std::fs::create_dir(&empty).expect("mkdir");
        let formatted = Brick::format(&empty).expect("format");
        assert_eq!(formatted.adopted, None);
    }

    #[test]
    fn the_walk_resumes_each_directory_where_it_left_it() {
        // Many subdirectories in one directory, each with entries: coming back up through
        // `..` must continue after the subdirectory, neither skipping nor repeating names.
        let dir = tempfile::tempdir().expect("tempdir");
        let brick = dir.path().join("brick");
        std::fs::create_dir_all(brick.join(GLUSTERFS_DIR)).expect("mkdir");
        set(&brick, GFID_XATTR, Gfid::ROOT.as_bytes());
        let mut objects = 1;
        for i in 0..300 {
            let sub = brick.join(format!("dir-{i}"));
            std::fs::create_dir(&sub).expect("mkdir");
            std::fs::write(sub.join("f"), b"").expect("write");
            std::fs::write(brick.join(format!("file-{i}")), b"").expect("write");
            for path in [&sub, &sub.join("f"), &brick.join(format!("file-{i}"))] {
                set(path, MDATA_XATTR, &mdata(i));
            }
            objects += 3;
        }
        let adoption = Brick::format(&brick).expect("format").adopted;
        assert_eq!(
            adoption,
            Some(Adoption {
                objects,
                mdata_removed: objects - 1,
            })
        );
    }
}
