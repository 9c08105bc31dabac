"""The GPU side-by-side (run by bench/gpu_check.sh): loomrl against TRL 1.16's GRPOTrainer on
the same RL work, on a ~0.36B Qwen2-shaped model with random weights built here from a config
(hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, tied embeddings; the real
Qwen2.5-0.5B minus its 151k-token vocabulary) and a byte-level BPE tokenizer of a few
thousand tokens trained in code on generated words.

The same work for every system: P prompts of exactly T tokens a step, G completions each,
exactly N new tokens each (the tokenizer's EOS id is one past the model's vocabulary, so no
system can ever sample it: every completion runs to N tokens), temperature 1, the same
cheap reward (vowel_reward.vowel_share), lr 1e-6, micro-batches of M completions, no KL term,
no reference model, no gradient checkpointing. Each system runs in its own process; after
W warm-up steps the next steps are timed (completions/s, generated tokens/s, seconds a step).
Results are rewritten after every step, so a run stopped at its cap still reports.

    python3 bench/gpu/side_by_side.py build --out /tmp/b_model [--dry]
    python3 bench/gpu/side_by_side.py trl --model /tmp/b_model --precision bf16 --name trl-bf16 --res-dir /tmp/b_res
    python3 bench/gpu/side_by_side.py loomrl --model /tmp/b_model --runtime local --name loomrl-local --res-dir /tmp/b_res
    python3 bench/gpu/side_by_side.py report --res-dir /tmp/b_res

TRL precisions: 'bf16' is TRL's default (fp32 weights, bf16=True: autocast in the training
forward; its plain-HF generate runs under no autocast, so in fp32), 'bf16w' loads the
weights in bf16 (generation and training in bf16: TRL at its fastest here), 'fp32' is
bf16=False. loomrl runs with its per-device defaults (on CUDA: bf16 compute weights, a bf16
mixed-precision trainer with fp32 master weights, no traces, CUDA-graph decode); dotted
overrides after the arguments change them (e.g. model.dtype=float32).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

T_PROCESS = time.perf_counter()
HERE = Path(__file__).resolve().parent

SIZES = {
    "full": dict(
        hidden=896,
        layers=24,
        heads=14,
        kv_heads=2,
        intermediate=4864,
        vocab=4096,
        words=1500,
        corpus_lines=6000,
        prompts=32,
        group=8,
        new_tokens=128,
        prompt_tokens=32,
        micro_batch=64,
        warmup=2,
        measured=4,
        device="cuda",
    ),
    "dry": dict(
        hidden=64,
        layers=2,
        heads=2,
        kv_heads=1,
        intermediate=128,
        vocab=512,
        words=300,
        corpus_lines=600,
        prompts=4,
        group=4,
        new_tokens=16,
        prompt_tokens=12,
        micro_batch=8,
        warmup=1,
        measured=2,
        device="cpu",
    ),
}
LR = 1e-6


def bench_settings(model_dir: str) -> dict:
    return json.loads((Path(model_dir) / "bench.json").read_text())


# -- build ---------------------------------------------------------------------------------


def build(args: argparse.Namespace) -> None:
    import random

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        PreTrainedTokenizerFast,
        Qwen2Config,
    )

    s = dict(SIZES["dry" if args.dry else "full"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiouy"] + [
        "th",
        "st",
        "qu",
        "ng",
        "sh",
    ]
    words = sorted(
        {
            "".join(rng.choice(syllables) for _ in range(rng.randint(1, 3)))
            for _ in range(4 * s["words"])
        }
    )
    rng.shuffle(words)
    words = words[: s["words"]]
    corpus = [" ".join(rng.choice(words) for _ in range(24)) for _ in range(s["corpus_lines"])]

    t0 = time.perf_counter()
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=s["vocab"],
        special_tokens=["<|pad|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(corpus, trainer)
    vocab = core.get_vocab_size()  # the model's vocabulary: ids 0 .. vocab-1
    core.add_special_tokens(["<|eos|>"])  # id `vocab`: outside the model's logits, never sampled
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|pad|>", eos_token="<|eos|>")
    tok.save_pretrained(out)
    assert tok.eos_token_id == vocab and tok.pad_token_id == 0, (
        tok.eos_token_id,
        tok.pad_token_id,
        vocab,
    )

    # Prompts of exactly prompt_tokens tokens, from the same words.
    rows, n = [], 2 * s["prompts"]
    while len(rows) < n:
        ws: list[str] = []
        for _ in range(200):
            ws.append(rng.choice(words))
            k = len(tok(" ".join(ws)).input_ids)
            if k == s["prompt_tokens"]:
                rows.append({"prompt": " ".join(ws), "id": len(rows)})
                break
            if k > s["prompt_tokens"]:
                ws.pop()
    (out / "data").mkdir(exist_ok=True)
    (out / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    # The tokenizer as the systems load it must encode as the one built here.
    again = AutoTokenizer.from_pretrained(out)
    sample = rows[0]["prompt"]
    assert again(sample).input_ids == tok(sample).input_ids, (
        "the saved tokenizer encodes differently"
    )
    assert again.eos_token_id == vocab and again.pad_token_id == 0, (
        again.eos_token_id,
        again.pad_token_id,
    )
    tok_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=512,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=vocab,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    # bf16 on disk: every system starts from the same (bf16-exact) weights, at half the I/O.
    model.to(torch.bfloat16).save_pretrained(out)
    model_s = time.perf_counter() - t0
    s.update(
        vocab=vocab,
        params=params,
        eos_id=vocab,
        lr=LR,
        build_tokenizer_s=round(tok_s, 1),
        build_model_s=round(model_s, 1),
    )
    (out / "bench.json").write_text(json.dumps(s, indent=2))
    print(
        f"built {out}: {params / 1e6:.1f}M parameters, vocab {vocab} (+EOS {vocab} outside it), "
        f"{len(rows)} prompts of {s['prompt_tokens']} tokens; tokenizer {tok_s:.1f}s, model {model_s:.1f}s"
    )


# -- results, shared by both systems --------------------------------------------------------


class Recorder:
    """Step end times and per-step numbers; rewrites the result file after every step."""

    def __init__(
        self, args: argparse.Namespace, s: dict, system: str, precision: str, last_step_final: bool
    ) -> None:
        self.path = Path(args.res_dir) / f"{args.name}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.s, self.system, self.precision = s, system, precision
        # the last step also checkpoints: leave it out of the window
        self.last_step_final = last_step_final
        self.total_steps = 0
        self.times: list[float] = []
        self.tokens: list[float] = []  # generated tokens per step
        self.gen_s: list[float] = []
        self.extra: dict = {}
        self.t_train = None
        self.cuda = s["device"] == "cuda"
        self.write()

    def peak_alloc_gib(self) -> float | None:
        if not self.cuda or not self.extra.get("in_process_gpu", True):
            return None
        import torch

        return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_initialized() else None

    def step(self, tokens: float, gen_s: float | None = None) -> None:
        self.times.append(time.perf_counter())
        self.tokens.append(tokens)
        if gen_s is not None:
            self.gen_s.append(gen_s)
        self.write()

    def write(self) -> None:
        s, w = self.s, self.s["warmup"]
        per_step = s["prompts"] * s["group"]
        last = len(self.times) - 1
        if self.last_step_final and len(self.times) == self.total_steps and last > w:
            last -= 1
        r = {
            "system": self.system,
            "name": self.path.stem,
            "precision": self.precision,
            "steps_done": len(self.times),
            "warmup": w,
            "completions_per_step": per_step,
            "startup_s": (self.t_train - T_PROCESS) if self.t_train else None,
            "first_step_s": (self.times[0] - self.t_train) if self.times and self.t_train else None,
            "peak_alloc_gib": self.peak_alloc_gib(),
            **self.extra,
        }
        if last >= w:  # a window of at least one step after the warm-up
            k = last - (w - 1)
            window_s = self.times[last] - self.times[w - 1]
            toks = sum(self.tokens[w : last + 1])
            r.update(
                window_steps=k,
                window_s=window_s,
                completions_per_s=k * per_step / window_s,
                tokens_per_s=toks / window_s,
                step_s=window_s / k,
                completion_len_mean=toks / (k * per_step),
            )
            if len(self.gen_s) > last:
                r["gen_s_per_step"] = sum(self.gen_s[w : last + 1]) / k
        self.path.write_text(json.dumps(r, indent=2))


# -- TRL ------------------------------------------------------------------------------------


def run_trl(args: argparse.Namespace) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(HERE))
    from vowel_reward import vowel_share

    s = bench_settings(args.model)
    cuda = s["device"] == "cuda"
    rec = Recorder(args, s, "trl", args.precision, last_step_final=False)
    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    dtype = torch.bfloat16 if args.precision == "bf16w" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    rows = [
        json.loads(line)
        for line in (Path(args.model) / "data" / "train.jsonl").read_text().splitlines()
    ]
    dataset = Dataset.from_list([{"prompt": r["prompt"]} for r in rows])

    def reward(prompts, completions, **_):
        return [vowel_share(p, c) for p, c in zip(prompts, completions)]

    per_step = s["prompts"] * s["group"]
    steps = s["warmup"] + s["measured"]
    rec.total_steps = steps
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="b_trl_"),
        per_device_train_batch_size=s["micro_batch"],
        gradient_accumulation_steps=per_step // s["micro_batch"],
        num_generations=s["group"],
        max_completion_length=s["new_tokens"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=s["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=steps,
        beta=0.0,
        num_iterations=1,
        bf16=args.precision != "fp32",
        gradient_checkpointing=False,
        disable_dropout=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
        dataloader_num_workers=0,
        use_cpu=not cuda,
        log_completions=False,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tok
    )
    rec.extra.update(
        generation_batch=config.generation_batch_size,
        steps_per_generation=config.steps_per_generation,
        loss_type=getattr(config, "loss_type", None),
        weights_dtype=str(dtype).replace("torch.", ""),
        bf16=config.bf16,
        gradient_checkpointing=config.gradient_checkpointing,
    )

    pending = {"tokens": 0.0, "gen_s": 0.0}
    inner = trainer._generate_single_turn

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        out = inner(*a, **kw)
        if cuda:
            torch.cuda.synchronize()
        pending["gen_s"] += time.perf_counter() - t0
        pending["tokens"] += sum(len(c) for c in out[0])
        return out

    trainer._generate_single_turn = timed_generate

    class Clock(TrainerCallback):
        def on_step_end(self, _args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            rec.step(pending["tokens"], pending["gen_s"])
            print(
                f"[bench] trl step {state.global_step}: {rec.times[-1] - (rec.times[-2] if len(rec.times) > 1 else rec.t_train):.2f}s "
                f"gen {pending['gen_s']:.2f}s tokens {pending['tokens']:.0f}",
                flush=True,
            )
            pending.update(tokens=0.0, gen_s=0.0)

    trainer.add_callback(Clock())
    if cuda:
        torch.cuda.synchronize()
    rec.t_train = time.perf_counter()
    trainer.train()
    rec.extra["finished"] = True
    rec.write()


# -- loomrl ---------------------------------------------------------------------------------


def run_loomrl(args: argparse.Namespace) -> None:
    import logging

    from loomrl.config import apply_overrides, build_config
    from loomrl.job import Job

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    s = bench_settings(args.model)
    steps = s["warmup"] + s["measured"] + 1  # the last step also checkpoints: timed without it
    out_dir = Path(tempfile.mkdtemp(prefix=f"b_{args.name}_"))
    raw = {
        "name": args.name,
        "seed": 0,
        "output_dir": str(out_dir / "run"),
        "runtime": args.runtime,
        "model": {"path": args.model, "device": s["device"]},
        "data": {"train": str(Path(args.model) / "data" / "train.jsonl"), "shuffle": True},
        "task": {"reward": "vowel_reward:vowel_share", "reward_timeout_s": 60.0},
        "generation": {
            "temperature": 1.0,
            "max_new_tokens": s["new_tokens"],
            "prompts_per_request": s["prompts"],
        },
        "algorithm": {
            "loss": "aipo",
            "group_size": s["group"],
            "groups_per_step": s["prompts"],
            "max_staleness": 1,
        },
        "trainer": {"lr": s["lr"], "num_steps": steps, "micro_batch_size": s["micro_batch"]},
        "weight_sync": {"codec": "full", "publish_dtype": "bfloat16", "transport": args.transport},
        "checkpoint": {"every_steps": 100000},
        "eval": {"every_steps": 100000},
    }
    raw = apply_overrides(raw, args.overrides or [])
    cfg = build_config(raw, "b_bench")
    precision = describe_precision(cfg)
    rec = Recorder(args, s, f"loomrl-{cfg.runtime}", precision, last_step_final=True)
    rec.total_steps = steps
    rec.extra.update(
        in_process_gpu=cfg.runtime == "local",
        overrides=args.overrides or [],
        transport=cfg.weight_sync.kind,
    )
    keys = (
        "timing/step_s",
        "timing/wait_for_batch_s",
        "timing/train_step_s",
        "timing/train_forward_s",
        "timing/train_backward_s",
        "timing/train_optimizer_s",
        "timing/publish_s",
        "weight_sync/apply_s",
        "executor/generator_busy_frac",
        "executor/trainer_busy_frac",
        "rollout/staleness_mean",
    )
    per_step = s["prompts"] * s["group"]
    records: list[dict] = []

    def on_record(record) -> None:
        if "timing/step_s" not in record:
            return
        records.append({k: record.get(k) for k in keys})
        rec.step(record.get("rollout/completion_len_mean", 0.0) * per_step)
        w = s["warmup"]
        window = records[w:-1] if len(records) == steps else records[w:]
        if window:
            rec.extra["loomrl_phases_per_step"] = {
                k.split("/")[1]: sum((r.get(k) or 0.0) for r in window) / len(window) for k in keys
            }
        print(
            f"[bench] {args.name} step {len(records)}: step_s {record.get('timing/step_s', 0):.2f} "
            f"train {record.get('timing/train_step_s') or 0:.2f} wait {record.get('timing/wait_for_batch_s') or 0:.2f} "
            f"publish {record.get('timing/publish_s') or 0:.2f}",
            flush=True,
        )

    # includes the executors' start-up (loomrl's loop starts them)
    rec.t_train = time.perf_counter()
    result = Job(cfg).run(on_record=on_record)
    summ = result.summary
    rec.extra.update(
        finished=True,
        summary={
            k: summ.get(k)
            for k in (
                "steps",
                "elapsed_s",
                "samples_per_s",
                "generator_busy_s",
                "trainer_busy_s",
                "controller_overhead",
                "peak_rss_mb",
                "trained",
                "dropped_stale",
            )
        },
    )
    rec.write()


def describe_precision(cfg) -> str:
    """The precision a loomrl run resolved to, in words, for the table."""
    parts = []
    for section, key in (
        ("model", "dtype"),
        ("trainer", "precision"),
        ("generation", "cuda_graphs"),
        ("generation", "trace"),
        ("weight_sync", "publish_dtype"),
    ):
        value = getattr(getattr(cfg, section), key, None)
        if value is not None:
            parts.append(f"{section}.{key}={value}")
    return ", ".join(parts)


# -- report ---------------------------------------------------------------------------------


def gpu_stats(path: Path) -> str:
    if not path.is_file() or not path.read_text().strip():
        return "n/a"
    mem, util = [], []
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            mem.append(float(parts[0]))
            util.append(float(parts[1]))
        except (ValueError, IndexError):
            continue
    if not mem:
        return "n/a"
    busy = [u for u in util if u > 0]
    return f"{max(mem) - min(mem):.0f} MiB, util max {max(util):.0f}% mean {sum(busy) / max(len(busy), 1):.0f}%"


def report(args: argparse.Namespace) -> None:
    res_dir = Path(args.res_dir)
    results = []
    for p in sorted(res_dir.glob("*.json")):
        try:
            results.append(json.loads(p.read_text()))
        except ValueError:
            continue
    s = (
        bench_settings(args.model)
        if args.model and Path(args.model, "bench.json").is_file()
        else {}
    )
    base = next(
        (r for r in results if r["name"] == "trl-bf16" and r.get("completions_per_s")), None
    )
    base_w = next(
        (r for r in results if r["name"] == "trl-bf16w" and r.get("completions_per_s")), None
    )

    def f(v, fmt="{:.1f}"):
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    lines = [
        "| system | precision | steps timed (done) | completions/s | gen tokens/s | s/step | gen s/step | "
        "peak alloc GiB (torch, own process) | GPU mem rise (nvidia-smi), util | vs TRL bf16 (default) | vs TRL bf16 weights | start-up s, 1st step s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        cps = r.get("completions_per_s")
        gen = r.get("gen_s_per_step")
        if gen is None and r.get("loomrl_phases_per_step"):
            ph = r["loomrl_phases_per_step"]
            gen_note = f"(gen busy {f(ph.get('generator_busy_frac'), '{:.0%}')}, train {f(ph.get('train_step_s'), '{:.2f}')}s, publish {f(ph.get('publish_s'), '{:.2f}')}s, wait {f(ph.get('wait_for_batch_s'), '{:.2f}')}s)"
        else:
            gen_note = f(gen, "{:.2f}")
        lines.append(
            f"| {r['name']} | {r.get('precision')} | {r.get('window_steps', 0)} ({r.get('steps_done', 0)}"
            f"{'' if r.get('finished') else ', stopped'}) | {f(cps)} | {f(r.get('tokens_per_s'), '{:.0f}')} | "
            f"{f(r.get('step_s'), '{:.2f}')} | {gen_note} | {f(r.get('peak_alloc_gib'), '{:.1f}')} | "
            f"{gpu_stats(res_dir / (r['name'] + '.gpu.csv'))} | "
            f"{f(cps / base['completions_per_s'], '{:.2f}x') if cps and base else '-'} | "
            f"{f(cps / base_w['completions_per_s'], '{:.2f}x') if cps and base_w else '-'} | "
            f"{f(r.get('startup_s'))}, {f(r.get('first_step_s'))} |"
        )
    if s:
        lines.append("")
        lines.append(
            f"Work per step, every system: {s['prompts']} prompts x {s['group']} completions, prompts of "
            f"{s['prompt_tokens']} tokens, exactly {s['new_tokens']} new tokens (EOS unreachable), "
            f"micro-batches of {s['micro_batch']}, lr {s['lr']}; timed after {s['warmup']} warm-up steps. "
            f"Model: Qwen2 {s['params'] / 1e6:.0f}M parameters (hidden {s['hidden']}, {s['layers']} layers, "
            f"{s['heads']} heads, {s['kv_heads']} KV heads, intermediate {s['intermediate']}, vocab {s['vocab']}), "
            f"random weights, device {s['device']}."
        )
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", required=True)
    b.add_argument("--dry", action="store_true")
    t = sub.add_parser("trl")
    t.add_argument("--model", required=True)
    t.add_argument("--precision", choices=["bf16", "bf16w", "fp32"], default="bf16")
    t.add_argument("--name", required=True)
    t.add_argument("--res-dir", required=True)
    lm = sub.add_parser("loomrl")
    lm.add_argument("--model", required=True)
    lm.add_argument("--runtime", choices=["local", "process"], default="local")
    lm.add_argument("--name", required=True)
    lm.add_argument("--res-dir", required=True)
    lm.add_argument(
        "--transport", default="tensor", help="weight_sync.transport (default: the tensor lane)"
    )
    lm.add_argument(
        "overrides", nargs="*", help="loomrl dotted overrides, e.g. generation.engine.trace=false"
    )
    r = sub.add_parser("report")
    r.add_argument("--res-dir", required=True)
    r.add_argument("--model")
    args = parser.parse_args()
    {"build": build, "trl": run_trl, "loomrl": run_loomrl, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
