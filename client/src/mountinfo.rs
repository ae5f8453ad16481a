//! The kernel's table of mounts as this process sees it (`/proc/self/mountinfo`), read and
//! parsed in one place for everyone who needs it: `kiln umount` finding Kiln mounts (and
//! copies of one left in other mount namespaces), the benchmarks waiting for a FUSE mount to
//! appear.
//!
//! A line is `ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE
//! SUPER_OPTIONS` (proc(5)). The kernel writes space, tab, newline and backslash inside a
//! field as `\ooo` (three octal digits); every other byte is written as it is, so a path need
//! not be UTF-8. Lines that do not have that shape are skipped rather than guessed at.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt as _;
use std::path::{Path, PathBuf};

/// Where the kernel lists the mounts of the calling process's mount namespace.
pub const SELF_MOUNTINFO: &str = "/proc/self/mountinfo";

/// Fields before the optional ones: ID, PARENT, MAJ:MIN, ROOT, MOUNT_POINT, OPTIONS.
const FIXED_FIELDS: usize = 6;

/// One mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// Where it is mounted, unescaped.
    pub mount_point: PathBuf,
    /// The file system type, with its subtype (`ext4`, `fuse.kiln`, `fuse.glusterfs`).
    pub fs_type: String,
    /// What is mounted (a device, `HOST:/VOLUME`, a FUSE server's `fsname`), unescaped.
    pub source: OsString,
    /// The file system's device, `MAJOR:MINOR`: the same in every mount namespace that has a
    /// copy of the mount.
    pub device: String,
}

impl MountEntry {
    /// Whether this is a mount of type `fs_type` exactly on `point` (compared as given: pass
    /// a canonical path, as the kernel lists those).
    pub fn is_at(&self, point: &Path, fs_type: &str) -> bool {
        self.fs_type == fs_type && self.mount_point == point
    }
}

/// The mounts of this process's mount namespace, in the kernel's order (parents first).
pub fn read_self() -> std::io::Result<Vec<MountEntry>> {
    read(Path::new(SELF_MOUNTINFO))
}

/// The mounts listed in a mountinfo file (`/proc/PID/mountinfo`).
pub fn read(path: &Path) -> std::io::Result<Vec<MountEntry>> {
    Ok(parse(&std::fs::read(path)?).collect())
}

/// A process of another mount namespace than this one's in which file system `device`
/// (`MAJOR:MINOR`) is mounted. A namespace made while a mount was there (`unshare`, `ip netns
/// exec`, a service's private mounts) keeps a copy of it, and a FUSE session goes on until
/// every copy is gone. Namespaces this process may not read are not looked at.
pub fn other_namespace_with(device: &str) -> Option<u32> {
    let own = std::fs::read_link("/proc/self/ns/mnt").ok()?;
    let mut seen = std::collections::HashSet::from([own]);
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        let Ok(namespace) = std::fs::read_link(entry.path().join("ns/mnt")) else {
            continue;
        };
        if !seen.insert(namespace) {
            continue;
        }
        let mounts = read(&entry.path().join("mountinfo"));
        if mounts.is_ok_and(|mounts| mounts.iter().any(|m| m.device == device)) {
            return Some(pid);
        }
    }
    None
}

/// The well-formed lines of a mountinfo text.
pub fn parse(text: &[u8]) -> impl Iterator<Item = MountEntry> + '_ {
    text.split(|&b| b == b'\n').filter_map(parse_line)
}

/// One line, or None if it does not have mountinfo's shape.
pub fn parse_line(line: &[u8]) -> Option<MountEntry> {
    let fields: Vec<&[u8]> = line.split(|&b| b == b' ').collect();
    // The optional fields end at a field that is exactly "-"; escaped fields never are.
    let optional = fields.get(FIXED_FIELDS..)?;
    let separator = FIXED_FIELDS + optional.iter().position(|f| *f == b"-")?;
    let number = |f: &[u8]| !f.is_empty() && f.iter().all(u8::is_ascii_digit);
    let device = |f: &[u8]| {
        f.iter().filter(|&&b| b == b':').count() == 1
            && f.iter().all(|&b| b == b':' || b.is_ascii_digit())
    };
    if !(number(fields[0]) && number(fields[1]) && device(fields[2])) {
        return None;
    }
    let mount_point = *fields.get(4)?;
    let (fs_type, source) = (*fields.get(separator + 1)?, *fields.get(separator + 2)?);
    if !mount_point.starts_with(b"/") || fs_type.is_empty() {
        return None;
    }
    Some(MountEntry {
        mount_point: PathBuf::from(OsString::from_vec(unescape(mount_point))),
        fs_type: String::from_utf8_lossy(&unescape(fs_type)).into_owned(),
        source: OsString::from_vec(unescape(source)),
        device: String::from_utf8_lossy(fields[2]).into_owned(),
    })
}

