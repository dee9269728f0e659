#!/usr/bin/env bash
# The test suite as CI runs it, on a busy machine: RUNS fresh clones of this repository's COMMIT,
# one after another, each running .ci/run (new virtual environment, install, `make test`) with
# BUSY busy processes beside it; `../shared` is linked beside each clone when this checkout has
# one. Prints one line per run (exit code, wall seconds, pytest's summary) into ROOT/series.txt.
#     tools/suite_under_load.sh [BUSY=4] [COMMIT=HEAD] [ROOT=/tmp/suite-under-load] [RUNS=3]
set -u
BUSY=${1:-4}; COMMIT=${2:-HEAD}; ROOT=${3:-/tmp/suite-under-load}; RUNS=${4:-3}
REPO=$(git rev-parse --show-toplevel)
COMMIT=$(git -C "$REPO" rev-parse --short "$COMMIT")
mkdir -p "$ROOT"
for n in $(seq "$RUNS"); do
    DIR=$ROOT/run$n
    rm -rf "$DIR" && mkdir -p "$DIR" && git clone -q "$REPO" "$DIR/main" && git -C "$DIR/main" checkout -q "$COMMIT"
    [ -d "$REPO/../shared" ] && ln -s "$(cd "$REPO/../shared" && pwd)" "$DIR/shared"
    pids=()
    for _ in $(seq "$BUSY"); do python3 -c "while True: pass" & pids+=($!); done
    start=$(date +%s)
    (cd "$DIR/main" && .ci/run) > "$DIR/ci.log" 2>&1; rc=$?
    end=$(date +%s)
    kill "${pids[@]}"
    summary=$(grep -E "passed|failed" "$DIR/ci.log" | grep -E " in [0-9.]+s" | tail -1)
    echo "run $n: rc=$rc wall=$((end-start)) s busy=$BUSY commit=$COMMIT started=$(date -u -d "@$start" +%H:%M) | $summary" | tee -a "$ROOT/series.txt"
done
