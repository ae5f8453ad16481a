//! The bricks of a volume as the layer sees them: a list that only grows, so a brick added to
//! the volume joins while fops run (a link file names a brick by its index, which never
//! changes), each with its [`BrickRole`] — a brick removed keeps its place, unused — and
//! where the layer learns of bricks added and roles changed since it was made.

use std::ops::Range;
use std::pin::Pin;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, AtomicUsize};
use std::time::{Duration, Instant};

use kiln_admin::volume::BrickRole;

use super::*;
use crate::distribute::layout::BRICKS_MAX;

/// How often, at most, a layer asks its [`BrickSource`]: how long a mount may go on placing
/// new directories' names by roles a `remove-brick` has changed.
pub const BRICKS_REFRESH: Duration = Duration::from_secs(1);

/// A brick of a volume as the layer is given it.
#[derive(Debug)]
pub enum Member<L> {
    Serving(L),
    /// Being emptied: in service, but given no share of any directory.
    Leaving(L),
    /// Removed from the volume: its index stays taken.
    Removed,
}

impl<L> Member<L> {
    /// `brick` in `role` (dropped when removed).
    pub fn new(brick: L, role: BrickRole) -> Member<L> {
        match role {
            BrickRole::Serving => Member::Serving(brick),
            BrickRole::Leaving => Member::Leaving(brick),
            BrickRole::Removed => Member::Removed,
        }
    }

    pub fn role(&self) -> BrickRole {
        match self {
            Member::Serving(_) => BrickRole::Serving,
            Member::Leaving(_) => BrickRole::Leaving,
            Member::Removed => BrickRole::Removed,
        }
    }

    /// The brick, unless removed.
    pub fn brick(&self) -> Option<&L> {
        match self {
            Member::Serving(brick) | Member::Leaving(brick) => Some(brick),
            Member::Removed => None,
        }
    }

    fn split(self) -> (Option<L>, BrickRole) {
        let role = self.role();
        match self {
            Member::Serving(brick) | Member::Leaving(brick) => (Some(brick), role),
            Member::Removed => (None, role),
        }
    }
}

/// Where a layer learns of bricks added to its volume, and of bricks leaving or removed,
/// since it was made (a mount asks the management daemon).
pub trait BrickSource<L>: Send + Sync + 'static {
    /// The role of every brick of the volume, in order, and the bricks after its first
    /// `known`, connected unless removed.
    fn members(
        &self,
        known: usize,
    ) -> Pin<Box<dyn Future<Output = Result<Listed<L>, Error>> + Send + '_>>;
}

/// What a [`BrickSource`] lists.
#[derive(Debug)]
pub struct Listed<L> {
    /// Every brick's role, in order.
    pub roles: Vec<BrickRole>,
    /// The bricks after the first `known` asked for.
    pub added: Vec<Member<L>>,
}

/// A list of bricks that only grows, read without a lock.
pub(super) struct Bricks<L> {
    slots: Box<[OnceLock<L>]>,
    /// Each slot's [`BrickRole`], as `role_code`.
    roles: Box<[AtomicU8]>,
    len: AtomicUsize,
    /// Held while the source is asked.
    asking: tokio::sync::Mutex<()>,
    /// Held while the layer asks; when it last asked in vain.
    in_vain: tokio::sync::Mutex<Option<Instant>>,
    /// When the source last answered.
    answered: Mutex<Option<Instant>>,
    /// Bumped at every change of the bricks or their roles.
    generation: AtomicU64,
    source: Option<Box<dyn BrickSource<L>>>,
    /// Called with each brick as it joins, before any fop reaches it.
    joined: Option<Joined<L>>,
}

/// What [`Bricks`] calls with each brick as it joins the list.
pub(super) type Joined<L> = Box<dyn Fn(&L) + Send + Sync>;

