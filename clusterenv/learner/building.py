"""Building a ``ClusterEnv``'s envs in its workers: the INITs, the spaces the workers report, the batch.

Each worker gets its slice of the pickled factories and builds them as Gymnasium would; the
learner then derives the batch's spaces exactly as ``SyncVectorEnv`` does from the envs'
own spaces, and preallocates the batch that every reset and step fills (observations in
shared memory with local workers where they are large enough to pay).

A factory may make a vector env, a *unit* (:mod:`clusterenv.worker.units`): how many envs
each factory made is only known once the workers report it, so the workers are sent slices
of the factories, and the slices of the envs follow from their reports (with each worker
told where its envs sit, a PLACE, and its kept INIT corrected for a replacement).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gymnasium import spaces
from gymnasium.vector import AutoresetMode

from clusterenv.learner.own_envs import LearnerEnvs
from clusterenv.learner.pool import OnLoss, WorkerPool
from clusterenv.learner.step_buffers import BatchBuffers, share_steps, share_with_local_workers
from clusterenv.learner.validation import worker_context
from clusterenv.wire.contract import vector_spaces
from clusterenv.wire.messages import EnvsMeta, PlaceMeta
from clusterenv.wire.protocol import Kind

__all__ = ["BuiltEnvs", "build_envs", "envs_served"]


@dataclass(frozen=True)
class BuiltEnvs:
    """What the workers' envs are, as a ``VectorEnv`` shows them, and the batch they fill."""

    metadata: dict[str, Any]
    render_mode: str | None
    #: Whether env 0 refuses a step before its first reset itself (``OrderEnforcing``, as ``gym.make`` wraps):
    #: ``SyncVectorEnv`` then raises ``ResetNeeded`` before any env steps.
    first_env_enforces_order: bool
    single_observation_space: spaces.Space
    observation_space: spaces.Space
    single_action_space: spaces.Space
    action_space: spaces.Space
    buffers: BatchBuffers
    #: The envs of each worker (global indices).
    slices: list[slice]
    #: The envs of each entry of ``env_fns`` (a single env's: one).
    units: list[slice]
    autoreset_mode: AutoresetMode


def build_envs(
    pool: WorkerPool,
    entry_slices: list[slice],
    pickled_fns: list[bytes],
    *,
    autoreset_mode: AutoresetMode | None,
    observation_mode: Any,
    procs_per_worker: int,
    max_env_errors: int | None,
    shared_memory: bool,
    spin_us: float | None,
    timeout: float,
    own: LearnerEnvs | None = None,
) -> BuiltEnvs:
    """Send every worker its INIT, wait for the envs to be built, and derive the batch from what they report.

    Args:
        pool: the joined workers.
        entry_slices: the factories of each worker (indices in ``pickled_fns``).
        pickled_fns: every factory, pickled.
        autoreset_mode: Gymnasium's autoreset mode, applied inside the workers to single envs
            (``None``: ``NEXT_STEP``); vector envs (units) have their own, which must agree.
        observation_mode: ``"same"``, ``"different"`` or ``(observation_space, single_observation_space)``.
        procs_per_worker: env processes per worker.
        max_env_errors: under ``on_env_error="reset"``, the errors one env may raise within 1,000
            of its steps (``None``: errors raise).
        shared_memory: whether workers on this host may step through shared memory
            (``step_buffers.share_steps``), or else write large observations into it.
        spin_us: how each side of the shared step path waits (:class:`~clusterenv.learner.shared_steps.SharedSteps`).
        timeout: seconds for every worker to build its envs.
        own: the envs the learner steps itself, built already (envs ``0..k-1``; the slices follow).
    """
    custom = isinstance(observation_mode, tuple)
    context = worker_context(observation_mode[1] if custom else None)
    single_mode = AutoresetMode.NEXT_STEP if autoreset_mode is None else autoreset_mode
    pool.new_call()
    metas = []
    for w, sl in enumerate(entry_slices):
        meta = EnvsMeta(
            env_offset=sl.start,
            entry_offset=sl.start,
            autoreset_mode=single_mode.value,
            observation_mode="custom" if custom else observation_mode,
            procs_per_worker=procs_per_worker,
            max_env_errors=max_env_errors,
        )
        metas.append(meta)
        pool.send_init(w, meta, [context, *pickled_fns[sl]])
    replies = pool.gather(range(len(entry_slices)), "building envs", timeout)
    descriptions = [pool.loads(replies[w].blobs[0]) for w in range(len(entry_slices))]
    if own is not None:  # envs 0..k-1, single envs: the entries before the workers'
        descriptions.insert(0, own.description())
    units = _entry_slices(descriptions)
    mode = _units_autoreset_mode(descriptions, units, autoreset_mode, single_mode)
    obs_spaces = [s for d in descriptions for s in d["observation_spaces"]]
    action_spaces = [s for d in descriptions for s in d["action_spaces"]]
    if any(u.stop - u.start != 1 or m is not None for u, m in zip(units, _entry_modes(descriptions), strict=True)):
        _check_unit_spaces(units, obs_spaces, action_spaces)
    single_observation_space, observation_space, single_action_space, action_space = vector_spaces(
        obs_spaces, action_spaces, observation_mode
    )
    slices = [slice(units[sl.start].start, units[sl.stop - 1].stop) for sl in entry_slices]
    _place(pool, slices, entry_slices, metas, pickled_fns, context, timeout)
    same = observation_mode == "same" or custom
    region = shared = None
    if same and shared_memory:
        region = share_steps(pool, single_observation_space, single_action_space, slices, timeout, spin_us)
        shared = (
            region.observations
            if region is not None
            else share_with_local_workers(pool, single_observation_space, slices, timeout)
        )
    num_envs = slices[-1].stop
    buffers = BatchBuffers(
        single_observation_space,
        observation_space,
        num_envs,
        pool.loads,
        observations=shared,
        step_fields=None if region is None else region.step_fields,
    )
    if own is not None:
        own.write_into(buffers.observations, (buffers.rewards, buffers.terminations, buffers.truncations))
    return BuiltEnvs(
        metadata={**descriptions[0]["metadata"], "autoreset_mode": mode},
        render_mode=descriptions[0]["render_mode"],
        first_env_enforces_order=bool(descriptions[0]["enforces_order"][0]),
        single_observation_space=single_observation_space,
        observation_space=observation_space,
        single_action_space=single_action_space,
        action_space=action_space,
        buffers=buffers,
        slices=slices,
        units=units,
        autoreset_mode=mode,
    )


