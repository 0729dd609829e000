"""Liveness of the learner and its workers: busy is not dead.

Each worker opens a second connection to the learner, next to its command connection,
used for nothing but liveness, so that large messages on the command connection never
delay it. On it, **libzmq's own heartbeats** (ZMTP PING/PONG, the ``HEARTBEAT_*`` socket
options) run both ways every ``interval`` seconds. libzmq's I/O threads answer them
without the GIL, so a process whose Python threads are starved (env code or learner code
in a long C call that holds the GIL) still answers, while a dead one closes its end and a
frozen (``SIGSTOP``) one stops answering: libzmq then drops the connection after
``interval * liveness`` seconds without traffic, and a socket monitor reports it.

* The learner's :class:`HeartbeatMonitor` declares a worker lost when its liveness
  connection dropped (dead, frozen, or partitioned), not when its application heartbeats
  are merely late. Those (one ``HEARTBEAT`` message every ``interval`` from the worker's
  thread) say which connection is whose, and bound how long a worker may stay busy
  (``Heartbeat.busy_timeout``). ``ClusterEnv`` checks :meth:`~HeartbeatMonitor.expired`
  while waiting for replies; local workers are also watched through their exit status.
* A worker's :class:`HeartbeatClient` is also its watchdog. A learner that is known to be
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
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

import zmq
from zmq.utils.monitor import recv_monitor_message

from clusterenv.cleanup import kill_descendants
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
# What the learner's monitor reports: a worker's connection made or dropped (the value is its fd).
_LEARNER_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
# What a worker's monitor reports: its connection up (ZMTP handshake done), dropped, or refused.
_WORKER_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED
)
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


class _Waker:
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
        if self.socket is not None:
            self.socket.close(linger=0)


def _events(monitor: zmq.Socket, timeout: float = 0.0, wake: zmq.Socket | None = None) -> list[tuple[int, int]]:
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


class HeartbeatMonitor:
    """The learner's heartbeat thread: tells each watched worker's connection apart, and notices it drop.

    A worker's first heartbeat names the connection it came on (its file descriptor, as the
    socket monitor names connections); a dropped connection is a lost worker.

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
        self._last_heard: dict[int, float] = {}  # the last heartbeat, or when watching began
        self._fds: dict[int, int] = {}  # worker -> its connection, once a heartbeat named it
        self._dropped: dict[int, float] = {}  # worker -> how long it had been silent when its connection dropped
        self._closed_fds: set[int] = set()  # descriptors whose connection dropped and were not reused since
        self._tick = time.monotonic()
        self._stop = threading.Event()
        self._waker = _Waker(context)
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
            self._forget(worker_id)
            self._sessions[identity] = session
            self._watched[identity] = worker_id
            self._last_heard[worker_id] = time.monotonic()

    def forget(self, worker_id: int) -> None:
        """Stop tracking worker ``worker_id``."""
        with self._lock:
            self._forget(worker_id)

    def _forget(self, worker_id: int) -> None:
        for ident in [ident for ident, w in self._watched.items() if w == worker_id]:
            self._sessions.pop(ident, None)
        self._watched = {ident: w for ident, w in self._watched.items() if w != worker_id}
        for table in (self._last_heard, self._fds, self._dropped):
            table.pop(worker_id, None)

    def expired(self) -> set[int]:
        """Watched workers that are lost.

        A worker is lost when its connection dropped, when it did not say which connection is
        its own within ``interval * liveness``, or when it has been silent for ``busy_timeout``.
        Silence is measured up to the monitor thread's last pass over its socket, not up to now:
        if the main thread held the GIL for long (a C extension that never releases it),
        heartbeats may be waiting unread, and the workers that sent them must not be declared lost.
        """
        with self._lock:
            lost = set(self._dropped)
            for w, last in self._last_heard.items():
                limit = self._silence_limit(w)
                if limit is not None and last < self._tick - limit:
                    lost.add(w)
            return lost

    def _silence_limit(self, worker_id: int) -> float | None:
        """How long worker ``worker_id`` may be silent: the expiry until its connection is known, then ``busy_timeout``."""
        config = self.config
        if worker_id not in self._fds:
            return config.expiry
        return None if config.busy_timeout is None else max(config.busy_timeout, config.expiry)

    def silence(self, worker_id: int) -> float | None:
        """Seconds since worker ``worker_id``'s last heartbeat (or since watching began); ``None`` if not watched."""
        with self._lock:
            last = self._last_heard.get(worker_id)
        return None if last is None else time.monotonic() - last

    def reason(self, worker_id: int) -> str | None:
        """Why worker ``worker_id`` is in :meth:`expired`, for an error message (``None``: it is not)."""
        config = self.config
        settings = f"interval={config.interval} s, liveness={config.liveness}"
        with self._lock:
            if worker_id in self._dropped:
                silent = self._dropped[worker_id]
                return (
                    f"stopped answering heartbeats (its connection dropped after {silent:.1f} s of silence; {settings})"
                )
            last, limit = self._last_heard.get(worker_id), self._silence_limit(worker_id)
            if last is None or limit is None or last >= self._tick - limit:
                return None
            silent = time.monotonic() - last
            if worker_id not in self._fds:
                return f"stopped answering heartbeats ({silent:.1f} s silent; {settings})"
            return (
                f"sent no heartbeat for {silent:.1f} s although its connection is alive: busy for longer than "
                f"busy_timeout={config.busy_timeout} s (env code holding the GIL?)"
            )

    def close(self) -> None:
        """Stop the thread and close its socket (before the context is terminated)."""
        self._stop.set()
        self._waker.wake()
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
                options=self.config.zmtp_options(),
            )
        except BaseException as exc:
            self._bind_error = exc
            self._bound.set()
            return
        # Before any worker connects: a worker connects once it has its INIT.
        monitor = channel.monitor = channel.socket.get_monitor_socket(_LEARNER_EVENTS)
        channel.track_source = True
        self.endpoint = channel.endpoint
        wake = self._waker.open()
        poller = zmq.Poller()
        for socket in (channel.socket, monitor, wake):
            poller.register(socket, zmq.POLLIN)
        # Woken by messages, connection events and close(); the timeout only bounds how stale
        # the tick that expired() measures silence against may get.
        poll_ms = max(10, int(min(self.config.interval, 1.0) * 1000))
        self._bound.set()
        try:
            while not self._stop.is_set():
                if wake in dict(poller.poll(poll_ms)):
                    break
                received = channel.recv(0, routed=True)
                while received is not None:
                    # Events first: libzmq reported this message's connection, and the drop of any
                    # earlier one that had the same descriptor, before the message arrived.
                    self._apply(_events(monitor))
                    sender, msg = received
                    if msg.kind is Kind.HEARTBEAT and sender is not None and channel.source_fd is not None:
                        self._heard(sender, channel.source_fd)
                    received = channel.recv(0, routed=True)
                self._apply(_events(monitor))
                with self._lock:
                    self._tick = time.monotonic()  # everything that arrived before now has been read
        finally:
            self._waker.close()
            channel.close()

    def _heard(self, identity: bytes, fd: int) -> None:
        with self._lock:
            worker_id = self._watched.get(identity)
            if worker_id is None:
                return
            now = time.monotonic()
            if worker_id not in self._fds and worker_id not in self._dropped:
                if fd in self._closed_fds:  # its connection dropped before this, its first heartbeat, was read
                    self._dropped[worker_id] = now - self._last_heard[worker_id]
                else:
                    self._fds[worker_id] = fd
            self._last_heard[worker_id] = now

    def _apply(self, events: list[tuple[int, int]]) -> None:
        if not events:
            return
        with self._lock:
            for event, fd in events:
                if event == zmq.EVENT_ACCEPTED:
                    self._closed_fds.discard(fd)
                    continue
                self._closed_fds.add(fd)
                for worker_id in [w for w, known in self._fds.items() if known == fd]:
                    del self._fds[worker_id]
                    self._dropped[worker_id] = time.monotonic() - self._last_heard[worker_id]


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
        self._waker = _Waker(context)
        # Connected, and the first heartbeat queued, in the caller's thread: libzmq delivers it
        # without the GIL, so the learner knows this worker's connection even if env code starves
        # the thread from its start. The thread takes the socket over.
        channel, link = self._connect()
        channel.send(Kind.HEARTBEAT)
        self._thread = threading.Thread(
            target=self._run, args=(channel, link), name="clusterenv-heartbeat", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop the thread and close its socket."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._waker.wake()
            self._thread.join()

    def _connect(self) -> tuple[Channel, _Link]:
        """The heartbeat channel, and the state of its connection (which tells a live learner from a dead or frozen one)."""
        channel = Channel.connect_dealer(
            self._context,
            self.address,
            b"",  # never joins: its keys come from the command connection's join
            self._identity,
            session=self._session,
            max_message_bytes=HEARTBEAT_MAX_BYTES,
            curve=self._curve,
            options={**self.config.zmtp_options(), zmq.SNDTIMEO: 0},  # never block on a learner that stopped reading
            monitor=_WORKER_EVENTS,
        )
        assert channel.monitor is not None
        return channel, _Link(channel.monitor)

    def _run(self, channel: Channel, link: _Link) -> None:
        config = self.config
        delay = config.reconnect_initial
        reconnects = 0
        next_beat = time.monotonic() + config.interval
        wake = self._waker.open()
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
                        pass  # queue full: the connection is down, which the monitor reports
                    next_beat = now + config.interval
                link.update(min(0.1, max(0.0, next_beat - time.monotonic())), wake)
                if link.down_since is None:
                    delay, reconnects = config.reconnect_initial, 0
                    continue
                if time.monotonic() - link.down_since < config.expiry:
                    continue
                if link.refused:
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
                    "The connection to the learner at %s has been down for %.1f s; reconnecting in %.1f s.",
                    self.address,
                    config.expiry,
                    delay,
                )
                channel.close()
                if self._stop.wait(delay):
                    return
                channel, link = self._connect()
                reconnects += 1
                delay = min(2 * delay, config.reconnect_max)
        finally:
            self._waker.close()
            if not channel.socket.closed:
                channel.close()

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


class _Link:
    """A worker's liveness connection as its monitor reported it.

    Up (ZMTP handshake done) or down since when, and whether the learner's end refused a
    reconnect (nothing listens there: its process is gone).
    """

    def __init__(self, monitor: zmq.Socket) -> None:
        self.monitor = monitor
        self.down_since: float | None = time.monotonic()  # a new connection is down until its handshake
        self.refused = False

    def update(self, timeout: float, wake: zmq.Socket | None = None) -> None:
        """Apply the monitor's events, waiting up to ``timeout`` seconds for the first (or for ``wake``)."""
        for event, _ in _events(self.monitor, timeout, wake):
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.down_since, self.refused = None, False
            elif event == zmq.EVENT_DISCONNECTED and self.down_since is None:
                self.down_since = time.monotonic()
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self.refused = True
            elif event == zmq.EVENT_CONNECTED:
                self.refused = False  # something accepted the connection: a frozen learner's kernel does
