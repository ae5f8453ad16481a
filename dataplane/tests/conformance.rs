//! The fop contract, run against both engines: every fop, the errno cases a local Linux file
//! system gives, permissions, rename edge cases, long names, deep trees, and containment.

mod common;

use std::os::unix::fs::MetadataExt as _;

use bytes::Bytes;
use common::*;
use kiln_dataplane::{EngineKind, FopsConfig, ParentAttrs};
use kiln_wire::*;

per_engine!(
    create_write_read_release,
    put_small_files_and_retry,
    a_put_sets_its_attributes_or_makes_nothing,
    mkdir_readdir_readdirp,
    modes_are_masked_by_the_callers_umask_only,
    errno_cases,
    rename_cases,
    permissions_are_the_kernels,
    symlinks_never_escape,
    xattrs,
    setattr_fields,
    hard_links,
    renames_between_names_of_one_file_change_nothing,
    fallocate_and_seek,
    locks_between_sessions,
    deep_tree_resolves_by_handle,
    open_file_limit_and_session_end,
    names_at_255_bytes,
    statfs_and_access,
    serves_a_glusterfs_brick,
    reused_gfid_is_refused,
    writes_run_as_the_caller,
    write_through_syncs_every_write,
    a_lookup_on_a_fresh_engine_writes_nothing,
    a_retried_create_must_match_the_type,
    setattr_never_follows_or_truncates_special_files,
    owners_reach_their_unsearchable_directories,
    ftruncate_runs_as_the_caller_on_the_open_file,
    lock_waits_hold_no_thread_and_end_with_their_session,
    readdirp_needs_search_permission_as_stat_does,
    new_files_are_named_without_cap_dac_read_search,
    parent_attributes_only_for_a_session_that_wants_them,
    unlink_settled_leaves_sticky_files_alone,
);

fn create_write_read_release(kind: EngineKind) {
    let h = Harness::new(kind);
    let gfid = h.gfid();
    let create = Create {
        parent: Gfid::ROOT,
        name: name("a.txt"),
        gfid,
        access: AccessMode::ReadWrite,
        flags: OpenFlags::EXCL,
        mode: mode(0o640),
        umask: mode(0o022),
    };
    let FopReply::Create(c) = h.call(&root(), create).expect("create") else {
        panic!()
    };
    assert_eq!(c.iatt.gfid, gfid);
    assert_eq!(c.iatt.file_type, FileType::Regular);
    assert_eq!(c.iatt.mode.bits(), 0o640);
    assert_eq!(c.iatt.nlink, 1, "the handle link is not visible");
    let data = Payload::new(Bytes::from_static(b"hello, brick")).expect("small");
    let FopReply::Write(w) = h
        .call(
            &root(),
            Write {
                fd: c.fd,
                offset: 0,
                data,
            },
        )
        .expect("write")
    else {
        panic!()
    };
    assert_eq!((w.pre.size, w.post.size), (0, 12));
    let FopReply::Fsync(_) = h
        .call(
            &root(),
            Fsync {
                fd: c.fd,
                datasync: false,
            },
        )
        .expect("fsync")
    else {
        panic!()
    };
    let FopReply::Fstat(s) = h.call(&root(), Fstat { fd: c.fd }).expect("fstat") else {
        panic!()
    };
    assert_eq!(s.iatt.size, 12);
    h.call(
        &root(),
        Flush {
            fd: c.fd,
            lock_owner: 1,
        },
    )
    .expect("flush");
    h.call(&root(), Release { fd: c.fd }).expect("release");
    assert_eq!(
        h.call(&root(), Release { fd: c.fd }).err(),
        Some(ErrorCode::BadFd),
        "a released fd is stale"
    );
    assert_eq!(h.read_all(gfid).expect("read"), b"hello, brick");
    let found = h.lookup(Gfid::ROOT, "a.txt").expect("lookup");
    assert_eq!(found.gfid, gfid);
    assert_eq!(h.stat(gfid).expect("stat").size, 12);
    // On disk: GlusterFS's layout.
    let on_disk = std::fs::read(h.path().join("a.txt")).expect("file on disk");
    assert_eq!(on_disk, b"hello, brick");
    let handle = h.path().join(kiln_dataplane::Brick::handle_path(&gfid));
    assert_eq!(
        std::fs::read(handle).expect("handle is a hard link"),
        b"hello, brick"
    );
    h.assert_consistent();
}

fn put_small_files_and_retry(kind: EngineKind) {
    let h = Harness::new(kind);
    let dir = h.mkdir(Gfid::ROOT, "spool").expect("mkdir");
    let gfid = h.gfid();
    let put = |g: Gfid, data: &'static [u8]| Put {
        parent: dir,
        name: name("msg"),
        gfid: g,
        mode: mode(0o600),
        umask: mode(0),
        flags: OpenFlags::empty(),
        data: Payload::new(Bytes::from_static(data)).expect("small"),
        attr: SetAttr {
            mtime: Some(TimeSet::At(Timespec::new(1_000_000, 5).expect("valid"))),
            ..SetAttr::default()
        },
    };
    let FopReply::Put(e) = h.call(&root(), put(gfid, b"mail body")).expect("put") else {
        panic!()
    };
    assert_eq!(
        (e.iatt.size, e.iatt.mode.bits(), e.iatt.mtime.sec()),
        (9, 0o600, 1_000_000)
    );
    assert_eq!(e.post_parent.nlink, 2);
    // A retry with the same GFID succeeds; another GFID finds the name taken.
    h.call(&root(), put(gfid, b"mail body"))
        .expect("idempotent retry");
    assert_eq!(
        h.call(&root(), put(h.gfid(), b"x")).err(),
        Some(ErrorCode::Exist)
    );
    assert_eq!(h.read_all(gfid).expect("read"), b"mail body");
    // Empty files too.
    let empty = h.put(dir, "empty", b"").expect("empty put");
    assert_eq!(h.stat(empty).expect("stat").size, 0);
    // Many small files, then all listed.
    for i in 0..200 {
        h.put(dir, &format!("f{i:03}"), format!("{i}").as_bytes())
            .expect("put");
    }
    assert_eq!(h.list(dir).expect("list").len(), 202);
    h.assert_consistent();
}

/// A brick without `CAP_DAC_READ_SEARCH` cannot link an open file another identity opened
/// from its fd (a user's new file, to its handle): it names new files through `/proc/self/fd`
/// instead, and PUT and CREATE still make whole files with their handles. (The set is dropped
/// on this thread before the engine starts: its threads inherit it.)
fn new_files_are_named_without_cap_dac_read_search(kind: EngineKind) {
    use rustix::thread::{CapabilitySet, capabilities, set_capabilities};
    // From the permitted set too, or the first switch back from a user to root would restore
    // it. Capabilities are per thread, and libtest runs each test on a thread of its own,
    // which ends with it.
    let mut dropped = capabilities(None).expect("capget");
    dropped.effective.remove(CapabilitySet::DAC_READ_SEARCH);
    dropped.permitted.remove(CapabilitySet::DAC_READ_SEARCH);
    set_capabilities(None, dropped).expect("capset");
    let h = Harness::new(kind);
    assert!(!h.brick.link_by_fd);
    let dir = h.mkdir_as(&root(), Gfid::ROOT, "d", 0o777).expect("mkdir");
    let put = h.put_as(&user(1000), dir, "put", b"by PUT").expect("put");
    let created = h.gfid();
    let create = Create {
        parent: dir,
        name: name("created"),
        gfid: created,
        access: AccessMode::ReadWrite,
        flags: OpenFlags::EXCL,
        mode: mode(0o640),
        umask: mode(0),
    };
    let FopReply::Create(c) = h.call(&root(), create).expect("create") else {
        panic!("not a CREATE reply")
    };
    h.call(&root(), Release { fd: c.fd }).expect("release");
    assert_eq!(h.lookup(dir, "put").expect("lookup").gfid, put);
    assert_eq!(h.lookup(dir, "created").expect("lookup").gfid, created);
    assert_eq!(h.read_all(put).expect("read"), b"by PUT");
    // Each with its handle: the layout is whole.
    h.assert_consistent();
}

/// A PUT's attributes (owner, mode, times) are set before its file is named: the file
/// appears with all of them, or — when the caller may not set them — not at all.
fn a_put_sets_its_attributes_or_makes_nothing(kind: EngineKind) {
    let h = Harness::new(kind);
    let put = |n: &str, attr: SetAttr| Put {
        attr,
        ..small_put(Gfid::ROOT, n, h.gfid(), b"data")
    };
    let restored = SetAttr {
        uid: Some(1234),
        gid: Some(5678),
        // Set after the owner, so the owner change does not clear the set-uid bit.
        mode: Some(mode(0o4750)),
        mtime: Some(TimeSet::At(Timespec::new(1_000_000, 7).expect("valid"))),
        ..SetAttr::default()
    };
    let FopReply::Put(e) = h.call(&root(), put("restored", restored)).expect("put") else {
        panic!()
    };
    let on_disk = h.stat(e.iatt.gfid).expect("stat");
    for iatt in [e.iatt, on_disk] {
        assert_eq!(
            (
                iatt.uid,
                iatt.gid,
                iatt.mode.bits(),
                iatt.mtime.sec(),
                iatt.size
            ),
            (1234, 5678, 0o4750, 1_000_000, 4)
        );
    }
    let open = SetAttr {
        mode: Some(mode(0o777)),
        ..SetAttr::default()
    };
    h.call(
        &root(),
        Setattr {
            gfid: Gfid::ROOT,
            attr: open,
        },
    )
    .expect("chmod root");
    let give_away = SetAttr {
        uid: Some(0),
        ..SetAttr::default()
    };
    assert_eq!(
        h.call(&user(1000), put("given", give_away)).err(),
        Some(ErrorCode::Perm)
    );
    assert_eq!(h.lookup(Gfid::ROOT, "given").err(), Some(ErrorCode::NoEnt));
    h.assert_consistent();
}

