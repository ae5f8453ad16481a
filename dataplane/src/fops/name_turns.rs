//! Turns on names: the namespace fops that change a name (make, remove or rename it) take
//! turns on that name, brick-wide, as the kernel's directory lock has them take turns inside
//! one directory. A brick fop is several system calls (resolve the name's object, then
//! change its handle and its name); without turns, a RENAME onto a name and an UNLINK of it
//! interleave — the unlink resolves the old object, the rename replaces it, and the unlink
//! then removes the name of the object the rename put there, leaving that one alive under
//! its handle with no name. Lookups and reads take no turn.
//!
//! Names map onto a fixed set of stripes (an async mutex each), so unrelated names may wait
//! for each other now and then; a RENAME takes its two stripes in ascending order, so no
//! two fops wait for each other.

use std::hash::{BuildHasher, Hash, Hasher};

use kiln_wire::{FopRequest, Gfid, Name, PutSynced};
use tokio::sync::{Mutex, MutexGuard};

/// Stripes: a collision between two names in use at once is a 1 in this chance.
const STRIPES: usize = 1024;

/// The turns on every name of a brick.
#[derive(Debug)]
pub(crate) struct NameTurns {
    stripes: Box<[Mutex<()>]>,
    hasher: std::hash::RandomState,
}

/// A fop's turn on the names it changes; they are free again when it goes.
#[derive(Debug)]
pub(crate) struct Turn<'a> {
    _held: [Option<MutexGuard<'a, ()>>; 2],
}

impl NameTurns {
    pub(crate) fn new() -> NameTurns {
        NameTurns {
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            hasher: std::hash::RandomState::new(),
        }
    }

    /// Waits for, and takes, the turn on every name `fop` changes (none for a fop that
    /// changes no name).
    pub(crate) async fn take(&self, fop: &FopRequest) -> Turn<'_> {
        let mut stripes = changed_names(fop).map(|named| named.map(|(p, n)| self.stripe(p, n)));
        stripes.sort_unstable();
        if stripes[0].is_some() && stripes[0] == stripes[1] {
            stripes[1] = None;
        }
        // `None` sorts first: take the lower stripe, then the higher.
        let mut held = [None, None];
        for (slot, stripe) in held.iter_mut().zip(stripes.into_iter().flatten()) {
            *slot = Some(self.stripes[stripe].lock().await);
        }
        Turn { _held: held }
    }

    fn stripe(&self, parent: &Gfid, name: &Name) -> usize {
        let mut h = self.hasher.build_hasher();
        parent.hash(&mut h);
        name.as_bytes().hash(&mut h);
        usize::try_from(h.finish() % STRIPES as u64).expect("below STRIPES")
    }
}

/// The names (parent, name) `fop` makes, removes or renames.
fn changed_names(fop: &FopRequest) -> [Option<(&Gfid, &Name)>; 2] {
    use FopRequest as Q;
    let one = |parent, name| [Some((parent, name)), None];
    match fop {
        Q::Create(r) => one(&r.parent, &r.name),
        Q::Put(r) | Q::PutSynced(PutSynced { put: r }) => one(&r.parent, &r.name),
        Q::Mkdir(r) => one(&r.parent, &r.name),
        Q::Mknod(r) => one(&r.parent, &r.name),
        Q::Symlink(r) => one(&r.parent, &r.name),
        Q::Link(r) => one(&r.new_parent, &r.new_name),
        Q::Unlink(r) => one(&r.parent, &r.name),
        Q::UnlinkSettled(r) => one(&r.parent, &r.name),
        Q::Rmdir(r) => one(&r.parent, &r.name),
        Q::Rename(r) => [
            Some((&r.old_parent, &r.old_name)),
            Some((&r.new_parent, &r.new_name)),
        ],
        _ => [None, None],
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kiln_wire::{Rename, RenameMode, Rmdir, Stat};

    use super::*;

    fn name(s: &str) -> Name {
        Name::new(s.to_owned()).expect("name")
    }

    fn rename(from: &str, to: &str) -> FopRequest {
        Rename {
            old_parent: Gfid::ROOT,
            old_name: name(from),
            new_parent: Gfid::ROOT,
            new_name: name(to),
            mode: RenameMode::Replace,
        }
        .into()
    }

    fn rmdir(n: &str) -> FopRequest {
        Rmdir {
            parent: Gfid::ROOT,
            name: name(n),
        }
        .into()
    }

    /// Whether a turn for `fop` is free now (taken within a moment).
    async fn free(turns: &NameTurns, fop: &FopRequest) -> bool {
        tokio::time::timeout(Duration::from_millis(50), turns.take(fop))
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn fops_on_one_name_take_turns_and_others_do_not_wait() {
        let turns = NameTurns::new();
        let held = turns.take(&rename("a", "b")).await;
        assert!(!free(&turns, &rmdir("a")).await, "the rename's source");
        assert!(!free(&turns, &rmdir("b")).await, "the rename's target");
        // Another name waits only if it shares a stripe with one of the two.
        let free_names = (0..64)
            .map(|i| format!("other{i}"))
            .filter(|n| {
                let s = turns.stripe(&Gfid::ROOT, &name(n));
                s != turns.stripe(&Gfid::ROOT, &name("a"))
                    && s != turns.stripe(&Gfid::ROOT, &name("b"))
            })
            .collect::<Vec<_>>();
        assert!(!free_names.is_empty());
        for n in &free_names {
            assert!(free(&turns, &rmdir(n)).await, "{n}");
        }
        let stat = Stat { gfid: Gfid::ROOT }.into();
        assert!(free(&turns, &stat).await, "a fop that changes no name");
        drop(held);
        assert!(free(&turns, &rmdir("a")).await);
        // A rename onto its own name takes its one stripe once.
        assert!(free(&turns, &rename("a", "a")).await);
    }
}
