"""Agent functions for the endpoint's tests: ordinary ``openai``-client programs."""

from __future__ import annotations

import asyncio

from loomrl.models import build_char_tokenizer

TOKENIZER = build_char_tokenizer()
# What each episode of ``three_requests`` saw, by the row's prompt: (token ids, log-probs).
SEEN: dict[str, list[tuple[list[int], list[float]]]] = {}


async def three_requests(client, row):
    """Three completions, each prompt the exact tokens of the one before, its answer and a
    short feedback (a tool's output, say): one sample whose answers are trained on."""
    prompt: str | list[int] = row["prompt"]
    feedback = TOKENIZER(" ok:", add_special_tokens=False)["input_ids"]
    seen = []
    for _ in range(3):
        done = await client.completions.create(model="tiny", prompt=prompt, max_tokens=3)
        ext = done.model_extra["loomrl"]["choices"][0]
        seen.append((ext["token_ids"], ext["logprobs"]))
        prompt = ext["prompt_token_ids"] + ext["token_ids"] + feedback
    SEEN.setdefault(row["prompt"], []).append(seen)
    return float(len(seen[-1][0]))


async def rewrites_history(client, row):
    """Two chat requests, the second dropping the first answer: two samples, one reward."""
    first = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=3
    )
    await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "again: " + row["prompt"]}],
        max_tokens=3,
    )
    return {"reward": 1.0, "answer_chars": float(len(first.choices[0].message.content or ""))}


async def leaves_scoring_to_the_task(client, row):
    await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=3
    )


async def raises_on_odd(client, row):
    await client.completions.create(model="tiny", prompt=row["prompt"], max_tokens=2)
    if int(row["answer"]) % 2:
        raise ValueError("the tool backend is down")
    return 1.0


async def hangs_on_odd(client, row):
    await client.completions.create(model="tiny", prompt=row["prompt"], max_tokens=2)
    if int(row["answer"]) % 2:
        await asyncio.sleep(3600)
    return 0.5
