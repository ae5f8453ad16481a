//! Many sessions at once: concurrent creates, reads, renames and unlinks in one shared
//! directory and in private ones, every result checked, then the whole brick checked.

mod common;

use std::collections::BTreeSet;

use bytes::Bytes;
use common::*;
use kiln_dataplane::{EngineKind, FopsConfig};
use kiln_wire::*;

per_engine!(
    concurrent_sessions_agree,
    links_racing_unlinks_of_the_last_name_keep_the_file_whole,
    creates_racing_lookups_of_their_names_succeed,
    removals_and_renames_racing_lookups_leave_the_brick_clean,
    creates_of_one_name_from_two_sessions_make_one_object,
    creates_inside_a_directory_being_renamed_succeed,
    namespace_fops_racing_on_one_name_leave_the_brick_clean,
    directories_being_renamed_stay_reachable_by_their_gfids,
    directories_renamed_into_each_other_never_make_a_loop,
    fops_into_a_directory_racing_its_rmdir_leave_nothing_behind,
);

const SESSIONS: usize = 32;
const FILES_PER_SESSION: usize = 20;

fn concurrent_sessions_agree(kind: EngineKind) {
    let h = Harness::new(kind);
    let shared = h.mkdir(Gfid::ROOT, "shared").expect("mkdir");
    let gfids: Vec<Vec<Gfid>> = (0..SESSIONS)
        .map(|_| (0..FILES_PER_SESSION * 2).map(|_| h.gfid()).collect())
        .collect();
    h.rt.block_on(async {
        let mut tasks = tokio::task::JoinSet::new();
        for (t, ids) in gfids.into_iter().enumerate() {
            let session = h.engine.session();
            tasks.spawn(async move {
                let call = |fop: FopRequest| session.call(root(), fop);
                let own = ids[FILES_PER_SESSION * 2 - 1];
                let mkdir = Mkdir {
                    parent: Gfid::ROOT,
                    name: name(&format!("own{t}")),
                    gfid: own,
                    mode: mode(0o755),
                    umask: mode(0),
                };
                call(mkdir.into()).await.expect("mkdir own");
                for (i, &gfid) in ids.iter().enumerate().take(FILES_PER_SESSION) {
                    let body = format!("session {t} file {i}");
                    let put = Put {
                        parent: shared,
                        name: name(&format!("f-{t}-{i}")),
                        gfid,
                        mode: mode(0o644),
                        umask: mode(0),
                        flags: OpenFlags::empty(),
                        data: Payload::new(Bytes::from(body.clone())).expect("small"),
                        attr: SetAttr::default(),
                    };
                    call(put.into()).await.expect("put");
                    let open = Open {
                        gfid,
                        access: AccessMode::ReadOnly,
                        flags: OpenFlags::empty(),
                    };
                    let Ok(FopReply::Open(o)) = call(open.into()).await else {
                        panic!("open")
                    };
                    let read = Read {
                        fd: o.fd,
                        offset: 0,
                        size: ReadSize::new(4096).expect("ok"),
                    };
                    let Ok(FopReply::Read(r)) = call(read.into()).await else {
                        panic!("read")
                    };
                    assert_eq!(r.data.as_bytes(), body.as_bytes(), "session {t} file {i}");
                    call(Release { fd: o.fd }.into()).await.expect("release");
                    // Move every other file into the session's own directory, drop the rest.
                    if i % 2 == 0 {
                        let rename = Rename {
                            old_parent: shared,
                            old_name: name(&format!("f-{t}-{i}")),
                            new_parent: own,
                            new_name: name(&format!("g{i}")),
                            mode: RenameMode::Replace,
                        };
                        call(rename.into()).await.expect("rename");
                    } else {
                        call(
                            Unlink {
                                parent: shared,
                                name: name(&format!("f-{t}-{i}")),
                            }
                            .into(),
                        )
                        .await
                        .expect("unlink");
                    }
                }
            });
        }
        while let Some(done) = tasks.join_next().await {
            done.expect("a session task panicked");
        }
    });
    assert!(
        h.list(shared).expect("list").is_empty(),
        "every shared file was moved or removed"
    );
    for t in 0..SESSIONS {
        let own = h
            .lookup(Gfid::ROOT, &format!("own{t}"))
            .expect("own dir")
            .gfid;
        let names: BTreeSet<String> = h.list(own).expect("list").into_iter().collect();
        let expected: BTreeSet<String> = (0..FILES_PER_SESSION)
            .filter(|i| i % 2 == 0)
            .map(|i| format!("g{i}"))
            .collect();
        assert_eq!(names, expected, "session {t}");
        let g0 = h.lookup(own, "g0").expect("g0").gfid;
        assert_eq!(
            h.read_all(g0).expect("read"),
            format!("session {t} file 0").as_bytes()
        );
    }
    h.assert_consistent();
}

