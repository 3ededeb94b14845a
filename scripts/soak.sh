#!/usr/bin/env bash
# A write-heavy soak: YCSB workload A against one node whose heap is about 2× its live data, for
# a bounded time, with heap use, the node's RSS and pinned bytes sampled every 15 s.
#
#   scripts/soak.sh [SECONDS] [RECORDS] [HEAP] [BINARY_DIRECTORY]
#       defaults: 300 s, 100000 records of 1 KB, heap 220M (2 × 109 MB of live blocks),
#       target/release
#
# It writes a one-node cluster file (loopback, reserved ports) to a temporary run directory, starts
# the node, loads RECORDS records with 16 tasks, and runs workload A with 64 tasks for SECONDS
# seconds. It prints the samples, then the run's errors, median ops/s and the seconds under half
# of it. Exit code 0 only when no operation failed and no second fell under half the median.
# The node is stopped on exit, whatever happens.
set -euo pipefail
seconds=${1:-300}
records=${2:-100000}
heap=${3:-220M}
binaries=${4:-target/release}
work=$(mktemp -d)
cleanup() {
  "$binaries/rdkv-cluster" down "$work/soak.toml" --run-dir "$work/run" >/dev/null 2>&1 || true
  [ -n "${runner:-}" ] && kill "$runner" 2>/dev/null || true
  [ -n "${port_holder:-}" ] && kill "$port_holder" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
# The node's three ports, bound to port 0 and held (SO_REUSEADDR, never listened on) by a
# helper until cleanup: the node binds them alongside, and no other process can take one
# before it does (rdkv_common::ports explains why this is sound on Linux).
exec {ports_fd}< <(exec python3 -c '
import signal, socket, sys
sockets = [socket.socket() for _ in range(3)]
for s in sockets:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in sockets], flush=True)
sys.stdout.close()
signal.pause()')
port_holder=$!
read -r control fabric metrics <&"$ports_fd"
exec {ports_fd}<&-
cat >"$work/soak.toml" <<TOML
[cluster]
name = "soak"
secret = "rdkv-soak-test-secret"
fabric = "soft"

[[node]]
id = 1
control_address = "127.0.0.1:$control"
fabric_address = "127.0.0.1:$fabric"
metrics_address = "127.0.0.1:$metrics"
index_size = "16M"
heap_size = "$heap"
chunk_size = "1M"
TOML
"$binaries/rdkv-cluster" up "$work/soak.toml" --detach --run-dir "$work/run" >/dev/null
pid=$(cat "$work/run/node-1.pid")
echo "soak: node pid $pid, heap $heap, loading $records records"
"$binaries/rdkv-ycsb" load -c "$work/soak.toml" -P workloada -p recordcount="$records" --threads 16 >"$work/load.txt"
echo "soak: running workload A with 64 tasks for $seconds s"
"$binaries/rdkv-ycsb" run -c "$work/soak.toml" -P workloada -p recordcount="$records" \
  -p operationcount=1000000000 --max-execution-time "$seconds" --threads 64 \
  --json "$work/run.json" >"$work/run.txt" 2>"$work/run.log" &
runner=$!
printf '%8s  %12s  %12s  %12s\n' "second" "heap used" "node RSS" "pinned"
elapsed=0
while kill -0 "$runner" 2>/dev/null; do
  sleep 15 || true
  elapsed=$((elapsed + 15))
  kill -0 "$runner" 2>/dev/null || break
  heap_used=$(curl -s "http://127.0.0.1:$metrics/metrics" | awk '/^rdkv_heap_used_bytes/ { print $2 }')
  pinned=$(curl -s "http://127.0.0.1:$metrics/metrics" | awk '/^rdkv_pinned_bytes/ { print $2 }')
  rss=$(awk '/^VmRSS/ { print $2 * 1024 }' "/proc/$pid/status" 2>/dev/null || echo 0)
  printf '%8s  %12s  %12s  %12s\n' "$elapsed" "${heap_used:-?}" "$rss" "${pinned:-?}"
done
wait "$runner" && status=0 || status=$?
runner=
[ "$status" -eq 0 ] || { echo "soak: rdkv-ycsb run exited $status" >&2; cat "$work/run.log" >&2; exit 1; }
python3 - "$work/run.json" <<'PY'
import json, statistics, sys
reports = json.load(open(sys.argv[1]))
report = reports[0] if isinstance(reports, list) else reports
errors = sum(count for kind in report["kinds"] for outcome, count in kind["outcomes"].items() if outcome != "OK")
series = [ops for second, ops in report["timeseries"]][1:-1]  # drop the partial first and last second
median = statistics.median(series)
low = [round(ops) for ops in series if ops < median / 2]
print(f"soak: {report['operations']} operations in {report['runtime_ms'] / 1000:.0f} s, "
      f"{report['throughput']:.0f} ops/s; per second: median {median:.0f}, min {min(series):.0f}, "
      f"{len(low)} seconds under half the median; {errors} errors")
sys.exit(1 if errors or low else 0)
PY
