//! Which hosts are a cluster's members, and how a host becomes one (`kiln cluster init`,
//! `token`, `join`, `leave`). The protocol of a join — tokens, sealed messages, what is
//! signed — is `kiln_admin::join`; here is how it travels through etcd:
//!
//! ```text
//! <prefix>members/<host>   a member host: written by `init` and by its daemon when it starts
//!                          on etcd, deleted by `leave`
//! <prefix>joins/<id>       a joining host's request (`JoinRequest`), one per token, under a
//!                          lease that outlives the joiner's wait
//! <prefix>joined/<id>      the answer (`JoinAnswer`), under the request's lease; written only
//!                          while the request is there, unchanged
//! <prefix>used/<id>        a token that was used, until it expires: a grant is written in one
//!                          transaction with it, so a token joins one host once
//! ```
//!
//! Every daemon that holds the CA's key answers requests ([`answer_joins_forever`]); the first
//! transaction wins, and a daemon that cannot decide (its own CA files unreadable) leaves the
//! request to the others. A host's choice of store is its state directory's `cluster.json`
//! ([`ClusterFile`]), which `init` and `join` write and `leave` removes.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use etcd_client::{
    Compare, CompareOp, GetOptions, KeyValue, PutOptions, Txn, TxnOp, TxnOpResponse, WatchOptions,
};
use kiln_admin::join::{JoinAnswer, JoinClaim, JoinError, JoinGrant, JoinRequest, Sealed, Token};
use kiln_admin::pki::{self, PkiError, Role};
use serde::{Deserialize, Serialize};

use crate::store::etcd::{Etcd, EtcdTarget};

/// The file in a daemon's state directory naming the cluster it belongs to.
pub const CLUSTER_FILE: &str = "cluster.json";
/// How long a joining host waits for a host of the cluster to answer.
pub const JOIN_ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a join request and its answer stay in etcd, in seconds (beyond the joiner's wait,
/// so a joiner that died leaves nothing behind for long).
const JOIN_KEYS_TTL_SECS: i64 = 120;
/// Longest reason a refusal gives, in bytes.
const REFUSAL_MAX_BYTES: usize = 200;

/// The cluster a host's daemon belongs to, as its state directory records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterFile {
    pub cluster: String,
    /// The etcd members' client URLs.
    pub etcd: Vec<String>,
    /// This host's name in the cluster.
    pub host: String,
}

impl ClusterFile {
    /// The cluster file of `state_dir`, if this host belongs to a cluster on etcd.
    pub fn load(state_dir: &Path) -> anyhow::Result<Option<ClusterFile>> {
        let path = state_dir.join(CLUSTER_FILE);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .with_context(|| format!("{} is not a cluster file", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
        }
    }

    fn save(&self, state_dir: &Path) -> anyhow::Result<()> {
        let json = serde_json::to_vec_pretty(self).expect("a cluster file encodes");
        kiln_admin::durable::private_dir(state_dir)?;
        kiln_admin::durable::replace_file(&state_dir.join(CLUSTER_FILE), &json, 0o600)?;
        Ok(())
    }

    /// Forgets the cluster: the daemon starts on the embedded store next time.
    pub fn remove(state_dir: &Path) -> anyhow::Result<()> {
        let path = state_dir.join(CLUSTER_FILE);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(e).with_context(|| format!("cannot remove {}", path.display()))
            }
            _ => Ok(()),
        }
    }

    pub fn target(&self) -> EtcdTarget {
        EtcdTarget {
            endpoints: self.etcd.clone(),
            cluster: self.cluster.clone(),
        }
    }

    /// Refuses when `state_dir` records a cluster already.
    fn refuse_second(state_dir: &Path) -> anyhow::Result<()> {
        match ClusterFile::load(state_dir)? {
            Some(current) => bail!(
                "this host is a member of cluster {} already (`kiln cluster leave` first)",
                current.cluster
            ),
            None => Ok(()),
        }
    }
}

/// The keys of members and joins.
struct MemberKeys {
    prefix: String,
}

