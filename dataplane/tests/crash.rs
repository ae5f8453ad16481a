//! Crash injection: every multi-step namespace fop is stopped after each of its steps, as if
//! the brick had been killed there; the brick is reopened (start-up repair runs), must check
//! clean, must show the fop either not done or fully done, and a retry must succeed.

mod common;

use std::path::Path;
use std::process::Command;

use bytes::Bytes;
use common::*;
use kiln_dataplane::{CrashPoint, EngineKind, FopsConfig};
use kiln_wire::*;

per_engine!(
    crash_during_put,
    crash_during_put_synced,
    crash_during_create,
    crash_during_read_only_create,
    dir_records_go_a_moment_after_the_last_create_and_unlink,
    crash_during_mkdir,
    crash_during_symlink,
    crash_during_mknod,
    crash_during_link,
    crash_during_unlink,
    crash_during_unlink_of_a_symlink,
    crash_during_unlink_of_one_of_two_names,
    crash_during_rmdir,
    crash_during_rename_replacing_a_file,
    crash_during_rename_replacing_one_of_two_names,
    crash_during_directory_rename,
);

/// More than any fop's chain is long: the last iterations crash after the whole chain.
const STEPS_MAX: usize = 12;

/// For each crash point: `setup` on a fresh brick, `action` crashed after `k` steps, reopen,
/// check the layout, `verify` (which sees the state and retries).
fn each_crash_point(
    kind: EngineKind,
    fop: FopCode,
    setup: impl Fn(&Harness) -> Vec<Gfid>,
    action: impl Fn(&Harness, &[Gfid]) -> Result<FopReply, ErrorCode>,
    verify: impl Fn(&Harness, &[Gfid], usize),
) {
    for k in 0..=STEPS_MAX {
        let h = Harness::new(kind);
        let ids = setup(&h);
        h.rt.block_on(h.engine.set_crash_point(Some(CrashPoint {
            fop,
            after_steps: k,
        })));
        assert_eq!(
            action(&h, &ids).err(),
            Some(ErrorCode::Io),
            "{fop:?} crash after {k} steps"
        );
        let Harness { dir, .. } = h;
        let path = dir.path().join("brick");
        let h = Harness::reopen(dir, &path, kind, FopsConfig::default());
        h.assert_consistent();
        verify(&h, &ids, k);
        h.assert_consistent();
    }
}

/// UNLINK of `n` in the root directory.
fn unlink_root(h: &Harness, n: &str) -> Result<FopReply, ErrorCode> {
    let unlink = Unlink {
        parent: Gfid::ROOT,
        name: name(n),
    };
    h.call(&root(), unlink)
}

/// RENAME of `a` over `b` in the root directory.
fn rename_a_over_b(h: &Harness) -> Result<FopReply, ErrorCode> {
    let rename = Rename {
        old_parent: Gfid::ROOT,
        old_name: name("a"),
        new_parent: Gfid::ROOT,
        new_name: name("b"),
        mode: RenameMode::Replace,
    };
    h.call(&root(), rename)
}

/// PUT of `x` with `gfid`, or PUT_SYNCED (`fop`).
fn put_x(h: &Harness, fop: FopCode, gfid: Gfid) -> Result<FopReply, ErrorCode> {
    let put = small_put(Gfid::ROOT, "x", gfid, b"payload");
    match fop {
        FopCode::PutSynced => h.call(&root(), PutSynced { put }),
        _ => h.call(&root(), put),
    }
}

/// After a crashed create of `x` with `gfid`: `x` is absent or is that object; a retry with
/// the same GFID succeeds and leaves exactly that object.
fn created_or_not(h: &Harness, gfid: Gfid, retry: impl Fn() -> Result<FopReply, ErrorCode>) {
    match h.lookup(Gfid::ROOT, "x") {
        Err(ErrorCode::NoEnt) => {}
        Ok(found) => assert_eq!(found.gfid, gfid, "a half-made object under another gfid"),
        Err(e) => panic!("lookup after crash: {e}"),
    }
    retry().expect("retry with the same gfid");
    assert_eq!(h.lookup(Gfid::ROOT, "x").expect("made").gfid, gfid);
    assert_eq!(h.stat(gfid).expect("reachable by gfid").gfid, gfid);
}

