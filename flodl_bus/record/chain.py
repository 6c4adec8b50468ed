"""The on-disk form of a record: JSON lines in a digest chain, plain or in zstd frames.

Every line is one JSON object whose last field is ``"d"``: the first 8 bytes of a BLAKE2b
over the previous line's digest and this line's bytes without ``"d"`` (the first line
chains from ``SEED``). A record is complete when its last line is an ``end`` record
(``Recorder.end``); one without it was cut short (a kill, a crash, a hang). So:

* an edited line fails its own digest; a removed, moved or inserted line fails the digest
  of the line after it; a cut record has no end. Each is named by file and line.
* Without a key the chain proves the lines are the ones a writer put there in that
  order, not who wrote them: anyone can rewrite a record and recompute every digest
  (``flodl-bus replay``'s ``save_run`` re-chains a record it changed on purpose, e.g.
  after surgery). With ``FLODL_RECORD_KEY`` set (a secret kept outside the run
  directory) every digest is a keyed BLAKE2b: a record is written and verified under
  that key, and a chain rebuilt without it (or with another) fails at its first line.

Compressed records (``*.jsonl.zst``) hold the same lines in zstd frames, sealed and
compressed on a writer thread. It emits a block whenever it has been idle ``FLUSH_S``
seconds (and when zstd's block fills), and ends a frame every ``FRAME_BYTES`` of input
and at close: a reader gets every line up to the last emitted block, while the record is written and
after a crash (a kill loses at most the lines of the last moments). ``*.jsonl.gz`` and records
without a chain (written before the chain existed) are read too; the latter are reported
as unchained, never as verified.
"""

from __future__ import annotations

import collections
import gzip
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

import orjson
import zstandard

SEED: Final = b"flodl-bus record v2"
DIGEST_BYTES: Final = 8
#: ``,"d":"<16 hex>"}`` closes every chained line
_D_OPEN: Final = b',"d":"'
_SUFFIX_LEN: Final = len(_D_OPEN) + 2 * DIGEST_BYTES + 2
FLUSH_S: Final = 0.1
#: how often the zstd writer looks for lines (a flush or the close wakes it at once):
#: each look is a wake and a GIL hand-over on the recording thread, which in a rank is the
#: training thread (a world of one's writer: 125 -> 73 wakes a second at 0.05 s against
#: 0.02 s); within ``FLUSH_S``, so what a hung process recorded is still readable
GATHER_S: Final = 0.05
#: most lines the zstd writer takes off its queue for one compress call
_BATCH_LINES: Final = 512
FRAME_BYTES: Final = 4 << 20
ZSTD_LEVEL: Final = 3
_READ_CHUNK: Final = 1 << 16
SUFFIXES: Final = (".jsonl.zst", ".jsonl.gz", ".jsonl")


class DamagedRecord(ValueError):
    """A record line was edited, removed, moved or is not JSON: the record cannot be
    trusted. ``path`` and ``line`` name where (``line`` counts from 1)."""

    def __init__(self, path: str | Path, line: int, why: str) -> None:
        super().__init__(f"{path}:{line}: {why}")
        self.path = str(path)
        self.line = line
        self.why = why


class IncompleteRecord(ValueError):
    """The record has no end line: its process was killed, crashed or hung. Every line up
    to ``last_line`` verified."""

    def __init__(self, path: str | Path, last_line: int, torn: bool) -> None:
        how = f"line {last_line + 1} is cut mid-line" if torn else "there is no end record"
        super().__init__(
            f"{path}: incomplete: {how}; lines 1-{last_line} verified "
            "(--allow-incomplete replays up to there)"
        )
        self.path = str(path)
        self.last_line = last_line
        self.torn = torn


class UnchainedRecord(ValueError):
    """A record without a digest chain (written before it existed): it cannot be verified."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(
            f"{path}: no digest chain (a record written before records were chained): "
            "it cannot be verified; record the run again"
        )
        self.path = str(path)


_blake2b = hashlib.blake2b


#: the environment variable holding the record key (any string; empty means none)
ENV_RECORD_KEY: Final = "FLODL_RECORD_KEY"


def record_key(env: Mapping[str, str] | None = None) -> bytes:
    """The chain's key from ``FLODL_RECORD_KEY`` (b"": no key, the unkeyed chain)."""
    raw = (os.environ if env is None else env).get(ENV_RECORD_KEY, "")
    if not raw:
        return b""
    # Any string: BLAKE2b takes keys of at most 64 bytes.
    return hashlib.blake2b(raw.encode(), digest_size=32, person=b"flodl-rec-key").digest()


