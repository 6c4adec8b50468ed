"""Progressive dispatch pools and the pure sizing rules (reference §4.10.2-§4.10.5).

A ``ChunkPool`` hands out slices ``(offset, size)`` of one epoch's batch-aligned span.
Every rank owns a contiguous reservation span it serves from the front; a rank whose
span is drained steals from the *tail* of the largest remaining span (so the owner keeps
its contiguous front); a dead rank's outstanding chunks move to a reclaimed list that is
served first. The pool tracks per-rank outstanding chunks FIFO: a ``MetricsMsg`` retires
the rank's oldest chunk, which is how an epoch is known to be complete.
"""

from __future__ import annotations

import heapq
import operator
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from flodl_bus.coordinator.numeric import ordered_sum
from flodl_bus.coordinator.tracked import Tracked

Range = tuple[int, int]


@dataclass(slots=True)
class _Chunk:
    offset: int
    size: int
    #: taken from the front of the rank's own span (only those can rewind the cursor)
    own: bool


class ChunkPool:
    def __init__(
        self,
        epoch: int,
        spans: Sequence[Range],
        created_at: float = 0.0,
        reclaimed: Sequence[Range] = (),
    ) -> None:
        self.epoch = epoch
        self.created_at = created_at
        self._cursor = [start for start, _ in spans]
        self._end = [start + size for start, size in spans]
        self._reclaimed: deque[Range] = deque(r for r in reclaimed if r[1] > 0)
        self._outstanding: list[deque[_Chunk]] = [deque() for _ in spans]
        self.dispatched = [0] * len(spans)
        self.completed = [0] * len(spans)
        # Samples outstanding per rank, kept with the queues: the state summary reads it
        # for every rank on every dispatch, and summing the queues made that O(chunks).
        self._in_flight = Tracked([0] * len(spans))
        self.total = sum(size for _, size in spans) + sum(s for _, s in self._reclaimed)
        # Kept incrementally: dispatch asks for it per rank, and a sum over spans would
        # make every reduce quadratic in the world size.
        self._remaining = self.total

    # ------------------------------------------------------------------ building
    @classmethod
    def create(
        cls,
        epoch: int,
        total_batches: int,
        batch_size: int,
        weights: Sequence[float],
        created_at: float = 0.0,
    ) -> ChunkPool:
        """Reservation spans proportional to ``weights`` (0 = no span, e.g. a dead rank)."""
        batches = ratio_to_sizes(total_batches, weights)
        spans: list[Range] = []
        offset = 0
        for b in batches:
            spans.append((offset, b * batch_size))
            offset += b * batch_size
        return cls(epoch, spans, created_at)

    @classmethod
    def from_coverage(
        cls, epoch: int, holes: Sequence[Range], world_size: int, created_at: float = 0.0
    ) -> ChunkPool:
        """A pool that serves exactly ``holes`` (the uncovered ranges of a checkpoint), once."""
        return cls(epoch, [(0, 0)] * world_size, created_at, reclaimed=holes)

    # ------------------------------------------------------------------ queries
    @property
    def world_size(self) -> int:
        return len(self._cursor)

    def residue(self, rank: int) -> int:
        return self._end[rank] - self._cursor[rank]

    def residue_range(self, rank: int) -> Range:
        """(offset, size) of ``rank``'s span not yet handed out."""
        return (self._cursor[rank], self._end[rank] - self._cursor[rank])

    def remaining(self) -> int:
        """Samples not yet dispatched (span residues plus reclaimed ranges)."""
        return self._remaining

    def in_flight(self, rank: int) -> int:
        return self._in_flight[rank]

    def in_flight_all(self) -> list[int]:
        """``in_flight`` of every rank, in rank order."""
        return self._in_flight.copy()

    def in_flight_view(self) -> list[int]:
        """What ``in_flight_all`` copies, itself (tracked; for the state summary, which
        never writes it)."""
        return self._in_flight

    def has_in_flight(self, rank: int) -> bool:
        return bool(self._outstanding[rank])

    def outstanding(self, rank: int) -> list[Range]:
        return [(c.offset, c.size) for c in self._outstanding[rank]]

    def is_epoch_done(self) -> bool:
        return self.remaining() == 0 and not any(self._outstanding)

    def uncovered_ranges(self) -> list[Range]:
        """Everything not completed (residues, in-flight, reclaimed), sorted and coalesced."""
        parts: list[Range] = [(c, e - c) for c, e in zip(self._cursor, self._end) if e > c]
        parts += [(c.offset, c.size) for q in self._outstanding for c in q]
        parts += list(self._reclaimed)
        return coalesce(parts)

    # ------------------------------------------------------------------ mutations
    def take_chunk(self, size: int, rank: int) -> Range | None:
        """Up to ``size`` samples for ``rank``: reclaimed first, own span, then a steal."""
        if size <= 0:
            return None
        own = False
        if self._reclaimed:
            off, avail = self._reclaimed[0]
            if avail <= size:
                self._reclaimed.popleft()
                got = (off, avail)
            else:
                self._reclaimed[0] = (off + size, avail - size)
                got = (off, size)
        elif self.residue(rank) > 0:
            take = min(size, self.residue(rank))
            got = (self._cursor[rank], take)
            self._cursor[rank] += take
            own = True
        else:
            # The largest residue, ties to the lowest rank, at C speed: a steal per chunk
            # once spans run dry (the dead's reclaimed, an epoch's tail) walked every rank.
            residues = list(map(operator.sub, self._end, self._cursor))
            best = max(residues, default=0)
            if best <= 0:
                return None
            victim = residues.index(best)
            take = min(size, best)
            self._end[victim] -= take
            got = (self._end[victim], take)
        self._outstanding[rank].append(_Chunk(got[0], got[1], own))
        self._in_flight[rank] += got[1]
        self.dispatched[rank] += got[1]
        self._remaining -= got[1]
        return got

    def mark_completed(self, rank: int, samples: int) -> int:
        """Retire ``rank``'s oldest chunks FIFO; returns samples retired.

        A completion beyond what is outstanding (a rank falsely declared dead whose
        chunks were already forfeited) clamps instead of underflowing.
        """
        left = samples
        q = self._outstanding[rank]
        while left > 0 and q:
            head = q[0]
            if head.size <= left:
                q.popleft()
                left -= head.size
            else:
                head.offset += left
                head.size -= left
                head.own = False
                left = 0
        done = samples - left
        self._in_flight[rank] -= done
        self.completed[rank] += done
        return done

    def forfeit(self, rank: int) -> int:
        """Move a dead rank's outstanding chunks to the reclaimed list (dispatch order)."""
        q = self._outstanding[rank]
        moved = 0
        while q:
            c = q.popleft()
            self._reclaimed.append((c.offset, c.size))
            moved += c.size
        self._in_flight[rank] -= moved
        self.dispatched[rank] -= moved
        self._remaining += moved
        return moved

    def rollback_take(self, rank: int, offset: int, size: int) -> bool:
        """Undo a take whose send failed; False (no-op) for an unknown chunk."""
        q = self._outstanding[rank]
        idx = next((i for i, c in enumerate(q) if c.offset == offset and c.size == size), None)
        if idx is None:
            return False
        c = q[idx]
        newest = idx == len(q) - 1
        del q[idx]
        self._in_flight[rank] -= size
        self.dispatched[rank] -= size
        self._remaining += size
        if newest and c.own and offset + size == self._cursor[rank]:
            self._cursor[rank] = offset
        else:
            self._reclaimed.append((offset, size))
        return True


