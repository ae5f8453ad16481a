//! Which hosts are a cluster's members, and how a host becomes one (`kiln cluster init`,
//! `token`, `join`, `leave`). The protocol of a join — tokens, sealed messages, what is
//! signed — is `kiln_admin::join`; here is how it travels through etcd:
//!
//! ```text
//! <prefix>members/<host>   a member host: written by `init` and by a granted join (and by a
//!                          daemon started on etcd, for clusters made before joins existed),
//!                          deleted by `leave`
//! <prefix>tokens/<id>      an unused join token, under a lease of its lifetime
//! <prefix>joins/<id>       a joining host's request (`JoinRequest`), one per token
//! <prefix>joined/<id>      the answer (`JoinAnswer`); a grant is written in the transaction
//!                          that deletes the token and adds the member: a token joins once
//! ```
//!
//! Every daemon that holds the CA's key answers requests ([`answer_joins_forever`]); the first
//! transaction wins. A host's choice of store is its state directory's `cluster.json`
//! ([`ClusterFile`]), which `init` and `join` write and `leave` removes.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchOptions,
};
use kiln_admin::join::{JoinAnswer, JoinClaim, JoinGrant, JoinRequest, Token};
use kiln_admin::pki::{self, Role};
use serde::{Deserialize, Serialize};

use crate::store::etcd::{Etcd, EtcdTarget};

/// The file in a daemon's state directory naming the cluster it belongs to.
pub const CLUSTER_FILE: &str = "cluster.json";
/// How long a joining host waits for a host of the cluster to answer.
pub const JOIN_ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a join token is valid unless asked otherwise.
pub const TOKEN_VALIDITY: Duration = Duration::from_secs(3600);
/// Longest a join token may be valid.
pub const TOKEN_VALIDITY_MAX: Duration = Duration::from_secs(7 * 24 * 3600);

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
}

struct Keys {
    prefix: String,
}

impl Keys {
    fn of(etcd: &Etcd) -> Keys {
        Keys {
            prefix: etcd.target().prefix(),
        }
    }
    fn member(&self, host: &str) -> String {
        format!("{}members/{host}", self.prefix)
    }
    fn members(&self) -> String {
        format!("{}members/", self.prefix)
    }
    fn token(&self, id: &str) -> String {
        format!("{}tokens/{id}", self.prefix)
    }
    fn requests(&self) -> String {
        format!("{}joins/", self.prefix)
    }
    fn answer(&self, id: &str) -> String {
        format!("{}joined/{id}", self.prefix)
    }
}

/// `kiln cluster init --etcd`: makes this host the first member of `file.cluster` — its CA
/// made (if it has none) and recorded as the cluster's, the host a member — and records the
/// cluster in `state_dir` for the daemon.
pub async fn init(state_dir: &Path, file: &ClusterFile) -> anyhow::Result<()> {
    if let Some(current) = ClusterFile::load(state_dir)? {
        bail!(
            "this host is a member of cluster {} already (`kiln cluster leave` first)",
            current.cluster
        );
    }
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
    let key = Keys::of(etcd).member(host);
    let put_if_new = Txn::new()
        .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
        .and_then([TxnOp::put(key, "{}", None)]);
    etcd.call(|mut client| {
        let txn = put_if_new.clone();
        async move { client.txn(txn).await }
    })
    .await?;
    Ok(())
}

/// The member hosts, by name.
pub async fn members(etcd: &Etcd) -> anyhow::Result<Vec<String>> {
    let prefix = Keys::of(etcd).members();
    let answer = etcd
        .call(|mut client| {
            let prefix = prefix.clone();
            let options = GetOptions::new().with_prefix().with_keys_only();
            async move { client.get(prefix, Some(options)).await }
        })
        .await?;
    Ok(answer
        .kvs()
        .iter()
        .map(|kv| String::from_utf8_lossy(&kv.key()[prefix.len()..]).into_owned())
        .collect())
}

/// `kiln cluster leave`: `host` is no longer a member, and its report is gone.
pub async fn leave(etcd: &Etcd, host: &str) -> anyhow::Result<()> {
    let keys = Keys::of(etcd);
    let report = format!("{}hosts/{host}", keys.prefix);
    let both = Txn::new().and_then([
        TxnOp::delete(keys.member(host), None),
        TxnOp::delete(report, None),
    ]);
    etcd.call(|mut client| {
        let txn = both.clone();
        async move { client.txn(txn).await }
    })
    .await?;
    Ok(())
}

