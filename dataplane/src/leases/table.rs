//! The lease table (`Table`): every lease of a brick, the recalls under way, the revoked
//! marks and the fops running, with the rules for LEASE and for the check. It is plain data:
//! time comes in as an argument, so its rules are tested without sleeping.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use kiln_wire::{Gfid, LeaseKind, Recall};
use tokio::sync::mpsc;

use super::listed::{Cover, Listed};
use super::{
    Access, DIRS_SWEEP_MIN, LEASES_PER_SESSION_MAX, LeaseSettings, LeaseStats, RECALL_TIMEOUTS_MAX,
    Targets,
};
use crate::fdtable::SessionId;

/// A lease held by a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Holder {
    session: SessionId,
    /// `Read` or `Write`, never `None`.
    pub(super) kind: LeaseKind,
    /// When the recall sent for it runs out; `None` while it is not recalled.
    recall_due: Option<Instant>,
    /// When that recall was sent.
    recalled_at: Option<Instant>,
}

/// What the table knows about one directory.
#[derive(Debug, Default)]
struct Dir {
    holders: Vec<Holder>,
    /// Sessions whose write lease here was revoked: their changes here get ESTALE until
    /// they send LEASE again.
    revoked: Vec<SessionId>,
    /// Fops that passed the check and are running, by session.
    running: Vec<(SessionId, Access)>,
    /// The last recall here and the session whose fop caused it, and the last one caused by
    /// a session other than that one: together, the last recall caused by anyone but a
    /// given session.
    recalled: Option<(SessionId, Instant)>,
    recalled_by_other: Option<(SessionId, Instant)>,
}

impl Dir {
    /// When a recall here was last caused by a session other than `session`.
    fn last_recall_not_by(&self, session: SessionId) -> Option<Instant> {
        match self.recalled {
            Some((by, at)) if by != session => Some(at),
            Some(_) => self.recalled_by_other.map(|(_, at)| at),
            None => None,
        }
    }

    fn note_recall(&mut self, by: SessionId, now: Instant) {
        if let Some(last) = self.recalled
            && last.0 != by
        {
            self.recalled_by_other = Some(last);
        }
        self.recalled = Some((by, now));
    }

    /// Nothing left worth keeping: no lease, mark or running fop, and no recall recent
    /// enough to refuse a grant.
    fn is_idle(&self, now: Instant, contention: Duration) -> bool {
        self.holders.is_empty()
            && self.revoked.is_empty()
            && self.running.is_empty()
            && self
                .recalled
                .is_none_or(|(_, at)| now.saturating_duration_since(at) >= contention)
    }
}

/// A session that may hold leases (it negotiated `LEASES`).
#[derive(Debug)]
struct Attached {
    events: mpsc::Sender<Recall>,
    /// Directories where it holds a lease or has a revoked mark.
    dirs: HashSet<Gfid>,
    held: usize,
    /// Directories where a lease of its was recalled (those back or revoked since are
    /// dropped at its next fop).
    recalling: Vec<Gfid>,
}

/// What a LEASE request leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Decision {
    /// Answer this kind (what is held now); nothing changes.
    Keep(LeaseKind),
    /// Hold this smaller kind (none: the lease goes).
    Lower(LeaseKind),
    /// Grant this larger kind.
    Raise(LeaseKind),
}

/// What the check found for one fop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Check {
    Clear,
    /// The fop changes a directory where the session's write lease was revoked.
    Stale,
    /// Conflicting leases are recalled; the first recall runs out at this instant.
    Wait(Instant),
    /// The fop removes a name whose object it did not look up, and that object may be under
    /// another session's lease now ([`Table::objects_wanted`]): look it up and ask again.
    Unresolved,
}

/// Every lease of a brick, plain data.
#[derive(Debug, Default)]
pub(super) struct Table {
    pub(super) settings: LeaseSettings,
    dirs: HashMap<Gfid, Dir>,
    sessions: HashMap<SessionId, Attached>,
    /// Leases held and revoked marks, over all directories.
    pub(super) held: usize,
    revoked: usize,
    /// The earliest recall deadline, if any recall is under way (maybe earlier than the
    /// real one once that lease came back: then the scan finds nothing and recomputes it).
    next_due: Option<Instant>,
    /// Gate parity whose fops must end before a lease may be granted.
    pub(super) draining: Option<usize>,
    /// Grants waiting for that drain, or for `unresolved`'s removals to end: the gate stays
    /// armed for them.
    pub(super) arming: usize,
    /// The sessions of running fops that remove a name whose object was not looked up, one
    /// entry per fop ([`Targets::unresolved`]).
    unresolved: Vec<SessionId>,
    /// Directory count after the last sweep.
    swept_at: usize,
    /// What listings under leases returned.
    listed: Listed,
    /// Moves on when a fop that changes an object starts and when it ends: a listing that
    /// saw it move may have read attributes as they were before a change.
    pub(super) changes: u64,
    pub(super) stats: LeaseStats,
}

