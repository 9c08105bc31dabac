"""What a run reports: the rollout accounting, each training step's record and the run's summary.

``StepRecord`` reads what it needs of a batch before the trainer has it (``BatchFacts``),
then builds the step's metrics once the step is done: the batch's rewards, staleness and
lengths, timing and throughput, the generators' weight and engine reports, executor busy
fractions and stall counts, failures by reason, faults and the accounting.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from loomrl.config import JobConfig
from loomrl.control.buffer import Batch
from loomrl.control.rollouts import GeneratorReports, Rollouts
from loomrl.control.watchdog import StallWatchdog
from loomrl.runtime.supervision import FaultStats
from loomrl.scoring.client import Scorer
from loomrl.telemetry.metrics import MetricsLogger
from loomrl.telemetry.samples import MismatchWatch, ZeroVarianceWatch, step_samples

_completion_tokens = operator.attrgetter("completion_tokens")


@dataclass
class Counters:
    """Rollout accounting: generated = trained + dropped_stale + dropped_zero_variance +
    failed + in_flight."""

    generated: int = 0
    trained: int = 0
    dropped_stale: int = 0
    dropped_zero_variance: int = 0  # dynamic sampling: groups with nothing to learn from
    failed: int = 0
    lost_on_resume: int = 0  # in flight at the checkpoint a run resumed from (regenerated)
    short_steps: int = 0  # steps dynamic sampling trained on fewer groups than a batch

    def accounting(self, in_flight: int, prompts_trained_twice: int) -> dict[str, int]:
        return {
            "rollout/generated": self.generated,
            "rollout/trained": self.trained,
            "rollout/dropped_stale": self.dropped_stale,
            "rollout/dropped_zero_variance": self.dropped_zero_variance,
            "rollout/failed": self.failed,
            "rollout/in_flight": in_flight,
            "rollout/lost_on_resume": self.lost_on_resume,
            "rollout/prompts_trained_twice": prompts_trained_twice,
            "rollout/short_steps": self.short_steps,
        }


@dataclass
class BatchFacts:
    """What the step's record needs from a batch, read before the trainer has it (the
    batch is not the controller's to read while it trains on it)."""

    num_rollouts: int
    completion_tokens: int
    truncated: int  # completions cut at generation.max_new_tokens
    rewards: list[list[float]]  # per group
    reward_sum: float
    staleness: list[int]
    # the rewards of the groups dynamic sampling dropped for this step
    dropped_rewards: list[list[float]] = field(default_factory=list)

    @classmethod
    def of(cls, batch: Batch, dropped_rewards: list[list[float]] | None = None) -> BatchFacts:
        rewards = [g.rewards for g in batch.groups]
        return cls(
            num_rollouts=sum(batch.sizes),
            completion_tokens=sum(map(_completion_tokens, batch.groups)),
            truncated=sum(g.finish_reasons.count("length") for g in batch.groups),
            rewards=rewards,
            reward_sum=sum(chain.from_iterable(rewards)),  # (in the order summed before)
            staleness=batch.staleness,
            dropped_rewards=dropped_rewards or [],
        )


def summed(dicts) -> dict[str, float]:
    """Key-wise sums: the generators' engine totals as one set of metrics."""
    total: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            total[k] = total.get(k, 0.0) + v
    return total


