//! A volume as a local file system: the FUSE mount behind `kiln mount`.
//!
//! [`mount`] opens `/dev/fuse`, mounts a client stack (any [`Layer`]) with mount(2) (no
//! libfuse, no fusermount) and serves the kernel's requests with fuser's protocol code on the
//! caller's tokio runtime. The mount's type is `fuse.kiln`, so `mount -t kiln` finds the
//! `mount.kiln` helper and `umount` works as usual.
//!
//! * `fs`: the `fuser::Filesystem` — each kernel request → a task → fops on the layer.
//! * `shared`: what the tasks share, and the fops on nodes (lookup, stat, setattr, xattrs).
//! * `handles`: open handles, open-behind and when a handle gets its fd below.
//! * `pending`: small files created with one PUT at close.
//! * `leases`: the directories the mount holds a write lease on, and their entries.
//! * `namespace`: namespace fops answered under a lease, or run on the brick.
//! * `behind`: the queue of changes answered here and not yet on the brick.
//! * `inodes`: node ids ↔ GFIDs with the kernel's lookup counts.
//! * `pages`: what the kernel's page cache of each file matches, to drop it only when stale.
//! * `convert`: FUSE ↔ wire types, the caller's credentials, errnos.

mod behind;
mod convert;
mod file_leases;
mod fs;
mod handles;
mod inodes;
mod leases;
mod made;
mod namespace;
mod pages;
mod pending;
mod prefetch;
mod shared;
mod space;

use std::ffi::CString;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fuser::{Config, InitFlags, SessionACL};
use rustix::mount::{MountFlags, UnmountFlags, unmount};

use crate::Layer;
use crate::brick::CONNECTIONS_MAX;
pub use fs::UNMOUNT_DRAIN_LIMIT;

/// The kernel's read-ahead on a mount unless told otherwise: four of the largest READs.
pub const READ_AHEAD_KIB_DEFAULT: u32 = 4 * 1024;

/// The most read-ahead a mount may be given.
pub const READ_AHEAD_KIB_MAX: u32 = 64 * 1024;

/// The free space below which a mount answers no change ahead unless told otherwise: what
/// it may hold that is not queued yet (deferred files' data and writes gathered behind,
/// 64 MiB each), and 64 MiB for other clients and the file system's own blocks.
pub const BEHIND_FREE_MIB_DEFAULT: u64 = 192;

/// The highest floor of free space a mount may be given: 1 TiB.
pub const BEHIND_FREE_MIB_MAX: u64 = 1 << 20;

