"""Wire format between learner and workers: message kinds, framing, keys and authentication.

A message is a ZeroMQ multipart message::

    [header, array_0, ..., array_k, blob_0, ..., blob_m, trailer]

* ``header`` is a msgpack list: protocol version, kind, a small ``meta`` map, the
  ``[dtype, shape]`` of every array frame, and the number of blobs.
* Array frames are raw C-contiguous buffers (zero-copy on both ends where it pays), or,
  between hosts with compression on, large ones compressed (:mod:`clusterenv.wire.codecs`):
  their spec then names the codec, ``[dtype, shape, codec]``.
* Blobs are cloudpickled Python objects (env factories, infos, call results). They are
  unpickled only after the MAC has been checked: pickles are code.
* ``trailer`` is fixed-size: the sender's message counter, the number of array frames,
  and a MAC over both, the length of every frame, the header, the blobs, and the array
  frames too when ``cover_arrays`` is set (tcp). The MAC is keyed BLAKE3 (the ``blake3``
  package): as cheap as keyed BLAKE2b on a small message and about 6x faster on an
  observation frame (6 GB/s against 0.9 GB/s on one core), which is most of what a frame
  from another host costs the learner. On ``ipc://`` the socket file lives in a ``0700``
  directory, so the OS already authenticates the peer and hashing every observation frame
  would only cost time.

The receiver checks the trailer's MAC before anything is parsed (msgpack included) or
decompressed, and only then the counter: each direction of a connection counts its messages, so a
replayed or reordered message is dropped. Keys are per connection and per direction,
derived with HKDF-SHA256 from the shared secret and a nonce from each side, exchanged in
a three-message join (:data:`Kind.HELLO`, :data:`Kind.WELCOME`, :data:`Kind.JOIN`; see
:mod:`clusterenv.wire.transport`). Only HELLO and WELCOME use a key derived from the secret
alone; WELCOME echoes the worker's nonce, so neither can be replayed into a join.

Everything here is a pure function of bytes, so the decoder can be fuzzed in isolation.
"""

from __future__ import annotations

import functools
import hmac
import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import blake3
import msgpack
import numpy as np

from clusterenv.errors import AuthenticationError, ProtocolError
from clusterenv.wire import codecs

__all__ = [
    "COALESCE_BYTES",
    "MAX_ARRAY_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_HEADER_INT",
    "NONCE_BYTES",
    "PROTOCOL_VERSION",
    "ROLLOUT_FIELDS",
    "STEP_FIELDS",
    "TRAILER_BYTES",
    "Kind",
    "Message",
    "Session",
    "coalesce",
    "decode",
    "derive_key",
    "encode",
    "hello_session",
    "pack",
    "parse",
    "read_trailer",
    "rollout_frames",
    "session_pair",
    "split",
    "split_rollout_frames",
    "step_fields",
    "trailer",
    "verify",
]

#: Bumped whenever a message's content changes (4: infos travel packed, see ``wire/infos.py``;
#: 5: any message may name a re-homed worker's ``slot``; 6: keyed BLAKE2b MACs instead of
#: HMAC-SHA256; 7: keyed BLAKE3 MACs, compressed array frames, WELCOME names the codec; 9: ROLLOUT
#: and PROBE carry the learner's movement, WEIGHTS_REQUEST the pull's reason), so that a learner and
#: a worker of different versions refuse each other with a clear error.
PROTOCOL_VERSION = 9
MAX_HEADER_BYTES = 64 * 1024
#: The largest integer a header can carry (msgpack's uint64); the smallest is -2**63.
MAX_HEADER_INT = 2**64 - 1
NONCE_BYTES = 16
#: The most bytes the arrays of one message may declare (compressed frames are checked against it before
#: anything is decompressed); transport passes its own, lower limit where it has one.
MAX_ARRAY_BYTES = 1 << 31
# Message counter, number of array frames, MAC (keyed BLAKE3, 32 bytes).
MAC_BYTES = 32
_TRAILER = struct.Struct(f"<QI{MAC_BYTES}s")
TRAILER_BYTES = _TRAILER.size
_MAX_NDIM = 32
# The most frames a coalesced message may announce: far above any real message, low enough
# that reading the frame table of a forged one costs nothing.
_MAX_COALESCED_FRAMES = 1 << 16
# Messages smaller than this travel as one frame: each ZeroMQ frame costs ~8 µs a round trip.
COALESCE_BYTES = 64 * 1024
# Below this size one C call over joined bytes beats incremental hashing.
_ONE_SHOT_MAC_BYTES = 64 * 1024
# Only plain numeric dtypes may be rebuilt from bytes; an object dtype would be a pointer.
_SAFE_DTYPE_KINDS = frozenset("biufc")
_DTYPE_STR = re.compile(r"[<>|=]?[biufc][0-9]{1,2}")


