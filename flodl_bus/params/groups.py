"""Process groups formed through the Redis store, with bounded waits and re-sessions.

Groups are built directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL`` on a
``RedisStore``), never through torch's global default group, so a re-session can build a
fresh group beside an abandoned one. Each session has its own store prefix derived from
its uid, so keys of an old session can never satisfy the rendezvous of a new one.

Waits: every collective waits on its future in slices and checks an abort flag between
slices, so ``abort()`` from another thread (a dead peer, a lost coordinator) releases a
rank parked in a collective within one slice. gloo has no working abort of an in-flight
op (its ``abort()`` returns but the op runs on until its own timeout), so an aborted
gloo group is *abandoned*: parked in ``retired`` rather than destroyed (its destructor
would join the op's thread and block up to the group timeout), and its buffers are never
reused by the next attempt.

Split rounds: a death inside a collective can leave it completed on some survivors and
broken on others. Each survivor announces the ops it completed under the new session's
keys as the session is offered; one about to retry reads them first and gives the round
up (``RoundSplit``) where a peer is one ahead, since that peer never runs it again.

``params.forming`` builds each group on its store.
"""

from __future__ import annotations

import atexit
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final, TypeVar

import redis
import structlog
import torch
import torch.distributed as dist

from flodl_bus.bus.store import RedisStore
from flodl_bus.params import forming
from flodl_bus.params.forming import form_process_group, session_prefix

log = structlog.get_logger("flodl_bus.params")

T = TypeVar("T")

#: Attempts of one averaging cycle across re-sessions (reference §3.14).
MAX_ATTEMPTS: Final = 32
#: How often a parked waiter looks at the abort flag.
ABORT_POLL_S: Final = 0.05
INITIAL_UID: Final = b"initial"
#: store key (under a session's prefix) where each member says its ops completed
ANNOUNCE_KEY: Final = "flodl_ops_done/"
#: How long a retry waits for every member's announcement (bounded by the group timeout).
#: Members announce as the offer reaches them, all at about the same time; one that has
#: not after this long died or is stuck, and the retry goes on as it did before splits
#: were told. Kept short: on the cpu planes a newer offer can reach this rank only after
#: the wait (the control thread forms offers under the lock the wait is made in).
ANNOUNCE_WAIT_S: Final = 10.0
SPLIT: Final = "the round completed on a peer only"


