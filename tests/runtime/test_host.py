"""Host helpers: a free port within a range, and the range as GPUFORGE_REPLICA_PORTS writes it."""

import socket

import pytest

from gpuforge.errors import GpuforgeError
from gpuforge.runtime.host import free_port, port_range


def test_a_port_range_is_read_and_a_bad_one_named():
    assert port_range("41000-41009") == range(41000, 41010) and port_range(None) is None
    for bad in ("80-90", "42000-41000", "41000-70000"):
        with pytest.raises(GpuforgeError, match="GPUFORGE_REPLICA_PORTS: .* FIRST-LAST"):
            port_range(bad)


def test_a_free_port_is_taken_from_the_range_and_a_full_range_says_so():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        with pytest.raises(GpuforgeError, match=f"no free port in {taken}-{taken}"):
            free_port(range(taken, taken + 1))
        start = 47300
        found = {free_port(range(start, start + 3)) for _ in range(20)}
        assert found and found <= set(range(start, start + 3))
