//! The fop targets of `kiln-bench smallfile`: the brick's engine called directly (`engine`),
//! or a client over QUIC to a brick served in this process (`volume`); every worker is a task
//! with a session (or a share of the connection) of its own.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use hdrhistogram::Histogram;
use kiln_client::BrickClient;
use kiln_dataplane::Brick;
use kiln_dataplane::engine::{Engine, EngineConfig};
use kiln_dataplane::server::Server;
use kiln_wire::limits::IO_SIZE_MAX_BYTES;
use kiln_wire::quic::UDP_PAYLOAD_MAX_BYTES;
use kiln_wire::*;
use serde_json::json;

use super::plan::{CHMOD_MODE, Kind, Layout, PlanStep, SmallfileOp, XATTR_NAME, XATTR_VALUE_BYTES};
use super::{Pass, Runner, merge};
use crate::bricks::{Caller, Destination, Served, open_engine, run_tasks};
use crate::report::{histogram, nanos};
use crate::scratch::Scratch;

/// Bytes asked for per READDIR/READDIRP.
const READDIR_CHUNK_BYTES: u32 = 64 * 1024;
/// How long the in-process server gets to drain at the end.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// The fop targets: the engine called directly, or a client over QUIC.
pub(super) struct FopRunner {
    rt: tokio::runtime::Runtime,
    engine: Engine,
    /// The brick (kept open until the end).
    _brick: Arc<Brick>,
    /// Over QUIC: the server and the connected client.
    served: Option<(Server, BrickClient)>,
    layout: Arc<Layout>,
    threads: usize,
    fsync: bool,
    data: Bytes,
}

impl FopRunner {
    pub(super) fn start_engine(
        brick_dir: &Path,
        config: &EngineConfig,
        layout: &Layout,
        threads: usize,
        fsync: bool,
    ) -> anyhow::Result<FopRunner> {
        Brick::format(brick_dir)?;
        let (brick, engine) = open_engine(brick_dir, config)?;
        FopRunner::new(
            client_runtime()?,
            engine,
            brick,
            None,
            layout,
            threads,
            fsync,
        )
    }

    pub(super) fn start_volume(
        dir: &Path,
        config: &EngineConfig,
        scratch: &Scratch,
        layout: &Layout,
        threads: usize,
        fsync: bool,
    ) -> anyhow::Result<FopRunner> {
        let served = Served::start(&dir.join("brick"), &scratch.path(), config, 0)?;
        // The client's connection is driven by the runtime it was made on: every later call
        // runs on the same one.
        let rt = client_runtime()?;
        let (server, volume) = rt.block_on(served.serve_and_connect(UDP_PAYLOAD_MAX_BYTES))?;
        let Served { brick, engine, .. } = served;
        FopRunner::new(
            rt,
            engine,
            brick,
            Some((server, volume)),
            layout,
            threads,
            fsync,
        )
    }

    fn new(
        rt: tokio::runtime::Runtime,
        engine: Engine,
        brick: Arc<Brick>,
        served: Option<(Server, BrickClient)>,
        layout: &Layout,
        threads: usize,
        fsync: bool,
    ) -> anyhow::Result<FopRunner> {
        let fops = FopRunner {
            rt,
            engine,
            _brick: brick,
            served,
            layout: Arc::new(layout.clone()),
            threads,
            fsync,
            data: Bytes::from(vec![0x5a; layout.file_bytes]),
        };
        let layout = fops.layout.clone();
        fops.tasks(move |t, caller| {
            let layout = layout.clone();
            async move { make_dirs(&caller, &layout, t).await }
        })?;
        Ok(fops)
    }

    fn tasks<T, F, Fut>(&self, job: F) -> anyhow::Result<Vec<T>>
    where
        T: Send + 'static,
        F: Fn(usize, Caller) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = anyhow::Result<T>> + 'static,
    {
        let destination = match &self.served {
            Some((_, volume)) => Destination::Volume(volume),
            None => Destination::Engine(&self.engine),
        };
        run_tasks(&self.rt, destination, self.threads, job)
    }
}

fn client_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

fn mode(bits: u32) -> anyhow::Result<Mode> {
    Mode::new(bits).context("mode bits")
}

fn name(s: String) -> anyhow::Result<Name> {
    Ok(Name::new(s)?)
}

/// Thread `t`'s top directory, its file directories and its mkdir directories.
async fn make_dirs(caller: &Caller, layout: &Layout, t: usize) -> anyhow::Result<()> {
    let mkdir = |parent, name: String, gfid| -> anyhow::Result<FopRequest> {
        Ok(Mkdir {
            parent,
            name: Name::new(name)?,
            gfid,
            mode: mode(0o755)?,
            umask: mode(0)?,
        }
        .into())
    };
    let top = layout.gfid(Kind::Top, t, 0);
    caller.call(mkdir(Gfid::ROOT, Layout::top(t), top)?).await?;
    for k in 0..layout.dirs() {
        let dir = mkdir(top, Layout::dir(k), layout.gfid(Kind::FileDir, t, k))?;
        caller.call(dir).await?;
        let dir = mkdir(top, Layout::mkdir_dir(k), layout.gfid(Kind::MkdirDir, t, k))?;
        caller.call(dir).await?;
    }
    Ok(())
}

