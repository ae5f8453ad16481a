//! `kiln mount` end to end: a real brick, a real FUSE mount, and real programs on it. Runs
//! as root (FUSE, `allow_other`, acting as other users).

mod common;
mod mount_common;

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use mount_common::{Mounted, is_kiln_mount, sh, sh_ok, text};

/// Long cache lifetimes: a correct answer must not depend on them running out.
const LONG_CACHES: &[&str] = &[
    "attr-timeout-ms=60000",
    "entry-timeout-ms=60000",
    "negative-timeout-ms=60000",
];

fn write(path: &Path, data: &[u8]) {
    fs::write(path, data).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

fn errno_of<T: std::fmt::Debug>(r: std::io::Result<T>) -> i32 {
    r.expect_err("should fail")
        .raw_os_error()
        .expect("an errno")
}

/// A python3 `script` run on `path` with its stdin and stdout piped, once it has printed its
/// first line (`said`, checked by the caller): a process that holds a file open or locked
/// while the test acts, until it is told to go on through its stdin.
fn python_holding(
    script: &str,
    path: &Path,
) -> (
    std::process::Child,
    std::io::BufReader<std::process::ChildStdout>,
    String,
) {
    let mut child = Command::new("python3")
        .args(["-c", script])
        .arg(path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut out = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    let mut said = String::new();
    std::io::BufRead::read_line(&mut out, &mut said).expect("the script's first line");
    (child, out, said)
}

/// `ls -l` asks every file for its security label and ACL: LOOKUP and READDIRP tell the mount
/// which of those a file lacks, so only the one file that has a label costs a round trip.
/// Without `selinux` a mount carries no labels, as GlusterFS's do not.
#[test]
fn ls_l_asks_the_brick_only_for_xattrs_that_exist() {
    let metrics = common::free_loopback_addr();
    let brick_args = ["--count-fop-hits", "--metrics-listen", &metrics];
    let mut m = Mounted::with_brick(&brick_args, &["selinux"]);
    fs::create_dir(m.path("walk")).expect("mkdir");
    for i in 0..30 {
        write(&m.path(&format!("walk/f{i}")), b"x");
    }
    let labelled = m.path("walk/f7");
    let label = b"system_u:object_r:kiln_test_t:s0\0";
    rustix::fs::setxattr(
        &labelled,
        "security.selinux",
        label,
        rustix::fs::XattrFlags::empty(),
    )
    .expect("label one file");
    // A new mount: nothing cached.
    m.unmount();
    m.mount(&["selinux"]);

    let before = common::scrape(&metrics);
    let listing = sh_ok(&m.mountpoint, "ls -l walk");
    let after = common::scrape(&metrics);
    assert_eq!(listing.lines().filter(|l| l.starts_with('-')).count(), 30);
    let served = |fop| common::fop_calls(&after, fop) - common::fop_calls(&before, fop);
    assert_eq!(served("LISTXATTR"), 0.0, "{listing}");
    assert_eq!(served("GETXATTR"), 1.0, "only the labelled file's label");
    assert_eq!(
        served("OPENDIR_LIST"),
        1.0,
        "the listing came with the open"
    );
    assert_eq!(served("OPENDIR") + served("READDIRP_XATTRS"), 0.0);

    // The absences told are right: the label reads back, an unlabelled file has none.
    let mut value = [0; 64];
    let n = rustix::fs::lgetxattr(&labelled, "security.selinux", &mut value).expect("label");
    assert_eq!(&value[..n], label);
    assert_eq!(
        rustix::fs::lgetxattr(m.path("walk/f8").as_path(), "security.selinux", &mut value),
        Err(rustix::io::Errno::NODATA)
    );

    // Mounted without `selinux`: no label is read, listed or written, and none reaches the
    // brick; the label kept there is untouched.
    m.unmount();
    m.mount(&[]);
    let before = common::scrape(&metrics);
    let listing = sh_ok(&m.mountpoint, "ls -l walk");
    assert_eq!(listing.lines().filter(|l| l.starts_with('-')).count(), 30);
    let unsupported = rustix::io::Errno::OPNOTSUPP;
    assert_eq!(
        rustix::fs::lgetxattr(&labelled, "security.selinux", &mut value),
        Err(unsupported)
    );
    let flags = rustix::fs::XattrFlags::empty();
    assert_eq!(
        rustix::fs::lsetxattr(&labelled, "security.selinux", label, flags),
        Err(unsupported)
    );
    assert_eq!(
        rustix::fs::lremovexattr(&labelled, "security.selinux"),
        Err(unsupported)
    );
    // Nor ACLs without `acl`.
    for acl in ["system.posix_acl_access", "system.posix_acl_default"] {
        let walk = m.path("walk");
        assert_eq!(
            rustix::fs::getxattr(&walk, acl, &mut value),
            Err(unsupported)
        );
        assert_eq!(
            rustix::fs::setxattr(&walk, acl, &posix_acl_granting_uid(1000), flags),
            Err(unsupported)
        );
    }
    let mut names = [0; 256];
    let n = rustix::fs::llistxattr(&labelled, &mut names).expect("listxattr");
    assert!(
        !names[..n]
            .split(|b| *b == 0)
            .any(|n| n == b"security.selinux"),
        "{:?}",
        String::from_utf8_lossy(&names[..n])
    );
    let after = common::scrape(&metrics);
    let served = |fop| common::fop_calls(&after, fop) - common::fop_calls(&before, fop);
    assert_eq!(
        served("GETXATTR") + served("SETXATTR") + served("REMOVEXATTR"),
        0.0
    );
    m.unmount();
    m.mount(&["selinux", "acl"]);
    let n = rustix::fs::lgetxattr(&labelled, "security.selinux", &mut value).expect("label");
    assert_eq!(&value[..n], label, "kept on the brick");
    let (acl, f9) = (posix_acl_granting_uid(1000), m.path("walk/f9"));
    rustix::fs::setxattr(&f9, "system.posix_acl_access", &acl, flags).expect("set an ACL");
    let n = rustix::fs::getxattr(&f9, "system.posix_acl_access", &mut value).expect("ACL");
    assert_eq!(&value[..n], acl);
}

/// A POSIX ACL xattr (version 2) giving the owner rw, uid `uid` r, the group and others
/// nothing.
fn posix_acl_granting_uid(uid: u32) -> Vec<u8> {
    const UNDEFINED_ID: u32 = u32::MAX;
    let entries = [
        (0x01_u16, 6_u16, UNDEFINED_ID), // the owner
        (0x02, 4, uid),                  // a named user
        (0x04, 0, UNDEFINED_ID),         // the owning group
        (0x10, 4, UNDEFINED_ID),         // the mask
        (0x20, 0, UNDEFINED_ID),         // others
    ];
    let mut acl = 2_u32.to_le_bytes().to_vec();
    for (tag, perm, id) in entries {
        acl.extend_from_slice(&tag.to_le_bytes());
        acl.extend_from_slice(&perm.to_le_bytes());
        acl.extend_from_slice(&id.to_le_bytes());
    }
    acl
}

/// Reading a small file whole costs one GET: no OPEN, READ or RELEASE reaches the brick, up
/// to 256 KiB. A larger one gets an fd at its first read past that.
#[test]
fn a_small_file_read_once_is_one_get() {
    let metrics = common::free_loopback_addr();
    let mut m = Mounted::with_brick(&["--count-fop-hits", "--metrics-listen", &metrics], &[]);
    fs::create_dir(m.path("small")).expect("mkdir");
    for i in 0..20 {
        write(
            &m.path(&format!("small/f{i}")),
            format!("file {i}\n").as_bytes(),
        );
    }
    let big: Vec<u8> = (0..3 << 20).map(|i: u32| i.to_le_bytes()[1]).collect();
    write(&m.path("big"), &big);
    let medium: Vec<u8> = (0..200 << 10)
        .map(|i: u32| i.to_le_bytes()[0] ^ 0x5a)
        .collect();
    write(&m.path("medium"), &medium);
    m.unmount();
    m.mount(&[]);

    let before = common::scrape(&metrics);
    let cat = sh_ok(&m.mountpoint, "cat small/*");
    let after = common::scrape(&metrics);
    let served = |fop| common::fop_calls(&after, fop) - common::fop_calls(&before, fop);
    assert_eq!(cat.lines().count(), 20, "{cat}");
    assert!(cat.contains("file 13\n"), "{cat}");
    assert_eq!(served("GET"), 20.0);
    assert_eq!(served("OPEN") + served("READ") + served("RELEASE"), 0.0);

    assert_eq!(fs::read(m.path("big")).expect("read big"), big);
    // Its fd is released in the background: wait for that before counting on.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut again = common::scrape(&metrics);
    while common::fop_calls(&again, "RELEASE") == common::fop_calls(&after, "RELEASE")
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(20));
        again = common::scrape(&metrics);
    }
    let served = |fop| common::fop_calls(&again, fop) - common::fop_calls(&after, fop);
    assert_eq!(
        (served("GET"), served("OPEN"), served("RELEASE")),
        (1.0, 1.0, 1.0)
    );
    assert!(served("READ") >= 1.0);

    // A file the kernel reads in several pieces, up to 256 KiB: its first GET fetched it all.
    assert_eq!(fs::read(m.path("medium")).expect("read medium"), medium);
    let last = common::scrape(&metrics);
    let served = |fop| common::fop_calls(&last, fop) - common::fop_calls(&again, fop);
    assert_eq!(served("GET"), 1.0);
    assert_eq!(served("OPEN") + served("READ") + served("RELEASE"), 0.0);
}

