"""Fixtures of the sandbox tests (test_sandbox.py, test_sandbox_bwrap.py)."""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def listener():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    yield server
    server.close()


@pytest.fixture
def shared_dir():
    """A directory the sandbox user can write (pytest's tmp_path is private to root)."""
    where = Path(tempfile.mkdtemp(prefix="earl-beat-"))
    where.chmod(0o777)
    yield where
    shutil.rmtree(where, ignore_errors=True)
