//! The typed volume option table: every key `kiln volume set` accepts, what values it takes,
//! its default and when a change reaches a running brick.
//!
//! Values are stored in canonical form (what [`OptionDef::parse`] returns), so two spellings
//! of the same setting (`on` and `YES`, `0256` and `256`) are one value in the volume
//! configuration and compare equal. Only explicitly set options are stored; [`effective`]
//! falls back to the table's default for the rest.
//!
//! Each option also says how it reaches a brick ([`BrickFlag`]): the supervisor builds a
//! brick's `kiln-brickd serve` arguments from the table ([`brick_args`]), and `kiln-brickd`
//! builds its flags, their defaults, ranges and help from it ([`BrickSettings`]), so a
//! default or a range is written once, here.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::pki;

mod brick;

pub use brick::{
    BrickSettings, FsyncPolicy, ServerEngine, brick_args, brick_clap_args, live_brick_options,
};

/// The values an option takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueKind {
    /// `on` or `off`; `true`/`false`, `yes`/`no` and `1`/`0` are accepted too.
    Bool,
    /// A decimal integer in `min..=max`.
    Integer { min: u64, max: u64 },
    /// One of these words.
    Choice(&'static [&'static str]),
    /// `*` (everyone) or a comma-separated list of identity names ([`pki::check_name`]).
    NameList,
    /// A comma-separated list of identity names, possibly empty (nobody); no `*`.
    Names,
    /// A comma-separated list of certificate serial numbers in hex (colons allowed, as
    /// `openssl x509 -serial` and TLS tools print them), possibly empty.
    Serials,
    /// `off`, or a TCP address `IP:PORT` to listen on.
    Listen,
}

/// When a changed value takes effect on a running brick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Apply {
    /// Pushed to running bricks; no restart needed.
    Live,
    /// Read when the brick starts; running bricks keep the old value until restarted.
    Restart,
    /// Read by `kiln mount` when it mounts; mounted clients keep the old value until
    /// remounted.
    Mount,
}

impl Apply {
    /// `live` or `restart`, as shown by `kiln volume set help`.
    pub fn as_str(self) -> &'static str {
        match self {
            Apply::Live => "live",
            Apply::Restart => "restart",
            Apply::Mount => "mount",
        }
    }
}

/// How an option reaches a brick: the `kiln-brickd serve` flag (written without its leading
/// `--`) and how the value becomes arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrickFlag {
    /// Not a brick option (read by mounts).
    None,
    /// `--FLAG VALUE`.
    Value(&'static str),
    /// `--FLAG VALUE`, left out at value `omitted` (the brick's own choice, e.g. `0` worker
    /// threads: one per core).
    ValueUnless {
        flag: &'static str,
        omitted: &'static str,
    },
    /// `--FLAG` when `on`; a switch, so the option's default must be `off`.
    Switch(&'static str),
    /// `--FLAG IP:PORT` when not `off`; brick `i` of a volume gets the port + `i`.
    ListenPlusBrickIndex(&'static str),
}

impl BrickFlag {
    /// The flag's name without `--`, if the option reaches bricks.
    pub fn name(self) -> Option<&'static str> {
        match self {
            BrickFlag::None => None,
            BrickFlag::Value(flag)
            | BrickFlag::ValueUnless { flag, .. }
            | BrickFlag::Switch(flag)
            | BrickFlag::ListenPlusBrickIndex(flag) => Some(flag),
        }
    }
}

/// One volume option.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionDef {
    pub key: &'static str,
    pub kind: ValueKind,
    /// The value when not set, in canonical form.
    pub default: &'static str,
    pub apply: Apply,
    pub brick: BrickFlag,
    /// One line for `kiln volume set help`.
    pub help: &'static str,
}

