//! The copy of a file until equal: passes over it, chunk by chunk, while clients keep
//! writing to it.

use super::super::files::{Look, STICKY};
use super::*;

/// A chunk of a file made equal on the destination.
struct Chunk {
    /// Its length on the source (0 past the end).
    len: u64,
    /// Bytes written to the destination.
    copied: u64,
    /// Equal on both when last read: not changing faster than it is copied.
    settled: bool,
}

impl<L: Layer> Distribute<L> {
    /// Copies file `gfid` from brick `from` to `to` pass after pass until a pass finds the
    /// copies equal and the source still marked: the bytes copied, or `None` after
    /// [`PASSES_MAX`] passes.
    pub(super) async fn copy_until_equal(
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
}

async fn fstat<L: Layer>(brick: &L, fd: &L::Fd) -> Result<Iatt, Error> {
    let fop = FdFop::new(|fd| kiln_wire::Fstat { fd }.into());
    match brick.call_fd(&Creds::root(), fd, fop).await? {
        FopReply::Fstat(r) => Ok(r.iatt),
        other => Err(unexpected(&other)),
    }
}
