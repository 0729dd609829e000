"""Small torch policies for the local-policy tests (importable by workers, so by reference)."""

from __future__ import annotations

import threading

import torch
from torch import nn


class BiasPolicy(nn.Module):
    """Outputs ``bias`` for every observation: the KL between two copies has a closed form."""

    def __init__(self, num_actions: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(num_actions))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.bias.expand(obs.shape[0], -1)

    def set(self, *values: float) -> BiasPolicy:
        with torch.no_grad():
            self.bias.copy_(torch.tensor(values))
        return self


class FlatOutputPolicy(nn.Module):
    """Returns one number per observation instead of one per action."""

    def __init__(self, obs_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(obs_size, 1)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.linear(obs)[:, 0]


class LockedPolicy(nn.Module):
    """Holds a lock, which no pickler can serialize."""

    def __init__(self, obs_size: int, num_actions: int) -> None:
        super().__init__()
        self.linear = nn.Linear(obs_size, num_actions)
        self.lock = threading.Lock()

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.linear(obs)


def linear_policy(obs_size: int, num_actions: int, seed: int) -> nn.Module:
    """A seeded ``nn.Linear``: obs-dependent, deterministic, cheap."""
    torch.manual_seed(seed)
    return nn.Linear(obs_size, num_actions)


def pole_policy(sign: float) -> nn.Module:
    """CartPole: logit of pushing right is ``sign * (angle + angular velocity)``; -1 and +1 disagree."""
    policy = nn.Linear(4, 2)
    with torch.no_grad():
        policy.weight.copy_(torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, sign, sign]]))
        policy.bias.zero_()
    return policy


def outputs(policy: nn.Module, obs) -> torch.Tensor:
    """The policy's outputs on a numpy batch of any leading shape, as numpy float32."""
    flat = torch.as_tensor(obs).reshape(-1, obs.shape[-1])
    with torch.no_grad():
        return policy(flat).reshape(*obs.shape[:-1], -1).numpy()
