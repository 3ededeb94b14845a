#!/usr/bin/env bash
# The README's test command on a busy machine: `cargo test --workspace` with every core kept
# busy by scripts/burn-cpu.sh, because the suite must pass there too (DESIGN.md §7: both cores
# busy). Exits with the tests' status. The default is 1 busy worker per core (2 on 2 cores; with
# the tests' own threads a load average of about 3-4): every core stays busy for the whole run.
# It was 4 per core (a load average of about 8), which kept the cores no busier but gave each
# test thread a fifth of a core, so that CI's run of the suite took 30 minutes (stop_attack.rs:
# 69 s beside 8 workers, 37 s beside 2, other work on the machine too, 2026-12-07).
# BURN_WORKERS=8 (or 16) runs it heavier.
#
#   scripts/test-under-load.sh [CARGO TEST ARGUMENTS…] [-- TEST BINARY ARGUMENTS…]
#       e.g. scripts/test-under-load.sh --no-fail-fast
#
# The tests are built first, without the burner (building under it only takes longer); the
# burner runs for the tests alone and is stopped when they end, whatever happens. Environment:
# BURN_WORKERS (default 1 per core), BURN_SECONDS (the burner's own bound, default 7200).
set -euo pipefail
cd "$(dirname "$0")/.."

# The arguments for cargo itself: those before a `--`.
cargo_arguments=()
for argument in "$@"; do
  [ "$argument" = "--" ] && break
  cargo_arguments+=("$argument")
done
cargo test --workspace --no-run "${cargo_arguments[@]}"

scripts/burn-cpu.sh "${BURN_SECONDS:-7200}" "${BURN_WORKERS:-$(nproc)}" &
burner=$!
trap 'kill "$burner" 2>/dev/null || true; wait "$burner" 2>/dev/null || true' EXIT
uptime >&2
status=0
cargo test --workspace "$@" || status=$?
uptime >&2
exit "$status"
