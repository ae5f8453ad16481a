//! Directory leases and BATCH on the engine (`docs/wire.md`, "Leases"), per engine: the grant
//! rules, a conflicting fop held until the holder gives its lease back (the holder told by a
//! RECALL), revocation after the timeout and ESTALE for the changes of a write lease's holder
//! until it asks again (a read lease's holder goes on as anyone), leases
//! dropped with their session and their directory, and BATCH's order and per-fop results.
//! Every wait is bounded.

mod common;

use std::future::Future;
use std::time::{Duration, Instant};

use common::*;
use kiln_dataplane::leases::{LeaseSettings, RecallEvents};
use kiln_dataplane::{EngineKind, FopsConfig, Session};
use kiln_wire::*;

per_engine!(
    grants_follow_the_rules,
    a_conflicting_fop_waits_until_the_holder_gives_the_lease_back,
    an_fd_fop_conflicts_through_its_fd,
    a_holder_that_does_not_answer_is_revoked_and_gets_estale_until_it_asks_again,
    a_session_end_releases_its_leases,
    a_removed_directory_takes_its_leases_along,
    batch_runs_in_order_and_answers_each_fop,
    leases_off_answers_none_and_switches_live,
    opendir_list_takes_its_lease_before_it_lists,
    a_change_to_a_listed_object_recalls_the_lease_it_was_listed_under,
    a_file_s_read_lease_is_recalled_before_another_session_changes_the_file,
);

/// How long a bounded wait may take before the test fails.
const BOUND: Duration = Duration::from_secs(10);
/// How long a held fop must stay held to count as held.
const HELD: Duration = Duration::from_millis(200);

fn harness(kind: EngineKind, recall_timeout: Duration) -> Harness {
    let leases = LeaseSettings {
        enabled: true,
        recall_timeout,
        contention: Duration::ZERO,
    };
    Harness::with(
        kind,
        FopsConfig {
            leases,
            ..FopsConfig::default()
        },
    )
}

async fn bounded<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(BOUND, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: not done within {BOUND:?}"),
    }
}

async fn lease(s: &Session, gfid: Gfid, kind: LeaseKind) -> Result<LeaseKind, ErrorCode> {
    match s.call(root(), Lease { gfid, kind }.into()).await? {
        FopReply::Lease(r) => Ok(r.kind),
        other => panic!("LEASE answered {other:?}"),
    }
}

fn lookup(parent: Gfid, n: &str) -> FopRequest {
    Lookup {
        parent,
        name: name(n),
    }
    .into()
}

fn put(h: &Harness, parent: Gfid, n: &str) -> FopRequest {
    small_put(parent, n, h.gfid(), b"data").into()
}

fn mkdir(h: &Harness, parent: Gfid, n: &str) -> (Gfid, FopRequest) {
    let gfid = h.gfid();
    let fop = Mkdir {
        parent,
        name: name(n),
        gfid,
        mode: mode(0o755),
        umask: mode(0),
    };
    (gfid, fop.into())
}

/// The next RECALL on `events`, within the bound.
async fn recall(events: &mut RecallEvents) -> Recall {
    bounded("a RECALL", events.recv())
        .await
        .expect("the event queue is open")
}

/// Asserts that `fop` is still held after [`HELD`].
async fn still_held<F: Future + Unpin>(what: &str, fop: &mut F) {
    if tokio::time::timeout(HELD, fop).await.is_ok() {
        panic!("{what} ran while a conflicting lease was out");
    }
}

