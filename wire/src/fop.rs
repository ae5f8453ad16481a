//! Every v1 fop: its stable code, its request and its reply.
//!
//! Codes are GlusterFS's `glusterfs_fop_t` numbers (`libglusterfs/src/glusterfs/glusterfs-fops.h`)
//! so captures and profiles read the same in both systems; fops GlusterFS does not have get
//! numbers from 100 up. A code is never renumbered or reused, and an existing message never
//! changes shape: a new shape is a new fop behind a capability.
//!
//! Entry fops address the parent directory by GFID plus a [`Name`]; inode fops address the
//! object by GFID; fd fops use the [`FdId`] an OPEN/OPENDIR/CREATE returned. Replies carry
//! pre/post attributes where GlusterFS's do, so a client can keep its caches exact.

use crate::attr::{DirEntry, DirEntryPlus, DirEntryXattrs, FileType, FsStats, Iatt, Mode, SetAttr};
use crate::codec::{
    Decode, DecodeError, Encode, Encoder, Reader, decode_list, encode_list, wire_enum, wire_struct,
};
use crate::flags::{
    AccessMask, AccessMode, Lock, LockCmd, OpenFlags, RenameMode, SeekWhat, XattrPresence,
    XattrSetMode,
};
use crate::ids::{FdId, Gfid};
use crate::limits::{IO_SIZE_MAX_BYTES, READDIR_REPLY_LEN_MAX_BYTES, XATTR_LIST_ENTRIES_MAX};
use crate::names::{Name, Payload, SymlinkTarget, XattrName, XattrValue};

/// A `u32` that is at most `MAX`, e.g. a READ size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BoundedU32<const MAX: u32>(u32);

impl<const MAX: u32> BoundedU32<MAX> {
    pub const MAX: u32 = MAX;

    pub fn new(v: u32) -> Option<Self> {
        (v <= MAX).then_some(Self(v))
    }

    /// `v`, lowered to the bound when above it.
    pub fn saturating(v: u64) -> Self {
        Self(u32::try_from(v.min(u64::from(MAX))).unwrap_or(MAX))
    }

    pub fn get(self) -> u32 {
        self.0
    }
}

impl<const MAX: u32> Encode for BoundedU32<MAX> {
    fn encode(&self, out: &mut Encoder) {
        out.put_u32(self.0);
    }
}

impl<const MAX: u32> Decode for BoundedU32<MAX> {
    const ENCODED_LEN_MIN: usize = 4;

    fn decode(input: &mut Reader) -> Result<Self, DecodeError> {
        let v = input.u32()?;
        Self::new(v).ok_or(DecodeError::TooLong {
            what: "size",
            len: v as usize,
            max: MAX as usize,
        })
    }
}

/// Bytes one READ may return.
pub type ReadSize = BoundedU32<{ IO_SIZE_MAX_BYTES as u32 }>;
/// Bytes of entries one READDIR/READDIRP reply may hold.
pub type ReaddirSize = BoundedU32<{ READDIR_REPLY_LEN_MAX_BYTES as u32 }>;

wire_enum! {
    /// What MKNOD may create: anything but directories and symlinks, which have their own fops.
    pub enum NodeType {
        Regular = 1,
        BlockDevice = 4,
        CharDevice = 5,
        Fifo = 6,
        Socket = 7,
    }
}

impl From<NodeType> for FileType {
    fn from(t: NodeType) -> FileType {
        match t {
            NodeType::Regular => FileType::Regular,
            NodeType::BlockDevice => FileType::BlockDevice,
            NodeType::CharDevice => FileType::CharDevice,
            NodeType::Fifo => FileType::Fifo,
            NodeType::Socket => FileType::Socket,
        }
    }
}

wire_enum! {
    /// A lease on a directory (`docs/wire.md`, "Leases"): what its holder may do without
    /// asking the brick, until the brick recalls it.
    pub enum LeaseKind {
        /// No lease (asked: give back the one held).
        None = 0,
        /// The holder may cache the directory's entries and their attributes; shared.
        Read = 1,
        /// Also: the holder may change the directory's entries and send the changes later;
        /// exclusive.
        Write = 2,
    }
}

