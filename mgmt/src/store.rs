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

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use kiln_admin::durable::{self, DurableWriteError};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

/// The snapshot file in a store directory.
pub const SNAPSHOT_FILE: &str = "snapshot.json";
/// The log file in a store directory.
pub const LOG_FILE: &str = "log";
/// Largest payload of one log record (one transaction), in bytes.
pub const RECORD_BYTES_MAX: u32 = 16 << 20;

/// Payload length and CRC-32C.
const RECORD_HEADER_BYTES: usize = 8;

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

/// A durable state; share it as `Arc<Store<S>>`. Dropping it finishes the queued commits
/// and stops the writer thread.
pub struct Store<S: State> {
    shared: Arc<Shared<S>>,
    /// `None` only while dropping, so the writer sees the queue close.
    requests: Option<mpsc::Sender<Request<S>>>,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl<S: State> std::fmt::Debug for Store<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("dir", &self.shared.dir)
            .field("generation", &self.generation())
            .finish_non_exhaustive()
    }
}

impl<S: State> Store<S> {
    /// Opens the store in `dir` (created 0700 if missing): the snapshot, then the log
    /// replayed over it, cutting off a torn tail.
    pub fn open(dir: &Path, options: StoreOptions) -> Result<(Store<S>, OpenReport), StoreError> {
        create_dir(dir)?;
        // Left by a compaction that crashed before putting them in place.
        for file in [SNAPSHOT_FILE, LOG_FILE] {
            remove_if_present(&durable::temp_path(&dir.join(file)))?;
        }
        let (mut state, snapshot_generation) = read_snapshot::<S>(&dir.join(SNAPSHOT_FILE))?;
        let log_path = dir.join(LOG_FILE);
        let (log, replay) = match std::fs::read(&log_path) {
            Ok(bytes) => {
                let replay = replay_log(&log_path, &bytes, &mut state, snapshot_generation)?;
                let log = open_log(&log_path, false)?;
                if let Some(tail) = &replay.dropped_tail {
                    tracing::warn!(
                        path = %log_path.display(),
                        offset = tail.offset,
                        bytes = tail.bytes,
                        reason = %tail.reason,
                        "dropping a torn tail from the store log"
                    );
                    let write_err = |error| StoreError::Write {
                        path: log_path.clone(),
                        error,
                    };
                    log.set_len(tail.offset).map_err(write_err)?;
                    log.sync_all().map_err(write_err)?;
                }
                (log, replay)
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => {
                let log = open_log(&log_path, true)?;
                sync_dir(dir)?;
                let replay = Replay {
                    generation: snapshot_generation,
                    records_replayed: 0,
                    log_bytes: 0,
                    dropped_tail: None,
                };
                (log, replay)
            }
            Err(error) => {
                return Err(StoreError::Read {
                    path: log_path,
                    error,
                });
            }
        };

        let shared = Arc::new(Shared {
            dir: dir.to_owned(),
            current: RwLock::new(Arc::new(Published {
                state,
                generation: replay.generation,
            })),
            failure: Mutex::new(None),
            commits: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            fsyncs: AtomicU64::new(0),
        });
        let queue_max = options.queue_max.max(1);
        let (requests, receiver) = mpsc::channel(queue_max);
        let writer = Writer {
            shared: shared.clone(),
            requests: receiver,
            log,
            log_bytes: replay.log_bytes,
            snapshot_generation,
            compact_after_bytes: options.compact_after_bytes,
            batch_max: queue_max,
        };
        let writer = std::thread::Builder::new()
            .name("kiln-store".into())
            .spawn(move || writer.run())
            .map_err(StoreError::Thread)?;
        let report = OpenReport {
            generation: replay.generation,
            snapshot_generation,
            records_replayed: replay.records_replayed,
            dropped_tail: replay.dropped_tail,
        };
        let store = Store {
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

impl<S: State> Drop for Store<S> {
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

/// What the writer and the readers share.
struct Shared<S> {
    dir: PathBuf,
    /// Replaced whole by the writer, so a reader clones the `Arc` and never holds the lock
    /// while it looks at the state.
    current: RwLock<Arc<Published<S>>>,
    /// Why the store takes no more commits.
    failure: Mutex<Option<String>>,
    commits: AtomicU64,
    batches: AtomicU64,
    fsyncs: AtomicU64,
}

struct Published<S> {
    state: S,
    generation: u64,
}

impl<S> Shared<S> {
    fn published(&self) -> Arc<Published<S>> {
        // The value is replaced whole, so a panic elsewhere cannot leave it half-written.
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn publish(&self, published: Published<S>) {
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(published);
    }

    /// Why the store takes no more commits, if it does not.
    fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn failed_error(&self) -> Option<StoreError> {
        self.failure().map(|reason| self.failed(reason))
    }

    fn failed(&self, reason: String) -> StoreError {
        StoreError::Failed {
            dir: self.dir.clone(),
            reason,
        }
    }

    /// Stops the store taking commits: what is on disk after a failed write or fsync is
    /// unknown until it is read again at open.
    fn fail(&self, reason: String) {
        tracing::error!(dir = %self.dir.display(), %reason, "the store takes no more commits");
        let mut failure = self.failure.lock().unwrap_or_else(PoisonError::into_inner);
        failure.get_or_insert(reason);
    }
}

enum Request<S: State> {
    Commit {
        changes: Vec<S::Change>,
        reply: oneshot::Sender<Result<u64, CommitError<S::Error>>>,
    },
    Compact {
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
}

type CommitReply<S> = oneshot::Sender<Result<u64, CommitError<<S as State>::Error>>>;

/// The thread that owns the log.
struct Writer<S: State> {
    shared: Arc<Shared<S>>,
    requests: mpsc::Receiver<Request<S>>,
    /// Opened with O_APPEND (and O_CLOEXEC, as std opens every file).
    log: File,
    log_bytes: u64,
    snapshot_generation: u64,
    compact_after_bytes: u64,
    batch_max: usize,
}

impl<S: State> Writer<S> {
    fn run(mut self) {
        let mut batch = Vec::new();
        while let Some(first) = self.requests.blocking_recv() {
            batch.push(first);
            while batch.len() < self.batch_max {
                match self.requests.try_recv() {
                    Ok(request) => batch.push(request),
                    Err(_) => break,
                }
            }
            self.shared.batches.fetch_add(1, Ordering::Relaxed);
            let mut commits = Vec::new();
            for request in batch.drain(..) {
                match request {
                    Request::Commit { changes, reply } => commits.push((changes, reply)),
                    Request::Compact { reply } => {
                        // Commits queued before the compaction go into its snapshot.
                        self.commit_group(std::mem::take(&mut commits));
                        let _ = reply.send(self.compact());
                    }
                }
            }
            self.commit_group(commits);
            if self.log_bytes > self.compact_after_bytes
                && self.shared.failure().is_none()
                && let Err(error) = self.compact()
            {
                tracing::warn!(dir = %self.shared.dir.display(), %error, "automatic store compaction failed");
            }
        }
    }

    /// Checks, writes, syncs and publishes a group of transactions, then answers each.
    fn commit_group(&mut self, commits: Vec<(Vec<S::Change>, CommitReply<S>)>) {
        if commits.is_empty() {
            return;
        }
        if let Some(reason) = self.shared.failure() {
            for (_, reply) in commits {
                let error = self.shared.failed(reason.clone());
                let _ = reply.send(Err(CommitError::Store(error)));
            }
            return;
        }
        let base = self.shared.published();
        let mut generation = base.generation;
        // Cloned on the first transaction that passes its checks.
        let mut next: Option<S> = None;
        let mut records = Vec::new();
        let mut accepted = Vec::new();
        for (changes, reply) in commits {
            let state = next.get_or_insert_with(|| base.state.clone());
            let checked = match check_transaction(state, &changes) {
                Ok(checked) => checked,
                Err(error) => {
                    let _ = reply.send(Err(CommitError::Rejected(error)));
                    continue;
                }
            };
            if let Err(error) = encode_record(&mut records, generation + 1, &changes) {
                let _ = reply.send(Err(CommitError::Store(error)));
                continue;
            }
            match checked {
                Some(trial) => *state = trial,
                None => changes.iter().for_each(|change| state.apply(change)),
            }
            generation += 1;
            accepted.push((generation, reply));
        }
        let Some(state) = next.filter(|_| !accepted.is_empty()) else {
            return;
        };

        let log_path = self.shared.dir.join(LOG_FILE);
        let written = self.log.write_all(&records).and_then(|()| {
            self.shared.fsyncs.fetch_add(1, Ordering::Relaxed);
            self.log.sync_data()
        });
        if let Err(error) = written {
            self.shared
                .fail(format!("cannot append to {}: {error}", log_path.display()));
            for (_, reply) in accepted {
                let _ = reply.send(Err(CommitError::Store(StoreError::Write {
                    path: log_path.clone(),
                    error: io::Error::new(error.kind(), error.to_string()),
                })));
            }
            return;
        }
        self.log_bytes += records.len() as u64;
        self.shared.publish(Published { state, generation });
        self.shared
            .commits
            .fetch_add(accepted.len() as u64, Ordering::Relaxed);
        for (generation, reply) in accepted {
            let _ = reply.send(Ok(generation));
        }
    }

    /// Snapshots the current state, then replaces the log with an empty one.
    ///
    /// A failure while preparing the new files changes nothing on disk and is only
    /// returned. A failure once they start replacing the old ones leaves the files valid for
    /// open, but not the writer's view of them, so it also stops the store taking commits.
    fn compact(&mut self) -> Result<(), StoreError> {
        if let Some(error) = self.shared.failed_error() {
            return Err(error);
        }
        let current = self.shared.published();
        if current.generation == self.snapshot_generation && self.log_bytes == 0 {
            return Ok(());
        }
        let snapshot = serde_json::to_vec(&SnapshotRef {
            generation: current.generation,
            state: &current.state,
        })
        .map_err(|error| StoreError::Encode {
            what: "snapshot",
            error,
        })?;
        let dir = &self.shared.dir;
        // Both files are prepared before either replaces its old one; a staged file that is
        // not put in place is removed when dropped.
        let new_snapshot = durable::stage(&dir.join(SNAPSHOT_FILE), &snapshot, 0o600)?;
        let new_log = durable::stage(&dir.join(LOG_FILE), &[], 0o600)?;
        let replaced = new_snapshot
            .commit()
            .and_then(|()| new_log.commit())
            .map_err(StoreError::from)
            .and_then(|()| open_log(&dir.join(LOG_FILE), false));
        match replaced {
            Ok(log) => {
                self.log = log;
                self.log_bytes = 0;
                self.snapshot_generation = current.generation;
                tracing::debug!(dir = %dir.display(), generation = current.generation, "store compacted");
                Ok(())
            }
            Err(error) => {
                self.shared.fail(format!("compaction failed: {error}"));
                Err(error)
            }
        }
    }
}

/// Checks a transaction's changes in order. One change is only checked (the caller applies
/// it); several are applied to a copy, so a refusal of a later one leaves `state` untouched;
/// the copy is returned.
fn check_transaction<S: State>(state: &S, changes: &[S::Change]) -> Result<Option<S>, S::Error> {
    match changes {
        [] => Ok(None),
        [change] => state.check(change).map(|()| None),
        changes => {
            let mut trial = state.clone();
            for change in changes {
                trial.check(change)?;
                trial.apply(change);
            }
            Ok(Some(trial))
        }
    }
}

#[derive(Serialize)]
struct RecordRef<'a, C> {
    generation: u64,
    changes: &'a [C],
}

#[derive(Deserialize)]
struct Record<C> {
    generation: u64,
    changes: Vec<C>,
}

#[derive(Serialize)]
struct SnapshotRef<'a, S> {
    generation: u64,
    state: &'a S,
}

#[derive(Deserialize)]
struct Snapshot<S> {
    generation: u64,
    state: S,
}

/// Appends one framed record to `out`; leaves `out` unchanged on error.
fn encode_record<C: Serialize>(
    out: &mut Vec<u8>,
    generation: u64,
    changes: &[C],
) -> Result<(), StoreError> {
    let payload = serde_json::to_vec(&RecordRef {
        generation,
        changes,
    })
    .map_err(|error| StoreError::Encode {
        what: "transaction",
        error,
    })?;
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|&len| len <= RECORD_BYTES_MAX)
        .ok_or(StoreError::RecordTooLarge {
            bytes: payload.len(),
        })?;
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(&payload).to_le_bytes());
    out.extend_from_slice(&payload);
    Ok(())
}

struct Replay {
    generation: u64,
    records_replayed: usize,
    /// Bytes of whole records, where appends continue.
    log_bytes: u64,
    dropped_tail: Option<DroppedTail>,
}

/// Applies the records of `log` after `snapshot_generation` to `state`. A short or badly
/// checksummed record is a torn write, and reported as the tail to drop, only when it is the
/// last thing in the log (nothing but zeros after it, which a crash can leave where a write
/// was not done); anywhere else it is corruption, and opening refuses: cutting there would
/// drop every acknowledged record after it.
fn replay_log<S: State>(
    path: &Path,
    log: &[u8],
    state: &mut S,
    snapshot_generation: u64,
) -> Result<Replay, StoreError> {
    let mut offset = 0;
    let mut generation = snapshot_generation;
    // The generation of the previous record: they follow each other one by one.
    let mut previous: Option<u64> = None;
    let mut records_replayed = 0;
    let mut torn = None;
    while offset < log.len() {
        let rest = &log[offset..];
        let Some((header, rest)) = rest.split_first_chunk::<RECORD_HEADER_BYTES>() else {
            torn = Some(format!("short record header: {} bytes", rest.len()));
            break;
        };
        let [l0, l1, l2, l3, c0, c1, c2, c3] = *header;
        let len = u32::from_le_bytes([l0, l1, l2, l3]);
        let crc = u32::from_le_bytes([c0, c1, c2, c3]);
        let corrupt = |reason: String| StoreError::CorruptLog {
            path: path.to_owned(),
            offset: offset as u64,
            reason,
        };
        let last = |after: &[u8]| after.iter().all(|&b| b == 0);
        if len == 0 || len > RECORD_BYTES_MAX {
            let reason = format!("bad record length {len}");
            // A length running past the end could be the last record's, torn.
            if len as usize <= rest.len() && !last(rest) {
                return Err(corrupt(format!("{reason}, with records after it")));
            }
            torn = Some(reason);
            break;
        }
        let Some(payload) = rest.get(..len as usize) else {
            torn = Some(format!(
                "short record: {} of {len} payload bytes",
                rest.len()
            ));
            break;
        };
        if crc32c::crc32c(payload) != crc {
            if !last(&rest[len as usize..]) {
                return Err(corrupt(
                    "record checksum mismatch, with records after it".to_owned(),
                ));
            }
            torn = Some("record checksum mismatch".to_owned());
            break;
        }
        // The checksum matched, so this is no torn write: dropping it would lose an
        // acknowledged transaction.
        let record: Record<S::Change> = serde_json::from_slice(payload)
            .map_err(|error| corrupt(format!("checksummed record does not decode: {error}")))?;
        let expected = match previous {
            Some(previous) => previous + 1,
            // The log starts at or before the snapshot's next generation.
            None if (1..=snapshot_generation + 1).contains(&record.generation) => record.generation,
            None => snapshot_generation + 1,
        };
        if record.generation != expected {
            return Err(corrupt(format!(
                "record of generation {} where {expected} was expected (snapshot generation {snapshot_generation})",
                record.generation
            )));
        }
        previous = Some(record.generation);
        if record.generation > snapshot_generation {
            for change in &record.changes {
                state.check(change).map_err(|error| {
                    corrupt(format!(
                        "generation {}: the state refuses committed change {change:?}: {error}",
                        record.generation
                    ))
                })?;
                state.apply(change);
            }
            generation = record.generation;
            records_replayed += 1;
        }
        offset += RECORD_HEADER_BYTES + len as usize;
    }
    let dropped_tail = torn.map(|reason| DroppedTail {
        offset: offset as u64,
        bytes: (log.len() - offset) as u64,
        reason,
    });
    Ok(Replay {
        generation,
        records_replayed,
        log_bytes: offset as u64,
        dropped_tail,
    })
}

/// The snapshot's state and generation; the default state at generation 0 if there is none.
fn read_snapshot<S: State>(path: &Path) -> Result<(S, u64), StoreError> {
    match std::fs::read(path) {
        Ok(bytes) => {
            let snapshot: Snapshot<S> =
                serde_json::from_slice(&bytes).map_err(|error| StoreError::CorruptSnapshot {
                    path: path.to_owned(),
                    reason: error.to_string(),
                })?;
            Ok((snapshot.state, snapshot.generation))
        }
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok((S::default(), 0)),
        Err(error) => Err(StoreError::Read {
            path: path.to_owned(),
            error,
        }),
    }
}

fn open_log(path: &Path, create: bool) -> Result<File, StoreError> {
    OpenOptions::new()
        .append(true)
        .create_new(create)
        .mode(0o600)
        .open(path)
        .map_err(|error| StoreError::Write {
            path: path.to_owned(),
            error,
        })
}

/// The store's directory: owner-only, and durably named in its parent (a store whose
/// directory entry a crash lost would lose every acknowledged change with it).
fn create_dir(dir: &Path) -> Result<(), StoreError> {
    durable::private_dir(dir).map_err(|e| StoreError::Write {
        path: e.path,
        error: e.error,
    })
}

fn remove_if_present(path: &Path) -> Result<(), StoreError> {
    match std::fs::remove_file(path) {
        Err(error) if error.kind() != io::ErrorKind::NotFound => Err(StoreError::Write {
            path: path.to_owned(),
            error,
        }),
        _ => Ok(()),
    }
}

/// Fsyncs the store directory (after the log is created).
fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    durable::sync_dir(dir).map_err(StoreError::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// A map of names to values; deleting a missing name is refused.
    #[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
    struct Map(BTreeMap<String, String>);

    #[derive(Debug, Clone, Serialize, Deserialize)]
    enum Change {
        Set(String, String),
        Delete(String),
    }

    #[derive(Debug, PartialEq, Eq, thiserror::Error)]
    #[error("no key {0:?}")]
    struct Missing(String);

    impl State for Map {
        type Change = Change;
        type Error = Missing;
        fn check(&self, change: &Change) -> Result<(), Missing> {
            match change {
                Change::Set(..) => Ok(()),
                Change::Delete(key) if self.0.contains_key(key) => Ok(()),
                Change::Delete(key) => Err(Missing(key.clone())),
            }
        }
        fn apply(&mut self, change: &Change) {
            match change {
                Change::Set(key, value) => {
                    self.0.insert(key.clone(), value.clone());
                }
                Change::Delete(key) => {
                    self.0.remove(key);
                }
            }
        }
    }

    fn set(key: &str, value: &str) -> Change {
        Change::Set(key.into(), value.into())
    }

    fn open(dir: &Path) -> (Store<Map>, OpenReport) {
        Store::open(dir, StoreOptions::default()).expect("open")
    }

    fn snapshot_of(store: &Store<Map>) -> (Map, u64) {
        store.read(|state, generation| (state.clone(), generation))
    }

    fn log_len(dir: &Path) -> u64 {
        std::fs::metadata(dir.join(LOG_FILE))
            .expect("log metadata")
            .len()
    }

    fn append_to_log(dir: &Path, bytes: &[u8]) {
        let mut log = OpenOptions::new()
            .append(true)
            .open(dir.join(LOG_FILE))
            .expect("open log");
        log.write_all(bytes).expect("append to log");
    }

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

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_commits_share_fsyncs() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (store, _) = open(tmp.path());
        let store = Arc::new(store);
        let start = Arc::new(tokio::sync::Barrier::new(200));
        let tasks: Vec<_> = (0..200)
            .map(|i| {
                let store = store.clone();
                let start = start.clone();
                tokio::spawn(async move {
                    start.wait().await;
                    store.commit(vec![set(&format!("k{i}"), "v")]).await
                })
            })
            .collect();
        let mut generations = Vec::new();
        for task in tasks {
            generations.push(task.await.expect("task").expect("commit"));
        }
        generations.sort_unstable();
        assert_eq!(generations, (1..=200).collect::<Vec<u64>>());
        let stats = store.stats();
        assert_eq!(stats.commits, 200);
        assert!(stats.fsyncs < 200, "{stats:?}");
        assert!(stats.batches <= stats.fsyncs + 1, "{stats:?}");
        assert_eq!(store.read(|map, g| (map.0.len(), g)), (200, 200));
    }

    #[tokio::test]
    async fn corruption_before_the_last_record_refuses_to_open() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (store, _) = open(tmp.path());
        store.commit(vec![set("a", "1")]).await.expect("commit");
        let first_end = log_len(tmp.path());
        store.commit(vec![set("b", "2")]).await.expect("commit");
        store.commit(vec![set("c", "3")]).await.expect("commit");
        drop(store);
        let log = tmp.path().join(LOG_FILE);
        let mut bytes = std::fs::read(&log).expect("read the log");
        // A byte inside the second record's payload: two acknowledged records follow it.
        bytes[first_end as usize + RECORD_HEADER_BYTES + 2] ^= 0x20;
        std::fs::write(&log, &bytes).expect("write");
        let opened = Store::<Map>::open(tmp.path(), StoreOptions::default());
        let Err(StoreError::CorruptLog { offset, reason, .. }) = opened else {
            panic!(
                "opened a log corrupt in the middle: {:?}",
                opened.map(|(_, r)| r)
            );
        };
        assert_eq!(offset, first_end);
        assert!(reason.contains("records after it"), "{reason}");
        assert_eq!(std::fs::read(&log).expect("read"), bytes, "nothing was cut");
    }

    #[tokio::test]
    async fn torn_tails_are_dropped_once() {
        let mut torn_record = Vec::new();
        encode_record(&mut torn_record, 3, &[set("torn", "x")]).expect("encode");
        let mut cut_record = torn_record.clone();
        cut_record.truncate(torn_record.len() - 3);
        let mut bad_crc = torn_record.clone();
        bad_crc[5] ^= 0x40;
        let tails: [(&str, Vec<u8>); 5] = [
            ("garbage", b"\x07garbage bytes!".to_vec()),
            ("zeros", vec![0; 32]),
            ("short header", vec![1, 2, 3]),
            ("truncated record", cut_record),
            ("flipped checksum byte", bad_crc),
        ];
        for (what, tail) in tails {
            let tmp = tempfile::tempdir().expect("tempdir");
            let (store, _) = open(tmp.path());
            store.commit(vec![set("a", "1")]).await.expect("commit");
            store.commit(vec![set("b", "2")]).await.expect("commit");
            let before = snapshot_of(&store);
            drop(store);
            let good = log_len(tmp.path());
            append_to_log(tmp.path(), &tail);

            let (store, report) = open(tmp.path());
            let dropped = report.dropped_tail.expect(what);
            assert_eq!(dropped.offset, good, "{what}");
            assert_eq!(dropped.bytes, tail.len() as u64, "{what}");
            assert_eq!(report.generation, 2, "{what}");
            assert_eq!(report.records_replayed, 2, "{what}");
            assert_eq!(snapshot_of(&store), before, "{what}");
            assert_eq!(log_len(tmp.path()), good, "{what}");
            // Appends continue where the good records end.
            assert_eq!(store.commit(vec![set("c", "3")]).await.expect(what), 3);
            drop(store);

            let (store, report) = open(tmp.path());
            assert_eq!(report.dropped_tail, None, "{what}");
            assert_eq!(report.generation, 3, "{what}");
            assert_eq!(store.read(|map, _| map.0.len()), 3, "{what}");
        }
    }

    #[tokio::test]
    async fn compaction_keeps_state_and_survives_a_crash_before_the_log_reset() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let options = StoreOptions {
            compact_after_bytes: 512,
            ..StoreOptions::default()
        };
        let (store, _) = Store::<Map>::open(tmp.path(), options).expect("open");
        for i in 0..100 {
            store
                .commit(vec![set(&format!("k{}", i % 10), &i.to_string())])
                .await
                .expect("commit");
        }
        let before = snapshot_of(&store);
        assert_eq!(before.1, 100);
        // Dropping waits for the writer, which compacts after it answers a batch. Each record
        // is about 50 bytes: the log was reset several times.
        drop(store);
        assert!(log_len(tmp.path()) <= 512, "{}", log_len(tmp.path()));
        let (store, report) = Store::<Map>::open(tmp.path(), options).expect("reopen");
        assert!(report.snapshot_generation > 0);
        assert_eq!(
            report.snapshot_generation + report.records_replayed as u64,
            100
        );
        assert_eq!(snapshot_of(&store), before);

        // An explicit compaction leaves an empty log; keep the old log to put back, as if
        // the process died after the snapshot's rename and before the log's.
        store.commit(vec![set("late", "1")]).await.expect("commit");
        let old_log = std::fs::read(tmp.path().join(LOG_FILE)).expect("read log");
        assert!(!old_log.is_empty());
        store.compact().await.expect("compact");
        assert_eq!(log_len(tmp.path()), 0);
        let before = snapshot_of(&store);
        drop(store);
        std::fs::write(tmp.path().join(LOG_FILE), &old_log).expect("restore old log");

        let (store, report) = Store::<Map>::open(tmp.path(), options).expect("reopen");
        assert_eq!(report.snapshot_generation, 101);
        assert_eq!(report.generation, 101);
        assert_eq!(report.records_replayed, 0);
        assert_eq!(report.dropped_tail, None);
        assert_eq!(snapshot_of(&store), before);
        // Appends after the stale records follow on from them.
        assert_eq!(store.commit(vec![set("next", "1")]).await.expect("c"), 102);
        let before = snapshot_of(&store);
        drop(store);
        let (store, report) = Store::<Map>::open(tmp.path(), options).expect("reopen");
        assert_eq!(report.generation, 102);
        assert_eq!(snapshot_of(&store), before);
    }