/// A LINK of a file racing with the UNLINK of its last name, from two sessions (two workers
/// on the io_uring engine): either order may win, but a LINK that succeeded leaves a named
/// file reachable by its GFID (its handle in place), and the brick checks clean.
fn links_racing_unlinks_of_the_last_name_keep_the_file_whole(kind: EngineKind) {
    const ROUNDS: usize = 150;
    let h = Harness::new(kind);
    let (a, b) = (h.engine.session(), h.engine.session());
    let mut file = h.put(Gfid::ROOT, "n0", b"x").expect("put");
    let mut linked_in_time = 0;
    for i in 0..ROUNDS {
        let (old, new) = (format!("n{i}"), format!("n{}", i + 1));
        let link = Link {
            gfid: file,
            new_parent: Gfid::ROOT,
            new_name: name(&new),
        };
        let unlink = Unlink {
            parent: Gfid::ROOT,
            name: name(&old),
        };
        let (linked, unlinked) = h.rt.block_on(async {
            tokio::join!(a.call(root(), link.into()), b.call(root(), unlink.into()))
        });
        unlinked.expect("the unlink of the old name");
        match linked {
            Ok(_) => {
                linked_in_time += 1;
                let st = h.stat(file).expect("a linked file keeps its handle");
                assert_eq!((st.nlink, st.gfid), (1, file), "round {i}");
                assert_eq!(h.lookup(Gfid::ROOT, &new).expect("new name").gfid, file);
            }
            // The unlink won: the file is gone, and with it its handle.
            Err(ErrorCode::NoEnt | ErrorCode::Stale) => {
                file = h.put(Gfid::ROOT, &new, b"x").expect("put again");
            }
            Err(e) => panic!("round {i}: {e}"),
        }
    }
    assert!(linked_in_time > 0, "no LINK ever won the race");
    h.assert_consistent();
}

/// The `round`th create of `n` in `parent` with identity `gfid`: a MKDIR, a PUT or a CREATE
/// (`EXCL`), in turn.
fn create_in(parent: Gfid, round: usize, n: &str, gfid: Gfid) -> FopRequest {
    match round % 3 {
        0 => Mkdir {
            parent,
            name: name(n),
            gfid,
            mode: mode(0o755),
            umask: mode(0),
        }
        .into(),
        1 => small_put(parent, n, gfid, b"x").into(),
        _ => Create {
            parent,
            name: name(n),
            gfid,
            access: AccessMode::WriteOnly,
            flags: OpenFlags::EXCL,
            mode: mode(0o644),
            umask: mode(0),
        }
        .into(),
    }
}

