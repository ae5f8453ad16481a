//! The client stack's seam: a layer of its own between the path helpers and a real brick
//! client, against a real `kiln-brickd`.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use bytes::Bytes;
use common::{Cluster, runtime};
use kiln_client::{Error, FdFop, Layer, LayerExt, Paths};
use kiln_wire::{
    AccessMode, Creds, EntryReply, ErrorCode, FdId, FopCode, FopReply, FopRequest, Gfid, OpenFlags,
};

/// A pass-through layer that counts the fops it forwards and notes who asked: what a
/// distribution or caching layer does first with every fop, before routing or answering it.
#[derive(Debug)]
struct Counting<L> {
    below: L,
    fops: Mutex<BTreeMap<FopCode, usize>>,
    uids: Mutex<BTreeSet<u32>>,
}

/// The counting layer's own fd: the one below, and whether it is a directory's (so its end is
/// counted as RELEASEDIR, not RELEASE).
#[derive(Debug)]
struct CountingFd<F> {
    below: F,
    dir: bool,
}

impl<L: Layer> Counting<L> {
    fn new(below: L) -> Counting<L> {
        Counting {
            below,
            fops: Mutex::new(BTreeMap::new()),
            uids: Mutex::new(BTreeSet::new()),
        }
    }

    fn count(&self, creds: &Creds, code: FopCode) {
        *self.fops.lock().expect("lock").entry(code).or_default() += 1;
        self.uids.lock().expect("lock").insert(creds.uid);
    }

    /// The fops counted since the last look, by name.
    fn take(&self) -> BTreeMap<&'static str, usize> {
        std::mem::take(&mut *self.fops.lock().expect("lock"))
            .into_iter()
            .map(|(code, n)| (code.name(), n))
            .collect()
    }
}

impl<L: Layer> Layer for Counting<L> {
    type Fd = CountingFd<L::Fd>;

    async fn call(&self, creds: &Creds, fop: FopRequest) -> Result<FopReply, Error> {
        self.count(creds, fop.code());
        self.below.call(creds, fop).await
    }

    async fn open(
        &self,
        creds: &Creds,
        gfid: Gfid,
        access: AccessMode,
        flags: OpenFlags,
    ) -> Result<Self::Fd, Error> {
        self.count(creds, FopCode::Open);
        let below = self.below.open(creds, gfid, access, flags).await?;
        Ok(CountingFd { below, dir: false })
    }

    async fn create(
        &self,
        creds: &Creds,
        create: kiln_wire::Create,
    ) -> Result<(Self::Fd, EntryReply), Error> {
        self.count(creds, FopCode::Create);
        let (below, entry) = self.below.create(creds, create).await?;
        Ok((CountingFd { below, dir: false }, entry))
    }

    async fn opendir(&self, creds: &Creds, gfid: Gfid) -> Result<Self::Fd, Error> {
        self.count(creds, FopCode::Opendir);
        let below = self.below.opendir(creds, gfid).await?;
        Ok(CountingFd { below, dir: true })
    }

    async fn call_fd(&self, creds: &Creds, fd: &Self::Fd, fop: FdFop) -> Result<FopReply, Error> {
        self.count(creds, fop.code());
        self.below.call_fd(creds, &fd.below, fop).await
    }

    async fn release(&self, creds: &Creds, fd: Self::Fd) -> Result<(), Error> {
        let code = match fd.dir {
            true => FopCode::Releasedir,
            false => FopCode::Release,
        };
        self.count(creds, code);
        self.below.release(creds, fd.below).await
    }

    async fn batch(&self, batch: kiln_wire::Batch) -> Result<kiln_wire::BatchReply, Error> {
        for fop in batch.fops() {
            self.count(&batch.creds, fop.code());
        }
        self.below.batch(batch).await
    }

    fn leases(&self) -> bool {
        self.below.leases()
    }

    fn listed_attrs(&self) -> bool {
        self.below.listed_attrs()
    }

    fn events(&self) -> tokio::sync::broadcast::Receiver<kiln_client::LayerEvent> {
        self.below.events()
    }
}

