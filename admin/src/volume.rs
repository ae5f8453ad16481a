//! A volume as `kiln-mgmtd` describes it: its bricks, the options set on it and its state.
//! Plain data, carried by the command protocol ([`crate::command`]); the rules for changing it
//! (the configuration state machine) are `kiln-mgmt`'s.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Volume {
    pub name: String,
    /// A UUID, fixed at creation.
    pub id: String,
    pub bricks: Vec<Brick>,
    /// Options set explicitly, in canonical form; the rest have their defaults.
    pub options: BTreeMap<String, String>,
    pub state: VolumeState,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Brick {
    /// The host that serves it, as its daemon is named (`kiln-mgmtd --host`); `None` on a
    /// single-node daemon (its own host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// The brick directory on its host.
    pub path: PathBuf,
    /// The UDP port its server listens on.
    pub port: u16,
    /// Whether it holds files, is being emptied, or is gone.
    #[serde(default, skip_serializing_if = "BrickRole::is_serving")]
    pub role: BrickRole,
}

/// What a brick is to its volume. A brick removed keeps its place in the volume's list, so
/// every brick after it keeps its index, which link files name (`VOLUME-client-N`), its
/// certificate and its control socket.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BrickRole {
    /// Holds the files its share of each directory's hash space names.
    #[default]
    Serving,
    /// Being emptied (`kiln volume remove-brick … start`): given no share of any directory,
    /// its files moved to the others; still served and still looked in.
    Leaving,
    /// Removed (`remove-brick … commit`): not served, not looked in; its port is free again,
    /// its directory stays its own.
    Removed,
}

impl BrickRole {
    pub fn is_serving(&self) -> bool {
        *self == BrickRole::Serving
    }

    /// Whether the brick is served and may hold files.
    pub fn in_service(self) -> bool {
        self != BrickRole::Removed
    }
}

impl std::fmt::Display for BrickRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BrickRole::Serving => "serving",
            BrickRole::Leaving => "leaving",
            BrickRole::Removed => "removed",
        })
    }
}

impl Volume {
    /// The bricks in service (not removed), with their indexes.
    pub fn bricks_in_service(&self) -> impl Iterator<Item = (usize, &Brick)> {
        self.bricks
            .iter()
            .enumerate()
            .filter(|(_, b)| b.role.in_service())
    }
}

impl Brick {
    /// A serving brick of `host` at `path`, listening on `port`.
    pub fn new(host: Option<String>, path: PathBuf, port: u16) -> Brick {
        Brick {
            host,
            path,
            port,
            role: BrickRole::Serving,
        }
    }

    /// A brick as a command line gives it: `HOST:PATH` (the host, the path), or a path alone
    /// (`None`: the host the command is run for). A `:` after a `/` is part of a path.
    pub fn split_spec(spec: &Path) -> (Option<String>, PathBuf) {
        let text = spec.to_string_lossy();
        match text.split_once(':') {
            Some((host, path)) if !host.contains('/') => (Some(host.to_owned()), path.into()),
            _ => (None, spec.to_owned()),
        }
    }

    /// Whether `self` and `other` live on the same host.
    pub fn shares_host(&self, other: &Brick) -> bool {
        self.host == other.host
    }

    /// `HOST:PATH`, or the path alone for a single-node daemon's brick.
    pub fn display(&self) -> String {
        Brick::place(self.host.as_deref(), &self.path)
    }

    /// A brick at `path` of `host` as people read it: `HOST:PATH`, or the path alone.
    pub fn place(host: Option<&str>, path: &Path) -> String {
        match host {
            Some(host) => format!("{host}:{}", path.display()),
            None => path.display().to_string(),
        }
    }

    /// The name of the brick's certificate, log and control socket: `<volume>-b<index>`.
    pub fn name(volume: &str, index: usize) -> String {
        format!("{volume}-b{index}")
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VolumeState {
    Created,
    Started,
    Stopped,
}

impl std::fmt::Display for VolumeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            VolumeState::Created => "created",
            VolumeState::Started => "started",
            VolumeState::Stopped => "stopped",
        })
    }
}