def envs_served(serves: list[int], slices: list[slice], units: list[slice]) -> dict[str, Any]:
    """The envs a worker process steps for the workers it ``serves``: ``env_ids``; ``units`` as ``(first, last)``.

    ``slices``: each worker's envs; ``units``: each entry of ``env_fns``'s envs.
    """
    return {
        "env_ids": [i for w in serves for i in range(slices[w].start, slices[w].stop)],
        "units": [(u.start, u.stop - 1) for w in serves for u in units if slices[w].start <= u.start < slices[w].stop],
    }


def _entry_slices(descriptions: list[dict[str, Any]]) -> list[slice]:
    """The envs of each entry of ``env_fns``, from how many envs each worker's factories made."""
    units, start = [], 0
    for d in descriptions:
        for count in d.get("entry_envs", [1] * len(d["observation_spaces"])):
            units.append(slice(start, start + count))
            start += count
    return units


def _entry_modes(descriptions: list[dict[str, Any]]) -> list[str | None]:
    """Each entry's own autoreset mode: a unit's, or ``None`` for a single env (it takes the ``ClusterEnv``'s)."""
    return [m for d in descriptions for m in d.get("entry_modes", [None] * len(d["observation_spaces"]))]


def _units_autoreset_mode(
    descriptions: list[dict[str, Any]], units: list[slice], asked: AutoresetMode | None, single_mode: AutoresetMode
) -> AutoresetMode:
    """The one autoreset mode of every entry: the units' own, which must agree with each other and with ``asked``."""
    modes = _entry_modes(descriptions)
    declared: dict[str, list[int]] = {}
    for entry, m in enumerate(modes):
        if m is not None:
            declared.setdefault(m, []).append(entry)
    if not declared:
        return single_mode
    if len(declared) > 1:
        raise ValueError(
            "Vector envs in `env_fns` must share one autoreset mode (their `metadata['autoreset_mode']`), got "
            + "; ".join(f"{m} for entries {_names(entries)}" for m, entries in declared.items())
            + "."
        )
    ((mode_value, entries),) = declared.items()
    mode = AutoresetMode(mode_value)
    if asked is not None and asked is not mode:
        raise ValueError(
            f"`autoreset_mode` is {asked.value}, but the vector envs of entries {_names(entries)} autoreset in "
            f"{mode.value} (their `metadata['autoreset_mode']`); leave `autoreset_mode` out to take theirs."
        )
    singles = [entry for entry, m in enumerate(modes) if m is None]
    if singles and mode is not single_mode:
        raise ValueError(
            f"The single envs of entries {_names(singles)} autoreset in {single_mode.value}, the vector envs of "
            f"entries {_names(entries)} in {mode.value}: pass `autoreset_mode={mode.value!r}` to step them alike."
        )
    return mode


def _check_unit_spaces(units: list[slice], obs_spaces: list[spaces.Space], action_spaces: list[spaces.Space]) -> None:
    """Every entry's single spaces must be entry 0's: a batch has one observation and one action space."""
    for kind, per_env in (("observation", obs_spaces), ("action", action_spaces)):
        expected = per_env[units[0].start]
        differing = [entry for entry, u in enumerate(units) if per_env[u.start] != expected]
        if differing:
            got = per_env[units[differing[0]].start]
            raise ValueError(
                f"Every entry of `env_fns` must have the same single {kind} space; entry 0 has {expected}, but "
                f"entries {_names(differing)} differ (entry {differing[0]}: {got})."
            )


def _names(entries: list[int]) -> str:
    return ", ".join(str(e) for e in entries[:8]) + (f" (and {len(entries) - 8} more)" if len(entries) > 8 else "")


def _place(
    pool: WorkerPool,
    slices: list[slice],
    entry_slices: list[slice],
    metas: list[EnvsMeta],
    pickled_fns: list[bytes],
    context: bytes,
    timeout: float,
) -> None:
    """Tell each worker whose envs do not start at its first entry's index where they do, and keep that for its INIT."""
    moved = [w for w, (sl, entries) in enumerate(zip(slices, entry_slices, strict=True)) if sl.start != entries.start]
    if not moved:
        return
    for w in moved:
        pool.members.keep_init(
            w, EnvsMeta(**{**metas[w], "env_offset": slices[w].start}), [context, *pickled_fns[entry_slices[w]]]
        )
    pool.send_each(Kind.PLACE, {w: (PlaceMeta(env_offset=slices[w].start), (), ()) for w in moved}, OnLoss.REPLAY)
    pool.gather(moved, "placing envs", timeout)
