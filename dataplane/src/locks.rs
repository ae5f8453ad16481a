//! POSIX record locks, kept by the brick: every client's locks live in one process here, so
//! the kernel's per-process locks cannot tell clients apart. A lock belongs to a (session,
//! owner) pair, like GlusterFS's `features/locks`.
//!
//! Bounded: a session holds at most `locks_per_client_max` ranges (ENOLCK past it). A blocked
//! F_SETLKW waits on its file's [`Notify`], which every unlock and release on the file wakes:
//! no thread is held while waiting.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Weak};

use kiln_wire::{Gfid, Lock, LockCmd, LockKind};
use rustix::io::Errno;
use tokio::sync::Notify;

use crate::fdtable::SessionId;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Held {
    session: SessionId,
    owner: u64,
    pid: u32,
    write: bool,
    start: u64,
    /// Inclusive end; `u64::MAX` for "to end of file".
    end: u64,
}

impl Held {
    fn overlaps(&self, start: u64, end: u64) -> bool {
        self.start <= end && start <= self.end
    }

    /// The lock as F_GETLK reports it.
    fn as_lock(&self) -> Lock {
        Lock {
            kind: if self.write {
                LockKind::Write
            } else {
                LockKind::Read
            },
            start: self.start,
            len: if self.end == u64::MAX {
                0
            } else {
                self.end - self.start + 1
            },
            pid: self.pid,
            owner: self.owner,
        }
    }
}

/// Every held lock, by file, and the waiters of each file.
#[derive(Debug)]
pub struct LockTable {
    files: HashMap<Gfid, Vec<Held>>,
    /// Ranges held per session.
    per_session: HashMap<SessionId, usize>,
    per_session_max: usize,
    /// Woken when a file's locks shrink; weak, so a file nobody waits on costs nothing.
    waiters: HashMap<Gfid, Weak<Notify>>,
    /// Sessions ending: their waits stop (EINTR) instead of holding the session open.
    cancelled: HashSet<SessionId>,
}

fn range(lock: &Lock) -> Result<(u64, u64), Errno> {
    let end = match lock.len {
        0 => u64::MAX,
        len => lock.start.checked_add(len - 1).ok_or(Errno::OVERFLOW)?,
    };
    Ok((lock.start, end))
}

impl LockTable {
    pub fn new(per_session_max: usize) -> LockTable {
        LockTable {
            files: HashMap::new(),
            per_session: HashMap::new(),
            per_session_max,
            waiters: HashMap::new(),
            cancelled: HashSet::new(),
        }
    }

    /// Tests, sets or clears `lock` for (session, owner). A conflicting set is EAGAIN (the
    /// caller waits on [`LockTable::waiter`] and retries for `SetWait`); a test returns the
    /// conflict or `Unlock`; a set past the session's limit is ENOLCK.
    pub fn apply(
        &mut self,
        session: SessionId,
        gfid: Gfid,
        cmd: LockCmd,
        lock: &Lock,
    ) -> Result<Lock, Errno> {
        let (start, end) = range(lock)?;
        let held = self.files.get(&gfid).map_or(&[][..], Vec::as_slice);
        let conflict = (lock.kind != LockKind::Unlock)
            .then(|| {
                held.iter().find(|h| {
                    (h.session, h.owner) != (session, lock.owner)
                        && h.overlaps(start, end)
                        && (h.write || lock.kind == LockKind::Write)
                })
            })
            .flatten();
        match (cmd, conflict) {
            (LockCmd::Get, Some(h)) => return Ok(h.as_lock()),
            (LockCmd::Get, None) => {
                return Ok(Lock {
                    kind: LockKind::Unlock,
                    ..lock.clone()
                });
            }
            (_, Some(_)) => return Err(Errno::AGAIN),
            (_, None) => {}
        }
        self.set(session, gfid, lock, (start, end))?;
        Ok(lock.clone())
    }

