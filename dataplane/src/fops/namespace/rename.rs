//! RENAME: the caller's `renameat2` is the commit point; a moved directory's handle symlink
//! follows it (through an `mv` record), and a replaced target loses a name like an UNLINK
//! (through a `del` record).

use std::ffi::CString;

use kiln_wire::{Creds, FopCode, Gfid, Rename, RenameMode, RenameReply};
use rustix::io::Errno;

use super::super::chain::{At, Chain};
use super::super::{Fops, ParentAttrs, R, iatt};
use super::parent_iatt;
use crate::brick::Brick;
use crate::brick::intent::{RecordKind, record_name};
use crate::exec::Exec;
use crate::op::{self, DirFd, Stat, Step, cstr};

/// A directory whose handle must follow it to its new place.
#[derive(Debug)]
struct MovedDir {
    gfid: Gfid,
    new_parent: Gfid,
    new_name: Vec<u8>,
    record: CString,
}

/// The object a replacing rename removes.
#[derive(Debug)]
struct Victim {
    gfid: Gfid,
    is_dir: bool,
    record: CString,
}

/// What the rename does besides the commit.
#[derive(Debug)]
struct RenamePlan {
    src_gfid: Gfid,
    moved: Vec<MovedDir>,
    victim: Option<Victim>,
}

/// The two directories and names involved.
#[derive(Debug)]
struct Ends {
    src_dir: DirFd,
    dst_dir: DirFd,
    old: CString,
    new: CString,
    parents: ParentAttrs,
}

/// The steps of a rename chain whose results the fop reads back.
#[derive(Debug)]
struct RenameSteps {
    pre_old: Option<At<Stat>>,
    pre_new: Option<At<Stat>>,
    records: Vec<At<()>>,
    victim: Option<At<()>>,
    commit: At<()>,
    stat: At<Stat>,
    post_old: Option<At<Stat>>,
    post_new: Option<At<Stat>>,
}

impl<E: Exec> Fops<E> {
    pub(in crate::fops) async fn rename(
        &self,
        creds: &Creds,
        r: Rename,
        parents: ParentAttrs,
    ) -> R<RenameReply> {
        Self::check_entry(&r.old_parent, &r.old_name)?;
        Self::check_entry(&r.new_parent, &r.new_name)?;
        let ends = Ends {
            src_dir: self.dir(&r.old_parent).await?,
            dst_dir: self.dir(&r.new_parent).await?,
            old: cstr(r.old_name.as_bytes()),
            new: cstr(r.new_name.as_bytes()),
            parents,
        };
        let plan = self.plan_rename(creds, &r, &ends).await?;
        let _removing = match &plan.victim {
            Some(v) => Some(self.shared.removing(v.gfid).await),
            None => None,
        };
        let (chain, steps) = self.rename_chain(creds, &r, &ends, &plan);
        let moving = (plan.moved.iter().map(|m| m.gfid)).collect();
        let moving = self.shared.moving_dirs.mark(moving);
        let mut results = self.run_namespace(FopCode::Rename, chain).await?;
        drop(moving);
        let victim = plan
            .victim
            .filter(|_| steps.victim.is_some_and(|at| results.ok(at)));
        if let Some(e) = results.error(steps.commit) {
            for (moved, record) in plan.moved.iter().zip(&steps.records) {
                if results.ok(*record) {
                    self.unlink_quietly(&self.brick.pending, &moved.record, false)
                        .await;
                }
            }
            if let Some(v) = &victim {
                self.handle_back(&v.gfid, &v.record).await;
            }
            return Err(e);
        }
        let handles = steps.commit.index() + 1..steps.stat.index();
        if let Some(e) = results.first_error_between(handles.start, handles.end) {
            // The rename happened but a handle could not follow (ENOSPC, EIO): the name is
            // right and `kiln-brickd check --repair` fixes the handle.
            tracing::warn!(error = %e, "rename committed but a handle update failed");
        }
        if let Some(v) = &victim {
            self.settle_removed(&v.gfid, v.is_dir, &v.record).await;
            if v.is_dir {
                self.forget_dir(&v.gfid);
            }
        }
        Ok(RenameReply {
            iatt: iatt(&results.take(steps.stat)?, plan.src_gfid),
            pre_old_parent: parent_iatt(&mut results, steps.pre_old, r.old_parent)?,
            post_old_parent: parent_iatt(&mut results, steps.post_old, r.old_parent)?,
            pre_new_parent: parent_iatt(&mut results, steps.pre_new, r.new_parent)?,
            post_new_parent: parent_iatt(&mut results, steps.post_new, r.new_parent)?,
        })
    }