fn rank(kind: LeaseKind) -> u8 {
    kind as u8
}

/// Whether a lease of `kind` held by another session conflicts with a fop that `access`es
/// its directory.
fn conflicts(kind: LeaseKind, access: Access) -> bool {
    kind == LeaseKind::Write || (kind == LeaseKind::Read && access == Access::Change)
}

impl Table {
    pub(super) fn attach(&mut self, session: SessionId, events: mpsc::Sender<Recall>) {
        let attached = Attached {
            events,
            dirs: HashSet::new(),
            held: 0,
            recalling: Vec::new(),
        };
        let replaced = self.sessions.insert(session, attached);
        debug_assert!(replaced.is_none(), "session {session} attached twice");
    }

    pub(super) fn is_attached(&self, session: SessionId) -> bool {
        self.sessions.contains_key(&session)
    }

    /// Whether nothing needs the gate armed: no lease and no revoked mark.
    pub(super) fn is_quiet(&self) -> bool {
        self.held == 0 && self.revoked == 0
    }

    /// Whether a fop of `session` that removes a name must look its object up for the check:
    /// another session holds a lease (on the object, or on a directory that listed it,
    /// perhaps), or a grant waits for such fops to end.
    pub(super) fn objects_wanted(&self, session: SessionId) -> bool {
        let own = self.sessions.get(&session).map_or(0, |s| s.held);
        self.held > own || self.arming > 0
    }

    /// Whether a fop of another session than `session` that removes a name whose object was
    /// not looked up is running: no lease is granted to `session` until it ends.
    pub(super) fn unresolved_by_others(&self, session: SessionId) -> bool {
        self.unresolved.iter().any(|&s| s != session)
    }

    pub(super) fn holder(&self, session: SessionId, gfid: &Gfid) -> Option<&Holder> {
        let dir = self.dirs.get(gfid)?;
        dir.holders.iter().find(|h| h.session == session)
    }

    /// What LEASE `asked` on `gfid` from `session` would do now.
    pub(super) fn decide(
        &self,
        session: SessionId,
        gfid: &Gfid,
        asked: LeaseKind,
        now: Instant,
    ) -> Decision {
        let own = self.holder(session, gfid);
        let held = own.map_or(LeaseKind::None, |h| h.kind);
        let asked = if self.settings.enabled {
            asked
        } else {
            LeaseKind::None
        };
        if rank(asked) == rank(held) {
            return Decision::Keep(held);
        }
        if rank(asked) < rank(held) {
            return Decision::Lower(asked);
        }
        let Some(dir) = self.dirs.get(gfid) else {
            return match self.room_for(session, held) {
                true => Decision::Raise(asked),
                false => Decision::Keep(held),
            };
        };
        let write = asked == LeaseKind::Write;
        let others_in_the_way = dir
            .holders
            .iter()
            .any(|h| h.session != session && (write || h.kind == LeaseKind::Write));
        let recall_under_way = dir.holders.iter().any(|h| h.recall_due.is_some());
        let contended = dir
            .last_recall_not_by(session)
            .is_some_and(|at| now.saturating_duration_since(at) < self.settings.contention);
        let running_in_the_way = dir
            .running
            .iter()
            .any(|&(s, access)| s != session && (write || access == Access::Change));
        if others_in_the_way
            || recall_under_way
            || contended
            || running_in_the_way
            || !self.room_for(session, held)
        {
            return Decision::Keep(held);
        }
        Decision::Raise(asked)
    }

    /// Whether `session`, holding `held` on a directory, may hold one more lease there.
    fn room_for(&self, session: SessionId, held: LeaseKind) -> bool {
        held != LeaseKind::None
            || self
                .sessions
                .get(&session)
                .is_some_and(|s| s.held < LEASES_PER_SESSION_MAX)
    }

    /// Clears `session`'s revoked mark on `gfid` (it sent LEASE for it); whether there was one.
    pub(super) fn clear_revoked(&mut self, session: SessionId, gfid: &Gfid) -> bool {
        let Some(dir) = self.dirs.get_mut(gfid) else {
            return false;
        };
        let Some(at) = dir.revoked.iter().position(|&s| s == session) else {
            return false;
        };
        dir.revoked.swap_remove(at);
        self.revoked -= 1;
        let holds = dir.holders.iter().any(|h| h.session == session);
        if !holds && let Some(attached) = self.sessions.get_mut(&session) {
            attached.dirs.remove(gfid);
        }
        true
    }

