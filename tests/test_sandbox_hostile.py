"""Hostile code stays in its sandbox, and the pool stays healthy after each case."""

from __future__ import annotations

import os
import socket
import threading
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


# --- clean state between execs ------------------------------------------------------------
_SCAN_MEMORY = """
import ctypes, re
ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: lets us open our own /proc/self/mem
marker = b"LEAK" + b"MARK:"
found = set()
with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
    for line in maps:
        fields = line.split()
        if not fields[1].startswith("r") or (len(fields) > 5 and fields[5].startswith("[v")):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        try:
            mem.seek(start)
            chunk = mem.read(end - start)
        except (OSError, OverflowError, ValueError):
            continue
        for m in re.finditer(re.escape(marker) + rb"[0-9a-f]{16}", chunk):
            found.add(m.group()[len(marker):].decode())
print(sorted(found))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_exec_cannot_read_earlier_execs_from_memory(backend):
    """Code, stdin and output of one exec must not be in the next exec's memory."""
    import secrets

    code_secret, stdin_secret, out_secret = (secrets.token_hex(8) for _ in range(3))
    with ForkServerSandbox(backend, SandboxLimits(timeout_s=10)) as sandbox:
        first = sandbox.exec(
            f"import sys\nkept = 'LEAKMARK:{code_secret}'\nsys.stdin.read()\n"
            f"print('LEAKMARK:' + '{out_secret}')",
            stdin=f"LEAKMARK:{stdin_secret}",
        )
        assert first.ok, first
        second = sandbox.exec(_SCAN_MEMORY)
        assert second.ok, second
    for secret in (code_secret, stdin_secret, out_secret):
        assert secret not in second.stdout, f"exec 2 read exec 1's data: {second.stdout}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_posix_message_queues_do_not_survive_an_exec(backend):
    needs_root("per-exec clean state")
    name = f"/loomrl-leak-{os.getpid()}"
    make = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"q = libc.mq_open({name.encode()!r}, 0o102, 0o666, None)\n"  # O_CREAT | O_RDWR
        "print('made' if q >= 0 else 'refused', ctypes.get_errno())\n"
    )
    probe = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"q = libc.mq_open({name.encode()!r}, 2)\nprint('opened' if q >= 0 else 'absent')\n"
    )
    try:
        with ForkServerSandbox(backend, SandboxLimits(timeout_s=3)) as sandbox:
            made = sandbox.exec(make)
            assert made.ok and made.stdout.startswith("refused"), made
            assert sandbox.exec(probe).stdout.strip() == "absent"
    finally:  # the process backend shares the host's IPC namespace: never leave one there
        import ctypes

        ctypes.CDLL(None).mq_unlink(name.encode())
    assert not os.path.exists(f"/dev/mqueue{name}")


# --- the server cannot be killed, stopped or hung ----------------------------------------
def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("PPid:"))


def _server_alive_and_outside_cgroup(pool) -> None:
    """Between execs the code's cgroup holds at most the next exec child, waiting; its
    parent, the server, is alive and outside the cgroup."""
    with pool._cond:
        sandboxes = list(pool._idle)
    for sandbox in sandboxes:
        assert sandbox.alive
        if sandbox.cgroup is not None:
            members = sandbox.cgroup.pids()
            assert len(members) <= 1, f"processes left in the code's cgroup: {members}"
            for pid in members:
                server = _ppid(pid)
                assert server not in members and os.path.exists(f"/proc/{server}")


def test_filling_tmpfs_under_the_memory_limit_leaves_the_server_alive(pool):
    stronger_only(pool.backend, "the work dir on a private tmpfs")
    needs_root("per-sandbox memory cgroup")
    code = (
        "import os\nchunk = b'x' * (1 << 20)\ni = 0\ntry:\n"
        "    while i < 2048:\n"
        "        with open(f'f{i}', 'wb') as f:\n"
        "            for _ in range(32):\n                f.write(chunk)\n"
        "        i += 1\n"
        "except OSError as e:\n    print('stopped', i, e.errno)\n"
        "hog = [bytearray(1 << 20) for _ in range(200)]\nprint('done')\n"
    )
    result = pool.exec(code, timeout_s=20)
    assert result.reason != "sandbox_lost", result
    _server_alive_and_outside_cgroup(pool)


