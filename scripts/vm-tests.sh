#!/usr/bin/env bash
# The tests that need real RDMA and real DAX, run for real: builds test binaries on the host,
# boots the Soft-RoCE VM (scripts/softroce-vm.sh --dax) once, runs them all inside it, prints a
# summary and exits non-zero if anything failed. This is the one entry point CI calls.
#
#   scripts/vm-tests.sh [--release] [--only] [SPEC...]
#
# With no SPEC it runs the fabric set:
#   dinomo-fabric+rdma:lib          the crate's unit tests
#   dinomo-fabric+rdma:conformance  the conformance suite over shm and tcp (on the VM's kernel)
#   dinomo-fabric+rdma:verbs        the suite over verbs on rxe0, and the DAX tests on /run/pm
# Extra SPECs (arguments, or the space-separated list in $VM_TESTS_EXTRA) run after the fabric
# set; --only runs just the given SPECs.
#
# SPEC is PACKAGE[+FEATURE,...]:TARGET[:ARGS]
#   PACKAGE  a workspace package (cargo -p)
#   FEATURE  cargo features to build it with (comma separated)
#   TARGET   `lib` (the library's unit tests), `bin:NAME` (a binary's unit tests) or the name of
#            an integration test (tests/NAME.rs)
#   ARGS     arguments for the test binary, space separated (a name filter, --exact, --skip X)
# e.g. to add the dpm-node's DAX tests (tests/dax.rs) and one unit test of its library:
#   scripts/vm-tests.sh dinomo-dpm-node:dax 'dinomo-dpm-node:lib:pool::tests::reopen --exact'
#
# Inside the VM every binary runs with --nocapture and TMPDIR=/run/tmp, DINOMO_VM=1,
# DINOMO_VM_TESTS=1, DINOMO_PM_DIR=/run/pm (ext4 with DAX) and DINOMO_PAGE_CACHE_DIR=/run/ext4
# (ext4 without) set. Tests that need the VM should skip (printing why) when those are
# absent, and fail when DINOMO_VM=1 but the device or directory is missing (fabric/tests/verbs.rs
# shows the pattern). Environment: VM_TESTS_TIMEOUT (seconds per binary, default 300),
# SOFTROCE_VM_CACHE (the VM's cache) and SOFTROCE_VM_KERNEL (another kernel): see softroce-vm.sh.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
cd "$root"

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

release=0 only=0
specs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --release) release=1; shift ;;
    --only) only=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; specs+=("$@"); break ;;
    -*) echo "vm-tests: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) specs+=("$1"); shift ;;
  esac