impl MemberKeys {
    fn of(etcd: &Etcd) -> MemberKeys {
        MemberKeys {
            prefix: etcd.target().prefix(),
        }
    }
    fn members_prefix(&self) -> String {
        format!("{}members/", self.prefix)
    }
    fn member(&self, host: &str) -> String {
        format!("{}{host}", self.members_prefix())
    }
    fn requests_prefix(&self) -> String {
        format!("{}joins/", self.prefix)
    }
    fn request(&self, id: &str) -> String {
        format!("{}{id}", self.requests_prefix())
    }
    fn answer(&self, id: &str) -> String {
        format!("{}joined/{id}", self.prefix)
    }
    fn used(&self, id: &str) -> String {
        format!("{}used/{id}", self.prefix)
    }
    fn revoked_prefix(&self) -> String {
        format!("{}revoked/", self.prefix)
    }
}

/// `kiln cluster init --etcd`: makes this host the first member of `file.cluster` — its CA
/// made (if it has none) and recorded as the cluster's, the host a member — and records the
/// cluster in `state_dir` for the daemon.
pub async fn init(state_dir: &Path, file: &ClusterFile) -> anyhow::Result<()> {
    ClusterFile::refuse_second(state_dir)?;
    let tls_dir = state_dir.join("tls");
    if !pki::ca_files(&tls_dir).cert.exists() {
        pki::init_ca(&tls_dir)?;
    }
    let etcd = Etcd::connect(&file.target()).await?;
    crate::cluster::check_ca(&etcd, &tls_dir).await?;
    register(&etcd, &file.host).await?;
    file.save(state_dir)
}

/// Records `host` as a member (a no-op when it is one).
pub async fn register(etcd: &Etcd, host: &str) -> anyhow::Result<()> {
    let key = MemberKeys::of(etcd).member(host);
    let put_if_new = Txn::new()
        .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
        .and_then([TxnOp::put(key, "{}", None)]);
    etcd.txn(put_if_new).await?;
    Ok(())
}

/// The member hosts, by name.
pub async fn members(etcd: &Etcd) -> anyhow::Result<Vec<String>> {
    names_under(etcd, &MemberKeys::of(etcd).members_prefix()).await
}

/// The serial numbers of the client certificates of hosts that left (as `auth.revoked`
/// lists them): every volume refuses them.
pub async fn revoked(etcd: &Etcd) -> anyhow::Result<Vec<String>> {
    names_under(etcd, &MemberKeys::of(etcd).revoked_prefix()).await
}

/// The names of the keys under `prefix`, without it.
async fn names_under(etcd: &Etcd, prefix: &str) -> anyhow::Result<Vec<String>> {
    let options = GetOptions::new().with_prefix().with_keys_only();
    let answer = etcd.get(prefix, Some(options)).await?;
    Ok(answer
        .kvs()
        .iter()
        .filter_map(|kv| kv.key_str().ok()?.strip_prefix(prefix).map(str::to_owned))
        .collect())
}

/// Records that the client certificate with `serial`, of `host`, is revoked: volumes created
/// from now on refuse it ([`revoked`]).
pub async fn revoke(etcd: &Etcd, serial: &str, host: &str) -> anyhow::Result<()> {
    let key = format!("{}{serial}", MemberKeys::of(etcd).revoked_prefix());
    etcd.put(&key, host.as_bytes(), 0).await?;
    Ok(())
}

/// `kiln cluster leave`: `host` is no longer a member, and its report is gone.
pub async fn leave(etcd: &Etcd, host: &str) -> anyhow::Result<()> {
    let both = Txn::new().and_then([
        TxnOp::delete(MemberKeys::of(etcd).member(host), None),
        TxnOp::delete(crate::cluster::host_key(etcd, host), None),
    ]);
    etcd.txn(both).await?;
    Ok(())
}

// The joining host's side.

