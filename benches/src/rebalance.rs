//! `kiln-bench rebalance`: how fast Kiln's rebalance moves files to a brick added to a
//! distributed volume (or, with `--remove`, off a brick being removed), against plain
//! syscalls moving as many files of the same size on the same file system, one at a time as
//! the rebalance moves them.
//!
//! * **Kiln.** `bricks + 1` fresh bricks (`kiln-brickd format`), each served by its own
//!   `kiln-brickd serve` on loopback (mutual TLS, the bench's client trusted with root:
//!   layouts and link files are trusted xattrs). A [`Distribute`] over the first `bricks`
//!   fills `files` files of `file_kib` KiB (contents drawn from [`SEED`]) spread over `dirs`
//!   directories; then a [`Distribute`] over all of them runs [`Distribute::rebalance`]: every
//!   directory laid out over every brick, a wait of two layout lifetimes
//!   (`2 × LAYOUT_TTL`, so every client reads the new layouts before any file moves), and
//!   each file off its hashed brick moved there. With `--remove`, `bricks` bricks are filled
//!   and the last one leaves (`remove-brick … start`): the rebalance first waits two brick
//!   refreshes (`2 × BRICKS_REFRESH`, so every mount knows the brick leaves), lays every
//!   directory out without it and moves every file off it. The rate is `moved` files (and
//!   their bytes) over the rebalance's time **less those fixed waits**; they are printed
//!   beside it. Every file is read back and compared afterwards (not timed).
//! * **Reference** (`std_copy_unlink`). The same tree written with std::fs on the same file
//!   system, then as many files as the rebalance moved (spread evenly over the tree, taken
//!   directory by directory) each opened, read, written to a new file in a second tree,
//!   closed and unlinked: what a migration does to the disk, minus the network, the bricks
//!   and the xattrs. One thread, as the rebalance moves one file at a time.
//! * **GlusterFS** is not run by this workload yet: a `glusterfs` note says so.
//!
//! `ratio` = Kiln's files/s ÷ the reference's (all files have one size, so MiB/s give the
//! same ratio). Both trees are written out (`syncfs`) before each timed phase; the caches
//! are not dropped, so both read warm files.

use std::io::{Read as _, Write as _};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use kiln_client::distribute::{BRICKS_REFRESH, Distribute, LAYOUT_TTL, Member, RebalanceReport};
use kiln_client::{BrickClient, ConnectOptions, Paths};
use kiln_wire::Creds;
use serde_json::json;

use crate::process::{
    Bins, Daemon, brickd_address, check_stop, log_tail, loopback_pki, run_bounded, stopping,
    version, watch_signals,
};
use crate::report::{Record, Reporter};
use crate::rng::Rng;
use crate::scratch::{Scratch, sync_file_systems};

/// Seed of the files' contents.
pub const SEED: u64 = 0x7265_6261_6c61;
/// The volume's name: link files name its bricks `VOLUME-client-N`.
const VOLUME: &str = "kilnbench";
const CLIENT_NAME: &str = "bench";
const BRICK_NAME: &str = "brick";
const WORKLOAD: &str = "rebalance";
const REFERENCE: &str = "std_copy_unlink";
/// Tasks writing (and reading back) files at once through the volume; not timed.
const FILL_TASKS: usize = 16;
/// Longest `kiln-brickd format`.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest fill, read-back or rebalance.
const PHASE_TIMEOUT: Duration = Duration::from_secs(3600);
/// Files between two looks at the stop flag in the reference loop.
const STOP_CHECK_FILES: usize = 256;

/// What `kiln-bench rebalance` runs.
#[derive(Debug, Clone)]
pub struct RebalanceBench {
    /// Bricks the volume has before one is added (or removed).
    pub bricks: usize,
    pub files: usize,
    pub file_kib: usize,
    pub dirs: usize,
    /// A brick removed rather than added.
    pub remove: bool,
    /// Only to say it is not run yet.
    pub glusterfs: bool,
}

impl RebalanceBench {
    fn file_bytes(&self) -> usize {
        self.file_kib * 1024
    }

    /// Bricks served: the volume's, and the one added.
    fn bricks_served(&self) -> usize {
        self.bricks + usize::from(!self.remove)
    }

