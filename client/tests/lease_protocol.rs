//! Directory leases on the wire against a real `kiln-brickd` (`docs/wire.md`, "Leases"), with
//! raw frames: HELLO negotiates `LEASES`; a RECALL arrives on a unidirectional stream when
//! another connection touches the leased directory, whose fop is answered only once the
//! holder gives the lease back (or, if it stays silent, once the recall runs out, after which
//! the holder gets ESTALE there); BATCH runs its fops in order as the squashed caller; and a
//! connection without the capability gets ENOTSUP. Every wait is bounded. Also here, as the
//! other capabilities a session's frames depend on: `NO_PARENT_ATTRS` leaves the parents'
//! attributes out of replies, and `UNCHECKED_BODIES` the body checksums out of frames.

mod common;
mod hostile_common;

use std::time::{Duration, Instant};

use hostile_common::*;
use kiln_wire::{
    Batch, BatchReply, Call, CallCode, Capabilities, Creds, ErrorCode, Event, FopReply, FopRequest,
    Gfid, Header, Iatt, Lease, LeaseKind, LeaseReply, Message, Outcome, Ping, Recall, Reply,
};

const ROOT: Gfid = Gfid::ROOT;
/// How long a held call must stay unanswered to count as held.
const HELD: Duration = Duration::from_millis(300);

fn lease(gfid: Gfid, kind: LeaseKind) -> FopRequest {
    Lease { gfid, kind }.into()
}

/// A connection of `alice` (trusted with root) that negotiated leases.
async fn holder(s: &Scene) -> RawConn {
    let (conn, hello) =
        RawConn::offering(&s.cluster, s.addr(), "alice", Capabilities::LEASES).await;
    assert_eq!(hello.capabilities, Capabilities::LEASES);
    conn
}

/// The fop reply in `answer`, or its error.
fn outcome(what: &str, answer: Answer) -> Result<FopReply, ErrorCode> {
    match answer {
        Answer::Reply(Message::Reply(Reply {
            outcome: Outcome::Fop(reply),
            ..
        })) => Ok(reply),
        Answer::Reply(Message::Reply(Reply {
            outcome: Outcome::Error { error, .. },
            ..
        })) => Err(error),
        other => panic!("{what}: {other:?}"),
    }
}

async fn fop_on(conn: &RawConn, what: &str, fop: FopRequest) -> Result<FopReply, ErrorCode> {
    outcome(what, conn.fop(Creds::root(), fop).await)
}

async fn take_lease(conn: &RawConn, gfid: Gfid, kind: LeaseKind) -> LeaseKind {
    match fop_on(conn, "LEASE", lease(gfid, kind)).await {
        Ok(FopReply::Lease(LeaseReply { kind })) => kind,
        other => panic!("LEASE: {other:?}"),
    }
}

/// A new directory `/n`; its GFID.
async fn dir(conn: &RawConn, n: &str) -> Gfid {
    let made = fop_on(conn, "MKDIR", mkdir(ROOT, n, gfid())).await;
    made_gfid(made.expect("mkdir"))
}

fn made_gfid(reply: FopReply) -> Gfid {
    made(reply).gfid
}

async fn expect_recall(conn: &RawConn, gfid: Gfid) {
    match conn.event().await {
        Message::Event(Event::Recall(recall)) => assert_eq!(
            recall,
            Recall {
                gfid,
                kind: LeaseKind::None
            }
        ),
        other => panic!("expected a RECALL, got {other:?}"),
    }
}