fn crash_during_put(kind: EngineKind) {
    crash_during_a_put(kind, FopCode::Put);
}

/// As PUT: the retry of a crashed PUT_SYNCED syncs what the first one made.
fn crash_during_put_synced(kind: EngineKind) {
    crash_during_a_put(kind, FopCode::PutSynced);
}

fn crash_during_a_put(kind: EngineKind, fop: FopCode) {
    each_crash_point(
        kind,
        fop,
        |h| vec![h.gfid()],
        |h, ids| put_x(h, fop, ids[0]),
        |h, ids, _| {
            created_or_not(h, ids[0], || put_x(h, fop, ids[0]));
            assert_eq!(
                h.read_all(ids[0]).expect("read"),
                b"payload",
                "a retried {fop:?} writes its data"
            );
        },
    );
}

fn create_x(h: &Harness, gfid: Gfid, access: AccessMode) -> Result<FopReply, ErrorCode> {
    h.call(
        &root(),
        Create {
            parent: Gfid::ROOT,
            name: name("x"),
            gfid,
            access,
            flags: OpenFlags::empty(),
            mode: mode(0o600),
            umask: mode(0),
        },
    )
}

/// A writable create: made as an unnamed file, then named, under its directory's record.
fn crash_during_create(kind: EngineKind) {
    each_crash_point(
        kind,
        FopCode::Create,
        |h| vec![h.gfid()],
        |h, ids| create_x(h, ids[0], AccessMode::ReadWrite),
        |h, ids, _| {
            created_or_not(h, ids[0], || create_x(h, ids[0], AccessMode::ReadWrite));
        },
    );
}

/// A read-only create cannot be made unnamed (`O_TMPFILE` needs write access): it takes the
/// intent-record path.
fn crash_during_read_only_create(kind: EngineKind) {
    each_crash_point(
        kind,
        FopCode::Create,
        |h| vec![h.gfid()],
        |h, ids| create_x(h, ids[0], AccessMode::ReadOnly),
        |h, ids, _| {
            created_or_not(h, ids[0], || create_x(h, ids[0], AccessMode::ReadOnly));
        },
    );
}

/// A burst of creates in one directory shares one record, which goes a moment after the
/// last; so does a burst of unlinks.
fn dir_records_go_a_moment_after_the_last_create_and_unlink(kind: EngineKind) {
    let h = Harness::new(kind);
    let pending = h.path().join(".glusterfs/kiln-pending");
    let records = || std::fs::read_dir(&pending).expect("pending dir").count();
    let records_go = || {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while records() > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the dir record stayed"
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    };
    for i in 0..20 {
        h.put(Gfid::ROOT, &format!("f{i}"), b"data").expect("put");
    }
    assert_eq!(records(), 1, "one record for the directory's creates");
    records_go();
    for i in 0..20 {
        h.unlink(Gfid::ROOT, &format!("f{i}")).expect("unlink");
    }
    assert_eq!(records(), 1, "one record for the directory's unlinks");
    records_go();
    h.assert_consistent();
}

fn crash_during_mkdir(kind: EngineKind) {
    let mkdir = |h: &Harness, g: Gfid| {
        h.call(
            &root(),
            Mkdir {
                parent: Gfid::ROOT,
                name: name("x"),
                gfid: g,
                mode: mode(0o755),
                umask: mode(0),
            },
        )
    };
    each_crash_point(
        kind,
        FopCode::Mkdir,
        |h| vec![h.gfid()],
        |h, ids| mkdir(h, ids[0]),
        |h, ids, _| {
            created_or_not(h, ids[0], || mkdir(h, ids[0]));
            h.put(ids[0], "child", b"c")
                .expect("the new directory works");
        },
    );
}

