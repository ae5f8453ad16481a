//! Identifiers: object GFIDs, brick ids, open-file ids and request ids.

use std::fmt;
use std::str::FromStr;

use crate::codec::{Decode, DecodeError, Encode, Encoder, Reader};

/// Writes 16 bytes in the canonical 8-4-4-4-12 UUID form.
fn fmt_uuid(bytes: &[u8; 16], f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let text = uuid_text(bytes);
    f.write_str(std::str::from_utf8(&text).map_err(|_| fmt::Error)?)
}

/// 16 bytes in the canonical 8-4-4-4-12 UUID form, lower-case hex (a GFID is formatted for
/// every handle a fop opens: no formatter machinery).
fn uuid_text(bytes: &[u8; 16]) -> [u8; 36] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = [b'-'; 36];
    let mut at = 0;
    for (i, b) in bytes.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            at += 1;
        }
        out[at] = HEX[usize::from(b >> 4)];
        out[at + 1] = HEX[usize::from(b & 0xf)];
        at += 2;
    }
    out
}

/// Parses the canonical UUID form (hyphens at 8, 13, 18, 23; either hex case).
fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let s = s.as_bytes();
    if s.len() != 36 || [8, 13, 18, 23].iter().any(|&i| s[i] != b'-') {
        return None;
    }
    let mut hex = s.iter().copied().filter(|&c| c != b'-');
    let mut out = [0u8; 16];
    for byte in &mut out {
        let hi = (hex.next()? as char).to_digit(16)?;
        let lo = (hex.next()? as char).to_digit(16)?;
        *byte = u8::try_from(hi * 16 + lo).ok()?;
    }
    Some(out)
}

/// The identity of a file-system object: 16 bytes, never all zero, printed as a UUID.
///
/// Clients choose GFIDs for the objects they create (like GlusterFS's `gfid-req`), so a retried
/// create is idempotent. The root directory is always [`Gfid::ROOT`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Gfid([u8; 16]);

impl Gfid {
    /// `00000000-0000-0000-0000-000000000001`, the brick root.
    pub const ROOT: Gfid = Gfid([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);

    /// A GFID from its bytes; `None` for the all-zero (null) GFID, which names nothing.
    pub fn from_bytes(bytes: [u8; 16]) -> Option<Gfid> {
        (bytes != [0; 16]).then_some(Gfid(bytes))
    }

    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    pub fn is_root(&self) -> bool {
        *self == Self::ROOT
    }

    /// The canonical UUID form as ASCII bytes, what `Display` prints.
    pub fn text(&self) -> [u8; 36] {
        uuid_text(&self.0)
    }
}

impl fmt::Display for Gfid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt_uuid(&self.0, f)
    }
}

impl fmt::Debug for Gfid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gfid({self})")
    }
}

/// Why a string is not a GFID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GfidParseError {
    #[error("not a UUID of the form xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx")]
    Syntax,
    #[error("the null GFID names no object")]
    Null,
}

impl FromStr for Gfid {
    type Err = GfidParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bytes = parse_uuid(s).ok_or(GfidParseError::Syntax)?;
        Gfid::from_bytes(bytes).ok_or(GfidParseError::Null)
    }
}

impl Encode for Gfid {
    fn encode(&self, out: &mut Encoder) {
        out.put_slice(&self.0);
    }
}

impl Decode for Gfid {
    const ENCODED_LEN_MIN: usize = 16;

    fn decode(input: &mut Reader) -> Result<Self, DecodeError> {
        Gfid::from_bytes(input.array()?).ok_or(DecodeError::invalid("gfid", "null gfid"))
    }
}

/// The identity of a brick, chosen when the brick is formatted.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct BrickId(pub [u8; 16]);

impl fmt::Display for BrickId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt_uuid(&self.0, f)
    }
}

impl fmt::Debug for BrickId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BrickId({self})")
    }
}

impl FromStr for BrickId {
    type Err = GfidParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_uuid(s).map(BrickId).ok_or(GfidParseError::Syntax)
    }
}

impl Encode for BrickId {
    fn encode(&self, out: &mut Encoder) {
        out.put_slice(&self.0);
    }
}

impl Decode for BrickId {
    const ENCODED_LEN_MIN: usize = 16;

    fn decode(input: &mut Reader) -> Result<Self, DecodeError> {
        Ok(BrickId(input.array()?))
    }
}

/// An open file or directory on one brick, for one client session: a slot in the session's
/// fd table and the generation that slot had when it was handed out. A stale or forged id
/// fails the generation check on the brick (EBADF) instead of reaching another file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct FdId {
    pub slot: u32,
    pub generation: u32,
}

impl Encode for FdId {
    fn encode(&self, out: &mut Encoder) {
        out.put_u32(self.slot);
        out.put_u32(self.generation);
    }
}

impl Decode for FdId {
    const ENCODED_LEN_MIN: usize = 8;

    fn decode(input: &mut Reader) -> Result<Self, DecodeError> {
        Ok(FdId {
            slot: input.u32()?,
            generation: input.u32()?,
        })
    }
}

/// Matches a reply to its request on one connection; chosen by the client.
pub type RequestId = u64;

#[cfg(test)]
mod arbitrary {
    use proptest::prelude::*;

    use super::*;

    impl Arbitrary for Gfid {
        type Parameters = ();
        type Strategy = BoxedStrategy<Gfid>;

        fn arbitrary_with((): ()) -> Self::Strategy {
            prop_oneof![
                Just(Gfid::ROOT),
                any::<[u8; 16]>().prop_filter_map("null", Gfid::from_bytes)
            ]
            .boxed()
        }
    }

    impl Arbitrary for BrickId {
        type Parameters = ();
        type Strategy = BoxedStrategy<BrickId>;

        fn arbitrary_with((): ()) -> Self::Strategy {
            any::<[u8; 16]>().prop_map(BrickId).boxed()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_gfid_prints_as_uuid() {
        assert_eq!(
            Gfid::ROOT.to_string(),
            "00000000-0000-0000-0000-000000000001"
        );
        assert_eq!(
            "00000000-0000-0000-0000-000000000001".parse(),
            Ok(Gfid::ROOT)
        );
    }

    #[test]
    fn gfid_parse_rejects_bad_forms() {
        assert_eq!("".parse::<Gfid>(), Err(GfidParseError::Syntax));
        assert_eq!(
            "00000000-0000-0000-0000-00000000000g".parse::<Gfid>(),
            Err(GfidParseError::Syntax)
        );
        assert_eq!(
            "000000000000-0000-0000-000000000001".parse::<Gfid>(),
            Err(GfidParseError::Syntax)
        );
        assert_eq!(
            "00000000-0000-0000-0000-000000000000".parse::<Gfid>(),
            Err(GfidParseError::Null)
        );
        let g: Gfid = "DEADBEEF-0000-4000-8000-0123456789AB"
            .parse()
            .expect("upper-case hex parses");
        assert_eq!(g.to_string(), "deadbeef-0000-4000-8000-0123456789ab");
    }

    proptest::proptest! {
        #[test]
        fn gfid_display_parse_roundtrip(g: Gfid) {
            proptest::prop_assert_eq!(g.to_string().parse::<Gfid>(), Ok(g));
        }
    }
}
