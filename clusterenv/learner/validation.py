"""Checks of user input, run on the learner before anything is sent to a worker, and its defaults.

Each check either returns the value in the form the wire needs or raises with what was
wrong and what was expected, in Gymnasium's wording where Gymnasium has one. The env
factories and the learner's env registry (:func:`worker_context`) are pickled here too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import cloudpickle
import gymnasium
import numpy as np
from gymnasium import Env, spaces
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import iterate

from clusterenv.wire.contract import per_env_seeds
from clusterenv.wire.leaves import leaf_arrays
from clusterenv.wire.protocol import MAX_HEADER_INT

__all__ = [
    "check_autoreset_mode",
    "action_items",
    "check_actions",
    "check_attribute_name",
    "check_batch_size",
    "check_choice",
    "check_count",
    "check_env_fns",
    "check_first_ready",
    "check_flag",
    "check_indices",
    "check_learner_envs",
    "check_min_workers",
    "check_num_workers",
    "check_observation_mode",
    "check_procs_per_worker",
    "check_reset_mask",
    "check_reset_options",
    "check_seconds",
    "check_seeds",
    "check_spin_us",
    "pickle_argument",
    "pickle_env_fn",
    "worker_context",
]

logger = logging.getLogger(__name__)


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    """``value``, if it is one of ``choices``."""
    if value not in choices:
        expected = " or ".join(map(repr, choices)) if len(choices) == 2 else f"one of {list(choices)}"
        raise ValueError(f"`{name}` must be {expected}, got {value!r}.")
    return value


def check_autoreset_mode(autoreset_mode: Any) -> AutoresetMode | None:
    """The ``AutoresetMode`` asked for (a mode or its value), or ``None``."""
    mode = autoreset_mode.value if isinstance(autoreset_mode, AutoresetMode) else autoreset_mode
    if mode is None:
        return None
    return AutoresetMode(check_choice("autoreset_mode", mode, [m.value for m in AutoresetMode]))


def check_first_ready(observation_mode: Any, autoreset_mode: AutoresetMode | None = None) -> None:
    """Check first-ready batches' needs: one observation space and an autoreset mode."""
    if observation_mode == "different":
        raise ValueError(
            "async_reset/send/recv batch any subset of envs, so they need observation_mode='same' "
            "(one observation space for all envs)."
        )
    if autoreset_mode is AutoresetMode.DISABLED:
        raise ValueError(
            "async_reset/send/recv need an autoreset mode (NEXT_STEP or SAME_STEP): under DISABLED an "
            "env that ended can only be reset with reset(options={'reset_mask': ...}), which waits for all envs."
        )


def check_flag(name: str, value: Any) -> bool:
    """``value`` as a ``bool``, if it is one (numpy's included)."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"`{name}` must be True or False, got {type(value).__name__} ({value!r}).")
    return bool(value)


def check_observation_mode(observation_mode: Any) -> str | tuple[spaces.Space, spaces.Space]:
    """``"same"``, ``"different"`` or ``(observation_space, single_observation_space)``, as in ``SyncVectorEnv``."""
    if isinstance(observation_mode, tuple) and len(observation_mode) == 2:
        if not all(isinstance(space, spaces.Space) for space in observation_mode):
            raise TypeError(
                "Expected both elements of observation_mode to be Spaces, got "
                f"{type(observation_mode[0])} and {type(observation_mode[1])}"
            )
        return observation_mode
    if isinstance(observation_mode, str) and observation_mode in ("same", "different"):
        return observation_mode
    raise ValueError(
        "Invalid `observation_mode`, expected: 'same' or 'different' or tuple of single and batch observation "
        f"space, actual got {observation_mode}"
    )


def check_seconds(name: str, value: Any, *, allow_none: bool, unit: str = "seconds") -> Any:
    """``value`` as a float if it is a positive number (of ``unit``; or None where allowed), else a clear error."""
    if value is None and allow_none:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        expected = f"a positive number of {unit}" + (" or None" if allow_none else "")
        raise TypeError(f"`{name}` must be {expected}, got {type(value).__name__} ({value!r}).")
    if not value > 0:
        raise ValueError(f"`{name}` must be a positive number of {unit}, got {value}.")
    return float(value)


def check_spin_us(value: Any) -> float | None:
    """``spin_us``: ``None`` (adapted), or a number of µs from 0 (never spin) up to a second."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"`spin_us` must be None or a number of microseconds, got {type(value).__name__} ({value!r}).")
    if not 0 <= value <= 1e6:
        raise ValueError(f"`spin_us` must be between 0 and 1,000,000 microseconds (a second), got {value}.")
    return float(value)