fn crash_during_symlink(kind: EngineKind) {
    let symlink = |h: &Harness, g: Gfid| {
        let target = SymlinkTarget::new(&b"somewhere"[..]).expect("valid");
        h.call(
            &root(),
            Symlink {
                parent: Gfid::ROOT,
                name: name("x"),
                gfid: g,
                target,
            },
        )
    };
    each_crash_point(
        kind,
        FopCode::Symlink,
        |h| vec![h.gfid()],
        |h, ids| symlink(h, ids[0]),
        |h, ids, _| {
            created_or_not(h, ids[0], || symlink(h, ids[0]));
        },
    );
}

fn crash_during_mknod(kind: EngineKind) {
    let mknod = |h: &Harness, g: Gfid| {
        h.call(
            &root(),
            Mknod {
                parent: Gfid::ROOT,
                name: name("x"),
                gfid: g,
                node_type: NodeType::Fifo,
                mode: mode(0o600),
                umask: mode(0),
                rdev: 0,
            },
        )
    };
    each_crash_point(
        kind,
        FopCode::Mknod,
        |h| vec![h.gfid()],
        |h, ids| mknod(h, ids[0]),
        |h, ids, _| {
            created_or_not(h, ids[0], || mknod(h, ids[0]));
        },
    );
}

fn crash_during_link(kind: EngineKind) {
    let link = |h: &Harness, g: Gfid| {
        h.call(
            &root(),
            Link {
                gfid: g,
                new_parent: Gfid::ROOT,
                new_name: name("x"),
            },
        )
    };
    each_crash_point(
        kind,
        FopCode::Link,
        |h| vec![h.put(Gfid::ROOT, "f", b"f").expect("put")],
        |h, ids| link(h, ids[0]),
        |h, ids, _| {
            match h.lookup(Gfid::ROOT, "x") {
                Err(ErrorCode::NoEnt) => {
                    link(h, ids[0]).expect("retry");
                }
                Ok(found) => assert_eq!(found.gfid, ids[0]),
                Err(e) => panic!("{e}"),
            }
            assert_eq!(h.stat(ids[0]).expect("stat").nlink, 2);
        },
    );
}

fn crash_during_unlink(kind: EngineKind) {
    each_crash_point(
        kind,
        FopCode::Unlink,
        |h| vec![h.put(Gfid::ROOT, "f", b"f").expect("put")],
        |h, _| unlink_root(h, "f"),
        |h, ids, _| {
            match h.lookup(Gfid::ROOT, "f") {
                Ok(found) => {
                    assert_eq!(found.gfid, ids[0]);
                    assert_eq!(h.read_all(ids[0]).expect("still whole"), b"f");
                    h.unlink(Gfid::ROOT, "f").expect("retry");
                }
                Err(ErrorCode::NoEnt) => {}
                Err(e) => panic!("{e}"),
            }
            assert_eq!(
                h.stat(ids[0]).err(),
                Some(ErrorCode::Stale),
                "gone by gfid too"
            );
        },
    );
}

/// A symlink's handle is a hard link like a file's: repair relinks it as it does a file's.
fn crash_during_unlink_of_a_symlink(kind: EngineKind) {
    each_crash_point(
        kind,
        FopCode::Unlink,
        |h| {
            let gfid = h.gfid();
            let target = SymlinkTarget::new(&b"somewhere"[..]).expect("valid");
            let symlink = Symlink {
                parent: Gfid::ROOT,
                name: name("s"),
                gfid,
                target,
            };
            h.call(&root(), symlink).expect("symlink");
            vec![gfid]
        },
        |h, _| unlink_root(h, "s"),
        |h, ids, _| {
            match h.lookup(Gfid::ROOT, "s") {
                Ok(found) => {
                    assert_eq!(found.gfid, ids[0]);
                    assert_eq!(h.stat(ids[0]).expect("handle in place").gfid, ids[0]);
                    h.unlink(Gfid::ROOT, "s").expect("retry");
                }
                Err(ErrorCode::NoEnt) => {}
                Err(e) => panic!("{e}"),
            }
            assert_eq!(h.stat(ids[0]).err(), Some(ErrorCode::Stale));
        },
    );
}

