"""The tensor lane: its digest, its choice of mode, catch-up, jobs on it, and (on a GPU)
device-to-device, CUDA IPC and NCCL. The contract it shares with the byte lanes runs in
``test_weights_transports.py`` (kinds ``tensor-local`` and ``tensor-gloo``)."""

from __future__ import annotations

import logging
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

from loomrl.job import Job
from loomrl.telemetry.metrics import read_metrics
from loomrl.weights import WeightUpdateError, state_digest
from loomrl.weights.publisher import Publisher, Subscriber
from loomrl.weights.tensors import buffer_digest, device_sums, pack_update
from loomrl.weights.transports import make_transport
from loomrl.weights.transports.tensor import choose_lane


def _state(seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(96, 40, generator=g).to(device),
        "b": torch.randn(40, generator=g).to(device),
    }


def _bf16(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16).cpu() for k, v in state.items()}


def test_the_digest_is_exact_and_catches_any_single_bit_flip():
    update = pack_update(_state(), torch.bfloat16, 0)
    assert update.prepare({}).commit(target := {}) == ["b", "w"]
    assert state_digest(_bf16(target)) == state_digest(_bf16(_state()))
    for position, bit in [(0, 0), (1, 7), (update.nbytes // 2, 3), (update.nbytes - 1, 7)]:
        flat = update.flat.clone()
        flat[position] ^= 1 << bit
        with pytest.raises(WeightUpdateError, match="device digest"):
            type(update)(0, flat, update.slots, update.digest).prepare({})
    # the GPU's method (device sums) checked on a CPU buffer: the receiver uses the sender's method
    sums = type(update)(
        0, update.flat, update.slots, buffer_digest(update.slots, update.flat, "sums")
    )
    assert sums.digest.startswith("sums:") and update.digest.startswith("crc32:")
    sums.prepare({})
    sums.flat = update.flat.clone()
    sums.flat[7] ^= 0x40
    with pytest.raises(WeightUpdateError, match="device digest"):
        sums.prepare({})
    # the same words in another order (two elements swapped) give other sums
    words = update.flat.clone().view(torch.int16)
    words[[3, 900]] = words[[900, 3]]
    assert words[3] != words[900] and device_sums(words.view(torch.uint8)) != device_sums(
        update.flat
    )


def test_a_rejected_update_leaves_the_mirror_as_it_was():
    t = make_transport("tensor", mode="local")
    pub, sub = Publisher(t.sender()), Subscriber(t.receiver())
    mirror = _bf16(_state(0))
    before = state_digest(mirror)
    bad = t.sender().pack(_state(1), torch.bfloat16, 1)
    bad.flat[5] ^= 0x10
    t.sender().send(bad)
    assert sub.poll(mirror, 0) == (None, 0.0) and sub.failures == 1
    assert state_digest(mirror) == before
    pub.publish(_state(2), 2)
    update, _ = sub.poll(mirror, 0)
    assert update.version == 2 and state_digest(mirror) == state_digest(_bf16(_state(2)))


def test_a_generator_that_missed_versions_gets_the_latest_weights():
    t = make_transport("tensor", mode="local")
    pub, sub = Publisher(t.sender(), codec="delta"), Subscriber(t.receiver())
    mirror = _bf16(_state(0))
    for v in range(5):
        metrics = pub.publish(_state(10 + v), v)
        assert metrics["weight_sync/is_full"] == 1.0  # the tensor lane sends snapshots only
    update, _ = sub.poll(mirror, 1)  # at version 1, missed 2..4: version 4, never a delta
    assert update.version == 4 and update.is_full and sub.num_applied == 1
    assert state_digest(mirror) == state_digest(_bf16(_state(14)))
    assert sub.poll(mirror, 4) == (None, 0.0)


def test_choose_lane_by_runtime_and_device(caplog):
    assert choose_lane("auto", in_process=True, device="cpu") == ("tensor", {"mode": "local"})
    with caplog.at_level(logging.WARNING, logger="loomrl.weights.transports.tensor"):
        kind, kwargs = choose_lane("auto", in_process=False, device="cpu")
    assert kind == "shm" and set(kwargs) == {"name"}
    assert "using the byte lane 'shm'" in caplog.text
    assert choose_lane("broadcast", in_process=False, device="cpu") == (
        "tensor",
        {"mode": "broadcast"},
    )
    with pytest.raises(ValueError, match="needs one process per executor"):
        choose_lane("broadcast", in_process=True, device="cpu")
    with pytest.raises(ValueError, match="tensor lane mode must be one of"):
        make_transport("tensor", mode="nvlink")


def _losses(run_dir):
    return [
        (r["train/loss"], r["train/grad_norm"], r["rollout/reward_mean"])
        for r in read_metrics(run_dir)
        if "train/loss" in r
    ]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "runtime,mode",
    [
        ("local", "auto"),
        ("process", "broadcast"),
        pytest.param("process", "auto", marks=pytest.mark.slow),
    ],
)
def test_a_job_on_the_tensor_lane_gives_the_same_losses_as_inproc(
    tiny_job, tmp_path, runtime, mode
):
    """local: the buffer handed over in one process; process + broadcast: a gloo group of
    processes; process + auto on CPU: the byte lane it falls back to."""
    sync = {"algorithm": {"max_staleness": 0}, "task": {"reward": "test_job:length_reward"}}
    base = Job(tiny_job(**sync, output_dir=str(tmp_path / "inproc"))).run()
    lane = Job(
        tiny_job(
            **sync,
            runtime=runtime,
            output_dir=str(tmp_path / "tensor"),
            weight_sync={"transport": {"type": "tensor", "mode": mode}},
        )
    ).run()
    assert len(_losses(base.run_dir)) == 4 and _losses(base.run_dir)[0][0] != 0.0
    assert _losses(lane.run_dir) == _losses(base.run_dir)  # bit-identical at fp32 on CPU
    assert lane.summary["trained"] == base.summary["trained"]


# -- on a GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_a_job_over_cuda_ipc_gives_the_same_losses_as_inproc(tiny_job, tmp_path, caplog):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    sync = {
        "algorithm": {"max_staleness": 0},
        "task": {"reward": "test_job:length_reward"},
        "model": {"device": "cuda"},
    }
    base = Job(tiny_job(**sync, output_dir=str(tmp_path / "inproc"))).run()
    with caplog.at_level(logging.WARNING, logger="loomrl.weights.transports.tensor"):
        lane = Job(
            tiny_job(
                **sync,
                runtime="process",
                output_dir=str(tmp_path / "ipc"),
                weight_sync={"transport": "tensor"},
            )
        ).run()
    assert "byte lane" not in caplog.text  # CUDA IPC, not the fallback
    assert _losses(lane.run_dir) == _losses(base.run_dir)


