"""Weight sync per step, the tensor lane next to the byte lane, in one run (``bench/weight_sync.py --lane tensor``).

    python bench/weight_sync.py --lane tensor --size full --device cuda --json lanes.json
    python bench/weight_sync.py --lane tensor --size small --device cpu     # a dry run

A trainer model (fp32 masters) publishes bf16 weights each step and a generator applies
them: the time from the start of the publish until the generator's model holds the new
weights (publish + apply, what a step pays), median of the timed steps after one warm-up.
``full`` is the 362M Qwen2 of the GPU side-by-side (hidden 896, 24 layers, 14 heads, 2 KV
heads, intermediate 4864, vocabulary 4096; 0.72 GB in bf16), random weights. Lanes:

- byte, one process: ``inproc`` (GPU -> CPU cast, codec, bytes, CPU -> mirror -> model);
- tensor, one process: ``tensor`` mode ``local`` (one device buffer, device-to-device);
- byte, other process: ``shm`` to a generator in a spawned process;
- tensor, other process: ``tensor`` mode ``ipc`` (CUDA IPC; CUDA only).

Every lane ends by checking that the generator's mirror holds exactly the published bits.
The table is printed last; ``--json`` writes the rows.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from loomrl.weights.params import published_state, synced_params  # noqa: E402
from loomrl.weights.publisher import Publisher, Subscriber  # noqa: E402
from loomrl.weights.receiver import WeightReceiver  # noqa: E402
from loomrl.weights.tensors import pack_update  # noqa: E402
from loomrl.weights.transports import make_transport  # noqa: E402

SIZES = {  # Qwen2 shapes: (hidden, layers, heads, kv heads, intermediate, vocab)
    "full": (896, 24, 14, 2, 4864, 4096),
    "small": (64, 2, 4, 2, 128, 256),
}


def build_model(size: str, device: str, seed: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads, kv, inter, vocab = SIZES[size]
    cfg = Qwen2Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        vocab_size=vocab,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        return Qwen2ForCausalLM(cfg).float().eval()


def _loader(model: torch.nn.Module):
    """The generator's ``load_weights`` (as ``HFGenerator.load_weights``)."""
    params = dict(model.named_parameters())

    def load_weights(weights) -> None:
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)

    return load_weights


def _digest(state: dict[str, torch.Tensor]) -> str:
    """The bits of ``state`` in bf16, digested on its device (the tensor lane's digest)."""
    return pack_update(state, torch.bfloat16, 0).digest


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _train_step(model: torch.nn.Module, step: int) -> None:
    """Move every weight a little, as an optimizer step does."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0 + 1e-3 * (1 + step % 3))


def _generator_process(kind: str, kwargs: dict, size: str, device: str, conn) -> None:
    """A generator in another process: applies each version the parent names, answers."""
    model = build_model(size, device, seed=1)
    transport = make_transport(kind, **kwargs)
    receiver = WeightReceiver(
        published_state(model, torch.bfloat16),
        _loader(model),
        Subscriber(transport.receiver(1)),
        wait_timeout_s=60,
    )
    conn.send("ready")
    while (msg := conn.recv()) != "stop":
        applied = receiver.apply_newest(int(msg))
        _sync(device)
        conn.send(applied.version)
    conn.send(_digest(receiver.mirror))
    transport.close()


def run_lane(lane: str, kind: str, kwargs: dict, trainer: torch.nn.Module, args) -> dict:
    """Publish + apply per step on one lane; the generator in this process or another."""
    remote = lane.endswith("other process")
    conn = proc = receiver = None
    transport = make_transport(kind, **kwargs)
    if remote:
        parent, child = mp.get_context("spawn").Pipe()
        proc = mp.get_context("spawn").Process(
            target=_generator_process, args=(kind, kwargs, args.size, args.device, child)
        )
        conn = parent
    publisher = Publisher(transport.sender(), codec="full", publish_dtype="bfloat16")
    if remote:
        proc.start()
        assert conn.recv() == "ready"
    else:
        gen = build_model(args.size, args.device, seed=1)
        receiver = WeightReceiver(
            published_state(gen, torch.bfloat16), _loader(gen), Subscriber(transport.receiver(1))
        )
    times, publish_s = [], []
    # the byte lane takes seconds a step
    steps = args.steps if kind == "tensor" else min(args.steps, 2)
    for step in range(steps + 1):
        _train_step(trainer, step)
        _sync(args.device)
        t0 = time.perf_counter()
        publisher.publish(synced_params(trainer), step)
        _sync(args.device)
        t1 = time.perf_counter()
        if remote:
            conn.send(str(step))
            assert conn.recv() == step
        else:
            receiver.apply_newest(step)
            _sync(args.device)
        if step > 0:  # the first is a warm-up (allocations, the digest's weights)
            times.append(time.perf_counter() - t0)
            publish_s.append(t1 - t0)
    expected = _digest(synced_params(trainer))
    if remote:
        conn.send("stop")
        mirror_digest = conn.recv()
        proc.join(timeout=60)
    else:
        mirror_digest = _digest(receiver.mirror)
    transport.close()
    getattr(transport, "unlink", lambda: None)()
    return {
        "lane": lane,
        "transport": kind,
        **{k: v for k, v in kwargs.items() if k == "mode"},
        "step_ms": 1e3 * statistics.median(times),
        "publish_ms": 1e3 * statistics.median(publish_s),
        "apply_ms": 1e3 * (statistics.median(times) - statistics.median(publish_s)),
        "steps": steps,
        "verified": mirror_digest == expected,
    }


def lanes(device: str) -> list[tuple[str, str, dict]]:
    name = uuid.uuid4().hex[:12]
    out = [
        ("byte, one process", "inproc", {}),
        ("tensor, one process", "tensor", {"mode": "local"}),
        ("byte, other process", "shm", {"name": f"bench-{name}"}),
    ]
    if device.startswith("cuda"):
        out.append(("tensor, other process", "tensor", {"mode": "ipc", "name": f"bench-t{name}"}))
    return out


def main(args) -> None:
    t_start = time.perf_counter()
    trainer = build_model(args.size, args.device, seed=0)
    nbytes = sum(t.numel() for t in synced_params(trainer).values()) * 2
    rows = [
        run_lane(lane, kind, kwargs, trainer, args) for lane, kind, kwargs in lanes(args.device)
    ]
    base = {r["lane"].split(", ")[1]: r["step_ms"] for r in rows if r["lane"].startswith("byte")}
    header = [
        "lane",
        "transport",
        "steps",
        "publish ms",
        "apply ms",
        "publish+apply ms",
        "vs byte lane",
        "verified",
    ]
    lines = [
        f"\n## Weight sync per step: {args.size} Qwen2, {nbytes / 1e6:.1f} MB bf16 on {args.device}, "
        f"median of the timed steps after a warm-up (total {time.perf_counter() - t_start:.0f} s)\n",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for r in rows:
        ratio = base[r["lane"].split(", ")[1]] / r["step_ms"]
        kind = r["transport"] + (f" ({r['mode']})" if "mode" in r else "")
        lines.append(
            f"| {r['lane']} | {kind} | {r['steps']} | {r['publish_ms']:.1f} | {r['apply_ms']:.1f} | "
            f"{r['step_ms']:.1f} | {ratio:.1f}x | {'yes' if r['verified'] else 'NO'} |"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "size": args.size,
                    "device": args.device,
                    "model_bytes": nbytes,
                    "steps": args.steps,
                    "rows": rows,
                },
                indent=2,
            )
        )
    print("\n".join(lines))
    if not all(r["verified"] for r in rows):
        raise SystemExit("a generator's mirror does not hold the published weights")
