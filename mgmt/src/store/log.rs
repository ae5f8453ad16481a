//! The log: its record format, appending a record, and replaying the records over the
//! snapshot at open, cutting off a torn tail.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use kiln_admin::durable;
use serde::{Deserialize, Serialize};

use super::{DroppedTail, LOG_FILE, RECORD_BYTES_MAX, State, StoreError};

/// Payload length and CRC-32C.
const RECORD_HEADER_BYTES: usize = 8;

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

/// Appends one framed record to `out`; leaves `out` unchanged on error.
pub(super) fn encode_record<C: Serialize>(
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

pub(super) struct Replay {
    pub(super) generation: u64,
    pub(super) records_replayed: usize,
    /// Bytes of whole records, where appends continue.
    pub(super) log_bytes: u64,
    pub(super) dropped_tail: Option<DroppedTail>,
}

/// Opens the log in `dir` for appends and replays it over `state`, the snapshot's, cutting
/// off a torn tail; creates an empty log if there is none.
pub(super) fn open_and_replay<S: State>(
    dir: &Path,
    state: &mut S,
    snapshot_generation: u64,
) -> Result<(File, Replay), StoreError> {
    let log_path = dir.join(LOG_FILE);
    match std::fs::read(&log_path) {
        Ok(bytes) => {
            let replay = replay_log(&log_path, &bytes, state, snapshot_generation)?;
            let log = open_log(&log_path, false)?;
            if let Some(tail) = &replay.dropped_tail {
                cut_torn_tail(&log, &log_path, tail)?;
            }
            Ok((log, replay))
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
            Ok((log, replay))
        }
        Err(error) => Err(StoreError::Read {
            path: log_path,
            error,
        }),
    }
}

fn cut_torn_tail(log: &File, log_path: &Path, tail: &DroppedTail) -> Result<(), StoreError> {
    tracing::warn!(
        path = %log_path.display(),
        offset = tail.offset,
        bytes = tail.bytes,
        reason = %tail.reason,
        "dropping a torn tail from the store log"
    );
    let write_err = |error| StoreError::Write {
        path: log_path.to_owned(),
        error,
    };
    log.set_len(tail.offset).map_err(write_err)?;
    log.sync_all().map_err(write_err)
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
        let payload = match read_frame(path, offset, &log[offset..])? {
            Frame::Whole(payload) => payload,
            Frame::Torn(reason) => {
                torn = Some(reason);
                break;
            }
        };
        let corrupt = |reason| corrupt_log(path, offset, reason);
        // The checksum matched, so this is no torn write: dropping it would lose an
        // acknowledged transaction.
        let record: Record<S::Change> = serde_json::from_slice(payload)
            .map_err(|error| corrupt(format!("checksummed record does not decode: {error}")))?;
        let expected = expected_generation(previous, record.generation, snapshot_generation);
        if record.generation != expected {
            return Err(corrupt(format!(
                "record of generation {} where {expected} was expected (snapshot generation {snapshot_generation})",
                record.generation
            )));
        }
        previous = Some(record.generation);
        if record.generation > snapshot_generation {
            apply_record(state, &record).map_err(corrupt)?;
            generation = record.generation;
            records_replayed += 1;
        }
        offset += RECORD_HEADER_BYTES + payload.len();
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

/// What the log holds where a record should start.
enum Frame<'a> {
    /// A whole record whose checksum matches: its payload.
    Whole(&'a [u8]),
    /// A torn write at the end of the log, and why it is one.
    Torn(String),
}

/// Reads the frame of the record at the start of `rest`, `offset` bytes into the log at
/// `path`. A frame that is short or does not match its checksum is torn when nothing but
/// zeros follows it, and corruption otherwise.
fn read_frame<'a>(path: &Path, offset: usize, rest: &'a [u8]) -> Result<Frame<'a>, StoreError> {
    let Some((header, after_header)) = rest.split_first_chunk::<RECORD_HEADER_BYTES>() else {
        return Ok(Frame::Torn(format!(
            "short record header: {} bytes",
            rest.len()
        )));
    };
    let [l0, l1, l2, l3, c0, c1, c2, c3] = *header;
    let len = u32::from_le_bytes([l0, l1, l2, l3]);
    let crc = u32::from_le_bytes([c0, c1, c2, c3]);
    let last = |after: &[u8]| after.iter().all(|&b| b == 0);
    if len == 0 || len > RECORD_BYTES_MAX {
        let reason = format!("bad record length {len}");
        // A length running past the end could be the last record's, torn.
        if len as usize <= after_header.len() && !last(after_header) {
            return Err(corrupt_log(
                path,
                offset,
                format!("{reason}, with records after it"),
            ));
        }
        return Ok(Frame::Torn(reason));
    }
    let Some(payload) = after_header.get(..len as usize) else {
        return Ok(Frame::Torn(format!(
            "short record: {} of {len} payload bytes",
            after_header.len()
        )));
    };
    if crc32c::crc32c(payload) != crc {
        if !last(&after_header[len as usize..]) {
            return Err(corrupt_log(
                path,
                offset,
                "record checksum mismatch, with records after it".to_owned(),
            ));
        }
        return Ok(Frame::Torn("record checksum mismatch".to_owned()));
    }
    Ok(Frame::Whole(payload))
}

