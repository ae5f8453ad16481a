//! The local git repository `mount.git_clone` clones: made once per run, unmeasured, in the
//! scratch directory from the first files of the tree's tarball (in archive order), committed
//! once and packed (`git gc`, as a repository fetched from a server is), so a clone copies
//! one pack and checks out every file. Also the check of a clone: `git fsck` and a count of
//! the files it checked out.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::json;

use super::round;
use super::tree::Tree;
use crate::process::{run_bounded, which};
use crate::report::Reporter;

/// Files of the repository, at most (the issue's `git clone` has about 9 000).
pub const DEFAULT_GIT_FILES: usize = 9_000;
/// Longest step of making the repository (listing, extracting, adding, committing, packing).
const PREPARE_TIMEOUT: Duration = Duration::from_secs(1800);
/// The repository's directory in the scratch directory.
const REPO_DIR: &str = "git-src";

/// The repository every target clones.
#[derive(Debug)]
pub(super) struct GitRepo {
    pub(super) path: PathBuf,
    /// Files git tracks (regular files and symbolic links).
    pub(super) files: u64,
}

/// `git` with settings of its own ([`own_settings`]).
pub(super) fn git() -> Command {
    let mut cmd = Command::new("git");
    own_settings(&mut cmd);
    cmd
}

/// Gives the git that `cmd` runs settings of its own: no system or user configuration
/// (hooks, templates, `core.*` of whoever runs the bench), no housekeeping started behind
/// its back (an automatic `gc` after the big commit would make the explicit one fail), and
/// an author for the commit.
pub(super) fn own_settings(cmd: &mut Command) {
    cmd.env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_CONFIG_COUNT", "2")
        .env("GIT_CONFIG_KEY_0", "gc.auto")
        .env("GIT_CONFIG_VALUE_0", "0")
        .env("GIT_CONFIG_KEY_1", "maintenance.auto")
        .env("GIT_CONFIG_VALUE_1", "false")
        .env("GIT_AUTHOR_NAME", "kiln-bench")
        .env("GIT_AUTHOR_EMAIL", "kiln-bench@localhost")
        .env("GIT_COMMITTER_NAME", "kiln-bench")
        .env("GIT_COMMITTER_EMAIL", "kiln-bench@localhost");
}

/// Makes `root/git-src` from the first `files_max` non-directory entries of the tree's
/// tarball; `Ok(None)` (and a `skipped` note) when git is not installed.
pub(super) fn prepare_repo(
    tree: &Tree,
    files_max: usize,
    root: &Path,
    logs: &Path,
    out: &mut Reporter,
) -> anyhow::Result<Option<GitRepo>> {
    if which("git").is_none() {
        out.note(
            "skipped",
            &json!({ "phase": "git_clone", "why": "git is not installed (no `git` on PATH)" }),
        );
        return Ok(None);
    }
    let start = Instant::now();
    let log = logs.join("git-prepare.log");
    let listing = root.join("git-listing.txt");
    let mut list = Command::new("tar");
    list.arg("-tf")
        .arg(&tree.tarball)
        .arg("--quoting-style=literal");
    let file = std::fs::File::create(&listing)?;
    run_bounded(&mut list, Some(file), &log, PREPARE_TIMEOUT)?;
    let names = std::fs::read_to_string(&listing)
        .with_context(|| format!("cannot read {}", listing.display()))?;
    // Directories end with a slash in a listing; tar makes the ones the files need.
    let chosen: Vec<&str> = names
        .lines()
        .filter(|n| !n.ends_with('/'))
        .take(files_max)
        .collect();
    let chosen_list = root.join("git-files.txt");
    std::fs::write(&chosen_list, chosen.join("\n") + "\n")?;
    std::fs::remove_file(&listing)?;

    let repo = root.join(REPO_DIR);
    std::fs::create_dir(&repo).with_context(|| format!("cannot create {}", repo.display()))?;
    let mut extract = Command::new("tar");
    extract
        .arg("-xf")
        .arg(&tree.tarball)
        .arg("-C")
        .arg(&repo)
        .arg("--verbatim-files-from")
        .arg("-T")
        .arg(&chosen_list);
    run_bounded(&mut extract, None, &log, PREPARE_TIMEOUT)?;
    let steps: [&[&str]; 4] = [
        &["init", "--quiet"],
        // Every file, even one a .gitignore of the tree names.
        &["add", "--all", "--force", "."],
        &["commit", "--quiet", "--no-verify", "-m", "kiln-bench tree"],
        &["gc", "--quiet", "--prune=now"],
    ];
    for args in steps {
        run_bounded(
            git().arg("-C").arg(&repo).args(args),
            None,
            &log,
            PREPARE_TIMEOUT,
        )?;
    }
    let tracked_list = root.join("git-tracked.txt");
    let file = std::fs::File::create(&tracked_list)?;
    run_bounded(
        git().arg("-C").arg(&repo).args(["ls-files", "-z"]),
        Some(file),
        &log,
        PREPARE_TIMEOUT,
    )?;
    let tracked = std::fs::read(&tracked_list)?;
    let files = tracked.iter().filter(|&&b| b == 0).count() as u64;
    if files == 0 {
        bail!("the git repository in {} tracks no files", repo.display());
    }
    let pack_bytes: u64 = std::fs::read_dir(repo.join(".git/objects/pack"))?
        .filter_map(Result::ok)
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum();
    out.note(
        "git_repo",
        &json!({
            "files": files,
            "from": format!("the first {} non-directory entries of the tree's tarball", chosen.len()),
            "pack_bytes": pack_bytes,
            "git": crate::process::version("git"),
            "prepared_s": round(start.elapsed().as_secs_f64()),
        }),
    );
    Ok(Some(GitRepo { path: repo, files }))
}

/// Entries under a directory (not counting it).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Entries {
    /// Everything but directories.
    pub(super) files: u64,
    pub(super) dirs: u64,
}

/// Counts the entries under `dir` without following symbolic links; entries named `skip`
/// directly in `dir` are left out.
pub(super) fn count_entries(dir: &Path, skip: Option<&str>) -> anyhow::Result<Entries> {
    let mut entries = Entries::default();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for entry in
            std::fs::read_dir(&d).with_context(|| format!("cannot list {}", d.display()))?
        {
            let entry = entry?;
            if d == dir && skip.is_some_and(|s| entry.file_name() == s) {
                continue;
            }
            match entry.file_type()?.is_dir() {
                true => {
                    entries.dirs += 1;
                    todo.push(entry.path());
                }
                false => entries.files += 1,
            }
        }
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_counted_without_the_skipped_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        std::fs::create_dir_all(d.join("a/b")).expect("mkdir");
        std::fs::create_dir_all(d.join(".git/objects")).expect("mkdir");
        for f in ["x", "a/y", "a/b/z", ".git/HEAD", ".git/objects/p"] {
            std::fs::write(d.join(f), b"1").expect("write");
        }
        std::os::unix::fs::symlink("a", d.join("link")).expect("symlink");
        let all = count_entries(d, None).expect("count");
        assert_eq!(
            all,
            Entries {
                files: 5 + 1,
                dirs: 4
            }
        );
        let work_tree = count_entries(d, Some(".git")).expect("count");
        assert_eq!(
            work_tree,
            Entries {
                files: 3 + 1,
                dirs: 2
            }
        );
    }
}