class Kind(IntEnum):
    """Message kinds. Learner → worker commands, then worker → learner replies."""

    INIT = 1
    RESET = 2
    STEP = 3
    CALL = 4
    SET_ATTR = 5
    CLOSE = 6
    SET_POLICY = 7
    SET_WEIGHTS = 8
    ROLLOUT = 9
    ROLLOUT_AHEAD = 10
    PUSH_WEIGHTS = 11
    SHARE_OBS = 12
    PROBE = 13
    WELCOME = 14
    SHARE_STEP = 15
    #: A wake-up on the shared step path (:mod:`clusterenv.wire.step_region`): never framed or sent,
    #: the channel's name for a byte on a wake socket (a command to a worker, a reply to the learner).
    WAKE_UP = 16
    #: Where a worker's envs sit among the ``ClusterEnv``'s, once the learner knows its units' sizes.
    PLACE = 17

    HELLO = 101
    READY = 102
    RESULT = 103
    VALUE = 104
    ERROR = 105
    CLOSED = 106
    ROLLOUT_RESULT = 107
    HEARTBEAT = 108
    WEIGHTS_REQUEST = 109
    JOIN = 110


_KINDS = {int(kind): kind for kind in Kind}

#: The arrays that follow the observation leaves in the RESULT of a STEP, in frame order. A RESULT's
#: first blob holds the per-env info records (empty: none); for observations without an array form a
#: second blob holds them pickled, and the observation leaves are absent (as they are for a worker
#: that writes them into the learner's shared batch).
STEP_FIELDS = ("rewards", "terminations", "truncations")

#: The transition arrays of a ROLLOUT_RESULT, in frame order (``next_obs`` follows them). ``obs`` and
#: ``next_obs`` take one frame per leaf of the observation space, in ``batching.leaf_arrays`` order.
ROLLOUT_FIELDS = (
    "obs",
    "actions",
    "logprobs",
    "logits",
    "rewards",
    "terminations",
    "truncations",
    "autoreset",
    "policy_versions",
)


def step_fields(msg: Message) -> list[np.ndarray]:
    """The :data:`STEP_FIELDS` arrays of a STEP's RESULT (after the observation leaves), in that order."""
    return list(msg.arrays[len(msg.arrays) - len(STEP_FIELDS) :])


def rollout_frames(
    obs: list[np.ndarray], fields: dict[str, np.ndarray], next_obs: list[np.ndarray]
) -> list[np.ndarray]:
    """The array frames of a ROLLOUT_RESULT: the observation leaves, the other fields, the next observation leaves."""
    return [*obs, *(fields[name] for name in ROLLOUT_FIELDS[1:]), *next_obs]


def split_rollout_frames(
    arrays: list[np.ndarray], num_leaves: int
) -> tuple[list[np.ndarray], dict[str, np.ndarray], list[np.ndarray]]:
    """Inverse of :func:`rollout_frames` for an observation space of ``num_leaves`` leaves."""
    expected = 2 * num_leaves + len(ROLLOUT_FIELDS) - 1
    if len(arrays) != expected:
        raise ProtocolError(
            f"A rollout result must have {expected} arrays for {num_leaves} observation leaves, got {len(arrays)}."
        )
    end = len(arrays) - num_leaves
    return (
        list(arrays[:num_leaves]),
        dict(zip(ROLLOUT_FIELDS[1:], arrays[num_leaves:end], strict=True)),
        list(arrays[end:]),
    )