    /// The rebalance's fixed waits: two layout lifetimes, and two brick refreshes before a
    /// removal.
    fn wait(&self) -> Duration {
        LAYOUT_TTL * 2 + BRICKS_REFRESH * 2 * u32::from(self.remove)
    }

    /// How the volume changes: `2+1` or `3-1`.
    fn change(&self) -> String {
        match self.remove {
            true => format!("{}-1", self.bricks),
            false => format!("{}+1", self.bricks),
        }
    }
}

/// What the Kiln side measured.
#[derive(Debug)]
struct KilnRun {
    report: RebalanceReport,
    /// The whole `rebalance` call.
    elapsed: Duration,
    /// From the call to its first report (every directory laid out, the wait, the root
    /// directory walked).
    to_first_dir: Duration,
    fill: Duration,
    verified: usize,
}

/// What the reference measured.
#[derive(Debug)]
struct ReferenceRun {
    files: usize,
    bytes: u64,
    elapsed: Duration,
}

/// Runs the workload; its records (the reference's, then Kiln's).
pub fn run(
    bench: &RebalanceBench,
    scratch: &Scratch,
    out: &mut Reporter,
) -> anyhow::Result<Vec<Record>> {
    if bench.bricks == 0 || bench.files == 0 || bench.dirs == 0 || bench.file_kib == 0 {
        bail!("--bricks, --files, --dirs and --file-kib must be at least 1");
    }
    if bench.remove && bench.bricks < 2 {
        bail!("--remove needs --bricks 2 or more: one brick stays");
    }
    watch_signals()?;
    let root = scratch.path().join(WORKLOAD);
    let logs = root.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("cannot create {}", logs.display()))?;
    let bins = Bins::beside_this_executable()?;
    out.note(
        "rebalance",
        &json!({
            "bricks_before": bench.bricks, "change": bench.change(), "files": bench.files,
            "file_kib": bench.file_kib, "dirs": bench.dirs, "seed": SEED,
            "kiln_brickd": version(&bins.brickd.to_string_lossy()),
            "brickd_engine": "kiln-brickd serve defaults (one per brick)",
            "mover_threads": 1,
            "wait_s": bench.wait().as_secs_f64(),
            "rate": "moved / (rebalance time - wait)",
        }),
    );
    let kiln = measure_kiln(bench, &bins, &root, &logs)?;
    let moved = usize::try_from(kiln.report.moved)?;
    if moved == 0 {
        bail!("the rebalance moved no file: nothing to compare");
    }
    let reference = measure_reference(bench, moved, &root.join("reference"))?;
    let records = report(bench, &kiln, &reference, out);
    out.note(
        "glusterfs",
        &json!(match bench.glusterfs {
            true => "not run: this workload does not set up GlusterFS yet",
            false => "not run",
        }),
    );
    Ok(records)
}

