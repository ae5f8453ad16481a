//! LEASE (and OPENDIR_LIST's lease), and what the lease check needs from the disk: the
//! directory an RMDIR or a replacing RENAME would remove. The lease rules themselves are
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

    /// The GFID of `parent/name` if it is a directory, looked up as the brick; `None` for
    /// anything else or a failed lookup (the fop that would remove it then fails itself).
    pub(super) async fn dir_gfid_at(&self, parent: &Gfid, name: &Name) -> Option<Gfid> {
        Self::check_entry(parent, name).ok()?;
        let dir = self.dir(parent).await.ok()?;
        let step = Step::brick(op::Statx::of(&dir, &cstr(name.as_bytes())));
        let stat: Stat = self.run_one(step).await.ok()?;
        if !stat.is_dir() {
            return None;
        }
        self.gfid_at(parent, &dir, name.as_bytes(), &stat)
            .await
            .ok()
    }
}
