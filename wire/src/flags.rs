//! Small argument types: open flags, access masks, rename and xattr flags, POSIX locks and
//! the caller's credentials. Wire bits are Kiln's own (stable across architectures) and are
//! mapped to the host's `libc` values at the edge.

use crate::codec::{
    Decode, DecodeError, Encode, Encoder, Reader, decode_list, encode_list, wire_enum, wire_struct,
};
use crate::limits::GROUPS_MAX;

/// Defines a `u32` bit set that refuses unknown bits on decode.
macro_rules! wire_bits {
    ($(#[$meta:meta])* pub struct $name:ident { $( $(#[$cmeta:meta])* const $flag:ident = $value:expr; )* }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
        pub struct $name(u32);

        impl $name {
            $( $(#[$cmeta])* pub const $flag: $name = $name($value); )*
            const KNOWN: u32 = 0 $( | $value )*;

            pub const fn empty() -> Self {
                $name(0)
            }

            /// `None` when `bits` holds a bit this protocol version does not know.
            pub const fn from_bits(bits: u32) -> Option<Self> {
                if bits & !Self::KNOWN == 0 { Some($name(bits)) } else { None }
            }

            pub const fn bits(self) -> u32 {
                self.0
            }

            pub const fn contains(self, other: Self) -> bool {
                self.0 & other.0 == other.0
            }
        }

        impl std::ops::BitOr for $name {
            type Output = Self;
            fn bitor(self, rhs: Self) -> Self {
                $name(self.0 | rhs.0)
            }
        }

        impl Encode for $name {
            fn encode(&self, out: &mut Encoder) {
                out.put_u32(self.0);
            }
        }

        impl Decode for $name {
            const ENCODED_LEN_MIN: usize = 4;
            fn decode(input: &mut Reader) -> Result<Self, DecodeError> {
                Self::from_bits(input.u32()?)
                    .ok_or(DecodeError::invalid(stringify!($name), "unknown bits"))
            }
        }

        #[cfg(test)]
        impl proptest::arbitrary::Arbitrary for $name {
            type Parameters = ();
            type Strategy = proptest::strategy::BoxedStrategy<Self>;
            fn arbitrary_with((): ()) -> Self::Strategy {
                use proptest::strategy::Strategy;
                (0..=Self::KNOWN).prop_map(|b| $name(b & Self::KNOWN)).boxed()
            }
        }
    };
}

wire_enum! {
    /// How an open file may be accessed.
    pub enum AccessMode {
        ReadOnly = 0,
        WriteOnly = 1,
        ReadWrite = 2,
    }
}

wire_bits! {
    /// Flags of OPEN and CREATE beyond the access mode.
    pub struct OpenFlags {
        const APPEND = 1 << 0;
        const TRUNC = 1 << 1;
        /// Only meaningful for CREATE: fail with EEXIST when the name exists.
        const EXCL = 1 << 2;
        const SYNC = 1 << 3;
        const DSYNC = 1 << 4;
        const DIRECT = 1 << 5;
        const NOATIME = 1 << 6;
        const NOFOLLOW = 1 << 7;
    }
}

impl OpenFlags {
    /// The host's `open(2)` flags for these bits (the access mode is added separately).
    pub fn to_libc(self) -> i32 {
        let table = [
            (Self::APPEND, libc::O_APPEND),
            (Self::TRUNC, libc::O_TRUNC),
            (Self::EXCL, libc::O_EXCL),
            (Self::SYNC, libc::O_SYNC),
            (Self::DSYNC, libc::O_DSYNC),
            (Self::DIRECT, libc::O_DIRECT),
            (Self::NOATIME, libc::O_NOATIME),
            (Self::NOFOLLOW, libc::O_NOFOLLOW),
        ];
        table
            .iter()
            .filter(|(f, _)| self.contains(*f))
            .fold(0, |acc, (_, l)| acc | l)
    }
}

wire_bits! {
    /// Which of the extended attributes that programs probe on every file they list or copy
    /// (`ls -l`, `cp -a`, `tar`) an object has, as LOOKUP_XATTRS and READDIRP_XATTRS answer
    /// it: a set bit means present, or not known (a client asks); a clear bit means absent
    /// when the reply was made.
    pub struct XattrPresence {
        const SELINUX = 1 << 0;
        const CAPABILITY = 1 << 1;
        const ACL_ACCESS = 1 << 2;
        const ACL_DEFAULT = 1 << 3;
    }
}

impl XattrPresence {
    /// Each probed name with its bit.
    pub const PROBED: [(&'static [u8], XattrPresence); 4] = [
        (b"security.selinux", Self::SELINUX),
        (b"security.capability", Self::CAPABILITY),
        (b"system.posix_acl_access", Self::ACL_ACCESS),
        (b"system.posix_acl_default", Self::ACL_DEFAULT),
    ];

    /// Nothing known to be absent: what a brick answers when it could not list the names.
    pub const UNKNOWN: XattrPresence = XattrPresence(Self::KNOWN);

    /// The presence of the probed names among `names`.
    pub fn of_names<'a>(names: impl IntoIterator<Item = &'a [u8]>) -> XattrPresence {
        names.into_iter().fold(Self::empty(), |set, name| {
            match Self::PROBED.iter().find(|(probed, _)| *probed == name) {
                Some((_, bit)) => set | *bit,
                None => set,
            }
        })
    }

    /// The presence of the probed names in a `listxattr(2)` list (names ended by NUL).
    pub fn of_list(list: &[u8]) -> XattrPresence {
        Self::of_names(list.split(|&b| b == 0))
    }

    /// Whether `name` is one of the probed names.
    pub fn is_probed(name: &[u8]) -> bool {
        Self::PROBED.iter().any(|(probed, _)| *probed == name)
    }

    /// The probed names this set says are absent.
    pub fn absent(self) -> impl Iterator<Item = &'static [u8]> {
        Self::PROBED
            .into_iter()
            .filter(move |(_, bit)| !self.contains(*bit))
            .map(|(name, _)| name)
    }
}

impl AccessMode {
    pub fn to_libc(self) -> i32 {
        match self {
            AccessMode::ReadOnly => libc::O_RDONLY,
            AccessMode::WriteOnly => libc::O_WRONLY,
            AccessMode::ReadWrite => libc::O_RDWR,
        }
    }
}

wire_bits! {
    /// What ACCESS checks; empty means existence only (`F_OK`).
    pub struct AccessMask {
        const EXECUTE = 1;
        const WRITE = 2;
        const READ = 4;
    }
}

wire_enum! {
    /// How RENAME treats an existing target.
    pub enum RenameMode {
        /// Replace the target (plain `rename(2)`).
        Replace = 0,
        /// Fail with EEXIST when the target exists (`RENAME_NOREPLACE`).
        NoReplace = 1,
        /// Swap source and target atomically (`RENAME_EXCHANGE`).
        Exchange = 2,
    }
}

wire_enum! {
    /// How SETXATTR treats an existing attribute.
    pub enum XattrSetMode {
        /// Create or replace.
        Upsert = 0,
        /// Fail with EEXIST when it exists (`XATTR_CREATE`).
        Create = 1,
        /// Fail with ENODATA when it does not (`XATTR_REPLACE`).
        Replace = 2,
    }
}

wire_enum! {
    /// What SEEK looks for from the given offset.
    pub enum SeekWhat {
        Data = 3,
        Hole = 4,
    }
}

wire_enum! {
    /// A POSIX record lock's type.
    pub enum LockKind {
        Read = 0,
        Write = 1,
        Unlock = 2,
    }

    /// What LK does: test (`F_GETLK`), set (`F_SETLK`) or set and wait (`F_SETLKW`).
    pub enum LockCmd {
        Get = 0,
        Set = 1,
        SetWait = 2,
    }
}

wire_struct! {
    /// A POSIX record lock on a byte range; `len == 0` means "to the end of the file".
    pub struct Lock {
        pub kind: LockKind,
        pub start: u64,
        pub len: u64,
        pub pid: u32,
        /// Identifies the lock holder across fds (FUSE's lock owner).
        pub owner: u64,
    }
}

/// The id that means "no id" to the kernel (`(uid_t)-1`): `setresuid(-1, …)` leaves an id
/// unchanged, so a caller claiming it would keep the brick's own. Refused at decode.
pub const NO_ID: u32 = u32::MAX;

/// Who is asking: every fop carries the caller's ids so the brick checks permissions as the
/// kernel would for that caller. Decoding refuses [`NO_ID`] for the uid, gid and any group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Creds {
    pub uid: u32,
    pub gid: u32,
    pub groups: Groups,
    pub pid: u32,
}

impl Encode for Creds {
    fn encode(&self, out: &mut Encoder) {
        self.uid.encode(out);
        self.gid.encode(out);
        self.groups.encode(out);
        self.pid.encode(out);
    }
}

impl Decode for Creds {
    const ENCODED_LEN_MIN: usize = 4 + 4 + Groups::ENCODED_LEN_MIN + 4;

    fn decode(input: &mut Reader) -> Result<Self, DecodeError> {
        let creds = Creds {
            uid: u32::decode(input)?,
            gid: u32::decode(input)?,
            groups: Groups::decode(input)?,
            pid: u32::decode(input)?,
        };
        let ids = [creds.uid, creds.gid];
        if ids
            .iter()
            .chain(creds.groups.as_slice())
            .any(|&id| id == NO_ID)
        {
            return Err(DecodeError::invalid("creds", "an id of -1 names no user"));
        }
        Ok(creds)
    }
}

#[cfg(test)]
impl proptest::arbitrary::Arbitrary for Creds {
    type Parameters = ();
    type Strategy = proptest::strategy::BoxedStrategy<Self>;
    fn arbitrary_with((): ()) -> Self::Strategy {
        use proptest::strategy::Strategy;
        let id = 0..NO_ID;
        let groups = proptest::collection::vec(0..NO_ID, 0..=GROUPS_MAX)
            .prop_map(|g| Groups::new(g).unwrap_or_default());
        (id.clone(), id, groups, proptest::arbitrary::any::<u32>())
            .prop_map(|(uid, gid, groups, pid)| Creds {
                uid,
                gid,
                groups,
                pid,
            })
            .boxed()
    }
}

impl Creds {
    /// The superuser, for tools that act as root.
    pub fn root() -> Creds {
        Creds {
            uid: 0,
            gid: 0,
            groups: Groups::default(),
            pid: 0,
        }
    }
}

/// Supplementary group ids, at most [`GROUPS_MAX`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Groups(Vec<u32>);

impl Groups {
    pub fn new(groups: Vec<u32>) -> Option<Groups> {
        (groups.len() <= GROUPS_MAX).then_some(Groups(groups))
    }

    pub fn as_slice(&self) -> &[u32] {
        &self.0
    }
}

impl Encode for Groups {
    fn encode(&self, out: &mut Encoder) {
        encode_list(&self.0, out);
    }
}

impl Decode for Groups {
    const ENCODED_LEN_MIN: usize = 4;

    fn decode(input: &mut Reader) -> Result<Self, DecodeError> {
        decode_list(input, "groups", GROUPS_MAX).map(Groups)
    }
}

#[cfg(test)]
impl proptest::arbitrary::Arbitrary for Groups {
    type Parameters = ();
    type Strategy = proptest::strategy::BoxedStrategy<Self>;
    fn arbitrary_with((): ()) -> Self::Strategy {
        use proptest::strategy::Strategy;
        proptest::collection::vec(proptest::arbitrary::any::<u32>(), 0..=GROUPS_MAX)
            .prop_map(Groups)
            .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_bits_are_refused() {
        assert_eq!(OpenFlags::from_bits(1 << 31), None);
        assert_eq!(AccessMask::from_bits(8), None);
        assert_eq!(
            AccessMask::from_bits(7),
            Some(AccessMask::READ | AccessMask::WRITE | AccessMask::EXECUTE)
        );
    }

    #[test]
    fn xattr_presence_reads_a_listxattr_list() {
        let list = b"user.a\0system.posix_acl_access\0security.selinuxx\0trusted.gfid\0";
        let presence = XattrPresence::of_list(list);
        assert_eq!(presence, XattrPresence::ACL_ACCESS);
        let absent: Vec<_> = presence.absent().collect();
        assert_eq!(
            absent,
            [
                &b"security.selinux"[..],
                b"security.capability",
                b"system.posix_acl_default"
            ]
        );
        assert_eq!(XattrPresence::UNKNOWN.absent().count(), 0);
        assert!(XattrPresence::is_probed(b"security.capability"));
        assert!(!XattrPresence::is_probed(b"user.a"));
        assert_eq!(XattrPresence::of_list(b"").absent().count(), 4);
    }

    #[test]
    fn open_flags_map_to_libc() {
        let f = OpenFlags::APPEND | OpenFlags::TRUNC;
        assert_eq!(f.to_libc(), libc::O_APPEND | libc::O_TRUNC);
        assert_eq!(AccessMode::ReadWrite.to_libc(), libc::O_RDWR);
        assert!(Groups::new(vec![0; GROUPS_MAX + 1]).is_none());
    }
}
