//! A distributed GlusterFS volume checked against Kiln's DHT and served by Kiln in place, and
//! a Kiln volume served by GlusterFS in place.
//!
//! A real three-brick GlusterFS 10 volume gets files through two FUSE mounts — one client in
//! the C.UTF-8 locale, one in the C locale, which GlusterFS's rsync rewrite tells apart — with
//! varied names (rsync temporary names, UTF-8, invalid UTF-8, long) and content derived from
//! each path, subdirectories, renames and a hard link to names hashed elsewhere (GlusterFS
//! leaves link files), a renamed directory and user xattrs. Every name must be on the brick
//! that the layouts read back from the bricks' `trusted.glusterfs.dht` and Kiln's hash say
//! it belongs on, and the layouts must be the ones `Layout::new_directory` builds.
//!
//! Then GlusterFS lets go of the bricks (unmount, `volume stop`, `volume delete`) and each
//! brick directory is served as it is by `kiln-brickd`, in the volume's brick order. Through
//! `Distribute` every directory lists what the GlusterFS mount listed, every file reads back
//! by name with its content (through link files too), the xattrs read back, and no file on
//! any brick got another inode, size or mtime: nothing was copied. Files Kiln then writes
//! land on the brick GlusterFS's layout hashes them to, and `kiln-brickd check` finds every
//! brick clean.
//!
//! The other way round, a three-brick Kiln volume gets directories, files of several sizes, a
//! rename and a hard link to names hashed to other bricks (Kiln leaves link files), symlinks
//! and user xattrs through `Distribute`; then GlusterFS serves the same brick directories, in
//! Kiln's brick order and under the volume name Kiln's link files use, and its FUSE mount must
//! list every directory, read every file by every name with its content and the mtime Kiln
//! reported, resolve the symlinks and read the xattrs, rewriting no layout. GlusterFS then
//! writes files of its own (keeping their times in `trusted.glusterfs.mdata`, as it does for
//! the directories it looks up), `kiln-brickd format` adopts the bricks back (removing that
//! xattr), Kiln changes files, and GlusterFS serving the bricks once more must show Kiln's
//! content and mtimes — and, for a control file whose mdata was put back, the stale mtime.
//!
//! Needs root and Debian's `glusterfs-server` (`glusterd`, `gluster`, `glusterfs`,
//! `mount.glusterfs`). Without them each test says why and passes — or fails, when
//! `KILN_REQUIRE_GLUSTERFS=1`. Each starts `glusterd -N` if none runs (and stops it after),
//! uses one that runs (and leaves it running), and always stops and deletes its volume,
//! unmounts and removes its directories (a guard's `Drop`). Every command is bounded. The
//! tests take turns with glusterd.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, PoisonError, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use bytes::Bytes;
use common::{Brickd, Cluster, xorshift};
use kiln_client::distribute::{
    COMMIT_HASH_INVALID, DiskLayout, Distribute, LINKTO_XATTR, Layout, Munging, XATTR_NAME,
    first_brick, name_hash, size_chunks, weights_for,
};
use kiln_client::path::new_gfid;
use kiln_client::{BrickClient, Layer, LayerExt, Paths};
use kiln_wire::{
    AccessMode, Creds, DirEntryPlus, ErrorCode, FileType, FopReply, FopRequest, Gfid, Name,
    OpenFlags, RenameMode, SymlinkTarget, XattrName, XattrSetMode, XattrValue,
};
use rustix::fs::XattrFlags;
use rustix::process::{Pid, Signal};

/// Longest `gluster` CLI command (its own `--timeout` is a little shorter).
const GLUSTER_TIMEOUT: Duration = Duration::from_secs(40);
const GLUSTER_CLI_TIMEOUT_S: u64 = 30;
/// How long glusterd may take to answer, and the bricks to come online.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest mount or unmount.
const MOUNT_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest run of file system calls through a mount (creating every file, say).
const CREATE_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest time Kiln may take to read the volume back and write to it.
const KILN_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a process may take to go after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);
const POLL_INTERVAL: Duration = Duration::from_millis(100);
/// Bricks in the volume.
const BRICKS: usize = 3;
/// Seed of the generated names and contents (fixed: a failure replays).
const NAMES_SEED: u64 = 0x6b69_6c6e_6468_7431;
/// A file holds its path and up to this many bytes more.
const CONTENT_EXTRA_BYTES_MAX: usize = 4096;
/// The one big file: more than two of Kiln's 1 MiB reads.
const BIG_FILE_BYTES: usize = (5 << 19) + 123;
/// Bytes asked for per READ through Kiln.
const READ_CHUNK_BYTES: u32 = 1 << 20;
/// New names tried for a rename to another brick (each misses with chance 1/3).
const NAME_TRIES: usize = 64;
/// The user xattr set through GlusterFS and read through Kiln.
const USER_XATTR: &str = "user.kiln-note";
/// An rsync temporary name and its final name: both hash as `rsync-final.txt`.
const RSYNC_TEMP: &[u8] = b".rsync-final.txt.Ab12Cd";
const RSYNC_FINAL: &[u8] = b"rsync-final.txt";
/// Renames and a hard link through GlusterFS to a name hashed to another brick than the one
/// holding the data, so GlusterFS leaves a link file there.
const MOVES: [MoveSpec; 5] = [
    MoveSpec::rename(b"README.md", b"", b"renamed-readme-"),
    MoveSpec::rename("café".as_bytes(), b"", "renamed-café-".as_bytes()),
    MoveSpec::rename(b".a\xff.b", b"", b"renamed-\xff-"),
    MoveSpec::rename("naïve.txt".as_bytes(), b"docs", b"moved-in-"),
    MoveSpec {
        hard_link: true,
        ..MoveSpec::rename(b"hello world", b"", b"hard-link-")
    },
];
/// The directory Kiln makes, and the files it writes: (directory, name). One is an rsync
/// temporary name, one is not UTF-8.
const KILN_DIR: &[u8] = b"kiln-made/deeper";
const KILN_WRITES: [(&[u8], &[u8]); 5] = [
    (b"", b"kiln-root.txt"),
    (b"", b".kiln-root.txt.Zq12Xy"),
    (b"", b"kiln-\xff-bytes"),
    (KILN_DIR, b"a.txt"),
    (KILN_DIR, "日本語-kiln".as_bytes()),
];

/// What the Kiln-to-GlusterFS test makes through Kiln: directories, files of several sizes
/// (empty, small, around Kiln's 1 MiB I/O unit and over it; by path), a rename and a hard
/// link to a name hashed to another brick (Kiln leaves link files), symlinks (by path, with
/// their targets) and user xattrs on a file and a directory.
const MADE_DIRS: [&str; 3] = ["data", "data/deep", "data/deep/er"];
const MADE_FILES: [(&str, usize); 11] = [
    ("empty", 0),
    ("one-byte", 1),
    ("small.txt", 100),
    ("page.bin", 4096),
    ("to-rename.txt", 777),
    ("hard-source.bin", 2048),
    ("big.bin", (3 << 20) + 123),
    ("data/notes.txt", 300),
    ("data/odd.bin", 65_537),
    ("data/deep/mib.bin", 1 << 20),
    ("data/deep/er/over-a-mib.bin", (1 << 20) + 7),
];
const MADE_MOVES: [MoveSpec; 2] = [
    MoveSpec::rename(b"to-rename.txt", b"data", b"renamed-"),
    MoveSpec {
        hard_link: true,
        ..MoveSpec::rename(b"hard-source.bin", b"data/deep", b"hard-link-")
    },
];
const MADE_SYMLINKS: [(&str, &str); 3] = [
    ("data/notes-link", "notes.txt"),
    ("to-big", "big.bin"),
    ("data/deep/up", "../../small.txt"),
];
const MADE_XATTRS: [(&str, &[u8]); 2] = [
    ("data/notes.txt", b"set through Kiln on a file"),
    ("data", b"set through Kiln on a directory"),
];
/// Files GlusterFS writes on the bricks Kiln made (GlusterFS 10 keeps their times in
/// [`MDATA_XATTR`]), by path, and their sizes. Kiln changes the first after adopting the
/// bricks back; [`CONTROL`] too, with its mdata put back as if it had not been adopted.
const GLUSTERFS_WRITES: [(&str, usize); 2] =
    [("glusterfs-made.txt", 1000), ("glusterfs-control.txt", 500)];
const CONTROL: &str = "glusterfs-control.txt";
/// The file Kiln made that it changes after adopting the bricks back, and the name it adds.
const KILN_CHANGES: &str = "small.txt";
const KILN_ADDS: &str = "data/deep/added-by-kiln.txt";
/// Where GlusterFS 10 keeps an object's times (its ctime feature).
const MDATA_XATTR: &str = "trusted.glusterfs.mdata";

