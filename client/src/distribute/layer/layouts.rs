//! The directory layouts a layer keeps. A layout is used for [`LAYOUT_TTL`] after it was read
//! (or written), and not at all once a brick joined or changed role since: another client (a
//! fix-layout, a rebalance) may replace it meanwhile. One read under a lease this layer holds
//! on the directory on every brick — read in the same request as the lease was granted, after
//! it — stays in use until the lease is recalled, lowered to none or lost: another client's
//! write of the layout (an xattr of the directory) recalls the lease before it runs.

use std::sync::atomic::{AtomicU64, Ordering};

use super::*;

/// A directory's layout as this layer keeps it.
#[derive(Debug)]
struct Kept {
    layout: Arc<Layout>,
    /// When it was read or written.
    read: Instant,
    /// The bricks' generation then.
    generation: u64,
    /// Whether it was read under a lease still held.
    leased: bool,
}

/// The layouts of up to [`LAYOUTS_MAX`] directories, the least recently used forgotten first.
#[derive(Debug)]
pub(super) struct Layouts {
    kept: Mutex<lru::LruCache<Gfid, Kept>>,
    /// Recalls (and losses of every lease) seen so far. A layout read under a lease whose
    /// grant was answered after a recall came is not kept as leased: the recall may have been
    /// of that lease, and have come before the grant's answer.
    recalls: AtomicU64,
}

impl Layouts {
    pub(super) fn new() -> Layouts {
        Layouts {
            kept: Mutex::new(lru::LruCache::new(capacity(LAYOUTS_MAX))),
            recalls: AtomicU64::new(0),
        }
    }

    /// The layout of `dir` kept, and whether it is fresh: read within [`LAYOUT_TTL`] or under
    /// a lease still held, and under the bricks' `generation`.
    pub(super) fn get(&self, dir: Gfid, generation: u64) -> Option<(Arc<Layout>, bool)> {
        lock(&self.kept).get(&dir).map(|kept| {
            let fresh =
                (kept.leased || kept.read.elapsed() < LAYOUT_TTL) && kept.generation == generation;
            (kept.layout.clone(), fresh)
        })
    }

    /// Keeps `layout` of `dir`, made or read now under the bricks' `generation`.
    pub(super) fn keep(&self, dir: Gfid, layout: Arc<Layout>, generation: u64) {
        self.put(dir, layout, generation, false);
    }

    /// Keeps `layout` of `dir`, read under the bricks' `generation` under a lease granted
    /// with it; `recalls` is [`Layouts::recalls`] from before the lease was asked.
    pub(super) fn keep_leased(
        &self,
        dir: Gfid,
        layout: Arc<Layout>,
        generation: u64,
        recalls: u64,
    ) {
        let leased = self.recalls() == recalls;
        self.put(dir, layout, generation, leased);
    }

    fn put(&self, dir: Gfid, layout: Arc<Layout>, generation: u64, leased: bool) {
        let kept = Kept {
            layout,
            read: Instant::now(),
            generation,
            leased,
        };
        lock(&self.kept).put(dir, kept);
    }

    pub(super) fn forget(&self, dir: Gfid) {
        lock(&self.kept).pop(&dir);
    }

    /// The recalls seen so far.
    pub(super) fn recalls(&self) -> u64 {
        self.recalls.load(Ordering::SeqCst)
    }

    /// The lease on `dir` is recalled or given back (`None`: every lease is lost): its layout
    /// is kept only for what is left of its [`LAYOUT_TTL`].
    pub(super) fn unleased(&self, dir: Option<Gfid>) {
        self.recalls.fetch_add(1, Ordering::SeqCst);
        let mut kept = lock(&self.kept);
        match dir {
            Some(dir) => {
                if let Some(kept) = kept.peek_mut(&dir) {
                    kept.leased = false;
                }
            }
            None => kept.iter_mut().for_each(|(_, kept)| kept.leased = false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gfid(n: u128) -> Gfid {
        Gfid::from_bytes(n.to_le_bytes()).expect("not nil")
    }

    fn layout() -> Arc<Layout> {
        Arc::new(Layout::new_directory(&[1, 1], 0, COMMIT_HASH_COMMITTED).expect("a layout"))
    }

    #[test]
    fn a_layout_read_under_a_lease_stays_fresh_until_the_lease_goes() {
        let layouts = Layouts::new();
        let (a, b, c) = (gfid(1), gfid(2), gfid(3));
        let recalls = layouts.recalls();
        layouts.keep_leased(a, layout(), 7, recalls);
        layouts.keep_leased(b, layout(), 7, recalls);
        layouts.keep(c, layout(), 7);
        let fresh = |dir| layouts.get(dir, 7).map(|(_, fresh)| fresh);
        assert_eq!(fresh(a), Some(true));
        assert_eq!(
            layouts.get(a, 8).map(|(_, fresh)| fresh),
            Some(false),
            "a brick joined"
        );
        // Old: only the leased ones are fresh.
        let age = |dir| {
            let mut kept = lock(&layouts.kept);
            let kept = kept.peek_mut(&dir).expect("kept");
            kept.read = kept.read.checked_sub(LAYOUT_TTL).expect("a past instant");
        };
        [a, b, c].into_iter().for_each(age);
        assert_eq!(
            (fresh(a), fresh(b), fresh(c)),
            (Some(true), Some(true), Some(false))
        );
        layouts.unleased(Some(a));
        assert_eq!((fresh(a), fresh(b)), (Some(false), Some(true)));
        layouts.unleased(None);
        assert_eq!(fresh(b), Some(false), "every lease lost");
        // A grant answered after a recall came is not taken as a lease on the layout.
        layouts.keep_leased(c, layout(), 7, recalls);
        age(c);
        assert_eq!(fresh(c), Some(false));
        layouts.forget(c);
        assert_eq!(fresh(c), None);
    }
}
