"""Heartbeats between the learner and its workers (the zguide's Paranoid Pirate pattern).

Each side runs one daemon thread with its own socket, on a second endpoint next to the
learner's command socket. The threads exchange ``HEARTBEAT`` messages every
``interval`` seconds, independent of the main loops, so a learner busy in a gradient
step or a worker inside a long env step still beats. A peer that has not been heard
from for ``interval * liveness`` seconds has expired:

* the learner's :class:`HeartbeatMonitor` reports the worker in :meth:`~HeartbeatMonitor.expired`,
  which ``ClusterEnv`` checks while waiting for replies, so a dead, frozen (``SIGSTOP``)
  or partitioned worker is found even where no process exit status exists (remote hosts);
* a worker's :class:`HeartbeatClient` is also its watchdog. A learner that is known to
  be dead (a local worker's parent process is gone: at once; the learner's end of the
  connection closed, as when its process died: after ``interval * liveness``) is lost.
  One that is silent but still connected (a partition, or a learner whose heartbeat
  thread is starved of the GIL) gets reconnects with exponential backoff, as ppworker
  does, and is lost after ``max_reconnects`` silent attempts. The worker's serve loop
  then exits; if its main thread is stuck in env code, the watchdog ends the process
  and the env processes below it, without waiting for that thread.

ZeroMQ sockets are not thread-safe, so each thread creates, uses and closes its socket
itself; only the (thread-safe) context is shared.

Heartbeats are authenticated like commands: each worker's heartbeat connection has its
own keys and counters, agreed when the worker joined the command socket (nobody joins
the heartbeat socket itself), so a captured heartbeat cannot be replayed to keep a dead
worker or learner looking alive. Heartbeats are tiny, so both ends refuse (in ZeroMQ,
before any copy) messages above :data:`HEARTBEAT_MAX_BYTES`.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

import zmq
from zmq.utils.monitor import recv_monitor_message

from clusterenv.cleanup import kill_descendants
from clusterenv.errors import ProtocolError
from clusterenv.protocol import Kind, Session
from clusterenv.transport import Channel, Curve

__all__ = [
    "HEARTBEAT_MAX_BYTES",
    "LEARNER_LOST_EXIT_CODE",
    "Heartbeat",
    "HeartbeatClient",
    "HeartbeatMonitor",
    "heartbeat_address",
]

logger = logging.getLogger(__name__)

# Exit code of a worker that ended itself because its learner stopped answering.
LEARNER_LOST_EXIT_CODE = 3
# What a worker's heartbeat socket monitor reports: a connection made, lost, or failing to be made.
_CONNECTION_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
#: The largest message either end of a heartbeat connection accepts (a heartbeat is ~60 bytes).
HEARTBEAT_MAX_BYTES = 1024


@dataclass(frozen=True)
class Heartbeat:
    """The heartbeat constants, as one block (ppworker's ``HEARTBEAT_*``/``INTERVAL_*``).

    Attributes:
        interval: seconds between heartbeats, each way.
        liveness: heartbeats a peer may miss before it is considered gone; a worker is
            declared lost after ``interval * liveness`` seconds of silence.
        reconnect_initial: a worker's first reconnect delay after the learner went silent.
        reconnect_max: cap of the exponentially growing reconnect delay.
        max_reconnects: silent reconnects after which a worker gives up on a learner that
            stays connected but silent. A worker outlives a learner whose process died by
            ``interval * liveness`` (a local worker: by a fraction of a second), and one
            that is unreachable by about ``(1 + max_reconnects) * interval * liveness``
            plus the backoff delays; its main thread, if stuck in env code, gets ~1 s more.
    """

    interval: float = 1.0
    liveness: int = 5
    reconnect_initial: float = 1.0
    reconnect_max: float = 8.0
    max_reconnects: int = 3

    def __post_init__(self) -> None:
        for name in ("interval", "reconnect_initial", "reconnect_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"`Heartbeat.{name}` must be a positive number of seconds, got {value!r}.")
        for name in ("liveness", "max_reconnects"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "liveness" else 0):
                least = "a positive" if name == "liveness" else "a non-negative"
                raise ValueError(f"`Heartbeat.{name}` must be {least} integer, got {value!r}.")

    @property
    def expiry(self) -> float:
        """Seconds of silence after which a peer has expired."""
        return self.interval * self.liveness

    def to_meta(self) -> dict[str, Any]:
        """The block as a plain map, to send to workers."""
        return asdict(self)


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


def _connect_address(learner_address: str, heartbeat_endpoint: str) -> str:
    """The heartbeat endpoint as seen from the worker: its learner host, the heartbeat port.

    The learner reports the endpoint it bound, which may be a wildcard host (``0.0.0.0``)
    that is not connectable; the host the worker already reached is.
    """
    if not heartbeat_endpoint.startswith("tcp://") or not learner_address.startswith("tcp://"):
        return heartbeat_endpoint
    host = urlsplit(learner_address).netloc.rpartition(":")[0]
    port = heartbeat_endpoint.rpartition(":")[2]
    return f"tcp://{host}:{port}"


class HeartbeatMonitor:
    """The learner's heartbeat thread: answers every watched worker and tracks when it was last heard.

    Args:
        context: the learner's ZeroMQ context.
        address: heartbeat bind address (``None``: a private ipc socket).
        key: the shared HMAC secret.
        config: the heartbeat constants.
        curve: encrypt, as the command socket does.
    """

    def __init__(
        self, context: zmq.Context, address: str | None, key: bytes, config: Heartbeat, *, curve: Curve | None = None
    ) -> None:
        self.config = config
        self._context, self._address, self._key, self._curve = context, address, key, curve
        self._lock = threading.Lock()
        self._watched: dict[bytes, int] = {}
        # Per watched identity, its heartbeat keys; read by the thread's channel (dict operations are atomic).
        self._sessions: dict[bytes | None, Session] = {}
        self._last_heard: dict[int, float] = {}
        self._tick = time.monotonic()
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._bind_error: BaseException | None = None
        self.endpoint = ""
        self._thread = threading.Thread(target=self._run, name="clusterenv-heartbeat", daemon=True)
        self._thread.start()
        self._bound.wait()
        if self._bind_error is not None:
            self._thread.join()
            raise self._bind_error

    def watch(self, worker_id: int, identity: bytes, session: Session) -> None:
        """Start expecting heartbeats from ``identity`` as worker ``worker_id`` (replacing any previous one).

        ``session``: the heartbeat keys agreed when that worker joined the command socket.
        """
        with self._lock:
            for old, w in list(self._watched.items()):
                if w == worker_id:
                    del self._watched[old]
                    self._sessions.pop(old, None)
            self._sessions[identity] = session
            self._watched[identity] = worker_id
            self._last_heard[worker_id] = time.monotonic()

    def forget(self, worker_id: int) -> None:
        """Stop tracking worker ``worker_id``."""
        with self._lock:
            for ident in [ident for ident, w in self._watched.items() if w == worker_id]:
                self._sessions.pop(ident, None)
            self._watched = {ident: w for ident, w in self._watched.items() if w != worker_id}
            self._last_heard.pop(worker_id, None)

    def silence(self, worker_id: int) -> float | None:
        """Seconds since worker ``worker_id`` was last heard from, or ``None`` if it is not watched."""
        with self._lock:
            last = self._last_heard.get(worker_id)
        return None if last is None else time.monotonic() - last

    def expired(self) -> set[int]:
        """Watched workers silent for longer than ``interval * liveness``.

        Measured up to the monitor thread's last pass over its socket, not up to now: if the
        main thread held the GIL for long (a C extension that never releases it), heartbeats
        may be waiting unread, and the workers that sent them must not be declared lost.
        """
        with self._lock:
            limit = self._tick - self.config.expiry
            return {w for w, last in self._last_heard.items() if last < limit}

    def close(self) -> None:
        """Stop the thread and close its socket (before the context is terminated)."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            channel = Channel.bind_router(
                self._context,
                self._address,
                self._key,
                accept_joins=False,
                sessions=self._sessions,
                max_message_bytes=HEARTBEAT_MAX_BYTES,
                curve=self._curve,
            )
        except BaseException as exc:
            self._bind_error = exc
            self._bound.set()
            return
        # A frozen peer stops reading: once its queue is full a send would block this thread for good.
        channel.socket.setsockopt(zmq.SNDTIMEO, 0)
        self.endpoint = channel.endpoint
        self._bound.set()
        interval = self.config.interval
        next_beat = time.monotonic()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    with self._lock:
                        identities = list(self._watched)
                    for identity in identities:
                        try:
                            channel.send(Kind.HEARTBEAT, to=identity)
                        except (zmq.ZMQError, ProtocolError):
                            pass  # not connected (yet, or any more), or just forgotten: its silence expires it
                    next_beat = now + interval
                # Short polls so that close() never waits a whole interval.
                received = channel.recv(min(0.1, max(0.0, next_beat - time.monotonic())), routed=True)
                while received is not None:
                    sender, msg = received
                    with self._lock:
                        worker_id = self._watched.get(sender or b"")
                        if msg.kind is Kind.HEARTBEAT and worker_id is not None:
                            self._last_heard[worker_id] = time.monotonic()
                    received = channel.recv(0, routed=True)
                with self._lock:
                    self._tick = time.monotonic()  # everything that arrived before now has been read
        finally:
            channel.close()


