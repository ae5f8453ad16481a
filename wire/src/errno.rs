//! The stable table of wire error codes and its mapping to and from the host's errno.
//!
//! Wire codes are frozen: a code is never renumbered or reused. Their values happen to equal
//! the generic Linux (x86_64, arm64) errno numbers, which makes captures easy to read, but the
//! mapping always goes through `libc`, so a host with other errno values still gets the right
//! one. Adding a code is a protocol change: it needs a capability negotiated in HELLO.

use std::fmt;

use crate::codec::{Decode, DecodeError, Encode, Encoder, Reader};

macro_rules! error_codes {
    ($( $variant:ident = $wire:literal => $errno:ident, )*) => {
        /// Why a fop failed, as the client should report it.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[cfg_attr(test, derive(proptest_derive::Arbitrary))]
        #[repr(u16)]
        pub enum ErrorCode {
            $( $variant = $wire, )*
        }

        impl ErrorCode {
            /// Every code, in table order.
            pub const ALL: &[ErrorCode] = &[$( ErrorCode::$variant, )*];

            pub fn from_wire(code: u16) -> Option<ErrorCode> {
                match code {
                    $( $wire => Some(ErrorCode::$variant), )*
                    _ => None,
                }
            }

            /// The host errno for this code.
            pub fn to_errno(self) -> i32 {
                match self {
                    $( ErrorCode::$variant => libc::$errno, )*
                }
            }

            /// The code for a host errno. An errno outside the table becomes [`ErrorCode::Io`]
            /// (EIO): the client gets a real error, never a success or a wrong specific one.
            pub fn from_errno(errno: i32) -> ErrorCode {
                // ENOTSUP and EOPNOTSUPP, EWOULDBLOCK and EAGAIN share a value on Linux.
                match errno {
                    $( libc::$errno => ErrorCode::$variant, )*
                    _ => ErrorCode::Io,
                }
            }

            /// This code's position in [`ErrorCode::ALL`], for tables indexed by error.
            pub fn index(self) -> usize {
                ErrorCode::ALL.iter().position(|&c| c == self).unwrap_or(0)
            }

            /// The errno's symbolic name, e.g. `"ENOENT"`.
            pub fn errno_name(self) -> &'static str {
                match self {
                    $( ErrorCode::$variant => stringify!($errno), )*
                }
            }
        }
    };
}

error_codes! {
    Perm = 1 => EPERM,
    NoEnt = 2 => ENOENT,
    Intr = 4 => EINTR,
    Io = 5 => EIO,
    NxIo = 6 => ENXIO,
    TooBig = 7 => E2BIG,
    BadFd = 9 => EBADF,
    Again = 11 => EAGAIN,
    NoMem = 12 => ENOMEM,
    Access = 13 => EACCES,
    Fault = 14 => EFAULT,
    Busy = 16 => EBUSY,
    Exist = 17 => EEXIST,
    CrossDevice = 18 => EXDEV,
    NoDev = 19 => ENODEV,
    NotDir = 20 => ENOTDIR,
    IsDir = 21 => EISDIR,
    Inval = 22 => EINVAL,
    NFile = 23 => ENFILE,
    MFile = 24 => EMFILE,
    TextBusy = 26 => ETXTBSY,
    FileTooBig = 27 => EFBIG,
    NoSpace = 28 => ENOSPC,
    SPipe = 29 => ESPIPE,
    ReadOnlyFs = 30 => EROFS,
    MLink = 31 => EMLINK,
    Range = 34 => ERANGE,
    Deadlock = 35 => EDEADLK,
    NameTooLong = 36 => ENAMETOOLONG,
    NoLock = 37 => ENOLCK,
    NoSys = 38 => ENOSYS,
    NotEmpty = 39 => ENOTEMPTY,
    Loop = 40 => ELOOP,
    NoData = 61 => ENODATA,
    Proto = 71 => EPROTO,
    Overflow = 75 => EOVERFLOW,
    ProtoNotSupported = 93 => EPROTONOSUPPORT,
    NotSupported = 95 => EOPNOTSUPP,
    NotConnected = 107 => ENOTCONN,
    TimedOut = 110 => ETIMEDOUT,
    Stale = 116 => ESTALE,
    Quota = 122 => EDQUOT,
    Canceled = 125 => ECANCELED,
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = std::io::Error::from_raw_os_error(self.to_errno()).to_string();
        // `io::Error` appends " (os error N)"; users want coreutils-style text.
        let text = text.split(" (os error").next().unwrap_or(&text);
        write!(f, "{text}")
    }
}

impl std::error::Error for ErrorCode {}

impl Encode for ErrorCode {
    fn encode(&self, out: &mut Encoder) {
        out.put_u16(*self as u16);
    }
}

impl Decode for ErrorCode {
    const ENCODED_LEN_MIN: usize = 2;

    fn decode(input: &mut Reader) -> Result<Self, DecodeError> {
        let code = input.u16()?;
        ErrorCode::from_wire(code).ok_or(DecodeError::UnknownErrorCode(code))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_maps_to_errno_and_back() {
        for &code in ErrorCode::ALL {
            assert_eq!(ErrorCode::from_errno(code.to_errno()), code, "{code:?}");
            assert_eq!(ErrorCode::from_wire(code as u16), Some(code));
        }
    }

    #[test]
    fn codes_are_frozen() {
        // The wire values are part of the protocol; this test fails if one moves.
        let frozen = [
            (ErrorCode::Perm, 1),
            (ErrorCode::NoEnt, 2),
            (ErrorCode::Io, 5),
            (ErrorCode::BadFd, 9),
            (ErrorCode::Access, 13),
            (ErrorCode::Exist, 17),
            (ErrorCode::CrossDevice, 18),
            (ErrorCode::NotDir, 20),
            (ErrorCode::IsDir, 21),
            (ErrorCode::Inval, 22),
            (ErrorCode::MFile, 24),
            (ErrorCode::NoSpace, 28),
            (ErrorCode::NameTooLong, 36),
            (ErrorCode::NotEmpty, 39),
            (ErrorCode::Loop, 40),
            (ErrorCode::NoData, 61),
            (ErrorCode::Stale, 116),
        ];
        for (code, wire) in frozen {
            assert_eq!(code as u16, wire, "{code:?}");
        }
    }

    #[test]
    fn unknown_errno_becomes_eio_and_display_reads_like_coreutils() {
        assert_eq!(ErrorCode::from_errno(libc::EHWPOISON), ErrorCode::Io);
        assert_eq!(
            ErrorCode::from_errno(libc::ENOTSUP),
            ErrorCode::NotSupported
        );
        assert_eq!(ErrorCode::NoEnt.to_string(), "No such file or directory");
        assert_eq!(ErrorCode::NoEnt.errno_name(), "ENOENT");
    }
}
