//! How the option table reaches a brick, from the table alone: the arguments the supervisor
//! starts `kiln-brickd serve` with ([`brick_args`]), the flags `kiln-brickd serve` takes with
//! their defaults, values and help ([`brick_clap_args`]), and the typed [`BrickSettings`] a brick
//! runs with, read from option values at start and changed by live pushes.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::{Apply, BrickFlag, OPTIONS, OptionDef, OptionError, ValueKind, effective, find};

/// The fop executor (`server.engine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ServerEngine {
    Uring,
    Blocking,
}

impl ServerEngine {
    /// The option's values, in the order of the variants.
    pub const NAMES: &'static [&'static str] = &["uring", "blocking"];
    const ALL: [ServerEngine; 2] = [ServerEngine::Uring, ServerEngine::Blocking];

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }

    fn from_name(name: &str) -> Option<ServerEngine> {
        Self::ALL.into_iter().find(|e| e.name() == name)
    }
}

/// When written data is durable (`storage.fsync-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FsyncPolicy {
    /// When clients fsync (POSIX).
    AsRequested,
    /// Before every WRITE and PUT is acknowledged.
    WriteThrough,
}

impl FsyncPolicy {
    /// The option's values, in the order of the variants.
    pub const NAMES: &'static [&'static str] = &["as-requested", "write-through"];
    const ALL: [FsyncPolicy; 2] = [FsyncPolicy::AsRequested, FsyncPolicy::WriteThrough];

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }

    fn from_name(name: &str) -> Option<FsyncPolicy> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }
}

/// What a brick runs with: every option of the table that reaches bricks, typed. Made from
/// option values ([`BrickSettings::from_options`]; a missing one has the table's default) or
/// from `kiln-brickd serve`'s flags (the `clap` impls, which do the same).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BrickSettings {
    /// `auth.allow`, canonical: `*` or names separated by commas.
    pub auth_allow: String,
    /// `auth.revoked`, canonical: serials separated by commas, empty for none.
    pub revoked: String,
    /// `network.inflight-max`: calls in flight per connection.
    pub inflight_max: u32,
    /// `diagnostics.count-fop-hits`.
    pub count_fop_hits: bool,
    /// `diagnostics.latency-measurement`.
    pub latency_measurement: bool,
    /// `server.engine`.
    pub engine: ServerEngine,
    /// `server.event-threads`; `None` (the option's 0): one per core.
    pub workers: Option<NonZeroUsize>,
    /// `network.inode-lru-limit`.
    pub gfid_cache_entries: NonZeroUsize,
    /// `storage.dirfd-cache-entries`.
    pub dirfd_cache_entries: NonZeroUsize,
    /// `server.ring-entries`.
    pub ring_entries: u32,
    /// `storage.fsync-policy`.
    pub fsync_policy: FsyncPolicy,
    /// `diagnostics.metrics-listen`; `None` when off.
    pub metrics_listen: Option<SocketAddr>,
    /// `server.root-squash`.
    pub root_squash: bool,
    /// `server.root-allow`, canonical: names separated by commas, empty for none.
    pub root_allow: String,
    /// `server.anonuid`, `server.anongid`.
    pub anon_uid: u32,
    pub anon_gid: u32,
    /// `network.connections-max`.
    pub connections_max: usize,
    /// `network.connections-per-client-max`.
    pub connections_per_client_max: usize,
    /// `network.open-files-per-client-max`.
    pub open_files_per_client_max: usize,
    /// `network.locks-per-client-max`.
    pub locks_per_client_max: usize,
    /// `features.leases`.
    pub leases: bool,
    /// `features.lease-recall-timeout-ms`.
    pub lease_recall_timeout_ms: u64,
    /// `features.lease-contention-ms`.
    pub lease_contention_ms: u64,
}

/// Reads option values as the table says: a missing key has its default, and every value is
/// checked (and made canonical) by [`OptionDef::parse`] before it is converted.
struct Reader<'a>(&'a BTreeMap<String, String>);

impl Reader<'_> {
    fn canonical(&self, key: &str) -> Result<(&'static OptionDef, String), OptionError> {
        let def = find(key)?;
        Ok((def, def.parse(effective(self.0, key))?))
    }

    /// The value converted by `convert`; a canonical value it refuses is a bad value.
    fn read<T>(&self, key: &str, convert: impl Fn(&str) -> Option<T>) -> Result<T, OptionError> {
        let (def, value) = self.canonical(key)?;
        convert(&value).ok_or_else(|| OptionError::BadValue {
            key: key.to_owned(),
            allowed: def.allowed(),
            value,
        })
    }

    fn number<T: FromStr>(&self, key: &str) -> Result<T, OptionError> {
        self.read(key, |v| v.parse().ok())
    }

    fn on(&self, key: &str) -> Result<bool, OptionError> {
        self.read(key, |v| Some(v == "on"))
    }
}

