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
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, KeyValue, Txn, TxnOp,
    TxnOpResponse, WatchOptions,
};
use tokio::sync::watch;

use super::{CommitError, State, StoreError};
use crate::lock;

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
}

/// Connections to each member of an etcd cluster. A request goes to the member that answered
/// last, and on to the next when that one cannot be reached or has no leader (etcd-client's
/// own balancing over several endpoints hands a request to a dead member and fails it).
#[derive(Clone)]
pub struct Etcd {
    target: EtcdTarget,
    members: Arc<[Client]>,
    current: Arc<AtomicUsize>,
}

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Etcd")
            .field("target", &self.target)
            .finish()
    }
}

impl Etcd {
    /// Prepares a connection to each member (made at first use).
    pub async fn connect(target: &EtcdTarget) -> Result<Etcd, StoreError> {
        let options = ConnectOptions::new()
            .with_connect_timeout(ETCD_CONNECT_TIMEOUT)
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            .with_keep_alive_while_idle(true)
            // A member cut off from the others says so at once instead of waiting.
            .with_require_leader(true);
        let mut members = Vec::with_capacity(target.endpoints.len());
        for endpoint in &target.endpoints {
            let client = Client::connect([endpoint], Some(options.clone()))
                .await
                .map_err(|e| unanswered(target, e.to_string()))?;
            members.push(client);
        }
        if members.is_empty() {
            return Err(refused(target, "no endpoints".to_owned()));
        }
        Ok(Etcd {
            target: target.clone(),
            members: members.into(),
            current: Arc::new(AtomicUsize::new(0)),
        })
    }

    pub fn target(&self) -> &EtcdTarget {
        &self.target
    }

