//! Directories: OPENDIR (and OPENDIR_LIST, with its first entries), READDIR, READDIRP,
//! FSYNCDIR. io_uring has no getdents: a listing is read on the blocking pool, its entries'
//! stats and xattr presence in the same call (one hand-off per READDIRP).

use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};

use kiln_wire::limits::{READDIR_ENTRY_BYTES, READDIRP_ENTRY_BYTES};
use kiln_wire::{
    Creds, DirEntry, DirEntryPlus, DirEntryXattrs, FdId, FileType, Gfid, LeaseKind, Name,
    OpenReply, OpendirList, OpendirListReply, ReaddirReply, ReaddirpReply, ReaddirpXattrsReply,
    XattrPresence,
};
use rustix::fs::AtFlags;
use rustix::io::Errno;

use super::xattr::presence_at;
use super::{Fops, R, iatt, lock};
use crate::brick::GLUSTERFS_DIR;
use crate::creds::ActAs;
use crate::exec::Exec;
use crate::fdtable::{OpenFile, OpenKind, SessionId};
use crate::leases::Cover;
use crate::op::fd_path;
use crate::op::{self, DirFd, FileRef, Step, cstr};

impl<E: Exec> Fops<E> {
    pub(super) async fn opendir(
        &self,
        session: SessionId,
        creds: &Creds,
        gfid: &Gfid,
    ) -> R<OpenReply> {
        // Through `/proc/self/fd/N` of the held fd, not `N/.`: opening a directory for reading
        // needs read permission on it, not search permission (its owner may have taken that
        // away, as with mode 0600).
        let dir = self.dir(gfid).await?;
        let open = op::Open {
            name: fd_path(&dir),
            dir,
            flags: libc::O_RDONLY | libc::O_DIRECTORY,
            mode: 0,
            fixed: false,
        };
        let FileRef::Fd(dir) = self.run_one(Step::caller(open, creds)).await? else {
            return Err(op::invariant("a plain open gave a direct descriptor"));
        };
        let stream = Arc::new(Mutex::new(()));
        let fd = self.insert_open(
            session,
            OpenFile {
                gfid: *gfid,
                kind: OpenKind::Dir { dir, stream },
            },
        )?;
        Ok(OpenReply { fd })
    }

    fn dir_fd(&self, session: SessionId, fd: FdId) -> R<(Gfid, DirFd, Arc<Mutex<()>>)> {
        match self.open_file(session, fd)? {
            OpenFile {
                gfid,
                kind: OpenKind::Dir { dir, stream },
            } => Ok((gfid, dir, stream)),
            _ => Err(Errno::NOTDIR),
        }
    }

    pub(super) async fn fsyncdir(
        &self,
        session: SessionId,
        fd: FdId,
        datasync: bool,
    ) -> R<kiln_wire::Done> {
        let (_, dir, _) = self.dir_fd(session, fd)?;
        let fsync = op::Fsync {
            file: FileRef::Fd(dir),
            datasync,
        };
        let result = self.run1(Step::brick(fsync)).await.map(drop);
        self.poison_on_fsync_error(result)?;
        Ok(kiln_wire::Done {})
    }

    pub(super) async fn readdir(
        &self,
        session: SessionId,
        fd: FdId,
        offset: u64,
        size: u32,
    ) -> R<ReaddirReply> {
        let (gfid, dir, stream) = self.dir_fd(session, fd)?;
        let (size, root) = (size as usize, gfid.is_root());
        let (names, eof) = self
            .exec
            .blocking(move || read_dir(&dir, &stream, root, offset, size, READDIR_ENTRY_BYTES))
            .await?;
        let entries = names
            .into_iter()
            .filter_map(|e| {
                Some(DirEntry {
                    offset: e.cookie,
                    ino: e.ino,
                    file_type: e.file_type.unwrap_or(FileType::Regular),
                    name: Name::new(e.name).ok()?,
                })
            })
            .collect();
        Ok(ReaddirReply { entries, eof })
    }

    /// READDIRP: the entries with their attributes. Reading the names needs read permission
    /// (checked when the directory was opened); their attributes need search permission on
    /// it, as `stat` of each name would, so a caller without it gets EACCES.
    pub(super) async fn readdirp(
        &self,
        session: SessionId,
        creds: &Creds,
        fd: FdId,
        offset: u64,
        size: u32,
    ) -> R<ReaddirpReply> {
        let (listed, eof) = self.list(session, creds, fd, offset, size, false).await?;
        let entries = listed.into_iter().map(|(e, _)| e).collect();
        Ok(ReaddirpReply { entries, eof })
    }

