"""Isolation backends: how a sandbox's fork server is launched.

- ``bwrap``: bubblewrap with every namespace but the user namespace unshared (mount, pid,
  net, ipc, uts, cgroup), read-only system dirs, a private tmpfs ``/tmp`` work root, a
  seccomp deny-list, and a server that keeps only the capabilities it needs to drop its
  children to the sandbox's dedicated uid and clean up after them. The user namespace is
  left alone on purpose: the code then runs as a real, unprivileged host uid (stronger
  than "root in a user namespace") and cannot signal or ptrace its root-owned server.
- ``process``: the same server as a plain process in its own session; children get the
  rlimits and the dedicated uid but share the host's filesystem view and network.
  Weaker: a warning is logged when it is chosen.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from loomrl.sandbox import seccomp

logger = logging.getLogger(__name__)

FORKSERVER_PATH = str(Path(__file__).with_name("forkserver.py"))
CLEANUP_PATH = str(Path(__file__).with_name("forkserver_cleanup.py"))
IO_PATH = str(Path(__file__).with_name("forkserver_io.py"))
CHILD_PATH = str(Path(__file__).with_name("forkserver_child.py"))
SANDBOX_SERVER_PATH = "/opt/loomrl/forkserver.py"
SANDBOX_CLEANUP_PATH = "/opt/loomrl/forkserver_cleanup.py"
SANDBOX_IO_PATH = "/opt/loomrl/forkserver_io.py"
SANDBOX_CHILD_PATH = "/opt/loomrl/forkserver_child.py"
CHILD_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
}
SERVER_CAPS = [
    "CAP_SETUID",
    "CAP_SETGID",
    "CAP_KILL",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_CHOWN",
]


@dataclass
class LaunchSpec:
    """How to start one fork server: argv, fds to pass, and its first config frame."""

    argv: list[str]
    server_config: dict
    pass_fds: list[int] = field(default_factory=list)
    work_dir_on_host: str | None = None  # removed by the host when the sandbox closes


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


_warned_weak = False


def resolve_backend(name: str) -> str:
    """``auto`` -> ``bwrap`` where installed, else ``process``; checks explicit choices."""
    global _warned_weak
    if name == "auto":
        name = "bwrap" if bwrap_path() else "process"
    if name == "bwrap" and not bwrap_path():
        raise ValueError("sandbox.backend = 'bwrap' but bubblewrap (bwrap) is not installed")
    if name not in ("bwrap", "process"):
        raise ValueError(f"unknown sandbox backend {name!r}; expected auto, bwrap or process")
    if name == "process" and not _warned_weak:
        _warned_weak = True
        logger.warning(
            "sandbox backend 'process' is weaker than 'bwrap': no namespaces (the code sees "
            "the host filesystem and network), only rlimits and an unprivileged uid"
        )
    if os.geteuid() != 0 and not _warned_weak:
        _warned_weak = True
        logger.warning("not root: sandboxed code runs under this uid (no dedicated uid)")
    return name


def _system_binds() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / name
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), f"/{name}"]
        elif host.is_dir():
            args += ["--ro-bind", str(host), f"/{name}"]
    for path in ("/etc/ld.so.cache", "/etc/alternatives", "/etc/localtime"):
        args += ["--ro-bind-try", path, path]
    return args


def sandbox_python() -> str:
    """The interpreter used inside bwrap: the system python if present, else ours."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    return os.path.realpath(sys.executable)


DEV_NODES = ("null", "zero", "full", "random", "urandom")
DEV_TMPFS_BYTES = 1 << 20


def _dev_args() -> list[str]:
    """A minimal, sized, read-only ``/dev`` (``--dev`` would be unsized: half of RAM)."""
    args = ["--size", str(DEV_TMPFS_BYTES), "--tmpfs", "/dev"]
    for node in DEV_NODES:
        args += ["--dev-bind", f"/dev/{node}", f"/dev/{node}"]
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        args += ["--symlink", target, f"/dev/{name}"]
    return [*args, "--remount-ro", "/dev"]


def bwrap_launch(
    server_config: dict, python: str | None = None, tmpfs_bytes: int = 256 << 20
) -> LaunchSpec:
    python = python or sandbox_python()
    args = [bwrap_path() or "bwrap"]
    args += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
    args += ["--unshare-cgroup-try", "--die-with-parent", "--new-session"]
    args += _system_binds()
    prefix = os.path.realpath(sys.base_prefix) if not python.startswith("/usr/") else None
    if prefix:
        args += ["--ro-bind", prefix, prefix]
    args += ["--proc", "/proc", *_dev_args(), "--size", str(tmpfs_bytes), "--tmpfs", "/tmp"]
    args += ["--dir", "/opt/loomrl"]
    args += ["--ro-bind", FORKSERVER_PATH, SANDBOX_SERVER_PATH]
    args += ["--ro-bind", CLEANUP_PATH, SANDBOX_CLEANUP_PATH, "--ro-bind", IO_PATH, SANDBOX_IO_PATH]
    args += ["--ro-bind", CHILD_PATH, SANDBOX_CHILD_PATH]
    args += ["--hostname", "sandbox"]
    args += ["--clearenv", "--chdir", "/tmp", "--cap-drop", "ALL"]
    for cap in SERVER_CAPS:
        args += ["--cap-add", cap]
    pass_fds: list[int] = []
    program = seccomp.build_filter()
    if program is None:
        logger.warning("seccomp filter not available on %s: skipped", os.uname().machine)
    else:
        read_fd, write_fd = os.pipe()
        os.write(write_fd, program)
        os.close(write_fd)
        args += ["--seccomp", str(read_fd)]
        pass_fds.append(read_fd)
    for key, value in CHILD_ENV.items():
        args += ["--setenv", key, value]
    args += [python, "-I", SANDBOX_SERVER_PATH]
    config = dict(server_config, work_root="/tmp/w", pid_namespace=True, scratch_dirs=[])
    return LaunchSpec(argv=args, server_config=config, pass_fds=pass_fds)


def process_launch(server_config: dict, work_dir: str) -> LaunchSpec:
    argv = [sandbox_python(), "-I", FORKSERVER_PATH]
    scratch = [d for d in ("/tmp", "/var/tmp", "/dev/shm") if os.path.isdir(d)]
    config = dict(server_config, work_root=work_dir, pid_namespace=False, scratch_dirs=scratch)
    return LaunchSpec(argv=argv, server_config=config, work_dir_on_host=work_dir)