def digest(prev: bytes, body: bytes, key: bytes = b"") -> bytes:
    return _blake2b(prev + body, digest_size=DIGEST_BYTES, key=key).digest()


def seal(prev: bytes, body: bytes, key: bytes = b"") -> tuple[bytes, bytes]:
    """(line with its digest and newline, the digest) for ``body`` (one JSON object);
    ``key``: the record key (``record_key``), b"" for the unkeyed chain."""
    d = _blake2b(prev + body, digest_size=DIGEST_BYTES, key=key).digest()
    return b'%s,"d":"%s"}\n' % (body[:-1], d.hex().encode()), d


def unseal(line: bytes) -> tuple[bytes, bytes] | None:
    """(body as it was chained, digest) of a line without its newline; None: no digest."""
    if len(line) <= _SUFFIX_LEN or line[-_SUFFIX_LEN:-18] != _D_OPEN or line[-2:] != b'"}':
        return None
    try:
        d = bytes.fromhex(line[-18:-2].decode())
    except ValueError:
        return None
    return line[:-_SUFFIX_LEN] + b"}", d


# ----------------------------------------------------------------------------- writing


class Sink:
    """Where a recorder's lines go, each sealed into the chain (``seal``) in the order
    written: a plain file, each line written through at once."""

    #: whether ``write_event`` leaves the encoding to a thread of the sink's own
    defers: bool = False

    def __init__(
        self,
        path: Path,
        *,
        last: bytes = SEED,
        key: bytes = b"",
        encode: Callable[[Any], bytes] | None = None,
    ) -> None:
        self._file: IO[bytes] = open(path, "ab", buffering=0)  # noqa: SIM115
        #: the digest of the last line sealed: the link of the next
        self.last = last
        self._key = key
        self._encode = encode

    def write(self, body: bytes) -> None:
        """``body`` (one JSON object) sealed into the chain and written."""
        line, self.last = seal(self.last, body, self._key)
        self._file.write(line)

    def write_event(self, event: dict[str, Any]) -> None:
        """An event nothing changes any more, encoded (``encode``) and written: here at
        once; a ``ZstdSink`` encodes it on its writer thread."""
        assert self._encode is not None, "the sink was opened without an encoder"
        self.write(self._encode(event))

    def flush(self) -> None:
        return None

    def close(self) -> None:
        self._file.close()

    @property
    def closed(self) -> bool:
        return self._file.closed


