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

mkdir -p /host
if mount -t 9p -o trans=virtio,version=9p2000.L host /host 2>/dev/null; then
  for program in /host/programs/*; do
    [ -f "$program" ] || continue
    chmod +x "$program"
    check "$(basename "$program")" env LD_LIBRARY_PATH=/host/lib "$program" --test-threads=1
  done
else
  report "FAIL mount the shared folder"
fi
report DONE
sync
poweroff -f
