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

use std::sync::atomic::AtomicBool;

use futures_util::StreamExt as _;

use kiln_admin::volume::BrickRole;

use super::files::{Look, STICKY};
use super::namespace::authoritative;
use super::*;

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

/// A chunk of a file made equal on the destination.
struct Chunk {
    /// Its length on the source (0 past the end).
    len: u64,
    /// Bytes written to the destination.
    copied: u64,
    /// Equal on both when last read: not changing faster than it is copied.
    settled: bool,
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

    /// Moves what the walk left on the leaving bricks — files with hard links, with all their
    /// names, then whatever else is there (a file renamed meanwhile into a directory walked
    /// already), each directory walked again, which also commits its layout — then counts
    /// what is still on them: entries other than directories, each logged.
    async fn sweep_leaving(
        &self,
        stop: &AtomicBool,
        report: &mut RebalanceReport,
    ) -> Result<u64, Error> {
        let mut left = 0;
        for brick in self.leaving() {
            let entries = self.entries_on(brick).await?;
            let missed: std::collections::BTreeSet<Gfid> =
                entries.iter().map(|(dir, _)| *dir).collect();
            self.move_hard_linked(brick, &entries, stop, report).await;
            for dir in missed {
                // (Only what moves counts again: the rest was counted by the walk.)
                let mut again = RebalanceReport::default();
                if let Err(e) = self.rebalance_dir(dir, stop, &mut again).await {
                    tracing::warn!(%dir, error = %e, "rebalance: a directory failed");
                    report.failed += 1;
                }
                report.moved += again.moved;
                report.bytes_moved += again.bytes_moved;
                report.link_files_removed += again.link_files_removed;
            }
            for (dir, entry) in self.entries_on(brick).await? {
                let name = entry.name.as_bytes().escape_ascii();
                tracing::warn!(%dir, %name, brick, "rebalance: an entry is left on a leaving brick");
                left += 1;
            }
        }
        Ok(left)
    }

    /// Moves each file with hard links among `entries` (brick `from`'s, with their
    /// directories) whose every name is there, stopping between two files once `stop` is set.
    async fn move_hard_linked(
        &self,
        from: usize,
        entries: &[(Gfid, kiln_wire::DirEntryPlus)],
        stop: &AtomicBool,
        report: &mut RebalanceReport,
    ) {
        let mut names: std::collections::BTreeMap<Gfid, Vec<(Gfid, Name)>> = Default::default();
        for (dir, entry) in entries {
            let (iatt, file) = (&entry.iatt, entry.iatt.file_type == FileType::Regular);
            if file && iatt.nlink > 1 && !looks_like_link_file(iatt) {
                let of_file = names.entry(entry.iatt.gfid).or_default();
                of_file.push((*dir, entry.name.clone()));
            }
        }
        for (gfid, names) in names {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            let (dir, name) = &names[0];
            let (to, outcome) = match self.hashed(*dir, name).await {
                Ok((to, _)) => (to, self.move_linked(from, to, gfid, &names).await),
                Err(e) => (from, Err(e)),
            };
            count(report, outcome, *dir, name, from, to);
        }
    }

