//! Removing names: UNLINK and RMDIR, and what happens to a handle after a name goes.

use std::ffi::CString;

use kiln_wire::{Creds, FopCode, Gfid, Name, RemoveReply};
use rustix::io::Errno;

use super::super::chain::Chain;
use super::super::{Fops, R, iatt};
use crate::brick::Brick;
use crate::brick::intent::{RecordKind, record_name};
use crate::exec::Exec;
use crate::op::{self, Stat, Step, cstr};

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

    /// UNLINK and RMDIR: the handle moves into the pending directory (the intent record), the
    /// caller's unlink commits, the record goes.
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
        // The handle moves into a record first; after the commit it comes back when names are
        // left (a file's other hard links) and goes otherwise (`settle_removed`).
        let record = record_name(RecordKind::Del, &gfid);
        let mut chain = Chain::new();
        let pre = chain.push::<Stat>(Step::brick(op::Fstat::dir(&dir)));
        let parked = chain.push::<()>(self.park_handle(&gfid, &record));
        let unlink = op::Unlink {
            dir: dir.clone(),
            name: n,
            dir_flag: is_dir,
        };
        let commit = chain.push::<()>(Step::caller(unlink, creds).barrier());
        let post = chain.push::<Stat>(Step::brick(op::Fstat::dir(&dir)));
        let mut results = self.run_namespace(fop, chain).await?;
        // No handle to move (a damaged brick, or a racing removal of another name that moved
        // it first) is no reason to refuse the removal.
        let moved = results.ok(parked);
        if let Some(e) = results.error(commit) {
            if moved {
                self.handle_back(&gfid, &record).await;
            }
            return Err(e);
        }
        if moved {
            self.settle_removed(&gfid, is_dir, &record).await;
        }
        if is_dir {
            self.forget_dir(&gfid);
        }
        Ok(RemoveReply {
            pre_parent: iatt(&results.take(pre)?, *parent),
            post_parent: iatt(&results.take(post)?, *parent),
        })
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
                // A removal of the last other name may have raced in between: a handle that
                // is now the only link goes (a missing handle is healed on lookup; an orphan
                // would keep the file alive).
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
                return;
            }
        }
        self.unlink_quietly(&pending, record, false).await;
    }
}
