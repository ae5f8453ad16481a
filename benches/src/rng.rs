//! The workloads' one source of randomness: SplitMix64 from a seed the run prints, so a run
//! can be replayed with the same choices (tree shapes, file sizes, samples, GFIDs).

/// SplitMix64: small, seedable, good enough for shapes, sizes and samples.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// A generator for one part of a run (`stream`), independent of the others' draws.
    pub fn stream(seed: u64, stream: u64) -> Rng {
        let mut mixer = Rng(seed ^ stream.wrapping_mul(0xa076_1d64_78bd_642f));
        Rng(mixer.next_u64())
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in 0..n (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.unit() * n as f64) as usize % n.max(1)
    }

    /// A standard normal sample (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.unit();
        let u2 = self.unit();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// 16 random bytes shaped as a version-4 UUID (a GFID that is never null or the root).
    pub fn uuid_bytes(&mut self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.next_u64().to_le_bytes());
        b[8..].copy_from_slice(&self.next_u64().to_le_bytes());
        b[6] = (b[6] & 0x0f) | 0x40;
        b[8] = (b[8] & 0x3f) | 0x80;
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_makes_the_same_choices() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        let mut r = Rng::new(1);
        assert!((0..10_000).all(|_| r.below(16) < 16));
    }

    #[test]
    fn streams_differ_and_repeat() {
        let draw = |s| Rng::stream(42, s).next_u64();
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
        assert_ne!(Rng::stream(42, 3).next_u64(), Rng::stream(43, 3).next_u64());
    }

    #[test]
    fn uuids_are_version_4() {
        let mut r = Rng::new(9);
        for _ in 0..100 {
            let b = r.uuid_bytes();
            assert_eq!(b[6] >> 4, 4);
            assert_eq!(b[8] >> 6, 0b10);
        }
    }
}
