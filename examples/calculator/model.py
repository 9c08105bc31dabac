"""The calculator example's tiny chat model: a character tokenizer with a chat template that
offers tools and renders tool calls the Hermes/Qwen way (``<tool_call>{json}</tool_call>``),
and a tiny Llama. Kept short for a character model: the tools as their names, a turn as
``Q:`` (user), ``A:`` (assistant, ended by EOS) or ``R:`` (a tool's result)."""

from __future__ import annotations

from typing import Any

CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}T:{% for t in tools %}{{ t.function.name }}"
    "{% if not loop.last %},{% endif %}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}Q:{{ m.content }}{{ '\\n' }}"
    "{% elif m.role == 'assistant' %}A:{{ m.content }}{% for c in m.tool_calls or [] %}"
    "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{{ eos_token }}{{ '\\n' }}"
    "{% elif m.role == 'tool' %}R:{{ m.content }}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)


def build(seed: int = 0) -> tuple[Any, Any]:
    """A randomly initialised tiny Llama and its character tokenizer with the template."""
    from loomrl.models.tiny import build_tiny_model

    model, tok = build_tiny_model("llama", seed=seed, max_position_embeddings=256)
    tok.chat_template = CHAT_TEMPLATE
    return model, tok


def call_text(a: int, b: int) -> str:
    """The tool call the warm-start traces show (compact JSON: fewer characters to write)."""
    return f'<tool_call>{{"name":"mul","arguments":{{"a":{a},"b":{b}}}}}</tool_call>'
