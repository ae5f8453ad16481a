//! The distribution layer over three real `kiln-brickd`s: files land on the brick their
//! name hashes to, layouts are on every brick's copy of a directory, listings show each name
//! once, renames and hard links across bricks leave GlusterFS link files, RMDIR keeps a
//! directory that still has entries on some brick, STATFS sums the bricks.

mod common;
mod mount_common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::{Brickd, Cluster, runtime};
use kiln_client::distribute::{DiskLayout, Distribute, LINKTO_XATTR, Munging, XATTR_NAME};
use kiln_client::{BrickClient, Error, Layer, LayerExt, Paths};
use kiln_wire::{Creds, ErrorCode, FileType, FopReply, Gfid, Name, RenameMode};

const BRICKS: usize = 3;
const FILES: usize = 120;

/// Three bricks of one cluster, served.
struct Volume {
    cluster: Cluster,
    bricks: Vec<PathBuf>,
    brickds: Vec<Brickd>,
}

impl Volume {
    fn start() -> Volume {
        let cluster = Cluster::new();
        let mut bricks = vec![cluster.brick.clone()];
        bricks.extend((1..BRICKS).map(|n| cluster.add_brick(n)));
        let brickds = bricks
            .iter()
            .map(|b| cluster.start_brick(b, "127.0.0.1:0", &[]))
            .collect();
        Volume {
            cluster,
            bricks,
            brickds,
        }
    }

    async fn connect(&self) -> Distribute<BrickClient> {
        let mut bricks = Vec::new();
        for brickd in &self.brickds {
            bricks.push(self.cluster.connect(brickd.addr, "alice").await);
        }
        Distribute::new(bricks, "dist").expect("a volume")
    }

    /// The volume over [`Racing`] brick clients, none armed.
    async fn connect_racing(&self) -> Distribute<Racing> {
        let mut bricks = Vec::new();
        for brickd in &self.brickds {
            bricks.push(Racing {
                below: self.cluster.connect(brickd.addr, "alice").await,
                volume: "dist".to_owned(),
                race: std::sync::Mutex::new((None, Race::Off)),
            });
        }
        Distribute::new(bricks, "dist").expect("a volume")
    }

    fn brick(&self, i: usize) -> &Path {
        &self.bricks[i]
    }

    /// The bricks on which `rel` exists.
    fn holders(&self, rel: &str) -> Vec<usize> {
        (0..BRICKS)
            .filter(|&i| self.brick(i).join(rel).symlink_metadata().is_ok())
            .collect()
    }
}

/// Closes the connections of `v`'s brick clients.
async fn close(v: &Distribute<BrickClient>) {
    for brick in v.bricks() {
        brick.close().await;
    }
}

/// A one-byte file `path` (holding "x") made through `v`.
async fn put_x<L: Layer>(v: &Distribute<L>, creds: &Creds, path: &str) {
    v.put(creds, path, Bytes::from_static(b"x"), 0o644)
        .await
        .expect("put");
}

/// Directory `path` made through `v`, and the brick each name in it hashes to.
async fn hashed_dir<L: Layer>(
    v: &Distribute<L>,
    creds: &Creds,
    path: &str,
) -> (kiln_wire::Iatt, impl Fn(&str) -> usize) {
    let dir = v.mkdir_all(creds, path, 0o755).await.expect("mkdir");
    let layout = v.layout(dir.gfid).await.expect("layout");
    let hashed = move |n: &str| {
        layout
            .hashed_brick(n.as_bytes(), Munging::default())
            .expect("a brick")
    };
    (dir, hashed)
}

/// RENAME of `from` to `to` in directory `dir`, replacing what is there.
fn rename_in(dir: Gfid, from: &str, to: &str) -> kiln_wire::FopRequest {
    kiln_wire::Rename {
        old_parent: dir,
        old_name: name(from),
        new_parent: dir,
        new_name: name(to),
        mode: RenameMode::Replace,
    }
    .into()
}

/// UNLINK of `n` in directory `parent`.
fn unlink_in(parent: Gfid, n: &str) -> kiln_wire::FopRequest {
    kiln_wire::Unlink {
        parent,
        name: name(n),
    }
    .into()
}

/// Each fop's answer in a BATCH reply: done, or its error.
fn answers(reply: &kiln_wire::BatchReply) -> Vec<Result<(), ErrorCode>> {
    reply
        .results
        .iter()
        .map(|r| r.as_ref().map(drop).map_err(|e| *e))
        .collect()
}

fn name(s: &str) -> Name {
    Name::new(s.to_owned()).expect("name")
}

/// The names directory `dir` lists (as root), sorted.
async fn sorted_names<L: Layer>(v: &Distribute<L>, dir: Gfid) -> Vec<String> {
    let listed = v.read_dir(&Creds::root(), dir).await.expect("readdir");
    let mut names: Vec<String> = listed.iter().map(|e| e.name.to_string()).collect();
    names.sort();
    names
}

/// Makes directory `dir_name` (mode 0750) in the root on bricks `on` only, as a MKDIR cut short
/// (or refused by a full brick) leaves it: its GFID.
async fn mkdir_on(v: &Distribute<BrickClient>, dir_name: &str, on: &[usize]) -> Gfid {
    let gfid = kiln_client::path::new_gfid();
    for (_, brick) in v.bricks().enumerate().filter(|(i, _)| on.contains(i)) {
        let mkdir = kiln_wire::Mkdir {
            parent: Gfid::ROOT,
            name: name(dir_name),
            gfid,
            mode: kiln_wire::Mode::new(0o750).expect("mode"),
            umask: kiln_wire::Mode::new(0).expect("mode"),
        };
        brick
            .call(&Creds::root(), mkdir.into())
            .await
            .expect("mkdir on one brick");
    }
    gfid
}

fn xattr(path: &Path, key: &str) -> Option<Vec<u8>> {
    let mut value = vec![0; 256];
    let n = rustix::fs::lgetxattr(path, key, &mut value).ok()?;
    value.truncate(n);
    Some(value)
}

fn link_file_target(path: &PathBuf) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let meta = path.symlink_metadata().ok()?;
    assert_eq!((meta.mode() & 0o7777, meta.len()), (0o1000, 0), "{path:?}");
    let value = xattr(path, LINKTO_XATTR)?;
    Some(
        String::from_utf8_lossy(&value)
            .trim_end_matches('\0')
            .to_owned(),
    )
}

/// The names of directory `dir`, sorted, listed in replies of about `size` bytes (READDIRP
/// with xattr presence, as the mount lists; the first, with `opened_listing`, from an
/// OPENDIR_LIST that asks for a read lease, granted where the bricks grant leases), and how
/// many the first reply held.
async fn list_in_replies<L: Layer>(
    v: &L,
    dir: Gfid,
    size: u32,
    opened_listing: bool,
) -> (Vec<String>, usize) {
    let creds = Creds::root();
    let size = kiln_wire::ReaddirSize::new(size).expect("a listing size");
    let (fd, mut first_reply) = if opened_listing {
        let read = kiln_wire::LeaseKind::Read;
        let (fd, lease, reply) = v.opendir_list(&creds, dir, size, read).await.expect("list");
        let granted = match v.leases() {
            true => read,
            false => kiln_wire::LeaseKind::None,
        };
        assert_eq!(lease, granted, "the lease every brick granted");
        (fd, Some(reply))
    } else {
        (v.opendir(&creds, dir).await.expect("opendir"), None)
    };
    let (mut names, mut offset, mut first) = (Vec::new(), 0, None);
    loop {
        let fop =
            kiln_client::FdFop::new(|fd| kiln_wire::ReaddirpXattrs { fd, offset, size }.into());
        let reply = match first_reply.take() {
            Some(reply) => reply,
            None => match v.call_fd(&creds, &fd, fop).await {
                Ok(FopReply::ReaddirpXattrs(reply)) => reply,
                other => panic!("READDIRP_XATTRS failed: {other:?}"),
            },
        };
        first.get_or_insert(reply.entries.len());
        for e in reply.entries {
            offset = e.offset;
            names.push(e.name.to_string());
        }
        if reply.eof {
            break;
        }
    }
    v.release(&creds, fd).await.expect("releasedir");
    if opened_listing {
        // Given back: an OPENDIR_LIST takes a lease only where the session holds none.
        let back = kiln_wire::Lease {
            gfid: dir,
            kind: kiln_wire::LeaseKind::None,
        };
        v.call(&creds, back.into()).await.expect("lease given back");
    }
    names.sort();
    (names, first.unwrap_or(0))
}

