"""The daemon's HTTP side: a threaded server that bounds its connections, and the handler
that answers every request, malformed ones included.

- **Connections are capped** in total (below the process's file-descriptor limit) and per
  client address, and every socket has a timeout (``idle_timeout_s``) on each read and
  write. At a cap, a new connection takes the place of the oldest *idle* one (connected,
  its request not yet read: a client that holds sockets open and sends nothing); only
  when every connection is busy is the new one refused, with a 503. So idle connections
  cannot starve a job, and no one exhausts the daemon's descriptors.
- **Bodies are bounded** (``max_body_bytes``): a larger ``Content-Length`` gets a 413
  before one byte of the body is read, and the connection is closed.
- **Every request is answered**: a missing, negative or non-numeric ``Content-Length``,
  chunked bodies, JSON that does not parse or nests too deep, a body that is not an
  object, and a failure inside the daemon each get a JSON error with a status code.
"""

from __future__ import annotations

import json
import logging
import resource
import socket
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from loomrl.scheduler.model import (
    MAX_BODY_BYTES,
    AcquireTimeout,
    BadRequest,
    Forbidden,
    LeaseLost,
    SchedulerError,
    Unauthorized,
    UnknownJob,
)

logger = logging.getLogger(__name__)

ERROR_STATUS = {
    BadRequest: 400,
    Unauthorized: 401,
    Forbidden: 403,
    UnknownJob: 404,
    AcquireTimeout: 408,
    LeaseLost: 410,
}
IDLE_TIMEOUT_S = 10.0
RESERVED_FDS = 64  # the store, logs, pipes and the listening socket