#[test]
fn a_glusterfs_volume_is_served_by_kiln_in_place() -> anyhow::Result<()> {
    let Some(_glusterd) = glusterfs_for_this_test()? else {
        return Ok(());
    };
    let started = Instant::now();
    let mut gluster = Gluster::set_up()?;
    let utf8 = gluster.mount("C.UTF-8", Munging::RsyncUtf8)?;
    let c = gluster.mount("C", Munging::RsyncBytes)?;

    let clients = (utf8.clone(), c);
    let tree = through_mount("creating files", move || populate(&clients.0, &clients.1))?;
    let moves = plan_moves(&tree, &gluster.layouts(&tree)?)?;
    let (client, planned) = (utf8.clone(), moves.clone());
    let tree = through_mount("renaming", move || rearrange(&client, tree, &planned))?;
    for m in &moves {
        gluster.check_link_file(m)?;
    }
    let layouts = gluster.layouts(&tree)?;
    gluster.check_rsync_rename(layouts.get(&b""[..]).context("the root's layout")?)?;
    let placed = gluster.check_tree_placement(&tree, &layouts)?;
    let (tree, listed) = through_mount("listing", move || {
        let listed = list(&utf8, &tree)?;
        Ok((tree, listed))
    })?;
    check_listings(&tree, &listed)?;
    let before = brick_files(&gluster.bricks)?;
    let glusterfs_s = started.elapsed().as_secs_f64();

    // GlusterFS lets go: nothing of it runs on or knows about the bricks from here on.
    gluster.tear_down()?;
    gluster.check_bricks_kept()?;
    let kiln = serve_with_kiln(&gluster, &tree, &listed)?;
    let unchanged = check_unchanged(&before, &brick_files(&gluster.bricks)?)?;

    eprintln!(
        "{}: {placed} names where Kiln predicts; link files left by GlusterFS for {}; \
         through Kiln: {} files read back, {} directories listed, {} xattrs, {} files \
         written where the layout hashes them; {unchanged} files on the bricks unchanged; \
         C-locale names Kiln hashes elsewhere: {:?}; {glusterfs_s:.1} s with GlusterFS, \
         {:.1} s in all",
        gluster.volume,
        moves
            .iter()
            .map(Move::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        kiln.files,
        kiln.dirs,
        kiln.xattrs,
        kiln.written,
        kiln.c_locale,
        started.elapsed().as_secs_f64(),
    );
    Ok(())
}

#[test]
fn a_kiln_volume_is_served_by_glusterfs_in_place() -> anyhow::Result<()> {
    let Some(_glusterd) = glusterfs_for_this_test()? else {
        return Ok(());
    };
    let started = Instant::now();
    let mut gluster = Gluster::new(format!("kilnrev{}", std::process::id()))?;
    let bricks = gluster.bricks.clone();
    for brick in &bricks {
        let formatted = gluster.kiln_format(brick)?;
        ensure!(formatted.contains("formatted"), "{formatted}");
    }
    let cluster = Cluster::new();
    let made = with_kiln(&cluster, &bricks, &gluster.volume, async |volume| {
        fill_through_kiln(volume, &bricks).await
    })?;
    for m in &made.moves {
        gluster.check_link_file(m)?;
    }
    let layouts = dir_layouts(&bricks, &made);
    let kiln_s = started.elapsed().as_secs_f64();

    // GlusterFS serves the bricks Kiln let go of, as they are.
    gluster.serve()?;
    let client = gluster.mount("C.UTF-8", Munging::RsyncUtf8)?;
    let (mount, expected) = (client.clone(), made.clone());
    let seen = through_mount("reading what Kiln made", move || {
        check_through_glusterfs(&mount, &expected)
    })?;
    let mount = client.clone();
    let glusterfs_made = through_mount("writing through GlusterFS", move || {
        write_through_glusterfs(&mount)
    })?;
    gluster.tear_down()?;
    let relaid = relaid_dirs(&layouts, &dir_layouts(&bricks, &made));
    ensure!(
        relaid.is_empty(),
        "GlusterFS rewrote the layouts Kiln wrote: {relaid:?}"
    );
    let glusterfs_s = started.elapsed().as_secs_f64() - kiln_s;

    // Kiln adopts the bricks back and changes files; GlusterFS then shows the new times.
    let round_trip = mdata_round_trip(&mut gluster, &cluster, &made, &glusterfs_made)?;
    eprintln!(
        "{}: written through Kiln: {} files, {} directories, {} symlinks, {} hard link, {} \
         xattrs, link files for {}; GlusterFS read back {seen}; {round_trip}; {kiln_s:.1} s \
         with Kiln, {glusterfs_s:.1} s with GlusterFS, {:.1} s in all",
        gluster.volume,
        made.files.len(),
        made.dirs.len(),
        made.symlinks.len(),
        made.hard_links.len(),
        made.xattrs.len(),
        made.moves
            .iter()
            .map(Move::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        started.elapsed().as_secs_f64(),
    );
    Ok(())
}

/// GlusterFS for one test at a time (the tests of this file run on parallel threads, and each
/// may start and stop glusterd), or None when it cannot run here and the test passes without
/// it, having said why. With `KILN_REQUIRE_GLUSTERFS=1` that is a failure instead.
fn glusterfs_for_this_test() -> anyhow::Result<Option<MutexGuard<'static, ()>>> {
    static GLUSTERD: Mutex<()> = Mutex::new(());
    if let Some(why) = cannot_run_glusterfs() {
        if std::env::var("KILN_REQUIRE_GLUSTERFS").as_deref() == Ok("1") {
            bail!(
                "KILN_REQUIRE_GLUSTERFS=1, but GlusterFS cannot run here: {why} \
                 (install Debian's glusterfs-server and run the test as root)"
            );
        }
        eprintln!("skipped: glusterfs-server not installed or not usable ({why})");
        return Ok(None);
    }
    // A test that failed holding it left nothing running (its guards tore down).
    Ok(Some(
        GLUSTERD.lock().unwrap_or_else(PoisonError::into_inner),
    ))
}

/// Why GlusterFS cannot run here, if it cannot.
fn cannot_run_glusterfs() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("not root: mounting and trusted.* xattrs need it".into());
    }
    ["glusterd", "gluster", "glusterfs", "mount.glusterfs"]
        .into_iter()
        .find(|program| which(program).is_none())
        .map(|program| format!("{program} not found"))
}

/// A program on PATH, or in the sbin directories a non-login root shell may lack.
fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

/// The names created through each mount: (C.UTF-8 client, C client). About 200 for the
/// first, every kind of name DHT treats specially; a few with invalid UTF-8 for the second.
fn names() -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let mut utf8: Vec<Vec<u8>> = Vec::new();
    let mut rng = NAMES_SEED;
    let mut next = move || xorshift(&mut rng);
    let ascii = b"abcdefghijklmnopqrstuvwxyz0123456789_-";
    for len in (1..=40).chain([47, 48, 49, 63, 64, 65, 128, 200, 255]) {
        utf8.push(
            (0..len)
                .map(|_| ascii[next() as usize % ascii.len()])
                .collect(),
        );
    }
    for base in [
        "foo",
        "report.pdf",
        "archive.tar.gz",
        "日本語.txt",
        "x",
        "é",
    ] {
        for suffix in ["x1y2", "AbCdEf", "Q", "000000"] {
            utf8.push(format!(".{base}.{suffix}").into_bytes());
        }
    }
    let fixed: [&[u8]; 30] = [
        b".bashrc",
        b"..x",
        b"...x",
        b".a.",
        b".a.b.",
        b".x.y.z",
        b".git",
        b".config.old",
        b".new\nline.tmp",
        "café".as_bytes(),
        "naïve.txt".as_bytes(),
        "日本語".as_bytes(),
        "Ελληνικά".as_bytes(),
        "emoji😀".as_bytes(),
        "中文文件名称测试".as_bytes(),
        "ångström.dat".as_bytes(),
        b"README.md",
        b"hello world",
        b"\xff",
        b"ab\x80",
        b"ok\xe9",
        b"qqqq\xc3",
        b".\xff.x",
        b".a\xff.b",
        b".a.\xfe",
        b".zz.\xc3",
        b".\xc0\xaf.x",
        b".\xed\xa0\x80.x",
        b".\xf4\x90\x80\x80.x",
        b".euro\xe2\x82\xac.\xe2\x82\xac",
    ];
    utf8.extend(fixed.iter().map(|n| n.to_vec()));
    utf8.push("é".repeat(127).into_bytes());
    utf8.push("日".repeat(85).into_bytes());
    utf8.push(format!(".{}.tmp", "d".repeat(200)).into_bytes());
    let alphabet: Vec<char> = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789._-éü日"
        .chars()
        .collect();
    while utf8.len() < 200 {
        let len = 1 + next() as usize % 40;
        let name: String = (0..len)
            .map(|_| alphabet[next() as usize % alphabet.len()])
            .collect();
        utf8.push(name.into_bytes());
    }
    let c: Vec<Vec<u8>> = [
        &b".\xff.y"[..],
        b".a.\xfd",
        b".a\xfe.c",
        b".c\xfc\xfb.d",
        b".\xf8\x87\x80\x80\x80.q",
        b".\xed\xa0\x80.z",
        b".plain.c1",
        b".plain.c2",
        b"\xfe\xfd\xfc",
    ]
    .iter()
    .map(|n| n.to_vec())
    .collect();
    utf8.retain(|n| n != b"." && n != b".." && !c.contains(n));
    utf8.sort();
    utf8.dedup();
    (utf8, c)
}

/// What a file holds: its path, a newline, then bytes derived from the path; `len` bytes in
/// all, or the path and up to [`CONTENT_EXTRA_BYTES_MAX`] more (how many derived from the path
/// too). No two files hold the same bytes, so a file read under the wrong name shows.
fn content(path: &[u8], len: Option<usize>) -> Vec<u8> {
    let seed = name_hash(path, Munging::Off);
    let len = len.unwrap_or(path.len() + 1 + seed as usize % CONTENT_EXTRA_BYTES_MAX);
    let mut out = Vec::with_capacity(len + 8);
    out.extend_from_slice(path);
    out.push(b'\n');
    let mut state = u64::from(seed) | 1;
    while out.len() < len {
        out.extend_from_slice(&xorshift(&mut state).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A FUSE mount of the volume, and how its client's locale munges rsync names.
#[derive(Debug, Clone)]
struct Client {
    mount: PathBuf,
    munging: Munging,
}

impl Client {
    /// `rel` (a path from the volume root, no leading `/`) in the mount.
    fn path(&self, rel: &[u8]) -> PathBuf {
        self.mount.join(OsStr::from_bytes(rel))
    }
}

/// A name in a directory of the volume (the directory's path from the root, no leading `/`;
/// empty for the root).
#[derive(Debug, Clone, PartialEq, Eq)]
struct At {
    dir: Vec<u8>,
    name: Vec<u8>,
}

impl At {
    fn new(dir: &[u8], name: &[u8]) -> At {
        At {
            dir: dir.to_vec(),
            name: name.to_vec(),
        }
    }

    /// The entry a path from the root names.
    fn split(path: &[u8]) -> At {
        match path.iter().rposition(|&b| b == b'/') {
            Some(slash) => At::new(&path[..slash], &path[slash + 1..]),
            None => At::new(b"", path),
        }
    }

    fn path(&self) -> Vec<u8> {
        if self.dir.is_empty() {
            self.name.clone()
        } else {
            [&self.dir[..], b"/", &self.name].concat()
        }
    }
}

impl std::fmt::Display for At {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "/{}", self.path().escape_ascii())
    }
}

/// What the volume should hold. Every change the test makes through a mount goes through
/// [`Tree`], so the two agree.
#[derive(Debug)]
struct Tree {
    /// Each directory by its path from the root (empty for the root).
    dirs: BTreeMap<Vec<u8>, Dir>,
    /// [`USER_XATTR`] set on these paths, with these values.
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

#[derive(Debug)]
struct Dir {
    /// The path it was made at: its layout starts at the brick that path hashes to.
    made_at: Vec<u8>,
    entries: BTreeMap<Vec<u8>, Entry>,
}

#[derive(Debug, Clone)]
enum Entry {
    /// A file: its content, and the munging of the client that gave it its name (which
    /// decided its brick).
    File {
        content: Vec<u8>,
        munging: Munging,
    },
    Dir,
}

impl Tree {
    fn new() -> Tree {
        let root = Dir {
            made_at: Vec::new(),
            entries: BTreeMap::new(),
        };
        Tree {
            dirs: BTreeMap::from([(Vec::new(), root)]),
            xattrs: Vec::new(),
        }
    }

    fn dir_mut(&mut self, dir: &[u8]) -> anyhow::Result<&mut Dir> {
        self.dirs
            .get_mut(dir)
            .with_context(|| format!("no directory /{} in the tree", dir.escape_ascii()))
    }

    /// The munging that placed file `at`.
    fn munging(&self, at: &At) -> anyhow::Result<Munging> {
        match self.dirs.get(&at.dir).and_then(|d| d.entries.get(&at.name)) {
            Some(Entry::File { munging, .. }) => Ok(*munging),
            _ => bail!("no file {at} in the tree"),
        }
    }

    /// Creates file `at` through `client`, with [`content`] of `len` bytes.
    fn create(&mut self, client: &Client, at: &At, len: Option<usize>) -> anyhow::Result<()> {
        let content = content(&at.path(), len);
        let path = client.path(&at.path());
        std::fs::write(&path, &content).with_context(|| format!("create {}", path.display()))?;
        let file = Entry::File {
            content,
            munging: client.munging,
        };
        self.dir_mut(&at.dir)?.entries.insert(at.name.clone(), file);
        Ok(())
    }

    fn mkdir(&mut self, client: &Client, path: &[u8]) -> anyhow::Result<()> {
        let at = At::split(path);
        let on_mount = client.path(path);
        std::fs::create_dir(&on_mount).with_context(|| format!("mkdir {}", on_mount.display()))?;
        self.dir_mut(&at.dir)?.entries.insert(at.name, Entry::Dir);
        let dir = Dir {
            made_at: path.to_vec(),
            entries: BTreeMap::new(),
        };
        self.dirs.insert(path.to_vec(), dir);
        Ok(())
    }

    /// Renames `from` to `to` through `client`; a directory must have no subdirectory.
    fn rename(&mut self, client: &Client, from: &At, to: &At) -> anyhow::Result<()> {
        std::fs::rename(client.path(&from.path()), client.path(&to.path()))
            .with_context(|| format!("rename {from} to {to}"))?;
        let entry = self.dir_mut(&from.dir)?.entries.remove(&from.name);
        let entry = match entry.with_context(|| format!("no {from} in the tree"))? {
            Entry::File { content, .. } => Entry::File {
                content,
                munging: client.munging,
            },
            Entry::Dir => {
                let below = [from.path(), b"/".to_vec()].concat();
                ensure!(
                    !self.dirs.keys().any(|d| d.starts_with(&below)),
                    "the tree renames no directory with subdirectories"
                );
                let dir = self.dirs.remove(&from.path()).context("the directory")?;
                self.dirs.insert(to.path(), dir);
                Entry::Dir
            }
        };
        self.dir_mut(&to.dir)?
            .entries
            .insert(to.name.clone(), entry);
        Ok(())
    }

    /// Makes `to` a hard link of file `from` through `client`.
    fn hard_link(&mut self, client: &Client, from: &At, to: &At) -> anyhow::Result<()> {
        std::fs::hard_link(client.path(&from.path()), client.path(&to.path()))
            .with_context(|| format!("link {from} to {to}"))?;
        let Some(Entry::File { content, .. }) = self.dir_mut(&from.dir)?.entries.get(&from.name)
        else {
            bail!("no file {from} in the tree");
        };
        let file = Entry::File {
            content: content.clone(),
            munging: client.munging,
        };
        self.dir_mut(&to.dir)?.entries.insert(to.name.clone(), file);
        Ok(())
    }

    /// Sets [`USER_XATTR`] on `path` through `client`.
    fn set_xattr(&mut self, client: &Client, path: &[u8], value: &[u8]) -> anyhow::Result<()> {
        let on_mount = client.path(path);
        rustix::fs::setxattr(&on_mount, USER_XATTR, value, XattrFlags::CREATE)
            .with_context(|| format!("setxattr {USER_XATTR} on {}", on_mount.display()))?;
        self.xattrs.push((path.to_vec(), value.to_vec()));
        Ok(())
    }
}

/// Runs `work` (file system calls through a FUSE mount) on a thread of its own, bounded: a
/// stuck FUSE call fails the test instead of hanging it.
fn through_mount<T: Send + 'static>(
    what: &str,
    work: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(work());
    });
    finished
        .recv_timeout(CREATE_TIMEOUT)
        .with_context(|| format!("{what} through the mount took more than {CREATE_TIMEOUT:?}"))?
}

