"""Tools over one episode's ``Workspace``: plain typed, docstringed functions.

``workspace_tools(ws)`` returns ``python``, ``shell``, ``read_file`` and ``write_file``,
each a plain function whose schema ``transformers.utils.get_json_schema`` builds from its
type hints and docstring, so a chat environment can offer them as they are. What the code
printed comes back as text the model reads, with how it ended when it did not exit with
status 0 (a timeout, an exit code, a lost sandbox). A refused path raises ``ValueError``
and a missing file ``FileNotFoundError``: the episode turns a raising tool into a tool
message. Each call blocks for as long as its exec (its timeout at most): an async caller
runs it in a thread.
"""

from __future__ import annotations

from collections.abc import Callable

from loomrl.sandbox.base import ExecResult
from loomrl.sandbox.workspace import Workspace


def describe_result(result: ExecResult) -> str:
    """The text a model reads for one exec: its output, then how it ended unless cleanly."""
    text = result.stdout
    if result.stderr:
        text += ("" if not text or text.endswith("\n") else "\n") + result.stderr
    if result.truncated:
        text += "\n[output cut at the sandbox's output cap]"
    if result.reason == "exit" and result.exit_code != 0:
        text += f"\n[exit code {result.exit_code}]"
    elif result.reason != "exit":
        text += f"\n[killed: {result.reason}]"
    return text.strip("\n") if text.strip() else "[no output]"


def workspace_tools(ws: Workspace | Callable[[], Workspace]) -> list[Callable[..., str]]:
    """``python``, ``shell``, ``read_file`` and ``write_file`` acting on ``ws``, or on
    whatever workspace ``ws()`` returns at each call (an environment builds its tools once
    and opens each episode's workspace in ``reset``)."""
    current: Callable[[], Workspace] = ws if callable(ws) else (lambda: ws)

    def python(code: str) -> str:
        """Run a Python program in the workspace and return what it printed.

        Files it writes stay in the workspace for later calls; variables do not.

        Args:
            code: The Python source to run; its working directory is the workspace.
        """
        return describe_result(current().run_python(code))

    def shell(command: str) -> str:
        """Run a shell command line (/bin/sh) in the workspace and return its output.

        Args:
            command: The command line to run; its working directory is the workspace.
        """
        return describe_result(current().run_shell(command))

    def read_file(path: str) -> str:
        """Return the text of a file in the workspace.

        Args:
            path: The file's path, relative to the workspace.
        """
        return current().read_file(path)

    def write_file(path: str, content: str) -> str:
        """Create or overwrite a file in the workspace (parent directories are created).

        Args:
            path: The file's path, relative to the workspace.
            content: The text to write.
        """
        return f"wrote {current().write_file(path, content)} bytes to {path}"

    return [python, shell, read_file, write_file]
