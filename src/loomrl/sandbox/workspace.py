"""``Workspace``: one episode's stateful sandbox, drawn from the warm pool.

A workspace holds one pooled sandbox for the whole episode. Every exec of the episode
runs in the same private directory (``/tmp/w/ws`` inside ``bwrap``; a dir under the
sandbox's host work dir on the ``process`` backend), owned by the sandbox's dedicated
uid: files written in one tool call are there in the next, and nothing else is carried
(each exec is still a fresh fork; processes do not outlive their call). No other
episode can see the dir: every sandbox has its own uid, and one sandbox serves one
workspace at a time. ``close`` kills what is left of the uid, removes the dir and checks
it is gone before the sandbox goes back to the pool (a sandbox it cannot clean is
quarantined); it runs whatever ends the episode (``with`` block, exception, the env's
``close``). A killed host takes its sandboxes with it (``bwrap``: the tmpfs goes with
the mount namespace; ``process``: the next pool removes the dir, see
``sweep_stale_work_dirs``).

File names are relative to the workspace: absolute names and ``..`` are refused before
anything runs, and the read or write itself runs *as the sandbox uid* inside the
sandbox, refusing a path whose real location leaves the workspace (a symlink out) or is
a symlink itself. The server, as root, never touches a path the code controls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import PurePosixPath

from loomrl.sandbox.base import ExecResult, SandboxError
from loomrl.sandbox.fork_sandbox import ForkServerSandbox

ESCAPE_EXIT = 3
MISSING_EXIT = 4
# Run as the sandbox uid in the workspace: resolve the parent dir, refuse a path whose
# real location leaves the workspace, and never follow a symlink at the last component.
_RESOLVE = """
import os, sys
root = os.path.realpath(os.getcwd())
rel = {path!r}
parent = os.path.realpath(os.path.join(root, os.path.dirname(rel)))
if parent != root and not parent.startswith(root + os.sep):
    sys.stderr.write("path escapes the workspace: " + rel)
    sys.exit({escape})
target = os.path.join(parent, os.path.basename(rel))
"""
_WRITE = """
os.makedirs(parent, exist_ok=True)
try:
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
except OSError as err:
    sys.stderr.write("cannot write " + rel + ": " + err.strerror)
    sys.exit({escape})
data = sys.stdin.buffer.read()
with os.fdopen(fd, "wb") as f:
    f.write(data)
print(len(data))
"""
_READ = """
try:
    fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW)
except FileNotFoundError:
    sys.stderr.write("no such file in the workspace: " + rel)
    sys.exit({missing})
except OSError as err:
    sys.stderr.write("cannot read " + rel + ": " + err.strerror)
    sys.exit({escape})
with os.fdopen(fd, "rb") as f:
    sys.stdout.buffer.write(f.read({limit}))
"""


class WorkspaceLost(SandboxError):
    """The workspace's sandbox died (or an exec left it unclean): its files are gone and
    the episode cannot use it again."""


def check_relative_path(path: str) -> str:
    """``path`` normalised, if it names something inside the workspace; else ValueError."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValueError(f"bad workspace path {path!r}")
    parts = PurePosixPath(path).parts
    if PurePosixPath(path).is_absolute() or ".." in parts:
        raise ValueError(f"path {path!r} leaves the workspace (absolute or '..')")
    clean = str(PurePosixPath(*[p for p in parts if p != "."])) if parts else ""
    if clean in ("", "."):
        raise ValueError(f"path {path!r} names the workspace itself, not a file")
    return clean


class Workspace:
    """A sandbox that keeps its working dir for one episode; ``close`` wipes it.

    Open it with ``pool.workspace()``. Calls are serialised (one exec at a time). A call
    cut at its timeout leaves the workspace usable: its process is killed, its files stay.
    A call that loses the sandbox returns ``reason = "sandbox_lost"``; a call that finds it
    already dead, and every later call, raises ``WorkspaceLost`` (a tool's runner shows
    either to the model as a tool error).
    """

    def __init__(
        self,
        sandbox: ForkServerSandbox,
        *,
        release: Callable[[ForkServerSandbox, list[str]], None],
        record: Callable[[ExecResult, float], None],
        timeout_s: float,
        max_output_bytes: int,
    ) -> None:
        self._sandbox: ForkServerSandbox | None = sandbox
        self._release, self._record = release, record
        self.timeout_s, self.max_output_bytes = timeout_s, max_output_bytes
        self.lost: str | None = None
        self.num_execs = 0

    @property
    def alive(self) -> bool:
        """Open and usable: not closed, its sandbox not lost."""
        return self._sandbox is not None and self.lost is None

    def _exec(self, code: str | None, timeout_s: float | None, **kwargs: object) -> ExecResult:
        if self._sandbox is None:
            raise SandboxError("workspace is closed")
        if self.lost is not None:
            raise WorkspaceLost(f"workspace lost: {self.lost}")
        t0 = time.perf_counter()
        kwargs.setdefault("max_output_bytes", self.max_output_bytes)
        try:
            result = self._sandbox.exec(
                code, timeout_s=timeout_s or self.timeout_s, workspace=True, **kwargs
            )
        except SandboxError as err:
            self.lost = str(err)
            raise WorkspaceLost(f"workspace lost: {err}") from None
        self.num_execs += 1
        self._record(result, (time.perf_counter() - t0) * 1e3)
        if result.reason == "sandbox_lost" or self._sandbox.dirty:
            self.lost = result.stderr.strip() or "the exec left the sandbox unclean"
        return result

    def run_python(self, code: str, timeout_s: float | None = None) -> ExecResult:
        """Run a Python snippet with the workspace as its working directory."""
        return self._exec(code, timeout_s)

    def run_shell(self, command: str, timeout_s: float | None = None) -> ExecResult:
        """Run a ``/bin/sh -c`` command line with the workspace as its working directory."""
        return self._exec(None, timeout_s, command=["/bin/sh", "-c", command])

    def write_file(self, path: str, text: str | bytes) -> int:
        """Write ``text`` to ``path`` (relative; parent dirs created); returns bytes written."""
        rel = check_relative_path(path)
        code = _RESOLVE.format(path=rel, escape=ESCAPE_EXIT) + _WRITE.format(escape=ESCAPE_EXIT)
        result = self._exec(code, None, stdin=text)
        self._raise_for(result, rel)
        return int(result.stdout.strip())

    def read_file(self, path: str, max_bytes: int | None = None) -> str:
        """The text of ``path`` (relative), at most ``max_bytes`` (default: the output cap)."""
        rel = check_relative_path(path)
        limit = int(max_bytes or self.max_output_bytes)
        code = _RESOLVE.format(path=rel, escape=ESCAPE_EXIT)
        code += _READ.format(missing=MISSING_EXIT, escape=ESCAPE_EXIT, limit=limit)
        result = self._exec(code, None, max_output_bytes=limit + 1)
        self._raise_for(result, rel)
        return result.stdout

    @staticmethod
    def _raise_for(result: ExecResult, rel: str) -> None:
        if result.ok:
            return
        message = result.stderr.strip() or f"{result.reason} (exit {result.exit_code})"
        if result.exit_code == MISSING_EXIT:
            raise FileNotFoundError(message)
        if result.exit_code == ESCAPE_EXIT:
            raise ValueError(message)
        raise OSError(f"workspace file {rel!r}: {message}")

    def close(self) -> None:
        """Wipe the workspace and give its sandbox back (idempotent)."""
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is None:
            return
        dirty = sandbox.wipe_workspace() if self.lost is None else [f"lost: {self.lost}"]
        self._release(sandbox, dirty)

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