@dataclass
class Message:
    """A decoded message, or a worker handler's reply. ``blobs`` stay bytes: the caller decides whether to unpickle."""

    kind: Kind
    meta: Mapping[str, Any] = field(default_factory=dict)
    arrays: list[np.ndarray] = field(default_factory=list)
    blobs: list[bytes] = field(default_factory=list)
    #: Infos already decoded (a ``clusterenv.wire.infos.InfoPayload``): a reply on the shared step
    #: path whose infos were in shared memory. Never framed; ``None``: they are in the first blob.
    infos: Any = None


class Session:
    """The keys and message counters of one connection, one of each per direction.

    ``heartbeat`` is the session of the same worker's heartbeat connection (its own keys and counters).
    """

    __slots__ = ("heartbeat", "received", "recv_key", "send_key", "sent")

    def __init__(self, send_key: bytes, recv_key: bytes, heartbeat: Session | None = None) -> None:
        self.send_key = send_key
        self.recv_key = recv_key
        self.sent = 0  # the counter of the last message sent
        self.received = 0  # the highest counter accepted
        self.heartbeat = heartbeat


def _hkdf(secret: bytes, salt: bytes, info: bytes) -> bytes:
    """HKDF-SHA256 (RFC 5869) with one block of output: 32 bytes."""
    prk = hmac.digest(salt, secret, "sha256")
    return hmac.digest(prk, info + b"\x01", "sha256")


def derive_key(secret: bytes, label: str) -> bytes:
    """A 32-byte key for one purpose (``label``), derived from the secret alone."""
    return _hkdf(secret, b"", b"clusterenv/2 " + label.encode())


def hello_session(secret: bytes) -> Session:
    """The session of HELLO and WELCOME, the only messages keyed by the secret alone (same key both ways)."""
    key = derive_key(secret, "hello")
    return Session(key, key)


def session_pair(secret: bytes, worker_nonce: bytes, learner_nonce: bytes, identity: bytes) -> tuple[Session, Session]:
    """The ``(learner, worker)`` ends of one worker's connections: command keys, and heartbeat keys inside."""
    salt = worker_nonce + learner_nonce

    def key(label: str) -> bytes:
        return _hkdf(secret, salt, b"clusterenv/2 " + label.encode() + b" " + identity)

    to_worker, to_learner = key("command learner->worker"), key("command worker->learner")
    beat_to_worker, beat_to_learner = key("heartbeat learner->worker"), key("heartbeat worker->learner")
    learner = Session(to_worker, to_learner, Session(beat_to_worker, beat_to_learner))
    worker = Session(to_learner, to_worker, Session(beat_to_learner, beat_to_worker))
    return learner, worker


@functools.lru_cache(maxsize=64)
def _prefix(n_frames: int) -> struct.Struct:
    return struct.Struct(f"<QI{n_frames}Q")


@functools.lru_cache(maxsize=64)
def _table(n_frames: int) -> struct.Struct:
    return struct.Struct(f"<I{n_frames}I")


def _mac(
    key: bytes, counter: int, n_arrays: int, sizes: Sequence[int], cover_arrays: bool, frames: Sequence[Any]
) -> bytes:
    """Keyed BLAKE3 under ``key`` of the counter, array count, frame lengths (``sizes``), then the covered frames.

    The lengths come first, so moving bytes across a frame boundary, or an array frame into
    the blobs, changes the MAC. The covered frames are all of ``frames``, or (``cover_arrays``
    off) all but the array frames, which ride on the OS's authentication of ``ipc://`` peers.
    """
    prefix = _prefix(len(sizes)).pack(counter, n_arrays, *sizes)
    if cover_arrays:
        covered, covered_bytes = frames, sum(sizes)
    else:
        covered, covered_bytes = [frames[0], *frames[1 + n_arrays :]], sizes[0] + sum(sizes[1 + n_arrays :])
    if covered_bytes <= _ONE_SHOT_MAC_BYTES:  # one hash call over joined bytes: the common case
        return blake3.blake3(b"".join([prefix, *covered]), key=key).digest()
    mac = blake3.blake3(prefix, key=key)
    for frame in covered:  # large updates release the GIL
        mac.update(_byte_view(frame) if type(frame) is np.ndarray else memoryview(frame))  # zmq.Frames need a view
    return mac.digest()


def _byte_view(a: np.ndarray) -> memoryview:
    """A C-contiguous array's bytes, flat.

    BLAKE3 and the codecs take byte buffers only, and ``memoryview.cast`` refuses empty shapes.
    """
    return a.reshape(-1).view(np.uint8).data


