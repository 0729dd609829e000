"""Liveness of the learner and its workers: busy is not dead.

Each worker opens a second connection to the learner, next to its command connection,
used for nothing but liveness, so that large messages on the command connection never
delay it. On it, **libzmq's own heartbeats** (ZMTP PING/PONG, the ``HEARTBEAT_*`` socket
options) run both ways every ``interval`` seconds. libzmq's I/O threads answer them
without the GIL, so a process whose Python threads are starved (env code or learner code
in a long C call that holds the GIL) still answers, while a dead one closes its end and a
frozen (``SIGSTOP``) one stops answering: libzmq then drops the connection after
``interval * liveness`` seconds without traffic, and a socket monitor reports it.

* The learner's ``HeartbeatMonitor`` (``heartbeat_monitor.py``) declares a worker lost when its liveness
  connection dropped (dead, frozen, or partitioned), not when its application heartbeats
  are merely late. Those (one ``HEARTBEAT`` message every ``interval`` from the worker's
  thread) say which connection is whose, and bound how long a worker may stay busy
  (``Heartbeat.busy_timeout``). ``ClusterEnv`` checks ``HeartbeatMonitor.expired``
  while waiting for replies; local workers are also watched through their exit status.
* A worker's ``HeartbeatClient`` (``heartbeat_client.py``) is also its watchdog. A learner that is known to be
  dead (a local worker's parent process is gone: at once; the connection dropped and the
  learner's end refuses reconnects, as when its process died: after ``interval * liveness``)
  is lost. One whose connection stays down without refusing (frozen, partitioned) gets
  reconnects with exponential backoff, as ppworker does, and is lost after ``max_reconnects``
  of them fail. A learner that is only busy keeps its connection, and its workers. The
  worker's serve loop then exits; if its main thread is stuck in env code, the watchdog
  ends the process and the env processes below it, without waiting for that thread.

Heartbeat messages are authenticated like commands: each worker's heartbeat connection has
its own keys and counters, agreed when the worker joined the command socket (nobody joins
the heartbeat socket itself), so a captured heartbeat cannot be replayed to keep a dead
worker looking alive. Heartbeats are tiny, so both ends refuse (in ZeroMQ, before any copy)
messages above :data:`HEARTBEAT_MAX_BYTES`.

ZeroMQ sockets are not thread-safe, so each socket is used by one thread at a time: the
heartbeat threads own theirs (a worker's first one is handed over at thread start).

This module holds what both ends share; the learner's end is ``heartbeat_monitor``, the
worker's ``heartbeat_client``.
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

import zmq
from zmq.utils.monitor import recv_monitor_message

__all__ = [
    "HEARTBEAT_MAX_BYTES",
    "LEARNER_LOST_EXIT_CODE",
    "Heartbeat",
    "Waker",
    "connect_address",
    "heartbeat_address",
    "monitor_events",
]

# Exit code of a worker that ended itself because its learner stopped answering.
LEARNER_LOST_EXIT_CODE = 3
#: The largest message either end of a heartbeat connection accepts (a heartbeat is ~60 bytes).
HEARTBEAT_MAX_BYTES = 1024
# libzmq takes milliseconds as a C int, and HEARTBEAT_TTL at most 6553.5 s (deciseconds in 16 bits).
_MAX_MS, _MAX_TTL_MS = 2**31 - 1, 6_553_500


@dataclass(frozen=True)
class Heartbeat:
    """The heartbeat constants, as one block (ppworker's ``HEARTBEAT_*``/``INTERVAL_*``).

    Attributes:
        interval: seconds between heartbeats, each way.
        liveness: heartbeats a peer may miss before it is considered gone: a connection
            that carried nothing for ``interval * liveness`` seconds is dropped, and a
            worker whose connection dropped is lost.
        reconnect_initial: a worker's first reconnect delay after its connection to the learner went down.
        reconnect_max: cap of the exponentially growing reconnect delay.
        max_reconnects: failed reconnects after which a worker gives up on a learner that does
            not answer but does not refuse either (frozen, unreachable). A worker outlives a
            learner whose process died by ``interval * liveness`` (a local worker: by a fraction
            of a second), and one that is frozen or unreachable by about
            ``(2 + max_reconnects) * interval * liveness`` plus the backoff delays; its main
            thread, if stuck in env code, gets ~1 s more.
        busy_timeout: seconds a worker whose connection is alive may send no heartbeat of its
            own before it is declared lost anyway (its heartbeat thread starved of the GIL: a
            C call that never returns?); ``None``: never. Never less than ``interval * liveness``.
    """

    interval: float = 1.0
    liveness: int = 5
    reconnect_initial: float = 1.0
    reconnect_max: float = 8.0
    max_reconnects: int = 3
    busy_timeout: float | None = 300.0

    def __post_init__(self) -> None:
        for name in ("interval", "reconnect_initial", "reconnect_max", "busy_timeout"):
            value = getattr(self, name)
            if value is None and name == "busy_timeout":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                what = "a positive number of seconds" + (" or None" if name == "busy_timeout" else "")
                raise ValueError(f"`Heartbeat.{name}` must be {what}, got {value!r}.")
        for name in ("liveness", "max_reconnects"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "liveness" else 0):
                least = "a positive" if name == "liveness" else "a non-negative"
                raise ValueError(f"`Heartbeat.{name}` must be {least} integer, got {value!r}.")

    @property
    def expiry(self) -> float:
        """Seconds without traffic after which a connection, and so its peer, has expired."""
        return self.interval * self.liveness

    def to_meta(self) -> dict[str, Any]:
        """The block as a plain map, to send to workers."""
        return asdict(self)

    def zmtp_options(self) -> dict[int, int]:
        """Socket options for libzmq's own heartbeats, set on both ends of a liveness connection.

        A PING every ``interval``; the connection is dropped after ``expiry`` without any
        reply (``HEARTBEAT_TIMEOUT``), and by the peer after ``expiry`` without any PING
        (``HEARTBEAT_TTL``, which libzmq ignores below 0.1 s).
        """
        interval_ms = min(_MAX_MS, max(1, round(self.interval * 1000)))
        expiry_ms = min(_MAX_MS, max(1, round(self.expiry * 1000)))
        return {
            zmq.HEARTBEAT_IVL: interval_ms,
            zmq.HEARTBEAT_TIMEOUT: expiry_ms,
            zmq.HEARTBEAT_TTL: min(_MAX_TTL_MS, expiry_ms),
        }


def heartbeat_address(command_address: str | None) -> str | None:
    """Where the learner binds its heartbeat socket, given its command socket's bind address.

    ``tcp://HOST:PORT`` → ``tcp://HOST:PORT+1`` (a predictable port, for firewalls), a
    wildcard port stays a wildcard; ``None`` (a private ipc socket) stays ``None``.
    """
    if command_address is None:
        return None
    parts = urlsplit(command_address)
    if parts.scheme != "tcp":
        return None
    host, _, port = parts.netloc.rpartition(":")
    return f"tcp://{host}:{'*' if port == '*' else int(port) + 1}"


def connect_address(learner_address: str, heartbeat_endpoint: str) -> str:
    """The heartbeat endpoint as seen from the worker: its learner host, the heartbeat port.

    The learner reports the endpoint it bound, which may be a wildcard host (``0.0.0.0``)
    that is not connectable; the host the worker already reached is.
    """
    if not heartbeat_endpoint.startswith("tcp://") or not learner_address.startswith("tcp://"):
        return heartbeat_endpoint
    host = urlsplit(learner_address).netloc.rpartition(":")[0]
    port = heartbeat_endpoint.rpartition(":")[2]
    return f"tcp://{host}:{port}"


class Waker:
    """Ends a heartbeat thread's wait at once, so that closing never waits for a poll timeout.

    The thread binds an ``inproc`` PAIR socket and polls it with its own; another thread
    connects a fresh socket of its own (sockets are not shared between threads) and sends
    one empty message. The stop flag is set first, so a lost wake-up only costs one timeout.
    """

    def __init__(self, context: zmq.Context) -> None:
        self._context = context
        self.address = f"inproc://clusterenv-wake-{secrets.token_hex(8)}"
        self.socket: zmq.Socket | None = None

    def open(self) -> zmq.Socket:
        """Bind the thread's end (call from the thread that polls it)."""
        self.socket = self._context.socket(zmq.PAIR)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(self.address)
        return self.socket

    def wake(self) -> None:
        """Wake the thread (from another thread)."""
        poke = self._context.socket(zmq.PAIR)
        poke.setsockopt(zmq.LINGER, 0)
        try:
            poke.connect(self.address)
            poke.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the thread is gone already, or will see the stop flag at its next timeout
        finally:
            poke.close()

    def close(self) -> None:
        """Close the thread's end (from the thread that opened it)."""
        if self.socket is not None:
            self.socket.close(linger=0)


def monitor_events(monitor: zmq.Socket, timeout: float = 0.0, wake: zmq.Socket | None = None) -> list[tuple[int, int]]:
    """The ``(event, value)`` pairs the monitor has reported, waiting up to ``timeout`` seconds (or for ``wake``)."""
    if timeout > 0:
        if wake is None:
            monitor.poll(int(timeout * 1000))
        else:
            zmq.select([monitor, wake], [], [], timeout)
    events: list[tuple[int, int]] = []
    while True:
        try:
            message = recv_monitor_message(monitor, zmq.NOBLOCK)
        except zmq.Again:
            return events
        events.append((int(message["event"]), int(message["value"])))
