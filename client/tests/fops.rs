//! Every fop through the client library against a real `kiln-brickd`, on both engines.

mod common;

use bytes::Bytes;
use common::{Cluster, runtime};
use kiln_client::path::new_gfid;
use kiln_client::{BrickClient, ConnectOptions, Error, FdFop, Layer, LayerExt, Paths};
use kiln_wire::{
    AccessMask, AccessMode, Capabilities, Creds, DirEntryXattrs, ErrorCode, FileType, FopCode,
    FopReply, Gfid, LeaseKind, Lock, LockCmd, LockKind, Mode, Name, NodeType, OpenFlags, Payload,
    ReadSize, ReaddirSize, RenameMode, SeekWhat, SetAttr, SymlinkTarget, XattrName, XattrPresence,
    XattrSetMode, XattrValue,
};

fn name(s: &str) -> Name {
    Name::new(Bytes::copy_from_slice(s.as_bytes())).expect("name")
}

fn xname(s: &str) -> XattrName {
    XattrName::new(Bytes::copy_from_slice(s.as_bytes())).expect("xattr name")
}

fn mode(m: u32) -> Mode {
    Mode::new(m).expect("mode")
}

fn code(e: &Error) -> ErrorCode {
    e.code().unwrap_or_else(|| panic!("not a fop error: {e}"))
}

#[test]
fn every_fop_over_quic_uring() {
    every_fop("uring");
}

#[test]
fn every_fop_over_quic_blocking() {
    every_fop("blocking");
}

fn every_fop(engine: &str) {
    let cluster = Cluster::new();
    let brickd = cluster.start("127.0.0.1:0", &["--engine", engine]);
    let rt = runtime();
    rt.block_on(async {
        let v = cluster.connect(brickd.addr, "alice").await;
        let mut seen = std::collections::BTreeSet::new();
        exercise(&v, &mut seen).await;
        let missing: Vec<_> = FopCode::ALL
            .iter()
            .filter(|c| !seen.contains(*c))
            .map(|c| c.name())
            .collect();
        assert!(missing.is_empty(), "fops not exercised: {missing:?}");
        v.close().await;
    });
    // What the client did is what is on disk.
    assert_eq!(
        std::fs::read(cluster.brick.join("dir/renamed")).expect("file on the brick"),
        b"hello, kiln"
    );
}