/// How a volume is mounted: the kernel's cache lifetimes and the usual mount flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountOptions {
    /// The source shown in `/proc/mounts` (the volume name or brick address).
    pub fsname: String,
    /// How long the kernel trusts cached attributes.
    pub attr_timeout: Duration,
    /// How long the kernel trusts a cached name lookup.
    pub entry_timeout: Duration,
    /// How long the kernel trusts that a name does not exist (zero: not cached).
    pub negative_timeout: Duration,
    /// The kernel gathers writes in its page cache and sends them in large batches.
    pub writeback_cache: bool,
    /// Small new files, of names known free under a lease, are sent as one PUT at their
    /// first close instead of a CREATE, WRITEs and SETATTRs; the brick's refusal of the
    /// create then fails the close.
    pub deferred_create: bool,
    /// The mount takes a write lease on each directory it makes and answers namespace fops
    /// there itself, sending them to the brick behind; a refusal is reported at the next
    /// `fsync` or `close` of the object (or `fsync` of a directory).
    pub leases: bool,
    /// Bytes of changes (small files' data included) the mount may hold not yet on the
    /// brick; an application that gets further ahead waits.
    pub behind_bytes_max: usize,
    /// Free space on the volume, in MiB, below which the mount answers no change ahead
    /// ([`space`]); 0: it always does.
    pub behind_free_mib: u64,
    /// With leases, the first subdirectories a listing shows are listed ahead of a walk that
    /// may open them next ([`prefetch`]).
    pub listing_prefetch: bool,
    /// With leases, a file opened for reading that no kept listing describes is held under
    /// a read lease, so another client's change to it drops what the kernel caches of it
    /// at once ([`file_leases`]).
    pub file_leases: bool,
    /// With file leases, a file this mount wrote gets its read lease when the writing handle
    /// is released (a round trip behind each close of a file rewritten here), so reading it
    /// back waits for nothing.
    pub release_leases: bool,
    /// A file's writes are gathered (up to a MiB per open file) and sent when they stop
    /// continuing each other, at its close or `fsync`, before any fop that reads it back
    /// from the brick, and before a lock changes: a WRITE costs no round trip, and a
    /// refusal is returned at the next `close` or `fsync` (GlusterFS's write-behind).
    /// Off, only the files the mount made under a directory's write lease gather theirs.
    pub write_behind: bool,
    /// With listings fetched ahead, the next small files of a directory read in the order it
    /// was listed are fetched ahead of the reader ([`prefetch`]).
    pub file_prefetch: bool,
    /// KiB the kernel reads ahead of a program reading a file in order (the mount's
    /// `read_ahead_kb`; 0 keeps the kernel's). FUSE starts every mount at 128 KiB, one
    /// READ in flight; a network file system wants several.
    pub read_ahead_kib: u32,
    /// QUIC connections to each brick: the main one, and lanes for large READs and WRITEs
    /// (a file read ahead, a large file written behind), 1 to
    /// [`crate::brick::CONNECTIONS_MAX`].
    pub connections: usize,
    /// The kernel's requests come through io_uring, a queue per CPU served by a thread on that
    /// CPU, where the kernel offers it (the `fuse` module's `enable_uring`); otherwise, and
    /// off, through reads of `/dev/fuse` on one thread.
    pub fuse_uring: bool,
    /// With leases, a held directory's listing is kept until the lease goes where the brick
    /// covers the attributes it listed (capability `LISTED_ATTRS`); off, for the attribute
    /// lifetime ([`leases`]).
    pub listed_attrs: bool,
    /// The kernel also checks permissions itself, from cached attributes, before asking the
    /// brick (which checks every fop again as the caller). On by default: without it, a path
    /// walk through cached entries would skip the search-permission check of each directory.
    pub default_permissions: bool,
    pub read_only: bool,
    /// Honour set-user-id bits (off: `nosuid`, as FUSE mounts default to).
    pub suid: bool,
    /// Honour device files (off: `nodev`).
    pub dev: bool,
    pub noexec: bool,
    pub noatime: bool,
    /// SELinux labels (`security.selinux`) are carried. Off, GETXATTR, SETXATTR and
    /// REMOVEXATTR of the name answer EOPNOTSUPP and LISTXATTR leaves it out, as GlusterFS's
    /// mounts do without `selinux`: `ls -l` then stops asking for every file (coreutils
    /// remembers a file system without labels).
    pub selinux: bool,
    /// POSIX ACLs (`system.posix_acl_access`, `system.posix_acl_default`) are carried: set,
    /// read, and enforced by the brick (the kernel checks the mode bits first). Off, they are
    /// unsupported as labels are without `selinux`, as GlusterFS's mounts without `acl`.
    pub acl: bool,
}

impl Default for MountOptions {
    fn default() -> MountOptions {
        MountOptions {
            fsname: "kiln".to_owned(),
            attr_timeout: Duration::from_secs(1),
            entry_timeout: Duration::from_secs(1),
            negative_timeout: Duration::from_secs(1),
            writeback_cache: false,
            deferred_create: true,
            leases: true,
            behind_bytes_max: 64 << 20,
            behind_free_mib: BEHIND_FREE_MIB_DEFAULT,
            listing_prefetch: true,
            file_leases: true,
            release_leases: true,
            write_behind: true,
            file_prefetch: true,
            read_ahead_kib: READ_AHEAD_KIB_DEFAULT,
            connections: 1,
            fuse_uring: true,
            listed_attrs: true,
            default_permissions: true,
            read_only: false,
            suid: false,
            dev: false,
            noexec: false,
            noatime: false,
            selinux: false,
            acl: false,
        }
    }
}