/// Prints the reference's row, then Kiln's with its ratio.
fn report(
    bench: &RebalanceBench,
    kiln: &KilnRun,
    reference: &ReferenceRun,
    out: &mut Reporter,
) -> Vec<Record> {
    let mib = |bytes: u64| bytes as f64 / f64::from(1u32 << 20);
    let ref_s = reference.elapsed.as_secs_f64();
    let ref_rate = reference.files as f64 / ref_s;
    let mut row = Record::new(
        WORKLOAD,
        REFERENCE,
        json!({ "files": reference.files, "file_kib": bench.file_kib, "dirs": bench.dirs,
                "threads": 1, "s": round3(ref_s) }),
        REFERENCE,
    );
    row.ops_per_s = Some(ref_rate);
    row.mib_per_s = Some(mib(reference.bytes) / ref_s);
    row.ratio = Some(1.0);
    out.print(&row);
    let reference_row = row;

    let wait = bench.wait();
    let kiln_s = kiln.elapsed.saturating_sub(wait).as_secs_f64().max(1e-9);
    let r = &kiln.report;
    let rate = r.moved as f64 / kiln_s;
    let mut row = Record::new(
        WORKLOAD,
        "kiln",
        json!({ "bricks": bench.change(), "files": bench.files,
                "moved": r.moved, "file_kib": bench.file_kib, "dirs": bench.dirs,
                "threads": 1, "s": round3(kiln_s),
                "wait_s": round3(wait.as_secs_f64()) }),
        REFERENCE,
    );
    row.ops_per_s = Some(rate);
    row.mib_per_s = Some(mib(r.bytes_moved) / kiln_s);
    row.ratio = Some(rate / ref_rate);
    out.print(&row);
    let kiln_row = row;
    out.note(
        "rebalance_kiln",
        &json!({
            "dirs": r.dirs, "files": r.files, "moved": r.moved, "bytes_moved": r.bytes_moved,
            "link_files_removed": r.link_files_removed, "skipped": r.skipped,
            "failed": r.failed, "left_on_leaving": r.left_on_leaving,
            "expected_moved_about": bench.files / (bench.bricks + usize::from(!bench.remove)),
            "rebalance_s": round3(kiln.elapsed.as_secs_f64()),
            "wait_s": round3(wait.as_secs_f64()),
            "to_first_dir_s": round3(kiln.to_first_dir.as_secs_f64()),
            "fill_s": round3(kiln.fill.as_secs_f64()),
            "files_read_back": kiln.verified,
        }),
    );
    vec![reference_row, kiln_row]
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Starts the bricks, fills the volume, adds a brick and times the rebalance; stops every
/// brick, failing unless each stopped cleanly.
fn measure_kiln(
    bench: &RebalanceBench,
    bins: &Bins,
    root: &Path,
    logs: &Path,
) -> anyhow::Result<KilnRun> {
    let tls = root.join("tls");
    loopback_pki(&tls, BRICK_NAME, CLIENT_NAME)?;
    let mut bricks = Vec::with_capacity(bench.bricks_served());
    for i in 0..bench.bricks_served() {
        let log = logs.join(format!("kiln-brickd-{i}.log"));
        bricks.push(Brickd::start(
            &bins.brickd,
            &root.join(format!("brick{i}")),
            &tls,
            &log,
        )?);
    }
    let addrs: Vec<SocketAddr> = bricks.iter().map(|b| b.addr).collect();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    let local = tokio::task::LocalSet::new();
    let result = local.block_on(&runtime, fill_and_rebalance(bench, &addrs, &tls, root));
    let mut stopped = Vec::new();
    for brick in &mut bricks {
        stopped.push(brick.stop());
    }
    let run = result?;
    for s in stopped {
        s?;
    }
    Ok(run)
}

/// Connects to every brick, fills the first ones, rebalances over all, reads every file back.
async fn fill_and_rebalance(
    bench: &RebalanceBench,
    addrs: &[SocketAddr],
    tls: &Path,
    root: &Path,
) -> anyhow::Result<KilnRun> {
    let mut clients = Vec::with_capacity(addrs.len());
    for &addr in addrs {
        let options = ConnectOptions::from_tls_dir(addr, tls, CLIENT_NAME)?;
        let client = tokio::time::timeout(CONNECT_TIMEOUT, BrickClient::connect(options))
            .await
            .with_context(|| format!("no connection to {addr} within {CONNECT_TIMEOUT:?}"))?
            .with_context(|| format!("connecting to {addr}"))?;
        clients.push(client);
    }
    let result = rebalance_on(bench, &clients, root).await;
    for client in clients {
        client.close().await;
    }
    result
}

async fn rebalance_on(
    bench: &RebalanceBench,
    clients: &[BrickClient],
    root: &Path,
) -> anyhow::Result<KilnRun> {
    let creds = Creds::root();
    let before = Rc::new(Distribute::new(clients[..bench.bricks].to_vec(), VOLUME)?);
    // After: every brick, one of them added — or the last leaving.
    let mut after: Vec<Member<BrickClient>> =
        clients.iter().cloned().map(Member::Serving).collect();
    if bench.remove
        && let Some(last) = after.pop()
        && let Some(brick) = last.brick()
    {
        after.push(Member::Leaving(brick.clone()));
    }
    let fill_start = Instant::now();
    for d in 0..bench.dirs {
        before.mkdir_all(&creds, &dir_name(d), 0o755).await?;
    }
    bounded("the fill", each_file(&before, bench, Phase::Write)).await?;
    let fill = fill_start.elapsed();
    drop(before);
    sync_file_systems(&[root]);
    check_stop()?;

    let changed = Rc::new(Distribute::of_members(after, VOLUME)?);
    let stop = AtomicBool::new(false);
    let mut first_dir = None;
    let mut progress = |_: &RebalanceReport| {
        first_dir.get_or_insert_with(Instant::now);
        if stopping() {
            stop.store(true, Ordering::Relaxed);
        }
    };
    let start = Instant::now();
    let rebalance = async {
        changed
            .rebalance(&stop, &mut progress)
            .await
            .context("rebalancing")
    };
    let report = bounded("the rebalance", rebalance).await?;
    let elapsed = start.elapsed();
    check_stop()?;
    if report.failed > 0 || report.skipped > 0 || report.left_on_leaving > 0 {
        bail!("the rebalance failed on, skipped or left some files: {report:?}");
    }
    let verified = bounded("the read-back", each_file(&changed, bench, Phase::Check)).await?;
    Ok(KilnRun {
        report,
        elapsed,
        to_first_dir: first_dir.map_or(elapsed, |t| t.duration_since(start)),
        fill,
        verified,
    })
}

async fn bounded<T>(
    what: &str,
    phase: impl Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    tokio::time::timeout(PHASE_TIMEOUT, phase)
        .await
        .with_context(|| format!("{what} took over {PHASE_TIMEOUT:?}"))?
}

/// What [`each_file`] does to each file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Write,
    /// Read it back and compare.
    Check,
}

