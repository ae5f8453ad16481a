//! What the hostile-client suite shares: a brick started with given flags, a canary tree
//! outside the brick that must never change, a well-behaved client that must keep working, a
//! raw QUIC client that sends frames the client library never would, and bounded waits.
#![allow(
    dead_code,
    unreachable_pub,
    reason = "helpers for the tests of hostile.rs"
)]

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::future::Future;
use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use kiln_admin::pki::{self, Role};
use kiln_client::brick::quinn_config;
use kiln_client::path::new_gfid;
use kiln_client::{BrickClient, Error, Paths};
use kiln_wire::quic::{self, StreamCode};
use kiln_wire::{
    AccessMode, BodyChecksum, Call, Capabilities, Creds, ErrorCode, FileType, FopReply, FopRequest,
    Gfid, Groups, Header, Hello, HelloReply, Label, Message, Mode, Name, NodeType, OpenFlags,
    Outcome, Payload, Ping, RenameMode, Reply, Request, SetAttr, SymlinkTarget, XattrName,
    XattrSetMode, XattrValue, checksum,
};

use crate::common::{Brickd, Cluster, runtime};

/// The client certificate of the well-behaved client; the attackers are `alice` and `bob`.
pub const BYSTANDER: &str = "carol";
/// The uid and gid the well-behaved client works as.
pub const BYSTANDER_ID: u32 = 1000;
/// What uid and gid 0 of a squashed client become by default.
pub const NOBODY: u32 = 65534;

/// How long any one step of a test may take before the test fails instead of hanging.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(20);

/// Fails loudly when the suite cannot run: the brick needs root (trusted xattrs, per-caller
/// credentials), so a test run without it must not pass.
pub fn require_root() {
    assert!(
        rustix::process::geteuid().is_root(),
        "the hostile-client suite needs root (the brick sets trusted.* xattrs and switches \
         credentials per caller); run it as root, as CI does"
    );
}

/// A brick under attack: its cluster, the running `kiln-brickd`, the canary tree outside it
/// and a runtime for the clients.
pub struct Scene {
    pub cluster: Cluster,
    pub brickd: Brickd,
    pub outside: Outside,
    pub rt: tokio::runtime::Runtime,
}

impl Scene {
    /// A formatted brick served with `extra` flags. Unless `extra` says otherwise about root
    /// squashing, `alice` and the well-behaved client are trusted with root and `bob` is
    /// squashed. Unless `extra` asks for the blocking engine, the io_uring engine must be the
    /// one that runs (a silent fallback would test the other engine).
    pub fn start(extra: &[&str]) -> Scene {
        require_root();
        let cluster = Cluster::new();
        pki::issue(&cluster.tls, &Role::Client, BYSTANDER, 1).expect("bystander certificate");
        let outside = Outside::make(cluster.dir.path());
        let squash_set = extra
            .iter()
            .any(|a| matches!(*a, "--root-allow" | "--root-squash"));
        let trusted = ["--root-allow", "alice,carol"];
        let mut args: Vec<&str> = if squash_set { vec![] } else { trusted.to_vec() };
        args.extend_from_slice(extra);
        let brickd = cluster.start("127.0.0.1:0", &args);
        let blocking = extra.windows(2).any(|w| w == ["--engine", "blocking"]);
        if !blocking {
            let logs = brickd.logs();
            assert!(
                !logs.contains("io_uring is unavailable"),
                "the brick fell back to the blocking engine; this suite tests io_uring:\n{logs}"
            );
        }
        Scene {
            cluster,
            brickd,
            outside,
            rt: runtime(),
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.brickd.addr
    }

    /// A client with `name`'s certificate.
    pub async fn connect(&self, name: &str) -> BrickClient {
        within("a client connects", self.cluster.connect(self.addr(), name)).await
    }

    /// A client with `name`'s certificate, or why it was refused.
    pub async fn try_connect(&self, name: &str) -> Result<BrickClient, Error> {
        within(
            "a connection attempt",
            BrickClient::connect(self.cluster.options(self.addr(), name)),
        )
        .await
    }

    /// Connects the well-behaved client and gives it a directory of its own.
    pub async fn bystander(&self) -> Bystander {
        Bystander::join(self.connect(BYSTANDER).await).await
    }

    /// A raw QUIC connection with `name`'s certificate, past HELLO.
    pub async fn raw(&self, name: &str) -> RawConn {
        RawConn::open(&self.cluster, self.addr(), name).await
    }

    /// The brick's resident memory now, in KiB.
    pub fn brick_rss_kib(&self) -> u64 {
        vm_rss_kib(self.brickd.pid())
    }

    /// The path of `name` in the brick root, on disk.
    pub fn on_brick(&self, name: &str) -> PathBuf {
        self.cluster.brick.join(name)
    }
}

// ---- bounded waits ----

/// `fut`, or a failure naming `what` after [`STEP_TIMEOUT`]: a regression fails the test
/// instead of hanging it.
pub async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    within_secs(STEP_TIMEOUT.as_secs(), what, fut).await
}

