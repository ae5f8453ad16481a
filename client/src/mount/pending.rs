//! Small files created with one PUT at close.
//!
//! A program that creates a file, writes a little, sets its mode, owner and times and closes
//! it (tar, cp, git, a mail delivery) costs a CREATE, WRITEs, SETATTRs and a RELEASE: one round
//! trip each. When the kernel allows it — a CREATE the mount can answer itself — the file is
//! kept here instead: its GFID is chosen by the client anyway, its attributes follow from the
//! caller, and its data and attribute changes are gathered until the first close (or until
//! anything else needs it on the brick), which sends them as one PUT.
//!
//! What the caller gives up is when errors show: a create that the brick refuses (the brick
//! is full) fails the `close`, as a write-back cache does. Only creates that look certain
//! are deferred: of a name the mount knows free under a lease on its directory (another
//! client's create of it recalls the lease, and the recall sends the file first), where the
//! parent's permissions are known and allow it, and the caller asked for nothing synchronous.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use kiln_wire::{
    Creds, FileType, FopReply, Gfid, Iatt, Mode, Name, OpenFlags, Payload, PutSynced, SetAttr,
    TimeSet,
};

use super::leases::{new_iatt, now};
use crate::{Error, Layer};

/// Bytes a deferred file may gather before it is sent and written through an fd instead:
/// what one PUT carries, as one WRITE does.
pub(crate) const DEFERRED_BYTES_MAX: usize = kiln_wire::limits::IO_SIZE_MAX_BYTES;

/// A created file not yet on the brick.
#[derive(Debug)]
pub(crate) struct Pending {
    pub(crate) parent: Gfid,
    pub(crate) name: Name,
    creds: Creds,
    /// The mode asked at create, and the caller's umask.
    mode: Mode,
    umask: Mode,
    exclusive: bool,
    data: Vec<u8>,
    /// Attribute changes gathered since the create (applied by the PUT after the data).
    attr: SetAttr,
    /// What the kernel is told the file looks like.
    iatt: Iatt,
    /// When the create was answered.
    made_at: std::time::Instant,
}

/// The parent directory's attributes that decide a create: who may, and the new file's group.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ParentAttr {
    pub(crate) mode: u32,
    pub(crate) uid: u32,
    pub(crate) gid: u32,
}

impl ParentAttr {
    /// Whether `creds` may create in the directory (write and search permission).
    pub(crate) fn allows_create(&self, creds: &Creds) -> bool {
        if creds.uid == 0 {
            return true;
        }
        let bits = if creds.uid == self.uid {
            self.mode >> 6
        } else if creds.gid == self.gid || creds.groups.as_slice().contains(&self.gid) {
            self.mode >> 3
        } else {
            self.mode
        };
        bits & 0o3 == 0o3
    }
}

impl Pending {
    /// The file `create` makes, by `creds` in a directory with `parent_attr`, as the kernel
    /// should see it at once.
    pub(crate) fn new(create: kiln_wire::Create, parent_attr: ParentAttr, creds: Creds) -> Pending {
        let kiln_wire::Create {
            parent,
            name,
            gfid,
            mode,
            umask,
            flags,
            ..
        } = create;
        // A set-group-ID directory gives its group to new files.
        let gid = if parent_attr.mode & libc::S_ISGID != 0 {
            parent_attr.gid
        } else {
            creds.gid
        };
        let mode_bits = mode.bits() & !umask.bits();
        let iatt = new_iatt(gfid, FileType::Regular, mode_bits, creds.uid, gid, 0);
        Pending {
            parent,
            name,
            creds,
            mode,
            umask,
            exclusive: flags.bits() & OpenFlags::EXCL.bits() != 0,
            data: Vec::new(),
            attr: SetAttr::default(),
            iatt,
            made_at: std::time::Instant::now(),
        }
    }

    pub(crate) fn iatt(&self) -> Iatt {
        self.iatt.clone()
    }