def _sizes(frames: Sequence[Any]) -> list[int]:
    """Byte lengths: frames are bytes, zmq.Frames or byte memoryviews (their ``len``), or arrays (``nbytes``)."""
    return [frame.nbytes if type(frame) is np.ndarray else len(frame) for frame in frames]


def trailer(key: bytes, counter: int, n_arrays: int, frames: list[Any], cover_arrays: bool) -> bytes:
    """The last frame of a message: its counter, its number of array frames and the MAC of ``frames`` under them."""
    return _TRAILER.pack(counter, n_arrays, _mac(key, counter, n_arrays, _sizes(frames), cover_arrays, frames))


def read_trailer(frame: Any) -> tuple[int, int, bytes]:
    """``(counter, number of arrays, MAC)`` of a trailer frame, unchecked (:func:`verify` checks them)."""
    if len(frame) != TRAILER_BYTES:
        raise ProtocolError(f"Message trailer is {len(frame)} bytes; expected {TRAILER_BYTES}.")
    counter, n_arrays, tag = _TRAILER.unpack(frame)
    return counter, n_arrays, tag


def _header(kind: Kind, meta: Mapping[str, Any] | None, specs: list[list[Any]], n_blobs: int) -> bytes:
    header = msgpack.packb([PROTOCOL_VERSION, int(kind), meta or {}, specs, n_blobs])
    if len(header) > MAX_HEADER_BYTES:
        raise ProtocolError(f"Message header is {len(header)} bytes, more than {MAX_HEADER_BYTES}.")
    return header


def _array_frames(arrays: Sequence[np.ndarray], compression: str | None) -> tuple[list[Any], list[list[Any]]]:
    """The frames of ``arrays`` (C-contiguous, or compressed with ``compression`` where that pays) and their specs."""
    frames: list[Any] = []
    specs: list[list[Any]] = []
    for a in arrays:
        if not a.flags.c_contiguous:
            a = np.ascontiguousarray(a)
        if compression is not None and a.nbytes >= codecs.MIN_BYTES:
            packed = codecs.compress(compression, _byte_view(a))
            if len(packed) < a.nbytes:
                frames.append(packed)
                specs.append([a.dtype.str, a.shape, compression])
                continue
        frames.append(a)
        specs.append([a.dtype.str, a.shape])
    return frames, specs


def _signed(
    kind: Kind,
    meta: Mapping[str, Any] | None,
    arrays: Sequence[np.ndarray],
    blobs: Sequence[bytes],
    key: bytes,
    counter: int,
    cover_arrays: bool,
    compression: str | None,
) -> tuple[list[Any], list[int], bytes]:
    """A message's frames, their byte lengths and its trailer."""
    array_frames, specs = _array_frames(arrays, compression)
    frames: list[Any] = [_header(kind, meta, specs, len(blobs)), *array_frames, *blobs]
    sizes = _sizes(frames)
    tag = _mac(key, counter, len(array_frames), sizes, cover_arrays, frames)
    return frames, sizes, _TRAILER.pack(counter, len(array_frames), tag)


def encode(
    kind: Kind,
    meta: Mapping[str, Any] | None = None,
    arrays: Sequence[np.ndarray] = (),
    blobs: Sequence[bytes] = (),
    *,
    key: bytes,
    counter: int,
    cover_arrays: bool,
    compression: str | None = None,
) -> list[Any]:
    """Frames for one message, ending with its trailer (``counter`` and the MAC under ``key``).

    ``compression``: a codec of :mod:`clusterenv.wire.codecs` for large array frames, or ``None``.
    """
    frames, _, end = _signed(kind, meta, arrays, blobs, key, counter, cover_arrays, compression)
    return [*frames, end]


def pack(
    kind: Kind,
    meta: Mapping[str, Any] | None = None,
    arrays: Sequence[np.ndarray] = (),
    blobs: Sequence[bytes] = (),
    *,
    key: bytes,
    counter: int,
    cover_arrays: bool,
    compression: str | None = None,
) -> list[Any]:
    """What is sent: the frames of ``coalesce(encode(...))``, a small message built with one join."""
    frames, sizes, end = _signed(kind, meta, arrays, blobs, key, counter, cover_arrays, compression)
    if sum(sizes) + TRAILER_BYTES > COALESCE_BYTES:
        return [*frames, end]
    return [b"".join([_table(len(sizes) + 1).pack(len(sizes) + 1, *sizes, TRAILER_BYTES), *frames, end])]


