#!/usr/bin/env bash
# Soft-RoCE harness: boots a Linux guest under QEMU (TCG, no network: -nic none), brings up an
# rdma_rxe device over a dummy interface that exists only inside the guest, and runs verbs
# programs there against real ibverbs (rdma-core's rxe provider).
#
#   scripts/softroce/run.sh [--timeout SECONDS] [--no-build] [--fabric-bench SECONDS]
#                           [--filter TEST_NAME] [PROGRAM ...]
#
# First it builds, on the host, with `--features verbs`: the fabric conformance test binary and
# rdkv-server, rdkv and rdkv-ycsb (skip with --no-build). In the guest it then checks that rxe0 is
# PORT_ACTIVE and that `ibv_rc_pingpong` passes over it, runs the conformance suite (soft,
# loopback and verbs on rxe0), and runs two-process smoke tests: rdkv-server on the verbs fabric
# (examples/verbs-1node.toml) with the rdkv CLI and rdkv-ycsb as clients. Each extra PROGRAM (a
# host path, for example another test binary) is run in the guest too. --fabric-bench also runs
# the fabric benchmark (verbs on rxe0 vs soft, SECONDS per scenario) in the guest; under TCG its
# figures compare the two paths on one slow machine, they say nothing about hardware speed.
# --filter runs only the tests whose names contain TEST_NAME (and skips the smoke tests): for
# debugging one check in the guest.
# The kernel and initramfs are cached under $RDKV_SOFTROCE_CACHE (default ~/.cache/rdkv-softroce).
# Prints one PASS/FAIL line per check and a summary; exits non-zero on any failure.
set -euo pipefail

timeout_seconds=240
build=1
bench_seconds=""
test_filter=""
programs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --timeout) timeout_seconds="$2"; shift 2 ;;
    --no-build) build=0; shift ;;
    --fabric-bench) bench_seconds="$2"; shift 2 ;;
    --filter) test_filter="$2"; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) programs+=("$1"); shift ;;
  esac
done

cache="${RDKV_SOFTROCE_CACHE:-$HOME/.cache/rdkv-softroce}"
mkdir -p "$cache"
started=$(date +%s)
say() { printf '[softroce %3ss] %s\n' "$(( $(date +%s) - started ))" "$*"; }

need_packages=()
for tool in qemu-system-x86_64:qemu-system-x86 busybox:busybox-static depmod:kmod cpio:cpio \
            rdma:iproute2 ibv_devinfo:ibverbs-utils ibv_rc_pingpong:ibverbs-utils; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || need_packages+=("${tool##*:}")
done
[ -f /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so ] || need_packages+=(ibverbs-providers rdma-core)
if [ "$build" -eq 1 ]; then
  # sideway builds rdma-core headers with cmake and generates bindings with libclang.
  command -v cmake >/dev/null 2>&1 || need_packages+=(cmake)
  command -v clang >/dev/null 2>&1 || need_packages+=(clang)
  ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1 || need_packages+=(libclang-dev)