#[test]
fn files_spread_over_bricks_by_name_hash() {
    let volume = Volume::start();
    let rt = runtime();
    let creds = Creds::root();
    rt.block_on(async {
        let v = volume.connect().await;
        let dir = v.mkdir_all(&creds, "/d", 0o755).await.expect("mkdir");
        assert_eq!(
            volume.holders("d"),
            [0, 1, 2],
            "a directory is on every brick"
        );
        let layout = v.layout(dir.gfid).await.expect("layout");
        for i in 0..BRICKS {
            let disk = xattr(&volume.brick(i).join("d"), XATTR_NAME).expect("layout xattr");
            let disk = DiskLayout::decode(&disk).expect("decodes");
            assert_eq!(Some(disk), layout.disk_layout(i), "brick {i}");
        }
        layout.check().expect("no holes or overlaps");

        let mut per_brick = [0; BRICKS];
        for i in 0..FILES {
            let (file, data) = (format!("f{i}"), format!("file {i}"));
            v.put(&creds, &format!("/d/{file}"), Bytes::from(data), 0o644)
                .await
                .expect("put");
            let hashed = layout
                .hashed_brick(file.as_bytes(), Munging::default())
                .expect("a brick");
            assert_eq!(volume.holders(&format!("d/{file}")), [hashed], "{file}");
            per_brick[hashed] += 1;
        }
        assert!(per_brick.iter().all(|&n| n > FILES / 6), "{per_brick:?}");
        v.mkdir_all(&creds, "/d/sub", 0o755).await.expect("subdir");

        // Every name once, with its attributes; every file reads back.
        let listed = sorted_names(&v, dir.gfid).await;
        let mut want: Vec<String> = (0..FILES).map(|i| format!("f{i}")).collect();
        want.push("sub".into());
        want.sort();
        assert_eq!(listed, want);
        // A reply takes entries from brick after brick until it is full: in one reply when
        // they fit, and every name once over many small ones — opened and listed apart, or
        // as one OPENDIR_LIST on every brick at once.
        for opened_listing in [false, true] {
            let (one_reply, first_reply_entries) =
                list_in_replies(&v, dir.gfid, 128 * 1024, opened_listing).await;
            assert_eq!(one_reply, want);
            assert_eq!(
                first_reply_entries,
                want.len(),
                "the whole directory in one reply"
            );
            let (small_replies, first_reply_entries) =
                list_in_replies(&v, dir.gfid, 1024, opened_listing).await;
            assert_eq!(small_replies, want);
            assert!(
                first_reply_entries < 10,
                "{first_reply_entries} entries in 1 KiB"
            );
            // The first brick's ~40 entries whole, and the second's cut where the reply is
            // full (all of them read ahead by OPENDIR_LIST).
            let (replies, first_reply_entries) =
                list_in_replies(&v, dir.gfid, 8 * 1024, opened_listing).await;
            assert_eq!(replies, want);
            assert!(
                first_reply_entries > per_brick[0] && first_reply_entries < want.len() - 20,
                "{first_reply_entries} entries in 8 KiB, {per_brick:?} on the bricks"
            );
        }
        for i in (0..FILES).step_by(7) {
            let data = v
                .read_to_end(&creds, &format!("/d/f{i}"))
                .await
                .expect("read");
            assert_eq!(data, format!("file {i}").as_bytes());
        }
        let root = v.stat(&creds, Gfid::ROOT).await.expect("stat root");
        assert_eq!(root.file_type, FileType::Directory);
        close(&v).await;
    });
}

#[test]
fn renames_and_links_across_bricks_leave_link_files() {
    let volume = Volume::start();
    let rt = runtime();
    let creds = Creds::root();
    rt.block_on(async {
        let v = volume.connect().await;
        let (dir, hashed) = hashed_dir(&v, &creds, "/d").await;
        v.put(&creds, "/d/a", Bytes::from_static(b"data of a"), 0o644)
            .await
            .expect("put");
        let home = hashed("a");
        // A new name hashed to another brick.
        let moved = (0..)
            .map(|i| format!("b{i}"))
            .find(|n| hashed(n) != home)
            .expect("a name elsewhere");
        let a = v.resolve(&creds, "/d/a").await.expect("a");
        let rename = rename_in(dir.gfid, "a", &moved);
        v.call(&creds, rename).await.expect("rename");
        // The data stays where it was; the new name's hashed brick has a link file to it.
        assert_eq!(volume.holders(&format!("d/{moved}")), {
            let mut both = vec![home, hashed(&moved)];
            both.sort_unstable();
            both
        });
        let link = volume.brick(hashed(&moved)).join(format!("d/{moved}"));
        assert_eq!(link_file_target(&link), Some(format!("dist-client-{home}")));
        assert!(volume.holders("d/a").is_empty());
        let found = v
            .resolve(&creds, &format!("/d/{moved}"))
            .await
            .expect("lookup");
        assert_eq!((found.gfid, found.size), (a.gfid, 9));
        let data = v
            .read_to_end(&creds, &format!("/d/{moved}"))
            .await
            .expect("read");
        assert_eq!(data, b"data of a");
        let listed = v.read_dir(&creds, dir.gfid).await.expect("readdir");
        let names: Vec<String> = listed.iter().map(|e| e.name.to_string()).collect();
        assert_eq!(names, [moved.as_str()], "a link file is never listed");

        // A hard link under a name hashed elsewhere again.
        let other = (0..)
            .map(|i| format!("c{i}"))
            .find(|n| hashed(n) != home && *n != moved)
            .expect("another name");
        let link = kiln_wire::Link {
            gfid: a.gfid,
            new_parent: dir.gfid,
            new_name: name(&other),
        };
        v.call(&creds, link.into()).await.expect("link");
        let unlink = kiln_wire::Unlink {
            parent: dir.gfid,
            name: name(&moved),
        };
        v.call(&creds, unlink.into()).await.expect("unlink");
        assert!(
            volume.holders(&format!("d/{moved}")).is_empty(),
            "link file removed too"
        );
        let data = v
            .read_to_end(&creds, &format!("/d/{other}"))
            .await
            .expect("read link");
        assert_eq!(data, b"data of a");

        // A directory renamed is renamed on every brick; STATFS sums the bricks.
        v.mkdir_all(&creds, "/d/sub", 0o755).await.expect("sub");
        let rename = kiln_wire::Rename {
            old_parent: dir.gfid,
            old_name: name("sub"),
            new_parent: Gfid::ROOT,
            new_name: name("top"),
            mode: RenameMode::Replace,
        };
        v.call(&creds, rename.into()).await.expect("rename dir");
        assert_eq!(volume.holders("top"), [0, 1, 2]);
        let statfs = kiln_wire::Statfs { gfid: Gfid::ROOT };
        let FopReply::Statfs(total) = v.call(&creds, statfs.into()).await.expect("statfs") else {
            panic!("statfs")
        };
        let FopReply::Statfs(one) = v
            .bricks()
            .next()
            .expect("a brick")
            .call(&creds, kiln_wire::Statfs { gfid: Gfid::ROOT }.into())
            .await
            .expect("statfs of one")
        else {
            panic!("statfs")
        };
        assert!(
            total.stats.files >= 3 * one.stats.files - 100,
            "{total:?} {one:?}"
        );
        close(&v).await;
    });
}

/// What a [`Racing`] layer puts under a name right after an UNLINK of it passes.
#[derive(Debug, Clone, Copy)]
enum Race {
    /// Nothing (not armed, or done).
    Off,
    /// A link file of another object, as a rebalance moving that name's old file makes.
    OtherObject,
    /// A link file of this object, as a rebalance moving it makes.
    SameObject(Gfid),
    /// Not after an UNLINK: the name in `parent` unlinked right before the `linkto` of `gfid`
    /// is set here, as a client's unlink between a rebalance's destination and its mark.
    UnlinkBeforeMark { parent: Gfid, gfid: Gfid },
}

/// A brick client that, once armed, makes a link file under a name right after an UNLINK of
/// that name passes: what a rebalance's move does between a RENAME's removal of the new
/// name's link file and its make of the new one.
struct Racing {
    below: BrickClient,
    volume: String,
    race: std::sync::Mutex<(Option<Name>, Race)>,
}

