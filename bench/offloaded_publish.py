"""What one publish costs while the trainer is offloaded (``generation.colocate``, or a
scheduler that took the device): the seconds it takes and how far it raises the process's
resident memory above the offloaded trainer's, next to the same publish on a trainer that
never left. On a CPU the host is the device, so the resident-memory rise is the bytes the
publish brings back "onto the device" (the peak: ``VmHWM`` reset by ``/proc/self/clear_refs``
before each publish).

One trainer executor (a model built from a config, nothing downloaded), an in-process
weight lane, ``codec = "delta"``: it trains a step and publishes version 1 (a full
snapshot, the delta base), trains a step, offloads, then publishes version 2 as a delta
and, after a restore, a step and an offload, version 3 as a full snapshot.

    python bench/offloaded_publish.py                           # ~60M parameters
    python bench/offloaded_publish.py --hidden 256 --layers 2  # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import time


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def groups(step: int):
    from loomrl.types import Group, Rollout

    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0]]
    return [
        Group.of_rollouts(
            i,
            0,
            [
                Rollout(
                    i,
                    [1, 2, 3 + i],
                    [4 + step, 5, 6],
                    [-1.0, -1.2, -0.8],
                    [1, 1, 1],
                    step,
                    reward=r,
                )
                for r in rs
            ],
        )
        for i, rs in enumerate(rewards)
    ]


def build(args: argparse.Namespace):
    from loomrl.config import AlgorithmConfig, ModelConfig, TrainerConfig
    from loomrl.training.executor import TrainerExecutor, TrainerSetup
    from loomrl.weights.config import WeightSyncConfig
    from loomrl.weights.transports.inproc import InprocTransport

    model = (
        f"tiny:llama?hidden_size={args.hidden}&num_layers={args.layers}"
        f"&num_heads={max(1, args.hidden // 64)}&intermediate_size={args.hidden * 8 // 3 // 64 * 64}"
    )
    setup = TrainerSetup(
        model=ModelConfig(path=model, device="cpu"),
        trainer=TrainerConfig(lr=1e-4),
        algorithm=AlgorithmConfig(kl_coef=args.kl_coef),
        weight_sync=WeightSyncConfig(codec="delta"),
        seed=0,
        temperature=1.0,
        trace=False,
        runtime="local",
    )
    return TrainerExecutor(setup, InprocTransport().sender())


def measure(ex, full: bool) -> dict:
    rss0 = rss_bytes()
    reset_peak()
    t0 = time.perf_counter()
    metrics = ex.publish(full=full)
    seconds = time.perf_counter() - t0
    return {
        "full": full,
        "offloaded": bool(getattr(ex, "_swap", None) is not None and ex._swap.offloaded),
        "publish_s": round(seconds, 4),
        "peak_rss_rise_mib": round((peak_rss_bytes() - rss0) / 2**20, 1),
        "rss_after_minus_before_mib": round((rss_bytes() - rss0) / 2**20, 1),
        "bytes_sent": metrics["weight_sync/bytes_sent"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kl-coef", type=float, default=0.05, help="a KL reference to offload")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    ex = build(args)
    params = sum(p.numel() for p in ex.trainer.model.parameters())
    ex.train_step(groups(0), publish=True)  # v1: a full snapshot, the delta base
    ex.train_step(groups(1))
    rows = [measure(ex, full=False)]  # v2 on the device: the baseline
    ex.train_step(groups(2))
    offload_s = ex.offload()
    rows.append(measure(ex, full=False))  # v3 offloaded, a delta
    ex.restore()
    ex.train_step(groups(3))
    ex.offload()
    rows.append(measure(ex, full=True))  # v4 offloaded, a full snapshot
    state = ex._swap._state
    print(
        json.dumps(
            {
                "parameters": params,
                "offloaded_mib": round(state.bytes_moved / 2**20, 1) if state else None,
                "offload_s": round(offload_s, 4),
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
