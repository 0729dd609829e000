"""Wire format between learner and workers: message kinds, framing and authentication.

A message is a ZeroMQ multipart message::

    [header, array_0, ..., array_k, blob_0, ..., blob_m, mac]

* ``header`` is a msgpack list: protocol version, kind, a small ``meta`` map, the
  ``[dtype, shape]`` of every array frame, and the number of blobs.
* Array frames are raw C-contiguous buffers (zero-copy on both ends where it pays).
* Blobs are cloudpickled Python objects (env factories, infos, call results). They are
  unpickled only after the MAC has been checked: pickles are code.
* ``mac`` is an HMAC-SHA256 keyed by the shared secret over the header and the blobs,
  and also over the array frames when ``cover_arrays`` is set (tcp). On ``ipc://`` the
  socket file lives in a ``0700`` directory, so the OS already authenticates the peer
  and hashing every observation frame would only cost time.

Everything here is a pure function of bytes, so the decoder can be fuzzed in isolation.
"""

from __future__ import annotations

import functools
import hmac
import math
import re
import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import msgpack
import numpy as np

from clusterenv.errors import AuthenticationError, ProtocolError

__all__ = [
    "COALESCE_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_HEADER_INT",
    "PROTOCOL_VERSION",
    "ROLLOUT_FIELDS",
    "Kind",
    "Message",
    "coalesce",
    "decode",
    "encode",
    "rollout_frames",
    "split",
    "split_rollout_frames",
]

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 64 * 1024
#: The largest integer a header can carry (msgpack's uint64); the smallest is -2**63.
MAX_HEADER_INT = 2**64 - 1
MAC_BYTES = 32
_MAX_NDIM = 32
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
    SHARE_OBS = 12
    PROBE = 13

    HELLO = 101
    READY = 102
    RESULT = 103
    VALUE = 104
    ERROR = 105
    CLOSED = 106
    ROLLOUT_RESULT = 107
    HEARTBEAT = 108
    WEIGHTS_REQUEST = 109


_KINDS = {int(kind): kind for kind in Kind}

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
    meta: dict[str, Any] = field(default_factory=dict)
    arrays: list[np.ndarray] = field(default_factory=list)
    blobs: list[bytes] = field(default_factory=list)


@functools.lru_cache(maxsize=16)
def _keyed_hmac(key: bytes) -> hmac.HMAC:
    """An HMAC with the key already absorbed: copying it skips re-deriving the key pads per message."""
    return hmac.new(key, digestmod="sha256")


def _mac(key: bytes, frames: list[Any]) -> bytes:
    views = [frame if type(frame) is bytes else memoryview(frame).cast("B") for frame in frames]
    sizes = [len(view) for view in views]
    # Length-prefix each frame so that moving bytes across a frame boundary changes the MAC.
    lengths = struct.pack(f"<{len(sizes)}Q", *sizes)
    mac = _keyed_hmac(key).copy()
    if sum(sizes) <= _ONE_SHOT_MAC_BYTES:
        mac.update(lengths + b"".join(views))
        return mac.digest()
    mac.update(lengths)
    for view in views:
        mac.update(view)
    return mac.digest()


def encode(
    kind: Kind,
    meta: dict[str, Any] | None = None,
    arrays: list[np.ndarray] | tuple[np.ndarray, ...] = (),
    blobs: list[bytes] | tuple[bytes, ...] = (),
    *,
    key: bytes,
    cover_arrays: bool,
) -> list[Any]:
    """Frames for one message, ending with its MAC."""
    contiguous = [a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in arrays]
    header = msgpack.packb(
        [PROTOCOL_VERSION, int(kind), meta or {}, [(a.dtype.str, a.shape) for a in contiguous], len(blobs)]
    )
    if len(header) > MAX_HEADER_BYTES:
        raise ProtocolError(f"Message header is {len(header)} bytes, more than {MAX_HEADER_BYTES}.")
    covered = [header, *contiguous, *blobs] if cover_arrays else [header, *blobs]
    return [header, *contiguous, *blobs, _mac(key, covered)]


