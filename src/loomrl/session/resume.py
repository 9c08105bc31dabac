"""Resuming a run and recording how one ended: the checkpoint to resume from, the
controller's state restored from it, the record cut back to it, and the summary a failed or
aborted run still leaves."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loomrl.config import JobConfig
from loomrl.control import Controller, Counters
from loomrl.data import PromptStream
from loomrl.run_folder import JobResult, write_json_atomically
from loomrl.runtime.base import ExecutorHandle
from loomrl.runtime.supervision import ExecutorLostError, FaultStats
from loomrl.session.inputs import RunInputs
from loomrl.stop_signals import StopSignal
from loomrl.training.base import PublishAfterStepError
from loomrl.training.checkpoint import (
    CheckpointError,
    checkpoint_step,
    find_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    newest_verified,
    restore_rng_state,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumedController:
    """The controller's state at the checkpoint a run resumes from, and the trainer's."""

    version: int
    counters: Counters
    history: dict[str, Any]
    trainer_state: dict[str, Any]

    def controller_kwargs(self) -> dict[str, Any]:
        """The ``Controller`` arguments it restores."""
        return {"version": self.version, "counters": self.counters, "history": self.history}


def resume_state(root: Path, from_step: int | None) -> tuple[Path, dict[str, Any]]:
    """The checkpoint to resume from (the newest, or that of ``from_step``), loaded and
    verified before any model loads; a bad one names the newest one that verifies."""
    path = find_checkpoint(root, from_step) if from_step is not None else latest_checkpoint(root)
    if path is None:
        raise CheckpointError(
            f"no checkpoint under {root}; nothing to resume (start it again with `loomrl run ... "
            f"--output-dir {root.parent} --overwrite`)"
        )
    try:
        return path, load_checkpoint(path)
    except CheckpointError as err:
        good = newest_verified(root, below=path)
        hint = (
            f"; the newest checkpoint that verifies is {good.name}: "
            f"`loomrl resume {root.parent} --from {checkpoint_step(good)}`"
            if good is not None
            else "; no older checkpoint verifies either"
        )
        raise CheckpointError(f"{err}{hint}") from None


def restore(inputs: RunInputs, stream: PromptStream) -> ResumedController:
    """Restore the controller side (data cursor, counters, RNG) from a verified checkpoint:
    what the controller starts from, and the trainer's state for the trainer executor."""
    state, path = inputs.resume_state, inputs.resume_from
    ctl = state["controller"]
    stream.load_state_dict(ctl["stream"])
    counters = Counters(**ctl["counters"])
    counters.generated -= ctl["in_flight"]  # lost in the crash; they will be regenerated
    counters.lost_on_resume += ctl["in_flight"]
    restore_rng_state(state["rng"])
    logger.info("resumed from %s at version %d", path, ctl["version"])
    return ResumedController(ctl["version"], counters, ctl.get("history", {}), state["trainer"])


def already_finished(cfg: JobConfig, run_dir: Path, state: dict[str, Any]) -> JobResult | None:
    """A resume of a run that reached ``num_steps`` and saved its final model changes
    nothing: its summary stays as it was, marked ``already_finished`` for the caller. A run
    that failed or was stopped while saving its final model (its summary says so) is not
    finished: the resume trains no step and saves the final model again."""
    version = state["controller"]["version"]
    summary_path = run_dir / "summary.json"
    if (
        version < cfg.trainer.num_steps
        or not (run_dir / "final").is_dir()
        or not summary_path.is_file()
    ):
        return None
    try:
        summary = {**json.loads(summary_path.read_text()), "already_finished": True}
    # a summary cut short: not finished
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError):
        return None
    # stopped while saving the final model
    if summary.get("job_failed") or summary.get("interrupted"):
        return None
    logger.info(
        "%s already finished (%d of %d steps); nothing to resume",
        run_dir,
        version,
        cfg.trainer.num_steps,
    )
    return JobResult(run_dir, summary, [])


