//! Options: set, get, reset; a change pushed live to a started volume's bricks, those of other
//! hosts waited for.

use std::time::{Duration, Instant};

use kiln_admin::command::{HostReport, OptionValue, Response};
use kiln_admin::options;
use kiln_admin::volume::{Brick, Volume, VolumeState};

use super::reports::{remote_status, report_of};
use super::{Daemon, done};
use crate::volume::Change;

/// How long `volume set` waits for the bricks of other hosts to report a change applied.
const REMOTE_APPLY_WAIT: Duration = Duration::from_secs(5);

impl Daemon {
    pub(super) async fn set_option(
        &self,
        name: &str,
        key: &str,
        value: &str,
    ) -> anyhow::Result<Response> {
        let value = options::find(key)?.parse(value)?;
        let generation = self
            .commit(Change::Set {
                volume: name.to_owned(),
                key: key.to_owned(),
                value: value.clone(),
            })
            .await?;
        let apply = options::find(key)?.apply;
        let note = self.apply_to_bricks(name, generation, apply).await?;
        Ok(done(
            generation,
            format!("{key} = {value} on volume {name}{note}"),
        ))
    }

    pub(super) fn get_options(&self, name: &str, key: Option<&str>) -> anyhow::Result<Response> {
        let volume = self.volume(name)?;
        let keys: Vec<&str> = match key {
            Some(k) => vec![options::find(k)?.key],
            None => options::OPTIONS.iter().map(|o| o.key).collect(),
        };
        let options = keys
            .into_iter()
            .map(|k| OptionValue {
                key: k.to_owned(),
                value: options::effective(&volume.options, k).to_string(),
                set: volume.options.contains_key(k),
            })
            .collect();
        Ok(Response::Options { options })
    }

    pub(super) async fn reset_option(
        &self,
        name: &str,
        key: Option<String>,
    ) -> anyhow::Result<Response> {
        let generation = self
            .commit(Change::Reset {
                volume: name.to_owned(),
                key: key.clone(),
            })
            .await?;
        let apply = match &key {
            Some(k) => options::find(k)?.apply,
            None => options::Apply::Live,
        };
        let note = self.apply_to_bricks(name, generation, apply).await?;
        let what = key.unwrap_or_else(|| "every option".to_owned());
        Ok(done(
            generation,
            format!("{what} reset to the default on volume {name}{note}"),
        ))
    }

    /// After a committed option change: pushes live options to a started volume's bricks and
    /// says which did not take them; restart options wait for the next brick start.
    async fn apply_to_bricks(
        &self,
        name: &str,
        generation: u64,
        apply: options::Apply,
    ) -> anyhow::Result<String> {
        let volume = self.volume(name)?;
        match apply {
            options::Apply::Mount => return Ok("; mounts use it from their next mount".into()),
            _ if volume.state != VolumeState::Started => return Ok(String::new()),
            options::Apply::Restart => {
                return Ok(
                    "; the bricks use it from their next start (`kiln volume stop` and `start`)"
                        .into(),
                );
            }
            options::Apply::Live => {}
        }
        let mut results = self.supervisor.push(&volume, generation).await;
        results.extend(self.remote_applied(&volume, generation).await?);
        let missing: Vec<String> = results
            .into_iter()
            .filter_map(|(brick, r)| r.err().map(|why| format!("{brick} ({why})")))
            .collect();
        Ok(match missing.is_empty() {
            true => format!(
                "; applied by {} running brick(s)",
                volume.bricks_in_service().count()
            ),
            false => format!(
                "; saved, but not yet applied by {}: they get it when they restart",
                missing.join(", ")
            ),
        })
    }

    /// Per brick of `volume` on other hosts: the generation its host's daemon has applied,
    /// once at `generation` or later (waiting up to [`REMOTE_APPLY_WAIT`] for the hosts that
    /// report), or why not.
    async fn remote_applied(
        &self,
        volume: &Volume,
        generation: u64,
    ) -> anyhow::Result<Vec<(String, Result<u64, String>)>> {
        let remote: Vec<(String, &Brick)> = volume
            .bricks_in_service()
            .map(|(i, brick)| (Brick::name(&volume.name, i), brick))
            .filter(|(_, brick)| !self.supervisor.is_local(brick))
            .collect();
        let Some(etcd) = self.store.etcd().filter(|_| !remote.is_empty()) else {
            return Ok(Vec::new());
        };
        let caught_up = |reports: &[HostReport]| {
            remote.iter().all(|(_, brick)| {
                report_of(reports, brick).is_none_or(|r| r.generation >= generation)
            })
        };
        let deadline = Instant::now() + REMOTE_APPLY_WAIT;
        let reports = crate::cluster::wait_for_hosts(etcd.etcd(), caught_up, deadline).await?;
        let results = remote
            .iter()
            .map(|(name, brick)| {
                let status = remote_status(&reports, name, brick);
                let applied = report_of(&reports, brick).map_or(0, |r| r.generation);
                let result = match status.pid {
                    Some(_) if applied >= generation => Ok(applied),
                    Some(_) => Err(format!("its host has applied generation {applied}")),
                    None => Err(format!("{}: {}", status.state, status.health)),
                };
                (name.clone(), result)
            })
            .collect();
        Ok(results)
    }
}
