#!/usr/bin/env bash
# The long form of the dpm-node failover test (issue 14): `dinomo up --dpm-replicas 3`, SDK
# clients on a checked workload, and the primary killed with SIGKILL N times (default 50) at
# random moments, each once the backups have been in sync for a while. Prints the
# DPM-FAILOVER line: kills, promotions, operations, unknown outcomes, violations, failover
# times (median and max). CI runs the short form (3 kills) with the tests.
#   bash scripts/dpm-failover.sh [KILLS] [SEED]
# DINOMO_DPM_FAILOVER_FABRIC=tcp|shm picks the KV nodes' fabric (default tcp; shm: the KV nodes
# forward each batch they store, docs/decisions/0007 "One-sided fabrics").
set -euo pipefail
cd "$(dirname "$0")/.."
kills=${1:-50}
export DINOMO_DPM_FAILOVER_KILLS=$kills
export DINOMO_DPM_FAILOVER_FABRIC=${DINOMO_DPM_FAILOVER_FABRIC:-tcp}
if [ -n "${2:-}" ]; then export DINOMO_DPM_FAILOVER_SEED=$2; fi
# Built first: the time limit below is for the run, not for a cold build.
cargo test -q -p dinomo-cli --test integration --no-run
# Each kill waits for the backups to be in sync again (seconds), so allow ~10 s per kill.
timeout $((120 + kills * 10)) cargo test -q -p dinomo-cli --test integration \
  dpm_failover -- --nocapture 2>&1 | grep -v '^client ' | grep -E 'DPM-FAILOVER|dpm failover|killed|answered|panicked|VIOLATION|test result'
