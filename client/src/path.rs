//! Path helpers over the GFID fop API, on every [`Layer`]: paths are resolved on the client,
//! one LOOKUP per component from the root, as a FUSE kernel would; the brick never walks a
//! path.

use std::future::Future;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use kiln_wire::limits::IO_SIZE_MAX_BYTES;
use kiln_wire::{
    AccessMode, Creds, DirEntryPlus, ErrorCode, FileType, FopReply, Gfid, Iatt, Mode, Name,
    OpenFlags, Payload, ReaddirSize, SetAttr,
};

use crate::error::Error;
use crate::layer::{FdFop, Layer, LayerExt};

/// Bytes asked for per READDIRP call.
const READDIR_CHUNK_BYTES: u32 = 64 * 1024;

/// GFIDs made one after another that share their first two bytes: the brick keeps an
/// object's handle in `.glusterfs/XX/YY`, named by those bytes, so a tree made at once (an
/// untar, a clone) fills one handle directory per this many objects instead of creating one
/// for nearly every object, and a walk of it later reads a few handle directories, not one
/// per file. Over many runs they are spread as evenly as random GFIDs (each process starts
/// at a random prefix); a handle directory holds a few blocks of names per run.
pub const GFIDS_PER_HANDLE_DIR: u64 = 256;

/// A new GFID: a version-4 UUID whose first two bytes (random in a v4 UUID) come from a
/// process-wide count that moves on every [`GFIDS_PER_HANDLE_DIR`] GFIDs, as a version-7
/// UUID's first bytes come from the clock, and for the same reason (locality in an index).
/// The other 106 random bits keep GFIDs unique.
pub fn new_gfid() -> Gfid {
    static MADE: LazyLock<AtomicU64> = LazyLock::new(|| {
        let random = uuid::Uuid::new_v4().into_bytes();
        let first_prefix = u16::from_be_bytes([random[0], random[1]]);
        AtomicU64::new(u64::from(first_prefix) * GFIDS_PER_HANDLE_DIR)
    });
    let n = MADE.fetch_add(1, Ordering::Relaxed);
    let prefix = ((n / GFIDS_PER_HANDLE_DIR) as u16).to_be_bytes();
    loop {
        let mut bytes = uuid::Uuid::new_v4().into_bytes();
        bytes[..2].copy_from_slice(&prefix);
        // Null is the one value a GFID cannot be; the version bits (byte 6) are untouched,
        // so this is never null, but the loop costs nothing and keeps this total.
        if let Some(gfid) = Gfid::from_bytes(bytes) {
            return gfid;
        }
    }
}

/// The components of `path` ("/a/b", "a/b" and "a//b/" are all `a`, `b`); `.` is skipped and
/// `..` refused (EINVAL): paths are resolved from the volume root only.
pub fn components(path: &str) -> Result<Vec<Name>, Error> {
    path.split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .map(|c| {
            Name::new(Bytes::copy_from_slice(c.as_bytes()))
                .map_err(|e| Error::Fop(ErrorCode::from_errno(e.errno())))
        })
        .collect()
}

fn mode(bits: u32) -> Mode {
    Mode::new(bits & 0o7777).unwrap_or(Mode::from_st_mode(0o644))
}

/// Helpers by path, run as `creds`, on any layer of the client stack.
pub trait Paths: Layer {
    /// The attributes of the object at `path` (symlinks are not followed).
    fn resolve(
        &self,
        creds: &Creds,
        path: &str,
    ) -> impl Future<Output = Result<Iatt, Error>> + Send {
        async move {
            let mut iatt = self.stat(creds, Gfid::ROOT).await?;
            for name in components(path)? {
                if iatt.file_type != FileType::Directory {
                    return Err(Error::Fop(ErrorCode::NotDir));
                }
                iatt = self.lookup(creds, iatt.gfid, &name).await?;
            }
            Ok(iatt)
        }
    }

