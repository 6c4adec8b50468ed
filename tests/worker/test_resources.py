"""A rank's resource sample reads its own process: RSS from the kernel, nothing GPU on
the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from flodl_bus.worker.resources import rss_bytes, sample

#: a child that holds 96 MiB it touched, says its sample and its pid, then waits
_CHILD = """
import os, sys, torch
from flodl_bus.worker.resources import sample
held = torch.ones(96 * 2**20 // 4)
s = sample(torch.device("cpu"))
print(os.getpid(), s.rss_bytes, flush=True)
sys.stdin.readline()
"""


def vm_rss(pid: int | str) -> int:
    """The kernel's other account of a process's RSS (``status``, not ``statm``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_a_sample_reports_the_rss_of_the_process_that_takes_it() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        pid_text, rss_text = proc.stdout.readline().split()
        reported = int(rss_text)
        # read from outside while the child still holds what it sampled
        seen = vm_rss(pid_text)
        proc.stdin.write("\n")
        proc.stdin.flush()
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == 0
    assert int(pid_text) != os.getpid()
    assert reported > 96 * 2**20  # it holds the tensor it touched
    assert abs(reported - seen) < 16 * 2**20, (reported, seen)


def test_rss_grows_with_memory_the_process_touches() -> None:
    before = rss_bytes()
    held = torch.ones(64 * 2**20 // 4)
    after = rss_bytes()
    assert before is not None and after is not None
    assert after - before > 48 * 2**20
    del held


def test_a_cpu_rank_samples_no_gpu_fields() -> None:
    s = sample(torch.device("cpu"))
    assert s.rss_bytes is not None and s.rss_bytes > 0
    assert s.device_index is None and s.gpu_util_percent is None
    assert s.vram_allocated_bytes is None and s.vram_reserved_peak_bytes is None
    assert s.vram_total_bytes is None
