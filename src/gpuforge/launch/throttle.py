"""A real slow link between two processes on one machine, to run a 2-process gloo job across it.

Two ranks on one host talk over loopback at tens of Gbit/s, so communication looks free, and gradient
compression saves nothing measurable. Between machines it is the link that costs. ``ThrottledLink`` makes
that link here: two network namespaces joined by a veth pair, each end shaped by a ``tbf`` qdisc (egress,
so each direction is limited by its sender's end). Processes started with ``link.command(side, argv)`` see
only their own end, so every byte between them crosses the shaped pair::

    with ThrottledLink(rate_mbit=200) as link:
        env = {**os.environ, **link.env(0), "RANK": "0", ...}
        subprocess.Popen(link.command(0, [sys.executable, "worker.py"]), env=env)

It shapes bandwidth only: ``netem`` (delay, loss) is not available on every kernel, so there is no added
latency. It needs root, ``ip`` and ``tc``; ``can_throttle()`` says whether this machine has them. It is for
gloo: NCCL would recognise the same host and use shared memory or P2P, not the sockets.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import shutil
import subprocess
from pathlib import Path

from gpuforge.runtime.host import is_alive

PREFIX = "gpuforge-link"
# The namespaces are private to the link, so every link can use the same subnet and interface names.
ADDRESSES = ("10.213.0.1", "10.213.0.2")
INTERFACES = ("veth0", "veth1")
# tbf shaping: a bucket of 1 ms of traffic (16 KiB at least, ~10 full frames) holds the rate within a few %
# from 20 Mbit/s to 5 Gbit/s; a smaller one loses rate at high rates. 20 ms of queue: TCP keeps the link full
# without drops at 200 Mbit/s (5 ms dropped 10-20% of the packets), while a queue stays short, as on a switch.
BURST_S, MIN_BURST_BYTES, QUEUE_LATENCY = 1e-3, 16 * 1024, "20ms"

_serial = itertools.count()


def _run(argv: list[str]) -> str:
    """Run an ``ip``/``tc`` command; on failure raise with the command and its stderr."""
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        stderr = " | ".join(proc.stderr.strip().splitlines())  # one line, for can_throttle's reason
        raise RuntimeError(f"`{' '.join(argv)}` failed ({proc.returncode}): {stderr}")
    return proc.stdout


def _namespaces() -> list[str]:
    # `ip netns list` prints "name" or "name (id: 3)"
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _tbf(namespace: str, interface: str, rate_mbit: float) -> None:
    burst = max(MIN_BURST_BYTES, int(rate_mbit * 1e6 / 8 * BURST_S))
    qdisc = ["tc", "-n", namespace, "qdisc", "replace", "dev", interface, "root", "tbf"]
    _run([*qdisc, "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", QUEUE_LATENCY])


@functools.cache
def can_throttle() -> str | None:
    """None if namespaces, a veth pair and tbf can be made here, else why not (one line). Cached."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH (iproute2)"
    namespace = f"{PREFIX}-{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", namespace])
    except RuntimeError as e:
        return str(e)
    try:
        _run(["ip", "-n", namespace, "link", "add", "veth0", "type", "veth", "peer", "name", "veth1"])
        _tbf(namespace, "veth0", 100)
        _run(["ip", "netns", "exec", namespace, "true"])
    except RuntimeError as e:
        return str(e)
    finally:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
    return None


def remove_stale(name_prefix: str = PREFIX) -> list[str]:
    """Delete the namespaces of links whose creating process is gone (killed before its cleanup ran).

    Returns the names deleted. Our names carry the pid: ``<prefix>-<pid>-...``.
    """
    removed = []
    for name in _namespaces():
        m = re.fullmatch(rf"{re.escape(name_prefix)}-(\d+)-.*", name)
        if m is None or is_alive(int(m.group(1))):
            continue
        _run(["ip", "netns", "del", name])
        removed.append(name)
    return removed


class ThrottledLink:
    """Two network namespaces joined by a veth pair shaped to ``rate_mbit`` each way; a context manager.

    Deleting the namespaces on exit removes the veth pair with them. Stop the processes inside first: a
    namespace with a process left in it outlives its name (but no longer shows in ``ip netns list``).
    """

    def __init__(self, rate_mbit: float = 200, name_prefix: str | None = None) -> None:
        prefix = name_prefix or PREFIX
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", prefix):
            raise ValueError(f"name_prefix must be letters, digits, '_', '.', '-': {prefix!r}")
        # pid and a per-process serial: parallel test workers and links in one process do not clash
        base = f"{prefix}-{os.getpid()}-{next(_serial)}"
        self.namespaces = (f"{base}a", f"{base}b")
        self.addresses = ADDRESSES
        self.interfaces = INTERFACES
        self.rate_mbit = rate_mbit
        self._made: list[str] = []

    def __enter__(self) -> ThrottledLink:
        try:
            for ns in self.namespaces:
                _run(["ip", "netns", "add", ns])
                self._made.append(ns)
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            (a, b), (va, vb) = self.namespaces, self.interfaces
            # made inside the namespaces directly: nothing named in the host's namespace, so no clashes
            _run(["ip", "link", "add", va, "netns", a, "type", "veth", "peer", "name", vb, "netns", b])
            for ns, iface, addr in zip(self.namespaces, self.interfaces, self.addresses, strict=True):
                _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", iface])
                _run(["ip", "-n", ns, "link", "set", iface, "up"])
            self.set_rate(self.rate_mbit)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Delete the namespaces made so far; try each, then raise the first failure."""
        errors = []
        while self._made:
            try:
                _run(["ip", "netns", "del", self._made.pop()])
            except RuntimeError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def set_rate(self, rate_mbit: float) -> None:
        """Shape both ends to ``rate_mbit`` (each direction), in place."""
        for ns, iface in zip(self.namespaces, self.interfaces, strict=True):
            _tbf(ns, iface, rate_mbit)
        self.rate_mbit = rate_mbit

    def command(self, side: int, argv: list[str]) -> list[str]:
        """The argv that runs ``argv`` inside namespace ``side`` (0 or 1); the environment passes through."""
        return ["ip", "netns", "exec", self.namespaces[side], *argv]

    def env(self, side: int) -> dict[str, str]:
        """Variables for a gloo process on ``side``: its interface, and rank 0's address (side 0) as master.

        Without the interface gloo resolves the hostname to an address the namespace cannot reach.
        """
        iface = self.interfaces[side]
        return {"GLOO_SOCKET_IFNAME": iface, "TP_SOCKET_IFNAME": iface, "MASTER_ADDR": self.addresses[0]}

    def start_rank(self, side: int, argv: list[str], port: int, log_path: Path) -> subprocess.Popen:
        """Rank `side` of a 2-rank job (torchrun's variables, one process a namespace as on two machines,
        one thread), started in namespace `side` in a session of its own, its output into `log_path`."""
        env = {**os.environ, **self.env(side), "RANK": str(side), "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
        env |= {"LOCAL_WORLD_SIZE": "1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        with log_path.open("wb") as sink:
            return subprocess.Popen(
                self.command(side, argv),
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
