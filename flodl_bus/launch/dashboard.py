"""``flodl-bus dashboard --run RUN``: a live web page of a run, fed from its streams.

    flodl-bus dashboard --run RUN [--redis-url URL] [--host 127.0.0.1] [--port 8765]

An observer, like ``flodl-bus tail``: one thread reads every stream of the run from its
beginning with plain XREAD (no consumer group, nothing acked, nothing written) and the
``meta`` hash the coordinator refreshes about once a second, and folds both into
``dashboard_state.DashboardState``. A small threaded HTTP server hands out:

- ``/``: one self-contained page (inline script and style, nothing fetched from any
  other address), which draws what ``/events`` sends;
- ``/events``: Server-Sent Events, one JSON snapshot per change (and at least one a
  second, since rates and heartbeat ages move with the clock alone);
- ``/state``: the current snapshot as JSON, for scripts and ``curl``.

It binds loopback unless ``--host`` says otherwise: the page has no authentication, and
a run's losses and hosts are nobody else's business. On loopback it also refuses a
request naming any other host (a DNS-rebinding page in the browser cannot read it).
``flodl-bus up --dashboard`` starts the same server beside its run.
"""

from __future__ import annotations

import contextlib
import http.server
import ipaddress
import json
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import redis

from flodl_bus.bus import entries
from flodl_bus.bus.connection import MAX_BLOCK_MS, REFUSALS, RETRYABLE, add_url_argument
from flodl_bus.bus.foreign import writer_limit
from flodl_bus.bus.ids import ZERO, EntryId, format_id, parse_id
from flodl_bus.bus.keys import BROADCAST, RunKeys
from flodl_bus.bus.tail import RunUnavailable, open_run
from flodl_bus.launch.dashboard_page import PAGE
from flodl_bus.launch.dashboard_state import DashboardState
from flodl_bus.options import OneLineParser
from flodl_bus.protocol import wire
from flodl_bus.stop_signals import SignalStop, StopSignals

DEFAULT_PORT = 8765
#: how often the key space is rescanned for streams that appeared (ranks start late)
RESCAN_S = 1.0
#: how often ``meta`` is read (the coordinator refreshes it once a second)
META_EVERY_S = 0.5
READ_COUNT = 1000
BLOCK_MS = 200
#: a snapshot goes out at least this often, news or not
PUSH_EVERY_S = 1.0


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class _Unchecked:
    """An observer holds no rank keys: it checks an entry's shape, never its MAC."""

    def verify(self, data: bytes, mac: bytes) -> bool:
        return True


_UNCHECKED = _Unchecked()


