"""The daemon's HTTP side: its routes (``routes.py``, Starlette) served by uvicorn on a
thread of the daemon, with uvicorn's h11 protocol extended where the daemon promises more
than uvicorn does out of the box.

- **Connections are capped** in total (below the process's file-descriptor limit) and per
  client address. At a cap, a new connection takes the place of the oldest *idle* one
  (connected, its request not yet read whole: a client that holds sockets open and sends
  nothing, or sends slowly); only when every connection is busy is the new one refused,
  with a JSON 503. So idle connections cannot starve a job, and no one exhausts the
  daemon's descriptors. (uvicorn's own ``limit_concurrency`` only answers 503 past the
  limit: a crowd of idle sockets would keep every job out.)
- **Time is bounded** (``idle_timeout_s``): a connection that has not sent a whole
  request (headers and body) this long after it opened or after its last answer is
  closed, so a slow-loris client that trickles its headers is dropped as surely as an
  idle one; so is one that leaves an answer unread this long.
- **Bodies are bounded** (``max_body_bytes``): a larger ``Content-Length`` gets a 413
  before one byte of the body is read, a chunked body is counted as it streams; the
  connection is then closed (after a short linger, so the answer reaches a client still
  sending).
- **Every request is answered**: what h11 cannot parse (a garbage request line, a
  non-numeric or negative ``Content-Length``, a header over 64 KiB) gets a JSON error
  with h11's status (400, 431) instead of uvicorn's plain-text 400; the routes answer the
  rest in JSON.
"""

from __future__ import annotations

import json
import logging
import resource
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from loomrl.scheduler.model import MAX_BODY_BYTES
from loomrl.scheduler.routes import build_app

logger = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 10.0
RESERVED_FDS = 64  # the store, logs, pipes and the listening socket
LISTEN_QUEUE = 128  # connections the kernel holds for the daemon to accept
MAX_HEADER_BYTES = 64 * 1024  # a request's head (line and headers) at most
LINGER_S, LINGER_BYTES = 1.0, 2**20  # what a refused body may still send before the close
SHUTDOWN_GRACE_S = 2.0  # in-flight answers (a long poll wakes at stop) before tasks are cancelled
_BUSY = b'{"error": "the scheduler has no free connection; retry", "type": "Busy"}'
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_BUSY), _BUSY)
)


def _fd_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 4096 if soft == resource.RLIM_INFINITY else soft