/// Calls every fop once or more, checking each answer; records the codes used in `seen`.
#[allow(
    clippy::too_many_lines,
    reason = "one walk through the whole fop table"
)]
async fn exercise(v: &BrickClient, seen: &mut std::collections::BTreeSet<FopCode>) {
    let creds = Creds::root();
    macro_rules! call {
        ($variant:ident, $fop:expr) => {{
            seen.insert(FopCode::$variant);
            match v.call(&creds, kiln_wire::$variant { ..$fop }.into()).await {
                Ok(FopReply::$variant(r)) => r,
                other => panic!("{}: {other:?}", stringify!($variant)),
            }
        }};
    }
    macro_rules! call_fd {
        ($fd:expr, $variant:ident, |$id:ident| $fop:expr) => {{
            seen.insert(FopCode::$variant);
            match v.call_fd(&creds, $fd, FdFop::new(|$id| $fop.into())).await {
                Ok(FopReply::$variant(r)) => r,
                other => panic!("{}: {other:?}", stringify!($variant)),
            }
        }};
    }

    let root = v.stat(&creds, Gfid::ROOT).await.expect("stat root");
    seen.insert(FopCode::Stat);
    assert_eq!(root.file_type, FileType::Directory);

    let dir = call!(
        Mkdir,
        kiln_wire::Mkdir {
            parent: Gfid::ROOT,
            name: name("dir"),
            gfid: new_gfid(),
            mode: mode(0o755),
            umask: mode(0o022),
        }
    );
    let dir = dir.iatt.gfid;
    let found = call!(
        Lookup,
        kiln_wire::Lookup {
            parent: Gfid::ROOT,
            name: name("dir"),
        }
    );
    assert_eq!(found.iatt.gfid, dir);
    // LEASE: a read lease on the directory, then given back.
    for kind in [LeaseKind::Read, LeaseKind::None] {
        let held = call!(Lease, kiln_wire::Lease { gfid: dir, kind });
        assert_eq!(held.kind, kind);
    }

    // CREATE, WRITE, FLUSH, FSYNC, FSTAT, READ, SEEK.
    seen.insert(FopCode::Create);
    let (fd, created) = v
        .create(
            &creds,
            kiln_wire::Create {
                parent: dir,
                name: name("file"),
                gfid: new_gfid(),
                access: AccessMode::ReadWrite,
                flags: OpenFlags::EXCL,
                mode: mode(0o640),
                umask: mode(0),
            },
        )
        .await
        .expect("create");
    let file = created.iatt.gfid;
    seen.insert(FopCode::Write);
    let written = v
        .write(&creds, &fd, 0, Bytes::from_static(b"hello, kiln"))
        .await
        .expect("write");
    assert_eq!((written.pre.size, written.post.size), (0, 11));
    call_fd!(&fd, Flush, |fd| kiln_wire::Flush { fd, lock_owner: 1 });
    call_fd!(&fd, Fsync, |fd| kiln_wire::Fsync { fd, datasync: true });
    let st = call_fd!(&fd, Fstat, |fd| kiln_wire::Fstat { fd });
    assert_eq!((st.iatt.size, st.iatt.mode.bits()), (11, 0o640));
    seen.insert(FopCode::Read);
    assert_eq!(
        &v.read(&creds, &fd, 7, 100).await.expect("read")[..],
        b"kiln"
    );
    let sought = call_fd!(&fd, Seek, |fd| kiln_wire::Seek {
        fd,
        offset: 0,
        what: SeekWhat::Data
    });
    assert_eq!(sought.offset, 0);
    // GET: the same bytes with no fd; a directory is refused as OPEN refuses it.
    let size = ReadSize::new(64).expect("size");
    let got = call!(
        Get,
        kiln_wire::Get {
            gfid: file,
            offset: 7,
            size
        }
    );
    assert_eq!((got.data.as_bytes(), got.iatt.size), (&b"kiln"[..], 11));
    let get_dir = kiln_wire::Get {
        gfid: dir,
        offset: 0,
        size,
    };
    let refused = v
        .call(&creds, get_dir.into())
        .await
        .expect_err("GET of a dir");
    assert_eq!(code(&refused), ErrorCode::IsDir);

    // Locks: a write lock is seen by LK GET from another owner.
    seen.insert(FopCode::Lk);
    let lock = |kind, owner| Lock {
        kind,
        start: 0,
        len: 0,
        pid: 1,
        owner,
    };
    v.lk(&creds, &fd, LockCmd::Set, lock(LockKind::Write, 7))
        .await
        .expect("lock");
    let held = v
        .lk(&creds, &fd, LockCmd::Get, lock(LockKind::Write, 8))
        .await
        .expect("test lock");
    assert_eq!((held.kind, held.owner), (LockKind::Write, 7));
    v.lk(&creds, &fd, LockCmd::Set, lock(LockKind::Unlock, 7))
        .await
        .expect("unlock");

    // fd xattrs and attributes.
    call_fd!(&fd, Fsetxattr, |fd| kiln_wire::Fsetxattr {
        fd,
        name: xname("user.f"),
        value: XattrValue::new(Bytes::from_static(b"1")).expect("value"),
        mode: XattrSetMode::Create,
    });
    let got = call_fd!(&fd, Fgetxattr, |fd| kiln_wire::Fgetxattr {
        fd,
        name: xname("user.f")
    });
    assert_eq!(got.value.as_bytes(), b"1");
    call_fd!(&fd, Fremovexattr, |fd| kiln_wire::Fremovexattr {
        fd,
        name: xname("user.f")
    });
    let changed = call_fd!(&fd, Fsetattr, |fd| kiln_wire::Fsetattr {
        fd,
        attr: SetAttr {
            mode: Some(mode(0o600)),
            ..SetAttr::default()
        }
    });
    assert_eq!(changed.post.mode.bits(), 0o600);
    let grown = call_fd!(&fd, Ftruncate, |fd| kiln_wire::Ftruncate { fd, size: 8192 });
    assert_eq!(grown.post.size, 8192);
    let alloc = call_fd!(&fd, Fallocate, |fd| kiln_wire::Fallocate {
        fd,
        keep_size: false,
        offset: 8192,
        len: 4096
    });
    assert_eq!(alloc.post.size, 12288);
    call_fd!(&fd, Discard, |fd| kiln_wire::Discard {
        fd,
        offset: 4096,
        len: 4096
    });
    call_fd!(&fd, Zerofill, |fd| kiln_wire::Zerofill {
        fd,
        offset: 8192,
        len: 4096
    });
    let shrunk = call!(
        Truncate,
        kiln_wire::Truncate {
            gfid: file,
            size: 11
        }
    );
    assert_eq!(shrunk.post.size, 11);
    seen.insert(FopCode::Release);
    v.release(&creds, fd).await.expect("release");

    // OPEN of an existing file, by GFID.
    seen.insert(FopCode::Open);
    let ro = v
        .open(&creds, file, AccessMode::ReadOnly, OpenFlags::empty())
        .await
        .expect("open");
    assert_eq!(
        &v.read(&creds, &ro, 0, 5).await.expect("read")[..],
        b"hello"
    );
    v.release(&creds, ro).await.expect("release");

    call!(
        Access,
        kiln_wire::Access {
            gfid: file,
            mask: AccessMask::READ
        }
    );
    let attr = call!(
        Setattr,
        kiln_wire::Setattr {
            gfid: file,
            attr: SetAttr {
                mode: Some(mode(0o644)),
                ..SetAttr::default()
            },
        }
    );
    assert_eq!(attr.post.mode.bits(), 0o644);

    // Path xattrs.
    call!(
        Setxattr,
        kiln_wire::Setxattr {
            gfid: file,
            name: xname("user.colour"),
            value: XattrValue::new(Bytes::from_static(b"blue")).expect("value"),
            mode: XattrSetMode::Upsert,
        }
    );
    let got = call!(
        Getxattr,
        kiln_wire::Getxattr {
            gfid: file,
            name: xname("user.colour"),
        }
    );
    assert_eq!(got.value.as_bytes(), b"blue");
    let list = call!(Listxattr, kiln_wire::Listxattr { gfid: file });
    assert!(list.entries.iter().any(|n| n.as_bytes() == b"user.colour"));
    // LOOKUP_XATTRS: which probed xattrs the object has (a user xattr is not one of them).
    let label = XattrValue::new(Bytes::from_static(b"system_u:object_r:kiln_t:s0")).expect("label");
    call!(
        Setxattr,
        kiln_wire::Setxattr {
            gfid: file,
            name: xname("security.selinux"),
            value: label,
            mode: XattrSetMode::Create,
        }
    );
    let found = call!(
        LookupXattrs,
        kiln_wire::LookupXattrs {
            parent: dir,
            name: name("file"),
        }
    );
    assert_eq!(
        (found.iatt.gfid, found.xattrs),
        (file, XattrPresence::SELINUX)
    );
    call!(
        Removexattr,
        kiln_wire::Removexattr {
            gfid: file,
            name: xname("user.colour"),
        }
    );

    // Links, symlinks, special files.
    let linked = call!(
        Link,
        kiln_wire::Link {
            gfid: file,
            new_parent: dir,
            new_name: name("hard"),
        }
    );
    assert_eq!(linked.iatt.nlink, 2);
    let sym = call!(
        Symlink,
        kiln_wire::Symlink {
            parent: dir,
            name: name("sym"),
            gfid: new_gfid(),
            target: SymlinkTarget::new(Bytes::from_static(b"file")).expect("target"),
        }
    );
    let target = call!(
        Readlink,
        kiln_wire::Readlink {
            gfid: sym.iatt.gfid
        }
    );
    assert_eq!(target.target.as_bytes(), b"file");
    let fifo = call!(
        Mknod,
        kiln_wire::Mknod {
            parent: dir,
            name: name("fifo"),
            gfid: new_gfid(),
            node_type: NodeType::Fifo,
            mode: mode(0o600),
            umask: mode(0),
            rdev: 0,
        }
    );
    assert_eq!(fifo.iatt.file_type, FileType::Fifo);
    let small = kiln_wire::Put {
        parent: dir,
        name: name("small"),
        gfid: new_gfid(),
        mode: mode(0o644),
        umask: mode(0),
        flags: OpenFlags::empty(),
        data: Payload::new(Bytes::from_static(b"tiny")).expect("payload"),
        attr: SetAttr::default(),
    };
    let put = call!(Put, small.clone());
    assert_eq!(put.iatt.size, 4);
    let mail = kiln_wire::Put {
        name: name("mail"),
        gfid: new_gfid(),
        data: Payload::new(Bytes::from_static(b"a mail")).expect("payload"),
        ..small
    };
    let synced = call!(PutSynced, kiln_wire::PutSynced { put: mail });
    assert_eq!(synced.iatt.size, 6);

    // Directory reading.
    seen.insert(FopCode::Opendir);
    let dfd = v.opendir(&creds, dir).await.expect("opendir");
    let size = ReaddirSize::new(64 * 1024).expect("size");
    let plain = call_fd!(&dfd, Readdir, |fd| kiln_wire::Readdir {
        fd,
        offset: 0,
        size
    });
    let mut names: Vec<String> = plain.entries.iter().map(|e| e.name.to_string()).collect();
    names.sort();
    assert_eq!(names, ["fifo", "file", "hard", "mail", "small", "sym"]);
    let plus = call_fd!(&dfd, Readdirp, |fd| kiln_wire::Readdirp {
        fd,
        offset: 0,
        size
    });
    assert!(
        plus.entries
            .iter()
            .any(|e| e.name.as_bytes() == b"small" && e.iatt.size == 4)
    );
    let with_xattrs = call_fd!(&dfd, ReaddirpXattrs, |fd| kiln_wire::ReaddirpXattrs {
        fd,
        offset: 0,
        size
    });
    let presence: Vec<_> = with_xattrs
        .entries
        .iter()
        .map(|e| {
            (
                e.name.to_string(),
                e.iatt.gfid == plus_gfid(&plus, &e.name),
                e.xattrs,
            )
        })
        .collect();
    assert!(presence.iter().all(|(_, same, _)| *same), "{presence:?}");
    for (entry, _, xattrs) in &presence {
        let labelled = entry == "file" || entry == "hard";
        let want = if labelled {
            XattrPresence::SELINUX
        } else {
            XattrPresence::empty()
        };
        assert_eq!(*xattrs, want, "{entry}");
    }
    call_fd!(&dfd, Fsyncdir, |fd| kiln_wire::Fsyncdir {
        fd,
        datasync: false
    });
    seen.insert(FopCode::Releasedir);
    v.release(&creds, dfd).await.expect("releasedir");
    // OPENDIR_LIST: the same entries as READDIRP_XATTRS, and an fd to go on with.
    seen.insert(FopCode::OpendirList);
    let (lfd, lease, first) = v
        .opendir_list(&creds, dir, size, LeaseKind::None)
        .await
        .expect("opendir_list");
    assert_eq!(lease, LeaseKind::None);
    let named = |entries: &[DirEntryXattrs]| -> Vec<(String, Gfid, XattrPresence)> {
        entries
            .iter()
            .map(|e| (e.name.to_string(), e.iatt.gfid, e.xattrs))
            .collect()
    };
    assert_eq!(named(&first.entries), named(&with_xattrs.entries));
    assert!(first.eof);
    call_fd!(&lfd, Fsyncdir, |fd| kiln_wire::Fsyncdir {
        fd,
        datasync: false
    });
    v.release(&creds, lfd).await.expect("releasedir");

    // Namespace changes.
    call!(
        Rename,
        kiln_wire::Rename {
            old_parent: dir,
            old_name: name("file"),
            new_parent: dir,
            new_name: name("renamed"),
            mode: RenameMode::NoReplace,
        }
    );
    for gone in ["hard", "sym", "fifo"] {
        call!(
            Unlink,
            kiln_wire::Unlink {
                parent: dir,
                name: name(gone),
            }
        );
    }
    call!(
        UnlinkSettled,
        kiln_wire::UnlinkSettled {
            parent: dir,
            name: name("small"),
        }
    );
    let statfs = call!(Statfs, kiln_wire::Statfs { gfid: Gfid::ROOT });
    assert!(statfs.stats.blocks > 0);
    call!(
        Mkdir,
        kiln_wire::Mkdir {
            parent: dir,
            name: name("empty"),
            gfid: new_gfid(),
            mode: mode(0o700),
            umask: mode(0),
        }
    );
    call!(
        Rmdir,
        kiln_wire::Rmdir {
            parent: dir,
            name: name("empty"),
        }
    );

    // Errors come back as the errno a local file system gives.
    let missing = v
        .lookup(&creds, dir, &name("nope"))
        .await
        .expect_err("ENOENT");
    assert_eq!(code(&missing), ErrorCode::NoEnt);
    let not_empty = v
        .call(
            &creds,
            kiln_wire::Rmdir {
                parent: Gfid::ROOT,
                name: name("dir"),
            }
            .into(),
        )
        .await
        .expect_err("ENOTEMPTY");
    assert_eq!(code(&not_empty), ErrorCode::NotEmpty);
}