#[test]
fn hello_negotiates_leases_and_without_them_lease_and_batch_are_refused() {
    let s = Scene::start(&[]);
    s.rt.block_on(async {
        let newer =
            Capabilities(Capabilities::LEASES.0 | Capabilities::INVALIDATE_EVENTS.0 | 1 << 40);
        let (_, hello) = RawConn::offering(&s.cluster, s.addr(), "alice", newer).await;
        assert_eq!(
            hello.capabilities,
            Capabilities::LEASES,
            "the intersection of what both ends offer"
        );
        let plain = s.raw("alice").await;
        let d = dir(&plain, "d").await;
        let refused = fop_on(&plain, "LEASE", lease(d, LeaseKind::Read)).await;
        assert_eq!(refused.map(drop), Err(ErrorCode::NotSupported));
        let mut batch = Batch::new(Creds::root());
        batch.push(stat(ROOT)).expect("batchable");
        match plain.call(Call::Batch(batch)).await {
            Answer::Reply(Message::Reply(Reply {
                outcome:
                    Outcome::Error {
                        call: CallCode::Batch,
                        error: ErrorCode::NotSupported,
                    },
                ..
            })) => {}
            other => panic!("BATCH without the capability: {other:?}"),
        }
        let leased = holder(&s).await;
        assert_eq!(
            take_lease(&leased, d, LeaseKind::Read).await,
            LeaseKind::Read
        );
        plain.ping("the connection goes on").await;
    });
}

/// A connection that negotiated `NO_PARENT_ATTRS` gets `Iatt::omitted_dir` as the parent's
/// attributes of a PUT and an UNLINK; one that did not gets the directory's real ones.
#[test]
fn no_parent_attrs_leaves_the_parent_out_of_namespace_replies() {
    let s = Scene::start(&[]);
    s.rt.block_on(async {
        let (bare, hello) =
            RawConn::offering(&s.cluster, s.addr(), "alice", Capabilities::NO_PARENT_ATTRS).await;
        assert_eq!(hello.capabilities, Capabilities::NO_PARENT_ATTRS);
        let full = s.raw("alice").await;
        let d = dir(&full, "d").await;
        let parents = |reply| match reply {
            Ok(FopReply::Put(e)) => (e.pre_parent, e.post_parent),
            Ok(FopReply::Unlink(r)) => (r.pre_parent, r.post_parent),
            other => panic!("{other:?}"),
        };
        let omitted = (Iatt::omitted_dir(d), Iatt::omitted_dir(d));
        let put_bare = fop_on(&bare, "PUT", put(d, "a", gfid(), b"a")).await;
        assert_eq!(parents(put_bare), omitted);
        let unlink_bare = fop_on(&bare, "UNLINK", unlink(d, "a")).await;
        assert_eq!(parents(unlink_bare), omitted);
        let (pre, post) = parents(fop_on(&full, "PUT", put(d, "b", gfid(), b"b")).await);
        assert_eq!((pre.gfid, post.gfid, post.nlink), (d, d, 2));
        assert!(
            pre.ino != 0 && pre.ino == post.ino,
            "the directory's own attributes"
        );
    });
}

/// A connection that negotiated `UNCHECKED_BODIES` sends its requests without a body checksum
/// and gets its replies without one; a connection that did not gets them checksummed.
#[test]
fn unchecked_bodies_go_both_ways_only_where_negotiated() {
    let s = Scene::start(&[]);
    s.rt.block_on(async {
        let wanted = Capabilities::UNCHECKED_BODIES;
        let (bare, hello) = RawConn::offering(&s.cluster, s.addr(), "alice", wanted).await;
        assert_eq!(hello.capabilities, wanted);
        let full = s.raw("alice").await;
        let d = dir(&full, "d").await;
        let data = b"some bytes no checksum covers";
        let (header, _) = split(&bare.request(Call::Ping(Ping { nonce: 1 })));
        assert!(
            !header.body_checked(),
            "the request goes without its checksum"
        );
        let made = fop_on(&bare, "PUT", put(d, "a", gfid(), data)).await;
        let Ok(FopReply::Put(made)) = made else {
            panic!("PUT: {made:?}");
        };
        assert_eq!(made.iatt.size, data.len() as u64);
        for (conn, checked) in [(&bare, false), (&full, true)] {
            let reply = reply_header(conn, Call::Ping(Ping { nonce: 2 })).await;
            assert_eq!(reply.body_checked(), checked, "checked: {checked}");
        }
        full.ping("a checksummed connection beside").await;
    });
}