    /// `call` on a member, within [`ETCD_REQUEST_TIMEOUT`] each: the one that answered
    /// last, then each other in turn while a member cannot be reached, has no leader or
    /// does not answer. (A transaction that timed out may have run: a commit's
    /// compare-and-set makes trying it again safe.)
    pub async fn call<T, F, Fut>(&self, call: F) -> Result<T, StoreError>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let first = self.current.load(Ordering::Relaxed);
        let mut failures = Vec::new();
        for k in 0..self.members.len() {
            let i = (first + k) % self.members.len();
            let endpoint = &self.target.endpoints[i];
            match tokio::time::timeout(ETCD_REQUEST_TIMEOUT, call(self.members[i].clone())).await {
                Ok(Ok(value)) => {
                    self.current.store(i, Ordering::Relaxed);
                    return Ok(value);
                }
                Ok(Err(e)) if elsewhere(&e) => failures.push(format!("{endpoint}: {e}")),
                Ok(Err(e)) => return Err(refused(&self.target, e.to_string())),
                Err(_) => failures.push(format!(
                    "{endpoint}: no answer within {ETCD_REQUEST_TIMEOUT:?}"
                )),
            }
        }
        let failures = failures.join("; ");
        Err(unanswered(
            &self.target,
            format!("no member with quorum answered ({failures})"),
        ))
    }

    /// `get` of `key` (as [`Etcd::call`]).
    pub async fn get(
        &self,
        key: &str,
        options: Option<GetOptions>,
    ) -> Result<etcd_client::GetResponse, StoreError> {
        self.call(|mut client| {
            let options = options.clone();
            async move { client.get(key, options).await }
        })
        .await
    }

    /// Puts `value` at `key`, under `lease` if it is not 0 (as [`Etcd::call`]).
    pub async fn put(
        &self,
        key: &str,
        value: &[u8],
        lease: i64,
    ) -> Result<etcd_client::PutResponse, StoreError> {
        self.call(|mut client| async move {
            let options = etcd_client::PutOptions::new().with_lease(lease);
            client.put(key, value, Some(options)).await
        })
        .await
    }

    /// A new lease of `ttl_secs` seconds: its id.
    pub async fn grant(&self, ttl_secs: i64) -> Result<i64, StoreError> {
        let granted = self
            .call(|mut client| async move { client.lease_grant(ttl_secs, None).await })
            .await?;
        Ok(granted.id())
    }

    /// Renews `lease` once: its time to live, or `None` when it has expired.
    pub async fn keep_alive(&self, lease: i64) -> Result<Option<Duration>, StoreError> {
        let answer = self
            .call(|mut client| async move {
                let (mut keeper, mut answers) = client.lease_keep_alive(lease).await?;
                keeper.keep_alive().await?;
                answers.message().await
            })
            .await?;
        Ok(answer
            .filter(|a| a.ttl() > 0)
            .map(|a| Duration::from_secs(a.ttl().unsigned_abs())))
    }

    /// Revokes `lease` (its keys go with it).
    pub async fn revoke(&self, lease: i64) -> Result<(), StoreError> {
        self.call(|mut client| async move { client.lease_revoke(lease).await })
            .await
            .map(|_| ())
    }

    /// Runs transaction `txn` (as [`Etcd::call`]: one that timed out may have run).
    pub async fn txn(&self, txn: Txn) -> Result<etcd_client::TxnResponse, StoreError> {
        self.call(|mut client| {
            let txn = txn.clone();
            async move { client.txn(txn).await }
        })
        .await
    }

    /// A watch of every key under `prefix` changed after `revision`.
    pub async fn watch_prefix_after(
        &self,
        prefix: &str,
        revision: i64,
    ) -> Result<etcd_client::WatchStream, StoreError> {
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        self.watch(prefix, options).await
    }

    /// The keys a watch answer put (deletions left out).
    pub fn puts(answer: &etcd_client::WatchResponse) -> impl Iterator<Item = &KeyValue> {
        let puts = answer.events().iter();
        puts.filter(|e| e.event_type() == EventType::Put)
            .filter_map(|e| e.kv())
    }

    /// The next answer of watch `stream`: `None` when it ended, an error when etcd cancelled
    /// it or compacted past it (its watcher reads everything again and watches anew).
    pub async fn next_watched(
        stream: &mut etcd_client::WatchStream,
    ) -> Result<Option<etcd_client::WatchResponse>, StoreError> {
        let watch_error = |error: String| StoreError::Etcd {
            endpoints: "(watch)".to_owned(),
            error,
        };
        let Some(answer) = stream
            .message()
            .await
            .map_err(|e| watch_error(e.to_string()))?
        else {
            return Ok(None);
        };
        if answer.compact_revision() > 0 {
            return Err(watch_error("compacted past the watch".to_owned()));
        }
        if answer.canceled() {
            return Err(watch_error(format!(
                "watch canceled: {}",
                answer.cancel_reason()
            )));
        }
        Ok(Some(answer))
    }

    /// A watch of `key` on the member that answered last (moving on as [`Etcd::call`]).
    pub async fn watch(
        &self,
        key: &str,
        options: WatchOptions,
    ) -> Result<etcd_client::WatchStream, StoreError> {
        self.call(|mut client| {
            let options = options.clone();
            async move { client.watch(key, Some(options)).await }
        })
        .await
    }

    /// Moves requests to the next member (the current one broke a watch).
    fn next_member(&self) {
        let next = (self.current.load(Ordering::Relaxed) + 1) % self.members.len();
        self.current.store(next, Ordering::Relaxed);
    }
}

/// Whether a request that failed with `error` may go to another member: it did not reach
/// this one, or this one has no leader (it ran nothing).
fn elsewhere(error: &etcd_client::Error) -> bool {
    match error {
        etcd_client::Error::TransportError(_) => true,
        etcd_client::Error::GRpcStatus(status) => matches!(
            status.code(),
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
        ),
        _ => false,
    }
}

/// etcd at `target` refused a request, or cannot be used as given.
fn refused(target: &EtcdTarget, error: String) -> StoreError {
    StoreError::Etcd {
        endpoints: target.endpoints.join(","),
        error,
    }
}

