"""loomrl against TRL's ``GRPOTrainer`` on the same RL work, interleaved in one run.

Both systems start from the same warm-started tiny Llama (the arithmetic demo's, 4 layers,
hidden 128) with the same tokenizer, data (``examples/arithmetic/train.jsonl``), reward
(exact match), group size (8), completions per step (16 prompts x 8), new tokens (4),
temperature (1.0), learning rate (2e-4, linear decay, 20 warm-up steps) and number of steps.
Each run is a fresh child process with the same torch thread count. For each system the
bench prints completions/s and completion tokens/s (training loop wall time, including the
system's own start-up of workers), held-out greedy accuracy of the final model on
``examples/arithmetic/eval.jsonl`` (the same function for both), peak resident memory, and
model-FLOPs utilisation (MFU): the model's own FLOPs per second over the fp32 matmul rate
this bench measures on this machine at the model's shapes (once a repeat, between the
systems; MFU is against the fastest of those probes).

    python bench/peer_trl.py --steps 150 --repeats 2
    python bench/peer_trl.py --systems trl,async-process --steps 60 --repeats 3

Settings that differ (they cannot be matched exactly; see docs/benchmarks.md):
- The loss. TRL 1.16 defaults to ``loss_type="dapo"`` (token-level PPO clip, epsilon 0.2,
  group-scaled advantages); loomrl runs the demo's ``aipo`` loss (the one it ships).
  Neither uses a KL term (TRL ``beta=0``).
- Dropout: both models have none (the tiny config sets it to 0).
- Staleness: TRL is synchronous by construction; loomrl ``sync`` is its synchronous mode
  (``max_staleness=0``), ``async`` its default (``max_staleness=1``).
- Sampling order of prompts: each system shuffles the training rows with its own RNG.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = ROOT / "examples/arithmetic"
PHASE_ORDER = [
    "generate",
    "score",
    "train forward",
    "train backward",
    "optimizer",
    "publish",
    "trainer busy",
    "wait for batch",
]
# trl: as users run it on a CPU (fp32); trl-bf16: with its own bf16=True (autocast). loomrl
# at its defaults (precision 'auto': bf16 on a CPU with native bf16), or pinned to fp32.
SYSTEMS = ("trl", "trl-bf16", "sync-local", "async-local", "async-process", "async-local-fp32")
FP32 = ['model.dtype="float32"', 'trainer.precision="fp32"']


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


def model_flops_per_completion(model_dir: Path, prompt_len: int, new_tokens: int) -> float:
    """Matmul FLOPs one completion costs: generation (a forward over the prompt, then one
    position per new token, 2 FLOPs per weight per position) plus training (forward and
    backward over prompt + completion, 6 FLOPs per weight per position), with the weights
    that take part in matmuls (embedding lookups excluded, the LM head included) and the
    attention score/value products."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    h, layers, inter, vocab = c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size
    kv = h // c.num_attention_heads * getattr(c, "num_key_value_heads", c.num_attention_heads)
    weights = layers * (2 * h * h + 2 * h * kv + 3 * h * inter) + h * vocab
    seq = prompt_len + new_tokens

    def attention(positions: int, context: int) -> float:  # QK^T and AV, per position
        return layers * 4 * h * context * positions

    gen = 2 * weights * seq + sum(attention(1, t) for t in range(1, seq + 1))
    train = 6 * weights * seq + 3 * attention(seq, seq) / 2
    return gen + train


def matmul_rate(model_dir: Path, rows: int, threads: int, seconds: float = 2.0) -> float:
    """fp32 FLOP/s of torch matmuls at the model's own shapes (a batch of ``rows`` positions
    through each of its weight shapes), the median over a few timed rounds."""
    import torch
    from transformers import AutoConfig

    torch.set_num_threads(threads)
    c = AutoConfig.from_pretrained(model_dir)
    h, inter, vocab = c.hidden_size, c.intermediate_size, c.vocab_size
    shapes = [(h, h), (h, inter), (inter, h), (h, vocab)]
    mats = [(torch.randn(rows, k), torch.randn(k, n)) for k, n in shapes]
    flops = sum(2 * rows * k * n for k, n in shapes)
    rates, deadline = [], time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(rates) < 5:
        t0 = time.perf_counter()
        for _ in range(20):
            for a, b in mats:
                torch.mm(a, b)
        rates.append(20 * flops / (time.perf_counter() - t0))
    return statistics.median(rates)