def coalesce(frames: list[Any]) -> list[Any]:
    """Join a small message into one frame ``[count][lengths...][frames...]``; large ones stay split.

    A split message always has at least two frames (header and MAC), so one frame is unambiguous.
    """
    sizes = _sizes(frames)
    if sum(sizes) > COALESCE_BYTES:
        return frames
    return [_table(len(sizes)).pack(len(sizes), *sizes) + b"".join(frames)]


def split(frames: list[Any]) -> list[Any]:
    """Inverse of :func:`coalesce`, as read-only views of the one frame; :class:`ProtocolError` if malformed."""
    if len(frames) != 1:
        return frames
    data = memoryview(frames[0])
    if data.ndim != 1 or data.itemsize != 1:
        data = data.cast("B")
    data = data.toreadonly()  # received zmq.Frames are writable; callers get views only
    if data.nbytes < 4:
        raise ProtocolError(f"Single-frame message of {data.nbytes} bytes is too short for its frame table.")
    (count,) = struct.unpack_from("<I", data)
    table_end = 4 + 4 * count
    if count < 2 or table_end > data.nbytes or count > _MAX_COALESCED_FRAMES:
        raise ProtocolError(
            f"Single-frame message announces {count} frames, which its {data.nbytes} bytes cannot hold."
        )
    if data.nbytes > table_end + COALESCE_BYTES:  # checked before the table is read: it is not authenticated
        raise ProtocolError(f"Single-frame message of {data.nbytes} bytes is larger than any coalesced message.")
    lengths = _table(count).unpack_from(data)[1:]
    if table_end + sum(lengths) != data.nbytes:
        raise ProtocolError("Single-frame message lengths do not add up to its size.")
    parts, offset = [], table_end
    for length in lengths:
        parts.append(data[offset : offset + length])
        offset += length
    return parts


@functools.lru_cache(maxsize=256)
def _safe_dtype(name: str) -> np.dtype:
    # Only ``dtype.str`` forms ('<f4', '|u1', ...) reach numpy's parser, which would otherwise
    # evaluate comma strings and raise anything from TypeError to SyntaxError on garbage.
    if _DTYPE_STR.fullmatch(name) is None:
        raise ProtocolError(f"Array dtype {name!r} is not a numpy dtype string such as '<f4'.")
    try:
        dtype = np.dtype(name)
    except Exception:
        raise ProtocolError(f"Array dtype {name!r} is not a numpy dtype.") from None
    if dtype.kind not in _SAFE_DTYPE_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise ProtocolError(f"Array dtype {name!r} is not a plain numeric dtype.")
    return dtype


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _parse_header(raw: Any) -> tuple[Kind, dict[str, Any], list[tuple[np.dtype, tuple[int, ...], str | None]], int]:
    try:
        header = msgpack.unpackb(raw, strict_map_key=True)
    except Exception as exc:
        raise ProtocolError(f"Header is not valid msgpack: {exc}") from None
    if not isinstance(header, list) or len(header) != 5:
        raise ProtocolError("Header must be a list [version, kind, meta, arrays, blobs].")
    version, kind_value, meta, array_specs, n_blobs = header
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"Protocol version {version!r} is not supported; expected {PROTOCOL_VERSION}.")
    kind = _KINDS.get(kind_value) if type(kind_value) is int else None
    if kind is None:
        raise ProtocolError(f"Unknown message kind {kind_value!r}.")
    if not isinstance(meta, dict):
        raise ProtocolError("Header field `meta` must be a map.")
    if not _is_count(n_blobs):
        raise ProtocolError("Header field `blobs` must be a non-negative integer.")
    if not isinstance(array_specs, list):
        raise ProtocolError("Header field `arrays` must be a list of [dtype, shape] or [dtype, shape, codec].")
    specs = []
    for spec in array_specs:  # plain loops and type() checks: this runs for every message
        if (
            type(spec) is not list
            or not 2 <= len(spec) <= 3
            or type(spec[0]) is not str
            or type(spec[1]) is not list
            or (len(spec) == 3 and spec[2] not in codecs.CODECS)
        ):
            raise ProtocolError(
                f"Array spec {spec!r} must be [dtype string, shape list] or [dtype string, shape list, codec] "
                f"with a codec in {list(codecs.CODECS)}."
            )
        shape = spec[1]
        if len(shape) > _MAX_NDIM:
            raise ProtocolError(f"Array shape {shape!r} must be at most {_MAX_NDIM} non-negative integers.")
        for dim in shape:
            if type(dim) is not int or dim < 0:
                raise ProtocolError(f"Array shape {shape!r} must be at most {_MAX_NDIM} non-negative integers.")
        specs.append((_safe_dtype(spec[0]), tuple(shape), spec[2] if len(spec) == 3 else None))
    return kind, meta, specs, n_blobs


