//! Validated byte strings: directory-entry names, symlink targets, xattr names and values,
//! data payloads, and client/volume labels. Each is checked once, when it is made or decoded,
//! and cannot hold an invalid value afterwards.

use std::fmt;

use bytes::Bytes;
use thiserror::Error;

use crate::codec::{Decode, DecodeError, Encode, Encoder, Reader};
use crate::limits::{
    IO_SIZE_MAX_BYTES, LABEL_LEN_MAX_BYTES, NAME_LEN_MAX_BYTES, SYMLINK_TARGET_LEN_MAX_BYTES,
    XATTR_NAME_LEN_MAX_BYTES, XATTR_VALUE_LEN_MAX_BYTES,
};

/// Why a byte string was refused. Maps to the errno a local file system returns for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum NameError {
    #[error("empty")]
    Empty,
    #[error("{len} bytes long, more than {max}")]
    TooLong { len: usize, max: usize },
    #[error("contains '/'")]
    Slash,
    #[error("contains a NUL byte")]
    Nul,
    #[error("'.' and '..' are not names")]
    Dot,
    #[error("no namespace prefix (user., trusted., security. or system.)")]
    XattrNamespace,
    #[error("characters other than A-Z a-z 0-9 . _ -")]
    LabelCharset,
}

impl NameError {
    /// The errno a Linux file system gives for the same mistake.
    pub fn errno(self) -> i32 {
        match self {
            NameError::TooLong { .. } => libc::ENAMETOOLONG,
            NameError::Empty => libc::ENOENT,
            NameError::XattrNamespace => libc::EOPNOTSUPP,
            _ => libc::EINVAL,
        }
    }
}

fn check_len(len: usize, min: usize, max: usize) -> Result<(), NameError> {
    if len < min {
        return Err(NameError::Empty);
    }
    if len > max {
        return Err(NameError::TooLong { len, max });
    }
    Ok(())
}

fn decode_err(what: &'static str, e: NameError) -> DecodeError {
    match e {
        NameError::TooLong { len, max } => DecodeError::TooLong { what, len, max },
        NameError::Empty => DecodeError::invalid(what, "empty"),
        NameError::Slash => DecodeError::invalid(what, "contains '/'"),
        NameError::Nul => DecodeError::invalid(what, "contains NUL"),
        NameError::Dot => DecodeError::invalid(what, "'.' or '..'"),
        NameError::XattrNamespace => DecodeError::invalid(what, "no namespace prefix"),
        NameError::LabelCharset => DecodeError::invalid(what, "bad characters"),
    }
}

/// Defines a validated byte-string newtype with a length prefix of `$len_ty`.
macro_rules! checked_bytes {
    ($(#[$meta:meta])* $name:ident, $what:literal, $len_ty:ty, $check:path) => {
        $(#[$meta])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Bytes);

        impl $name {
            pub fn new(bytes: impl Into<Bytes>) -> Result<Self, NameError> {
                let bytes = bytes.into();
                $check(&bytes)?;
                Ok(Self(bytes))
            }

            pub fn as_bytes(&self) -> &[u8] {
                &self.0
            }

            pub fn into_bytes(self) -> Bytes {
                self.0
            }

            pub fn len(&self) -> usize {
                self.0.len()
            }

            pub fn is_empty(&self) -> bool {
                self.0.is_empty()
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($name), String::from_utf8_lossy(&self.0))
            }
        }

        impl Encode for $name {
            fn encode(&self, out: &mut Encoder) {
                let len = <$len_ty>::try_from(self.0.len()).unwrap_or(<$len_ty>::MAX);
                Encode::encode(&len, out);
                out.put_bytes(&self.0);
            }
        }

        impl Decode for $name {
            const ENCODED_LEN_MIN: usize = size_of::<$len_ty>();

            fn decode(input: &mut Reader) -> Result<Self, DecodeError> {
                let len = <$len_ty as Decode>::decode(input)? as usize;
                let bytes = input.bytes(len)?;
                $check(&bytes).map_err(|e| decode_err($what, e))?;
                Ok(Self(bytes))
            }
        }
    };
}

fn check_name(b: &[u8]) -> Result<(), NameError> {
    check_len(b.len(), 1, NAME_LEN_MAX_BYTES)?;
    if b == b"." || b == b".." {
        return Err(NameError::Dot);
    }
    check_no_nul(b)?;
    if b.contains(&b'/') {
        return Err(NameError::Slash);
    }
    Ok(())
}

fn check_no_nul(b: &[u8]) -> Result<(), NameError> {
    match b.contains(&0) {
        true => Err(NameError::Nul),
        false => Ok(()),
    }
}

fn check_symlink_target(b: &[u8]) -> Result<(), NameError> {
    check_len(b.len(), 1, SYMLINK_TARGET_LEN_MAX_BYTES)?;
    check_no_nul(b)
}

/// The namespaces Linux knows; a name outside them is refused with EOPNOTSUPP.
pub const XATTR_NAMESPACES: [&[u8]; 4] = [b"user.", b"trusted.", b"security.", b"system."];

fn check_xattr_name(b: &[u8]) -> Result<(), NameError> {
    check_len(b.len(), 1, XATTR_NAME_LEN_MAX_BYTES)?;
    check_no_nul(b)?;
    match XATTR_NAMESPACES
        .iter()
        .any(|ns| b.len() > ns.len() && b.starts_with(ns))
    {
        true => Ok(()),
        false => Err(NameError::XattrNamespace),
    }
}

fn check_xattr_value(b: &[u8]) -> Result<(), NameError> {
    check_len(b.len(), 0, XATTR_VALUE_LEN_MAX_BYTES)
}

fn check_payload(b: &[u8]) -> Result<(), NameError> {
    check_len(b.len(), 0, IO_SIZE_MAX_BYTES)
}

fn check_label(b: &[u8]) -> Result<(), NameError> {
    check_len(b.len(), 1, LABEL_LEN_MAX_BYTES)?;
    match b
        .iter()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
    {
        true => Ok(()),
        false => Err(NameError::LabelCharset),
    }
}

checked_bytes!(
    /// One directory-entry name: 1–255 bytes, no `/`, no NUL, not `.` or `..`. Not
    /// necessarily UTF-8, like names on Linux.
    Name, "name", u8, check_name
);
checked_bytes!(
    /// What a symlink points at: 1–4095 bytes without NUL. Stored as given; the brick never
    /// follows it.
    SymlinkTarget, "symlink target", u16, check_symlink_target
);
checked_bytes!(
    /// An extended-attribute name with its namespace prefix, e.g. `user.mime_type`.
    XattrName, "xattr name", u8, check_xattr_name
);
checked_bytes!(
    /// An extended-attribute value, up to 64 KiB.
    XattrValue, "xattr value", u32, check_xattr_value
);
checked_bytes!(
    /// File data carried by READ, WRITE and PUT: up to 1 MiB, shared, never copied on decode.
    Payload, "payload", u32, check_payload
);
checked_bytes!(
    /// A client or volume name: 1–64 bytes of `A-Z a-z 0-9 . _ -`.
    Label, "label", u8, check_label
);

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&String::from_utf8_lossy(&self.0))
    }
}

