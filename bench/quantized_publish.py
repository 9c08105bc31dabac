"""Publishing for a quantized generator (``generation.engine.quantize = "int8"``), both ways, in one run:

- ``bf16``: the trainer publishes bf16 (``weight_sync.publish_dtype``), the generator keeps a
  bf16 mirror and re-quantizes each changed Linear from it (``publish_quantized = false``);
- ``int8 codes``: the trainer publishes int8 codes and fp32 per-row scales of those Linears,
  quantized from its fp32 masters (``publish_quantized = true``), the rest in bf16.

Per model and mode: the full snapshot's payload (``WeightUpdate.nbytes``, manifest and
payload as serialized), the delta after one optimizer step (``codec = "delta"``), the
trainer's publish time (cast or quantize, encode; the in-process transport hands the update
over without copying) and the generator's receive + apply time (decode, verify, commit to the
mirror, load into the quantized layers), medians over ``--repeats``, the share of published
elements a delta changes, and the mirror's size.

The step is a perturbation, not a trained one: every fp32 master weight moves by
``lr * sign(g)`` for a random ``g``, which is exactly AdamW's first update (bias-corrected
m / sqrt(v) = sign(g)); later Adam steps move weights by at most that. ``lr`` is the demo
job's 2e-4 on the demo model and ``--big-lr`` (1e-5) on the 138M one.

Models as in ``bench/quantized.py``: the warm-started demo and a 138M Llama built from a config.

    python bench/quantized_publish.py --demo .cache/arithmetic-warmstart
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from quantized import _IdsOnly, build  # noqa: E402  (bench/quantized.py)

MODES = {"bf16": False, "int8 codes": True}


def _adam_first_step(model, lr: float, seed: int) -> None:
    import torch

    rng = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(lr * torch.randn(p.shape, generator=rng).sign())


def _mb(nbytes: float) -> float:
    return nbytes / 2**20


def run_mode(master_init, quantized: bool, lr: float, repeats: int) -> dict:
    """Publish full snapshots and one-step deltas of a copy of ``master_init`` to an int8
    generator; the mode's row."""
    import torch

    from loomrl.generation.hf import HFGenerator
    from loomrl.weights.params import synced_params
    from loomrl.weights.publisher import Publisher, Subscriber
    from loomrl.weights.quantized import QuantizedPublish
    from loomrl.weights.transports.inproc import InprocTransport

    master, transport = copy.deepcopy(master_init), InprocTransport()
    selected = QuantizedPublish.of_model(master, "int8") if quantized else None
    publisher = Publisher(transport.sender(), codec="delta", full_every=10_000, quantized=selected)
    gen = HFGenerator(
        copy.deepcopy(master_init),
        _IdsOnly(),
        subscriber=Subscriber(transport.receiver()),
        quantize="int8",
        publish_quantized=quantized,
        trace=False,
    )
    rows: dict[str, list[float]] = {}
    version = 0
    for kind in ["full"] * repeats + ["delta"] * repeats:
        if kind == "delta":
            _adam_first_step(master, lr, seed=version)
        t0 = time.perf_counter()
        metrics = publisher.publish(synced_params(master), version, full=kind == "full")
        t1 = time.perf_counter()
        assert gen.apply_weights(version).version == version
        t2 = time.perf_counter()
        assert metrics["weight_sync/is_full"] == float(kind == "full")
        for key, value in (
            ("mb", _mb(metrics["weight_sync/bytes_sent"])),
            ("publish_s", 1e3 * (t1 - t0)),  # ms
            ("apply_s", 1e3 * (t2 - t1)),
            ("changed_pct", 100 * metrics.get("weight_sync/changed_fraction", 1.0)),
        ):
            rows.setdefault(f"{kind}_{key}", []).append(value)
        version += 1
    row = {key: statistics.median(values) for key, values in rows.items()}
    row["mirror_mb"] = _mb(sum(t.numel() * t.element_size() for t in gen.mirror.values()))
    del gen, master
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return row


COLUMNS = [
    ("full_mb", "full MB", "{:.1f}"),
    ("delta_mb", "delta MB", "{:.2f}"),
    ("delta_changed_pct", "delta changed %", "{:.1f}"),
    ("full_publish_s", "full publish ms", "{:.1f}"),
    ("full_apply_s", "full receive+apply ms", "{:.1f}"),
    ("delta_publish_s", "delta publish ms", "{:.1f}"),
    ("delta_apply_s", "delta receive+apply ms", "{:.1f}"),
    ("mirror_mb", "mirror MB", "{:.1f}"),
]


def table(rows: list[tuple[str, str, dict]]) -> str:
    """A markdown table: each quantized row with its ratio to the model's bf16 row."""
    lines = [
        "| model | publishing | " + " | ".join(h for _, h, _ in COLUMNS) + " |",
        "|" + "---|" * (2 + len(COLUMNS)),
    ]
    base = {}
    for model, mode, row in rows:
        ref = base.setdefault(model, row)
        cells = []
        for key, _, fmt in COLUMNS:
            cell = fmt.format(row[key])
            if row is not ref:
                cell += f" ({row[key] / ref[key]:.2f}x)"
            cells.append(cell)
        lines.append(f"| {model} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo", default=str(ROOT / ".cache/arithmetic-warmstart"))
    p.add_argument("--models", nargs="+", default=["demo", "138m"])
    p.add_argument("--lr", type=float, default=2e-4, help="the step on the demo model")
    p.add_argument("--big-lr", type=float, default=1e-5, help="the step on the 138M model")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    rows = []
    for model_name in args.models:
        master, _ = build(model_name, args.demo, "cpu")
        lr = args.lr if model_name == "demo" else args.big_lr
        params_m = sum(t.numel() for t in master.parameters()) / 1e6
        for mode, quantized in MODES.items():
            row = run_mode(master, quantized, lr, args.repeats)
            rows.append((f"{model_name} ({params_m:.0f}M)", mode, row))
            print(model_name, mode, row, file=sys.stderr)
        del master
    print(table(rows))


if __name__ == "__main__":
    main()
