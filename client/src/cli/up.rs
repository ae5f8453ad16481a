//! `kiln up`: one command from a fresh clone to a served volume. It makes what is missing —
//! the cluster CA, a brick certificate, an `admin` client certificate, the brick — then runs
//! `kiln-brickd serve` in its place, in the foreground, until Ctrl-C. (The management daemon will take this
//! over: see README.md, Status.)

use std::net::SocketAddr;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use kiln_mgmt::pki::{self, Role};

const BRICK_NAME: &str = "local";
const CLIENT_NAME: &str = "admin";

pub(crate) fn run(data_dir: &Path, listen: SocketAddr) -> anyhow::Result<()> {
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("cannot create {}", data_dir.display()))?;
    let data_dir = data_dir.canonicalize()?;
    let tls = data_dir.join("tls");
    if !pki::ca_files(&tls).cert.exists() {
        pki::init_ca(&tls)?;
    }
    let brick_role = Role::Brick {
        hosts: vec!["localhost".into(), listen.ip().to_string()],
    };
    for (role, name) in [(&brick_role, BRICK_NAME), (&Role::Client, CLIENT_NAME)] {
        if !pki::identity_files(&tls, role, name).cert.exists() {
            pki::issue(&tls, role, name, pki::CERT_VALIDITY_DAYS)?;
        }
    }

    let brickd = sibling_binary("kiln-brickd")?;
    let brick = data_dir.join("brick");
    if !brick.join(".glusterfs").exists() {
        std::fs::create_dir_all(&brick)?;
        let status = Command::new(&brickd).arg("format").arg(&brick).status()?;
        if !status.success() {
            bail!("kiln-brickd format {} failed", brick.display());
        }
    }
    println!("serving {} on {listen}; in another shell:", brick.display());
    println!(
        "  export KILN_TLS_DIR={} KILN_BRICK={listen}",
        tls.display()
    );
    println!("  kiln put ./README.md /readme && kiln ls -l /");
    // The brick takes this process's place, so Ctrl-C and SIGTERM reach it directly and it
    // drains before the shell prompt returns.
    let error = Command::new(&brickd)
        .arg("serve")
        .arg(&brick)
        .arg("--listen")
        .arg(listen.to_string())
        .arg("--tls-dir")
        .arg(&tls)
        .arg("--name")
        .arg(BRICK_NAME)
        .exec();
    Err(error).with_context(|| format!("cannot run {}", brickd.display()))
}

/// `name` next to this executable (how cargo and packages lay them out), else from PATH.
fn sibling_binary(name: &str) -> anyhow::Result<PathBuf> {
    let here = std::env::current_exe()?;
    let beside = here.with_file_name(name);
    if beside.exists() {
        return Ok(beside);
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(name))
        .find(|p| p.exists())
        .with_context(|| {
            format!(
                "{name} not found beside {} or in PATH; build it with `cargo build --release`",
                here.display()
            )
        })
}
