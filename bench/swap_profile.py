"""What one swap (offload + restore) of bench/timeslice_job.py's state costs, alone.

Builds the bench job's policy and Trainer, takes a train step between swaps (as the job
does: the gradients dropped after it), and prints medians over ``--swaps``: offload and
restore milliseconds, the bytes moved and copied, the page faults of a restore, how much
resident memory an offload frees, and the faults of the train step after a swap against
one after none (what a lazy restore would leave to the phase).

    flock /tmp/loomrl-bench.lock python bench/swap_profile.py --core 1
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from timeslice_job import GROUP_SIZE, MODEL  # noqa: E402

from loomrl.config import AlgorithmConfig, TrainerConfig  # noqa: E402
from loomrl.device.offload import offload, restore  # noqa: E402
from loomrl.models import load_model_and_tokenizer  # noqa: E402
from loomrl.training.trainer import Trainer  # noqa: E402
from loomrl.types import Group, Rollout  # noqa: E402


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--swaps", type=int, default=40)
    p.add_argument(
        "--groups",
        type=int,
        default=8,
        help="prompts per step (x4 rollouts), as the bench's 1x job",
    )
    p.add_argument("--core", type=int, help="run on this core only")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})
    model, tok = load_model_and_tokenizer(MODEL, seed=0)
    trainer = Trainer(
        model,
        tok,
        AlgorithmConfig(group_size=GROUP_SIZE),
        TrainerConfig(lr=1e-4, micro_batch_size=64),
        1.0,
    )
    gen = torch.Generator().manual_seed(0)

    def train_step() -> int:  # the minor faults it took
        groups = [
            Group.of_rollouts(
                g,
                0,
                [
                    Rollout(
                        g,
                        [3, 4, 5, 6, 7, 8],
                        torch.randint(3, model.config.vocab_size, (16,), generator=gen).tolist(),
                        [-1.0] * 16,
                        [1] * 16,
                        0,
                        reward=float(i % 2),
                    )
                    for i in range(GROUP_SIZE)
                ],
            )
            for g in range(args.groups)
        ]
        before = minor_faults()
        trainer.train_step(groups)
        trainer.optimizer.zero_grad(set_to_none=True)
        return minor_faults() - before

    train_step()
    first = offload(trainer.model, trainer.optimizer)
    first_s, num_mappings = first.seconds, len(first.mappings)
    first_restore_s = restore(first)
    rows: dict[str, list[float]] = {
        k: []
        for k in (
            "offload_ms",
            "restore_ms",
            "restore_faults",
            "rss_freed_mb",
            "copied_mb",
            "step_faults_after_swap",
            "step_faults_no_swap",
        )
    }
    for _ in range(args.swaps):
        rows["step_faults_no_swap"].append(train_step())
        rss = rss_bytes()
        state = offload(trainer.model, trainer.optimizer)
        rows["rss_freed_mb"].append((rss - rss_bytes()) / 1e6)
        faults = minor_faults()
        rows["restore_ms"].append(1e3 * restore(state))
        rows["restore_faults"].append(minor_faults() - faults)
        rows["offload_ms"].append(1e3 * state.seconds)
        rows["copied_mb"].append(state.bytes_copied / 1e6)
        rows["step_faults_after_swap"].append(train_step())
    print(
        f"state: {first.bytes_moved / 1e6:.2f} MB in {num_mappings} mappings; first swap (copies it "
        f"into shared memory): offload {1e3 * first_s:.1f} ms, restore {1e3 * first_restore_s:.1f} ms"
    )
    print(f"median of {args.swaps} swaps after it:")
    for key, values in rows.items():
        print(f"  {key:<24} {statistics.median(values):8.2f}")
    print(
        f"  {'swap_ms':<24} {statistics.median(rows['offload_ms']) + statistics.median(rows['restore_ms']):8.2f}"
    )


if __name__ == "__main__":
    main()