/// A file with another name keeps its handle whatever step the unlink of one name stopped at.
fn crash_during_unlink_of_one_of_two_names(kind: EngineKind) {
    each_crash_point(
        kind,
        FopCode::Unlink,
        |h| {
            let gfid = h.put(Gfid::ROOT, "f", b"f").expect("put");
            let link = Link {
                gfid,
                new_parent: Gfid::ROOT,
                new_name: name("g"),
            };
            h.call(&root(), link).expect("link");
            vec![gfid]
        },
        |h, _| unlink_root(h, "f"),
        |h, ids, _| {
            assert_eq!(h.lookup(Gfid::ROOT, "g").expect("other name").gfid, ids[0]);
            // The names the file has (the brick does not count its handle).
            let expected_nlink = match h.lookup(Gfid::ROOT, "f") {
                Ok(_) => 2,
                Err(ErrorCode::NoEnt) => 1,
                Err(e) => panic!("{e}"),
            };
            assert_eq!(h.stat(ids[0]).expect("by gfid").nlink, expected_nlink);
            assert_eq!(h.read_all(ids[0]).expect("still whole"), b"f");
        },
    );
}

fn crash_during_rmdir(kind: EngineKind) {
    each_crash_point(
        kind,
        FopCode::Rmdir,
        |h| vec![h.mkdir(Gfid::ROOT, "d").expect("mkdir")],
        |h, _| {
            h.call(
                &root(),
                Rmdir {
                    parent: Gfid::ROOT,
                    name: name("d"),
                },
            )
        },
        |h, ids, _| {
            match h.lookup(Gfid::ROOT, "d") {
                Ok(found) => {
                    assert_eq!(found.gfid, ids[0]);
                    assert_eq!(h.stat(ids[0]).expect("handle back in place").gfid, ids[0]);
                    h.rmdir(Gfid::ROOT, "d").expect("retry");
                }
                Err(ErrorCode::NoEnt) => {}
                Err(e) => panic!("{e}"),
            }
            assert_eq!(h.stat(ids[0]).err(), Some(ErrorCode::Stale));
        },
    );
}

fn crash_during_rename_replacing_a_file(kind: EngineKind) {
    each_crash_point(
        kind,
        FopCode::Rename,
        |h| {
            vec![
                h.put(Gfid::ROOT, "a", b"a").expect("put"),
                h.put(Gfid::ROOT, "b", b"b").expect("put"),
            ]
        },
        |h, _| rename_a_over_b(h),
        |h, ids, _| {
            let b = h.lookup(Gfid::ROOT, "b").expect("b always exists");
            if b.gfid == ids[1] {
                assert_eq!(
                    h.lookup(Gfid::ROOT, "a").expect("not renamed yet").gfid,
                    ids[0]
                );
                assert_eq!(h.read_all(ids[1]).expect("victim intact"), b"b");
                h.rename(Gfid::ROOT, "a", Gfid::ROOT, "b", RenameMode::Replace)
                    .expect("retry");
            } else {
                assert_eq!(b.gfid, ids[0]);
                assert_eq!(h.lookup(Gfid::ROOT, "a").err(), Some(ErrorCode::NoEnt));
            }
            assert_eq!(h.read_all(ids[0]).expect("moved file"), b"a");
            assert_eq!(
                h.stat(ids[1]).err(),
                Some(ErrorCode::Stale),
                "the victim is gone"
            );
        },
    );
}

