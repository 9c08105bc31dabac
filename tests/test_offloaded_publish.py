"""Publishing from an offloaded trainer (``generation.colocate``, a scheduler that took the
device): the update is the one the trainer would publish on its device, bit for bit, while
the gradients, the AdamW state and the KL reference stay away, and the trainer is still
offloaded after it, and comes back bit for bit."""

from __future__ import annotations

import pytest
import torch

from loomrl.config import AlgorithmConfig, ModelConfig, TrainerConfig
from loomrl.device.offload import Swappable, is_placeholder
from loomrl.training.executor import TrainerExecutor, TrainerSetup
from loomrl.weights.config import WeightSyncConfig
from loomrl.weights.transports.base import Sender, TransferStats
from loomrl.weights.transports.tensor import TensorSender
from tests.test_device_offload import groups, snapshot

MODEL = "tiny:llama?hidden_size=64&num_layers=2&num_heads=2&intermediate_size=128"


class Recorder(Sender):
    """A byte lane that keeps every update and calls ``during`` as it sends one (inside the
    publish, while the trainer's state is wherever the publish left it)."""

    def __init__(self) -> None:
        self.stats, self.updates, self.during = TransferStats(), [], None

    def _put(self, update) -> None:
        if self.during is not None:
            self.during(update)
        self.updates.append(update)


class TensorRecorder(Recorder, TensorSender):
    """The tensor lane's sender (packs device tensors), recording the same way."""


def executor(sender: Sender, device: str = "cpu", quantize: str = "none") -> TrainerExecutor:
    setup = TrainerSetup(
        model=ModelConfig(path=MODEL, device=device),
        trainer=TrainerConfig(precision="fp32", lr=1e-3),
        algorithm=AlgorithmConfig(kl_coef=0.05),  # a KL reference, offloaded with the rest
        weight_sync=WeightSyncConfig(codec="delta", publish_quantized=quantize != "none"),
        seed=0,
        temperature=1.0,
        trace=False,
        runtime="local",
        quantize=quantize,  # int8 codes and scales computed from the masters where they are
    )
    return TrainerExecutor(setup, sender)


def full_state(ex: TrainerExecutor) -> dict[str, torch.Tensor]:
    """Model, gradients, AdamW state and KL reference, cloned."""
    out = snapshot(ex.trainer)
    out.update({f"r/{n}": p.detach().clone() for n, p in ex.trainer.reference.named_parameters()})
    return out


def assert_equal_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].cpu(), b[k].cpu()), k


def same_update(a, b) -> None:
    assert (a.version, a.base_version, a.digest) == (b.version, b.base_version, b.digest)
    if hasattr(a, "payload"):  # a byte lane's update
        assert a.header() == b.header() and bytes(a.payload) == bytes(b.payload)
    else:  # the tensor lane's flat buffer
        assert torch.equal(a.flat.cpu(), b.flat.cpu())


def observe_away(ex: TrainerExecutor, seen: list) -> None:
    """While the update is sent: what of the trainer is on hand."""
    t = ex.trainer
    seen.append(
        {
            "optimizer_away": all(
                is_placeholder(v) for s in t.optimizer.state.values() for v in s.values()
            ),
            "grads_away": all(p.grad is None for p in t.model.parameters()),
            "reference_away": all(p.numel() == 0 for p in t.reference.parameters()),
            "params_here": all(p.numel() > 0 for p in t.model.parameters()),
            "kinds_held": {e.kind for e in getattr(ex._swap._state, "entries", [])},
        }
    )


def twins(lane: type[Recorder], device: str = "cpu", quantize: str = "none"):
    """Two executors trained alike to version 2, version 1 published (the delta base)."""
    pair = [executor(lane(), device, quantize), executor(lane(), device, quantize)]
    for ex in pair:
        ex.train_step(groups(0), publish=True)
        ex.train_step(groups(1))
        assert any(p.grad is not None for p in ex.trainer.model.parameters())
    return pair