/// A mount's kernel reads 4 MiB ahead of a program reading a file in order, where FUSE starts
/// every mount at 128 KiB (one READ in flight); `read-ahead-kib` sets it, 0 leaves the
/// kernel's. A file read through it reads back whole.
#[test]
fn a_mount_reads_ahead_as_its_option_says() {
    let mut m = Mounted::new(&[]);
    assert_eq!(read_ahead_kib_becomes(&m.mountpoint, 4096), 4096);
    let big: Vec<u8> = (0..9 << 20).map(|i: u32| (i % 251) as u8).collect();
    write(&m.path("big"), &big);
    m.unmount();
    m.mount(&["read-ahead-kib=512"]);
    assert_eq!(read_ahead_kib_becomes(&m.mountpoint, 512), 512);
    assert!(fs::read(m.path("big")).expect("read big") == big);
    m.unmount();
    m.mount(&["read-ahead-kib=0"]);
    assert_eq!(read_ahead_kib_becomes(&m.mountpoint, 128), 128);
}

/// The read-ahead of the mount on `mountpoint` once it is `want` (it is set just after the
/// mount comes up), or after 5 s.
fn read_ahead_kib_becomes(mountpoint: &Path, want: u32) -> u32 {
    let dev = fs::metadata(mountpoint).expect("stat the mount").dev();
    let knob = format!(
        "/sys/class/bdi/{}:{}/read_ahead_kb",
        libc::major(dev),
        libc::minor(dev)
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let kib: u32 = fs::read_to_string(&knob)
            .expect("read_ahead_kb")
            .trim()
            .parse()
            .expect("a number");
        if kib == want || Instant::now() > deadline {
            return kib;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A small file the mount creates is put whole into the kernel's page cache at its close
/// (`FUSE_NOTIFY_STORE`): reading it back, as `tar -c` does after `tar -x`, reaches neither
/// the mount nor the brick, though its writes left pages only partly filled. What is read is
/// what was written, also after appends through later handles and with the cache dropped.
/// Without leases no name is known free, so every create goes to the brick at once, and the
/// same reads are right but reach the brick.
#[test]
fn a_new_small_file_is_read_back_from_the_page_cache() {
    new_small_files_are_read_back_from_the_page_cache(&[], true);
    new_small_files_are_read_back_from_the_page_cache(&["leases=off"], false);
}

fn new_small_files_are_read_back_from_the_page_cache(options: &[&str], from_cache: bool) {
    let metrics = common::free_loopback_addr();
    let m = Mounted::with_brick(&["--count-fop-hits", "--metrics-listen", &metrics], options);
    fs::create_dir(m.path("new")).expect("mkdir");
    let content = |i: usize| -> Vec<u8> {
        (0..3000 + 1000 * i)
            .map(|b| (b * 7 + i).to_le_bytes()[0])
            .collect()
    };
    let mtime = |i: usize| std::time::UNIX_EPOCH + Duration::from_secs(1_000_000_000 + i as u64);
    for i in 0..10 {
        let data = content(i);
        let mut f = fs::File::create(m.path(&format!("new/f{i}"))).expect("create");
        // Two writes that share a page, as tar's 10 KiB records do.
        let (head, tail) = data.split_at(1500);
        f.write_all(head).expect("write");
        f.write_all(tail).expect("write");
        f.set_modified(mtime(i)).expect("futimens");
    }
    let before = common::scrape(&metrics);
    for i in 0..10 {
        let path = m.path(&format!("new/f{i}"));
        assert_eq!(fs::read(&path).expect("read"), content(i), "f{i}");
        let meta = fs::metadata(&path).expect("stat");
        assert_eq!(meta.modified().expect("mtime"), mtime(i));
    }
    let after = common::scrape(&metrics);
    let served = |fop| common::fop_calls(&after, fop) - common::fop_calls(&before, fop);
    let served = served("GET") + served("OPEN") + served("READ");
    assert_eq!(
        served == 0.0,
        from_cache,
        "{served} reads served by the brick"
    );

    // Appends through new handles, each read back at once.
    let path = m.path("new/f0");
    let mut expected = content(0);
    for round in 0..3u8 {
        let mut f = fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .expect("open");
        let more = vec![b'a' + round; 777];
        f.write_all(&more).expect("append");
        expected.extend_from_slice(&more);
        drop(f);
        assert_eq!(fs::read(&path).expect("read"), expected, "round {round}");
    }
    // A file closed while a second handle is open on it, which writes on after the close.
    let mut first = fs::File::create(m.path("new/shared")).expect("create");
    first.write_all(b"first ").expect("write");
    let mut second = fs::OpenOptions::new()
        .write(true)
        .open(m.path("new/shared"))
        .expect("open");
    drop(first);
    second.seek(SeekFrom::Start(6)).expect("seek");
    second.write_all(b"second").expect("write");
    drop(second);
    assert_eq!(
        fs::read(m.path("new/shared")).expect("read"),
        b"first second"
    );

    fs::write("/proc/sys/vm/drop_caches", b"1").expect("drop caches");
    assert_eq!(fs::read(&path).expect("read from the brick"), expected);
    for i in 1..10 {
        let path = m.path(&format!("new/f{i}"));
        assert_eq!(fs::read(&path).expect("read from the brick"), content(i));
    }
}

#[test]
fn files_directories_and_links_behave_like_a_local_file_system() {
    let m = Mounted::new(&[]);
    let f = m.path("f");
    write(&f, b"hello");
    assert_eq!(fs::read(&f).expect("read"), b"hello");
    assert_eq!(fs::read(m.on_brick("f")).expect("on the brick"), b"hello");
    let mut append = fs::OpenOptions::new().append(true).open(&f).expect("open");
    append.write_all(b", world").expect("append");
    drop(append);
    assert_eq!(fs::read(&f).expect("read"), b"hello, world");

    // Directories.
    fs::create_dir(m.path("d")).expect("mkdir");
    write(&m.path("d/inner"), b"x");
    assert_eq!(errno_of(fs::remove_dir(m.path("d"))), libc::ENOTEMPTY);
    assert_eq!(errno_of(fs::create_dir(m.path("d"))), libc::EEXIST);
    assert_eq!(
        errno_of(fs::File::create_new(m.path("d/inner"))),
        libc::EEXIST
    );
    let long = "n".repeat(256);
    assert_eq!(errno_of(fs::write(m.path(&long), b"")), libc::ENAMETOOLONG);
    let mut names: Vec<String> = fs::read_dir(m.mountpoint.clone())
        .expect("readdir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["d", "f"], ".glusterfs stays hidden");

    // Symbolic and hard links.
    std::os::unix::fs::symlink("f", m.path("s")).expect("symlink");
    assert_eq!(
        fs::read_link(m.path("s")).expect("readlink"),
        Path::new("f")
    );
    assert_eq!(
        fs::read(m.path("s")).expect("through the link"),
        b"hello, world"
    );
    fs::hard_link(&f, m.path("h")).expect("link");
    let (a, b) = (
        fs::metadata(&f).expect("stat"),
        fs::metadata(m.path("h")).expect("stat"),
    );
    assert_eq!(a.ino(), b.ino(), "hard links share an inode number");
    assert_eq!((a.nlink(), b.nlink()), (2, 2));

    // Renames: plain, RENAME_NOREPLACE, RENAME_EXCHANGE.
    fs::rename(m.path("h"), m.path("h2")).expect("rename");
    write(&m.path("other"), b"other");
    let at = |p: &str| m.path(p);
    let noreplace = rustix::fs::renameat_with(
        rustix::fs::CWD,
        at("h2").as_path(),
        rustix::fs::CWD,
        at("other").as_path(),
        rustix::fs::RenameFlags::NOREPLACE,
    );
    assert_eq!(noreplace, Err(rustix::io::Errno::EXIST));
    rustix::fs::renameat_with(
        rustix::fs::CWD,
        at("h2").as_path(),
        rustix::fs::CWD,
        at("other").as_path(),
        rustix::fs::RenameFlags::EXCHANGE,
    )
    .expect("exchange");
    assert_eq!(fs::read(m.path("h2")).expect("read"), b"other");
    assert_eq!(fs::read(m.path("other")).expect("read"), b"hello, world");

    // Unlinked while open: still readable and writable through the fd.
    let mut open = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.path("h2"))
        .expect("open");
    fs::remove_file(m.path("h2")).expect("unlink");
    assert_eq!(open.metadata().expect("fstat").nlink(), 0);
    open.write_all(b"!").expect("write after unlink");
    let mut back = String::new();
    open.seek(SeekFrom::Start(0)).expect("seek");
    open.read_to_string(&mut back).expect("read after unlink");
    assert_eq!(back, "!ther");

    // A FIFO, and the file system's numbers.
    rustix::fs::mknodat(
        rustix::fs::CWD,
        m.path("fifo").as_path(),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .expect("mkfifo");
    assert!(
        fs::symlink_metadata(m.path("fifo"))
            .expect("stat")
            .file_type()
            .is_fifo_like()
    );
    let st = rustix::fs::statfs(m.mountpoint.as_path()).expect("statfs");
    assert!(st.f_blocks > 0 && st.f_bsize > 0);
}

/// `.` and `..` come first in every listing, as a local file system lists them, and a
/// listing goes on from any offset it gave (`seekdir` to a `telldir`), on one brick and
/// over three (whose listings number their own offsets).
#[test]
fn listings_show_the_dot_entries_first_and_go_on_from_any_offset() {
    for m in [Mounted::new(&[]), Mounted::distributed(3, &[])] {
        let dir = m.path("many");
        fs::create_dir(&dir).expect("mkdir");
        for i in 0..300 {
            write(
                &m.path(&format!("many/a-rather-long-file-name-{i:04}")),
                b"",
            );
        }
        let fd = open_dir(&dir);
        let all = entries_from(&fd, 0);
        let names: Vec<&str> = all.iter().map(|(name, ..)| name.as_str()).collect();
        assert_eq!(names[..2], [".", ".."]);
        let ino = fs::metadata(&dir).expect("stat").ino();
        assert_eq!(all[0].1, ino, "`.` is the directory itself");
        let mut files = names[2..].to_vec();
        files.sort_unstable();
        files.dedup();
        assert_eq!((files.len(), names.len()), (300, 302), "each file once");
        // Forwards first: distribution's offsets hold until a listing from the start (of
        // which `..` and the entry after it are, for the layers below the mount).
        for i in [3, 150, all.len() - 1, all.len(), 2, 1] {
            let (from, rest) = (all[i - 1].2, &all[i..]);
            let listed = entries_from(&fd, from);
            assert_eq!(named(&listed), named(rest), "the listing after entry {i}");
        }
        assert_eq!(
            named(&entries_from(&fd, 0)),
            named(&all),
            "from the start again"
        );

        let root = open_dir(&m.mountpoint);
        let root_ino = fs::metadata(&m.mountpoint).expect("stat").ino();
        let dots: Vec<_> = entries_from(&root, 0)
            .into_iter()
            .take(2)
            .map(|(name, ino, _)| (name, ino))
            .collect();
        assert_eq!(
            dots,
            [(".".to_owned(), root_ino), ("..".to_owned(), root_ino)],
            "the root is its own parent"
        );
    }
}

/// Directory `dir`, open for `getdents64`.
fn open_dir(dir: &Path) -> rustix::fd::OwnedFd {
    let flags = rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY;
    rustix::fs::open(dir, flags, rustix::fs::Mode::empty()).expect("open the directory")
}

/// The entries of open directory `fd` from its offset `from`, read 1 KiB at a time (many
/// `getdents64` calls): name, inode number, the offset after it.
fn entries_from(fd: &rustix::fd::OwnedFd, from: u64) -> Vec<(String, u64, u64)> {
    rustix::fs::seek(fd, rustix::fs::SeekFrom::Start(from)).expect("seekdir");
    let mut buf = vec![std::mem::MaybeUninit::uninit(); 1024];
    let mut raw = rustix::fs::RawDir::new(fd, &mut buf);
    let mut out = Vec::new();
    while let Some(entry) = raw.next() {
        let entry = entry.expect("getdents64");
        let name = entry.file_name().to_string_lossy().into_owned();
        out.push((name, entry.ino(), entry.next_entry_cookie()));
    }
    out
}

/// The names and inode numbers of listed `entries`.
fn named(entries: &[(String, u64, u64)]) -> Vec<(&str, u64)> {
    entries
        .iter()
        .map(|(name, ino, _)| (name.as_str(), *ino))
        .collect()
}

/// `is_fifo` without importing the extension trait under another name.
trait FifoLike {
    fn is_fifo_like(&self) -> bool;
}
impl FifoLike for fs::FileType {
    fn is_fifo_like(&self) -> bool {
        std::os::unix::fs::FileTypeExt::is_fifo(self)
    }
}

#[test]
fn attributes_xattrs_and_sparse_files() {
    let m = Mounted::new(&[]);
    let f = m.path("f");
    write(&f, &[7; 10_000]);
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&f)
        .expect("open");

    // chmod, chown, truncate.
    fs::set_permissions(&f, fs::Permissions::from_mode(0o640)).expect("chmod");
    std::os::unix::fs::chown(&f, Some(1234), Some(4321)).expect("chown");
    file.set_len(100).expect("ftruncate");
    let meta = fs::metadata(&f).expect("stat");
    assert_eq!(meta.mode() & 0o7777, 0o640);
    assert_eq!((meta.uid(), meta.gid(), meta.len()), (1234, 4321, 100));
    let on_brick = fs::metadata(m.on_brick("f")).expect("brick stat");
    assert_eq!((on_brick.uid(), on_brick.len()), (1234, 100));

    // utimensat: an explicit mtime with UTIME_OMIT for atime, then UTIME_NOW.
    let before = fs::metadata(&f).expect("stat");
    let times = rustix::fs::Timestamps {
        last_access: rustix::fs::Timespec {
            tv_sec: 0,
            tv_nsec: rustix::fs::UTIME_OMIT,
        },
        last_modification: rustix::fs::Timespec {
            tv_sec: 1_000_000_000,
            tv_nsec: 5,
        },
    };
    rustix::fs::utimensat(
        rustix::fs::CWD,
        f.as_path(),
        &times,
        rustix::fs::AtFlags::empty(),
    )
    .expect("utimensat");
    let after = fs::metadata(&f).expect("stat");
    assert_eq!((after.mtime(), after.mtime_nsec()), (1_000_000_000, 5));
    assert_eq!(
        (after.atime(), after.atime_nsec()),
        (before.atime(), before.atime_nsec()),
        "UTIME_OMIT keeps atime"
    );
    let now = rustix::fs::Timestamps {
        last_access: rustix::fs::Timespec {
            tv_sec: 0,
            tv_nsec: rustix::fs::UTIME_NOW,
        },
        last_modification: rustix::fs::Timespec {
            tv_sec: 0,
            tv_nsec: rustix::fs::UTIME_NOW,
        },
    };
    rustix::fs::utimensat(
        rustix::fs::CWD,
        f.as_path(),
        &now,
        rustix::fs::AtFlags::empty(),
    )
    .expect("utimensat now");
    assert!(fs::metadata(&f).expect("stat").mtime() > 1_000_000_000);

    // Extended attributes.
    rustix::fs::setxattr(
        f.as_path(),
        "user.colour",
        b"blue",
        rustix::fs::XattrFlags::CREATE,
    )
    .expect("setxattr");
    assert_eq!(
        rustix::fs::setxattr(
            f.as_path(),
            "user.colour",
            b"red",
            rustix::fs::XattrFlags::CREATE
        ),
        Err(rustix::io::Errno::EXIST)
    );
    let mut value = [0; 16];
    let n = rustix::fs::getxattr(f.as_path(), "user.colour", &mut value).expect("getxattr");
    assert_eq!(&value[..n], b"blue");
    let mut list = [0; 256];
    let n = rustix::fs::listxattr(f.as_path(), &mut list).expect("listxattr");
    assert!(
        list[..n]
            .split(|&b| b == 0)
            .any(|name| name == b"user.colour")
    );
    rustix::fs::removexattr(f.as_path(), "user.colour").expect("removexattr");
    assert_eq!(
        rustix::fs::getxattr(f.as_path(), "user.colour", &mut value),
        Err(rustix::io::Errno::NODATA)
    );

    // fallocate, a punched hole, SEEK_DATA / SEEK_HOLE.
    let sparse = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(m.path("sparse"))
        .expect("create");
    rustix::fs::fallocate(&sparse, rustix::fs::FallocateFlags::empty(), 0, 1 << 20)
        .expect("fallocate");
    assert_eq!(sparse.metadata().expect("fstat").len(), 1 << 20);
    let data = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(m.path("holes"))
        .expect("create");
    (&data).write_all(&[1; 3 * 65536]).expect("write");
    data.sync_all().expect("fsync");
    rustix::fs::fallocate(
        &data,
        rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
        65536,
        65536,
    )
    .expect("punch a hole");
    assert_eq!(
        data.metadata().expect("fstat").len(),
        3 * 65536,
        "size kept"
    );
    let hole = rustix::fs::seek(&data, rustix::fs::SeekFrom::Hole(0)).expect("SEEK_HOLE");
    assert_eq!(hole, 65536);
    let next = rustix::fs::seek(&data, rustix::fs::SeekFrom::Data(65536)).expect("SEEK_DATA");
    assert_eq!(next, 131072);
    let mut middle = vec![9; 16];
    rustix::io::pread(&data, &mut middle, 70_000).expect("pread");
    assert_eq!(middle, [0; 16], "the hole reads as zeros");
    // Every zeroing mode ext4 has works, with or without keeping the size, inside the file
    // and past its end: a program that probes one mode and uses another does not break.
    let zero = rustix::fs::FallocateFlags::ZERO_RANGE;
    let keep = rustix::fs::FallocateFlags::KEEP_SIZE;
    rustix::fs::fallocate(&data, zero | keep, 0, 4096).expect("ZERO_RANGE|KEEP_SIZE inside");
    rustix::fs::fallocate(&data, zero | keep, 3 * 65536, 65536).expect("… past the end");
    assert_eq!(
        data.metadata().expect("fstat").len(),
        3 * 65536,
        "size kept"
    );
    let mut head = vec![9; 4097];
    rustix::io::pread(&data, &mut head, 0).expect("pread");
    assert_eq!(
        (&head[..4096], head[4096]),
        (&[0u8; 4096][..], 1),
        "only the range zeroed"
    );
    rustix::fs::fallocate(&data, zero, 3 * 65536, 4096).expect("ZERO_RANGE past the end");
    assert_eq!(
        data.metadata().expect("fstat").len(),
        3 * 65536 + 4096,
        "size grown"
    );
    assert_eq!(
        rustix::fs::fallocate(&data, rustix::fs::FallocateFlags::PUNCH_HOLE, 0, 4096),
        Err(rustix::io::Errno::OPNOTSUPP),
        "a hole punched without KEEP_SIZE is refused, as Linux does"
    );

    // O_DIRECT bypasses the page cache; any buffer will do.
    let mut direct = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_DIRECT)
        .open(m.path("direct"))
        .expect("open O_DIRECT");
    direct.write_all(&[5; 3000]).expect("direct write");
    direct.seek(SeekFrom::Start(0)).expect("seek");
    let mut back = Vec::new();
    direct.read_to_end(&mut back).expect("direct read");
    assert_eq!(back, [5; 3000]);
}

#[test]
fn small_files_created_write_only_reach_the_brick_at_close() {
    let m = Mounted::new(LONG_CACHES);
    // Created, written, given mode, owner and times, closed: one PUT at the close (sent
    // behind the root's write lease; `on_brick` waits for it).
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(m.path("small"))
        .expect("create");
    f.write_all(b"deferred").expect("write");
    f.set_permissions(fs::Permissions::from_mode(0o600))
        .expect("fchmod");
    std::os::unix::fs::fchown(&f, Some(42), Some(43)).expect("fchown");
    f.set_modified(std::time::UNIX_EPOCH + Duration::from_secs(1_000_000_000))
        .expect("futimens");
    // Seen by a listing before the close.
    let listed: Vec<_> = fs::read_dir(&m.mountpoint)
        .expect("readdir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert!(listed.iter().any(|n| n == "small"), "{listed:?}");
    drop(f);
    let meta = fs::metadata(m.on_brick("small")).expect("on the brick");
    assert_eq!(fs::read(m.on_brick("small")).expect("read"), b"deferred");
    assert_eq!(
        (meta.mode() & 0o7777, meta.uid(), meta.gid(), meta.mtime()),
        (0o600, 42, 43, 1_000_000_000)
    );

    // A duplicate of the create's fd outlives the close that sent the PUT, and an unlink
    // after it: the mount gives it a brick fd before the unlink, not at every close.
    let mut first = fs::File::create(m.path("dup")).expect("create");
    first.write_all(b"one").expect("write");
    let mut second = first.try_clone().expect("dup");
    drop(first);
    assert_eq!(fs::read(m.on_brick("dup")).expect("on the brick"), b"one");
    fs::remove_file(m.path("dup")).expect("unlink");
    second.write_all(b" two").expect("write after the unlink");
    assert_eq!(second.metadata().expect("fstat").len(), 7);
    drop(second);

    // A read-only open is made on the brick at first use; an unlink in between gives it
    // its brick fd first, so the open file still reads (from the brick: caches dropped).
    fs::write(m.path("lazy"), b"read me later").expect("write");
    let mut lazy = fs::File::open(m.path("lazy")).expect("open");
    fs::remove_file(m.path("lazy")).expect("unlink");
    fs::write("/proc/sys/vm/drop_caches", b"1").expect("drop caches");
    let mut later = String::new();
    lazy.read_to_string(&mut later)
        .expect("read after the unlink");
    assert_eq!(later, "read me later");
    drop(lazy);

    // Truncating creates, a stat before the close, and files past the deferred limit.
    for len in [0, 10, 300 * 1024, 2 << 20] {
        let name = format!("sized-{len}");
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let mut f = fs::File::create(m.path(&name)).expect("create");
        f.write_all(&data).expect("write");
        assert_eq!(fs::metadata(m.path(&name)).expect("stat").len(), len as u64);
        drop(f);
        assert_eq!(
            fs::read(m.on_brick(&name)).expect("on the brick"),
            data,
            "{len}"
        );
    }

    // Unlinked before its close: the fd still works.
    let mut f = fs::File::create_new(m.path("gone")).expect("create");
    f.write_all(b"x").expect("write");
    fs::remove_file(m.path("gone")).expect("unlink");
    f.write_all(b"y").expect("write after unlink");
    drop(f);
    assert_eq!(errno_of(fs::metadata(m.path("gone"))), libc::ENOENT);
}

/// Another client writes the name of a file still open after its create, in a directory
/// the mount made (`kiln put`: a create, else a truncating open), then the file is written
/// once more and closed. Under the directory's write lease the create was deferred, and the
/// recall sends it first: the other client rewrites that file, and the last write lands in
/// it. Without leases the create is never deferred (no name is known free): it made the file
/// at once, and both writes, gathered behind, land at the close, after the other client's.
/// Either way the close succeeds.
#[test]
fn a_deferred_create_raced_by_another_client() {
    raced_create(&[], "closed", b"theimore");
    raced_create(&["leases=off"], "closed", b"minemore");
}

fn raced_create(options: &[&str], closed: &str, on_brick: &[u8]) {
    let m = Mounted::new(options);
    fs::create_dir(m.path("d")).expect("mkdir");
    let (mut writer, mut out, mut line) = python_holding(
        "import os,sys\n\
         fd=os.open(sys.argv[1], os.O_WRONLY|os.O_CREAT|os.O_EXCL, 0o644)\n\
         os.write(fd, b'mine'); print('open', flush=True); sys.stdin.readline()\n\
         os.write(fd, b'more')\n\
         try:\n    os.close(fd); print('closed')\n\
         except OSError as e:\n    print('errno', e.errno)",
        &m.path("d/raced"),
    );
    assert_eq!(line.trim(), "open");
    let local = m.cluster.dir.path().join("raced.txt");
    write(&local, b"theirs");
    let put = m
        .kiln()
        .args(["--brick-addr", &m.addr(), "put"])
        .arg(&local)
        .arg("/d/raced")
        .output()
        .expect("kiln put");
    assert!(put.status.success(), "{}", text(&put));
    writer
        .stdin
        .take()
        .expect("stdin")
        .write_all(b"go\n")
        .expect("go");
    line.clear();
    std::io::BufRead::read_line(&mut out, &mut line).expect("writer");
    assert_eq!(line.trim(), closed);
    writer.wait().expect("writer exits");
    assert_eq!(fs::read(m.on_brick("d/raced")).expect("brick"), on_brick);
}

#[test]
fn cached_attributes_follow_links_renames_and_setattr() {
    // Caches that never expire during the test: every answer below comes from precise
    // invalidation, not from a timeout.
    let m = Mounted::new(LONG_CACHES);
    let f = m.path("f");
    write(&f, b"data");
    let first = fs::metadata(&f).expect("stat");
    assert_eq!(first.nlink(), 1);
    std::thread::sleep(Duration::from_millis(20));

    // A new name: both names show two links and the new ctime.
    fs::hard_link(&f, m.path("g")).expect("link");
    let (a, b) = (
        fs::metadata(&f).expect("stat"),
        fs::metadata(m.path("g")).expect("stat"),
    );
    assert_eq!((a.nlink(), b.nlink()), (2, 2));
    assert!(a.ctime_nsec() != first.ctime_nsec() || a.ctime() != first.ctime());

    // One name goes: the other shows one link.
    fs::remove_file(m.path("g")).expect("unlink");
    assert_eq!(fs::metadata(&f).expect("stat").nlink(), 1);

    // Rename over a file that is open: the replaced file has no links left.
    write(&m.path("victim"), b"old");
    let victim = fs::File::open(m.path("victim")).expect("open");
    fs::rename(&f, m.path("victim")).expect("rename over");
    assert_eq!(victim.metadata().expect("fstat").nlink(), 0);
    assert_eq!(fs::read(m.path("victim")).expect("read"), b"data");
    assert_eq!(errno_of(fs::metadata(&f)), libc::ENOENT);

    // chmod and a write through another path are seen at once.
    fs::set_permissions(m.path("victim"), fs::Permissions::from_mode(0o600)).expect("chmod");
    assert_eq!(
        fs::metadata(m.path("victim")).expect("stat").mode() & 0o777,
        0o600
    );
    fs::OpenOptions::new()
        .append(true)
        .open(m.path("victim"))
        .expect("open")
        .write_all(b"+more")
        .expect("append");
    assert_eq!(fs::metadata(m.path("victim")).expect("stat").len(), 9);

    // A negative entry is replaced by this mount's own create; a directory's link count
    // follows its subdirectories.
    assert_eq!(errno_of(fs::metadata(m.path("later"))), libc::ENOENT);
    write(&m.path("later"), b"now");
    assert_eq!(fs::read(m.path("later")).expect("read"), b"now");
    fs::create_dir(m.path("p")).expect("mkdir");
    let before = fs::metadata(m.path("p")).expect("stat").nlink();
    fs::create_dir(m.path("p/q")).expect("mkdir");
    assert_eq!(fs::metadata(m.path("p")).expect("stat").nlink(), before + 1);
    fs::remove_dir(m.path("p/q")).expect("rmdir");
    assert_eq!(fs::metadata(m.path("p")).expect("stat").nlink(), before);

    // The kernel forgets inodes under memory pressure; lookups come back and still work.
    fs::write("/proc/sys/vm/drop_caches", b"2").expect("drop caches");
    assert_eq!(fs::read(m.path("victim")).expect("read"), b"data+more");
}

#[test]
fn another_clients_changes_show_once_the_timeouts_pass() {
    let m = Mounted::new(&[
        "attr-timeout-ms=200",
        "entry-timeout-ms=200",
        "negative-timeout-ms=200",
    ]);
    assert_eq!(errno_of(fs::metadata(m.path("theirs"))), libc::ENOENT);
    let local = m.cluster.dir.path().join("theirs.txt");
    write(&local, b"from another client");
    let out = m
        .kiln()
        .args(["--brick-addr", &m.addr(), "put"])
        .arg(&local)
        .arg("/theirs")
        .output()
        .expect("kiln put");
    assert!(out.status.success(), "{}", text(&out));
    let deadline = Instant::now() + Duration::from_secs(5);
    while fs::metadata(m.path("theirs")).is_err() {
        assert!(
            Instant::now() < deadline,
            "the other client's file never showed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        fs::read(m.path("theirs")).expect("read"),
        b"from another client"
    );
}

/// Runs `script` with `sh -c` as uid/gid 65534 (`nobody`) with extra groups `groups`.
fn as_nobody(dir: &Path, groups: &str, script: &str) -> std::process::Output {
    let mut command = Command::new("setpriv");
    command.args(["--reuid=65534", "--regid=65534"]);
    match groups {
        "" => command.arg("--clear-groups"),
        g => command.arg(format!("--groups={g}")),
    };
    command
        .args(["sh", "-c", script])
        .current_dir(dir)
        .output()
        .expect("setpriv")
}

#[test]
fn permissions_are_checked_as_the_caller() {
    let m = Mounted::new(&[]);
    let root_dir = m.path("root-only");
    fs::create_dir(&root_dir).expect("mkdir");
    fs::set_permissions(&root_dir, fs::Permissions::from_mode(0o755)).expect("chmod");
    let denied = as_nobody(&m.mountpoint, "", "echo x > root-only/mine");
    assert!(!denied.status.success(), "{}", text(&denied));
    assert!(
        text(&denied).contains("Permission denied"),
        "{}",
        text(&denied)
    );

    let open_dir = m.path("open");
    fs::create_dir(&open_dir).expect("mkdir");
    fs::set_permissions(&open_dir, fs::Permissions::from_mode(0o777)).expect("chmod");
    let made = as_nobody(&m.mountpoint, "", "echo x > open/mine && mkdir open/sub");
    assert!(made.status.success(), "{}", text(&made));
    let brick_meta = fs::metadata(m.on_brick("open/mine")).expect("on the brick");
    assert_eq!((brick_meta.uid(), brick_meta.gid()), (65534, 65534));

    // A group-readable file: readable through a supplementary group, not without it.
    let secret = m.path("open/group-secret");
    write(&secret, b"for group 4242");
    std::os::unix::fs::chown(&secret, Some(0), Some(4242)).expect("chown");
    fs::set_permissions(&secret, fs::Permissions::from_mode(0o640)).expect("chmod");
    let without = as_nobody(&m.mountpoint, "", "cat open/group-secret");
    assert!(!without.status.success(), "{}", text(&without));
    let with = as_nobody(&m.mountpoint, "4242", "cat open/group-secret");
    assert!(with.status.success(), "{}", text(&with));
    assert_eq!(with.stdout, b"for group 4242");
}

/// New files in a held directory are written past the kernel's page cache, which then
/// leaves the set-ID bits to the mount: a write by a caller without `CAP_FSETID` drops
/// set-user-ID, and set-group-ID where group execute is set, as on a local disk.
#[test]
fn a_write_without_cap_fsetid_drops_the_set_id_bits() {
    let m = Mounted::new(&[]);
    let dir = m.path("setid");
    fs::create_dir(&dir).expect("mkdir");
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).expect("chmod");
    let write_new = "import os\n\
        def make(name, mode):\n    \
            fd = os.open('setid/' + name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)\n    \
            os.fchmod(fd, mode)\n    \
            os.write(fd, b'x' * 5000)\n    \
            os.close(fd)\n\
        make('u', 0o4755); make('gx', 0o6775); make('g', 0o2745)";
    let out = as_nobody(&m.mountpoint, "", &format!("python3 -c \"{write_new}\""));
    assert!(out.status.success(), "{}", text(&out));
    // Root keeps them.
    let root_file = m.path("setid/root");
    write(&root_file, b"");
    fs::set_permissions(&root_file, fs::Permissions::from_mode(0o4755)).expect("chmod");
    write(&root_file, b"by root");
    let expected = [("u", 0o755), ("gx", 0o775), ("g", 0o2745), ("root", 0o4755)];
    for (name, mode) in expected {
        let rel = format!("setid/{name}");
        let seen = fs::metadata(m.path(&rel)).expect("stat").mode() & 0o7777;
        assert_eq!(seen, mode, "{rel} through the mount: {seen:o}");
        let stored = fs::metadata(m.on_brick(&rel)).expect("on brick").mode() & 0o7777;
        assert_eq!(stored, mode, "{rel} on the brick: {stored:o}");
    }
}

#[test]
fn posix_locks_exclude_other_processes_until_close() {
    let m = Mounted::new(&[]);
    write(&m.path("lockfile"), b"");
    // A holder takes a write lock and keeps it until its stdin closes.
    let (mut holder, _, line) = python_holding(
        "import fcntl,sys; f=open(sys.argv[1],'r+'); fcntl.lockf(f, fcntl.LOCK_EX); \
         print('locked', flush=True); sys.stdin.read()",
        &m.path("lockfile"),
    );
    assert_eq!(line.trim(), "locked");
    let try_lock =
        "import fcntl,sys; f=open(sys.argv[1],'r+'); fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)";
    let busy = Command::new("python3")
        .args(["-c", try_lock])
        .arg(m.path("lockfile"))
        .output()
        .expect("python3");
    assert!(
        !busy.status.success(),
        "the second lock must fail while held"
    );
    drop(holder.stdin.take());
    holder.wait().expect("holder exits");
    let free = Command::new("python3")
        .args(["-c", try_lock])
        .arg(m.path("lockfile"))
        .output()
        .expect("python3");
    assert!(free.status.success(), "{}", text(&free));
}

/// Read-only handles close without a FLUSH (`FOPEN_NOFLUSH`); a lock taken through one still
/// goes when it is closed, although the same process keeps the file open for writing through
/// another handle (so the brick still has the file open for this mount).
#[test]
fn a_lock_taken_through_a_read_only_handle_goes_with_its_close() {
    let m = Mounted::new(&[]);
    write(&m.path("shared"), b"shared data");
    let (mut holder, mut said, mut line) = python_holding(
        "import fcntl,sys; keep=open(sys.argv[1],'r+'); \
         locked=open(sys.argv[1]); fcntl.lockf(locked, fcntl.LOCK_SH); \
         print('locked', flush=True); sys.stdin.readline(); locked.close(); \
         print('closed', flush=True); sys.stdin.read()",
        &m.path("shared"),
    );
    assert_eq!(line.trim(), "locked");
    // The release that drops the lock follows the close asynchronously: a few tries.
    let try_lock = "import fcntl,sys,time\n\
         f=open(sys.argv[1],'r+')\n\
         for _ in range(int(sys.argv[2])):\n\
         \x20   try:\n\
         \x20       fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB); sys.exit(0)\n\
         \x20   except OSError:\n\
         \x20       time.sleep(0.02)\n\
         sys.exit(1)";
    let lock_with_tries = |tries: &str| {
        Command::new("python3")
            .args(["-c", try_lock])
            .arg(m.path("shared"))
            .arg(tries)
            .output()
            .expect("python3")
    };
    let busy = lock_with_tries("1");
    assert!(
        !busy.status.success(),
        "the read lock must exclude a writer"
    );
    let mut stdin = holder.stdin.take().expect("stdin");
    stdin.write_all(b"close\n").expect("tell the holder");
    line.clear();
    std::io::BufRead::read_line(&mut said, &mut line).expect("holder");
    assert_eq!(line.trim(), "closed");
    let free = lock_with_tries("100");
    assert!(free.status.success(), "{}", text(&free));
    drop(stdin);
    holder.wait().expect("holder exits");
}

/// An open file whose last name is gone is still the file: fchmod, fsetxattr, fgetxattr and
/// fremovexattr act on it (the brick answers them through its fd, not by GFID).
#[test]
fn fd_calls_reach_an_open_file_after_its_last_name_is_gone() {
    let m = Mounted::new(&[]);
    let script = "import os,sys\n\
        fd=os.open(sys.argv[1], os.O_RDWR|os.O_CREAT, 0o644)\n\
        os.write(fd, b'data')\n\
        os.fsync(fd)\n\
        os.unlink(sys.argv[1])\n\
        os.fchmod(fd, 0o600)\n\
        assert os.fstat(fd).st_mode & 0o777 == 0o600, oct(os.fstat(fd).st_mode)\n\
        os.setxattr(fd, 'user.k', b'v')\n\
        assert os.getxattr(fd, 'user.k') == b'v'\n\
        os.removexattr(fd, 'user.k')\n\
        try:\n\
        \x20   os.getxattr(fd, 'user.k'); sys.exit('user.k is still there')\n\
        except OSError as e:\n\
        \x20   assert e.errno == 61, e\n\
        os.ftruncate(fd, 2)\n\
        assert os.pread(fd, 10, 0) == b'da'\n\
        print('ok')";
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(m.path("doomed"))
        .output()
        .expect("python3");
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok");
    assert!(!m.on_brick("doomed").exists());
}

#[test]
fn a_running_program_is_never_truncated_under_it() {
    let m = Mounted::new(&[]);
    let program = fs::read("/usr/bin/sleep").expect("sleep");
    let path = m.path("sleep");
    fs::write(&path, &program).expect("copy");
    fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).expect("chmod");
    let mut running = Command::new(&path)
        .arg("30")
        .spawn()
        .expect("run from the mount");
    // The kernel checks ETXTBSY only after a truncating open reached the file system.
    for (what, options) in [
        ("O_WRONLY", fs::OpenOptions::new().write(true).clone()),
        (
            "O_RDONLY|O_TRUNC",
            fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_TRUNC)
                .clone(),
        ),
    ] {
        let err = options.open(&path).expect_err(what);
        assert_eq!(err.raw_os_error(), Some(libc::ETXTBSY), "{what}: {err}");
    }
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        running.try_wait().expect("wait").is_none(),
        "the program died"
    );
    running.kill().expect("kill");
    running.wait().expect("wait");
    assert_eq!(
        fs::read(m.on_brick("sleep")).expect("on the brick"),
        program
    );
}