impl<L: Send + Sync + 'static> Bricks<L> {
    /// The list of `members`, each given to `joined` (and so is each brick that joins later).
    pub(super) fn new(
        members: Vec<Member<L>>,
        joined: Option<Joined<L>>,
    ) -> Result<Bricks<L>, Error> {
        if members.is_empty() || members.len() > BRICKS_MAX {
            return Err(Error::Misuse(format!(
                "a distributed volume has 1 to {BRICKS_MAX} bricks, not {}",
                members.len()
            )));
        }
        let bricks = Bricks {
            slots: (0..BRICKS_MAX).map(|_| OnceLock::new()).collect(),
            roles: (0..BRICKS_MAX).map(|_| AtomicU8::new(0)).collect(),
            len: AtomicUsize::new(0),
            asking: tokio::sync::Mutex::new(()),
            in_vain: tokio::sync::Mutex::new(None),
            answered: Mutex::new(None),
            generation: AtomicU64::new(0),
            source: None,
            joined,
        };
        for member in members {
            bricks.push(member)?;
        }
        if bricks.in_service().next().is_none() {
            return Err(Error::Misuse("every brick of the volume is removed".into()));
        }
        Ok(bricks)
    }

    fn push(&self, member: Member<L>) -> Result<(), Error> {
        let n = self.len();
        let slot = self
            .slots
            .get(n)
            .ok_or_else(|| Error::Misuse(format!("a volume of more than {BRICKS_MAX} bricks")))?;
        let (brick, role) = member.split();
        if let Some(brick) = brick {
            if let Some(joined) = &self.joined {
                joined(&brick);
            }
            assert!(slot.set(brick).is_ok(), "slot {n} is taken");
        }
        self.roles[n].store(role_code(role), Ordering::Release);
        self.len.store(n + 1, Ordering::Release);
        Ok(())
    }

    /// Makes `source` the one asked; the bricks this list was made with are taken for its
    /// latest answer.
    pub(super) fn set_source(&mut self, source: Box<dyn BrickSource<L>>) {
        self.source = Some(source);
        *lock(&self.answered) = Some(Instant::now());
    }

    /// How many bricks the volume has had: the indexes in use, removed ones included.
    pub(super) fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }

    pub(super) fn indexes(&self) -> Range<usize> {
        0..self.len()
    }

    /// The role of brick `brick`; one this layer does not know counts as removed.
    pub(super) fn role(&self, brick: usize) -> BrickRole {
        if brick >= self.len() {
            return BrickRole::Removed;
        }
        match self.roles[brick].load(Ordering::Acquire) {
            0 => BrickRole::Serving,
            1 => BrickRole::Leaving,
            _ => BrickRole::Removed,
        }
    }

    /// Brick `brick`, unless it is removed (or not known): `ENOTCONN` then, as for a brick
    /// out of reach.
    pub(super) fn get(&self, brick: usize) -> Result<&L, Error> {
        match self.role(brick).in_service() {
            true => self.slots[brick].get(),
            false => None,
        }
        .ok_or(Error::Fop(ErrorCode::NotConnected))
    }

    /// The bricks in service (serving or leaving), with their indexes.
    pub(super) fn in_service(&self) -> impl Iterator<Item = (usize, &L)> {
        self.indexes().filter_map(|i| Some((i, self.get(i).ok()?)))
    }

    /// Each brick's share of a new layout: 1 for a serving brick, 0 for the others.
    pub(super) fn weights(&self) -> Vec<u32> {
        let share = |i| u32::from(self.role(i).is_serving());
        self.indexes().map(share).collect()
    }

    /// Asks the source for bricks added to the volume and roles changed — when the layer
    /// finds something it does not know: at most once per [`BRICKS_REFRESH`] in vain —
    /// whether anything changed (by this call or one that ran meanwhile).
    pub(super) async fn refresh(&self) -> Result<bool, Error> {
        if self.source.is_none() {
            return Ok(false);
        }
        let before = self.generation();
        let mut in_vain = self.in_vain.lock().await;
        if self.generation() != before {
            return Ok(true);
        }
        if in_vain.is_some_and(|at| at.elapsed() < BRICKS_REFRESH) {
            return Ok(false);
        }
        self.ask_source().await?;
        // (Or the periodic ask, which ran meanwhile.)
        let changed = self.generation() != before;
        if !changed {
            *in_vain = Some(Instant::now());
        }
        Ok(changed)
    }

    /// Asks the source (none: nothing changes); a change bumps the [`Bricks::generation`].
    pub(super) async fn ask_source(&self) -> Result<(), Error> {
        let Some(source) = &self.source else {
            return Ok(());
        };
        let _one_at_a_time = self.asking.lock().await;
        let known = self.len();
        let listed = source.members(known).await?;
        if listed.roles.len() != known + listed.added.len() {
            return Err(Error::Protocol(format!(
                "the volume lists {} roles for {known} + {} bricks",
                listed.roles.len(),
                listed.added.len()
            )));
        }
        let mut changed = !listed.added.is_empty();
        for member in listed.added {
            self.push(member)?;
        }
        for (i, role) in listed.roles.into_iter().enumerate() {
            // A brick removed stays removed: its client is gone.
            let code = role_code(role);
            if self.role(i).in_service() && self.roles[i].swap(code, Ordering::AcqRel) != code {
                changed = true;
            }
        }
        *lock(&self.answered) = Some(Instant::now());
        if changed {
            self.generation.fetch_add(1, Ordering::AcqRel);
            let roles: Vec<BrickRole> = self.indexes().map(|i| self.role(i)).collect();
            tracing::info!(bricks = self.len(), ?roles, "the volume's bricks changed");
        }
        Ok(())
    }

    /// How many times the bricks or their roles changed since the layer was made.
    pub(super) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Whether this layer knows every brick there is: it has no source to learn of others
    /// from (a rebalance's, made from the daemon's list of the moment).
    pub(super) fn knows_all(&self) -> bool {
        self.source.is_none()
    }

    /// Whether the roles are known to be current: there is no source (the layer's bricks are
    /// all there is), or it answered within two [`BRICKS_REFRESH`].
    pub(super) fn roles_current(&self) -> bool {
        let answered = *lock(&self.answered);
        self.source.is_none() || answered.is_some_and(|at| at.elapsed() < BRICKS_REFRESH * 2)
    }
}