/// The header of the reply to `call` on `conn`, read as raw bytes.
async fn reply_header(conn: &RawConn, call: Call) -> Header {
    let (mut send, mut recv) = conn.connection.open_bi().await.expect("a stream");
    send.write_all(&conn.request(call))
        .await
        .expect("the request");
    send.finish().expect("finish");
    let bytes = within("the reply", recv.read_to_end(1 << 16))
        .await
        .expect("the reply's bytes");
    Header::decode_prefix(&bytes).expect("the reply's header")
}

fn a_recall_holds_the_other_connections_fop_until_the_lease_is_back(extra: &[&str]) {
    let s = Scene::start(extra);
    s.rt.block_on(async {
        let a = holder(&s).await;
        let b = holder(&s).await;
        let d = dir(&a, "d").await;
        assert_eq!(take_lease(&a, d, LeaseKind::Write).await, LeaseKind::Write);
        let mut held = Box::pin(b.fop(Creds::root(), lookup(d, "x")));
        if tokio::time::timeout(HELD, &mut held).await.is_ok() {
            panic!("a LOOKUP under another connection's write lease was answered at once");
        }
        expect_recall(&a, d).await;
        let own = fop_on(&a, "the holder's own LOOKUP", lookup(d, "x")).await;
        assert_eq!(own.map(drop), Err(ErrorCode::NoEnt));
        if tokio::time::timeout(HELD, &mut held).await.is_ok() {
            panic!("the LOOKUP was answered before the lease came back");
        }
        assert_eq!(take_lease(&a, d, LeaseKind::None).await, LeaseKind::None);
        let found = outcome("the held LOOKUP", within("the held LOOKUP", held).await);
        assert_eq!(found.map(drop), Err(ErrorCode::NoEnt));
        let by = s.bystander().await;
        by.check("after a recall").await;
    });
}

#[test]
fn a_recall_holds_the_other_connections_fop_until_the_lease_is_back_uring() {
    a_recall_holds_the_other_connections_fop_until_the_lease_is_back(&[]);
}

#[test]
fn a_recall_holds_the_other_connections_fop_until_the_lease_is_back_blocking() {
    a_recall_holds_the_other_connections_fop_until_the_lease_is_back(&["--engine", "blocking"]);
}

#[test]
fn a_silent_holder_is_revoked_after_the_recall_timeout() {
    let timeout = Duration::from_millis(700);
    let s = Scene::start(&["--lease-recall-timeout-ms", "700"]);
    s.rt.block_on(async {
        let a = holder(&s).await;
        let b = holder(&s).await;
        let d = dir(&a, "d").await;
        let e = dir(&a, "e").await;
        assert_eq!(take_lease(&a, d, LeaseKind::Write).await, LeaseKind::Write);
        let start = Instant::now();
        // Any fop conflicts with a write lease; the holder never answers its RECALL.
        let made = fop_on(
            &b,
            "MKDIR under a silent holder's lease",
            mkdir(d, "sub", gfid()),
        )
        .await;
        made.expect("mkdir after the revocation");
        assert!(
            start.elapsed() >= timeout - Duration::from_millis(50),
            "answered after {:?}, before the recall ran out",
            start.elapsed()
        );
        expect_recall(&a, d).await;
        // Its changes there fail (they were meant for under the lease); its reads work.
        let late = fop_on(&a, "the revoked holder's MKDIR", mkdir(d, "late", gfid())).await;
        assert_eq!(late.map(drop), Err(ErrorCode::Stale));
        let found = fop_on(&a, "the revoked holder's LOOKUP", lookup(d, "sub")).await;
        found.expect("a read goes on");
        let elsewhere = fop_on(&a, "a MKDIR elsewhere", mkdir(e, "x", gfid())).await;
        elsewhere.expect("a change elsewhere");
        assert_eq!(take_lease(&a, d, LeaseKind::None).await, LeaseKind::None);
        let made = fop_on(&a, "MKDIR after asking again", mkdir(d, "late", gfid())).await;
        made.expect("mkdir");
    });
}

