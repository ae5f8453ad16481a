//! The file commands: coreutils-like verbs against one brick, as root (a client holding a
//! cluster certificate is a trusted node). Each failure prints one line the way coreutils does
//! (`kiln: cannot stat 'x': No such file or directory`); the command goes on with its other
//! operands and exits 1 if any failed.

use std::io::{Read as _, Write as _};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use bytes::Bytes;
use clap::Subcommand;
use kiln_client::distribute::Member;
use kiln_client::path::{components, new_gfid};
use kiln_client::{BrickClient, ConnectOptions, Error, Layer, LayerExt, Paths};
use kiln_wire::limits::IO_SIZE_MAX_BYTES;
use kiln_wire::{
    AccessMode, Creds, ErrorCode, FileType, FopReply, Iatt, OpenFlags, RenameMode, SymlinkTarget,
    Timespec, XattrName, XattrSetMode, XattrValue,
};

use crate::Global;

#[derive(Subcommand)]
pub(crate) enum FileCommand {
    /// List directories (or name files).
    Ls {
        /// Long format: type and mode, links, owner, size, modification time.
        #[arg(short = 'l')]
        long: bool,
        #[arg(default_value = "/")]
        paths: Vec<String>,
    },
    /// Show an object's attributes and GFID.
    Stat {
        #[arg(required = true)]
        paths: Vec<String>,
    },
    /// Print files to standard output.
    Cat {
        #[arg(required = true)]
        paths: Vec<String>,
    },
    /// Copy a local file to the volume.
    Put { local: PathBuf, remote: String },
    /// Copy a file from the volume to a local file (`-` for standard output).
    Get { remote: String, local: PathBuf },
    /// Make directories.
    Mkdir {
        /// Make parents as needed; existing directories are fine.
        #[arg(short = 'p')]
        parents: bool,
        #[arg(required = true)]
        paths: Vec<String>,
    },
    /// Remove files (and with -r, directories and their contents).
    Rm {
        #[arg(short = 'r', short_alias = 'R')]
        recursive: bool,
        #[arg(required = true)]
        paths: Vec<String>,
    },
    /// Rename or move; into DEST when DEST is a directory.
    Mv { source: String, dest: String },
    /// Make a hard link (or with -s, a symbolic link holding TARGET).
    Ln {
        #[arg(short = 's')]
        symbolic: bool,
        target: String,
        link: String,
    },
    /// Extended attributes.
    #[command(subcommand)]
    Xattr(XattrCommand),
}

#[derive(Subcommand)]
pub(crate) enum XattrCommand {
    /// Print one attribute's value.
    Get { path: String, name: String },
    /// Set an attribute.
    Set {
        path: String,
        name: String,
        value: String,
    },
    /// List attribute names.
    List { path: String },
    /// Remove an attribute.
    Rm { path: String, name: String },
}

/// Runs one file command and returns the process status.
pub(crate) fn run(global: &Global, command: FileCommand) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kiln: cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let volume = match connect(global).await {
            Ok(v) => v,
            Err(e) => {
                eprintln!("kiln: {e}");
                return ExitCode::FAILURE;
            }
        };
        let failures = execute(&volume, command).await;
        volume.close().await;
        match failures {
            0 => ExitCode::SUCCESS,
            _ => ExitCode::FAILURE,
        }
    })
}

pub(crate) async fn connect(global: &Global) -> Result<BrickClient, Error> {
    let mut options =
        ConnectOptions::from_tls_dir(global.brick_addr, &global.tls_dir, &global.client)?;
    if let Some(name) = &global.server_name {
        options.server_name.clone_from(name);
    }
    options.connections = global.connections;
    BrickClient::connect(options).await
}

/// A brick client for the brick at `addr`, as [`connect`] makes one.
async fn connect_to(global: &Global, addr: SocketAddr) -> anyhow::Result<BrickClient> {
    let mut to = global.clone();
    to.brick_addr = addr;
    connect(&to)
        .await
        .with_context(|| format!("cannot reach brick {addr}"))
}

/// A brick client for each of `members` in service (a volume's bricks, in order), as
/// [`connect`] makes one; a removed brick stays removed.
pub(crate) async fn connect_members(
    global: &Global,
    members: &[Member<SocketAddr>],
) -> anyhow::Result<Vec<Member<BrickClient>>> {
    let mut connected = Vec::with_capacity(members.len());
    for member in members {
        connected.push(match member.brick() {
            Some(&addr) => Member::new(connect_to(global, addr).await?, member.role()),
            None => Member::Removed,
        });
    }
    Ok(connected)
}

