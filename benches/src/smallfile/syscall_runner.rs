//! The syscall targets of `kiln-bench smallfile` (`local`, `path=DIR`, `kiln-mount`): plain
//! system calls (std::fs, rustix) on OS threads released together.

use std::io::{Read as _, Write as _};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hdrhistogram::Histogram;
use serde_json::json;

use super::plan::{CHMOD_MODE, Layout, PlanStep, SmallfileOp, XATTR_NAME, XATTR_VALUE_BYTES};
use super::{Pass, Runner, merge};
use crate::mount::KilnMount;
use crate::report::{histogram, nanos};
use crate::scratch::fs_type;

/// Runs `job(t)` on `threads` OS threads released together; returns their results and the
/// time from the first one's start to the last one's end. Each thread reads the clock
/// itself: on 2 cores the thread that released them may not run again until they are done.
fn run_threads<T: Send>(
    threads: usize,
    job: impl Fn(usize) -> anyhow::Result<T> + Sync,
) -> anyhow::Result<(Vec<T>, Duration)> {
    let barrier = Barrier::new(threads);
    let ran = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (barrier, job) = (&barrier, &job);
                s.spawn(move || {
                    barrier.wait();
                    let start = Instant::now();
                    let result = job(t);
                    (start, Instant::now(), result)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| anyhow::anyhow!("a worker thread panicked"))
            })
            .collect::<anyhow::Result<Vec<_>>>()
    })?;
    let first = ran.iter().map(|r| r.0).min();
    let last = ran.iter().map(|r| r.1).max();
    let elapsed = match (first, last) {
        (Some(first), Some(last)) => last - first,
        _ => Duration::ZERO,
    };
    let results = ran
        .into_iter()
        .map(|r| r.2)
        .collect::<anyhow::Result<Vec<T>>>()?;
    Ok((results, elapsed))
}

/// The syscall targets: `local`, `path=DIR` and `kiln-mount`.
pub(super) struct SyscallRunner {
    base: PathBuf,
    layout: Layout,
    threads: usize,
    fsync: bool,
    data: Vec<u8>,
    xattr: Vec<u8>,
    mount: Option<KilnMount>,
    /// The type of the file system under `base`.
    fs: String,
}

impl SyscallRunner {
    pub(super) fn start(
        base: PathBuf,
        layout: &Layout,
        threads: usize,
        fsync: bool,
        mount: Option<KilnMount>,
    ) -> anyhow::Result<SyscallRunner> {
        for t in 0..threads {
            let top = base.join(Layout::top(t));
            for k in 0..layout.dirs() {
                for dir in [Layout::dir(k), Layout::mkdir_dir(k)] {
                    let path = top.join(dir);
                    std::fs::create_dir_all(&path)
                        .with_context(|| format!("cannot create {}", path.display()))?;
                }
            }
        }
        Ok(SyscallRunner {
            fs: fs_type(&base),
            base,
            layout: layout.clone(),
            threads,
            fsync,
            data: vec![0x5a; layout.file_bytes],
            xattr: vec![0xa5; XATTR_VALUE_BYTES],
            mount,
        })
    }

    /// `step` on thread `t`'s files, one at a time, then its changes settled ([`settle`]).
    fn thread(&self, t: usize, step: &PlanStep) -> anyhow::Result<Histogram<u64>> {
        let top = self.base.join(Layout::top(t));
        let latency = self.ops(&top, t, step)?;
        settle(&top).with_context(|| format!("fsync of {}", top.display()))?;
        Ok(latency)
    }

    /// `step` on the files under `top` (thread `t`'s), one at a time: each op's latency.
    fn ops(&self, top: &Path, t: usize, step: &PlanStep) -> anyhow::Result<Histogram<u64>> {
        let mut h = histogram()?;
        let mut buf = Vec::with_capacity(step.size + 1);
        let fanout = self.layout.fanout;
        if step.op.per_directory() {
            for k in 0..self.layout.dirs() {
                let start = Instant::now();
                let entries = self.list(&top.join(Layout::dir(k)), step.op == SmallfileOp::LsL)?;
                h.record(nanos(start.elapsed()))?;
                let want = self.layout.files_in(k);
                if entries != want {
                    bail!("directory {k} of thread {t}: {entries} entries, not {want}");
                }
            }
            return Ok(h);
        }
        for i in 0..self.layout.files {
            let dir = top.join(Layout::dir(i / fanout));
            let path = dir.join(Layout::file(i, step.renamed));
            let start = Instant::now();
            self.file_op(step, i, &dir, &path, &mut buf)
                .with_context(|| format!("{}", path.display()))?;
            h.record(nanos(start.elapsed()))?;
        }
        Ok(h)
    }

