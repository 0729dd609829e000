"""ZeroMQ sockets: where the learner binds, how workers connect, and safe defaults.

The learner owns one ROUTER socket; each worker owns one DEALER with an explicit routing
identity (the zguide's Paranoid Pirate layout). Every socket has ``LINGER=0`` so that
closing never blocks on unsent messages, and ``ROUTER_MANDATORY`` so that a message to
a worker that is gone fails loudly instead of vanishing.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import shutil
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import zmq

from clusterenv.cleanup import scratch_dir
from clusterenv.errors import ProtocolError
from clusterenv.protocol import Kind, Message, coalesce, decode, encode, split

__all__ = [
    "SECRET_ENV_VAR",
    "Channel",
    "is_loopback",
    "new_identity",
    "resolve_secret",
]

logger = logging.getLogger(__name__)

SECRET_ENV_VAR = "CLUSTERENV_SECRET"
# A generous cap: policy weights travel in one message. Larger messages are dropped by ZeroMQ.
MAX_MESSAGE_BYTES = 1 << 31


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


@dataclass
class Channel:
    """A socket plus the key and framing rules used on it."""

    socket: zmq.Socket
    key: bytes
    cover_arrays: bool
    _remove_tmpdir: weakref.finalize | None = field(default=None, repr=False)
    # The receive timeout currently set on the socket (ms, -1 = forever), to set it only when it changes.
    _rcvtimeo: int | None = field(default=None, repr=False)
    #: Whether :meth:`recv` on a ROUTER records :attr:`source_fd` (off: it costs a call per message).
    track_source: bool = field(default=False, repr=False)
    #: The file descriptor of the connection the last routed message came from, as monitor events name it.
    source_fd: int | None = field(default=None, repr=False)
    #: Where the socket's connection events are reported (``zmq.utils.monitor``), if asked for; closed with it.
    monitor: zmq.Socket | None = field(default=None, repr=False)

    @classmethod
    def bind_router(
        cls, context: zmq.Context, address: str | None, key: bytes, *, options: Mapping[int, int] | None = None
    ) -> Channel:
        """Bind the learner's ROUTER; ``address=None`` means a fresh private ``ipc://`` path.

        ``options`` are further socket options, set before binding: connections take them from the listener.
        """
        tmpdir = None
        if address is None:
            tmpdir = scratch_dir()  # mode 0700: only this user can connect
            address = f"ipc://{tmpdir}/learner.sock"
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        for option, value in (options or {}).items():
            socket.setsockopt(option, value)
        try:
            socket.bind(address)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            if tmpdir:
                shutil.rmtree(tmpdir, ignore_errors=True)
            raise OSError(f"Cannot bind the learner socket to {address!r}: {exc}") from exc
        channel = cls(socket, key, cover_arrays=not address.startswith("ipc://"))
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
        options: Mapping[int, int] | None = None,
        monitor: int = 0,
    ) -> Channel:
        """Connect a worker's DEALER to the learner.

        ``options`` are further socket options; ``monitor`` the ``zmq.EVENT_*`` flags to report on
        :attr:`monitor`. Both are set before connecting, so that no event of the connection is missed.
        """
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IDENTITY, identity)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        for option, value in (options or {}).items():
            socket.setsockopt(option, value)
        events = socket.get_monitor_socket(monitor) if monitor else None
        socket.connect(address)
        return cls(socket, key, cover_arrays=not address.startswith("ipc://"), monitor=events)

    @property
    def endpoint(self) -> str:
        """The address actually bound (wildcard ports resolved)."""
        return self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def send(
        self,
        kind: Kind,
        meta: dict[str, Any] | None = None,
        arrays: list[np.ndarray] | tuple[np.ndarray, ...] = (),
        blobs: list[bytes] | tuple[bytes, ...] = (),
        *,
        to: bytes | None = None,
    ) -> None:
        """Send one message (to ``to`` on a ROUTER)."""
        self.send_frames(self.frames(kind, meta, arrays, blobs), to=to)

    def frames(
        self,
        kind: Kind,
        meta: dict[str, Any] | None = None,
        arrays: list[np.ndarray] | tuple[np.ndarray, ...] = (),
        blobs: list[bytes] | tuple[bytes, ...] = (),
    ) -> list[Any]:
        """One message encoded for this channel, for :meth:`send_frames`: encoding errors raise here, before sending."""
        return coalesce(encode(kind, meta, arrays, blobs, key=self.key, cover_arrays=self.cover_arrays))

    def send_frames(self, frames: list[Any], *, to: bytes | None = None) -> None:
        """Send a message encoded by :meth:`frames` (to ``to`` on a ROUTER)."""
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

    def recv(self, timeout: float | None, *, routed: bool) -> tuple[bytes | None, Message] | None:
        """Receive one valid message within ``timeout`` seconds, or ``None``.

        Messages that fail to decode or authenticate are logged and dropped: a stray or
        hostile peer must not be able to crash the receiver.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            frames = self._recv_frames(-1 if remaining is None else int(remaining * 1000))
            if frames is None:
                return None
            sender = None
            if routed:
                if self.track_source:
                    self.source_fd = frames[0].get(zmq.SRCFD)
                sender, frames = frames[0].bytes, frames[1:]
            try:
                return sender, decode(split(frames), key=self.key, cover_arrays=self.cover_arrays)
            except ProtocolError as exc:
                logger.warning("Dropped a message from %r: %s", sender, exc)
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _recv_frames(self, timeout_ms: int) -> list[zmq.Frame] | None:
        """The frames of one message, or ``None`` after ``timeout_ms`` (-1: wait forever).

        A blocking receive under ``RCVTIMEO`` costs one call where poll-then-receive costs
        two, and uncopied frames (read through ``.more``) avoid ``recv_multipart``'s
        per-frame option lookups; decode copies what it keeps out of them.
        """
        socket = self.socket
        if timeout_ms != self._rcvtimeo:
            socket.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._rcvtimeo = timeout_ms
        try:
            frame = socket.recv(copy=False)
        except zmq.Again:
            return None
        frames = [frame]
        while frame.more:  # the rest of a multipart message has arrived with its first frame
            frame = socket.recv(copy=False)
            frames.append(frame)
        return frames

    def close(self, linger: int = 0) -> None:
        """Close the socket (keeping unsent messages up to ``linger`` ms) and remove the private ipc directory."""
        if self.monitor is not None:
            self.socket.disable_monitor()
            self.monitor.close(linger=0)
        self.socket.close(linger=linger)
        if self._remove_tmpdir is not None:
            self._remove_tmpdir()