    /// The directory that holds `path`'s last component, and that component. EINVAL for the
    /// root itself.
    fn resolve_parent(
        &self,
        creds: &Creds,
        path: &str,
    ) -> impl Future<Output = Result<(Gfid, Name), Error>> + Send {
        async move {
            let mut names = components(path)?;
            let last = names.pop().ok_or(Error::Fop(ErrorCode::Inval))?;
            let mut parent = Gfid::ROOT;
            for name in names {
                let iatt = self.lookup(creds, parent, &name).await?;
                if iatt.file_type != FileType::Directory {
                    return Err(Error::Fop(ErrorCode::NotDir));
                }
                parent = iatt.gfid;
            }
            Ok((parent, last))
        }
    }

    /// Creates (or truncates) the file at `path` and opens it for writing.
    fn create_file(
        &self,
        creds: &Creds,
        path: &str,
        mode_bits: u32,
    ) -> impl Future<Output = Result<Self::Fd, Error>> + Send {
        async move {
            let (parent, name) = self.resolve_parent(creds, path).await?;
            let create = kiln_wire::Create {
                parent,
                name: name.clone(),
                gfid: new_gfid(),
                access: AccessMode::WriteOnly,
                flags: OpenFlags::EXCL,
                mode: mode(mode_bits),
                umask: mode(0),
            };
            match self.create(creds, create).await {
                Ok((fd, _)) => Ok(fd),
                Err(Error::Fop(ErrorCode::Exist)) => {
                    let iatt = self.lookup(creds, parent, &name).await?;
                    if iatt.file_type == FileType::Directory {
                        return Err(Error::Fop(ErrorCode::IsDir));
                    }
                    self.open(creds, iatt.gfid, AccessMode::WriteOnly, OpenFlags::TRUNC)
                        .await
                }
                Err(e) => Err(e),
            }
        }
    }

    /// Writes a small file (at most 1 MiB) in one round trip with the PUT fop: create, write,
    /// set attributes and release on the brick. EEXIST if the name is taken.
    fn put(
        &self,
        creds: &Creds,
        path: &str,
        data: Bytes,
        mode_bits: u32,
    ) -> impl Future<Output = Result<Iatt, Error>> + Send {
        async move {
            let (parent, name) = self.resolve_parent(creds, path).await?;
            self.put_at(creds, parent, name, data, mode_bits).await
        }
    }

    /// [`Paths::put`] in a known directory.
    fn put_at(
        &self,
        creds: &Creds,
        parent: Gfid,
        name: Name,
        data: Bytes,
        mode_bits: u32,
    ) -> impl Future<Output = Result<Iatt, Error>> + Send {
        async move {
            let data =
                Payload::new(data).map_err(|e| Error::Fop(ErrorCode::from_errno(e.errno())))?;
            let fop = kiln_wire::Put {
                parent,
                name,
                gfid: new_gfid(),
                mode: mode(mode_bits),
                umask: mode(0),
                flags: OpenFlags::empty(),
                data,
                attr: SetAttr::default(),
            };
            match self.call(creds, fop.into()).await? {
                FopReply::Put(r) => Ok(r.iatt),
                _ => Err(Error::Protocol("unexpected reply to PUT".into())),
            }
        }
    }

    /// Writes `data` to `path`, replacing what was there: one PUT when the file is new and
    /// small, else CREATE or OPEN with truncation and 1 MiB WRITEs.
    fn write_file(
        &self,
        creds: &Creds,
        path: &str,
        data: Bytes,
        mode_bits: u32,
    ) -> impl Future<Output = Result<(), Error>> + Send {
        async move {
            if data.len() <= IO_SIZE_MAX_BYTES {
                match self.put(creds, path, data.clone(), mode_bits).await {
                    Err(Error::Fop(ErrorCode::Exist)) => {}
                    other => return other.map(drop),
                }
            }
            let fd = self.create_file(creds, path, mode_bits).await?;
            let mut offset = 0;
            let result = async {
                while offset < data.len() {
                    let end = (offset + IO_SIZE_MAX_BYTES).min(data.len());
                    self.write(creds, &fd, offset as u64, data.slice(offset..end))
                        .await?;
                    offset = end;
                }
                Ok(())
            }
            .await;
            let released = self.release(creds, fd).await;
            result.and(released)
        }
    }

