"""One run of a job: its lifecycle (``run``), the executors it starts (``assembly``), what it
reads before any model loads (``inputs``) and how it resumes or records a failure (``resume``)."""

from loomrl.session.run import event_loop_factory, run_job

__all__ = ["event_loop_factory", "run_job"]
