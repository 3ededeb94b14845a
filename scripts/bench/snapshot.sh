#!/usr/bin/env bash
# The cost of snapshots, measured in one run (docs/benchmarks.md, *Snapshots*): YCSB-A on a
# one-node cluster of RECORDS × 1 KB keys, in interleaved rounds without and with snapshots
# written back to back meanwhile; then the time one snapshot takes on an idle node, and the
# time the node takes to start from it (`down`, then `up` until it serves).
#
#   scripts/bench/snapshot.sh [--records N] [--seconds S] [--rounds R] [--threads T] [BINDIR]
#
# BINDIR holds rdkv-cluster, rdkv-server and rdkv-ycsb (default target/release, built first).
# The node pins 5 KiB per record and 16 MiB more (about 500 MiB for 100,000): run it as root, or
# with the memlock limit raised (docs/memory.md). It listens on 127.0.0.1:7650-7652. Exit code
# 0 when every step succeeded.
set -euo pipefail

records=100000
seconds=5
rounds=3
threads=64
bindir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --records) records=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    -*) sed -n '8p' "$0" | sed 's/^# //' >&2; exit 2 ;;
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

# Room for the records, YCSB-A's new versions of them and the collector's lag.
heap_mib=$(( records * 5 / 1024 > 64 ? records * 5 / 1024 : 64 ))
work=$(mktemp -d /tmp/rdkv-snapshot-bench.XXXXXX)
file="$work/cluster.toml"
cat > "$file" <<TOML
[cluster]
name = "snapshot-bench"
secret = "snapshot-bench-secret"
fabric = "soft"
snapshot_interval = "0s"

[[node]]
id = 1
control_address = "127.0.0.1:7650"
fabric_address = "127.0.0.1:7651"
metrics_address = "127.0.0.1:7652"
index_size = "16M"
heap_size = "${heap_mib}M"
chunk_size = "1M"
TOML
chmod 600 "$file"
cluster() { "$bindir/rdkv-cluster" --run-dir "$work/run" "$@"; }
snapshots=""
cleanup() {
  [ -n "$snapshots" ] && kill "$snapshots" 2>/dev/null
  cluster down "$file" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

cluster up "$file" --detach > "$work/up.log"
"$bindir/rdkv-ycsb" load -c "$file" -P workloada -p recordcount="$records" --threads 16 \
  > "$work/load.log"

# YCSB-A for the round's seconds; prints its throughput.
run_a() {
  "$bindir/rdkv-ycsb" run -c "$file" -P workloada -p recordcount="$records" \
    -p operationcount=1000000000 --max-execution-time "$seconds" --threads "$threads" \
    | awk -F', ' '/^\[OVERALL\], Throughput/ { print $3 }'
}

# Waits until the node's heap stops coming back (the collector and compactor have caught up
# with the last run's garbage), at most 60 s: a run right after another one otherwise pays
# for the first one's reclamation, which made the second run of a pair slower whatever it did.
settle() {
  local previous="" free
  for _ in $(seq 1 120); do
    free=$(curl -s --max-time 2 http://127.0.0.1:7652/metrics \
      | awk '/^rdkv_heap_free_bytes[{ ]/ { print $NF }')
    [ -n "$free" ] && [ "$free" = "$previous" ] && return 0
    previous=$free
    sleep 0.5
  done
}

# YCSB-A with snapshots written back to back meanwhile; appends the throughput and the count.
run_with_snapshots() {
  # Bounded: the run's seconds, a few snapshots at most.
  ( for _ in $(seq 1 100); do cluster snapshot "$file" || exit 1; done ) > "$work/snapshots.log" 2>&1 &
  snapshots=$!
  with+=("$(run_a)")
  kill "$snapshots" 2>/dev/null || true
  wait "$snapshots" 2>/dev/null || true
  snapshots=""
  written+=("$(grep -c 'keys' "$work/snapshots.log" || true)")
  # Waits for the snapshot the loop left running (one at a time): the next run starts quiet.
  cluster snapshot "$file" > /dev/null
}

without=()
with=()
written=()
for round in $(seq 1 "$rounds"); do
  # The order alternates by round, and every run starts on a settled heap.
  if [ $((round % 2)) -eq 1 ]; then
    settle; without+=("$(run_a)")
    settle; run_with_snapshots
  else
    settle; run_with_snapshots
    settle; without+=("$(run_a)")
  fi
  echo "snapshot bench: round $round of $rounds: ${without[-1]} ops/s without, ${with[-1]} with (${written[-1]} snapshots)" >&2
done

idle=$(cluster snapshot "$file")
cluster down "$file" > "$work/down.log"
started=$(date +%s.%N)
cluster up "$file" --detach > "$work/up2.log"
ready=$(date +%s.%N)
loaded=$(grep -h "snapshot loaded" "$work"/run/node-1.log | tail -1 | sed 's/.*took=//')

python3 - "$records" "$seconds" "$threads" "$idle" "$started" "$ready" "$loaded" \
  "${without[*]}" "${with[*]}" "${written[*]}" <<'PYTHON'
import statistics, sys
records, seconds, threads, idle, started, ready, loaded = sys.argv[1:8]
without = [float(value) for value in sys.argv[8].split()]
with_snapshots = [float(value) for value in sys.argv[9].split()]
written = sys.argv[10].split()
ratio = statistics.median(with_snapshots) / statistics.median(without)
print(f"{int(records):,} × 1 KB, one node (soft, clients over shm), YCSB-A, {threads} tasks, {seconds} s per run; medians of {len(without)} interleaved rounds")
print()
print("| | ops/s (median) | rounds |")
print("|---|---:|---|")
print(f"| without snapshots | {statistics.median(without):,.0f} | {', '.join(f'{value:,.0f}' for value in without)} |")
print(f"| snapshots back to back | {statistics.median(with_snapshots):,.0f} | {', '.join(f'{value:,.0f}' for value in with_snapshots)} (snapshots per run: {', '.join(written)}) |")
print()
print(f"with / without: {ratio:.2f}")
print(f"one snapshot on the idle node: {idle.strip()}")
print(f"start from it: `up` ready after {float(ready) - float(started):.2f} s (loading took {loaded.strip()})")
PYTHON
