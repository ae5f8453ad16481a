//! A BATCH through the layer. Its fops are bound for several bricks, so no one request carries
//! it; sent one after another, each would wait for the one before (an `rm -rf`'s UNLINKs, an
//! untar's PUTs, queued by the mount under a write lease). They run in waves instead: a wave
//! is a run of consecutive fops none of which can see another's effect — creates and removals
//! of different names (directories too), attribute changes of different objects — and runs
//! at once; a fop that could (the same name, an object made or changed in the wave, a parent
//! made or changed in it) starts the next wave, and one whose effects reach further (a
//! directory removed, which must be empty; a rename; a link; a lease) runs alone. Each fop's
//! result is the one it would have had in order.
//!
//! Within a wave, where the parent's layout is authoritative (no older layout may have placed
//! a name elsewhere), new names (PUT, MKNOD, SYMLINK) go as one BATCH per hashed brick, and
//! removals (UNLINK) as one BATCH of LOOKUPs per hashed brick, then one of UNLINKs of the
//! names found there settled (not link files, not being moved); what those could not settle
//! (EEXIST: maybe a stale link file; a link file; a moving file) and every other fop go
//! through [`Layer::call`], the whole way.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;

use kiln_wire::BatchReply;

use super::files::Look;
use super::namespace::authoritative;
use super::*;

/// Fops of one wave by the brick they go to, as their indexes in the wave.
type ByBrick = BTreeMap<usize, Vec<usize>>;

/// What a BATCH on a brick answered each fop of a wave it carried: (brick, index, answer).
type Answered = Vec<(usize, usize, Result<FopReply, ErrorCode>)>;

/// How a fop of a wave reaches a brick without the whole way through [`Layer::call`].
enum Direct {
    /// A new name, made on this brick.
    Make(usize),
    /// A removal, of a name looked up on this brick first.
    Remove(usize),
}

/// Fops of one wave, at most: what one batch puts in flight on the bricks at once.
const WAVE_FOPS_MAX: usize = 64;

impl<L: Layer> Distribute<L> {
    /// Runs `batch` wave after wave ([`waves`]); a broken connection ends it.
    pub(super) async fn batch_in_waves(&self, batch: &Batch) -> Result<BatchReply, Error> {
        let fops = batch.fops();
        let mut results = Vec::with_capacity(fops.len());
        for wave in waves(fops) {
            for answer in self.run_wave(&batch.creds, &fops[wave]).await {
                results.push(match answer {
                    Ok(reply) => Ok(reply),
                    Err(Error::Fop(code)) => Err(code),
                    Err(e) => return Err(e),
                });
            }
        }
        Ok(BatchReply { results })
    }

    /// The answers to `fops`, none of which can see another's effect, all run at once.
    async fn run_wave(&self, creds: &Creds, fops: &[FopRequest]) -> Vec<Result<FopReply, Error>> {
        let mut answers: Vec<Option<Result<FopReply, Error>>> = fops.iter().map(|_| None).collect();
        let (mut makes, mut removals) = (ByBrick::new(), ByBrick::new());
        for (i, fop) in fops.iter().enumerate() {
            match self.direct(fop).await {
                Some(Direct::Make(brick)) => makes.entry(brick).or_default().push(i),
                Some(Direct::Remove(brick)) => removals.entry(brick).or_default().push(i),
                None => {}
            }
        }
        let (made, looked_up) = tokio::join!(
            self.batches(creds, &makes, |i| fops[i].clone()),
            self.batches(creds, &removals, |i| lookup_of(&fops[i])),
        );
        for (brick, i, answer) in made {
            answers[i] = match answer {
                Ok(reply) => {
                    if let Ok(iatt) = entry_iatt(&reply) {
                        self.note_home(iatt, brick);
                    }
                    Some(Ok(reply))
                }
                // The name may be a stale link file's: the whole make clears it.
                Err(ErrorCode::Exist) => None,
                Err(code) => Some(Err(Error::Fop(code))),
            };
        }
        let (mut unlinks, mut found) = (ByBrick::new(), HashMap::new());
        for (brick, i, answer) in looked_up {
            match answer {
                Ok(FopReply::Lookup(r)) if Look::of(&r.iatt) == Look::Settled => {
                    unlinks.entry(brick).or_default().push(i);
                    found.insert(i, r.iatt);
                }
                // The layout is authoritative: a name not on its hashed brick is nowhere.
                Err(ErrorCode::NoEnt) => answers[i] = Some(Err(Error::Fop(ErrorCode::NoEnt))),
                _ => {}
            }
        }
        for (_, i, answer) in self.batches(creds, &unlinks, |i| fops[i].clone()).await {
            if answer.is_ok()
                && let Some(iatt) = found.get(&i)
                && iatt.nlink <= 1
            {
                lock(&self.homes).pop(&iatt.gfid);
            }
            answers[i] = Some(answer.map_err(Error::Fop));
        }
        let rest = answers.iter().enumerate().filter(|(_, a)| a.is_none());
        let calls = rest.map(|(i, _)| async move { (i, self.call(creds, fops[i].clone()).await) });
        for (i, answer) in futures_util::future::join_all(calls).await {
            answers[i] = Some(answer);
        }
        answers.into_iter().flatten().collect()
    }

