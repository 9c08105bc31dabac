"""The sharded trainer (``trainer.parallel.type = "fsdp2"``) against the single one: per-rank
memory of the trained state for 1, 2 and 4 ranks, and the train-step time for 1 and 2 ranks
with a projection to 8 from the measured compute and communication times.

Run by ``python bench/trainer_memory.py --sharded`` (options there). The model is a
Llama-shaped one built from a config with random weights (hidden 768, 12 layers, 12 heads,
intermediate 2048, vocabulary 32,000, untied: 134M parameters; nothing is downloaded).
Every rank is a process with one torch thread (2 ranks on this 2-core machine stand for 2
devices), on gloo; 1 rank is the single trainer (``loomrl.training.trainer.Trainer``).

Figures:
- ``state MiB``: what a rank holds after a step: its shards of the fp32 weights, their
  gradients and AdamW's state (``to_local()`` of each DTensor: exact bytes, not a sampled
  RSS), and its ratio to the single trainer's over N (1.00 = exactly 1/N);
- ``peak RSS MiB``: the rank process's ``ru_maxrss`` (torch, the model as built before
  sharding, activations): context, not the sharded figure;
- step time: the mean of the measured steps after a warm-up, and of the forward, backward
  (FSDP's gathers and reduce-scatters run inside them) and optimizer phases;
- the 2-rank run also times the step's collectives alone on the full fp32 state (an
  all-gather for forward, one for backward, a reduce-scatter of gradients): with the
  single trainer's compute C1, N ranks take C1/N + comm(N) with the ring's (N-1)/N of the
  bytes at the measured bandwidth plus a per-call latency; the bench prints that model's
  2-rank figure beside the measured one, then its 8-rank projection.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path
from typing import Any

MODEL = {
    "vocab_size": 32_000,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
}
PROMPT_TOKENS, COMPLETION_TOKENS = 16, 48
MIB = 2**20


def _model():
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        **MODEL,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _groups(rows: int):
    from loomrl.types import Group, Rollout

    rollouts = [
        Rollout(
            i,
            [2 + i % 7] * PROMPT_TOKENS,
            [(11 * i + j) % 31_000 + 5 for j in range(COMPLETION_TOKENS)],
            [-3.0] * COMPLETION_TOKENS,
            [1] * COMPLETION_TOKENS,
            0,
            reward=float(i % 2),
        )
        for i in range(rows)
    ]
    return [Group.of_rollouts(0, 0, rollouts)]


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def state_bytes(trainer) -> dict[str, int]:
    """This rank's bytes of weights, gradients and optimizer state (its shards under FSDP)."""
    params = list(trainer.model.parameters())
    optimizer = [
        v for s in trainer.optimizer.state.values() for v in s.values() if hasattr(v, "numel")
    ]
    return {
        "params": _local_bytes(params),
        "grads": _local_bytes(p.grad for p in params),
        "optimizer": _local_bytes(optimizer),
    }


def _trainer(rank: int, world_size: int, rows: int):
    from loomrl.config import AlgorithmConfig, TrainerConfig
    from loomrl.training.trainer import Trainer

    cfg = TrainerConfig(
        lr=1e-5, micro_batch_size=rows, shared_prefix=False, trace=False, chunked_logprobs=False
    )
    algorithm = AlgorithmConfig(group_size=max(2, rows))  # (the step reads the groups' own size)
    tokenizer = type("Tok", (), {"pad_token_id": 0})()
    model = _model()
    if world_size == 1:
        return Trainer(model, tokenizer, algorithm, cfg, 1.0)
    from torch.distributed.device_mesh import init_device_mesh

    from loomrl.training.fsdp import ShardedTrainer, shard_model

    shard_model(model, init_device_mesh("cpu", (world_size,)), "fp32", reshard=True)
    return ShardedTrainer(model, tokenizer, algorithm, cfg, 1.0, rank=rank, world_size=world_size)