def _count_between(name: str, value: Any, high: int, high_name: str) -> int:
    """An integer ``value`` between 1 and ``high`` (``high_name`` says what bounds it), else a clear error."""
    value = _integer(name, value)
    if not 1 <= value <= high:
        raise ValueError(f"`{name}` must be between 1 and {high_name} ({high}), got {value}.")
    return value


def _integer(name: str, value: Any) -> int:
    """``value`` as an ``int``, if it is a Python or numpy integer (not a bool), else a ``TypeError``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"`{name}` must be an integer, got {type(value).__name__} ({value!r}).")
    return int(value)


def check_count(name: str, value: Any) -> int:
    """A non-negative integer ``value``, else a clear error."""
    value = _integer(name, value)
    if value < 0:
        raise ValueError(f"`{name}` must be at least 0, got {value}.")
    return value


def check_num_workers(num_workers: Any, num_envs: int) -> int:
    """A worker count between 1 and ``num_envs``."""
    return _count_between("num_workers", num_workers, num_envs, "the number of envs")


def check_min_workers(min_workers: Any, num_workers: int) -> int:
    """The fewest worker processes a re-homing run goes on with: between 1 and ``num_workers``."""
    return _count_between("min_workers", min_workers, num_workers, "`num_workers`")


def check_procs_per_worker(procs_per_worker: Any) -> int:
    """A positive number of env processes per worker."""
    if (
        isinstance(procs_per_worker, bool)
        or not isinstance(procs_per_worker, (int, np.integer))
        or not procs_per_worker >= 1
    ):
        raise ValueError(
            f"`procs_per_worker` must be an integer of at least 1, got {type(procs_per_worker).__name__} "
            f"({procs_per_worker!r})."
        )
    return int(procs_per_worker)


def check_env_fns(env_fns: Sequence[Callable[[], Env | VectorEnv]]) -> None:
    """A non-empty sequence of callables, as ``AsyncVectorEnv`` takes."""
    if isinstance(env_fns, (str, bytes)) or not isinstance(env_fns, Sequence):
        raise TypeError(f"`env_fns` must be a sequence of callables, got {type(env_fns).__name__}.")
    if len(env_fns) == 0:
        raise ValueError("`env_fns` must contain at least one environment factory, got an empty sequence.")
    for i, fn in enumerate(env_fns):
        if not callable(fn):
            raise TypeError(f"`env_fns[{i}]` must be a zero-argument callable, got {type(fn).__name__}.")


def pickle_env_fn(index: int, fn: Callable[[], Env | VectorEnv]) -> bytes:
    """The cloudpickled factory, or an error naming the factory that cannot travel and why."""
    try:
        return cloudpickle.dumps(fn)
    except Exception as exc:
        raise TypeError(
            f"`env_fns[{index}]` ({fn!r}) cannot be pickled with cloudpickle, so it cannot be sent "
            f"to a worker: {type(exc).__name__}: {exc}"
        ) from exc


def pickle_argument(value: Any, what: str) -> bytes:
    """The cloudpickled ``value``, or an error saying which argument cannot be sent."""
    try:
        return cloudpickle.dumps(value)
    except Exception as exc:
        raise TypeError(f"The {what} cannot be pickled to send to workers: {exc}") from exc


def check_batch_size(batch_size: Any, sizes: Sequence[int]) -> int:
    """``batch_size`` for first-ready ``recv()``: whole workers' slices (``sizes``), so equal ones, and a multiple."""
    num_envs, num_workers = sum(sizes), len(sizes)
    if batch_size is None:
        return num_envs
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
        raise TypeError(f"`batch_size` must be an int or None, got {type(batch_size).__name__}.")
    batch_size = int(batch_size)
    if not 1 <= batch_size <= num_envs:
        raise ValueError(f"`batch_size` must be between 1 and num_envs={num_envs}, got {batch_size}.")
    if batch_size == num_envs:
        return batch_size
    if num_envs % num_workers:
        raise ValueError(
            f"batch_size={batch_size} < num_envs needs the same number of envs on every worker, so that recv() "
            f"can return whole workers; {num_envs} envs do not split evenly over num_workers={num_workers}."
        )
    if len(set(sizes)) > 1:
        raise ValueError(
            f"batch_size={batch_size} < num_envs needs the same number of envs on every worker, so that recv() "
            f"can return whole workers; the vector envs in `env_fns` give the workers {list(sizes)} envs."
        )
    per_worker = num_envs // num_workers
    if batch_size % per_worker:
        raise ValueError(
            f"`batch_size` must be a multiple of the envs per worker ({per_worker}: {num_envs} envs over "
            f"{num_workers} workers), so that recv() returns whole workers; got {batch_size}."
        )
    return batch_size