    /// How `fop` reaches a brick directly, if it can: a new name or a removal in a parent
    /// whose layout is authoritative, by its hashed brick.
    async fn direct(&self, fop: &FopRequest) -> Option<Direct> {
        let (parent, name, direct): (_, _, fn(usize) -> Direct) = match fop {
            FopRequest::Put(r) => (r.parent, &r.name, Direct::Make),
            FopRequest::Mknod(r) => (r.parent, &r.name, Direct::Make),
            FopRequest::Symlink(r) => (r.parent, &r.name, Direct::Make),
            FopRequest::Unlink(r) => (r.parent, &r.name, Direct::Remove),
            _ => return None,
        };
        let (hashed, layout) = self.hashed(parent, name).await.ok()?;
        authoritative(&layout).then(|| direct(hashed))
    }

    /// The fops `fop_of(i)` of each brick's indexes in `by_brick`, as one BATCH per brick, all
    /// at once. A BATCH that failed as a whole answers none of its fops.
    async fn batches(
        &self,
        creds: &Creds,
        by_brick: &ByBrick,
        fop_of: impl Fn(usize) -> FopRequest,
    ) -> Answered {
        let fop_of = &fop_of;
        let sent = by_brick.iter().map(|(&brick, indexes)| async move {
            let mut batch = Batch::new(creds.clone());
            for &i in indexes {
                batch.push(fop_of(i)).ok()?;
            }
            let reply = self.bricks.get(brick).ok()?.batch(batch).await.ok()?;
            (reply.results.len() == indexes.len()).then(|| {
                let answers = indexes.iter().zip(reply.results);
                answers
                    .map(|(&i, answer)| (brick, i, answer))
                    .collect::<Vec<_>>()
            })
        });
        let answered = futures_util::future::join_all(sent).await;
        answered.into_iter().flatten().flatten().collect()
    }
}

/// The LOOKUP of the name UNLINK `fop` removes.
fn lookup_of(fop: &FopRequest) -> FopRequest {
    match fop {
        FopRequest::Unlink(r) => kiln_wire::Lookup {
            parent: r.parent,
            name: r.name.clone(),
        }
        .into(),
        other => unreachable!("a removal is an UNLINK, not {}", other.code().name()),
    }
}

/// `fops` cut into waves: consecutive runs whose fops may run at once, in order.
fn waves(fops: &[FopRequest]) -> Vec<Range<usize>> {
    let mut waves = Vec::new();
    let (mut wave, mut start) = (Wave::default(), 0);
    for (i, fop) in fops.iter().enumerate() {
        if wave.admit(fop) {
            continue;
        }
        if start < i {
            waves.push(start..i);
        }
        (wave, start) = (Wave::default(), i);
        if !wave.admit(fop) {
            // A fop that runs alone.
            waves.push(i..i + 1);
            start = i + 1;
        }
    }
    if start < fops.len() {
        waves.push(start..fops.len());
    }
    waves
}

/// What the fops admitted to a wave touch.
#[derive(Default)]
struct Wave {
    len: usize,
    /// Names made or removed.
    names: HashSet<(Gfid, Name)>,
    /// Objects made, or whose attributes change.
    changed: HashSet<Gfid>,
    /// Directories a name is made or removed in.
    parents: HashSet<Gfid>,
    /// Whether a name is removed (which may take an object with it).
    removes: bool,
    /// Whether an existing object's attributes change (one a removal may take).
    sets_attrs: bool,
}

/// What one fop touches, for a wave.
struct Access {
    name: Option<(Gfid, Name)>,
    changes: Option<Gfid>,
    parent: Option<Gfid>,
    removes: bool,
    sets_attrs: bool,
}

