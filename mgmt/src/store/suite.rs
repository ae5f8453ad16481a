//! One suite of store tests, run against both backends: the embedded log, and etcd (a real
//! `etcd` member started here). What a daemon relies on: commits read back, refused ones
//! change nothing, a reopened store has every acknowledged commit, subscribers hear of
//! commits, and commits racing from two handles (two daemons on etcd) are each checked
//! against the state they follow.

use std::sync::Arc;
use std::time::Duration;

use super::etcd::{EtcdStore, EtcdTarget};
use super::test_state::{Change, Map, Missing, set};
use super::{CommitError, ConfigStore, LogStore, StoreOptions};
use crate::etcd_server::EtcdServer;

/// Opens handles on one store: the first, then more on the same store (another daemon's,
/// for etcd), or again after the first is dropped.
trait Backend {
    async fn open(&self) -> ConfigStore<Map>;
    /// Whether two open handles are two daemons (etcd); else the second shares the first.
    const SHARED_BY_HANDLES: bool;
}

struct Log(tempfile::TempDir);

impl Backend for Log {
    const SHARED_BY_HANDLES: bool = false;
    async fn open(&self) -> ConfigStore<Map> {
        let (store, _) = LogStore::open(self.0.path(), StoreOptions::default()).expect("open");
        ConfigStore::Log(store)
    }
}

struct Etcd {
    _server: EtcdServer,
    target: EtcdTarget,
    _dir: tempfile::TempDir,
}

impl Backend for Etcd {
    const SHARED_BY_HANDLES: bool = true;
    async fn open(&self) -> ConfigStore<Map> {
        ConfigStore::Etcd(Box::new(
            EtcdStore::open(self.target.clone()).await.expect("open"),
        ))
    }
}

fn log() -> Log {
    Log(tempfile::tempdir().expect("tempdir"))
}

fn etcd(test: &str) -> Option<Etcd> {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = EtcdServer::single_for_test(test, &dir.path().join("member"))?;
    let target = server.target("suite");
    Some(Etcd {
        _server: server,
        target,
        _dir: dir,
    })
}

/// Waits (at most 10 s) until `store` has seen generation `generation`.
async fn caught_up(store: &ConfigStore<Map>, generation: u64) {
    let mut told = store.subscribe();
    tokio::time::timeout(Duration::from_secs(10), told.wait_for(|&g| g >= generation))
        .await
        .expect("caught up within 10 s")
        .expect("the store is alive");
}

fn keys(store: &ConfigStore<Map>) -> Vec<String> {
    store.read(|map, _| map.0.keys().cloned().collect())
}

async fn commits_read_back_and_refusals_change_nothing<B: Backend>(backend: B) {
    let store = backend.open().await;
    assert_eq!(store.generation(), 0);
    let first = store.commit(vec![set("a", "1")]).await.expect("commit");
    let second = store
        .commit(vec![set("b", "2"), set("c", "3")])
        .await
        .expect("commit");
    assert!(0 < first && first < second, "{first} then {second}");
    assert_eq!(store.generation(), second);
    assert_eq!(keys(&store), ["a", "b", "c"]);

    // One bad change refuses the whole transaction.
    let refused = store
        .commit(vec![
            Change::Delete("a".into()),
            Change::Delete("zz".into()),
        ])
        .await
        .expect_err("missing key");
    assert!(matches!(&refused, CommitError::Rejected(Missing(k)) if k == "zz"));
    assert_eq!(store.generation(), second);
    assert_eq!(keys(&store), ["a", "b", "c"]);
    // A change sees the earlier ones of its transaction.
    store
        .commit(vec![set("d", "4"), Change::Delete("d".into())])
        .await
        .expect("commit");
    assert_eq!(keys(&store), ["a", "b", "c"]);
}

async fn a_reopened_store_has_every_commit<B: Backend>(backend: B) {
    let store = backend.open().await;
    let mut last = 0;
    for i in 0..20 {
        last = store
            .commit(vec![set(&format!("k{i:02}"), &i.to_string())])
            .await
            .expect("commit");
    }
    store
        .commit(vec![Change::Delete("k07".into())])
        .await
        .expect("commit");
    let before = store.read(|map, generation| (map.clone(), generation));
    assert!(before.1 > last);
    drop(store);
    let store = backend.open().await;
    assert_eq!(
        store.read(|map, generation| (map.clone(), generation)),
        before
    );
    assert_eq!(keys(&store).len(), 19);
}