    #[test]
    fn corrupt_snapshot_refuses_to_open() {
        let tmp = tempfile::tempdir().expect("tempdir");
        std::fs::write(tmp.path().join(SNAPSHOT_FILE), b"{\"generation\":3,\"sta")
            .expect("write snapshot");
        let err = Store::<Map>::open(tmp.path(), StoreOptions::default()).expect_err("corrupt");
        assert!(matches!(err, StoreError::CorruptSnapshot { .. }), "{err}");
        assert!(err.to_string().contains("snapshot.json"), "{err}");
    }

    #[test]
    fn gaps_and_undecodable_checksummed_records_refuse_to_open() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut records = Vec::new();
        encode_record(&mut records, 1, &[set("a", "1")]).expect("encode");
        encode_record(&mut records, 3, &[set("b", "1")]).expect("encode");
        std::fs::write(tmp.path().join(LOG_FILE), &records).expect("write log");
        let err = Store::<Map>::open(tmp.path(), StoreOptions::default()).expect_err("gap");
        assert!(matches!(err, StoreError::CorruptLog { .. }), "{err}");
        assert!(err.to_string().contains("generation 3"), "{err}");

        let payload = b"{\"generation\":1,\"changes\":[{\"Rename\":1}]}";
        let mut record = Vec::new();
        record.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        record.extend_from_slice(&crc32c::crc32c(payload).to_le_bytes());
        record.extend_from_slice(payload);
        std::fs::write(tmp.path().join(LOG_FILE), &record).expect("write log");
        let err = Store::<Map>::open(tmp.path(), StoreOptions::default()).expect_err("decode");
        assert!(
            matches!(err, StoreError::CorruptLog { offset: 0, .. }),
            "{err}"
        );
        assert_eq!(
            std::fs::read(tmp.path().join(LOG_FILE)).expect("read log"),
            record
        );
    }
}