    /// Makes `session` hold `kind` on `gfid` (none: no lease).
    pub(super) fn set(&mut self, session: SessionId, gfid: Gfid, kind: LeaseKind) {
        let Some(attached) = self.sessions.get_mut(&session) else {
            debug_assert!(
                false,
                "a lease for session {session}, which is not attached"
            );
            return;
        };
        let dir = self.dirs.entry(gfid).or_default();
        let at = dir.holders.iter().position(|h| h.session == session);
        match (at, kind) {
            (None, LeaseKind::None) => {}
            (Some(at), LeaseKind::None) => {
                dir.holders.swap_remove(at);
                attached.held -= 1;
                self.held -= 1;
                if !dir.revoked.contains(&session) {
                    attached.dirs.remove(&gfid);
                }
            }
            (Some(at), kind) => dir.holders[at].kind = kind,
            (None, kind) => {
                dir.holders.push(Holder {
                    session,
                    kind,
                    recall_due: None,
                    recalled_at: None,
                });
                attached.dirs.insert(gfid);
                attached.held += 1;
                self.held += 1;
            }
        }
    }

    /// What a fop of `session` touching `targets` meets: a revoked mark of its own where it
    /// changes something, leases of others to recall (each recalled once: its holder gets a
    /// RECALL event now), or nothing.
    pub(super) fn check(&mut self, session: SessionId, targets: &Targets, now: Instant) -> Check {
        let stale = targets.dirs.iter().any(|(gfid, access)| {
            *access == Access::Change
                && self
                    .dirs
                    .get(gfid)
                    .is_some_and(|d| d.revoked.contains(&session))
        });
        if stale {
            return Check::Stale;
        }
        if targets.unresolved && self.objects_wanted(session) {
            return Check::Unresolved;
        }
        self.renew_recalls(session, now);
        let mut first_due: Option<Instant> = None;
        for (gfid, access) in targets.all() {
            let Some(dir) = self.dirs.get(&gfid) else {
                continue;
            };
            let in_the_way: Vec<(SessionId, bool)> = (dir.holders.iter())
                .filter(|h| h.session != session && conflicts(h.kind, access))
                .map(|h| (h.session, h.recall_due.is_none()))
                .collect();
            let mut recalled = false;
            for (holder, first) in in_the_way {
                recalled |= first;
                if let Some(due) = self.recall(gfid, holder, now) {
                    first_due = Some(first_due.map_or(due, |d| d.min(due)));
                }
            }
            if recalled && let Some(dir) = self.dirs.get_mut(&gfid) {
                dir.note_recall(session, now);
            }
        }
        match first_due {
            Some(due) => Check::Wait(due),
            None => Check::Clear,
        }
    }

    /// Recalls `holder`'s lease on `gfid` — sends RECALL and starts its timeout — unless it is
    /// recalled already; when the recall runs out (`None`: no such lease).
    fn recall(&mut self, gfid: Gfid, holder: SessionId, now: Instant) -> Option<Instant> {
        let timeout = self.settings.recall_timeout;
        let dir = self.dirs.get_mut(&gfid)?;
        let lease = dir.holders.iter_mut().find(|h| h.session == holder)?;
        if let Some(due) = lease.recall_due {
            return Some(due);
        }
        let due = now + timeout;
        lease.recall_due = Some(due);
        lease.recalled_at = Some(now);
        if let Some(attached) = self.sessions.get_mut(&holder) {
            attached.recalling.push(gfid);
        }
        self.stats.recalls += 1;
        self.next_due = Some(self.next_due.map_or(due, |d| d.min(due)));
        send_recall(&self.sessions, holder, gfid);
        Some(due)
    }

    /// Adds to `targets` the directories where a listing under a lease returned an object
    /// the fop changes.
    pub(super) fn add_listed_in(&self, targets: &mut Targets) {
        let mut listed_in = Vec::new();
        for object in targets.changed() {
            for dir in self.listed.dirs_of(object) {
                let touched = targets.dirs.contains(&(*dir, Access::Change));
                if !touched && !listed_in.contains(dir) {
                    listed_in.push(*dir);
                }
            }
        }
        targets.listed_in = listed_in;
    }

