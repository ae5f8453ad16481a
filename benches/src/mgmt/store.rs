//! (b), (c) `mgmt.floor` and `mgmt.commit`: the durability floors of the scratch disk, and the
//! configuration store's commits (sequential, then grouped) on a fresh log or etcd store.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hdrhistogram::Histogram;
use kiln_admin::options;
use kiln_admin::volume::{Brick, Volume, VolumeState};
use kiln_mgmt::store::etcd::{EtcdStore, EtcdTarget};
use kiln_mgmt::store::{ConfigStore, LOG_FILE, LogStore, StoreOptions, StoreStats};
use kiln_mgmt::volume::{BRICK_PORT_BASE, Change, Cluster};
use serde_json::json;
use tokio::task::JoinSet;

use super::{
    APPEND_FLOOR, Floor, KEY, REPLACE_FLOOR, Rows, VOLUME_NAME, latency_record, sampled, value,
    warmup,
};
use crate::report::{histogram, nanos};

/// The store phases' names: their directories in the scratch directory, or their cluster
/// names in etcd (each fresh).
const STORE_PROBE: &str = "store-probe";
const STORE_SEQUENTIAL: &str = "store-seq";
const STORE_GROUP: &str = "store-group";

/// Where the store phases make their fresh stores.
pub(super) enum StoreSite {
    /// A [`LogStore`] in a new directory under `root`, one per phase.
    Log {
        root: PathBuf,
        options: StoreOptions,
    },
    /// An [`EtcdStore`] under a new cluster name, one per phase, in the etcd at `endpoint`.
    Etcd { endpoint: String },
}

/// (b) The store's rows: sequential commits against both floors, then grouped ones.
pub(super) async fn store_rows(
    site: &StoreSite,
    brick: &Path,
    sets: usize,
    tasks: usize,
    floors: [Floor; 2],
    rows: &mut Rows<'_>,
) -> anyhow::Result<()> {
    let sequential = store_sequential(site, brick, sets).await?;
    for floor in floors {
        rows.push(latency_record(
            "mgmt.commit",
            "store",
            sequential.params(sets, 1),
            sequential.rate,
            &sequential.latency,
            floor,
        ));
    }
    let group = store_group(site, brick, sets, tasks).await?;
    for floor in floors {
        let mut r = latency_record(
            "mgmt.commit",
            "store_group",
            group.params(sets, tasks),
            group.rate,
            &group.latency,
            floor,
        );
        // A grouped commit waits at least one fdatasync; what beats the floor is throughput.
        r.ratio = Some(group.rate * floor.p50_us / 1e6);
        rows.push(r);
    }
    Ok(())
}

/// (c) Both floors, `bytes` each, `n` samples each: their rows pushed, the floors returned
/// (the append first).
pub(super) fn floors(
    dir: &Path,
    n: usize,
    bytes: usize,
    rows: &mut Rows<'_>,
) -> anyhow::Result<[Floor; 2]> {
    std::fs::create_dir_all(dir)?;
    let data = vec![b'k'; bytes];
    let append_file = dir.join("log");
    let mut log = std::fs::File::options()
        .append(true)
        .create(true)
        .open(&append_file)
        .with_context(|| format!("cannot open {}", append_file.display()))?;
    let append = timed(n, || {
        use std::io::Write as _;
        log.write_all(&data)?;
        log.sync_data()
    })
    .with_context(|| format!("appending to {}", append_file.display()))?;
    let target = dir.join("config.json");
    let replace = timed(n, || {
        kiln_admin::durable::replace_file(&target, &data, 0o600).map_err(|e| e.error)
    })
    .with_context(|| format!("replacing {}", target.display()))?;
    let floor = |name: &'static str, (rate, h): (f64, Histogram<u64>), rows: &mut Rows<'_>| {
        let floor = Floor::of(name, &h);
        rows.push(latency_record(
            "mgmt.floor",
            name,
            json!({ "samples": n, "bytes": bytes }),
            rate,
            &h,
            floor,
        ));
        floor
    };
    Ok([
        floor(APPEND_FLOOR, append, rows),
        floor(REPLACE_FLOOR, replace, rows),
    ])
}

/// Runs `op` `warmup(n)` times unmeasured, then `n` times timed: ops/s and each latency.
fn timed(
    n: usize,
    mut op: impl FnMut() -> std::io::Result<()>,
) -> anyhow::Result<(f64, Histogram<u64>)> {
    sampled(n, |_| {
        let t = Instant::now();
        op()?;
        Ok(t.elapsed())
    })
}

/// Bytes one option change appends to the embedded store's log, measured on a fresh log
/// store under `root` (whatever store the run measures: the floors are the same in both).
pub(super) async fn commit_bytes(root: &Path, brick: &Path) -> anyhow::Result<usize> {
    let site = StoreSite::Log {
        root: root.to_owned(),
        options: StoreOptions::default(),
    };
    let store = fresh_store(&site, STORE_PROBE, brick).await?;
    let log = root.join(STORE_PROBE).join(LOG_FILE);
    let len = || -> anyhow::Result<u64> {
        Ok(std::fs::metadata(&log)
            .with_context(|| format!("the store's log {}", log.display()))?
            .len())
    };
    let before = len()?;
    timed_commit(&store, set_change(0)?).await?;
    let grown = len()?.checked_sub(before).filter(|&b| b > 0);
    let grown = grown.context("one commit did not grow the store's log")?;
    Ok(usize::try_from(grown)?)
}