#: moved to ``params.forming``; still found here, with a warning, for one minor version
_MOVED: Final = frozenset({"store_base", "backend_for", "routable_host", "serve_tcp_store"})


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(
            f"flodl_bus.params.groups.{name} moved to flodl_bus.params.forming.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(forming, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class CollectiveFailed(RuntimeError):
    """The group is unusable (peer lost, aborted, timed out); a re-session may fix it."""


class SessionTimeout(RuntimeError):
    """No new session arrived within the mailbox cap after the group broke."""


class RoundSplit(RuntimeError):
    """The op being retried completed on a survivor before the group broke.

    A collective can finish on some ranks and break on others when a peer dies inside
    it (gloo's ring: the dead peer's last chunk reached one survivor, not the other). The
    survivors that finished moved on and never run that op again, so a retry in the new
    session would wait for them until the group timeout, then for a session nobody
    sends. The caller keeps its own state for this round (not realized); the next round
    brings the survivors together again.
    """


@dataclass(frozen=True, slots=True)
class SessionSpec:
    uid: bytes
    rank: int
    world_size: int


class Group:
    """One formed session: a process group plus its abort flag."""

    def __init__(self, spec: SessionSpec, pg: Any, backend: str, prefix: str) -> None:
        self.spec = spec
        self.pg = pg
        self.backend = backend
        self.prefix = prefix
        self._aborted = threading.Event()
        self.broken = False
        #: collectives completed on this group (the first one after a re-session is the
        #: end of a recovery, which ``bench kill`` times)
        self.ops_done = 0
        # Built once: a SyncNow issues several sums, each on the rank's critical path.
        self._sum = dist.AllreduceOptions()
        self._sum.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def destroy(self) -> None:
        """Drop the process group now (its destructor joins gloo's threads)."""
        self._aborted.set()
        self.broken = True
        self.pg = None

    def abort(self) -> None:
        if self._aborted.is_set():
            return
        self._aborted.set()
        self.broken = True
        if self.backend == "nccl" and self.pg is not None:
            # ncclCommAbort really releases kernels parked on a dead peer.
            try:
                self.pg.abort()
            except Exception as exc:  # abort is best effort; the flag already releases us
                log.warning("nccl_abort_failed", error=str(exc))

    def all_reduce_sum_(self, tensors: Sequence[torch.Tensor], timeout: float) -> None:
        """Sum each tensor across the group in place; bounded by ``timeout`` seconds."""
        self.wait_all(self.start_all_reduce_sum(tensors), timeout)

    def start_all_reduce_sum(self, tensors: Sequence[torch.Tensor]) -> list[Any]:
        """Issue an in-place sum of each tensor, in order, without waiting: the works to
        hand to ``wait_all``. On NCCL the ops queue on the communication stream while the
        caller's stream goes on (a ``work.wait()`` makes the caller's stream wait for one).

        Each tensor is its own op: gloo's multi-tensor form would also sum the list's
        entries together (they are taken as one rank's per-device replicas).
        """
        if self._aborted.is_set():
            raise CollectiveFailed("group was aborted")
        try:
            return [self.pg.allreduce([t], self._sum) for t in tensors]
        except RuntimeError as exc:
            self.broken = True
            raise CollectiveFailed(str(exc)) from exc

    def order_after(self, work: Any) -> None:
        """Make the caller's CUDA stream wait for ``work`` without blocking the thread
        (NCCL's ``wait``); the op's failure surfaces as ``CollectiveFailed``."""
        try:
            work.wait()
        except RuntimeError as exc:
            self.broken = True
            raise CollectiveFailed(str(exc)) from exc

    def wait_all(self, works: Sequence[Any], timeout: float) -> None:
        """Wait for every work (aborts and the deadline still release the caller)."""
        deadline = time.monotonic() + timeout
        for work in works:
            self._wait(work, deadline)

    def _wait(self, work: Any, deadline: float) -> None:
        future = work.get_future()
        # A future already done needs no callback: the op's error and, on NCCL, the
        # stream order still come from ``work.wait`` below.
        done = threading.Event()
        if future.done():
            done.set()
        else:
            future.add_done_callback(lambda _f: done.set())
        while not done.wait(ABORT_POLL_S):
            if self._aborted.is_set():
                raise CollectiveFailed("collective aborted")
            if time.monotonic() > deadline:
                self.broken = True
                raise CollectiveFailed("collective did not finish within its timeout")
        try:
            work.wait()  # raises the op's error; on NCCL also orders the current stream
        except RuntimeError as exc:
            self.broken = True
            raise CollectiveFailed(str(exc)) from exc


#: Managers whose groups are still alive; closed at exit (see ``SessionManager.close``).
_LIVE: weakref.WeakSet[SessionManager] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for manager in list(_LIVE):
        manager.close()


class SessionManager:
    """The rank's current group, the mailbox of the next session, and the retry loop.

    Thread-safe: ``abort`` and ``offer`` come from the control reader while the training
    thread (``nccl``) or the averaging thread (``cpu``) sits in ``run``.
    """

    def __init__(
        self,
        redis_client: redis.Redis | str,
        base_prefix: str,
        rank: int,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout: float = 30.0,
        mailbox_cap: float = 60.0,
        max_attempts: int = MAX_ATTEMPTS,
    ) -> None:
        if isinstance(redis_client, str):
            redis_client = redis.Redis.from_url(
                redis_client, socket_timeout=5.0, socket_connect_timeout=5.0
            )
        self._redis = redis_client
        self.base_prefix = base_prefix
        self.backend = backend
        self.timeout = timeout
        self.mailbox_cap = mailbox_cap
        self.max_attempts = max_attempts
        self._cond = threading.Condition()
        #: held while a group is formed (or its session awaited): one formation at a
        #: time on this rank, whichever thread asks (the averaging thread's ``connect``,
        #: the control thread's eager ``offer``)
        self._forming = threading.Lock()
        self._spec = SessionSpec(INITIAL_UID, rank, world_size)
        self._pending: SessionSpec | None = None
        self._group: Group | None = None
        # uids of sessions that broke or failed to form: only a newer one may be formed.
        self._failed: set[bytes] = set()
        self._closed = False
        self.retired: list[Group] = []
        self.sessions_formed = 0
        #: ops this rank completed over the run, every group counted: survivors of one
        #: world run the same sequence, so a peer one ahead finished the op we retry
        self._ops_total = 0
        #: offers seen, so an op that succeeds after an offer announced the count
        #: without it is taken as failed (the announcement must stay true)
        self._offers = 0
        #: rounds given up because they completed on a peer only
        self.rounds_split = 0
        #: whether the last offer was formed at once (every survivor's plane does the same)
        self._eager = False
        #: the newest session heard of before it was offered here (``heard_of``), and the
        #: uids offered so far: one heard of and not yet offered is newer than any formed
        self._heard: SessionSpec | None = None
        self._offered: set[bytes] = set()
        _LIVE.add(self)

    # -- state ----------------------------------------------------------------------------

    @property
    def spec(self) -> SessionSpec:
        with self._cond:
            return self._spec

    @property
    def group(self) -> Group | None:
        with self._cond:
            return self._group

    def abort(self) -> None:
        """Abort the current group (idempotent; a no-op when none is formed)."""
        with self._cond:
            group = self._group
            self._cond.notify_all()
        if group is not None:
            group.abort()

    def offer(self, spec: SessionSpec, *, form: bool = False) -> None:
        """Deliver ``NewNcclSession``: the next group to form. The current one is aborted,
        since the coordinator only re-sessions after a death.

        ``form``: form it now, on the caller's thread, instead of at this rank's next
        collective. Every survivor gets the offer at about the same time, but a survivor
        not in a collective used to form only at its next round: a peer that formed at
        once waited the group timeout for it, gave the session up as failed and then
        waited for a newer one the coordinator never sends (a lost survivor, issue 28).
        """
        with self._cond:
            self._pending = spec
            self._offered.add(spec.uid)
            group = self._group
            self._offers += 1
            self._eager = form
            done = self._ops_total
            self._cond.notify_all()
        if group is not None and group.spec.uid != spec.uid:
            group.abort()
        self._announce(spec, done)
        if form:
            self._form_offered()

    def heard_of(self, spec: SessionSpec) -> None:
        """A session was offered that this rank will take only once the one it forms now
        is done (the rank's session thread delivers offers one at a time): a formation
        in progress gives up for it (``_superseded``). Never blocks."""
        with self._cond:
            self._heard = spec
            self._cond.notify_all()

    # -- split rounds ---------------------------------------------------------------------

    def _session_store(
        self, spec: SessionSpec, cancelled: Callable[[], str | None] | None = None
    ) -> RedisStore:
        return RedisStore(
            self._redis,
            session_prefix(self.base_prefix, spec.uid),
            timedelta(seconds=self.timeout),
            cancelled=cancelled,
        )

    def _announce(self, spec: SessionSpec, done: int) -> None:
        """Say, under the new session's keys, how many ops this rank completed before it.

        Every survivor is offered the session, so every one announces, whether it is in
        a collective or between rounds; a survivor retrying reads them all (``_split``).
        """
        try:
            self._session_store(spec).set(f"{ANNOUNCE_KEY}{spec.rank}", str(done))
        except (RuntimeError, redis.RedisError) as exc:
            # Without it a retrying peer waits the timeout, then retries as before.
            log.warning("param_ops_not_announced", uid=spec.uid.hex(), error=str(exc)[:300])

    def _split(self, spec: SessionSpec) -> bool | None:
        """Whether a member of ``spec``'s session completed the op this rank is retrying;
        if so the op counts as done here too (the peers' count and ours agree again).

        None: a newer session was offered while the announcements were awaited (a member
        died after this offer), so this one will never form. The wait is bounded
        (``ANNOUNCE_WAIT_S``); without every announcement the retry goes on as before.
        """
        if spec.uid == INITIAL_UID:
            return False  # the first session: nobody announced into it
        keys = [f"{ANNOUNCE_KEY}{r}" for r in range(spec.world_size)]
        store = self._session_store(spec)
        deadline = time.monotonic() + min(self.timeout, ANNOUNCE_WAIT_S)
        try:
            while not store.check(keys):
                # ``_connect`` took this offer: anything offered or heard of now is newer.
                if self._superseded(spec) is not None:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("not every member announced its ops in time")
                with self._cond:
                    self._cond.wait(min(left, ABORT_POLL_S))
            counts = [int(v) for v in store.multi_get(keys)]
        except (RuntimeError, redis.RedisError, ValueError, TimeoutError) as exc:
            log.warning("param_ops_unknown", uid=spec.uid.hex(), error=str(exc)[:300])
            return False
        with self._cond:
            # A peer cannot be further ahead: it needed this rank for any later op.
            if max(counts) != self._ops_total + 1:
                return False
            self._ops_total += 1
            self.rounds_split += 1
        log.warning(
            "param_round_split",
            uid=spec.uid.hex(),
            rank=spec.rank,
            detail="the round completed on a survivor before the group broke; "
            "this rank keeps its own state for it",
        )
        return True

    def _form_offered(self) -> None:
        with self._forming:
            with self._cond:
                if self._closed:
                    return
                pending, group = self._pending, self._group
                if pending is None or pending.uid in self._failed:
                    return  # taken by a connect meanwhile, or already given up
                if group is not None and group.spec.uid == pending.uid and not group.broken:
                    return
                if group is not None:
                    self._failed.add(group.spec.uid)
                self._pending = None
            try:
                self._form(pending)
            except CollectiveFailed as exc:
                with self._cond:
                    self._failed.add(pending.uid)
                log.warning("param_session_not_formed", uid=pending.uid.hex(), error=str(exc)[:300])

    def close(self) -> None:
        """Destroy every group this rank formed. Idempotent.

        Groups must be destroyed before the interpreter exits: a gloo group still alive
        when the process tears down its C++ statics ends in ``std::terminate``. Destroying
        an abandoned group waits for its in-flight op, which its own timeout bounds.
        """
        with self._cond:
            self._closed = True
            group, self._group = self._group, None
            retired, self.retired = self.retired, []
            self._cond.notify_all()
        for g in [*retired, *([group] if group is not None else [])]:
            g.destroy()
        _LIVE.discard(self)

    # -- forming --------------------------------------------------------------------------

    def connect(self, *, retry: bool = False) -> Group:
        """The usable group, formed now if needed (waits for a new session if broken).

        ``retry``: the caller's op broke on the last group and is about to run again;
        if it completed on a peer, ``RoundSplit`` is raised instead (``_split``).
        """
        with self._forming:
            return self._connect(retry)

    def _connect(self, retry: bool) -> Group:
        with self._cond:
            if self._closed:
                raise RuntimeError("the param plane is closed")
            group = self._group
            if group is not None and not group.broken:
                # A retry finding a session the control thread formed while its op was
                # failing is that session's first op: whether the round split is told.
                if not (retry and group.ops_done == 0):
                    return group
                formed_meanwhile = group
            else:
                formed_meanwhile = None
                if group is not None:
                    self._failed.add(group.spec.uid)
                # A session offered before the first one formed supersedes it.
                need_new = bool(self._failed) or (group is None and self._pending is not None)
                spec = self._take_pending_locked() if need_new else self._spec
            eager = self._eager
        if formed_meanwhile is not None:
            if self._split(formed_meanwhile.spec):
                raise RoundSplit(SPLIT)
            return formed_meanwhile
        # Told before forming: where survivors form an offer lazily (at their next op),
        # a peer done with the round would not form it now, and neither may we.
        split = False
        if retry and need_new:
            verdict = self._split(spec)
            if verdict is None:
                with self._cond:
                    self._failed.add(spec.uid)
                raise CollectiveFailed(f"session {spec.uid.hex()} superseded before it formed")
            split = verdict
        if split and not eager:
            with self._cond:
                if self._pending is None:
                    self._pending = spec  # formed with the peers at the next op
            raise RoundSplit(SPLIT)
        try:
            formed = self._form(spec)
        except CollectiveFailed:
            with self._cond:
                self._failed.add(spec.uid)
            if not split:
                raise
        # Formed with the peers that form offers at once (or that failed), then the
        # round is given up.
        if split:
            raise RoundSplit(SPLIT)
        return formed

    def _take_pending_locked(self) -> SessionSpec:
        deadline = time.monotonic() + self.mailbox_cap
        while True:
            pending = self._pending
            if pending is not None and pending.uid not in self._failed:
                self._pending = None
                return pending
            if self._closed:
                raise SessionTimeout("param plane closed while waiting for a new session")
            left = deadline - time.monotonic()
            if left <= 0:
                raise SessionTimeout(
                    f"no new session within {self.mailbox_cap:.1f}s after the group broke"
                )
            self._cond.wait(min(left, ABORT_POLL_S * 4))

    def _superseded(self, spec: SessionSpec) -> str | None:
        """Why a formation of ``spec`` can never complete, if it can't: a newer session
        was offered (a member died meanwhile, a second death), or the plane closed. It
        then stops waiting for that member at once, where it held the formation lock
        for the whole group timeout and the newer session's peers timed out on this rank
        in their turn (a cascade: every later death cost a whole timeout more)."""
        with self._cond:
            if self._closed:
                return "the param plane closed"
            pending, heard = self._pending, self._heard
            if pending is not None and pending.uid != spec.uid:
                return f"session {pending.uid.hex()} was offered since"
            if heard is not None and heard.uid != spec.uid and heard.uid not in self._offered:
                return f"session {heard.uid.hex()} was offered since"
        return None

    def _form(self, spec: SessionSpec) -> Group:
        store = self._session_store(spec, cancelled=lambda: self._superseded(spec))
        prefix = store.prefix
        started = time.monotonic()
        try:
            pg = form_process_group(
                store,
                spec.rank,
                spec.world_size,
                backend=self.backend,
                timeout=timedelta(seconds=self.timeout),
            )
        except (RuntimeError, redis.RedisError) as exc:
            raise CollectiveFailed(f"forming session {spec.uid.hex()} failed: {exc}") from exc
        group = Group(spec, pg, self.backend, prefix)
        with self._cond:
            old, self._group, self._spec = self._group, group, spec
            self.sessions_formed += 1
        if old is not None:
            self.retired.append(old)
            if spec.rank == 0:
                # Everyone formed the old session long ago; its keys are garbage now.
                RedisStore(self._redis, old.prefix).clear()
        log.info(
            "param_session_formed",
            uid=spec.uid.hex(),
            rank=spec.rank,
            world_size=spec.world_size,
            backend=self.backend,
            form_s=round(time.monotonic() - started, 4),
        )
        return group

    # -- retry loop -----------------------------------------------------------------------

    def run(self, op: Callable[[Group], T]) -> T:
        """Run ``op`` on a usable group; after a collective failure wait (bounded) for a
        new session of survivors and run it again there (reference §3.14).

        ``op`` must be restartable: it rebuilds its inputs from a pre-sync copy and
        commits nothing to the model until it returns.
        """
        last: Exception | None = None
        for attempt in range(self.max_attempts):
            try:
                group = self.connect(retry=isinstance(last, CollectiveFailed))
            except CollectiveFailed as exc:  # formation failed: wait for yet another session
                last = exc
                continue
            with self._cond:
                offers = self._offers
            try:
                result = op(group)
                with self._cond:
                    if self._offers != offers:
                        # Announced without this op: peers must not count it either.
                        raise CollectiveFailed("a new session was offered during the op")
                    self._ops_total += 1
            except CollectiveFailed as exc:
                last = exc
                self._mark_broken(group)
                log.warning(
                    "param_collective_failed",
                    attempt=attempt,
                    uid=group.spec.uid.hex(),
                    rank=group.rank,
                    error=str(exc)[:300],
                )
                continue
            group.ops_done += 1
            if group.ops_done == 1 and self.sessions_formed > 1:
                log.info(
                    "param_first_collective_after_resession",
                    uid=group.spec.uid.hex(),
                    rank=group.rank,
                    world_size=group.world_size,
                )
            return result
        raise CollectiveFailed(f"gave up after {self.max_attempts} attempts: {last}")

    def _mark_broken(self, group: Group) -> None:
        with self._cond:
            group.broken = True
            self._failed.add(group.spec.uid)