/// `kiln cluster token`: a new one-time join token, valid for `valid` (its key in etcd lives
/// under a lease of that time). This host must hold the CA's key.
pub async fn new_token(etcd: &Etcd, tls_dir: &Path, valid: Duration) -> anyhow::Result<Token> {
    if valid.is_zero() || valid > TOKEN_VALIDITY_MAX {
        bail!(
            "a token is valid for 1 s to {} s",
            TOKEN_VALIDITY_MAX.as_secs()
        );
    }
    if !pki::holds_ca_key(tls_dir) {
        bail!("this host does not hold the cluster CA's key: make the token on one that does");
    }
    let token = Token::new(tls_dir, &etcd.target().cluster)?;
    let ttl = i64::try_from(valid.as_secs().max(1)).expect("bounded above");
    let lease = etcd
        .call(|mut client| async move { client.lease_grant(ttl, None).await })
        .await?
        .id();
    let key = Keys::of(etcd).token(&token.id);
    etcd.call(|mut client| {
        let key = key.clone();
        async move {
            let options = PutOptions::new().with_lease(lease);
            client.put(key, "", Some(options)).await
        }
    })
    .await?;
    Ok(token)
}

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
    if let Some(current) = ClusterFile::load(state_dir)? {
        bail!(
            "this host is a member of cluster {} already (`kiln cluster leave` first)",
            current.cluster
        );
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
    let answer = ask(&etcd, token, &claim).await?;
    let grant: JoinGrant = match answer {
        JoinAnswer::Granted(sealed) => token.open(&sealed, "the grant")?,
        JoinAnswer::Refused(reason) => bail!("cluster {} refused: {reason}", token.cluster),
    };
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
    let file = ClusterFile {
        cluster: grant.cluster,
        etcd: grant.endpoints,
        host: host.to_owned(),
    };
    file.save(state_dir)?;
    Ok(file)
}

/// Posts the join request of `claim` and waits for the answer; both keys are removed after.
async fn ask(etcd: &Etcd, token: &Token, claim: &JoinClaim) -> anyhow::Result<JoinAnswer> {
    let keys = Keys::of(etcd);
    let request_key = format!("{}{}", keys.requests(), token.id);
    let answer_key = keys.answer(&token.id);
    let request = JoinRequest {
        token_id: token.id.clone(),
        claim: token.seal(claim),
    };
    let json = serde_json::to_vec(&request).expect("a request encodes");
    let post = Txn::new()
        .when([
            Compare::create_revision(request_key.clone(), CompareOp::Equal, 0),
            Compare::create_revision(answer_key.clone(), CompareOp::Equal, 0),
        ])
        .and_then([TxnOp::put(request_key.clone(), json, None)]);
    let posted = etcd
        .call(|mut client| {
            let txn = post.clone();
            async move { client.txn(txn).await }
        })
        .await?;
    if !posted.succeeded() {
        bail!("this token was used already: ask for a new one (`kiln cluster token`)");
    }
    let revision = posted.header().map_or(0, |h| h.revision());
    let answer = wait_for_answer(etcd, &answer_key, revision).await;
    let forget = Txn::new().and_then([
        TxnOp::delete(request_key, None),
        TxnOp::delete(answer_key, None),
    ]);
    let _ = etcd
        .call(|mut client| {
            let txn = forget.clone();
            async move { client.txn(txn).await }
        })
        .await;
    answer
}

async fn wait_for_answer(etcd: &Etcd, key: &str, after: i64) -> anyhow::Result<JoinAnswer> {
    let options = WatchOptions::new().with_start_revision(after + 1);
    let mut changes = etcd.watch(key, options).await?;
    let deadline = Instant::now() + JOIN_ANSWER_TIMEOUT;
    loop {
        let message = tokio::time::timeout_at(deadline.into(), changes.message()).await;
        let Ok(Ok(Some(message))) = message else {
            bail!(
                "no host of the cluster answered within {} s: is kiln-mgmtd running on a \
                 host that holds the cluster CA's key?",
                JOIN_ANSWER_TIMEOUT.as_secs()
            );
        };
        if let Some(kv) = message
            .events()
            .iter()
            .filter(|e| e.event_type() == EventType::Put)
            .find_map(|e| e.kv())
        {
            return serde_json::from_slice(kv.value()).context("the cluster's answer");
        }
    }
}

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
    let prefix = Keys::of(etcd).requests();
    let waiting = etcd
        .call(|mut client| {
            let prefix = prefix.clone();
            async move {
                client
                    .get(prefix, Some(GetOptions::new().with_prefix()))
                    .await
            }
        })
        .await?;
    for kv in waiting.kvs() {
        answer_one(etcd, tls_dir, host, kv.key(), kv.value()).await?;
    }
    let revision = waiting.header().map_or(0, |h| h.revision());
    let options = WatchOptions::new()
        .with_prefix()
        .with_start_revision(revision + 1);
    let mut changes = etcd.watch(&prefix, options).await?;
    while let Some(message) = changes.message().await? {
        for event in message.events() {
            if let (EventType::Put, Some(kv)) = (event.event_type(), event.kv()) {
                answer_one(etcd, tls_dir, host, kv.key(), kv.value()).await?;
            }
        }
    }
    bail!("the watch of join requests ended")
}

