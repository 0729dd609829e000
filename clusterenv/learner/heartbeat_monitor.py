"""The learner's end of liveness: one thread that watches every worker's heartbeat connection.

See ``liveness`` for the design: a worker is lost when its liveness connection drops (dead,
frozen or partitioned) or its heartbeats stop for longer than ``busy_timeout``, never
merely because it is busy.
"""

from __future__ import annotations

import threading
import time

import zmq

from clusterenv.wire.liveness import (
    HEARTBEAT_MAX_BYTES,
    Heartbeat,
    Waker,
    monitor_events,
)
from clusterenv.wire.protocol import Kind, Session
from clusterenv.wire.transport import Channel, Curve

__all__ = ["LIVENESS_POLL_S", "HeartbeatMonitor"]

#: While waiting for replies or HELLOs, wake this often to notice a worker process that died.
LIVENESS_POLL_S = 0.05

# What the learner's monitor reports: a worker's connection made or dropped (the value is its fd).
_LEARNER_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


class HeartbeatMonitor:
    """The learner's heartbeat thread: tells each watched worker's connection apart, and notices it drop.

    A worker's first heartbeat names the connection it came on (its file descriptor, as the
    socket monitor names connections); a dropped connection is a lost worker.

    Args:
        context: the learner's ZeroMQ context.
        address: heartbeat bind address (``None``: a private ipc socket).
        key: the shared secret.
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
        self._waker = Waker(context)
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
        """How long worker ``worker_id`` may be silent: the expiry until it is connected, then ``busy_timeout``."""
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
        carrier = channel.zmq_carrier
        monitor = carrier.monitor = carrier.socket.get_monitor_socket(_LEARNER_EVENTS)
        carrier.track_source = True
        self.endpoint = channel.endpoint
        wake = self._waker.open()
        poller = zmq.Poller()
        for socket in (carrier.socket, monitor, wake):
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
                    self._apply(monitor_events(monitor))
                    sender, msg = received
                    if msg.kind is Kind.HEARTBEAT and sender is not None and carrier.source_fd is not None:
                        self._heard(sender, carrier.source_fd)
                    received = channel.recv(0, routed=True)
                self._apply(monitor_events(monitor))
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
