//! Removing names: UNLINK and RMDIR, and what happens to a handle after a name goes.

use std::ffi::CString;

use kiln_wire::{Creds, FopCode, Gfid, Name, RemoveReply};
use rustix::io::Errno;

use super::super::chain::Chain;
use super::super::{Fops, R, iatt};
use crate::brick::Brick;
use crate::brick::intent::{RecordKind, record_name};
use crate::exec::Exec;
use crate::op::{self, DirFd, Stat, Step, cstr};

impl<E: Exec> Fops<E> {
    pub(in crate::fops) async fn unlink(
        &self,
        creds: &Creds,
        parent: &Gfid,
        name: &Name,
    ) -> R<RemoveReply> {
        self.remove(FopCode::Unlink, creds, parent, name).await
    }

    pub(in crate::fops) async fn rmdir(
        &self,
        creds: &Creds,
        parent: &Gfid,
        name: &Name,
    ) -> R<RemoveReply> {
        self.remove(FopCode::Rmdir, creds, parent, name).await
    }

    /// UNLINK and RMDIR of `parent/name`: a file's name goes under the directory's `dir`
    /// record ([`Fops::unlink_file`]), a directory's under a removal record of its own
    /// ([`Fops::remove_dir`]).
    async fn remove(
        &self,
        fop: FopCode,
        creds: &Creds,
        parent: &Gfid,
        name: &Name,
    ) -> R<RemoveReply> {
        Self::check_entry(parent, name)?;
        let dir = self.dir(parent).await?;
        let n = cstr(name.as_bytes());
        let stat: Stat = self
            .run_one(Step::caller(op::Statx::of(&dir, &n), creds))
            .await?;
        let is_dir = stat.is_dir();
        match (fop, is_dir) {
            (FopCode::Unlink, true) => return Err(Errno::ISDIR),
            (FopCode::Rmdir, false) => return Err(Errno::NOTDIR),
            _ => {}
        }
        let gfid = self.gfid_at(parent, &dir, name.as_bytes(), &stat).await?;
        let _parked = self.shared.park(gfid);
        let named = Named {
            parent: *parent,
            dir,
            name: n,
            gfid,
            stat,
        };
        let (pre, post) = match is_dir {
            true => self.remove_dir(creds, &named).await?,
            false => self.unlink_file(creds, &named).await?,
        };
        Ok(RemoveReply {
            pre_parent: iatt(&pre, *parent),
            post_parent: iatt(&post, *parent),
        })
    }

    /// UNLINK of a file: when this is its last name, its handle goes first, then the caller's
    /// unlink commits; a file with other names keeps its handle. A crash between the two
    /// leaves the file named without its handle, which the directory's `dir` record has
    /// start-up repair heal. The parent's attributes before and after.
    async fn unlink_file(&self, creds: &Creds, named: &Named) -> R<(Stat, Stat)> {
        let under_record = self.under_dir_record(&named.parent).await?;
        // This name and the handle: no other name is left after the commit.
        let last_name = named.stat.nlink <= 2;
        let (dir, gfid) = (&named.dir, &named.gfid);
        let mut chain = Chain::new();
        let pre = chain.push::<Stat>(Step::brick(op::Fstat::dir(dir)));
        let unhandled = last_name.then(|| chain.push::<()>(self.unlink_handle(gfid)));
        let unlink = op::Unlink {
            dir: dir.clone(),
            name: named.name.clone(),
            dir_flag: false,
        };
        let commit = chain.push::<()>(Step::caller(unlink, creds).barrier());
        let post = chain.push::<Stat>(Step::brick(op::Fstat::dir(dir)));
        let mut results = match self.run_namespace(FopCode::Unlink, chain).await {
            Ok(results) => results,
            Err(e) => {
                // A crash point: the record stays for the reopened brick's repair.
                std::mem::forget(under_record);
                return Err(e);
            }
        };
        if let Some(e) = results.error(commit) {
            if unhandled.is_some_and(|at| results.ok(at)) {
                self.relink_handle(dir, &named.name, gfid, named.stat.ino)
                    .await;
            }
            return Err(e);
        }
        if !last_name {
            // The other names may have gone meanwhile, each counting on this one.
            self.drop_handle_if_unnamed(gfid).await;
        }
        Ok((results.take(pre)?, results.take(post)?))
    }

