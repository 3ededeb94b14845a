#!/usr/bin/env bash
# YCSB-A while a node joins, and the time to move keys (docs/benchmarks.md, *Membership
# changes*): three nodes with `replicas = 2` and RECORDS × 1 KB keys; YCSB-A runs for SECONDS;
# at ADD_AT seconds a fourth node is added (`rdkv-cluster add-node`), which copies the keys it
# now holds (about half of them) from their primaries before it serves. Prints the throughput
# before, during and after the join (from the run's per-second series), the join's time, the
# keys and bytes node 4 copied and its refill's rate, and how many operations failed (a
# replicated put racing the view change may end "outcome unknown": counted, not fatal).
#
#   scripts/bench/membership.sh [--records N] [--seconds S] [--add-at S] [--threads T] [BINDIR]
#
# BINDIR holds rdkv-cluster, rdkv-server and rdkv-ycsb (default target/release, built first).
# Each node pins about 5 KiB per record (2 GiB in all for 200,000): run it as root, or with the
# memlock limit raised (docs/memory.md). The nodes listen on 127.0.0.1:7660-7692. Exit code 0
# when every step succeeded (operations that failed are printed, not an error); the nodes are
# stopped whatever happens.
set -euo pipefail

records=200000
seconds=30
add_at=10
threads=16
bindir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --records) records=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --add-at) add_at=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    -*) sed -n '9p' "$0" | sed 's/^# //' >&2; exit 2 ;;
    *) bindir=$1; shift ;;
  esac
done
repository=$(git rev-parse --show-toplevel)
cd "$repository"
if [ -z "$bindir" ]; then
  cargo build -q --release -p rdkv-cluster-config -p rdkv-server -p rdkv-ycsb --bins
  bindir=target/release
fi
bindir=$(cd "$bindir" && pwd)

# Every node holds up to all the keys once node 4 joins and before the sweeps: room for them,
# YCSB-A's new versions and the collector's lag.
heap_mib=$(( records * 3 / 1024 > 64 ? records * 3 / 1024 : 64 ))
work=$(mktemp -d /tmp/rdkv-membership-bench.XXXXXX)
file="$work/cluster.toml"
node_section() {
  cat <<TOML

[[node]]
id = $1
control_address = "127.0.0.1:76$(( $1 * 10 + 50 ))"
fabric_address = "127.0.0.1:76$(( $1 * 10 + 51 ))"
metrics_address = "127.0.0.1:76$(( $1 * 10 + 52 ))"
index_size = "16M"
heap_size = "${heap_mib}M"
chunk_size = "1M"
TOML
}
{
  printf '[cluster]\nname = "membership-bench"\nsecret = "membership-bench-secret"\n'
  printf 'fabric = "soft"\nfailure_timeout = "1s"\nreplicas = 2\noperation_deadline = "8s"\n'
  for id in 1 2 3; do node_section "$id"; done
} > "$file"
chmod 600 "$file"
cluster() { "$bindir/rdkv-cluster" "$@" --run-dir "$work/run"; }
runner=""
cleanup() {
  # Never a failing last command before `down` (errexit would end the trap there, and leave
  # the nodes running: it did once, when the run below failed).
  if [ -n "$runner" ]; then kill "$runner" 2>/dev/null || true; fi
  cluster down "$file" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

cluster up "$file" --detach > "$work/up.log"
"$bindir/rdkv-ycsb" load -c "$file" -P workloada -p recordcount="$records" --threads 16 \
  > "$work/load.log"
# As docs/operations.md says: list node 4 in the file the nodes run from, then add it.
node_section 4 >> "$file"

"$bindir/rdkv-ycsb" run -c "$file" -P workloada -p recordcount="$records" \
  -p operationcount=1000000000 --max-execution-time "$seconds" --threads "$threads" \
  --json "$work/a.json" --allow-errors > "$work/run.log" 2>&1 &
runner=$!
run_started=$(date +%s.%N)
sleep "$add_at"
add_started=$(date +%s.%N)
cluster add-node "$file" --node 4 > "$work/add.log"
add_ended=$(date +%s.%N)
wait "$runner"
runner=""
# A replicated put racing the view change may end "outcome unknown" (docs/protocol.md,
# Membership changes): counted and printed, not a failed measurement.
errors=$(awk -F', ' '/Return=ERROR/ { total += $3 } END { print total + 0 }' "$work/run.log")
refill=$(grep -h "refill complete" "$work/run/node-4.log" | tail -1)
stats=$(curl -s --max-time 2 http://127.0.0.1:7692/metrics)
copied=$(awk '/^rdkv_refill_keys_copied_total[{ ]/ { print $NF }' <<<"$stats")
copied_bytes=$(awk '/^rdkv_refill_bytes_copied_total[{ ]/ { print $NF }' <<<"$stats")

python3 - "$work/a.json" "$records" "$threads" "$seconds" "$run_started" "$add_started" \
  "$add_ended" "$refill" "${copied:-0}" "${copied_bytes:-0}" "$errors" <<'PYTHON'
import json, re, statistics, sys
path, records, threads, seconds, run_started, add_started, add_ended, refill, copied, copied_bytes, errors = sys.argv[1:12]
run_started, add_started, add_ended = float(run_started), float(add_started), float(add_ended)
report = json.load(open(path))
reports = report if isinstance(report, list) else report.get("reports", [report])
series = [point for one in reports for point in one.get("timeseries", [])]
if not series:
    sys.exit("membership bench: the run's JSON has no per-second series")
join_from, join_to = add_started - run_started, add_ended - run_started
def mean(points):
    return statistics.mean(rate for _, rate in points) if points else float("nan")
before = [p for p in series if p[0] <= join_from]
during = [p for p in series if join_from < p[0] <= join_to + 1]
after = [p for p in series if p[0] > join_to + 1]
match = re.search(r"elapsed=([0-9.]+)(ms|s)", refill)
refill_seconds = (float(match.group(1)) / (1000 if match.group(2) == "ms" else 1)) if match else float("nan")
copied = int(float(copied))
rate = copied / refill_seconds if refill_seconds > 0 else float("nan")
print(f"{int(records):,} × 1 KB on 3 nodes, replicas = 2 (soft, clients over shm), YCSB-A with {threads} tasks for {seconds} s; node 4 added at {join_from:.1f} s")
print()
print("| | ops/s (mean of the per-second series) | seconds |")
print("|---|---:|---:|")
print(f"| before the join | {mean(before):,.0f} | {len(before)} |")
print(f"| during the join (add-node running, and 1 s after) | {mean(during):,.0f} | {len(during)} |")
print(f"| after the join | {mean(after):,.0f} | {len(after)} |")
print()
print(f"operations that failed: {int(errors):,} (a put racing the view change may end 'outcome unknown')")
print(f"add-node took {join_to - join_from:.1f} s; node 4's refill copied {copied:,} keys ({int(float(copied_bytes)):,} bytes) in {refill_seconds:.2f} s: {rate:,.0f} keys/s, {100_000 / rate if rate > 0 else float('nan'):.1f} s per 100,000 keys")
PYTHON