/// Every volume option, sorted by key (checked at compile time; [`find`] relies on it).
pub const OPTIONS: &[OptionDef] = &[
    OptionDef {
        key: "auth.allow",
        kind: ValueKind::NameList,
        default: "*",
        apply: Apply::Live,
        brick: BrickFlag::Value("auth-allow"),
        help: "client certificate names allowed to connect (`*`: any from the cluster CA)",
    },
    OptionDef {
        key: "auth.revoked",
        kind: ValueKind::Serials,
        default: "",
        apply: Apply::Live,
        brick: BrickFlag::Value("revoked"),
        help: "serial numbers of revoked certificates: refused at connect, and connections \
               holding one are closed when this changes",
    },
    OptionDef {
        key: "diagnostics.count-fop-hits",
        kind: ValueKind::Bool,
        default: "off",
        apply: Apply::Live,
        brick: BrickFlag::Switch("count-fop-hits"),
        help: "per-fop call counters",
    },
    OptionDef {
        key: "diagnostics.latency-measurement",
        kind: ValueKind::Bool,
        default: "off",
        apply: Apply::Live,
        brick: BrickFlag::Switch("latency-measurement"),
        help: "per-fop latency histograms",
    },
    OptionDef {
        key: "diagnostics.metrics-listen",
        kind: ValueKind::Listen,
        default: "off",
        apply: Apply::Restart,
        brick: BrickFlag::ListenPlusBrickIndex("metrics-listen"),
        help: "serve Prometheus metrics at http://IP:PORT/metrics (a volume's later bricks \
               take the following ports); off: no endpoint",
    },
    OptionDef {
        key: "features.acl",
        kind: ValueKind::Bool,
        default: "off",
        apply: Apply::Mount,
        brick: BrickFlag::None,
        help: "mounts carry POSIX ACLs (set, read and enforced by the brick); off, as \
               GlusterFS's mounts default to, they answer that the file system does not \
               support them, and `ls -l` stops asking for every file",
    },
    OptionDef {
        key: "features.lease-contention-ms",
        kind: ValueKind::Integer {
            min: 0,
            max: 60_000,
        },
        default: "1000",
        apply: Apply::Live,
        brick: BrickFlag::Value("lease-contention-ms"),
        help: "after a client's fop recalled another's lease on a directory, no other client \
               gets a lease there for this long, in milliseconds (clients working in one \
               directory stop taking it from each other)",
    },
    OptionDef {
        key: "features.lease-recall-timeout-ms",
        kind: ValueKind::Integer {
            min: 100,
            max: 600_000,
        },
        default: "5000",
        apply: Apply::Live,
        brick: BrickFlag::Value("lease-recall-timeout-ms"),
        help: "how long a recalled directory lease may stay out, in milliseconds: past it the \
               lease is revoked, the recalling fop runs, and the holder's fops in that \
               directory get ESTALE until it asks for a lease there again",
    },
    OptionDef {
        key: "features.leases",
        kind: ValueKind::Bool,
        default: "on",
        apply: Apply::Live,
        brick: BrickFlag::Value("leases"),
        help: "grant directory leases to clients that ask (off: every LEASE is answered \
               none; leases already held are recalled as usual until given back)",
    },
    OptionDef {
        key: "features.selinux",
        kind: ValueKind::Bool,
        default: "off",
        apply: Apply::Mount,
        brick: BrickFlag::None,
        help: "mounts carry SELinux labels (security.selinux); off, as GlusterFS's mounts \
               default to, they answer that the file system does not support them, and \
               `ls -l` stops asking for every file",
    },
    OptionDef {
        key: "network.connections-max",
        kind: ValueKind::Integer {
            min: 1,
            max: 65_536,
        },
        default: "1024",
        apply: Apply::Live,
        brick: BrickFlag::Value("connections-max"),
        help: "client connections a brick serves at once (each one a session); more are \
               refused (applies to new connections)",
    },
    OptionDef {
        key: "network.connections-per-client-max",
        kind: ValueKind::Integer {
            min: 1,
            max: 65_536,
        },
        default: "256",
        apply: Apply::Live,
        brick: BrickFlag::Value("connections-per-client-max"),
        help: "connections one client certificate may hold to a brick at once (applies to \
               new connections)",
    },
    OptionDef {
        key: "network.inflight-max",
        kind: ValueKind::Integer { min: 1, max: 4096 },
        default: "256",
        apply: Apply::Live,
        brick: BrickFlag::Value("inflight-max"),
        help: "calls in flight per connection (applies to new connections)",
    },
    OptionDef {
        key: "network.inode-lru-limit",
        kind: ValueKind::Integer {
            min: 1024,
            max: 16_777_216,
        },
        default: "1048576",
        apply: Apply::Restart,
        brick: BrickFlag::Value("gfid-cache-entries"),
        help: "GFID entries cached per worker thread (a brick holds up to event-threads times \
               this)",
    },
    OptionDef {
        key: "network.locks-per-client-max",
        kind: ValueKind::Integer {
            min: 1,
            max: 1_048_576,
        },
        default: "4096",
        apply: Apply::Restart,
        brick: BrickFlag::Value("locks-per-client-max"),
        help: "POSIX lock ranges one connection may hold; more get ENOLCK",
    },
    OptionDef {
        key: "network.open-files-per-client-max",
        kind: ValueKind::Integer {
            min: 16,
            max: 1_048_576,
        },
        default: "16384",
        apply: Apply::Restart,
        brick: BrickFlag::Value("open-files-per-client-max"),
        help: "files and directories one connection may hold open; more get EMFILE",
    },
    OptionDef {
        key: "performance.attr-timeout-ms",
        kind: ValueKind::Integer {
            min: 0,
            max: 3_600_000,
        },
        default: "1000",
        apply: Apply::Mount,
        brick: BrickFlag::None,
        help: "how long a mount's kernel caches file attributes, in milliseconds",
    },
    OptionDef {
        key: "performance.behind-bytes-max",
        kind: ValueKind::Integer {
            min: 1 << 20,
            max: 1 << 34,
        },
        default: "67108864",
        apply: Apply::Mount,
        brick: BrickFlag::None,
        help: "bytes of changes (small files' data included) a mount may hold answered but not \
               yet on the brick; an application further ahead waits",
    },
    OptionDef {
        key: "performance.behind-free-mib",
        kind: ValueKind::Integer {
            min: 0,
            max: 1 << 20,
        },
        default: "192",
        apply: Apply::Mount,
        brick: BrickFlag::None,
        help: "free space on any brick, in MiB, below which a mount answers no change ahead \
               (nor below 512 free inodes): changes go to the brick while the program waits, \
               so a full brick is an error at the call (0: always ahead)",
    },
    OptionDef {
        key: "performance.connections",
        // `kiln_client::CONNECTIONS_MAX` (a mount test checks they agree).
        kind: ValueKind::Integer { min: 1, max: 16 },
        default: "1",
        apply: Apply::Mount,
        brick: BrickFlag::None,
        help: "QUIC connections a mount makes to each brick: large reads and writes are \
               spread over them (more than one core's worth of encryption per brick)",
    },
    OptionDef {
        key: "performance.deferred-create",
        kind: ValueKind::Bool,
        default: "on",
        apply: Apply::Mount,
        brick: BrickFlag::None,
        help: "a mount sends a small new file, of a name it knows free under a lease, as one \
               PUT at its first close (a refused create then fails the close) instead of a \
               CREATE, WRITEs and SETATTRs",
    },
    OptionDef {
        key: "performance.entry-timeout-ms",
        kind: ValueKind::Integer {
            min: 0,
            max: 3_600_000,
        },
        default: "1000",
        apply: Apply::Mount,
        brick: BrickFlag::None,
        help: "how long a mount's kernel caches a name's lookup, in milliseconds",
    },
    OptionDef {
        key: "performance.file-leases",
        kind: ValueKind::Bool,
        default: "on",
        apply: Apply::Mount,
        brick: BrickFlag::None,
        help: "with leases, a mount holds a read lease on each file it opens for reading \
               that no kept listing describes (a round trip at its first open), so another \
               client's change to it drops what the kernel caches of it at once",
    },
    OptionDef {
        key: "performance.file-prefetch",
        kind: ValueKind::Bool,
        default: "on",
        apply: Apply::Mount,
        brick: BrickFlag::None,
        help: "with listings fetched ahead and a brick that recalls a listing's lease before \
               another client changes what it showed, a program reading a directory's files \
               in the order it listed them finds the next small files fetched ahead (a GET \
               each, wasted if the program stops reading)",
    },
    OptionDef {
        key: "performance.fuse-uring",
        kind: ValueKind::Bool,
        default: "on",
        apply: Apply::Mount,
        brick: BrickFlag::None,
        help: "a mount takes the kernel's requests through io_uring, one queue per CPU, \
               answering each on the CPU that made it, where the kernel offers it (Linux \
               6.14+, the fuse module's enable_uring on); otherwise through /dev/fuse",
    },
    OptionDef {
        key: "performance.leases",
        kind: ValueKind::Bool,
        default: "on",
        apply: Apply::Mount,
        brick: BrickFlag::None,
        help: "a mount takes a write lease on each directory it makes and answers namespace \
               changes there itself, sending them to the brick behind (a refused change fails \
               the next fsync or close of the object, or fsync of a directory)",
    },
    OptionDef {
        key: "performance.listed-attrs",
        kind: ValueKind::Bool,
        default: "on",
        apply: Apply::Mount,
        brick: BrickFlag::None,
        help: "with leases, a mount keeps a directory's listing until its lease goes rather \
               than for the attribute lifetime, where the brick recalls the lease before \
               another client changes anything the listing showed (LISTED_ATTRS)",
    },
    OptionDef {
        key: "performance.listing-prefetch",
        kind: ValueKind::Bool,
        default: "on",
        apply: Apply::Mount,
        brick: BrickFlag::None,
        help: "with leases, a mount lists the first subdirectories a listing shows before \
               anything opens them, so a walk (find, ls -lR, du) finds their listings kept \
               (each costs the brick a listing and a read lease, used or not)",
    },
    OptionDef {
        key: "performance.negative-timeout-ms",
        kind: ValueKind::Integer {
            min: 0,
            max: 3_600_000,
        },
        default: "1000",
        apply: Apply::Mount,
        brick: BrickFlag::None,
        help: "how long a mount's kernel caches that a name does not exist, in milliseconds",
    },
    OptionDef {
        key: "performance.read-ahead-kib",
        kind: ValueKind::Integer {
            min: 0,
            max: 65_536,
        },
        default: "4096",
        apply: Apply::Mount,
        brick: BrickFlag::None,
        help: "how far a mount's kernel reads ahead of a program reading a file in order, in \
               KiB (0: the kernel's 128 KiB, one READ in flight)",
    },
    OptionDef {
        key: "performance.release-leases",
        kind: ValueKind::Bool,
        default: "on",
        apply: Apply::Mount,
        brick: BrickFlag::None,
        help: "with file leases, a mount takes the read lease of a file it wrote when the \
               writing handle is released (a round trip behind each close of a file \
               rewritten there), so reading it back waits for nothing",
    },
    OptionDef {
        key: "performance.write-behind",
        kind: ValueKind::Bool,
        default: "on",
        apply: Apply::Mount,
        brick: BrickFlag::None,
        help: "a mount gathers each open file's writes (up to a MiB) and sends them when \
               they stop continuing each other, at close or fsync, or before the file is \
               read back from the brick; a refusal is returned at the next close or fsync",
    },
    OptionDef {
        key: "performance.writeback-cache",
        kind: ValueKind::Bool,
        default: "off",
        apply: Apply::Mount,
        brick: BrickFlag::None,
        help: "a mount's kernel gathers small writes in its page cache (flushed on close, \
               fsync and memory pressure) instead of sending each one",
    },
    OptionDef {
        key: "server.anongid",
        kind: ValueKind::Integer {
            min: 0,
            max: 4_294_967_294,
        },
        default: "65534",
        apply: Apply::Live,
        brick: BrickFlag::Value("anongid"),
        help: "the group id gid 0 becomes when root is squashed",
    },
    OptionDef {
        key: "server.anonuid",
        kind: ValueKind::Integer {
            min: 0,
            max: 4_294_967_294,
        },
        default: "65534",
        apply: Apply::Live,
        brick: BrickFlag::Value("anonuid"),
        help: "the user id uid 0 becomes when root is squashed",
    },
    OptionDef {
        key: "server.engine",
        kind: ValueKind::Choice(ServerEngine::NAMES),
        default: "uring",
        apply: Apply::Restart,
        brick: BrickFlag::Value("engine"),
        help: "fop executor: io_uring rings, or a pool of threads making blocking calls",
    },
    OptionDef {
        key: "server.event-threads",
        kind: ValueKind::Integer { min: 0, max: 64 },
        default: "0",
        apply: Apply::Restart,
        brick: BrickFlag::ValueUnless {
            flag: "workers",
            omitted: "0",
        },
        help: "brick worker threads (0: one per core)",
    },
    OptionDef {
        key: "server.ring-entries",
        kind: ValueKind::Integer {
            min: 16,
            max: 32_768,
        },
        default: "1024",
        apply: Apply::Restart,
        brick: BrickFlag::Value("ring-entries"),
        help: "submission queue entries of each worker's io_uring (rounded up to a power of two)",
    },
    OptionDef {
        key: "server.root-allow",
        kind: ValueKind::Names,
        default: "",
        apply: Apply::Live,
        brick: BrickFlag::Value("root-allow"),
        help: "client certificate names whose uid 0 stays root (an admin host's mount); \
               empty: none",
    },
    OptionDef {
        key: "server.root-squash",
        kind: ValueKind::Bool,
        default: "on",
        apply: Apply::Live,
        brick: BrickFlag::Value("root-squash"),
        help: "uid and gid 0 of clients not in server.root-allow become server.anonuid and \
               server.anongid, as NFS's root_squash",
    },
    OptionDef {
        key: "storage.dirfd-cache-entries",
        kind: ValueKind::Integer {
            min: 16,
            max: 1_048_576,
        },
        default: "4096",
        apply: Apply::Restart,
        brick: BrickFlag::Value("dirfd-cache-entries"),
        help: "directory fds the brick holds open (one cache for all its worker threads)",
    },
    OptionDef {
        key: "storage.fsync-policy",
        kind: ValueKind::Choice(FsyncPolicy::NAMES),
        default: "as-requested",
        apply: Apply::Restart,
        brick: BrickFlag::Value("fsync-policy"),
        help: "as-requested: data is durable when clients fsync (POSIX); \
               write-through: every write is synced before it is acknowledged",
    },
];

