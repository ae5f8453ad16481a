//! `kiln volume heal VOLUME` and `kiln volume rebalance VOLUME fix-layout`: every directory
//! of a distributed volume looked up through the distribution layer, whose lookups heal what
//! they find missing or broken — a directory copy a brick lacks, a layout with holes or that
//! leaves out a brick added since (`kiln_client::distribute::Distribute::heal_tree`).

use anyhow::Context;
use std::net::SocketAddr;

use kiln_client::BrickClient;
use kiln_client::distribute::{Distribute, Member};
use kiln_wire::Creds;

use crate::Global;

pub(crate) fn run(global: &Global, name: &str, json: bool) -> anyhow::Result<()> {
    let volume = crate::mount::resolve_volume(global, name)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    let report = runtime.block_on(on_distributed(
        global,
        name,
        &volume.bricks,
        async |distribute| distribute.heal_tree(&Creds::root()).await,
    ))?;
    if json {
        println!(
            "{}",
            serde_json::json!({
                "volume": name,
                "directories": report.dirs,
                "copies_made": report.copies_made,
                "layouts_healed": report.layouts_healed,
                "failed": report.failed,
            })
        );
    } else {
        println!(
            "{name}: {} directories looked at, {} missing copies made, {} layouts healed",
            report.dirs, report.copies_made, report.layouts_healed
        );
    }
    if report.failed > 0 {
        anyhow::bail!(
            "{} directories of {name} could not be healed (see the log)",
            report.failed
        );
    }
    Ok(())
}

/// Runs `work` on the distribution layer over every brick of volume `name` (`members`),
/// connected for it and closed after.
pub(crate) async fn on_distributed<T>(
    global: &Global,
    name: &str,
    members: &[Member<SocketAddr>],
    work: impl AsyncFnOnce(&Distribute<BrickClient>) -> Result<T, kiln_client::Error>,
) -> anyhow::Result<T> {
    let members = crate::files::connect_members(global, members)
        .await
        .with_context(|| format!("cannot reach the bricks of {name}"))?;
    let bricks: Vec<BrickClient> = members.iter().filter_map(Member::brick).cloned().collect();
    let distribute = Distribute::of_members(members, name)?;
    let done = work(&distribute).await;
    for brick in bricks {
        brick.close().await;
    }
    done.with_context(|| format!("on volume {name}"))
}
