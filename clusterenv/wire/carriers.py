"""Carriers: how a channel's records travel, behind one small interface.

A :class:`~clusterenv.wire.transport.Channel` owns the keys, counters and framing rules of
its connections; a carrier moves its encoded records: a ZeroMQ socket (:class:`SocketCarrier`,
ROUTER or DEALER), a worker's pipe to the learner that started it (:class:`PipeCarrier`), or
the learner's socket together with its pipes to local workers (:class:`LearnerCarrier`).
The carrier also says what a peer's records need: whether their array frames are covered by
the MAC (not on a private carrier: ``ipc://``, CurveZMQ, a pipe) and whether they may be
compressed (not on a pipe). The channel never asks which carrier it has.
"""

from __future__ import annotations

import errno
import select
import time
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from clusterenv.wire.pipes import WOKEN, LearnerPipes, Pipe, WakeSocket

__all__ = ["Carrier", "LearnerCarrier", "PipeCarrier", "Received", "SocketCarrier"]

#: One record as a carrier delivers it: ``(sender's routing id, or None unless routed; frames)``.
Received = tuple[bytes | None, list[Any]]


class Carrier(Protocol):
    """What a channel needs of whatever moves its records."""

    def send(self, frames: list[Any], to: bytes | None) -> None:
        """Send one record (to peer ``to`` where the carrier routes); raises ``zmq.ZMQError`` if it is gone."""

    def recv(self, timeout_ms: int, routed: bool) -> Received | None:
        """One record within ``timeout_ms`` (-1: forever; 0: only what has arrived), else ``None``."""

    def covers_arrays(self, peer: bytes | None) -> bool:
        """Whether the MAC of records to and from ``peer`` covers their array frames too."""

    def compresses(self, peer: bytes | None) -> bool:
        """Whether large array frames to and from ``peer`` may be compressed."""

    def forget(self, peer: bytes) -> None:
        """Stop carrying records of ``peer`` (a lost worker)."""

    def close(self, linger: int) -> None:
        """Close, keeping unsent records up to ``linger`` ms where that applies."""

    def can_wake(self, peer: bytes | None) -> bool:
        """Whether ``peer`` has a wake socket (the shared step path, :mod:`clusterenv.wire.step_region`)."""

    def wake(self, to: bytes | None) -> None:
        """Send a wake-up byte; raises ``zmq.ZMQError`` if the peer is gone or has no wake socket."""

    def waker(self, to: bytes) -> Callable[[], None]:
        """A function that does what ``wake(to)`` does, for the peer ``to`` is now (the learner's)."""

    def pass_fd(self, fd: int, to: bytes | None) -> None:
        """Send a file descriptor over the peer's wake socket."""

    def take_fd(self) -> int | None:
        """A file descriptor received on the wake socket, if one has arrived (workers)."""

    def await_wake_up(self, peer: bytes) -> bool:
        """Learner: block on ``peer``'s wake socket for a wake-up; whether one came (see ``LearnerPipes``)."""

    def await_wakes(self, timeout_ms: int) -> bool | None:
        """Worker: block up to ``timeout_ms`` for the next record; whether it was wake-ups alone.

        ``True``: wake-ups alone (taken); ``False``: anything else (left for :meth:`recv`); ``None``: nothing.
        """


def _no_wake(to: bytes | None) -> zmq.ZMQError:
    return zmq.ZMQError(errno.EHOSTUNREACH, f"{to!r} has no wake socket")


class _Unwakeable:
    """The wake-up methods of a carrier without wake sockets."""

    def can_wake(self, peer: bytes | None) -> bool:
        """Never."""
        return False

    def wake(self, to: bytes | None) -> None:
        """Raises: there is no wake socket."""
        raise _no_wake(to)

    def waker(self, to: bytes) -> Callable[[], None]:
        """Raises: there is no wake socket."""
        raise _no_wake(to)

    def pass_fd(self, fd: int, to: bytes | None) -> None:
        """Raises: there is no wake socket."""
        raise _no_wake(to)

    def take_fd(self) -> int | None:
        """Nothing ever arrives."""
        return None

    def await_wake_up(self, peer: bytes) -> bool:
        """None can arrive: receive as usual."""
        return False

    def await_wakes(self, timeout_ms: int) -> bool | None:
        """None can arrive: receive as usual."""
        return False