/// Writes or checks every file through `volume`, [`FILL_TASKS`] at a time; the files done.
async fn each_file(
    volume: &Rc<Distribute<BrickClient>>,
    bench: &RebalanceBench,
    phase: Phase,
) -> anyhow::Result<usize> {
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..FILL_TASKS.min(bench.files) {
        let (volume, bench) = (volume.clone(), bench.clone());
        tasks.spawn_local(async move {
            let creds = Creds::root();
            let mut done = 0;
            for i in (t..bench.files).step_by(FILL_TASKS) {
                if i % STOP_CHECK_FILES == t {
                    check_stop()?;
                }
                let path = file_path(i, bench.dirs);
                let data = contents(i, bench.file_bytes());
                match phase {
                    Phase::Write => volume
                        .write_file(&creds, &path, data, 0o644)
                        .await
                        .with_context(|| format!("writing {path}"))?,
                    Phase::Check => {
                        let read = volume
                            .read_to_end(&creds, &path)
                            .await
                            .with_context(|| format!("reading {path} back"))?;
                        if read != data {
                            bail!("{path} reads back different after the rebalance");
                        }
                    }
                }
                done += 1;
            }
            anyhow::Ok(done)
        });
    }
    let mut done = 0;
    while let Some(task) = tasks.join_next().await {
        done += task.context("a fill task died")??;
    }
    Ok(done)
}

/// Writes the tree with std::fs, then times moving `moved` of its files to a second tree.
fn measure_reference(
    bench: &RebalanceBench,
    moved: usize,
    dir: &Path,
) -> anyhow::Result<ReferenceRun> {
    let (src, dst) = (dir.join("src"), dir.join("dst"));
    for d in 0..bench.dirs {
        let sub = src.join(dir_name(d));
        std::fs::create_dir_all(&sub)
            .with_context(|| format!("cannot create {}", sub.display()))?;
    }
    for i in 0..bench.files {
        if i % STOP_CHECK_FILES == 0 {
            check_stop()?;
        }
        std::fs::write(
            src.join(file_path(i, bench.dirs)),
            contents(i, bench.file_bytes()),
        )?;
    }
    std::fs::create_dir(&dst)?;
    sync_file_systems(&[dir]);
    let mut chosen = spread(bench.files, moved);
    chosen.sort_by_key(|&i| (i % bench.dirs, i));
    let mut buf = vec![0u8; bench.file_bytes()];
    let start = Instant::now();
    for d in 0..bench.dirs {
        std::fs::create_dir(dst.join(dir_name(d)))?;
    }
    for (n, &i) in chosen.iter().enumerate() {
        if n % STOP_CHECK_FILES == 0 {
            check_stop()?;
        }
        let path = file_path(i, bench.dirs);
        move_file(&src.join(&path), &dst.join(&path), &mut buf)
            .with_context(|| format!("moving {path}"))?;
    }
    let elapsed = start.elapsed();
    Ok(ReferenceRun {
        files: chosen.len(),
        bytes: (chosen.len() * bench.file_bytes()) as u64,
        elapsed,
    })
}