fi
if [ ${#need_packages[@]} -gt 0 ]; then
  say "installing ${need_packages[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing packages: apt-get install ${need_packages[*]}" >&2; exit 2
  fi
  timeout 300 apt-get update -qq
  DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq "${need_packages[@]}" >/dev/null
fi

# 1. The guest kernel: Debian's current linux-image, unpacked (never installed on the host).
if [ ! -f "$cache/kernel.version" ]; then
  package=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/{print $2; exit}')
  [ -n "$package" ] || { echo "cannot resolve linux-image-amd64 (run apt-get update)" >&2; exit 2; }
  say "downloading $package"
  rm -rf "$cache/kernel" && mkdir -p "$cache/kernel"
  (cd "$cache" && timeout 300 apt-get download "$package" >/dev/null)
  dpkg-deb -x "$cache/$package"_*.deb "$cache/kernel"
  rm -f "$cache/$package"_*.deb
  version=$(ls "$cache/kernel/lib/modules" | head -1)
  depmod -b "$cache/kernel" "$version"
  echo "$version" > "$cache/kernel.version"
fi
version=$(cat "$cache/kernel.version")
modules="$cache/kernel/lib/modules/$version"

# 2. The initramfs: busybox, the verbs tools with their libraries, the rxe provider, modules.
initramfs="$cache/initramfs-$version.cpio.gz"
# Rebuilt whenever this script or the guest's init changes (by content, not mtime: a cache shared
# between checkouts must not serve a stale init).
stamp=$(cat "$0" "$(dirname "$0")/guest-init.sh" | sha256sum | cut -c1-16)
if [ ! -f "$initramfs" ] || [ "$(cat "$initramfs.stamp" 2>/dev/null)" != "$stamp" ]; then
  say "building the initramfs"
  root=$(mktemp -d)
  trap 'rm -rf "$root"' EXIT
  mkdir -p "$root"/{bin,sbin,etc,proc,sys,dev,tmp,host,lib/modules,usr/lib/x86_64-linux-gnu/libibverbs,etc/libibverbs.d}
  cp /bin/busybox "$root/bin/busybox"
  for applet in sh env mount mkdir ip insmod cat echo grep sleep poweroff sync ls seq timeout test true false kill wait; do
    ln -sf busybox "$root/bin/$applet"
  done
  for program in rdma ibv_devices ibv_devinfo ibv_rc_pingpong; do
    path=$(command -v "$program")
    cp "$path" "$root/bin/"
    ldd "$path" | awk '/=>/ {print $3} /^\t\/lib/ {print $1}' | while read -r library; do
      [ -n "$library" ] && [ -f "$library" ] && mkdir -p "$root$(dirname "$library")" && cp -L "$library" "$root$library"
    done
  done
  provider=/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so
  cp -L "$provider" "$root$provider"
  ldd "$provider" | awk '/=>/ {print $3}' | while read -r library; do
    [ -f "$library" ] && mkdir -p "$root$(dirname "$library")" && cp -L "$library" "$root$library"
  done
  cp /etc/libibverbs.d/rxe.driver "$root/etc/libibverbs.d/"
  # Modules and their dependencies, in load order, from modules.dep.
  : > "$root/modules.order"
  add_module() {
    local name=$1 entry dependency
    entry=$(grep -E "(^|/)$name\.ko(\.xz|\.zst)?:" "$modules/modules.dep" | head -1) || true
    [ -n "$entry" ] || { echo "module $name not found in $version" >&2; exit 2; }
    for dependency in ${entry#*:}; do
      add_module "$(basename "$dependency" | sed -E 's/\.ko(\.xz|\.zst)?$//')"
    done
    local file=${entry%%:*}
    grep -qx "$file" "$root/modules.order" && return 0
    mkdir -p "$root/lib/modules/$(dirname "$file")"
    case "$file" in
      *.xz) xz -dc "$modules/$file" > "$root/lib/modules/${file%.xz}"; file=${file%.xz} ;;
      *.zst) zstd -qdc "$modules/$file" > "$root/lib/modules/${file%.zst}"; file=${file%.zst} ;;
      *) cp "$modules/$file" "$root/lib/modules/$file" ;;
    esac
    echo "$file" >> "$root/modules.order"
  }
  for module in dummy crc32_generic rdma_rxe ib_uverbs rdma_ucm virtio_pci 9pnet_virtio 9p; do
    add_module "$module"
  done
  cp "$(dirname "$0")/guest-init.sh" "$root/init"
  chmod +x "$root/init"
  (cd "$root" && find . | cpio -o -H newc --quiet | gzip -1 > "$initramfs")
  echo "$stamp" > "$initramfs.stamp"
  rm -rf "$root"
  trap - EXIT
fi

# 3. The host build: the conformance suite and the binaries, with the verbs backend.
repository=$(cd "$(dirname "$0")/../.." && pwd)
smoke_binaries=()
if [ "$build" -eq 1 ]; then
  say "building with --features verbs (conformance suite, rdkv-server, rdkv, rdkv-ycsb)"
  (cd "$repository" && timeout 1200 cargo build --quiet --features verbs \
      -p rdkv-server -p rdkv-cli -p rdkv-ycsb -p rdkv-cluster-config --bins)
  conformance=$(cd "$repository" && timeout 1200 cargo test --features verbs \
      -p rdkv-fabric --test conformance --no-run 2>&1 \
      | grep -o 'target/[^ )]*/deps/conformance-[0-9a-f]*' | head -1)
  [ -n "$conformance" ] || { echo "could not build the conformance test binary" >&2; exit 2; }
  programs=("$repository/$conformance" "${programs[@]}")
  smoke_binaries=("$repository/target/debug/rdkv-server" "$repository/target/debug/rdkv" \
                  "$repository/target/debug/rdkv-ycsb" "$repository/target/debug/rdkv-cluster")
  if [ -n "$bench_seconds" ]; then
    bench=$(cd "$repository" && timeout 1200 cargo bench --features verbs -p rdkv-fabric \
        --bench fabric --no-run 2>&1 | grep -o 'target/[^ )]*/deps/fabric-[0-9a-f]*' | head -1)
    [ -n "$bench" ] || { echo "could not build the fabric benchmark" >&2; exit 2; }
  fi
  say "built"
  # On the host (no RDMA device here, normally): the verbs build must fail clearly, not crash.
  if (cd "$repository" && timeout 600 cargo test --quiet --features verbs -p rdkv-server \
        --test binary the_verbs_fabric -- --include-ignored > "$cache/host-check.log" 2>&1); then
    host_result="PASS"
  else
    host_result="FAIL"; cat "$cache/host-check.log"
  fi
  say "$host_result host: rdkv-server --fabric verbs without an RDMA device, or without libibverbs, exits with a clear error"