class ZstdSink(Sink):
    """zstd frames written by a thread of their own: the recording thread only queues the
    line (compressing it would be most of a record's cost there), and the writer seals
    each line into the chain in queue order. An event handed to ``write_event`` is queued
    as it is and encoded by the writer too: a rank's step line, whose encoding and sealing
    took its training thread about 20 µs a step on a 2-core machine (issue 27; the line
    after a training step runs with cold caches), against about 8 µs of the writer's
    time, which encodes the lines of ``GATHER_S`` together.
    The writer wakes every ``GATHER_S`` (or at once for a flush or the close), never per
    line: a wake-up per line was a GIL hand-over per training step on the recording
    thread's path. It emits a block as soon as it has nothing queued for ``FLUSH_S``, so
    a hung process leaves everything it recorded readable; a frame ends every
    ``FRAME_BYTES`` and at close."""

    defers = True

    def __init__(
        self,
        path: Path,
        *,
        last: bytes = SEED,
        key: bytes = b"",
        encode: Callable[[Any], bytes] | None = None,
    ) -> None:
        super().__init__(path, last=last, key=key, encode=encode)
        self._cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        self._obj = self._cctx.compressobj()
        self._in_frame = 0
        self._dirty = False
        self._flushed = time.monotonic()
        #: line bodies, events to encode, flush events and the close (None), in order;
        #: appended by any thread, taken by the writer only (deque's append and popleft
        #: are atomic)
        self._q: collections.deque[bytes | dict[str, Any] | threading.Event | None] = (
            collections.deque()
        )
        #: set by a flush or the close: the writer does not wait out ``GATHER_S``
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="flodl-record-zstd")
        self._thread.daemon = True
        self._thread.start()

    def write(self, body: bytes) -> None:
        self._q.append(body)

    def write_event(self, event: dict[str, Any]) -> None:
        assert self._encode is not None, "the sink was opened without an encoder"
        self._q.append(event)

    def flush(self) -> None:
        """Everything queued so far is on disk as a whole block when this returns."""
        if not self._thread.is_alive():
            return
        done = threading.Event()
        self._q.append(done)
        self._wake.set()
        done.wait(10.0)

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._q.append(None)
        self._wake.set()
        self._thread.join(30.0)
        self._file.close()

    @property
    def closed(self) -> bool:
        return self._closing or self._file.closed

    def _encoded(self, event: dict[str, Any]) -> bytes:
        assert self._encode is not None
        try:
            return self._encode(event)
        except Exception as exc:
            # Encoded on the recording thread, this would have raised there; here the
            # line still takes its place (the chain and the end record's count hold),
            # saying what could not be recorded: a replay stops at it.
            return orjson.dumps(
                {
                    "event": "unrecordable",
                    "i": event.get("i"),
                    "of": event.get("event"),
                    "error": repr(exc)[:300],
                }
            )

    def _run(self) -> None:
        q, wake, key = self._q, self._wake, self._key
        while True:
            if not q:
                wake.wait(GATHER_S)
                wake.clear()
            if not q:
                if self._dirty and time.monotonic() - self._flushed > FLUSH_S:
                    self._flush_block()
                continue
            # Every line queued meanwhile goes into one compress call: the writer's
            # Python work per line is GIL time the recording thread waits for.
            lines: list[bytes] = []
            last = self.last
            while q and len(lines) < _BATCH_LINES:
                item = q[0]
                kind = type(item)
                if kind is bytes:
                    body: bytes = item  # type: ignore[assignment]
                elif kind is dict:
                    body = self._encoded(item)  # type: ignore[arg-type]
                else:
                    break
                q.popleft()
                line, last = seal(last, body, key)
                lines.append(line)
            self.last = last
            if lines:
                data = lines[0] if len(lines) == 1 else b"".join(lines)
                out = self._obj.compress(data)
                if out:
                    self._file.write(out)
                self._dirty = True
                self._in_frame += len(data)
                if self._in_frame >= FRAME_BYTES:
                    self._end_frame()
                elif time.monotonic() - self._flushed > FLUSH_S:
                    self._flush_block()  # a steady stream of lines is readable as it goes
                continue
            item = q.popleft()
            if item is None:
                if self._in_frame:
                    self._end_frame()
                return
            assert isinstance(item, threading.Event)
            self._flush_block()
            item.set()

    def _flush_block(self) -> None:
        if self._dirty:
            self._file.write(self._obj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
            self._dirty = False
        self._flushed = time.monotonic()

    def _end_frame(self) -> None:
        self._file.write(self._obj.flush(zstandard.COMPRESSOBJ_FLUSH_FINISH))
        self._obj = self._cctx.compressobj()
        self._in_frame = 0
        self._dirty = False


def open_sink(
    path: Path,
    *,
    last: bytes = SEED,
    key: bytes = b"",
    encode: Callable[[Any], bytes] | None = None,
) -> Sink:
    """The sink of ``path`` (zstd frames for ``*.zst``), its chain going on from ``last``
    under ``key``; ``encode`` turns an event of ``write_event`` into its line's body."""
    cls = ZstdSink if path.name.endswith(".zst") else Sink
    return cls(path, last=last, key=key, encode=encode)


# ----------------------------------------------------------------------------- reading


def resolve(path: str | Path) -> Path:
    """``path``, or the compressed record of the same name (``x.jsonl`` -> ``x.jsonl.zst``
    or ``x.jsonl.gz``) when only that exists."""
    p = Path(path)
    if p.exists() or not p.name.endswith(".jsonl"):
        return p
    for suffix in (".zst", ".gz"):
        alt = p.with_name(p.name + suffix)
        if alt.exists():
            return alt
    return p


def _chunks(path: Path) -> Iterator[bytes]:
    name = path.name
    with open(path, "rb") as f:
        if name.endswith(".gz"):
            with gzip.GzipFile(fileobj=f) as g:
                try:
                    while chunk := g.read(_READ_CHUNK):
                        yield chunk
                except EOFError:
                    return  # a gzip cut short: everything before the cut was yielded
            return
        if not name.endswith(".zst"):
            while chunk := f.read(_READ_CHUNK):
                yield chunk
            return
        dctx = zstandard.ZstdDecompressor()
        obj = dctx.decompressobj()
        while data := f.read(_READ_CHUNK):
            while data:
                out = obj.decompress(data)
                if out:
                    yield out
                if not obj.eof:
                    break
                # a frame ended: the rest of the read belongs to the next one
                data = obj.unused_data
                obj = dctx.decompressobj()


def raw_lines(path: str | Path) -> Iterator[bytes]:
    """The record's lines in order, each with its newline; a last line cut mid-write comes
    without one. Streams: memory holds one chunk and one line."""
    rest = b""
    for chunk in _chunks(resolve(path)):
        data = rest + chunk if rest else chunk
        start = 0
        while (nl := data.find(b"\n", start)) >= 0:
            yield data[start : nl + 1]
            start = nl + 1
        rest = data[start:]
    if rest:
        yield rest


def record_bytes(path: str | Path) -> bytes:
    """The whole record as plain JSON lines (decompressed)."""
    return b"".join(raw_lines(path))


@dataclass
class ChainState:
    """Where a verified walk of one record stands."""

    lines: int = 0
    last: bytes = SEED
    chained: bool | None = None
    ended: bool = False
    torn: bool = False


def verified_lines(
    path: str | Path,
    state: ChainState | None = None,
    *,
    parse: bool = True,
    key: bytes | None = None,
) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """(line number, record without ``d``) for every line whose digest follows its
    predecessor's; raises ``DamagedRecord`` at the first that does not (or is not JSON,
    or follows the end record). A torn last line ends the walk with ``state.torn`` set;
    ``state.ended`` says whether the end record was reached. A record whose first line
    has no digest is unchained: its lines come unverified (``state.chained`` False).
    With ``parse=False`` only the chain is checked (records come as None). ``key``: the
    record key (default: ``FLODL_RECORD_KEY``'s)."""
    st = state if state is not None else ChainState()
    key = record_key() if key is None else key
    where = resolve(path)
    lines = raw_lines(where)
    while True:
        try:
            raw = next(lines)
        except StopIteration:
            return
        except zstandard.ZstdError as exc:
            # Bytes that are no zstd frame (appended, overwritten): damage, not a crash.
            raise DamagedRecord(
                where, st.lines + 1, f"not a zstd frame after line {st.lines} ({exc})"
            ) from None
        number = st.lines + 1
        if not raw.endswith(b"\n"):
            st.torn = True
            return
        line = raw.rstrip(b"\r\n")
        if not line.strip():
            raise DamagedRecord(where, number, "an empty line")
        if st.ended:
            raise DamagedRecord(where, number, "a line after the end record")
        sealed = unseal(line)
        if st.chained is None:
            st.chained = sealed is not None
        if st.chained:
            if sealed is None:
                raise DamagedRecord(where, number, "no digest: the line was edited or inserted")
            body, d = sealed
            if digest(st.last, body, key) != d:
                if number > 1:
                    why = (
                        "the digest does not follow: this line was edited, or a line "
                        "before it was removed or moved"
                    )
                elif key and digest(st.last, body) == d:
                    why = (
                        f"the chain has no key, and {ENV_RECORD_KEY} is set: the record "
                        "was written without the key, or rewritten by someone without it"
                    )
                elif key:
                    why = (
                        "the digest does not follow: the header line was edited, or the "
                        f"record was chained under another {ENV_RECORD_KEY}"
                    )
                else:
                    why = (
                        "the digest does not follow: the header line was edited, or the "
                        f"record is keyed (set {ENV_RECORD_KEY} to verify it)"
                    )
                raise DamagedRecord(where, number, why)
            st.last = d
        else:
            body = line
        rec: dict[str, Any] | None = None
        if parse or body.startswith(b'{"event":"end"'):
            try:
                rec = orjson.loads(body)
            except orjson.JSONDecodeError:
                raise DamagedRecord(where, number, "not a JSON record") from None
            if not isinstance(rec, dict):
                raise DamagedRecord(where, number, "not a JSON object")
            if st.chained and rec.get("event") == "end":
                st.ended = True
                said = rec.get("records")
                if isinstance(said, int) and said != number - 1:
                    raise DamagedRecord(
                        where,
                        number,
                        f"the end record counts {said} lines before it; the file holds "
                        f"{number - 1}: lines were removed or added and the chain rewritten",
                    )
        st.lines = number
        yield number, rec


def check(path: str | Path, *, allow_incomplete: bool = False) -> ChainState:
    """Verify a whole record without keeping it: ``DamagedRecord``, ``UnchainedRecord``,
    or ``IncompleteRecord`` (unless ``allow_incomplete``)."""
    st = ChainState()
    for _ in verified_lines(path, st, parse=False):
        pass
    if st.chained is False:
        raise UnchainedRecord(resolve(path))
    if not st.ended and not allow_incomplete:
        raise IncompleteRecord(resolve(path), st.lines, st.torn)
    return st


def size_on_disk(path: str | Path) -> int:
    return os.stat(resolve(path)).st_size
