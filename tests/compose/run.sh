#!/usr/bin/env bash
# A Dinomo cluster of separate hosts in containers (docker-compose, file format 2.4): faults
# injected while a recorded client runs, every history checked by dinomo-checker, and
# throughput with 1, 2 and 3 KV-node containers of half a core each.
#
#   bash tests/compose/run.sh --short     # CI: 4 faults, one round, no throughput steps
#   bash tests/compose/run.sh             # long: every fault, --rounds rounds, throughput steps
#   bash tests/compose/run.sh --help
#
# Options:
#   --short            the CI form (a few minutes; see tests/compose/README.md)
#   --rounds N         long form: rounds over the fault list (default 2)
#   --faults LIST      comma-separated subset of the faults (default: all; --short: 4)
#   --no-faults        skip the fault phase
#   --no-scale         skip the throughput steps
#   --scale-seconds S  length of each throughput measurement (default 20)
#   --build            rebuild the image first (bash docker/build.sh) even if it exists
#   --keep             leave each cluster running (prints how to remove it)
#   --results DIR      where histories, logs and summary.md go (default: a new directory
#                      under ${TMPDIR:-/tmp}/dinomo-compose.*)
#
# Faults (each one while dinomo-history records a 4-client load; then heal, read every key
# back, check):
#   kill-kn          docker kill of a KN container (SIGKILL), later restarted (compose start)
#   pause-kn         docker pause of a KN for 3 s (longer than failed_after_ms: it is fenced)
#   disconnect-kn    docker network disconnect of a KN for 3 s, then reconnect (same address)
#   disconnect-dpm   the same for the dpm-node
#   cut-kn-dpm       one way: the KN's packets to the dpm-node dropped (iptables OUTPUT in the
#                    KN's network namespace), 3 s
#   drop-kn-answers  one way: the KN's answers (tcp source port 7800) dropped, 3 s
#   cut-client-kn    one way: the client's packets to one KN dropped, 3 s
# After each fault the cluster is brought back to 3 KNs: a stopped container is started again
# and `dinomo admin add-kn` adopts a registered KN that is not in the map.
#
# Exit status: 0 when every history passed (no violation, no lost acknowledged write, every key
# read back) and the cluster served again after every fault; 0 with "SKIP" when docker or
# docker-compose is missing or the daemon does not answer; 1 otherwise.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

short=0 rounds=2 faults="" do_faults=1 do_scale=1 scale_s=20 build=0 keep=0 results=""
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --short) short=1 ;;
    --rounds) rounds=$2; shift ;;
    --faults) faults=$2; shift ;;
    --no-faults) do_faults=0 ;;
    --no-scale) do_scale=0 ;;
    --scale-seconds) scale_s=$2; shift ;;
    --build) build=1 ;;
    --keep) keep=1 ;;
    --results) results=$2; shift ;;
    *) echo "run.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
all_faults="kill-kn,pause-kn,disconnect-kn,disconnect-dpm,cut-kn-dpm,drop-kn-answers,cut-client-kn"
if [ "$short" = 1 ]; then
  rounds=1 do_scale=0
  faults=${faults:-kill-kn,pause-kn,disconnect-dpm,cut-kn-dpm}
fi
faults=${faults:-$all_faults}

skip() { echo "SKIP: $*"; echo "0 passed, 0 failed, 1 skipped"; exit 0; }
command -v docker >/dev/null 2>&1 || skip "docker is not installed: the compose cluster test needs Docker"
command -v docker-compose >/dev/null 2>&1 || skip "docker-compose is not installed (Debian: apt-get install docker-compose)"
docker info >/dev/null 2>&1 || skip "the docker daemon does not answer (docker info failed)"

log() { echo "[compose $(date -u +%H:%M:%S)] $*"; }
die() { echo "run.sh: $*" >&2; exit 1; }

results=${results:-$(mktemp -d "${TMPDIR:-/tmp}/dinomo-compose.XXXXXX")}
mkdir -p "$results"
results=$(cd "$results" && pwd)
summary=$results/summary.md
: >"$summary"
image=${DINOMO_IMAGE:-dinomo:latest}

# --- images and the test client -----------------------------------------------------------------
if [ "$build" = 1 ] || ! docker image inspect "$image" >/dev/null 2>&1; then
  log "building $image (bash docker/build.sh)"
  DINOMO_IMAGE=$image bash "$repo/docker/build.sh"
