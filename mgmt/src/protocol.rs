//! What `kiln` and `kiln-mgmtd` say over the daemon's Unix socket: one JSON request line, one
//! JSON response line, per connection.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::volume::Volume;

/// Where the daemon listens unless told otherwise.
pub const DEFAULT_SOCKET: &str = "/run/kiln/mgmtd.sock";
/// Longest request or response line, in bytes.
pub const LINE_MAX_BYTES: usize = 1024 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Request {
    VolumeCreate {
        name: String,
        bricks: Vec<PathBuf>,
        /// The first brick's port; the others follow. Default: the lowest free ones.
        port: Option<u16>,
    },
    VolumeDelete {
        name: String,
    },
    VolumeStart {
        name: String,
    },
    VolumeStop {
        name: String,
    },
    /// One volume, or all.
    VolumeInfo {
        name: Option<String>,
    },
    VolumeStatus {
        name: String,
    },
    VolumeSet {
        name: String,
        key: String,
        value: String,
    },
    /// One option, or all (`key` = None).
    VolumeGet {
        name: String,
        key: Option<String>,
    },
    VolumeReset {
        name: String,
        key: Option<String>,
    },
    /// `kiln volume profile`: switch the bricks' per-fop profile on or off, or read it.
    VolumeProfile {
        name: String,
        action: ProfileAction,
    },
    /// `kiln volume statedump`: every running brick's state as JSON.
    VolumeStatedump {
        name: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProfileAction {
    /// `diagnostics.count-fop-hits` and `diagnostics.latency-measurement` on (counters start
    /// from zero).
    Start,
    /// Both off; the numbers so far stay readable.
    Stop,
    /// Each brick's profile.
    Info,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "kebab-case")]
pub enum Response {
    /// A committed change: the configuration generation it made.
    Done {
        generation: u64,
        message: String,
    },
    Volumes {
        generation: u64,
        volumes: Vec<Volume>,
    },
    Options {
        options: Vec<OptionValue>,
    },
    Status {
        bricks: Vec<BrickStatus>,
    },
    /// One answer per brick (profile, state dump).
    BrickReports {
        generation: u64,
        bricks: Vec<BrickReport>,
    },
    Error {
        message: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OptionValue {
    pub key: String,
    pub value: String,
    /// Set explicitly on the volume, or the default.
    pub set: bool,
}

/// A brick's answer to a query: `report` as the brick sent it, or why there is none.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BrickReport {
    pub brick: String,
    pub path: PathBuf,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub report: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BrickStatus {
    pub path: PathBuf,
    pub port: u16,
    pub pid: Option<u32>,
    /// `running`, `restarting`, `stopped`.
    pub state: String,
    pub uptime_secs: u64,
    pub restarts: u32,
    /// The configuration generation the running brick has applied.
    pub generation: Option<u64>,
    /// `ok` when the running brick answers on its control socket, else why not; `-` when it
    /// is not running.
    pub health: String,
}

/// One fop's line of a profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FopProfile {
    pub fop: String,
    pub calls: u64,
    pub errors: u64,
    pub bytes: u64,
    /// Executor steps (one syscall's worth each) of the fop's chains.
    pub steps: u64,
    /// Of those, submitted to io_uring.
    pub sqes: u64,
    /// Calls run on the blocking pool.
    pub pool_jobs: u64,
    pub intents: u64,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub latency: Option<LatencySummary>,
}

/// A latency histogram summed up, in microseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    pub count: u64,
    pub avg_us: f64,
    pub min_us: f64,
    pub max_us: f64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
}

/// A brick's profile as `kiln volume profile VOL info` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProfileReport {
    pub counting: bool,
    pub timing: bool,
    /// Seconds since counting (timing) was last switched on.
    pub counting_for_s: f64,
    pub timing_for_s: f64,
    /// Fops with at least one call, in table order.
    pub fops: Vec<FopProfile>,
    /// Failed fops by errno name.
    pub errors: std::collections::BTreeMap<String, u64>,
}