/// Prints `kiln: <what>: <error>` and counts one failure.
fn report(failures: &mut usize, what: &str, e: &Error) {
    eprintln!("kiln: {what}: {e}");
    *failures += 1;
}

async fn execute(v: &BrickClient, command: FileCommand) -> usize {
    let mut failures = 0;
    match command {
        FileCommand::Ls { long, paths } => {
            let many = paths.len() > 1;
            for path in paths {
                if let Err(e) = ls(v, &path, long, many).await {
                    report(&mut failures, &format!("cannot access '{path}'"), &e);
                }
            }
        }
        FileCommand::Stat { paths } => {
            for path in paths {
                match v.resolve(&Creds::root(), &path).await {
                    Ok(iatt) => print_stat(&path, &iatt),
                    Err(e) => report(&mut failures, &format!("cannot stat '{path}'"), &e),
                }
            }
        }
        FileCommand::Cat { paths } => {
            for path in paths {
                if let Err(e) = copy_out(v, &path, None).await {
                    report(&mut failures, &path, &e);
                }
            }
        }
        FileCommand::Get { remote, local } => {
            let to = (local.as_os_str() != "-").then_some(local);
            if let Err(e) = copy_out(v, &remote, to.as_deref()).await {
                report(&mut failures, &format!("cannot copy '{remote}'"), &e);
            }
        }
        FileCommand::Put { local, remote } => {
            if let Err(e) = copy_in(v, &local, &remote).await {
                report(
                    &mut failures,
                    &format!("cannot copy '{}' to '{remote}'", local.display()),
                    &e,
                );
            }
        }
        FileCommand::Mkdir { parents, paths } => {
            for path in paths {
                let made = match parents {
                    true => v.mkdir_all(&Creds::root(), &path, 0o755).await,
                    false => v.mkdir(&Creds::root(), &path, 0o755).await,
                };
                if let Err(e) = made {
                    report(
                        &mut failures,
                        &format!("cannot create directory '{path}'"),
                        &e,
                    );
                }
            }
        }
        FileCommand::Rm { recursive, paths } => {
            for path in paths {
                if let Err(e) = rm(v, &path, recursive).await {
                    report(&mut failures, &format!("cannot remove '{path}'"), &e);
                }
            }
        }
        FileCommand::Mv { source, dest } => {
            if let Err(e) = mv(v, &source, &dest).await {
                report(
                    &mut failures,
                    &format!("cannot move '{source}' to '{dest}'"),
                    &e,
                );
            }
        }
        FileCommand::Ln {
            symbolic,
            target,
            link,
        } => {
            if let Err(e) = ln(v, symbolic, &target, &link).await {
                let kind = if symbolic { "symbolic" } else { "hard" };
                report(
                    &mut failures,
                    &format!("failed to create {kind} link '{link}'"),
                    &e,
                );
            }
        }
        FileCommand::Xattr(command) => {
            if let Err((what, e)) = xattr(v, command).await {
                report(&mut failures, &what, &e);
            }
        }
    }
    failures
}

fn einval() -> Error {
    Error::Fop(ErrorCode::Inval)
}

async fn ls(v: &BrickClient, path: &str, long: bool, heading: bool) -> Result<(), Error> {
    let iatt = v.resolve(&Creds::root(), path).await?;
    let mut out = std::io::stdout().lock();
    if iatt.file_type != FileType::Directory {
        let name = path.trim_end_matches('/');
        let _ = writeln!(out, "{}", entry_line(name, &iatt, long));
        return Ok(());
    }
    let mut entries = v.read_dir(&Creds::root(), iatt.gfid).await?;
    entries.sort_by(|a, b| a.name.as_bytes().cmp(b.name.as_bytes()));
    if heading {
        let _ = writeln!(out, "{path}:");
    }
    for e in entries {
        let _ = writeln!(out, "{}", entry_line(&e.name.to_string(), &e.iatt, long));
    }
    Ok(())
}

fn entry_line(name: &str, iatt: &Iatt, long: bool) -> String {
    if !long {
        return name.to_owned();
    }
    format!(
        "{} {:>3} {:>5} {:>5} {:>10} {} {name}",
        mode_string(iatt),
        iatt.nlink,
        iatt.uid,
        iatt.gid,
        iatt.size,
        time_string(iatt.mtime),
    )
}

