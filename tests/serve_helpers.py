"""A tiny policy served on loopback for the endpoint's tests: an HF engine over a tiny model,
its generate calls counted, on a thread (as the local runtime runs a generator)."""

from __future__ import annotations

import asyncio
import contextlib

from loomrl.generation.hf import HFGenerator
from loomrl.models.tiny import build_tiny_model
from loomrl.serve.app import ServeState
from loomrl.serve.batcher import Batcher
from loomrl.serve.episodes import EpisodeBook
from loomrl.serve.policy import ServedPolicy
from loomrl.serve.server import Endpoint, new_token

MODEL = "tiny-policy"


class ThreadedGenerator:
    """``generate`` of an HF engine on one worker thread, each call's batch size kept."""

    def __init__(self, engine: HFGenerator) -> None:
        self.engine = engine
        self.batch_sizes: list[int] = []
        self.lock = asyncio.Lock()

    async def __call__(self, requests):
        self.batch_sizes.append(len(requests))
        async with self.lock:
            return await asyncio.to_thread(self.engine.generate, requests)


def tiny_engine() -> HFGenerator:
    model, tok = build_tiny_model(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    return HFGenerator(model, tok)


def make_state(
    generate, tokenizer, *, window_s=0.005, tool_parser=None, deadline_s=60.0
) -> ServeState:
    batcher = Batcher(generate, window_s, 64)
    policy = ServedPolicy(
        tokenizer, batcher, default_max_tokens=8, max_tokens=64, tool_parser=tool_parser
    )
    return ServeState(policy, EpisodeBook(deadline_s), new_token(), MODEL)


@contextlib.asynccontextmanager
async def serving(state: ServeState):
    endpoint = Endpoint(state)
    url = await endpoint.start()
    try:
        yield url, endpoint
    finally:
        await endpoint.stop()
