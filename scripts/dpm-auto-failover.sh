#!/usr/bin/env bash
# The long form of the monitor's automatic dpm-node failover under load (issue 14;
# cli/tests/integration/dpm_auto_failover.rs, kv_nodes_follow_the_primary_the_monitor_promotes_under_load):
# three dpm-node processes run like pods, KV nodes and SDK clients reaching the primary only
# through a Service-like proxy that the monitor's watcher points, and the primary killed and
# held down N times (default 20), each once both backups are in sync; the old primary is let
# back before the next kill. Prints the AUTO-FAILOVER line: kills, operations, unknown
# outcomes, violations, the kill -> first acknowledged write times (3 s of each is
# failover_after_ms). CI runs the short form (2 kills) with the tests.
#   bash scripts/dpm-auto-failover.sh [KILLS]
set -euo pipefail
cd "$(dirname "$0")/.."
kills=${1:-20}
export DINOMO_AUTO_FAILOVER_KILLS=$kills
# Built first: the time limit below is for the run, not for a cold build.
cargo test -q -p dinomo-cli --test integration --no-run
# Each kill waits for the backups to be in sync again and for the failover delay: ~15 s.
timeout $((180 + kills * 15)) cargo test -q -p dinomo-cli --test integration \
  kv_nodes_follow_the_primary -- --nocapture 2>&1 | grep -v '^client ' | grep -E 'AUTO-FAILOVER|panicked|VIOLATION|kill [0-9]|test result'
