//! A directory's DHT layout: which range of the 32-bit hash space each brick holds, how
//! GlusterFS stores it in `trusted.glusterfs.dht`, and how GlusterFS builds one.
//!
//! Bricks are numbered by their place in the volume's brick list (GlusterFS's subvolume
//! `VOL-client-N`; with replication, the N-th replica set).

use super::Error;
use super::hash::{Munging, dm_hash, name_hash};

/// The xattr that holds a brick's range on each directory.
pub const XATTR_NAME: &str = "trusted.glusterfs.dht";
/// Bytes in a `trusted.glusterfs.dht` value: four big-endian 32-bit words.
pub const XATTR_LEN: usize = 16;
/// Most bricks one layout spans. With equal shares each range is still 4 Mi hashes wide, and
/// [`Layout::rebalanced`]'s search stays quadratic in a small number.
pub const BRICKS_MAX: usize = 1024;
/// GlusterFS's `DHT_LAYOUT_HASH_INVALID`: the commit hash of a layout no rebalance has
/// committed (GlusterFS heals the volume root with it), so a lookup that misses on the hashed
/// brick must still look on the others.
pub const COMMIT_HASH_INVALID: u32 = 1;
/// The commit hash Kiln writes with a layout every name of the directory follows (each on its
/// hashed brick, or behind a link file there): a new directory's, or one a rebalance went
/// through.
pub const COMMIT_HASH_COMMITTED: u32 = 0;

/// How many distinct hashes there are.
const HASH_SPACE: u64 = 1 << 32;

// Equal shares give every brick a range of at least two hashes (GlusterFS reads a range
// whose start equals its stop as no share at all).
const _: () = assert!(u32::MAX as usize / BRICKS_MAX >= 2);

/// The hashes `[start, stop]` (both included) one brick holds; never empty, and never a
/// single hash, which GlusterFS cannot tell from "no range".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HashRange {
    start: u32,
    stop: u32,
}

impl HashRange {
    /// `[start, stop]`, or `None` unless `start < stop`.
    pub fn new(start: u32, stop: u32) -> Option<HashRange> {
        (start < stop).then_some(HashRange { start, stop })
    }

    /// The first hash in the range.
    pub fn start(self) -> u32 {
        self.start
    }

    /// The last hash in the range.
    pub fn stop(self) -> u32 {
        self.stop
    }

    /// Whether `hash` falls in the range.
    pub fn contains(self, hash: u32) -> bool {
        (self.start..=self.stop).contains(&hash)
    }

    /// How many hashes the range holds (2 to 2^32).
    pub fn hashes(self) -> u64 {
        u64::from(self.stop) - u64::from(self.start) + 1
    }

    /// How many of the hashes `[start, start + len)` the range holds.
    fn overlap(self, start: u64, len: u64) -> u64 {
        let from = start.max(u64::from(self.start));
        let to = (start + len).min(u64::from(self.stop) + 1);
        to.saturating_sub(from)
    }
}

/// The hash function a layout was made for (the second word of the xattr).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HashType {
    /// `DHT_HASH_TYPE_DM`: [`dm_hash`]; what GlusterFS writes.
    #[default]
    Dm,
    /// `DHT_HASH_TYPE_DM_USER`: the same hash on a layout a user set by hand, which
    /// GlusterFS's fix-layout leaves alone.
    DmUser,
}

impl HashType {
    fn code(self) -> u32 {
        match self {
            HashType::Dm => 0,
            HashType::DmUser => 1,
        }
    }

    fn from_code(value: u32) -> Result<HashType, Error> {
        match value {
            0 => Ok(HashType::Dm),
            1 => Ok(HashType::DmUser),
            _ => Err(Error::HashType { value }),
        }
    }
}

/// One brick's `trusted.glusterfs.dht` value on one directory.
///
/// GlusterFS 10 writes four big-endian 32-bit words (`dht_disk_layout_extract`): the commit
/// hash, the hash type, the range's start, its stop. A brick with no share (left out of the
/// layout: full, being removed) gets `start = stop = 0`, which reads back as `range: None`;
/// so does any value with `start == stop`, as GlusterFS treats it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskLayout {
    /// The volume commit hash the layout was written under ([`COMMIT_HASH_INVALID`] if none).
    pub commit_hash: u32,
    pub hash_type: HashType,
    /// This brick's range, if it has a share.
    pub range: Option<HashRange>,
}

impl DiskLayout {
    /// The xattr value.
    pub fn encode(&self) -> [u8; XATTR_LEN] {
        let (start, stop) = self.range.map_or((0, 0), |r| (r.start, r.stop));
        let mut value = [0u8; XATTR_LEN];
        let words = [self.commit_hash, self.hash_type.code(), start, stop];
        for (bytes, word) in value.chunks_exact_mut(4).zip(words) {
            bytes.copy_from_slice(&word.to_be_bytes());
        }
        value
    }

    /// Reads an xattr value; fails on a wrong length, an unknown hash type or a range that
    /// stops before it starts.
    pub fn decode(value: &[u8]) -> Result<DiskLayout, Error> {
        let value: &[u8; XATTR_LEN] = value
            .try_into()
            .map_err(|_| Error::XattrLength { len: value.len() })?;
        let word = |i: usize| {
            u32::from_be_bytes([
                value[4 * i],
                value[4 * i + 1],
                value[4 * i + 2],
                value[4 * i + 3],
            ])
        };
        let (start, stop) = (word(2), word(3));
        if start > stop {
            return Err(Error::InvertedRange { start, stop });
        }
        Ok(DiskLayout {
            commit_hash: word(0),
            hash_type: HashType::from_code(word(1))?,
            range: HashRange::new(start, stop),
        })
    }
}

