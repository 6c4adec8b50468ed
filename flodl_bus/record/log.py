"""structlog set up once per process: a readable console and a fast JSONL record.

Two sinks, deliberately separate:

* the console logger (global structlog config) is for people: key=value lines on stderr;
* a ``Recorder`` is the durable record of one process (``runs/<run>/<role>.jsonl[.zst]``):
  orjson straight into a chained line (``record.chain``), no logging framework on the
  hot path, one line per event.

Secrets never reach either sink: the ``redact`` processor masks them by key and strips
credentials out of URLs.
"""

from __future__ import annotations

import base64
import sys
import threading
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import orjson
import structlog

from flodl_bus.bus.connection import redact_url
from flodl_bus.record import chain

_SECRET_KEYS = frozenset({"secret", "password", "passwd", "token", "run_secret", "mac_key"})
_configured = False
_lock = threading.Lock()


def redact(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key in list(event):
        lowered = key.lower()
        if lowered in _SECRET_KEYS or lowered.endswith("_secret") or lowered.endswith("password"):
            event[key] = "***"
        else:
            value = event[key]
            if isinstance(value, str) and "://" in value:
                event[key] = redact_url(value)
    return event


class _Stderr:
    """Whatever ``sys.stderr`` is at write time: a test runner swaps it per test, and a
    logger bound to the first one would write to a closed file afterwards."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


#: the level ``configure_console`` set, for processes this one starts (None: not set)
_level: str | None = None


def console_level() -> str | None:
    """The level the console was configured at in this process (None: never)."""
    return _level


def configure_console(level: str = "info", *, cache: bool = True) -> None:
    """Human-readable structured logs on stderr. Idempotent; cheap when filtered out.
    ``cache=False`` is for a test session: a logger cached on its first use escapes a
    later ``structlog.testing.capture_logs``."""
    global _configured, _level
    with _lock:
        if _configured:
            return
        structlog.configure(
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
                redact,
                structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()),
            ],
            wrapper_class=structlog.make_filtering_bound_logger(level),
            logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),  # type: ignore[arg-type]
            cache_logger_on_first_use=cache,
        )
        _configured = True
        _level = level


#: What orjson cannot write itself (messages, effects, other dataclasses) is turned into
#: JSON-ready data by an encoder the caller passes (``record.dispatch.record_value``):
#: encoding objects inside orjson's C walk, instead of converting whole events in Python
#: first, is what keeps a record line cheap on the dispatching thread.
Encoder = Callable[[Any], Any]


def _default_with(encoder: Encoder | None) -> Callable[[Any], Any]:
    def default(obj: Any) -> Any:
        if isinstance(obj, bytes):
            return {"$b": base64.b64encode(obj).decode()}
        if isinstance(obj, (set, frozenset)):
            return sorted(obj)
        if encoder is not None:
            return encoder(obj)
        raise TypeError(f"cannot record {type(obj).__name__}")

    return default


_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_PASSTHROUGH_DATACLASS
_PLAIN_DEFAULT = _default_with(None)


def dumps(event: Any, encoder: Encoder | None = None) -> bytes:
    """One record value as the record writes it (no newline)."""
    default = _PLAIN_DEFAULT if encoder is None else _default_with(encoder)
    return orjson.dumps(event, default=default, option=_OPTIONS)


def unjson(value: Any) -> Any:
    """Inverse of the record's encoding: ``{"$b": ...}`` back to bytes, lists to tuples."""
    if isinstance(value, dict):
        if len(value) == 1 and "$b" in value:
            return base64.b64decode(value["$b"])
        return {k: unjson(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(unjson(v) for v in value)
    return value


class Recorder:
    """Appends one JSON object per line to ``path`` in a digest chain (``record.chain``);
    ``*.zst`` paths are written in zstd frames. Thread-safe: the chain follows the file's
    order, whichever thread wrote. After ``end`` the record takes no more lines."""

    def __init__(self, path: str | Path, *, encoder: Encoder | None = None, **context: Any) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write_lock = threading.Lock()
        self._default = _default_with(encoder)
        self._context = context
        self._last = chain.SEED
        #: ``FLODL_RECORD_KEY``'s key when the record was opened (b"": unkeyed)
        self._key = chain.record_key()
        self.lines = 0
        self.ended = False
        self._resume()
        # The sink seals every line into the chain, in the order written (a compressed
        # record's on its writer thread), going on from ``_last``.
        self._sink = chain.open_sink(self.path, last=self._last, key=self._key, encode=self._dumps)

    def _dumps(self, event: Mapping[str, Any]) -> bytes:
        return orjson.dumps(event, default=self._default, option=_OPTIONS)

    def _resume(self) -> None:
        """Lines appended to an existing record (the launcher's ``up.jsonl`` of a run id
        used again) continue its chain, so the file still verifies as a whole."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        st = chain.ChainState()
        try:
            for _ in chain.verified_lines(self.path, st, parse=False, key=self._key):
                pass
        except chain.DamagedRecord:
            return
        if st.chained and not st.torn and not st.ended:
            self._last, self.lines = st.last, st.lines

    def _write(self, event: dict[str, Any]) -> None:
        self._append(self._sink.write, self._dumps(event))

    def _append(self, put: Callable[[Any], None], item: Any) -> None:
        """One line handed to the sink (``put``: its ``write`` or ``write_event``)."""
        with self._write_lock:
            if self.ended or self._sink.closed:
                return  # a late line from another thread: the record is closed
            put(item)
            self.lines += 1

    def record(self, event: str, **fields: Any) -> None:
        """A free-form event: every field goes through ``redact``."""
        self._write(redact(None, "", {"event": event, **self._context, **fields}))  # type: ignore[arg-type]

    def record_core(self, event: str, **fields: Any) -> None:
        """A core event of the dispatch schema (fields fixed by ``record.dispatch``).

        Core events have a fixed set of fields holding protocol data only (no key that
        could hold a secret), so they skip the redaction pass: it would be most of the
        cost of a record on the dispatching thread."""
        self._write(self._core_fields(event, fields))

    def _core_fields(self, event: str, fields: dict[str, Any]) -> dict[str, Any]:
        if self._context:
            fields = {**self._context, **fields}
        fields["event"] = event  # last, as structlog wrote it: a dict built once
        return fields

    def record_settled(self, event: str, **fields: Any) -> None:
        """``record_core`` for an event none of whose values changes after the call
        (numbers, fresh dicts and lists, frozen messages): a compressed record encodes
        it on its writer thread, off the caller's (a rank's step, its training thread's
        hottest line). The line is the one ``record_core`` writes, in the same place."""
        fields = self._core_fields(event, fields)
        if self._sink.defers:
            self._append(self._sink.write_event, fields)
        else:
            self._write(fields)  # encoded here, outside the lock, as any other line

    def end(self, **fields: Any) -> None:
        """The closing line: a record without it was cut short (a kill, a crash, a hang).
        ``records`` counts the lines before it."""
        self._write(
            redact(None, "", {"event": "end", **self._context, "records": self.lines, **fields})  # type: ignore[arg-type]
        )
        with self._write_lock:
            self.ended = True

    def flush(self) -> None:
        with self._write_lock:
            if not self._sink.closed:
                self._sink.flush()

    def close(self) -> None:
        with self._write_lock:
            if not self._sink.closed:
                self._sink.flush()
                self._sink.close()

    @property
    def closed(self) -> bool:
        return self._sink.closed


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a record file (plain, ``.zst`` or ``.gz``; ``x.jsonl`` finds
    ``x.jsonl.zst``), without the chain's digests.

    The chain is verified (``DamagedRecord`` names the first line that breaks it); a last
    line cut mid-write is left out, as a record being written or cut by a crash has one.
    """
    return [r for _, r in chain.verified_lines(path) if r is not None]
