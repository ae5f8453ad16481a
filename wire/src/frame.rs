//! The fixed-size frame header. It is checked on its own, before the body is read, so a
//! reader knows the body's length and can trust it (see `docs/wire.md` for the byte layout).

use crate::codec::DecodeError;
use crate::ids::RequestId;
use crate::limits::{FRAME_BODY_LEN_MAX_BYTES, FRAME_HEADER_LEN_BYTES};

/// `b"KILN"`: the first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"KILN";

/// The frame layout and message shapes this build speaks.
pub const PROTOCOL_VERSION: u8 = 1;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// Client to brick.
    Request = 1,
    /// Brick to client, answering the request with the same id.
    Reply = 2,
    /// Brick to client, unsolicited (e.g. a cache invalidation).
    Event = 3,
}

impl FrameKind {
    pub fn from_u8(v: u8) -> Option<FrameKind> {
        match v {
            1 => Some(FrameKind::Request),
            2 => Some(FrameKind::Reply),
            3 => Some(FrameKind::Event),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            FrameKind::Request => "request",
            FrameKind::Reply => "reply",
            FrameKind::Event => "event",
        }
    }
}

/// Header flag: the body carries no checksum (`body_checksum` is zero). Sent only on a session
/// that negotiated [`Capabilities::UNCHECKED_BODIES`](crate::Capabilities::UNCHECKED_BODIES),
/// whose transport already authenticates every byte (QUIC's AEAD).
pub const FLAG_BODY_UNCHECKED: u16 = 1 << 0;

/// Every header flag this build knows; any other set bit is refused.
const FLAGS_KNOWN: u16 = FLAG_BODY_UNCHECKED;

/// A decoded, checked frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: FrameKind,
    /// The message code: a fop code or a session code (see [`crate::Code`]).
    pub code: u16,
    /// Per-frame flags: [`FLAG_BODY_UNCHECKED`] or none; any other set bit is refused.
    pub flags: u16,
    pub request_id: RequestId,
    pub body_len: u32,
    /// CRC-32C of the body; zero when the body is unchecked.
    pub body_checksum: u32,
}

const _: () = assert!(FRAME_HEADER_LEN_BYTES == 32);

/// Byte offsets of the header fields; the layout table in `docs/wire.md` mirrors these.
mod offset {
    pub(super) const MAGIC: usize = 0;
    pub(super) const VERSION: usize = 4;
    pub(super) const KIND: usize = 5;
    pub(super) const CODE: usize = 6;
    pub(super) const FLAGS: usize = 8;
    pub(super) const RESERVED: usize = 10;
    pub(super) const BODY_LEN: usize = 12;
    pub(super) const REQUEST_ID: usize = 16;
    pub(super) const BODY_CHECKSUM: usize = 24;
    pub(super) const HEADER_CHECKSUM: usize = 28;
}