/// What is wrong with a layout's ranges (GlusterFS's `dht_layout_anomalies`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Anomalies {
    /// Runs of hashes no brick holds: a name that hashes there has no brick.
    pub holes: u32,
    /// Ranges that start inside an earlier one: a name there is on one of two bricks.
    pub overlaps: u32,
}

impl Anomalies {
    /// Whether every hash has exactly one brick.
    pub fn is_empty(&self) -> bool {
        self.holes == 0 && self.overlaps == 0
    }
}

/// A directory's layout: per brick of the volume, its hash range if it has one, and the
/// commit hash the layout was written under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    commit_hash: u32,
    hash_type: HashType,
    /// Indexed by brick.
    ranges: Vec<Option<HashRange>>,
}

impl Layout {
    /// The layout GlusterFS gives a new directory (`dht_selfheal_layout_new_directory`).
    ///
    /// `weights[b]` is brick `b`'s share (0: no range); see [`weights_for`] for how
    /// GlusterFS picks them. Bricks take consecutive ranges from hash 0 up, in GlusterFS's
    /// order (by subvolume name, so brick 10 comes before brick 2), starting at `first`
    /// (see [`first_brick`]) and wrapping around; a share is `u32::MAX / total × weight`,
    /// truncated, and the last brick takes the rest. Equal weights give every brick
    /// `u32::MAX / n` hashes.
    pub fn new_directory(weights: &[u32], first: usize, commit_hash: u32) -> Result<Layout, Error> {
        let bricks = check_brick_count(weights.len())?;
        let mut order = glusterfs_order(bricks);
        let Some(at) = order.iter().position(|&b| b == first) else {
            return Err(Error::NoSuchBrick {
                brick: first,
                bricks,
            });
        };
        order.rotate_left(at);
        order.retain(|&b| weights[b] > 0);
        if order.is_empty() {
            return Err(Error::NoShares);
        }
        Ok(Layout {
            commit_hash,
            hash_type: HashType::Dm,
            ranges: lay_out(&order, weights, bricks),
        })
    }

    /// The layout that bricks' `trusted.glusterfs.dht` values describe, one entry per brick
    /// of the volume (`None`: the brick has no value, or no copy of the directory).
    ///
    /// The commit hash is the one all values agree on, else [`COMMIT_HASH_INVALID`]
    /// (GlusterFS keeps the first non-zero one it reads when some are 0; treating any
    /// disagreement as "not committed" costs lookups, never a wrong answer).
    pub fn from_disk(bricks: &[Option<DiskLayout>]) -> Result<Layout, Error> {
        check_brick_count(bricks.len())?;
        let mut commit_hashes = bricks.iter().flatten().map(|d| d.commit_hash);
        let commit_hash = match commit_hashes.next() {
            None => 0,
            Some(first) if commit_hashes.all(|h| h == first) => first,
            Some(_) => COMMIT_HASH_INVALID,
        };
        let user_set = bricks
            .iter()
            .flatten()
            .any(|d| d.hash_type == HashType::DmUser);
        Ok(Layout {
            commit_hash,
            hash_type: if user_set {
                HashType::DmUser
            } else {
                HashType::Dm
            },
            ranges: bricks.iter().map(|d| d.and_then(|d| d.range)).collect(),
        })
    }

    /// The value to store on `brick`'s copy of the directory; `None` if there is no such
    /// brick.
    pub fn disk_layout(&self, brick: usize) -> Option<DiskLayout> {
        Some(DiskLayout {
            commit_hash: self.commit_hash,
            hash_type: self.hash_type,
            range: *self.ranges.get(brick)?,
        })
    }

    /// How many bricks the layout spans, with a range or not.
    pub fn brick_count(&self) -> usize {
        self.ranges.len()
    }

    /// `brick`'s range, if it has one.
    pub fn range(&self, brick: usize) -> Option<HashRange> {
        self.ranges.get(brick).copied().flatten()
    }

    /// The volume commit hash the layout was written under.
    pub fn commit_hash(&self) -> u32 {
        self.commit_hash
    }

    /// The hash type the layout was written with.
    pub fn hash_type(&self) -> HashType {
        self.hash_type
    }

    /// The same ranges under another commit hash (a rebalance commits a layout by writing
    /// the volume's new commit hash).
    pub fn with_commit_hash(mut self, commit_hash: u32) -> Layout {
        self.commit_hash = commit_hash;
        self
    }

    /// The brick whose range holds `hash`; in a layout with overlaps, the one whose range
    /// starts first, as GlusterFS searches a sorted layout.
    pub fn brick_for_hash(&self, hash: u32) -> Option<usize> {
        self.ranges
            .iter()
            .enumerate()
            .filter_map(|(brick, range)| {
                let range = range.filter(|r| r.contains(hash))?;
                Some((range.start, brick))
            })
            .min()
            .map(|(_, brick)| brick)
    }

    /// The brick `name` belongs on in this directory (GlusterFS's hashed subvolume); `None`
    /// if its hash falls in a hole.
    pub fn hashed_brick(&self, name: &[u8], munging: Munging) -> Option<usize> {
        self.brick_for_hash(name_hash(name, munging))
    }