/// What the clients make before the layouts are known: names of every kind in the root from
/// both clients, nested directories with files, a big file, an empty directory, a directory
/// to rename and an rsync temporary file.
fn populate(utf8: &Client, c: &Client) -> anyhow::Result<Tree> {
    let (utf8_names, c_names) = names();
    let mut tree = Tree::new();
    for name in &utf8_names {
        tree.create(utf8, &At::new(b"", name), None)?;
    }
    for name in &c_names {
        tree.create(c, &At::new(b"", name), None)?;
    }
    for dir in [&b"sub"[..], b"sub/deeper", b"docs", b"olddir", b"empty"] {
        tree.mkdir(utf8, dir)?;
    }
    for name in utf8_names.iter().step_by(3) {
        tree.create(utf8, &At::new(b"sub", name), None)?;
    }
    for name in utf8_names.iter().step_by(17) {
        tree.create(utf8, &At::new(b"sub/deeper", name), None)?;
    }
    for name in [&b"index.html"[..], b"notes.txt"] {
        tree.create(utf8, &At::new(b"docs", name), None)?;
    }
    tree.create(utf8, &At::new(b"docs", b"big.bin"), Some(BIG_FILE_BYTES))?;
    for name in [b"x", b"y"] {
        tree.create(utf8, &At::new(b"olddir", name), None)?;
    }
    tree.create(utf8, &At::new(b"", RSYNC_TEMP), None)?;
    Ok(tree)
}

/// A rename or hard link through GlusterFS whose new name hashes to another brick than the
/// one holding the data.
#[derive(Debug, Clone)]
struct Move {
    from: At,
    to: At,
    /// The brick holding the data.
    home: usize,
    /// The brick the new name hashes to, where GlusterFS must leave a link file.
    hashed: usize,
    hard_link: bool,
}

impl std::fmt::Display for Move {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let verb = if self.hard_link { "linked" } else { "renamed" };
        write!(
            f,
            "{} {verb} to {} (data on brick {}, link file on brick {})",
            self.from, self.to, self.home, self.hashed
        )
    }
}

/// One of [`MOVES`]: file `name` in the root renamed (or hard-linked) into directory
/// `to_dir`, under `prefix` and the first number that hashes to another brick than the data's.
#[derive(Debug, Clone, Copy)]
struct MoveSpec {
    name: &'static [u8],
    to_dir: &'static [u8],
    prefix: &'static [u8],
    hard_link: bool,
}

impl MoveSpec {
    const fn rename(name: &'static [u8], to_dir: &'static [u8], prefix: &'static [u8]) -> MoveSpec {
        MoveSpec {
            name,
            to_dir,
            prefix,
            hard_link: false,
        }
    }
}

/// The [`MOVES`] with their new names chosen in `layouts`.
fn plan_moves(tree: &Tree, layouts: &Layouts) -> anyhow::Result<Vec<Move>> {
    let layout = |dir: &[u8]| {
        layouts
            .get(dir)
            .with_context(|| format!("no layout for /{}", dir.escape_ascii()))
    };
    let hole = || anyhow::anyhow!("a hole in a layout GlusterFS wrote");
    MOVES
        .iter()
        .map(|spec| {
            let from = At::new(b"", spec.name);
            let home = layout(b"")?
                .hashed_brick(spec.name, tree.munging(&from)?)
                .ok_or_else(hole)?;
            let to_layout = layout(spec.to_dir)?;
            let (to, hashed) = (0..NAME_TRIES)
                .find_map(|k| {
                    let name = [spec.prefix, k.to_string().as_bytes()].concat();
                    let to = At::new(spec.to_dir, &name);
                    let hashed = to_layout.hashed_brick(&to.name, Munging::RsyncUtf8)?;
                    (hashed != home).then_some((to, hashed))
                })
                .with_context(|| format!("no new name for {from} hashes off brick {home}"))?;
            anyhow::Ok(Move {
                from,
                to,
                home,
                hashed,
                hard_link: spec.hard_link,
            })
        })
        .collect()
}

/// What the UTF-8 client does once the layouts are known: `moves`, an rsync temporary file
/// renamed to its final name, a directory renamed, user xattrs on a file, a renamed file and
/// a directory.
fn rearrange(utf8: &Client, mut tree: Tree, moves: &[Move]) -> anyhow::Result<Tree> {
    for m in moves {
        if m.hard_link {
            tree.hard_link(utf8, &m.from, &m.to)?;
        } else {
            tree.rename(utf8, &m.from, &m.to)?;
        }
    }
    let root = |name: &[u8]| At::new(b"", name);
    tree.rename(utf8, &root(RSYNC_TEMP), &root(RSYNC_FINAL))?;
    tree.rename(utf8, &root(b"olddir"), &root(b"renamed-dir"))?;
    tree.set_xattr(utf8, b"docs/notes.txt", b"set through GlusterFS on a file")?;
    tree.set_xattr(utf8, b"docs", b"set through GlusterFS on a directory")?;
    let renamed = moves
        .iter()
        .find(|m| !m.hard_link)
        .context("a rename in MOVES")?;
    tree.set_xattr(utf8, &renamed.to.path(), b"set on a renamed file")?;
    Ok(tree)
}

/// Each directory's layout, by its path from the root.
type Layouts = BTreeMap<Vec<u8>, Layout>;
/// Each directory's names as a listing gave them (sorted), by its path from the root.
type Listings = BTreeMap<Vec<u8>, Vec<Vec<u8>>>;

/// Each directory of `tree` as `client` lists it.
fn list(client: &Client, tree: &Tree) -> anyhow::Result<Listings> {
    tree.dirs
        .keys()
        .map(|dir| {
            let at = client.path(dir);
            let mut names = std::fs::read_dir(&at)
                .and_then(|entries| {
                    entries
                        .map(|e| Ok(e?.file_name().as_bytes().to_vec()))
                        .collect::<std::io::Result<Vec<_>>>()
                })
                .with_context(|| format!("list {}", at.display()))?;
            names.sort();
            anyhow::Ok((dir.clone(), names))
        })
        .collect()
}

/// Checks that the GlusterFS mount lists what the tree holds, nothing more or less.
fn check_listings(tree: &Tree, listed: &Listings) -> anyhow::Result<()> {
    let mut wrong = Vec::new();
    for (dir, d) in &tree.dirs {
        let listed = listed.get(dir).map(Vec::as_slice).unwrap_or_default();
        let want: Vec<Vec<u8>> = d.entries.keys().cloned().collect();
        if let Some(diff) = listing_diff(listed, &want) {
            wrong.push(format!("/{}: {diff}", dir.escape_ascii()));
        }
    }
    ensure!(
        wrong.is_empty(),
        "the GlusterFS mount does not list what the test made:\n{}",
        wrong.join("\n")
    );
    Ok(())
}

