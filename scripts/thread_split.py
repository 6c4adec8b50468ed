"""Where each thread of a training process spends its wall time, seen from outside it.

Runs a command (``bench train`` as a rule) and, for each process whose command line
holds one of the ``--match`` strings, reads every thread's ``/proc/<pid>/task/<tid>``
``schedstat`` and ``status`` at the start and the end of a window of ``--window``
seconds, ``--after`` seconds after the process appeared (past its imports and its first
epochs). Per thread: the share of the window it ran on a core, waited for one (runnable,
not running: another thread or process had the core), and was blocked (a lock, the GIL,
a socket, a sleep), its voluntary and involuntary switches and its minor page faults a
second; per process, its resident memory and how much of it is in huge pages. ``--spy
DIR`` also records the window with py-spy (``FLODL_SPY_NATIVE=1``: native frames too,
pausing the process at each sample). Nothing is injected into the process: the plain
loop and a rank are seen the same way.

    python3 scripts/thread_split.py --match plain_loop --match 'cli worker' -- \\
        python3 -m flodl_bus.cli bench train --device cpu --workers 1 --epochs 400

A training thread that runs 95% of its window alone and 60% beside the rank's other
threads, blocked the rest, loses its time to waits (the GIL); one that runs 99% in both
and still steps slower loses it on the core (caches, migrations, more work a step).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

sys.path.insert(0, os.getcwd())

from flodl_bus.worker import thread_stats

#: py-spy sampling mode: FLODL_SPY_NATIVE=1 walks native frames too (pausing the process)
SPY_MODE = ["--native"] if os.environ.get("FLODL_SPY_NATIVE") == "1" else ["--nonblocking"]


@dataclass(frozen=True)
class Sample:
    name: str
    run_ns: int
    wait_ns: int
    voluntary: int
    involuntary: int
    minor_faults: int
    #: times the scheduler moved it to another core (its caches left behind)
    migrations: int


def _threads(pid: int) -> dict[int, Sample]:
    out: dict[int, Sample] = {}
    base = f"/proc/{pid}/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return out
    for t in tids:
        counts = thread_stats.sample(f"{base}/{t}")
        try:
            with open(f"{base}/{t}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/{t}/stat") as f:
                # fields after the command's closing parenthesis; minflt is the 10th field
                minflt = int(f.read().rsplit(")", 1)[1].split()[7])
        except (OSError, ValueError):
            continue
        if counts is None:
            continue
        out[int(t)] = Sample(
            name,
            counts.run_ns,
            counts.wait_ns,
            counts.voluntary,
            counts.involuntary,
            minflt,
            _migrations(f"{base}/{t}"),
        )
    return out


def _migrations(task: str) -> int:
    """How often the scheduler moved the thread between cores (``se.nr_migrations`` in
    its ``sched`` file; 0 where the kernel does not say)."""
    try:
        with open(f"{task}/sched") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "se.nr_migrations":
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _memory(pid: int) -> str:
    """Resident memory and how much of it is in transparent huge pages (fewer TLB misses
    for the same tensors)."""
    got: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "AnonHugePages"):
                    got[key] = int(rest.split()[0])
    except (OSError, ValueError):
        return "memory unknown"
    rss, huge = got.get("Rss", 0) / 1024, got.get("AnonHugePages", 0) / 1024
    return f"rss {rss:.0f} MB, {huge:.0f} MB in huge pages"


def _descends(pid: int, root: int) -> bool:
    """Whether ``pid`` is ``root`` or one of its descendants (a Redis of the run, not the
    machine's own)."""
    while pid > 1:
        if pid == root:
            return True
        try:
            with open(f"/proc/{pid}/status") as f:
                pid = next(int(ln.split()[1]) for ln in f if ln.startswith("PPid:"))
        except (OSError, StopIteration, ValueError):
            return False
    return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _pin(pid: int, label: str, core: int | None, away: set[int], lines: list[str] | None) -> None:
    """The kept-core policy, seen from outside: a training process's main thread (its
    tid is the pid) alone on ``core``, its other threads, and every thread of the other
    watched processes (the coordinator, Redis), on the ``away`` cores. Set once the
    process's threads exist: a thread inherits its creator's cores."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    moved = 0
    for tid in tids:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, {core} if tid == pid and core is not None else away)
            moved += 1
    if lines is None:
        return
    where = f"main thread on core {core}, the rest" if core is not None else "every thread"
    lines.append(f"{label} pid {pid}: {where} on cores {_span(away)} ({moved} threads)")


def _keep_pinned(pid: int, label: str, pin: tuple[int | None, set[int]]) -> None:
    """Until the process ends: a thread the training thread starts later would share its
    core (inheriting it), so every 0.2 s each thread is put where it belongs again."""
    while os.path.exists(f"/proc/{pid}"):
        time.sleep(0.2)
        _pin(pid, label, pin[0], pin[1], None)


def _span(cores: set[int]) -> str:
    """``{0, 1, 2, 5}`` as ``0-2,5``."""
    runs: list[list[int]] = []
    for c in sorted(cores):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def _watch(
    pid: int,
    label: str,
    after: float,
    window: float,
    lines: list[str],
    spy: str | None,
    pin: tuple[int | None, set[int]] | None = None,
) -> None:
    time.sleep(after)
    if pin is not None:
        _pin(pid, label, pin[0], pin[1], lines)
        threading.Thread(target=_keep_pinned, args=(pid, label, pin), daemon=True).start()
    t0, a = time.monotonic(), _threads(pid)
    sampler = None
    if spy is not None:
        # py-spy's samples of the same window (raw stacks per thread, idle ones included)
        out = os.path.join(spy, f"{label.replace(' ', '_')}-{pid}.txt")
        sampler = subprocess.Popen(
            ["py-spy", "record", "--pid", str(pid), "--idle", "--threads", *SPY_MODE,
             "-r", "200", "-d", str(max(1, round(window))), "-f", "raw", "-o", out],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    time.sleep(window)
    t1, b = time.monotonic(), _threads(pid)
    if sampler is not None:
        sampler.wait(timeout=window + 10)
    if not a or not b:
        lines.append(f"{label} pid {pid}: gone before its window ended")
        return
    wall_ns = (t1 - t0) * 1e9
    rows = []
    for tid, s1 in b.items():
        s0 = a.get(tid)
        if s0 is None:
            continue
        run, wait = s1.run_ns - s0.run_ns, s1.wait_ns - s0.wait_ns
        blocked = max(0.0, wall_ns - run - wait)
        rows.append(
            (
                run,
                f"  {s1.name[:22]:22} tid {tid:>7}: on a core {run / wall_ns:6.1%}, "
                f"runnable {wait / wall_ns:6.1%}, blocked {blocked / wall_ns:6.1%}; "
                f"switches/s voluntary {(s1.voluntary - s0.voluntary) / (t1 - t0):7.0f}, "
                f"involuntary {(s1.involuntary - s0.involuntary) / (t1 - t0):6.0f}; "
                f"minor faults/s {(s1.minor_faults - s0.minor_faults) / (t1 - t0):7.0f}; "
                f"migrations/s {(s1.migrations - s0.migrations) / (t1 - t0):6.0f}",
            )
        )
    rows.sort(reverse=True)
    lines.append(
        f"{label} pid {pid}, a {t1 - t0:.2f} s window {after:.1f} s after it appeared"
        f" ({_memory(pid)}):"
    )
    lines.extend(r for _, r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--match", action="append", required=True, help="command-line substring")
    ap.add_argument("--after", type=float, default=3.0)
    ap.add_argument("--window", type=float, default=3.0)
    ap.add_argument("--spy", help="also record each window with py-spy into this folder")
    ap.add_argument(
        "--pin",
        help="comma-separated cores, kept for training threads: at --after, the main thread "
        "(the training thread) of each process matched by a --train pattern goes alone to "
        "the next of them, in turn, and every other thread of the watched processes to the "
        "cores not in the list (whether the step loses its time to threads and processes "
        "the scheduler wakes beside it)",
    )
    ap.add_argument(
        "--train",
        action="append",
        default=None,
        help="a --match pattern whose processes train (default: plain_loop, cli worker)",
    )
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if args.spy:
        os.makedirs(args.spy, exist_ok=True)
    pins = [int(c) for c in args.pin.split(",")] if args.pin else []
    away = set(os.sched_getaffinity(0)) - set(pins)
    train = args.train or ["plain_loop", "cli worker"]
    trained = 0
    proc = subprocess.Popen(cmd)
    seen: set[int] = set()
    lines: list[str] = []
    watchers: list[threading.Thread] = []
    while proc.poll() is None:
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in seen:
                continue
            line = _cmdline(int(entry))
            hit = next((m for m in args.match if m in line), None)
            # The bench's own parent holds every match in its argv; skip it.
            if hit is None or int(entry) == proc.pid or "thread_split" in line:
                continue
            if not _descends(int(entry), proc.pid):
                continue
            seen.add(int(entry))
            pinned: tuple[int | None, set[int]] | None = None
            if pins:
                core = None
                if hit in train:
                    core, trained = pins[trained % len(pins)], trained + 1
                pinned = (core, away)
            w = threading.Thread(
                target=_watch,
                args=(
                    int(entry),
                    hit,
                    args.after,
                    args.window,
                    lines,
                    args.spy,
                    pinned,
                ),
                daemon=True,
            )
            w.start()
            watchers.append(w)
        time.sleep(0.05)
    for w in watchers:
        w.join(timeout=args.after + args.window + 15)
    print("\n".join(lines), flush=True)
    return proc.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
