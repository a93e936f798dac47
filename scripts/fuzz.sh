#!/usr/bin/env bash
# Fuzzing the decoders of untrusted bytes with cargo-fuzz, on stable Rust (no nightly needed).
# See docs/operations.md, "Fuzzing".
#
#   scripts/fuzz.sh smoke               build, then a few thousand executions per target (CI)
#   scripts/fuzz.sh long [TARGET...]    10 million executions or 30 minutes per target, one
#                                       after the other (FUZZ_RUNS / FUZZ_SECONDS override)
#   scripts/fuzz.sh run TARGET [ARGS]   one target; ARGS go to libFuzzer (-runs=, -max_len=, ...)
#   scripts/fuzz.sh repro TARGET FILE   run one input (a crash artifact) through a target
#   scripts/fuzz.sh seeds               regenerate the seed corpus (fuzz/corpus/*/seed-*)
#   scripts/fuzz.sh replay              the corpus and regressions through `cargo test` (no
#                                       libFuzzer, plain stable build)
#
# How it runs on stable: cargo-fuzz's instrumentation flags (-Cpasses=sancov-module and
# -Cllvm-args) are stable; only sanitizers need -Z flags. So targets are built with
# `--sanitizer none` (overflow checks and debug assertions stay on: cargo-fuzz turns them on).
# FUZZ_SANITIZER=address builds with AddressSanitizer instead, which on a stable toolchain
# needs RUSTC_BOOTSTRAP=1 (set here for that mode only); the targets are safe Rust, so the
# default does without it.
#
# New inputs libFuzzer finds go to fuzz/work/<target>/ and crashes to fuzz/artifacts/<target>/
# (both ignored by git); fuzz/corpus/ (the committed seeds) and fuzz/regressions/ (committed
# reproducers of fixed bugs) are only read.
set -euo pipefail
cd "$(dirname "$0")/.."

CARGO_FUZZ_VERSION=0.13.2
TARGETS=(segment_scan log_decode bucket_chain cluster_map_decode tcp_frame_decode)
SMOKE_RUNS=${FUZZ_SMOKE_RUNS:-5000}
LONG_RUNS=${FUZZ_RUNS:-10000000}
LONG_SECONDS=${FUZZ_SECONDS:-1800}

FUZZ_ARGS=(--sanitizer none)
if [ "${FUZZ_SANITIZER:-none}" != none ]; then
  export RUSTC_BOOTSTRAP=1
  FUZZ_ARGS=(--sanitizer "$FUZZ_SANITIZER" --target-dir "fuzz/target/$FUZZ_SANITIZER")
fi

ensure_cargo_fuzz() {
  if ! cargo fuzz --version 2>/dev/null | grep -q "cargo-fuzz $CARGO_FUZZ_VERSION"; then
    echo "installing cargo-fuzz $CARGO_FUZZ_VERSION"
    cargo install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked
  fi
}

# run_target TARGET LOG [libFuzzer args...]
run_target() {
  local t=$1 log=$2
  shift 2
  local dirs=("fuzz/work/$t" "fuzz/corpus/$t")
  [ -d "fuzz/regressions/$t" ] && dirs+=("fuzz/regressions/$t")
  local extra=()
  [ -f "fuzz/dicts/$t.dict" ] && extra+=("-dict=fuzz/dicts/$t.dict")
  mkdir -p "fuzz/work/$t"
  local status=0
  cargo fuzz run "${FUZZ_ARGS[@]}" "$t" "${dirs[@]}" -- \
    -print_final_stats=1 "${extra[@]}" "$@" >"$log" 2>&1 || status=$?
  local runs secs
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  secs=$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$log" | tail -1)
  printf '%-20s %12s executions %6s s  %s\n' "$t" "${runs:-?}" "${secs:-?}" \
    "$([ $status = 0 ] && echo ok || echo "FAILED (exit $status), log: $log")"
  if [ $status != 0 ]; then
    grep -E "panicked|ERROR|SUMMARY|Test unit written|artifact" "$log" | head -20 || true
  fi
  return $status
}

build() {
  ensure_cargo_fuzz
  cargo fuzz build "${FUZZ_ARGS[@]}"
}

cmd=${1:-smoke}
shift || true
case $cmd in
  smoke)
    build
    mkdir -p fuzz/work
    failed=0
    for t in "${TARGETS[@]}"; do
      run_target "$t" "fuzz/work/$t.smoke.log" -runs="$SMOKE_RUNS" || failed=1
    done
    exit $failed
    ;;
  long)
    build
    mkdir -p fuzz/work
    [ $# -gt 0 ] && TARGETS=("$@")
    failed=0
    for t in "${TARGETS[@]}"; do
      run_target "$t" "fuzz/work/$t.long.log" -runs="$LONG_RUNS" \
        -max_total_time="$LONG_SECONDS" || failed=1
    done
    exit $failed
    ;;
  run)
    t=${1:?usage: scripts/fuzz.sh run TARGET [libFuzzer args]}
    shift
    ensure_cargo_fuzz
    mkdir -p "fuzz/work/$t"
    exec cargo fuzz run "${FUZZ_ARGS[@]}" "$t" "fuzz/work/$t" "fuzz/corpus/$t" -- "$@"
    ;;
  repro)
    t=${1:?usage: scripts/fuzz.sh repro TARGET FILE}
    f=${2:?usage: scripts/fuzz.sh repro TARGET FILE}
    ensure_cargo_fuzz
    exec cargo fuzz run "${FUZZ_ARGS[@]}" "$t" "$f"
    ;;
  seeds)
    cargo run --manifest-path fuzz/Cargo.toml --example gen_seeds
    ;;
  replay)
    cargo test --manifest-path fuzz/Cargo.toml
    ;;
  *)
    sed -n '2,13p' "$0"
    exit 2
    ;;
esac
