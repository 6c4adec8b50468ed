#!/usr/bin/env bash
# Issue 19 items 5 and 2 on a bigger host: the code before the fast-rank bridge and the
# world-of-one skip against the code after, interleaved, each call beside its own DDP.
#
#   scripts/idle_suite.sh BEFORE_TREE [OUT_DIR]
#
# BEFORE_TREE is a copy of the package before the change, made where git is:
#   git archive 9015dc8 | tar -x -C /tmp/idle-before
# (on a device host, put it in an ignored folder of the checkout and carry it). Python
# dependencies and redis-server as in scripts/gpu_suite.sh (.gpu/wheels, .gpu/bin).
# On any host: charrnn and digits, 2 ranks on gloo, homogeneous and with rank 1 slowed
# 2x (scripts/idle_compare.py); then one rank under nccl-sync and nccl-cadence against
# the plain loop (item 2: a world of one, no rounds): cifar_resnet on a CUDA host,
# charrnn otherwise.
set -uo pipefail

before="${1:?usage: scripts/idle_suite.sh BEFORE_TREE [OUT_DIR]}"
out="${2:-idle-suite-$(date -u +%Y%m%dT%H%M%S)}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
site=""
if [ -d .gpu/wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .gpu/wheels/*.whl || exit 1
    site="/tmp/site:"
fi
[ -d .gpu/bin ] && export PATH="$PWD/.gpu/bin:$PATH"
export PYTHONPATH="$site$PWD"
nproc | tee "$out/host.txt"
uptime | tee -a "$out/host.txt"

compare() {  # compare NAME ARGS...: scripts/idle_compare.py, output kept
    local name=$1
    shift
    echo "=== $name" | tee -a "$out/suite.log"
    python3 scripts/idle_compare.py --before "$before" --after "$PWD" --repeats 3 \
        --out "$out/$name" "$@" 2>&1 | tee "$out/$name.txt" | tail -12
}
compare charrnn --job flodl_bus.examples.charrnn:job --modes nccl-cadence,nccl-sync
compare digits --job flodl_bus.examples.digits:job --modes nccl-cadence,nccl-sync
compare charrnn-slow --job flodl_bus.examples.charrnn:job --modes nccl-cadence \
    --slow-rank 1 --slow-factor 2
compare digits-slow --job flodl_bus.examples.digits:job --modes nccl-cadence \
    --slow-rank 1 --slow-factor 2

# One rank (item 2): nccl-sync and nccl-cadence against the plain loop, each tree in turn.
solo_job=flodl_bus.examples.charrnn:job
if python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    solo_job=flodl_bus.examples.cifar_resnet:job
fi
for rep in 1 2 3; do
    for tree in before after; do
        dir="$before"
        [ "$tree" = after ] && dir="$PWD"
        echo "=== solo $tree $rep" | tee -a "$out/suite.log"
        PYTHONPATH="$site$dir" python3 -m flodl_bus.cli bench train --job "$solo_job" \
            --workers 1 --modes nccl-sync,nccl-cadence --repeats 1 \
            --json "$out/solo-$tree-$rep.json" 2>&1 | tee "$out/solo-$tree-$rep.txt" | tail -8
    done
done
echo "results in $out"
