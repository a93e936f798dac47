#!/usr/bin/env bash
# What mutual TLS costs: two `dinomo up` clusters side by side on this machine, one with TLS
# (the default) and one with --insecure, and `dinomo bench` runs alternating between them (TLS,
# plain, TLS, plain, ...) so that both see the same machine. Prints, per workload, the median
# ops/s of each, their ratio, p50/p99 and CPU microseconds per operation of the client and the
# KV nodes (from /proc, as `dinomo bench` reports them).
#
#   scripts/tls-cost.sh [options]
#
# Options:
#   --dinomo PATH     the dinomo binary (default target/release/dinomo; build it with
#                     `cargo build --release -p dinomo-cli`)
#   --records N       keys loaded (default 50000), values of --value-size bytes (default 1000)
#   --clients N       bench clients (default 8), each with --outstanding M (default 4)
#   --duration S      seconds measured per run (default 8), after --warmup S (default 2)
#   --rounds N        TLS/plain pairs per workload (default 3; the medians are printed)
#   --workloads LIST  workloads after the load (default c,a)
#   --out DIR         logs and JSON summaries (default target/tls-cost)
#   -h, --help        this text
#
# Figures from a shared 2-core machine are noisy: read the ratio and the CPU per operation
# (the KV nodes' figure sums both clusters' KNs: the idle cluster's add a little to both).
# What changes: the client-KN data path (the KV wire, or the Pipeline RPC with
# DINOMO_KV_TRANSPORT=grpc, over TLS or not) and the gRPC control paths (KN-DPM, monitor);
# the fabric data path is the same in both clusters. Everything it starts is stopped on exit.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
cd "$root"
usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

dinomo=target/release/dinomo records=50000 value_size=1000 clients=8 outstanding=4 warmup=2
duration=8 rounds=3 workloads=c,a out=target/tls-cost
while [ $# -gt 0 ]; do
  case "$1" in
    --dinomo) dinomo=$2; shift 2 ;;
    --records) records=$2; shift 2 ;;
    --value-size) value_size=$2; shift 2 ;;
    --clients) clients=$2; shift 2 ;;
    --outstanding) outstanding=$2; shift 2 ;;
    --duration) duration=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --workloads) workloads=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -x "$dinomo" ] || { echo "no $dinomo: cargo build --release -p dinomo-cli" >&2; exit 2; }
dinomo=$(cd "$(dirname "$dinomo")" && pwd)/$(basename "$dinomo")
mkdir -p "$out"
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

# name base extra-up-args...
start() {
  local name=$1 base=$2; shift 2
  env -u DINOMO_INSECURE -u DINOMO_CREDENTIALS "$dinomo" up --data-dir "$work/$name" --kns 2 \
    --port-base "$base" "$@" >"$out/$name.up.out" 2>"$out/$name.up.err" &
  pids+=($!)
  for _ in $(seq 1 120); do
    grep -q "Press Ctrl-C" "$out/$name.up.out" 2>/dev/null && return 0
    sleep 0.5
  done
  echo "dinomo up ($name) did not start; see $out/$name.up.err" >&2
  exit 1
}
start tls 14700
start plain 17700 --insecure

common=(--records "$records" --value-size "$value_size" --clients "$clients" --outstanding "$outstanding"
  --connections 1)
bench() { # name workload run extra...
  local name=$1 wl=$2 run=$3; shift 3
  local base=14700 sec=(--credentials "$work/tls/credentials")
  if [ "$name" = plain ]; then base=17700 sec=(--insecure); fi
  echo "== $name $wl $run" >&2
  "$dinomo" bench --target "dinomo://127.0.0.1:$((base + 200))" "${sec[@]}" --workload "$wl" \
    "${common[@]}" "$@" --json "$out/$name-$wl-$run.json" >"$out/$name-$wl-$run.txt" 2>&1
}
for name in tls plain; do bench "$name" load 0 --operations "$records"; done
IFS=, read -ra wls <<<"$workloads"
for wl in "${wls[@]}"; do
  for run in $(seq 1 "$rounds"); do
    for name in tls plain; do bench "$name" "$wl" "$run" --warmup "$warmup" --duration "$duration"; done
  done
done

python3 - "$out" "$workloads" "$rounds" <<'PY'
import json, statistics, sys
out, wls, rounds = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
def runs(name, wl):
    for r in range(1, rounds + 1):
        with open(f"{out}/{name}-{wl}-{r}.json") as f:
            yield json.load(f)
def summary(name, wl):
    rs = list(runs(name, wl))
    ops = [r["run"]["throughput_ops_per_s"] for r in rs]
    lat = [([l for l in r["run"]["latency"] if l["op"] == "ALL"] or r["run"]["latency"])[0] for r in rs]
    # Both clusters' processes are listed (names repeat, pids differ): the idle cluster's
    # KNs add their polling, the same small amount to both sides.
    cpu = [r.get("cpu", []) for r in rs]
    return {
        "ops": statistics.median(ops),
        "all_ops": ops,
        "p50": statistics.median(l["p50_us"] for l in lat),
        "p99": statistics.median(l["p99_us"] for l in lat),
        "client": statistics.median(sum(p["us_per_op"] for p in c if p["name"] == "client") for c in cpu),
        "kn": statistics.median(sum(p["us_per_op"] for p in c if p["name"].startswith("kv-node")) for c in cpu),
    }
print("| workload | TLS ops/s (median) | plain ops/s (median) | TLS / plain | TLS p50 / p99 us | plain p50 / p99 us | client CPU us/op TLS / plain | KN CPU us/op TLS / plain | runs TLS; plain |")
print("|---|---|---|---|---|---|---|---|---|")
for wl in wls:
    t, p = summary("tls", wl), summary("plain", wl)
    print(f"| {wl} | {t['ops']:,.0f} | {p['ops']:,.0f} | {t['ops'] / p['ops']:.2f} | {t['p50']:.0f} / {t['p99']:.0f} | "
          f"{p['p50']:.0f} / {p['p99']:.0f} | {t['client']:.1f} / {p['client']:.1f} | {t['kn']:.1f} / {p['kn']:.1f} | "
          f"{', '.join(f'{x:,.0f}' for x in t['all_ops'])}; {', '.join(f'{x:,.0f}' for x in p['all_ops'])} |")
PY
echo "logs, texts and JSON summaries: $out" >&2