/// Whether `keys` are strictly increasing bytewise: sorted and unique.
const fn keys_sorted_and_unique(options: &[OptionDef]) -> bool {
    let mut i = 1;
    while i < options.len() {
        if !str_less(options[i - 1].key, options[i].key) {
            return false;
        }
        i += 1;
    }
    true
}

const fn str_less(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut i = 0;
    while i < a.len() && i < b.len() {
        if a[i] != b[i] {
            return a[i] < b[i];
        }
        i += 1;
    }
    a.len() < b.len()
}

const _: () = assert!(
    keys_sorted_and_unique(OPTIONS),
    "OPTIONS must be sorted by key with no key twice"
);

/// Whether every option given to bricks as a switch is off by default: a flag that is present
/// when `on` cannot say `off` to a brick whose default is on.
const fn switches_default_off(options: &[OptionDef]) -> bool {
    let mut i = 0;
    while i < options.len() {
        if let BrickFlag::Switch(_) = options[i].brick
            && (str_less(options[i].default, "off") || str_less("off", options[i].default))
        {
            return false;
        }
        i += 1;
    }
    true
}

const _: () = assert!(
    switches_default_off(OPTIONS),
    "an option with a BrickFlag::Switch must default to off"
);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionError {
    #[error("unknown option '{key}'{}", suggestion(.closest))]
    Unknown {
        key: String,
        closest: Option<&'static str>,
    },
    #[error("bad value '{value}' for {key}: {allowed}")]
    BadValue {
        key: String,
        value: String,
        allowed: String,
    },
    #[error("{key} is not an option a running brick can change")]
    NotLive { key: String },
}

