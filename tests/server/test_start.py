"""`gpuforge server` on a port something else holds: one line naming the port, and nothing written."""

import socket

import pytest

from tests.helpers.cli import run_cli

pytestmark = pytest.mark.slow  # every test here is slow (docs/testing.md)


def test_a_busy_port_is_named_before_a_home_or_a_key_is_made(tmp_path):
    home = tmp_path / "home"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = run_cli("server", "--port", str(port), env={"GPUFORGE_HOME": str(home)}, timeout=60)
    assert started.returncode != 0, started.stdout
    said = (started.stdout + started.stderr).strip()
    assert said == f"gpuforge: error: port {port} is in use on 127.0.0.1: another server listens there; " \
        "stop it, or start this one with --port N (or GPUFORGE_PORT)", said  # fmt: skip
    assert not home.exists()  # no store, no admin key made for a server that never listened
