"""Small torch policies for the local-policy tests (importable by workers, so by reference)."""

from __future__ import annotations

import math
import threading

import numpy as np
import torch
from torch import nn

from clusterenv.policy.strategies import APS, SyncStrategy


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


class DictPolicy(nn.Module):
    """Reads every leaf of ``RichSpacesEnv``'s Dict observations, and refuses them in the wrong dtype."""

    def __init__(self, num_actions: int, image_shape: tuple[int, ...] = (6, 5, 3), seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.image = nn.Linear(math.prod(image_shape), num_actions)
        self.box = nn.Linear(3, num_actions)
        self.index = nn.Embedding(7, num_actions)  # Discrete(7, start=-2)
        self.flags = nn.Linear(4, num_actions)
        self.grid = nn.Linear(2, num_actions)

    def forward(self, obs: dict[str, torch.Tensor | tuple[torch.Tensor, ...]]) -> torch.Tensor:
        image, (box, index), flags, grid = obs["image"], obs["state"], obs["flags"], obs["grid"]
        if image.dtype != torch.uint8 or box.dtype != torch.float32 or index.dtype != torch.int64:
            raise TypeError(f"image {image.dtype}, box {box.dtype}, index {index.dtype}")
        return (
            self.image(image.flatten(1).float() / 255)
            + self.box(box)
            + self.index(index + 2)
            + self.flags(flags.float())
            + self.grid(grid.float())
        )


class TuplePolicy(nn.Module):
    """Blackjack's Tuple(Discrete(32), Discrete(11), Discrete(2)): one embedding per leaf, summed."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embeddings = nn.ModuleList(nn.Embedding(size, 2) for size in (32, 11, 2))

    def forward(self, obs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return sum((embed(leaf) for embed, leaf in zip(self.embeddings, obs, strict=True)), torch.zeros(()))


def structured_outputs(policy: nn.Module, obs) -> np.ndarray:
    """The policy's outputs on a batch of dict/tuple observations, leaves passed as the workers pass them."""

    def tensors(value):
        if isinstance(value, dict):
            return {key: tensors(item) for key, item in value.items()}
        if isinstance(value, tuple):
            return tuple(tensors(item) for item in value)
        value = np.asarray(value)
        return torch.as_tensor(value.astype(np.float32) if value.dtype.kind == "f" else value)

    with torch.no_grad():
        return policy(tensors(obs)).numpy()


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


class EveryOtherVersion(SyncStrategy):
    """A user's strategy written against ``should_pull``'s three keywords: pull once two versions behind."""

    def should_pull(self, *, local_version: int, learner_version: int, kl: float | None) -> bool:
        return learner_version - local_version >= 2


class OwnAPS(APS):
    """A user's APS subclass whose ``should_pull`` predates the ``movement`` keyword."""

    def should_pull(self, *, local_version: int, learner_version: int, kl: float | None) -> bool:
        return super().should_pull(local_version=local_version, learner_version=learner_version, kl=kl)
