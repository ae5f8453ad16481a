//! Extended attributes: SETXATTR, GETXATTR, LISTXATTR, REMOVEXATTR (and their fd forms), as
//! the caller, through `/proc/self/fd/N/...` paths (io_uring's xattr opcodes take no dirfd).
//! The brick's own bookkeeping (`trusted.gfid`, `trusted.glusterfs.*`, `trusted.kiln.*`) can be
//! read by clients but never changed.

use std::ffi::CString;

use bytes::Bytes;
use kiln_wire::{
    Creds, Fsetxattr, Gfid, ListxattrReply, Setxattr, XattrName, XattrReply, XattrSetMode,
    XattrValue, limits,
};
use rustix::io::Errno;

use super::{Fops, R};
use crate::brick::GFID_XATTR;
use crate::creds::ActAs;
use crate::exec::Exec;
use crate::op::{DirFd, cstr, proc_path};

/// Names clients may read but never change: the brick's own bookkeeping.
fn protected(name: &XattrName) -> bool {
    let n = name.as_bytes();
    n == GFID_XATTR.as_bytes()
        || n.starts_with(b"trusted.glusterfs.")
        || n.starts_with(b"trusted.kiln.")
}

impl<E: Exec> Fops<E> {
    /// The `/proc/self/fd/N/...` path an xattr call uses for `gfid`, with the directory fd
    /// it goes through: the caller moves both into the blocking job, so fd N cannot be closed
    /// and reused for another object before the call runs.
    async fn xattr_path(&self, gfid: &Gfid) -> R<(DirFd, CString)> {
        let (dir, name) = self.object_path(gfid).await?;
        let path = proc_path(&dir, &name);
        Ok((dir, path))
    }

    pub(super) async fn setxattr(
        &self,
        creds: &Creds,
        gfid: &Gfid,
        r: &Setxattr,
    ) -> R<kiln_wire::Done> {
        self.set(creds, gfid, &r.name, r.value.as_bytes(), r.mode)
            .await
    }

    pub(super) async fn fsetxattr(
        &self,
        creds: &Creds,
        gfid: &Gfid,
        r: &Fsetxattr,
    ) -> R<kiln_wire::Done> {
        self.set(creds, gfid, &r.name, r.value.as_bytes(), r.mode)
            .await
    }

    async fn set(
        &self,
        creds: &Creds,
        gfid: &Gfid,
        name: &XattrName,
        value: &[u8],
        mode: XattrSetMode,
    ) -> R<kiln_wire::Done> {
        if protected(name) {
            return Err(Errno::PERM);
        }
        let (dir, path) = self.xattr_path(gfid).await?;
        let (creds, name, value) = (creds.clone(), cstr(name.as_bytes()), value.to_vec());
        let flags = match mode {
            XattrSetMode::Upsert => rustix::fs::XattrFlags::empty(),
            XattrSetMode::Create => rustix::fs::XattrFlags::CREATE,
            XattrSetMode::Replace => rustix::fs::XattrFlags::REPLACE,
        };
        self.exec
            .blocking(move || {
                let _held = dir;
                let _as = ActAs::new(&creds)?;
                rustix::fs::lsetxattr(&*path, &*name, &value, flags)
            })
            .await?;
        Ok(kiln_wire::Done {})
    }

    pub(super) async fn removexattr(
        &self,
        creds: &Creds,
        gfid: &Gfid,
        name: &XattrName,
    ) -> R<kiln_wire::Done> {
        if protected(name) {
            return Err(Errno::PERM);
        }
        let (dir, path) = self.xattr_path(gfid).await?;
        let (creds, name) = (creds.clone(), cstr(name.as_bytes()));
        self.exec
            .blocking(move || {
                let _held = dir;
                let _as = ActAs::new(&creds)?;
                rustix::fs::lremovexattr(&*path, &*name)
            })
            .await?;
        Ok(kiln_wire::Done {})
    }

    pub(super) async fn getxattr(
        &self,
        creds: &Creds,
        gfid: &Gfid,
        name: &XattrName,
    ) -> R<XattrReply> {
        let (dir, path) = self.xattr_path(gfid).await?;
        let (creds, name) = (creds.clone(), cstr(name.as_bytes()));
        let value = self
            .exec
            .blocking(move || {
                let _held = dir;
                let _as = ActAs::new(&creds)?;
                let mut buf = vec![0u8; limits::XATTR_VALUE_LEN_MAX_BYTES];
                let n = rustix::fs::lgetxattr(&*path, &*name, &mut buf[..])?;
                buf.truncate(n);
                Ok::<_, Errno>(buf)
            })
            .await?;
        Ok(XattrReply {
            value: XattrValue::new(value).map_err(|_| Errno::TOOBIG)?,
        })
    }

    pub(super) async fn listxattr(&self, creds: &Creds, gfid: &Gfid) -> R<ListxattrReply> {
        let (dir, path) = self.xattr_path(gfid).await?;
        let creds = creds.clone();
        let list = self
            .exec
            .blocking(move || {
                let _held = dir;
                let _as = ActAs::new(&creds)?;
                let mut buf = vec![0u8; limits::XATTR_VALUE_LEN_MAX_BYTES];
                let n = rustix::fs::llistxattr(&*path, &mut buf[..])?;
                buf.truncate(n);
                Ok::<_, Errno>(buf)
            })
            .await?;
        let entries = list
            .split(|&b| b == 0)
            .filter_map(|n| XattrName::new(Bytes::copy_from_slice(n)).ok())
            .filter(|n| !protected(n))
            .collect();
        Ok(ListxattrReply { entries, eof: true })
    }
}
