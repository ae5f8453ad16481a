//! Open directories: READDIRP (and READDIR) brick after brick, each directory once (with the
//! latest times of its copies) and no link files, under offsets of this layer's own.

use std::collections::{HashMap, HashSet};

use kiln_wire::limits::{BATCH_FOPS_MAX, READDIRP_ENTRY_BYTES};

use super::heal::merge_times;
use super::*;
use crate::layer::DOT_OFFSET_MAX;

/// What one listed entry counts against a reply's size besides its name, as a brick counts
/// it.
const LISTED_ENTRY_BYTES: u64 = READDIRP_ENTRY_BYTES as u64;

/// The offsets of a directory listing this layer keeps: the latest ones given out, so a
/// listing goes on from where the kernel stopped and a `seekdir` back a little works,
/// while the memory one open directory holds stays bounded.
const OFFSETS_KEPT: usize = 64 * 1024;

/// The subdirectories an open directory's listing remembers having shown, at most: a later
/// brick's copies of them are not shown again, without asking the earlier bricks.
const SHOWN_DIRS_KEPT: usize = 64 * 1024;

/// An open directory: its fd on each brick that has it, the offsets given out, and the
/// subdirectories shown since the listing last began, with the brick each was shown from (up
/// to [`SHOWN_DIRS_KEPT`]).
#[derive(Debug)]
pub struct DirFds<F> {
    pub(super) fds: Vec<Option<F>>,
    pub(super) offsets: Mutex<Offsets>,
    shown_dirs: Mutex<HashMap<Gfid, usize>>,
}

/// This layer's offsets in one directory: offset `n` (from [`DOT_OFFSET_MAX`] + 1, below
/// which the mount lists `.` and `..`) continues listing brick `.0` after its own offset
/// `.1`; the latest [`OFFSETS_KEPT`] are kept.
#[derive(Debug, Default)]
pub(super) struct Offsets {
    /// The offset of `kept[0]`.
    first: u64,
    kept: std::collections::VecDeque<(usize, u64)>,
}

impl Offsets {
    /// A new offset for "after brick `brick`'s offset `at`".
    fn push(&mut self, brick: usize, at: u64) -> u64 {
        if self.kept.len() == OFFSETS_KEPT {
            self.kept.pop_front();
            self.first += 1;
        }
        self.kept.push_back((brick, at));
        DOT_OFFSET_MAX + self.first + self.kept.len() as u64
    }

    /// Where offset `n` continues; `None` for one never given or no longer kept.
    fn get(&self, n: u64) -> Option<(usize, u64)> {
        let index = n.checked_sub(DOT_OFFSET_MAX + self.first + 1)?;
        self.kept.get(usize::try_from(index).ok()?).copied()
    }

    /// Forgets every offset (a listing from the start); offsets given later are new.
    fn restart(&mut self) {
        self.first += self.kept.len() as u64;
        self.kept.clear();
    }
}

impl<F> DirFds<F> {
    /// A directory open on the bricks that have `fds[brick]`, its listing not begun.
    pub(super) fn new(fds: Vec<Option<F>>) -> DirFds<F> {
        DirFds {
            fds,
            offsets: Mutex::new(Offsets::default()),
            shown_dirs: Mutex::new(HashMap::new()),
        }
    }
}

impl<L: Layer> Distribute<L> {
    /// `open` on every brick at once: what each opened, by brick (`None` where it failed or
    /// the brick is gone), and whether one failed; the error of one that failed when none
    /// opened. A brick without a copy of the directory is left out, as GlusterFS's OPENDIR
    /// leaves it.
    pub(super) async fn open_everywhere<'a, T, Opened>(
        &'a self,
        open: impl Fn(&'a L) -> Opened,
    ) -> Result<(Vec<Option<T>>, bool), Error>
    where
        Opened: Future<Output = Result<T, Error>>,
    {
        let open = &open;
        let opened = futures_util::future::join_all(self.bricks.indexes().map(|i| async move {
            match self.bricks.get(i) {
                Ok(brick) => open(brick).await.map(Some),
                Err(_) => Ok(None),
            }
        }))
        .await;
        let (mut fds, mut failure) = (Vec::with_capacity(opened.len()), None);
        for result in opened {
            fds.push(result.unwrap_or_else(|e| {
                failure = Some(e);
                None
            }));
        }
        match (fds.iter().any(Option::is_some), failure) {
            (false, Some(e)) => Err(e),
            (_, failure) => Ok((fds, failure.is_some())),
        }
    }

