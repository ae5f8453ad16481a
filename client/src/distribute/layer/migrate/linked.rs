//! Files with hard links off a leaving brick: each moved with all its names at once.

use std::sync::atomic::AtomicBool;

use super::phases::reads_as_phase;
use super::*;

impl<L: Layer> Distribute<L> {
    /// Moves each file with hard links among `entries` (brick `from`'s, with their
    /// directories) whose every name is there, stopping between two files once `stop` is set.
    pub(super) async fn move_hard_linked(
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
    /// ([`super::super::files`]).
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
    pub(in crate::distribute::layer) async fn point_link_files(
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
}
