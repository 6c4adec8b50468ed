#!/usr/bin/env bash
# The GPU tables of BENCHMARKS.md: run from the repository root on a CUDA host.
#
#   scripts/gpu_suite.sh [OUT_DIR [PART...]]   (default: ./gpu-suite-<date>, every part)
#
# Parts (two GPUs or more): gpu allreduce allreduce-eager train-cifar train-cifar-slow
# train-wide train-wide-diloco kill; kill-sync kill-slow need four GPUs; one GPU: gpu
# train-cifar-1 train-wide-1. Naming parts lets a lent host with a per-call time limit run
# the suite in several calls into one OUT_DIR.
#
# kill (issue 33; bench kill): SIGKILL the last rank mid-epoch, with one rank per GPU (4 on
# a host of four or more, else 2: the lone survivor's SingleSurvivor stop). Each prints the
# recovery's times, every TCP socket of the run off loopback (none expected: the check
# that the groups formed on loopback), coverage, shares per epoch, the final eval beside
# an undisturbed run, and the replay of the records on the CPU.
#
# A host without internet can take the Python dependencies as wheels and a redis-server
# from .gpu/ (see BENCHMARKS.md, "GPU suite"): .gpu/wheels/*.whl are installed into
# /tmp/site, .gpu/bin goes first on PATH. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
# SUITE=quick runs one repeat of each table (a smoke run); the default is 3 (medians).
set -uo pipefail

out="${1:-gpu-suite-$(date -u +%Y%m%dT%H%M%S)}"
shift || true
parts=" $* "
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
if [ -d .gpu/wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .gpu/wheels/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
[ -d .gpu/bin ] && export PATH="$PWD/.gpu/bin:$PATH"

repeats=3
[ "${SUITE:-full}" = quick ] && repeats=1
# The runs' records and logs stay off OUT_DIR (a lent host returns a few files): they
# come back as one archive, runs.tgz, at the end.
runs=$(mktemp -d /tmp/gpu-suite-runs-XXXXXX)
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
bench() { python3 -m flodl_bus.cli bench "$@"; }
step() {  # step NAME CMD...: run, keep its output, go on after a failure
    local name=$1
    shift
    if [ "$parts" != "  " ] && [[ "$parts" != *" $name "* ]]; then
        return 0
    fi
    echo "=== $name: $*" | tee -a "$out/suite.log"
    "$@" 2>&1 | tee "$out/$name.txt" | tail -40
    echo "=== $name exit ${PIPESTATUS[0]}" | tee -a "$out/suite.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpus.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' \
    | tee -a "$out/gpus.txt"

step gpu bench gpu
if [ "$gpus" -ge 2 ]; then
    step allreduce bench allreduce --params-m 100 --rounds 10
    step allreduce-eager bench allreduce --params-m 100 --rounds 10 --eager-norms
    step train-cifar bench train --job flodl_bus.examples.cifar_resnet:job --workers 2 \
        --epochs 8 --modes nccl-cadence,nccl-sync --ddp --repeats "$repeats" \
        --json "$out/train-cifar.json"
    step train-cifar-slow bench train --job flodl_bus.examples.cifar_resnet:job --workers 2 \
        --epochs 8 --modes nccl-cadence --ddp --slow-rank 1 --slow-factor 2 \
        --repeats "$repeats" --json "$out/train-cifar-slow.json"
    step train-wide bench train --job flodl_bus.examples.cifar_wide:job --workers 2 \
        --modes nccl-cadence,nccl-sync,cpu-async --ddp --no-plain --repeats 1 \
        --json "$out/train-wide.json"
    step train-wide-diloco bench train --job flodl_bus.examples.cifar_wide:job --workers 2 \
        --modes nccl-cadence,cpu-async --no-plain --repeats 1 --up-args="--outer nesterov" \
        --json "$out/train-wide-diloco.json"
    # Two GPUs: the lone survivor stops (SingleSurvivor), so no final eval to compare.
    kill_ranks=2 reference=""
    [ "$gpus" -ge 4 ] && kill_ranks=4 reference="--reference"
    step kill bench kill --job flodl_bus.examples.cifar_resnet:job --workers "$kill_ranks" \
        --mode nccl-cadence --epochs 6 --after 2 $reference --run-dir "$runs/kill"
    if [ "$gpus" -ge 4 ]; then
        step kill-sync bench kill --job flodl_bus.examples.cifar_resnet:job --workers 4 \
            --mode nccl-sync --epochs 6 --after 2 --reference --run-dir "$runs/kill-sync"
        step kill-slow bench kill --job flodl_bus.examples.cifar_resnet:job --workers 4 \
            --mode nccl-cadence --epochs 6 --after 2 --slow-rank 1 --slow-factor 2 \
            --reference --run-dir "$runs/kill-slow"
    fi
else
    # One GPU: one rank under the bus against the plain loop (no DDP, no all-reduce).
    step train-cifar-1 bench train --job flodl_bus.examples.cifar_resnet:job --workers 1 \
        --epochs 8 --modes nccl-cadence --repeats "$repeats" --json "$out/train-cifar-1.json"
    step train-wide-1 bench train --job flodl_bus.examples.cifar_wide:job --workers 1 \
        --epochs 6 --modes nccl-cadence --repeats 1 --json "$out/train-wide-1.json"
fi
if [ -n "$(ls -A "$runs")" ]; then
    tar czf "$out/runs.tgz" -C "$runs" . && echo "records and logs of the runs: $out/runs.tgz"
fi
echo "results in $out"