fn mkdir_readdir_readdirp(kind: EngineKind) {
    let h = Harness::new(kind);
    let a = h.mkdir(Gfid::ROOT, "a").expect("mkdir a");
    let b = h.mkdir(a, "b").expect("mkdir b");
    h.put(b, "leaf", b"x").expect("put");
    assert_eq!(
        h.stat(b).expect("nameless stat of a directory").file_type,
        FileType::Directory
    );
    assert_eq!(
        h.list(Gfid::ROOT).expect("root"),
        vec!["a"],
        ".glusterfs is hidden"
    );
    // READDIRP returns the same GFIDs LOOKUP does, in small pages.
    for i in 0..50 {
        h.mkdir(a, &format!("d{i:02}")).expect("mkdir");
    }
    let listed = h.list_plus(a).expect("readdirp");
    for (name, gfid) in &listed {
        assert_eq!(h.lookup(a, name).expect("lookup").gfid, *gfid, "{name}");
    }
    assert_eq!(listed.len(), 51);
    // A released fd is gone.
    let FopReply::Opendir(o) = h.call(&root(), Opendir { gfid: a }).expect("opendir") else {
        panic!()
    };
    h.call(&root(), Releasedir { fd: o.fd })
        .expect("releasedir");
    h.call(
        &root(),
        Fsyncdir {
            fd: o.fd,
            datasync: false,
        },
    )
    .expect_err("released");
    let lookup = h
        .call(
            &root(),
            Lookup {
                parent: a,
                name: name("b"),
            },
        )
        .expect("lookup");
    let FopReply::Lookup(l) = lookup else {
        panic!()
    };
    assert_eq!(l.parent.gfid, a);
    h.assert_consistent();
}

fn errno_cases(kind: EngineKind) {
    let h = Harness::new(kind);
    let d = h.mkdir(Gfid::ROOT, "d").expect("mkdir");
    let f = h.put(Gfid::ROOT, "f", b"data").expect("put");
    let err = |r: Result<FopReply, ErrorCode>| r.err();
    assert_eq!(
        h.lookup(Gfid::ROOT, "missing").err(),
        Some(ErrorCode::NoEnt)
    );
    assert_eq!(h.mkdir(Gfid::ROOT, "d").err(), Some(ErrorCode::Exist));
    assert_eq!(h.put(Gfid::ROOT, "d", b"").err(), Some(ErrorCode::Exist));
    h.put(d, "inner", b"").expect("put");
    assert_eq!(h.rmdir(Gfid::ROOT, "d").err(), Some(ErrorCode::NotEmpty));
    assert_eq!(h.unlink(Gfid::ROOT, "d").err(), Some(ErrorCode::IsDir));
    assert_eq!(h.rmdir(Gfid::ROOT, "f").err(), Some(ErrorCode::NotDir));
    assert_eq!(
        h.lookup(f, "x").err(),
        Some(ErrorCode::NotDir),
        "a file as parent"
    );
    assert_eq!(h.mkdir(f, "x").err(), Some(ErrorCode::NotDir));
    assert_eq!(
        h.rename(Gfid::ROOT, "d", d, "inside", RenameMode::Replace)
            .err(),
        Some(ErrorCode::Inval)
    );
    assert_eq!(
        err(h.call(
            &root(),
            Link {
                gfid: d,
                new_parent: Gfid::ROOT,
                new_name: name("dl")
            }
        )),
        Some(ErrorCode::Perm)
    );
    assert_eq!(
        h.open(d, AccessMode::WriteOnly).err(),
        Some(ErrorCode::IsDir)
    );
    assert_eq!(
        err(h.call(&root(), Readlink { gfid: f })),
        Some(ErrorCode::Inval)
    );
    let unknown = h.gfid();
    assert_eq!(h.stat(unknown).err(), Some(ErrorCode::Stale));
    assert_eq!(h.lookup(unknown, "x").err(), Some(ErrorCode::Stale));
    assert_eq!(
        h.lookup(Gfid::ROOT, ".glusterfs").err(),
        Some(ErrorCode::Perm)
    );
    assert_eq!(
        h.mkdir(Gfid::ROOT, ".glusterfs").err(),
        Some(ErrorCode::Perm)
    );
    let forged = FdId {
        slot: 77,
        generation: 3,
    };
    assert_eq!(
        err(h.call(
            &root(),
            Read {
                fd: forged,
                offset: 0,
                size: ReadSize::new(1).expect("ok")
            }
        )),
        Some(ErrorCode::BadFd)
    );
    // Writing through a read-only fd.
    let ro = h.open(f, AccessMode::ReadOnly).expect("open");
    let data = Payload::new(Bytes::from_static(b"x")).expect("small");
    assert_eq!(
        err(h.call(
            &root(),
            Write {
                fd: ro,
                offset: 0,
                data
            }
        )),
        Some(ErrorCode::BadFd)
    );
    // Another session cannot use this session's fd.
    let other = h.engine.session();
    assert_eq!(
        err(h.call_as(&other, &root(), Fstat { fd: ro })),
        Some(ErrorCode::BadFd)
    );
    h.assert_consistent();
}

fn rename_cases(kind: EngineKind) {
    let h = Harness::new(kind);
    let a = h.mkdir(Gfid::ROOT, "a").expect("mkdir");
    let b = h.mkdir(Gfid::ROOT, "b").expect("mkdir");
    let f = h.put(a, "f", b"one").expect("put");
    let g = h.put(b, "g", b"two").expect("put");
    // Within a directory, then across.
    h.rename(a, "f", a, "f2", RenameMode::Replace)
        .expect("rename");
    h.rename(a, "f2", b, "f3", RenameMode::Replace)
        .expect("rename across");
    assert_eq!(h.lookup(b, "f3").expect("moved").gfid, f);
    // Replacing a file drops the victim's handle (check finds nothing stale).
    h.rename(b, "f3", b, "g", RenameMode::Replace)
        .expect("replace");
    assert_eq!(h.lookup(b, "g").expect("replaced").gfid, f);
    assert_eq!(
        h.stat(g).err(),
        Some(ErrorCode::Stale),
        "the victim is gone"
    );
    h.assert_consistent();
    // NOREPLACE and EXCHANGE.
    h.put(a, "x", b"x").expect("put");
    assert_eq!(
        h.rename(a, "x", b, "g", RenameMode::NoReplace).err(),
        Some(ErrorCode::Exist)
    );
    h.rename(a, "x", b, "g", RenameMode::Exchange)
        .expect("exchange");
    assert_eq!(
        h.read_all(h.lookup(a, "x").expect("swapped").gfid)
            .expect("read"),
        b"one"
    );
    // A directory moves with its subtree; its handle follows, so nameless access still works.
    let sub = h.mkdir(a, "sub").expect("mkdir");
    let deep = h.mkdir(sub, "deep").expect("mkdir");
    h.put(deep, "leaf", b"leaf").expect("put");
    h.rename(a, "sub", b, "moved", RenameMode::Replace)
        .expect("dir rename");
    let fresh = Harness::reopen(
        tempfile::tempdir().expect("tmp"),
        &h.path(),
        kind,
        FopsConfig::default(),
    );
    assert_eq!(
        fresh
            .stat(deep)
            .expect("cold resolve through the new handle")
            .file_type,
        FileType::Directory
    );
    assert_eq!(fresh.lookup(deep, "leaf").expect("leaf").size, 4);
    // Replacing an empty directory with a directory.
    h.mkdir(Gfid::ROOT, "empty").expect("mkdir");
    h.rename(b, "moved", Gfid::ROOT, "empty", RenameMode::Replace)
        .expect("replace empty dir");
    assert_eq!(h.lookup(Gfid::ROOT, "empty").expect("moved over").gfid, sub);
    // Exchanging two directories updates both handles.
    let c = h.mkdir(Gfid::ROOT, "c").expect("mkdir");
    h.rename(Gfid::ROOT, "c", Gfid::ROOT, "empty", RenameMode::Exchange)
        .expect("exchange dirs");
    drop(fresh);
    let fresh = Harness::reopen(
        tempfile::tempdir().expect("tmp"),
        &h.path(),
        kind,
        FopsConfig::default(),
    );
    assert_eq!(fresh.stat(c).expect("c").file_type, FileType::Directory);
    assert_eq!(fresh.lookup(deep, "leaf").expect("still reachable").size, 4);
    h.assert_consistent();
}

fn modes_are_masked_by_the_callers_umask_only(kind: EngineKind) {
    // The brick process's own umask (022 in most shells) must not mask again.
    let h = Harness::new(kind);
    let open = h
        .mkdir_as(&root(), Gfid::ROOT, "open", 0o777)
        .expect("mkdir");
    assert_eq!(h.stat(open).expect("stat").mode.bits(), 0o777);
    let gfid = h.gfid();
    h.call(
        &root(),
        Mkdir {
            parent: Gfid::ROOT,
            name: name("masked"),
            gfid,
            mode: mode(0o777),
            umask: mode(0o027),
        },
    )
    .expect("mkdir");
    assert_eq!(h.stat(gfid).expect("stat").mode.bits(), 0o750);
}

