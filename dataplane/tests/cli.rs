//! `kiln-brickd format` and `kiln-brickd check` as a user runs them.

use std::process::Command;

fn brickd(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln-brickd"))
        .args(args)
        .output()
        .expect("run kiln-brickd");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn format_then_check() {
    let dir = tempfile::tempdir().expect("tempdir");
    let brick = dir.path().join("brick");
    let brick = brick.to_str().expect("utf-8 path");
    let (code, out, err) = brickd(&["format", brick]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("formatted"), "{out}");
    let (code, out, err) = brickd(&["check", brick]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("stale handles          0 found"), "{out}");
    // Damage it: a name removed behind the brick's back leaves a stale handle.
    std::fs::write(format!("{brick}/copied"), b"x").expect("write");
    let (code, _, err) = brickd(&["check", brick]);
    assert_eq!(code, 1);
    assert!(err.contains("problems found; run with --repair"), "{err}");
    let (code, out, _) = brickd(&["check", "--repair", brick]);
    assert_eq!(code, 0);
    assert!(out.contains("objects without gfid   1 repaired"), "{out}");
    assert_eq!(brickd(&["check", brick]).0, 0);
}

#[test]
fn clear_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().to_str().expect("utf-8 path");
    std::fs::write(dir.path().join("data"), b"x").expect("write");
    let (code, _, err) = brickd(&["format", path]);
    assert_eq!(code, 1);
    assert!(err.contains("is not empty; refusing to format"), "{err}");
    let (code, _, err) = brickd(&["check", path]);
    assert_eq!(code, 1);
    assert!(err.contains("is not a brick"), "{err}");
    let (code, _, err) = brickd(&["frobnicate"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("unrecognized subcommand") && err.contains("Usage:"),
        "{err}"
    );
    // Serving needs the brick's certificate: a missing one is named.
    let (code, _, err) = brickd(&["serve", path, "--tls-dir", path, "--name", "b"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("cannot read")
            && err.contains("ca.crt")
            && err.matches("os error").count() == 1,
        "{err}"
    );
}