impl fmt::Display for Label {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Labels are ASCII by construction.
        f.write_str(&String::from_utf8_lossy(&self.0))
    }
}

#[cfg(test)]
mod arbitrary {
    use proptest::collection::vec;
    use proptest::prelude::*;

    use super::*;

    fn strategy<T: fmt::Debug + 'static>(
        bytes: impl Strategy<Value = Vec<u8>> + 'static,
        make: fn(Bytes) -> Result<T, NameError>,
    ) -> BoxedStrategy<T> {
        bytes
            .prop_filter_map("invalid", move |b| make(Bytes::from(b)).ok())
            .boxed()
    }

    macro_rules! arbitrary_bytes {
        ($($name:ident => $bytes:expr;)*) => {$(
            impl Arbitrary for $name {
                type Parameters = ();
                type Strategy = BoxedStrategy<$name>;
                fn arbitrary_with((): ()) -> Self::Strategy {
                    strategy($bytes, |b| $name::new(b))
                }
            }
        )*};
    }

    arbitrary_bytes! {
        Name => vec(any::<u8>(), 1..=NAME_LEN_MAX_BYTES);
        SymlinkTarget => vec(1u8..=255, 1..300);
        XattrName => "(user|trusted|security|system)\\.[a-z0-9._]{1,40}".prop_map(String::into_bytes);
        XattrValue => vec(any::<u8>(), 0..200);
        Payload => prop_oneof![vec(any::<u8>(), 0..64), vec(any::<u8>(), 4096..5000)];
        Label => "[A-Za-z0-9._-]{1,64}".prop_map(String::into_bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn name_rules() {
        assert!(Name::new(&b"a"[..]).is_ok());
        assert!(Name::new(vec![b'x'; 255]).is_ok());
        assert_eq!(
            Name::new(vec![b'x'; 256]),
            Err(NameError::TooLong { len: 256, max: 255 })
        );
        assert_eq!(Name::new(&b""[..]), Err(NameError::Empty));
        assert_eq!(Name::new(&b"."[..]), Err(NameError::Dot));
        assert_eq!(Name::new(&b".."[..]), Err(NameError::Dot));
        assert!(Name::new(&b"..."[..]).is_ok());
        assert_eq!(Name::new(&b"a/b"[..]), Err(NameError::Slash));
        assert_eq!(Name::new(&b"a\0b"[..]), Err(NameError::Nul));
        assert!(Name::new(&b"\xff\xfe not utf-8"[..]).is_ok());
        assert_eq!(
            NameError::TooLong { len: 256, max: 255 }.errno(),
            libc::ENAMETOOLONG
        );
        assert_eq!(NameError::Slash.errno(), libc::EINVAL);
    }

    #[test]
    fn xattr_name_rules() {
        assert!(XattrName::new(&b"user.x"[..]).is_ok());
        assert!(XattrName::new(&b"trusted.gfid"[..]).is_ok());
        assert_eq!(
            XattrName::new(&b"user."[..]),
            Err(NameError::XattrNamespace)
        );
        assert_eq!(
            XattrName::new(&b"foo.bar"[..]),
            Err(NameError::XattrNamespace)
        );
        assert_eq!(XattrName::new(&b"user.a\0"[..]), Err(NameError::Nul));
        assert!(XattrValue::new(vec![0; XATTR_VALUE_LEN_MAX_BYTES]).is_ok());
        assert!(XattrValue::new(vec![0; XATTR_VALUE_LEN_MAX_BYTES + 1]).is_err());
    }

    #[test]
    fn label_rules() {
        assert!(Label::new(&b"vol-0.a_b"[..]).is_ok());
        assert_eq!(Label::new(&b"a b"[..]), Err(NameError::LabelCharset));
        assert_eq!(
            Label::new(vec![b'a'; 65]),
            Err(NameError::TooLong { len: 65, max: 64 })
        );
    }
}
