//! What the kernel's page cache of a file holds, as far as the mount knows.
//!
//! The kernel keeps a file's pages across opens (`FOPEN_KEEP_CACHE`). Left to itself
//! (`FUSE_AUTO_INVAL_DATA`) it drops them whenever an attribute refresh shows another mtime or
//! size than the one it holds — which every write through the mount causes, since the
//! attributes the kernel holds predate the brick's mtime of that write: a file written here and
//! read back was read again from the brick. Where every page it keeps is covered by a lease
//! (file leases on), the mount asks the kernel to drop pages only when told
//! (`FUSE_EXPLICIT_INVAL_DATA`) and tells it: it keeps per file the brick's mtime and size the
//! kernel's pages match (a [`Stamp`]), moves the stamp along with its own changes (a WRITE,
//! truncate or new times whose attributes before the change are the stamp; a PUT), and drops
//! the pages when the brick shows the file otherwise — another client changed it.
//!
//! What another client sees stays close-to-open: an open for reading that takes a lease keeps
//! the pages only when the brick, asked after the grant, still shows the stamp (see
//! `Shared::ask_file_lease`), and a change from elsewhere recalls the lease first.

use kiln_wire::{Iatt, Timespec};

/// The brick's mtime and size of a file, as one version of its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Stamp {
    mtime: Timespec,
    size: u64,
}

impl Stamp {
    pub(super) fn of(iatt: &Iatt) -> Stamp {
        Stamp {
            mtime: iatt.mtime,
            size: iatt.size,
        }
    }
}

/// One file's pages in the kernel, as the mount knows them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Pages {
    /// The version of the data the pages match; `None` until the brick showed one (the
    /// kernel then holds no page that could be stale).
    stamp: Option<Stamp>,
    /// Whether the kernel may hold pages this mount wrote (not dropped since): worth asking
    /// the brick for the stamp when a lease is taken, rather than reading them again.
    written: bool,
}

impl Pages {
    /// The brick shows the file as `seen`: whether the kernel's pages must go.
    pub(super) fn seen(&mut self, seen: Stamp) -> bool {
        let stale = self.stamp.is_some_and(|s| s != seen);
        self.stamp = Some(seen);
        if stale {
            self.written = false;
        }
        stale
    }

    /// This mount changed the file's data on the brick from version `before` (`None`: it made
    /// the file) to `after`, the kernel's pages holding the change: whether they must go (the
    /// brick had changed since the version they match).
    pub(super) fn changed(&mut self, before: Option<Stamp>, after: Stamp) -> bool {
        let stale = matches!((self.stamp, before), (Some(s), Some(b)) if s != b);
        self.stamp = Some(after);
        self.written = !stale;
        stale
    }

    /// The kernel's pages were dropped, or hold what the brick refused.
    pub(super) fn dropped(&mut self) {
        *self = Pages::default();
    }

    /// The version the kernel's pages this mount wrote match, if it may hold any.
    pub(super) fn written(&self) -> Option<Stamp> {
        self.stamp.filter(|_| self.written)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp(size: u64) -> Stamp {
        Stamp {
            mtime: Timespec::default(),
            size,
        }
    }

    #[test]
    fn the_first_version_seen_drops_nothing_and_a_later_one_drops_the_pages() {
        let mut pages = Pages::default();
        assert!(!pages.seen(stamp(1)));
        assert!(!pages.seen(stamp(1)));
        assert!(pages.seen(stamp(2)), "another client changed it");
        assert!(!pages.seen(stamp(2)));
    }

    #[test]
    fn changes_made_here_move_the_stamp_and_keep_the_pages() {
        let mut pages = Pages::default();
        assert!(!pages.changed(None, stamp(4096)), "a PUT");
        assert_eq!(pages.written(), Some(stamp(4096)));
        assert!(!pages.changed(Some(stamp(4096)), stamp(8192)), "a WRITE");
        assert!(!pages.seen(stamp(8192)), "its own change seen later");
        assert_eq!(pages.written(), Some(stamp(8192)));
    }

    #[test]
    fn a_change_from_a_version_the_pages_do_not_match_drops_them() {
        let mut pages = Pages::default();
        assert!(!pages.seen(stamp(1)));
        assert!(
            pages.changed(Some(stamp(5)), stamp(6)),
            "another client wrote first"
        );
        assert_eq!(pages.written(), None);
        assert!(!pages.seen(stamp(6)));
        pages.dropped();
        assert!(!pages.seen(stamp(7)), "nothing left to be stale");
    }
}