done
# shellcheck disable=SC2206 # word splitting of the list is intended
[ -n "${VM_TESTS_EXTRA:-}" ] && specs+=(${VM_TESTS_EXTRA})
default=(dinomo-fabric+rdma:lib dinomo-fabric+rdma:conformance dinomo-fabric+rdma:verbs)
if [ "$only" = 0 ]; then specs=("${default[@]}" ${specs[@]+"${specs[@]}"}); fi
[ ${#specs[@]} -gt 0 ] || { echo "vm-tests: --only needs at least one SPEC" >&2; exit 2; }

t0=$(date +%s)
log() { echo "vm-tests: $*" >&2; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"
  elif command -v sudo >/dev/null; then sudo "$@"
  else log "need root (or sudo) to run: $*"; exit 1
  fi
}

# --- Build dependencies (sideway's rdma-mummy-sys runs cmake and bindgen) ---------------------
need=()
for p in libibverbs-dev librdmacm-dev libclang-dev pkg-config cmake; do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
command -v cc >/dev/null && command -v c++ >/dev/null || need+=(build-essential)
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
command -v cargo >/dev/null || { log "cargo is not on PATH (install a Rust toolchain first)"; exit 1; }

# --- Build the test binaries on the host ------------------------------------------------------
work=$(mktemp -d "${TMPDIR:-/tmp}/vm-tests.XXXXXX")
trap 'rm -rf "$work"' EXIT
declare -A exe=()   # "PACKAGE+FEATURES|TARGET" -> executable
declare -A built=() # "PACKAGE+FEATURES" -> 1
profile_args=()
[ "$release" = 1 ] && profile_args=(--release)

for spec in "${specs[@]}"; do
  unit=${spec%%:*}
  rest=${spec#*:}
  if [ "$unit" = "$spec" ] || [ -z "$rest" ]; then
    log "bad SPEC '$spec' (want PACKAGE[+FEATURES]:TARGET[:ARGS])"
    exit 2
  fi
  [ -z "${built[$unit]:-}" ] || continue
  pkg=${unit%%+*}
  feat_args=()
  [ "$unit" != "$pkg" ] && feat_args=(--features "${unit#*+}")
  log "building $unit: cargo test -p $pkg ${feat_args[*]} ${profile_args[*]} --no-run"
  json=$work/build-${#built[@]}.json
  if ! cargo test -p "$pkg" ${feat_args[@]+"${feat_args[@]}"} ${profile_args[@]+"${profile_args[@]}"} \
      --no-run --message-format=json-render-diagnostics >"$json"; then
    log "the build of $unit failed"
    exit 1
  fi
  # One line per test executable: KIND NAME PATH.
  while read -r kind name path; do
    case "$kind" in
      lib) key=lib ;;
      bin) key=bin:$name ;;
      *) key=$name ;;
    esac
    exe["$unit|$key"]=$path
  done < <(sed -E -n 's/.*"target":\{"kind":\["([a-z-]+)"[^}]*"name":"([^"]+)"[^}]*\},"profile":\{[^}]*"test":true\}.*"executable":"([^"]+)".*/\1 \2 \3/p' "$json")
  built[$unit]=1
done
t_build=$(date +%s)

# --- The script the VM runs --------------------------------------------------------------------
inner=$work/inner.sh
cat >"$inner" <<'EOF'
#!/bin/sh
export DINOMO_VM_TESTS=1 DINOMO_PM_DIR=/run/pm DINOMO_PAGE_CACHE_DIR=/run/ext4 RUST_BACKTRACE=1
fails=0
echo "VMTEST-INFO kernel=$(uname -r) cpus=$(nproc) rdma=$(ls /sys/class/infiniband 2>/dev/null | tr '\n' ' ')"
mount | grep -q " /run/pm .*dax" || echo "VMTEST-INFO no DAX mount at /run/pm"
mount | grep -q " /run/ext4 " || echo "VMTEST-INFO no page-cache ext4 at /run/ext4"
EOF
i=0
for spec in "${specs[@]}"; do
  unit=${spec%%:*}
  rest=${spec#*:}
  target=${rest%%:*}
  args=""
  [ "$rest" != "$target" ] && args=${rest#*:}
  # bin targets have a colon in them: bin:NAME[:ARGS]
  if [ "$target" = bin ]; then
    name=${rest#bin:}; target=bin:${name%%:*}
    args=""; [ "$name" != "${name%%:*}" ] && args=${name#*:}
  fi
  path=${exe["$unit|$target"]:-}
  if [ -z "$path" ]; then
    echo "echo 'VMTEST-END $i rc=127 secs=0'" >>"$inner"
    echo "echo 'vm-tests: no test executable for $unit target $target'; fails=\$((fails + 1))" >>"$inner"
  else
    cat >>"$inner" <<EOF
echo "VMTEST-BEGIN $i"
s=\$(date +%s)
timeout -k 5 ${VM_TESTS_TIMEOUT:-300} $(printf '%q' "$path") --nocapture $args
rc=\$?
echo "VMTEST-END $i rc=\$rc secs=\$((\$(date +%s) - s))"
[ \$rc = 0 ] || fails=\$((fails + 1))
EOF
  fi
  i=$((i + 1))
done
# shellcheck disable=SC2016 # expanded by the guest
echo 'exit $fails' >>"$inner"
chmod 755 "$inner" "$work"

# --- Boot the VM once and run everything ------------------------------------------------------
console=$work/console.log
log "booting the VM (${#specs[@]} test binaries)"
set +e
"$here/softroce-vm.sh" --dax --timeout 900 -- /bin/sh "$inner" 2>&1 | tee "$console"
vm_rc=${PIPESTATUS[0]}
set -e
t_end=$(date +%s)

# --- Summary -----------------------------------------------------------------------------------
echo
echo "==================== vm-tests summary ===================="
sed -n 's/^VMTEST-INFO /  /p' "$console"
failed=0
i=0
for spec in "${specs[@]}"; do
  end=$(grep -a -o "VMTEST-END $i rc=[0-9]* secs=[0-9]*" "$console" | tail -1 || true)
  # The "test result:" lines between this binary's BEGIN and END markers.
  counts=$(awk -v b="VMTEST-BEGIN $i" -v e="VMTEST-END $i " '
      index($0, b) == 1 {on = 1; next} index($0, e) == 1 {on = 0}
      on && match($0, /[0-9]+ passed; [0-9]+ failed; [0-9]+ ignored/) {
        s = substr($0, RSTART, RLENGTH); gsub(/;/, ",", s); print s}' "$console" | paste -sd'+' -)
  if [ -z "$end" ]; then
    status=FAIL; detail="did not finish (the VM stopped first)"
  else
    rc=${end#*rc=}; rc=${rc%% *}; secs=${end##*secs=}
    if [ "$rc" = 0 ]; then status=PASS; else status=FAIL; fi
    case "$rc" in
      0) detail="${counts:-no test result line} (${secs}s)" ;;
      124) detail="timed out after ${secs}s; ${counts}" ;;
      127) detail="no such test executable (check the SPEC)" ;;
      *) detail="exit status $rc; ${counts:-no test result line} (${secs}s)" ;;
    esac
  fi
  [ "$status" = PASS ] || failed=$((failed + 1))
  printf '  %-4s  %-40s %s\n' "$status" "$spec" "$detail"
  i=$((i + 1))
done
notes=$(grep -a -o -E '(PROBE|SKIPPED): .*' "$console" | sort -u || true)
if [ -n "$notes" ]; then
  echo "  notes:"
  while IFS= read -r l; do echo "    $l"; done <<<"$notes"
fi
echo "  time: build $((t_build - t0))s, VM $((t_end - t_build))s, total $((t_end - t0))s"
if [ "$failed" = 0 ] && [ "$vm_rc" = 0 ]; then
  echo "  RESULT: PASS (${#specs[@]} test binaries)"
  exit 0
fi
echo "  RESULT: FAIL ($failed of ${#specs[@]} test binaries failed; the VM run exited with $vm_rc)"
exit 1