def verify(frames: list[Any], *, key: bytes, cover_arrays: bool) -> tuple[int, int]:
    """Check a message's MAC, before anything in it is parsed; returns its ``(counter, number of arrays)``."""
    if len(frames) < 2:
        raise ProtocolError(f"Message has {len(frames)} frame(s); expected at least a header and a trailer.")
    counter, n_arrays, tag = read_trailer(frames[-1])
    if n_arrays > len(frames) - 2:
        raise ProtocolError(f"Message trailer announces {n_arrays} array(s) in {len(frames)} frames.")
    body = frames[:-1]
    if not hmac.compare_digest(tag, _mac(key, counter, n_arrays, _sizes(body), cover_arrays, body)):
        raise AuthenticationError(
            "Message MAC does not match: the peer does not hold the shared secret, or not this connection's keys."
        )
    return counter, n_arrays


def parse(frames: list[Any], n_arrays: int, max_array_bytes: int = MAX_ARRAY_BYTES) -> Message:
    """Decode a message whose MAC :func:`verify` accepted; raise :class:`ProtocolError` on anything unexpected.

    Array payloads are returned as read-only views of the received frames (compressed ones
    as arrays over their decompressed bytes). The arrays may declare ``max_array_bytes`` in
    all: more is refused before anything is decompressed.
    """
    if len(frames[0]) > MAX_HEADER_BYTES:  # checked before the header is copied out of its frame
        raise ProtocolError(f"Header of {len(frames[0])} bytes exceeds the {MAX_HEADER_BYTES}-byte limit.")
    kind, meta, specs, n_blobs = _parse_header(frames[0])
    if len(specs) != n_arrays or len(frames) != 2 + n_arrays + n_blobs:
        raise ProtocolError(
            f"Message has {len(frames)} frames and {n_arrays} array(s) but its header announces "
            f"{len(specs)} array(s) and {n_blobs} blob(s)."
        )
    declared = [math.prod(shape) * dtype.itemsize for dtype, shape, _ in specs]
    if sum(declared) > max_array_bytes:
        raise ProtocolError(f"The arrays of a message declare {sum(declared)} bytes, more than {max_array_bytes}.")
    arrays = []
    for (dtype, shape, codec), expected, frame in zip(specs, declared, frames[1 : 1 + n_arrays], strict=True):
        buffer = memoryview(frame)
        if codec is not None:
            buffer = memoryview(codecs.decompress(codec, buffer, expected))  # bytes: read-only
        elif not buffer.readonly:
            buffer = buffer.toreadonly()  # received zmq.Frames are writable; callers get views only
        if buffer.nbytes != expected:
            raise ProtocolError(
                f"Array frame has {buffer.nbytes} bytes; dtype {dtype} and shape {shape} need {expected}."
            )
        arrays.append(np.ndarray(shape, dtype, buffer))  # one call; frombuffer + reshape cost three times more
    return Message(kind, meta, arrays, [bytes(b) for b in frames[1 + n_arrays : -1]])


def decode(
    frames: list[Any], *, key: bytes, cover_arrays: bool, max_array_bytes: int = MAX_ARRAY_BYTES
) -> tuple[int, Message]:
    """``(counter, message)`` of received ``frames``: :func:`split`, :func:`verify` (first), then :func:`parse`."""
    frames = split(frames)
    counter, n_arrays = verify(frames, key=key, cover_arrays=cover_arrays)
    return counter, parse(frames, n_arrays, max_array_bytes)