fn suggestion(closest: &Option<&'static str>) -> String {
    match closest {
        Some(key) => format!("; did you mean '{key}'?"),
        None => "; `kiln volume set help` lists them".to_owned(),
    }
}

/// The option named `key` (exact, case-sensitive); unknown keys get the closest known one.
pub fn find(key: &str) -> Result<&'static OptionDef, OptionError> {
    match OPTIONS.binary_search_by(|def| def.key.cmp(key)) {
        Ok(i) => Ok(&OPTIONS[i]),
        Err(_) => Err(OptionError::Unknown {
            key: key.to_owned(),
            closest: closest_key(key),
        }),
    }
}

/// The known key most like `key`, if one is close enough to be a plausible typo: within an
/// edit distance of a third of the longer string (at least 2), or `key` missing only the
/// section (`inflight-max` for `network.inflight-max`).
fn closest_key(key: &str) -> Option<&'static str> {
    let key = key.trim().to_ascii_lowercase();
    if key.is_empty() {
        return None;
    }
    if let Some(def) = OPTIONS
        .iter()
        .find(|def| def.key.split_once('.').is_some_and(|(_, rest)| rest == key))
    {
        return Some(def.key);
    }
    OPTIONS
        .iter()
        .map(|def| (levenshtein(&key, def.key), def.key))
        .filter(|&(distance, known)| distance <= (key.len().max(known.len()) / 3).max(2))
        .min_by_key(|&(distance, _)| distance)
        .map(|(_, known)| known)
}