    /// The entries of open directory `fd` from cookie `offset`, with their attributes and,
    /// when `probe` is set, the presence of the probed xattrs ([`XattrPresence::UNKNOWN`]
    /// otherwise); and whether the end was reached.
    async fn list(
        &self,
        session: SessionId,
        creds: &Creds,
        fd: FdId,
        offset: u64,
        size: u32,
        probe: bool,
    ) -> R<(Vec<(DirEntryPlus, XattrPresence)>, bool)> {
        let (gfid, dir, stream) = self.dir_fd(session, fd)?;
        let (listing, size, root) = (dir.clone(), size as usize, gfid.is_root());
        let creds = creds.clone();
        let leases = &self.shared.leases;
        // Under a lease, what is read here may be kept until the lease is recalled.
        let began = leases.is_armed().then(|| leases.changes());
        // The names, their stats and what xattrs they have in one call on the blocking pool:
        // a stat that has to read its inode from disk holds up no worker. An entry that
        // vanished meanwhile is left out, and does not cancel the rest.
        let (cookies, named, xattrs, eof) = self
            .exec
            .blocking(move || {
                may_search(&creds, &listing)?;
                let (names, eof) =
                    read_dir(&listing, &stream, root, offset, size, READDIRP_ENTRY_BYTES)?;
                let (mut cookies, mut named, mut xattrs) = (Vec::new(), Vec::new(), Vec::new());
                for e in names {
                    let name_c = cstr(&e.name);
                    let Ok(stat) = op::lstat_at(&listing, &name_c) else {
                        continue;
                    };
                    let Ok(name) = Name::new(e.name) else {
                        continue;
                    };
                    xattrs.push(match probe {
                        true => presence_at(&listing, &name_c),
                        false => XattrPresence::UNKNOWN,
                    });
                    cookies.push(e.cookie);
                    named.push((name, stat));
                }
                Ok::<_, Errno>((cookies, named, xattrs, eof))
            })
            .await?;
        let gfids = self.gfids_at(&gfid, &dir, &named).await;
        let mut entries: Vec<_> = (cookies.into_iter().zip(named).zip(gfids).zip(xattrs))
            .filter_map(|(((offset, (name, stat)), g), xattrs)| {
                let entry = DirEntryPlus {
                    offset,
                    name,
                    iatt: iatt(&stat, g.ok()?),
                };
                Some((entry, xattrs))
            })
            .collect();
        if let Some(began) = began {
            let objects: Vec<Gfid> = entries.iter().map(|(e, _)| e.iatt.gfid).collect();
            if leases.cover(session, gfid, began, &objects) == Cover::Restat {
                self.restat(&dir, &mut entries).await?;
            }
        }
        Ok((entries, eof))
    }

    /// Reads the attributes of listed `entries` of `dir` again (an entry whose name now
    /// names another inode, or none, keeps what was read before: the change of the name
    /// recalls the lease).
    async fn restat(&self, dir: &DirFd, entries: &mut [(DirEntryPlus, XattrPresence)]) -> R<()> {
        let names: Vec<_> = entries
            .iter()
            .map(|(e, _)| cstr(e.name.as_bytes()))
            .collect();
        let dir = dir.clone();
        let stats: Vec<R<op::Stat>> = self
            .exec
            .blocking(move || Ok::<_, Errno>(names.iter().map(|n| op::lstat_at(&dir, n)).collect()))
            .await?;
        for ((entry, _), stat) in entries.iter_mut().zip(stats) {
            if let Ok(stat) = stat
                && stat.ino == entry.iatt.ino
            {
                entry.iatt = iatt(&stat, entry.iatt.gfid);
            }
        }
        Ok(())
    }

