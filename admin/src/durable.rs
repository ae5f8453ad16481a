//! Replacing a file so that a crash leaves the old content or the new, never a torn mix: write
//! a temporary file beside it, fsync it, rename it over the target, fsync the directory. The
//! one way Kiln's control plane replaces a file (the CA's and certificates' PEM files, the
//! configuration store's snapshot); the store's log appends are its own discipline.
//!
//! [`stage`] and [`Staged::commit`] are the two halves, for a caller that prepares several
//! files before putting any in place; [`replace_file`] does both. [`private_dir`] makes the
//! directories they live in: owner-only, and durably named in their parents.

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

/// A step of a durable write failed; `path` is the file or directory it was on.
#[derive(Debug, thiserror::Error)]
#[error("cannot write {path}: {error}")]
pub struct DurableWriteError {
    pub path: PathBuf,
    #[source]
    pub error: std::io::Error,
}

/// The temporary name a new version of `path` is written under: `path` + `.tmp`. A crash can
/// leave it behind; the next writer replaces it, and owners may remove stale ones at start.
pub fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".tmp");
    PathBuf::from(name)
}

/// New content for a file, written and fsynced under its temporary name but not yet in place.
/// Dropped without [`Staged::commit`], the temporary file is removed.
#[derive(Debug)]
pub struct Staged {
    temp: PathBuf,
    target: PathBuf,
    committed: bool,
}

/// Writes `bytes` to [`temp_path`]`(target)` with `mode` (when it is created) and fsyncs it.
pub fn stage(target: &Path, bytes: &[u8], mode: u32) -> Result<Staged, DurableWriteError> {
    let temp = temp_path(target);
    let staged = Staged {
        temp,
        target: target.to_owned(),
        committed: false,
    };
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&staged.temp)
        .and_then(|mut file| {
            file.write_all(bytes)?;
            file.sync_all()
        })
        .map_err(|error| DurableWriteError {
            path: staged.temp.clone(),
            error,
        })?;
    Ok(staged)
}

impl Staged {
    /// Renames the temporary file over the target and fsyncs the directory, so the rename
    /// survives a crash.
    pub fn commit(mut self) -> Result<(), DurableWriteError> {
        std::fs::rename(&self.temp, &self.target).map_err(|error| DurableWriteError {
            path: self.target.clone(),
            error,
        })?;
        self.committed = true;
        sync_dir(self.target.parent().unwrap_or(Path::new(".")))
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}

/// Replaces `path` with `bytes` durably (see the module doc); `mode` applies to a new file.
pub fn replace_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), DurableWriteError> {
    stage(path, bytes, mode)?.commit()
}

/// Fsyncs directory `dir`, making the names created, renamed or removed in it durable.
pub fn sync_dir(dir: &Path) -> Result<(), DurableWriteError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|error| DurableWriteError {
            path: dir.to_owned(),
            error,
        })
}

/// Makes `dir` and its missing parents, owner-only (0700), each new one fsynced into its
/// parent so a crash cannot lose it once this returns; an existing `dir` is narrowed to 0700.
/// For directories Kiln owns (state, certificates, sockets), never a shared one.
pub fn private_dir(dir: &Path) -> Result<(), DurableWriteError> {
    use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
    let error = |path: &Path| {
        let path = path.to_owned();
        move |error| DurableWriteError { path, error }
    };
    let missing: Vec<&Path> = dir.ancestors().take_while(|d| !d.exists()).collect();
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(error(dir))?;
    for made in missing.iter().rev() {
        if let Some(parent) = made.parent().filter(|p| !p.as_os_str().is_empty()) {
            sync_dir(parent)?;
        }
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(error(dir))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    #[test]
    fn private_dirs_are_owner_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let deep = dir.path().join("a/b/c");
        private_dir(&deep).expect("made");
        for d in [dir.path().join("a"), dir.path().join("a/b"), deep.clone()] {
            let mode = std::fs::metadata(&d).expect("stat").permissions().mode();
            assert_eq!(mode & 0o777, 0o700, "{}", d.display());
        }
        std::fs::set_permissions(&deep, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        private_dir(&deep).expect("narrowed");
        let mode = std::fs::metadata(&deep).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
    }

    #[test]
    fn replaces_whole_files_with_the_mode_asked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("secret.pem");
        replace_file(&path, b"one", 0o600).expect("first write");
        replace_file(&path, b"two", 0o600).expect("second write");
        assert_eq!(std::fs::read(&path).expect("read"), b"two");
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(!temp_path(&path).exists(), "no temporary file is left");
    }

    #[test]
    fn a_staged_file_dropped_uncommitted_leaves_the_old_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("snapshot.json");
        replace_file(&path, b"old", 0o600).expect("write");
        let staged = stage(&path, b"new", 0o600).expect("stage");
        assert_eq!(temp_path(&path), dir.path().join("snapshot.json.tmp"));
        assert!(temp_path(&path).exists());
        drop(staged);
        assert!(!temp_path(&path).exists());
        assert_eq!(std::fs::read(&path).expect("read"), b"old");
    }

    #[test]
    fn failures_name_the_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("no/such/dir/file");
        let error = replace_file(&missing, b"x", 0o600).expect_err("no directory");
        assert_eq!(error.path, temp_path(&missing));
        assert!(error.to_string().starts_with("cannot write "), "{error}");
    }
}