/// Edit distance (insertions, deletions, substitutions) between `a` and `b`, by character.
fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let substitute = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(diagonal + 1);
        }
    }
    row[b.len()]
}

impl OptionDef {
    /// The value in canonical form: booleans as `on`/`off` (accepting on/off, true/false,
    /// yes/no and 1/0, in any case); integers in decimal without a sign or leading zeros;
    /// choices as listed (matched in any case); name lists as `*` or names separated by a
    /// bare comma, each checked with [`pki::check_name`], later repeats dropped. Surrounding
    /// whitespace is ignored.
    pub fn parse(&self, value: &str) -> Result<String, OptionError> {
        let v = value.trim();
        let parsed = match self.kind {
            ValueKind::Bool => parse_bool(v).map(|b| if b { "on" } else { "off" }.to_owned()),
            ValueKind::Integer { min, max } => parse_integer(v)
                .filter(|n| (min..=max).contains(n))
                .map(|n| n.to_string()),
            ValueKind::Choice(choices) => choices
                .iter()
                .find(|c| c.eq_ignore_ascii_case(v))
                .map(|&c| c.to_owned()),
            ValueKind::NameList => parse_names(v),
            ValueKind::Names if v.trim().is_empty() => Some(String::new()),
            ValueKind::Names if v.trim() == "*" => None,
            ValueKind::Names => parse_names(v),
            ValueKind::Serials => parse_serials(v),
            ValueKind::Listen if v.eq_ignore_ascii_case("off") => Some("off".to_owned()),
            ValueKind::Listen => v
                .parse::<std::net::SocketAddr>()
                .ok()
                .map(|a| a.to_string()),
        };
        parsed.ok_or_else(|| OptionError::BadValue {
            key: self.key.to_owned(),
            value: value.to_owned(),
            allowed: self.allowed(),
        })
    }