impl BrickSettings {
    /// The settings for option values `set` (keys of the table; keys that do not reach bricks
    /// are not read).
    pub fn from_options(set: &BTreeMap<String, String>) -> Result<BrickSettings, OptionError> {
        let read = Reader(set);
        Ok(BrickSettings {
            auth_allow: read.canonical("auth.allow")?.1,
            revoked: read.canonical("auth.revoked")?.1,
            inflight_max: read.number("network.inflight-max")?,
            count_fop_hits: read.on("diagnostics.count-fop-hits")?,
            latency_measurement: read.on("diagnostics.latency-measurement")?,
            engine: read.read("server.engine", ServerEngine::from_name)?,
            workers: NonZeroUsize::new(read.number("server.event-threads")?),
            gfid_cache_entries: read.number("network.inode-lru-limit")?,
            dirfd_cache_entries: read.number("storage.dirfd-cache-entries")?,
            ring_entries: read.number("server.ring-entries")?,
            fsync_policy: read.read("storage.fsync-policy", FsyncPolicy::from_name)?,
            metrics_listen: read.read("diagnostics.metrics-listen", |v| match v {
                "off" => Some(None),
                addr => addr.parse().ok().map(Some),
            })?,
            root_squash: read.on("server.root-squash")?,
            root_allow: read.canonical("server.root-allow")?.1,
            anon_uid: read.number("server.anonuid")?,
            anon_gid: read.number("server.anongid")?,
            connections_max: read.number("network.connections-max")?,
            connections_per_client_max: read.number("network.connections-per-client-max")?,
            open_files_per_client_max: read.number("network.open-files-per-client-max")?,
            locks_per_client_max: read.number("network.locks-per-client-max")?,
            leases: read.on("features.leases")?,
            lease_recall_timeout_ms: read.number("features.lease-recall-timeout-ms")?,
            lease_contention_ms: read.number("features.lease-contention-ms")?,
        })
    }

    /// Every brick option's value, canonical: what [`BrickSettings::from_options`] reads back.
    pub fn to_options(&self) -> BTreeMap<String, String> {
        let on_off = |on: bool| if on { "on" } else { "off" }.to_owned();
        [
            ("auth.allow", self.auth_allow.clone()),
            ("auth.revoked", self.revoked.clone()),
            ("network.inflight-max", self.inflight_max.to_string()),
            ("diagnostics.count-fop-hits", on_off(self.count_fop_hits)),
            (
                "diagnostics.latency-measurement",
                on_off(self.latency_measurement),
            ),
            ("server.engine", self.engine.name().to_owned()),
            (
                "server.event-threads",
                self.workers.map_or(0, NonZeroUsize::get).to_string(),
            ),
            (
                "network.inode-lru-limit",
                self.gfid_cache_entries.to_string(),
            ),
            (
                "storage.dirfd-cache-entries",
                self.dirfd_cache_entries.to_string(),
            ),
            ("server.ring-entries", self.ring_entries.to_string()),
            ("storage.fsync-policy", self.fsync_policy.name().to_owned()),
            (
                "diagnostics.metrics-listen",
                self.metrics_listen
                    .map_or_else(|| "off".to_owned(), |a| a.to_string()),
            ),
            ("server.root-squash", on_off(self.root_squash)),
            ("server.root-allow", self.root_allow.clone()),
            ("server.anonuid", self.anon_uid.to_string()),
            ("server.anongid", self.anon_gid.to_string()),
            ("network.connections-max", self.connections_max.to_string()),
            (
                "network.connections-per-client-max",
                self.connections_per_client_max.to_string(),
            ),
            (
                "network.open-files-per-client-max",
                self.open_files_per_client_max.to_string(),
            ),
            (
                "network.locks-per-client-max",
                self.locks_per_client_max.to_string(),
            ),
            ("features.leases", on_off(self.leases)),
            (
                "features.lease-recall-timeout-ms",
                self.lease_recall_timeout_ms.to_string(),
            ),
            (
                "features.lease-contention-ms",
                self.lease_contention_ms.to_string(),
            ),
        ]
        .into_iter()
        .map(|(key, value)| (key.to_owned(), value))
        .collect()
    }

