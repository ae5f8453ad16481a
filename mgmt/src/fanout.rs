//! Asking every host's daemon about its own bricks — a volume's profile, its bricks' state
//! dumps — through etcd, so that `kiln volume profile VOL info` and `statedump` on any host
//! show every brick of the cluster:
//!
//! ```text
//! <prefix>asks/<id>             what is asked (`Ask`), under a lease of ASK_TTL
//! <prefix>answers/<id>/<host>   that host's daemon's answer: its bricks' reports (JSON),
//!                               under the ask's lease
//! ```
//!
//! Every daemon watches `asks/` and answers for the bricks it runs; the asking daemon waits
//! until every other host with a brick in the volume has answered, or for ANSWER_WAIT.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::bail;
use etcd_client::GetOptions;
use kiln_admin::command::BrickReport;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::store::etcd::Etcd;

/// How long an ask and its answers stay in etcd, in seconds.
const ASK_TTL_SECS: i64 = 30;
/// How long the asking daemon waits for the other hosts' answers.
pub const ANSWER_WAIT: Duration = Duration::from_secs(5);

/// What a daemon is asked of its bricks of `volume`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Query {
    Profile,
    Statedump,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Ask {
    query: Query,
    volume: String,
}

fn asks_prefix(etcd: &Etcd) -> String {
    format!("{}asks/", etcd.target().prefix())
}

fn answers_prefix(etcd: &Etcd, id: &str) -> String {
    format!("{}answers/{id}/", etcd.target().prefix())
}

/// Asks the daemons of `hosts` `query` about their bricks of `volume`, and waits (at most
/// [`ANSWER_WAIT`]) for their answers: each host's reports, by host; a host missing did not
/// answer in time.
pub async fn ask_hosts<T: DeserializeOwned>(
    etcd: &Etcd,
    query: Query,
    volume: &str,
    hosts: &[String],
) -> anyhow::Result<BTreeMap<String, Vec<BrickReport<T>>>> {
    if hosts.is_empty() {
        return Ok(BTreeMap::new());
    }
    let id = uuid::Uuid::new_v4().simple().to_string();
    let lease = etcd.grant(ASK_TTL_SECS).await?;
    let ask = serde_json::to_vec(&Ask {
        query,
        volume: volume.to_owned(),
    })
    .expect("an ask encodes");
    let key = format!("{}{id}", asks_prefix(etcd));
    let put = etcd.put(&key, &ask, lease).await?;
    let revision = put.header().map_or(0, |h| h.revision());
    let prefix = answers_prefix(etcd, &id);
    let mut changes = etcd.watch_prefix_after(&prefix, revision).await?;
    let mut answers = BTreeMap::new();
    let deadline = Instant::now() + ANSWER_WAIT;
    while !hosts.iter().all(|h| answers.contains_key(h)) {
        let next = tokio::time::timeout_at(deadline.into(), Etcd::next_watched(&mut changes));
        let Ok(message) = next.await else { break };
        let Some(message) = message? else { break };
        for kv in Etcd::puts(&message) {
            let Some(host) = kv.key_str().ok().and_then(|k| k.strip_prefix(&prefix)) else {
                continue;
            };
            match serde_json::from_slice(kv.value()) {
                Ok(reports) => {
                    answers.insert(host.to_owned(), reports);
                }
                Err(e) => tracing::warn!(%host, error = %e, "an answer that is not one"),
            }
        }
    }
    // Done with it (its lease would drop it anyway).
    let _ = etcd.revoke(lease).await;
    Ok(answers)
}

/// Answers asks while the daemon runs: `answer` gives this host's reports for a query, as
/// JSON; a broken watch is made again.
pub async fn answer_asks_forever(
    etcd: Etcd,
    host: String,
    answer: impl AsyncFn(Query, &str) -> serde_json::Value,
) {
    loop {
        if let Err(e) = answer_asks(&etcd, &host, &answer).await {
            tracing::warn!(error = %format!("{e:#}"), "answering asks of other hosts");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn answer_asks(
    etcd: &Etcd,
    host: &str,
    answer: &impl AsyncFn(Query, &str) -> serde_json::Value,
) -> anyhow::Result<()> {
    let prefix = asks_prefix(etcd);
    // Asks made before this watch are not answered: their askers are gone or nearly so.
    let now = etcd
        .get(&prefix, Some(GetOptions::new().with_count_only()))
        .await?;
    let revision = now.header().map_or(0, |h| h.revision());
    let mut changes = etcd.watch_prefix_after(&prefix, revision).await?;
    while let Some(message) = Etcd::next_watched(&mut changes).await? {
        for kv in Etcd::puts(&message) {
            let Some(id) = kv.key_str().ok().and_then(|k| k.strip_prefix(&prefix)) else {
                continue;
            };
            let Ok(ask) = serde_json::from_slice::<Ask>(kv.value()) else {
                continue;
            };
            let reports =
                serde_json::to_vec(&answer(ask.query, &ask.volume).await).expect("reports encode");
            let key = format!("{}{host}", answers_prefix(etcd, id));
            if let Err(e) = etcd.put(&key, &reports, kv.lease()).await {
                tracing::warn!(error = %e, "an answer to another host was not written");
            }
        }
    }
    bail!("the watch of asks ended")
}
