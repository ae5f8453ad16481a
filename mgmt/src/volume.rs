//! The cluster configuration `kiln-mgmtd` keeps: volumes, their bricks and their options
//! (described by [`kiln_admin::volume`]), and the typed changes that are its only way to
//! change ([`Change`], committed by the [`store`](crate::store)).

use std::collections::BTreeMap;
use std::path::PathBuf;

use kiln_admin::options::{self, OptionError};
use kiln_admin::volume::{Brick, BrickRole, Volume, VolumeState};
use serde::{Deserialize, Serialize};

use crate::store::State;
use crate::store::etcd::Objects;

/// Lowest (UDP) port handed to a brick when the caller does not choose one; the first
/// brick of `kiln up` listens there. Chosen clear of GlusterFS on the same host (glusterd's
/// 24007-24008, bricks of old releases from 24009, of current ones 49152-60999), so a host
/// can run both while a volume moves; below Linux's ephemeral ports (32768-60999), so an
/// outgoing connection never holds it; and free in /etc/services.
pub const BRICK_PORT_BASE: u16 = 26100;
/// Longest volume name, in bytes.
pub const VOLUME_NAME_MAX_BYTES: usize = 64;

/// Every volume of this management daemon.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cluster {
    pub volumes: BTreeMap<String, Volume>,
}

/// One change to the configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "change", rename_all = "kebab-case")]
pub enum Change {
    Create(Volume),
    /// A brick added at the end of the volume's list.
    AddBrick {
        volume: String,
        brick: Brick,
    },
    /// Brick `index` of the volume becomes `role`: leaving (`remove-brick … start`), serving
    /// again (`… stop`) or removed (`… commit`); a removed brick keeps its index.
    SetBrickRole {
        volume: String,
        index: usize,
        role: BrickRole,
    },
    Delete {
        volume: String,
    },
    Start {
        volume: String,
    },
    Stop {
        volume: String,
    },
    /// `value` in canonical form ([`options::OptionDef::parse`]).
    Set {
        volume: String,
        key: String,
        value: String,
    },
    /// Back to the default; `None` resets every option.
    Reset {
        volume: String,
        key: Option<String>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("volume {0} does not exist")]
    NoSuchVolume(String),
    #[error("volume {0} already exists")]
    VolumeExists(String),
    #[error(
        "bad volume name {0:?}: use 1 to {VOLUME_NAME_MAX_BYTES} letters, digits, '.', '_' or '-'"
    )]
    BadVolumeName(String),
    #[error("a volume needs at least one brick")]
    NoBricks,
    #[error("brick {path} must be an absolute path")]
    RelativeBrick { path: PathBuf },
    #[error("brick {brick} already belongs to volume {volume}")]
    BrickInUse { brick: String, volume: String },
    #[error("port {port} of {host} is already used by volume {volume}")]
    PortInUse {
        host: String,
        port: u16,
        volume: String,
    },
    #[error("volume {volume} has no brick {index}")]
    NoSuchBrick { volume: String, index: usize },
    #[error("brick {brick} is {from}; it cannot become {to}")]
    BrickRole {
        brick: String,
        from: BrickRole,
        to: BrickRole,
    },
    #[error("brick {brick} is the last serving brick of volume {volume}")]
    LastBrick { brick: String, volume: String },
    #[error("volume {0} is already started")]
    AlreadyStarted(String),
    #[error("volume {0} is not started")]
    NotStarted(String),
    #[error("volume {0} is started; stop it first")]
    StillStarted(String),
    #[error(transparent)]
    Option(#[from] OptionError),
    #[error("value {value:?} for {key} is not in canonical form")]
    NotCanonical { key: String, value: String },
}

/// Checks a volume name: it becomes part of file names and certificate names.
pub fn check_volume_name(name: &str) -> Result<(), ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= VOLUME_NAME_MAX_BYTES
        && !name.starts_with(['.', '-'])
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    ok.then_some(())
        .ok_or_else(|| ConfigError::BadVolumeName(name.to_owned()))
}

impl Cluster {
    pub fn volume(&self, name: &str) -> Result<&Volume, ConfigError> {
        self.volumes
            .get(name)
            .ok_or_else(|| ConfigError::NoSuchVolume(name.to_owned()))
    }