/// A replaced file with another name keeps its handle whatever step the rename stopped at.
fn crash_during_rename_replacing_one_of_two_names(kind: EngineKind) {
    each_crash_point(
        kind,
        FopCode::Rename,
        |h| {
            let a = h.put(Gfid::ROOT, "a", b"a").expect("put");
            let b = h.put(Gfid::ROOT, "b", b"b").expect("put");
            let link = Link {
                gfid: b,
                new_parent: Gfid::ROOT,
                new_name: name("c"),
            };
            h.call(&root(), link).expect("link");
            vec![a, b]
        },
        |h, _| rename_a_over_b(h),
        |h, ids, _| {
            assert_eq!(h.lookup(Gfid::ROOT, "c").expect("other name").gfid, ids[1]);
            let renamed = h.lookup(Gfid::ROOT, "b").expect("b always exists").gfid == ids[0];
            assert_eq!(
                h.stat(ids[1]).expect("by gfid").nlink,
                if renamed { 1 } else { 2 }
            );
            assert_eq!(h.read_all(ids[1]).expect("still whole"), b"b");
            assert_eq!(h.read_all(ids[0]).expect("the moved file"), b"a");
        },
    );
}

fn crash_during_directory_rename(kind: EngineKind) {
    each_crash_point(
        kind,
        FopCode::Rename,
        |h| {
            let a = h.mkdir(Gfid::ROOT, "a").expect("mkdir");
            let sub = h.mkdir(a, "sub").expect("mkdir");
            h.put(sub, "leaf", b"leaf").expect("put");
            let b = h.mkdir(Gfid::ROOT, "b").expect("mkdir");
            vec![a, sub, b]
        },
        |h, ids| {
            h.call(
                &root(),
                Rename {
                    old_parent: ids[0],
                    old_name: name("sub"),
                    new_parent: ids[2],
                    new_name: name("moved"),
                    mode: RenameMode::Replace,
                },
            )
        },
        |h, ids, _| {
            let (a, sub, b) = (ids[0], ids[1], ids[2]);
            if h.lookup(a, "sub").is_ok() {
                h.rename(a, "sub", b, "moved", RenameMode::Replace)
                    .expect("retry");
            }
            assert_eq!(h.lookup(b, "moved").expect("moved").gfid, sub);
            // The directory's handle points at its new place: a cold resolve finds it.
            let fresh = Harness::reopen(
                tempfile::tempdir().expect("tmp"),
                &h.path(),
                h.engine.kind(),
                FopsConfig::default(),
            );
            assert_eq!(
                fresh
                    .lookup(sub, "leaf")
                    .expect("leaf through the handle")
                    .size,
                4
            );
        },
    );
}

/// Damage made behind the brick's back (names removed, xattrs stripped, handles deleted) is
/// found by `check` and repaired by `check --repair`.
#[test]
fn check_finds_and_repairs_damage() {
    let h = Harness::new(EngineKind::Blocking);
    let d = h.mkdir(Gfid::ROOT, "d").expect("mkdir");
    h.mkdir(Gfid::ROOT, "gone").expect("mkdir");
    let f = h.put(d, "f", b"f").expect("put");
    h.put(Gfid::ROOT, "stale", b"s").expect("put");
    let p = h.path();
    std::fs::remove_file(p.join("stale")).expect("name removed behind the brick's back");
    std::fs::remove_dir(p.join("gone")).expect("dir removed behind the brick's back");
    std::fs::remove_file(p.join(kiln_dataplane::Brick::handle_path(&f))).expect("handle removed");
    rustix::fs::lremovexattr(p.join("d"), "trusted.gfid").expect("gfid stripped");
    std::fs::write(p.join("d/new"), b"no gfid").expect("file copied in");
    let report = kiln_dataplane::recovery::check(&h.brick, false).expect("check");
    assert_eq!(report.stale_handle, 1, "{report}");
    assert_eq!(report.dangling_dir_handle, 2, "{report}");
    assert_eq!(report.missing_gfid, 2, "{report}");
    assert_eq!(report.missing_handle, 1, "{report}");
    let repaired = kiln_dataplane::recovery::check(&h.brick, true).expect("repair");
    assert!(repaired.problems() > 0);
    h.assert_consistent();
}