/// A client that speaks as an older one — its HELLO without `PUT_SYNCED`, `GET` and
/// `UNLINK_SETTLED` — has those fops answered all the same, each sent as the older fops it
/// stands for (counted by the brick): PUT_SYNCED as PUT, then OPEN, FSYNC and RELEASE as
/// root (the file's mode lets its maker write it, not open it again); GET as OPEN, READ and
/// RELEASE; UNLINK_SETTLED as LOOKUP and UNLINK.
#[test]
fn fops_a_session_lacks_go_as_the_older_fops() {
    let cluster = Cluster::new();
    let metrics = common::free_loopback_addr();
    let args = ["--count-fop-hits", "--metrics-listen", &metrics];
    let brickd = cluster.start("127.0.0.1:0", &args);
    let older = Capabilities::PUT_SYNCED
        .union(Capabilities::GET)
        .union(Capabilities::UNLINK_SETTLED);
    let options = ConnectOptions {
        capabilities: Capabilities::OFFERED.without(older),
        ..cluster.options(brickd.addr, "alice")
    };
    let calls = |fops: &[&str]| {
        let now = common::scrape(&metrics);
        fops.iter()
            .map(|fop| common::fop_calls(&now, fop))
            .collect::<Vec<_>>()
    };
    runtime().block_on(async {
        let v = BrickClient::connect(options).await.expect("connect");
        let hello = v.hello().await.expect("hello");
        assert_eq!(hello.capabilities.intersection(older), Capabilities::NONE);
        let user = Creds {
            uid: 1000,
            gid: 1000,
            ..Creds::root()
        };
        let dir = v
            .call(
                &Creds::root(),
                kiln_wire::Mkdir {
                    parent: Gfid::ROOT,
                    name: name("spool"),
                    gfid: new_gfid(),
                    mode: mode(0o777),
                    umask: mode(0),
                }
                .into(),
            )
            .await
            .expect("mkdir");
        let FopReply::Mkdir(dir) = dir else {
            panic!("{dir:?}")
        };
        let put = kiln_wire::Put {
            parent: dir.iatt.gfid,
            name: name("mail"),
            gfid: new_gfid(),
            mode: mode(0o200),
            umask: mode(0),
            flags: OpenFlags::EXCL,
            data: Payload::new(Bytes::from_static(b"a mail")).expect("payload"),
            attr: SetAttr::default(),
        };
        let gfid = put.gfid;
        let before = calls(&["PUT", "OPEN", "FSYNC", "RELEASE", "PUT_SYNCED"]);
        match v.call(&user, kiln_wire::PutSynced { put }.into()).await {
            Ok(FopReply::PutSynced(made)) => assert_eq!((made.iatt.size, made.iatt.uid), (6, 1000)),
            other => panic!("PUT_SYNCED: {other:?}"),
        }
        let after = calls(&["PUT", "OPEN", "FSYNC", "RELEASE", "PUT_SYNCED"]);
        let sent: Vec<f64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
        assert_eq!(sent, [1.0, 1.0, 1.0, 1.0, 0.0], "PUT, OPEN, FSYNC, RELEASE");

        let size = ReadSize::new(64).expect("size");
        let get = kiln_wire::Get {
            gfid,
            offset: 0,
            size,
        };
        match v.call(&Creds::root(), get.into()).await {
            Ok(FopReply::Get(read)) => assert_eq!(read.data.as_bytes(), b"a mail"),
            other => panic!("GET: {other:?}"),
        }
        let unlink = kiln_wire::UnlinkSettled {
            parent: dir.iatt.gfid,
            name: name("mail"),
        };
        let unlinked = v.call(&user, unlink.into()).await;
        assert!(
            matches!(unlinked, Ok(FopReply::UnlinkSettled(_))),
            "{unlinked:?}"
        );
        let after = calls(&["GET", "UNLINK_SETTLED", "LOOKUP", "UNLINK", "READ"]);
        assert_eq!(
            (after[0], after[1]),
            (0.0, 0.0),
            "GET or UNLINK_SETTLED sent"
        );
        assert!(after[2] >= 1.0 && after[3] >= 1.0 && after[4] >= 1.0);
        let gone = v.lookup(&Creds::root(), dir.iatt.gfid, &name("mail")).await;
        assert_eq!(gone.map_err(|e| code(&e)).err(), Some(ErrorCode::NoEnt));
        v.close().await;
    });
}