/// What one fop task needs (cheap to clone into every task).
#[derive(Debug, Clone)]
struct FopJob {
    layout: Arc<Layout>,
    step: PlanStep,
    fsync: bool,
    data: Bytes,
}

impl FopJob {
    /// `step` on thread `t`'s files, one at a time.
    async fn thread(&self, caller: &Caller, t: usize) -> anyhow::Result<Histogram<u64>> {
        let layout = &self.layout;
        let mut h = histogram()?;
        if self.step.op.per_directory() {
            for k in 0..layout.dirs() {
                let dir = layout.gfid(Kind::FileDir, t, k);
                let start = Instant::now();
                let entries = list(caller, dir, self.step.op == SmallfileOp::LsL).await?;
                h.record(nanos(start.elapsed()))?;
                let want = layout.files_in(k);
                if entries != want {
                    bail!("directory {k} of thread {t}: {entries} entries, not {want}");
                }
            }
            return Ok(h);
        }
        for i in 0..layout.files {
            let start = Instant::now();
            self.file_op(caller, t, i)
                .await
                .with_context(|| format!("file {i} of thread {t}"))?;
            h.record(nanos(start.elapsed()))?;
        }
        Ok(h)
    }

    async fn file_op(&self, caller: &Caller, t: usize, i: usize) -> anyhow::Result<()> {
        let (layout, step) = (&self.layout, &self.step);
        let parent = layout.gfid(Kind::FileDir, t, i / layout.fanout);
        let gfid = layout.gfid(Kind::File, t, i);
        let file_name = || name(Layout::file(i, step.renamed));
        match step.op {
            SmallfileOp::Create => {
                let put = Put {
                    parent,
                    name: file_name()?,
                    gfid,
                    mode: mode(0o644)?,
                    umask: mode(0)?,
                    // O_SYNC: the write is on stable storage when the PUT returns, as a
                    // write + fsync is.
                    flags: match self.fsync {
                        true => OpenFlags::SYNC,
                        false => OpenFlags::empty(),
                    },
                    data: Payload::new(self.data.clone())?,
                    attr: SetAttr::default(),
                };
                caller.call(put).await?;
            }
            SmallfileOp::Read => read_all(caller, gfid, step.size).await?,
            SmallfileOp::Append => self.append(caller, gfid, step.size as u64).await?,
            SmallfileOp::Stat => {
                let name = file_name()?;
                caller.call(Lookup { parent, name }).await?;
            }
            SmallfileOp::Chmod => {
                let attr = SetAttr {
                    mode: Some(mode(CHMOD_MODE)?),
                    ..SetAttr::default()
                };
                caller.call(Setattr { gfid, attr }).await?;
            }
            SmallfileOp::Setxattr => {
                let set = Setxattr {
                    gfid,
                    name: XattrName::new(XATTR_NAME)?,
                    value: XattrValue::new(vec![0xa5; XATTR_VALUE_BYTES])?,
                    mode: XattrSetMode::Upsert,
                };
                caller.call(set).await?;
            }
            SmallfileOp::Getxattr => {
                let get = Getxattr {
                    gfid,
                    name: XattrName::new(XATTR_NAME)?,
                };
                match caller.call(get).await? {
                    FopReply::Getxattr(r) if r.value.len() == XATTR_VALUE_BYTES => {}
                    other => bail!("GETXATTR answered {other:?}"),
                }
            }
            SmallfileOp::Rename => {
                let rename = Rename {
                    old_parent: parent,
                    old_name: file_name()?,
                    new_parent: parent,
                    new_name: name(Layout::file(i, !step.renamed))?,
                    mode: RenameMode::Replace,
                };
                caller.call(rename).await?;
            }
            SmallfileOp::Delete => {
                let name = file_name()?;
                caller.call(Unlink { parent, name }).await?;
            }
            SmallfileOp::Mkdir | SmallfileOp::Rmdir => {
                let parent = layout.gfid(Kind::MkdirDir, t, i / layout.fanout);
                let name = name(Layout::subdir(i))?;
                match step.op {
                    SmallfileOp::Mkdir => {
                        let gfid = layout.gfid(Kind::Mkdir, t, i);
                        let (mode, umask) = (mode(0o755)?, mode(0)?);
                        let mkdir = Mkdir {
                            parent,
                            name,
                            gfid,
                            mode,
                            umask,
                        };
                        caller.call(mkdir).await?;
                    }
                    _ => drop(caller.call(Rmdir { parent, name }).await?),
                }
            }
            SmallfileOp::Readdir | SmallfileOp::LsL => unreachable!("listed per directory"),
        }
        Ok(())
    }