    /// Whether `brick` may join volume `volume`, which has `siblings` so far: an absolute
    /// path, and a path and a port no brick of its host uses yet.
    fn check_new_brick(
        &self,
        brick: &Brick,
        siblings: &[Brick],
        volume: &str,
    ) -> Result<(), ConfigError> {
        if !brick.path.is_absolute() {
            return Err(ConfigError::RelativeBrick {
                path: brick.path.clone(),
            });
        }
        let others = self
            .volumes
            .values()
            .flat_map(|v| v.bricks.iter().map(move |b| (v.name.as_str(), b)))
            .chain(siblings.iter().map(|b| (volume, b)))
            .filter(|(_, other)| other.shares_host(brick));
        for (owner, other) in others {
            // A removed brick's directory stays its own (it still holds the volume's
            // directories and `.glusterfs`); its port is free.
            if other.path == brick.path {
                return Err(ConfigError::BrickInUse {
                    brick: brick.display(),
                    volume: owner.to_owned(),
                });
            }
            if other.port == brick.port && other.role.in_service() {
                return Err(ConfigError::PortInUse {
                    host: brick.host.clone().unwrap_or_else(|| "this host".to_owned()),
                    port: brick.port,
                    volume: owner.to_owned(),
                });
            }
        }
        Ok(())
    }

    /// The lowest brick port of `host` at or above `from` that no brick holds, is not in
    /// `taken_now`, and passes `usable` (on this host: no other process has bound it).
    pub fn free_port(
        &self,
        host: Option<&str>,
        from: u16,
        taken_now: &[u16],
        usable: impl Fn(u16) -> bool,
    ) -> u16 {
        let used: Vec<u16> = self
            .volumes
            .values()
            .flat_map(|v| &v.bricks)
            .filter(|b| b.host.as_deref() == host && b.role.in_service())
            .map(|b| b.port)
            .chain(taken_now.iter().copied())
            .collect();
        (from..=u16::MAX)
            .find(|&p| !used.contains(&p) && usable(p))
            .unwrap_or(from)
    }
}

impl State for Cluster {
    type Change = Change;
    type Error = ConfigError;

    fn check(&self, change: &Change) -> Result<(), ConfigError> {
        match change {
            Change::Create(new) => {
                check_volume_name(&new.name)?;
                if self.volumes.contains_key(&new.name) {
                    return Err(ConfigError::VolumeExists(new.name.clone()));
                }
                if new.bricks.is_empty() {
                    return Err(ConfigError::NoBricks);
                }
                for (i, brick) in new.bricks.iter().enumerate() {
                    self.check_new_brick(brick, &new.bricks[..i], &new.name)?;
                }
                for (key, value) in &new.options {
                    check_option(key, value)?;
                }
                Ok(())
            }
            Change::AddBrick { volume, brick } => {
                let bricks = &self.volume(volume)?.bricks;
                self.check_new_brick(brick, bricks, volume)
            }
            Change::SetBrickRole {
                volume,
                index,
                role,
            } => check_role_change(self.volume(volume)?, *index, *role),
            Change::Delete { volume } => match self.volume(volume)?.state {
                VolumeState::Started => Err(ConfigError::StillStarted(volume.clone())),
                _ => Ok(()),
            },
            Change::Start { volume } => match self.volume(volume)?.state {
                VolumeState::Started => Err(ConfigError::AlreadyStarted(volume.clone())),
                _ => Ok(()),
            },
            Change::Stop { volume } => match self.volume(volume)?.state {
                VolumeState::Started => Ok(()),
                _ => Err(ConfigError::NotStarted(volume.clone())),
            },
            Change::Set { volume, key, value } => {
                self.volume(volume)?;
                check_option(key, value)
            }
            Change::Reset { volume, key } => {
                self.volume(volume)?;
                match key {
                    Some(key) => options::find(key).map(drop).map_err(ConfigError::from),
                    None => Ok(()),
                }
            }
        }
    }

    fn apply(&mut self, change: &Change) {
        match change {
            Change::Create(new) => {
                self.volumes.insert(new.name.clone(), new.clone());
            }
            Change::AddBrick { volume, brick } => {
                if let Some(v) = self.volumes.get_mut(volume) {
                    v.bricks.push(brick.clone());
                }
            }
            Change::SetBrickRole {
                volume,
                index,
                role,
            } => {
                if let Some(brick) = self
                    .volumes
                    .get_mut(volume)
                    .and_then(|v| v.bricks.get_mut(*index))
                {
                    brick.role = *role;
                }
            }
            Change::Delete { volume } => {
                self.volumes.remove(volume);
            }
            Change::Start { volume: name } => {
                if let Some(v) = self.volumes.get_mut(name) {
                    v.state = VolumeState::Started;
                }
            }
            Change::Stop { volume: name } => {
                if let Some(v) = self.volumes.get_mut(name) {
                    v.state = VolumeState::Stopped;
                }
            }
            Change::Set {
                volume: name,
                key,
                value,
            } => {
                if let Some(v) = self.volumes.get_mut(name) {
                    v.options.insert(key.clone(), value.clone());
                }
            }
            Change::Reset { volume: name, key } => {
                if let Some(v) = self.volumes.get_mut(name) {
                    match key {
                        Some(key) => drop(v.options.remove(key)),
                        None => v.options.clear(),
                    }
                }
            }
        }
    }
}

