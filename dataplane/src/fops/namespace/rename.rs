//! RENAME: the caller's `renameat2` is the commit point; a moved directory's handle symlink
//! follows it (through an `mv` record), and a replaced target loses a name like an UNLINK or
//! RMDIR (a file under the target directory's `dir` record, a directory through a `del`
//! record).

use std::ffi::CString;

use kiln_wire::{Creds, FopCode, Gfid, Rename, RenameMode, RenameReply};
use rustix::io::Errno;

use super::super::chain::{At, Chain};
use super::super::{Fops, R, iatt};
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
enum Victim {
    /// A directory: its handle parks in a `del` record until the commit.
    Dir { gfid: Gfid, record: CString },
    /// A file: when this is its last name, its handle goes before the commit, as in UNLINK.
    File {
        gfid: Gfid,
        ino: u64,
        last_name: bool,
    },
}

impl Victim {
    fn gfid(&self) -> Gfid {
        match self {
            Victim::Dir { gfid, .. } | Victim::File { gfid, .. } => *gfid,
        }
    }
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
}

/// The steps of a rename chain whose results the fop reads back.
#[derive(Debug)]
struct RenameSteps {
    pre_old: At<Stat>,
    pre_new: At<Stat>,
    records: Vec<At<()>>,
    victim: Option<At<()>>,
    commit: At<()>,
    stat: At<Stat>,
    post_old: At<Stat>,
    post_new: At<Stat>,
}

impl<E: Exec> Fops<E> {
    pub(in crate::fops) async fn rename(&self, creds: &Creds, r: Rename) -> R<RenameReply> {
        Self::check_entry(&r.old_parent, &r.old_name)?;
        Self::check_entry(&r.new_parent, &r.new_name)?;
        let ends = Ends {
            src_dir: self.dir(&r.old_parent).await?,
            dst_dir: self.dir(&r.new_parent).await?,
            old: cstr(r.old_name.as_bytes()),
            new: cstr(r.new_name.as_bytes()),
        };
        let plan = self.plan_rename(creds, &r, &ends).await?;
        let _parked = plan.victim.as_ref().map(|v| self.shared.park(v.gfid()));
        let under_record = match &plan.victim {
            Some(Victim::File { .. }) => Some(self.under_dir_record(&r.new_parent).await?),
            _ => None,
        };
        let (chain, steps) = self.rename_chain(creds, &r, &ends, &plan);
        let mut results = match self.run_namespace(FopCode::Rename, chain).await {
            Ok(results) => results,
            Err(e) => {
                // A crash point: the record stays for the reopened brick's repair.
                std::mem::forget(under_record);
                return Err(e);
            }
        };
        let victim_step_done = steps.victim.is_some_and(|at| results.ok(at));
        if let Some(e) = results.error(steps.commit) {
            for (moved, record) in plan.moved.iter().zip(&steps.records) {
                if results.ok(*record) {
                    self.unlink_quietly(&self.brick.pending, &moved.record, false)
                        .await;
                }
            }
            match &plan.victim {
                Some(Victim::Dir { gfid, record }) if victim_step_done => {
                    self.handle_back(gfid, record).await;
                }
                Some(Victim::File { gfid, ino, .. }) if victim_step_done => {
                    self.relink_handle(&ends.dst_dir, &ends.new, gfid, *ino)
                        .await;
                }
                _ => {}
            }
            return Err(e);
        }
        let handles = steps.commit.index() + 1..steps.stat.index();
        if let Some(e) = results.first_error_between(handles.start, handles.end) {
            // The rename happened but a handle could not follow (ENOSPC, EIO): the name is
            // right and `kiln-brickd check --repair` fixes the handle.
            tracing::warn!(error = %e, "rename committed but a handle update failed");
        }
        match &plan.victim {
            Some(Victim::Dir { gfid, record }) => {
                if victim_step_done {
                    self.unlink_quietly(&self.brick.pending, record, false)
                        .await;
                }
                self.forget_dir(gfid);
            }
            Some(Victim::File {
                gfid,
                last_name: false,
                ..
            }) => self.drop_handle_if_unnamed(gfid).await,
            _ => {}
        }
        Ok(RenameReply {
            iatt: iatt(&results.take(steps.stat)?, plan.src_gfid),
            pre_old_parent: iatt(&results.take(steps.pre_old)?, r.old_parent),
            post_old_parent: iatt(&results.take(steps.post_old)?, r.old_parent),
            pre_new_parent: iatt(&results.take(steps.pre_new)?, r.new_parent),
            post_new_parent: iatt(&results.take(steps.post_new)?, r.new_parent),
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
        // A replaced target loses a name (see `Victim`).
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
                plan.victim = Some(match st.is_dir() {
                    true => Victim::Dir {
                        gfid,
                        record: record_name(RecordKind::Del, &gfid),
                    },
                    // This name and the handle: no other name is left after the commit.
                    false => Victim::File {
                        gfid,
                        ino: st.ino,
                        last_name: st.nlink <= 2,
                    },
                });
            }
            _ => {}
        }
        Ok(plan)
    }

    /// Records for moved directories, the victim's handle parked or unlinked, the caller's rename (the
    /// barrier), the moved handles installed, then the stats of the reply.
    fn rename_chain(
        &self,
        creds: &Creds,
        r: &Rename,
        ends: &Ends,
        plan: &RenamePlan,
    ) -> (Chain, RenameSteps) {
        let mut chain = Chain::new();
        let pre_old = chain.push(Step::brick(op::Fstat::dir(&ends.src_dir)));
        let pre_new = chain.push(Step::brick(op::Fstat::dir(&ends.dst_dir)));
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
        let victim = match &plan.victim {
            Some(Victim::Dir { gfid, record }) => Some(chain.push(self.park_handle(gfid, record))),
            Some(Victim::File {
                gfid,
                last_name: true,
                ..
            }) => Some(chain.push(self.unlink_handle(gfid))),
            _ => None,
        };
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
        let post_old = chain.push(Step::brick(op::Fstat::dir(&ends.src_dir)));
        let post_new = chain.push(Step::brick(op::Fstat::dir(&ends.dst_dir)));
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