    /// The live options among [`BrickSettings::to_options`]: what a push carries.
    pub fn live_options(&self) -> BTreeMap<String, String> {
        let mut options = self.to_options();
        options.retain(|key, _| is_live_brick_option(key));
        options
    }

    /// These settings with the live options of a push applied (the ones it names; the rest
    /// stay). An option a running brick cannot change is refused, as is a bad value.
    pub fn with_live(&self, push: &BTreeMap<String, String>) -> Result<BrickSettings, OptionError> {
        let mut options = self.to_options();
        for (key, value) in push {
            find(key)?;
            if !is_live_brick_option(key) {
                return Err(OptionError::NotLive { key: key.clone() });
            }
            options.insert(key.clone(), value.clone());
        }
        BrickSettings::from_options(&options)
    }
}

fn is_live_brick_option(key: &str) -> bool {
    find(key).is_ok_and(|def| def.apply == Apply::Live && def.brick != BrickFlag::None)
}

/// The live brick options of a volume with options `set` (defaults filled in): what the
/// supervisor pushes to its running bricks.
pub fn live_brick_options(set: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    OPTIONS
        .iter()
        .filter(|def| is_live_brick_option(def.key))
        .map(|def| (def.key.to_owned(), effective(set, def.key).to_owned()))
        .collect()
}

/// The `kiln-brickd serve` arguments that give brick `brick_index` of a volume the volume's
/// options `set` (defaults filled in), each in its [`BrickFlag`] form.
pub fn brick_args(set: &BTreeMap<String, String>, brick_index: usize) -> Vec<String> {
    let mut args = Vec::new();
    for def in OPTIONS {
        let value = effective(set, def.key);
        match def.brick {
            BrickFlag::None => {}
            BrickFlag::Value(flag) => args.extend([format!("--{flag}"), value.to_owned()]),
            BrickFlag::ValueUnless { flag, omitted } if value != omitted => {
                args.extend([format!("--{flag}"), value.to_owned()]);
            }
            BrickFlag::ValueUnless { .. } => {}
            BrickFlag::Switch(flag) if value == "on" => args.push(format!("--{flag}")),
            BrickFlag::Switch(_) => {}
            BrickFlag::ListenPlusBrickIndex(flag) => {
                if let Ok(mut addr) = value.parse::<SocketAddr>() {
                    let index = u16::try_from(brick_index).unwrap_or(u16::MAX);
                    addr.set_port(addr.port().saturating_add(index));
                    args.extend([format!("--{flag}"), addr.to_string()]);
                }
            }
        }
    }
    args
}

/// `kiln-brickd serve`'s flags for the brick options, one per option with a [`BrickFlag`]:
/// the table's default, its values (checked by [`OptionDef::parse`], so a flag's value is
/// canonical) and its help. Each flag's id is its option's key.
pub fn brick_clap_args() -> Vec<clap::Arg> {
    OPTIONS
        .iter()
        .filter_map(|def| Some(clap_arg(def, def.brick.name()?)))
        .collect()
}

fn clap_arg(def: &'static OptionDef, flag: &'static str) -> clap::Arg {
    let arg = clap::Arg::new(def.key).long(flag);
    match def.brick {
        BrickFlag::Switch(_) => arg
            .help(format!("{} ({} on)", def.help, def.key))
            .action(clap::ArgAction::SetTrue),
        _ => arg
            .help(format!(
                "{} ({}: {})",
                def.help,
                def.key,
                def.kind_summary()
            ))
            .value_name(value_name(def.kind))
            .default_value(def.default)
            .value_parser(move |value: &str| def.parse(value)),
    }
}

fn value_name(kind: ValueKind) -> &'static str {
    match kind {
        ValueKind::Bool => "on|off",
        ValueKind::Integer { .. } => "N",
        ValueKind::Choice(_) => "NAME",
        ValueKind::NameList | ValueKind::Names => "NAMES",
        ValueKind::Serials => "SERIALS",
        ValueKind::Listen => "IP:PORT",
    }
}

impl clap::Args for BrickSettings {
    fn augment_args(command: clap::Command) -> clap::Command {
        command.args(brick_clap_args())
    }

    fn augment_args_for_update(command: clap::Command) -> clap::Command {
        Self::augment_args(command)
    }
}