def time_collectives(numel: int, repeats: int = 2) -> dict[str, float]:
    """Seconds of one all-gather and one reduce-scatter of ``numel`` fp32 values over the
    default group (each rank holding 1/N), and of a one-value all-gather (the latency)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    shard = torch.ones(numel // world)
    full = torch.empty(shard.numel() * world)

    def timed(fn) -> float:
        fn()  # warm-up
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) / repeats

    tiny, tiny_full = torch.ones(1), torch.empty(world)
    return {
        "all_gather_s": timed(lambda: dist.all_gather_single(full, shard)),
        "reduce_scatter_s": timed(lambda: dist.reduce_scatter_single(shard, full)),
        "latency_s": timed(lambda: dist.all_gather_single(tiny_full, tiny)),
    }


def rank_main(rank: int, world_size: int, rendezvous: str, opts: dict[str, Any], out: str) -> None:
    """One rank of a configuration (run by torch.multiprocessing.spawn)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size)
    trainer = _trainer(rank, world_size, opts["rows"])
    trainer.train_step(_groups(opts["rows"]))  # warm-up: gradients and AdamW state exist now
    steps = []
    for _ in range(opts["steps"]):
        t0 = time.perf_counter()
        metrics = trainer.train_step(_groups(opts["rows"]))
        steps.append(
            {
                "step_s": time.perf_counter() - t0,
                "forward_s": metrics["timing/train_forward_s"],
                "backward_s": metrics["timing/train_backward_s"],
                "optimizer_s": metrics["timing/train_optimizer_s"],
                "loss": metrics["train/loss"],
            }
        )
    report = {
        "rank": rank,
        "state": state_bytes(trainer),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "steps": steps,
        "params": sum(p.numel() for p in trainer.model.parameters()),
    }
    if world_size > 1:
        if opts.get("collectives"):
            report["collectives"] = time_collectives(report["params"])
        parts: list = [None] * world_size
        dist.all_gather_object(parts, report)
        dist.destroy_process_group()
    else:
        parts = [report]
    if rank == 0:
        Path(out).write_text(json.dumps(parts))


def run_configuration(world_size: int, opts: dict[str, Any], out: Path) -> list[dict]:
    import torch.multiprocessing as mp

    from loomrl.runtime.group import new_rendezvous

    if out.exists():  # kept from an earlier run with the same --workdir
        return json.loads(out.read_text())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(
        rank_main, (world_size, new_rendezvous("127.0.0.1"), opts, str(out)), nprocs=world_size
    )
    return json.loads(out.read_text())


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def collective_s(collectives: dict[str, float], n: int, units: int) -> float:
    """Seconds of a step's collectives alone on ``n`` ranks, from the 2-rank measurements: a
    ring moves (n-1)/n of the bytes per rank (2 ranks: 1/2) and pays (n-1) latencies per
    call, ``units`` calls per collective (one per fully_shard unit)."""
    per_byte = (2 * collectives["all_gather_s"] + collectives["reduce_scatter_s"]) / 0.5
    return (n - 1) / n * per_byte + 3 * units * (n - 1) * collectives["latency_s"]


def report(runs: dict[int, list[dict]], shares: dict[int, list[dict]], opts: dict[str, Any]) -> str:
    """The bench's tables (markdown), from the ranks' reports of each configuration."""
    lines = []
    base = runs[1][0]
    base_state = sum(base["state"].values())
    lines.append(
        f"Llama-shaped, {base['params'] / 1e6:.0f}M parameters, fp32 weights and AdamW, "
        f"{opts['rows']} rows of {PROMPT_TOKENS}+{COMPLETION_TOKENS} tokens a step, gloo, one "
        "thread per rank\n"
    )
    lines.append(
        "| ranks | state per rank MiB (weights + grads + AdamW) | x N / single | "
        "weights / grads / AdamW MiB | peak RSS MiB (max rank) | loss |"
    )
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for n, ranks in sorted(runs.items()):
        worst = max(ranks, key=lambda r: sum(r["state"].values()))
        state = sum(worst["state"].values())
        parts = " / ".join(
            f"{worst['state'][k] / MIB:.0f}" for k in ("params", "grads", "optimizer")
        )
        lines.append(
            f"| {n} | {state / MIB:.0f} | {state * n / base_state:.3f} | {parts} | "
            f"{max(r['peak_rss'] for r in ranks) / MIB:.0f} | {ranks[0]['steps'][0]['loss']:.6g} |"
        )
    lines.append("")
    lines.append("| ranks | step s | forward s | backward s | optimizer s |")
    lines.append("| --- | --- | --- | --- | --- |")
    for n, ranks in sorted(runs.items()):
        steps = ranks[0]["steps"]
        note = " (4 processes on 2 cores)" if n > (os.cpu_count() or 1) else ""
        lines.append(
            f"| {n}{note} | {_mean(s['step_s'] for s in steps):.2f} | "
            f"{_mean(s['forward_s'] for s in steps):.2f} | {_mean(s['backward_s'] for s in steps):.2f} | "
            f"{_mean(s['optimizer_s'] for s in steps):.2f} |"
        )
    if 2 in runs and shares:
        lines += _projection(runs, shares)
    return "\n".join(lines)


