"""The ``loomrl`` command. Imports no torch until a job actually runs."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from loomrl import __version__
from loomrl.safe_text import SafeFormatter, escape_controls

EPILOG = """examples:
  loomrl run examples/arithmetic/job.toml
  loomrl run examples/arithmetic/job.toml algorithm.max_staleness=0 trainer.lr=3e-4
  loomrl resume runs/arithmetic-20261129-120000
  loomrl eval examples/arithmetic/job.toml --checkpoint runs/arithmetic-20261129-120000/final
  loomrl config            # every config key with its default and description
  loomrl scheduler serve --device cpu0=0 --policy fair   # share a device between jobs
  loomrl simulate --scenario llm-d
"""


def _print_summary(result) -> None:
    from rich.console import Console
    from rich.table import Table

    s = result.summary
    if s.get("already_finished"):
        print(f"already finished: {result.run_dir} ran all {s['steps']} steps; nothing to resume")
        return
    title = "run finished"
    if s.get("interrupted"):
        title = f"run interrupted by {s.get('stopped_by') or 'SIGINT'}"
    table = Table(title=f"{title}: {result.run_dir}", show_header=False)
    start, end = s.get("eval_start"), s.get("eval_end")
    if start is not None and end is not None:
        table.add_row("eval mean reward", f"{start:.3f} -> {end:.3f} ({end - start:+.3f})")
    table.add_row("steps", str(s["steps"]))
    table.add_row("training time", f"{s['elapsed_s']:.1f} s")
    table.add_row("samples/s", f"{s['samples_per_s']:.1f}")
    table.add_row(
        "rollouts",
        f"generated {s['generated']} = trained {s['trained']} + dropped stale {s['dropped_stale']}"
        f" + dropped zero-variance {s.get('dropped_zero_variance', 0)}"
        f" + failed {s['failed']} + in flight {s['in_flight']}",
    )
    faults = s.get("faults") or {}
    failures = {
        k.split("/")[1][: -len("_failures")]: v
        for k, v in faults.items()
        if k.endswith("_failures") and v
    }
    if failures or faults.get("executor/trainer_restarts"):
        table.add_row(
            "executor faults",
            ", ".join(f"{role} {n:.0f} lost" for role, n in failures.items())
            + f"; {faults.get('executor/restarts', 0):.0f} restarted, {faults.get('executor/hung_kills', 0):.0f} hung, "
            f"{faults.get('executor/requeued_prompts', 0):.0f} prompts re-queued, "
            f"{faults.get('executor/trainer_restarts', 0):.0f} job restarts from a checkpoint",
        )
    if not s.get("interrupted"):
        table.add_row("final model", str(result.run_dir / "final"))
    Console().print(table)


def _execute(job_fn, total_steps: int, run_dir: str) -> int:
    from loomrl.config import ConfigError
    from loomrl.progress import StepProgress

    try:
        # (the bar is drawn from the first step on: an early error stands alone)
        with StepProgress(total_steps) as progress:
            result = job_fn(progress.on_record)
    except (
        KeyboardInterrupt
    ) as err:  # a second Ctrl-C (or SIGTERM, SIGHUP), or one outside training
        return _report_interrupt(run_dir, getattr(err, "name", None))
    except (ConfigError, OSError, ValueError, TypeError, RuntimeError, FloatingPointError) as err:
        # Bad input (config, paths, user code, checkpoints), a job stopped for failures and a
        # weight wait that timed out: a one-line message (docs/errors.md says what to do);
        # `loomrl -v ...` shows the traceback too.
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            logging.getLogger(__name__).exception("job failed")
        _print_error(f"{type(err).__name__}: {err}")
        return 2
    _print_summary(result)
    # a first Ctrl-C, SIGTERM or SIGHUP: stopped after a step, checkpointed
    if result.summary.get("interrupted"):
        return _report_interrupt(run_dir, result.summary.get("stopped_by"))
    return 0


def _print_error(text: str) -> None:
    """One ``error: ...`` line on stderr. Errors quote outside text (a completion in a
    reward's error, a dataset row, a handed run folder's config), so it is escaped."""
    print(f"error: {escape_controls(text)}", file=sys.stderr)


def console_log_handler() -> logging.Handler:
    """The CLI's console handler, its output escaped (``SafeFormatter``): the root logger's,
    so executors' records, forwarded to the controller, come through it too."""
    from rich.logging import RichHandler

    handler = RichHandler(show_path=False)
    handler.setFormatter(SafeFormatter("%(message)s"))
    return handler


