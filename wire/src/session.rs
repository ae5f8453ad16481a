//! Session messages: the HELLO handshake, PING, and events the brick pushes to clients.

use crate::codec::{Decode, DecodeError, Encode, Encoder, Reader, wire_struct};
use crate::errno::ErrorCode;
use crate::fop::LeaseKind;
use crate::frame::PROTOCOL_VERSION;
use crate::ids::{BrickId, Gfid};
use crate::limits::{
    FRAME_BODY_LEN_MAX_BYTES, INFLIGHT_MAX, IO_SIZE_MAX_BYTES, READDIR_REPLY_LEN_MAX_BYTES,
};
use crate::message::BodyChecksum;
use crate::names::{Label, Name};

/// Optional features, negotiated in HELLO: each side offers what it supports and the session
/// uses the intersection. Unknown bits from a newer peer are kept on decode and simply never
/// match, which is what lets a new capability be added without breaking old peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct Capabilities(pub u64);

impl Capabilities {
    pub const NONE: Capabilities = Capabilities(0);
    /// The brick may push [`Invalidate`] events.
    pub const INVALIDATE_EVENTS: Capabilities = Capabilities(1 << 0);
    /// The client may take leases (LEASE) and send BATCH requests; the brick recalls leases
    /// with [`Recall`] events.
    pub const LEASES: Capabilities = Capabilities(1 << 1);
    /// The brick answers LOOKUP_XATTRS and READDIRP_XATTRS.
    pub const XATTR_PRESENCE: Capabilities = Capabilities(1 << 2);
    /// The brick answers GET.
    pub const GET: Capabilities = Capabilities(1 << 3);
    /// The brick answers OPENDIR_LIST.
    pub const OPENDIR_LIST: Capabilities = Capabilities(1 << 4);
    /// A lease on a directory also covers the attributes of what a listing under it
    /// returned: the brick recalls it before another session changes one of those objects.
    pub const LISTED_ATTRS: Capabilities = Capabilities(1 << 5);
    /// The client never reads a namespace reply's parent attributes (`pre_parent`,
    /// `post_parent`): the brick does not stat the parent for them and sends
    /// [`Iatt::omitted_dir`](crate::Iatt::omitted_dir) in their place.
    pub const NO_PARENT_ATTRS: Capabilities = Capabilities(1 << 6);
    /// Frames after HELLO go without their body checksum
    /// ([`BodyChecksum::Omitted`](crate::BodyChecksum::Omitted)): the transport
    /// authenticates every byte.
    pub const UNCHECKED_BODIES: Capabilities = Capabilities(1 << 7);
    /// The brick answers UNLINK_SETTLED.
    pub const UNLINK_SETTLED: Capabilities = Capabilities(1 << 8);
    /// The brick grants read leases on regular files (LEASE), recalled as a directory's
    /// are before another session changes the file.
    pub const FILE_LEASES: Capabilities = Capabilities(1 << 9);
    /// The brick answers PUT_SYNCED.
    pub const PUT_SYNCED: Capabilities = Capabilities(1 << 10);
    /// Everything this build implements.
    pub const SUPPORTED: Capabilities = Self::INVALIDATE_EVENTS
        .union(Self::LEASES)
        .union(Self::XATTR_PRESENCE)
        .union(Self::GET)
        .union(Self::OPENDIR_LIST)
        .union(Self::LISTED_ATTRS)
        .union(Self::NO_PARENT_ATTRS)
        .union(Self::UNCHECKED_BODIES)
        .union(Self::UNLINK_SETTLED)
        .union(Self::FILE_LEASES)
        .union(Self::PUT_SYNCED);
    /// What Kiln's client and brick offer at HELLO: everything this build implements but
    /// `INVALIDATE_EVENTS` (no brick sends INVALIDATE; leases recall with RECALL).
    pub const OFFERED: Capabilities = Self::SUPPORTED.without(Self::INVALIDATE_EVENTS);

    /// Whether a session with these capabilities sends and takes frame bodies without their
    /// checksum.
    pub fn body_checksum(self) -> BodyChecksum {
        match self.contains(Self::UNCHECKED_BODIES) {
            true => BodyChecksum::Omitted,
            false => BodyChecksum::Required,
        }
    }

    pub const fn union(self, other: Capabilities) -> Capabilities {
        Capabilities(self.0 | other.0)
    }

    pub const fn without(self, other: Capabilities) -> Capabilities {
        Capabilities(self.0 & !other.0)
    }

