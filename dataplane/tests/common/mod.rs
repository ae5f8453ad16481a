//! A brick in a temporary directory with an engine on it, and fop helpers that read like the
//! syscalls they stand for.
#![allow(dead_code, reason = "each test binary uses a different subset")]
#![allow(
    unreachable_pub,
    reason = "a test helper module, public to its test binaries"
)]

use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use kiln_dataplane::{Brick, Engine, EngineConfig, EngineKind, FopsConfig, Session};
use kiln_wire::*;

pub struct Harness {
    pub dir: tempfile::TempDir,
    pub brick: Arc<Brick>,
    pub engine: Engine,
    pub rt: tokio::runtime::Runtime,
    pub session: Session,
    next_gfid: std::cell::Cell<u64>,
}

pub fn root() -> Creds {
    Creds::root()
}

pub fn user(uid: u32) -> Creds {
    Creds {
        uid,
        gid: uid,
        groups: Groups::default(),
        pid: 1,
    }
}

pub fn name(s: &str) -> Name {
    Name::new(s.to_owned()).expect("valid name")
}

pub fn mode(m: u32) -> Mode {
    Mode::new(m).expect("valid mode")
}

/// A PUT of `data` as `parent/n` with GFID `gfid`: mode 0644, no umask, no flags, no
/// attributes (change a field with `Put { attr, ..small_put(…) }`).
pub fn small_put(parent: Gfid, n: &str, gfid: Gfid, data: &[u8]) -> Put {
    Put {
        parent,
        name: name(n),
        gfid,
        mode: mode(0o644),
        umask: mode(0),
        flags: OpenFlags::empty(),
        data: Payload::new(Bytes::copy_from_slice(data)).expect("small"),
        attr: SetAttr::default(),
    }
}

impl Harness {
    pub fn new(kind: EngineKind) -> Harness {
        Harness::with(kind, FopsConfig::default())
    }

    pub fn with(kind: EngineKind, fops: FopsConfig) -> Harness {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("brick");
        Brick::format(&path).expect("format");
        Harness::reopen(dir, &path, kind, fops)
    }

    /// Opens (after repairing) the brick at `path`.
    pub fn reopen(
        dir: tempfile::TempDir,
        path: &std::path::Path,
        kind: EngineKind,
        fops: FopsConfig,
    ) -> Harness {
        let brick = Arc::new(Brick::open(path).expect("open brick"));
        kiln_dataplane::recovery::repair(&brick).expect("repair");
        let mut config = EngineConfig {
            kind,
            workers: 2,
            fops,
            ..EngineConfig::default()
        };
        // One fop at a time would run every chain as plain system calls on an idle worker
        // (the blocking engine's path, tested by its own runs): make the ring run them.
        config.ring.idle_inline = false;
        let engine = Engine::start(&brick, &config).expect("engine");
        // The per-engine tests must really run on the engine they name (no silent fallback).
        assert_eq!(engine.kind(), kind, "the engine fell back");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let session = engine.session();
        Harness {
            dir,
            brick,
            engine,
            rt,
            session,
            next_gfid: std::cell::Cell::new(1),
        }
    }

    pub fn path(&self) -> PathBuf {
        self.dir.path().join("brick")
    }

    pub fn gfid(&self) -> Gfid {
        let n = self.next_gfid.get();
        self.next_gfid.set(n + 1);
        let mut b = *kiln_dataplane::brick::new_gfid().as_bytes();
        b[8..16].copy_from_slice(&n.to_be_bytes());
        Gfid::from_bytes(b).expect("non-null")
    }

    pub fn call_as(
        &self,
        session: &Session,
        creds: &Creds,
        fop: impl Into<FopRequest>,
    ) -> Result<FopReply, ErrorCode> {
        self.rt.block_on(session.call(creds.clone(), fop.into()))
    }

    pub fn call(&self, creds: &Creds, fop: impl Into<FopRequest>) -> Result<FopReply, ErrorCode> {
        self.call_as(&self.session, creds, fop)
    }

    pub fn lookup(&self, parent: Gfid, n: &str) -> Result<Iatt, ErrorCode> {
        match self.call(
            &root(),
            Lookup {
                parent,
                name: name(n),
            },
        )? {
            FopReply::Lookup(r) => Ok(r.iatt),
            other => panic!("unexpected {other:?}"),
        }
    }

    pub fn mkdir_as(
        &self,
        creds: &Creds,
        parent: Gfid,
        n: &str,
        m: u32,
    ) -> Result<Gfid, ErrorCode> {
        let gfid = self.gfid();
        self.call(
            creds,
            Mkdir {
                parent,
                name: name(n),
                gfid,
                mode: mode(m),
                umask: mode(0),
            },
        )?;
        Ok(gfid)
    }

    pub fn mkdir(&self, parent: Gfid, n: &str) -> Result<Gfid, ErrorCode> {
        self.mkdir_as(&root(), parent, n, 0o755)
    }

    pub fn put_as(
        &self,
        creds: &Creds,
        parent: Gfid,
        n: &str,
        data: &[u8],
    ) -> Result<Gfid, ErrorCode> {
        let gfid = self.gfid();
        self.call(creds, small_put(parent, n, gfid, data))?;
        Ok(gfid)
    }