fn grants_follow_the_rules(kind: EngineKind) {
    let h = harness(kind, BOUND);
    let d = h.mkdir(Gfid::ROOT, "d").expect("mkdir");
    let f = h.put(d, "f", b"x").expect("put");
    let (a, _qa) = h.engine.lease_session();
    let (b, _qb) = h.engine.lease_session();
    let plain = h.engine.session();
    let leases = h.engine.leases();
    h.rt.block_on(async {
        assert!(!leases.is_armed(), "no lease: fops pass unchecked");
        assert_eq!(lease(&a, d, LeaseKind::Read).await, Ok(LeaseKind::Read));
        assert!(leases.is_armed());
        assert_eq!(lease(&b, d, LeaseKind::Read).await, Ok(LeaseKind::Read));
        assert_eq!(
            lease(&b, d, LeaseKind::Write).await,
            Ok(LeaseKind::Read),
            "no write lease while another session reads"
        );
        assert_eq!(lease(&a, d, LeaseKind::None).await, Ok(LeaseKind::None));
        assert_eq!(lease(&b, d, LeaseKind::Write).await, Ok(LeaseKind::Write));
        assert_eq!(lease(&a, d, LeaseKind::Read).await, Ok(LeaseKind::None));
        assert_eq!(lease(&b, d, LeaseKind::Read).await, Ok(LeaseKind::Read));
        assert_eq!(lease(&b, d, LeaseKind::None).await, Ok(LeaseKind::None));
        assert!(!leases.is_armed(), "every lease back: unchecked again");
        assert_eq!(lease(&a, f, LeaseKind::Read).await, Ok(LeaseKind::Read));
        assert_eq!(
            lease(&a, f, LeaseKind::Write).await,
            Err(ErrorCode::Inval),
            "a file's lease is a read lease"
        );
        assert_eq!(lease(&a, f, LeaseKind::None).await, Ok(LeaseKind::None));
        let link = Symlink {
            parent: d,
            name: name("link"),
            gfid: h.gfid(),
            target: SymlinkTarget::new("f".to_owned()).expect("target"),
        };
        let FopReply::Symlink(link) = a.call(root(), link.into()).await.expect("symlink") else {
            panic!("SYMLINK reply")
        };
        assert_eq!(
            lease(&a, link.iatt.gfid, LeaseKind::Read).await,
            Err(ErrorCode::NotDir),
            "a lease is on a directory or a regular file"
        );
        assert_eq!(
            lease(&a, h.gfid(), LeaseKind::Read).await,
            Err(ErrorCode::Stale)
        );
        assert_eq!(
            lease(&plain, d, LeaseKind::Read).await,
            Err(ErrorCode::NotSupported),
            "a session that did not negotiate leases"
        );
        let batch = Batch::new(root());
        assert_eq!(plain.batch(batch).await, Err(ErrorCode::NotSupported));
    });
    assert_eq!(leases.stats().grants, 4);
    assert_eq!(leases.stats().held, 0);
}

fn a_conflicting_fop_waits_until_the_holder_gives_the_lease_back(kind: EngineKind) {
    let h = harness(kind, BOUND);
    let d = h.mkdir(Gfid::ROOT, "d").expect("mkdir");
    let (a, mut events) = h.engine.lease_session();
    let (b, _qb) = h.engine.lease_session();
    let put_d = put(&h, d, "new");
    h.rt.block_on(async {
        assert_eq!(lease(&a, d, LeaseKind::Read).await, Ok(LeaseKind::Read));
        // A read lease shares reads: no recall.
        let found = b.call(root(), lookup(d, "missing")).await;
        assert_eq!(found, Err(ErrorCode::NoEnt));
        assert!(
            events.try_recv().is_err(),
            "a read conflicts with no read lease"
        );
        // A change is held until the lease is back.
        let mut change = Box::pin(b.call(root(), put_d));
        still_held("a PUT under another session's read lease", &mut change).await;
        assert_eq!(
            recall(&mut events).await,
            Recall {
                gfid: d,
                kind: LeaseKind::None
            }
        );
        // The holder may still work in its directory while it flushes.
        let own = a.call(root(), lookup(d, "missing")).await;
        assert_eq!(own, Err(ErrorCode::NoEnt), "the holder's own fops pass");
        still_held("the PUT", &mut change).await;
        assert_eq!(lease(&a, d, LeaseKind::None).await, Ok(LeaseKind::None));
        bounded("the held PUT", change).await.expect("put");
        assert!(events.try_recv().is_err(), "one recall");
    });
    assert_eq!(h.lookup(d, "new").map(|_| ()), Ok(()));
    let stats = h.engine.leases().stats();
    assert_eq!((stats.recalls, stats.returns, stats.waits), (1, 1, 1));
}