fi
log "building dinomo-history (tests/compose/history) in the builder image"
bin=$(bash "$repo/docker/build.sh" --tool "$here/history/Cargo.toml" | tail -1)
[ -x "$bin/dinomo-history" ] || die "no dinomo-history binary in '$bin'"
mkdir -p "$results/bin"
cp "$bin/dinomo-history" "$results/bin/"

# --- one cluster at a time, always removed ------------------------------------------------------
project="" net_prefix=""
dc() { docker-compose -p "$project" -f "$here/docker-compose.yml" "$@"; }

# A /24 under 10.213.0.0/16 that no docker network uses now.
pick_subnet() {
  local used i
  used=$(docker network ls -q | xargs -r docker network inspect -f '{{range .IPAM.Config}}{{.Subnet}} {{end}}' 2>/dev/null || true)
  for i in $(shuf -i 1-250); do
    case " $used " in *" 10.213.$i.0/24 "*) continue ;; esac
    echo "10.213.$i"; return
  done
  die "no free 10.213.x.0/24 subnet"
}

cleanup() {
  [ -n "$project" ] || return 0
  if [ "$keep" = 1 ]; then
    log "kept: DINOMO_NET=$net_prefix docker-compose -p $project -f $here/docker-compose.yml down -v"
    project=""
    return 0
  fi
  # A paused container cannot be stopped: unpause first.
  local c
  for c in $(dc ps -q 2>/dev/null); do docker unpause "$c" >/dev/null 2>&1 || true; done
  dc logs --no-color -t >"$results/$project.logs.txt" 2>&1 || true
  dc down -v --remove-orphans -t 2 >/dev/null 2>&1 || true
  project=""
}
trap 'cleanup' EXIT
trap 'exit 130' INT TERM

start_cluster() { # name kns services...
  local name=$1 kns=$2; shift 2
  project="dinomo-$name-$$-$RANDOM"
  cids=()
  net_prefix=$(pick_subnet)
  export DINOMO_NET=$net_prefix DINOMO_KNS=$kns DINOMO_IMAGE=$image
  export DINOMO_TEST_BIN=$results/bin DINOMO_RESULTS=$results
  log "cluster $project on $net_prefix.0/24, monitor --orchestrator external --kns $kns: $*"
  dc up -d "$@" >"$results/$project.up.log" 2>&1 || { cat "$results/$project.up.log"; return 1; }
  lookup_cids
  client_cid=$(cid client)
}

# Container ids, looked up after each `up` (they survive start, restart and network changes;
# cid runs in command substitutions, so it reads the table and never fills it).
declare -A cids=()
lookup_cids() { local s; for s in dpm kn1 kn2 kn3 routing monitor client; do cids[$s]=$(dc ps -q "$s" 2>/dev/null || true); done; }
cid() { echo "${cids[$1]:-}"; }
# docker exec, not docker-compose exec: each compose call costs a second of Python start-up.
client_cid=""
client() { docker exec -i "$client_cid" "$@"; }
routing() { echo "$net_prefix.30:7900"; }
net_name() { echo "${project}_dinomo"; }
ip_of() { case $1 in dpm) echo "$net_prefix.10" ;; kn[1-9]) echo "$net_prefix.2${1#kn}" ;; client) echo "$net_prefix.50" ;; esac; }

