//! Directories a RENAME is moving. A directory's handle is a symlink to its parent's handle
//! and its name, so between a rename's commit and the new handle's install the old one points
//! at nothing: a lookup of the directory by its GFID — or of any directory below it, whose
//! handle resolves through it — then fails though the directory is there. The rename marks
//! the directories it moves for its whole chain; a lookup by GFID that fails while moves are
//! under way waits for them to end (or notices one ended since it began) and looks again.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kiln_wire::Gfid;
use tokio::sync::Notify;

use super::lock;

/// The directories being moved now, and how many moves ended so far.
#[derive(Debug, Default)]
pub(crate) struct MovingDirs {
    moving: Mutex<HashMap<Gfid, Arc<Notify>>>,
    ended: AtomicU64,
}

/// A move under way: the directories are marked until it goes.
#[derive(Debug)]
pub(crate) struct Moving<'a> {
    dirs: &'a MovingDirs,
    gfids: Vec<Gfid>,
}

impl MovingDirs {
    /// Marks `gfids` as being moved until the returned guard goes. A rename's directories
    /// are under its name turns, so no two moves mark one directory at once.
    pub(crate) fn mark(&self, gfids: Vec<Gfid>) -> Moving<'_> {
        let mut moving = lock(&self.moving);
        for gfid in &gfids {
            moving.insert(*gfid, Arc::new(Notify::new()));
        }
        Moving { dirs: self, gfids }
    }

    /// How many moves ended so far: what [`MovingDirs::look_again`] compares with.
    pub(crate) fn ended(&self) -> u64 {
        self.ended.load(Ordering::Acquire)
    }

    /// After a lookup by GFID begun when [`MovingDirs::ended`] was `since` failed: whether
    /// to look again — at once when a move ended meanwhile (it may have been the directory's
    /// own, or an ancestor's, whose handle its handle resolves through), else once every move
    /// under way now has ended; no, when none is.
    pub(crate) async fn look_again(&self, since: u64) -> bool {
        let under_way: Vec<Arc<Notify>>;
        // Registered under the lock a move's end takes to count itself and wake them.
        let (ends, ended_since) = {
            let moving = lock(&self.moving);
            under_way = moving.values().cloned().collect();
            let ends: Vec<_> = under_way.iter().map(|n| n.notified()).collect();
            (ends, self.ended() != since)
        };
        if ended_since {
            return true;
        }
        if ends.is_empty() {
            return false;
        }
        for end in ends {
            end.await;
        }
        true
    }
}

impl Drop for Moving<'_> {
    fn drop(&mut self) {
        let mut moving = lock(&self.dirs.moving);
        self.dirs.ended.fetch_add(1, Ordering::Release);
        for gfid in &self.gfids {
            if let Some(notify) = moving.remove(gfid) {
                notify.notify_waiters();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn gfid(n: u8) -> Gfid {
        Gfid::from_bytes([n; 16]).expect("not null")
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_failed_lookup_looks_again_once_the_moves_under_way_ended() {
        let dirs = MovingDirs::default();
        let since = dirs.ended();
        assert!(
            !dirs.look_again(since).await,
            "nothing moved: the failure stands"
        );
        let moving = dirs.mark(vec![gfid(1)]);
        let waiting = dirs.look_again(since);
        tokio::pin!(waiting);
        let early = tokio::time::timeout(Duration::from_millis(20), &mut waiting).await;
        assert!(early.is_err(), "looked again while a move was under way");
        drop(moving);
        assert!(waiting.await);
        assert!(
            dirs.look_again(since).await,
            "a move ended since the lookup began"
        );
        assert!(!dirs.look_again(dirs.ended()).await);
    }
}
