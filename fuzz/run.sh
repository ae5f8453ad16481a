#!/usr/bin/env bash
# Runs the wire decoder fuzz target for a bounded time: fuzz/run.sh [SECONDS] (default 60).
# Needs cargo-fuzz (`cargo install cargo-fuzz`); the stable toolchain is enough when
# RUSTC_BOOTSTRAP lets cargo-fuzz pass its sanitizer flags.
set -euo pipefail
seconds="${1:-60}"
cd "$(dirname "$0")"
command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz
mkdir -p corpus/decode_frame
# Seed the corpus with real frames so the fuzzer starts past the checksums.
cargo run --quiet -p kiln-wire --example seed_corpus -- corpus/decode_frame
# Sanitizer coverage does not survive the server profile's fat LTO.
CARGO_PROFILE_RELEASE_LTO=false RUSTC_BOOTSTRAP=1 cargo fuzz run decode_frame corpus/decode_frame -- \
  -max_total_time="$seconds" -max_len=70000 -print_final_stats=1