def check_publish_while_offloaded(moved, kept, full: bool) -> None:
    before = full_state(moved)
    moved.offload()
    seen: list = []
    moved.publisher.sender.during = lambda update: observe_away(moved, seen)
    got = moved.publish(full=full)
    moved.publisher.sender.during = None
    assert len(seen) == 1
    during = seen[0]  # the publish read the parameters and nothing else came back
    assert during["params_here"], during
    assert during["optimizer_away"] and during["grads_away"], during
    assert during["reference_away"], during
    assert {"grad", "optim"} <= during["kinds_held"], during
    want = kept.publish(full=full)
    same_update(moved.publisher.sender.updates[-1], kept.publisher.sender.updates[-1])
    assert got["weight_sync/bytes_sent"] == want["weight_sync/bytes_sent"]
    assert got.get("weight_sync/changed_fraction") == want.get("weight_sync/changed_fraction")
    published = kept.trainer.model.parameters()  # they were read, nothing else
    assert got["weight_sync/offloaded_read_bytes"] == sum(p.nbytes for p in published)
    # still offloaded after it; the publisher's new snapshot too (on a CPU)
    assert moved._swap.offloaded and all(p.numel() == 0 for p in moved.trainer.model.parameters())
    if moved.trainer.device.type == "cpu" and moved.publisher._last is not None:
        assert all(is_placeholder(v) for v in moved.publisher._last.values())
    moved.restore()
    assert_equal_states(full_state(moved), before)


@pytest.mark.parametrize(
    "lane, quantize",
    [(Recorder, "none"), (TensorRecorder, "none"), (Recorder, "int8")],
    ids=["bytes", "tensor", "bytes-int8"],
)
def test_an_offloaded_publish_sends_the_same_bytes_and_leaves_the_optimizer_away(lane, quantize):
    moved, kept = twins(lane, quantize=quantize)
    check_publish_while_offloaded(moved, kept, full=False)  # a delta on a byte lane
    for ex in (moved, kept):
        ex.train_step(groups(2))
    check_publish_while_offloaded(moved, kept, full=True)
    assert moved.publisher.sender.updates[-1].is_full
    if lane is Recorder:
        assert not moved.publisher.sender.updates[-2].is_full  # the first one was a delta
    # the restored trainer trains on exactly as the one that never left
    m1, m2 = moved.train_step(groups(3), publish=True), kept.train_step(groups(3), publish=True)
    assert m1["train/loss"] == m2["train/loss"] and m1["train/grad_norm"] == m2["train/grad_norm"]
    same_update(moved.publisher.sender.updates[-1], kept.publisher.sender.updates[-1])


def test_repeated_offloaded_publishes_keep_one_snapshot_offloaded():
    moved, kept = twins(Recorder)
    moved.offload()
    for version in range(2):  # the same version twice: an all-same delta, then a full one
        same = [ex.publish(full=version == 1) for ex in (moved, kept)]
        assert same[0]["weight_sync/bytes_sent"] == same[1]["weight_sync/bytes_sent"]
        same_update(moved.publisher.sender.updates[-1], kept.publisher.sender.updates[-1])
        swap = moved._snapshot_swap
        assert swap.offloaded and swap.tensor_dicts[0] is moved.publisher._last
    moved.restore()
    assert not moved._snapshot_swap.offloaded
    for name, value in kept.publisher._last.items():
        assert torch.equal(moved.publisher._last[name], value), name


def test_lend_gives_back_only_the_modules_asked_for(tmp_path):
    torch.manual_seed(0)
    model, other = torch.nn.Linear(8, 4), torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW([*model.parameters(), *other.parameters()])
    (other(model(torch.randn(3, 8))).square().sum()).backward()
    optimizer.step()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    swap = Swappable([model, other], optimizer, directory=str(tmp_path))
    with swap.lend(model) as lent:
        assert lent == 0  # not offloaded: nothing to lend
    swap.offload()
    with swap.lend(model) as lent:
        assert lent == sum(t.nbytes for t in want.values())
        for n, p in model.named_parameters():
            assert torch.equal(p, want[n]), n
        assert all(p.numel() == 0 and p.grad is None for p in other.parameters())
        assert all(is_placeholder(v) for s in optimizer.state.values() for v in s.values())
    assert all(p.numel() == 0 for p in model.parameters()) and swap.offloaded
    swap.restore()
    for n, p in model.named_parameters():
        assert torch.equal(p, want[n]) and p.grad is not None, n


