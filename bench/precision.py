"""Where matmuls bind: loomrl at its default precision ('auto') against loomrl pinned to fp32,
and against TRL's ``GRPOTrainer`` in fp32 (as users run it on a CPU) and with its own
``bf16=True``, on compute-bound shapes of our own, interleaved in one run.

Each shape is a random tiny Llama (wider than the demo's) saved to a folder with the demo's
tokenizer, run on the arithmetic prompts with completions of ``new_tokens`` tokens (the
``digits`` reward, which a random model's completions vary on, so every group has something
to learn) through ``bench/peer_trl.py``'s children: the same data, group size (8), prompts
per step, learning rate and threads for every system. Every repeat runs every shape and
system once, in turn, so a shared machine's noise hits them alike; the table has medians.

Also probed once a repeat: the fp32 and bf16 matmul rate at each shape's weight shapes
(this machine's measured peak for that shape), against which the table states each
system's model-FLOP rate, and the seconds per step in each phase (the profile).

    OMP_NUM_THREADS=1 python bench/precision.py                          # 3 shapes x 2 repeats
    python bench/precision.py --shapes h512-l2-t128 --steps 8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peer_trl import PHASE_ORDER, _rows, model_flops_per_completion

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("async-local", "async-local-fp32", "trl", "trl-bf16")
SHAPES = "h256-l4-t32,h384-l4-t64,h512-l2-t128"


def parse_shape(name: str) -> dict[str, int]:
    """'h384-l4-t64': hidden 384, 4 layers, 64-token completions (heads of 64, MLP 4x)."""
    parts = {p[0]: int(p[1:]) for p in name.split("-")}
    if set(parts) != {"h", "l", "t"}:
        raise ValueError(f"shape {name!r}: expected h<hidden>-l<layers>-t<new tokens>")
    return {"hidden": parts["h"], "layers": parts["l"], "new_tokens": parts["t"]}


def build_model(shape: dict[str, int], folder: Path) -> Path:
    from loomrl.models.tiny import build_tiny_model

    h = shape["hidden"]
    model, tok = build_tiny_model(
        "llama",
        seed=0,
        hidden_size=h,
        num_layers=shape["layers"],
        num_heads=max(1, h // 64),
        intermediate_size=4 * h,
    )
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def matmul_rates(model_dir: Path, rows: int, threads: int, seconds: float = 1.5) -> dict:
    """FLOP/s of torch matmuls at the model's weight shapes, fp32 and bf16 (median rounds)."""
    import torch
    from transformers import AutoConfig

    torch.set_num_threads(threads)
    c = AutoConfig.from_pretrained(model_dir)
    h, inter, vocab = c.hidden_size, c.intermediate_size, c.vocab_size
    shapes = [(h, h), (h, inter), (inter, h), (h, vocab)]
    flops = sum(2 * rows * k * n for k, n in shapes)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        mats = [
            (torch.randn(rows, k, dtype=dtype), torch.randn(k, n, dtype=dtype)) for k, n in shapes
        ]
        rates, deadline = [], time.perf_counter() + seconds
        while time.perf_counter() < deadline or len(rates) < 5:
            t0 = time.perf_counter()
            for _ in range(5):
                for a, b in mats:
                    torch.mm(a, b)
            rates.append(5 * flops / (time.perf_counter() - t0))
        out[str(dtype).removeprefix("torch.")] = statistics.median(rates)
    return out