fn permissions_are_the_kernels(kind: EngineKind) {
    let h = Harness::new(kind);
    let alice = user(1000);
    let bob = user(2000);
    let shared = h.mkdir(Gfid::ROOT, "shared").expect("mkdir");
    assert_eq!(
        h.put_as(&alice, shared, "x", b"").err(),
        Some(ErrorCode::Access),
        "0755 root dir"
    );
    let home = h.mkdir(Gfid::ROOT, "alice").expect("mkdir");
    let chown = SetAttr {
        uid: Some(1000),
        gid: Some(1000),
        ..SetAttr::default()
    };
    h.call(
        &root(),
        Setattr {
            gfid: home,
            attr: chown,
        },
    )
    .expect("chown by root");
    let f = h
        .put_as(&alice, home, "notes", b"secret")
        .expect("alice writes her home");
    let attr = h.stat(f).expect("stat");
    assert_eq!(
        (attr.uid, attr.gid),
        (1000, 1000),
        "new files belong to the caller"
    );
    let private = SetAttr {
        mode: Some(mode(0o600)),
        ..SetAttr::default()
    };
    h.call(
        &alice,
        Setattr {
            gfid: f,
            attr: private,
        },
    )
    .expect("owner chmods");
    assert_eq!(
        h.call(
            &bob,
            Setattr {
                gfid: f,
                attr: private
            }
        )
        .err(),
        Some(ErrorCode::Perm),
        "non-owner chmod"
    );
    assert_eq!(
        h.open_as(&bob, f, AccessMode::ReadOnly).err(),
        Some(ErrorCode::Access)
    );
    h.open_as(&alice, f, AccessMode::ReadWrite)
        .expect("owner opens");
    assert_eq!(
        h.call(
            &bob,
            Unlink {
                parent: home,
                name: name("notes")
            }
        )
        .err(),
        Some(ErrorCode::Access)
    );
    let give = SetAttr {
        uid: Some(2000),
        ..SetAttr::default()
    };
    assert_eq!(
        h.call(
            &alice,
            Setattr {
                gfid: f,
                attr: give
            }
        )
        .err(),
        Some(ErrorCode::Perm),
        "only root gives files away"
    );
    // A sticky, world-writable directory: bob cannot remove alice's file.
    let tmp = h.mkdir(Gfid::ROOT, "tmp").expect("mkdir");
    let sticky = SetAttr {
        mode: Some(mode(0o1777)),
        ..SetAttr::default()
    };
    h.call(
        &root(),
        Setattr {
            gfid: tmp,
            attr: sticky,
        },
    )
    .expect("chmod");
    h.put_as(&alice, tmp, "a", b"").expect("alice in /tmp");
    assert_eq!(
        h.call(
            &bob,
            Unlink {
                parent: tmp,
                name: name("a")
            }
        )
        .err(),
        Some(ErrorCode::Perm)
    );
    h.call(
        &alice,
        Unlink {
            parent: tmp,
            name: name("a"),
        },
    )
    .expect("owner removes");
    // Search permission is needed to look names up.
    let locked = h.mkdir_as(&alice, home, "locked", 0o700).expect("mkdir");
    h.put_as(&alice, locked, "in", b"").expect("put");
    assert_eq!(
        h.call(
            &bob,
            Lookup {
                parent: locked,
                name: name("in")
            }
        )
        .err(),
        Some(ErrorCode::Access)
    );
    // Root's trusted xattrs are out of a user's reach.
    let value = XattrValue::new(&b"v"[..]).expect("small");
    let set = Setxattr {
        gfid: f,
        name: XattrName::new(&b"trusted.x"[..]).expect("valid"),
        value,
        mode: XattrSetMode::Upsert,
    };
    assert_eq!(h.call(&alice, set).err(), Some(ErrorCode::Perm));
    h.assert_consistent();
}

fn symlinks_never_escape(kind: EngineKind) {
    let h = Harness::new(kind);
    for (n, target) in [
        ("up", "../../../../../../etc"),
        ("abs", "/etc/passwd"),
        ("dots", ".."),
    ] {
        let gfid = h.gfid();
        let symlink = Symlink {
            parent: Gfid::ROOT,
            name: name(n),
            gfid,
            target: SymlinkTarget::new(target.to_owned()).expect("valid"),
        };
        let FopReply::Symlink(e) = h.call(&root(), symlink).expect("symlink") else {
            panic!()
        };
        assert_eq!(e.iatt.file_type, FileType::Symlink);
        let FopReply::Readlink(r) = h.call(&root(), Readlink { gfid }).expect("readlink") else {
            panic!()
        };
        assert_eq!(r.target.as_bytes(), target.as_bytes());
        assert_eq!(
            h.lookup(Gfid::ROOT, n).expect("lookup").file_type,
            FileType::Symlink,
            "never followed"
        );
        assert_eq!(
            h.open(gfid, AccessMode::ReadOnly).err(),
            Some(ErrorCode::Loop)
        );
        assert_eq!(
            h.lookup(gfid, "passwd").err(),
            Some(ErrorCode::NotDir),
            "not a directory to look in"
        );
        let chmod = SetAttr {
            mode: Some(mode(0o777)),
            ..SetAttr::default()
        };
        assert_eq!(
            h.call(&root(), Setattr { gfid, attr: chmod }).err(),
            Some(ErrorCode::NotSupported)
        );
    }
    // Handles of files and directories cannot be reached as names.
    assert_eq!(
        h.lookup(Gfid::ROOT, ".glusterfs").err(),
        Some(ErrorCode::Perm)
    );
    h.assert_consistent();
}

fn xattrs(kind: EngineKind) {
    let h = Harness::new(kind);
    let f = h.put(Gfid::ROOT, "f", b"").expect("put");
    let d = h.mkdir(Gfid::ROOT, "d").expect("mkdir");
    for gfid in [f, d] {
        let xname = XattrName::new(&b"user.color"[..]).expect("valid");
        let value = |v: &'static [u8]| XattrValue::new(v).expect("small");
        let set = |v, mode| Setxattr {
            gfid,
            name: xname.clone(),
            value: value(v),
            mode,
        };
        h.call(&root(), set(b"blue", XattrSetMode::Create))
            .expect("create");
        assert_eq!(
            h.call(&root(), set(b"red", XattrSetMode::Create)).err(),
            Some(ErrorCode::Exist)
        );
        h.call(&root(), set(b"red", XattrSetMode::Replace))
            .expect("replace");
        let FopReply::Getxattr(g) = h
            .call(
                &root(),
                Getxattr {
                    gfid,
                    name: xname.clone(),
                },
            )
            .expect("get")
        else {
            panic!()
        };
        assert_eq!(g.value.as_bytes(), b"red");
        let listed = |creds: &Creds| {
            let FopReply::Listxattr(l) = h.call(creds, Listxattr { gfid }).expect("list") else {
                panic!()
            };
            let mut names: Vec<_> = l.entries.iter().map(|n| n.as_bytes().to_vec()).collect();
            names.sort();
            names
        };
        assert_eq!(
            listed(&root()),
            vec![b"user.color".to_vec()],
            "internal xattrs are hidden"
        );
        // `trusted.*` shows to root alone, as the kernel lists it.
        let trusted = XattrName::new(&b"trusted.note"[..]).expect("valid");
        let note = Setxattr {
            gfid,
            name: trusted.clone(),
            value: value(b"n"),
            mode: XattrSetMode::Create,
        };
        h.call(&root(), note).expect("root sets trusted.*");
        assert_eq!(
            listed(&root()),
            vec![b"trusted.note".to_vec(), b"user.color".to_vec()]
        );
        assert_eq!(listed(&user(1000)), vec![b"user.color".to_vec()]);
        let unnote = Removexattr {
            gfid,
            name: trusted,
        };
        h.call(&root(), unnote).expect("root removes trusted.*");
        // A user's calls are checked as the user's: no write permission, no change.
        assert_eq!(
            h.call(&user(1000), set(b"green", XattrSetMode::Upsert))
                .err(),
            Some(ErrorCode::Access)
        );
        let unset_as_user = Removexattr {
            gfid,
            name: xname.clone(),
        };
        assert_eq!(
            h.call(&user(1000), unset_as_user).err(),
            Some(ErrorCode::Access)
        );
        h.call(
            &root(),
            Removexattr {
                gfid,
                name: xname.clone(),
            },
        )
        .expect("remove");
        assert_eq!(
            h.call(
                &root(),
                Getxattr {
                    gfid,
                    name: xname.clone()
                }
            )
            .err(),
            Some(ErrorCode::NoData)
        );
        assert_eq!(
            h.call(&root(), set(b"x", XattrSetMode::Replace)).err(),
            Some(ErrorCode::NoData)
        );
        let gfid_name = XattrName::new(&b"trusted.gfid"[..]).expect("valid");
        let forge = Setxattr {
            gfid,
            name: gfid_name.clone(),
            value: value(b"0123456789abcdef"),
            mode: XattrSetMode::Upsert,
        };
        assert_eq!(
            h.call(&root(), forge).err(),
            Some(ErrorCode::Perm),
            "the gfid is the brick's"
        );
        assert_eq!(
            h.call(
                &root(),
                Removexattr {
                    gfid,
                    name: gfid_name.clone()
                }
            )
            .err(),
            Some(ErrorCode::Perm)
        );
        let FopReply::Getxattr(own) = h
            .call(
                &root(),
                Getxattr {
                    gfid,
                    name: gfid_name,
                },
            )
            .expect("readable")
        else {
            panic!()
        };
        assert_eq!(own.value.as_bytes(), gfid.as_bytes());
    }
    // By fd.
    let fd = h.open(f, AccessMode::ReadWrite).expect("open");
    let xname = XattrName::new(&b"user.fd"[..]).expect("valid");
    h.call(
        &root(),
        Fsetxattr {
            fd,
            name: xname.clone(),
            value: XattrValue::new(&b"1"[..]).expect("ok"),
            mode: XattrSetMode::Upsert,
        },
    )
    .expect("fset");
    let FopReply::Fgetxattr(v) = h
        .call(
            &root(),
            Fgetxattr {
                fd,
                name: xname.clone(),
            },
        )
        .expect("fget")
    else {
        panic!()
    };
    assert_eq!(v.value.as_bytes(), b"1");
    h.call(&root(), Fremovexattr { fd, name: xname })
        .expect("fremove");
    h.assert_consistent();
}

