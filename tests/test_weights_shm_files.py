"""The shm transport creates its files exclusively and refuses files it does not own."""

from __future__ import annotations

import os

import pytest

from loomrl.weights.transports.base import TransportError
from loomrl.weights.transports.shm import ShmTransport


def test_sender_refuses_a_planted_symlink(tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"keep me")
    t = ShmTransport("planted", root=str(tmp_path))
    os.symlink(target, t.index_path)
    with pytest.raises(TransportError, match="not ours"):
        t.sender()
    assert target.read_bytes() == b"keep me"


def test_sender_refuses_a_file_of_another_user(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to plant a file owned by another uid")
    t = ShmTransport("foreign", root=str(tmp_path))
    t.index_path.write_bytes(b"")
    os.chown(t.index_path, 65534, 65534)
    with pytest.raises(TransportError, match="not ours"):
        t.sender()


def test_stale_own_file_is_replaced_and_files_are_private(tmp_path):
    t = ShmTransport("stale", root=str(tmp_path))
    t.index_path.write_bytes(b"left by a killed sender")
    t.sender()
    try:
        st = os.stat(t.index_path)
        assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid()
    finally:
        t.close()


def test_receiver_refuses_a_world_readable_index(tmp_path):
    t = ShmTransport("loose", root=str(tmp_path))
    t.index_path.write_bytes(b"\0" * 65536)
    os.chmod(t.index_path, 0o644)
    receiver = t.receiver()
    with pytest.raises(TransportError, match="not a private file"):
        receiver.receive(None)
