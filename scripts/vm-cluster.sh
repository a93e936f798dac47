#!/usr/bin/env bash
# A whole Dinomo cluster on the verbs fabric, for real: boots the Soft-RoCE VM
# (scripts/softroce-vm.sh --devdax: RDMA device rxe0, device-DAX pmem at /dev/dax0.0) once and
# runs in it, with a release build of `dinomo` made with `--features rdma`:
#
#   1. cluster  `dinomo up --fabric verbs --rdma-device rxe0 --kns 2 --pool /dev/dax0.0
#               --format-device` (dpm-node, two KV nodes, routing node, monitor; the monitor's
#               policy set to keep membership fixed), checks from the logs that the DPM serves
#               verbs on rxe0 and that every KN registered on verbs;
#   2. bench    `dinomo bench --load --workload a` against it (load, then YCSB-A; the table
#               includes fabric round trips per operation, RTs/op);
#   3. kn-kill  the KN-kill linearizability tests over verbs (DINOMO_TEST_FABRIC=verbs):
#               e2e::a_kn_killed_under_load_loses_no_acknowledged_write (a KN killed, failed
#               over by a reconfiguration) and
#               monitor::the_monitor_recovers_a_killed_kn_without_losing_acknowledged_writes
#               (the monitor detects and recovers it);
#   4. nemesis  a few bounded nemesis schedules on verbs (DINOMO_NEMESIS_FABRIC=verbs, 6 s of
#               load, at most 3 KN kills each, which the monitor fails over; network cuts need a
#               cgroup2 mount the VM lacks);
#   5. devdax   the device-DAX and verbs-fencing tests: PmRegion on /dev/dax0.0, a DPM pool on
#               it (format only when told, reopen), FenceKn stopping a verbs KN at the device.
#
#   scripts/vm-cluster.sh [options]
#
# Options:
#   --records N      keys loaded before YCSB-A (default 20000: with 1 KiB values, more than a
#                    KN's 8 MiB log segment, so some of the data is merged into the DPM's index
#                    and read through it, and more than the KNs' 1 MiB caches)
#   --operations N   measured YCSB-A operations (default 10000)
#   --clients N      bench clients (default 4)
#   --bench-timeout SEC  stop the benchmark after this long (default 1200) and show the logs
#   --pool KIND      devdax (default: the cluster's pool is /dev/dax0.0) or file (a pool file
#                    on the VM's tmpfs)
#   --only LIST      run only these steps (comma separated: cluster,kn-kill,nemesis,devdax;
#                    bench runs with cluster)
#   --seed N         the first nemesis schedule's seed (default 1)
#   --schedules N    nemesis schedules, seeds SEED.. (default 3)
#   --results FILE   the Markdown summary (default target/vm-cluster/results.md)
#   --no-build       use the binaries already built
#   --timeout SEC    kill the VM after this long (default 5400)
#   -h, --help       this text
#
# The VM emulates its CPUs (TCG, 2 vCPUs): everything runs 10-50 times slower than on the host,
# so throughput and latency are only good for comparing runs of this script; RTs/op is the
# machine-independent figure. The whole run takes about 20-40 minutes once built. Output: the
# console (everything), target/vm-cluster/console.log and the results file. Exit status: 0 if
# every step passed.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
cd "$root"

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

records=20000 operations=10000 clients=4 pool=devdax only=cluster,kn-kill,nemesis,devdax seed=1
results=target/vm-cluster/results.md build=1 timeout_s=5400 bench_timeout=1200 schedules=3
while [ $# -gt 0 ]; do
  case "$1" in
    --records) records=$2; shift 2 ;;
    --operations) operations=$2; shift 2 ;;
    --clients) clients=$2; shift 2 ;;
    --bench-timeout) bench_timeout=$2; shift 2 ;;
    --pool) pool=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    --schedules) schedules=$2; shift 2 ;;
    --results) results=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    --timeout) timeout_s=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "vm-cluster: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done
case "$pool" in devdax|file) ;; *) echo "vm-cluster: --pool devdax|file" >&2; exit 2 ;; esac

log() { echo "vm-cluster: $*" >&2; }
out=target/vm-cluster
mkdir -p "$out"

# --- Build (release, rdma) and find the test executables --------------------------------------
if [ "$build" = 1 ]; then
  log "building: cargo build --release -p dinomo-cli --features rdma (and the test binaries)"
  cargo build --release -p dinomo-cli --features rdma
fi
# Prints the test executable of `cargo test ARGS --no-run` (built now if needed).
test_exe() {
  cargo test --release "$@" --no-run --message-format=json-render-diagnostics |
    sed -E -n 's/.*"profile":\{[^}]*"test":true\}.*"executable":"([^"]+)".*/\1/p' | tail -1
}
dinomo=$root/target/release/dinomo
cli_it=$(test_exe -p dinomo-cli --features rdma --test integration)
dpm_it=$(test_exe -p dinomo-dpm-node --features rdma --test integration)
fabric_lib=$(test_exe -p dinomo-fabric --features rdma --lib)
for f in "$dinomo" "$cli_it" "$dpm_it" "$fabric_lib"; do
  [ -n "$f" ] && [ -x "$f" ] || { log "missing executable '$f' (build failed?)"; exit 1; }
