//! The configuration in etcd, shared by every host's daemon: one key per object under a
//! cluster prefix, changed only by etcd transactions that compare-and-set one commit key.
//!
//! ```text
//! <prefix>config/commit           the last transaction's changes (JSON); its mod revision
//!                                 is the configuration's generation
//! <prefix>config/objects/<key>    one object of the state (a volume), JSON
//! ```
//!
//! A commit checks its changes against the state this daemon has seen, then writes the
//! objects they change in one transaction that succeeds only if the commit key has not
//! moved since (`mod_revision == generation`): every transaction is checked against the
//! state it follows, as the embedded log's writer checks them in order. A transaction that
//! lost a race reads the newer state in the same round trip and is checked again.
//!
//! Every daemon keeps a copy of the state, brought up to date by a watch from the revision
//! it has: a commit's own result is applied at once (so a command reads what it wrote), the
//! others' as their events arrive. A broken watch is made again from where it stopped; one
//! whose revision etcd has compacted away reloads the whole prefix.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, KeyValue, Txn, TxnOp,
    TxnOpResponse, WatchOptions,
};
use tokio::sync::watch;

use super::{CommitError, State, StoreError};

/// How long one request to etcd may take before the commit or read fails (a partitioned
/// member without quorum never answers).
pub const ETCD_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long connecting to an etcd endpoint may take.
const ETCD_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Transactions tried before a commit that keeps losing races gives up.
const COMMIT_ATTEMPTS_MAX: usize = 64;
/// Waits between attempts to make a broken watch again: the first, and the longest.
const REWATCH_BACKOFF_MIN: Duration = Duration::from_millis(100);
const REWATCH_BACKOFF_MAX: Duration = Duration::from_secs(2);

/// A state etcd can hold: one value per object.
pub trait Objects: State {
    /// Each object: its key (a name without `/`) and its encoded value.
    fn objects(&self) -> BTreeMap<String, Vec<u8>>;
    /// The state made of `objects`, as [`Objects::objects`] gave them.
    fn from_objects(objects: &BTreeMap<String, Vec<u8>>) -> Result<Self, String>;
}

/// Where the configuration lives in etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTarget {
    /// Client URLs of the members (`http://HOST:2379`).
    pub endpoints: Vec<String>,
    /// The cluster's name: its keys are under `/kiln/<cluster>/`.
    pub cluster: String,
}

impl EtcdTarget {
    /// The prefix of every key of the cluster.
    pub fn prefix(&self) -> String {
        format!("/kiln/{}/", self.cluster)
    }

    /// Connects to the members (each request goes to one that answers).
    pub async fn connect(&self) -> Result<Client, StoreError> {
        let options = ConnectOptions::new()
            .with_connect_timeout(ETCD_CONNECT_TIMEOUT)
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            .with_keep_alive_while_idle(true);
        let connect = Client::connect(&self.endpoints, Some(options));
        in_time(&self.endpoints, connect).await
    }
}

/// The state at one revision.
#[derive(Debug)]
struct Seen<S> {
    state: S,
    objects: BTreeMap<String, Vec<u8>>,
    /// The commit key's mod revision: the configuration generation (0: never committed).
    generation: u64,
    /// The etcd revision up to which every change of the configuration is in `state`.
    revision: i64,
}

/// The keys of a cluster's configuration.
#[derive(Debug, Clone)]
struct Keys {
    /// Every configuration key starts with it (the watch's range).
    config: String,
    commit: String,
    objects: String,
}

impl Keys {
    fn new(prefix: &str) -> Keys {
        let config = format!("{prefix}config/");
        Keys {
            commit: format!("{config}commit"),
            objects: format!("{config}objects/"),
            config,
        }
    }
}

/// The configuration state `S` kept in etcd; share it as `Arc`. Dropping it stops its
/// watch.
pub struct EtcdStore<S: Objects> {
    client: Client,
    target: EtcdTarget,
    keys: Keys,
    seen: watch::Sender<Arc<Seen<S>>>,
    /// Why the copy stopped following etcd (an object that does not decode).
    failure: Arc<Mutex<Option<String>>>,
    watcher: tokio::task::JoinHandle<()>,
}

impl<S: Objects> std::fmt::Debug for EtcdStore<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("target", &self.target)
            .field("generation", &self.generation())
            .finish_non_exhaustive()
    }
}

impl<S: Objects> EtcdStore<S> {
    /// Connects, reads the configuration, and follows it from there.
    pub async fn open(target: EtcdTarget) -> Result<EtcdStore<S>, StoreError> {
        let client = target.connect().await?;
        let keys = Keys::new(&target.prefix());
        let seen = load::<S>(&client, &target, &keys).await?;
        let (seen, _) = watch::channel(Arc::new(seen));
        let failure = Arc::new(Mutex::new(None));
        let watcher = tokio::spawn(follow(
            client.clone(),
            target.clone(),
            keys.clone(),
            seen.clone(),
            failure.clone(),
        ));
        Ok(EtcdStore {
            client,
            target,
            keys,
            seen,
            failure,
            watcher,
        })
    }