    /// OPENDIR_LIST of directory `gfid` on every brick at once: each copy opened, and
    /// `lease` taken on it before its first `size` bytes of entries are read. The lease
    /// granted is the least any brick granted (the others lowered to it, as
    /// [`Distribute::lease`] does); the entries are what a listing from the start gives
    /// ([`Distribute::list`]) out of what the bricks sent. A brick that fails (no copy there)
    /// is left out, as OPENDIR leaves it; when all fail, the error is the last one.
    pub(super) async fn open_listed(
        &self,
        creds: &Creds,
        gfid: Gfid,
        size: ReaddirSize,
        lease: LeaseKind,
    ) -> Result<(DistFd<L::Fd>, LeaseKind, ReaddirpXattrsReply), Error> {
        let (opened, failed) =
            (self.open_everywhere(|brick| brick.opendir_list(creds, gfid, size, lease))).await?;
        let (mut fds, mut firsts, mut granted) = (vec![], vec![], vec![]);
        for (i, opened) in opened.into_iter().enumerate() {
            let (fd, first) = match opened {
                Some((fd, kind, first)) => {
                    granted.push((i, kind));
                    (Some(fd), Some(first))
                }
                None => (None, None),
            };
            fds.push(fd);
            firsts.push(first);
        }
        // A brick without the directory's copy grants nothing.
        if failed && let Some(refused) = fds.iter().position(Option::is_none) {
            granted.push((refused, LeaseKind::None));
        }
        let least = self.least_lease(creds, gfid, &granted).await;
        let fds = DirFds::new(fds);
        match self.list_from(creds, &fds, 0, size, firsts).await {
            Ok(listing) => Ok((DistFd::Dir(fds), least, listing)),
            Err(e) => {
                // Nothing stays open or held that the caller would not know of.
                let _ = Layer::release(self, creds, DistFd::Dir(fds)).await;
                if least != LeaseKind::None {
                    let back = kiln_wire::Lease {
                        gfid,
                        kind: LeaseKind::None,
                    };
                    let _ = self.lease(creds, back).await;
                }
                Err(e)
            }
        }
    }

    /// The entries of directory `fds` from this layer's `offset`: brick after brick until
    /// about `size` bytes of entries (counted as a brick counts them), so a small directory
    /// comes whole in one reply however many bricks it spans.
    pub(super) async fn list(
        &self,
        creds: &Creds,
        fds: &DirFds<L::Fd>,
        offset: u64,
        size: ReaddirSize,
    ) -> Result<ReaddirpXattrsReply, Error> {
        self.list_from(creds, fds, offset, size, Vec::new()).await
    }