/// How `listed` differs from `want` (both sorted), if it does: the names missing, those not
/// expected, those listed twice.
fn listing_diff(listed: &[Vec<u8>], want: &[Vec<u8>]) -> Option<String> {
    if listed == want {
        return None;
    }
    let show = |names: &mut dyn Iterator<Item = &Vec<u8>>| {
        names
            .map(|n| format!("\"{}\"", n.escape_ascii()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let missing = show(&mut want.iter().filter(|n| !listed.contains(n)));
    let unexpected = show(&mut listed.iter().filter(|n| !want.contains(n)));
    let twice = show(&mut listed.windows(2).filter(|w| w[0] == w[1]).map(|w| &w[0]));
    Some(format!(
        "missing [{missing}], not expected [{unexpected}], listed twice [{twice}]"
    ))
}

/// A regular file's identity on its brick: what a copy, or a rewrite, would change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId {
    ino: u64,
    size: u64,
    mtime_ns: i128,
}

/// Every regular file on every brick (link files too; not `.glusterfs`): (brick, path on
/// it) → its identity.
fn brick_files(bricks: &[PathBuf]) -> anyhow::Result<BTreeMap<(usize, PathBuf), FileId>> {
    let mut files = BTreeMap::new();
    for (b, brick) in bricks.iter().enumerate() {
        let mut dirs = vec![brick.clone()];
        while let Some(dir) = dirs.pop() {
            for entry in
                std::fs::read_dir(&dir).with_context(|| format!("read {}", dir.display()))?
            {
                let entry = entry?;
                if dir == *brick && entry.file_name() == ".glusterfs" {
                    continue;
                }
                // Not following symlinks.
                let meta = entry.metadata()?;
                if meta.is_dir() {
                    dirs.push(entry.path());
                } else if meta.is_file() {
                    let id = FileId {
                        ino: meta.ino(),
                        size: meta.size(),
                        mtime_ns: i128::from(meta.mtime()) * 1_000_000_000
                            + i128::from(meta.mtime_nsec()),
                    };
                    files.insert((b, entry.path().strip_prefix(brick)?.to_owned()), id);
                }
            }
        }
    }
    Ok(files)
}

/// Checks that every file of `before` is still there with the same inode, size and mtime;
/// how many it checked.
fn check_unchanged(
    before: &BTreeMap<(usize, PathBuf), FileId>,
    after: &BTreeMap<(usize, PathBuf), FileId>,
) -> anyhow::Result<usize> {
    let changed: Vec<String> = before
        .iter()
        .filter(|(key, id)| after.get(*key) != Some(*id))
        .map(|((b, path), id)| {
            let now = after.get(&(*b, path.clone()));
            format!("brick {b} {}: {id:?} before, {now:?} after", path.display())
        })
        .collect();
    ensure!(
        changed.is_empty(),
        "{} of {} files on the bricks changed while Kiln served them:\n{}",
        changed.len(),
        before.len(),
        changed.join("\n")
    );
    Ok(before.len())
}

/// The volume through Kiln's client stack.
type Volume = Distribute<BrickClient>;

/// What Kiln found serving the bricks.
#[derive(Debug, Default)]
struct KilnReport {
    /// Files read back with their content.
    files: usize,
    /// Directories that listed what the GlusterFS mount listed.
    dirs: usize,
    xattrs: usize,
    /// Files written through Kiln, each on its hashed brick.
    written: usize,
    /// Names the C-locale client made that Kiln's (UTF-8) munging hashes to another brick
    /// than the one GlusterFS put them on, and what reading each gave.
    c_locale: Vec<String>,
    failures: Vec<String>,
}

impl KilnReport {
    /// Checks the listing of `dir` against the GlusterFS mount's, and each entry's type and
    /// size against `d`'s.
    fn check_listing(&mut self, dir: &[u8], d: &Dir, entries: &[DirEntryPlus], listed: &Listings) {
        let mut names: Vec<Vec<u8>> = entries.iter().map(|e| e.name.as_bytes().to_vec()).collect();
        names.sort();
        let want = listed.get(dir).map(Vec::as_slice).unwrap_or_default();
        match listing_diff(&names, want) {
            Some(diff) => self.failures.push(format!(
                "Kiln lists /{} unlike GlusterFS: {diff}",
                dir.escape_ascii()
            )),
            None => self.dirs += 1,
        }
        for e in entries {
            let fits = match d.entries.get(e.name.as_bytes()) {
                Some(Entry::Dir) => e.iatt.file_type == FileType::Directory,
                Some(Entry::File { content, .. }) => {
                    e.iatt.file_type == FileType::Regular && e.iatt.size == content.len() as u64
                }
                // Not in the tree: reported by name above.
                None => true,
            };
            if !fits {
                self.failures.push(format!(
                    "Kiln lists {} as {:?}, mode {:o}, {} bytes",
                    At::new(dir, e.name.as_bytes()),
                    e.iatt.file_type,
                    e.iatt.mode.bits(),
                    e.iatt.size
                ));
            }
        }
    }

    /// Notes what reading file `at` (placed with `munging` in `layout`) through Kiln gave.
    fn note_read(
        &mut self,
        at: &At,
        content: &[u8],
        munging: Munging,
        layout: &Layout,
        read: &Result<Vec<u8>, kiln_client::Error>,
    ) {
        let wrong = match read {
            Ok(data) if data == content => None,
            Ok(data) => {
                let differ = data.iter().zip(content).position(|(a, b)| a != b);
                let offset = differ.unwrap_or(data.len().min(content.len()));
                Some(format!(
                    "{} bytes read, {} written, the first difference at byte {offset}",
                    data.len(),
                    content.len()
                ))
            }
            Err(e) => Some(format!("error: {e}")),
        };
        // A name the C-locale client hashed to another brick than Kiln's default (UTF-8)
        // munging does is found all the same: the root's layout is uncommitted, so a miss on
        // the hashed brick sends the lookup to every brick, as GlusterFS's does.
        let elsewhere = layout.hashed_brick(&at.name, munging)
            != layout.hashed_brick(&at.name, Munging::default());
        match (wrong, elsewhere) {
            (None, false) => self.files += 1,
            (None, true) => {
                self.files += 1;
                self.c_locale.push(format!("{at}: read back"));
            }
            (Some(wrong), _) => self
                .failures
                .push(format!("{at} (named by a {munging:?} client): {wrong}")),
        }
    }
}

/// Serves the bricks GlusterFS let go of with `kiln-brickd`, checks the volume through
/// `Distribute` (reading, then writing), stops the brickds and runs `kiln-brickd check` on
/// every brick.
fn serve_with_kiln(
    gluster: &Gluster,
    tree: &Tree,
    listed: &Listings,
) -> anyhow::Result<KilnReport> {
    let cluster = Cluster::new();
    with_kiln(&cluster, &gluster.bricks, &gluster.volume, async |volume| {
        let mut report = read_back(volume, tree, listed).await?;
        let root = listed.get(&b""[..]).context("the root's listing")?;
        report.written =
            write_through_kiln(volume, &gluster.bricks, root, &mut report.failures).await?;
        ensure!(
            report.failures.is_empty(),
            "{} checks through Kiln failed:\n{}",
            report.failures.len(),
            report.failures.join("\n")
        );
        Ok(report)
    })
}

/// Serves `bricks` with a `kiln-brickd` each and runs `work` (bounded) on them through
/// `Distribute` — brick `i` is `VOLUME-client-i`, under the volume's name `volume`, so link
/// files resolve — then stops the brickds and runs `kiln-brickd check` on every brick.
fn with_kiln<T>(
    cluster: &Cluster,
    bricks: &[PathBuf],
    volume: &str,
    work: impl AsyncFnOnce(&Volume) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let brickds: Vec<Brickd> = bricks
        .iter()
        .map(|brick| cluster.start_brick(brick, "127.0.0.1:0", &[]))
        .collect();
    let rt = common::runtime();
    let worked = rt.block_on(async {
        let work = async {
            let mut clients = Vec::with_capacity(brickds.len());
            for brickd in &brickds {
                clients.push(cluster.connect(brickd.addr, "alice").await);
            }
            let volume = Distribute::new(clients, volume)?;
            let worked = work(&volume).await;
            for brick in volume.bricks() {
                brick.close().await;
            }
            worked
        };
        tokio::time::timeout(KILN_TIMEOUT, work).await
    });
    let worked =
        worked.map_err(|_| anyhow::anyhow!("Kiln's work took more than {KILN_TIMEOUT:?}"))??;
    for brickd in brickds {
        let status = brickd.terminate();
        ensure!(status.success(), "kiln-brickd exited with {status}");
    }
    for brick in bricks {
        common::assert_brick_checks_clean(brick);
    }
    Ok(worked)
}

/// Reads the volume back through Kiln: every directory lists what the GlusterFS mount
/// listed, every file reads back by name with its content, the user xattrs read back.
async fn read_back(volume: &Volume, tree: &Tree, listed: &Listings) -> anyhow::Result<KilnReport> {
    let creds = Creds::root();
    let mut report = KilnReport::default();
    for (dir, d) in &tree.dirs {
        let parent = volume.resolve(&creds, &path_from_root(dir)?).await?.gfid;
        let entries = volume.read_dir(&creds, parent).await?;
        report.check_listing(dir, d, &entries, listed);
        let layout = volume.layout(parent).await?;
        for (name, entry) in &d.entries {
            let Entry::File { content, munging } = entry else {
                continue;
            };
            let at = At::new(dir, name);
            let read = read_file(volume, &creds, parent, &at).await;
            report.note_read(&at, content, *munging, &layout, &read);
        }
    }
    for (path, value) in &tree.xattrs {
        match user_xattr(volume, &creds, path).await {
            Ok(found) if found == *value => report.xattrs += 1,
            found => report.failures.push(format!(
                "{USER_XATTR} of /{} through Kiln: {:?}, not \"{}\"",
                path.escape_ascii(),
                found.map(|v| v.escape_ascii().to_string()),
                value.escape_ascii()
            )),
        }
    }
    Ok(report)
}

/// Writes [`KILN_WRITES`] through Kiln, in a directory it makes; each file must be on the
/// brick the layout (GlusterFS's, for the root) hashes its name to, and only there, and read
/// back; the directories must be on every brick with a layout; the root must list what the
/// GlusterFS mount listed (`root`) and the new names. Failures go to `failures`; how many
/// files it wrote.
async fn write_through_kiln(
    volume: &Volume,
    bricks: &[PathBuf],
    root: &[Vec<u8>],
    failures: &mut Vec<String>,
) -> anyhow::Result<usize> {
    let creds = Creds::root();
    volume
        .mkdir_all(&creds, &path_from_root(KILN_DIR)?, 0o755)
        .await?;
    for (dir, name) in KILN_WRITES {
        let at = At::new(dir, name);
        let parent = volume.resolve(&creds, &path_from_root(dir)?).await?.gfid;
        let content = content(&at.path(), None);
        let data = Bytes::from(content.clone());
        match String::from_utf8(at.path()) {
            Ok(path) => volume.put(&creds, &format!("/{path}"), data, 0o644).await?,
            Err(_) => {
                volume
                    .put_at(&creds, parent, Name::new(name)?, data, 0o644)
                    .await?
            }
        };
        let hashed = volume
            .layout(parent)
            .await?
            .hashed_brick(name, Munging::default());
        let found = on_disk(bricks, &at);
        if hashed.is_none_or(|h| found != [(h, false)]) {
            failures.push(format!(
                "{at} written through Kiln: hashed to brick {hashed:?}, (brick, is a link \
                 file) holding it: {found:?}"
            ));
        }
        if read_file(volume, &creds, parent, &at).await? != content {
            failures.push(format!("{at} written through Kiln reads back otherwise"));
        }
    }
    for dir in [&b"kiln-made"[..], KILN_DIR] {
        for (b, brick) in bricks.iter().enumerate() {
            if xattr(&brick.join(OsStr::from_bytes(dir)), XATTR_NAME).is_none() {
                failures.push(format!(
                    "/{} made through Kiln: no {XATTR_NAME} on brick {b}",
                    dir.escape_ascii()
                ));
            }
        }
    }
    let mut names: Vec<Vec<u8>> = volume
        .read_dir(&creds, Gfid::ROOT)
        .await?
        .iter()
        .map(|e| e.name.as_bytes().to_vec())
        .collect();
    names.sort();
    let mut want = root.to_vec();
    want.push(b"kiln-made".to_vec());
    want.extend(
        KILN_WRITES
            .iter()
            .filter(|(dir, _)| dir.is_empty())
            .map(|(_, n)| n.to_vec()),
    );
    want.sort();
    if let Some(diff) = listing_diff(&names, &want) {
        failures.push(format!("Kiln lists the root after its writes: {diff}"));
    }
    Ok(KILN_WRITES.len())
}

/// The content of file `at` through Kiln: by path with [`Paths::read_to_end`] when the path
/// is text, else by LOOKUP of its name in `parent`, OPEN and READs.
async fn read_file(
    volume: &Volume,
    creds: &Creds,
    parent: Gfid,
    at: &At,
) -> Result<Vec<u8>, kiln_client::Error> {
    if let Ok(path) = std::str::from_utf8(&at.path()) {
        return volume.read_to_end(creds, &format!("/{path}")).await;
    }
    let name = Name::new(at.name.clone())
        .map_err(|e| kiln_client::Error::Fop(ErrorCode::from_errno(e.errno())))?;
    let iatt = volume.lookup(creds, parent, &name).await?;
    let fd = volume
        .open(creds, iatt.gfid, AccessMode::ReadOnly, OpenFlags::empty())
        .await?;
    let mut data = Vec::new();
    let read = loop {
        match volume
            .read(creds, &fd, data.len() as u64, READ_CHUNK_BYTES)
            .await
        {
            Ok(chunk) if chunk.is_empty() => break Ok(()),
            Ok(chunk) => data.extend_from_slice(&chunk),
            Err(e) => break Err(e),
        }
    };
    let released = volume.release(creds, fd).await;
    read.and(released).map(|()| data)
}

/// [`USER_XATTR`] of `path` through Kiln (GETXATTR on the brick that holds it).
async fn user_xattr(volume: &Volume, creds: &Creds, path: &[u8]) -> anyhow::Result<Vec<u8>> {
    let gfid = volume.resolve(creds, &path_from_root(path)?).await?.gfid;
    let get = kiln_wire::Getxattr {
        gfid,
        name: XattrName::new(USER_XATTR)?,
    };
    match volume.call(creds, get.into()).await? {
        FopReply::Getxattr(r) => Ok(r.value.as_bytes().to_vec()),
        other => bail!("GETXATTR answered with a {} reply", other.code().name()),
    }
}

/// `/` and `rel` (a path from the root), as text.
fn path_from_root(rel: &[u8]) -> anyhow::Result<String> {
    let rel =
        std::str::from_utf8(rel).with_context(|| format!("{} is not text", rel.escape_ascii()))?;
    Ok(format!("/{rel}"))
}

fn ranges(layout: &Layout) -> Vec<String> {
    (0..layout.brick_count())
        .map(|b| match layout.range(b) {
            Some(r) => format!("{:08x}-{:08x}", r.start(), r.stop()),
            None => "none".into(),
        })
        .collect()
}

/// The bricks that have an entry `at`, each with whether it is a link file there.
fn on_disk(bricks: &[PathBuf], at: &At) -> Vec<(usize, bool)> {
    bricks
        .iter()
        .enumerate()
        .filter_map(|(b, brick)| {
            let path = brick.join(OsStr::from_bytes(&at.path()));
            std::fs::symlink_metadata(&path).ok()?;
            Some((b, xattr(&path, LINKTO_XATTR).is_some()))
        })
        .collect()
}

/// Xattr `name` of `path` (not following a symlink), if it has it.
fn xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    let mut value = vec![0; 1024];
    let len = rustix::fs::lgetxattr(path, name, &mut value[..]).ok()?;
    value.truncate(len);
    Some(value)
}

/// What the test made through Kiln, as GlusterFS must show it. Paths are from the volume's
/// root, without a leading `/`.
#[derive(Debug, Clone, Default)]
struct Made {
    /// Each directory's names (the root is "").
    dirs: BTreeMap<String, BTreeSet<String>>,
    /// Each directory's mtime as Kiln reported it (the latest of its bricks').
    dir_mtimes: BTreeMap<String, (i64, u32)>,
    /// Each regular file by path (a hard link is one more path).
    files: BTreeMap<String, MadeFile>,
    /// Each symlink's target.
    symlinks: BTreeMap<String, String>,
    /// Two paths of one file.
    hard_links: Vec<(String, String)>,
    xattrs: Vec<(String, Vec<u8>)>,
    /// The rename and the hard link to a name hashed to another brick.
    moves: Vec<Move>,
}

/// A file's content and its mtime (seconds, nanoseconds) as the side that wrote it reported.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MadeFile {
    content: Vec<u8>,
    mtime: (i64, u32),
}

