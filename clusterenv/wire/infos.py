"""Infos on the wire: each worker batches its own slice, the learner places the slices.

``SyncVectorEnv`` batches infos with ``VectorEnv._add_info``, env by env: a key's array takes
the dtype of the first env that reports it, later envs' values are cast into it, and every
key gets a ``_key`` mask. To return exactly that, workers used to send each env's info and
the learner replayed them all through ``_add_info``, one env and one key at a time, on its
critical path.

Now a worker packs its slice's infos into columns (:func:`pack_infos`): one per key, the
values of its envs as one raw array (numbers and numeric arrays) or a tuple (anything else),
with the rows that have the key. The learner places each column's rows into the batch
(:func:`merge_infos`); the per-env work happened on the workers, in parallel.

Placing gives what the replay would have given when the batch's array for a key has the same
dtype and shape as the slice's: both cast every value into that same dtype. So a worker packs
only a *uniform* slice (each key's values of one type, or one dtype and shape; plain string
keys without a leading ``_``, which could collide with a mask), and the learner checks each
column against the batch before placing anything. Whatever does not fit (a key that is an
``int`` in one slice and a ``float`` in another, say) is rebuilt into per-env infos and
replayed through Gymnasium's own ``_add_info``: a uniform column's values come back exactly
(a Python ``int`` from an ``int64`` row, a ``float32`` from a ``float32`` row).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from gymnasium.vector import VectorEnv

__all__ = [
    "BatchedInfoLog",
    "Column",
    "InfoPayload",
    "InfoRecord",
    "PYTHON_NUMBERS",
    "PackedInfos",
    "merge_infos",
    "pack_infos",
    "records_of",
    "replay_infos",
    "split_infos",
]

#: One env's info as a worker recorded it: ``(index within the worker's slice, info)``.
InfoRecord = tuple[int, dict[str, Any]]

#: One key of a packed slice: ``(key, kind, rows, data)``. ``kind`` is ``"n"`` (numbers or
#: numeric arrays: ``data`` is ``(python type, dtype char, shape, raw bytes of every row)``),
#: ``"o"`` (objects: ``data`` is the values of the rows that have the key) or ``"d"`` (a nested
#: dict: ``data`` is its columns). ``rows`` is the ``_key`` mask as bytes, or ``b""`` for every row.
Column = tuple[str, str, bytes, Any]

#: A worker slice's infos, packed: ``(number of envs, columns)``. Only builtin types, so that
#: the learner's restricted unpickler loads it.
PackedInfos = tuple[int, tuple[Column, ...]]

#: What a worker sends for a slice's infos: packed, or the per-env records if its slice is not uniform.
InfoPayload = PackedInfos | list[InfoRecord]

#: Slices of fewer envs travel as records: placing a column costs a few numpy calls, more
#: than replaying one or two envs' infos (measured on Atari's three info keys).
PACK_MIN_ENVS = 4

#: The Python number types a packed column names, by name (a column's values come back as these).
PYTHON_NUMBERS: dict[str, type] = {"int": int, "float": float, "bool": bool}
_PYTHON_NUMBERS = {kind: name for name, kind in PYTHON_NUMBERS.items()}


class _InfoBatcher(VectorEnv):
    """Holds only ``num_envs``: all that Gymnasium's ``VectorEnv._add_info`` reads."""

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs


@functools.lru_cache(maxsize=64)
def _batcher(num_envs: int) -> _InfoBatcher:
    return _InfoBatcher(num_envs)


def replay_infos(infos: dict[str, Any], records: Iterable[InfoRecord], num_envs: int, offset: int) -> dict[str, Any]:
    """Batch per-env info records into ``infos`` with Gymnasium's own ``VectorEnv._add_info``.

    Replaying the records with global indices (``offset + local index``), in env order,
    builds exactly the infos that one ``SyncVectorEnv`` over all ``num_envs`` envs would have built.
    """
    batcher = _batcher(num_envs)
    for local_index, env_info in records:
        infos = batcher._add_info(infos, env_info, offset + local_index)
    return infos


# -- packing (worker side) ------------------------------------------------------------------


class _NotUniform(Exception):
    """The slice's infos cannot be packed; its records are sent instead."""


# The answers of _packable_dtype by the dtype object's id, with the object itself (so that its id is
# not reused while cached). Not an lru_cache: that is keyed by equality, and equal dtypes differ
# here (a ``longlong`` equals an ``int64``): whichever came first would answer for both.
_PACKABLE: dict[int, tuple[np.dtype, bool]] = {}
_PACKABLE_MAX = 256


