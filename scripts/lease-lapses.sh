#!/usr/bin/env bash
# Counts how often the nodes of a local three-node cluster lose their lease while the host is
# loaded (docs/operations.md, *Leases under load*; docs/benchmarks.md, *Lease lapses under
# load*).
#
#   scripts/lease-lapses.sh FAILURE_TIMEOUT [SECONDS] [WORKERS] [OPERATIONS_PER_SECOND]
#       e.g. scripts/lease-lapses.sh 2s 120 8 200
#       defaults: 120 s under load; 8 burner workers (scripts/burn-cpu.sh: a load average of
#       about 8 on 2 cores); a YCSB-A client throttled to 200 operations per second (0: none)
#
# It copies examples/local-3node.toml with FAILURE_TIMEOUT (and an operation_deadline 1 s
# above it, so that the file loads without a warning) onto free loopback ports, starts the
# cluster from target/release (build it first: cargo build --release --workspace --bins),
# runs the burner and the client for SECONDS, and prints per node: `stopped serving data`
# lines in its log (by reason), rdkv_serving_stops_total and rdkv_lease_lapses_total, and
# the load average seen. Everything it starts stops by itself or when it exits.
set -euo pipefail
failure_timeout=${1:?usage: $0 FAILURE_TIMEOUT [SECONDS] [WORKERS] [OPERATIONS_PER_SECOND]}
seconds=${2:-120}
workers=${3:-8}
rate=${4:-200}
case "$seconds$workers$rate" in
  *[!0-9]*) echo "usage: $0 FAILURE_TIMEOUT [SECONDS] [WORKERS] [OPERATIONS_PER_SECOND]" >&2; exit 2 ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
binaries=${CARGO_TARGET_DIR:-$root/target}/release
work=$(mktemp -d "${TMPDIR:-/tmp}/rdkv-lease-lapses.XXXXXX")
file=$work/cluster.toml
pids=()

stop() {
  trap - EXIT INT TERM HUP
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
deadline_seconds=$(( ${failure_timeout%s} + 1 ))
umask 077
python3 - "$root/examples/local-3node.toml" "$file" "$failure_timeout" "${deadline_seconds}s" "${ports[@]}" <<'EOF'
import re, sys
source, target, failure_timeout, deadline, *ports = sys.argv[1:]
text = open(source).read()
text = re.sub(r'failure_timeout = "[^"]*"', f'failure_timeout = "{failure_timeout}"', text)
text = re.sub(r'operation_deadline = "[^"]*"', f'operation_deadline = "{deadline}"', text)
old = iter(ports)
text = re.sub(r'127\.0\.0\.1:74\d\d', lambda _: f"127.0.0.1:{next(old)}", text)
open(target, "w").write(text)
EOF
metrics_ports=("${ports[2]}" "${ports[5]}" "${ports[8]}")

"$binaries/rdkv-cluster" up "$file" --detach --run-dir "$work/run" >/dev/null
echo "cluster up: failure_timeout $failure_timeout, files in $work" >&2
if [ "$rate" -gt 0 ]; then
  "$binaries/rdkv-ycsb" run -c "$file" -P workloada --load -p recordcount=1000 \
    -p operationcount=$((rate * seconds)) --target "$rate" --threads 4 \
    --max-execution-time "$seconds" --allow-errors >"$work/ycsb.txt" 2>&1 &
  pids+=($!)
fi
"$root/scripts/burn-cpu.sh" "$seconds" "$workers" &
pids+=($!)
loads=()
for _ in 1 2 3 4; do
  sleep $((seconds / 4))
  loads+=("$(cut -d' ' -f1 /proc/loadavg)")
done
wait "${pids[@]}" 2>/dev/null || true
pids=()

metric() { # PORT NAME: the metric's value, or - when the endpoint does not have it
  curl -s --max-time 5 "http://127.0.0.1:$1/metrics" \
    | awk -v name="$2" '$1 == name || index($1, name "{") == 1 { print $2; found = 1 } END { if (!found) print "-" }'
}
echo "failure_timeout=$failure_timeout seconds=$seconds workers=$workers rate=$rate load_average(1 min, each quarter)=${loads[*]}"
for node in 1 2 3; do
  log=$work/run/node-$node.log
  printf 'node %s: stopped_serving_lines=%s (no_lease=%s view_down=%s other=%s) stepped_down_as_leader=%s serving_stops_total=%s lease_lapses_total=%s\n' \
    "$node" \
    "$(grep -c 'stopped serving data' "$log" || true)" \
    "$(grep 'stopped serving data' "$log" | grep -c 'no lease' || true)" \
    "$(grep 'stopped serving data' "$log" | grep -c 'has this node down' || true)" \
    "$(grep 'stopped serving data' "$log" | grep -vc 'no lease\|has this node down' || true)" \
    "$(grep -c 'no longer the leader' "$log" || true)" \
    "$(metric "${metrics_ports[$((node - 1))]}" rdkv_serving_stops_total)" \
    "$(metric "${metrics_ports[$((node - 1))]}" rdkv_lease_lapses_total)"
done
grep -h 'Operations\|Return=' "$work/ycsb.txt" 2>/dev/null | head -8 || true