def publish_offloaded_then_rewound(ex: TrainerExecutor, during, after_offload=None) -> dict:
    """Publish offloaded (``during`` called as it sends), restore, rewind the publisher and
    publish the same version from the device: one executor, so nothing depends on two
    trainers training alike (CUDA, a LoRA adapter's random init). Checks the restore is
    bit for bit and the two updates are the same; returns the offloaded publish's metrics."""
    pub = ex.publisher
    rewind = {k: getattr(pub, k) for k in ("_last", "_last_version", "_last_digest", "_since_full")}
    if pub._last is not None:  # (the tensor lane keeps none)
        rewind["_last"] = {k: v.clone() for k, v in pub._last.items()}
    before = full_state(ex)
    ex.offload()
    if after_offload is not None:
        after_offload()
    pub.sender.during = during
    metrics = ex.publish()  # a delta on a byte lane
    pub.sender.during = None
    ex.restore()
    assert_equal_states(full_state(ex), before)
    for k, v in rewind.items():
        setattr(pub, k, v)
    ex.publish()  # the same publish, from the device
    same_update(pub.sender.updates[-2], pub.sender.updates[-1])
    return metrics


def test_a_lora_trainer_publishes_its_adapter_from_the_offloaded_copies():
    from loomrl.config import LoraConfig

    lora = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    setup = TrainerSetup(
        model=ModelConfig(path=MODEL, device="cpu", lora=lora),
        trainer=TrainerConfig(precision="fp32", lr=1e-3),
        algorithm=AlgorithmConfig(kl_coef=0.05),
        weight_sync=WeightSyncConfig(codec="delta"),
        seed=0,
        temperature=1.0,
        trace=False,
        runtime="local",
    )
    ex = TrainerExecutor(setup, Recorder())
    ex.train_step(groups(0), publish=True)
    ex.train_step(groups(1))
    seen: list = []
    metrics = publish_offloaded_then_rewound(ex, lambda update: observe_away(ex, seen))
    assert not ex.publisher.sender.updates[-1].is_full
    assert seen[0]["optimizer_away"] and seen[0]["grads_away"] and seen[0]["reference_away"]
    adapter = [p for n, p in ex.trainer.model.named_parameters() if "lora_" in n]
    assert metrics["weight_sync/offloaded_read_bytes"] == sum(p.nbytes for p in adapter)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "lane, quantize",
    [(Recorder, "none"), (TensorRecorder, "none"), (Recorder, "int8"), (Recorder, "fp8")],
    ids=["bytes", "tensor", "bytes-int8", "bytes-fp8"],
)
def test_an_offloaded_cuda_trainer_publishes_without_its_optimizer_on_the_device(lane, quantize):
    # A byte lane casts (and quantizes) the host copies on the CPU where the device publish
    # does it on CUDA: the bytes must be the same.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ex = executor(lane(), "cuda", quantize)
    ex.train_step(groups(0), publish=True)
    ex.train_step(groups(1))
    params_bytes = sum(p.nbytes for p in ex.trainer.model.parameters())
    away: list[int] = []  # device memory once offloaded
    offloaded: list[int] = []
    during: list[int] = []

    def on_send(update) -> None:
        offloaded.append(ex._swap._state.bytes_moved)
        during.append(torch.cuda.memory_allocated() - away[0])

    publish_offloaded_then_rewound(
        ex, on_send, after_offload=lambda: away.append(torch.cuda.memory_allocated())
    )
    assert offloaded[0] > 3 * params_bytes  # gradients and AdamW moments were away
    if lane is Recorder:  # read on the host: nothing came to the device
        assert during[0] < 1 << 20, (during, params_bytes)
    else:  # the published tensors and the packed buffer, not the AdamW moments
        assert during[0] <= 1.5 * params_bytes + (4 << 20), (during, params_bytes)


@pytest.mark.slow
def test_a_colocated_job_refreshes_a_restarted_generator_from_the_offloaded_trainer(
    tiny_job, tmp_path
):
    # The fresh generator's full snapshot is published inside its generate phase, while the
    # trainer is offloaded: the job completes with every rollout accounted for.
    from loomrl.job import Job
    from loomrl.telemetry.metrics import read_metrics
    from tests.test_faults import _assert_complete_and_accounted, _fault_job, _kill_at

    cfg = _fault_job(tiny_job, tmp_path, "process")
    cfg.generation.colocate = True
    on_record, killed = _kill_at(3, "process", "generator0")
    result = Job(cfg).run(on_record=on_record)
    assert killed
    faults = _assert_complete_and_accounted(result, cfg)
    assert faults["executor/generator_restarts"] == 1 and faults["executor/trainer_failures"] == 0
    train_records = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    assert train_records[-1]["weight_sync/num_fulls"] == 2  # the first, and the fresh one's
    assert train_records[-1]["colocate/switches"] >= 2 * cfg.trainer.num_steps
