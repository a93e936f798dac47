#!/usr/bin/env bash
# Runs one command inside a small QEMU VM (software emulation, TCG) that boots Debian's own
# kernel, with a Soft-RoCE RDMA device (rxe0) and, with --dax, a DAX-mounted emulated pmem device
# at /run/pm. The host's root is shared read-only over 9p and the command runs chrooted into it,
# so binaries built on the host (cargo test executables) run unchanged. Exits with the command's
# exit status.
#
#   scripts/softroce-vm.sh [options] -- COMMAND [ARG...]
#
# Options:
#   --dax            emulate a pmem device (memmap=SIZE!OFFSET), mkfs.ext4 it, mount -o dax at
#                    /run/pm; and mount an ext4 without DAX (a loop device) at /run/ext4
#   --devdax         emulate the pmem device but configure it as device-DAX: /dev/dax0.0 (no
#                    filesystem; needs ndctl, which the script installs)
#   --pmem MB        size of the pmem device with --dax or --devdax (default 256)
#   --mem MB         guest memory (default 2048)
#   --smp N          guest CPUs (default 2)
#   --timeout SEC    kill the VM after this long (default 900); exit status 124 then
#   --env NAME=VAL   export NAME=VAL to the command (repeatable)
#   -h, --help       this text
#
# Inside the VM: TMPDIR=/run/tmp and /dev/shm (writable tmpfs; everything else is the host's
# root, read only), DINOMO_VM=1, RDMA device rxe0 on eth0 (10.0.2.15/24), the working directory is the
# caller's, with --dax /run/pm is ext4 -o dax on /dev/pmem0 (MAP_SYNC works) and /run/ext4 is
# a 256 MiB ext4 without DAX on a loop device (an ordinary disk's page cache), with --devdax
# /dev/dax0.0 is a device-DAX character device (mmap it in 2 MiB multiples). RDMA memory
# registration works on device-DAX mappings but not on fsdax files (long-term pins of fsdax
# pages are refused with EOPNOTSUPP on 6.1; from 6.5, pins for writing of page-cache file
# pages, as on /run/ext4, are refused too, with EFAULT).
# SOFTROCE_VM_KERNEL=<package> boots another kernel apt can download, e.g. bookworm-backports'
# linux-image-6.12.95+deb12-amd64 (add bookworm-backports to apt's sources first).
#
# Everything comes from Debian: the kernel is the one linux-image-amd64 depends on (it has
# rdma_rxe and nd_pmem as modules), fetched with apt-get download and unpacked into the cache
# ${SOFTROCE_VM_CACHE:-$HOME/.cache/softroce-vm}; the initramfs is busybox plus the modules. The
# script installs the Debian packages it needs (as root, or through sudo). KVM is not used: it
# hangs at boot on the machines this was written on, and TCG boots in about 10 s.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

dax=0 mem=2048 pmem=256 smp=2 timeout_s=900
envs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dax) dax=1; shift ;;
    --devdax) dax=2; shift ;;
    --pmem) pmem=$2; shift 2 ;;
    --mem) mem=$2; shift 2 ;;
    --smp) smp=$2; shift 2 ;;
    --timeout) timeout_s=$2; shift 2 ;;
    --env) envs+=("$2"); shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    -*) echo "softroce-vm: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { usage >&2; exit 2; }
if [ "$dax" != 0 ] && [ $((pmem + 512)) -gt "$mem" ]; then
  echo "softroce-vm: --pmem $pmem needs --mem of at least $((pmem + 512))" >&2
  exit 2
fi

log() { echo "softroce-vm: $*" >&2; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"
  elif command -v sudo >/dev/null; then sudo "$@"
  else log "need root (or sudo) to run: $*"; exit 1
  fi
}

# --- Debian packages -------------------------------------------------------------------------
need=()
for p in qemu-system-x86 busybox-static cpio kmod xz-utils zstd rdma-core ibverbs-utils \
         ibverbs-providers e2fsprogs iproute2 $([ "$dax" = 2 ] && echo ndctl); do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

cache=${SOFTROCE_VM_CACHE:-$HOME/.cache/softroce-vm}
mkdir -p "$cache"

