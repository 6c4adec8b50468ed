#!/usr/bin/env bash
# Issue 27's open question on a lent host, in order of priority (whatever ran is kept if
# the call is cut): a world of one and two cadence ranks with FLODL_KEEP_CORE=1 and 0
# (worker.cores), where two bus ranks' step time goes beside the plain loop's
# (scripts/thread_split.py with py-spy: each thread's share on a core, runnable, blocked,
# its moves between cores), the kept-core policy applied from outside (--pin, the
# coordinator and Redis moved too), two and four plain processes at once
# (scripts/plain_pairs.py), bench bus, and the digits part of scripts/cpu_suite.sh. Run
# from the repository root, with .gpu/ carried (scripts/gpu_bundle.sh builds it here):
#
#   scripts/host_diag.sh [OUT_DIR]      (default: $OUT, else ./host-diag-<date>)
set -uo pipefail
o="${1:-${OUT:-host-diag-$(date -u +%Y%m%dT%H%M%S)}}"
mkdir -p "$o/spy"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=""
if [ -d .gpu/wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .gpu/wheels/*.whl .gpu/tools/*.whl >/dev/null 2>&1
    export PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
[ -d .gpu/bin ] && export PATH="$PWD/.gpu/bin:$PATH"
{ nproc; python3 -c 'import torch,sys;print(torch.__version__, sys.version)'; lscpu | grep -i 'model name\|mhz\|thread\|numa'; } > "$o/host.txt" 2>&1
echo "== FLODL_KEEP_CORE=1 (worker.cores) or 0, alternating: a world of one and two cadence ranks, 100 epochs" | tee "$o/keep.txt"
for keep in 0 1 0 1; do
    for w in 1 2; do
        echo "-- workers $w, FLODL_KEEP_CORE=$keep" >> "$o/keep.txt"
        FLODL_KEEP_CORE=$keep timeout 60 python3 -m flodl_bus.cli bench train --device cpu \
            --workers "$w" --modes cpu-cadence --epochs 100 --repeats 1 2>&1 |
            grep "^plain\|^bus\|^ *plain loop:" >> "$o/keep.txt"
    done
done
cat "$o/keep.txt"
echo "== thread_split, two cadence ranks and the plain loop, 400 epochs" | tee "$o/split-two.txt"
timeout 70 python3 scripts/thread_split.py --match plain_loop --match 'cli worker' \
    --match 'cli coordinator' --after 6 --window 3 --spy "$o/spy/two" -- \
    python3 -m flodl_bus.cli bench train --device cpu --workers 2 --modes cpu-cadence \
    --epochs 400 --repeats 1 >> "$o/split-two.txt" 2>&1
grep -v "^  run" "$o/split-two.txt" | grep -v "redis-server\|jemalloc\|bio_" | head -60
(cd "$o" && tar czf spy.tgz spy && rm -rf spy)
echo "== a core kept for each training thread from outside, or not (300 epochs)" | tee "$o/pin.txt"
# --pin: at 3 s, each training thread alone on its core, every other thread of the run
# (the rank's own, the coordinator, its record process, Redis) on the other 14
for pin in no 4,10; do
    for w in 1 2; do
        echo "-- workers $w, pin $pin" >> "$o/pin.txt"
        args=(--match plain_loop --match 'cli worker' --match 'cli coordinator'
            --match redis-server --match record/process --after 3 --window 2)
        [ "$pin" != no ] && args+=(--pin "$pin")
        timeout 60 python3 scripts/thread_split.py "${args[@]}" -- \
            python3 -m flodl_bus.cli bench train --device cpu --workers "$w" \
            --modes cpu-cadence --epochs 300 --repeats 1 2>&1 |
            grep -v "^  run \|^command\|^records\|^(vs\|^LR\|^medians\|jemalloc\|bio_" |
            grep -v "blocked 100.0%\|blocked  99" >> "$o/pin.txt"
    done
done
grep "^bus\|^plain\|^--\|main thread on\|^ *python3 *tid *[0-9]*: on a core *[1-9][0-9]\." "$o/pin.txt" | head -40
echo "== plain_pairs" | tee "$o/pairs.txt"
ROUNDS=2 COUNTS=1,2,4 timeout 60 python3 scripts/plain_pairs.py >> "$o/pairs.txt" 2>&1
cat "$o/pairs.txt"
echo "== bench bus" | tee "$o/bus.txt"
timeout 100 python3 -m flodl_bus.cli bench bus --repeats 3 >> "$o/bus.txt" 2>&1
cat "$o/bus.txt"
echo "== cpu_suite two (REPEATS=2)"
REPEATS=2 timeout 150 bash scripts/cpu_suite.sh "$o/suite" two > "$o/suite-two.log" 2>&1
grep -v "^  run \|^command\|^records\|^(vs" "$o/suite/two.txt" | head -40
