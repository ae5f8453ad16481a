//! Directories a RENAME is moving. A directory's handle is a symlink to its parent's handle
//! and its name, so between a rename's commit and the new handle's install the old one points
//! at nothing: a lookup of the directory by its GFID then fails though the directory is
//! there. The rename marks each directory it moves for its whole chain; a lookup by GFID that
//! fails waits for a move of that directory to end (or notices one ended since it began) and
//! looks again.

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

    /// After a lookup of `gfid` begun when [`MovingDirs::ended`] was `since` failed: whether
    /// to look again — once a move of `gfid` under way has ended, or at once when a move
    /// ended meanwhile (it may have been this directory's).
    pub(crate) async fn look_again(&self, gfid: &Gfid, since: u64) -> bool {
        let notify = lock(&self.moving).get(gfid).cloned();
        let Some(notify) = notify else {
            return self.ended() != since;
        };
        let ended = notify.notified();
        // Ended between the lookup above and the registration of `ended`?
        if !lock(&self.moving).contains_key(gfid) {
            return true;
        }
        ended.await;
        true
    }
}

impl Drop for Moving<'_> {
    fn drop(&mut self) {
        let mut moving = lock(&self.dirs.moving);
        for gfid in &self.gfids {
            if let Some(notify) = moving.remove(gfid) {
                notify.notify_waiters();
            }
        }
        self.dirs.ended.fetch_add(1, Ordering::Release);
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
    async fn a_failed_lookup_waits_for_the_move_of_its_directory_and_only_for_that() {
        let dirs = MovingDirs::default();
        let since = dirs.ended();
        assert!(!dirs.look_again(&gfid(1), since).await, "nothing moved");
        let moved = gfid(1);
        let moving = dirs.mark(vec![moved]);
        let waiting = dirs.look_again(&moved, since);
        tokio::pin!(waiting);
        let early = tokio::time::timeout(Duration::from_millis(20), &mut waiting).await;
        assert!(early.is_err(), "looked again while the move was under way");
        // Another directory's lookup does not wait, and looks again only once a move ended.
        assert!(!dirs.look_again(&gfid(2), since).await);
        drop(moving);
        assert!(waiting.await);
        assert!(dirs.look_again(&gfid(2), since).await, "a move ended since");
        assert!(!dirs.look_again(&gfid(2), dirs.ended()).await);
    }
}
