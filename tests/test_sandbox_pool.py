"""SandboxPool: exec basics, adaptive warm buffer, backpressure, retries, quarantine, reaper."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time

import pytest

from loomrl.config import SandboxConfig
from loomrl.sandbox import SandboxError, SandboxLimits, SandboxPool, set_default_pool
from loomrl.sandbox.default import default_pool

from sandbox_helpers import BACKENDS, needs_root, sandbox_code_processes

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def small_pool(backend: str, **kwargs) -> SandboxPool:
    opts = {"min_warm": 1, "max_warm": 2, "max_sandboxes": 3, "limits": SandboxLimits(timeout_s=3)}
    return SandboxPool(backend, **{**opts, **kwargs})


def test_exec_python_command_files_stdin_and_exit_codes(backend):
    with small_pool(backend) as pool:
        r = pool.exec(
            "import sys\nprint(open('data/in.txt').read() + sys.stdin.read())",
            files={"data/in.txt": "from file "},
            stdin="from stdin",
        )
        assert r.ok and r.stdout == "from file from stdin\n", r
        r = pool.exec(command=["sh", "-c", "echo out; echo err >&2; exit 3"])
        assert (r.stdout, r.stderr, r.exit_code, r.reason) == ("out\n", "err\n", 3, "exit")
        r = pool.exec("raise ValueError('boom')")
        assert r.exit_code == 1 and "ValueError: boom" in r.stderr and not r.ok
        r = pool.exec("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)")
        assert r.reason == "signal" and r.signal == signal.SIGTERM
        r = pool.exec(command=["/no/such/program"])
        assert r.exit_code == 127
        with pytest.raises(ValueError):
            pool.exec()  # neither code nor a command
        assert set(r.timings_ms) >= {"setup_ms", "run_ms", "cleanup_ms", "total_ms"}
        m = pool.metrics()
        assert m["sandbox/infra_failures"] == 0 and m["sandbox/execs"] == 5
        assert m["sandbox/kills_signal"] == 1
        with pytest.raises(SandboxError, match="leaves the work dir"):
            # the escape itself now runs (it sat in an `if False`)
            pool.exec("x", files={"../escape": "x"})


def test_file_names_may_not_leave_the_work_dir(backend):
    with small_pool(backend, max_retries=0) as pool:
        with pytest.raises(SandboxError, match="leaves the work dir"):
            pool.exec("print(1)", files={"../../etc/evil": "x"})
        assert pool.exec("print(1)").ok


def test_warm_target_follows_claim_rate_times_ready_p95(backend):
    with small_pool(backend, min_warm=1, max_warm=10, max_sandboxes=12) as pool:
        pool._ready_s.clear()
        pool._ready_s.extend([0.1] * 20)
        pool._claim_times.clear()
        assert pool.warm_target == 1  # no claims: min_warm
        now = time.monotonic()
        pool._claim_times.extend([now] * 100)  # 100 claims in the 5 s window: 20/s
        assert pool.warm_target == 4  # ceil(20/s * 0.1 s * safety 2)
        pool._claim_times.extend([now] * 1000)
        assert pool.warm_target == 10  # clamped to max_warm


def test_buffer_misses_fall_once_the_buffer_has_adapted(backend):
    with small_pool(backend, min_warm=1, max_warm=6, max_sandboxes=8) as pool:

        def burst(n: int) -> None:
            # Each exec lasts 0.2 s, so the n run at once: with instant ones the threads can
            # finish before the last starts, the pool never needs n, and it rightly keeps fewer.
            threads = [
                threading.Thread(target=pool.exec, args=("import time; time.sleep(0.2)",))
                for _ in range(n)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        for _ in range(3):
            burst(4)
        deadline = time.monotonic() + 15  # the filler tops the buffer up to the adapted target
        while time.monotonic() < deadline and pool.metrics()["sandbox/warm"] < 4:
            time.sleep(0.05)
        before = pool.metrics()
        for _ in range(5):
            burst(4)
            time.sleep(0.05)
        after = pool.metrics()
        assert before["sandbox/warm"] >= 4  # adapted to bursts of 4 (the burst peak is kept warm)
        misses = after["sandbox/buffer_misses"] - before["sandbox/buffer_misses"]
        assert misses <= 1, (before, after)


def test_backpressure_waits_then_times_out(backend):
    with small_pool(backend, min_warm=0, max_warm=1, max_sandboxes=1, claim_timeout_s=0.3) as pool:
        slow = threading.Thread(target=pool.exec, args=("import time; time.sleep(1.5)",))
        slow.start()
        time.sleep(0.5)
        with pytest.raises(SandboxError, match="backpressure"):
            pool.exec("print(1)")
        slow.join()
        pool.claim_timeout_s = 10
        assert pool.exec("print(2)").stdout == "2\n"


def test_infra_failure_is_retried_and_quarantined_code_failure_is_not(backend):
    with small_pool(backend, min_warm=1, max_warm=1, max_sandboxes=2) as pool:
        assert pool.exec("import sys; sys.exit(3)").exit_code == 3
        assert pool.metrics()["sandbox/infra_retries"] == 0
        # The first claim found no idle sandbox and started one beside the filler's, so a
        # second may still be starting: wait for it, or the claim below gets a healthy one.
        deadline = time.monotonic() + 30
        with pool._cond:
            while pool._num_starting and time.monotonic() < deadline:
                pool._cond.wait(0.05)
            assert pool._num_starting == 0
            victims = list(pool._idle)
        assert victims
        for sandbox in victims:  # the infrastructure dies under the pool's feet
            os.killpg(sandbox._proc.pid, signal.SIGKILL)
            sandbox._proc.wait()
        result = pool.exec("print('recovered')")
        assert result.stdout == "recovered\n"
        m = pool.metrics()
        assert m["sandbox/infra_failures"] >= 1 and m["sandbox/infra_retries"] >= 1
        assert m["sandbox/quarantined"] >= 1


def test_ttl_retires_sandboxes(backend):
    with small_pool(backend, ttl_s=0.2) as pool:
        pool.exec("print(1)")
        time.sleep(0.4)
        pool.exec("print(1)")
        assert pool.metrics()["sandbox/retired_ttl"] >= 1


def test_reaper_kills_processes_left_under_a_released_uid(backend):
    needs_root("dedicated sandbox uids")
    with small_pool(backend) as pool:
        uid = pool._uids.base + pool._uids.count - 1
        leaked = subprocess.Popen(["sleep", "300"], user=uid, group=uid, extra_groups=[])
        pool._used_uids.add(uid)
        assert pool.reap_leaked() == 1
        assert leaked.wait(timeout=5) == -signal.SIGKILL
        assert pool.metrics()["sandbox/reaped"] == 1


def test_async_exec_and_default_pool(backend):
    with small_pool(backend) as pool:
        set_default_pool(pool)
        try:

            async def main():
                return await asyncio.gather(
                    *(default_pool().aexec(f"print({i})") for i in range(6))
                )

            results = asyncio.run(main())
        finally:
            set_default_pool(None)
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)]


def test_from_config_and_metric_names():
    cfg = SandboxConfig(backend="process", min_warm=0, max_warm=1, max_sandboxes=2, timeout_s=1.0)
    with SandboxPool.from_config(cfg) as pool:
        assert pool.limits.timeout_s == 1.0 and pool.max_sandboxes == 2
        pool.exec("print(1)")
        m = pool.metrics()
    for name in (
        "exec_p50_ms",
        "exec_p99_ms",
        "buffer_misses",
        "miss_rate",
        "kills_timeout",
        "kills_output_cap",
        "kills_oom",
        "kills_leftover",
        "quarantined",
        "infra_retries",
    ):
        assert f"sandbox/{name}" in m
    assert m["sandbox/exec_p50_ms"] > 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ten_thousand_execs_leave_no_process_behind(backend):
    needs_root("dedicated sandbox uids")
    snippets = [
        "print(1)",
        "import subprocess\nsubprocess.Popen(['sleep', '100'], start_new_session=True)",
        "import os\nif os.fork() == 0:\n    os.setsid()\n    import time; time.sleep(100)",
        "while True: pass",
    ]
    pool = SandboxPool(
        backend,
        min_warm=2,
        max_warm=4,
        max_sandboxes=6,
        limits=SandboxLimits(timeout_s=0.2),
        max_execs_per_sandbox=500,
    )
    reasons: dict[str, int] = {}
    lock = threading.Lock()

    def worker(start: int) -> None:
        for i in range(start, 10_000, 4):
            snippet = snippets[3] if i % 500 == 0 else snippets[i % 3]
            r = pool.exec(snippet)
            with lock:
                reasons[r.reason] = reasons.get(r.reason, 0) + 1

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    metrics = pool.metrics()
    pool.close()
    assert sum(reasons.values()) == 10_000 and reasons.get("timeout") == 20, reasons
    assert metrics["sandbox/infra_failures"] == 0, metrics
    assert not sandbox_code_processes()
    children = [
        p
        for p in os.listdir("/proc")
        if p.isdigit() and _parent_of(p) == os.getpid() and not _is_resource_tracker(p)
    ]
    assert not children, "a sandbox (bwrap or server) process is still our child"
    leftover_groups = [
        f"{c}/sb-{uid}"
        for c in ("memory", "pids")
        for uid in pool._used_uids
        if os.path.isdir(f"/sys/fs/cgroup/{c}/loomrl/sb-{uid}")
    ]
    assert not leftover_groups


def _parent_of(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _is_resource_tracker(pid: str) -> bool:
    """multiprocessing's resource tracker: started once per process by the first spawned
    executor of an earlier test (process runtime), it lives as long as pytest does."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False
