//! A BATCH through the layer. Its fops are bound for several bricks, so no one request carries
//! it; sent one after another, each would wait for the one before (an `rm -rf`'s UNLINKs and
//! RMDIRs, an untar's MKDIRs and PUTs, queued by the mount under a write lease). They run in
//! waves instead: each fop goes in the first wave after every earlier fop that could see its
//! effect or whose effect it could see — a fop on the same name, on an object made or changed
//! before, in a directory made, changed or removed before; a removal after an attribute change
//! (it may take the object) and the other way round — and the fops of a wave (at most as many
//! as a BATCH carries) run at once. So the files of many directories go in one wave, and each
//! directory's RMDIR in the next; a new directory's write lease beside its first files. Fops
//! whose effects reach further (a rename, a link, a lease given back, an RMDIR whose directory
//! is not known beforehand) run alone, after everything before them. Each fop's result is the
//! one it would have had in order.
//!
//! Before the first wave, the layouts of the directories the batch works in are read at once
//! (one round trip, not one per directory as its turn comes), and the directory each RMDIR
//! removes is looked up on its name's hashed brick (one BATCH of LOOKUPs per brick), where no
//! fop before it in the batch names that name: its GFID places it, and its RMDIR needs no
//! lookup of its own.
//!
//! Within a wave, where the parent's layout is authoritative (no older layout may have placed
//! a name elsewhere), new names (PUT, MKNOD, SYMLINK) go as one BATCH per hashed brick, and
//! removals (UNLINK) as one BATCH of LOOKUPs per hashed brick, then one of UNLINKs of the
//! names found there settled (not link files, not being moved); what those could not settle
//! (EEXIST: maybe a stale link file; a link file; a moving file) and every other fop go
//! through [`Layer::call`], the whole way.

use std::collections::{BTreeMap, HashMap, HashSet};

use kiln_wire::{BatchReply, LeaseKind, PutSynced};

use super::files::Look;
use super::namespace::{as_unlink, authoritative};
use super::*;

/// Fops of one wave by the brick they go to, as their indexes in the batch.
type ByBrick = BTreeMap<usize, Vec<usize>>;

/// What a BATCH on a brick answered each fop it carried: (brick, index, answer).
type Answered = Vec<(usize, usize, Result<FopReply, ErrorCode>)>;

/// A directory an RMDIR of the batch removes, found before the batch runs.
struct FoundDir {
    /// The brick its name hashes to.
    hashed: usize,
    iatt: Iatt,
}

/// How a fop of a wave reaches a brick without the whole way through [`Layer::call`].
enum Direct {
    /// A new name, made on this brick.
    Make(usize),
    /// A removal, of a name looked up on this brick first.
    Remove(usize),
}

/// Fops of one wave, at most: what one batch puts in flight on the bricks at once. As many
/// as a batch carries: a wave's creates and removals go as one BATCH per brick, so a smaller
/// wave costs more requests, not less work.
const WAVE_FOPS_MAX: usize = kiln_wire::limits::BATCH_FOPS_MAX;

impl<L: Layer> Distribute<L> {
    /// Runs `batch` wave after wave ([`waves`]); a broken connection ends it.
    pub(super) async fn batch_in_waves(&self, batch: &Batch) -> Result<BatchReply, Error> {
        let (creds, fops) = (&batch.creds, batch.fops());
        self.read_layouts(fops).await;
        let removed = self.removed_dirs(creds, fops).await;
        let mut results: Vec<Option<Result<FopReply, ErrorCode>>> =
            fops.iter().map(|_| None).collect();
        for wave in waves(fops, |i| removed.get(&i).map(|dir| dir.iatt.gfid)) {
            let answers = self.run_wave(creds, fops, &wave, &removed).await;
            for (i, answer) in wave.into_iter().zip(answers) {
                results[i] = Some(match answer {
                    Ok(reply) => Ok(reply),
                    Err(Error::Fop(code)) => Err(code),
                    Err(e) => return Err(e),
                });
            }
        }
        let results = results.into_iter().map(|result| {
            result.unwrap_or_else(|| unreachable!("every fop of a batch is in one wave"))
        });
        Ok(BatchReply {
            results: results.collect(),
        })
    }