    /// Gathers a write; `false` when the file would grow past [`DEFERRED_BYTES_MAX`].
    pub(crate) fn write(&mut self, offset: u64, data: &[u8]) -> bool {
        let Some(end) = usize::try_from(offset)
            .ok()
            .and_then(|o| o.checked_add(data.len()))
            .filter(|&end| end <= DEFERRED_BYTES_MAX)
        else {
            return false;
        };
        if self.data.len() < end {
            self.data.resize(end, 0);
        }
        let start = end - data.len();
        self.data[start..end].copy_from_slice(data);
        let now = now();
        self.iatt.size = self.data.len() as u64;
        self.iatt.blocks = self.iatt.size.div_ceil(4096) * 8;
        self.iatt.mtime = now;
        self.iatt.ctime = now;
        true
    }

    /// A write by a caller without `CAP_FSETID`, or a chown: see [`killed_suidgid`].
    pub(crate) fn kill_suidgid(&mut self) {
        let mode = killed_suidgid(self.iatt.mode);
        if mode != self.iatt.mode {
            self.iatt.mode = mode;
            self.attr.mode = Some(mode);
        }
    }

    /// The file's content so far.
    pub(crate) fn data(&self) -> &[u8] {
        &self.data
    }

    /// The bytes at `offset` (fewer at the end).
    pub(crate) fn read(&self, offset: u64, size: u32) -> Bytes {
        let start = usize::try_from(offset)
            .unwrap_or(usize::MAX)
            .min(self.data.len());
        let end = start.saturating_add(size as usize).min(self.data.len());
        Bytes::copy_from_slice(&self.data[start..end])
    }

    /// Gathers an attribute change by `creds`; `false` when it must run on the brick (it
    /// may be refused, or is not the creator's to make without a check).
    pub(crate) fn setattr(&mut self, creds: &Creds, mut attr: SetAttr) -> bool {
        // tar's `fchown` to the owner and group the file was made with changes nothing (a
        // new file has no set-ID bits for it to drop): the brick is spared the call.
        let same = |new: Option<u32>, now: u32| new.is_none_or(|n| n == now);
        if (creds.uid == 0 || creds.uid == self.creds.uid)
            && same(attr.uid, self.iatt.uid)
            && same(attr.gid, self.iatt.gid)
            && self.iatt.mode.bits() & SET_ID_BITS == 0
        {
            (attr.uid, attr.gid) = (None, None);
        }
        let owner_ok = creds.uid == 0 || (creds.uid == self.creds.uid && attr.uid.is_none());
        let group_ok = creds.uid == 0 || attr.gid.is_none_or(|g| g == self.iatt.gid);
        if !owner_ok || !group_ok {
            return false;
        }
        if let Some(size) = attr.size {
            let Ok(size) = usize::try_from(size) else {
                return false;
            };
            if size > DEFERRED_BYTES_MAX {
                return false;
            }
            self.data.resize(size, 0);
            self.iatt.size = size as u64;
            self.iatt.blocks = self.iatt.size.div_ceil(4096) * 8;
            self.iatt.mtime = now();
        }
        if attr.uid.is_some() || attr.gid.is_some() {
            // A chown drops the set-ID bits, root's too; a mode set with it comes after.
            self.kill_suidgid();
        }
        let now = now();
        if let Some(mode) = attr.mode {
            self.attr.mode = Some(mode);
            self.iatt.mode = mode;
        }
        if let Some(uid) = attr.uid {
            self.attr.uid = Some(uid);
            self.iatt.uid = uid;
        }
        if let Some(gid) = attr.gid {
            self.attr.gid = Some(gid);
            self.iatt.gid = gid;
        }
        // "Now" is taken now, not when the PUT runs.
        let at = |t: TimeSet| match t {
            TimeSet::Now => TimeSet::At(now),
            at => at,
        };
        if let Some(t) = attr.atime.map(at) {
            self.attr.atime = Some(t);
            if let TimeSet::At(ts) = t {
                self.iatt.atime = ts;
            }
        }
        if let Some(t) = attr.mtime.map(at) {
            self.attr.mtime = Some(t);
            if let TimeSet::At(ts) = t {
                self.iatt.mtime = ts;
            }
        }
        self.iatt.ctime = now;
        true
    }

