"""A per-rank list that notes which of its entries were written (``Tracked``).

The state summary (``coordinator.summary``) is built for every message the coordinator
handles, and most of it is per-rank lists of which a message changes one entry or none.
A ``Tracked`` list lets it rebuild only what was written since it last looked, without
trusting every writer to say so: each item assignment marks its index here, whoever
makes it, and anything that could reorder or resize the list marks the whole list. A
writer that replaces the list instead (``self.steps = [0] * ws``) is seen by the
summary as a different object, so a missed write costs a full comparison, never a
wrong summary.

Copy one with ``.copy()`` (a plain list at C speed); ``list(t)`` takes the slow path
CPython keeps for list subclasses (three times the cost at 1,024 entries).

A leaf: the parts that hold per-rank state import it, and it imports none of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, SupportsIndex, TypeVar

__all__ = ["Tracked"]

T = TypeVar("T")


class Tracked(list[T]):
    """A ``list`` whose writes since the reader's last ``take`` are known: ``marks``
    holds the indexes assigned one at a time, ``whole`` says anything else happened
    (a slice assignment, a resize, a sort). Reads are the list's own (C speed)."""

    __slots__ = ("marks", "whole")

    def __init__(self, items: Iterable[T] = ()) -> None:
        super().__init__(items)
        self.marks: set[int] = set()
        self.whole = False

    def __setitem__(self, i: Any, v: Any) -> None:
        list.__setitem__(self, i, v)
        if type(i) is int and i >= 0:
            self.marks.add(i)
        elif isinstance(i, SupportsIndex) and not isinstance(i, slice):
            # a negative or index-like key: the same entry as its non-negative index
            self.marks.add(range(len(self))[i])
        else:
            self.whole = True

    def take(self) -> tuple[bool, set[int]]:
        """(whether the whole list may have changed, the indexes written) since the last
        ``take``, and a fresh start for the next."""
        whole, marks = self.whole, self.marks
        self.whole = False
        if marks:
            self.marks = set()
        return whole, marks

    # Everything else that changes a list changes it as a whole.
    def _all(self) -> None:
        self.whole = True

    def __delitem__(self, i: Any) -> None:
        list.__delitem__(self, i)
        self._all()

    def __iadd__(self, other: Iterable[T]) -> Tracked[T]:  # type: ignore[override,misc]
        list.__iadd__(self, other)
        self._all()
        return self

    def __imul__(self, n: SupportsIndex) -> Tracked[T]:  # type: ignore[override,misc]
        list.__imul__(self, n)
        self._all()
        return self

    def append(self, v: T) -> None:
        list.append(self, v)
        self._all()

    def extend(self, items: Iterable[T]) -> None:
        list.extend(self, items)
        self._all()

    def insert(self, i: SupportsIndex, v: T) -> None:
        list.insert(self, i, v)
        self._all()

    def pop(self, i: SupportsIndex = -1) -> T:
        v = list.pop(self, i)
        self._all()
        return v

    def remove(self, v: T) -> None:
        list.remove(self, v)
        self._all()

    def clear(self) -> None:
        list.clear(self)
        self._all()

    def reverse(self) -> None:
        list.reverse(self)
        self._all()

    def sort(self, *args: Any, **kwargs: Any) -> None:
        list.sort(self, *args, **kwargs)
        self._all()
