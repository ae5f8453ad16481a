//! One file's move from brick to brick through its phases (destination, copying, copy until
//! equal, switch), and a symlink's or special file's off a leaving brick.

use kiln_admin::volume::BrickRole;

use super::super::files::{Look, STICKY};
use super::*;

impl<L: Layer> Distribute<L> {
    /// Moves file `iatt`, `name` in `dir`, from brick `from` to brick `to`.
    pub(super) async fn migrate_file(
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
        let copied = self.mark_and_copy(from, to, gfid, mode).await;
        if !matches!(copied, Ok(Some(_))) && self.is_gone_from(from, gfid).await? {
            // Unlinked since it was looked at: the destination made for it is a link file
            // to nothing now, which would hold the name.
            self.remove_link_file_of(to, dir, name, gfid).await?;
            return Ok(Outcome::Skipped("it was unlinked during its move"));
        }
        let Some(bytes) = copied? else {
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
    pub(super) async fn move_node(
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
    pub(super) async fn make_destination(
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
    pub(super) async fn mark_and_copy(
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

    /// Whether file `gfid` on brick `from` has exactly the names `names` still.
    pub(super) async fn still_named(
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

    /// Makes brick `to`'s copy of file `gfid` the file, and `from`'s a link file to it that
    /// is then removed (`name` in `dir`).
    pub(super) async fn switch_to(
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
        self.set_attr(to, gfid, unmarked(&now)).await?;
        self.remove_xattr(to, gfid, LINKTO_XATTR).await?;
        let link = kiln_wire::SetAttr {
            mode: Mode::new(LINK_FILE_MODE),
            ..kiln_wire::SetAttr::default()
        };
        let marked = self.change_attr(from, gfid, link).await?;
        // A client's chmod, chown or utimens that reached the source after `now` went nowhere
        // else: until this mark the file looked copied, not moved (`Distribute::keep_mark`).
        if unmarked(&marked) != unmarked(&now) {
            self.set_attr(to, gfid, unmarked(&marked)).await?;
        }
        self.note_home(&now, to);
        self.remove_if_still(from, dir, name, |t| t.gfid == gfid)
            .await
    }

    /// Puts file `gfid` back as it was before its move began: brick `from`'s copy unmarked,
    /// `to`'s an empty link file to it.
    pub(super) async fn abandon_move(
        &self,
        from: usize,
        to: usize,
        gfid: Gfid,
    ) -> Result<(), Error> {
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
}

/// Whether a file of mode `mode` would read as in a migration phase (the sticky bit, or no
/// permission bits: a link file's mode).
pub(super) fn reads_as_phase(mode: u32) -> bool {
    mode & STICKY != 0 || mode & 0o777 == 0
}

/// What gives a moved file's copy the mode (unmarked), owner and times of `now` (the
/// original's).
fn unmarked(now: &Iatt) -> kiln_wire::SetAttr {
    kiln_wire::SetAttr {
        mode: Mode::new(now.mode.bits() & !STICKY),
        ..owner_and_times(now)
    }
}

/// What gives an object's copy the owner and times of `now` (the original's).
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
