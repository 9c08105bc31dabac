"""Hostile code stays in its sandbox, and the pool stays healthy after each case."""

from __future__ import annotations

import os
import socket
import time

import pytest

from loomrl.sandbox import ForkServerSandbox, SandboxLimits, SandboxPool

from sandbox_helpers import BACKENDS, needs_root, sandbox_code_processes, stronger_only

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", params=BACKENDS)
def pool(request):
    limits = SandboxLimits(timeout_s=3.0, memory_mb=256, cpu_s=5, processes=32)
    p = SandboxPool(request.param, limits=limits, min_warm=1, max_warm=2, max_sandboxes=4)
    yield p
    p.close()
    assert not sandbox_code_processes()


@pytest.fixture(autouse=True)
def healthy_after(request):
    yield
    if "pool" not in request.fixturenames:
        return
    pool = request.getfixturevalue("pool")
    result = pool.exec("print('still ok')")
    assert result.ok and result.stdout == "still ok\n", result
    assert not sandbox_code_processes(), "a sandbox process outlived its exec"
    assert pool.metrics()["sandbox/infra_failures"] == 0


def test_tcp_to_host_listener_is_blocked(pool):
    stronger_only(pool.backend, "network isolation")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        code = (
            "import socket\ntry:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=1); print('CONNECTED')\n"
            "except OSError as e:\n    print('blocked', e)\n"
        )
        result = pool.exec(code)
        assert "blocked" in result.stdout, result
        with pytest.raises(socket.timeout):
            listener.accept()


def test_no_dns_or_outside_network(pool):
    stronger_only(pool.backend, "network isolation")
    code = (
        "import socket\ntry:\n    socket.create_connection(('10.255.255.1', 80), timeout=1)\n"
        "except OSError as e:\n    print('blocked', e.errno)\n"
    )
    assert "blocked" in pool.exec(code).stdout


def test_writing_outside_the_work_dir_fails_or_is_cleaned(pool, tmp_path):
    needs_root("file permissions")
    target_dir = tmp_path / "host"
    target_dir.mkdir(mode=0o755)
    marker = f"/tmp/loomrl-hostile-{os.getpid()}"
    code = (  # noqa: UP031
        "import os\nfor p in [%r, '/usr/loomrl-hostile', '/etc/loomrl-hostile', %r, '../escape']:\n"
        "    try:\n        open(p, 'w').write('x'); print('WROTE', p)\n"
        "    except OSError as e:\n        print('denied', p, e.errno)\n"
    ) % (str(target_dir / "f"), marker)
    result = pool.exec(code)
    assert not (target_dir / "f").exists()
    assert not os.path.exists("/usr/loomrl-hostile") and not os.path.exists("/etc/loomrl-hostile")
    assert not os.path.exists(marker), "a file written to the host /tmp survived the exec"
    if pool.backend == "bwrap":
        assert "WROTE" not in result.stdout, result.stdout


def test_cannot_read_host_home_or_secrets(pool, tmp_path):
    needs_root("file permissions")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET-42")
    os.chmod(tmp_path, 0o700)
    code = (  # noqa: UP031
        "import os\nfor p in [%r, '/root', '/home', os.path.expanduser('~root')]:\n"
        "    try:\n"
        "        print(open(p).read() if os.path.isfile(p) else os.listdir(p))\n"
        "    except OSError as e:\n        print('denied', p, e.errno)\n"
    ) % str(secret)
    result = pool.exec(code)
    assert "TOPSECRET-42" not in result.stdout + result.stderr
    assert ".pyenv" not in result.stdout, "the host's /root was listed"


def test_cannot_read_other_processes_proc(pool):
    needs_root("process isolation")
    os.environ["LOOMRL_HOSTILE_SECRET"] = "proc-secret-77"
    try:
        code = (
            "import os\nfound = []\nfor pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
            "    try:\n        found.append(open(f'/proc/{pid}/environ', 'rb').read())\n"
            "    except OSError:\n        pass\n"
            "print(b''.join(found).decode(errors='replace'))\n"
            "print('PIDS', len([p for p in os.listdir('/proc') if p.isdigit()]))\n"
            f"print(os.path.exists('/proc/{os.getpid()}/cmdline'))\n"
        )
        result = pool.exec(code)
        assert "proc-secret-77" not in result.stdout
        if pool.backend == "bwrap":
            num_pids = int(result.stdout.split("PIDS ")[1].split()[0])
            assert num_pids <= 4, "the sandbox sees host processes"
            assert result.stdout.strip().endswith("False")
    finally:
        del os.environ["LOOMRL_HOSTILE_SECRET"]