/// Two fops interrupted at once: a directory rename after its commit (the directory's new
/// handle not yet installed) and a PUT into that directory after its commit. Repair settles
/// the move first, so the create's parent resolves and the create is completed, not undone.
#[test]
fn repair_settles_moves_before_creates_inside_them() {
    for kind in [EngineKind::Blocking, EngineKind::Uring] {
        let h = Harness::new(kind);
        let a = h.mkdir(Gfid::ROOT, "a").expect("mkdir");
        let sub = h.mkdir(a, "sub").expect("mkdir");
        // Resolve `sub` once, so the (still running) brick holds its fd across the rename.
        h.put(sub, "warm", b"").expect("put");
        // The rename chain: 2 stats, the `mv-` record, the rename (commit); stop right after.
        h.rt.block_on(h.engine.set_crash_point(Some(CrashPoint {
            fop: FopCode::Rename,
            after_steps: 4,
        })));
        let rename = Rename {
            old_parent: a,
            old_name: name("sub"),
            new_parent: Gfid::ROOT,
            new_name: name("moved"),
            mode: RenameMode::Replace,
        };
        assert_eq!(h.call(&root(), rename).err(), Some(ErrorCode::Io));
        // The PUT chain: parent stat, `new-` record, open (commit), gfid xattr; stop there.
        h.rt.block_on(h.engine.set_crash_point(Some(CrashPoint {
            fop: FopCode::Put,
            after_steps: 4,
        })));
        let file = h.gfid();
        let put = Put {
            parent: sub,
            name: name("f"),
            gfid: file,
            mode: mode(0o644),
            umask: mode(0),
            flags: OpenFlags::empty(),
            data: Payload::new(Bytes::from_static(b"")).expect("small"),
            attr: SetAttr::default(),
        };
        assert_eq!(h.call(&root(), put).err(), Some(ErrorCode::Io));
        let Harness { dir, .. } = h;
        let path = dir.path().join("brick");
        let h = Harness::reopen(dir, &path, kind, FopsConfig::default());
        h.assert_consistent();
        assert_eq!(h.lookup(Gfid::ROOT, "moved").expect("moved").gfid, sub);
        assert_eq!(
            h.lookup(sub, "f").expect("the create was completed").gfid,
            file
        );
        assert_eq!(h.stat(file).expect("by gfid").gfid, file);
    }
}

/// Unmounts a loop-mounted file system when dropped.
struct Unmount(std::path::PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        // The engine's threads may still hold directory fds for a moment (EBUSY); retry,
        // then detach lazily so no mount outlives the test.
        for _ in 0..50 {
            let done = Command::new("umount").arg(&self.0).output();
            if done.is_ok_and(|o| o.status.success()) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = Command::new("umount").arg("-l").arg(&self.0).output();
    }
}

fn succeeds(cmd: &mut Command) -> bool {
    cmd.output().map(|o| o.status.success()).unwrap_or(false)
}

/// A new ext4 of `mib` MiB in file `image` (`mkfs_args` added), mounted at `mnt`.
fn new_ext4(image: &Path, mib: u64, mkfs_args: &[&str], mnt: &Path, options: &str) -> Unmount {
    std::fs::File::create(image)
        .and_then(|f| f.set_len(mib << 20))
        .expect("image");
    let mut mkfs = Command::new("mkfs.ext4");
    mkfs.args(["-q", "-F"]).args(mkfs_args).arg(image);
    assert!(succeeds(&mut mkfs), "mkfs.ext4");
    mount_loop(image, mnt, options)
}

/// The file system in file `image`, mounted at `mnt` with `options` (its journal replayed).
fn mount_loop(image: &Path, mnt: &Path, options: &str) -> Unmount {
    std::fs::create_dir_all(mnt).expect("mkdir");
    let mut mount = Command::new("mount");
    mount
        .args(["-o", &format!("loop,{options}")])
        .arg(image)
        .arg(mnt);
    assert!(succeeds(&mut mount), "mount {}", image.display());
    Unmount(mnt.to_owned())
}

