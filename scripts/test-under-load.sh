#!/usr/bin/env bash
# The README's test command on a busy machine: `cargo test --workspace` with every core kept
# busy by scripts/burn-cpu.sh (4 busy workers per core: a load average of about 8 on 2 cores,
# DESIGN.md §7), because the suite must pass there too. Exits with the tests' status.
# BURN_WORKERS=2 (one per core) keeps both cores busy too and runs the suite in about half the
# time (stop_attack.rs: 69 s beside 8 workers, 37 s beside 2, other work on the machine too,
# 2026-12-07), for a quicker local run.
#
#   scripts/test-under-load.sh [CARGO TEST ARGUMENTS…] [-- TEST BINARY ARGUMENTS…]
#       e.g. scripts/test-under-load.sh --no-fail-fast
#
# The tests are built first, without the burner (building under it only takes longer); the
# burner runs for the tests alone and is stopped when they end, whatever happens. Environment:
# BURN_WORKERS (default 4 per core), BURN_SECONDS (the burner's own bound, default 7200).
set -euo pipefail
cd "$(dirname "$0")/.."

# The arguments for cargo itself: those before a `--`.
cargo_arguments=()
for argument in "$@"; do
  [ "$argument" = "--" ] && break
  cargo_arguments+=("$argument")
done
cargo test --workspace --no-run "${cargo_arguments[@]}"

scripts/burn-cpu.sh "${BURN_SECONDS:-7200}" "${BURN_WORKERS:-$((4 * $(nproc)))}" &
burner=$!
trap 'kill "$burner" 2>/dev/null || true; wait "$burner" 2>/dev/null || true' EXIT
uptime >&2
status=0
cargo test --workspace "$@" || status=$?
uptime >&2
exit "$status"
