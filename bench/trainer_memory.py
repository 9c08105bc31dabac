"""Peak memory of one train step on a Qwen2-0.5B-shaped model, before and after the
memory-lean trainer (issue 35): the full ``[tokens, vocabulary]`` log-softmax against the
chunked log-probs (``trainer.chunked_logprobs``), with and without gradient checkpointing.

The model is built from a config with random weights (hidden 896, 24 layers, 14 heads, 2
key/value heads, intermediate 4864, vocabulary 151,936, tied embeddings; nothing is
downloaded); one micro-batch of 2,048 tokens (4 rows of 512). Each variant runs in a fresh
subprocess: a tiny warm-up step first creates the gradients and AdamW's state, then the
measured step.

Figures (each printed, none hidden):
- CPU: ``peak RSS`` is the process's ``ru_maxrss`` (everything: weights, gradients, AdamW
  state and the step); ``step transient`` is the peak resident set during the measured step
  (``VmHWM`` after ``/proc/self/clear_refs``) minus the resident set before it, i.e. what
  the step itself adds above the resident model and optimizer state.
- CUDA: ``torch.cuda.max_memory_allocated`` over the measured step, and the same minus
  what was allocated before it.

    python bench/trainer_memory.py                    # 24 layers, the auto device
    python bench/trainer_memory.py --layers 2 --device cpu

``--spread --batch-rows 8``: eight rows of 16 to 512 tokens (2,109 tokens, 4,096 padded)
instead of four of 512, and the variants at the defaults (issue 52): ``defaults`` (the
large vocabulary chunks the log-probs even in fp32 on the CPU), ``defaults + packing``
(``trainer.packing``: no padding) and a smaller chunk:

    python bench/trainer_memory.py --layers 1 --device cpu --spread --batch-rows 8 --variants 0,3,4,5

``--sharded``: the sharded trainer (fsdp2) against the single one instead: per-rank state
for 1, 2 and 4 ranks on a 134M-parameter model, step times for 1 and 2 ranks and their
projection to 8 (``bench/trainer_sharding.py``; ~5 minutes on 2 cores):

    python bench/trainer_memory.py --sharded                 # ranks 1,2,4
    python bench/trainer_memory.py --sharded --ranks 1,2 --rows 8 --steps 2
    python bench/trainer_memory.py --startup --ranks 2,4      # the start-up table alone

It ends with each rank's start-up peak on the same model saved as a folder: the whole model
loaded on every rank then sharded, against the meta-device start (``fsdp_init``; each rank
reads its rows of the safetensors) and torch's broadcast-from-rank-0 recipe (~2 minutes).

Cost: the 24-layer default needs ~16 GB of RAM for the 'before' variant on a CPU (fp32) and
takes minutes a variant on 2 cores; ``--layers 2`` took 2-3 minutes a variant on a shared
2-core Xeon (most of it the 151,936-wide output projection). On a GPU it is seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {  # name -> trainer overrides
    "before (full log-softmax)": {"chunked_logprobs": False},
    "after (chunked)": {"chunked_logprobs": True},
    "after (chunked + checkpointing)": {"chunked_logprobs": True, "gradient_checkpointing": True},
    "defaults": {},
    "defaults + packing": {"packing": True},
    "defaults, 128-token chunks": {"logprob_chunk_tokens": 128},
}
ROWS, ROW_TOKENS, PROMPT_TOKENS = 4, 512, 32


def _proc_status_kb(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Resets the kernel's peak-RSS mark of this process (``VmHWM``); False where refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _model(layers: int, device):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=151_936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)


def _lengths(row_tokens: int, rows: int, spread: bool) -> list[int]:
    """Each row's prompt + completion length: all ``row_tokens``, or (``spread``) evenly
    from 16 to ``row_tokens``, where padding to the longest wastes about half the batch."""
    if not spread or rows == 1:
        return [row_tokens] * rows
    return [16 + (row_tokens - 16) * i // (rows - 1) for i in range(rows)]


def _groups(row_tokens: int, rows: int, prompt_tokens: int, spread: bool = False):
    from loomrl.types import Group, Rollout

    rollouts = []
    for i, length in enumerate(_lengths(row_tokens, rows, spread)):
        prompt = min(prompt_tokens, length // 2)
        n = length - prompt
        rollouts.append(
            Rollout(
                i,
                [2 + i % 7] * prompt,
                [(11 * i + j) % 151_000 + 5 for j in range(n)],
                [-3.0] * n,
                [1] * n,
                0,
                reward=float(i % 2),
            )
        )
    return [Group.of_rollouts(0, 0, rollouts)]


def child(variant: str, layers: int, device_name: str, rows: int, spread: bool) -> dict:
    """One variant's step, measured in this (fresh) process."""
    import torch

    from loomrl.config import AlgorithmConfig, TrainerConfig
    from loomrl.device import resolve_device
    from loomrl.training.trainer import Trainer

    device = resolve_device(device_name)
    model = _model(layers, device)
    cfg = TrainerConfig(
        lr=1e-5,
        micro_batch_size=rows,
        packing_max_tokens=rows * ROW_TOKENS,
        **({"shared_prefix": False} if "packing" not in variant else {}),
        trace=False,
        **VARIANTS[variant],
    )
    trainer = Trainer(
        model, type("Tok", (), {"pad_token_id": 0})(), AlgorithmConfig(group_size=rows), cfg, 1.0
    )
    # gradients and AdamW state exist now
    trainer.train_step(_groups(PROMPT_TOKENS + 8, rows, PROMPT_TOKENS))
    groups = _groups(ROW_TOKENS, rows, PROMPT_TOKENS, spread)
    out = {
        "variant": variant,
        "precision": trainer.precision,
        "device": str(device),
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
    }
    if device.type == "cuda":
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        resident = (_proc_status_kb("VmRSS") or 0) * 1024
        out["hwm_reset"] = _reset_peak_rss()
    t0 = time.perf_counter()
    metrics = trainer.train_step(groups)
    out["step_s"] = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = (_proc_status_kb("VmHWM") or 0) * 1024 if out["hwm_reset"] else None
        out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.update(
        resident=resident,
        step_peak=peak,
        transient=None if peak is None else peak - resident,
        grad_norm=metrics["train/grad_norm"],
    )
    return out