    /// The holes and overlaps in the ranges.
    pub fn anomalies(&self) -> Anomalies {
        let mut ranges: Vec<HashRange> = self.ranges.iter().flatten().copied().collect();
        ranges.sort_unstable_by_key(|r| (r.start, r.stop));
        let mut found = Anomalies::default();
        // The first hash no range seen so far holds.
        let mut next = 0u64;
        for range in ranges {
            let start = u64::from(range.start);
            if start > next {
                found.holes += 1;
            } else if start < next {
                found.overlaps += 1;
            }
            next = next.max(u64::from(range.stop) + 1);
        }
        if next < HASH_SPACE {
            found.holes += 1;
        }
        found
    }

    /// `Ok` if every hash has exactly one brick.
    pub fn check(&self) -> Result<(), Error> {
        let found = self.anomalies();
        match found.is_empty() {
            true => Ok(()),
            false => Err(Error::Anomalies(found)),
        }
    }

    /// How many hashes have another brick (or none) in `other`: the share of a directory's
    /// files a change of layout moves.
    pub fn moved_hashes(&self, other: &Layout) -> u64 {
        let mut cuts = vec![0, HASH_SPACE];
        for range in self.ranges.iter().chain(&other.ranges).flatten() {
            cuts.extend([u64::from(range.start), u64::from(range.stop) + 1]);
        }
        cuts.sort_unstable();
        cuts.dedup();
        cuts.windows(2)
            .filter(|w| {
                // Below HASH_SPACE: it is smaller than the next cut.
                let hash = w[0] as u32;
                self.brick_for_hash(hash) != other.brick_for_hash(hash)
            })
            .map(|w| w[1] - w[0])
            .sum()
    }

    /// The layout after bricks were added (or left out), moving as few hashes as a layout
    /// of one range per brick allows.
    ///
    /// `weights` has one entry per brick of the volume now: those of this layout's bricks
    /// first, then any new ones (0: no range). Every brick with a weight gets the share
    /// [`Layout::new_directory`] would give it (the last range takes the rounding
    /// remainder, under one hash per brick). The bricks that keep a range keep the
    /// order of their ranges today, and each newcomer goes into the slot between them that
    /// keeps the most hashes where they are (GlusterFS's `dht_fix_layout_of_directory` gets
    /// there from a fresh layout by swapping ranges; this searches the slots directly).
    ///
    /// Adding one brick to `n` equal ones cannot move only the newcomer's `1/(n+1)` of the
    /// hashes: each brick must shrink to `1/(n+1)` while the newcomer's range stays in one
    /// piece. This search moves `(n+2)/(4(n+1))` of the hashes for even `n` and
    /// `(n+1)/(4n)` for odd `n` — about a quarter, and `1/(n+1)` only for `n ≤ 2` — which is
    /// the fewest any order of the bricks gives (checked by trying every order for `n ≤ 5`
    /// in the tests, and `n ≤ 7` once by hand).
    ///
    /// GlusterFS's fix-layout leaves a [`HashType::DmUser`] layout alone; callers should too.
    pub fn rebalanced(&self, weights: &[u32]) -> Result<Layout, Error> {
        let bricks = check_brick_count(weights.len())?;
        if bricks < self.ranges.len() {
            return Err(Error::TooFewWeights {
                weights: bricks,
                bricks: self.ranges.len(),
            });
        }
        let has_range = |b: usize| self.range(b).is_some();
        let mut order: Vec<usize> = (0..bricks)
            .filter(|&b| weights[b] > 0 && has_range(b))
            .collect();
        order.sort_by_key(|&b| self.range(b).map(HashRange::start));
        let newcomers: Vec<usize> = (0..bricks)
            .filter(|&b| weights[b] > 0 && !has_range(b))
            .collect();
        if order.is_empty() && newcomers.is_empty() {
            return Err(Error::NoShares);
        }
        let total: u64 = weights.iter().copied().map(u64::from).sum();
        for brick in newcomers {
            let slot = self.best_slot(&order, brick, weights, total);
            order.insert(slot, brick);
        }
        Ok(Layout {
            commit_hash: self.commit_hash,
            hash_type: self.hash_type,
            ranges: lay_out(&order, weights, bricks),
        })
    }

    /// The slot in `order` where `brick` keeps the most hashes on the bricks that hold them
    /// in this layout (the later slot on a tie), with every share at its final size.
    fn best_slot(&self, order: &[usize], brick: usize, weights: &[u32], total: u64) -> usize {
        let chunk = share_unit(total);
        let share = |b: usize| share_of(chunk, weights[b]);
        let shift = share(brick);
        // kept[i]: hashes order[i] keeps in place with `brick` after it, and with `brick`
        // before it (its range moved up by `shift`).
        let mut start = 0u64;
        let mut kept = Vec::with_capacity(order.len());
        for &b in order {
            let len = share(b);
            let old = self.range(b);
            let keep = |at: u64| old.map_or(0, |r| r.overlap(at, len));
            kept.push((keep(start), keep(start + shift)));
            start += len;
        }
        let mut before = 0u64;
        let mut after: u64 = kept.iter().map(|&(_, shifted)| shifted).sum();
        let (mut best_slot, mut best_kept) = (0, 0);
        for slot in 0..=order.len() {
            if before + after >= best_kept {
                (best_slot, best_kept) = (slot, before + after);
            }
            if let Some(&(in_place, shifted)) = kept.get(slot) {
                before += in_place;
                after -= shifted;
            }
        }
        best_slot
    }
}

