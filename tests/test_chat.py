"""Chat data (issue 38, item 1): message-list prompts through the tokenizer's chat template
with exactly one BOS, a system prompt, clear errors for malformed messages, every EOS id of
the generation config, and stop strings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loomrl.chat import PromptEncoder
from loomrl.config import DataConfig, GenerationConfig
from loomrl.data import DatasetError, load_rows_with_places
from loomrl.job import Job
from loomrl.models.tiny import build_char_tokenizer, build_tiny_model

# A template that writes its own BOS, as Llama's and many instruct models' do.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
SEEN: list[tuple] = []  # (prompt, completion) pairs the reward got


def record_reward(prompt, completion: str, answer: str, **row) -> float:
    SEEN.append((prompt, completion))
    return float(completion.strip() == answer)


def _chat_tokenizer():
    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture
def chat_model(tmp_path: Path) -> Path:
    """A tiny instruct-style model folder: a chat template, and two EOS ids in its generation config."""
    model, _ = build_tiny_model(
        "llama", hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
    )
    tok = _chat_tokenizer()
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids("#")]
    folder = tmp_path / "instruct"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _chat_rows(path: Path, n: int = 64) -> Path:
    rows = [
        {"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)} for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_templated_prompts_have_exactly_one_bos_and_plain_ones_keep_theirs():
    tok = _chat_tokenizer()
    encoder = PromptEncoder(tok, DataConfig(train="x.jsonl"))
    plain, chat = encoder.encode(["1+1=", [{"role": "user", "content": "1+1="}]])
    assert plain == tok("1+1=").input_ids and plain.count(tok.bos_token_id) == 1
    assert chat.count(tok.bos_token_id) == 1 and chat[0] == tok.bos_token_id
    assert tok.decode(chat) == "<bos>user: 1+1=\nassistant: "
    # What applying the template and then tokenizing by default does: two BOS.
    assert (
        tok(encoder.render([{"role": "user", "content": "1+1="}])).input_ids[:2]
        == [tok.bos_token_id] * 2
    )
    with_system = PromptEncoder(
        tok, DataConfig(train="x.jsonl", system_prompt="Answer with digits.")
    )
    assert with_system.render("2+2=") == "<bos>system: Answer with digits.\nuser: 2+2=\nassistant: "
    own = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    # a row's own system message is kept, alone
    assert with_system.render(own).count("system:") == 1
    with pytest.raises(DatasetError, match="has no chat template"):
        PromptEncoder(build_char_tokenizer(), DataConfig(train="x.jsonl")).encode([own])
    with pytest.raises(DatasetError, match="chat_template=false"):
        PromptEncoder(tok, DataConfig(train="x.jsonl", chat_template=False)).encode([own])
    with pytest.raises(ValueError, match="system_prompt"):
        DataConfig(train="x.jsonl", chat_template=False, system_prompt="hi")


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "is an empty list of messages"),
        (["hi"], "message 0 is a str"),
        ([{"role": "user"}], "message 0 has 'content' missing"),
        (
            [{"role": "user", "content": "a"}, {"role": 3, "content": "b"}],
            "message 1 has 'role' an int",
        ),
    ],
)
def test_a_malformed_message_list_names_file_line_and_message(tmp_path: Path, prompt, message):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"prompt": prompt}) + "\n")
    with pytest.raises(DatasetError, match=rf"{path}:2: 'prompt'.*{message}"):
        load_rows_with_places(path)


def test_a_conversational_dataset_trains_through_the_template_with_one_bos(
    tmp_path, chat_model, monkeypatch
):
    from loomrl.generation import hf

    sampled: list[list[int]] = []
    original = hf.HFGenerator._sample

    def spy(self, prompts, seeds, sampling):
        sampled.extend(prompts)
        # both EOS ids stop
        assert self.eos_ids == {2, build_char_tokenizer().convert_tokens_to_ids("#")}
        return original(self, prompts, seeds, sampling)

    monkeypatch.setattr(hf.HFGenerator, "_sample", spy)
    SEEN.clear()
    rows = str(_chat_rows(tmp_path / "chat.jsonl"))
    job = Job(
        model=str(chat_model),
        dataset=rows,
        eval_dataset=rows,
        reward="test_chat:record_reward",
        group_size=2,
        groups_per_step=2,
        num_steps=2,
        output_dir=str(tmp_path / "run"),
        overrides=["generation.max_new_tokens=3", "data.max_eval_examples=4", "eval.every_steps=2"],
    )
    result = job.run()
    # evaluation encodes them the same way
    assert result.summary["steps"] == 2 and len(result.eval_history) >= 1
    tok = _chat_tokenizer()
    assert sampled and all(
        ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id for ids in sampled
    )
    assert tok.decode(sampled[0]).endswith("\nassistant: ")
    prompt, completion = SEEN[0]
    # the prompt as the dataset holds it
    assert isinstance(prompt, list) and prompt[0]["role"] == "user"
    assert isinstance(completion, str)


def test_a_stop_string_cuts_the_completion_and_its_tokens():
    from loomrl.generation.base import cut_at_stop

    tok = build_char_tokenizer()
    ids = [
        tok("12\n34", add_special_tokens=False).input_ids,
        tok("567", add_special_tokens=False).input_ids,
    ]
    logprobs = [[-0.1] * len(ids[0]), [-0.2] * 3]
    finish, texts = ["length", "length"], tok.batch_decode(ids, skip_special_tokens=True)
    cut_at_stop(tok, ["\n", "9"], ids, logprobs, finish, texts)
    assert texts == ["12", "567"] and finish == ["stop", "length"]
    # tokens up to the stop string's, trained on
    assert tok.decode(ids[0]) == "12\n" and len(logprobs[0]) == 3
    assert ids[1] == tok("567", add_special_tokens=False).input_ids
    with pytest.raises(ValueError, match="empty string"):
        GenerationConfig(stop=[""])


@pytest.mark.parametrize("static_cache", [False, True])
def test_generation_stops_on_a_stop_string(static_cache):
    """An engine with ``generation.stop``, on either decode path: no completion holds the
    stop string, those that held it end with finish reason 'stop', and their tokens end
    with it (the sequence stopped there)."""
    from loomrl.generation.hf import HFGenerator
    from loomrl.types import GenerationRequest, SamplingParams

    model, tok = build_tiny_model(
        "llama", hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
    )
    engine = HFGenerator(model, tok, stop=["1"], static_cache=static_cache)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=40)
    request = GenerationRequest(
        prompt_ids=tok("1+1=").input_ids, num_samples=16, sampling=sampling, seed=3
    )
    with torch.no_grad():
        (result,) = engine.generate([request], apply_newest=False)
    ids, finish, texts = result.token_ids, result.finish_reasons, result.texts
    assert all("1" not in t for t in texts)
    stopped = [i for i, f in enumerate(finish) if f == "stop" and tok.eos_token_id not in ids[i]]
    assert stopped  # 40 random characters over ~100: some held a '1'
    # tokens end with the stop string's
    assert all(tok.decode(ids[i]).endswith("1") for i in stopped)


def test_sequences_stop_sampling_at_a_stop_string(monkeypatch):
    """A stop string ends the sampling loop for its sequence, not only the text: with stop
    strings most characters hold, every sequence stops long before max_new_tokens."""
    from loomrl.generation.hf import HFGenerator
    from loomrl.types import GenerationRequest, SamplingParams

    model, tok = build_tiny_model(
        "llama", hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
    )
    engine = HFGenerator(
        model, tok, stop=list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    )
    steps = []
    pick = HFGenerator._pick
    monkeypatch.setattr(HFGenerator, "_pick", staticmethod(lambda *a: steps.append(1) or pick(*a)))
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=64)
    (result,) = engine.generate([GenerationRequest(tok("1+1=").input_ids, 8, sampling, seed=1)])
    assert len(steps) < 64 and all(f == "stop" for f in result.finish_reasons)
