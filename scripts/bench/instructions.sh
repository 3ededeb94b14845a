#!/usr/bin/env bash
# Counts the client's CPU instructions per GET and per update with callgrind, over rdkv's `shm`
# and `soft` fabrics and over the harness's in-process `map` (its own ceiling): figures that
# repeat whatever else the machine is doing (unlike ops/s on this 2-core machine), and a
# regression gate against the figures recorded in docs/benchmarks.md.
#
#   scripts/bench/instructions.sh [--check] [--operations N] [--stores shm,soft,map]
#                                 [--kinds get,update] [--profiles DIRECTORY] [BINARY_DIRECTORY]
#
# BINARY_DIRECTORY holds rdkv-server and rdkv-ycsb (default: $CARGO_TARGET_DIR/release, else
# target/release of this checkout). For each store and kind it runs `rdkv-ycsb run` under
# `valgrind --tool=callgrind` twice, with N and 2N operations (N = 20,000 by default; 4 tasks;
# 2,000 records; GETs: workload C; updates: workload A with readproportion=0,
# updateproportion=1 and a uniform key choice, so that the four tasks seldom update one key at
# once and wait for each other), and reports the marginal instructions per operation,
# (I(2N) - I(N)) / N: start-up, connections and the map's load cancel out. The client runs one
# tokio worker (TOKIO_WORKER_THREADS=1 unless set), so that the figure does not depend on the
# machine's cores. The rdkv stores use one node started here on 127.0.0.1 with port 0 (its
# ready line names the bound addresses; the cluster file is written after), offering `shm` on
# a socket in a temporary directory, loaded once with the 2,000 records; only the client is
# counted. The node pins a heap for every block the runs write (about 170 MiB for N = 20,000):
# run as root, or raise `ulimit -l` (docs/operations.md, Memory: memlock and hugepages).
#
# It prints a table: each figure, the one recorded in docs/benchmarks.md (the table of the
# section "Instructions per operation", whose format that section describes) and their ratio.
# --check also compares: a figure more than 10% above its recorded one fails, named on stderr.
# --profiles DIRECTORY keeps each run's callgrind output (for callgrind_annotate) and its report
# there.
#
# Exit codes: 0 measured (and, with --check, no figure more than 10% above its record);
# 1 with --check, a figure more than 10% above its record; 2 nothing to compare or measure (a
# binary or valgrind missing, the node did not start, a run did not complete its operations,
# no recorded figure to check against), or a bad command line.
set -euo pipefail
repository=$(cd "$(dirname "$0")/../.." && pwd)
recorded_file=$repository/docs/benchmarks.md
binaries=${CARGO_TARGET_DIR:-$repository/target}/release
operations=20000
stores=shm,soft,map
kinds=get,update
check=
profiles=
# A figure more than this many percent above its record fails --check.
tolerance=10

fail() {
  echo "instructions: $*" >&2
  exit 2
}
while [ $# -gt 0 ]; do
  case $1 in
    --check) check=yes ;;
    --operations) operations=${2:?--operations needs a number}; shift ;;
    --stores) stores=${2:?--stores needs shm, soft and/or map}; shift ;;
    --kinds) kinds=${2:?--kinds needs get and/or update}; shift ;;
    --profiles) profiles=${2:?--profiles needs a directory}; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) fail "unknown option $1 (see --help)" ;;
    *) binaries=$1 ;;
  esac
  shift
