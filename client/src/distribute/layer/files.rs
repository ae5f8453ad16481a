//! Fops on files, following a file that a rebalance moves to another brick while it is in use
//! (the client's half of [`super::migrate`], as GlusterFS's DHT follows its migration phases).
//!
//! What the reply of a fop on a file shows of its mode says where the file is:
//!
//! * **Copying** — the sticky bit with other bits: the rebalancer is copying the file to the
//!   brick its `linkto` xattr names. A fop that changed its data (WRITE, FTRUNCATE, FALLOCATE,
//!   DISCARD, ZEROFILL, TRUNCATE, a SETATTR of the size) is sent again to that brick, so the
//!   copy misses nothing the rebalancer has already copied.
//! * **Moved** — mode `01000` exactly, a link file's: the data now lives on the brick the
//!   `linkto` xattr names. The fop is sent again there, and every later fop on the fd too.
//!
//! Each look is confirmed by the `linkto` xattr (a user's file may carry the sticky bit), so
//! only a file with the sticky bit pays a round trip more per fop. GlusterFS marks a copying
//! file with setgid and sticky; Kiln uses the sticky bit alone, as a brick's WRITE on behalf of
//! a user clears the setgid bit of a group-executable file.

use std::sync::atomic::AtomicBool;

use super::migrate::size_attr;
use super::*;

/// The sticky bit (`S_ISVTX`).
pub(super) const STICKY: u32 = 0o1000;
/// How long a rename, unlink or hard link of a file waits for a rebalance to finish moving
/// it before it fails with EBUSY.
const MOVE_WAIT: Duration = Duration::from_secs(60);
/// How often such a fop looks again whether the move has ended.
const MOVE_POLL: Duration = Duration::from_millis(20);

/// This layer's handle on an open file: the brick's fd, and the fd on the brick the file is
/// moving to once a reply showed a migration.
#[derive(Debug)]
pub struct FileFd<F> {
    gfid: Gfid,
    brick: usize,
    fd: F,
    access: AccessMode,
    flags: OpenFlags,
    /// The file's fd on the brick it is moving (or moved) to.
    dst: tokio::sync::OnceCell<(usize, F)>,
    /// The move is done: every fop goes to `dst`.
    moved: AtomicBool,
}

impl<F> FileFd<F> {
    pub(super) fn new(
        gfid: Gfid,
        brick: usize,
        fd: F,
        access: AccessMode,
        flags: OpenFlags,
    ) -> FileFd<F> {
        FileFd {
            gfid,
            brick,
            fd,
            access,
            flags,
            dst: tokio::sync::OnceCell::new(),
            moved: AtomicBool::new(false),
        }
    }

    /// The fds this handle holds, with their bricks, for their release.
    pub(super) fn into_fds(self) -> impl Iterator<Item = (usize, F)> {
        std::iter::once((self.brick, self.fd)).chain(self.dst.into_inner())
    }
}

/// Where a file is, by the mode a reply shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Look {
    Settled,
    Copying,
    Moved,
}

impl Look {
    pub(super) fn of(iatt: &Iatt) -> Look {
        if looks_like_link_file(iatt) {
            Look::Moved
        } else if iatt.file_type == FileType::Regular && iatt.mode.bits() & STICKY != 0 {
            Look::Copying
        } else {
            Look::Settled
        }
    }
}

