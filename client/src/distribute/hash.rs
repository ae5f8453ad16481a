//! The hash GlusterFS's DHT places a name by: `gf_dm_hashfn` (a Davies-Meyer construction
//! over the TEA block cipher, `libglusterfs/src/hashfn.c`) of the name after DHT's rsync
//! rewrite (`xlators/cluster/dht/src/dht-hashfn.c`).
//!
//! Names are bytes, as a Linux file system has them; nothing here allocates.

use std::num::Wrapping;

/// TEA's key-schedule constant (2^32 / golden ratio).
const TEA_DELTA: Wrapping<u32> = Wrapping(0x9e37_79b9);
/// TEA rounds mixed in per full 16-byte block of the message.
const ROUNDS_PER_BLOCK: u32 = 6;
/// TEA rounds mixed in for the last, padded block.
const ROUNDS_LAST_BLOCK: u32 = 10;
/// The two hash words before any block is mixed in.
const HASH_INIT: [u32; 2] = [0x9464_a485, 0x542e_1a94];
/// Bytes of message per TEA key: four 32-bit words.
const BLOCK_BYTES: usize = 16;

/// GlusterFS's `gf_dm_hashfn` of `bytes`, bit for bit as x86-64 builds compute it:
/// little-endian words, and a tail byte >= 0x80 sign-extended, as a C `char` is there (on
/// aarch64, where `char` is unsigned, GlusterFS's own hash of such a name differs).
///
/// Every full 16-byte block is a TEA key that mixes the two hash words for 6 rounds
/// (Davies-Meyer: the words are added back after the rounds); the last block — the tail
/// bytes and a pad word made of the length, repeated — mixes for 10. The result is the two
/// words XORed.
pub fn dm_hash(bytes: &[u8]) -> u32 {
    // GlusterFS takes the length as a C `int`; names and paths are far below 2^31 bytes, and
    // for anything longer only the low 32 bits count, as in C.
    let pad = pad_word(bytes.len() as u32);
    let mut hash = HASH_INIT.map(Wrapping);
    let mut blocks = bytes.chunks_exact(BLOCK_BYTES);
    for block in &mut blocks {
        let mut key = [0u32; 4];
        for (word, chunk) in key.iter_mut().zip(block.chunks_exact(4)) {
            *word = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        }
        tea_mix(&mut hash, key, ROUNDS_PER_BLOCK);
    }
    tea_mix(
        &mut hash,
        last_block(blocks.remainder(), pad),
        ROUNDS_LAST_BLOCK,
    );
    (hash[0] ^ hash[1]).0
}

/// The pad word: the length's low byte in all four bytes (higher bits of a long length
/// spill into the bytes above, as GlusterFS's `__pad` lets them).
fn pad_word(len: u32) -> u32 {
    let pad = len | (len << 8);
    pad | (pad << 16)
}

/// The key of the last block from the `tail` (< 16 bytes): its whole words, then the pad
/// word with the leftover bytes shifted in, then the pad word.
fn last_block(tail: &[u8], pad: u32) -> [u32; 4] {
    debug_assert!(tail.len() < BLOCK_BYTES);
    let mut key = [pad; 4];
    let mut words = tail.chunks_exact(4);
    let mut slot = 0;
    for chunk in &mut words {
        key[slot] = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        slot += 1;
    }
    // `slot` is at most 3 here: the tail is shorter than a block.
    key[slot] = words.remainder().iter().fold(pad, |word, &byte| {
        // GlusterFS ORs in a (signed) `char`: a byte >= 0x80 sets all the bits above it.
        (word << 8) | i32::from(byte as i8) as u32
    });
    key
}

/// `rounds` TEA rounds of the two hash words under `key`, added back to them (GlusterFS's
/// `dm_round`).
fn tea_mix(hash: &mut [Wrapping<u32>; 2], key: [u32; 4], rounds: u32) {
    let [k0, k1, k2, k3] = key.map(Wrapping);
    let [mut b0, mut b1] = *hash;
    let mut sum = Wrapping(0u32);
    for _ in 0..rounds {
        sum += TEA_DELTA;
        b0 += ((b1 << 4) + k0) ^ (b1 + sum) ^ ((b1 >> 5) + k1);
        b1 += ((b0 << 4) + k2) ^ (b0 + sum) ^ ((b0 >> 5) + k3);
    }
    hash[0] += b0;
    hash[1] += b1;
}

