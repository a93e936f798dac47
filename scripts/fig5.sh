#!/usr/bin/env bash
# The DINOMO Fig. 5 experiment, scaled to this machine: fabric round trips per operation, cache
# hit ratios and throughput as KV nodes are added, for DAC, shortcut-only (DINOMO-S) and
# value-only caches, with the KNs' caches together holding about half of the data.
#
# For each KN count and policy: a fresh `dinomo up` (1 shard per KN, 256 KiB log segments so
# that the KNs' unmerged segments hold a small share of the data and reads really go through
# the caches and the DPM's index), `dinomo bench --load`, then the measured workloads. Prints a
# Markdown table (one row per KN count x policy x workload).
#
#   scripts/fig5.sh [options]
#
# Options:
#   --dinomo PATH        the dinomo binary (default target/release/dinomo)
#   --kns LIST           KN counts (default 1,2,4,8)
#   --policies LIST      cache policies (default dac,value-only,shortcut-only)
#   --workloads LIST     measured workloads (default c,b)
#   --records N          keys (default 50000) of --value-size bytes (default 1000)
#   --cache-share F      the KNs' caches together, as a share of the data (default 0.5)
#   --clients N          bench clients (default 8), --outstanding M each (default 4)
#   --warmup S           warm-up seconds per workload (default 2), --duration S measured
#                        seconds (default 8)
#   --port-base N        the cluster's port base (default 20700)
#   --out DIR            logs and JSON summaries (default target/fig5)
#   -h, --help           this text
#
# The monitor runs with a policy that never adds or removes KNs (SLOs out of reach, nothing
# over- or under-utilised), so each row has exactly the KNs it says. RTs/op and the hit ratios
# are the machine-independent figures; throughput on a shared 2-core machine says little about
# scaling (every KN shares the same two cores). Everything started is stopped on exit.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
cd "$root"
usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

dinomo=target/release/dinomo kns_list=1,2,4,8 policies=dac,value-only,shortcut-only
workloads=c,b records=50000 value_size=1000 share=0.5 clients=8 outstanding=4 warmup=2
duration=8 base=20700 out=target/fig5
while [ $# -gt 0 ]; do
  case "$1" in
    --dinomo) dinomo=$2; shift 2 ;;
    --kns) kns_list=$2; shift 2 ;;
    --policies) policies=$2; shift 2 ;;
    --workloads) workloads=$2; shift 2 ;;
    --records) records=$2; shift 2 ;;
    --value-size) value_size=$2; shift 2 ;;
    --cache-share) share=$2; shift 2 ;;
    --clients) clients=$2; shift 2 ;;
    --outstanding) outstanding=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --duration) duration=$2; shift 2 ;;
    --port-base) base=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -x "$dinomo" ] || { echo "no $dinomo: cargo build --release -p dinomo-cli" >&2; exit 2; }

mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
up_pid=""
stop_cluster() {
  if [ -n "$up_pid" ]; then
    kill "$up_pid" 2>/dev/null || true
    wait "$up_pid" 2>/dev/null || true
    up_pid=""
  fi
}
trap 'stop_cluster; rm -rf "$work"' EXIT

# A monitor that never changes membership; KNs that take 16 KiB values at most (a value must
# fit a quarter of a 256 KiB segment).
printf '[policy]\navg_latency_slo_us = 1000000000\ntail_latency_slo_us = 1000000000\nover_utilized = 1.0\nunder_utilized = 0.0\n' \
  >"$work/monitor.toml"
printf 'max_value_bytes = "16KiB"\n' >"$work/kn.toml"
data_bytes=$((records * value_size))

for kns in ${kns_list//,/ }; do
  # Each KN's cache: its share of the data, so that all of them together hold --cache-share.
  cache=$(python3 -c "print(max(64 * 1024, int($data_bytes * $share / $kns)))")
  for policy in ${policies//,/ }; do
    run="kns$kns-$policy"
    echo "== $run: cache $cache bytes per KN" >&2
    rm -rf "$work/data"
    DINOMO_KN_CONFIG="$work/kn.toml" "$dinomo" up --data-dir "$work/data" --kns "$kns" --shards 1 \
      --cache-size "$cache" --cache-policy "$policy" --segment-size 256KiB --pool-size 1GiB \
      --port-base "$base" --monitor-config "$work/monitor.toml" \
      >"$out/$run.up.out" 2>"$out/$run.up.err" &
    up_pid=$!
    for _ in $(seq 1 120); do
      grep -q "routing node" "$out/$run.up.out" 2>/dev/null && break
      sleep 0.5
    done
    grep -q "routing node" "$out/$run.up.out" || { echo "dinomo up failed: $out/$run.up.err" >&2; exit 1; }
    export DINOMO_CREDENTIALS="$work/data/credentials" # made by `up` (TLS by default)
    target="dinomo://127.0.0.1:$((base + 200))"
    common=(--target "$target" --records "$records" --value-size "$value_size" --clients "$clients"
      --outstanding "$outstanding")
    "$dinomo" bench "${common[@]}" --workload load --operations "$records" \
      --json "$out/$run-load.json" >"$out/$run-load.txt" 2>&1
    for wl in ${workloads//,/ }; do
      "$dinomo" bench "${common[@]}" --workload "$wl" --warmup "$warmup" --duration "$duration" \
        --json "$out/$run-$wl.json" >"$out/$run-$wl.txt" 2>&1
    done
    stop_cluster
  done
done

python3 - "$out" "$kns_list" "$policies" "$workloads" <<'EOF'
import json, sys
out, kns, policies, wls = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(","), sys.argv[4].split(",")
print("| KNs | policy | workload | ops/s | RTs/op | value hits | shortcut hits | unmerged hits | misses |")
print("|---|---|---|---|---|---|---|---|---|")
for wl in wls:
    for k in kns:
        for p in policies:
            with open(f"{out}/kns{k}-{p}-{wl}.json") as f:
                s = json.load(f)
            d = s.get("dinomo") or {}
            pct = lambda x: f"{100 * d.get(x, float('nan')):.1f}%"
            print(f"| {k} | {p} | {wl.upper()} | {s['run']['throughput_ops_per_s']:,.0f} | "
                  f"{d.get('rts_per_op', float('nan')):.3f} | {pct('value_hit_ratio')} | "
                  f"{pct('shortcut_hit_ratio')} | {pct('unmerged_hit_ratio')} | {pct('miss_ratio')} |")
EOF
echo "logs and JSON summaries: $out" >&2