/// No member of `target` answered.
fn unanswered(target: &EtcdTarget, error: String) -> StoreError {
    StoreError::EtcdUnanswered {
        endpoints: target.endpoints.join(","),
        error,
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
    /// The last generation not known to be this store's own commit (another daemon's, or
    /// one read back from etcd): a daemon elsewhere may be waiting for this host to apply it.
    foreign: u64,
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
    etcd: Etcd,
    keys: Keys,
    seen: watch::Sender<Arc<Seen<S>>>,
    /// This daemon's commits go one at a time: racing each other on the commit key they
    /// would only make each other try again.
    committing: tokio::sync::Mutex<()>,
    /// Why the copy stopped following etcd (an object that does not decode).
    failure: Arc<Mutex<Option<String>>>,
    /// The id of the commit this daemon is making (one at a time): the watch that sees it
    /// does not take it for another daemon's.
    in_flight: Arc<Mutex<Option<String>>>,
    watcher: tokio::task::JoinHandle<()>,
}

impl<S: Objects> std::fmt::Debug for EtcdStore<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("target", self.etcd.target())
            .field("generation", &self.generation())
            .finish_non_exhaustive()
    }
}

/// What the commit key holds: the last transaction, and an id its committer knows it by.
#[derive(serde::Serialize, serde::Deserialize)]
struct Record<C> {
    id: String,
    changes: Vec<C>,
}

impl<S: Objects> EtcdStore<S> {
    /// Connects, reads the configuration, and follows it from there.
    pub async fn open(target: EtcdTarget) -> Result<EtcdStore<S>, StoreError> {
        let etcd = Etcd::connect(&target).await?;
        let keys = Keys::new(&target.prefix());
        let seen = load::<S>(&etcd, &keys).await?;
        let (seen, _) = watch::channel(Arc::new(seen));
        let failure = Arc::new(Mutex::new(None));
        let in_flight = Arc::new(Mutex::new(None));
        let watcher = tokio::spawn(follow(
            etcd.clone(),
            keys.clone(),
            seen.clone(),
            failure.clone(),
            in_flight.clone(),
        ));
        Ok(EtcdStore {
            etcd,
            keys,
            seen,
            committing: tokio::sync::Mutex::new(()),
            failure,
            in_flight,
            watcher,
        })
    }

    /// Checks the changes in order against the configuration (all or none) and commits
    /// them as one etcd transaction; returns the new generation (its etcd revision). This
    /// daemon's commits are made one after another (no group commit: each is one etcd
    /// transaction, and etcd batches its own disk writes).
    pub async fn commit(&self, changes: Vec<S::Change>) -> Result<u64, CommitError<S::Error>> {
        if let Some(reason) = lock(&self.failure).clone() {
            return Err(CommitError::Store(StoreError::Diverged { reason }));
        }
        let id = uuid::Uuid::new_v4().to_string();
        let record = Record { id, changes };
        let _one_at_a_time = self.committing.lock().await;
        *lock(&self.in_flight) = Some(record.id.clone());
        let committed = self.commit_record(&record).await;
        *lock(&self.in_flight) = None;
        committed
    }