def final_accuracy(model_dir: Path) -> float:
    from loomrl.models import load_model_and_tokenizer
    from loomrl.training.sft import greedy_accuracy

    model, tok = load_model_and_tokenizer(str(model_dir))
    return greedy_accuracy(model, tok, _rows("eval.jsonl"))


def run_trl(args: argparse.Namespace, out: Path, bf16: bool = False) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    dataset = Dataset.from_list(
        [{"prompt": r["prompt"], "answer": r["answer"]} for r in _rows("train.jsonl")]
    )

    from examples.arithmetic import reward

    score = getattr(reward, args.reward)

    def reward_fn(prompts, completions, answer, **_):
        return [score(p, c, answer=a) for p, c, a in zip(prompts, completions, answer)]

    config = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=args.groups_per_step * 8,
        num_generations=8,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        learning_rate=2e-4,
        lr_scheduler_type="linear",
        warmup_steps=20,
        max_steps=args.steps,
        beta=0.0,
        num_iterations=1,
        use_cpu=True,
        bf16=bf16,
        report_to="none",
        save_strategy="no",
        logging_steps=max(1, args.steps // 10),
        seed=args.seed,
        dataloader_num_workers=0,
        disable_dropout=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_fn,
        args=config,
        train_dataset=dataset,
        processing_class=tok,
    )
    phases = _time_trl_phases(trainer)
    ends: list[float] = []  # each step's end: the steady rate leaves out the first step
    trainer.add_callback(
        type(
            "StepEnds",
            (TrainerCallback,),
            {"on_step_end": lambda *a, **k: ends.append(time.perf_counter())},
        )
    )
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0  # TRL's loop: its start-up is done before train()
    trainer.model.save_pretrained(out / "final")
    tok.save_pretrained(out / "final")
    return {
        "wall_s": wall,
        "loop_s": wall,
        "completions": args.steps * args.groups_per_step * 8,
        "final": out / "final",
        "phases": {k: v / args.steps for k, v in phases.items()},
        "precision": "bf16_mixed" if bf16 else "fp32",
        "steady_s_per_step": (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else None,
    }


def _time_trl_phases(trainer) -> dict[str, float]:
    """Seconds spent in each phase of TRL's loop, by wrapping the methods that do them."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    phases = {
        "generate": 0.0,
        "score": 0.0,
        "train forward": 0.0,
        "train backward": 0.0,
        "optimizer": 0.0,
    }

    def timed(obj, name: str, phase: str) -> None:
        inner = getattr(obj, name)

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                phases[phase] += time.perf_counter() - t0

        setattr(obj, name, wrapper)

    timed(trainer, "_generate_single_turn", "generate")
    timed(trainer, "_calculate_rewards", "score")
    timed(trainer, "compute_loss", "train forward")
    timed(trainer.accelerator, "backward", "train backward")
    started: list[float] = []
    register_optimizer_step_pre_hook(lambda *_: started.append(time.perf_counter()))

    def post(*_):
        phases["optimizer"] += time.perf_counter() - started.pop()

    register_optimizer_step_post_hook(post)
    return phases


def _loomrl_phases(run_dir: Path, steps: int) -> dict[str, float]:
    """Seconds per step of each phase, from the run's metrics and summary (executor phases
    overlap in async mode)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "train/loss" in r]
    summary = json.loads((run_dir / "summary.json").read_text())

    def total(key: str) -> float:
        return sum(r.get(key, 0.0) for r in records) / steps

    return {
        "generate": summary["generator_busy_s"] / steps,
        "train forward": total("timing/train_forward_s"),
        "train backward": total("timing/train_backward_s"),
        "optimizer": total("timing/train_optimizer_s"),
        "publish": total("timing/publish_s"),
        "trainer busy": summary["trainer_busy_s"] / steps,
        "wait for batch": total("timing/wait_for_batch_s"),
    }


