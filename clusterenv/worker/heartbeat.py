"""The worker's end of liveness: its heartbeat thread, which is also its watchdog.

See ``liveness`` for the design: a worker ends itself when its learner is known to be
dead, or unreachable after ``max_reconnects`` backed-off reconnects, never merely because
the learner is busy.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import zmq

from clusterenv.wire.cleanup import kill_descendants, remove_stale_dirs
from clusterenv.wire.liveness import (
    HEARTBEAT_MAX_BYTES,
    LEARNER_LOST_EXIT_CODE,
    Heartbeat,
    Waker,
    connect_address,
    monitor_events,
)
from clusterenv.wire.protocol import Kind, Session
from clusterenv.wire.transport import Channel, Curve

logger = logging.getLogger(__name__)

__all__ = ["HeartbeatClient"]

# What a worker's monitor reports: its connection up (ZMTP handshake done), dropped, or refused.
_WORKER_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED
)


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
        self.address = connect_address(learner_address, endpoint)
        self._context, self._session, self._identity, self._curve = context, session, identity, curve
        self._parent_pid = parent_pid
        self._exit_grace = exit_grace
        self.learner_lost = threading.Event()
        self._stop = threading.Event()
        self._waker = Waker(context)
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
        """The heartbeat channel, and the state of its connection (a live learner, or a dead or frozen one)."""
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
        monitor = channel.zmq_carrier.monitor
        assert monitor is not None
        return channel, _Link(monitor)

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
            if not channel.zmq_socket.closed:
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
        remove_stale_dirs()  # the learner's, if its process is gone
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
        for event, _ in monitor_events(self.monitor, timeout, wake):
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.down_since, self.refused = None, False
            elif event == zmq.EVENT_DISCONNECTED and self.down_since is None:
                self.down_since = time.monotonic()
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self.refused = True
            elif event == zmq.EVENT_CONNECTED:
                self.refused = False  # something accepted the connection: a frozen learner's kernel does