pub async fn within_secs<T>(secs: u64, what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(Duration::from_secs(secs), fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: no answer within {secs} s"),
    }
}

/// Retries `attempt` every 100 ms until it returns `Some`, for at most `secs` seconds.
pub async fn eventually<T, F: Future<Output = Option<T>>>(
    secs: u64,
    what: &str,
    mut attempt: impl FnMut() -> F,
) -> T {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = attempt().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: still not so after {secs} s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---- fops ----

/// Any fop as `creds` through the client's raw call (OPEN and CREATE included), bounded in
/// time: a fop that blocks (say, an open of a FIFO) fails the test.
pub async fn fop(
    v: &BrickClient,
    creds: &Creds,
    fop: impl Into<FopRequest>,
) -> Result<FopReply, Error> {
    let fop = fop.into();
    let what = format!("{} as uid {}", fop.code().name(), creds.uid);
    within(&what, v.call_raw(creds, fop)).await
}

/// Asserts that `result` is the fop error `want`.
pub fn expect_err<T: Debug>(what: &str, result: Result<T, Error>, want: ErrorCode) {
    match result {
        Err(Error::Fop(code)) if code == want => {}
        other => panic!(
            "{what}: expected {} ({}), got {other:?}",
            want.errno_name(),
            want
        ),
    }
}

/// Asserts that `result` succeeded.
pub fn expect_ok<T: Debug>(what: &str, result: Result<T, Error>) -> T {
    result.unwrap_or_else(|e| panic!("{what}: {e} ({e:?})"))
}

pub fn name(s: &str) -> Name {
    Name::new(Bytes::copy_from_slice(s.as_bytes())).expect("name")
}

pub fn mode(bits: u32) -> Mode {
    Mode::new(bits).expect("mode")
}

pub fn creds(uid: u32, gid: u32, groups: &[u32]) -> Creds {
    Creds {
        uid,
        gid,
        groups: Groups::new(groups.to_vec()).expect("few groups"),
        pid: 1,
    }
}

/// One fop that must fail: what it attempts, the request, the error it must get.
pub type Refusal = (&'static str, FopRequest, ErrorCode);

/// Runs each fop as `creds` and asserts that it fails as its case says.
pub async fn expect_refusals(v: &BrickClient, creds: &Creds, cases: Vec<Refusal>) {
    for (what, request, want) in cases {
        let result = fop(v, creds, request).await;
        expect_err(what, result, want);
    }
}

// Requests, tersely: the fops the attacks send, with harmless defaults for what they do
// not attack.

pub fn put(parent: Gfid, n: &str, gfid: Gfid, data: &'static [u8]) -> FopRequest {
    kiln_wire::Put {
        parent,
        name: name(n),
        gfid,
        mode: mode(0o644),
        umask: mode(0),
        flags: OpenFlags::TRUNC,
        data: Payload::new(Bytes::from_static(data)).expect("payload"),
        attr: SetAttr::default(),
    }
    .into()
}

pub fn create_args(parent: Gfid, n: &str, gfid: Gfid, flags: OpenFlags) -> kiln_wire::Create {
    kiln_wire::Create {
        parent,
        name: name(n),
        gfid,
        access: AccessMode::ReadWrite,
        flags,
        mode: mode(0o644),
        umask: mode(0),
    }
}

pub fn create(parent: Gfid, n: &str, gfid: Gfid, flags: OpenFlags) -> FopRequest {
    create_args(parent, n, gfid, flags).into()
}

pub fn mkdir(parent: Gfid, n: &str, gfid: Gfid) -> FopRequest {
    kiln_wire::Mkdir {
        parent,
        name: name(n),
        gfid,
        mode: mode(0o755),
        umask: mode(0),
    }
    .into()
}

pub fn symlink(parent: Gfid, n: &str, gfid: Gfid, target: &str) -> FopRequest {
    kiln_wire::Symlink {
        parent,
        name: name(n),
        gfid,
        target: SymlinkTarget::new(Bytes::copy_from_slice(target.as_bytes())).expect("target"),
    }
    .into()
}

pub fn mknod(parent: Gfid, n: &str, gfid: Gfid, node_type: NodeType, rdev: u64) -> FopRequest {
    kiln_wire::Mknod {
        parent,
        name: name(n),
        gfid,
        node_type,
        mode: mode(0o666),
        umask: mode(0),
        rdev,
    }
    .into()
}

pub fn fifo(parent: Gfid, n: &str, gfid: Gfid) -> FopRequest {
    mknod(parent, n, gfid, NodeType::Fifo, 0)
}

pub fn lookup(parent: Gfid, n: &str) -> FopRequest {
    kiln_wire::Lookup {
        parent,
        name: name(n),
    }
    .into()
}

pub fn unlink(parent: Gfid, n: &str) -> FopRequest {
    kiln_wire::Unlink {
        parent,
        name: name(n),
    }
    .into()
}

pub fn rmdir(parent: Gfid, n: &str) -> FopRequest {
    kiln_wire::Rmdir {
        parent,
        name: name(n),
    }
    .into()
}

pub fn link(gfid: Gfid, new_parent: Gfid, n: &str) -> FopRequest {
    kiln_wire::Link {
        gfid,
        new_parent,
        new_name: name(n),
    }
    .into()
}

pub fn rename(from: (Gfid, &str), to: (Gfid, &str), mode: RenameMode) -> FopRequest {
    kiln_wire::Rename {
        old_parent: from.0,
        old_name: name(from.1),
        new_parent: to.0,
        new_name: name(to.1),
        mode,
    }
    .into()
}

pub fn open(gfid: Gfid, access: AccessMode, flags: OpenFlags) -> FopRequest {
    kiln_wire::Open {
        gfid,
        access,
        flags,
    }
    .into()
}

pub fn opendir(gfid: Gfid) -> FopRequest {
    kiln_wire::Opendir { gfid }.into()
}

pub fn stat(gfid: Gfid) -> FopRequest {
    kiln_wire::Stat { gfid }.into()
}

pub fn truncate(gfid: Gfid, size: u64) -> FopRequest {
    kiln_wire::Truncate { gfid, size }.into()
}

pub fn setattr(gfid: Gfid, attr: SetAttr) -> FopRequest {
    kiln_wire::Setattr { gfid, attr }.into()
}

pub fn chmod(bits: u32) -> SetAttr {
    SetAttr {
        mode: Some(mode(bits)),
        ..SetAttr::default()
    }
}

pub fn chown(uid: u32, gid: u32) -> SetAttr {
    SetAttr {
        uid: Some(uid),
        gid: Some(gid),
        ..SetAttr::default()
    }
}

pub fn resize(size: u64) -> SetAttr {
    SetAttr {
        size: Some(size),
        ..SetAttr::default()
    }
}

pub fn xname(s: &str) -> XattrName {
    XattrName::new(Bytes::copy_from_slice(s.as_bytes())).expect("xattr name")
}

pub fn setxattr(gfid: Gfid, n: &str, value: &'static [u8]) -> FopRequest {
    kiln_wire::Setxattr {
        gfid,
        name: xname(n),
        value: XattrValue::new(Bytes::from_static(value)).expect("value"),
        mode: XattrSetMode::Upsert,
    }
    .into()
}

pub fn getxattr(gfid: Gfid, n: &str) -> FopRequest {
    kiln_wire::Getxattr {
        gfid,
        name: xname(n),
    }
    .into()
}

pub fn removexattr(gfid: Gfid, n: &str) -> FopRequest {
    kiln_wire::Removexattr {
        gfid,
        name: xname(n),
    }
    .into()
}

pub fn listxattr(gfid: Gfid) -> FopRequest {
    kiln_wire::Listxattr { gfid }.into()
}

/// The new object's attributes from a reply that made one.
pub fn made(reply: FopReply) -> kiln_wire::Iatt {
    match reply {
        FopReply::Mkdir(r)
        | FopReply::Mknod(r)
        | FopReply::Symlink(r)
        | FopReply::Link(r)
        | FopReply::Put(r) => r.iatt,
        FopReply::Create(r) => r.iatt,
        other => panic!("not a reply that makes an object: {other:?}"),
    }
}

/// Makes symlink `/n` → `target` as root; its GFID.
pub async fn symlink_at_root(v: &BrickClient, n: &str, target: &Path) -> Gfid {
    let target = target.to_str().expect("utf-8 path");
    let reply = fop(
        v,
        &Creds::root(),
        symlink(Gfid::ROOT, n, new_gfid(), target),
    )
    .await;
    let iatt = made(expect_ok(&format!("SYMLINK {n}"), reply));
    assert_eq!(iatt.file_type, FileType::Symlink);
    iatt.gfid
}

/// Makes directory `/n` with `mode_bits` (set after the create, whatever the brick's umask)
/// as root; its GFID.
pub async fn dir_at_root(v: &BrickClient, n: &str, mode_bits: u32) -> Gfid {
    let root = Creds::root();
    let gfid = expect_ok(
        &format!("MKDIR {n}"),
        v.mkdir(&root, &format!("/{n}"), mode_bits).await,
    )
    .gfid;
    expect_ok(
        "chmod",
        fop(v, &root, setattr(gfid, chmod(mode_bits))).await,
    );
    gfid
}

// ---- the canary outside the brick ----

/// What is planted outside the brick: a file with content, mode, owner, times and an xattr,
/// and a directory with a file in it, beside the brick in the test's directory.
pub struct Outside {
    /// The test's directory: the brick, the TLS files, the brick's logs and `outside`.
    parent: PathBuf,
    pub dir: PathBuf,
    /// A regular file that no client may change.
    pub file: PathBuf,
    /// A directory no client may change or list.
    pub subdir: PathBuf,
    /// A path that does not exist: a symlink to it must not make it exist.
    pub absent: PathBuf,
    before: Vec<Snapshot>,
}

pub const CANARY_CONTENT: &[u8] = b"canary: nothing a client sends may change this file\n";
pub const CANARY_XATTR: &str = "user.canary";
pub const CANARY_XATTR_VALUE: &[u8] = b"secret";
const CANARY_OWNER: u32 = 4321;
const CANARY_MTIME_S: u64 = 1_000_000_000;

/// Everything that could betray a write, a chmod, a chown, a link or a new entry.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Snapshot {
    path: PathBuf,
    file_type: String,
    mode: u32,
    uid: u32,
    gid: u32,
    size: u64,
    nlink: u64,
    ino: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
    content: Option<Vec<u8>>,
    xattrs: BTreeMap<String, Vec<u8>>,
}

impl Outside {
    fn make(parent: &Path) -> Outside {
        let dir = parent.join("outside");
        let file = dir.join("canary");
        let subdir = dir.join("canary-dir");
        std::fs::create_dir(&dir).expect("outside dir");
        std::fs::write(&file, CANARY_CONTENT).expect("canary");
        std::fs::create_dir(&subdir).expect("canary dir");
        std::fs::write(subdir.join("inner"), CANARY_CONTENT).expect("inner canary");
        for path in [&file, &subdir.join("inner")] {
            std::os::unix::fs::chown(path, Some(CANARY_OWNER), Some(CANARY_OWNER)).expect("chown");
            set_mode(path, 0o640);
            rustix::fs::setxattr(
                path.as_path(),
                CANARY_XATTR,
                CANARY_XATTR_VALUE,
                rustix::fs::XattrFlags::CREATE,
            )
            .expect("canary xattr (the test directory's file system must support user xattrs)");
            let old = std::time::UNIX_EPOCH + Duration::from_secs(CANARY_MTIME_S);
            std::fs::File::options()
                .write(true)
                .open(path)
                .and_then(|f| f.set_modified(old))
                .expect("canary mtime");
        }
        set_mode(&subdir, 0o750);
        let mut outside = Outside {
            parent: parent.to_owned(),
            absent: dir.join("made-through-a-symlink"),
            dir,
            file,
            subdir,
            before: Vec::new(),
        };
        outside.before = outside.snapshot();
        outside
    }

    fn snapshot(&self) -> Vec<Snapshot> {
        let mut out = Vec::new();
        walk(&self.dir, &mut out);
        out
    }

    /// Asserts that nothing outside the brick changed: the canary tree is as planted, to the
    /// ctime, and the test's directory holds nothing new (a name that climbed out of the
    /// brick would land there).
    pub fn assert_untouched(&self) {
        let now = self.snapshot();
        for (before, after) in self.before.iter().zip(&now) {
            assert_eq!(before, after, "something outside the brick changed");
        }
        assert_eq!(
            self.before.len(),
            now.len(),
            "entries appeared or vanished outside the brick: {now:#?}"
        );
        let strays: Vec<_> = std::fs::read_dir(&self.parent)
            .expect("test directory")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .filter(|n| {
                !matches!(n.as_str(), "brick" | "tls" | "outside") && !n.starts_with("brickd-")
            })
            .collect();
        assert!(strays.is_empty(), "new names beside the brick: {strays:?}");
    }
}

fn set_mode(path: &Path, bits: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(bits)).expect("chmod");
}