class StepRecord:
    """Builds each step's record (module docstring)."""

    def __init__(
        self,
        cfg: JobConfig,
        metrics: MetricsLogger,
        trainer,
        generators,
        scorer: Scorer,
        faults: FaultStats,
    ) -> None:
        self.metrics, self.completions_per_step = metrics, cfg.logging.completions_per_step
        self.trainer, self.generators, self.scorer, self.faults = (
            trainer,
            generators,
            scorer,
            faults,
        )
        every = cfg.logging.zero_variance_warning_every_steps
        self.zero_variance = ZeroVarianceWatch(
            every, dynamic_sampling=cfg.algorithm.dynamic_sampling
        )
        self.mismatch = MismatchWatch(cfg.logging.logprob_mismatch_warning, every)
        self.trained_tokens = 0

    def watch(
        self,
        rollouts: Rollouts,
        watchdog: StallWatchdog,
        extra_metrics: Callable[[], dict[str, float]] | None,
    ) -> None:
        """Report the generators' reports (``rollouts.reports``), chat episodes' ``episode/*``,
        the watchdog's counts and ``extra_metrics()`` (e.g. the sandbox pool's ``sandbox/*``)
        in each record; the samples show their prompts as the model saw them
        (``rollouts.prompts``)."""
        self.reports: GeneratorReports = rollouts.reports
        self.episode_stats = rollouts.episode_stats
        self.watchdog, self.extra_metrics = watchdog, extra_metrics
        self.prompt_text = rollouts.prompts.prompt_text

    def log_samples(self, step: int, groups: list) -> None:
        """A few of the step's completions, as text, for samples.jsonl
        (``logging.completions_per_step``), with the prompt as the model saw it."""
        if self.completions_per_step:
            samples = step_samples(groups, self.completions_per_step, self.prompt_text)
            self.metrics.log_samples(samples, step)

    def build(
        self,
        step: int,
        facts: BatchFacts,
        wait_s: float,
        t0: float,
        elapsed: float,
        trained: dict[str, Any],
    ) -> dict[str, Any]:
        """The record of step ``step`` besides ``trained`` (the trainer's metrics, which the
        caller adds; read here for the mismatch warning); ``t0``: when the step began
        waiting for its batch, ``elapsed``: training seconds so far."""
        self.trained_tokens += facts.completion_tokens
        n, staleness = facts.num_rollouts, facts.staleness
        return {
            "step": step,
            "rollout/reward_mean": facts.reward_sum / n,
            "rollout/staleness_mean": sum(staleness) / len(staleness),
            "rollout/staleness_max": max(staleness),
            "rollout/completion_len_mean": facts.completion_tokens / n,
            "timing/wait_for_batch_s": wait_s,
            **self.generator_weight_metrics(),
            "weight_sync/apply_s": self.reports.take_apply_s(),
            **summed(self.reports.engine_metrics.values()),
            "throughput/tokens_per_s": self.trained_tokens / max(elapsed, 1e-9),
            "timing/step_s": time.perf_counter() - t0,
            "timing/elapsed_s": elapsed,
            **self.executor_metrics(elapsed),
            **self.failed_metrics(),
            **self.scorer.reward_metrics(),
            **self.zero_variance.observe(step, facts.rewards, facts.dropped_rewards),
            "rollout/truncated_frac": facts.truncated / n,
            **self.mismatch.observe(step, trained),
            **self.faults.metrics(),
            **self.episode_stats.metrics(),
            **(self.extra_metrics() if self.extra_metrics else {}),
        }

    def executor_metrics(self, elapsed: float) -> dict[str, float]:
        """How busy the executors were over ``elapsed`` seconds, and the watchdog's counts."""
        generators_s = sum(g.busy_s for g in self.generators)
        return {
            "executor/generator_busy_frac": generators_s
            / max(elapsed * len(self.generators), 1e-9),
            "executor/trainer_busy_frac": self.trainer.busy_s / max(elapsed, 1e-9),
            "executor/stall_warnings": self.watchdog.stall_warnings,
            "executor/no_step_warnings": self.watchdog.no_step_warnings,
        }

    def generator_weight_metrics(self) -> dict[str, float]:
        """The generators' latest ``weight_sync/*`` as ``weight_sync/generator_*``."""
        return {
            k.replace("weight_sync/", "weight_sync/generator_"): v
            for k, v in self.reports.weight_metrics.items()
        }

    def failed_metrics(self) -> dict[str, int]:
        """The scorer's failures by reason as ``rollout/failed_*``."""
        return {f"rollout/failed_{k}": v for k, v in self.scorer.failure_counts().items()}


class RunClock:
    """The run's time: training seconds (before the checkpoint resumed from, and since),
    the loop's and the process's CPU, and the executors' busy seconds since the start."""

    def __init__(self, history: dict[str, Any], trainer, generators, scorer: Scorer) -> None:
        self.history, self.trainer, self.generators, self.scorer = (
            history,
            trainer,
            generators,
            scorer,
        )
        self.started = time.perf_counter()
        self._loop_cpu, self._process_cpu = time.thread_time(), time.process_time()
        self._busy_before = self._busy()

    def _busy(self) -> tuple[float, float, float]:
        """Seconds the generators, the trainer and the scorer executors spent in calls
        (overlapping scorer calls each count)."""
        scorers = self.scorer.executors
        scorer_s = sum(s.busy_s for s in scorers) if scorers else self.scorer.busy_s
        return sum(g.busy_s for g in self.generators), self.trainer.busy_s, scorer_s

    def elapsed(self) -> float:
        """Training seconds of the whole run."""
        return self.history["elapsed_s"] + time.perf_counter() - self.started

    def session_s(self) -> float:
        """Seconds since this session's training began."""
        return time.perf_counter() - self.started

    def summary(self, trained: int, faults: FaultStats, accounting: dict[str, int]) -> dict:
        """The run's summary, less its steps and evaluations: ``trained`` rollouts, faults and
        accounting, and its times. The loop's own CPU time is neither waiting (no CPU)
        nor executor calls (other threads or processes), so all the controller's overhead,
        as a share of this session's wall; the process's covers every thread of it
        (transport threads pickling calls, TensorBoard, and on ``local`` the executors)."""
        loop_cpu = time.thread_time() - self._loop_cpu
        process_cpu = time.process_time() - self._process_cpu
        busy = [now - before for now, before in zip(self._busy(), self._busy_before)]
        elapsed = self.elapsed()
        return {
            "controller_cpu_s": loop_cpu,
            "controller_overhead": loop_cpu / max(time.perf_counter() - self.started, 1e-9),
            "controller_process_cpu_s": process_cpu,
            "elapsed_s": elapsed,
            "samples_per_s": trained / max(elapsed, 1e-9),
            "generator_busy_s": busy[0],
            "trainer_busy_s": busy[1],
            "scorer_busy_s": busy[2],
            "faults": faults.metrics(),
            **{k.split("/")[1]: v for k, v in accounting.items()},
        }
