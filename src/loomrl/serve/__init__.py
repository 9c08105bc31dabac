"""The OpenAI-compatible endpoint: the job's generators served to agents and harnesses, every
sampled token recorded for training (docs/serve.md)."""