    /// A listing of `dir` for `session` returned `objects`, their attributes read after
    /// [`Table::changes`] was `began`: whether `session`'s lease there covers them. Where
    /// another session's fop is changing one of them, or the index is full, the lease is
    /// recalled instead.
    pub(super) fn cover(
        &mut self,
        session: SessionId,
        dir: Gfid,
        began: u64,
        objects: &[Gfid],
        now: Instant,
    ) -> Cover {
        if self.holder(session, &dir).is_none() {
            return Cover::Uncovered;
        }
        let changing = |object: &Gfid| {
            self.dirs.get(object).is_some_and(|d| {
                (d.running.iter()).any(|&(s, a)| s != session && a == Access::Change)
            })
        };
        if objects.iter().any(changing) || !self.listed.insert(dir, objects) {
            self.recall(dir, session, now);
            if let Some(dir) = self.dirs.get_mut(&dir) {
                dir.note_recall(session, now);
            }
            return Cover::Uncovered;
        }
        match self.changes == began {
            true => Cover::Covered,
            false => Cover::Restat,
        }
    }

    /// A fop of `session` shows it alive and giving back: the recalls of its leases run out
    /// a full timeout from `now`, at most [`RECALL_TIMEOUTS_MAX`] timeouts after each recall.
    fn renew_recalls(&mut self, session: SessionId, now: Instant) {
        let Some(attached) = self.sessions.get_mut(&session) else {
            return;
        };
        let (dirs, timeout) = (&mut self.dirs, self.settings.recall_timeout);
        attached.recalling.retain(|gfid| {
            let holder = dirs
                .get_mut(gfid)
                .and_then(|d| d.holders.iter_mut().find(|h| h.session == session));
            let Some(holder) = holder else {
                return false;
            };
            let (Some(due), Some(at)) = (holder.recall_due, holder.recalled_at) else {
                return false;
            };
            let last = at + timeout * RECALL_TIMEOUTS_MAX;
            holder.recall_due = Some((now + timeout).min(last).max(due));
            true
        });
    }

    pub(super) fn register(&mut self, session: SessionId, targets: &Targets) {
        self.count_change(targets);
        if targets.unresolved {
            self.unresolved.push(session);
        }
        for (gfid, access) in targets.all() {
            self.dirs
                .entry(gfid)
                .or_default()
                .running
                .push((session, access));
        }
    }

    pub(super) fn unregister(&mut self, session: SessionId, targets: &Targets, now: Instant) {
        self.count_change(targets);
        if targets.unresolved
            && let Some(at) = self.unresolved.iter().position(|&s| s == session)
        {
            self.unresolved.swap_remove(at);
        }
        for (gfid, access) in targets.all() {
            let Some(dir) = self.dirs.get_mut(&gfid) else {
                continue;
            };
            if let Some(at) = dir.running.iter().position(|r| *r == (session, access)) {
                dir.running.swap_remove(at);
            }
            self.tidy(&gfid, now);
        }
    }

    fn count_change(&mut self, targets: &Targets) {
        if targets.changed().next().is_some() {
            self.changes += 1;
        }
    }

    /// Revokes every recalled lease whose recall ran out by `now`; how many. A revoked write
    /// lease leaves its holder a mark there: changes it meant to send under the lease, still
    /// to come, fail instead of landing late. A read lease had none; its holder's later
    /// fops there are as anyone's.
    pub(super) fn expire(&mut self, now: Instant) -> usize {
        if self.next_due.is_none_or(|due| now < due) {
            return 0;
        }
        let (mut revoked, mut marked) = (0, 0);
        let mut next_due: Option<Instant> = None;
        let mut unheld = Vec::new();
        for (gfid, dir) in &mut self.dirs {
            let held = dir.holders.len();
            let mut i = 0;
            while i < dir.holders.len() {
                let holder = dir.holders[i];
                match holder.recall_due {
                    Some(due) if due <= now => {
                        dir.holders.swap_remove(i);
                        let mark = holder.kind == LeaseKind::Write;
                        if mark {
                            dir.revoked.push(holder.session);
                            marked += 1;
                        }
                        if let Some(attached) = self.sessions.get_mut(&holder.session) {
                            attached.held -= 1;
                            if !mark {
                                attached.dirs.remove(gfid);
                            }
                        }
                        let session = holder.session;
                        tracing::info!(session, %gfid, "lease revoked: not back in time");
                        revoked += 1;
                        continue;
                    }
                    Some(due) => next_due = Some(next_due.map_or(due, |d| d.min(due))),
                    None => {}
                }
                i += 1;
            }
            if held > 0 && dir.holders.is_empty() {
                unheld.push(*gfid);
            }
        }
        for gfid in &unheld {
            self.listed.forget_dir(gfid);
        }
        self.next_due = next_due;
        self.held -= revoked;
        self.revoked += marked;
        self.stats.revocations += revoked as u64;
        revoked
    }