def default_max_connections() -> int:
    """Half the descriptors the process may open (at most 512), leaving ``RESERVED_FDS``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft = 4096 if soft == resource.RLIM_INFINITY else soft
    return max(8, min(512, soft // 2, soft - RESERVED_FDS))


@dataclass
class _Connection:
    sock: socket.socket
    client: str
    opened_at: float
    busy: bool = False


class CappedHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        *,
        max_connections: int | None = None,
        max_per_client: int | None = None,
    ) -> None:
        super().__init__(address, handler)
        self.max_connections = max_connections or default_max_connections()
        self.max_per_client = max_per_client or self.max_connections
        self._conns: dict[socket.socket, _Connection] = {}
        self._conns_lock = threading.Lock()
        self.counts = {"evicted": 0, "refused": 0}

    def verify_request(self, request: Any, client_address: Any) -> bool:
        client = (
            str(client_address[0]) if isinstance(client_address, tuple) else str(client_address)
        )
        with self._conns_lock:
            same = [c for c in self._conns.values() if c.client == client]
            if len(self._conns) >= self.max_connections:
                crowd = list(self._conns.values())
            elif len(same) >= self.max_per_client:
                crowd = same
            else:
                crowd = None
            if crowd is not None:
                idle = [c for c in crowd if not c.busy]
                if not idle:
                    self.counts["refused"] += 1
                    _refuse(request)
                    return False
                victim = min(idle, key=lambda c: c.opened_at)
                del self._conns[victim.sock]
                self.counts["evicted"] += 1
                try:
                    victim.sock.shutdown(socket.SHUT_RDWR)  # its handler reads EOF and ends
                except OSError:
                    pass
            self._conns[request] = _Connection(request, client, time.monotonic())
        return True

    def mark(self, sock: socket.socket, busy: bool) -> None:
        """A request was read whole (busy) or answered (idle again, for keep-alive)."""
        with self._conns_lock:
            conn = self._conns.get(sock)
            if conn is not None:
                conn.busy = busy
                if not busy:
                    conn.opened_at = time.monotonic()

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.pop(request, None)
        super().shutdown_request(request)

    def num_connections(self) -> int:
        with self._conns_lock:
            return len(self._conns)

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug(
            "scheduler: connection from %s ended with an error", client_address, exc_info=True
        )


def _refuse(sock: socket.socket) -> None:
    body = b'{"error": "the scheduler has no free connection; retry", "type": "Busy"}'
    head = f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    try:
        sock.setblocking(False)
        sock.send(head.encode() + b"Connection: close\r\n\r\n" + body)
    except OSError:
        pass


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Handler(BaseHTTPRequestHandler):
    """Answers the daemon's API (``daemon.call``, ``status``, ``health``, ``metrics_text``);
    ``make_handler`` binds it to a daemon and its limits."""

    daemon: Any = None  # the SchedulerDaemon
    max_body_bytes = MAX_BODY_BYTES
    protocol_version = "HTTP/1.1"
    server_version = "loomrl-scheduler"
    default_request_version = "HTTP/1.0"  # answers to a garbage request line get a status line
    timeout = IDLE_TIMEOUT_S  # on every read and write of the socket

    def log_message(self, fmt: str, *args: Any) -> None:
        logger.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, status: int, payload: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Cache-Control", "no-store")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(payload)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _error(self, status: int, message: str, kind: str) -> None:
        self._json(status, {"error": message, "type": kind})

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's answers to a request it cannot parse (a bad request line, a
        header too long, an unknown method), as JSON like every other error."""
        self.close_connection = True
        try:
            self._error(code, message or HTTPStatus(code).phrase, "BadRequest")
        except OSError:
            pass

    def do_GET(self) -> None:  # the http.server API
        self.server.mark(self.connection, True)
        try:
            self._answer_get(self.path.split("?", 1)[0])
        finally:
            self.server.mark(self.connection, False)

    def _answer_get(self, path: str) -> None:
        try:
            if path == "/metrics":
                from prometheus_client.exposition import CONTENT_TYPE_LATEST

                self._send(200, self.daemon.metrics_text(), CONTENT_TYPE_LATEST)
            elif path in ("/", "/dashboard"):
                from loomrl.scheduler.dashboard import DASHBOARD_HTML

                self._send(200, DASHBOARD_HTML.encode(), "text/html; charset=utf-8")
            elif path == "/healthz":
                health = self.daemon.health()
                self._json(200 if health["ok"] else 503, health)
            elif path == "/api/status":
                self._json(200, self.daemon.status())
            else:
                self._error(404, f"no such page {path[:100]!r}", "NotFound")
        except Exception as err:  # an answer, never a dropped connection
            logger.exception("scheduler: GET %s failed", path[:100])
            self._error(
                500,
                f"GET {path[:100]}: internal error: {type(err).__name__}: {err}",
                "InternalError",
            )

    def do_POST(self) -> None:
        route = self.path.split("?", 1)[0][:100]
        try:
            body = self._read_body()
        except _Refused as err:
            self.close_connection = True  # the body was not read: the stream is out of step
            self._error(err.status, f"{route}: {err}", "BadRequest")
            self._linger()
            return
        if body is None:  # the client went away mid-body
            self.close_connection = True
            return
        self.server.mark(self.connection, True)
        try:
            self._answer_post(route, body)
        finally:
            self.server.mark(self.connection, False)

    def _linger(self, timeout_s: float = 1.0, max_bytes: int = 2**20) -> None:
        """Let the answer reach a client still sending its body: stop writing, read and
        drop what comes for a moment, then close (closing on unread data would reset
        the connection and could lose the answer)."""
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            end, dropped = time.monotonic() + timeout_s, 0
            while dropped < max_bytes and time.monotonic() < end:
                self.connection.settimeout(max(0.01, end - time.monotonic()))
                chunk = self.connection.recv(65536)
                if not chunk:
                    break
                dropped += len(chunk)
        except OSError:
            pass

    def _read_body(self) -> bytes | None:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            raise _Refused(411, "chunked bodies are not taken: send a Content-Length")
        raw = self.headers.get("Content-Length") or "0"
        try:
            length = int(raw)
        except ValueError:
            raise _Refused(
                400, f"Content-Length must be a number of bytes, got {raw[:40]!r}"
            ) from None
        if length < 0:
            raise _Refused(400, f"Content-Length must be >= 0, got {length}")
        if length > self.max_body_bytes:
            raise _Refused(
                413, f"a body of {length} bytes is over the limit of {self.max_body_bytes} bytes"
            )
        data = self.rfile.read(length)
        return data if len(data) == length else None

    def _answer_post(self, route: str, raw: bytes) -> None:
        try:
            try:
                body = json.loads(raw or b"{}")
            except (ValueError, RecursionError) as err:
                raise BadRequest(f"{route}: the body is not JSON: {str(err)[:200]}") from None
            self._json(200, self.daemon.call(route, body))
        except KeyError as err:
            if err.args and err.args[0] == route:
                self._error(404, f"no such route {route!r}", "NotFound")
            else:
                logger.exception("scheduler: POST %s failed", route)
                self._error(500, f"{route}: internal error: KeyError: {err}", "InternalError")
        except SchedulerError as err:
            self._error(ERROR_STATUS.get(type(err), 409), str(err), type(err).__name__)
        except Exception as err:
            logger.exception("scheduler: POST %s failed", route)
            self._error(
                500, f"{route}: internal error: {type(err).__name__}: {err}", "InternalError"
            )


def make_handler(
    daemon: Any, *, idle_timeout_s: float = IDLE_TIMEOUT_S, max_body_bytes: int = MAX_BODY_BYTES
) -> type[BaseHTTPRequestHandler]:
    """The request handler for ``daemon`` (a ``SchedulerDaemon``)."""
    attrs = {"daemon": daemon, "timeout": idle_timeout_s, "max_body_bytes": max_body_bytes}
    return type("SchedulerHandler", (Handler,), attrs)