impl Made {
    /// Notes the new name `path` in its directory.
    fn name(&mut self, path: &str) {
        let (dir, name) = path.rsplit_once('/').unwrap_or(("", path));
        self.dirs
            .entry(dir.to_owned())
            .or_default()
            .insert(name.to_owned());
    }
}

fn mtime_of(iatt: &kiln_wire::Iatt) -> (i64, u32) {
    (iatt.mtime.sec(), iatt.mtime.nsec())
}

fn mtime_on(meta: &std::fs::Metadata) -> (i64, u32) {
    (
        meta.mtime(),
        u32::try_from(meta.mtime_nsec()).unwrap_or(u32::MAX),
    )
}

/// Makes [`MADE_DIRS`], [`MADE_FILES`], [`MADE_MOVES`], [`MADE_SYMLINKS`] and
/// [`MADE_XATTRS`] through Kiln, then notes the mtime Kiln reports for every directory and
/// file.
async fn fill_through_kiln(volume: &Volume, bricks: &[PathBuf]) -> anyhow::Result<Made> {
    let creds = Creds::root();
    let mut made = Made::default();
    made.dirs.insert(String::new(), BTreeSet::new());
    for dir in MADE_DIRS {
        volume.mkdir_all(&creds, &format!("/{dir}"), 0o755).await?;
        made.name(dir);
        made.dirs.insert(dir.to_owned(), BTreeSet::new());
    }
    let mut contents = BTreeMap::new();
    for (path, len) in MADE_FILES {
        let data = content(path.as_bytes(), Some(len));
        let bytes = Bytes::from(data.clone());
        volume
            .write_file(&creds, &format!("/{path}"), bytes, 0o644)
            .await?;
        made.name(path);
        contents.insert(path.to_owned(), data);
    }
    for spec in MADE_MOVES {
        let m = move_through_kiln(volume, bricks, &spec).await?;
        let (from, to) = (
            String::from_utf8(m.from.path())?,
            String::from_utf8(m.to.path())?,
        );
        let data = contents.get(&from).context("the moved file")?.clone();
        if m.hard_link {
            made.hard_links.push((from, to.clone()));
        } else {
            contents.remove(&from);
            made.dirs.entry(String::new()).or_default().remove(&from);
        }
        made.name(&to);
        contents.insert(to, data);
        made.moves.push(m);
    }
    for (path, target) in MADE_SYMLINKS {
        let (parent, name) = volume.resolve_parent(&creds, &format!("/{path}")).await?;
        let symlink = kiln_wire::Symlink {
            parent,
            name,
            gfid: new_gfid(),
            target: SymlinkTarget::new(Bytes::from(target))?,
        };
        volume.call(&creds, symlink.into()).await?;
        made.name(path);
        made.symlinks.insert(path.to_owned(), target.to_owned());
    }
    for (path, value) in MADE_XATTRS {
        let set = kiln_wire::Setxattr {
            gfid: volume.resolve(&creds, &format!("/{path}")).await?.gfid,
            name: XattrName::new(USER_XATTR)?,
            value: XattrValue::new(Bytes::from(value))?,
            mode: XattrSetMode::Create,
        };
        volume.call(&creds, set.into()).await?;
        made.xattrs.push((path.to_owned(), value.to_vec()));
    }
    // Last: nothing after changes an mtime.
    for dir in made.dirs.keys() {
        let iatt = volume.resolve(&creds, &format!("/{dir}")).await?;
        made.dir_mtimes.insert(dir.clone(), mtime_of(&iatt));
    }
    for (path, content) in contents {
        let iatt = volume.resolve(&creds, &format!("/{path}")).await?;
        let mtime = mtime_of(&iatt);
        made.files.insert(path, MadeFile { content, mtime });
    }
    Ok(made)
}

/// Renames (or hard-links) `spec`'s file through Kiln to the first name under its prefix
/// that hashes to another brick than the one holding the data.
async fn move_through_kiln(
    volume: &Volume,
    bricks: &[PathBuf],
    spec: &MoveSpec,
) -> anyhow::Result<Move> {
    let creds = Creds::root();
    let from = At::new(b"", spec.name);
    let home = match on_disk(bricks, &from)[..] {
        [(home, false)] => home,
        ref found => bail!("{from} written through Kiln: (brick, is a link file) {found:?}"),
    };
    let new_parent = volume
        .resolve(&creds, &path_from_root(spec.to_dir)?)
        .await?
        .gfid;
    let layout = volume.layout(new_parent).await?;
    let (to, hashed) = (0..NAME_TRIES)
        .find_map(|k| {
            let name = [spec.prefix, k.to_string().as_bytes()].concat();
            let hashed = layout.hashed_brick(&name, Munging::default())?;
            (hashed != home).then(|| (At::new(spec.to_dir, &name), hashed))
        })
        .with_context(|| format!("no new name for {from} hashes off brick {home}"))?;
    let new_name = Name::new(to.name.clone())?;
    let fop: FopRequest = if spec.hard_link {
        let gfid = volume
            .resolve(&creds, &path_from_root(&from.path())?)
            .await?
            .gfid;
        kiln_wire::Link {
            gfid,
            new_parent,
            new_name,
        }
        .into()
    } else {
        kiln_wire::Rename {
            old_parent: Gfid::ROOT,
            old_name: Name::new(spec.name)?,
            new_parent,
            new_name,
            mode: RenameMode::Replace,
        }
        .into()
    };
    volume.call(&creds, fop).await?;
    Ok(Move {
        from,
        to,
        home,
        hashed,
        hard_link: spec.hard_link,
    })
}

/// Each directory's layout xattr on each brick: (directory, brick) → its value.
type DirLayouts = BTreeMap<(String, usize), Option<Vec<u8>>>;

fn dir_layouts(bricks: &[PathBuf], made: &Made) -> DirLayouts {
    let mut layouts = DirLayouts::new();
    for dir in made.dirs.keys() {
        for (b, brick) in bricks.iter().enumerate() {
            let value = xattr(&brick.join(dir), XATTR_NAME);
            layouts.insert((dir.clone(), b), value);
        }
    }
    layouts
}

/// The (directory, brick) pairs whose layout changed from `before` to `after`.
fn relaid_dirs(before: &DirLayouts, after: &DirLayouts) -> Vec<String> {
    before
        .iter()
        .filter(|(key, value)| after.get(*key) != Some(*value))
        .map(|((dir, b), value)| {
            let now = after.get(&(dir.clone(), *b));
            format!("/{dir} on brick {b}: {value:02x?}, then {now:02x?}")
        })
        .collect()
}

