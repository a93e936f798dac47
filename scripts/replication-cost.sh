#!/usr/bin/env bash
# What replicating the dpm-node costs (issue 14), in one run: the same `dinomo bench`
# workloads against `dinomo up --fabric F` (no replication) and `dinomo up --fabric F
# --dpm-replicas 3` (a primary and two backups), one cluster after the other on the same
# ports; F is tcp unless --fabric says shm (the KV nodes then forward each batch they store). Prints a
# markdown table per workload: throughput and the ratio, write latency p50/p99, CPU per
# operation of the client, the primary and each backup (from /proc, as `dinomo bench`
# reports it), and the bytes the primary shipped to each backup per write (its
# ReplicaStatus, from `dinomo status`). Then a backup is killed and `up` brings it back: the
# time and bytes of its re-replication; and the primary is failed (`dinomo admin fail-dpm`):
# the time and bytes until both backups are in sync with the new primary.
#   bash scripts/replication-cost.sh [--dinomo PATH] [--records N] [--duration S] [--workloads load,a] [--fabric tcp|shm]
set -euo pipefail
cd "$(dirname "$0")/.."
dinomo=target/release/dinomo records=20000 duration=8 workloads=a clients=4 outstanding=4 fabric=tcp
base=28700
while [ $# -gt 0 ]; do
  case "$1" in
    --dinomo) dinomo=$2; shift 2 ;;
    --records) records=$2; shift 2 ;;
    --duration) duration=$2; shift 2 ;;
    --workloads) workloads=$2; shift 2 ;;
    --clients) clients=$2; shift 2 ;;
    --outstanding) outstanding=$2; shift 2 ;;
    --fabric) fabric=$2; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -x "$dinomo" ] || { echo "no $dinomo: cargo build --release -p dinomo-cli" >&2; exit 1; }
dinomo=$(cd "$(dirname "$dinomo")" && pwd)/$(basename "$dinomo")
work=$(mktemp -d /tmp/dinomo-replication-cost.XXXXXX)
up_pid=""
cleanup() {
  if [ -n "$up_pid" ]; then kill -TERM "$up_pid" 2>/dev/null || true; wait "$up_pid" 2>/dev/null || true; fi
  [ -n "${KEEP_WORK:-}" ] || rm -rf "$work"
}
trap cleanup EXIT
export DINOMO_INSECURE=1 RUST_BACKTRACE=0
routing=127.0.0.1:$((base + 200)) dpm=127.0.0.1:$base