fi

# 4. The shared folder: the programs to run, the smoke-test binaries, and where results come back.
share=$(mktemp -d)
trap 'rm -rf "$share"' EXIT
mkdir -p "$share/programs" "$share/lib"
[ -z "$test_filter" ] || echo "$test_filter" > "$share/test-filter"
if [ ${#smoke_binaries[@]} -gt 0 ] && [ -z "$test_filter" ]; then
  mkdir -p "$share/smoke"
  cp "${smoke_binaries[@]}" "$share/smoke/"
  # The example node, with deadlines that fit a guest under TCG (about 1,000x slower than the
  # host: a 2 s operation deadline and a 10 s lease time out there when the host is loaded).
  guest_deadlines=(-e 's/^operation_deadline = .*/operation_deadline = "30s"/'
                   -e 's/^lease_timeout = .*/lease_timeout = "120s"/')
  sed "${guest_deadlines[@]}" "$repository/examples/verbs-1node.toml" > "$share/smoke/verbs-1node.toml"
  # The same node with busy-polling completions (the launcher check uses it).
  sed "${guest_deadlines[@]}" -e 's/^fabric = "verbs"/fabric = "verbs"\npoll_spin = "50us"/' \
      "$repository/examples/verbs-1node.toml" > "$share/smoke/verbs-1node-spin.toml"
fi
# A program's shared libraries travel with it (the guest has only what the tools need).
copy_libraries() {
  ldd "$1" 2>/dev/null | awk '/=>/ {print $3}' | while read -r library; do
    [ -f "$library" ] && cp -Ln "$library" "$share/lib/" 2>/dev/null || true
  done
}
for program in "${programs[@]}"; do
  cp "$program" "$share/programs/"
  copy_libraries "$program"
done
for program in "${smoke_binaries[@]}"; do
  copy_libraries "$program"
done
if [ -n "$bench_seconds" ] && [ -n "${bench:-}" ]; then
  mkdir -p "$share/bench"
  cp "$repository/$bench" "$share/bench/fabric"
  echo "$bench_seconds" > "$share/bench/seconds"
  # The same node on the soft fabric, for a side-by-side YCSB run in the same guest.
  sed "${guest_deadlines[@]}" -e 's/^fabric = "verbs"/fabric = "soft"/' \
      -e 's/^device = "rxe0"/fabric_address = "127.0.0.1:7401"/' \
      "$repository/examples/verbs-1node.toml" > "$share/smoke/soft-1node.toml"
  copy_libraries "$repository/$bench"
fi

say "booting the guest (kernel $version, TCG, -nic none)"
set +e
timeout "$timeout_seconds" qemu-system-x86_64 -accel tcg,thread=multi -cpu max -m 1024 -smp 2 \
  -nographic -no-reboot -nic none \
  -kernel "$cache/kernel/boot/vmlinuz-$version" -initrd "$initramfs" \
  -append "console=ttyS0 quiet panic=-1" \
  -virtfs "local,path=$share,mount_tag=host,security_model=none" > "$share/console.log" 2>&1
qemu_status=$?
set -e
cp "$share/console.log" "$cache/last-console.log"
grep -E '^\[guest\]' "$share/console.log" || true
if [ $qemu_status -eq 124 ]; then
  say "FAIL: the guest did not finish within ${timeout_seconds}s"; tail -20 "$share/console.log"; exit 1
fi
passed=$(grep -c '^\[guest\] PASS' "$share/console.log" || true)
failed=$(grep -c '^\[guest\] FAIL' "$share/console.log" || true)
case "${host_result:-}" in
  PASS) passed=$((passed + 1)) ;;
  FAIL) failed=$((failed + 1)) ;;
esac
if ! grep -q '^\[guest\] DONE' "$share/console.log"; then
  say "FAIL: the guest stopped before finishing"; tail -30 "$share/console.log"; exit 1
fi
say "softroce: $passed passed, $failed failed"
[ "$failed" -eq 0 ] && [ "$passed" -gt 0 ]