    /// The whole content of the file at `path`.
    fn read_to_end(
        &self,
        creds: &Creds,
        path: &str,
    ) -> impl Future<Output = Result<Vec<u8>, Error>> + Send {
        async move {
            let iatt = self.resolve(creds, path).await?;
            if iatt.file_type == FileType::Directory {
                return Err(Error::Fop(ErrorCode::IsDir));
            }
            let fd = self
                .open(creds, iatt.gfid, AccessMode::ReadOnly, OpenFlags::empty())
                .await?;
            let mut out = Vec::with_capacity(iatt.size as usize);
            let result = async {
                loop {
                    let chunk = self
                        .read(creds, &fd, out.len() as u64, IO_SIZE_MAX_BYTES as u32)
                        .await?;
                    if chunk.is_empty() {
                        return Ok(());
                    }
                    out.extend_from_slice(&chunk);
                }
            }
            .await;
            let released = self.release(creds, fd).await;
            result.and(released).map(|()| out)
        }
    }

    /// Every entry of directory `gfid` with its attributes (READDIRP until the end), without
    /// `.` and `..`.
    fn read_dir(
        &self,
        creds: &Creds,
        gfid: Gfid,
    ) -> impl Future<Output = Result<Vec<DirEntryPlus>, Error>> + Send {
        async move {
            let fd = self.opendir(creds, gfid).await?;
            let mut entries = Vec::new();
            let result = async {
                let mut offset = 0;
                let size =
                    ReaddirSize::new(READDIR_CHUNK_BYTES).ok_or(Error::Fop(ErrorCode::Inval))?;
                loop {
                    let fop = FdFop::new(|fd| kiln_wire::Readdirp { fd, offset, size }.into());
                    let reply = self.call_fd(creds, &fd, fop).await?;
                    let FopReply::Readdirp(r) = reply else {
                        return Err(Error::Protocol("unexpected reply to READDIRP".into()));
                    };
                    for e in r.entries {
                        offset = e.offset;
                        if !matches!(e.name.as_bytes(), b"." | b"..") {
                            entries.push(e);
                        }
                    }
                    if r.eof {
                        return Ok(());
                    }
                }
            }
            .await;
            let released = self.release(creds, fd).await;
            result.and(released).map(|()| entries)
        }
    }

    /// MKDIR of `path`.
    fn mkdir(
        &self,
        creds: &Creds,
        path: &str,
        mode_bits: u32,
    ) -> impl Future<Output = Result<Iatt, Error>> + Send {
        async move {
            let (parent, name) = self.resolve_parent(creds, path).await?;
            self.mkdir_at(creds, parent, name, mode_bits).await
        }
    }

    /// MKDIR of `name` in a known directory.
    fn mkdir_at(
        &self,
        creds: &Creds,
        parent: Gfid,
        name: Name,
        mode_bits: u32,
    ) -> impl Future<Output = Result<Iatt, Error>> + Send {
        let fop = kiln_wire::Mkdir {
            parent,
            name,
            gfid: new_gfid(),
            mode: mode(mode_bits),
            umask: mode(0),
        };
        async move {
            match self.call(creds, fop.into()).await? {
                FopReply::Mkdir(r) => Ok(r.iatt),
                _ => Err(Error::Protocol("unexpected reply to MKDIR".into())),
            }
        }
    }

    /// Makes `path` and any missing parents; an existing directory is fine.
    fn mkdir_all(
        &self,
        creds: &Creds,
        path: &str,
        mode_bits: u32,
    ) -> impl Future<Output = Result<Iatt, Error>> + Send {
        async move {
            let mut dir = self.stat(creds, Gfid::ROOT).await?;
            for name in components(path)? {
                dir = match self.lookup(creds, dir.gfid, &name).await {
                    Ok(iatt) if iatt.file_type == FileType::Directory => iatt,
                    Ok(_) => return Err(Error::Fop(ErrorCode::NotDir)),
                    Err(Error::Fop(ErrorCode::NoEnt)) => {
                        match self
                            .mkdir_at(creds, dir.gfid, name.clone(), mode_bits)
                            .await
                        {
                            // Another client made it first.
                            Err(Error::Fop(ErrorCode::Exist)) => {
                                self.lookup(creds, dir.gfid, &name).await?
                            }
                            other => other?,
                        }
                    }
                    Err(e) => return Err(e),
                };
            }
            Ok(dir)
        }
    }