start() { # replicas
  "$dinomo" up --data-dir "$work/data-$1" --port-base $base --kns 2 --fabric "$fabric" \
    --dpm-replicas "$1" --pool-size 1GiB >"$work/up-$1.log" 2>&1 &
  up_pid=$!
  for _ in $(seq 1 600); do
    grep -q "Press Ctrl-C" "$work/up-$1.log" && return 0
    kill -0 $up_pid 2>/dev/null || { cat "$work/up-$1.log"; exit 1; }
    sleep 0.1
  done
  echo "dinomo up did not come up" >&2; cat "$work/up-$1.log"; exit 1
}
stop() { kill -TERM "$up_pid"; wait "$up_pid" || true; up_pid=""; }
sent_mib() { # total MiB shipped to the backups so far
  "$dinomo" status --routing $routing --dpm $dpm 2>/dev/null \
    | sed -n 's/.* \([0-9.]*\) MiB sent.*/\1/p' | awk '{s += $1} END {printf "%.1f", s + 0}'
}
bench() { # replicas workload
  local load=""; [ "$2" = load ] || load=""
  "$dinomo" bench --target dinomo://$routing --workload "$2" --records $records \
    --duration $duration --warmup 1 --clients $clients --outstanding $outstanding \
    --json "$work/$1-$2.json" >"$work/$1-$2.txt" 2>&1
}
for replicas in 1 3; do
  start $replicas
  "$dinomo" bench --target dinomo://$routing --workload load --records $records \
    --operations $records --clients $clients --outstanding $outstanding >/dev/null 2>&1
  for w in ${workloads//,/ }; do
    before=$(sent_mib)
    bench $replicas "$w"
    after=$(sent_mib)
    echo "$before $after" >"$work/$replicas-$w.sent"
  done
  if [ $replicas = 3 ]; then
    # Re-replication: kill backup 1; `up` removes it, starts it again and adds it back, and
    # the primary copies the pool to it. Timed from the kill until its status is in sync again
    # (first seen leaving in-sync, so an old line is not mistaken for the new copy).
    status_of_b1() { "$dinomo" status --routing $routing --dpm $dpm 2>/dev/null | grep "backup 127.0.0.1:$((base + 20)) " || true; }
    pid=$(pgrep -f -- "--role backup --pool $work/data-3/dpm-backup-1.pool" | head -1)
    kill -9 "$pid"
    t0=$(date +%s%N)
    left=0
    for _ in $(seq 1 1200); do
      line=$(status_of_b1)
      if ! echo "$line" | grep -q in-sync; then left=1; fi
      if [ $left = 1 ] && echo "$line" | grep -q in-sync; then break; fi
      sleep 0.05
    done
    t1=$(date +%s%N)
    echo "re-replication of backup 1 (SIGKILL; up restarts it on its pool, the primary copies the chunks that differ): $(( (t1 - t0) / 1000000 )) ms from the kill to in sync; its status: ${line## }"
    # After a failover: the promoted backup's place is taken by a backup on the dead primary's
    # pool, and the other backup (in sync with the old primary) is attached by the new one;
    # both are copied what differs. Timed from the end of fail-dpm until both are in sync.
    "$dinomo" admin fail-dpm --dpm $dpm --routing $routing | tail -2
    t0=$(date +%s%N)
    for _ in $(seq 1 1200); do
      [ "$("$dinomo" status --routing $routing --dpm $dpm 2>/dev/null | grep -c "backup .* in-sync")" = 2 ] && break
      sleep 0.05
    done
    t1=$(date +%s%N)
    echo "after the failover, both backups in sync $(( (t1 - t0) / 1000000 )) ms after fail-dpm returned:"
    "$dinomo" status --routing $routing --dpm $dpm 2>/dev/null | grep "    backup " || true
  fi
  stop
done
python3 - "$work" ${workloads//,/ } <<'PY'
import json, sys
work, workloads = sys.argv[1], sys.argv[2:]
def cpu(s, name):
    return sum(c["us_per_op"] for c in s["cpu"] if c["name"] == name)
for w in workloads:
    rows = []
    for r in ("1", "3"):
        s = json.load(open(f"{work}/{r}-{w}.json"))
        lat = {l["op"]: l for l in s["run"]["latency"]}
        wr = lat.get("UPDATE") or lat.get("INSERT") or lat["ALL"]
        before, after = map(float, open(f"{work}/{r}-{w}.sent").read().split())
        writes = wr["ops"]
        per_write = (after - before) * 1048576 / 2 / writes if r == "3" and writes else 0
        rows.append((r, s["run"]["throughput_ops_per_s"], wr, cpu(s, "client"), cpu(s, "dpm-node"),
                     cpu(s, "dpm-node backup") / 2, per_write, s["run"]["errors"]))
    base = rows[0][1]
    print(f"\nworkload {w} ({rows[0][2]['op']} = the writes)\n")
    print("| dpm-node replicas | ops/s | ratio | write p50 / p99 us | client CPU us/op | primary CPU us/op | each backup CPU us/op | bytes to each backup per write | errors |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r, tput, wr, c, p, b, pw, e in rows:
        print(f"| {'1 (off)' if r == '1' else '3 (2 backups)'} | {tput:,.0f} | {tput / base:.2f} | {wr['p50_us']:.0f} / {wr['p99_us']:.0f} | {c:.1f} | {p:.1f} | {b:.1f} | {pw:,.0f} | {e} |")
PY