/// A read lease not given back in time is revoked too, but leaves no mark: nothing was
/// changed under it, so its holder's changes there are as anyone's.
#[test]
fn a_silent_read_holder_goes_on_after_its_revocation() {
    let s = Scene::start(&["--lease-recall-timeout-ms", "300"]);
    s.rt.block_on(async {
        let a = holder(&s).await;
        let b = holder(&s).await;
        let d = dir(&a, "d").await;
        assert_eq!(take_lease(&a, d, LeaseKind::Read).await, LeaseKind::Read);
        let made = fop_on(&b, "MKDIR under a silent reader", mkdir(d, "sub", gfid())).await;
        made.expect("mkdir after the revocation");
        expect_recall(&a, d).await;
        let made = fop_on(&a, "the revoked reader's MKDIR", mkdir(d, "own", gfid())).await;
        made.expect("no mark");
    });
}

#[test]
fn batch_runs_in_order_as_the_squashed_caller() {
    let s = Scene::start(&[]);
    s.rt.block_on(async {
        let a = holder(&s).await;
        let (bob, hello) =
            RawConn::offering(&s.cluster, s.addr(), "bob", Capabilities::LEASES).await;
        assert_eq!(hello.capabilities, Capabilities::LEASES);
        let d = gfid();
        let mut batch = Batch::new(Creds::root());
        for fop in [
            mkdir(ROOT, "d", d),
            put(d, "f", gfid(), b"batched"),
            lookup(d, "f"),
            unlink(d, "missing"),
            lease(d, LeaseKind::Read),
            stat(d),
        ] {
            batch.push(fop).expect("batchable");
        }
        let results = match a.call(Call::Batch(batch)).await {
            Answer::Reply(Message::Reply(Reply {
                outcome: Outcome::Batch(BatchReply { results }),
                ..
            })) => results,
            other => panic!("BATCH: {other:?}"),
        };
        assert_eq!(results.len(), 6, "{results:?}");
        assert_eq!(made_gfid(results[0].clone().expect("mkdir")), d);
        let put_gfid = made_gfid(results[1].clone().expect("put"));
        match &results[2] {
            Ok(FopReply::Lookup(r)) => assert_eq!(r.iatt.gfid, put_gfid, "in order"),
            other => panic!("LOOKUP: {other:?}"),
        }
        assert_eq!(results[3].clone().map(drop), Err(ErrorCode::NoEnt));
        assert!(
            matches!(
                results[4],
                Ok(FopReply::Lease(LeaseReply {
                    kind: LeaseKind::Read
                }))
            ),
            "{:?}",
            results[4]
        );
        assert!(
            matches!(results[5], Ok(FopReply::Stat(_))),
            "a failure stops nothing"
        );
        // Root squashing applies to a batch's credentials as to a single fop's.
        let mut squashed = Batch::new(Creds::root());
        squashed
            .push(mkdir(ROOT, "bob-dir", gfid()))
            .expect("batchable");
        match bob.call(Call::Batch(squashed)).await {
            Answer::Reply(Message::Reply(Reply {
                outcome: Outcome::Batch(BatchReply { results }),
                ..
            })) => assert_eq!(
                results.into_iter().map(|r| r.map(drop)).collect::<Vec<_>>(),
                [Err(ErrorCode::Access)],
                "bob's root is squashed"
            ),
            other => panic!("BATCH: {other:?}"),
        }
        assert!(!s.on_brick("bob-dir").exists());
    });
}
