//! A hostile client against a real `kiln-brickd` (issue 14): path escapes through every fop
//! that takes a name or a GFID, root and uid −1 with root squashing on and off, fd, lock and
//! connection exhaustion, one byte per stream, stream floods, lock-wait floods, and oversized
//! and lying frames on many streams at once.
//!
//! Each test asserts that the attack gets a clear typed error or is contained, that nothing
//! outside the brick changed (a canary tree beside it keeps content, mode, owner, times and
//! xattrs), and that a well-behaved client kept working during and after the attack.

mod common;
mod hostile_common;

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hostile_common::*;
use kiln_client::{BrickClient, Error, Layer, LayerExt, Paths};
use kiln_wire::limits::FRAME_BODY_LEN_MAX_BYTES;
use kiln_wire::{
    AccessMask, AccessMode, Call, CallCode, Creds, ErrorCode, FLAG_BODY_UNCHECKED, FileType,
    FopCode, FopReply, FopRequest, FrameKind, Gfid, Header, Lock, LockCmd, LockKind, Message,
    NodeType, OpenFlags, Outcome, Ping, RenameMode, Reply, SetAttr, TimeSet, Timespec,
};

use ErrorCode::{
    Access, Exist, Inval, Loop, MFile, NoData, NoLock, NotDir, NotSupported, NxIo, Perm, Stale,
};
const ROOT: Gfid = Gfid::ROOT;

