//! Inode attributes: LOOKUP, STAT, ACCESS, READLINK, SETATTR (and TRUNCATE), STATFS.

use kiln_wire::{
    AccessMask, AttrChange, AttrReply, Creds, FsStats, Gfid, LookupReply, LookupXattrsReply, Name,
    ReadlinkReply, SetAttr, StatfsReply, SymlinkTarget,
};
use rustix::fs::AtFlags;
use rustix::io::Errno;

use super::chain::Chain;
use super::resolve::Named;
use super::xattr::presence_at;
use super::{Fops, R, iatt};
use crate::brick::Brick;
use crate::creds::ActAs;
use crate::exec::Exec;
use crate::op::{self, FileRef, Stat, Step, cstr};

impl<E: Exec> Fops<E> {
    pub(super) async fn lookup(&self, creds: &Creds, parent: &Gfid, name: &Name) -> R<LookupReply> {
        Self::check_entry(parent, name)?;
        let dir = self.dir(parent).await?;
        let mut chain = Chain::new();
        let stat = chain.push::<Stat>(Step::caller(
            op::Statx::of(&dir, &cstr(name.as_bytes())),
            creds,
        ));
        let parent_stat = chain.push::<Stat>(Step::brick(op::Fstat::dir(&dir)));
        let mut results = self.run(chain).await;
        let (stat, parent_stat) = (results.take(stat)?, results.take(parent_stat)?);
        let gfid = self.gfid_at(parent, &dir, name.as_bytes(), &stat).await?;
        Ok(LookupReply {
            iatt: iatt(&stat, gfid),
            parent: iatt(&parent_stat, *parent),
        })
    }

    /// LOOKUP with the presence of the probed xattrs of what the name is.
    pub(super) async fn lookup_xattrs(
        &self,
        creds: &Creds,
        parent: &Gfid,
        name: &Name,
    ) -> R<LookupXattrsReply> {
        let LookupReply {
            iatt,
            parent: parent_iatt,
        } = self.lookup(creds, parent, name).await?;
        // On the worker: the name was just looked up, so its inode (and the xattrs ext4 keeps
        // in it) is in memory, and `listxattrat` walks one name.
        let dir = self.dir(parent).await?;
        Ok(LookupXattrsReply {
            iatt,
            parent: parent_iatt,
            xattrs: presence_at(&dir, &cstr(name.as_bytes())),
        })
    }

    pub(super) async fn stat(&self, gfid: &Gfid) -> R<AttrReply> {
        Ok(AttrReply {
            iatt: iatt(&self.stat_gfid(gfid).await?, *gfid),
        })
    }

    pub(super) async fn access(
        &self,
        creds: &Creds,
        gfid: &Gfid,
        mask: AccessMask,
    ) -> R<kiln_wire::Done> {
        let object = self.object_path(gfid).await?;
        let creds = creds.clone();
        let mut access = rustix::fs::Access::EXISTS;
        for (bit, a) in [
            (AccessMask::READ, rustix::fs::Access::READ_OK),
            (AccessMask::WRITE, rustix::fs::Access::WRITE_OK),
            (AccessMask::EXECUTE, rustix::fs::Access::EXEC_OK),
        ] {
            if mask.contains(bit) {
                access |= a;
            }
        }
        self.exec
            .blocking(move || {
                let _as = ActAs::new(&creds)?;
                let (path, follow) = object.proc_path();
                let nofollow = match follow {
                    true => AtFlags::empty(),
                    false => AtFlags::SYMLINK_NOFOLLOW,
                };
                rustix::fs::accessat(rustix::fs::CWD, &*path, access, AtFlags::EACCESS | nofollow)
            })
            .await?;
        Ok(kiln_wire::Done {})
    }

    pub(super) async fn readlink(&self, gfid: &Gfid) -> R<ReadlinkReply> {
        let stat = self.stat_gfid(gfid).await?;
        if !stat.is_symlink() {
            return Err(Errno::INVAL);
        }
        let dir = self.brick.handle_dir(gfid).clone();
        let name = Brick::handle_name(gfid);
        let target = self
            .exec
            .blocking(move || rustix::fs::readlinkat(&dir, &*name, Vec::new()))
            .await?;
        let target = SymlinkTarget::new(target.into_bytes()).map_err(|_| Errno::NAMETOOLONG)?;
        Ok(ReadlinkReply {
            target,
            iatt: iatt(&stat, *gfid),
        })
    }

    pub(super) async fn statfs(&self, gfid: &Gfid) -> R<StatfsReply> {
        // The object must exist; any fd on the brick's file system answers for it.
        self.stat_gfid(gfid).await?;
        let root = self.brick.root.clone();
        self.exec
            .blocking(move || {
                let s = rustix::fs::fstatvfs(&root)?;
                Ok(StatfsReply {
                    stats: FsStats {
                        bsize: s.f_bsize,
                        frsize: s.f_frsize,
                        blocks: s.f_blocks,
                        bfree: s.f_bfree,
                        bavail: s.f_bavail,
                        files: s.f_files,
                        ffree: s.f_ffree,
                        favail: s.f_favail,
                        fsid: s.f_fsid,
                        flags: s.f_flag.bits(),
                        namemax: s.f_namemax,
                    },
                })
            })
            .await
    }

    pub(super) async fn truncate(&self, creds: &Creds, gfid: &Gfid, size: u64) -> R<AttrChange> {
        let attr = SetAttr {
            size: Some(size),
            ..SetAttr::default()
        };
        self.setattr(creds, Named::Gfid(gfid), attr).await
    }

    /// SETATTR on the pinned object: what the calls act on cannot change under them, and a
    /// symlink is never followed.
    pub(super) async fn setattr(
        &self,
        creds: &Creds,
        object: Named<'_>,
        attr: SetAttr,
    ) -> R<AttrChange> {
        let (gfid, pinned) = (object.gfid(), self.pin_named(object).await?);
        let pre = pinned.stat;
        if pre.is_symlink() && attr.mode.is_some() {
            return Err(Errno::OPNOTSUPP);
        }
        if attr.size.is_some() {
            match () {
                _ if pre.is_dir() => return Err(Errno::ISDIR),
                // truncate(2) of anything but a regular file is EINVAL.
                _ if !pre.is_regular() => return Err(Errno::INVAL),
                _ => {}
            }
        }
        // Mode, owner and times on the worker; a size on the pool ([`op::SetAttrs`]).
        let set = op::SetAttrs {
            file: FileRef::Fd(pinned.fd.clone()),
            attr,
        };
        self.run_one::<()>(Step::caller(set, creds)).await?;
        let post = self.fstat_dir(&pinned.fd).await?;
        Ok(AttrChange {
            pre: iatt(&pre, *gfid),
            post: iatt(&post, *gfid),
        })
    }
}
