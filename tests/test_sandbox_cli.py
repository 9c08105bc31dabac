"""``loomrl sandbox exec`` shows untrusted output without letting it drive the terminal."""

from __future__ import annotations

import argparse

from loomrl.safe_text import escape_controls
from loomrl.sandbox.cli import cmd_sandbox_exec


def test_escape_controls_keeps_text_and_escapes_terminal_controls():
    assert escape_controls("ok\tfine\n") == "ok\tfine\n"
    assert escape_controls("é ü 中") == "é ü 中"
    assert escape_controls("\x1b]0;x\x07\r\x9b\u202e\U000e0041") == (
        "\\x1b]0;x\\x07\\x0d\\x9b\\u202e\\U000e0041"
    )


def test_sandbox_exec_prints_escape_sequences_escaped(tmp_path, capsys):
    script = tmp_path / "evil.py"
    script.write_text(
        "import sys\nprint('\\x1b]0;pwned\\x07\\x1b[2J\\rhidden\\u202e')\n"
        "print('\\x1b[31mred', file=sys.stderr)\n"
    )
    args = argparse.Namespace(
        file=script,
        backend="auto",
        timeout_s=5.0,
        stdin="",
        memory_mb=256,
        max_output_bytes=1 << 20,
    )
    assert cmd_sandbox_exec(args) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out and "\u202e" not in out
    assert "\\x1b]0;pwned\\x07\\x1b[2J\\x0dhidden\\u202e" in out and "\\x1b[31mred" in out
