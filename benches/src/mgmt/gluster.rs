//! (d) `mgmt.set` / `gluster-cli`: GlusterFS's own `gluster volume set` on a one-brick volume,
//! where GlusterFS is installed.

use std::path::Path;

use anyhow::Context;
use hdrhistogram::Histogram;
use serde_json::json;

use super::{Floor, KilnSets, Rows, latency_record, sampled};
use crate::mount::glusterd::Glusterd;
use crate::process::{check_stop, which};
use crate::report::micros;

/// GlusterFS's option the `gluster-cli` row changes: live (a started volume's brick
/// reconfigures when it changes).
const GLUSTER_KEY: &str = "performance.io-thread-count";
/// Its values cycle through 1..=GLUSTER_VALUES (GlusterFS takes 1 to 64).
const GLUSTER_VALUES: usize = 64;

/// The value of the `i`-th `gluster volume set`: consecutive sets always differ.
fn gluster_value(i: usize) -> String {
    (i % GLUSTER_VALUES + 1).to_string()
}

/// (d) `gluster volume set` on a one-brick GlusterFS volume in `root`, timed as the kiln
/// CLI's sets and compared with `kiln`'s p50s; noted and skipped where `gluster` is not on
/// PATH, with `--no-glusterfs` (`enabled` false), or where GlusterFS cannot be set up.
pub(super) fn gluster(
    root: &Path,
    enabled: bool,
    sets: usize,
    floor: Floor,
    kiln: KilnSets,
    rows: &mut Rows<'_>,
) -> anyhow::Result<()> {
    let found = which("gluster").map(|p| p.display().to_string());
    let note = |note: String, setup: serde_json::Value| json!({ "found": found, "note": note, "setup": setup });
    if found.is_none() {
        let why = "gluster not found on PATH: no GlusterFS comparison";
        rows.note("gluster", &note(why.into(), json!(null)));
        return Ok(());
    }
    if !enabled {
        let why = "--no-glusterfs: no GlusterFS comparison";
        rows.note("gluster", &note(why.into(), json!(null)));
        return Ok(());
    }
    let dir = root.join("glusterfs");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    // Torn down when dropped, on every path out of here.
    let mut g = match Glusterd::set_up_installed(&dir, &dir) {
        Ok(g) => g,
        Err(e) => {
            check_stop()?;
            let why = format!("GlusterFS could not be set up, no comparison: {e:#}");
            rows.note("gluster", &note(why, json!(null)));
            return Ok(());
        }
    };
    let what = format!("`gluster volume set {} {GLUSTER_KEY} <n>`", g.volume());
    rows.note("gluster", &note(what, g.describe()));
    let (rate, h) = gluster_sets(&g, sets)?;
    let p50_us = micros(&h, 0.5);
    rows.push(latency_record(
        "mgmt.set",
        "gluster-cli",
        json!({ "sets": sets, "key": GLUSTER_KEY, "volume": "started", "bricks": 1,
                "kiln_cli_vs_gluster": p50_us / kiln.created_p50_us,
                "kiln_cli_started_vs_gluster": p50_us / kiln.started_p50_us }),
        rate,
        &h,
        floor,
    ));
    rows.note("gluster_teardown", &g.tear_down());
    Ok(())
}

/// `n` measured `gluster volume set` processes after `warmup(n)` unmeasured ones: sets/s and
/// the latency of each.
fn gluster_sets(g: &Glusterd, n: usize) -> anyhow::Result<(f64, Histogram<u64>)> {
    sampled(n, |i| g.set(GLUSTER_KEY, &gluster_value(i)))
}