def coalesce(frames: list[Any]) -> list[Any]:
    """Join a small message into one frame ``[count][lengths...][frames...]``; large ones stay split.

    A split message always has at least two frames (header and MAC), so one frame is unambiguous.
    """
    views = [frame if type(frame) is bytes else memoryview(frame).cast("B") for frame in frames]
    sizes = [len(view) for view in views]
    if sum(sizes) > COALESCE_BYTES:
        return frames
    table = struct.pack(f"<I{len(sizes)}I", len(sizes), *sizes)
    return [table + b"".join(views)]


def split(frames: list[Any]) -> list[Any]:
    """Inverse of :func:`coalesce`; raises :class:`ProtocolError` on a malformed table."""
    if len(frames) != 1:
        return frames
    data = memoryview(frames[0]).cast("B")
    if data.nbytes < 4:
        raise ProtocolError(f"Single-frame message of {data.nbytes} bytes is too short for its frame table.")
    (count,) = struct.unpack_from("<I", data)
    table_end = 4 + 4 * count
    if count < 2 or table_end > data.nbytes:
        raise ProtocolError(
            f"Single-frame message announces {count} frames, which its {data.nbytes} bytes cannot hold."
        )
    lengths = struct.unpack_from(f"<{count}I", data, 4)
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


def _parse_header(raw: bytes) -> tuple[Kind, dict[str, Any], list[tuple[np.dtype, tuple[int, ...]]], int]:
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"Header of {len(raw)} bytes exceeds the {MAX_HEADER_BYTES}-byte limit.")
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
        raise ProtocolError("Header field `arrays` must be a list of [dtype, shape].")
    specs = []
    for spec in array_specs:  # plain loops and type() checks: this runs for every message
        if type(spec) is not list or len(spec) != 2 or type(spec[0]) is not str or type(spec[1]) is not list:
            raise ProtocolError(f"Array spec {spec!r} must be [dtype string, shape list].")
        shape = spec[1]
        if len(shape) > _MAX_NDIM:
            raise ProtocolError(f"Array shape {shape!r} must be at most {_MAX_NDIM} non-negative integers.")
        for dim in shape:
            if type(dim) is not int or dim < 0:
                raise ProtocolError(f"Array shape {shape!r} must be at most {_MAX_NDIM} non-negative integers.")
        specs.append((_safe_dtype(spec[0]), tuple(shape)))
    return kind, meta, specs, n_blobs


def decode(frames: list[Any], *, key: bytes, cover_arrays: bool) -> Message:
    """Check and decode one message; raise :class:`ProtocolError` on anything unexpected.

    Array payloads are returned as read-only views of the received frames.
    """
    if len(frames) < 2:
        raise ProtocolError(f"Message has {len(frames)} frame(s); expected at least a header and a MAC.")
    kind, meta, specs, n_blobs = _parse_header(bytes(frames[0]))
    if len(frames) != 2 + len(specs) + n_blobs:
        raise ProtocolError(
            f"Message has {len(frames)} frames but its header announces {len(specs)} array(s) and {n_blobs} blob(s)."
        )
    array_frames = frames[1 : 1 + len(specs)]
    blob_frames = frames[1 + len(specs) : -1]
    covered = [frames[0], *array_frames, *blob_frames] if cover_arrays else [frames[0], *blob_frames]
    if not hmac.compare_digest(bytes(frames[-1]), _mac(key, covered)):
        raise AuthenticationError("Message MAC does not match: the peer does not hold the shared secret.")
    arrays = []
    for (dtype, shape), frame in zip(specs, array_frames, strict=True):
        buffer = memoryview(frame).toreadonly()  # received zmq.Frames are writable; callers get views only
        expected = math.prod(shape) * dtype.itemsize
        if buffer.nbytes != expected:
            raise ProtocolError(
                f"Array frame has {buffer.nbytes} bytes; dtype {dtype} and shape {shape} need {expected}."
            )
        arrays.append(np.frombuffer(buffer, dtype=dtype).reshape(shape))
    return Message(kind, meta, arrays, [bytes(b) for b in blob_frames])
