#!/usr/bin/env bash
# Measures what one stopped client costs the other writers (docs/benchmarks.md, *A frozen
# client*; docs/protocol.md, *Heap space*).
#
#   scripts/frozen-client.sh [SECONDS] [FABRIC]
#       e.g. scripts/frozen-client.sh 15 auto
#       defaults: 15 s; the clients' fabric `auto` (each node's shm fabric, as a client on the
#       nodes' host gets by default); `soft` runs them over the soft NIC
#
# It copies examples/local-3node.toml (three nodes of 4 MiB heaps, replicas = 2) onto free
# loopback ports, starts the cluster from target/release (build it first: cargo build
# --release --workspace --bins), loads 1,000 records, and starts YCSB-A writer A (4 threads)
# for the whole run. Then writer B (4 threads) runs twice, SECONDS each, one after the other:
# once with A running, and once with A stopped (SIGSTOP) for those SECONDS. It prints B's
# throughput in each window, their ratio, B's errors, each node's rdkv_heap_fences_total, and
# how many connections a node kept because an shm client stopped inside a request. Everything it starts stops by itself or when it exits.
set -euo pipefail
seconds=${1:-15}
fabric=${2:-auto}
case "$seconds" in
  *[!0-9]* | "") echo "usage: $0 [SECONDS] [FABRIC]" >&2; exit 2 ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
binaries=${CARGO_TARGET_DIR:-$root/target}/release
work=$(mktemp -d "${TMPDIR:-/tmp}/rdkv-frozen-client.XXXXXX")
file=$work/cluster.toml
pids=()
frozen=

stop() {
  trap - EXIT INT TERM HUP
  [ -z "$frozen" ] || kill -CONT "$frozen" 2>/dev/null || true
  [ "${#pids[@]}" -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
  "$binaries/rdkv-cluster" down "$file" --run-dir "$work/run" >/dev/null 2>&1 || true
}
trap stop EXIT
trap 'exit 143' INT TERM HUP

# Nine free loopback ports (bound to port 0 and released: another process may take one in
# between, and then `up` says so).
read -r -a ports <<<"$(python3 -c '
import socket
sockets = [socket.socket() for _ in range(9)]
for s in sockets: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in sockets))')"
umask 077
python3 - "$root/examples/local-3node.toml" "$file" "${ports[@]}" <<'EOF'
import re, sys
source, target, *ports = sys.argv[1:]
text = open(source).read()
old = iter(ports)
text = re.sub(r'127\.0\.0\.1:74\d\d', lambda _: f"127.0.0.1:{next(old)}", text)
open(target, "w").write(text)
EOF
read -r -a metrics_addresses <<<"$(sed -n 's/^metrics_address = "\(.*\)"/\1/p' "$file" | tr '\n' ' ')"

"$binaries/rdkv-cluster" up "$file" --detach --run-dir "$work/run" >/dev/null
echo "cluster up, files in $work" >&2
# A YCSB-A writer of 4 threads on the loaded records, for SECONDS (an argument to add).
writer=("$binaries/rdkv-ycsb" run -c "$file" --fabric "$fabric" -P workloada
  -p recordcount=1000 -p operationcount=100000000 --threads 4 --allow-errors
  --max-execution-time)
"$binaries/rdkv-ycsb" load -c "$file" --fabric "$fabric" -P workloada \
  -p recordcount=1000 >"$work/load.txt" 2>&1

# Started directly (not through a function's subshell), so that $! is rdkv-ycsb itself.
"${writer[@]}" $((2 * seconds + 10)) >"$work/a.txt" 2>&1 &
frozen=$!
pids+=("$frozen")
sleep 3
"${writer[@]}" "$seconds" >"$work/b-running.txt" 2>&1
kill -STOP "$frozen"
"${writer[@]}" "$seconds" >"$work/b-stopped.txt" 2>&1
kill -CONT "$frozen"
frozen=

throughput() { awk -F', ' '$1 == "[OVERALL]" && $2 == "Throughput(ops/sec)" { printf "%.0f", $3 }' "$1"; }
errors() { grep -h 'Return=ERROR' "$1" | awk -F', ' '{ sum += $3 } END { print sum + 0 }'; }
metric() { # ADDRESS NAME: the metric's value, or - when the endpoint does not have it
  curl -s --max-time 5 "http://$1/metrics" \
    | awk -v name="$2" '$1 == name || index($1, name "{") == 1 { print $2; found = 1 } END { if (!found) print "-" }'
}
running=$(throughput "$work/b-running.txt")
stopped=$(throughput "$work/b-stopped.txt")
fences=()
for address in "${metrics_addresses[@]}"; do fences+=("$(metric "$address" rdkv_heap_fences_total)"); done
echo "fabric=$fabric seconds=$seconds"
echo "writer B with A running: ${running} ops/s ($(errors "$work/b-running.txt") errors)"
echo "writer B with A stopped: ${stopped} ops/s ($(errors "$work/b-stopped.txt") errors)"
awk -v a="$running" -v b="$stopped" 'BEGIN { if (a > 0) printf "ratio (stopped / running): %.2f\n", b / a }'
echo "rdkv_heap_fences_total per node: ${fences[*]}"
echo "node log lines, per node: 'stopped inside a request' (an shm client kept until it leaves it):" \
  "$(for node in 1 2 3; do grep -c 'stopped inside a request' "$work/run/node-$node.log" || true; done | tr '\n' ' ')"
wait "${pids[@]}" 2>/dev/null || true
pids=()
