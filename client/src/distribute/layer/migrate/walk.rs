//! The walk of the tree a rebalance makes, directory by directory, and the sweep of the
//! leaving bricks after it.

use std::sync::atomic::AtomicBool;

use futures_util::StreamExt as _;

use kiln_admin::volume::BrickRole;

use super::super::namespace::authoritative;
use super::*;

impl<L: Layer> Distribute<L> {
    /// Moves the files of directory `dir` that are off their hashed brick, and commits its
    /// layout when every name follows it; its subdirectories.
    pub(super) async fn rebalance_dir(
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
                    self.remove_link_file_of(from, dir, name, iatt.gfid).await?;
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

    /// Moves what the walk left on the leaving bricks — files with hard links, with all their
    /// names, then whatever else is there (a file renamed meanwhile into a directory walked
    /// already), each directory walked again, which also commits its layout — then counts
    /// what is still on them: entries other than directories, each logged.
    pub(super) async fn sweep_leaving(
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
}
