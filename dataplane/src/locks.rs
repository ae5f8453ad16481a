//! POSIX record locks, kept by the brick: every client's locks live in one process here, so
//! the kernel's per-process locks cannot tell clients apart. A lock belongs to a (session,
//! owner) pair, like GlusterFS's `features/locks`.

use std::collections::HashMap;

use kiln_wire::{Gfid, Lock, LockCmd, LockKind};
use rustix::io::Errno;

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

/// Every held lock, by file.
#[derive(Debug, Default)]
pub struct LockTable {
    files: HashMap<Gfid, Vec<Held>>,
}

fn range(lock: &Lock) -> Result<(u64, u64), Errno> {
    let end = match lock.len {
        0 => u64::MAX,
        len => lock.start.checked_add(len - 1).ok_or(Errno::OVERFLOW)?,
    };
    Ok((lock.start, end))
}

impl LockTable {
    /// Tests, sets or clears `lock` for (session, owner). A conflicting set is EAGAIN (the
    /// caller waits and retries for `SetWait`); a test returns the conflict or `Unlock`.
    pub fn apply(
        &mut self,
        session: SessionId,
        gfid: Gfid,
        cmd: LockCmd,
        lock: &Lock,
    ) -> Result<Lock, Errno> {
        let (start, end) = range(lock)?;
        if cmd == LockCmd::Get && !self.files.contains_key(&gfid) {
            return Ok(Lock {
                kind: LockKind::Unlock,
                ..lock.clone()
            });
        }
        let held = self.files.entry(gfid).or_default();
        let mine = |h: &Held| h.session == session && h.owner == lock.owner;
        let conflict = held.iter().find(|h| {
            !mine(h)
                && h.start <= end
                && start <= h.end
                && (h.write || lock.kind == LockKind::Write)
        });
        if cmd == LockCmd::Get || lock.kind != LockKind::Unlock {
            if let Some(h) = conflict.filter(|_| lock.kind != LockKind::Unlock) {
                let found = Lock {
                    kind: if h.write {
                        LockKind::Write
                    } else {
                        LockKind::Read
                    },
                    start: h.start,
                    len: if h.end == u64::MAX {
                        0
                    } else {
                        h.end - h.start + 1
                    },
                    pid: h.pid,
                    owner: h.owner,
                };
                return match cmd {
                    LockCmd::Get => Ok(found),
                    _ => Err(Errno::AGAIN),
                };
            }
            if cmd == LockCmd::Get {
                return Ok(Lock {
                    kind: LockKind::Unlock,
                    ..lock.clone()
                });
            }
        }
        // Carve the range out of this owner's locks, then add the new one (POSIX merges and
        // splits an owner's locks by range).
        let mut kept = Vec::with_capacity(held.len() + 1);
        for h in held.drain(..) {
            if !mine(&h) || h.end < start || end < h.start {
                kept.push(h);
                continue;
            }
            if h.start < start {
                kept.push(Held {
                    end: start - 1,
                    ..h
                });
            }
            if h.end > end {
                kept.push(Held {
                    start: end + 1,
                    ..h
                });
            }
        }
        if lock.kind != LockKind::Unlock {
            let write = lock.kind == LockKind::Write;
            kept.push(Held {
                session,
                owner: lock.owner,
                pid: lock.pid,
                write,
                start,
                end,
            });
        }
        *held = kept;
        if held.is_empty() {
            self.files.remove(&gfid);
        }
        Ok(lock.clone())
    }

    /// Drops the locks on `gfid` held by `session`, or only by its `owner` when given (FLUSH:
    /// POSIX drops a process's locks when it closes any fd of the file).
    pub fn release(&mut self, session: SessionId, owner: Option<u64>, gfid: &Gfid) {
        if let Some(held) = self.files.get_mut(gfid) {
            held.retain(|h| h.session != session || owner.is_some_and(|o| o != h.owner));
            if held.is_empty() {
                self.files.remove(gfid);
            }
        }
    }

    /// Drops every lock of a session that ended.
    pub fn release_session(&mut self, session: SessionId) {
        self.files.retain(|_, held| {
            held.retain(|h| h.session != session);
            !held.is_empty()
        });
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
        let mut t = LockTable::default();
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
        t.apply(2, g, LockCmd::Set, &lk(LockKind::Read, 50, 1, 9))
            .expect("now free");
        assert_eq!(
            t.apply(2, g, LockCmd::Set, &lk(LockKind::Read, 10, 1, 9)),
            Err(Errno::AGAIN)
        );
        t.release(2, Some(9), &g);
        let probe = t.apply(3, g, LockCmd::Get, &lk(LockKind::Write, 50, 1, 4));
        assert_eq!(
            probe.map(|l| l.kind),
            Ok(LockKind::Unlock),
            "owner 9's lock went with its flush"
        );
        t.release_session(1);
        t.apply(2, g, LockCmd::Set, &lk(LockKind::Write, 0, 0, 9))
            .expect("all free after session end");
        assert_eq!(
            t.apply(3, g, LockCmd::Get, &lk(LockKind::Read, 5, 1, 1))
                .map(|l| l.kind),
            Ok(LockKind::Write)
        );
    }
}
