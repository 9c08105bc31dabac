"""Bounds on the right quantity, refused before memory grows: a ``tiny:`` spec too large to
build, and message-list prompts counted by every string they hold and by their number."""

from __future__ import annotations

import resource

import pytest

from loomrl.data import DatasetError
from loomrl.models.loading import (
    TINY_MAX_PARAMS,
    ModelLoadError,
    load_model_and_tokenizer,
    parse_tiny_spec,
    tiny_num_params,
)
from loomrl.prompt_fit import check_prompts


def test_the_tiny_estimate_is_the_models_own_count():
    for spec in ("tiny:llama", "tiny:qwen2?hidden_size=64&num_layers=2&intermediate_size=96"):
        model, _ = load_model_and_tokenizer(spec)
        built = sum(p.numel() for p in model.parameters())
        estimate = tiny_num_params(parse_tiny_spec(spec)[1])
        # (the estimate rounds the ~104-token vocabulary up and counts q/k/v biases)
        assert built <= estimate <= built * 1.05, spec


def test_a_tiny_spec_of_17_g_parameters_is_refused_before_building():
    spec = "tiny:llama?hidden_size=16384&num_layers=9&intermediate_size=16384"
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ModelLoadError, match=r"about 16.9 G parameters .* over the limit of 1 G"):
        load_model_and_tokenizer(spec)
    # refused from the spec alone: the peak RSS did not move by a model's worth (KiB)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200_000
    assert tiny_num_params(parse_tiny_spec("tiny:llama")[1]) < TINY_MAX_PARAMS
    with pytest.raises(ModelLoadError, match=r"num_layers must be at least 1, got 0"):
        parse_tiny_spec("tiny:llama?num_layers=0")


def _never_encode(prompt):
    raise AssertionError("encoded a prompt that should have been refused before")


@pytest.mark.parametrize(
    "messages, what",
    [
        ([{"role": "x" * 2_000_000, "content": ""}], r"hold \d+ bytes"),
        ([{"role": "user", "content": ""}] * 100_000, r"100000 messages"),
        ([{"role": "user", "content": "", "name": "n" * 2_000_000}], r"hold \d+ bytes"),
    ],
)
def test_message_prompts_are_counted_whole_before_rendering(messages, what):
    rows = [{"prompt": messages}]
    with pytest.raises(DatasetError, match=rf"train.jsonl:1: .*{what}.*max_prompt_bytes"):
        check_prompts(rows, ["train.jsonl:1"], _never_encode, "prompt", 100, False, 1 << 20)


class _RunsCode:
    def __reduce__(self):
        return (print, ("this ran at load time",))


def test_a_pickled_weights_file_is_refused_naming_the_file_and_folder(tmp_path):
    import torch

    from loomrl.models.tiny import build_tiny_model

    model, tok = build_tiny_model("llama", hidden_size=32, num_layers=1, num_heads=2)
    folder = tmp_path / "handed-model"
    model.config.save_pretrained(folder)
    tok.save_pretrained(folder)
    state = dict(model.state_dict(), extra=_RunsCode())
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"handed-model: pytorch_model.bin holds more than"):
        load_model_and_tokenizer(str(folder))
