"""What colocation (``generation.colocate``) saves and costs: one synchronous job run twice
on the ``process`` runtime, without and with colocation, the same model, data and seeds.

While each job runs, the resident memory of its executor processes (trainer, generators,
scorers: every process below this one) is sampled every 50 ms; the table gives the peak of
their sum, the device a colocated job shares, measured on a CPU as resident memory (on CUDA
the same job's trainer and generators would share the GPU's memory, which this does not
read), the median step time from the run's metrics and the turns' cost per step
(``colocate/offload_s + restore_s`` over the steps). The model is built from a config
(nothing downloaded); the data are the arithmetic demo's rows.

    python bench/colocate.py                          # ~60M parameters, 6 steps
    python bench/colocate.py --hidden 256 --layers 2 --steps 4   # seconds

The baseline is the same job without colocation, run in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def descendants_rss_mib(pid: int) -> float:
    """Resident memory of every process below ``pid``, summed (MiB)."""
    import psutil

    total = 0
    for child in psutil.Process(pid).children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:  # ended between the listing and the read
            pass
    return total / 2**20


class Sampler:
    """The peak of ``descendants_rss_mib`` while it runs, read every ``every_s``: over the
    whole run (``peak``), and from the end of the first step on (``steady``: loading puts
    every executor's state in memory before the first turn can send one side away)."""

    def __init__(self, every_s: float = 0.05) -> None:
        self.every_s, self.peak, self.steady = every_s, 0.0, 0.0
        self.first_step_done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def on_record(self, record) -> None:
        if "train/loss" in record:
            self.first_step_done.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            rss = descendants_rss_mib(os.getpid())
            self.peak = max(self.peak, rss)
            if self.first_step_done.is_set():
                self.steady = max(self.steady, rss)
            self._stop.wait(self.every_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def job_config(args: argparse.Namespace, out: Path, colocate: bool):
    from loomrl.config import build_config

    from conftest import tiny_job_raw

    rows = [json.loads(line) for line in (ROOT / "examples/arithmetic/train.jsonl").open()]
    out.mkdir(parents=True, exist_ok=True)
    train = out / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:2000]))
    model = (
        f"tiny:llama?hidden_size={args.hidden}&num_layers={args.layers}"
        f"&num_heads={args.hidden // 64}&intermediate_size={args.hidden * 8 // 3 // 64 * 64}"
    )
    raw = tiny_job_raw(
        out,
        train,
        output_dir=str(out / ("colocated" if colocate else "plain")),
        runtime="process",
        model={"path": model},
        task={"reward": "examples.arithmetic.reward:exact_match"},
        generation={"colocate": colocate, "max_new_tokens": 4, "prompts_per_request": 8},
        algorithm={"group_size": 8, "groups_per_step": 8, "max_staleness": 0},
        trainer={"num_steps": args.steps, "lr": 1e-5, "micro_batch_size": 64},
        checkpoint={"every_steps": 10_000},
    )
    return build_config(raw)


def run_one(args: argparse.Namespace, out: Path, colocate: bool) -> dict:
    from loomrl.job import Job
    from loomrl.telemetry.metrics import read_metrics

    cfg = job_config(args, out, colocate)
    t0 = time.perf_counter()
    with Sampler() as sampler:
        result = Job(cfg).run(on_record=sampler.on_record)
    wall = time.perf_counter() - t0
    records = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    step_s = [r["timing/step_s"] for r in records if "timing/step_s" in r]
    last = records[-1]
    turns = last.get("colocate/offload_s", 0.0) + last.get("colocate/restore_s", 0.0)
    return {
        "colocate": colocate,
        "peak_rss_mib": sampler.peak,
        "steady_rss_mib": sampler.steady,
        "step_s": statistics.median(step_s[1:] or step_s),  # the first step also warms up
        "turns_s_per_step": turns / len(records),
        "switches": last.get("colocate/switches", 0.0),
        "wall_s": wall,
        "losses": [r["train/loss"] for r in records],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--json", type=Path, help="write the rows here too")
    args = p.parse_args()
    from loomrl.models import load_model_and_tokenizer

    probe = job_config(args, Path(tempfile.mkdtemp(prefix="loomrl-coloc-")), False)
    model, _ = load_model_and_tokenizer(probe.model.path, seed=0)
    params = sum(t.numel() for t in model.parameters())
    del model
    rows = []
    with tempfile.TemporaryDirectory(prefix="loomrl-coloc-") as tmp:
        for colocate in (False, True):
            rows.append(run_one(args, Path(tmp) / str(colocate), colocate))
    base = rows[0]
    print(
        f"\nsynchronous job, process runtime, {params / 1e6:.1f}M parameters fp32, "
        f"{args.steps} steps, one trainer + one generator + one scorer"
    )
    print(
        "| colocate | peak RSS of executors MiB | vs plain | median step s | vs plain | turns s/step | switches |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['colocate']} | {r['peak_rss_mib']:.0f} | {r['peak_rss_mib'] / base['peak_rss_mib']:.2f}x "
            f"| {r['step_s']:.2f} | {r['step_s'] / base['step_s']:.2f}x | {r['turns_s_per_step']:.2f} "
            f"| {r['switches']:.0f} |"
        )
    same = rows[0]["losses"] == rows[1]["losses"]
    print(f"\nlosses identical step for step: {same}")
    if args.json:
        args.json.write_text(json.dumps({"params": params, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
