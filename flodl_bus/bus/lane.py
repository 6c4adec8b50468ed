"""One connection kept for one hot command path: the request and its raw reply.

redis-py's client-level call (``Redis.execute_command``: the pool's lock and pid check,
observability counters, deprecation wrappers, the reply callback) cost 25-40 µs of CPU a
command on a loaded 2-core host, where writing the request and reading the reply on a
connection cost 10-13 µs: more than the loopback round trip itself. The control path
pays it twice per message (the coordinator's XADD, the rank's XREAD), so those two, and
the batch script, go through a ``Lane``: a connection taken from the client's own pool
(the same URL, credentials, client name and fault-injecting connection class in tests)
and kept by the one thread that sends on it (the coordinator under its send lock, a
rank's reader thread).

The request is packed by hiredis straight from the arguments (bytes, str or int, as the
bus's hot commands are): redis-py's serializer first runs every argument through its
encoder and type checks, 20-25 µs of an XADD's 90 on a loaded 2-core host against 4 µs
(issue 27). A caller that packs its own request (``bus.resp``) hands the bytes to
``call_packed``.

Errors surface as they would through the client: a lost connection is a
``ConnectionError`` (the connection is dropped, and the next call connects again) for
``Link`` to retry; an error reply is the ``ResponseError`` subclass redis-py's parser
names (NOSCRIPT, NOPERM, ...), and the connection stays usable.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import hiredis
import redis

#: one command as RESP, packed by hiredis from bytes, str (UTF-8) or int arguments (its
#: stub types the tuple as one item long)
pack = cast(Callable[[tuple[Any, ...]], bytes], hiredis.pack_command)


class Lane:
    """A connection of ``client``'s pool kept between calls. Meant for one thread; a
    call made while another is in flight, or after ``close``, takes a connection of the
    pool for itself and gives it back after, as the client would."""

    def __init__(self, client: redis.Redis) -> None:
        self.pool = client.connection_pool
        self._conn: Any = None
        self._closed = False
        self._state = threading.Lock()

    def call(self, *args: Any) -> Any:
        """The raw reply of one command (RESP2 shapes: bytes, ints, nested lists).
        Arguments are bytes, str (UTF-8) or int."""
        return self.call_packed(pack(args))

    def call_packed(self, packed: bytes) -> Any:
        """The raw reply of the command ``packed`` holds as RESP."""
        return self.call_many([packed])[0]

    def call_many(self, packed: Sequence[bytes]) -> list[Any]:
        """The raw replies of several packed commands, sent in one write, in order (a
        pipeline without redis-py's per-argument packing). An error reply is raised,
        the first one, once every reply is read, so the connection stays in step."""
        with self._state:
            conn, self._conn = self._conn, None
        if conn is None:
            conn = self.pool.get_connection()
        try:
            conn.send_packed_command(packed)
            replies: list[Any] = []
            error: redis.exceptions.ResponseError | None = None
            for _ in packed:
                try:
                    replies.append(conn.read_response())
                except redis.exceptions.ResponseError as exc:
                    error = error or exc
                    replies.append(exc)
            if error is not None:
                raise error
            return replies
        except redis.exceptions.ResponseError:
            raise  # error replies, every one read: the connection is in step
        except BaseException:
            # Lost, timed out, or interrupted between request and reply: whatever comes
            # next on this connection would be out of step with its requests. The next
            # command connects again.
            conn.disconnect()
            raise
        finally:
            with self._state:
                keep = not self._closed and self._conn is None
                if keep:
                    self._conn = conn
            if not keep:
                self.pool.release(conn)

    def close(self) -> None:
        """Give the kept connection back to the pool (one in flight goes back after)."""
        with self._state:
            self._closed = True
            conn, self._conn = self._conn, None
        if conn is not None:
            self.pool.release(conn)