fn an_fd_fop_conflicts_through_its_fd(kind: EngineKind) {
    let h = harness(kind, BOUND);
    let d = h.mkdir(Gfid::ROOT, "d").expect("mkdir");
    h.put(d, "f", b"x").expect("put");
    let (a, mut events) = h.engine.lease_session();
    let (b, _qb) = h.engine.lease_session();
    h.rt.block_on(async {
        // Opened before any lease: the fd is the only thing that names d later.
        let FopReply::Opendir(o) = b
            .call(root(), Opendir { gfid: d }.into())
            .await
            .expect("opendir")
        else {
            panic!("OPENDIR reply")
        };
        assert_eq!(lease(&a, d, LeaseKind::Write).await, Ok(LeaseKind::Write));
        let size = ReaddirSize::new(4096).expect("size");
        let readdir = Readdir {
            fd: o.fd,
            offset: 0,
            size,
        };
        let mut list = Box::pin(b.call(root(), readdir.into()));
        still_held("a READDIR under another session's write lease", &mut list).await;
        assert_eq!(recall(&mut events).await.gfid, d);
        assert_eq!(lease(&a, d, LeaseKind::Read).await, Ok(LeaseKind::Read));
        // A read lease does not conflict with reading: the downgrade is enough.
        let FopReply::Readdir(r) = bounded("the held READDIR", list).await.expect("readdir") else {
            panic!("READDIR reply")
        };
        assert!(r.entries.iter().any(|e| e.name.as_bytes() == b"f"));
    });
}

fn a_holder_that_does_not_answer_is_revoked_and_gets_estale_until_it_asks_again(kind: EngineKind) {
    let timeout = Duration::from_millis(300);
    let h = harness(kind, timeout);
    let d = h.mkdir(Gfid::ROOT, "d").expect("mkdir");
    let e = h.mkdir(Gfid::ROOT, "e").expect("mkdir");
    let (a, mut events) = h.engine.lease_session();
    let (b, _qb) = h.engine.lease_session();
    h.rt.block_on(async {
        assert_eq!(lease(&a, d, LeaseKind::Write).await, Ok(LeaseKind::Write));
        assert_eq!(lease(&a, e, LeaseKind::Write).await, Ok(LeaseKind::Write));
        let start = Instant::now();
        let found = bounded(
            "a LOOKUP held by a silent holder",
            b.call(root(), lookup(d, "x")),
        )
        .await;
        assert_eq!(found, Err(ErrorCode::NoEnt), "it ran after the revocation");
        assert!(
            start.elapsed() >= timeout - Duration::from_millis(20),
            "it waited for the recall to run out ({:?})",
            start.elapsed()
        );
        assert_eq!(recall(&mut events).await.gfid, d);
        // The holder's changes in d fail; its reads there, and its changes elsewhere, work.
        let (_, mkdir_d) = mkdir(&h, d, "late");
        assert_eq!(
            a.call(root(), mkdir_d).await.map(drop),
            Err(ErrorCode::Stale),
            "a change meant for under the lease fails instead of landing late"
        );
        assert_eq!(a.call(root(), lookup(d, "x")).await, Err(ErrorCode::NoEnt));
        a.call(root(), Stat { gfid: d }.into()).await.expect("stat");
        let (_, mkdir_e) = mkdir(&h, e, "sub");
        a.call(root(), mkdir_e).await.expect("a change elsewhere");
        // Asking again (any kind) ends it.
        assert_eq!(lease(&a, d, LeaseKind::None).await, Ok(LeaseKind::None));
        let (_, again) = mkdir(&h, d, "again");
        a.call(root(), again).await.expect("mkdir once asked again");
    });
    assert!(h.lookup(d, "late").is_err(), "the late MKDIR never ran");
    let stats = h.engine.leases().stats();
    assert_eq!((stats.revocations, stats.held), (1, 1));
}

