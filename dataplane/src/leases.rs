//! Directory leases (`docs/wire.md`, "Leases"): which session holds which lease on which
//! directory, the recalls under way, the revoked marks, and the check every fop passes before
//! it runs. One [`Leases`] is shared by every worker of a brick.
//!
//! * **Grants** ([`Leases::grant`]) never recall: a lease is granted only when nothing is in
//!   the way — no other session's conflicting lease, no recall of that directory under way,
//!   no recall there caused by another session within `features.lease-contention-ms`, no
//!   other session's conflicting fop running there. Otherwise the answer is less than asked.
//! * **The check** ([`Leases::admit`]) finds the other sessions' leases a fop conflicts with
//!   (a write lease: any fop; a read lease: a fop that changes the directory), sends each
//!   holder a RECALL once, and waits — on a [`Notify`], holding no thread — until every one is
//!   back: returned by LEASE, its session ended, or revoked `features.lease-recall-timeout-ms`
//!   after the recall. A revoked session gets ESTALE for fops touching that directory until it
//!   sends LEASE for it again. A fop that passed the check is registered as running there
//!   until it ends, so no lease is granted under it.
//! * **Free when unused.** While no lease and no revoked mark exist the gate is disarmed and a
//!   fop pays an atomic add and sub on its worker's own counter and three loads
//!   ([`Leases::enter`]). The first grant arms it, then waits until every fop that passed the
//!   disarmed gate has ended (they are counted per epoch parity, as SRCU does), so no lease is
//!   granted under a fop that was never checked.
//!
//! The table (`Table`) is plain data: time comes in as an argument, so its rules are tested
//! without sleeping.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kiln_admin::options::BrickSettings;
use kiln_wire::{FdId, FopRequest, Gfid, LeaseKind, Name, Recall, RenameMode};
use rustix::io::Errno;
use tokio::sync::{Notify, mpsc};

use crate::fdtable::SessionId;

/// Leases one session may hold at once; past it, LEASE answers none.
pub const LEASES_PER_SESSION_MAX: usize = 65_536;
/// RECALL events queued for one session's connection; a recall that finds the queue full is
/// not sent, and its lease is revoked when the recall times out.
pub const RECALLS_QUEUED_MAX: usize = 1024;
/// How long a grant that arms the gate waits for fops that passed it disarmed; past it, the
/// answer is none (a later LEASE tries again).
pub const DRAIN_WAIT_MAX: Duration = Duration::from_secs(1);
/// How often an arming grant looks whether those fops have ended.
const DRAIN_POLL: Duration = Duration::from_millis(1);
/// A holder still sending fops is giving back what was recalled (its changes queued before
/// the recall go first): each fop moves the recall's deadline to a full timeout away, up to
/// this many timeouts after the recall.
pub const RECALL_TIMEOUTS_MAX: u32 = 12;
/// Directories remembered (for their last recall, or a fop running there) before the idle
/// ones are swept out; the sweep runs again when the table has doubled since.
const DIRS_SWEEP_MIN: usize = 1024;

/// `features.leases`, `features.lease-recall-timeout-ms`, `features.lease-contention-ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseSettings {
    /// Off: every LEASE is answered none (leases held keep being honoured until returned).
    pub enabled: bool,
    /// How long a recalled lease may stay out before it is revoked.
    pub recall_timeout: Duration,
    /// How long after a recall caused by another session a directory's leases are refused.
    pub contention: Duration,
}

impl Default for LeaseSettings {
    fn default() -> Self {
        LeaseSettings {
            enabled: true,
            recall_timeout: Duration::from_millis(5000),
            contention: Duration::from_millis(1000),
        }
    }
}

impl From<&BrickSettings> for LeaseSettings {
    fn from(settings: &BrickSettings) -> LeaseSettings {
        LeaseSettings {
            enabled: settings.leases,
            recall_timeout: Duration::from_millis(settings.lease_recall_timeout_ms),
            contention: Duration::from_millis(settings.lease_contention_ms),
        }
    }
}

/// A session's RECALL events, for its connection to send.
pub type RecallEvents = mpsc::Receiver<Recall>;

/// What lease activity a brick has seen: counters since start, and the leases held now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LeaseStats {
    pub grants: u64,
    pub recalls: u64,
    /// Leases given back by LEASE (to none, or a downgrade).
    pub returns: u64,
    pub revocations: u64,
    /// Fops that waited for a recall.
    pub waits: u64,
    /// Leases held now.
    pub held: u64,
}

// ---- what a fop touches ----

/// How a fop uses a directory it touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Reads it, or names something in it, or works on it without changing it.
    Look,
    /// Makes, removes or renames an entry there, sets its attributes or xattrs, removes it.
    Change,
}