/// In etcd, each volume is one object, named by the volume.
impl Objects for Cluster {
    fn objects(&self) -> BTreeMap<String, Vec<u8>> {
        self.volumes
            .iter()
            .map(|(name, volume)| {
                let json = serde_json::to_vec(volume).expect("a volume always encodes");
                (name.clone(), json)
            })
            .collect()
    }

    fn from_objects(objects: &BTreeMap<String, Vec<u8>>) -> Result<Cluster, String> {
        let mut volumes = BTreeMap::new();
        for (name, json) in objects {
            let volume: Volume = serde_json::from_slice(json)
                .map_err(|e| format!("volume {name:?} does not decode: {e}"))?;
            if &volume.name != name {
                return Err(format!(
                    "the object {name:?} holds volume {:?}",
                    volume.name
                ));
            }
            volumes.insert(name.clone(), volume);
        }
        Ok(Cluster { volumes })
    }
}

/// Whether brick `index` of `volume` may become `to`: a serving brick leaves (while another
/// serves), a leaving one serves again or is removed.
fn check_role_change(volume: &Volume, index: usize, to: BrickRole) -> Result<(), ConfigError> {
    let brick = volume
        .bricks
        .get(index)
        .ok_or_else(|| ConfigError::NoSuchBrick {
            volume: volume.name.clone(),
            index,
        })?;
    let from = brick.role;
    match (from, to) {
        (BrickRole::Serving, BrickRole::Leaving) => {
            let mut others = volume.bricks.iter().enumerate();
            match others.any(|(i, b)| i != index && b.role.is_serving()) {
                true => Ok(()),
                false => Err(ConfigError::LastBrick {
                    brick: brick.display(),
                    volume: volume.name.clone(),
                }),
            }
        }
        (BrickRole::Leaving, BrickRole::Serving | BrickRole::Removed) => Ok(()),
        _ => Err(ConfigError::BrickRole {
            brick: brick.display(),
            from,
            to,
        }),
    }
}