    /// The allowed values in words, for error messages.
    pub fn allowed(&self) -> String {
        match self.kind {
            ValueKind::Bool => "on or off (or true/false, yes/no, 1/0)".to_owned(),
            ValueKind::Integer { min, max } => format!("an integer from {min} to {max}"),
            ValueKind::Choice(choices) => format!("one of {}", choices.join(", ")),
            ValueKind::NameList => format!(
                "'*' or a comma-separated list of names of 1 to {} letters, digits, '.', '_' \
                 or '-', not starting with '.'",
                pki::IDENTITY_NAME_MAX_BYTES
            ),
            ValueKind::Names => format!(
                "a comma-separated list of names of 1 to {} letters, digits, '.', '_' or '-', \
                 not starting with '.' (empty: nobody)",
                pki::IDENTITY_NAME_MAX_BYTES
            ),
            ValueKind::Serials => "a comma-separated list of certificate serial numbers in hex \
                 (`kiln cert serial FILE` prints one; empty: none)"
                .to_owned(),
            ValueKind::Listen => "off or IP:PORT (e.g. 127.0.0.1:9713, [::1]:9713)".to_owned(),
        }
    }

    /// The kind in a few characters, for the help table's type column.
    fn kind_summary(&self) -> String {
        match self.kind {
            ValueKind::Bool => "on|off".to_owned(),
            ValueKind::Integer { min, max } => format!("{min}..{max}"),
            ValueKind::Choice(choices) => choices.join("|"),
            ValueKind::NameList => "*|name,...".to_owned(),
            ValueKind::Names => "name,...".to_owned(),
            ValueKind::Serials => "serial,...".to_owned(),
            ValueKind::Listen => "off|ip:port".to_owned(),
        }
    }
}

fn parse_bool(v: &str) -> Option<bool> {
    const TRUE: [&str; 4] = ["on", "true", "yes", "1"];
    const FALSE: [&str; 4] = ["off", "false", "no", "0"];
    if TRUE.iter().any(|t| t.eq_ignore_ascii_case(v)) {
        Some(true)
    } else if FALSE.iter().any(|f| f.eq_ignore_ascii_case(v)) {
        Some(false)
    } else {
        None
    }
}

/// A non-negative decimal integer, optionally with a leading `+`; `None` on overflow.
fn parse_integer(v: &str) -> Option<u64> {
    let digits = v.strip_prefix('+').unwrap_or(v);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn parse_names(v: &str) -> Option<String> {
    if v == "*" {
        return Some("*".to_owned());
    }
    let mut names: Vec<&str> = Vec::new();
    for name in v.split(',').map(str::trim) {
        pki::check_name(name).ok()?;
        if !names.contains(&name) {
            names.push(name);
        }
    }
    Some(names.join(","))
}

/// Serial numbers, canonical: lowercase hex without separators or a leading zero byte,
/// sorted, each once; 1 to 20 bytes (RFC 5280's limit).
fn parse_serials(v: &str) -> Option<String> {
    let mut serials: Vec<String> = Vec::new();
    for serial in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        // With colons, each group is one byte (`0a:ff:1` is 0a ff 01).
        let hex: String = match serial.contains(':') {
            true => serial
                .split(':')
                .map(|byte| format!("{byte:0>2}"))
                .collect(),
            false => serial.to_owned(),
        };
        let hex = hex.to_ascii_lowercase();
        if hex.is_empty() || hex.len() > 40 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let hex = if hex.len() % 2 == 1 {
            format!("0{hex}")
        } else {
            hex
        };
        let hex = match hex.strip_prefix("00") {
            Some(rest) if !rest.is_empty() => rest.to_owned(),
            _ => hex,
        };
        serials.push(hex);
    }
    serials.sort();
    serials.dedup();
    Some(serials.join(","))
}