/// Checks through GlusterFS's mount what Kiln made: every directory lists its names and has
/// the mtime Kiln reported, every file (by each of its names, behind link files too) reads
/// back with its content and the mtime Kiln reported, symlinks read back and resolve, hard
/// links are one file, the user xattrs read back. What it checked.
fn check_through_glusterfs(client: &Client, made: &Made) -> anyhow::Result<String> {
    let mut failures = Vec::new();
    for (dir, names) in &made.dirs {
        let at = client.path(dir.as_bytes());
        let mut listed = std::fs::read_dir(&at)
            .and_then(|entries| {
                entries
                    .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
                    .collect::<std::io::Result<Vec<_>>>()
            })
            .with_context(|| format!("list {}", at.display()))?;
        listed.sort();
        let want: Vec<String> = names.iter().cloned().collect();
        if listed != want {
            failures.push(format!(
                "GlusterFS lists /{dir} as {listed:?}, not {want:?}"
            ));
        }
        let shown = std::fs::metadata(&at).map(|m| mtime_on(&m));
        let want = made.dir_mtimes.get(dir);
        if shown.as_ref().ok() != want {
            failures.push(format!(
                "/{dir}: GlusterFS shows mtime {shown:?}, Kiln reported {want:?}"
            ));
        }
    }
    for (path, file) in &made.files {
        let on_mount = client.path(path.as_bytes());
        match std::fs::read(&on_mount) {
            Ok(data) if data == file.content => {}
            Ok(data) => failures.push(format!(
                "/{path}: {} bytes read through GlusterFS, {} written through Kiln",
                data.len(),
                file.content.len()
            )),
            Err(e) => failures.push(format!("/{path}: read through GlusterFS: {e}")),
        }
        match std::fs::symlink_metadata(&on_mount) {
            Ok(meta) if meta.is_file() && mtime_on(&meta) == file.mtime => {}
            Ok(meta) => failures.push(format!(
                "/{path}: GlusterFS shows mtime {:?} ({:?}), Kiln reported {:?}",
                mtime_on(&meta),
                meta.file_type(),
                file.mtime
            )),
            Err(e) => failures.push(format!("/{path}: stat through GlusterFS: {e}")),
        }
    }
    for (path, target) in &made.symlinks {
        let on_mount = client.path(path.as_bytes());
        let read = std::fs::read_link(&on_mount);
        if read.as_ref().ok() != Some(&PathBuf::from(target)) {
            failures.push(format!("/{path}: readlink through GlusterFS gave {read:?}"));
        }
        let dir = path.rsplit_once('/').map_or("", |(dir, _)| dir);
        let target_path = Path::new(dir).join(target);
        let target_path = normalize(&target_path);
        let want = made.files.get(&target_path).map(|f| &f.content);
        let got = std::fs::read(&on_mount).ok();
        if want.is_none() || got.as_ref() != want {
            failures.push(format!(
                "/{path} → {target} (/{target_path}) does not read as that file through GlusterFS"
            ));
        }
    }
    for (a, b) in &made.hard_links {
        let stat = |p: &str| std::fs::symlink_metadata(client.path(p.as_bytes()));
        match (stat(a), stat(b)) {
            (Ok(ma), Ok(mb)) if ma.ino() == mb.ino() && ma.nlink() == 2 && mb.nlink() == 2 => {}
            (ma, mb) => failures.push(format!(
                "/{a} and /{b} are not one file with two names through GlusterFS: {:?}, {:?}",
                ma.map(|m| (m.ino(), m.nlink())),
                mb.map(|m| (m.ino(), m.nlink()))
            )),
        }
    }
    for (path, value) in &made.xattrs {
        let found = xattr(&client.path(path.as_bytes()), USER_XATTR);
        if found.as_ref() != Some(value) {
            failures.push(format!(
                "/{path}: {USER_XATTR} through GlusterFS is {:?}",
                found.map(|v| v.escape_ascii().to_string())
            ));
        }
    }
    ensure!(
        failures.is_empty(),
        "{} checks through GlusterFS failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    Ok(format!(
        "{} files with their content and mtime, {} directories listed, {} symlinks, {} hard \
         link, {} xattrs",
        made.files.len(),
        made.dirs.len(),
        made.symlinks.len(),
        made.hard_links.len(),
        made.xattrs.len()
    ))
}

/// `path` (relative, with `..` components) as a path from the root, without them.
fn normalize(path: &Path) -> String {
    let mut parts: Vec<&OsStr> = Vec::new();
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                parts.pop();
            }
            std::path::Component::Normal(p) => parts.push(p),
            _ => {}
        }
    }
    parts
        .iter()
        .map(|p| p.to_string_lossy())
        .collect::<Vec<_>>()
        .join("/")
}

/// Writes [`GLUSTERFS_WRITES`] through GlusterFS's mount; each with the mtime it shows.
fn write_through_glusterfs(client: &Client) -> anyhow::Result<BTreeMap<String, MadeFile>> {
    GLUSTERFS_WRITES
        .iter()
        .map(|&(path, len)| {
            let content = content(path.as_bytes(), Some(len));
            let on_mount = client.path(path.as_bytes());
            std::fs::write(&on_mount, &content)
                .with_context(|| format!("write {}", on_mount.display()))?;
            let mtime = mtime_on(&std::fs::metadata(&on_mount)?);
            anyhow::Ok((path.to_owned(), MadeFile { content, mtime }))
        })
        .collect()
}

/// GlusterFS's times after Kiln adopts bricks GlusterFS wrote to: `kiln-brickd format` must
/// remove [`MDATA_XATTR`] (GlusterFS wrote it on `glusterfs_made` and on the directories it
/// looked up), then Kiln writes new content to a file it made, to the one behind a link file
/// and to `glusterfs_made`, and adds [`KILN_ADDS`]; GlusterFS serving the bricks again must
/// show the new content with Kiln's new mtimes, the directory's too — but for [`CONTROL`],
/// whose mdata is put back after the format, the stale one: what every file would show
/// without the adoption. What it found.
fn mdata_round_trip(
    gluster: &mut Gluster,
    cluster: &Cluster,
    made: &Made,
    glusterfs_made: &BTreeMap<String, MadeFile>,
) -> anyhow::Result<String> {
    let bricks = gluster.bricks.clone();
    let carried = objects_with_mdata(&bricks)?;
    for path in glusterfs_made.keys() {
        ensure!(
            carried.iter().any(|(_, p)| p == path),
            "GlusterFS wrote no {MDATA_XATTR} on /{path} (is its ctime feature off?); objects \
             carrying one: {carried:?}"
        );
    }
    let control = data_on_disk(&bricks, CONTROL)?;
    let stale = xattr(&control, MDATA_XATTR).context("the control's mdata")?;
    for brick in &bricks {
        let adopted = gluster.kiln_format(brick)?;
        ensure!(adopted.contains("adopted"), "{adopted}");
    }
    let left = objects_with_mdata(&bricks)?;
    ensure!(
        left.is_empty(),
        "kiln-brickd format left {MDATA_XATTR} on {left:?}"
    );
    rustix::fs::lsetxattr(&control, MDATA_XATTR, &stale, XattrFlags::CREATE)?;

    let renamed = made
        .moves
        .iter()
        .find(|m| !m.hard_link)
        .context("a rename")?;
    let mut paths = vec![
        KILN_CHANGES.to_owned(),
        String::from_utf8(renamed.to.path())?,
    ];
    paths.extend(glusterfs_made.keys().cloned());
    let mut before = Changes::default();
    for path in &paths {
        let file = made.files.get(path).or_else(|| glusterfs_made.get(path));
        let file = file.context("a file made before")?.clone();
        before.files.insert(path.clone(), file);
    }
    let (dir, _) = KILN_ADDS.rsplit_once('/').context("a directory")?;
    let dir_mtime = *made.dir_mtimes.get(dir).context("the directory's mtime")?;
    before.dir_mtimes.insert(dir.to_owned(), dir_mtime);
    let volume = gluster.volume.clone();
    let changed = with_kiln(cluster, &bricks, &volume, async |volume| {
        change_through_kiln(volume, &paths).await
    })?;

    gluster.serve()?;
    let client = gluster.mount("C.UTF-8", Munging::RsyncUtf8)?;
    let shown = through_mount("reading what Kiln changed", move || {
        check_changes(&client, &changed, &before)
    })?;
    gluster.tear_down()?;
    Ok(format!(
        "{} objects carried {MDATA_XATTR} when Kiln adopted the bricks back; {shown}",
        carried.len()
    ))
}

/// Files (with their content and mtime) and directories' mtimes, before or after Kiln's
/// changes.
#[derive(Debug, Clone, Default)]
struct Changes {
    files: BTreeMap<String, MadeFile>,
    dir_mtimes: BTreeMap<String, (i64, u32)>,
}

/// Writes new content through Kiln to each of `paths` and makes [`KILN_ADDS`]; each with the
/// mtime Kiln reports after, and that of the directory it added to.
async fn change_through_kiln(volume: &Volume, paths: &[String]) -> anyhow::Result<Changes> {
    let creds = Creds::root();
    let mut changed = Changes::default();
    for (i, path) in paths.iter().chain([&KILN_ADDS.to_owned()]).enumerate() {
        let content = content(format!("{path} changed by Kiln").as_bytes(), Some(2000 + i));
        let at = format!("/{path}");
        volume
            .write_file(&creds, &at, Bytes::from(content.clone()), 0o644)
            .await?;
        ensure!(
            volume.read_to_end(&creds, &at).await? == content,
            "{at} reads back otherwise through Kiln"
        );
        let mtime = mtime_of(&volume.resolve(&creds, &at).await?);
        changed
            .files
            .insert(path.clone(), MadeFile { content, mtime });
    }
    let (dir, _) = KILN_ADDS.rsplit_once('/').context("a directory")?;
    let mtime = mtime_of(&volume.resolve(&creds, &format!("/{dir}")).await?);
    changed.dir_mtimes.insert(dir.to_owned(), mtime);
    Ok(changed)
}

/// Checks through GlusterFS's mount that each file Kiln `changed` shows its new content and
/// the mtime Kiln reported — another than it had `before` — but [`CONTROL`] its stale one;
/// and that each directory shows the mtime Kiln reported, another than `before`.
fn check_changes(client: &Client, changed: &Changes, before: &Changes) -> anyhow::Result<String> {
    let mut failures = Vec::new();
    for (path, file) in &changed.files {
        let on_mount = client.path(path.as_bytes());
        let data = std::fs::read(&on_mount).with_context(|| format!("read /{path}"))?;
        let shown = mtime_on(&std::fs::metadata(&on_mount)?);
        let old = before.files.get(path).map(|f| f.mtime);
        ensure!(
            old != Some(file.mtime),
            "/{path}: Kiln's write left its mtime {old:?}"
        );
        let want = match old {
            Some(old) if path == CONTROL => old,
            _ => file.mtime,
        };
        if data != file.content || shown != want {
            failures.push(format!(
                "/{path}: GlusterFS shows {} bytes {} Kiln wrote, mtime {shown:?}; Kiln \
                 reported {:?}, the mtime before was {old:?}",
                data.len(),
                if data == file.content {
                    "as"
                } else {
                    "unlike what"
                },
                file.mtime
            ));
        }
    }
    for (dir, mtime) in &changed.dir_mtimes {
        let shown = mtime_on(&std::fs::metadata(client.path(dir.as_bytes()))?);
        let old = before.dir_mtimes.get(dir);
        ensure!(old != Some(mtime), "/{dir}: Kiln's create left its mtime");
        if shown != *mtime {
            failures.push(format!(
                "/{dir}: GlusterFS shows mtime {shown:?}; Kiln reported {mtime:?}, the mtime \
                 before was {old:?}"
            ));
        }
    }
    ensure!(
        failures.is_empty(),
        "GlusterFS does not show Kiln's changes:\n{}",
        failures.join("\n")
    );
    Ok(format!(
        "GlusterFS shows the {} files Kiln then changed or made with their content and mtime, \
         the directory it added to with its mtime, and the control (mdata put back) with its \
         stale mtime",
        changed.files.len() - 1
    ))
}