def check_seeds(seed: Any, num_envs: int) -> list[int | None]:
    """One seed per env, as ``SyncVectorEnv.reset`` derives them, or a clear error.

    Seeds must be valid for Gymnasium's ``np_random`` (non-negative) and fit in a message
    header (at most ``2**64 - 1``), for every env: ``seed=n`` gives env ``i`` the seed ``n + i``.
    """
    if isinstance(seed, np.ndarray):
        seed = seed.tolist()
    if seed is None:
        return per_env_seeds(None, num_envs)
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        seed = int(seed)
        if seed < 0:
            raise ValueError(
                f"`seed` must be a non-negative integer (Gymnasium's `np_random` requires it), got {seed}."
            )
        if seed + num_envs - 1 > MAX_HEADER_INT:
            raise ValueError(
                f"`seed` must be at most 2**64 - {num_envs} = {MAX_HEADER_INT - num_envs + 1} for {num_envs} envs "
                f"(env i gets `seed + i`, and no seed above 2**64 - 1 can be sent to a worker), got {seed}."
            )
        return per_env_seeds(seed, num_envs)
    if isinstance(seed, (str, bytes)) or not isinstance(seed, Sequence):
        raise TypeError(
            f"`seed` must be an int, a list of int or None (one per env), or None, got {type(seed).__name__}."
        )
    seeds = list(seed)
    for i, value in enumerate(seeds if len(seeds) == num_envs else []):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
            raise TypeError(f"`seed[{i}]` must be an int or None, got {type(value).__name__} ({value!r}).")
        if value is not None and not 0 <= value <= MAX_HEADER_INT:
            raise ValueError(
                f"`seed[{i}]` must be between 0 (Gymnasium's `np_random` requires it) and 2**64 - 1 (the largest "
                f"seed that can be sent to a worker), got {value}."
            )
    return per_env_seeds(seeds, num_envs)  # refuses a list of the wrong length, as SyncVectorEnv does first


def check_reset_options(
    options: Any, num_envs: int
) -> tuple[dict[str, Any] | list[dict[str, Any] | None] | None, np.ndarray | None]:
    """``reset``'s ``options`` split into the options the envs get and the checked ``reset_mask`` (or None).

    ``options`` is a dict for every env (as Gymnasium takes it), or a list or tuple of one
    dict (or ``None``) per env.
    """
    if options is None:
        return None, None
    if isinstance(options, (list, tuple)):
        if len(options) != num_envs:
            raise ValueError(
                f"If `options` are passed as a list, its length must match num_envs={num_envs}, "
                f"got length={len(options)}."
            )
        for i, env_options in enumerate(options):
            if env_options is not None and not isinstance(env_options, Mapping):
                raise TypeError(f"`options[{i}]` must be a dict or None, got {type(env_options).__name__}.")
            if env_options is not None and "reset_mask" in env_options:
                raise ValueError("`reset_mask` applies to all envs: pass it in one options dict, not per env.")
        return [None if o is None else dict(o) for o in options], None
    if not isinstance(options, Mapping):
        raise TypeError(
            f"`options` must be a dict, a list of one dict per env, or None, "
            f"got {type(options).__name__} ({options!r})."
        )
    options = dict(options)
    mask = check_reset_mask(options.pop("reset_mask"), num_envs) if "reset_mask" in options else None
    return options, mask


def check_attribute_name(name: Any) -> str:
    """The name given to ``call``/``get_attr``/``set_attr``: a string, as ``getattr`` requires."""
    if not isinstance(name, str):
        raise TypeError(f"The attribute name must be a string, got {type(name).__name__} ({name!r}).")
    return name


def check_reset_mask(reset_mask: Any, num_envs: int) -> np.ndarray:
    """``options["reset_mask"]`` checked exactly as ``SyncVectorEnv.reset`` checks it."""
    if not isinstance(reset_mask, np.ndarray):
        raise TypeError(f"`options['reset_mask']` must be a numpy array, got {type(reset_mask)}")
    if reset_mask.shape != (num_envs,):
        raise ValueError(f"`options['reset_mask']` must have shape `({num_envs},)`, got {reset_mask.shape}")
    if reset_mask.dtype != np.bool_:
        raise TypeError(f"`options['reset_mask']` must have `dtype=np.bool_`, got {reset_mask.dtype}")
    if not np.any(reset_mask):
        raise ValueError(
            f"`options['reset_mask']` must contain a boolean array with at least one True value, "
            f"got reset_mask={reset_mask}"
        )
    return reset_mask


