//! Rebalance: every file moved to the brick its name hashes to, while clients keep using it
//! (GlusterFS's rebalance migration, in phases that [`super::files`] follows).
//!
//! One file moves from brick `from` to its hashed brick `to` so:
//!
//! 1. **Destination.** On `to`, a link file to `from` under the file's name and GFID (the one
//!    a rename left is reused). Lookups still follow it to `from`.
//! 2. **Copying.** `from`'s copy gets a `linkto` xattr naming `to` and the sticky bit: from
//!    here each client sends what it changes in the file's data to `to` as well.
//! 3. **Copy until equal.** Passes over the file compare each chunk of `from` with `to` and
//!    copy the chunks that differ, until a whole pass finds none. A chunk copied is read from
//!    `from` again and copied again if it changed: a client's write that landed on `from`
//!    after the chunk was read may have reached `to` before the copy, which overwrote it.
//!    A file that keeps changing is left where it is after [`PASSES_MAX`] passes.
//! 4. **Switch.** `to`'s copy gets the file's xattrs, owner, mode and times and loses its
//!    `linkto`: it is the file. `from`'s copy gets a link file's mode (`01000`), which sends
//!    every client still using it to `to`, and its name is removed.
//!
//! Files with hard links stay where they are (as GlusterFS's rebalance leaves them by default),
//! but off a leaving brick: there the sweep after the walk, which lists the brick's own tree
//! and so finds every name of the file, moves it with all its names at once
//! (`Distribute::move_linked`). Files with the sticky bit or no permission bits, which
//! would read as a phase, stay.
//! Renames, unlinks and hard links of a file wait for its move to end ([`super::files`]), and
//! a move is given up when its name changed before the switch; a rename that looked before
//! the file was marked and lands after that last check is not excluded (GlusterFS takes an
//! entry lock for it; Kiln has none yet).
//!
//! Here: the entry points and what they count; [`walk`] the walk of the tree and the sweep
//! of the leaving bricks after it; [`phases`] one file's move through its phases; [`copy`]
//! the passes that copy a file until equal; [`linked`] files with hard links off a leaving
//! brick; [`attrs`] the xattrs and attributes set on a brick's copy.

use std::sync::atomic::AtomicBool;

use kiln_admin::volume::BrickRole;

use super::*;

mod attrs;
mod copy;
mod linked;
mod phases;
mod walk;

pub(super) use attrs::size_attr;

/// Bytes a copy reads and writes at a time.
const CHUNK_BYTES: u32 = 1024 * 1024;
/// Copy passes over a file before it counts as too busy to move.
const PASSES_MAX: usize = 8;
/// Copies of one chunk in a pass while clients keep changing it.
const CHUNK_TRIES_MAX: usize = 8;
/// Files of one directory moved at a time (each holds two 1 MiB chunks while it copies).
const MOVES_IN_FLIGHT: usize = 16;

/// What [`Distribute::rebalance`] did (a type of the command socket: the management daemon
/// relays it from the rebalance it runs).
pub use kiln_admin::command::RebalanceReport;

/// The files of one directory a rebalance has seen (each counted once, wherever listed), and
/// those it moved (listed again on the brick they moved to, where nothing is left to do). A
/// file in place on its hashed brick does not hide another copy of it elsewhere: a move a
/// dead rebalance left half done.
#[derive(Default)]
struct Walked {
    seen: Mutex<std::collections::HashSet<Gfid>>,
    moved: Mutex<std::collections::HashSet<Gfid>>,
}

/// What the rebalance did with one entry.
enum Outcome {
    /// Nothing: where it belongs, or moved there by this walk already.
    InPlace,
    Moved {
        bytes: u64,
    },
    Skipped(&'static str),
    LinkFileRemoved,
    /// A file with hard links on a leaving brick: the sweep after the walk moves it with
    /// all its names.
    Deferred,
}

/// Counts in `report` what happened to entry `name` of `dir` (logged); whether it is where
/// the layout says.
fn count(
    report: &mut RebalanceReport,
    outcome: Result<Outcome, Error>,
    dir: Gfid,
    name: &Name,
    from: usize,
    to: usize,
) -> bool {
    let name = name.as_bytes().escape_ascii();
    match outcome {
        // Removed or replaced since it was listed: nothing to move.
        Ok(Outcome::InPlace) | Err(Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale)) => {}
        Ok(Outcome::LinkFileRemoved) => report.link_files_removed += 1,
        Ok(Outcome::Moved { bytes }) => {
            report.moved += 1;
            report.bytes_moved += bytes;
            tracing::debug!(%dir, %name, from, to, bytes, "rebalance: moved a file");
        }
        Ok(Outcome::Deferred) => return false,
        Ok(Outcome::Skipped(why)) => {
            report.skipped += 1;
            tracing::info!(%dir, %name, from, to, why, "rebalance: left a file in place");
            return false;
        }
        Err(e) => {
            report.failed += 1;
            tracing::warn!(%dir, %name, from, to, error = %e, "rebalance: an entry failed");
            return false;
        }
    }
    true
}

impl<L: Layer> Distribute<L> {
    /// The bricks leaving the volume, which a rebalance empties.
    pub fn leaving(&self) -> Vec<usize> {
        let leaving = |&i: &usize| self.bricks.role(i) == BrickRole::Leaving;
        self.bricks.indexes().filter(leaving).collect()
    }

    /// Lays every directory out over every serving brick (as [`Distribute::heal_tree`]; with
    /// a brick leaving, once every mount knows it: [`BRICKS_REFRESH`]), waits until every
    /// client uses those layouts ([`LAYOUT_TTL`]), then walks the tree and moves each file
    /// off its hashed brick there — everything off a leaving brick, symlinks and special
    /// files too — reporting after each directory; stops between two files once `stop` is
    /// set.
    pub async fn rebalance(
        &self,
        stop: &AtomicBool,
        progress: &mut (dyn FnMut(&RebalanceReport) + Send),
    ) -> Result<RebalanceReport, Error> {
        let root = Creds::root();
        let gone = |i| self.bricks.role(i) != BrickRole::Serving;
        if self.bricks.indexes().any(gone) {
            // Every mount knows a brick leaves (or was removed) before the layouts are
            // rebuilt without it: one that did not would give it its share back.
            tokio::time::sleep(BRICKS_REFRESH * 2).await;
        }
        let healed_so_far = |h: &HealReport| RebalanceReport {
            copies_made: h.copies_made,
            layouts_healed: h.layouts_healed,
            failed: h.failed,
            ..RebalanceReport::default()
        };
        let healed = self
            .heal_tree_reporting(&root, stop, &mut |h| progress(&healed_so_far(h)))
            .await?;
        let mut report = healed_so_far(&healed);
        // Every client reads the new layouts again before any file moves, or a layout is
        // committed: none places a new name by the old one after.
        tokio::time::sleep(LAYOUT_TTL * 2).await;
        let mut pending = vec![Gfid::ROOT];
        while let Some(dir) = pending.pop() {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            report.dirs += 1;
            match self.rebalance_dir(dir, stop, &mut report).await {
                Ok(subdirs) => pending.extend(subdirs),
                Err(e) => {
                    tracing::warn!(%dir, error = %e, "rebalance: a directory failed");
                    report.failed += 1;
                }
            }
            progress(&report);
        }
        if !self.leaving().is_empty() && !stop.load(Ordering::Relaxed) {
            report.left_on_leaving = self.sweep_leaving(stop, &mut report).await?;
            progress(&report);
        }
        Ok(report)
    }
}
