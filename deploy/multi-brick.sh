#!/usr/bin/env bash
# Bring up a volume of N bricks on this machine with kiln-mgmtd, from a built tree.
#   deploy/multi-brick.sh [BRICKS] [DATA_DIR]     (defaults: 3 bricks under ./kiln-multi)
# Runs kiln-mgmtd in the background (its log: DATA_DIR/mgmtd.log); stop it with
#   kill $(cat DATA_DIR/mgmtd.pid)
set -euo pipefail
bricks=${1:-3}
data=$(realpath -m "${2:-./kiln-multi}")
bin=$(realpath "$(dirname "$0")/../target/release")
[[ -x $bin/kiln-mgmtd ]] || { echo "build first: cargo build --release" >&2; exit 1; }
mkdir -p "$data"
export KILN_MGMT_SOCKET=$data/mgmtd.sock KILN_TLS_DIR=$data/state/tls
"$bin/kiln-mgmtd" --state-dir "$data/state" --socket "$KILN_MGMT_SOCKET" 2>>"$data/mgmtd.log" &
echo $! >"$data/mgmtd.pid"
for _ in $(seq 100); do [[ -S $KILN_MGMT_SOCKET ]] && break; sleep 0.1; done
dirs=()
for i in $(seq 0 $((bricks - 1))); do dirs+=("$data/bricks/b$i"); done
"$bin/kiln" volume create multi "${dirs[@]}"
"$bin/kiln" volume start multi
"$bin/kiln" volume status multi
echo
echo "export KILN_MGMT_SOCKET=$KILN_MGMT_SOCKET KILN_TLS_DIR=$KILN_TLS_DIR"
echo "each brick serves its own directory; reach brick N with KILN_BRICK=127.0.0.1:<port from status>"