done
[[ $operations =~ ^[1-9][0-9]*$ ]] || fail "--operations must be a positive number, not $operations"
for store in ${stores//,/ }; do
  [[ $store =~ ^(shm|soft|map)$ ]] || fail "unknown store $store: shm, soft or map"
done
for kind in ${kinds//,/ }; do
  [[ $kind =~ ^(get|update)$ ]] || fail "unknown kind $kind: get or update"
done
for program in rdkv-server rdkv-ycsb; do
  [ -x "$binaries/$program" ] \
    || fail "$binaries/$program is missing; build it with cargo build --release --workspace --bins"
done
command -v valgrind >/dev/null || fail "valgrind is missing; install it with apt-get install valgrind"
command -v python3 >/dev/null || fail "python3 is missing"
[ -z "$profiles" ] || mkdir -p "$profiles"
export TOKIO_WORKER_THREADS=${TOKIO_WORKER_THREADS:-1}
records=2000
tasks=4
started=$(date +%s)
work=$(mktemp -d)
server=
cleanup() {
  if [ -n "$server" ]; then
    kill "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# The node, when an rdkv store is measured: port 0, its bound addresses read from its ready
# line (`rdkv-server ready node=1 control=ADDRESS fabric=ADDRESS metrics=-`), then the cluster
# file for the clients. Its heap holds every block the script writes (each update writes one,
# about 1.1 KiB), with a quarter to spare: once a node reuses freed space its grants are
# scattered extents, a control round trip every few writes, and how many depends on the node's
# pace against the client's, so the instructions per update would not repeat.
start_node() {
  local secret=instructions-secret ready_line field control= fabric=
  local blocks=$((records + 2 * 3 * operations))
  local heap_size=$((blocks * 1152 * 5 / 4 / 1048576 + 8))M
  mkfifo "$work/ready"
  RDKV_SECRET=$secret RUST_LOG=warn "$binaries/rdkv-server" --node-id 1 \
    --listen 127.0.0.1:0 --fabric-listen 127.0.0.1:0 --fabric soft \
    --shm-socket "$work/node.sock" --index-size 1M --heap-size "$heap_size" --chunk-size 1M \
    --lease-timeout-ms 60000 --deadline-ms 20000 >"$work/ready" 2>"$work/server.log" &
  server=$!
  # Held open until the end: the node may write to its stdout again.
  exec {ready_descriptor}<"$work/ready"
  if ! read -r -t 60 ready_line <&"$ready_descriptor"; then
    cat "$work/server.log" >&2
    fail "the node did not print its ready line within 60 s"
  fi
  for field in $ready_line; do
    case $field in
      control=*) control=${field#control=} ;;
      fabric=*) fabric=${field#fabric=} ;;
    esac
  done
  [ -n "$control" ] && [ -n "$fabric" ] || fail "no addresses in the node's ready line: $ready_line"
  # Clients and the node wait long for each other: valgrind slows the client about 50 times.
  cat >"$work/cluster.toml" <<CLUSTER
[cluster]
name = "instructions"
secret = "$secret"
fabric = "soft"
operation_deadline = "20s"
lease_timeout = "60s"

[[node]]
id = 1
control_address = "$control"
fabric_address = "$fabric"
index_size = "1M"
heap_size = "$heap_size"
chunk_size = "1M"
CLUSTER
  "$binaries/rdkv-ycsb" load -c "$work/cluster.toml" --fabric soft -P workloadc \
    -p recordcount=$records --threads $tasks >"$work/load.log" 2>&1 \
    || { cat "$work/load.log" >&2; fail "loading $records records failed"; }
}

# The client's instructions for `count` operations of `kind` on `store` (every one OK).
count_instructions() {
  local store=$1 kind=$2 count=$3 label workload=() driver=() total
  case $kind in
    get) label=READ; workload=(-P workloadc) ;;
    update) label=UPDATE; workload=(-P workloada -p readproportion=0 -p updateproportion=1 -p requestdistribution=uniform) ;;
  esac
  case $store in
    map) driver=(--driver map) ;;
    *) driver=(-c "$work/cluster.toml" --fabric "$store") ;;
  esac
  local run="$work/$store-$kind-$count"
  valgrind --tool=callgrind --callgrind-out-file="$run.out" \
    "$binaries/rdkv-ycsb" run "${driver[@]}" "${workload[@]}" -p recordcount=$records \
    -p operationcount="$count" --threads $tasks >"$run.log" 2>"$run.valgrind.log" \
    || { cat "$run.log" "$run.valgrind.log" >&2; fail "$store $kind: the run failed"; }
  grep -q "^\[$label\], Return=OK, $count$" "$run.log" || {
    cat "$run.log" >&2
    fail "$store $kind: the run did not complete $count operations, each OK"
  }
  total=$(grep -o 'refs: *[0-9,]*' "$run.valgrind.log" | tr -dc '0-9')
  [ -n "$total" ] || { cat "$run.valgrind.log" >&2; fail "$store $kind: no instruction count from callgrind"; }
  if [ -n "$profiles" ]; then
    cp "$run.out" "$profiles/$store-$kind-$count.callgrind.out"
    cp "$run.log" "$profiles/$store-$kind-$count.log"
  fi
  echo "$total"
}

