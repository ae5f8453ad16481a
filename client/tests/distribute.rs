//! The distribution layer over three real `kiln-brickd`s: files land on the brick their
//! name hashes to, layouts are on every brick's copy of a directory, listings show each name
//! once, renames and hard links across bricks leave GlusterFS link files, RMDIR keeps a
//! directory that still has entries on some brick, STATFS sums the bricks.

mod common;
mod mount_common;

use std::path::{Path, PathBuf};

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

fn name(s: &str) -> Name {
    Name::new(s.to_owned()).expect("name")
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
        let mut listed: Vec<String> = v
            .read_dir(&creds, dir.gfid)
            .await
            .expect("readdir")
            .iter()
            .map(|e| e.name.to_string())
            .collect();
        listed.sort();
        let mut want: Vec<String> = (0..FILES).map(|i| format!("f{i}")).collect();
        want.push("sub".into());
        want.sort();
        assert_eq!(listed, want);
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
        let dir = v.mkdir_all(&creds, "/d", 0o755).await.expect("mkdir");
        let layout = v.layout(dir.gfid).await.expect("layout");
        let hashed = |n: &str| {
            layout
                .hashed_brick(n.as_bytes(), Munging::default())
                .expect("brick")
        };
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
        let rename = kiln_wire::Rename {
            old_parent: dir.gfid,
            old_name: name("a"),
            new_parent: dir.gfid,
            new_name: name(&moved),
            mode: RenameMode::Replace,
        };
        v.call(&creds, rename.into()).await.expect("rename");
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
        let FopReply::Statfs(one) = v.bricks()[0]
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
        v.put(
            &creds,
            &format!("/d/{file}"),
            Bytes::from_static(b"x"),
            0o644,
        )
        .await
        .expect("put");
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

/// `kiln mount` of three bricks: programs see one tree; files spread over the bricks; a
/// rename and a hard link across bricks and a recursive removal work.
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
        "cp -a {src} tree && diff -r {src} tree && mv tree/d1/f1 tree/d2/moved && \
         ln tree/d2/moved tree/d3/hard && cat tree/d3/hard && ls tree/d1 | wc -l && \
         readlink tree/link",
        src = src.display()
    );
    let out = mount_common::sh_ok(&m.mountpoint, &script);
    assert_eq!(out, "1/1\n39\nd1/f1\n", "{}", m.logs());
    let per_brick: Vec<usize> = std::iter::once(m.cluster.brick.clone())
        .chain((1..BRICKS).map(|n| m.cluster.dir.path().join(format!("brick-{n}"))))
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
    mount_common::sh_ok(&m.mountpoint, "rm -rf tree && test -z \"$(ls -A)\"");
    for n in 0..BRICKS {
        let brick = match n {
            0 => m.cluster.brick.clone(),
            n => m.cluster.dir.path().join(format!("brick-{n}")),
        };
        assert!(!brick.join("tree").exists(), "brick {n} still has the tree");
    }
}

#[test]
fn pjdfstest_passes_on_a_distributed_mount() {
    let m = mount_common::Mounted::distributed(BRICKS, &[]);
    mount_common::pjdfstest_passes(&m);
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
        let gfid = kiln_client::path::new_gfid();
        for brick in &v.bricks()[..2] {
            let mkdir = kiln_wire::Mkdir {
                parent: Gfid::ROOT,
                name: name("half"),
                gfid,
                mode: kiln_wire::Mode::new(0o750).expect("mode"),
                umask: kiln_wire::Mode::new(0).expect("mode"),
            };
            brick
                .call(&creds, mkdir.into())
                .await
                .expect("mkdir on one brick");
        }
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
        let dir = v.mkdir_all(&creds, "/d", 0o755).await.expect("mkdir");
        let layout = v.layout(dir.gfid).await.expect("layout");
        let hashed = |n: &str| {
            layout
                .hashed_brick(n.as_bytes(), Munging::default())
                .expect("brick")
        };

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
        let older = Distribute::new(v.bricks()[..2].to_vec(), "dist").expect("layer");
        older.resolve(&creds, "/d").await.expect("lookup");
        older.heal_tree(&creds).await.expect("heal walk");
        assert_eq!(older.healed(), (0, 0));
        assert_eq!(xattr(&volume.brick(2).join("d"), XATTR_NAME), Some(before));
        close(&v).await;
    });
}
