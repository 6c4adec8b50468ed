#!/usr/bin/env bash
# Issue 27's CPU tables (BENCHMARKS.md, "A rank off the critical path"): every contender on
# the host's CPUs (a GPU host's devices hidden), run from the repository root.
#
#   scripts/cpu_suite.sh [OUT_DIR [PART...]]   (default: ./cpu-suite-<date>, every part)
#
# Parts: one (a world of one against the plain loop, the default thread share),
# threads (the same at 1, 2, 4 and 8 threads), two (digits on 2 ranks: cadence, sync,
# async, DDP), slow (rank 1 made 2x slower), charrnn, policies (a world of one under
# other thread policies: 14 and 8 threads, OMP_WAIT_POLICY=PASSIVE; bench worker),
# rankio (a rank's Redis work on threads against a process of its own, alternating: a
# world of one for 100 epochs and two ranks for 30, then bench worker with both).
# Dependencies as in gpu_suite.sh (.gpu/wheels, .gpu/bin on a host without internet:
# scripts/gpu_bundle.sh builds them on a machine that has them).
# REPEATS=N (default 3) runs of each.
set -uo pipefail

out="${1:-cpu-suite-$(date -u +%Y%m%dT%H%M%S)}"
shift || true
parts=" $* "
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=""
if [ -d .gpu/wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .gpu/wheels/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/site/bin:$PATH"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
[ -d .gpu/bin ] && export PATH="$PWD/.gpu/bin:$PATH"
repeats="${REPEATS:-3}"
nproc | tee "$out/host.txt"
step() {  # step NAME CMD...: run, keep its output, go on after a failure
    local name=$1
    shift
    if [ "$parts" != "  " ] && [[ "$parts" != *" $name "* ]]; then
        return 0
    fi
    echo "=== $name: $*" | tee -a "$out/suite.log"
    "$@" 2>&1 | tee "$out/$name.txt" | grep -v '^  run \|^command\|^records\|^(vs'
    echo "=== $name exit ${PIPESTATUS[0]}" | tee -a "$out/suite.log"
}
train() { python3 -m flodl_bus.cli bench train --device cpu "$@"; }
threads() {
    for t in 1 2 4 8; do
        echo "--- FLODL_NUM_THREADS=$t"
        FLODL_NUM_THREADS=$t train --workers 1 --modes cpu-cadence --epochs 30 --repeats 1 \
            --run-dir "/tmp/cpu-suite-threads-$t"
    done
}
policies() {
    for p in FLODL_NUM_THREADS=14 FLODL_NUM_THREADS=8 OMP_WAIT_POLICY=PASSIVE; do
        echo "--- $p"
        env "$p" python3 -m flodl_bus.cli bench train --device cpu --workers 1 \
            --modes cpu-cadence --epochs 30 --repeats "$repeats" --run-dir "/tmp/cpu-suite-$p"
    done
    echo "--- bench worker"
    python3 -m flodl_bus.cli bench worker --repeats "$repeats"
}
rankio() {
    local io
    for io in threads process threads process; do
        echo "--- FLODL_RANK_IO=$io, a world of one"
        FLODL_RANK_IO=$io train --workers 1 --modes cpu-cadence --epochs 100 --repeats 1
        echo "--- FLODL_RANK_IO=$io, two ranks"
        FLODL_RANK_IO=$io train --workers 2 --modes cpu-cadence --no-plain --epochs 30 \
            --repeats 1
    done
    echo "--- bench worker"
    python3 -m flodl_bus.cli bench worker --repeats "$repeats"
}
step rankio rankio
step one train --workers 1 --modes cpu-cadence --epochs 30 --repeats "$repeats"
step threads threads
step two train --workers 2 --modes cpu-cadence,cpu-sync,cpu-async --ddp --epochs 30 \
    --target 0.97 --repeats "$repeats"
step slow train --workers 2 --modes cpu-cadence --ddp --epochs 30 --slow-rank 1 \
    --slow-factor 2 --repeats "$repeats"
step charrnn train --job flodl_bus.examples.charrnn:job --workers 2 --modes cpu-cadence \
    --ddp --repeats 1
step policies policies
echo "results in $out"
