"""``loomrl sandbox exec FILE``: run a file in a sandbox by hand and show how it ended.

A ``.py`` file runs as a Python snippet (in the fork server, like rewards do); any other
file is copied into the work dir and run with ``/bin/sh``. No torch import here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loomrl.safe_text import escape_controls


def add_sandbox_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sandbox exec`` to the ``loomrl`` command's subparsers."""
    sandbox = subparsers.add_parser("sandbox", help="try the sandbox by hand")
    commands = sandbox.add_subparsers(dest="sandbox_command", required=True)
    run = commands.add_parser("exec", help="run FILE in a sandbox (.py as Python, else sh)")
    run.add_argument("file", type=Path, help="the file to run")
    run.add_argument("--backend", choices=["auto", "bwrap", "process"], default="auto")
    run.add_argument("--timeout-s", type=float, default=5.0, help="wall-clock limit")
    run.add_argument("--stdin", default="", help="text for stdin, or @PATH to read a file")
    run.add_argument("--memory-mb", type=int, default=512, help="address-space limit")
    run.add_argument("--max-output-bytes", type=int, default=1 << 20, help="output cap")
    run.set_defaults(fn=cmd_sandbox_exec)


def cmd_sandbox_exec(args: argparse.Namespace) -> int:
    from loomrl.sandbox import ForkServerSandbox, SandboxError, SandboxLimits

    if not args.file.is_file():
        print(f"error: no such file: {args.file}", file=sys.stderr)
        return 2
    stdin = Path(args.stdin[1:]).read_bytes() if args.stdin.startswith("@") else args.stdin.encode()
    limits = SandboxLimits(
        timeout_s=args.timeout_s, memory_mb=args.memory_mb, max_output_bytes=args.max_output_bytes
    )
    try:
        with ForkServerSandbox(args.backend, limits) as sandbox:
            if args.file.suffix == ".py":
                result = sandbox.exec(args.file.read_text(), stdin=stdin)
            else:
                name = args.file.name
                result = sandbox.exec(
                    command=["/bin/sh", name], files={name: args.file.read_bytes()}, stdin=stdin
                )
            backend, ready_ms = sandbox.backend, sandbox.ready_s * 1e3
    except (SandboxError, ValueError) as err:
        print(f"sandbox error: {err}", file=sys.stderr)
        return 3
    stdout, stderr = escape_controls(result.stdout), escape_controls(result.stderr)
    print("--- stdout" + (" (truncated)" if result.truncated else ""))
    print(stdout, end="" if stdout.endswith("\n") or not stdout else "\n")
    print("--- stderr")
    print(stderr, end="" if stderr.endswith("\n") or not stderr else "\n")
    print("---")
    timings = " ".join(f"{k}={v:.1f}" for k, v in result.timings_ms.items())
    print(f"backend={backend} ready_ms={ready_ms:.1f} {timings}")
    print(
        f"exit={result.exit_code} signal={result.signal} reason={result.reason} "
        f"leftover_killed={result.leftover_killed}"
    )
    return 0 if result.ok else 1