def check_actions(
    actions: Any,
    single_action_space: spaces.Space,
    specs: list[tuple[np.dtype, tuple[int, ...], spaces.Space]],
    num_envs: int,
) -> list[np.ndarray]:
    """The leaf arrays of a batch of actions, each of shape ``(num_envs, *single_shape)``.

    Only what the wire needs is checked: the structure, one action per env, the shape and a
    numeric dtype. Values are the envs' business, as with ``SyncVectorEnv``: an action out of
    range may be what an env in its autoreset step ignores. The user's dtype is kept (not
    cast to the space's), so that envs see exactly what ``SyncVectorEnv`` would pass them.
    Leaves pair with ``specs`` in the single space's order (``Dict`` keys as the env declared
    them; ``batch_space`` sorts them).
    """
    try:
        leaves = leaf_arrays(single_action_space, actions)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ValueError(
            f"Actions do not match the action space {single_action_space} (batched for {num_envs} envs): "
            f"{type(exc).__name__}: {exc}"
        ) from None
    checked = []
    for leaf, (_dtype, shape, space) in zip(leaves, specs, strict=True):
        array = np.asarray(leaf)
        if array.ndim == 0:
            raise TypeError(
                f"Actions must be a batch with one action per env (num_envs={num_envs}) for action space {space}, "
                f"got the scalar {leaf!r}."
            )
        expected = (num_envs, *shape)
        if array.shape != expected:
            raise ValueError(
                f"Actions must have shape {expected} (num_envs={num_envs}, then the single action "
                f"shape {shape}) for action space {space}, got shape {array.shape}."
            )
        if array.dtype.kind not in "biuf":
            raise TypeError(f"Actions must be numeric for action space {space}, got dtype {array.dtype}.")
        checked.append(array)
    return checked


def action_items(actions: Any, action_space: spaces.Space, num_envs: int) -> list[Any]:
    """The per-env actions that ``SyncVectorEnv.step`` would hand each env, for spaces without an array form."""
    try:
        items = list(iterate(action_space, actions))
    except Exception as exc:
        raise ValueError(f"Actions do not match the action space {action_space}: {type(exc).__name__}: {exc}") from None
    if len(items) != num_envs:
        raise ValueError(f"Expected one action per env (num_envs={num_envs}), got {len(items)} actions.")
    return items


def check_indices(indices: Any, num_envs: int) -> list[int] | None:
    """Env indices for ``get_attr``/``set_attr``/``apply``: ``None`` (all), an int or ints (negative: from the end)."""
    if indices is None:
        return None
    single = isinstance(indices, (int, np.integer)) and not isinstance(indices, bool)
    if isinstance(indices, (str, bytes)) or not (single or isinstance(indices, Iterable)):
        raise TypeError(f"`indices` must be None, an int or a sequence of ints, got {type(indices).__name__}.")
    checked = []
    for index in [indices] if single else list(indices):
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"`indices` must hold ints, got {type(index).__name__} ({index!r}).")
        if not -num_envs <= index < num_envs:
            raise IndexError(f"Env index {index} is out of range for num_envs={num_envs}.")
        checked.append(int(index) % num_envs)
    return checked


def worker_context(observation_space: spaces.Space | None) -> bytes:
    """What every worker needs before it runs the factories: this process's env registry, and a given observation space.

    A factory calling ``gym.make(id)`` must find ids that only this process registered
    (``gym.register`` in the script, ``gym.register_envs(ale_py)``), as it would under
    ``SyncVectorEnv``. Each spec travels pickled on its own, so that one a worker cannot load
    (its entry point's module is not installed there) costs only that id.
    """
    specs = {}
    for env_id, spec in gymnasium.registry.items():
        try:
            specs[env_id] = cloudpickle.dumps(spec)
        except Exception as exc:
            logger.debug("Env id %r stays unknown to workers: its spec cannot be pickled (%s).", env_id, exc)
    return cloudpickle.dumps({"registry": specs, "observation_space": observation_space})


def check_learner_envs(learner_envs: Any, num_envs: int, batch_size: Any) -> int | None:
    """How many envs the learner steps itself: from 0 to ``num_envs - 1`` (the workers keep at least one).

    ``None``: the default layout decides (:mod:`clusterenv.learner.layout`).
    """
    if learner_envs is None:
        return None
    value = _integer("learner_envs", learner_envs)
    if not 0 <= value < num_envs:
        raise ValueError(
            f"`learner_envs` must be between 0 and num_envs - 1 ({num_envs - 1}): the workers step at least one "
            f"env, got {value}."
        )
    if value and batch_size is not None:
        raise ValueError("`batch_size` is for first-ready batches, which need `learner_envs=0`.")
    return value