fn walk(path: &Path, out: &mut Vec<Snapshot>) {
    let meta = std::fs::symlink_metadata(path).expect("lstat");
    let kind = meta.file_type();
    out.push(Snapshot {
        path: path.to_owned(),
        file_type: format!("{kind:?}"),
        mode: meta.mode(),
        uid: meta.uid(),
        gid: meta.gid(),
        size: meta.size(),
        nlink: meta.nlink(),
        ino: meta.ino(),
        mtime: (meta.mtime(), meta.mtime_nsec()),
        ctime: (meta.ctime(), meta.ctime_nsec()),
        content: kind
            .is_file()
            .then(|| std::fs::read(path).expect("read canary")),
        xattrs: xattrs(path),
    });
    if kind.is_dir() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(path)
            .expect("readdir")
            .map(|e| e.expect("entry").path())
            .collect();
        entries.sort();
        for entry in entries {
            walk(&entry, out);
        }
    }
}

/// Every extended attribute of `path` (not following a symlink), by name.
pub fn xattrs(path: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut names = vec![0u8; 64 * 1024];
    let n = rustix::fs::llistxattr(path, &mut names[..]).expect("llistxattr");
    names.truncate(n);
    names
        .split(|&b| b == 0)
        .filter(|n| !n.is_empty())
        .map(|n| {
            let key = String::from_utf8_lossy(n).into_owned();
            let mut value = vec![0u8; 64 * 1024];
            let len = rustix::fs::lgetxattr(path, n, &mut value[..]).expect("lgetxattr");
            value.truncate(len);
            (key, value)
        })
        .collect()
}