async fn subscribers_hear_of_commits<B: Backend>(backend: B) {
    let store = Arc::new(backend.open().await);
    // On etcd, a second daemon hears of the first one's commits.
    let other = match B::SHARED_BY_HANDLES {
        true => Arc::new(backend.open().await),
        false => store.clone(),
    };
    let generation = store.commit(vec![set("x", "1")]).await.expect("commit");
    caught_up(&other, generation).await;
    assert_eq!(
        other.read(|map, _| map.0.get("x").cloned()),
        Some("1".into())
    );
}

async fn racing_commits_are_each_checked_against_the_state_they_follow<B: Backend>(backend: B) {
    let one = Arc::new(backend.open().await);
    let two = match B::SHARED_BY_HANDLES {
        true => Arc::new(backend.open().await),
        false => one.clone(),
    };
    let writers = [(0, one.clone()), (1, two.clone())].map(|(writer, store)| {
        tokio::spawn(async move {
            let mut generations = Vec::new();
            for i in 0..25 {
                let key = format!("{writer}-{i}");
                generations.push(store.commit(vec![set(&key, "v")]).await.expect("commit"));
            }
            generations
        })
    });
    let mut generations = Vec::new();
    for writer in writers {
        generations.extend(writer.await.expect("writer"));
    }
    generations.sort_unstable();
    generations.dedup();
    assert_eq!(generations.len(), 50, "every commit has its own generation");
    // Both handles end with all 50 keys (each once it has seen the last commit: the other
    // handle's copy follows by its watch).
    let last = *generations.last().expect("commits");
    caught_up(&one, last).await;
    caught_up(&two, last).await;
    assert_eq!(one.read(|m, _| m.0.len()), 50);
    assert_eq!(two.read(|m, _| m.0.len()), 50);

    // Two deletes of one key, racing: exactly one is refused, as it would be in order.
    let once = one.commit(vec![set("once", "1")]).await.expect("commit");
    caught_up(&two, once).await;
    let delete = || vec![Change::Delete("once".into())];
    let (a, b) = tokio::join!(one.commit(delete()), two.commit(delete()));
    let refused = [&a, &b]
        .iter()
        .filter(|r| matches!(r, Err(CommitError::Rejected(Missing(_)))))
        .count();
    assert_eq!((refused, a.is_ok() || b.is_ok()), (1, true), "{a:?} {b:?}");
}

macro_rules! both_backends {
    ($($test:ident),* $(,)?) => {
        mod log_backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test::<super::Log>(super::log()).await;
                }
            )*
        }
        mod etcd_backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    if let Some(etcd) = super::etcd(stringify!($test)) {
                        super::$test::<super::Etcd>(etcd).await;
                    }
                }
            )*
        }
    };
}

both_backends!(
    commits_read_back_and_refusals_change_nothing,
    a_reopened_store_has_every_commit,
    subscribers_hear_of_commits,
    racing_commits_are_each_checked_against_the_state_they_follow,
);

/// A daemon on etcd tells its own commits from other daemons' (only another daemon's change
/// has someone waiting for this host's report of it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_store_tells_its_own_commits_from_other_daemons() {
    let Some(backend) = etcd("an_etcd_store_tells_its_own_commits_from_other_daemons") else {
        return;
    };
    let (one, two) = (backend.open().await, backend.open().await);
    let foreign = |store: &ConfigStore<Map>| store.etcd().expect("etcd").foreign_generation();
    let first = one.commit(vec![set("a", "1")]).await.expect("commit");
    assert_eq!(foreign(&one), 0, "its own commit");
    caught_up(&two, first).await;
    assert_eq!(foreign(&two), first, "heard by its watch");
    let second = two.commit(vec![set("b", "2")]).await.expect("commit");
    assert_eq!(foreign(&two), first, "its own commit changes nothing");
    caught_up(&one, second).await;
    assert_eq!(foreign(&one), second);
}
