#!/usr/bin/env bash
# Short-lived clients against the example cluster: starts examples/local-3node.toml (detached,
# its own run directory), runs COUNT `rdkv put`s in a shell loop (each a new process, a new
# connection and a chunk for its first write), reads one back, prints the errors and the time,
# and stops the cluster. Exit code 0 only when every put succeeded.
#
#   scripts/cli-loop.sh [COUNT] [BINARY_DIRECTORY]     (defaults: 1000, target/release)
set -euo pipefail
count=${1:-1000}
binaries=${2:-target/release}
config=examples/local-3node.toml
run_directory=$(mktemp -d)
stop() { "$binaries/rdkv-cluster" down "$config" --run-dir "$run_directory" >/dev/null 2>&1 || true; rm -rf "$run_directory"; }
trap stop EXIT
"$binaries/rdkv-cluster" up "$config" --detach --run-dir "$run_directory" >/dev/null
started=$(date +%s%N)
errors=0
for index in $(seq 1 "$count"); do
  if ! "$binaries/rdkv" --config "$config" put "loop-$index" "value-$index" >/dev/null 2>"$run_directory/last-error"; then
    errors=$((errors + 1))
    [ "$errors" -gt 3 ] || cat "$run_directory/last-error" >&2
  fi
  if [ $((index % 250)) -eq 0 ]; then echo "cli-loop: $index of $count puts, $errors errors"; fi
done
elapsed_ms=$(( ($(date +%s%N) - started) / 1000000 ))
[ "$("$binaries/rdkv" --config "$config" get "loop-$count")" = "value-$count" ] || { echo "cli-loop: loop-$count did not read back" >&2; exit 1; }
echo "cli-loop: $count puts in ${elapsed_ms} ms, $errors errors"
[ "$errors" -eq 0 ]
