//! Layouts written, and directories healed: copies a brick lacks made again, layouts with
//! holes or overlaps (or leaving a brick out) rebuilt over every brick, a directory's times
//! merged from its copies, and the walk `kiln volume heal` runs.

use kiln_admin::volume::BrickRole;

use super::*;

/// What [`Distribute::heal_tree`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealReport {
    /// Directories walked.
    pub dirs: u64,
    /// Directory copies made on bricks that lacked them.
    pub copies_made: u64,
    /// Layouts rebuilt over every brick.
    pub layouts_healed: u64,
    /// Directories that could not be listed or healed, and directory copies that could
    /// not be made (each logged); the walk goes on.
    pub failed: u64,
}

/// What the directory self-heal did, counted.
#[derive(Debug, Default)]
pub(super) struct Healed {
    dirs: AtomicU64,
    layouts: AtomicU64,
    /// Directory copies that could not be made.
    dirs_failed: AtomicU64,
}

impl<L: Layer> Distribute<L> {
    /// Gives directory `dir` a new layout over every serving brick (by the roles a mount
    /// learns every [`BRICKS_REFRESH`]) but those `lacking` a copy of it, equal shares; the
    /// layout kept.
    pub(super) async fn write_new_layout(
        &self,
        dir: Gfid,
        lacking: &[usize],
    ) -> Result<Arc<Layout>, Error> {
        let mut weights = self.bricks.weights();
        for &brick in lacking {
            weights[brick] = 0;
        }
        let first = first_brick(dir.to_string().as_bytes(), weights.len())
            .map_err(|e| layout_error(dir, &e))?;
        let layout = Layout::new_directory(&weights, first, COMMIT_HASH_COMMITTED)
            .map_err(|e| layout_error(dir, &e))?;
        self.store_layout(dir, layout).await
    }

