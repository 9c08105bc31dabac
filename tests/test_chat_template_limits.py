"""A chat template from a handed model folder: one that loops for ever is stopped within its
time budget, and one jinja's sandbox refuses is a clear error; both name the template."""

from __future__ import annotations

import time

import pytest

from loomrl.chat import PromptEncoder
from loomrl.config import DataConfig
from loomrl.data import DatasetError
from loomrl.models.tiny import build_char_tokenizer

# Each range is under jinja's cap; their product renders for hours.
NESTED = (
    "{% for i in range(90000) %}{% for j in range(90000) %}{% for k in range(90000) %}"
    "{% endfor %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}"
)
UNSAFE = "{{ messages.append({'role': 'x'}) }}{{ messages[0]['content'] }}"


def _encoder(tmp_path, template: str) -> PromptEncoder:
    folder = tmp_path / "handed-model"
    folder.mkdir()
    tok = build_char_tokenizer()
    tok.chat_template = template
    tok.save_pretrained(folder)
    return PromptEncoder(tok, DataConfig(train="x.jsonl"), str(folder))


def test_a_template_with_nested_loops_is_stopped_within_its_budget(tmp_path):
    encoder = _encoder(tmp_path, NESTED)
    encoder.template_budget_s = 0.5
    start = time.monotonic()
    with pytest.raises(DatasetError, match=r"chat template of .*handed-model.* more than 0.5 s"):
        encoder.encode([[{"role": "user", "content": "hi"}]])
    assert time.monotonic() - start < 5


def test_a_template_the_sandbox_refuses_names_the_template(tmp_path):
    encoder = _encoder(tmp_path, UNSAFE)
    with pytest.raises(DatasetError, match=r"chat template of .*handed-model.*SecurityError"):
        encoder.encode([[{"role": "user", "content": "hi"}]])


def test_a_normal_template_renders_and_leaves_no_tracer(tmp_path):
    import sys

    encoder = _encoder(tmp_path, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert encoder.render([{"role": "user", "content": "hi"}]) == "hi"
    assert sys.gettrace() is None
