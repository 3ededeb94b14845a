#!/usr/bin/env bash
# Counts the client's CPU instructions per GET with callgrind: repeatable, whatever else the
# machine is doing (unlike ops/s on this 2-core machine).
#
#   scripts/bench/callgrind-get.sh [BINARY_DIRECTORY] [OPERATIONS]
#
# BINARY_DIRECTORY holds rdkv-server and rdkv-ycsb (default: target/release of this checkout);
# OPERATIONS is the number of GETs (default 20000). It starts one node on 127.0.0.1 (ports
# 7640/7641), loads 2,000 records, runs OPERATIONS GETs with 4 tasks under
# `valgrind --tool=callgrind`, stops the node, and prints the client's total instructions and
# instructions per GET (startup included, so compare like with like). Exit code 0 on success.
set -euo pipefail
repository=$(git rev-parse --show-toplevel)
binaries=${1:-$repository/target/release}
operations=${2:-20000}
for program in rdkv-server rdkv-ycsb; do
  [ -x "$binaries/$program" ] || {
    echo "callgrind-get: $binaries/$program is missing; build it with cargo build --release --bins" >&2
    exit 2
  }
done
command -v valgrind >/dev/null || {
  echo "callgrind-get: valgrind is missing; install it with apt-get install valgrind" >&2
  exit 2
}
work=$(mktemp -d)
server=
cleanup() {
  [ -n "$server" ] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
cat >"$work/cluster.toml" <<'CLUSTER'
[cluster]
name = "callgrind-get"
secret = "callgrind-get-secret"
fabric = "soft"
operation_deadline = "20s"
lease_timeout = "60s"

[[node]]
id = 1
control_address = "127.0.0.1:7640"
fabric_address = "127.0.0.1:7641"
index_size = "1M"
heap_size = "6M"
chunk_size = "64K"
CLUSTER
"$binaries/rdkv-server" --config "$work/cluster.toml" --node 1 >"$work/server.log" 2>&1 &
server=$!
for _ in $(seq 100); do
  grep -q "ready" "$work/server.log" && break
  kill -0 "$server" 2>/dev/null || { cat "$work/server.log" >&2; exit 1; }
  sleep 0.1
done
grep -q "ready" "$work/server.log" || { echo "callgrind-get: the node did not start" >&2; exit 1; }
# The soft fabric, always: a build that knows shm would otherwise pick it, the node being on
# this host (builds before shm have no --fabric and use soft anyway).
fabric=()
if "$binaries/rdkv-ycsb" run --help 2>/dev/null | grep -- '--fabric' >/dev/null; then fabric=(--fabric soft); fi
"$binaries/rdkv-ycsb" load -c "$work/cluster.toml" -P workloadc -p recordcount=2000 --threads 4 >/dev/null
echo "counting instructions of $operations GETs (valgrind is about 50x slower)"
valgrind --tool=callgrind --callgrind-out-file="$work/callgrind.out" \
  "$binaries/rdkv-ycsb" run -c "$work/cluster.toml" -P workloadc -p recordcount=2000 \
  -p operationcount="$operations" --threads 4 "${fabric[@]}" >"$work/run.log" 2>"$work/valgrind.log"
grep -q "\[READ\], Operations, $operations" "$work/run.log" || {
  echo "callgrind-get: the run did not complete $operations GETs" >&2
  cat "$work/run.log" >&2
  exit 1
}
total=$(grep -o 'refs: *[0-9,]*' "$work/valgrind.log" | tr -dc '0-9')
# CALLGRIND_OUT=path keeps the profile, for callgrind_annotate.
[ -z "${CALLGRIND_OUT:-}" ] || cp "$work/callgrind.out" "$CALLGRIND_OUT"
echo "instructions: $total in all, $((total / operations)) per GET ($operations GETs, startup included)"
