"""A tiny instruct-style Qwen2 folder for trying the GSM8K job on a laptop CPU: a character
tokenizer with a chat template, random weights (it will not solve word problems; the job shows
the path, not a result). Point ``model.path`` at a real instruct model folder instead, e.g. a
local copy of Qwen2.5-0.5B-Instruct (see job.toml for the settings that change).

    python -m examples.gsm8k.make_model --out .cache/gsm8k-tiny-instruct
"""

from __future__ import annotations

import argparse
from pathlib import Path

# A ChatML-like template in plain text (the character tokenizer has no <|im_start|> tokens);
# it writes the one BOS itself, as Llama's and many instruct templates do.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>\n{{ m['content'] }}\n</{{ m['role'] }}>\n"
    "{% endfor %}{% if add_generation_prompt %}<assistant>\n{% endif %}"
)


def build(out: Path, seed: int = 0) -> Path:
    from loomrl.models.tiny import build_tiny_model

    model, tok = build_tiny_model(
        "qwen2",
        seed=seed,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        intermediate_size=128,
        max_position_embeddings=1024,
    )
    tok.chat_template = CHAT_TEMPLATE
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(".cache/gsm8k-tiny-instruct"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build(args.out, args.seed))


if __name__ == "__main__":
    main()
