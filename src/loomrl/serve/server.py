"""The endpoint served: uvicorn on the caller's event loop, and the job's token and address
in its run folder.

``Endpoint.start()`` serves ``build_app(state)`` on the running loop (the controller's, so
an agent function, the endpoint and the batcher share one loop and no thread). uvicorn
keeps the connection limits (``limit_concurrency``: past it a request is answered 503;
``timeout_keep_alive``; h11's bound on an incomplete request's headers). The token
(``secrets.token_urlsafe(32)``) is written to ``<run>/serve_token`` (mode 0600) and the URL
to ``<run>/serve.json``, which ``loomrl status`` reads.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from pathlib import Path

import uvicorn

from loomrl.serve.app import ServeState, build_app

TOKEN_FILE, INFO_FILE = "serve_token", "serve.json"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_private(path: Path, text: str) -> None:
    """``text`` into ``path``, readable by this user only (mode 0600, never through a link)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


class _Server(uvicorn.Server):
    # The job owns Ctrl-C (session/run.py): uvicorn must not take the signal handlers.
    def capture_signals(self):  # uvicorn's hook
        import contextlib

        return contextlib.nullcontext()


class Endpoint:
    """The app served on ``host:port`` (0: a free port) until ``stop``."""

    def __init__(
        self, state: ServeState, host: str = "127.0.0.1", port: int = 0, max_connections: int = 1024
    ) -> None:
        self.state, self.host, self.port = state, host, port
        config = uvicorn.Config(
            build_app(state),
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            limit_concurrency=max_connections,
            timeout_keep_alive=30,
            lifespan="off",
        )
        self._server = _Server(config)
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> str:
        """Serve on the running loop; the base URL once it listens."""
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError(f"the endpoint did not start on {self.host}:{self.port}")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self.url

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        await asyncio.wait([self._task], timeout=5.0)
        if not self._task.done():
            self._server.force_exit = True
            await asyncio.wait([self._task], timeout=5.0)
        self._task = None

    def write_run_files(self, run_dir: Path) -> None:
        """The token (0600) and the URL in the run folder, for a harness and ``loomrl status``."""
        write_private(run_dir / TOKEN_FILE, self.state.token + "\n")
        info = {"url": self.url + "/v1", "model": self.state.model_name, "token_file": TOKEN_FILE}
        (run_dir / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")


def read_run_files(run_dir: Path) -> dict | None:
    """The endpoint's URL, model and token of a run folder (None: the run serves none)."""
    info_path = run_dir / INFO_FILE
    if not info_path.is_file():
        return None
    info = json.loads(info_path.read_text())
    token_path = run_dir / TOKEN_FILE
    info["token"] = token_path.read_text().strip() if token_path.is_file() else None
    return info
