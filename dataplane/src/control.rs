//! The brick's control socket: `kiln-mgmtd` pushes live options here, reads the per-fop
//! profile and asks for a state dump. The requests and answers are
//! [`kiln_admin::control`]'s, one line each per connection; connections are answered one at a
//! time, each bounded by the exchange's timeout.
//!
//! Options the brick cannot change while running are not pushed (a push naming one is
//! refused): they take effect when kiln-mgmtd restarts it.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context as _;
use kiln_admin::control::{
    ControlAnswer, ControlRequest, EXCHANGE, EngineDump, SessionFds, StartSettings, Statedump,
};
use kiln_admin::options::BrickSettings;
use kiln_dataplane::Engine;
use kiln_dataplane::leases::LeaseSettings;
use kiln_dataplane::server::Server;
use tokio::net::{UnixListener, UnixStream};

/// Binds the control socket, root-only ([`kiln_admin::exchange::bind_private`]).
pub(crate) fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    Ok(kiln_admin::exchange::bind_private(path)?)
}

/// The running brick, as the control socket reads and changes it.
pub(crate) struct Running {
    pub(crate) server: Server,
    pub(crate) engine: Engine,
    /// The configuration generation the brick runs.
    pub(crate) generation: u64,
    /// What the brick was started with, for the state dump.
    pub(crate) start: StartSettings,
    /// What it runs now: the start's settings with the live options pushed since.
    pub(crate) settings: BrickSettings,
    pub(crate) started: std::time::Instant,
}

/// Answers one request.
pub(crate) async fn serve(mut stream: UnixStream, running: &mut Running) {
    let answer = match EXCHANGE.read_request(&mut stream).await {
        Ok(request) => answer(request, running).await,
        Err(e) => ControlAnswer::Error {
            message: format!("bad request: {e}"),
        },
    };
    if let Err(e) = EXCHANGE.write_answer(&mut stream, &answer).await {
        tracing::debug!(error = %e, "control answer not delivered");
    }
}

async fn answer(request: ControlRequest, running: &mut Running) -> ControlAnswer {
    let generation = running.generation;
    match request {
        ControlRequest::Status => ControlAnswer::Generation { generation },
        ControlRequest::Profile => ControlAnswer::Profile {
            generation,
            profile: running.engine.profile().report(),
        },
        ControlRequest::Statedump => ControlAnswer::Statedump {
            generation,
            statedump: Box::new(statedump(running).await),
        },
        // A push older than what the brick runs (a catch-up racing a newer change) would
        // bring back an older value: it is answered with the generation the brick runs.
        ControlRequest::Push {
            generation: pushed, ..
        } if pushed < running.generation => {
            tracing::info!(pushed, running = running.generation, "stale push ignored");
            ControlAnswer::Generation {
                generation: running.generation,
            }
        }
        ControlRequest::Push {
            generation,
            options,
        } => match apply(&options, running) {
            Ok(()) => {
                running.generation = generation;
                tracing::info!(generation, "live options applied");
                ControlAnswer::Generation { generation }
            }
            Err(e) => {
                tracing::warn!(error = %e, "live options refused");
                ControlAnswer::Error {
                    message: format!("{e:#}"),
                }
            }
        },
    }
}

async fn statedump(running: &Running) -> Statedump {
    let engine = running.engine.state().await;
    Statedump {
        pid: std::process::id(),
        uptime_s: running.started.elapsed().as_secs(),
        generation: running.generation,
        settings: running.start.clone(),
        live_options: running.settings.live_options(),
        listen: running.server.local_addr(),
        connections: running.server.connections().list(),
        engine: EngineDump {
            kind: running.engine.kind().name().to_owned(),
            workers: running.engine.workers(),
            open_fds: engine.open_fds(),
            fd_tables: engine
                .fd_tables
                .iter()
                .map(|(&session, &open_fds)| SessionFds { session, open_fds })
                .collect(),
            gfid_cache: engine.gfid_cache,
            dirfd_cache: engine.dirfd_cache,
            ring: engine.ring,
        },
        profile: running.engine.profile().report(),
        volume_options: None,
    }
}

/// Applies a push's live options; nothing changes if one is refused.
fn apply(options: &BTreeMap<String, String>, running: &mut Running) -> anyhow::Result<()> {
    let settings = running.settings.with_live(options).context("bad push")?;
    running.server.reconfigure(crate::live_config(&settings)?)?;
    running
        .engine
        .profile()
        .set(settings.count_fop_hits, settings.latency_measurement);
    running
        .engine
        .leases()
        .set_settings(LeaseSettings::from(&settings));
    running.settings = settings;
    Ok(())
}