    /// [`EtcdStore::commit`] of `record`, tried again while other daemons commit first.
    async fn commit_record(
        &self,
        record: &Record<S::Change>,
    ) -> Result<u64, CommitError<S::Error>> {
        let encoded = serde_json::to_vec(record).map_err(|error| {
            CommitError::Store(StoreError::Encode {
                what: "transaction",
                error,
            })
        })?;
        for _ in 0..COMMIT_ATTEMPTS_MAX {
            let base = self.seen.borrow().clone();
            let mut next = base.state.clone();
            for change in &record.changes {
                next.check(change).map_err(CommitError::Rejected)?;
                next.apply(change);
            }
            let objects = next.objects();
            let mut writes = self.writes(&base.objects, &objects);
            writes.push(TxnOp::put(self.keys.commit.clone(), encoded.clone(), None));
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
            let answer = self
                .etcd
                .call(|mut client| {
                    let txn = txn.clone();
                    async move { client.txn(txn).await }
                })
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
                    foreign: base.foreign,
                };
                publish(&self.seen, seen);
                return Ok(generation);
            }
            // Another daemon committed first — or this transaction did, on a member that
            // did not answer in time: take the state from the answer.
            let Some(TxnOpResponse::Get(get)) = answer.op_responses().into_iter().next() else {
                continue;
            };
            let seen = decode::<S>(&self.keys, get.kvs(), revision)
                .map_err(|reason| CommitError::Store(StoreError::Diverged { reason }))?;
            let ours = get.kvs().iter().any(|kv| {
                kv.key() == self.keys.commit.as_bytes()
                    && record_id(kv.value()).as_ref() == Some(&record.id)
            });
            let generation = seen.generation;
            publish(&self.seen, seen);
            if ours {
                return Ok(generation);
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

    /// The last generation another daemon may wait for this host to apply: committed
    /// elsewhere, or not known to be this store's.
    pub fn foreign_generation(&self) -> u64 {
        self.seen.borrow().foreign
    }

    /// Tells each new generation seen here.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        let mut seen = self.seen.subscribe();
        let (tell, told) = watch::channel(seen.borrow_and_update().generation);
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

    /// The connection to etcd (for what the daemons keep beside the configuration).
    pub fn etcd(&self) -> &Etcd {
        &self.etcd
    }
}

impl<S: Objects> Drop for EtcdStore<S> {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

/// The id of commit record `value`.
fn record_id(value: &[u8]) -> Option<String> {
    serde_json::from_slice::<Record<serde::de::IgnoredAny>>(value)
        .ok()
        .map(|record| record.id)
}

/// Whether commit record `value` is the one this daemon is making (decoded only when one is).
fn is_in_flight(value: &[u8], in_flight: &Mutex<Option<String>>) -> bool {
    lock(in_flight)
        .as_deref()
        .is_some_and(|id| record_id(value).as_deref() == Some(id))
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

/// Reads the whole configuration.
async fn load<S: Objects>(etcd: &Etcd, keys: &Keys) -> Result<Seen<S>, StoreError> {
    let answer = etcd
        .call(|mut client| async move {
            let options = GetOptions::new().with_prefix();
            client.get(keys.config.as_str(), Some(options)).await
        })
        .await?;
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
        foreign: generation,
    })
}

/// Keeps `seen` up to date with etcd until the store is dropped.
async fn follow<S: Objects>(
    etcd: Etcd,
    keys: Keys,
    seen: watch::Sender<Arc<Seen<S>>>,
    failure: Arc<Mutex<Option<String>>>,
    in_flight: Arc<Mutex<Option<String>>>,
) {
    let mut backoff = REWATCH_BACKOFF_MIN;
    loop {
        let from = seen.borrow().revision + 1;
        let why = match watch_from(&etcd, &keys, &seen, &in_flight, from).await {
            Ok(()) => "the watch ended".to_owned(),
            Err(Broken::Compacted) => {
                // The changes since `from` are gone: read everything again.
                match load::<S>(&etcd, &keys).await {
                    Ok(loaded) => {
                        publish(&seen, loaded);
                        continue;
                    }
                    Err(e) => e.to_string(),
                }
            }
            Err(Broken::Undecodable(reason)) => {
                tracing::error!(%reason, "the configuration in etcd does not decode; no more commits");
                *lock(&failure) = Some(reason);
                return;
            }
            Err(Broken::Etcd(e)) => e,
        };
        tracing::warn!(why = %why, ?backoff, "watching the configuration in etcd again");
        etcd.next_member();
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(REWATCH_BACKOFF_MAX);
        if let Ok(loaded) = load::<S>(&etcd, &keys).await {
            publish(&seen, loaded);
            backoff = REWATCH_BACKOFF_MIN;
        }
    }
}

#[derive(Debug)]
enum Broken {
    Compacted,
    Undecodable(String),
    Etcd(String),
}

/// Applies the configuration's changes from revision `from` to `seen` as they come.
async fn watch_from<S: Objects>(
    etcd: &Etcd,
    keys: &Keys,
    seen: &watch::Sender<Arc<Seen<S>>>,
    in_flight: &Mutex<Option<String>>,
    from: i64,
) -> Result<(), Broken> {
    let options = WatchOptions::new()
        .with_prefix()
        .with_start_revision(from)
        .with_progress_notify();
    let mut stream = etcd
        .watch(&keys.config, options)
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
        let mut foreign = now.foreign;
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
                if !is_in_flight(kv.value(), in_flight) {
                    foreign = generation;
                }
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
                foreign,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::etcd_server::EtcdServer;
    use crate::store::test_state::{Map, set};

    /// A store on a one-member etcd of its own, and a client and the keys to look under it.
    struct Fixture {
        store: EtcdStore<Map>,
        etcd: Etcd,
        keys: Keys,
        _server: EtcdServer,
        _dir: tempfile::TempDir,
    }

    /// Waits (at most 10 s) until the copy `told` follows has seen generation `generation`.
    async fn seen_up_to(told: &mut watch::Receiver<Arc<Seen<Map>>>, generation: u64) {
        tokio::time::timeout(
            Duration::from_secs(10),
            told.wait_for(|s| s.generation >= generation),
        )
        .await
        .expect("caught up within 10 s")
        .expect("the copy is alive");
    }

    impl Fixture {
        async fn start(test: &str) -> Option<Fixture> {
            let dir = tempfile::tempdir().expect("tempdir");
            let server = EtcdServer::single_for_test(test, &dir.path().join("member"))?;
            let target = server.target(test);
            Some(Fixture {
                store: EtcdStore::open(target.clone()).await.expect("open"),
                etcd: Etcd::connect(&target).await.expect("connect"),
                keys: Keys::new(&target.prefix()),
                _server: server,
                _dir: dir,
            })
        }
    }

    /// The watch that sees this daemon's commit in flight does not take it for another's;
    /// the same commit seen with none in flight is another daemon's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_watch_knows_the_commit_in_flight_as_its_own() {
        let Some(fixture) = Fixture::start("the_watch_knows_the_commit_in_flight_as_its_own").await
        else {
            return;
        };
        let (store, etcd, keys) = (&fixture.store, &fixture.etcd, &fixture.keys);
        let behind = Arc::new(load::<Map>(etcd, keys).await.expect("load"));
        let committed = store.commit(vec![set("a", "1")]).await.expect("commit");
        let commit_key = keys.commit.clone();
        let answer = etcd
            .call(|mut client| {
                let key = commit_key.clone();
                async move { client.get(key, None).await }
            })
            .await
            .expect("get");
        let id = record_id(answer.kvs()[0].value()).expect("a commit record");

        for (in_flight, foreign) in [(Some(id), behind.foreign), (None, committed)] {
            let (seen, mut told) = watch::channel(behind.clone());
            let in_flight = Mutex::new(in_flight);
            let from = behind.revision + 1;
            tokio::select! {
                ended = watch_from(etcd, keys, &seen, &in_flight, from) => {
                    panic!("the watch ended: {ended:?}")
                }
                () = seen_up_to(&mut told, committed) => {}
            }
            assert_eq!(seen.borrow().foreign, foreign);
        }
    }