/// Creates (MKDIR, PUT, CREATE) racing with LOOKUPs of their names from another session: a
/// lookup between a new name and its handle finds the handle missing and makes it, and the
/// create must still succeed — its object reachable by its GFID, and the brick clean. (It
/// failed with EEXIST and undid itself, leaving the handle the lookup made without a name.)
fn creates_racing_lookups_of_their_names_succeed(kind: EngineKind) {
    const ROUNDS: usize = 300;
    let h = Harness::new(kind);
    let (maker, looker) = (h.engine.session(), h.engine.session());
    let mut seen_before_the_reply = 0;
    for i in 0..ROUNDS {
        let (n, gfid) = (format!("n{i}"), h.gfid());
        let make = create_in(Gfid::ROOT, i, &n, gfid);
        let lookup = Lookup {
            parent: Gfid::ROOT,
            name: name(&n),
        };
        let replied = std::sync::atomic::AtomicBool::new(false);
        let (made, seen) = h.rt.block_on(async {
            let make = async {
                let made = maker.call(root(), make).await;
                replied.store(true, std::sync::atomic::Ordering::Release);
                made
            };
            let look = async {
                let mut seen = false;
                while !replied.load(std::sync::atomic::Ordering::Acquire) {
                    seen |= looker.call(root(), lookup.clone().into()).await.is_ok();
                }
                seen
            };
            tokio::join!(make, look)
        });
        made.unwrap_or_else(|e| panic!("round {i}: {e}"));
        seen_before_the_reply += usize::from(seen);
        assert_eq!(
            h.lookup(Gfid::ROOT, &n).expect("named").gfid,
            gfid,
            "round {i}"
        );
        assert_eq!(h.stat(gfid).expect("by its handle").gfid, gfid, "round {i}");
    }
    assert!(
        seen_before_the_reply > 0,
        "no lookup ever found a name before its create replied"
    );
    h.assert_consistent();
}

/// UNLINK, RMDIR and RENAME racing with LOOKUPs of the names they change, from another
/// session (another worker on the io_uring engine): whatever order the lookups saw, the names
/// end as the fops left them, a renamed object stays reachable by its GFID, a removed one
/// does not (not even through a worker that held the directory open), and the brick checks
/// clean.
fn removals_and_renames_racing_lookups_leave_the_brick_clean(kind: EngineKind) {
    const ROUNDS: usize = 300;
    let h = Harness::new(kind);
    let (changer, looker) = (h.engine.session(), h.engine.session());
    for i in 0..ROUNDS {
        let (n, moved) = (format!("n{i}"), format!("m{i}"));
        let (gfid, change): (Gfid, FopRequest) = match i % 3 {
            0 => {
                let gfid = h.put(Gfid::ROOT, &n, b"x").expect("put");
                let unlink = Unlink {
                    parent: Gfid::ROOT,
                    name: name(&n),
                };
                (gfid, unlink.into())
            }
            1 => {
                let gfid = h.mkdir(Gfid::ROOT, &n).expect("mkdir");
                // Held open by the harness session's worker from here.
                assert_eq!(h.lookup(gfid, "inside"), Err(ErrorCode::NoEnt));
                let rmdir = Rmdir {
                    parent: Gfid::ROOT,
                    name: name(&n),
                };
                (gfid, rmdir.into())
            }
            _ => {
                let gfid = h.put(Gfid::ROOT, &n, b"x").expect("put");
                let rename = Rename {
                    old_parent: Gfid::ROOT,
                    old_name: name(&n),
                    new_parent: Gfid::ROOT,
                    new_name: name(&moved),
                    mode: RenameMode::Replace,
                };
                (gfid, rename.into())
            }
        };
        let lookups = [&n, &moved].map(|n| Lookup {
            parent: Gfid::ROOT,
            name: name(n),
        });
        let replied = std::sync::atomic::AtomicBool::new(false);
        let changed = h.rt.block_on(async {
            let change = async {
                let changed = changer.call(root(), change).await;
                replied.store(true, std::sync::atomic::Ordering::Release);
                changed
            };
            let look = async {
                while !replied.load(std::sync::atomic::Ordering::Acquire) {
                    for lookup in &lookups {
                        let _ = looker.call(root(), lookup.clone().into()).await;
                    }
                }
            };
            tokio::join!(change, look).0
        });
        changed.unwrap_or_else(|e| panic!("round {i}: {e}"));
        assert!(h.lookup(Gfid::ROOT, &n).is_err(), "round {i}: {n} left");
        match i % 3 {
            2 => assert_eq!(h.stat(gfid).expect("moved").gfid, gfid, "round {i}"),
            _ => assert!(h.stat(gfid).is_err(), "round {i}: removed, yet reachable"),
        }
    }
    h.assert_consistent();
}

