#!/usr/bin/env bash
# Counts the node's CPU instructions under YCSB-A over `shm` with callgrind: per update, per
# collector pass, per extent the collector reclaims and per grant it hands out. The node's time
# under A is its reclamation (docs/benchmarks.md, *Where the node's time goes*), and
# instruction counts repeat whatever else this 2-core machine is doing, unlike its CPU seconds.
#
#   scripts/bench/node-instructions.sh [--operations N] [--records R] [--threads T]
#                                      [--profile FILE] [--native] [BINARY_DIRECTORY]
#
# BINARY_DIRECTORY holds rdkv-server and rdkv-ycsb (default: $CARGO_TARGET_DIR/release, else
# target/release of this checkout). One node starts under `valgrind --tool=callgrind` on
# 127.0.0.1 with port 0 (its ready line names the bound addresses; the cluster file is written
# after), offering `shm` on a socket in a temporary directory, with the table `rdkv-ycsb
# compare` gives 100,000 records of 1 KB: a 16 MiB index and a 576 MiB heap (1 MiB chunks).
# The client runs natively: it loads R records (100,000), then the counters are zeroed
# (`callgrind_control --zero`) and it runs N operations (1,000,000) of workload A (50% reads,
# 50% updates, zipfian) with T tasks (64), so that only the run is counted. The node's pace is
# its own (a pass every 25 ms at most, resting 4 times a pass's length): under valgrind it runs
# about 50 times slower than its client, so how many passes the run takes follows the machine,
# and the figure per pass is the steady one; per grant follows how scattered the free extents
# are, per update and per reclaimed extent the pass count. The updates write about 550 MB into
# the heap, so it is reused. The node pins 592 MiB: run as root, or raise `ulimit -l`.
# --profile FILE keeps the callgrind output (for callgrind_annotate).
#
# --native runs the node natively instead and samples it during the run only (`perf record -e
# cpu-clock -F 2000 -p PID`, which needs no hardware counters): its CPU microseconds per update,
# noisier than instructions (the machine's other work shares the caches and the node's pace
# follows the client's speed), but at the speed the node really runs. --profile FILE then keeps
# the perf data (for perf report).
#
# Exit codes: 0 measured; 2 nothing measured (a binary, valgrind or curl missing, the node did
# not start, a run failed), or a bad command line.
set -euo pipefail
repository=$(cd "$(dirname "$0")/../.." && pwd)
binaries=${CARGO_TARGET_DIR:-$repository/target}/release
operations=1000000
records=100000
threads=64
profile=
native=

fail() {
  echo "node-instructions: $*" >&2
  exit 2
}
while [ $# -gt 0 ]; do
  case $1 in
    --operations) operations=${2:?--operations needs a number}; shift ;;
    --records) records=${2:?--records needs a number}; shift ;;
    --threads) threads=${2:?--threads needs a number}; shift ;;
    --profile) profile=${2:?--profile needs a file}; shift ;;
    --native) native=yes ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) fail "unknown option $1 (see --help)" ;;
    *) binaries=$1 ;;
  esac
  shift
done
for number in "$operations" "$records" "$threads"; do
  [[ $number =~ ^[1-9][0-9]*$ ]] || fail "$number is not a positive number"
done
for program in rdkv-server rdkv-ycsb; do
  [ -x "$binaries/$program" ] \
    || fail "$binaries/$program is missing; build it with cargo build --release --workspace --bins"
done
if [ -n "$native" ]; then tools=(perf curl python3); else tools=(valgrind callgrind_control callgrind_annotate curl python3); fi
for program in "${tools[@]}"; do
  command -v "$program" >/dev/null || fail "$program is missing"
done

