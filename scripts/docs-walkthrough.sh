#!/usr/bin/env bash
# README.md and docs/operations.md as written, the way a new user runs them: in a fresh clone,
# as a non-root user, under the common 8 MiB memlock limit; and the commands of the other docs
# that are not measurements.
#
#   scripts/docs-walkthrough.sh            (CI runs it; about 3 minutes, most of it the
#                                           README's `rdkv-ycsb compare` run)
#
# - The cargo commands run as the invoking user in this checkout (the toolchain lives in its
#   home); everything else runs in a fresh `git clone` of HEAD with the release binaries copied
#   in, as the user `rdkv-docs` (created when run as root) under `prlimit --memlock=8MiB`, or,
#   when not root, as yourself under `ulimit -l 8192`. The two documented `rdkv-ycsb compare`
#   runs, which the docs say need more than the 8 MiB default, first run as that user to check
#   they stop at once with the error naming the fix; then the README's runs where the limit is
#   lifted (as root: CAP_IPC_LOCK). The full default run is a 5-minute measurement, not run.
# - Every command runs verbatim (a `doc` line below), and its output is checked where the docs
#   say what it prints.
# - At the end, every command line of the `sh` blocks of README.md and docs/*.md must have been
#   run here, or
#   be listed in `covered_elsewhere` with the test or CI step that runs it, or why it cannot run
#   on a CI machine. A new command in the docs fails this script until it is covered.
# Exit code 0 only when every step passed.
set -euo pipefail
repository=$(cd "$(dirname "$0")/.." && pwd)
cd "$repository"
work=$(mktemp -d /tmp/rdkv-docs.XXXXXX)
chmod 755 "$work"
ran="$work/ran.txt"
: > "$ran"
user=rdkv-docs
memlock=$((8 << 20))
children=()

cleanup() {
  local status=$?
  for pid in "${children[@]}"; do kill "$pid" 2>/dev/null || true; done
  if [ -d "$work/rdkv" ]; then
    as_user "target/release/rdkv-cluster down examples/local-3node.toml" >/dev/null 2>&1 || true
    as_user "redis-cli -p 6379 shutdown nosave" >/dev/null 2>&1 || true
  fi
  rm -rf "$work"
  [ "$status" -eq 0 ] && echo "docs-walkthrough: passed" || echo "docs-walkthrough: FAILED (exit $status)" >&2
}
trap cleanup EXIT

fail() { echo "docs-walkthrough: $*" >&2; exit 1; }

# Runs a command line in the clone as the walkthrough's user, under the 8 MiB memlock limit.
as_user() {
  if [ "$(id -u)" -eq 0 ]; then
    prlimit --memlock="$memlock:$memlock" runuser -u "$user" -- \
      env -i HOME="/home/$user" PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 RUST_BACKTRACE=1 \
      bash -c "cd '$work/rdkv' && $1"
  else
    bash -c "ulimit -l $((memlock >> 10)) && cd '$work/rdkv' && $1"
  fi
}

# A command that the docs say needs more than the 8 MiB memlock default (the comparisons pin
# about 70 and 550 MiB per node, plus the in-process ceiling store's table): run where that holds. Raising a non-root user's hard limit
# needs CAP_SYS_RESOURCE, which a container's root may lack, so as root it runs as root, whose
# CAP_IPC_LOCK lifts the limit (docs/memory.md); otherwise under `ulimit -l unlimited`.
as_user_raised() {
  if [ "$(id -u)" -eq 0 ]; then
    bash -c "cd '$work/rdkv' && $1"
  else
    bash -c "ulimit -l unlimited 2>/dev/null || { echo 'needs a raised memlock limit: run as root, or see docs/memory.md' >&2; exit 1; }; cd '$work/rdkv' && $1"
  fi
}

# A documented command that needs the raised limit.
doc_raised() {
  echo "$1" >> "$ran"
  echo "docs (memlock limit lifted, as documented)\$ $1"
  as_user_raised "$1" > "$work/out" 2> "$work/err" || { cat "$work/out" "$work/err" >&2; fail "failed: $1"; }
  sed 's/^/    /' "$work/out" | tail -n 9
}