    /// Reads, all at once, the layouts of the directories `fops` make or remove names in
    /// that are not made by the batch itself (theirs are written when they are made). One
    /// that cannot be read is read again, and its error met, by the fop that needs it.
    async fn read_layouts(&self, fops: &[FopRequest]) {
        let made: HashSet<Gfid> = fops.iter().filter_map(made_dir).collect();
        let parents: HashSet<Gfid> = (fops.iter().flat_map(names_of))
            .map(|(parent, _)| parent)
            .filter(|parent| !made.contains(parent))
            .collect();
        futures_util::future::join_all(parents.into_iter().map(|dir| self.layout(dir))).await;
    }

    /// The directories `fops`' RMDIRs remove, by the RMDIR's index: looked up on their names'
    /// hashed bricks (one BATCH per brick, all at once) where the parent's layout is
    /// authoritative and no fop before the RMDIR in the batch names its name or makes its
    /// parent (so what the name holds then is what it holds now).
    async fn removed_dirs(&self, creds: &Creds, fops: &[FopRequest]) -> HashMap<usize, FoundDir> {
        let (mut named, mut made, mut by_brick) = (HashSet::new(), HashSet::new(), ByBrick::new());
        for (i, fop) in fops.iter().enumerate() {
            if let FopRequest::Rmdir(r) = fop
                && !named.contains(&(r.parent, r.name.clone()))
                && !made.contains(&r.parent)
                && let Ok((hashed, layout)) = self.hashed(r.parent, &r.name).await
                && authoritative(&layout)
            {
                by_brick.entry(hashed).or_default().push(i);
            }
            named.extend(names_of(fop));
            made.extend(made_dir(fop));
        }
        let looked_up = self
            .batches(creds, &by_brick, |i| lookup_of(&fops[i]))
            .await;
        let found = looked_up
            .into_iter()
            .filter_map(|(hashed, i, answer)| match answer {
                Ok(FopReply::Lookup(r)) if r.iatt.file_type == FileType::Directory => Some((
                    i,
                    FoundDir {
                        hashed,
                        iatt: r.iatt,
                    },
                )),
                _ => None,
            });
        found.collect()
    }