    /// Directory `gfid` is gone: its leases and marks with it.
    pub(super) fn drop_dir(&mut self, gfid: &Gfid, now: Instant) {
        let Some(dir) = self.dirs.get_mut(gfid) else {
            return;
        };
        for holder in dir.holders.drain(..) {
            if let Some(attached) = self.sessions.get_mut(&holder.session) {
                attached.held -= 1;
                attached.dirs.remove(gfid);
            }
            self.held -= 1;
        }
        for session in dir.revoked.drain(..) {
            if let Some(attached) = self.sessions.get_mut(&session) {
                attached.dirs.remove(gfid);
            }
            self.revoked -= 1;
        }
        self.tidy(gfid, now);
    }

    /// Session `session` ended: its leases and marks go.
    pub(super) fn detach(&mut self, session: SessionId, now: Instant) {
        let Some(attached) = self.sessions.remove(&session) else {
            return;
        };
        for gfid in &attached.dirs {
            let Some(dir) = self.dirs.get_mut(gfid) else {
                continue;
            };
            let before = (dir.holders.len(), dir.revoked.len());
            dir.holders.retain(|h| h.session != session);
            dir.revoked.retain(|&s| s != session);
            self.held -= before.0 - dir.holders.len();
            self.revoked -= before.1 - dir.revoked.len();
            self.tidy(gfid, now);
        }
    }

    /// Forgets directory `gfid` if nothing about it is worth keeping; sweeps every idle one
    /// when the table has doubled since the last sweep.
    pub(super) fn tidy(&mut self, gfid: &Gfid, now: Instant) {
        let contention = self.settings.contention;
        let dir = self.dirs.get(gfid);
        if dir.is_none_or(|d| d.holders.is_empty()) {
            self.listed.forget_dir(gfid);
        }
        if dir.is_some_and(|d| d.is_idle(now, contention)) {
            self.dirs.remove(gfid);
        }
        if self.dirs.len() >= DIRS_SWEEP_MIN.max(2 * self.swept_at) {
            self.dirs.retain(|_, d| !d.is_idle(now, contention));
            self.swept_at = self.dirs.len();
        }
    }
}

