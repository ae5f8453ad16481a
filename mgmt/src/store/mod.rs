//! The management daemon's embedded durable config store: a [`State`] changed only by
//! committed transactions, each made durable with one log append before it is applied.
//!
//! A store directory (created 0700) holds two files:
//!
//! ```text
//! snapshot.json   {"generation":N,"state":...}: the state at generation N (absent: the
//!                 default state at generation 0); replaced atomically
//! log             the transactions after some generation <= N, one record each:
//!                   u32 LE payload length | u32 LE CRC-32C of the payload | payload
//!                 payload = JSON {"generation":G,"changes":[...]}, G = previous G + 1
//! ```
//!
//! Commits go through one writer thread that owns the log: it takes every transaction
//! waiting in the queue, checks them in order, writes all accepted records with one write and
//! one fdatasync (group commit), then publishes the new state and answers. A failed write or
//! fdatasync is never retried: the store stops taking commits until the daemon restarts and
//! recovers from what is on disk. Reads never wait for the disk.
//!
//! Opening replays the log over the snapshot. A torn tail (a short record or a bad checksum,
//! what a crash during an append leaves) is cut off and reported. Anything else that does not
//! fit — a snapshot that does not parse, a checksummed record that does not decode, a gap in
//! the generations, a replayed change its state now refuses — is an error: the store refuses
//! to open rather than lose configuration that was acknowledged.

pub mod etcd;
mod log;
mod snapshot;
#[cfg(test)]
mod suite;
#[cfg(test)]
mod test_state;
mod writer;

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use kiln_admin::durable::{self, DurableWriteError};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};

use writer::{Request, Shared};

/// The snapshot file in a store directory.
pub const SNAPSHOT_FILE: &str = "snapshot.json";
/// The log file in a store directory.
pub const LOG_FILE: &str = "log";
/// Largest payload of one log record (one transaction), in bytes.
pub const RECORD_BYTES_MAX: u32 = 16 << 20;

/// What the store holds: a state changed only by committed changes.
pub trait State:
    Default + Clone + Serialize + serde::de::DeserializeOwned + Send + Sync + 'static
{
    type Change: Serialize
        + serde::de::DeserializeOwned
        + Clone
        + Send
        + Sync
        + std::fmt::Debug
        + 'static;
    type Error: std::error::Error + Send + Sync + 'static;
    /// Whether `change` may be applied to this state (unknown names, conflicts...).
    fn check(&self, change: &Self::Change) -> Result<(), Self::Error>;
    /// Applies a checked change. Must not fail.
    fn apply(&mut self, change: &Self::Change);
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot read {path}: {error}")]
    Read { path: PathBuf, error: io::Error },
    #[error("cannot write {path}: {error}")]
    Write { path: PathBuf, error: io::Error },
    #[error(
        "corrupt snapshot {path}: {reason}; refusing to open rather than lose committed configuration"
    )]
    CorruptSnapshot { path: PathBuf, reason: String },
    #[error(
        "corrupt log {path} at byte {offset}: {reason}; refusing to open rather than lose committed configuration"
    )]
    CorruptLog {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
    #[error("cannot encode the {what}: {error}")]
    Encode {
        what: &'static str,
        error: serde_json::Error,
    },
    #[error("a transaction of {bytes} bytes is over the {RECORD_BYTES_MAX} byte record limit")]
    RecordTooLarge { bytes: usize },
    #[error(
        "the store in {dir} takes no more commits after a failed write ({reason}); restart to recover from disk"
    )]
    Failed { dir: PathBuf, reason: String },
    #[error("cannot start the store's writer thread: {0}")]
    Thread(io::Error),
    #[error("the store is closed")]
    Closed,
    #[error("etcd at {endpoints}: {error}")]
    Etcd { endpoints: String, error: String },
    /// No member could be reached, or none with quorum answered in time: the same request
    /// may succeed later.
    #[error("etcd at {endpoints} does not answer: {error}")]
    EtcdUnanswered { endpoints: String, error: String },
    #[error("the configuration in etcd cannot be read: {reason}")]
    Diverged { reason: String },
    #[error("the change lost {attempts} races with other daemons' changes in a row; try again")]
    Contended { attempts: usize },
}

impl From<DurableWriteError> for StoreError {
    fn from(e: DurableWriteError) -> StoreError {
        StoreError::Write {
            path: e.path,
            error: e.error,
        }
    }
}

/// Why a commit did not happen.
#[derive(Debug, thiserror::Error)]
pub enum CommitError<E> {
    /// The state refused a change; nothing of the transaction was written.
    #[error(transparent)]
    Rejected(E),
    /// The store could not make the transaction durable (or is closed or failed).
    #[error(transparent)]
    Store(StoreError),
}

/// Tuning of a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreOptions {
    /// Compact (snapshot, then start an empty log) after a commit batch leaves the log longer
    /// than this.
    pub compact_after_bytes: u64,
    /// Commits waiting for the writer before `commit` waits for room (backpressure); also the
    /// most the writer takes in one batch. 0 counts as 1.
    pub queue_max: usize,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            compact_after_bytes: 4 << 20,
            queue_max: 1024,
        }
    }
}