# A documented command: recorded, echoed, run as the user; its stdout is kept in $work/out.
doc() {
  echo "$1" >> "$ran"
  echo "docs\$ $1"
  as_user "$1" > "$work/out" 2> "$work/err" || { cat "$work/out" "$work/err" >&2; fail "failed: $1"; }
  sed 's/^/    /' "$work/out" | head -n 12
}

# A documented command run by the invoking user in this checkout (cargo).
doc_here() {
  echo "$1" >> "$ran"
  echo "docs (as $(id -un), in the checkout)\$ $1"
  bash -c "$1" || fail "failed: $1"
}

# A documented command run by the invoking user in this checkout, whose documented exit
# status is $2 (a grep that must find nothing, a model check that must find a violation).
doc_here_status() {
  echo "$1" >> "$ran"
  echo "docs (as $(id -un), in the checkout, exit $2 expected)\$ $1"
  local status=0
  bash -c "$1" > "$work/out" 2>&1 || status=$?
  sed 's/^/    /' "$work/out" | tail -n 5
  [ "$status" -eq "$2" ] || fail "exit $status, the docs say $2: $1"
}

# Starts a documented command in the background as the user. Sets $started_pid to the
# command's own process (what Ctrl-C or SIGTERM goes to) and $waiter to the shell that waits
# for it and exits with its status.
doc_background() {
  echo "$1" >> "$ran"
  echo "docs\$ $1 &"
  rm -f "$work/$2.pid"
  as_user "{ $1 & echo \$! > '$work/$2.pid'; wait \$!; }" > "$work/$2.out" 2> "$work/$2.err" &
  waiter=$!
  local deadline=$((SECONDS + 10))
  until [ -s "$work/$2.pid" ]; do
    [ "$SECONDS" -lt "$deadline" ] || fail "$1 did not start"
    sleep 0.05
  done
  started_pid=$(cat "$work/$2.pid")
  children+=("$started_pid")
}

# Waits (bounded) until a background command's output shows `pattern`.
wait_for() {
  local file=$1 pattern=$2 deadline=$((SECONDS + 60))
  until grep -q "$pattern" "$file"; do
    [ "$SECONDS" -lt "$deadline" ] || { cat "$file" "${file%.out}.err" >&2; fail "no \`$pattern\` in $file within 60 s"; }
    sleep 0.1
  done
}

expect_output() {
  grep -q -- "$1" "$work/out" || { cat "$work/out" >&2; fail "expected \`$1\` in the output"; }
}

echo "=== build (as $(id -un)) ==="
doc_here "cargo build --release --bins"
doc_here "cargo build --release --workspace --bins"
doc_here "cargo build --workspace"
doc_here "cargo build --workspace --release"

echo "=== a fresh clone, run as a non-root user with an 8 MiB memlock limit ==="
git clone -q "$repository" "$work/rdkv"
mkdir -p "$work/rdkv/target/release"
cp target/release/rdkv target/release/rdkv-server target/release/rdkv-cluster target/release/rdkv-ycsb \
  "$work/rdkv/target/release/"
if [ "$(id -u)" -eq 0 ]; then
  id "$user" >/dev/null 2>&1 || useradd --create-home --shell /bin/bash "$user"
  chown -R "$user" "$work"
fi
as_user 'echo "user $(id -un), memlock $(ulimit -l) KiB"'
[ "$(as_user 'ulimit -l')" = "8192" ] || fail "the memlock limit is not 8 MiB"

echo "=== README: the cluster in the foreground, the CLI, the Rust example ==="
doc_background "target/release/rdkv-cluster up examples/local-3node.toml" foreground
foreground=$started_pid
foreground_waiter=$waiter
wait_for "$work/foreground.out" "forwarding node logs"
doc "target/release/rdkv --config examples/local-3node.toml put user:1 ada"
doc "target/release/rdkv --config examples/local-3node.toml get user:1"
[ "$(cat "$work/out")" = "ada" ] || fail "get printed $(cat "$work/out"), not ada"
doc "target/release/rdkv --config examples/local-3node.toml cas user:1 ada grace"
doc "target/release/rdkv --config examples/local-3node.toml del user:1"
doc "target/release/rdkv --config examples/local-3node.toml stats"
expect_output "client operations"
doc "target/release/rdkv-cluster status examples/local-3node.toml"
doc "target/release/rdkv-cluster ack-loss examples/local-3node.toml"
expect_output "no loss recorded"

