//! Attributes: file types and modes, timestamps, `Iatt` (GlusterFS's stat), statfs, setattr
//! requests and directory entries.

use crate::codec::{Decode, DecodeError, Encode, Encoder, Reader, wire_enum, wire_struct};
use crate::flags::XattrPresence;
use crate::ids::Gfid;
use crate::names::Name;

wire_enum! {
    /// The type of a file-system object.
    pub enum FileType {
        Regular = 1,
        Directory = 2,
        Symlink = 3,
        BlockDevice = 4,
        CharDevice = 5,
        Fifo = 6,
        Socket = 7,
    }
}

impl FileType {
    /// The `S_IFMT` bits of this type.
    pub fn to_mode_bits(self) -> u32 {
        match self {
            FileType::Regular => libc::S_IFREG,
            FileType::Directory => libc::S_IFDIR,
            FileType::Symlink => libc::S_IFLNK,
            FileType::BlockDevice => libc::S_IFBLK,
            FileType::CharDevice => libc::S_IFCHR,
            FileType::Fifo => libc::S_IFIFO,
            FileType::Socket => libc::S_IFSOCK,
        }
    }

    /// The type named by the `S_IFMT` bits of a `st_mode`.
    pub fn from_mode_bits(mode: u32) -> Option<Self> {
        Some(match mode & libc::S_IFMT {
            libc::S_IFREG => FileType::Regular,
            libc::S_IFDIR => FileType::Directory,
            libc::S_IFLNK => FileType::Symlink,
            libc::S_IFBLK => FileType::BlockDevice,
            libc::S_IFCHR => FileType::CharDevice,
            libc::S_IFIFO => FileType::Fifo,
            libc::S_IFSOCK => FileType::Socket,
            _ => return None,
        })
    }
}

/// Permission bits with set-uid, set-gid and sticky: at most `0o7777`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Mode(u16);

impl Mode {
    pub const MAX: u16 = 0o7777;

    pub fn new(bits: u32) -> Option<Mode> {
        u16::try_from(bits)
            .ok()
            .filter(|&b| b <= Self::MAX)
            .map(Mode)
    }

    /// Keeps only the permission bits of a full `st_mode`.
    pub fn from_st_mode(st_mode: u32) -> Mode {
        Mode((st_mode & 0o7777) as u16)
    }

    pub fn bits(self) -> u32 {
        u32::from(self.0)
    }
}

impl Encode for Mode {
    fn encode(&self, out: &mut Encoder) {
        out.put_u16(self.0);
    }
}

impl Decode for Mode {
    const ENCODED_LEN_MIN: usize = 2;

    fn decode(input: &mut Reader) -> Result<Self, DecodeError> {
        Mode::new(u32::from(input.u16()?)).ok_or(DecodeError::invalid("mode", "above 0o7777"))
    }
}

/// A point in time: seconds since the epoch (may be negative) and nanoseconds below 10⁹.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Timespec {
    sec: i64,
    nsec: u32,
}

impl Timespec {
    pub const NSEC_PER_SEC: u32 = 1_000_000_000;

    pub fn new(sec: i64, nsec: u32) -> Option<Timespec> {
        (nsec < Self::NSEC_PER_SEC).then_some(Timespec { sec, nsec })
    }

    pub fn sec(self) -> i64 {
        self.sec
    }

    pub fn nsec(self) -> u32 {
        self.nsec
    }
}

impl Encode for Timespec {
    fn encode(&self, out: &mut Encoder) {
        out.put_i64(self.sec);
        out.put_u32(self.nsec);
    }
}

impl Decode for Timespec {
    const ENCODED_LEN_MIN: usize = 12;

    fn decode(input: &mut Reader) -> Result<Self, DecodeError> {
        let (sec, nsec) = (input.i64()?, input.u32()?);
        Timespec::new(sec, nsec).ok_or(DecodeError::invalid("timespec", "nanoseconds ≥ 10⁹"))
    }
}