    /// The creator, as whom the file is sent.
    pub(crate) fn creds(&self) -> &Creds {
        &self.creds
    }

    /// The PUT that makes the file on the brick.
    pub(crate) fn into_put(mut self) -> Result<kiln_wire::Put, Error> {
        let data = std::mem::take(&mut self.data);
        self.put_of(Bytes::from(data))
    }

    /// Sends the file to the brick as one PUT, or PUT_SYNCED (`synced`), as its creator (its
    /// bytes move into the PUT); its attributes and content then.
    async fn send(self, layer: &impl Layer, synced: bool) -> Result<(Iatt, Bytes), Error> {
        let creds = self.creds.clone();
        let put = self.into_put()?;
        let content = put.data.clone().into_bytes();
        let fop = match synced {
            true => PutSynced { put }.into(),
            false => put.into(),
        };
        match layer.call(&creds, fop).await? {
            FopReply::Put(r) | FopReply::PutSynced(r) => Ok((r.iatt, content)),
            other => Err(Error::Protocol(format!(
                "a {} reply to PUT",
                other.code().name()
            ))),
        }
    }

    fn put_of(&self, data: Bytes) -> Result<kiln_wire::Put, Error> {
        let data = Payload::new(data)
            .map_err(|e| Error::Fop(kiln_wire::ErrorCode::from_errno(e.errno())))?;
        Ok(kiln_wire::Put {
            parent: self.parent,
            name: self.name.clone(),
            gfid: self.iatt.gfid,
            mode: self.mode,
            umask: self.umask,
            flags: if self.exclusive {
                OpenFlags::EXCL
            } else {
                OpenFlags::empty()
            },
            data,
            // Applied after the data, so the times stand: the caller's, else those the mount
            // described the file with (its create and last write).
            attr: SetAttr {
                atime: self.attr.atime.or(Some(TimeSet::At(self.iatt.atime))),
                mtime: self.attr.mtime.or(Some(TimeSet::At(self.iatt.mtime))),
                ..self.attr
            },
        })
    }
}

/// The set-user-ID and set-group-ID bits of a mode.
const SET_ID_BITS: u32 = libc::S_ISUID | libc::S_ISGID;

/// File mode `mode` after a chown, or a write by a caller without `CAP_FSETID`, as the
/// kernel leaves a local file's: without the set-user-ID bit, and without the set-group-ID bit where group
/// execute is set (without it, the bit marks mandatory locking and stays).
pub(crate) fn killed_suidgid(mode: Mode) -> Mode {
    let bits = mode.bits();
    let killed = match bits & libc::S_IXGRP {
        0 => libc::S_ISUID,
        _ => SET_ID_BITS,
    };
    Mode::from_st_mode(bits & !killed)
}

/// The deferred creates of a mount, by node id.
#[derive(Debug, Default)]
pub(crate) struct PendingCreates {
    files: Mutex<HashMap<u64, Arc<tokio::sync::Mutex<Option<Pending>>>>>,
    /// Creates the brick refused when something else sent them, kept for the file's close
    /// to report (errno).
    failed: Mutex<HashMap<u64, i32>>,
}

impl PendingCreates {
    pub(crate) fn insert(&self, ino: u64, pending: Pending) {
        self.lock()
            .insert(ino, Arc::new(tokio::sync::Mutex::new(Some(pending))));
    }

    /// The deferred file of node `ino`, if it is one.
    pub(crate) fn get(&self, ino: u64) -> Option<Arc<tokio::sync::Mutex<Option<Pending>>>> {
        self.lock().get(&ino).cloned()
    }