fn a_session_end_releases_its_leases(kind: EngineKind) {
    let h = harness(kind, BOUND);
    let d = h.mkdir(Gfid::ROOT, "d").expect("mkdir");
    let (a, mut events) = h.engine.lease_session();
    let (b, _qb) = h.engine.lease_session();
    let (_, mkdir_d) = mkdir(&h, d, "sub");
    h.rt.block_on(async {
        assert_eq!(lease(&a, d, LeaseKind::Write).await, Ok(LeaseKind::Write));
        let mut change = Box::pin(b.call(root(), mkdir_d));
        still_held("a MKDIR under another session's write lease", &mut change).await;
        assert_eq!(recall(&mut events).await.gfid, d);
        drop(a);
        bounded("the MKDIR after the holder's session ended", change)
            .await
            .expect("mkdir");
    });
    assert_eq!(h.engine.leases().stats().held, 0);
    assert!(!h.engine.leases().is_armed());
}

fn a_removed_directory_takes_its_leases_along(kind: EngineKind) {
    let h = harness(kind, BOUND);
    let d = h.mkdir(Gfid::ROOT, "d").expect("mkdir");
    let sub = h.mkdir(d, "sub").expect("mkdir");
    let target = h.mkdir(d, "target").expect("mkdir");
    h.mkdir(d, "source").expect("mkdir");
    let (a, _qa) = h.engine.lease_session();
    let (b, mut events_b) = h.engine.lease_session();
    let rmdir = Rmdir {
        parent: d,
        name: name("sub"),
    };
    let rename = Rename {
        old_parent: d,
        old_name: name("source"),
        new_parent: d,
        new_name: name("target"),
        mode: RenameMode::Replace,
    };
    h.rt.block_on(async {
        // Its own lease does not hold the remover back; the removal ends it.
        assert_eq!(lease(&a, sub, LeaseKind::Read).await, Ok(LeaseKind::Read));
        a.call(root(), rmdir.into()).await.expect("rmdir");
        assert_eq!(h.engine.leases().stats().held, 0);
        assert_eq!(lease(&a, sub, LeaseKind::Read).await, Err(ErrorCode::Stale));
        // Another session's lease on the directory a RENAME replaces is recalled first.
        assert_eq!(
            lease(&b, target, LeaseKind::Read).await,
            Ok(LeaseKind::Read)
        );
        let mut replace = Box::pin(a.call(root(), rename.into()));
        still_held("a RENAME over a leased directory", &mut replace).await;
        assert_eq!(recall(&mut events_b).await.gfid, target);
        assert_eq!(
            lease(&b, target, LeaseKind::None).await,
            Ok(LeaseKind::None)
        );
        bounded("the held RENAME", replace).await.expect("rename");
    });
    assert_eq!(h.engine.leases().stats().held, 0);
    assert!(!h.engine.leases().is_armed());
}

fn batch_runs_in_order_and_answers_each_fop(kind: EngineKind) {
    let h = harness(kind, BOUND);
    h.engine.profile().set(true, false);
    let (a, _qa) = h.engine.lease_session();
    let (d, mkdir_d) = mkdir(&h, Gfid::ROOT, "d");
    let (_, mkdir_again) = mkdir(&h, Gfid::ROOT, "d");
    let mut batch = Batch::new(root());
    for fop in [
        mkdir_d,
        mkdir_again,
        put(&h, d, "f"),
        lookup(d, "f"),
        Unlink {
            parent: d,
            name: name("missing"),
        }
        .into(),
        Lease {
            gfid: d,
            kind: LeaseKind::Write,
        }
        .into(),
        put(&h, d, "g"),
    ] {
        batch.push(fop).expect("batchable");
    }
    let reply =
        h.rt.block_on(bounded("a BATCH", a.batch(batch)))
            .expect("batch");
    let results = reply.results;
    assert_eq!(results.len(), 7, "one result per fop");
    assert!(
        matches!(results[0], Ok(FopReply::Mkdir(_))),
        "{:?}",
        results[0]
    );
    assert_eq!(results[1].clone().map(drop), Err(ErrorCode::Exist));
    let Ok(FopReply::Put(made)) = &results[2] else {
        panic!("PUT: {:?}", results[2])
    };
    let Ok(FopReply::Lookup(found)) = &results[3] else {
        panic!("LOOKUP after the PUT in the same batch: {:?}", results[3])
    };
    assert_eq!(found.iatt.gfid, made.iatt.gfid, "in order");
    assert_eq!(results[4].clone().map(drop), Err(ErrorCode::NoEnt));
    assert!(
        matches!(
            results[5],
            Ok(FopReply::Lease(LeaseReply {
                kind: LeaseKind::Write
            }))
        ),
        "{:?}",
        results[5]
    );
    assert!(
        matches!(results[6], Ok(FopReply::Put(_))),
        "a failure stops nothing"
    );
    let back = h.rt.block_on(lease(&a, d, LeaseKind::None));
    assert_eq!(back, Ok(LeaseKind::None));
    assert_eq!(h.list(d).expect("list"), ["f", "g"]);
    let report = h.engine.profile().report();
    let calls = |fop: &str| {
        report
            .fops
            .iter()
            .find(|f| f.fop == fop)
            .map_or(0, |f| f.calls)
    };
    assert_eq!(
        (
            calls("MKDIR"),
            calls("PUT"),
            calls("LOOKUP"),
            calls("UNLINK"),
            calls("LEASE")
        ),
        (2, 2, 1, 1, 2),
        "each batched fop counted as itself"
    );
}

