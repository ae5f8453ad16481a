//! What the daemons of a cluster share in etcd beside the configuration:
//!
//! ```text
//! <prefix>ca.crt          the cluster CA's certificate, recorded by the first daemon; every
//!                         other daemon must hold the same CA (its key stays on the hosts
//!                         that issue certificates; others join, see `membership`)
//! <prefix>hosts/<host>    each daemon's report of its host (JSON `HostReport`), under an
//!                         etcd lease: it disappears within HOST_LEASE_TTL of the daemon
//!                         or its host going away
//! ```

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp, TxnOpResponse, WatchOptions};
use kiln_admin::command::HostReport;
use kiln_admin::pki;
use tokio::sync::watch;

use crate::store::etcd::Etcd;

/// How long a host's report outlives its daemon's last keep-alive, in seconds: a dead host
/// shows as down within this.
pub const HOST_LEASE_TTL_SECS: i64 = 5;
/// How often a daemon reports its host.
pub const REPORT_EVERY: Duration = Duration::from_secs(1);

fn hosts_prefix(etcd: &Etcd) -> String {
    format!("{}hosts/", etcd.target().prefix())
}

/// The key of the cluster CA's certificate.
pub(crate) fn ca_key(etcd: &Etcd) -> String {
    format!("{}ca.crt", etcd.target().prefix())
}

/// The key of `host`'s report.
pub(crate) fn host_key(etcd: &Etcd, host: &str) -> String {
    format!("{}{host}", hosts_prefix(etcd))
}

/// Checks this host's cluster CA against the one the cluster recorded; the first daemon of
/// a cluster makes one (if it has none) and records its certificate.
pub async fn check_ca(etcd: &Etcd, tls_dir: &Path) -> anyhow::Result<()> {
    let cluster = &etcd.target().cluster;
    let key = ca_key(etcd);
    let ca = pki::ca_files(tls_dir);
    let record = match std::fs::read(&ca.cert) {
        Ok(cert) => cert,
        Err(_) => {
            let recorded = etcd
                .call(|mut client| {
                    let key = key.clone();
                    async move { client.get(key, None).await }
                })
                .await?;
            if !recorded.kvs().is_empty() {
                bail!(
                    "this host has no copy of cluster {cluster}'s CA: join the cluster with \
                     `kiln cluster join` and a token from `kiln cluster token` on one of its \
                     hosts (or copy ca.crt, and ca.key to let it issue certificates, from a \
                     host of the cluster into {})",
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
    let answer = etcd
        .call(|mut client| {
            let first = first.clone();
            async move { client.txn(first).await }
        })
        .await?;
    if answer.succeeded() {
        tracing::info!(%cluster, "recorded this host's CA as the cluster's");
        return Ok(());
    }
    let recorded = match answer.op_responses().into_iter().next() {
        Some(TxnOpResponse::Get(get)) => get.kvs().first().map(|kv| kv.value().to_vec()),
        _ => None,
    };
    if recorded.as_deref() != Some(&record[..]) {
        bail!(
            "the CA in {} is not cluster {cluster}'s: copy ca.crt and ca.key from a host of \
             the cluster",
            tls_dir.display()
        );
    }
    Ok(())
}

/// Reports this host (`report()`) into etcd under a lease every [`REPORT_EVERY`], and at
/// once when `applied` tells a new generation applied here, until the task is dropped; a
/// lost lease (etcd unreachable for longer than its time) is granted again.
pub async fn report_forever(
    etcd: Etcd,
    host: String,
    report: impl AsyncFn() -> HostReport,
    mut applied: watch::Receiver<u64>,
) {
    let key = host_key(&etcd, &host);
    loop {
        if let Err(e) = report_under_one_lease(&etcd, &key, &report, &mut applied).await {
            tracing::warn!(error = %format!("{e:#}"), "reporting this host into etcd");
        }
        tokio::time::sleep(REPORT_EVERY).await;
    }
}

/// Grants a lease and keeps this host's report under it fresh until something fails.
async fn report_under_one_lease(
    etcd: &Etcd,
    key: &str,
    report: &impl AsyncFn() -> HostReport,
    applied: &mut watch::Receiver<u64>,
) -> anyhow::Result<()> {
    let lease = etcd.grant(HOST_LEASE_TTL_SECS).await?;
    // Kept alive on its own clock: reports sent at every generation do not renew a lease.
    let mut keep_alive = tokio::time::interval(REPORT_EVERY);
    keep_alive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let json = serde_json::to_vec(&report().await).context("encode the host report")?;
        etcd.put(key, &json, lease).await?;
        tokio::select! {
            changed = applied.changed() => {
                if changed.is_err() {
                    return Ok(());
                }
            }
            _ = keep_alive.tick() => {
                // (A put under an expired lease fails, and a new lease is granted.)
                etcd.keep_alive(lease).await?;
            }
        }
    }
}

/// The hosts' reports once `enough` holds for them, or as they are at `deadline`: each
/// change of a report wakes the check.
pub async fn wait_for_hosts(
    etcd: &Etcd,
    enough: impl Fn(&[HostReport]) -> bool,
    deadline: Instant,
) -> anyhow::Result<Vec<HostReport>> {
    let (mut reports, revision) = hosts_at(etcd).await?;
    if enough(&reports) {
        return Ok(reports);
    }
    let options = WatchOptions::new()
        .with_prefix()
        .with_start_revision(revision + 1);
    let mut changes = etcd.watch(&hosts_prefix(etcd), options).await?;
    while !enough(&reports) {
        match tokio::time::timeout_at(deadline.into(), changes.message()).await {
            Ok(Ok(Some(_))) => reports = hosts_at(etcd).await?.0,
            Ok(Ok(None) | Err(_)) | Err(_) => break,
        }
    }
    Ok(reports)
}

/// Every host whose daemon reports.
pub async fn hosts(etcd: &Etcd) -> anyhow::Result<Vec<HostReport>> {
    Ok(hosts_at(etcd).await?.0)
}

/// Every host whose daemon reports, and the etcd revision read at.
async fn hosts_at(etcd: &Etcd) -> anyhow::Result<(Vec<HostReport>, i64)> {
    let prefix = hosts_prefix(etcd);
    let answer = etcd
        .call(|mut client| {
            let prefix = prefix.clone();
            async move {
                let options = GetOptions::new().with_prefix();
                client.get(prefix, Some(options)).await
            }
        })
        .await?;
    let reports = answer
        .kvs()
        .iter()
        .map(|kv| {
            serde_json::from_slice(kv.value())
                .with_context(|| format!("the report {}", String::from_utf8_lossy(kv.key())))
        })
        .collect::<anyhow::Result<_>>()?;
    Ok((reports, answer.header().map_or(0, |h| h.revision())))
}