fn role_code(role: BrickRole) -> u8 {
    match role {
        BrickRole::Serving => 0,
        BrickRole::Leaving => 1,
        BrickRole::Removed => 2,
    }
}

impl<L: Debug + Send + Sync + 'static> Debug for Bricks<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.in_service()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Grow;

    impl BrickSource<u32> for Grow {
        fn members(
            &self,
            known: usize,
        ) -> Pin<Box<dyn Future<Output = Result<Listed<u32>, Error>> + Send + '_>> {
            Box::pin(async move {
                let added = match known {
                    1 => vec![Member::Removed, Member::Serving(8)],
                    _ => Vec::new(),
                };
                let roles = vec![BrickRole::Leaving, BrickRole::Removed, BrickRole::Serving];
                Ok(Listed { roles, added })
            })
        }
    }

    #[tokio::test]
    async fn the_list_grows_and_its_roles_change_as_the_source_says() {
        let mut bricks = Bricks::new(vec![Member::Serving(1_u32)], None).expect("bricks");
        assert!(!bricks.refresh().await.expect("no source"));
        bricks.set_source(Box::new(Grow));
        assert!(bricks.refresh().await.expect("refresh"));
        // Brick 1 was removed before this layer heard of it: its place stays, unused. Brick
        // 0 is leaving: in service, with no share.
        assert_eq!(bricks.len(), 3);
        let in_service: Vec<_> = bricks.in_service().map(|(i, b)| (i, *b)).collect();
        assert_eq!(in_service, [(0, 1), (2, 8)]);
        assert!(matches!(
            bricks.get(1),
            Err(Error::Fop(ErrorCode::NotConnected))
        ));
        assert_eq!(bricks.weights(), [0, 0, 1]);
        assert_eq!(*bricks.get(2).expect("brick 2"), 8);
        // Not asked again within the interval.
        assert!(!bricks.refresh().await.expect("refresh"));
        assert!(Bricks::<u32>::new(Vec::new(), None).is_err());
        assert!(Bricks::<u32>::new(vec![Member::Removed], None).is_err());
    }
}
