"""Who may talk to the scheduler daemon: a daemon token to register, a secret per job.

- The **daemon token** (``secrets.token_urlsafe(32)``, new at every start) lives in a
  0600 file in a 0700 folder of the daemon's user. Registering a job needs it; whoever
  can read the file may register. The default file is per user and per port,
  ``~/.cache/loomrl/scheduler/port-PORT.token``, so a job of the same user finds it from
  the URL alone; ``LOOMRL_SCHEDULER_TOKEN_FILE`` (both sides) or ``--token-file`` moves it,
  and ``LOOMRL_SCHEDULER_TOKEN`` hands a job the token itself (another user, another host).
- A **job secret** (``secrets.token_urlsafe(32)``) is returned once, at registration, and
  must come with every call of that job; the daemon keeps only its SHA-256. Without it no
  one, token holders included, can heartbeat, acquire, release or unregister that job.

Why a file and not a unix socket with peer credentials: the dashboard and ``/metrics``
are read by browsers and Prometheus over TCP, jobs on other hosts reach the daemon over
TCP, and peer credentials would tell a job's process from sandboxed code of the same uid
no better than file permissions do. ``docs/security.md`` has the whole trust model.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path
from urllib.parse import urlsplit

TOKEN_ENV = "LOOMRL_SCHEDULER_TOKEN"
TOKEN_FILE_ENV = "LOOMRL_SCHEDULER_TOKEN_FILE"
MAX_TOKEN_BYTES = 256


def default_token_file(port: int) -> Path:
    """Where the daemon on ``port`` writes its token and where a job looks for it."""
    if os.environ.get(TOKEN_FILE_ENV):
        return Path(os.environ[TOKEN_FILE_ENV])
    return Path.home() / ".cache" / "loomrl" / "scheduler" / f"port-{port}.token"


def _private_folder(folder: Path) -> None:
    """Make ``folder`` (0700) or check that the one there is this user's alone to write.
    The mode of a folder loomrl did not create is never changed: a shared one (``/tmp``,
    ``/dev/shm``: sticky and world-writable) is refused, not made private."""
    try:
        folder.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    info = folder.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(f"token folder {folder} is not a folder")
    if info.st_uid != os.getuid():
        raise PermissionError(
            f"token folder {folder} belongs to uid {info.st_uid}, not to this user ({os.getuid()})"
        )
    if info.st_mode & 0o022:
        raise PermissionError(
            f"token folder {folder} is writable by others (mode {stat.S_IMODE(info.st_mode):o}): "
            f"another user could replace or remove the daemon's token there; give --token-file "
            f"(or {TOKEN_FILE_ENV}) a path in a folder of your own, e.g. "
            f"~/.cache/loomrl/scheduler/, which loomrl creates with mode 700"
        )


def write_token_file(path: Path) -> str:
    """A fresh token in ``path`` (mode 0600, written whole, never through a link)."""
    path = Path(path)
    _private_folder(path.parent)
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.replace(tmp, path)
    return token


def remove_token_file(path: Path, token: str) -> None:
    """Remove ``path`` if it still holds ``token`` (not a newer daemon's)."""
    try:
        if Path(path).read_text().strip() == token:
            Path(path).unlink()
    except OSError:
        pass


def read_token(url: str) -> str | None:
    """The token a job registers with at ``url``: ``LOOMRL_SCHEDULER_TOKEN``, else the
    token file for the URL's port (None when there is none to read)."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV].strip()
    port = urlsplit(url).port or 80
    path = default_token_file(port)
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_TOKEN_BYTES:
            return None
        return path.read_text().strip() or None
    except OSError:
        return None


def new_secret() -> tuple[str, str]:
    """A job secret and the SHA-256 the daemon keeps of it."""
    secret = secrets.token_urlsafe(32)
    return secret, digest(secret)


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def same(given: str | None, expected: str) -> bool:
    """Constant-time comparison of two strings (a token, or a secret's digest)."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())
