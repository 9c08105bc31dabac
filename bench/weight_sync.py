"""Weight sync benchmark: delta payload size, codec speed and transport time, each next to
a baseline measured in the same run.

    .venv/bin/python bench/weight_sync.py            # ~10M, ~100M, ~1B parameters
    .venv/bin/python bench/weight_sync.py --quick    # ~10M only
    .venv/bin/python bench/weight_sync.py --lane tensor --size full --device cuda --json PATH
                                                     # per step: tensor lane vs byte lane (weight_lanes.py)

1. Real consecutive weights: the arithmetic example's RL job itself (the demo's ~1M-parameter
   tiny Llama, its 350-step supervised warm-start, then async RL with AdamW on fp32 masters), with a
   checkpoint after every step, at several learning rates; each checkpoint cast to bf16 is
   what the trainer published. Every consecutive pair is encoded.
2. Synthetic bf16 models of ~10M/~100M/~1B parameters with a chosen fraction of elements
   moved by 1-2 ulp (as fp32 masters crossing a bf16 rounding boundary do): payload, and
   encode / decode GB/s of model bytes on one core next to a memcpy of the same bytes.
3. Transports: a full update and a delta, each next to a raw transfer of the full bytes
   on the same path (shm: copy into /dev/shm and out in another process; torch_dist: gloo
   broadcast to another process; files: write + rename + read).
"""

from __future__ import annotations

import argparse
import gc
import mmap
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from loomrl.weights import WeightUpdate, apply_update, encode_update  # noqa: E402
from loomrl.weights.manifest import bits_view  # noqa: E402
from loomrl.weights.transports import make_transport  # noqa: E402