/// How DHT rewrites a name before hashing it: GlusterFS's `cluster.rsync-hash-regex`, whose
/// default `^\.(.+)\.[^.]+$` hashes rsync's temporary name `.report.pdf.Xa3b9Q` as
/// `report.pdf`, so the rename rsync ends with does not move the file to another brick.
///
/// GlusterFS matches the regex with glibc's `regexec` in the client process's locale, so
/// the locale decides for names that are not valid text: in a UTF-8 locale `.` matches only
/// whole characters, and a name with an invalid sequence is never rewritten; in the C locale
/// every byte is a character. Both were observed on GlusterFS 10.3 (two mounts of one volume
/// placed `.\xff.x` on different bricks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Munging {
    /// The default regex, as a client in a UTF-8 locale (`C.UTF-8`, `en_US.UTF-8`; what
    /// systemd gives services on most distributions) matches it.
    #[default]
    RsyncUtf8,
    /// The default regex, as a client in the C (POSIX) locale matches it.
    RsyncBytes,
    /// `cluster.rsync-hash-regex none`: names are hashed as they are.
    Off,
}

impl Munging {
    /// What DHT hashes for `name`: the part between the leading dot and the last dot when the
    /// rsync regex matches, else `name` itself.
    pub fn apply(self, name: &[u8]) -> &[u8] {
        match self {
            Munging::Off => name,
            Munging::RsyncBytes => rsync_stem(name).unwrap_or(name),
            Munging::RsyncUtf8 => match rsync_stem(name) {
                Some(stem) if is_glibc_utf8(name) => stem,
                _ => name,
            },
        }
    }
}

/// The hash DHT places `name` by (GlusterFS's `dht_hash_compute` with the hash type of every
/// layout GlusterFS writes).
pub fn name_hash(name: &[u8], munging: Munging) -> u32 {
    dm_hash(munging.apply(name))
}

/// The first group of `^\.(.+)\.[^.]+$` matched byte by byte: a leading dot, a non-empty
/// stem, a last dot and a non-empty suffix without dots. POSIX regexes match the longest
/// group, so the stem runs to the last dot.
fn rsync_stem(name: &[u8]) -> Option<&[u8]> {
    let rest = name.strip_prefix(b".")?;
    let last_dot = rest.iter().rposition(|&b| b == b'.')?;
    let (stem, suffix) = (&rest[..last_dot], &rest[last_dot + 1..]);
    (!stem.is_empty() && !suffix.is_empty()).then_some(stem)
}