impl Access {
    /// What `fop` touches, if it may run beside others at all.
    fn of(fop: &FopRequest) -> Option<Access> {
        use FopRequest as Q;
        let make = |parent: Gfid, name: &Name, gfid: Gfid| Access {
            name: Some((parent, name.clone())),
            changes: Some(gfid),
            parent: Some(parent),
            removes: false,
            sets_attrs: false,
        };
        let set = |gfid: Gfid| Access {
            name: None,
            changes: Some(gfid),
            parent: None,
            removes: false,
            sets_attrs: true,
        };
        Some(match fop {
            Q::Put(r) => make(r.parent, &r.name, r.gfid),
            Q::Mkdir(r) => make(r.parent, &r.name, r.gfid),
            Q::Mknod(r) => make(r.parent, &r.name, r.gfid),
            Q::Symlink(r) => make(r.parent, &r.name, r.gfid),
            Q::Unlink(r) => Access {
                name: Some((r.parent, r.name.clone())),
                changes: None,
                parent: Some(r.parent),
                removes: true,
                sets_attrs: false,
            },
            Q::Setattr(r) => set(r.gfid),
            Q::Setxattr(r) => set(r.gfid),
            Q::Removexattr(r) => set(r.gfid),
            Q::Truncate(r) => set(r.gfid),
            _ => return None,
        })
    }
}

impl Wave {
    /// Takes `fop` into the wave if it can run beside every fop there.
    fn admit(&mut self, fop: &FopRequest) -> bool {
        let Some(access) = Access::of(fop) else {
            return false;
        };
        let clash = self.len == WAVE_FOPS_MAX
            || access.name.as_ref().is_some_and(|n| self.names.contains(n))
            || access
                .changes
                .is_some_and(|g| self.changed.contains(&g) || self.parents.contains(&g))
            || access.parent.is_some_and(|p| self.changed.contains(&p))
            || (access.removes && self.sets_attrs)
            || (access.sets_attrs && self.removes);
        if clash {
            return false;
        }
        self.len += 1;
        self.names.extend(access.name);
        self.changed.extend(access.changes);
        self.parents.extend(access.parent);
        self.removes |= access.removes;
        self.sets_attrs |= access.sets_attrs;
        true
    }
}

#[cfg(test)]
mod tests {
    use kiln_wire::{SetAttr, Unlink};

    use super::*;

    fn gfid(n: u128) -> Gfid {
        Gfid::from_bytes(n.to_le_bytes()).expect("not nil")
    }

    fn unlink(parent: u128, name: &str) -> FopRequest {
        Unlink {
            parent: gfid(parent),
            name: Name::new(Bytes::copy_from_slice(name.as_bytes())).expect("a name"),
        }
        .into()
    }

    fn setattr(object: u128) -> FopRequest {
        kiln_wire::Setattr {
            gfid: gfid(object),
            attr: SetAttr::default(),
        }
        .into()
    }

    fn mkdir(parent: u128, name: &str, gfid_of_new: u128) -> FopRequest {
        kiln_wire::Mkdir {
            parent: gfid(parent),
            name: Name::new(Bytes::copy_from_slice(name.as_bytes())).expect("a name"),
            gfid: gfid(gfid_of_new),
            mode: Mode::new(0o755).expect("mode"),
            umask: Mode::from_st_mode(0),
        }
        .into()
    }

    fn lease(dir: u128) -> FopRequest {
        kiln_wire::Lease {
            gfid: gfid(dir),
            kind: kiln_wire::LeaseKind::None,
        }
        .into()
    }

    #[test]
    fn fops_that_cannot_see_each_other_share_a_wave() {
        // Removals of different names, then the same name again; attribute changes of
        // different objects, then one a removal may take; a lease alone.
        let fops = [
            unlink(1, "a"),
            unlink(1, "b"),
            unlink(2, "a"),
            unlink(1, "a"),
            setattr(7),
            setattr(8),
            setattr(8),
            unlink(1, "c"),
            lease(1),
            setattr(1),
            unlink(1, "d"),
        ];
        assert_eq!(
            waves(&fops),
            [0..3, 3..4, 4..6, 6..7, 7..8, 8..9, 9..10, 10..11]
        );
        let many: Vec<FopRequest> = (1..=WAVE_FOPS_MAX as u128 + 1).map(setattr).collect();
        assert_eq!(
            waves(&many),
            [0..WAVE_FOPS_MAX, WAVE_FOPS_MAX..WAVE_FOPS_MAX + 1]
        );
        assert!(waves(&[]).is_empty());
    }

    #[test]
    fn what_goes_in_a_directory_made_waits_for_the_wave_that_makes_it() {
        let fops = [
            mkdir(1, "d", 5),
            unlink(1, "x"),
            mkdir(1, "e", 6),
            unlink(5, "f"),
            unlink(6, "g"),
            mkdir(1, "d", 7),
        ];
        assert_eq!(waves(&fops), [0..3, 3..6]);
    }
}
