"""Tokens/s of loomrl's HF generator (``loomrl.generation.hf``) for its engine variants,
on one device, the same model and prompts, in one run.

Variants (each where it applies; the table's ratios are against the first one run):
- ``fp32 traced``: fp32 weights, forwards from TorchScript traces (the CPU ``local`` default);
- ``fp32 eager``: fp32 weights, the dynamic-cache loop (the CUDA default before the static step);
- ``bf16 eager``: bf16 weights, the dynamic-cache loop (fp32 sampling);
- ``fp32 static``: the static-cache decode step run eagerly (CPU: what the tests compare);
- ``fp32 static+graphs`` / ``bf16 static+graphs``: the static cache with each decode step
  replayed from a CUDA graph (the CUDA default, ``generation.engine.cuda_graphs = "auto"``).

Sizes: ``full`` is the 0.36B Qwen2 of issue 35 (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4,864, vocabulary 4,096; random weights), 32 prompts of 32 tokens x 8 completions
x 128 new tokens a call; ``dry`` a tiny Qwen2 of the same shape family that runs in seconds on
a CPU. EOS never ends a sequence here (every completion has exactly the new tokens asked for,
as in the TRL side-by-side), so every variant does the same work. Detokenizing is left out.

    python bench/hf_engine.py --size dry
    python bench/hf_engine.py --size full --device cuda --json /tmp/engine.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from loomrl.generation.hf import HFGenerator  # noqa: E402
from loomrl.types import GenerationRequest, SamplingParams  # noqa: E402

SIZES = {
    "dry": dict(
        model=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
        ),
        prompts=4,
        samples=4,
        prompt_len=12,
        new_tokens=24,
        repeats=3,
    ),
    "full": dict(
        model=dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=4096,
        ),
        prompts=32,
        samples=8,
        prompt_len=32,
        new_tokens=128,
        repeats=2,
    ),
}

# name, weights dtype, HFGenerator knobs, devices it runs on
VARIANTS = [
    ("fp32 traced", torch.float32, dict(trace=True), {"cpu"}),
    ("fp32 eager", torch.float32, {}, {"cpu", "cuda"}),
    ("bf16 eager", torch.bfloat16, {}, {"cpu", "cuda"}),
    ("fp32 static", torch.float32, dict(static_cache=True), {"cpu"}),
    ("fp32 static+graphs", torch.float32, dict(cuda_graphs=True), {"cuda"}),
    ("bf16 static+graphs", torch.bfloat16, dict(cuda_graphs=True), {"cuda"}),
]
# Only when named in --variants: the static step through transformers' sdpa, which repeats the
# key/value heads for each query head (what grouped_decode_attention saves).
OPTIONAL_VARIANTS = [
    (
        "bf16 static+graphs repeat-kv",
        torch.bfloat16,
        dict(cuda_graphs=True, grouped_attention=False),
        {"cuda"},
    ),
    (
        "fp32 static repeat-kv",
        torch.float32,
        dict(static_cache=True, grouped_attention=False),
        {"cpu"},
    ),
]
# a decode shape is traced on its third use; the others need one call
WARMUP_CALLS = {"fp32 traced": 3}
# a dynamic-cache variant warms up on short completions (no shape to capture)
WARMUP_NEW_TOKENS = 16


class _IdsOnly:
    """The generator's tokenizer contract without text: the bench times tokens, not decoding."""

    eos_token_id, pad_token_id = -1, 0  # -1: no sampled token ends a sequence

    def batch_decode(self, ids, skip_special_tokens: bool = True) -> list[str]:
        return [""] * len(ids)


def build_model(size: dict, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        **size["model"],
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs (a 0.36B init on the CPU takes seconds)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def make_requests(size: dict) -> list[GenerationRequest]:
    rng = torch.Generator().manual_seed(1)
    vocab = size["model"]["vocab_size"]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=size["new_tokens"])
    return [
        GenerationRequest(
            torch.randint(3, vocab, (size["prompt_len"],), generator=rng).tolist(),
            size["samples"],
            sampling,
            seed=i,
        )
        for i in range(size["prompts"])
    ]