#[test]
fn path_helpers_round_trip() {
    let cluster = Cluster::new();
    let brickd = cluster.start("127.0.0.1:0", &[]);
    runtime().block_on(async {
        let v = cluster.connect(brickd.addr, "alice").await;
        let creds = Creds::root();
        v.mkdir_all(&creds, "/a/b/c", 0o755)
            .await
            .expect("mkdir -p");
        v.mkdir_all(&creds, "/a/b/c", 0o755)
            .await
            .expect("mkdir -p again");
        v.put(&creds, "/a/b/c/one", Bytes::from_static(b"1"), 0o644)
            .await
            .expect("put");
        assert_eq!(
            code(
                &v.put(&creds, "/a/b/c/one", Bytes::from_static(b"x"), 0o644)
                    .await
                    .expect_err("taken")
            ),
            ErrorCode::Exist
        );
        // 2.5 MiB goes through CREATE and three WRITEs, and replaces what was there.
        let big: Vec<u8> = (0..2_621_440u32).map(|i| (i % 251) as u8).collect();
        v.write_file(&creds, "/a/b/c/one", Bytes::from(big.clone()), 0o600)
            .await
            .expect("write_file");
        assert_eq!(
            v.read_to_end(&creds, "/a/b/c/one").await.expect("read"),
            big
        );
        let walked: Vec<String> = v
            .walk(&creds, "/a")
            .await
            .expect("walk")
            .into_iter()
            .map(|(p, _)| p)
            .collect();
        assert_eq!(walked, ["/a", "/a/b", "/a/b/c", "/a/b/c/one"]);
        assert_eq!(
            code(
                &v.resolve(&creds, "/a/b/c/one/x")
                    .await
                    .expect_err("ENOTDIR")
            ),
            ErrorCode::NotDir
        );
        v.remove_all(&creds, "/a").await.expect("rm -r");
        assert_eq!(
            code(&v.resolve(&creds, "/a").await.expect_err("gone")),
            ErrorCode::NoEnt
        );
        v.close().await;
    });
    let left: Vec<_> = std::fs::read_dir(&cluster.brick)
        .expect("brick")
        .map(|e| e.expect("entry").file_name())
        .filter(|n| n != ".glusterfs")
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// The GFID READDIRP gave entry `name`.
fn plus_gfid(plus: &kiln_wire::ReaddirpReply, name: &Name) -> Gfid {
    let entry = plus.entries.iter().find(|e| &e.name == name);
    entry.expect("the same entries in READDIRP").iatt.gfid
}