fn counts(pairs: &[(&'static str, usize)]) -> BTreeMap<&'static str, usize> {
    pairs.iter().copied().collect()
}

#[test]
fn path_helpers_run_through_a_layer_over_the_brick_client() {
    let cluster = Cluster::new();
    let brickd = cluster.start("127.0.0.1:0", &[]);
    runtime().block_on(async {
        let brick = cluster.connect(brickd.addr, "alice").await;
        let stack = Counting::new(brick.clone());
        let root = Creds::root();
        let user = Creds {
            uid: 1000,
            gid: 1000,
            ..Creds::root()
        };

        stack
            .mkdir_all(&root, "/a/b", 0o777)
            .await
            .expect("mkdir -p");
        assert_eq!(
            stack.take(),
            counts(&[("STAT", 1), ("LOOKUP", 2), ("MKDIR", 2)])
        );

        // Credentials travel with each call: the same stack acts for another user.
        let small = stack
            .put(&user, "/a/b/small", Bytes::from_static(b"tiny"), 0o644)
            .await
            .expect("put as a user");
        assert_eq!((small.uid, small.gid), (1000, 1000), "made as the caller");
        assert_eq!(stack.take(), counts(&[("LOOKUP", 2), ("PUT", 1)]));
        assert_eq!(*stack.uids.lock().expect("lock"), BTreeSet::from([0, 1000]));

        // 2.5 MiB: a CREATE, three WRITEs and a RELEASE, all through the layer's fd.
        let big: Vec<u8> = (0..2_621_440u32).map(|i| (i % 251) as u8).collect();
        stack
            .write_file(&root, "/a/b/big", Bytes::from(big.clone()), 0o600)
            .await
            .expect("write_file");
        assert_eq!(
            stack.take(),
            counts(&[("LOOKUP", 2), ("CREATE", 1), ("WRITE", 3), ("RELEASE", 1)])
        );
        assert_eq!(
            stack.read_to_end(&root, "/a/b/big").await.expect("read"),
            big
        );
        assert_eq!(
            stack.take(),
            counts(&[
                ("STAT", 1),
                ("LOOKUP", 3),
                ("OPEN", 1),
                ("READ", 4),
                ("RELEASE", 1)
            ])
        );

        stack.remove_all(&root, "/a").await.expect("rm -r");
        // Each directory is listed through its own fd (READDIRP until the end), then its
        // entries go depth first.
        let removed = stack.take();
        assert_eq!((removed["OPENDIR"], removed["RELEASEDIR"]), (2, 2));
        assert!(removed["READDIRP"] >= 2, "{removed:?}");
        assert_eq!((removed["UNLINK"], removed["RMDIR"]), (2, 2));
        let gone = stack.resolve(&root, "/a").await.expect_err("gone");
        assert_eq!(gone.code(), Some(ErrorCode::NoEnt));

        // The brick client below is still usable on its own.
        brick.ping().await.expect("ping");
        brick.close().await;
    });
}

#[test]
fn the_brick_client_keeps_its_layer_contract() {
    let cluster = Cluster::new();
    let brickd = cluster.start("127.0.0.1:0", &[]);
    runtime().block_on(async {
        let alice = cluster.connect(brickd.addr, "alice").await;
        let other = cluster.connect(brickd.addr, "alice").await;
        let root = Creds::root();
        let iatt = alice
            .put(&root, "/f", Bytes::from_static(b"data"), 0o644)
            .await
            .expect("put");

        // A fop on a raw fd id, or one that opens, does not go through `call`.
        let raw = FopRequest::Fstat(kiln_wire::Fstat {
            fd: FdId {
                slot: 0,
                generation: 0,
            },
        });
        let open = FopRequest::Open(kiln_wire::Open {
            gfid: iatt.gfid,
            access: AccessMode::ReadOnly,
            flags: OpenFlags::empty(),
        });
        for fop in [raw, open] {
            let e = alice.call(&root, fop).await.expect_err("refused");
            assert!(matches!(e, Error::Misuse(_)), "{e:?}");
        }

        // An fd is its own client's: another client of the same brick refuses it, even
        // though an fd with the same id exists in its session.
        let fd = alice
            .open(&root, iatt.gfid, AccessMode::ReadOnly, OpenFlags::empty())
            .await
            .expect("open");
        let mine = other
            .open(&root, iatt.gfid, AccessMode::ReadOnly, OpenFlags::empty())
            .await
            .expect("open");
        let e = other.read(&root, &fd, 0, 4).await.expect_err("not its fd");
        assert_eq!(e.code(), Some(ErrorCode::BadFd));
        assert_eq!(
            &alice.read(&root, &fd, 0, 4).await.expect("read")[..],
            b"data"
        );

        // Its release ends an fd; a RELEASE through `call_fd` would leave it dangling.
        let release = FdFop::new(|fd| kiln_wire::Release { fd }.into());
        let e = alice
            .call_fd(&root, &fd, release)
            .await
            .expect_err("refused");
        assert!(matches!(e, Error::Misuse(_)), "{e:?}");
        alice.release(&root, fd).await.expect("release");
        other.release(&root, mine).await.expect("release");
        alice.close().await;
        other.close().await;
    });
}
