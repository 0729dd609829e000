"""Direct pipes between the learner and the worker processes it starts on its own host.

ZeroMQ moves every message through an I/O thread at each end: a command wakes the learner's
I/O thread, then the worker's, then the worker's main thread; a reply the same way back.
When every core is busy stepping envs, each of those wake-ups waits for a core, and on a
16-core host that staggered the workers' starts by up to 3 ms per batch step (measured:
``benchmarks/probes/timeline.py``). A worker the learner starts itself can instead hold one end of
a Unix socket pair: the worker's main thread reads its commands and writes its replies
itself, and the learner reads the replies in its own thread, so nothing waits for a third
thread to be scheduled.

The messages are the same as on ZeroMQ (joins, sessions, counters, MACs): a pipe only
carries them, each as one record ``[frame count: u32][body bytes: u64][frame lengths: u64...]
[frames...]``. Only the learner and the child it started hold the pair. A record of no
frames is the learner waking the worker on the shared step path: the worker then waits on
one descriptor, its pipe, for its commands, its messages and its wake-ups alike.

The learner's ends never block: what the kernel does not take at once waits in order and
leaves while the learner receives (as in a ZeroMQ socket's queue), so that a worker writing
a large reply while the learner writes a large command to it cannot deadlock them, and a
frozen worker cannot hang the learner. Receiving polls the ZeroMQ socket and every pipe at
once. A worker's end blocks, in one read bounded by ``SO_RCVTIMEO``: a worker only ever waits
for its learner, which always reads.
"""

from __future__ import annotations

import array
import collections
import contextlib
import errno
import logging
import os
import select
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from clusterenv.errors import ProtocolError

__all__ = ["WOKEN", "LearnerPipes", "Pipe", "PipeClosed", "WakeSocket", "pipe_pair", "wake_pair"]

logger = logging.getLogger(__name__)

_PREFIX = struct.Struct("<IQ")  # frame count, body bytes (lengths table + frames)
_MAX_FRAMES = 1 << 16
_READ_CHUNK = 1 << 18
# Bigger kernel buffers let a reply or command of a few hundred KB leave without waiting for
# the reader; the kernel caps them at net.core.wmem_max / rmem_max.
_SOCKET_BUFFER_BYTES = 4 << 20
# Buffers per sendmsg call (the kernel's IOV_MAX is 1024).
_MAX_IOV = 512
#: The longest the learner's blocking read of one wake socket waits (then the pool checks liveness).
WAKE_READ_TIMEOUT_S = 0.05
_RECEIVE_TIMEOUT = struct.pack("ll", 0, int(WAKE_READ_TIMEOUT_S * 1e6))  # struct timeval
# A record of no frames: the learner wakes a worker (the shared step path), on its pipe.
_WAKE_RECORD = _PREFIX.pack(0, 0)
# Wake-ups kept for a pipe the kernel takes nothing more of: beyond, its worker is not reading.
_MAX_QUEUED_WAKES = 1024
# ZeroMQ messages taken per poll before the pipes get their turn again.
_MAX_ZMQ_PER_POLL = 64


def pipe_pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of Unix stream sockets: the learner's end and the child's (neither inheritable)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for end in (ours, theirs):
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            # Linux caps the size at its maximum; a system that refuses it instead keeps its default.
            with contextlib.suppress(OSError):
                end.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER_BYTES)
    return ours, theirs


def wake_pair() -> tuple[socket.socket, socket.socket] | None:
    """A connected pair of Unix stream sockets for wake-up bytes on the shared step path (neither inheritable).

    ``None`` where this Python cannot pass a file descriptor over a socket (no ``SCM_RIGHTS``): the
    shared step path passes its region so, and workers then keep the message path.
    """
    if not (hasattr(socket, "SCM_RIGHTS") and hasattr(socket, "CMSG_SPACE") and hasattr(socket.socket, "sendmsg")):
        return None
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


#: What a carrier delivers as a record's frames for a wake-up byte (the shared step path): never framed.
WOKEN: list[Any] = []