    /// A copy that fell behind a compaction (its daemon's watch broke while etcd compacted
    /// the revisions it had not seen) cannot be caught up change by change: it reads the
    /// whole configuration again, and follows from there.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_copy_behind_a_compaction_reads_everything_again() {
        let Some(fixture) =
            Fixture::start("a_copy_behind_a_compaction_reads_everything_again").await
        else {
            return;
        };
        let (store, etcd, keys) = (&fixture.store, &fixture.etcd, &fixture.keys);
        // A copy as it was before three commits.
        let behind = load::<Map>(etcd, keys).await.expect("load");
        let from = behind.revision + 1;
        let mut last = 0;
        for key in ["a", "b", "c"] {
            last = store.commit(vec![set(key, "1")]).await.expect("commit");
        }
        let revision = i64::try_from(last).expect("revision");
        etcd.call(|mut client| async move { client.compact(revision, None).await })
            .await
            .expect("compact");

        let (seen, mut told) = watch::channel(Arc::new(behind));
        let in_flight = Mutex::new(None);
        let broken = watch_from(etcd, keys, &seen, &in_flight, from).await;
        assert!(matches!(broken, Err(Broken::Compacted)), "{broken:?}");

        let follower = tokio::spawn(follow(
            etcd.clone(),
            keys.clone(),
            seen.clone(),
            Arc::new(Mutex::new(None)),
            Arc::new(in_flight),
        ));
        seen_up_to(&mut told, last).await;
        assert_eq!(seen.borrow().state.0.len(), 3);
        assert_eq!(
            seen.borrow().foreign,
            last,
            "read back: not known to be its own"
        );
        // And it follows from there.
        let next = store.commit(vec![set("d", "1")]).await.expect("commit");
        seen_up_to(&mut told, next).await;
        assert_eq!(seen.borrow().state.0.len(), 4);
        follower.abort();
    }
}