/// A brick formatted on a fresh 16 MiB ext4 of `inodes` inodes in `scratch`; the file
/// system is unmounted when the guard goes.
fn small_brick(scratch: &Path, inodes: u32) -> (Unmount, std::path::PathBuf) {
    let mnt = scratch.join("mnt");
    let inodes = inodes.to_string();
    let unmount = new_ext4(
        &scratch.join("small.img"),
        16,
        &["-N", &inodes],
        &mnt,
        "defaults",
    );
    let path = mnt.join("brick");
    kiln_dataplane::Brick::format(&path).expect("format");
    (unmount, path)
}

/// A full disk: creates and writes fail with ENOSPC (or EDQUOT-like errors the kernel gives),
/// never with a wrong success, and the brick stays consistent; after space is freed it works.
#[test]
fn full_disk_gives_enospc_and_loses_nothing() {
    let scratch = tempfile::tempdir().expect("tempdir");
    let (_unmount, path) = small_brick(scratch.path(), 4096);
    for kind in [EngineKind::Blocking, EngineKind::Uring] {
        let h = Harness::reopen(
            tempfile::tempdir().expect("tmp"),
            &path,
            kind,
            FopsConfig::default(),
        );
        let dir = h.mkdir(Gfid::ROOT, &format!("{kind:?}")).expect("mkdir");
        // Each file's content is its own, so a read back shows which file it came from.
        let block = |i: usize| {
            let mut data = vec![0u8; 1 << 20];
            for (j, b) in data.iter_mut().enumerate() {
                *b = (i * 31 + j / 4096) as u8;
            }
            data
        };
        let mut written = Vec::new();
        let err = loop {
            match h.put(dir, &format!("f{}", written.len()), &block(written.len())) {
                Ok(g) => written.push(g),
                Err(e) => break e,
            }
            assert!(
                written.len() < 64,
                "a 16 MiB file system cannot hold 64 MiB"
            );
        };
        assert_eq!(err, ErrorCode::NoSpace, "{kind:?}");
        h.assert_consistent();
        // Everything acknowledged is intact, byte for byte.
        for (i, g) in written.iter().enumerate() {
            assert!(
                h.read_all(*g).expect("read back") == block(i),
                "{kind:?}: file {i} changed"
            );
        }
        // Freeing space makes the brick usable again.
        for i in 0..written.len() {
            h.unlink(dir, &format!("f{i}")).expect("unlink");
        }
        h.put(dir, "after", b"fits again")
            .expect("put after freeing space");
        h.assert_consistent();
    }
}

/// A disk whose inodes are all used: creates fail with ENOSPC, and every file can still be
/// unlinked — with no inode for the directory's `dir` record, the name goes before the
/// handle — leaving the brick consistent; then files are made again.
#[test]
fn a_disk_out_of_inodes_can_still_be_emptied() {
    let scratch = tempfile::tempdir().expect("tempdir");
    let (_unmount, path) = small_brick(scratch.path(), 1024);
    for kind in [EngineKind::Blocking, EngineKind::Uring] {
        let h = Harness::reopen(
            tempfile::tempdir().expect("tmp"),
            &path,
            kind,
            FopsConfig::default(),
        );
        let dir = h.mkdir(Gfid::ROOT, &format!("{kind:?}")).expect("mkdir");
        let mut names = Vec::new();
        let put = |names: &mut Vec<String>| {
            let name = format!("f{}", names.len());
            h.put(dir, &name, b"x").map(|_| names.push(name))
        };
        let err = loop {
            if let Err(e) = put(&mut names) {
                break e;
            }
            assert!(names.len() < 2048, "1024 inodes hold 2048 files");
        };
        assert_eq!(err, ErrorCode::NoSpace, "{kind:?}");
        // The creates' `dir` record goes after 1 s idle; the inode it frees is taken again,
        // so the unlinks find no room for a record of their own.
        std::thread::sleep(std::time::Duration::from_millis(2500));
        let _ = put(&mut names);
        for name in &names {
            h.unlink(dir, name).expect("unlink on a disk out of inodes");
        }
        h.assert_consistent();
        h.put(dir, "after", b"fits again")
            .expect("put after freeing inodes");
        h.assert_consistent();
    }
}