# A wake-up byte: a command or a reply is in the shared step region.
_WAKE = b"w"
# Room for the few descriptors one read may carry (the learner passes one at a time).
_ANCILLARY_BYTES = socket.CMSG_SPACE(4 * 4) if hasattr(socket, "CMSG_SPACE") else 0  # none: see wake_pair()
# The byte that carries a file descriptor (the step region) as SCM_RIGHTS ancillary data.
_FD = b"f"


class WakeSocket:
    """One end of a wake socket: a worker's wake-up bytes for the learner (the shared step path), and the region's file.

    The learner reads its end only where a byte has arrived, or in a read bounded by
    ``WAKE_READ_TIMEOUT_S`` (:meth:`LearnerPipes.await_wake_up`). A worker reads its end only
    for the region's file (:meth:`PipeCarrier.take_fd
    <clusterenv.wire.carriers.PipeCarrier.take_fd>`): the learner wakes it with a record on its
    pipe, so that it waits on one descriptor. Bytes read are counted, so that two wake-ups
    read at once are two.

    At most one wake-up is in flight, so a byte always fits unless the other end has
    stopped reading what the protocol has it read. The learner's end never waits for that
    (``never_waits``): it sends without blocking, and a channel found full is a
    ``ProtocolError``, so that a worker that never drains its end cannot hang the learner. A
    worker's end waits, as on its pipe: a worker only ever waits for its learner.

    Args:
        sock: one end of a :func:`wake_pair`.
        blocking: whether reads wait (the learner's reads are bounded by ``SO_RCVTIMEO`` instead).
        takes_fds: a worker's end, which keeps the files passed to it; the learner's ignores any
            (the kernel closes them).
        never_waits: sends never block (the learner's end).
    """

    def __init__(self, sock: socket.socket, *, blocking: bool, takes_fds: bool, never_waits: bool = False) -> None:
        self.sock = sock
        self.sock.setblocking(blocking)
        self.fd = sock.fileno()
        self.takes_fds = takes_fds
        self._send_flags = socket.MSG_DONTWAIT if never_waits else 0
        self.closed = False
        self.wakes = 0  # wake-up bytes read and not yet taken
        self.fds: collections.deque[int] = collections.deque()  # files received and not yet taken

    def wake(self) -> None:
        """Send one wake-up byte; ``PipeClosed`` if the other end is gone, ``ProtocolError`` if it is full."""
        try:
            self.sock.send(_WAKE, self._send_flags)
        except BlockingIOError:
            raise _full() from None
        except OSError as exc:
            self.close()
            raise PipeClosed(f"The other end of the wake socket is gone ({exc}).") from None

    def pass_fd(self, fd: int) -> None:
        """Send a file descriptor (it arrives before anything sent on the pipe after it); raises as :meth:`wake`."""
        try:
            # sendmsg itself: socket.send_fds() drops its flags (CPython 3.11 to 3.13), so it would block.
            self.sock.sendmsg([_FD], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))], self._send_flags)
        except BlockingIOError:
            raise _full() from None
        except OSError as exc:
            self.close()
            raise PipeClosed(f"The other end of the wake socket is gone ({exc}).") from None

    def read(self) -> None:
        """Read what has arrived (a blocking end: wait for it), counting wake-ups and keeping files."""
        fds: list[int] = []
        try:
            if self.takes_fds:  # recvmsg itself: recv_fds() costs a worker more per step than the read
                data, ancillary, _, _ = self.sock.recvmsg(64, _ANCILLARY_BYTES)
                for level, kind, payload in ancillary:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
            else:
                data = os.read(self.fd, 64)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        self.fds.extend(fds)
        if not data:
            self.close()
            raise PipeClosed("The other end of the wake socket closed it.")
        self.wakes += data.count(_WAKE)

    def take(self) -> bool:
        """Take one wake-up read earlier, if any."""
        if self.wakes:
            self.wakes -= 1
            return True
        return False

    def close(self) -> None:
        """Close this end, and any file received and not taken."""
        self.closed = True
        while self.fds:
            os.close(self.fds.popleft())
        self.sock.close()