if [[ ,$stores, =~ ,(shm|soft), ]]; then start_node; fi
echo "counting the client's instructions: $operations and $((2 * operations)) operations per store and kind, $tasks tasks, $records records, TOKIO_WORKER_THREADS=$TOKIO_WORKER_THREADS" >&2
: >"$work/figures"
for store in ${stores//,/ }; do
  for kind in ${kinds//,/ }; do
    single=$(count_instructions "$store" "$kind" "$operations")
    double=$(count_instructions "$store" "$kind" $((2 * operations)))
    echo "$store $kind $(( (double - single + operations / 2) / operations )) $single $double" >>"$work/figures"
    echo "  $store $kind: $single instructions for $operations, $double for $((2 * operations)) ($(( $(date +%s) - started )) s)" >&2
  done
done

set +e
python3 - "$work/figures" "$recorded_file" "$tolerance" "$check" \
  "$operations, $tasks tasks, $records records, TOKIO_WORKER_THREADS=$TOKIO_WORKER_THREADS" <<'PYTHON'
import sys

figures_path, recorded_path, tolerance, check, settings = sys.argv[1:6]
tolerance, check = float(tolerance), check == "yes"
KINDS = {"get": "GET", "update": "update"}


class Unreadable(Exception):
    """The recorded figures cannot be read."""


def unreadable(reason):
    raise Unreadable(reason)


def recorded_figures(path):
    """{(store, kind): instructions} from the table of the section "## Instructions per operation":
    its header row is `| store | GET | update |`, each row `| shm | 9,876 | 12,345 |`."""
    figures, inside, columns = {}, False, None
    for line in open(path, encoding="utf-8"):
        if line.startswith("## "):
            if inside:
                break
            inside = line.strip() == "## Instructions per operation"
            continue
        if not inside or not line.startswith("|"):
            if columns and not line.startswith("|"):
                break
            continue
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        if columns is None:
            columns = cells
            if columns[:3] != ["store", "GET", "update"]:
                unreadable(f"{path}: the table of \"Instructions per operation\" must start with | store | GET | update |, not {line.strip()}")
            continue
        if set(cells[0]) <= set("-:"):
            continue
        for kind, column in KINDS.items():
            value = cells[columns.index(column)].replace(",", "")
            if not value.isdigit():
                unreadable(f"{path}: {cells[0]} {column}: `{value}` is not a number of instructions")
            figures[(cells[0], kind)] = int(value)
    if not figures:
        unreadable(f"{path}: no section \"## Instructions per operation\" with a table of figures")
    return figures


def grouped(number):
    return f"{number:,}"


measured = {}
for line in open(figures_path):
    store, kind, per_operation, _, _ = line.split()
    measured[(store, kind)] = int(per_operation)
try:
    recorded = recorded_figures(recorded_path)
except (Unreadable, OSError) as error:
    print(f"instructions: {error}", file=sys.stderr)
    if check:
        sys.exit(2)
    recorded = {}
stores = list(dict.fromkeys(store for store, _ in measured))
kinds = [kind for kind in KINDS if any(key[1] == kind for key in measured)]
header = "| store |" + "".join(f" {KINDS[kind]} | recorded | ratio |" for kind in kinds)
print(f"client instructions per operation, marginal: (I(2N) - I(N)) / N with N = {settings}")
print()
print(header)
print("|---|" + "---:|---:|---:|" * len(kinds))
regressions, unrecorded = [], []
for store in stores:
    row = f"| {store} |"
    for kind in kinds:
        figure, record = measured.get((store, kind)), recorded.get((store, kind))
        if figure is None:
            row += " - | - | - |"
            continue
        if record is None:
            unrecorded.append(f"{store} {KINDS[kind]}")
            row += f" {grouped(figure)} | - | - |"
            continue
        ratio = figure / record
        row += f" {grouped(figure)} | {grouped(record)} | {ratio:.3f}× |"
        if ratio > 1 + tolerance / 100:
            regressions.append(
                f"{store} {KINDS[kind]}: {grouped(figure)} instructions, {100 * (ratio - 1):.1f}% above the recorded {grouped(record)} (limit +{tolerance:g}%)"
            )
    print(row)
if not check:
    sys.exit(0)
if regressions:
    print("\ninstructions: more than the recorded figures allow (docs/benchmarks.md, Instructions per operation):", file=sys.stderr)
    for regression in regressions:
        print(f"  {regression}", file=sys.stderr)
    sys.exit(1)
if unrecorded:
    print(f"\ninstructions: no recorded figure to check against for {', '.join(unrecorded)} in {recorded_path}", file=sys.stderr)
    sys.exit(2)
print(f"\nevery figure is within +{tolerance:g}% of its record")
PYTHON
status=$?
set -e
echo "($(( $(date +%s) - started )) s)"
exit $status
