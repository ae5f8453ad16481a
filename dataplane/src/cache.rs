//! Bounded O(1) caches: which GFID an inode carries, and open `O_PATH` fds of directories.
//!
//! Both are LRUs (the `lru` crate: a hash map over an intrusive list, O(1) insert, lookup and
//! eviction) with a size fixed at start-up, in entries.

use std::hash::Hash;
use std::num::NonZeroUsize;

use kiln_wire::{Gfid, Timespec};
use lru::LruCache;

use crate::op::{DirFd, Stat};

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
pub type GfidCache = CountedLru<InodeKey, Gfid>;

/// GFID → open `O_PATH` fd of that directory. An fd keeps naming its directory across
/// renames, so entries are dropped only on eviction and RMDIR. Sized by
/// `storage.dirfd-cache-entries`.
pub type DirCache = CountedLru<Gfid, DirFd>;

/// Bytes one [`GfidCache`] entry costs: key and value plus the LRU's links and hash slot.
pub const GFID_CACHE_ENTRY_BYTES: usize =
    size_of::<InodeKey>() + size_of::<Gfid>() + 2 * size_of::<usize>() + 2 * size_of::<usize>();

/// An LRU that counts its hits and misses.
pub struct CountedLru<K, V> {
    map: LruCache<K, V>,
    hits: u64,
    misses: u64,
}

impl<K: Hash + Eq, V: Clone> std::fmt::Debug for CountedLru<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.state().fmt(f)
    }
}

impl<K: Hash + Eq, V: Clone> CountedLru<K, V> {
    pub fn new(entries: NonZeroUsize) -> CountedLru<K, V> {
        CountedLru {
            map: LruCache::new(entries),
            hits: 0,
            misses: 0,
        }
    }

    pub fn get(&mut self, key: &K) -> Option<V> {
        let found = self.map.get(key).cloned();
        match found {
            Some(_) => self.hits += 1,
            None => self.misses += 1,
        }
        found
    }

    pub fn insert(&mut self, key: K, value: V) {
        self.map.put(key, value);
    }

    pub fn remove(&mut self, key: &K) {
        self.map.pop(key);
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Entries, capacity, hits and misses since start.
    pub fn state(&self) -> CacheState {
        CacheState {
            entries: self.map.len(),
            capacity: self.map.cap().get(),
            hits: self.hits,
            misses: self.misses,
        }
    }
}

pub use kiln_admin::control::CacheState;

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
        assert_eq!((c.state().hits, c.state().misses), (1, 1));
        const _: () = assert!(GFID_CACHE_ENTRY_BYTES <= 256);
    }
}