def _run_variant(variant: str, layers: int, device: str, rows: int, spread: bool) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    cmd = [
        sys.executable,
        __file__,
        "--child",
        variant,
        "--layers",
        str(layers),
        "--device",
        device,
        "--batch-rows",
        str(rows),
        *(["--spread"] if spread else []),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _sharded(args) -> None:
    """``--sharded`` (the step tables, then the start-up table) or ``--startup`` (that alone)."""
    import tempfile

    sys.path.insert(0, str(ROOT / "bench"))
    from trainer_sharding import main as sharded_main
    from trainer_sharding import startup_main

    ranks = [int(n) for n in args.ranks.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(args.workdir or scratch)  # --workdir: the figures stay; a rerun reuses them
        workdir.mkdir(parents=True, exist_ok=True)
        if not args.startup:
            sharded_main(ranks, args.rows, args.steps, workdir)
        startup_main(ranks, workdir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--layers", type=int, default=24, help="decoder layers (24 is the 0.5B shape)"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--variants",
        default=",".join(str(i) for i in range(len(VARIANTS))),
        help="indices of the variants to run, comma-separated: "
        + "; ".join(f"{i}={v}" for i, v in enumerate(VARIANTS)),
    )
    parser.add_argument("--batch-rows", type=int, default=ROWS, help="rows of the micro-batch")
    parser.add_argument(
        "--spread",
        action="store_true",
        help="row lengths evenly from 16 to 512 tokens (padding wastes about half) instead of all 512",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--sharded", action="store_true", help="fsdp2 ranks vs the single trainer")
    parser.add_argument("--ranks", default="1,2,4", help="--sharded: rank counts (with 1)")
    parser.add_argument("--rows", type=int, default=8, help="--sharded: rollouts a step")
    parser.add_argument("--steps", type=int, default=2, help="--sharded: measured steps")
    parser.add_argument(
        "--workdir", help="--sharded: keep (and reuse) each configuration's figures here"
    )
    parser.add_argument(
        "--startup",
        action="store_true",
        help="--sharded's start-up table alone: each rank's peak while the model starts",
    )
    args = parser.parse_args()
    if args.sharded or args.startup:
        _sharded(args)
        return
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.device, args.batch_rows, args.spread)))
        return
    names = [list(VARIANTS)[int(i)] for i in args.variants.split(",")]
    n = args.batch_rows
    rows = [_run_variant(v, args.layers, args.device, n, args.spread) for v in names]
    lengths = _lengths(ROW_TOKENS, n, args.spread)
    batch = (
        f"{n} rows of {lengths[0]}-{lengths[-1]} tokens ({sum(lengths)} tokens, {n * max(lengths)} padded)"
        if args.spread
        else f"{n} x {ROW_TOKENS} = {n * ROW_TOKENS} tokens"
    )
    cuda = rows[0]["device"].startswith("cuda")
    print(
        f"\nQwen2-shaped, {args.layers} layers, {rows[0]['params_m']:.0f}M parameters, vocabulary 151,936, "
        f"one micro-batch of {batch}, precision {rows[0]['precision']}, "
        f"device {rows[0]['device']}\n"
    )
    peak_name = "step peak allocated GiB" if cuda else "peak RSS GiB (ru_maxrss)"
    print(
        f"| variant | {peak_name} | vs before | resident before step GiB | step transient GiB | vs before "
        "| step s | grad norm |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    base = rows[0]
    for r in rows:
        peak = r["step_peak"] if cuda else r["peak_rss"]
        base_peak = base["step_peak"] if cuda else base["peak_rss"]
        ratio = f"{base_peak / peak:.2f}x" if peak else "-"
        t_ratio = (
            f"{base['transient'] / r['transient']:.2f}x"
            if r["transient"] and base["transient"]
            else "-"
        )
        print(
            f"| {r['variant']} | {_gib(peak)} | {ratio} | {_gib(r['resident'])} | {_gib(r['transient'])} | {t_ratio} "
            f"| {r['step_s']:.1f} | {r['grad_norm']:.6g} |"
        )


if __name__ == "__main__":
    main()
