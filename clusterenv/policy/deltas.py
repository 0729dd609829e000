"""Weight deltas: a worker that holds one version of the weights is sent the difference to the next.

Successive policy versions differ little, so sending the whole tensors on every pull pays for
bytes the worker already has. Three encodings, chosen per pull by the learner:

* **full**: the tensors themselves, as raw array frames (what a new worker always gets);
* **lossless**: per tensor, the XOR of the new and the held bit patterns, its bytes regrouped
  by significance (all first bytes, then all second bytes, ...: the sign and exponent bytes
  of a small change are mostly zero) and compressed with Zstandard. The worker rebuilds the
  new tensors bit for bit;
* **lossy**: per float32 or float64 tensor, the difference quantized to ``bits``-bit integers
  with one scale per tensor (``bits=16``: float16), compressed the same way. The learner keeps each
  worker's rebuilt copy, so the next delta is taken from what the worker really holds and the
  quantization error of one pull is carried into the next (error feedback): it never
  accumulates over versions. Other tensors (float16 ones, integer counters) stay lossless.

Every shipment names the digest of the weights it produces, and a delta the digest of the
weights it applies to: a worker whose weights are not that base asks for a full copy
instead of rebuilding something else, and a rebuild that does not give the named digest is
refused the same way. The rebuild is the same function on both sides (:func:`apply_delta`
is what the learner's :func:`encode_delta` computes its record with).

This module is numpy only; the codec is the wire's (:mod:`clusterenv.wire.codecs`), whose
decompression allocates no more than the size each frame must have.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Literal, cast

import numpy as np

from clusterenv.errors import PolicyError, ProtocolError
from clusterenv.wire.codecs import compress, decompress

__all__ = [
    "CODEC",
    "Encoding",
    "LossyWeights",
    "WeightsSpec",
    "apply_delta",
    "check_weights_spec",
    "digest",
    "encode_delta",
]

#: The codec of every delta frame (level 1: the learner encodes one delta per worker per pull).
CODEC = "zstd"
Encoding = Literal["full", "lossless", "lossy"]


@dataclass(frozen=True)
class LossyWeights:
    """Lossy weight deltas, guarded: ``PolicyRunner(..., weights=LossyWeights(bits=8, guard_kl=1e-3))``.

    ``weights="lossy"`` is ``LossyWeights()``. After loading a lossy delta, the worker measures
    ``KL(π_learner ‖ π_rebuilt)`` on its probe states against the learner's outputs at the same
    version; above ``guard_kl`` it asks for an exact copy (a lossless delta) before acting.

    Args:
        bits: 2 to 8 (signed integers with one scale per tensor), or 16 (float16 differences).
        guard_kl: the KL (nats) that the rebuilt policy may differ from the learner's by; positive.
    """

    bits: int = 8
    guard_kl: float = 1e-3

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or self.bits not in (*range(2, 9), 16):
            raise PolicyError(f"`bits` must be an integer from 2 to 8, or 16 (float16), got {self.bits!r}.")
        value = self.guard_kl
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise PolicyError(f"`guard_kl` must be a positive finite KL (nats), got {value!r}.")


WeightsSpec = Literal["full", "lossless"] | LossyWeights | None


def check_weights_spec(weights: Any) -> WeightsSpec:
    """``weights`` as the runner keeps it: ``None`` (chosen per worker), ``"full"``, ``"lossless"`` or lossy."""
    if weights is None or isinstance(weights, LossyWeights):
        return weights
    if type(weights) is str and weights in ("full", "lossless"):
        return cast(WeightsSpec, weights)
    if type(weights) is str and weights == "lossy":
        return LossyWeights()
    raise PolicyError(
        f"`weights` must be None (lossless deltas to workers on other hosts, full copies on this one), "
        f"'full', 'lossless', 'lossy' or a clusterenv.LossyWeights, got {weights!r}."
    )


def digest(arrays: list[np.ndarray]) -> bytes:
    """A 16-byte BLAKE2b digest of the arrays' bytes, in order: names a set of weights on both sides."""
    hasher = hashlib.blake2b(digest_size=16)
    for array in arrays:
        hasher.update(np.ascontiguousarray(array).data)
    return hasher.digest()


def _bits_dtype(dtype: np.dtype) -> np.dtype:
    """Unsigned integers of ``dtype``'s width (bytes, for widths numpy has no such integer for)."""
    return np.dtype(f"u{dtype.itemsize}") if dtype.itemsize in (1, 2, 4, 8) else np.dtype(np.uint8)


def _bits_view(array: np.ndarray) -> np.ndarray:
    """The array's bit patterns as unsigned integers (:func:`_bits_dtype`), flat."""
    return np.ascontiguousarray(array).reshape(-1).view(_bits_dtype(array.dtype))


