"""Replacing lost workers (``ClusterEnv(on_worker_failure="restart")``).

When a worker is lost (its process exited, or it stopped answering heartbeats), the
learner first collects every other worker's reply, so no other env's data is lost or
duplicated. Then, for each lost worker, it ends the old process if it can, starts a
replacement through the launcher, waits for it to join, and builds the same env slice
from the same factories. What the affected envs report depends on the command that was
interrupted:

* ``reset``, ``call``, ``get_attr``, ``set_attr``: the command is replayed on the new envs,
  so a seeded reset returns exactly what the lost worker would have returned.
* ``step``: the episode that was running is reported as **truncated**, with reward 0,
  ``terminated=False``, and ``infos["worker_restarted"]`` set (with its ``_worker_restarted``
  mask) for the affected envs only. The observation follows the autoreset mode:

  - ``NEXT_STEP``: the last observation the learner received for the env (the final
    observation of the cut episode is lost with the worker); the env's next ``step``
    is its autoreset step (action ignored, reset observation, reward 0), exactly as
    after any truncation.
  - ``SAME_STEP``: the first observation of a new episode, with
    ``infos["final_obs"]`` = the last observation received and ``infos["final_info"]`` = ``{}``.
  - ``DISABLED``: the last observation received; reset the env (``reset_mask``) before
    stepping it again, as after any truncation.

  Replacement envs are not re-seeded: their new episodes use fresh entropy, so a run
  with a restart is not reproducible (every other env's stream is unchanged).

State that extensions installed on the lost worker with their own commands (policies)
is not restored; commands other than the ones above cannot be replayed and raise
``WorkerLostError``.
"""

from __future__ import annotations

import logging
import pickle
from copy import deepcopy
from typing import TYPE_CHECKING, Any

from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import concatenate, iterate

from clusterenv.protocol import Kind, Message

if TYPE_CHECKING:
    from clusterenv.env import ClusterEnv

__all__ = ["WORKER_RESTARTED_KEY", "replace_workers", "report_interrupted"]

logger = logging.getLogger(__name__)

WORKER_RESTARTED_KEY = "worker_restarted"
# Commands whose effect on fresh envs is what the user asked for, so they can simply be sent again.
_REPLAYABLE = frozenset({Kind.RESET, Kind.CALL, Kind.SET_ATTR})


def replace_workers(env: ClusterEnv, lost: list[int], replies: dict[int, Message], doing: str) -> None:
    """Replace each lost worker, then replay its last command into ``replies`` or mark its envs interrupted.

    A replacement that fails in turn raises: restarts do not loop.
    """
    env._recovering = True
    try:
        for worker_id in lost:
            kind, meta, arrays, blobs = env._last_sent[worker_id]
            if kind is not Kind.STEP and kind not in _REPLAYABLE:
                raise env._lost(worker_id, f"{doing} ({kind.name} cannot be replayed on a replacement worker)")
            _restart(env, worker_id)
            if kind is Kind.STEP:
                env._interrupted[worker_id] = _prepare_interrupted(env, worker_id)
            else:
                env._send(worker_id, kind, meta, arrays, blobs)
                replies[worker_id] = env._gather([worker_id], doing, env.timeout)[worker_id]
    finally:
        env._recovering = False


def _restart(env: ClusterEnv, worker_id: int) -> None:
    sl = env._slices[worker_id]
    logger.warning("Starting a replacement for worker %d (envs %d..%d).", worker_id, sl.start, sl.stop - 1)
    env._launcher.kill(worker_id)
    env._monitor.forget(worker_id)
    old = env._identities.pop(worker_id, None)
    env._peers.pop(old or b"", None)
    env._launcher.start([worker_id], env.address, env._channel.key)
    env._join([worker_id], env._start_timeout)
    env._failed.discard(worker_id)
    env._send(worker_id, Kind.INIT, env._init_meta(worker_id, replacement=True), blobs=env._pickled_fns[sl])
    env._gather([worker_id], f"rebuilding the envs of worker {worker_id}", env._start_timeout)


def _prepare_interrupted(env: ClusterEnv, worker_id: int) -> Message | None:
    """Under SAME_STEP the new episode starts now: reset the replacement's envs and keep the reply."""
    if env.autoreset_mode is not AutoresetMode.SAME_STEP:
        return None
    sl = env._slices[worker_id]
    env._send(worker_id, Kind.RESET, {"seeds": [None] * (sl.stop - sl.start), "mask": None})
    return env._gather([worker_id], "resetting the envs of a replacement worker", env.timeout)[worker_id]


def report_interrupted(env: ClusterEnv, infos: dict[str, Any]) -> dict[str, Any]:
    """Overwrite the step results of interrupted envs with the truncation described in the module docstring."""
    for worker_id, reset_reply in sorted(env._interrupted.items()):
        sl = env._slices[worker_id]
        env._rewards[sl] = 0.0
        env._terminations[sl] = False
        env._truncations[sl] = True
        reset_infos: dict[int, list[dict[str, Any]]] = {}
        if reset_reply is not None:
            final_obs = _env_observations(env, sl)
            _write_observations(env, sl, reset_reply)
            if reset_reply.blobs[0]:
                for local_index, env_info in pickle.loads(reset_reply.blobs[0]):
                    reset_infos.setdefault(sl.start + local_index, []).append(env_info)
        for index in range(sl.start, sl.stop):
            if reset_reply is not None:
                infos = env._add_info(infos, {"final_obs": final_obs[index - sl.start], "final_info": {}}, index)
                for env_info in reset_infos.get(index, []):
                    infos = env._add_info(infos, env_info, index)
            infos = env._add_info(infos, {WORKER_RESTARTED_KEY: True}, index)
    env._interrupted.clear()
    return infos


def _env_observations(env: ClusterEnv, sl: slice) -> list[Any]:
    """Copies of the last observations received for the envs in ``sl``."""
    if not env._array_obs:
        return deepcopy(env._env_obs[sl])
    every = list(iterate(env.observation_space, env._observations))
    return [deepcopy(obs) for obs in every[sl]]


def _write_observations(env: ClusterEnv, sl: slice, reply: Message) -> None:
    if env._array_obs:
        for leaf, part in zip(env._obs_leaves, reply.arrays, strict=True):
            leaf[sl] = part
    else:
        env._env_obs[sl] = pickle.loads(reply.blobs[1])
        env._observations = concatenate(env.single_observation_space, env._env_obs, env._observations)  # type: ignore[arg-type]
