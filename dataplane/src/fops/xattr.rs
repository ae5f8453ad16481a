//! Extended attributes: SETXATTR, GETXATTR, LISTXATTR, REMOVEXATTR (and their fd forms), as
//! the caller (LISTXATTR as the brick, showing what the caller may see), through
//! `/proc/self/fd/N/...` paths (io_uring's xattr opcodes take no dirfd), on the worker
//! ([`op::GetXattr`]).
//! The brick's own bookkeeping (`trusted.gfid`, `trusted.glusterfs.*`, `trusted.kiln.*`) can be
//! read by clients but never changed (but for GlusterFS's distribution xattrs, which clients
//! own).

use std::ffi::CStr;

use bytes::Bytes;
use kiln_wire::{
    Creds, ListxattrReply, XattrName, XattrPresence, XattrReply, XattrSetMode, XattrValue,
};
use rustix::io::Errno;

use super::resolve::Named;
use super::{Fops, R};
use crate::brick::GFID_XATTR;
use crate::exec::Exec;
use crate::op::{self, DirFd, ObjectPath, Step, cstr};
use crate::sys;

/// Longest list of xattr names a presence check reads, in bytes; an object with a longer one
/// is answered [`XattrPresence::UNKNOWN`] (its client asks).
const PRESENCE_LIST_LEN_MAX_BYTES: usize = 4 * 1024;

/// Names clients may read but never change: the brick's own bookkeeping, and GlusterFS's
/// replication changelog (a brick moved between GlusterFS and Kiln keeps its meaning).
fn protected(name: &XattrName) -> bool {
    let n = name.as_bytes();
    n == GFID_XATTR.as_bytes()
        || n.starts_with(b"trusted.glusterfs.")
        || n.starts_with(b"trusted.kiln.")
        || n.starts_with(b"trusted.afr.")
}

/// GlusterFS's distribution xattrs: a directory's layout and a link file's target. Clients
/// write them, as GlusterFS's DHT does (as root: `trusted.*` needs it), and they stay out of
/// LISTXATTR with the rest of the bookkeeping.
const DHT_XATTRS: [&[u8]; 2] = [b"trusted.glusterfs.dht", b"trusted.glusterfs.dht.linkto"];

/// Names clients may not set or remove.
fn unchangeable(name: &XattrName) -> bool {
    protected(name) && !DHT_XATTRS.contains(&name.as_bytes())
}

impl<E: Exec> Fops<E> {
    pub(super) async fn setxattr(
        &self,
        creds: &Creds,
        object: Named<'_>,
        name: &XattrName,
        value: &[u8],
        mode: XattrSetMode,
    ) -> R<kiln_wire::Done> {
        if unchangeable(name) {
            return Err(Errno::PERM);
        }
        let flags = match mode {
            XattrSetMode::Upsert => rustix::fs::XattrFlags::empty(),
            XattrSetMode::Create => rustix::fs::XattrFlags::CREATE,
            XattrSetMode::Replace => rustix::fs::XattrFlags::REPLACE,
        };
        let set = op::SetXattr {
            object: self.named_path(object).await?,
            xattr: cstr(name.as_bytes()),
            value: value.to_vec(),
            flags,
        };
        self.run_one::<()>(Step::caller(set, creds)).await?;
        Ok(kiln_wire::Done {})
    }

    pub(super) async fn removexattr(
        &self,
        creds: &Creds,
        object: Named<'_>,
        name: &XattrName,
    ) -> R<kiln_wire::Done> {
        if unchangeable(name) {
            return Err(Errno::PERM);
        }
        let remove = op::RemoveXattr {
            object: self.named_path(object).await?,
            xattr: cstr(name.as_bytes()),
        };
        self.run_one::<()>(Step::caller(remove, creds)).await?;
        Ok(kiln_wire::Done {})
    }

    /// GETXATTR as the caller, on the worker ([`op::GetXattr`]).
    pub(super) async fn getxattr(
        &self,
        creds: &Creds,
        object: Named<'_>,
        name: &XattrName,
    ) -> R<XattrReply> {
        let get = op::GetXattr {
            object: self.named_path(object).await?,
            xattr: cstr(name.as_bytes()),
        };
        let value: Bytes = self.run_one(Step::caller(get, creds)).await?;
        Ok(XattrReply {
            value: XattrValue::new(value).map_err(|_| Errno::TOOBIG)?,
        })
    }

    /// LISTXATTR, on the worker: listing needs no permission on the object, so the brick
    /// lists as itself and leaves out what the caller could not see — `trusted.*` but for
    /// root — as the kernel would.
    pub(super) async fn listxattr(&self, creds: &Creds, object: Named<'_>) -> R<ListxattrReply> {
        let object = self.named_path(object).await?;
        let list = list_names(&object)?;
        let visible = |n: &XattrName| creds.uid == 0 || !n.as_bytes().starts_with(b"trusted.");
        let entries = list
            .split(|&b| b == 0)
            .filter_map(|n| XattrName::new(Bytes::copy_from_slice(n)).ok())
            .filter(|n| !protected(n) && visible(n))
            .collect();
        Ok(ListxattrReply { entries, eof: true })
    }
}

/// The xattr names of `object`, NUL-ended.
fn list_names(object: &ObjectPath) -> Result<Vec<u8>, Errno> {
    let (path, follow) = object.proc_path();
    op::read_xattr(|buf| match follow {
        true => rustix::fs::listxattr(&*path, buf),
        false => rustix::fs::llistxattr(&*path, buf),
    })
}

/// Which probed xattrs `name` in `dir` has (not following a symlink: a client asks about
/// the object the name is); [`XattrPresence::UNKNOWN`] when it cannot be listed. Presence is
/// not a secret (listxattr(2) needs no permission on the object), so the brick lists as
/// itself.
pub(super) fn presence_at(dir: &DirFd, name: &CStr) -> XattrPresence {
    let mut list = [0u8; PRESENCE_LIST_LEN_MAX_BYTES];
    match sys::llistxattr_at(dir, name, &mut list[..]) {
        Ok(len) => XattrPresence::of_list(&list[..len]),
        Err(_) => XattrPresence::UNKNOWN,
    }
}