done

# --- The script the VM runs ---------------------------------------------------------------------
work=$(mktemp -d "${TMPDIR:-/tmp}/vm-cluster.XXXXXX")
trap 'rm -rf "$work"' EXIT
chmod 755 "$work"
inner=$work/inner.sh
if [ "$pool" = devdax ]; then pool_path=/dev/dax0.0; else pool_path=/run/tmp/cluster/dinomo.pool; fi
cat >"$inner" <<EOF
#!/bin/sh
# Generated by scripts/vm-cluster.sh; runs inside the VM.
DINOMO=$dinomo CLI_IT=$cli_it DPM_IT=$dpm_it FABRIC_LIB=$fabric_lib
RECORDS=$records OPERATIONS=$operations CLIENTS=$clients POOL=$pool_path ONLY=,$only, SEED=$seed
BENCH_TIMEOUT=$bench_timeout SCHEDULES=$schedules
EOF
cat >>"$inner" <<'EOF'
export RUST_BACKTRACE=1 DINOMO_LOG=info
fails=0
want() { case "$ONLY" in *",$1,"*) return 0 ;; esac; return 1; }
begin() { echo "VMCLUSTER-BEGIN $1"; t0=$(date +%s); }
end() { echo "VMCLUSTER-END $1 rc=$2 secs=$(($(date +%s) - t0))"; [ "$2" = 0 ] || fails=$((fails + 1)); }
echo "VMCLUSTER-INFO kernel=$(uname -r) cpus=$(nproc) mem_mb=$(free -m | awk '/Mem:/ {print $2}') rdma=$(ls /sys/class/infiniband | tr '\n' ' ')"
[ -c /dev/dax0.0 ] && echo "VMCLUSTER-INFO /dev/dax0.0 size=$(cat /sys/bus/dax/devices/dax0.0/size) align=$(cat /sys/bus/dax/devices/dax0.0/align)"

