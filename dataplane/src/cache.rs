//! Bounded O(1) caches: which GFID an inode carries, and open `O_PATH` fds of directories.
//!
//! Both are LRUs (the `lru` crate: a hash map over an intrusive list, O(1) insert, lookup and
//! eviction) with a size fixed at start-up, in entries.

use std::num::NonZeroUsize;

use kiln_wire::{Gfid, Timespec};
use lru::LruCache;

use crate::step::{DirFd, Stat};

/// Identifies an inode across reuse of inode numbers: the number plus its birth time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct InodeKey {
    ino: u64,
    btime: Timespec,
}

impl InodeKey {
    pub fn of(stat: &Stat) -> InodeKey {
        InodeKey {
            ino: stat.ino,
            btime: stat.btime,
        }
    }
}

/// inode → GFID, so a LOOKUP or READDIRP entry costs one `statx` instead of a `statx` plus a
/// `getxattr`. Sized by `network.inode-lru-limit`.
#[derive(Debug)]
pub struct GfidCache {
    map: LruCache<InodeKey, Gfid>,
    hits: u64,
    misses: u64,
}

/// Bytes one [`GfidCache`] entry costs: key and value plus the LRU's links and hash slot.
pub const GFID_CACHE_ENTRY_BYTES: usize =
    size_of::<InodeKey>() + size_of::<Gfid>() + 2 * size_of::<usize>() + 2 * size_of::<usize>();

impl GfidCache {
    pub fn new(entries: NonZeroUsize) -> GfidCache {
        GfidCache {
            map: LruCache::new(entries),
            hits: 0,
            misses: 0,
        }
    }

    pub fn get(&mut self, key: &InodeKey) -> Option<Gfid> {
        let found = self.map.get(key).copied();
        match found {
            Some(_) => self.hits += 1,
            None => self.misses += 1,
        }
        found
    }

    pub fn insert(&mut self, key: InodeKey, gfid: Gfid) {
        self.map.put(key, gfid);
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// (hits, misses) since start.
    pub fn stats(&self) -> (u64, u64) {
        (self.hits, self.misses)
    }
}

/// GFID → open `O_PATH` fd of that directory. An fd keeps naming its directory across
/// renames, so entries are dropped only on eviction and RMDIR. Sized by
/// `storage.dirfd-cache-entries`.
#[derive(Debug)]
pub struct DirCache {
    map: LruCache<Gfid, DirFd>,
}

impl DirCache {
    pub fn new(entries: NonZeroUsize) -> DirCache {
        DirCache {
            map: LruCache::new(entries),
        }
    }

    pub fn get(&mut self, gfid: &Gfid) -> Option<DirFd> {
        self.map.get(gfid).cloned()
    }

    pub fn insert(&mut self, gfid: Gfid, dir: DirFd) {
        self.map.put(gfid, dir);
    }

    pub fn remove(&mut self, gfid: &Gfid) {
        self.map.pop(gfid);
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gfid_cache_is_bounded_and_counts() {
        let mut c = GfidCache::new(NonZeroUsize::new(2).expect("non-zero"));
        let key = |ino| InodeKey {
            ino,
            btime: Timespec::default(),
        };
        c.insert(key(1), Gfid::ROOT);
        c.insert(key(2), Gfid::ROOT);
        c.insert(key(3), Gfid::ROOT);
        assert_eq!(c.len(), 2);
        assert_eq!(c.get(&key(1)), None);
        assert_eq!(c.get(&key(3)), Some(Gfid::ROOT));
        assert_eq!(c.stats(), (1, 1));
        const _: () = assert!(GFID_CACHE_ENTRY_BYTES <= 256);
    }
}