    /// Looks at the source and the target (as the caller) and decides which handles move.
    async fn plan_rename(&self, creds: &Creds, r: &Rename, ends: &Ends) -> R<RenamePlan> {
        let src: Stat = self
            .run_one(Step::caller(op::Statx::of(&ends.src_dir, &ends.old), creds))
            .await?;
        let src_gfid = self
            .gfid_at(&r.old_parent, &ends.src_dir, r.old_name.as_bytes(), &src)
            .await?;
        let probe = Step::caller(op::Statx::of(&ends.dst_dir, &ends.new), creds);
        let dst = match self.run_one::<Stat>(probe).await {
            Ok(st) => Some((
                st,
                self.gfid_at(&r.new_parent, &ends.dst_dir, r.new_name.as_bytes(), &st)
                    .await?,
            )),
            Err(Errno::NOENT) => None,
            Err(e) => return Err(e),
        };
        let mut plan = RenamePlan {
            src_gfid,
            moved: Vec::new(),
            victim: None,
        };
        if src.is_dir() {
            plan.moved.push(MovedDir {
                gfid: src_gfid,
                new_parent: r.new_parent,
                new_name: r.new_name.as_bytes().to_vec(),
                record: record_name(RecordKind::Mv, &src_gfid),
            });
        }
        // A replaced target loses a name: its handle moves to a record, and after the commit
        // goes back or away depending on whether a name is left (see `settle_removed`).
        match (dst, r.mode) {
            (Some((st, gfid)), RenameMode::Exchange) if gfid != src_gfid && st.is_dir() => {
                plan.moved.push(MovedDir {
                    gfid,
                    new_parent: r.old_parent,
                    new_name: r.old_name.as_bytes().to_vec(),
                    record: record_name(RecordKind::Mv, &gfid),
                });
            }
            (Some((st, gfid)), RenameMode::Replace) if gfid != src_gfid => {
                plan.victim = Some(Victim {
                    gfid,
                    is_dir: st.is_dir(),
                    record: record_name(RecordKind::Del, &gfid),
                });
            }
            _ => {}
        }
        Ok(plan)
    }

    /// Records for moved directories and the victim's handle, the caller's rename (the
    /// barrier), the moved handles installed, then the stats of the reply.
    fn rename_chain(
        &self,
        creds: &Creds,
        r: &Rename,
        ends: &Ends,
        plan: &RenamePlan,
    ) -> (Chain, RenameSteps) {
        let mut chain = Chain::new();
        let pre_old = ends.parents.push(&mut chain, &ends.src_dir);
        let pre_new = ends.parents.push(&mut chain, &ends.dst_dir);
        let records = plan
            .moved
            .iter()
            .map(|m| {
                chain.push(Step::brick(op::Symlink {
                    target: cstr(&Brick::dir_handle_target(&m.new_parent, &m.new_name)),
                    dir: self.brick.pending.clone(),
                    name: m.record.clone(),
                }))
            })
            .collect();
        let victim = plan
            .victim
            .as_ref()
            .map(|v| chain.push(self.park_handle(&v.gfid, &v.record)));
        let flags = match r.mode {
            RenameMode::Replace => 0,
            RenameMode::NoReplace => libc::RENAME_NOREPLACE,
            RenameMode::Exchange => libc::RENAME_EXCHANGE,
        };
        let rename = op::Rename {
            old_dir: ends.src_dir.clone(),
            old_name: ends.old.clone(),
            new_dir: ends.dst_dir.clone(),
            new_name: ends.new.clone(),
            flags,
        };
        let commit = chain.push(Step::caller(rename, creds).barrier());
        for m in &plan.moved {
            chain.push::<()>(self.install_handle(&m.gfid, &m.record, true));
        }
        let stat = chain.push(Step::brick(op::Statx::of(&ends.dst_dir, &ends.new)));
        let post_old = ends.parents.push(&mut chain, &ends.src_dir);
        let post_new = ends.parents.push(&mut chain, &ends.dst_dir);
        let steps = RenameSteps {
            pre_old,
            pre_new,
            records,
            victim,
            commit,
            stat,
            post_old,
            post_new,
        };
        (chain, steps)
    }
}
