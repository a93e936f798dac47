#!/usr/bin/env bash
# What CI runs for the Python SDK (sdk/python), from anywhere:
#   1. a fresh venv in a temporary directory, the package installed from a copy of this folder
#      (not editable: the tests import what pip installed) with its `dev` extra (pinned
#      grpcio-tools, pytest, mypy);
#   2. the stub-sync check: the gRPC stubs regenerated from proto/proto/ into a temporary
#      directory must equal the shipped src/dinomo/_proto/;
#   3. mypy over the package; the routing vectors by the document-only checker
#      (scripts/check-routing-vectors.py);
#   4. pytest: unit tests, then real clusters started with `dinomo up` from $DINOMO_BIN_DIR
#      (default <repo>/target/debug), on 127.0.0.1 only.
# Bounded: pytest gets 600 s at most. Every `dinomo up` the tests start leads its own process
# group, recorded in a pid file; on exit (success, failure or signal) any group still alive is
# killed by id, and the temporary directory removed.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
export DINOMO_BIN_DIR=${DINOMO_BIN_DIR:-$REPO/target/debug}
PYTHON=${PYTHON:-python3}
if [ ! -x "$DINOMO_BIN_DIR/dinomo" ]; then
    echo "ci.sh: no dinomo binary in $DINOMO_BIN_DIR (cargo build -p dinomo-cli, or set DINOMO_BIN_DIR)" >&2
    exit 1
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/dinomo-sdk-ci.XXXXXX")
export DINOMO_TEST_PIDFILE="$WORK/clusters.pids"
: >"$DINOMO_TEST_PIDFILE"

CHILD=""
# Runs a step in the background and waits for it, so that a signal to this script is handled
# at once (bash defers traps while a foreground command runs).
run() {
    "$@" &
    CHILD=$!
    local rc=0
    wait "$CHILD" || rc=$?
    CHILD=""
    return "$rc"
}

cleanup() {
    local status=$?
    if [ -n "$CHILD" ] && kill -0 "$CHILD" 2>/dev/null; then
        # The step still running (pip, or `timeout` running pytest, which passes it on).
        kill -TERM "$CHILD" 2>/dev/null || true
        wait "$CHILD" 2>/dev/null || true
    fi
    # Whatever clusters the tests started and did not stop (a test session killed before its
    # finalizers ran): each `dinomo up` leads its own process group.
    while read -r pgid; do
        [ -n "$pgid" ] || continue
        if kill -0 -- "-$pgid" 2>/dev/null; then
            echo "ci.sh: killing leftover cluster process group $pgid" >&2
            kill -TERM -- "-$pgid" 2>/dev/null || true
            sleep 2
            kill -KILL -- "-$pgid" 2>/dev/null || true
        fi
    done <"$DINOMO_TEST_PIDFILE"
    rm -rf "$WORK"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "== venv and install ($("$PYTHON" --version))"
"$PYTHON" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
# Installed from a copy, so that the build leaves nothing (build/, *.egg-info) in the tree.
mkdir "$WORK/pkg"
tar -C "$HERE" --exclude=./build --exclude='*.egg-info' --exclude=__pycache__ --exclude=.pytest_cache -cf - . \
    | tar -C "$WORK/pkg" -xf -
run timeout 600 "$VPY" -m pip install -q --disable-pip-version-check "$WORK/pkg[dev]"

echo "== stub-sync check"
run "$VPY" "$HERE/tools/gen_stubs.py" "$WORK/stubs" >/dev/null
if ! diff -r -x __pycache__ "$HERE/src/dinomo/_proto" "$WORK/stubs"; then
    echo "ci.sh: the shipped stubs differ from proto/proto/: run" >&2
    echo "  python sdk/python/tools/gen_stubs.py   (with grpcio-tools as pinned in pyproject.toml)" >&2
    exit 1
fi

echo "== mypy"
(cd "$HERE" && run "$WORK/venv/bin/mypy" --cache-dir "$WORK/mypy-cache" src/dinomo)

echo "== routing vectors (document-only checker)"
"$VPY" "$REPO/scripts/check-routing-vectors.py" "$REPO/docs/routing-vectors.json"

echo "== pytest (binaries from $DINOMO_BIN_DIR)"
cd "$HERE"
run timeout --kill-after=20 600 "$VPY" -m pytest -p no:cacheprovider --basetemp="$WORK/pytest" -v -rs tests
