"""The coordinator record's states as deltas: what changed since the line before.

A coordinator core event used to carry the core's whole state summary twice (``before``
and ``after``). Most of it is per-rank lists, so a line grew with the world: about 50 kB
at 1,024 ranks, written (JSON, digest, compression) for every upstream message, which
alone cost the coordinator more than the message's whole budget at a 50 ms step. Yet
``before`` is by construction the previous core event's ``after`` (the core changes only
through recorded calls), and a ``Batch`` changes one entry of one list.

So a core event after the first carries only:

``"changed": {key: value, ...}``
    every state key whose value differs from the previous event's ``after``, whole;
``"patched": {key: [index, value, index, value, ...], ...}`` (absent when empty)
    per-rank lists of unchanged length of which only a few entries changed;
``"removed": [key, ...]`` (absent when empty)
    keys the state no longer has (a key it gained is in ``changed``).

Keys in none of them are unchanged. The first core event, and any whose ``before`` is not the
previous ``after`` (which the coordinator loop never produces), carries ``before`` and
``after`` whole, as every line of older records does: so a core call that changed the
state without being recorded still shows, as the replay's divergence on that ``before``.
``expand`` turns a record's events back into whole states when it is read, so replay
compares whole states as before; the digest chain (``record.chain``) is what makes a
delta trustworthy: no line can be dropped or reordered without the record failing
verification.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import compress, count
from operator import ne
from typing import Any, Final

#: lists shorter than this are written whole when they change (a patch saves nothing)
PATCH_MIN: Final = 16
#: a list of which more than this share changed is written whole
PATCH_SHARE: Final = 0.25

CHANGED: Final = "changed"
PATCHED: Final = "patched"
REMOVED: Final = "removed"
_DELTA: Final = (CHANGED, PATCHED, REMOVED)


_ABSENT: Final[Any] = object()


def _changed_at(prev: list[Any], cur: list[Any], hint: int | None) -> list[int]:
    """Indexes where ``cur`` differs from ``prev`` (same length)."""
    if hint is not None and 0 <= hint < len(cur) and prev[hint] != cur[hint]:
        # The usual case (a rank's message moves its own entry) at C speed: a copy and
        # one comparison instead of a scan.
        probe = prev.copy()
        probe[hint] = cur[hint]
        if probe == cur:
            return [hint]
    elif prev == cur:
        return []
    return list(compress(count(), map(ne, prev, cur)))


def delta(
    prev: Mapping[str, Any],
    cur: Mapping[str, Any],
    hint: int | None = None,
    known: Mapping[str, Sequence[int] | None] | None = None,
    patches: Mapping[str, list[Any]] | None = None,
) -> dict[str, Any]:
    """The fields of a line that take ``prev`` to ``cur``: ``changed``, and
    ``patched``/``removed`` where there are any. ``hint``: the rank the call was about,
    where a change most likely is. ``known``: where lists of ``cur`` differ from
    ``prev``'s, from whoever built one from the other (``Coordinator.summary_changes``):
    a key with its indexes, in order, is not scanned; any other is compared as usual.
    ``patches``: the entries of lists ``prev`` and ``cur`` share that were set in place
    in between (``Summarizer.mirror``), ``[index, value, ...]``; a list then is never
    written by reference (it changes in place later), always copied."""
    changed: dict[str, Any] = {}
    patched: dict[str, list[Any]] = {}
    for k, v in cur.items():
        p = prev.get(k, _ABSENT)
        if p is _ABSENT:
            changed[k] = v if patches is None or type(v) is not list else v.copy()
            continue
        if p is v:
            flat = patches.get(k) if patches is not None else None
            if flat is None:
                continue  # a list the summary handed back unchanged (``state_summary``)
            # Set in place: the patch, as a diff of the two lists would find it.
            if len(v) >= PATCH_MIN and len(flat) // 2 <= PATCH_SHARE * len(v):
                patched[k] = flat
            else:
                changed[k] = v.copy()
            continue
        if type(v) is list and type(p) is list and len(v) == len(p) >= PATCH_MIN:
            told = known.get(k) if known is not None else None
            at = _changed_at(p, v, hint) if told is None else [i for i in told if p[i] != v[i]]
            if not at:
                continue
            if len(at) <= PATCH_SHARE * len(v):
                patched[k] = [x for i in at for x in (i, v[i])]
                continue
        elif p == v:
            continue
        changed[k] = v if patches is None or type(v) is not list else v.copy()
    out: dict[str, Any] = {CHANGED: changed}
    if patched:
        out[PATCHED] = patched
    gone = [k for k in prev if k not in cur]
    if gone:
        out[REMOVED] = gone
    return out


def delta_shared(
    prev: Mapping[str, Any],
    cur: Mapping[str, Any],
    keys: Sequence[str],
    patches: Mapping[str, list[Any]],
) -> dict[str, Any] | None:
    """``delta(prev, cur, patches=patches)`` for two states that share every list (the
    entries set in place between them in ``patches``, in ``cur``'s key order) and may
    differ elsewhere only at ``keys`` (no list among them; in ``cur``'s order, as any of
    them gone is in ``prev``'s): a ``Batch``'s states, whose builder knows this
    (``Summarizer.delta``). The walk over every key, at a fifth of a message's record
    cost at 1,024 ranks, is left out. None where a patch would be written whole: its
    place among the changed values is the walk's to find."""
    patched: dict[str, list[Any]] = {}
    for k, flat in patches.items():
        n = len(cur[k])
        if n < PATCH_MIN or len(flat) // 2 > PATCH_SHARE * n:
            return None
        patched[k] = flat
    changed: dict[str, Any] = {}
    gone: list[str] = []
    for k in keys:
        v = cur.get(k, _ABSENT)
        p = prev.get(k, _ABSENT)
        if p is v or p == v:
            continue  # (absent from both is the first)
        if v is _ABSENT:
            gone.append(k)
        else:
            changed[k] = v
    out: dict[str, Any] = {CHANGED: changed}
    if patched:
        out[PATCHED] = patched
    if gone:
        out[REMOVED] = gone
    return out


def copy_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A state that shares no list or dict with ``state`` (whose lists may change)."""
    return {k: _copy(v) for k, v in state.items()}


def _copy(value: Any) -> Any:
    """A copy of a JSON value that shares no list or dict with it."""
    if type(value) is list:
        if any(type(v) in (list, dict) for v in value):
            return [_copy(v) for v in value]
        return value.copy()
    if type(value) is dict:
        return {k: _copy(v) for k, v in value.items()}
    return value


class BadDelta(ValueError):
    """A delta that does not fit the state before it (a record made by another tool)."""


def apply(prev: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """The state ``fields`` (a line's ``changed``/``patched``) take ``prev`` to; shares
    unchanged values with ``prev``."""
    changed = fields.get(CHANGED)
    patched = fields.get(PATCHED) or {}
    removed = fields.get(REMOVED) or []
    if not isinstance(changed, Mapping) or not isinstance(patched, Mapping):
        raise BadDelta("changed/patched are not maps")
    if not isinstance(removed, list):
        raise BadDelta("removed is not a list")
    out = dict(prev)
    for k in removed:
        if out.pop(k, _ABSENT) is _ABSENT:
            raise BadDelta(f"removed key {k!r} is not a state key")
    out.update(changed)
    for k, flat in patched.items():
        base = out.get(k)
        if type(base) is not list or type(flat) is not list or len(flat) % 2:
            raise BadDelta(f"patch of {k!r} does not fit the state")
        lst = base.copy()
        for i in range(0, len(flat), 2):
            at = flat[i]
            if type(at) is not int or not 0 <= at < len(lst):
                raise BadDelta(f"patch of {k!r} at {at!r} is outside the list")
            lst[at] = flat[i + 1]
        out[k] = lst
    return out


def expand(events: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """A coordinator record's events with every delta turned back into whole ``before``
    and ``after`` states (each event's own copies: a tool may change one in place).
    ``BadDelta`` for a delta with no whole state before it."""
    state: dict[str, Any] | None = None
    for ev in events:
        if CHANGED in ev:
            if state is None:
                raise BadDelta(
                    f"event i={ev.get('i')} holds a state delta, and no event before it "
                    "a whole state"
                )
            after = apply(state, ev)
            ev = {k: v for k, v in ev.items() if k not in _DELTA}
            ev["before"] = _copy(state)
            ev["after"] = _copy(after)
            state = after
        elif isinstance(ev.get("after"), dict):
            state = _copy(ev["after"])
        yield ev