class SocketCarrier(_Unwakeable):
    """A ZeroMQ socket: the learner's ROUTER or a worker's DEALER.

    Args:
        socket: the socket, bound or connected.
        private: whether only this host's user (``ipc://``) or holders of the Curve keys can
            reach it: then array frames need no MAC.
        monitor: where the socket's connection events are reported, if asked for; closed with it.
    """

    def __init__(self, socket: zmq.Socket, *, private: bool, monitor: zmq.Socket | None = None) -> None:
        self.socket = socket
        self.private = private
        self.monitor = monitor
        #: Whether a routed receive records :attr:`source_fd` (off: it costs a call per message).
        self.track_source = False
        #: The file descriptor of the connection the last routed message came from, as monitor events name it.
        self.source_fd: int | None = None
        self._rcvtimeo: int | None = None  # the receive timeout set on the socket, to set it only when it changes

    def send(self, frames: list[Any], to: bytes | None) -> None:
        """Send one message (to ``to`` on a ROUTER)."""
        socket = self.socket
        if to is not None:
            socket.send(to, zmq.SNDMORE)
        if len(frames) == 1:
            socket.send(frames[0])  # one small frame; send_multipart's per-frame checks cost more than it
            return
        # A split message carries large arrays: zero-copy (pyzmq still copies frames below
        # zmq.COPY_THRESHOLD), so callers must not write into them before the peer replies.
        # A worker's observation buffer is written again only by the learner's next command.
        socket.send_multipart(frames, copy=False)

    def recv(self, timeout_ms: int, routed: bool) -> Received | None:
        """One message within ``timeout_ms``.

        A blocking receive under ``RCVTIMEO`` costs one call where poll-then-receive costs
        two, and uncopied frames (read through ``.more``) avoid ``recv_multipart``'s
        per-frame option lookups; parsing copies what it keeps out of them.
        """
        if timeout_ms != self._rcvtimeo:
            self.socket.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._rcvtimeo = timeout_ms
        return self.take(0, routed)

    def take(self, flags: int, routed: bool) -> Received | None:
        """One message from the socket (``zmq.NOBLOCK``: only if one has arrived)."""
        socket = self.socket
        try:
            frame = socket.recv(flags, copy=False)
        except zmq.Again:
            return None
        frames: list[Any] = [frame]
        while frame.more:  # the rest of a multipart message has arrived with its first frame
            frame = socket.recv(copy=False)
            frames.append(frame)
        if not routed:
            return None, frames
        if self.track_source:
            self.source_fd = frames[0].get(zmq.SRCFD)
        return frames[0].bytes, frames[1:]

    def covers_arrays(self, peer: bytes | None) -> bool:
        """Array frames are MACed unless the socket is private."""
        return not self.private

    def compresses(self, peer: bytes | None) -> bool:
        """Whatever codec the channel was given applies."""
        return True

    def forget(self, peer: bytes) -> None:
        """Nothing to drop: the channel forgets the peer's keys."""

    def close(self, linger: int) -> None:
        """Close the socket (and its monitor), keeping unsent messages up to ``linger`` ms."""
        if self.monitor is not None:
            self.socket.disable_monitor()
            self.monitor.close(linger=0)
        self.socket.close(linger=linger)