impl Racing {
    fn arm(&self, name: &str, race: Race) {
        *self.race.lock().expect("lock") = (Some(self::name(name)), race);
    }

    async fn make_link_file(&self, parent: Gfid, name: Name, gfid: Gfid) {
        make_link_file(&self.below, &self.volume, (parent, name), gfid, 0).await;
    }

    /// Unlinks the armed name first when `fop` sets the `linkto` of its armed object.
    async fn unlink_before_mark(&self, fop: &kiln_wire::FopRequest) {
        let kiln_wire::FopRequest::Setxattr(set) = fop else {
            return;
        };
        let armed = {
            let mut armed = self.race.lock().expect("lock");
            match &*armed {
                (Some(name), Race::UnlinkBeforeMark { parent, gfid })
                    if *gfid == set.gfid && set.name.as_bytes() == LINKTO_XATTR.as_bytes() =>
                {
                    let unlink = kiln_wire::Unlink {
                        parent: *parent,
                        name: name.clone(),
                    };
                    *armed = (None, Race::Off);
                    Some(unlink)
                }
                _ => None,
            }
        };
        if let Some(unlink) = armed {
            let root = Creds::root();
            self.below.call(&root, unlink.into()).await.expect("unlink");
        }
    }
}

/// Makes `name` in `parent` on brick `on` a link file of object `gfid` of volume `volume`,
/// pointing to brick `home`.
async fn make_link_file(
    on: &BrickClient,
    volume: &str,
    (parent, name): (Gfid, Name),
    gfid: Gfid,
    home: usize,
) {
    let root = Creds::root();
    let mknod = kiln_wire::Mknod {
        parent,
        name,
        gfid,
        node_type: kiln_wire::NodeType::Regular,
        mode: kiln_wire::Mode::new(0o1000).expect("mode"),
        umask: kiln_wire::Mode::from_st_mode(0),
        rdev: 0,
    };
    on.call(&root, mknod.into()).await.expect("mknod");
    let set = kiln_wire::Setxattr {
        gfid,
        name: kiln_wire::XattrName::new(LINKTO_XATTR.as_bytes().to_vec()).expect("name"),
        value: kiln_wire::XattrValue::new(Bytes::from(format!("{volume}-client-{home}\0")))
            .expect("value"),
        mode: kiln_wire::XattrSetMode::Create,
    };
    on.call(&root, set.into()).await.expect("linkto");
}

fn random_gfid() -> Gfid {
    Gfid::from_bytes(uuid::Uuid::new_v4().into_bytes()).expect("gfid")
}

impl Layer for Racing {
    type Fd = <BrickClient as Layer>::Fd;

    async fn call(&self, creds: &Creds, fop: kiln_wire::FopRequest) -> Result<FopReply, Error> {
        let unlinked = match &fop {
            kiln_wire::FopRequest::Unlink(u) => Some((u.parent, u.name.clone())),
            _ => None,
        };
        self.unlink_before_mark(&fop).await;
        let reply = self.below.call(creds, fop).await;
        if let Some((parent, unlinked)) = unlinked {
            let race = {
                let mut armed = self.race.lock().expect("lock");
                match &*armed {
                    (Some(name), _) if *name == unlinked => {
                        std::mem::replace(&mut *armed, (None, Race::Off)).1
                    }
                    _ => Race::Off,
                }
            };
            match race {
                Race::Off | Race::UnlinkBeforeMark { .. } => {}
                Race::OtherObject => self.make_link_file(parent, unlinked, random_gfid()).await,
                Race::SameObject(gfid) => self.make_link_file(parent, unlinked, gfid).await,
            }
        }
        reply
    }

    async fn open(
        &self,
        creds: &Creds,
        gfid: Gfid,
        access: kiln_wire::AccessMode,
        flags: kiln_wire::OpenFlags,
    ) -> Result<Self::Fd, Error> {
        self.below.open(creds, gfid, access, flags).await
    }

    async fn create(
        &self,
        creds: &Creds,
        create: kiln_wire::Create,
    ) -> Result<(Self::Fd, kiln_wire::EntryReply), Error> {
        self.below.create(creds, create).await
    }

    async fn opendir(&self, creds: &Creds, gfid: Gfid) -> Result<Self::Fd, Error> {
        self.below.opendir(creds, gfid).await
    }

    async fn call_fd(
        &self,
        creds: &Creds,
        fd: &Self::Fd,
        fop: kiln_client::FdFop,
    ) -> Result<FopReply, Error> {
        self.below.call_fd(creds, fd, fop).await
    }

    async fn release(&self, creds: &Creds, fd: Self::Fd) -> Result<(), Error> {
        self.below.release(creds, fd).await
    }

    async fn batch(&self, batch: kiln_wire::Batch) -> Result<kiln_wire::BatchReply, Error> {
        self.below.batch(batch).await
    }

    fn leases(&self) -> bool {
        false
    }

    fn listed_attrs(&self) -> bool {
        false
    }

    fn events(&self) -> tokio::sync::broadcast::Receiver<kiln_client::LayerEvent> {
        self.below.events()
    }
}

/// A RENAME across bricks replaces the new name's link file; a rebalance moving a file under
/// that name may make one of its own between the removal and the make. The rename still
/// succeeds, and the name points at the renamed file: a link file of another object is
/// replaced, one of the renamed object pointed at its home.
#[test]
fn a_rename_survives_a_link_file_made_under_its_new_name_meanwhile() {
    let volume = Volume::start();
    let rt = runtime();
    let creds = Creds::root();
    rt.block_on(async {
        let v = volume.connect_racing().await;
        let (dir, hashed) = hashed_dir(&v, &creds, "/d").await;
        for (i, race) in ["other", "same"].into_iter().enumerate() {
            let source = format!("s{i}");
            v.put(
                &creds,
                &format!("/d/{source}"),
                Bytes::from(source.clone()),
                0o644,
            )
            .await
            .expect("put");
            let home = hashed(&source);
            let target = (0..)
                .map(|n| format!("t{i}-{n}"))
                .find(|n| hashed(n) != home)
                .expect("a name elsewhere");
            let object = v
                .resolve(&creds, &format!("/d/{source}"))
                .await
                .expect("source");
            let race = match race {
                "other" => Race::OtherObject,
                _ => Race::SameObject(object.gfid),
            };
            v.bricks()
                .nth(hashed(&target))
                .expect("brick")
                .arm(&target, race);
            let rename = kiln_wire::Rename {
                old_parent: dir.gfid,
                old_name: name(&source),
                new_parent: dir.gfid,
                new_name: name(&target),
                mode: RenameMode::Replace,
            };
            v.call(&creds, rename.into()).await.expect("rename");
            let link = volume.brick(hashed(&target)).join(format!("d/{target}"));
            assert_eq!(link_file_target(&link), Some(format!("dist-client-{home}")));
            let gfid = xattr(&link, "trusted.gfid").expect("gfid");
            assert_eq!(
                gfid,
                object.gfid.as_bytes(),
                "{race:?}: the renamed object's"
            );
            let data = v
                .read_to_end(&creds, &format!("/d/{target}"))
                .await
                .expect("read");
            assert_eq!(data, source.as_bytes());
        }
        for brick in v.bricks() {
            brick.below.close().await;
        }
    });
}

