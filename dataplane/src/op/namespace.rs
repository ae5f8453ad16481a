//! Name operations relative to held directory fds: `mkdirat`, `mknodat`, `symlinkat`,
//! `linkat` (of a name, or of an open file that has none: [`LinkFile`]), `renameat2`,
//! `unlinkat`. io_uring has no `mknodat`: MKNOD runs on the pool.

use std::ffi::CString;

use io_uring::{opcode, squeue, types};
use rustix::fs::{AtFlags, Mode, RenameFlags};

use super::{Buf, DirFd, FileRef, RingOp, StepResult, raw, value};

#[derive(Debug)]
pub struct Mkdir {
    pub dir: DirFd,
    pub name: CString,
    pub mode: u32,
}

/// `mknodat`; `mode` carries the file type bits.
#[derive(Debug)]
pub struct Mknod {
    pub dir: DirFd,
    pub name: CString,
    pub mode: u32,
    pub rdev: u64,
}

/// `symlinkat(target, dir, name)`.
#[derive(Debug)]
pub struct Symlink {
    pub target: CString,
    pub dir: DirFd,
    pub name: CString,
}

#[derive(Debug)]
pub struct Link {
    pub old_dir: DirFd,
    pub old_name: CString,
    pub new_dir: DirFd,
    pub new_name: CString,
}

/// Gives an open file with no name (an `O_TMPFILE`) the name `new_dir/new_name`, from its fd.
/// A privileged step (the brick's own, or a root caller's, which keeps the brick's
/// capabilities, when those include `CAP_DAC_READ_SEARCH`: `Brick::link_by_fd`) links it as
/// `linkat(fd, "", new_dir, new_name, AT_EMPTY_PATH)`; any other through `/proc/self/fd/N`
/// (`linkat(AT_FDCWD, path, …, AT_SYMLINK_FOLLOW)`), which needs no privilege beyond the right to
/// make the name but costs a walk of four components, the `/proc` ones among the slowest.
#[derive(Debug)]
pub struct LinkFile {
    pub file: FileRef,
    pub new_dir: DirFd,
    pub new_name: CString,
    privileged: bool,
    /// `/proc/self/fd/N` of `file`, set once the file is known (unprivileged only).
    path: CString,
}

impl LinkFile {
    /// Links the file an earlier step of the chain opened; `privileged`: see the type.
    pub fn chain_file(new_dir: DirFd, new_name: CString, privileged: bool) -> LinkFile {
        LinkFile {
            file: FileRef::Chain,
            new_dir,
            new_name,
            privileged,
            path: CString::default(),
        }
    }

    /// Links the file `held` (a plain fd, `O_PATH` or not) while it has a name.
    pub fn of(held: &DirFd, new_dir: DirFd, new_name: CString, privileged: bool) -> LinkFile {
        let mut link = LinkFile::chain_file(new_dir, new_name, privileged);
        link.resolve_chain_file(&FileRef::Fd(held.clone()));
        link
    }
}

/// `renameat2` with `RENAME_*` flags.
#[derive(Debug)]
pub struct Rename {
    pub old_dir: DirFd,
    pub old_name: CString,
    pub new_dir: DirFd,
    pub new_name: CString,
    pub flags: u32,
}

/// `unlinkat`, with `AT_REMOVEDIR` when `dir_flag`.
#[derive(Debug)]
pub struct Unlink {
    pub dir: DirFd,
    pub name: CString,
    pub dir_flag: bool,
}

