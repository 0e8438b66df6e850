"""ThrottledLink: the shaped pair holds its rate, gloo works across it, and nothing is left behind.

Skipped, with the reason, where namespaces, veth or tbf cannot be made (not root, no iproute2, a container
without the capability). Every subprocess runs under a timeout: a broken link fails, it does not hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuforge.launch import throttle
from gpuforge.launch.throttle import ThrottledLink, can_throttle, remove_stale

PROBE = Path(__file__).resolve().parent / "throttle_probe.py"
PORT = 5201  # the namespaces are private to each link: no other process can hold it
TIMEOUT_S = 60


@pytest.fixture(autouse=True)
def _needs_throttle():
    reason = can_throttle()
    if reason is not None:
        pytest.skip(f"cannot make a throttled link here: {reason}")


def _netns() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def _mbit_per_s(link: ThrottledLink, nbytes: int) -> float:
    """Send ``nbytes`` from side 0 to side 1 over one TCP connection; the receiver's rate in Mbit/s."""
    recv_cmd = [sys.executable, str(PROBE), "recv", link.addresses[1], str(PORT)]
    recv = subprocess.Popen(link.command(1, recv_cmd), stdout=subprocess.PIPE, text=True)
    try:
        assert recv.stdout.readline().strip() == "listening"
        send_cmd = [sys.executable, str(PROBE), "send", link.addresses[1], str(PORT), str(nbytes)]
        subprocess.run(link.command(0, send_cmd), check=True, timeout=TIMEOUT_S)
        out, _ = recv.communicate(timeout=TIMEOUT_S)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    result = json.loads(out)
    assert result["bytes"] == nbytes
    return result["bytes"] * 8 / result["seconds"] / 1e6


def test_bandwidth_holds_the_rate():
    nbytes = 10_000_000
    with ThrottledLink(rate_mbit=200) as link:
        slow = _mbit_per_s(link, nbytes)
        link.set_rate(2000)
        fast = _mbit_per_s(link, nbytes)
    print(f"200 Mbit/s link: {slow:.0f} Mbit/s; 2000 Mbit/s link: {fast:.0f} Mbit/s")
    # payload rate: tbf counts Ethernet/IP/TCP headers too, ~4% of a 1500-byte frame. The ceiling shows the
    # shaping; the floor is loose, for a sender slowed by a busy 2-core machine (~192 when idle)
    assert 60 <= slow <= 230
    assert fast > 3 * slow


@pytest.mark.slow
def test_gloo_all_reduce_across_the_link():
    nfloats = 2_500_000  # 10 MB: ~0.4 s at 200 Mbit/s
    with ThrottledLink(rate_mbit=200) as link:
        procs = []
        for rank in (0, 1):
            env = {**os.environ, **link.env(rank), "MASTER_PORT": str(PORT), "RANK": str(rank)}
            env |= {"WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
            cmd = link.command(rank, [sys.executable, str(PROBE), "gloo", str(nfloats)])
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            )
        try:
            outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
        except subprocess.TimeoutExpired:
            pytest.fail(f"the 2-rank gloo job across the link hung (over {TIMEOUT_S}s)")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    result = json.loads(outs[0].strip().splitlines()[-1])
    assert result["sum"] == [3.0] * 4 and result["big_ok"]
    # a 2-rank all-reduce moves about the tensor's size each way; faster than the link means it bypassed it
    mbit = result["bytes"] * 8 / result["seconds"] / 1e6
    print(f"gloo all-reduce of {result['bytes'] / 1e6:.0f} MB: {result['seconds']:.2f} s, {mbit:.0f} Mbit/s")
    assert mbit < 1.2 * link.rate_mbit


def test_cleanup_on_exit_error_and_interrupt():
    with ThrottledLink() as link:
        names = link.namespaces
        assert all(n in _netns() for n in names)
    assert not any(n in _netns() for n in names)

    for exc in (ValueError, KeyboardInterrupt):
        with pytest.raises(exc), ThrottledLink() as link:
            names = link.namespaces
            raise exc()
        assert not any(n in _netns() for n in names)


def test_cleanup_when_setup_fails(monkeypatch):
    def refuse(*args):
        raise RuntimeError("tbf refused")

    monkeypatch.setattr(throttle, "_tbf", refuse)
    link = ThrottledLink()
    with pytest.raises(RuntimeError, match="tbf refused"), link:
        pass
    assert not any(n in _netns() for n in link.namespaces)


def test_remove_stale_takes_only_dead_owners():
    prefix = f"gpuforge-stale-test{os.getpid()}"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    stale = f"{prefix}-{int(dead.stdout)}-0a"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with ThrottledLink(name_prefix=prefix) as live:
            assert remove_stale(prefix) == [stale]
            assert stale not in _netns()
            assert all(n in _netns() for n in live.namespaces)
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