    /// The answers to the fops of `wave` (indexes into `fops`), none of which can see
    /// another's effect, all run at once.
    async fn run_wave(
        &self,
        creds: &Creds,
        fops: &[FopRequest],
        wave: &[usize],
        removed: &HashMap<usize, FoundDir>,
    ) -> Vec<Result<FopReply, Error>> {
        let mut answers: HashMap<usize, Result<FopReply, Error>> = HashMap::new();
        let (mut makes, mut settled, mut removals) =
            (ByBrick::new(), ByBrick::new(), ByBrick::new());
        for &i in wave {
            match self.direct(&fops[i]).await {
                Some(Direct::Make(brick)) => makes.entry(brick).or_default().push(i),
                Some(Direct::Remove(brick)) if self.takes_unlink_settled(brick) => {
                    settled.entry(brick).or_default().push(i);
                }
                Some(Direct::Remove(brick)) => removals.entry(brick).or_default().push(i),
                None => {}
            }
        }
        let (made, unlinked, looked_up) = tokio::join!(
            self.batches(creds, &makes, |i| fops[i].clone()),
            self.batches(creds, &settled, |i| unlink_settled_of(&fops[i])),
            self.batches(creds, &removals, |i| lookup_of(&fops[i])),
        );
        for (_, i, answer) in unlinked {
            match answer {
                // A link file or a file being moved: the whole UNLINK follows it.
                Err(ErrorCode::CrossDevice) => {}
                answer => _ = answers.insert(i, answer.map(as_unlink).map_err(Error::Fop)),
            }
        }
        for (brick, i, answer) in made {
            match answer {
                Ok(reply) => {
                    if let Ok(iatt) = entry_iatt(&reply) {
                        self.note_home(iatt, brick);
                    }
                    answers.insert(i, Ok(reply));
                }
                // The name may be a stale link file's: the whole make clears it.
                Err(ErrorCode::Exist) => {}
                Err(code) => _ = answers.insert(i, Err(Error::Fop(code))),
            }
        }
        let (mut unlinks, mut found) = (ByBrick::new(), HashMap::new());
        for (brick, i, answer) in looked_up {
            match answer {
                Ok(FopReply::Lookup(r)) if Look::of(&r.iatt) == Look::Settled => {
                    unlinks.entry(brick).or_default().push(i);
                    found.insert(i, r.iatt);
                }
                // The layout is authoritative: a name not on its hashed brick is nowhere.
                Err(ErrorCode::NoEnt) => _ = answers.insert(i, Err(Error::Fop(ErrorCode::NoEnt))),
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
            answers.insert(i, answer.map_err(Error::Fop));
        }
        let rest = wave.iter().filter(|i| !answers.contains_key(i));
        let calls = rest.map(|&i| async move {
            let answer = match (&fops[i], removed.get(&i)) {
                (FopRequest::Rmdir(r), Some(dir)) => {
                    self.remove_dir(creds, r, dir.hashed, &dir.iatt).await
                }
                (fop, _) => self.call(creds, fop.clone()).await,
            };
            (i, answer)
        });
        answers.extend(futures_util::future::join_all(calls).await);
        let answer = |i| {
            answers
                .remove(i)
                .unwrap_or_else(|| unreachable!("fop {i} answered"))
        };
        wave.iter().map(answer).collect()
    }

    /// How `fop` reaches a brick directly, if it can: a new name or a removal in a parent
    /// whose layout is authoritative, by its hashed brick.
    async fn direct(&self, fop: &FopRequest) -> Option<Direct> {
        let (parent, name, direct): (_, _, fn(usize) -> Direct) = match fop {
            FopRequest::Put(r) | FopRequest::PutSynced(PutSynced { put: r }) => {
                (r.parent, &r.name, Direct::Make)
            }
            FopRequest::Mknod(r) => (r.parent, &r.name, Direct::Make),
            FopRequest::Symlink(r) => (r.parent, &r.name, Direct::Make),
            FopRequest::Unlink(r) => (r.parent, &r.name, Direct::Remove),
            _ => return None,
        };
        self.settled_brick(parent, name).await.map(direct)
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

/// UNLINK `fop` as UNLINK_SETTLED.
fn unlink_settled_of(fop: &FopRequest) -> FopRequest {
    let FopRequest::Unlink(r) = fop else {
        unreachable!(
            "only an UNLINK goes as UNLINK_SETTLED, not {}",
            fop.code().name()
        )
    };
    let (parent, name) = (r.parent, r.name.clone());
    kiln_wire::UnlinkSettled { parent, name }.into()
}

/// The LOOKUP of the name UNLINK or RMDIR `fop` removes.
fn lookup_of(fop: &FopRequest) -> FopRequest {
    let (parent, name) = match fop {
        FopRequest::Unlink(r) => (r.parent, &r.name),
        FopRequest::Rmdir(r) => (r.parent, &r.name),
        other => unreachable!(
            "a removal is an UNLINK or RMDIR, not {}",
            other.code().name()
        ),
    };
    kiln_wire::Lookup {
        parent,
        name: name.clone(),
    }
    .into()
}

/// The directory `fop` makes, if it is a MKDIR.
fn made_dir(fop: &FopRequest) -> Option<Gfid> {
    match fop {
        FopRequest::Mkdir(r) => Some(r.gfid),
        _ => None,
    }
}

/// The names `fop` makes, removes or moves.
fn names_of(fop: &FopRequest) -> Vec<(Gfid, Name)> {
    match fop {
        FopRequest::Rename(r) => vec![
            (r.old_parent, r.old_name.clone()),
            (r.new_parent, r.new_name.clone()),
        ],
        FopRequest::Link(r) => vec![(r.new_parent, r.new_name.clone())],
        FopRequest::Create(r) => vec![(r.parent, r.name.clone())],
        fop => Access::of(fop, None)
            .and_then(|a| a.name)
            .into_iter()
            .collect(),
    }
}

/// `fops` placed in waves, as their indexes: each in the first wave, with room, after those
/// of every earlier fop it touches ([`Waves::place`]). `removed_dir(i)` is the directory the
/// RMDIR at `i` removes, when known; one not known runs alone.
fn waves(fops: &[FopRequest], removed_dir: impl Fn(usize) -> Option<Gfid>) -> Vec<Vec<usize>> {
    let mut waves = Waves::default();
    for (i, fop) in fops.iter().enumerate() {
        waves.place(i, Access::of(fop, removed_dir(i)));
    }
    waves.waves
}

/// Waves being filled, with the last wave that touched each thing.
#[derive(Default)]
struct Waves {
    waves: Vec<Vec<usize>>,
    /// Names made or removed.
    names: HashMap<(Gfid, Name), usize>,
    /// Objects made, removed, or whose attributes change.
    changed: HashMap<Gfid, usize>,
    /// Directories a name is made or removed in, or a write lease asked on.
    parents: HashMap<Gfid, usize>,
    /// A name removed (which may take an object with it).
    removes: Option<usize>,
    /// An existing object's attributes changed (one a removal may take).
    sets_attrs: Option<usize>,
    /// A fop run alone: everything after it waits for it.
    alone: Option<usize>,
}

impl Waves {
    /// Places fop `i`, which touches `access` (`None`: it runs alone, after every fop before
    /// it).
    fn place(&mut self, i: usize, access: Option<Access>) {
        let Some(a) = access else {
            self.alone = Some(self.waves.len());
            self.waves.push(vec![i]);
            return;
        };
        let after = [
            self.alone,
            a.name
                .as_ref()
                .and_then(|name| self.names.get(name).copied()),
            a.changes
                .and_then(|object| self.changed.get(&object).copied()),
            a.changes
                .and_then(|object| self.parents.get(&object).copied()),
            a.parent
                .and_then(|parent| self.changed.get(&parent).copied()),
            self.removes.filter(|_| a.sets_attrs),
            self.sets_attrs.filter(|_| a.removes),
        ];
        let first = after.into_iter().flatten().max().map_or(0, |w| w + 1);
        let room = |w: &usize| {
            self.waves
                .get(*w)
                .is_none_or(|wave| wave.len() < WAVE_FOPS_MAX)
        };
        let w = (first..)
            .find(room)
            .unwrap_or_else(|| unreachable!("waves past the last"));
        if w == self.waves.len() {
            self.waves.push(Vec::new());
        }
        self.waves[w].push(i);
        // (A fop may go before an earlier one it does not touch: the latest wave is kept.)
        if let Some(name) = a.name {
            touched(&mut self.names, name, w);
        }
        if let Some(object) = a.changes {
            touched(&mut self.changed, object, w);
        }
        if let Some(parent) = a.parent {
            touched(&mut self.parents, parent, w);
        }
        if a.removes {
            self.removes = self.removes.max(Some(w));
        }
        if a.sets_attrs {
            self.sets_attrs = self.sets_attrs.max(Some(w));
        }
    }
}

/// Records that wave `w` touched `key`, keeping the latest wave that did.
fn touched<K: Eq + std::hash::Hash>(last: &mut HashMap<K, usize>, key: K, w: usize) {
    let wave = last.entry(key).or_insert(w);
    *wave = (*wave).max(w);
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
    /// What `fop` touches, if it may run beside others at all; an RMDIR only with
    /// `removed_dir`, the directory it removes.
    fn of(fop: &FopRequest, removed_dir: Option<Gfid>) -> Option<Access> {
        use FopRequest as Q;
        let entry = |parent: Gfid, name: &Name, object: Option<Gfid>, removes: bool| Access {
            name: Some((parent, name.clone())),
            changes: object,
            parent: Some(parent),
            removes,
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
            Q::Put(r) | Q::PutSynced(PutSynced { put: r }) => {
                entry(r.parent, &r.name, Some(r.gfid), false)
            }
            Q::Mkdir(r) => entry(r.parent, &r.name, Some(r.gfid), false),
            Q::Mknod(r) => entry(r.parent, &r.name, Some(r.gfid), false),
            Q::Symlink(r) => entry(r.parent, &r.name, Some(r.gfid), false),
            // (Its object unknown: any attribute change may be of it.)
            Q::Unlink(r) => entry(r.parent, &r.name, None, true),
            Q::Rmdir(r) => entry(r.parent, &r.name, Some(removed_dir?), false),
            // Asking for a write lease on a directory changes nothing, but goes after what
            // made the directory; what removes it or changes it waits for it. (A lease given
            // back or lowered waits for every change before it: it runs alone.)
            Q::Lease(r) if r.kind == LeaseKind::Write => Access {
                name: None,
                changes: None,
                parent: Some(r.gfid),
                removes: false,
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
            kind: LeaseKind::None,
        }
        .into()
    }

    fn rmdir(parent: u128, name: &str) -> FopRequest {
        kiln_wire::Rmdir {
            parent: gfid(parent),
            name: Name::new(Bytes::copy_from_slice(name.as_bytes())).expect("a name"),
        }
        .into()
    }

    /// No RMDIR's directory known.
    fn unknown(_: usize) -> Option<Gfid> {
        None
    }

    #[test]
    fn fops_that_cannot_see_each_other_share_a_wave() {
        // Removals of different names, then the same name again; attribute changes of
        // different objects, then one a removal may take; a lease alone, and everything
        // after it later.
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
        let expected: [&[usize]; 8] = [&[0, 1, 2], &[3], &[4, 5], &[6], &[7], &[8], &[9], &[10]];
        assert_eq!(waves(&fops, unknown), expected);
        let many: Vec<FopRequest> = (1..=WAVE_FOPS_MAX as u128 + 1).map(setattr).collect();
        let full: Vec<usize> = (0..WAVE_FOPS_MAX).collect();
        assert_eq!(waves(&many, unknown), [full, vec![WAVE_FOPS_MAX]]);
        assert!(waves(&[], unknown).is_empty());
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
        assert_eq!(waves(&fops, unknown), [vec![0, 1, 2], vec![3, 4, 5]]);
    }

    #[test]
    fn a_write_lease_goes_after_its_directory_is_made_and_beside_what_goes_in_it() {
        let ask = |dir: u128| -> FopRequest {
            kiln_wire::Lease {
                gfid: gfid(dir),
                kind: LeaseKind::Write,
            }
            .into()
        };
        let fops = [
            mkdir(1, "d", 5),
            ask(5),
            unlink(5, "f"),
            mkdir(1, "e", 6),
            rmdir(1, "d"),
        ];
        let removed = |i| (i == 4).then(|| gfid(5));
        let expected: [&[usize]; 3] = [&[0, 3], &[1, 2], &[4]];
        assert_eq!(waves(&fops, removed), expected);
    }

    #[test]
    fn a_directory_is_removed_after_what_was_in_it_and_before_what_follows_in_it() {
        // `rm -rf` of 1/d (5) and 1/e (6), then of 1 itself from 9: the files of both
        // directories first, then both RMDIRs, then 1's. An RMDIR whose directory is not
        // known runs alone, after everything before it.
        let fops = [
            unlink(5, "x"),
            rmdir(1, "d"),
            unlink(6, "y"),
            rmdir(1, "e"),
            rmdir(9, "p"),
            rmdir(1, "f"),
            unlink(7, "z"),
            unlink(5, "w"),
        ];
        let removed = |i| match i {
            1 => Some(gfid(5)),
            3 => Some(gfid(6)),
            4 => Some(gfid(1)),
            _ => None,
        };
        let expected: [&[usize]; 5] = [&[0, 2], &[1, 3], &[4], &[5], &[6, 7]];
        assert_eq!(waves(&fops, removed), expected);
        // The same batch with no directory known: every RMDIR alone.
        let expected: [&[usize]; 7] = [&[0], &[1], &[2], &[3], &[4], &[5], &[6, 7]];
        assert_eq!(waves(&fops, unknown), expected);
    }
}