# KN ids in the monitor's map (`dinomo admin status`), space-separated.
map_kns() {
  client timeout 10 dinomo admin status 2>/dev/null |
    awk '/^ *[0-9]+ +[0-9.]+:[0-9]+ / {printf "%s ", $1}' || true
}
count() { echo $#; }

# Waits until the map has at least n KNs and a write and a read succeed; prints the
# milliseconds taken.
wait_serving() { # n timeout_s
  local n=$1 limit=$2 t0 now kns
  t0=$(date +%s%N)
  while :; do
    now=$(date +%s%N)
    [ $(( (now - t0) / 1000000000 )) -lt "$limit" ] || return 1
    kns=$(map_kns)
    if [ "$(count $kns)" -ge "$n" ] &&
      client timeout 10 dinomo kv --routing "$(routing)" put probe-serving "$now" >/dev/null 2>&1 &&
      client timeout 10 dinomo kv --routing "$(routing)" get probe-serving >/dev/null 2>&1; then
      echo $(( ($(date +%s%N) - t0) / 1000000 ))
      return 0
    fi
    sleep 0.5
  done
}

running() { [ "$(docker inspect -f '{{.State.Running}}' "$(cid "$1")" 2>/dev/null)" = true ]; }

# Back to the KNs kn1..kn$1 all in the map: start stopped containers, adopt registered ones.
restore() { # n
  local n=$1 i try kns
  for try in 1 2 3 4 5; do
    for i in $(seq 1 "$n"); do
      running "kn$i" || { log "  starting kn$i again"; dc start "kn$i" >/dev/null 2>&1 || true; }
    done
    kns=$(map_kns)
    [ "$(count $kns)" -ge "$n" ] && return 0
    log "  map has KNs [${kns% }]; dinomo admin add-kn"
    client timeout 60 dinomo admin add-kn 2>&1 | sed 's/^/    /' || true
    kns=$(map_kns)
    [ "$(count $kns)" -ge "$n" ] && return 0
    if [ "$try" -ge 3 ]; then
      # A KN that was fenced but still runs may need a fresh start to register again.
      for i in $(seq 1 "$n"); do
        case " $kns " in *" $i "*) ;; *) log "  restarting kn$i"; dc restart -t 1 "kn$i" >/dev/null 2>&1 || true ;; esac
      done
    fi
    sleep 2
  done
  return 1
}

# iptables inside a container's network namespace (the host's iptables binary).
ns_ipt() { # service iptables-args...
  local pid
  pid=$(docker inspect -f '{{.State.Pid}}' "$(cid "$1")"); shift
  nsenter -t "$pid" -n iptables -w "$@"
}

have_iptables() { command -v iptables >/dev/null 2>&1 && command -v nsenter >/dev/null 2>&1; }

# Applies fault $1; echoes the command that heals it into $heal.
heal=""
inject() {
  local f=$1
  case $f in
    kill-kn)
      docker kill "$(cid kn2)" >/dev/null
      heal="dc start kn2" ;;
    pause-kn)
      docker pause "$(cid kn3)" >/dev/null
      heal="docker unpause $(cid kn3)" ;;
    disconnect-kn)
      docker network disconnect "$(net_name)" "$(cid kn1)"
      heal="docker network connect --ip $(ip_of kn1) $(net_name) $(cid kn1)" ;;
    disconnect-dpm)
      docker network disconnect "$(net_name)" "$(cid dpm)"
      heal="docker network connect --ip $(ip_of dpm) $(net_name) $(cid dpm)" ;;
    cut-kn-dpm)
      ns_ipt kn1 -I OUTPUT -d "$(ip_of dpm)" -j DROP
      heal="ns_ipt kn1 -D OUTPUT -d $(ip_of dpm) -j DROP" ;;
    drop-kn-answers)
      ns_ipt kn2 -I OUTPUT -p tcp --sport 7800 -j DROP
      heal="ns_ipt kn2 -D OUTPUT -p tcp --sport 7800 -j DROP" ;;
    cut-client-kn)
      ns_ipt client -I OUTPUT -d "$(ip_of kn3)" -p tcp --dport 7800 -j DROP
      heal="ns_ipt client -D OUTPUT -d $(ip_of kn3) -p tcp --dport 7800 -j DROP" ;;
    *) die "unknown fault '$f' (see --help)" ;;
  esac
}

