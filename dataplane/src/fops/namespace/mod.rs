//! Namespace fops and their intent protocol (`docs/disk-layout.md`, `crate::brick::intent`):
//! an intent record first, then the caller-visible step that commits (the chain's barrier),
//! then the housekeeping (GFID xattr, handle), then the record goes — all one chain. A crash
//! anywhere leaves a record that start-up repair settles.
//!
//! [`create`]: CREATE, PUT, MKDIR, MKNOD, SYMLINK and LINK; [`files`]: the cheaper way a new
//! regular file is made where the file system allows; [`remove`]: UNLINK and RMDIR, and what a
//! removal does to the handle afterwards; [`dir_record`]: the one record a busy directory's
//! file creates and unlinks share; [`rename`]: RENAME.

mod create;
mod dir_record;
mod files;
mod remove;
mod rename;

use std::ffi::CString;

use kiln_wire::{FopCode, Gfid, Iatt};
use rustix::io::Errno;

use super::chain::{At, Chain, Results};
use super::{Fops, ParentAttrs, R, iatt, lock};
use crate::brick::Brick;
use crate::exec::Exec;
use crate::op::{self, DirFd, Stat, Step};
use crate::profile;
pub(super) use dir_record::DirRecord;
pub(crate) use dir_record::spawn_dir_record_sweeper;

impl ParentAttrs {
    /// An `fstat` of the parent `dir` pushed onto `chain`, when the reply carries it.
    fn push(self, chain: &mut Chain, dir: &DirFd) -> Option<At<Stat>> {
        (self == ParentAttrs::Stat).then(|| chain.push(Step::brick(op::Fstat::dir(dir))))
    }
}

/// The attributes of `parent` a reply carries: what the step `at` read, or
/// [`Iatt::omitted_dir`] when the session did not ask for them.
fn parent_iatt(results: &mut Results, at: Option<At<Stat>>, parent: Gfid) -> R<Iatt> {
    match at {
        Some(at) => Ok(iatt(&results.take(at)?, parent)),
        None => Ok(Iatt::omitted_dir(parent)),
    }
}

impl<E: Exec> Fops<E> {
    fn crash_point_for(&self, fop: FopCode) -> Option<usize> {
        lock(&self.crash_point)
            .filter(|p| p.fop == fop)
            .map(|p| p.after_steps)
    }

    /// Runs a namespace chain, or — when a crash point is armed for `fop` — only its first
    /// steps, reporting EIO as a killed brick would (no rollback).
    async fn run_namespace(&self, fop: FopCode, mut chain: Chain) -> R<Results> {
        if let Some(n) = self.crash_point_for(fop) {
            chain.truncate(n);
            let _ = self.run(chain).await;
            return Err(Errno::IO);
        }
        profile::charge(|c| c.intents += 1);
        Ok(self.run(chain).await)
    }

    /// Removes `dir/name`, ignoring the result: undoing a step of a fop that already failed.
    async fn unlink_quietly(&self, dir: &DirFd, name: &CString, dir_flag: bool) {
        let unlink = op::Unlink {
            dir: dir.clone(),
            name: name.clone(),
            dir_flag,
        };
        let _ = self.run1(Step::brick(unlink)).await;
    }

    /// A step that renames `gfid`'s handle into the pending directory as `record`.
    fn park_handle(&self, gfid: &Gfid, record: &CString) -> Step {
        Step::brick(op::Rename {
            old_dir: self.brick.handle_dir(gfid).clone(),
            old_name: Brick::handle_name(gfid),
            new_dir: self.brick.pending.clone(),
            new_name: record.clone(),
            flags: 0,
        })
    }

    /// A step that renames `record` from the pending directory into place as `gfid`'s handle,
    /// replacing the one there when `replace` (a moved directory's new handle), else never
    /// (a parked handle put back must not overwrite another).
    fn install_handle(&self, gfid: &Gfid, record: &CString, replace: bool) -> Step {
        Step::brick(op::Rename {
            old_dir: self.brick.pending.clone(),
            old_name: record.clone(),
            new_dir: self.brick.handle_dir(gfid).clone(),
            new_name: Brick::handle_name(gfid),
            flags: if replace { 0 } else { libc::RENAME_NOREPLACE },
        })
    }
}