work=$(mktemp -d)
server=
sampler=
cleanup() {
  if [ -n "$sampler" ]; then
    kill -INT "$sampler" 2>/dev/null || true
    wait "$sampler" 2>/dev/null || true
  fi
  if [ -n "$server" ]; then
    kill "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

secret=node-instructions-secret
index_size=16M
heap_size=576M
mkfifo "$work/ready"
if [ -n "$native" ]; then wrapper=(); else wrapper=(valgrind --tool=callgrind --callgrind-out-file="$work/node.out"); fi
RDKV_SECRET=$secret RUST_LOG=warn "${wrapper[@]}" "$binaries/rdkv-server" --node-id 1 --listen 127.0.0.1:0 --fabric-listen 127.0.0.1:0 \
  --metrics-listen 127.0.0.1:0 --fabric soft --shm-socket "$work/node.sock" \
  --index-size $index_size --heap-size $heap_size --chunk-size 1M \
  --lease-timeout-ms 60000 --deadline-ms 20000 >"$work/ready" 2>"$work/server.log" &
server=$!
# Held open until the end: the node may write to its stdout again.
exec {ready_descriptor}<"$work/ready"
if ! read -r -t 120 ready_line <&"$ready_descriptor"; then
  cat "$work/server.log" >&2
  fail "the node did not print its ready line within 120 s"
fi
control= fabric= metrics=
for field in $ready_line; do
  case $field in
    control=*) control=${field#control=} ;;
    fabric=*) fabric=${field#fabric=} ;;
    metrics=*) metrics=${field#metrics=} ;;
  esac
done
[ -n "$control" ] && [ -n "$fabric" ] && [ -n "$metrics" ] \
  || fail "no addresses in the node's ready line: $ready_line"
cat >"$work/cluster.toml" <<CLUSTER
[cluster]
name = "node-instructions"
secret = "$secret"
fabric = "soft"
operation_deadline = "20s"
lease_timeout = "60s"

[[node]]
id = 1
control_address = "$control"
fabric_address = "$fabric"
index_size = "$index_size"
heap_size = "$heap_size"
chunk_size = "1M"
CLUSTER

# The node's pass, reclaim and grant counters, from its metrics endpoint, as "name value" lines.
counters() {
  curl -sf "http://$metrics/metrics" | grep -E '^rdkv_(collector_passes_total|heap_extents_reclaimed_total|chunk_allocations_total)\{' \
    | sed 's/{[^}]*}//' || fail "reading the node's metrics failed"
}

timeout 600 "$binaries/rdkv-ycsb" load -c "$work/cluster.toml" --fabric shm -P workloada \
  -p recordcount="$records" --threads 16 >"$work/load.log" 2>&1 \
  || { cat "$work/load.log" >&2; fail "loading $records records failed"; }
counters >"$work/before"
if [ -n "$native" ]; then
  perf record -q -e cpu-clock -F 2000 -p "$server" -o "$work/node.perf" 2>"$work/perf.log" &
  sampler=$!
else
  callgrind_control --zero "$server" >/dev/null 2>&1 || fail "zeroing the node's counters failed"
fi
timeout 600 "$binaries/rdkv-ycsb" run -c "$work/cluster.toml" --fabric shm -P workloada \
  -p recordcount="$records" -p operationcount="$operations" --threads "$threads" \
  >"$work/run.log" 2>&1 || { cat "$work/run.log" >&2; fail "the run failed"; }
counters >"$work/after"
updates=$(grep -o '^\[UPDATE\], Return=OK, [0-9]*' "$work/run.log" | grep -o '[0-9]*$' || true)
[ -n "$updates" ] || { cat "$work/run.log" >&2; fail "no successful updates in the run"; }
grep -q 'Return=\(ERROR\|TIMEOUT\|FAILED\)' "$work/run.log" && { cat "$work/run.log" >&2; fail "some operations failed"; }
throughput=$(grep -o 'Throughput(ops/sec), [0-9.]*' "$work/run.log" | grep -o '[0-9.]*$')
if [ -n "$native" ]; then
  kill -INT "$sampler"
  wait "$sampler" || true
  sampler=
  samples=$(perf script -i "$work/node.perf" -F period 2>/dev/null | wc -l)
  [ -z "$profile" ] || cp "$work/node.perf" "$profile"
fi
kill -INT "$server"
wait "$server" || true
server=
if [ -n "$native" ]; then
  python3 - "$work/before" "$work/after" "$updates" "$throughput" "$samples" <<'PYTHON'
import sys

before_path, after_path, updates, throughput, samples = sys.argv[1:6]
updates, samples = int(updates), int(samples)
counters = lambda path: {line.split()[0]: int(float(line.split()[1])) for line in open(path)}
before, after = counters(before_path), counters(after_path)
passes = after["rdkv_collector_passes_total"] - before["rdkv_collector_passes_total"]
seconds = samples / 2000
print(f"node CPU over the run: {seconds:.2f} s ({samples:,} samples at 2000 Hz) for {updates:,} updates ({float(throughput):,.0f} ops/s)")
print(f"  per update:       {seconds / updates * 1e6:.2f} µs")
print(f"  collector passes: {passes:,}")
PYTHON
  exit 0
fi
[ -z "$profile" ] || cp "$work/node.out" "$profile"

python3 - "$work/node.out" "$work/before" "$work/after" "$updates" "$throughput" <<'PYTHON'
import re
import subprocess
import sys

profile, before_path, after_path, updates, throughput = sys.argv[1:6]
updates = int(updates)


def counters(path):
    return {line.split()[0]: int(float(line.split()[1])) for line in open(path)}


before, after = counters(before_path), counters(after_path)
passes = after["rdkv_collector_passes_total"] - before["rdkv_collector_passes_total"]
reclaimed = after["rdkv_heap_extents_reclaimed_total"] - before["rdkv_heap_extents_reclaimed_total"]
grants = after["rdkv_chunk_allocations_total"] - before["rdkv_chunk_allocations_total"]
annotated = subprocess.run(
    ["callgrind_annotate", "--inclusive=yes", "--threshold=100", profile],
    capture_output=True, text=True, check=True,
).stdout
total = int(re.search(r"([\d,]+) \(100.0%\)\s+PROGRAM TOTALS", annotated).group(1).replace(",", ""))


def inclusive(function):
    """The largest inclusive count callgrind_annotate lists for `function` (its own line)."""
    counts = [
        int(match.group(1).replace(",", ""))
        for match in re.finditer(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+\S+?:(\S+) \[", annotated, re.M)
        if match.group(2) == function
    ]
    return max(counts, default=0)


collector = inclusive("rdkv_server::collector::pass")
allocation = inclusive("rdkv_server::heap::Heap::allocate")
per = lambda count, of: f"{count // of:,}" if of else "-"
print(f"node instructions over the run: {total:,} for {updates:,} updates ({float(throughput):,.0f} ops/s)")
print(f"  per update:              {per(total, updates)}")
print(f"  collector passes:        {passes:,}, {per(collector, passes)} instructions each")
print(f"  extents reclaimed:       {reclaimed:,}, {per(collector, reclaimed)} collector instructions each")
print(f"  grants (AllocateChunk):  {grants:,}, {per(allocation, grants)} instructions each (Heap::allocate, the compactor's included)")
PYTHON