fn lstat(path: &Path) -> std::fs::Metadata {
    std::fs::symlink_metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The owner of `path` on the brick's disk.
fn owner(path: &Path) -> (u32, u32) {
    let meta = lstat(path);
    (meta.uid(), meta.gid())
}

/// Every path under `dir`, not following symlinks.
fn walk_names(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("readdir") {
        let path = entry.expect("entry").path();
        if lstat(&path).is_dir() {
            out.extend(walk_names(&path));
        }
        out.push(path);
    }
    out
}

// ---- path escapes: symlinks out of the brick ----

#[test]
fn put_create_and_mkdir_never_write_through_a_symlink_out_of_the_brick() {
    let s = Scene::start(&[]);
    s.rt.block_on(async {
        let by = s.bystander().await;
        let v = s.connect("alice").await;
        let x = symlink_at_root(&v, "x", &s.outside.file).await;
        let dangling = symlink_at_root(&v, "d", &s.outside.absent).await;
        let xd = symlink_at_root(&v, "xd", &s.outside.subdir).await;
        let (excl, trunc) = (OpenFlags::EXCL, OpenFlags::TRUNC);
        #[rustfmt::skip]
        expect_refusals(&v, &Creds::root(), vec![
            // Over the symlink, with its own GFID (as a retry would) or a new one.
            ("PUT x with its GFID", put(ROOT, "x", x, b"pwned"), Exist),
            ("PUT x with a new GFID", put(ROOT, "x", gfid(), b"pwned"), Exist),
            ("PUT another name with x's GFID", put(ROOT, "other", x, b"pwned"), Exist),
            ("CREATE|EXCL x with its GFID", create(ROOT, "x", x, excl), Exist),
            ("CREATE|TRUNC x with its GFID", create(ROOT, "x", x, trunc), Loop),
            ("CREATE|TRUNC x with a new GFID", create(ROOT, "x", gfid(), trunc), Loop),
            ("MKDIR x with its GFID", mkdir(ROOT, "x", x), Exist),
            ("MKNOD x with its GFID", mknod(ROOT, "x", x, NodeType::Regular, 0), Exist),
            // A dangling symlink must not make its target exist.
            ("PUT over a dangling symlink", put(ROOT, "d", dangling, b"pwned"), Exist),
            ("CREATE over a dangling symlink", create(ROOT, "d", gfid(), trunc), Loop),
            // A symlink to a directory outside is no parent directory.
            ("PUT into xd", put(xd, "evil", gfid(), b"pwned"), NotDir),
            ("CREATE into xd", create(xd, "evil", gfid(), excl), NotDir),
            ("MKDIR into xd", mkdir(xd, "evil", gfid()), NotDir),
            ("SYMLINK into xd", symlink(xd, "evil", gfid(), "/"), NotDir),
            ("MKNOD into xd", fifo(xd, "evil", gfid()), NotDir),
            ("LOOKUP of a file outside through xd", lookup(xd, "inner"), NotDir),
            ("UNLINK of a file outside through xd", unlink(xd, "inner"), NotDir),
        ]).await;
        // The link is still a link, to the same text.
        assert!(lstat(&s.on_brick("x")).file_type().is_symlink());
        assert_eq!(
            std::fs::read_link(s.on_brick("x")).expect("x"),
            s.outside.file
        );
        by.check("after writes through symlinks").await;
    });
    s.outside.assert_untouched();
}

#[test]
fn setattr_by_a_symlinks_gfid_changes_the_link_never_its_target() {
    let s = Scene::start(&[]);
    s.rt.block_on(async {
        let by = s.bystander().await;
        let v = s.connect("alice").await;
        let bob = s.connect("bob").await;
        let root = Creds::root();
        let x = symlink_at_root(&v, "x", &s.outside.file).await;
        let xd = symlink_at_root(&v, "xd", &s.outside.subdir).await;
        for g in [x, xd] {
            #[rustfmt::skip]
            expect_refusals(&v, &root, vec![
                ("SETATTR size of a symlink", setattr(g, resize(0)), Inval),
                ("TRUNCATE of a symlink", truncate(g, 0), Inval),
                ("chmod of a symlink", setattr(g, chmod(0o777)), NotSupported),
            ]).await;
            let r = fop(&bob, &root, setattr(g, chown(0, 0))).await;
            expect_err("chown of a symlink by a squashed root", r, Perm);
        }
        // chown and times act on the link itself.
        let reply = fop(&v, &root, setattr(x, chown(1234, 1235))).await;
        let FopReply::Setattr(changed) = expect_ok("chown of the symlink", reply) else {
            panic!("not a SETATTR reply");
        };
        assert_eq!(changed.post.file_type, FileType::Symlink);
        assert_eq!(
            owner(&s.on_brick("x")),
            (1234, 1235),
            "the link was chowned"
        );
        let at = TimeSet::At(Timespec::new(2_000_000_000, 0).expect("time"));
        let times = SetAttr {
            atime: Some(at),
            mtime: Some(at),
            ..SetAttr::default()
        };
        match fop(&v, &root, setattr(x, times)).await {
            Ok(_) => assert_eq!(lstat(&s.on_brick("x")).mtime(), 2_000_000_000),
            Err(Error::Fop(_)) => {}
            Err(e) => panic!("utimes of a symlink: {e:?}"),
        }
        by.check("after SETATTR on symlinks").await;
    });
    s.outside.assert_untouched();
}

#[test]
fn a_hard_link_to_a_symlink_is_never_followed_either() {
    let s = Scene::start(&[]);
    s.rt.block_on(async {
        let by = s.bystander().await;
        let v = s.connect("alice").await;
        let root = Creds::root();
        let x = symlink_at_root(&v, "x", &s.outside.file).await;
        let xd = symlink_at_root(&v, "xd", &s.outside.subdir).await;
        let linked = made(expect_ok(
            "LINK x as y",
            fop(&v, &root, link(x, ROOT, "y")).await,
        ));
        assert_eq!((linked.gfid, linked.file_type), (x, FileType::Symlink));
        assert_eq!(lstat(&s.on_brick("y")).ino(), lstat(&s.on_brick("x")).ino());
        let write = AccessMode::WriteOnly;
        #[rustfmt::skip]
        expect_refusals(&v, &root, vec![
            // Writes by every route through the new name.
            ("PUT y with its GFID", put(ROOT, "y", x, b"pwned"), Exist),
            ("PUT y with a new GFID", put(ROOT, "y", gfid(), b"pwned"), Exist),
            ("CREATE|TRUNC y", create(ROOT, "y", gfid(), OpenFlags::TRUNC), Loop),
            ("OPEN|TRUNC of y's GFID", open(x, write, OpenFlags::TRUNC), Loop),
            ("SETATTR size of y's GFID", setattr(x, resize(0)), Inval),
            // Links into a symlink to outside, or of a directory.
            ("LINK into xd", link(x, xd, "escaped"), NotDir),
            ("LINK of the root directory", link(ROOT, ROOT, "root-again"), Perm),
        ]).await;
        by.check("after links to symlinks").await;
    });
    s.outside.assert_untouched();
}

#[test]
fn rename_over_a_symlink_replaces_the_link_not_its_target() {
    let s = Scene::start(&[]);
    s.rt.block_on(async {
        let by = s.bystander().await;
        let v = s.connect("alice").await;
        let root = Creds::root();
        let x = symlink_at_root(&v, "x", &s.outside.file).await;
        let xd = symlink_at_root(&v, "xd", &s.outside.subdir).await;
        for n in ["/f", "/g"] {
            expect_ok(
                "PUT",
                v.put(&root, n, Bytes::from_static(b"inside"), 0o644).await,
            );
        }
        let replace = RenameMode::Replace;
        let r = fop(&v, &root, rename((ROOT, "f"), (ROOT, "x"), replace)).await;
        expect_ok("RENAME f over the symlink x", r);
        assert!(lstat(&s.on_brick("x")).file_type().is_file(), "x is f now");
        assert_eq!(std::fs::read(s.on_brick("x")).expect("x"), b"inside");
        expect_err(
            "STAT of the replaced symlink",
            fop(&v, &root, stat(x)).await,
            Stale,
        );
        #[rustfmt::skip]
        expect_refusals(&v, &root, vec![
            ("RENAME into xd", rename((ROOT, "g"), (xd, "escaped"), replace), NotDir),
            ("RENAME out of xd", rename((xd, "inner"), (ROOT, "stolen"), replace), NotDir),
            ("RENAME_EXCHANGE with a file outside",
                rename((ROOT, "g"), (xd, "inner"), RenameMode::Exchange), NotDir),
        ]).await;
        assert!(!s.on_brick("stolen").exists());
        by.check("after renames over symlinks").await;
    });
    s.outside.assert_untouched();
}

#[test]
fn a_symlink_is_never_opened_nor_used_as_a_directory() {
    let s = Scene::start(&[]);
    s.rt.block_on(async {
        let by = s.bystander().await;
        let v = s.connect("alice").await;
        let root = Creds::root();
        let x = symlink_at_root(&v, "x", &s.outside.file).await;
        let xd = symlink_at_root(&v, "xd", &s.outside.subdir).await;
        for g in [x, xd] {
            #[rustfmt::skip]
            expect_refusals(&v, &root, vec![
                ("OPEN for reading", open(g, AccessMode::ReadOnly, OpenFlags::empty()), Loop),
                ("OPEN for writing", open(g, AccessMode::WriteOnly, OpenFlags::empty()), Loop),
                ("OPEN|TRUNC", open(g, AccessMode::ReadWrite, OpenFlags::TRUNC), Loop),
                ("OPEN|APPEND", open(g, AccessMode::WriteOnly, OpenFlags::APPEND), Loop),
                ("OPENDIR", opendir(g), NotDir),
            ]).await;
            // What the brick says is the link's, not the target's.
            let FopReply::Stat(st) = expect_ok("STAT", fop(&v, &root, stat(g)).await) else {
                panic!("not a STAT reply");
            };
            assert_eq!(st.iatt.file_type, FileType::Symlink);
            assert_ne!(st.iatt.uid, 4321, "STAT shows the target's owner");
        }
        by.check("after opens of symlinks").await;
    });
    s.outside.assert_untouched();
}

#[test]
fn xattrs_by_a_symlinks_gfid_act_on_the_link_and_reveal_nothing_outside() {
    let s = Scene::start(&[]);
    s.rt.block_on(async {
        let by = s.bystander().await;
        let v = s.connect("alice").await;
        let root = Creds::root();
        let x = symlink_at_root(&v, "x", &s.outside.file).await;
        let xd = symlink_at_root(&v, "xd", &s.outside.subdir).await;
        for (g, on_brick) in [(x, s.on_brick("x")), (xd, s.on_brick("xd"))] {
            #[rustfmt::skip]
            expect_refusals(&v, &root, vec![
                ("GETXATTR of the canary's xattr", getxattr(g, CANARY_XATTR), NoData),
                // Linux keeps user.* xattrs off symlinks.
                ("REMOVEXATTR of the canary's xattr", removexattr(g, CANARY_XATTR), Perm),
                ("SETXATTR user.*", setxattr(g, "user.evil", b"1"), Perm),
            ]).await;
            let listed = expect_ok("LISTXATTR", fop(&v, &root, listxattr(g)).await);
            let FopReply::Listxattr(listed) = listed else {
                panic!("not a LISTXATTR reply");
            };
            let canary = CANARY_XATTR.as_bytes();
            let shown = listed.entries.iter().any(|n| n.as_bytes() == canary);
            assert!(!shown, "LISTXATTR of a symlink shows its target's xattrs");
            // A trusted.* xattr set by root lands on the link, not on what it points at.
            let set = fop(&v, &root, setxattr(g, "trusted.evil", b"1")).await;
            expect_ok("SETXATTR trusted.* of a symlink", set);
            let on_link = xattrs(&on_brick).get("trusted.evil").cloned();
            assert_eq!(on_link.as_deref(), Some(&b"1"[..]));
            // An answer of either kind will do; what matters is that nothing moved.
            let access = kiln_wire::Access {
                gfid: g,
                mask: AccessMask::WRITE,
            };
            let _ = fop(&v, &root, access).await;
        }
        by.check("after xattrs on symlinks").await;
    });
    s.outside.assert_untouched();
}

// ---- path escapes: names ----

/// A name patched into `..`, `.`, `a/b`… on the wire.
const PLACEHOLDER: &str = "PLACEHOLDERNAME";

/// Every fop that takes a name, with the placeholder in the name under attack.
fn name_fops() -> Vec<(&'static str, FopRequest)> {
    let (p, any) = (PLACEHOLDER, RenameMode::Replace);
    vec![
        ("LOOKUP", lookup(ROOT, p)),
        ("MKDIR", mkdir(ROOT, p, gfid())),
        ("CREATE", create(ROOT, p, gfid(), OpenFlags::EXCL)),
        ("PUT", put(ROOT, p, gfid(), b"pwned")),
        ("MKNOD", mknod(ROOT, p, gfid(), NodeType::Regular, 0)),
        ("SYMLINK", symlink(ROOT, p, gfid(), "/")),
        ("UNLINK", unlink(ROOT, p)),
        ("RMDIR", rmdir(ROOT, p)),
        ("LINK", link(ROOT, ROOT, p)),
        ("RENAME from", rename((ROOT, p), (ROOT, "target"), any)),
        ("RENAME to", rename((ROOT, "source"), (ROOT, p), any)),
    ]
}

#[test]
fn dot_dotdot_and_slash_names_are_refused_at_decode_by_every_name_fop() {
    const BAD: &[&[u8]] = &[
        b"..",
        b".",
        b"../escaped",
        b"a/b",
        b"/",
        b"",
        b"a\0b",
        b"escaped/..",
    ];
    // The client library cannot even make such a name.
    for bad in BAD {
        assert!(
            kiln_wire::Name::new(Bytes::from_static(bad)).is_err(),
            "{bad:?}"
        );
    }
    let s = Scene::start(&[]);
    s.rt.block_on(async {
        let by = s.bystander().await;
        let v = s.connect("alice").await;
        let data = Bytes::from_static(b"s");
        expect_ok(
            "PUT source",
            v.put(&Creds::root(), "/source", data, 0o644).await,
        );
        let raw = Arc::new(s.raw("alice").await);
        let mut attacks = tokio::task::JoinSet::new();
        for (what, fop) in name_fops() {
            let creds = Creds::root();
            let frame = raw.request(Call::Fop { creds, fop });
            for bad in BAD {
                let frame = patched(&frame, &wire_name(PLACEHOLDER.as_bytes()), &wire_name(bad));
                let what = format!("{what} {:?}", String::from_utf8_lossy(bad));
                let raw = raw.clone();
                attacks.spawn(async move { raw.expect_reset(&what, &frame, true).await });
            }
        }
        let count = attacks.len();
        while let Some(done) = attacks.join_next().await {
            done.expect("an attack task panicked");
        }
        assert_eq!(count, name_fops().len() * BAD.len());
        raw.ping("the attacked connection after bad names").await;
        // Nothing was made, moved or removed.
        let left: Vec<_> = std::fs::read_dir(&s.cluster.brick)
            .expect("brick")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .filter(|n| n != ".glusterfs" && !n.starts_with("bystander-"))
            .collect();
        assert_eq!(left, ["source"], "the brick root after bad names");
        by.check("after bad names").await;
    });
    s.outside.assert_untouched();
}

// ---- path escapes: GFIDs ----

/// Every fop that takes a GFID, aimed at `g`: the GFID as the object, then as the parent.
#[rustfmt::skip]
fn gfid_fops(g: Gfid) -> Vec<(&'static str, FopRequest)> {
    let any = RenameMode::Replace;
    vec![
        ("STAT", stat(g)),
        ("OPEN", open(g, AccessMode::ReadWrite, OpenFlags::empty())),
        ("OPENDIR", opendir(g)),
        ("SETATTR", setattr(g, chmod(0o777))),
        ("TRUNCATE", truncate(g, 0)),
        ("READLINK", kiln_wire::Readlink { gfid: g }.into()),
        ("ACCESS", kiln_wire::Access { gfid: g, mask: AccessMask::READ }.into()),
        ("STATFS", kiln_wire::Statfs { gfid: g }.into()),
        ("GETXATTR", getxattr(g, "user.x")),
        ("LISTXATTR", listxattr(g)),
        ("SETXATTR", setxattr(g, "user.x", b"1")),
        ("REMOVEXATTR", removexattr(g, "user.x")),
        ("LINK of it", link(g, ROOT, "l")),
        ("LOOKUP in it", lookup(g, "x")),
        ("MKDIR in it", mkdir(g, "x", gfid())),
        ("CREATE in it", create(g, "x", gfid(), OpenFlags::EXCL)),
        ("PUT in it", put(g, "x", gfid(), b"x")),
        ("SYMLINK in it", symlink(g, "x", gfid(), "/")),
        ("MKNOD in it", fifo(g, "x", gfid())),
        ("UNLINK in it", unlink(g, "x")),
        ("RMDIR in it", rmdir(g, "x")),
        ("RENAME from it", rename((g, "x"), (ROOT, "y"), any)),
        ("RENAME into it", rename((ROOT, "x"), (g, "y"), any)),
    ]
}

#[test]
fn gfids_never_created_or_already_gone_are_estale() {
    let s = Scene::start(&[]);
    s.rt.block_on(async {
        let by = s.bystander().await;
        let v = s.connect("alice").await;
        let root = Creds::root();
        let data = Bytes::from_static(b"g");
        let gone = expect_ok("PUT gone", v.put(&root, "/gone", data, 0o644).await).gfid;
        expect_ok("UNLINK gone", fop(&v, &root, unlink(ROOT, "gone")).await);
        for (what, g) in [
            ("a GFID never created", gfid()),
            ("an unlinked file's", gone),
        ] {
            for (fop_name, request) in gfid_fops(g) {
                let r = fop(&v, &root, request).await;
                expect_err(&format!("{fop_name} with {what}"), r, Stale);
            }
        }
        by.check("after unknown GFIDs").await;
    });
    s.outside.assert_untouched();
}

#[test]
fn a_gfid_reused_for_another_object_is_eexist_and_its_owner_is_untouched() {
    let s = Scene::start(&[]);
    s.rt.block_on(async {
        let by = s.bystander().await;
        let v = s.connect("alice").await;
        let bob = s.connect("bob").await;
        let root = Creds::root();
        let shared = dir_at_root(&v, "shared", 0o777).await;
        let data = Bytes::from_static(b"owner's data");
        let file = expect_ok("PUT owner", v.put(&root, "/owner", data, 0o600).await).gfid;
        let dir = expect_ok("MKDIR ownerdir", v.mkdir(&root, "/ownerdir", 0o700).await).gfid;
        let disk = |n: &str| {
            let m = lstat(&s.on_brick(n));
            (m.ino(), m.mode(), m.size(), m.mtime(), m.ctime())
        };
        let before = (disk("owner"), disk("ownerdir"));
        for g in [file, dir, ROOT] {
            #[rustfmt::skip]
            expect_refusals(&v, &root, vec![
                ("MKDIR with a taken GFID", mkdir(ROOT, "m", g), Exist),
                ("CREATE|EXCL with a taken GFID", create(ROOT, "c", g, OpenFlags::EXCL), Exist),
                // Without O_EXCL too: the name is new, the GFID is not.
                ("CREATE with a taken GFID", create(ROOT, "c", g, OpenFlags::empty()), Exist),
                ("PUT with a taken GFID", put(ROOT, "p", g, b"pwned"), Exist),
                ("SYMLINK with a taken GFID", symlink(ROOT, "s", g, "/"), Exist),
                ("MKNOD with a taken GFID", fifo(ROOT, "n", g), Exist),
            ]).await;
            // Another client, where it may write.
            let r = fop(&bob, &root, put(shared, "bob", g, b"pwned")).await;
            expect_err("a squashed client's PUT with a taken GFID", r, Exist);
        }
        for n in ["m", "c", "p", "s", "n", "shared/bob"] {
            assert!(
                std::fs::symlink_metadata(s.on_brick(n)).is_err(),
                "{n} was made"
            );
        }
        // The owners are as they were, and their GFIDs still name them.
        assert_eq!((disk("owner"), disk("ownerdir")), before);
        assert_eq!(
            std::fs::read(s.on_brick("owner")).expect("owner"),
            b"owner's data"
        );
        let st = expect_ok("STAT owner", v.stat(&root, file).await);
        assert_eq!((st.ino, st.file_type), (before.0.0, FileType::Regular));
        let st = expect_ok("STAT ownerdir", v.stat(&root, dir).await);
        assert_eq!((st.ino, st.file_type), (before.1.0, FileType::Directory));
        by.check("after reused GFIDs").await;
    });
    s.outside.assert_untouched();
}

#[test]
fn fifos_and_device_nodes_are_refused_and_never_block() {
    let s = Scene::start(&[]);
    s.rt.block_on(async {
        let by = s.bystander().await;
        let v = s.connect("alice").await;
        let root = Creds::root();
        // /dev/null's numbers: should a regression open it, nothing is harmed, and the test
        // still sees the open succeed.
        let null = rustix::fs::makedev(1, 3);
        let r = fop(&v, &root, fifo(ROOT, "fifo", gfid())).await;
        let fifo_gfid = made(expect_ok("MKNOD fifo", r)).gfid;
        let r = fop(
            &v,
            &root,
            mknod(ROOT, "chr", gfid(), NodeType::CharDevice, null),
        )
        .await;
        let chr = made(expect_ok("MKNOD chr", r)).gfid;
        assert!(lstat(&s.on_brick("chr")).file_type().is_char_device());
        for (n, g) in [("fifo", fifo_gfid), ("chr", chr)] {
            // A second name opens no better.
            let second = format!("{n}-2");
            expect_ok("LINK", fop(&v, &root, link(g, ROOT, &second)).await);
            let (none, trunc) = (OpenFlags::empty(), OpenFlags::TRUNC);
            // Every wait is bounded: an open that blocks on the FIFO fails the test.
            #[rustfmt::skip]
            expect_refusals(&v, &root, vec![
                ("OPEN for reading", open(g, AccessMode::ReadOnly, none), NxIo),
                ("OPEN for writing", open(g, AccessMode::WriteOnly, none), NxIo),
                ("OPEN|TRUNC", open(g, AccessMode::ReadWrite, trunc), NxIo),
                ("PUT over it with its GFID", put(ROOT, n, g, b"pwned"), Exist),
                ("PUT over it with a new GFID", put(ROOT, n, gfid(), b"pwned"), Exist),
                ("CREATE|TRUNC over it", create(ROOT, n, gfid(), trunc), NxIo),
                ("CREATE|EXCL with its GFID", create(ROOT, n, g, OpenFlags::EXCL), Exist),
                ("CREATE over its second name", create(ROOT, &second, gfid(), none), NxIo),
                ("TRUNCATE", truncate(g, 0), Inval),
                ("OPENDIR", opendir(g), NotDir),
            ]).await;
        }
        by.check("after FIFO and device opens").await;
    });
    s.outside.assert_untouched();
}

// ---- the brick's own housekeeping ----

#[test]
fn the_glusterfs_directory_is_unreachable_by_name() {
    let s = Scene::start(&[]);
    let before = walk_names(&s.on_brick(".glusterfs"));
    s.rt.block_on(async {
        let by = s.bystander().await;
        let v = s.connect("alice").await;
        let root = Creds::root();
        let data = Bytes::from_static(b"f");
        let f = expect_ok("PUT f", v.put(&root, "/f", data, 0o644).await).gfid;
        let (gl, any) = (".glusterfs", RenameMode::Replace);
        #[rustfmt::skip]
        expect_refusals(&v, &root, vec![
            ("LOOKUP .glusterfs", lookup(ROOT, gl), Perm),
            ("MKDIR .glusterfs", mkdir(ROOT, gl, gfid()), Perm),
            ("CREATE .glusterfs", create(ROOT, gl, gfid(), OpenFlags::empty()), Perm),
            ("PUT .glusterfs", put(ROOT, gl, gfid(), b"pwned"), Perm),
            ("SYMLINK .glusterfs", symlink(ROOT, gl, gfid(), "/"), Perm),
            ("MKNOD .glusterfs", fifo(ROOT, gl, gfid()), Perm),
            ("UNLINK .glusterfs", unlink(ROOT, gl), Perm),
            ("RMDIR .glusterfs", rmdir(ROOT, gl), Perm),
            ("LINK as .glusterfs", link(f, ROOT, gl), Perm),
            ("RENAME .glusterfs away", rename((ROOT, gl), (ROOT, "stolen"), any), Perm),
            ("RENAME over .glusterfs", rename((ROOT, "f"), (ROOT, gl), any), Perm),
            ("RENAME_EXCHANGE with .glusterfs",
                rename((ROOT, "f"), (ROOT, gl), RenameMode::Exchange), Perm),
        ]).await;
        let listed = expect_ok("READDIRP of the root", v.read_dir(&root, ROOT).await);
        let shown = listed.iter().any(|e| e.name.as_bytes() == gl.as_bytes());
        assert!(!shown, "the root lists .glusterfs");
        // Below the root it is an ordinary name.
        let sub = expect_ok("MKDIR sub", v.mkdir(&root, "/sub", 0o755).await).gfid;
        expect_ok(
            "MKDIR sub/.glusterfs",
            fop(&v, &root, mkdir(sub, gl, gfid())).await,
        );
        by.check("after names of .glusterfs").await;
    });
    // Handle directories are made lazily; nothing was removed, renamed or added by a client.
    let after = walk_names(&s.on_brick(".glusterfs"));
    let lost: Vec<_> = before.iter().filter(|p| !after.contains(p)).collect();
    assert!(lost.is_empty(), "gone from .glusterfs: {lost:?}");
    assert!(!s.on_brick("stolen").exists());
    s.outside.assert_untouched();
}

#[test]
fn handles_and_the_root_gfid_are_unreachable_through_symlinks_and_reused_gfids() {
    let s = Scene::start(&[]);
    s.rt.block_on(async {
        let by = s.bystander().await;
        let v = s.connect("alice").await;
        let root = Creds::root();
        // Symlinks whose text, read from a handle's own directory, reaches into .glusterfs
        // or back to the root: their GFIDs are no directories.
        let root_handle = format!("../../00/00/{ROOT}");
        let targets = [
            "../../kiln-pending",
            "../..",
            "../../..",
            root_handle.as_str(),
            "../../../.glusterfs",
        ];
        for (i, target) in targets.into_iter().enumerate() {
            let r = fop(&v, &root, symlink(ROOT, &format!("h{i}"), gfid(), target)).await;
            let g = made(expect_ok("SYMLINK", r)).gfid;
            #[rustfmt::skip]
            expect_refusals(&v, &root, vec![
                ("PUT through a handle-relative symlink", put(g, "evil", gfid(), b"pwned"), NotDir),
                ("MKDIR through a handle-relative symlink", mkdir(g, "evil", gfid()), NotDir),
                ("LOOKUP through a handle-relative symlink", lookup(g, "kiln-pending"), NotDir),
                ("OPENDIR of a handle-relative symlink", opendir(g), NotDir),
                ("UNLINK through a handle-relative symlink", unlink(g, "00"), NotDir),
            ]).await;
        }
        // The root's GFID is nobody else's.
        #[rustfmt::skip]
        expect_refusals(&v, &root, vec![
            ("MKDIR with the root's GFID", mkdir(ROOT, "r", ROOT), Exist),
            ("PUT with the root's GFID", put(ROOT, "r", ROOT, b"pwned"), Exist),
            ("SYMLINK with the root's GFID", symlink(ROOT, "r", ROOT, "/"), Exist),
            ("OPEN of the root", open(ROOT, AccessMode::ReadWrite, OpenFlags::TRUNC),
                ErrorCode::IsDir),
        ]).await;
        by.check("after attempts on handles").await;
    });
    let made_inside: Vec<_> = walk_names(&s.cluster.brick)
        .into_iter()
        .filter(|p| p.ends_with("evil") || p.ends_with("r"))
        .collect();
    assert!(
        made_inside.is_empty(),
        "made inside the brick: {made_inside:?}"
    );
    s.outside.assert_untouched();
}

#[test]
fn the_bricks_own_xattrs_cannot_be_changed() {
    let s = Scene::start(&[]);
    s.rt.block_on(async {
        let by = s.bystander().await;
        let v = s.connect("alice").await;
        let root = Creds::root();
        let data = Bytes::from_static(b"f");
        let f = expect_ok("PUT f", v.put(&root, "/f", data, 0o644).await).gfid;
        let names = [
            "trusted.gfid",
            "trusted.glusterfs.volume-id",
            "trusted.kiln.brick-id",
            "trusted.afr.vol-client-0",
        ];
        for g in [ROOT, f] {
            for n in names {
                #[rustfmt::skip]
                expect_refusals(&v, &root, vec![
                    ("SETXATTR of the brick's own xattr", setxattr(g, n, &[7; 16]), Perm),
                    ("REMOVEXATTR of the brick's own xattr", removexattr(g, n), Perm),
                ]).await;
            }
        }
        let kept = xattrs(&s.on_brick("f")).get("trusted.gfid").cloned();
        assert_eq!(kept.as_deref(), Some(&f.as_bytes()[..]));
        let root_gfid = xattrs(&s.cluster.brick).get("trusted.gfid").cloned();
        assert_eq!(root_gfid.as_deref(), Some(&ROOT.as_bytes()[..]));
        by.check("after attempts on the brick's xattrs").await;
    });
    s.outside.assert_untouched();
}

// ---- identity ----

#[test]
fn a_squashed_client_acting_as_root_gets_nobody_and_a_trusted_one_stays_root() {
    let s = Scene::start(&["--root-allow", "alice,carol"]);
    s.rt.block_on(async {
        let by = s.bystander().await;
        let alice = s.connect("alice").await;
        let bob = s.connect("bob").await;
        let root = Creds::root();
        let shared = dir_at_root(&alice, "shared", 0o777).await;
        let group_only = dir_at_root(&alice, "group-only", 0o770).await;

        let r = fop(&bob, &root, put(shared, "bob", gfid(), b"b")).await;
        let mine = made(expect_ok("a squashed client's PUT as root", r));
        assert_eq!((mine.uid, mine.gid), (NOBODY, NOBODY));
        assert_eq!(owner(&s.on_brick("shared/bob")), (NOBODY, NOBODY));
        let r = fop(&bob, &root, mkdir(shared, "bobdir", gfid())).await;
        let dir = made(expect_ok("a squashed client's MKDIR as root", r));
        assert_eq!((dir.uid, dir.gid), (NOBODY, NOBODY));
        let r = fop(&alice, &root, put(shared, "alice", gfid(), b"a")).await;
        let theirs = made(expect_ok("a trusted client's PUT as root", r));
        assert_eq!((theirs.uid, theirs.gid), (0, 0));
        assert_eq!(owner(&s.on_brick("shared/alice")), (0, 0));

        // Root's powers are gone, not just its name.
        let (t, write) = (theirs.gfid, AccessMode::WriteOnly);
        let null = rustix::fs::makedev(1, 3);
        #[rustfmt::skip]
        expect_refusals(&bob, &root, vec![
            ("PUT in the root-owned root", put(ROOT, "bob-in-root", gfid(), b"b"), Access),
            ("chown of its own file to root", setattr(mine.gfid, chown(0, 0)), Perm),
            ("chmod of root's file", setattr(t, chmod(0o4777)), Perm),
            ("OPEN for writing of root's 0644 file", open(t, write, OpenFlags::TRUNC), Access),
            ("SETXATTR trusted.*", setxattr(t, "trusted.evil", b"1"), Perm),
            ("MKNOD of a device", mknod(shared, "chr", gfid(), NodeType::CharDevice, null), Perm),
        ]).await;
        // Group 0 is squashed too, as the primary group or a supplementary one.
        for who in [creds(1000, 0, &[]), creds(1000, 1000, &[0])] {
            let r = fop(&bob, &who, put(group_only, "g", gfid(), b"g")).await;
            expect_err("a squashed group 0 in a root-group directory", r, Access);
        }
        let who = creds(1000, 1000, &[0]);
        let r = fop(&alice, &who, put(group_only, "g", gfid(), b"g")).await;
        let kept = made(expect_ok("a trusted client's group 0", r));
        assert_eq!((kept.uid, kept.gid), (1000, 1000));
        by.check("after root attempts").await;
    });
    assert!(!s.on_brick("bob-in-root").exists());
    assert!(!s.on_brick("shared/chr").exists());
    assert_eq!(
        std::fs::read(s.on_brick("shared/alice")).expect("alice's file"),
        b"a"
    );
    s.outside.assert_untouched();
}

#[test]
fn with_root_squash_off_every_client_is_root() {
    let s = Scene::start(&["--root-squash", "off"]);
    s.rt.block_on(async {
        let by = s.bystander().await;
        let bob = s.connect("bob").await;
        let root = Creds::root();
        let r = fop(&bob, &root, put(ROOT, "bob", gfid(), b"b")).await;
        let iatt = made(expect_ok("bob's PUT as root", r));
        assert_eq!((iatt.uid, iatt.gid), (0, 0));
        assert_eq!(owner(&s.on_brick("bob")), (0, 0));
        let r = fop(&bob, &root, setattr(iatt.gfid, chown(4242, 4242))).await;
        expect_ok("bob's chown as root", r);
        assert_eq!(owner(&s.on_brick("bob")), (4242, 4242));
        by.check("after an unsquashed root").await;
    });
    s.outside.assert_untouched();
}

#[test]
fn anonuid_and_anongid_name_what_a_squashed_root_becomes() {
    let s = Scene::start(&["--anonuid", "4242", "--anongid", "4343"]);
    s.rt.block_on(async {
        let by = s.bystander().await;
        let alice = s.connect("alice").await;
        let bob = s.connect("bob").await;
        let shared = dir_at_root(&alice, "shared", 0o777).await;
        let r = fop(&bob, &Creds::root(), put(shared, "bob", gfid(), b"b")).await;
        let iatt = made(expect_ok("bob's PUT as root", r));
        assert_eq!((iatt.uid, iatt.gid), (4242, 4343));
        assert_eq!(owner(&s.on_brick("shared/bob")), (4242, 4343));
        by.check("after squashing to anonuid").await;
    });
    s.outside.assert_untouched();
}

#[test]
fn an_id_of_minus_one_resets_only_its_own_stream() {
    let s = Scene::start(&[]);
    let minus_one = [
        ("uid -1", creds(u32::MAX, 0, &[])),
        ("gid -1", creds(0, u32::MAX, &[])),
        ("group -1", creds(0, 0, &[5, u32::MAX])),
        ("all -1", creds(u32::MAX, u32::MAX, &[u32::MAX])),
    ];
    s.rt.block_on(async {
        let by = s.bystander().await;
        for client in ["alice", "bob"] {
            // Through the client library: a protocol error for that call, and the next call
            // on the same client works.
            let v = s.connect(client).await;
            for (what, bad) in &minus_one {
                match fop(&v, bad, put(ROOT, "minus-one", gfid(), b"x")).await {
                    Err(Error::Protocol(why)) => assert!(why.contains("refused"), "{why}"),
                    other => panic!("{client}'s PUT with {what}: {other:?}"),
                }
                expect_ok("a STAT after it", fop(&v, &Creds::root(), stat(ROOT)).await);
            }
            // On a raw connection: the stream is reset as a bad frame, the connection lives.
            let raw = s.raw(client).await;
            for (what, bad) in &minus_one {
                let fop = put(ROOT, "minus-one", gfid(), b"x");
                let frame = raw.request(Call::Fop {
                    creds: bad.clone(),
                    fop,
                });
                raw.expect_reset(&format!("{client}'s PUT with {what}"), &frame, true)
                    .await;
                raw.ping(&format!("{client}'s connection after {what}"))
                    .await;
            }
        }
        by.check("after ids of -1").await;
    });
    assert!(
        !s.on_brick("minus-one").exists(),
        "a call with an id of -1 ran"
    );
    s.outside.assert_untouched();
}

// ---- fd, lock and connection exhaustion ----

#[test]
fn a_client_at_its_open_files_limit_gets_emfile_while_others_still_open() {
    const LIMIT: usize = 32;
    let s = Scene::start(&["--open-files-per-client-max", "32"]);
    s.rt.block_on(async {
        let by = s.bystander().await;
        let hog = s.connect("alice").await;
        let root = Creds::root();
        let dir = expect_ok("MKDIR many", hog.mkdir(&root, "/many", 0o755).await).gfid;
        let mut files = Vec::new();
        for i in 0..LIMIT + 8 {
            let data = Bytes::from_static(b"x");
            let put = hog.put(&root, &format!("/many/f{i}"), data, 0o644).await;
            files.push(expect_ok("PUT", put).gfid);
        }
        // The hog opens until refused: exactly its quota.
        let mut held = Vec::new();
        let refused = loop {
            assert!(held.len() <= LIMIT, "opened more than the limit of {LIMIT}");
            match read_only(&hog, files[held.len()]).await {
                Ok(fd) => held.push(fd),
                Err(e) => break e,
            }
        };
        assert_eq!(
            (held.len(), refused.code()),
            (LIMIT, Some(MFile)),
            "{refused}"
        );
        expect_err(
            "OPENDIR at the limit",
            within("OPENDIR", hog.opendir(&root, dir)).await,
            MFile,
        );
        let creating = hog.create(&root, create_args(dir, "new", gfid(), OpenFlags::EXCL));
        expect_err(
            "CREATE at the limit",
            within("CREATE", creating).await,
            MFile,
        );
        // A create refused with EMFILE leaves no file behind, as open(O_CREAT) would not.
        let r = fop(&hog, &root, lookup(dir, "new")).await;
        expect_err(
            "LOOKUP of a create refused with EMFILE",
            r,
            ErrorCode::NoEnt,
        );
        // PUT keeps no fd: still fine.
        let put = hog
            .put(&root, "/many/put", Bytes::from_static(b"p"), 0o644)
            .await;
        expect_ok("PUT at the limit", put);

        // Other sessions are not affected: another client, and the hog's second connection.
        let bob = s.connect("bob").await;
        let hog2 = s.connect("alice").await;
        for v in [&bob, &hog2] {
            let mut fds = Vec::new();
            for g in &files[..LIMIT] {
                fds.push(expect_ok("another session's OPEN", read_only(v, *g).await));
            }
            assert_eq!(
                &expect_ok("READ", v.read(&root, &fds[0], 0, 10).await)[..],
                b"x"
            );
            for fd in fds {
                expect_ok("RELEASE", v.release(&root, fd).await);
            }
        }
        by.check("while a client is at its fd limit").await;
        // One fd given back, one more open.
        let fd = held.pop().expect("an fd");
        expect_ok("RELEASE", hog.release(&root, fd).await);
        let again = read_only(&hog, files[LIMIT]).await;
        held.push(expect_ok("OPEN after a release", again));
        by.check("after the fd limit").await;
    });
    s.outside.assert_untouched();
}

#[test]
fn a_client_at_its_lock_limit_gets_enolck_while_others_still_lock() {
    const LIMIT: u64 = 8;
    let s = Scene::start(&["--locks-per-client-max", "8"]);
    let lock = |kind, start, owner| Lock {
        kind,
        start,
        len: 1,
        pid: 1,
        owner,
    };
    s.rt.block_on(async {
        let by = s.bystander().await;
        let hog = s.connect("alice").await;
        let bob = s.connect("bob").await;
        let root = Creds::root();
        let mut gfids = Vec::new();
        for n in ["/a", "/b"] {
            let put = hog.put(&root, n, Bytes::from(vec![0u8; 64]), 0o644).await;
            gfids.push(expect_ok("PUT", put).gfid);
        }
        let rw = hog.open(&root, gfids[0], AccessMode::ReadWrite, OpenFlags::empty());
        let fd = expect_ok("OPEN", rw.await);
        let set = |fd, l| within("LK", hog.lk(&root, fd, LockCmd::Set, l));
        for i in 0..LIMIT {
            // Ranges two bytes apart, so none merges with another.
            expect_ok(
                "a lock within the limit",
                set(&fd, lock(LockKind::Write, 2 * i, 1)).await,
            );
        }
        for owner in [1, 2] {
            let r = set(&fd, lock(LockKind::Write, 100, owner)).await;
            expect_err("a lock past the limit", r, NoLock);
        }
        // Another client locks as before.
        let ro = bob.open(&root, gfids[1], AccessMode::ReadOnly, OpenFlags::empty());
        let theirs = expect_ok("bob's OPEN", ro.await);
        for i in 0..LIMIT {
            let l = lock(LockKind::Read, 2 * i, 9);
            let r = within("LK", bob.lk(&root, &theirs, LockCmd::Set, l)).await;
            expect_ok("another client's lock", r);
        }
        by.check("while a client is at its lock limit").await;
        // An unlock gives one back.
        expect_ok("unlock", set(&fd, lock(LockKind::Unlock, 0, 1)).await);
        expect_ok(
            "a lock after an unlock",
            set(&fd, lock(LockKind::Write, 100, 1)).await,
        );
    });
    s.outside.assert_untouched();
}

/// Opens file `gfid` for reading as root, bounded in time.
async fn read_only(v: &BrickClient, gfid: Gfid) -> Result<kiln_client::Fd, Error> {
    let root = Creds::root();
    let opening = v.open(&root, gfid, AccessMode::ReadOnly, OpenFlags::empty());
    within("OPEN", opening).await
}

/// Asserts that a connection attempt was refused with a reason that names `limit`.
fn refused_for(what: &str, result: Result<BrickClient, Error>, limit: &str) {
    match result {
        Err(Error::Refused(why)) if why.contains(limit) => {}
        // A full brick refuses before spending a TLS handshake, with QUIC's own refusal.
        Err(Error::Connect { reason, .. })
            if limit == "network.connections-max" && reason.contains("refused") => {}
        other => panic!("{what}: expected a refusal naming {limit}, got {other:?}"),
    }
}

#[test]
fn a_third_connection_with_one_certificate_is_refused_while_others_connect() {
    let s = Scene::start(&["--connections-per-client-max", "2"]);
    s.rt.block_on(async {
        let by = s.bystander().await;
        let first = s.connect("alice").await;
        let second = s.connect("alice").await;
        for v in [&first, &second] {
            within("PING", v.ping()).await.expect("ping");
        }
        let third = s.try_connect("alice").await;
        refused_for(
            "a third connection",
            third,
            "network.connections-per-client-max",
        );
        let bob = s.connect("bob").await;
        within("PING", bob.ping())
            .await
            .expect("another certificate connects");
        by.check("while alice is at her connection limit").await;
        // A closed connection gives its slot back.
        first.close().await;
        let again = eventually(10, "alice connects again after closing one", || async {
            s.try_connect("alice").await.ok()
        })
        .await;
        within("PING", again.ping())
            .await
            .expect("alice's new connection");
        within("PING", second.ping())
            .await
            .expect("alice's second connection");
    });
    s.outside.assert_untouched();
}

#[test]
fn the_brick_refuses_connections_past_connections_max() {
    let s = Scene::start(&["--connections-max", "3"]);
    s.rt.block_on(async {
        let by = s.bystander().await;
        let alice = s.connect("alice").await;
        let bob = s.connect("bob").await;
        for who in ["alice", "bob", "carol"] {
            let fourth = s.try_connect(who).await;
            refused_for("a fourth connection", fourth, "network.connections-max");
        }
        within("PING", alice.ping()).await.expect("alice");
        within("PING", bob.ping()).await.expect("bob");
        by.check("while the brick is full").await;
        bob.close().await;
        let again = eventually(10, "a connection after one closed", || async {
            s.try_connect("bob").await.ok()
        })
        .await;
        within("PING", again.ping())
            .await
            .expect("the new connection");
        by.check("after the brick was full").await;
    });
    s.outside.assert_untouched();
}

// ---- floods: bytes, streams, frames, lock waits ----

/// A valid PUT header announcing a body of `body_len` bytes.
fn announcing(body_len: u32) -> [u8; 32] {
    Header {
        kind: FrameKind::Request,
        code: CallCode::Fop(FopCode::Put).to_u16(),
        flags: 0,
        request_id: 7,
        body_len,
        body_checksum: 0,
    }
    .encode()
}

#[test]
fn one_byte_per_stream_pins_no_memory_and_stream_credit_bounds_the_flood() {
    const CONNECTIONS: usize = 4;
    const INFLIGHT_MAX: usize = 256;
    const ANNOUNCED_BYTES: u32 = 1024 * 1024;
    // The brick may grow by an eighth of what the streams announce (a stalled call costs a
    // task and QUIC's stream state: 20 to 70 KiB each in a debug build). One that allocated
    // bodies by their announced length grew by over 1 GiB here.
    const GROWTH_MAX_FRACTION: u64 = 8;
    let s = Scene::start(&["--inflight-max", "256"]);
    s.rt.block_on(async {
        let by = s.bystander().await;
        let mut conns = Vec::new();
        for _ in 0..CONNECTIONS {
            let raw = s.raw("alice").await;
            raw.ping("before the flood").await;
            conns.push(raw);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let before = s.brick_rss_kib();
        // Every stream: a valid header announcing 1 MiB, one byte, then silence. Each
        // connection opens what its credit allows, short of the two streams it used itself
        // (QUIC returns their credit lazily).
        let mut frame = announcing(ANNOUNCED_BYTES).to_vec();
        frame.push(0x42);
        let mut streams = Vec::new();
        for raw in &conns {
            for _ in 0..INFLIGHT_MAX - 2 {
                let (mut send, recv) = within("a stream", raw.connection.open_bi())
                    .await
                    .expect("stream");
                within("a byte", send.write_all(&frame))
                    .await
                    .expect("write");
                streams.push((send, recv));
            }
        }
        by.check("while a thousand streams trickle").await;
        // Stream credit is the bound: the first connection gets at most inflight-max.
        let mut on_first = INFLIGHT_MAX - 2;
        let next = || tokio::time::timeout(Duration::from_secs(2), conns[0].connection.open_bi());
        while let Ok(opened) = next().await {
            let (mut send, recv) = opened.expect("stream");
            within("a byte", send.write_all(&frame))
                .await
                .expect("write");
            streams.push((send, recv));
            on_first += 1;
            assert!(
                on_first <= INFLIGHT_MAX,
                "a stream past inflight-max was opened"
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let after = s.brick_rss_kib();
        let growth = after.saturating_sub(before);
        let announced_kib = streams.len() as u64 * u64::from(ANNOUNCED_BYTES / 1024);
        assert!(
            growth < announced_kib / GROWTH_MAX_FRACTION,
            "{} streams announcing {} KiB each grew the brick by {growth} KiB ({before} → {after})",
            streams.len(),
            ANNOUNCED_BYTES / 1024,
        );
        // The stalled streams hold nothing of anyone else's.
        s.raw("bob")
            .await
            .ping("a new connection during the flood")
            .await;
        by.check("during the flood").await;
        // Finished streams are refused as truncated, and their credit comes back.
        drop(streams);
        for raw in &conns {
            raw.ping("a flooding connection once its streams are finished")
                .await;
        }
        drop(conns);
        by.check("after the flood").await;
    });
    s.outside.assert_untouched();
}

/// Frames the client library never sends, each with whether its stream is finished: the
/// brick must reset each stream as a bad frame (those not finished, from their header
/// alone).
#[rustfmt::skip]
fn bad_frames(raw: &RawConn) -> Vec<(&'static str, Vec<u8>, bool)> {
    let ping = raw.request(Call::Ping(Ping { nonce: 5 }));
    let (ping_header, ping_body) = split(&ping);
    let with_header = |change: &dyn Fn(&mut Header)| {
        let mut h = ping_header;
        change(&mut h);
        [&h.encode()[..], &ping_body[..]].concat()
    };
    let flipped = |at: usize| {
        let mut f = ping.clone();
        f[at] ^= 0x01;
        f
    };
    let lookup = raw.request(Call::Fop {
        creds: Creds::root(),
        fop: lookup(ROOT, PLACEHOLDER),
    });
    // Creds whose bytes are easy to find: the group count follows the gid.
    let marked = raw.request(Call::Fop {
        creds: creds(0x0102_0304, 0x0506_0708, &[]),
        fop: stat(ROOT),
    });
    let put = raw.request(Call::Fop {
        creds: Creds::root(),
        fop: put(placeholder_gfid(), "p", gfid(), b"0123456789abcdef"),
    });
    let payload = |len: [u8; 4]| [&len[..], b"0123456789abcdef"].concat();
    let over_limit = u32::try_from(FRAME_BODY_LEN_MAX_BYTES + 1).expect("u32");
    let name = wire_name(PLACEHOLDER.as_bytes());
    let long_name = [&[200u8][..], PLACEHOLDER.as_bytes()].concat();
    let (gid, lying_count) = ([8, 7, 6, 5, 0, 0, 0, 0], [8, 7, 6, 5, 0xFF, 0xFF, 0xFF, 0x0F]);
    vec![
        // Refused from the header alone: the body never comes.
        ("a body over the limit", announcing(over_limit).to_vec(), false),
        ("a body of 4 GiB", announcing(u32::MAX).to_vec(), false),
        ("a bad header checksum", flipped(28), true),
        ("a bad magic", flipped(0), true),
        ("reserved header bits", with_header(&|h| h.flags = 2), true),
        ("a body without its checksum, not negotiated", with_header(&|h| {
            h.flags = FLAG_BODY_UNCHECKED;
            h.body_checksum = 0;
        }), true),
        ("an unknown call code", with_header(&|h| h.code = 0x7777), true),
        ("a reply instead of a request", with_header(&|h| h.kind = FrameKind::Reply), true),
        // Lies in the body.
        ("a bad body checksum", with_header(&|h| h.body_checksum ^= 1), true),
        ("a truncated body", ping[..ping.len() - 3].to_vec(), true),
        ("bytes after the message", reframe(ping_header, &[&ping_body[..], &[0; 4]].concat()), true),
        ("a name longer than the body", patched(&lookup, &name, &long_name), true),
        ("268 million groups", patched(&marked, &gid, &lying_count), true),
        ("a payload longer than the body", patched(&put, &payload([16, 0, 0, 0]), &payload([0, 0, 16, 0])), true),
        ("a null GFID", patched(&put, placeholder_gfid().as_bytes(), &[0; 16]), true),
        ("garbage", vec![0xA5; 300], true),
        ("nothing at all", vec![], true),
    ]
}

#[test]
fn oversized_and_lying_frames_on_many_streams_reset_only_their_own_streams() {
    const COPIES: usize = 16;
    let s = Scene::start(&[]);
    s.rt.block_on(async {
        let by = s.bystander().await;
        let raw = Arc::new(s.raw("alice").await);
        let attacks = bad_frames(&raw);
        let mut tasks = tokio::task::JoinSet::new();
        for copy in 0..COPIES {
            for (what, frame, finish) in &attacks {
                let what = format!("{what} (copy {copy})");
                let (raw, frame, finish) = (raw.clone(), frame.clone(), *finish);
                tasks.spawn(async move { raw.expect_reset(&what, &frame, finish).await });
            }
            // Good calls among the bad ones, on the same connection.
            let raw = raw.clone();
            tasks.spawn(async move { raw.ping("a good call among bad frames").await });
        }
        let mut done = 0;
        while let Some(result) = tasks.join_next().await {
            result.expect("a stream task panicked");
            done += 1;
        }
        assert_eq!(done, COPIES * (attacks.len() + 1));
        raw.ping("the attacked connection afterwards").await;
        match raw.fop(Creds::root(), stat(ROOT)).await {
            Answer::Reply(Message::Reply(Reply {
                outcome: Outcome::Fop(FopReply::Stat(_)),
                ..
            })) => {}
            other => panic!("a fop on the attacked connection: {other:?}"),
        }
        by.check("after bad frames").await;
    });
    let logs = s.brickd.logs();
    assert!(
        logs.contains("bad frame: stream reset"),
        "the brick logged no resets"
    );
    s.outside.assert_untouched();
}

#[test]
fn a_flood_of_lock_waits_holds_no_thread_on_the_uring_engine() {
    lock_wait_flood(&[]);
}

#[test]
fn a_flood_of_lock_waits_holds_no_thread_on_the_blocking_engine() {
    lock_wait_flood(&["--engine", "blocking"]);
}

/// 64 F_SETLKW calls from four connections wait on one write lock — many more waiters than
/// the brick has threads — while other clients work; the waiters of a closed connection end
/// with it, the others get their locks when the holder unlocks.
fn lock_wait_flood(extra: &[&str]) {
    const CONNECTIONS: usize = 4;
    const WAITS_PER_CONNECTION: u64 = 16;
    let s = Scene::start(extra);
    let whole = |kind, owner| Lock {
        kind,
        start: 0,
        len: 0,
        pid: 1,
        owner,
    };
    s.rt.block_on(async {
        let by = s.bystander().await;
        let holder = s.connect("alice").await;
        let root = Creds::root();
        let put = holder
            .put(&root, "/locked", Bytes::from_static(b"l"), 0o644)
            .await;
        let file = expect_ok("PUT", put).gfid;
        let rw = holder.open(&root, file, AccessMode::ReadWrite, OpenFlags::empty());
        let held = expect_ok("OPEN", rw.await);
        let lk = |cmd, l| holder.lk(&root, &held, cmd, l);
        expect_ok(
            "the holder's lock",
            lk(LockCmd::Set, whole(LockKind::Write, 1)).await,
        );

        let mut waiters = Vec::new();
        for c in 0..CONNECTIONS {
            let v = s.connect("bob").await;
            let ro = v.open(&root, file, AccessMode::ReadOnly, OpenFlags::empty());
            let fd = Arc::new(expect_ok("a waiter's OPEN", ro.await));
            let mut waits = tokio::task::JoinSet::new();
            for w in 0..WAITS_PER_CONNECTION {
                let (v, fd, root) = (v.clone(), fd.clone(), root.clone());
                let lock = whole(LockKind::Read, 100 * (c as u64 + 1) + w);
                waits.spawn(async move { v.lk(&root, &fd, LockCmd::SetWait, lock).await });
            }
            waiters.push((v, fd, waits));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        for (_, _, waits) in &mut waiters {
            assert!(
                waits.try_join_next().is_none(),
                "a waiter got a lock that is held"
            );
        }
        // Meanwhile everyone else is served, blocking-pool fops included (listing, chmod,
        // xattrs).
        by.check("while 64 lock waits are queued").await;
        expect_ok(
            "chmod",
            fop(&holder, &root, setattr(file, chmod(0o640))).await,
        );
        let set = fop(&holder, &root, setxattr(file, "user.during", b"1")).await;
        expect_ok("SETXATTR", set);
        let test = expect_ok("F_GETLK", lk(LockCmd::Get, whole(LockKind::Write, 2)).await);
        assert_eq!((test.kind, test.owner), (LockKind::Write, 1));

        // The waiters of a closed connection end with it, and its session ends (its fd is
        // closed) well before the 30 s an orphaned call may run.
        let fds_before = s.brickd.open_fds();
        let (gone, _gone_fd, mut gone_waits) = waiters.pop().expect("a waiter connection");
        gone.close().await;
        let mut ended = 0;
        while let Some(result) =
            within("a closed connection's waiter", gone_waits.join_next()).await
        {
            let result = result.expect("waiter task");
            assert!(
                result.is_err(),
                "a closed connection's waiter got a lock: {result:?}"
            );
            ended += 1;
        }
        assert_eq!(ended, WAITS_PER_CONNECTION);
        eventually(10, "the closed connection's session to end", || async {
            (s.brickd.open_fds() < fds_before).then_some(())
        })
        .await;

        // The holder unlocks: every remaining waiter gets its shared lock.
        expect_ok("unlock", lk(LockCmd::Set, whole(LockKind::Unlock, 1)).await);
        for (_, _, waits) in &mut waiters {
            while let Some(result) = within("a waiter after the unlock", waits.join_next()).await {
                let got = expect_ok("F_SETLKW after the unlock", result.expect("waiter task"));
                assert_eq!(got.kind, LockKind::Read);
            }
        }
        // Their connections go; no lock of theirs is left behind.
        for (v, _, _) in &waiters {
            v.close().await;
        }
        eventually(
            10,
            "the holder's write lock once the readers are gone",
            || async { lk(LockCmd::Set, whole(LockKind::Write, 1)).await.ok() },
        )
        .await;
        by.check("after the lock-wait flood").await;
    });
    s.outside.assert_untouched();
}
