"""Units: entries of ``env_fns`` that make a whole vector env (EnvPool, SuperSuit, a ``SyncVectorEnv``).

Worker side. A factory may return a ``gymnasium.vector.VectorEnv`` instead of a single env:
it is then a *unit* that fills as many slots of the ``ClusterEnv`` as it has envs, and a
worker always holds whole units. A worker whose entries include a unit steps them with one
:class:`UnitsVectorEnv`: each unit steps its own envs, its results are written into the
worker's batch at its rows, and its batched infos are split per env (as Gymnasium's
``DictInfoToList`` splits them) into the same per-env records a
:class:`~clusterenv.stepping.recording_env.RecordingVectorEnv` keeps, which the learner merges
with Gymnasium's own ``_add_info`` in slot order. A single env among units is a unit of one
(a ``SyncVectorEnv`` of it, in the ``ClusterEnv``'s autoreset mode).

A worker's envs are then exactly those units stepped in one process, side by side: what a
unit returns is what the ``ClusterEnv`` returns at its rows, and its autoreset is its own
(the learner checks that every unit declares the same ``metadata["autoreset_mode"]``).
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from gymnasium import Env, spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorEnv
from gymnasium.vector.utils import batch_space, create_empty_array, iterate

from clusterenv.stepping.failures import EnvTracker
from clusterenv.stepping.recording_env import RecordingVectorEnv, build_from, enforces_order, make_envs
from clusterenv.stepping.step_clock import StepClock
from clusterenv.wire import shared_memory
from clusterenv.wire.infos import BatchedInfoLog
from clusterenv.wire.leaves import is_array_tree, leaf_arrays, leaf_specs, unflatten

__all__ = ["UnitsVectorEnv", "build_worker_envs", "unit_autoreset_mode", "unit_spaces"]

logger = logging.getLogger(__name__)


def unit_spaces(unit: VectorEnv) -> tuple[spaces.Space, spaces.Space]:
    """A unit's single observation and action spaces.

    Gymnasium's vector envs name them ``single_observation_space``/``single_action_space``.
    EnvPool sets both those and ``observation_space`` to the single env's space, and SuperSuit's
    vector envs set only ``observation_space``/``action_space``, to the single env's space: a
    missing (or ``None``) single space is read from the plain one, as such.
    """
    observation = getattr(unit, "single_observation_space", None)
    action = getattr(unit, "single_action_space", None)
    return (
        unit.observation_space if observation is None else observation,
        unit.action_space if action is None else action,
    )


def unit_autoreset_mode(unit: VectorEnv) -> AutoresetMode:
    """The unit's ``metadata["autoreset_mode"]``; Gymnasium reads a missing one as ``NEXT_STEP``, and so do we."""
    mode = (getattr(unit, "metadata", None) or {}).get("autoreset_mode", AutoresetMode.NEXT_STEP)
    return mode if isinstance(mode, AutoresetMode) else AutoresetMode(mode)


