//! The shared leases ([`Leases`]): the table behind a lock and the gate, with the LEASE
//! answer ([`Leases::grant`]) and the check every fop passes ([`Leases::admit`]).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use kiln_wire::{Gfid, LeaseKind};
use rustix::io::Errno;
use tokio::sync::{Notify, mpsc};

use super::gate::{Gate, Slot, Unarmed};
use super::listed::Cover;
use super::table::{Check, Decision, Table};
use super::{
    DRAIN_POLL, DRAIN_WAIT_MAX, LeaseSettings, LeaseStats, RECALLS_QUEUED_MAX, RecallEvents,
    Targets, lock,
};
use crate::fdtable::SessionId;

/// How a lease is asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ask {
    /// By LEASE: the kind asked, raised or lowered.
    Lease,
    /// By OPENDIR_LIST, before its listing: only where the session holds none.
    ListingWhereNone,
}

/// Why [`Leases::admit`] did not let a fop run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The fop changes a directory where the session's write lease was revoked (ESTALE).
    Stale,
    /// The fop removes a name whose object it did not look up, and another session may hold
    /// a lease on that object now: look it up and ask again.
    Unresolved,
}

/// The brick's leases and the gate in front of every fop.
#[derive(Debug, Default)]
pub struct Leases {
    gate: Gate,
    table: Mutex<Table>,
    /// Woken when a lease comes back, is revoked or dropped, or a session ends.
    changed: Notify,
}

impl Leases {
    pub fn new(settings: LeaseSettings) -> Leases {
        let leases = Leases::default();
        lock(&leases.table).settings = settings;
        leases
    }

    /// Applies changed settings (live): a new timeout applies to recalls sent from now on.
    pub fn set_settings(&self, settings: LeaseSettings) {
        lock(&self.table).settings = settings;
    }

    pub fn settings(&self) -> LeaseSettings {
        lock(&self.table).settings
    }

    pub fn stats(&self) -> LeaseStats {
        let table = lock(&self.table);
        LeaseStats {
            held: table.held as u64,
            ..table.stats
        }
    }

    /// Lets `session` hold leases and send BATCH (it negotiated `LEASES`); its RECALL events
    /// come out of the returned queue.
    pub fn attach(&self, session: SessionId) -> RecallEvents {
        let (events, queue) = mpsc::channel(RECALLS_QUEUED_MAX);
        lock(&self.table).attach(session, events);
        queue
    }

    /// Whether `session` may hold leases and send BATCH.
    pub fn is_attached(&self, session: SessionId) -> bool {
        lock(&self.table).is_attached(session)
    }

    /// Session `session` ended: its leases go and the fops waiting for them run.
    pub fn end_session(&self, session: SessionId) {
        let mut table = lock(&self.table);
        if !table.is_attached(session) {
            return;
        }
        table.detach(session, Instant::now());
        self.settle(&mut table);
        drop(table);
        self.changed.notify_waiters();
    }

    /// A counter for the fops of one worker ([`Leases::enter`]).
    pub fn slot(&self) -> Arc<Slot> {
        let slot = Arc::new(Slot::default());
        lock(&self.gate.slots).push(slot.clone());
        slot
    }