# --- faults ---------------------------------------------------------------------------------------
failures=0
rows=()
run_fault() { # round fault
  local round=$1 f=$2 name rec_pid rc rec chk t_heal serving full kns_before kns_mid kns_after hold=3
  name=r$round-$f
  case $f in cut-*|drop-*) have_iptables || { rows+=("| $round | $f | unavailable (no iptables/nsenter) | | | | | | | | |"); return 0; } ;; esac
  kns_before=$(map_kns)
  rm -f "$results/$name.stop"
  log "$name: recorded load starts (map KNs [${kns_before% }])"
  # timeout inside the container: the load stops by --seconds or the stop file, each operation
  # by its deadline, the settle by --settle-s; this bounds the read-back too.
  client timeout -k 5 300 /opt/dinomo-test/bin/dinomo-history record --routing "$(routing)" --clients 4 --keys 64 \
    --key-prefix "$name-" --seconds 120 --stop-file "/results/$name.stop" \
    --out "/results/$name.history" \
    </dev/null >"$results/$name.record.out" 2>"$results/$name.record.log" &
  rec_pid=$!
  sleep 3
  log "$name: inject"
  inject "$f"
  sleep "$hold"
  log "$name: heal: $heal"
  eval "$heal" >/dev/null
  t_heal=$(date +%s%N)
  # Serving again: some map, and a write and a read through the routing node succeed.
  serving=$(wait_serving 1 60) || serving=never
  kns_mid=$(map_kns)
  # Membership back to 3 KNs (a killed or fenced KN is out of the map).
  restore 3 || log "  could not bring the map back to 3 KNs"
  kns_after=$(map_kns)
  full=$(( ($(date +%s%N) - t_heal) / 1000000 ))
  log "  serving ${serving} ms after the heal; map [${kns_after% }] ${full} ms after it"
  sleep 3
  touch "$results/$name.stop"
  rc=0
  wait "$rec_pid" || rc=$?
  rec=$(grep '^RECORD' "$results/$name.record.out" || true)
  chk=$(client /opt/dinomo-test/bin/dinomo-history check "/results/$name.history" 2>&1 | tee "$results/$name.check.out" | grep '^CHECK' || true)
  log "  $rec"
  log "  $chk"
  local v ops unk err lost stall result
  ops=$(sed -n 's/.* ops=\([0-9]*\).*/\1/p' <<<"$rec")
  unk=$(sed -n 's/.* unknown=\([0-9]*\).*/\1/p' <<<"$rec")
  err=$(sed -n 's/.* errors=\([0-9]*\).*/\1/p' <<<"$rec")
  stall=$(sed -n 's/.* max_stall_ms=\([0-9]*\).*/\1/p' <<<"$rec")
  v=$(sed -n 's/.* violations=\([0-9]*\).*/\1/p' <<<"$chk")
  lost=$(sed -n 's/.* lost_writes=\([0-9]*\).*/\1/p' <<<"$chk")
  result=$(sed -n 's/.* result=\([A-Za-z]*\).*/\1/p' <<<"$chk")
  if [ "$result" != ok ] || [ "$rc" != 0 ] || [ "$serving" = never ] || [ "$(count $kns_after)" -lt 3 ]; then
    failures=$((failures + 1))
    result="FAIL(${result:-no check}, record exit $rc, serving $serving, map [${kns_after% }])"
    log "  FAILED: see $results/$name.*"
  fi
  rows+=("| $round | $f | ${ops:-?} | ${unk:-?} | ${err:-?} | ${v:-?} | ${lost:-?} | ${stall:-?} | ${serving} | [${kns_before% }] -> [${kns_mid% }] -> [${kns_after% }] in ${full} ms | $result |")
}

if [ "$do_faults" = 1 ]; then
  start_cluster faults 3 dpm kn1 kn2 kn3 routing monitor client
  ms=$(wait_serving 3 120) || { dc logs --no-color --tail 50 >&2 || true; die "the 3-KN cluster did not serve within 120 s"; }
  log "serving with KNs [$(map_kns)] after ${ms} ms"
  # The external orchestrator cannot kill what it did not start: fail-kn must be refused.
  if out=$(client timeout 20 dinomo admin fail-kn 1 2>&1); then
    die "dinomo admin fail-kn was accepted under --orchestrator external: $out"
  fi
  log "fail-kn refused, as it should be: $out"
  IFS=, read -r -a flist <<<"$faults"
  for round in $(seq 1 "$rounds"); do
    for f in "${flist[@]}"; do run_fault "$round" "$f"; done
  done
  {
    echo "## Faults ($(date -u +%FT%TZ), image $image, project $project)"
    echo
    echo "ops: operations recorded; unknown: outcome unknown (recorded as such); errors: other errors"
    echo "(recorded as unknown); longest stall: longest time with no successful operation;"
    echo "serving after heal: until a put and a get through the routing node succeed; map KNs: before the"
    echo "fault -> when serving again (a KN missing was failed over by the monitor) -> after add-kn."
    echo
    echo "| round | fault | ops | unknown | errors | violations | lost writes | longest stall ms | serving after heal ms | map KNs | result |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
    echo
  } >>"$summary"
  cleanup
fi