    /// Whether node `ino` is a deferred file not yet sent (or being sent).
    pub(crate) fn contains(&self, ino: u64) -> bool {
        self.lock().contains_key(&ino)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Nothing deferred and no refusal waiting for a close to report it.
    pub(crate) fn is_idle(&self) -> bool {
        self.is_empty()
            && self
                .failed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty()
    }

    /// The attributes of the deferred file `name` in `parent`, if there is one.
    pub(crate) async fn find(&self, parent: Gfid, name: &Name) -> Option<Iatt> {
        if self.is_empty() {
            return None;
        }
        let files: Vec<_> = self.lock().values().cloned().collect();
        for pending in files {
            if let Some(p) = pending.lock().await.as_ref()
                && p.parent == parent
                && p.name == *name
            {
                return Some(p.iatt());
            }
        }
        None
    }

    /// Node ids of deferred files in directory `parent` (all of them when `None`).
    pub(crate) async fn in_dir(&self, parent: Option<Gfid>) -> Vec<u64> {
        let files: Vec<_> = self
            .lock()
            .iter()
            .map(|(ino, p)| (*ino, p.clone()))
            .collect();
        let mut found = Vec::new();
        for (ino, pending) in files {
            if let Some(p) = pending.lock().await.as_ref()
                && parent.is_none_or(|g| p.parent == g)
            {
                found.push(ino);
            }
        }
        found
    }

    /// Node ids of deferred files answered at least `age` ago (those not being worked on
    /// this moment).
    pub(crate) fn older_than(&self, age: std::time::Duration) -> Vec<u64> {
        self.lock()
            .iter()
            .filter(|(_, p)| {
                p.try_lock()
                    .is_ok_and(|p| p.as_ref().is_some_and(|p| p.made_at.elapsed() >= age))
            })
            .map(|(ino, _)| *ino)
            .collect()
    }

    /// Sends node `ino`'s file to the brick if it is still deferred, fsynced there too when
    /// `synced`; its attributes and content then. Once settled (or refused) the node is an
    /// ordinary one.
    pub(crate) async fn settle(
        &self,
        layer: &impl Layer,
        ino: u64,
        synced: bool,
    ) -> Result<Option<(Iatt, Bytes)>, Error> {
        let Some(slot) = self.get(ino) else {
            return Ok(None);
        };
        let mut slot = slot.lock().await;
        let Some(pending) = slot.take() else {
            return Ok(None);
        };
        let name = pending.name.clone();
        let result = pending.send(layer, synced).await;
        self.lock().remove(&ino);
        if let Err(e) = &result {
            tracing::warn!(?name, error = %e, "a deferred create failed");
            let errno = match e {
                Error::Fop(code) => code.to_errno(),
                _ => libc::EIO,
            };
            self.failed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(ino, errno);
        }
        result.map(Some)
    }

    /// Takes node `ino`'s file out of the deferred creates (to be sent another way).
    pub(crate) async fn take(&self, ino: u64) -> Option<Pending> {
        let slot = self.get(ino)?;
        let pending = slot.lock().await.take();
        self.lock().remove(&ino);
        pending
    }

    /// The errno of node `ino`'s deferred create if the brick refused it, once.
    pub(crate) fn take_failure(&self, ino: u64) -> Option<i32> {
        self.failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&ino)
    }

    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<tokio::sync::Mutex<Option<Pending>>>>> {
        self.files.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds(uid: u32, gid: u32) -> Creds {
        Creds {
            uid,
            gid,
            groups: kiln_wire::Groups::default(),
            pid: 1,
        }
    }

    fn pending(parent_mode: u32) -> Pending {
        let gfid = Gfid::from_bytes([7; 16]).expect("gfid");
        let create = kiln_wire::Create {
            parent: Gfid::ROOT,
            name: Name::new(Bytes::from_static(b"f")).expect("name"),
            gfid,
            access: kiln_wire::AccessMode::WriteOnly,
            flags: OpenFlags::EXCL,
            mode: Mode::new(0o666).expect("mode"),
            umask: Mode::new(0o022).expect("umask"),
        };
        let parent = ParentAttr {
            mode: parent_mode,
            uid: 0,
            gid: 50,
        };
        Pending::new(create, parent, creds(1000, 1000))
    }

    #[test]
    fn writes_gather_within_the_limit() {
        let mut p = pending(0o777);
        assert_eq!(p.iatt().mode.bits(), 0o644);
        assert!(p.write(4, b"tail"));
        assert!(p.write(0, b"head"));
        assert_eq!(&p.read(0, 100)[..], b"headtail");
        assert_eq!(p.iatt().size, 8);
        assert!(!p.write(DEFERRED_BYTES_MAX as u64, b"x"), "past the limit");
        assert_eq!(&p.read(6, 100)[..], b"il");
        assert!(p.read(100, 10).is_empty());
    }

    #[test]
    fn only_safe_attribute_changes_are_gathered() {
        let mut p = pending(0o777);
        let chmod = SetAttr {
            mode: Some(Mode::new(0o600).expect("mode")),
            ..SetAttr::default()
        };
        assert!(p.setattr(&creds(1000, 1000), chmod));
        assert_eq!(p.iatt().mode.bits(), 0o600);
        let give_away = SetAttr {
            uid: Some(0),
            ..SetAttr::default()
        };
        assert!(
            !p.setattr(&creds(1000, 1000), give_away),
            "chown needs the brick"
        );
        assert!(p.setattr(&creds(0, 0), give_away), "root may");
        assert!(!p.setattr(&creds(2000, 2000), chmod), "not the creator");
    }

    #[test]
    fn a_chown_that_changes_nothing_is_not_sent() {
        // tar's `fchown` of a file it made to the owner and group it has.
        let mut p = pending(0o777);
        let chown_to_self = SetAttr {
            uid: Some(1000),
            gid: Some(1000),
            ..SetAttr::default()
        };
        assert!(p.setattr(&creds(1000, 1000), chown_to_self));
        let put = p.into_put().expect("put");
        assert_eq!((put.attr.uid, put.attr.gid), (None, None));

        // It drops set-ID bits: sent.
        let mut p = pending(0o777);
        let setuid = SetAttr {
            mode: Some(Mode::new(0o4755).expect("mode")),
            ..SetAttr::default()
        };
        assert!(p.setattr(&creds(0, 0), setuid));
        assert!(p.setattr(&creds(0, 0), chown_to_self));
        assert_eq!(p.iatt().mode.bits(), 0o755, "as the kernel leaves it");
        let put = p.into_put().expect("put");
        assert_eq!((put.attr.uid, put.attr.gid), (Some(1000), Some(1000)));
        assert_eq!(put.attr.mode, Mode::new(0o755));

        // Another owner: sent.
        let mut p = pending(0o777);
        let to_root = SetAttr {
            uid: Some(0),
            ..SetAttr::default()
        };
        assert!(p.setattr(&creds(0, 0), to_root));
        assert_eq!(p.into_put().expect("put").attr.uid, Some(0));
    }

    #[test]
    fn set_group_id_directories_give_their_group() {
        assert_eq!(pending(0o777).iatt().gid, 1000);
        assert_eq!(pending(0o2777).iatt().gid, 50);
    }

    #[test]
    fn create_permission_follows_the_mode_bits() {
        let dir = ParentAttr {
            mode: 0o750,
            uid: 1,
            gid: 2,
        };
        assert!(dir.allows_create(&creds(0, 0)));
        assert!(dir.allows_create(&creds(1, 9)));
        assert!(!dir.allows_create(&creds(3, 2)), "group has r-x only");
        assert!(!dir.allows_create(&creds(3, 3)));
    }
}
