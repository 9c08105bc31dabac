"""The daemon's token file never changes the mode of a folder loomrl did not create
(issue 49, item 4): a token file in a shared, sticky world-writable folder (``/tmp``,
``/dev/shm``) is refused, naming the folder and why, and the folder keeps its mode."""

from __future__ import annotations

import os
import stat

import pytest

from loomrl.cli import main as loomrl_main
from loomrl.scheduler import auth
from loomrl.scheduler.server import SchedulerDaemon


@pytest.fixture
def shared_tmp(tmp_path):
    """A folder like /tmp: sticky and world-writable (made here, not the real /tmp)."""
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o1777)
    return folder


def test_a_token_file_in_a_shared_folder_is_refused_and_the_mode_kept(shared_tmp):
    with pytest.raises(PermissionError, match="writable by others") as info:
        auth.write_token_file(shared_tmp / "loomrl.token")
    assert str(shared_tmp) in str(info.value)
    assert stat.S_IMODE(shared_tmp.stat().st_mode) == 0o1777
    assert list(shared_tmp.iterdir()) == []


def test_the_daemon_refuses_it_too_and_frees_its_port(shared_tmp):
    with pytest.raises(PermissionError, match="writable by others"):
        SchedulerDaemon({"cpu0": [0]}, port=0, token_file=shared_tmp / "loomrl.token")
    assert stat.S_IMODE(shared_tmp.stat().st_mode) == 0o1777


def test_serve_says_why_and_exits_2(shared_tmp, tmp_path, capsys):
    args = ["serve", "--port", "0", "--db", str(tmp_path / "s.db")]
    code = loomrl_main(["scheduler", *args, "--token-file", str(shared_tmp / "loomrl.token")])
    assert code == 2
    assert f"token folder {shared_tmp} is writable by others" in capsys.readouterr().err
    assert stat.S_IMODE(shared_tmp.stat().st_mode) == 0o1777


def test_a_folder_it_creates_is_private_and_an_own_private_one_is_kept(tmp_path):
    made = tmp_path / "new" / "deeper"
    auth.write_token_file(made / "t.token")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert stat.S_IMODE((made / "t.token").stat().st_mode) == 0o600
    own = tmp_path / "own"
    own.mkdir(mode=0o755)
    os.chmod(own, 0o755)
    auth.write_token_file(own / "t.token")
    assert stat.S_IMODE(own.stat().st_mode) == 0o755
