#!/usr/bin/env bash
# A joiner's state stream (the ring broadcast) across real hosts whose links, not this
# machine's two cores, are the limit: N network namespaces on one bridge, each host's link
# shaped to RATE (tc tbf), one rank per host. Prints the time until the slowest rank has every
# byte, for each world size: a pipelined broadcast takes about one link's time for the whole
# state whatever the world size; a store-and-forward one would take (N-1) times it.
#
# Usage (root): bench/broadcast_netns.sh [SIZES=2,4,8,16] [MB=20] [RATE=200mbit] [REPEATS=3]
# Addresses 198.18.1.0/24 (RFC 2544's test range); everything is removed on exit.
set -euo pipefail
sizes=${1:-2,4,8,16}; mb=${2:-20}; rate=${3:-200mbit}; repeats=${4:-3}
root=$(cd "$(dirname "$0")/.." && pwd)
cargo build --release --quiet --manifest-path "$root/Cargo.toml" -p collective --example broadcast_rank
bin="$root/target/release/examples/broadcast_rank"
max=$(tr , '\n' <<<"$sizes" | sort -n | tail -1)
br=bcbr$$
cleanup() {
  for i in $(seq 1 "$max"); do ip netns del "bc$$-$i" 2>/dev/null || true; done
  ip link del "$br" 2>/dev/null || true
}
trap cleanup EXIT
ip link add "$br" type bridge && ip link set "$br" up
for i in $(seq 1 "$max"); do
  ns="bc$$-$i"
  ip netns add "$ns"
  ip link add "bcv$$-$i" type veth peer name eth0 netns "$ns"
  ip link set "bcv$$-$i" master "$br" up
  ip -n "$ns" addr add "198.18.1.$i/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  # Each host sends at RATE (its side of the link), and receives at RATE (the bridge's side).
  ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 100ms
  tc qdisc add dev "bcv$$-$i" root tbf rate "$rate" burst 256kb latency 100ms
done
for n in $(tr , ' ' <<<"$sizes"); do
  port=$((29600 + n))
  pids=()
  for r in $(seq 0 $((n - 1))); do
    ip netns exec "bc$$-$((r + 1))" env RANK="$r" WORLD_SIZE="$n" MASTER_ADDR=198.18.1.1 \
      MASTER_PORT="$port" TRAINCTL_JOB_TOKEN=bench "$bin" "$mb" "$repeats" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
done
