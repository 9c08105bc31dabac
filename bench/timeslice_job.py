"""One RL job for bench/timeslice.py: a tiny policy that samples completions (generate,
on the device), waits for a multi-turn environment's tool calls (off the device), and
trains on the scored rollouts with loomrl's Trainer (train, on the device). Each device
phase runs in a lease of the scheduler; the model and AdamW state are offloaded when
another job takes the device.

    python bench/timeslice_job.py --url URL --name a --sync DIR [--groups 2 --tool-s 0.4]

It warms up, writes DIR/NAME.ready, waits for DIR/go (start and end times), runs until
the end time and writes DIR/NAME.json: every lease (requested, granted, body start/end,
released, restore/offload seconds) and every finished cycle.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from loomrl.config import AlgorithmConfig, TrainerConfig  # noqa: E402
from loomrl.device.offload import Swappable  # noqa: E402
from loomrl.models import load_model_and_tokenizer  # noqa: E402
from loomrl.scheduler.client import SchedulerClient  # noqa: E402
from loomrl.training.trainer import Trainer  # noqa: E402
from loomrl.types import Group, Rollout  # noqa: E402

MODEL = "tiny:llama?hidden_size=128&num_layers=4&num_heads=4&intermediate_size=256"
GROUP_SIZE = 4


def sample(model, prompts: torch.Tensor, new_tokens: int, gen: torch.Generator):
    """Plain sampling, one forward pass per token: ids [n, new] and log-probs [n, new]."""
    ids, logps = prompts, []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(input_ids=ids).logits[:, -1, :].float()
            probs = torch.softmax(logits, -1)
            nxt = torch.multinomial(probs, 1, generator=gen)
            logps.append(torch.log(probs.gather(-1, nxt)))
            ids = torch.cat([ids, nxt], dim=1)
    return ids[:, prompts.shape[1] :], torch.cat(logps, dim=1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--sync", required=True, type=Path)
    p.add_argument("--groups", type=int, default=4, help="prompts per step (x4 rollouts)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument(
        "--tool-s", type=float, default=0.4, help="the environment's tool calls per step"
    )
    p.add_argument("--heartbeat-s", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model, tok = load_model_and_tokenizer(MODEL, seed=args.seed)
    trainer = Trainer(
        model,
        tok,
        AlgorithmConfig(group_size=GROUP_SIZE),
        TrainerConfig(lr=1e-4, micro_batch_size=64),
        1.0,
    )
    client = SchedulerClient(
        args.url, args.name, heartbeat_timeout_s=10.0, heartbeat_interval_s=args.heartbeat_s
    )
    client.attach(Swappable(trainer.model, trainer.optimizer))
    gen = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    leases: list[dict] = []

    def phase(name: str, fn):
        t_req = time.time()
        stats0 = dict(client.stats)
        with client.lease("cpu0", name) as lease:
            t_body = time.time()
            out = fn()
            t_end = time.time()
        t_rel = time.time()
        leases.append(
            {
                "phase": name,
                "requested": t_req,
                "body_start": t_body,
                "body_end": t_end,
                "released": t_rel,
                "restore_s": lease.restore_s,
                "offload_s": client.stats["offload_s"] - stats0["offload_s"],
            }
        )
        return out

    def cycle(step: int) -> None:
        prompts = torch.randint(3, vocab, (args.groups * GROUP_SIZE, 6), generator=gen)
        completion, logp = phase(
            "generate", lambda: sample(trainer.model, prompts, args.new_tokens, gen)
        )
        time.sleep(args.tool_s)  # the environment's tool calls: off the device
        rewards = torch.rand(len(prompts), generator=gen).round().tolist()
        groups = [
            Group.of_rollouts(
                g,
                0,
                [
                    Rollout(
                        g,
                        prompts[i].tolist(),
                        completion[i].tolist(),
                        logp[i].tolist(),
                        [1] * args.new_tokens,
                        step,
                        reward=rewards[i],
                    )
                    for i in range(g * GROUP_SIZE, (g + 1) * GROUP_SIZE)
                ],
            )
            for g in range(args.groups)
        ]

        def train() -> None:
            trainer.train_step(groups)
            # the gradients are dead once the step is taken (the next step starts with
            # zero_grad): drop them now, so an eviction does not move them
            trainer.optimizer.zero_grad(set_to_none=True)

        phase("train", train)

    cycle(0)  # warm up (allocations, first passes) before the measured window
    leases.clear()
    (args.sync / f"{args.name}.ready").write_text("ok")
    go = args.sync / "go"
    while not go.exists():
        time.sleep(0.02)
    start, end = json.loads(go.read_text())
    while time.time() < start:
        time.sleep(0.005)
    offload_before = client.stats["offload_s"]
    cycles, step = [], 1
    while time.time() < end:
        cycle(step)
        cycles.append(time.time())
        step += 1
    client.close()
    out = {
        "name": args.name,
        "groups": args.groups,
        "tool_s": args.tool_s,
        "leases": leases,
        "cycles": cycles,
        "offload_s_total": client.stats["offload_s"] - offload_before,
        "rollouts_per_cycle": args.groups * GROUP_SIZE,
    }
    (args.sync / f"{args.name}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