/// A migration's disk work: open, read, write a new file, close both, unlink the old one.
fn move_file(from: &Path, to: &Path, buf: &mut [u8]) -> std::io::Result<()> {
    let mut source = std::fs::File::open(from)?;
    source.read_exact(buf)?;
    drop(source);
    let mut target = std::fs::File::create_new(to)?;
    target.write_all(buf)?;
    drop(target);
    std::fs::remove_file(from)
}

/// `count` of the indices `0..total`, evenly spread.
fn spread(total: usize, count: usize) -> Vec<usize> {
    let count = count.min(total) as u128;
    let total_u = total as u128;
    (0..total)
        .filter(|&i| (i as u128 + 1) * count / total_u != i as u128 * count / total_u)
        .collect()
}

fn dir_name(d: usize) -> String {
    format!("d{d:04}")
}

/// File `i` of the tree, in directory `i mod dirs`.
fn file_path(i: usize, dirs: usize) -> String {
    format!("{}/f{i:07}", dir_name(i % dirs))
}

/// File `i`'s contents, drawn from [`SEED`].
fn contents(i: usize, len: usize) -> Bytes {
    let mut rng = Rng::stream(SEED, i as u64);
    let mut data = Vec::with_capacity(len + 8);
    while data.len() < len {
        data.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    data.truncate(len);
    Bytes::from(data)
}

/// A `kiln-brickd serve` of a fresh brick on loopback, stopped (SIGTERM, a bounded wait,
/// SIGKILL) when dropped.
#[derive(Debug)]
struct Brickd {
    daemon: Daemon,
    addr: SocketAddr,
}

impl Brickd {
    fn start(exe: &Path, brick: &Path, tls: &Path, log: &Path) -> anyhow::Result<Brickd> {
        std::fs::create_dir(brick).with_context(|| format!("cannot create {}", brick.display()))?;
        run_bounded(
            Command::new(exe).arg("format").arg(brick),
            None,
            log,
            COMMAND_TIMEOUT,
        )?;
        let mut serve = Command::new(exe);
        serve
            .arg("serve")
            .arg(brick)
            .args(["--listen", "127.0.0.1:0", "--name", BRICK_NAME, "--tls-dir"])
            .arg(tls)
            .args(["--root-allow", CLIENT_NAME, "--volume", VOLUME])
            .stdout(Stdio::piped());
        let mut daemon = Daemon::spawn("kiln-brickd", &mut serve, log)?;
        let stdout = daemon.take_stdout().context("no pipe from kiln-brickd")?;
        let addr = brickd_address(stdout, log)?;
        Ok(Brickd { daemon, addr })
    }

    /// SIGTERM, a bounded wait, then SIGKILL; fails unless it exits 0 on the SIGTERM.
    fn stop(&mut self) -> anyhow::Result<()> {
        match self.daemon.stop()? {
            (Some(status), false) if status.success() => Ok(()),
            status => bail!(
                "kiln-brickd of {} did not stop cleanly on SIGTERM ({status:?}):\n{}",
                self.addr,
                log_tail(&self.daemon.log)
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_picks_exactly_count_evenly() {
        assert_eq!(spread(10, 5), [1, 3, 5, 7, 9]);
        assert_eq!(spread(10, 10), (0..10).collect::<Vec<_>>());
        assert_eq!(spread(10, 20).len(), 10);
        assert!(spread(10, 0).is_empty());
        assert_eq!(spread(10_000, 3333).len(), 3333);
    }

    #[test]
    fn contents_are_deterministic_and_sized() {
        assert_eq!(contents(7, 1000), contents(7, 1000));
        assert_ne!(contents(7, 1000), contents(8, 1000));
        assert_eq!(contents(3, 16 * 1024).len(), 16 * 1024);
        assert_eq!(file_path(12, 10), "d0002/f0000012");
    }

    #[test]
    fn a_moved_file_keeps_its_bytes_and_leaves_its_source() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (from, to) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::write(&from, contents(1, 4096)).expect("write");
        let mut buf = vec![0u8; 4096];
        move_file(&from, &to, &mut buf).expect("move");
        assert!(!from.exists());
        assert_eq!(std::fs::read(&to).expect("read"), contents(1, 4096));
    }
}
