#!/usr/bin/env bash
# The nemesis suite (issue 10: no stale read and no lost write under any fault schedule), long
# form. See docs/testing.md, "Nemesis".
#
#   scripts/nemesis.sh [SCHEDULES] [FIRST_SEED]
#
# Runs SCHEDULES (default 100) schedules of cli/tests/integration/nemesis.rs, each a fresh
# `dinomo up` cluster under a seeded fault schedule, in batches of DINOMO_NEMESIS_BATCH (default
# 10) schedules per test process (a batch that hangs is cut off after BATCH_TIMEOUT seconds,
# default 60 per schedule), then prints one row per schedule and the totals. Seeds run
# consecutively from FIRST_SEED (default: random). The other DINOMO_NEMESIS_* variables
# (SECONDS, FAULTS, CLIENTS, KINDS, KEEP) pass through to the test.
#
# Output: target/nemesis/<first-seed>/batch-*.log (full test output) and summary.txt. A failed
# schedule's history, fault timeline and node logs are in target/tmp/nemesis-<seed>/; replay its
# fault schedule with
#   DINOMO_NEMESIS_SEED=<seed> cargo test -p dinomo-cli --test integration nemesis -- --nocapture
# Exit status: 0 if every schedule passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."

SCHEDULES=${1:-100}
FIRST_SEED=${2:-$(( (RANDOM << 15 | RANDOM) % 1000000000 ))}
BATCH=${DINOMO_NEMESIS_BATCH:-10}
BATCH_TIMEOUT=${BATCH_TIMEOUT:-$(( 60 * BATCH ))}
OUT=target/nemesis/$FIRST_SEED
mkdir -p "$OUT"

echo "nemesis: $SCHEDULES schedules from seed $FIRST_SEED, $BATCH per batch; logs in $OUT"
cargo test -p dinomo-cli --test integration nemesis --no-run >/dev/null 2>&1 ||
  cargo test -p dinomo-cli --test integration nemesis --no-run

done_n=0
batch=0
while [ "$done_n" -lt "$SCHEDULES" ]; do
  n=$(( SCHEDULES - done_n < BATCH ? SCHEDULES - done_n : BATCH ))
  seed=$(( FIRST_SEED + done_n ))
  log=$OUT/batch-$(printf %03d "$batch").log
  echo "batch $batch: seeds $seed..$(( seed + n - 1 ))"
  DINOMO_NEMESIS_SEED=$seed DINOMO_NEMESIS_SCHEDULES=$n \
    timeout --kill-after=30 "$BATCH_TIMEOUT" \
    cargo test -p dinomo-cli --test integration nemesis -- --nocapture >"$log" 2>&1
  rc=$?
  [ "$rc" -eq 124 ] && echo "NEMESIS-BATCH-TIMEOUT seeds $seed..$(( seed + n - 1 ))" | tee -a "$log"
  grep -E '^NEMESIS seed=.* took_ms=' "$log" | sed 's/^/  /' | cut -c1-160
  done_n=$(( done_n + n ))
  batch=$(( batch + 1 ))
done

# One row per schedule, then the totals.
cat "$OUT"/batch-*.log | grep -E '^NEMESIS seed=.* took_ms=' | awk '
function val(k,   i, a) {
  for (i = 2; i <= NF; i++) { split($i, a, "="); if (a[1] == k) return a[2] }
  return ""
}
BEGIN {
  printf "%-11s %8s %7s %6s %6s %10s %11s %5s %6s %-9s %6s\n", "seed", "ops", "unknown",
    "errors", "faults", "violations", "recovery_ms", "repl", "derepl", "result", "took_s"
}
{
  rec = val("recovery_ms"); took = val("took_ms") / 1000
  printf "%-11s %8s %7s %6s %6s %10s %11s %5s %6s %-9s %6.1f\n", val("seed"), val("ops"),
    val("unknown"), val("errors"), val("faults"), val("violations"), rec, val("replicated"),
    val("dereplicated"), val("result"), took
  n++; ops += val("ops"); unk += val("unknown"); fl += val("faults"); vio += val("violations")
  if (val("result") != "ok") { bad++; badseeds = badseeds " " val("seed") "(" val("result") ")" }
  if (rec != "-" && rec + 0 > slow) slow = rec + 0
  if (rec == "-") stuck++
}
END {
  printf "\nschedules %d  operations %d  unknown-outcome %d  faults %d  violations %d  " \
    "failed %d  slowest recovery %d ms\n", n, ops, unk, fl, vio, bad, slow
  if (bad) printf "failed seeds:%s\n", badseeds
}' | tee "$OUT/summary.txt"

ran=$(cat "$OUT"/batch-*.log | grep -cE '^NEMESIS seed=.* took_ms=')
if [ "$ran" -lt "$SCHEDULES" ]; then
  echo "only $ran of $SCHEDULES schedules reported (a batch timed out or crashed; see $OUT)" |
    tee -a "$OUT/summary.txt"
  exit 1
fi
grep -q '^failed seeds:' "$OUT/summary.txt" && exit 1
exit 0