    /// Moves file `gfid`, whose names on leaving brick `from` are `names`, to brick `to`
    /// (where its first name hashes), every name with it. Before the file is marked, every
    /// name gets its entry off `from`: on `to` a name of the destination (hard links of one
    /// inode), on a third brick a link file to `from`. After the switch the third bricks'
    /// link files are pointed at `to` (no name is made then: a client may unlink or rename
    /// one the moment the move ends), and only then do the other names leave `from`.
    /// Renames, unlinks and links of the file wait meanwhile, as for any move
    /// ([`super::files`]).
    async fn move_linked(
        &self,
        from: usize,
        to: usize,
        gfid: Gfid,
        names: &[(Gfid, Name)],
    ) -> Result<Outcome, Error> {
        let root = Creds::root();
        let [(dir, name), others @ ..] = names else {
            return Ok(Outcome::InPlace);
        };
        let now = self.bricks.get(from)?.stat(&root, gfid).await?;
        let mode = now.mode.bits();
        if now.nlink as usize != names.len() {
            return Ok(Outcome::Skipped(
                "it was linked or unlinked during the walk",
            ));
        }
        if reads_as_phase(mode) {
            return Ok(Outcome::Skipped("its mode would read as a migration phase"));
        }
        if !self.make_destination(*dir, name, gfid, from, to).await? {
            return Ok(Outcome::Skipped(
                "another object holds its name on the hashed brick",
            ));
        }
        let mut third = std::collections::BTreeSet::new();
        for (dir, name) in names {
            if let Some(why) = self.give_name(to, *dir, name, gfid, from).await? {
                return Ok(Outcome::Skipped(why));
            }
            let (on, _) = self.hashed(*dir, name).await?;
            if on != to {
                third.insert(on);
                if let Some(why) = self.give_name(on, *dir, name, gfid, from).await? {
                    return Ok(Outcome::Skipped(why));
                }
            }
        }
        // (An older link file's name of it on `to` would become one more name of the file.)
        let there = self.bricks.get(to)?.stat(&root, gfid).await?;
        if there.nlink as usize != names.len() {
            return Ok(Outcome::Skipped(
                "the brick it moves to has other names of it",
            ));
        }
        let Some(bytes) = self.mark_and_copy(from, to, gfid, mode).await? else {
            return Ok(Outcome::Skipped("it kept changing"));
        };
        if !self.still_named(from, gfid, names).await? {
            self.abandon_move(from, to, gfid).await?;
            return Ok(Outcome::Skipped("it was renamed or linked during its move"));
        }
        self.switch_to(*dir, name, from, to, gfid).await?;
        for on in third {
            self.point_link_files(on, gfid, to).await?;
        }
        for (other_dir, other) in others {
            self.remove_if_still(from, *other_dir, other, |t| t.gfid == gfid)
                .await?;
        }
        Ok(Outcome::Moved { bytes })
    }

    /// Gives file `gfid` (moving off brick `from`) the name `name` in `dir` on brick `brick`
    /// (unless `brick` is `from`): a link file to `from`, or one more name of the one there;
    /// why the move cannot go on, if it cannot.
    async fn give_name(
        &self,
        brick: usize,
        dir: Gfid,
        name: &Name,
        gfid: Gfid,
        from: usize,
    ) -> Result<Option<&'static str>, Error> {
        if brick == from {
            return Ok(None);
        }
        match self
            .bricks
            .get(brick)?
            .lookup(&Creds::root(), dir, name)
            .await
        {
            Ok(there) if there.gfid == gfid => Ok(None),
            Ok(_) => Ok(Some(
                "another object holds one of its names on another brick",
            )),
            Err(Error::Fop(ErrorCode::NoEnt)) => {
                match self.make_link_file(brick, dir, name, gfid, from).await {
                    Ok(()) => Ok(None),
                    Err(Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale)) => Ok(Some(
                        "a directory of one of its names is missing on a brick",
                    )),
                    // Made meanwhile (a client's lookup makes link files too): the next
                    // run looks again.
                    Err(Error::Fop(ErrorCode::Exist)) => {
                        Ok(Some("one of its names was made on another brick meanwhile"))
                    }
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        }
    }

