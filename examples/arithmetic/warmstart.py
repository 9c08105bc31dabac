"""Supervised warm-start of the tiny model for the arithmetic example (separate from RL).

A randomly initialised tiny model never samples a correct sum, so RL has no signal. This
script trains it briefly on (prompt, answer) pairs from the training split only, with the
loss on the answer tokens, and stops early on purpose: the model learns the format and is
right some of the time, and RL takes it from there. Eval rows are never seen here.

Where it stops: supervised training on this data has one sharp transition, when the model
learns to write the units digit, and when it comes varies with the seed and the CPU's
floating-point order (held-out accuracy after 300 steps ranged from 3.5% to 61.5% over
six seeds and instruction sets). A fixed step count therefore hands RL a model that has
not begun the transition (RL then gains little) or has finished it (nothing left to
gain). The warm-start instead stops as soon as greedy accuracy on 200 training rows held
out of its batches reaches 25%, checked every 5 steps: every model starts RL just inside
the transition (it is quick: one case went from under 25% to 54% within 25 steps). 25% is
far above the plateau before it (about 10%, noise included), where a 15% target once
stopped on a lucky reading. AdamW weight decay 0.1 (not torch's 0.01) brings the
transition earlier and more surely: with 0.01 one seed and instruction set (AVX2, seed 0)
had not left the plateau after 900 steps; with 0.1 every case measured did by step 700
(see docs/benchmarks.md).

    python -m examples.arithmetic.warmstart --out .cache/arithmetic-warmstart

The result is a normal Hugging Face folder (``save_pretrained``) that the job loads as
``model.path``. It is rebuilt only if missing or built with other settings or data.
"""

from pathlib import Path

from loomrl.training.sft import warmstart_main

if __name__ == "__main__":
    warmstart_main(
        train_file=Path(__file__).parent / "train.jsonl",
        default_out=".cache/arithmetic-warmstart",
        default_steps=1500,
        default_target_accuracy=0.25,
        default_weight_decay=0.1,
        description=__doc__,
    )