fn setattr_fields(kind: EngineKind) {
    let h = Harness::new(kind);
    let f = h.put(Gfid::ROOT, "f", b"0123456789").expect("put");
    let t = Timespec::new(1_234_567_890, 123_456_789).expect("valid");
    let attr = SetAttr {
        mode: Some(mode(0o4751)),
        uid: Some(42),
        gid: Some(43),
        size: Some(4),
        atime: Some(TimeSet::At(t)),
        mtime: Some(TimeSet::At(t)),
    };
    let FopReply::Setattr(c) = h.call(&root(), Setattr { gfid: f, attr }).expect("setattr") else {
        panic!()
    };
    assert_eq!(c.pre.size, 10);
    let p = c.post;
    assert_eq!(
        (p.mode.bits(), p.uid, p.gid, p.size, p.atime, p.mtime),
        (0o4751, 42, 43, 4, t, t)
    );
    // UTIME_OMIT keeps atime; UTIME_NOW moves mtime.
    let now = SetAttr {
        mtime: Some(TimeSet::Now),
        ..SetAttr::default()
    };
    let FopReply::Setattr(c) = h
        .call(&root(), Setattr { gfid: f, attr: now })
        .expect("setattr")
    else {
        panic!()
    };
    assert_eq!(c.post.atime, t);
    assert!(c.post.mtime > t);
    let FopReply::Truncate(c) = h
        .call(&root(), Truncate { gfid: f, size: 100 })
        .expect("truncate")
    else {
        panic!()
    };
    assert_eq!(c.post.size, 100);
    let fd = h.open(f, AccessMode::WriteOnly).expect("open");
    let FopReply::Ftruncate(c) = h
        .call(&root(), Ftruncate { fd, size: 1 })
        .expect("ftruncate")
    else {
        panic!()
    };
    assert_eq!(c.post.size, 1);
    let ro = h.open(f, AccessMode::ReadOnly).expect("open");
    assert_eq!(
        h.call(&root(), Ftruncate { fd: ro, size: 0 }).err(),
        Some(ErrorCode::Inval)
    );
    let d = h.mkdir(Gfid::ROOT, "d").expect("mkdir");
    let size = SetAttr {
        size: Some(0),
        ..SetAttr::default()
    };
    assert_eq!(
        h.call(
            &root(),
            Setattr {
                gfid: d,
                attr: size
            }
        )
        .err(),
        Some(ErrorCode::IsDir)
    );
    let dmode = SetAttr {
        mode: Some(mode(0o700)),
        ..SetAttr::default()
    };
    let FopReply::Setattr(c) = h
        .call(
            &root(),
            Setattr {
                gfid: d,
                attr: dmode,
            },
        )
        .expect("chmod dir")
    else {
        panic!()
    };
    assert_eq!(c.post.mode.bits(), 0o700);
    h.assert_consistent();
}

fn hard_links(kind: EngineKind) {
    let h = Harness::new(kind);
    let f = h.put(Gfid::ROOT, "f", b"linked").expect("put");
    let d = h.mkdir(Gfid::ROOT, "d").expect("mkdir");
    let FopReply::Link(l) = h
        .call(
            &root(),
            Link {
                gfid: f,
                new_parent: d,
                new_name: name("g"),
            },
        )
        .expect("link")
    else {
        panic!()
    };
    assert_eq!((l.iatt.gfid, l.iatt.nlink), (f, 2));
    assert_eq!(h.lookup(d, "g").expect("lookup").gfid, f);
    h.unlink(Gfid::ROOT, "f").expect("unlink one name");
    assert_eq!(h.stat(f).expect("still there by gfid").nlink, 1);
    assert_eq!(h.read_all(f).expect("read"), b"linked");
    h.assert_consistent();
    // Unlinking the last name while open: the fd still reads.
    let fd = h.open(f, AccessMode::ReadOnly).expect("open");
    h.unlink(d, "g").expect("unlink last name");
    let FopReply::Read(r) = h
        .call(
            &root(),
            Read {
                fd,
                offset: 0,
                size: ReadSize::new(100).expect("ok"),
            },
        )
        .expect("read")
    else {
        panic!()
    };
    assert_eq!(r.data.as_bytes(), b"linked");
    assert_eq!(h.stat(f).err(), Some(ErrorCode::Stale));
    h.assert_consistent();
}

/// `rename(2)` between two names of one file (and of a name onto itself) does nothing and
/// succeeds, in every mode but NOREPLACE: both names stay, and so does the file's handle.
fn renames_between_names_of_one_file_change_nothing(kind: EngineKind) {
    let h = Harness::new(kind);
    let f = h.put(Gfid::ROOT, "f", b"one file").expect("put");
    let d = h.mkdir(Gfid::ROOT, "d").expect("mkdir");
    let link = Link {
        gfid: f,
        new_parent: d,
        new_name: name("g"),
    };
    h.call(&root(), link).expect("link");
    for mode in [RenameMode::Replace, RenameMode::Exchange] {
        h.rename(Gfid::ROOT, "f", d, "g", mode)
            .unwrap_or_else(|e| panic!("{mode:?} onto another name: {e}"));
        h.rename(Gfid::ROOT, "f", Gfid::ROOT, "f", mode)
            .unwrap_or_else(|e| panic!("{mode:?} onto itself: {e}"));
        for (parent, n) in [(Gfid::ROOT, "f"), (d, "g")] {
            assert_eq!(h.lookup(parent, n).expect(n).gfid, f, "{mode:?}");
        }
        assert_eq!(h.stat(f).expect("by its GFID").nlink, 2, "{mode:?}");
        h.assert_consistent();
    }
    assert_eq!(
        h.rename(Gfid::ROOT, "f", d, "g", RenameMode::NoReplace)
            .err(),
        Some(ErrorCode::Exist)
    );
    let sub = h.mkdir(Gfid::ROOT, "sub").expect("mkdir");
    h.rename(Gfid::ROOT, "sub", Gfid::ROOT, "sub", RenameMode::Replace)
        .expect("a directory onto itself");
    assert_eq!(h.stat(sub).expect("by its GFID").gfid, sub);
    assert_eq!(h.read_all(f).expect("read"), b"one file");
    h.assert_consistent();
}

fn fallocate_and_seek(kind: EngineKind) {
    let h = Harness::new(kind);
    let f = h.put(Gfid::ROOT, "f", b"").expect("put");
    let fd = h.open(f, AccessMode::ReadWrite).expect("open");
    let FopReply::Fallocate(c) = h
        .call(
            &root(),
            Fallocate {
                fd,
                keep_size: false,
                offset: 0,
                len: 1 << 20,
            },
        )
        .expect("fallocate")
    else {
        panic!()
    };
    assert_eq!(c.post.size, 1 << 20);
    let data = Payload::new(Bytes::from(vec![7u8; 4096])).expect("small");
    h.call(
        &root(),
        Write {
            fd,
            offset: 0,
            data,
        },
    )
    .expect("write");
    h.call(
        &root(),
        Discard {
            fd,
            offset: 65536,
            len: 65536,
        },
    )
    .expect("punch hole");
    let FopReply::Seek(s) = h
        .call(
            &root(),
            Seek {
                fd,
                offset: 0,
                what: SeekWhat::Data,
            },
        )
        .expect("seek data")
    else {
        panic!()
    };
    assert_eq!(s.offset, 0);
    let FopReply::Zerofill(z) = h
        .call(
            &root(),
            Zerofill {
                fd,
                offset: 0,
                len: 10,
            },
        )
        .expect("zerofill")
    else {
        panic!()
    };
    assert_eq!(z.post.size, 1 << 20);
    let FopReply::Read(r) = h
        .call(
            &root(),
            Read {
                fd,
                offset: 0,
                size: ReadSize::new(16).expect("ok"),
            },
        )
        .expect("read")
    else {
        panic!()
    };
    assert_eq!(
        &r.data.as_bytes()[..12],
        &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7, 7]
    );
    let end = h.call(
        &root(),
        Seek {
            fd,
            offset: 2 << 20,
            what: SeekWhat::Data,
        },
    );
    assert_eq!(end.err(), Some(ErrorCode::NxIo));
}