def coalesce(ranges: Sequence[Range]) -> list[Range]:
    out: list[Range] = []
    for off, size in sorted(r for r in ranges if r[1] > 0):
        if out and out[-1][0] + out[-1][1] >= off:
            last_off, last_size = out[-1]
            out[-1] = (last_off, max(last_off + last_size, off + size) - last_off)
        else:
            out.append((off, size))
    return out


# ---------------------------------------------------------------------- sizing rules


def equal_sizes(n: int, world_size: int) -> list[int]:
    """``n // ws`` each, the remainder one apiece to the first ranks (100/3 -> 34,33,33)."""
    base, extra = divmod(n, world_size)
    return [base + (1 if i < extra else 0) for i in range(world_size)]


def ratio_to_sizes(n: int, ratios: Sequence[float]) -> list[int]:
    """Floor-proportional split of ``n``; the remainder goes to the largest ratios first.

    Ratios that are all zero (or not positive) fall back to an equal split; a zero ratio
    gets nothing while others are positive.
    """
    clean = [r if r > 0 and r == r and r != float("inf") else 0.0 for r in ratios]
    total = ordered_sum(clean)
    if total <= 0:
        return equal_sizes(n, len(ratios))
    sizes = [int(n * r / total) for r in clean]
    order = sorted(range(len(clean)), key=lambda i: (-clean[i], i))
    order = [i for i in order if clean[i] > 0]
    k = 0
    while sum(sizes) < n:
        sizes[order[k % len(order)]] += 1
        k += 1
    return sizes


