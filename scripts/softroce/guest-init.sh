#!/bin/sh
# PID 1 of the Soft-RoCE guest: load modules, create rxe0 over a guest-only dummy interface,
# run the smoke tests and the shared programs, report, power off. Nothing leaves the guest:
# QEMU runs with -nic none and 192.0.2.0/24 is a documentation range that exists only here.
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/infiniband /tmp
for module in $(cat /modules.order); do
  insmod "/lib/modules/$module" 2>/dev/null
done
# A leading newline keeps reports on lines of their own between kernel console messages.
report() { printf '\n[guest] %s\n' "$*"; }
check() { name=$1; shift; if "$@" > /tmp/out 2>&1; then report "PASS $name"; else report "FAIL $name"; sed 's/^/[guest]   /' /tmp/out; fi; }
# As check, and shows the output when it passes too.
check_show() { check "$@"; grep -q "^" /tmp/out && sed 's/^/[guest]   /' /tmp/out | tail -"${SHOW_LINES:-12}"; true; }

ip link add rdkv0 type dummy
ip addr add 192.0.2.1/24 dev rdkv0
ip link set rdkv0 up
ip link set lo up
rdma link add rxe0 type rxe netdev rdkv0
check "rxe0 is active" sh -c 'ibv_devinfo -d rxe0 | grep -q PORT_ACTIVE'
check "ibv_rc_pingpong over rxe0" sh -c '
  ibv_rc_pingpong -d rxe0 -g 0 -n 100 > /tmp/server.log 2>&1 &
  server=$!
  for attempt in $(seq 1 50); do
    ibv_rc_pingpong -d rxe0 -g 0 -n 100 192.0.2.1 > /tmp/client.log 2>&1 && break
    sleep 0.1
  done
  wait $server && grep -q "100 iters" /tmp/client.log'

# Two processes over rxe0: an rdkv-server on the verbs fabric, and the rdkv CLI and rdkv-ycsb as
# its clients. Every wait is bounded.
smoke_tests() {
  export LD_LIBRARY_PATH=/host/lib
  smoke=/host/smoke
  config=$smoke/verbs-1node.toml
  # Reserve 2 MiB hugepages, so `hugepages = "auto"` registers the table on them with rxe.
  echo 8 > /proc/sys/vm/nr_hugepages
  "$smoke/rdkv-server" --config "$config" --node 1 > /tmp/rdkv-server.log 2>&1 &
  server=$!
  check "rdkv-server starts on rxe0" sh -c '
    for attempt in $(seq 1 300); do
      grep -q "rdkv-server ready" /tmp/rdkv-server.log && exit 0
      kill -0 '"$server"' 2>/dev/null || break
      sleep 0.1
    done
    cat /tmp/rdkv-server.log; exit 1'
  check "the table is on 2 MiB hugepages, registered with rxe0" \
    grep -q "pinned memory block.*2 MiB hugetlb pages" /tmp/rdkv-server.log
  check "rdkv put/get/cas/del over rxe0" sh -c '
    set -e
    rdkv="'"$smoke"'/rdkv -c '"$config"'"
    $rdkv put greeting "hello over rxe0"
    test "$($rdkv get greeting)" = "hello over rxe0"
    $rdkv cas greeting "hello over rxe0" "swapped"
    test "$($rdkv get greeting)" = "swapped"
    $rdkv del greeting
    if $rdkv get greeting; then echo "deleted key still found"; exit 1; fi
    $rdkv stats'
  check_show "rdkv-cluster status sees the node over rxe0 (a monitoring connection)" sh -c '
    "'"$smoke"'/rdkv-cluster" status "'"$config"'" > /tmp/status.log 2>&1 || { cat /tmp/status.log; exit 1; }
    cat /tmp/status.log
    grep -qE "^ *1 +up" /tmp/status.log'
  check_show "rdkv-ycsb workload A over rxe0 (2000 records, 5 s, at least 100 operations)" sh -c '
    set -e
    ycsb="'"$smoke"'/rdkv-ycsb"
    $ycsb load -c '"$config"' -P workloada -p recordcount=2000 --threads 4 > /tmp/load.log 2>&1 || { cat /tmp/load.log; exit 1; }
    $ycsb run -c '"$config"' -P workloada -p recordcount=2000 -p operationcount=1000000 \
      --max-execution-time 5 --threads 4 > /tmp/run.log 2>&1 || { cat /tmp/run.log; exit 1; }
    grep -E "^\[OVERALL\]|Return=" /tmp/run.log
    if grep -q "Return=ERROR" /tmp/load.log /tmp/run.log; then exit 1; fi
    operations=$(awk -F", " "/^\[(READ|UPDATE)\], Operations,/ { total += \$3 } END { print total + 0 }" /tmp/run.log)
    echo "operations: $operations"
    [ "$operations" -ge 100 ] || { echo "too few operations to count as working: $operations"; exit 1; }'
  if grep -qiE " (ERROR|WARN) " /tmp/rdkv-server.log; then
    grep -iE " (ERROR|WARN) " /tmp/rdkv-server.log | tail -10 | sed 's/^/[guest]   rdkv-server: /'
  fi
  kill -TERM "$server" 2>/dev/null
  # The node bounds its own shutdown at 10 s (plus 1 s for its runtime and 1 s for its log);
  # under TCG a teardown can take seconds, so wait past that bound, and show what it waited for.
  check "rdkv-server stops cleanly on SIGTERM" sh -c '
    for attempt in $(seq 1 200); do
      kill -0 '"$server"' 2>/dev/null || exit 0
      sleep 0.1
    done
    echo "still running after 20 s"; tail -5 /tmp/rdkv-server.log; exit 1'
  # The README's hardware path: the launcher starts the node, the CLI uses it, `down` stops it;
  # this node and its clients busy-poll their CQs (poll_spin = 50us).
  check "rdkv-cluster up --detach / rdkv / rdkv-cluster down on the verbs fabric, poll_spin 50us" sh -c '
    set -e
    cluster="'"$smoke"'/rdkv-cluster"; config="'"$smoke"'/verbs-1node-spin.toml"
    timeout 120 $cluster up --detach --run-dir /tmp/cluster "$config"
    "'"$smoke"'/rdkv" -c "$config" put launched yes
    test "$("'"$smoke"'/rdkv" -c "$config" get launched)" = yes
    timeout 60 $cluster down --run-dir /tmp/cluster "$config"
    if $cluster status "$config" | grep -qE "^ *1 +up"; then echo "still up after down"; exit 1; fi'
}