fn locks_between_sessions(kind: EngineKind) {
    let h = Harness::new(kind);
    let f = h.put(Gfid::ROOT, "f", b"").expect("put");
    let other = h.engine.session();
    let fd1 = h.open(f, AccessMode::ReadWrite).expect("open");
    let FopReply::Open(o) = h
        .call_as(
            &other,
            &root(),
            Open {
                gfid: f,
                access: AccessMode::ReadWrite,
                flags: OpenFlags::empty(),
            },
        )
        .expect("open")
    else {
        panic!()
    };
    let write = |start, len, owner| Lock {
        kind: LockKind::Write,
        start,
        len,
        pid: 1,
        owner,
    };
    h.call(
        &root(),
        Lk {
            fd: fd1,
            cmd: LockCmd::Set,
            lock: write(0, 10, 1),
        },
    )
    .expect("lock");
    assert_eq!(
        h.call_as(
            &other,
            &root(),
            Lk {
                fd: o.fd,
                cmd: LockCmd::Set,
                lock: write(5, 1, 2)
            }
        )
        .err(),
        Some(ErrorCode::Again)
    );
    let FopReply::Lk(t) = h
        .call_as(
            &other,
            &root(),
            Lk {
                fd: o.fd,
                cmd: LockCmd::Get,
                lock: write(5, 1, 2),
            },
        )
        .expect("getlk")
    else {
        panic!()
    };
    assert_eq!(
        (t.lock.kind, t.lock.start, t.lock.len),
        (LockKind::Write, 0, 10)
    );
    h.call_as(
        &other,
        &root(),
        Lk {
            fd: o.fd,
            cmd: LockCmd::Set,
            lock: write(20, 5, 2),
        },
    )
    .expect("no overlap");
    // FLUSH by one owner drops that owner's locks only; another owner of the same session
    // (another process behind the same mount) keeps its own.
    h.call(
        &root(),
        Lk {
            fd: fd1,
            cmd: LockCmd::Set,
            lock: write(30, 5, 3),
        },
    )
    .expect("second owner");
    h.call(
        &root(),
        Flush {
            fd: fd1,
            lock_owner: 3,
        },
    )
    .expect("flush by owner 3");
    h.call_as(
        &other,
        &root(),
        Lk {
            fd: o.fd,
            cmd: LockCmd::Set,
            lock: write(30, 5, 2),
        },
    )
    .expect("owner 3's range is free");
    assert_eq!(
        h.call_as(
            &other,
            &root(),
            Lk {
                fd: o.fd,
                cmd: LockCmd::Set,
                lock: write(5, 1, 2)
            }
        )
        .err(),
        Some(ErrorCode::Again),
        "owner 1 still holds 0..10"
    );
    // Releasing the holder's last fd on the file drops its locks.
    h.call(&root(), Release { fd: fd1 }).expect("release");
    h.call_as(
        &other,
        &root(),
        Lk {
            fd: o.fd,
            cmd: LockCmd::Set,
            lock: write(0, 10, 2),
        },
    )
    .expect("free now");
}

fn deep_tree_resolves_by_handle(kind: EngineKind) {
    let h = Harness::new(kind);
    let mut parent = Gfid::ROOT;
    let mut chain = Vec::new();
    for i in 0..60 {
        parent = h.mkdir(parent, &format!("level{i}")).expect("mkdir");
        chain.push(parent);
    }
    h.put(parent, "bottom", b"deep").expect("put");
    // A fresh engine has a cold directory cache: the deepest GFID resolves through 60 nested
    // handle symlinks, past the kernel's limit of 40.
    let fresh = Harness::reopen(
        tempfile::tempdir().expect("tmp"),
        &h.path(),
        kind,
        FopsConfig::default(),
    );
    assert_eq!(fresh.lookup(parent, "bottom").expect("deep lookup").size, 4);
    assert_eq!(
        fresh.stat(chain[30]).expect("middle").file_type,
        FileType::Directory
    );
    h.assert_consistent();
}

fn open_file_limit_and_session_end(kind: EngineKind) {
    let fops = FopsConfig {
        open_files_per_client_max: 4,
        ..FopsConfig::default()
    };
    let h = Harness::with(kind, fops);
    let f = h.put(Gfid::ROOT, "f", b"").expect("put");
    let s = h.engine.session();
    let open = || {
        h.call_as(
            &s,
            &root(),
            Open {
                gfid: f,
                access: AccessMode::ReadOnly,
                flags: OpenFlags::empty(),
            },
        )
    };
    for _ in 0..4 {
        open().expect("under the limit");
    }
    assert_eq!(open().err(), Some(ErrorCode::MFile));
    // Other sessions have their own limit.
    h.open(f, AccessMode::ReadOnly).expect("another session");
    drop(s);
    // The dropped session's files are released; the brick stays usable.
    h.open(f, AccessMode::ReadOnly).expect("still fine");
}

fn names_at_255_bytes(kind: EngineKind) {
    let h = Harness::new(kind);
    let long = "n".repeat(255);
    let d = h.mkdir(Gfid::ROOT, &long).expect("255-byte dir name");
    let f = h.put(d, &long, b"x").expect("255-byte file name");
    assert_eq!(h.lookup(d, &long).expect("lookup").gfid, f);
    let odd = Name::new(&b"\xff\xfe bytes, not utf-8"[..]).expect("valid");
    h.call(
        &root(),
        Mkdir {
            parent: d,
            name: odd.clone(),
            gfid: h.gfid(),
            mode: mode(0o755),
            umask: mode(0),
        },
    )
    .expect("mkdir");
    h.call(
        &root(),
        Lookup {
            parent: d,
            name: odd,
        },
    )
    .expect("lookup");
    h.assert_consistent();
}

fn statfs_and_access(kind: EngineKind) {
    let h = Harness::new(kind);
    let FopReply::Statfs(s) = h
        .call(&root(), Statfs { gfid: Gfid::ROOT })
        .expect("statfs")
    else {
        panic!()
    };
    assert!(s.stats.blocks > 0 && s.stats.namemax == 255);
    let f = h.put(Gfid::ROOT, "f", b"").expect("put");
    let private = SetAttr {
        mode: Some(mode(0o600)),
        ..SetAttr::default()
    };
    h.call(
        &root(),
        Setattr {
            gfid: f,
            attr: private,
        },
    )
    .expect("chmod");
    h.call(
        &user(1000),
        Access {
            gfid: f,
            mask: AccessMask::empty(),
        },
    )
    .expect("exists");
    assert_eq!(
        h.call(
            &user(1000),
            Access {
                gfid: f,
                mask: AccessMask::READ
            }
        )
        .err(),
        Some(ErrorCode::Access)
    );
    h.call(
        &root(),
        Access {
            gfid: f,
            mask: AccessMask::READ | AccessMask::WRITE,
        },
    )
    .expect("root");
    // Directories too, the root included (a FUSE chdir asks ACCESS X_OK of each).
    let d = h.mkdir(Gfid::ROOT, "private-dir").expect("mkdir");
    let private_dir = SetAttr {
        mode: Some(mode(0o700)),
        ..SetAttr::default()
    };
    h.call(
        &root(),
        Setattr {
            gfid: d,
            attr: private_dir,
        },
    )
    .expect("chmod dir");
    for (who, gfid, ok) in [
        (root(), Gfid::ROOT, true),
        (user(1000), Gfid::ROOT, true),
        (root(), d, true),
        (user(1000), d, false),
    ] {
        let result = h.call(
            &who,
            Access {
                gfid,
                mask: AccessMask::EXECUTE,
            },
        );
        assert_eq!(result.is_ok(), ok, "{who:?} X_OK on {gfid}: {result:?}");
    }
    let node = Mknod {
        parent: Gfid::ROOT,
        name: name("fifo"),
        gfid: h.gfid(),
        node_type: NodeType::Fifo,
        mode: mode(0o644),
        umask: mode(0),
        rdev: 0,
    };
    let FopReply::Mknod(m) = h.call(&root(), node).expect("mknod") else {
        panic!()
    };
    assert_eq!(m.iatt.file_type, FileType::Fifo);
    // Special files are opened by the client's kernel, never on the brick.
    assert_eq!(
        h.open(m.iatt.gfid, AccessMode::ReadOnly).err(),
        Some(ErrorCode::NxIo)
    );
    h.assert_consistent();
}

