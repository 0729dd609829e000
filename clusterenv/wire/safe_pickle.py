"""Unpickling what workers send, without letting a worker run code in the learner.

A pickle names the callables that rebuild it (``find_class``), and unpickling calls
them: a worker could make the learner run anything. Workers the learner started itself
(:class:`~clusterenv.launch.launchers.LocalLauncher`) run the learner's own code on this host, so
their replies are loaded with plain :func:`pickle.loads`. For any other worker
(``launcher="external"``, Ray, a custom launcher), :func:`loader` returns a restricted
unpickler that rebuilds only data:

* builtin containers and scalars (``dict``, ``list``, ``tuple``, ``set``, ``complex``, ...)
  and builtin exception classes (``ValueError``, ``KeyError``, ...);
* numpy arrays, dtypes, scalars and random generators (what numpy's own pickles name);
* gymnasium spaces, ``EnvSpec`` and gymnasium's and clusterenv's exception classes;
* the classes the user names in ``ClusterEnv(..., trusted_classes=...)``.

Anything else raises :class:`UntrustedPickleError`, naming the class and the option.
The allow-list is checked before a module is imported: importing is running code too.

    >>> import numpy as np
    >>> loads = loader((), restricted=True)
    >>> loads(pickle.dumps({"x": np.arange(3)}))["x"].tolist()
    [0, 1, 2]
    >>> try:
    ...     loads(pickle.dumps(eval))
    ... except UntrustedPickleError as error:
    ...     print(str(error)[:64])
    A worker sent a pickle that references `builtins.eval`, which th
"""

from __future__ import annotations

import builtins
import functools
import importlib
import io
import pickle
from collections.abc import Callable, Iterable
from typing import Any

from clusterenv.errors import UntrustedPickleError

__all__ = ["loader"]

_BUILTIN_TYPES = frozenset(
    {"bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int", "list", "object"}
    | {"range", "set", "slice", "str", "tuple"}
)
# Functions and classes named by numpy's own pickles (numpy 1.x ``numpy.core``, 2.x ``numpy._core``).
_NUMPY = frozenset(
    {
        ("numpy", "dtype"),
        ("numpy", "ndarray"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy.random._pickle", "__generator_ctor"),
        ("numpy.random._pickle", "__bit_generator_ctor"),
        ("numpy.random._pickle", "__randomstate_ctor"),
        ("numpy.random._generator", "Generator"),
        ("numpy.random.mtrand", "RandomState"),
        ("numpy.random._pcg64", "PCG64"),
        ("numpy.random._pcg64", "PCG64DXSM"),
        ("numpy.random._mt19937", "MT19937"),
        ("numpy.random._philox", "Philox"),
        ("numpy.random._sfc64", "SFC64"),
        ("numpy.random.bit_generator", "SeedSequence"),
        ("numpy.random.bit_generator", "__pyx_unpickle_SeedSequence"),
    }
)
_DATA_CLASSES = frozenset(
    {
        ("collections", "OrderedDict"),
        ("collections", "defaultdict"),
        ("collections", "deque"),
        ("collections", "Counter"),
        ("gymnasium.envs.registration", "EnvSpec"),
        ("gymnasium.envs.registration", "WrapperSpec"),
    }
)
# Modules whose exception classes (and nothing else) may be rebuilt.
_EXCEPTION_MODULES = frozenset({"gymnasium.error", "clusterenv.errors"})


def _trusted_names(trusted: Iterable[type | str]) -> frozenset[tuple[str, str]]:
    names = set()
    for entry in trusted:
        if isinstance(entry, str):
            module, _, name = entry.rpartition(".")
            if not module or not name:
                raise ValueError(f"`trusted_classes` entries must be classes or 'module.Name' strings, got {entry!r}.")
        elif isinstance(entry, type):
            module, name = entry.__module__, entry.__qualname__
        else:
            raise TypeError(
                f"`trusted_classes` entries must be classes or 'module.Name' strings, got {type(entry).__name__}."
            )
        names.add((module, name))
    return frozenset(names)


def _attribute(module: str, name: str) -> Any:
    value: Any = importlib.import_module(module)
    for part in name.split("."):
        value = getattr(value, part)
    return value


def _is_class(value: Any, base: type) -> bool:
    return isinstance(value, type) and issubclass(value, base)


@functools.lru_cache(maxsize=512)
def _allowed(module: str, name: str, trusted: frozenset[tuple[str, str]]) -> Any:
    """The object ``module.name`` if the allow-list admits it, else ``None`` (cached: find_class runs per global)."""
    if (module, name) in trusted or (module, name) in _NUMPY or (module, name) in _DATA_CLASSES:
        return _attribute(module, name)
    if module == "builtins":
        value = getattr(builtins, name, None)
        return value if name in _BUILTIN_TYPES or _is_class(value, BaseException) else None
    if module == "numpy":
        import numpy as np

        value = getattr(np, name, None)
        return value if _is_class(value, np.generic) else None  # scalar types: np.float32, np.int64, ...
    if module.startswith("gymnasium.spaces.") and "." not in name:
        from gymnasium.spaces import Space

        value = getattr(importlib.import_module(module), name, None)
        return value if _is_class(value, Space) else None
    if module in _EXCEPTION_MODULES and "." not in name:
        value = getattr(importlib.import_module(module), name, None)
        return value if _is_class(value, BaseException) else None
    return None


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, trusted: frozenset[tuple[str, str]]) -> None:
        super().__init__(io.BytesIO(data))
        self._trusted = trusted

    def find_class(self, module: str, name: str) -> Any:
        value = _allowed(module, name, self._trusted)
        if value is None and module.split(".")[0] == "cloudpickle":
            raise UntrustedPickleError(
                f"A worker sent a pickle that rebuilds a class or function by value (`{module}.{name}`): one "
                "defined in `__main__` or a notebook, which the learner does not load from workers it did not "
                "start itself (launcher='external', Ray). Define it in an importable module and pass it in "
                "`ClusterEnv(..., trusted_classes=[...])`."
            )
        if value is None:
            raise UntrustedPickleError(
                f"A worker sent a pickle that references `{module}.{name}`, which the learner does not load from "
                "workers it did not start itself (launcher='external', Ray): unpickling is running code. If that "
                f"class comes from code you trust, pass `ClusterEnv(..., trusted_classes=['{module}.{name}'])`."
            )
        return value


def loader(trusted: Iterable[type | str] = (), *, restricted: bool) -> Callable[[bytes], Any]:
    """The function that unpickles the blobs workers send.

    Args:
        trusted: classes (or ``"module.Name"`` strings) allowed beyond the built-in allow-list.
        restricted: ``False`` for workers the learner started itself (plain ``pickle.loads``).
    """
    names = _trusted_names(trusted)
    if not restricted:
        return pickle.loads

    def loads(data: bytes) -> Any:
        return _RestrictedUnpickler(data, names).load()

    return loads