    /// Opens `gfid` for appending, writes the data at `offset` (the file's size), fsyncs it
    /// if asked, and releases it.
    async fn append(&self, caller: &Caller, gfid: Gfid, offset: u64) -> anyhow::Result<()> {
        let fd = open(caller, gfid, AccessMode::WriteOnly, OpenFlags::APPEND).await?;
        let data = Payload::new(self.data.clone())?;
        let written = caller.call(Write { fd, offset, data }).await;
        let synced = match (written.is_ok(), self.fsync) {
            (true, true) => caller
                .call(Fsync {
                    fd,
                    datasync: false,
                })
                .await
                .map(drop),
            _ => Ok(()),
        };
        caller.call(Release { fd }).await?;
        written?;
        synced?;
        Ok(())
    }
}

/// Opens `gfid`, reads it to its end (asking for a byte more than it should hold), releases
/// it, and checks it held `file_bytes` bytes.
async fn read_all(caller: &Caller, gfid: Gfid, file_bytes: usize) -> anyhow::Result<()> {
    let fd = open(caller, gfid, AccessMode::ReadOnly, OpenFlags::empty()).await?;
    let mut got = 0;
    let result = async {
        loop {
            let want = (file_bytes + 1 - got).min(IO_SIZE_MAX_BYTES);
            let size = ReadSize::saturating(want as u64);
            let offset = got as u64;
            match caller.call(Read { fd, offset, size }).await? {
                FopReply::Read(r) if r.data.is_empty() => return Ok(()),
                FopReply::Read(r) => got += r.data.len(),
                other => bail!("READ answered {:?}", other.code()),
            }
        }
    }
    .await;
    caller.call(Release { fd }).await?;
    result?;
    if got != file_bytes {
        bail!("read {got} bytes, not {file_bytes}");
    }
    Ok(())
}

async fn open(
    caller: &Caller,
    gfid: Gfid,
    access: AccessMode,
    flags: OpenFlags,
) -> anyhow::Result<FdId> {
    match caller
        .call(Open {
            gfid,
            access,
            flags,
        })
        .await?
    {
        FopReply::Open(o) => Ok(o.fd),
        other => bail!("OPEN answered {:?}", other.code()),
    }
}

/// Lists directory `gfid` with READDIRP (`plus`, the attributes too: `ls -l`) or READDIR;
/// returns the entry count without `.` and `..`.
async fn list(caller: &Caller, gfid: Gfid, plus: bool) -> anyhow::Result<usize> {
    let fd = match caller.call(Opendir { gfid }).await? {
        FopReply::Opendir(o) => o.fd,
        other => bail!("OPENDIR answered {:?}", other.code()),
    };
    let size = ReaddirSize::new(READDIR_CHUNK_BYTES).context("readdir size")?;
    let counted = async {
        let (mut offset, mut entries) = (0, 0);
        loop {
            let (eof, names): (bool, Vec<(u64, Name)>) = match plus {
                true => match caller.call(Readdirp { fd, offset, size }).await? {
                    FopReply::Readdirp(r) => {
                        let names = r.entries.into_iter().map(|e| (e.offset, e.name));
                        (r.eof, names.collect())
                    }
                    other => bail!("READDIRP answered {:?}", other.code()),
                },
                false => match caller.call(Readdir { fd, offset, size }).await? {
                    FopReply::Readdir(r) => {
                        let names = r.entries.into_iter().map(|e| (e.offset, e.name));
                        (r.eof, names.collect())
                    }
                    other => bail!("READDIR answered {:?}", other.code()),
                },
            };
            for (next, name) in &names {
                offset = *next;
                if !matches!(name.as_bytes(), b"." | b"..") {
                    entries += 1;
                }
            }
            if eof || names.is_empty() {
                return Ok(entries);
            }
        }
    }
    .await;
    caller.call(Releasedir { fd }).await?;
    counted
}

impl Runner for FopRunner {
    fn run(&mut self, step: &PlanStep) -> anyhow::Result<Pass> {
        let job = FopJob {
            layout: self.layout.clone(),
            step: *step,
            fsync: self.fsync,
            data: self.data.clone(),
        };
        let start = Instant::now();
        let histograms = self.tasks(move |t, caller| {
            let job = job.clone();
            async move { job.thread(&caller, t).await }
        })?;
        let elapsed = start.elapsed();
        Ok(Pass {
            elapsed,
            latency: merge(histograms)?,
        })
    }

    fn finish(self: Box<Self>) -> anyhow::Result<serde_json::Value> {
        let FopRunner {
            rt, engine, served, ..
        } = *self;
        let note = json!({
            "target": match served { Some(_) => "volume", None => "engine" },
            "engine": engine.kind().name(), "engine_workers": engine.workers(),
        });
        if let Some((server, volume)) = served {
            rt.block_on(async {
                volume.close().await;
                server.shutdown(SHUTDOWN_GRACE).await;
            });
        }
        Ok(note)
    }
}