impl Iatt {
    /// A directory's attributes left out of a reply (capability `NO_PARENT_ATTRS`): its GFID
    /// and type, every other field zero.
    pub fn omitted_dir(gfid: Gfid) -> Iatt {
        Iatt {
            gfid,
            ino: 0,
            file_type: FileType::Directory,
            mode: Mode(0),
            nlink: 0,
            uid: 0,
            gid: 0,
            rdev: 0,
            size: 0,
            blocks: 0,
            blksize: 0,
            atime: Timespec::default(),
            mtime: Timespec::default(),
            ctime: Timespec::default(),
        }
    }
}

wire_struct! {
    /// An object's attributes, GlusterFS's `iatt`: what `statx` says plus the GFID.
    pub struct Iatt {
        pub gfid: Gfid,
        pub ino: u64,
        pub file_type: FileType,
        pub mode: Mode,
        pub nlink: u32,
        pub uid: u32,
        pub gid: u32,
        pub rdev: u64,
        pub size: u64,
        /// 512-byte blocks allocated.
        pub blocks: u64,
        pub blksize: u32,
        pub atime: Timespec,
        pub mtime: Timespec,
        pub ctime: Timespec,
    }

    /// What `statvfs` reports for the brick's file system.
    pub struct FsStats {
        pub bsize: u64,
        pub frsize: u64,
        pub blocks: u64,
        pub bfree: u64,
        pub bavail: u64,
        pub files: u64,
        pub ffree: u64,
        pub favail: u64,
        pub fsid: u64,
        pub flags: u64,
        pub namemax: u64,
    }

    /// One READDIR entry. `offset` is the cookie to continue after this entry.
    pub struct DirEntry {
        pub offset: u64,
        pub ino: u64,
        pub file_type: FileType,
        pub name: Name,
    }

    /// One READDIRP entry: the name with its full attributes, so a client fills its cache
    /// without a LOOKUP per entry.
    pub struct DirEntryPlus {
        pub offset: u64,
        pub name: Name,
        pub iatt: Iatt,
    }

    /// One READDIRP_XATTRS entry: a READDIRP entry with the presence of the probed xattrs.
    pub struct DirEntryXattrs {
        pub offset: u64,
        pub name: Name,
        pub iatt: Iatt,
        pub xattrs: XattrPresence,
    }
}

/// How SETATTR sets a timestamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub enum TimeSet {
    /// The brick's current time (`UTIME_NOW`).
    Now,
    At(Timespec),
}

/// The attributes one SETATTR changes; `None` leaves that attribute alone (`UTIME_OMIT` for
/// times). On the wire: a `u32` mask of the `SetAttr::*` bits, then the present fields in
/// order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub struct SetAttr {
    pub mode: Option<Mode>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<TimeSet>,
    pub mtime: Option<TimeSet>,
}

impl SetAttr {
    pub const MODE: u32 = 1 << 0;
    pub const UID: u32 = 1 << 1;
    pub const GID: u32 = 1 << 2;
    pub const SIZE: u32 = 1 << 3;
    pub const ATIME: u32 = 1 << 4;
    pub const MTIME: u32 = 1 << 5;
    pub const ATIME_NOW: u32 = 1 << 7;
    pub const MTIME_NOW: u32 = 1 << 8;
    const KNOWN: u32 = Self::MODE
        | Self::UID
        | Self::GID
        | Self::SIZE
        | Self::ATIME
        | Self::MTIME
        | Self::ATIME_NOW
        | Self::MTIME_NOW;

    /// The wire mask of the attributes this request sets.
    pub fn mask(&self) -> u32 {
        let time = |t: Option<TimeSet>, at, now| match t {
            None => 0,
            Some(TimeSet::Now) => now,
            Some(TimeSet::At(_)) => at,
        };
        (if self.mode.is_some() { Self::MODE } else { 0 })
            | (if self.uid.is_some() { Self::UID } else { 0 })
            | (if self.gid.is_some() { Self::GID } else { 0 })
            | (if self.size.is_some() { Self::SIZE } else { 0 })
            | time(self.atime, Self::ATIME, Self::ATIME_NOW)
            | time(self.mtime, Self::MTIME, Self::MTIME_NOW)
    }

