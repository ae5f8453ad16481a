//! Directory leases through the layer: a directory has a copy on every brick, and another
//! client changes it on whichever brick a name hashes to, so a lease on it is the same lease
//! on every copy, and a recall from any brick is the directory's recall.
//!
//! * **LEASE** on a directory is asked of every brick at once. The lease granted is the least
//!   any brick granted; a brick that granted more is lowered to it at once, so the session
//!   holds no more anywhere than the layer above was told. A brick without the directory's
//!   copy grants nothing (another client's heal could make one there unseen). Asked of
//!   every brick of the volume, it carries a read of the directory's layout after it in the
//!   same BATCH, which stays in use while the lease is held ([`super::layouts`]).
//! * **Events**: each brick's recalls and lost sessions are passed on as they come, from the
//!   moment it joins the layer (before any fop can reach it), so no recall is missed; a brick
//!   whose events fell behind loses every lease above, as its own receiver would. A recall
//!   ends the lease's hold on the directory's layout first.

use kiln_wire::{Lease, LeaseKind, LeaseReply};
use tokio::sync::broadcast::error::RecvError;

use super::layouts::Layouts;
use super::*;

/// Events waiting for the layer above before it is told it fell behind (and loses them all).
pub(super) const EVENTS_QUEUED_MAX: usize = 4096;

impl<L: Layer> Distribute<L> {
    /// LEASE `lease` on the object it names: on every brick for a directory, the least any
    /// granted (the others lowered to it); on a file's brick as it is.
    pub(super) async fn lease(&self, creds: &Creds, lease: Lease) -> Result<FopReply, Error> {
        let gfid = lease.gfid;
        if let Home::Brick(b) = self.home(creds, gfid).await? {
            return self.call_on_file(creds, gfid, b, lease.into()).await;
        }
        if lease.kind == LeaseKind::None {
            self.layouts.unleased(Some(gfid));
        }
        // Asking for one where every brick serves, the directory's layout is read with it,
        // after it, and kept as long as the lease is held.
        let with_layout =
            lease.kind != LeaseKind::None && self.bricks.in_service().count() == self.bricks.len();
        let (recalls, generation) = (self.layouts.recalls(), self.bricks.generation());
        let asked = futures_util::future::join_all(self.bricks.in_service().map(|(i, brick)| {
            let lease = lease.clone();
            async move {
                if !with_layout {
                    return (i, granted(brick.call(creds, lease.into()).await), None);
                }
                let (kind, layout) = lease_and_layout(brick, lease).await;
                (i, kind, Some(layout))
            }
        }))
        .await;
        let kinds: Vec<(usize, LeaseKind)> = asked.iter().map(|(i, kind, _)| (*i, *kind)).collect();
        let kind = self.least_lease(creds, gfid, &kinds).await;
        if kind != LeaseKind::None
            && with_layout
            && let Some(disks) = (asked.into_iter())
                .map(|(_, _, disk)| disk?.ok())
                .collect::<Option<Vec<_>>>()
            && let Some(layout) = layout_of_disks(&disks)
        {
            self.layouts
                .keep_leased(gfid, Arc::new(layout), generation, recalls);
        }
        Ok(FopReply::Lease(LeaseReply { kind }))
    }

    /// The least of the leases on directory `gfid` the bricks `asked` granted (brick,
    /// lease); a brick that granted more is lowered to it at once.
    pub(super) async fn least_lease(
        &self,
        creds: &Creds,
        gfid: Gfid,
        asked: &[(usize, LeaseKind)],
    ) -> LeaseKind {
        let least = asked
            .iter()
            .map(|(_, kind)| *kind)
            .min_by_key(|kind| rank(*kind))
            .unwrap_or(LeaseKind::None);
        for &(i, kind) in asked {
            if rank(kind) > rank(least) {
                let lower = Lease { gfid, kind: least };
                let lowered = match self.bricks.get(i) {
                    Ok(brick) => brick.call(creds, lower.into()).await,
                    Err(e) => Err(e),
                };
                if let Err(e) = lowered {
                    // (Recalled from there as any lease is, it costs another client a wait.)
                    tracing::warn!(%gfid, brick = i, error = %e, "a lease not lowered");
                }
            }
        }
        least
    }