/// Undoes the kernel's `\ooo` escapes. A backslash not followed by three octal digits (of a
/// byte: at most `\377`) is kept as it is.
pub fn unescape(field: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while i < field.len() {
        let octal = match field.get(i + 1..i + 4) {
            Some(&[a @ b'0'..=b'3', b @ b'0'..=b'7', c @ b'0'..=b'7']) if field[i] == b'\\' => {
                Some((a - b'0') << 6 | (b - b'0') << 3 | (c - b'0'))
            }
            _ => None,
        };
        match octal {
            Some(byte) => {
                out.push(byte);
                i += 4;
            }
            None => {
                out.push(field[i]);
                i += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,discard
36 22 0:31 / /mnt/a\\040b\\134c rw,nosuid,nodev master:7 - fuse.kiln 127.0.0.1:26100 rw,user_id=0
37 22 0:32 / /mnt/plain rw - fuse.glusterfs server:/vol\\040x rw
this is not a mount
38 22 0:33 / /mnt/no-separator rw shared:2 ext4 /dev/sdb rw
39 22 0:34 / /mnt/short rw -
x 22 0:35 / /mnt/bad-id rw - ext4 /dev/sdc rw
40 22 0:36 / relative rw - ext4 /dev/sdd rw

41 22 0:37 /sub /mnt/many\\011tabs\\012lines rw shared:3 master:4 propagate_from:5 - tmpfs none rw
";

    #[test]
    fn entries_are_unescaped_and_malformed_lines_skipped() {
        let entries: Vec<MountEntry> = parse(SAMPLE.as_bytes()).collect();
        let points: Vec<&Path> = entries.iter().map(|e| e.mount_point.as_path()).collect();
        assert_eq!(
            points,
            [
                Path::new("/"),
                Path::new("/mnt/a b\\c"),
                Path::new("/mnt/plain"),
                Path::new("/mnt/many\ttabs\nlines"),
            ]
        );
        let kiln = &entries[1];
        assert_eq!(kiln.fs_type, "fuse.kiln");
        assert_eq!(kiln.source, "127.0.0.1:26100");
        assert!(kiln.is_at(Path::new("/mnt/a b\\c"), "fuse.kiln"));
        assert!(!kiln.is_at(Path::new("/mnt/a b\\c"), "fuse"));
        assert!(!kiln.is_at(Path::new("/mnt/a\\040b\\134c"), "fuse.kiln"));
        assert_eq!(entries[2].source, "server:/vol x");
        // Optional fields of any number, ROOT other than `/`.
        assert_eq!(entries[3].fs_type, "tmpfs");
        assert_eq!(entries[3].source, "none");
    }

    #[test]
    fn escapes_are_undone_only_when_whole() {
        assert_eq!(unescape(br"/mnt/a\040b\134c"), b"/mnt/a b\\c");
        assert_eq!(unescape(b"/plain"), b"/plain");
        assert_eq!(unescape(br"/odd\04"), br"/odd\04");
        assert_eq!(unescape(br"/end\"), br"/end\");
        assert_eq!(unescape(br"/big\777"), br"/big\777");
        assert_eq!(unescape(br"/sign\+12"), br"/sign\+12");
        assert_eq!(unescape(br"\134\134"), br"\\");
        assert_eq!(unescape(br"\\040"), br"\ ");
    }

    #[test]
    fn paths_need_not_be_utf8() {
        let line = b"50 22 0:40 / /mnt/caf\xe9 rw - ext4 /dev/sde rw";
        let entry = parse_line(line).expect("a mount");
        assert_eq!(
            entry.mount_point.as_os_str().as_encoded_bytes(),
            b"/mnt/caf\xe9"
        );
    }

    #[test]
    fn this_process_sees_its_root() {
        let entries = read_self().expect("read /proc/self/mountinfo");
        assert!(
            entries.iter().any(|e| e.mount_point == Path::new("/")),
            "{entries:?}"
        );
    }
}