class PipeCarrier:
    """A worker's pipe to the learner that started it, and its wake socket if it has one: only these two hold them."""

    def __init__(self, pipe: Pipe, waker: WakeSocket | None = None) -> None:
        self.pipe = pipe
        self.wake_socket = waker

    def send(self, frames: list[Any], to: bytes | None) -> None:
        """Write one record (blocking: the learner reads its end whenever it waits)."""
        self.pipe.write(frames)

    def recv(self, timeout_ms: int, routed: bool) -> Received | None:
        """The next record from the learner, or a wake-up (frames :data:`~clusterenv.wire.pipes.WOKEN`).

        Both come on the pipe, in the order they were sent: one descriptor to wait on.
        """
        record = self.pipe.read(timeout_ms)
        if record is None:
            return None
        return None, (record if record else WOKEN)  # a record of no frames wakes the worker

    def can_wake(self, peer: bytes | None) -> bool:
        """Whether the learner gave this worker a wake socket."""
        return self.wake_socket is not None and not self.wake_socket.closed

    def wake(self, to: bytes | None) -> None:
        """Send the learner a wake-up byte."""
        if self.wake_socket is None:
            raise _no_wake(to)
        self.wake_socket.wake()

    def waker(self, to: bytes) -> Callable[[], None]:
        """A worker wakes its learner with :meth:`wake`."""
        raise _no_wake(to)

    def pass_fd(self, fd: int, to: bytes | None) -> None:
        """Workers pass no files."""
        raise _no_wake(to)

    def await_wake_up(self, peer: bytes) -> bool:
        """A worker takes its wake-ups in :meth:`recv`, or here between its steps (:meth:`await_wakes`)."""
        return False

    def await_wakes(self, timeout_ms: int) -> bool | None:
        """Block on the pipe for wake-ups alone (``Pipe.await_wakes``): anything else is left for :meth:`recv`."""
        return self.pipe.await_wakes(timeout_ms)

    def take_fd(self) -> int | None:
        """The oldest file the learner passed and nobody took yet, waiting up to a second for it to arrive.

        The learner passes a file before the command that uses it, on another socket; the wait
        covers the case of the command being read first.
        """
        waker = self.wake_socket
        if waker is None:
            return None
        deadline = time.monotonic() + 1.0
        while not waker.fds and time.monotonic() < deadline and not waker.closed:
            if select.select([waker.fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                waker.read()
        return waker.fds.popleft() if waker.fds else None

    def covers_arrays(self, peer: bytes | None) -> bool:
        """A pipe is private."""
        return False

    def compresses(self, peer: bytes | None) -> bool:
        """Nothing to gain on a pipe."""
        return False

    def forget(self, peer: bytes) -> None:
        """A worker's only peer is its learner."""

    def close(self, linger: int) -> None:
        """Close the worker's end (and its wake socket): the learner reads the end of the stream."""
        self.pipe.close()
        if self.wake_socket is not None and not self.wake_socket.closed:
            self.wake_socket.close()


class LearnerCarrier:
    """The learner's ROUTER socket and its pipes to the workers it started, received from together."""

    def __init__(self, socket: SocketCarrier, pipes: LearnerPipes) -> None:
        self.socket = socket
        self.pipes = pipes

    def send(self, frames: list[Any], to: bytes | None) -> None:
        """Send over the peer's pipe if it has one, else over the socket."""
        if to is not None and to in self.pipes:
            self.pipes.send(to, frames)
        else:
            self.socket.send(frames, to)
            self.pipes.check_socket = True

    def recv(self, timeout_ms: int, routed: bool) -> Received | None:
        """The next message from a pipe or from the socket (the socket alone once every pipe is gone)."""
        if self.pipes:
            return self.pipes.recv(timeout_ms)
        self.pipes.check_socket = True  # receiving from the socket directly may take its descriptor's signal
        return self.socket.recv(timeout_ms, routed)

    def covers_arrays(self, peer: bytes | None) -> bool:
        """As the socket does, except for peers on a pipe."""
        return peer not in self.pipes and self.socket.covers_arrays(peer)

    def compresses(self, peer: bytes | None) -> bool:
        """As the socket does, except for peers on a pipe."""
        return peer not in self.pipes and self.socket.compresses(peer)

    def forget(self, peer: bytes) -> None:
        """Close the peer's pipe, if it has one."""
        self.pipes.drop(peer)

    def close(self, linger: int) -> None:
        """Close the pipes and the socket."""
        self.pipes.close()
        self.socket.close(linger)

    def can_wake(self, peer: bytes | None) -> bool:
        """Whether ``peer`` is on a pipe with a wake socket."""
        return self.pipes.has_wake(peer)

    def wake(self, to: bytes | None) -> None:
        """Send a wake-up byte to the worker process ``to``."""
        if to is None:
            raise _no_wake(to)
        self.pipes.waker(to)()

    def waker(self, to: bytes) -> Callable[[], None]:
        """A function that wakes the worker process ``to`` (as :meth:`wake`), for the shared step path's every step."""
        return self.pipes.waker(to)

    def pass_fd(self, fd: int, to: bytes | None) -> None:
        """Send a file descriptor to the worker process ``to``."""
        if to is None:
            raise _no_wake(to)
        self.pipes.pass_fd(to, fd)

    def take_fd(self) -> int | None:
        """The learner receives no files."""
        return None

    def await_wake_up(self, peer: bytes) -> bool:
        """Block on the wake socket of the worker process ``peer`` (see ``LearnerPipes.await_wake_up``)."""
        return self.pipes.await_wake_up(peer)

    def await_wakes(self, timeout_ms: int) -> bool | None:
        """The learner receives as usual."""
        return False