def _packable_dtype(dtype: np.dtype) -> bool:
    """Numbers whose dtype travels as its one-letter code and comes back the very same dtype.

    Only canonical dtypes: a ``longlong`` (``"q"``) would be packed as itself but is an
    ``int64`` (``"l"``) once pickled, so it travels as a record, pickled like any value.
    """
    cached = _PACKABLE.get(id(dtype))
    if cached is not None and cached[0] is dtype:
        return cached[1]
    packable = dtype.kind in "biufc" and np.dtype(dtype.char) is dtype and np.dtype(dtype.str) is dtype
    if len(_PACKABLE) >= _PACKABLE_MAX:
        _PACKABLE.clear()
    _PACKABLE[id(dtype)] = (dtype, packable)
    return packable


def _signature(key: str, value: Any) -> tuple[Any, ...]:
    """How ``_add_info`` batches ``value``: what decides the array it creates and what a row gives back."""
    if key == "final_obs":
        return ("o",)
    if isinstance(value, dict):
        return ("d",)
    kind = type(value)
    if kind in _PYTHON_NUMBERS:
        return ("n", _PYTHON_NUMBERS[kind], np.dtype(kind), ())
    if issubclass(kind, np.number):
        dtype = np.dtype(kind)
        if not _packable_dtype(dtype) or dtype.type is not kind:
            raise _NotUniform
        return ("n", "numpy", dtype, ())
    if isinstance(value, np.ndarray):
        if kind is not np.ndarray or not _packable_dtype(value.dtype) or not value.flags.c_contiguous:
            raise _NotUniform
        return ("n", "ndarray", value.dtype, value.shape)
    return ("o",)


def _columns(records: Sequence[tuple[int, dict[str, Any]]], size: int) -> tuple[Column, ...]:
    signatures: dict[str, tuple[Any, ...]] = {}
    rows: dict[str, list[tuple[int, Any]]] = {}
    for row, info in records:
        for key, value in info.items():
            if type(key) is not str or key.startswith("_"):
                raise _NotUniform
            signature = _signature(key, value)
            if signatures.setdefault(key, signature) != signature:
                raise _NotUniform
            rows.setdefault(key, []).append((row, value))
    columns: list[Column] = []
    for key, signature in signatures.items():
        values = rows[key]
        if len(values) == size:
            mask = b""
        else:
            present = np.zeros(size, dtype=np.bool_)
            present[[row for row, _ in values]] = True
            mask = present.tobytes()
        kind = signature[0]
        if kind == "n":
            _, python_type, dtype, shape = signature
            array = np.zeros((size, *shape), dtype=dtype)
            for row, value in values:
                array[row] = value  # as _add_info assigns it
            columns.append((key, kind, mask, (python_type, dtype.char, shape, array.tobytes())))
        elif kind == "o":  # an object array stores each value as it is, a sequence too
            columns.append((key, kind, mask, tuple(value for _, value in values)))
        else:
            columns.append((key, kind, mask, _columns(values, size)))
    return tuple(columns)


def pack_infos(
    records: Sequence[InfoRecord] | BatchedInfoLog, num_envs: int, min_envs: int = PACK_MIN_ENVS
) -> InfoPayload:
    """A worker slice's infos for the wire: in columns if uniform (and ``min_envs`` or more), else the records."""
    if num_envs < min_envs:
        return list(records)
    if isinstance(records, BatchedInfoLog):
        columns = records.columns(num_envs)
        if columns is not None:
            return num_envs, columns
    try:
        return num_envs, _columns(list(records), num_envs)
    except (_NotUniform, ValueError, TypeError, OverflowError):  # e.g. an int too large for int64
        return list(records)


def split_infos(infos: Any, num_envs: int) -> list[dict[str, Any]]:
    """A vector env's batched infos, one dict per env.

    Gymnasium's dict of arrays is split as ``DictInfoToList`` splits it: a key's value goes to
    the envs its ``_key`` mask marks, or to every env without a mask (EnvPool's infos have
    none); nested dicts are split the same way. A list or tuple of dicts (SuperSuit's and
    Stable-Baselines3's form) is already one dict per env.
    """
    if isinstance(infos, (list, tuple)):
        if len(infos) != num_envs:
            raise ValueError(f"A vector env of {num_envs} envs returned infos for {len(infos)} envs.")
        return [dict(info) for info in infos]
    if not isinstance(infos, Mapping):
        raise TypeError(f"A vector env's infos must be a dict (or a list of dicts), got {type(infos).__name__}.")
    per_env: list[dict[str, Any]] = [{} for _ in range(num_envs)]
    for key, value in infos.items():
        if isinstance(key, str) and key.startswith("_"):
            continue
        mask = infos.get(f"_{key}")
        values = split_infos(value, num_envs) if isinstance(value, Mapping) else value
        if len(values) != num_envs:
            raise ValueError(f"A vector env of {num_envs} envs returned info {key!r} with {len(values)} values.")
        for i in range(num_envs):
            if mask is None or mask[i]:
                per_env[i][key] = values[i]
    return per_env