/// What opening a store found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenReport {
    /// The generation of the opened state.
    pub generation: u64,
    /// The generation of the snapshot the state was built on (0: none).
    pub snapshot_generation: u64,
    /// Log records applied over the snapshot.
    pub records_replayed: usize,
    /// A torn tail cut off the log, if there was one.
    pub dropped_tail: Option<DroppedTail>,
}

/// The end of the log dropped at open: from a crash during an append, never acknowledged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DroppedTail {
    /// Where the log now ends.
    pub offset: u64,
    /// How many bytes were cut off.
    pub bytes: u64,
    pub reason: String,
}

/// Counters of the writer since open.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Transactions made durable.
    pub commits: u64,
    /// Groups of requests the writer took from the queue at once.
    pub batches: u64,
    /// fdatasync calls on the log.
    pub fsyncs: u64,
}

/// A durable state; share it as `Arc<LogStore<S>>`. Dropping it finishes the queued commits
/// and stops the writer thread.
pub struct LogStore<S: State> {
    shared: Arc<Shared<S>>,
    /// `None` only while dropping, so the writer sees the queue close.
    requests: Option<mpsc::Sender<Request<S>>>,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl<S: State> std::fmt::Debug for LogStore<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogStore")
            .field("dir", &self.shared.dir)
            .field("generation", &self.generation())
            .finish_non_exhaustive()
    }
}

impl<S: State> LogStore<S> {
    /// Opens the store in `dir` (created 0700 if missing): the snapshot, then the log
    /// replayed over it, cutting off a torn tail.
    pub fn open(
        dir: &Path,
        options: StoreOptions,
    ) -> Result<(LogStore<S>, OpenReport), StoreError> {
        create_dir(dir)?;
        snapshot::remove_compaction_leftovers(dir)?;
        let (mut state, snapshot_generation) = snapshot::read::<S>(&dir.join(SNAPSHOT_FILE))?;
        let (log, replay) = log::open_and_replay(dir, &mut state, snapshot_generation)?;
        let shared = Arc::new(Shared::new(dir, state, replay.generation));
        let log_end = writer::LogEnd {
            log,
            log_bytes: replay.log_bytes,
            snapshot_generation,
        };
        let (requests, writer) = writer::spawn(shared.clone(), log_end, options)?;
        let report = OpenReport {
            generation: replay.generation,
            snapshot_generation,
            records_replayed: replay.records_replayed,
            dropped_tail: replay.dropped_tail,
        };
        let store = LogStore {
            shared,
            requests: Some(requests),
            writer: Some(writer),
        };
        Ok((store, report))
    }

    /// Checks the changes in order against the current state (all or none), appends ONE
    /// record for the transaction, makes it durable with fdatasync, applies it, and returns
    /// the new generation. Concurrent commits share one write and one fdatasync (group
    /// commit).
    ///
    /// A commit whose future is dropped after it was queued may still be committed. After a
    /// [`CommitError::Store`] from a failed write the transaction may or may not be on disk;
    /// the store takes no more commits, and reopening it tells.
    pub async fn commit(&self, changes: Vec<S::Change>) -> Result<u64, CommitError<S::Error>> {
        let closed = || CommitError::Store(StoreError::Closed);
        let requests = self.requests.as_ref().ok_or_else(closed)?;
        if let Some(error) = self.shared.failed_error() {
            return Err(CommitError::Store(error));
        }
        let (reply, answer) = oneshot::channel();
        requests
            .send(Request::Commit { changes, reply })
            .await
            .map_err(|_| closed())?;
        answer.await.map_err(|_| closed())?
    }

    /// Calls `f` with the current state and its generation. Never waits for the disk.
    pub fn read<R>(&self, f: impl FnOnce(&S, u64) -> R) -> R {
        let current = self.shared.published();
        f(&current.state, current.generation)
    }

    /// The generation of the current state: the number of transactions committed since the
    /// store was created.
    pub fn generation(&self) -> u64 {
        self.shared.published().generation
    }

    /// Tells each new generation.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.shared.generations.subscribe()
    }

    /// Writes a snapshot of the state and starts an empty log (also done automatically when
    /// the log exceeds `options.compact_after_bytes`).
    pub async fn compact(&self) -> Result<(), StoreError> {
        let requests = self.requests.as_ref().ok_or(StoreError::Closed)?;
        let (reply, answer) = oneshot::channel();
        requests
            .send(Request::Compact { reply })
            .await
            .map_err(|_| StoreError::Closed)?;
        answer.await.map_err(|_| StoreError::Closed)?
    }

    /// Counters of the writer since open.
    pub fn stats(&self) -> StoreStats {
        StoreStats {
            commits: self.shared.commits.load(Ordering::Relaxed),
            batches: self.shared.batches.load(Ordering::Relaxed),
            fsyncs: self.shared.fsyncs.load(Ordering::Relaxed),
        }
    }
}

