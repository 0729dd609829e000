"""Another host on this machine: network and UTS namespaces, joined by a veth pair, optionally rate-limited.

Workers started in it have their own hostname (so the learner treats them as remote: no
shared memory) and reach the learner only over the veth pair, whose addresses the helper
picks in ``10.213.0.0/16`` and gives back when it ends. A rate, e.g. ``"1gbit"``, is applied
to both ends with ``tc qdisc ... tbf``. Used by the tests and by ``benchmarks/link.py``;
needs root and iproute2, and says why when it cannot be made (:func:`unavailable`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass

from clusterenv.wire.transport import SECRET_ENV_VAR

__all__ = ["OtherHost", "external_workers", "free_port", "other_host", "rate_bits", "unavailable"]

_SUBNET = "10.213"
_TBF_LATENCY = "50ms"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def unavailable() -> str | None:
    """Why a network namespace cannot be made here, or ``None`` if it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2, util-linux)"
    name = f"ce-probe-{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"`ip netns add` fails here: {getattr(exc, 'stderr', '') or exc}"
    _ip("netns", "del", name)
    return None


@dataclass
class OtherHost:
    """The namespace: ``learner_ip`` is this side's address on the link, ``ip`` the other side's."""

    namespace: str
    hostname: str
    learner_ip: str
    ip: str
    device: str  # this side's end of the veth pair

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on the other host (its network, its hostname)."""
        script = f'hostname {self.hostname} && exec "$@"'
        command = ["ip", "netns", "exec", self.namespace, "unshare", "--uts", "sh", "-c", script, "sh", *argv]
        return subprocess.Popen(command, **kwargs)

    def rx_bytes(self) -> int:
        """Bytes this side has received from the other host so far."""
        with open(f"/sys/class/net/{self.device}/statistics/rx_bytes") as f:
            return int(f.read())

    def tx_bytes(self) -> int:
        """Bytes this side has sent to the other host so far."""
        with open(f"/sys/class/net/{self.device}/statistics/tx_bytes") as f:
            return int(f.read())


@contextlib.contextmanager
def external_workers(host: OtherHost, count: int, secret: str) -> Iterator[str]:
    """Workers ``0..count-1`` started on the other host; yields the address they connect to.

    The learner binds that address with ``launcher="external"`` and ``secret``. At exit each
    worker gets 10 s to end (it does once the learner closes), then it is killed.
    """
    address = f"tcp://{host.learner_ip}:{free_port(host.learner_ip)}"
    child = {**os.environ, SECRET_ENV_VAR: secret, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    command = [sys.executable, "-m", "clusterenv.worker", "--connect", address, "--worker-id"]
    workers = [host.popen([*command, str(w)], env=child, stdout=subprocess.DEVNULL) for w in range(count)]
    try:
        yield address
    finally:
        for worker in workers:
            try:
                worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()


def free_port(host: str) -> int:
    """A port free on ``host`` now, whose next one (the heartbeat port) is free too."""
    while True:
        with closing(socket.socket()) as first, closing(socket.socket()) as second:
            first.bind((host, 0))
            port = first.getsockname()[1]
            try:
                second.bind((host, port + 1))
            except OSError:
                continue
        return port


def _limit(namespace: str | None, device: str, rate: str) -> None:
    bits = rate_bits(rate)
    burst = max(64 * 1024, bits // 8 // 250)  # 4 ms of traffic: tbf needs at least rate / HZ
    command = ["tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", rate, "burst", str(burst)]
    command += ["latency", _TBF_LATENCY]
    if namespace is not None:
        command = ["ip", "netns", "exec", namespace, *command]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=10)


def rate_bits(rate: str) -> int:
    """``"1gbit"`` → 10**9: tc's rate units."""
    for unit, factor in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3), ("bit", 1)):
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * factor)
    raise ValueError(f"A rate must be a number followed by gbit, mbit, kbit or bit, got {rate!r}.")


@contextlib.contextmanager
def other_host(rate: str | None = None) -> Iterator[OtherHost]:
    """Make the other host; on exit end its processes and remove the namespace and the link, whatever happened."""
    token = secrets.token_hex(3)
    namespace, near, far = f"ce-{token}", f"ce{token}a", f"ce{token}b"
    octet, quad = secrets.randbelow(256), secrets.randbelow(64) * 4
    learner_ip, ip = f"{_SUBNET}.{octet}.{quad + 1}", f"{_SUBNET}.{octet}.{quad + 2}"
    try:
        _ip("netns", "add", namespace)
        _ip("link", "add", near, "type", "veth", "peer", "name", far)
        _ip("link", "set", far, "netns", namespace)
        _ip("addr", "add", f"{learner_ip}/30", "dev", near)
        _ip("link", "set", near, "up")
        _ip("-n", namespace, "addr", "add", f"{ip}/30", "dev", far)
        _ip("-n", namespace, "link", "set", far, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        if rate is not None:
            _limit(None, near, rate)
            _limit(namespace, far, rate)
        yield OtherHost(namespace, f"other-host-{token}", learner_ip, ip, near)
    finally:
        _end_processes(namespace)
        subprocess.run(["ip", "link", "del", near], capture_output=True, timeout=10)  # both ends go
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=10)


def _end_processes(namespace: str) -> None:
    """Kill whatever still runs in the namespace, and wait until it is gone."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=10)
        pids = [int(pid) for pid in found.stdout.split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