def run_loomrl(system: str, args: argparse.Namespace, out: Path) -> dict:
    import logging

    from loomrl.job import Job

    logging.disable(logging.INFO)
    mode, runtime, *pinned = system.split("-")
    overrides = [
        *(FP32 if pinned else []),
        f"generation.max_new_tokens={args.new_tokens}",
        f'task.reward="examples.arithmetic.reward:{args.reward}"',
        f'model.path="{args.model}"',
        f'runtime="{runtime}"',
        f"seed={args.seed}",
        f"algorithm.max_staleness={0 if mode == 'sync' else 1}",
        f"trainer.num_steps={args.steps}",
        f"algorithm.groups_per_step={args.groups_per_step}",
        f'output_dir="{out}"',
        "eval.every_steps=100000",
        "checkpoint.every_steps=100000",
        "data.max_eval_examples=8",
    ]
    t0 = time.perf_counter()
    result = Job.from_toml(DATA / "job.toml", overrides).run()
    wall = time.perf_counter() - t0
    run_dir = Path(result.summary["run_dir"])
    return {
        "wall_s": wall,
        "loop_s": result.summary["elapsed_s"],
        "completions": result.summary["trained"],
        "final": run_dir / "final",
        "phases": _loomrl_phases(run_dir, args.steps),
        "executor_rss_mb": result.summary["peak_rss_mb"],
        "controller_overhead": result.summary["controller_overhead"],
        "precision": result.summary["precision"]["trainer_precision"],
        "steady_s_per_step": _steady_s_per_step(run_dir),
    }