/// What a fop touches, before its fd and the directory it would remove are resolved.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Touches {
    /// Parents of entry fops and the objects of GFID fops.
    pub dirs: Vec<(Gfid, Access)>,
    /// The open fd of an fd fop, whose object is touched.
    pub fd: Option<(FdId, Access)>,
    /// The entry (parent, name) an RMDIR or a replacing RENAME would remove, if a directory.
    pub removes: Option<(Gfid, Name)>,
}

/// What `fop` touches (`docs/wire.md`, "Conflicts"). LEASE touches nothing: it has rules of
/// its own.
pub fn touches(fop: &FopRequest) -> Touches {
    use Access::{Change, Look};
    use FopRequest as Q;
    let dirs = |list: &[(Gfid, Access)]| Touches {
        dirs: list.to_vec(),
        ..Touches::default()
    };
    let fd = |fd: FdId, access: Access| Touches {
        fd: Some((fd, access)),
        ..Touches::default()
    };
    match fop {
        Q::Lookup(r) => dirs(&[(r.parent, Look)]),
        Q::LookupXattrs(r) => dirs(&[(r.parent, Look)]),
        Q::Mknod(r) => dirs(&[(r.parent, Change)]),
        Q::Mkdir(r) => dirs(&[(r.parent, Change)]),
        Q::Symlink(r) => dirs(&[(r.parent, Change)]),
        Q::Create(r) => dirs(&[(r.parent, Change)]),
        Q::Put(r) => dirs(&[(r.parent, Change)]),
        Q::Unlink(r) => dirs(&[(r.parent, Change)]),
        Q::Rmdir(r) => Touches {
            removes: Some((r.parent, r.name.clone())),
            ..dirs(&[(r.parent, Change)])
        },
        Q::Rename(r) => Touches {
            removes: (r.mode == RenameMode::Replace).then(|| (r.new_parent, r.new_name.clone())),
            ..dirs(&[(r.old_parent, Change), (r.new_parent, Change)])
        },
        Q::Link(r) => dirs(&[(r.gfid, Look), (r.new_parent, Change)]),
        Q::Stat(r) => dirs(&[(r.gfid, Look)]),
        Q::Access(r) => dirs(&[(r.gfid, Look)]),
        Q::Readlink(r) => dirs(&[(r.gfid, Look)]),
        Q::Statfs(r) => dirs(&[(r.gfid, Look)]),
        Q::Getxattr(r) => dirs(&[(r.gfid, Look)]),
        Q::Listxattr(r) => dirs(&[(r.gfid, Look)]),
        Q::Open(r) => dirs(&[(r.gfid, Look)]),
        Q::Get(r) => dirs(&[(r.gfid, Look)]),
        Q::Opendir(r) => dirs(&[(r.gfid, Look)]),
        Q::Setattr(r) => dirs(&[(r.gfid, Change)]),
        Q::Truncate(r) => dirs(&[(r.gfid, Change)]),
        Q::Setxattr(r) => dirs(&[(r.gfid, Change)]),
        Q::Removexattr(r) => dirs(&[(r.gfid, Change)]),
        Q::Lease(_) => Touches::default(),
        Q::Write(r) => fd(r.fd, Change),
        Q::Ftruncate(r) => fd(r.fd, Change),
        Q::Fallocate(r) => fd(r.fd, Change),
        Q::Discard(r) => fd(r.fd, Change),
        Q::Zerofill(r) => fd(r.fd, Change),
        Q::Fsetxattr(r) => fd(r.fd, Change),
        Q::Fremovexattr(r) => fd(r.fd, Change),
        Q::Fsetattr(r) => fd(r.fd, Change),
        // Every other fop names an fd and only reads through it (or releases it).
        other => other.fd().map_or_else(Touches::default, |f| fd(f, Look)),
    }
}

/// The directories one fop touches, resolved: what the check looks at.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Targets {
    dirs: Vec<(Gfid, Access)>,
    /// The directory the fop would remove (also among `dirs`, as a change).
    removed: Option<Gfid>,
}

impl Targets {
    pub fn new(mut dirs: Vec<(Gfid, Access)>, removed: Option<Gfid>) -> Targets {
        if let Some(gfid) = removed {
            dirs.push((gfid, Access::Change));
        }
        Targets { dirs, removed }
    }
}

// ---- the table ----

/// A lease held by a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holder {
    session: SessionId,
    /// `Read` or `Write`, never `None`.
    kind: LeaseKind,
    /// When the recall sent for it runs out; `None` while it is not recalled.
    recall_due: Option<Instant>,
    /// When that recall was sent.
    recalled_at: Option<Instant>,
}

