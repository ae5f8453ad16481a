//! Path helpers over the GFID fop API: paths are resolved on the client, one LOOKUP per
//! component from the root, as a FUSE kernel would; the brick never walks a path.

use bytes::Bytes;
use kiln_wire::limits::IO_SIZE_MAX_BYTES;
use kiln_wire::{
    AccessMode, DirEntryPlus, ErrorCode, FileType, FopReply, Gfid, Iatt, Mode, Name, OpenFlags,
    Payload, ReaddirSize, SetAttr,
};

use crate::error::Error;
use crate::volume::Volume;

/// Bytes asked for per READDIRP call.
const READDIR_CHUNK_BYTES: u32 = 64 * 1024;

/// A new random GFID (a version-4 UUID).
pub fn new_gfid() -> Gfid {
    loop {
        let mut b = [0u8; 16];
        let _ = rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty());
        b[6] = (b[6] & 0x0f) | 0x40;
        b[8] = (b[8] & 0x3f) | 0x80;
        if let Some(gfid) = Gfid::from_bytes(b) {
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

impl Volume {
    /// LOOKUP of one name in a directory.
    pub async fn lookup(&self, parent: Gfid, name: &Name) -> Result<Iatt, Error> {
        let fop = kiln_wire::Lookup {
            parent,
            name: name.clone(),
        };
        match self.call(fop).await? {
            FopReply::Lookup(r) => Ok(r.iatt),
            _ => Err(Error::Protocol("unexpected reply to LOOKUP".into())),
        }
    }

    /// STAT of an object by GFID.
    pub async fn stat(&self, gfid: Gfid) -> Result<Iatt, Error> {
        match self.call(kiln_wire::Stat { gfid }).await? {
            FopReply::Stat(r) => Ok(r.iatt),
            _ => Err(Error::Protocol("unexpected reply to STAT".into())),
        }
    }

    /// The attributes of the object at `path` (symlinks are not followed).
    pub async fn resolve(&self, path: &str) -> Result<Iatt, Error> {
        let mut iatt = self.stat(Gfid::ROOT).await?;
        for name in components(path)? {
            if iatt.file_type != FileType::Directory {
                return Err(Error::Fop(ErrorCode::NotDir));
            }
            iatt = self.lookup(iatt.gfid, &name).await?;
        }
        Ok(iatt)
    }

    /// The directory that holds `path`'s last component, and that component. EINVAL for the
    /// root itself.
    pub async fn resolve_parent(&self, path: &str) -> Result<(Gfid, Name), Error> {
        let mut names = components(path)?;
        let last = names.pop().ok_or(Error::Fop(ErrorCode::Inval))?;
        let mut parent = Gfid::ROOT;
        for name in names {
            let iatt = self.lookup(parent, &name).await?;
            if iatt.file_type != FileType::Directory {
                return Err(Error::Fop(ErrorCode::NotDir));
            }
            parent = iatt.gfid;
        }
        Ok((parent, last))
    }

    /// Creates (or truncates) the file at `path` and opens it for writing.
    pub async fn create_file(&self, path: &str, mode_bits: u32) -> Result<crate::Fd, Error> {
        let (parent, name) = self.resolve_parent(path).await?;
        let create = kiln_wire::Create {
            parent,
            name: name.clone(),
            gfid: new_gfid(),
            access: AccessMode::WriteOnly,
            flags: OpenFlags::EXCL,
            mode: mode(mode_bits),
            umask: mode(0),
        };
        match self.create(create).await {
            Ok((fd, _)) => Ok(fd),
            Err(Error::Fop(ErrorCode::Exist)) => {
                let iatt = self.lookup(parent, &name).await?;
                if iatt.file_type == FileType::Directory {
                    return Err(Error::Fop(ErrorCode::IsDir));
                }
                self.open(iatt.gfid, AccessMode::WriteOnly, OpenFlags::TRUNC)
                    .await
            }
            Err(e) => Err(e),
        }
    }

    /// Writes a small file (at most 1 MiB) in one round trip with the PUT fop: create, write,
    /// set attributes and release on the brick. EEXIST if the name is taken.
    pub async fn put(&self, path: &str, data: Bytes, mode_bits: u32) -> Result<Iatt, Error> {
        let (parent, name) = self.resolve_parent(path).await?;
        self.put_at(parent, name, data, mode_bits).await
    }

    /// [`Volume::put`] in a known directory.
    pub async fn put_at(
        &self,
        parent: Gfid,
        name: Name,
        data: Bytes,
        mode_bits: u32,
    ) -> Result<Iatt, Error> {
        let data = Payload::new(data).map_err(|e| Error::Fop(ErrorCode::from_errno(e.errno())))?;
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
        match self.call(fop).await? {
            FopReply::Put(r) => Ok(r.iatt),
            _ => Err(Error::Protocol("unexpected reply to PUT".into())),
        }
    }

    /// Writes `data` to `path`, replacing what was there: one PUT when the file is new and
    /// small, else CREATE or OPEN with truncation and 1 MiB WRITEs.
    pub async fn write_file(&self, path: &str, data: Bytes, mode_bits: u32) -> Result<(), Error> {
        if data.len() <= IO_SIZE_MAX_BYTES {
            match self.put(path, data.clone(), mode_bits).await {
                Err(Error::Fop(ErrorCode::Exist)) => {}
                other => return other.map(drop),
            }
        }
        let fd = self.create_file(path, mode_bits).await?;
        let mut offset = 0;
        let result = async {
            while offset < data.len() {
                let end = (offset + IO_SIZE_MAX_BYTES).min(data.len());
                self.write(&fd, offset as u64, data.slice(offset..end))
                    .await?;
                offset = end;
            }
            Ok(())
        }
        .await;
        let released = self.release(fd).await;
        result.and(released)
    }

    /// The whole content of the file at `path`.
    pub async fn read_to_end(&self, path: &str) -> Result<Vec<u8>, Error> {
        let iatt = self.resolve(path).await?;
        if iatt.file_type == FileType::Directory {
            return Err(Error::Fop(ErrorCode::IsDir));
        }
        let fd = self
            .open(iatt.gfid, AccessMode::ReadOnly, OpenFlags::empty())
            .await?;
        let mut out = Vec::with_capacity(iatt.size as usize);
        let result = async {
            loop {
                let chunk = self
                    .read(&fd, out.len() as u64, IO_SIZE_MAX_BYTES as u32)
                    .await?;
                if chunk.is_empty() {
                    return Ok(());
                }
                out.extend_from_slice(&chunk);
            }
        }
        .await;
        let released = self.release(fd).await;
        result.and(released).map(|()| out)
    }

    /// Every entry of directory `gfid` with its attributes (READDIRP until the end), without
    /// `.` and `..`.
    pub async fn read_dir(&self, gfid: Gfid) -> Result<Vec<DirEntryPlus>, Error> {
        let fd = self.opendir(gfid).await?;
        let mut entries = Vec::new();
        let result = async {
            let mut offset = 0;
            let size = ReaddirSize::new(READDIR_CHUNK_BYTES).ok_or(Error::Fop(ErrorCode::Inval))?;
            loop {
                let reply = self
                    .call_fd(&fd, |fd| kiln_wire::Readdirp { fd, offset, size }.into())
                    .await?;
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
        let released = self.release(fd).await;
        result.and(released).map(|()| entries)
    }

    /// MKDIR of `path`.
    pub async fn mkdir(&self, path: &str, mode_bits: u32) -> Result<Iatt, Error> {
        let (parent, name) = self.resolve_parent(path).await?;
        self.mkdir_at(parent, name, mode_bits).await
    }

    async fn mkdir_at(&self, parent: Gfid, name: Name, mode_bits: u32) -> Result<Iatt, Error> {
        let fop = kiln_wire::Mkdir {
            parent,
            name,
            gfid: new_gfid(),
            mode: mode(mode_bits),
            umask: mode(0),
        };
        match self.call(fop).await? {
            FopReply::Mkdir(r) => Ok(r.iatt),
            _ => Err(Error::Protocol("unexpected reply to MKDIR".into())),
        }
    }

    /// Makes `path` and any missing parents; an existing directory is fine.
    pub async fn mkdir_all(&self, path: &str, mode_bits: u32) -> Result<Iatt, Error> {
        let mut dir = self.stat(Gfid::ROOT).await?;
        for name in components(path)? {
            dir = match self.lookup(dir.gfid, &name).await {
                Ok(iatt) if iatt.file_type == FileType::Directory => iatt,
                Ok(_) => return Err(Error::Fop(ErrorCode::NotDir)),
                Err(Error::Fop(ErrorCode::NoEnt)) => {
                    match self.mkdir_at(dir.gfid, name.clone(), mode_bits).await {
                        // Another client made it first.
                        Err(Error::Fop(ErrorCode::Exist)) => self.lookup(dir.gfid, &name).await?,
                        other => other?,
                    }
                }
                Err(e) => return Err(e),
            };
        }
        Ok(dir)
    }

    /// Removes `path`: a file or symlink with UNLINK, a directory with everything in it.
    pub async fn remove_all(&self, path: &str) -> Result<(), Error> {
        let (parent, name) = self.resolve_parent(path).await?;
        let iatt = self.lookup(parent, &name).await?;
        self.remove_entry(parent, name, iatt).await
    }

    async fn remove_entry(&self, parent: Gfid, name: Name, iatt: Iatt) -> Result<(), Error> {
        // Depth-first with an explicit stack, so deep trees do not recurse.
        let mut stack = vec![(parent, name, iatt, false)];
        while let Some((parent, name, iatt, emptied)) = stack.pop() {
            if iatt.file_type != FileType::Directory {
                self.call(kiln_wire::Unlink { parent, name }).await?;
            } else if emptied {
                self.call(kiln_wire::Rmdir { parent, name }).await?;
            } else {
                let children = self.read_dir(iatt.gfid).await?;
                let dir = iatt.gfid;
                stack.push((parent, name, iatt, true));
                for child in children {
                    stack.push((dir, child.name, child.iatt, false));
                }
            }
        }
        Ok(())
    }

    /// Every object under `path` (itself first), depth first: its path and attributes.
    pub async fn walk(&self, path: &str) -> Result<Vec<(String, Iatt)>, Error> {
        let top = self.resolve(path).await?;
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
                let mut children = self.read_dir(iatt.gfid).await?;
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
}
