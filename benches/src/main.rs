//! `kiln-bench`: Kiln's workloads, each printed beside a reference from the same run.
//!
//! ```text
//! kiln-bench engine [--files N] [--dirs N] [--depths 1,16,256] [--loop-fs-mib M] [--json]
//! ```

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use kiln_bench::engine::{self, EngineBench};
use kiln_bench::report::{Reporter, environment};
use kiln_bench::scratch::Scratch;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(
    name = "kiln-bench",
    version,
    about = "Kiln workloads, each with a reference measured in the same run"
)]
struct Cli {
    #[command(subcommand)]
    workload: Workload,
    /// Print JSON Lines instead of a table.
    #[arg(long, global = true)]
    json: bool,
    /// Make the scratch directory under this path (default: the system temp directory).
    #[arg(long, global = true)]
    scratch: Option<PathBuf>,
    /// As root: measure on a fresh ext4 of this many MiB in a loop image (steadier than a
    /// shared root file system).
    #[arg(long, global = true)]
    loop_fs_mib: Option<u64>,
}

#[derive(Debug, Subcommand)]
enum Workload {
    /// The brick engine called directly, against a std::fs loop on the same disk.
    Engine {
        #[arg(long, default_value_t = 100_000)]
        files: usize,
        #[arg(long, default_value_t = 100)]
        dirs: usize,
        #[arg(long, value_delimiter = ',', default_values_t = [1, 16, 256])]
        depths: Vec<usize>,
        #[arg(long, default_value_t = 4096)]
        file_bytes: usize,
        /// Files held open during the open-latency sweep; 0 means as many as the process may
        /// hold (RLIMIT_NOFILE less the brick's own fds).
        #[arg(long, value_delimiter = ',', default_values_t = [10, 1000, 10_000, 0])]
        open_sweep: Vec<usize>,
        #[arg(long, default_value_t = 2000)]
        open_samples: usize,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let scratch = Scratch::new(cli.scratch.as_deref(), cli.loop_fs_mib)?;
    let mut out = Reporter::new(cli.json);
    let env = environment(&scratch.fs);
    if cli.json {
        println!("{}", serde_json::json!({ "environment": env }));
    } else {
        println!("# {env}");
        println!(
            "# memory: {} bytes per cached GFID entry, {} bytes per open fd in the table",
            kiln_dataplane::cache::GFID_CACHE_ENTRY_BYTES,
            kiln_dataplane::fdtable::FD_TABLE_ENTRY_BYTES
        );
    }
    match cli.workload {
        Workload::Engine {
            files,
            dirs,
            depths,
            file_bytes,
            open_sweep,
            open_samples,
        } => {
            let bench = EngineBench {
                files,
                dirs: dirs.max(1),
                depths,
                file_bytes,
                open_sweep,
                open_samples,
            };
            engine::run(&bench, &scratch, &mut out)?;
        }
    }
    Ok(())
}
