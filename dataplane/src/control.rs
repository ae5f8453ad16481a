//! The brick's control socket: `kiln-mgmtd` pushes live options here (one JSON line in, one
//! out, per connection) and learns which configuration generation the brick runs.
//!
//! ```text
//! → {"generation":7,"options":{"auth.allow":"alice,bob","network.inflight-max":"128"}}
//! ← {"generation":7}            or   {"error":"…"}
//! → {"status":true}             (a health probe: changes nothing)
//! ← {"generation":7}
//! ```
//! Options the brick cannot change while running are not sent: they take effect when
//! kiln-mgmtd restarts it.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context as _;
use kiln_dataplane::server::{AuthAllow, Server};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

/// Longest control line, in bytes.
const LINE_MAX_BYTES: u64 = 64 * 1024;

/// Binds the control socket with mode 0600, replacing a stale one.
pub(crate) fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::remove_file(path);
    let listener =
        UnixListener::bind(path).with_context(|| format!("cannot listen on {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

#[derive(serde::Deserialize)]
struct Push {
    generation: u64,
    options: BTreeMap<String, String>,
}

/// Answers one push; `generation` is what the brick runs, updated when the push applies.
pub(crate) async fn serve(stream: UnixStream, server: &mut Server, generation: &mut u64) {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    let answer = match BufReader::new(read)
        .take(LINE_MAX_BYTES)
        .read_line(&mut line)
        .await
    {
        Ok(_) if is_status_probe(&line) => serde_json::json!({ "generation": *generation }),
        Ok(_) => match apply(&line, server) {
            Ok(applied) => {
                *generation = applied;
                tracing::info!(generation = applied, "live options applied");
                serde_json::json!({ "generation": applied })
            }
            Err(e) => {
                tracing::warn!(error = %e, "live options refused");
                serde_json::json!({ "error": format!("{e:#}") })
            }
        },
        Err(e) => serde_json::json!({ "error": e.to_string() }),
    };
    let mut out = answer.to_string().into_bytes();
    out.push(b'\n');
    let _ = write.write_all(&out).await;
}

fn is_status_probe(line: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(line).is_ok_and(|v| v["status"] == true)
}

fn apply(line: &str, server: &mut Server) -> anyhow::Result<u64> {
    let push: Push = serde_json::from_str(line).context("bad push")?;
    let auth_allow = match push.options.get("auth.allow") {
        Some(list) => AuthAllow::parse(list).context("auth.allow")?,
        None => AuthAllow::All,
    };
    let inflight_max = match push.options.get("network.inflight-max") {
        Some(n) => n.parse().context("network.inflight-max")?,
        None => 256,
    };
    if !(1..=4096).contains(&inflight_max) {
        anyhow::bail!("network.inflight-max {inflight_max} is outside 1..=4096");
    }
    server.reconfigure(auth_allow, inflight_max)?;
    Ok(push.generation)
}
