"""The controller: the RL loop, with no model code in it.

Generation loops (one per generator) start groups while the staleness gate admits them,
have them generated, then scored into the buffer; the training loop takes full batches,
trains, publishes the new version and opens the gate. ``max_staleness = 0`` is the
synchronous baseline through the same code. The two loops below read as docs/async.md's:

    generation loop (per generator)           training loop
      n = await gate.acquire(k)                 batch = await buffer.take(B, v)  # drops stale groups
      groups = await generate(requests)         metrics = await trainer.train_step(batch, publish=True)
      score the request's groups -> buffer      v += 1; gate.set_version(v)

The plumbing is in components the controller holds: ``Rollouts`` (requests -> groups),
``Intake`` (a request's groups scored into the buffer, less those ``DynamicSampling``
drops), ``Requeues`` (prompts handed out again), ``StepRecord`` (each step's metrics),
``Evaluator``, ``StallWatchdog``, ``Checkpoints``, ``Background`` (its first failure ends a step).
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from types import MappingProxyType
from typing import Any

from loomrl.config import JobConfig
from loomrl.control.background import Background
from loomrl.control.buffer import Batch, RolloutBuffer, StalenessGate
from loomrl.control.checkpoints import Checkpoints
from loomrl.control.evaluation import Evaluator
from loomrl.control.intake import Intake
from loomrl.control.prompts import PromptCache
from loomrl.control.requeues import Requeues
from loomrl.control.rollouts import Rollouts, Versions
from loomrl.control.step_record import BatchFacts, Counters, RunClock, StepRecord
from loomrl.control.watchdog import StallWatchdog
from loomrl.data import PromptStream
from loomrl.runtime.replicas import Replicas
from loomrl.runtime.supervision import ExecutorLostError, FaultStats
from loomrl.runtime.threads import release_later
from loomrl.scoring.client import Scorer
from loomrl.telemetry.metrics import MetricsLogger
from loomrl.training.base import PublishAfterStepError

logger = logging.getLogger(__name__)

_epoch_and_index = operator.attrgetter("epoch", "prompt_index")


class Controller:
    def __init__(
        self,
        cfg: JobConfig,
        *,
        trainer,
        generators: list,
        scorer: Scorer,
        tokenizer,
        train_rows: list[dict[str, Any]],
        eval_rows: list[dict[str, Any]],
        stream: PromptStream,
        metrics: MetricsLogger,
        version: int = 0,
        counters: Counters | None = None,
        on_record: Callable[[dict[str, Any]], None] | None = None,
        env_factory: Callable[[], Any] | None = None,
        extra_metrics: Callable[[], dict[str, float]] | None = None,
        history: dict[str, Any] | None = None,
        max_prompt_tokens: int | None = None,
        leases: Any = None,
        faults: FaultStats | None = None,
    ) -> None:
        self.cfg, self.trainer, self.scorer, self.stream = cfg, trainer, scorer, stream
        self.generators = Replicas(generators)
        self.metrics, self.on_record = metrics, on_record
        self.env_factory = env_factory  # multi-turn environment tasks: one instance per episode
        self.agent: Any = None  # task.agent's episodes (set by session/serving.py)
        # device phases run in scheduler leases (scheduler.url) or colocated turns (device.colocate)
        self.leases = leases
        # Executor failures, restarts and re-queues (loomrl.runtime.supervision); a restarted
        # generator gets a full weight update of the current version before any request.
        self.faults = faults or FaultStats()
        self.counters = counters or Counters()
        self.stop_requested = False  # set by request_stop(): checkpoint after this step, end
        self._stop = False  # the generation loops end
        self._build_pipeline(version)
        self._build_generation(tokenizer, train_rows, eval_rows, max_prompt_tokens)
        self._build_reporting(version, history, extra_metrics)

    def _build_pipeline(self, version: int) -> None:
        """The gate, buffer and requeues rollouts flow through, at ``version``."""
        algo = self.cfg.algorithm
        self.versions = Versions(version, version, algo.max_staleness)
        self.gate = StalenessGate(algo.max_staleness, algo.groups_per_step, version)
        self.buffer = RolloutBuffer(algo.max_staleness)
        self.background = Background()
        self.requeues = Requeues(
            self.stream, self.gate, self.counters, self.faults, self.versions, algo.groups_per_step
        )
        parts = (self.scorer, self.buffer, self.gate, self.counters, self.requeues, self.background)
        self.intake = Intake(*parts, self.cfg)

    def _build_generation(self, tokenizer, train_rows, eval_rows, max_prompt_tokens) -> None:
        """Generate calls (training requests and evaluations), restarted generators' weights."""
        cfg = self.cfg
        encode_all = self.env_factory is None  # (an environment's episodes encode their own turns)
        prompts = PromptCache(
            tokenizer, cfg.data, cfg.model.path, train_rows, max_prompt_tokens, encode_all
        )
        self.rollouts = Rollouts(cfg, prompts, self.versions, self.on_device)
        self.evaluator = Evaluator(
            cfg, eval_rows, self.rollouts, self.generators[0], self.scorer, self.env_factory
        )
        for generator in self.generators:
            if generator.restartable:
                generator.on_restart = self._refresh_restarted_generator

    def _build_reporting(self, version: int, history: dict | None, extra_metrics) -> None:
        """The watchdog, the step record, checkpoints and what a resumed run carries over
        from before its checkpoint (for one whole-run summary)."""
        self.watchdog = StallWatchdog(
            self.cfg.stall_warning_s,
            lambda: (self.trainer, *self.generators, *self.scorer.executors),
            lambda: (self.version + 1, self.cfg.trainer.num_steps, *self._unsettled()),
            stop_after_s=self.cfg.no_step_timeout_s,
            last_failure=lambda: self.scorer.last_error,
        )
        self.step_record = StepRecord(
            self.cfg, self.metrics, self.trainer, self.generators, self.scorer, self.faults
        )
        self.step_record.watch(self.rollouts, self.watchdog, extra_metrics)
        self.resumed = history is not None
        self.history: dict[str, Any] = {"elapsed_s": 0.0, "eval_start": None, **(history or {})}
        self.checkpoints = Checkpoints(self.cfg, version, self.history)

    # -- where the run stands ------------------------------------------------------------

    def _unsettled(self) -> tuple[int, int]:
        return self.requeues.drops_since_step, self.in_flight

    @property
    def version(self) -> int:
        """The trainer's policy version: steps trained."""
        return self.versions.trained

    @property
    def published_version(self) -> int:
        return self.versions.published

    @property
    def in_flight(self) -> int:
        """Rollouts generated but not yet trained, dropped or failed, counted where they are."""
        return self.intake.in_flight

    @property
    def eval_history(self) -> list[dict[str, Any]]:
        return self.evaluator.history

    def accounting(self) -> dict[str, int]:
        return self.counters.accounting(self.in_flight, self.stream.trained_twice)

    def on_device(self, phase: str, call: Callable[[], Awaitable[Any]]) -> Awaitable[Any]:
        """``call()`` as a device phase, to await: in a scheduler lease when the job shares
        its devices (``scheduler.url``), in the trainer's or the generators' turn when they
        share one (``generation.colocate``), else ``call()`` itself."""
        if self.leases is None:
            return call()
        return self.leases.run(phase, call)

    # -- the generation loop -------------------------------------------------------------

    async def _generation_loop(self, generator) -> None:
        per_request = self.cfg.generation.prompts_per_request
        while not self._stop:
            n = await self.gate.acquire(per_request)
            picks = self.stream.next_many(n)
            if self.env_factory or self.agent:  # multi-turn episodes: a task per group
                for epoch, index in picks:
                    episodes = self._episode_group(generator, epoch, index)
                    self.background.watch(asyncio.create_task(episodes))
                continue
            try:
                groups, count, payload = await self.rollouts.generate_groups(generator, picks)
            except ExecutorLostError as err:  # lost with its generator (now replaced)
                await self.requeues.lost_generate(picks, err)
                continue
            self.intake.add(groups, count, payload)  # scored, then into the buffer

    async def _episode_group(self, generator, epoch: int, index: int) -> None:
        """One group of multi-turn episodes (environment tasks): generated and scored together."""
        try:
            group = await (
                self.agent.group(epoch, index)  # task.agent: over the job's endpoint
                if self.agent
                else self.rollouts.episode_group(
                    generator, self.env_factory, epoch, index, self.cfg.task.max_turns
                )
            )
        except ExecutorLostError as err:  # the whole group runs again from its first turn
            await self.requeues.lost_generate([(epoch, index)], err)
            return
        await self.intake.add_episodes(group)

    async def _refresh_restarted_generator(self, generator) -> None:
        """A fresh generator has no weights but the model's own: publish a full snapshot of
        the current version (never a delta on a base it lacks) before it serves a request
        (inside the lost call's own device phase: no second lease)."""
        self.rollouts.reports.forget(id(generator))
        await self.trainer.publish(full=True)

    # -- the training loop ---------------------------------------------------------------

    async def run(self, checkpoint: Callable[[int], Any] | None = None) -> dict[str, Any]:
        """Train to ``trainer.num_steps``; returns a summary of the whole run (a resumed run
        adds its time to the time before the checkpoint and keeps the first eval)."""
        self.checkpoints.save = checkpoint
        await self.on_device("weight_sync", self.trainer.publish)  # version v to every generator
        first_eval = await self.evaluator.first(self.history, self.resumed)
        if first_eval and not self.resumed:
            self._emit({"step": self.version, **first_eval})
        background = [
            self.background.watch(asyncio.create_task(self._generation_loop(g)))
            for g in self.generators
        ]
        background.append(self.background.watch(asyncio.create_task(self.watchdog.run())))
        clock = RunClock(self.history, self.trainer, self.generators, self.scorer)
        self.watchdog.step_done()
        try:
            await self._training_loop(clock)
        finally:
            self._stop = True
            await Background.cancel(background)
            await self.intake.settle(2.0 if self.stop_requested else None)
        final_eval = {} if self.stop_requested else await self.evaluator.evaluate()
        interrupted = self.stop_requested and self.version < self.cfg.trainer.num_steps
        summary = clock.summary(self.counters.trained, self.faults, self.accounting())
        summary.update(steps=self.version, interrupted=interrupted)
        summary.update(eval_start=first_eval.get("eval/mean_reward"))
        summary.update(eval_end=final_eval.get("eval/mean_reward"))
        if final_eval:
            self._emit({"step": self.version, **final_eval, **self.accounting()})
        return summary

    async def _training_loop(self, clock: RunClock) -> None:
        num_steps = self.cfg.trainer.num_steps
        try:
            while self.version < num_steps and not self.stop_requested:
                record = self.background.checked(await self._train_one_step(clock))
                if record is None:  # stopped between steps: keep the last step, if not kept yet
                    await self.checkpoints.if_new(self.version, clock)
                    break
                if self.version % self.cfg.eval.every_steps == 0 and self.version < num_steps:
                    record.update(await self.evaluator.evaluate())
                if self.checkpoints.due(self.version, self.stop_requested):
                    await self.checkpoints.if_new(self.version, clock)
                elapsed = record["timing/elapsed_s"] = clock.elapsed()
                record["throughput/samples_per_s"] = self.counters.trained / max(elapsed, 1e-9)
                self._emit(record)
        except Exception as err:
            # A generator or scorer died while the trainer may live: keep what it trained.
            await self.checkpoints.before_failure(self.version, clock, err)
            raise

    async def _train_one_step(self, clock: RunClock) -> dict[str, Any] | None:
        """Take a batch, train on it (publishing when due), open the gate; the step's
        record. None when a stop was requested while waiting for the batch. A failure
        elsewhere ends only that wait, never a step in progress (``Background.until_failure``)."""
        t0 = time.perf_counter()
        stale = self.requeues.stale
        take = self.buffer.take(self.cfg.algorithm.groups_per_step, self.version, stale)
        batch = await self.background.until_failure(take)
        if batch is None:
            return None
        wait_s = time.perf_counter() - t0
        dropped = await self.intake.dynamic_sampling.after_take(self.version + 1, batch, self.gate)
        facts = BatchFacts.of(batch, dropped)  # (read before the trainer has the batch)
        self.step_record.log_samples(self.version + 1, batch.groups)
        metrics = await self._train(batch)
        await self.gate.set_version(self.version)
        metrics.update(
            self.step_record.build(self.version, facts, wait_s, t0, clock.session_s(), metrics)
        )
        metrics.update(self.accounting())
        release_later(batch)  # (its thousand objects are freed off the loop once this frame ends)
        return metrics

    async def _train(self, batch: Batch) -> dict[str, Any]:
        """The trainer's step on ``batch``, publishing the new version when it is due: in
        the step's own call (one round trip, not two) unless the job's scheduler leases
        keep training and weight sync as device phases of their own. A publish that fails
        after its step raises once the step is counted (a checkpoint then matches)."""
        step = self.version + 1
        publish = step % self.cfg.weight_sync.sync_every == 0 or step == self.cfg.trainer.num_steps
        fused = publish and (self.leases is None or self.leases.publish_in_train_phase)
        try:
            metrics = await self.on_device(
                "train", lambda: self.trainer.train_step(batch.groups, publish=fused)
            )
        except PublishAfterStepError:  # the step stands (the trainer is at ``step``)
            self._count_step(batch)
            raise
        self._count_step(batch)
        if publish:
            if not fused:
                metrics.update(await self.on_device("weight_sync", self.trainer.publish))
            self.versions.published = self.version
        return metrics

    def _count_step(self, batch: Batch) -> None:
        """The trainer took one step on ``batch``: account for it."""
        self.counters.trained += sum(batch.sizes)
        self.stream.mark_trained_many(list(map(_epoch_and_index, batch.groups)))
        self.versions.trained += 1
        self.watchdog.step_done()
        self.requeues.drops_since_step = 0

    # -- the run's edges -----------------------------------------------------------------

    def request_stop(self) -> None:
        """End the run after the step in progress, with a checkpoint of it (for Ctrl-C)."""
        if not self.stop_requested:
            logger.warning(
                "stopping after step %d with a checkpoint (Ctrl-C again aborts)", self.version + 1
            )
        self.stop_requested = True
        self.buffer.interrupt()  # wakes a training loop that waits for a batch

    def _emit(self, record: dict[str, Any]) -> None:
        """Log ``record``, which the caller hands over (it is not changed afterwards: the
        metrics writer takes the dict itself, and ``on_record`` gets a read-only view)."""
        self.metrics.log(record, step=int(record.get("step", self.version)), owned=True)
        if self.on_record is not None:
            self.on_record(MappingProxyType(record))

    def state_dict(self) -> dict[str, Any]:
        history = {
            "elapsed_s": self.history.get("elapsed_s_at_checkpoint", self.history["elapsed_s"]),
            "eval_start": self.history["eval_start"],
        }
        return {
            "version": self.version,
            "stream": self.stream.state_dict(),
            "counters": asdict(self.counters),
            "in_flight": self.in_flight,
            "history": history,
        }