impl clap::FromArgMatches for BrickSettings {
    fn from_arg_matches(matches: &clap::ArgMatches) -> Result<BrickSettings, clap::Error> {
        let set: BTreeMap<String, String> = OPTIONS
            .iter()
            .filter_map(|def| {
                let value = match def.brick {
                    BrickFlag::None => return None,
                    BrickFlag::Switch(_) => match matches.get_flag(def.key) {
                        true => "on".to_owned(),
                        false => "off".to_owned(),
                    },
                    _ => matches.try_get_one::<String>(def.key).ok()??.clone(),
                };
                Some((def.key.to_owned(), value))
            })
            .collect();
        BrickSettings::from_options(&set)
            .map_err(|e| clap::Error::raw(clap::error::ErrorKind::ValueValidation, e))
    }

    fn update_from_arg_matches(&mut self, matches: &clap::ArgMatches) -> Result<(), clap::Error> {
        *self = BrickSettings::from_arg_matches(matches)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::FromArgMatches as _;

    fn set(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn brickd() -> clap::Command {
        clap::Command::new("serve").args(brick_clap_args())
    }

    /// The settings `kiln-brickd serve` reads from `args`.
    fn parse(args: &[String]) -> Result<BrickSettings, clap::Error> {
        let matches = brickd().try_get_matches_from(
            std::iter::once("serve".to_owned()).chain(args.iter().cloned()),
        )?;
        BrickSettings::from_arg_matches(&matches)
    }

    fn non_defaults() -> BTreeMap<String, String> {
        set(&[
            ("auth.allow", "alice,bob"),
            ("diagnostics.count-fop-hits", "on"),
            ("diagnostics.latency-measurement", "on"),
            ("diagnostics.metrics-listen", "127.0.0.1:9713"),
            ("features.lease-contention-ms", "0"),
            ("features.lease-recall-timeout-ms", "250"),
            ("features.leases", "off"),
            ("network.inflight-max", "64"),
            ("network.inode-lru-limit", "2048"),
            ("performance.attr-timeout-ms", "5"),
            ("server.engine", "blocking"),
            ("server.event-threads", "3"),
            ("server.ring-entries", "64"),
            ("storage.dirfd-cache-entries", "32"),
            ("storage.fsync-policy", "write-through"),
        ])
    }

    #[test]
    fn every_brick_option_is_a_flag_with_the_tables_default_and_values() {
        let command = brickd();
        for def in OPTIONS {
            let arg = command.get_arguments().find(|a| a.get_id() == def.key);
            let Some(flag) = def.brick.name() else {
                assert!(arg.is_none(), "{} is not a brick option", def.key);
                continue;
            };
            let arg = arg.unwrap_or_else(|| panic!("no flag for {}", def.key));
            assert_eq!(arg.get_long(), Some(flag), "{}", def.key);
            assert!(!flag.starts_with('-') && !flag.is_empty(), "{flag}");
            let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
            assert!(help.contains(def.key), "{help}");
            let defaults: Vec<_> = arg.get_default_values().iter().collect();
            match def.brick {
                BrickFlag::Switch(_) => {
                    assert_eq!(def.default, "off", "a switch cannot turn {} off", def.key);
                    assert!(defaults.iter().all(|d| *d == "false"), "{}", def.key);
                }
                _ => assert_eq!(defaults, [def.default], "{}", def.key),
            }
            if let ValueKind::Integer { min, max } = def.kind {
                let at = |n: u64| parse(&[format!("--{flag}"), n.to_string()]);
                assert!(at(min).is_ok() && at(max).is_ok(), "{}", def.key);
                assert!(at(max + 1).is_err(), "{} above its range", def.key);
                if min > 0 {
                    assert!(at(min - 1).is_err(), "{} below its range", def.key);
                }
            }
        }
        // Every flag comes from the table.
        assert_eq!(
            command.get_arguments().count(),
            OPTIONS
                .iter()
                .filter(|d| d.brick != BrickFlag::None)
                .count()
        );
    }

    #[test]
    fn supervisor_arguments_give_a_brick_the_volumes_settings() {
        for options in [BTreeMap::new(), non_defaults()] {
            let args = brick_args(&options, 0);
            let parsed = parse(&args).expect("brickd takes the supervisor's arguments");
            assert_eq!(
                parsed,
                BrickSettings::from_options(&options).expect("valid"),
                "{args:?}"
            );
        }
        let defaults = BrickSettings::from_options(&BTreeMap::new()).expect("defaults");
        assert_eq!(parse(&[]).expect("no flags"), defaults);
        assert_eq!(defaults.workers, None);
        assert_eq!(defaults.metrics_listen, None);
        assert_eq!(defaults.inflight_max, 256);
    }

    #[test]
    fn flag_forms_follow_the_table() {
        let args = brick_args(&non_defaults(), 2);
        let joined = args.join(" ");
        assert!(
            joined.contains("--metrics-listen 127.0.0.1:9715"),
            "{joined}"
        );
        assert!(joined.contains("--workers 3"), "{joined}");
        assert!(
            joined.contains("--count-fop-hits --latency-measurement"),
            "{joined}"
        );
        assert!(joined.contains("--auth-allow alice,bob"), "{joined}");
        assert!(!joined.contains("attr-timeout"), "{joined}");
        let defaults = brick_args(&BTreeMap::new(), 2).join(" ");
        for absent in ["--workers", "--metrics-listen", "--count-fop-hits"] {
            assert!(!defaults.contains(absent), "{defaults}");
        }
        assert!(defaults.contains("--inflight-max 256"), "{defaults}");
        let bad = parse(&["--inflight-max".into(), "0".into()]).expect_err("out of range");
        assert!(
            bad.to_string().contains("an integer from 1 to 4096"),
            "{bad}"
        );
    }

    #[test]
    fn settings_round_trip_through_option_values() {
        let settings = BrickSettings::from_options(&non_defaults()).expect("valid");
        let options = settings.to_options();
        let brick_keys: Vec<&str> = OPTIONS
            .iter()
            .filter(|d| d.brick != BrickFlag::None)
            .map(|d| d.key)
            .collect();
        assert_eq!(
            options.keys().map(String::as_str).collect::<Vec<_>>(),
            brick_keys
        );
        assert_eq!(
            BrickSettings::from_options(&options).expect("valid"),
            settings
        );
        for (key, value) in &non_defaults() {
            if let Some(round_tripped) = options.get(key) {
                assert_eq!(round_tripped, value, "{key}");
            }
        }
        assert_eq!(
            live_brick_options(&non_defaults()),
            settings.live_options(),
            "the supervisor pushes what the brick reports"
        );
    }

    #[test]
    fn live_pushes_change_only_live_options() {
        let start = BrickSettings::from_options(&BTreeMap::new()).expect("defaults");
        let push = set(&[
            ("auth.allow", " carol "),
            ("network.inflight-max", "8"),
            ("diagnostics.count-fop-hits", "yes"),
            ("features.leases", "off"),
            ("features.lease-recall-timeout-ms", "300"),
        ]);
        let live = start.with_live(&push).expect("live options");
        assert!(!live.leases && start.leases);
        assert_eq!(live.lease_recall_timeout_ms, 300);
        assert_eq!(live.lease_contention_ms, 1000);
        assert_eq!(live.auth_allow, "carol");
        assert_eq!(live.inflight_max, 8);
        assert!(live.count_fop_hits && !live.latency_measurement);
        assert_eq!(live.engine, start.engine);
        let refused = start.with_live(&set(&[("server.engine", "blocking")]));
        assert!(
            matches!(refused, Err(OptionError::NotLive { .. })),
            "{refused:?}"
        );
        let refused = start.with_live(&set(&[("network.inflight-max", "0")]));
        assert!(
            matches!(refused, Err(OptionError::BadValue { .. })),
            "{refused:?}"
        );
        let refused = start.with_live(&set(&[("no.such", "1")]));
        assert!(
            matches!(refused, Err(OptionError::Unknown { .. })),
            "{refused:?}"
        );
        assert_eq!(
            live.live_options().keys().collect::<Vec<_>>(),
            [
                "auth.allow",
                "auth.revoked",
                "diagnostics.count-fop-hits",
                "diagnostics.latency-measurement",
                "features.lease-contention-ms",
                "features.lease-recall-timeout-ms",
                "features.leases",
                "network.connections-max",
                "network.connections-per-client-max",
                "network.inflight-max",
                "server.anongid",
                "server.anonuid",
                "server.root-allow",
                "server.root-squash",
            ]
        );
    }

    #[test]
    fn engine_and_fsync_names_match_their_variants() {
        for engine in ServerEngine::ALL {
            assert_eq!(ServerEngine::from_name(engine.name()), Some(engine));
            let json = serde_json::to_string(&engine).expect("json");
            assert_eq!(json, format!("\"{}\"", engine.name()));
        }
        for policy in FsyncPolicy::ALL {
            assert_eq!(FsyncPolicy::from_name(policy.name()), Some(policy));
            let json = serde_json::to_string(&policy).expect("json");
            assert_eq!(json, format!("\"{}\"", policy.name()));
        }
        assert_eq!(ServerEngine::NAMES.len(), ServerEngine::ALL.len());
        assert_eq!(FsyncPolicy::NAMES.len(), FsyncPolicy::ALL.len());
    }
}
