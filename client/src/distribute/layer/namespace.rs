//! Namespace fops over the bricks: where a name is (its hashed brick, a link file to follow),
//! the link files renames and hard links leave, and MKDIR, RMDIR, UNLINK, RENAME, LINK and
//! the creates.

use kiln_admin::volume::BrickRole;

use super::*;

/// Link files a RENAME makes at most for its new name before it gives up (a rebalance may
/// make one there between its removal and its make).
const LINK_FILE_TRIES: usize = 3;

/// An entry found: where its name hashes, where it lives, and the LOOKUP's answer there.
#[derive(Debug)]
pub(super) struct Located {
    pub(super) hashed: usize,
    pub(super) home: usize,
    pub(super) reply: FopReply,
    pub(super) iatt: Iatt,
}

impl<L: Layer> Distribute<L> {
    /// The entry `name` in `parent`: its attributes and the brick holding it (following a
    /// link file), with `fop` (a LOOKUP or LOOKUP_XATTRS of it) answered there.
    pub(super) async fn locate(
        &self,
        creds: &Creds,
        parent: Gfid,
        name: &Name,
        fop: FopRequest,
    ) -> Result<Located, Error> {
        let (hashed, layout) = self.hashed(parent, name).await?;
        match self.bricks.get(hashed)?.call(creds, fop.clone()).await {
            Ok(reply) => {
                let iatt = entry_iatt(&reply)?.clone();
                let target = match self.link_file_target(hashed, &iatt).await {
                    // Removed since it was looked up.
                    Err(Error::Fop(ErrorCode::Stale)) => Err(Error::Fop(ErrorCode::NoEnt)),
                    target => target,
                };
                let Some(home) = target? else {
                    self.note_home(&iatt, hashed);
                    return Ok(Located {
                        hashed,
                        home: hashed,
                        reply,
                        iatt,
                    });
                };
                let link = (parent, name, iatt.gfid);
                self.follow_link_file(creds, link, hashed, home, fop).await
            }
            // Authoritative when every hash has a brick and the layout was committed
            // (GlusterFS's lookup-optimize): a volume's root, whose layout GlusterFS writes
            // uncommitted, may hold names a client in another locale hashed elsewhere.
            Err(Error::Fop(ErrorCode::NoEnt)) if authoritative(&layout) => {
                Err(Error::Fop(ErrorCode::NoEnt))
            }
            Err(Error::Fop(ErrorCode::NoEnt)) => {
                let found = self.locate_everywhere(creds, hashed, fop).await?;
                // Found off its hashed brick with no link file there (placed by an older
                // layout): one is made, so the next lookup, and a create of the name, find it
                // there (GlusterFS's lookup-everywhere does the same).
                if found.iatt.file_type != FileType::Directory
                    && let Err(e) = self
                        .make_link_file(hashed, parent, name, found.iatt.gfid, found.home)
                        .await
                {
                    tracing::debug!(%parent, brick = hashed, error = %e, "no link file made");
                }
                Ok(found)
            }
            Err(e) => Err(e),
        }
    }

    /// [`Distribute::locate`] of `name` in `parent` past its link file (of GFID `link`) on
    /// brick `hashed`, which points to brick `home`. A stale one — its brick removed, or the
    /// name not (or only as a link file) there — means the file moved on (a file with hard
    /// links, between its move's switch and its link files' repointing; or a brick removed
    /// with its files): it is where no link file is, if anywhere, and the link file is
    /// pointed there (or, its brick removed and the name nowhere, removed).
    async fn follow_link_file(
        &self,
        creds: &Creds,
        (parent, name, link): (Gfid, &Name, Gfid),
        hashed: usize,
        home: usize,
        fop: FopRequest,
    ) -> Result<Located, Error> {
        let Some((reply, iatt)) = self.object_at(creds, home, fop.clone()).await? else {
            let found = self.locate_everywhere(creds, hashed, fop).await;
            match &found {
                Ok(found) if found.iatt.gfid == link => {
                    self.point_link_files(hashed, link, found.home).await?;
                }
                // (While the home brick serves, only when the object is gone from it: a hard
                // link makes its link file before the name it points to.)
                Err(Error::Fop(ErrorCode::NoEnt))
                    if self.bricks.role(home) == BrickRole::Removed
                        || self.is_gone_from(home, link).await? =>
                {
                    self.remove_link_file_of(hashed, parent, name, link).await?;
                }
                _ => {}
            }
            return found;
        };
        self.note_home(&iatt, home);
        Ok(Located {
            hashed,
            home,
            reply,
            iatt,
        })
    }