// ---- the well-behaved client ----

/// A second client that minds its own business in a directory of its own, as uid 1000: it
/// must keep working whatever the attackers do.
pub struct Bystander {
    pub client: BrickClient,
    path: String,
    gfid: Gfid,
    round: AtomicU32,
}

static BYSTANDERS: AtomicU64 = AtomicU64::new(0);

impl Bystander {
    async fn join(client: BrickClient) -> Bystander {
        let path = format!("/bystander-{}", BYSTANDERS.fetch_add(1, Ordering::Relaxed));
        let root = Creds::root();
        let iatt = expect_ok(
            "the well-behaved client makes its directory",
            within("MKDIR", client.mkdir(&root, &path, 0o755)).await,
        );
        let own = chown(BYSTANDER_ID, BYSTANDER_ID);
        expect_ok(
            "the well-behaved client owns its directory",
            fop(&client, &root, setattr(iatt.gfid, own)).await,
        );
        let bystander = Bystander {
            client,
            path,
            gfid: iatt.gfid,
            round: AtomicU32::new(0),
        };
        bystander.check("when it joined").await;
        bystander
    }

    /// A put, a read back and a listing, each of which must succeed in time.
    pub async fn check(&self, when: &str) {
        let n = self.round.fetch_add(1, Ordering::Relaxed);
        let me = creds(BYSTANDER_ID, BYSTANDER_ID, &[]);
        let file = format!("r{n}");
        let path = format!("{}/{file}", self.path);
        let data = Bytes::from(format!("a well-behaved write, round {n}"));
        let failed = |step: &str, e: Error| -> ! {
            panic!("the well-behaved client's {step} failed {when}: {e} ({e:?})")
        };
        let work = async {
            if let Err(e) = self.client.put(&me, &path, data.clone(), 0o644).await {
                failed("put", e);
            }
            match self.client.read_to_end(&me, &path).await {
                Ok(back) => assert_eq!(back, data, "the well-behaved client read back {when}"),
                Err(e) => failed("read", e),
            }
            match self.client.read_dir(&me, self.gfid).await {
                Ok(entries) => assert!(
                    entries.iter().any(|e| e.name.as_bytes() == file.as_bytes()),
                    "the well-behaved client's listing lacks {file} {when}"
                ),
                Err(e) => failed("listing", e),
            }
        };
        within(&format!("the well-behaved client {when}"), work).await;
    }
}

