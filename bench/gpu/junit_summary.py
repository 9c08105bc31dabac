"""Summarise a pytest run for bench/gpu_check.sh: one RESULT line (from junit.xml, or the
log's last line where pytest wrote no junit.xml) and one FAIL line per failed or erroring
test with the first lines of its error.

    python3 bench/gpu/junit_summary.py JUNIT_XML PYTEST_LOG
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def summarise(junit: Path, log: Path) -> list[str]:
    if not junit.is_file():
        text = log.read_text(errors="replace") if log.is_file() else ""
        lines = text.strip().splitlines()
        out = ["RESULT no junit.xml; last line: " + (lines[-1][:200] if lines else "no output")]
        out += ["FAIL " + line[:600] for line in lines if line.startswith(("FAILED ", "ERROR "))]
        return out
    root = ET.parse(junit).getroot()
    counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    for suite in [root] if root.tag == "testsuite" else root.findall("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    out = [
        f"RESULT {passed} passed, {counts['failures']} failed, {counts['errors']} errors, "
        f"{counts['skipped']} skipped (junit)"
    ]
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            element = case.find(kind)
            if element is None:
                continue
            text = (
                ((element.get("message") or "") + "\n" + (element.text or "")).strip().splitlines()
            )
            keep = [t.strip() for t in text if t.strip()][:1]
            keep += [t[1:].strip() for t in text if t.startswith("E ") and t[1:].strip()][:4]
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            out.append(f"FAIL {kind.upper()} {name}: " + " / ".join(keep)[:600])
    return out


if __name__ == "__main__":
    print("\n".join(summarise(Path(sys.argv[1]), Path(sys.argv[2]))))
