"""Offload and restore for time-slicing: the trainer's next step is bit-identical to one
that never left the device, and the process's resident memory really falls meanwhile."""

from __future__ import annotations

import os

import torch

from loomrl.config import AlgorithmConfig, TrainerConfig
from loomrl.models import load_model_and_tokenizer
from loomrl.scheduler.offload import Swappable, offload, restore
from loomrl.training.trainer import Trainer
from loomrl.types import Group, Rollout

# big enough (~3M parameters: ~45 MB with grads and AdamW moments) for RSS to show it
MODEL = "tiny:llama?hidden_size=256&num_layers=4&num_heads=4&intermediate_size=512"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def groups(step: int) -> list[Group]:
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0]]
    return [Group(i, 0, [Rollout(i, [1, 2, 3 + i], [4 + step, 5, 6], [-1.0, -1.2, -0.8], [1, 1, 1], step, reward=r)
                         for r in rs]) for i, rs in enumerate(rewards)]  # fmt: skip


def trainer() -> Trainer:
    model, tok = load_model_and_tokenizer(MODEL, seed=0)
    return Trainer(model, tok, AlgorithmConfig(), TrainerConfig(lr=1e-3), 1.0)


def snapshot(t: Trainer) -> dict[str, torch.Tensor]:
    out = {f"p/{n}": p.detach().clone() for n, p in t.model.named_parameters()}
    out.update({f"g/{n}": p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None})
    for i, state in enumerate(t.optimizer.state.values()):
        out.update({f"o/{i}/{k}": v.clone() for k, v in state.items()})
    return out


def test_offload_restore_keeps_the_next_step_bit_identical_and_frees_memory(tmp_path):
    torch.manual_seed(0)
    moved, kept = trainer(), trainer()
    for t in (moved, kept):
        t.train_step(groups(0))
    before = snapshot(moved)
    assert any(k.startswith("g/") for k in before) and any(k.startswith("o/") for k in before)
    rss_before = rss_bytes()
    state = offload(moved.model, moved.optimizer, directory=str(tmp_path))
    rss_after = rss_bytes()
    assert state.bytes_moved > 30e6
    assert rss_before - rss_after > 0.5 * state.bytes_moved, (rss_before, rss_after, state.bytes_moved)
    assert all(p.numel() == 0 and p.grad is None for p in moved.model.parameters())
    restore(state)
    assert not list(tmp_path.iterdir())  # the offload file is gone
    after = snapshot(moved)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    # a second round trip: the restored tensors are freed without malloc_trim this time
    rss_before = rss_bytes()
    again = offload(moved.model, moved.optimizer, directory=str(tmp_path))
    assert rss_before - rss_bytes() > 0.5 * again.bytes_moved
    restore(again)
    m1, m2 = moved.train_step(groups(1)), kept.train_step(groups(1))
    assert m1["train/loss"] == m2["train/loss"] and m1["train/grad_norm"] == m2["train/grad_norm"]
    for (name, p), q in zip(moved.model.named_parameters(), kept.model.parameters()):
        assert torch.equal(p, q), name
    moved.model.save_pretrained(tmp_path / "final")  # restored tensors share no storage


def test_swappable_generator_model_round_trips(tmp_path):
    model, _ = load_model_and_tokenizer("tiny:llama?hidden_size=32&num_layers=2&num_heads=2&intermediate_size=64")
    model.eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
    swap = Swappable(model, directory=str(tmp_path))
    assert swap.offload() > 0 and swap.offloaded
    assert swap.offload() == 0.0  # offloading twice is a no-op
    swap.restore()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)
