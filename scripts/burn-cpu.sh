#!/usr/bin/env bash
# Keeps every core busy for a bounded time, so that tests can be run as on a loaded machine
# (the suite must pass with both cores busy, load average 8: DESIGN.md §7).
#
#   scripts/burn-cpu.sh [SECONDS] [WORKERS]
#       defaults: 600 s; 4 busy workers per core (8 on 2 cores: a load average of about 8)
#
# Uses stress-ng when it is installed (apt-get install stress-ng), else one busy-looping bash
# per worker. Each worker stops after SECONDS, and at once when this script exits or gets INT,
# TERM or HUP: nothing outlives it. Run it in the background and kill its pid to stop it early.
set -euo pipefail
seconds=${1:-600}
workers=${2:-$((4 * $(nproc)))}
case "$seconds$workers" in
  *[!0-9]*) echo "usage: $0 [SECONDS] [WORKERS] (whole numbers)" >&2; exit 2 ;;
esac
[ "$seconds" -gt 0 ] && [ "$workers" -gt 0 ] \
  || { echo "usage: $0 [SECONDS] [WORKERS] (both above 0)" >&2; exit 2; }

pids=()
stop() {
  trap - EXIT INT TERM HUP
  [ "${#pids[@]}" -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap stop EXIT
trap 'exit 143' INT TERM HUP

if command -v stress-ng >/dev/null 2>&1; then
  echo "burn-cpu: stress-ng, $workers workers for ${seconds}s" >&2
  # stress-ng stops its workers itself at --timeout, and when it is sent TERM.
  stress-ng --cpu "$workers" --timeout "${seconds}s" --quiet &
  pids+=($!)
else
  echo "burn-cpu: $workers busy bash loops for ${seconds}s (stress-ng is not installed)" >&2
  for _ in $(seq "$workers"); do
    timeout "$seconds" bash -c 'while :; do :; done' &
    pids+=($!)
  done
fi
# `wait` returns early when a trapped signal arrives, so the trap runs at once.
wait