def _shuffle(array: np.ndarray) -> bytes:
    """A flat array's bytes grouped by significance (the lowest byte of every element first, and so on).

    The significant bytes of a small change are mostly zeros, which then compress as a run.
    The planes are cut with shifts of the unsigned integers of the element's width: numpy's
    strided transpose of an ``(n, width)`` byte matrix is several times slower.
    """
    width = array.dtype.itemsize
    if width == 1:
        return array.tobytes()
    bits = array.view(f"u{width}")
    planes = np.empty((width, array.size), dtype=np.uint8)
    for plane in range(width):
        planes[plane] = (bits >> (8 * plane)).astype(np.uint8, casting="unsafe")
    return planes.tobytes()


def _unshuffle(data: bytes, dtype: np.dtype, count: int) -> np.ndarray:
    """The inverse of :func:`_shuffle`: ``count`` elements of ``dtype``, rebuilt from their byte planes."""
    planes = np.frombuffer(data, dtype=np.uint8).reshape(dtype.itemsize, count)
    if dtype.itemsize == 1:
        return planes[0].view(dtype).copy()
    unsigned = np.dtype(f"u{dtype.itemsize}")
    bits = planes[0].astype(unsigned)
    for plane in range(1, dtype.itemsize):
        bits |= planes[plane].astype(unsigned) << unsigned.type(8 * plane)
    return bits.view(dtype)


def _quantizable(array: np.ndarray) -> bool:
    return array.dtype in (np.float32, np.float64)


def _rebuild_lossy(held: np.ndarray, quantized: np.ndarray, scale: float) -> np.ndarray:
    """``held + quantized * scale`` in ``held``'s dtype: the one formula both sides rebuild with."""
    step = quantized.astype(held.dtype).reshape(held.shape)
    if scale != 1.0:  # float16 differences travel unscaled
        step *= held.dtype.type(scale)
    return held + step


def _quantize(held: np.ndarray, new: np.ndarray, bits: int) -> tuple[np.ndarray, float] | None:
    """``new - held`` quantized, with its scale; ``None`` where the difference is not finite."""
    difference = new - held
    largest = float(np.max(np.abs(difference))) if difference.size else 0.0
    if not math.isfinite(largest):
        return None
    if bits == 16:
        if largest > float(np.finfo(np.float16).max):
            return None
        return difference.astype(np.float16), 1.0
    levels = 2 ** (bits - 1) - 1
    scale = largest / levels if largest > 0 else 0.0
    if scale == 0.0:
        return np.zeros(difference.shape, dtype=np.int8), 0.0
    return np.clip(np.rint(difference / scale), -levels, levels).astype(np.int8), scale


def encode_delta(
    held: list[np.ndarray], new: list[np.ndarray], bits: int | None
) -> tuple[list[np.ndarray], list[float | None], list[np.ndarray]]:
    """The frames of a delta from ``held`` to ``new``, its per-tensor scales, and what the worker will rebuild.

    ``bits=None`` is lossless (every scale ``None``, the rebuild is ``new`` itself); otherwise
    floating tensors are quantized (a scale per tensor) and the rebuild differs from ``new``
    by at most half a quantization step per element.
    """
    frames: list[np.ndarray] = []
    scales: list[float | None] = []
    rebuilt: list[np.ndarray] = []
    for base, target in zip(held, new, strict=True):
        quantized = _quantize(base, target, bits) if bits is not None and _quantizable(base) else None
        if quantized is None:
            payload = _bits_view(base) ^ _bits_view(target)
            scales.append(None)
            rebuilt.append(target)
        else:
            payload, scale = quantized
            scales.append(scale)
            rebuilt.append(_rebuild_lossy(base, payload, scale))
        frames.append(np.frombuffer(compress(CODEC, _shuffle(payload.reshape(-1))), dtype=np.uint8))
    return frames, scales, rebuilt


def apply_delta(
    held: list[np.ndarray], frames: list[np.ndarray], scales: list[float | None], bits: int | None
) -> list[np.ndarray]:
    """Rebuild the weights a delta names from the ``held`` ones (the worker's side of :func:`encode_delta`).

    Raises:
        ProtocolError: the delta does not fit the held tensors (count, sizes, codec).
    """
    if not len(frames) == len(scales) == len(held):
        raise ProtocolError(
            f"A weight delta has {len(frames)} frames and {len(scales)} scales for a policy of {len(held)} tensors."
        )
    rebuilt = []
    for base, frame, scale in zip(held, frames, scales, strict=True):
        if scale is None:
            kind = _bits_dtype(base.dtype)
        elif bits == 16:
            kind = np.dtype(np.float16)
        elif bits is not None:
            kind = np.dtype(np.int8)
        else:
            raise ProtocolError("A lossless weight delta carries a quantization scale.")
        count = base.nbytes // kind.itemsize if scale is None else base.size
        payload = _unshuffle(decompress(CODEC, frame, count * kind.itemsize), kind, count)
        if scale is None:
            rebuilt.append((_bits_view(base) ^ payload).view(base.dtype).reshape(base.shape))
        else:
            rebuilt.append(_rebuild_lossy(base, payload, scale))
    return rebuilt
