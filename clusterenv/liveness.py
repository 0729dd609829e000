"""Heartbeats between the learner and its workers (the zguide's Paranoid Pirate pattern).

Each side runs one daemon thread with its own socket, on a second endpoint next to the
learner's command socket. The threads exchange ``HEARTBEAT`` messages every
``interval`` seconds, independent of the main loops, so a learner busy in a gradient
step or a worker inside a long env step still beats. A peer that has not been heard
from for ``interval * liveness`` seconds has expired:

* the learner's :class:`HeartbeatMonitor` reports the worker in :meth:`~HeartbeatMonitor.expired`,
  which ``ClusterEnv`` checks while waiting for replies, so a dead, frozen (``SIGSTOP``)
  or partitioned worker is found even where no process exit status exists (remote hosts);
* a worker's :class:`HeartbeatClient` reconnects with exponential backoff, as ppworker
  does, and after ``max_reconnects`` silent attempts declares the learner lost: the
  worker's serve loop then exits, and if the main thread is stuck in env code the
  thread ends the process itself.

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
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

import zmq

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
        max_reconnects: silent reconnects after which a worker gives up on its learner.
            A worker thus outlives a dead learner by about
            ``(1 + max_reconnects) * interval * liveness`` plus the backoff delays.
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
    """A worker's heartbeat thread (ppworker): beats, and notices a learner that went silent.

    Args:
        context: the worker's ZeroMQ context.
        learner_address: the learner address the worker connected to.
        endpoint: the learner's heartbeat endpoint (from INIT).
        session: the heartbeat keys and counters agreed when this worker joined (kept across reconnects).
        identity: this worker's routing identity.
        config: the heartbeat constants (from INIT, so both sides agree).
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
        exit_grace: float = 10.0,
        curve: Curve | None = None,
    ) -> None:
        self.config = config
        self.address = _connect_address(learner_address, endpoint)
        self._context, self._session, self._identity, self._curve = context, session, identity, curve
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

    def _connect(self) -> Channel:
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
        return channel

    def _run(self) -> None:
        config = self.config
        channel = self._connect()
        delay = config.reconnect_initial
        reconnects = 0
        expires = time.monotonic() + config.expiry
        next_beat = time.monotonic()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    try:
                        channel.send(Kind.HEARTBEAT)
                    except zmq.Again:
                        pass  # queue full: the learner is not reading, which its silence will show
                    next_beat = now + config.interval
                received = channel.recv(min(0.1, max(0.0, next_beat - time.monotonic())), routed=False)
                if received is not None and received[1].kind is Kind.HEARTBEAT:
                    expires = time.monotonic() + config.expiry
                    delay, reconnects = config.reconnect_initial, 0
                    continue
                if time.monotonic() < expires:
                    continue
                if reconnects >= config.max_reconnects:
                    self._give_up()
                    return
                logger.warning(
                    "No heartbeat from the learner at %s for %.1f s; reconnecting in %.1f s.",
                    self.address,
                    config.expiry,
                    delay,
                )
                channel.close()
                if self._stop.wait(delay):
                    return
                channel = self._connect()
                reconnects += 1
                delay = min(2 * delay, config.reconnect_max)
                expires = time.monotonic() + config.expiry
        finally:
            channel.close()

    def _give_up(self) -> None:
        logger.error(
            "The learner at %s has not answered heartbeats after %d reconnects; stopping this worker.",
            self.address,
            self.config.max_reconnects,
        )
        self.learner_lost.set()
        if not self._stop.wait(self._exit_grace):
            logger.error("The worker's main loop did not stop within %.1f s; exiting the process.", self._exit_grace)
            os._exit(LEARNER_LOST_EXIT_CODE)