/// `kiln cluster join`: asks the cluster `token` names, through the etcd members `via`, to
/// take this host in as `host`, its bricks reached at `names`; installs the CA's certificate
/// and the host's certificates (its keys made here) and records the cluster in `state_dir`.
pub async fn join(
    state_dir: &Path,
    via: Vec<String>,
    token: &Token,
    host: &str,
    names: Vec<String>,
) -> anyhow::Result<ClusterFile> {
    ClusterFile::refuse_second(state_dir)?;
    if token.has_expired() {
        bail!("the token has expired: ask for a new one (`kiln cluster token`)");
    }
    let tls_dir = state_dir.join("tls");
    if pki::holds_ca_key(&tls_dir) {
        bail!(
            "{} holds a CA of its own (a single-host daemon made it): move it away to join \
             cluster {}",
            tls_dir.display(),
            token.cluster
        );
    }
    let (brick_key, brick_csr) = pki::request(pki::HOST_IDENTITY)?;
    let (client_key, client_csr) = pki::request(pki::ADMIN_CLIENT)?;
    let claim = JoinClaim {
        host: host.to_owned(),
        names: names.clone(),
        brick_csr,
        client_csr,
    };
    claim.check()?;
    let etcd = Etcd::connect(&EtcdTarget {
        endpoints: via,
        cluster: token.cluster.clone(),
    })
    .await?;
    refuse_other_ca(&etcd, &tls_dir).await?;
    let sealed = token.seal("claim", &claim);
    let grant: JoinGrant = match ask(&etcd, token, &sealed).await? {
        JoinAnswer::Granted(grant) => token.open("grant", &grant)?,
        JoinAnswer::Refused(reason) => bail!("cluster {} refused: {reason}", token.cluster),
    };
    if grant.claim != sealed.digest() {
        bail!("the cluster's grant answers another request: join again with a new token");
    }
    pki::install_ca_cert(&tls_dir, &grant.ca_cert)?;
    let role = Role::Brick { hosts: names };
    pki::install(
        &tls_dir,
        &role,
        pki::HOST_IDENTITY,
        &brick_key,
        &grant.host_cert,
    )?;
    pki::install(
        &tls_dir,
        &Role::Client,
        pki::ADMIN_CLIENT,
        &client_key,
        &grant.client_cert,
    )?;
    if !pki::is_current(&tls_dir, &role, pki::HOST_IDENTITY)
        || !pki::is_current(&tls_dir, &Role::Client, pki::ADMIN_CLIENT)
    {
        bail!("the certificates the cluster granted do not fit this host's keys and names");
    }
    let file = ClusterFile {
        cluster: grant.cluster,
        etcd: grant.endpoints,
        host: host.to_owned(),
    };
    file.save(state_dir)?;
    Ok(file)
}

/// Refuses before asking when this host keeps another CA than the one the cluster recorded
/// (a grant it could not install would use its token up).
async fn refuse_other_ca(etcd: &Etcd, tls_dir: &Path) -> anyhow::Result<()> {
    let Ok(held) = std::fs::read(pki::ca_files(tls_dir).cert) else {
        return Ok(());
    };
    let recorded = etcd.get(&crate::cluster::ca_key(etcd), None).await?;
    match recorded.kvs().first() {
        Some(kv) if kv.value() != held => Err(PkiError::OtherCa(pki::ca_files(tls_dir).cert))?,
        _ => Ok(()),
    }
}