class BatchedInfoLog:
    """A worker's info records, kept as the batched infos of its vector envs (units) until they are read.

    Splitting a unit's infos into per-env records and packing those back into columns costs
    Python work per env and key (1 ms per step for 128 EnvPool envs): where one unit's
    Gymnasium infos cover the worker's slice, :meth:`columns` packs them into the very columns
    :func:`pack_infos` would build from the records, array by array. Anything else is read as
    the records :func:`split_infos` gives, through iteration.
    """

    def __init__(self) -> None:
        self.batches: list[tuple[int, int, Any]] = []  # (first row, rows, the unit's batched infos)
        self._records: list[InfoRecord] | None = None
        self._packed: tuple[Column, ...] | None = None  # one unit's columns, once packed

    def add(self, offset: int, size: int, infos: Any) -> None:
        """Record the infos of a unit of ``size`` envs at rows ``offset`` onwards."""
        if isinstance(infos, Mapping) and not infos:
            return
        self.batches.append((offset, size, infos))
        self._records = self._packed = None

    def __iter__(self) -> Iterator[InfoRecord]:
        if self._records is None:
            self._records = [
                (offset + i, info)
                for offset, size, infos in self.batches
                for i, info in enumerate(split_infos(infos, size))
                if info
            ]
        return iter(self._records)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __bool__(self) -> bool:
        """Whether any env has an info (as its record would say), without splitting a unit that packs."""
        if not self.batches:
            return False
        packed = self._pack()
        return bool(packed) if packed is not None else any(True for _ in self)

    def columns(self, num_envs: int) -> tuple[Column, ...] | None:
        """The packed columns of one unit's Gymnasium infos of numbers covering every row; else ``None``."""
        if len(self.batches) != 1 or self.batches[0][:2] != (0, num_envs):
            return None
        return self._pack()

    def _pack(self) -> tuple[Column, ...] | None:
        if self._packed is None and len(self.batches) == 1 and isinstance(self.batches[0][2], Mapping):
            _, size, infos = self.batches[0]
            try:
                found = _unit_columns(infos, size, np.ones(size, dtype=np.bool_))
            except (_NotUniform, ValueError, TypeError):
                return None
            self._packed = tuple(column for *_, column in sorted(found, key=lambda entry: entry[:2]))
        return self._packed


def _unit_columns(infos: Mapping[str, Any], size: int, within: np.ndarray) -> list[tuple[int, int, Column]]:
    """Each key's column, with the first row that has it and the key's place: records list keys in that order."""
    found: list[tuple[int, int, Column]] = []
    for position, (key, value) in enumerate(infos.items()):
        if type(key) is not str or key == "final_obs":
            raise _NotUniform
        if key.startswith("_"):
            continue
        mask = infos.get(f"_{key}")
        if mask is None:
            present = within
        else:
            mask = np.asarray(mask)
            if mask.dtype != np.bool_ or mask.shape != (size,):
                raise _NotUniform
            present = within & mask
        if not present.any():
            continue
        rows = b"" if present.all() else present.tobytes()
        if isinstance(value, Mapping):
            nested = _unit_columns(value, size, present)
            column: Column = (key, "d", rows, tuple(c for *_, c in sorted(nested, key=lambda entry: entry[:2])))
        else:
            if (
                type(value) is not np.ndarray
                or value.dtype.kind not in "iufc"
                or not _packable_dtype(value.dtype)
                or not value.flags.c_contiguous
                or value.ndim < 1
                or len(value) != size
            ):
                raise _NotUniform
            array = value if present.all() else np.where(present.reshape(-1, *[1] * (value.ndim - 1)), value, 0)
            python_type = "numpy" if value.ndim == 1 else "ndarray"
            data = (python_type, value.dtype.char, value.shape[1:], array.astype(value.dtype, copy=False).tobytes())
            column = (key, "n", rows, data)
        found.append((int(np.argmax(present)), position, column))
    return found


# -- placing (learner side) -----------------------------------------------------------------