    pub fn intersection(self, other: Capabilities) -> Capabilities {
        Capabilities(self.0 & other.0)
    }

    pub fn contains(self, other: Capabilities) -> bool {
        self.0 & other.0 == other.0
    }
}

impl Encode for Capabilities {
    fn encode(&self, out: &mut Encoder) {
        out.put_u64(self.0);
    }
}

impl Decode for Capabilities {
    const ENCODED_LEN_MIN: usize = 8;

    fn decode(input: &mut Reader) -> Result<Self, DecodeError> {
        input.u64().map(Capabilities)
    }
}

wire_struct! {
    /// The first request on a connection: which protocol versions the client speaks.
    pub struct Hello {
        pub version_min: u8,
        pub version_max: u8,
        pub capabilities: Capabilities,
        /// The client's name, matched against `auth.allow` together with its certificate.
        pub client_name: Label,
    }

    /// The brick's answer: the version and capabilities in use, and the limits it enforces.
    pub struct HelloReply {
        pub version: u8,
        pub capabilities: Capabilities,
        pub brick_id: BrickId,
        pub volume: Label,
        pub limits: Limits,
    }

    /// The bounds a brick enforces for this session (at most the protocol's own limits).
    pub struct Limits {
        pub frame_body_len_max_bytes: u32,
        pub io_size_max_bytes: u32,
        pub readdir_reply_len_max_bytes: u32,
        pub inflight_max: u32,
    }

    /// A liveness probe; the reply echoes the nonce.
    pub struct Ping { pub nonce: u64 }

    /// Pushed by the brick: cached attributes of `gfid` (and, with a name, that entry of the
    /// directory `gfid`) are stale.
    pub struct Invalidate { pub gfid: Gfid, pub name: Option<Name> }

    /// Pushed by the brick: give back the lease on `gfid`, keeping at most `kind`. The holder
    /// sends what it has pending for the directory, then LEASE with `kind` (or less).
    pub struct Recall { pub gfid: Gfid, pub kind: LeaseKind }
}

impl Limits {
    /// The protocol's own limits; a brick may advertise less.
    pub fn protocol() -> Limits {
        let as_u32 = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        Limits {
            frame_body_len_max_bytes: as_u32(FRAME_BODY_LEN_MAX_BYTES),
            io_size_max_bytes: as_u32(IO_SIZE_MAX_BYTES),
            readdir_reply_len_max_bytes: as_u32(READDIR_REPLY_LEN_MAX_BYTES),
            inflight_max: as_u32(INFLIGHT_MAX),
        }
    }
}

impl Hello {
    /// The version a server that speaks only [`PROTOCOL_VERSION`] uses with this client, or
    /// `ProtoNotSupported` when their ranges do not meet.
    pub fn negotiate(&self) -> Result<u8, ErrorCode> {
        match (self.version_min..=self.version_max).contains(&PROTOCOL_VERSION) {
            true => Ok(PROTOCOL_VERSION),
            false => Err(ErrorCode::ProtoNotSupported),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_negotiation() {
        let hello = |min, max| Hello {
            version_min: min,
            version_max: max,
            capabilities: Capabilities::NONE,
            client_name: Label::new(&b"c"[..]).expect("valid label"),
        };
        assert_eq!(hello(1, 1).negotiate(), Ok(1));
        assert_eq!(hello(1, 9).negotiate(), Ok(1));
        assert_eq!(hello(2, 3).negotiate(), Err(ErrorCode::ProtoNotSupported));
        assert_eq!(hello(3, 2).negotiate(), Err(ErrorCode::ProtoNotSupported));
    }

    #[test]
    fn capabilities_intersect() {
        let theirs = Capabilities(Capabilities::INVALIDATE_EVENTS.0 | 1 << 40);
        assert_eq!(
            theirs.intersection(Capabilities::SUPPORTED),
            Capabilities::INVALIDATE_EVENTS
        );
        assert!(Capabilities::SUPPORTED.contains(Capabilities::LEASES));
    }

    #[test]
    fn kiln_offers_all_it_implements_but_invalidate_events() {
        let offered = Capabilities::OFFERED;
        assert!(!offered.contains(Capabilities::INVALIDATE_EVENTS));
        assert_eq!(
            offered.union(Capabilities::INVALIDATE_EVENTS),
            Capabilities::SUPPORTED
        );
        assert_eq!(offered.body_checksum(), BodyChecksum::Omitted);
        assert_eq!(Capabilities::NONE.body_checksum(), BodyChecksum::Required);
    }
}
