//! The cluster: its status, join tokens, and a host's leave (which revokes its client
//! certificate in every volume).

use std::time::Duration;

use anyhow::Context as _;
use kiln_admin::command::{ClusterStatus, Response};
use kiln_admin::options;
use kiln_admin::pki::{self, Role};
use kiln_admin::volume::{Brick, Volume};

use super::{Daemon, done};
use crate::membership;
use crate::store::etcd::EtcdStore;
use crate::volume::Cluster;

impl Daemon {
    pub(super) async fn cluster_status(&self) -> anyhow::Result<Response> {
        let store = match self.store.etcd() {
            Some(etcd) => format!("etcd {}", etcd.etcd().target().endpoints.join(",")),
            None => "embedded".to_owned(),
        };
        let hosts = self.host_reports().await?;
        let (down, leader) = match self.store.etcd() {
            Some(etcd) => (
                membership::members(etcd.etcd())
                    .await?
                    .into_iter()
                    .filter(|member| !hosts.iter().any(|h| &h.host == member))
                    .collect(),
                crate::tasks::leader(etcd.etcd()).await?,
            ),
            None => (Vec::new(), self.config.host.clone()),
        };
        Ok(Response::Cluster(ClusterStatus {
            store,
            generation: self.store.generation(),
            hosts,
            down,
            leader,
        }))
    }

    pub(super) async fn token(&self, valid_secs: u64) -> anyhow::Result<Response> {
        let etcd = self.cluster_etcd()?;
        let tls_dir = self.config.state_dir.join("tls");
        if !pki::holds_ca_key(&tls_dir) {
            anyhow::bail!(
                "this host does not hold the cluster CA's key: make the token on one that does"
            );
        }
        let cluster = &etcd.etcd().target().cluster;
        let valid = Duration::from_secs(valid_secs);
        let token = kiln_admin::join::Token::new(&tls_dir, cluster, valid)?;
        Ok(Response::Token {
            token: token.to_string(),
            valid_secs,
        })
    }

    /// Leaves the cluster if no volume has a brick here: the host is no longer a member,
    /// its report stops, its cluster file goes, and the daemon stops.
    pub(super) async fn leave(&self) -> anyhow::Result<Response> {
        let etcd = self.cluster_etcd()?;
        let bricks: Vec<String> = self.store.read(|cluster, _| {
            let volumes = cluster.volumes.values();
            volumes
                .flat_map(|v| {
                    let local = self.supervisor.local_bricks(v);
                    local.map(|i| Brick::name(&v.name, i))
                })
                .collect()
        });
        if !bricks.is_empty() {
            anyhow::bail!(
                "bricks of this host are in volumes ({}): delete them or move their data first",
                bricks.join(", ")
            );
        }
        let host = self.config.host.as_deref().unwrap_or_default();
        let serial = self.revoke_everywhere(etcd, host).await?;
        if let Some(reporter) = crate::lock(&self.reporter).take() {
            reporter.abort();
        }
        membership::leave(etcd.etcd(), host).await?;
        membership::ClusterFile::remove(&self.config.state_dir)?;
        Ok(done(
            self.store.generation(),
            format!(
                "host {host} left cluster {}; its client certificate ({serial}) is revoked in \
                 every volume; its daemon stops (it starts on the embedded store next time)",
                etcd.etcd().target().cluster
            ),
        ))
    }

    /// Revokes this host's client certificate in every volume: recorded first, so volumes
    /// created from then on take it (`membership::revoked`), then added to each volume's
    /// `auth.revoked` as it is now (pushed live), until none lacks it; its serial.
    async fn revoke_everywhere(
        &self,
        etcd: &EtcdStore<Cluster>,
        host: &str,
    ) -> anyhow::Result<String> {
        let tls_dir = self.config.state_dir.join("tls");
        let cert = pki::identity_files(&tls_dir, &Role::Client, pki::ADMIN_CLIENT).cert;
        let serial = pki::serial_of(&cert)
            .with_context(|| format!("the serial of this host's certificate {}", cert.display()))?;
        membership::revoke(etcd.etcd(), &serial, host).await?;
        // (Again for a volume created while the record was written.)
        for _ in 0..REVOKE_ROUNDS {
            let lacking: Vec<(String, String)> = self.store.read(|cluster, _| {
                let revoked = |v: &Volume| v.options.get(REVOKED).cloned().unwrap_or_default();
                let volumes = cluster
                    .volumes
                    .values()
                    .map(|v| (v.name.clone(), revoked(v)));
                volumes
                    .filter(|(_, r)| !r.split(',').any(|s| s == serial))
                    .collect()
            });
            if lacking.is_empty() {
                return Ok(serial);
            }
            for (name, revoked) in lacking {
                let revoked = with_revoked(&revoked, std::slice::from_ref(&serial))?;
                self.set_option(&name, REVOKED, &revoked).await?;
            }
        }
        anyhow::bail!("volumes kept appearing without this host's certificate revoked: try again")
    }

    fn cluster_etcd(&self) -> anyhow::Result<&EtcdStore<Cluster>> {
        self.store
            .etcd()
            .context("this daemon keeps its configuration on this host, not in a cluster on etcd")
    }
}

/// The option that lists revoked client certificates.
pub(super) const REVOKED: &str = "auth.revoked";
/// Passes over the volumes that revoke a leaving host's certificate (a volume created during
/// one is seen by the next).
const REVOKE_ROUNDS: usize = 3;

/// `auth.revoked`'s value `current` with `serials` added, in canonical form.
pub(super) fn with_revoked(current: &str, serials: &[String]) -> anyhow::Result<String> {
    let all: Vec<&str> = std::iter::once(current)
        .filter(|c| !c.is_empty())
        .chain(serials.iter().map(String::as_str))
        .collect();
    Ok(options::find(REVOKED)?.parse(&all.join(","))?)
}