    /// Carves `start..=end` out of the owner's locks on `gfid` (POSIX merges and splits an
    /// owner's locks by range), then adds the new one unless it is an unlock.
    fn set(
        &mut self,
        session: SessionId,
        gfid: Gfid,
        lock: &Lock,
        (start, end): (u64, u64),
    ) -> Result<(), Errno> {
        let held = self.files.get(&gfid).map_or(&[][..], Vec::as_slice);
        let mine = |h: &Held| h.session == session && h.owner == lock.owner;
        let mut kept = Vec::with_capacity(held.len() + 1);
        for h in held {
            if !mine(h) || !h.overlaps(start, end) {
                kept.push(*h);
                continue;
            }
            if h.start < start {
                kept.push(Held {
                    end: start - 1,
                    ..*h
                });
            }
            if h.end > end {
                kept.push(Held {
                    start: end + 1,
                    ..*h
                });
            }
        }
        if lock.kind != LockKind::Unlock {
            kept.push(Held {
                session,
                owner: lock.owner,
                pid: lock.pid,
                write: lock.kind == LockKind::Write,
                start,
                end,
            });
        }
        let count = |locks: &[Held]| locks.iter().filter(|h| h.session == session).count();
        let (before, after) = (count(held), count(&kept));
        let total = self.per_session.get(&session).copied().unwrap_or(0);
        let total = (total + after).saturating_sub(before);
        if after > before && total > self.per_session_max {
            return Err(Errno::NOLCK);
        }
        self.count(session, total);
        self.replace(gfid, kept);
        Ok(())
    }

    /// Drops the locks on `gfid` held by `session`, or only by its `owner` when given (FLUSH:
    /// POSIX drops a process's locks when it closes any fd of the file).
    pub fn release(&mut self, session: SessionId, owner: Option<u64>, gfid: &Gfid) {
        let Some(held) = self.files.get(gfid) else {
            return;
        };
        let gone = |h: &Held| h.session == session && owner.is_none_or(|o| o == h.owner);
        let dropped = held.iter().filter(|h| gone(h)).count();
        if dropped == 0 {
            return;
        }
        let kept = held.iter().filter(|h| !gone(h)).copied().collect();
        let total = self.per_session.get(&session).copied().unwrap_or(0);
        self.count(session, total.saturating_sub(dropped));
        self.replace(*gfid, kept);
    }

    /// Stops the lock waits of an ending session: every waiter wakes, and the session's find
    /// their wait cancelled ([`LockTable::is_cancelled`]) until [`LockTable::release_session`].
    pub fn cancel_waits(&mut self, session: SessionId) {
        self.cancelled.insert(session);
        for notify in self.waiters.values().filter_map(Weak::upgrade) {
            notify.notify_waiters();
        }
    }

    pub fn is_cancelled(&self, session: SessionId) -> bool {
        self.cancelled.contains(&session)
    }

    /// Drops every lock of a session that ended.
    pub fn release_session(&mut self, session: SessionId) {
        self.cancelled.remove(&session);
        if self.per_session.remove(&session).is_none() {
            return;
        }
        let files: Vec<Gfid> = self
            .files
            .iter()
            .filter(|(_, held)| held.iter().any(|h| h.session == session))
            .map(|(g, _)| *g)
            .collect();
        for gfid in files {
            let kept = self.files[&gfid]
                .iter()
                .filter(|h| h.session != session)
                .copied()
                .collect();
            self.replace(gfid, kept);
        }
    }

    /// The waiter queue of `gfid`: a blocked F_SETLKW enables a `notified` future on it
    /// before letting go of the table, then waits.
    pub fn waiter(&mut self, gfid: Gfid) -> Arc<Notify> {
        if let Some(notify) = self.waiters.get(&gfid).and_then(Weak::upgrade) {
            return notify;
        }
        let notify = Arc::new(Notify::new());
        self.waiters.retain(|_, w| w.strong_count() > 0);
        self.waiters.insert(gfid, Arc::downgrade(&notify));
        notify
    }

    /// Ranges `session` holds now.
    pub fn held_by(&self, session: SessionId) -> usize {
        self.per_session.get(&session).copied().unwrap_or(0)
    }

    fn count(&mut self, session: SessionId, total: usize) {
        match total {
            0 => self.per_session.remove(&session),
            n => self.per_session.insert(session, n),
        };
    }

