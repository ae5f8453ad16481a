//! Open directories: READDIRP (and READDIR) brick after brick, each directory once and no
//! link files, under offsets of this layer's own.

use super::*;

/// An open directory: its fd on each brick that has it, and the offsets given out.
#[derive(Debug)]
pub struct DirFds<F> {
    pub(super) fds: Vec<Option<F>>,
    /// Offset `n` (from 1) continues listing brick `.0` after its offset `.1`.
    pub(super) offsets: Mutex<Vec<(usize, u64)>>,
}

impl<L: Layer> Distribute<L> {
    /// The entries of directory `fds` from this layer's `offset`.
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
                lock(&fds.offsets).clear();
                (0, 0)
            }
            n => {
                let offsets = lock(&fds.offsets);
                let index = usize::try_from(n - 1).map_err(|_| Error::Fop(ErrorCode::Inval))?;
                *offsets.get(index).ok_or(Error::Fop(ErrorCode::Inval))?
            }
        };
        let first = fds.fds.iter().position(Option::is_some);
        while brick < fds.fds.len() {
            let Some(fd) = &fds.fds[brick] else {
                (brick, from) = (brick + 1, 0);
                continue;
            };
            let fop = FdFop::new(|fd| {
                kiln_wire::ReaddirpXattrs {
                    fd,
                    offset: from,
                    size,
                }
                .into()
            });
            let FopReply::ReaddirpXattrs(reply) =
                self.bricks[brick].call_fd(creds, fd, fop).await?
            else {
                return Err(Error::Protocol("a READDIRP answered otherwise".into()));
            };
            let last = reply.entries.last().map(|e| e.offset);
            let mut entries = Vec::new();
            for e in reply.entries {
                let is_dir = e.iatt.file_type == FileType::Directory;
                if (is_dir && Some(brick) != first)
                    || self.link_file_target(brick, &e.iatt).await?.is_some()
                {
                    continue;
                }
                self.note_home(&e.iatt, brick);
                let mut offsets = lock(&fds.offsets);
                offsets.push((brick, e.offset));
                entries.push(DirEntryXattrs {
                    offset: offsets.len() as u64,
                    ..e
                });
            }
            if !entries.is_empty() {
                let eof = reply.eof && brick + 1 == fds.fds.len();
                return Ok(ReaddirpXattrsReply { entries, eof });
            }
            (brick, from) = match (reply.eof, last) {
                (false, Some(last)) => (brick, last),
                _ => (brick + 1, 0),
            };
        }
        Ok(ReaddirpXattrsReply {
            entries: Vec::new(),
            eof: true,
        })
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
                    answer = Some(self.bricks[brick].call_fd(creds, fd, fop.clone()).await?);
                }
                answer.ok_or(Error::Fop(ErrorCode::BadFd))
            }
            // Anything else on a directory asks its first copy.
            _ => {
                let (brick, fd) = self
                    .dir_fds(fds)
                    .next()
                    .ok_or(Error::Fop(ErrorCode::BadFd))?;
                self.bricks[brick].call_fd(creds, fd, fop).await
            }
        }
    }

    pub(super) fn dir_fds<'a>(
        &self,
        fds: &'a DirFds<L::Fd>,
    ) -> impl Iterator<Item = (usize, &'a L::Fd)> {
        fds.fds
            .iter()
            .enumerate()
            .filter_map(|(i, fd)| fd.as_ref().map(|fd| (i, fd)))
    }
}