    /// [`Distribute::list`], with `firsts[brick]`, where there is one, the brick's entries
    /// from the start, already read (up to `size`: they are cut where the reply is full).
    async fn list_from(
        &self,
        creds: &Creds,
        fds: &DirFds<L::Fd>,
        offset: u64,
        size: ReaddirSize,
        mut firsts: Vec<Option<ReaddirpXattrsReply>>,
    ) -> Result<ReaddirpXattrsReply, Error> {
        let (mut brick, mut from) = match offset {
            // A listing from the start: the offsets of earlier ones go.
            0 => {
                lock(&fds.offsets).restart();
                lock(&fds.shown_dirs).clear();
                (0, 0)
            }
            n => lock(&fds.offsets)
                .get(n)
                .ok_or(Error::Fop(ErrorCode::Inval))?,
        };
        let opened: Vec<usize> = self.dir_fds(fds).map(|(i, _)| i).collect();
        let mut entries = Vec::new();
        let mut left = u64::from(size.get());
        while brick < fds.fds.len() {
            // (A brick removed since the directory was opened is left out.)
            let in_service = self.bricks.role(brick).in_service();
            let Some(fd) = fds.fds[brick].as_ref().filter(|_| in_service) else {
                (brick, from) = (brick + 1, 0);
                continue;
            };
            let read = firsts.get_mut(brick).and_then(Option::take);
            let reply = match read.filter(|_| from == 0) {
                Some(reply) => reply,
                None => self.read_entries(creds, brick, fd, from, left).await?,
            };
            let last = reply.entries.last().map(|e| e.offset);
            let earlier = &opened[..opened.partition_point(|&i| i < brick)];
            for e in (self.shown(creds, fds, brick, earlier, reply.entries)).await? {
                let cost = listed_bytes(&e);
                if !entries.is_empty() && cost > left {
                    // Full, with entries read ahead left: the next listing goes on after the
                    // last one taken (its offset says where).
                    let eof = false;
                    return Ok(ReaddirpXattrsReply { entries, eof });
                }
                left = left.saturating_sub(cost);
                let offset = lock(&fds.offsets).push(brick, e.offset);
                entries.push(DirEntryXattrs { offset, ..e });
            }
            (brick, from) = match (reply.eof, last) {
                (false, Some(last)) => (brick, last),
                _ => (brick + 1, 0),
            };
            // Stop where this brick has more, or the reply is full; the next listing goes on
            // from its last entry.
            if !entries.is_empty() && (!reply.eof || left < LISTED_ENTRY_BYTES) {
                break;
            }
        }
        let eof = brick >= fds.fds.len();
        Ok(ReaddirpXattrsReply { entries, eof })
    }

    /// READDIRP_XATTRS of up to `size` bytes of brick `brick`'s entries after its `offset`.
    async fn read_entries(
        &self,
        creds: &Creds,
        brick: usize,
        fd: &L::Fd,
        offset: u64,
        size: u64,
    ) -> Result<ReaddirpXattrsReply, Error> {
        let fop = FdFop::new(|fd| {
            kiln_wire::ReaddirpXattrs {
                fd,
                offset,
                size: ReaddirSize::saturating(size),
            }
            .into()
        });
        match self.bricks.get(brick)?.call_fd(creds, fd, fop).await? {
            FopReply::ReaddirpXattrs(reply) => Ok(reply),
            _ => Err(Error::Protocol("a READDIRP answered otherwise".into())),
        }
    }