    /// Writes `layout` of directory `dir` to every brick's copy, all at once, and keeps it.
    pub(super) async fn store_layout(
        &self,
        dir: Gfid,
        layout: Layout,
    ) -> Result<Arc<Layout>, Error> {
        let generation = self.bricks.generation();
        let shares = self.bricks.in_service().filter_map(|(brick, _)| {
            let disk = layout.disk_layout(brick)?;
            Some(async move {
                match self.set_disk_layout(brick, dir, disk).await {
                    // No copy there (a MKDIR that did not reach it): the next lookup makes it
                    // and writes its share.
                    Err(Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale)) => Ok(()),
                    written => written,
                }
            })
        });
        futures_util::future::try_join_all(shares).await?;
        let layout = Arc::new(layout);
        self.keep_layout(dir, layout.clone(), generation);
        Ok(layout)
    }

    /// Replaces the layout of directory `dir`, which overlaps, leaves a serving brick out or
    /// gives a leaving one a share, by one over every serving brick that keeps as many hashes
    /// where they are as it can. It is written uncommitted: names placed by the old one are
    /// still found (a miss on the hashed brick asks every brick) until a rebalance moves them.
    pub(super) async fn heal_layout(&self, dir: Gfid, old: &Layout) -> Result<(), Error> {
        let weights = self.bricks.weights();
        let healed = old
            .rebalanced(&weights)
            .map_err(|e| layout_error(dir, &e))?
            .with_commit_hash(COMMIT_HASH_INVALID);
        self.store_layout(dir, healed).await?;
        self.healed.layouts.fetch_add(1, Ordering::Relaxed);
        tracing::info!(%dir, "healed a directory's layout");
        Ok(())
    }

    pub(super) async fn set_disk_layout(
        &self,
        brick: usize,
        dir: Gfid,
        disk: DiskLayout,
    ) -> Result<(), Error> {
        let set = kiln_wire::Setxattr {
            gfid: dir,
            name: xattr_name(XATTR_NAME),
            value: XattrValue::new(Bytes::copy_from_slice(&disk.encode()))
                .map_err(|e| Error::Protocol(e.to_string()))?,
            mode: XattrSetMode::Upsert,
        };
        self.bricks
            .get(brick)?
            .call(&Creds::root(), set.into())
            .await
            .map(drop)
    }

    /// A directory's attributes as one: a STAT's (from brick `from`) with the latest times of
    /// every copy, so that a change on any brick shows in the directory's mtime and ctime
    /// (GlusterFS's `dht_iatt_merge`; a LOOKUP's are merged by [`Distribute::looked_up`]).
    /// Any other reply is returned as it is.
    pub(super) async fn merged_dir(
        &self,
        creds: &Creds,
        mut reply: FopReply,
        from: usize,
    ) -> Result<FopReply, Error> {
        if let FopReply::Stat(r) = &mut reply
            && r.iatt.file_type == FileType::Directory
        {
            self.merge_copies(creds, &mut r.iatt, from).await;
        }
        Ok(reply)
    }

    /// Merges the times of directory `iatt`'s copies on every brick but `from` into it; the
    /// bricks that have no copy.
    pub(super) async fn merge_copies(
        &self,
        creds: &Creds,
        iatt: &mut Iatt,
        from: usize,
    ) -> Vec<usize> {
        let gfid = iatt.gfid;
        let others = self.bricks.in_service().filter(|(i, _)| *i != from);
        let copies = futures_util::future::join_all(
            others.map(|(i, brick)| async move { (i, brick.stat(creds, gfid).await) }),
        )
        .await;
        let mut missing = Vec::new();
        for (i, copy) in copies {
            match copy {
                Ok(copy) => merge_times(iatt, &copy),
                Err(Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale)) => missing.push(i),
                // A brick out of reach has nothing to merge or heal now.
                Err(_) => {}
            }
        }
        missing
    }

    /// The answer to a LOOKUP that found `found` (`name` in `parent`); a directory is made
    /// whole first (GlusterFS's directory self-heal): its copies missing on some brick are
    /// made again (same GFID, mode and owner), a layout with holes or overlaps, or one that
    /// leaves a brick out, is rebuilt over every brick, and its times are merged from
    /// every copy.
    pub(super) async fn looked_up(
        &self,
        creds: &Creds,
        parent: Gfid,
        name: &Name,
        found: Located,
    ) -> Result<FopReply, Error> {
        let mut reply = found.reply;
        if found.iatt.file_type != FileType::Directory {
            return Ok(reply);
        }
        let iatt = match &mut reply {
            FopReply::Lookup(r) => &mut r.iatt,
            FopReply::LookupXattrs(r) => &mut r.iatt,
            other => return Err(unexpected(other)),
        };
        let missing = self.merge_copies(creds, iatt, found.home).await;
        let mut lacking = false;
        for &brick in &missing {
            let dir = found.iatt.gfid;
            match self.make_dir_copy(brick, parent, name, &found.iatt).await {
                Ok(()) => {
                    self.healed.dirs.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(%dir, brick, "made a directory's missing copy");
                }
                // The directory is still served from the copies there are (a brick out of
                // space or inodes cannot take one), and its layout is left as it is: a brick
                // without a copy gets no share until a later lookup makes the copy.
                Err(e) => {
                    lacking = true;
                    self.healed.dirs_failed.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(%dir, brick, error = %e, "a directory's missing copy could not be made");
                }
            }
        }
        let layout = self.layout(found.iatt.gfid).await?;
        if !lacking && self.needs_heal(&layout).await {
            self.heal_layout(found.iatt.gfid, &layout).await?;
        }
        Ok(reply)
    }

    /// Makes the copy of directory `iatt` (`name` in `parent`) on brick `brick`: same GFID,
    /// mode and owner.
    pub(super) async fn make_dir_copy(
        &self,
        brick: usize,
        parent: Gfid,
        name: &Name,
        iatt: &Iatt,
    ) -> Result<(), Error> {
        let root = Creds::root();
        let mkdir = kiln_wire::Mkdir {
            parent,
            name: name.clone(),
            gfid: iatt.gfid,
            mode: iatt.mode,
            umask: Mode::from_st_mode(0),
        };
        match self.bricks.get(brick)?.call(&root, mkdir.into()).await {
            Ok(_) | Err(Error::Fop(ErrorCode::Exist)) => {}
            Err(e) => return Err(e),
        }
        let owner = kiln_wire::Setattr {
            gfid: iatt.gfid,
            attr: kiln_wire::SetAttr {
                uid: Some(iatt.uid),
                gid: Some(iatt.gid),
                ..kiln_wire::SetAttr::default()
            },
        };
        self.bricks
            .get(brick)?
            .call(&root, owner.into())
            .await
            .map(drop)
    }

    /// Walks the whole tree, looking up every directory, so each is healed (see
    /// [`Layer::call`] of LOOKUP): what `kiln volume heal` runs.
    pub async fn heal_tree(&self, creds: &Creds) -> Result<HealReport, Error> {
        let stop = std::sync::atomic::AtomicBool::new(false);
        self.heal_tree_reporting(creds, &stop, &mut |_| {}).await
    }

    /// [`Distribute::heal_tree`], reporting before each directory; stops between two
    /// directories once `stop` is set.
    pub async fn heal_tree_reporting(
        &self,
        creds: &Creds,
        stop: &std::sync::atomic::AtomicBool,
        progress: &mut (dyn FnMut(&HealReport) + Send),
    ) -> Result<HealReport, Error> {
        let before = self.healed();
        let copies_failed = || self.healed.dirs_failed.load(Ordering::Relaxed);
        let failed_before = copies_failed();
        let report = |dirs, failed| {
            let after = self.healed();
            HealReport {
                dirs,
                copies_made: after.0 - before.0,
                layouts_healed: after.1 - before.1,
                failed: failed + copies_failed() - failed_before,
            }
        };
        let root = self.layout(Gfid::ROOT).await?;
        if self.needs_heal(&root).await {
            self.heal_layout(Gfid::ROOT, &root).await?;
        }
        let (mut pending, mut dirs, mut failed) = (vec![Gfid::ROOT], 0, 0);
        while let Some(dir) = pending.pop() {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            progress(&report(dirs, failed));
            dirs += 1;
            let entries = match self.read_dir(creds, dir).await {
                Ok(entries) => entries,
                Err(e) => {
                    tracing::warn!(%dir, error = %e, "heal: a directory could not be listed");
                    failed += 1;
                    continue;
                }
            };
            for entry in entries {
                if entry.iatt.file_type != FileType::Directory {
                    continue;
                }
                let lookup = kiln_wire::Lookup {
                    parent: dir,
                    name: entry.name,
                };
                match self.call(creds, lookup.into()).await {
                    Ok(_) => pending.push(entry.iatt.gfid),
                    Err(e) => {
                        tracing::warn!(%dir, error = %e, "heal: a directory could not be healed");
                        failed += 1;
                    }
                }
            }
        }
        Ok(report(dirs, failed))
    }

    /// Whether `layout` is to be rebuilt: a serving brick has no range in it, another brick
    /// has one, or ranges overlap — by the bricks' roles as the source says now (asked when
    /// the layout does not fit the ones this layer knew: another client may know better);
    /// not when the source has not answered lately.
    /// Holes between the ranges of every brick are left alone: a brick this layer does not
    /// know (added since it was made, as a mount older than an add-brick) may hold them, and
    /// rebuilding would take its share away — but by a layer that knows every brick (a
    /// rebalance's) once a brick was removed: the share of one removed with its files
    /// (`remove-brick … force`), kept on it alone, reads as a hole.
    async fn needs_heal(&self, layout: &Layout) -> bool {
        let holed = |layout: &Layout| {
            let removed = |b| self.bricks.role(b) == BrickRole::Removed;
            layout.anomalies().holes > 0
                && self.bricks.knows_all()
                && self.bricks.indexes().any(removed)
        };
        if self.fits(layout) && !holed(layout) {
            return false;
        }
        // Healed only by roles known to be current: a mount whose source does not answer
        // could give a leaving brick its share back.
        self.refresh_bricks().await;
        self.bricks.roles_current() && (!self.fits(layout) || holed(layout))
    }

    /// Whether `layout` gives a range to the serving bricks alone, without overlaps.
    fn fits(&self, layout: &Layout) -> bool {
        let fits = |b: usize| layout.range(b).is_some() == self.bricks.role(b).is_serving();
        self.bricks.indexes().all(fits) && layout.anomalies().overlaps == 0
    }

    /// How many directory copies and layouts this layer has healed.
    pub fn healed(&self) -> (u64, u64) {
        (
            self.healed.dirs.load(Ordering::Relaxed),
            self.healed.layouts.load(Ordering::Relaxed),
        )
    }
}

/// Keeps the latest of each time of `iatt` and `copy` (two copies of one directory).
pub(super) fn merge_times(iatt: &mut Iatt, copy: &Iatt) {
    iatt.atime = iatt.atime.max(copy.atime);
    iatt.mtime = iatt.mtime.max(copy.mtime);
    iatt.ctime = iatt.ctime.max(copy.ctime);
}