#[test]
fn pjdfstest_passes_with_caches_on() {
    let m = Mounted::new(&[]);
    mount_common::pjdfstest_passes(&m);
}

#[test]
fn fsx_finds_no_corruption_with_or_without_the_writeback_cache() {
    for (writeback, seed) in [("off", 1), ("on", 2)] {
        let m = Mounted::new(&[&format!("writeback-cache={writeback}")]);
        mount_common::fsx_passes(&m.path("fsx.dat"), 5000, seed);
    }
    // In a directory the mount made: a deferred create, then writes gathered behind.
    let m = Mounted::new(&[]);
    fs::create_dir(m.path("made")).expect("mkdir");
    mount_common::fsx_passes(&m.path("made/fsx.dat"), 5000, 3);
    // Without leases no file is described by the mount: write-behind alone gathers.
    let m = Mounted::new(&["leases=off"]);
    mount_common::fsx_passes(&m.path("fsx.dat"), 5000, 4);
}

/// A new file written past what its deferred create gathers, then closed (the kernel sends
/// no FLUSH for a deferred create: its writes go at the release, after `close` returned)
/// and opened again reads back what was written at once, from four processes at a time:
/// a read never overtakes writes the mount still holds for the file.
#[test]
fn a_file_written_and_closed_reads_back_at_once() {
    let m = Mounted::new(&[]);
    let script = r#"
import os, sys
d = sys.argv[1]
os.mkdir(d)
offset = 2**30 + 1
for i in range(100):
    p = os.path.join(d, "f%d" % i)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.pwrite(fd, b"data", offset)
    size = os.lstat(p).st_size
    os.close(fd)
    fd = os.open(p, os.O_RDONLY)
    got = os.pread(fd, 4, offset)
    os.close(fd)
    if size != offset + 4 or got != b"data":
        sys.exit("%s: size %d, read %r" % (p, size, got))
    os.unlink(p)
"#;
    let writers: Vec<_> = (0..4)
        .map(|t| {
            Command::new("python3")
                .args(["-c", script])
                .arg(m.path(&format!("t{t}")))
                .stderr(Stdio::piped())
                .spawn()
                .expect("python3 runs")
        })
        .collect();
    for writer in writers {
        let out = writer.wait_with_output().expect("python3 ends");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Writes a tree of `files` small files (sizes 0 to 8 KiB, 50 per directory) under `root`.
fn small_file_tree(root: &Path, files: usize) {
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = || common::xorshift(&mut state);
    for i in 0..files {
        let dir = root.join(format!("d{:03}/e{:02}", i / 500, (i / 50) % 10));
        if i % 50 == 0 {
            fs::create_dir_all(&dir).expect("mkdir");
        }
        let len = usize::try_from(next() % 8192).expect("small");
        let byte = u8::try_from(i % 251).expect("small");
        write(&dir.join(format!("f{i}")), &vec![byte; len]);
    }
}

#[test]
fn tar_git_and_rsync_work_on_the_mount() {
    let m = Mounted::new(&[]);
    let scratch = tempfile::tempdir().expect("tempdir");
    let source = scratch.path().join("tree");
    small_file_tree(&source, 20_000);
    let tarball = scratch.path().join("tree.tar");
    sh_ok(
        scratch.path(),
        &format!("tar -C {} -cf {} .", source.display(), tarball.display()),
    );

    // tar extracts 20 000 small files; diff finds every byte and name.
    fs::create_dir(m.path("untar")).expect("mkdir");
    let started = Instant::now();
    sh_ok(
        &m.mountpoint,
        &format!("tar -C untar -xf {}", tarball.display()),
    );
    println!("untar of 20000 files: {:?}", started.elapsed());
    sh_ok(
        &m.mountpoint,
        &format!("diff -r {} untar", source.display()),
    );

    // git: a repository, a commit, and a full consistency check (of 500 of the files).
    sh_ok(
        &m.mountpoint,
        "mkdir repo && cd repo && git init -q && cp -r ../untar/d000 . && \
         git add -A && git -c user.name=k -c user.email=k@example.invalid commit -qm one && \
         git fsck --full --strict && git status --porcelain | wc -l | grep -qx 0",
    );

    // rsync in and out again (1000 of the files), preserving modes, times and links.
    let back = scratch.path().join("back");
    sh_ok(
        &m.mountpoint,
        &format!(
            "ln -s e01 {src}/link && rsync -a {src}/ rsynced/ && rsync -a rsynced/ {back}/ && \
             diff -r {src} {back} && test -L {back}/link",
            src = source.join("d001").display(),
            back = back.display()
        ),
    );

    // rm -rf of everything leaves the brick empty (but for its own .glusterfs) once the
    // removals sent behind are on it (an fsync of the directory waits for them).
    sh_ok(&m.mountpoint, "rm -rf untar repo rsynced");
    fs::File::open(&m.mountpoint)
        .and_then(|root| root.sync_all())
        .expect("removals sent");
    let left: Vec<_> = fs::read_dir(&m.cluster.brick)
        .expect("brick")
        .map(|e| e.expect("entry").file_name())
        .filter(|n| n != ".glusterfs")
        .collect();
    assert!(left.is_empty(), "left on the brick: {left:?}");
}

#[test]
fn a_brick_restart_fails_calls_with_eio_then_new_ones_work() {
    let mut m = Mounted::new(&["attr-timeout-ms=0", "entry-timeout-ms=0"]);
    write(&m.path("kept"), b"durable");
    let addr = m.addr();
    m.brickd.take().expect("brick").kill9();
    let down = fs::read(m.path("kept"));
    assert_eq!(
        errno_of(down),
        libc::EIO,
        "a call with no brick fails with EIO"
    );
    m.brickd = Some(m.cluster.start(&addr, &[]));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match fs::read(m.path("kept")) {
            Ok(data) => {
                assert_eq!(data, b"durable");
                break;
            }
            Err(e) => assert!(Instant::now() < deadline, "still failing: {e}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    write(&m.path("new"), b"after the restart");
    assert_eq!(
        fs::read(m.on_brick("new")).expect("on the brick"),
        b"after the restart"
    );
}

#[test]
fn bad_mounts_fail_with_a_clear_message() {
    let m = Mounted::new(&[]);
    let elsewhere = m.cluster.dir.path().join("elsewhere");
    fs::create_dir(&elsewhere).expect("mkdir");
    let run = |args: &[&str], mountpoint: &Path| {
        m.kiln()
            .arg("mount")
            .arg(m.addr())
            .arg(mountpoint)
            .arg("-f")
            .args(args)
            .output()
            .expect("kiln mount")
    };
    let cases: [(&[&str], &Path, &str); 4] = [
        (&[], m.mountpoint.as_path(), "already a Kiln mount"),
        (
            &[],
            &m.cluster.dir.path().join("missing"),
            "No such file or directory",
        ),
        (
            &["-o", "colour=blue"],
            &elsewhere,
            "unknown mount option 'colour'",
        ),
        (&["-o", "client=mallory"], &elsewhere, "client-mallory.crt"),
    ];
    for (args, mountpoint, message) in cases {
        let out = run(args, mountpoint);
        assert!(!out.status.success(), "{args:?} mounted");
        assert!(text(&out).contains(message), "{args:?}: {}", text(&out));
        assert!(!is_kiln_mount(&elsewhere));
    }

    // A certificate from another CA: the brick refuses it during the handshake.
    let rogue = m.cluster.dir.path().join("rogue-tls");
    kiln_admin::pki::init_ca(&rogue).expect("ca");
    kiln_admin::pki::issue(&rogue, &kiln_admin::pki::Role::Client, "alice", 1).expect("cert");
    let out = Command::new(common::bin("kiln"))
        .arg("--tls-dir")
        .arg(&rogue)
        .args(["--client", "alice", "mount", &m.addr()])
        .arg(&elsewhere)
        .arg("-f")
        .output()
        .expect("kiln mount");
    assert!(!out.status.success());
    assert!(text(&out).contains("cannot mount"), "{}", text(&out));
    assert!(!is_kiln_mount(&elsewhere));
}

/// Held by the test that makes a mount namespace, and by the one that needs `kiln umount` to
/// wait: a namespace made beside it would copy that test's mount too, and `kiln umount` rightly
/// does not wait for a mount another namespace still has.
static NAMESPACE_COPIES: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `kiln umount` returns only once the mount's process has sent what it answered itself and
/// exited. The process is stopped (SIGSTOP) right after files are made under its write
/// lease: the unmount itself needs nothing of it, and `kiln umount` must then wait for it to
/// be let go, send the files and exit; when it returns every file is on the brick.
#[test]
fn umount_waits_until_the_mounts_process_has_sent_everything_and_exited() {
    use rustix::process::Signal;
    let _alone = NAMESPACE_COPIES.lock().unwrap_or_else(|p| p.into_inner());
    let mut m = Mounted::new(&[]);
    fs::create_dir(m.path("d")).expect("mkdir");
    for i in 0..20 {
        fs::write(m.path(&format!("d/f{i}")), format!("file {i}")).expect("write");
    }
    let server = i32::try_from(m.server.as_ref().expect("server").id()).expect("pid");
    common::signal(server, Signal::STOP);
    let mountpoint = m.mountpoint.clone();
    let umount = std::thread::spawn(move || common::kiln_umount(&mountpoint));
    std::thread::sleep(Duration::from_secs(1));
    let returned_early = umount.is_finished();
    common::signal(server, Signal::CONT);
    assert!(
        !returned_early,
        "kiln umount returned before the mount's process was done"
    );
    let out = umount.join().expect("kiln umount thread");
    assert!(out.status.success(), "umount: {}", text(&out));
    for i in 0..20 {
        let on_brick = m.cluster.brick.join(format!("d/f{i}"));
        let content = fs::read_to_string(&on_brick)
            .unwrap_or_else(|e| panic!("d/f{i} on the brick: {e}; kiln umount: {}", text(&out)));
        assert_eq!(content, format!("file {i}"));
    }
    m.wait_server_exit();
}

/// A mount namespace made while the volume is mounted (`unshare -m`, as `ip netns exec` and
/// services with private mounts do) keeps a copy of the mount, which the mount's process goes
/// on serving: `kiln umount` then unmounts here, says so, and does not wait; the process ends
/// when the last copy goes.
#[test]
fn umount_does_not_wait_for_a_copy_of_the_mount_in_another_namespace() {
    let _alone = NAMESPACE_COPIES.lock().unwrap_or_else(|p| p.into_inner());
    let mut m = Mounted::new(&[]);
    fs::write(m.path("f"), b"seen from the copy").expect("write");
    let mut copy = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sleep", "60"])
        .spawn()
        .expect("unshare");
    // The namespace exists once `unshare` has execed `sleep`.
    let deadline = Instant::now() + Duration::from_secs(10);
    let pid = copy.id();
    while fs::read_to_string(format!("/proc/{pid}/comm")).map_or(true, |c| c.trim() != "sleep") {
        assert!(Instant::now() < deadline, "unshare did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    let started = Instant::now();
    let out = common::kiln_umount(&m.mountpoint);
    assert!(out.status.success(), "umount: {}", text(&out));
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "kiln umount waited {:?}",
        started.elapsed()
    );
    assert!(
        text(&out).contains("still mounted in the mount namespace of process"),
        "{}",
        text(&out)
    );
    assert!(!is_kiln_mount(&m.mountpoint));
    let mut server = m.server.take().expect("server");
    assert!(
        server.try_wait().expect("wait").is_none(),
        "it serves the copy"
    );
    copy.kill().expect("kill the namespace's process");
    copy.wait().expect("reaped");
    m.server = Some(server);
    m.wait_server_exit();
}

#[test]
fn unmounting_a_busy_mount_is_refused_and_sigterm_waits_for_open_files() {
    let mut m = Mounted::new(&[]);
    let mut open = fs::File::create(m.path("busy")).expect("create");
    let refused = m
        .kiln()
        .arg("umount")
        .arg(&m.mountpoint)
        .output()
        .expect("kiln umount");
    assert!(!refused.status.success());
    assert!(
        text(&refused).contains("target is busy"),
        "{}",
        text(&refused)
    );

    // SIGTERM detaches the mount at once; the open file still works until it is closed,
    // and then the server exits 0.
    let pid = rustix::process::Pid::from_raw(
        i32::try_from(m.server.as_ref().expect("server").id()).expect("pid"),
    )
    .expect("pid");
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).expect("kill");
    m.wait_mounted(false);
    open.write_all(b"written after the detach").expect("write");
    open.sync_all().expect("fsync");
    drop(open);
    m.wait_server_exit();
    assert_eq!(
        fs::read(m.on_brick("busy")).expect("on the brick"),
        b"written after the detach"
    );
}

#[test]
fn background_mounts_and_the_mount_helper() {
    let mut m = Mounted::new(&[]);
    m.unmount();
    assert!(!is_kiln_mount(&m.mountpoint));

    // `mount.kiln` is what mount(8) runs for `-t kiln` (and for /etc/fstab lines).
    let helper_dir = m.cluster.dir.path().join("sbin");
    fs::create_dir(&helper_dir).expect("mkdir");
    let helper = helper_dir.join("mount.kiln");
    std::os::unix::fs::symlink(common::bin("kiln"), &helper).expect("symlink");
    let log = m.cluster.dir.path().join("helper.log");
    let options = format!(
        "rw,_netdev,tls-dir={},client=alice,log-file={},attr-timeout-ms=500",
        m.cluster.tls.display(),
        log.display()
    );
    let out = Command::new(&helper)
        .arg(m.addr())
        .arg(&m.mountpoint)
        .args(["-o", &options])
        .output()
        .expect("mount.kiln");
    assert!(out.status.success(), "mount.kiln: {}", text(&out));
    assert!(
        is_kiln_mount(&m.mountpoint),
        "the helper returns once mounted"
    );
    write(&m.path("via-helper"), b"ok");
    assert_eq!(fs::read(m.on_brick("via-helper")).expect("brick"), b"ok");

    // The system's umount ends it; the background server then exits.
    let out = sh(
        &m.mountpoint.join(".."),
        &format!("umount {}", m.mountpoint.display()),
    );
    assert!(out.status.success(), "umount: {}", text(&out));
    let deadline = Instant::now() + Duration::from_secs(30);
    while is_kiln_mount(&m.mountpoint) {
        assert!(Instant::now() < deadline, "still mounted");
        std::thread::sleep(Duration::from_millis(20));
    }
    let bad = Command::new(&helper)
        .arg(m.addr())
        .arg(&m.mountpoint)
        .args(["-o", "bogus-option"])
        .output()
        .expect("mount.kiln");
    assert!(!bad.status.success());
    assert!(
        text(&bad).contains("unknown mount option 'bogus-option'"),
        "{}",
        text(&bad)
    );
}

/// A file is no terminal: the ioctl stdio asks of every file it opens (`TCGETS`, through
/// `isatty`) is answered ENOTTY, as a local file system answers it, and leaves the mount's
/// log quiet.
#[test]
fn a_file_is_no_terminal_and_its_ioctls_log_nothing() {
    let m = Mounted::new(&[]);
    write(&m.path("f"), b"text");
    let script = "import errno, fcntl, sys, termios\n\
                  f = open(sys.argv[1])\n\
                  print(f.isatty(), f.read())\n\
                  try:\n    fcntl.ioctl(f.fileno(), termios.TCGETS, bytes(64))\n\
                  except OSError as e:\n    print(errno.errorcode[e.errno])";
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(m.path("f"))
        .output()
        .expect("python3");
    assert_eq!(text(&out).trim(), "False text\nENOTTY");
    assert!(!m.logs().contains("ioctl"), "{}", m.logs());
}

/// Two processes' worth of namespace changes (files and directories made, renamed across two
/// directories, removed) racing listings of those directories, for a few seconds: everything
/// ends. The kernel sends a FORGET as a request of its own, from inside a READDIRPLUS, for an
/// entry it cannot link (one a rename moved meanwhile); over io_uring such a request holds
/// its queue entry until the mount commits it, and the listing waited for that forever
/// (within seconds of this churn, before the mount committed requests that take no reply).
/// A run that does not end in a minute aborts the mount's connection and fails.
#[test]
fn listings_racing_renames_never_hang_the_mount() {
    const CHURN: Duration = Duration::from_secs(6);
    let m = Mounted::new(&[]);
    let root = m.path("churn");
    for dir in ["d0", "d1"] {
        fs::create_dir_all(root.join(dir)).expect("mkdir");
    }
    let (done, finished) = std::sync::mpsc::channel();
    for seed in [1u64, 2] {
        let (root, done) = (root.clone(), done.clone());
        std::thread::spawn(move || {
            let ops = churn(&root, seed, CHURN);
            let _ = done.send(ops);
        });
    }
    let mut ops = 0;
    for _ in 0..2 {
        match finished.recv_timeout(CHURN + Duration::from_secs(60)) {
            Ok(n) => ops += n,
            Err(_) => {
                abort_fuse_connection(&m.mountpoint);
                panic!("a racing listing or change never ended: the mount hung");
            }
        }
    }
    assert!(ops > 1_000, "only {ops} operations ran");
}

/// A file opened for reading stays readable while another process removes or replaces its
/// name, as on a local file system: one thread replaces (`rename` over) and removes names
/// while another opens and reads them, for a few seconds, and no read of a file that opened
/// fails. A read-only handle takes its brick fd at its first read, so a removal gives the
/// handles in its way their fds first, and a handle opened while a removal is under way
/// (until the brick has answered it, queued behind under a lease too) takes its fd at once
/// (before, 4 of 31 000 and 9 of 38 000 reads failed, ESTALE, in two runs).
#[test]
fn files_open_for_reading_outlive_removals_by_another_process() {
    const RACE: Duration = Duration::from_secs(5);
    let m = Mounted::new(&[]);
    let dir = m.path("d");
    fs::create_dir(&dir).expect("mkdir");
    let end = Instant::now() + RACE;
    let changer = {
        let dir = dir.clone();
        std::thread::spawn(move || {
            for i in 0.. {
                if Instant::now() > end {
                    break;
                }
                // A change a millisecond: the names exist most of the time.
                std::thread::sleep(Duration::from_millis(1));
                let name = dir.join(format!("n{}", i % 8));
                match i % 3 {
                    2 => _ = fs::remove_file(&name),
                    _ => {
                        let new = dir.join(format!("new{}", i % 8));
                        fs::write(&new, format!("version {i}")).expect("write");
                        fs::rename(&new, &name).expect("rename over");
                    }
                }
            }
        })
    };
    let (mut reads, mut failed) = (0, Vec::new());
    for i in 0.. {
        if Instant::now() > end {
            break;
        }
        let Ok(mut file) = fs::File::open(dir.join(format!("n{}", i % 8))) else {
            continue;
        };
        let mut data = String::new();
        match file.read_to_string(&mut data) {
            Ok(_) => reads += 1,
            Err(e) => failed.push(e),
        }
    }
    changer.join().expect("the changing thread");
    assert!(
        failed.is_empty(),
        "{} of {reads} reads failed: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    assert!(reads > 100, "only {reads} reads");
}

/// Random namespace changes and listings under `root` (its directories `d0` and `d1`, names
/// `n0`..`n11` in each and in `root`) for `time`, ignoring the errors a race gives; how many
/// ran.
fn churn(root: &Path, seed: u64, time: Duration) -> usize {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    };
    let end = Instant::now() + time;
    let mut ops = 0;
    while Instant::now() < end {
        let dirs = ["", "d0", "d1"];
        let op = next(6);
        let mut pick = || {
            root.join(dirs[next(3) as usize])
                .join(format!("n{}", next(12)))
        };
        let _ = match op {
            0 => fs::write(pick(), b"x").map(drop),
            1 => fs::create_dir(pick()),
            2 => fs::rename(pick(), pick()),
            3 => fs::remove_file(pick()),
            4 => fs::remove_dir(pick()),
            _ => {
                let dir = pick().parent().expect("a parent").to_owned();
                fs::read_dir(dir).map(|entries| entries.for_each(drop))
            }
        };
        ops += 1;
    }
    ops
}

/// Aborts the FUSE connection of the mount at `mountpoint` (`fusectl`'s `abort`), so that
/// whatever waits on it ends.
fn abort_fuse_connection(mountpoint: &Path) {
    let connections = Path::new("/sys/fs/fuse/connections");
    if fs::read_dir(connections).is_ok_and(|mut d| d.next().is_none()) {
        let _ = Command::new("mount")
            .args(["-t", "fusectl", "none"])
            .arg(connections)
            .status();
    }
    // The connection is named by the minor number of the mount's device.
    let dev = fs::metadata(mountpoint).map(|m| m.dev()).unwrap_or(0);
    let minor = (dev & 0xff) | ((dev >> 12) & 0xfff00);
    let _ = fs::write(connections.join(minor.to_string()).join("abort"), b"1");
}

/// Whether the kernel offers FUSE over io_uring: Linux 6.14+ built with it (the `fuse`
/// module has an `enable_uring` switch) and the switch on. `scripts/test` turns it on and sets
/// `KILN_REQUIRE_FUSE_URING=1`, so a kernel that has the switch must have it on.
fn fuse_uring_offered() -> bool {
    match fs::read_to_string("/sys/module/fuse/parameters/enable_uring") {
        Ok(switch) => {
            let on = switch.trim() == "Y";
            assert!(
                on || std::env::var("KILN_REQUIRE_FUSE_URING").as_deref() != Ok("1"),
                "FUSE over io_uring is off: echo Y > /sys/module/fuse/parameters/enable_uring"
            );
            on
        }
        Err(_) => false,
    }
}

/// The names of the threads of process `pid`, with the CPU time (ticks) each used.
fn threads_of(pid: i32) -> Vec<(String, u64)> {
    let tasks = fs::read_dir(format!("/proc/{pid}/task")).expect("tasks");
    tasks
        .map(|t| {
            let dir = t.expect("task").path();
            let name = fs::read_to_string(dir.join("comm")).expect("comm");
            let stat = fs::read_to_string(dir.join("stat")).expect("stat");
            let fields: Vec<&str> = stat.rsplit_once(')').expect("stat").1.split(' ').collect();
            // utime and stime: fields 14 and 15 of stat, 13 and 14 after the name.
            let cpu = fields[12].parse::<u64>().expect("utime")
                + fields[13].parse::<u64>().expect("stime");
            (name.trim().to_owned(), cpu)
        })
        .collect()
}

/// Where the kernel offers it, the mount takes requests through io_uring: one queue per CPU,
/// each a thread that serves them (the device reader is left only FORGETs and INTERRUPTs),
/// and real programs work through it. `fuse-uring=off`, or a kernel without it, keeps the
/// mount on `/dev/fuse`, and the mount says which.
#[test]
fn requests_come_through_io_uring_where_the_kernel_offers_it() {
    let offered = fuse_uring_offered();
    let cpus = fs::read_to_string("/sys/devices/system/cpu/possible").expect("cpus");
    let cpus = 1 + cpus
        .trim()
        .rsplit(['-', ','])
        .next()
        .expect("last")
        .parse::<usize>()
        .expect("n");
    let scratch = tempfile::tempdir().expect("tempdir");
    let source = scratch.path().join("tree");
    small_file_tree(&source, 2_000);
    for options in [&[][..], &["fuse-uring=off"]] {
        let m = Mounted::new(options);
        sh_ok(
            &m.mountpoint,
            &format!(
                "cp -a {} copy && diff -r {} copy && ls -lR copy > /dev/null && rm -rf copy",
                source.display(),
                source.display()
            ),
        );
        let threads = threads_of(m.pid());
        let rings: Vec<_> = threads
            .iter()
            .filter(|(n, _)| n.starts_with("fuser-ring-"))
            .collect();
        let logs = m.logs();
        if offered && options.is_empty() {
            assert!(logs.contains("requests come through io_uring"), "{logs}");
            assert_eq!(
                rings.len(),
                cpus,
                "one queue per CPU, each alive: {threads:?}"
            );
            let device = threads
                .iter()
                .find(|(n, _)| n == "fuser-0")
                .expect("device reader");
            let ring_cpu: u64 = rings.iter().map(|(_, cpu)| cpu).sum();
            assert!(
                ring_cpu > device.1,
                "the queues served the requests, not the device reader: {threads:?}"
            );
        } else {
            assert!(rings.is_empty(), "{options:?}: {threads:?}");
            assert_eq!(
                logs.contains("FUSE over io_uring is not offered"),
                options.is_empty(),
                "{logs}"
            );
        }
    }
}

/// With `connections=3` the mount reaches the brick over three connections, and a large
/// file's reads and writes are spread over them: the brick holds the file open on each
/// session while a reader has it open, and what is read is what was written.
#[test]
fn a_mount_spreads_large_files_over_its_connections() {
    let mut m = Mounted::new(&["connections=3"]);
    let big: Vec<u8> = (0..9 << 20).map(|i: u32| (i % 253) as u8).collect();
    write(&m.path("big"), &big);
    // The kernel keeps the pages it wrote: read from a fresh mount, the reads reach the brick.
    m.unmount();
    m.mount(&["connections=3"]);
    let mut reader = fs::File::open(m.path("big")).expect("open big");
    let mut read = Vec::new();
    reader.read_to_end(&mut read).expect("read big");
    assert!(read == big, "the file reads back as written");
    let brickd = m.brickd.as_ref().expect("the brick");
    let file = fs::metadata(m.on_brick("big")).expect("big on the brick");
    let open_on_brick = fs::read_dir(format!("/proc/{}/fd", brickd.pid()))
        .expect("the brick's fds")
        .filter_map(Result::ok)
        .filter_map(|fd| fs::metadata(fd.path()).ok())
        .filter(|f| (f.dev(), f.ino()) == (file.dev(), file.ino()))
        .count();
    assert!(
        open_on_brick >= 3,
        "the open file is held by {open_on_brick} brick descriptors, not one per connection"
    );
    drop(reader);
}
