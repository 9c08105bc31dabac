"""Peak memory of a whole short synchronous run of a 151,936-token-vocabulary model on the
CPU, before and after the memory-lean defaults (issue 52 item 6).

``bench/trainer_memory.py`` measures one train step in isolation; this runs the real job
(``loomrl run``, ``runtime = "local"``: controller, generator, scorer and trainer in one
process) for a few synchronous steps (``max_staleness = 0``) and reports the whole process's
peak resident set: the generator's copy of the weights, the published update, sampling, the
trainer's weights, gradients, AdamW state and step, all together.

The model is the Qwen2-0.5B shape cut to ``--layers`` decoder layers (hidden 896, 14 heads,
2 key/value heads, vocabulary 151,936, tied embeddings; random weights from a config, nothing
downloaded). Its tokenizer is the character tokenizer padded to the model's vocabulary with
filler tokens (``<f123>``), and every 300th filler is also an EOS id in the saved
``generation_config``, so sampled completions stop after ~300 tokens on average, capped at
``--max-new-tokens``: rows of spread lengths, as RL batches have. Prompts are the arithmetic
demo's, the reward is its ``digits`` partial credit (fillers hold digits: rewards vary), one
micro-batch a step (``--groups`` x ``--group-size`` rollouts).

Variants (each a fresh ``loomrl run`` with the same seed, so the same prompts and samples):
``before``: fp32 pinned with ``trainer.chunked_logprobs = false`` (the defaults on a CPU
without native bf16 until issue 52: the full ``[tokens, vocabulary]`` log-softmax);
``defaults (fp32)``: fp32 pinned, everything else the defaults; ``+ packing``; and the
defaults with nothing pinned (``auto``: bf16_mixed on a CPU with native bf16, else fp32).

Peak figures: ``ru_maxrss`` of the run's process (from ``wait4``), and the highest sum of the
resident sets of the run's process tree sampled every 50 ms (the same unless the run starts
processes of its own).

    python bench/run_memory.py                       # 1 layer, 3 steps, every variant
    python bench/run_memory.py --variants 0,1 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # trainer_memory's model
VOCAB = 151_936
STOP_EVERY = 300
VARIANTS = {  # name -> job overrides
    "before (fp32, full log-softmax)": [
        'model.dtype="float32"',
        'trainer.precision="fp32"',
        "trainer.chunked_logprobs=false",
    ],
    "defaults (fp32 pinned)": ['model.dtype="float32"', 'trainer.precision="fp32"'],
    "defaults (fp32 pinned) + packing": [
        'model.dtype="float32"',
        'trainer.precision="fp32"',
        "trainer.packing=true",
    ],
    "defaults (nothing pinned)": [],
    "before, nothing else pinned": ["trainer.chunked_logprobs=false"],
}


def build_model(folder: Path, layers: int) -> None:
    """The model, its padded character tokenizer and a generation_config with many EOS ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from trainer_memory import _model as qwen2_shape
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    from loomrl.models.tiny import CHARS, SPECIAL_TOKENS

    base = SPECIAL_TOKENS + CHARS
    vocab = {tok: i for i, tok in enumerate(base)}
    vocab.update({f"<f{i}>": len(base) + i for i in range(VOCAB - len(base))})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
    )
    tok.add_bos_token = True
    model = qwen2_shape(layers, "cpu")  # bench/trainer_memory.py's, random fp32 weights
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # this tokenizer's ids
        setattr(model.config, key, getattr(tok, key))
    stops = [len(base) + i for i in range(0, VOCAB - len(base), STOP_EVERY)]
    model.generation_config = GenerationConfig(
        eos_token_id=[tok.eos_token_id, *stops],
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
    )
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def write_job(path: Path, model: Path, args) -> None:
    path.write_text(
        f"""name = "run-memory"
seed = 0

[model]
path = "{model}"

[data]
train = "{ROOT / "examples/arithmetic/train.jsonl"}"

[task]
reward = "examples.arithmetic.reward:digits"

[generation]
temperature = 1.0
max_new_tokens = {args.max_new_tokens}

[algorithm]
loss = "grpo"
group_size = {args.group_size}
groups_per_step = {args.groups}
max_staleness = 0

[trainer]
num_steps = {args.steps}
micro_batch_size = {args.groups * args.group_size}

[checkpoint]
every_steps = 100000
"""
    )


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run_variant(name: str, job: Path, out: Path) -> dict:
    """One ``loomrl run``; its peaks, wall time and what its summary says."""
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "loomrl.cli", "run", str(job), *VARIANTS[name]]
    cmd += ["--output-dir", str(out)]
    log = open(out.parent / f"{out.name}.log", "w")  # noqa: SIM115
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    tree_peak = [0]
    timeline: list[tuple[float, int]] = []  # (epoch seconds, as trace.json, tree RSS) every 50 ms
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            rss = _tree_rss(proc.pid)
            tree_peak[0] = max(tree_peak[0], rss)
            timeline.append((round(time.time(), 3), rss))
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)
    done.set()
    sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    log.close()
    if proc.returncode != 0:
        tail = (out.parent / f"{out.name}.log").read_text()[-3000:]
        raise RuntimeError(f"{name}: exit {proc.returncode}\n{tail}")
    # where the peak falls: read against the run's trace.json (generate, train, publish spans)
    (out / "rss_timeline.json").write_text(json.dumps(timeline))
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lengths = [
        r["rollout/completion_len_mean"] for r in records if "rollout/completion_len_mean" in r
    ]
    return {
        "variant": name,
        "peak_rss": usage.ru_maxrss * 1024,
        "tree_peak": tree_peak[0],
        "wall_s": wall,
        "precision": summary.get("precision", {}),
        "steps": summary.get("steps"),
        "completion_len_mean": sum(lengths) / len(lengths) if lengths else None,
        "trained": summary.get("trained"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=2, help="groups a step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=480)
    parser.add_argument(
        "--variants",
        default=",".join(str(i) for i in range(len(VARIANTS))),
        help="; ".join(f"{i}={v}" for i, v in enumerate(VARIANTS)),
    )
    parser.add_argument("--work", type=Path, default=ROOT / "runs/bench-run-memory")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.work / f"qwen2-shape-{args.layers}l"
    if not (model / "config.json").is_file():
        build_model(model, args.layers)
    job = args.work / "job.toml"
    write_job(job, model, args)
    rows = []
    for i in args.variants.split(","):
        name = list(VARIANTS)[int(i)]
        rows.append(run_variant(name, job, args.work / f"run-{i}"))
        print(json.dumps(rows[-1]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
    gib = 2**30
    base = rows[0]
    print(
        f"\nQwen2-shaped, {args.layers} layer(s), vocabulary {VOCAB:,}; {args.steps} synchronous "
        f"steps of {args.groups} x {args.group_size} rollouts (up to {args.max_new_tokens} new "
        "tokens), runtime local, one process\n"
    )
    print(
        "| variant | precision | peak RSS GiB | vs first | process-tree peak GiB | wall s | mean completion |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        prec = r["precision"].get("trainer_precision", "?")
        length = "-" if r["completion_len_mean"] is None else f"{r['completion_len_mean']:.0f}"
        print(
            f"| {r['variant']} | {prec} | {r['peak_rss'] / gib:.2f} | {base['peak_rss'] / r['peak_rss']:.2f}x "
            f"| {r['tree_peak'] / gib:.2f} | {r['wall_s']:.0f} | {length} |"
        )


if __name__ == "__main__":
    main()
