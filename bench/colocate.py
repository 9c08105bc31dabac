"""What colocation (``generation.colocate``) saves and costs: one synchronous job run twice,
without and with colocation, the same model, data and seeds, on the ``local`` runtime (every
executor in this process, so one reading covers them all).

While each job runs, memory is sampled every 50 ms from the end of its first step on
(loading puts both sides' state in memory before the first turn can send one away):
- CUDA: the device memory torch has allocated (``torch.cuda.memory_allocated``), what a user
  with one GPU needs to fit: the peak, and the bench's point.
- CPU: this process's resident memory and, beside it, the system's shared memory
  (``Shmem`` in ``/proc/meminfo``, relative to before the job). On a CPU the host *is* the
  device: an offloaded tensor leaves the process's resident set but stays in a shared-memory
  file in RAM (``loomrl.device.offload``), so resident memory falls and resident + shared
  does not. On a CPU colocation saves no memory; it is there for tests and for one-device
  setups, and this table says what its turns cost.

The table also gives the median step time from the run's metrics, the turns' cost per step
(``colocate/offload_s + restore_s``) and whether the losses are identical step for step
(offload and restore are exact, so they must be). The model is built from a config (nothing
downloaded); the prompts are the arithmetic demo's, scored by partial credit (``digits``).

    python bench/colocate.py                                      # 100M parameters, 6 steps
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


def shmem_mib() -> float:
    """The system's shared memory (tmpfs, shared mappings), MiB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) / 1024
    return 0.0


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Sampler:
    """Peaks of the readings above from the end of the first step on, every ``every_s``."""

    def __init__(self, cuda: bool, every_s: float = 0.05) -> None:
        self.cuda, self.every_s = cuda, every_s
        self.peaks = {"device": 0.0, "rss": 0.0, "rss_plus_shmem": 0.0}
        self.shmem0 = shmem_mib()
        self.first_step_done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def on_record(self, record) -> None:
        if "train/loss" in record:
            self.first_step_done.set()

    def _read(self) -> dict[str, float]:
        if self.cuda:
            import torch

            return {"device": torch.cuda.memory_allocated() / 2**20}
        rss = rss_mib()
        return {"rss": rss, "rss_plus_shmem": rss + shmem_mib() - self.shmem0}

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.first_step_done.is_set():
                for key, value in self._read().items():
                    self.peaks[key] = max(self.peaks[key], value)
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
        runtime="local",
        model={"path": model, "device": args.device},
        task={"reward": "examples.arithmetic.reward:digits"},  # partial credit: it learns
        generation={"colocate": colocate, "max_new_tokens": 4, "prompts_per_request": 8},
        algorithm={"group_size": 8, "groups_per_step": 8, "max_staleness": 0},
        trainer={"num_steps": args.steps, "lr": 1e-5, "micro_batch_size": 64},
        checkpoint={"every_steps": 10_000},
    )
    return build_config(raw)


def run_one(args: argparse.Namespace, out: Path, colocate: bool, cuda: bool) -> dict:
    from loomrl.job import Job
    from loomrl.telemetry.metrics import read_metrics

    cfg = job_config(args, out, colocate)
    with Sampler(cuda) as sampler:
        result = Job(cfg).run(on_record=sampler.on_record)
    records = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    step_s = [r["timing/step_s"] for r in records]
    last = records[-1]
    turns = last.get("colocate/offload_s", 0.0) + last.get("colocate/restore_s", 0.0)
    return {
        "colocate": colocate,
        **{f"peak_{k}_mib": v for k, v in sampler.peaks.items()},
        "step_s": statistics.median(step_s[1:] or step_s),  # the first step also warms up
        "turns_s_per_step": turns / len(records),
        "switches": last.get("colocate/switches", 0.0),
        "losses": [r["train/loss"] for r in records],
    }


def report(rows: list[dict], params: int, args: argparse.Namespace, cuda: bool) -> None:
    base = rows[0]
    keys = ["peak_device_mib"] if cuda else ["peak_rss_mib", "peak_rss_plus_shmem_mib"]
    names = {
        "peak_device_mib": "peak CUDA memory MiB",
        "peak_rss_mib": "peak RSS MiB",
        "peak_rss_plus_shmem_mib": "peak RSS + shmem MiB",
    }
    print(
        f"\nsynchronous job, local runtime, {params / 1e6:.1f}M parameters fp32 on "
        f"{'cuda' if cuda else 'cpu'}, {args.steps} steps, one trainer + one generator"
    )
    head = " | ".join(f"{names[k]} | vs plain" for k in keys)
    print(f"| colocate | {head} | median step s | vs plain | turns s/step | switches |")
    print("|---" * (5 + 2 * len(keys)) + "|")
    for r in rows:
        mem = " | ".join(f"{r[k]:.0f} | {r[k] / max(base[k], 1e-9):.2f}x" for k in keys)
        print(
            f"| {r['colocate']} | {mem} | {r['step_s']:.2f} | {r['step_s'] / base['step_s']:.2f}x "
            f"| {r['turns_s_per_step']:.2f} | {r['switches']:.0f} |"
        )
    print(f"\nlosses identical step for step: {rows[0]['losses'] == rows[1]['losses']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--device", default="auto", help="model.device: auto, cpu or cuda")
    p.add_argument("--json", type=Path, help="write the rows here too")
    args = p.parse_args()
    import torch

    from loomrl.models import load_model_and_tokenizer

    cuda = args.device != "cpu" and torch.cuda.is_available()
    probe = job_config(args, Path(tempfile.mkdtemp(prefix="loomrl-coloc-")), False)
    model, _ = load_model_and_tokenizer(probe.model.path, seed=0)
    params = sum(t.numel() for t in model.parameters())
    del model
    rows = []
    with tempfile.TemporaryDirectory(prefix="loomrl-coloc-") as tmp:
        for colocate in (False, True):
            rows.append(run_one(args, Path(tmp) / str(colocate), colocate, cuda))
            time.sleep(1.0)  # the first job's memory handed back before the second starts
    report(rows, params, args, cuda)
    if args.json:
        args.json.write_text(json.dumps({"params": params, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