def _full() -> ProtocolError:
    return ProtocolError(
        "its wake channel is full (it has not read the wake-ups sent to it; the protocol never has more "
        "than one in flight)"
    )


def _record(frames: Sequence[Any]) -> list[Any]:
    """The buffers of one record (see the module docstring)."""
    lengths = [memoryview(frame).nbytes for frame in frames]
    table = struct.pack(f"<{len(lengths)}Q", *lengths)
    return [_PREFIX.pack(len(frames), len(table) + sum(lengths)), table, *frames]


def _advance(buffers: list[Any], sent: int) -> list[Any]:
    """What remains of ``buffers`` after the first ``sent`` bytes left.

    Buffers that left whole are dropped, empty ones (an array of shape ``(8, 0)``) with them:
    ``memoryview.cast`` refuses a shape with a zero in it, so only the one buffer cut in the
    middle, never empty, is cast to bytes.
    """
    remaining = list(buffers)
    while remaining and sent >= memoryview(remaining[0]).nbytes:
        sent -= memoryview(remaining.pop(0)).nbytes
    if remaining and sent:
        remaining[0] = memoryview(remaining[0]).cast("B")[sent:]
    return remaining


class PipeClosed(ConnectionError):
    """The other end of a pipe is gone."""


class Pipe:
    """One end of a pipe: whole records in, whole records out.

    Args:
        sock: a connected Unix stream socket.
        max_record_bytes: the largest record accepted; a larger announcement closes the pipe
            before anything is allocated for it.
        blocking: a worker's end blocks; the learner's never does.
    """

    def __init__(self, sock: socket.socket, max_record_bytes: int, *, blocking: bool) -> None:
        self.sock = sock
        self.sock.setblocking(blocking)
        self.fd = sock.fileno()
        self.max_record_bytes = max_record_bytes
        self.closed = False
        #: The peer's routing id: the first record a worker sends (learner's ends; ``None`` until then).
        self.identity: bytes | None = None
        self._buffer = bytearray()
        self._chunk = bytearray(_READ_CHUNK)  # what one read takes (see _fill)
        self._chunk_view = memoryview(self._chunk)
        self._unsent: list[Any] = []
        self._receive_timeout: float | None = None  # the SO_RCVTIMEO set (a blocking end), None: none
        self._queued_wakes = 0  # wake-ups queued since the kernel last took bytes (see write_wake)

    # -- reading ---------------------------------------------------------------------------
    def _next_record(self) -> list[memoryview] | None:
        """The first complete record in the buffer, as read-only views of one copy; ``None`` if incomplete."""
        buffer = self._buffer
        if len(buffer) < _PREFIX.size:
            return None
        count, body = _PREFIX.unpack_from(buffer)
        if not body and not count:  # a wake-up
            del buffer[: _PREFIX.size]
            return []
        if count > _MAX_FRAMES or body > self.max_record_bytes or body < 8 * count:
            self.close()
            raise PipeClosed(f"A pipe record announced {count} frames in {body} bytes; the pipe was closed.")
        end = _PREFIX.size + body
        if len(buffer) < end:
            return None
        data = memoryview(bytes(buffer[_PREFIX.size : end]))
        del buffer[:end]
        lengths = struct.unpack_from(f"<{count}Q", data)
        frames, position = [], 8 * count
        for length in lengths:
            frames.append(data[position : position + length])
            position += length
        if position != body:
            self.close()
            raise PipeClosed("A pipe record's frame lengths do not add up to its size; the pipe was closed.")
        return frames

    def _fill(self, flags: int = 0) -> bool:
        """Read what has arrived (blocking ends: wait for something); ``False`` if nothing could be read.

        ``flags``: ``MSG_DONTWAIT`` reads a blocking end without waiting.

        Into a chunk kept from read to read: ``recv(n)`` allocates its ``n`` bytes before it
        reads, about 10 µs for a chunk's 256 KB, even when a record of 12 bytes is waiting or
        nothing is. A record larger than the chunk is read whole, once its size is known.
        """
        missing = self._missing()
        try:
            if missing > _READ_CHUNK:
                chunk: Any = self.sock.recv(missing, flags)
                read = len(chunk)
            else:
                read = self.sock.recv_into(self._chunk, 0, flags)
                chunk = self._chunk_view[:read]
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            read = 0
        if not read:
            self.close()
            raise PipeClosed("The other end of the pipe closed it.")
        self._buffer += chunk
        return True

    def _missing(self) -> int:
        """Bytes still to come for the record being read (0 if its size is not known yet)."""
        if len(self._buffer) < _PREFIX.size:
            return 0
        _, body = _PREFIX.unpack_from(self._buffer)
        return min(body, self.max_record_bytes) + _PREFIX.size - len(self._buffer)

    def read_available(self) -> list[list[memoryview]]:
        """Every complete record that has arrived (non-blocking ends), without waiting."""
        records = []
        while True:
            record = self._next_record()
            if record is not None:
                records.append(record)
                continue
            if not self._fill():
                return records

    def read(self, timeout_ms: int) -> list[memoryview] | None:
        """The next record, waiting up to ``timeout_ms`` (0: only what arrived; -1: forever); ``None`` on time-out.

        A blocking end's. Each wait is one read, bounded by ``SO_RCVTIMEO``: a worker woken on
        the shared step path pays one system call, not a ``select`` and then a read.
        """
        deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
        while True:
            record = self._next_record()
            if record is not None:
                return record
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                if not self._fill(socket.MSG_DONTWAIT):
                    return None
                continue
            self._bound_reads(remaining)
            if not self._fill() and deadline is not None and time.monotonic() >= deadline:
                return None

    def await_wakes(self, timeout_ms: int) -> bool | None:
        """Block up to ``timeout_ms`` for the next bytes (a blocking end): whether they are wake-ups alone.

        ``True``: only wake-up records came, and they are taken; ``False``: anything else came
        (or waits already), kept for :meth:`read`, which reads it as it always does; ``None``:
        nothing came. A worker on the shared step path waits for its next command here: one
        read, and no record parsed unless it is more than wake-ups.
        """
        if self._buffer:
            return False
        self._bound_reads(timeout_ms / 1000)
        try:
            read = self.sock.recv_into(self._chunk, 0)
        except (BlockingIOError, InterruptedError):  # SO_RCVTIMEO passed, or a signal
            return None
        except OSError:
            read = 0
        if not read:  # the end of the stream: read() finds it again, and closes the pipe there
            return False
        chunk = self._chunk_view[:read]
        wake = len(_WAKE_RECORD)
        if read % wake == 0 and chunk == _WAKE_RECORD * (read // wake):
            return True
        self._buffer += chunk
        return False

    def _bound_reads(self, seconds: float | None) -> None:
        """Bound a blocking read to ``seconds`` (``None``: unbounded), set only when it changes."""
        if seconds is not None:
            seconds = max(round(seconds, 3), 0.001)  # whole ms: a worker's waits repeat their bound; 0 means forever
        if seconds != self._receive_timeout:
            whole = 0 if seconds is None else int(seconds)
            micros = 0 if seconds is None else round((seconds - whole) * 1e6)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, micros))
            self._receive_timeout = seconds

    # -- writing ---------------------------------------------------------------------------
    @property
    def pending(self) -> bool:
        """Whether bytes wait to be written (non-blocking ends)."""
        return bool(self._unsent)

    def write_wake(self) -> None:
        """Send a record of no frames: the learner wakes a worker on the shared step path (one ``send``).

        A worker is woken once per command, and reads its pipe when it is: a pipe that has
        queued :data:`_MAX_QUEUED_WAKES` of them while the kernel took nothing more of it
        belongs to a worker that stopped reading (frozen, or not ours), and raises
        ``ProtocolError`` rather than keep more.
        """
        if self._unsent:  # behind what waits
            if self._queued_wakes >= _MAX_QUEUED_WAKES:
                raise _full()
            self._unsent.append(_WAKE_RECORD)
            self._queued_wakes += 1
            self.flush()
            return
        try:
            sent = self.sock.send(_WAKE_RECORD)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self.close()
            raise PipeClosed(f"The other end of the pipe is gone ({exc}).") from None
        if sent < len(_WAKE_RECORD):
            self._unsent = [memoryview(_WAKE_RECORD)[sent:]]
            self._queued_wakes = 1

    def write(self, frames: Sequence[Any]) -> None:
        """Send one record.

        A blocking end waits until it is written; a non-blocking end keeps what the kernel does
        not take yet, in order, for :meth:`flush` (as a ZeroMQ socket's queue does).
        """
        self._unsent += _record(frames)
        self.flush()

    def flush(self) -> None:
        """Write what waits: all of it on a blocking end, what the kernel takes now on a non-blocking one."""
        while self._unsent:
            try:
                sent = self.sock.sendmsg(self._unsent[:_MAX_IOV])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.close()
                raise PipeClosed(f"The other end of the pipe is gone ({exc}).") from None
            self._unsent = _advance(self._unsent, sent)
            self._queued_wakes = 0  # the worker reads: the wake-ups queued so far are on their way

    def close(self) -> None:
        """Close this end; the peer reads the end of the stream."""
        self.closed = True
        self._unsent = []
        self.sock.close()


