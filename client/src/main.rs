//! `kiln`: the one command users type.

use std::process::ExitCode;

const USAGE: &str =
    "usage: kiln up [BRICK_DIR]    serve a single-node volume from a local directory";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("up") => {
            eprintln!(
                "kiln: 'kiln up' will start kiln-mgmtd with its embedded store and serve a \
                 one-brick volume from {}; it needs the brick engine and the management daemon, \
                 which are not built yet (see README.md, Status)",
                args.get(1).map_or("./kiln-data", String::as_str)
            );
            ExitCode::from(2)
        }
        Some("--version") => {
            println!("kiln {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}