impl RingOp for Mkdir {
    const OPCODE: Option<(u8, &'static str)> = Some((opcode::MkDirAt::CODE, "mkdirat"));

    fn sqe(&self, _buf: &mut Buf, _slot: Option<u32>) -> squeue::Entry {
        opcode::MkDirAt::new(types::Fd(raw(&self.dir)), self.name.as_ptr())
            .mode(self.mode)
            .build()
    }

    fn blocking(self) -> StepResult {
        value(rustix::fs::mkdirat(
            &self.dir,
            &*self.name,
            Mode::from_raw_mode(self.mode),
        ))
    }
}

impl RingOp for Mknod {
    const OPCODE: Option<(u8, &'static str)> = None;

    fn sqe(&self, _buf: &mut Buf, _slot: Option<u32>) -> squeue::Entry {
        super::invariant("mknod has no io_uring opcode");
        opcode::Nop::new().build()
    }

    fn blocking(self) -> StepResult {
        let kind = rustix::fs::FileType::from_raw_mode(self.mode);
        let perm = Mode::from_raw_mode(self.mode & 0o7777);
        value(rustix::fs::mknodat(
            &self.dir,
            &*self.name,
            kind,
            perm,
            self.rdev,
        ))
    }
}

impl RingOp for Symlink {
    const OPCODE: Option<(u8, &'static str)> = Some((opcode::SymlinkAt::CODE, "symlinkat"));

    fn sqe(&self, _buf: &mut Buf, _slot: Option<u32>) -> squeue::Entry {
        let dir = types::Fd(raw(&self.dir));
        opcode::SymlinkAt::new(dir, self.target.as_ptr(), self.name.as_ptr()).build()
    }

    fn blocking(self) -> StepResult {
        value(rustix::fs::symlinkat(&*self.target, &self.dir, &*self.name))
    }
}

impl RingOp for Link {
    const OPCODE: Option<(u8, &'static str)> = Some((opcode::LinkAt::CODE, "linkat"));

    fn sqe(&self, _buf: &mut Buf, _slot: Option<u32>) -> squeue::Entry {
        let (old, new) = (types::Fd(raw(&self.old_dir)), types::Fd(raw(&self.new_dir)));
        opcode::LinkAt::new(old, self.old_name.as_ptr(), new, self.new_name.as_ptr()).build()
    }

    fn blocking(self) -> StepResult {
        value(rustix::fs::linkat(
            &self.old_dir,
            &*self.old_name,
            &self.new_dir,
            &*self.new_name,
            AtFlags::empty(),
        ))
    }
}

impl RingOp for LinkFile {
    const OPCODE: Option<(u8, &'static str)> = Some((opcode::LinkAt::CODE, "linkat"));

    /// `linkat` takes no direct descriptor, and only a plain fd has a `/proc/self/fd` path.
    fn on_ring(&self) -> bool {
        matches!(self.file, FileRef::Fd(_))
    }

    fn sqe(&self, _buf: &mut Buf, _slot: Option<u32>) -> squeue::Entry {
        let new_dir = types::Fd(raw(&self.new_dir));
        let link = match &self.file {
            FileRef::Fd(fd) if self.privileged => opcode::LinkAt::new(
                types::Fd(raw(fd)),
                c"".as_ptr(),
                new_dir,
                self.new_name.as_ptr(),
            )
            .flags(libc::AT_EMPTY_PATH),
            _ => opcode::LinkAt::new(
                types::Fd(libc::AT_FDCWD),
                self.path.as_ptr(),
                new_dir,
                self.new_name.as_ptr(),
            )
            .flags(libc::AT_SYMLINK_FOLLOW),
        };
        link.build()
    }

    fn blocking(self) -> StepResult {
        let fd = super::plain(&self.file)?;
        value(if self.privileged {
            rustix::fs::linkat(fd, c"", &self.new_dir, &*self.new_name, AtFlags::EMPTY_PATH)
        } else {
            rustix::fs::linkat(
                rustix::fs::CWD,
                &*self.path,
                &self.new_dir,
                &*self.new_name,
                AtFlags::SYMLINK_FOLLOW,
            )
        })
    }

    fn resolve_chain_file(&mut self, opened: &FileRef) {
        if matches!(self.file, FileRef::Chain) {
            self.file = opened.clone();
        }
        if let FileRef::Fd(fd) = &self.file
            && !self.privileged
        {
            self.path = super::fd_path(fd);
        }
    }
}

impl RingOp for Rename {
    const OPCODE: Option<(u8, &'static str)> = Some((opcode::RenameAt::CODE, "renameat"));

    fn sqe(&self, _buf: &mut Buf, _slot: Option<u32>) -> squeue::Entry {
        let (old, new) = (types::Fd(raw(&self.old_dir)), types::Fd(raw(&self.new_dir)));
        opcode::RenameAt::new(old, self.old_name.as_ptr(), new, self.new_name.as_ptr())
            .flags(self.flags)
            .build()
    }

    fn blocking(self) -> StepResult {
        value(rustix::fs::renameat_with(
            &self.old_dir,
            &*self.old_name,
            &self.new_dir,
            &*self.new_name,
            RenameFlags::from_bits_retain(self.flags),
        ))
    }
}

impl RingOp for Unlink {
    const OPCODE: Option<(u8, &'static str)> = Some((opcode::UnlinkAt::CODE, "unlinkat"));

    fn sqe(&self, _buf: &mut Buf, _slot: Option<u32>) -> squeue::Entry {
        let flags = if self.dir_flag { libc::AT_REMOVEDIR } else { 0 };
        opcode::UnlinkAt::new(types::Fd(raw(&self.dir)), self.name.as_ptr())
            .flags(flags)
            .build()
    }

    fn blocking(self) -> StepResult {
        let flags = if self.dir_flag {
            AtFlags::REMOVEDIR
        } else {
            AtFlags::empty()
        };
        value(rustix::fs::unlinkat(&self.dir, &*self.name, flags))
    }
}
