"""What each row runs: a lockstep loop over one backend, one batch step (or one rollout) per call.

Every loop steps with actions drawn beforehand from the seeded batched action space, so the
timed part is the backend's own work. The acting rows run a small MLP: in the workers
(:class:`~clusterenv.PolicyRunner`) and, for comparison, in the learner over ``SyncVectorEnv``.
"""

from __future__ import annotations

import abc
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from clusterenv.errors import PolicyError
from clusterenv.policy.heads import Head, default_head

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "ActingLoop",
    "EnvPoolLoop",
    "LearnerActingLoop",
    "Loop",
    "VectorLoop",
    "acting_policy",
    "envpool_knows",
]

# Action batches drawn ahead and cycled: enough that no pattern in them matters to an env.
ACTION_BATCHES = 64


class Loop(abc.ABC):
    """One backend, ready to step; :meth:`step` advances every env and returns the env steps made."""

    @abc.abstractmethod
    def step(self) -> int:
        """Advance every env (one batch step, or one rollout) and return how many env steps that was."""

    @abc.abstractmethod
    def close(self) -> None:
        """End the backend's processes or threads."""


def _action_batches(action_space: spaces.Space, seed: int) -> list[Any]:
    action_space.seed(seed)
    return [action_space.sample() for _ in range(ACTION_BATCHES)]


class VectorLoop(Loop):
    """``envs.step`` with random actions: any Gymnasium ``VectorEnv`` (Sync, Async, ClusterEnv)."""

    def __init__(self, envs: gym.vector.VectorEnv, seed: int) -> None:
        self.envs = envs
        envs.reset(seed=seed)
        self._actions = _action_batches(envs.action_space, seed)
        self._t = 0

    def step(self) -> int:
        """One batch step with the next drawn actions."""
        self.envs.step(self._actions[self._t % ACTION_BATCHES])
        self._t += 1
        return self.envs.num_envs

    def close(self) -> None:
        """Close the envs."""
        self.envs.close()


def envpool_knows(env_id: str | None) -> bool:
    """Whether EnvPool is installed and has its own implementation of ``env_id``."""
    if env_id is None:
        return False
    try:
        import envpool
    except ImportError:
        return False
    return env_id in envpool.list_all_envs()


class EnvPoolLoop(Loop):
    """EnvPool's ``step`` (its C++ threads, its own implementation of the env) with random actions."""

    def __init__(self, env_id: str, num_envs: int, num_threads: int, seed: int) -> None:
        import envpool

        with warnings.catch_warnings():  # its spaces are built from float64 bounds, which Gymnasium warns about
            warnings.simplefilter("ignore")
            self.envs = envpool.make_gymnasium(env_id, num_envs=num_envs, num_threads=num_threads, seed=seed)
        self.envs.reset()
        space = self.envs.action_space
        space.seed(seed)
        self._actions = [np.stack([space.sample() for _ in range(num_envs)]) for _ in range(ACTION_BATCHES)]
        self._num_envs = num_envs
        self._t = 0

    def step(self) -> int:
        """One batch step with the next drawn actions."""
        self.envs.step(self._actions[self._t % ACTION_BATCHES])
        self._t += 1
        return self._num_envs

    def close(self) -> None:
        """Close the envs."""
        self.envs.close()


def acting_policy(observation_space: spaces.Space, action_space: spaces.Space) -> tuple[nn.Module, Head] | str:
    """A small MLP (two hidden layers of 64) and its head for these spaces, or why there is none.

    The MLP reads float ``Box`` observations, flattened; the head is the action space's
    :func:`~clusterenv.policy.heads.default_head`.
    """
    if not isinstance(observation_space, spaces.Box) or not np.issubdtype(observation_space.dtype, np.floating):
        return f"the MLP reads float Box observations, got {observation_space}"
    try:
        head = default_head(action_space)
    except PolicyError as exc:
        return str(exc)
    import torch
    from torch import nn

    torch.manual_seed(0)
    width = head.output_width(action_space)
    inputs = int(np.prod(observation_space.shape))
    mlp = nn.Sequential(
        nn.Flatten(), nn.Linear(inputs, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, width)
    )
    return mlp, head


class ActingLoop(Loop):
    """Workers act: one :meth:`~clusterenv.PolicyRunner.rollout` of ``rollout_steps`` steps per call."""

    def __init__(self, envs: Any, policy: nn.Module, head: Head, rollout_steps: int, seed: int) -> None:
        from clusterenv.learner.rollouts import LockstepRunner

        self.envs = envs
        self.runner = LockstepRunner(envs, policy, head=head, seed=seed)  # PolicyRunner(..., prefetch=0)
        self.rollout_steps = rollout_steps

    def step(self) -> int:
        """One batch step with the next drawn actions."""
        self.runner.rollout(self.rollout_steps)
        return self.rollout_steps * self.envs.num_envs

    def close(self) -> None:
        """Close the envs."""
        self.envs.close()


class LearnerActingLoop(Loop):
    """The loop workers acting replaces: the learner runs the same MLP and head, then steps ``envs``."""

    def __init__(self, envs: gym.vector.VectorEnv, policy: nn.Module, head: Head, seed: int) -> None:
        self.envs = envs
        self.policy = policy
        self.head = head
        self._obs, _ = envs.reset(seed=seed)
        self._rngs: Sequence[np.random.Generator] = [np.random.default_rng([seed, i]) for i in range(envs.num_envs)]

    def step(self) -> int:
        """The MLP on the last observations, then one batch step with the actions it sampled."""
        import torch

        with torch.no_grad():
            outputs = self.policy(torch.as_tensor(self._obs, dtype=torch.float32)).numpy()
        actions, _ = self.head.act(outputs, self._rngs)
        self._obs, *_ = self.envs.step(self.head.to_env(actions, self.envs.single_action_space))
        return self.envs.num_envs

    def close(self) -> None:
        """Close the envs."""
        self.envs.close()