/// `ls -l`'s ten characters: type, then rwx for user, group and other with s/t bits.
fn mode_string(iatt: &Iatt) -> String {
    let kind = match iatt.file_type {
        FileType::Directory => 'd',
        FileType::Symlink => 'l',
        FileType::CharDevice => 'c',
        FileType::BlockDevice => 'b',
        FileType::Fifo => 'p',
        FileType::Socket => 's',
        FileType::Regular => '-',
    };
    let m = iatt.mode.bits();
    let bit = |mask: u32, c: char| if m & mask != 0 { c } else { '-' };
    let special = |exec: bool, set: bool, lower: char| match (exec, set) {
        (true, true) => lower,
        (false, true) => lower.to_ascii_uppercase(),
        (true, false) => 'x',
        (false, false) => '-',
    };
    [
        kind,
        bit(0o400, 'r'),
        bit(0o200, 'w'),
        special(m & 0o100 != 0, m & 0o4000 != 0, 's'),
        bit(0o040, 'r'),
        bit(0o020, 'w'),
        special(m & 0o010 != 0, m & 0o2000 != 0, 's'),
        bit(0o004, 'r'),
        bit(0o002, 'w'),
        special(m & 0o001 != 0, m & 0o1000 != 0, 't'),
    ]
    .iter()
    .collect()
}

fn time_string(t: Timespec) -> String {
    match time::OffsetDateTime::from_unix_timestamp(t.sec()) {
        Ok(d) => format!(
            "{:04}-{:02}-{:02} {:02}:{:02}",
            d.year(),
            u8::from(d.month()),
            d.day(),
            d.hour(),
            d.minute()
        ),
        Err(_) => t.sec().to_string(),
    }
}

fn precise_time_string(t: Timespec) -> String {
    match time::OffsetDateTime::from_unix_timestamp(t.sec()) {
        Ok(d) => format!("{}:{:02}.{:09}", time_string(t), d.second(), t.nsec()),
        Err(_) => format!("{}.{:09}", t.sec(), t.nsec()),
    }
}

fn print_stat(path: &str, iatt: &Iatt) {
    let kind = match iatt.file_type {
        FileType::Directory => "directory",
        FileType::Symlink => "symbolic link",
        FileType::Regular if iatt.size == 0 => "regular empty file",
        FileType::Regular => "regular file",
        FileType::CharDevice => "character special file",
        FileType::BlockDevice => "block special file",
        FileType::Fifo => "fifo",
        FileType::Socket => "socket",
    };
    println!("  File: {path}");
    println!(
        "  Size: {:<10}\tBlocks: {:<10} IO Block: {:<6} {kind}",
        iatt.size, iatt.blocks, iatt.blksize
    );
    println!("  GFID: {}", iatt.gfid);
    println!("Inode: {:<11} Links: {}", iatt.ino, iatt.nlink);
    println!(
        "Access: ({:04o}/{})  Uid: {:>5}   Gid: {:>5}",
        iatt.mode.bits(),
        mode_string(iatt),
        iatt.uid,
        iatt.gid
    );
    for (label, t) in [
        ("Access", iatt.atime),
        ("Modify", iatt.mtime),
        ("Change", iatt.ctime),
    ] {
        println!("{label}: {} UTC", precise_time_string(t));
    }
}

/// Streams a remote file to `to` (standard output when `None`), 1 MiB per READ.
async fn copy_out(
    v: &BrickClient,
    remote: &str,
    to: Option<&std::path::Path>,
) -> Result<(), Error> {
    let iatt = v.resolve(&Creds::root(), remote).await?;
    if iatt.file_type == FileType::Directory {
        return Err(Error::Fop(ErrorCode::IsDir));
    }
    let local_error = |e: std::io::Error| {
        Error::Fop(ErrorCode::from_errno(e.raw_os_error().unwrap_or(libc::EIO)))
    };
    let mut out: Box<dyn std::io::Write> = match to {
        Some(path) => Box::new(std::fs::File::create(path).map_err(local_error)?),
        None => Box::new(std::io::stdout().lock()),
    };
    let fd = v
        .open(
            &Creds::root(),
            iatt.gfid,
            AccessMode::ReadOnly,
            OpenFlags::empty(),
        )
        .await?;
    let mut offset = 0u64;
    let result = async {
        loop {
            let chunk = v
                .read(&Creds::root(), &fd, offset, IO_SIZE_MAX_BYTES as u32)
                .await?;
            if chunk.is_empty() {
                return out.flush().map_err(local_error);
            }
            out.write_all(&chunk).map_err(local_error)?;
            offset += chunk.len() as u64;
        }
    }
    .await;
    let released = v.release(&Creds::root(), fd).await;
    result.and(released)
}