    /// What of brick `brick`'s `listed` entries (in the directory open as `fds`) this layer
    /// shows: each directory once (from the first brick that has a copy of it, of those
    /// `earlier` bricks where the listed directory is open and this one; with the latest
    /// times of its copies), no link files.
    async fn shown(
        &self,
        creds: &Creds,
        fds: &DirFds<L::Fd>,
        brick: usize,
        earlier: &[usize],
        listed: Vec<DirEntryXattrs>,
    ) -> Result<Vec<DirEntryXattrs>, Error> {
        let mut shown = Vec::with_capacity(listed.len());
        let is_dir = |e: &DirEntryXattrs| e.iatt.file_type == FileType::Directory;
        // Shown from an earlier brick in this listing, or else asked of the earlier bricks.
        let (mut on_earlier, mut unseen) = (HashSet::new(), Vec::new());
        {
            let shown_dirs = lock(&fds.shown_dirs);
            for gfid in listed.iter().filter(|e| is_dir(e)).map(|e| e.iatt.gfid) {
                if shown_dirs.get(&gfid).is_some_and(|&from| from < brick) {
                    on_earlier.insert(gfid);
                } else {
                    unseen.push(gfid);
                }
            }
        }
        on_earlier.extend(self.copies_on(creds, earlier, &unseen).await);
        for e in listed {
            if is_dir(&e) && on_earlier.contains(&e.iatt.gfid) {
                continue;
            }
            match self.link_file_target(brick, &e.iatt).await {
                Ok(None) => shown.push(e),
                // A link file, or an entry removed since it was listed.
                Ok(Some(_)) | Err(Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale)) => {}
                Err(e) => return Err(e),
            }
        }
        self.merge_dir_copies(creds, brick, &mut shown).await;
        let mut shown_dirs = lock(&fds.shown_dirs);
        for e in shown.iter().filter(|e| is_dir(e)) {
            if shown_dirs.len() < SHOWN_DIRS_KEPT {
                shown_dirs.insert(e.iatt.gfid, brick);
            }
        }
        drop(shown_dirs);
        for e in &shown {
            self.note_home(&e.iatt, brick);
        }
        Ok(shown)
    }

    /// Which of directories `dirs` have a copy on one of `bricks`, all asked at once. A brick
    /// out of reach is taken to have them all (a directory shows once at most).
    async fn copies_on(&self, creds: &Creds, bricks: &[usize], dirs: &[Gfid]) -> HashSet<Gfid> {
        if dirs.is_empty() {
            return HashSet::new();
        }
        let stated = futures_util::future::join_all(
            (bricks.iter()).map(|&brick| async move { self.stat_each(creds, brick, dirs).await }),
        )
        .await;
        let mut found = HashSet::new();
        for answers in stated {
            for (gfid, answer) in dirs.iter().zip(answers) {
                if !matches!(answer, Err(Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale))) {
                    found.insert(*gfid);
                }
            }
        }
        found
    }

    /// STAT of each of `gfids` on brick `brick`, as BATCHes: an answer for each.
    async fn stat_each(
        &self,
        creds: &Creds,
        brick: usize,
        gfids: &[Gfid],
    ) -> Vec<Result<FopReply, Error>> {
        let mut answers = Vec::with_capacity(gfids.len());
        for chunk in gfids.chunks(BATCH_FOPS_MAX) {
            let failed = |e: Error| chunk.iter().map(|_| Err(e.clone())).collect::<Vec<_>>();
            let mut batch = Batch::new(creds.clone());
            for gfid in chunk {
                let stat = kiln_wire::Stat { gfid: *gfid };
                batch
                    .push(stat.into())
                    .unwrap_or_else(|e| unreachable!("a BATCH takes {BATCH_FOPS_MAX} STATs: {e}"));
            }
            let answered = match self.bricks.get(brick) {
                Ok(on) => on.batch(batch).await,
                Err(e) => Err(e),
            };
            answers.extend(match answered {
                Ok(reply) if reply.results.len() == chunk.len() => (reply.results.into_iter())
                    .map(|r| r.map_err(Error::Fop))
                    .collect(),
                Ok(_) => failed(Error::Protocol("a BATCH half answered".into())),
                Err(e) => failed(e),
            });
        }
        answers
    }

    /// Gives each directory in `shown` (listed on brick `brick`) its times as a STAT or
    /// LOOKUP of it gives them, the latest of every copy: a program that compares them (tar's
    /// "file changed as we read it") sees one directory. Each other brick is asked for its
    /// copies' as one BATCH of STATs, all bricks at once; a copy missing, or a brick out of
    /// reach, has nothing to merge.
    async fn merge_dir_copies(&self, creds: &Creds, brick: usize, shown: &mut [DirEntryXattrs]) {
        let is_dir = |e: &DirEntryXattrs| e.iatt.file_type == FileType::Directory;
        let dirs: Vec<usize> = (0..shown.len()).filter(|&i| is_dir(&shown[i])).collect();
        if dirs.is_empty() {
            return;
        }
        let gfids: Vec<Gfid> = dirs.iter().map(|&i| shown[i].iatt.gfid).collect();
        let others = self.bricks.in_service().filter(|(i, _)| *i != brick);
        let gfids = &gfids;
        let stated = futures_util::future::join_all(
            others.map(|(other, _)| async move { self.stat_each(creds, other, gfids).await }),
        )
        .await;
        for answers in stated {
            for (&i, answer) in dirs.iter().zip(answers) {
                if let Ok(FopReply::Stat(copy)) = answer {
                    merge_times(&mut shown[i].iatt, &copy.iatt);
                }
            }
        }
    }

    /// A fop on an open directory.
    pub(super) async fn call_dir(
        &self,
        creds: &Creds,
        fds: &DirFds<L::Fd>,
        fop: FdFop,
    ) -> Result<FopReply, Error> {
        match fop.request().clone() {
            FopRequest::ReaddirpXattrs(r) => Ok(FopReply::ReaddirpXattrs(
                self.list(creds, fds, r.offset, r.size).await?,
            )),
            FopRequest::Readdirp(r) => {
                let reply = self.list(creds, fds, r.offset, r.size).await?;
                let entries = reply.entries.into_iter().map(|e| kiln_wire::DirEntryPlus {
                    offset: e.offset,
                    name: e.name,
                    iatt: e.iatt,
                });
                Ok(FopReply::Readdirp(kiln_wire::ReaddirpReply {
                    entries: entries.collect(),
                    eof: reply.eof,
                }))
            }
            FopRequest::Readdir(r) => {
                let reply = self.list(creds, fds, r.offset, r.size).await?;
                let entries = reply.entries.into_iter().map(|e| DirEntry {
                    offset: e.offset,
                    ino: e.iatt.ino,
                    file_type: e.iatt.file_type,
                    name: e.name,
                });
                Ok(FopReply::Readdir(kiln_wire::ReaddirReply {
                    entries: entries.collect(),
                    eof: reply.eof,
                }))
            }
            FopRequest::Fsyncdir(_) => {
                let mut answer = None;
                for (brick, fd) in self.dir_fds(fds) {
                    answer = Some(
                        self.bricks
                            .get(brick)?
                            .call_fd(creds, fd, fop.clone())
                            .await?,
                    );
                }
                answer.ok_or(Error::Fop(ErrorCode::BadFd))
            }
            // Anything else on a directory asks its first copy.
            _ => {
                let (brick, fd) = self
                    .dir_fds(fds)
                    .next()
                    .ok_or(Error::Fop(ErrorCode::BadFd))?;
                self.bricks.get(brick)?.call_fd(creds, fd, fop).await
            }
        }
    }

    /// The fds of open directory `fds` on the bricks in service, with their bricks.
    pub(super) fn dir_fds<'a>(
        &'a self,
        fds: &'a DirFds<L::Fd>,
    ) -> impl Iterator<Item = (usize, &'a L::Fd)> {
        let in_service = |i: usize| self.bricks.role(i).in_service();
        fds.fds
            .iter()
            .enumerate()
            .filter_map(move |(i, fd)| fd.as_ref().filter(|_| in_service(i)).map(|fd| (i, fd)))
    }
}

