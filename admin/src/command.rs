//! What `kiln` and `kiln-mgmtd` say over the daemon's command socket (root-only): one
//! [`Request`] line, one [`Response`] line, per connection ([`EXCHANGE`]).

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::control::{ProfileReport, Statedump};
use crate::exchange::LineExchange;
use crate::volume::{BrickRole, Volume};

/// Where the daemon listens unless told otherwise.
pub const DEFAULT_SOCKET: &str = "/run/kiln/mgmtd.sock";

/// The command socket's exchange. A response relays every brick's state dump (each up to the
/// control socket's line limit, usually a few KiB), so it gets 16 MiB. The daemon waits 10 s
/// for a request. `kiln` waits 10 minutes for an answer: stopping a volume drains its bricks
/// (15 s each at most, together) and a change is pushed to the bricks one by one (5 s each
/// at most), so a large volume with stuck bricks takes a while to answer.
pub const EXCHANGE: LineExchange = LineExchange {
    line_bytes_max: 16 << 20,
    request_timeout: Duration::from_secs(10),
    exchange_timeout: Duration::from_secs(600),
};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Request {
    VolumeCreate {
        name: String,
        bricks: Vec<PathBuf>,
        /// The first brick's port; the others follow. Default: the lowest free ones.
        port: Option<u16>,
    },
    /// Adds a brick (made and formatted if missing) at the end of the volume's brick list.
    VolumeAddBrick {
        name: String,
        brick: PathBuf,
        /// Default: the lowest free one.
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
    /// `kiln cluster status`: the store, and every host whose daemon reports.
    ClusterStatus,
    /// `kiln cluster token`: a one-time token a host joins the cluster with.
    ClusterToken {
        valid_secs: u64,
    },
    /// `kiln cluster leave`: this host leaves its cluster (none of its bricks may be in a
    /// volume); its daemon stops.
    ClusterLeave,
    /// `kiln volume rebalance VOLUME start|status|stop`: run by one daemon of the cluster
    /// (the elected one), whichever daemon is asked.
    Rebalance {
        name: String,
        action: TaskAction,
    },
    /// `kiln volume remove-brick VOLUME BRICK start|status|stop|commit`: the brick leaves
    /// (given no share of any directory, its files moved off by a rebalance), or serves again,
    /// or — once a rebalance emptied it — is removed.
    VolumeRemoveBrick {
        name: String,
        brick: PathBuf,
        action: RemoveAction,
    },
}

/// What to do with a brick being removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RemoveAction {
    /// Mark it leaving and start the rebalance that empties it.
    Start,
    /// That rebalance's progress.
    Status,
    /// Stop that rebalance; the brick serves again.
    Stop,
    /// Remove it from the volume: allowed once a rebalance completed with nothing left on it.
    Commit,
    /// Remove it from the volume now, its files with it (they stay in its directory, out of
    /// the volume), and start a rebalance over the bricks left: for a brick whose host is
    /// gone.
    Force,
}

/// What to do with a volume's cluster-wide task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TaskAction {
    /// Start a rebalance.
    Start,
    /// Start a fix-layout (`kiln volume heal`, `rebalance … fix-layout`).
    FixLayout,
    Status,
    /// Stop after the file being moved (the directory being healed).
    Stop,
}

/// A volume's cluster-wide task: one runs at a time per volume.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TaskKind {
    /// Every directory laid out over the serving bricks, every file moved to its hashed
    /// brick.
    #[default]
    Rebalance,
    /// Every directory looked up, which heals it: copies a brick lacks made, layouts with
    /// holes or overlaps (or that leave out a serving brick) rebuilt; no file moved.
    FixLayout,
}

impl TaskAction {
    /// The task this action starts, if it starts one.
    pub fn starts(self) -> Option<TaskKind> {
        match self {
            TaskAction::Start => Some(TaskKind::Rebalance),
            TaskAction::FixLayout => Some(TaskKind::FixLayout),
            TaskAction::Status | TaskAction::Stop => None,
        }
    }
}

impl TaskKind {
    /// The action that starts it.
    pub fn start(self) -> TaskAction {
        match self {
            TaskKind::Rebalance => TaskAction::Start,
            TaskKind::FixLayout => TaskAction::FixLayout,
        }
    }

    /// Its action word in `kiln volume rebalance VOLUME <action> --for-daemon`.
    pub fn action(self) -> &'static str {
        match self {
            TaskKind::Rebalance => "start",
            TaskKind::FixLayout => "fix-layout",
        }
    }
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

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// Each brick's profile.
    Profiles {
        generation: u64,
        bricks: Vec<BrickReport<ProfileReport>>,
    },
    /// Each brick's state.
    Statedumps {
        generation: u64,
        bricks: Vec<BrickReport<Statedump>>,
    },
    Cluster(ClusterStatus),
    /// A join token (`kiln_admin::join::Token` as text), valid for `valid_secs`.
    Token {
        token: String,
        valid_secs: u64,
    },
    Rebalance(RebalanceStatus),
    Error {
        message: String,
    },
}

/// What `kiln cluster status` shows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// `embedded` (one host), or `etcd <endpoints>`.
    pub store: String,
    /// The configuration generation this daemon has.
    pub generation: u64,
    /// Every host whose daemon reports (a single-node daemon: itself).
    pub hosts: Vec<HostReport>,
    /// Member hosts whose daemon does not report: down, or cut off etcd.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub down: Vec<String>,
    /// The host whose daemon runs the cluster-wide tasks (none while an election is on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leader: Option<String>,
}