wire_struct! {
    // ---- requests ----

    /// Resolves `name` in `parent`.
    pub struct Lookup { pub parent: Gfid, pub name: Name }
    pub struct Stat { pub gfid: Gfid }
    pub struct Fstat { pub fd: FdId }
    pub struct Access { pub gfid: Gfid, pub mask: AccessMask }
    pub struct Readlink { pub gfid: Gfid }
    pub struct Mknod {
        pub parent: Gfid,
        pub name: Name,
        /// Chosen by the client; a retry with the same GFID is idempotent.
        pub gfid: Gfid,
        pub node_type: NodeType,
        pub mode: Mode,
        pub umask: Mode,
        pub rdev: u64,
    }
    pub struct Mkdir { pub parent: Gfid, pub name: Name, pub gfid: Gfid, pub mode: Mode, pub umask: Mode }
    pub struct Unlink { pub parent: Gfid, pub name: Name }
    /// UNLINK of a name whose object is not a regular file with the sticky bit set (a
    /// distribution link file, or a file being moved between bricks): such a name is left as
    /// it is and answered EXDEV (capability `UNLINK_SETTLED`).
    pub struct UnlinkSettled { pub parent: Gfid, pub name: Name }
    pub struct Rmdir { pub parent: Gfid, pub name: Name }
    pub struct Symlink { pub parent: Gfid, pub name: Name, pub gfid: Gfid, pub target: SymlinkTarget }
    pub struct Rename {
        pub old_parent: Gfid,
        pub old_name: Name,
        pub new_parent: Gfid,
        pub new_name: Name,
        pub mode: RenameMode,
    }
    /// Adds the name `new_name` in `new_parent` for the existing object `gfid`.
    pub struct Link { pub gfid: Gfid, pub new_parent: Gfid, pub new_name: Name }
    pub struct Create {
        pub parent: Gfid,
        pub name: Name,
        pub gfid: Gfid,
        pub access: AccessMode,
        pub flags: OpenFlags,
        pub mode: Mode,
        pub umask: Mode,
    }
    pub struct Open { pub gfid: Gfid, pub access: AccessMode, pub flags: OpenFlags }
    pub struct Read { pub fd: FdId, pub offset: u64, pub size: ReadSize }
    pub struct Write { pub fd: FdId, pub offset: u64, pub data: Payload }
    /// A close of one of the caller's fds: POSIX drops the locks `lock_owner` holds on the
    /// file (FUSE's FLUSH carries the owner).
    pub struct Flush { pub fd: FdId, pub lock_owner: u64 }
    pub struct Fsync { pub fd: FdId, pub datasync: bool }
    pub struct Release { pub fd: FdId }
    pub struct Opendir { pub gfid: Gfid }
    /// Continues after the entry whose `offset` cookie is given (0 = from the start).
    pub struct Readdir { pub fd: FdId, pub offset: u64, pub size: ReaddirSize }
    pub struct Readdirp { pub fd: FdId, pub offset: u64, pub size: ReaddirSize }
    pub struct Releasedir { pub fd: FdId }
    pub struct Fsyncdir { pub fd: FdId, pub datasync: bool }
    pub struct Statfs { pub gfid: Gfid }
    pub struct Setxattr { pub gfid: Gfid, pub name: XattrName, pub value: XattrValue, pub mode: XattrSetMode }
    pub struct Getxattr { pub gfid: Gfid, pub name: XattrName }
    pub struct Listxattr { pub gfid: Gfid }
    pub struct Removexattr { pub gfid: Gfid, pub name: XattrName }
    pub struct Fsetxattr { pub fd: FdId, pub name: XattrName, pub value: XattrValue, pub mode: XattrSetMode }
    pub struct Fgetxattr { pub fd: FdId, pub name: XattrName }
    pub struct Fremovexattr { pub fd: FdId, pub name: XattrName }
    pub struct Setattr { pub gfid: Gfid, pub attr: SetAttr }
    pub struct Fsetattr { pub fd: FdId, pub attr: SetAttr }
    pub struct Truncate { pub gfid: Gfid, pub size: u64 }
    pub struct Ftruncate { pub fd: FdId, pub size: u64 }
    /// Allocates `[offset, offset + len)`; `keep_size` leaves the file size alone.
    pub struct Fallocate { pub fd: FdId, pub keep_size: bool, pub offset: u64, pub len: u64 }
    /// Punches a hole (the file size is kept).
    pub struct Discard { pub fd: FdId, pub offset: u64, pub len: u64 }
    pub struct Zerofill { pub fd: FdId, pub offset: u64, pub len: u64 }
    pub struct Seek { pub fd: FdId, pub offset: u64, pub what: SeekWhat }
    pub struct Lk { pub fd: FdId, pub cmd: LockCmd, pub lock: Lock }
    /// The small-file fast path: create `name` with `data` and `attr` applied, and close it,
    /// in one request. Fails with EEXIST like CREATE with `EXCL` unless the same GFID is
    /// already there (a retry).
    pub struct Put {
        pub parent: Gfid,
        pub name: Name,
        pub gfid: Gfid,
        pub mode: Mode,
        pub umask: Mode,
        pub flags: OpenFlags,
        pub data: Payload,
        pub attr: SetAttr,
    }
    /// PUT answered once the new file is also fsynced, as FSYNC of an fd of it would be (a
    /// retry's too): a file written and synced before its close in one round trip
    /// (capability `PUT_SYNCED`).
    pub struct PutSynced { pub put: Put }

    /// Asks for a lease of `kind` on directory `gfid`, or gives back the one held (`None`).
    /// The brick never recalls another session's lease to grant one.
    pub struct Lease { pub gfid: Gfid, pub kind: LeaseKind }
    /// LOOKUP answered with the presence of the probed xattrs (capability `XATTR_PRESENCE`).
    pub struct LookupXattrs { pub parent: Gfid, pub name: Name }
    /// READDIRP whose entries carry the presence of the probed xattrs (capability
    /// `XATTR_PRESENCE`).
    pub struct ReaddirpXattrs { pub fd: FdId, pub offset: u64, pub size: ReaddirSize }
    /// Reads `size` bytes at `offset` of regular file `gfid` with no fd: OPEN, READ and
    /// RELEASE in one round trip (GlusterFS's quick-read), checked as an OPEN for reading
    /// would be (capability `GET`).
    pub struct Get { pub gfid: Gfid, pub offset: u64, pub size: ReadSize }
    /// OPENDIR that answers with the directory's first `size` bytes of entries, as
    /// READDIRP_XATTRS from the start would, and takes lease `lease` on it before it reads
    /// them (none: no lease asked) — one round trip for three fops (capability
    /// `OPENDIR_LIST`).
    pub struct OpendirList { pub gfid: Gfid, pub size: ReaddirSize, pub lease: LeaseKind }

    // ---- replies ----

    /// A reply with no fields (FLUSH, RELEASE, SETXATTR, …).
    pub struct Done {}
    pub struct LookupReply { pub iatt: Iatt, pub parent: Iatt }
    pub struct AttrReply { pub iatt: Iatt }
    pub struct ReadlinkReply { pub target: SymlinkTarget, pub iatt: Iatt }
    /// A new entry (MKNOD, MKDIR, SYMLINK, LINK, PUT): the object and its parent before/after.
    pub struct EntryReply { pub iatt: Iatt, pub pre_parent: Iatt, pub post_parent: Iatt }
    /// A removed entry (UNLINK, RMDIR): the parent before and after.
    pub struct RemoveReply { pub pre_parent: Iatt, pub post_parent: Iatt }
    pub struct RenameReply {
        pub iatt: Iatt,
        pub pre_old_parent: Iatt,
        pub post_old_parent: Iatt,
        pub pre_new_parent: Iatt,
        pub post_new_parent: Iatt,
    }
    pub struct CreateReply { pub fd: FdId, pub iatt: Iatt, pub pre_parent: Iatt, pub post_parent: Iatt }
    pub struct OpenReply { pub fd: FdId }
    /// READ: fewer bytes than asked means end of file.
    pub struct ReadReply { pub data: Payload, pub iatt: Iatt }
    /// The object before and after a change of data or attributes.
    pub struct AttrChange { pub pre: Iatt, pub post: Iatt }
    pub struct StatfsReply { pub stats: FsStats }
    pub struct XattrReply { pub value: XattrValue }
    pub struct SeekReply { pub offset: u64 }
    /// LK: for `Get`, the conflicting lock or one of kind `Unlock` when there is none.
    pub struct LkReply { pub lock: Lock }
    /// The lease now held: what was asked, or less (`None` when another session's lease is in
    /// the way).
    pub struct LeaseReply { pub kind: LeaseKind }
    pub struct LookupXattrsReply { pub iatt: Iatt, pub parent: Iatt, pub xattrs: XattrPresence }
    /// The new fd, the lease now held (as LEASE answers it), and the first entries.
    pub struct OpendirListReply { pub fd: FdId, pub lease: LeaseKind, pub listing: ReaddirpXattrsReply }
}

