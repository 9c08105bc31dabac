"""cgroup path logic (v1 and v2) against fake cgroupfs trees, and the pool's refusal to run
code without memory limits."""

from __future__ import annotations

import logging

import pytest

from loomrl.sandbox import SandboxError, SandboxPool
from loomrl.sandbox import pool as pool_module
from loomrl.sandbox.cgroups import CgroupLimits, detect, remove_stale_cgroups


def fake_v2(tmp_path, controllers="cpu memory pids io"):
    (tmp_path / "cgroup.controllers").write_text(controllers + "\n")
    (tmp_path / "cgroup.subtree_control").write_text("cpu\n")
    return tmp_path


def fake_v1(tmp_path):
    for c in ("memory", "pids", "cpu"):
        (tmp_path / c).mkdir()
        (tmp_path / c / "cgroup.procs").write_text("")
    return tmp_path


def test_detect_tells_v1_v2_and_neither(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    assert detect(fake_v2(a)) == "v2"
    b = tmp_path / "b"
    b.mkdir()
    assert detect(fake_v2(b, controllers="cpu io")) is None  # no memory controller
    c = tmp_path / "c"
    c.mkdir()
    assert detect(fake_v1(c)) == "v1"
    d = tmp_path / "d"
    d.mkdir()
    assert detect(d) is None


def test_v2_groups_get_memory_swap_and_pids_limits(tmp_path):
    root = fake_v2(tmp_path)
    group = CgroupLimits.create("sb-880001", memory_bytes=640 << 20, max_pids=80, root=root)
    assert group.version == "v2" and group.memory_dir == group.pids_dir == root / "loomrl/sb-880001"
    assert (root / "cgroup.subtree_control").read_text() == "+memory +pids"
    assert (root / "loomrl/cgroup.subtree_control").read_text() == "+memory +pids"
    d = root / "loomrl/sb-880001"
    assert (d / "memory.max").read_text() == str(640 << 20)
    assert (d / "memory.swap.max").read_text() == "0"
    assert (d / "pids.max").read_text() == "80"
    assert group.procs_files == [str(d / "cgroup.procs")]
    assert group.pids_current_file == str(d / "pids.current")
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n")
    assert group.oom_kills() == 2
    group.remove(wait_s=0)  # a real cgroupfs has no regular files to stop rmdir
    for f in d.iterdir():
        f.unlink()
    group.remove(wait_s=0)
    assert not d.exists()


def test_v1_groups_get_memory_swap_tcp_and_pids_limits(tmp_path):
    root = fake_v1(tmp_path)
    group = CgroupLimits.create(
        "sb-7", memory_bytes=1 << 30, max_pids=9, tcp_bytes=16 << 20, root=root
    )
    mem, pids = root / "memory/loomrl/sb-7", root / "pids/loomrl/sb-7"
    assert group.version == "v1" and (group.memory_dir, group.pids_dir) == (mem, pids)
    assert (mem / "memory.limit_in_bytes").read_text() == str(1 << 30)
    assert (mem / "memory.memsw.limit_in_bytes").read_text() == str(1 << 30)
    assert (mem / "memory.kmem.tcp.limit_in_bytes").read_text() == str(16 << 20)
    assert (pids / "pids.max").read_text() == "9"
    assert group.procs_files == [str(mem / "tasks"), str(pids / "tasks")]
    (mem / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 4\n")
    assert group.oom_kills() == 4


def test_stale_groups_are_removed_on_both_versions(tmp_path):
    for parent in ("loomrl", "memory/loomrl", "pids/loomrl"):
        for name in ("sb-1", "sb-2", "other"):
            (tmp_path / parent / name).mkdir(parents=True)
    assert remove_stale_cgroups(lambda uid: uid == 1, root=tmp_path) == 3
    assert not (tmp_path / "loomrl/sb-1").exists() and (tmp_path / "loomrl/sb-2").exists()
    assert (tmp_path / "memory/loomrl/other").exists()


def test_no_cgroups_raises_a_clear_error(tmp_path):
    with pytest.raises(OSError, match="no writable cgroup"):
        CgroupLimits.create("sb-1", 1, 1, root=tmp_path)


def test_pool_refuses_to_run_code_without_memory_limits(monkeypatch, caplog):
    monkeypatch.setattr(pool_module, "cgroups_writable", lambda: False)
    with pytest.raises(SandboxError, match="allow_no_memory_limit"):
        SandboxPool("process", min_warm=0)
    with caplog.at_level(logging.WARNING):
        SandboxPool("process", min_warm=0, allow_no_memory_limit=True).close()
    assert "without memory limits" in caplog.text


def test_auto_falling_back_to_process_is_a_warning_and_a_metric(monkeypatch, caplog):
    from loomrl.sandbox import backends

    monkeypatch.setattr(backends, "bwrap_path", lambda: None)
    with caplog.at_level(logging.WARNING):
        with SandboxPool("auto", min_warm=0, allow_no_memory_limit=True) as pool:
            assert pool.backend == "process"
            assert pool.metrics()["sandbox/backend_fallbacks"] == 1
    assert "fell back to the weaker 'process' backend" in caplog.text
