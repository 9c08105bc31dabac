"""A refactor keeps a fixed-seed synchronous run bit-identical: per-step losses, grad
norms, learning rates and rewards against ``tests/data/golden_sync.json``, which was
written at commit 7a184df (before the structural changes of issue 8) by
``tests/golden_sync.py``."""

from __future__ import annotations

import json

import pytest
from golden_sync import CASES, GOLDEN, run_case


@pytest.mark.parametrize("case", sorted(CASES))
def test_sync_run_is_bit_identical_to_the_golden_record(case, tmp_path):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got = run_case(case, tmp_path)
    finally:
        torch.set_num_threads(threads)
    want = json.loads(GOLDEN.read_text())[case]
    assert len(got["steps"]) == len(want["steps"]) > 0
    for step_got, step_want in zip(got["steps"], want["steps"]):
        assert step_got == step_want  # exact: not approximately equal
    assert got["evals"] == want["evals"]