def _step_s(ranks: list[dict]) -> float:
    return _mean(s["step_s"] for s in ranks[0]["steps"])


def _projection(runs: dict[int, list[dict]], shares: dict[int, list[dict]]) -> list[str]:
    """Step time on N ranks = a rank's compute (the single trainer measured on 1/N of the
    rows, its optimizer step counted 1/N) + the sharding overhead (collectives, FSDP's copies), taken from the measured
    2-rank step and scaled as the ring's bytes, (N-1)/N."""
    coll = runs[2][0]["collectives"]
    units = MODEL["num_hidden_layers"] + 1
    optimizer_1 = _mean(s["optimizer_s"] for s in runs[1][0]["steps"])
    compute = {  # a rank steps AdamW on 1/N of the weights; the single run stepped them all
        1: _step_s(runs[1]),
        **{n: _step_s(r) - optimizer_1 * (1 - 1 / n) for n, r in shares.items()},
    }
    overhead_2 = _step_s(runs[2]) - compute[2]
    gib = runs[1][0]["params"] * 4 / 2**30
    lines = [
        "",
        f"collectives alone on 2 ranks, the full fp32 state ({gib:.2f} GiB): all-gather "
        f"{coll['all_gather_s']:.2f} s, reduce-scatter {coll['reduce_scatter_s']:.2f} s, latency "
        f"{coll['latency_s'] * 1e3:.2f} ms a call; a step has 2 all-gathers and 1 reduce-scatter "
        f"in {units} calls each: {collective_s(coll, 2, units):.2f} s. The measured 2-rank step "
        f"is {_step_s(runs[2]):.2f} s against {compute[2]:.2f} s of compute: "
        f"{overhead_2:.2f} s of sharding overhead.",
        "",
        "| ranks | compute s (single trainer on rows/N, AdamW / N) | collectives alone s | overhead s (from "
        "2 ranks, x 2(N-1)/N) | step s | speedup vs 1 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for n in sorted(compute):
        overhead = overhead_2 * 2 * (n - 1) / n
        step = compute[n] + overhead
        kind = "measured" if n <= 2 else "projected"
        lines.append(
            f"| {n} ({kind}) | {compute[n]:.2f} | {collective_s(coll, n, units):.2f} | "
            f"{overhead:.2f} | {step:.2f} | {compute[1] / step:.2f}x |"
        )
    return lines


def main(ranks: list[int], rows: int, steps: int, workdir: Path) -> None:
    if 1 not in ranks:
        raise SystemExit(
            "--ranks must include 1 (the single trainer every figure is compared with)"
        )
    runs, shares = {}, {}
    for n in ranks:
        opts = {"rows": rows, "steps": steps if n <= 2 else 1, "collectives": n == 2}
        t0 = time.perf_counter()
        runs[n] = run_configuration(n, opts, workdir / f"ranks{n}.json")
        print(f"{n} rank(s): {time.perf_counter() - t0:.0f} s", flush=True)
    if 2 in runs:  # a rank's compute at N ranks: the single trainer on rows/N
        for n in (2, 4, 8):
            if rows % n == 0:
                opts = {"rows": rows // n, "steps": steps}
                shares[n] = run_configuration(1, opts, workdir / f"share{n}.json")
                print(f"single trainer on {rows // n} rows: done", flush=True)
    print(report(runs, shares, {"rows": rows}))


# -- start-up: the whole model on every rank, against the meta-device start -----------------

STARTUPS = {
    "whole (load_policy, then shard)": "whole",
    "meta, each rank reads its rows (shipped)": "meta",
    "meta, rank 0 loads and broadcasts": "broadcast",
}


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _broadcast_start(folder: str, shard):
    """torch's other recipe: rank 0 alone reads the whole state, then
    ``set_model_state_dict(..., broadcast_from_rank0=True)`` sends each tensor and every
    rank keeps its shard."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from loomrl.models.loading import build_meta_model, safetensors_files
    from loomrl.training.fsdp_init import init_non_persistent_buffers

    model = build_meta_model(folder, torch.float32)
    shard(model)
    model.to_empty(device="cpu")
    init_non_persistent_buffers(model)
    state = {}
    if dist.get_rank() == 0:
        for file in sorted(set(safetensors_files(folder).values())):
            state.update(load_file(file))
        first: dict = {}  # a tied parameter's other names -> its stored one
        alias = {
            n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)
        }
        state = {n: state[alias.get(n, n)].float() for n in model.state_dict()}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, state, options=options)
    return model


def _start(method: str, folder: str, shard):
    import torch

    from loomrl.config import ModelConfig
    from loomrl.models.loading import load_policy
    from loomrl.training.fsdp_init import start_sharded_model

    model_cfg = ModelConfig(path=folder, device="cpu")
    if method == "broadcast":
        return _broadcast_start(folder, shard)
    if method == "meta":
        return start_sharded_model(model_cfg, torch.float32, shard)[0]
    model = load_policy(model_cfg, dtype=torch.float32)[0]
    shard(model)
    return model


def startup_rank(rank: int, world_size: int, rendezvous: str, opts: dict[str, Any], out: str):
    """One rank: a warm-up start of a tiny model (imports, code pages), then the measured
    start of the bench's model: ``VmHWM`` (reset through ``/proc/self/clear_refs``) minus the
    resident set before it, and the shards it holds."""
    from functools import partial

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from loomrl.training.fsdp import shard_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    shard = partial(shard_model, mesh=mesh, precision="fp32", reshard=True)
    warm = _start(opts["method"], opts["tiny"], shard)
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    before, t0 = _status_bytes("VmRSS"), time.perf_counter()
    model = _start(opts["method"], opts["folder"], shard)
    report = {
        "rank": rank,
        "peak": _status_bytes("VmHWM") - before,
        "held": _local_bytes(model.parameters()),
        "start_s": time.perf_counter() - t0,
    }
    del warm
    parts: list = [None] * world_size
    dist.all_gather_object(parts, report)
    if rank == 0:
        Path(out).write_text(json.dumps(parts))
    dist.destroy_process_group()


def _save_models(workdir: Path) -> tuple[dict[str, Path], Path]:
    """The bench's model saved as a folder in fp32 and in bf16 (as hub models are stored;
    the trainer's fp32 master weights are then a cast copy), and a tiny one (the warm-up)."""
    import torch

    from loomrl.models.tiny import build_char_tokenizer, build_tiny_model

    folders = {"fp32": workdir / "model_fp32", "bf16": workdir / "model_bf16"}
    for dtype, folder in folders.items():
        if not (folder / "config.json").exists():
            _model().to(
                getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype])
            ).save_pretrained(folder)
            build_char_tokenizer().save_pretrained(folder)
    tiny = workdir / "tiny"
    if not (tiny / "config.json").exists():
        model, tok = build_tiny_model("llama", hidden_size=32, num_layers=2, num_heads=2)
        model.save_pretrained(tiny)
        tok.save_pretrained(tiny)
    return folders, tiny