/// What a daemon reports of its host, into etcd under a lease: gone within the lease's
/// time when the daemon or its host dies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostReport {
    pub host: String,
    /// The address its bricks listen on.
    pub listen_ip: std::net::IpAddr,
    pub daemon_pid: u32,
    /// The configuration generation its daemon has applied.
    pub generation: u64,
    /// Its bricks, by brick name.
    pub bricks: std::collections::BTreeMap<String, BrickStatus>,
}

/// What a rebalance did (`kiln_client::distribute::Distribute::rebalance` counts it).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RebalanceReport {
    /// Directories walked.
    pub dirs: u64,
    /// Files looked at, each once wherever it is listed (link files not counted).
    pub files: u64,
    /// Files moved to their hashed brick.
    pub moved: u64,
    /// Bytes copied to move them (a chunk copied again counts again).
    pub bytes_moved: u64,
    /// Link files on a brick their name no longer hashes to, removed.
    pub link_files_removed: u64,
    /// Files off their hashed brick left there (hard links, a mode that reads as a phase,
    /// another object under the name there, a file that kept changing); each logged.
    pub skipped: u64,
    /// Files or directories that failed (each logged); the walk goes on.
    pub failed: u64,
    /// Directory copies made on bricks that lacked them.
    #[serde(default)]
    pub copies_made: u64,
    /// Layouts rebuilt over the serving bricks.
    #[serde(default)]
    pub layouts_healed: u64,
    /// Entries other than directories still on a leaving brick when the walk ended (each
    /// logged): a leaving brick is removed only when a rebalance leaves none.
    #[serde(default)]
    pub left_on_leaving: u64,
}

/// A volume's rebalance: how far it got, where it runs. The process running it writes it to
/// [`rebalance_status_file`] after each directory; on a cluster the elected daemon copies it
/// into etcd, where every daemon reads it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RebalanceStatus {
    pub volume: String,
    #[serde(default)]
    pub kind: TaskKind,
    /// The host it runs on (`None`: a daemon of one host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// The process running it (0 before one does).
    pub pid: u32,
    /// `wanted` (asked, not yet running), `running`, `completed`, `stopped`, `failed` or
    /// `interrupted` (its process ended without saying how).
    pub state: String,
    #[serde(flatten)]
    pub report: RebalanceReport,
    pub elapsed_secs: f64,
    /// A stop was asked; the rebalance stops after the file it is moving.
    #[serde(default)]
    pub stop: bool,
    /// Why it failed or was interrupted, when that is known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The bricks (by index) it empties: those leaving when it started.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub leaving: Vec<usize>,
}

impl RebalanceStatus {
    /// A task of `volume` asked for, not yet running.
    pub fn wanted(volume: &str, kind: TaskKind) -> RebalanceStatus {
        RebalanceStatus {
            volume: volume.to_owned(),
            kind,
            host: None,
            pid: 0,
            state: "wanted".to_owned(),
            report: RebalanceReport::default(),
            elapsed_secs: 0.0,
            stop: false,
            error: None,
            leaving: Vec::new(),
        }
    }

    /// Whether it is a rebalance that completed and left nothing on leaving brick `index`.
    pub fn emptied(&self, index: usize) -> bool {
        self.kind == TaskKind::Rebalance
            && self.state == "completed"
            && self.report.failed == 0
            && self.report.left_on_leaving == 0
            && self.leaving.contains(&index)
    }

    /// Whether it is still to run or running.
    pub fn is_live(&self) -> bool {
        matches!(self.state.as_str(), "wanted" | "running")
    }
}

/// Where the rebalance of `volume` run by a daemon whose socket is in `dir` writes its
/// status.
pub fn rebalance_status_file(dir: &std::path::Path, volume: &str) -> PathBuf {
    dir.join(format!("rebalance-{volume}.json"))
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OptionValue {
    pub key: String,
    pub value: String,
    /// Set explicitly on the volume, or the default.
    pub set: bool,
}

/// A brick's answer to a query: `report` as the brick sent it, or why there is none.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BrickReport<T> {
    pub brick: String,
    pub path: PathBuf,
    #[serde(skip_serializing_if = "Option::is_none", default = "Option::default")]
    pub report: Option<T>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BrickStatus {
    /// The host serving it (`None`: the daemon's own, single-node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    pub path: PathBuf,
    pub port: u16,
    #[serde(default, skip_serializing_if = "BrickRole::is_serving")]
    pub role: BrickRole,
    pub pid: Option<u32>,
    /// `running`, `restarting`, `stopped`, `removed` (`down`: its host does not report).
    pub state: String,
    pub uptime_secs: u64,
    pub restarts: u32,
    /// The configuration generation the running brick has applied.
    pub generation: Option<u64>,
    /// `ok` when the running brick answers on its control socket, else why not; `-` when it
    /// is not running.
    pub health: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn brick_reports_are_typed_and_round_trip() {
        let response = Response::Profiles {
            generation: 3,
            bricks: vec![BrickReport {
                brick: "v-b0".into(),
                path: "/b".into(),
                report: None,
                error: Some("not running (stopped)".into()),
            }],
        };
        let json = serde_json::to_string(&response).expect("encode");
        assert_eq!(
            json,
            r#"{"result":"profiles","generation":3,"bricks":[{"brick":"v-b0","path":"/b","error":"not running (stopped)"}]}"#
        );
        let back: Response = serde_json::from_str(&json).expect("decode");
        assert_eq!(back, response);
        let request = Request::VolumeProfile {
            name: "v".into(),
            action: ProfileAction::Info,
        };
        let json = serde_json::to_string(&request).expect("encode");
        assert_eq!(
            json,
            r#"{"op":"volume-profile","name":"v","action":"info"}"#
        );
        assert_eq!(
            serde_json::from_str::<Request>(&json).expect("decode"),
            request
        );
    }
}