def run_child(system: str, model: Path, shape: dict, args) -> dict:
    cmd = [
        sys.executable,
        str(ROOT / "bench/peer_trl.py"),
        "--child", system,
        "--model", str(model),
        "--steps", str(args.steps),
        "--threads", str(args.threads),
        "--groups-per-step", str(args.groups_per_step),
        "--new-tokens", str(shape["new_tokens"]),
        "--reward", "digits",
        "--skip-accuracy",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{system} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shapes", default=SHAPES, help="comma-separated h<hidden>-l<layers>-t<tokens>"
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--groups-per-step", type=int, default=8, help="prompts per step (x8 completions)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each system")
    parser.add_argument("--json", type=Path, help="also write every run's numbers here")
    args = parser.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    systems = [s for s in args.systems.split(",") if s]
    results: dict[str, dict[str, list[dict]]] = {s: {x: [] for x in systems} for s in shapes}
    rates: dict[str, list[dict]] = {s: [] for s in shapes}
    with tempfile.TemporaryDirectory() as tmp:
        models = {s: build_model(parse_shape(s), Path(tmp) / s) for s in shapes}
        for rep in range(args.repeats):
            for s in shapes:
                shape = parse_shape(s)
                rows = args.groups_per_step * 8 * (shape["new_tokens"] + 10)
                rates[s].append(matmul_rates(models[s], rows, args.threads))
                for system in systems:
                    r = run_child(system, models[s], shape, args) | {"steps": args.steps}
                    results[s][system].append(r)
                    print(
                        f"repeat {rep} {s} {system} ({r['precision']}): "
                        f"{steady_rate(r):.1f} completions/s after the first step",
                        flush=True,
                    )
            if args.json:
                args.json.write_text(json.dumps({"results": results, "rates": rates}, indent=2))
        flops = {
            s: model_flops_per_completion(models[s], prompt_length(), parse_shape(s)["new_tokens"])
            for s in shapes
        }
    report(results, rates, flops, args)


def prompt_length() -> int:
    return round(statistics.mean(len(r["prompt"]) + 1 for r in _rows("train.jsonl")))


def steady_rate(r: dict) -> float:
    """Completions/s after the first step (its warm-up left out, for every system alike)."""
    if r["steady_s_per_step"] is None:
        return r["completions"] / r["loop_s"]
    return r["completions"] / r["steps"] / r["steady_s_per_step"]


def med(runs: list[dict], key) -> float:
    return statistics.median(key(r) for r in runs)


def report(results, rates, flops, args) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 140))
    cps = {s: {x: med(runs, steady_rate) for x, runs in by.items()} for s, by in results.items()}
    table = Table(
        title=f"completions/s where matmuls bind ({args.steps} steps x "
        f"{args.groups_per_step * 8} completions, {args.threads} threads, median of {args.repeats})"
    )
    for col in (
        "shape",
        "system",
        "precision",
        "completions/s",
        "vs loomrl fp32",
        "vs TRL fp32",
        "vs TRL bf16",
        "model GFLOP/s",
        "of measured peak",
    ):
        table.add_column(col, justify="right")
    for s, by in results.items():
        peak = {k: max(r[k] for r in rates[s]) for k in ("float32", "bfloat16")}
        for x, runs in by.items():
            precision = runs[0]["precision"]
            rate = cps[s][x] * flops[s]
            ref = peak["float32" if precision == "fp32" else "bfloat16"]
            table.add_row(
                s,
                x,
                precision,
                f"{cps[s][x]:.1f}",
                *(
                    f"{cps[s][x] / cps[s][b]:.2f}x" if b in cps[s] else "-"
                    for b in ("async-local-fp32", "trl", "trl-bf16")
                ),
                f"{rate / 1e9:.0f}",
                f"{rate / ref:.0%} of {ref / 1e9:.0f}",
            )
    console.print(table)
    phases = Table(
        title="profile: seconds per step in each phase (median over all steps; wall: after the first; loomrl's generator "
        "and trainer overlap, so its phases add up to more than its wall)"
    )
    for col in ("shape", "system", *PHASE_ORDER, "wall", "generate share"):
        phases.add_column(col, justify="right")
    for s, by in results.items():
        for x, runs in by.items():
            cells = [
                f"{med(runs, lambda r, p=p: r['phases'][p]):.3f}" if p in runs[0]["phases"] else "-"
                for p in PHASE_ORDER
            ]
            gen = med(runs, lambda r: r["phases"]["generate"])
            busy = gen + sum(
                med(runs, lambda r, p=p: r["phases"][p])
                for p in ("train forward", "train backward", "optimizer")
                if p in runs[0]["phases"]
            )
            phases.add_row(
                s,
                x,
                *cells,
                f"{med(runs, lambda r: r['steady_s_per_step']):.3f}",
                f"{gen / busy:.0%}",
            )
    console.print(phases)
    for s in results:
        console.print(
            f"{s}: {flops[s] / 1e9:.2f} GFLOP per completion; matmul peak at its shapes "
            + ", ".join(
                f"{k} {max(r[k] for r in rates[s]) / 1e9:.0f} GFLOP/s"
                for k in ("float32", "bfloat16")
            )
        )


if __name__ == "__main__":
    main()
