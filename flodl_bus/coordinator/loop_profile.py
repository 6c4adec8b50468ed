"""Where the coordinator loop's time goes, stage by stage, over a whole run.

``CoordinatorLoop`` adds the time of each call it makes into one ``LoopProfile``: a
``time.perf_counter`` reading between each two (0.05-0.2 µs a reading; three a message,
each message's last the next one's first), the loop thread's CPU
time (``time.thread_time``) only around calls made once per read, never per message.
The stages do not overlap, so their sum never exceeds the window's wall time; what is
left is ``other`` (the loop's own bookkeeping: supervisor, join and unread polls, the
console's progress lines):

* ``idle``: the part of an upstream read that found nothing spent off the loop thread's
  CPU (blocked in Redis's BLOCK, waiting for input);
* ``read_wait``: the same part of a read that returned entries: the round trip, Redis's
  own work, and the wait for the first entry when none was there yet (the client cannot
  tell these apart: a loop that keeps up waits on input here; one that falls behind
  reads a backlog at once and waits on Redis alone). On a loaded host, also waiting for
  a core or the GIL;
* ``read_cpu``: the loop thread's CPU in every read, whatever it held: packing the
  XREADGROUP over N streams, parsing the reply, checking MACs, decoding;
* ``handle``: ``Coordinator.handle`` per upstream message, with the message's lookup
  (its rank, the clock, the state summary the recorder cached at the previous call);
* ``record``: the dispatch record per message (the state summary after, the line);
* ``send``: the bus calls of the core's ``Send``/``Broadcast`` effects (one call per
  batch of consecutive ones); with the sender thread (``LoopOptions.send_thread``,
  opt-in), only handing them to it and any wait for room in its queue, the calls
  themselves being that thread's ``sender_s``; ``apply``: the rest of applying effects;
* ``tick``: ``Coordinator.tick`` with its record and what the loop does per tick, sends
  excluded; ``ack``: handing deliveries back to the bus.

On a Redis Cluster (``ShardedCoordinatorBus``) each shard is read on a thread of its own
and the loop takes what they read from a queue: the reading's CPU is on those threads,
and the loop's reads wait on the queue.

A message is an upstream delivery the core handled. The window opens right before
``Coordinator.start`` (after the first-contact wait) and closes when the loop ends.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Final

#: the stages, in the order a report lists them; they partition the window with "other"
STAGES: Final = (
    "idle",
    "read_wait",
    "read_cpu",
    "handle",
    "record",
    "send",
    "apply",
    "tick",
    "ack",
)


@dataclass(slots=True)
class LoopProfile:
    """Seconds per stage (see the module docstring) and counts, added up by the loop."""

    #: ``time.monotonic()`` when the window opened (to match other processes' clocks)
    opened_at: float = 0.0
    wall_s: float = 0.0
    #: the loop thread's CPU time over the window
    cpu_s: float = 0.0
    idle: float = 0.0
    read_wait: float = 0.0
    read_cpu: float = 0.0
    handle: float = 0.0
    record: float = 0.0
    send: float = 0.0
    apply: float = 0.0
    tick: float = 0.0
    ack: float = 0.0
    #: upstream messages the core handled
    messages: int = 0
    reads: int = 0
    #: reads that returned nothing
    empty_reads: int = 0
    ticks: int = 0
    #: ticks after a read that may have left entries waiting (the loop behind its input)
    ticks_behind: int = 0
    #: control messages written: unicast, broadcast, and the bus calls that wrote them
    sent: int = 0
    broadcasts: int = 0
    send_calls: int = 0
    #: seconds the sender thread spent in bus calls (``coordinator.sender``; not a stage
    #: of the loop's thread, whose ``send`` is then the hand-over and any wait for room)
    sender_s: float = 0.0

    def add_read(self, wall: float, cpu: float, got: bool) -> None:
        """One upstream read: its wall and thread CPU time, and whether it brought
        entries (its off-CPU part is then ``read_wait``, else ``idle``)."""
        cpu = min(cpu, wall)
        self.read_cpu += cpu
        self.reads += 1
        if got:
            self.read_wait += wall - cpu
        else:
            self.idle += wall - cpu
            self.empty_reads += 1

    def brief(self) -> dict[str, Any]:
        """The figures of the run's closing log line."""
        return {
            "messages": self.messages,
            "ticks_behind": self.ticks_behind,
            "wall_s": round(self.wall_s, 3),
            "us_per_message": {k: round(v, 2) for k, v in self.per_message_us().items()},
        }

    @property
    def other(self) -> float:
        return max(0.0, self.wall_s - sum(self.stages().values()))

    def stages(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in STAGES}

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["other"] = self.other
        return out

    def per_message_us(self) -> dict[str, float]:
        """Microseconds of each stage (``other`` included) per upstream message."""
        n = max(1, self.messages)
        parts = {**self.stages(), "other": self.other}
        return {k: v * 1e6 / n for k, v in parts.items()}


#: the stages that may be waiting for input rather than working
WAITS: Final = ("idle", "read_wait")


def busiest(stages: dict[str, float]) -> str:
    """The working stage with the most time (the waits are not work)."""
    work = {k: v for k, v in stages.items() if k in STAGES or k == "other"}
    work = {k: v for k, v in work.items() if k not in WAITS}
    return max(work, key=lambda k: work[k]) if work else "idle"