class LearnerPipes:
    """The learner's pipes to its local workers, received from together with its ZeroMQ socket.

    Records from pipes come out as ``(routing id, frames)``, as ROUTER messages do; a pipe's
    first record is its worker's routing id, which routes the learner's messages back to it.
    """

    def __init__(
        self,
        zmq_socket: zmq.Socket,
        take_from_socket: Callable[[], tuple[bytes | None, list[Any]] | None],
        max_record_bytes: int,
    ) -> None:
        self._zmq_socket = zmq_socket
        self._take_from_socket = take_from_socket  # one message that has arrived on the socket, else None
        self.max_record_bytes = max_record_bytes
        self._by_fd: dict[int, Pipe] = {}
        self._by_identity: dict[bytes, Pipe] = {}
        self._wakes: dict[Pipe, WakeSocket] = {}  # each pipe's wake socket, for workers that have one
        self._by_wake_fd: dict[int, Pipe] = {}
        self._inbox: collections.deque[tuple[bytes | None, list[Any]]] = collections.deque()
        # One poll over the pipes, the wake sockets and the ZeroMQ socket's own file descriptor, which
        # signals only that the socket's events changed: recv() checks them before every poll.
        self._poller = select.poll()
        self._zmq_fd = int(zmq_socket.getsockopt(zmq.FD))
        self._poller.register(self._zmq_fd, select.POLLIN)
        #: Whether the socket's events must be read before the next wait: after its descriptor
        #: signalled, and after anything else used the socket (a send may consume the signal).
        self.check_socket = True

    def __bool__(self) -> bool:
        return bool(self._by_fd)

    def __contains__(self, identity: object) -> bool:
        return identity in self._by_identity

    def add(self, sock: socket.socket, wake: socket.socket | None = None) -> None:
        """Take the learner's end of a pipe to a worker about to start (and of its wake socket, if it has one)."""
        pipe = Pipe(sock, self.max_record_bytes, blocking=False)
        self.check_socket = True  # the socket may have been read without this poll meanwhile
        self._by_fd[pipe.fd] = pipe
        self._poller.register(pipe.fd, select.POLLIN)
        if wake is not None:
            # Blocking, for await_wake_up(); recv() reads one only when the poll says it has a byte.
            waker = WakeSocket(wake, blocking=True, takes_fds=False, never_waits=True)
            wake.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _RECEIVE_TIMEOUT)
            self._wakes[pipe] = waker
            self._by_wake_fd[waker.fd] = pipe
            self._poller.register(waker.fd, select.POLLIN)

    def has_wake(self, identity: object) -> bool:
        """Whether the worker process ``identity`` has a wake socket (the shared step path can reach it)."""
        pipe = self._by_identity.get(identity)  # type: ignore[call-overload]
        return pipe is not None and pipe in self._wakes and not self._wakes[pipe].closed

    def waker(self, identity: bytes) -> Callable[[], None]:
        """A function that wakes the worker process ``identity`` (looked up once, not per step).

        The wake-up is a record of no frames on its pipe, behind whatever was sent before it.
        It raises ``zmq.ZMQError(EHOSTUNREACH)`` once the process is gone, as a send does; it
        never blocks.
        """
        pipe, _ = self._wake_socket(identity)
        return lambda: self._write(pipe, Pipe.write_wake)

    def pass_fd(self, identity: bytes, fd: int) -> None:
        """Send a file descriptor to the worker process ``identity`` over its wake socket; raises as :meth:`waker`'s."""
        pipe, waker = self._wake_socket(identity)
        self._on_wake(identity, pipe, waker, lambda waker: waker.pass_fd(fd))

    def _wake_socket(self, identity: bytes) -> tuple[Pipe, WakeSocket]:
        pipe = self._by_identity.get(identity)
        waker = None if pipe is None else self._wakes.get(pipe)
        if pipe is None or waker is None:
            raise zmq.ZMQError(errno.EHOSTUNREACH, f"the wake socket of {identity!r} is closed")
        return pipe, waker

    def _on_wake(self, identity: bytes, pipe: Pipe, waker: WakeSocket, action: Callable[[WakeSocket], None]) -> None:
        """``action(waker)``; a wake socket that is closed, or found gone, raises as a send to a gone process does."""
        try:
            if waker.closed:
                raise PipeClosed("The wake socket is closed.")
            action(waker)
        except PipeClosed:
            self._remove(pipe)
            raise zmq.ZMQError(errno.EHOSTUNREACH, f"the wake socket of {identity!r} is closed") from None

    def drop(self, identity: bytes) -> None:
        """Close the pipe to that worker process, if it has one."""
        pipe = self._by_identity.pop(identity, None)
        if pipe is not None:
            self._remove(pipe)

    def _remove(self, pipe: Pipe) -> None:
        # This pipe's own entries only: a descriptor closed earlier may number a newer pipe now.
        if self._by_fd.get(pipe.fd) is pipe:
            del self._by_fd[pipe.fd]
            self._poller.unregister(pipe.fd)
        if pipe.identity is not None and self._by_identity.get(pipe.identity) is pipe:
            del self._by_identity[pipe.identity]
        if not pipe.closed:
            pipe.close()
        waker = self._wakes.pop(pipe, None)
        if waker is not None:
            if self._by_wake_fd.get(waker.fd) is pipe:
                del self._by_wake_fd[waker.fd]
                self._poller.unregister(waker.fd)
            if not waker.closed:
                waker.close()

    def close(self) -> None:
        """Close every pipe."""
        for pipe in list(self._by_fd.values()):
            self._remove(pipe)

    def send(self, identity: bytes, frames: Sequence[Any]) -> None:
        """Send to the worker process ``identity`` without blocking (what waits leaves while receiving).

        A pipe that is gone raises ``zmq.ZMQError(EHOSTUNREACH)``, as a ROUTER_MANDATORY socket does.
        """
        self._write(self._by_identity[identity], lambda pipe: pipe.write(frames))

    def _write(self, pipe: Pipe, write: Callable[[Pipe], None]) -> None:
        """``write(pipe)``, without blocking: what the kernel does not take leaves while receiving."""
        waited = pipe.pending
        try:
            if pipe.closed:
                raise PipeClosed("The pipe is closed.")
            write(pipe)
        except PipeClosed:
            self._remove(pipe)
            raise zmq.ZMQError(errno.EHOSTUNREACH, f"the pipe to {pipe.identity!r} is closed") from None
        if pipe.pending and not waited:
            self._poller.modify(pipe.fd, select.POLLIN | select.POLLOUT)

    def _flush(self, pipe: Pipe) -> None:
        try:
            pipe.flush()
        except PipeClosed as exc:
            logger.debug("%s (worker %r)", str(exc), pipe.identity)
            self._remove(pipe)
            return
        if not pipe.pending:
            self._poller.modify(pipe.fd, select.POLLIN)

    def _read(self, pipe: Pipe) -> None:
        try:
            records = pipe.read_available()
        except PipeClosed as exc:
            logger.debug("%s (worker %r)", str(exc), pipe.identity)
            self._remove(pipe)
            return
        for frames in records:
            if pipe.identity is None:
                self._name(pipe, frames)
            else:
                self._inbox.append((pipe.identity, frames))

    def _read_wake(self, pipe: Pipe) -> None:
        waker = self._wakes[pipe]
        try:
            waker.read()
        except PipeClosed as exc:  # the process is gone: its pipe says so too, and liveness checks see it
            logger.debug("%s (worker %r)", str(exc), pipe.identity)
            self._by_wake_fd.pop(waker.fd, None)
            self._poller.unregister(waker.fd)
            return
        while pipe.identity is not None and waker.take():
            self._inbox.append((pipe.identity, WOKEN))

    def _name(self, pipe: Pipe, frames: list[memoryview]) -> None:
        identity = bytes(frames[0]) if len(frames) == 1 else b""
        if not 0 < len(identity) <= 255 or identity in self._by_identity:
            logger.warning("A local worker's pipe opened with an invalid routing id; it was closed.")
            self._remove(pipe)
            return
        pipe.identity = identity
        self._by_identity[identity] = pipe

    def recv(self, timeout_ms: int) -> tuple[bytes | None, list[Any]] | None:
        """The next message from a pipe or from the ZeroMQ socket within ``timeout_ms`` (-1: forever)."""
        deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
        while not self._inbox:
            remaining = -1 if deadline is None else max(0, round((deadline - time.monotonic()) * 1000))
            self._poll(remaining)
            if not self._inbox and deadline is not None and time.monotonic() >= deadline:
                return None
        return self._inbox.popleft()

    def await_wake_up(self, identity: bytes) -> bool:
        """Block on the wake socket of the process ``identity`` for a wake-up; whether one came.

        The shared step path's blocking wait: one read, bounded by ``WAKE_READ_TIMEOUT_S``. A
        wake-up only says "read the region's words again", so the bytes read are dropped, and
        so are the wake-ups that :meth:`recv` queued earlier: the caller reads the words next.
        It returns False at once if a message read earlier is still to be received or a pipe
        still has bytes to send (:meth:`recv` takes it from there), and when the read times
        out or finds the end of the stream (the pool's liveness check then finds the process).
        """
        if self._inbox:
            self._inbox = collections.deque(item for item in self._inbox if item[1] is not WOKEN)
            if self._inbox:
                return False
        pipe = self._by_identity.get(identity)
        waker = None if pipe is None else self._wakes.get(pipe)
        if pipe is None or waker is None or waker.closed or pipe.pending:
            return False
        try:
            data = os.read(waker.fd, 64)
        except (BlockingIOError, InterruptedError):  # SO_RCVTIMEO passed
            return False
        except OSError:
            data = b""
        if not data:
            self._read_wake(pipe)  # reads the end again, and closes it there
            return False
        return True

    def _poll(self, timeout_ms: int) -> None:
        """Wait up to ``timeout_ms`` (-1: forever) for anything to read or write; what arrived goes to the inbox."""
        if self.check_socket:
            if int(self._zmq_socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                self._take_zmq()
                return
            self.check_socket = False
        for source, event in self._poller.poll(timeout_ms):
            if source == self._zmq_fd:
                self.check_socket = True
            elif source in self._by_wake_fd:
                self._read_wake(self._by_wake_fd[source])
            elif source in self._by_fd:
                pipe = self._by_fd[source]
                if event & select.POLLOUT:
                    self._flush(pipe)
                if event & (select.POLLIN | select.POLLERR | select.POLLHUP) and not pipe.closed:
                    self._read(pipe)

    def _take_zmq(self) -> None:
        for _ in range(_MAX_ZMQ_PER_POLL):
            message = self._take_from_socket()
            if message is None:
                return
            self._inbox.append(message)
