"""The coordinator's record written by a record process (``record.process``) is the
record the dispatching thread writes, line for line, and a record process that dies is
noticed at once, its record cut at a verified line."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import signal
import sys
import termios
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import structlog

from flodl_bus.bus.keys import RunKeys
from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.effects import Out
from flodl_bus.protocol import messages as m
from flodl_bus.record import chain
from flodl_bus.record.dispatch import DispatchRecorder
from flodl_bus.record.process import process_default
from flodl_bus.record.telemetry import EVENTS_FILE
from flodl_bus.replay import load_run, replay
from tests.coordinator.sim import Cluster


class Teed:
    """The core, each of whose calls is recorded by every recorder given, as the
    coordinator loop records them (a tick only when it emits or changes something)."""

    def __init__(
        self, core: Coordinator, recs: Sequence[DispatchRecorder], run: str = "teed"
    ) -> None:
        self.keys = RunKeys(run)
        self.core = core
        self.recs = recs
        self.last: dict[str, Any] = core.state_summary()
        self.k = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.core, name)

    def _after(self) -> dict[str, Any]:
        self.last = self.core.state_summary(self.last)
        return self.last

    def start(self, now: float) -> list[Out]:
        before = self.last
        outs = self.core.start(now)
        after = self._after()
        for rec in self.recs:
            rec.core_call("start", now=now, before=before, after=after, out=outs)
        return outs

    def handle(self, rank: int, msg: object, now: float) -> list[Out]:
        before = self.last
        outs = self.core.handle(rank, msg, now)  # type: ignore[arg-type]
        after = self._after()
        self.k += 1
        for rec in self.recs:
            rec.dispatch(
                stream=self.keys.up(rank),
                entry_id=f"{self.k}-0",
                msg=msg,
                now=now,
                before=before,
                after=after,
                out=outs,
                sender=rank,
            )
        return outs

    def tick(self, now: float) -> list[Out]:
        before = self.last
        outs = self.core.tick(now)
        after = self.core.state_summary(before)
        if outs or after != before:
            self.last = after
            for rec in self.recs:
                rec.core_call("tick", now=now, before=before, after=after, out=outs)
        return outs


def cfg(ws: int = 3) -> CoordinatorConfig:
    return CoordinatorConfig(
        mode="cpu-cadence", world_size=ws, total_samples=240, batch_size=4, num_epochs=2
    )


def test_the_record_process_writes_the_lines_and_events_the_thread_writes(
    tmp_path: Path,
) -> None:
    thread = DispatchRecorder(tmp_path / "thread", "coordinator")
    proc = DispatchRecorder(tmp_path / "proc", "coordinator", process=True)
    assert proc.in_process and not thread.in_process
    recs = (thread, proc)
    config = cfg()
    for rec in recs:
        rec.header(run="teed", config={"mode": config.mode, "num_epochs": 2})
    sim = Cluster(config, [1, 2, 3], core=Teed(Coordinator(config), recs))  # type: ignore[arg-type]
    sim.run()
    assert sim.finished is not None
    for rec in recs:
        # the other kinds of line: a runtime event, a port answer, a failed send
        rec.event("lost_broadcast", control="EpochAggregated", now=sim.now, error="refused")
        rec.port(call="meta", args={"k": (1, 2)}, result={"ok": True, "raw": b"\x00\x01"})
        rec.core_call(
            "send_failed",
            rank=1,
            msg=m.Shutdown(),
            now=sim.now,
            before={"a": 1},
            after={"a": 2},
            out=[],
        )
        rec.event("end", dispatches=sim.core.k)
        rec.flush()
        rec.close()
    assert proc.failure is None
    lines = {rec: chain.record_bytes(rec.path) for rec in recs}
    assert lines[proc] == lines[thread]
    n = len(lines[thread].splitlines())
    assert n == thread.lines == proc.lines > 100
    assert chain.check(proc.path).ended
    events = {rec: (rec.run_dir / EVENTS_FILE).read_bytes() for rec in recs}
    assert events[proc] == events[thread]
    kinds = events[proc].decode()
    assert "SyncStart" in kinds and "CpuAvgEnd" in kinds


def test_a_record_process_record_replays_identically(tmp_path: Path) -> None:
    config = cfg(2)
    rec = DispatchRecorder(tmp_path, "coordinator", process=True)
    rec.header(run="proc", config=dataclasses.asdict(config), clock="sim")
    sim = Cluster(config, [1, 3], core=Teed(Coordinator(config), [rec], "proc"))  # type: ignore[arg-type]
    sim.run()
    rec.event("end", dispatches=sim.core.k)
    rec.close()
    (coord,) = load_run(tmp_path).values()
    result = replay(coord)
    assert result.identical, result.summary()
    assert result.replayed == len(coord.core_events()) > 50


def test_flush_puts_every_line_on_disk_before_it_returns(tmp_path: Path) -> None:
    rec = DispatchRecorder(tmp_path, "coordinator", process=True)
    rec.header(run="flush")
    for k in range(200):
        rec.event("membership", k=k)
    rec.flush()
    # read while the record is still open: every line so far is there, verified
    st = chain.check(rec.path, allow_incomplete=True)
    assert st.lines == 201 and not st.ended and not st.torn
    rec.close()


def test_a_killed_record_process_is_noticed_at_once_and_its_record_verifies_to_its_cut(
    tmp_path: Path,
) -> None:
    rec = DispatchRecorder(tmp_path, "coordinator", process=True)
    remote = rec.remote
    assert remote is not None
    rec.header(run="killed")
    for k in range(50):
        rec.event("membership", k=k)
    rec.flush()
    os.kill(remote.pid, signal.SIGKILL)
    assert remote.dead.wait(30), "the watcher did not notice the record process die"
    assert rec.failure is not None and "SIGKILL" in rec.failure
    # lines after the death go nowhere, loudly (failure), and never reach the record
    rec.event("membership", k=50)
    rec.flush()
    rec.close()
    st = chain.check(rec.path, allow_incomplete=True)
    assert st.lines == 51 and not st.ended
    with pytest.raises(chain.IncompleteRecord):
        chain.check(rec.path)


def test_a_hung_record_process_is_killed_and_a_failure_once_the_pipe_stays_full_stall_s(
    tmp_path: Path,
) -> None:
    rec = DispatchRecorder(tmp_path, "coordinator", process=True)
    remote = rec.remote
    assert remote is not None
    remote.stall_s = 1.0
    rec.header(run="hung")
    rec.flush()
    os.kill(remote.pid, signal.SIGSTOP)  # alive, taking nothing
    try:
        # well past the pipe's capacity: a writer must give up within stall_s, not block
        for k in range(400):
            rec.event("membership", k=k, pad="x" * 10_000)
            if remote.dead.is_set():
                break
        assert remote.dead.wait(30), "a full pipe blocked the writer past stall_s"
        assert rec.failure is not None and "took nothing for 1 s" in rec.failure
        rec.event("membership", k=-1)
        rec.flush()  # after a failure: returns at once, waits on no reply
        with structlog.testing.capture_logs() as logs:
            rec.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(remote.pid, signal.SIGCONT)
    # the stall killed the child: the close found it gone and had nothing to kill
    assert "record_process_hung" not in [e["event"] for e in logs]
    st = chain.check(rec.path, allow_incomplete=True)
    assert st.lines >= 1 and not st.ended


def test_a_full_pipe_whose_child_resumes_within_stall_s_is_back_pressure_not_a_failure(
    tmp_path: Path,
) -> None:
    rec = DispatchRecorder(tmp_path, "coordinator", process=True)
    remote = rec.remote
    assert remote is not None
    remote.stall_s = 20.0  # far above the child's resume on a loaded host
    rec.header(run="paused")
    rec.flush()
    os.kill(remote.pid, signal.SIGSTOP)
    n = 300  # about 3 MB: three pipes' worth

    def send() -> None:
        for k in range(n):
            rec.event("membership", k=k, pad="x" * 10_000)

    sender = threading.Thread(target=send)
    try:
        sender.start()
        # the pipe full (less than one batch of room left): the writers now wait on it
        fd = remote._fd
        full = remote._capacity - 64 * 1024
        while sender.is_alive():
            queued = fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0")
            if int.from_bytes(queued, sys.byteorder) >= full:
                break
        assert sender.is_alive(), "the sender never waited on a full pipe"
    finally:
        os.kill(remote.pid, signal.SIGCONT)
    sender.join(60)
    assert not sender.is_alive()
    rec.event("end", dispatches=0)
    rec.close()
    assert rec.failure is None
    st = chain.check(rec.path)
    assert st.ended and st.lines == 1 + n + 1


def test_stop_signals_leave_the_record_process_to_its_coordinator(tmp_path: Path) -> None:
    rec = DispatchRecorder(tmp_path, "coordinator", process=True)
    remote = rec.remote
    assert remote is not None
    rec.header(run="sigint")
    rec.flush()
    os.kill(remote.pid, signal.SIGINT)  # a Ctrl-C reaches the whole process group
    os.kill(remote.pid, signal.SIGTERM)
    rec.event("end", dispatches=0)
    rec.close()  # the close waits for the child: it had to live through both signals
    assert rec.failure is None
    assert chain.check(rec.path).ended


def test_the_option_and_its_limits() -> None:
    assert process_default({}) is True
    assert process_default({"FLODL_RECORD_PROCESS": "0"}) is False
    assert process_default({"FLODL_RECORD_PROCESS": "off"}) is False
    with pytest.raises(ValueError, match="coordinator"):
        DispatchRecorder("/nonexistent-never-created", "rank", 0, process=True)


def test_a_record_process_that_cannot_start_leaves_the_record_on_the_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an interpreter that exits at once: the child never says it is ready
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with structlog.testing.capture_logs() as logs:
        rec = DispatchRecorder(tmp_path, "coordinator", process=True)
    assert not rec.in_process and rec.failure is None
    assert [e["event"] for e in logs] == ["record_process_unavailable"]
    rec.header(run="fallback")
    rec.event("end", dispatches=0)
    rec.close()
    assert chain.check(rec.path).ended


def test_a_record_process_started_above_a_thousand_open_descriptors_records_and_flushes(
    tmp_path: Path,
) -> None:
    # A coordinator of many ranks holds sockets and pipes by the thousand: the child's
    # pipes then land above select's FD_SETSIZE (1024), where select raises.
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this host allows {hard} open files")
    if soft != resource.RLIM_INFINITY and soft < 1200:
        resource.setrlimit(
            resource.RLIMIT_NOFILE,
            (1200 if hard == resource.RLIM_INFINITY else min(hard, 4096), hard),
        )
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        assert max(held) >= 1024
        rec = DispatchRecorder(tmp_path, "coordinator", process=True)
        assert rec.in_process and rec.remote is not None  # a child, not the thread
        rec.header(run="many-fds")
        for k in range(50):
            rec.event("membership", k=k)
        rec.flush()  # waits on the child's reply line
        assert chain.check(rec.path, allow_incomplete=True).lines == 51
        rec.event("end", dispatches=0)
        rec.close()
        assert chain.check(rec.path).ended
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