    /// Checks the changes in order against the configuration (all or none) and commits
    /// them as one etcd transaction; returns the new generation (its etcd revision).
    pub async fn commit(&self, changes: Vec<S::Change>) -> Result<u64, CommitError<S::Error>> {
        let failure = self
            .failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(reason) = failure {
            return Err(CommitError::Store(StoreError::Diverged { reason }));
        }
        let record = serde_json::to_vec(&changes).map_err(|error| {
            CommitError::Store(StoreError::Encode {
                what: "transaction",
                error,
            })
        })?;
        for _ in 0..COMMIT_ATTEMPTS_MAX {
            let base = self.seen.borrow().clone();
            let mut next = base.state.clone();
            for change in &changes {
                next.check(change).map_err(CommitError::Rejected)?;
                next.apply(change);
            }
            let objects = next.objects();
            let mut writes = self.writes(&base.objects, &objects);
            writes.push(TxnOp::put(self.keys.commit.clone(), record.clone(), None));
            let generation = i64::try_from(base.generation).unwrap_or(i64::MAX);
            let txn = Txn::new()
                .when([Compare::mod_revision(
                    self.keys.commit.clone(),
                    CompareOp::Equal,
                    generation,
                )])
                .and_then(writes)
                .or_else([TxnOp::get(
                    self.keys.config.clone(),
                    Some(GetOptions::new().with_prefix()),
                )]);
            let mut client = self.client.clone();
            let answer = in_time(&self.target.endpoints, client.txn(txn))
                .await
                .map_err(CommitError::Store)?;
            let revision = answer.header().map_or(0, |h| h.revision());
            if answer.succeeded() {
                let generation = u64::try_from(revision).unwrap_or(0);
                let seen = Seen {
                    state: next,
                    objects,
                    generation,
                    revision,
                };
                publish(&self.seen, seen);
                return Ok(generation);
            }
            // Another daemon committed first: take its state from the answer and try again.
            if let Some(TxnOpResponse::Get(get)) = answer.op_responses().into_iter().next() {
                let seen = decode::<S>(&self.keys, get.kvs(), revision)
                    .map_err(|reason| CommitError::Store(StoreError::Diverged { reason }))?;
                publish(&self.seen, seen);
            }
        }
        Err(CommitError::Store(StoreError::Contended {
            attempts: COMMIT_ATTEMPTS_MAX,
        }))
    }

    /// The puts and deletes that turn `old` objects into `new`.
    fn writes(
        &self,
        old: &BTreeMap<String, Vec<u8>>,
        new: &BTreeMap<String, Vec<u8>>,
    ) -> Vec<TxnOp> {
        let key = |name: &str| format!("{}{name}", self.keys.objects);
        let puts = new
            .iter()
            .filter(|(name, value)| old.get(*name) != Some(*value))
            .map(|(name, value)| TxnOp::put(key(name), value.clone(), None));
        let deletes = old
            .keys()
            .filter(|name| !new.contains_key(*name))
            .map(|name| TxnOp::delete(key(name), None));
        puts.chain(deletes).collect()
    }

    /// Calls `f` with the configuration as last seen here and its generation.
    pub fn read<R>(&self, f: impl FnOnce(&S, u64) -> R) -> R {
        let seen = self.seen.borrow().clone();
        f(&seen.state, seen.generation)
    }

    /// The generation last seen here.
    pub fn generation(&self) -> u64 {
        self.seen.borrow().generation
    }

    /// Tells each new generation seen here.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        let (tell, told) = watch::channel(self.generation());
        let mut seen = self.seen.subscribe();
        tokio::spawn(async move {
            while seen.changed().await.is_ok() {
                let generation = seen.borrow_and_update().generation;
                if tell.send(generation).is_err() {
                    return;
                }
            }
        });
        told
    }

    /// A client of the same etcd (for what the daemon keeps beside the configuration).
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    pub fn target(&self) -> &EtcdTarget {
        &self.target
    }
}