/// Two sessions create one name at once (MKDIR, PUT, CREATE, each with its own GFID): one
/// wins, the other gets EEXIST and leaves nothing of its object behind — the name holds the
/// winner, the loser's GFID reaches nothing, and the brick checks clean.
fn creates_of_one_name_from_two_sessions_make_one_object(kind: EngineKind) {
    const ROUNDS: usize = 150;
    let h = Harness::new(kind);
    let sessions = [h.engine.session(), h.engine.session()];
    for i in 0..ROUNDS {
        let n = format!("n{i}");
        let gfids = [h.gfid(), h.gfid()];
        let make = |gfid| create_in(Gfid::ROOT, i, &n, gfid);
        let results = h.rt.block_on(async {
            let [a, b] = &sessions;
            let (ra, rb) = tokio::join!(
                a.call(root(), make(gfids[0])),
                b.call(root(), make(gfids[1]))
            );
            [ra.map(drop), rb.map(drop)]
        });
        let won: Vec<usize> = (0..2).filter(|&k| results[k].is_ok()).collect();
        assert_eq!(won.len(), 1, "round {i}: {results:?}");
        let (winner, loser) = (gfids[won[0]], gfids[1 - won[0]]);
        assert_eq!(results[1 - won[0]], Err(ErrorCode::Exist), "round {i}");
        assert_eq!(
            h.lookup(Gfid::ROOT, &n).expect("named").gfid,
            winner,
            "round {i}"
        );
        assert_eq!(
            h.stat(winner).expect("the winner").gfid,
            winner,
            "round {i}"
        );
        assert!(
            h.stat(loser).is_err(),
            "round {i}: the loser's object is reachable"
        );
    }
    h.assert_consistent();
}

/// A directory renamed back and forth while another session creates files inside it by its
/// GFID: every create succeeds (a directory's GFID reaches it whatever its name), every file
/// is found under the directory's last name, and the brick checks clean.
fn creates_inside_a_directory_being_renamed_succeed(kind: EngineKind) {
    const ROUNDS: usize = 200;
    let h = Harness::new(kind);
    let dir = h.mkdir(Gfid::ROOT, "d0").expect("mkdir");
    let (renamer, maker) = (h.engine.session(), h.engine.session());
    for i in 0..ROUNDS {
        let rename = Rename {
            old_parent: Gfid::ROOT,
            old_name: name(&format!("d{}", i % 2)),
            new_parent: Gfid::ROOT,
            new_name: name(&format!("d{}", (i + 1) % 2)),
            mode: RenameMode::Replace,
        };
        let put = small_put(dir, &format!("f{i}"), h.gfid(), b"x");
        let (renamed, made) = h.rt.block_on(async {
            tokio::join!(
                renamer.call(root(), rename.into()),
                maker.call(root(), put.into())
            )
        });
        renamed.unwrap_or_else(|e| panic!("round {i}: rename: {e}"));
        made.unwrap_or_else(|e| panic!("round {i}: put: {e}"));
    }
    let last = format!("d{}", ROUNDS % 2);
    assert_eq!(h.lookup(Gfid::ROOT, &last).expect("renamed").gfid, dir);
    assert_eq!(h.list(dir).expect("list").len(), ROUNDS);
    h.assert_consistent();
}

