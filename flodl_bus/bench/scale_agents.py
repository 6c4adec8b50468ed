"""Host agents for ``flodl-bus bench scale --ranks-per-host K``: one
``python -m flodl_bus.agent`` process per K simulated ranks (``flodl_bus.agent``), and
their CPU, sampled like the other processes'."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path


def hosts(n: int, k: int) -> list[range]:
    """The ranks of each host: K consecutive ranks a host, the last one maybe fewer."""
    return [range(lo, min(n, lo + k)) for lo in range(0, n, k)]


def socket_of(work: str | Path, rank: int, k: int) -> str:
    return str(Path(work) / f"h{rank // k}.sock")


class Agents:
    """The agent processes of one run, started and ready (each printed its line)."""

    def __init__(self, url: str, run: str, work: Path, n: int, k: int) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.cpu: list[tuple[float, float]] = []
        #: set by ``close``
        self.items_per_fold = float("nan")
        self.logs = [Path(work) / f"agent{j}.log" for j in range(len(hosts(n, k)))]
        for j, ranks in enumerate(hosts(n, k)):
            cmd = [
                sys.executable, "-m", "flodl_bus.agent", "--url", url, "--run", run,
                "--host", f"h{j}", "--ranks", f"{ranks.start}-{ranks.stop - 1}",
                "--socket", socket_of(work, ranks.start, k),
            ]  # fmt: skip
            with open(self.logs[j], "w") as log:
                self.procs.append(
                    subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
                )
        for p in self.procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if "ready" not in line:
                self.close()
                raise RuntimeError(f"a host agent did not start: {line!r}")

    def sample(self) -> None:
        self.cpu.append((time.monotonic(), sum(_cpu_s(p.pid) for p in self.procs)))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.items_per_fold = self._items_per_entry()

    def _items_per_entry(self) -> float:
        """Items per folded entry over every agent (from their ``agent_stopped`` lines,
        once they stopped): how much one tick folds."""
        entries = items = 0
        for path in self.logs:
            for line in path.read_text(errors="replace").splitlines():
                if "agent_stopped" in line:
                    got = dict(re.findall(r"(folded_\w+)=(\d+)", line))
                    entries += int(got.get("folded_entries", 0))
                    items += int(got.get("folded_items", 0))
        return items / entries if entries else float("nan")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / (os.sysconf("SC_CLK_TCK") or 100)