/// A mount option that is unknown or has a bad value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionError {
    #[error("unknown mount option '{0}'")]
    Unknown(String),
    #[error("mount option '{key}': {why}")]
    BadValue { key: String, why: String },
}

/// Options `mount(8)` and `/etc/fstab` pass that only matter to them.
const IGNORED: &[&str] = &[
    "defaults",
    "auto",
    "noauto",
    "user",
    "nouser",
    "users",
    "_netdev",
    "nofail",
    "relatime",
    "strictatime",
    "async",
    "exec",
    "atime",
];

impl MountOptions {
    /// Applies one `key` or `key=value` from a `-o` list. The cache settings are also the
    /// volume's `performance.*` options, without the prefix.
    pub fn set(&mut self, key: &str, value: Option<&str>) -> Result<(), OptionError> {
        let flag = |on: &mut bool| -> Result<(), OptionError> {
            *on = match value {
                None | Some("on" | "true" | "yes" | "1") => true,
                Some("off" | "false" | "no" | "0") => false,
                Some(v) => return Err(bad(key, format!("'{v}' is not on or off"))),
            };
            Ok(())
        };
        match key {
            "attr-timeout-ms" => self.attr_timeout = millis(key, value)?,
            "entry-timeout-ms" => self.entry_timeout = millis(key, value)?,
            "negative-timeout-ms" => self.negative_timeout = millis(key, value)?,
            "writeback-cache" => flag(&mut self.writeback_cache)?,
            "deferred-create" => flag(&mut self.deferred_create)?,
            "leases" => flag(&mut self.leases)?,
            "behind-bytes-max" => self.behind_bytes_max = bytes(key, value)?,
            "behind-free-mib" => self.behind_free_mib = mib(key, value)?,
            "listing-prefetch" => flag(&mut self.listing_prefetch)?,
            "file-leases" => flag(&mut self.file_leases)?,
            "release-leases" => flag(&mut self.release_leases)?,
            "write-behind" => flag(&mut self.write_behind)?,
            "file-prefetch" => flag(&mut self.file_prefetch)?,
            "read-ahead-kib" => self.read_ahead_kib = kib(key, value)?,
            "connections" => self.connections = connections(key, value)?,
            "listed-attrs" => flag(&mut self.listed_attrs)?,
            "fuse-uring" => flag(&mut self.fuse_uring)?,
            "default-permissions" => flag(&mut self.default_permissions)?,
            "ro" => flag(&mut self.read_only)?,
            "rw" => self.read_only = false,
            "suid" => flag(&mut self.suid)?,
            "nosuid" => self.suid = false,
            "dev" => flag(&mut self.dev)?,
            "nodev" => self.dev = false,
            "noexec" => flag(&mut self.noexec)?,
            "noatime" => flag(&mut self.noatime)?,
            "selinux" => flag(&mut self.selinux)?,
            "acl" => flag(&mut self.acl)?,
            k if IGNORED.contains(&k) || k.starts_with("x-") => {}
            k => return Err(OptionError::Unknown(k.to_owned())),
        }
        Ok(())
    }

    /// Whether this mount carries xattr `name` ([`MountOptions::selinux`],
    /// [`MountOptions::acl`]); the kernel's calls for one it does not are answered EOPNOTSUPP.
    pub fn carries_xattr(&self, name: &[u8]) -> bool {
        match name {
            b"security.selinux" => self.selinux,
            b"system.posix_acl_access" | b"system.posix_acl_default" => self.acl,
            _ => true,
        }
    }