/// Defines a reply that is a bounded list of entries plus an end-of-directory flag.
macro_rules! list_reply {
    ($(#[$meta:meta])* $name:ident, $item:ty, $what:literal, $max:expr) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq)]
        #[cfg_attr(test, derive(proptest_derive::Arbitrary))]
        pub struct $name {
            pub entries: Vec<$item>,
            /// No entries follow the last one returned.
            pub eof: bool,
        }

        impl Encode for $name {
            fn encode(&self, out: &mut Encoder) {
                encode_list(&self.entries, out);
                self.eof.encode(out);
            }
        }

        impl Decode for $name {
            fn decode(input: &mut Reader) -> Result<Self, DecodeError> {
                let entries = decode_list(input, $what, $max)?;
                Ok(Self { entries, eof: bool::decode(input)? })
            }
        }
    };
}

list_reply!(
    ReaddirReply,
    DirEntry,
    "readdir entries",
    READDIR_REPLY_LEN_MAX_BYTES
);
list_reply!(
    ReaddirpReply,
    DirEntryPlus,
    "readdirp entries",
    READDIR_REPLY_LEN_MAX_BYTES
);
list_reply!(
    ReaddirpXattrsReply,
    DirEntryXattrs,
    "readdirp entries",
    READDIR_REPLY_LEN_MAX_BYTES
);
list_reply!(
    ListxattrReply,
    XattrName,
    "xattr names",
    XATTR_LIST_ENTRIES_MAX
);

/// A LOOKUP reply as LOOKUP_XATTRS's, for a brick without `XATTR_PRESENCE`: nothing is known
/// absent.
impl From<LookupReply> for LookupXattrsReply {
    fn from(r: LookupReply) -> LookupXattrsReply {
        LookupXattrsReply {
            iatt: r.iatt,
            parent: r.parent,
            xattrs: XattrPresence::UNKNOWN,
        }
    }
}

/// A READDIRP reply as READDIRP_XATTRS's, for a brick without `XATTR_PRESENCE`: nothing is
/// known absent.
impl From<ReaddirpReply> for ReaddirpXattrsReply {
    fn from(r: ReaddirpReply) -> ReaddirpXattrsReply {
        let entries = r.entries.into_iter().map(|e| DirEntryXattrs {
            offset: e.offset,
            name: e.name,
            iatt: e.iatt,
            xattrs: XattrPresence::UNKNOWN,
        });
        ReaddirpXattrsReply {
            entries: entries.collect(),
            eof: r.eof,
        }
    }
}

/// Defines the fop table: the code enum and the request and reply enums dispatching on it.
macro_rules! fops {
    ($( $code:literal $name:literal $variant:ident($req:ident) -> $rep:ident; )*) => {
        /// A fop's stable number.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[cfg_attr(test, derive(proptest_derive::Arbitrary))]
        #[repr(u16)]
        pub enum FopCode {
            $( $variant = $code, )*
        }

        impl FopCode {
            /// Every fop, in table order.
            pub const ALL: &[FopCode] = &[$( FopCode::$variant, )*];

            pub fn from_u16(code: u16) -> Option<FopCode> {
                match code {
                    $( $code => Some(FopCode::$variant), )*
                    _ => None,
                }
            }

            /// This fop's position in [`FopCode::ALL`], for tables indexed by fop.
            pub fn index(self) -> usize {
                // Built at compile time; a code of 256 or more fails the build here.
                const BY_CODE: [u8; 256] = {
                    let mut table = [u8::MAX; 256];
                    let mut i = 0;
                    while i < FopCode::ALL.len() {
                        table[FopCode::ALL[i] as usize] = i as u8;
                        i += 1;
                    }
                    table
                };
                BY_CODE[self as usize] as usize
            }

            /// The GlusterFS-style upper-case name, e.g. `"LOOKUP"`.
            pub fn name(self) -> &'static str {
                match self {
                    $( FopCode::$variant => $name, )*
                }
            }
        }

        /// The arguments of one fop.
        #[derive(Debug, Clone, PartialEq, Eq)]
        #[cfg_attr(test, derive(proptest_derive::Arbitrary))]
        pub enum FopRequest {
            $( $variant($req), )*
        }

        /// The successful result of one fop.
        #[allow(clippy::large_enum_variant, reason = "a reply is built once and encoded; boxing would allocate per reply")]
        #[derive(Debug, Clone, PartialEq, Eq)]
        #[cfg_attr(test, derive(proptest_derive::Arbitrary))]
        pub enum FopReply {
            $( $variant($rep), )*
        }

        impl FopRequest {
            pub fn code(&self) -> FopCode {
                match self {
                    $( FopRequest::$variant(_) => FopCode::$variant, )*
                }
            }

            pub(crate) fn encode_body(&self, out: &mut Encoder) {
                match self {
                    $( FopRequest::$variant(r) => r.encode(out), )*
                }
            }

            pub(crate) fn decode_body(code: FopCode, input: &mut Reader) -> Result<Self, DecodeError> {
                Ok(match code {
                    $( FopCode::$variant => FopRequest::$variant($req::decode(input)?), )*
                })
            }
        }

        impl FopReply {
            pub fn code(&self) -> FopCode {
                match self {
                    $( FopReply::$variant(_) => FopCode::$variant, )*
                }
            }

            pub(crate) fn encode_body(&self, out: &mut Encoder) {
                match self {
                    $( FopReply::$variant(r) => r.encode(out), )*
                }
            }

            pub(crate) fn decode_body(code: FopCode, input: &mut Reader) -> Result<Self, DecodeError> {
                Ok(match code {
                    $( FopCode::$variant => FopReply::$variant($rep::decode(input)?), )*
                })
            }
        }

        $(
            impl From<$req> for FopRequest {
                fn from(r: $req) -> FopRequest {
                    FopRequest::$variant(r)
                }
            }
        )*
    };
}