class HeartbeatClient:
    """A worker's heartbeat thread (ppworker) and watchdog: beats, and ends the worker once its learner is lost.

    Args:
        context: the worker's ZeroMQ context.
        learner_address: the learner address the worker connected to.
        endpoint: the learner's heartbeat endpoint (from INIT).
        session: the heartbeat keys and counters agreed when this worker joined (kept across reconnects).
        identity: this worker's routing identity.
        config: the heartbeat constants (from INIT, so both sides agree).
        parent_pid: the learner's pid, for a worker that is its child: the learner is lost
            as soon as this worker's parent is another process.
        exit_grace: seconds the main thread gets to exit by itself once the learner is lost,
            before this thread ends the process (an env step may never return).
        curve: encrypt, as the command connection does.
    """

    def __init__(
        self,
        context: zmq.Context,
        learner_address: str,
        endpoint: str,
        session: Session,
        identity: bytes,
        config: Heartbeat,
        *,
        parent_pid: int | None = None,
        exit_grace: float = 1.0,
        curve: Curve | None = None,
    ) -> None:
        self.config = config
        self.address = _connect_address(learner_address, endpoint)
        self._context, self._session, self._identity, self._curve = context, session, identity, curve
        self._parent_pid = parent_pid
        self._exit_grace = exit_grace
        self.learner_lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="clusterenv-heartbeat", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread and close its socket."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _connect(self) -> tuple[Channel, zmq.Socket]:
        """The heartbeat channel, and a monitor of its connection (which tells a dead learner from a silent one)."""
        channel = Channel.connect_dealer(
            self._context,
            self.address,
            b"",  # never joins: its keys come from the command connection's join
            self._identity,
            session=self._session,
            max_message_bytes=HEARTBEAT_MAX_BYTES,
            curve=self._curve,
        )
        channel.socket.setsockopt(zmq.SNDTIMEO, 0)  # never block on a learner that stopped reading
        monitor = channel.socket.get_monitor_socket(_CONNECTION_EVENTS)
        return channel, monitor

    @staticmethod
    def _disconnect(channel: Channel, monitor: zmq.Socket) -> None:
        channel.socket.disable_monitor()
        monitor.close(linger=0)
        channel.close()

    def _run(self) -> None:
        config = self.config
        channel, monitor = self._connect()
        # The learner's end of the connection, as the monitor last reported it. Assumed up until
        # then: only a learner known to be gone is given up on without reconnects.
        connected = True
        delay = config.reconnect_initial
        reconnects = 0
        expires = time.monotonic() + config.expiry
        next_beat = time.monotonic()
        try:
            while not self._stop.is_set():
                if self._parent_pid is not None and os.getppid() != self._parent_pid:
                    self._give_up(f"The learner process {self._parent_pid} is gone")
                    return
                now = time.monotonic()
                if now >= next_beat:
                    try:
                        channel.send(Kind.HEARTBEAT)
                    except zmq.Again:
                        pass  # queue full: the learner is not reading, which its silence will show
                    next_beat = now + config.interval
                received = channel.recv(min(0.1, max(0.0, next_beat - time.monotonic())), routed=False)
                connected = _still_connected(monitor, connected)
                if received is not None and received[1].kind is Kind.HEARTBEAT:
                    expires = time.monotonic() + config.expiry
                    delay, reconnects = config.reconnect_initial, 0
                    continue
                if time.monotonic() < expires:
                    continue
                if not connected:
                    self._give_up(
                        f"The learner at {self.address} has been silent for {config.expiry:.1f} s and its "
                        "end of the connection is closed"
                    )
                    return
                if reconnects >= config.max_reconnects:
                    self._give_up(
                        f"The learner at {self.address} has not answered heartbeats after {config.max_reconnects} "
                        "reconnects"
                    )
                    return
                logger.warning(
                    "No heartbeat from the learner at %s for %.1f s; reconnecting in %.1f s.",
                    self.address,
                    config.expiry,
                    delay,
                )
                self._disconnect(channel, monitor)
                if self._stop.wait(delay):
                    return
                channel, monitor = self._connect()
                connected = True
                reconnects += 1
                delay = min(2 * delay, config.reconnect_max)
                expires = time.monotonic() + config.expiry
        finally:
            if not monitor.closed:
                self._disconnect(channel, monitor)

    def _give_up(self, reason: str) -> None:
        """Tell the main loop to stop; if it does not within ``exit_grace`` (stuck in env code), end the process."""
        logger.error("%s; stopping this worker.", reason)
        self.learner_lost.set()
        if self._stop.wait(self._exit_grace):
            return
        logger.error(
            "The worker's main thread did not stop within %.1f s (an env step that does not return?); "
            "ending the process and its env processes.",
            self._exit_grace,
        )
        # The envs cannot be closed from this thread while the main thread is inside one, and the
        # processes they started would outlive the worker (re-parented): they are killed instead.
        # Sockets and mappings go with the process.
        kill_descendants(os.getpid())
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(LEARNER_LOST_EXIT_CODE)


def _still_connected(monitor: zmq.Socket, connected: bool) -> bool:
    """The connection state after the monitor's pending events (a failed reconnect counts as closed)."""
    while True:
        try:
            event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
        except zmq.Again:
            return connected
        if event == zmq.EVENT_CONNECTED:
            connected = True
        elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CONNECT_RETRIED):
            connected = False