def _steady_s_per_step(run_dir: Path) -> float | None:
    """Seconds a step after the first (its warm-up: traces, kernels chosen), from the
    records' cumulative ``timing/elapsed_s``."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    t = [r["timing/elapsed_s"] for r in map(json.loads, lines) if "train/loss" in r]
    return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None


def child(system: str, args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        r = (
            run_trl(args, Path(tmp), bf16=system == "trl-bf16")
            if system.startswith("trl")
            else run_loomrl(system, args, Path(tmp) / "run")
        )
        accuracy = float("nan") if args.skip_accuracy else final_accuracy(r["final"])
    rss_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rss_children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "wall_s": r["wall_s"],
                "loop_s": r["loop_s"],
                "completions": r["completions"],
                "accuracy": accuracy,
                "rss_mb": rss_self,
                "child_rss_mb": rss_children,
                "phases": r["phases"],
                "executor_rss_mb": r.get("executor_rss_mb"),
                "controller_overhead": r.get("controller_overhead"),
                "precision": r["precision"],
                "steady_s_per_step": r["steady_s_per_step"],
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--groups-per-step", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each system")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", default="trl,trl-bf16,sync-local,async-local,async-process")
    parser.add_argument("--new-tokens", type=int, default=4, help="completion length (max)")
    parser.add_argument("--reward", choices=["exact_match", "digits"], default="exact_match")
    parser.add_argument("--skip-accuracy", action="store_true", help="no held-out evaluation")
    parser.add_argument(
        "--model",
        default=".cache/arithmetic-warmstart",
        help="warm-started model folder (python -m examples.arithmetic.warmstart builds it)",
    )
    parser.add_argument(
        "--json", type=Path, help='also write {"results": per system, "matmul_rates": per repeat}'
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model = str(Path(args.model).resolve())
    if args.child:
        child(args.child, args)
        return
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    if not Path(args.model, "config.json").is_file():
        parser.error(
            f"no model at {args.model}; build it with: python -m examples.arithmetic.warmstart"
        )
    results: dict[str, list[dict]] = {s: [] for s in systems}
    rates: list[float] = []  # the matmul rate, probed once a repeat (between systems, like them)
    for rep in range(args.repeats):  # interleaved, so the machine's noise hits every system
        rates.append(
            matmul_rate(Path(args.model), rows=args.groups_per_step * 8 * 11, threads=args.threads)
        )
        print(
            f"repeat {rep} fp32 matmul rate at the model's shapes: {rates[-1] / 1e9:.1f} GFLOP/s",
            flush=True,
        )
        for system in systems:
            cmd = [
                sys.executable,
                __file__,
                "--child",
                system,
                "--steps",
                str(args.steps),
                "--threads",
                str(args.threads),
                "--seed",
                str(args.seed),
                "--groups-per-step",
                str(args.groups_per_step),
                "--model",
                args.model,
                "--new-tokens",
                str(args.new_tokens),
                "--reward",
                args.reward,
                *(["--skip-accuracy"] if args.skip_accuracy else []),
            ]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{system} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            results[system].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            r = results[system][-1]
            print(
                f"repeat {rep} {system}: {r['completions'] / r['loop_s']:.0f} completions/s "
                f"({r['completions'] / r['wall_s']:.0f} with start-up), "
                f"accuracy {r['accuracy']:.1%}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps({"results": results, "matmul_rates": rates}, indent=2))
    report(results, args, rates)


def report(results: dict[str, list[dict]], args: argparse.Namespace, rates: list[float]) -> None:
    """The tables. MFU is against the fastest matmul rate probed in the run: a probe that
    ran at a slow moment of the machine would otherwise overstate it (over 100% once, when
    a single probe at the end read 90 GFLOP/s on a machine that read 152 GFLOP/s minutes before)."""
    from rich.console import Console
    from rich.table import Table

    prompt_len = statistics.mean(len(r["prompt"]) + 1 for r in _rows("train.jsonl"))  # + BOS
    flops = model_flops_per_completion(Path(args.model), round(prompt_len), args.new_tokens)
    rate = max(rates)

    def med(system: str, key) -> float:
        return statistics.median(key(r) for r in results[system])

    cps = {s: med(s, lambda r: r["completions"] / r["loop_s"]) for s in results}
    cps_e2e = {s: med(s, lambda r: r["completions"] / r["wall_s"]) for s in results}
    base, base_bf16 = cps.get("trl"), cps.get("trl-bf16")
    table = Table(
        title=f"loomrl vs TRL GRPOTrainer: {args.steps} steps x {args.groups_per_step * 8} completions, "
        f"{args.threads} threads, median of {args.repeats}"
    )
    for col in (
        "system",
        "completions/s",
        f"tokens/s (<={args.new_tokens} each)",
        "precision",
        "vs TRL",
        "vs TRL bf16",
        "MFU (fp32 peak)",
        "with start-up",
        "held-out acc",
        "peak RSS MB",
    ):
        table.add_column(col, justify="right")
    for s in results:
        rss = med(s, lambda r: max(r["rss_mb"], r["child_rss_mb"]))
        table.add_row(
            s,
            f"{cps[s]:.0f}",
            f"{args.new_tokens * cps[s]:.0f}",
            results[s][0]["precision"],
            f"{cps[s] / base:.2f}x" if base else "-",
            f"{cps[s] / base_bf16:.2f}x" if base_bf16 else "-",
            f"{cps[s] * flops / rate:.0%}",
            f"{cps_e2e[s]:.0f} ({cps_e2e[s] / cps_e2e['trl']:.2f}x)"
            if base
            else f"{cps_e2e[s]:.0f}",
            f"{med(s, lambda r: r['accuracy']):.1%}",
            f"{rss:.0f}",
        )
    console = Console(width=max(Console().width, 120))
    console.print(table)
    phases = sorted({p for s in results for p in results[s][0]["phases"]}, key=PHASE_ORDER.index)
    by_phase = Table(
        title="seconds per step in each phase (median; loomrl's executors overlap in async mode)"
    )
    for col in ("system", *phases, "wall"):
        by_phase.add_column(col, justify="right")
    for s in results:
        cells = [
            f"{med(s, lambda r, p=p: r['phases'][p]):.3f}" if p in results[s][0]["phases"] else "-"
            for p in phases
        ]
        by_phase.add_row(s, *cells, f"{med(s, lambda r: r['loop_s']) / args.steps:.3f}")
    console.print(by_phase)
    for s in results:
        if results[s][0].get("executor_rss_mb"):
            rss = {
                name: med(s, lambda r, n=name: r["executor_rss_mb"][n])
                for name in results[s][0]["executor_rss_mb"]
            }
            console.print(
                f"{s}: controller loop overhead {med(s, lambda r: r['controller_overhead']):.1%} of wall; "
                "peak RSS MB " + ", ".join(f"{name} {mb:.0f}" for name, mb in rss.items())
            )
    console.print(
        f"model FLOPs per completion {flops / 1e6:.1f} M; fp32 matmul rate at the model's shapes "
        f"{rate / 1e9:.1f} GFLOP/s on {args.threads} threads (the fastest of {len(rates)} probes, one a "
        f"repeat: {', '.join(f'{r / 1e9:.1f}' for r in rates)}); machine limit "
        f"~{rate / flops:.0f} completions/s"
    )
    over = [s for s in results if cps[s] * flops > rate and results[s][0]["precision"] == "fp32"]
    if over:
        console.print(
            f"[yellow]warning: MFU over 100% for {', '.join(over)}: every matmul probe ran slower than "
            "the systems did (a noisy machine); rerun with more repeats[/yellow]"
        )


if __name__ == "__main__":
    main()
