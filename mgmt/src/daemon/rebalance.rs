//! The cluster-wide tasks: rebalance (and heal), and remove-brick, which runs one to move the
//! leaving brick's files off.

use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use kiln_admin::command::{RemoveAction, Response, TaskAction};
use kiln_admin::volume::{BrickRole, Volume, VolumeState};

use super::{Daemon, done};
use crate::volume::Change;

/// How long `remove-brick … stop` waits for the rebalance to finish the file it is moving.
const TASK_STOP_WAIT: Duration = Duration::from_secs(120);

impl Daemon {
    /// `kiln volume rebalance NAME start|fix-layout|status|stop` (and `heal`): run by this
    /// daemon, or on a cluster by the elected one (`tasks`).
    pub(super) async fn rebalance(
        &self,
        name: &str,
        action: TaskAction,
    ) -> anyhow::Result<Response> {
        let status = match action.starts() {
            Some(kind) => {
                must_be_started(&self.volume(name)?)?;
                self.tasks.start(name, kind).await?
            }
            None if action == TaskAction::Status => self.tasks.status(name).await?,
            None => self.tasks.stop(name).await?,
        };
        Ok(Response::Rebalance(status))
    }

    /// `kiln volume remove-brick NAME BRICK start|status|stop|commit`.
    pub(super) async fn remove_brick(
        &self,
        name: &str,
        spec: &Path,
        action: RemoveAction,
    ) -> anyhow::Result<Response> {
        let (host, path) = self.brick_place(spec)?;
        let volume = self.volume(name)?;
        let index = volume
            .bricks_in_service()
            .find(|(_, b)| b.host == host && b.path == path)
            .map(|(i, _)| i)
            .with_context(|| format!("volume {name} has no brick {}", spec.display()))?;
        let brick = volume.bricks[index].display();
        let role = |role| Change::SetBrickRole {
            volume: name.to_owned(),
            index,
            role,
        };
        // The last task's status is forgotten when the brick starts or stops leaving: a
        // removal is committed only on a rebalance that began with the brick leaving.
        match action {
            RemoveAction::Start => {
                must_be_started(&volume)?;
                self.no_task_running(name).await?;
                self.tasks.forget(name).await?;
                if volume.bricks[index].role != BrickRole::Leaving {
                    self.commit(role(BrickRole::Leaving)).await?;
                }
                self.rebalance(name, TaskAction::Start).await
            }
            RemoveAction::Status => self.rebalance(name, TaskAction::Status).await,
            RemoveAction::Stop => {
                self.store.read(|cluster, _| {
                    crate::store::State::check(cluster, &role(BrickRole::Serving))
                })?;
                if self.tasks.is_live(name).await? {
                    // (One that ended meanwhile has nothing to stop.)
                    if let Err(e) = self.tasks.stop(name).await {
                        tracing::info!(volume = %name, error = %format!("{e:#}"), "no task to stop");
                    }
                    self.tasks.wait_until_ended(name, TASK_STOP_WAIT).await?;
                }
                self.tasks.forget(name).await?;
                let generation = self.commit(role(BrickRole::Serving)).await?;
                Ok(done(
                    generation,
                    format!(
                        "brick {brick} of volume {name} serves again; the files moved off it \
                         stay where they are"
                    ),
                ))
            }
            RemoveAction::Commit => {
                let last = self.tasks.status(name).await.ok();
                if !last.as_ref().is_some_and(|s| s.emptied(index)) {
                    let how = match last {
                        Some(s) if s.is_live() => "its rebalance is still running".to_owned(),
                        Some(s) if s.leaving.contains(&index) => format!(
                            "its last rebalance {} with {} entries left on it and {} failed",
                            s.state, s.report.left_on_leaving, s.report.failed
                        ),
                        _ => "no rebalance has emptied it".to_owned(),
                    };
                    anyhow::bail!(
                        "brick {brick} still holds files of volume {name} ({how}): run \
                         `kiln volume remove-brick {name} {brick} start` until it completes"
                    );
                }
                let generation = self.commit(role(BrickRole::Removed)).await?;
                self.reconcile().await;
                Ok(done(
                    generation,
                    format!(
                        "brick {brick} removed from volume {name}; it holds none of the \
                         volume's files now and its directory may be deleted"
                    ),
                ))
            }
            // The files on it leave the volume; a rebalance lays every directory out over
            // the bricks left and removes the link files that pointed at it.
            RemoveAction::Force => {
                self.no_task_running(name).await?;
                self.tasks.forget(name).await?;
                if volume.bricks[index].role == BrickRole::Serving {
                    self.commit(role(BrickRole::Leaving)).await?;
                }
                let generation = self.commit(role(BrickRole::Removed)).await?;
                self.reconcile().await;
                if volume.state != VolumeState::Started {
                    return Ok(done(
                        generation,
                        format!(
                            "brick {brick} removed from volume {name} with the files on it; \
                             run `kiln volume rebalance {name} start` once the volume is \
                             started"
                        ),
                    ));
                }
                self.rebalance(name, TaskAction::Start).await
            }
        }
    }

    /// Refuses while a rebalance or heal of volume `name` runs.
    async fn no_task_running(&self, name: &str) -> anyhow::Result<()> {
        if self.tasks.is_live(name).await? {
            anyhow::bail!(
                "a rebalance or heal of {name} is running: `kiln volume rebalance {name} stop` \
                 it first"
            );
        }
        Ok(())
    }
}

/// A task runs on a started volume only (its runner reaches the bricks).
fn must_be_started(volume: &Volume) -> anyhow::Result<()> {
    match volume.state {
        VolumeState::Started => Ok(()),
        state => {
            let name = &volume.name;
            anyhow::bail!("volume {name} is {state}; `kiln volume start {name}` first")
        }
    }
}