/// What the table knows about one directory.
#[derive(Debug, Default)]
struct Dir {
    holders: Vec<Holder>,
    /// Sessions whose lease here was revoked: ESTALE until they send LEASE again.
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
enum Decision {
    /// Answer this kind (what is held now); nothing changes.
    Keep(LeaseKind),
    /// Hold this smaller kind (none: the lease goes).
    Lower(LeaseKind),
    /// Grant this larger kind.
    Raise(LeaseKind),
}

/// What the check found for one fop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Check {
    Clear,
    /// The session's lease on a touched directory was revoked.
    Stale,
    /// Conflicting leases are recalled; the first recall runs out at this instant.
    Wait(Instant),
}

/// Every lease of a brick, plain data.
#[derive(Debug, Default)]
struct Table {
    settings: LeaseSettings,
    dirs: HashMap<Gfid, Dir>,
    sessions: HashMap<SessionId, Attached>,
    /// Leases held and revoked marks, over all directories.
    held: usize,
    revoked: usize,
    /// The earliest recall deadline, if any recall is under way (maybe earlier than the
    /// real one once that lease came back: then the scan finds nothing and recomputes it).
    next_due: Option<Instant>,
    /// Gate parity whose fops must end before a lease may be granted.
    draining: Option<usize>,
    /// Grants waiting for that drain: the gate stays armed for them.
    arming: usize,
    /// Directory count after the last sweep.
    swept_at: usize,
    stats: LeaseStats,
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
    fn attach(&mut self, session: SessionId, events: mpsc::Sender<Recall>) {
        let attached = Attached {
            events,
            dirs: HashSet::new(),
            held: 0,
            recalling: Vec::new(),
        };
        let replaced = self.sessions.insert(session, attached);
        debug_assert!(replaced.is_none(), "session {session} attached twice");
    }

    fn is_attached(&self, session: SessionId) -> bool {
        self.sessions.contains_key(&session)
    }

    /// Whether nothing needs the gate armed: no lease and no revoked mark.
    fn is_quiet(&self) -> bool {
        self.held == 0 && self.revoked == 0
    }

    fn holder(&self, session: SessionId, gfid: &Gfid) -> Option<&Holder> {
        let dir = self.dirs.get(gfid)?;
        dir.holders.iter().find(|h| h.session == session)
    }