/// A link file whose object is gone from the brick it points to (a rebalance's move that
/// raced an unlink leaves one, as may a crash) holds its name for nothing: a lookup finds no
/// such name and removes it, and each make of the name succeeds — the hashed brick answers
/// EEXIST, the stale link file goes, and the make runs again.
#[test]
fn a_stale_link_file_is_removed_and_its_name_made_again() {
    let volume = Volume::start();
    let rt = runtime();
    let creds = Creds::root();
    rt.block_on(async {
        let v = volume.connect().await;
        let (dir, hashed) = hashed_dir(&v, &creds, "/d").await;
        let on_brick = |n: &str| volume.brick(hashed(n)).join(format!("d/{n}"));
        for n in [
            "looked-up",
            "put",
            "mkdir",
            "create-excl",
            "create",
            "batched",
        ] {
            let on = v.bricks().nth(hashed(n)).expect("brick");
            let home = (hashed(n) + 1) % BRICKS;
            make_link_file(on, "dist", (dir.gfid, name(n)), random_gfid(), home).await;
            assert!(link_file_target(&on_brick(n)).is_some(), "{n}: made");
        }
        let looked_up = v.resolve(&creds, "/d/looked-up").await;
        assert!(
            matches!(looked_up, Err(Error::Fop(ErrorCode::NoEnt))),
            "{looked_up:?}"
        );
        assert!(!on_brick("looked-up").exists(), "the lookup removed it");
        v.put(&creds, "/d/put", Bytes::from_static(b"put"), 0o644)
            .await
            .expect("put");
        let mkdir = kiln_wire::Mkdir {
            parent: dir.gfid,
            name: name("mkdir"),
            gfid: random_gfid(),
            mode: kiln_wire::Mode::new(0o755).expect("mode"),
            umask: kiln_wire::Mode::from_st_mode(0),
        };
        v.call(&creds, mkdir.into()).await.expect("mkdir");
        for (n, flags) in [
            ("create-excl", kiln_wire::OpenFlags::EXCL),
            ("create", kiln_wire::OpenFlags::empty()),
        ] {
            let create = kiln_wire::Create {
                parent: dir.gfid,
                name: name(n),
                gfid: random_gfid(),
                access: kiln_wire::AccessMode::ReadWrite,
                flags,
                mode: kiln_wire::Mode::new(0o644).expect("mode"),
                umask: kiln_wire::Mode::from_st_mode(0),
            };
            let (fd, entry) = v.create(&creds, create.clone()).await.expect(n);
            assert_eq!(entry.iatt.gfid, create.gfid, "{n}: the new file");
            v.release(&creds, fd).await.expect("release");
        }
        // In a BATCH (as a mount sends what it made behind): the one made on a stale link
        // file's name goes the whole way, beside one made on a free name.
        let mut batch = kiln_wire::Batch::new(creds.clone());
        for n in ["batched", "batched-free"] {
            let put = kiln_wire::Put {
                parent: dir.gfid,
                name: name(n),
                gfid: random_gfid(),
                mode: kiln_wire::Mode::new(0o644).expect("mode"),
                umask: kiln_wire::Mode::from_st_mode(0),
                flags: kiln_wire::OpenFlags::empty(),
                data: kiln_wire::Payload::new(Bytes::from_static(b"batched")).expect("data"),
                attr: kiln_wire::SetAttr::default(),
            };
            batch.push(put.into()).expect("batchable");
        }
        let answered = v.batch(batch).await.expect("batch");
        assert!(answered.results.iter().all(Result::is_ok), "{answered:?}");
        for (n, file_type) in [
            ("batched", FileType::Regular),
            ("batched-free", FileType::Regular),
            ("put", FileType::Regular),
            ("mkdir", FileType::Directory),
            ("create-excl", FileType::Regular),
            ("create", FileType::Regular),
        ] {
            let made = v.resolve(&creds, &format!("/d/{n}")).await.expect(n);
            assert_eq!(made.file_type, file_type, "{n}");
            let meta = on_brick(n).symlink_metadata().expect(n);
            assert!(xattr(&on_brick(n), LINKTO_XATTR).is_none(), "{n}: {meta:?}");
        }
        let data = v.read_to_end(&creds, "/d/put").await.expect("read");
        assert_eq!(data, b"put");

        // Removals in a BATCH: a name on its hashed brick, a name that is nowhere, and a name
        // whose hashed brick holds only a link file (its file was renamed from another brick).
        v.put(&creds, "/d/src", Bytes::from_static(b"src"), 0o644)
            .await
            .expect("put");
        let moved = (0..)
            .map(|i| format!("moved-{i}"))
            .find(|n| hashed(n) != hashed("src"))
            .expect("a name hashed elsewhere");
        let rename = rename_in(dir.gfid, "src", &moved);
        v.call(&creds, rename).await.expect("rename");
        assert!(link_file_target(&on_brick(&moved)).is_some(), "a link file");
        let mut batch = kiln_wire::Batch::new(creds.clone());
        for n in ["batched", "nowhere", moved.as_str()] {
            let unlink = kiln_wire::Unlink {
                parent: dir.gfid,
                name: name(n),
            };
            batch.push(unlink.into()).expect("batchable");
        }
        let answered = v.batch(batch).await.expect("batch");
        assert!(
            matches!(
                answered.results.as_slice(),
                [Ok(_), Err(ErrorCode::NoEnt), Ok(_)]
            ),
            "{answered:?}"
        );
        for n in ["batched", moved.as_str()] {
            assert_eq!(volume.holders(&format!("d/{n}")), [0_usize; 0], "{n}");
        }
        close(&v).await;
    });
}

/// A directory whose copy on some brick holds only stale link files (the listing shows it
/// empty) is removed: the stale link files go first. One holding a link file whose object
/// exists is not empty, and RMDIR leaves it whole.
#[test]
fn rmdir_removes_stale_link_files_but_not_live_ones() {
    let volume = Volume::start();
    let rt = runtime();
    let creds = Creds::root();
    rt.block_on(async {
        let v = volume.connect().await;
        let file = v
            .put(&creds, "/live", Bytes::from_static(b"live"), 0o644)
            .await
            .expect("put");
        let home = volume.holders("live")[0];
        for (n, d) in ["stale", "live"].into_iter().enumerate() {
            let dir = v
                .mkdir_all(&creds, &format!("/{d}-dir"), 0o755)
                .await
                .expect("mkdir");
            let on = (home + 1 + n) % BRICKS;
            let (gfid, to) = match d {
                "stale" => (random_gfid(), (on + 1) % BRICKS),
                _ => (file.gfid, home),
            };
            let below = v.bricks().nth(on).expect("brick");
            make_link_file(below, "dist", (dir.gfid, name("l")), gfid, to).await;
            let listed = v.read_dir(&creds, dir.gfid).await.expect("list");
            assert!(listed.is_empty(), "{d}: {listed:?}");
        }
        let rmdir = |n: &str| kiln_wire::Rmdir {
            parent: Gfid::ROOT,
            name: name(n),
        };
        v.call(&creds, rmdir("stale-dir").into())
            .await
            .expect("rmdir of a directory with stale link files only");
        assert!(
            volume.holders("stale-dir").is_empty(),
            "gone from every brick"
        );
        let refused = v.call(&creds, rmdir("live-dir").into()).await;
        assert!(
            matches!(refused, Err(Error::Fop(ErrorCode::NotEmpty))),
            "{refused:?}"
        );
        assert_eq!(volume.holders("live-dir").len(), BRICKS, "put back whole");
        assert_eq!(
            volume.holders("live-dir/l").len(),
            1,
            "the live link file stays"
        );
        close(&v).await;
    });
}

#[test]
fn rmdir_keeps_a_directory_that_is_not_empty_on_some_brick() {
    let volume = Volume::start();
    let rt = runtime();
    let creds = Creds::root();
    rt.block_on(async {
        let v = volume.connect().await;
        let dir = v.mkdir_all(&creds, "/d", 0o750).await.expect("mkdir");
        let layout = v.layout(Gfid::ROOT).await.expect("root layout");
        let dir_hashed = layout
            .hashed_brick(b"d", Munging::default())
            .expect("brick");
        let inner = v.layout(dir.gfid).await.expect("layout");
        // One file, on a brick that is not the directory's hashed one.
        let file = (0..)
            .map(|i| format!("f{i}"))
            .find(|n| inner.hashed_brick(n.as_bytes(), Munging::default()) != Some(dir_hashed))
            .expect("a name");
        put_x(&v, &creds, &format!("/d/{file}")).await;
        let rmdir = kiln_wire::Rmdir {
            parent: Gfid::ROOT,
            name: name("d"),
        };
        let refused = v
            .call(&creds, rmdir.clone().into())
            .await
            .expect_err("not empty");
        assert_eq!(refused, Error::Fop(ErrorCode::NotEmpty));
        assert_eq!(volume.holders("d"), [0, 1, 2], "every copy is back");
        for i in 0..BRICKS {
            let disk = xattr(&volume.brick(i).join("d"), XATTR_NAME).expect("layout back");
            assert_eq!(DiskLayout::decode(&disk).ok(), inner.disk_layout(i));
        }
        let unlink = kiln_wire::Unlink {
            parent: dir.gfid,
            name: name(&file),
        };
        v.call(&creds, unlink.into()).await.expect("unlink");
        v.call(&creds, rmdir.into()).await.expect("rmdir");
        assert!(volume.holders("d").is_empty());
        close(&v).await;
    });
    for i in 0..BRICKS {
        common::assert_brick_checks_clean(volume.brick(i));
    }
}