# --- throughput with 1, 2, 3 KN containers ---------------------------------------------------------
if [ "$do_scale" = 1 ]; then
  start_cluster scale 1 dpm kn1 routing monitor client
  wait_serving 1 120 >/dev/null || die "the 1-KN cluster did not serve within 120 s"
  records=20000
  log "bench load: $records records"
  client dinomo bench --target "dinomo://$(routing)" --workload load --records $records \
    --clients 8 --value-size 256 >"$results/scale-load.out" 2>&1 || { cat "$results/scale-load.out"; die "bench load failed"; }
  declare -A up down cpu
  # One measurement: workload c for scale_s seconds; a docker stats sample half-way through.
  bench_level() { # n label
    local n=$1 label=$2 out=$results/scale-$2-$1 pid
    client dinomo bench --target "dinomo://$(routing)" --workload c --records $records \
      --clients 32 --value-size 256 --warmup 3 --duration "$scale_s" --seed "$n" \
      --json "/results/scale-$label-$n.json" </dev/null >"$out.out" 2>&1 &
    pid=$!
    sleep $(( 3 + scale_s / 2 ))
    # shellcheck disable=SC2046 # one argument per container id
    docker stats --no-stream --format '{{.Name}} {{.CPUPerc}}' $(for s in kn1 kn2 kn3 client dpm routing; do cid "$s"; done) 2>/dev/null |
      sed "s/^${project}_\([a-z0-9]*\)_1/\1/" | tr '\n' ' ' >"$out.cpu"
    echo "load $(cut -d' ' -f1 /proc/loadavg)" >>"$out.cpu"
    wait "$pid" || { cat "$out.out"; die "bench with $n KNs failed"; }
    python3 -c 'import json,sys; print(round(json.load(open(sys.argv[1]))["run"]["throughput_ops_per_s"]))' "$out.json"
  }
  for n in 1 2 3; do
    if [ "$n" -gt 1 ]; then
      log "starting kn$n, dinomo admin add-kn"
      dc up -d --no-deps "kn$n" >/dev/null 2>&1
      lookup_cids
      restore "$n" || die "kn$n was not adopted into the map"
      wait_serving "$n" 60 >/dev/null || die "no service with $n KNs"
    fi
    log "bench with KNs [$(map_kns)]: workload c, ${scale_s} s"
    up[$n]=$(bench_level "$n" up)
    cpu[up$n]=$(cat "$results/scale-up-$n.cpu")
    log "  $n KN(s): ${up[$n]} ops/s (CPU: ${cpu[up$n]})"
  done
  # The same steps downwards (remove-kn only takes a KN out of the map), so that a drift of the
  # machine's other load during the sweep shows, and the mean of both sweeps cancels a linear one.
  for n in 3 2 1; do
    if [ "$n" -lt 3 ]; then
      log "dinomo admin remove-kn $((n + 1))"
      client timeout 60 dinomo admin remove-kn $((n + 1)) 2>&1 | sed 's/^/    /' || true
      wait_serving "$n" 60 >/dev/null || die "no service after removing KN $((n + 1))"
    fi
    log "bench with KNs [$(map_kns)]: workload c, ${scale_s} s"
    down[$n]=$(bench_level "$n" down)
    cpu[down$n]=$(cat "$results/scale-down-$n.cpu")
    log "  $n KN(s): ${down[$n]} ops/s (CPU: ${cpu[down$n]})"
  done
  {
    echo "## Throughput, workload c (reads, zipfian 0.99), 32 clients, KN containers cpus: ${DINOMO_KN_CPUS:-0.5}, ${scale_s} s each"
    echo
    echo "Up: kn\$n started and adopted (\`dinomo admin add-kn\`); down: \`dinomo admin remove-kn\`."
    echo "CPU: one \`docker stats\` sample half-way through (100% = one core); load: the host's 1-min load average."
    echo
    echo "| KN containers | ops/s up | ops/s down | mean | ratio to 1 KN | CPU up | CPU down |"
    echo "|---|---|---|---|---|---|---|"
    for n in 1 2 3; do
      python3 - "$n" "${up[$n]}" "${down[$n]}" "${up[1]}" "${down[1]}" "${cpu[up$n]}" "${cpu[down$n]}" <<'PY'
import sys
n, u, d, u1, d1 = sys.argv[1], *map(float, sys.argv[2:6])
m, m1 = (u + d) / 2, (u1 + d1) / 2
print(f"| {n} | {u:.0f} | {d:.0f} | {m:.0f} | {m / m1:.2f} | {sys.argv[6]} | {sys.argv[7]} |")
PY
    done
    echo
  } >>"$summary"
  cleanup
fi

cat "$summary"
log "results in $results"
if [ "$failures" -gt 0 ]; then
  echo "$(( ${#rows[@]} - failures )) passed, $failures failed"
  exit 1
fi
echo "${#rows[@]} passed, 0 failed"
