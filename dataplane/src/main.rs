//! `kiln-brickd`: the brick process.
//!
//! ```text
//! kiln-brickd format BRICK_DIR      make an empty directory a Kiln brick
//! kiln-brickd check [--repair] BRICK_DIR
//!                                   find (and repair) stale handles, missing gfids,
//!                                   dangling directory handles, interrupted fops
//! ```
//! Serving clients over QUIC comes with the transport (see README.md, Status).

use std::path::PathBuf;
use std::process::ExitCode;

use kiln_dataplane::Brick;
use kiln_dataplane::recovery;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const USAGE: &str =
    "usage: kiln-brickd format BRICK_DIR\n       kiln-brickd check [--repair] BRICK_DIR";

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["format", dir] => Brick::format(&PathBuf::from(dir))
            .map(|id| println!("formatted {dir} as brick {id}"))
            .map_err(anyhow::Error::from),
        ["check", dir] => check(dir, false),
        ["check", "--repair", dir] => check(dir, true),
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kiln-brickd: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn check(dir: &str, repair: bool) -> anyhow::Result<()> {
    let brick = Brick::open(&PathBuf::from(dir))?;
    let report = recovery::check(&brick, repair).map_err(std::io::Error::from)?;
    println!("{report}");
    if report.problems() > 0 && !repair {
        anyhow::bail!(
            "{} problems found; run with --repair to fix them",
            report.problems()
        );
    }
    Ok(())
}