fn leases_off_answers_none_and_switches_live(kind: EngineKind) {
    let h = harness(kind, BOUND);
    let d = h.mkdir(Gfid::ROOT, "d").expect("mkdir");
    let leases = h.engine.leases();
    let on = leases.settings();
    leases.set_settings(LeaseSettings {
        enabled: false,
        ..on
    });
    let (a, _qa) = h.engine.lease_session();
    h.rt.block_on(async {
        assert_eq!(lease(&a, d, LeaseKind::Write).await, Ok(LeaseKind::None));
        leases.set_settings(on);
        assert_eq!(lease(&a, d, LeaseKind::Write).await, Ok(LeaseKind::Write));
        leases.set_settings(LeaseSettings {
            enabled: false,
            ..on
        });
        assert_eq!(
            lease(&a, d, LeaseKind::Read).await,
            Ok(LeaseKind::None),
            "off: what is held is given back"
        );
    });
    assert_eq!(leases.stats().held, 0);
}

/// OPENDIR_LIST takes its lease before it reads the entries, answers the lease, the entries
/// and a working fd, and gives the lease back when it fails; it never lowers a lease the
/// session holds.
fn opendir_list_takes_its_lease_before_it_lists(kind: EngineKind) {
    let h = harness(kind, BOUND);
    let d = h.mkdir(Gfid::ROOT, "d").expect("mkdir");
    let e = h.mkdir(Gfid::ROOT, "e").expect("mkdir");
    h.put(d, "f", b"x").expect("put");
    let (closed, fop) = mkdir(&h, Gfid::ROOT, "closed");
    let FopRequest::Mkdir(fop) = fop else {
        unreachable!("a MKDIR")
    };
    let private = Mkdir {
        mode: mode(0o700),
        ..fop
    };
    h.call(&root(), private).expect("mkdir 0700");
    let (a, mut events) = h.engine.lease_session();
    let (b, _qb) = h.engine.lease_session();
    let size = ReaddirSize::new(4096).expect("size");
    let list = |gfid, lease| FopRequest::from(OpendirList { gfid, size, lease });
    let listed = async |gfid, lease| match a.call(root(), list(gfid, lease)).await {
        Ok(FopReply::OpendirList(r)) => r,
        other => panic!("OPENDIR_LIST answered {other:?}"),
    };
    h.rt.block_on(async {
        let r = listed(d, LeaseKind::Read).await;
        assert_eq!(r.lease, LeaseKind::Read);
        assert!(r.listing.eof);
        let names: Vec<String> = r
            .listing
            .entries
            .iter()
            .map(|e| e.name.to_string())
            .collect();
        assert!(names.iter().any(|n| n == "f"), "{names:?}");
        // The lease is held: another session's change there is recalled first.
        let mut change = Box::pin(b.call(root(), put(&h, d, "g")));
        still_held("a PUT under another session's read lease", &mut change).await;
        assert_eq!(recall(&mut events).await.gfid, d);
        assert_eq!(lease(&a, d, LeaseKind::None).await, Ok(LeaseKind::None));
        bounded("the held PUT", change).await.expect("put");
        // The fd is a directory fd of the session.
        let readdir = Readdir {
            fd: r.fd,
            offset: 0,
            size,
        };
        let FopReply::Readdir(again) = a.call(root(), readdir.into()).await.expect("readdir")
        else {
            panic!("READDIR reply")
        };
        assert!(again.entries.iter().any(|e| e.name.as_bytes() == b"g"));
        a.call(root(), Releasedir { fd: r.fd }.into())
            .await
            .expect("releasedir");

        // Refused (no read permission): no fd, and the lease it took is given back, so
        // another session gets the write lease at once.
        let refused = a.call(user(4242), list(closed, LeaseKind::Read)).await;
        assert_eq!(refused.err(), Some(ErrorCode::Access));
        assert_eq!(
            lease(&b, closed, LeaseKind::Write).await,
            Ok(LeaseKind::Write)
        );
        // Without a lease asked, none is taken.
        assert_eq!(listed(d, LeaseKind::None).await.lease, LeaseKind::None);
        assert_eq!(lease(&b, d, LeaseKind::Write).await, Ok(LeaseKind::Write));

        // A lease the session holds is never lowered by a listing's: a write lease a LEASE
        // took beside it stays, and the listing says it took none.
        assert_eq!(lease(&a, e, LeaseKind::Write).await, Ok(LeaseKind::Write));
        assert_eq!(listed(e, LeaseKind::Read).await.lease, LeaseKind::None);
        assert_eq!(
            lease(&b, e, LeaseKind::Read).await,
            Ok(LeaseKind::None),
            "the write lease is in the way"
        );
    });
}