/// Pairs of namespace fops on one name from two sessions at once — two renames of one source,
/// a replacing rename against an unlink of its target, a directory's rename against its
/// RMDIR, a MKDIR against an RMDIR — each fop succeeding or failing as POSIX allows for one
/// order or the other, the object left reachable by its GFID exactly when a name holds it,
/// and the brick clean after all.
fn namespace_fops_racing_on_one_name_leave_the_brick_clean(kind: EngineKind) {
    const ROUNDS: usize = 100;
    let h = Harness::new(kind);
    let (a, b) = (h.engine.session(), h.engine.session());
    let rename = |from: &str, to: &str| -> FopRequest {
        Rename {
            old_parent: Gfid::ROOT,
            old_name: name(from),
            new_parent: Gfid::ROOT,
            new_name: name(to),
            mode: RenameMode::Replace,
        }
        .into()
    };
    let unlink = |n: &str| -> FopRequest {
        Unlink {
            parent: Gfid::ROOT,
            name: name(n),
        }
        .into()
    };
    let rmdir = |n: &str| -> FopRequest {
        Rmdir {
            parent: Gfid::ROOT,
            name: name(n),
        }
        .into()
    };
    let race = |x: FopRequest, y: FopRequest| {
        h.rt.block_on(async { tokio::join!(a.call(root(), x), b.call(root(), y)) })
    };
    let named = |n: &str| h.lookup(Gfid::ROOT, n).ok().map(|iatt| iatt.gfid);
    for i in 0..ROUNDS {
        let (s, t, u) = (format!("s{i}"), format!("t{i}"), format!("u{i}"));
        // Two renames of one source: one moves it, the other finds it gone.
        let file = h.put(Gfid::ROOT, &s, b"x").expect("put");
        let (x, y) = race(rename(&s, &t), rename(&s, &u));
        assert!(x.is_ok() != y.is_ok(), "round {i}: {x:?} {y:?}");
        assert_eq!(
            [named(&s), named(&t), named(&u)].iter().flatten().count(),
            1
        );
        assert_eq!(h.stat(file).expect("moved once").gfid, file, "round {i}");
        for n in [&t, &u] {
            let _ = h.unlink(Gfid::ROOT, n);
        }
        // A rename onto a name another session unlinks meanwhile.
        let (src, target) = (
            h.put(Gfid::ROOT, &s, b"s").expect("put"),
            h.put(Gfid::ROOT, &t, b"t").expect("put"),
        );
        let (x, y) = race(rename(&s, &t), unlink(&t));
        x.unwrap_or_else(|e| panic!("round {i}: rename: {e}"));
        match (y, named(&t)) {
            // The unlink came first, or removed what the rename had put there.
            (Ok(_), Some(g)) => assert_eq!(g, src, "round {i}"),
            (Ok(_), None) => assert!(h.stat(src).is_err(), "round {i}: unnamed, yet reachable"),
            (Err(e), _) => panic!("round {i}: unlink: {e}"),
        }
        assert!(
            h.stat(target).is_err(),
            "round {i}: the replaced file is reachable"
        );
        let _ = h.unlink(Gfid::ROOT, &t);
        // A directory's rename against its RMDIR: one of them wins.
        let dir = h.mkdir(Gfid::ROOT, &s).expect("mkdir");
        let (x, y) = race(rename(&s, &t), rmdir(&s));
        assert!(x.is_ok() != y.is_ok(), "round {i}: {x:?} {y:?}");
        match x.is_ok() {
            true => assert_eq!(named(&t), Some(dir), "round {i}"),
            false => assert!(h.stat(dir).is_err(), "round {i}: removed, yet reachable"),
        }
        let _ = h.rmdir(Gfid::ROOT, &t);
        // A MKDIR against an RMDIR of the same name.
        let (x, y) = race(
            Mkdir {
                parent: Gfid::ROOT,
                name: name(&u),
                gfid: h.gfid(),
                mode: mode(0o755),
                umask: mode(0),
            }
            .into(),
            rmdir(&u),
        );
        x.unwrap_or_else(|e| panic!("round {i}: mkdir: {e}"));
        assert_eq!(named(&u).is_some(), y.is_err(), "round {i}: {y:?}");
        let _ = h.rmdir(Gfid::ROOT, &u);
    }
    assert!(h.list(Gfid::ROOT).expect("list").is_empty());
    h.assert_consistent();
}

