"""Supervised warm-start of the tiny model for the arithmetic example (separate from RL).

A randomly initialised tiny model never samples a correct sum, so RL has no signal. This
script trains it briefly on (prompt, answer) pairs from the training split only, with the
loss on the answer tokens, and stops early on purpose: the model learns the format and is
right some of the time, and RL takes it from there. Eval rows are never seen here.

Why 300 steps: supervised training on this data has one sharp transition, when the model
learns to write the units digit (greedy accuracy ~10% at step 300, ~35-60% at 400, ~99% at
600, on every seed and floating-point order measured). 300 steps hands RL a model that has
just begun it, so RL has both a signal and room to climb.

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
        default_steps=300,
        description=__doc__,
    )