fops! {
    27 "LOOKUP" Lookup(Lookup) -> LookupReply;
    1 "STAT" Stat(Stat) -> AttrReply;
    25 "FSTAT" Fstat(Fstat) -> AttrReply;
    22 "ACCESS" Access(Access) -> Done;
    2 "READLINK" Readlink(Readlink) -> ReadlinkReply;
    3 "MKNOD" Mknod(Mknod) -> EntryReply;
    4 "MKDIR" Mkdir(Mkdir) -> EntryReply;
    5 "UNLINK" Unlink(Unlink) -> RemoveReply;
    6 "RMDIR" Rmdir(Rmdir) -> RemoveReply;
    7 "SYMLINK" Symlink(Symlink) -> EntryReply;
    8 "RENAME" Rename(Rename) -> RenameReply;
    9 "LINK" Link(Link) -> EntryReply;
    23 "CREATE" Create(Create) -> CreateReply;
    11 "OPEN" Open(Open) -> OpenReply;
    12 "READ" Read(Read) -> ReadReply;
    13 "WRITE" Write(Write) -> AttrChange;
    15 "FLUSH" Flush(Flush) -> Done;
    16 "FSYNC" Fsync(Fsync) -> AttrChange;
    42 "RELEASE" Release(Release) -> Done;
    20 "OPENDIR" Opendir(Opendir) -> OpenReply;
    28 "READDIR" Readdir(Readdir) -> ReaddirReply;
    40 "READDIRP" Readdirp(Readdirp) -> ReaddirpReply;
    43 "RELEASEDIR" Releasedir(Releasedir) -> Done;
    21 "FSYNCDIR" Fsyncdir(Fsyncdir) -> Done;
    14 "STATFS" Statfs(Statfs) -> StatfsReply;
    17 "SETXATTR" Setxattr(Setxattr) -> Done;
    18 "GETXATTR" Getxattr(Getxattr) -> XattrReply;
    100 "LISTXATTR" Listxattr(Listxattr) -> ListxattrReply;
    19 "REMOVEXATTR" Removexattr(Removexattr) -> Done;
    36 "FSETXATTR" Fsetxattr(Fsetxattr) -> Done;
    35 "FGETXATTR" Fgetxattr(Fgetxattr) -> XattrReply;
    45 "FREMOVEXATTR" Fremovexattr(Fremovexattr) -> Done;
    38 "SETATTR" Setattr(Setattr) -> AttrChange;
    39 "FSETATTR" Fsetattr(Fsetattr) -> AttrChange;
    10 "TRUNCATE" Truncate(Truncate) -> AttrChange;
    24 "FTRUNCATE" Ftruncate(Ftruncate) -> AttrChange;
    46 "FALLOCATE" Fallocate(Fallocate) -> AttrChange;
    47 "DISCARD" Discard(Discard) -> AttrChange;
    48 "ZEROFILL" Zerofill(Zerofill) -> AttrChange;
    50 "SEEK" Seek(Seek) -> SeekReply;
    26 "LK" Lk(Lk) -> LkReply;
    55 "PUT" Put(Put) -> EntryReply;
    101 "LEASE" Lease(Lease) -> LeaseReply;
    102 "LOOKUP_XATTRS" LookupXattrs(LookupXattrs) -> LookupXattrsReply;
    103 "READDIRP_XATTRS" ReaddirpXattrs(ReaddirpXattrs) -> ReaddirpXattrsReply;
    104 "GET" Get(Get) -> ReadReply;
    105 "OPENDIR_LIST" OpendirList(OpendirList) -> OpendirListReply;
    106 "UNLINK_SETTLED" UnlinkSettled(UnlinkSettled) -> RemoveReply;
    107 "PUT_SYNCED" PutSynced(PutSynced) -> EntryReply;
}

