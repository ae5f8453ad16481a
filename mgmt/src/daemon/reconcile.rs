//! Keeping the bricks here what the configuration says: at start, after every new generation
//! and when a removed brick's grace ends.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use kiln_admin::volume::{Brick, Volume, VolumeState};

use super::{Daemon, REMOVED_BRICK_GRACE};

impl Daemon {
    /// Reconciles after every new generation (another daemon's commits included) until the
    /// daemon stops.
    pub(super) async fn reconcile_forever(
        self: Arc<Self>,
        mut generations: tokio::sync::watch::Receiver<u64>,
    ) {
        loop {
            // (Again when a removed brick's grace ends.)
            let grace_ends = self.reconciling.lock().await.values().min().copied();
            let grace_ends = grace_ends.map(|seen| seen + REMOVED_BRICK_GRACE);
            tokio::select! {
                changed = generations.changed() => if changed.is_err() {
                    return;
                },
                () = sleep_until(grace_ends) => {}
            }
            self.reconcile().await;
        }
    }

    /// Brings the bricks of this host in line with the configuration: those of started
    /// volumes run (made and formatted first if new), the others stop, and running ones get
    /// live options changed elsewhere.
    pub(super) async fn reconcile(&self) {
        let mut removed = self.reconciling.lock().await;
        let seen_before = std::mem::take(&mut *removed);
        let (cluster, generation) = self.store.read(|c, g| (c.clone(), g));
        let foreign = self
            .store
            .etcd()
            .map_or(0, |etcd| etcd.foreign_generation());
        let previous = *self.applied.borrow();
        let before = self.supervisor.running_names();
        let mut pushed = false;
        let mut wanted = HashSet::new();
        for volume in cluster.volumes.values() {
            if volume.state != VolumeState::Started {
                continue;
            }
            for i in self.supervisor.local_bricks(volume) {
                let name = Brick::name(&volume.name, i);
                // (Formatting runs a process and issuing makes a key: off the runtime's
                // threads' way.)
                if !self.supervisor.is_running(&name)
                    && let Err(e) = tokio::task::block_in_place(|| {
                        self.prepare_brick(&volume.name, i, &volume.bricks[i])
                    })
                {
                    tracing::error!(brick = %name, error = %format!("{e:#}"), "cannot prepare brick");
                }
                wanted.insert(name);
            }
            self.keep_removed_awhile(volume, &seen_before, &mut removed, &mut wanted);
            self.supervisor.start_volume(volume);
            if self.supervisor.options_changed(volume) {
                self.supervisor.push(volume, generation).await;
                pushed = true;
            }
        }
        self.supervisor.stop_unwanted(&wanted).await;
        // The host's report is renewed at once when its bricks changed, or when they were
        // given options another daemon committed (its `volume set` waits for the report);
        // otherwise at its next tick, sparing etcd a write (half the writes of a `volume set`
        // made here on a started volume).
        let acted = (pushed && foreign > previous) || self.supervisor.running_names() != before;
        self.applied.send_if_modified(|applied| {
            *applied = generation;
            acted
        });
    }

    /// Adds to `wanted` the bricks of `volume` removed while running here less than
    /// [`REMOVED_BRICK_GRACE`] ago, noting in `removed` when each was first seen removed
    /// (`seen_before`, or now).
    fn keep_removed_awhile(
        &self,
        volume: &Volume,
        seen_before: &HashMap<String, Instant>,
        removed: &mut HashMap<String, Instant>,
        wanted: &mut HashSet<String>,
    ) {
        for (i, brick) in volume.bricks.iter().enumerate() {
            let name = Brick::name(&volume.name, i);
            if brick.role.in_service()
                || !self.supervisor.is_local(brick)
                || !self.supervisor.is_running(&name)
            {
                continue;
            }
            let seen = seen_before.get(&name).copied().unwrap_or_else(Instant::now);
            if seen.elapsed() < REMOVED_BRICK_GRACE {
                removed.insert(name.clone(), seen);
                wanted.insert(name);
            }
        }
    }
}

/// Sleeps until `when`; forever without one.
async fn sleep_until(when: Option<Instant>) {
    match when {
        Some(when) => tokio::time::sleep_until(when.into()).await,
        None => std::future::pending().await,
    }
}