/// The brick a new directory's layout starts at (GlusterFS's
/// `dht_selfheal_layout_alloc_start`): [`dm_hash`] of `key` modulo the brick count, counted
/// in GlusterFS's brick order.
///
/// `key` is the directory's path from the volume root (`/`, `/a/b`) — or, with
/// `cluster.randomize-hash-range-by-gfid on`, its GFID in canonical text form. GlusterFS
/// passes it through the rsync rewrite too, which never matches a key that starts with `/`
/// or a hex digit.
pub fn first_brick(key: &[u8], bricks: usize) -> Result<usize, Error> {
    check_brick_count(bricks)?;
    let at = dm_hash(key) as usize % bricks;
    Ok(glusterfs_order(bricks)[at])
}

/// The weights GlusterFS lays a new directory out with, from each brick's size in 1 MiB
/// chunks ([`size_chunks`]; `None`: the brick gets no range — down, full or being removed).
///
/// With `weighted` (`cluster.weighted-rebalance`, on by default) shares follow sizes; off, or
/// when some brick's size is unknown (0), every brick with a range gets an equal share.
pub fn weights_for(sizes_chunks: &[Option<u32>], weighted: bool) -> Vec<u32> {
    let known = sizes_chunks.iter().flatten().all(|&size| size > 0);
    sizes_chunks
        .iter()
        .map(|size| match size {
            None => 0,
            Some(size) if weighted && known => *size,
            Some(_) => 1,
        })
        .collect()
}

/// A brick's size as GlusterFS weighs it: its file system's blocks (`statvfs` `f_blocks`) in
/// 1 MiB chunks of `block_bytes` (`f_bsize`), rounded up; saturates at 4 PiB.
pub fn size_chunks(blocks: u64, block_bytes: u64) -> u32 {
    // GlusterFS divides by zero for blocks over 1 MiB; one block per chunk is the sane reading.
    let blocks_per_chunk = ((1u64 << 20) / block_bytes.max(1)).max(1);
    u32::try_from(blocks.div_ceil(blocks_per_chunk)).unwrap_or(u32::MAX)
}

fn check_brick_count(bricks: usize) -> Result<usize, Error> {
    match bricks {
        1..=BRICKS_MAX => Ok(bricks),
        _ => Err(Error::BrickCount { bricks }),
    }
}

/// Brick numbers in the order GlusterFS sorts its subvolumes (`dht_layout_sort_volname`):
/// by name, `VOL-client-N`, so by the decimal digits of `N` as text.
fn glusterfs_order(bricks: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..bricks).collect();
    order.sort_by_cached_key(|b| b.to_string());
    order
}

/// Hashes per unit of weight, in GlusterFS's floating point.
fn share_unit(total_weight: u64) -> f64 {
    f64::from(u32::MAX) / total_weight as f64
}

/// A brick's share, truncated as GlusterFS's conversion to `uint32_t` truncates.
fn share_of(unit: f64, weight: u32) -> u64 {
    (unit * f64::from(weight)) as u64
}