/// Posts the join request of `claim` and waits for the answer; both keys are removed after.
async fn ask(etcd: &Etcd, token: &Token, claim: &Sealed) -> anyhow::Result<JoinAnswer> {
    let keys = MemberKeys::of(etcd);
    let (request_key, answer_key) = (keys.request(&token.id), keys.answer(&token.id));
    let request = JoinRequest {
        token_id: token.id.clone(),
        expires: token.expires,
        claim: claim.clone(),
    };
    let json = serde_json::to_vec(&request).expect("a request encodes");
    let lease = etcd.grant(JOIN_KEYS_TTL_SECS).await?;
    let post = Txn::new()
        .when([
            Compare::create_revision(request_key.clone(), CompareOp::Equal, 0),
            Compare::create_revision(answer_key.clone(), CompareOp::Equal, 0),
        ])
        .and_then([TxnOp::put(
            request_key.clone(),
            json.clone(),
            Some(PutOptions::new().with_lease(lease)),
        )])
        .or_else([TxnOp::get(request_key.clone(), None)]);
    let posted = etcd.txn(post).await?;
    // A post that timed out on one member may have run before it ran again on another: the
    // request there, ours to the byte, is ours.
    let ours = posted.succeeded()
        || posted.op_responses().iter().any(|op| {
            matches!(op, TxnOpResponse::Get(get) if get.kvs().first().is_some_and(|kv| kv.value() == json))
        });
    if !ours {
        bail!("a join with this token is under way or done: ask for a new token");
    }
    let revision = posted.header().map_or(0, |h| h.revision());
    let answer = wait_for_answer(etcd, &answer_key, revision).await;
    let forget = Txn::new().and_then([
        TxnOp::delete(request_key, None),
        TxnOp::delete(answer_key, None),
    ]);
    let _ = etcd.txn(forget).await;
    answer
}

async fn wait_for_answer(etcd: &Etcd, key: &str, after: i64) -> anyhow::Result<JoinAnswer> {
    // From the revision of the post on: an answer written since is in the watch.
    let options = WatchOptions::new().with_start_revision(after);
    let mut changes = etcd.watch(key, options).await?;
    let deadline = Instant::now() + JOIN_ANSWER_TIMEOUT;
    loop {
        let next = tokio::time::timeout_at(deadline.into(), Etcd::next_watched(&mut changes));
        let message = match next.await {
            Err(_) => bail!(
                "no host of the cluster answered within {} s: is kiln-mgmtd running on a \
                 host that holds the cluster CA's key?",
                JOIN_ANSWER_TIMEOUT.as_secs()
            ),
            Ok(Ok(Some(message))) => message,
            Ok(Ok(None)) => bail!("etcd ended the watch for the answer"),
            Ok(Err(e)) => return Err(e).context("watching for the cluster's answer"),
        };
        for kv in Etcd::puts(&message) {
            match serde_json::from_slice(kv.value()) {
                Ok(answer) => return Ok(answer),
                Err(e) => tracing::warn!(error = %e, "an answer that is not one; waiting on"),
            }
        }
    }
}

// The answering hosts' side.