/// Matches the fops on an open file or directory (each names it in its `fd` field), binding
/// that field as `$fd`; every other fop gives `$none`. One list, so [`FopRequest::fd`] and
/// [`FopRequest::set_fd`] cannot disagree.
macro_rules! match_fd {
    ($fop:expr, $fd:ident => $some:expr, _ => $none:expr) => {
        match $fop {
            FopRequest::Fstat(Fstat { fd: $fd })
            | FopRequest::Read(Read { fd: $fd, .. })
            | FopRequest::Write(Write { fd: $fd, .. })
            | FopRequest::Flush(Flush { fd: $fd, .. })
            | FopRequest::Fsync(Fsync { fd: $fd, .. })
            | FopRequest::Release(Release { fd: $fd })
            | FopRequest::Readdir(Readdir { fd: $fd, .. })
            | FopRequest::Readdirp(Readdirp { fd: $fd, .. })
            | FopRequest::ReaddirpXattrs(ReaddirpXattrs { fd: $fd, .. })
            | FopRequest::Releasedir(Releasedir { fd: $fd })
            | FopRequest::Fsyncdir(Fsyncdir { fd: $fd, .. })
            | FopRequest::Fsetxattr(Fsetxattr { fd: $fd, .. })
            | FopRequest::Fgetxattr(Fgetxattr { fd: $fd, .. })
            | FopRequest::Fremovexattr(Fremovexattr { fd: $fd, .. })
            | FopRequest::Fsetattr(Fsetattr { fd: $fd, .. })
            | FopRequest::Ftruncate(Ftruncate { fd: $fd, .. })
            | FopRequest::Fallocate(Fallocate { fd: $fd, .. })
            | FopRequest::Discard(Discard { fd: $fd, .. })
            | FopRequest::Zerofill(Zerofill { fd: $fd, .. })
            | FopRequest::Seek(Seek { fd: $fd, .. })
            | FopRequest::Lk(Lk { fd: $fd, .. }) => $some,
            FopRequest::Lookup(_)
            | FopRequest::LookupXattrs(_)
            | FopRequest::Stat(_)
            | FopRequest::Access(_)
            | FopRequest::Readlink(_)
            | FopRequest::Mknod(_)
            | FopRequest::Mkdir(_)
            | FopRequest::Unlink(_)
            | FopRequest::UnlinkSettled(_)
            | FopRequest::Rmdir(_)
            | FopRequest::Symlink(_)
            | FopRequest::Rename(_)
            | FopRequest::Link(_)
            | FopRequest::Create(_)
            | FopRequest::Open(_)
            | FopRequest::Opendir(_)
            | FopRequest::Statfs(_)
            | FopRequest::Setxattr(_)
            | FopRequest::Getxattr(_)
            | FopRequest::Listxattr(_)
            | FopRequest::Removexattr(_)
            | FopRequest::Setattr(_)
            | FopRequest::Truncate(_)
            | FopRequest::Put(_)
            | FopRequest::PutSynced(_)
            | FopRequest::Lease(_)
            | FopRequest::Get(_)
            | FopRequest::OpendirList(_) => $none,
        }
    };
}

