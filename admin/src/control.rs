//! What `kiln-mgmtd` and a brick say on the brick's control socket (`kiln-brickd serve
//! --control PATH`, mode 0600): one [`ControlRequest`] line in, one [`ControlAnswer`] line out,
//! per connection ([`EXCHANGE`]).
//!
//! ```text
//! → {"op":"push","generation":7,"options":{"auth.allow":"alice,bob",…}}   live options
//! ← {"answer":"generation","generation":7}       or   {"answer":"error","message":"…"}
//! → {"op":"status"}                              a health probe: changes nothing
//! ← {"answer":"generation","generation":7}
//! → {"op":"profile"}
//! ← {"answer":"profile","generation":7,"profile":{…}}           (ProfileReport)
//! → {"op":"statedump"}
//! ← {"answer":"statedump","generation":7,"statedump":{…}}       (Statedump)
//! ```
//!
//! Options a brick cannot change while running are not pushed: they take effect when
//! kiln-mgmtd restarts it. Also here: the plain counters a state dump carries, which the brick
//! defines its own tables' statistics with ([`CacheState`], [`RingStats`], [`ConnectionInfo`]).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::exchange::LineExchange;
use crate::options::BrickSettings;

/// The control socket's exchange. An answer holds a state dump (every connection, every fd
/// table, the profile): a few hundred bytes per connection, so 4 MiB is thousands of them.
/// A request is waited for 5 s; the daemon waits 5 s for a push or query to be answered.
pub const EXCHANGE: LineExchange = LineExchange {
    line_bytes_max: 4 << 20,
    request_timeout: Duration::from_secs(5),
    exchange_timeout: Duration::from_secs(5),
};

/// A request to a brick.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum ControlRequest {
    /// The volume's live options at configuration `generation` (keys and canonical values of
    /// the option table; see [`BrickSettings::with_live`]).
    Push {
        generation: u64,
        options: BTreeMap<String, String>,
    },
    /// The generation the brick runs; changes nothing.
    Status,
    /// The per-fop profile.
    Profile,
    /// Everything the brick can say about itself.
    Statedump,
}

/// A brick's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "answer", rename_all = "kebab-case")]
pub enum ControlAnswer {
    /// To a push (the generation now applied) or a status probe.
    Generation { generation: u64 },
    Profile {
        generation: u64,
        profile: ProfileReport,
    },
    Statedump {
        generation: u64,
        statedump: Box<Statedump>,
    },
    /// The request was refused or not understood; nothing changed.
    Error { message: String },
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
    pub errors: BTreeMap<String, u64>,
}

/// A brick's state, as `kiln volume statedump` prints it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Statedump {
    pub pid: u32,
    pub uptime_s: u64,
    /// The configuration generation the brick runs.
    pub generation: u64,
    /// What the brick was started with.
    pub settings: StartSettings,
    /// The live options it runs now (canonical values by key).
    pub live_options: BTreeMap<String, String>,
    pub listen: SocketAddr,
    pub connections: Vec<ConnectionInfo>,
    pub engine: EngineDump,
    pub profile: ProfileReport,
    /// Every option of the volume as configured now, added by kiln-mgmtd (the brick does not
    /// know the volume's other options).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub volume_options: Option<BTreeMap<String, String>>,
}

/// The brick and the settings it was started with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartSettings {
    pub brick: PathBuf,
    pub brick_id: String,
    #[serde(flatten)]
    pub options: BrickSettings,
}

/// The engine's part of a state dump, summed over its workers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineDump {
    /// `uring` or `blocking`.
    pub kind: String,
    pub workers: usize,
    pub open_fds: usize,
    /// Each session's open fds.
    pub fd_tables: Vec<SessionFds>,
    pub gfid_cache: CacheState,
    pub dirfd_cache: CacheState,
    pub ring: RingStats,
}

/// One session's fd table in a state dump. (A list rather than a map by session id: a map
/// with number keys does not survive serde's tagged enums, which the answers are.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionFds {
    pub session: u64,
    pub open_fds: usize,
}

/// A cache's size and use since start, summed over workers in a state dump.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheState {
    pub entries: usize,
    pub capacity: usize,
    pub hits: u64,
    pub misses: u64,
}

impl std::ops::AddAssign for CacheState {
    fn add_assign(&mut self, other: CacheState) {
        self.entries += other.entries;
        self.capacity += other.capacity;
        self.hits += other.hits;
        self.misses += other.misses;
    }
}

/// Counters of an io_uring executor, for benchmarks and state dumps.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RingStats {
    /// `io_uring_enter` calls.
    pub enters: u64,
    pub sqes: u64,
    /// Linked chains (one per chain of steps that reached the ring).
    pub chains: u64,
    /// Calls run on the blocking pool.
    pub pool_jobs: u64,
    /// Chains run as plain system calls on an otherwise idle worker.
    #[serde(default)]
    pub idle_chains: u64,
}

impl std::ops::AddAssign for RingStats {
    fn add_assign(&mut self, other: RingStats) {
        self.enters += other.enters;
        self.sqes += other.sqes;
        self.chains += other.chains;
        self.pool_jobs += other.pool_jobs;
        self.idle_chains += other.idle_chains;
    }
}

