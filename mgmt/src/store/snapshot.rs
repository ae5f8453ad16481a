//! The snapshot file: the whole state at one generation, written by a compaction together
//! with the empty log that follows it, and read first at open.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

use kiln_admin::durable::{self, Staged};
use serde::{Deserialize, Serialize};

use super::log::open_log;
use super::{LOG_FILE, SNAPSHOT_FILE, State, StoreError};

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

/// The snapshot's state and generation; the default state at generation 0 if there is none.
pub(super) fn read<S: State>(path: &Path) -> Result<(S, u64), StoreError> {
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

/// Removes the files a compaction that crashed before putting them in place left.
pub(super) fn remove_compaction_leftovers(dir: &Path) -> Result<(), StoreError> {
    for file in [SNAPSHOT_FILE, LOG_FILE] {
        remove_if_present(&durable::temp_path(&dir.join(file)))?;
    }
    Ok(())
}

/// A new snapshot and the empty log after it, written but not yet in place.
pub(super) struct Compaction {
    snapshot: Staged,
    log: Staged,
    log_path: PathBuf,
}

/// Writes the snapshot of `state` at `generation` and an empty log beside the store's files
/// in `dir`. Both files are prepared before either replaces its old one; a staged file that
/// is not put in place is removed when dropped.
pub(super) fn stage_compaction<S: Serialize>(
    dir: &Path,
    generation: u64,
    state: &S,
) -> Result<Compaction, StoreError> {
    let snapshot = serde_json::to_vec(&SnapshotRef { generation, state }).map_err(|error| {
        StoreError::Encode {
            what: "snapshot",
            error,
        }
    })?;
    let log_path = dir.join(LOG_FILE);
    let snapshot = durable::stage(&dir.join(SNAPSHOT_FILE), &snapshot, 0o600)?;
    let log = durable::stage(&log_path, &[], 0o600)?;
    Ok(Compaction {
        snapshot,
        log,
        log_path,
    })
}

impl Compaction {
    /// Puts the snapshot, then the empty log, in place; returns the new log opened for
    /// appends.
    pub(super) fn replace(self) -> Result<File, StoreError> {
        self.snapshot
            .commit()
            .and_then(|()| self.log.commit())
            .map_err(StoreError::from)
            .and_then(|()| open_log(&self.log_path, false))
    }
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

#[cfg(test)]
mod tests {
    use super::super::test_state::{Map, log_len, set, snapshot_of};
    use super::super::{LogStore, StoreOptions};
    use super::*;

    #[tokio::test]
    async fn compaction_keeps_state_and_survives_a_crash_before_the_log_reset() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let options = StoreOptions {
            compact_after_bytes: 512,
            ..StoreOptions::default()
        };
        let (store, _) = LogStore::<Map>::open(tmp.path(), options).expect("open");
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
        let (store, report) = LogStore::<Map>::open(tmp.path(), options).expect("reopen");
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

        let (store, report) = LogStore::<Map>::open(tmp.path(), options).expect("reopen");
        assert_eq!(report.snapshot_generation, 101);
        assert_eq!(report.generation, 101);
        assert_eq!(report.records_replayed, 0);
        assert_eq!(report.dropped_tail, None);
        assert_eq!(snapshot_of(&store), before);
        // Appends after the stale records follow on from them.
        assert_eq!(store.commit(vec![set("next", "1")]).await.expect("c"), 102);
        let before = snapshot_of(&store);
        drop(store);
        let (store, report) = LogStore::<Map>::open(tmp.path(), options).expect("reopen");
        assert_eq!(report.generation, 102);
        assert_eq!(snapshot_of(&store), before);
    }

    #[test]
    fn corrupt_snapshot_refuses_to_open() {
        let tmp = tempfile::tempdir().expect("tempdir");
        std::fs::write(tmp.path().join(SNAPSHOT_FILE), b"{\"generation\":3,\"sta")
            .expect("write snapshot");
        let err = LogStore::<Map>::open(tmp.path(), StoreOptions::default()).expect_err("corrupt");
        assert!(matches!(err, StoreError::CorruptSnapshot { .. }), "{err}");
        assert!(err.to_string().contains("snapshot.json"), "{err}");
    }
}
