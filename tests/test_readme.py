"""The README's smallest job runs as printed and learns something."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_the_smallest_job_learns_and_prints_a_number(tmp_path):
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## The smallest job", 1)[1]
    code = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    code = code.replace("job.run()", "job.run(overwrite=True)").replace(
        "num_steps=60)", f"num_steps=60, output_dir={str(tmp_path / 'run')!r})"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    start, end = map(
        float, re.search(r"held-out reward ([\d.]+) -> ([\d.]+)", done.stdout).groups()
    )
    assert end >= start + 0.2 and end >= 0.6, done.stdout
