#!/usr/bin/env bash
# Dinomo against Redis on this machine, same driver (`dinomo bench`), same workloads, one run:
# the table of issue 12 ("The request path at Redis speed"). Prints a Markdown table with, per
# workload, ops/s of both and their ratio, p50/p99 of both, Dinomo's fabric round trips per
# operation, and CPU microseconds per operation of the bench client and of each KV node
# (from /proc, as `dinomo bench` reports them).
#
#   scripts/peer-bench.sh [options]
#
# Options:
#   --dinomo PATH     the dinomo binary (default target/release/dinomo; build it with
#                     `cargo build --release -p dinomo-cli`)
#   --records N       keys loaded (default 50000), values of --value-size bytes (default 1000)
#   --clients N       bench clients (default 8), each with --outstanding M requests (default 4),
#                     sharing --connections C connections (default 1: one SDK client, one
#                     multiplexed Redis connection; the bench's own default is one per client)
#   --threads N       runtime threads of the bench process, for both targets (default: the
#                     bench's own default, one per core)
#   --kn-threads N    runtime threads per KV node (default: `dinomo up`'s, cores / KNs)
#   --shards N        shards per KV node (default: `dinomo up`'s)
#   --warmup S        seconds of warm-up before each measured run (default 2)
#   --duration S      seconds measured per workload (default 8)
#   --workloads LIST  run workloads after the load (default a,b,c)
#   --rounds N        measure each workload N times, Dinomo and Redis alternating (D R, R D,
#                     D R, ...), and print each round's ratio and the median of the rounds
#                     (default 1). This machine's speed drifts by tens of percent within minutes;
#                     rounds spread that drift over both systems instead of one of them
#   --kns N           KV nodes of the Dinomo cluster (default 2)
#   --kv-transport T  how the SDK reaches the KV nodes: wire (default) or grpc, or a list
#                     (wire,grpc): each is measured against the same cluster and the same
#                     Redis runs, alternating per workload (the load runs with the first)
#   --insecure        run the Dinomo cluster with --insecure (plain text, as Redis runs);
#                     default: TLS, as `dinomo up` starts it
#   --port-base N     the Dinomo cluster's port base (default 27700); Redis uses BASE-1000
#   --out DIR         where logs and JSON summaries go (default target/peer-bench)
#   -h, --help        this text
#
# Redis runs with AOF, appendfsync everysec (the durability closest to Dinomo's acknowledged
# writes on this machine's shared-memory pool). Needs redis-server (apt install redis-server).
# Figures from a shared 2-core machine are noisy: read the ratios, CPU per operation and
# RTs/op, not the absolute throughput. Everything it starts is stopped on exit.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
cd "$root"
usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

dinomo=target/release/dinomo records=50000 value_size=1000 clients=8 outstanding=4 warmup=2 connections=1
duration=8 workloads=a,b,c kns=2 base=27700 out=target/peer-bench threads="" kn_threads=""
kv_transport=wire insecure=0 shards="" rounds=1
while [ $# -gt 0 ]; do
  case "$1" in
    --dinomo) dinomo=$2; shift 2 ;;
    --records) records=$2; shift 2 ;;
    --value-size) value_size=$2; shift 2 ;;
    --clients) clients=$2; shift 2 ;;
    --outstanding) outstanding=$2; shift 2 ;;
    --connections) connections=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --kn-threads) kn_threads=$2; shift 2 ;;
    --shards) shards=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --duration) duration=$2; shift 2 ;;
    --workloads) workloads=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --kns) kns=$2; shift 2 ;;
    --kv-transport) kv_transport=$2; shift 2 ;;
    --insecure) insecure=1; shift ;;
    --port-base) base=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -x "$dinomo" ] || { echo "no $dinomo: cargo build --release -p dinomo-cli" >&2; exit 2; }
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "--rounds must be a positive integer, not '$rounds'" >&2; exit 2; }
command -v redis-server >/dev/null || { echo "needs redis-server (apt install redis-server)" >&2; exit 2; }

mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
redis_port=$((base - 1000))
up_pid=""
cleanup() {
  [ -n "$up_pid" ] && kill "$up_pid" 2>/dev/null && wait "$up_pid" 2>/dev/null || true
  redis-cli -p "$redis_port" shutdown nosave >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

mkdir -p "$work/redis"
redis-server --port "$redis_port" --bind 127.0.0.1 --dir "$work/redis" --appendonly yes \
  --appendfsync everysec --save "" --daemonize yes --logfile "$out/redis.log"
up_extra=()
[ -n "$kn_threads" ] && up_extra=(--kn-threads "$kn_threads")
[ "$insecure" = 1 ] && up_extra+=(--insecure)
[ -n "$shards" ] && up_extra+=(--shards "$shards")
# The cluster keeps --kns KV nodes for the whole run: the monitor's policy would otherwise
# remove a KN left idle while Redis is measured (no client reports latencies then, and an idle
# KN may go once the 90 s grace period passed), and every later Dinomo run would measure one
# KN fewer. The rest of the policy is the embedded default's.
printf '[policy]\nmin_kns = %s\nmax_kns = %s\n' "$kns" "$kns" >"$work/monitor.toml"
up_extra+=(--monitor-config "$work/monitor.toml")
"$dinomo" up --data-dir "$work/dinomo" --kns "$kns" --port-base "$base" "${up_extra[@]}" \
  >"$out/up.out" 2>"$out/up.err" &
up_pid=$!
routing="127.0.0.1:$((base + 200))"
for _ in $(seq 1 120); do
  grep -q "routing node" "$out/up.out" 2>/dev/null && break
  sleep 0.5
done
grep -q "routing node" "$out/up.out" || { echo "dinomo up did not start; see $out/up.err" >&2; exit 1; }
# The dpm-node faults its pool in in the background once it is open (prefault in
# config/dpm-node.toml): measure after that one-time cost, not while it competes for the cores.
prefaulted=""
for _ in $(seq 1 120); do
  grep -qE "pool prefaulted|prefaulting the pool|not prefaulting" "$work/dinomo/logs/dpm-node.log" 2>/dev/null \
    && prefaulted=1 && break
  sleep 0.5
done
[ -n "$prefaulted" ] || echo "warning: the dpm-node did not report prefaulting its pool within 60 s; measuring anyway" >&2
# `up` made the cluster's TLS credentials under its data directory; the bench uses its client
# identity: this measures the default, TLS (unless --insecure).
if [ "$insecure" = 1 ]; then export DINOMO_INSECURE=1; else export DINOMO_CREDENTIALS="$work/dinomo/credentials"; fi

common=(--records "$records" --value-size "$value_size" --clients "$clients" --outstanding "$outstanding"
  --connections "$connections")
[ -n "$threads" ] && common+=(--threads "$threads")
bench() { # system transport workload round extra...
  local sys=$1 tr=$2 wl=$3 round=$4; shift 4
  local target name=$sys
  if [ "$sys" = dinomo ]; then
    target="dinomo://$routing"
    name="dinomo-$tr"
    set -- --kv-transport "$tr" "$@"
  else
    target="redis://127.0.0.1:$redis_port"
  fi
  echo "== $name $wl (round $round)" >&2
  "$dinomo" bench --target "$target" --workload "$wl" "${common[@]}" "$@" \
    --json "$out/$name-$wl-r$round.json" >"$out/$name-$wl-r$round.txt" 2>&1
}
IFS=, read -ra transports <<<"$kv_transport"
IFS=, read -ra wls <<<"$workloads"
bench dinomo "${transports[0]}" load 1 --operations "$records"
bench redis - load 1 --operations "$records"
dinomo_runs() { # workload round
  for tr in "${transports[@]}"; do
    bench dinomo "$tr" "$1" "$2" --warmup "$warmup" --duration "$duration"
  done
}
for wl in "${wls[@]}"; do
  for round in $(seq 1 "$rounds"); do
    # Odd rounds run Dinomo first, even rounds Redis first: neither always gets the warmer
    # (or the more disturbed) slot.
    if [ $((round % 2)) = 1 ]; then
      dinomo_runs "$wl" "$round"
      bench redis - "$wl" "$round" --warmup "$warmup" --duration "$duration"
    else
      bench redis - "$wl" "$round" --warmup "$warmup" --duration "$duration"
      dinomo_runs "$wl" "$round"
    fi
  done
done

if [ "$insecure" = 1 ]; then mode="plain text"; else mode=TLS; fi
echo "Dinomo: $kns KNs, $mode; Redis: plain text, AOF everysec; $clients clients x $outstanding outstanding over $connections connection(s)"
PEER_BENCH_KNS=$kns python3 - "$out" "load,$workloads" "$kv_transport" "$rounds" <<'EOF'
import json, os, statistics, sys
out, wls, transports, rounds = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(","), int(sys.argv[4])
def load(sys_, wl, r):
    with open(f"{out}/{sys_}-{wl}-r{r}.json") as f:
        return json.load(f)
def lat(s):
    all_ = [l for l in s["run"]["latency"] if l["op"] == "ALL"] or s["run"]["latency"]
    return all_[0]
kns_asked = int(os.environ["PEER_BENCH_KNS"])
def row(d, r):
    """One round's figures: both systems' ops/s and p50/p99, RTs/op, CPU us/op."""
    kns = (d.get("dinomo") or {}).get("kns")
    if kns != kns_asked:
        sys.exit(f"a Dinomo run served by {kns} KV nodes, not {kns_asked}: the cluster changed "
                 f"under the benchmark (its JSON: {d['workload']} in {out}); not reporting it")
    dl, rl = lat(d), lat(r)
    cpu = {c["name"]: c["us_per_op"] for c in d.get("cpu", [])}
    rcpu = {c["name"]: c["us_per_op"] for c in r.get("cpu", [])}
    return {
        "d": d["run"]["throughput_ops_per_s"], "r": r["run"]["throughput_ops_per_s"],
        "dp50": dl["p50_us"], "dp99": dl["p99_us"], "rp50": rl["p50_us"], "rp99": rl["p99_us"],
        "rts": d["dinomo"]["rts_per_op"] if d.get("dinomo") else float("nan"),
        "client": cpu.get("client", float("nan")),
        "kn": sum(v for k, v in cpu.items() if k.startswith("kv-node")),
        "rclient": rcpu.get("client", float("nan")),
        "rserver": rcpu.get("redis-server", float("nan")),
    }
many = rounds > 1
print("| workload | KV transport | Dinomo ops/s | Redis ops/s | ratio | "
      + ("ratio per round | " if many else "")
      + "Dinomo p50 / p99 us | Redis p50 / p99 us | RTs/op | client CPU us/op | "
      + "KN CPU us/op (sum) | Redis client / server CPU us/op |")
print("|---|---|---|---|---|" + ("---|" if many else "") + "---|---|---|---|---|---|")
for wl, tr in [(w, t) for w in wls for t in transports]:
    if not os.path.exists(f"{out}/dinomo-{tr}-{wl}-r1.json"):
        continue
    n = 1 if wl == "load" else rounds
    rs = [row(load(f"dinomo-{tr}", wl, i), load("redis", wl, i)) for i in range(1, n + 1)]
    # With several rounds each column is the median of the rounds, and the ratio the median
    # of the rounds' own ratios (a round's two runs are minutes apart at most).
    m = {k: statistics.median([x[k] for x in rs]) for k in rs[0]}
    ratios = [x["d"] / x["r"] for x in rs]
    per_round = (" " + ", ".join(f"{q:.2f}" for q in ratios) + " |") if many else ""
    print(f"| {wl} | {tr} | {m['d']:,.0f} | {m['r']:,.0f} | {statistics.median(ratios):.2f} |{per_round} "
          f"{m['dp50']:.0f} / {m['dp99']:.0f} | {m['rp50']:.0f} / {m['rp99']:.0f} | {m['rts']:.2f} | "
          f"{m['client']:.1f} | {m['kn']:.1f} | {m['rclient']:.1f} / {m['rserver']:.1f} |")
if many:
    print(f"(medians of {rounds} rounds per workload, Dinomo and Redis alternating; the load runs once)")
EOF
echo "logs, texts and JSON summaries: $out" >&2
