//! The binary codec every message is built from: little-endian integers, length-prefixed
//! byte strings and bounded lists.
//!
//! [`Reader`] bounds-checks every read and hands out sub-slices of the frame's [`Bytes`], so a
//! data payload is never copied on decode. [`Encoder`] copies small fields into one buffer and
//! keeps large payloads as separate chunks, so a 1 MiB WRITE is not copied on encode either.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use thiserror::Error;

/// Why a frame or message could not be decoded. Decoding never panics; it returns one of these.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DecodeError {
    #[error("input ends early: {needed} more bytes needed, {remaining} left")]
    Truncated { needed: usize, remaining: usize },
    #[error("bad magic {0:#010x}: not a Kiln frame")]
    BadMagic(u32),
    #[error("protocol version {0} is not supported (this build speaks {supported})", supported = crate::PROTOCOL_VERSION)]
    UnsupportedVersion(u8),
    #[error("frame header checksum mismatch")]
    HeaderChecksum,
    #[error("frame body checksum mismatch")]
    BodyChecksum,
    #[error("a frame body without a checksum on a session that did not negotiate it")]
    UncheckedBody,
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("unknown message code {code:#06x} for a {kind} frame")]
    UnknownCode { kind: &'static str, code: u16 },
    #[error("reserved header bits are set: {0:#x}")]
    ReservedBits(u32),
    #[error("{what} is {len} long, more than the limit of {max}")]
    TooLong {
        what: &'static str,
        len: usize,
        max: usize,
    },
    #[error("{0} bytes left over after the message")]
    TrailingBytes(usize),
    #[error("invalid {what}: {reason}")]
    Invalid {
        what: &'static str,
        reason: &'static str,
    },
    #[error("unknown wire error code {0}")]
    UnknownErrorCode(u16),
}

impl DecodeError {
    pub(crate) fn invalid(what: &'static str, reason: &'static str) -> Self {
        Self::Invalid { what, reason }
    }
}

/// Something that can be written to the wire.
pub trait Encode {
    fn encode(&self, out: &mut Encoder);
}

/// Something that can be read back from the wire, validating as it goes.
pub trait Decode: Sized {
    /// The fewest bytes one encoded value takes; bounds how many elements a list length may
    /// claim before anything is allocated.
    const ENCODED_LEN_MIN: usize = 1;

    fn decode(input: &mut Reader) -> Result<Self, DecodeError>;
}

/// Payloads at least this long are kept as their own chunk instead of being copied.
const SHARED_CHUNK_LEN_MIN_BYTES: usize = 4096;

/// Builds a frame body as a list of chunks: copied small fields, shared large payloads.
#[derive(Debug, Default)]
pub struct Encoder {
    current: BytesMut,
    chunks: Vec<Bytes>,
}

impl Encoder {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn put_u8(&mut self, v: u8) {
        self.current.put_u8(v);
    }
    pub fn put_u16(&mut self, v: u16) {
        self.current.put_u16_le(v);
    }
    pub fn put_u32(&mut self, v: u32) {
        self.current.put_u32_le(v);
    }
    pub fn put_u64(&mut self, v: u64) {
        self.current.put_u64_le(v);
    }
    pub fn put_i64(&mut self, v: i64) {
        self.current.put_i64_le(v);
    }
    pub fn put_slice(&mut self, v: &[u8]) {
        self.current.put_slice(v);
    }

    /// Appends `v`, sharing it instead of copying when it is large.
    pub fn put_bytes(&mut self, v: &Bytes) {
        if v.len() < SHARED_CHUNK_LEN_MIN_BYTES {
            self.current.put_slice(v);
        } else {
            self.flush_current();
            self.chunks.push(v.clone());
        }
    }

    /// Bytes encoded so far.
    pub fn len(&self) -> usize {
        self.current.len() + self.chunks.iter().map(Bytes::len).sum::<usize>()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The finished body as chunks, in order.
    pub fn into_chunks(mut self) -> Vec<Bytes> {
        self.flush_current();
        self.chunks
    }

    fn flush_current(&mut self) {
        if !self.current.is_empty() {
            self.chunks.push(self.current.split().freeze());
        }
    }
}

/// A bounds-checked cursor over one frame body.
#[derive(Debug)]
pub struct Reader {
    buf: Bytes,
}

impl Reader {
    pub fn new(buf: Bytes) -> Self {
        Self { buf }
    }

    pub fn remaining(&self) -> usize {
        self.buf.len()
    }

    fn need(&self, needed: usize) -> Result<(), DecodeError> {
        if self.buf.len() < needed {
            return Err(DecodeError::Truncated {
                needed,
                remaining: self.buf.len(),
            });
        }
        Ok(())
    }

    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        self.need(1)?;
        Ok(self.buf.get_u8())
    }
    pub fn u16(&mut self) -> Result<u16, DecodeError> {
        self.need(2)?;
        Ok(self.buf.get_u16_le())
    }
    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        self.need(4)?;
        Ok(self.buf.get_u32_le())
    }
    pub fn u64(&mut self) -> Result<u64, DecodeError> {
        self.need(8)?;
        Ok(self.buf.get_u64_le())
    }
    pub fn i64(&mut self) -> Result<i64, DecodeError> {
        self.need(8)?;
        Ok(self.buf.get_i64_le())
    }

    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        self.need(N)?;
        let mut out = [0; N];
        self.buf.copy_to_slice(&mut out);
        Ok(out)
    }

    /// The next `len` bytes, shared with the frame buffer (no copy).
    pub fn bytes(&mut self, len: usize) -> Result<Bytes, DecodeError> {
        self.need(len)?;
        Ok(self.buf.split_to(len))
    }

    /// A list length, refused when the remaining input cannot hold that many elements of at
    /// least `element_len_min` bytes each or when it exceeds `max`.
    pub fn list_len(
        &mut self,
        what: &'static str,
        element_len_min: usize,
        max: usize,
    ) -> Result<usize, DecodeError> {
        let len = self.u32()? as usize;
        if len > max {
            return Err(DecodeError::TooLong { what, len, max });
        }
        let needed = len.saturating_mul(element_len_min.max(1));
        self.need(needed)?;
        Ok(len)
    }

    /// Fails unless every byte was consumed.
    pub fn finish(self) -> Result<(), DecodeError> {
        match self.buf.len() {
            0 => Ok(()),
            n => Err(DecodeError::TrailingBytes(n)),
        }
    }
}