/// A layout read under a lease the layer holds stays in use past its lifetime, and not past
/// the lease: another client's write of the layout recalls the lease first, and the next use
/// reads the new one.
#[test]
fn a_layout_held_under_a_lease_is_read_again_once_another_client_rewrites_it() {
    let volume = Volume::start();
    let rt = runtime();
    let creds = Creds::root();
    rt.block_on(async {
        let a = volume.connect().await;
        let b = volume.connect().await;
        let dir = a.mkdir_all(&creds, "/d", 0o755).await.expect("mkdir");
        if !a.leases() {
            panic!("the bricks grant leases");
        }
        // A gives its lease back when it is recalled, as a mount does.
        let mut events = a.events();
        let lease = |kind| kiln_wire::Lease {
            gfid: dir.gfid,
            kind,
        };
        let write = kiln_wire::LeaseKind::Write;
        let granted = a.call(&creds, lease(write).into()).await.expect("lease");
        assert!(
            matches!(&granted, FopReply::Lease(r) if r.kind == write),
            "{granted:?}"
        );
        let held = a.layout(dir.gfid).await.expect("layout");
        tokio::time::sleep(kiln_client::distribute::LAYOUT_TTL + Duration::from_millis(100)).await;
        assert_eq!(
            a.layout(dir.gfid).await.expect("layout").disk_layout(0),
            held.disk_layout(0),
            "the same layout, past its lifetime"
        );
        // B swaps the shares of bricks 0 and 1 (as a fix-layout rewrites them).
        let (share0, share1) = (held.disk_layout(0), held.disk_layout(1));
        assert_ne!(share0, share1);
        let rewrite = async {
            for (i, share) in [(0, share1), (1, share0)] {
                let value = share.expect("a share").encode();
                let set = kiln_wire::Setxattr {
                    gfid: dir.gfid,
                    name: kiln_wire::XattrName::new(Bytes::from_static(XATTR_NAME.as_bytes()))
                        .expect("name"),
                    value: kiln_wire::XattrValue::new(Bytes::copy_from_slice(&value))
                        .expect("value"),
                    mode: kiln_wire::XattrSetMode::Upsert,
                };
                let brick = b.bricks().nth(i).expect("brick");
                brick.call(&creds, set.into()).await.expect("setxattr");
            }
        };
        let give_back = async {
            loop {
                match events.recv().await.expect("events") {
                    kiln_client::LayerEvent::Recall(r) if r.gfid == dir.gfid => break,
                    _ => {}
                }
            }
            // Straight to the bricks, not through A's layer: what A's layer learns of the
            // lease's end is the recall.
            for brick in a.bricks() {
                let none = kiln_wire::LeaseKind::None;
                brick
                    .call(&creds, lease(none).into())
                    .await
                    .expect("given back");
            }
        };
        tokio::join!(rewrite, give_back);
        let now = a.layout(dir.gfid).await.expect("layout");
        assert_eq!(
            (now.disk_layout(0), now.disk_layout(1)),
            (share1, share0),
            "the new layout"
        );
        close(&a).await;
        close(&b).await;
    });
}

/// A BATCH as `rm -rf` queues it (files, then their directory, then its parent), run in
/// waves across directories: each RMDIR after the removals in its directory, a make of the
/// same name after the RMDIR, and each answer the one it has in order — a directory still
/// holding a file refused (every copy put back), a parent left non-empty refused, a name
/// that is nowhere ENOENT.
#[test]
fn a_batch_removes_directories_after_their_files_and_answers_in_order() {
    let volume = Volume::start();
    let rt = runtime();
    let creds = Creds::root();
    rt.block_on(async {
        let v = volume.connect().await;
        let t = v.mkdir_all(&creds, "/t", 0o755).await.expect("mkdir");
        let mut dirs = Vec::new();
        for d in ["a", "b", "c"] {
            dirs.push(
                v.mkdir_all(&creds, &format!("/t/{d}"), 0o755)
                    .await
                    .expect(d),
            );
            for f in 0..5 {
                let path = format!("/t/{d}/f{f}");
                put_x(&v, &creds, &path).await;
            }
        }
        put_x(&v, &creds, "/t/top").await;
        let rmdir = |parent: Gfid, n: &str| kiln_wire::Rmdir {
            parent,
            name: name(n),
        };
        let mut batch = kiln_wire::Batch::new(creds.clone());
        let mut expected = Vec::new();
        for (d, dir) in ["a", "b"].into_iter().zip(&dirs) {
            for f in 0..5 {
                batch
                    .push(unlink_in(dir.gfid, &format!("f{f}")))
                    .expect("fits");
                expected.push(Ok(()));
            }
            batch.push(rmdir(t.gfid, d).into()).expect("fits");
            expected.push(Ok(()));
        }
        // c keeps one file.
        for f in 0..4 {
            batch
                .push(unlink_in(dirs[2].gfid, &format!("f{f}")))
                .expect("fits");
            expected.push(Ok(()));
        }
        let mkdir = kiln_wire::Mkdir {
            parent: t.gfid,
            name: name("a"),
            gfid: random_gfid(),
            mode: kiln_wire::Mode::new(0o755).expect("mode"),
            umask: kiln_wire::Mode::from_st_mode(0),
        };
        let tail: [(kiln_wire::FopRequest, Result<(), ErrorCode>); 5] = [
            (rmdir(t.gfid, "c").into(), Err(ErrorCode::NotEmpty)),
            (unlink_in(t.gfid, "top"), Ok(())),
            (rmdir(Gfid::ROOT, "t").into(), Err(ErrorCode::NotEmpty)),
            (mkdir.clone().into(), Ok(())),
            (rmdir(t.gfid, "nowhere").into(), Err(ErrorCode::NoEnt)),
        ];
        for (fop, answer) in tail {
            batch.push(fop).expect("fits");
            expected.push(answer);
        }
        let answered = v.batch(batch).await.expect("batch");
        assert_eq!(answers(&answered), expected);
        assert!(
            volume.holders("t/b").is_empty(),
            "b removed from every brick"
        );
        assert!(volume.holders("t/top").is_empty());
        assert_eq!(volume.holders("t/c"), [0, 1, 2], "every copy of c is back");
        assert_eq!(volume.holders("t/a"), [0, 1, 2], "a made again");
        let a = v.resolve(&creds, "/t/a").await.expect("a");
        assert_eq!(a.gfid, mkdir.gfid, "the new a");
        let c = v.resolve(&creds, "/t/c/f4").await.expect("c's last file");
        assert_eq!(c.file_type, FileType::Regular);
        close(&v).await;
    });
    for i in 0..BRICKS {
        common::assert_brick_checks_clean(volume.brick(i));
    }
}

/// UNLINKs of files that live on their hashed brick go to it as UNLINK_SETTLED, in one BATCH
/// per brick; those whose hashed brick holds a link file (renamed there from a name hashed
/// elsewhere) are refused there and removed where they live, link file and all — in a BATCH
/// and alone.
#[test]
fn unlinks_remove_files_where_they_live_and_their_link_files() {
    let volume = Volume::start();
    let rt = runtime();
    let creds = Creds::root();
    rt.block_on(async {
        let v = volume.connect().await;
        let (dir, hashed) = hashed_dir(&v, &creds, "/u").await;
        let mut moved = Vec::new();
        for i in 0..8 {
            let from = format!("f{i}");
            put_x(&v, &creds, &format!("/u/{from}")).await;
            let to = (0..)
                .map(|j| format!("g{i}-{j}"))
                .find(|to| hashed(to) != hashed(&from))
                .expect("a name hashed elsewhere");
            v.call(&creds, rename_in(dir.gfid, &from, &to))
                .await
                .expect("rename");
            assert_eq!(volume.holders(&format!("u/{to}")).len(), 2, "a link file");
            moved.push(to);
        }
        let plain: Vec<String> = (0..8).map(|i| format!("p{i}")).collect();
        for p in &plain {
            put_x(&v, &creds, &format!("/u/{p}")).await;
        }
        let unlink = |n: &str| unlink_in(dir.gfid, n);
        let (alone, batched) = ([&moved[0], &plain[0]], moved[1..].iter().chain(&plain[1..]));
        for n in alone {
            v.call(&creds, unlink(n)).await.expect("unlink alone");
        }
        let mut batch = kiln_wire::Batch::new(creds.clone());
        for n in batched.clone() {
            batch.push(unlink(n)).expect("fits");
        }
        batch.push(unlink("nowhere")).expect("fits");
        let answered = v.batch(batch).await.expect("batch");
        let mut expected = vec![Ok(()); batched.count()];
        expected.push(Err(ErrorCode::NoEnt));
        assert_eq!(answers(&answered), expected);
        for n in moved.iter().chain(&plain) {
            assert!(
                volume.holders(&format!("u/{n}")).is_empty(),
                "{n} everywhere gone"
            );
        }
        close(&v).await;
    });
    for i in 0..BRICKS {
        common::assert_brick_checks_clean(volume.brick(i));
    }
}