    /// `fop` (a LOOKUP of a name) answered by brick `home`, with the entry's attributes,
    /// when the entry there is the object itself; `None` when the brick was removed, or has
    /// the name not or only as a link file.
    async fn object_at(
        &self,
        creds: &Creds,
        home: usize,
        fop: FopRequest,
    ) -> Result<Option<(FopReply, Iatt)>, Error> {
        let gone = |e: &Error| matches!(e, Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale));
        if self.bricks.role(home) == BrickRole::Removed {
            return Ok(None);
        }
        let reply = match self.bricks.get(home)?.call(creds, fop).await {
            Ok(reply) => reply,
            Err(e) if gone(&e) => return Ok(None),
            Err(e) => return Err(e),
        };
        let iatt = entry_iatt(&reply)?.clone();
        match self.link_file_target(home, &iatt).await {
            Ok(None) => Ok(Some((reply, iatt))),
            Ok(Some(_)) => Ok(None),
            Err(e) if gone(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Whether `name` exists in `parent` where its hashed brick in `layout` cannot tell (a
    /// layout not committed: healed, or GlusterFS's root): found anywhere, and then given a
    /// link file on the hashed brick. A create must see it before it makes the name anew.
    pub(super) async fn exists_unseen(
        &self,
        creds: &Creds,
        parent: Gfid,
        name: &Name,
        layout: &Layout,
    ) -> Result<bool, Error> {
        if authoritative(layout) {
            return Ok(false);
        }
        match self.find(creds, parent, name).await {
            Ok(_) => Ok(true),
            Err(Error::Fop(ErrorCode::NoEnt)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// [`Distribute::locate`] of `name` in `parent` with a plain LOOKUP: what a namespace
    /// fop needs to know of the entry it changes.
    pub(super) async fn find(
        &self,
        creds: &Creds,
        parent: Gfid,
        name: &Name,
    ) -> Result<Located, Error> {
        let lookup = kiln_wire::Lookup {
            parent,
            name: name.clone(),
        };
        self.locate(creds, parent, name, lookup.into()).await
    }

    /// LOOKUP `fop` on every brick but `hashed`: the first that has the entry (not a link
    /// file).
    pub(super) async fn locate_everywhere(
        &self,
        creds: &Creds,
        hashed: usize,
        fop: FopRequest,
    ) -> Result<Located, Error> {
        for (i, brick) in self.bricks.in_service().filter(|(i, _)| *i != hashed) {
            match brick.call(creds, fop.clone()).await {
                Ok(reply) => {
                    let iatt = entry_iatt(&reply)?.clone();
                    if self.link_file_target(i, &iatt).await?.is_none() {
                        self.note_home(&iatt, i);
                        return Ok(Located {
                            hashed,
                            home: i,
                            reply,
                            iatt,
                        });
                    }
                }
                Err(Error::Fop(ErrorCode::NoEnt)) => {}
                Err(e) => return Err(e),
            }
        }
        Err(Error::Fop(ErrorCode::NoEnt))
    }

    /// The brick the link file `iatt` on brick `on` points to; `None` when it is no link
    /// file (GlusterFS's `check_is_linkfile`: a link file's mode, and its `linkto` xattr — a
    /// file of mode 01000 without it is a file like any other).
    pub(super) async fn link_file_target(
        &self,
        on: usize,
        iatt: &Iatt,
    ) -> Result<Option<usize>, Error> {
        if !looks_like_link_file(iatt) {
            return Ok(None);
        }
        self.linkto(on, iatt.gfid).await
    }

    /// The brick the `linkto` xattr of object `gfid` on brick `on` names; `None` without one.
    pub(super) async fn linkto(&self, on: usize, gfid: Gfid) -> Result<Option<usize>, Error> {
        let get = kiln_wire::Getxattr {
            gfid,
            name: xattr_name(LINKTO_XATTR),
        };
        let read = self.bricks.get(on)?.call(&Creds::root(), get.into()).await;
        self.linkto_read(read).await
    }

    /// The brick a read of a `linkto` xattr (GETXATTR or FGETXATTR) names; `None` without one.
    pub(super) async fn linkto_read(
        &self,
        read: Result<FopReply, Error>,
    ) -> Result<Option<usize>, Error> {
        match read {
            Ok(FopReply::Getxattr(r) | FopReply::Fgetxattr(r)) => {
                self.brick_of_link(r.value.as_bytes()).await.map(Some)
            }
            Ok(other) => Err(unexpected(&other)),
            Err(Error::Fop(ErrorCode::NoData)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The brick a link file's `linkto` value names, asking for bricks added to the volume
    /// when it names none this layer knows.
    pub(super) async fn brick_of_link(&self, value: &[u8]) -> Result<usize, Error> {
        if let Some(brick) = self.brick_named(value) {
            return Ok(brick);
        }
        self.refresh_bricks().await;
        self.brick_named(value).ok_or_else(|| {
            Error::Protocol(format!(
                "a link file points to unknown brick {}",
                value.escape_ascii()
            ))
        })
    }

    /// The index of the brick a link file names (`VOLUME-client-N`, maybe NUL-ended).
    pub(super) fn brick_named(&self, name: &[u8]) -> Option<usize> {
        let name = name.strip_suffix(b"\0").unwrap_or(name);
        let (_, n) = std::str::from_utf8(name).ok()?.rsplit_once("-client-")?;
        n.parse().ok().filter(|&n| n < self.bricks.len())
    }

    /// What a link file to brick `brick` says.
    pub(super) fn link_value(&self, brick: usize) -> XattrValue {
        let name = format!("{}-client-{brick}\0", self.volume);
        XattrValue::new(Bytes::from(name.into_bytes()))
            .unwrap_or_else(|_| unreachable!("a volume name is at most 64 bytes"))
    }

    /// Makes a link file `name` in `parent` on brick `on`, pointing to brick `home` where
    /// object `gfid` lives.
    pub(super) async fn make_link_file(
        &self,
        on: usize,
        parent: Gfid,
        name: &Name,
        gfid: Gfid,
        home: usize,
    ) -> Result<(), Error> {
        let root = Creds::root();
        // Another name of the object has a link file there already: one more name for it
        // (a GFID is one object per brick).
        if let Ok(iatt) = self.bricks.get(on)?.stat(&root, gfid).await
            && let Ok(Some(_)) = self.link_file_target(on, &iatt).await
        {
            let link = kiln_wire::Link {
                gfid,
                new_parent: parent,
                new_name: name.clone(),
            };
            return self
                .bricks
                .get(on)?
                .call(&root, link.into())
                .await
                .map(drop);
        }
        let mknod = kiln_wire::Mknod {
            parent,
            name: name.clone(),
            gfid,
            node_type: NodeType::Regular,
            mode: Mode::new(LINK_FILE_MODE).unwrap_or(Mode::from_st_mode(0)),
            umask: Mode::from_st_mode(0),
            rdev: 0,
        };
        self.bricks.get(on)?.call(&root, mknod.into()).await?;
        self.set_linkto(on, gfid, home, XattrSetMode::Create).await
    }

    /// Points the link file of object `gfid` on brick `on` at brick `home`.
    async fn set_linkto(
        &self,
        on: usize,
        gfid: Gfid,
        home: usize,
        mode: XattrSetMode,
    ) -> Result<(), Error> {
        let set = kiln_wire::Setxattr {
            gfid,
            name: xattr_name(LINKTO_XATTR),
            value: self.link_value(home),
            mode,
        };
        let root = Creds::root();
        self.bricks.get(on)?.call(&root, set.into()).await.map(drop)
    }

    /// Makes `name` in `parent` on brick `on` a link file to object `gfid` on brick `home`,
    /// replacing the link file there. A rebalance moving a file under that name may make one
    /// of its own in between: one of `gfid` is pointed `home`, one of another object removed
    /// and the make tried again, at most [`LINK_FILE_TRIES`] times; a real file is EEXIST.
    async fn replace_link_file(
        &self,
        on: usize,
        parent: Gfid,
        name: &Name,
        gfid: Gfid,
        home: usize,
    ) -> Result<(), Error> {
        let root = Creds::root();
        self.remove_link_file(on, parent, name).await?;
        for _ in 0..LINK_FILE_TRIES {
            match self.make_link_file(on, parent, name, gfid, home).await {
                Err(Error::Fop(ErrorCode::Exist)) => {}
                made => return made,
            }
            let there = match self.bricks.get(on)?.lookup(&root, parent, name).await {
                Ok(there) => there,
                Err(Error::Fop(ErrorCode::NoEnt)) => continue,
                Err(e) => return Err(e),
            };
            if !looks_like_link_file(&there) {
                return Err(Error::Fop(ErrorCode::Exist));
            }
            if there.gfid == gfid {
                return self.set_linkto(on, gfid, home, XattrSetMode::Upsert).await;
            }
            self.remove_link_file_of(on, parent, name, there.gfid)
                .await?;
        }
        Err(Error::Fop(ErrorCode::Exist))
    }

    /// Removes the link file `name` in `parent` on brick `on`; one already gone is fine.
    pub(super) async fn remove_link_file(
        &self,
        on: usize,
        parent: Gfid,
        name: &Name,
    ) -> Result<(), Error> {
        let unlink = kiln_wire::Unlink {
            parent,
            name: name.clone(),
        };
        match self
            .bricks
            .get(on)?
            .call(&Creds::root(), unlink.into())
            .await
        {
            Ok(_) | Err(Error::Fop(ErrorCode::NoEnt)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// [`Distribute::remove_link_file`] of `name` in `parent` on brick `on` if it is still a
    /// link file of object `gfid` (another client may have made the name anew since).
    pub(super) async fn remove_link_file_of(
        &self,
        on: usize,
        parent: Gfid,
        name: &Name,
        gfid: Gfid,
    ) -> Result<(), Error> {
        let link_file = |t: &Iatt| t.gfid == gfid && looks_like_link_file(t);
        self.remove_if_still(on, parent, name, link_file).await
    }

    /// [`Distribute::remove_link_file`] of `name` in `parent` on brick `on` if what it names
    /// is `still` what the caller found there (another client may have made it anew since).
    pub(super) async fn remove_if_still(
        &self,
        on: usize,
        parent: Gfid,
        name: &Name,
        still: impl FnOnce(&Iatt) -> bool,
    ) -> Result<(), Error> {
        match self
            .bricks
            .get(on)?
            .lookup(&Creds::root(), parent, name)
            .await
        {
            Ok(there) if still(&there) => self.remove_link_file(on, parent, name).await,
            Ok(_) | Err(Error::Fop(ErrorCode::NoEnt)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Whether object `gfid` is gone from brick `home` altogether. A link file pointing to
    /// an object gone from its brick is stale — left by a rebalance's move that raced an
    /// unlink, or by a crash — and holds its name for nothing.
    pub(super) async fn is_gone_from(&self, home: usize, gfid: Gfid) -> Result<bool, Error> {
        match self.bricks.get(home)?.stat(&Creds::root(), gfid).await {
            Ok(_) => Ok(false),
            Err(Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale)) => Ok(true),
            Err(e) => Err(e),
        }
    }

    /// Whether `iatt`, an entry on brick `on`, is a stale link file: a link file whose object
    /// is gone from the brick it points to ([`Distribute::is_gone_from`]).
    pub(super) async fn is_stale_link_file(&self, on: usize, iatt: &Iatt) -> Result<bool, Error> {
        match self.link_file_target(on, iatt).await? {
            Some(home) => self.is_gone_from(home, iatt.gfid).await,
            None => Ok(false),
        }
    }

    /// After a make of `name` in `parent` on its hashed brick failed with EEXIST: removes a
    /// stale link file that held the name, and says whether the make may be tried again.
    pub(super) async fn cleared_stale_link_file(
        &self,
        hashed: usize,
        parent: Gfid,
        name: &Name,
    ) -> Result<bool, Error> {
        let there = match self
            .bricks
            .get(hashed)?
            .lookup(&Creds::root(), parent, name)
            .await
        {
            Ok(there) => there,
            // Removed meanwhile.
            Err(Error::Fop(ErrorCode::NoEnt)) => return Ok(true),
            Err(e) => return Err(e),
        };
        if !self.is_stale_link_file(hashed, &there).await? {
            return Ok(false);
        }
        tracing::info!(brick = hashed, %parent, %name, "a stale link file removed");
        self.remove_link_file_of(hashed, parent, name, there.gfid)
            .await?;
        Ok(true)
    }

    /// After brick `on` refused to remove its copy of directory `dir` (ENOTEMPTY): when every
    /// entry left there is a stale link file — which a listing never shows —, removes them
    /// and says the RMDIR may be tried again. Anything else in the copy leaves it all as it
    /// is.
    async fn cleared_only_stale_link_files(&self, on: usize, dir: Gfid) -> Result<bool, Error> {
        let entries = self.bricks.get(on)?.read_dir(&Creds::root(), dir).await?;
        for entry in &entries {
            if !self.is_stale_link_file(on, &entry.iatt).await? {
                return Ok(false);
            }
        }
        for entry in &entries {
            tracing::info!(brick = on, %dir, name = %entry.name, "a stale link file removed");
            self.remove_link_file_of(on, dir, &entry.name, entry.iatt.gfid)
                .await?;
        }
        Ok(!entries.is_empty())
    }

    /// Runs `make` (a make of `name` in `parent` on its hashed brick `hashed`), and once more
    /// when a stale link file held the name and was removed.
    pub(super) async fn making<T, F: Future<Output = Result<T, Error>>>(
        &self,
        hashed: usize,
        parent: Gfid,
        name: &Name,
        make: impl Fn() -> F,
    ) -> Result<T, Error> {
        match make().await {
            Err(Error::Fop(ErrorCode::Exist))
                if self.cleared_stale_link_file(hashed, parent, name).await? =>
            {
                make().await
            }
            made => made,
        }
    }

    /// [`Distribute::remove_link_file`] of a link file whose name is gone from the brick it
    /// pointed to: one left behind (the brick failed) is only logged — a lookup following it
    /// finds nothing there, but it keeps its directory from being removed.
    pub(super) async fn remove_stale_link_file(&self, on: usize, parent: Gfid, name: &Name) {
        if let Err(e) = self.remove_link_file(on, parent, name).await {
            tracing::warn!(brick = on, %parent, %name, error = %e, "a stale link file stays");
        }
    }

    /// A new name made on its hashed brick (MKNOD, SYMLINK, PUT).
    pub(super) async fn make_file(
        &self,
        creds: &Creds,
        parent: Gfid,
        name: &Name,
        fop: FopRequest,
    ) -> Result<FopReply, Error> {
        let (hashed, layout) = self.hashed(parent, name).await?;
        if self.exists_unseen(creds, parent, name, &layout).await? {
            return Err(Error::Fop(ErrorCode::Exist));
        }
        let brick = self.bricks.get(hashed)?;
        let make = || brick.call(creds, fop.clone());
        let reply = self.making(hashed, parent, name, make).await?;
        self.note_home(entry_iatt(&reply)?, hashed);
        Ok(reply)
    }

    pub(super) async fn mkdir(
        &self,
        creds: &Creds,
        r: kiln_wire::Mkdir,
    ) -> Result<FopReply, Error> {
        let (hashed, layout) = self.hashed(r.parent, &r.name).await?;
        if self
            .exists_unseen(creds, r.parent, &r.name, &layout)
            .await?
        {
            return Err(Error::Fop(ErrorCode::Exist));
        }
        let on_hashed = self.bricks.get(hashed)?;
        let make = || on_hashed.call(creds, r.clone().into());
        let reply = self.making(hashed, r.parent, &r.name, make).await?;
        let others = self.bricks.in_service().filter(|(i, _)| *i != hashed);
        let copies = others.map(|(i, brick)| {
            let r = r.clone();
            async move {
                // The layout leaves the brick out, so that no name is put where the
                // directory is not; the next lookup of the directory makes the missing copy
                // (and gives it its share), as GlusterFS's self-heal does.
                let e = brick.call(creds, r.into()).await.err()?;
                tracing::warn!(brick = i, error = %e, "mkdir did not reach every brick");
                Some(i)
            }
        });
        let lacking: Vec<usize> = futures_util::future::join_all(copies)
            .await
            .into_iter()
            .flatten()
            .collect();
        self.write_new_layout(r.gfid, &lacking).await?;
        lock(&self.homes).put(r.gfid, Home::Everywhere);
        Ok(reply)
    }

    /// RMDIR of the directory `name` in `parent` ([`Distribute::remove_dir`]).
    pub(super) async fn rmdir(
        &self,
        creds: &Creds,
        r: kiln_wire::Rmdir,
    ) -> Result<FopReply, Error> {
        let found = self.find(creds, r.parent, &r.name).await?;
        if found.iatt.file_type != FileType::Directory {
            return Err(Error::Fop(ErrorCode::NotDir));
        }
        self.remove_dir(creds, &r, found.hashed, &found.iatt).await
    }

    /// RMDIR `r` of directory `dir`, found on its name's hashed brick `hashed`: the copies on
    /// the other bricks first, all at once, the hashed brick's last (so a lookup finds the
    /// directory until it is gone); when a brick still has entries — other than stale link
    /// files, which go ([`Distribute::cleared_only_stale_link_files`]) — the copies removed
    /// are put back (same GFID, mode and layout) and the answer is ENOTEMPTY.
    pub(super) async fn remove_dir(
        &self,
        creds: &Creds,
        r: &kiln_wire::Rmdir,
        hashed: usize,
        dir: &Iatt,
    ) -> Result<FopReply, Error> {
        let others = (self.bricks.in_service().map(|(i, _)| i)).filter(|&i| i != hashed);
        let removals = futures_util::future::join_all(
            others.map(|i| async move { (i, self.remove_dir_copy(creds, r, i, dir.gfid).await) }),
        )
        .await;
        let (mut removed, mut failed) = (Vec::new(), None);
        for (i, removal) in removals {
            match removal {
                Ok(_) => removed.push(i),
                Err(Error::Fop(ErrorCode::NoEnt)) => {}
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        let last = match failed {
            Some(e) => Err(e),
            None => self.remove_dir_copy(creds, r, hashed, dir.gfid).await,
        };
        match last {
            Ok(reply) => {
                self.forget_layout(dir.gfid);
                lock(&self.homes).pop(&dir.gfid);
                Ok(reply)
            }
            Err(e) => {
                self.put_back_dir(r, dir, &removed).await;
                Err(e)
            }
        }
    }

    /// RMDIR `r` of directory `dir`'s copy on brick `on`, again once stale link files alone
    /// kept it.
    async fn remove_dir_copy(
        &self,
        creds: &Creds,
        r: &kiln_wire::Rmdir,
        on: usize,
        dir: Gfid,
    ) -> Result<FopReply, Error> {
        let brick = self.bricks.get(on)?;
        match brick.call(creds, r.clone().into()).await {
            Err(Error::Fop(ErrorCode::NotEmpty))
                if self.cleared_only_stale_link_files(on, dir).await? =>
            {
                brick.call(creds, r.clone().into()).await
            }
            removal => removal,
        }
    }

    /// Makes the removed copies of directory `iatt` (`r.name` in `r.parent`) again on
    /// `bricks`, with its layout.
    pub(super) async fn put_back_dir(&self, r: &kiln_wire::Rmdir, iatt: &Iatt, bricks: &[usize]) {
        let layout = self.cached_layout(iatt.gfid).map(|(layout, _)| layout);
        for &i in bricks {
            let mut made = self.make_dir_copy(i, r.parent, &r.name, iatt).await;
            if let (Ok(()), Some(disk)) = (&made, layout.as_ref().and_then(|l| l.disk_layout(i))) {
                made = self.set_disk_layout(i, iatt.gfid, disk).await;
            }
            if let Err(e) = made {
                tracing::warn!(brick = i, error = %e, "a directory copy removed by a failed rmdir could not be put back");
            }
        }
    }

    /// UNLINK on the brick holding the entry, and its link file on the hashed brick: where
    /// the parent's layout is authoritative, first as UNLINK_SETTLED on the hashed brick,
    /// which removes a file that lives there in one round trip.
    pub(super) async fn unlink(
        &self,
        creds: &Creds,
        r: kiln_wire::Unlink,
    ) -> Result<FopReply, Error> {
        if let Some(hashed) = self.settled_brick(r.parent, &r.name).await
            && self.takes_unlink_settled(hashed)
        {
            let (parent, name) = (r.parent, r.name.clone());
            let settled = kiln_wire::UnlinkSettled { parent, name };
            match self.bricks.get(hashed)?.call(creds, settled.into()).await {
                // A link file or a file being moved: found and followed below.
                Err(Error::Fop(ErrorCode::CrossDevice)) => {}
                answer => return answer.map(as_unlink),
            }
        }
        let found = self.find_settled(creds, r.parent, &r.name).await?;
        self.unlink_located(creds, r.parent, &r.name, &found).await
    }

    /// UNLINK of the entry `found` (`name` in `parent`) where it lives, then of its link
    /// file.
    pub(super) async fn unlink_located(
        &self,
        creds: &Creds,
        parent: Gfid,
        name: &Name,
        found: &Located,
    ) -> Result<FopReply, Error> {
        let unlink = kiln_wire::Unlink {
            parent,
            name: name.clone(),
        };
        let reply = self
            .bricks
            .get(found.home)?
            .call(creds, unlink.into())
            .await?;
        if found.home != found.hashed {
            self.remove_stale_link_file(found.hashed, parent, name)
                .await;
        }
        if found.iatt.nlink <= 1 {
            lock(&self.homes).pop(&found.iatt.gfid);
        }
        Ok(reply)
    }

    /// RENAME. A directory is renamed on every brick; a file on the brick that holds it (its
    /// data never moves) first, and then the other bricks are put right: a target living on
    /// another brick removed there, a link file on the new name's hashed brick when that is
    /// another one, the old name's link file removed. Nothing is changed before the rename
    /// itself succeeds; a failure after it is returned (the rename happened). An EXCHANGE
    /// that would need link files is refused with EXDEV.
    pub(super) async fn rename(
        &self,
        creds: &Creds,
        r: kiln_wire::Rename,
    ) -> Result<FopReply, Error> {
        let source = self.find_settled(creds, r.old_parent, &r.old_name).await?;
        if source.iatt.file_type == FileType::Directory {
            return self.rename_dir(creds, r).await;
        }
        let (new_hashed, _) = self.hashed(r.new_parent, &r.new_name).await?;
        let target = match self.find_settled(creds, r.new_parent, &r.new_name).await {
            Ok(target) => Some(target),
            Err(Error::Fop(ErrorCode::NoEnt)) => None,
            Err(e) => return Err(e),
        };
        let home = source.home;
        if let Some(target) = &target {
            if target.iatt.gfid == source.iatt.gfid {
                // Two names of one file: nothing moves.
                return self.bricks.get(home)?.call(creds, r.into()).await;
            }
            if r.mode == RenameMode::NoReplace {
                return Err(Error::Fop(ErrorCode::Exist));
            }
            if target.home != home && target.iatt.file_type == FileType::Directory {
                return Err(Error::Fop(ErrorCode::IsDir));
            }
        }
        let one_brick = source.hashed == home
            && new_hashed == home
            && target
                .as_ref()
                .is_none_or(|t| t.home == home && t.hashed == home);
        if r.mode == RenameMode::Exchange && !one_brick {
            return Err(Error::Fop(ErrorCode::CrossDevice));
        }
        let reply = self.bricks.get(home)?.call(creds, r.clone().into()).await?;
        if let Some(target) = target.filter(|t| t.home != home) {
            let unlink = kiln_wire::Unlink {
                parent: r.new_parent,
                name: r.new_name.clone(),
            };
            self.bricks
                .get(target.home)?
                .call(creds, unlink.into())
                .await?;
        }
        if new_hashed != home {
            let (parent, name) = (r.new_parent, &r.new_name);
            self.replace_link_file(new_hashed, parent, name, source.iatt.gfid, home)
                .await?;
        }
        if source.hashed != home {
            self.remove_stale_link_file(source.hashed, r.old_parent, &r.old_name)
                .await;
        }
        Ok(reply)
    }

    /// A directory renamed on every brick, the new name's hashed brick first. A directory
    /// it would replace must be empty on every brick (each brick only sees its own copy).
    pub(super) async fn rename_dir(
        &self,
        creds: &Creds,
        r: kiln_wire::Rename,
    ) -> Result<FopReply, Error> {
        let (hashed, _) = self.hashed(r.new_parent, &r.new_name).await?;
        match self.find(creds, r.new_parent, &r.new_name).await {
            // Emptiness is the bricks' to see, not the caller's (rename needs no read
            // permission on the directory it replaces); an exchange replaces nothing.
            Ok(target)
                if target.iatt.file_type == FileType::Directory
                    && r.mode != RenameMode::Exchange =>
            {
                if !self
                    .read_dir(&Creds::root(), target.iatt.gfid)
                    .await?
                    .is_empty()
                {
                    return Err(Error::Fop(ErrorCode::NotEmpty));
                }
            }
            Ok(_) | Err(Error::Fop(ErrorCode::NoEnt)) => {}
            Err(e) => return Err(e),
        }
        let reply = self
            .bricks
            .get(hashed)?
            .call(creds, r.clone().into())
            .await?;
        let mut renamed = vec![hashed];
        for (i, brick) in self.bricks.in_service().filter(|(i, _)| *i != hashed) {
            match brick.call(creds, r.clone().into()).await {
                Ok(_) => renamed.push(i),
                Err(Error::Fop(ErrorCode::NoEnt)) => {}
                Err(e) => {
                    // One name per directory on every brick: the copies renamed go back.
                    self.rename_back(&r, &renamed).await;
                    return Err(e);
                }
            }
        }
        Ok(reply)
    }

    /// Undoes rename `r` of a directory on `bricks` (a rename that failed on another).
    async fn rename_back(&self, r: &kiln_wire::Rename, bricks: &[usize]) {
        let back = kiln_wire::Rename {
            old_parent: r.new_parent,
            old_name: r.new_name.clone(),
            new_parent: r.old_parent,
            new_name: r.old_name.clone(),
            mode: RenameMode::NoReplace,
        };
        for &brick in bricks {
            let back = async {
                self.bricks
                    .get(brick)?
                    .call(&Creds::root(), back.clone().into())
                    .await
            };
            if let Err(e) = back.await {
                tracing::warn!(brick, error = %e, "a directory keeps its new name on one brick");
            }
        }
    }

    /// LINK on the brick holding the object, with a link file on the new name's hashed
    /// brick (made first) when that is another one.
    pub(super) async fn link(&self, creds: &Creds, r: kiln_wire::Link) -> Result<FopReply, Error> {
        let Some(home) = self.home_settled(creds, r.gfid).await? else {
            return Err(Error::Fop(ErrorCode::Perm));
        };
        let (hashed, _) = self.hashed(r.new_parent, &r.new_name).await?;
        if hashed == home {
            return self.bricks.get(home)?.call(creds, r.into()).await;
        }
        self.make_link_file(hashed, r.new_parent, &r.new_name, r.gfid, home)
            .await?;
        let linked = self.bricks.get(home)?.call(creds, r.clone().into()).await;
        if linked.is_err() {
            let _ = self
                .remove_link_file(hashed, r.new_parent, &r.new_name)
                .await;
        }
        linked
    }

    /// The brick `name` in directory `parent` hashes to, where the parent's layout is
    /// authoritative: a name not there is nowhere, one there lives there unless it is a link
    /// file or being moved.
    pub(super) async fn settled_brick(&self, parent: Gfid, name: &Name) -> Option<usize> {
        let (hashed, layout) = self.hashed(parent, name).await.ok()?;
        authoritative(&layout).then_some(hashed)
    }

    /// Whether brick `i` takes UNLINK_SETTLED.
    pub(super) fn takes_unlink_settled(&self, i: usize) -> bool {
        self.bricks.get(i).is_ok_and(|brick| brick.unlink_settled())
    }
}

/// An UNLINK_SETTLED reply as the UNLINK's it answers.
pub(super) fn as_unlink(reply: FopReply) -> FopReply {
    match reply {
        FopReply::UnlinkSettled(r) => FopReply::Unlink(r),
        other => other,
    }
}

/// Whether a miss on a name's hashed brick in `layout` means the name does not exist: every
/// hash has a brick and the layout was committed (GlusterFS's lookup-optimize).
pub(super) fn authoritative(layout: &Layout) -> bool {
    layout.check().is_ok() && layout.commit_hash() != COMMIT_HASH_INVALID
}