    /// Passes a fop without a check while no lease and no revoked mark exist (the guard
    /// counts it until it ends); `None`: the fop must be checked ([`Leases::admit`]).
    pub fn enter<'s>(&self, slot: &'s Slot) -> Option<Unarmed<'s>> {
        self.gate.enter(slot)
    }

    /// Whether fops are checked now.
    pub fn is_armed(&self) -> bool {
        self.gate.is_armed()
    }

    /// Waits until no other session's lease conflicts with a fop of `session` touching
    /// `targets` (recalling them), then lets it run, registered as running there when
    /// `register` (until the returned guard goes).
    pub async fn admit(
        &self,
        session: SessionId,
        mut targets: Targets,
        register: bool,
    ) -> Result<Admitted<'_>, Refused> {
        let mut waited = false;
        loop {
            let changed = self.changed.notified();
            let mut changed = std::pin::pin!(changed);
            // Enabled before the table is read, so a wake-up in between is not lost.
            changed.as_mut().enable();
            let (check, revoked) = {
                let mut table = lock(&self.table);
                let now = Instant::now();
                let revoked = table.expire(now);
                table.add_listed_in(&mut targets);
                let check = table.check(session, &targets, now);
                match check {
                    Check::Clear if register => table.register(session, &targets),
                    Check::Wait(_) if !waited => table.stats.waits += 1,
                    _ => {}
                }
                self.settle(&mut table);
                (check, revoked)
            };
            if revoked > 0 {
                self.changed.notify_waiters();
            }
            match check {
                Check::Clear => {
                    return Ok(Admitted {
                        leases: self,
                        session,
                        targets: register.then_some(targets),
                    });
                }
                Check::Stale => return Err(Refused::Stale),
                Check::Unresolved => return Err(Refused::Unresolved),
                Check::Wait(due) => {
                    waited = true;
                    let due = tokio::time::Instant::from_std(due);
                    tokio::select! {
                        () = &mut changed => {}
                        () = tokio::time::sleep_until(due) => {}
                    }
                }
            }
        }
    }

    /// Where the count of changes stands ([`Leases::cover`]): read before a listing reads
    /// the attributes of what it lists.
    pub fn changes(&self) -> u64 {
        lock(&self.table).changes
    }

    /// A listing of `dir` for `session` returned `objects`, their attributes read after the
    /// count of changes was `began`: whether the session's lease there covers them from now
    /// on (`docs/wire.md`, "Listed attributes").
    pub fn cover(&self, session: SessionId, dir: Gfid, began: u64, objects: &[Gfid]) -> Cover {
        lock(&self.table).cover(session, dir, began, objects, Instant::now())
    }

    /// LEASE `asked` on directory `gfid` for `session`: the kind it holds afterwards
    /// (`docs/wire.md`). ENOTSUP for a session that did not negotiate leases.
    pub async fn grant(
        &self,
        session: SessionId,
        gfid: Gfid,
        asked: LeaseKind,
    ) -> Result<LeaseKind, Errno> {
        self.grant_as(session, gfid, asked, Ask::Lease).await
    }

    /// The lease an OPENDIR_LIST asks before its listing (`docs/wire.md`): `asked` on
    /// directory `gfid`, taken as LEASE takes it, but only where `session` holds none there
    /// (a lease it holds, a write lease a LEASE beside the listing took included, is never
    /// lowered by it); the lease it took, none where it took none.
    pub async fn take_for_listing(
        &self,
        session: SessionId,
        gfid: Gfid,
        asked: LeaseKind,
    ) -> Result<LeaseKind, Errno> {
        self.grant_as(session, gfid, asked, Ask::ListingWhereNone)
            .await
    }

    /// Gives back the lease `took` an OPENDIR_LIST took on `gfid` for `session` when the rest
    /// of it failed: only if it is still what the session holds there (a LEASE beside it may
    /// have raised it since, and that stays).
    pub fn give_back(&self, session: SessionId, gfid: Gfid, took: LeaseKind) {
        let mut table = lock(&self.table);
        if table.holder(session, &gfid).map(|h| h.kind) != Some(took) {
            return;
        }
        table.set(session, gfid, LeaseKind::None);
        table.stats.returns += 1;
        table.tidy(&gfid, Instant::now());
        self.settle(&mut table);
        drop(table);
        self.changed.notify_waiters();
    }

    async fn grant_as(
        &self,
        session: SessionId,
        gfid: Gfid,
        asked: LeaseKind,
        ask: Ask,
    ) -> Result<LeaseKind, Errno> {
        let give_up = Instant::now() + DRAIN_WAIT_MAX;
        loop {
            if let Some(kind) = self.try_grant(session, gfid, asked, ask, give_up)? {
                return Ok(kind);
            }
            let _arming = Arming(self);
            tokio::time::sleep(DRAIN_POLL).await;
        }
    }

    /// One attempt of [`Leases::grant`]: `None` when the lease could be granted but fops that
    /// passed the disarmed gate, or other sessions' removals that did not look their object
    /// up, are still running (counted in `arming`, which the caller's `Arming` gives back).
    fn try_grant(
        &self,
        session: SessionId,
        gfid: Gfid,
        asked: LeaseKind,
        ask: Ask,
        give_up: Instant,
    ) -> Result<Option<LeaseKind>, Errno> {
        let mut table = lock(&self.table);
        if !table.is_attached(session) {
            return Err(Errno::NOTSUP);
        }
        if ask == Ask::ListingWhereNone && table.holder(session, &gfid).is_some() {
            return Ok(Some(LeaseKind::None));
        }
        let now = Instant::now();
        let mut wake = table.expire(now) > 0;
        table.clear_revoked(session, &gfid);
        let kind = match table.decide(session, &gfid, asked, now) {
            Decision::Keep(kind) => kind,
            Decision::Lower(kind) => {
                table.set(session, gfid, kind);
                table.stats.returns += 1;
                wake = true;
                kind
            }
            Decision::Raise(kind)
                if self.ready(&mut table) && !table.unresolved_by_others(session) =>
            {
                table.set(session, gfid, kind);
                table.stats.grants += 1;
                kind
            }
            Decision::Raise(_) if now < give_up => {
                table.arming += 1;
                return Ok(None);
            }
            Decision::Raise(_) => table
                .holder(session, &gfid)
                .map_or(LeaseKind::None, |h| h.kind),
        };
        table.tidy(&gfid, now);
        self.settle(&mut table);
        drop(table);
        if wake {
            self.changed.notify_waiters();
        }
        Ok(Some(kind))
    }

    /// Arms the gate if it is not, and says whether every fop that passed it disarmed has
    /// ended (a lease may be granted).
    fn ready(&self, table: &mut Table) -> bool {
        if !self.gate.is_armed() {
            table.draining = Some(self.gate.arm());
        }
        if let Some(parity) = table.draining
            && self.gate.drained(parity)
        {
            table.draining = None;
        }
        table.draining.is_none()
    }

    /// Finishes a drain that is done, and disarms the gate when nothing needs it.
    fn settle(&self, table: &mut Table) {
        if let Some(parity) = table.draining
            && self.gate.drained(parity)
        {
            table.draining = None;
        }
        let idle = table.is_quiet() && table.draining.is_none() && table.arming == 0;
        if idle && self.gate.is_armed() {
            self.gate.disarm();
        }
    }
}

