"""Chat episodes with tools, driven with a scripted generator: the trained ids are exactly the
sampled ids with the template's observation ids between them; a template that rewrites
earlier turns is named (or trained turn by turn); every kind of tool failure becomes a tool
message the model reads and is counted; limits end episodes with their reason."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from loomrl.envs.chat import AssistantMessage, ChatEnvironment, ChatStepResult
from loomrl.envs.chat_episode import ChatLimits, run_chat_episodes
from loomrl.envs.chat_render import TemplateDriftError
from loomrl.envs.episode import turn_seed
from loomrl.envs.episode_stats import EpisodeStats
from loomrl.envs.tool_parsers import get_parser
from loomrl.models import build_char_tokenizer
from loomrl.types import GenerationResult, SamplingParams

ASSISTANT = (
    "A:{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}"
    "</tool_call>{% endfor %}{{ eos_token }}\n"
)
# Keeps history: every message renders the same whatever follows it.
KEEPS = (
    "{{ bos_token }}{% if tools %}T:{% for t in tools %}{{ t.function.name }};{% endfor %}\n"
    "{% endif %}{% for m in messages %}{% if m.role == 'user' %}U:{{ m.content }}\n"
    "{% elif m.role == 'assistant' %}"
    + ASSISTANT
    + "{% elif m.role == 'tool' %}R:{{ m.content }}\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
)
# Rewrites history: an assistant turn followed by anything loses its tool calls (as
# templates that drop earlier turns' reasoning do).
REWRITES = KEEPS.replace(
    "{% elif m.role == 'assistant' %}" + ASSISTANT,
    "{% elif m.role == 'assistant' %}{% if loop.last %}" + ASSISTANT + "{% else %}"
    "A:{{ m.content }}{{ eos_token }}\n{% endif %}",
)
EOS = "<eos>"


def tokenizer(template: str = KEEPS):
    tok = build_char_tokenizer()
    tok.chat_template = template
    return tok


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def explode(x: int) -> int:
    """Always fails.

    Args:
        x: anything
    """
    raise ValueError("boom")


HANG = threading.Event()


def hang(x: int) -> int:
    """Never answers (until the test ends).

    Args:
        x: anything
    """
    HANG.wait(60)
    return x


class Calculator(ChatEnvironment):
    def __init__(self) -> None:
        self.tools = [multiply, explode, hang]
        self.closed = False

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def reward(self, messages, row):
        last = messages[-1]
        return float(last["role"] == "assistant" and last["content"].strip() == row["answer"])

    def close(self) -> None:
        self.closed = True


def call(name: str, **arguments) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class Scripted:
    """Samples each episode's scripted turns (text, then EOS), in order; log-prob of token k
    is -(k+1)/100; the version rises with each call."""

    def __init__(self, tok, scripts: list[list[str]], seed: int = 3) -> None:
        self.tok, self.scripts, self.seed, self.version = tok, scripts, seed, 5
        self.sampled: list[list[list[int]]] = [[] for _ in scripts]
        self.prompts: list[list[list[int]]] = [[] for _ in scripts]
        self.turn = 0

    async def __call__(self, requests):
        results = []
        for req in requests:
            (i,) = [
                i
                for i in range(len(self.scripts))
                if turn_seed(self.seed, self.turn, i) == req.seed
            ]
            text = self.scripts[i][self.turn]
            ids = self.tok(text, add_special_tokens=False).input_ids
            ids = ids[: req.sampling.max_new_tokens]
            finish = "length"
            if len(ids) < req.sampling.max_new_tokens:
                ids, finish = ids + [self.tok.eos_token_id], "stop"
            self.sampled[i].append(ids)
            self.prompts[i].append(list(req.prompt_ids))
            logprobs = [-(k + 1) / 100 for k in range(len(ids))]
            results.append(GenerationResult([ids], [logprobs], [finish], None, self.version))
        self.turn += 1
        self.version += 1
        return results


def run(envs, scripts, tok=None, rows=None, **limits):
    tok = tok or tokenizer()
    gen = Scripted(tok, scripts)
    stats = EpisodeStats()
    options = {"parser": get_parser("hermes"), "max_turns": 4, **limits}
    rollouts = asyncio.run(
        run_chat_episodes(
            envs,
            rows or {"prompt": "12*34?", "answer": "408"},
            9,
            generate=gen,
            tokenizer=tok,
            sampling=SamplingParams(max_new_tokens=200),
            limits=ChatLimits(**options),
            seed=3,
            stats=stats,
        )
    )
    return rollouts, gen, stats


THREE_TURNS = [call("multiply", a=12, b=34), call("multiply", a=408, b=1), "408"]


def test_trained_ids_are_the_sampled_ids_with_the_templates_observations_between():
    tok = tokenizer()
    env = Calculator()
    (ep,), gen, stats = run([env], [THREE_TURNS], tok)
    assert ep.status == "ok" and ep.reward == 1.0 and ep.num_turns == 3
    # The model wrote exactly what the template writes for its turns, so prompt + completion
    # is the template's rendering of the whole conversation, token for token.
    whole = tok.apply_chat_template(env.messages, tools=ep_schemas(), tokenize=False)
    expected = tok(whole, add_special_tokens=False).input_ids
    assert (
        ep.prompt_ids + ep.completion_ids == expected[: len(ep.prompt_ids) + len(ep.completion_ids)]
    )
    assert len(expected) == len(ep.prompt_ids) + len(ep.completion_ids) + 1  # the last turn's "\n"
    # Trained = sampled, in order, with log-probs; everything else masked with log-prob 0.
    trained = [t for t, m in zip(ep.completion_ids, ep.loss_mask) if m]
    assert trained == sum(gen.sampled[0], [])
    assert [lp for lp, m in zip(ep.behaviour_logprobs, ep.loss_mask) if m] == [
        -(k + 1) / 100 for ids in gen.sampled[0] for k in range(len(ids))
    ]
    assert all(lp == 0.0 for lp, m in zip(ep.behaviour_logprobs, ep.loss_mask) if not m)
    observations = tok.decode([t for t, m in zip(ep.completion_ids, ep.loss_mask) if not m])
    assert observations == "\nR:408\nA:\nR:408\nA:"
    # Each turn was sampled after exactly the ids trained on before it.
    for prompt in gen.prompts[0]:
        assert prompt == ep.prompt_ids + ep.completion_ids[: len(prompt) - len(ep.prompt_ids)]
    assert ep.version == 5 and "[tool multiply] 408" in ep.completion
    # each sampled token keeps the version of its call (5, 6, 7), next to its log-prob
    assert [v for v, m in zip(ep.token_versions, ep.loss_mask) if m] == [
        5 + turn for turn, ids in enumerate(gen.sampled[0]) for _ in ids
    ]
    metrics = stats.metrics()
    assert metrics["episode/calls_multiply"] == 2 and metrics["episode/turns_mean"] == 3
    assert metrics["episode/valid_call_frac"] == 1.0 and metrics["episode/end_answered"] == 1


def ep_schemas():
    from loomrl.envs.chat import tool_schemas

    return tool_schemas([multiply, explode, hang])


def test_sampled_ids_are_kept_even_where_the_template_would_write_them_otherwise():
    tok = tokenizer()
    spaced = '<tool_call>{"name":"multiply","arguments":{"a":12,"b":34}}</tool_call>'
    (ep,), gen, _ = run([Calculator()], [[spaced, "408"]], tok)
    assert ep.reward == 1.0
    assert [t for t, m in zip(ep.completion_ids, ep.loss_mask) if m] == sum(gen.sampled[0], [])
    assert tok.decode(ep.completion_ids).startswith(spaced)


def test_a_template_that_rewrites_history_is_named_at_the_first_episode():
    with pytest.raises(TemplateDriftError, match="rewrites earlier turns.*per_turn_samples"):
        run([Calculator()], [THREE_TURNS], tokenizer(REWRITES))


def test_the_per_turn_fallback_trains_each_turn_on_the_templates_rendering():
    tok = tokenizer(REWRITES)
    env = Calculator()
    rollouts, gen, _ = run([env], [THREE_TURNS], tok, per_turn_samples=True)
    assert len(rollouts) == 3 and all(r.reward == 1.0 for r in rollouts)
    for turn, r in enumerate(rollouts):
        assert r.completion_ids == gen.sampled[0][turn] and r.loss_mask == [1] * len(
            r.completion_ids
        )
        assert r.prompt_ids == gen.prompts[0][turn]
        rendered = tok.apply_chat_template(
            env.messages[: 2 * turn + 1],
            tools=ep_schemas(),
            tokenize=False,
            add_generation_prompt=True,
        )
        assert r.prompt_ids == tok(rendered, add_special_tokens=False).input_ids
    assert [r.version for r in rollouts] == [5, 6, 7]
    assert all(r.token_versions is None for r in rollouts)  # one version within each turn


@pytest.mark.parametrize(
    ("text", "kind", "shown"),
    [
        (
            '<tool_call>{"name": "multiply", "arguments": {"a": 1,}}</tool_call>',
            "malformed",
            "malformed tool call",
        ),
        ('<tool_call>{"name": "multiply", "arguments": {"a": 1', "malformed", "unclosed"),
        (call("divide", a=1, b=2), "unknown_tool", "no tool 'divide'"),
        (call("multiply", a=1), "bad_arguments", "missing a required argument"),
        (call("multiply", a="1", b=2), "bad_arguments", "not of type integer"),
        (call("explode", x=1), "raised", "ValueError: boom"),
    ],
)
def test_each_kind_of_bad_call_becomes_a_tool_message_and_is_counted(text, kind, shown):
    env = Calculator()
    (ep,), _, stats = run([env], [[text, "408"]])
    assert ep.status == "ok" and ep.reward == 1.0 and ep.num_turns == 2
    (answer,) = [m for m in env.messages if m["role"] == "tool"]
    assert answer["content"].startswith("error: ") and shown in answer["content"]
    metrics = stats.metrics()
    assert metrics[f"episode/errors_{kind}"] == 1
    assert sum(v for k, v in metrics.items() if k.startswith("episode/errors_")) == 1
    assert metrics["episode/valid_call_frac"] == 0.0


def test_a_tool_that_hangs_is_cut_at_its_timeout_and_the_episode_goes_on():
    env = Calculator()
    t0 = time.monotonic()
    try:
        (ep,), _, stats = run([env], [[call("hang", x=1), "408"]], tool_timeout_s=0.5)
    finally:
        HANG.set()
    assert time.monotonic() - t0 < 10
    assert ep.reward == 1.0 and "ran past 0.5 s" in env.messages[2]["content"]
    assert stats.metrics()["episode/errors_timeout"] == 1


def test_episodes_stop_at_max_episode_tokens_with_the_reason():
    env = Calculator()
    rollouts, gen, stats = run([env, Calculator()], [THREE_TURNS, ["408"]], max_episode_tokens=120)
    long, short = rollouts
    assert short.reward == 1.0 and short.num_turns == 1
    assert len(long.prompt_ids) + len(long.completion_ids) <= 120 and long.reward == 0.0
    assert long.num_turns < 3
    metrics = stats.metrics()
    assert metrics["episode/end_max_episode_tokens"] == 1 and metrics["episode/end_answered"] == 1


def test_max_turns_and_a_cut_turn_end_with_their_reasons():
    rollouts, _, stats = run(
        [Calculator(), Calculator()],
        [THREE_TURNS, ["4" * 300]],
        max_turns=2,
    )
    assert [r.num_turns for r in rollouts] == [2, 1] and [r.reward for r in rollouts] == [0.0, 0.0]
    metrics = stats.metrics()
    assert metrics["episode/end_max_turns"] == 1 and metrics["episode/end_max_new_tokens"] == 1


def test_a_long_tool_result_is_cut_with_a_marker():
    env = Calculator()
    (ep,), _, stats = run(
        [env], [[call("multiply", a=10**30, b=10**30), "1"]], max_tool_result_tokens=8
    )
    assert env.messages[2]["content"] == "10000000\n[... cut: 53 more tokens]"
    assert stats.metrics()["episode/tool_result_cuts"] == 1


def test_an_environment_that_raises_fails_only_its_own_episode():
    class Broken(Calculator):
        async def step(self, message: AssistantMessage) -> ChatStepResult:
            raise RuntimeError("backend down")

    broken, good = Broken(), Calculator()
    (bad, ok), _, stats = run([broken, good], [THREE_TURNS, THREE_TURNS])
    assert bad.status == "failed" and "backend down" in bad.error and bad.failure == "environment"
    assert ok.status == "ok" and ok.reward == 1.0
    assert stats.metrics()["episode/end_error"] == 1
