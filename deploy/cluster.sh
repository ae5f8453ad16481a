#!/usr/bin/env bash
# Three Kiln hosts on this machine, for trying a cluster out: each a network namespace on a
# bridge (10.77.0.1-3, the bridge 10.77.0.254), running a member of one etcd cluster (Debian's
# etcd-server) and a kiln-mgmtd that keeps the configuration there; host 1 makes the cluster
# (`kiln cluster init`), hosts 2 and 3 join it with tokens. From a built tree, as root:
#   deploy/cluster.sh up [DATA_DIR]      (default ./kiln-cluster; etcd and ip must be installed)
#   deploy/cluster.sh down [DATA_DIR]    (kills daemons, bricks and members; keeps DATA_DIR)
# Then, e.g.:
#   export KILN_MGMT_SOCKET=DATA_DIR/host1/run/mgmtd.sock KILN_TLS_DIR=DATA_DIR/host1/state/tls
#   kiln volume create v 10.77.0.1:DATA_DIR/host1/b 10.77.0.2:DATA_DIR/host2/b 10.77.0.3:DATA_DIR/host3/b
#   kiln volume set v server.root-allow admin && kiln volume start v
#   kiln cluster status; mkdir -p /mnt/v && kiln mount v /mnt/v
# (any host's socket takes any command; `ip link set kc-h3 down` cuts host 3 off). KILN_BIN
# names another directory of binaries (e.g. target/debug).
set -euo pipefail
action=${1:-}
data=$(realpath -m "${2:-./kiln-cluster}")
bin=$(realpath -m "${KILN_BIN:-$(dirname "$0")/../target/release}")
net=10.77.0
hosts=(1 2 3)
endpoints=$(printf "http://$net.%s:2379," "${hosts[@]}")
endpoints=${endpoints%,}
initial=
for h in "${hosts[@]}"; do initial+="m$h=http://$net.$h:2380,"; done
initial=${initial%,}

down() {
  for h in "${hosts[@]}"; do
    for pidfile in "$data/host$h"/*.pid "$data/host$h"/state/run/*.pid; do
      [[ -f $pidfile ]] && kill -9 "$(cat "$pidfile")" 2>/dev/null || true
    done
    ip netns del "kc-$h" 2>/dev/null || true
  done
  ip link del kc-br 2>/dev/null || true
}

up() {
  [[ -x $bin/kiln-mgmtd ]] || { echo "build first: cargo build --release" >&2; exit 1; }
  command -v etcd >/dev/null || { echo "install etcd: apt-get install etcd-server" >&2; exit 1; }
  ip link add kc-br type bridge
  ip addr add "$net.254/24" dev kc-br
  ip link set kc-br up
  for h in "${hosts[@]}"; do
    ip netns add "kc-$h"
    ip link add "kc-h$h" type veth peer name eth0 netns "kc-$h"
    ip link set "kc-h$h" master kc-br up
    ip -n "kc-$h" addr add "$net.$h/24" dev eth0
    ip -n "kc-$h" link set eth0 up
    ip -n "kc-$h" link set lo up
    mkdir -p "$data/host$h"
    ip netns exec "kc-$h" etcd --name "m$h" --data-dir "$data/host$h/etcd" \
      --listen-client-urls "http://$net.$h:2379" --advertise-client-urls "http://$net.$h:2379" \
      --listen-peer-urls "http://$net.$h:2380" --initial-advertise-peer-urls "http://$net.$h:2380" \
      --initial-cluster "$initial" --initial-cluster-state new \
      >"$data/host$h/etcd.log" 2>&1 &
    echo $! >"$data/host$h/etcd.pid"
  done
  first=${hosts[0]}
  for h in "${hosts[@]}"; do
    # The first host makes the cluster (and its CA); the others join it with a one-time
    # token from the first, and get their certificates without the CA's key.
    if [[ $h == "$first" ]]; then
      KILN_STATE_DIR=$data/host$h/state "$bin/kiln" cluster init --etcd "$endpoints" \
        --host "$net.$h" --cluster try
    else
      # (The token through the environment: it stays out of `ps`.)
      KILN_JOIN_TOKEN=$(KILN_MGMT_SOCKET=$data/host$first/run/mgmtd.sock "$bin/kiln" cluster token 2>/dev/null) \
        KILN_STATE_DIR=$data/host$h/state "$bin/kiln" cluster join "$net.$first" --host "$net.$h"
    fi
    ip netns exec "kc-$h" "$bin/kiln-mgmtd" --state-dir "$data/host$h/state" \
      --socket "$data/host$h/run/mgmtd.sock" --listen-ip "$net.$h" \
      >"$data/host$h/mgmtd.log" 2>&1 &
    echo $! >"$data/host$h/mgmtd.pid"
    for _ in $(seq 300); do [[ -S $data/host$h/run/mgmtd.sock ]] && break; sleep 0.1; done
    [[ -S $data/host$h/run/mgmtd.sock ]] || { echo "kiln-mgmtd of host $h did not start: see $data/host$h/mgmtd.log" >&2; exit 1; }
  done
  KILN_MGMT_SOCKET=$data/host1/run/mgmtd.sock "$bin/kiln" cluster status
  echo
  echo "export KILN_MGMT_SOCKET=$data/host1/run/mgmtd.sock KILN_TLS_DIR=$data/host1/state/tls"
}

case $action in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down [DATA_DIR]" >&2; exit 2 ;;
esac
