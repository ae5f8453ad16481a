//! What listings under a lease returned (`docs/wire.md`, "Listed attributes"): which objects'
//! attributes a lease holder may keep, by the directories they were listed in, so that a
//! change to one recalls the leases on those directories. Plain data; the table keeps it.

use std::collections::HashMap;

use kiln_wire::Gfid;

/// Objects listed under leases, counted once per directory they were listed in, at most;
/// past it a listing is not covered (its lease is recalled).
const LISTED_MAX: usize = 262_144;

/// What a listing under a lease needs once its objects are known ([`super::Leases::cover`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cover {
    /// The lease covers the attributes read.
    Covered,
    /// Covered from now on, but a change may have landed since the attributes were read:
    /// read them again.
    Restat,
    /// Not covered: the session holds no lease there, or it was recalled (an object was being
    /// changed by another session, or the index is full).
    Uncovered,
}

/// Objects by the directories they were listed in, and the other way round.
#[derive(Debug, Default)]
pub(super) struct Listed {
    dirs_of: HashMap<Gfid, Vec<Gfid>>,
    objects_in: HashMap<Gfid, Vec<Gfid>>,
    len: usize,
}

impl Listed {
    /// The directories `object` was listed in.
    pub(super) fn dirs_of(&self, object: &Gfid) -> &[Gfid] {
        self.dirs_of.get(object).map_or(&[], Vec::as_slice)
    }

    /// Notes `objects` as listed in `dir`; false (and nothing noted) when that would pass
    /// [`LISTED_MAX`].
    pub(super) fn insert(&mut self, dir: Gfid, objects: &[Gfid]) -> bool {
        if self.len + objects.len() > LISTED_MAX {
            return false;
        }
        let listed = self.objects_in.entry(dir).or_default();
        for object in objects {
            let dirs = self.dirs_of.entry(*object).or_default();
            if !dirs.contains(&dir) {
                dirs.push(dir);
                listed.push(*object);
                self.len += 1;
            }
        }
        true
    }

    /// Forgets what was listed in `dir` (no lease covers it any more).
    pub(super) fn forget_dir(&mut self, dir: &Gfid) {
        let Some(objects) = self.objects_in.remove(dir) else {
            return;
        };
        self.len -= objects.len();
        for object in objects {
            if let Some(dirs) = self.dirs_of.get_mut(&object) {
                dirs.retain(|d| d != dir);
                if dirs.is_empty() {
                    self.dirs_of.remove(&object);
                }
            }
        }
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gfid(n: u8) -> Gfid {
        Gfid::from_bytes([n; 16]).expect("not null")
    }

    #[test]
    fn objects_are_found_by_every_directory_they_were_listed_in_until_it_is_forgotten() {
        let mut listed = Listed::default();
        let (p, q, x, y) = (gfid(1), gfid(2), gfid(3), gfid(4));
        assert!(listed.insert(p, &[x, y]));
        assert!(listed.insert(p, &[x]), "listed again: counted once");
        assert!(listed.insert(q, &[x]), "a hard link in another directory");
        assert_eq!(listed.len(), 3);
        assert_eq!(listed.dirs_of(&x), [p, q]);
        listed.forget_dir(&p);
        assert_eq!(listed.dirs_of(&x), [q]);
        assert!(listed.dirs_of(&y).is_empty());
        listed.forget_dir(&q);
        assert_eq!(listed.len(), 0);
        assert!(listed.dirs_of.is_empty() && listed.objects_in.is_empty());
    }

    #[test]
    fn the_index_is_bounded() {
        let mut listed = Listed::default();
        let many: Vec<Gfid> = (0..LISTED_MAX as u32 - 1)
            .map(|i| {
                let mut b = [0xff; 16];
                b[..4].copy_from_slice(&i.to_le_bytes());
                Gfid::from_bytes(b).expect("not null")
            })
            .collect();
        assert!(listed.insert(gfid(1), &many));
        assert!(
            !listed.insert(gfid(2), &[gfid(3), gfid(4)]),
            "over the bound"
        );
        assert!(listed.dirs_of(&gfid(3)).is_empty(), "nothing noted");
        assert!(listed.insert(gfid(2), &[gfid(3)]), "exactly at the bound");
    }
}
