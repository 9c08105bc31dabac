"""What chat episodes did, as ``episode/*`` metrics in each step's record.

Means over the episodes that ended since the last record (``episode/count`` of them):
``turns_mean``, ``tokens_mean`` (prompt, turns and observations), ``tool_calls_mean`` (every
call the model tried) and ``valid_call_frac`` (calls that ran and returned, of those tried).
Counts since the run began: ``calls_<tool>`` by tool, ``errors_<kind>`` by kind
(``loomrl.envs.tools.ERROR_KINDS``), ``end_<reason>`` by how episodes ended
(``END_REASONS``) and ``tool_result_cuts`` (answers cut to ``task.chat.max_tool_result_tokens``).
"""

from __future__ import annotations

from collections import Counter

from loomrl.envs.tools import ERROR_KINDS, ToolLog

# answered: the environment said done; max_turns, max_episode_tokens, max_new_tokens (a turn
# cut by generation.max_new_tokens): a limit ended it; error: the environment raised.
END_REASONS = ("answered", "max_turns", "max_episode_tokens", "max_new_tokens", "error")


class EpisodeStats:
    """Accumulates finished episodes (module docstring)."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.errors: Counter = Counter({kind: 0 for kind in ERROR_KINDS})
        self.ends: Counter = Counter({reason: 0 for reason in END_REASONS})
        self.cuts = 0
        self._window = [0, 0, 0, 0, 0]  # episodes, turns, tokens, calls tried, calls valid

    def add(self, num_turns: int, num_tokens: int, log: ToolLog, end_reason: str) -> None:
        self.calls.update(log.calls)
        self.errors.update(log.errors)
        self.ends[end_reason] += 1
        self.cuts += log.cuts
        for i, value in enumerate((1, num_turns, num_tokens, log.num_attempts, log.num_valid)):
            self._window[i] += value

    def metrics(self) -> dict[str, float]:
        """The record's ``episode/*`` (nothing before the first episode); starts a new window."""
        episodes, turns, tokens, tried, valid = self._window
        if not episodes and not sum(self.ends.values()):
            return {}
        self._window = [0, 0, 0, 0, 0]
        out: dict[str, float] = {"episode/count": float(episodes)}
        if episodes:
            out["episode/turns_mean"] = turns / episodes
            out["episode/tokens_mean"] = tokens / episodes
            out["episode/tool_calls_mean"] = tried / episodes
            out["episode/valid_call_frac"] = valid / tried if tried else 0.0
        out.update({f"episode/calls_{name}": float(n) for name, n in self.calls.items()})
        out.update({f"episode/errors_{kind}": float(n) for kind, n in self.errors.items()})
        out.update({f"episode/end_{reason}": float(n) for reason, n in self.ends.items()})
        out["episode/tool_result_cuts"] = float(self.cuts)
        return out