    /// A step unlinking `gfid`'s handle: its last name goes next.
    pub(super) fn unlink_handle(&self, gfid: &Gfid) -> Step {
        Step::brick(op::Unlink {
            dir: self.brick.handle_dir(gfid).clone(),
            name: Brick::handle_name(gfid),
            dir_flag: false,
        })
    }

    /// A refused removal of `dir/name`, file `gfid` (inode `ino`), after its handle was
    /// unlinked: the name keeps the file, so the file gets its handle back — if the name is
    /// still that file (a racing rename may have put another object there).
    pub(super) async fn relink_handle(&self, dir: &DirFd, name: &CString, gfid: &Gfid, ino: u64) {
        let probe = Step::brick(op::Statx::of(dir, name));
        if !self
            .run_one::<Stat>(probe)
            .await
            .is_ok_and(|st| st.ino == ino)
        {
            return;
        }
        let link = op::Link {
            old_dir: dir.clone(),
            old_name: name.clone(),
            new_dir: self.brick.handle_dir(gfid).clone(),
            new_name: Brick::handle_name(gfid),
        };
        if let Err(e) = self.run1(Step::brick(link)).await {
            // Healed by the next lookup of the name (or repair, while the record lasts).
            tracing::warn!(%gfid, error = %e, "a handle could not be relinked");
        }
    }

    /// RMDIR: the handle moves into a removal record, the caller's rmdir commits, the record
    /// goes (or the handle comes back). The parent's attributes before and after.
    async fn remove_dir(&self, creds: &Creds, named: &Named) -> R<(Stat, Stat)> {
        let (dir, gfid) = (&named.dir, &named.gfid);
        let record = record_name(RecordKind::Del, gfid);
        let mut chain = Chain::new();
        let pre = chain.push::<Stat>(Step::brick(op::Fstat::dir(dir)));
        let parked = chain.push::<()>(self.park_handle(gfid, &record));
        let rmdir = op::Unlink {
            dir: dir.clone(),
            name: named.name.clone(),
            dir_flag: true,
        };
        let commit = chain.push::<()>(Step::caller(rmdir, creds).barrier());
        let post = chain.push::<Stat>(Step::brick(op::Fstat::dir(dir)));
        let mut results = self.run_namespace(FopCode::Rmdir, chain).await?;
        // No handle to move (a damaged brick) is no reason to refuse the removal.
        let moved = results.ok(parked);
        if let Some(e) = results.error(commit) {
            if moved {
                self.handle_back(gfid, &record).await;
            }
            return Err(e);
        }
        if moved {
            self.unlink_quietly(&self.brick.pending, &record, false)
                .await;
        }
        self.forget_dir(gfid);
        Ok((results.take(pre)?, results.take(post)?))
    }

    /// Moves a handle parked in `record` back into place (the removal did not happen).
    pub(super) async fn handle_back(&self, gfid: &Gfid, record: &CString) {
        if let Err(e) = self.run1(self.install_handle(gfid, record, false)).await {
            // Another handle took the place (parking keeps creates off the GFID, so only a
            // hand-made one could): the record stays for `kiln-brickd check` to settle.
            tracing::warn!(%gfid, error = %e, "a parked handle could not go back");
        }
    }

    /// Removes `gfid`'s handle if it is the file's only link (a missing handle is healed on
    /// lookup; an orphan would keep the file alive).
    pub(super) async fn drop_handle_if_unnamed(&self, gfid: &Gfid) {
        let dir = self.brick.handle_dir(gfid).clone();
        let handle = Brick::handle_name(gfid);
        let probe = Step::brick(op::Statx::of(&dir, &handle));
        if self
            .run_one::<Stat>(probe)
            .await
            .is_ok_and(|st| st.nlink <= 1)
        {
            self.unlink_quietly(&dir, &handle, false).await;
        }
    }
}

/// The name a removal takes away, and what it named when looked at.
struct Named {
    parent: Gfid,
    dir: DirFd,
    name: CString,
    gfid: Gfid,
    stat: Stat,
}