def default_max_connections() -> int:
    """Half the descriptors the process may open (at most 512), leaving ``RESERVED_FDS``."""
    soft = _fd_limit()
    return max(8, min(512, soft // 2, soft - RESERVED_FDS))


def accept_batch(max_connections: int) -> int:
    """How many connections the event loop accepts in one go. asyncio accepts up to its
    ``backlog`` per pass, and a connection is admitted (an idle one evicted, its socket
    closed) two passes later, so about three batches are open beyond the cap; they must
    fit under the descriptor limit, at which asyncio stops accepting for a second."""
    spare = _fd_limit() - max_connections - RESERVED_FDS // 2
    return max(4, min(LISTEN_QUEUE, spare // 4))


class ConnectionBook:
    """The open connections of one server (its event loop's thread alone changes them)."""

    def __init__(self, max_connections: int, max_per_client: int, idle_timeout_s: float) -> None:
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.idle_timeout_s = idle_timeout_s
        self.open: set[GuardedH11Protocol] = set()
        self.counts = {"evicted": 0, "refused": 0, "timed_out": 0}

    def admit(self, conn: GuardedH11Protocol) -> bool:
        """Room for ``conn``: made by closing the oldest idle connection at a cap; False
        (refuse it) when every connection in the way is busy."""
        same = [c for c in self.open if c.peer == conn.peer]
        if len(self.open) >= self.max_connections:
            crowd = list(self.open)
        elif len(same) >= self.max_per_client:
            crowd = same
        else:
            crowd = []
        if crowd:
            idle = [c for c in crowd if not c.busy]
            if not idle:
                self.counts["refused"] += 1
                return False
            victim = min(idle, key=lambda c: c.idle_since)
            self.open.discard(victim)
            self.counts["evicted"] += 1
            victim.drop()
        self.open.add(conn)
        return True


class _Connection(h11.Connection):
    """h11's connection, keeping the parse error it raised (its status hint: 400, 431),
    and bounding a request's head: h11 bounds only a head still incomplete, and takes a
    longer one that arrives in one read."""

    error: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            event = super().next_event()
            if isinstance(event, h11.Request):
                size = len(event.method) + len(event.target)
                size += sum(len(name) + len(value) + 4 for name, value in event.headers)
                if size > MAX_HEADER_BYTES:
                    raise h11.RemoteProtocolError(
                        f"a request head of {size} bytes is over the limit of {MAX_HEADER_BYTES}",
                        error_status_hint=431,
                    )
            return event
        except h11.RemoteProtocolError as err:
            self.error = err
            raise


class _ClientFaultLog(logging.LoggerAdapter):
    """uvicorn's log for a connection, where a client's malformed request (a warning in
    uvicorn) is a debug line: the daemon answers it, and a flood of them is no news."""

    @property
    def level(self) -> int:  # uvicorn reads its logger's level
        return self.logger.level

    def warning(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.debug(msg, *args, **kwargs)


class _Transport:
    """A connection's asyncio transport as uvicorn sees it: its ``close`` goes through the
    protocol, which lingers when the client is still sending a body it will not read."""

    def __init__(self, raw: Any, close: Any) -> None:
        self.raw, self._close = raw, close

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)

    def close(self) -> None:
        self._close()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under the ``ConnectionBook``'s caps and the idle deadline.
    A connection is *busy* from the moment its request is read whole until its answer is
    written; otherwise it is idle, may be evicted at a cap, and is closed at its deadline."""

    book: ConnectionBook  # set per server by ``SchedulerHTTPServer``

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _Connection(h11.SERVER, MAX_HEADER_BYTES)
        self.logger = _ClientFaultLog(logger)
        self.busy = False
        self.idle_since = time.monotonic()
        self.peer = ""
        self._lingering = False
        self._linger_left = LINGER_BYTES
        self._timer: Any = None

    def connection_made(self, transport: Any) -> None:  # asyncio's protocol API
        super().connection_made(_Transport(transport, self._close))
        self.peer = self.client[0] if self.client else ""
        if not self.book.admit(self):
            transport.write(REFUSAL)
            self._linger()
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.book.open.discard(self)
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._linger_left -= len(data)
            if self._linger_left <= 0:
                self.drop()
            return
        super().data_received(data)
        self._mark()

    def on_response_complete(self) -> None:
        self.busy = False
        self.idle_since = time.monotonic()
        if self._lingering or self.transport.is_closing():
            return
        self._arm()
        super().on_response_complete()
        self._mark()

    def pause_writing(self) -> None:  # the client leaves an answer unread: a deadline
        super().pause_writing()
        self._arm()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.busy:
            self._disarm()

    def send_400_response(self, msg: str) -> None:
        """What h11 cannot parse, answered in JSON with h11's status (uvicorn's is plain text)."""
        err = self.conn.error
        status = getattr(err, "error_status_hint", 400) or 400
        body = json.dumps({"error": f"malformed request: {err or msg}", "type": "BadRequest"})
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"cache-control", b"no-store"),
            (b"connection", b"close"),
        ]
        head = h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status])
        try:
            self.transport.write(
                self.conn.send(head) + self.conn.send(h11.Data(data=body.encode()))
            )
        except h11.LocalProtocolError:
            # an answer cannot be framed on this connection any more: it is closed unanswered
            pass
        self._linger()

    def drop(self) -> None:
        """Close the connection now (evicted, past its deadline, done lingering)."""
        self._disarm()
        self.transport.raw.close()

    def _close(self) -> None:
        # uvicorn closes after an answer that ends the connection; if the request's body is
        # still coming (refused unread: 413), closing now would reset the connection
        if self.conn.their_state is h11.SEND_BODY and not self._lingering:
            self._linger()
        else:
            self.drop()

    def _mark(self) -> None:
        """Busy once a request is read whole: no deadline while the daemon answers it."""
        cycle = self.cycle
        busy = cycle is not None and not cycle.more_body and not cycle.response_complete
        if busy and not self.busy:
            self._disarm()
        self.busy = busy

    def _arm(self) -> None:
        self._disarm()
        self._timer = self.loop.call_later(self.book.idle_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if not self.transport.is_closing():
            self.book.counts["timed_out"] += 1
            self.drop()

    def _linger(self) -> None:
        """Stop writing, drop what the client still sends for a moment, then close."""
        self._disarm()
        self.book.open.discard(self)
        self._lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.transport.resume_reading()
        self._timer = self.loop.call_later(LINGER_S, self.drop)


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    """The listening socket, bound now so that the port is known (and taken) before serving."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # asyncio listened with the accept batch as the queue: the kernel may hold more
        for sock in sockets or []:
            sock.listen(LISTEN_QUEUE)


class SchedulerHTTPServer:
    """``daemon``'s routes on uvicorn (h11, the asyncio loop), on ``host:port`` (0: a free
    port). ``serve_forever`` serves on the calling thread until ``shutdown``; the socket is
    bound at construction, so ``server_address`` is known before."""

    def __init__(
        self,
        daemon: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_connections: int | None = None,
        max_per_client: int | None = None,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        cap = max_connections or default_max_connections()
        self.book = ConnectionBook(cap, max_per_client or cap, idle_timeout_s)
        # the daemon's calls block (a long poll holds its thread): at most one per connection
        self.pool = ThreadPoolExecutor(max_workers=cap + 4, thread_name_prefix="scheduler-call")
        protocol = type("SchedulerProtocol", (GuardedH11Protocol,), {"book": self.book})
        self.socket = _listen(host, port, LISTEN_QUEUE)
        config = uvicorn.Config(
            build_app(daemon, self.pool, max_body_bytes),
            http=protocol,
            # the loop whose accept batches ``accept_batch`` sizes (uvloop's libuv accepts
            # on its own terms)
            loop="asyncio",
            lifespan="off",
            # no websockets, and no proxy in front whose X-Forwarded-For is believed
            ws="none",
            proxy_headers=False,
            log_config=None,
            access_log=False,
            server_header=False,
            headers=[("server", "loomrl-scheduler")],
            backlog=accept_batch(cap),
            timeout_keep_alive=idle_timeout_s,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        )
        self._server = _Server(config)
        self._serving = threading.Event()
        self._done = threading.Event()

    @property
    def server_address(self) -> tuple[str, int]:
        return self.socket.getsockname()[:2]

    @property
    def counts(self) -> dict[str, int]:
        """Connections evicted at a cap, refused (503, all busy), closed at their deadline."""
        return self.book.counts

    def num_connections(self) -> int:
        return len(self.book.open)

    def serve_forever(self) -> None:
        self._serving.set()
        try:
            self._server.run(sockets=[self.socket])
        finally:
            self._done.set()

    def shutdown(self, timeout_s: float = 2 * SHUTDOWN_GRACE_S + 1.0) -> None:
        """Stop serving: no new connection; answers in flight get ``SHUTDOWN_GRACE_S``."""
        self._server.should_exit = True
        if self._serving.is_set() and not self._done.wait(timeout_s):
            self._server.force_exit = True
            self._done.wait(1.0)

    def server_close(self) -> None:
        self.socket.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