mkdir -p /host
if mount -t 9p -o trans=virtio,version=9p2000.L host /host 2>/dev/null; then
  for program in /host/programs/*; do
    [ -f "$program" ] || continue
    chmod +x "$program"
    check "$(basename "$program")" env LD_LIBRARY_PATH=/host/lib "$program" --test-threads=1 \
      $(cat /host/test-filter 2>/dev/null)
  done
  if [ -x /host/smoke/rdkv-server ]; then
    smoke_tests
  fi
  if [ -x /host/bench/fabric ] && [ -f /host/smoke/soft-1node.toml ]; then
    /host/smoke/rdkv-server --config /host/smoke/soft-1node.toml --node 1 > /tmp/soft-server.log 2>&1 &
    soft_server=$!
    check_show "rdkv-ycsb workload A over the soft fabric in the same guest (comparison)" sh -c '
      for attempt in $(seq 1 300); do grep -q "rdkv-server ready" /tmp/soft-server.log && break; sleep 0.1; done
      ycsb=/host/smoke/rdkv-ycsb; config=/host/smoke/soft-1node.toml
      $ycsb load -c $config -P workloada -p recordcount=2000 --threads 4 > /tmp/load.log 2>&1 || { cat /tmp/load.log; exit 1; }
      $ycsb run -c $config -P workloada -p recordcount=2000 -p operationcount=1000000 \
        --max-execution-time 2 --threads 4 > /tmp/run.log 2>&1 || { cat /tmp/run.log; exit 1; }
      grep -E "^\[OVERALL\]|Return=|AverageLatency" /tmp/run.log'
    kill -TERM "$soft_server" 2>/dev/null; wait "$soft_server" 2>/dev/null
  fi
  if [ -x /host/bench/fabric ]; then
    SHOW_LINES=60 check_show "fabric benchmark (verbs on rxe0 vs soft, under TCG)" env LD_LIBRARY_PATH=/host/lib \
      /host/bench/fabric --backend verbs --backend soft --seconds "$(cat /host/bench/seconds)"
  fi
else
  report "FAIL mount the shared folder"
fi
report DONE
sync
poweroff -f