    /// The FUSE features the mount asks the kernel for at INIT, the mount telling the kernel
    /// when to drop a file's pages where `pages_told` (else the kernel drops them when a file's
    /// mtime or size moves: [`pages`]).
    fn kernel_features(&self, pages_told: bool) -> InitFlags {
        let mut wanted = InitFlags::FUSE_POSIX_LOCKS
            | InitFlags::FUSE_ATOMIC_O_TRUNC
            | InitFlags::FUSE_DO_READDIRPLUS
            | InitFlags::FUSE_PARALLEL_DIROPS
            | InitFlags::FUSE_CACHE_SYMLINKS
            // The brick writes, truncates and chowns as the caller, so its own kernel clears
            // set-id bits and capabilities; the FUSE kernel need not ask first (and with v2
            // it stops asking for security.capability before every write).
            | InitFlags::FUSE_HANDLE_KILLPRIV
            | InitFlags::FUSE_HANDLE_KILLPRIV_V2
            | InitFlags::FUSE_MAX_PAGES;
        if self.writeback_cache {
            wanted |= InitFlags::FUSE_WRITEBACK_CACHE;
        }
        wanted
            | match pages_told {
                true => InitFlags::FUSE_EXPLICIT_INVAL_DATA,
                false => InitFlags::FUSE_AUTO_INVAL_DATA,
            }
    }

    /// The mount(2) flags.
    fn flags(&self) -> MountFlags {
        let mut flags = MountFlags::empty();
        for (on, flag) in [
            (self.read_only, MountFlags::RDONLY),
            (!self.suid, MountFlags::NOSUID),
            (!self.dev, MountFlags::NODEV),
            (self.noexec, MountFlags::NOEXEC),
            (self.noatime, MountFlags::NOATIME),
        ] {
            if on {
                flags |= flag;
            }
        }
        flags
    }
}

fn bad(key: &str, why: String) -> OptionError {
    OptionError::BadValue {
        key: key.to_owned(),
        why,
    }
}

fn bytes(key: &str, value: Option<&str>) -> Result<usize, OptionError> {
    let value = value.ok_or_else(|| bad(key, "needs a number of bytes".into()))?;
    match value.parse() {
        Ok(n) if n >= 1 << 20 => Ok(n),
        _ => Err(bad(
            key,
            format!("'{value}' is not a number of bytes of at least 1 MiB"),
        )),
    }
}

fn mib(key: &str, value: Option<&str>) -> Result<u64, OptionError> {
    let value = value.ok_or_else(|| bad(key, "needs a number of MiB".into()))?;
    value
        .parse()
        .ok()
        .filter(|&n| n <= BEHIND_FREE_MIB_MAX)
        .ok_or_else(|| {
            let max = BEHIND_FREE_MIB_MAX;
            bad(key, format!("'{value}' is not a number of MiB up to {max}"))
        })
}

fn kib(key: &str, value: Option<&str>) -> Result<u32, OptionError> {
    let value = value.ok_or_else(|| bad(key, "needs a number of KiB".into()))?;
    match value.parse() {
        Ok(n) if n <= READ_AHEAD_KIB_MAX => Ok(n),
        _ => Err(bad(
            key,
            format!("'{value}' is not a number of KiB up to {READ_AHEAD_KIB_MAX}"),
        )),
    }
}

fn connections(key: &str, value: Option<&str>) -> Result<usize, OptionError> {
    let value = value.ok_or_else(|| bad(key, "needs a number of connections".into()))?;
    match value.parse() {
        Ok(n) if (1..=CONNECTIONS_MAX).contains(&n) => Ok(n),
        _ => Err(bad(
            key,
            format!("'{value}' is not a number of connections from 1 to {CONNECTIONS_MAX}"),
        )),
    }
}

fn millis(key: &str, value: Option<&str>) -> Result<Duration, OptionError> {
    let value = value.ok_or_else(|| bad(key, "needs a number of milliseconds".into()))?;
    value
        .parse()
        .map(Duration::from_millis)
        .map_err(|_| bad(key, format!("'{value}' is not a number of milliseconds")))
}

/// A mounted volume. Dropping it unmounts.
#[derive(Debug)]
pub struct Mounted {
    session: fuser::BackgroundSession,
    mountpoint: PathBuf,
}

