//! The content of the small files the mount made, kept to answer their reads.
//!
//! A deferred create in a held directory goes to the brick as one PUT queued behind its close
//! ([`super::pending`]), and the mount describes the file while it holds the directory's write
//! lease. Without file leases the kernel's pages of it rarely survive until it is read: its
//! first write dropped the attributes the kernel had from the CREATE, and the next ones it
//! gets (the file's final mtime) differ, so `FUSE_AUTO_INVAL_DATA` drops the pages stored at
//! the close (with them the mount keeps the pages, [`super::pages`], but the kernel may have
//! reclaimed them). A build reading the objects it just compiled, or a copy checked right
//! after it is made, would read every file back from the brick. The content is kept here
//! too, and a READ of such a
//! file is answered from it while the mount still describes the file — no other client can
//! have changed it without a recall, which ends the description — and nothing here changed
//! its data ([`MadeFiles::forget`] at every write, truncate and open for writing).
//!
//! At most [`MADE_BYTES_MAX`] bytes are kept, the oldest files going first.

use std::sync::Mutex;

use bytes::Bytes;
use kiln_wire::Gfid;

/// Bytes of content the mount keeps at once.
pub(super) const MADE_BYTES_MAX: usize = 64 << 20;

/// The content of files made here, by GFID, oldest first.
#[derive(Debug)]
pub(super) struct MadeFiles {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// Each file's content, the one kept last most recent (reads do not reorder it).
    files: lru::LruCache<Gfid, Bytes>,
    bytes: usize,
}

impl Default for MadeFiles {
    fn default() -> MadeFiles {
        MadeFiles {
            state: Mutex::new(State {
                files: lru::LruCache::unbounded(),
                bytes: 0,
            }),
        }
    }
}

impl MadeFiles {
    /// Keeps `data`, the whole content of file `gfid` as the mount made it.
    pub(super) fn keep(&self, gfid: Gfid, data: Bytes) {
        if data.is_empty() || data.len() > MADE_BYTES_MAX {
            return;
        }
        let mut state = self.lock();
        state.remove(&gfid);
        while state.bytes + data.len() > MADE_BYTES_MAX {
            let Some((_, oldest)) = state.files.pop_lru() else {
                break;
            };
            state.bytes -= oldest.len();
        }
        state.bytes += data.len();
        state.files.put(gfid, data);
        debug_assert!(state.bytes <= MADE_BYTES_MAX);
    }

    /// The content kept of file `gfid`, if any.
    pub(super) fn get(&self, gfid: &Gfid) -> Option<Bytes> {
        self.lock().files.peek(gfid).cloned()
    }

    /// Forgets the content of file `gfid`: it changes.
    pub(super) fn forget(&self, gfid: &Gfid) {
        self.lock().remove(gfid);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl State {
    fn remove(&mut self, gfid: &Gfid) {
        if let Some(data) = self.files.pop(gfid) {
            self.bytes -= data.len();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gfid(n: u8) -> Gfid {
        Gfid::from_bytes([n; 16]).expect("not the nil GFID")
    }

    #[test]
    fn keeps_until_forgotten_or_pushed_out_oldest_first() {
        let made = MadeFiles::default();
        let quarter = MADE_BYTES_MAX / 4;
        for n in 1..=4 {
            made.keep(gfid(n), Bytes::from(vec![n; quarter]));
        }
        made.forget(&gfid(2));
        assert_eq!(made.get(&gfid(2)), None);
        // Room for one more quarter: the forgotten one made it.
        made.keep(gfid(5), Bytes::from(vec![5; quarter]));
        assert!(made.get(&gfid(1)).is_some());
        // Past the bound: the oldest goes.
        made.keep(gfid(6), Bytes::from(vec![6; quarter]));
        assert_eq!(made.get(&gfid(1)), None);
        assert_eq!(made.get(&gfid(6)).map(|d| d[0]), Some(6));
        // Kept again: the new content, counted once.
        made.keep(gfid(6), Bytes::from_static(b"new"));
        assert_eq!(made.get(&gfid(6)), Some(Bytes::from_static(b"new")));
        assert_eq!(made.lock().bytes, 3 * quarter + 3);
        // Kept again after others: the older place in the queue no longer counts.
        made.keep(gfid(9), Bytes::from(vec![9; quarter]));
        made.keep(gfid(10), Bytes::from(vec![10; quarter]));
        made.keep(gfid(9), Bytes::from(vec![9; quarter]));
        assert!(made.get(&gfid(9)).is_some(), "9 is the newest");
        // Forgetting and keeping many times leaves only what is kept.
        for _ in 0..10_000 {
            made.keep(gfid(11), Bytes::from_static(b"x"));
            made.forget(&gfid(11));
        }
        let state = made.lock();
        let kept: usize = state.files.iter().map(|(_, data)| data.len()).sum();
        assert_eq!(state.bytes, kept);
        assert!(state.files.peek(&gfid(11)).is_none() && state.files.len() <= 4);
        drop(state);
        // Nothing kept of an empty file, or of one larger than the bound.
        made.keep(gfid(7), Bytes::new());
        made.keep(gfid(8), Bytes::from(vec![8; MADE_BYTES_MAX + 1]));
        assert_eq!((made.get(&gfid(7)), made.get(&gfid(8))), (None, None));
    }
}
