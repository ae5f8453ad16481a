//! Removing names: UNLINK and RMDIR, and what happens to a handle after a name goes.

use std::ffi::CString;

use kiln_wire::{Creds, FopCode, Gfid, Iatt, Name, RemoveReply};
use rustix::io::Errno;

use super::super::chain::{At, Chain, Results};
use super::super::{Fops, ParentAttrs, R};
use super::parent_iatt;
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
        parents: ParentAttrs,
    ) -> R<RemoveReply> {
        let removal = Removal::Unlink {
            only_settled: false,
        };
        self.remove(removal, creds, parent, name, parents).await
    }

    /// UNLINK_SETTLED: UNLINK, but a regular file with the sticky bit set — a distribution
    /// link file, or a file being moved — is left as it is, answered EXDEV.
    pub(in crate::fops) async fn unlink_settled(
        &self,
        creds: &Creds,
        parent: &Gfid,
        name: &Name,
        parents: ParentAttrs,
    ) -> R<RemoveReply> {
        let removal = Removal::Unlink { only_settled: true };
        self.remove(removal, creds, parent, name, parents).await
    }

    pub(in crate::fops) async fn rmdir(
        &self,
        creds: &Creds,
        parent: &Gfid,
        name: &Name,
        parents: ParentAttrs,
    ) -> R<RemoveReply> {
        self.remove(Removal::Rmdir, creds, parent, name, parents)
            .await
    }

    /// UNLINK and RMDIR of `parent/name`. A file's last name goes under the directory's `dir`
    /// record ([`Fops::unlink_last_name`]); a directory, or a file with other names, goes
    /// through a removal record of its own ([`Fops::remove_parked`]).
    async fn remove(
        &self,
        removal: Removal,
        creds: &Creds,
        parent: &Gfid,
        name: &Name,
        parents: ParentAttrs,
    ) -> R<RemoveReply> {
        Self::check_entry(parent, name)?;
        let dir = self.dir(parent).await?;
        let n = cstr(name.as_bytes());
        // What UNLINK removes is held (`O_PATH`) until it is done; a directory is looked at.
        let (stat, held) = match removal {
            Removal::Unlink { .. } => {
                let held = self.hold_as(creds, &dir, &n).await?;
                (self.fstat_dir(&held).await?, Some(held))
            }
            Removal::Rmdir => {
                let stat = Step::caller(op::Statx::of(&dir, &n), creds);
                (self.run_one(stat).await?, None)
            }
        };
        let is_dir = stat.is_dir();
        let sticky_file = stat.is_regular() && stat.mode & libc::S_ISVTX != 0;
        let fop = match (removal, is_dir) {
            (Removal::Unlink { .. }, true) => return Err(Errno::ISDIR),
            (Removal::Unlink { only_settled: true }, false) if sticky_file => {
                return Err(Errno::XDEV);
            }
            (Removal::Unlink { .. }, false) => FopCode::Unlink,
            (Removal::Rmdir, false) => return Err(Errno::NOTDIR),
            (Removal::Rmdir, true) => FopCode::Rmdir,
        };
        let gfid = self.gfid_at(parent, &dir, name.as_bytes(), &stat).await?;
        let _removing = self.shared.removing(gfid).await;
        let named = Named {
            parent: *parent,
            dir,
            name: n,
            gfid,
            is_dir,
            parents,
        };
        let (pre_parent, post_parent) = match held {
            // This name and the handle, when it was held: a LINK or another UNLINK of the
            // file since then is made good by either way (the last-name way relinks a
            // handle whose file is still named after its commit; the parked way counts
            // the names after its commit).
            Some(held) if stat.nlink <= 2 => self.unlink_last_name(creds, &named, &held).await?,
            _ => self.remove_parked(fop, creds, &named).await?,
        };
        Ok(RemoveReply {
            pre_parent,
            post_parent,
        })
    }

    /// UNLINK of a file's last name, held open as `held`: its handle goes first, then the
    /// caller's unlink commits, under the directory's `dir` record (a crash between the two
    /// leaves the file named without its handle, which start-up repair heals). On a file
    /// system with no room for the record (a full disk, its inodes used up) the name goes
    /// first and then the handle, so a full disk can be emptied: a crash between the two
    /// leaves a stale handle, which `kiln-brickd check` reports and `--repair` removes. A
    /// file still named afterwards — the unlink was refused, or a LINK or RENAME of it raced
    /// in — gets its handle back from `held`. The parent's attributes before and after.
    async fn unlink_last_name(
        &self,
        creds: &Creds,
        named: &Named,
        held: &DirFd,
    ) -> R<(Iatt, Iatt)> {
        let under_record = match self.under_dir_record(&named.parent).await {
            Ok(guard) => Some(guard),
            Err(Errno::NOSPC | Errno::DQUOT) => None,
            Err(e) => return Err(e),
        };
        let (dir, gfid) = (&named.dir, &named.gfid);
        let mut chain = Chain::new();
        let pre = named.parents.push(&mut chain, dir);
        // A missing handle (a damaged brick) is no reason to refuse the unlink.
        let handle = || {
            Step::brick(op::Unlink {
                dir: self.brick.handle_dir(gfid).clone(),
                name: Brick::handle_name(gfid),
                dir_flag: false,
            })
        };
        if under_record.is_some() {
            chain.push::<()>(handle());
        }
        let unlink = op::Unlink {
            dir: dir.clone(),
            name: named.name.clone(),
            dir_flag: false,
        };
        let commit = chain.push::<()>(Step::caller(unlink, creds).barrier());
        if under_record.is_none() {
            chain.push::<()>(handle());
        }
        let post = named.parents.push(&mut chain, dir);
        let mut results = match self.run_namespace(FopCode::Unlink, chain).await {
            Ok(results) => results,
            Err(e) => {
                // A crash point: the record stays for the reopened brick's repair.
                std::mem::forget(under_record);
                return Err(e);
            }
        };
        if self.fstat_dir(held).await.is_ok_and(|st| st.nlink >= 1)
            && self.relink_handle(gfid, held).await
        {
            // The unlink failed, or a lookup of the name between the two unlinks found the
            // handle missing and made it: then the handle is all that is left of the file.
            self.drop_handle_if_unnamed(gfid).await;
        }
        if let Some(e) = results.error(commit) {
            return Err(e);
        }
        named.parent_iatts(&mut results, pre, post)
    }

    /// Links the handle of `gfid` to the open file `held` again (it is still named); whether
    /// a handle was there already.
    async fn relink_handle(&self, gfid: &Gfid, held: &DirFd) -> bool {
        let link = op::LinkFile::of(
            held,
            self.brick.handle_dir(gfid).clone(),
            Brick::handle_name(gfid),
            self.brick.link_by_fd,
        );
        match self.run1(Step::brick(link)).await {
            Ok(_) => false,
            // The handle never went (its unlink failed), or a lookup of a name of the file
            // (one whose worker had not cached its GFID) healed it.
            Err(Errno::EXIST) => true,
            // Left for the next lookup of a name of the file to heal.
            Err(e) => {
                tracing::warn!(%gfid, error = %e, "a handle could not be relinked");
                false
            }
        }
    }

    /// UNLINK of a name of a file with others, and RMDIR: the handle moves into a removal
    /// record, the caller's removal commits, then the handle comes back (names are left, or
    /// the removal was refused) or goes with the record. The parent's attributes before and
    /// after.
    async fn remove_parked(&self, fop: FopCode, creds: &Creds, named: &Named) -> R<(Iatt, Iatt)> {
        let (dir, gfid) = (&named.dir, &named.gfid);
        let record = record_name(RecordKind::Del, gfid);
        let mut chain = Chain::new();
        let pre = named.parents.push(&mut chain, dir);
        let parked = chain.push::<()>(self.park_handle(gfid, &record));
        let remove = op::Unlink {
            dir: dir.clone(),
            name: named.name.clone(),
            dir_flag: named.is_dir,
        };
        let commit = chain.push::<()>(Step::caller(remove, creds).barrier());
        let post = named.parents.push(&mut chain, dir);
        let mut results = self.run_namespace(fop, chain).await?;
        // No handle to move (a damaged brick) is no reason to refuse the removal.
        let moved = results.ok(parked);
        if let Some(e) = results.error(commit) {
            if moved {
                self.handle_back(gfid, &record).await;
            }
            return Err(e);
        }
        if moved {
            self.settle_removed(gfid, named.is_dir, &record).await;
        }
        if named.is_dir {
            self.forget_dir(gfid);
        }
        named.parent_iatts(&mut results, pre, post)
    }

    /// Moves a handle parked in `record` back into place (the removal did not happen).
    pub(super) async fn handle_back(&self, gfid: &Gfid, record: &CString) {
        if let Err(e) = self.run1(self.install_handle(gfid, record, false)).await {
            // Another handle took the place (parking keeps creates off the GFID, so only a
            // hand-made one could): the record stays for `kiln-brickd check` to settle.
            tracing::warn!(%gfid, error = %e, "a parked handle could not go back");
        }
    }

    /// After a committed removal of one name of `gfid`, whose handle was parked in `record`:
    /// a file with names left (other hard links, counted now, after the commit, so a LINK or
    /// UNLINK racing with this one cannot mislead it) gets its handle back; otherwise the
    /// record goes, and with it the handle.
    pub(super) async fn settle_removed(&self, gfid: &Gfid, is_dir: bool, record: &CString) {
        let pending = self.brick.pending.clone();
        if !is_dir {
            let probe = Step::brick(op::Statx::of(&pending, record));
            if self
                .run_one::<Stat>(probe)
                .await
                .is_ok_and(|st| st.nlink >= 2)
            {
                self.handle_back(gfid, record).await;
                // A removal of the last other name may have raced in between.
                self.drop_handle_if_unnamed(gfid).await;
                return;
            }
        }
        self.unlink_quietly(&pending, record, false).await;
    }

    /// Removes `gfid`'s handle if it is the file's only link (a missing handle is healed on
    /// lookup; an orphan would keep the file alive).
    async fn drop_handle_if_unnamed(&self, gfid: &Gfid) {
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

/// The name a removal takes away, and what it names.
struct Named {
    parent: Gfid,
    dir: DirFd,
    name: CString,
    gfid: Gfid,
    is_dir: bool,
    parents: ParentAttrs,
}

impl Named {
    /// The parent's attributes before and after the removal, as the reply carries them.
    fn parent_iatts(
        &self,
        results: &mut Results,
        pre: Option<At<Stat>>,
        post: Option<At<Stat>>,
    ) -> R<(Iatt, Iatt)> {
        Ok((
            parent_iatt(results, pre, self.parent)?,
            parent_iatt(results, post, self.parent)?,
        ))
    }
}

/// What [`Fops::remove`] removes.
#[derive(Debug, Clone, Copy)]
enum Removal {
    /// A name that is not a directory's; with `only_settled`, not a regular file with the
    /// sticky bit set either.
    Unlink {
        only_settled: bool,
    },
    Rmdir,
}
