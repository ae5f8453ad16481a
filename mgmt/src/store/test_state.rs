//! A small [`State`] and helpers shared by the store's tests.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{LOG_FILE, LogStore, OpenReport, State, StoreOptions};

/// A map of names to values; deleting a missing name is refused.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Map(pub(super) BTreeMap<String, String>);

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) enum Change {
    Set(String, String),
    Delete(String),
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("no key {0:?}")]
pub(super) struct Missing(pub(super) String);

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

impl super::etcd::Objects for Map {
    fn objects(&self) -> BTreeMap<String, Vec<u8>> {
        self.0
            .iter()
            .map(|(k, v)| (k.clone(), v.clone().into_bytes()))
            .collect()
    }

    fn from_objects(objects: &BTreeMap<String, Vec<u8>>) -> Result<Map, String> {
        let text = |(k, v): (&String, &Vec<u8>)| {
            let v = String::from_utf8(v.clone()).map_err(|e| e.to_string())?;
            Ok((k.clone(), v))
        };
        objects
            .iter()
            .map(text)
            .collect::<Result<_, String>>()
            .map(Map)
    }
}

pub(super) fn set(key: &str, value: &str) -> Change {
    Change::Set(key.into(), value.into())
}

pub(super) fn open(dir: &Path) -> (LogStore<Map>, OpenReport) {
    LogStore::open(dir, StoreOptions::default()).expect("open")
}

pub(super) fn snapshot_of(store: &LogStore<Map>) -> (Map, u64) {
    store.read(|state, generation| (state.clone(), generation))
}

pub(super) fn log_len(dir: &Path) -> u64 {
    std::fs::metadata(dir.join(LOG_FILE))
        .expect("log metadata")
        .len()
}

pub(super) fn append_to_log(dir: &Path, bytes: &[u8]) {
    let mut log = OpenOptions::new()
        .append(true)
        .open(dir.join(LOG_FILE))
        .expect("open log");
    log.write_all(bytes).expect("append to log");
}