    /// Whether every brick in service grants directory leases (and so does this layer: it
    /// passes their events on).
    pub(super) fn bricks_lease(&self) -> bool {
        self.passes_events && self.bricks.in_service().all(|(_, brick)| brick.leases())
    }

    /// Whether every brick in service recalls a lease for the attributes its listings
    /// returned.
    pub(super) fn bricks_cover_listed_attrs(&self) -> bool {
        self.bricks_lease() && self.bricks.in_service().all(|(_, b)| b.listed_attrs())
    }
}

/// LEASE `lease` on `brick` and, after it in the same BATCH, a read of the directory's
/// layout there: what it granted (none when it failed) and the layout read.
async fn lease_and_layout<L: Layer>(
    brick: &L,
    lease: Lease,
) -> (LeaseKind, Result<Option<DiskLayout>, Error>) {
    let dir = lease.gfid;
    let mut batch = Batch::new(Creds::root());
    let pushed = batch.push(lease.into()).and(batch.push(layout_read(dir)));
    let answered = match pushed {
        Ok(()) => brick.batch(batch).await,
        Err(e) => Err(Error::Misuse(e.to_string())),
    };
    let mut results = match answered {
        Ok(reply) if reply.results.len() == 2 => reply.results.into_iter(),
        Ok(_) => {
            return (
                LeaseKind::None,
                Err(Error::Protocol("a BATCH half answered".into())),
            );
        }
        Err(e) => return (LeaseKind::None, Err(e)),
    };
    let mut next = || {
        results
            .next()
            .map(|r| r.map_err(Error::Fop))
            .unwrap_or(Err(Error::Fop(ErrorCode::Io)))
    };
    let kind = granted(next());
    (kind, disk_layout_read(dir, next()))
}

/// The layout the bricks' `disks` make up, if every brick's share was read and they make one.
fn layout_of_disks(disks: &[Option<DiskLayout>]) -> Option<Layout> {
    if disks.iter().all(Option::is_none) {
        return None;
    }
    Layout::from_disk(disks).ok()
}

/// What [`Bricks`] calls with each brick that joins: its events passed on to `to` by a task
/// of `runtime`, subscribed at once; a recall, or a loss of every lease, ends the lease on the
/// layouts `layouts` keeps under it first.
pub(super) fn pass_events_on<L: Layer>(
    runtime: tokio::runtime::Handle,
    to: broadcast::Sender<LayerEvent>,
    layouts: Arc<Layouts>,
) -> bricks::Joined<L> {
    Box::new(move |brick: &L| {
        let mut from = brick.events();
        let (to, layouts) = (to.clone(), layouts.clone());
        runtime.spawn(async move {
            loop {
                let event = match from.recv().await {
                    Ok(event) => event,
                    Err(RecvError::Lagged(_)) => LayerEvent::LeasesLost,
                    Err(RecvError::Closed) => return,
                };
                match &event {
                    LayerEvent::Recall(recall) => layouts.unleased(Some(recall.gfid)),
                    LayerEvent::LeasesLost => layouts.unleased(None),
                }
                // (No one above listening: nothing to tell.)
                let _ = to.send(event);
            }
        });
    })
}

/// The lease a brick's answer to LEASE grants: none when it failed.
fn granted(answer: Result<FopReply, Error>) -> LeaseKind {
    match answer {
        Ok(FopReply::Lease(reply)) => reply.kind,
        _ => LeaseKind::None,
    }
}

/// Leases in order of what they allow.
fn rank(kind: LeaseKind) -> u8 {
    match kind {
        LeaseKind::None => 0,
        LeaseKind::Read => 1,
        LeaseKind::Write => 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_lease_is_the_one_every_brick_granted() {
        let answers = [
            Ok(FopReply::Lease(LeaseReply {
                kind: LeaseKind::Write,
            })),
            Err(Error::Fop(ErrorCode::NoEnt)),
            Ok(FopReply::Lease(LeaseReply {
                kind: LeaseKind::Read,
            })),
        ];
        let kinds: Vec<LeaseKind> = answers.into_iter().map(granted).collect();
        assert_eq!(kinds, [LeaseKind::Write, LeaseKind::None, LeaseKind::Read]);
        assert!(rank(LeaseKind::None) < rank(LeaseKind::Read));
        assert!(rank(LeaseKind::Read) < rank(LeaseKind::Write));
    }
}
