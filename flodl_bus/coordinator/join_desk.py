"""Forming the world: the coordinator's side of the join stream (DESIGN §2).

``form_world`` admits workers from the ``join`` stream (``membership.Admission``, the
sans-IO rules) until the world forms; ``JoinDesk`` reads the Hellos and posts the
Assign / Reject answers. After the world formed, ``CoordinatorLoop`` keeps polling the
desk for late Hellos.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

import structlog

from flodl_bus.coordinator.membership import Admission, Answer
from flodl_bus.protocol.messages import Assign, Hello, JoinMsg, Reject

log = structlog.get_logger("flodl_bus.coordinator")


class Interrupted(Exception):
    """A stop was requested while the world was still forming."""


class WorldNotFormed(Exception):
    """The world did not form within the join timeout; the message names why."""


class JoinPort(Protocol):
    """The join stream as the runtime uses it (``bus.join.JoinStream``)."""

    def post(self, msg: JoinMsg) -> str: ...

    def read(self, after: str, block_ms: int | None) -> tuple[list[tuple[str, JoinMsg]], str]: ...


class JoinDesk:
    """The coordinator's side of the join stream: read Hellos, post the answers.

    The stream outlives a run (a run id reused on the same Redis, a persisted volume),
    so it may hold Hellos of an earlier incarnation whose workers are long gone. A Hello
    that some *other* coordinator already answered (an Assign or Reject we did not post)
    is stale and skipped: a dead worker must never take a rank. Hellos nobody answered
    are taken as live (a worker may say Hello before the coordinator starts).
    """

    def __init__(
        self,
        join: JoinPort,
        admission: Admission,
        *,
        clock: Callable[[], float] = time.monotonic,
        after: str = "0",
    ) -> None:
        self.join = join
        self.admission = admission
        self.clock = clock
        #: Where Hellos start counting. A worker says Hello only after it read the
        #: coordinator's identity, so the coordinator starts at the join stream's top as
        #: it published that: an earlier Hello is of an earlier incarnation's worker,
        #: whose key was agreed with a coordinator that is gone.
        self.cursor = after
        self._ours: set[str] = set()
        self.stale: set[str] = set()

    def poll(
        self, block_ms: int | None, recorder: Callable[..., None] | None = None
    ) -> list[Answer]:
        got, self.cursor = self.join.read(self.cursor, block_ms)
        now = self.clock()
        adm = self.admission
        # Answers first: a stale Hello comes before its answer, often in the same read.
        for eid, msg in got:
            if (
                isinstance(msg, (Assign, Reject))
                and eid not in self._ours
                and msg.worker_id not in self.stale
            ):
                self.stale.add(msg.worker_id)
                adm.forget(msg.worker_id)
        answers: list[Answer] = []
        for eid, msg in got:
            if not isinstance(msg, Hello) or msg.worker_id in self.stale:
                continue
            log.info(
                "worker_hello",
                worker=msg.worker_id,
                host=msg.host,
                device=msg.device,
                requested_rank=msg.requested_rank,
            )
            if recorder is not None:
                recorder("hello", entry=eid, msg=msg, now=now)
            answers += adm.hello(msg, now)
        answers += adm.poll(now)
        for a in answers:
            self._ours.add(self.join.post(a))
            if isinstance(a, Reject):
                log.warning("worker_rejected", worker=a.worker_id, reason=a.reason)
            else:
                log.info(
                    "worker_admitted", worker=a.worker_id, rank=a.rank, world_size=a.world_size
                )
            if recorder is not None:
                recorder("join_answer", msg=a, now=now)
        return answers


def form_world(desk: JoinDesk, *, stop: threading.Event | None = None, block_ms: int = 200) -> None:
    """Admit workers until the world forms."""
    admission = desk.admission
    admission.open(desk.clock())
    last_note = started = desk.clock()
    while not admission.formed:
        if stop is not None and stop.is_set():
            raise Interrupted("stopped while the world was forming")
        desk.poll(block_ms)
        now = desk.clock()
        # The minimum-size world forms at the timeout if it can; a grace period later
        # (a few polls) it could not, and nothing must wait forever for absent workers.
        if not admission.formed and now - started > admission.join_timeout + 1.0:
            failed = getattr(desk.join, "auth_failures", 0)
            raise WorldNotFormed(
                f"the world did not form within --join-timeout {admission.join_timeout:g}s: "
                f"{admission.joined} of {admission.min_workers or admission.target} workers "
                "joined"
                + (
                    f"; {failed} Hello(s) failed authentication (a worker's run secret is "
                    "not this run's)"
                    if failed
                    else ""
                )
            )
        if not admission.formed and now - last_note >= 10.0:
            last_note = now
            log.info(
                "waiting_for_workers",
                joined=admission.joined,
                world_size=admission.target,
                min_workers=admission.min_workers,
            )
    log.info("world_formed", world_size=admission.world_size)
