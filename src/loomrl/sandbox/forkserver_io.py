"""The fork server's I/O (standard library only): the length-prefixed JSON frames it
speaks with the host (the host imports them from here too); feed an exec's stdin, collect
its output up to a deadline and a cap, and describe how it ended. Imported by
``forkserver.py``; inside the sandbox it sits next to it.
"""

from __future__ import annotations

import base64
import json
import os
import select
import signal
import struct
import time

_HEADER = struct.Struct("!I")
MAX_FRAME_BYTES = 256 * 1024 * 1024


def write_frame(fd: int, message: dict) -> None:
    """Write one length-prefixed JSON frame to a blocking fd."""
    body = json.dumps(message, separators=(",", ":")).encode()
    data = memoryview(_HEADER.pack(len(body)) + body)
    while data:
        written = os.write(fd, data)
        data = data[written:]


def read_exact(fd: int, size: int) -> bytes:
    chunks = []
    while size:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            raise EOFError("channel closed")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> dict:
    """Read one frame written by ``write_frame`` from a blocking fd."""
    (size,) = _HEADER.unpack(read_exact(fd, _HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {size} bytes is over the limit")
    return json.loads(read_exact(fd, size))


class Pump:
    """Feeds an exec's stdin and collects its stdout/stderr up to a deadline and a cap."""

    def __init__(self, req: dict, stdin_w: int, out_r: int, err_r: int) -> None:
        self.deadline = time.monotonic() + float(req["timeout_s"])
        self.cap = int(req["max_output_bytes"])
        self.stdin = memoryview(base64.b64decode(req.get("stdin") or ""))
        self.stdin_w = stdin_w
        self.out, self.err = bytearray(), bytearray()
        self.buffers = {out_r: self.out, err_r: self.err}
        self.open_fds = {out_r, err_r}
        self.reason: str | None = None
        if self.stdin:
            os.set_blocking(stdin_w, False)
        else:
            self._close_stdin()

    def step(self, extra_fds: list[int]) -> bool:
        """Wait for one round of I/O (or ``extra_fds``); False once the exec must stop."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            self.reason = self.reason or "timeout"
            return False
        writers = [self.stdin_w] if self.stdin_w >= 0 else []
        readable, writable, _ = select.select([*self.open_fds, *extra_fds], writers, [], remaining)
        if writable:
            self._feed_stdin()
        for fd in readable:
            if fd in self.open_fds:
                chunk = os.read(fd, 65536)
                if not chunk:
                    self.open_fds.discard(fd)
                    os.close(fd)
                    continue
                self.buffers[fd] += chunk
                if len(self.out) + len(self.err) > self.cap:
                    self.reason = "output_cap"
                    return False
        return True

    def _feed_stdin(self) -> None:
        try:
            written = os.write(self.stdin_w, self.stdin[:65536])
            self.stdin = self.stdin[written:]
        except (BrokenPipeError, BlockingIOError):
            self.stdin = self.stdin[:0]
        if not self.stdin:
            self._close_stdin()

    def _close_stdin(self) -> None:
        if self.stdin_w >= 0:
            os.close(self.stdin_w)
            self.stdin_w = -1

    def close(self) -> None:
        self._close_stdin()
        for fd in self.open_fds:
            os.close(fd)
        self.open_fds = set()


def describe(status: int | None, reason: str | None, out: bytes, err: bytes, cap: int) -> dict:
    if status is None:  # never reaped within its deadline (the sandbox is reported dirty)
        exit_code, sig = None, signal.SIGKILL
    else:
        exit_code = os.waitstatus_to_exitcode(status)
        sig = -exit_code if exit_code < 0 else None
    if reason is None:
        if sig == signal.SIGXCPU:
            reason = "cpu_limit"
        elif sig == signal.SIGXFSZ:
            reason = "file_size_limit"
        elif sig is not None:
            reason = "signal"
        else:
            reason = "exit"
    truncated = len(out) + len(err) > cap
    out = out[:cap]
    err = err[: max(0, cap - len(out))]
    return {
        "exit_code": exit_code if sig is None else None,
        "signal": sig,
        "reason": reason,
        "truncated": truncated,
        "stdout": base64.b64encode(out).decode(),
        "stderr": base64.b64encode(err).decode(),
    }


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])