/// Writes a brick the way GlusterFS 10's posix translator does: root gfid and volume id,
/// `.glusterfs` with only the handle directories in use (mode 0700), a directory handle
/// symlink and a file handle hard link — plus a file copied in behind the brick's back.
fn glusterfs_brick(path: &std::path::Path) -> (Gfid, Gfid) {
    use rustix::fs::XattrFlags;
    let set = |p: &std::path::Path, name: &str, value: &[u8]| {
        rustix::fs::lsetxattr(p, name, value, XattrFlags::empty()).expect("setxattr");
    };
    let docs: Gfid = "6a1c3e2f-9b7d-4e0a-8c1f-2d3e4f5a6b7c"
        .parse()
        .expect("gfid");
    let readme: Gfid = "b2c4d6e8-1a3b-4c5d-9e7f-0a1b2c3d4e5f"
        .parse()
        .expect("gfid");
    std::fs::create_dir_all(path.join("docs")).expect("mkdir");
    set(path, "trusted.gfid", Gfid::ROOT.as_bytes());
    set(path, "trusted.glusterfs.volume-id", &[7; 16]);
    std::fs::write(path.join("docs/readme"), b"written by glusterfs").expect("write");
    std::fs::write(path.join("plain"), b"copied in").expect("write");
    set(&path.join("docs"), "trusted.gfid", docs.as_bytes());
    set(&path.join("docs/readme"), "trusted.gfid", readme.as_bytes());
    let handle = |g: &Gfid| path.join(kiln_dataplane::Brick::handle_path(g));
    for g in [Gfid::ROOT, docs, readme] {
        let dir = handle(&g);
        let dir = dir.parent().expect("has parent");
        std::fs::create_dir_all(dir).expect("mkdir");
        for d in [dir, dir.parent().expect("xx")] {
            std::fs::set_permissions(d, std::os::unix::fs::PermissionsExt::from_mode(0o700))
                .expect("chmod");
        }
    }
    std::os::unix::fs::symlink("../../..", handle(&Gfid::ROOT)).expect("root handle");
    std::os::unix::fs::symlink(
        "../../00/00/00000000-0000-0000-0000-000000000001/docs",
        handle(&docs),
    )
    .expect("dir handle");
    std::fs::hard_link(path.join("docs/readme"), handle(&readme)).expect("file handle");
    (docs, readme)
}

fn serves_a_glusterfs_brick(kind: EngineKind) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("brick");
    let (docs, readme) = glusterfs_brick(&path);
    let h = Harness::reopen(dir, &path, kind, FopsConfig::default());
    assert_eq!(
        h.brick.id.0, [7; 16],
        "the GlusterFS volume id becomes the brick id"
    );
    // A listing by an engine that has cached nothing yet: every GFID read from its xattr,
    // and an object without one given one (the one its lookup finds later).
    let mut listed = h.list_plus(Gfid::ROOT).expect("readdirp");
    listed.sort();
    let healed = match listed.as_slice() {
        [(d, docs_gfid), (p, plain_gfid)] if d == "docs" && p == "plain" => {
            assert_eq!(*docs_gfid, docs);
            *plain_gfid
        }
        other => panic!("the brick's root lists {other:?}"),
    };
    assert_eq!(h.lookup(Gfid::ROOT, "docs").expect("dir").gfid, docs);
    assert_eq!(h.lookup(docs, "readme").expect("file").gfid, readme);
    assert_eq!(
        h.stat(docs).expect("nameless dir").file_type,
        FileType::Directory
    );
    assert_eq!(h.read_all(readme).expect("read"), b"written by glusterfs");
    // An object with no gfid gets one, with its handle, on first lookup.
    let plain = h.lookup(Gfid::ROOT, "plain").expect("healed");
    assert_eq!(plain.gfid, healed, "the GFID the listing gave it");
    assert_eq!(
        h.read_all(plain.gfid).expect("read by its new gfid"),
        b"copied in"
    );
    // New objects land in GlusterFS's layout too.
    h.put(docs, "new", b"by kiln").expect("put");
    h.assert_consistent();
}

fn reused_gfid_is_refused(kind: EngineKind) {
    let h = Harness::new(kind);
    let d = h.mkdir(Gfid::ROOT, "d").expect("mkdir");
    let f = h.put(Gfid::ROOT, "f", b"f").expect("put");
    // A client reusing another object's identity gets EEXIST and the other object keeps its
    // handle (nameless access still works).
    for taken in [d, f] {
        let mkdir = Mkdir {
            parent: Gfid::ROOT,
            name: name("new"),
            gfid: taken,
            mode: mode(0o755),
            umask: mode(0),
        };
        assert_eq!(h.call(&root(), mkdir).err(), Some(ErrorCode::Exist));
        let put = Put {
            parent: d,
            name: name("new"),
            gfid: taken,
            mode: mode(0o644),
            umask: mode(0),
            flags: OpenFlags::empty(),
            data: Payload::new(Bytes::from_static(b"x")).expect("small"),
            attr: SetAttr::default(),
        };
        assert_eq!(h.call(&root(), put).err(), Some(ErrorCode::Exist));
        assert_eq!(h.stat(taken).expect("still reachable").gfid, taken);
    }
    assert_eq!(h.lookup(Gfid::ROOT, "new").err(), Some(ErrorCode::NoEnt));
    h.assert_consistent();
}

fn writes_run_as_the_caller(kind: EngineKind) {
    let h = Harness::new(kind);
    let f = h.put(Gfid::ROOT, "tool", b"#!/bin/sh").expect("put");
    let setuid = SetAttr {
        mode: Some(mode(0o4777)),
        ..SetAttr::default()
    };
    h.call(
        &root(),
        Setattr {
            gfid: f,
            attr: setuid,
        },
    )
    .expect("chmod");
    let bob = user(2000);
    let fd = h
        .open_as(&bob, f, AccessMode::WriteOnly)
        .expect("world-writable");
    let data = Payload::new(Bytes::from_static(b"evil")).expect("small");
    let FopReply::Write(w) = h
        .call(
            &bob,
            Write {
                fd,
                offset: 0,
                data,
            },
        )
        .expect("write")
    else {
        panic!()
    };
    // The kernel clears set-uid on a write by someone without CAP_FSETID: it only does so
    // if the write really ran as bob.
    assert_eq!(
        w.post.mode.bits(),
        0o777,
        "set-uid must not survive an unprivileged write"
    );
}

/// `storage.fsync-policy write-through`: WRITE and PUT carry an fdatasync in their chain
/// (the profile's step counts show it), and the data is there.
fn write_through_syncs_every_write(kind: EngineKind) {
    let steps = |write_through: bool| {
        let fops = FopsConfig {
            write_through,
            ..FopsConfig::default()
        };
        let h = Harness::with(kind, fops);
        h.engine.profile().set(true, false);
        let f = h.put(Gfid::ROOT, "log", b"first").expect("put");
        let fd = h.open_as(&root(), f, AccessMode::WriteOnly).expect("open");
        let data = Payload::new(Bytes::from_static(b"second")).expect("small");
        let write = Write {
            fd,
            offset: 5,
            data,
        };
        h.call(&root(), write).expect("write");
        assert_eq!(h.read_all(f).expect("read"), b"firstsecond");
        let report = h.engine.profile().report();
        let of = |fop: &str| report.fops.iter().find(|p| p.fop == fop).map(|p| p.steps);
        (of("PUT").expect("PUT"), of("WRITE").expect("WRITE"))
    };
    let (put, write) = steps(false);
    assert_eq!(steps(true), (put + 1, write + 1), "one fdatasync more each");
}

/// LOOKUP is read-only on disk: a fresh engine (empty caches) that meets a file's handle
/// directory for the first time does not touch it.
fn a_lookup_on_a_fresh_engine_writes_nothing(kind: EngineKind) {
    use std::os::unix::fs::MetadataExt as _;
    let h = Harness::new(kind);
    let f = h.put(Gfid::ROOT, "quiet", b"x").expect("put");
    let path = h.path();
    let b = f.as_bytes();
    let yy = path.join(format!(".glusterfs/{:02x}/{:02x}", b[0], b[1]));
    let Harness { dir, .. } = h;
    let before = std::fs::metadata(&yy).expect("handle dir");
    std::thread::sleep(std::time::Duration::from_millis(20));
    let h = Harness::reopen(dir, &path, kind, FopsConfig::default());
    assert_eq!(h.lookup(Gfid::ROOT, "quiet").expect("lookup").gfid, f);
    let after = std::fs::metadata(&yy).expect("handle dir");
    assert_eq!(
        (after.ctime(), after.ctime_nsec(), after.mode()),
        (before.ctime(), before.ctime_nsec(), before.mode()),
        "the handle directory was written by a LOOKUP"
    );
}

/// A PUT, CREATE or MKDIR that names an existing object by name and GFID is a retry only
/// when the object is of the type it makes: a PUT over a symlink must not write through it,
/// nor open a FIFO or a device.
fn a_retried_create_must_match_the_type(kind: EngineKind) {
    let h = Harness::new(kind);
    let outside = h.dir.path().join("outside.txt");
    std::fs::write(&outside, b"precious").expect("outside file");
    let symlink_gfid = h.gfid();
    let target = SymlinkTarget::new(outside.to_string_lossy().into_owned()).expect("valid");
    let symlink = Symlink {
        parent: Gfid::ROOT,
        name: name("x"),
        gfid: symlink_gfid,
        target,
    };
    h.call(&root(), symlink).expect("symlink");
    let fifo_gfid = h.gfid();
    let fifo = Mknod {
        parent: Gfid::ROOT,
        name: name("fifo"),
        gfid: fifo_gfid,
        node_type: NodeType::Fifo,
        mode: mode(0o666),
        umask: mode(0),
        rdev: 0,
    };
    h.call(&root(), fifo).expect("mknod");
    for (n, gfid) in [("x", symlink_gfid), ("fifo", fifo_gfid)] {
        let put = Put {
            parent: Gfid::ROOT,
            name: name(n),
            gfid,
            mode: mode(0o644),
            umask: mode(0),
            flags: OpenFlags::empty(),
            data: Payload::new(Bytes::from_static(b"pwned")).expect("small"),
            attr: SetAttr::default(),
        };
        assert_eq!(h.call(&root(), put).err(), Some(ErrorCode::Exist), "{n}");
        let create = Create {
            parent: Gfid::ROOT,
            name: name(n),
            gfid,
            access: AccessMode::WriteOnly,
            flags: OpenFlags::TRUNC,
            mode: mode(0o644),
            umask: mode(0),
        };
        assert!(h.call(&root(), create).is_err(), "{n}: a create over it");
        let mkdir = Mkdir {
            parent: Gfid::ROOT,
            name: name(n),
            gfid,
            mode: mode(0o755),
            umask: mode(0),
        };
        assert_eq!(h.call(&root(), mkdir).err(), Some(ErrorCode::Exist), "{n}");
    }
    assert_eq!(std::fs::read(&outside).expect("read"), b"precious");
    assert_eq!(
        h.lookup(Gfid::ROOT, "fifo").expect("lookup").file_type,
        FileType::Fifo
    );
    // A true retry still succeeds.
    let again = Symlink {
        parent: Gfid::ROOT,
        name: name("x"),
        gfid: symlink_gfid,
        target: SymlinkTarget::new(outside.to_string_lossy().into_owned()).expect("valid"),
    };
    h.call(&root(), again).expect("a retried symlink");
    h.assert_consistent();
}

