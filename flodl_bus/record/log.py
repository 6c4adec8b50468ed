"""structlog set up once per process: a readable console and a fast JSONL record.

Two sinks, deliberately separate:

* the console logger (global structlog config) is for people: key=value lines on stderr;
* a ``Recorder`` is the durable record of one process (``runs/<run>/<role>.jsonl``): a
  structlog logger wrapped around a ``BytesLogger`` with orjson, no stdlib ``logging`` on
  the hot path, one line per event.

Secrets never reach either sink: the ``redact`` processor masks them by key and strips
credentials out of URLs.
"""

from __future__ import annotations

import base64
import gzip
import sys
import threading
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import IO, Any

import orjson
import structlog

from flodl_bus.bus.connection import redact_url

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


def configure_console(level: str = "info") -> None:
    """Human-readable structured logs on stderr. Idempotent; cheap when filtered out."""
    global _configured
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
            cache_logger_on_first_use=True,
        )
        _configured = True


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
    """Appends one JSON object per line to ``path``. Thread-safe; flushed on close."""

    def __init__(self, path: str | Path, *, encoder: Encoder | None = None, **context: Any) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[bytes] = open(self.path, "ab", buffering=1 << 16)  # noqa: SIM115
        self._write_lock = threading.Lock()
        default = _default_with(encoder)

        def serialize(event: Any, **_kw: Any) -> bytes:
            return orjson.dumps(event, default=default, option=_OPTIONS)

        render = structlog.processors.JSONRenderer(serializer=serialize)
        # An explicit BoundLogger: the default lazy proxy re-resolves its configuration
        # on every call, which costs more than the rest of a record.
        self._log = structlog.wrap_logger(
            structlog.BytesLogger(self._file),
            processors=[redact, render],
            wrapper_class=structlog.BoundLogger,
            context_class=dict,
        ).bind(**context)
        # Core events have a fixed set of fields holding protocol data only (no key that
        # could hold a secret), so they skip the redaction pass: it is most of the cost
        # of a record on the dispatching thread.
        self._core = structlog.wrap_logger(
            structlog.BytesLogger(self._file),
            processors=[render],
            wrapper_class=structlog.BoundLogger,
            context_class=dict,
        ).bind(**context)

    def record(self, event: str, **fields: Any) -> None:
        """A free-form event: every field goes through ``redact``."""
        with self._write_lock:
            self._log.msg(event, **fields)

    def record_core(self, event: str, **fields: Any) -> None:
        """A core event of the dispatch schema (fields fixed by ``record.dispatch``)."""
        with self._write_lock:
            self._core.msg(event, **fields)

    def flush(self) -> None:
        with self._write_lock:
            self._file.flush()

    def close(self) -> None:
        with self._write_lock:
            if not self._file.closed:
                self._file.flush()
                self._file.close()

    @property
    def closed(self) -> bool:
        return self._file.closed


class DamagedRecord(ValueError):
    """A record line other than the last one does not parse: something cut or edited it."""


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a JSONL file (``.gz`` too).

    Only the *last* line may be torn (a crash mid-write); a bad line anywhere else means
    the record was damaged, and replaying around the hole could call a run identical
    that is not, so it raises ``DamagedRecord`` naming the line.
    """
    out: list[dict[str, Any]] = []
    bad: int | None = None
    opener: Any = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if bad is not None:
                raise DamagedRecord(f"{path}: line {bad} is not a JSON record")
            try:
                out.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                bad = number
    return out