echo "--- docs/operations.md, The CLI ---"
doc "target/release/rdkv --config examples/local-3node.toml put user:1 ada"
doc "target/release/rdkv --config examples/local-3node.toml get user:1"
doc "target/release/rdkv --config examples/local-3node.toml cas user:1 ada grace"
doc "target/release/rdkv --config examples/local-3node.toml insert user:2 linus"
doc "target/release/rdkv --config examples/local-3node.toml del user:1"
doc "target/release/rdkv --config examples/local-3node.toml stats"
# This user runs the nodes: its CLI reaches every node over shm (docs/operations.md, Same-host
# clients), and stats says so.
[ "$(awk '$2 == "up" { print $4 }' "$work/out" | sort -u)" = "shm" ] \
  || { cat "$work/out" >&2; fail "stats does not show every node via shm"; }
doc "target/release/rdkv --config examples/local-3node.toml --fabric soft get user:2"
[ "$(cat "$work/out")" = "linus" ] || fail "get over soft printed $(cat "$work/out"), not linus"

echo "--- README, Use it from Rust: the Cargo.toml lines and the main, as an application ---"
mkdir -p "$work/app/src"
{
  printf '[package]\nname = "readme-app"\nversion = "0.1.0"\nedition = "2021"\n\n[workspace]\n\n'
  awk '/^## Use it from Rust/ { section = 1 } section && /^```toml/ { inside = 1; next } inside && /^```/ { exit } inside { print }' README.md
} > "$work/app/Cargo.toml"
awk '/^## Use it from Rust/ { section = 1 } section && /^```rust/ { inside = 1; next } inside && /^```/ { exit } inside { print }' \
  README.md > "$work/app/src/main.rs"
grep -q 'rdkv-client = { path = "../rdkv/client" }' "$work/app/Cargo.toml" || fail "the README's dependency line changed"
# The workspace's lock file: the same dependency versions as the tested build, offline-ready.
cp Cargo.lock "$work/app/Cargo.lock"
echo "docs (as $(id -un))\$ cargo build --release   # the README's Cargo.toml and main, next to the clone"
CARGO_TARGET_DIR="$repository/target" cargo build -q --release --manifest-path "$work/app/Cargo.toml"
cp "$repository/target/release/readme-app" "$work/readme-app"
[ "$(id -u)" -ne 0 ] || chown "$user" "$work/readme-app" "$work/app" -R
echo "docs\$ ../readme-app"
as_user "../readme-app" > "$work/out" 2>&1 || { cat "$work/out" >&2; fail "the README's Rust example failed"; }
expect_output "ada became grace"
echo "docs\$ cd .. && RDKV_CONFIG=rdkv/examples/local-3node.toml ./readme-app   # from outside the clone"
as_user "cd .. && RDKV_CONFIG=rdkv/examples/local-3node.toml ./readme-app" > "$work/out" 2>&1 \
  || { cat "$work/out" >&2; fail "the README's Rust example failed from outside the clone"; }
expect_output "ada became grace"
# A wrong path: exit 1 and one line in words (Display), not Rust's debug format.
set +e
as_user "cd .. && RDKV_CONFIG=no-such-cluster.toml ./readme-app" > "$work/out" 2>&1
app_status=$?
set -e
[ "$app_status" -eq 1 ] || { cat "$work/out" >&2; fail "the README's example exited $app_status on a missing file, not 1"; }
[ "$(wc -l < "$work/out")" -eq 1 ] && grep -q '^error: ' "$work/out" && ! grep -q 'Config {' "$work/out" \
  || { cat "$work/out" >&2; fail "the README's example did not print one line in words"; }

echo "--- Ctrl-C stops the foreground cluster in order, exit 0 ---"
kill -INT "$foreground"
wait "$foreground_waiter" || fail "the foreground rdkv-cluster up did not exit 0 after Ctrl-C"
grep -q "node 3: stopped" "$work/foreground.out" || { cat "$work/foreground.out" >&2; fail "no stop report"; }