/// Answers the request at `key`: granted (in one transaction with the token's deletion and the
/// new member, so a token joins one host once) or refused with the reason.
async fn answer_one(
    etcd: &Etcd,
    tls_dir: &Path,
    issuer: &str,
    key: &[u8],
    value: &[u8],
) -> anyhow::Result<()> {
    let keys = Keys::of(etcd);
    let id = String::from_utf8_lossy(&key[keys.requests().len()..]).into_owned();
    let answer_key = keys.answer(&id);
    let decided = tokio::task::block_in_place(|| grant(etcd, tls_dir, &id, value));
    let (answer, member) = match decided {
        Ok((grant, host)) => (JoinAnswer::Granted(grant), Some(host)),
        Err(e) => (JoinAnswer::Refused(format!("{e:#}")), None),
    };
    let json = serde_json::to_vec(&answer).expect("an answer encodes");
    let mut when = vec![Compare::create_revision(
        answer_key.clone(),
        CompareOp::Equal,
        0,
    )];
    let mut then = vec![TxnOp::put(answer_key.clone(), json, None)];
    if let Some(host) = &member {
        when.push(Compare::version(keys.token(&id), CompareOp::Greater, 0));
        when.push(Compare::create_revision(
            keys.member(host),
            CompareOp::Equal,
            0,
        ));
        then.push(TxnOp::delete(keys.token(&id), None));
        then.push(TxnOp::put(keys.member(host), "{}", None));
    }
    let txn = Txn::new().when(when).and_then(then);
    let done = etcd
        .call(|mut client| {
            let txn = txn.clone();
            async move { client.txn(txn).await }
        })
        .await?;
    match (done.succeeded(), member) {
        (true, Some(host)) => tracing::info!(%host, %issuer, "a host joined the cluster"),
        (true, None) => tracing::info!(token = %id, "refused a join request"),
        (false, Some(host)) => refuse_late(etcd, &keys, &id, &host).await?,
        (false, None) => {}
    }
    Ok(())
}

/// A grant that lost its transaction: answered already (nothing to do), or the token is gone
/// or the host a member (refused with which).
async fn refuse_late(etcd: &Etcd, keys: &Keys, id: &str, host: &str) -> anyhow::Result<()> {
    let member = keys.member(host);
    let token = keys.token(id);
    let look = |key: String| async move {
        etcd.call(|mut client| {
            let key = key.clone();
            async move { client.get(key, None).await }
        })
        .await
        .map(|answer| !answer.kvs().is_empty())
    };
    let reason = if look(member).await? {
        format!("host {host} is a member already: run `kiln cluster leave` on it first")
    } else if !look(token).await? {
        "the token was used already or has expired: ask for a new one".to_owned()
    } else {
        return Ok(());
    };
    let answer_key = keys.answer(id);
    let json = serde_json::to_vec(&JoinAnswer::Refused(reason)).expect("an answer encodes");
    let refuse = Txn::new()
        .when([Compare::create_revision(
            answer_key.clone(),
            CompareOp::Equal,
            0,
        )])
        .and_then([TxnOp::put(answer_key, json, None)]);
    etcd.call(|mut client| {
        let txn = refuse.clone();
        async move { client.txn(txn).await }
    })
    .await?;
    Ok(())
}

/// What the request `value` (for token `id`) is granted, sealed, and the host it names; or
/// why it is refused. Signs with the CA in `tls_dir`.
fn grant(
    etcd: &Etcd,
    tls_dir: &Path,
    id: &str,
    value: &[u8],
) -> anyhow::Result<(kiln_admin::join::Sealed, String)> {
    let request: JoinRequest =
        serde_json::from_slice(value).context("the request is not a join request")?;
    if request.token_id != id {
        bail!("the request names token {} under {id}", request.token_id);
    }
    let token = Token::of_ca(tls_dir, &etcd.target().cluster, id)?;
    let claim: JoinClaim = token.open(&request.claim, "the claim")?;
    claim.check()?;
    let days = pki::CERT_VALIDITY_DAYS;
    let role = Role::Brick {
        hosts: claim.names.clone(),
    };
    let grant = JoinGrant {
        cluster: etcd.target().cluster.clone(),
        endpoints: etcd.target().endpoints.clone(),
        ca_cert: std::fs::read_to_string(pki::ca_files(tls_dir).cert)
            .context("this host's CA certificate")?,
        host_cert: pki::sign_request(tls_dir, &role, pki::HOST_IDENTITY, &claim.brick_csr, days)?,
        client_cert: pki::sign_request(
            tls_dir,
            &Role::Client,
            pki::ADMIN_CLIENT,
            &claim.client_csr,
            days,
        )?,
    };
    Ok((token.seal(&grant), claim.host))
}