/// A lease covers what a listing under it returned (`docs/wire.md`, "Listed attributes"):
/// another session's change to a listed file — its mode, a new name for it, an `O_TRUNC`
/// open — or to a listed subdirectory's entries is held until the lease is back; a look at
/// one, or the holder's own change, is not.
fn a_change_to_a_listed_object_recalls_the_lease_it_was_listed_under(kind: EngineKind) {
    let h = harness(kind, BOUND);
    let d = h.mkdir(Gfid::ROOT, "d").expect("mkdir");
    let f = h.put(d, "f", b"x").expect("put");
    let sub = h.mkdir(d, "s").expect("mkdir");
    let (a, mut events) = h.engine.lease_session();
    let (b, _qb) = h.engine.lease_session();
    let size = ReaddirSize::new(4096).expect("size");
    let list = || async {
        let fop = OpendirList {
            gfid: d,
            size,
            lease: LeaseKind::Read,
        };
        match a.call(root(), fop.into()).await {
            Ok(FopReply::OpendirList(r)) => {
                assert_eq!(r.lease, LeaseKind::Read, "granted");
                a.call(root(), Releasedir { fd: r.fd }.into())
                    .await
                    .expect("releasedir");
            }
            other => panic!("OPENDIR_LIST answered {other:?}"),
        }
    };
    let chmod = |gfid| -> FopRequest {
        let attr = SetAttr {
            mode: Some(mode(0o600)),
            ..SetAttr::default()
        };
        Setattr { gfid, attr }.into()
    };
    let changes: [(&str, FopRequest); 6] = [
        ("a SETATTR of a listed file", chmod(f)),
        (
            "a LINK to a listed file",
            Link {
                gfid: f,
                new_parent: Gfid::ROOT,
                new_name: name("f2"),
            }
            .into(),
        ),
        (
            "an O_TRUNC OPEN of a listed file",
            Open {
                gfid: f,
                access: AccessMode::ReadWrite,
                flags: OpenFlags::TRUNC,
            }
            .into(),
        ),
        ("a PUT in a listed subdirectory", put(&h, sub, "g")),
        (
            "a RENAME of another name of a listed file",
            Rename {
                old_parent: Gfid::ROOT,
                old_name: name("f2"),
                new_parent: Gfid::ROOT,
                new_name: name("f3"),
                mode: RenameMode::NoReplace,
            }
            .into(),
        ),
        (
            "an UNLINK of another name of a listed file",
            Unlink {
                parent: Gfid::ROOT,
                name: name("f3"),
            }
            .into(),
        ),
    ];
    h.rt.block_on(async {
        for (what, change) in changes {
            list().await;
            let stat = Stat { gfid: f };
            bounded("a look at a listed file", b.call(root(), stat.into()))
                .await
                .expect("stat");
            bounded("the holder's own change", a.call(root(), chmod(f)))
                .await
                .expect("own chmod");
            let mut change = Box::pin(b.call(root(), change));
            still_held(what, &mut change).await;
            assert_eq!(recall(&mut events).await.gfid, d, "{what}");
            assert_eq!(lease(&a, d, LeaseKind::None).await, Ok(LeaseKind::None));
            bounded(what, change).await.expect(what);
        }
    });
}