// ---- a raw QUIC client ----

/// One QUIC connection past HELLO, for frames the client library never sends.
pub struct RawConn {
    pub connection: quinn::Connection,
    _endpoint: quinn::Endpoint,
    next_id: AtomicU64,
    /// Whether its frames carry body checksums, as its HELLO negotiated.
    pub crc: BodyChecksum,
}

/// What the brick did with one stream.
#[allow(
    clippy::large_enum_variant,
    reason = "one per stream, matched at once; boxing would only hide the reply from patterns"
)]
#[derive(Debug)]
pub enum Answer {
    Reply(Message),
    /// The brick reset the stream with this code.
    Reset(u64),
    /// Anything else (the connection went, the reply did not decode…).
    Failed(String),
}

impl RawConn {
    pub async fn open(cluster: &Cluster, addr: SocketAddr, client: &str) -> RawConn {
        RawConn::offering(cluster, addr, client, Capabilities::NONE)
            .await
            .0
    }

    /// A raw connection whose HELLO offers `capabilities`, and the brick's HELLO reply.
    pub async fn offering(
        cluster: &Cluster,
        addr: SocketAddr,
        client: &str,
        capabilities: Capabilities,
    ) -> (RawConn, HelloReply) {
        let config = quinn_config(&cluster.options(addr, client)).expect("client config");
        let bind = "127.0.0.1:0".parse().expect("address");
        let mut endpoint = quinn::Endpoint::client(bind).expect("client endpoint");
        endpoint.set_default_client_config(config);
        let connecting = endpoint.connect(addr, "127.0.0.1").expect("connect");
        let connection = within("a raw QUIC handshake", connecting)
            .await
            .expect("raw handshake");
        let mut raw = RawConn {
            connection,
            _endpoint: endpoint,
            next_id: AtomicU64::new(1),
            crc: BodyChecksum::Required,
        };
        let hello = Call::Hello(Hello {
            version_min: kiln_wire::PROTOCOL_VERSION,
            version_max: kiln_wire::PROTOCOL_VERSION,
            capabilities,
            client_name: Label::new(&b"hostile"[..]).expect("label"),
        });
        match raw.call(hello).await {
            Answer::Reply(Message::Reply(Reply {
                outcome: Outcome::Hello(reply),
                ..
            })) => {
                raw.crc = reply.capabilities.body_checksum();
                (raw, reply)
            }
            other => panic!("raw HELLO: {other:?}"),
        }
    }

