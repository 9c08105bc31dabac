"""SIGINT, SIGTERM and SIGHUP stop a job the same way (docs/security.md, "Signals").

While the controller trains, the first of them asks it to stop after the step in progress,
with a checkpoint of that step; a second one aborts (KeyboardInterrupt, or ``StopSignal``
for SIGTERM/SIGHUP). Outside training (loading models, starting executors, saving the final
model) SIGTERM and SIGHUP raise ``StopSignal`` at once, so every ``finally`` runs: the
executors are shut down, the shm weight channel is removed and a summary is written. Their
default action would end the process on the spot, leaking all of that.

Only in the main thread, and a signal that is ignored where the job starts (``nohup``) stays
ignored. Executor processes ignore all three (``runtime/process.py``): a signal sent to the
whole process group, as systemd, docker and Slurm send it, reaches the controller, which
shuts them down after the checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopSignal(KeyboardInterrupt):
    """SIGTERM or SIGHUP before training began, after it ended, or a second time."""

    def __init__(self, signum: int) -> None:
        self.signum, self.name = signum, signal.Signals(signum).name
        super().__init__(f"stopped by {self.name}")


def exit_status(signal_name: str | None) -> int:
    """The shell's status for a job stopped by ``signal_name`` (130 for Ctrl-C, 143 for SIGTERM)."""
    try:
        return 128 + int(signal.Signals[signal_name or "SIGINT"])
    except KeyError:
        return 130


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def raise_on_stop_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``StopSignal`` (once; the cleanup that follows is not cut
    short by a second one) instead of ending the process without cleanup."""
    if not _in_main_thread():
        yield
        return
    raised: list[int] = []

    def handler(signum: int, frame) -> None:
        if raised:
            logger.warning(
                "%s again: still cleaning up (shm, executors, summary)", signal.Signals(signum).name
            )
            return
        raised.append(signum)
        raise StopSignal(signum)

    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS[1:]}
    installed = [sig for sig, old in previous.items() if old is signal.SIG_DFL]
    for sig in installed:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig in installed:
            signal.signal(sig, previous[sig])


@contextmanager
def stop_after_step(request_stop: Callable[[], None], stopped_by: list[str]) -> Iterator[None]:
    """While the controller runs, the first stop signal calls ``request_stop`` (stop after
    the current step with a checkpoint) and is named in ``stopped_by``; a second one goes to
    the handler from before (asyncio's for SIGINT, ``raise_on_stop_signals``' for the
    others), which aborts."""
    if not _in_main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    handled = [sig for sig, old in previous.items() if old not in (signal.SIG_IGN, None)]

    def restore() -> None:
        for sig in handled:
            loop.remove_signal_handler(sig)  # (sets SIG_DFL, or Python's SIGINT handler)
            signal.signal(sig, previous[sig])

    def first(sig: int) -> None:
        restore()
        stopped_by.append(signal.Signals(sig).name)
        logger.warning(
            "%s: stopping after the step in progress, with a checkpoint (send it again to abort)",
            stopped_by[-1],
        )
        request_stop()

    try:
        for sig in handled:
            loop.add_signal_handler(sig, first, sig)
    except (NotImplementedError, RuntimeError, ValueError):  # no signal support on this loop
        restore()
        yield
        return
    try:
        yield
    finally:
        if not stopped_by:
            restore()
