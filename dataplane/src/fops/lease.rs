//! LEASE (and OPENDIR_LIST's lease), and what the lease check needs from the disk: the
//! directory an RMDIR or a replacing RENAME would remove. The lease rules themselves are [`crate::leases`]'s.

use kiln_wire::{Gfid, Lease, LeaseKind, LeaseReply, Name};
use rustix::io::Errno;

use super::{Fops, R};
use crate::exec::Exec;
use crate::fdtable::SessionId;
use crate::op::{self, Stat, Step, cstr};

impl<E: Exec> Fops<E> {
    /// LEASE: asks for a lease on directory `gfid` (ENOTDIR for anything else, ESTALE when it
    /// is gone) or gives one back (kind none, which needs no directory: a removed one's
    /// leases are gone already). ENOTSUP for a session that did not negotiate leases.
    pub(super) async fn lease(&self, session: SessionId, r: Lease) -> R<LeaseReply> {
        let leases = &self.shared.leases;
        if !leases.is_attached(session) {
            return Err(Errno::NOTSUP);
        }
        if r.kind != LeaseKind::None && !self.stat_gfid(&r.gfid).await?.is_dir() {
            return Err(Errno::NOTDIR);
        }
        let kind = leases.grant(session, r.gfid, r.kind).await?;
        Ok(LeaseReply { kind })
    }

    /// The lease OPENDIR_LIST asked on directory `gfid` before its listing, as LEASE would
    /// grant it: what is granted, none where LEASE would fail.
    pub(super) async fn lease_before_listing(
        &self,
        session: SessionId,
        gfid: Gfid,
        kind: LeaseKind,
    ) -> LeaseKind {
        if kind == LeaseKind::None {
            return kind;
        }
        match self.lease(session, Lease { gfid, kind }).await {
            Ok(reply) => reply.kind,
            Err(_) => LeaseKind::None,
        }
    }

    /// Gives back the lease an OPENDIR_LIST took when the rest of it failed: the client never
    /// learns of it.
    pub(super) async fn give_back(&self, session: SessionId, gfid: Gfid) {
        let none = Lease {
            gfid,
            kind: LeaseKind::None,
        };
        let _ = self.lease(session, none).await;
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
