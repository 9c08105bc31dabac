"""Cooperative time-slicing: several RL jobs share devices and fill each other's idle time.

- ``core``: the scheduler as a state machine over explicit time (the daemon and the
  simulator drive the same code), with the lease rules: deadlines, heartbeats, max hold,
  lazy eviction, one lock order for multi-device leases.
- ``policies``: fifo, priority with backfill, weighted fair share (deficit round robin).
- ``store``: SQLite state and event log, so a restarted daemon keeps its queue.
- ``server``: the HTTP daemon (loopback), Prometheus ``/metrics`` and the dashboard;
  ``api`` (the bodies it takes, bounded), ``auth`` (daemon token, per-job secrets),
  ``routes`` (its Starlette app), ``httpd`` (uvicorn serving it: capped connections,
  idle deadlines, every request answered).
- ``client``: the job side: register, heartbeat, ``with client.lease(...)``.
- ``offload``: move a module's (and optimizer's) tensors off the device and back.
- ``simulate``: a discrete-event model of jobs under each policy.

Nothing here is imported unless a job sets ``scheduler.url`` or a scheduler command runs.
"""
