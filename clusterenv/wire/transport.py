"""ZeroMQ sockets: where the learner binds, how workers connect, joining, and safe defaults.

The learner owns one ROUTER socket; each worker owns one DEALER with an explicit routing
identity (the zguide's Paranoid Pirate layout). Every socket has ``LINGER=0`` so that
closing never blocks on unsent messages, and ``ROUTER_MANDATORY`` so that a message to
a worker that is gone fails loudly instead of vanishing.

Joining: a worker's first message is HELLO with a fresh nonce; the learner answers
WELCOME with its own nonce (echoing the worker's), and both derive the keys of that
connection (:func:`~clusterenv.wire.protocol.session_pair`); the worker proves it holds them
with JOIN. Only then does the learner's caller see the HELLO. A replayed HELLO earns a
WELCOME that nobody without the secret can answer; a replayed WELCOME does not echo the
worker's current nonce. From then on each message carries a counter under its MAC, and
a message whose counter is not above the last one received is dropped.

Size limits come before any decoding: a peer that has not joined may send at most
:data:`PRE_JOIN_BYTES` per message, a joined one :attr:`Channel.max_message_bytes`.

Encryption (``ClusterEnv(encrypt=True)``) is CurveZMQ under all of that: the learner's
keypair and the workers' shared keypair are derived from the secret (:class:`Curve`),
so a peer without the secret fails ZeroMQ's own handshake and none of its messages is
ever read into the learner's memory; and messages cross the network encrypted. CurveZMQ
authenticates every message, so the MAC then skips the array frames, as on ``ipc://``.

Workers the learner starts on its own host may talk to it over pipes instead of the socket
(:mod:`clusterenv.wire.pipes`): the channel carries the same messages, joins included, over
them, polls them together with the socket on the learner's side, and neither compresses
nor MACs their array frames (only the learner and that child hold a pipe).

Compression (``ClusterEnv(compression="lz4")``) is the learner's choice for its tcp
connections: its WELCOME names the codec, and from then on both ends compress their large
array frames with it (:mod:`clusterenv.wire.codecs`). On ``ipc://`` nothing is compressed.
"""

from __future__ import annotations

import collections
import functools
import ipaddress
import logging
import os
import secrets
import shutil
import socket as pysocket
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import zmq
from zmq.utils import z85

from clusterenv.errors import ProtocolError
from clusterenv.wire import codecs
from clusterenv.wire.carriers import Carrier, LearnerCarrier, PipeCarrier, SocketCarrier
from clusterenv.wire.cleanup import scratch_dir
from clusterenv.wire.messages import WelcomeMeta, check_meta
from clusterenv.wire.pipes import WOKEN, LearnerPipes, Pipe, WakeSocket
from clusterenv.wire.protocol import (
    NONCE_BYTES,
    Kind,
    Message,
    Session,
    derive_key,
    hello_session,
    pack,
    parse,
    session_pair,
    split,
    verify,
)

__all__ = [
    "DROP_LOG_BURST",
    "DROP_LOG_WINDOW_S",
    "MAX_MESSAGE_BYTES",
    "PRE_JOIN_BYTES",
    "SECRET_ENV_VAR",
    "WAKE_UP",
    "Channel",
    "Curve",
    "is_loopback",
    "new_identity",
    "resolve_secret",
]

logger = logging.getLogger(__name__)

#: What a channel returns for a wake-up byte from a peer (the shared step path): the data is in the step region.
WAKE_UP = Message(Kind.WAKE_UP)

SECRET_ENV_VAR = "CLUSTERENV_SECRET"
# A generous cap: policy weights travel in one message. Larger messages are dropped by ZeroMQ.
MAX_MESSAGE_BYTES = 1 << 31
#: The most a peer that has not joined may send in one message (HELLO and JOIN need ~200 bytes).
PRE_JOIN_BYTES = 4096
# Joins under way (HELLO answered, JOIN awaited): the oldest is forgotten beyond this.
_MAX_PENDING_JOINS = 64
# Dropped messages logged one by one per window; the rest are counted in one line.
DROP_LOG_BURST = 10
DROP_LOG_WINDOW_S = 10.0


def new_identity(worker_id: int | None) -> bytes:
    """A fresh routing id for one worker process: ``worker-3-9f2c1a7b`` (``worker-any-...`` if unassigned).

    The random part makes every incarnation distinct, so that the learner can tell a
    replacement from the worker it replaces, and never routes to a stale connection.
    """
    return f"worker-{'any' if worker_id is None else worker_id}-{secrets.token_hex(4)}".encode()