    /// Installs `gfid`'s new lock list and wakes its waiters: any change may free a range.
    fn replace(&mut self, gfid: Gfid, kept: Vec<Held>) {
        match kept.is_empty() {
            true => self.files.remove(&gfid),
            false => self.files.insert(gfid, kept),
        };
        if let Some(notify) = self.waiters.get(&gfid).and_then(Weak::upgrade) {
            notify.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lk(kind: LockKind, start: u64, len: u64, owner: u64) -> Lock {
        Lock {
            kind,
            start,
            len,
            pid: 1,
            owner,
        }
    }

    #[test]
    fn conflicts_between_owners_and_splits_within_one() {
        let mut t = LockTable::new(64);
        let g = Gfid::ROOT;
        t.apply(1, g, LockCmd::Set, &lk(LockKind::Write, 0, 100, 7))
            .expect("free");
        assert_eq!(
            t.apply(2, g, LockCmd::Set, &lk(LockKind::Read, 50, 1, 9)),
            Err(Errno::AGAIN)
        );
        let probe = t
            .apply(2, g, LockCmd::Get, &lk(LockKind::Read, 50, 1, 9))
            .expect("test");
        assert_eq!(
            (probe.kind, probe.start, probe.len, probe.owner),
            (LockKind::Write, 0, 100, 7)
        );
        // The owner unlocks the middle: the range splits and the middle is free.
        t.apply(1, g, LockCmd::Set, &lk(LockKind::Unlock, 40, 20, 7))
            .expect("unlock");
        assert_eq!(t.held_by(1), 2, "split in two");
        t.apply(2, g, LockCmd::Set, &lk(LockKind::Read, 50, 1, 9))
            .expect("now free");
        assert_eq!(
            t.apply(2, g, LockCmd::Set, &lk(LockKind::Read, 10, 1, 9)),
            Err(Errno::AGAIN)
        );
        t.release(2, Some(9), &g);
        assert_eq!(t.held_by(2), 0);
        let probe = t.apply(3, g, LockCmd::Get, &lk(LockKind::Write, 50, 1, 4));
        assert_eq!(
            probe.map(|l| l.kind),
            Ok(LockKind::Unlock),
            "owner 9's lock went with its flush"
        );
        t.release_session(1);
        assert_eq!(t.held_by(1), 0);
        t.apply(2, g, LockCmd::Set, &lk(LockKind::Write, 0, 0, 9))
            .expect("all free after session end");
        assert_eq!(
            t.apply(3, g, LockCmd::Get, &lk(LockKind::Read, 5, 1, 1))
                .map(|l| l.kind),
            Ok(LockKind::Write)
        );
    }

    #[test]
    fn a_session_past_its_limit_gets_enolck_and_others_do_not() {
        let mut t = LockTable::new(3);
        let g = Gfid::ROOT;
        for i in 0..3 {
            t.apply(1, g, LockCmd::Set, &lk(LockKind::Read, i * 10, 1, 7))
                .expect("within the limit");
        }
        assert_eq!(
            t.apply(1, g, LockCmd::Set, &lk(LockKind::Read, 100, 1, 7)),
            Err(Errno::NOLCK)
        );
        // Replacing a range it holds adds nothing.
        t.apply(1, g, LockCmd::Set, &lk(LockKind::Write, 0, 1, 7))
            .expect("same range");
        t.apply(2, g, LockCmd::Set, &lk(LockKind::Read, 100, 1, 9))
            .expect("another session is unaffected");
        t.apply(1, g, LockCmd::Set, &lk(LockKind::Unlock, 0, 0, 7))
            .expect("unlock all");
        assert_eq!(t.held_by(1), 0);
    }

    #[test]
    fn an_unlock_wakes_the_files_waiters() {
        let mut t = LockTable::new(8);
        let g = Gfid::ROOT;
        t.apply(1, g, LockCmd::Set, &lk(LockKind::Write, 0, 0, 7))
            .expect("free");
        let notify = t.waiter(g);
        let mut woken = Box::pin(notify.clone().notified_owned());
        woken.as_mut().enable();
        t.apply(1, g, LockCmd::Set, &lk(LockKind::Unlock, 0, 0, 7))
            .expect("unlock");
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        assert!(
            woken.as_mut().poll(&mut cx).is_ready(),
            "woken by the unlock"
        );
    }
}
