"""Dial-in membership, sans-IO: who joins the world, at which rank, and when it forms.

Workers say ``Hello`` on the run's ``join`` stream. ``Admission`` decides:

* a Hello whose dataset signature differs from the coordinator's is refused at once,
  naming both signatures (a worker training other data would silently poison the
  average);
* a Hello with a ``requested_rank`` (a worker started with ``--rank``) claims that rank;
  a second claim of the same rank, or a rank outside the world, is refused;
* the others get the lowest free ranks in arrival order when the world forms, so rank
  order is admission order;
* the world forms as soon as ``world_size`` workers joined, or — with ``min_workers`` —
  once ``join_timeout`` passed since the coordinator opened the door and at least
  ``min_workers`` joined. Assigns go out together when it forms: the world size a
  worker is told is final;
* after forming, a repeated Hello of an admitted worker (its XADD retried) gets its
  Assign again; anyone else is refused (no elastic growth of a formed world).

No clock, no IO: the runtime passes ``now`` and posts what ``hello``/``poll`` return.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flodl_bus.protocol.messages import Assign, Hello, Reject

Answer = Assign | Reject


@dataclass(frozen=True, slots=True)
class Member:
    worker_id: str
    host: str
    device: str
    rank: int
    #: the worker asked for this rank (``--rank``) rather than being given one
    requested: bool
    #: the worker's X25519 public key from its Hello (its rank key is derived from it)
    kx_pub: str = ""
    #: the spec score of the worker's CUDA device from its Hello (None: not told)
    device_score: float | None = None


@dataclass(frozen=True, slots=True)
class _Pending:
    hello: Hello
    arrived_at: float


class Admission:
    def __init__(
        self,
        *,
        dataset_sig: str,
        world_size: int | None = None,
        min_workers: int | None = None,
        join_timeout: float = 60.0,
        model_sig: str | None = None,
    ) -> None:
        if world_size is None and min_workers is None:
            raise ValueError("give world_size, min_workers, or both")
        if world_size is not None and world_size < 1:
            raise ValueError("world_size must be at least 1")
        if min_workers is not None and min_workers < 1:
            raise ValueError("min_workers must be at least 1")
        if world_size is not None and min_workers is not None and min_workers > world_size:
            raise ValueError(f"min_workers {min_workers} exceeds world_size {world_size}")
        if join_timeout < 0:
            raise ValueError("join_timeout must be >= 0")
        self.dataset_sig = dataset_sig
        #: the coordinator's model signature (None: not told, nothing compared)
        self.model_sig = model_sig
        self.target = world_size
        self.min_workers = min_workers
        self.join_timeout = join_timeout
        self.opened_at: float | None = None
        self._pending: list[_Pending] = []
        self.members: list[Member] = []
        self.formed = False
        self.refused = 0

    @property
    def world_size(self) -> int | None:
        """The formed world's size (None until it formed)."""
        return len(self.members) if self.formed else None

    @property
    def device_scores(self) -> tuple[float, ...] | None:
        """Each rank's device spec score in rank order, once the world formed and every
        member told one; None otherwise (flodl's spec prior covers every rank or none)."""
        if not self.formed or not self.members:
            return None
        scores: list[float] = []
        for m in self.members:
            if m.device_score is None or not math.isfinite(m.device_score):
                return None
            scores.append(m.device_score)
        return tuple(scores)

    @property
    def joined(self) -> int:
        return len(self.members) if self.formed else len(self._pending)

    def open(self, now: float) -> None:
        if self.opened_at is None:
            self.opened_at = now

    # ------------------------------------------------------------------ events

    def hello(self, msg: Hello, now: float) -> list[Answer]:
        self.open(now)
        if self.formed:
            for m in self.members:
                if m.worker_id == msg.worker_id:
                    return [Assign(m.worker_id, m.rank, len(self.members))]
            return [self._refuse(msg, f"the world already formed with {len(self.members)} ranks")]
        if any(p.hello.worker_id == msg.worker_id for p in self._pending):
            return []  # a retried XADD
        if msg.dataset_sig != self.dataset_sig:
            return [
                self._refuse(
                    msg,
                    f"dataset signature {msg.dataset_sig} does not match the coordinator's "
                    f"{self.dataset_sig}: every worker must train the same data (same --job "
                    "and data files)",
                )
            ]
        if None not in (self.model_sig, msg.model_sig) and msg.model_sig != self.model_sig:
            return [
                self._refuse(
                    msg,
                    f"model signature {msg.model_sig} does not match the coordinator's "
                    f"{self.model_sig}: every worker must build the same model (same --job "
                    "and code; parameter names, shapes and dtypes)",
                )
            ]
        want = msg.requested_rank
        if want is not None:
            if self.target is not None and want >= self.target:
                return [
                    self._refuse(
                        msg, f"requested rank {want} is outside the world of {self.target}"
                    )
                ]
            holder = self._claimant(want)
            if holder is not None:
                return [self._refuse(msg, f"rank {want} is already taken by worker {holder}")]
        self._pending.append(_Pending(msg, now))
        return self.poll(now)

    def poll(self, now: float) -> list[Answer]:
        """Form the world if it is due; the Assigns (and any late refusals) to post."""
        if self.formed:
            return []
        n = len(self._pending)
        if self.target is not None and n >= self.target:
            return self._form()
        if self.min_workers is not None and n >= self.min_workers:
            opened = self.opened_at if self.opened_at is not None else now
            if now - opened >= self.join_timeout:
                return self._form()
        return []

    def forget(self, worker_id: str) -> None:
        """Drop a pending worker (its Hello turned out stale); no-op once formed."""
        if not self.formed:
            self._pending = [p for p in self._pending if p.hello.worker_id != worker_id]

    # ------------------------------------------------------------------ internals

    def _claimant(self, rank: int) -> str | None:
        for p in self._pending:
            if p.hello.requested_rank == rank:
                return p.hello.worker_id
        return None

    def _refuse(self, msg: Hello, reason: str) -> Reject:
        self.refused += 1
        return Reject(msg.worker_id, reason)

    def _form(self) -> list[Answer]:
        answers: list[Answer] = []
        pending = list(self._pending)
        if self.target is not None:
            pending = pending[: self.target]
        # A claimed rank must exist in the world that forms; a world that shrinks when
        # such a claim is refused may strand another claim, hence the loop.
        while True:
            size = len(pending)
            outside = [
                p
                for p in pending
                if p.hello.requested_rank is not None and p.hello.requested_rank >= size
            ]
            if not outside:
                break
            for p in outside:
                pending.remove(p)
                answers.append(
                    self._refuse(
                        p.hello,
                        f"requested rank {p.hello.requested_rank} is outside the world of "
                        f"{size} that formed",
                    )
                )
        size = len(pending)
        need = self.min_workers if self.min_workers is not None else self.target
        if answers and size < (need or 1):
            # Refusals shrank the world below its minimum: keep waiting for joiners.
            refused = {a.worker_id for a in answers}
            self._pending = [p for p in self._pending if p.hello.worker_id not in refused]
            return answers
        taken = {p.hello.requested_rank for p in pending if p.hello.requested_rank is not None}
        free = iter(r for r in range(size) if r not in taken)
        members: list[Member] = []
        for p in pending:
            h = p.hello
            requested = h.requested_rank is not None
            rank = h.requested_rank if h.requested_rank is not None else next(free)
            members.append(
                Member(h.worker_id, h.host, h.device, rank, requested, h.kx_pub, h.device_score)
            )
        members.sort(key=lambda m: m.rank)
        self.members = members
        self._pending = []
        self.formed = True
        answers += [Assign(m.worker_id, m.rank, size) for m in members]
        return answers
