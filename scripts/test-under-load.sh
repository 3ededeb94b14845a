#!/usr/bin/env bash
# The README's test command on a busy machine: `cargo test --workspace` with every core kept
# busy by scripts/burn-cpu.sh, because the suite must pass there too (DESIGN.md §7: both cores
# busy). Exits with the tests' status. The default is 2 busy workers per core (4 on 2 cores: a
# load average of about 5 with the tests' own threads); it was 4 per core (load average about
# 8), which held every core just as busy but made each CPU-bound test take 2-3 times as long,
# and CI's run of the suite 30 minutes. BURN_WORKERS=16 runs it heavier.
#
#   scripts/test-under-load.sh [CARGO TEST ARGUMENTS…] [-- TEST BINARY ARGUMENTS…]
#       e.g. scripts/test-under-load.sh --no-fail-fast
#
# The tests are built first, without the burner (building under it only takes longer); the
# burner runs for the tests alone and is stopped when they end, whatever happens. Environment:
# BURN_WORKERS (default 2 per core), BURN_SECONDS (the burner's own bound, default 7200).
set -euo pipefail
cd "$(dirname "$0")/.."

# The arguments for cargo itself: those before a `--`.
cargo_arguments=()
for argument in "$@"; do
  [ "$argument" = "--" ] && break
  cargo_arguments+=("$argument")
done
cargo test --workspace --no-run "${cargo_arguments[@]}"

scripts/burn-cpu.sh "${BURN_SECONDS:-7200}" "${BURN_WORKERS:-$((2 * $(nproc)))}" &
burner=$!
trap 'kill "$burner" 2>/dev/null || true; wait "$burner" 2>/dev/null || true' EXIT
uptime >&2
status=0
cargo test --workspace "$@" || status=$?
uptime >&2
exit "$status"