/// Mounts the client stack `layer` on `mountpoint`; requests are served on `runtime`.
///
/// The mount(2) call is made here rather than by fuser, which would unmount the path again
/// when its session ends — by then possibly a new mount on the same directory.
pub fn mount<L: Layer>(
    runtime: tokio::runtime::Handle,
    layer: L,
    mountpoint: &Path,
    options: MountOptions,
) -> io::Result<Mounted> {
    let mountpoint = mountpoint.canonicalize()?;
    let meta = std::fs::metadata(&mountpoint)?;
    if !meta.is_dir() {
        return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
    }
    let device = rustix::fs::open(
        "/dev/fuse",
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?;
    // A shared file system: every local user reaches it (allow_other), and the brick checks
    // each caller's permissions.
    let mut data = format!(
        "fd={},rootmode={:o},user_id=0,group_id=0,allow_other",
        device.as_raw_fd(),
        meta.mode() & libc::S_IFMT
    );
    if options.default_permissions {
        data.push_str(",default_permissions");
    }
    let data = CString::new(data).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    rustix::mount::mount(
        options.fsname.as_str(),
        &mountpoint,
        "fuse.kiln",
        options.flags(),
        data.as_c_str(),
    )?;
    let mut config = Config::default();
    config.n_threads = Some(1);
    let read_ahead_kib = options.read_ahead_kib;
    let fs = fs::KilnFs::new(runtime, layer, options);
    let shared = fs.shared();
    let session = fuser::Session::from_fd(fs, device, SessionACL::All, config).and_then(|s| {
        let _ = shared.kernel.set(s.notifier());
        s.spawn()
    });
    match session {
        Ok(session) => {
            if read_ahead_kib > 0 {
                set_read_ahead(mountpoint.clone(), read_ahead_kib);
            }
            Ok(Mounted {
                session,
                mountpoint,
            })
        }
        Err(e) => {
            let _ = unmount(&mountpoint, UnmountFlags::DETACH);
            Err(e)
        }
    }
}

/// Sets the read-ahead of the mount on `mountpoint` to `kib`, on a thread of its own: the
/// kernel sets it from the INIT reply (at most 128 KiB, whatever the mount asks), and holds
/// every request until that reply is in, so a `stat` of the mount point returns only after.
/// A mount that cannot be given it (no sysfs) keeps the kernel's.
fn set_read_ahead(mountpoint: PathBuf, kib: u32) {
    let set = move || {
        // Fails only when the mount is gone already.
        let Ok(meta) = std::fs::metadata(&mountpoint) else {
            return;
        };
        let (major, minor) = (rustix::fs::major(meta.dev()), rustix::fs::minor(meta.dev()));
        let knob = format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb");
        if let Err(e) = std::fs::write(&knob, kib.to_string()) {
            tracing::warn!(error = %e, knob, "the mount keeps the kernel's read-ahead");
        }
    };
    let spawned = std::thread::Builder::new()
        .name("kiln-read-ahead".into())
        .spawn(set);
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "the mount keeps the kernel's read-ahead");
    }
}

impl Mounted {
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// The kernel ended the session: the file system was unmounted from outside
    /// (`umount`, `kiln umount`).
    pub fn is_finished(&self) -> bool {
        self.session.guard.is_finished()
    }