/// Two interrupted directory renames, one into the other: the inner move's record resolves
/// only once the outer one is installed, which repair does in passes.
#[test]
fn repair_settles_nested_moves() {
    for kind in [EngineKind::Blocking, EngineKind::Uring] {
        let h = Harness::new(kind);
        let a = h.mkdir(Gfid::ROOT, "a").expect("mkdir");
        let p = h.mkdir(a, "p").expect("mkdir");
        let d = h.mkdir(Gfid::ROOT, "d").expect("mkdir");
        // Resolve both once, so the still running brick holds their fds across the renames.
        h.put(p, "warm", b"").expect("put");
        h.put(d, "leaf", b"leaf").expect("put");
        let crash_rename = |op: Gfid, on: &str, np: Gfid, nn: &str| {
            // Two parent stats, the `mv-` record, the rename (commit): stop right after.
            h.rt.block_on(h.engine.set_crash_point(Some(CrashPoint {
                fop: FopCode::Rename,
                after_steps: 4,
            })));
            let rename = Rename {
                old_parent: op,
                old_name: name(on),
                new_parent: np,
                new_name: name(nn),
                mode: RenameMode::Replace,
            };
            assert_eq!(h.call(&root(), rename).err(), Some(ErrorCode::Io));
        };
        crash_rename(a, "p", Gfid::ROOT, "p2");
        crash_rename(Gfid::ROOT, "d", p, "d2");
        let Harness { dir, .. } = h;
        let path = dir.path().join("brick");
        let h = Harness::reopen(dir, &path, kind, FopsConfig::default());
        h.assert_consistent();
        assert_eq!(h.lookup(p, "d2").expect("inner move kept").gfid, d);
        assert_eq!(
            h.lookup(d, "leaf")
                .expect("through the repaired handle")
                .size,
            4
        );
    }
}

/// PUT_SYNCED is durable once answered: a copy of the brick's file system taken right after
/// it — what a power cut leaves, with ext4 told to commit its journal only every minute, so
/// nothing reaches the disk unless synced — holds the file whole, with its GFID, handle and
/// the directory made before it. A PUT answered after it is not in the copy: the copy does
/// lose what was not synced (without the sync, the first file is lost the same way).
#[test]
fn a_synced_put_survives_a_power_cut() {
    for kind in [EngineKind::Blocking, EngineKind::Uring] {
        let scratch = tempfile::tempdir().expect("tempdir");
        let (image, copy) = (
            scratch.path().join("fs.img"),
            scratch.path().join("cut.img"),
        );
        let mnt = scratch.path().join("mnt");
        let unmount = new_ext4(&image, 64, &[], &mnt, "commit=60");
        let path = mnt.join("brick");
        kiln_dataplane::Brick::format(&path).expect("format");
        assert!(succeeds(Command::new("sync").arg("-f").arg(&mnt)), "sync");
        let h = Harness::reopen(tempdir(), &path, kind, FopsConfig::default());
        let spool = h.mkdir(Gfid::ROOT, "spool").expect("mkdir");
        let (mail, content) = (h.gfid(), b"From: a\n\nsynced".repeat(100));
        let put = small_put(spool, "mail", mail, &content);
        h.call(&root(), PutSynced { put }).expect("put synced");
        h.put(spool, "unsynced", b"answered, never synced")
            .expect("put");
        std::fs::copy(&image, &copy).expect("copy the image");
        drop(h);
        drop(unmount);

        let _unmount = mount_loop(&copy, &mnt, "defaults");
        let h = Harness::reopen(tempdir(), &path, kind, FopsConfig::default());
        h.assert_consistent();
        let spool = h.lookup(Gfid::ROOT, "spool").expect("the directory").gfid;
        assert_eq!(h.lookup(spool, "mail").expect("the mail").gfid, mail);
        assert_eq!(h.read_all(mail).expect("read by gfid"), content, "{kind:?}");
        assert_eq!(
            h.lookup(spool, "unsynced").err(),
            Some(ErrorCode::NoEnt),
            "{kind:?}: the copy holds what was never synced: no power cut"
        );
    }
}

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}