    /// Points the link files of object `gfid` on brick `on` (one inode, whatever its names)
    /// at brick `to`; none there is fine.
    pub(super) async fn point_link_files(
        &self,
        on: usize,
        gfid: Gfid,
        to: usize,
    ) -> Result<(), Error> {
        match self.bricks.get(on)?.stat(&Creds::root(), gfid).await {
            Ok(there) if looks_like_link_file(&there) => {
                self.set_xattr(on, gfid, LINKTO_XATTR, self.link_value(to))
                    .await
            }
            Ok(_) | Err(Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Whether file `gfid` on brick `from` has exactly the names `names` still.
    async fn still_named(
        &self,
        from: usize,
        gfid: Gfid,
        names: &[(Gfid, Name)],
    ) -> Result<bool, Error> {
        let root = Creds::root();
        for (dir, name) in names {
            match self.bricks.get(from)?.lookup(&root, *dir, name).await {
                Ok(there) if there.gfid == gfid && there.nlink as usize == names.len() => {}
                Ok(_) | Err(Error::Fop(ErrorCode::NoEnt)) => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// The entries other than directories on brick `brick`, with their directories, found
    /// by walking its own tree.
    async fn entries_on(
        &self,
        brick: usize,
    ) -> Result<Vec<(Gfid, kiln_wire::DirEntryPlus)>, Error> {
        let root = Creds::root();
        let (mut pending, mut found) = (vec![Gfid::ROOT], Vec::new());
        while let Some(dir) = pending.pop() {
            let entries = match self.bricks.get(brick)?.read_dir(&root, dir).await {
                Ok(entries) => entries,
                Err(Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale)) => continue,
                Err(e) => return Err(e),
            };
            for entry in entries {
                match entry.iatt.file_type {
                    FileType::Directory => pending.push(entry.iatt.gfid),
                    _ => found.push((dir, entry)),
                }
            }
        }
        Ok(found)
    }

    /// Moves the files of directory `dir` that are off their hashed brick, and commits its
    /// layout when every name follows it; its subdirectories.
    async fn rebalance_dir(
        &self,
        dir: Gfid,
        stop: &AtomicBool,
        report: &mut RebalanceReport,
    ) -> Result<Vec<Gfid>, Error> {
        let root = Creds::root();
        let layout = self.layout(dir).await?;
        let mut subdirs = std::collections::BTreeSet::new();
        let walked = Walked::default();
        let mut settled = true;
        for (from, brick) in self.bricks.in_service() {
            let entries = match brick.read_dir(&root, dir).await {
                Ok(entries) => entries,
                Err(Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale)) => continue,
                Err(e) => return Err(e),
            };
            let (dirs, others): (Vec<_>, Vec<_>) = entries
                .into_iter()
                .partition(|e| e.iatt.file_type == FileType::Directory);
            subdirs.extend(dirs.iter().map(|d| d.iatt.gfid));
            // Several files at a time: a move is a few dozen round trips one after another.
            let (layout, walked) = (&layout, &walked);
            let mut moves = futures_util::stream::iter(others.iter().map(|entry| async move {
                if stop.load(Ordering::Relaxed) {
                    return None;
                }
                let to = layout.hashed_brick(entry.name.as_bytes(), self.munging);
                let outcome = match to {
                    Some(to) => Some(self.rebalance_entry(dir, from, entry, to, walked).await),
                    None => None,
                };
                Some((entry, to, outcome))
            }))
            .buffer_unordered(MOVES_IN_FLIGHT);
            // (What stays on a leaving brick is counted by the sweep after the walk.)
            while let Some(done) = moves.next().await {
                match done {
                    Some((entry, Some(to), Some(outcome))) => {
                        settled &= count(report, outcome, dir, &entry.name, from, to);
                    }
                    // In a hole of the layout: nowhere to go.
                    Some(_) => settled = false,
                    None => {}
                }
            }
            if stop.load(Ordering::Relaxed) {
                return Ok(Vec::new());
            }
        }
        report.files += lock(&walked.seen).len() as u64;
        if settled && !authoritative(&layout) {
            let committed = (*layout).clone().with_commit_hash(COMMIT_HASH_COMMITTED);
            self.store_layout(dir, committed).await?;
        }
        Ok(subdirs.into_iter().collect())
    }

    /// Puts entry `entry` of directory `dir`, listed on brick `from`, where its hashed brick
    /// `to` says: a file moved there, anything else given a link file there, a link file
    /// elsewhere removed.
    async fn rebalance_entry(
        &self,
        dir: Gfid,
        from: usize,
        entry: &kiln_wire::DirEntryPlus,
        to: usize,
        walked: &Walked,
    ) -> Result<Outcome, Error> {
        let (name, iatt) = (&entry.name, &entry.iatt);
        if let Some(target) = self.link_file_target(from, iatt).await? {
            if from != to {
                self.remove_link_file(from, dir, name).await?;
                return Ok(Outcome::LinkFileRemoved);
            }
            if self.bricks.role(target) != BrickRole::Removed {
                return Ok(Outcome::InPlace);
            }
            // Its brick was removed: with its files (`remove-brick … force`), or after a
            // move that did not get to point it at the file's new brick.
            lock(&self.homes).pop(&iatt.gfid);
            return match self.find_home(&Creds::root(), iatt.gfid, 0).await {
                Ok(Home::Brick(home)) => {
                    self.point_link_files(from, iatt.gfid, home).await?;
                    Ok(Outcome::InPlace)
                }
                Ok(Home::Everywhere) | Err(Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale)) => {
                    let gfid = iatt.gfid;
                    let link_file = |t: &Iatt| t.gfid == gfid && looks_like_link_file(t);
                    self.remove_if_still(from, dir, name, link_file).await?;
                    Ok(Outcome::LinkFileRemoved)
                }
                Err(e) => Err(e),
            };
        }
        lock(&walked.seen).insert(iatt.gfid);
        if from == to || lock(&walked.moved).contains(&iatt.gfid) {
            return Ok(Outcome::InPlace);
        }
        if iatt.file_type != FileType::Regular {
            if self.bricks.role(from) == BrickRole::Leaving {
                return self.move_node(dir, name, from, iatt.gfid, to).await;
            }
            // A symlink or special file stays; a link file on its hashed brick finds it.
            return match self.make_link_file(to, dir, name, iatt.gfid, from).await {
                Ok(()) | Err(Error::Fop(ErrorCode::Exist)) => Ok(Outcome::InPlace),
                Err(e) => Err(e),
            };
        }
        let outcome = self.migrate_file(dir, name, from, iatt, to).await;
        if let Ok(Outcome::Moved { .. }) = outcome {
            lock(&walked.moved).insert(iatt.gfid);
        }
        outcome
    }

    /// Moves file `iatt`, `name` in `dir`, from brick `from` to brick `to`.
    async fn migrate_file(
        &self,
        dir: Gfid,
        name: &Name,
        from: usize,
        iatt: &Iatt,
        to: usize,
    ) -> Result<Outcome, Error> {
        if Look::of(iatt) == Look::Copying
            && let Some(was_to) = self.moving_to(from, iatt.gfid).await?
        {
            // Left marked by a rebalance that was stopped or died mid-move: finished when
            // its destination had become the file, else undone and started again.
            match self
                .bricks
                .get(was_to)?
                .stat(&Creds::root(), iatt.gfid)
                .await
            {
                Ok(there) if !looks_like_link_file(&there) => {
                    self.set_mode(from, iatt.gfid, LINK_FILE_MODE).await?;
                    self.note_home(&there, was_to);
                    let gfid = iatt.gfid;
                    self.remove_if_still(from, dir, name, |t| t.gfid == gfid)
                        .await?;
                    return Ok(Outcome::Moved { bytes: 0 });
                }
                Ok(_) | Err(Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale)) => {
                    self.abandon_move(from, was_to, iatt.gfid).await?;
                }
                Err(e) => return Err(e),
            }
        }
        // As it is now, not as listed (a chmod since must not be undone).
        let now = self
            .bricks
            .get(from)?
            .stat(&Creds::root(), iatt.gfid)
            .await?;
        let mode = now.mode.bits();
        if now.nlink != 1 {
            return Ok(match self.bricks.role(from) {
                BrickRole::Leaving => Outcome::Deferred,
                _ => Outcome::Skipped("it has hard links"),
            });
        }
        if reads_as_phase(mode) {
            return Ok(Outcome::Skipped("its mode would read as a migration phase"));
        }
        if !self
            .make_destination(dir, name, iatt.gfid, from, to)
            .await?
        {
            return Ok(Outcome::Skipped(
                "another object holds its name on the hashed brick",
            ));
        }
        let gfid = iatt.gfid;
        let Some(bytes) = self.mark_and_copy(from, to, gfid, mode).await? else {
            return Ok(Outcome::Skipped("it kept changing"));
        };
        // Renamed, unlinked or linked after it was marked, by a client that looked before:
        // given up (later ones wait for the move to end).
        if !self.still_named(from, gfid, &[(dir, name.clone())]).await? {
            self.abandon_move(from, to, gfid).await?;
            return Ok(Outcome::Skipped("it was renamed or linked during its move"));
        }
        self.switch_to(dir, name, from, to, gfid).await?;
        Ok(Outcome::Moved { bytes })
    }

    /// Moves symlink or special file `gfid` (`name` in `dir`) off leaving brick `from` to
    /// `to`: made again there under its GFID (over the link file a rebalance may have left
    /// for it) with its owner, times and xattrs, then removed from `from`. While both exist a
    /// lookup finds the one on `to`; before, the one on `from` (the layout is uncommitted).
    async fn move_node(
        &self,
        dir: Gfid,
        name: &Name,
        from: usize,
        gfid: Gfid,
        to: usize,
    ) -> Result<Outcome, Error> {
        let root = Creds::root();
        let now = self.bricks.get(from)?.stat(&root, gfid).await?;
        if now.nlink != 1 {
            return Ok(Outcome::Skipped("it has hard links"));
        }
        match self.bricks.get(to)?.lookup(&root, dir, name).await {
            Ok(there) if there.gfid == gfid && looks_like_link_file(&there) => {
                self.remove_link_file(to, dir, name).await?;
            }
            Ok(_) => {
                return Ok(Outcome::Skipped(
                    "another object holds its name on the hashed brick",
                ));
            }
            Err(Error::Fop(ErrorCode::NoEnt)) => {}
            Err(e) => return Err(e),
        }
        let (parent, name) = (dir, name.clone());
        let make: FopRequest = match now.file_type {
            FileType::Symlink => {
                let read = kiln_wire::Readlink { gfid };
                let target = match self.bricks.get(from)?.call(&root, read.into()).await? {
                    FopReply::Readlink(r) => r.target,
                    other => return Err(unexpected(&other)),
                };
                let name = name.clone();
                kiln_wire::Symlink {
                    parent,
                    name,
                    gfid,
                    target,
                }
                .into()
            }
            other => kiln_wire::Mknod {
                parent,
                name: name.clone(),
                gfid,
                node_type: node_type(other)?,
                mode: now.mode,
                umask: Mode::from_st_mode(0),
                rdev: now.rdev,
            }
            .into(),
        };
        self.bricks.get(to)?.call(&root, make).await?;
        self.copy_xattrs(from, to, gfid).await?;
        self.set_attr(to, gfid, owner_and_times(&now)).await?;
        self.note_home(&now, to);
        self.remove_if_still(from, dir, &name, |t| t.gfid == gfid)
            .await?;
        Ok(Outcome::Moved { bytes: 0 })
    }

    /// Makes the destination of file `gfid` (`name` in `dir`) on brick `to`: a link file to
    /// `from`, or the one there made empty; `false` when another object holds the name.
    async fn make_destination(
        &self,
        dir: Gfid,
        name: &Name,
        gfid: Gfid,
        from: usize,
        to: usize,
    ) -> Result<bool, Error> {
        let root = Creds::root();
        // Twice at most: a client's lookup that finds the file off its hashed brick makes
        // the same link file, and may make it first.
        for _ in 0..2 {
            match self.bricks.get(to)?.lookup(&root, dir, name).await {
                Ok(there) if there.gfid == gfid && looks_like_link_file(&there) => {
                    if there.size > 0 {
                        self.set_attr(to, gfid, size_attr(0)).await?;
                    }
                    self.set_xattr(to, gfid, LINKTO_XATTR, self.link_value(from))
                        .await?;
                    return Ok(true);
                }
                Ok(_) => return Ok(false),
                Err(Error::Fop(ErrorCode::NoEnt)) => {
                    match self.make_link_file(to, dir, name, gfid, from).await {
                        Ok(()) => return Ok(true),
                        Err(Error::Fop(ErrorCode::Exist)) => {}
                        Err(e) => return Err(e),
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(false)
    }

    /// Marks file `gfid` (of mode `mode`) on brick `from` as moving to brick `to` — its
    /// `linkto` xattr and the sticky bit — and copies it there until equal: the bytes copied,
    /// or `None` when it kept changing. A move not copied is undone.
    async fn mark_and_copy(
        &self,
        from: usize,
        to: usize,
        gfid: Gfid,
        mode: u32,
    ) -> Result<Option<u64>, Error> {
        self.set_xattr(from, gfid, LINKTO_XATTR, self.link_value(to))
            .await?;
        self.set_mode(from, gfid, mode | STICKY).await?;
        match self.copy_until_equal(from, to, gfid).await {
            Ok(Some(bytes)) => Ok(Some(bytes)),
            Ok(None) => {
                self.abandon_move(from, to, gfid).await?;
                Ok(None)
            }
            Err(e) => {
                if let Err(undo) = self.abandon_move(from, to, gfid).await {
                    tracing::warn!(%gfid, error = %undo, "rebalance: a move not undone");
                }
                Err(e)
            }
        }
    }

    /// Copies file `gfid` from brick `from` to `to` pass after pass until a pass finds the
    /// copies equal and the source still marked: the bytes copied, or `None` after
    /// [`PASSES_MAX`] passes.
    async fn copy_until_equal(
        &self,
        from: usize,
        to: usize,
        gfid: Gfid,
    ) -> Result<Option<u64>, Error> {
        let root = Creds::root();
        let src = self
            .bricks
            .get(from)?
            .open(&root, gfid, AccessMode::ReadOnly, OpenFlags::empty())
            .await?;
        let dst = match self
            .bricks
            .get(to)?
            .open(&root, gfid, AccessMode::ReadWrite, OpenFlags::empty())
            .await
        {
            Ok(dst) => dst,
            Err(e) => {
                let _ = self.bricks.get(from)?.release(&root, src).await;
                return Err(e);
            }
        };
        let mut copied = 0;
        let mut result = Ok(None);
        for _ in 0..PASSES_MAX {
            match self.copy_pass(from, &src, to, &dst).await {
                Ok(Some(bytes)) => copied += bytes,
                Ok(None) => {
                    result = self
                        .still_marked(from, gfid)
                        .await
                        .map(|marked| marked.then_some(copied));
                    if !matches!(result, Ok(None)) {
                        break;
                    }
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        let released = self.bricks.get(from)?.release(&root, src).await;
        let released = released.and(self.bricks.get(to)?.release(&root, dst).await);
        let copied = result?;
        released?;
        Ok(copied)
    }

    /// One pass: `dst` given `src`'s size, and each chunk of `src` that differs from `dst`'s
    /// copied; the bytes copied, `None` when the copies were equal.
    async fn copy_pass(
        &self,
        from: usize,
        src: &L::Fd,
        to: usize,
        dst: &L::Fd,
    ) -> Result<Option<u64>, Error> {
        let size = fstat(self.bricks.get(from)?, src).await?.size;
        let mut changed = fstat(self.bricks.get(to)?, dst).await?.size != size;
        if changed {
            let truncate = FdFop::new(|fd| kiln_wire::Ftruncate { fd, size }.into());
            self.bricks
                .get(to)?
                .call_fd(&Creds::root(), dst, truncate)
                .await?;
        }
        let (mut offset, mut copied) = (0, 0);
        while offset < size {
            let chunk = self.copy_chunk(from, src, to, dst, offset).await?;
            if chunk.len == 0 {
                break;
            }
            copied += chunk.copied;
            changed |= chunk.copied > 0 || !chunk.settled;
            offset += chunk.len;
        }
        changed |= fstat(self.bricks.get(from)?, src).await?.size != size;
        Ok(changed.then_some(copied))
    }

    /// Makes the chunk of `dst` at `offset` `src`'s: copied, then `src`'s read again, and
    /// copied again while a client's write changed it meanwhile (whose copy to `dst` may
    /// have come before this one's, and been overwritten).
    async fn copy_chunk(
        &self,
        from: usize,
        src: &L::Fd,
        to: usize,
        dst: &L::Fd,
        offset: u64,
    ) -> Result<Chunk, Error> {
        let root = Creds::root();
        let (from, to) = (self.bricks.get(from)?, self.bricks.get(to)?);
        let mut data = from.read(&root, src, offset, CHUNK_BYTES).await?;
        let mut chunk = Chunk {
            len: data.len() as u64,
            copied: 0,
            settled: false,
        };
        for _ in 0..CHUNK_TRIES_MAX {
            if to.read(&root, dst, offset, CHUNK_BYTES).await? == data {
                chunk.settled = true;
                break;
            }
            to.write(&root, dst, offset, data.clone()).await?;
            chunk.copied += data.len() as u64;
            let again = from.read(&root, src, offset, CHUNK_BYTES).await?;
            if again == data {
                chunk.settled = true;
                break;
            }
            data = again;
        }
        Ok(chunk)
    }

    /// Whether file `gfid` on brick `from` still has the sticky bit; put back (and `false`)
    /// when a user's chmod took it, as clients stopped sending their changes to the copy.
    async fn still_marked(&self, from: usize, gfid: Gfid) -> Result<bool, Error> {
        let now = self.bricks.get(from)?.stat(&Creds::root(), gfid).await?;
        if Look::of(&now) == Look::Copying {
            return Ok(true);
        }
        self.set_mode(from, gfid, now.mode.bits() | STICKY).await?;
        Ok(false)
    }

    /// Makes brick `to`'s copy of file `gfid` the file, and `from`'s a link file to it that
    /// is then removed (`name` in `dir`).
    async fn switch_to(
        &self,
        dir: Gfid,
        name: &Name,
        from: usize,
        to: usize,
        gfid: Gfid,
    ) -> Result<(), Error> {
        let root = Creds::root();
        let now = self.bricks.get(from)?.stat(&root, gfid).await?;
        self.copy_xattrs(from, to, gfid).await?;
        let attr = kiln_wire::SetAttr {
            mode: Mode::new(now.mode.bits() & !STICKY),
            ..owner_and_times(&now)
        };
        self.set_attr(to, gfid, attr).await?;
        self.remove_xattr(to, gfid, LINKTO_XATTR).await?;
        self.set_mode(from, gfid, LINK_FILE_MODE).await?;
        self.note_home(&now, to);
        self.remove_if_still(from, dir, name, |t| t.gfid == gfid)
            .await
    }

    /// Puts file `gfid` back as it was before its move began: brick `from`'s copy unmarked,
    /// `to`'s an empty link file to it.
    async fn abandon_move(&self, from: usize, to: usize, gfid: Gfid) -> Result<(), Error> {
        let gone = |e: &Error| matches!(e, Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale));
        match self.bricks.get(from)?.stat(&Creds::root(), gfid).await {
            Ok(now) => {
                self.set_mode(from, gfid, now.mode.bits() & !STICKY).await?;
                match self.remove_xattr(from, gfid, LINKTO_XATTR).await {
                    Ok(()) | Err(Error::Fop(ErrorCode::NoData)) => {}
                    Err(e) => return Err(e),
                }
            }
            // Unlinked meanwhile: nothing to unmark.
            Err(e) if gone(&e) => {}
            Err(e) => return Err(e),
        }
        // Emptied only while it is a link file still: never the file itself.
        match self.bricks.get(to)?.stat(&Creds::root(), gfid).await {
            Ok(there) if looks_like_link_file(&there) => {
                match self.set_attr(to, gfid, size_attr(0)).await {
                    Err(e) if !gone(&e) => Err(e),
                    _ => Ok(()),
                }
            }
            Ok(_) => Ok(()),
            Err(e) if gone(&e) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Copies the xattrs of file `gfid` from brick `from` to `to`, but DHT's and the GFID.
    async fn copy_xattrs(&self, from: usize, to: usize, gfid: Gfid) -> Result<(), Error> {
        let root = Creds::root();
        let names = match self
            .bricks
            .get(from)?
            .call(&root, kiln_wire::Listxattr { gfid }.into())
            .await?
        {
            FopReply::Listxattr(r) => r.entries,
            other => return Err(unexpected(&other)),
        };
        for name in names {
            let bytes = name.as_bytes();
            if bytes == b"trusted.gfid" || bytes.starts_with(b"trusted.glusterfs.") {
                continue;
            }
            let get = kiln_wire::Getxattr {
                gfid,
                name: name.clone(),
            };
            let value = match self.bricks.get(from)?.call(&root, get.into()).await {
                Ok(FopReply::Getxattr(r)) => r.value,
                Ok(other) => return Err(unexpected(&other)),
                Err(Error::Fop(ErrorCode::NoData)) => continue,
                Err(e) => return Err(e),
            };
            let set = kiln_wire::Setxattr {
                gfid,
                name,
                value,
                mode: XattrSetMode::Upsert,
            };
            self.bricks.get(to)?.call(&root, set.into()).await?;
        }
        Ok(())
    }

    async fn set_xattr(
        &self,
        brick: usize,
        gfid: Gfid,
        name: &'static str,
        value: XattrValue,
    ) -> Result<(), Error> {
        let set = kiln_wire::Setxattr {
            gfid,
            name: xattr_name(name),
            value,
            mode: XattrSetMode::Upsert,
        };
        self.bricks
            .get(brick)?
            .call(&Creds::root(), set.into())
            .await
            .map(drop)
    }

    async fn remove_xattr(
        &self,
        brick: usize,
        gfid: Gfid,
        name: &'static str,
    ) -> Result<(), Error> {
        let remove = kiln_wire::Removexattr {
            gfid,
            name: xattr_name(name),
        };
        self.bricks
            .get(brick)?
            .call(&Creds::root(), remove.into())
            .await
            .map(drop)
    }

    pub(super) async fn set_mode(&self, brick: usize, gfid: Gfid, mode: u32) -> Result<(), Error> {
        let attr = kiln_wire::SetAttr {
            mode: Some(Mode::new(mode).ok_or(Error::Fop(ErrorCode::Inval))?),
            ..kiln_wire::SetAttr::default()
        };
        self.set_attr(brick, gfid, attr).await
    }

    async fn set_attr(
        &self,
        brick: usize,
        gfid: Gfid,
        attr: kiln_wire::SetAttr,
    ) -> Result<(), Error> {
        let setattr = kiln_wire::Setattr { gfid, attr };
        self.bricks
            .get(brick)?
            .call(&Creds::root(), setattr.into())
            .await
            .map(drop)
    }
}

/// What gives an object's copy the owner and times of `now` (the original's).
/// Whether a file of mode `mode` would read as in a migration phase (the sticky bit, or no
/// permission bits: a link file's mode).
fn reads_as_phase(mode: u32) -> bool {
    mode & STICKY != 0 || mode & 0o777 == 0
}

fn owner_and_times(now: &Iatt) -> kiln_wire::SetAttr {
    kiln_wire::SetAttr {
        uid: Some(now.uid),
        gid: Some(now.gid),
        atime: Some(kiln_wire::TimeSet::At(now.atime)),
        mtime: Some(kiln_wire::TimeSet::At(now.mtime)),
        ..kiln_wire::SetAttr::default()
    }
}

/// What MKNOD makes a special file of `file_type` with.
fn node_type(file_type: FileType) -> Result<NodeType, Error> {
    Ok(match file_type {
        FileType::BlockDevice => NodeType::BlockDevice,
        FileType::CharDevice => NodeType::CharDevice,
        FileType::Fifo => NodeType::Fifo,
        FileType::Socket => NodeType::Socket,
        other => return Err(Error::Protocol(format!("no MKNOD makes a {other:?}"))),
    })
}

pub(super) fn size_attr(size: u64) -> kiln_wire::SetAttr {
    kiln_wire::SetAttr {
        size: Some(size),
        ..kiln_wire::SetAttr::default()
    }
}

async fn fstat<L: Layer>(brick: &L, fd: &L::Fd) -> Result<Iatt, Error> {
    let fop = FdFop::new(|fd| kiln_wire::Fstat { fd }.into());
    match brick.call_fd(&Creds::root(), fd, fop).await? {
        FopReply::Fstat(r) => Ok(r.iatt),
        other => Err(unexpected(&other)),
    }
}
