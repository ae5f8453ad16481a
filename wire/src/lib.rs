//! Kiln's wire protocol, sans-IO: frames, every fop's request and reply, session messages,
//! identifiers, the error-code table and the protocol's limits.
//!
//! This crate is plain data in, plain data out. It opens no socket, starts no runtime and reads
//! no clock; the brick (`kiln-dataplane`) and the client (`kiln-client`) drive it. Decoding
//! never panics and never allocates more than the limits in [`limits`] allow: every input is
//! parsed into types that cannot hold invalid values ([`Name`], [`Gfid`], [`Mode`], …).
//!
//! A frame is a 32-byte [`Header`] (magic, version, kind, code, request id, body length and
//! two CRC-32C checksums) followed by the body. [`Message::encode`] and
//! [`Message::decode_frame`] convert between the two; `docs/wire.md` has the byte layout and
//! the versioning rule.
//!
//! ```
//! use kiln_wire::{Call, Creds, Gfid, Lookup, Message, Name, Request};
//!
//! let lookup = Lookup { parent: Gfid::ROOT, name: Name::new("hello.txt").unwrap() };
//! let msg = Message::Request(Request {
//!     id: 1,
//!     call: Call::Fop { creds: Creds::root(), fop: lookup.into() },
//! });
//! let bytes = msg.encode().unwrap().to_bytes();
//! assert_eq!(Message::decode_frame(bytes).unwrap(), msg);
//! ```

// The codec has no unsafe code; only `quic::runtime` registers its sockets with tokio.
#![deny(unsafe_code)]

mod attr;
mod batch;
mod codec;
mod errno;
mod flags;
mod fop;
mod frame;
mod ids;
pub mod limits;
mod message;
mod names;
#[cfg(feature = "quic")]
pub mod quic;
mod session;

pub use attr::{
    DirEntry, DirEntryPlus, DirEntryXattrs, FileType, FsStats, Iatt, Mode, SetAttr, TimeSet,
    Timespec,
};
pub use batch::{Batch, BatchError, BatchReply};
pub use codec::{Decode, DecodeError, Encode, Encoder, Reader};
pub use errno::ErrorCode;
pub use flags::{
    AccessMask, AccessMode, Creds, Groups, Lock, LockCmd, LockKind, NO_ID, OpenFlags, RenameMode,
    SeekWhat, XattrPresence, XattrSetMode,
};
pub use fop::*;
pub use frame::{
    FLAG_BODY_UNCHECKED, FrameKind, Header, MAGIC, PROTOCOL_VERSION, checksum, checksum_append,
};
pub use ids::{BrickId, FdId, Gfid, GfidParseError, RequestId};
pub use message::{
    BodyChecksum, Call, CallCode, EncodeError, EncodedFrame, Event, Message, Outcome, Reply,
    Request,
};
pub use names::{
    Label, Name, NameError, Payload, SymlinkTarget, XATTR_NAMESPACES, XattrName, XattrValue,
};
pub use session::{Capabilities, Hello, HelloReply, Invalidate, Limits, Ping, Recall};
