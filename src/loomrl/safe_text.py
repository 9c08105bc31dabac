"""Text from outside (model output, rewards, datasets, handed run folders) made safe to print.

Such text is untrusted: raw, an ``ESC[2J`` clears the screen, OSC 52 writes the clipboard,
OSC 8 hides a link, a title sequence retitles the terminal, a bidi override reorders what
the reader sees. Every sink that prints it (the CLI's log handler and error lines,
``loomrl status``, ``loomrl sandbox exec``, the report) passes it through
``escape_controls``. No torch, no rich: the CLI imports this before anything heavy.
"""

from __future__ import annotations

import logging
import unicodedata

# Unicode categories that move the cursor, drive the terminal or reorder text: controls
# (C0, DEL, C1: ESC and CSI among them), format characters (bidi overrides U+202A-202E and
# isolates U+2066-2069, zero-width ones), lone surrogates and the line/paragraph separators.
UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def escape_controls(text: str) -> str:
    """``text`` with control characters shown as escapes (``\\x1b``, ``\\u202e``).

    Newlines and tabs are kept; everything else in ``UNSAFE_CATEGORIES`` is written as a
    Python-style escape, so the reader sees that it was there without it acting.
    """
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch in "\n\t" or unicodedata.category(ch) not in UNSAFE_CATEGORIES:
            out.append(ch)
        elif ord(ch) < 0x100:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return "".join(out)


class SafeFormatter(logging.Formatter):
    """A log formatter whose output (message, its args, the exception's text) is escaped.

    Log records carry reward errors with the completion in them, judge replies, dataset
    rows and executor output; this formatter is what every console handler loomrl installs
    uses, so none of it reaches the terminal raw.
    """

    def format(self, record: logging.LogRecord) -> str:
        return escape_controls(super().format(record))


__all__ = ["SafeFormatter", "escape_controls"]