def test_environment_variables_do_not_leak(pool):
    os.environ["LOOMRL_LEAK_CHECK"] = "env-secret-99"
    try:
        py = pool.exec("import os; print(sorted(os.environ.items()))")
        sh = pool.exec(command=["env"])
    finally:
        del os.environ["LOOMRL_LEAK_CHECK"]
    for result in (py, sh):
        assert result.ok, result
        assert "env-secret-99" not in result.stdout
        assert "/root" not in result.stdout


def test_fork_bomb_is_contained(pool):
    needs_root("RLIMIT_NPROC on a dedicated uid")
    code = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    t0 = time.monotonic()
    result = pool.exec(code, timeout_s=1.5)
    assert time.monotonic() - t0 < 15
    assert result.reason in ("timeout", "cpu_limit", "signal"), result


def test_memory_bomb_is_contained(pool):
    result = pool.exec("x = []\nwhile True:\n    x.append(bytearray(32 << 20))\n", timeout_s=5)
    assert not result.ok
    assert result.reason in ("exit", "oom", "signal"), result
    if result.reason == "exit":
        assert "MemoryError" in result.stderr


def test_infinite_loop_times_out(pool):
    t0 = time.monotonic()
    result = pool.exec("while True:\n    pass\n", timeout_s=0.5)
    assert result.reason == "timeout" and result.exit_code is None
    assert time.monotonic() - t0 < 5


def test_sleep_past_timeout(pool):
    t0 = time.monotonic()
    result = pool.exec("import time\nprint('before', flush=True)\ntime.sleep(60)", timeout_s=0.5)
    assert result.reason == "timeout"
    assert result.stdout == "before\n"
    assert time.monotonic() - t0 < 5


def test_gigabytes_on_stdout_hit_the_cap(pool):
    code = "import sys\nblock = 'x' * 65536\nwhile True:\n    sys.stdout.write(block)\n"
    result = pool.exec(code, max_output_bytes=100_000, timeout_s=10)
    assert result.reason == "output_cap" and result.truncated
    assert len(result.stdout) <= 100_000


def test_killing_the_parent_fails(pool):
    needs_root("a server the code cannot signal")
    code = (
        "import os, signal\nfor pid in (os.getppid(), 1, -1):\n"
        "    try:\n        os.kill(pid, signal.SIGKILL); print('killed', pid)\n"
        "    except OSError as e:\n        print('denied', pid, e.errno)\n"
    )
    before = pool.metrics()["sandbox/quarantined"]
    result = pool.exec(code)
    assert f"denied {result.stdout.split()[1]}" in result.stdout  # the parent survived
    assert pool.metrics()["sandbox/quarantined"] == before


def test_background_children_are_killed(pool):
    needs_root("kill-by-uid cleanup")
    code = (
        "import os, subprocess, time\n"
        "subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(300)\n"
        "    os._exit(0)\n"
        "print('parent done')\n"
    )
    t0 = time.monotonic()
    result = pool.exec(code, timeout_s=10)
    assert result.ok and result.stdout == "parent done\n", result
    assert time.monotonic() - t0 < 5, "the exec waited for its background children"
    assert result.leftover_killed >= 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_state_survives_to_the_next_exec(backend):
    needs_root("per-exec cleanup under a dedicated uid")
    with ForkServerSandbox(backend, SandboxLimits(timeout_s=3)) as sandbox:
        first = sandbox.exec(
            "import os, builtins, sys\nbuiltins.LEAK = 1\nsys.modules['leak'] = sys\n"
            "os.environ['LEAK'] = '1'\nopen('left.txt', 'w').write('x')\n"
            "open(os.path.expanduser('~/.leak'), 'w').write('x')\n"
            "try:\n    open('/tmp/leak', 'w').write('x')\nexcept OSError:\n    pass\n"
            "print(os.getcwd())"
        )
        assert first.ok, first
        second = sandbox.exec(
            "import os, builtins, sys\n"
            "print(hasattr(builtins, 'LEAK'), 'leak' in sys.modules, 'LEAK' in os.environ,\n"
            "      os.listdir('.'), os.path.exists('/tmp/leak'), os.path.exists(%r))"
            % (first.stdout.strip() + "/left.txt")
        )
        assert second.stdout.strip() == "False False False [] False False", second


def test_seccomp_blocks_namespace_and_mount_calls(pool):
    stronger_only(pool.backend, "seccomp filter")
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.unshare(0x10000000), ctypes.get_errno())\n"
        "print(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno())\n"
        "print(libc.ptrace(0, 0, None, None), ctypes.get_errno())\n"
    )
    result = pool.exec(code)
    assert result.stdout.split() == ["-1", "1"] * 3, result
