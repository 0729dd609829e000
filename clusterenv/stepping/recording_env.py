"""The vector env that steps a worker's envs in one process, recording per-env infos.

Worker side. A worker steps its slice with one :class:`RecordingVectorEnv`
(``procs_per_worker=1``), or hands it to :mod:`clusterenv.worker.env_processes`, whose child
processes each step a part of the slice with one. Either way every per-env semantic
(autoreset modes, seeding) is Gymnasium's own ``SyncVectorEnv`` code.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import pickle
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import cloudpickle
import gymnasium
import numpy as np
from gymnasium.envs.registration import EnvSpec
from gymnasium.vector import SyncVectorEnv, VectorEnv
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array
from gymnasium.wrappers import OrderEnforcing

from clusterenv.stepping.env_errors import ResettingEnv
from clusterenv.stepping.failures import EnvTracker, TimedEnvs, TrackedEnvs, index_in_step
from clusterenv.stepping.lean_loop import lean_step, takes_lean_step
from clusterenv.stepping.step_clock import StepClock
from clusterenv.wire import shared_memory
from clusterenv.wire.infos import InfoRecord
from clusterenv.wire.layers import user_env
from clusterenv.wire.leaves import leaf_arrays

__all__ = [
    "RecordingVectorEnv",
    "build",
    "build_from",
    "dumps",
    "enforces_order",
    "install_registry",
    "learner_registry",
    "make_envs",
    "reset_envs",
]

logger = logging.getLogger(__name__)

# Gymnasium's warning when ``gym.register`` meets an id already in the registry.
_OVERRIDDEN = re.compile(r"Overriding environment (\S+) already in registry")


class RecordingVectorEnv(SyncVectorEnv):
    """A SyncVectorEnv that records each per-env info instead of batching it.

    The learner replays the records with global env indices through Gymnasium's own
    ``VectorEnv._add_info``, so the batched infos are exactly what one SyncVectorEnv
    over all envs would have built (same keys, order, dtypes and masks).
    """

    info_log: list[InfoRecord]
    #: Whether one batch step in ``SAMPLE_EVERY`` times each env's step (for usage reports).
    samples_steps: bool = True
    envs: TrackedEnvs  # tells the worker's EnvTracker which env its loops reached (build() sets it)
    _untracked: list[Any]  # the same envs, handed to a batch step (build() sets it)
    _timed: TimedEnvs  # the same envs, handed to a timed batch step (build() sets it)

    @property
    def step_clock(self) -> StepClock:
        """Times each env's steps (the tracker's clock, which sees each env reached)."""
        return self.envs.tracker.clock

    def step(self, actions: Any) -> Any:
        """``SyncVectorEnv.step``; in a sampled batch step, each env's step timed.

        Under ``NEXT_STEP`` and ``SAME_STEP`` with array actions, the lean loop (:mod:`clusterenv.stepping.lean_loop`)
        stands in for ``SyncVectorEnv``'s: the same calls and writes, without its per-env bookkeeping.

        The loop gets a plain list of the envs (a timed one in a sampled step): tracking each
        env it reaches would cost a Python call per env, 6% of a CartPole's step. An env that
        raises is named from the traceback instead.
        """
        if self._stepped(actions):
            return self._observations, self._rewards.copy(), self._terminations.copy(), self._truncations.copy(), {}
        return self._sync_step(actions)

    def step_into(self, actions: Any, rewards: np.ndarray, terminations: np.ndarray, truncations: np.ndarray) -> Any:
        """:meth:`step`, writing the rewards and flags into the given arrays (the batch's rows): the observations.

        A lean step's results go there straight from the envs' own arrays, with none of the
        copies that ``step`` returns.
        """
        if self._stepped(actions):
            rewards[...], terminations[...], truncations[...] = self._rewards, self._terminations, self._truncations
            return self._observations
        obs, rewards[...], terminations[...], truncations[...], _ = self._sync_step(actions)
        return obs

    def _stepped(self, actions: Any) -> bool:
        """Step with the lean loop where it stands in for ``SyncVectorEnv.step``; whether it did."""
        if not takes_lean_step(self, actions):
            return False
        tracked = self.envs
        clock = tracked.tracker.clock
        timed = self.samples_steps and clock.start()  # the others pay no clock read, no Python call per env
        try:
            lean_step(self, self._timed if timed else self._untracked, actions, self.info_log)
        except BaseException as exc:
            tracked.tracker.reached = index_in_step(exc.__traceback__)
            raise
        finally:
            if timed:
                clock.stop()
        return True

    def _sync_step(self, actions: Any) -> Any:
        """``SyncVectorEnv.step`` itself, with the plain list of envs (a timed one in a sampled step)."""
        tracked = self.envs
        clock = tracked.tracker.clock
        timed = self.samples_steps and clock.start()
        try:
            # For this loop only: SyncVectorEnv.step indexes any list (the other loops keep the tracked one).
            self.envs = self._timed if timed else self._untracked  # type: ignore[assignment]
            return super().step(actions)
        except BaseException as exc:
            tracked.tracker.reached = index_in_step(exc.__traceback__)
            raise
        finally:
            self.envs = tracked
            if timed:
                clock.stop()

    def _add_info(self, vector_infos: dict[str, Any], env_info: dict[str, Any], env_num: int) -> dict[str, Any]:
        if env_info:
            self.info_log.append((env_num, env_info))
        return vector_infos

    # The one place that reaches into SyncVectorEnv's internals.
    @property
    def current_observations(self) -> Any:
        """The batch of current observations (the buffer ``step`` writes into, ``copy=False``)."""
        return self._observations

    def env_observations(self) -> list[Any]:
        """The current per-env observations, for spaces without a fixed array form."""
        return self._env_obs

    def misfit_observation(self) -> int | None:
        """The first env whose current observation does not batch into the observation space, if any."""
        space = self.single_observation_space
        out: Any = create_empty_array(space, n=1)
        for i, obs in enumerate(self._env_obs):
            try:
                concatenate(space, [obs], out)
            except Exception:
                return i
        return None

    def autoresetting(self) -> np.ndarray:
        """Under NEXT_STEP, which envs' next step is an autoreset step (a copy)."""
        return self._autoreset_envs.copy()

    def mark_autoreset_pending(self) -> None:
        """Make every env's next step an autoreset step, as after a truncation (a replacement's envs)."""
        self._autoreset_envs = np.ones(self.num_envs, dtype=np.bool_)

    def write_observations_into(self, view: Any) -> None:
        """From now on, write observations into ``view`` (shared memory), starting from the current ones."""
        space = self.single_observation_space
        for new, old in zip(leaf_arrays(space, view), leaf_arrays(space, self._observations), strict=True):
            new[...] = old
        self._observations = view  # SyncVectorEnv's concatenate(..., out=) now fills it

    def observe_into(self, view: Any) -> None:
        """From now on, write observations into ``view``, leaving what it holds until the next reset or step.

        The shared step region: a replacement's fresh envs have no observation yet, and the
        region still holds the last ones the learner received of the envs they replace.
        """
        self._observations = view

    def share_observations(self, meta: Mapping[str, Any]) -> bool:
        """Write observations into the shared batch that ``meta`` describes (``shared_obs``), if it maps here."""
        view = shared_memory.attach(meta, self.single_observation_space)
        if view is None:
            return False
        self.write_observations_into(view)
        return True

    def reset_each(
        self, seeds: list[int | None], options: list[dict[str, Any] | None], mask: Any = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset env ``i`` with ``seeds[i]`` and its own ``options[i]`` (only the envs in ``mask``, if given).

        ``SyncVectorEnv.reset`` gives every env the same options; this is its masked reset with
        per-env options (Stable-Baselines3's ``set_options`` takes a list), state for state.
        """
        selected = np.ones(self.num_envs, dtype=np.bool_) if mask is None else np.asarray(mask, dtype=np.bool_)
        self._terminations[selected] = False
        self._truncations[selected] = False
        self._autoreset_envs[selected] = False
        infos: dict[str, Any] = {}
        for i, env in enumerate(self.envs):
            if selected[i]:
                self._env_obs[i], env_info = env.reset(seed=seeds[i], options=options[i])
                infos = self._add_info(infos, env_info, i)
        self._observations = concatenate(self.single_observation_space, self._env_obs, self._observations)
        return self._observations, infos

    def call_at(self, indices: list[int] | None, name: str | None, args: tuple, kwargs: dict[str, Any]) -> list[Any]:
        """``call(name, *args, **kwargs)`` on the envs ``indices`` (``None``: all); ``name=None``: ``args[0](env)``."""
        if indices is None and name is not None:
            return list(self.call(name, *args, **kwargs))  # Gymnasium's own
        results = []
        for i in range(self.num_envs) if indices is None else indices:
            env = self.envs[i]
            self.envs.tracker.reached = i
            if name is None:
                results.append(args[0](user_env(env)))
            else:
                function = env.get_wrapper_attr(name)
                results.append(function(*args, **kwargs) if callable(function) else function)
        return results

    def set_attr_at(self, indices: list[int] | None, name: str, values: list[Any]) -> None:
        """``set_attr(name, values)`` on the envs ``indices`` (``None``: all), one value each."""
        if indices is None:
            self.set_attr(name, values)  # Gymnasium's own
            return
        for i, value in zip(indices, values, strict=True):
            env = self.envs[i]
            self.envs.tracker.reached = i
            env.set_wrapper_attr(name, value)

    def description(self) -> dict[str, Any]:
        """What the learner needs to know of these envs: per-env spaces, metadata and render mode."""
        return {
            "observation_spaces": [env.observation_space for env in self.envs],
            "action_spaces": [env.action_space for env in self.envs],
            "metadata": self.envs[0].metadata,
            "render_mode": self.render_mode,
            "enforces_order": [enforces_order(env) for env in self.envs],
        }


def reset_envs(envs: Any, seeds: list[int | None] | None, options: Any, mask: list[bool] | None) -> Any:
    """Reset a vector env's envs (those in ``mask``, if any): the observations.

    ``options`` is one dict for every env, or a list with one per env (Stable-Baselines3's
    ``set_options``), which ``SyncVectorEnv.reset`` cannot express:
    :meth:`RecordingVectorEnv.reset_each` then resets env by env, state for state.
    """
    if isinstance(options, list):
        obs, _ = envs.reset_each(seeds or [None] * envs.num_envs, options, mask)
        return obs
    if mask is not None:
        options = dict(options or {}, reset_mask=np.array(mask, dtype=np.bool_))
    obs, _ = envs.reset(seed=seeds, options=options)
    return obs


def enforces_order(env: Any) -> bool:
    """Whether ``env`` refuses a step before its first reset itself: Gymnasium's ``OrderEnforcing`` wraps it.

    ``gym.make`` adds that wrapper; an env built by its class does not, and ``SyncVectorEnv``
    then steps it before any reset, as clusterenv must too.
    """
    env = user_env(env)
    while isinstance(env, gymnasium.Wrapper):
        if isinstance(env, OrderEnforcing):
            return True
        env = env.env
    return False


def install_registry(specs: dict[str, bytes]) -> dict[str, EnvSpec]:
    """Know every env id the learner knew when it made the envs, before their factories run.

    An id registered only in the learner (``gym.register`` in the script, or a package such
    as ``ale_py`` registered there) would be unknown here, and a factory calling
    ``gym.make(id)`` would fail. ``specs`` maps each id to its pickled ``EnvSpec``; one that
    cannot be loaded here (its entry point's module is missing) is left out, and only a
    factory making that id fails. String entry points are imported when an env is made.
    Returns the specs it registered (those this process did not already have as they are).
    """
    installed = {}
    for env_id, blob in specs.items():
        try:
            spec: EnvSpec = pickle.loads(blob)
        except Exception as exc:
            logger.debug("Env id %r cannot be registered here: %s", env_id, exc)
            continue
        if gymnasium.registry.get(env_id) != spec:
            gymnasium.registry[env_id] = installed[env_id] = spec
    return installed


@contextlib.contextmanager
def learner_registry(specs: dict[str, bytes]) -> Iterator[None]:
    """:func:`install_registry` for a block that builds envs, without its echo in the warnings.

    A factory that registers its env ids itself (``import ale_py`` in CleanRL's ``make_env``)
    registers again the ids installed here, and Gymnasium warns "Overriding environment"
    for each: for ale-py, hundreds of warnings per worker. Such a warning is dropped where the id
    ends up with the very spec the learner had; any other warning of the block (an id
    registered differently here than in the learner included) is shown, after the block.
    """
    installed = install_registry(specs)
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            yield
    finally:  # outside catch_warnings: what is kept is shown as it would have been
        for warning in caught:
            overridden = _OVERRIDDEN.search(str(warning.message))
            if overridden is not None and overridden[1] in installed:
                if gymnasium.registry.get(overridden[1]) == installed[overridden[1]]:
                    continue
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


def build(
    env_blobs: list[bytes],
    observation_mode: Any,
    autoreset_mode: Any,
    tracker: EnvTracker,
    max_env_errors: int | None = None,
) -> RecordingVectorEnv:
    """A RecordingVectorEnv over the envs that the pickled factories ``env_blobs`` make.

    ``observation_mode`` is ``"same"``, ``"different"``, or a single observation space that
    every env's observation batches into (``SyncVectorEnv``'s ``(batch space, single space)`` form).
    ``tracker`` learns which env is being built, and later which env each loop reaches.
    ``max_env_errors``: under ``on_env_error="reset"``, each env is a :class:`ResettingEnv` allowing that many errors.
    """
    env_fns = [pickle.loads(blob) for blob in env_blobs]
    return build_from(env_fns, make_envs(env_fns, tracker), observation_mode, autoreset_mode, tracker, max_env_errors)


def build_from(
    env_fns: list[Callable[[], Any]],
    envs: list[Any],
    observation_mode: Any,
    autoreset_mode: Any,
    tracker: EnvTracker,
    max_env_errors: int | None = None,
) -> RecordingVectorEnv:
    """:func:`build` over envs already made by ``env_fns`` (which a ``ResettingEnv`` calls to rebuild one).

    A vector env among them (a unit, :mod:`clusterenv.worker.units`) is refused here: only a
    worker stepping its envs in its own process holds units.
    """
    for i, env in enumerate(envs):
        if isinstance(env, VectorEnv):
            raise TypeError(
                f"Env factory {i} of this worker made a vector env ({type(env).__name__}); vector envs (units) "
                "are stepped in the worker's own process: use procs_per_worker=1 (clusterenv-worker without --procs)."
            )
    if max_env_errors is not None:
        envs = [ResettingEnv(env, env_fn, max_env_errors) for env, env_fn in zip(envs, env_fns, strict=True)]
    if isinstance(observation_mode, gymnasium.Space):
        observation_mode = (batch_space(observation_mode, len(envs)), observation_mode)
    vector = RecordingVectorEnv(
        [functools.partial(_identity, env) for env in envs],
        copy=False,
        observation_mode=observation_mode,
        autoreset_mode=autoreset_mode,
    )
    vector._untracked = list(vector.envs)
    vector._timed = TimedEnvs(vector.envs, tracker.clock)
    vector.envs = TrackedEnvs(vector.envs, tracker)
    vector.info_log = []
    return vector


def make_envs(env_fns: list[Callable[[], Any]], tracker: EnvTracker) -> list[Any]:
    """Build the envs one by one, telling ``tracker`` which one is being built (a constructor may raise)."""
    envs = []
    for i, env_fn in enumerate(env_fns):
        tracker.reached = i
        envs.append(env_fn())
    return envs


def dumps(value: Any) -> bytes:
    """Per-step payloads (infos, non-array observations): plain pickle, else cloudpickle.

    Infos are plain data almost always, which pickle serializes several times faster;
    a lambda or a class defined in the learner's script needs cloudpickle.
    """
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return cloudpickle.dumps(value)


def _identity(value: Any) -> Any:
    return value