/// A fresh store named `name` at `site` with volume `v` created in it.
async fn fresh_store(
    site: &StoreSite,
    name: &str,
    brick: &Path,
) -> anyhow::Result<ConfigStore<Cluster>> {
    let store = match site {
        StoreSite::Log { root, options } => {
            let dir = root.join(name);
            if dir.exists() {
                bail!("{} already exists; the store must be fresh", dir.display());
            }
            let (store, _) = LogStore::<Cluster>::open(&dir, *options)
                .with_context(|| format!("opening a store in {}", dir.display()))?;
            ConfigStore::Log(store)
        }
        StoreSite::Etcd { endpoint } => {
            let target = EtcdTarget {
                endpoints: vec![endpoint.clone()],
                cluster: name.to_owned(),
            };
            let store = EtcdStore::<Cluster>::open(target)
                .await
                .with_context(|| format!("opening cluster {name} in etcd at {endpoint}"))?;
            if store.generation() != 0 {
                bail!("cluster {name} in etcd at {endpoint} is not empty; the store must be fresh");
            }
            ConfigStore::Etcd(Box::new(store))
        }
    };
    let volume = Volume {
        name: VOLUME_NAME.into(),
        id: "00000000-0000-4000-8000-00000000b0b0".into(),
        bricks: vec![Brick::new(None, brick.to_owned(), BRICK_PORT_BASE)],
        options: Default::default(),
        state: VolumeState::Created,
    };
    store
        .commit(vec![Change::Create(volume)])
        .await
        .context("creating the volume in the store")?;
    Ok(store)
}

/// The `i`-th option change, in canonical form.
fn set_change(i: usize) -> anyhow::Result<Change> {
    Ok(Change::Set {
        volume: VOLUME_NAME.into(),
        key: KEY.into(),
        value: options::find(KEY)?.parse(&value(i))?,
    })
}

/// One commit of `change`, timed.
async fn timed_commit(store: &ConfigStore<Cluster>, change: Change) -> anyhow::Result<Duration> {
    let t = Instant::now();
    store.commit(vec![change]).await.context("commit")?;
    Ok(t.elapsed())
}

/// The embedded log's own counts (etcd's are not seen from here).
fn log_stats(store: &ConfigStore<Cluster>) -> Option<StoreStats> {
    match store {
        ConfigStore::Log(store) => Some(store.stats()),
        ConfigStore::Etcd(_) => None,
    }
}

/// The counts between `before` and `after`, when the store keeps them.
fn stats_since(after: Option<StoreStats>, before: Option<StoreStats>) -> Option<StoreStats> {
    let (after, before) = after.zip(before)?;
    Some(StoreStats {
        commits: after.commits - before.commits,
        batches: after.batches - before.batches,
        fsyncs: after.fsyncs - before.fsyncs,
    })
}

/// The measured commits of one store phase.
struct Commits {
    /// Commits per second over the phase.
    rate: f64,
    /// Each commit's latency.
    latency: Histogram<u64>,
    /// The embedded log's counts over the phase; `None` on etcd.
    stats: Option<StoreStats>,
}

impl Commits {
    fn params(&self, commits: usize, tasks: usize) -> serde_json::Value {
        json!({ "commits": commits, "tasks": tasks,
                "fsyncs": self.stats.map(|s| s.fsyncs), "batches": self.stats.map(|s| s.batches) })
    }
}

/// (b) `n` sequential commits of one option change each.
async fn store_sequential(site: &StoreSite, brick: &Path, n: usize) -> anyhow::Result<Commits> {
    let store = fresh_store(site, STORE_SEQUENTIAL, brick).await?;
    let warm = warmup(n);
    for i in 0..warm {
        timed_commit(&store, set_change(i)?).await?;
    }
    let before = log_stats(&store);
    let mut latency = histogram()?;
    let start = Instant::now();
    for i in warm..warm + n {
        latency.record(nanos(timed_commit(&store, set_change(i)?).await?))?;
    }
    Ok(Commits {
        rate: n as f64 / start.elapsed().as_secs_f64(),
        latency,
        stats: stats_since(log_stats(&store), before),
    })
}

/// (b) `n` commits from `tasks` concurrent tasks on one store (group commit).
async fn store_group(
    site: &StoreSite,
    brick: &Path,
    n: usize,
    tasks: usize,
) -> anyhow::Result<Commits> {
    let store = Arc::new(fresh_store(site, STORE_GROUP, brick).await?);
    let warm = warmup(n);
    for i in 0..warm {
        timed_commit(&store, set_change(i)?).await?;
    }
    let before = log_stats(&store);
    let start = Instant::now();
    let mut running = JoinSet::new();
    for k in 0..tasks {
        let store = store.clone();
        running.spawn(async move {
            let mut latency = histogram()?;
            for i in (k..n).step_by(tasks) {
                latency.record(nanos(timed_commit(&store, set_change(warm + i)?).await?))?;
            }
            anyhow::Ok(latency)
        });
    }
    let mut latency = histogram()?;
    while let Some(done) = running.join_next().await {
        latency.add(done??)?;
    }
    Ok(Commits {
        rate: n as f64 / start.elapsed().as_secs_f64(),
        latency,
        stats: stats_since(log_stats(&store), before),
    })
}
