//! The maildir phases' work, run by `kiln-bench mail STEP DIR` in a process of its own (as
//! every other phase is an external command), with plain syscalls:
//!
//! * `deliver` — what a mail transfer agent does for each of `--mails` mails: create it
//!   exclusively in `DIR/tmp/`, write it, fsync it, close it and rename it into `DIR/new/`;
//!   then an fsync of `new/` (a FUSE mount sends the renames it answered itself).
//! * `read` — what a mail server does when a client fetches every new mail: list `new/`,
//!   read each mail whole and rename it into `cur/` marked seen (`:2,S`); then an fsync of
//!   `cur/`. Prints a line per mail read (its size).
//!
//! Mail sizes run from 2 to 17 KiB (mean 9.5 KiB, as the generated tree's files), the same
//! sequence in every run.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::Path;

use anyhow::{Context, bail};

/// Mails the maildir phases deliver and read, unless told otherwise.
pub const DEFAULT_MAILS: usize = 5000;

/// The maildir's subdirectories.
pub const SUBDIRS: [&str; 3] = ["tmp", "new", "cur"];

/// One maildir phase's work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MailStep {
    Deliver,
    Read,
}

/// Runs `step` on maildir `dir`.
pub fn run(step: MailStep, dir: &Path, mails: usize) -> anyhow::Result<()> {
    match step {
        MailStep::Deliver => deliver(dir, mails),
        MailStep::Read => read(dir, &mut std::io::stdout().lock()).map(drop),
    }
}

fn deliver(dir: &Path, mails: usize) -> anyhow::Result<()> {
    for sub in SUBDIRS {
        let path = dir.join(sub);
        fs::create_dir_all(&path).with_context(|| format!("cannot create {}", path.display()))?;
    }
    for i in 0..mails {
        let name = format!("{i}.M{i}P1.kiln");
        let tmp = dir.join("tmp").join(&name);
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .with_context(|| format!("cannot create {}", tmp.display()))?;
        file.write_all(&mail(i))
            .and_then(|()| file.sync_all())
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        drop(file);
        fs::rename(&tmp, dir.join("new").join(&name))
            .with_context(|| format!("cannot deliver {}", tmp.display()))?;
    }
    sync_dir(&dir.join("new"))
}

/// Returns the bytes read.
fn read(dir: &Path, out: &mut impl Write) -> anyhow::Result<u64> {
    let (new, cur) = (dir.join("new"), dir.join("cur"));
    let mut bytes = 0;
    let mut content = Vec::new();
    for entry in fs::read_dir(&new).with_context(|| format!("cannot list {}", new.display()))? {
        let name = entry?.file_name();
        let path = new.join(&name);
        content.clear();
        File::open(&path)
            .and_then(|mut f| f.read_to_end(&mut content))
            .with_context(|| format!("cannot read {}", path.display()))?;
        if !content.starts_with(b"Return-Path: ") {
            bail!("{} is not a mail this benchmark delivered", path.display());
        }
        bytes += content.len() as u64;
        writeln!(out, "{}", content.len())?;
        let mut seen = name;
        seen.push(":2,S");
        fs::rename(&path, cur.join(seen))
            .with_context(|| format!("cannot move {}", path.display()))?;
    }
    sync_dir(&cur)?;
    Ok(bytes)
}

/// Mail `i`: a few headers and a body, 2 to 17 KiB.
fn mail(i: usize) -> Vec<u8> {
    let size = (2 + (i.wrapping_mul(2_654_435_761) >> 7) % 16) << 10;
    let mut mail = format!(
        "Return-Path: <sender{i}@example.org>\nFrom: sender{i}@example.org\n\
         To: user@example.org\nSubject: message {i}\n\n"
    )
    .into_bytes();
    let line = b"The quick brown fox jumps over the lazy dog, again and again.\n";
    while mail.len() < size {
        mail.extend_from_slice(line);
    }
    mail.truncate(size);
    mail
}

fn sync_dir(dir: &Path) -> anyhow::Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("cannot fsync {}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mails_are_2_to_17_kib_and_average_about_9_5() {
        let sizes: Vec<usize> = (0..10_000).map(|i| mail(i).len()).collect();
        assert!(sizes.iter().all(|s| (2 << 10..=17 << 10).contains(s)));
        let mean = sizes.iter().sum::<usize>() as f64 / sizes.len() as f64 / 1024.0;
        assert!((8.5..10.5).contains(&mean), "mean {mean} KiB");
    }

    #[test]
    fn delivered_mails_are_read_whole_and_moved() {
        let dir = tempfile::tempdir().expect("tempdir");
        deliver(dir.path(), 50).expect("deliver");
        let want: u64 = (0..50).map(|i| mail(i).len() as u64).sum();
        let mut lines = Vec::new();
        assert_eq!(read(dir.path(), &mut lines).expect("read"), want);
        assert_eq!(lines.iter().filter(|&&b| b == b'\n').count(), 50);
        assert_eq!(
            fs::read_dir(dir.path().join("new")).expect("new").count(),
            0
        );
        assert_eq!(
            fs::read_dir(dir.path().join("cur")).expect("cur").count(),
            50
        );
    }
}