/// SETATTR's size only truncates regular files; a symlink is never followed by chmod, chown
/// or utimes.
fn setattr_never_follows_or_truncates_special_files(kind: EngineKind) {
    let h = Harness::new(kind);
    let outside = h.dir.path().join("outside.txt");
    std::fs::write(&outside, b"precious").expect("outside file");
    let before = std::fs::metadata(&outside).expect("stat");
    let link = h.gfid();
    let target = SymlinkTarget::new(outside.to_string_lossy().into_owned()).expect("valid");
    let symlink = Symlink {
        parent: Gfid::ROOT,
        name: name("x"),
        gfid: link,
        target,
    };
    h.call(&root(), symlink).expect("symlink");
    let fifo = h.gfid();
    let mknod = Mknod {
        parent: Gfid::ROOT,
        name: name("fifo"),
        gfid: fifo,
        node_type: NodeType::Fifo,
        mode: mode(0o666),
        umask: mode(0),
        rdev: 0,
    };
    h.call(&root(), mknod).expect("mknod");
    let size = |size| SetAttr {
        size: Some(size),
        ..SetAttr::default()
    };
    for gfid in [link, fifo] {
        assert_eq!(
            h.call(
                &root(),
                Setattr {
                    gfid,
                    attr: size(0)
                }
            )
            .err(),
            Some(ErrorCode::Inval)
        );
    }
    let own = SetAttr {
        uid: Some(1234),
        gid: Some(1234),
        mtime: Some(TimeSet::At(Timespec::new(1_000_000, 0).expect("valid"))),
        ..SetAttr::default()
    };
    let FopReply::Setattr(changed) = h
        .call(
            &root(),
            Setattr {
                gfid: link,
                attr: own,
            },
        )
        .expect("lchown and lutimes")
    else {
        panic!()
    };
    assert_eq!(changed.post.uid, 1234, "the symlink itself changed");
    assert_eq!(changed.post.mtime.sec(), 1_000_000);
    let after = std::fs::metadata(&outside).expect("stat");
    assert_eq!(
        (after.len(), after.modified().ok(), after.uid()),
        (before.len(), before.modified().ok(), before.uid()),
        "the target outside the brick is untouched"
    );
    h.assert_consistent();
}

/// A directory's owner can list, chmod, chown, read xattrs of and check access to a
/// directory whose mode lacks the owner's search bit (0600), as on a local file system.
fn owners_reach_their_unsearchable_directories(kind: EngineKind) {
    let h = Harness::new(kind);
    let alice = user(4242);
    let dir = h.mkdir_as(&root(), Gfid::ROOT, "d", 0o777).expect("mkdir");
    let chown = SetAttr {
        uid: Some(alice.uid),
        gid: Some(alice.gid),
        ..SetAttr::default()
    };
    h.call(
        &root(),
        Setattr {
            gfid: dir,
            attr: chown,
        },
    )
    .expect("chown to alice");
    for bits in [0o600, 0o477, 0o177] {
        let chmod = SetAttr {
            mode: Some(mode(bits)),
            ..SetAttr::default()
        };
        h.call(
            &alice,
            Setattr {
                gfid: dir,
                attr: chmod,
            },
        )
        .unwrap_or_else(|e| panic!("chmod {bits:o} by the owner: {e:?}"));
    }
    let chmod = |bits| SetAttr {
        mode: Some(mode(bits)),
        ..SetAttr::default()
    };
    h.call(
        &alice,
        Setattr {
            gfid: dir,
            attr: chmod(0o600),
        },
    )
    .expect("chmod 0600");
    let FopReply::Opendir(o) = h
        .call(&alice, Opendir { gfid: dir })
        .expect("the owner opens a 0600 directory for reading")
    else {
        panic!()
    };
    h.call(&alice, Releasedir { fd: o.fd }).expect("releasedir");
    let same_owner = SetAttr {
        uid: Some(alice.uid),
        ..SetAttr::default()
    };
    h.call(
        &alice,
        Setattr {
            gfid: dir,
            attr: same_owner,
        },
    )
    .expect("chown to oneself");
    h.call(
        &alice,
        Access {
            gfid: dir,
            mask: AccessMask::READ | AccessMask::WRITE,
        },
    )
    .expect("access rw");
    assert_eq!(
        h.call(
            &alice,
            Access {
                gfid: dir,
                mask: AccessMask::EXECUTE,
            },
        )
        .err(),
        Some(ErrorCode::Access)
    );
    let xname = XattrName::new(&b"user.note"[..]).expect("valid");
    let set = Setxattr {
        gfid: dir,
        name: xname.clone(),
        value: XattrValue::new(&b"v"[..]).expect("small"),
        mode: XattrSetMode::Upsert,
    };
    h.call(&alice, set).expect("setxattr by the owner");
    h.call(
        &alice,
        Getxattr {
            gfid: dir,
            name: xname,
        },
    )
    .expect("getxattr by the owner");
    // Another user still gets nothing.
    assert_eq!(
        h.call(&user(4343), Opendir { gfid: dir }).err(),
        Some(ErrorCode::Access)
    );
    h.call(
        &root(),
        Setattr {
            gfid: dir,
            attr: chmod(0o755),
        },
    )
    .expect("chmod back");
    h.assert_consistent();
}

/// FTRUNCATE runs as the caller on the open file: the kernel clears set-uid as for the
/// caller's own call, and a file unlinked meanwhile is still reached.
fn ftruncate_runs_as_the_caller_on_the_open_file(kind: EngineKind) {
    let h = Harness::new(kind);
    let f = h.put(Gfid::ROOT, "tool", b"#!/bin/sh\n").expect("put");
    let setuid = SetAttr {
        mode: Some(mode(0o4777)),
        ..SetAttr::default()
    };
    h.call(
        &root(),
        Setattr {
            gfid: f,
            attr: setuid,
        },
    )
    .expect("chmod");
    let bob = user(2000);
    let fd = h
        .open_as(&bob, f, AccessMode::WriteOnly)
        .expect("world-writable");
    let FopReply::Ftruncate(t) = h.call(&bob, Ftruncate { fd, size: 2 }).expect("ftruncate") else {
        panic!()
    };
    assert_eq!(t.post.size, 2);
    assert_eq!(t.post.mode.bits(), 0o777, "set-uid cleared as for bob");
    h.unlink(Gfid::ROOT, "tool").expect("unlink");
    let FopReply::Ftruncate(t) = h
        .call(&bob, Ftruncate { fd, size: 0 })
        .expect("an unlinked open file is still truncated")
    else {
        panic!()
    };
    assert_eq!(t.post.size, 0);
}

