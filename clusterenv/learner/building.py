"""Building a ``ClusterEnv``'s envs in its workers: the INITs, the spaces the workers report, the batch.

Each worker gets its slice's pickled factories and builds them as Gymnasium would; the
learner then derives the batch's spaces exactly as ``SyncVectorEnv`` does from the envs'
own spaces, and preallocates the batch that every reset and step fills (observations in
shared memory with local workers where they are large enough to pay).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gymnasium import spaces
from gymnasium.vector import AutoresetMode

from clusterenv.learner.own_envs import LearnerEnvs
from clusterenv.learner.pool import WorkerPool
from clusterenv.learner.step_buffers import BatchBuffers, share_steps, share_with_local_workers
from clusterenv.learner.validation import worker_context
from clusterenv.wire.contract import vector_spaces
from clusterenv.wire.messages import EnvsMeta

__all__ = ["BuiltEnvs", "build_envs"]


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


def build_envs(
    pool: WorkerPool,
    slices: list[slice],
    pickled_fns: list[bytes],
    *,
    autoreset_mode: AutoresetMode,
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
        slices: the envs of each worker.
        pickled_fns: every env's factory, pickled.
        autoreset_mode: Gymnasium's autoreset mode, applied inside the workers.
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
    pool.new_call()
    for w, sl in enumerate(slices):
        meta = EnvsMeta(
            env_offset=sl.start,
            autoreset_mode=autoreset_mode.value,
            observation_mode="custom" if custom else observation_mode,
            procs_per_worker=procs_per_worker,
            max_env_errors=max_env_errors,
        )
        pool.send_init(w, meta, [context, *pickled_fns[sl]])
    replies = pool.gather(range(len(slices)), "building envs", timeout)
    descriptions = [pool.loads(replies[w].blobs[0]) for w in range(len(slices))]
    if own is not None:
        descriptions.insert(0, own.description())
    obs_spaces = [s for d in descriptions for s in d["observation_spaces"]]
    action_spaces = [s for d in descriptions for s in d["action_spaces"]]
    single_observation_space, observation_space, single_action_space, action_space = vector_spaces(
        obs_spaces, action_spaces, observation_mode
    )
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
        own.observe_into(buffers.observations)
    return BuiltEnvs(
        metadata={**descriptions[0]["metadata"], "autoreset_mode": autoreset_mode},
        render_mode=descriptions[0]["render_mode"],
        first_env_enforces_order=bool(descriptions[0]["enforces_order"][0]),
        single_observation_space=single_observation_space,
        observation_space=observation_space,
        single_action_space=single_action_space,
        action_space=action_space,
        buffers=buffers,
    )