macro_rules! int_codec {
    ($($ty:ty => $put:ident, $get:ident;)*) => {$(
        impl Encode for $ty {
            fn encode(&self, out: &mut Encoder) {
                out.$put(*self);
            }
        }
        impl Decode for $ty {
            const ENCODED_LEN_MIN: usize = size_of::<$ty>();
            fn decode(input: &mut Reader) -> Result<Self, DecodeError> {
                input.$get()
            }
        }
    )*};
}

int_codec! {
    u8 => put_u8, u8;
    u16 => put_u16, u16;
    u32 => put_u32, u32;
    u64 => put_u64, u64;
    i64 => put_i64, i64;
}

impl Encode for bool {
    fn encode(&self, out: &mut Encoder) {
        out.put_u8(u8::from(*self));
    }
}

impl Decode for bool {
    fn decode(input: &mut Reader) -> Result<Self, DecodeError> {
        match input.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(DecodeError::invalid("bool", "not 0 or 1")),
        }
    }
}

/// `Option<T>` is a presence byte followed by the value.
impl<T: Encode> Encode for Option<T> {
    fn encode(&self, out: &mut Encoder) {
        match self {
            None => out.put_u8(0),
            Some(v) => {
                out.put_u8(1);
                v.encode(out);
            }
        }
    }
}

impl<T: Decode> Decode for Option<T> {
    fn decode(input: &mut Reader) -> Result<Self, DecodeError> {
        match input.u8()? {
            0 => Ok(None),
            1 => Ok(Some(T::decode(input)?)),
            _ => Err(DecodeError::invalid("option tag", "not 0 or 1")),
        }
    }
}

/// Encodes a list as a `u32` count followed by its elements.
pub(crate) fn encode_list<T: Encode>(items: &[T], out: &mut Encoder) {
    let len = u32::try_from(items.len()).unwrap_or(u32::MAX);
    out.put_u32(len);
    for item in items {
        item.encode(out);
    }
}

/// Decodes a list written by [`encode_list`], holding at most `max` elements. Capacity grows
/// with the elements actually decoded, so a lying count cannot force a large allocation.
pub(crate) fn decode_list<T: Decode>(
    input: &mut Reader,
    what: &'static str,
    max: usize,
) -> Result<Vec<T>, DecodeError> {
    let len = input.list_len(what, T::ENCODED_LEN_MIN, max)?;
    let mut items = Vec::with_capacity(len.min(64));
    for _ in 0..len {
        items.push(T::decode(input)?);
    }
    Ok(items)
}

/// Defines a plain message struct whose encoding is its fields in order.
macro_rules! wire_struct {
    ($(
        $(#[$meta:meta])*
        pub struct $name:ident { $( $(#[$fmeta:meta])* pub $field:ident : $ty:ty ),* $(,)? }
    )*) => {$(
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq)]
        #[cfg_attr(test, derive(proptest_derive::Arbitrary))]
        pub struct $name { $( $(#[$fmeta])* pub $field: $ty ),* }

        impl $crate::codec::Encode for $name {
            #[allow(unused_variables)]
            fn encode(&self, out: &mut $crate::codec::Encoder) {
                $( $crate::codec::Encode::encode(&self.$field, out); )*
            }
        }

        impl $crate::codec::Decode for $name {
            #[allow(unused_variables)]
            fn decode(
                input: &mut $crate::codec::Reader,
            ) -> Result<Self, $crate::codec::DecodeError> {
                Ok(Self { $( $field: $crate::codec::Decode::decode(input)? ),* })
            }
        }
    )*};
}
pub(crate) use wire_struct;

/// Defines a fieldless enum stored as one `u8`, with a stable value per variant.
macro_rules! wire_enum {
    ($(
        $(#[$meta:meta])*
        pub enum $name:ident { $( $(#[$vmeta:meta])* $variant:ident = $value:literal ),* $(,)? }
    )*) => {$(
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[cfg_attr(test, derive(proptest_derive::Arbitrary))]
        #[repr(u8)]
        pub enum $name { $( $(#[$vmeta])* $variant = $value ),* }

        impl $name {
            pub fn from_u8(v: u8) -> Option<Self> {
                match v {
                    $( $value => Some(Self::$variant), )*
                    _ => None,
                }
            }
        }

        impl $crate::codec::Encode for $name {
            fn encode(&self, out: &mut $crate::codec::Encoder) {
                out.put_u8(*self as u8);
            }
        }

        impl $crate::codec::Decode for $name {
            fn decode(
                input: &mut $crate::codec::Reader,
            ) -> Result<Self, $crate::codec::DecodeError> {
                Self::from_u8(input.u8()?).ok_or($crate::codec::DecodeError::Invalid {
                    what: stringify!($name),
                    reason: "unknown value",
                })
            }
        }
    )*};
}
pub(crate) use wire_enum;
