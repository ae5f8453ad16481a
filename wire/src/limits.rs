//! Every bound of the protocol, as a named constant with its unit in the name.
//!
//! A decoder checks each length against these before it allocates; a server may advertise
//! smaller values in its HELLO reply ([`crate::Limits`]) but never larger ones.

/// Size of the fixed frame header, in bytes.
pub const FRAME_HEADER_LEN_BYTES: usize = 32;

/// Largest data payload of one READ reply, WRITE or PUT request, in bytes (1 MiB).
pub const IO_SIZE_MAX_BYTES: usize = 1024 * 1024;

/// Room for everything in a frame body that is not the data payload, in bytes.
pub const FRAME_METADATA_MAX_BYTES: usize = 64 * 1024;

/// Largest frame body, in bytes: one full data payload plus its metadata.
pub const FRAME_BODY_LEN_MAX_BYTES: usize = IO_SIZE_MAX_BYTES + FRAME_METADATA_MAX_BYTES;

/// Longest name of one directory entry, in bytes (Linux `NAME_MAX`).
pub const NAME_LEN_MAX_BYTES: usize = 255;

/// Longest symlink target, in bytes (Linux `PATH_MAX` less the terminating NUL).
pub const SYMLINK_TARGET_LEN_MAX_BYTES: usize = 4095;

/// Longest extended-attribute name, in bytes (Linux `XATTR_NAME_MAX`).
pub const XATTR_NAME_LEN_MAX_BYTES: usize = 255;

/// Largest extended-attribute value, in bytes (Linux `XATTR_SIZE_MAX`).
pub const XATTR_VALUE_LEN_MAX_BYTES: usize = 64 * 1024;

/// Most names one LISTXATTR reply carries (Linux caps the whole list at 64 KiB, and every
/// name takes at least two bytes there).
pub const XATTR_LIST_ENTRIES_MAX: usize = 32 * 1024;

/// Largest READDIR/READDIRP reply a client may ask for, in bytes of encoded entries.
pub const READDIR_REPLY_LEN_MAX_BYTES: usize = 128 * 1024;

/// What one READDIR entry counts against a reply's asked size besides its name, in bytes.
pub const READDIR_ENTRY_BYTES: usize = 24;

/// What one READDIRP entry counts against a reply's asked size besides its name, in bytes
/// (its attributes and, in READDIRP_XATTRS, its xattr presence included).
pub const READDIRP_ENTRY_BYTES: usize = 140;

/// Most supplementary groups carried with a caller's credentials.
pub const GROUPS_MAX: usize = 32;

/// Longest client or volume name, in bytes.
pub const LABEL_LEN_MAX_BYTES: usize = 64;

/// Most fops one BATCH request carries.
pub const BATCH_FOPS_MAX: usize = 256;

/// Most requests a client may have in flight on one connection; a brick may advertise less.
pub const INFLIGHT_MAX: usize = 4096;

const _: () = assert!(FRAME_HEADER_LEN_BYTES.is_multiple_of(8));
const _: () = assert!(READDIR_REPLY_LEN_MAX_BYTES < FRAME_BODY_LEN_MAX_BYTES);
const _: () =
    assert!(XATTR_VALUE_LEN_MAX_BYTES + FRAME_METADATA_MAX_BYTES <= FRAME_BODY_LEN_MAX_BYTES);
const _: () = assert!(SYMLINK_TARGET_LEN_MAX_BYTES < FRAME_METADATA_MAX_BYTES);
const _: () = assert!(FRAME_BODY_LEN_MAX_BYTES <= u32::MAX as usize);
const _: () = assert!(NAME_LEN_MAX_BYTES <= u8::MAX as usize);
const _: () = assert!(XATTR_NAME_LEN_MAX_BYTES <= u8::MAX as usize);
const _: () = assert!(SYMLINK_TARGET_LEN_MAX_BYTES <= u16::MAX as usize);
