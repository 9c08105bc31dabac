"""Offload and restore for time-slicing: the trainer's next step is bit-identical to one
that never left the device, and the process's resident memory really falls meanwhile."""

from __future__ import annotations

import gc
import os

import torch

from loomrl.config import AlgorithmConfig, TrainerConfig
from loomrl.device import offload as offload_module
from loomrl.device.offload import OffloadedState, Swappable, offload, restore
from loomrl.models import load_model_and_tokenizer
from loomrl.training.trainer import Trainer
from loomrl.types import Group, Rollout

# big enough (~3M parameters: ~45 MB with grads and AdamW moments) for RSS to show it
MODEL = "tiny:llama?hidden_size=256&num_layers=4&num_heads=4&intermediate_size=512"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def groups(step: int) -> list[Group]:
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


def trainer() -> Trainer:
    model, tok = load_model_and_tokenizer(MODEL, seed=0)
    return Trainer(model, tok, AlgorithmConfig(), TrainerConfig(precision="fp32", lr=1e-3), 1.0)


def snapshot(t: Trainer) -> dict[str, torch.Tensor]:
    out = {f"p/{n}": p.detach().clone() for n, p in t.model.named_parameters()}
    out.update(
        {f"g/{n}": p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
    )
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
    assert rss_before - rss_after > 0.5 * state.bytes_moved, (
        rss_before,
        rss_after,
        state.bytes_moved,
    )
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
    model, _ = load_model_and_tokenizer(
        "tiny:llama?hidden_size=32&num_layers=2&num_heads=2&intermediate_size=64"
    )
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


def status_bytes(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS, RssShmem)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def mapped_bytes() -> int:
    """Resident pages of file and shared-memory mappings (the offload file is either)."""
    return status_bytes("RssFile") + status_bytes("RssShmem")


def offload_mappings(directory) -> int:
    """How many of this process's mappings are offload files in ``directory``."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if f"{directory}/loomrl-offload-" in line)


def test_repeated_swaps_copy_nothing_drop_the_pages_and_keep_training_bit_identical(tmp_path):
    torch.manual_seed(0)
    moved, kept = trainer(), trainer()
    swap = Swappable(moved.model, moved.optimizer, directory=str(tmp_path))
    for step in range(5):
        for t in (moved, kept):
            t.train_step(groups(step))
            t.optimizer.zero_grad(set_to_none=True)  # as the bench job does: no gradients move
        before = snapshot(moved)
        rss, mapped = status_bytes("VmRSS"), mapped_bytes()
        swap.offload()
        state = swap._state
        assert not list(tmp_path.iterdir())  # the file is unlinked: nothing to leave behind
        if step == 0:
            assert state.bytes_copied == state.bytes_moved > 30e6  # the first offload copies once
        else:
            assert state.bytes_copied == 0  # later ones copy nothing ...
            # ... and still take the pages out of the process (they stay in the tmpfs file)
            assert mapped - mapped_bytes() > 0.9 * state.bytes_moved, (mapped, state.bytes_moved)
        assert rss - status_bytes("VmRSS") > 0.5 * state.bytes_moved
        assert all(p.numel() == 0 for p in moved.model.parameters())
        mapped_off = mapped_bytes()
        swap.restore()
        # restore maps the pages back, so it pays the faults
        if offload_module._populate["supported"]:
            assert mapped_bytes() - mapped_off > 0.9 * state.bytes_moved
        after = snapshot(moved)
        assert before.keys() == after.keys() and all(
            torch.equal(before[k], after[k]) for k in before
        )
    m1, m2 = moved.train_step(groups(9)), kept.train_step(groups(9))
    assert m1["train/loss"] == m2["train/loss"] and m1["train/grad_norm"] == m2["train/grad_norm"]
    for (name, p), q in zip(moved.model.named_parameters(), kept.model.parameters()):
        assert torch.equal(p, q), name


def small_module_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.LayerNorm(256), torch.nn.Linear(256, 8)
    )
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    module(torch.randn(4, 64)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return module, optimizer


def round_trip(module, optimizer, directory) -> OffloadedState:
    state = offload(module, optimizer, directory=str(directory))
    assert all(p.numel() == 0 for p in module.parameters())
    restore(state)
    return state


def test_a_tensor_changed_since_the_last_restore_comes_back_changed(tmp_path):
    module, optimizer = small_module_and_optimizer()
    round_trip(module, optimizer, tmp_path)  # everything is in shared memory from here on
    first, last = module[0].weight, module[2].bias
    first.data.mul_(3.0)  # changed in place: lives in the mapping, nothing to copy
    want_first = first.detach().clone()
    new_bias = torch.randn(8)
    last.data = new_bias.clone()  # replaced: a tensor not in shared memory yet
    moment = optimizer.state[first]["exp_avg"]
    moment.add_(1.0)
    want_moment = moment.clone()
    module(torch.randn(4, 64)).sum().backward()  # gradients appear: new tensors too
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    state = round_trip(module, optimizer, tmp_path)
    assert state.bytes_copied == new_bias.nbytes + sum(g.nbytes for g in grads.values())
    assert torch.equal(first, want_first) and torch.equal(last, new_bias)
    assert torch.equal(optimizer.state[first]["exp_avg"], want_moment)
    assert all(torch.equal(p.grad, grads[n]) for n, p in module.named_parameters())
    state = round_trip(module, optimizer, tmp_path)  # and now all of it stays put
    assert state.bytes_copied == 0
    assert torch.equal(last, new_bias) and all(
        torch.equal(p.grad, grads[n]) for n, p in module.named_parameters()
    )


def test_the_shared_memory_goes_with_the_tensors(tmp_path):
    module, optimizer = small_module_and_optimizer()
    module(torch.randn(4, 64)).sum().backward()  # gradients at the first offload, with the weights
    swap = Swappable(module, optimizer, directory=str(tmp_path))
    for _ in range(3):
        swap.offload()
        assert not list(tmp_path.iterdir())  # unlinked at once: a killed job leaves no file
        swap.restore()
    mappings = offload_mappings(tmp_path)
    assert mappings >= 2
    optimizer.zero_grad(set_to_none=True)  # the gradients' mapping goes with the last gradient
    assert offload_mappings(tmp_path) == mappings - 1
    del module, optimizer, swap
    gc.collect()
    assert offload_mappings(tmp_path) == 0