/// A read lease on a file (capability `FILE_LEASES`) shares reads, and is recalled before
/// another session changes the file: by its GFID (SETATTR), through an fd (WRITE), or by
/// renaming (RENAME) or removing (UNLINK) another of its names.
fn a_file_s_read_lease_is_recalled_before_another_session_changes_the_file(kind: EngineKind) {
    let h = harness(kind, BOUND);
    let f = h.put(Gfid::ROOT, "f", b"first").expect("put");
    let (a, mut events) = h.engine.lease_session();
    let (b, _qb) = h.engine.lease_session();
    h.rt.block_on(async {
        assert_eq!(lease(&a, f, LeaseKind::Read).await, Ok(LeaseKind::Read));
        let size = ReadSize::new(64).expect("size");
        let get = Get {
            gfid: f,
            offset: 0,
            size,
        };
        b.call(root(), get.into())
            .await
            .expect("a read goes through");
        let FopReply::Open(opened) = (b.call(
            root(),
            Open {
                gfid: f,
                access: AccessMode::ReadWrite,
                flags: OpenFlags::empty(),
            }
            .into(),
        ))
        .await
        .expect("open") else {
            panic!("OPEN reply")
        };
        assert!(
            events.try_recv().is_err(),
            "reads and an open conflict with no read lease"
        );
        // `change` by b, under a's read lease of the file, is held until a gives it back.
        let mut held = async |what: &str, change: FopRequest| {
            assert_eq!(lease(&a, f, LeaseKind::Read).await, Ok(LeaseKind::Read));
            let mut change = Box::pin(b.call(root(), change));
            let under = format!("{what} under another session's read lease of the file");
            still_held(&under, &mut change).await;
            let recalled = recall(&mut events).await;
            assert_eq!(
                (recalled.gfid, recalled.kind),
                (f, LeaseKind::None),
                "{what}"
            );
            assert_eq!(lease(&a, f, LeaseKind::None).await, Ok(LeaseKind::None));
            bounded(what, change).await.expect(what);
        };
        let data = Payload::new(bytes::Bytes::from_static(b"again")).expect("small");
        let write = Write {
            fd: opened.fd,
            offset: 0,
            data,
        };
        held("a WRITE", write.into()).await;
        let attr = SetAttr {
            mode: Some(mode(0o600)),
            ..SetAttr::default()
        };
        held("a SETATTR", Setattr { gfid: f, attr }.into()).await;
        // Another name of the file renamed or removed changes its ctime or link count.
        let link = Link {
            gfid: f,
            new_parent: Gfid::ROOT,
            new_name: name("f2"),
        };
        b.call(root(), link.into()).await.expect("link");
        let rename = Rename {
            old_parent: Gfid::ROOT,
            old_name: name("f2"),
            new_parent: Gfid::ROOT,
            new_name: name("f3"),
            mode: RenameMode::Replace,
        };
        held("a RENAME of another name", rename.into()).await;
        let unlink = Unlink {
            parent: Gfid::ROOT,
            name: name("f3"),
        };
        held("an UNLINK of another name", unlink.into()).await;
        // Renamed over, its last name goes (and with it the file, on the brick).
        b.call(root(), put(&h, Gfid::ROOT, "g")).await.expect("put");
        let rename = Rename {
            old_parent: Gfid::ROOT,
            old_name: name("g"),
            new_parent: Gfid::ROOT,
            new_name: name("f"),
            mode: RenameMode::Replace,
        };
        held("a RENAME over its last name", rename.into()).await;
    });
}