# --- Kernel ----------------------------------------------------------------------------------
kernel_pkg() { apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}'; }
# SOFTROCE_VM_KERNEL names another kernel package (one apt can download: e.g. a backports
# kernel, to run the tests against a newer kernel's rules on pinning).
kpkg=${SOFTROCE_VM_KERNEL:-$(kernel_pkg)}
if [ -z "$kpkg" ]; then
  as_root apt-get update -qq
  kpkg=$(kernel_pkg)
fi
[ -n "$kpkg" ] || { log "cannot find the kernel package linux-image-amd64 depends on"; exit 1; }
kver=${kpkg#linux-image-}
kroot=$cache/$kver
if [ ! -f "$kroot/root/boot/vmlinuz-$kver" ]; then
  log "fetching $kpkg"
  rm -rf "$kroot" && mkdir -p "$kroot/root"
  # apt-get download drops privileges to _apt, which must be able to write here.
  chmod 777 "$kroot"
  (cd "$kroot" && apt-get download -qq "$kpkg" && dpkg-deb -x ./*.deb root && rm -f ./*.deb)
  depmod -b "$kroot/root" "$kver"
fi

# --- Initramfs: busybox, modules, and an init that sets up rxe0 (and pmem) --------------------
mods="crc32_generic crc32c_generic virtio_pci virtio_net 9p 9pnet_virtio rdma_rxe ib_uverbs nd_pmem nd_e820 ext4 dax_pmem device_dax loop"
read -r -d '' INIT <<'INIT' || true
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for ko in $(cat /mods/order); do insmod /mods/$ko 2>/dev/null; done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=262144 hostroot /host
mount -t proc proc /host/proc; mount -t sysfs sys /host/sys; mount -t devtmpfs dev /host/dev
mount -t tmpfs tmp /host/run; mkdir -p /host/run/tmp; chmod 1777 /host/run/tmp
mkdir -p /host/dev/shm; mount -t tmpfs -o mode=1777 shm /host/dev/shm
ip link set lo up; ip link set eth0 up; ip addr add 10.0.2.15/24 dev eth0
if ! chroot /host /usr/bin/rdma link add rxe0 type rxe netdev eth0; then
  echo "softroce-vm(guest): could not add rxe0"; dmesg | tail -20
fi
cmdline=$(cat /proc/cmdline)
runfile=${cmdline##*softroce_run=}; runfile=${runfile%% *}
if echo "$cmdline" | grep -q softroce_dax=2; then
  if chroot /host /usr/bin/ndctl create-namespace -f -e namespace0.0 -m devdax >/dev/null; then
    chmod 666 /dev/dax0.0
  else
    echo "softroce-vm(guest): could not set up device-DAX at /dev/dax0.0"; dmesg | grep -i -E 'pmem|nd_|dax' | tail -20
  fi
elif echo "$cmdline" | grep -q softroce_dax=1; then
  if [ -b /dev/pmem0 ] && chroot /host /sbin/mkfs.ext4 -q -F -b 4096 /dev/pmem0 \
     && mkdir -p /host/run/pm && mount -t ext4 -o dax /dev/pmem0 /host/run/pm; then
    chmod 1777 /host/run/pm
  else
    echo "softroce-vm(guest): could not set up DAX pmem at /run/pm"; dmesg | grep -i -E 'pmem|nd_|dax' | tail -20
  fi
  # Beside it, an ordinary disk filesystem (ext4 in the page cache, on a loop device): the
  # kind whose file pages kernels from 6.5 on do not let RDMA pin for writing.
  if chroot /host /sbin/mkfs.ext4 -q -F /run/ext4.img 256M \
     && mkdir -p /host/run/ext4 && mount -t ext4 -o loop /host/run/ext4.img /host/run/ext4; then
    chmod 1777 /host/run/ext4
  else
    echo "softroce-vm(guest): could not set up the page-cache ext4 at /run/ext4"; dmesg | tail -5
  fi
fi
chroot /host /usr/bin/env TMPDIR=/run/tmp DINOMO_VM=1 /bin/sh "$runfile"
echo "SOFTROCE-VM-EXIT=$?"
poweroff -f
INIT
recipe=$(printf 'recipe 2\n%s\n%s\n' "$mods" "$INIT" | sha256sum | cut -c1-12)
initrd=$kroot/initrd-$recipe.gz
if [ ! -f "$initrd" ]; then
  log "building the initramfs ($recipe)"
  ird=$(mktemp -d "$kroot/initrd.XXXXXX")
  mkdir -p "$ird"/{bin,dev,proc,sys,host,mods}
  cp /bin/busybox "$ird/bin/busybox"
  order=$ird/mods/order && : >"$order"
  # The host's /etc/modprobe.d must not leak in: ndctl's nvdimm-security.conf, for one, turns
  # libnvdimm into an `install` command, and --show-depends would then drop it.
  noconf=$(mktemp -d)
  for m in $mods; do
    modprobe -C "$noconf" --ignore-install -d "$kroot/root" -S "$kver" --show-depends "$m" |
      awk '$1 == "insmod" {print $2}'
  done | awk '!seen[$0]++' | while read -r ko; do
    base=$(basename "$ko"); base=${base%.xz}; base=${base%.zst}
    case "$ko" in
      *.xz) xz -dc "$ko" >"$ird/mods/$base" ;;
      *.zst) zstd -qdc "$ko" >"$ird/mods/$base" ;;
      *) cp "$ko" "$ird/mods/$base" ;;
    esac
    echo "$base" >>"$order"
  done
  rmdir "$noconf"
  # A module built into this kernel (virtio_pci from 6.12 on) needs no file.
  builtin=$kroot/root/lib/modules/$kver/modules.builtin
  for m in $mods libnvdimm; do
    grep -q -x "$m.ko" "$order" || grep -q "/$m.ko\$" "$builtin" 2>/dev/null ||
      { log "module $m is missing from the initramfs"; exit 1; }
  done
  printf '%s\n' "$INIT" >"$ird/init" && chmod +x "$ird/init"
  (cd "$ird" && find . | cpio -o -H newc 2>/dev/null | gzip -1 >"$initrd.tmp") && mv "$initrd.tmp" "$initrd"
  rm -rf "$ird"
  # Initramfs images of older recipes are never used again.
  find "$kroot" -maxdepth 1 -name 'initrd-*.gz' ! -name "initrd-$recipe.gz" -delete
fi

# --- Run ---------------------------------------------------------------------------------------
# The command goes in a file on the host's filesystem, which the guest sees at the same path.
run=$(mktemp "$cache/run.XXXXXX.sh")
out=$(mktemp "$cache/console.XXXXXX.log")
trap 'rm -f "$run"; [ -n "${SOFTROCE_VM_KEEP_CONSOLE:-}" ] || rm -f "$out"' EXIT
{
  echo "cd $(printf '%q' "$PWD") || exit 97"
  for kv in ${envs[@]+"${envs[@]}"}; do echo "export $(printf '%q' "$kv")"; done
  printf '%q ' "$@"; echo
} >"$run"
chmod 644 "$run"
append="console=ttyS0 quiet panic=-1 softroce_run=$run softroce_dax=$dax"
# The pmem sits in the upper half of guest memory.
[ "$dax" != 0 ] && append="$append memmap=${pmem}M!$((mem / 2))M"

# The firmware's banner and the command's first line can share a console line, separated only
# by a terminal reset (ESC c): split there, so the filter never eats the command's output.
set +e
timeout -k 10 "$timeout_s" \
  qemu-system-x86_64 -accel tcg -cpu max -m "$mem" -smp "$smp" -nographic -no-reboot \
    -kernel "$kroot/root/boot/vmlinuz-$kver" -initrd "$initrd" -append "$append" \
    -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
    -netdev user,id=n0 -device virtio-net-pci,netdev=n0 </dev/null \
  | tee "$out" \
  | sed -u -e 's/\x1bc/\n/g' -e 's/\x1b\[[0-9;?]*[A-Za-z]//g' -e 's/\r$//' \
  | grep -a --line-buffered -v -E '^\s*$|SeaBIOS|iPXE|Booting from|reboot: Power down'
qemu_status=${PIPESTATUS[0]}
set -e
code=$(grep -a -o 'SOFTROCE-VM-EXIT=[0-9]*' "$out" | tail -1 | cut -d= -f2)
if [ -z "$code" ]; then
  if [ "$qemu_status" = 124 ]; then
    log "the VM did not finish within ${timeout_s}s and was killed"
    exit 124
  fi
  log "the VM did not report an exit status (qemu exited with $qemu_status); console tail:"
  tail -n 30 "$out" >&2
  exit 98
fi
exit "$code"