    fn file_op(
        &self,
        step: &PlanStep,
        i: usize,
        dir: &Path,
        path: &Path,
        buf: &mut Vec<u8>,
    ) -> anyhow::Result<()> {
        match step.op {
            SmallfileOp::Create => {
                let mut f = std::fs::File::options()
                    .write(true)
                    .create_new(true)
                    .open(path)?;
                self.write_records(&mut f)?;
                if self.fsync {
                    f.sync_all()?;
                }
            }
            SmallfileOp::Read => {
                buf.clear();
                let n = std::fs::File::open(path)?.read_to_end(buf)?;
                if n != step.size {
                    bail!("read {n} bytes, not {}", step.size);
                }
            }
            SmallfileOp::Append => {
                let mut f = std::fs::File::options().append(true).open(path)?;
                self.write_records(&mut f)?;
                if self.fsync {
                    f.sync_all()?;
                }
            }
            SmallfileOp::Stat => {
                std::fs::symlink_metadata(path)?;
            }
            SmallfileOp::Chmod => {
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(CHMOD_MODE))?;
            }
            SmallfileOp::Setxattr => rustix::fs::lsetxattr(
                path,
                XATTR_NAME,
                &self.xattr,
                rustix::fs::XattrFlags::empty(),
            )?,
            SmallfileOp::Getxattr => {
                let mut value = [0u8; XATTR_VALUE_BYTES + 1];
                let n = rustix::fs::lgetxattr(path, XATTR_NAME, &mut value[..])?;
                if n != XATTR_VALUE_BYTES {
                    bail!("{XATTR_NAME} has {n} bytes, not {XATTR_VALUE_BYTES}");
                }
            }
            SmallfileOp::Rename => std::fs::rename(path, dir.join(Layout::file(i, !step.renamed)))?,
            SmallfileOp::Delete => std::fs::remove_file(path)?,
            SmallfileOp::Mkdir | SmallfileOp::Rmdir => {
                let sub = dir
                    .with_file_name(Layout::mkdir_dir(i / self.layout.fanout))
                    .join(Layout::subdir(i));
                match step.op {
                    SmallfileOp::Mkdir => std::fs::create_dir(sub)?,
                    _ => std::fs::remove_dir(sub)?,
                }
            }
            SmallfileOp::Readdir | SmallfileOp::LsL => unreachable!("listed per directory"),
        }
        Ok(())
    }

    /// Lists `dir` (and `lstat`s every entry for `ls -l`); returns the entry count.
    /// Writes the file's bytes to `f` in records of the layout's size.
    fn write_records(&self, f: &mut std::fs::File) -> std::io::Result<()> {
        for record in self.data.chunks(self.layout.record_bytes) {
            f.write_all(record)?;
        }
        Ok(())
    }

    fn list(&self, dir: &Path, stat_each: bool) -> anyhow::Result<usize> {
        let mut entries = 0;
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            if stat_each {
                std::fs::symlink_metadata(entry.path())?;
            }
            entries += 1;
        }
        Ok(entries)
    }
}

impl Runner for SyscallRunner {
    fn run(&mut self, step: &PlanStep) -> anyhow::Result<Pass> {
        let (histograms, elapsed) = run_threads(self.threads, |t| self.thread(t, step))?;
        Ok(Pass {
            elapsed,
            latency: merge(histograms)?,
        })
    }

    fn finish(self: Box<Self>) -> anyhow::Result<serde_json::Value> {
        let SyscallRunner {
            base, mount, fs, ..
        } = *self;
        match mount {
            Some(mount) => {
                std::fs::remove_dir_all(&base)
                    .or_else(|_| empty_dir(&base))
                    .with_context(|| format!("cannot empty {}", base.display()))?;
                let stopped = mount.finish()?;
                Ok(json!({ "target": "kiln-mount", "fs": fs, "stopped": stopped }))
            }
            None => {
                std::fs::remove_dir_all(&base)
                    .with_context(|| format!("cannot remove {}", base.display()))?;
                Ok(json!({ "dir": base.display().to_string(), "fs": fs, "removed": true }))
            }
        }
    }
}

/// Ends a thread's pass as an application that wants its changes kept does: an fsync of its
/// top directory, inside the pass's time (not in any op's latency). On a local file system
/// it commits the journal; on a Kiln mount it also waits until every change the mount
/// answered ahead of the brick (creates, writes, chmods, renames, unlinks under a lease) is
/// on the brick, so a pass is timed until its work is done, not until it was queued, and
/// the next pass does not pay for it.
fn settle(top: &Path) -> std::io::Result<()> {
    std::fs::File::open(top)?.sync_all()
}

/// Removes everything inside `dir` (a mount point, which itself stays).
fn empty_dir(dir: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        match path.is_dir() {
            true => std::fs::remove_dir_all(&path)?,
            false => std::fs::remove_file(&path)?,
        }
    }
    Ok(())
}