/// Directories renamed back and forth while another session stats them, and a directory
/// inside each, by GFID, with a held-directory cache too small to keep them (so each stat may
/// find its directory through the handle a rename is replacing, its own or its parent's):
/// every stat finds its directory.
fn directories_being_renamed_stay_reachable_by_their_gfids(kind: EngineKind) {
    const DIRS: usize = 64;
    const ROUNDS: usize = 20;
    let small_cache = FopsConfig {
        dirfd_cache_entries: std::num::NonZeroUsize::new(16).expect("not zero"),
        ..FopsConfig::default()
    };
    let h = Harness::with(kind, small_cache);
    let moved: Vec<Gfid> = (0..DIRS)
        .map(|k| h.mkdir(Gfid::ROOT, &format!("a{k}")).expect("mkdir"))
        .collect();
    // And a directory inside each, found through its parent's handle.
    let inner: Vec<Gfid> = (moved.iter())
        .map(|&parent| h.mkdir(parent, "inner").expect("mkdir"))
        .collect();
    let dirs: Vec<Gfid> = moved.iter().chain(&inner).copied().collect();
    let (renamer, stater) = (h.engine.session(), h.engine.session());
    for round in 0..ROUNDS {
        let (from, to) = match round % 2 {
            0 => ("a", "b"),
            _ => ("b", "a"),
        };
        let renames = async {
            for k in 0..DIRS {
                let rename = Rename {
                    old_parent: Gfid::ROOT,
                    old_name: name(&format!("{from}{k}")),
                    new_parent: Gfid::ROOT,
                    new_name: name(&format!("{to}{k}")),
                    mode: RenameMode::Replace,
                };
                renamer.call(root(), rename.into()).await.expect("rename");
            }
        };
        let stats = async {
            let mut failed = Vec::new();
            for &gfid in dirs.iter().chain(&dirs) {
                if let Err(e) = stater.call(root(), Stat { gfid }.into()).await {
                    failed.push(e);
                }
            }
            failed
        };
        let ((), failed) = h.rt.block_on(async { tokio::join!(renames, stats) });
        assert!(failed.is_empty(), "round {round}: {failed:?}");
    }
    h.assert_consistent();
}

/// Two directories each renamed into the other at once, from two sessions: one rename wins,
/// the other is refused (a directory cannot move below itself), both stay reachable from the
/// root by name and by GFID, and the brick checks clean.
fn directories_renamed_into_each_other_never_make_a_loop(kind: EngineKind) {
    const ROUNDS: usize = 100;
    let h = Harness::new(kind);
    let (a, b) = (h.engine.session(), h.engine.session());
    let (da, db) = (
        h.mkdir(Gfid::ROOT, "a").expect("mkdir"),
        h.mkdir(Gfid::ROOT, "b").expect("mkdir"),
    );
    let into = |dir: &str, parent: Gfid| -> FopRequest {
        Rename {
            old_parent: Gfid::ROOT,
            old_name: name(dir),
            new_parent: parent,
            new_name: name(dir),
            mode: RenameMode::Replace,
        }
        .into()
    };
    for i in 0..ROUNDS {
        let (x, y) = h.rt.block_on(async {
            tokio::join!(a.call(root(), into("a", db)), b.call(root(), into("b", da)))
        });
        assert!(x.is_ok() != y.is_ok(), "round {i}: {x:?} {y:?}");
        let (moved, (outer, outer_gfid), (inner, inner_gfid)) = match x.is_ok() {
            true => ("a", ("b", db), ("a", da)),
            false => ("b", ("a", da), ("b", db)),
        };
        let refused = if x.is_ok() { y } else { x };
        assert_eq!(refused, Err(ErrorCode::Inval), "round {i}: moving {moved}");
        assert_eq!(h.lookup(Gfid::ROOT, outer).expect("outer").gfid, outer_gfid);
        assert_eq!(h.lookup(outer_gfid, inner).expect("inner").gfid, inner_gfid);
        for gfid in [da, db] {
            assert_eq!(h.stat(gfid).expect("reachable").gfid, gfid, "round {i}");
        }
        h.rename(outer_gfid, inner, Gfid::ROOT, inner, RenameMode::Replace)
            .unwrap_or_else(|e| panic!("round {i}: moving {inner} back: {e}"));
    }
    h.assert_consistent();
}

