"""The endpoint's overhead per request: the same completion asked of the HF engine directly
(its ``generate`` on a worker thread, as the local runtime calls it) and through the
OpenAI-compatible endpoint with the official ``openai`` client (HTTP on loopback, JSON,
tokenization, the batcher), one request at a time, interleaved, in one run.

Prints p50 and p99 latency of each path, and the endpoint's overhead (endpoint minus direct)
at the median and the 99th percentile; ``--window-ms`` is the batcher's window (0: a request
goes at once; the default job setting of 5 ms adds up to that much by design, buying shared
generate calls under load).

    python bench/serve.py --requests 300 --max-tokens 8
    python bench/serve.py --requests 300 --window-ms 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    import openai

    from loomrl.generation.hf import HFGenerator
    from loomrl.models.tiny import build_tiny_model
    from loomrl.serve.app import ServeState
    from loomrl.serve.batcher import Batcher
    from loomrl.serve.episodes import EpisodeBook
    from loomrl.serve.policy import ServedPolicy
    from loomrl.serve.server import Endpoint, new_token
    from loomrl.types import GenerationRequest, SamplingParams

    model, tok = build_tiny_model(hidden_size=args.hidden_size, num_layers=2)
    engine = HFGenerator(model, tok)

    async def generate(requests):
        return await asyncio.to_thread(engine.generate, requests)

    batcher = Batcher(generate, args.window_ms / 1000, 64)
    policy = ServedPolicy(
        tok, batcher, default_max_tokens=args.max_tokens, max_tokens=args.max_tokens
    )
    state = ServeState(policy, EpisodeBook(600.0), new_token(), "bench")
    endpoint = Endpoint(state)
    url = await endpoint.start()
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=state.token, max_retries=0)
    prompt = "12+34="
    ids = tok(prompt)["input_ids"]
    sampling = SamplingParams(1.0, 1.0, args.max_tokens)
    times: dict[str, list[float]] = {"direct": [], "endpoint": []}
    try:
        for i in range(args.requests + args.warmup):
            t0 = time.perf_counter()
            await generate([GenerationRequest(ids, 1, sampling, i)])
            t1 = time.perf_counter()
            await client.completions.create(
                model="bench", prompt=prompt, max_tokens=args.max_tokens, seed=i
            )
            t2 = time.perf_counter()
            if i >= args.warmup:
                times["direct"].append((t1 - t0) * 1000)
                times["endpoint"].append((t2 - t1) * 1000)
    finally:
        await client.close()
        await endpoint.stop()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--window-ms", type=float, default=0.0)
    args = parser.parse_args()
    times = asyncio.run(measure(args))
    direct, served = times["direct"], times["endpoint"]
    overhead = [s - d for s, d in zip(served, direct)]
    print(f"{args.requests} requests, {args.max_tokens} tokens each, window {args.window_ms:g} ms")
    print(f"{'path':<22}{'p50 ms':>10}{'p99 ms':>10}{'ratio p50':>12}")
    base = statistics.median(direct)
    for name, values in (("generator directly", direct), ("endpoint (openai)", served)):
        p50 = statistics.median(values)
        print(f"{name:<22}{p50:>10.2f}{percentile(values, 0.99):>10.2f}{p50 / base:>12.2f}")
    print(
        f"{'overhead per request':<22}{statistics.median(overhead):>10.2f}"
        f"{percentile(overhead, 0.99):>10.2f}"
    )


if __name__ == "__main__":
    main()