def test_deeply_nested_directories_are_cleaned_up(pool):
    needs_root("cleanup of the work dir")
    depth = 3000 if pool.backend == "bwrap" else 1500  # the process backend is on disk
    code = f"import os\nfor _ in range({depth}):\n    os.mkdir('d')\n    os.chdir('d')\nprint('deep')\n"
    result = pool.exec(code, timeout_s=20)
    assert result.ok, result
    assert pool.metrics()["sandbox/infra_failures"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_tiny_files_are_cleaned_up_within_the_deadline(backend):
    """Clean-up stops at its deadline (the sandbox is replaced instead of blocking the pool)."""
    needs_root("cleanup of the work dir")
    count = 100_000 if backend == "bwrap" else 20_000  # the process backend writes to disk
    code = f"import os\nfor i in range({count}):\n    os.close(os.open(str(i), 0o101))\n"
    limits = SandboxLimits(timeout_s=60, cpu_s=60, cleanup_s=0.2)
    with ForkServerSandbox(backend, limits) as sandbox:
        result = sandbox.exec(code)
        assert result.ok, result
        assert result.timings_ms["cleanup_ms"] < 200 + 800, result.timings_ms


def test_a_sigstop_spinner_cannot_stop_the_reaper(pool):
    needs_root("a reaper the code cannot signal")
    code = (
        "import os, signal\nif os.fork() == 0:\n    os.setsid()\n    while True:\n"
        "        try:\n            os.kill(-1, signal.SIGSTOP)\n        except OSError:\n"
        "            pass\nprint('spinner started')\n"
    )
    t0 = time.monotonic()
    result = pool.exec(code, timeout_s=5)
    assert result.reason != "sandbox_lost", result
    assert time.monotonic() - t0 < 15, "the server hung on a stopped reaper"
    _server_alive_and_outside_cgroup(pool)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_exec_that_loses_its_sandbox_is_its_own_failure(backend):
    """Losing the server mid-exec is a result (counted, sandbox replaced), never a retry."""
    with SandboxPool(backend, min_warm=1, max_warm=1, max_sandboxes=1, max_retries=2) as pool:
        deadline = time.monotonic() + 30
        while not pool._idle and time.monotonic() < deadline:
            time.sleep(0.05)
        victim = pool._idle[0]
        killer = threading.Timer(0.5, lambda: os.killpg(victim._proc.pid, 9))
        killer.start()
        result = pool.exec("import time\ntime.sleep(5)", timeout_s=10)
        killer.join()
        assert result.reason == "sandbox_lost" and not result.ok, result
        m = pool.metrics()
        assert m["sandbox/infra_retries"] == 0 and m["sandbox/infra_failures"] == 0, m
        assert m["sandbox/kills_sandbox_lost"] == 1 and m["sandbox/quarantined"] == 1, m
        assert pool.exec("print(2)").stdout == "2\n"


def test_remove_tree_is_iterative_and_stops_at_its_deadline(tmp_path):
    from loomrl.sandbox.forkserver_cleanup import remove_tree

    deep = tmp_path / "deep"
    path = str(deep)
    os.mkdir(path)
    fd = os.open(path, os.O_RDONLY)
    for _ in range(2000):  # deeper than the recursion limit, and past PATH_MAX
        os.mkdir("dddd", dir_fd=fd)
        child = os.open("dddd", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.close(fd)
    wide = tmp_path / "wide"
    wide.mkdir()
    for i in range(3000):
        (wide / str(i)).touch()
    assert not remove_tree(str(wide), time.monotonic() - 1)  # out of time: stops, says so
    assert remove_tree(str(deep), time.monotonic() + 120) and not deep.exists()
    assert remove_tree(str(wide), time.monotonic() + 120) and not wide.exists()


def test_socket_families_are_an_allow_list(pool):
    stronger_only(pool.backend, "seccomp filter")
    code = (  # AF_VSOCK, AF_PACKET, AF_ALG, AF_BLUETOOTH, netlink audit: refused at creation
        "import socket\nfor fam, typ, proto in [(40, 1, 0), (17, 3, 0), (38, 5, 0), (31, 1, 0),"
        " (16, 3, 9), (1, 1, 0), (2, 1, 0), (10, 2, 0), (16, 3, 0)]:\n"
        "    try:\n        socket.socket(fam, typ, proto).close(); print('made', fam)\n"
        "    except OSError as e:\n        print('refused', fam, e.errno)\n"
    )
    lines = pool.exec(code).stdout.splitlines()
    assert lines[:5] == [f"refused {f} 97" for f in (40, 17, 38, 31, 16)], lines
    assert lines[5:] == ["made 1", "made 2", "made 10", "made 16"], lines


def _host_tcp_mem_bytes() -> int:
    """The host's TCP buffer memory (one pool for every socket of every namespace)."""
    with open("/proc/net/sockstat") as f:
        for line in f:
            if line.startswith("TCP:"):
                fields = line.split()
                return int(fields[fields.index("mem") + 1]) * os.sysconf("SC_PAGE_SIZE")
    return 0


_PIN_TCP = """
import socket, time
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(64)
conns, pinned = [], 0
for _ in range(48):
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    client.setblocking(False)
    chunk = b"x" * 65536
    try:
        while True:
            pinned += client.send(chunk)
    except (BlockingIOError, OSError):
        pass
    conns += [client, server]
print("pinned", pinned >> 20, "MiB")
time.sleep(1.5)
"""


def test_tcp_buffers_cannot_pin_host_kernel_memory(pool):
    needs_root("per-sandbox memory cgroup")
    if pool.backend != "bwrap":
        pytest.skip("process backend: loopback is the host's (covered by the same cgroup limit)")
    baseline, peak = _host_tcp_mem_bytes(), [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _host_tcp_mem_bytes())
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        result = pool.exec(_PIN_TCP, timeout_s=20)
    finally:
        done.set()
        sampler.join()
    assert result.reason in ("exit", "oom", "signal"), result
    grown_mib = (peak[0] - baseline) >> 20
    assert grown_mib < 96, f"one exec pinned {grown_mib} MiB of host TCP memory: {result.stdout}"


def test_uid_leases_are_host_wide_whatever_tmpdir_says(tmp_path, monkeypatch):
    needs_root("uid leases")
    import tempfile

    from loomrl.sandbox.uids import UidAllocator

    base = 990_000  # away from the default range, so live pools are not disturbed
    leases = []
    for name in ("job-a", "job-b"):
        (tmp_path / name).mkdir()
        monkeypatch.setenv("TMPDIR", str(tmp_path / name))
        monkeypatch.setattr(tempfile, "tempdir", None)
        allocator = UidAllocator(base, 4)
        try:
            leases.append(allocator.acquire_specific(base))
        except BlockingIOError:
            leases.append(None)
    assert leases[0] is not None and leases[1] is None, "two jobs leased the same uid"
    leases[0].release()


def _host_sysv_objects_of(uids) -> list[str]:
    found = []
    for kind in ("shm", "msg", "sem"):
        with open(f"/proc/sysvipc/{kind}") as f:
            header, *rows = [line.split() for line in f]
        at = header.index("uid")
        found += [f"{kind} {row[1]}" for row in rows if int(row[at]) in uids]
    return found


@pytest.mark.parametrize("backend", BACKENDS)
def test_sysv_ipc_objects_do_not_survive_an_exec(backend):
    needs_root("per-exec clean state")
    from sandbox_helpers import SANDBOX_UIDS

    make = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.shmget(0x4C4F4F4D, 4096, 0o1666), libc.msgget(0x4C4F4F4D, 0o1666),"
        " libc.semget(0x4C4F4F4D, 1, 0o1666))\n"
    )
    probe = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.shmget(0x4C4F4F4D, 0, 0), libc.msgget(0x4C4F4F4D, 0),"
        " libc.semget(0x4C4F4F4D, 0, 0))\n"
    )
    with SandboxPool(backend, min_warm=1, max_warm=1, max_sandboxes=1) as pool:
        made = pool.exec(make)
        assert made.ok and "-1" not in made.stdout.split(), made
        assert not _host_sysv_objects_of(SANDBOX_UIDS), "SysV objects left on the host"
        assert pool.exec(probe).stdout.split() == ["-1", "-1", "-1"]