if want cluster; then
  begin cluster
  D=/run/tmp/cluster
  mkdir -p $D
  # Membership stays as started: under emulation every latency is far above the default SLOs,
  # and the policy would scale the cluster while it is measured.
  # Failure detection is slow too: under TCG a loaded KN can miss probes for seconds, and a
  # false failover in the middle of the benchmark would measure recovery, not the fabric.
  printf '[policy]\navg_latency_slo_us = 1000000000\ntail_latency_slo_us = 1000000000\nover_utilized = 1.0\nunder_utilized = 0.0\n[failure]\nprobe_every_ms = 500\nfailed_after_ms = 30000\n' >$D/monitor.toml
  $DINOMO up --data-dir $D --fabric verbs --rdma-device rxe0 --kns 2 --shards 1 \
    --cache-size 1MiB --pool-size 200MiB --pool $POOL --format-device \
    --monitor-config $D/monitor.toml >$D/up.out 2>$D/up.err &
  up=$!
  rc=1
  for i in $(seq 1 600); do
    if grep -q 'Press Ctrl-C' $D/up.out 2>/dev/null; then rc=0; break; fi
    kill -0 $up 2>/dev/null || break
    sleep 1
  done
  cat $D/up.out
  if [ $rc = 0 ]; then
    # The DPM serves verbs on rxe0 from the pool asked for, and every KN registered on verbs.
    grep -h -o 'fabric: verbs.*' $D/logs/dpm-node.log | head -1
    grep -h -o 'pool open.*' $D/logs/dpm-node.log | head -1
    grep -q 'fabric: verbs' $D/logs/dpm-node.log || rc=2
    for k in 1 2; do
      l=$(grep -h 'registered with the DPM' $D/logs/kn-$k.log | tail -1)
      echo "kn-$k: $l"
      echo "$l" | grep -q FABRIC_KIND_VERBS || rc=3
    done
  else
    echo "dinomo up did not come up:"; tail -30 $D/up.err
    for f in $D/logs/*.log; do echo "--- $f"; tail -15 $f; done
  fi
  end cluster $rc
  if [ $rc = 0 ]; then
    begin bench
    DINOMO_CREDENTIALS=$D/credentials timeout -k 10 $BENCH_TIMEOUT $DINOMO bench --target dinomo://127.0.0.1:7900 --load \
      --records $RECORDS --workload a --operations $OPERATIONS --clients $CLIENTS \
      --value-size 1000 >$D/bench.out 2>&1
    rc=$?
    cat $D/bench.out
    if [ $rc != 0 ]; then
      echo "bench failed (rc=$rc); the nodes' last words:"
      for f in $D/logs/*.log; do echo "--- $f"; tail -25 $f | cut -c1-300; done
    fi
    # The KNs wrote through verbs the whole time: no session lost, no fabric errors.
    grep -h -c 'DPM session lost' $D/logs/kn-*.log | paste -sd' ' | sed 's/^/sessions lost per KN: /'
    end bench $rc
  fi
  kill -TERM $up 2>/dev/null; wait $up
  echo "dinomo up exited with $?"
fi

if want kn-kill; then
  for t in e2e::a_kn_killed_under_load_loses_no_acknowledged_write \
           monitor::the_monitor_recovers_a_killed_kn_without_losing_acknowledged_writes; do
    begin "kn-kill $t"
    DINOMO_TEST_FABRIC=verbs timeout -k 10 900 $CLI_IT --exact $t --nocapture --test-threads 1
    end "kn-kill $t" $?
  done
fi

if want nemesis; then
  begin nemesis
  DINOMO_NEMESIS_FABRIC=verbs DINOMO_NEMESIS_KINDS=kill-kn DINOMO_NEMESIS_SEED=$SEED \
    DINOMO_NEMESIS_SCHEDULES=$SCHEDULES DINOMO_NEMESIS_SECONDS=6 DINOMO_NEMESIS_FAULTS=3 \
    DINOMO_NEMESIS_CLIENTS=2 timeout -k 10 1200 $CLI_IT nemesis --nocapture --test-threads 1
  end nemesis $?
fi

if want devdax; then
  begin devdax
  rc=0
  if [ -c /dev/dax0.0 ]; then
    export DINOMO_DAX_DEVICE=/dev/dax0.0
    timeout -k 10 600 $FABRIC_LIB pm::tests::device_dax_region_when_there_is_one --exact --nocapture || rc=1
    timeout -k 10 600 $DPM_IT dax::dpm_on_device_dax_formats_only_when_told_and_reopens --exact --nocapture || rc=1
  else
    echo "no /dev/dax0.0 in this VM"; rc=1
  fi
  timeout -k 10 600 $DPM_IT verbs:: --nocapture || rc=1
  end devdax $rc
fi
exit $fails
EOF
chmod 755 "$inner"

# --- Run ------------------------------------------------------------------------------------------
console=$out/console.log
log "booting the VM (pool: $pool_path; steps: $only)"
set +e
"$here/softroce-vm.sh" --devdax --pmem 256 --mem 2048 --timeout "$timeout_s" -- /bin/sh "$inner" 2>&1 |
  tee "$console"
vm_rc=${PIPESTATUS[0]}

# --- Results (errexit stays off: a step that did not run has no lines to find) ------------------
section() { # the console lines between the markers of step $1
  awk -v b="VMCLUSTER-BEGIN $1" -v e="VMCLUSTER-END $1 " '
    $0 == b {on = 1; next} index($0, e) == 1 {on = 0} on' "$console"
}
status() { grep -a -o "VMCLUSTER-END $1 rc=[0-9]* secs=[0-9]*" "$console" | tail -1 | sed 's/.* rc=/rc=/'; }
mkdir -p "$(dirname "$results")"
{
  echo "# Dinomo on the verbs fabric in the Soft-RoCE VM"
  echo
  echo "Run by \`scripts/vm-cluster.sh\` on $(date -u '+%Y-%m-%d %H:%M UTC') at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "(plus uncommitted changes, if any); pool: $pool_path; steps: $only."
  echo
  sed -n 's/^VMCLUSTER-INFO /- /p' "$console"
  ran() { grep -a -q "VMCLUSTER-BEGIN $1\$" "$console"; }
  for s in cluster bench; do
    ran "$s" || continue
    echo; echo "## $s ($(status "$s"))"; echo; echo '```text'; section "$s"; echo '```'
  done
  for t in e2e::a_kn_killed_under_load_loses_no_acknowledged_write \
           monitor::the_monitor_recovers_a_killed_kn_without_losing_acknowledged_writes; do
    ran "kn-kill $t" || continue
    echo; echo "## kn-kill $t ($(status "kn-kill $t"))"; echo; echo '```text'
    section "kn-kill $t" | grep -a -E 'linearizable|failover|recovery|ops [0-9]|test result|panicked|NOT' | cut -c1-400
    echo '```'
  done
  if ran nemesis; then
    echo; echo "## nemesis ($(status nemesis))"; echo; echo '```text'
    section nemesis | grep -a -E '^NEMESIS|^nemesis|test result|panicked' | cut -c1-600
    echo '```'
  fi
  if ran devdax; then
    echo; echo "## devdax ($(status devdax))"; echo; echo '```text'
    section devdax | grep -a -E '^test |SKIPPED|device-DAX|dpm on|verbs:|test result|panicked' | cut -c1-400
    echo '```'
  fi
} >"$results"
log "results: $results (console: $console)"
[ "$vm_rc" = 0 ]
