//! LEASE (and OPENDIR_LIST's lease), and what the lease check needs from the disk: what an
//! RMDIR, an UNLINK or a replacing RENAME would remove. The lease rules themselves are
//! [`crate::leases`]'s.

use kiln_wire::{Gfid, Lease, LeaseKind, LeaseReply, Name};
use rustix::io::Errno;

use super::{Fops, R};
use crate::exec::Exec;
use crate::fdtable::SessionId;
use crate::op::{self, Stat, Step, cstr};

impl<E: Exec> Fops<E> {
    /// LEASE: asks for a lease on directory `gfid`, or a read lease on regular file `gfid`
    /// (capability `FILE_LEASES`: EINVAL for a write lease on a file, ENOTDIR for anything
    /// else, ESTALE when it is gone), or gives one back (kind none, which needs no object: a
    /// removed directory's leases are gone already). ENOTSUP for a session that did not
    /// negotiate leases.
    pub(super) async fn lease(&self, session: SessionId, r: Lease) -> R<LeaseReply> {
        let leases = &self.shared.leases;
        if !leases.is_attached(session) {
            return Err(Errno::NOTSUP);
        }
        if r.kind != LeaseKind::None {
            let stat = self.stat_gfid(&r.gfid).await?;
            match (stat.is_dir(), stat.is_regular(), r.kind) {
                (true, _, _) | (false, true, LeaseKind::Read) => {}
                (false, true, _) => return Err(Errno::INVAL),
                (false, false, _) => return Err(Errno::NOTDIR),
            }
        }
        let kind = leases.grant(session, r.gfid, r.kind).await?;
        // A removal that ran between the look above and the grant recalled nothing: the
        // object must still be there now that the grant is noted (any removal from now on
        // recalls it first).
        if kind != LeaseKind::None
            && let Err(e) = self.stat_gfid(&r.gfid).await
        {
            leases.give_back(session, r.gfid, kind);
            return Err(e);
        }
        Ok(LeaseReply { kind })
    }

    /// The lease OPENDIR_LIST asked on directory `gfid` before its listing, taken as LEASE
    /// would grant it where the session holds none there (one it holds stays as it is): what
    /// it took, none where it took none or LEASE would fail.
    pub(super) async fn lease_before_listing(
        &self,
        session: SessionId,
        gfid: Gfid,
        kind: LeaseKind,
    ) -> LeaseKind {
        if kind == LeaseKind::None || !self.stat_gfid(&gfid).await.is_ok_and(|s| s.is_dir()) {
            return LeaseKind::None;
        }
        let took = self.shared.leases.take_for_listing(session, gfid, kind);
        took.await.unwrap_or(LeaseKind::None)
    }

    /// What `parent/name`, which a fop would remove (or move), is for the lease check, looked
    /// up as the brick: a directory always, another object only when `objects`.
    pub(super) async fn removed_at(&self, parent: &Gfid, name: &Name, objects: bool) -> Removed {
        let looked: R<Removed> = async {
            Self::check_entry(parent, name)?;
            let dir = self.dir(parent).await?;
            let step = Step::brick(op::Statx::of(&dir, &cstr(name.as_bytes())));
            let stat: Stat = self.run_one(step).await?;
            if !stat.is_dir() && !objects {
                return Ok(Removed::Unresolved);
            }
            let gfid = self.gfid_at(parent, &dir, name.as_bytes(), &stat).await?;
            Ok(match stat.is_dir() {
                true => Removed::Dir(gfid),
                false => Removed::Object(gfid),
            })
        }
        .await;
        // A failed lookup: the fop that would remove it fails itself.
        looked.unwrap_or(Removed::Nothing)
    }
}

/// What a fop would remove, as the lease check sees it ([`Fops::removed_at`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Removed {
    /// A directory: its leases go with it.
    Dir(Gfid),
    /// Another object, whose link count changes.
    Object(Gfid),
    /// Not a directory, and not looked further up.
    Unresolved,
    /// Nothing there, or nothing the brick could look up.
    Nothing,
}