/// The objects of `bricks`' named trees (not `.glusterfs`) carrying [`MDATA_XATTR`]: (brick,
/// path from the root).
fn objects_with_mdata(bricks: &[PathBuf]) -> anyhow::Result<Vec<(usize, String)>> {
    let mut found = Vec::new();
    for (b, brick) in bricks.iter().enumerate() {
        let mut paths = vec![brick.clone()];
        while let Some(path) = paths.pop() {
            if xattr(&path, MDATA_XATTR).is_some() {
                let rel = path.strip_prefix(brick)?;
                found.push((b, rel.to_string_lossy().into_owned()));
            }
            if !std::fs::symlink_metadata(&path)?.is_dir() {
                continue;
            }
            for entry in std::fs::read_dir(&path)? {
                let entry = entry?;
                if path != *brick || entry.file_name() != ".glusterfs" {
                    paths.push(entry.path());
                }
            }
        }
    }
    Ok(found)
}

/// Where file `path` (from the root) has its data on `bricks`: the one brick holding it that
/// is not a link file.
fn data_on_disk(bricks: &[PathBuf], path: &str) -> anyhow::Result<PathBuf> {
    let at = At::split(path.as_bytes());
    match on_disk(bricks, &at)[..] {
        [(b, false)] => Ok(bricks[b].join(path)),
        ref found => bail!("{at}: (brick, is a link file) {found:?}"),
    }
}

/// The volume this test set up, and the glusterd serving it.
struct Gluster {
    volume: String,
    host: String,
    /// In the volume's order: brick `i` is `VOLUME-client-i`.
    bricks: Vec<PathBuf>,
    logs: PathBuf,
    /// glusterd, when this test started it.
    glusterd: Option<Child>,
    created: bool,
    started: bool,
    brick_pids: Vec<Pid>,
    mounts: Vec<PathBuf>,
    commands: usize,
    torn_down: bool,
    /// Bricks, mount points and logs; removed last, after the teardown.
    dir: tempfile::TempDir,
}
impl Gluster {
    /// The volume this test sets up on new, empty brick directories, started.
    fn set_up() -> anyhow::Result<Gluster> {
        let mut g = Gluster::new(format!("kilndht{}", std::process::id()))?;
        g.serve()?;
        Ok(g)
    }

    /// A harness for volume `volume` over [`BRICKS`] new, empty brick directories; nothing
    /// runs yet.
    fn new(volume: String) -> anyhow::Result<Gluster> {
        let dir = tempfile::tempdir()?;
        let logs = dir.path().join("logs");
        std::fs::create_dir(&logs)?;
        let bricks: Vec<PathBuf> = (0..BRICKS)
            .map(|i| dir.path().join(format!("brick{i}")))
            .collect();
        for brick in &bricks {
            std::fs::create_dir(brick)?;
        }
        Ok(Gluster {
            volume,
            host: String::new(),
            bricks,
            logs,
            glusterd: None,
            created: false,
            started: false,
            brick_pids: Vec::new(),
            mounts: Vec::new(),
            commands: 0,
            torn_down: true,
            dir,
        })
    }

    /// Serves the brick directories as the volume, in their order: starts glusterd if none
    /// runs, creates the volume and starts it. After a [`Gluster::tear_down`] it serves them
    /// again as a new volume of the same name.
    fn serve(&mut self) -> anyhow::Result<()> {
        self.torn_down = false;
        if !process_named("glusterd") {
            let log = self.logs.join("glusterd.log");
            let glusterd = Command::new(which("glusterd").context("glusterd")?)
                .arg("-N")
                .arg(format!("--log-file={}", log.display()))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("start glusterd -N")?;
            self.glusterd = Some(glusterd);
        }
        self.wait_for_glusterd()?;
        self.create_volume()?;
        self.place_every_file_on_its_hashed_brick()?;
        self.start_volume()
    }

    /// Runs `kiln-brickd format` on `brick` (bounded, logged like every command); its output.
    fn kiln_format(&mut self, brick: &Path) -> anyhow::Result<String> {
        let mut format = Command::new(common::bin("kiln-brickd"));
        self.run(format.arg("format").arg(brick), GLUSTER_TIMEOUT)
    }

    /// Runs `cmd` (bounded), its output going to a log file; that output, or an error with it.
    fn run(&mut self, cmd: &mut Command, timeout: Duration) -> anyhow::Result<String> {
        self.commands += 1;
        let log_path = self.logs.join(format!("command-{:03}.log", self.commands));
        let shown = format!("{cmd:?}");
        let log = std::fs::File::create(&log_path)?;
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let mut child = cmd.spawn().with_context(|| format!("cannot run {shown}"))?;
        let status = wait_bounded(&mut child, timeout);
        let mut output = String::new();
        std::fs::File::open(&log_path)?.read_to_string(&mut output)?;
        match status {
            Some(status) if status.success() => Ok(output),
            Some(status) => bail!("{shown} failed ({status}): {}", output.trim()),
            None => bail!(
                "{shown} did not finish within {timeout:?}: {}",
                output.trim()
            ),
        }
    }

    fn gluster(&mut self, args: &[&str]) -> anyhow::Result<String> {
        let mut cmd = Command::new(which("gluster").context("gluster")?);
        cmd.arg("--mode=script")
            .arg(format!("--timeout={GLUSTER_CLI_TIMEOUT_S}"))
            .args(args)
            .env("LC_ALL", "C");
        self.run(&mut cmd, GLUSTER_TIMEOUT)
    }

