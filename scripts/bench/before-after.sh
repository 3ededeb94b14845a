#!/usr/bin/env bash
# Measures two builds of rdkv side by side in one run: BEFORE (any commit) and the working tree.
#
#   scripts/bench/before-after.sh BEFORE [--rounds N] [--profile release|debug] [-- COMPARE OPTIONS]
#
# It exports BEFORE with `git archive` into target/before-after/<commit>/ and builds both trees'
# binaries (same profile; the working tree's into its own target/), then runs
# `rdkv-ycsb compare COMPARE OPTIONS` N times for each build, alternating so that drift on the
# machine hits both alike (odd rounds run before first, even rounds after first). Every compare
# run starts its own rdkv node and redis-server on loopback, so each rdkv figure comes with a
# Redis figure from the same minute;
# the summary prints, per workload, the median rdkv ops/s of each build, the median rdkv/Redis
# ratio of each build, and round trips per operation. Exit code: 0 when every run succeeded.
set -euo pipefail

usage() {
  sed -n '2,3p' "$0" | sed 's/^# //' >&2
  exit 2
}
[ $# -ge 1 ] || usage
before=$1
shift
rounds=3
profile=release
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --profile) profile=$2; shift 2 ;;
    --) shift; break ;;
    *) usage ;;
  esac
done
compare_options=("$@")
[ ${#compare_options[@]} -gt 0 ] || compare_options=(--workloads a,c)

repository=$(git rev-parse --show-toplevel)
commit=$(git -C "$repository" rev-parse --short "$before^{commit}") || {
  echo "before-after: $before is not a commit of this repository" >&2
  exit 2
}
work="$repository/target/before-after"
tree="$work/$commit"
results="$work/results"
mkdir -p "$work" "$results"
rm -f "$results"/*.json "$results"/*.log

profile_flag=()
[ "$profile" = release ] && profile_flag=(--release)

if [ ! -f "$tree/Cargo.toml" ]; then
  echo "exporting $commit into $tree"
  mkdir -p "$tree"
  git -C "$repository" archive "$commit" | tar -x -C "$tree"
fi
echo "building $commit ($profile)"
(cd "$tree" && cargo build --quiet "${profile_flag[@]}" --bins)
echo "building the working tree ($profile)"
(cd "$repository" && cargo build --quiet "${profile_flag[@]}" --bins)

binary_before="$tree/target/$profile/rdkv-ycsb"
binary_after="$repository/target/$profile/rdkv-ycsb"
for round in $(seq 1 "$rounds"); do
  # Odd rounds run before first, even rounds after first: drift over a round hits both alike.
  order=(before after)
  [ $((round % 2)) -eq 0 ] && order=(after before)
  for side in "${order[@]}"; do
    binary=binary_$side
    echo "round $round/$rounds: $side: rdkv-ycsb compare ${compare_options[*]} (log: $results/$side-$round.log)"
    if ! "${!binary}" compare "${compare_options[@]}" --json "$results/$side-$round.json" \
        >"$results/$side-$round.log" 2>&1; then
      echo "before-after: the $side run of round $round failed; see $results/$side-$round.log" >&2
      exit 1
    fi
  done
done

python3 - "$results" "$commit" <<'SUMMARY'
import json, pathlib, statistics, sys

results, commit = pathlib.Path(sys.argv[1]), sys.argv[2]
# A `compare --json` file keys each store by the name its table prints, with one report per
# round; one from before `compare --rounds` (BEFORE may be that old) is a list of rows keyed
# `rdkv`, `redis`, ….
OLD_KEYS = {"rdkv": "rdkv soft", "redis": "Redis TCP", "rdkv_shm": "rdkv shm",
            "redis_unix": "Redis unix", "memory": "memory (ceiling)"}
def stores_by_workload(document):
    """{workload: {store name: [one report per round]}} of a compare --json file, old or new."""
    if isinstance(document, list):
        return {row["workload"].upper(): {name: [row[key]] for key, name in OLD_KEYS.items() if row.get(key)}
                for row in document}
    return {row["workload"].upper(): {name: entry["rounds"] for name, entry in row["stores"].items()}
            for row in document["workloads"]}
# Every rdkv store the comparison ran (--stores), each against the better Redis of its run.
stores = ["rdkv soft", "rdkv shm", "memory (ceiling)"]
rows = {}
for path in sorted(results.glob("*.json")):
    side = path.stem.split("-")[0]
    for workload, reports in stores_by_workload(json.loads(path.read_text())).items():
        redis = max((statistics.median(report["throughput"] for report in reports[name])
                     for name in ("Redis TCP", "Redis unix") if name in reports), default=0)
        for name in stores:
            for report in reports.get(name, []):
                figures = rows.setdefault((workload, name), {}).setdefault(
                    side, {"ops": [], "ratio": [], "round_trips": [], "cpu": [], "errors": 0}
                )
                figures["ops"].append(report["throughput"])
                if redis:
                    figures["ratio"].append(report["throughput"] / redis)
                figures["round_trips"].append(report["rdkv"]["round_trips_per_operation"])
                figures["cpu"].append(report.get("client_cpu_us_per_operation") or 0)
                figures["errors"] += sum(
                    count for kind in report["kinds"] for outcome, count in kind["outcomes"].items() if outcome != "OK"
                )
median = statistics.median
def ratio(figures):
    return f"{median(figures['ratio']):.2f}×" if figures["ratio"] else "-"
print(f"| workload | store | before ({commit}) ops/s | after ops/s | after/before | before vs Redis | after vs Redis | before client CPU µs/op | after client CPU µs/op | before round trips/op | after round trips/op | errors before/after |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for (workload, name), sides in sorted(rows.items()):
    if "before" not in sides or "after" not in sides:
        continue
    b, a = sides["before"], sides["after"]
    print(
        f"| {workload} | {name} | {median(b['ops']):,.0f} | {median(a['ops']):,.0f} | {median(a['ops']) / median(b['ops']):.2f}× "
        f"| {ratio(b)} | {ratio(a)} | {median(b['cpu']):.1f} | {median(a['cpu']):.1f} "
        f"| {median(b['round_trips']):.2f} | {median(a['round_trips']):.2f} | {b['errors']}/{a['errors']} |"
    )
print(f"(medians of {len(next(iter(rows.values()))['before']['ops'])} runs per build)")
SUMMARY
