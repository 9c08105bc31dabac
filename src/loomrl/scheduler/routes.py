"""The daemon's routes as a Starlette app (served by uvicorn, ``httpd.py``): every answer,
errors included, is JSON ``{"error": message, "type": name}`` with a status code.

The daemon's calls block (an acquire long-polls for up to ``poll_s`` on the scheduler's
lock), so they run on a thread pool of the daemon's; ``/healthz`` and the dashboard answer
on the event loop and take no lock, so they answer while the core is stuck. A body is read
only when its ``Content-Length`` is within ``max_body_bytes`` (else 413, unread); a
chunked body is counted as it streams and refused at the bound.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from http import HTTPStatus
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from loomrl.scheduler.dashboard import DASHBOARD_HTML
from loomrl.scheduler.model import (
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


def json_response(status: int, obj: Any, headers: dict[str, str] | None = None) -> Response:
    # json.dumps as the stdlib server did: a NaN in a snapshot is written, not a 500
    return Response(
        json.dumps(obj).encode(),
        status_code=status,
        media_type="application/json",
        headers={"Cache-Control": "no-store", **(headers or {})},
    )


def error_response(status: int, message: str, kind: str, **headers: str) -> Response:
    return json_response(status, {"error": message, "type": kind}, headers)


class _BodyTooLarge(Exception):
    pass


async def _read_body(request: Request, max_body_bytes: int) -> bytes:
    """The body, counted as it arrives (a chunked one has no length to check first)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise _BodyTooLarge(f"a body over {max_body_bytes} bytes (streamed) is over the limit")
        chunks.append(chunk)
    return b"".join(chunks)


class DaemonRoutes:
    """The daemon's pages and calls, its blocking work on ``pool``."""

    def __init__(self, daemon: Any, pool: Executor, max_body_bytes: int) -> None:
        self.daemon, self.pool, self.max_body_bytes = daemon, pool, max_body_bytes

    async def on_pool(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def post(self, request: Request) -> Response:
        route, limit = request.url.path[:100], self.max_body_bytes
        length = request.headers.get("content-length")
        # h11 has refused a Content-Length that is not a number before the app sees it
        if length is not None and int(length) > limit:
            message = f"{route}: a body of {int(length)} bytes is over the limit of {limit} bytes"
            return error_response(413, message, "BadRequest", Connection="close")
        try:
            raw = await _read_body(request, limit)
        except _BodyTooLarge as err:
            return error_response(413, f"{route}: {err}", "BadRequest", Connection="close")
        except ClientDisconnect:
            # the client went away mid-body: nothing is sent on a closed connection
            return Response(status_code=400)
        status, out = await self.on_pool(self.answer_post, route, raw)
        return json_response(status, out)

    def answer_post(self, route: str, raw: bytes) -> tuple[int, dict[str, Any]]:
        """``POST route`` with the body ``raw``: (status, JSON answer). Runs on the pool."""
        try:
            try:
                body = json.loads(raw or b"{}")
            except (ValueError, RecursionError) as err:
                raise BadRequest(f"{route}: the body is not JSON: {str(err)[:200]}") from None
            return 200, self.daemon.call(route, body)
        except KeyError as err:
            if err.args and err.args[0] == route:
                return 404, {"error": f"no such route {route!r}", "type": "NotFound"}
            logger.exception("scheduler: POST %s failed", route)
            message = f"{route}: internal error: KeyError: {err}"
            return 500, {"error": message, "type": "InternalError"}
        except SchedulerError as err:
            return ERROR_STATUS.get(type(err), 409), {"error": str(err), "type": type(err).__name__}
        except Exception as err:
            logger.exception("scheduler: POST %s failed", route)
            message = f"{route}: internal error: {type(err).__name__}: {err}"
            return 500, {"error": message, "type": "InternalError"}

    async def get(self, request: Request) -> Response:
        path = request.url.path
        try:
            if path == "/healthz":
                health = self.daemon.health()
                return json_response(200 if health["ok"] else 503, health)
            if path == "/api/status":
                return json_response(200, await self.on_pool(self.daemon.status))
            if path == "/metrics":
                from prometheus_client.exposition import CONTENT_TYPE_LATEST

                text = await self.on_pool(self.daemon.metrics_text)
                return Response(text, media_type=CONTENT_TYPE_LATEST)
            return Response(DASHBOARD_HTML, media_type="text/html; charset=utf-8")
        except Exception as err:  # an answer, never a dropped connection
            logger.exception("scheduler: GET %s failed", path[:100])
            message = f"GET {path[:100]}: internal error: {type(err).__name__}: {err}"
            return error_response(500, message, "InternalError")


async def _http_error(request: Request, err: Exception) -> Response:
    """Starlette's own refusals (an unknown page 404, another method 405) in the daemon's JSON."""
    assert isinstance(err, HTTPException)
    kind = HTTPStatus(err.status_code).phrase.replace(" ", "")
    message = f"{request.method} {request.url.path[:100]!r}: {err.detail}"
    return error_response(err.status_code, message, kind, **(err.headers or {}))


def build_app(daemon: Any, pool: Executor, max_body_bytes: int) -> Starlette:
    """The routes of ``daemon`` (a ``SchedulerDaemon``), its blocking calls on ``pool``."""
    routes = DaemonRoutes(daemon, pool, max_body_bytes)
    pages = ["/healthz", "/api/status", "/metrics", "/", "/dashboard"]
    table = [Route(page, routes.get, methods=["GET"]) for page in pages]
    table.append(Route("/v1/{name}", routes.post, methods=["POST"]))
    app = Starlette(routes=table, exception_handlers={HTTPException: _http_error})
    # "/v1/register/" is an unknown route (404), as it always was, not a redirect
    app.router.redirect_slashes = False
    return app