/// Blocked F_SETLKWs wait without holding a thread: more waiters than the engine has
/// threads leave other fops served, each waiter gets the lock in turn, and a waiter whose
/// session ends stops at once.
fn lock_waits_hold_no_thread_and_end_with_their_session(kind: EngineKind) {
    const WAITERS: usize = 24;
    let h = Harness::new(kind);
    let f = h.put(Gfid::ROOT, "f", b"").expect("put");
    let holder = h.open(f, AccessMode::ReadWrite).expect("open");
    fn lk(fd: FdId, cmd: LockCmd, kind: LockKind) -> Lk {
        let lock = Lock {
            kind,
            start: 0,
            len: 0,
            pid: 1,
            owner: 1,
        };
        Lk { fd, cmd, lock }
    }
    h.call(&root(), lk(holder, LockCmd::Set, LockKind::Write))
        .expect("lock");
    let waiters: Vec<_> = (0..WAITERS)
        .map(|_| {
            let session = std::sync::Arc::new(h.engine.session());
            let FopReply::Open(o) = h
                .call_as(
                    &session,
                    &root(),
                    Open {
                        gfid: f,
                        access: AccessMode::ReadWrite,
                        flags: OpenFlags::empty(),
                    },
                )
                .expect("open")
            else {
                panic!()
            };
            let wait = session.clone();
            let task = h.rt.spawn(async move {
                let taken = wait
                    .call(root(), lk(o.fd, LockCmd::SetWait, LockKind::Write).into())
                    .await;
                if taken.is_ok() {
                    let unlock = lk(o.fd, LockCmd::Set, LockKind::Unlock);
                    wait.call(root(), unlock.into()).await.expect("unlock");
                }
                taken.map(drop)
            });
            (session, task)
        })
        .collect();
    // Let the waiters block, then check the brick still serves everything else.
    h.rt.block_on(async { tokio::time::sleep(std::time::Duration::from_millis(200)).await });
    for i in 0..8 {
        h.put(Gfid::ROOT, &format!("other-{i}"), b"x")
            .expect("served while locks wait");
    }
    assert_eq!(h.list(Gfid::ROOT).expect("readdir").len(), 9);
    // One waiter's session ends: its wait stops without the lock being released.
    let (ending, ending_task) = {
        let mut waiters = waiters;
        let last = waiters.pop().expect("a waiter");
        (last, waiters)
    };
    let (session, task) = ending;
    session.cancel_lock_waits();
    let stopped = h
        .rt
        .block_on(async { tokio::time::timeout(std::time::Duration::from_secs(10), task).await });
    assert!(
        matches!(stopped, Ok(Ok(Err(ErrorCode::Intr)))),
        "an ending session's wait stops: {stopped:?}"
    );
    drop(session);
    // The holder unlocks: every other waiter gets the lock in turn.
    h.call(&root(), lk(holder, LockCmd::Set, LockKind::Unlock))
        .expect("unlock");
    for (session, task) in ending_task {
        let taken = h.rt.block_on(async {
            tokio::time::timeout(std::time::Duration::from_secs(30), task).await
        });
        assert!(
            matches!(taken, Ok(Ok(Ok(())))),
            "a waiter got the lock: {taken:?}"
        );
        drop(session);
    }
}

/// Names need read permission on a directory; their attributes need search permission, as
/// `stat` of each would: READDIRP without it is EACCES, READDIR is not.
fn readdirp_needs_search_permission_as_stat_does(kind: EngineKind) {
    let h = Harness::new(kind);
    let dir = h
        .mkdir_as(&root(), Gfid::ROOT, "r-only", 0o744)
        .expect("mkdir");
    h.put(dir, "inside", b"x").expect("put");
    let other = user(4242);
    let FopReply::Opendir(o) = h
        .call(&other, Opendir { gfid: dir })
        .expect("r is enough to open")
    else {
        panic!()
    };
    let size = ReaddirSize::new(64 * 1024).expect("size");
    let FopReply::Readdir(names) = h
        .call(
            &other,
            Readdir {
                fd: o.fd,
                offset: 0,
                size,
            },
        )
        .expect("names need only r")
    else {
        panic!()
    };
    assert_eq!(names.entries.len(), 1);
    assert_eq!(
        h.call(
            &other,
            Readdirp {
                fd: o.fd,
                offset: 0,
                size
            }
        )
        .err(),
        Some(ErrorCode::Access),
        "attributes need x"
    );
    let FopReply::Opendir(mine) = h.call(&root(), Opendir { gfid: dir }).expect("opendir") else {
        panic!()
    };
    h.call(
        &root(),
        Readdirp {
            fd: mine.fd,
            offset: 0,
            size,
        },
    )
    .expect("root may");
}

/// A session opened with `ParentAttrs::Omit` (a client that negotiated `NO_PARENT_ATTRS`) gets
/// `Iatt::omitted_dir` for every parent attribute of every namespace fop, and the fops do
/// what they do for any session; a default session gets the parents' real attributes.
fn parent_attributes_only_for_a_session_that_wants_them(kind: EngineKind) {
    let h = Harness::new(kind);
    let bare = h.engine.session_with(ParentAttrs::Omit);
    let d = h.mkdir(Gfid::ROOT, "d").expect("mkdir");
    let call = |fop: FopRequest| h.call_as(&bare, &root(), fop).expect("fop");
    let omitted = |reply: &FopReply, parent: Gfid| {
        let parents: Vec<&Iatt> = match reply {
            FopReply::Put(e) | FopReply::Mkdir(e) | FopReply::Symlink(e) | FopReply::Link(e) => {
                vec![&e.pre_parent, &e.post_parent]
            }
            FopReply::Create(c) => vec![&c.pre_parent, &c.post_parent],
            FopReply::Unlink(r) | FopReply::Rmdir(r) => vec![&r.pre_parent, &r.post_parent],
            FopReply::Rename(r) => vec![&r.pre_old_parent, &r.post_old_parent],
            other => panic!("not a namespace reply: {other:?}"),
        };
        for iatt in parents {
            assert_eq!(*iatt, Iatt::omitted_dir(parent), "{reply:?}");
        }
    };
    let (f, e, g) = (h.gfid(), h.gfid(), h.gfid());
    let put = Put {
        parent: d,
        name: name("f"),
        gfid: f,
        mode: mode(0o644),
        umask: mode(0),
        flags: OpenFlags::empty(),
        data: Payload::new(Bytes::from_static(b"body")).expect("small"),
        attr: SetAttr::default(),
    };
    let reply = call(put.into());
    omitted(&reply, d);
    let FopReply::Put(made) = &reply else {
        panic!()
    };
    assert_eq!(
        (made.iatt.gfid, made.iatt.size),
        (f, 4),
        "the object itself is there"
    );
    let create = Create {
        parent: d,
        name: name("c"),
        gfid: g,
        access: AccessMode::ReadWrite,
        flags: OpenFlags::EXCL,
        mode: mode(0o600),
        umask: mode(0),
    };
    omitted(&call(create.into()), d);
    let mkdir = Mkdir {
        parent: d,
        name: name("e"),
        gfid: e,
        mode: mode(0o755),
        umask: mode(0),
    };
    omitted(&call(mkdir.into()), d);
    let symlink = Symlink {
        parent: d,
        name: name("s"),
        gfid: h.gfid(),
        target: SymlinkTarget::new(b"f".to_vec()).expect("target"),
    };
    omitted(&call(symlink.into()), d);
    let link = Link {
        gfid: f,
        new_parent: d,
        new_name: name("f2"),
    };
    omitted(&call(link.into()), d);
    let rename = Rename {
        old_parent: d,
        old_name: name("f2"),
        new_parent: d,
        new_name: name("f3"),
        mode: RenameMode::Replace,
    };
    omitted(&call(rename.into()), d);
    for n in ["f3", "f", "c", "s"] {
        let unlink = Unlink {
            parent: d,
            name: name(n),
        };
        omitted(&call(unlink.into()), d);
    }
    let rmdir = Rmdir {
        parent: d,
        name: name("e"),
    };
    omitted(&call(rmdir.into()), d);
    assert!(
        h.list(d).expect("list").is_empty(),
        "every fop did its work"
    );
    // The harness's own session asks for them.
    h.put(d, "x", b"x").expect("put");
    let FopReply::Unlink(r) = h
        .call(
            &root(),
            Unlink {
                parent: d,
                name: name("x"),
            },
        )
        .expect("unlink")
    else {
        panic!()
    };
    assert_eq!((r.post_parent.gfid, r.post_parent.nlink), (d, 2));
    assert!(r.post_parent.ino != 0 && r.pre_parent.mtime.sec() > 0);
    h.assert_consistent();
}

/// UNLINK_SETTLED removes what UNLINK removes, but a regular file with the sticky bit (a link
/// file, or a file being moved between bricks) is answered EXDEV and left whole.
fn unlink_settled_leaves_sticky_files_alone(kind: EngineKind) {
    let h = Harness::new(kind);
    let settled = |n: &str| {
        h.call(
            &root(),
            UnlinkSettled {
                parent: Gfid::ROOT,
                name: name(n),
            },
        )
    };
    let set_mode = |gfid, bits| {
        let attr = SetAttr {
            mode: Some(mode(bits)),
            ..SetAttr::default()
        };
        h.call(&root(), Setattr { gfid, attr }).expect("setattr");
    };
    h.put(Gfid::ROOT, "plain", b"data").expect("put");
    assert!(matches!(settled("plain"), Ok(FopReply::UnlinkSettled(_))));
    assert_eq!(h.lookup(Gfid::ROOT, "plain").err(), Some(ErrorCode::NoEnt));
    for (n, bits) in [("link-file", 0o1000), ("being-moved", 0o1644)] {
        let gfid = h.put(Gfid::ROOT, n, b"data").expect("put");
        set_mode(gfid, bits);
        assert_eq!(settled(n).err(), Some(ErrorCode::CrossDevice), "{n}");
        assert_eq!(h.read_all(gfid).expect("still whole"), b"data", "{n}");
        h.unlink(Gfid::ROOT, n).expect("a plain UNLINK removes it");
    }
    let dir = h.mkdir(Gfid::ROOT, "sticky-dir").expect("mkdir");
    set_mode(dir, 0o1777);
    assert_eq!(settled("sticky-dir").err(), Some(ErrorCode::IsDir));
    assert_eq!(settled("missing").err(), Some(ErrorCode::NoEnt));
    let two = h.put(Gfid::ROOT, "one-of-two", b"linked").expect("put");
    let link = Link {
        gfid: two,
        new_parent: Gfid::ROOT,
        new_name: name("two-of-two"),
    };
    h.call(&root(), link).expect("link");
    settled("one-of-two").expect("one name of two");
    assert_eq!(h.lookup(Gfid::ROOT, "two-of-two").expect("kept").nlink, 1);
    h.assert_consistent();
}