/// Copies a local file in: one PUT when it fits in one request, else 1 MiB WRITEs.
async fn copy_in(v: &BrickClient, local: &std::path::Path, remote: &str) -> Result<(), Error> {
    let local_error = |e: std::io::Error| {
        Error::Fop(ErrorCode::from_errno(e.raw_os_error().unwrap_or(libc::EIO)))
    };
    let mut file = std::fs::File::open(local).map_err(local_error)?;
    let mode = {
        use std::os::unix::fs::PermissionsExt;
        file.metadata().map_err(local_error)?.permissions().mode() & 0o7777
    };
    // An existing directory as the target means "into it", as cp does.
    let remote = match v.resolve(&Creds::root(), remote).await {
        Ok(iatt) if iatt.file_type == FileType::Directory => {
            let name = local.file_name().ok_or_else(einval)?.to_string_lossy();
            format!("{}/{name}", remote.trim_end_matches('/'))
        }
        _ => remote.to_owned(),
    };
    let mut first = vec![0u8; IO_SIZE_MAX_BYTES];
    let n = read_full(&mut file, &mut first).map_err(local_error)?;
    first.truncate(n);
    if n < IO_SIZE_MAX_BYTES {
        return v
            .write_file(&Creds::root(), &remote, Bytes::from(first), mode)
            .await;
    }
    let fd = v.create_file(&Creds::root(), &remote, mode).await?;
    let result = async {
        let mut offset = 0u64;
        let mut chunk = first;
        while !chunk.is_empty() {
            let len = chunk.len() as u64;
            v.write(&Creds::root(), &fd, offset, Bytes::from(chunk))
                .await?;
            offset += len;
            let mut next = vec![0u8; IO_SIZE_MAX_BYTES];
            let n = read_full(&mut file, &mut next).map_err(local_error)?;
            next.truncate(n);
            chunk = next;
        }
        Ok(())
    }
    .await;
    let released = v.release(&Creds::root(), fd).await;
    result.and(released)
}

fn read_full(file: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read(&mut buf[filled..])? {
            0 => break,
            n => filled += n,
        }
    }
    Ok(filled)
}

async fn rm(v: &BrickClient, path: &str, recursive: bool) -> Result<(), Error> {
    if recursive {
        if components(path)?.is_empty() {
            return Err(Error::Fop(ErrorCode::Perm));
        }
        return v.remove_all(&Creds::root(), path).await;
    }
    let (parent, name) = v.resolve_parent(&Creds::root(), path).await?;
    let iatt = v.lookup(&Creds::root(), parent, &name).await?;
    if iatt.file_type == FileType::Directory {
        return Err(Error::Fop(ErrorCode::IsDir));
    }
    v.call(&Creds::root(), kiln_wire::Unlink { parent, name }.into())
        .await
        .map(drop)
}

async fn mv(v: &BrickClient, source: &str, dest: &str) -> Result<(), Error> {
    let (old_parent, old_name) = v.resolve_parent(&Creds::root(), source).await?;
    let (new_parent, new_name) = match v.resolve(&Creds::root(), dest).await {
        Ok(iatt) if iatt.file_type == FileType::Directory => (iatt.gfid, old_name.clone()),
        _ => v.resolve_parent(&Creds::root(), dest).await?,
    };
    let fop = kiln_wire::Rename {
        old_parent,
        old_name,
        new_parent,
        new_name,
        mode: RenameMode::Replace,
    };
    v.call(&Creds::root(), fop.into()).await.map(drop)
}

async fn ln(v: &BrickClient, symbolic: bool, target: &str, link: &str) -> Result<(), Error> {
    let (parent, name) = v.resolve_parent(&Creds::root(), link).await?;
    let fop: kiln_wire::FopRequest = if symbolic {
        let target = SymlinkTarget::new(Bytes::copy_from_slice(target.as_bytes()))
            .map_err(|e| Error::Fop(ErrorCode::from_errno(e.errno())))?;
        kiln_wire::Symlink {
            parent,
            name,
            gfid: new_gfid(),
            target,
        }
        .into()
    } else {
        let iatt = v.resolve(&Creds::root(), target).await?;
        if iatt.file_type == FileType::Directory {
            return Err(Error::Fop(ErrorCode::Perm));
        }
        kiln_wire::Link {
            gfid: iatt.gfid,
            new_parent: parent,
            new_name: name,
        }
        .into()
    };
    v.call(&Creds::root(), fop).await.map(drop)
}