def resolve_secret(secret: str | bytes | None) -> bytes | None:
    """The shared secret from the argument or ``$CLUSTERENV_SECRET``, as UTF-8 bytes."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV_VAR)
    if secret is None:
        return None
    value = secret.encode() if isinstance(secret, str) else bytes(secret)
    try:
        value.decode()
    except UnicodeDecodeError:
        raise ValueError(
            "The shared secret must be UTF-8 text so that it can travel in an environment variable."
        ) from None
    if len(value) < 16:
        raise ValueError(f"The shared secret must be at least 16 bytes long, got {len(value)}.")
    return value


def is_loopback(address: str) -> bool:
    """Whether binding ``address`` exposes the socket to this machine only."""
    parts = urlsplit(address)
    if parts.scheme in ("ipc", "inproc"):
        return True
    if parts.scheme != "tcp":
        return False
    host = (parts.hostname or "").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Curve:
    """CurveZMQ keys (z85): the learner's keypair, and one keypair shared by its workers, all from the secret.

    The learner's public key is never sent, and a client must know it to complete
    CurveZMQ's handshake: only holders of the secret connect at all.
    """

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> Curve:
        """Derive the keys; raises ``RuntimeError`` if this libzmq was built without CurveZMQ."""
        if not zmq.has("curve"):
            raise RuntimeError("Encryption needs a libzmq built with CurveZMQ (libsodium); this one is not.")
        server = z85.encode(derive_key(secret, "curve learner"))
        client = z85.encode(derive_key(secret, "curve worker"))
        return cls(zmq.curve_public(server), server, zmq.curve_public(client), client)

    def serve(self, socket: zmq.Socket) -> None:
        """Make ``socket`` (not yet bound) a CurveZMQ server."""
        socket.setsockopt(zmq.CURVE_SERVER, 1)
        socket.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)

    def connect(self, socket: zmq.Socket) -> None:
        """Make ``socket`` (not yet connected) a CurveZMQ client of the learner."""
        socket.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        socket.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
        socket.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)


class _DropLog:
    """Logs dropped messages, at most ``DROP_LOG_BURST`` per window: a flood must not flood the log.

    It logs the error's text, not the error: a handler that keeps log records (a test's) would
    otherwise keep its traceback, and with it the frames of the receive and what they refer to.
    """

    def __init__(self) -> None:
        self.window_end = 0.0
        self.logged = 0
        self.suppressed = 0

    def __call__(self, sender: bytes | None, exc: ProtocolError) -> None:
        now = time.monotonic()
        if now >= self.window_end:
            if self.suppressed:
                logger.warning(
                    "Dropped %d more messages in the last %.0f s without logging them.",
                    self.suppressed,
                    DROP_LOG_WINDOW_S,
                )
            self.window_end, self.logged, self.suppressed = now + DROP_LOG_WINDOW_S, 0, 0
        if self.logged < DROP_LOG_BURST:
            self.logged += 1
            logger.warning("Dropped a message from %r: %s", sender, str(exc))
        else:
            self.suppressed += 1


def _decoded(frames: list[Any], n_arrays: int, max_array_bytes: int) -> Message:
    """The message in verified ``frames``, its meta checked against its kind's declaration."""
    msg = parse(frames, n_arrays, max_array_bytes)
    check_meta(msg.kind, msg.meta)
    return msg


