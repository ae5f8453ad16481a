//! New regular files made whole before they are named: an unnamed file (`O_TMPFILE`) in the
//! parent gets its GFID, its data and (a PUT's) attributes, then its name (the commit) and its
//! handle, both linked from the open file — no intent record per file.
//!
//! Crash safety: before it is named the file is nothing (the kernel frees an unnamed inode
//! when its fd goes); once named it carries its GFID and data. The one window left — named
//! but without its handle — is covered by the parent's `dir` record ([`super::dir_record`]).

use std::ffi::CString;

use bytes::Bytes;
use kiln_wire::{Creds, EntryReply, FopCode, Gfid, SetAttr};

use super::super::chain::{At, Chain};
use super::super::{Fops, ParentAttrs, R, iatt};
use super::parent_iatt;
use crate::brick::{Brick, GFID_XATTR};
use crate::exec::Exec;
use crate::op::{self, DirFd, FileRef, Stat, Step, cstr};

/// What the new file is.
#[derive(Debug)]
pub(super) struct NewFile<'a> {
    pub(super) parent: Gfid,
    pub(super) dir: &'a DirFd,
    pub(super) name: &'a CString,
    pub(super) gfid: Gfid,
    /// Open flags: the access mode and what else the caller asked, without `O_CREAT`.
    pub(super) flags: i32,
    pub(super) mode: u32,
    pub(super) data: Option<Bytes>,
    /// Attributes set after the data, before the name (a PUT's).
    pub(super) attr: SetAttr,
    pub(super) parents: ParentAttrs,
}

/// The steps of an unnamed-file chain the fop reads back.
#[derive(Debug)]
pub(super) struct FileSteps {
    pub(super) pre: Option<At<Stat>>,
    pub(super) opened: At<FileRef>,
    /// The name linked: the commit point.
    pub(super) named: At<()>,
    pub(super) handle: At<()>,
    pub(super) stat: At<Stat>,
    pub(super) post: Option<At<Stat>>,
}

impl<E: Exec> Fops<E> {
    /// Whether a new regular file opened with `flags` is made unnamed first: the file system
    /// must support it and `O_TMPFILE` needs write access.
    pub(super) fn makes_unnamed(&self, flags: i32) -> bool {
        self.brick.tmpfile && flags & libc::O_ACCMODE != libc::O_RDONLY
    }

    /// The chain that makes `file`: unnamed, its GFID, its data, its name, its handle.
    pub(super) fn unnamed_file_chain(&self, creds: &Creds, file: &NewFile) -> (Chain, FileSteps) {
        let (dir, name) = (file.dir, file.name);
        let mut chain = Chain::new();
        let pre = file.parents.push(&mut chain, dir);
        let flags = file.flags & !(libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC);
        let open = op::Open {
            dir: dir.clone(),
            name: cstr(b"."),
            flags: flags | libc::O_TMPFILE,
            mode: file.mode,
            fixed: false,
        };
        let opened = chain.push(Step::caller(open, creds).barrier());
        // Nothing is named unless it is whole: its GFID and data steps are barriers.
        let gfid = op::FSetXattr {
            file: FileRef::Chain,
            name: cstr(GFID_XATTR.as_bytes()),
            value: file.gfid.as_bytes().to_vec(),
            flags: libc::XATTR_CREATE,
        };
        chain.push::<()>(Step::brick(gfid).barrier());
        if let Some(data) = &file.data {
            self.push_data(&mut chain, creds, data.clone(), true);
        }
        if !file.attr.is_empty() {
            let attr = op::SetAttrs {
                file: FileRef::Chain,
                attr: file.attr,
            };
            chain.push::<()>(Step::caller(attr, creds).barrier());
        }
        // Both links from the open file, so the handle is made even when the name fails (and
        // then undone): it never names another object that held the name. A root caller acts
        // with the brick's own capabilities.
        let by_fd = self.brick.link_by_fd;
        let named = chain.push(Step::caller(
            op::LinkFile::chain_file(dir.clone(), name.clone(), by_fd && creds.uid == 0),
            creds,
        ));
        let handle = chain.push(Step::brick(op::LinkFile::chain_file(
            self.brick.handle_dir(&file.gfid).clone(),
            Brick::handle_name(&file.gfid),
            by_fd,
        )));
        // The file itself, not its name: no lookup, and nothing another fop renamed there.
        let stat = chain.push(Step::brick(op::Fstat {
            file: FileRef::Chain,
        }));
        let post = file.parents.push(&mut chain, dir);
        let steps = FileSteps {
            pre,
            opened,
            named,
            handle,
            stat,
            post,
        };
        (chain, steps)
    }

    /// Makes `file` (see the module doc): the reply and the open file. EEXIST when the name is
    /// taken, for the caller to tell a retry from another object.
    pub(super) async fn make_file(
        &self,
        fop: FopCode,
        creds: &Creds,
        file: &NewFile<'_>,
    ) -> R<(EntryReply, FileRef)> {
        let under_record = self.under_dir_record(&file.parent).await?;
        let (chain, steps) = self.unnamed_file_chain(creds, file);
        let mut results = match self.run_namespace(fop, chain).await {
            Ok(results) => results,
            Err(e) => {
                // Only a crash point stops a chain, and a killed brick finishes nothing: the
                // directory's record stays for start-up repair.
                std::mem::forget(under_record);
                return Err(e);
            }
        };
        let opened = results.take(steps.opened)?;
        self.excuse_healed_handle(&mut results, steps.handle, steps.stat, &file.gfid)
            .await;
        if let Some(e) = results.first_error() {
            // Newest first; the record covers a name left without its handle meanwhile.
            if results.ok(steps.handle) {
                let handle_dir = self.brick.handle_dir(&file.gfid).clone();
                self.unlink_quietly(&handle_dir, &Brick::handle_name(&file.gfid), false)
                    .await;
            }
            if results.ok(steps.named) {
                self.unlink_quietly(file.dir, file.name, false).await;
            }
            return Err(e);
        }
        let stat = results.take(steps.stat)?;
        self.remember_gfid(&stat, file.gfid);
        let reply = EntryReply {
            iatt: iatt(&stat, file.gfid),
            pre_parent: parent_iatt(&mut results, steps.pre, file.parent)?,
            post_parent: parent_iatt(&mut results, steps.post, file.parent)?,
        };
        Ok((reply, opened))
    }
}