echo "=== docs/operations.md: Start, stop, inspect ==="
doc "chmod 600 examples/local-3node.toml"
doc "target/release/rdkv-cluster up examples/local-3node.toml --detach"
doc "target/release/rdkv-cluster status examples/local-3node.toml"
doc "target/release/rdkv-cluster logs examples/local-3node.toml --node 2 --lines 20"
expect_output "server ready"
doc "target/release/rdkv-cluster restart examples/local-3node.toml --node 2"
expect_output "node 2: started"
doc "target/release/rdkv-cluster down examples/local-3node.toml --node 3"
doc "target/release/rdkv-cluster up examples/local-3node.toml --node 3 --detach"
# As docs/operations.md says: the restarted nodes fill, then serve; wait for that (30 s at most)
# before the load test.
settled=""
for _ in $(seq 1 60); do
  if as_user "target/release/rdkv-cluster status examples/local-3node.toml" 2>/dev/null \
      | grep -q "^view: .*1 serving, 2 serving, 3 serving"; then
    settled=yes
    break
  fi
  sleep 0.5
done
[ -n "$settled" ] || fail "the view did not show every node serving within 30 s of the restarts"

echo "=== docs/operations.md: Load tests (YCSB), on the running cluster ==="
doc "target/release/rdkv-ycsb load -c examples/local-3node.toml -P workloada -p recordcount=1500 --threads 16"
doc "target/release/rdkv-ycsb run  -c examples/local-3node.toml -P workloada -p recordcount=1500 -p operationcount=100000 --threads 16 --json a.json"
expect_output "\[OVERALL\], Throughput"
doc "target/release/rdkv-ycsb run  -c examples/local-3node.toml --fabric soft -P workloadc -p recordcount=1500 --threads 16"
expect_output "\[OVERALL\], Throughput"
as_user "redis-server --port 6379 --bind 127.0.0.1 --save '' --appendonly no --daemonize yes" >/dev/null
doc "target/release/rdkv-ycsb run  --driver redis --redis-url redis://127.0.0.1:6379 -P workloadb --load --threads 16"
as_user "redis-cli -p 6379 shutdown nosave" >/dev/null 2>&1 || true
doc "target/release/rdkv-ycsb run  --driver memory -P workloadc -p recordcount=1000 --threads 16"
doc "target/release/rdkv-ycsb run  --driver map -P workloadc -p recordcount=1000 --threads 16"
doc "target/release/rdkv-ycsb plot -o a.svg a.json"
as_user "test -s a.svg" || fail "plot wrote no a.svg"

echo "=== docs/operations.md: Persistence (a key survives down and up) ==="
doc "target/release/rdkv --config examples/local-3node.toml put persisted:1 survives"
doc "target/release/rdkv-cluster snapshot examples/local-3node.toml"
expect_output "node 3: snapshot"
doc "target/release/rdkv-cluster down examples/local-3node.toml"
expect_output "cluster stopped at view epoch"
expect_output "node 3: stopped"
doc "target/release/rdkv-cluster up examples/local-3node.toml --detach"
doc "target/release/rdkv --config examples/local-3node.toml get persisted:1"
expect_output "survives"
doc "target/release/rdkv-cluster down examples/local-3node.toml"
expect_output "node 3: stopped"
doc "target/release/rdkv-cluster systemd examples/local-3node.toml --node 1 > rdkv-local-3node-node-1.service"
as_user "grep -q '^LimitMEMLOCK=' rdkv-local-3node-node-1.service" || fail "no unit written"

echo "=== docs/operations.md: Growing and shrinking a cluster (node 4 added, node 1 removed) ==="
as_user "target/release/rdkv-cluster up examples/local-3node.toml --detach" > "$work/out" 2>&1 \
  || { cat "$work/out" >&2; fail "up before the membership changes failed"; }