/// `kiln mount` of three bricks: programs see one tree (tar finds no directory changing as
/// it reads it); files spread over the bricks; a rename and a hard link across bricks and a
/// recursive removal work.
#[test]
fn a_mount_over_three_bricks_is_one_tree() {
    let m = mount_common::Mounted::distributed(BRICKS, &[]);
    let src = m.cluster.dir.path().join("src");
    mount_common::sh_ok(
        m.cluster.dir.path(),
        "mkdir src && cd src && for d in 1 2 3 4 5; do mkdir d$d; \
         for f in $(seq 1 40); do echo \"$d/$f\" > d$d/f$f; done; done && ln -s d1/f1 link",
    );
    let script = format!(
        "cp -a {src} tree && diff -r {src} tree && tar -cf {tar} -C tree . && \
         mv tree/d1/f1 tree/d2/moved && \
         ln tree/d2/moved tree/d3/hard && cat tree/d3/hard && ls tree/d1 | wc -l && \
         readlink tree/link && sync .",
        src = src.display(),
        tar = m.cluster.dir.path().join("tree.tar").display()
    );
    let out = mount_common::sh_ok(&m.mountpoint, &script);
    assert_eq!(out, "1/1\n39\nd1/f1\n", "{}", m.logs());
    let per_brick: Vec<usize> = m
        .brick_dirs()
        .into_iter()
        .map(|brick| {
            (1..=5)
                .map(|d| {
                    std::fs::read_dir(brick.join(format!("tree/d{d}"))).map_or(0, Iterator::count)
                })
                .sum()
        })
        .collect();
    assert!(
        per_brick.iter().all(|&n| n > 20),
        "files on each brick: {per_brick:?}"
    );
    // A directory's times are one whether a listing gave them or a STAT: each copy changes
    // as its brick's entries do, and the latest of them is the directory's.
    let fresh = m.path("fresh");
    let times = || {
        use std::os::unix::fs::MetadataExt;
        (1..=5)
            .map(|d| {
                let meta = std::fs::symlink_metadata(fresh.join(format!("d{d}"))).expect("stat");
                (
                    meta.ctime(),
                    meta.ctime_nsec(),
                    meta.mtime(),
                    meta.mtime_nsec(),
                )
            })
            .collect::<Vec<_>>()
    };
    mount_common::sh_ok(
        &m.mountpoint,
        "for d in 1 2 3 4 5; do mkdir -p fresh/d$d; \
         for f in $(seq 1 30); do echo $f > fresh/d$d/f$f; done; done",
    );
    let listed = std::fs::read_dir(&fresh).expect("readdir").count();
    assert_eq!(listed, 5);
    let from_listing = times();
    // (Once the kernel's attributes of them have expired: a LOOKUP's, merged.)
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(from_listing, times());
    // (`sync .`: the changes the mount made behind reach the bricks.)
    mount_common::sh_ok(
        &m.mountpoint,
        "rm -rf tree fresh && test -z \"$(ls -A)\" && sync .",
    );
    for (n, brick) in m.brick_dirs().iter().enumerate() {
        assert!(!brick.join("tree").exists(), "brick {n} still has the tree");
    }
}

#[test]
fn pjdfstest_passes_on_a_distributed_mount() {
    let m = mount_common::Mounted::distributed(BRICKS, &[]);
    mount_common::pjdfstest_passes(&m);
}

/// A directory whose MKDIR did not reach the first brick (full, or out of reach) is listed
/// once, from the first brick that has it, before any lookup heals it; one on every brick
/// once too.
#[test]
fn a_directory_missing_on_the_first_brick_is_listed_once() {
    let volume = Volume::start();
    let rt = runtime();
    let creds = Creds::root();
    rt.block_on(async {
        let v = volume.connect().await;
        v.mkdir_all(&creds, "/whole", 0o755).await.expect("mkdir");
        mkdir_on(&v, "late", &[1, 2]).await;
        assert_eq!(volume.holders("late"), [1, 2]);
        assert_eq!(sorted_names(&v, Gfid::ROOT).await, ["late", "whole"]);
    });
}

/// A directory that did not reach every brick, and a layout with a hole: a LOOKUP heals both,
/// and every file placed before stays reachable.
#[test]
fn lookup_heals_missing_directory_copies_and_layout_holes() {
    let volume = Volume::start();
    let rt = runtime();
    let creds = Creds::root();
    rt.block_on(async {
        let v = volume.connect().await;
        // "half" made on bricks 0 and 1 only, as a mkdir cut short would leave it.
        let gfid = mkdir_on(&v, "half", &[0, 1]).await;
        assert_eq!(volume.holders("half"), [0, 1]);
        let found = v.resolve(&creds, "/half").await.expect("lookup");
        assert_eq!(found.gfid, gfid);
        assert_eq!(
            volume.holders("half"),
            [0, 1, 2],
            "the missing copy is made"
        );
        assert_eq!(v.healed(), (1, 0));
        let layout = v.layout(gfid).await.expect("layout");
        layout.check().expect("a whole layout");
        for i in 0..BRICKS {
            assert!(
                xattr(&volume.brick(i).join("half"), XATTR_NAME).is_some(),
                "brick {i}"
            );
        }

        // A hole: brick 1's share of /d's layout is gone.
        let dir = v.mkdir_all(&creds, "/d", 0o755).await.expect("mkdir");
        for i in 0..30 {
            v.put(
                &creds,
                &format!("/d/f{i}"),
                Bytes::from(format!("{i}")),
                0o644,
            )
            .await
            .expect("put");
        }
        let no_share = DiskLayout {
            range: None,
            ..v.layout(dir.gfid)
                .await
                .expect("layout")
                .disk_layout(1)
                .expect("brick 1")
        };
        rustix::fs::lsetxattr(
            volume.brick(1).join("d").as_path(),
            XATTR_NAME,
            &no_share.encode(),
            rustix::fs::XattrFlags::REPLACE,
        )
        .expect("cut a hole");
        let fresh = volume.connect().await;
        assert!(
            fresh
                .layout(dir.gfid)
                .await
                .expect("layout")
                .check()
                .is_err()
        );
        fresh.resolve(&creds, "/d").await.expect("lookup heals");
        assert_eq!(fresh.healed(), (0, 1));
        let healed = fresh.layout(dir.gfid).await.expect("layout");
        healed.check().expect("no hole left");
        assert_eq!(
            healed.commit_hash(),
            kiln_client::distribute::COMMIT_HASH_INVALID
        );
        for i in 0..30 {
            let data = fresh
                .read_to_end(&creds, &format!("/d/f{i}"))
                .await
                .expect("read");
            assert_eq!(data, format!("{i}").as_bytes());
        }
        close(&v).await;
        close(&fresh).await;
    });
    for i in 0..BRICKS {
        common::assert_brick_checks_clean(volume.brick(i));
    }
}