impl FopRequest {
    /// The open file or directory this fop works on; `None` for fops that address an object
    /// by GFID or a name in a directory.
    pub fn fd(&self) -> Option<FdId> {
        match_fd!(self, fd => Some(*fd), _ => None)
    }

    /// Whether a [`crate::Batch`] may carry it: it names no fd and opens nothing.
    pub fn batchable(&self) -> bool {
        self.fd().is_none()
            && !matches!(
                self,
                FopRequest::Open(_)
                    | FopRequest::Create(_)
                    | FopRequest::Opendir(_)
                    | FopRequest::OpendirList(_)
            )
    }

    /// Points this fop at `fd` (a client fills in the id its brick gave it last, e.g. after
    /// opening the file again on a new connection); `false`, and nothing changed, for a fop
    /// that names no fd.
    pub fn set_fd(&mut self, new: FdId) -> bool {
        match_fd!(self, fd => { *fd = new; true }, _ => false)
    }
}

#[cfg(test)]
mod arbitrary {
    use proptest::prelude::*;

    use super::*;

    impl<const MAX: u32> Arbitrary for BoundedU32<MAX> {
        type Parameters = ();
        type Strategy = BoxedStrategy<Self>;
        fn arbitrary_with((): ()) -> Self::Strategy {
            (0..=MAX).prop_map(Self).boxed()
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn codes_are_unique_and_roundtrip() {
        let mut seen = HashSet::new();
        for &code in FopCode::ALL {
            assert!(seen.insert(code as u16), "duplicate code {}", code as u16);
            assert_eq!(FopCode::from_u16(code as u16), Some(code));
        }
        assert_eq!(FopCode::ALL.len(), 49);
        for (i, &code) in FopCode::ALL.iter().enumerate() {
            assert_eq!(code.index(), i);
        }
        assert_eq!(FopCode::from_u16(0), None);
        assert_eq!(FopCode::from_u16(56), None);
    }

    #[test]
    fn codes_match_glusterfs() {
        // glusterfs_fop_t values; frozen.
        let frozen = [
            (FopCode::Stat, 1),
            (FopCode::Readlink, 2),
            (FopCode::Rename, 8),
            (FopCode::Open, 11),
            (FopCode::Write, 13),
            (FopCode::Create, 23),
            (FopCode::Lookup, 27),
            (FopCode::Readdirp, 40),
            (FopCode::Release, 42),
            (FopCode::Seek, 50),
            (FopCode::Put, 55),
            (FopCode::Listxattr, 100),
            (FopCode::Lease, 101),
            (FopCode::LookupXattrs, 102),
            (FopCode::ReaddirpXattrs, 103),
            (FopCode::Get, 104),
            (FopCode::OpendirList, 105),
            (FopCode::UnlinkSettled, 106),
            (FopCode::PutSynced, 107),
        ];
        for (code, n) in frozen {
            assert_eq!(code as u16, n, "{}", code.name());
        }
    }

    /// `set_fd` changes the fd of a fop on an open fd and nothing else, and leaves every other
    /// fop alone. (That every fop is classified is checked at compile time: `match_fd!` lists
    /// each variant, with no wildcard.)
    #[test]
    fn set_fd_changes_only_the_fd() {
        use proptest::prelude::*;
        use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

        let check = |(fop, new): (FopRequest, FdId)| {
            let mut changed = fop.clone();
            prop_assert_eq!(changed.set_fd(new), fop.fd().is_some());
            match fop.fd() {
                Some(old) => {
                    prop_assert_eq!(changed.fd(), Some(new));
                    prop_assert!(changed.set_fd(old));
                }
                None => prop_assert_eq!(changed.fd(), None),
            }
            prop_assert_eq!(changed, fop);
            Ok(())
        };
        // The derived strategies nest deeply; unoptimised builds need more than the default
        // test-thread stack to build them (as in `message.rs`). A fixed seed: replayable.
        std::thread::Builder::new()
            .stack_size(256 << 20)
            .spawn(move || {
                let config = Config {
                    cases: 1000,
                    failure_persistence: None,
                    ..Config::default()
                };
                let rng = TestRng::deterministic_rng(RngAlgorithm::ChaCha);
                TestRunner::new_with_rng(config, rng)
                    .run(&any::<(FopRequest, FdId)>(), check)
                    .unwrap_or_else(|e| panic!("{e}"));
            })
            .expect("spawn test thread")
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e));
    }

    #[test]
    fn bounded_sizes() {
        assert!(ReadSize::new(1 << 20).is_some());
        assert!(ReadSize::new((1 << 20) + 1).is_none());
        assert_eq!(ReadSize::saturating(u64::MAX).get(), 1 << 20);
    }
}
