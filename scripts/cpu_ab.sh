#!/usr/bin/env bash
# Interleaved A/B of two trees on the host's CPUs (BENCHMARKS.md, issue 27's later session):
# bus cpu-cadence on digits, 30 epochs, a world of one and two ranks, one run per
# contender per pair, OLD and this tree alternating (the host drifts between calls more
# than most changes move).
#
#   scripts/cpu_ab.sh OUT_DIR OLD_TREE [PAIRS]      (OLD_TREE: e.g. `git archive REV | tar -x -C DIR`)
#
# REFS=1 gives this tree's runs their references from the same run: the plain loop (and
# DDP beside the two ranks). Every run's whole output goes to OUT_DIR/runs.log.
#
# Dependencies as in cpu_suite.sh (.gpu/wheels on a host without internet).
set -uo pipefail
out=$(realpath -m "$1") old=$(realpath "$2") pairs=${3:-4}
mkdir -p "$out"
if [ -d .gpu/wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .gpu/wheels/*.whl || exit 1
    export PATH="/tmp/site/bin:$PATH"
fi
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=""
one() {  # one TAG TREE ARGS...: one bench run, its time and where it went
    local tag=$1 tree=$2
    shift 2
    # From the tree's own directory: `python3 -m` puts the working directory first on
    # sys.path, ahead of PYTHONPATH, so a run started from this checkout would import this
    # checkout whatever tree it names (every "old" run before 2026-12-02 did).
    (cd "$tree" && PYTHONPATH="/tmp/site:$tree" timeout 120 python3 -m flodl_bus.cli bench \
        train --device cpu --repeats 1 "$@") > "$out/last.txt" 2>&1
    { echo "=== $tag"; cat "$out/last.txt"; } >> "$out/runs.log"
    local t line
    t=$(grep "^  run 1/1 bus" "$out/last.txt" | sed 's/.*train *\([0-9.]*\) s.*/\1/')
    line=$(grep -A1 "^where a rank" "$out/last.txt" | tail -1)
    echo "$tag train $t | $line" | tee -a "$out/ab.log"
}
refs1=(--no-plain) refs2=(--no-plain)
if [ "${REFS:-0}" = 1 ]; then refs1=() refs2=(--ddp); fi
for i in $(seq "$pairs"); do
    one w1-new "$PWD" "${refs1[@]}" --workers 1 --modes cpu-cadence --epochs 30 --run-dir "/tmp/ab-w1n-$i"
    one w1-old "$old" --no-plain --workers 1 --modes cpu-cadence --epochs 30 --run-dir "/tmp/ab-w1o-$i"
    one w2-new "$PWD" "${refs2[@]}" --workers 2 --modes cpu-cadence --epochs 30 --run-dir "/tmp/ab-w2n-$i"
    one w2-old "$old" --no-plain --workers 2 --modes cpu-cadence --epochs 30 --run-dir "/tmp/ab-w2o-$i"
done
