"""Prompts must fit the model's context together with the tokens generated after them.

A prompt past the context is not an error to the model: positions past it produce
garbage, rewards and losses of 0, and slow steps. So every prompt is measured before any
model loads; a prompt that does not fit fails the job naming its file and line, or, with
``data.truncate_prompts``, is cut to fit (keeping its end) and the cut is logged. A prompt
past ``data.max_prompt_bytes`` is refused (or cut by bytes) before it is tokenized at all:
tokenizing costs hundreds of bytes of memory per character.
"""

from __future__ import annotations

import logging
from typing import Any

from loomrl.data import DatasetError

logger = logging.getLogger(__name__)


def prompt_budget(context: int | None, max_new_tokens: int) -> int | None:
    """Prompt tokens that fit with ``max_new_tokens`` generated after them (None: unknown)."""
    if context is None:
        return None
    if max_new_tokens >= context:
        raise DatasetError(
            f"generation.max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's "
            f"context of {context} positions; lower it"
        )
    return context - max_new_tokens


def check_prompts(
    rows: list[dict[str, Any]],
    where: list[str],
    encode,
    key: str,
    budget: int | None,
    truncate: bool,
    max_bytes: int | None = None,
) -> None:
    """Fail on the first prompt longer than ``max_bytes`` UTF-8 bytes or ``budget`` tokens
    (``where`` names each row's file and line), or, with ``truncate``, cut each prompt past
    ``max_bytes`` to its last ``max_bytes`` bytes (in place, before any is tokenized: memory
    stays bounded) and log how many will be cut to ``budget`` tokens."""
    if max_bytes is not None:
        _check_prompt_bytes(rows, where, key, max_bytes, truncate)
    if budget is None:
        return
    too_long = 0
    for row, place in zip(rows, where):
        n = len(encode(row[key]))
        if n <= budget:
            continue
        if not truncate:
            raise DatasetError(
                f"{place}: prompt is {n} tokens; with generation.max_new_tokens the model's context leaves "
                f"{budget}; shorten it, lower max_new_tokens, or set data.truncate_prompts=true"
            )
        too_long += 1
    if too_long:
        logger.warning(
            "data.truncate_prompts: %d of %d prompts (%s ...) are longer than %d tokens and will be cut "
            "to their last %d tokens",
            too_long,
            len(rows),
            where[0].split(":")[0],
            budget,
            budget,
        )


def _check_prompt_bytes(
    rows: list[dict[str, Any]], where: list[str], key: str, max_bytes: int, truncate: bool
) -> None:
    """Refuse (or, with ``truncate``, cut) prompts past ``max_bytes`` UTF-8 bytes. A prompt
    of at most ``max_bytes // 4`` characters fits whatever they are, so only longer ones are
    encoded to count."""
    cut = 0
    for row, place in zip(rows, where):
        text = row[key]
        if isinstance(text, list):  # messages: measured by their contents, never cut
            _check_message_bytes(text, place, max_bytes)
            continue
        if len(text) <= max_bytes // 4:
            continue
        data = text.encode("utf-8", "surrogatepass")
        if len(data) <= max_bytes:
            continue
        if not truncate:
            raise DatasetError(
                f"{place}: prompt is {len(data)} bytes, more than data.max_prompt_bytes={max_bytes}; refused "
                "before tokenizing it; shorten it, raise data.max_prompt_bytes, or set data.truncate_prompts=true"
            )
        # The last max_bytes bytes, less a character cut in two at the start.
        row[key] = data[len(data) - max_bytes :].decode("utf-8", "ignore")
        cut += 1
    if cut:
        logger.warning(
            "data.truncate_prompts: %d prompts (%s ...) are longer than data.max_prompt_bytes=%d bytes "
            "and were cut to their last %d bytes before tokenizing",
            cut,
            where[0].split(":")[0],
            max_bytes,
            max_bytes,
        )


# What a message costs beyond its strings once rendered and tokenized (the template's role
# markers, separators, special tokens), counted against data.max_prompt_bytes so that many
# empty messages are not free; and the most messages one prompt may hold.
MESSAGE_ALLOWANCE_BYTES = 64
MAX_PROMPT_MESSAGES = 4096


def _check_message_bytes(messages: list[dict[str, Any]], place: str, max_bytes: int) -> None:
    """Refuse a message list before it is rendered: past ``MAX_PROMPT_MESSAGES`` messages,
    or past ``max_bytes`` counting every string in it (roles, contents, names, keys) plus
    ``MESSAGE_ALLOWANCE_BYTES`` a message."""
    if len(messages) > MAX_PROMPT_MESSAGES:
        raise DatasetError(
            f"{place}: the prompt holds {len(messages)} messages, more than {MAX_PROMPT_MESSAGES}; "
            "refused before rendering it (data.max_prompt_bytes bounds one prompt); shorten it"
        )
    size = len(messages) * MESSAGE_ALLOWANCE_BYTES + _string_bytes(messages, max_bytes)
    if size > max_bytes:
        raise DatasetError(
            f"{place}: the prompt's {len(messages)} messages hold {size} bytes (every string, and "
            f"{MESSAGE_ALLOWANCE_BYTES} a message), more than data.max_prompt_bytes={max_bytes}; "
            "refused before rendering and tokenizing them (a message list is never cut); shorten "
            "them or raise max_prompt_bytes"
        )


def _string_bytes(value: Any, stop_at: int) -> int:
    """UTF-8 bytes of every string (keys included) in ``value``'s lists and dicts; other
    values count 8. Stops counting once past ``stop_at``."""
    if isinstance(value, str):
        # (a string longer than stop_at characters is past it in bytes too: not encoded)
        return len(value) if len(value) > stop_at else len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, dict):
        parts: Any = (part for pair in value.items() for part in pair)
    elif isinstance(value, list):
        parts = value
    else:
        return 8
    total = 0
    for part in parts:
        total += _string_bytes(part, stop_at - total)
        if total > stop_at:
            break
    return total


def truncate_ids(ids: list[int], budget: int | None, bos_id: int | None) -> list[int]:
    """The last ``budget`` tokens of a prompt (a leading BOS is kept)."""
    if budget is None or len(ids) <= budget:
        return ids
    if bos_id is not None and ids and ids[0] == bos_id:
        return [bos_id, *ids[len(ids) - budget + 1 :]]
    return ids[len(ids) - budget :]


def encode_texts(
    tokenizer: Any, texts: list[str], add_special_tokens: bool = True
) -> list[list[int]]:
    """``tokenizer(texts).input_ids``, in one call to the fast (Rust) backend when the
    tokenizer has one with no truncation or padding of its own: the transformers wrapper
    costs about 4x the encoding itself, on the controller's loop. ``add_special_tokens``
    False for text a chat template rendered (it holds its own BOS)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return (
            tokenizer(texts) if add_special_tokens else tokenizer(texts, add_special_tokens=False)
        ).input_ids
    return [e.ids for e in backend.encode_batch(texts, add_special_tokens=add_special_tokens)]