    pub fn is_empty(&self) -> bool {
        self.mask() == 0
    }
}

impl Encode for SetAttr {
    fn encode(&self, out: &mut Encoder) {
        out.put_u32(self.mask());
        self.mode.inspect(|v| v.encode(out));
        self.uid.inspect(|v| v.encode(out));
        self.gid.inspect(|v| v.encode(out));
        self.size.inspect(|v| v.encode(out));
        for t in [self.atime, self.mtime] {
            if let Some(TimeSet::At(ts)) = t {
                ts.encode(out);
            }
        }
    }
}

impl Decode for SetAttr {
    const ENCODED_LEN_MIN: usize = 4;

    fn decode(input: &mut Reader) -> Result<Self, DecodeError> {
        let mask = input.u32()?;
        if mask & !Self::KNOWN != 0 {
            return Err(DecodeError::invalid("setattr mask", "unknown bits"));
        }
        if mask & Self::ATIME != 0 && mask & Self::ATIME_NOW != 0
            || mask & Self::MTIME != 0 && mask & Self::MTIME_NOW != 0
        {
            return Err(DecodeError::invalid(
                "setattr mask",
                "a time both given and now",
            ));
        }
        let field = |bit: u32| mask & bit != 0;
        let mode = field(Self::MODE).then(|| Mode::decode(input)).transpose()?;
        let uid = field(Self::UID).then(|| input.u32()).transpose()?;
        let gid = field(Self::GID).then(|| input.u32()).transpose()?;
        let size = field(Self::SIZE).then(|| input.u64()).transpose()?;
        let mut time = |at: u32, now: u32| -> Result<Option<TimeSet>, DecodeError> {
            Ok(match (field(at), field(now)) {
                (true, _) => Some(TimeSet::At(Timespec::decode(input)?)),
                (false, true) => Some(TimeSet::Now),
                (false, false) => None,
            })
        };
        let atime = time(Self::ATIME, Self::ATIME_NOW)?;
        let mtime = time(Self::MTIME, Self::MTIME_NOW)?;
        Ok(SetAttr {
            mode,
            uid,
            gid,
            size,
            atime,
            mtime,
        })
    }
}

#[cfg(test)]
mod arbitrary {
    use proptest::prelude::*;

    use super::*;

    impl Arbitrary for Mode {
        type Parameters = ();
        type Strategy = BoxedStrategy<Mode>;
        fn arbitrary_with((): ()) -> Self::Strategy {
            (0u32..=0o7777)
                .prop_map(|b| Mode::new(b).expect("in range"))
                .boxed()
        }
    }

    impl Arbitrary for Timespec {
        type Parameters = ();
        type Strategy = BoxedStrategy<Timespec>;
        fn arbitrary_with((): ()) -> Self::Strategy {
            (any::<i64>(), 0..Timespec::NSEC_PER_SEC)
                .prop_map(|(s, n)| Timespec::new(s, n).expect("in range"))
                .boxed()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_type_mode_bits_roundtrip() {
        for v in 1..=7 {
            let t = FileType::from_u8(v).expect("every value 1..=7 is a type");
            assert_eq!(FileType::from_mode_bits(t.to_mode_bits() | 0o644), Some(t));
        }
        assert_eq!(FileType::from_u8(0), None);
        assert_eq!(FileType::from_u8(8), None);
    }

    #[test]
    fn mode_and_time_bounds() {
        assert!(Mode::new(0o7777).is_some());
        assert!(Mode::new(0o10000).is_none());
        assert_eq!(Mode::from_st_mode(libc::S_IFDIR | 0o1755).bits(), 0o1755);
        assert!(Timespec::new(-1, 999_999_999).is_some());
        assert!(Timespec::new(0, 1_000_000_000).is_none());
    }
}