@dataclass
class Channel:
    """The keys, counters and framing rules of a connection, over a carrier that moves its records.

    Attributes:
        carrier: what moves the records, and says per peer whether their arrays are MACed and
            may be compressed (:mod:`clusterenv.wire.carriers`): a ZeroMQ socket, a worker's
            pipe, or the learner's socket with its pipes (from its first :meth:`add_pipe`).
        key: the shared secret (joins derive every connection's keys from it).
        sessions: per peer (``None`` on a DEALER), the keys and counters of its connection.
        accept_joins: whether peers may join here; the heartbeat socket gets its sessions
            from the command socket's joins instead.
        max_message_bytes: the most a joined peer may send in one message (and the most
            its arrays may decompress to).
        compression: the codec of large array frames sent on this connection (``None``: none).
            The learner's is its own choice (tcp only), a worker's the one the learner's WELCOME named.
    """

    carrier: Carrier
    key: bytes
    #: The ZeroMQ socket's carrier (``None``: a worker on a pipe): its monitor and source tracking.
    socket_carrier: SocketCarrier | None
    accept_joins: bool = True
    sessions: dict[bytes | None, Session] = field(default_factory=dict)
    max_message_bytes: int = MAX_MESSAGE_BYTES
    compression: str | None = None
    #: A worker's routing id (the learner routes by its peers' ids instead).
    identity: bytes | None = None
    #: The learner: its pipes to the workers it started, received from together with the socket.
    pipes: LearnerPipes | None = field(default=None, repr=False)
    _remove_tmpdir: weakref.finalize | None = field(default=None, repr=False)
    # Learner: joins under way, by peer: (learner's session, the HELLO). Worker: the nonce of its HELLO.
    _pending: dict[bytes, tuple[Session, Message]] = field(default_factory=dict, repr=False)
    _hello_nonce: bytes | None = field(default=None, repr=False)
    _hello: Session | None = field(default=None, repr=False)
    _drop_log: _DropLog = field(default_factory=_DropLog, repr=False)
    #: Seconds spent so far waiting for and receiving messages (the learner's waiting time).
    waited_s: float = field(default=0.0, repr=False)
    #: Messages handed to the carrier so far, by peer: whether one went out, for a sender interrupted around it.
    sent: collections.Counter[bytes | None] = field(default_factory=collections.Counter, repr=False)

    @classmethod
    def bind_router(
        cls,
        context: zmq.Context,
        address: str | None,
        key: bytes,
        *,
        accept_joins: bool = True,
        sessions: dict[bytes | None, Session] | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        curve: Curve | None = None,
        options: Mapping[int, int] | None = None,
        compression: str | None = None,
    ) -> Channel:
        """Bind the learner's ROUTER; ``address=None`` means a fresh private ``ipc://`` path.

        ``max_message_bytes`` is also ZeroMQ's ``MAXMSGSIZE``, which applies to connections
        as it was at bind time: set it here, not later. ``curve``: encrypt (CurveZMQ server).
        ``options`` are further socket options, set before binding: connections take them from the listener.
        ``compression``: the codec for large array frames both ways, on tcp (ignored on ``ipc://``).
        """
        tmpdir = None
        if address is None:
            tmpdir = scratch_dir()  # mode 0700: only this user can connect
            address = f"ipc://{tmpdir}/learner.sock"
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        for option, value in (options or {}).items():
            socket.setsockopt(option, value)
        if curve is not None:
            curve.serve(socket)
        try:
            socket.bind(address)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            if tmpdir:
                shutil.rmtree(tmpdir, ignore_errors=True)
            raise OSError(f"Cannot bind the learner socket to {address!r}: {exc}") from exc
        carrier = SocketCarrier(socket, private=address.startswith("ipc://") or curve is not None)
        channel = cls(
            carrier,
            key,
            carrier,
            accept_joins=accept_joins,
            sessions={} if sessions is None else sessions,
            max_message_bytes=max_message_bytes,
            compression=None if address.startswith("ipc://") else codecs.check_codec(compression),
        )
        if tmpdir:
            # Also at interpreter exit, for a channel never closed; a killed learner's is removed by the next one.
            channel._remove_tmpdir = weakref.finalize(channel, shutil.rmtree, tmpdir, ignore_errors=True)
        return channel

    @classmethod
    def connect_dealer(
        cls,
        context: zmq.Context,
        address: str,
        key: bytes,
        identity: bytes,
        *,
        session: Session | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        curve: Curve | None = None,
        options: Mapping[int, int] | None = None,
        monitor: int = 0,
    ) -> Channel:
        """Connect a worker's DEALER to the learner (with ``session``: on keys agreed on another connection).

        ``curve``: encrypt (CurveZMQ client); the learner must encrypt too. ``options`` are further
        socket options; ``monitor`` the ``zmq.EVENT_*`` flags to report on :attr:`monitor`. Both are
        set before connecting, so that no event of the connection is missed.
        """
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IDENTITY, identity)
        socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        for option, value in (options or {}).items():
            socket.setsockopt(option, value)
        if curve is not None:
            curve.connect(socket)
        events = socket.get_monitor_socket(monitor) if monitor else None
        socket.connect(address)
        sessions: dict[bytes | None, Session] = {} if session is None else {None: session}
        carrier = SocketCarrier(socket, private=address.startswith("ipc://") or curve is not None, monitor=events)
        return cls(
            carrier,
            key,
            carrier,
            accept_joins=False,
            sessions=sessions,
            max_message_bytes=max_message_bytes,
            identity=identity,
        )

    @classmethod
    def connect_pipe(
        cls,
        fd: int,
        key: bytes,
        identity: bytes,
        *,
        wake_fd: int | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> Channel:
        """A worker's channel on the pipe its learner gave it (file descriptor ``fd``, ``pipe://FD``).

        Its first record names the worker's routing id, as a DEALER's identity does on ZeroMQ.
        Nothing is compressed or MACed over arrays: only the learner and this process hold the pipe
        (and the wake socket ``wake_fd`` of the shared step path, if the learner gave one).
        """
        sock = pysocket.socket(fileno=fd)
        os.set_inheritable(fd, False)  # env code that forks must not hold the learner's pipe
        pipe = Pipe(sock, max_message_bytes, blocking=True)
        pipe.identity = identity
        pipe.write([identity])
        waker = None
        if wake_fd is not None:
            os.set_inheritable(wake_fd, False)
            waker = WakeSocket(pysocket.socket(fileno=wake_fd), blocking=True, takes_fds=True)
        return cls(
            PipeCarrier(pipe, waker),
            key,
            None,
            accept_joins=False,
            max_message_bytes=max_message_bytes,
            identity=identity,
        )

    def add_pipe(self, sock: pysocket.socket, wake: pysocket.socket | None = None) -> None:
        """Learner: take its end of the pipe (and wake socket) to a worker it is starting (the worker joins over it)."""
        if self.pipes is None:
            socket = self.zmq_carrier
            self.pipes = LearnerPipes(
                socket.socket, functools.partial(socket.take, zmq.NOBLOCK, True), self.max_message_bytes
            )
            self.carrier = LearnerCarrier(socket, self.pipes)
        self.pipes.add(sock, wake)

    @property
    def zmq_carrier(self) -> SocketCarrier:
        """The ZeroMQ socket's carrier (every channel but a worker's on a pipe has one)."""
        assert self.socket_carrier is not None, "a worker on a pipe has no socket"
        return self.socket_carrier

    @property
    def socket(self) -> zmq.Socket | None:
        """The ZeroMQ socket (``None``: a worker on a pipe)."""
        return None if self.socket_carrier is None else self.socket_carrier.socket

    @property
    def zmq_socket(self) -> zmq.Socket:
        """The ZeroMQ socket (every channel but a worker's on a pipe has one)."""
        return self.zmq_carrier.socket

    @property
    def endpoint(self) -> str:
        """The address actually bound (wildcard ports resolved)."""
        return self.zmq_socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def heartbeat_session(self, peer: bytes | None = None) -> Session:
        """The heartbeat keys and counters agreed when ``peer`` (on a DEALER: the learner) joined."""
        heartbeat = self.sessions[peer].heartbeat
        assert heartbeat is not None
        return heartbeat

    # -- the shared step path's wake sockets (:mod:`clusterenv.wire.step_region`) ---------------
    def can_wake(self, peer: bytes | None = None) -> bool:
        """Whether ``peer`` (a worker: its learner) has a wake socket."""
        return self.carrier.can_wake(peer)

    def wake(self, to: bytes | None = None) -> None:
        """Send a wake-up byte to ``to`` (a worker: to its learner)."""
        self.carrier.wake(to)

    def waker(self, to: bytes) -> Callable[[], None]:
        """Learner: a function that sends a wake-up byte to the worker process ``to`` (``zmq.ZMQError`` once gone)."""
        return self.carrier.waker(to)

    def pass_fd(self, fd: int, to: bytes) -> None:
        """Learner: send a file descriptor to the worker process ``to`` over its wake socket."""
        self.carrier.pass_fd(fd, to)

    def take_fd(self) -> int | None:
        """Worker: a file descriptor its learner passed, if one arrived."""
        return self.carrier.take_fd()

    def await_wake_up(self, peer: bytes) -> bool:
        """Learner: block on the wake socket of the joined worker process ``peer``; whether a wake-up came.

        It returns early when the read waits too long or anything else needs reading, which
        :meth:`recv` then returns (see ``LearnerPipes.await_wake_up``).
        """
        started = time.perf_counter()
        woken = self.carrier.await_wake_up(peer)
        self.waited_s += time.perf_counter() - started
        return woken

    def await_wakes(self, timeout: float) -> bool:
        """Worker: block up to ``timeout`` seconds for the next record; whether it was wake-ups alone (taken).

        Anything else, or nothing, is for :meth:`recv`, which reads and checks it as always. A
        wake-up carries nothing to authenticate: it only says "read the step region's words".
        """
        started = time.perf_counter()
        woken = self.carrier.await_wakes(int(timeout * 1000))
        self.waited_s += time.perf_counter() - started
        return woken is True

    def forget(self, peer: bytes) -> None:
        """Drop a peer's keys: nothing it sends is accepted any more."""
        self.sessions.pop(peer, None)
        self._pending.pop(peer, None)
        self.carrier.forget(peer)

    def send(
        self,
        kind: Kind,
        meta: Mapping[str, Any] | None = None,
        arrays: Sequence[np.ndarray] = (),
        blobs: Sequence[bytes] = (),
        *,
        to: bytes | None = None,
    ) -> None:
        """Send one message (to ``to`` on a ROUTER); a worker's HELLO starts its join."""
        if kind is Kind.HELLO and to is None and None not in self.sessions:
            self._hello_nonce = secrets.token_bytes(NONCE_BYTES)
            self._send(self._hello_session(), kind, {**(meta or {}), "nonce": self._hello_nonce}, (), (), to)
            return
        self.send_frames(self.frames(kind, meta, arrays, blobs, to=to), to=to)

    def frames(
        self,
        kind: Kind,
        meta: Mapping[str, Any] | None = None,
        arrays: Sequence[np.ndarray] = (),
        blobs: Sequence[bytes] = (),
        *,
        to: bytes | None = None,
    ) -> list[Any]:
        """One message encoded for peer ``to``, for :meth:`send_frames`: encoding errors raise here, before sending."""
        session = self.sessions.get(to)
        if session is None:
            raise ProtocolError(f"Cannot send {kind.name} to {to!r}: that peer has not joined.")
        return self._encode(session, kind, meta, arrays, blobs, to)

    def _covers_arrays(self, peer: bytes | None) -> bool:
        """Whether messages to and from ``peer`` MAC their array frames too (not on ``ipc://``, Curve or a pipe)."""
        return self.carrier.covers_arrays(peer)

    def _codec(self, peer: bytes | None) -> str | None:
        """The codec of large array frames to and from ``peer`` (none on a pipe)."""
        return self.compression if self.carrier.compresses(peer) else None

    def _encode(
        self,
        session: Session,
        kind: Kind,
        meta: Mapping[str, Any] | None,
        arrays: Sequence[np.ndarray],
        blobs: Sequence[bytes],
        to: bytes | None,
    ) -> list[Any]:
        session.sent += 1
        return pack(
            kind,
            meta,
            arrays,
            blobs,
            key=session.send_key,
            counter=session.sent,
            cover_arrays=self._covers_arrays(to),
            compression=self._codec(to),
        )

    def _send(
        self,
        session: Session,
        kind: Kind,
        meta: Mapping[str, Any] | None,
        arrays: Sequence[np.ndarray],
        blobs: Sequence[bytes],
        to: bytes | None,
    ) -> None:
        self.send_frames(self._encode(session, kind, meta, arrays, blobs, to), to=to)

    def send_frames(self, frames: list[Any], *, to: bytes | None = None) -> None:
        """Send a message encoded by :meth:`frames` (to ``to`` on a ROUTER)."""
        self.carrier.send(frames, to)
        self.sent[to] += 1

    def _hello_session(self) -> Session:
        if self._hello is None:
            self._hello = hello_session(self.key)
        return self._hello

    def recv(self, timeout: float | None, *, routed: bool) -> tuple[bytes | None, Message] | None:
        """Receive one valid message within ``timeout`` seconds, or ``None``.

        Messages that are too large, fail to authenticate, repeat an earlier counter or fail
        to decode are logged (rate-limited) and dropped: a stray or hostile peer must not be
        able to crash the receiver. Join messages are answered here and not returned, except
        that a completed join returns the worker's HELLO.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            started = time.perf_counter()
            received = self.carrier.recv(-1 if remaining is None else int(remaining * 1000), routed)
            self.waited_s += time.perf_counter() - started
            if received is None:
                return None
            sender, frames = received
            session = self.sessions.get(sender)
            if frames is WOKEN:  # a wake-up byte on the shared step path: its data is in the step region
                if session is not None:
                    return sender, WAKE_UP
                continue
            try:
                # Sizes first, from the frames' lengths: nothing is copied or parsed before the MAC.
                size = len(frames[0]) if len(frames) == 1 else sum(len(frame) for frame in frames)
                limit = PRE_JOIN_BYTES if session is None else self.max_message_bytes
                if size > limit:
                    raise ProtocolError(
                        f"Message of {size} bytes exceeds the {limit}-byte limit for "
                        f"{'a peer that has not joined' if session is None else 'a joined peer'}."
                    )
                frames = split(frames)
                if session is None:
                    hello = self._join(sender, frames)
                    if hello is not None:
                        return sender, hello
                else:
                    counter, n_arrays = verify(frames, key=session.recv_key, cover_arrays=self._covers_arrays(sender))
                    if counter <= session.received:
                        raise ProtocolError(
                            f"Message counter {counter} is not above the last one received ({session.received}): "
                            "a replayed or reordered message."
                        )
                    session.received = counter
                    return sender, _decoded(frames, n_arrays, self.max_message_bytes)
            except ProtocolError as exc:
                self._drop_log(sender, exc)
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _join(self, sender: bytes | None, frames: list[Any]) -> Message | None:
        """Handle a message from a peer without a session: a step of the join, or a :class:`ProtocolError`."""
        if sender is not None and sender in self._pending:  # the learner awaits this peer's JOIN
            session, hello = self._pending[sender]
            try:
                counter, n_arrays = verify(frames, key=session.recv_key, cover_arrays=self._covers_arrays(sender))
            except ProtocolError:
                pass  # not the JOIN: maybe a new HELLO, checked below
            else:
                if _decoded(frames, n_arrays, PRE_JOIN_BYTES).kind is not Kind.JOIN:
                    raise ProtocolError("Expected JOIN from a peer joining.")
                del self._pending[sender]
                session.received = counter
                self.sessions[sender] = session
                return hello
        if not self.accept_joins and self._hello_nonce is None:
            raise ProtocolError("The peer has not joined.")
        _, n_arrays = verify(frames, key=self._hello_session().recv_key, cover_arrays=self._covers_arrays(sender))
        msg = _decoded(frames, n_arrays, PRE_JOIN_BYTES)
        if sender is None:  # a worker: the learner's WELCOME
            nonce = msg.meta.get("nonce")
            if msg.kind is not Kind.WELCOME or msg.meta.get("echo") != self._hello_nonce or self._hello_nonce is None:
                raise ProtocolError(
                    f"Unexpected {msg.kind.name} before joining (not a WELCOME to this worker's HELLO)."
                )
            if type(nonce) is not bytes or len(nonce) != NONCE_BYTES:
                raise ProtocolError("WELCOME carries no valid nonce.")
            try:
                compression = codecs.check_codec(msg.meta["compression"])
            except ValueError as exc:
                raise ProtocolError(f"WELCOME names an unknown codec: {exc}") from None
            assert self.identity is not None, "only a worker's channel (with its routing id) joins"
            _, session = session_pair(self.key, self._hello_nonce, nonce, self.identity)
            self.sessions[None], self._hello_nonce, self.compression = session, None, compression
            self._send(session, Kind.JOIN, {}, (), (), None)
            return None
        nonce = msg.meta.get("nonce")
        if msg.kind is not Kind.HELLO:
            raise ProtocolError(f"Unexpected {msg.kind.name} from a peer that has not joined.")
        if type(nonce) is not bytes or len(nonce) != NONCE_BYTES:
            raise ProtocolError("HELLO carries no valid nonce.")
        learner_nonce = secrets.token_bytes(NONCE_BYTES)
        session, _ = session_pair(self.key, nonce, learner_nonce, sender)
        self._pending.pop(sender, None)
        if len(self._pending) >= _MAX_PENDING_JOINS:
            del self._pending[next(iter(self._pending))]
        # The nonce was the channel's business; the caller sees the HELLO the worker's code sent.
        hello = Message(msg.kind, {key: value for key, value in msg.meta.items() if key != "nonce"})
        self._pending[sender] = (session, hello)
        try:
            welcome = WelcomeMeta(nonce=learner_nonce, echo=nonce, compression=self._codec(sender))
            self._send(self._hello_session(), Kind.WELCOME, welcome, (), (), sender)
        except zmq.ZMQError:
            del self._pending[sender]  # gone already
        return None

    def close(self, linger: int = 0) -> None:
        """Close the carrier (keeping unsent messages up to ``linger`` ms) and the private ipc directory."""
        self.carrier.close(linger)
        if self._remove_tmpdir is not None:
            self._remove_tmpdir()