    fn wait_for_glusterd(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let Err(last) = self.gluster(&["pool", "list"]) else {
                return Ok(());
            };
            if let Some(status) = self
                .glusterd
                .as_mut()
                .and_then(|d| d.try_wait().ok().flatten())
            {
                bail!("glusterd -N exited ({status}) before answering: {last:#}");
            }
            ensure!(
                Instant::now() < deadline,
                "glusterd did not answer within {READY_TIMEOUT:?}: {last:#}"
            );
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// Creates the volume on the first name of this host glusterd takes for a brick (it
    /// refuses 127.0.0.1 and localhost).
    fn create_volume(&mut self) -> anyhow::Result<()> {
        let mut refused = Vec::new();
        for host in self.host_candidates() {
            let volume = self.volume.clone();
            let bricks: Vec<String> = self
                .bricks
                .iter()
                .map(|b| format!("{host}:{}", b.display()))
                .collect();
            let mut args = vec!["volume", "create", &volume];
            args.extend(bricks.iter().map(String::as_str));
            args.push("force");
            match self.gluster(&args) {
                Ok(_) => {
                    self.host = host;
                    self.created = true;
                    return Ok(());
                }
                Err(e) => refused.push(format!("{host}: {e:#}")),
            }
        }
        bail!(
            "glusterd created the volume on no name of this host:\n{}",
            refused.join("\n")
        )
    }

    /// Turns off GlusterFS's placement by free space: with less than `cluster.min-free-disk`
    /// (10%) or `cluster.min-free-inodes` (5%) free on the hashed brick — a nearly full test
    /// machine — it creates a file elsewhere behind a link file, and the test's placement
    /// checks would wrongly fail.
    fn place_every_file_on_its_hashed_brick(&mut self) -> anyhow::Result<()> {
        let volume = self.volume.clone();
        for option in ["cluster.min-free-disk", "cluster.min-free-inodes"] {
            self.gluster(&["volume", "set", &volume, option, "0"])?;
        }
        Ok(())
    }

    /// This host's names for a brick: its host name, then the addresses `hostname -I` lists.
    fn host_candidates(&mut self) -> Vec<String> {
        let mut hosts = vec![
            rustix::system::uname()
                .nodename()
                .to_string_lossy()
                .into_owned(),
        ];
        if let Ok(addresses) = self.run(Command::new("hostname").arg("-I"), GLUSTER_TIMEOUT) {
            hosts.extend(addresses.split_whitespace().map(str::to_owned));
        }
        hosts.retain(|h| !h.is_empty());
        hosts.dedup();
        hosts
    }

    /// Starts the volume and waits (bounded) until all its bricks are online.
    fn start_volume(&mut self) -> anyhow::Result<()> {
        let volume = self.volume.clone();
        self.gluster(&["volume", "start", &volume])?;
        self.started = true;
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let status = self.gluster(&["volume", "status", &volume, "--xml"])?;
            let online = online_brick_pids(&status);
            if online.len() == BRICKS {
                self.brick_pids = online;
                return Ok(());
            }
            ensure!(
                Instant::now() < deadline,
                "{} of {BRICKS} bricks online after {READY_TIMEOUT:?}:\n{status}",
                online.len()
            );
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// Mounts the volume with its FUSE client in `locale` (which glibc must have: in another
    /// one the client would match the rsync regex differently), which munges rsync names as
    /// `munging` says.
    fn mount(&mut self, locale: &str, munging: Munging) -> anyhow::Result<Client> {
        let normal = |l: &str| l.to_ascii_lowercase().replace('-', "");
        let known = self.run(Command::new("locale").arg("-a"), MOUNT_TIMEOUT)?;
        ensure!(
            known.lines().any(|l| normal(l) == normal(locale)),
            "locale {locale} is not available (`locale -a`): the test needs it for the client"
        );
        // The same point again when the volume is served again.
        let point = self.dir.path().join(format!("mount-{locale}"));
        std::fs::create_dir_all(&point)?;
        let log = self.logs.join(format!("mount-{locale}.log"));
        let mut cmd = Command::new(which("mount").context("mount")?);
        cmd.args(["-t", "glusterfs", "-o"])
            .arg(format!("log-file={}", log.display()))
            .arg(format!("{}:/{}", self.host, self.volume))
            .arg(&point)
            .env("LC_ALL", locale);
        self.run(&mut cmd, MOUNT_TIMEOUT)?;
        self.mounts.push(point.clone());
        wait_all_connected(&log)?;
        Ok(Client {
            mount: point,
            munging,
        })
    }

    /// The layout of every directory of `tree`, each checked by [`Gluster::layout`].
    fn layouts(&self, tree: &Tree) -> anyhow::Result<Layouts> {
        tree.dirs
            .iter()
            .map(|(dir, d)| {
                // The root's layout is written when the volume starts, under no commit hash;
                // a new directory's under the volume's (0: never rebalanced).
                let commit_hash = if dir.is_empty() {
                    COMMIT_HASH_INVALID
                } else {
                    0
                };
                anyhow::Ok((dir.clone(), self.layout(dir, &d.made_at, commit_hash)?))
            })
            .collect()
    }

    /// The layout of directory `dir` (its path from the root) as the bricks store it, checked
    /// against the one Kiln builds for a directory made at `made_at`.
    fn layout(&self, dir: &[u8], made_at: &[u8], commit_hash: u32) -> anyhow::Result<Layout> {
        let mut disk = Vec::new();
        for brick in &self.bricks {
            let at = brick.join(OsStr::from_bytes(dir));
            let mut value = [0u8; 64];
            let len = rustix::fs::getxattr(&at, XATTR_NAME, &mut value[..])
                .with_context(|| format!("getxattr {XATTR_NAME} on {}", at.display()))?;
            disk.push(Some(DiskLayout::decode(&value[..len])?));
        }
        let layout = Layout::from_disk(&disk)?;
        layout.check()?;
        // GlusterFS weighs by size (`cluster.weighted-rebalance` on) when it knows the bricks'
        // sizes by then, else equally; the bricks share one file system, but the float
        // arithmetic of a weighted share can differ from an equal one by a hash.
        let stat = rustix::fs::statvfs(&self.bricks[0])?;
        let size = size_chunks(stat.f_blocks, stat.f_bsize);
        let path = [&b"/"[..], made_at].concat();
        let first = first_brick(&path, BRICKS)?;
        let candidates = [
            weights_for(&[Some(size); BRICKS], true),
            weights_for(&[Some(size); BRICKS], false),
        ];
        let built: Vec<Layout> = candidates
            .iter()
            .map(|weights| Layout::new_directory(weights, first, commit_hash))
            .collect::<Result<_, _>>()?;
        ensure!(
            built.contains(&layout),
            "GlusterFS laid {} out as {:?}, Kiln as {:?}",
            path.escape_ascii(),
            ranges(&layout),
            ranges(&built[0])
        );
        Ok(layout)
    }

    /// Checks that every file of `tree` is on the brick its directory's layout hashes its
    /// name to, with the munging of the client that named it; how many it checked.
    fn check_tree_placement(&self, tree: &Tree, layouts: &Layouts) -> anyhow::Result<usize> {
        let mut checked = 0;
        for (dir, d) in &tree.dirs {
            let layout = layouts.get(dir).context("a layout for every directory")?;
            for munging in [Munging::RsyncUtf8, Munging::RsyncBytes] {
                let names: Vec<&[u8]> = d
                    .entries
                    .iter()
                    .filter(|(_, e)| matches!(e, Entry::File { munging: m, .. } if *m == munging))
                    .map(|(name, _)| name.as_slice())
                    .collect();
                checked += self.check_placement(dir, layout, &names, munging)?;
            }
        }
        Ok(checked)
    }

    /// Checks that each of `names` in `dir` is on the brick `layout` hashes it to; how many
    /// it checked.
    fn check_placement(
        &self,
        dir: &[u8],
        layout: &Layout,
        names: &[&[u8]],
        munging: Munging,
    ) -> anyhow::Result<usize> {
        let mut wrong = Vec::new();
        for name in names {
            let found = self.hashed_brick_on_disk(&At::new(dir, name))?;
            let predicted = layout.hashed_brick(name, munging);
            if found != predicted {
                wrong.push(format!(
                    "{} (hash {:08x}, {munging:?}): on brick {found:?}, Kiln says {predicted:?}",
                    name.escape_ascii(),
                    name_hash(name, munging),
                ));
            }
        }
        ensure!(
            wrong.is_empty(),
            "{} of {} names in /{} are not where Kiln predicts (layout {:?}):\n{}",
            wrong.len(),
            names.len(),
            dir.escape_ascii(),
            ranges(layout),
            wrong.join("\n")
        );
        Ok(names.len())
    }

    /// The brick GlusterFS hashed `at` to: the one with a link file for it, else the one
    /// brick that holds it.
    fn hashed_brick_on_disk(&self, at: &At) -> anyhow::Result<Option<usize>> {
        let found = on_disk(&self.bricks, at);
        if let Some(&(b, _)) = found.iter().find(|(_, link_file)| *link_file) {
            return Ok(Some(b));
        }
        ensure!(found.len() <= 1, "{at} is on bricks {found:?}");
        Ok(found.first().map(|&(b, _)| b))
    }

    /// Checks what `m` left on the bricks: the data under the new name on the brick that held
    /// it, and a link file — `---------T`, empty, `trusted.glusterfs.dht.linkto` naming the
    /// data's brick `VOLUME-client-N` — on the brick the new name hashes to.
    fn check_link_file(&self, m: &Move) -> anyhow::Result<()> {
        let found = on_disk(&self.bricks, &m.to);
        ensure!(
            found.len() == 2
                && found.contains(&(m.home, false))
                && found.contains(&(m.hashed, true)),
            "{m}: GlusterFS left no link file as expected; (brick, is a link file) holding {}: \
             {found:?}",
            m.to
        );
        let link = self.bricks[m.hashed].join(OsStr::from_bytes(&m.to.path()));
        let meta = std::fs::symlink_metadata(&link)?;
        let linkto = xattr(&link, LINKTO_XATTR).unwrap_or_default();
        let linkto = linkto.strip_suffix(b"\0").unwrap_or(&linkto);
        let want = format!("{}-client-{}", self.volume, m.home);
        ensure!(
            meta.is_file()
                && meta.mode() & 0o7777 == 0o1000
                && meta.len() == 0
                && linkto == want.as_bytes(),
            "{m}: {} is not a link file to {want}: mode {:o}, {} bytes, {LINKTO_XATTR} \"{}\"",
            link.display(),
            meta.mode(),
            meta.len(),
            linkto.escape_ascii()
        );
        Ok(())
    }

    /// Checks that renaming [`RSYNC_TEMP`] to [`RSYNC_FINAL`] left the data on the brick both
    /// hash to (rsync's temporary names hash as their final names) and no link file.
    fn check_rsync_rename(&self, root: &Layout) -> anyhow::Result<()> {
        let hashed = root.hashed_brick(RSYNC_FINAL, Munging::RsyncUtf8);
        ensure!(
            hashed == root.hashed_brick(RSYNC_TEMP, Munging::RsyncUtf8),
            "{} and {} hash to different bricks",
            RSYNC_TEMP.escape_ascii(),
            RSYNC_FINAL.escape_ascii()
        );
        let found = on_disk(&self.bricks, &At::new(b"", RSYNC_FINAL));
        ensure!(
            hashed.is_some_and(|h| found == [(h, false)]),
            "renaming {} to {} should leave the data on brick {hashed:?} and no link file; \
             (brick, is a link file): {found:?}",
            RSYNC_TEMP.escape_ascii(),
            RSYNC_FINAL.escape_ascii()
        );
        Ok(())
    }

    /// Checks that each brick directory is still a brick once GlusterFS let go of it: its
    /// root keeps the root GFID (what `kiln-brickd` adopts a brick by).
    fn check_bricks_kept(&self) -> anyhow::Result<()> {
        for brick in &self.bricks {
            let gfid = xattr(brick, "trusted.gfid");
            ensure!(
                gfid.as_deref() == Some(&Gfid::ROOT.as_bytes()[..]),
                "{}: trusted.gfid is {gfid:?} after `gluster volume delete`, not the root GFID",
                brick.display()
            );
        }
        Ok(())
    }

    /// Unmounts, stops and deletes the volume, and stops what this test started; every step
    /// runs even if one before it failed, and the first failure is returned. Afterwards no
    /// GlusterFS process serves the bricks and glusterd knows nothing of them; the brick
    /// directories stay (until `dir` is dropped).
    fn tear_down(&mut self) -> anyhow::Result<()> {
        self.torn_down = true;
        let mut failures = Vec::new();
        let mounts = std::mem::take(&mut self.mounts);
        for point in mounts.iter().rev() {
            let mut umount = Command::new("umount");
            if let Err(e) = self.run(umount.arg(point), MOUNT_TIMEOUT) {
                failures.push(format!("{e:#}"));
                let mut lazy = Command::new("umount");
                let _ = self.run(lazy.arg("-l").arg(point), MOUNT_TIMEOUT);
            }
        }
        let volume = self.volume.clone();
        if std::mem::take(&mut self.started)
            && let Err(e) = self.gluster(&["volume", "stop", &volume, "force"])
        {
            failures.push(format!("{e:#}"));
        }
        if std::mem::take(&mut self.created)
            && let Err(e) = self.gluster(&["volume", "delete", &volume])
        {
            failures.push(format!("{e:#}"));
        }
        for pid in std::mem::take(&mut self.brick_pids) {
            end_process(pid, "glusterfsd");
        }
        if let Some(mut glusterd) = self.glusterd.take() {
            stop_child(&mut glusterd);
        }
        match failures.first() {
            None => Ok(()),
            Some(first) => bail!("tearing GlusterFS down: {first}"),
        }
    }
}

impl Drop for Gluster {
    fn drop(&mut self) {
        if !self.torn_down
            && let Err(e) = self.tear_down()
        {
            eprintln!("{e:#}");
        }
    }
}

/// Waits for `child` to exit; kills it after `timeout`. Its status, if it exited in time.
fn wait_bounded(child: &mut Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(POLL_INTERVAL),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

/// SIGTERM, a bounded wait, then SIGKILL, for a process this test spawned.
fn stop_child(child: &mut Child) {
    if let Some(pid) = i32::try_from(child.id()).ok().and_then(Pid::from_raw) {
        let _ = rustix::process::kill_process(pid, Signal::TERM);
    }
    let _ = wait_bounded(child, STOP_TIMEOUT);
}

/// Ends `pid` if it is still a process named `name` (a volume stop normally ends its brick
/// processes; a reused pid is left alone).
fn end_process(pid: Pid, name: &str) {
    let alive = || {
        std::fs::read_to_string(format!("/proc/{}/comm", pid.as_raw_nonzero()))
            .is_ok_and(|comm| comm.trim() == name)
    };
    if !alive() {
        return;
    }
    let _ = rustix::process::kill_process(pid, Signal::TERM);
    let deadline = Instant::now() + STOP_TIMEOUT;
    while alive() && Instant::now() < deadline {
        std::thread::sleep(POLL_INTERVAL);
    }
    if alive() {
        let _ = rustix::process::kill_process(pid, Signal::KILL);
    }
}

/// Whether a process named `name` runs.
fn process_named(name: &str) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    entries.filter_map(Result::ok).any(|entry| {
        std::fs::read_to_string(entry.path().join("comm")).is_ok_and(|comm| comm.trim() == name)
    })
}

/// Waits (bounded) until the FUSE client logging to `log` has reached every brick: `mount`
/// returns before the client has, and a brick not reached yet hides its files (ENOTCONN).
fn wait_all_connected(log: &Path) -> anyhow::Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let connected: BTreeSet<&str> = (text.lines())
            .filter(|l| l.contains("Connected, attached to remote volume"))
            .filter_map(|l| l.split_whitespace().find(|w| w.contains("-client-")))
            .collect();
        if connected.len() >= BRICKS {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "the GlusterFS client reached {} of {BRICKS} bricks after {READY_TIMEOUT:?}; see {}",
            connected.len(),
            log.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The pids of the online bricks in `gluster volume status VOL --xml`.
fn online_brick_pids(xml: &str) -> Vec<Pid> {
    xml.split("<node>")
        .skip(1)
        .filter_map(|node| {
            let node = &node[..node.find("</node>")?];
            let field = |name: &str| {
                let open = format!("<{name}>");
                let start = node.find(&open)? + open.len();
                let len = node[start..].find('<')?;
                Some(node[start..start + len].trim())
            };
            if field("status")? != "1" {
                return None;
            }
            Pid::from_raw(field("pid")?.parse().ok()?)
        })
        .collect()
}