def throughput_sizes(n: int, ms_per_batch: Sequence[float | None]) -> list[int]:
    """Sizes proportional to ``1 / ms`` (floored at 0.001 ms); unknown ranks get the mean."""
    known = [1.0 / max(ms, 0.001) for ms in ms_per_batch if ms is not None]
    fill = ordered_sum(known) / len(known) if known else 1.0
    tps = [1.0 / max(ms, 0.001) if ms is not None else fill for ms in ms_per_batch]
    return ratio_to_sizes(n, tps)


def final_window_alloc(rem: int, counts: Sequence[int], alive: Sequence[bool]) -> list[int]:
    """Split the last ``rem`` batches of an epoch over the alive ranks; the sum is exact.

    Fold band (``rem >= Σcounts``): everyone gets its full count and the crumb goes one
    per rank to the slowest non-fastest ranks. Otherwise largest-remainder proportional,
    then lone single batches are consolidated (a 1-batch window has no marginal sample).
    """
    ws = len(counts)
    alloc = [0] * ws
    live = [r for r in range(ws) if alive[r]]
    if not live or rem <= 0:
        return alloc
    if len(live) == 1:
        alloc[live[0]] = rem
        return alloc
    weights = {r: max(counts[r], 1) for r in live}
    total = sum(weights.values())
    fastest = min(live, key=lambda r: (-weights[r], r))
    if rem >= total:
        for r in live:
            alloc[r] = weights[r]
        crumb = rem - total
        slow_first = sorted((r for r in live if r != fastest), key=lambda r: (weights[r], r))
        i = 0
        while crumb > 0:
            alloc[slow_first[i % len(slow_first)]] += 1
            crumb -= 1
            i += 1
        return alloc
    fracs: dict[int, int] = {}
    for r in live:
        alloc[r], fracs[r] = divmod(rem * weights[r], total)
    short = rem - sum(alloc)
    for r in sorted(live, key=lambda r: (-fracs[r], -weights[r], r))[:short]:
        alloc[r] += 1
    return consolidate_lone_ones(alloc)


def consolidate_lone_ones(alloc: Sequence[int]) -> list[int]:
    """Move each lone 1-batch slot onto the smallest peer holding >= 1 (ties: lowest rank).

    A single irreducible 1 (no other holder) is left for the fallback.

    The rule, one move at a time: the highest rank holding 1 moves it to the holder
    smallest by (slots, rank) among the others. While two ones are left that holder is the
    lowest one (1 is the least a holder has), so the ones pair off from both ends; the
    last one goes to the smallest holder of two or more. Done so, with a heap for the
    latter, it is O(N log N): the move-at-a-time scan was O(N) a move and O(N^2) a call,
    most of a 1,024-rank coordinator's time at each epoch's last window (issue 31).
    """
    out = list(alloc)
    ones = deque(r for r, a in enumerate(out) if a == 1)  # ascending
    if not ones:
        return out
    bigger = [(a, r) for r, a in enumerate(out) if a >= 2]
    heapq.heapify(bigger)
    while len(ones) + len(bigger) >= 2 and ones:
        r = ones.pop()
        if ones:
            t = ones.popleft()
            out[t] = 2
            heapq.heappush(bigger, (2, t))
        else:
            a, t = heapq.heappop(bigger)
            out[t] = a + 1
            heapq.heappush(bigger, (a + 1, t))
        out[r] = 0
    return out


def split_ranges(ranges: Sequence[Range], sizes: Sequence[int]) -> list[list[Range]]:
    """Cut ``ranges`` (in order) into consecutive shares of ``sizes`` samples each."""
    queue = deque(coalesce(ranges) if len(ranges) > 1 else [r for r in ranges if r[1] > 0])
    shares: list[list[Range]] = []
    for want in sizes:
        share: list[Range] = []
        while want > 0 and queue:
            off, size = queue[0]
            take = min(want, size)
            share.append((off, take))
            want -= take
            if take == size:
                queue.popleft()
            else:
                queue[0] = (off + take, size - take)
        shares.append(share)
    return shares