def _rows(mask: bytes, size: int) -> np.ndarray | slice:
    return slice(0, size) if not mask else np.flatnonzero(np.frombuffer(mask, dtype=np.bool_))


@functools.lru_cache(maxsize=64)
def _dtype(char: str) -> np.dtype:
    return np.dtype(char)


def _values(data: Any, size: int) -> np.ndarray:
    _, char, shape, raw = data
    values = np.frombuffer(raw, dtype=_dtype(char))
    return values.reshape(size, *shape) if shape else values


def _fits(infos: dict[str, Any], columns: tuple[Column, ...], num_envs: int, size: int) -> bool:
    """Whether placing ``columns`` into ``infos`` gives what replaying their envs would."""
    for key, kind, _, data in columns:
        mask = infos.get(f"_{key}")
        if mask is not None and not (type(mask) is np.ndarray and mask.dtype == np.bool_ and mask.shape == (num_envs,)):
            return False
        if key not in infos:
            continue
        existing = infos[key]
        if kind == "d":
            if not isinstance(existing, dict) or not _fits(existing, data, num_envs, size):
                return False
        elif type(existing) is not np.ndarray:
            return False
        elif kind == "o":
            if existing.dtype != object or existing.shape != (num_envs,):
                return False
        elif existing.dtype != _dtype(data[1]) or existing.shape[1:] != data[2] or len(existing) != num_envs:
            return False
    return True


def _place(infos: dict[str, Any], columns: tuple[Column, ...], num_envs: int, offset: int, size: int) -> None:
    for key, kind, rows_mask, data in columns:
        rows = _rows(rows_mask, size)
        if kind == "d":
            array: Any = infos.get(key, {})
            _place(array, data, num_envs, offset, size)
        elif kind == "o":
            array = infos.get(key)
            if array is None:
                array = np.full(num_envs, fill_value=None, dtype=object)
            indices = range(offset, offset + size) if isinstance(rows, slice) else (offset + rows).tolist()
            for index, value in zip(indices, data, strict=True):
                array[index] = value
        else:
            values = _values(data, size)
            array = infos.get(key)
            if array is None:
                array = np.zeros((num_envs, *values.shape[1:]), dtype=values.dtype)
            if isinstance(rows, slice):
                array[offset : offset + size] = values
            else:
                array[offset + rows] = values[rows]
        mask = infos.get(f"_{key}")
        if mask is None:
            mask = np.zeros(num_envs, dtype=np.bool_)
        if isinstance(rows, slice):
            mask[offset : offset + size] = True
        else:
            mask[offset + rows] = True
        infos[key], infos[f"_{key}"] = array, mask


def _unpack(columns: tuple[Column, ...], size: int) -> list[dict[str, Any]]:
    infos: list[dict[str, Any]] = [{} for _ in range(size)]
    for key, kind, rows_mask, data in columns:
        rows = _rows(rows_mask, size)
        row_list = list(range(size)) if isinstance(rows, slice) else rows.tolist()
        if kind == "o":
            values: Iterable[Any] = data
        elif kind == "d":
            nested = _unpack(data, size)
            values = [nested[row] for row in row_list]
        else:
            array, python_type = _values(data, size), data[0]
            if python_type in PYTHON_NUMBERS:
                values = [PYTHON_NUMBERS[python_type](array[row]) for row in row_list]
            elif python_type == "numpy":
                values = [array[row] for row in row_list]
            else:
                values = [np.array(array[row]) for row in row_list]
        for row, value in zip(row_list, values, strict=True):
            infos[row][key] = value
    return infos


def records_of(payload: InfoPayload) -> list[InfoRecord]:
    """The per-env records a payload stands for (a packed uniform slice gives its values back exactly)."""
    if isinstance(payload, list):
        return payload
    size, columns = payload
    return [(row, info) for row, info in enumerate(_unpack(columns, size)) if info]


def merge_infos(infos: dict[str, Any], payload: InfoPayload, num_envs: int, offset: int) -> dict[str, Any]:
    """Add a worker slice's infos (envs ``offset`` onwards) to the batch ``infos``, as ``SyncVectorEnv`` would have.

    A packed slice whose columns fit the batch is placed column by column; anything else is
    replayed env by env through Gymnasium's own ``_add_info``.
    """
    if isinstance(payload, list):
        return replay_infos(infos, payload, num_envs, offset)
    size, columns = payload
    if not _fits(infos, columns, num_envs, size):
        return replay_infos(infos, records_of(payload), num_envs, offset)
    _place(infos, columns, num_envs, offset, size)
    return infos