/// Fops that make or move something into a directory racing with its RMDIR, from two
/// sessions: either the fop wins and the RMDIR finds the directory not empty, or the RMDIR
/// wins and the fop fails — never both, so nothing is left inside a removed directory — and
/// the brick checks clean.
fn fops_into_a_directory_racing_its_rmdir_leave_nothing_behind(kind: EngineKind) {
    const ROUNDS: usize = 150;
    let h = Harness::new(kind);
    let (a, b) = (h.engine.session(), h.engine.session());
    let mut fop_won = 0;
    for i in 0..ROUNDS {
        let dir = h.mkdir(Gfid::ROOT, "p").expect("mkdir");
        let (made, gfid) = (format!("x{i}"), h.gfid());
        let fop: FopRequest = match i % 4 {
            // A MKDIR, a PUT.
            k @ (0 | 1) => create_in(dir, k, &made, gfid),
            2 => {
                h.put(Gfid::ROOT, &made, b"x").expect("put");
                rename_into(dir, &made)
            }
            _ => {
                h.mkdir(Gfid::ROOT, &made).expect("mkdir");
                rename_into(dir, &made)
            }
        };
        let rmdir = Rmdir {
            parent: Gfid::ROOT,
            name: name("p"),
        };
        let (x, y) = h
            .rt
            .block_on(async { tokio::join!(a.call(root(), fop), b.call(root(), rmdir.into())) });
        assert!(x.is_ok() != y.is_ok(), "round {i}: {x:?} {y:?}");
        match y {
            Ok(_) => assert!(h.stat(dir).is_err(), "round {i}: removed, yet reachable"),
            Err(e) => {
                assert_eq!(e, ErrorCode::NotEmpty, "round {i}");
                fop_won += 1;
                let inside = h.lookup(dir, &made).expect("made inside");
                match inside.file_type {
                    FileType::Directory => h.rmdir(dir, &made),
                    _ => h.unlink(dir, &made),
                }
                .unwrap_or_else(|e| panic!("round {i}: clearing: {e}"));
                h.rmdir(Gfid::ROOT, "p").expect("rmdir");
            }
        }
        // What a refused rename was to move is still where it was.
        if i % 4 >= 2 && y.is_ok() {
            let left = h.lookup(Gfid::ROOT, &made).expect("still in the root");
            match left.file_type {
                FileType::Directory => h.rmdir(Gfid::ROOT, &made),
                _ => h.unlink(Gfid::ROOT, &made),
            }
            .expect("clearing");
        }
    }
    assert!(fop_won > 0, "no fop ever won the race");
    assert!(h.list(Gfid::ROOT).expect("list").is_empty());
    h.assert_consistent();
}

/// A RENAME of the root's `n` into `parent` under the same name.
fn rename_into(parent: Gfid, n: &str) -> FopRequest {
    Rename {
        old_parent: Gfid::ROOT,
        old_name: name(n),
        new_parent: parent,
        new_name: name(n),
        mode: RenameMode::Replace,
    }
    .into()
}