def cut_record(run_dir: Path, resume_from: Path, step: int) -> None:
    """Resuming from ``step``: drop the metrics written after it (those steps run again),
    mark the resume in the record, and set checkpoints newer than it aside."""
    records = []
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a kill -9
            continue
    kept = [r for r in records if int(r.get("step", 0)) <= step]
    lines = [json.dumps(r, sort_keys=True) for r in kept]
    lines.append(
        json.dumps(
            {
                "step": step,
                "event": "resume",
                "resume/from_step": step,
                "resume/dropped_records": len(records) - len(kept),
            },
            sort_keys=True,
        )
    )
    tmp = run_dir / "metrics.jsonl.tmp"
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, run_dir / "metrics.jsonl")
    _cut_eval_samples(run_dir / "eval_samples.jsonl", step)
    for newer in list_checkpoints(resume_from.parent):
        if newer.name > resume_from.name:
            newer.rename(newer.with_name(f"abandoned-{newer.name}"))
            logger.warning(
                "resuming from %s: set the newer %s aside as abandoned-%s",
                resume_from.name,
                newer.name,
                newer.name,
            )


def _cut_eval_samples(path: Path, step: int) -> None:
    """Drop the evaluations after ``step`` from ``eval_samples.jsonl`` (they run again)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if int(json.loads(line).get("version", 0)) <= step:
                kept.append(line + "\n")
        except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
            continue
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def write_failure_summary(run_dir: Path, controller: Controller | None, err: BaseException) -> None:
    """A job that stops with an error, or is aborted (a second Ctrl-C, SIGTERM before or
    after training), still leaves a summary.json saying how far it got, whose accounting
    adds up: rollouts taken for a step that did not finish are counted ``in_step``."""
    interrupted = isinstance(err, KeyboardInterrupt)
    summary: dict[str, Any] = {
        "job_failed": not interrupted,
        "interrupted": interrupted,
        "error": f"{type(err).__name__}: {err}",
        "run_dir": str(run_dir),
    }
    if isinstance(err, StopSignal):
        summary["stopped_by"] = err.name
    if controller is not None:  # ("failed" below counts failed rollouts, as in every summary)
        summary["steps"] = controller.version
        counts = {k.split("/")[1]: v for k, v in controller.accounting().items()}
        parts = ("trained", "dropped_stale", "dropped_zero_variance", "failed", "in_flight")
        accounted = sum(counts[k] for k in parts)
        summary.update(counts, in_step=counts["generated"] - accounted)
        summary["first_failures"] = controller.scorer.first_failures()
        summary["failures_by_kind"] = dict(controller.scorer.failure_counts())
    write_json_atomically(run_dir / "summary.json", summary)


def lost_group_member(
    cfg: JobConfig,
    faults: FaultStats,
    err: PublishAfterStepError,
    handles: Iterable[ExecutorHandle],
) -> ExecutorLostError | None:
    """``err`` as the loss of an executor the job restarts from its checkpoint for, or None
    where the job just fails. A publish that failed after its step under a transport whose
    generators form a group with the trainer (``torch_dist``, the tensor lane's broadcast)
    broke that group: a member died (the trainer sees its connection reset), and a fresh
    process cannot rejoin the group, so it is lost as the trainer would be (counted in
    ``executor/weight_group_failures``; ``handles`` name the members found dead)."""
    if not cfg.weight_sync.forms_group:
        return None
    faults.failures["weight_group"] += 1
    dead = ", ".join(h.name for h in handles if not h.alive) or "none found dead yet"
    transport = cfg.weight_sync.transport.type
    return ExecutorLostError(
        f"the {transport!r} weight group lost a member (dead: {dead}): {err}",
        "generator",
        restarted=False,
    )


def may_restart(cfg: JobConfig, run_dir: Path, faults: FaultStats, err: ExecutorLostError) -> bool:
    """After the trainer (or a torch_dist generator) was lost: may the job restart itself
    from its newest checkpoint? Logs the cause and the decision."""
    limit = cfg.faults.max_restarts
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    if faults.trainer_restarts >= limit:
        logger.error(
            "%s; the job has restarted %d times (faults.max_restarts=%d) and stops",
            err,
            faults.trainer_restarts,
            limit,
        )
        return False
    if checkpoint is None:
        logger.error(
            "%s; no checkpoint to restart from yet (checkpoint.every_steps=%d): the job stops",
            err,
            cfg.checkpoint.every_steps,
        )
        return False
    logger.warning(
        "%s; restarting the job from %s (restart %d of faults.max_restarts=%d)",
        err,
        checkpoint.name,
        faults.trainer_restarts + 1,
        limit,
    )
    return True
