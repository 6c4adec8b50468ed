#!/usr/bin/env bash
# Interleaved A/B of a rank sizing its threads to the work (the default, FLODL_TUNE_THREADS=1)
# against its share (FLODL_TUNE_THREADS=0), on the host's CPUs (BENCHMARKS.md, "A rank
# sizes its threads to the work"): digits 30 epochs, a world of one beside the plain loop,
# two ranks of cpu-cadence and cpu-sync beside DDP, then once each (sized) the slow rank
# and charrnn. Every bus run's line names the counts its ranks kept.
#
#   scripts/threads_ab.sh OUT_DIR [PAIRS]     (default 3 pairs; EPOCHS=N for the digits pairs)
#
# Every run's whole output goes to OUT_DIR/runs.log, a line a run to OUT_DIR/ab.log.
# Dependencies as in cpu_suite.sh (.gpu/wheels, .gpu/bin on a host without internet).
set -uo pipefail
out=$(realpath -m "$1") pairs=${2:-3}
mkdir -p "$out"
if [ -d .gpu/wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .gpu/wheels/*.whl || exit 1
    export PATH="/tmp/site/bin:$PATH"
fi
[ -d .gpu/bin ] && export PATH="$PWD/.gpu/bin:$PATH"
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES="" PYTHONPATH="/tmp/site:$PWD"
one() {  # one TAG TUNE ARGS...: one bench run, its time, where it went, the counts kept
    local tag=$1 tune=$2
    shift 2
    FLODL_TUNE_THREADS=$tune timeout 150 python3 -m flodl_bus.cli bench train --device cpu \
        --repeats 1 "$@" > "$out/last.txt" 2>&1
    { echo "=== $tag"; cat "$out/last.txt"; } >> "$out/runs.log"
    local runs line
    runs=$(grep "^  run 1/1" "$out/last.txt" | sed 's/^  run 1\/1 //; s/  */ /g' | tr '\n' ';')
    line=$(grep -A1 "^where a rank" "$out/last.txt" | tail -1)
    echo "$tag | $runs | $line" | tee -a "$out/ab.log"
}
w1=(--workers 1 --modes cpu-cadence --epochs ${EPOCHS:-30})
w2=(--workers 2 --modes cpu-cadence,cpu-sync --epochs ${EPOCHS:-30} --target 0.97)
for i in $(seq "$pairs"); do
    one w1-sized 1 "${w1[@]}" --run-dir "/tmp/tab-w1t-$i"
    one w1-share 0 --no-plain "${w1[@]}" --run-dir "/tmp/tab-w1s-$i"
    one w2-sized 1 --ddp "${w2[@]}" --run-dir "/tmp/tab-w2t-$i"
    one w2-share 0 --no-plain "${w2[@]}" --run-dir "/tmp/tab-w2s-$i"
done
one slow-sized 1 --workers 2 --modes cpu-cadence --ddp --epochs 30 --slow-rank 1 \
    --slow-factor 2 --run-dir /tmp/tab-slow
one charrnn-sized 1 --job flodl_bus.examples.charrnn:job --workers 2 --modes cpu-cadence \
    --ddp --run-dir /tmp/tab-char
echo "results in $out"