    /// Unmounts and waits for the session to end. When the mount is busy, it is detached
    /// from the tree at once (new opens fail), and this waits until the files open on it are
    /// closed, so their writes still reach the brick.
    pub fn unmount(self) -> io::Result<()> {
        if !self.is_finished() {
            match unmount(&self.mountpoint, UnmountFlags::empty()) {
                Ok(()) => {}
                Err(rustix::io::Errno::BUSY) => {
                    tracing::warn!(
                        mountpoint = %self.mountpoint.display(),
                        "mount point busy: detached; serving open files until they are closed"
                    );
                    unmount(&self.mountpoint, UnmountFlags::DETACH)?;
                }
                // Already gone (unmounted from outside meanwhile).
                Err(rustix::io::Errno::INVAL) => {}
                Err(e) => return Err(e.into()),
            }
        }
        self.session.join()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_and_acls_are_carried_only_when_asked() {
        let mut o = MountOptions::default();
        let names = [
            &b"security.selinux"[..],
            b"system.posix_acl_access",
            b"system.posix_acl_default",
        ];
        assert!(names.iter().all(|n| !o.carries_xattr(n)));
        assert!(o.carries_xattr(b"security.capability") && o.carries_xattr(b"user.x"));
        o.set("selinux", None).expect("valid");
        assert!(o.carries_xattr(names[0]) && !o.carries_xattr(names[1]));
        o.set("acl", Some("on")).expect("valid");
        assert!(names.iter().all(|n| o.carries_xattr(n)));
    }

    #[test]
    fn options_parse_and_refuse_what_they_do_not_know() {
        let mut o = MountOptions::default();
        o.set("attr-timeout-ms", Some("250")).expect("valid");
        o.set("writeback-cache", None).expect("valid");
        o.set("deferred-create", Some("off")).expect("valid");
        o.set("listed-attrs", Some("off")).expect("valid");
        o.set("read-ahead-kib", Some("0")).expect("valid");
        o.set("ro", None).expect("valid");
        for fstab_only in ["defaults", "_netdev", "nofail", "x-systemd.automount"] {
            o.set(fstab_only, None).expect("ignored");
        }
        assert_eq!(o.attr_timeout, Duration::from_millis(250));
        assert!(o.writeback_cache && !o.deferred_create && !o.listed_attrs && o.read_only);
        assert!(o.flags().contains(MountFlags::RDONLY | MountFlags::NOSUID));
        assert_eq!(
            o.set("colour", Some("blue")),
            Err(OptionError::Unknown("colour".into()))
        );
        assert!(matches!(
            o.set("entry-timeout-ms", Some("soon")),
            Err(OptionError::BadValue { .. })
        ));
        assert!(matches!(
            o.set("negative-timeout-ms", None),
            Err(OptionError::BadValue { .. })
        ));
        assert_eq!(o.read_ahead_kib, 0);
        for bad_kib in [None, Some("lots"), Some("65537")] {
            assert!(matches!(
                o.set("read-ahead-kib", bad_kib),
                Err(OptionError::BadValue { .. })
            ));
        }
        assert!(matches!(
            o.set("writeback-cache", Some("maybe")),
            Err(OptionError::BadValue { .. })
        ));
        o.set("connections", Some("4")).expect("valid");
        assert_eq!(o.connections, 4);
        // The volume option allows what the mount does.
        let volume_option = kiln_admin::options::find("performance.connections").expect("known");
        assert!(matches!(
            volume_option.kind,
            kiln_admin::options::ValueKind::Integer { min: 1, max } if max == CONNECTIONS_MAX as u64
        ));
        for bad_count in [None, Some("0"), Some("17"), Some("many")] {
            assert!(matches!(
                o.set("connections", bad_count),
                Err(OptionError::BadValue { .. })
            ));
        }
        assert_eq!(o.behind_free_mib, BEHIND_FREE_MIB_DEFAULT);
        o.set("behind-free-mib", Some("0")).expect("valid");
        assert_eq!(o.behind_free_mib, 0);
        for bad_mib in [None, Some("-1"), Some("1048577"), Some("lots")] {
            assert!(matches!(
                o.set("behind-free-mib", bad_mib),
                Err(OptionError::BadValue { .. })
            ));
        }
        // The volume option allows what the mount does, with the same default.
        let volume_option =
            kiln_admin::options::find("performance.behind-free-mib").expect("known");
        assert!(matches!(
            volume_option.kind,
            kiln_admin::options::ValueKind::Integer { min: 0, max } if max == BEHIND_FREE_MIB_MAX
        ));
        assert_eq!(volume_option.default, BEHIND_FREE_MIB_DEFAULT.to_string());
    }
}