/// Queues RECALL (keep none) of `gfid` for `holder`'s connection. A full or closed queue
/// loses it: the lease is then revoked when the recall runs out, as for a holder that does
/// not answer.
fn send_recall(sessions: &HashMap<SessionId, Attached>, holder: SessionId, gfid: Gfid) {
    let recall = Recall {
        gfid,
        kind: LeaseKind::None,
    };
    let sent = sessions
        .get(&holder)
        .is_some_and(|s| s.events.try_send(recall).is_ok());
    if !sent {
        tracing::debug!(session = holder, %gfid, "recall not queued: event queue full or closed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::leases::{RECALLS_QUEUED_MAX, RecallEvents};
    use LeaseKind::{None as No, Read, Write};

    const TIMEOUT: Duration = Duration::from_millis(100);
    const CONTENTION: Duration = Duration::from_millis(50);

    fn gfid(n: u8) -> Gfid {
        Gfid::from_bytes([n; 16]).expect("not null")
    }

    fn table(sessions: &[SessionId]) -> (Table, Vec<RecallEvents>) {
        let mut table = Table {
            settings: LeaseSettings {
                enabled: true,
                recall_timeout: TIMEOUT,
                contention: CONTENTION,
            },
            ..Table::default()
        };
        let queues = sessions
            .iter()
            .map(|&s| {
                let (tx, rx) = mpsc::channel(RECALLS_QUEUED_MAX);
                table.attach(s, tx);
                rx
            })
            .collect();
        (table, queues)
    }

    /// LEASE as the shared [`Leases::grant`] applies it, with a drained gate.
    fn lease(t: &mut Table, s: SessionId, g: Gfid, asked: LeaseKind, now: Instant) -> LeaseKind {
        t.clear_revoked(s, &g);
        match t.decide(s, &g, asked, now) {
            Decision::Keep(kind) => kind,
            Decision::Lower(kind) | Decision::Raise(kind) => {
                t.set(s, g, kind);
                kind
            }
        }
    }

    /// The instant a fop held for recalls waits until.
    fn waits(check: Check) -> Instant {
        match check {
            Check::Wait(due) => due,
            other => panic!("no wait: {other:?}"),
        }
    }

    fn on(g: Gfid, access: Access) -> Targets {
        Targets::new(vec![(g, access)], None)
    }

    #[test]
    fn write_is_exclusive_and_read_is_shared() {
        let (mut t, _q) = table(&[1, 2, 3]);
        let (d, now) = (gfid(1), Instant::now());
        assert_eq!(lease(&mut t, 1, d, Read, now), Read);
        assert_eq!(lease(&mut t, 2, d, Read, now), Read, "read is shared");
        assert_eq!(
            lease(&mut t, 3, d, Write, now),
            No,
            "write needs nobody else there"
        );
        assert_eq!(
            lease(&mut t, 1, d, Write, now),
            Read,
            "an upgrade past a reader is refused"
        );
        assert_eq!(lease(&mut t, 2, d, No, now), No);
        assert_eq!(
            lease(&mut t, 1, d, Write, now),
            Write,
            "alone: the upgrade is granted"
        );
        assert_eq!(
            lease(&mut t, 2, d, Read, now),
            No,
            "a writer keeps readers out"
        );
        assert_eq!(
            lease(&mut t, 1, d, Read, now),
            Read,
            "asking read while writing downgrades"
        );
        assert_eq!(t.held, 1);
    }

    #[test]
    fn a_grant_never_recalls() {
        let (mut t, mut q) = table(&[1, 2]);
        let (d, now) = (gfid(1), Instant::now());
        assert_eq!(lease(&mut t, 1, d, Write, now), Write);
        assert_eq!(lease(&mut t, 2, d, Write, now), No);
        assert!(q[0].try_recv().is_err(), "no recall for a refused grant");
        assert_eq!(t.holder(1, &d).map(|h| h.recall_due), Some(None));
    }

    #[test]
    fn conflicts_recall_once_and_wait_until_the_lease_is_back() {
        let (mut t, mut q) = table(&[1, 2]);
        let (d, now) = (gfid(1), Instant::now());
        lease(&mut t, 1, d, Read, now);
        assert_eq!(
            t.check(2, &on(d, Access::Look), now),
            Check::Clear,
            "reads share"
        );
        assert_eq!(
            t.check(1, &on(d, Access::Change), now),
            Check::Clear,
            "own lease"
        );
        let due = now + TIMEOUT;
        assert_eq!(t.check(2, &on(d, Access::Change), now), Check::Wait(due));
        assert_eq!(
            q[0].try_recv().ok(),
            Some(Recall { gfid: d, kind: No }),
            "the holder is told"
        );
        let later = now + Duration::from_millis(10);
        assert_eq!(t.check(2, &on(d, Access::Change), later), Check::Wait(due));
        assert!(q[0].try_recv().is_err(), "one recall per lease");
        assert_eq!(lease(&mut t, 1, d, No, later), No);
        assert_eq!(t.check(2, &on(d, Access::Change), later), Check::Clear);
        assert_eq!(t.stats.recalls, 1);
    }

    #[test]
    fn a_write_lease_conflicts_with_any_fop() {
        let (mut t, mut q) = table(&[1, 2]);
        let (d, now) = (gfid(1), Instant::now());
        lease(&mut t, 1, d, Write, now);
        assert!(matches!(
            t.check(2, &on(d, Access::Look), now),
            Check::Wait(_)
        ));
        assert!(q[0].try_recv().is_ok());
        let other = on(gfid(2), Access::Change);
        assert_eq!(
            t.check(2, &other, now),
            Check::Clear,
            "other directories are free"
        );
    }

    #[test]
    fn no_grant_while_a_recall_is_under_way_or_within_the_contention_window() {
        let (mut t, _q) = table(&[1, 2, 3]);
        let (d, now) = (gfid(1), Instant::now());
        lease(&mut t, 1, d, Read, now);
        assert!(matches!(
            t.check(2, &on(d, Access::Change), now),
            Check::Wait(_)
        ));
        assert_eq!(lease(&mut t, 3, d, Read, now), No, "a recall is under way");
        assert_eq!(
            lease(&mut t, 1, d, Write, now),
            Read,
            "no upgrade of a recalled lease"
        );
        assert_eq!(lease(&mut t, 1, d, No, now), No);
        let soon = now + CONTENTION / 2;
        assert_eq!(lease(&mut t, 1, d, Read, soon), No, "within the window");
        assert_eq!(
            lease(&mut t, 3, d, Read, soon),
            No,
            "for every other session"
        );
        assert_eq!(
            lease(&mut t, 2, d, Read, soon),
            Read,
            "the session whose fop caused the recall is not held off by it"
        );
        lease(&mut t, 2, d, No, soon);
        let after = now + CONTENTION;
        assert_eq!(
            lease(&mut t, 1, d, Read, after),
            Read,
            "the window has passed"
        );
    }

    #[test]
    fn the_window_remembers_the_last_recall_by_anyone_else() {
        let (mut t, _q) = table(&[1, 2, 3]);
        let (d, now) = (gfid(1), Instant::now());
        lease(&mut t, 1, d, Read, now);
        assert!(matches!(
            t.check(3, &on(d, Access::Change), now),
            Check::Wait(_)
        ));
        lease(&mut t, 1, d, No, now);
        // Session 2 takes and loses a lease to session 1 later: the last recall is now by 1.
        let t1 = now + Duration::from_millis(60);
        assert_eq!(lease(&mut t, 2, d, Read, t1), Read);
        assert!(matches!(
            t.check(1, &on(d, Access::Change), t1),
            Check::Wait(_)
        ));
        lease(&mut t, 2, d, No, t1);
        let t2 = t1 + Duration::from_millis(10);
        assert_eq!(
            lease(&mut t, 1, d, Read, t2),
            Read,
            "1 caused the last recall"
        );
        lease(&mut t, 1, d, No, t2);
        assert_eq!(
            lease(&mut t, 3, d, Read, t2),
            No,
            "1's recall is within the window"
        );
    }

    #[test]
    fn a_running_fop_of_another_session_holds_grants_off() {
        let (mut t, _q) = table(&[1, 2]);
        let (d, now) = (gfid(1), Instant::now());
        let look = on(d, Access::Look);
        t.register(2, &look);
        assert_eq!(
            lease(&mut t, 1, d, Write, now),
            No,
            "a write lease needs nothing running"
        );
        assert_eq!(
            lease(&mut t, 1, d, Read, now),
            Read,
            "a read lease only no change"
        );
        lease(&mut t, 1, d, No, now);
        t.unregister(2, &look, now);
        let change = on(d, Access::Change);
        t.register(2, &change);
        assert_eq!(lease(&mut t, 1, d, Read, now), No);
        t.unregister(2, &change, now);
        assert_eq!(lease(&mut t, 1, d, Write, now), Write);
        assert!(t.dirs[&d].running.is_empty());
    }

    #[test]
    fn a_holder_sending_fops_keeps_its_recalled_lease_up_to_the_bound() {
        let (mut t, _q) = table(&[1, 2]);
        let (d, elsewhere, now) = (gfid(1), gfid(2), Instant::now());
        lease(&mut t, 1, d, Write, now);
        let due = waits(t.check(2, &on(d, Access::Look), now));
        // Its queued changes, in any directory, reach the brick: each one renews.
        let later = due - Duration::from_millis(1);
        assert_eq!(
            t.check(1, &on(elsewhere, Access::Change), later),
            Check::Clear
        );
        assert_eq!(t.expire(due), 0, "renewed");
        let renewed = later + TIMEOUT;
        assert_eq!(t.check(2, &on(d, Access::Look), due), Check::Wait(renewed));
        // Never past the bound, however busy.
        let last = now + TIMEOUT * RECALL_TIMEOUTS_MAX;
        let mut at = renewed;
        while at < last {
            t.check(1, &on(elsewhere, Access::Change), at);
            at += TIMEOUT / 2;
        }
        assert_eq!(t.check(2, &on(d, Access::Look), last), Check::Wait(last));
        assert_eq!(t.expire(last), 1);
        assert_eq!(t.check(2, &on(d, Access::Look), last), Check::Clear);
    }

    #[test]
    fn an_unanswered_recall_revokes_and_the_holder_gets_estale_until_it_asks_again() {
        let (mut t, _q) = table(&[1, 2]);
        let (d, now) = (gfid(1), Instant::now());
        lease(&mut t, 1, d, Write, now);
        let due = waits(t.check(2, &on(d, Access::Look), now));
        assert_eq!(t.expire(due - Duration::from_millis(1)), 0, "not yet");
        assert_eq!(t.expire(due), 1);
        assert_eq!((t.held, t.revoked, t.stats.revocations), (0, 1, 1));
        assert_eq!(t.check(2, &on(d, Access::Look), due), Check::Clear);
        assert_eq!(t.check(1, &on(d, Access::Change), due), Check::Stale);
        assert_eq!(
            t.check(1, &on(d, Access::Look), due),
            Check::Clear,
            "reads go on"
        );
        assert_eq!(t.check(1, &on(gfid(2), Access::Change), due), Check::Clear);
        assert_eq!(lease(&mut t, 1, d, No, due), No, "LEASE clears the mark");
        assert_eq!(t.check(1, &on(d, Access::Change), due), Check::Clear);
        assert!(t.is_quiet());
    }

    #[test]
    fn a_revoked_read_lease_leaves_no_mark() {
        let (mut t, _q) = table(&[1, 2]);
        let (d, now) = (gfid(1), Instant::now());
        lease(&mut t, 1, d, Read, now);
        let due = waits(t.check(2, &on(d, Access::Change), now));
        assert_eq!(t.expire(due), 1);
        assert_eq!((t.held, t.revoked, t.stats.revocations), (0, 0, 1));
        assert_eq!(t.check(1, &on(d, Access::Change), due), Check::Clear);
        assert!(t.sessions[&1].dirs.is_empty());
        assert!(t.is_quiet());
    }

    #[test]
    fn a_session_end_and_a_removal_drop_leases() {
        let (mut t, _q) = table(&[1, 2]);
        let (d, e, now) = (gfid(1), gfid(2), Instant::now());
        lease(&mut t, 1, d, Read, now);
        lease(&mut t, 1, e, Read, now);
        lease(&mut t, 2, d, Read, now);
        t.detach(1, now);
        assert!(!t.is_attached(1));
        assert_eq!(t.held, 1);
        assert!(t.holder(1, &d).is_none() && t.holder(1, &e).is_none());
        t.drop_dir(&d, now);
        assert!(t.is_quiet());
        assert!(t.sessions[&2].dirs.is_empty());
        assert!(t.dirs.is_empty(), "nothing kept for idle directories");
    }

    #[test]
    fn leases_off_answers_none_and_gives_back_what_is_held() {
        let (mut t, _q) = table(&[1]);
        let (d, now) = (gfid(1), Instant::now());
        lease(&mut t, 1, d, Read, now);
        t.settings.enabled = false;
        assert_eq!(lease(&mut t, 1, d, Write, now), No);
        assert!(t.is_quiet());
    }

    #[test]
    fn a_session_holds_a_bounded_number_of_leases() {
        let (mut t, _q) = table(&[1]);
        let now = Instant::now();
        t.sessions.get_mut(&1).expect("attached").held = LEASES_PER_SESSION_MAX;
        assert_eq!(lease(&mut t, 1, gfid(1), Read, now), No);
    }

    /// The check as the shared [`Leases::admit`] makes it.
    fn admit(t: &mut Table, s: SessionId, mut targets: Targets, now: Instant) -> Check {
        t.add_listed_in(&mut targets);
        let check = t.check(s, &targets, now);
        if check == Check::Clear {
            t.register(s, &targets);
            t.unregister(s, &targets, now);
        }
        check
    }

    #[test]
    fn a_change_to_a_listed_object_recalls_the_leases_it_was_listed_under() {
        let (mut t, mut q) = table(&[1, 2]);
        let (d, file, now) = (gfid(1), gfid(2), Instant::now());
        lease(&mut t, 1, d, Read, now);
        let began = t.changes;
        assert_eq!(t.cover(1, d, began, &[file], now), Cover::Covered);
        assert_eq!(
            admit(&mut t, 2, on(file, Access::Look), now),
            Check::Clear,
            "looking changes nothing"
        );
        assert_eq!(
            admit(&mut t, 1, on(file, Access::Change), now),
            Check::Clear,
            "the holder's own change: its mount knows"
        );
        assert!(q[0].try_recv().is_err());
        assert!(matches!(
            admit(&mut t, 2, on(file, Access::Change), now),
            Check::Wait(_)
        ));
        assert_eq!(q[0].try_recv().ok(), Some(Recall { gfid: d, kind: No }));
        lease(&mut t, 1, d, No, now);
        assert_eq!(
            admit(&mut t, 2, on(file, Access::Change), now),
            Check::Clear,
            "back: the change runs"
        );
        assert_eq!(t.listed.len(), 0, "the index forgets an unheld directory");
    }

    #[test]
    fn a_listing_that_may_have_raced_a_change_reads_again_or_is_not_covered() {
        let (mut t, mut q) = table(&[1, 2]);
        let (d, x, y, now) = (gfid(1), gfid(2), gfid(3), Instant::now());
        assert_eq!(
            t.cover(1, d, t.changes, &[x], now),
            Cover::Uncovered,
            "no lease"
        );
        lease(&mut t, 1, d, Read, now);
        let began = t.changes;
        admit(&mut t, 2, on(y, Access::Change), now);
        assert_eq!(
            t.cover(1, d, began, &[x], now),
            Cover::Restat,
            "a change began and ended while the listing read"
        );
        let running = on(x, Access::Change);
        t.register(2, &running);
        assert_eq!(t.cover(1, d, t.changes, &[x], now), Cover::Uncovered);
        assert_eq!(
            q[0].try_recv().ok(),
            Some(Recall { gfid: d, kind: No }),
            "the lease whose listing read a changing object is recalled"
        );
        t.unregister(2, &running, now);
    }
}