/// A known key with a value already in canonical form.
fn check_option(key: &str, value: &str) -> Result<(), ConfigError> {
    let canonical = options::find(key)?.parse(value)?;
    if canonical != value {
        return Err(ConfigError::NotCanonical {
            key: key.to_owned(),
            value: value.to_owned(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume(name: &str, path: &str, port: u16) -> Volume {
        Volume {
            name: name.into(),
            id: "00000000-0000-4000-8000-000000000001".into(),
            bricks: vec![Brick::new(None, path.into(), port)],
            options: BTreeMap::new(),
            state: VolumeState::Created,
        }
    }

    fn commit(c: &mut Cluster, change: &Change) -> Result<(), ConfigError> {
        c.check(change)?;
        c.apply(change);
        Ok(())
    }

    #[test]
    fn lifecycle_and_conflicts() {
        let mut c = Cluster::default();
        commit(&mut c, &Change::Create(volume("v1", "/b/1", 49152))).expect("create");
        assert_eq!(
            commit(&mut c, &Change::Create(volume("v1", "/b/2", 49153))),
            Err(ConfigError::VolumeExists("v1".into()))
        );
        assert!(matches!(
            commit(&mut c, &Change::Create(volume("v2", "/b/1", 49153))),
            Err(ConfigError::BrickInUse { .. })
        ));
        assert!(matches!(
            commit(&mut c, &Change::Create(volume("v2", "/b/2", 49152))),
            Err(ConfigError::PortInUse { .. })
        ));
        assert!(matches!(
            commit(&mut c, &Change::Create(volume("v2", "b/2", 49153))),
            Err(ConfigError::RelativeBrick { .. })
        ));
        assert!(matches!(
            commit(&mut c, &Change::Create(volume("../x", "/b/3", 49154))),
            Err(ConfigError::BadVolumeName(_))
        ));
        assert_eq!(c.free_port(None, 49152, &[49153], |_| true), 49154);
        assert_eq!(c.free_port(None, 49152, &[49153], |p| p != 49154), 49155);
        assert_eq!(c.free_port(Some("b"), 49152, &[], |_| true), 49152);
        let v = "v1".to_owned();
        assert_eq!(
            commit(&mut c, &Change::Stop { volume: v.clone() }),
            Err(ConfigError::NotStarted(v.clone()))
        );
        commit(&mut c, &Change::Start { volume: v.clone() }).expect("start");
        assert_eq!(
            commit(&mut c, &Change::Delete { volume: v.clone() }),
            Err(ConfigError::StillStarted(v.clone()))
        );
        commit(&mut c, &Change::Stop { volume: v.clone() }).expect("stop");
        commit(&mut c, &Change::Delete { volume: v.clone() }).expect("delete");
        assert!(c.volumes.is_empty());
    }

    #[test]
    fn a_brick_is_added_only_where_nothing_else_is() {
        let mut c = Cluster::default();
        commit(&mut c, &Change::Create(volume("v1", "/b/1", 49152))).expect("create");
        commit(&mut c, &Change::Create(volume("v2", "/b/2", 49153))).expect("create");
        let add = |volume: &str, path: &str, port| Change::AddBrick {
            volume: volume.into(),
            brick: Brick::new(None, path.into(), port),
        };
        for (change, clash) in [
            (add("v1", "/b/2", 49160), "path"),
            (add("v1", "/b/1", 49160), "path"),
            (add("v1", "/b/3", 49153), "port"),
            (add("v1", "b/3", 49160), "relative"),
            (add("v9", "/b/3", 49160), "volume"),
        ] {
            let refused = commit(&mut c, &change).expect_err(clash);
            let kind = match refused {
                ConfigError::BrickInUse { .. } => "path",
                ConfigError::PortInUse { .. } => "port",
                ConfigError::RelativeBrick { .. } => "relative",
                ConfigError::NoSuchVolume(_) => "volume",
                other => panic!("{other}"),
            };
            assert_eq!(kind, clash);
        }
        commit(&mut c, &add("v1", "/b/3", 49160)).expect("add");
        let bricks = &c.volume("v1").expect("v1").bricks;
        assert_eq!((bricks.len(), bricks[1].port), (2, 49160));
    }

    #[test]
    fn a_brick_leaves_then_is_removed_keeping_its_index() {
        let mut c = Cluster::default();
        commit(&mut c, &Change::Create(volume("v", "/b/1", 49152))).expect("create");
        let add = Change::AddBrick {
            volume: "v".into(),
            brick: Brick::new(None, "/b/2".into(), 49153),
        };
        commit(&mut c, &add).expect("add");
        let role = |index, role| Change::SetBrickRole {
            volume: "v".into(),
            index,
            role,
        };
        let refused = |c: &mut Cluster, change| commit(c, &change).expect_err("refused");
        assert!(matches!(
            refused(&mut c, role(1, BrickRole::Removed)),
            ConfigError::BrickRole { .. }
        ));
        assert!(matches!(
            refused(&mut c, role(2, BrickRole::Leaving)),
            ConfigError::NoSuchBrick { index: 2, .. }
        ));
        commit(&mut c, &role(1, BrickRole::Leaving)).expect("leave");
        // The other one is the last that serves.
        assert!(matches!(
            refused(&mut c, role(0, BrickRole::Leaving)),
            ConfigError::LastBrick { .. }
        ));
        commit(&mut c, &role(1, BrickRole::Serving)).expect("stay");
        commit(&mut c, &role(1, BrickRole::Leaving)).expect("leave");
        commit(&mut c, &role(1, BrickRole::Removed)).expect("remove");
        assert!(matches!(
            refused(&mut c, role(1, BrickRole::Serving)),
            ConfigError::BrickRole { .. }
        ));
        // Its place stays, and its path; its port is free again.
        assert_eq!(c.volume("v").expect("v").bricks.len(), 2);
        assert_eq!(c.free_port(None, 49153, &[], |_| true), 49153);
        let add = |path: &str| Change::AddBrick {
            volume: "v".into(),
            brick: Brick::new(None, path.into(), 49153),
        };
        assert!(matches!(
            refused(&mut c, add("/b/2")),
            ConfigError::BrickInUse { .. }
        ));
        commit(&mut c, &add("/b/3")).expect("the port is free again");
        assert_eq!(c.volume("v").expect("v").bricks.len(), 3);
    }

    #[test]
    fn options_are_checked_and_reset() {
        let mut c = Cluster::default();
        commit(&mut c, &Change::Create(volume("v", "/b", 49152))).expect("create");
        let set = |key: &str, value: &str| Change::Set {
            volume: "v".into(),
            key: key.into(),
            value: value.into(),
        };
        commit(&mut c, &set("network.inflight-max", "64")).expect("set");
        assert!(matches!(
            commit(&mut c, &set("network.inflight-max", "0")),
            Err(ConfigError::Option(OptionError::BadValue { .. }))
        ));
        assert!(matches!(
            commit(&mut c, &set("auth.alow", "*")),
            Err(ConfigError::Option(OptionError::Unknown { .. }))
        ));
        commit(&mut c, &set("auth.allow", "alice")).expect("set");
        commit(
            &mut c,
            &Change::Reset {
                volume: "v".into(),
                key: Some("auth.allow".into()),
            },
        )
        .expect("reset");
        let opts = &c.volume("v").expect("v").options;
        assert_eq!(opts.len(), 1);
        assert_eq!(opts["network.inflight-max"], "64");
    }
}