impl<L: Layer> Distribute<L> {
    /// Runs `fop` on open file `file`, following its migration.
    pub(super) async fn call_file(
        &self,
        creds: &Creds,
        file: &FileFd<L::Fd>,
        fop: FdFop,
    ) -> Result<FopReply, Error> {
        // Its brick was removed, every file moved off it first.
        if !file.moved.load(Ordering::Acquire)
            && !self.bricks.role(file.brick).in_service()
            && !self.follow_home(file).await?
        {
            return Err(Error::Fop(ErrorCode::Io));
        }
        if let Some(moved) = self.call_moved(creds, file, &fop).await {
            return moved;
        }
        let reply = match self
            .bricks
            .get(file.brick)?
            .call_fd(creds, &file.fd, fop.clone())
            .await
        {
            Err(Error::Fop(code @ (ErrorCode::NoEnt | ErrorCode::Stale))) => {
                return self.call_gone(creds, file, &fop, code).await;
            }
            reply => reply?,
        };
        let Some((gfid, mut look)) = file_iatt(&reply).map(|iatt| (iatt.gfid, Look::of(iatt)))
        else {
            return Ok(reply);
        };
        match self.keep_mark(file.brick, &reply).await {
            Ok(before) => look = before.unwrap_or(look),
            // Moved away since: made again there. Nowhere else (unlinked): the reply stands.
            Err(Error::Fop(ErrorCode::Stale)) => {
                self.mark_moved_through(file).await;
                return match self.follow_home(file).await {
                    Ok(true) => self
                        .call_moved(creds, file, &fop)
                        .await
                        .unwrap_or(Ok(reply)),
                    _ => Ok(reply),
                };
            }
            Err(e) => return Err(e),
        }
        if look == Look::Settled || (look == Look::Copying && !changes_data(fop.request())) {
            return Ok(reply);
        }
        let Some(to) = self.moving_to_of(creds, file, gfid, look).await? else {
            return Ok(reply);
        };
        let (brick, fd) = match self.destination(file, to).await {
            Ok(opened) => opened,
            // The copy is gone: the rebalancer gave the move up, and its source is the file.
            Err(Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale)) if look == Look::Copying => {
                return Ok(reply);
            }
            Err(e) => return Err(e),
        };
        if look == Look::Moved {
            file.moved.store(true, Ordering::Release);
            tracing::debug!(from = file.brick, to, "an open file follows its migration");
            return self.bricks.get(*brick)?.call_fd(creds, fd, fop).await;
        }
        let mut change = fop;
        *change.request_mut() = data_part(change.request().clone());
        self.bricks
            .get(*brick)?
            .call_fd(&Creds::root(), fd, change)
            .await
            .map(|_| reply)
    }

    /// `fop` run again where open file `file` is now that its brick has it no more (a fop by
    /// its GFID there found nothing): a move that finished may have taken it, link file and
    /// all; `code` when it did not.
    async fn call_gone(
        &self,
        creds: &Creds,
        file: &FileFd<L::Fd>,
        fop: &FdFop,
        code: ErrorCode,
    ) -> Result<FopReply, Error> {
        match self.follow_home(file).await {
            Ok(true) => self.call_moved(creds, file, fop).await,
            _ => None,
        }
        .unwrap_or(Err(Error::Fop(code)))
    }

    /// `fop` run on the brick open file `file` has moved to, once it has.
    async fn call_moved(
        &self,
        creds: &Creds,
        file: &FileFd<L::Fd>,
        fop: &FdFop,
    ) -> Option<Result<FopReply, Error>> {
        if !file.moved.load(Ordering::Acquire) {
            return None;
        }
        let (brick, fd) = file.dst.get()?;
        Some(match self.bricks.get(*brick) {
            Ok(client) => client.call_fd(creds, fd, fop.clone()).await,
            Err(e) => Err(e),
        })
    }

    /// Points open file `file` at the brick its GFID lives on now, when that is another
    /// brick than the one it was opened on; whether it does.
    async fn follow_home(&self, file: &FileFd<L::Fd>) -> Result<bool, Error> {
        lock(&self.homes).pop(&file.gfid);
        let to = match self.home(&Creds::root(), file.gfid).await? {
            Home::Brick(to) if to != file.brick => to,
            _ => return Ok(false),
        };
        self.destination(file, to).await?;
        file.moved.store(true, Ordering::Release);
        tracing::debug!(
            from = file.brick,
            to,
            "an open file follows its finished move"
        );
        Ok(true)
    }

    /// Gives the source of a finished move, reached through `file` after its name went, a
    /// link file's mode again: a change through this fd took it off, and the copy's mark
    /// could not be put back by GFID. A change through another fd opened before the move
    /// then finds it moved and follows it, instead of staying on the removed copy.
    async fn mark_moved_through(&self, file: &FileFd<L::Fd>) {
        let attr = kiln_wire::SetAttr {
            mode: Mode::new(LINK_FILE_MODE),
            ..kiln_wire::SetAttr::default()
        };
        let mark = FdFop::new(|fd| kiln_wire::Fsetattr { fd, attr }.into());
        let Ok(brick) = self.bricks.get(file.brick) else {
            return;
        };
        if let Err(e) = brick.call_fd(&Creds::root(), &file.fd, mark).await {
            tracing::debug!(error = %e, "a moved file's source could not be marked again");
        }
    }

    /// The fd of open file `file` on brick `to`, where it is moving or has moved, opened the
    /// first time it is asked for (`ESTALE` if it was opened on another brick).
    async fn destination<'f>(
        &self,
        file: &'f FileFd<L::Fd>,
        to: usize,
    ) -> Result<&'f (usize, L::Fd), Error> {
        let dst = file
            .dst
            .get_or_try_init(|| async {
                // As root: a copying file's destination has no permission bits yet, and the
                // caller opened the file with this access already.
                let flags = OpenFlags::from_bits(
                    file.flags.bits() & !(OpenFlags::TRUNC.bits() | OpenFlags::EXCL.bits()),
                )
                .unwrap_or_default();
                let fd = self
                    .bricks
                    .get(to)?
                    .open(&Creds::root(), file.gfid, file.access, flags)
                    .await?;
                Ok::<_, Error>((to, fd))
            })
            .await?;
        // One opened for another move, given up since: this fd cannot follow the file.
        match dst.0 == to {
            true => Ok(dst),
            false => Err(Error::Fop(ErrorCode::Stale)),
        }
    }

    /// Puts back the mark of a file being moved that a caller's change of mode (`reply`, on
    /// brick `brick`) took off — the sticky bit while it is copied, mode `01000` once moved —
    /// so clients keep sending its changes where they belong; the look it had before.
    /// `ESTALE` when the move has since removed the copy the change reached (maybe after the
    /// mover read it): the change is to be made again where the file is now.
    async fn keep_mark(&self, brick: usize, reply: &FopReply) -> Result<Option<Look>, Error> {
        let (FopReply::Setattr(change) | FopReply::Fsetattr(change)) = reply else {
            return Ok(None);
        };
        let (before, gfid) = (Look::of(&change.pre), change.pre.gfid);
        if before == Look::Settled || Look::of(&change.post) == before {
            return Ok(None);
        }
        let gone = |e: Error| match e {
            Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale) => Error::Fop(ErrorCode::Stale),
            e => e,
        };
        if self
            .linkto(brick, gfid)
            .await
            .map_err(gone)?
            .is_none_or(|to| to == brick)
        {
            return Ok(None);
        }
        let mark = match before {
            Look::Copying => change.post.mode.bits() | STICKY,
            Look::Moved | Look::Settled => LINK_FILE_MODE,
        };
        self.set_mode(brick, gfid, mark).await.map_err(gone)?;
        Ok(Some(before))
    }

    /// `name` in `parent`, found as [`Distribute::find`] finds it once no rebalance is moving
    /// it: a rename, unlink or hard link waits for a file's move to end, which would otherwise
    /// move or remove the name under it (GlusterFS takes an entry lock for it).
    pub(super) async fn find_settled(
        &self,
        creds: &Creds,
        parent: Gfid,
        name: &Name,
    ) -> Result<Located, Error> {
        let deadline = Instant::now() + MOVE_WAIT;
        loop {
            let found = self.find(creds, parent, name).await?;
            if !self.is_moving(&found.iatt, found.home).await? {
                return Ok(found);
            }
            self.wait_for_move(found.iatt.gfid, deadline).await?;
        }
    }

    /// The brick file `gfid` lives on once no rebalance is moving it (as
    /// [`Distribute::find_settled`]); `None` for a directory.
    pub(super) async fn home_settled(
        &self,
        creds: &Creds,
        gfid: Gfid,
    ) -> Result<Option<usize>, Error> {
        let deadline = Instant::now() + MOVE_WAIT;
        loop {
            let Home::Brick(brick) = self.home(creds, gfid).await? else {
                return Ok(None);
            };
            let iatt = self.bricks.get(brick)?.stat(creds, gfid).await?;
            if !self.is_moving(&iatt, brick).await? {
                return Ok(Some(brick));
            }
            self.wait_for_move(gfid, deadline).await?;
        }
    }

    /// Whether file `iatt`, on brick `brick`, is being moved by a rebalance.
    async fn is_moving(&self, iatt: &Iatt, brick: usize) -> Result<bool, Error> {
        Ok(Look::of(iatt) != Look::Settled && self.moving_to(brick, iatt.gfid).await?.is_some())
    }

    async fn wait_for_move(&self, gfid: Gfid, deadline: Instant) -> Result<(), Error> {
        if Instant::now() > deadline {
            tracing::warn!(%gfid, "a file's move did not end within {MOVE_WAIT:?}");
            return Err(Error::Fop(ErrorCode::Busy));
        }
        lock(&self.homes).pop(&gfid);
        tokio::time::sleep(MOVE_POLL).await;
        Ok(())
    }

    /// Runs `fop`, which names file `gfid` (no fd), on brick `brick` that holds it, following
    /// its migration: a file gone from there is looked for again.
    pub(super) async fn call_on_file(
        &self,
        creds: &Creds,
        gfid: Gfid,
        brick: usize,
        fop: FopRequest,
    ) -> Result<FopReply, Error> {
        let reply = match self.bricks.get(brick)?.call(creds, fop.clone()).await {
            Err(Error::Fop(code @ (ErrorCode::NoEnt | ErrorCode::Stale))) => {
                return self.call_on_new_home(creds, gfid, brick, fop, code).await;
            }
            other => other?,
        };
        let mut look = file_iatt(&reply).map_or(Look::Settled, Look::of);
        match self.keep_mark(brick, &reply).await {
            Ok(before) => look = before.unwrap_or(look),
            // Moved away since: made again there. Nowhere else (unlinked): the reply stands.
            Err(Error::Fop(ErrorCode::Stale)) => {
                return match self
                    .call_on_new_home(creds, gfid, brick, fop, ErrorCode::Stale)
                    .await
                {
                    Err(Error::Fop(ErrorCode::Stale)) => Ok(reply),
                    done => done,
                };
            }
            Err(e) => return Err(e),
        }
        if look == Look::Settled || (look == Look::Copying && !changes_data(&fop)) {
            return Ok(reply);
        }
        let Some(to) = self.moving_to(brick, gfid).await? else {
            return Ok(reply);
        };
        if look == Look::Moved {
            return self
                .call_on_new_home(creds, gfid, brick, fop, ErrorCode::Stale)
                .await;
        }
        match self
            .bricks
            .get(to)?
            .call(&Creds::root(), data_part(fop))
            .await
        {
            Ok(_) | Err(Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale)) => Ok(reply),
            Err(e) => Err(e),
        }
    }

    /// Runs `fop` on wherever file `gfid` lives now that brick `was` no longer holds it;
    /// `code` when it lives nowhere else.
    async fn call_on_new_home(
        &self,
        creds: &Creds,
        gfid: Gfid,
        was: usize,
        fop: FopRequest,
        code: ErrorCode,
    ) -> Result<FopReply, Error> {
        lock(&self.homes).pop(&gfid);
        match self.home(creds, gfid).await {
            Ok(Home::Brick(b)) if b != was => self.bricks.get(b)?.call(creds, fop).await,
            Ok(_) | Err(Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale)) => Err(Error::Fop(code)),
            Err(e) => Err(e),
        }
    }

    /// The brick open file `file` (object `gfid`, whose replies look `look`) is moving to:
    /// the one its fd there is open on, else the one its `linkto` xattr names, else — moved
    /// and its old copy gone, whose xattrs the brick cannot read by GFID any more — wherever
    /// it is found now.
    async fn moving_to_of(
        &self,
        creds: &Creds,
        file: &FileFd<L::Fd>,
        gfid: Gfid,
        look: Look,
    ) -> Result<Option<usize>, Error> {
        if let Some((to, _)) = file.dst.get() {
            return Ok(Some(*to));
        }
        match self.moving_to_fd(file).await? {
            Some(to) => Ok(Some(to)),
            None if look == Look::Moved => {
                lock(&self.homes).pop(&gfid);
                match self.home(creds, gfid).await {
                    Ok(Home::Brick(to)) if to != file.brick => Ok(Some(to)),
                    Ok(_) | Err(Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale)) => Ok(None),
                    Err(e) => Err(e),
                }
            }
            None => Ok(None),
        }
    }

    /// The brick open file `file` is moving to, by its `linkto` xattr.
    async fn moving_to_fd(&self, file: &FileFd<L::Fd>) -> Result<Option<usize>, Error> {
        let get = FdFop::new(|fd| {
            kiln_wire::Fgetxattr {
                fd,
                name: xattr_name(LINKTO_XATTR),
            }
            .into()
        });
        let read = self
            .bricks
            .get(file.brick)?
            .call_fd(&Creds::root(), &file.fd, get)
            .await;
        elsewhere(file.brick, self.linkto_read(read).await)
    }

    /// The brick file `gfid` on brick `brick` is moving to, by its `linkto` xattr (one this
    /// layer does not know is looked for among the bricks added to the volume: a change sent
    /// to the copy must not be dropped).
    pub(super) async fn moving_to(&self, brick: usize, gfid: Gfid) -> Result<Option<usize>, Error> {
        elsewhere(brick, self.linkto(brick, gfid).await)
    }
}

