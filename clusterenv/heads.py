"""Action distributions over a discrete action space, built from a policy's raw outputs.

A policy maps a batch of observations to one number per action: logits for an actor
(PPO), Q-values for a critic (DQN). A *head* turns those outputs into the distribution
that acts, and the same head is used on both ends of a KL check, so that the learner's
and the worker's outputs are compared as distributions, never as raw numbers.

Heads are numpy-only (no torch), frozen, and travel to workers as a small map.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from clusterenv.errors import PolicyError

__all__ = ["Categorical", "EpsilonGreedy", "Greedy", "Head", "head_from_meta"]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - np.max(x, axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


class Head:
    """Base class: ``log_probs`` defines the distribution, ``act`` samples from it."""

    name: ClassVar[str]

    def log_probs(self, outputs: np.ndarray) -> np.ndarray:
        """Log-probabilities ``(B, A)`` in float64 for raw policy outputs ``(B, A)``; ``-inf`` marks impossible actions."""
        raise NotImplementedError

    def act(self, outputs: np.ndarray, uniforms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Actions ``(B,)`` int64 and their log-probabilities ``(B,)`` float32.

        ``uniforms`` holds one draw from U[0, 1) per row (from that env's own generator), used
        by inverse-CDF sampling, so that a sample depends only on that env's outputs and draw.
        """
        log_p = self.log_probs(outputs)
        cdf = np.cumsum(np.exp(log_p), axis=-1)
        # Comparing against the row total keeps rounding in the cumulative sum from overshooting.
        actions = (uniforms[:, None] * cdf[:, -1:] >= cdf).sum(axis=-1)
        actions = np.minimum(actions, outputs.shape[-1] - 1).astype(np.int64)
        return actions, np.take_along_axis(log_p, actions[:, None], axis=-1)[:, 0].astype(np.float32)

    def to_meta(self) -> dict[str, Any]:
        """The head as a small msgpack-able map (inverse of :func:`head_from_meta`)."""
        return {"name": self.name, **vars(self)}


@dataclass(frozen=True)
class Categorical(Head):
    """``softmax(outputs / temperature)``: the usual actor head; with Q-values, a Boltzmann policy.

    Args:
        temperature: divides the outputs before the softmax; must be positive and finite.
    """

    name: ClassVar[str] = "categorical"
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and 0 < self.temperature < math.inf):
            raise PolicyError(f"`temperature` must be a positive finite number, got {self.temperature!r}.")

    def log_probs(self, outputs: np.ndarray) -> np.ndarray:
        """Log-softmax of the outputs divided by the temperature."""
        return _log_softmax(np.asarray(outputs, dtype=np.float64) / self.temperature)


@dataclass(frozen=True)
class Greedy(Head):
    """Acts by ``argmax(outputs)`` (first index on ties), for evaluation and deterministic tests.

    Its recorded log-probabilities and its KL use ``softmax(outputs)``: a one-hot distribution
    would make every change of greedy action an infinite KL.
    """

    name: ClassVar[str] = "greedy"

    def log_probs(self, outputs: np.ndarray) -> np.ndarray:
        """Log-softmax of the outputs (temperature 1)."""
        return _log_softmax(np.asarray(outputs, dtype=np.float64))

    def act(self, outputs: np.ndarray, uniforms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The argmax actions; ``uniforms`` is ignored."""
        actions = np.argmax(outputs, axis=-1).astype(np.int64)
        log_p = self.log_probs(outputs)
        return actions, np.take_along_axis(log_p, actions[:, None], axis=-1)[:, 0].astype(np.float32)


@dataclass(frozen=True)
class EpsilonGreedy(Head):
    """For Q-values: ``argmax`` with probability ``1 - epsilon``, else a uniform action.

    The distribution is ``epsilon / A`` everywhere plus ``1 - epsilon`` on the first argmax,
    so with ``epsilon=0`` the KL between two copies is infinite wherever their greedy
    actions differ (and zero elsewhere).

    Args:
        epsilon: exploration probability in [0, 1].
    """

    name: ClassVar[str] = "epsilon_greedy"
    epsilon: float = 0.05

    def __post_init__(self) -> None:
        if not (isinstance(self.epsilon, (int, float)) and 0.0 <= self.epsilon <= 1.0):
            raise PolicyError(f"`epsilon` must be a number in [0, 1], got {self.epsilon!r}.")

    def log_probs(self, outputs: np.ndarray) -> np.ndarray:
        """Log of ``epsilon / A + (1 - epsilon) * onehot(argmax)``."""
        outputs = np.asarray(outputs)
        n = outputs.shape[-1]
        probs = np.full(outputs.shape, self.epsilon / n, dtype=np.float64)
        np.put_along_axis(probs, np.argmax(outputs, axis=-1)[..., None], 1.0 - self.epsilon + self.epsilon / n, -1)
        with np.errstate(divide="ignore"):
            return np.log(probs)


_HEADS: dict[str, type[Head]] = {cls.name: cls for cls in (Categorical, Greedy, EpsilonGreedy)}


def head_from_meta(meta: dict[str, Any]) -> Head:
    """Rebuild a head from :meth:`Head.to_meta`."""
    fields = dict(meta)
    name = fields.pop("name")
    if name not in _HEADS:
        raise PolicyError(f"Unknown action head {name!r}; expected one of {sorted(_HEADS)}.")
    return _HEADS[name](**fields)