    /// Removes `path`: a file or symlink with UNLINK, a directory with everything in it.
    fn remove_all(
        &self,
        creds: &Creds,
        path: &str,
    ) -> impl Future<Output = Result<(), Error>> + Send {
        async move {
            let (parent, name) = self.resolve_parent(creds, path).await?;
            let iatt = self.lookup(creds, parent, &name).await?;
            // Depth-first with an explicit stack, so deep trees do not recurse.
            let mut stack = vec![(parent, name, iatt, false)];
            while let Some((parent, name, iatt, emptied)) = stack.pop() {
                if iatt.file_type != FileType::Directory {
                    self.call(creds, kiln_wire::Unlink { parent, name }.into())
                        .await?;
                } else if emptied {
                    self.call(creds, kiln_wire::Rmdir { parent, name }.into())
                        .await?;
                } else {
                    let children = self.read_dir(creds, iatt.gfid).await?;
                    let dir = iatt.gfid;
                    stack.push((parent, name, iatt, true));
                    for child in children {
                        stack.push((dir, child.name, child.iatt, false));
                    }
                }
            }
            Ok(())
        }
    }

    /// Every object under `path` (itself first), depth first: its path and attributes.
    fn walk(
        &self,
        creds: &Creds,
        path: &str,
    ) -> impl Future<Output = Result<Vec<(String, Iatt)>, Error>> + Send {
        async move {
            let top = self.resolve(creds, path).await?;
            let root = format!(
                "/{}",
                components(path)?
                    .iter()
                    .map(Name::to_string)
                    .collect::<Vec<_>>()
                    .join("/")
            );
            let mut out = Vec::new();
            let mut stack = vec![(root, top)];
            while let Some((path, iatt)) = stack.pop() {
                if iatt.file_type == FileType::Directory {
                    let mut children = self.read_dir(creds, iatt.gfid).await?;
                    children.sort_by(|a, b| b.name.as_bytes().cmp(a.name.as_bytes()));
                    let base = path.trim_end_matches('/').to_owned();
                    for child in children {
                        stack.push((format!("{base}/{}", child.name), child.iatt));
                    }
                }
                out.push((path, iatt));
            }
            Ok(out)
        }
    }
}

impl<L: Layer + ?Sized> Paths for L {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn components_skip_empty_and_dot() {
        let names: Vec<String> = components("/a//b/./c/")
            .expect("test setup")
            .iter()
            .map(Name::to_string)
            .collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert!(components("/").expect("test setup").is_empty());
        assert_eq!(
            components("a/../b").expect_err("must fail").errno(),
            libc::EINVAL
        );
    }

    #[test]
    fn gfids_are_v4_uuids() {
        let a = new_gfid();
        assert_ne!(a, new_gfid());
        assert_eq!(a.as_bytes()[6] >> 4, 4);
    }

    #[test]
    fn gfids_made_together_share_few_handle_directories() {
        let count = 4 * GFIDS_PER_HANDLE_DIR as usize;
        let gfids: std::collections::HashSet<Gfid> = (0..count).map(|_| new_gfid()).collect();
        assert_eq!(gfids.len(), count, "every GFID is new");
        let dirs: std::collections::HashSet<[u8; 2]> = gfids
            .iter()
            .map(|g| [g.as_bytes()[0], g.as_bytes()[1]])
            .collect();
        // Other tests of this process make GFIDs meanwhile: at most one more directory each
        // run of them can start.
        assert!(
            (4..=8).contains(&dirs.len()),
            "{} handle directories",
            dirs.len()
        );
    }
}