    /// The next event the brick pushes: one frame on a unidirectional stream of its own.
    pub async fn event(&self) -> Message {
        let mut recv = within(
            "an event stream from the brick",
            self.connection.accept_uni(),
        )
        .await
        .expect("an event stream");
        within("the event's frame", quic::read_message(&mut recv, self.crc))
            .await
            .expect("an event frame")
    }

    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// A request frame for `call`.
    pub fn request(&self, call: Call) -> Vec<u8> {
        let request = Message::Request(Request {
            id: self.next_id(),
            call,
        });
        request
            .encode_with(self.crc)
            .expect("encode")
            .to_bytes()
            .to_vec()
    }

    pub async fn call(&self, call: Call) -> Answer {
        let frame = self.request(call);
        self.exchange(&frame, true).await
    }

    /// Sends `frame` on a new stream (finishing it when `finish`) and reads what comes back.
    pub async fn exchange(&self, frame: &[u8], finish: bool) -> Answer {
        let work = async {
            let (mut send, mut recv) = match self.connection.open_bi().await {
                Ok(s) => s,
                Err(e) => return Answer::Failed(format!("open: {e}")),
            };
            // The brick may refuse the frame before it has all of it: a write that fails
            // because the brick stopped the stream is expected, the answer says why.
            if send.write_all(frame).await.is_ok() && finish {
                let _ = send.finish();
            }
            let answer = match quic::read_message(&mut recv, self.crc).await {
                Ok(m) => Answer::Reply(m),
                Err(quic::StreamError::Read(quinn::ReadError::Reset(code))) => {
                    Answer::Reset(code.into_inner())
                }
                Err(e) => Answer::Failed(e.to_string()),
            };
            drop(send);
            answer
        };
        within("a raw stream's answer", work).await
    }

