"""Scorer executors beyond reward functions: reward models and generative judges
(``[task.scorer]``; docs/scoring.md)."""