    pub fn put(&self, parent: Gfid, n: &str, data: &[u8]) -> Result<Gfid, ErrorCode> {
        self.put_as(&root(), parent, n, data)
    }

    pub fn open(&self, gfid: Gfid, access: AccessMode) -> Result<FdId, ErrorCode> {
        self.open_as(&root(), gfid, access)
    }

    pub fn open_as(
        &self,
        creds: &Creds,
        gfid: Gfid,
        access: AccessMode,
    ) -> Result<FdId, ErrorCode> {
        match self.call(
            creds,
            Open {
                gfid,
                access,
                flags: OpenFlags::empty(),
            },
        )? {
            FopReply::Open(r) => Ok(r.fd),
            other => panic!("unexpected {other:?}"),
        }
    }

    pub fn read_all(&self, gfid: Gfid) -> Result<Vec<u8>, ErrorCode> {
        let fd = self.open(gfid, AccessMode::ReadOnly)?;
        let mut out = Vec::new();
        loop {
            let size = ReadSize::new(65536).expect("valid");
            let FopReply::Read(r) = self.call(
                &root(),
                Read {
                    fd,
                    offset: out.len() as u64,
                    size,
                },
            )?
            else {
                panic!()
            };
            if r.data.is_empty() {
                break;
            }
            out.extend_from_slice(r.data.as_bytes());
        }
        self.call(&root(), Release { fd })?;
        Ok(out)
    }

    pub fn stat(&self, gfid: Gfid) -> Result<Iatt, ErrorCode> {
        match self.call(&root(), Stat { gfid })? {
            FopReply::Stat(r) => Ok(r.iatt),
            other => panic!("unexpected {other:?}"),
        }
    }

    pub fn unlink(&self, parent: Gfid, n: &str) -> Result<(), ErrorCode> {
        self.call(
            &root(),
            Unlink {
                parent,
                name: name(n),
            },
        )
        .map(drop)
    }

    pub fn rmdir(&self, parent: Gfid, n: &str) -> Result<(), ErrorCode> {
        self.call(
            &root(),
            Rmdir {
                parent,
                name: name(n),
            },
        )
        .map(drop)
    }

    pub fn rename(
        &self,
        op: Gfid,
        on: &str,
        np: Gfid,
        nn: &str,
        mode: RenameMode,
    ) -> Result<(), ErrorCode> {
        self.call(
            &root(),
            Rename {
                old_parent: op,
                old_name: name(on),
                new_parent: np,
                new_name: name(nn),
                mode,
            },
        )
        .map(drop)
    }

    /// Every name in a directory (READDIR until eof), sorted.
    pub fn list(&self, gfid: Gfid) -> Result<Vec<String>, ErrorCode> {
        let mut names = self.pages(gfid, |fd, offset| {
            let size = ReaddirSize::new(4096).expect("valid");
            let FopReply::Readdir(r) = self.call(&root(), Readdir { fd, offset, size })? else {
                panic!()
            };
            let entries = r.entries.iter().map(|e| (e.name.to_string(), e.offset));
            Ok((entries.collect(), r.eof))
        })?;
        names.sort();
        Ok(names)
    }

    /// READDIRP of directory `gfid` through, in small pages: each name with its GFID.
    pub fn list_plus(&self, gfid: Gfid) -> Result<Vec<(String, Gfid)>, ErrorCode> {
        self.pages(gfid, |fd, offset| {
            let size = ReaddirSize::new(1024).expect("valid");
            let FopReply::Readdirp(r) = self.call(&root(), Readdirp { fd, offset, size })? else {
                panic!()
            };
            let entries = r.entries.iter();
            let entries = entries.map(|e| ((e.name.to_string(), e.iatt.gfid), e.offset));
            Ok((entries.collect(), r.eof))
        })
    }

    /// Opens directory `gfid` and reads it through with `page` (from an offset: the items
    /// with the offset after each, and whether the end was reached), then releases it.
    fn pages<T>(
        &self,
        gfid: Gfid,
        mut page: impl FnMut(FdId, u64) -> Result<(Vec<(T, u64)>, bool), ErrorCode>,
    ) -> Result<Vec<T>, ErrorCode> {
        let FopReply::Opendir(o) = self.call(&root(), Opendir { gfid })? else {
            panic!()
        };
        let (mut offset, mut all) = (0, Vec::new());
        loop {
            let (items, eof) = page(o.fd, offset)?;
            for (item, next) in items {
                all.push(item);
                offset = next;
            }
            if eof {
                break;
            }
        }
        self.call(&root(), Releasedir { fd: o.fd })?;
        Ok(all)
    }

    /// Asserts the brick's on-disk layout is consistent (no stale handles, nothing pending).
    pub fn assert_consistent(&self) {
        let report = kiln_dataplane::recovery::check(&self.brick, false).expect("check runs");
        assert_eq!(report.problems(), 0, "brick inconsistent:\n{report}");
    }
}

/// Runs each listed test once per engine.
#[macro_export]
macro_rules! per_engine {
    ($($test:ident),* $(,)?) => {
        mod uring {
            $( #[test] fn $test() { super::$test(kiln_dataplane::EngineKind::Uring) } )*
        }
        mod blocking {
            $( #[test] fn $test() { super::$test(kiln_dataplane::EngineKind::Blocking) } )*
        }
    };
}