def _report_interrupt(run_dir: str, signal_name: str | None = None) -> int:
    """Say what an interrupted run left to resume from; the exit status of the signal that
    stopped it (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP)."""
    from pathlib import Path

    from loomrl.stop_signals import exit_status
    from loomrl.training.checkpoint import latest_checkpoint

    last = latest_checkpoint(Path(run_dir) / "checkpoints")
    if last is None:
        print(
            f"interrupted before the first checkpoint: nothing to resume in {run_dir}",
            file=sys.stderr,
        )
    else:
        print(f"interrupted: `loomrl resume {run_dir}` continues from {last.name}", file=sys.stderr)
    return exit_status(signal_name)


def _load_job(args: argparse.Namespace) -> Any:
    """The job file with its overrides, or None once the error is printed; an engine that is
    not installed is refused here, before the progress bar and any model (``run_job`` checks
    it again for ``Job(...).run()``)."""
    from loomrl.config import ConfigError, load_config
    from loomrl.generation.engine_config import engine_install_error

    try:
        cfg = load_config(args.job, list(args.overrides))
    except ConfigError as err:
        _print_error(str(err))
        return None
    missing = engine_install_error(cfg.generation.engine.type, cfg.runtime)
    if missing is not None:
        _print_error(f"ConfigError: {missing}")
        return None
    return cfg


def cmd_run(args: argparse.Namespace) -> int:
    from loomrl.job import Job, default_run_dir

    cfg = _load_job(args)
    if cfg is None:
        return 2
    if args.output_dir:  # set as a value, never pasted into TOML (quotes, backslashes)
        cfg.output_dir = args.output_dir
    cfg.output_dir = str(default_run_dir(cfg))  # fixed now, so an interrupt can name it
    return _execute(
        lambda cb: Job(cfg).run(overwrite=args.overwrite, on_record=cb, progress=False),
        cfg.trainer.num_steps,
        cfg.output_dir,
    )


def cmd_resume(args: argparse.Namespace) -> int:
    from loomrl.job import load_run_config, resume_job

    try:
        cfg = load_run_config(args.run_dir, list(args.overrides))
    except (FileNotFoundError, ValueError) as err:
        _print_error(str(err))
        return 2
    return _execute(
        lambda cb: resume_job(
            args.run_dir,
            on_record=cb,
            from_step=args.from_step,
            overrides=list(args.overrides),
            progress=False,
        ),
        cfg.trainer.num_steps,
        args.run_dir,
    )


def cmd_eval(args: argparse.Namespace) -> int:
    """``loomrl eval JOB.toml [--checkpoint DIR]``: evaluation only (session/evaluate.py)."""
    cfg = _load_job(args)
    if cfg is None:
        return 2
    if args.output_dir:
        cfg.output_dir = args.output_dir
    from loomrl.config import ConfigError
    from loomrl.session.evaluate import evaluate_job

    try:
        result = evaluate_job(cfg, args.checkpoint, overwrite=args.overwrite)
    except KeyboardInterrupt:
        return 130
    except (ConfigError, OSError, ValueError, TypeError, RuntimeError) as err:
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            logging.getLogger(__name__).exception("eval failed")
        _print_error(f"{type(err).__name__}: {err}")
        return 2
    _print_eval(result)
    return 0


def _print_eval(result) -> None:
    """The results as lines (paths whole, never cut to the terminal's width)."""
    r = result.results
    lines = [
        f"eval: {result.run_dir}",
        f"  weights      {r['checkpoint'] or r['model']}",
        f"  prompts      {r['num_prompts']} of {r['data']}",
        f"  mean reward  {r.get('eval/mean_reward', float('nan')):.4f}",
        f"  failed       {r.get('eval/num_failed', 0)}",
        f"  results      {result.run_dir / 'eval.json'}",
        f"  samples      {result.run_dir / 'eval_samples.jsonl'}",
    ]
    print(escape_controls("\n".join(lines)))