class UnitsVectorEnv(VectorEnv):
    """A worker's units side by side, as one vector env with the interface of ``RecordingVectorEnv``.

    Args:
        units: the units, in slot order.
        entries: the index in ``env_fns`` of each unit (named in errors).
        tracker: learns which env (the first of its unit) each loop reaches, should a unit raise.
        singles: which units are single envs made units of one (they take the ``ClusterEnv``'s
            autoreset mode, and report none of their own).
    """

    def __init__(
        self, units: list[VectorEnv], entries: list[int], tracker: EnvTracker, singles: list[bool] | None = None
    ) -> None:
        super().__init__()
        self.units, self.entries, self.tracker = units, entries, tracker
        self.singles = [False] * len(units) if singles is None else singles
        sizes = [int(unit.num_envs) for unit in units]
        self.offsets = [sum(sizes[:u]) for u in range(len(units))]
        self.sizes = sizes
        self.num_envs = sum(sizes)
        self.single_observation_space, self.single_action_space = unit_spaces(units[0])
        for u, unit in enumerate(units):
            for space in unit_spaces(unit):
                if not is_array_tree(space):
                    raise TypeError(
                        f"`env_fns[{entries[u]}]` made a vector env with space {space}, which has no fixed array "
                        "form: units need spaces whose values batch into arrays (Box, Discrete, MultiDiscrete, "
                        "MultiBinary, and Tuples and Dicts of them)."
                    )
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.autoreset_mode = unit_autoreset_mode(units[0])
        self.metadata = {**(getattr(units[0], "metadata", None) or {}), "autoreset_mode": self.autoreset_mode}
        self.render_mode = getattr(units[0], "render_mode", None)
        self._info_log = BatchedInfoLog()
        self._observations: Any = create_empty_array(self.single_observation_space, self.num_envs)
        self._rewards = np.zeros(self.num_envs, dtype=np.float64)
        self._terminations = np.zeros(self.num_envs, dtype=np.bool_)
        self._truncations = np.zeros(self.num_envs, dtype=np.bool_)
        self._autoreset = np.zeros(self.num_envs, dtype=np.bool_)  # under NEXT_STEP: the next step resets
        self._fresh = np.zeros(len(units), dtype=np.bool_)  # a replacement's units: the next step is a reset
        self._obs_specs = leaf_specs(self.single_observation_space)

    @property
    def info_log(self) -> BatchedInfoLog:
        """The infos since the handlers last took them, as the units batched them (read as per-env records)."""
        return self._info_log

    @info_log.setter
    def info_log(self, value: Any) -> None:
        # The handlers take the log and leave an empty list: a fresh log takes its place.
        self._info_log = BatchedInfoLog()

    @property
    def step_clock(self) -> StepClock:
        """Times each unit's step (a sample per unit step: its envs step together)."""
        return self.tracker.clock

    # -- stepping --------------------------------------------------------------------------
    def step_into(self, actions: Any, rewards: np.ndarray, terminations: np.ndarray, truncations: np.ndarray) -> Any:
        """:meth:`step`, writing the rewards and flags into the given arrays (the worker's rows): the observations."""
        obs, rewards[...], terminations[...], truncations[...], _ = self.step(actions)
        return obs

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step every unit with its rows of ``actions``; the worker's batch (``copy=False``)."""
        action_leaves = leaf_arrays(self.single_action_space, actions)
        clock = self.step_clock
        clock.start()
        try:
            for u, unit in enumerate(self.units):
                start, stop = self.offsets[u], self.offsets[u] + self.sizes[u]
                self.tracker.reached = start
                clock.reached()
                if self._fresh[u]:  # the autoreset step of a replacement's unit (NEXT_STEP)
                    self._fresh[u] = False
                    obs, infos = unit.reset()
                    self._place(u, obs, infos, "reset")
                    self._rewards[start:stop] = 0.0
                    self._terminations[start:stop] = self._truncations[start:stop] = False
                    self._autoreset[start:stop] = False
                    continue
                mine = unflatten(self.single_action_space, [leaf[start:stop] for leaf in action_leaves])
                obs, rewards, terminations, truncations, infos = unit.step(mine)
                for name, values in (
                    ("rewards", rewards),
                    ("terminations", terminations),
                    ("truncations", truncations),
                ):
                    if np.shape(values) != (self.sizes[u],):
                        raise ValueError(
                            f"`env_fns[{self.entries[u]}]` made a vector env of num_envs={self.sizes[u]} whose step "
                            f"returned {name} of shape {np.shape(values)}, expected ({self.sizes[u]},)."
                        )
                self._place(u, obs, infos, "step")
                self._rewards[start:stop] = rewards
                self._terminations[start:stop] = terminations
                self._truncations[start:stop] = truncations
                if self.autoreset_mode is AutoresetMode.NEXT_STEP:
                    self._autoreset[start:stop] = self._terminations[start:stop] | self._truncations[start:stop]
        finally:
            clock.stop()
        return self._observations, self._rewards, self._terminations, self._truncations, {}

    def _place(self, u: int, obs: Any, infos: Any, what: str) -> None:
        """Write unit ``u``'s observations into its rows and record its infos, checking them against its spaces."""
        start, size = self.offsets[u], self.sizes[u]
        leaves = leaf_arrays(self.single_observation_space, obs)
        for leaf, (dtype, shape, _), out in zip(
            leaves, self._obs_specs, leaf_arrays(self.single_observation_space, self._observations), strict=True
        ):
            got = np.asarray(leaf)
            if got.shape != (size, *shape) or got.dtype != dtype:
                raise ValueError(
                    f"`env_fns[{self.entries[u]}]` made a vector env whose {what} returned observations of shape "
                    f"{got.shape} and dtype {got.dtype}, but its single observation space "
                    f"{self.single_observation_space} and num_envs={size} expect shape {(size, *shape)} and dtype "
                    f"{dtype}."
                )
            out[start : start + size] = got
        if not isinstance(infos, (Mapping, list, tuple)):
            raise TypeError(
                f"`env_fns[{self.entries[u]}]` made a vector env whose {what} returned infos of type "
                f"{type(infos).__name__}; expected a dict (Gymnasium's form) or a list of per-env dicts."
            )
        self._info_log.add(start, size, infos)

    def reset(
        self, *, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset the units (those with an env in ``options["reset_mask"]``), each with the seed of its first env.

        ``seed`` is one seed per env, as the learner derives them (``s + i`` for env ``i``): a unit
        takes one seed and seeds its envs from it, so its envs' seeds must be that seed's run
        (``x, x + 1, ...``) or all ``None``.
        """
        seeds = self._seeds(seed)
        options = dict(options or {})
        mask = options.pop("reset_mask", None)
        self._reset_units(seeds, [options or None] * self.num_envs, mask)
        return self._observations, {}

    def reset_each(
        self, seeds: list[int | None], options: list[dict[str, Any] | None], mask: Any = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset with one options dict per env: a unit's envs must share theirs (a unit takes one)."""
        self._reset_units(self._seeds(seeds), list(options), mask)
        return self._observations, {}

    def _seeds(self, seed: int | list[int | None] | None) -> list[int | None]:
        if seed is None:
            return [None] * self.num_envs
        if isinstance(seed, int):
            return [seed + i for i in range(self.num_envs)]
        return list(seed)

    def _reset_units(self, seeds: list[int | None], options: list[dict[str, Any] | None], mask: Any) -> None:
        selected = np.ones(self.num_envs, dtype=np.bool_) if mask is None else np.asarray(mask, dtype=np.bool_)
        for u, unit in enumerate(self.units):
            start, stop = self.offsets[u], self.offsets[u] + self.sizes[u]
            mine = selected[start:stop]
            if not mine.any():
                continue
            unit_seed = self._unit_seed(u, seeds[start:stop])
            unit_options = options[start]
            if any(o != unit_options for o in options[start:stop]):
                raise ValueError(
                    f"`env_fns[{self.entries[u]}]` is a vector env of envs {start}..{stop - 1} of this worker, and a "
                    f"vector env takes one options dict for its envs; got different options for them: "
                    f"{options[start:stop]!r}."
                )
            if not mine.all():
                unit_options = {**(unit_options or {}), "reset_mask": mine.copy()}
            self.tracker.reached = start
            obs, infos = unit.reset(seed=unit_seed, options=unit_options)
            self._place(u, obs, infos, "reset")
            self._terminations[start:stop][mine] = False
            self._truncations[start:stop][mine] = False
            self._autoreset[start:stop][mine] = False
            self._fresh[u] = False

    def _unit_seed(self, u: int, seeds: list[int | None]) -> int | None:
        first = seeds[0]
        expected = [None] * len(seeds) if first is None else [first + i for i in range(len(seeds))]
        if seeds != expected:
            raise ValueError(
                f"`env_fns[{self.entries[u]}]` is a vector env, which takes one seed `s` and seeds its envs "
                f"s, s + 1, ...; its envs were given the seeds {seeds}, expected {expected}. Pass `seed` as an "
                "int, or per-env seeds that count up by one within each vector env."
            )
        return first

    # -- what the worker's handlers use (as RecordingVectorEnv offers it) -----------------------
    @property
    def current_observations(self) -> Any:
        """The batch of current observations (the buffer ``step`` writes into)."""
        return self._observations

    def env_observations(self) -> list[Any]:
        """The current per-env observations."""
        return list(iterate(self.observation_space, self._observations))

    def misfit_observation(self) -> int | None:
        """Units' observations are checked as they are placed (:meth:`_place` raises): none is left misfit."""
        return None

    def autoresetting(self) -> np.ndarray:
        """Under NEXT_STEP, which envs' next step is an autoreset step (their last step ended an episode)."""
        return self._autoreset.copy()

    def mark_autoreset_pending(self) -> None:
        """Make every unit's next step a reset, as a NEXT_STEP autoreset step (a replacement's fresh units)."""
        self._fresh[:] = True
        self._autoreset[:] = True

    def write_observations_into(self, view: Any) -> None:
        """From now on, write observations into ``view`` (shared memory), starting from the current ones."""
        space = self.single_observation_space
        for new, old in zip(leaf_arrays(space, view), leaf_arrays(space, self._observations), strict=True):
            new[...] = old
        self._observations = view

    def observe_into(self, view: Any) -> None:
        """From now on, write observations into ``view``, leaving what it holds until the next reset or step."""
        self._observations = view

    def share_observations(self, meta: Mapping[str, Any]) -> bool:
        """Write observations into the shared batch that ``meta`` describes, if it maps here."""
        view = shared_memory.attach(meta, self.single_observation_space)
        if view is None:
            return False
        self.write_observations_into(view)
        return True

    def _unit_of(self, index: int) -> tuple[int, int]:
        for u in range(len(self.units)):
            if index < self.offsets[u] + self.sizes[u]:
                return u, index - self.offsets[u]
        raise IndexError(f"Env index {index} is out of range for {self.num_envs} envs.")

    def call_at(self, indices: list[int] | None, name: str | None, args: tuple, kwargs: dict[str, Any]) -> list[Any]:
        """``call(name, ...)`` for the envs ``indices`` (``None``: all); ``name=None``: ``args[0](env)``.

        A unit with ``call`` (Gymnasium's vector envs) answers per env from its own ``call``; any
        other unit (EnvPool, SuperSuit) answers with its own attribute once, for each of its envs.
        ``apply`` sees a unit's ``envs[i]`` if it has such a list, else the unit itself.
        """
        answers: dict[int, list[Any]] = {}
        results = []
        for index in range(self.num_envs) if indices is None else indices:
            u, i = self._unit_of(index)
            unit = self.units[u]
            self.tracker.reached = index
            if name is None:
                sub_envs = getattr(unit, "envs", None)
                results.append(args[0](sub_envs[i] if isinstance(sub_envs, Sequence) else unit))
                continue
            if u not in answers:
                if hasattr(unit, "call"):
                    answers[u] = list(unit.call(name, *args, **kwargs))
                else:
                    value = getattr(unit, name)
                    answers[u] = [value(*args, **kwargs) if callable(value) else value] * self.sizes[u]
            results.append(answers[u][i])
        return results

    def set_attr_at(self, indices: list[int] | None, name: str, values: list[Any]) -> None:
        """``set_attr(name, values)`` on the envs ``indices`` (``None``: all), through units that have ``set_attr``."""
        chosen = list(range(self.num_envs)) if indices is None else indices
        by_unit: dict[int, dict[int, Any]] = {}
        for index, value in zip(chosen, values, strict=True):
            u, i = self._unit_of(index)
            by_unit.setdefault(u, {})[i] = value
        for u, mine in by_unit.items():
            unit = self.units[u]
            if not hasattr(unit, "set_attr") or len(mine) != self.sizes[u]:
                raise AttributeError(
                    f"`env_fns[{self.entries[u]}]` is a vector env ({type(unit).__name__}): `set_attr({name!r})` "
                    "needs a vector env with `set_attr`, given a value for every one of its envs."
                )
            unit.set_attr(name, [mine[i] for i in range(self.sizes[u])])

    def description(self) -> dict[str, Any]:
        """What the learner needs to know of these envs: per-env spaces, metadata, render mode, and the units."""
        observation_spaces, action_spaces = [], []
        for unit, size in zip(self.units, self.sizes, strict=True):
            observation, action = unit_spaces(unit)
            observation_spaces += [observation] * size
            action_spaces += [action] * size
        return {
            "observation_spaces": observation_spaces,
            "action_spaces": action_spaces,
            # The mode travels as a value (entry_modes): an enum is a class that the learner's safe
            # unpickling refuses from workers it did not start.
            "metadata": {key: value for key, value in self.metadata.items() if key != "autoreset_mode"},
            "render_mode": self.render_mode,
            "entry_envs": list(self.sizes),
            # A unit is stepped as it is; a single env among them refuses a step before reset if it enforces order.
            "enforces_order": [
                flag
                for unit, single, size in zip(self.units, self.singles, self.sizes, strict=True)
                for flag in ([enforces_order(unit.envs[0])] if single and hasattr(unit, "envs") else [False] * size)
            ],
            "entry_modes": [
                None if single else unit_autoreset_mode(unit).value
                for unit, single in zip(self.units, self.singles, strict=True)
            ],
        }

    def close_extras(self, **kwargs: Any) -> None:
        """Close every unit."""
        for unit in self.units:
            unit.close()


def build_worker_envs(
    env_blobs: list[bytes],
    observation_mode: Any,
    autoreset_mode: AutoresetMode,
    tracker: EnvTracker,
    max_env_errors: int | None,
    entry_offset: int,
) -> RecordingVectorEnv | UnitsVectorEnv:
    """A worker's envs: a ``RecordingVectorEnv`` of single envs, or a ``UnitsVectorEnv`` if any factory made a unit.

    Args:
        env_blobs: the worker's pickled factories.
        observation_mode: as for :func:`~clusterenv.stepping.recording_env.build`.
        autoreset_mode: the ``ClusterEnv``'s, for single envs (a unit has its own).
        tracker: learns which env is being built.
        max_env_errors: ``on_env_error="reset"``'s bound (``None``: errors raise); single envs only.
        entry_offset: the index in ``env_fns`` of the worker's first factory (named in errors).
    """
    env_fns = [pickle.loads(blob) for blob in env_blobs]
    made = make_envs(env_fns, tracker)
    if not any(isinstance(env, VectorEnv) for env in made):
        return build_from(env_fns, made, observation_mode, autoreset_mode, tracker, max_env_errors)
    entries = [entry_offset + i for i in range(len(made))]
    if max_env_errors is not None:
        raise ValueError(
            f"`env_fns[{entries[0]}..{entries[-1]}]` include vector envs, which on_env_error='reset' cannot rebuild "
            "env by env: use on_env_error='raise'."
        )
    if observation_mode != "same":
        raise ValueError(
            f"`env_fns[{entries[0]}..{entries[-1]}]` include vector envs, which need observation_mode='same', got "
            f"{observation_mode!r}."
        )
    units = [
        env if isinstance(env, VectorEnv) else SyncVectorEnv([_returning(env)], autoreset_mode=autoreset_mode)
        for env in made
    ]
    return UnitsVectorEnv(units, entries, tracker, [not isinstance(env, VectorEnv) for env in made])


def _returning(env: Env) -> Callable[[], Env]:
    return lambda: env
