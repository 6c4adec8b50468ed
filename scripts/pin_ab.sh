#!/usr/bin/env bash
# Interleaved A/B of the control plane on cores of its own (FLODL_PIN_CPUS=1: `up` keeps
# the last core for Redis, the coordinator and every rank's own threads, and gives each
# rank's training thread its slice of the rest; worker.host.cpu_layout) against the
# scheduler's placement, on the host's CPUs: digits 30 epochs, a world of one sized (the
# default) and at 15 threads, two ranks of cpu-cadence; then one thread sweep (1, 2, 4,
# 8 threads, FLODL_NUM_THREADS for the plain loop and the bus alike), pinned.
#
#   scripts/pin_ab.sh OUT_DIR [PAIRS]      (default 3 pairs)
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
one() {  # one TAG PIN THREADS ARGS...: one bench run (THREADS "": the default share)
    local tag=$1 pin=$2 threads=$3
    shift 3
    FLODL_PIN_CPUS=$pin FLODL_NUM_THREADS=$threads timeout 150 python3 -m flodl_bus.cli \
        bench train --device cpu --repeats 1 --epochs "${EPOCHS:-30}" "$@" > "$out/last.txt" 2>&1
    { echo "=== $tag"; cat "$out/last.txt"; } >> "$out/runs.log"
    local runs line
    runs=$(grep "^  run 1/1" "$out/last.txt" | sed 's/^  run 1\/1 //; s/  */ /g' | tr '\n' ';')
    line=$(grep -A1 "^where a rank" "$out/last.txt" | tail -1)
    echo "$tag | $runs | $line" | tee -a "$out/ab.log"
}
w1=(--workers 1 --modes cpu-cadence)
w2=(--workers 2 --modes cpu-cadence)
for i in $(seq "$pairs"); do
    one w1-sized-unpinned 0 "" "${w1[@]}" --run-dir "/tmp/pab-a-$i"
    one w1-sized-pinned 1 "" --no-plain "${w1[@]}" --run-dir "/tmp/pab-b-$i"
    one w1-15-unpinned 0 15 --no-plain "${w1[@]}" --run-dir "/tmp/pab-c-$i"
    one w1-15-pinned 1 15 --no-plain "${w1[@]}" --run-dir "/tmp/pab-d-$i"
    one w2-unpinned 0 "" --ddp "${w2[@]}" --run-dir "/tmp/pab-e-$i"
    one w2-pinned 1 "" --no-plain "${w2[@]}" --run-dir "/tmp/pab-f-$i"
done
for k in 1 2 4 8; do
    one "w1-$k-pinned" 1 "$k" "${w1[@]}" --run-dir "/tmp/pab-t$k"
done
grep -h "cpus_laid_out" /tmp/pab-*/*/rank*.log 2>/dev/null | head -3
echo "results in $out"