/// What entry `e` costs a reply.
fn listed_bytes(e: &DirEntryXattrs) -> u64 {
    e.name.as_bytes().len() as u64 + LISTED_ENTRY_BYTES
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_are_kept_in_a_window_and_never_reused() {
        let mut offsets = Offsets::default();
        let first = DOT_OFFSET_MAX + 1;
        assert_eq!(offsets.get(first), None);
        assert_eq!(
            offsets.push(0, 10),
            first,
            "the mount's `.` and `..` come before"
        );
        assert_eq!(offsets.push(1, 20), first + 1);
        assert_eq!(
            (offsets.get(first), offsets.get(first + 1)),
            (Some((0, 10)), Some((1, 20)))
        );
        offsets.restart();
        assert_eq!(
            offsets.get(first + 1),
            None,
            "a new listing's offsets are new"
        );
        assert_eq!(offsets.push(2, 30), first + 2);
        for i in 0..OFFSETS_KEPT as u64 {
            offsets.push(0, i);
        }
        assert_eq!(offsets.get(first + 2), None, "the oldest went");
        assert_eq!(
            offsets.get(first + 2 + OFFSETS_KEPT as u64),
            Some((0, OFFSETS_KEPT as u64 - 1))
        );
        for dot in 0..first {
            assert_eq!(offsets.get(dot), None);
        }
    }
}
