"""Lossless compression of large array frames between hosts (``ClusterEnv(compression=...)``).

Observations compress well (preprocessed Atari frames 50-150x), and a link between hosts
is slower than the learner: 1 GbE carries about 4,400 uncompressed 84x84x4 frames a second.
Compression is per array frame, only for frames of at least :data:`MIN_BYTES`, and a frame
that does not shrink travels as it is. The receiver decompresses only after the message's
MAC has been checked, and only into exactly the size that the frame's dtype and shape
declare: a frame that would decompress to more, or less, is refused (:class:`ProtocolError`).

Codecs (measured on Breakout frames, 8 envs per message, one core; docs/benchmarks.md):

* ``"lz4"`` (python-lz4's block format): compresses fastest, about 57x on those frames.
* ``"zstd"`` (Zstandard level 1, the ``zstandard`` package): about 150x at similar
  decompression speed, for about 1.5x lz4's compression CPU on the worker.
"""

from __future__ import annotations

import threading
from typing import Any

import lz4.block
import zstandard

from clusterenv.errors import ProtocolError

__all__ = ["CODECS", "MIN_BYTES", "check_codec", "compress", "decompress"]

#: The codecs a frame may be compressed with.
CODECS = ("lz4", "zstd")
#: Array frames smaller than this travel uncompressed: a small frame gains little and costs a call.
MIN_BYTES = 4096
_ZSTD_LEVEL = 1
# zstandard's (de)compressor objects are not thread-safe; each thread that sends or receives keeps its own.
_local = threading.local()


def check_codec(codec: Any) -> str | None:
    """``codec`` if it is ``None`` or one of :data:`CODECS`; else a ``ValueError`` naming the choices."""
    if codec is None or (type(codec) is str and codec in CODECS):
        return codec
    raise ValueError(f"`compression` must be None or one of {list(CODECS)}, got {codec!r}.")


def _zstd() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    pair = getattr(_local, "zstd", None)
    if pair is None:
        pair = _local.zstd = (zstandard.ZstdCompressor(level=_ZSTD_LEVEL), zstandard.ZstdDecompressor())
    return pair


def compress(codec: str, buffer: Any) -> bytes:
    """``buffer`` (bytes-like) compressed with ``codec``."""
    if codec == "lz4":
        return lz4.block.compress(buffer, store_size=False)
    return _zstd()[0].compress(buffer)


def decompress(codec: str, data: Any, size: int) -> bytes:
    """``data`` decompressed with ``codec``: exactly ``size`` bytes, else :class:`ProtocolError`, allocating no more."""
    try:
        if codec == "lz4":
            out = lz4.block.decompress(data, uncompressed_size=size)  # writes at most ``size`` bytes
        elif codec == "zstd":
            declared = zstandard.frame_content_size(data)
            if declared != size:  # zstandard would allocate what the frame declares
                raise ProtocolError(f"A zstd frame declares {declared} bytes; its array needs {size}.")
            out = _zstd()[1].decompress(data, max_output_size=size)
        else:
            raise ProtocolError(f"Array frame codec {codec!r} is not one of {list(CODECS)}.")
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"A {codec} array frame does not decompress: {exc}") from None
    if len(out) != size:
        raise ProtocolError(f"A {codec} array frame decompressed to {len(out)} bytes; its array needs {size}.")
    return out
