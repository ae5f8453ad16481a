//! What the daemons of a cluster share in etcd beside the configuration:
//!
//! ```text
//! <prefix>ca.crt          the cluster CA's certificate, recorded by the first daemon; every
//!                         other daemon must hold the same CA (its key stays on the hosts)
//! <prefix>hosts/<host>    each daemon's report of its host (JSON `HostReport`), under an
//!                         etcd lease: it disappears within HOST_LEASE_TTL of the daemon
//!                         or its host going away
//! ```

use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, bail};
use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse};
use kiln_admin::command::HostReport;
use kiln_admin::pki;

use crate::store::etcd::{EtcdTarget, in_time};

/// How long a host's report outlives its daemon's last keep-alive, in seconds: a dead host
/// shows as down within this.
pub const HOST_LEASE_TTL_SECS: i64 = 5;
/// How often a daemon reports its host.
pub const REPORT_EVERY: Duration = Duration::from_secs(1);

fn hosts_prefix(target: &EtcdTarget) -> String {
    format!("{}hosts/", target.prefix())
}

/// Checks this host's cluster CA against the one the cluster recorded; the first daemon of
/// a cluster makes one (if it has none) and records its certificate.
pub async fn check_ca(client: &Client, target: &EtcdTarget, tls_dir: &Path) -> anyhow::Result<()> {
    let key = format!("{}ca.crt", target.prefix());
    let ca = pki::ca_files(tls_dir);
    let local = std::fs::read(&ca.cert).ok();
    let record = match &local {
        Some(cert) => cert.clone(),
        None => {
            let recorded = get(client, target, &key).await?;
            if recorded.is_some() {
                bail!(
                    "this host has no copy of cluster {}'s CA: copy ca.crt and ca.key from \
                     a host of the cluster into {} (mode 0600 for the key)",
                    target.cluster,
                    tls_dir.display()
                );
            }
            pki::init_ca(tls_dir)?;
            std::fs::read(&ca.cert).with_context(|| ca.cert.display().to_string())?
        }
    };
    let first = Txn::new()
        .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
        .and_then([TxnOp::put(key.clone(), record.clone(), None)])
        .or_else([TxnOp::get(key.clone(), None)]);
    let mut client = client.clone();
    let answer = in_time(&target.endpoints, client.txn(first)).await?;
    if answer.succeeded() {
        tracing::info!(cluster = %target.cluster, "recorded this host's CA as the cluster's");
        return Ok(());
    }
    let recorded = match answer.op_responses().into_iter().next() {
        Some(TxnOpResponse::Get(get)) => get.kvs().first().map(|kv| kv.value().to_vec()),
        _ => None,
    };
    if recorded.as_deref() != Some(&record[..]) {
        bail!(
            "the CA in {} is not cluster {}'s: copy ca.crt and ca.key from a host of the \
             cluster",
            tls_dir.display(),
            target.cluster
        );
    }
    Ok(())
}

/// Reports this host (`report()`) into etcd every [`REPORT_EVERY`] under a lease, until the
/// task is dropped; a lost lease (etcd unreachable for longer than its time) is granted
/// again.
pub async fn report_forever(
    client: Client,
    target: EtcdTarget,
    host: String,
    report: impl Fn() -> HostReport,
) {
    let key = format!("{}{host}", hosts_prefix(&target));
    loop {
        if let Err(e) = report_under_one_lease(&client, &target, &key, &report).await {
            tracing::warn!(error = %e, "reporting this host into etcd");
        }
        tokio::time::sleep(REPORT_EVERY).await;
    }
}

async fn report_under_one_lease(
    client: &Client,
    target: &EtcdTarget,
    key: &str,
    report: &impl Fn() -> HostReport,
) -> anyhow::Result<()> {
    let mut client = client.clone();
    let lease = in_time(
        &target.endpoints,
        client.lease_grant(HOST_LEASE_TTL_SECS, None),
    )
    .await?;
    let (mut keeper, mut answers) =
        in_time(&target.endpoints, client.lease_keep_alive(lease.id())).await?;
    loop {
        let json = serde_json::to_vec(&report()).context("encode the host report")?;
        let options = PutOptions::new().with_lease(lease.id());
        in_time(&target.endpoints, client.put(key, json, Some(options))).await?;
        in_time(&target.endpoints, keeper.keep_alive()).await?;
        match in_time(&target.endpoints, answers.message()).await? {
            Some(answer) if answer.ttl() > 0 => {}
            _ => bail!("the host's lease expired"),
        }
        tokio::time::sleep(REPORT_EVERY).await;
    }
}

/// Every host whose daemon reports, by name.
pub async fn hosts(client: &Client, target: &EtcdTarget) -> anyhow::Result<Vec<HostReport>> {
    let prefix = hosts_prefix(target);
    let mut client = client.clone();
    let options = GetOptions::new().with_prefix();
    let answer = in_time(&target.endpoints, client.get(prefix, Some(options))).await?;
    answer
        .kvs()
        .iter()
        .map(|kv| {
            serde_json::from_slice(kv.value())
                .with_context(|| format!("the report {}", String::from_utf8_lossy(kv.key())))
        })
        .collect()
}

async fn get(client: &Client, target: &EtcdTarget, key: &str) -> anyhow::Result<Option<Vec<u8>>> {
    let mut client = client.clone();
    let answer = in_time(&target.endpoints, client.get(key, None)).await?;
    Ok(answer.kvs().first().map(|kv| kv.value().to_vec()))
}
