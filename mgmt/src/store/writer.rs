//! The writer thread that owns the log: it takes the queued transactions in groups, checks
//! them, makes them durable with one write and one fdatasync, publishes the new state, and
//! compacts the log when it grows long. Also what it shares with the readers.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::thread::JoinHandle;

use tokio::sync::{mpsc, oneshot};

use super::log::encode_record;
use super::snapshot;
use super::{CommitError, LOG_FILE, State, StoreError, StoreOptions};

/// What the writer and the readers share.
pub(super) struct Shared<S> {
    pub(super) dir: PathBuf,
    /// Replaced whole by the writer, so a reader clones the `Arc` and never holds the lock
    /// while it looks at the state.
    current: RwLock<Arc<Published<S>>>,
    /// Tells each generation published.
    pub(super) generations: tokio::sync::watch::Sender<u64>,
    /// Why the store takes no more commits.
    failure: Mutex<Option<String>>,
    pub(super) commits: AtomicU64,
    pub(super) batches: AtomicU64,
    pub(super) fsyncs: AtomicU64,
}

pub(super) struct Published<S> {
    pub(super) state: S,
    pub(super) generation: u64,
}

impl<S> Shared<S> {
    /// What a store opened in `dir` at `generation` shares.
    pub(super) fn new(dir: &Path, state: S, generation: u64) -> Shared<S> {
        Shared {
            dir: dir.to_owned(),
            current: RwLock::new(Arc::new(Published { state, generation })),
            generations: tokio::sync::watch::Sender::new(generation),
            failure: Mutex::new(None),
            commits: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            fsyncs: AtomicU64::new(0),
        }
    }

    pub(super) fn published(&self) -> Arc<Published<S>> {
        // The value is replaced whole, so a panic elsewhere cannot leave it half-written.
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn publish(&self, published: Published<S>) {
        let generation = published.generation;
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(published);
        self.generations.send_replace(generation);
    }

    /// Why the store takes no more commits, if it does not.
    fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub(super) fn failed_error(&self) -> Option<StoreError> {
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

pub(super) enum Request<S: State> {
    Commit {
        changes: Vec<S::Change>,
        reply: oneshot::Sender<Result<u64, CommitError<S::Error>>>,
    },
    Compact {
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
}

type CommitReply<S> = oneshot::Sender<Result<u64, CommitError<<S as State>::Error>>>;

/// Where the log stands when the writer takes it over.
pub(super) struct LogEnd {
    /// Opened with O_APPEND (and O_CLOEXEC, as std opens every file).
    pub(super) log: File,
    /// Bytes of whole records, where appends continue.
    pub(super) log_bytes: u64,
    /// The generation of the snapshot the log follows.
    pub(super) snapshot_generation: u64,
}

/// Starts the writer thread on the opened log; returns its queue and the thread.
pub(super) fn spawn<S: State>(
    shared: Arc<Shared<S>>,
    log_end: LogEnd,
    options: StoreOptions,
) -> Result<(mpsc::Sender<Request<S>>, JoinHandle<()>), StoreError> {
    let queue_max = options.queue_max.max(1);
    let (requests, receiver) = mpsc::channel(queue_max);
    let writer = Writer {
        shared,
        requests: receiver,
        log: log_end.log,
        log_bytes: log_end.log_bytes,
        snapshot_generation: log_end.snapshot_generation,
        compact_after_bytes: options.compact_after_bytes,
        batch_max: queue_max,
    };
    let thread = std::thread::Builder::new()
        .name("kiln-store".into())
        .spawn(move || writer.run())
        .map_err(StoreError::Thread)?;
    Ok((requests, thread))
}

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

/// Transactions of a group that passed their checks: their records, their answers, and the
/// state and generation after the last of them.
struct CheckedGroup<S: State> {
    state: S,
    generation: u64,
    records: Vec<u8>,
    accepted: Vec<(u64, CommitReply<S>)>,
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
        if let Some(group) = self.check_group(commits) {
            self.write_group(group);
        }
    }

    /// Checks each transaction against the state the ones before it leave, and encodes its
    /// record; answers the refused ones. `None` when none was accepted.
    fn check_group(
        &self,
        commits: Vec<(Vec<S::Change>, CommitReply<S>)>,
    ) -> Option<CheckedGroup<S>> {
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
        let state = next.filter(|_| !accepted.is_empty())?;
        Some(CheckedGroup {
            state,
            generation,
            records,
            accepted,
        })
    }

    /// Appends a checked group's records with one write and one fdatasync, then publishes
    /// the new state and answers each transaction.
    fn write_group(&mut self, group: CheckedGroup<S>) {
        let CheckedGroup {
            state,
            generation,
            records,
            accepted,
        } = group;
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
        let dir = &self.shared.dir;
        let staged = snapshot::stage_compaction(dir, current.generation, &current.state)?;
        match staged.replace() {
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::test_state::{open, set};

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
}
