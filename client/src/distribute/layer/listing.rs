//! Open directories: READDIRP (and READDIR) brick after brick, each directory once (with the
//! latest times of its copies) and no link files, under offsets of this layer's own.

use kiln_wire::limits::READDIRP_ENTRY_BYTES;

use super::*;

/// What one listed entry counts against a reply's size besides its name, as a brick counts
/// it.
const LISTED_ENTRY_BYTES: u64 = READDIRP_ENTRY_BYTES as u64;

/// The offsets of a directory listing this layer keeps: the latest ones given out, so a
/// listing goes on from where the kernel stopped and a `seekdir` back a little works,
/// while the memory one open directory holds stays bounded.
const OFFSETS_KEPT: usize = 64 * 1024;

/// An open directory: its fd on each brick that has it, and the offsets given out.
#[derive(Debug)]
pub struct DirFds<F> {
    pub(super) fds: Vec<Option<F>>,
    pub(super) offsets: Mutex<Offsets>,
}

/// This layer's offsets in one directory: offset `n` (from 1) continues listing brick `.0`
/// after its own offset `.1`; the latest [`OFFSETS_KEPT`] are kept.
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
        self.first + self.kept.len() as u64
    }

    /// Where offset `n` continues; `None` for one never given or no longer kept.
    fn get(&self, n: u64) -> Option<(usize, u64)> {
        let index = n.checked_sub(self.first + 1)?;
        self.kept.get(usize::try_from(index).ok()?).copied()
    }

    /// Forgets every offset (a listing from the start); offsets given later are new.
    fn restart(&mut self) {
        self.first += self.kept.len() as u64;
        self.kept.clear();
    }
}

impl<L: Layer> Distribute<L> {
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
        let (mut brick, mut from) = match offset {
            // A listing from the start: the offsets of earlier ones go.
            0 => {
                lock(&fds.offsets).restart();
                (0, 0)
            }
            n => lock(&fds.offsets)
                .get(n)
                .ok_or(Error::Fop(ErrorCode::Inval))?,
        };
        let first = self.dir_fds(fds).next().map(|(i, _)| i);
        let mut entries = Vec::new();
        let mut left = u64::from(size.get());
        while brick < fds.fds.len() {
            // (A brick removed since the directory was opened is left out.)
            let in_service = self.bricks.role(brick).in_service();
            let Some(fd) = fds.fds[brick].as_ref().filter(|_| in_service) else {
                (brick, from) = (brick + 1, 0);
                continue;
            };
            let fop = FdFop::new(|fd| {
                kiln_wire::ReaddirpXattrs {
                    fd,
                    offset: from,
                    size: ReaddirSize::saturating(left),
                }
                .into()
            });
            let FopReply::ReaddirpXattrs(reply) =
                self.bricks.get(brick)?.call_fd(creds, fd, fop).await?
            else {
                return Err(Error::Protocol("a READDIRP answered otherwise".into()));
            };
            let last = reply.entries.last().map(|e| e.offset);
            let shown = self.shown(creds, brick, first, reply.entries).await?;
            for e in shown {
                left = left.saturating_sub(listed_bytes(&e));
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

    /// What of brick `brick`'s `listed` entries this layer shows: each directory once (from
    /// the `first` brick, with the latest times of its copies), no link files.
    async fn shown(
        &self,
        creds: &Creds,
        brick: usize,
        first: Option<usize>,
        listed: Vec<DirEntryXattrs>,
    ) -> Result<Vec<DirEntryXattrs>, Error> {
        let mut shown = Vec::with_capacity(listed.len());
        for e in listed {
            let is_dir = e.iatt.file_type == FileType::Directory;
            if is_dir && Some(brick) != first {
                continue;
            }
            match self.link_file_target(brick, &e.iatt).await {
                Ok(None) => shown.push(e),
                // A link file, or an entry removed since it was listed.
                Ok(Some(_)) | Err(Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale)) => {}
                Err(e) => return Err(e),
            }
        }
        // A directory's times as a STAT or LOOKUP of it gives them, the latest of every copy:
        // a program that compares them (tar's "file changed as we read it") sees one
        // directory. Asked for all of them at once.
        let merges = shown.iter_mut().map(|e| async move {
            if e.iatt.file_type == FileType::Directory {
                self.merge_copies(creds, &mut e.iatt, brick).await;
            }
        });
        futures_util::future::join_all(merges).await;
        for e in &shown {
            self.note_home(&e.iatt, brick);
        }
        Ok(shown)
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
        assert_eq!(offsets.get(1), None);
        assert_eq!(offsets.push(0, 10), 1);
        assert_eq!(offsets.push(1, 20), 2);
        assert_eq!(
            (offsets.get(1), offsets.get(2)),
            (Some((0, 10)), Some((1, 20)))
        );
        offsets.restart();
        assert_eq!(offsets.get(2), None, "a new listing's offsets are new");
        assert_eq!(offsets.push(2, 30), 3);
        for i in 0..OFFSETS_KEPT as u64 {
            offsets.push(0, i);
        }
        assert_eq!(offsets.get(3), None, "the oldest went");
        assert_eq!(
            offsets.get(3 + OFFSETS_KEPT as u64),
            Some((0, OFFSETS_KEPT as u64 - 1))
        );
        assert_eq!(offsets.get(0), None);
    }
}