def startup_main(ranks: list[int], workdir: Path) -> None:
    """Per-rank start-up peak of each start (``STARTUPS``) on each rank count above 1, from
    the model stored in fp32 and in bf16."""
    import torch.multiprocessing as mp

    from loomrl.runtime.group import new_rendezvous

    folders, tiny = _save_models(workdir)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    fp32_bytes = sum(f.stat().st_size for f in folders["fp32"].glob("*.safetensors"))
    lines = [
        f"\nStart-up of each rank into fp32 master weights ({fp32_bytes / MIB:.0f} MiB whole): the "
        "model above saved as a folder, its safetensors in fp32 or bf16; the peak resident set "
        "during the start minus before it (VmHWM), after a warm-up start of a tiny model\n",
        "| ranks | stored | start | peak per rank MiB: rank 0 / others (max) | x fp32 model "
        "| shards held MiB | s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n in [r for r in ranks if r > 1]:
        for stored, folder in folders.items():
            for label, method in STARTUPS.items():
                out = workdir / f"startup_{method}_{stored}_{n}.json"
                if not out.exists():
                    opts = {"method": method, "folder": str(folder), "tiny": str(tiny)}
                    args = (n, new_rendezvous("127.0.0.1"), opts, str(out))
                    mp.spawn(startup_rank, args, nprocs=n)
                parts = json.loads(out.read_text())
                peak0, others = parts[0]["peak"], max(p["peak"] for p in parts[1:])
                lines.append(
                    f"| {n} | {stored} | {label} | {peak0 / MIB:.0f} / {others / MIB:.0f} | "
                    f"{max(peak0, others) / fp32_bytes:.2f} | {parts[0]['held'] / MIB:.0f} | "
                    f"{max(p['start_s'] for p in parts):.1f} |"
                )
    print("\n".join(lines))
