"""The HF and vLLM generation engines side by side: tokens/s on the same model and prompts,
and the time of a full and of a delta weight update into each, in one run.

Each engine is loomrl's own (``HFGenerator`` with its device defaults: traced forwards on a
CPU, the static step with CUDA graphs on CUDA; ``VllmGenerator``), fed through the same
``WeightReceiver`` path a job uses: an update is decoded and verified into the mirror, then
loaded into the engine. Tokens/s counts the tokens each engine returned (a sequence may end
at EOS), over ``--repeats`` timed calls after one warm-up call. ``vllm-async`` is the vLLM
engine on AsyncLLM (``async_engine = true``). The requests are split into ``--calls``
generate calls: made at once from threads to an engine whose ``generate`` is concurrent (as
the local runtime makes them), one after another to the others. Update times are medians of
``--repeats`` updates: full (every tensor, raw) and delta (every tensor changed a little,
xor-zstd), decode and verify included.

Run it in the vLLM venv (``make vllm-env``):

    .venv-vllm/bin/python bench/engines.py                      # CPU, the demo-sized model
    python bench/engines.py --device cuda --model tiny:qwen2?hidden_size=896&num_layers=24
    .venv-vllm/bin/python bench/engines.py --engines vllm,vllm-async --calls 64   # AsyncLLM
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from loomrl.generation.engine_config import VllmEngineConfig  # noqa: E402
from loomrl.generation.hf import HFGenerator  # noqa: E402
from loomrl.models import load_model_and_tokenizer  # noqa: E402
from loomrl.types import GenerationRequest, SamplingParams  # noqa: E402
from loomrl.weights import encode_update  # noqa: E402
from loomrl.weights.params import published_state  # noqa: E402


def _requests(tok, args) -> list[GenerationRequest]:
    sp = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
    return [
        GenerationRequest(tok(f"{i}+{i * 7 % 100}=").input_ids, args.samples, sp, seed=i)
        for i in range(args.prompts)
    ]


def _generate(gen, requests, num_calls: int) -> list:
    """All results, from ``num_calls`` generate calls: at once (threads) when the engine's
    ``generate`` is concurrent, else one after another."""
    from concurrent.futures import ThreadPoolExecutor

    from loomrl.generation.base import Generator
    from loomrl.runtime.endpoints import check_implements

    chunks = [requests[i::num_calls] for i in range(num_calls)]
    if num_calls == 1 or not check_implements(gen, Generator)["generate"]:
        return [r for chunk in chunks for r in gen.generate(chunk)]
    with ThreadPoolExecutor(num_calls) as pool:
        return [r for results in pool.map(gen.generate, chunks) for r in results]


def _tokens_per_s(gen, requests, repeats: int, num_calls: int) -> float:
    _generate(gen, requests, num_calls)  # warm-up: traces, graphs, vLLM's first schedule
    tokens, t0 = 0, time.perf_counter()
    for _ in range(repeats):
        for result in _generate(gen, requests, num_calls):
            tokens += sum(map(len, result.token_ids))
    return tokens / (time.perf_counter() - t0)


def _update_times(gen, state: dict, repeats: int) -> tuple[float, float]:
    """Median seconds of a full and of a delta update (versions 1, 2, ...)."""
    g = torch.Generator().manual_seed(0)
    full, delta, version, base = [], [], 0, state
    for _ in range(repeats):
        new = {k: v + 1e-3 * torch.randn(v.shape, generator=g).to(v.dtype) for k, v in base.items()}
        update = encode_update(None, new, version=version + 1, base_version=None)
        t0 = time.perf_counter()
        gen.update_weights(update)
        full.append(time.perf_counter() - t0)
        newer = {
            k: v + 1e-3 * torch.randn(v.shape, generator=g).to(v.dtype) for k, v in new.items()
        }
        update = encode_update(new, newer, version=version + 2, base_version=version + 1)
        t0 = time.perf_counter()
        gen.update_weights(update)
        delta.append(time.perf_counter() - t0)
        version, base = version + 2, newer
    return statistics.median(full), statistics.median(delta)


def _engine(name: str, model, tok, args):
    if name == "hf":
        on_cuda = args.device == "cuda"
        return HFGenerator(
            model,
            tok,
            publish_dtype=args.publish_dtype,
            trace=not on_cuda,
            static_cache=on_cuda,
            cuda_graphs=on_cuda,
        )
    from loomrl.generation.vllm_async import AsyncVllmGenerator
    from loomrl.generation.vllm_engine import VllmGenerator

    on_async = name == "vllm-async"
    cfg = VllmEngineConfig(multiprocessing=args.vllm_multiprocessing, async_engine=on_async)
    engine = AsyncVllmGenerator if on_async else VllmGenerator
    return engine(model, tok, engine=cfg, publish_dtype=args.publish_dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny:llama", help="a 'tiny:' spec or a model folder")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16")
    p.add_argument("--publish-dtype", default="float32")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engines", default="hf,vllm", help="hf, vllm, vllm-async")
    p.add_argument("--calls", type=int, default=1, help="generate calls the requests make")
    p.add_argument("--vllm-multiprocessing", action="store_true")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    rows = []
    for name in args.engines.split(","):
        model, tok = load_model_and_tokenizer(args.model, seed=0, dtype=dtype)
        model = model.to(args.device)
        state = published_state(model, getattr(torch, args.publish_dtype))
        gen = _engine(name, model, tok, args)
        gen.update_weights(encode_update(None, state, version=0, base_version=None))
        tps = _tokens_per_s(gen, _requests(tok, args), args.repeats, args.calls)
        full_s, delta_s = _update_times(gen, state, args.repeats)
        rows.append((name, tps, full_s, delta_s))
        getattr(gen, "close", lambda: None)()
    params = sum(t.numel() for t in state.values())
    print(
        f"\n{args.model} ({params / 1e6:.2f}M params, {dtype}, {args.device}); "
        f"{args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens "
        f"in {args.calls} generate calls\n"
    )
    print("| engine | tokens/s | vs first | full update s | delta update s |")
    print("|---|---|---|---|---|")
    for name, tps, full_s, delta_s in rows:
        print(f"| {name} | {tps:.0f} | {tps / rows[0][1]:.2f}x | {full_s:.3f} | {delta_s:.3f} |")


if __name__ == "__main__":
    main()
