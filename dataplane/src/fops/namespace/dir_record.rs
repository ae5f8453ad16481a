//! A directory's `dir` record ([`crate::brick::intent`]): "files here may be named without
//! their handles". New regular files ([`super::files`]) are named before their handle is
//! linked, and a file's last name is unlinked after its handle ([`super::remove`]); in both
//! windows a crash leaves a named file without a handle, and start-up repair gives every file
//! of a directory with a `dir` record its handle.
//!
//! The record is made before the first such fop in a directory and kept a moment after the
//! last one ([`DIR_RECORD_LINGER`]), so a burst of creates and unlinks in one directory (an
//! untar, an `rm -rf`) shares one record instead of writing one per file.

use std::ffi::CString;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use kiln_wire::Gfid;

use super::super::{BrickState, Fops, R, lock};
use crate::brick::Brick;
use crate::brick::intent::{RecordKind, record_name};
use crate::exec::Exec;
use crate::op::{self, DirFd, Step, cstr};

/// How long a directory's `dir` record stays after its last fop: the next one there in that
/// time needs no new record.
pub(in crate::fops) const DIR_RECORD_LINGER: Duration = Duration::from_secs(1);

/// A directory with fops under its `dir` record (or lately), as [`BrickState`] keeps it.
#[derive(Debug)]
pub(in crate::fops) struct DirRecord {
    record: CString,
    /// Made (once) by the first fop that needs it.
    made: Arc<tokio::sync::OnceCell<()>>,
    active: usize,
    idle_since: Instant,
}

/// A fop under way in `parent` under its `dir` record; when it goes, the directory may
/// become idle. A fop stopped by a crash point forgets it, so the record stays for the
/// reopened brick's repair, as a killed brick's would.
pub(super) struct UnderDirRecord<'a, E> {
    fops: &'a Fops<E>,
    parent: Gfid,
}

impl<E> Drop for UnderDirRecord<'_, E> {
    fn drop(&mut self) {
        let mut records = lock(&self.fops.shared.dir_records);
        if let Some(dir) = records.get_mut(&self.parent) {
            dir.active -= 1;
            dir.idle_since = Instant::now();
        }
    }
}

impl<E: Exec> Fops<E> {
    /// Marks `parent` as having a fop under its `dir` record until the guard goes, making the
    /// record first if it has none.
    pub(super) async fn under_dir_record(&self, parent: &Gfid) -> R<UnderDirRecord<'_, E>> {
        let (made, record) = {
            let mut records = lock(&self.shared.dir_records);
            let dir = records.entry(*parent).or_insert_with(|| DirRecord {
                record: record_name(RecordKind::Dir, parent),
                made: Default::default(),
                active: 0,
                idle_since: Instant::now(),
            });
            dir.active += 1;
            (dir.made.clone(), dir.record.clone())
        };
        let guard = UnderDirRecord {
            fops: self,
            parent: *parent,
        };
        made.get_or_try_init(|| async {
            let symlink = op::Symlink {
                target: cstr(parent.to_string().as_bytes()),
                dir: self.brick.pending.clone(),
                name: record,
            };
            self.run1(Step::brick(symlink)).await.map(drop)
        })
        .await?;
        Ok(guard)
    }
}

impl BrickState {
    /// Removes the `dir` records of directories idle for [`DIR_RECORD_LINGER`]. Under the
    /// lock: a fop that comes for a directory meanwhile finds either its record in place or
    /// none, never one about to go.
    fn sweep_dir_records(&self, pending: &DirFd) {
        lock(&self.dir_records).retain(|_, dir| {
            let keep = dir.active > 0 || dir.idle_since.elapsed() < DIR_RECORD_LINGER;
            if !keep && dir.made.initialized() {
                let record = &*dir.record;
                if let Err(e) = rustix::fs::unlinkat(pending, record, rustix::fs::AtFlags::empty())
                {
                    tracing::warn!(error = %e, ?record, "dir record left for start-up repair");
                }
            }
            keep
        });
    }
}

/// Starts the thread that removes idle `dir` records, every [`DIR_RECORD_LINGER`], until the
/// brick's state is gone. Records left at a stop are settled by the next start's repair.
pub(crate) fn spawn_dir_record_sweeper(
    brick: &Arc<Brick>,
    state: &Arc<BrickState>,
) -> std::io::Result<()> {
    let (brick, state): (Arc<Brick>, Weak<BrickState>) = (brick.clone(), Arc::downgrade(state));
    std::thread::Builder::new()
        .name("kiln-dir-records".into())
        .spawn(move || {
            loop {
                std::thread::sleep(DIR_RECORD_LINGER);
                let Some(state) = state.upgrade() else { return };
                state.sweep_dir_records(&brick.pending);
            }
        })
        .map(drop)
}
