"""Quantized generation (``generation.engine.quantize``): tokens/s, generator memory and the
behaviour log-prob mismatch for ``none`` vs ``int8`` and ``int4`` (``fp8`` on CUDA), in one run.

Models: ``demo``, the arithmetic demo's tiny Llama (the warm-started checkpoint when
``--demo`` points at one, else ``tiny:llama`` with random weights), on prompts from
``examples/arithmetic/eval.jsonl``; ``138m``, a Llama built from a config (hidden 768,
12 layers, 12 heads, intermediate 3,072, vocabulary 32,000, tied head; random weights) on
random prompts. Each (model, precision) runs in its own process, so the memory figures are
that process's alone:

- ``engine MB``: the generator model's weight bytes (parameters, buffers, packed int8/int4
  weights and scales); the receiver's unquantized mirror (published bf16) is not in it;
- ``RSS +MB``: the process's resident memory after building the generator and generating,
  less before the model was built (model, mirror, quantized copy, activations);
- ``|dlogp|``, ``ratio max``, ``>delta``: the behaviour log-probs against the fp32 model the
  trainer holds, on the sampled tokens: the mismatch the loss's importance ratio sees (with
  ``none`` it is the bf16 publishing's alone), its largest ratio pi/mu and the share of tokens
  past ``algorithm.delta`` = 2.

EOS never ends a sequence (every completion has the new tokens asked for). Quick default:
well under 3 minutes on a 2-core CPU.

    python bench/quantized.py --demo .cache/arithmetic-warmstart
    python bench/quantized.py --device cuda --precisions none int8 fp8 --new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

BIG = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    vocab_size=32000,
)
DELTA = 2.0


class _IdsOnly:
    """The generator's tokenizer contract without text: the bench times tokens, not decoding."""

    eos_token_id, pad_token_id = -1, 0  # -1: no sampled token ends a sequence

    def batch_decode(self, ids, skip_special_tokens: bool = True) -> list[str]:
        return [""] * len(ids)


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def build(model_name: str, demo: str, device: str):
    """(model in fp32 on ``device``, prompt token lists) for ``model_name``."""
    import torch

    if model_name == "demo":
        from loomrl.models import load_model_and_tokenizer

        model, tok = load_model_and_tokenizer(demo if Path(demo).exists() else "tiny:llama", seed=0)
        rows = [json.loads(x) for x in (ROOT / "examples/arithmetic/eval.jsonl").open()]
        prompts = [tok(r["prompt"]).input_ids for r in rows]
        return model.to(device).eval(), prompts
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        **BIG, max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=0
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    rng = torch.Generator().manual_seed(1)
    return model, [torch.randint(3, BIG["vocab_size"], (16,), generator=rng).tolist()] * 64


def engine_bytes(gen) -> int:
    tensors = {id(t): t for t in [*gen.model.parameters(), *gen.model.buffers()]}
    dense = sum(t.numel() * t.element_size() for t in tensors.values())
    return dense + (gen.quantized.weight_bytes() if gen.quantized is not None else 0)


def mismatch(model_name, args, gen, requests, results) -> dict:
    """Behaviour log-probs against the fp32 model's on the sampled tokens."""
    import torch

    from loomrl.training.trainer import build_token_batch, token_logprobs
    from loomrl.types import Rollout

    full, _ = build(model_name, args.demo, args.device)
    rollouts = [
        Rollout(0, req.prompt_ids, ids, lps, [1] * len(ids), 0)
        for req, res in zip(requests, results)
        for ids, lps in zip(res.token_ids, res.logprobs)
    ]
    batch = build_token_batch(rollouts, [0.0] * len(rollouts), 0, 0).to(args.device)
    with torch.no_grad():
        logp, _ = token_logprobs(full, batch, temperature=1.0)
    mask = batch.target_mask
    diff = (logp - batch.behaviour) * mask
    ratio = torch.exp(diff)
    n = mask.sum()
    return {
        "dlogp_abs_mean": float(diff.abs().sum() / n),
        "ratio_max": float(ratio.masked_fill(mask == 0, 0).max()),
        "over_delta": float(((ratio > DELTA).float() * mask).sum() / n),
    }


def run_one(args) -> dict:
    """One (model, precision) in this process: the row of the table."""
    import torch

    from loomrl.generation.hf import HFGenerator
    from loomrl.types import GenerationRequest, SamplingParams
    from loomrl.weights import encode_update
    from loomrl.weights.params import published_state

    torch.set_num_threads(args.threads)
    before = rss_mb()
    model, prompts = build(args.model, args.demo, args.device)
    if args.device == "cuda":
        model = model.to(torch.bfloat16)
    gen = HFGenerator(model, _IdsOnly(), quantize=args.one, trace=False)
    # version 0 as a job's generator gets it: the trainer's weights published in bf16
    gen.update_weights(
        encode_update(None, published_state(model, torch.bfloat16), version=0, base_version=None)
    )
    del model
    sp = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
    n = args.prompts if args.model == "demo" else args.big_prompts
    requests = [GenerationRequest(p, args.samples, sp, seed=i) for i, p in enumerate(prompts[:n])]
    gen.generate(requests[:2])  # warm-up
    best = float("inf")
    for _ in range(args.repeats):
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        results = gen.generate(requests)
        best = min(best, time.perf_counter() - t0)
    tokens = sum(len(ids) for r in results for ids in r.token_ids)
    row = dict(
        model=args.model,
        precision=args.one,
        num_params_m=sum(t.numel() for t in gen.mirror.values()) / 1e6,
        tokens_per_s=tokens / best,
        engine_mb=engine_bytes(gen) / 2**20,
        rss_growth_mb=rss_mb() - before,
    )
    return row | mismatch(args.model, args, gen, requests, results)


def _cell(row: dict, ref: dict, key: str) -> str:
    """``row[key]``, with its ratio to the model's first row."""
    return f"{row[key]:.1f}" + (f" ({row[key] / ref[key]:.2f}x)" if row is not ref else "")


def table(rows: list[dict]) -> str:
    head = "| model | params | precision | tokens/s | engine MB | RSS +MB | |dlogp| | ratio max | >delta |"
    lines = [head, "|" + "---|" * 9]
    base = {}
    for r in rows:
        ref = base.setdefault(r["model"], r)
        x = lambda key, r=r, ref=ref: _cell(r, ref, key)  # noqa: E731
        lines.append(
            f"| {r['model']} | {r['num_params_m']:.1f}M | {r['precision']} | {x('tokens_per_s')} "
            f"| {x('engine_mb')} | {x('rss_growth_mb')} | {r['dlogp_abs_mean']:.4f} "
            f"| {r['ratio_max']:.3f} | {r['over_delta']:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo", default=str(ROOT / ".cache/arithmetic-warmstart"))
    p.add_argument("--models", nargs="+", default=["demo", "138m"])
    p.add_argument(
        "--precisions", nargs="+", help="default: none int8 int4 on a CPU, none int8 fp8 on CUDA"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompts", type=int, default=16, help="demo prompts a call")
    p.add_argument("--big-prompts", type=int, default=4, help="138m prompts a call")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=Path)
    p.add_argument("--one", help=argparse.SUPPRESS)  # a precision: run one row in this process
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.precisions:
        args.precisions = ["none", "int8", "fp8" if args.device == "cuda" else "int4"]
        sys.argv += ["--precisions", *args.precisions]
    if args.one:
        print(json.dumps(run_one(args)))
        return
    rows = []
    for model in args.models:
        for precision in args.precisions:
            cmd = [sys.executable, __file__, *sys.argv[1:], "--one", precision, "--model", model]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), file=sys.stderr)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
