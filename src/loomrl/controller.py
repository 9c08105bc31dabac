"""The controller: the RL loop, with no model code in it.

Generation loops (one per generator) start groups while the staleness gate admits them,
score them and put them in the buffer; the training loop takes full batches, trains,
publishes the new version and opens the gate. ``max_staleness = 0`` is the synchronous
baseline through the same code.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from functools import partial
from itertools import chain
from types import MappingProxyType
from typing import Any

from loomrl.buffer import RolloutBuffer, StalenessGate
from loomrl.chat import PromptEncoder
from loomrl.config import JobConfig
from loomrl.data import PromptStream
from loomrl.envs.scorer import JobFailedError, Scorer, group_payload, lost_by_scorer
from loomrl.evaluation import Evaluation
from loomrl.prompt_fit import truncate_ids
from loomrl.runtime.base import ExecutorHandle, release_later
from loomrl.runtime.supervision import ExecutorLostError, FaultStats, TrainerLostError
from loomrl.telemetry.metrics import MetricsLogger
from loomrl.telemetry.samples import ZeroVarianceWatch, step_samples
from loomrl.training.base import PublishAfterStepError
from loomrl.types import GenerationRequest, GenerationResult, Group, Rollout, SamplingParams
from loomrl.watchdog import StallWatchdog

logger = logging.getLogger(__name__)

PROMPT_CACHE_ROWS = 100_000  # training rows whose prompt ids the controller keeps between epochs


@dataclass
class Counters:
    """Rollout accounting: generated = trained + dropped_stale + failed + in_flight."""

    generated: int = 0
    trained: int = 0
    dropped_stale: int = 0
    failed: int = 0
    lost_on_resume: int = 0  # in flight at the checkpoint a run resumed from (regenerated)


_weight_apply_s, _weight_metrics, _engine_metrics, _version, _prompt_ids, _completion_tokens = (
    operator.attrgetter(a)
    for a in (
        "weight_apply_s",
        "weight_metrics",
        "engine_metrics",
        "version",
        "prompt_ids",
        "completion_tokens",
    )
)
_epoch_and_index, _all_ok = (
    operator.attrgetter("epoch", "prompt_index"),
    operator.attrgetter("all_ok"),
)


def _read_reports(
    then: Callable[[list[GenerationResult]], Any] | None, results: list[GenerationResult]
) -> tuple:
    """Off the loop, where a generate call ended: what its results report (an engine puts
    it on one of them), read at C speed, and ``then(results)`` (the results themselves
    when there is no ``then``)."""
    weight = [m for m in map(_weight_metrics, results) if m]
    engine = [m for m in map(_engine_metrics, results) if m]
    return (
        sum(map(_weight_apply_s, results)),
        weight[-1] if weight else None,
        engine[-1] if engine else None,
        max(map(_version, results), default=-1),
        results if then is None else then(results),
    )


def _groups_of(
    picks: list[tuple[int, int]],
    requests: list[GenerationRequest],
    rows: list[dict[str, Any]],
    prompt_key: str,
    results: list[GenerationResult],
) -> tuple:
    """Off the loop, where a training request's generate call ended: the results, their
    groups (None when an engine left the texts to decode: the tokenizer is the loop's),
    how many completions they hold and what a scorer executor takes for them."""
    groups = Group.from_results(
        picks, list(map(_prompt_ids, requests)), rows, prompt_key, results, None
    )
    return (
        results,
        groups,
        sum(map(len, results)),
        None if groups is None else group_payload(groups),
    )


def sample_seed(job_seed: int, epoch: int, index: int) -> int:
    return (job_seed * 1_000_003 + epoch) * 10_000_019 + index


def _summed(dicts) -> dict[str, float]:
    """Key-wise sums: the generators' engine totals as one set of metrics."""
    total: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            total[k] = total.get(k, 0.0) + v
    return total


class Controller(Evaluation, StallWatchdog):
    def __init__(
        self,
        cfg: JobConfig,
        *,
        trainer: ExecutorHandle,
        generators: list[ExecutorHandle],
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
        self.cfg, self.trainer, self.generators, self.scorer = cfg, trainer, generators, scorer
        self.eval_scorer = scorer.for_eval()  # eval failures are counted under eval/*, apart
        self.tokenizer = tokenizer
        self.train_rows, self.eval_rows, self.stream = train_rows, eval_rows, stream
        self.metrics, self.on_record = metrics, on_record
        self.env_factory = env_factory  # multi-turn environment tasks: one instance per episode
        self.extra_metrics = extra_metrics  # e.g. the sandbox pool's sandbox/* metrics
        self.leases = (
            leases  # scheduler.url set: device phases run in leases (loomrl.scheduler.jobside)
        )
        # Executor failures, restarts and re-queues (loomrl.runtime.supervision); a restarted
        # generator gets a full weight update of the current version before any request.
        self.faults = faults or FaultStats()
        for generator in generators:
            if getattr(generator, "restartable", False):
                generator.on_restart = self._refresh_restarted_generator
        self._init_pipeline(version, counters)
        self._sampling = SamplingParams(
            temperature=cfg.generation.temperature,
            top_p=cfg.generation.top_p,
            max_new_tokens=cfg.generation.max_new_tokens,
        )
        self._prompt_key = cfg.data.prompt_key
        self._prompt_encoder = PromptEncoder(tokenizer, cfg.data, cfg.model.path)
        self.max_prompt_tokens = (
            max_prompt_tokens  # prompts past it are cut (data.truncate_prompts)
        )
        self._prompt_ids: dict[int, list[int]] = {}  # training row -> prompt tokens, encoded once
        self._eval_prompt_ids: list[list[int]] | None = (
            None  # the eval rows' prompt tokens, at the first eval
        )
        if env_factory is None and len(train_rows) <= PROMPT_CACHE_ROWS:
            # The whole dataset in one batch now (as a trainer tokenizes its dataset before it
            # starts), not a few prompts per request on the loop while the executors run.
            self._encode_train_prompts(range(len(train_rows)))
        self._all_prompts_encoded = len(self._prompt_ids) == len(
            train_rows
        )  # (then the loop never looks)
        self._init_run_state(version, history)

    def _init_pipeline(self, version: int, counters: Counters | None) -> None:
        """The gate, buffer and counters rollouts flow through, at ``version``."""
        algo = self.cfg.algorithm
        self.version = version
        self.gate = StalenessGate(algo.max_staleness, algo.groups_per_step)
        self.gate.version = version
        self.gate.accepted = version * algo.groups_per_step
        self.buffer = RolloutBuffer(algo.max_staleness)
        self.counters = counters or Counters()
        self.scoring: set[asyncio.Task] = set()
        self.scoring_rollouts = 0
        self.eval_history: list[dict[str, Any]] = []
        self._trained_tokens = 0
        self._generator_weight_metrics: dict[str, float] = {}
        self._renamed_source: dict[
            str, float
        ] = {}  # what _renamed_generator_weight_metrics last renamed
        self._failed_key: tuple | None = None  # the scorer's failures _failed_metrics last named
        self._renamed: dict[str, float] = {}
        self._engine_metrics: dict[
            int, dict[str, float]
        ] = {}  # id(generator handle) -> its engine's totals
        self._apply_s = 0.0  # generator pauses for weight updates since the last step
        self._zero_variance = ZeroVarianceWatch(self.cfg.logging.zero_variance_warning_every_steps)
        self._held: dict[
            int, int
        ] = {}  # id(generator handle) -> the version it last reported holding

    def _init_run_state(self, version: int, history: dict[str, Any] | None) -> None:
        """Stopping, failure and watchdog state, and what a resumed run carries over."""
        self._stop = False
        self._failure: BaseException | None = None
        self._racing: asyncio.Task | None = (
            None  # the task in _until_failure, cancelled by a failure
        )
        self.stall_warnings = 0  # executor calls that ran past stall_warning_s
        self.no_step_warnings = 0  # times no step completed within stall_warning_s
        self.stop_requested = False  # set by request_stop(): checkpoint after this step, end
        self._last_step_at = time.monotonic()
        self._drops_since_step = 0  # groups dropped as stale since the last completed step
        self.last_checkpoint = version  # a resumed run starts at a checkpoint
        self.published_version = version  # the trainer publishes it first thing in run()
        # What a resumed run carries over from before its checkpoint, for one whole-run summary.
        self.resumed = history is not None
        self.history: dict[str, Any] = {"elapsed_s": 0.0, "eval_start": None, **(history or {})}

    # -- accounting ----------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Rollouts generated but not yet trained, dropped or failed, counted where they are."""
        return self.buffer.num_rollouts + self.scoring_rollouts

    def accounting(self) -> dict[str, int]:
        c = self.counters
        return {
            "rollout/generated": c.generated,
            "rollout/trained": c.trained,
            "rollout/dropped_stale": c.dropped_stale,
            "rollout/failed": c.failed,
            "rollout/in_flight": self.in_flight,
            "rollout/lost_on_resume": c.lost_on_resume,
            "rollout/prompts_trained_twice": self.stream.trained_twice,
        }

    def on_device(self, phase: str, call: Callable[[], Awaitable[Any]]) -> Awaitable[Any]:
        """``call()`` as a device phase, to await: in a scheduler lease when the job shares
        its devices (``scheduler.url``), else ``call()`` itself (no coroutine of its own
        around every executor call)."""
        if self.leases is None:
            return call()
        return self.leases.run(phase, call)

    # -- generation ----------------------------------------------------------------------

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    def _encode_train_prompts(self, indices: list[int]) -> None:
        """Encode the training rows' prompts not encoded yet, in one tokenizer call; each is
        encoded once per run (epochs and groups share the ids; nothing downstream changes
        them)."""
        new = [i for i in dict.fromkeys(indices) if i not in self._prompt_ids]
        if not new:
            return
        if (
            len(self._prompt_ids) + len(new) > PROMPT_CACHE_ROWS
        ):  # a huge dataset: keep only recent rows
            self._prompt_ids.clear()
            new = list(dict.fromkeys(indices))
        self._prompt_ids.update(
            zip(new, self._encode_prompts([self.train_rows[i][self._prompt_key] for i in new]))
        )

    def _encode_prompts(self, prompts: list) -> list[list[int]]:
        """Prompts' ids (texts or messages, through the chat template as data.chat_template
        says), each cut to ``max_prompt_tokens``."""
        return [
            truncate_ids(ids, self.max_prompt_tokens, self.tokenizer.bos_token_id)
            for ids in self._prompt_encoder.encode(prompts)
        ]

    def _min_version(self) -> int:
        """The oldest weights a new training request may run on: the latest published
        version, less what max_staleness allows (so in synchronous mode exactly it)."""
        return max(0, self.published_version - self.cfg.algorithm.max_staleness)

    def _require(
        self, requests: list[GenerationRequest], eval_: bool = False
    ) -> list[GenerationRequest]:
        needed = self.published_version if eval_ else self._min_version()
        for request in requests:
            request.min_version = max(request.min_version, needed)
        return requests

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _decode_batch(self, ids: list[list[int]]) -> list[str]:
        """Completions' text, for an engine that did not detokenize them."""
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)

    def _generate(
        self,
        generator: ExecutorHandle,
        requests: list[GenerationRequest],
        then: Callable[[list[GenerationResult]], Any] | None = None,
    ) -> Awaitable[Any]:
        """Apply the newest weights the requests may use, then generate on them: one
        device phase (one lease when the job shares its devices, so no other job's phase
        and no swap comes between applying the weights and using them). To await: the
        results, or ``then(results)``, which runs off the loop where the call ended (it
        must read nothing the loop changes)."""
        return self.on_device(
            "generate", lambda: self._apply_and_generate(generator, requests, then)
        )

    async def _apply_and_generate(
        self,
        generator: ExecutorHandle,
        requests: list[GenerationRequest],
        then: Callable[[list[GenerationResult]], Any] | None,
    ) -> Any:
        # A generator behind the newest published version applies it first, in the same
        # call (one round trip); one that holds it is not asked to look.
        key = id(generator)
        behind = self._held.get(key, -1) < self.published_version
        apply_s, weight_metrics, engine_metrics, version, value = await generator.generate.call(
            requests, apply_newest=behind, then=partial(_read_reports, then)
        )
        self._apply_s += apply_s  # generate's own catch-up, if any
        if weight_metrics is not None:
            self._generator_weight_metrics = weight_metrics
        if engine_metrics is not None:
            self._engine_metrics[key] = engine_metrics
        if version > self._held.get(key, -1):
            self._held[key] = version
        return value

    async def _refresh_restarted_generator(self, generator: ExecutorHandle) -> None:
        """A fresh generator has no weights but the model's own: publish a full snapshot of
        the current version (never a delta on a base it lacks) before it serves a request."""
        self._held.pop(id(generator), None)  # it holds only the model's own weights now
        await self.trainer.publish(
            full=True
        )  # (inside the lost call's own device phase: no second lease)

    async def _requeue_lost(self, picks: list[tuple[int, int]], err: ExecutorLostError) -> None:
        """The generate call of ``picks`` was lost with its generator (now replaced): hand
        each prompt out again, once, and free its place at the gate."""
        if not err.restarted:
            raise err
        for epoch, index in picks:
            self.stream.requeue(epoch, index)
            await self.gate.finish(accepted=False)
        self.faults.requeued_prompts += len(picks)

    async def _generation_loop(self, generator: ExecutorHandle) -> None:
        per_request = self.cfg.generation.prompts_per_request
        group_size = self.cfg.algorithm.group_size
        while not self._stop:
            n = await self.gate.acquire(per_request)
            picks = self.stream.next_many(n)
            if self.env_factory is not None:
                for epoch, index in picks:
                    self._watch(asyncio.create_task(self._episode_group(generator, epoch, index)))
                continue
            if not self._all_prompts_encoded:
                self._encode_train_prompts([i for _, i in picks])
            seed, min_version, prompt_ids = self.cfg.seed, self._min_version(), self._prompt_ids
            requests = [
                GenerationRequest(
                    prompt_ids[i],
                    group_size,
                    self._sampling,
                    sample_seed(seed, epoch, i),
                    min_version,
                )
                for epoch, i in picks
            ]
            # One object per group (its completions as columns), not one per completion (the
            # trainer builds the rollouts it trains on, on its own thread), built where the
            # call ended, off the loop.
            build = partial(_groups_of, picks, requests, self.train_rows, self._prompt_key)
            try:
                results, groups, generated, payload = await self._generate(
                    generator, requests, build
                )
            except ExecutorLostError as err:
                await self._requeue_lost(picks, err)
                continue
            if groups is None:  # texts to decode, with the loop's tokenizer
                groups = Group.from_results(
                    picks,
                    list(map(_prompt_ids, requests)),
                    self.train_rows,
                    self._prompt_key,
                    results,
                    self._decode_batch,
                )
            self.counters.generated += generated
            self.scoring_rollouts += generated
            task = asyncio.create_task(self._score_and_put_groups(groups, generated, payload))
            self.scoring.add(task)
            self._watch(task)
            release_later((requests, results))  # (the groups hold what they need of them)
            del requests, results

    async def _episode_group(self, generator: ExecutorHandle, epoch: int, index: int) -> None:
        """One group of multi-turn episodes (environment tasks): generated and scored together."""
        from loomrl.envs.episode import run_group_episodes

        envs = [self.env_factory() for _ in range(self.cfg.algorithm.group_size)]
        try:
            rollouts = await run_group_episodes(
                envs,
                self.train_rows[index],
                index,
                generate=lambda requests: self._generate(generator, self._require(requests)),
                encode=self._encode,
                decode=self._decode,
                sampling=self._sampling,
                max_turns=self.cfg.task.max_turns,
                seed=sample_seed(self.cfg.seed, epoch, index),
            )
        except ExecutorLostError as err:  # the whole group runs again from its first turn
            await self._requeue_lost([(epoch, index)], err)
            return
        finally:
            for env in envs:
                env.close()
        for r in rollouts:
            if r.status == "failed":
                self.scorer.failures_by_reason["environment"] += 1
                self.scorer.last_error = r.error
        self.counters.generated += len(rollouts)
        self.scoring_rollouts += len(rollouts)
        await self._score_and_put(Group(index, epoch, rollouts))

    async def _score_and_put(self, group: Group) -> None:
        await self._score_and_put_groups([group])

    async def _score_and_put_groups(
        self, groups: list[Group], count: int | None = None, payload: tuple | None = None
    ) -> None:
        """Score the groups of one request together (one reward batch), then put them
        together (one wake-up of the gate and the trainer per request, not per group);
        ``count``: their rollouts, ``payload`` their ``group_payload``, if the caller has them."""
        if count is None:
            count = sum(group.size for group in groups)
        try:
            await self.scorer.score_groups(groups, payload)
        finally:  # they leave "scoring" just as they enter the buffer (or fail)
            self.scoring_rollouts -= count
        await self._put_scored(groups, count)

    async def _put_scored(self, groups: list[Group], count: int) -> None:
        """Put ``groups`` (``count`` rollouts) in the buffer, less their failed rollouts."""
        if all(map(_all_ok, groups)):  # the common case: nothing to look at per rollout
            kept, outcomes = groups, None
        else:
            kept, outcomes = self._drop_failed(groups)
        if kept:
            await self.buffer.put_many(kept)
        await self.gate.finish_many(len(groups), len(kept))
        if outcomes is None:
            self.scorer.record_ok(count)
        else:
            self.scorer.record_outcomes(outcomes)

    def _drop_failed(self, groups: list[Group]) -> tuple[list[Group], list[Rollout]]:
        """Count and remove the failed rollouts of ``groups`` (a prompt no scorer could score
        goes out again); the groups left with any rollout, and every outcome for the
        failure-rate window."""
        outcomes: list[Rollout] = []  # failed and ok
        kept: list[Group] = []
        for group in groups:
            ok = [r for r in group.rollouts if r.status == "ok"]
            if len(ok) < len(group.rollouts):
                self.counters.failed += len(group.rollouts) - len(ok)
                outcomes += [r for r in group.rollouts if r.status != "ok"]
                if all(
                    lost_by_scorer(r) for r in group.rollouts
                ):  # scorers lost it, not the reward
                    self.stream.requeue(group.epoch, group.prompt_index)
                    self.faults.requeued_prompts += 1
                group.rollouts = ok
            outcomes += ok
            if ok:
                kept.append(group)
        return kept, outcomes

    async def _on_drop(self, group: Group) -> None:
        self.counters.dropped_stale += group.size
        self.stream.requeue(group.epoch, group.prompt_index)
        await self.gate.release_accepted()
        self._drops_since_step += 1
        limit = (self.cfg.algorithm.max_staleness + 10) * self.cfg.algorithm.groups_per_step
        if self._drops_since_step > limit:
            raise JobFailedError(
                f"{self._drops_since_step} groups in a row were dropped as too stale without one training "
                f"step (trainer at version {self.version}, newest dropped group from version "
                f"{group.min_version}): the generators are not getting new weights; check weight_sync "
                "(transport, sync_every) and the generator's log"
            )

    # -- training ------------------------------------------------------------------------

    async def _train_one_step(self, started: float) -> dict[str, Any]:
        algo = self.cfg.algorithm
        t0 = time.perf_counter()
        batch = await self._take_batch(algo.groups_per_step)
        if batch is None:  # stop requested while waiting for a batch
            return None
        wait_s = time.perf_counter() - t0
        step = self.version + 1
        publish = step % self.cfg.weight_sync.sync_every == 0 or step == self.cfg.trainer.num_steps
        # Without a scheduler the publish rides in the step's own call (one round trip, not
        # two); with one, training and weight sync stay device phases of their own.
        fused = publish and self.leases is None
        # What the step's record needs from the batch, read before the trainer has it (the
        # batch is not the controller's to read while it trains on it).
        num_rollouts = sum(batch.sizes)
        completion_tokens = sum(map(_completion_tokens, batch.groups))
        rewards = [g.rewards for g in batch.groups]
        reward_sum = sum(chain.from_iterable(rewards))  # (in the order summed before)
        self._record_samples(step, batch.groups)
        try:
            metrics = await self.on_device(
                "train", lambda: self.trainer.train_step(batch.groups, publish=fused)
            )
        except (
            PublishAfterStepError
        ):  # the step stands (the trainer is at ``step``): count it, then fail
            self._count_step(batch, num_rollouts)
            raise
        self._count_step(batch, num_rollouts)
        if publish:
            if not fused:
                metrics.update(await self.on_device("weight_sync", self.trainer.publish))
            self.published_version = self.version
        await self.gate.set_version(self.version)
        elapsed = time.perf_counter() - started
        self._trained_tokens += completion_tokens
        apply_s, self._apply_s = self._apply_s, 0.0
        metrics.update(
            {
                "step": self.version,
                "rollout/reward_mean": reward_sum / num_rollouts,
                "rollout/staleness_mean": sum(batch.staleness) / len(batch.staleness),
                "rollout/staleness_max": max(batch.staleness),
                "rollout/completion_len_mean": completion_tokens / num_rollouts,
                "timing/wait_for_batch_s": wait_s,
                **self._renamed_generator_weight_metrics(),
                "weight_sync/apply_s": apply_s,
                **_summed(self._engine_metrics.values()),
                "throughput/tokens_per_s": self._trained_tokens / max(elapsed, 1e-9),
                "timing/step_s": time.perf_counter() - t0,
                "timing/elapsed_s": elapsed,
                "executor/generator_busy_frac": sum(g.busy_s for g in self.generators)
                / max(elapsed * len(self.generators), 1e-9),
                "executor/trainer_busy_frac": self.trainer.busy_s / max(elapsed, 1e-9),
                "executor/stall_warnings": self.stall_warnings,
                "executor/no_step_warnings": self.no_step_warnings,
                **self._failed_metrics(),
                **self.scorer.reward_metrics(),
                "rollout/zero_variance_frac": self._zero_variance.observe(step, rewards),
                **self.faults.metrics(),
                **(self.extra_metrics() if self.extra_metrics else {}),
                **self.accounting(),
            }
        )
        release_later(batch)  # (its thousand objects are freed off the loop once this frame ends)
        return metrics

    def _record_samples(self, step: int, groups: list) -> None:
        """A few of the step's completions, as text, for samples.jsonl (logging.completions_per_step)."""
        count = self.cfg.logging.completions_per_step
        if count:
            self.metrics.log_samples(step_samples(groups, count), step)

    def _renamed_generator_weight_metrics(self) -> dict[str, float]:
        """The generators' latest ``weight_sync/*`` as ``weight_sync/generator_*`` (renamed
        again only when they changed: one comparison at C speed a step)."""
        source = self._generator_weight_metrics
        if source != self._renamed_source:
            self._renamed_source = dict(source)
            self._renamed = {
                k.replace("weight_sync/", "weight_sync/generator_"): v for k, v in source.items()
            }
        return self._renamed

    def _failed_metrics(self) -> dict[str, int]:
        """The scorer's failures by reason as ``rollout/failed_*`` (built again only when
        a count changed: one tuple comparison a step)."""
        key = tuple(self.scorer.failures_by_reason.items())
        if key != self._failed_key:
            self._failed_key, self._failed = key, {f"rollout/failed_{k}": v for k, v in key}
        return self._failed

    def _count_step(self, batch, num_rollouts: int) -> None:
        """The trainer took one step on ``batch`` (``num_rollouts`` rollouts): account for it."""
        self.counters.trained += num_rollouts
        self.stream.mark_trained_many(list(map(_epoch_and_index, batch.groups)))
        self.version += 1
        self._last_step_at, self._drops_since_step = time.monotonic(), 0

    async def _take_batch(self, count: int):
        """The next batch, or None when a stop is requested first (``request_stop``
        interrupts the buffer)."""
        return await self.buffer.take(count, self.version, self._on_drop)

    async def run(self, checkpoint: Callable[[int], Any] | None = None) -> dict[str, Any]:
        """Train to ``trainer.num_steps``; returns a summary of the whole run (a resumed run
        adds its time to the time before the checkpoint and keeps the first eval)."""
        await self.on_device(
            "weight_sync", self.trainer.publish
        )  # version v to every generator first
        if self.resumed:
            first_eval = {"eval/mean_reward": self.history["eval_start"]}
        else:
            first_eval = await self.evaluate()
            self.history["eval_start"] = first_eval.get("eval/mean_reward")
            if first_eval:
                self._emit({"step": self.version, **first_eval})
        background = [
            self._watch(asyncio.create_task(self._generation_loop(g))) for g in self.generators
        ]
        background.append(asyncio.create_task(self._stall_watchdog()))
        started, loop_cpu, process_cpu = (
            time.perf_counter(),
            time.thread_time(),
            time.process_time(),
        )
        self._last_step_at = time.monotonic()
        base_busy = (
            sum(g.busy_s for g in self.generators),
            self.trainer.busy_s,
            self._scorer_busy_s(),
        )
        try:
            await self._train_steps(started, checkpoint)
        finally:
            self._stop = True
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            # Let scoring in progress land in the buffer, so every rollout stays accounted;
            # after a Ctrl-C only briefly: what is still scoring then stays in flight.
            if self.scoring:
                await asyncio.wait(list(self.scoring), timeout=2.0 if self.stop_requested else None)
        final_eval = {} if self.stop_requested else await self.evaluate()
        elapsed = self._elapsed(started)
        # The loop's own CPU time: neither waiting (no CPU) nor executor calls (other threads
        # or processes), so all the controller's overhead, as a share of this session's wall.
        loop_cpu = time.thread_time() - loop_cpu
        # Every thread of this process (transport threads pickling calls, TensorBoard, and
        # on ``local`` the executors themselves): what the controller's process takes from
        # the machine's cores.
        process_cpu = time.process_time() - process_cpu
        summary = {
            "controller_cpu_s": loop_cpu,
            "controller_overhead": loop_cpu / max(time.perf_counter() - started, 1e-9),
            "controller_process_cpu_s": process_cpu,
            "steps": self.version,
            "elapsed_s": elapsed,
            "samples_per_s": self.counters.trained / max(elapsed, 1e-9),
            "generator_busy_s": sum(g.busy_s for g in self.generators) - base_busy[0],
            "trainer_busy_s": self.trainer.busy_s - base_busy[1],
            "scorer_busy_s": self._scorer_busy_s() - base_busy[2],
            "eval_start": first_eval.get("eval/mean_reward"),
            "eval_end": final_eval.get("eval/mean_reward"),
            "interrupted": self.stop_requested and self.version < self.cfg.trainer.num_steps,
            "faults": self.faults.metrics(),
            **{k.split("/")[1]: v for k, v in self.accounting().items()},
        }
        if final_eval:
            self._emit({"step": self.version, **final_eval, **self.accounting()})
        return summary

    def _scorer_busy_s(self) -> float:
        """Seconds the scorer executors spent in calls (overlapping calls each count)."""
        return (
            sum(s.busy_s for s in self.scorer.executors)
            if self.scorer.executors
            else self.scorer.busy_s
        )

    def _elapsed(self, started: float) -> float:
        """Training seconds of the whole run: before the checkpoint resumed from, and since."""
        return self.history["elapsed_s"] + time.perf_counter() - started

    async def _train_steps(self, started: float, checkpoint: Callable[[int], Any] | None) -> None:
        try:
            while self.version < self.cfg.trainer.num_steps and not self.stop_requested:
                record = await self._until_failure(self._train_one_step(started))
                if record is None:  # stopped between steps: keep the last step, if not kept yet
                    await self._checkpoint_if_new(checkpoint, started)
                    break
                if (
                    self.version % self.cfg.eval.every_steps == 0
                    and self.version < self.cfg.trainer.num_steps
                ):
                    record.update(await self.evaluate())
                if checkpoint and (
                    self.version % self.cfg.checkpoint.every_steps == 0
                    or self.version == self.cfg.trainer.num_steps
                    or self.stop_requested
                ):
                    await self._checkpoint_if_new(checkpoint, started)
                record["timing/elapsed_s"] = self._elapsed(started)
                record["throughput/samples_per_s"] = self.counters.trained / max(
                    record["timing/elapsed_s"], 1e-9
                )
                self._emit(record)
        except Exception as err:
            # A generator or scorer died while the trainer may live: keep what it trained.
            await self._checkpoint_before_failure(checkpoint, started, err)
            raise

    async def _checkpoint_if_new(
        self, checkpoint: Callable[[int], Any] | None, started: float
    ) -> None:
        if checkpoint is not None and self.version > self.last_checkpoint:
            self.history["elapsed_s_at_checkpoint"] = self._elapsed(started)
            await checkpoint(self.version)
            self.last_checkpoint = self.version

    async def _checkpoint_before_failure(
        self, checkpoint, started: float, err: BaseException
    ) -> None:
        if (
            checkpoint is None
            or self.version <= self.last_checkpoint
            or isinstance(err, TrainerLostError)
        ):
            return  # (a lost trainer took its state with it)
        try:
            await self._checkpoint_if_new(checkpoint, started)
        except Exception as ckpt_err:  # noqa: BLE001 - the trainer is gone too: report the first error
            logger.error("could not checkpoint step %d after %r: %r", self.version, err, ckpt_err)
        else:
            logger.warning(
                "job failing (%s); checkpointed step %d first, `loomrl resume` continues",
                err,
                self.version,
            )

    def request_stop(self) -> None:
        """End the run after the step in progress, with a checkpoint of it (for Ctrl-C)."""
        if not self.stop_requested:
            logger.warning(
                "stopping after step %d with a checkpoint (Ctrl-C again aborts)", self.version + 1
            )
        self.stop_requested = True
        self.buffer.interrupt()  # wakes a training loop that waits for a batch

    def _watch(self, task: asyncio.Task) -> asyncio.Task:
        """Remember the first exception of a background task and wake the training loop."""

        def done(t: asyncio.Task) -> None:
            self.scoring.discard(t)
            if not t.cancelled() and t.exception() is not None and self._failure is None:
                self._failure = t.exception()
                if self._racing is not None:  # interrupt the step waiting in _until_failure
                    self._racing.cancel()

        task.add_done_callback(done)
        return task

    async def _until_failure(self, coro) -> Any:
        """Await ``coro`` unless a generation or scoring task fails first; then raise that.

        The failure cancels the task awaiting here (as a task racing ``coro`` would, but
        without two tasks and a wait on the loop every step)."""
        if self._failure is not None:
            coro.close()
            raise self._failure
        self._racing = asyncio.current_task()
        try:
            return await coro
        except asyncio.CancelledError:
            if self._failure is None:  # a cancel from outside (the run is being torn down)
                raise
            self._racing.uncancel()
            raise self._failure from None
        finally:
            self._racing = None

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