/// What looks like a link file without being one is a file; an exchange across bricks is
/// refused with both files intact; a layer that knows fewer bricks than the layouts name (a
/// mount older than an add-brick) leaves the layouts alone.
#[test]
fn look_alike_link_files_exchanges_and_older_mounts() {
    let volume = Volume::start();
    let rt = runtime();
    let creds = Creds::root();
    rt.block_on(async {
        let v = volume.connect().await;
        let (dir, hashed) = hashed_dir(&v, &creds, "/d").await;

        // `touch sticky; chmod 1000 sticky`: empty, mode 01000, no linkto xattr.
        v.put(&creds, "/d/sticky", Bytes::new(), 0o1000)
            .await
            .expect("put");
        let listed = v.read_dir(&creds, dir.gfid).await.expect("readdir");
        assert!(
            listed.iter().any(|e| e.name.as_bytes() == b"sticky"),
            "{listed:?}"
        );
        let sticky = v.resolve(&creds, "/d/sticky").await.expect("lookup");
        assert_eq!((sticky.mode.bits(), sticky.size), (0o1000, 0));

        // Two files on two bricks: RENAME_EXCHANGE would need link files.
        let a = "a0";
        let b = (1..)
            .map(|i| format!("b{i}"))
            .find(|n| hashed(n) != hashed(a))
            .expect("b");
        v.put(&creds, &format!("/d/{a}"), Bytes::from_static(b"A"), 0o644)
            .await
            .expect("a");
        v.put(&creds, &format!("/d/{b}"), Bytes::from_static(b"B"), 0o644)
            .await
            .expect("b");
        let exchange = kiln_wire::Rename {
            old_parent: dir.gfid,
            old_name: name(a),
            new_parent: dir.gfid,
            new_name: name(&b),
            mode: RenameMode::Exchange,
        };
        let refused = v.call(&creds, exchange.into()).await.expect_err("exchange");
        assert_eq!(refused, Error::Fop(ErrorCode::CrossDevice));
        assert_eq!(
            v.read_to_end(&creds, &format!("/d/{a}")).await.expect("a"),
            b"A"
        );
        assert_eq!(
            v.read_to_end(&creds, &format!("/d/{b}")).await.expect("b"),
            b"B"
        );

        // A layer over the first two bricks only: /d's layout has a hole where brick 2's
        // share is, and that is no reason to rebuild it.
        let before = xattr(&volume.brick(2).join("d"), XATTR_NAME).expect("brick 2's share");
        let older = Distribute::new(v.bricks().take(2).cloned().collect(), "dist").expect("layer");
        older.resolve(&creds, "/d").await.expect("lookup");
        older.heal_tree(&creds).await.expect("heal walk");
        assert_eq!(older.healed(), (0, 0));
        assert_eq!(xattr(&volume.brick(2).join("d"), XATTR_NAME), Some(before));
        close(&v).await;
    });
}

/// A rebalance moving a file that a client unlinks between the move's destination (a link
/// file on the new hashed brick) and its mark on the source gives the move up, and removes
/// that destination too: no link file to nothing is left holding the name.
#[test]
fn a_move_raced_by_an_unlink_leaves_no_link_file() {
    let volume = Volume::start();
    let rt = runtime();
    let creds = Creds::root();
    rt.block_on(async {
        let plain = volume.connect().await;
        let two =
            Distribute::new(plain.bricks().take(2).cloned().collect(), "dist").expect("two bricks");
        two.mkdir_all(&creds, "/m", 0o755).await.expect("mkdir");
        for i in 0..20 {
            let path = format!("/m/f{i}");
            two.put(&creds, &path, Bytes::from(path.clone()), 0o640)
                .await
                .expect("put");
        }
        let all = volume.connect_racing().await;
        all.heal_tree(&creds).await.expect("fix-layout");
        let m = all.resolve(&creds, "/m").await.expect("/m");
        let layout = all.layout(m.gfid).await.expect("layout");
        let hashed = |n: &str| layout.hashed_brick(n.as_bytes(), Munging::default());
        let (moving, from) = (0..20)
            .map(|i| format!("f{i}"))
            .find_map(|f| {
                let holders = volume.holders(&format!("m/{f}"));
                (holders != [hashed(&f).expect("a brick")]).then(|| (f, holders[0]))
            })
            .expect("a file that moves");
        let file = all
            .resolve(&creds, &format!("/m/{moving}"))
            .await
            .expect("the file");
        let race = Race::UnlinkBeforeMark {
            parent: m.gfid,
            gfid: file.gfid,
        };
        all.bricks().nth(from).expect("brick").arm(&moving, race);
        let stop = AtomicBool::new(false);
        let report = all.rebalance(&stop, &mut |_| {}).await.expect("rebalance");
        assert_eq!(
            volume.holders(&format!("m/{moving}")),
            Vec::<usize>::new(),
            "neither the file nor a link file to it is left"
        );
        assert_eq!(report.skipped, 1, "the raced move given up: {report:?}");
        for i in 0..20 {
            let f = format!("f{i}");
            if f != moving {
                let home = hashed(&f).expect("a brick");
                assert_eq!(volume.holders(&format!("m/{f}")), [home], "{f} moved home");
            }
        }
        for brick in all.bricks() {
            brick.below.close().await;
        }
        close(&plain).await;
    });
}