/// CRC-32C (Castagnoli), hardware-accelerated where the CPU has it.
pub fn checksum(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// Continues a CRC-32C over another chunk.
pub fn checksum_append(crc: u32, bytes: &[u8]) -> u32 {
    crc32c::crc32c_append(crc, bytes)
}

fn read_u16(b: &[u8; FRAME_HEADER_LEN_BYTES], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn read_u32(b: &[u8; FRAME_HEADER_LEN_BYTES], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

impl Header {
    /// The header's 32 bytes, its own checksum included.
    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN_BYTES] {
        let mut b = [0u8; FRAME_HEADER_LEN_BYTES];
        b[offset::MAGIC..offset::VERSION].copy_from_slice(&MAGIC);
        b[offset::VERSION] = PROTOCOL_VERSION;
        b[offset::KIND] = self.kind as u8;
        b[offset::CODE..offset::FLAGS].copy_from_slice(&self.code.to_le_bytes());
        b[offset::FLAGS..offset::RESERVED].copy_from_slice(&self.flags.to_le_bytes());
        b[offset::BODY_LEN..offset::REQUEST_ID].copy_from_slice(&self.body_len.to_le_bytes());
        b[offset::REQUEST_ID..offset::BODY_CHECKSUM]
            .copy_from_slice(&self.request_id.to_le_bytes());
        b[offset::BODY_CHECKSUM..offset::HEADER_CHECKSUM]
            .copy_from_slice(&self.body_checksum.to_le_bytes());
        let crc = checksum(&b[..offset::HEADER_CHECKSUM]);
        b[offset::HEADER_CHECKSUM..].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Checks and decodes a header: magic, version, checksum, kind, reserved bits and the
    /// body length limit, in that order.
    pub fn decode(b: &[u8; FRAME_HEADER_LEN_BYTES]) -> Result<Header, DecodeError> {
        if b[offset::MAGIC..offset::VERSION] != MAGIC {
            return Err(DecodeError::BadMagic(u32::from_be_bytes([
                b[0], b[1], b[2], b[3],
            ])));
        }
        if b[offset::VERSION] != PROTOCOL_VERSION {
            return Err(DecodeError::UnsupportedVersion(b[offset::VERSION]));
        }
        if checksum(&b[..offset::HEADER_CHECKSUM]) != read_u32(b, offset::HEADER_CHECKSUM) {
            return Err(DecodeError::HeaderChecksum);
        }
        let kind =
            FrameKind::from_u8(b[offset::KIND]).ok_or(DecodeError::UnknownKind(b[offset::KIND]))?;
        let flags = read_u16(b, offset::FLAGS);
        let reserved = read_u16(b, offset::RESERVED);
        if flags & !FLAGS_KNOWN != 0 || reserved != 0 {
            return Err(DecodeError::ReservedBits(
                u32::from(flags & !FLAGS_KNOWN) << 16 | u32::from(reserved),
            ));
        }
        let body_checksum = read_u32(b, offset::BODY_CHECKSUM);
        if flags & FLAG_BODY_UNCHECKED != 0 && body_checksum != 0 {
            return Err(DecodeError::invalid(
                "frame header",
                "an unchecked body with a checksum",
            ));
        }
        let body_len = read_u32(b, offset::BODY_LEN);
        if body_len as usize > FRAME_BODY_LEN_MAX_BYTES {
            return Err(DecodeError::TooLong {
                what: "frame body",
                len: body_len as usize,
                max: FRAME_BODY_LEN_MAX_BYTES,
            });
        }
        let request_id = u64::from_le_bytes(
            b[offset::REQUEST_ID..offset::BODY_CHECKSUM]
                .try_into()
                .unwrap_or_default(),
        );
        Ok(Header {
            kind,
            code: read_u16(b, offset::CODE),
            flags,
            request_id,
            body_len,
            body_checksum,
        })
    }

    /// Whether the body carries a checksum (it does unless [`FLAG_BODY_UNCHECKED`] is set).
    pub fn body_checked(&self) -> bool {
        self.flags & FLAG_BODY_UNCHECKED == 0
    }

    /// Decodes the header at the start of `bytes`, which may be longer or shorter.
    pub fn decode_prefix(bytes: &[u8]) -> Result<Header, DecodeError> {
        let head = bytes
            .get(..FRAME_HEADER_LEN_BYTES)
            .ok_or(DecodeError::Truncated {
                needed: FRAME_HEADER_LEN_BYTES,
                remaining: bytes.len(),
            })?;
        let head: &[u8; FRAME_HEADER_LEN_BYTES] =
            head.try_into().map_err(|_| DecodeError::Truncated {
                needed: FRAME_HEADER_LEN_BYTES,
                remaining: bytes.len(),
            })?;
        Header::decode(head)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Header {
        Header {
            kind: FrameKind::Request,
            code: 27,
            flags: 0,
            request_id: 0x0102_0304_0506_0708,
            body_len: 100,
            body_checksum: 0xdead_beef,
        }
    }

    #[test]
    fn header_roundtrip() {
        assert_eq!(Header::decode(&sample().encode()), Ok(sample()));
    }

    #[test]
    fn every_corrupted_header_byte_is_caught() {
        let good = sample().encode();
        for i in 0..FRAME_HEADER_LEN_BYTES {
            for bit in 0..8 {
                let mut bad = good;
                bad[i] ^= 1 << bit;
                assert!(
                    Header::decode(&bad).is_err(),
                    "flip of byte {i} bit {bit} accepted"
                );
            }
        }
    }

    #[test]
    fn oversized_body_and_reserved_bits_are_refused() {
        let mut h = sample();
        h.body_len = u32::try_from(FRAME_BODY_LEN_MAX_BYTES + 1).expect("fits");
        assert!(matches!(
            Header::decode(&h.encode()),
            Err(DecodeError::TooLong { .. })
        ));
        let mut h = sample();
        h.flags = 2 | FLAG_BODY_UNCHECKED;
        assert_eq!(
            Header::decode(&h.encode()),
            Err(DecodeError::ReservedBits(2 << 16))
        );
    }

    #[test]
    fn an_unchecked_body_has_no_checksum() {
        let mut h = sample();
        h.flags = FLAG_BODY_UNCHECKED;
        assert!(matches!(
            Header::decode(&h.encode()),
            Err(DecodeError::Invalid { .. })
        ));
        h.body_checksum = 0;
        let decoded = Header::decode(&h.encode()).expect("decodes");
        assert!(!decoded.body_checked());
        assert!(sample().body_checked());
    }

    #[test]
    fn wrong_version_is_named() {
        let mut b = sample().encode();
        b[offset::VERSION] = 2;
        let crc = checksum(&b[..offset::HEADER_CHECKSUM]);
        b[offset::HEADER_CHECKSUM..].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(Header::decode(&b), Err(DecodeError::UnsupportedVersion(2)));
    }

    #[test]
    fn short_input_is_truncated() {
        assert_eq!(
            Header::decode_prefix(&[0; 5]),
            Err(DecodeError::Truncated {
                needed: 32,
                remaining: 5
            })
        );
    }
}