class Observer:
    """Reads one run's streams and meta into a ``DashboardState``, under ``cond``."""

    def __init__(self, client: redis.Redis, run: str) -> None:
        self.client = client
        self.keys = RunKeys(run)
        self.state = DashboardState(run)
        self.cond = threading.Condition()
        self._last: dict[str, EntryId] = {}
        self._next_scan = 0.0
        self._next_meta = 0.0
        #: why the last read failed (Redis unreachable...), None while reads work
        self.trouble: str | None = None

    def snapshot(self) -> dict[str, Any]:
        with self.cond:
            snap = self.state.snapshot(_now_ms())
            snap["trouble"] = self.trouble
            return snap

    def _scan(self) -> None:
        found: set[str] = set()
        for pattern in (self.keys.ctl_pattern, self.keys.up_pattern):
            for k in self.client.scan_iter(match=pattern, count=1000, _type="stream"):
                found.add(k.decode() if isinstance(k, bytes) else str(k))
        if self.client.exists(self.keys.dlq):
            found.add(self.keys.dlq)
        for stream in found:
            self._last.setdefault(stream, ZERO)  # all of a stream is news to the page

    def _expect(self, world: str) -> None:
        """Read every stream of a known world from the start, before it exists: a
        stream found only by a later scan would be folded after entries of others that
        were written after it (XREAD of a missing key is simply empty)."""
        if not world.isdigit():
            return
        for r in range(int(world)):
            for stream in (self.keys.ctl(r), self.keys.up(r)):
                self._last.setdefault(stream, ZERO)
        for stream in (self.keys.ctl_all, self.keys.dlq):
            self._last.setdefault(stream, ZERO)

    def step(self, block_ms: int | None = BLOCK_MS) -> None:
        """One round: rescan and re-read meta when due, then one XREAD of every stream."""
        now = time.monotonic()
        if now >= self._next_scan:
            self._scan()
            self._next_scan = now + RESCAN_S
        if now >= self._next_meta:
            raw: Any = self.client.hgetall(self.keys.meta)
            meta = {_text(k): _text(v) for k, v in raw.items()}
            with self.cond:
                self.state.on_meta(meta, _now_ms())
                self.cond.notify_all()
            self._next_meta = now + META_EVERY_S
            self._expect(meta.get("world_size", ""))
        if not self._last:
            if block_ms:
                time.sleep(block_ms / 1000)
            return
        block = None if block_ms is None else min(block_ms, MAX_BLOCK_MS)
        reply: Any = self.client.xread(
            {s: format_id(i) for s, i in self._last.items()}, count=READ_COUNT, block=block
        )
        got: list[tuple[EntryId, str, dict[bytes, bytes]]] = []
        before = dict(self._last)
        limit = writer_limit(_now_ms())
        for name, items in reply or ():
            stream = _text(name)
            for raw_id, fields in items:
                eid = parse_id(raw_id)
                if eid[0] > limit:
                    # Beyond any id of the run (a foreign entry): the cursor stays, or
                    # nothing the run writes after it would be read.
                    break
                self._last[stream] = eid
                got.append((eid, stream, fields))
        # Ids are the writers' millisecond clocks: sorting approximates the order things
        # happened across streams (within a stream it is exact either way).
        got.sort(key=lambda g: g[0])
        with self.cond:
            for eid, stream, fields in got:
                self._fold(stream, eid, fields)
            if got:
                self.cond.notify_all()
        if reply and block is not None and self._last == before:
            time.sleep(block / 1000)  # only an entry the cursor must not pass came back

    def _fold(self, stream: str, eid: EntryId, fields: dict[bytes, bytes]) -> None:
        keys, state = self.keys, self.state
        if stream == keys.dlq:
            state.on_dead_letter(eid, fields)
            return
        rank = keys.rank_of(stream)
        upstream = keys.short(stream).startswith("up:")
        if rank is None and stream != keys.ctl_all:
            return  # a stream of the run the page has nothing to say about
        parsed = entries.parse(
            _UNCHECKED,
            stream,
            format_id(eid).encode(),
            fields,
            channel=wire.UPSTREAM if upstream else wire.CONTROL,
            rank=BROADCAST if rank is None else str(rank),
        )
        if isinstance(parsed, str):
            state.on_unreadable()
        elif upstream:
            assert rank is not None
            state.on_upstream(rank, eid, parsed.msg)
        else:
            state.on_control(rank, eid, parsed.msg)

    def run(self, stop: threading.Event) -> None:
        """Read until ``stop`` is set; Redis going away is said on the page, not fatal."""
        while not stop.is_set():
            try:
                self.step()
                if self.trouble is not None:
                    with self.cond:
                        self.trouble = None
                        self.cond.notify_all()
            except (*RETRYABLE, OSError, *REFUSALS) as exc:
                with self.cond:
                    self.trouble = f"Redis unreachable ({type(exc).__name__}); retrying"
                    self.cond.notify_all()
                stop.wait(0.5)


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        return  # a request line per poll would bury the console

    def _host_ok(self) -> bool:
        if not self.server.loopback_only:
            return True
        host = self.headers.get("Host", "")
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        return is_loopback(name)

    def _send(self, code: int, kind: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        # The page fetches nothing from anywhere else, and says so to the browser.
        self.send_header(
            "Content-Security-Policy",
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
            "connect-src 'self'; img-src data:",
        )
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if not self._host_ok():
            self._send(403, "text/plain; charset=utf-8", b"loopback only\n")
            return
        path = self.path.split("?", 1)[0]
        if path == "/":
            self._send(200, "text/html; charset=utf-8", PAGE.encode())
        elif path == "/state":
            body = json.dumps(self.server.observer.snapshot()).encode()
            self._send(200, "application/json", body)
        elif path == "/events":
            self._events()
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found\n")

    def _events(self) -> None:
        observer, stop = self.server.observer, self.server.stopping
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        seen = -1
        try:
            while not stop.is_set():
                with observer.cond:
                    if observer.state.revision == seen:
                        observer.cond.wait(PUSH_EVERY_S)
                    seen = observer.state.revision
                snap = observer.snapshot()
                self.wfile.write(b"data: " + json.dumps(snap).encode() + b"\n\n")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            return  # the page was closed


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    observer: Observer
    stopping: threading.Event
    loopback_only: bool


class Dashboard:
    """The observer thread and the HTTP server of one run; ``start`` returns the URL."""

    def __init__(self, client: redis.Redis, run: str, host: str = "127.0.0.1", port: int = 0):
        self.observer = Observer(client, run)
        self.host = host
        self.port = port
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server: _Server | None = None

    def start(self) -> str:
        """Bind and serve (raises OSError when the address is taken or not ours)."""
        server = _Server((self.host, self.port), _Handler)
        server.observer = self.observer
        server.stopping = self._stop
        server.loopback_only = is_loopback(self.host)
        self._server = server
        for name, target in (
            ("dashboard-observer", lambda: self.observer.run(self._stop)),
            ("dashboard-http", lambda: server.serve_forever(poll_interval=0.2)),
        ):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self.url

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else str(host)
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/"

    def close(self) -> None:
        self._stop.set()
        with self.observer.cond:
            self.observer.cond.notify_all()  # event streams end at once
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        for t in self._threads:
            t.join(timeout=2.0)


def main(argv: Sequence[str] | None = None) -> int:
    ap = OneLineParser(
        prog="flodl-bus dashboard",
        description="Serve a live web page of a run, fed from its streams as they arrive: "
        "per-rank step, loss and throughput, the anchor and window, the averaging gate "
        "and why it is shut, averaging rounds, deaths and re-formations, dead letters, "
        "the eval curve. Runs until Ctrl-C.",
        epilog="Binds loopback by default (the page has no authentication); from another "
        "machine use an SSH tunnel: ssh -L 8765:127.0.0.1:8765 HOST. Read-only: the "
        "observer user is enough (FLODL_REDIS_USERNAME / FLODL_REDIS_PASSWORD).",
    )
    required = ap.add_argument_group("required")
    required.add_argument("--run", required=True, help="run id")
    add_url_argument(ap)
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ap.add_argument(
        "--port", type=int, default=DEFAULT_PORT,
        help=f"port to bind (default {DEFAULT_PORT}; 0: a free one, printed)",
    )  # fmt: skip
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        client, _keys = open_run(args.run, args.redis_url, "flodl-dashboard")
    except RunUnavailable as exc:
        print(f"flodl-bus dashboard: {exc}", file=sys.stderr)
        return 2
    dash = Dashboard(client, args.run, args.host, args.port)
    try:
        with StopSignals() as signals:
            try:
                url = dash.start()
            except OSError as exc:
                print(
                    f"flodl-bus dashboard: cannot bind {args.host}:{args.port} "
                    f"({exc.strerror or exc}): pick another --port (0: any free one)",
                    file=sys.stderr,
                )
                return 2
            if not is_loopback(args.host):
                print(
                    f"flodl-bus dashboard: serving on {args.host}, beyond this machine: "
                    "the page has no authentication",
                    file=sys.stderr,
                )
            print(f"flodl-bus dashboard: run {args.run} at {url}  (Ctrl-C to stop)", flush=True)
            done = threading.Event()
            signals.call_on_stop(lambda _sig, _n: done.set())
            done.wait()
    except SignalStop:
        pass  # stopped while starting: as good as stopped while serving
    finally:
        dash.close()
        with contextlib.suppress(Exception):
            client.close()
    return 0