/// A volume grown from two bricks to three: a rebalance lays every directory out over the
/// three and moves each file off its hashed brick there — renamed ones behind a link file
/// too — while another client keeps writing one of the files it moves. Afterwards every file
/// is on its hashed brick alone and reads back what was written, the writer's every write
/// included (those that raced with the copy, and those after the switch through the fd it
/// opened before).
#[test]
fn a_rebalance_moves_files_while_a_client_writes_one() {
    const PER_DIR: usize = 40;
    const BIG_BYTES: usize = 24 << 20;
    const BLOCK_BYTES: usize = 4096;
    let volume = Volume::start();
    let rt = runtime();
    let creds = Creds::root();
    rt.block_on(async {
        let all = volume.connect().await;
        let two =
            Distribute::new(all.bricks().take(2).cloned().collect(), "dist").expect("two bricks");
        let mut files = Vec::new();
        for dir in ["/a", "/a/b"] {
            two.mkdir_all(&creds, dir, 0o755).await.expect("mkdir");
            for i in 0..PER_DIR {
                let path = format!("{dir}/f{i}");
                two.put(&creds, &path, Bytes::from(path.clone()), 0o640)
                    .await
                    .expect("put");
                files.push(path);
            }
        }
        let a = two.resolve(&creds, "/a").await.expect("/a");
        for i in 0..5 {
            let rename = kiln_wire::Rename {
                old_parent: a.gfid,
                old_name: name(&format!("f{i}")),
                new_parent: a.gfid,
                new_name: name(&format!("renamed{i}")),
                mode: RenameMode::Replace,
            };
            two.call(&creds, rename.into()).await.expect("rename");
            files.retain(|f| *f != format!("/a/f{i}"));
            files.push(format!("/a/renamed{i}"));
        }
        let contents = |path: &str| match path.strip_prefix("/a/renamed") {
            Some(i) => format!("/a/f{i}"),
            None => path.to_owned(),
        };

        // Laid out over three bricks; a file that will move made big.
        all.heal_tree(&creds).await.expect("fix-layout");
        let layout = all.layout(a.gfid).await.expect("layout");
        let hashed = |name: &str| layout.hashed_brick(name.as_bytes(), Munging::default());
        let big = (5..PER_DIR)
            .map(|i| format!("f{i}"))
            .find(|f| volume.holders(&format!("a/{f}")) != [hashed(f).expect("a brick")])
            .expect("a file off its hashed brick");
        let big_path = format!("/a/{big}");
        let mut model: Vec<u8> = (0..BIG_BYTES).map(|i| (i % 251) as u8).collect();
        all.write_file(&creds, &big_path, Bytes::from(model.clone()), 0o640)
            .await
            .expect("write the big file");

        let writer = volume.connect().await;
        let rebalancer = volume.connect().await;
        let file = writer.resolve(&creds, &big_path).await.expect("lookup");
        let read_write = kiln_wire::AccessMode::ReadWrite;
        let open = || writer.open(&creds, file.gfid, read_write, kiln_wire::OpenFlags::empty());
        let fd = open().await.expect("open");
        // A second fd on the file, left alone during the move.
        let idle_fd = open().await.expect("open");
        let (stop, done) = (AtomicBool::new(false), AtomicBool::new(false));
        let mut last_mode = 0o640;
        let writes = async {
            let (mut writes, mut state) = (0_u64, 0x9e37_79b9_7f4a_7c15_u64);
            while !done.load(Ordering::Relaxed) {
                common::xorshift(&mut state);
                let offset = (state as usize % (BIG_BYTES / BLOCK_BYTES)) * BLOCK_BYTES;
                let block = vec![(writes % 256) as u8; BLOCK_BYTES];
                writer
                    .write(&creds, &fd, offset as u64, Bytes::from(block.clone()))
                    .await
                    .expect("a write during the rebalance");
                model[offset..offset + BLOCK_BYTES].copy_from_slice(&block);
                writes += 1;
                // Now and then a chmod through the fd, which must not take the move's mark off.
                if writes % 64 == 0 {
                    last_mode = if last_mode == 0o640 { 0o600 } else { 0o640 };
                    let attr = kiln_wire::SetAttr {
                        mode: kiln_wire::Mode::new(last_mode),
                        ..kiln_wire::SetAttr::default()
                    };
                    let chmod =
                        kiln_client::FdFop::new(|fd| kiln_wire::Fsetattr { fd, attr }.into());
                    writer
                        .call_fd(&creds, &fd, chmod)
                        .await
                        .expect("fchmod during the rebalance");
                }
            }
            writes
        };
        let rebalance = async {
            let report = rebalancer.rebalance(&stop, &mut |_| {}).await;
            done.store(true, Ordering::Relaxed);
            report.expect("rebalance")
        };
        let (writes, report) = tokio::join!(writes, rebalance);
        writer.release(&creds, fd).await.expect("release");
        // A chmod that raced the end of the move is not lost, whichever copy it reached.
        let moved = volume.connect().await;
        let iatt = moved.resolve(&creds, &big_path).await.expect("stat");
        assert_eq!(iatt.mode.bits(), last_mode, "{big_path}: the last chmod");
        close(&moved).await;
        // Its first fop after the move finds the file gone from the brick it was opened on
        // (even the link file): it follows the file to where it is now.
        last_mode = 0o604;
        let attr = kiln_wire::SetAttr {
            mode: kiln_wire::Mode::new(last_mode),
            ..kiln_wire::SetAttr::default()
        };
        let chmod = kiln_client::FdFop::new(|fd| kiln_wire::Fsetattr { fd, attr }.into());
        writer
            .call_fd(&creds, &idle_fd, chmod)
            .await
            .expect("fchmod through an fd opened before the move");
        writer.release(&creds, idle_fd).await.expect("release");
        assert!(writes > 10, "{writes} writes during the rebalance");
        assert_eq!((report.skipped, report.failed), (0, 0), "{report:?}");
        assert!(
            report.moved >= 1 && report.files as usize == files.len(),
            "{report:?}"
        );

        let fresh = volume.connect().await;
        for path in &files {
            let (dir, file) = path.rsplit_once('/').expect("a parent");
            let dir = fresh.resolve(&creds, dir).await.expect("dir");
            let layout = fresh.layout(dir.gfid).await.expect("layout");
            let hashed = layout.hashed_brick(file.as_bytes(), Munging::default());
            assert_eq!(
                volume.holders(&path[1..]).first(),
                hashed.as_ref(),
                "{path} on its hashed brick"
            );
            assert_eq!(volume.holders(&path[1..]).len(), 1, "{path}: no link file");
            let data = fresh.read_to_end(&creds, path).await.expect("read");
            if *path == big_path {
                let iatt = fresh.resolve(&creds, path).await.expect("stat");
                assert_eq!(
                    iatt.mode.bits(),
                    last_mode,
                    "{path}: the last chmod, unmarked"
                );
                let wrong: Vec<(usize, u8, u8)> = (0..BIG_BYTES / BLOCK_BYTES)
                    .map(|b| b * BLOCK_BYTES)
                    .filter(|&o| data.get(o..o + BLOCK_BYTES) != Some(&model[o..o + BLOCK_BYTES]))
                    .map(|o| (o / BLOCK_BYTES, data.get(o).copied().unwrap_or(0), model[o]))
                    .collect();
                assert!(
                    data.len() == model.len() && wrong.is_empty(),
                    "{path}: the writer's writes are not all there: {} bytes, blocks (block, \
                     byte read, byte written) {wrong:?}",
                    data.len()
                );
            } else {
                assert_eq!(data, contents(path).as_bytes(), "{path}");
            }
        }
        let again = fresh.rebalance(&stop, &mut |_| {}).await.expect("again");
        assert_eq!((again.moved, again.link_files_removed), (0, 0), "{again:?}");
        for v in [&all, &two, &writer, &rebalancer, &fresh] {
            close(v).await;
        }
    });
    for i in 0..BRICKS {
        common::assert_brick_checks_clean(volume.brick(i));
    }
}

/// A rebalance that died mid-move leaves a file marked: the next one undoes a move still
/// copying (the source unmarked, the half-filled link file emptied) and moves the file anew,
/// and finishes a move whose destination had become the file (the source removed).
#[test]
fn a_rebalance_finishes_or_undoes_a_move_left_half_done() {
    let volume = Volume::start();
    let rt = runtime();
    let creds = Creds::root();
    rt.block_on(async {
        let v = volume.connect().await;
        let (dir, hashed) = hashed_dir(&v, &creds, "/m").await;
        let brick = |i: usize| v.bricks().nth(i).expect("a brick");
        let linkto = |i: usize| Bytes::from(format!("dist-client-{i}\0"));
        // Two files each on a brick its name does not hash to, as a crash left them.
        let mut placed = Vec::new();
        for label in ["copying", "switched"] {
            let to = hashed(label);
            let from = (to + 1) % BRICKS;
            let data = Bytes::from(label.repeat(50_000));
            brick(from)
                .put(&creds, &format!("/m/{label}"), data.clone(), 0o640)
                .await
                .expect("put");
            let file = brick(from)
                .resolve(&creds, &format!("/m/{label}"))
                .await
                .expect("file");
            let set = |gfid, value: Bytes| kiln_wire::Setxattr {
                gfid,
                name: kiln_wire::XattrName::new(Bytes::from_static(LINKTO_XATTR.as_bytes()))
                    .expect("name"),
                value: kiln_wire::XattrValue::new(value).expect("value"),
                mode: kiln_wire::XattrSetMode::Upsert,
            };
            brick(from)
                .call(&creds, set(file.gfid, linkto(to)).into())
                .await
                .expect("linkto");
            let sticky = kiln_wire::Setattr {
                gfid: file.gfid,
                attr: kiln_wire::SetAttr {
                    mode: kiln_wire::Mode::new(0o1640),
                    ..kiln_wire::SetAttr::default()
                },
            };
            brick(from)
                .call(&creds, sticky.into())
                .await
                .expect("sticky");
            // The destination: a link file half filled, or (switched) the file itself.
            let mode = if label == "copying" { 0o1000 } else { 0o640 };
            let mknod = kiln_wire::Mknod {
                parent: dir.gfid,
                name: name(label),
                gfid: file.gfid,
                node_type: kiln_wire::NodeType::Regular,
                mode: kiln_wire::Mode::new(mode).expect("mode"),
                umask: kiln_wire::Mode::new(0).expect("mode"),
                rdev: 0,
            };
            brick(to)
                .call(&creds, mknod.into())
                .await
                .expect("destination");
            let fd = brick(to)
                .open(
                    &creds,
                    file.gfid,
                    kiln_wire::AccessMode::WriteOnly,
                    kiln_wire::OpenFlags::empty(),
                )
                .await
                .expect("open");
            let part = if label == "copying" {
                data.slice(..1000)
            } else {
                data.clone()
            };
            brick(to).write(&creds, &fd, 0, part).await.expect("write");
            brick(to).release(&creds, fd).await.expect("release");
            if label == "copying" {
                brick(to)
                    .call(&creds, set(file.gfid, linkto(from)).into())
                    .await
                    .expect("linkto");
            }
            placed.push((label, to, data));
        }
        let stop = AtomicBool::new(false);
        let report = v.rebalance(&stop, &mut |_| {}).await.expect("rebalance");
        assert_eq!(
            (report.moved, report.skipped, report.failed),
            (2, 0, 0),
            "{report:?}"
        );
        let fresh = volume.connect().await;
        for (label, to, data) in placed {
            assert_eq!(volume.holders(&format!("m/{label}")), [to], "{label}");
            let read = fresh
                .read_to_end(&creds, &format!("/m/{label}"))
                .await
                .expect("read");
            assert!(read == data, "{label}: {} bytes read", read.len());
            let iatt = fresh
                .resolve(&creds, &format!("/m/{label}"))
                .await
                .expect("stat");
            assert_eq!(iatt.mode.bits(), 0o640, "{label}: unmarked");
        }
        close(&v).await;
        close(&fresh).await;
    });
}