/// The generation the record after `previous` must have. The log starts at or before the
/// snapshot's next generation, so the first record may have any generation up to that.
fn expected_generation(previous: Option<u64>, generation: u64, snapshot_generation: u64) -> u64 {
    match previous {
        Some(previous) => previous + 1,
        None if (1..=snapshot_generation + 1).contains(&generation) => generation,
        None => snapshot_generation + 1,
    }
}

/// Applies a replayed record's changes, each checked first: the state refusing a committed
/// change is corruption, whose reason this returns.
fn apply_record<S: State>(state: &mut S, record: &Record<S::Change>) -> Result<(), String> {
    for change in &record.changes {
        state.check(change).map_err(|error| {
            format!(
                "generation {}: the state refuses committed change {change:?}: {error}",
                record.generation
            )
        })?;
        state.apply(change);
    }
    Ok(())
}

fn corrupt_log(path: &Path, offset: usize, reason: String) -> StoreError {
    StoreError::CorruptLog {
        path: path.to_owned(),
        offset: offset as u64,
        reason,
    }
}

pub(super) fn open_log(path: &Path, create: bool) -> Result<File, StoreError> {
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

/// Fsyncs the store directory (after the log is created).
fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    durable::sync_dir(dir).map_err(StoreError::from)
}

#[cfg(test)]
mod tests {
    use super::super::test_state::{Map, append_to_log, log_len, open, set, snapshot_of};
    use super::super::{LogStore, StoreOptions};
    use super::*;

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
        let opened = LogStore::<Map>::open(tmp.path(), StoreOptions::default());
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

    #[test]
    fn gaps_and_undecodable_checksummed_records_refuse_to_open() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut records = Vec::new();
        encode_record(&mut records, 1, &[set("a", "1")]).expect("encode");
        encode_record(&mut records, 3, &[set("b", "1")]).expect("encode");
        std::fs::write(tmp.path().join(LOG_FILE), &records).expect("write log");
        let err = LogStore::<Map>::open(tmp.path(), StoreOptions::default()).expect_err("gap");
        assert!(matches!(err, StoreError::CorruptLog { .. }), "{err}");
        assert!(err.to_string().contains("generation 3"), "{err}");

        let payload = b"{\"generation\":1,\"changes\":[{\"Rename\":1}]}";
        let mut record = Vec::new();
        record.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        record.extend_from_slice(&crc32c::crc32c(payload).to_le_bytes());
        record.extend_from_slice(payload);
        std::fs::write(tmp.path().join(LOG_FILE), &record).expect("write log");
        let err = LogStore::<Map>::open(tmp.path(), StoreOptions::default()).expect_err("decode");
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
