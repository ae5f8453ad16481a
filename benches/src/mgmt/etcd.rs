//! The etcd member of `--store etcd`: started on free loopback ports, its data directory on
//! the scratch disk.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail};
use kiln_mgmt::etcd_server::{EtcdServer, etcd_binary};
use serde_json::json;

use super::COMMAND_TIMEOUT;
use crate::process::run_captured;
use crate::report::Reporter;

/// One etcd member with its data directory in `root` (on the scratch disk, as the floors
/// are), noted.
pub(super) fn start_etcd(root: &Path, out: &mut Reporter) -> anyhow::Result<EtcdServer> {
    let Some(binary) = etcd_binary() else {
        bail!("etcd is not installed (apt-get install etcd-server)");
    };
    let version = run_captured(Command::new(&binary).arg("--version"), COMMAND_TIMEOUT)?;
    let data_dir = root.join("etcd");
    let server = EtcdServer::single(&binary, &data_dir).with_context(|| {
        format!(
            "cannot start {} in {}",
            binary.display(),
            data_dir.display()
        )
    })?;
    out.note(
        "etcd",
        &json!({
            "binary": binary.display().to_string(),
            "version": version.stdout.lines().next().unwrap_or_default().trim(),
            "endpoint": server.member.client_url(),
            "data_dir": data_dir.display().to_string(),
            "log": data_dir.with_extension("log").display().to_string(),
        }),
    );
    Ok(server)
}
