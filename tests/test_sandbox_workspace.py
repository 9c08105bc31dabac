"""Per-episode workspaces: state kept across one episode's calls, never across episodes,
wiped however the episode ends, with the pool's isolation (uid, limits, network)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest
from transformers.utils import get_json_schema

from loomrl.sandbox import SandboxError, SandboxLimits, SandboxPool, WorkspaceLost
from loomrl.sandbox.tools import workspace_tools
from loomrl.sandbox.workspace import check_relative_path

from sandbox_helpers import BACKENDS, needs_root, sandbox_code_processes, stronger_only

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def open_dir():
    """A host dir the sandbox uid may enter (pytest's tmp_path sits under a 0700 dir)."""
    path = tempfile.mkdtemp(prefix="loomrl-ws-test-")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def one_sandbox_pool(backend: str, **kwargs) -> SandboxPool:
    """A pool of exactly one sandbox: the next workspace gets the same sandbox (and uid)."""
    limits = SandboxLimits(timeout_s=3.0, memory_mb=256, cpu_s=5, processes=32)
    opts = {"min_warm": 1, "max_warm": 1, "max_sandboxes": 1, "limits": limits}
    return SandboxPool(backend, **{**opts, **kwargs})


def workspace_dir_on_host(ws) -> str | None:
    """Where the process backend keeps the workspace on the host (bwrap: in its tmpfs)."""
    host = ws._sandbox._host_work_dir
    return os.path.join(host, "w", "ws") if host else None


def test_a_file_from_call_1_is_read_in_call_3_and_gone_after_close(backend):
    with one_sandbox_pool(backend) as pool:
        with pool.workspace() as ws:
            ws.write_file("src/notes.txt", "kept across calls")
            assert ws.run_shell("mkdir -p build && echo 42 > build/out").ok
            third = ws.run_python("print(open('src/notes.txt').read(), open('build/out').read())")
            assert third.stdout == "kept across calls 42\n\n", third
            assert ws.read_file("build/out") == "42\n"
            on_host = workspace_dir_on_host(ws)
        assert not ws.alive
        if on_host is not None:
            assert not os.path.exists(on_host)
        # The same sandbox (the pool has one) serves the next episode: it finds nothing.
        with pool.workspace() as ws2:
            listing = ws2.run_shell("ls -A; ls -A /tmp/w 2>/dev/null; echo end")
            assert listing.stdout == "end\n" or listing.stdout.split() == ["ws", "end"], listing
            with pytest.raises(FileNotFoundError):
                ws2.read_file("src/notes.txt")
        m = pool.metrics()
        assert (m["sandbox/workspaces_opened"], m["sandbox/workspaces_closed"]) == (2, 2)
        assert m["sandbox/started"] == 1 and m["sandbox/workspace_wipe_failures"] == 0


def test_two_concurrent_workspaces_never_see_each_others_files(backend):
    if backend == "process":
        needs_root("on the process backend, a uid of its own per workspace")
    limits = SandboxLimits(timeout_s=3.0)
    with SandboxPool(backend, limits=limits, min_warm=2, max_warm=2, max_sandboxes=2) as pool:
        with pool.workspace() as a, pool.workspace() as b:
            barrier, errors = threading.Barrier(2), []

            def episode(ws, secret: str) -> None:
                try:
                    ws.write_file("secret.txt", secret)
                    barrier.wait(timeout=30)
                    for _ in range(5):
                        assert ws.read_file("secret.txt") == secret
                except Exception as err:  # noqa: BLE001 - re-raised by the test below
                    errors.append(err)

            threads = [threading.Thread(target=episode, args=p) for p in ((a, "A"), (b, "B"))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert errors == []
            # B aims at A's dir by its absolute path: another uid's 0700 dir on the host
            # (process), its own private tmpfs (bwrap). Either way, never A's file.
            a_path = workspace_dir_on_host(a) or "/tmp/w/ws"
            peek = b.run_python(f"print(open({a_path + '/secret.txt'!r}).read())")
            assert "A" not in peek.stdout, peek
            assert b.run_shell(f"cat {a_path}/secret.txt 2>&1 || true").stdout.strip() != "A"


def test_a_hung_call_is_cut_at_its_timeout_and_the_workspace_stays_usable(backend):
    with one_sandbox_pool(backend) as pool, pool.workspace(timeout_s=2.0) as ws:
        ws.write_file("state.txt", "before")
        hung = ws.run_shell("echo started; sleep 60 & sleep 60", timeout_s=0.5)
        assert hung.reason == "timeout" and hung.stdout == "started\n", hung
        assert hung.timings_ms["total_ms"] < 0.5e3 + 3e3
        assert ws.alive and ws.read_file("state.txt") == "before"
        # Nothing of the hung call (its background sleep included) is left running.
        assert not sandbox_code_processes()
        looping = ws.run_python("while True: pass", timeout_s=0.5)
        assert looping.reason == "timeout" and ws.run_python("print('ok')").stdout == "ok\n"
        assert pool.metrics()["sandbox/kills_timeout"] == 2


def test_an_exception_in_the_episode_still_wipes_the_workspace(backend):
    with one_sandbox_pool(backend) as pool:
        with pytest.raises(RuntimeError, match="episode failed"), pool.workspace() as ws:
            ws.write_file("left.txt", "x")
            on_host = workspace_dir_on_host(ws)
            raise RuntimeError("episode failed")
        if on_host is not None:
            assert not os.path.exists(on_host)
        m = pool.metrics()
        assert m["sandbox/workspaces_closed"] == 1 and m["sandbox/busy"] == 0
        with pool.workspace() as ws:
            with pytest.raises(FileNotFoundError):
                ws.read_file("left.txt")
        with pytest.raises(SandboxError, match="closed"):
            ws.run_shell("true")
        ws.close()  # idempotent


@pytest.mark.parametrize("found_dead", [False, True], ids=["race", "found_dead"])
def test_a_killed_sandbox_reports_the_workspace_lost_and_takes_its_files(backend, found_dead):
    """Whether the call finds the sandbox dead (``WorkspaceLost`` at once) or loses it while
    running (``reason="sandbox_lost"``) depends on when the kernel reaps the killed process;
    both lose the workspace, quarantine the sandbox and take its files."""
    with one_sandbox_pool(backend, max_sandboxes=2, max_warm=2) as pool:
        ws = pool.workspace()
        ws.write_file("data.txt", "x")
        on_host = workspace_dir_on_host(ws)
        os.killpg(ws._sandbox._proc.pid, signal.SIGKILL)
        if found_dead:  # the death seen before the next call starts (the kill's usual race)
            ws._sandbox._proc.wait()
            with pytest.raises(WorkspaceLost, match="sandbox is not running"):
                ws.run_shell("cat data.txt")
        else:  # the death seen by the call itself, or before it: either way the loss is said
            try:
                lost = ws.run_shell("cat data.txt")
                assert lost.reason == "sandbox_lost", lost
            except WorkspaceLost:
                pass
        assert not ws.alive
        with pytest.raises(WorkspaceLost):
            ws.read_file("data.txt")
        ws.close()
        assert pool.metrics()["sandbox/quarantined"] == 1
        if on_host is not None:
            assert not os.path.exists(os.path.dirname(os.path.dirname(on_host)))
        with pool.workspace() as fresh:
            assert fresh.run_shell("ls -A").stdout == ""


KILLED_HOST = """
import sys, time
from loomrl.sandbox import SandboxPool, SandboxLimits
pool = SandboxPool("process", min_warm=1, max_warm=1, max_sandboxes=1)
ws = pool.workspace()
ws.write_file("episode.txt", "x")
print(ws._sandbox._host_work_dir, flush=True)
time.sleep(600)
"""


def test_a_host_killed_mid_episode_leaves_no_workspace_behind(open_dir):
    """kill -9 of the process holding a workspace: bwrap's tmpfs dies with its namespace;
    the process backend's dir is removed by the next pool on the machine."""
    env = dict(os.environ, TMPDIR=open_dir)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    host = subprocess.Popen(
        [sys.executable, "-c", KILLED_HOST], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        work_dir = host.stdout.readline().strip()
        assert work_dir.startswith(open_dir) and os.path.isdir(work_dir), work_dir
    finally:
        host.kill()
        host.wait()
    assert os.path.exists(os.path.join(work_dir, "w", "ws", "episode.txt"))
    os.environ["TMPDIR"], before = open_dir, os.environ.get("TMPDIR")
    tempfile.tempdir = None
    try:
        SandboxPool("process", min_warm=0, max_warm=1, max_sandboxes=1).close()
    finally:
        tempfile.tempdir = None
        if before is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = before
    assert not os.path.exists(work_dir)
    assert not sandbox_code_processes()


def test_closing_the_pool_wipes_workspaces_left_open(backend):
    pool = one_sandbox_pool(backend)
    ws = pool.workspace()
    ws.write_file("f.txt", "x")
    on_host = workspace_dir_on_host(ws)
    pool.close()
    ws.close()  # after the pool: nothing left to give back, no error
    if on_host is not None:
        assert not os.path.exists(on_host)
    assert not sandbox_code_processes()


@pytest.mark.parametrize("path", ["../x", "a/../../x", "/etc/passwd", "", ".", "a\0b"])
def test_paths_that_leave_the_workspace_are_refused_before_anything_runs(path):
    with pytest.raises(ValueError):
        check_relative_path(path)


def test_symlinks_cannot_carry_reads_or_writes_out(backend, open_dir):
    """The outside dir is one the sandbox uid could write (process backend): the
    workspace's own check refuses it, not the file permissions."""
    outside = Path(open_dir) / "outside"
    outside.mkdir()
    (outside / "host.txt").write_text("host secret")
    os.chmod(outside, 0o777)
    with one_sandbox_pool(backend) as pool, pool.workspace() as ws:
        ws.run_shell(f"ln -s {outside} out; ln -s {outside}/host.txt leaf; ln -s /etc etc")
        for path in ("out/host.txt", "leaf", "etc/passwd", "out/new.txt"):
            with pytest.raises(ValueError):
                ws.read_file(path)
            with pytest.raises(ValueError):
                ws.write_file(path, "overwritten")
        assert (outside / "host.txt").read_text() == "host secret"
        assert not (outside / "new.txt").exists()
        assert ws.write_file("inside/ok.txt", "fine") == 4


def test_workspace_calls_keep_the_pools_isolation(backend):
    with one_sandbox_pool(backend) as pool, pool.workspace() as ws:
        limits = ws.run_shell("ulimit -n; ulimit -v")
        assert limits.stdout.split() == ["256", str(256 << 10)], limits
        if os.geteuid() == 0:
            assert ws.run_shell("id -u").stdout.strip() == str(ws._sandbox.lease.uid)
        bomb = ws.run_python("x = bytearray(1 << 30)")
        assert not bomb.ok and "MemoryError" in bomb.stderr, bomb
        assert ws.alive and ws.run_shell("echo alive").stdout == "alive\n"


def test_workspace_calls_run_as_an_unprivileged_uid(backend):
    needs_root("dedicated sandbox uid")
    with one_sandbox_pool(backend) as pool, pool.workspace() as ws:
        uid = int(ws.run_shell("id -u").stdout)
        assert uid != 0 and uid == ws._sandbox.lease.uid
        assert "Permission denied" in ws.run_shell("cat /etc/shadow 2>&1; true").stdout


def test_workspace_has_no_network(backend):
    stronger_only(backend, "network isolation")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        with one_sandbox_pool(backend) as pool, pool.workspace() as ws:
            code = textwrap.dedent(f"""
                import socket
                try:
                    socket.create_connection(('127.0.0.1', {port}), timeout=1); print('CONNECTED')
                except OSError as e:
                    print('blocked')
            """)
            assert ws.run_python(code).stdout == "blocked\n"


def test_tools_have_schemas_and_act_on_the_workspace(backend):
    with one_sandbox_pool(backend) as pool, pool.workspace(timeout_s=1.0) as ws:
        tools = {fn.__name__: fn for fn in workspace_tools(ws)}
        schemas = {name: get_json_schema(fn)["function"] for name, fn in tools.items()}
        assert schemas["write_file"]["parameters"]["required"] == ["path", "content"]
        assert schemas["python"]["parameters"]["properties"]["code"]["type"] == "string"
        assert tools["write_file"]("m.py", "X = 7\n") == "wrote 6 bytes to m.py"
        assert tools["python"]("import m; print(m.X * 6)") == "42"
        assert tools["shell"]("exit 3") == "[exit code 3]"
        assert tools["shell"]("true") == "[no output]"
        assert tools["shell"]("sleep 5").endswith("[killed: timeout]")
        assert "ZeroDivisionError" in tools["python"]("1/0")
        assert tools["read_file"]("m.py") == "X = 7\n"
        with pytest.raises(ValueError):
            tools["read_file"]("../m.py")


def test_hostile_leftovers_are_wiped_before_the_next_episode(backend):
    """Locked dirs, a FIFO, thousands of files and a deep tree: the wipe removes them (or
    the sandbox is quarantined); either way the next episode starts empty."""
    with one_sandbox_pool(backend, max_sandboxes=2, max_warm=2) as pool:
        with pool.workspace(timeout_s=10.0) as ws:
            code = textwrap.dedent("""
                import os
                os.makedirs("locked/inner")
                open("locked/inner/f", "w").write("x")
                os.chmod("locked/inner", 0)
                os.chmod("locked", 0)
                os.mkfifo("pipe")
                os.mkdir("many")
                for i in range(2000):
                    open(f"many/{i}", "w").close()
                path = "deep"
                for _ in range(200):
                    path += "/d"
                os.makedirs(path)
            """)
            assert ws.run_python(code).ok
        m = pool.metrics()
        assert m["sandbox/workspaces_closed"] == 1
        with pool.workspace() as fresh:
            assert fresh.run_shell("ls -A").stdout == ""
        assert not sandbox_code_processes()