def time_variant(base, name: str, dtype, knobs: dict, requests, repeats: int, device) -> dict:
    model = copy.deepcopy(base).to(dtype)
    knobs = dict(knobs)
    grouped = knobs.pop("grouped_attention", True)
    gen = HFGenerator(model, _IdsOnly(), publish_dtype="bfloat16", **knobs)
    if gen._static is not None:
        gen._static.grouped_attention = grouped
    warmup = requests
    # (static: the graph is captured at the timed shape)
    if gen._static is None and not knobs.get("trace"):
        short = dataclasses.replace(requests[0].sampling, max_new_tokens=WARMUP_NEW_TOKENS)
        warmup = [dataclasses.replace(r, sampling=short) for r in requests]
    for _ in range(WARMUP_CALLS.get(name, 1)):
        gen.generate(warmup)
    seconds, tokens, metrics = [], 0, {}
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        results = gen.generate(requests)  # (returns host lists: the device is done when it returns)
        seconds.append(time.perf_counter() - t0)
        tokens = sum(len(ids) for r in results for ids in r.token_ids)
        metrics = results[0].engine_metrics or metrics
    best = min(seconds)
    row = dict(
        variant=name,
        tokens=tokens,
        s_per_call=best,
        tokens_per_s=tokens / best,
        notes=_notes(metrics),
    )
    gen.close()
    del gen, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _notes(metrics: dict) -> str:
    notes = []
    if "generation/cuda_graphs" in metrics:
        notes.append(
            f"graphs {metrics['generation/cuda_graphs']:.0f}, failed {metrics['generation/cuda_graph_failures']:.0f}"
        )
    if "generation/traced_forwards" in metrics:
        notes.append(
            f"traced {metrics['generation/traced_forwards']:.0f}/eager {metrics['generation/eager_forwards']:.0f} fwd"
        )
    return "; ".join(notes)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def table(rows: list[dict], header: str) -> str:
    base = rows[0]["tokens_per_s"]
    lines = [
        header,
        "",
        "| variant | tokens/s | s/call | vs first | notes |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['tokens_per_s']:,.0f} | {r['s_per_call']:.3f} | "
            f"{r['tokens_per_s'] / base:.2f}x | {r['notes']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default="dry")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed calls per variant (best taken)"
    )
    parser.add_argument(
        "--variants", default=None, help="comma-separated names (default: all for the device)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=45.0,
        help="after this many seconds the remaining variants get one timed call each",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    device = torch.device(args.device)
    size = SIZES[args.size]
    wanted = set(args.variants.split(",")) if args.variants else None
    known = VARIANTS + OPTIONAL_VARIANTS
    variants = [
        v
        for v in (VARIANTS if wanted is None else known)
        if device.type in v[3] and (wanted is None or v[0] in wanted)
    ]
    if not variants:
        raise SystemExit(
            f"no variant of {[v[0] for v in known]} runs on {device.type} (asked: {args.variants})"
        )
    t0 = time.perf_counter()
    base = build_model(size, device)
    requests = make_requests(size)
    repeats = args.repeats or size["repeats"]
    rows = []
    for name, dtype, knobs, _ in variants:
        late = time.perf_counter() - t0 > args.budget_s  # past the budget: one timed call a variant
        rows.append(
            time_variant(base, name, dtype, knobs, requests, 1 if late else repeats, device)
        )
        print(
            f"{name}: {rows[-1]['tokens_per_s']:,.0f} tokens/s ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    sequences = size["prompts"] * size["samples"]
    what = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU, {torch.get_num_threads()} threads"
    )
    header = (
        f"HF engine, {args.size} ({sum(p.numel() for p in base.parameters()) / 1e6:.1f}M parameters): "
        f"{sequences} sequences x {size['new_tokens']} new tokens, prompts of {size['prompt_len']}, on {what}; "
        f"best of {repeats}, {time.perf_counter() - t0:.0f} s in all"
    )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                dict(
                    device=what, size=args.size, header=header, rows=rows, torch=torch.__version__
                ),
                indent=2,
            )
        )
    print(table(rows, header))


if __name__ == "__main__":
    main()