/// `kiln volume set help`: a header, then one aligned line per option: key, allowed values,
/// default, `live` or `restart`, and what it does.
pub fn help_table() -> String {
    let header = ["OPTION", "VALUES", "DEFAULT", "APPLIES", "DESCRIPTION"];
    let rows: Vec<[String; 5]> = OPTIONS
        .iter()
        .map(|def| {
            [
                def.key.to_owned(),
                def.kind_summary(),
                def.default.to_owned(),
                def.apply.as_str().to_owned(),
                def.help.to_owned(),
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.len());
        }
    }
    let mut out = String::new();
    let header = header.map(str::to_owned);
    for row in std::iter::once(&header).chain(&rows) {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                // Writing to a String cannot fail.
                let _ = write!(line, "{cell:<width$}  ", width = widths[i]);
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// The effective value of `key` given the explicitly set options `set`: the set value, else
/// the table's default; `""` for a key not in the table. Set values are stored canonical
/// (from [`OptionDef::parse`]), so callers may parse the result without re-validating.
pub fn effective<'a>(set: &'a BTreeMap<String, String>, key: &str) -> &'a str {
    match find(key) {
        Ok(def) => set.get(key).map_or(def.default, String::as_str),
        Err(_) => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def(key: &str) -> &'static OptionDef {
        find(key).expect("known key")
    }

    fn bad_value(key: &str, value: &str) -> String {
        match def(key).parse(value) {
            Err(e @ OptionError::BadValue { .. }) => e.to_string(),
            other => panic!("{key}={value:?} gave {other:?}"),
        }
    }

    #[test]
    fn table_is_sorted_unique_and_defaults_are_canonical() {
        assert!(keys_sorted_and_unique(OPTIONS));
        for pair in OPTIONS.windows(2) {
            assert!(
                pair[0].key < pair[1].key,
                "{} / {}",
                pair[0].key,
                pair[1].key
            );
        }
        for opt in OPTIONS {
            let parsed = opt.parse(opt.default).expect("default parses");
            assert_eq!(parsed, opt.default, "{} default is not canonical", opt.key);
            assert!(
                !opt.help.is_empty() && !opt.help.contains('\n'),
                "{}",
                opt.key
            );
            assert_eq!(find(opt.key).expect("every key is found").key, opt.key);
            if let ValueKind::Integer { min, max } = opt.kind {
                assert!(min <= max, "{}", opt.key);
            }
        }
        for key in [
            "auth.allow",
            "server.event-threads",
            "server.engine",
            "network.inflight-max",
            "network.inode-lru-limit",
            "storage.dirfd-cache-entries",
            "storage.fsync-policy",
            "diagnostics.latency-measurement",
            "diagnostics.count-fop-hits",
        ] {
            def(key);
        }
    }

    #[test]
    fn serials_and_names_are_canonical_and_checked() {
        let revoked = def("auth.revoked");
        assert_eq!(
            revoked.parse(" 0A:ff:1, 00a0b1 ,0aff01").expect("serials"),
            "0aff01,a0b1"
        );
        assert_eq!(revoked.parse("").expect("none"), "");
        for bad in ["xyz", "*", &"ab".repeat(21)] {
            bad_value("auth.revoked", bad);
        }
        let root_allow = def("server.root-allow");
        assert_eq!(
            root_allow.parse("admin, ops,admin").expect("names"),
            "admin,ops"
        );
        assert_eq!(root_allow.parse(" ").expect("nobody"), "");
        bad_value("server.root-allow", "*");
        bad_value("server.root-allow", "../x");
    }

    #[test]
    fn const_order_check_catches_disorder() {
        let mut swapped = [OPTIONS[0], OPTIONS[1]];
        assert!(keys_sorted_and_unique(&swapped));
        swapped.swap(0, 1);
        assert!(!keys_sorted_and_unique(&swapped));
        assert!(!keys_sorted_and_unique(&[OPTIONS[0], OPTIONS[0]]));
        assert!(str_less("a", "ab") && !str_less("ab", "a") && !str_less("a", "a"));
    }

    #[test]
    fn unknown_keys_suggest_the_closest() {
        let closest = |key: &str| match find(key) {
            Err(OptionError::Unknown { closest, .. }) => closest,
            other => panic!("{key} gave {other:?}"),
        };
        assert_eq!(closest("auth.alow"), Some("auth.allow"));
        assert_eq!(closest("network.inflight"), Some("network.inflight-max"));
        assert_eq!(closest("inflight-max"), Some("network.inflight-max"));
        assert_eq!(closest("Server.Engine"), Some("server.engine"));
        assert_eq!(closest("server.event-thread"), Some("server.event-threads"));
        assert_eq!(closest("zzz"), None);
        assert_eq!(closest(""), None);
        assert_eq!(
            find("auth.alow").expect_err("unknown").to_string(),
            "unknown option 'auth.alow'; did you mean 'auth.allow'?"
        );
        assert_eq!(
            find("x").expect_err("unknown").to_string(),
            "unknown option 'x'; `kiln volume set help` lists them"
        );
    }

    #[test]
    fn levenshtein_counts_edits() {
        assert_eq!(levenshtein("", ""), 0);
        assert_eq!(levenshtein("abc", ""), 3);
        assert_eq!(levenshtein("", "abc"), 3);
        assert_eq!(levenshtein("kitten", "sitting"), 3);
        assert_eq!(levenshtein("auth.alow", "auth.allow"), 1);
    }

    #[test]
    fn integers_are_range_checked_and_canonical() {
        let inflight = def("network.inflight-max");
        for (given, canonical) in [("1", "1"), ("4096", "4096"), (" 0256 ", "256"), ("+7", "7")] {
            assert_eq!(inflight.parse(given).expect("valid"), canonical, "{given}");
        }
        assert_eq!(
            bad_value("network.inflight-max", "0"),
            "bad value '0' for network.inflight-max: an integer from 1 to 4096"
        );
        for bad in [
            "4097",
            "-1",
            "ten",
            "",
            "1.5",
            "0x10",
            "+",
            "99999999999999999999",
        ] {
            assert!(
                bad_value("network.inflight-max", bad).ends_with("an integer from 1 to 4096"),
                "{bad}"
            );
        }
        assert_eq!(def("server.event-threads").parse("0").expect("valid"), "0");
        assert!(bad_value("server.event-threads", "65").contains("from 0 to 64"));
        assert!(bad_value("network.inode-lru-limit", "1023").contains("from 1024 to 16777216"));
    }

    #[test]
    fn listen_addresses_are_canonical_and_bad_ones_refused() {
        let opt = def("diagnostics.metrics-listen");
        assert_eq!(opt.parse(" OFF ").expect("valid"), "off");
        assert_eq!(
            opt.parse("127.0.0.1:9713").expect("valid"),
            "127.0.0.1:9713"
        );
        assert_eq!(opt.parse("[::1]:09713").expect("valid"), "[::1]:9713");
        for bad in [
            "",
            "9713",
            "localhost:9713",
            "127.0.0.1",
            "127.0.0.1:99999",
            "on",
        ] {
            assert!(
                bad_value("diagnostics.metrics-listen", bad).contains("off or IP:PORT"),
                "{bad}"
            );
        }
    }

    #[test]
    fn bools_accept_common_spellings() {
        let opt = def("diagnostics.latency-measurement");
        for on in ["on", "ON", "true", "True", "yes", "YES", "1", " on "] {
            assert_eq!(opt.parse(on).expect("valid"), "on", "{on}");
        }
        for off in ["off", "Off", "false", "FALSE", "no", "No", "0"] {
            assert_eq!(opt.parse(off).expect("valid"), "off", "{off}");
        }
        for bad in ["", "2", "enable", "onn", "y"] {
            assert!(
                bad_value("diagnostics.latency-measurement", bad).contains("on or off"),
                "{bad}"
            );
        }
    }

    #[test]
    fn choices_reject_other_words() {
        let opt = def("server.engine");
        assert_eq!(opt.parse("blocking").expect("valid"), "blocking");
        assert_eq!(opt.parse(" URING ").expect("valid"), "uring");
        assert_eq!(
            bad_value("server.engine", "epoll"),
            "bad value 'epoll' for server.engine: one of uring, blocking"
        );
        assert!(
            bad_value("storage.fsync-policy", "always")
                .ends_with("one of as-requested, write-through")
        );
        assert_eq!(
            def("storage.fsync-policy")
                .parse("write-through")
                .expect("valid"),
            "write-through"
        );
    }

    #[test]
    fn name_lists_are_checked_and_canonical() {
        let opt = def("auth.allow");
        assert_eq!(opt.parse(" alice , bob ").expect("valid"), "alice,bob");
        assert_eq!(opt.parse(" * ").expect("valid"), "*");
        assert_eq!(opt.parse("a.b_c-1").expect("valid"), "a.b_c-1");
        assert_eq!(opt.parse("alice,bob,alice").expect("valid"), "alice,bob");
        assert_eq!(opt.parse(&"x".repeat(64)).expect("valid"), "x".repeat(64));
        for bad in [
            "a/b",
            ".x",
            "",
            "alice,,bob",
            "alice,",
            ",alice",
            "alice bob",
            "alice,*",
            "**",
            &"x".repeat(65),
        ] {
            assert!(
                bad_value("auth.allow", bad).contains("comma-separated list of names"),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn help_table_has_a_line_per_option() {
        let table = help_table();
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), OPTIONS.len() + 1, "{table}");
        assert!(lines[0].starts_with("OPTION"));
        for (line, opt) in lines[1..].iter().zip(OPTIONS) {
            assert!(line.starts_with(opt.key), "{line}");
            assert!(line.contains(opt.apply.as_str()), "{line}");
            assert!(line.ends_with(opt.help), "{line}");
            assert_eq!(line.find(opt.help), lines[0].find("DESCRIPTION"), "{line}");
        }
        assert!(table.contains(" live ") && table.contains(" restart "));
        assert!(lines.iter().all(|l| l == &l.trim_end()));
    }

    #[test]
    fn effective_falls_back_to_defaults() {
        let mut set = BTreeMap::new();
        set.insert("network.inflight-max".to_owned(), "64".to_owned());
        assert_eq!(effective(&set, "network.inflight-max"), "64");
        assert_eq!(effective(&set, "server.engine"), "uring");
        assert_eq!(effective(&set, "auth.allow"), "*");
        assert_eq!(effective(&set, "no.such-option"), "");
        set.insert("no.such-option".to_owned(), "1".to_owned());
        assert_eq!(effective(&set, "no.such-option"), "");
    }
}