impl<S: State> Drop for LogStore<S> {
    fn drop(&mut self) {
        // Closing the queue lets the writer finish what is queued and return.
        self.requests = None;
        if let Some(writer) = self.writer.take()
            && writer.join().is_err()
        {
            tracing::error!(dir = %self.shared.dir.display(), "the store's writer thread panicked");
        }
    }
}

/// The configuration store a daemon runs on: the embedded log (one host) or etcd (a
/// cluster of hosts sharing one configuration).
#[derive(Debug)]
pub enum ConfigStore<S: etcd::Objects> {
    Log(LogStore<S>),
    /// Boxed: an etcd client is a few KiB.
    Etcd(Box<etcd::EtcdStore<S>>),
}

impl<S: etcd::Objects> ConfigStore<S> {
    /// Commits `changes` as one transaction (all or none); the new generation.
    pub async fn commit(&self, changes: Vec<S::Change>) -> Result<u64, CommitError<S::Error>> {
        match self {
            ConfigStore::Log(store) => store.commit(changes).await,
            ConfigStore::Etcd(store) => store.commit(changes).await,
        }
    }

    /// Calls `f` with the current state and its generation.
    pub fn read<R>(&self, f: impl FnOnce(&S, u64) -> R) -> R {
        match self {
            ConfigStore::Log(store) => store.read(f),
            ConfigStore::Etcd(store) => store.read(f),
        }
    }

    pub fn generation(&self) -> u64 {
        self.read(|_, generation| generation)
    }

    /// Tells each new generation (an etcd store's includes other daemons' commits).
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        match self {
            ConfigStore::Log(store) => store.subscribe(),
            ConfigStore::Etcd(store) => store.subscribe(),
        }
    }

    /// The etcd store, when the configuration is in etcd.
    pub fn etcd(&self) -> Option<&etcd::EtcdStore<S>> {
        match self {
            ConfigStore::Log(_) => None,
            ConfigStore::Etcd(store) => Some(store),
        }
    }
}

/// The store's directory: owner-only, and durably named in its parent (a store whose
/// directory entry a crash lost would lose every acknowledged change with it).
fn create_dir(dir: &Path) -> Result<(), StoreError> {
    durable::private_dir(dir).map_err(|e| StoreError::Write {
        path: e.path,
        error: e.error,
    })
}

#[cfg(test)]
mod tests {
    use super::test_state::{Change, Missing, log_len, open, set, snapshot_of};
    use super::*;

    #[tokio::test]
    async fn commits_survive_reopen() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("store");
        let (store, report) = open(&dir);
        assert_eq!(
            report,
            OpenReport {
                generation: 0,
                snapshot_generation: 0,
                records_replayed: 0,
                dropped_tail: None
            }
        );
        assert_eq!(store.commit(vec![set("a", "1")]).await.expect("commit"), 1);
        assert_eq!(
            store
                .commit(vec![set("b", "2"), set("c", "3")])
                .await
                .expect("commit"),
            2
        );
        assert_eq!(
            store
                .commit(vec![Change::Delete("a".into())])
                .await
                .expect("commit"),
            3
        );
        let before = snapshot_of(&store);
        assert_eq!(before.1, 3);
        assert_eq!(store.generation(), 3);
        drop(store);

        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&dir).expect("dir").permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);

        let (store, report) = open(&dir);
        assert_eq!(report.generation, 3);
        assert_eq!(report.records_replayed, 3);
        assert_eq!(report.dropped_tail, None);
        assert_eq!(snapshot_of(&store), before);
        assert_eq!(
            store.read(|map, _| map.0.keys().cloned().collect::<Vec<_>>()),
            ["b", "c"]
        );
    }

    #[tokio::test]
    async fn rejected_transactions_write_nothing() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (store, _) = open(tmp.path());
        store.commit(vec![set("a", "1")]).await.expect("commit");
        let len = log_len(tmp.path());

        let err = store
            .commit(vec![Change::Delete("nope".into())])
            .await
            .expect_err("missing key");
        assert!(matches!(&err, CommitError::Rejected(Missing(k)) if k == "nope"));
        assert_eq!(err.to_string(), "no key \"nope\"");
        // One bad change: none of the transaction's changes are written or applied.
        let err = store
            .commit(vec![
                set("b", "2"),
                Change::Delete("a".into()),
                Change::Delete("a".into()),
            ])
            .await
            .expect_err("second delete");
        assert!(matches!(err, CommitError::Rejected(Missing(_))));
        assert_eq!(store.generation(), 1);
        assert_eq!(log_len(tmp.path()), len);
        store.read(|map, generation| {
            assert_eq!(generation, 1);
            assert_eq!(map.0.len(), 1);
            assert_eq!(map.0.get("a").map(String::as_str), Some("1"));
        });
        // A change later in the transaction sees the earlier ones.
        let generation = store
            .commit(vec![set("b", "2"), Change::Delete("b".into())])
            .await
            .expect("commit");
        assert_eq!(generation, 2);
        drop(store);
        let (store, report) = open(tmp.path());
        assert_eq!(report.generation, 2);
        assert_eq!(store.read(|map, _| map.0.len()), 1);
    }
}