/// Whether every byte of `bytes` belongs to a character glibc's UTF-8 locale decodes: the
/// original UTF-8 of RFC 2279 (sequences of up to 6 bytes, code points up to 0x7fff_ffff),
/// shortest form only, no UTF-16 surrogates. This is wider than Rust's `str` (which stops at
/// U+10FFFF); checked against glibc 2.36's `regexec` on 360 000 names.
fn is_glibc_utf8(bytes: &[u8]) -> bool {
    let mut rest = bytes;
    while let Some((&lead, tail)) = rest.split_first() {
        let (len, bits, min) = match lead {
            0x00..=0x7f => {
                rest = tail;
                continue;
            }
            0xc2..=0xdf => (2, lead & 0x1f, 0x80),
            0xe0..=0xef => (3, lead & 0x0f, 0x800),
            0xf0..=0xf7 => (4, lead & 0x07, 0x1_0000),
            0xf8..=0xfb => (5, lead & 0x03, 0x20_0000),
            0xfc..=0xfd => (6, lead & 0x01, 0x400_0000),
            _ => return false,
        };
        let Some((continuation, after)) = tail.split_at_checked(len - 1) else {
            return false;
        };
        let mut code = u32::from(bits);
        for &byte in continuation {
            if byte & 0xc0 != 0x80 {
                return false;
            }
            code = (code << 6) | u32::from(byte & 0x3f);
        }
        if code < min || (0xd800..=0xdfff).contains(&code) {
            return false;
        }
        rest = after;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `gf_dm_hashfn` as GlusterFS 10.3 computes it: each value was returned by the installed
    /// `libglusterfs.so.0` (Debian's glusterfs 10.3, x86-64), called through Python's ctypes.
    const DM_HASHES: &[(&[u8], u32)] = &[
        (b"", 0x8847_74a2),
        (b"a", 0x3a17_e4e6),
        (b"fio", 0x8102_250e),
        (b"/", 0x8619_bd58),
        (b"/sub", 0x2918_3312),
        (b"hello", 0xa792_3147),
        (b"abc", 0xba8b_d29a),
        (b"abcd", 0xd896_27f6),
        (b"0123456789abcde", 0x9fc1_c536),
        (b"0123456789abcdef", 0x6ecb_5ada),
        (b"0123456789abcdef0", 0x795e_f9c7),
        (b"0123456789abcdef0123456789abcdef", 0xf1ed_7304),
        (b"\xc3\xa9", 0x65cf_caa1),
        (b"\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e.txt", 0xb065_afb9),
        (b"\xff", 0xee42_408a),
        (b"ab\x80", 0x7027_ca13),
        (b"ok\xe9", 0xdf6a_e681),
        (b"qqq\xc3", 0x4291_f613),
        (b"qqqq\xc3", 0x8cb7_8ba9),
        (b"qqqqqqqqqqqqqq\xc3", 0x4ec9_d2af),
        (b"\x80\x81\x82\x83\x84", 0xff02_8317),
        (b".foo.x1y2", 0xa691_3339),
        (b"foo", 0x0b55_ac76),
        (b"report.pdf", 0x6df6_354f),
        (b"hello world", 0xdab8_aad1),
    ];

    #[test]
    fn dm_hash_matches_libglusterfs() {
        for &(bytes, want) in DM_HASHES {
            assert_eq!(
                dm_hash(bytes),
                want,
                "gf_dm_hashfn({})",
                bytes.escape_ascii()
            );
        }
        // The longest name: 15 full blocks and a 15-byte tail.
        assert_eq!(dm_hash(&[b'x'; 255]), 0x8ca6_6f57);
    }

    /// Whether glibc 2.36's `regexec` of `^\.(.+)\.[^.]+$` matched, in `C.UTF-8` and in `C`
    /// (a C program that calls `setlocale` and `regexec` as GlusterFS's `dht_munge_name`
    /// does).
    const RSYNC_MATCHES: &[(&[u8], bool, bool)] = &[
        (b".foo.x1y2", true, true),
        (b".report.pdf.AbCdEf", true, true),
        (b".bashrc", false, false),
        (b"..x", false, false),
        (b"...x", true, true),
        (b".a.", false, false),
        (b".a.b.", false, false),
        (b".new\nline.tmp", true, true),
        (b"plain.txt", false, false),
        (b".\xc3\xa9.\xc3\xa9", true, true),
        (b".\xff.x", false, true),
        (b".a\xff.b", false, true),
        (b".a.\xfe", false, true),
        (b".zz.\xc3", false, true),
        (b".\xc0\xaf.x", false, true),
        (b".\xed\xa0\x80.x", false, true),
        (b".\xf4\x90\x80\x80.x", true, true),
        (b".\xf7\xbf\xbf\xbf.x", true, true),
        (b".\xf8\x88\x80\x80\x80.x", true, true),
        (b".\xf8\x87\x80\x80\x80.x", false, true),
        (b".\xfc\x84\x80\x80\x80\x80.x", true, true),
        (b".\xfd\xbf\xbf\xbf\xbf\xbf.x", true, true),
        (b".\xfe.x", false, true),
    ];

    #[test]
    fn rsync_munging_matches_glibc_regexec() {
        // A rewritten name is always shorter: the stem drops at least two dots and a suffix.
        let rewritten = |munging: Munging, name: &[u8]| munging.apply(name).len() < name.len();
        for &(name, utf8, bytes) in RSYNC_MATCHES {
            let shown = name.escape_ascii();
            assert_eq!(
                rewritten(Munging::RsyncUtf8, name),
                utf8,
                "{shown} in C.UTF-8"
            );
            assert_eq!(rewritten(Munging::RsyncBytes, name), bytes, "{shown} in C");
            assert!(!rewritten(Munging::Off, name), "{shown} with the regex off");
        }
    }

    #[test]
    fn munging_takes_the_stem_up_to_the_last_dot() {
        assert_eq!(Munging::RsyncUtf8.apply(b".foo.x1y2"), b"foo");
        assert_eq!(Munging::RsyncUtf8.apply(b".a.b.c"), b"a.b");
        assert_eq!(Munging::RsyncUtf8.apply(b"...x"), b".");
        assert_eq!(name_hash(b".fio.sh", Munging::RsyncUtf8), 0x8102_250e);
        assert_eq!(name_hash(b".fio.sh", Munging::Off), dm_hash(b".fio.sh"));
    }
}