# The doc's [[node]] section for node 4, appended as it says.
{
  printf '\n'
  awk '/^### Growing and shrinking a cluster/ { section = 1 } section && /^```toml/ { inside = 1; next } inside && /^```/ { exit } inside { print }' docs/operations.md
} > "$work/node-4.toml"
grep -q '^id = 4$' "$work/node-4.toml" || fail "docs/operations.md's [[node]] section for node 4 changed"
as_user "cat >> examples/local-3node.toml" < "$work/node-4.toml"
doc "target/release/rdkv-cluster add-node examples/local-3node.toml --node 4"
expect_output "node 4: serving"
doc "target/release/rdkv-cluster status examples/local-3node.toml"
expect_output "4 serving"
doc "target/release/rdkv-cluster remove-node examples/local-3node.toml --node 1"
expect_output "node 1: removed"
doc "target/release/rdkv --config examples/local-3node.toml get persisted:1"
expect_output "survives"
echo "=== docs/operations.md: Growing a node's table ==="
doc "target/release/rdkv-cluster resize examples/local-3node.toml --node 2 --index-size 2M"
expect_output "node 2: serving again"
as_user "grep -q 'index_size = \"2M\"' examples/local-3node.toml" || fail "resize did not write node 2's index_size"
doc "target/release/rdkv --config examples/local-3node.toml get persisted:1"
expect_output "survives"
doc "target/release/rdkv-cluster down examples/local-3node.toml"
expect_output "node 4: stopped"

echo "=== README: a single server by hand (SIGTERM stops it in order, exit 0) ==="
doc_background "RDKV_SECRET=change-me-to-32-random-bytes target/release/rdkv-server --listen 127.0.0.1:7400 --fabric-listen 127.0.0.1:7401 --index-size 1M --heap-size 4M --chunk-size 256K --hugepages auto" single
single=$started_pid
single_waiter=$waiter
wait_for "$work/single.out" "rdkv-server ready node=1"
kill -TERM "$single"
wait "$single_waiter" || fail "rdkv-server did not exit 0 after SIGTERM"

echo "=== docs/operations.md: Memory ==="
doc "ulimit -l"
[ "$(cat "$work/out")" = "8192" ] || fail "ulimit -l printed $(cat "$work/out")"
doc "grep -E 'HugePages_(Total|Free)' /proc/meminfo"

echo "=== the YCSB comparisons with Redis (README's; docs/operations.md's full default run refuses 8 MiB) ==="
# Both say they need more than the 8 MiB default (each node pins about 70 MiB, then 550 MiB);
# at 8 MiB they must refuse at once with the error that names the fix. The README's run then
# measures every workload and store; the full default run, the same tool over the same workloads
# and stores for about 5 minutes, is a measurement (covered_elsewhere below).
for command in "target/release/rdkv-ycsb compare --records 20000 --seconds 3" "target/release/rdkv-ycsb compare"; do
  as_user "$command" > "$work/out" 2> "$work/err" \
    && fail "$command ran under 8 MiB of memlock: the docs' warning is stale"
  grep -q "RLIMIT_MEMLOCK allows 8388608 bytes" "$work/err" || { cat "$work/err" >&2; fail "$command at 8 MiB did not name the memlock limit"; }
done
doc_raised "target/release/rdkv-ycsb compare --records 20000 --seconds 3"

echo "=== docs/architecture.md: the provider seam by hand; docs/protocol.md: the model checker ==="
doc_here_status "grep -rn \"crate::provider\" fabric/src/*.rs fabric/src/memory" 1
doc_here_status "grep -rn 'feature = \"verbs\"' fabric/src fabric/tests fabric/benches --include=*.rs | grep -v 'fabric/src/provider/verbs/\\|fabric/src/provider/mod.rs'" 0
[ "$(wc -l < "$work/out")" -eq 1 ] || fail "the verbs cfg appears $(wc -l < "$work/out") times, the docs say once"
doc_here_status "cargo run -p rdkv-protocol-model -- --list" 0
doc_here_status "cargo run -p rdkv-protocol-model -- --protocol new-draft --scenario put-then-update" 1

