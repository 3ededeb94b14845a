#!/usr/bin/env bash
# The cost of replication, measured in one run: YCSB A and C on a 3-node rdkv cluster with
# replicas = 1, 2 and 3, each over shm and over soft, every run with a Redis baseline of the
# same minute.
#
#   scripts/bench/replication.sh [--profile release|debug] [--rounds N] [-- COMPARE OPTIONS]
#
# For each round and each replicas value it runs `rdkv-ycsb compare --nodes 3 --replicas R
# --workloads a,c --stores rdkv-shm,rdkv-soft,redis-tcp COMPARE OPTIONS` (each run starts its
# own cluster and redis-server on loopback). The summary prints, per workload, store and
# replicas, the median ops/s, the ratio to replicas = 1 and to Redis, round trips per operation
# (all lists posted, and those waited for in sequence: a replicated write posts some on several
# nodes at once) and round trips per READ. Exit code: 0 when every run succeeded.
set -euo pipefail

usage() {
  sed -n '6,7p' "$0" | sed 's/^# //' >&2
  exit 2
}
profile=release
rounds=1
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --) shift; break ;;
    *) usage ;;
  esac
done
compare_options=("$@")

repository=$(git rev-parse --show-toplevel)
cd "$repository"
if [ "$profile" = release ]; then
  cargo build -q --release -p rdkv-ycsb -p rdkv-server
else
  cargo build -q -p rdkv-ycsb -p rdkv-server
fi
binary="target/$profile/rdkv-ycsb"
results="target/replication-bench"
mkdir -p "$results"
rm -f "$results"/*.json "$results"/*.log

for round in $(seq 1 "$rounds"); do
  for replicas in 1 2 3; do
    echo "replication: round $round of $rounds, replicas = $replicas" >&2
    if ! "$binary" compare --nodes 3 --replicas "$replicas" --workloads a,c \
        --stores rdkv-shm,rdkv-soft,redis-tcp "${compare_options[@]}" \
        --json "$results/r$replicas-$round.json" > "$results/r$replicas-$round.log" 2>&1; then
      echo "replication: the run with replicas = $replicas failed:" >&2
      tail -5 "$results/r$replicas-$round.log" >&2
      exit 1
    fi
  done
done

python3 - "$results" <<'SUMMARY'
import json, pathlib, statistics, sys

results = pathlib.Path(sys.argv[1])
figures = {}  # (workload, store, replicas) -> list of (ops/s, rt/op, rt in sequence/op, rt/read, redis ops/s)
for path in sorted(results.glob("r*-*.json")):
    replicas = int(path.stem[1:].split("-")[0])
    # `compare --json`: each store keyed by the name its table prints, one report per round.
    for row in json.loads(path.read_text())["workloads"]:
        reports = row["stores"]
        redis = (reports.get("Redis TCP") or {}).get("median_throughput")
        for store, name in (("rdkv-shm", "rdkv shm"), ("rdkv-soft", "rdkv soft")):
            for report in (reports.get(name) or {}).get("rounds", []):
                if not report.get("rdkv"):
                    continue
                rdkv = report["rdkv"]
                figures.setdefault((row["workload"], store, replicas), []).append((
                    report["throughput"],
                    rdkv["round_trips_per_operation"],
                    rdkv.get("round_trips_in_sequence_per_operation", rdkv["round_trips_per_operation"]),
                    rdkv["round_trips_per_read"],
                    redis,
                ))

def median(values):
    values = [value for value in values if value is not None]
    return statistics.median(values) if values else None

print("| workload | store | replicas | ops/s | vs replicas = 1 | vs Redis (same run) | round trips/op | in sequence/op | round trips/READ |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
for workload in sorted({key[0] for key in figures}):
    for store in ("rdkv-shm", "rdkv-soft"):
        base = median([entry[0] for entry in figures.get((workload, store, 1), [])])
        for replicas in (1, 2, 3):
            entries = figures.get((workload, store, replicas))
            if not entries:
                continue
            throughput = median([entry[0] for entry in entries])
            redis = median([entry[4] for entry in entries])
            ratio = f"{throughput / base:.2f}×" if base else "-"
            versus_redis = f"{throughput / redis:.2f}×" if redis else "-"
            print(f"| {workload} | {store} | {replicas} | {throughput:,.0f} | {ratio} | {versus_redis} | "
                  f"{median([entry[1] for entry in entries]):.2f} | {median([entry[2] for entry in entries]):.2f} | "
                  f"{median([entry[3] for entry in entries]):.2f} |")
SUMMARY