/// Consecutive ranges from hash 0 for the bricks of `order` (all with a weight), the last
/// one running to `u32::MAX`.
fn lay_out(order: &[usize], weights: &[u32], bricks: usize) -> Vec<Option<HashRange>> {
    debug_assert!(order.iter().all(|&b| weights[b] > 0));
    let total: u64 = order.iter().map(|&b| u64::from(weights[b])).sum();
    let unit = share_unit(total);
    let mut ranges = vec![None; bricks];
    // Non-last ranges stop early enough to leave the last brick two hashes; only rounding at
    // the edge of f64 could come near that.
    let stop_max = u64::from(u32::MAX) - 2;
    let mut start = 0u64;
    for (i, &brick) in order.iter().enumerate() {
        let stop = match i + 1 == order.len() {
            true => u64::from(u32::MAX),
            false => (start + share_of(unit, weights[brick]))
                .saturating_sub(1)
                .min(stop_max),
        };
        // A share under two hashes (a brick of 1 MiB beside petabytes) cannot be stored as
        // a range; its hashes go to the next brick instead of leaving a hole.
        let Some(range) = HashRange::new(start as u32, stop as u32) else {
            continue;
        };
        ranges[brick] = Some(range);
        start = stop + 1;
    }
    debug_assert_eq!(start, HASH_SPACE);
    ranges
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Decodes hex `trusted.glusterfs.dht` values, one per brick, as `getfattr -e hex` shows
    /// them.
    fn from_hex(values: &[&str]) -> Layout {
        let disk: Vec<Option<DiskLayout>> = values
            .iter()
            .map(|hex| {
                let bytes: Vec<u8> = (0..hex.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
                    .collect();
                Some(DiskLayout::decode(&bytes).expect("GlusterFS's value decodes"))
            })
            .collect();
        Layout::from_disk(&disk).expect("layout")
    }

    fn to_hex(layout: &Layout) -> Vec<String> {
        (0..layout.brick_count())
            .map(|b| {
                let value = layout.disk_layout(b).expect("brick").encode();
                value.iter().map(|byte| format!("{byte:02x}")).collect()
            })
            .collect()
    }

    // What GlusterFS 10.3 (Debian's glusterfs-server) wrote, read with
    // `getfattr -n trusted.glusterfs.dht -e hex` on each brick's directory, bricks in the
    // order given to `gluster volume create` (the integration test `dht_glusterfs` redoes
    // the three-brick case on every run).

    /// Three bricks on one file system: the root, healed at the first mount.
    const ROOT_3: [&str; 3] = [
        "0000000100000000aaaaaaaaffffffff",
        "00000001000000000000000055555554",
        "000000010000000055555555aaaaaaa9",
    ];
    /// The same volume: `mkdir /sub` through the mount.
    const SUB_3: [&str; 3] = [
        "000000000000000055555555aaaaaaa9",
        "0000000000000000aaaaaaaaffffffff",
        "00000000000000000000000055555554",
    ];
    /// Bricks on tmpfs of 64, 128 and 320 MiB (`cluster.weighted-rebalance` on, the
    /// default): the root, then `/sub`.
    const ROOT_WEIGHTED: [&str; 3] = [
        "0000000100000000dffffffeffffffff",
        "0000000100000000000000003ffffffe",
        "00000001000000003fffffffdffffffd",
    ];
    const SUB_WEIGHTED: [&str; 3] = [
        "00000000000000009fffffffbffffffd",
        "0000000000000000bffffffeffffffff",
        "0000000000000000000000009ffffffe",
    ];
    /// The three-brick volume after `gluster volume add-brick` of a fourth brick and
    /// `gluster volume rebalance fix-layout`: the root, then `/sub`.
    const ROOT_3_PLUS_1: [&str; 4] = [
        "0000000100000000bffffffdffffffff",
        "0000000100000000000000003ffffffe",
        "00000001000000007ffffffebffffffc",
        "00000001000000003fffffff7ffffffd",
    ];
    const SUB_3_PLUS_1: [&str; 4] = [
        "00000000000000007ffffffebffffffc",
        "0000000000000000bffffffdffffffff",
        "0000000000000000000000003ffffffe",
        "00000000000000003fffffff7ffffffd",
    ];
    /// Twelve bricks: the root, `/sub` and `/sub2` (GlusterFS orders brick 10 and 11 before
    /// brick 2).
    const ROOT_12: [&str; 12] = [
        "0000000100000000aaaaaaa8bffffffc",
        "0000000100000000bffffffdd5555551",
        "00000001000000000000000015555554",
        "0000000100000000155555552aaaaaa9",
        "00000001000000002aaaaaaa3ffffffe",
        "00000001000000003fffffff55555553",
        "0000000100000000555555546aaaaaa8",
        "00000001000000006aaaaaa97ffffffd",
        "00000001000000007ffffffe95555552",
        "000000010000000095555553aaaaaaa7",
        "0000000100000000d5555552eaaaaaa6",
        "0000000100000000eaaaaaa7ffffffff",
    ];
    const SUB_12: [&str; 12] = [
        "0000000000000000d5555552eaaaaaa6",
        "0000000000000000eaaaaaa7ffffffff",
        "00000000000000002aaaaaaa3ffffffe",
        "00000000000000003fffffff55555553",
        "0000000000000000555555546aaaaaa8",
        "00000000000000006aaaaaa97ffffffd",
        "00000000000000007ffffffe95555552",
        "000000000000000095555553aaaaaaa7",
        "0000000000000000aaaaaaa8bffffffc",
        "0000000000000000bffffffdd5555551",
        "00000000000000000000000015555554",
        "0000000000000000155555552aaaaaa9",
    ];
    const SUB2_12: [&str; 12] = [
        "00000000000000006aaaaaa97ffffffd",
        "00000000000000007ffffffe95555552",
        "0000000000000000bffffffdd5555551",
        "0000000000000000d5555552eaaaaaa6",
        "0000000000000000eaaaaaa7ffffffff",
        "00000000000000000000000015555554",
        "0000000000000000155555552aaaaaa9",
        "00000000000000002aaaaaaa3ffffffe",
        "00000000000000003fffffff55555553",
        "0000000000000000555555546aaaaaa8",
        "000000000000000095555553aaaaaaa7",
        "0000000000000000aaaaaaa8bffffffc",
    ];

    /// Names created through a GlusterFS 10.3 mount (in the C.UTF-8 locale) of the
    /// three-brick volume, in its root ([`ROOT_3`]), and the brick each one landed on.
    const PLACED_ROOT_3: &[(&[u8], usize)] = &[
        (b"README.md", 1),
        (b"Cargo.toml", 1),
        (b"main.rs", 0),
        (b"x", 0),
        (b"fio", 2),
        (b"hello world", 0),
        (b"new\nline", 1),
        (b".foo.x1y2", 1),
        (b".foo.Q", 1),
        (b".report.pdf.AbCdEf", 2),
        (b".archive.tar.gz.000000", 2),
        (b".\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e.txt.x1y2", 0),
        (b".bashrc", 0),
        (b"..x", 0),
        (b"...x", 0),
        (b".a.", 1),
        (b".a.b.", 1),
        (b".x.y.z", 1),
        (b".\xc3\xa9.\xc3\xa9", 2),
        (b"caf\xc3\xa9", 2),
        (b"emoji\xf0\x9f\x98\x80", 1),
        (b"\xe4\xb8\xad\xe6\x96\x87\xe6\x96\x87\xe4\xbb\xb6\xe5\x90\x8d\xe7\xa7\xb0\xe6\xb5\x8b\xe8\xaf\x95", 0),
        (b"\xff", 0),
        (b"ab\x80", 2),
        (b"ok\xe9", 0),
        // Not valid UTF-8, so not rewritten in a UTF-8 locale ("\xff" would go to brick 0).
        (b".\xff.x", 1),
    ];

    /// Names created through a second mount of the same volume whose client ran in the C
    /// locale: the rsync rewrite there matches bytes.
    const PLACED_ROOT_3_C_LOCALE: &[(&[u8], usize)] =
        &[(b".\xff.y", 0), (b".a.\xfe", 1), (b".plain.c1", 2)];

    /// Names created (C.UTF-8) in the root after the fourth brick was added
    /// ([`ROOT_3_PLUS_1`]): glibc's UTF-8 takes code points past U+10FFFF, not overlong forms.
    const PLACED_ROOT_3_PLUS_1: &[(&[u8], usize)] = &[
        (b".\xf4\x90\x80\x80.x", 1),
        (b".\xc0\xaf.x", 1),
        (b".ok\xe2\x82.x", 2),
        (b".abc.\xfe", 0),
        (b".zz.\xc3", 2),
        (b".\xe2\x82\xac.x", 2),
        (b".euro\xe2\x82\xac.\xe2\x82\xac", 3),
    ];

    /// A directory GlusterFS laid out: its xattrs, path, commit hash and brick weights.
    struct Observed {
        xattrs: &'static [&'static str],
        path: &'static [u8],
        commit_hash: u32,
        weights: &'static [u32],
    }

    #[test]
    fn new_directories_match_glusterfs() {
        let observed = |xattrs, path, commit_hash, weights| Observed {
            xattrs,
            path,
            commit_hash,
            weights,
        };
        let cases = [
            observed(&ROOT_3, b"/", COMMIT_HASH_INVALID, &[1; 3]),
            observed(&SUB_3, b"/sub", 0, &[1; 3]),
            observed(&ROOT_WEIGHTED, b"/", COMMIT_HASH_INVALID, &[64, 128, 320]),
            observed(&SUB_WEIGHTED, b"/sub", 0, &[64, 128, 320]),
            observed(&ROOT_12, b"/", COMMIT_HASH_INVALID, &[1; 12]),
            observed(&SUB_12, b"/sub", 0, &[1; 12]),
            observed(&SUB2_12, b"/sub2", 0, &[1; 12]),
        ];
        for Observed {
            xattrs,
            path,
            commit_hash,
            weights,
        } in cases
        {
            let first = first_brick(path, weights.len()).expect("bricks");
            let built = Layout::new_directory(weights, first, commit_hash).expect("layout");
            let shown = path.escape_ascii();
            assert_eq!(built, from_hex(xattrs), "{shown} with weights {weights:?}");
            assert_eq!(
                to_hex(&built),
                xattrs,
                "{shown} encodes as GlusterFS wrote it"
            );
            built.check().expect("no holes or overlaps");
        }
    }

    #[test]
    fn tmpfs_sizes_weigh_as_in_mib() {
        // tmpfs of 64 MiB: 16384 blocks of 4 KiB.
        assert_eq!(size_chunks(16_384, 4096), 64);
        assert_eq!(size_chunks(16_385, 4096), 65);
        assert_eq!(size_chunks(10, 4 << 20), 10);
        assert_eq!(size_chunks(u64::MAX, 1), u32::MAX);
        let sizes = [Some(64), Some(128), None, Some(320)];
        assert_eq!(weights_for(&sizes, true), [64, 128, 0, 320]);
        assert_eq!(weights_for(&sizes, false), [1, 1, 0, 1]);
        assert_eq!(weights_for(&[Some(64), Some(0)], true), [1, 1]);
    }

    #[test]
    fn names_land_where_glusterfs_put_them() {
        let root = from_hex(&ROOT_3);
        let after_add = from_hex(&ROOT_3_PLUS_1);
        let cases = [
            (&root, Munging::RsyncUtf8, PLACED_ROOT_3),
            (&root, Munging::RsyncBytes, PLACED_ROOT_3_C_LOCALE),
            (&after_add, Munging::RsyncUtf8, PLACED_ROOT_3_PLUS_1),
        ];
        for (layout, munging, placed) in cases {
            for &(name, brick) in placed {
                let shown = name.escape_ascii();
                assert_eq!(layout.hashed_brick(name, munging), Some(brick), "{shown}");
            }
        }
        // Two long ones: 127 × "é" (254 bytes) and a 205-byte rsync name.
        let long = "é".repeat(127);
        assert_eq!(
            root.hashed_brick(long.as_bytes(), Munging::RsyncUtf8),
            Some(1)
        );
        let rsync = format!(".{}.tmp", "d".repeat(200));
        assert_eq!(
            root.hashed_brick(rsync.as_bytes(), Munging::RsyncUtf8),
            Some(2)
        );
    }

    #[test]
    fn adding_a_brick_keeps_what_glusterfs_fix_layout_keeps() {
        for (before, after) in [(ROOT_3, ROOT_3_PLUS_1), (SUB_3, SUB_3_PLUS_1)] {
            let old = from_hex(&before);
            let glusterfs = from_hex(&after);
            let ours = old.rebalanced(&[1; 4]).expect("layout");
            ours.check().expect("no holes or overlaps");
            assert_eq!(ours.moved_hashes(&old), glusterfs.moved_hashes(&old));
            assert_eq!(ours, glusterfs);
        }
    }

    #[test]
    fn empty_ranges_read_as_no_share() {
        let value = |words: [u32; 4]| {
            let mut bytes = Vec::new();
            for word in words {
                bytes.extend(word.to_be_bytes());
            }
            DiskLayout::decode(&bytes)
        };
        let none = value([0, 0, 0, 0]).expect("a brick left out");
        assert_eq!(none.range, None);
        assert_eq!(none.encode(), [0; XATTR_LEN]);
        assert_eq!(value([7, 0, 9, 9]).expect("start = stop").range, None);
        assert_eq!(
            value([7, 1, 9, 10]).expect("user-set"),
            DiskLayout {
                commit_hash: 7,
                hash_type: HashType::DmUser,
                range: HashRange::new(9, 10),
            }
        );
        assert_eq!(
            value([0, 2, 0, 1]),
            Err(Error::HashType { value: 2 }),
            "GlusterFS refuses unknown hash types"
        );
        assert_eq!(
            value([0, 0, 5, 4]),
            Err(Error::InvertedRange { start: 5, stop: 4 })
        );
        assert_eq!(
            DiskLayout::decode(&[0; 15]),
            Err(Error::XattrLength { len: 15 })
        );
    }

    #[test]
    fn anomalies_count_holes_and_overlaps() {
        let layout = |ranges: &[(u32, u32)]| Layout {
            commit_hash: 0,
            hash_type: HashType::Dm,
            ranges: ranges.iter().map(|&(a, b)| HashRange::new(a, b)).collect(),
        };
        let anomalies = |ranges: &[(u32, u32)]| {
            let found = layout(ranges).anomalies();
            (found.holes, found.overlaps)
        };
        assert_eq!(anomalies(&[(0, u32::MAX)]), (0, 0));
        assert_eq!(anomalies(&[(0, 0)]), (1, 0), "no range at all");
        assert_eq!(anomalies(&[(0, 9), (11, u32::MAX)]), (1, 0));
        assert_eq!(anomalies(&[(1, u32::MAX)]), (1, 0));
        assert_eq!(anomalies(&[(0, 9), (10, u32::MAX - 1)]), (1, 0));
        assert_eq!(anomalies(&[(0, 9), (5, u32::MAX)]), (0, 1));
        assert_eq!(anomalies(&[(0, 9), (5, 20), (30, 40)]), (2, 1));
        assert_eq!(
            layout(&[(0, 9), (5, u32::MAX)]).check(),
            Err(Error::Anomalies(Anomalies {
                holes: 0,
                overlaps: 1
            }))
        );
        // The earliest range wins where two overlap, as in GlusterFS's sorted search.
        assert_eq!(layout(&[(5, u32::MAX), (0, 9)]).brick_for_hash(7), Some(1));
        assert_eq!(layout(&[(0, 9), (11, u32::MAX)]).brick_for_hash(10), None);
    }

    #[test]
    fn bad_arguments_are_typed_errors() {
        assert_eq!(
            Layout::new_directory(&[], 0, 0),
            Err(Error::BrickCount { bricks: 0 })
        );
        assert_eq!(
            Layout::new_directory(&[1, 1], 2, 0),
            Err(Error::NoSuchBrick {
                brick: 2,
                bricks: 2
            })
        );
        assert_eq!(Layout::new_directory(&[0, 0], 0, 0), Err(Error::NoShares));
        assert_eq!(
            first_brick(b"/", BRICKS_MAX + 1),
            Err(Error::BrickCount {
                bricks: BRICKS_MAX + 1
            })
        );
        let layout = Layout::new_directory(&[1, 1, 1], 0, 0).expect("layout");
        assert_eq!(
            layout.rebalanced(&[1, 1]),
            Err(Error::TooFewWeights {
                weights: 2,
                bricks: 3
            })
        );
        assert_eq!(layout.rebalanced(&[0, 0, 0]), Err(Error::NoShares));
        assert_eq!(layout.disk_layout(3), None);
    }

    /// The fewest hashes any layout of one range per brick with the shares `new_weights`
    /// moves from `old`: every order of the bricks, tried.
    fn fewest_moved(old: &Layout, new_weights: &[u32]) -> u64 {
        fn permutations(items: &mut Vec<usize>, k: usize, each: &mut impl FnMut(&[usize])) {
            if k == items.len() {
                return each(items);
            }
            for i in k..items.len() {
                items.swap(k, i);
                permutations(items, k + 1, each);
                items.swap(k, i);
            }
        }
        let mut fewest = u64::MAX;
        let mut order: Vec<usize> = (0..new_weights.len()).collect();
        permutations(&mut order, 0, &mut |order| {
            let candidate = Layout {
                ranges: lay_out(order, new_weights, new_weights.len()),
                ..old.clone()
            };
            fewest = fewest.min(old.moved_hashes(&candidate));
        });
        fewest
    }

    #[test]
    fn adding_a_brick_moves_the_fewest_hashes_possible() {
        for bricks in 1..=5 {
            for first in 0..bricks {
                let old = Layout::new_directory(&vec![1; bricks], first, 0).expect("layout");
                let weights = vec![1; bricks + 1];
                let moved = old.moved_hashes(&old.rebalanced(&weights).expect("layout"));
                // Rounding: the last brick's share differs from the others' by < n hashes.
                let slack = bricks as u64 + 1;
                assert!(
                    moved <= fewest_moved(&old, &weights) + slack,
                    "{bricks} bricks from {first}: {moved} moved"
                );
            }
        }
    }

    /// A layout for `weights` from a strategy: 1 to `bricks_max` bricks, some of them
    /// without a share.
    fn weights(bricks_max: usize) -> impl Strategy<Value = Vec<u32>> {
        proptest::collection::vec(
            prop_oneof![1 => Just(0u32), 4 => 1u32..=1 << 20],
            1..=bricks_max,
        )
        .prop_filter("some brick has a share", |w| w.iter().any(|&w| w > 0))
    }

    fn disk_layout() -> impl Strategy<Value = DiskLayout> {
        let range = prop_oneof![
            1 => Just(None),
            4 => (any::<u32>(), any::<u32>()).prop_map(|(a, b)| HashRange::new(a.min(b), a.max(b))),
        ];
        let hash_type = prop_oneof![Just(HashType::Dm), Just(HashType::DmUser)];
        (any::<u32>(), hash_type, range).prop_map(|(commit_hash, hash_type, range)| DiskLayout {
            commit_hash,
            hash_type,
            range,
        })
    }

    proptest! {
        /// Every brick with a weight gets one range, of its share within rounding; together
        /// they cover every hash once.
        #[test]
        fn new_layouts_cover_every_hash_once(weights in weights(64), first in any::<prop::sample::Index>()) {
            let first = first.index(weights.len());
            let layout = Layout::new_directory(&weights, first, 0).expect("layout");
            prop_assert_eq!(layout.anomalies(), Anomalies::default());
            let total: u64 = weights.iter().copied().map(u64::from).sum();
            for (brick, &weight) in weights.iter().enumerate() {
                let range = layout.range(brick);
                prop_assert_eq!(range.is_some(), weight > 0, "brick {}", brick);
                let Some(range) = range else { continue };
                let exact = HASH_SPACE as f64 * f64::from(weight) / total as f64;
                let error = (range.hashes() as f64 - exact).abs();
                // Each share is truncated by < 1 and computed from u32::MAX, not 2^32; the
                // last brick takes what all lost.
                prop_assert!(error <= weights.len() as f64 + 2.0, "brick {}: {} vs {}", brick, range.hashes(), exact);
            }
        }

        /// A name hashes to exactly one brick, the one whose range holds its hash.
        #[test]
        fn every_name_has_one_brick(weights in weights(64), name in proptest::collection::vec(any::<u8>(), 1..=255)) {
            let layout = Layout::new_directory(&weights, 0, 0).expect("layout");
            let hash = name_hash(&name, Munging::default());
            let holders: Vec<usize> = (0..weights.len())
                .filter(|&b| layout.range(b).is_some_and(|r| r.contains(hash)))
                .collect();
            prop_assert_eq!(holders.len(), 1);
            prop_assert_eq!(layout.hashed_brick(&name, Munging::default()), Some(holders[0]));
        }

        #[test]
        fn xattr_values_roundtrip(disk in disk_layout()) {
            prop_assert_eq!(DiskLayout::decode(&disk.encode()), Ok(disk));
        }

        #[test]
        fn layouts_roundtrip_through_their_xattrs(weights in weights(64), commit_hash in any::<u32>()) {
            let layout = Layout::new_directory(&weights, 0, commit_hash).expect("layout");
            let disk: Vec<Option<DiskLayout>> = (0..weights.len())
                .map(|b| {
                    let value = layout.disk_layout(b).expect("brick").encode();
                    Some(DiskLayout::decode(&value).expect("decodes"))
                })
                .collect();
            prop_assert_eq!(Layout::from_disk(&disk), Ok(layout));
        }

        /// Decoding any bytes returns a value or an error, never a panic.
        #[test]
        fn any_bytes_decode_without_panic(bytes in proptest::collection::vec(any::<u8>(), 0..32)) {
            let _ = DiskLayout::decode(&bytes);
        }

        /// Adding a brick to n equal ones moves at most about a quarter of the hashes (the
        /// best one range per brick allows; see `Layout::rebalanced`), and at least the
        /// newcomer's share.
        #[test]
        fn adding_an_equal_brick_moves_little(bricks in 1usize..=64, first in any::<prop::sample::Index>()) {
            let first = first.index(bricks);
            let old = Layout::new_directory(&vec![1; bricks], first, 0).expect("layout");
            let new = old.rebalanced(&vec![1; bricks + 1]).expect("layout");
            prop_assert_eq!(new.anomalies(), Anomalies::default());
            let moved = old.moved_hashes(&new) as f64 / HASH_SPACE as f64;
            let n = bricks as f64;
            let fewest = 1.0 / (n + 1.0);
            // The optimum: (n+2)/(4(n+1)) for even n, (n+1)/(4n) for odd n.
            let bound = (n + 1.0) / (4.0 * n) + 1e-6;
            prop_assert!(moved >= fewest - 1e-6, "{} < {}", moved, fewest);
            prop_assert!(moved <= bound, "{} bricks: moved {}, bound {}", bricks, moved, bound);
        }

        /// With any weights, the newcomer's slot is never worse than putting it last, and
        /// every brick still gets its share.
        #[test]
        fn adding_a_weighted_brick_beats_appending(old_weights in weights(32), new_weight in 1u32..=1 << 20, first in any::<prop::sample::Index>()) {
            let first = first.index(old_weights.len());
            let old = Layout::new_directory(&old_weights, first, 0).expect("layout");
            let mut weights = old_weights.clone();
            weights.push(new_weight);
            let new = old.rebalanced(&weights).expect("layout");
            prop_assert_eq!(new.anomalies(), Anomalies::default());
            for (brick, &weight) in weights.iter().enumerate() {
                prop_assert_eq!(new.range(brick).is_some(), weight > 0);
            }
            let mut appended: Vec<usize> = (0..old_weights.len()).filter(|&b| old.range(b).is_some()).collect();
            appended.sort_by_key(|&b| old.range(b).map(HashRange::start));
            appended.push(old_weights.len());
            let appended = Layout { ranges: lay_out(&appended, &weights, weights.len()), ..old.clone() };
            let slack = weights.len() as u64;
            prop_assert!(old.moved_hashes(&new) <= old.moved_hashes(&appended) + slack);
        }
    }
}