echo "=== docs/benchmarks.md: the in-process ceiling run and its plot, a comparison in rounds and its plot ==="
doc_raised "target/release/rdkv-ycsb run --driver memory -P workloadc -p recordcount=5000 -p operationcount=3000000 --max-execution-time 3 --threads 16 --json /tmp/memc.json"
doc_raised "target/release/rdkv-ycsb plot -o /tmp/plot.png /tmp/memc.json"
rm -f /tmp/memc.json /tmp/plot.png
doc_raised "target/release/rdkv-ycsb compare --stores memory --workloads a,c --records 1000 --seconds 1 --rounds 3 --json /tmp/compare.json"
doc_raised "target/release/rdkv-ycsb plot -o /tmp/compare.svg /tmp/compare.json"
rm -f /tmp/compare.json /tmp/compare.svg

echo "=== every documented command is covered ==="
python3 - "$ran" README.md docs/*.md <<'PYTHON'
import re
import sys

ran = {" ".join(line.split()) for line in open(sys.argv[1]) if line.strip()}
# Commands not run above: the test or CI step that runs them, or why a CI machine cannot.
covered_elsewhere = [
    (r"^cargo test --workspace$", ".ci/run's test step (the README's test command)"),
    (r"^cargo build --release --features verbs --bins$", ".ci/run's Soft-RoCE tier (scripts/softroce/run.sh) builds it"),
    (r"^apt-get install cmake clang libclang-dev libibverbs1 ibverbs-providers$", "scripts/softroce/run.sh installs these when missing"),
    (r"^(ibv_devices|show_gids)$", "needs an RDMA device: scripts/softroce/run.sh runs rdma-core's tools on rxe0 in a QEMU guest"),
    (r"verbs-1node\.toml", "needs an RDMA device: scripts/softroce/run.sh runs rdkv-cluster, rdkv and rdkv-ycsb on examples/verbs-1node.toml over rxe0"),
    (r"^ulimit -l unlimited$", "raises the limit above the hard limit: root only, and the walkthrough keeps the 8 MiB default on purpose"),
    (r"\| sudo tee ", "changes the machine's configuration (limits, hugepages, sysctl): not done on a CI machine"),
    (r"^(install -d -m 0700 /etc/rdkv|printf .* /etc/rdkv/|cp rdkv-local-3node-node-1\.service /etc/systemd/system/|systemctl |journalctl )",
     "installs a systemd unit: needs systemd as PID 1; the unit passes systemd-analyze verify in integration-tests/tests/operations.rs"),
    (r"^cargo test -p rdkv-protocol-model( replication)?$", ".ci/run's test step (cargo test --workspace)"),
    (r"^cargo run -p rdkv-protocol-model -- --protocol (old|new)$", ".ci/run's protocol model check step runs both"),
    (r"^cargo run -p rdkv-protocol-model -- --model reclaim( --unchecked-reads| --fence (drain-bounded|release-first|wait-for-out))?$", ".ci/run's reclaim model check step runs each and checks its exit code"),
    (r"^cargo run -p rdkv-protocol-model -- --model membership( --rule [a-z-]+)?( --scenario [a-z-]+)?$", ".ci/run's membership model check step runs the built rule on every scenario and each broken variant, and checks its exit code"),
    (r"^cargo run -p rdkv-protocol-model -- --model leave-order( --decide [a-z-]+)?( --scenario [a-z-]+)?$", ".ci/run's leave-order model check step runs the built rule and each broken variant and checks its exit code"),
    (r"^scripts/frozen-client\.sh ", "a measurement (a client stopped for 15 s beside another, release build): integration-tests/tests/frozen_client.rs runs the same scenario in the test step"),
    # docs/benchmarks.md: the measurements behind its figures take minutes each; CI runs every
    # tool in a short form.
    (r"^cargo bench -p rdkv-fabric --bench fabric", "a measurement (seconds per backend): .ci/run's fabric benchmark smoke run (-- --seconds 0.05)"),
    (r"^scripts/softroce/run\.sh --fabric-bench", "a measurement in the Soft-RoCE guest: .ci/run runs the Soft-RoCE tier without the benchmark"),
    (r"^target/release/rdkv-ycsb compare --workloads a,f --heap-size (218|870)M$", "the 2x/8x heap measurement (870 MiB pinned, minutes): the compare runs above and .ci/run's smoke comparison run the same tool"),
    (r"^((TOKIO_WORKER_THREADS|RDKV_SLOT_CACHE_ENTRIES)=\d+ )?target/release/rdkv-ycsb compare --workloads [a-f,]+ --seconds \d+ --stores [a-z,-]+$", "a measurement (seconds per store and workload, memlock raised): the compare runs above and .ci/run's smoke comparison run the same tool"),
    (r"^target/release/rdkv-ycsb compare --stores [a-z,-]+$", "a measurement (every workload, minutes): the compare runs above and .ci/run's smoke comparison run the same tool"),
    (r"^target/release/rdkv-ycsb compare$", "the full default run, a measurement (every workload and store, about 6 minutes): checked above to refuse 8 MiB at once; the README's compare above runs the same workloads and stores"),
    (r"^target/release/rdkv-ycsb compare (--records \d+ --threads \d+ )?--seconds \d+( --rounds \d+)?$", "a measurement (every workload and store, minutes): the compare runs above and .ci/run's smoke comparison run the same tool"),
    (r"^target/release/rdkv-ycsb compare --records \d+ --rounds \d+$", "a measurement (every workload and store, 3 rounds: about 17 minutes): the compare runs above and .ci/run's smoke comparison run the same tool"),
    (r"^scripts/bench/membership\.sh ", "the membership change measurement (release, a minute): .ci/run runs membership.sh in a smoke run of 2,000 records"),
    (r"^scripts/bench/replication\.sh ", "the replication cost measurement (release, minutes): .ci/run runs replication.sh in a debug smoke run"),
    (r"^scripts/bench/snapshot\.sh", "a measurement (100,000 records, minutes): .ci/run's snapshot benchmark smoke run (--records 2000 --seconds 1 --rounds 1)"),
    (r"^scripts/bench/before-after\.sh ", "a measurement against an old commit: .ci/run runs before-after.sh HEAD for one round"),
    (r"^scripts/bench/node-instructions\.sh target/release", "a measurement under valgrind (100,000 records, 1,000,000 operations: minutes): .ci/run runs node-instructions.sh on 2,000 records and 20,000 operations"),
    (r"^scripts/bench/node-instructions\.sh --native ", "a measurement under perf (linux-perf, not installed on a CI machine): the same run natively; .ci/run runs the callgrind one small"),
    (r"^(TOKIO_WORKER_THREADS=\d+ )?scripts/bench/instructions\.sh ", "a measurement under valgrind (about 2 minutes): .ci/run's instructions step runs instructions.sh --check on the release build"),
    (r"^(BEFORE|AFTER)=|^for round in ", "a by-hand loop over two builds' fabric benchmarks (a measurement)"),
    (r"^target/release/rdkv-cluster remove-node examples/local-3node\.toml --node 3$", "the removal of a dead node (operations.md, A node that stays dead): integration-tests/tests/rereplication.rs kills a node and runs it, and the replace_after path"),
    (r"^scripts/soak\.sh$", "the 300 s soak behind the figures: not in CI (5 minutes); not run here"),
    (r"^scripts/lease-lapses\.sh ", "a measurement under the CPU burner (2 minutes per setting): not in CI; it runs the same release binaries the walkthrough runs"),
]
missing = []
for path in sys.argv[2:]:
    inside = False
    pending = ""
    for number, line in enumerate(open(path), 1):
        if line.startswith("```"):
            inside = line.strip() == "```sh" if not inside else False
            continue
        if not inside:
            continue
        line = pending + line.rstrip("\n")
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        command = re.sub(r"\s{2,}#.*$", "", line).strip()
        if not command or command.startswith("#"):
            continue
        command = " ".join(command.split())
        parts = [part.strip() for part in command.split(" && ")] if command.startswith("cargo build") else [command]
        for part in parts:
            if part in ran:
                continue
            reason = next((why for pattern, why in covered_elsewhere if re.search(pattern, part)), None)
            if reason is None:
                missing.append(f"{path}:{number}: {part}")
            else:
                print(f"  elsewhere: {part}\n             ({reason})")
if missing:
    print("documented commands that nothing runs:\n  " + "\n  ".join(missing), file=sys.stderr)
    sys.exit(1)
print(f"every command of README.md and docs/*.md is run here ({len(ran)}) or covered elsewhere")
PYTHON