@pytest.mark.gpu
def test_device_to_device_in_one_process():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    t = make_transport("tensor", mode="local")
    pub, sub = Publisher(t.sender()), Subscriber(t.receiver())
    mirror = {k: v.to(torch.bfloat16) for k, v in _state(0, "cuda").items()}
    metrics = pub.publish(_state(3, "cuda"), 0)
    assert metrics["weight_sync/bytes_sent"] == (96 * 40 + 40) * 2
    update, _ = sub.poll(mirror, None)
    assert update.flat.is_cuda and mirror["w"].is_cuda
    assert state_digest(mirror) == state_digest(_bf16(_state(3)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _remote_generator(kwargs: dict, last: int, results) -> None:
    t = make_transport("tensor", **kwargs)
    sub = Subscriber(t.receiver(kwargs.get("rank", 1)))
    mirror = {k: v.to(torch.bfloat16) for k, v in _state(0, "cuda").items()}
    have, deadline = None, time.monotonic() + 60
    while have != last and time.monotonic() < deadline:
        update, _ = sub.poll(mirror, have)
        have = update.version if update is not None else have
        time.sleep(0.001)
    results.put((have, state_digest(mirror), sub.failures))
    t.close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["ipc", "broadcast"])
def test_a_generator_in_another_process_on_the_tensor_lane(mode):
    if not torch.cuda.is_available() or (mode == "broadcast" and torch.cuda.device_count() < 2):
        pytest.skip("ipc needs CUDA; NCCL broadcast needs two GPUs (NCCL refuses two ranks on one)")
    if mode == "ipc":
        kwargs = {"mode": "ipc", "name": f"test-{_free_port()}"}
    else:
        kwargs = {
            "mode": "broadcast",
            "world_size": 2,
            "init_method": f"tcp://127.0.0.1:{_free_port()}",
            "backend": "nccl",
            "bucket_bytes": 4096,
        }
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(
        target=_remote_generator,
        args=(kwargs | ({"rank": 1} if mode == "broadcast" else {}), 3, results),
    )
    proc.start()
    t = make_transport("tensor", **(kwargs | ({"rank": 0} if mode == "broadcast" else {})))
    pub = Publisher(t.sender())
    try:
        for v in range(4):
            pub.publish(_state(20 + v, "cuda"), v)
            time.sleep(0.2)  # ipc keeps the newest only: let the generator see each
        have, digest, failures = results.get(timeout=120)
        assert have == 3 and digest == state_digest(_bf16(_state(23))) and failures == 0
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
        t.close()
        t.unlink() if mode == "ipc" else None


def test_the_ipc_mailbox_sees_every_write_and_opens_only_private_files(tmp_path):
    """Quick writes can repeat a file's inode and coarse mtime: the stamp tells them apart.
    The mailbox is unpickled, so a file others could write is refused."""
    from loomrl.weights.transports.base import TransportError
    from loomrl.weights.transports.tensor import _Mailbox

    writer, reader = _Mailbox(tmp_path / "box"), _Mailbox(tmp_path / "box")
    assert reader.read() is None
    for i in range(100):
        writer.write({"version": i})
        assert reader.read() == {"version": i}
    writer.write({"version": 100})
    (tmp_path / "box").chmod(0o666)
    with pytest.raises(TransportError, match="not a private file"):
        reader.read()


def test_a_bad_manifest_or_a_cpu_state_on_ipc_is_a_clear_error(tmp_path):
    from loomrl.weights.tensors import TensorUpdate
    from loomrl.weights.transports.base import TransportError

    update = pack_update(_state(), torch.bfloat16, 3)
    manifest = update.manifest()
    assert TensorUpdate.from_manifest(manifest, update.flat.clone()).version == 3
    with pytest.raises(WeightUpdateError, match="manifest says"):
        TensorUpdate.from_manifest(manifest, update.flat[:-2].clone())
    with pytest.raises(WeightUpdateError, match="does not tile"):
        TensorUpdate.from_manifest({**manifest, "slots": manifest["slots"][::-1]}, update.flat)
    with pytest.raises(WeightUpdateError, match="malformed"):
        TensorUpdate.from_manifest({"version": 1}, update.flat)
    t = make_transport("tensor", mode="ipc", root=str(tmp_path))
    pub = Publisher(t.sender())
    with pytest.raises(TransportError, match="tensor lane 'ipc' shares CUDA memory"):
        pub.publish(_state(), 0)
    assert pub.num_send_failures == 1
    t.close()