/// A connected client, as a state dump shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectionInfo {
    /// The brick's id of the client's session.
    pub session: u64,
    /// The client's certificate name.
    pub client: String,
    pub remote: SocketAddr,
    /// When the session opened, in seconds since the Unix epoch.
    pub since_unix_s: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> ProfileReport {
        ProfileReport {
            counting: true,
            timing: true,
            counting_for_s: 1.5,
            timing_for_s: 1.5,
            fops: vec![FopProfile {
                fop: "STAT".into(),
                calls: 4,
                errors: 0,
                bytes: 0,
                steps: 4,
                sqes: 0,
                pool_jobs: 0,
                intents: 0,
                latency: Some(LatencySummary {
                    count: 4,
                    avg_us: 10.0,
                    min_us: 5.0,
                    max_us: 20.0,
                    p50_us: 9.0,
                    p90_us: 19.0,
                    p99_us: 20.0,
                    p999_us: 20.0,
                }),
            }],
            errors: BTreeMap::from([("ENOENT".to_owned(), 5)]),
        }
    }

    fn statedump() -> Statedump {
        let options = BrickSettings::from_options(&BTreeMap::new()).expect("defaults");
        Statedump {
            pid: 42,
            uptime_s: 3,
            generation: 7,
            settings: StartSettings {
                brick: "/bricks/b0".into(),
                brick_id: "00000000-0000-4000-8000-000000000001".into(),
                options,
            },
            live_options: BTreeMap::from([(
                "diagnostics.count-fop-hits".to_owned(),
                "on".to_owned(),
            )]),
            listen: "127.0.0.1:47300".parse().expect("addr"),
            connections: vec![ConnectionInfo {
                session: 1,
                client: "admin".into(),
                remote: "127.0.0.1:50000".parse().expect("addr"),
                since_unix_s: 1_700_000_000,
            }],
            engine: EngineDump {
                kind: "uring".into(),
                workers: 2,
                open_fds: 3,
                fd_tables: vec![SessionFds {
                    session: 1,
                    open_fds: 3,
                }],
                gfid_cache: CacheState {
                    entries: 1,
                    capacity: 1024,
                    hits: 2,
                    misses: 3,
                },
                dirfd_cache: CacheState::default(),
                ring: RingStats::default(),
            },
            profile: profile(),
            volume_options: None,
        }
    }

    fn round_trip<T: Serialize + serde::de::DeserializeOwned>(value: &T) -> T {
        let json = serde_json::to_string(value).expect("encode");
        serde_json::from_str(&json).expect("decode")
    }

    #[test]
    fn requests_and_answers_round_trip() {
        let requests = [
            ControlRequest::Push {
                generation: 7,
                options: BTreeMap::from([("auth.allow".to_owned(), "alice".to_owned())]),
            },
            ControlRequest::Status,
            ControlRequest::Profile,
            ControlRequest::Statedump,
        ];
        for request in &requests {
            assert_eq!(&round_trip(request), request);
        }
        let answers = [
            ControlAnswer::Generation { generation: 7 },
            ControlAnswer::Profile {
                generation: 7,
                profile: profile(),
            },
            ControlAnswer::Statedump {
                generation: 7,
                statedump: Box::new(statedump()),
            },
            ControlAnswer::Error {
                message: "no".into(),
            },
        ];
        for answer in &answers {
            assert_eq!(&round_trip(answer), answer);
        }
        assert_eq!(
            serde_json::to_string(&ControlRequest::Status).expect("encode"),
            r#"{"op":"status"}"#
        );
    }

    #[test]
    fn a_statedump_reads_as_scripts_expect() {
        let mut dump = statedump();
        let json = serde_json::to_value(&dump).expect("encode");
        assert_eq!(json["connections"][0]["client"], "admin");
        assert_eq!(json["engine"]["gfid_cache"]["capacity"], 1024);
        assert_eq!(json["engine"]["fd_tables"][0]["open_fds"], 3);
        assert_eq!(json["settings"]["brick"], "/bricks/b0");
        assert_eq!(json["settings"]["inflight_max"], 256);
        assert_eq!(json["settings"]["engine"], "uring");
        assert!(json.get("volume_options").is_none());
        dump.volume_options = Some(BTreeMap::from([("a.b".to_owned(), "1".to_owned())]));
        let json = serde_json::to_value(&dump).expect("encode");
        assert_eq!(json["volume_options"]["a.b"], "1");
        assert_eq!(round_trip(&dump), dump);
    }

    #[test]
    fn a_brick_answers_typed_over_its_socket() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("brick.sock");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let answer = rt.block_on(async {
            let listener = tokio::net::UnixListener::bind(&socket).expect("bind");
            tokio::spawn(async move {
                let (mut stream, _) = listener.accept().await.expect("accept");
                let answer = match EXCHANGE.read_request(&mut stream).await {
                    Ok(ControlRequest::Statedump) => ControlAnswer::Statedump {
                        generation: 7,
                        statedump: Box::new(statedump()),
                    },
                    other => ControlAnswer::Error {
                        message: format!("{other:?}"),
                    },
                };
                EXCHANGE.write_answer(&mut stream, &answer).await
            });
            EXCHANGE
                .ask::<_, ControlAnswer>(&socket, &ControlRequest::Statedump)
                .await
        });
        match answer.expect("answer") {
            ControlAnswer::Statedump {
                statedump: dump, ..
            } => assert_eq!(*dump, statedump()),
            other => panic!("{other:?}"),
        }
    }
}