async fn xattr(v: &BrickClient, command: XattrCommand) -> Result<(), (String, Error)> {
    let name_of = |path: &str, name: &str| {
        XattrName::new(Bytes::copy_from_slice(name.as_bytes())).map_err(|e| {
            (
                format!("bad attribute name '{name}' on '{path}'"),
                Error::Fop(ErrorCode::from_errno(e.errno())),
            )
        })
    };
    let at = |path: &str| {
        let path = path.to_owned();
        move |e: Error| (format!("'{path}'"), e)
    };
    match command {
        XattrCommand::Get { path, name } => {
            let xname = name_of(&path, &name)?;
            let gfid = v
                .resolve(&Creds::root(), &path)
                .await
                .map_err(at(&path))?
                .gfid;
            let reply = v
                .call(
                    &Creds::root(),
                    kiln_wire::Getxattr { gfid, name: xname }.into(),
                )
                .await
                .map_err(at(&path))?;
            let FopReply::Getxattr(r) = reply else {
                return Err((path, Error::Protocol("bad GETXATTR reply".into())));
            };
            let value = r.value.as_bytes();
            match std::str::from_utf8(value) {
                Ok(text) if !text.contains('\0') => println!("{text}"),
                _ => println!(
                    "0x{}",
                    value.iter().map(|b| format!("{b:02x}")).collect::<String>()
                ),
            }
        }
        XattrCommand::Set { path, name, value } => {
            let xname = name_of(&path, &name)?;
            let value = XattrValue::new(Bytes::from(value.into_bytes())).map_err(|e| {
                (
                    format!("'{path}'"),
                    Error::Fop(ErrorCode::from_errno(e.errno())),
                )
            })?;
            let gfid = v
                .resolve(&Creds::root(), &path)
                .await
                .map_err(at(&path))?
                .gfid;
            let fop = kiln_wire::Setxattr {
                gfid,
                name: xname,
                value,
                mode: XattrSetMode::Upsert,
            };
            v.call(&Creds::root(), fop.into())
                .await
                .map_err(at(&path))?;
        }
        XattrCommand::List { path } => {
            let gfid = v
                .resolve(&Creds::root(), &path)
                .await
                .map_err(at(&path))?
                .gfid;
            let reply = v
                .call(&Creds::root(), kiln_wire::Listxattr { gfid }.into())
                .await
                .map_err(at(&path))?;
            let FopReply::Listxattr(r) = reply else {
                return Err((path, Error::Protocol("bad LISTXATTR reply".into())));
            };
            for name in r.entries {
                println!("{}", String::from_utf8_lossy(name.as_bytes()));
            }
        }
        XattrCommand::Rm { path, name } => {
            let xname = name_of(&path, &name)?;
            let gfid = v
                .resolve(&Creds::root(), &path)
                .await
                .map_err(at(&path))?
                .gfid;
            v.call(
                &Creds::root(),
                kiln_wire::Removexattr { gfid, name: xname }.into(),
            )
            .await
            .map_err(at(&path))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_print_like_ls() {
        let mut iatt = Iatt {
            gfid: kiln_wire::Gfid::ROOT,
            ino: 1,
            file_type: FileType::Directory,
            mode: kiln_wire::Mode::new(0o1777).expect("test setup"),
            nlink: 2,
            uid: 0,
            gid: 0,
            rdev: 0,
            size: 0,
            blocks: 0,
            blksize: 4096,
            atime: Timespec::new(0, 0).expect("test setup"),
            mtime: Timespec::new(0, 0).expect("test setup"),
            ctime: Timespec::new(0, 0).expect("test setup"),
        };
        assert_eq!(mode_string(&iatt), "drwxrwxrwt");
        iatt.file_type = FileType::Regular;
        iatt.mode = kiln_wire::Mode::new(0o4640).expect("test setup");
        assert_eq!(mode_string(&iatt), "-rwSr-----");
        assert_eq!(time_string(iatt.mtime), "1970-01-01 00:00");
    }
}