/// Answers join requests while the daemon runs (on a host that holds the CA's key): those
/// waiting now, then each new one; a broken watch is made again.
pub async fn answer_joins_forever(etcd: Etcd, tls_dir: PathBuf, host: String) {
    loop {
        if let Err(e) = answer_joins(&etcd, &tls_dir, &host).await {
            tracing::warn!(error = %format!("{e:#}"), "answering join requests");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn answer_joins(etcd: &Etcd, tls_dir: &Path, host: &str) -> anyhow::Result<()> {
    let prefix = MemberKeys::of(etcd).requests_prefix();
    let waiting = etcd
        .get(&prefix, Some(GetOptions::new().with_prefix()))
        .await?;
    for kv in waiting.kvs() {
        answer_logged(etcd, tls_dir, host, kv).await;
    }
    let revision = waiting.header().map_or(0, |h| h.revision());
    let mut changes = etcd.watch_prefix_after(&prefix, revision).await?;
    while let Some(message) = Etcd::next_watched(&mut changes).await? {
        for kv in Etcd::puts(&message) {
            answer_logged(etcd, tls_dir, host, kv).await;
        }
    }
    bail!("the watch of join requests ended")
}

/// [`answer_one`], its failure logged: one request never holds up the others.
async fn answer_logged(etcd: &Etcd, tls_dir: &Path, issuer: &str, request: &KeyValue) {
    if let Err(e) = answer_one(etcd, tls_dir, issuer, request).await {
        let key = String::from_utf8_lossy(request.key());
        tracing::warn!(%key, error = %format!("{e:#}"), "a join request left unanswered");
    }
}

/// What this host decides on a request.
enum Decision {
    /// The sealed grant, the host it is for, and when its token expires.
    Grant(Sealed, String, u64),
    Refuse(String),
}

/// Answers `request`: granted (in one transaction with the token's use, so a token joins one
/// host once) or refused with the reason — either only while the request is there unchanged
/// and unanswered (a joiner that gave up takes nothing).
async fn answer_one(
    etcd: &Etcd,
    tls_dir: &Path,
    issuer: &str,
    request: &KeyValue,
) -> anyhow::Result<()> {
    let keys = MemberKeys::of(etcd);
    let prefix = keys.requests_prefix();
    let Some(id) = request.key_str().ok().and_then(|k| k.strip_prefix(&prefix)) else {
        return Ok(());
    };
    let answer_key = keys.answer(id);
    if !etcd.get(&answer_key, None).await?.kvs().is_empty() {
        return Ok(());
    }
    let members = members(etcd).await?;
    let decision = tokio::task::block_in_place(|| {
        decide(etcd.target(), tls_dir, id, request.value(), &members)
    })?;
    let unchanged = [
        Compare::mod_revision(request.key(), CompareOp::Equal, request.mod_revision()),
        Compare::create_revision(answer_key.clone(), CompareOp::Equal, 0),
    ];
    let lease = PutOptions::new().with_lease(request.lease());
    let put_answer = |answer: &JoinAnswer| {
        let json = serde_json::to_vec(answer).expect("an answer encodes");
        TxnOp::put(answer_key.clone(), json, Some(lease.clone()))
    };
    let refusal = match decision {
        Decision::Refuse(reason) => reason,
        Decision::Grant(grant, host, expires) => {
            let used_for_secs = expires.saturating_sub(kiln_admin::join::unix_now()) + 60;
            let used_lease = etcd
                .grant(i64::try_from(used_for_secs).unwrap_or(i64::MAX))
                .await?;
            let mut when = unchanged.to_vec();
            when.push(Compare::create_revision(keys.used(id), CompareOp::Equal, 0));
            when.push(Compare::create_revision(
                keys.member(&host),
                CompareOp::Equal,
                0,
            ));
            let grant_txn = Txn::new().when(when).and_then([
                put_answer(&JoinAnswer::Granted(grant)),
                TxnOp::put(
                    keys.used(id),
                    host.as_str(),
                    Some(PutOptions::new().with_lease(used_lease)),
                ),
            ]);
            if etcd.txn(grant_txn).await?.succeeded() {
                tracing::info!(%host, %issuer, "granted a host's join");
                return Ok(());
            }
            if !etcd.get(&keys.member(&host), None).await?.kvs().is_empty() {
                format!("host {host} is a member already: `kiln cluster leave` on it first")
            } else if !etcd.get(&keys.used(id), None).await?.kvs().is_empty() {
                "the token was used already: ask for a new one".to_owned()
            } else {
                return Ok(()); // answered meanwhile, or the joiner gave up
            }
        }
    };
    let refuse = Txn::new()
        .when(unchanged)
        .and_then([put_answer(&JoinAnswer::Refused(refusal))]);
    etcd.txn(refuse).await?;
    Ok(())
}

/// This host's decision on the request `value` for token `id`: a refusal for what is wrong
/// with the request (in a few words, none of them the request's), an error for what is
/// wrong here (another host may decide).
fn decide(
    target: &EtcdTarget,
    tls_dir: &Path,
    id: &str,
    value: &[u8],
    members: &[String],
) -> anyhow::Result<Decision> {
    let refuse = |reason: &str| {
        let mut reason = reason.to_owned();
        if reason.len() > REFUSAL_MAX_BYTES {
            let cut = (0..=REFUSAL_MAX_BYTES)
                .rev()
                .find(|&i| reason.is_char_boundary(i))
                .unwrap_or(0);
            reason.truncate(cut);
        }
        Ok(Decision::Refuse(reason))
    };
    let Ok(request) = serde_json::from_slice::<JoinRequest>(value) else {
        return refuse("the request is not a join request");
    };
    if request.token_id != id {
        return refuse("the request names another token than its key");
    }
    let token = Token::of_ca(tls_dir, &target.cluster, id, request.expires)
        .context("deriving the token from this host's CA key")?;
    let claim: JoinClaim = match token.open("claim", &request.claim) {
        Ok(claim) => claim,
        Err(JoinError::BadSeal) => return refuse(&JoinError::BadSeal.to_string()),
        Err(_) => return refuse("the claim cannot be decoded"),
    };
    // (Checked after the seal: only a token's holder learns that it expired.)
    if token.has_expired() {
        return refuse("the token has expired: ask for a new one");
    }
    if let Err(e) = claim.check() {
        return refuse(&e.to_string());
    }
    let loopback = |name: &str| {
        name == "localhost"
            || name
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    };
    if let Some(taken) = claim
        .names
        .iter()
        .find(|name| **name != claim.host && !loopback(name) && members.contains(name))
    {
        return refuse(&format!("{taken} is the name of another member"));
    }
    let days = pki::CERT_VALIDITY_DAYS;
    let role = Role::Brick {
        hosts: claim.names.clone(),
    };
    let sign = |role: &Role, name: &str, csr: &str| match pki::sign_request(
        tls_dir, role, name, csr, days,
    ) {
        Ok(cert) => Ok(Ok(cert)),
        Err(PkiError::Generate(_) | PkiError::BadHost(_)) => Ok(Err(())),
        Err(e) => Err(e),
    };
    let (Ok(host_cert), Ok(client_cert)) = (
        sign(&role, pki::HOST_IDENTITY, &claim.brick_csr)?,
        sign(&Role::Client, pki::ADMIN_CLIENT, &claim.client_csr)?,
    ) else {
        return refuse("a signing request is not one, or its signature does not hold");
    };
    let grant = JoinGrant {
        cluster: target.cluster.clone(),
        endpoints: target.endpoints.clone(),
        ca_cert: std::fs::read_to_string(pki::ca_files(tls_dir).cert)
            .context("this host's CA certificate")?,
        host_cert,
        client_cert,
        claim: request.claim.digest(),
    };
    Ok(Decision::Grant(
        token.seal("grant", &grant),
        claim.host,
        request.expires,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::etcd_server::EtcdServer;

    struct Fixture {
        etcd: Etcd,
        tls: PathBuf,
        _server: EtcdServer,
        _dir: tempfile::TempDir,
    }

    impl Fixture {
        async fn start(test: &str) -> Option<Fixture> {
            let dir = tempfile::tempdir().expect("tempdir");
            let server = EtcdServer::single_for_test(test, &dir.path().join("member"))?;
            let etcd = Etcd::connect(&server.target("m")).await.expect("connect");
            let tls = dir.path().join("tls");
            pki::init_ca(&tls).expect("ca");
            Some(Fixture {
                etcd,
                tls,
                _server: server,
                _dir: dir,
            })
        }

        /// Puts `value` as the request of token `id` and answers it; the answer, if any.
        async fn answer(&self, id: &str, value: &[u8]) -> Option<JoinAnswer> {
            let keys = MemberKeys::of(&self.etcd);
            self.etcd
                .put(&keys.request(id), value, 0)
                .await
                .expect("put");
            let request = self.etcd.get(&keys.request(id), None).await.expect("get");
            let request = request.kvs().first().expect("the request");
            answer_one(&self.etcd, &self.tls, "issuer", request)
                .await
                .expect("answered");
            let answer = self.etcd.get(&keys.answer(id), None).await.expect("get");
            answer
                .kvs()
                .first()
                .map(|kv| serde_json::from_slice(kv.value()).expect("an answer"))
        }
    }

    fn claim(host: &str) -> JoinClaim {
        let (_, brick_csr) = pki::request(pki::HOST_IDENTITY).expect("request");
        let (_, client_csr) = pki::request(pki::ADMIN_CLIENT).expect("request");
        JoinClaim {
            host: host.to_owned(),
            names: vec![host.to_owned()],
            brick_csr,
            client_csr,
        }
    }

    fn refused(answer: Option<JoinAnswer>) -> String {
        match answer {
            Some(JoinAnswer::Refused(reason)) => reason,
            other => panic!("not refused: {other:?}"),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hostile_requests_are_refused_briefly_and_a_token_grants_once() {
        let Some(f) = Fixture::start("hostile_join_requests").await else {
            return;
        };
        // Not JSON, a huge value, a forged seal: refused in a few words, nothing repeated.
        let said = refused(f.answer("0000000000000001", b"\xff not json").await);
        assert_eq!(said, "the request is not a join request");
        let huge = vec![b'x'; 1 << 20];
        let said = refused(f.answer("0000000000000002", &huge).await);
        assert!(said.len() <= REFUSAL_MAX_BYTES, "{said}");
        let token = Token::new(&f.tls, "m", Duration::from_secs(600)).expect("token");
        let forged = JoinRequest {
            token_id: token.id.clone(),
            expires: token.expires,
            claim: Sealed {
                body: serde_json::to_string(&claim("10.0.0.9")).expect("json"),
                tag: "00".repeat(32),
            },
        };
        let json = serde_json::to_vec(&forged).expect("json");
        let said = refused(f.answer(&token.id, &json).await);
        assert!(said.contains("seal does not match"), "{said}");

        // A real one is granted once; the same token again is refused as used.
        let real = |host: &str| JoinRequest {
            token_id: token.id.clone(),
            expires: token.expires,
            claim: token.seal("claim", &claim(host)),
        };
        let keys = MemberKeys::of(&f.etcd);
        let forget = |id: String| {
            let etcd = f.etcd.clone();
            let keys = MemberKeys::of(&f.etcd);
            async move {
                let both = Txn::new().and_then([
                    TxnOp::delete(keys.request(&id), None),
                    TxnOp::delete(keys.answer(&id), None),
                ]);
                etcd.txn(both).await.expect("delete");
            }
        };
        forget(token.id.clone()).await;
        let json = serde_json::to_vec(&real("10.0.0.2")).expect("json");
        match f.answer(&token.id, &json).await {
            Some(JoinAnswer::Granted(grant)) => {
                let grant: JoinGrant = token.open("grant", &grant).expect("sealed");
                assert_eq!(grant.cluster, "m");
            }
            other => panic!("{other:?}"),
        }
        assert!(
            !f.etcd
                .get(&keys.used(&token.id), None)
                .await
                .expect("get")
                .kvs()
                .is_empty()
        );
        forget(token.id.clone()).await;
        let json = serde_json::to_vec(&real("10.0.0.3")).expect("json");
        let said = refused(f.answer(&token.id, &json).await);
        assert!(said.contains("used already"), "{said}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_withdrawn_before_its_answer_gets_none() {
        let Some(f) = Fixture::start("a_request_withdrawn").await else {
            return;
        };
        let token = Token::new(&f.tls, "m", Duration::from_secs(600)).expect("token");
        let request = JoinRequest {
            token_id: token.id.clone(),
            expires: token.expires,
            claim: token.seal("claim", &claim("10.0.0.4")),
        };
        let keys = MemberKeys::of(&f.etcd);
        let json = serde_json::to_vec(&request).expect("json");
        f.etcd
            .put(&keys.request(&token.id), &json, 0)
            .await
            .expect("put");
        let read = f
            .etcd
            .get(&keys.request(&token.id), None)
            .await
            .expect("get");
        let read = read.kvs().first().expect("the request").clone();
        // The joiner gives up (deletes its request) before the answer is written.
        let gone = Txn::new().and_then([TxnOp::delete(keys.request(&token.id), None)]);
        f.etcd.txn(gone).await.expect("delete");
        answer_one(&f.etcd, &f.tls, "issuer", &read)
            .await
            .expect("answered");
        let answer = f
            .etcd
            .get(&keys.answer(&token.id), None)
            .await
            .expect("get");
        assert!(answer.kvs().is_empty(), "answered a withdrawn request");
        let used = f.etcd.get(&keys.used(&token.id), None).await.expect("get");
        assert!(
            used.kvs().is_empty(),
            "the token of a withdrawn request was used"
        );
    }
}
