"""Publisher / Subscriber: metrics, snapshots, fallbacks, prefetch, LoRA adapters, and a job
with delta sync against the same job with full sync."""

from __future__ import annotations

import time

import pytest
import torch

from loomrl.weights import state_digest
from loomrl.weights.publisher import Publisher, Subscriber
from loomrl.weights.transports import TransferStats, TransportError, make_transport
from loomrl.weights.transports.base import Sender

METRICS = (
    "weight_sync/changed_fraction",
    "weight_sync/bytes_full",
    "weight_sync/bytes_sent",
    "weight_sync/encode_s",
    "weight_sync/transfer_s",
    "weight_sync/send_failures",
)


def master_states(num: int, lr: float = 1e-5):
    torch.manual_seed(0)
    state = {"w": torch.randn(96, 64) * 0.02, "b": torch.zeros(64), "n": torch.ones(64)}
    for _ in range(num):
        yield {k: v.clone() for k, v in state.items()}
        state["w"] += lr * torch.randn_like(state["w"]).sign()
        state["b"] += lr


def published(state, dtype=torch.bfloat16):
    return {k: v.to(dtype) for k, v in state.items()}


def poll_until(sub, mirror, have, version, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while have != version and time.monotonic() < deadline:
        u, _ = sub.poll(mirror, have)
        have = u.version if u is not None else have
    return have


def test_delta_publishing_metrics_and_periodic_snapshots():
    t = make_transport("inproc")
    pub = Publisher(t.sender(), codec="delta", full_every=3)
    sub = Subscriber(t.receiver())
    mirror, have = {}, None
    for v, state in enumerate(master_states(7)):
        m = pub.publish(state, v)
        assert all(k in m for k in METRICS[1:])
        assert m["weight_sync/is_full"] == float(v % 3 == 0)
        if v:
            assert 0 < m["weight_sync/changed_fraction"] <= 1
        if not m["weight_sync/is_full"]:
            assert m["weight_sync/bytes_sent"] < m["weight_sync/bytes_full"] / 2
        have = poll_until(sub, mirror, have, v)
        assert have == v and state_digest(mirror) == state_digest(published(state))
    sm = sub.metrics()
    assert sm["weight_sync/num_applied"] == 7 and sm["weight_sync/apply_failures"] == 0
    assert {"weight_sync/apply_s", "weight_sync/decode_s", "weight_sync/receive_s"} <= sm.keys()


def test_full_codec_and_fp32_publishing_are_exact():
    t = make_transport("inproc")
    pub = Publisher(t.sender(), codec="full", publish_dtype="float32")
    sub = Subscriber(t.receiver())
    mirror, have = {}, None
    for v, state in enumerate(master_states(3)):
        assert pub.publish(state, v)["weight_sync/is_full"] == 1.0
        have = poll_until(sub, mirror, have, v)
        assert all(torch.equal(mirror[k], state[k]) for k in state)


def test_the_last_snapshot_is_the_next_deltas_base_and_the_tensor_lane_keeps_none():
    """What an offloading trainer moves off with the model (``TrainerExecutor.offload``)."""
    pub = Publisher(make_transport("inproc").sender(), codec="delta", publish_dtype="float32")
    assert not pub.sender.carries_tensors and pub.last_snapshot is None
    states = list(master_states(2))
    for v, state in enumerate(states):
        pub.publish(state, v)
        assert all(torch.equal(pub.last_snapshot[k], state[k]) for k in state)
    lane = Publisher(make_transport("tensor", mode="local").sender(), publish_dtype="float32")
    assert lane.sender.carries_tensors
    lane.publish(states[0], 0)
    assert lane.last_snapshot is None


def test_a_generator_that_polls_rarely_catches_up_exactly():
    t = make_transport("inproc")
    pub = Publisher(t.sender(), codec="delta", full_every=4)
    sub = Subscriber(t.receiver())
    mirror, have = {}, None
    for v, state in enumerate(master_states(11)):
        pub.publish(state, v)
        if v % 3 == 2:  # misses versions, sometimes across a snapshot
            have = poll_until(sub, mirror, have, v)
            assert state_digest(mirror) == state_digest(published(state))


class DeltaRefusingSender(Sender):
    """A sender whose channel cannot take deltas (as an undersized shm ring)."""

    def __init__(self, inner: Sender) -> None:
        self.inner, self.stats = inner, TransferStats()

    def _put(self, update) -> None:
        if not update.is_full:
            raise TransportError("no room for deltas")
        self.inner.send(update)


def test_a_delta_that_cannot_be_sent_becomes_a_snapshot():
    t = make_transport("inproc")
    sender = DeltaRefusingSender(t.sender())
    pub = Publisher(sender, codec="delta", full_every=10)
    states = list(master_states(2))
    pub.publish(states[0], 0)
    m = pub.publish(states[1], 1)
    assert m["weight_sync/is_full"] == 1.0 and m["weight_sync/send_failures"] == 1.0
    assert sender.stats.failures == 1


def test_prefetch_verifies_in_the_background_and_pauses_only_for_the_apply():
    t = make_transport("inproc")
    pub = Publisher(t.sender(), codec="delta", full_every=50)
    sub = Subscriber(t.receiver(), prefetch=True)
    mirror = {
        k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in next(master_states(1)).items()
    }
    have = None
    try:
        for v, state in enumerate(master_states(4)):
            pub.publish(state, v)
            have = poll_until(sub, mirror, have, v)
            assert have == v and state_digest(mirror) == state_digest(published(state))
    finally:
        sub.close()


class _SlowReceiver:
    """A receiver whose receive (the transfer, before decode and verify) takes 0.2 s."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def receive(self, *args, **kwargs):
        time.sleep(0.2)
        return self.inner.receive(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("prefetch", [True, False])
def test_prefetch_pauses_the_generator_only_for_the_apply(prefetch):
    t = make_transport("inproc")
    pub = Publisher(t.sender(), codec="delta", full_every=50)
    sub = Subscriber(_SlowReceiver(t.receiver()), prefetch=prefetch)
    mirror = {
        k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in next(master_states(1)).items()
    }
    have, longest_poll_s, pauses = None, 0.0, []
    try:
        for v, state in enumerate(master_states(3)):
            pub.publish(state, v)
            deadline = time.monotonic() + 10
            while have != v and time.monotonic() < deadline:
                t0 = time.perf_counter()
                update, paused_s = sub.poll(mirror, have)
                longest_poll_s = max(longest_poll_s, time.perf_counter() - t0)
                if update is not None:
                    have = update.version
                    pauses.append(paused_s)
            assert have == v and state_digest(mirror) == state_digest(published(state))
    finally:
        sub.close()
    if prefetch:  # the 0.2 s receive happened in the background: polls cost only the commit
        assert longest_poll_s < 0.1 and max(pauses) < 0.1
        assert max(pauses) <= sub.metrics()["weight_sync/apply_s"] + 0.05
    else:  # the control: without prefetch the generator waits through the receive
        assert longest_poll_s >= 0.2


def test_bad_publisher_arguments_fail_clearly():
    sender = make_transport("inproc").sender()
    with pytest.raises(ValueError, match="codec must be"):
        Publisher(sender, codec="lz4")
    with pytest.raises(ValueError, match="publish_dtype"):
        Publisher(sender, publish_dtype="int8")


# -- LoRA --------------------------------------------------------------------------------------


def _lora_pair():
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    def build():
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        return peft.get_peft_model(LlamaForCausalLM(cfg), lora)

    return build(), build()


def test_lora_sync_sends_only_the_adapter_and_the_generator_matches():
    from loomrl.weights.lora import adapter_state, load_adapter_state

    trainer, generator = _lora_pair()
    ids = torch.randint(0, 64, (2, 10))
    opt = torch.optim.AdamW([p for p in trainer.parameters() if p.requires_grad], lr=1e-2)
    t = make_transport("inproc")
    pub = Publisher(t.sender(), codec="delta", publish_dtype="float32", full_every=10)
    sub = Subscriber(t.receiver())
    mirror, have = {}, None
    for v in range(3):
        loss = trainer(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        adapter = adapter_state(trainer)
        assert adapter and all("lora_" in k for k in adapter)
        m = pub.publish(adapter, v)
        full_model_bytes = sum(p.numel() * 4 for p in trainer.parameters())
        assert m["weight_sync/bytes_full"] < full_model_bytes / 10
        have = poll_until(sub, mirror, have, v)
        load_adapter_state(generator, mirror)
        with torch.no_grad():
            assert torch.equal(generator(input_ids=ids).logits, trainer(input_ids=ids).logits)


def test_lora_bf16_mirror_equals_the_cast_adapter():
    from loomrl.weights.lora import adapter_state, load_adapter_state

    trainer, generator = _lora_pair()
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    t = make_transport("inproc")
    Publisher(t.sender(), codec="delta").publish(adapter_state(trainer), 0)
    mirror: dict = {}
    Subscriber(t.receiver()).poll(mirror, None)
    load_adapter_state(generator, mirror)
    reference = {k: v.to(torch.bfloat16).float() for k, v in adapter_state(trainer).items()}
    gen_state = adapter_state(generator)
    assert all(torch.equal(gen_state[k], reference[k]) for k in reference)


def test_adapter_state_refuses_a_plain_model():
    from loomrl.weights.lora import adapter_state

    with pytest.raises(ValueError, match="PEFT model"):
        adapter_state(torch.nn.Linear(2, 2))


# -- the job ----------------------------------------------------------------------------------


def _eval_and_losses(result):
    from loomrl.telemetry.metrics import read_metrics

    records = read_metrics(result.run_dir)
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    sync = [r for r in records if "weight_sync/bytes_sent" in r]
    return losses, result.eval_history, sync


def test_arithmetic_job_with_delta_sync_matches_full_sync(tiny_job, tmp_path):
    """Synchronous mode is deterministic, so delta sync must give the very same run as full
    sync (bit-exact weights at every version); the async job runs with deltas too."""
    from loomrl.job import Job

    runs = {}
    for codec in ("full", "delta"):
        cfg = tiny_job(
            algorithm={"max_staleness": 0},
            trainer={"num_steps": 4},
            weight_sync={"codec": codec, "full_every": 3},
            eval={"every_steps": 2},
            output_dir=str(tmp_path / codec),
        )
        runs[codec] = _eval_and_losses(Job(cfg).run())
    (loss_f, eval_f, _), (loss_d, eval_d, sync_d) = runs["full"], runs["delta"]
    assert loss_f == loss_d and len(loss_d) == 4
    assert [e.get("eval/mean_reward") for e in eval_f] == [
        e.get("eval/mean_reward") for e in eval_d
    ]
    deltas = [r for r in sync_d if r.get("weight_sync/is_full") == 0.0]
    assert deltas and all(r["weight_sync/bytes_sent"] < r["weight_sync/bytes_full"] for r in deltas)
    cfg = tiny_job(
        algorithm={"max_staleness": 2},
        trainer={"num_steps": 4},
        weight_sync={"codec": "delta"},
        output_dir=str(tmp_path / "async"),
    )
    result = Job(cfg).run()
    assert result.summary["steps"] == 4
