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