GB = 1e9


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def nbytes_of(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def table(title: str, header: list[str], rows: list[list]) -> None:
    print(f"\n## {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    sys.stdout.flush()


# -- 1. real consecutive weights ---------------------------------------------------------------

REAL_MODEL = "tiny:llama"  # the demo model


def _published(checkpoint: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's fp32 masters cast to bf16: the weights the trainer published at that
    version (tied tensors once)."""
    from loomrl.training.checkpoint import load_checkpoint

    seen: set[int] = set()
    state = {}
    for name, t in load_checkpoint(checkpoint)["trainer"]["model"].items():
        if t.is_floating_point() and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            state[name] = t.to(torch.bfloat16)
    return state


def real_weights(lrs: list[float], rl_steps: int, warm_steps: int) -> dict[float, list[dict]]:
    """bf16 states published after each step of the arithmetic RL job, for each learning
    rate: the project's own warm-start, generator, trainer (AdamW, fp32 masters) and
    checkpoints, with a checkpoint after every step."""
    import logging

    from loomrl.data import load_rows
    from loomrl.job import Job
    from loomrl.training.checkpoint import list_checkpoints
    from loomrl.training.sft import supervised_warmstart

    logging.disable(logging.INFO)
    torch.set_num_threads(2)
    tmp = Path(tempfile.mkdtemp(prefix="loomrl-bench-"))
    t0 = time.perf_counter()
    rows = load_rows(ROOT / "examples/arithmetic/train.jsonl")
    supervised_warmstart(
        REAL_MODEL, rows, tmp / "warm", steps=warm_steps, batch_size=64, lr=2e-3, seed=0
    )
    print(f"# warm start: {warm_steps} supervised steps in {time.perf_counter() - t0:.0f}s")
    runs = {}
    for lr in lrs:
        out = tmp / f"lr{lr:g}"
        overrides = [
            f'model.path="{tmp / "warm"}"',
            f"trainer.lr={lr}",
            'trainer.lr_schedule="constant"',
            "trainer.warmup_steps=0",
            f"trainer.num_steps={rl_steps}",
            "checkpoint.every_steps=1",
            f"checkpoint.keep={rl_steps + 1}",
            "eval.every_steps=1000000",
            "data.max_eval_examples=8",
            f'output_dir="{out}"',
        ]
        result = Job.from_toml(ROOT / "examples/arithmetic/job.toml", overrides).run()
        runs[lr] = [_published(c) for c in list_checkpoints(out / "checkpoints")]
        print(
            f"# RL lr={lr:g}: {rl_steps} steps of the arithmetic job, reward per step "
            f"{[round(r['rollout/reward_mean'], 2) for r in _step_records(out)]}, "
            f"eval {result.summary['eval_start']:.2f} -> {result.summary['eval_end']:.2f}"
        )
    torch.set_num_threads(1)
    logging.disable(logging.NOTSET)
    return runs


def _step_records(run_dir: Path) -> list[dict]:
    from loomrl.telemetry.metrics import read_metrics

    return [r for r in read_metrics(run_dir) if "rollout/reward_mean" in r]


def codec_row(label: str, pairs: list[tuple[dict, dict]], repeats: int) -> list:
    """Median over pairs of payload and changed fraction; codec speed on the last pair."""
    fracs, sizes = [], []
    for old, new in pairs:
        u = encode_update(old, new, version=1, base_version=0)
        fracs.append(u.changed_fraction)
        sizes.append(u.nbytes / u.model_nbytes)
    old, new = pairs[-1]
    model_bytes = nbytes_of(new)
    update = encode_update(old, new, version=1, base_version=0)
    enc_s = median_time(lambda: encode_update(old, new, version=1, base_version=0), repeats)
    state = {k: v.clone() for k, v in old.items()}

    def decode() -> None:
        for k, v in old.items():  # reset to the base (not timed separately: a memcpy)
            state[k].copy_(v)
        apply_update(state, update)

    dec_total = median_time(decode, repeats)
    copy_s = median_time(lambda: [state[k].copy_(v) for k, v in new.items()], repeats)
    dec_s = max(dec_total - copy_s, 1e-9)
    params = sum(t.numel() for t in new.values())
    frac, size = statistics.median(fracs), statistics.median(sizes)
    return [
        label,
        f"{params / 1e6:.0f}M",
        f"{frac * 100:.2f}%",
        f"{size * 100:.3f}%",
        f"{1 / size:.0f}x",
        f"{model_bytes / enc_s / GB:.2f}",
        f"{model_bytes / dec_s / GB:.2f}",
        f"{model_bytes / copy_s / GB:.2f}",
    ]


CODEC_HEADER = [
    "weights",
    "params",
    "changed",
    "payload % of full bf16",
    "smaller by",
    "encode GB/s",
    "decode GB/s",
    "memcpy GB/s",
]


# -- 2. synthetic models ---------------------------------------------------------------------------


def synthetic_model(params: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Transformer-shaped bf16 tensors (h x h and h x 4h blocks, norms, embedding)."""
    h = {10_000_000: 512, 100_000_000: 1024, 1_000_000_000: 2048}.get(params, 1024)
    gen = torch.Generator().manual_seed(seed)
    state, total, layer = {}, 0, 0
    state["embed"] = (torch.randn(params // 10 // h, h, generator=gen) * 0.02).to(torch.bfloat16)
    total += state["embed"].numel()
    while total < params:
        for name, shape in (
            ("qkvo", (4 * h, h)),
            ("up", (4 * h, h)),
            ("down", (h, 4 * h)),
            ("gate", (4 * h, h)),
            ("norm", (h,)),
        ):
            t = torch.randn(shape, generator=gen) * 0.02
            state[f"layers.{layer}.{name}"] = (t + 1 if name == "norm" else t).to(torch.bfloat16)
            total += t.numel()
        layer += 1
    return state


def nudge(
    state: dict[str, torch.Tensor], fraction: float, seed: int = 1
) -> dict[str, torch.Tensor]:
    """A copy where ``fraction`` of the elements moved by +-1 or +-2 ulp."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, t in state.items():
        new = t.clone()
        bits = bits_view(new)
        idx = np.flatnonzero(rng.random(bits.size, dtype=np.float32) < fraction)
        step = rng.choice(np.array([-2, -1, 1, 2], np.int16), size=idx.size)
        bits[idx] = (bits[idx].view(np.int16) + step).view(np.uint16)
        out[k] = new
    return out


# -- 3. transports ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _raw_group(port: int, rank: int):
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, datetime.timedelta(seconds=300))
    return dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=300))


def _broadcast(pg, tensor: torch.Tensor, bucket: int) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for start in range(0, tensor.numel(), bucket):
        pg.broadcast([tensor[start : start + bucket]], opts).wait()


class _RawShmReader:
    """Child side of the raw shm baseline: wait for the sequence number, copy the bytes out
    into a preallocated buffer (a pure memcpy; the transport reuses its buffers too)."""

    def __init__(self, path: str, poll_s: float) -> None:
        with open(path, "r+b") as f:
            self.mm = mmap.mmap(f.fileno(), 0)
        self.poll_s, self.out = poll_s, None

    def read(self, nbytes: int, seq: int) -> None:
        head = np.frombuffer(self.mm, dtype=np.uint64, count=1)
        while int(head[0]) != seq:
            time.sleep(self.poll_s)
        if self.out is None or len(self.out) != nbytes:
            self.out = bytearray(nbytes)
        np.frombuffer(self.out, np.uint8)[:] = np.frombuffer(self.mm, np.uint8, nbytes, 64)


def _child(kind: str, kwargs: dict, raw: dict, conn) -> None:
    """The receiving process: raw transfers of the full bytes, and transport receives."""
    torch.set_num_threads(1)
    pg = _raw_group(raw["port"], 1) if kind == "torch_dist" else None
    t = make_transport(kind, **kwargs)
    receiver = t.receiver(1)
    shm_reader, dist_out, have = None, None, None
    while (msg := conn.recv())[0] != "exit":
        if msg[0] == "raw_done":  # free the baseline's memory before the transport's turn
            shm_reader = dist_out = None
        elif msg[0] == "raw" and kind == "shm":
            shm_reader = shm_reader or _RawShmReader(raw["path"], receiver.poll_interval_s)
            shm_reader.read(msg[1], msg[2])
        elif msg[0] == "raw":
            if dist_out is None or dist_out.numel() != msg[1]:
                dist_out = torch.empty(msg[1], dtype=torch.uint8)
            _broadcast(pg, dist_out, raw["bucket"])
        else:
            while have != msg[1]:
                u = receiver.receive(have, timeout_s=60)
                have = u.version if u is not None else have
            u = None  # dropped, as a generator drops an update once applied
        conn.send(time.perf_counter())
    t.close()


def _timed(conn, msg, start_fn) -> float:
    conn.send(msg)
    time.sleep(0.05)  # let the receiver start waiting
    t0 = time.perf_counter()
    start_fn()
    return conn.recv() - t0


def _versions(full: WeightUpdate, delta: WeightUpdate, i: int) -> tuple[WeightUpdate, WeightUpdate]:
    """The same bytes as versions 2i (full) and 2i+1 (delta on 2i)."""
    return (
        WeightUpdate(2 * i, None, full.codec, full.tensors, full.digest, full.payload),
        WeightUpdate(
            2 * i + 1,
            2 * i,
            delta.codec,
            delta.tensors,
            delta.digest,
            delta.payload,
            delta.base_digest,
        ),
    )


def _raw_sender(kind: str, raw: dict, payload) -> tuple:
    """Parent side of the raw baseline: a function sending the full bytes once, and a closer."""
    nbytes = len(payload)
    if kind == "shm":
        with open(raw["path"], "wb") as f:
            f.truncate(nbytes + 64)
        with open(raw["path"], "r+b") as f:
            mm = mmap.mmap(f.fileno(), 0)
        views = {
            "dst": np.frombuffer(mm, np.uint8, nbytes, 64),
            "seq": np.frombuffer(mm, np.uint64, 1),
            "src": np.frombuffer(payload, np.uint8),
        }
        views["dst"].fill(0)  # pre-fault, as the transport does when it allocates

        def send(i: int) -> None:
            views["dst"][:] = views["src"]
            views["seq"][0] = i

        def close() -> None:
            views.clear()
            mm.close()
            os.unlink(raw["path"])

        return send, ("raw", nbytes), close
    pg = _raw_group(raw["port"], 0)
    src = torch.frombuffer(payload, dtype=torch.uint8)  # the model's bytes, no copy
    return (lambda i: _broadcast(pg, src, raw["bucket"])), ("raw", nbytes), lambda: None


def _remote_rows(kind: str, full: WeightUpdate, delta: WeightUpdate, repeats: int) -> list:
    """Raw transfers of the full bytes, then full updates and deltas, to a receiver in
    another process; the first two of each warm up (connections made, buffers allocated)."""
    bucket = 64 << 20
    if kind == "shm":
        kwargs = {"name": f"bench-{os.getpid()}-{_free_port()}"}
        raw = {"path": f"/dev/shm/loomrl-bench-raw-{os.getpid()}"}
    else:
        kwargs = {
            "world_size": 2,
            "init_method": f"tcp://127.0.0.1:{_free_port()}",
            "backend": "gloo",
            "bucket_bytes": bucket,
        }
        raw = {"port": _free_port(), "bucket": bucket}
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_child,
        args=(kind, kwargs | {"rank": 1} if kind != "shm" else kwargs, raw, child),
        daemon=True,
    )
    t = make_transport(kind, **(kwargs | ({"rank": 0} if kind != "shm" else {})))
    if kind == "shm":
        sender = t.sender()
        proc.start()
        raw_send, raw_msg, raw_close = _raw_sender(kind, raw, full.payload)
    else:
        proc.start()
        raw_send, raw_msg, raw_close = _raw_sender(kind, raw, full.payload)
        sender = t.sender()
    times: dict[str, list[float]] = {"raw": [], "full": [], "delta": []}
    for i in range(repeats + 2):
        times["raw"].append(_timed(parent, (*raw_msg, i + 1), lambda i=i: raw_send(i + 1)))
    raw_close()
    _timed(parent, ("raw_done",), lambda: None)
    for i in range(repeats + 2):
        f, d = _versions(full, delta, i)
        times["full"].append(_timed(parent, ("recv", f.version), lambda f=f: sender.send(f)))
        times["delta"].append(_timed(parent, ("recv", d.version), lambda d=d: sender.send(d)))
    parent.send(("exit",))
    proc.join(timeout=60)
    t.close()
    return [statistics.median(times[k][2:]) for k in ("raw", "full", "delta")]


def _raw_files(folder: str, data, i: int) -> float:
    path = Path(folder) / f"raw{i}.bin"
    t0 = time.perf_counter()
    with open(path.with_suffix(".tmp"), "wb") as f:
        f.write(data)
    os.replace(path.with_suffix(".tmp"), path)
    with open(path, "rb") as f:
        f.read()
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def _local_rows(kind: str, full: WeightUpdate, delta: WeightUpdate, repeats: int) -> list:
    """inproc and files: sender and receiver in this process, interleaved with the raw
    baseline (page-cache writeback makes file timings drift)."""
    tmp = tempfile.mkdtemp(prefix="loomrl-bench-")
    t = make_transport(kind, **({"path": tmp} if kind == "files" else {}))
    sender, receiver = t.sender(), t.receiver()
    times: dict[str, list[float]] = {"raw": [], "full": [], "delta": []}
    for i in range(repeats + 1):  # the first round warms up
        if kind == "files":
            times["raw"].append(_raw_files(tmp, full.payload, i))
        for key, u in zip(("full", "delta"), _versions(full, delta, i), strict=True):
            t0 = time.perf_counter()
            sender.send(u)
            got = receiver.receive(u.base_version)
            times[key].append(time.perf_counter() - t0)
            assert got is not None and got.version == u.version
            got = None
    t.close()
    for p in Path(tmp).iterdir():
        p.unlink()
    os.rmdir(tmp)
    return [
        statistics.median(times[k][1:]) if times[k] else float("nan")
        for k in ("raw", "full", "delta")
    ]


def transport_rows(label: str, full: WeightUpdate, delta: WeightUpdate, repeats: int) -> list:
    rows = []
    for kind in ("inproc", "shm", "torch_dist", "files"):
        rows_fn = _remote_rows if kind in ("shm", "torch_dist") else _local_rows
        raw_s, full_s, delta_s = rows_fn(kind, full, delta, repeats)
        no_raw = raw_s != raw_s  # nan: no raw path for inproc
        rows.append(
            [
                label,
                kind,
                f"{full.nbytes / 1e6:.1f}",
                "-" if no_raw else f"{raw_s * 1e3:.1f}",
                f"{full_s * 1e3:.1f}",
                "-" if no_raw else f"{full_s / raw_s:.2f}x",
                f"{delta.nbytes / 1e6:.2f}",
                f"{delta_s * 1e3:.2f}",
                "-" if no_raw else f"{raw_s / delta_s:.0f}x",
            ]
        )
        gc.collect()
    return rows


TRANSPORT_HEADER = [
    "model",
    "transport",
    "full MB",
    "raw full ms",
    "full update ms",
    "full / raw",
    "delta MB",
    "delta ms",
    "raw / delta",
]


# -- main -------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="~10M parameters only, fewer steps")
    ap.add_argument("--sizes", default=None, help="comma-separated parameter counts")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-real", action="store_true", help="skip the RL run (synthetic only)")
    ap.add_argument(
        "--lane",
        choices=["byte", "tensor"],
        default="byte",
        help="tensor: publish+apply per step, tensor lane next to the byte lane (bench/weight_lanes.py)",
    )
    ap.add_argument(
        "--size",
        choices=["full", "small"],
        default="full",
        help="--lane tensor: the 362M Qwen2 or a tiny one",
    )
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="--lane tensor: device",
    )
    ap.add_argument("--steps", type=int, default=5, help="--lane tensor: timed steps per lane")
    ap.add_argument("--json", default=None, help="--lane tensor: write the rows here")
    args = ap.parse_args()
    if args.lane == "tensor":
        sys.path.insert(0, str(ROOT / "bench"))
        from weight_lanes import main as lanes_main

        lanes_main(args)
        return
    torch.set_num_threads(1)
    sizes = (
        [int(float(s)) for s in args.sizes.split(",")]
        if args.sizes
        else ([10_000_000] if args.quick else [10_000_000, 100_000_000, 1_000_000_000])
    )
    t_start = time.perf_counter()
    print(
        f"# torch {torch.__version__}, numpy {np.__version__}, one core (torch threads 1); "
        "medians of repeats"
    )
    rows, observed = [], [0.02, 0.1]
    if not args.no_real:
        runs = real_weights([1e-6, 1e-5, 1e-3], rl_steps=3 if args.quick else 5, warm_steps=350)
        rows = [
            codec_row(f"real RL, AdamW lr={lr:g}", list(zip(s, s[1:], strict=False)), args.repeats)
            for lr, s in runs.items()
        ]
        observed = [round(float(r[2].rstrip("%")) / 100, 4) for r in rows[:2]]  # lr 1e-6, 1e-5
        del runs
    gc.collect()
    trows = []
    for params in sizes:
        base = synthetic_model(params)
        label = f"synthetic ~{params / 1e6:.0f}M"
        fractions = [0.001, 0.05, *observed] if params < 5e8 else observed[:1]
        for frac in fractions + [0.01]:  # 1% last: its updates go on to the transports
            new = nudge(base, frac)
            rows.append(
                codec_row(
                    f"{label}, {frac * 100:.2f}% moved",
                    [(base, new)],
                    args.repeats if params < 5e8 else 2,
                )
            )
            if frac == 0.01:
                delta = encode_update(base, new, version=1, base_version=0)
                del base
                gc.collect()
                full = encode_update(None, new, version=0, base_version=None)
            del new
            gc.collect()
        trows += transport_rows(
            f"~{params / 1e6:.0f}M, 1% moved", full, delta, args.repeats if params < 5e8 else 2
        )
        del full, delta
        gc.collect()
    table("Delta codec (payload and speed on one core)", CODEC_HEADER, rows)
    table(
        "Transports (one receiver; full update and a 1%-changed delta vs a raw transfer of "
        "the full bytes on the same path)",
        TRANSPORT_HEADER,
        trows,
    )
    print(f"\n# total {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    main()
