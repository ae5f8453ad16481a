//! Listings fetched ahead of a walk. When a listing shows the kernel subdirectories, the
//! mount lists the first of them before anything opens them, each under a read lease, and
//! keeps those listings ([`super::leases`]): the `find`, `ls -lR` or `du` that descends next
//! opens them without a round trip while the mount fetches the next ones, instead of waiting
//! for one round trip per directory in turn. Only where a kept listing answers an OPENDIR:
//! with leases, and with the kernel checking permissions itself.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kiln_wire::{Creds, Gfid};
use tokio::sync::{Semaphore, watch};

use super::shared::Shared;
use crate::Layer;

/// Subdirectories of one listing reply fetched ahead. A kept listing may answer only within
/// the kernel's attribute lifetime (`super::leases`): a walk must reach these first.
pub(super) const PREFETCH_SUBDIRS_MAX: usize = 16;

/// Listings the whole mount fetches ahead at once.
const PREFETCH_INFLIGHT_MAX: usize = 4;

/// The mount's listings in flight ahead of a walk.
#[derive(Debug)]
pub(super) struct Prefetch {
    inflight: Semaphore,
    /// Each directory being listed ahead; its channel closes once the listing is kept (or
    /// failed, or the fetch was dropped).
    listing: Mutex<HashMap<Gfid, watch::Receiver<()>>>,
}

impl Default for Prefetch {
    fn default() -> Prefetch {
        Prefetch {
            inflight: Semaphore::new(PREFETCH_INFLIGHT_MAX),
            listing: Mutex::default(),
        }
    }
}

impl Prefetch {
    /// Waits until directory `gfid` is no longer being listed ahead: an OPENDIR that overtook
    /// its walk's prefetch takes the listing kept instead of asking for it again.
    pub(super) async fn wait_for(&self, gfid: &Gfid) {
        let listing = self.lock().get(gfid).cloned();
        if let Some(mut listing) = listing {
            // Nothing is ever sent: this returns when the fetch's sender goes.
            let _ = listing.changed().await;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Gfid, watch::Receiver<()>>> {
        self.listing.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<L: Layer> Shared<L> {
    /// Whether this mount fetches listings ahead.
    pub(super) fn prefetches(&self) -> bool {
        self.options.listing_prefetch && self.options.default_permissions && self.uses_leases()
    }

    /// Lists directories `dirs` (node and GFID, just shown to the kernel by a listing when
    /// the mount had noted `changes` changes) as `c`, one after the other, and keeps each
    /// listing; a failure only means nothing is kept. Stops at the first change noted since:
    /// it drops every kept listing (an `rm -rf` would have each directory listed twice).
    pub(super) async fn prefetch_listings(
        self: Arc<Self>,
        c: Creds,
        dirs: Vec<(u64, Gfid)>,
        changes: u64,
    ) {
        for (ino, gfid) in dirs {
            let Ok(_turn) = self.prefetch.inflight.acquire().await else {
                return;
            };
            if self.leases.changes() != changes {
                return;
            }
            // Kept until the listing is: an OPENDIR of the directory waits for it to go.
            let (_listing, listing) = watch::channel(());
            {
                let mut being_listed = self.prefetch.lock();
                let kept = self.kept_listing(&gfid);
                if kept.is_some() || being_listed.contains_key(&gfid) {
                    continue;
                }
                being_listed.insert(gfid, listing);
            }
            if let Err(errno) = self.list_below(&c, ino, gfid).await {
                tracing::debug!(%gfid, ?errno, "a listing fetched ahead failed");
            }
            self.prefetch.lock().remove(&gfid);
        }
    }
}