    /// What LEASE `asked` on `gfid` from `session` would do now.
    fn decide(&self, session: SessionId, gfid: &Gfid, asked: LeaseKind, now: Instant) -> Decision {
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
    fn clear_revoked(&mut self, session: SessionId, gfid: &Gfid) -> bool {
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
    fn set(&mut self, session: SessionId, gfid: Gfid, kind: LeaseKind) {
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

    /// What a fop of `session` touching `targets` meets: a revoked mark of its own, leases of
    /// others to recall (each recalled once: its holder gets a RECALL event now), or nothing.
    fn check(&mut self, session: SessionId, targets: &Targets, now: Instant) -> Check {
        let stale = targets.dirs.iter().any(|(gfid, _)| {
            self.dirs
                .get(gfid)
                .is_some_and(|d| d.revoked.contains(&session))
        });
        if stale {
            return Check::Stale;
        }
        self.renew_recalls(session, now);
        let mut first_due: Option<Instant> = None;
        for (gfid, access) in &targets.dirs {
            let Some(dir) = self.dirs.get_mut(gfid) else {
                continue;
            };
            let mut recalled = false;
            for holder in &mut dir.holders {
                if holder.session == session || !conflicts(holder.kind, *access) {
                    continue;
                }
                let due = match holder.recall_due {
                    Some(due) => due,
                    None => {
                        let due = now + self.settings.recall_timeout;
                        holder.recall_due = Some(due);
                        holder.recalled_at = Some(now);
                        if let Some(attached) = self.sessions.get_mut(&holder.session) {
                            attached.recalling.push(*gfid);
                        }
                        recalled = true;
                        self.stats.recalls += 1;
                        self.next_due = Some(self.next_due.map_or(due, |d| d.min(due)));
                        send_recall(&self.sessions, holder.session, *gfid);
                        due
                    }
                };
                first_due = Some(first_due.map_or(due, |d| d.min(due)));
            }
            if recalled {
                dir.note_recall(session, now);
            }
        }
        match first_due {
            Some(due) => Check::Wait(due),
            None => Check::Clear,
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

    fn register(&mut self, session: SessionId, targets: &Targets) {
        for &(gfid, access) in &targets.dirs {
            self.dirs
                .entry(gfid)
                .or_default()
                .running
                .push((session, access));
        }
    }

    fn unregister(&mut self, session: SessionId, targets: &Targets, now: Instant) {
        for (gfid, access) in &targets.dirs {
            let Some(dir) = self.dirs.get_mut(gfid) else {
                continue;
            };
            if let Some(at) = dir.running.iter().position(|r| *r == (session, *access)) {
                dir.running.swap_remove(at);
            }
            self.tidy(gfid, now);
        }
    }

    /// Revokes every recalled lease whose recall ran out by `now`; how many.
    fn expire(&mut self, now: Instant) -> usize {
        if self.next_due.is_none_or(|due| now < due) {
            return 0;
        }
        let mut revoked = 0;
        let mut next_due: Option<Instant> = None;
        for (gfid, dir) in &mut self.dirs {
            let mut i = 0;
            while i < dir.holders.len() {
                let holder = dir.holders[i];
                match holder.recall_due {
                    Some(due) if due <= now => {
                        dir.holders.swap_remove(i);
                        dir.revoked.push(holder.session);
                        if let Some(attached) = self.sessions.get_mut(&holder.session) {
                            attached.held -= 1;
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
        }
        self.next_due = next_due;
        self.held -= revoked;
        self.revoked += revoked;
        self.stats.revocations += revoked as u64;
        revoked
    }

    /// Directory `gfid` is gone: its leases and marks with it.
    fn drop_dir(&mut self, gfid: &Gfid, now: Instant) {
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
    fn detach(&mut self, session: SessionId, now: Instant) {
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
    fn tidy(&mut self, gfid: &Gfid, now: Instant) {
        let contention = self.settings.contention;
        if self
            .dirs
            .get(gfid)
            .is_some_and(|d| d.is_idle(now, contention))
        {
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

// ---- the gate ----

/// Fops that passed the disarmed gate and are running, on one worker, by epoch parity. Its
/// own cache line, so workers never write each other's.
#[derive(Debug, Default)]
#[repr(align(128))]
pub struct Slot {
    running: [AtomicUsize; 2],
}

/// A fop that passed the disarmed gate, counted until it ends.
#[derive(Debug)]
pub struct Unarmed<'a> {
    slot: &'a Slot,
    parity: usize,
}

impl Drop for Unarmed<'_> {
    fn drop(&mut self) {
        self.slot.running[self.parity].fetch_sub(1, SeqCst);
    }
}

/// Whether fops must be checked, and which ones passed unchecked (an SRCU-like epoch).
#[derive(Debug, Default)]
struct Gate {
    armed: AtomicBool,
    epoch: AtomicUsize,
    slots: Mutex<Vec<Arc<Slot>>>,
}

impl Gate {
    /// Passes a fop unchecked while disarmed, counting it in `slot` until the guard goes.
    ///
    /// Counted before `armed` is read, all sequentially consistent: either [`Gate::arm`]'s
    /// drain sees the count, or the fop sees the gate armed. The epoch read again catches an
    /// arming between the first read and the count (that count would be in the parity the
    /// next arming drains, not this one).
    fn enter<'s>(&self, slot: &'s Slot) -> Option<Unarmed<'s>> {
        loop {
            let epoch = self.epoch.load(SeqCst);
            let parity = epoch & 1;
            slot.running[parity].fetch_add(1, SeqCst);
            if self.armed.load(SeqCst) {
                slot.running[parity].fetch_sub(1, SeqCst);
                return None;
            }
            if self.epoch.load(SeqCst) == epoch {
                return Some(Unarmed { slot, parity });
            }
            slot.running[parity].fetch_sub(1, SeqCst);
        }
    }

    /// Arms the gate: fops from now on are checked. Returns the parity of the fops that
    /// passed unchecked, to drain.
    fn arm(&self) -> usize {
        self.armed.store(true, SeqCst);
        self.epoch.fetch_add(1, SeqCst) & 1
    }

    fn disarm(&self) {
        self.armed.store(false, SeqCst);
    }

    fn is_armed(&self) -> bool {
        self.armed.load(SeqCst)
    }

    /// Whether every fop counted in `parity` has ended.
    fn drained(&self, parity: usize) -> bool {
        lock(&self.slots)
            .iter()
            .all(|s| s.running[parity].load(SeqCst) == 0)
    }
}

// ---- the shared leases ----

/// The brick's leases and the gate in front of every fop.
#[derive(Debug, Default)]
pub struct Leases {
    gate: Gate,
    table: Mutex<Table>,
    /// Woken when a lease comes back, is revoked or dropped, or a session ends.
    changed: Notify,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update leaves the table whole before it can panic (counters are adjusted with
    // the entries they count), so a poisoned lock still holds a usable table.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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
    /// `register` (until the returned guard goes). ESTALE when the session's own lease on one
    /// of them was revoked.
    pub async fn admit(
        &self,
        session: SessionId,
        targets: Targets,
        register: bool,
    ) -> Result<Admitted<'_>, Errno> {
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
                Check::Stale => return Err(Errno::STALE),
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

    /// LEASE `asked` on directory `gfid` for `session`: the kind it holds afterwards
    /// (`docs/wire.md`). ENOTSUP for a session that did not negotiate leases.
    pub async fn grant(
        &self,
        session: SessionId,
        gfid: Gfid,
        asked: LeaseKind,
    ) -> Result<LeaseKind, Errno> {
        let give_up = Instant::now() + DRAIN_WAIT_MAX;
        loop {
            if let Some(kind) = self.try_grant(session, gfid, asked, give_up)? {
                return Ok(kind);
            }
            let _arming = Arming(self);
            tokio::time::sleep(DRAIN_POLL).await;
        }
    }

    /// One attempt of [`Leases::grant`]: `None` when the lease could be granted but fops that
    /// passed the disarmed gate are still running (counted in `arming`, which the caller's
    /// `Arming` gives back).
    fn try_grant(
        &self,
        session: SessionId,
        gfid: Gfid,
        asked: LeaseKind,
        give_up: Instant,
    ) -> Result<Option<LeaseKind>, Errno> {
        let mut table = lock(&self.table);
        if !table.is_attached(session) {
            return Err(Errno::NOTSUP);
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
            Decision::Raise(kind) if self.ready(&mut table) => {
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

/// A grant waiting for the gate's drain, for as long as this lives (even if the grant is
/// dropped meanwhile): the gate stays armed for it.
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
    use super::*;
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
        let Check::Wait(due) = t.check(2, &on(d, Access::Look), now) else {
            panic!("no wait")
        };
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
        let Check::Wait(due) = t.check(2, &on(d, Access::Look), now) else {
            panic!("no wait")
        };
        assert_eq!(t.expire(due - Duration::from_millis(1)), 0, "not yet");
        assert_eq!(t.expire(due), 1);
        assert_eq!((t.held, t.revoked, t.stats.revocations), (0, 1, 1));
        assert_eq!(t.check(2, &on(d, Access::Look), due), Check::Clear);
        assert_eq!(t.check(1, &on(d, Access::Look), due), Check::Stale);
        assert_eq!(t.check(1, &on(gfid(2), Access::Look), due), Check::Clear);
        assert_eq!(lease(&mut t, 1, d, No, due), No, "LEASE clears the mark");
        assert_eq!(t.check(1, &on(d, Access::Look), due), Check::Clear);
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

    #[test]
    fn fops_touch_what_the_contract_says() {
        use kiln_wire::{Lookup, Rename, Rmdir, Setattr, Write as WriteFop};
        let (p, q) = (gfid(1), gfid(2));
        let n = Name::new("x".to_owned()).expect("name");
        let lookup = touches(
            &Lookup {
                parent: p,
                name: n.clone(),
            }
            .into(),
        );
        assert_eq!(lookup.dirs, [(p, Access::Look)]);
        let rmdir = touches(
            &Rmdir {
                parent: p,
                name: n.clone(),
            }
            .into(),
        );
        assert_eq!(rmdir.dirs, [(p, Access::Change)]);
        assert_eq!(rmdir.removes, Some((p, n.clone())));
        let rename = |mode| Rename {
            old_parent: p,
            old_name: n.clone(),
            new_parent: q,
            new_name: n.clone(),
            mode,
        };
        let replace = touches(&rename(RenameMode::Replace).into());
        assert_eq!(replace.dirs, [(p, Access::Change), (q, Access::Change)]);
        assert_eq!(replace.removes, Some((q, n.clone())));
        assert_eq!(touches(&rename(RenameMode::Exchange).into()).removes, None);
        let setattr = Setattr {
            gfid: p,
            attr: Default::default(),
        };
        assert_eq!(touches(&setattr.into()).dirs, [(p, Access::Change)]);
        let fd = FdId {
            slot: 7,
            generation: 1,
        };
        let write = WriteFop {
            fd,
            offset: 0,
            data: kiln_wire::Payload::new(bytes::Bytes::new()).expect("empty"),
        };
        assert_eq!(touches(&write.into()).fd, Some((fd, Access::Change)));
        let fstat = kiln_wire::Fstat { fd };
        assert_eq!(touches(&fstat.into()).fd, Some((fd, Access::Look)));
    }

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
}