    /// OPENDIR_LIST: OPENDIR, then READDIRP_XATTRS from the start through the new fd; the
    /// lease (taken by [`Fops::call_with`] before) comes back in the reply, or is given back
    /// when either fails.
    pub(super) async fn opendir_list(
        &self,
        session: SessionId,
        creds: &Creds,
        r: OpendirList,
    ) -> R<OpendirListReply> {
        let listed = async {
            let OpenReply { fd } = self.opendir(session, creds, &r.gfid).await?;
            match self
                .readdirp_xattrs(session, creds, fd, 0, r.size.get())
                .await
            {
                Ok(listing) => Ok((fd, listing)),
                Err(e) => {
                    let _ = self.release(session, fd, true).await;
                    Err(e)
                }
            }
        };
        match listed.await {
            Ok((fd, listing)) => Ok(OpendirListReply {
                fd,
                lease: r.lease,
                listing,
            }),
            Err(e) => {
                // The client never learns of the lease it took.
                if r.lease != LeaseKind::None {
                    self.shared.leases.give_back(session, r.gfid, r.lease);
                }
                Err(e)
            }
        }
    }

    /// READDIRP_XATTRS: READDIRP, each entry with the presence of the probed xattrs.
    pub(super) async fn readdirp_xattrs(
        &self,
        session: SessionId,
        creds: &Creds,
        fd: FdId,
        offset: u64,
        size: u32,
    ) -> R<ReaddirpXattrsReply> {
        let (listed, eof) = self.list(session, creds, fd, offset, size, true).await?;
        let entries = listed
            .into_iter()
            .map(|(e, xattrs)| DirEntryXattrs {
                offset: e.offset,
                name: e.name,
                iatt: e.iatt,
                xattrs,
            })
            .collect();
        Ok(ReaddirpXattrsReply { entries, eof })
    }
}

/// Whether `creds` may search directory `dir` (stat the names in it).
fn may_search(creds: &Creds, dir: &DirFd) -> R<()> {
    let _as = ActAs::new(creds)?;
    let access = rustix::fs::Access::EXEC_OK;
    rustix::fs::accessat(rustix::fs::CWD, &*fd_path(dir), access, AtFlags::EACCESS)
}

/// One directory entry read by `getdents64`.
#[derive(Debug)]
pub(crate) struct RawEntry {
    pub name: Vec<u8>,
    pub ino: u64,
    pub cookie: u64,
    pub file_type: Option<FileType>,
}

/// Reads entries of `dir` from cookie `offset` until about `size` bytes of reply (each entry
/// costs its name plus `per_entry` bytes), hiding `.`, `..` and, in the root, `.glusterfs`.
/// Returns the entries and whether the end was reached.
pub(crate) fn read_dir(
    dir: &DirFd,
    stream: &Mutex<()>,
    is_root: bool,
    offset: u64,
    size: usize,
    per_entry: usize,
) -> R<(Vec<RawEntry>, bool)> {
    use std::mem::MaybeUninit;
    // The fd's position is shared: one READDIR at a time seeks and reads it.
    let _stream = lock(stream);
    rustix::fs::seek(dir, rustix::fs::SeekFrom::Start(offset))?;
    let mut buf = vec![MaybeUninit::<u8>::uninit(); 32 * 1024];
    let mut raw = rustix::fs::RawDir::new(dir.as_fd(), &mut buf);
    let mut out = Vec::new();
    let mut used = 0;
    while let Some(entry) = raw.next() {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name == b"." || name == b".." || (is_root && name == GLUSTERFS_DIR.as_bytes()) {
            continue;
        }
        let cost = name.len() + per_entry;
        if used + cost > size && !out.is_empty() {
            // Stop before this entry; the caller continues from the previous cookie.
            return Ok((out, false));
        }
        used += cost;
        let file_type = match entry.file_type() {
            rustix::fs::FileType::RegularFile => Some(FileType::Regular),
            rustix::fs::FileType::Directory => Some(FileType::Directory),
            rustix::fs::FileType::Symlink => Some(FileType::Symlink),
            rustix::fs::FileType::Fifo => Some(FileType::Fifo),
            rustix::fs::FileType::Socket => Some(FileType::Socket),
            rustix::fs::FileType::CharacterDevice => Some(FileType::CharDevice),
            rustix::fs::FileType::BlockDevice => Some(FileType::BlockDevice),
            _ => None,
        };
        out.push(RawEntry {
            name: name.to_vec(),
            ino: entry.ino(),
            cookie: entry.next_entry_cookie(),
            file_type,
        });
    }
    Ok((out, true))
}