impl<S: Objects> Drop for EtcdStore<S> {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

/// Replaces the state seen with `seen` unless what is seen is as new already.
fn publish<S>(current: &watch::Sender<Arc<Seen<S>>>, seen: Seen<S>) {
    current.send_if_modified(|now| {
        let newer = seen.revision > now.revision;
        if newer {
            *now = Arc::new(seen);
        }
        newer
    });
}

/// Runs `call` against etcd within [`ETCD_REQUEST_TIMEOUT`].
pub(crate) async fn in_time<T>(
    endpoints: &[String],
    call: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, StoreError> {
    let unreachable = |error: String| StoreError::Etcd {
        endpoints: endpoints.join(","),
        error,
    };
    match tokio::time::timeout(ETCD_REQUEST_TIMEOUT, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(unreachable(e.to_string())),
        Err(_) => Err(unreachable(format!(
            "no answer within {ETCD_REQUEST_TIMEOUT:?} (no quorum reachable?)"
        ))),
    }
}

/// Reads the whole configuration.
async fn load<S: Objects>(
    client: &Client,
    target: &EtcdTarget,
    keys: &Keys,
) -> Result<Seen<S>, StoreError> {
    let mut client = client.clone();
    let get = client.get(keys.config.clone(), Some(GetOptions::new().with_prefix()));
    let answer = in_time(&target.endpoints, get).await?;
    let revision = answer.header().map_or(0, |h| h.revision());
    decode(keys, answer.kvs(), revision).map_err(|reason| StoreError::Diverged { reason })
}

/// The state made of the configuration keys `kvs`, read at `revision`.
fn decode<S: Objects>(keys: &Keys, kvs: &[KeyValue], revision: i64) -> Result<Seen<S>, String> {
    let mut objects = BTreeMap::new();
    let mut generation = 0;
    for kv in kvs {
        let key = String::from_utf8_lossy(kv.key());
        if key == keys.commit {
            generation = u64::try_from(kv.mod_revision()).unwrap_or(0);
        } else if let Some(name) = key.strip_prefix(&keys.objects) {
            objects.insert(name.to_owned(), kv.value().to_vec());
        }
    }
    let state = S::from_objects(&objects)?;
    Ok(Seen {
        state,
        objects,
        generation,
        revision,
    })
}

/// Keeps `seen` up to date with etcd until the store is dropped.
async fn follow<S: Objects>(
    client: Client,
    target: EtcdTarget,
    keys: Keys,
    seen: watch::Sender<Arc<Seen<S>>>,
    failure: Arc<Mutex<Option<String>>>,
) {
    let mut backoff = REWATCH_BACKOFF_MIN;
    loop {
        let from = seen.borrow().revision + 1;
        let why = match watch_from(&client, &keys, &seen, from).await {
            Ok(()) => "the watch ended".to_owned(),
            Err(Broken::Compacted) => {
                // The changes since `from` are gone: read everything again.
                match load::<S>(&client, &target, &keys).await {
                    Ok(loaded) => {
                        publish(&seen, loaded);
                        continue;
                    }
                    Err(e) => e.to_string(),
                }
            }
            Err(Broken::Undecodable(reason)) => {
                tracing::error!(%reason, "the configuration in etcd does not decode; no more commits");
                *failure.lock().unwrap_or_else(PoisonError::into_inner) = Some(reason);
                return;
            }
            Err(Broken::Etcd(e)) => e,
        };
        tracing::warn!(why = %why, ?backoff, "watching the configuration in etcd again");
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(REWATCH_BACKOFF_MAX);
        if let Ok(loaded) = load::<S>(&client, &target, &keys).await {
            publish(&seen, loaded);
            backoff = REWATCH_BACKOFF_MIN;
        }
    }
}

enum Broken {
    Compacted,
    Undecodable(String),
    Etcd(String),
}

/// Applies the configuration's changes from revision `from` to `seen` as they come.
async fn watch_from<S: Objects>(
    client: &Client,
    keys: &Keys,
    seen: &watch::Sender<Arc<Seen<S>>>,
    from: i64,
) -> Result<(), Broken> {
    let options = WatchOptions::new()
        .with_prefix()
        .with_start_revision(from)
        .with_progress_notify();
    let mut client = client.clone();
    let mut stream = client
        .watch(keys.config.clone(), Some(options))
        .await
        .map_err(|e| Broken::Etcd(e.to_string()))?;
    loop {
        let Some(answer) = stream
            .message()
            .await
            .map_err(|e| Broken::Etcd(e.to_string()))?
        else {
            return Ok(());
        };
        if answer.compact_revision() > 0 {
            return Err(Broken::Compacted);
        }
        if answer.canceled() {
            return Err(Broken::Etcd(format!(
                "watch canceled: {}",
                answer.cancel_reason()
            )));
        }
        let now = seen.borrow().clone();
        let mut objects = now.objects.clone();
        let (mut generation, mut revision) = (now.generation, now.revision);
        for event in answer.events() {
            let Some(kv) = event.kv() else { continue };
            if kv.mod_revision() <= now.revision {
                continue;
            }
            revision = revision.max(kv.mod_revision());
            let key = String::from_utf8_lossy(kv.key());
            let put = event.event_type() == EventType::Put;
            if key == keys.commit {
                generation = u64::try_from(kv.mod_revision()).unwrap_or(0);
            } else if let Some(name) = key.strip_prefix(&keys.objects) {
                match put {
                    true => objects.insert(name.to_owned(), kv.value().to_vec()),
                    false => objects.remove(name),
                };
            }
        }
        if revision == now.revision {
            continue;
        }
        let state = S::from_objects(&objects).map_err(Broken::Undecodable)?;
        publish(
            seen,
            Seen {
                state,
                objects,
                generation,
                revision,
            },
        );
    }
}
