//! The brick's control socket: `kiln-mgmtd` pushes live options here, reads the per-fop
//! profile and asks for a state dump (one JSON line in, one out, per connection).
//!
//! ```text
//! → {"generation":7,"options":{"auth.allow":"alice,bob","network.inflight-max":"128",…}}
//! ← {"generation":7}            or   {"error":"…"}
//! → {"status":true}             (a health probe: changes nothing)
//! ← {"generation":7}
//! → {"profile":true}
//! ← {"generation":7,"profile":{…}}           (kiln_dataplane::profile::ProfileReport)
//! → {"statedump":true}
//! ← {"generation":7,"statedump":{…}}
//! ```
//! Options the brick cannot change while running are not sent: they take effect when
//! kiln-mgmtd restarts it.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context as _;
use kiln_dataplane::Engine;
use kiln_dataplane::server::{AuthAllow, Server};
use serde_json::json;
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

/// The running brick, as the control socket reads and changes it.
pub(crate) struct Running {
    pub(crate) server: Server,
    pub(crate) engine: Engine,
    /// The configuration generation the brick runs.
    pub(crate) generation: u64,
    /// What the brick was started with and the live options it runs, for the state dump.
    pub(crate) settings: serde_json::Value,
    pub(crate) live: BTreeMap<String, String>,
    pub(crate) started: std::time::Instant,
}

#[derive(serde::Deserialize)]
struct Push {
    generation: u64,
    options: BTreeMap<String, String>,
}

/// Answers one request.
pub(crate) async fn serve(stream: UnixStream, running: &mut Running) {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    let answer = match BufReader::new(read)
        .take(LINE_MAX_BYTES)
        .read_line(&mut line)
        .await
    {
        Ok(_) => answer(&line, running).await,
        Err(e) => json!({ "error": e.to_string() }),
    };
    let mut out = answer.to_string().into_bytes();
    out.push(b'\n');
    let _ = write.write_all(&out).await;
}

async fn answer(line: &str, running: &mut Running) -> serde_json::Value {
    let request: serde_json::Value = serde_json::from_str(line).unwrap_or_default();
    let generation = running.generation;
    if request["status"] == true {
        return json!({ "generation": generation });
    }
    if request["profile"] == true {
        return json!({ "generation": generation, "profile": running.engine.profile().report() });
    }
    if request["statedump"] == true {
        return json!({ "generation": generation, "statedump": statedump(running).await });
    }
    match apply(line, running) {
        Ok(applied) => {
            running.generation = applied;
            tracing::info!(generation = applied, "live options applied");
            json!({ "generation": applied })
        }
        Err(e) => {
            tracing::warn!(error = %e, "live options refused");
            json!({ "error": format!("{e:#}") })
        }
    }
}

async fn statedump(running: &Running) -> serde_json::Value {
    let engine = running.engine.state().await;
    json!({
        "pid": std::process::id(),
        "uptime_s": running.started.elapsed().as_secs(),
        "generation": running.generation,
        "settings": running.settings,
        "live_options": running.live,
        "listen": running.server.local_addr(),
        "connections": running.server.connections().list(),
        "engine": {
            "kind": running.engine.kind().name(),
            "workers": running.engine.workers(),
            "open_fds": engine.open_fds(),
            "fd_tables": engine.fd_tables,
            "gfid_cache": engine.gfid_cache,
            "dirfd_cache": engine.dirfd_cache,
            "ring": engine.ring,
        },
        "profile": running.engine.profile().report(),
    })
}

/// `on`/`off` as the option table writes booleans.
pub(crate) fn switch(options: &BTreeMap<String, String>, key: &str) -> anyhow::Result<bool> {
    match options.get(key).map(String::as_str) {
        None | Some("off") => Ok(false),
        Some("on") => Ok(true),
        Some(other) => anyhow::bail!("{key}: '{other}' is neither on nor off"),
    }
}

fn apply(line: &str, running: &mut Running) -> anyhow::Result<u64> {
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
    let counting = switch(&push.options, "diagnostics.count-fop-hits")?;
    let timing = switch(&push.options, "diagnostics.latency-measurement")?;
    running.server.reconfigure(auth_allow, inflight_max)?;
    running.engine.profile().set(counting, timing);
    running.live = push.options;
    Ok(push.generation)
}