    /// Sends `frame` and expects the brick to reset that stream as a bad frame.
    pub async fn expect_reset(&self, what: &str, frame: &[u8], finish: bool) {
        match self.exchange(frame, finish).await {
            Answer::Reset(code) if code == StreamCode::BadFrame as u64 => {}
            other => panic!("{what}: expected the stream reset as a bad frame, got {other:?}"),
        }
    }

    /// A PING that must be echoed on this connection.
    pub async fn ping(&self, what: &str) {
        let nonce = self.next_id();
        match self.call(Call::Ping(Ping { nonce })).await {
            Answer::Reply(Message::Reply(Reply {
                outcome: Outcome::Ping(Ping { nonce: echoed }),
                ..
            })) if echoed == nonce => {}
            other => panic!("{what}: PING not echoed: {other:?}"),
        }
    }

    /// Runs a fop and returns its outcome.
    pub async fn fop(&self, creds: Creds, fop: impl Into<FopRequest>) -> Answer {
        self.call(Call::Fop {
            creds,
            fop: fop.into(),
        })
        .await
    }
}

// ---- frames as bytes ----

/// A message as one frame.
pub fn encode(message: &Message) -> Vec<u8> {
    message.encode().expect("encode").to_bytes().to_vec()
}

/// The header and body of an encoded frame.
pub fn split(frame: &[u8]) -> (Header, Vec<u8>) {
    let header = Header::decode_prefix(frame).expect("a valid header");
    (
        header,
        frame[kiln_wire::limits::FRAME_HEADER_LEN_BYTES..].to_vec(),
    )
}

/// `body` under `header`, with the header's length and body checksum made to match: a frame
/// whose only lies are inside the body.
pub fn reframe(mut header: Header, body: &[u8]) -> Vec<u8> {
    header.body_len = u32::try_from(body.len()).expect("small body");
    header.body_checksum = checksum(body);
    let mut frame = header.encode().to_vec();
    frame.extend_from_slice(body);
    frame
}

/// `frame` with its one occurrence of `from` in the body replaced by `to`, lengths and
/// checksum fixed up in the header.
pub fn patched(frame: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    let (header, body) = split(frame);
    let at: Vec<usize> = body
        .windows(from.len())
        .enumerate()
        .filter(|(_, w)| *w == from)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(at.len(), 1, "the placeholder must occur once in the body");
    let mut out = body[..at[0]].to_vec();
    out.extend_from_slice(to);
    out.extend_from_slice(&body[at[0] + from.len()..]);
    reframe(header, &out)
}

/// A name as the wire carries it: a one-byte length, then the bytes.
pub fn wire_name(bytes: &[u8]) -> Vec<u8> {
    let mut out = vec![u8::try_from(bytes.len()).expect("short name")];
    out.extend_from_slice(bytes);
    out
}

/// A GFID unlikely to occur by chance in a frame, to be patched.
pub fn placeholder_gfid() -> Gfid {
    Gfid::from_bytes([0xA7; 16]).expect("not null")
}

/// A fresh GFID (re-exported for the tests).
pub fn gfid() -> Gfid {
    new_gfid()
}

// ---- the brick process ----

/// `VmRSS` of process `pid`, in KiB.
pub fn vm_rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/PID/status")
}