/// The brick a file on brick `brick` is moving to, from what its `linkto` names: none when it
/// names that brick itself or the file is gone.
fn elsewhere(brick: usize, linkto: Result<Option<usize>, Error>) -> Result<Option<usize>, Error> {
    match linkto {
        Ok(to) => Ok(to.filter(|&to| to != brick)),
        Err(Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The attributes of the file a reply describes, after the fop.
fn file_iatt(reply: &FopReply) -> Option<&Iatt> {
    match reply {
        FopReply::Read(r) | FopReply::Get(r) => Some(&r.iatt),
        FopReply::Stat(r) | FopReply::Fstat(r) => Some(&r.iatt),
        FopReply::Write(c)
        | FopReply::Fsync(c)
        | FopReply::Setattr(c)
        | FopReply::Fsetattr(c)
        | FopReply::Truncate(c)
        | FopReply::Ftruncate(c)
        | FopReply::Fallocate(c)
        | FopReply::Discard(c)
        | FopReply::Zerofill(c) => Some(&c.post),
        _ => None,
    }
}

/// What of `fop`, a change of data, a copy being made must get too: a SETATTR's size alone
/// (its mode would take the copy's link-file look away; the rest is copied at the switch).
fn data_part(fop: FopRequest) -> FopRequest {
    match fop {
        FopRequest::Setattr(r) => kiln_wire::Setattr {
            gfid: r.gfid,
            attr: r.attr.size.map(size_attr).unwrap_or_default(),
        }
        .into(),
        FopRequest::Fsetattr(r) => kiln_wire::Fsetattr {
            fd: r.fd,
            attr: r.attr.size.map(size_attr).unwrap_or_default(),
        }
        .into(),
        other => other,
    }
}

/// Whether `fop` changes a file's data (and so must reach a copy being made of it).
fn changes_data(fop: &FopRequest) -> bool {
    match fop {
        FopRequest::Setattr(r) => r.attr.size.is_some(),
        FopRequest::Fsetattr(r) => r.attr.size.is_some(),
        _ => matches!(
            fop.code(),
            FopCode::Write
                | FopCode::Truncate
                | FopCode::Ftruncate
                | FopCode::Fallocate
                | FopCode::Discard
                | FopCode::Zerofill
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::iatt;
    use super::*;

    #[test]
    fn the_sticky_bit_tells_a_file_s_migration() {
        assert_eq!(Look::of(&iatt(FileType::Regular, 0o644)), Look::Settled);
        assert_eq!(Look::of(&iatt(FileType::Regular, 0o1644)), Look::Copying);
        assert_eq!(Look::of(&iatt(FileType::Regular, 0o1000)), Look::Moved);
        assert_eq!(Look::of(&iatt(FileType::Directory, 0o1777)), Look::Settled);
    }

    #[test]
    fn only_fops_on_data_are_sent_to_the_copy() {
        let size = |size| kiln_wire::SetAttr {
            size,
            ..kiln_wire::SetAttr::default()
        };
        let fd = kiln_wire::FdId {
            slot: 0,
            generation: 0,
        };
        let setattr = |attr| {
            FopRequest::from(kiln_wire::Setattr {
                gfid: Gfid::ROOT,
                attr,
            })
        };
        assert!(changes_data(&setattr(size(Some(0)))));
        assert!(!changes_data(&setattr(size(None))));
        assert!(changes_data(&kiln_wire::Ftruncate { fd, size: 0 }.into()));
        assert!(!changes_data(&kiln_wire::Fstat { fd }.into()));
    }
}