def cmd_report(args: argparse.Namespace) -> int:
    from loomrl.telemetry.report import ReportError, build_report

    try:
        out = build_report(args.run_dir, args.out)
    except ReportError as err:
        _print_error(str(err))
        return 2
    except ImportError as err:
        _print_error(f"the report draws with matplotlib: {err}")
        return 2
    print(escape_controls(str(out)))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from loomrl.telemetry.run_status import ReportError, format_status, run_status

    try:
        status = run_status(args.run_dir)
    except ReportError as err:
        _print_error(str(err))
        return 2
    print(json.dumps(status) if args.json else format_status(status))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from loomrl.config import config_reference

    print("\n".join(config_reference()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loomrl",
        description="Asynchronous RL post-training for language models.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"loomrl {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job from a TOML file")
    run.add_argument("job", help="the job's TOML file")
    run.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=3e-4")
    run.add_argument("--output-dir", help="the run folder (default runs/<name>-<timestamp>)")
    run.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a finished or abandoned run in the output dir",
    )
    run.set_defaults(fn=cmd_run)
    resume = sub.add_parser("resume", help="continue a run from its latest checkpoint")
    resume.add_argument("run_dir", help="the run folder")
    resume.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. trainer.num_steps=400 (docs/runs.md)"
    )
    resume.add_argument(
        "--from",
        dest="from_step",
        type=int,
        metavar="STEP",
        help="resume from this step's checkpoint, not the newest",
    )
    resume.set_defaults(fn=cmd_resume)
    _add_view_commands(sub)
    config = sub.add_parser("config", help="list every config key with its default")
    config.set_defaults(fn=cmd_config)
    try:
        from loomrl.sandbox.cli import add_sandbox_commands
    except ImportError as err:  # say why when someone asks for it, instead of hiding it
        broken = sub.add_parser(
            "sandbox", help="try the sandbox by hand (unavailable: see `loomrl sandbox`)"
        )
        broken.add_argument("rest", nargs=argparse.REMAINDER)
        broken.set_defaults(fn=lambda args, err=err: _sandbox_unavailable(err))
    else:
        add_sandbox_commands(sub)
    from loomrl.scheduler.cli import add_scheduler_commands

    add_scheduler_commands(sub)
    return parser


def _add_eval_command(sub) -> None:
    """``loomrl eval JOB.toml [--checkpoint DIR]``."""
    evaluate = sub.add_parser(
        "eval", help="evaluate a job's model or a checkpoint on data.eval (no training)"
    )
    evaluate.add_argument("job", help="the job's TOML file")
    evaluate.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.eval=x.jsonl")
    evaluate.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="a checkpoint (RUN/checkpoints/step_N), a run folder (its newest checkpoint) or a "
        "model folder (RUN/final); default: the job's model.path",
    )
    evaluate.add_argument("--output-dir", help="where to write (default runs/<name>-eval-<time>)")
    evaluate.add_argument("--overwrite", action="store_true", help="replace what is there")
    evaluate.set_defaults(fn=cmd_eval)


def _add_view_commands(sub) -> None:
    """``loomrl eval``, ``loomrl report`` and ``loomrl status`` (a run folder seen from
    outside), and ``loomrl warmstart``."""
    _add_eval_command(sub)
    from loomrl.training.warmstart import add_warmstart_command

    add_warmstart_command(sub)
    report = sub.add_parser("report", help="write a run folder's report.html (plots of the run)")
    report.add_argument("run_dir", help="the run folder")
    report.add_argument("--out", help="where to write the page (default RUN_DIR/report.html)")
    report.set_defaults(fn=cmd_report)
    status = sub.add_parser("status", help="where a run is: step, reward, throughput, failures")
    status.add_argument("run_dir", help="the run folder")
    status.add_argument("--json", action="store_true", help="one JSON object")
    status.set_defaults(fn=cmd_status)


def _sandbox_unavailable(err: ImportError) -> int:
    print(
        f"error: the sandbox commands could not be loaded: {type(err).__name__}: {err}",
        file=sys.stderr,
    )
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # overrides may come after options: `run job.toml --output-dir x a.b=1`
        if getattr(args, "fn", None) in (cmd_run, cmd_resume, cmd_eval) and all(
            "=" in e and not e.startswith("-") for e in extra
        ):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, handlers=[console_log_handler()]
    )
    fn = getattr(args, "fn", None)
    if fn is None:
        return 0
    return int(fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
