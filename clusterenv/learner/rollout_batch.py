"""``RolloutBatch``: the transitions a :class:`~clusterenv.learner.rollouts.PolicyRunner` hands to the learner."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

if TYPE_CHECKING:
    import torch

    #: What ``as_tensors`` makes of an observation field: a tensor, or a dict/tuple tree of them.
    TensorTree: TypeAlias = torch.Tensor | dict[str, "TensorTree"] | tuple["TensorTree", ...]

__all__ = ["ObsTree", "RolloutBatch"]

#: An observation field: one array, or for ``Dict``/``Tuple`` spaces a dict/tuple of them, nested as the space.
ObsTree: TypeAlias = np.ndarray | dict[str, "ObsTree"] | tuple["ObsTree", ...]


@dataclass
class RolloutBatch:
    """``T`` steps of every env, as numpy arrays (``as_tensors`` converts), in step-mode order.

    ``obs[t]`` is what the acting policy saw at step ``t``; ``actions[t]``, ``rewards[t]``,
    ``terminations[t]``, ``truncations[t]`` and ``infos[t]`` are exactly what
    ``envs.step(actions[t])`` would have returned from there, and ``obs[t + 1]`` (or
    ``next_obs`` after the last step) is the observation it returned. Env ``i`` is column
    ``i`` everywhere, as in step mode.

    NEXT_STEP autoreset (the default): the step after a done is a *reset step*, marked in
    ``autoreset[t]``: ``obs[t]`` is the last observation of the ended episode, the env
    ignored ``actions[t]`` and reset, ``rewards[t]`` is 0, both done flags are False and
    ``obs[t + 1]`` is the first observation of the new episode. Drop reset steps from the
    loss; a truncated step ``t`` bootstraps from ``obs[t + 1]``, its true last observation.
    In SAME_STEP mode ``autoreset`` is all False and last observations are in the infos.

    A *fragment* (:meth:`PolicyRunner.fragments`) is the same for the envs of one worker:
    column ``j`` is env ``env_ids[j]``.

    Observations keep the structure and dtypes of the observation space: for a ``Dict`` or
    ``Tuple`` space ``obs`` and ``next_obs`` are a dict (keys in space order) or tuple of
    arrays, nested as the space is, each leaf shaped ``(T, N, *leaf_shape)`` (``(N, ...)``
    for ``next_obs``) in the leaf's own dtype (an image stays uint8).

    Attributes:
        obs: ``(T, N, *obs_shape)``, the observation dtype; a dict/tuple of such arrays for ``Dict``/``Tuple`` spaces.
        actions: ``(T, N, *action_shape)``, the head's samples (Discrete: int64 indices from 0;
            the env received ``head.to_env(actions)``, e.g. plus the space's ``start``, or
            clipped to a Box).
        logprobs: ``(T, N)`` float32, log-probability of each action under the acting copy.
        logits: ``(T, N, width)`` float32, the acting copy's raw outputs (logits, Q-values, means and log-stds).
        rewards: ``(T, N)`` float64.
        terminations: ``(T, N)`` bool.
        truncations: ``(T, N)`` bool.
        autoreset: ``(T, N)`` bool, True on NEXT_STEP reset steps.
        policy_versions: ``(T, N)`` int64, the learner version of the weights that acted at each step.
        next_obs: ``(N, *obs_shape)``, the observation after the last step (structured as ``obs``).
        infos: ``T`` step-mode info dicts (``episode`` statistics if the envs record them).
        learner_version: the latest published version when the batch was handed to the learner;
            ``learner_version - policy_versions`` is each step's policy lag.
        env_ids: ``(N,)`` the global index of each column's env.
    """

    obs: ObsTree
    actions: np.ndarray
    logprobs: np.ndarray
    logits: np.ndarray
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    autoreset: np.ndarray
    policy_versions: np.ndarray
    next_obs: ObsTree
    infos: list[dict[str, Any]] = field(repr=False)
    learner_version: int = 0
    env_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def num_steps(self) -> int:
        """``T``."""
        return int(self.actions.shape[0])

    @property
    def num_envs(self) -> int:
        """``N``."""
        return int(self.actions.shape[1])

    def as_tensors(self, device: str | torch.device | None = None) -> dict[str, TensorTree]:
        """Every array field as a torch tensor on ``device`` (same dtypes; bools stay bool).

        ``obs`` and ``next_obs`` of a ``Dict``/``Tuple`` space become a dict/tuple of tensors.
        """
        return {
            f.name: _as_tensors(getattr(self, f.name), device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), (np.ndarray, dict, tuple)) and f.name != "env_ids"
        }

    def episodes(self) -> list[tuple[int, int, float, int]]:
        """``(step, env, return, length)`` of each episode that ended, from ``RecordEpisodeStatistics`` infos.

        Under SAME_STEP autoreset the statistics are read from ``infos[t]["final_info"]``.
        """
        ended = []
        for t, step_info in enumerate(self.infos):
            for info in (step_info, step_info.get("final_info", {})):
                if "_episode" not in info:
                    continue
                stats = info["episode"]
                for env in np.flatnonzero(info["_episode"]):
                    ended.append((t, int(env), float(stats["r"][env]), int(stats["l"][env])))
        return ended


def _as_tensors(value: ObsTree, device: str | torch.device | None) -> TensorTree:
    import torch

    if isinstance(value, np.ndarray):
        return torch.as_tensor(value, device=device)
    if isinstance(value, dict):
        return {key: _as_tensors(item, device) for key, item in value.items()}
    return tuple(_as_tensors(item, device) for item in value)
