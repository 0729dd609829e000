"""The shared step region: what a plain step moves, in memory the learner shares with its local workers.

A step of cheap envs moves a few hundred bytes, and on the message path each worker's
reply cost the learner more CPU than the envs' own step (framing, MACs, parsing). For the
workers the learner starts on its own host, one nameless shared file holds,
batched over all envs, every field a plain step moves, and one header per worker::

    [ token | worker 0 header | worker 1 header | ... | actions leaves | observation leaves
      | previous observation leaves | rewards | terminations | truncations
      | infos (INFO_BYTES per env) ]

    header (two cache lines, each written by one side only):
        command (the learner's):  [counter, call, messages, learner waits]
        reply (the worker's):     [counter, status, worker waits]

**Sequence words are the truth; wake-up bytes are hints.** A command is the worker's
actions written into its rows, then its header's ``call`` (the learner's call number, which
the worker echoes in any message it sends about this step) and a fresh ``counter`` (one more
than the last, never reused). A reply is the observations, rewards and flags written into
the worker's rows, then the reply ``counter`` (the command's) and a final ``status``. Each
side waits for the other's counter by reading it: for a short while in a loop (a *spin*),
then by blocking after raising its *waits* word (the learner on its wake socket, a worker on
its pipe). The other side writes a wake-up only when it sees that word raised (both sides fence between their store and
their load, so that one of them always sees the other's), and a waiter that wakes reads the
words again: a byte that finds nothing new is ignored. So a wake-up lost to an interrupted
read, or one left over from a race, can neither hang a step nor answer one.

A worker that begins a step copies its observation rows to its *previous* rows, then sets
the reply status :data:`STEPPING` with the command's counter: should it die before its reply
is final, the learner takes the observations it last received from there (the envs may have
written the next ones into the batch already).

When the step produced something the region has no place for (infos, a usage report), or
raised, the worker sends that reply as a message on its pipe first (naming the counter, or
an ERROR as on the message path), then sets the status that says so (:data:`MESSAGE`). The
learner bumps ``messages`` after each message it sends to a worker on the path, so that a
spinning worker turns to its pipe without a wake-up.

Infos that every env reports at every step, as numbers or numeric arrays under the same
keys (MuJoCo's ``x_position``, Atari's ``lives`` and ``ram``), in nested dicts too (EnvPool's
``players``), go in the region too, in a layout learned from the first steps: a worker
names the layout in a message that carries such infos, and its later steps whose infos fit
it write them into its info rows (status ``INFOS``) instead of sending a message. The
learner reads back the very columns the message would have carried
(:mod:`clusterenv.wire.infos`), so both paths merge them alike. Anything else (a new key,
another type, a key some envs lack, a ``final_obs``) is a message. A layout of scalars only
(MuJoCo's, Atari's) is also a record type over the rows (:class:`ScalarInfos`): each env's
values go straight into its row, and when every worker wrote the same one the batch's arrays
come straight out, one copy per key.

Observations are the learner's batch itself: the worker's envs write them in place. Nothing
in the region is ever unpickled; its layout follows from the spaces alone, and a worker maps
it only if its own spaces give the same layout. The file has no name: it is passed over the
wake socket (``SCM_RIGHTS``), so nothing is left behind by a learner that is killed. It is a memfd sealed
against resizing, so that no worker can truncate it under the learner's mapping (which would
kill the learner with ``SIGBUS``), or where there is no memfd an unlinked file
(:mod:`clusterenv.wire.region_file`).
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import platform
import secrets
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium import spaces

from clusterenv.wire.infos import PYTHON_NUMBERS, Column, InfoPayload, InfoRecord, PackedInfos
from clusterenv.wire.leaves import is_array_tree, leaf_specs, unflatten
from clusterenv.wire.messages import StepRegionMeta
from clusterenv.wire.region_file import open_region_file

__all__ = [
    "DONE",
    "FINAL",
    "INFOS",
    "INFO_BYTES",
    "NESTED",
    "ORDERED_MEMORY",
    "MESSAGE",
    "STEPPING",
    "COUNTER",
    "CALL",
    "MESSAGES",
    "LEARNER_WAITS",
    "STATUS",
    "WORKER_WAITS",
    "InfoKey",
    "InfoLayout",
    "ScalarInfos",
    "fence",
    "check_layout",
    "fits",
    "info_layout",
    "read_infos",
    "scalar_infos",
    "write_infos",
    "StepRegion",
    "WorkerRows",
    "attach_rows",
    "region_layout",
]

#: Whether this CPU keeps each core's stores, and its loads, in program order (x86's total store
#: order), which the words rely on: a worker writes its rows, then its status; STEPPING, then its
#: counter; the learner reads the counter, then the status, then the rows, with no barrier between
#: (the one barrier, :func:`fence`, orders a store before a later load). Where the CPU may reorder
#: them (ARM: Apple silicon, Graviton), the learner could take an earlier step's results for this
#: one, so every worker keeps the message path there.
ORDERED_MEMORY = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")

#: Reply status: the results are in the worker's rows.
DONE = 1
#: Reply status: the worker's reply is a message, sent before this status: the results are in its
#: rows and the message has the rest (infos, a usage report), or the step raised and it is an ERROR.
MESSAGE = 2
#: Reply status: the results are in the worker's rows, and its infos in its info rows, in the layout
#: its last message named.
INFOS = 3
#: Reply status: the worker began the step (its previous observations are saved); no reply yet.
STEPPING = 4
#: The statuses that end a step.
FINAL = frozenset((DONE, MESSAGE, INFOS))

#: Words of a header's command line (the learner writes them): the step's counter, its call number,
#: how many messages the learner sent since the worker joined the path, and whether the learner
#: waits blocked for this worker's reply (then the worker writes a wake-up byte).
COUNTER, CALL, MESSAGES, LEARNER_WAITS = 0, 1, 2, 3
#: Words of a header's reply line (the worker writes them), after its ``COUNTER``: the reply's
#: status, and whether the worker waits blocked for its next command.
STATUS, WORKER_WAITS = 1, 2

#: Bytes of infos per env the region holds: numbers and numeric arrays that every env reports at every
#: step (MuJoCo's ``x_position``, Atari's ``lives`` and 128 bytes of ``ram``), each key from an 8-byte
#: boundary. Infos that need more travel as messages.
INFO_BYTES = 256
_INFO_ALIGN = 8
#: A layout's python type of a nested dict.
NESTED = "dict"
#: One key of a layout, as ``pack_infos`` packs it: ``(key, python type, dtype char, shape)`` for
#: numbers and numeric arrays, ``(key, NESTED, layout)`` for a dict of such keys.
InfoKey = tuple[str, str, str, tuple[int, ...]] | tuple[str, str, "InfoLayout"]
#: The keys of a slice's infos in the order their columns come, as the info rows hold them.
InfoLayout = tuple[InfoKey, ...]

_ALIGN = 64
_TOKEN_BYTES = 16
_SCALAR_TYPES = ("int", "float", "bool", "numpy")
_NUMBER_TYPES = (*_SCALAR_TYPES, "ndarray")
_HEADER_BYTES = 2 * _ALIGN  # the command's cache line and the reply's: each side writes its own

#: One field of the region: ``(name, offset, dtype, batched shape)``.
Field = tuple[str, int, np.dtype, tuple[int, ...]]


def region_layout(
    observation_space: spaces.Space, action_space: spaces.Space, num_envs: int, num_workers: int
) -> tuple[list[Field], int]:
    """Every field of the region, each on its own cache lines after the headers, and the region's size."""
    fields: list[Field] = []
    offset = _ALIGN + num_workers * _HEADER_BYTES

    def add(name: str, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        nonlocal offset
        batched = (num_envs, *shape)
        fields.append((name, offset, np.dtype(dtype), batched))
        offset += -(-max(1, math.prod(batched) * np.dtype(dtype).itemsize) // _ALIGN) * _ALIGN

    for i, (dtype, shape, _) in enumerate(leaf_specs(action_space)):
        add(f"action{i}", dtype, shape)
    for i, (dtype, shape, _) in enumerate(leaf_specs(observation_space)):
        add(f"obs{i}", dtype, shape)
    for i, (dtype, shape, _) in enumerate(leaf_specs(observation_space)):
        add(f"previous{i}", dtype, shape)
    add("rewards", np.dtype(np.float64), ())
    add("terminations", np.dtype(np.bool_), ())
    add("truncations", np.dtype(np.bool_), ())
    add("infos", np.dtype(np.uint8), (INFO_BYTES,))
    return fields, offset


def fits(observation_space: spaces.Space, action_space: spaces.Space) -> bool:
    """Whether both spaces have a fixed array form (Box, Discrete, MultiDiscrete, MultiBinary, Dict/Tuple of them)."""
    return is_array_tree(observation_space) and is_array_tree(action_space)


@dataclass
class WorkerRows:
    """One worker's view of the region: its header words and its rows of every field.

    Attributes:
        command: ``[counter, call, messages, learner waits]`` (the learner writes them).
        reply: ``[counter, status, worker waits]`` (the worker writes them).
        actions, observations: leaf arrays of the worker's rows.
        previous: leaf arrays of the observations the worker had when its step in flight began.
        rewards, terminations, truncations: the worker's rows.
        infos: the worker's info rows: ``INFO_BYTES`` per env (raw, in the layout the worker named).
    """

    command: memoryview
    reply: memoryview
    actions: list[np.ndarray]
    observations: list[np.ndarray]
    previous: list[np.ndarray]
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    infos: np.ndarray

    def clear(self) -> None:
        """Zero the headers (a replacement starts from a cleared slot)."""
        for words in (self.command, self.reply):
            for i in range(len(words)):
                words[i] = 0

    def began(self, counter: int) -> bool:
        """Whether the worker began step ``counter`` (its observation rows may hold that step's, not the last)."""
        return int(self.reply[COUNTER]) == counter

    def restore_observations(self) -> None:
        """Put back the observations the worker saved when it began its step (it was lost before replying)."""
        for rows, saved in zip(self.observations, self.previous, strict=True):
            rows[...] = saved

    def save_observations(self) -> None:
        """Keep the current observations before the envs overwrite them (the worker, as a step begins)."""
        for rows, saved in zip(self.observations, self.previous, strict=True):
            saved[...] = rows


_FENCE = threading.Lock()


def fence() -> None:
    """A full memory barrier: a locked instruction, as acquiring an uncontended lock is.

    Between raising a *waits* word and reading the other side's counter (and between writing
    a counter and reading the other side's *waits* word), so that a store is never passed by
    a later load: without it, each side could miss the other's store and both would wait.
    Never blocks: a lock left held (an interrupt between acquiring and releasing it) would
    otherwise hang every later fence; trying to acquire it is the same locked instruction.
    """
    if _FENCE.acquire(False):
        _FENCE.release()


def _batch(buffer: Any, fields: list[Field]) -> dict[str, np.ndarray]:
    """Every field of the region, batched over all envs."""
    return {name: np.ndarray(shape, dtype, buffer=buffer, offset=offset) for name, offset, dtype, shape in fields}


def _rows(buffer: Any, batch: dict[str, np.ndarray], worker: int, rows: slice) -> WorkerRows:
    """Worker ``worker``'s header and its ``rows`` of the ``batch`` (views of the batch's own arrays)."""
    header = _ALIGN + worker * _HEADER_BYTES
    # Header words as a memoryview of unsigned 64-bit integers: reading one costs a fraction of a numpy
    # scalar's, which matters in a spin. Aligned 8-byte stores and loads are atomic on every 64-bit CPU.
    words = memoryview(buffer)[header : header + _HEADER_BYTES].cast("Q")
    per_line = _ALIGN // 8
    return WorkerRows(
        command=words[:4],
        reply=words[per_line : per_line + 3],
        actions=[view[rows] for name, view in batch.items() if name.startswith("action")],
        observations=[view[rows] for name, view in batch.items() if name.startswith("obs")],
        previous=[view[rows] for name, view in batch.items() if name.startswith("previous")],
        rewards=batch["rewards"][rows],
        terminations=batch["terminations"][rows],
        truncations=batch["truncations"][rows],
        infos=batch["infos"][rows],
    )


class StepRegion:
    """The learner's side: the region of all envs, its batch of observations, and each worker's rows.

    Args:
        observation_space, action_space: one env's spaces (both with a fixed array form).
        slices: the envs of each worker.

    Raises:
        OSError: no file for the region can be made here (see :func:`~clusterenv.wire.region_file.open_region_file`).
    """

    def __init__(self, observation_space: spaces.Space, action_space: spaces.Space, slices: list[slice]) -> None:
        if not fits(observation_space, action_space):
            raise TypeError("The step region needs observation and action spaces with a fixed array form.")
        self.observation_space = observation_space
        self.action_space = action_space
        self.slices = slices
        self.num_envs = slices[-1].stop
        self._fields, self.size = region_layout(observation_space, action_space, self.num_envs, len(slices))
        file = open_region_file(self.size)  # OSError: none can be made here (the caller keeps messages)
        self.fd = file.fd
        #: Whether no holder of the file can resize it (a sealed memfd; see ``wire.region_file``).
        self.sealed = file.sealed
        self._close_fd = weakref.finalize(self, os.close, self.fd)  # also if the pool never closes it
        # The views keep the mapping alive as long as any array (a user's copy=False batch) refers to it.
        self._buffer = mmap.mmap(self.fd, self.size)
        self.token = secrets.token_bytes(_TOKEN_BYTES)
        self._buffer[:_TOKEN_BYTES] = self.token
        batch = _batch(self._buffer, self._fields)
        #: Each worker's header and rows: views of the batch's arrays below.
        self.workers = [_rows(self._buffer, batch, w, sl) for w, sl in enumerate(slices)]
        #: The batch of actions, as leaf arrays.
        self.actions = [view for name, view in batch.items() if name.startswith("action")]
        #: The batch of observations, in the region: the learner's batch buffer.
        self.observations = unflatten(observation_space, [v for n, v in batch.items() if n.startswith("obs")])
        #: The batch's rewards, terminations and truncations, in the region.
        self.step_fields = (batch["rewards"], batch["terminations"], batch["truncations"])
        #: The batch's info rows (``INFO_BYTES`` per env), in the region.
        self.infos = batch["infos"]

    def meta(self, worker_id: int, spin_us: float | None) -> StepRegionMeta:
        """What worker ``worker_id`` needs to map its rows (the file itself travels on its wake socket).

        ``spin_us``: how the worker waits for its next command (:class:`~clusterenv.wire.waiting.SpinBudget`).
        """
        sl = self.slices[worker_id]
        return StepRegionMeta(
            token=self.token.hex(),
            size=self.size,
            fields=[[name, offset, dtype.str, list(shape)] for name, offset, dtype, shape in self._fields],
            worker=worker_id,
            workers=len(self.slices),
            start=sl.start,
            stop=sl.stop,
            spin_us=spin_us,
        )

    def close(self) -> None:
        """Close the file; the mapping lives on while views of it do."""
        self._close_fd()
        self.fd = -1


def attach_rows(
    fd: int, meta: Mapping[str, Any], observation_space: spaces.Space, action_space: spaces.Space
) -> WorkerRows | None:
    """The worker's side: map the region in ``fd`` and return its rows, or ``None`` if the layout is not its own.

    The layout must be the one this worker's own spaces give, and the rows inside the region:
    a worker never writes outside of what the learner reads.
    """
    try:
        if not fits(observation_space, action_space) or os.fstat(fd).st_size != meta["size"]:
            return None
        start, stop, worker, workers = (int(meta[k]) for k in ("start", "stop", "worker", "workers"))
        fields = [(str(n), int(o), np.dtype(d), tuple(int(x) for x in s)) for n, o, d, s in meta["fields"]]
        num_envs = fields[0][3][0]
        if (fields, int(meta["size"])) != region_layout(observation_space, action_space, num_envs, workers):
            return None
        if not (0 <= worker < workers and 0 <= start < stop <= num_envs):
            return None
        buffer = mmap.mmap(fd, int(meta["size"]))
    finally:
        os.close(fd)
    if buffer[:_TOKEN_BYTES] != bytes.fromhex(meta["token"]):
        return None
    return _rows(buffer, _batch(buffer, fields), worker, slice(start, stop))


def info_layout(payload: InfoPayload) -> InfoLayout | None:
    """The layout that puts a slice's packed infos in the region, or ``None`` if they do not fit one.

    They fit when every env of the slice reports the same keys, at every level of nesting,
    each a number (a Python ``int``/``float``/``bool`` or a numpy scalar), a numeric array of
    one dtype and shape, or a dict of such keys (EnvPool's ``players``), and their values take
    ``INFO_BYTES`` or fewer per env.
    """
    if isinstance(payload, list):
        return None
    layout = _layout_of(payload[1])
    return layout if layout is not None and _row_bytes(layout) <= INFO_BYTES else None


def _layout_of(columns: tuple[Column, ...]) -> InfoLayout | None:
    layout: list[InfoKey] = []
    for key, kind, rows, data in columns:
        if rows:  # not every env has the key: its mask would have to travel too
            return None
        if kind == "d":
            nested = _layout_of(data)
            if nested is None:
                return None
            layout.append((key, NESTED, nested))
        elif kind == "n" and data[0] in _NUMBER_TYPES:
            layout.append((key, data[0], data[1], data[2]))
        else:
            return None
    return tuple(layout)


def check_layout(layout: Any) -> InfoLayout:
    """A layout a worker named, checked (``ValueError`` unless it is one :func:`info_layout` could give)."""
    try:
        checked = _checked(layout)
        ok = _row_bytes(checked) <= INFO_BYTES
    except (TypeError, ValueError, RecursionError):
        ok = False
    if not ok:
        raise ValueError(f"Not an info layout: {layout!r}.")
    return checked


def _checked(layout: Any) -> InfoLayout:
    if not isinstance(layout, (list, tuple)):
        raise TypeError("a layout is a sequence of keys")
    checked: list[InfoKey] = []
    for entry in layout:
        if not isinstance(entry, (list, tuple)) or len(entry) < 3:
            raise TypeError("a layout's key is a sequence of 3 or 4 fields")
        key, python_type = str(entry[0]), str(entry[1])
        if python_type == NESTED and len(entry) == 3:
            checked.append((key, NESTED, _checked(entry[2])))
            continue
        if len(entry) != 4:
            raise ValueError("a number's key has 4 fields")
        char, shape = str(entry[2]), tuple(int(n) for n in entry[3])
        scalar = python_type in _SCALAR_TYPES and shape == ()
        if not (scalar or python_type == "ndarray") or np.dtype(char).kind not in "biufc" or min(shape, default=0) < 0:
            raise ValueError("not a number nor a numeric array")
        checked.append((key, python_type, char, shape))
    return tuple(checked)


@functools.lru_cache(maxsize=256)
def _width(char: str, shape: tuple[int, ...]) -> int:
    """Bytes per env of a key's values."""
    return np.dtype(char).itemsize * math.prod(shape)


def _slot(width: int) -> int:
    """Bytes per env that a key of ``width`` bytes takes in the info rows (each key starts 8-byte aligned)."""
    return -(-width // _INFO_ALIGN) * _INFO_ALIGN


def _row_bytes(layout: InfoLayout) -> int:
    return sum(_row_bytes(entry[2]) if len(entry) == 3 else _slot(_width(entry[2], entry[3])) for entry in layout)


def write_infos(rows: np.ndarray, payload: PackedInfos) -> None:
    """Write a slice's packed infos (that :func:`info_layout` fits) into its info ``rows``."""
    _write(rows, payload[1], 0)


def _write(rows: np.ndarray, columns: tuple[Column, ...], start: int) -> int:
    for _, kind, _, data in columns:
        if kind == "d":
            start = _write(rows, data, start)
            continue
        width = _width(data[1], data[2])
        rows[:, start : start + width] = np.frombuffer(data[3], dtype=np.uint8).reshape(len(rows), width)
        start += _slot(width)
    return start


def read_infos(rows: np.ndarray, layout: InfoLayout) -> PackedInfos:
    """The packed infos that info ``rows`` hold in ``layout``: what the worker's message would have carried."""
    return len(rows), _read(rows, layout, 0)[0]


def _read(rows: np.ndarray, layout: InfoLayout, start: int) -> tuple[tuple[Column, ...], int]:
    columns: list[Column] = []
    for entry in layout:
        if len(entry) == 3:
            nested, start = _read(rows, entry[2], start)
            columns.append((entry[0], "d", b"", nested))
            continue
        key, python_type, char, shape = entry
        width = _width(char, shape)
        columns.append((key, "n", b"", (python_type, char, shape, rows[:, start : start + width].tobytes())))
        start += _slot(width)
    return tuple(columns), start


@dataclass(frozen=True)
class ScalarInfos:
    """A layout of scalars only, at the top level (MuJoCo's and Atari's infos), as typed fields of the info rows.

    Each env's values then go straight into its row, and the batch's arrays come straight out
    of the rows: no columns of bytes in between (:func:`write_infos`, :func:`read_infos`), which
    cost more than the envs' own infos on a step of cheap envs.

    Attributes:
        keys: the layout's keys, in order.
        types: the exact type of each key's values (what ``pack_infos`` batches into this layout).
        dtype: one info row (``INFO_BYTES``) as a record of the keys, each where :func:`write_infos` puts it.
    """

    keys: tuple[str, ...]
    types: tuple[type, ...]
    dtype: np.dtype

    def rows(self, infos: np.ndarray) -> np.ndarray:
        """Info rows (``n`` rows of ``INFO_BYTES``) as ``n`` records of the keys: a view."""
        return infos.view(self.dtype).reshape(len(infos))

    def write(self, rows: np.ndarray, records: Sequence[InfoRecord]) -> bool:
        """Write a step's info ``records`` into ``rows`` (of :meth:`rows`) if they are this layout's; else ``False``.

        They are when every env, in order, reported exactly the keys, in their order, each
        value of its type: the infos that ``pack_infos`` would pack into this very layout.
        A value that its dtype cannot hold (an ``int`` past int64) is not written either.
        """
        if len(records) != len(rows):
            return False
        keys, types = self.keys, self.types
        values = []
        for expected, (row, info) in enumerate(records):
            if row != expected or tuple(info) != keys:
                return False
            row_values = tuple(info.values())
            if tuple(map(type, row_values)) != types:
                return False
            values.append(row_values)
        try:
            rows[:] = values
        except (OverflowError, ValueError, TypeError):
            return False
        return True

    def batch(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """The batch's infos from ``rows`` where every env reported every key, as ``SyncVectorEnv`` builds them."""
        infos: dict[str, np.ndarray] = {}
        for key in self.keys:
            infos[key] = rows[key].copy()
            infos[f"_{key}"] = np.ones(len(rows), dtype=np.bool_)
        return infos


def scalar_infos(layout: InfoLayout) -> ScalarInfos | None:
    """``layout`` as :class:`ScalarInfos` if its keys are all scalars at the top level; else ``None``."""
    keys: list[str] = []
    types: list[type] = []
    formats: list[np.dtype] = []
    offsets: list[int] = []
    start = 0
    for entry in layout:
        if len(entry) == 3 or entry[1] not in _SCALAR_TYPES or entry[3] != ():
            return None
        key, python_type, char, _ = entry
        dtype = np.dtype(char)
        keys.append(key)
        types.append(PYTHON_NUMBERS.get(python_type, dtype.type))  # ``numpy``: the dtype's own scalar type
        formats.append(dtype)
        offsets.append(start)
        start += _slot(_width(char, ()))
    try:
        record = np.dtype({"names": keys, "formats": formats, "offsets": offsets, "itemsize": INFO_BYTES})
    except (ValueError, TypeError):  # a key numpy cannot name a field (an empty one)
        return None
    return ScalarInfos(tuple(keys), tuple(types), record)
