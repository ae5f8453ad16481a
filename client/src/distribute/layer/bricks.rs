//! The bricks of a volume as the layer sees them: a list that only grows, so a brick added to
//! the volume joins while fops run (a link file names a brick by its index, which never
//! changes), and where the layer learns of the bricks added since it was made.

use std::ops::Index;
use std::pin::Pin;
use std::sync::OnceLock;
use std::sync::atomic::AtomicUsize;
use std::time::{Duration, Instant};

use super::*;
use crate::distribute::layout::BRICKS_MAX;

/// How often, at most, a layer asks its [`BrickSource`] in vain.
const DISCOVERY_INTERVAL: Duration = Duration::from_secs(1);

/// Where a layer learns of bricks added to its volume since it was made (a mount asks the
/// management daemon).
pub trait BrickSource<L>: Send + Sync + 'static {
    /// The volume's bricks after its first `known`, connected, in order; none when there are
    /// no more.
    fn added(
        &self,
        known: usize,
    ) -> Pin<Box<dyn Future<Output = Result<Vec<L>, Error>> + Send + '_>>;
}

/// A list of bricks that only grows, read without a lock.
pub(super) struct Bricks<L> {
    slots: Box<[OnceLock<L>]>,
    len: AtomicUsize,
    /// Held while bricks are added; when they last were looked for.
    discovery: tokio::sync::Mutex<Option<Instant>>,
    source: Option<Box<dyn BrickSource<L>>>,
}

impl<L: Send + Sync + 'static> Bricks<L> {
    pub(super) fn new(bricks: Vec<L>) -> Result<Bricks<L>, Error> {
        if bricks.is_empty() || bricks.len() > BRICKS_MAX {
            return Err(Error::Misuse(format!(
                "a distributed volume has 1 to {BRICKS_MAX} bricks, not {}",
                bricks.len()
            )));
        }
        let slots: Box<[OnceLock<L>]> = (0..BRICKS_MAX).map(|_| OnceLock::new()).collect();
        let len = bricks.len();
        for (slot, brick) in slots.iter().zip(bricks) {
            let _ = slot.set(brick);
        }
        Ok(Bricks {
            slots,
            len: AtomicUsize::new(len),
            discovery: tokio::sync::Mutex::new(None),
            source: None,
        })
    }

    pub(super) fn set_source(&mut self, source: Box<dyn BrickSource<L>>) {
        self.source = Some(source);
    }

    pub(super) fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &L> {
        self.slots[..self.len()].iter().filter_map(OnceLock::get)
    }

    /// Asks the source for bricks added to the volume; whether any were (by this call or one
    /// that ran meanwhile).
    pub(super) async fn discover(&self) -> Result<bool, Error> {
        let Some(source) = &self.source else {
            return Ok(false);
        };
        let known = self.len();
        let mut last = self.discovery.lock().await;
        if self.len() > known {
            return Ok(true);
        }
        if last.is_some_and(|at| at.elapsed() < DISCOVERY_INTERVAL) {
            return Ok(false);
        }
        *last = Some(Instant::now());
        let added = source.added(known).await?;
        let found = !added.is_empty();
        for brick in added {
            let n = self.len();
            let slot = self.slots.get(n).ok_or_else(|| {
                Error::Misuse(format!("a volume of more than {BRICKS_MAX} bricks"))
            })?;
            assert!(
                slot.set(brick).is_ok(),
                "slot {n} of {known} bricks is taken"
            );
            self.len.store(n + 1, Ordering::Release);
        }
        if found {
            tracing::info!(bricks = self.len(), "bricks were added to the volume");
        }
        Ok(found)
    }
}

impl<L: Send + Sync + 'static> Index<usize> for Bricks<L> {
    type Output = L;

    fn index(&self, brick: usize) -> &L {
        self.slots
            .get(brick)
            .and_then(OnceLock::get)
            .unwrap_or_else(|| panic!("brick {brick} of {}", self.len()))
    }
}

impl<L: Debug + Send + Sync + 'static> Debug for Bricks<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Grow;

    impl BrickSource<u32> for Grow {
        fn added(
            &self,
            known: usize,
        ) -> Pin<Box<dyn Future<Output = Result<Vec<u32>, Error>> + Send + '_>> {
            Box::pin(async move { Ok(if known < 3 { vec![7, 8] } else { Vec::new() }) })
        }
    }

    #[tokio::test]
    async fn the_list_grows_by_what_the_source_adds() {
        let mut bricks = Bricks::new(vec![1_u32]).expect("bricks");
        assert!(!bricks.discover().await.expect("no source"));
        bricks.set_source(Box::new(Grow));
        assert!(bricks.discover().await.expect("discover"));
        assert_eq!(bricks.iter().copied().collect::<Vec<_>>(), [1, 7, 8]);
        assert_eq!(bricks[2], 8);
        // Nothing more, and not asked again within the interval.
        assert!(!bricks.discover().await.expect("discover"));
        assert!(Bricks::<u32>::new(Vec::new()).is_err());
    }
}