/// A grant waiting for the gate's drain or for unresolved removals, for as long as this lives
/// (even if the grant is dropped meanwhile): the gate stays armed for it, and removals look
/// their object up.
struct Arming<'a>(&'a Leases);

impl Drop for Arming<'_> {
    fn drop(&mut self) {
        let mut table = lock(&self.0.table);
        table.arming -= 1;
        self.0.settle(&mut table);
    }
}

/// A fop that passed the check, registered as running in the directories it touches until
/// this goes.
#[derive(Debug)]
pub struct Admitted<'a> {
    leases: &'a Leases,
    session: SessionId,
    targets: Option<Targets>,
}

impl Admitted<'_> {
    /// The fop ended; `done`: it succeeded, so a directory it removed takes its leases along.
    pub fn finish(self, done: bool) {
        let Some(removed) = self.targets.as_ref().and_then(|t| t.removed) else {
            return;
        };
        if !done {
            return;
        }
        let mut table = lock(&self.leases.table);
        table.drop_dir(&removed, Instant::now());
        self.leases.settle(&mut table);
        drop(table);
        self.leases.changed.notify_waiters();
    }
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        if let Some(targets) = &self.targets {
            let mut table = lock(&self.leases.table);
            table.unregister(self.session, targets, Instant::now());
            self.leases.settle(&mut table);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_gate_counts_unchecked_fops_until_a_drain() {
        let leases = Leases::new(LeaseSettings::default());
        let slot = leases.slot();
        let pass = leases.enter(&slot).expect("disarmed");
        let mut table = lock(&leases.table);
        assert!(
            !leases.ready(&mut table),
            "a fop that passed unchecked is running"
        );
        assert!(leases.enter(&slot).is_none(), "armed: every fop is checked");
        drop(pass);
        assert!(leases.ready(&mut table), "drained");
        leases.settle(&mut table);
        assert!(!leases.is_armed(), "quiet: disarmed again");
        drop(table);
        assert!(leases.enter(&slot).is_some());
    }

    /// A removal that did not look its object up (no other session held a lease) holds off
    /// another session's grant until it ends, and meanwhile every removal looks up.
    #[tokio::test(flavor = "current_thread")]
    async fn a_grant_waits_for_removals_that_did_not_look_their_object_up() {
        use super::super::Access;
        let gfid = |n| Gfid::from_bytes([n; 16]).expect("not null");
        let (dir, file) = (gfid(1), gfid(2));
        let settings = LeaseSettings {
            enabled: true,
            ..LeaseSettings::default()
        };
        let leases = Leases::new(settings);
        let (_remover_events, _asker_events) = (leases.attach(1), leases.attach(2));
        assert_eq!(
            leases.grant(1, dir, LeaseKind::Write).await,
            Ok(LeaseKind::Write)
        );
        assert!(
            !lock(&leases.table).objects_wanted(1),
            "nobody else holds a lease"
        );
        let removal = || Targets::new(vec![(dir, Access::Change)], None).unresolved();
        let running = leases.admit(1, removal(), true).await.expect("admitted");
        let mut grant = Box::pin(leases.grant(2, file, LeaseKind::Read));
        let early = tokio::time::timeout(Duration::from_millis(20), &mut grant).await;
        assert!(early.is_err(), "granted while the removal runs");
        assert!(
            lock(&leases.table).objects_wanted(1),
            "a grant waits: removals look up"
        );
        let again = leases.admit(1, removal(), true).await.err();
        assert_eq!(again, Some(Refused::Unresolved));
        drop(running);
        let granted = tokio::time::timeout(Duration::from_secs(10), grant).await;
        assert_eq!(granted.expect("granted in time"), Ok(LeaseKind::Read));
        assert!(
            lock(&leases.table).objects_wanted(1),
            "another session holds a lease now"
        );
    }
}
