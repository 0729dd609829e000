"""Action distributions built from a policy's raw outputs, one head per Gymnasium action space.

A policy maps a batch of observations to a row of numbers per observation: logits for an
actor, Q-values for a critic, means and log standard deviations for a continuous actor. A
*head* turns those outputs into the distribution that acts, and the same head is used on
both ends of a KL check, so that the learner's and the worker's outputs are compared as
distributions, never as raw numbers. Every head has an exact, closed-form KL.

==============================  ========================  ===============================  ==========================
head                            action space              outputs per row                  action sent to the env
==============================  ========================  ===============================  ==========================
``Categorical``, ``Greedy``,    ``Discrete(n, start)``    ``n`` logits (or Q-values)       index ``+ start``
``EpsilonGreedy``
``MultiCategorical``            ``MultiDiscrete(nvec)``   ``sum(nvec)`` logits, the        indices ``+ start``
                                                          sub-actions' concatenated
``Bernoulli``                   ``MultiBinary(n)``        ``n`` logits, one per bit        the bits
``Gaussian``                    ``Box``                   ``2A``: ``A`` means, then        clipped to ``[low, high]``
                                                          ``A`` log standard deviations
``TanhGaussian``                ``Box``, finite bounds    ``2A``, as ``Gaussian``          ``tanh`` sample rescaled
                                                                                           from [-1, 1] to
                                                                                           ``[low, high]``
==============================  ========================  ===============================  ==========================

:meth:`Head.act` samples each row from that env's own ``np.random.Generator``, so an env's
action depends only on its own outputs and generator, never on the other rows. It returns
the *sampled* actions (what the log-probabilities are of, what a learner stores);
:meth:`Head.to_env` maps them to what the env takes.

Heads are numpy-only (workers may never import torch), frozen, and travel as a small map.

Examples:
    >>> import numpy as np
    >>> from gymnasium import spaces
    >>> space = spaces.Box(-2.0, 2.0, shape=(3,))
    >>> head = default_head(space)
    >>> head, head.output_width(space)
    (Gaussian(shape=None), 6)
    >>> outputs = np.zeros((2, 6))  # means 0, log std 0
    >>> actions, log_probs = head.act(outputs, [np.random.default_rng([0, i]) for i in range(2)])
    >>> actions.shape, actions.dtype, log_probs.dtype, head.to_env(actions, space).shape
    ((2, 3), dtype('float32'), dtype('float32'), (2, 3))
    >>> float(head.kl(outputs, outputs)[0])
    0.0
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from gymnasium import spaces

from clusterenv.errors import PolicyError

__all__ = [
    "Bernoulli",
    "Categorical",
    "EpsilonGreedy",
    "Gaussian",
    "Greedy",
    "Head",
    "MultiCategorical",
    "TanhGaussian",
    "default_head",
    "head_from_meta",
    "kl_divergence",
]

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
# Largest float32 below 1: ``tanh`` actions stored as float32 are clipped inside (-1, 1) before ``atanh``.
_TANH_LIMIT = float(np.nextafter(np.float32(1), np.float32(0)))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - np.max(x, axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def kl_divergence(log_p: np.ndarray, log_q: np.ndarray) -> np.ndarray:
    """Per-row ``KL(p ‖ q) = Σ_a p(a) (log p(a) − log q(a))`` from log-probabilities ``(B, A)``.

    Terms with ``p(a) = 0`` contribute nothing; ``q(a) = 0 < p(a)`` gives ``inf``.
    """
    log_p = np.asarray(log_p, dtype=np.float64)
    log_q = np.asarray(log_q, dtype=np.float64)
    p = np.exp(log_p)
    with np.errstate(invalid="ignore"):
        return np.where(p > 0, p * (log_p - log_q), 0.0).sum(axis=-1)


def _inverse_cdf(log_p: np.ndarray, draws: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(B,)`` int64 sampled from log-probability rows ``(B, n)``, and their log-probs.

    ``draws`` ``(B,)`` are U[0, 1) numbers, one per row.
    """
    cdf = np.cumsum(np.exp(log_p), axis=-1)
    # Comparing against the row total keeps rounding in the cumulative sum from overshooting.
    index = np.minimum((draws[:, None] * cdf[:, -1:] >= cdf).sum(axis=-1), log_p.shape[-1] - 1).astype(np.int64)
    return index, np.take_along_axis(log_p, index[:, None], axis=-1)[:, 0]


def _as_outputs(outputs: np.ndarray) -> np.ndarray:
    outputs = np.asarray(outputs, dtype=np.float64)
    if outputs.ndim != 2:
        raise PolicyError(f"Head outputs must have shape (batch, outputs per row), got shape {outputs.shape}.")
    return outputs


def _check_rngs(rngs: Sequence[np.random.Generator], rows: int) -> None:
    if len(rngs) != rows:
        raise PolicyError(f"`act` needs one np.random.Generator per row: got {len(rngs)} for {rows} rows.")


def _uniforms(rngs: Sequence[np.random.Generator], rows: int) -> np.ndarray:
    """One U[0, 1) draw per row from that row's generator."""
    generators = list(rngs)
    _check_rngs(generators, rows)
    return np.array([rng.random() for rng in generators])


def _shape_field(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, (tuple, list)) and all(isinstance(n, (int, np.integer)) and n >= 1 for n in value):
        return tuple(int(n) for n in value)
    raise PolicyError(f"`shape` must be None or a tuple of positive integers, got {value!r}.")


class Head:
    """An action distribution over one action space, parameterised by a policy's output rows.

    Subclasses define :meth:`output_width`, :meth:`act`, :meth:`log_prob`, :meth:`kl` and
    :meth:`to_env`; all take outputs ``(B, width)`` and work row by row.
    """

    name: ClassVar[str]
    layout: ClassVar[str]

    def output_width(self, action_space: spaces.Space) -> int:
        """Outputs per row this head needs to act in ``action_space``.

        Raises:
            PolicyError: if the head cannot act in that space.
        """
        raise NotImplementedError

    def check_width(self, action_space: spaces.Space, width: int) -> None:
        """Raise :class:`PolicyError`, naming both widths, unless a module with ``width`` outputs per row fits."""
        expected = self.output_width(action_space)
        if width != expected:
            raise PolicyError(
                f"The {type(self).__name__} head needs {expected} outputs per observation for action space "
                f"{action_space} ({self.layout}), but the policy outputs {width}."
            )

    def act(self, outputs: np.ndarray, rngs: Sequence[np.random.Generator]) -> tuple[np.ndarray, np.ndarray]:
        """Sample one action per row, row ``i`` from ``rngs[i]`` only.

        Args:
            outputs: ``(B, width)`` raw policy outputs.
            rngs: one ``np.random.Generator`` per row (each env's own), so that an env's action
                depends only on its row and its generator, whatever else is in the batch.

        Returns:
            The sampled actions ``(B, *action_shape)`` and their log-probabilities ``(B,)`` float32.
        """
        raise NotImplementedError

    def log_prob(self, outputs: np.ndarray, actions: np.ndarray) -> np.ndarray:
        """Log-probabilities ``(B,)`` float64 of sampled ``actions`` (as :meth:`act` returns them)."""
        raise NotImplementedError

    def kl(self, p_outputs: np.ndarray, q_outputs: np.ndarray) -> np.ndarray:
        """Exact per-row ``KL(p ‖ q)`` ``(B,)`` float64 between the distributions of two output arrays."""
        raise NotImplementedError

    def to_env(self, actions: np.ndarray, action_space: spaces.Space) -> np.ndarray:
        """The sampled ``actions`` ``(B, *shape)`` as the env takes them, in the space's dtype."""
        raise NotImplementedError

    def to_meta(self) -> dict[str, Any]:
        """The head as a small msgpack-able map (inverse of :func:`head_from_meta`)."""
        return {"name": self.name, **vars(self)}


class _DiscreteHead(Head):
    """A head over ``Discrete(n)`` defined by its table of log-probabilities ``(B, n)``."""

    layout: ClassVar[str] = "one output per action"

    def log_probs(self, outputs: np.ndarray) -> np.ndarray:
        """Log-probabilities ``(B, n)`` in float64 for raw outputs ``(B, n)``; ``-inf`` marks impossible actions."""
        raise NotImplementedError

    def output_width(self, action_space: spaces.Space) -> int:
        """``n`` for ``Discrete(n)``."""
        if not isinstance(action_space, spaces.Discrete):
            raise PolicyError(f"{type(self).__name__} acts in Discrete action spaces, got {action_space}.")
        return int(action_space.n)

    def act(self, outputs: np.ndarray, rngs: Sequence[np.random.Generator]) -> tuple[np.ndarray, np.ndarray]:
        """Indices ``(B,)`` int64 by inverse-CDF sampling with one ``rngs[i].random()`` per row."""
        log_p = self.log_probs(outputs)
        actions, chosen = _inverse_cdf(log_p, _uniforms(rngs, len(log_p)))
        return actions, chosen.astype(np.float32)

    def log_prob(self, outputs: np.ndarray, actions: np.ndarray) -> np.ndarray:
        """Entries of :meth:`log_probs` at ``actions`` ``(B,)``."""
        index = np.asarray(actions, dtype=np.int64)[:, None]
        return np.take_along_axis(self.log_probs(outputs), index, axis=-1)[:, 0]

    def kl(self, p_outputs: np.ndarray, q_outputs: np.ndarray) -> np.ndarray:
        """``Σ_a p(a) (log p(a) − log q(a))`` over the :meth:`log_probs` tables."""
        return kl_divergence(self.log_probs(p_outputs), self.log_probs(q_outputs))

    def to_env(self, actions: np.ndarray, action_space: spaces.Space) -> np.ndarray:
        """``actions + start``."""
        self.output_width(action_space)
        return (np.asarray(actions) + action_space.start).astype(action_space.dtype)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Categorical(_DiscreteHead):
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
class Greedy(_DiscreteHead):
    """Acts by ``argmax(outputs)`` (first index on ties), for evaluation and deterministic tests.

    Its recorded log-probabilities and its KL use ``softmax(outputs)``: a one-hot distribution
    would make every change of greedy action an infinite KL.
    """

    name: ClassVar[str] = "greedy"

    def log_probs(self, outputs: np.ndarray) -> np.ndarray:
        """Log-softmax of the outputs (temperature 1)."""
        return _log_softmax(np.asarray(outputs, dtype=np.float64))

    def act(self, outputs: np.ndarray, rngs: Sequence[np.random.Generator]) -> tuple[np.ndarray, np.ndarray]:
        """The argmax actions; still takes one draw per row, so each generator advances as with any discrete head."""
        _uniforms(rngs, len(outputs))
        actions = np.argmax(outputs, axis=-1).astype(np.int64)
        log_p = self.log_probs(outputs)
        return actions, np.take_along_axis(log_p, actions[:, None], axis=-1)[:, 0].astype(np.float32)


@dataclass(frozen=True)
class EpsilonGreedy(_DiscreteHead):
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


@dataclass(frozen=True)
class MultiCategorical(Head):
    """Independent categoricals, one per sub-action of ``MultiDiscrete(nvec)``.

    The outputs are the logits of every sub-action concatenated in ``nvec.ravel()`` order
    (``sum(nvec)`` wide); the log-probability and the KL are sums over the sub-actions.

    Args:
        nvec: the number of values of each sub-action, any nesting (``space.nvec.tolist()``);
            the actions have its shape.
    """

    name: ClassVar[str] = "multi_categorical"
    layout: ClassVar[str] = "the logits of each sub-action, concatenated"
    nvec: Any

    def __post_init__(self) -> None:
        nvec = np.asarray(self.nvec)
        if nvec.size == 0 or nvec.dtype.kind not in "iu" or (nvec < 1).any():
            raise PolicyError(f"`nvec` must be a non-empty nesting of positive integers, got {self.nvec!r}.")
        object.__setattr__(self, "nvec", _nested_tuple(nvec))

    def _sizes(self, outputs: np.ndarray) -> np.ndarray:
        sizes = np.ravel(self.nvec)
        if outputs.shape[-1] != sizes.sum():
            raise PolicyError(
                f"MultiCategorical(nvec={self.nvec}) needs sum(nvec) = {sizes.sum()} outputs per row, "
                f"got {outputs.shape[-1]}."
            )
        return sizes

    def _components(self, outputs: np.ndarray) -> list[np.ndarray]:
        outputs = _as_outputs(outputs)
        bounds = np.cumsum(self._sizes(outputs))[:-1]
        return [_log_softmax(part) for part in np.split(outputs, bounds, axis=-1)]

    def output_width(self, action_space: spaces.Space) -> int:
        """``sum(nvec)``, for a ``MultiDiscrete`` space with this head's ``nvec``."""
        if not isinstance(action_space, spaces.MultiDiscrete):
            raise PolicyError(f"MultiCategorical acts in MultiDiscrete action spaces, got {action_space}.")
        if _nested_tuple(action_space.nvec) != self.nvec:
            raise PolicyError(
                f"MultiCategorical(nvec={self.nvec}) does not match the action space's nvec "
                f"{action_space.nvec.tolist()}; build the head with default_head(action_space)."
            )
        return int(action_space.nvec.sum())

    def act(self, outputs: np.ndarray, rngs: Sequence[np.random.Generator]) -> tuple[np.ndarray, np.ndarray]:
        """Indices ``(B, *nvec_shape)`` int64, each sub-action by inverse CDF on one ``rngs[i].random()``."""
        log_ps = self._components(outputs)
        _check_rngs(rngs, len(log_ps[0]))
        draws = np.stack([rng.random(len(log_ps)) for rng in rngs]) if len(rngs) else np.empty((0, len(log_ps)))
        picks = [_inverse_cdf(log_p, draws[:, j]) for j, log_p in enumerate(log_ps)]
        actions = np.stack([index for index, _ in picks], axis=-1).reshape(len(draws), *np.shape(self.nvec))
        return actions, sum((chosen for _, chosen in picks), start=np.zeros(len(draws))).astype(np.float32)

    def log_prob(self, outputs: np.ndarray, actions: np.ndarray) -> np.ndarray:
        """Sum over sub-actions of each categorical's log-probability."""
        log_ps = self._components(outputs)
        flat = np.asarray(actions, dtype=np.int64).reshape(len(log_ps[0]), -1)
        return sum(
            (np.take_along_axis(lp, flat[:, j, None], axis=-1)[:, 0] for j, lp in enumerate(log_ps)),
            start=np.zeros(len(flat)),
        )

    def kl(self, p_outputs: np.ndarray, q_outputs: np.ndarray) -> np.ndarray:
        """Sum over sub-actions of the categorical KLs (the joint is a product)."""
        pairs = zip(self._components(p_outputs), self._components(q_outputs), strict=True)
        return sum((kl_divergence(p, q) for p, q in pairs), start=np.zeros(len(p_outputs)))

    def to_env(self, actions: np.ndarray, action_space: spaces.Space) -> np.ndarray:
        """``actions + start``."""
        self.output_width(action_space)
        return (np.asarray(actions) + action_space.start).astype(action_space.dtype)  # type: ignore[attr-defined]


def _nested_tuple(array: Any) -> Any:
    return tuple(_nested_tuple(x) for x in array) if np.ndim(array) > 0 else int(array)


class _FlatHead(Head):
    """A head whose actions are ``A`` numbers per row, reshaped to ``shape`` (default ``(A,)``)."""

    shape: tuple[int, ...] | None
    space_type: ClassVar[type[spaces.Space]]
    per_action: ClassVar[int]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", _shape_field(self.shape))

    def _size(self, outputs: np.ndarray) -> int:
        width = outputs.shape[-1]
        size, remainder = divmod(width, self.per_action)
        if remainder or (self.shape is not None and size != math.prod(self.shape)):
            need = f"a multiple of {self.per_action}" if self.shape is None else self.per_action * math.prod(self.shape)
            raise PolicyError(f"{type(self).__name__} needs {need} outputs per row ({self.layout}), got {width}.")
        return size

    def _row_shape(self, size: int) -> tuple[int, ...]:
        return (size,) if self.shape is None else self.shape

    def output_width(self, action_space: spaces.Space) -> int:
        """``per_action * prod(action_space.shape)``; the space's shape must be the head's ``shape``."""
        cls = type(self).__name__
        if not isinstance(action_space, self.space_type):
            raise PolicyError(f"{cls} acts in {self.space_type.__name__} action spaces, got {action_space}.")
        shape = tuple(action_space.shape or ())
        if (self.shape is None and len(shape) != 1) or (self.shape is not None and self.shape != shape):
            raise PolicyError(
                f"{cls}(shape={self.shape}) makes actions of shape {'(A,)' if self.shape is None else self.shape}, "
                "but the action space "
                f"{action_space} has shape {shape}; build the head with default_head(action_space)."
            )
        return self.per_action * math.prod(shape)


@dataclass(frozen=True)
class Bernoulli(_FlatHead):
    """Independent bits for ``MultiBinary(n)``: one logit per bit, ``P(bit = 1) = sigmoid(logit)``.

    Args:
        shape: the action shape when ``MultiBinary`` has several dimensions; None for ``(n,)``.
    """

    name: ClassVar[str] = "bernoulli"
    layout: ClassVar[str] = "one logit per bit"
    space_type: ClassVar[type[spaces.Space]] = spaces.MultiBinary
    per_action: ClassVar[int] = 1
    shape: tuple[int, ...] | None = None

    @staticmethod
    def _log_p(outputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(log P(1), log P(0))`` per bit: ``-softplus(-x)`` and ``-softplus(x)``, stable for any logit."""
        return -np.logaddexp(0.0, -outputs), -np.logaddexp(0.0, outputs)

    def act(self, outputs: np.ndarray, rngs: Sequence[np.random.Generator]) -> tuple[np.ndarray, np.ndarray]:
        """Bits ``(B, *shape)`` int8: bit ``k`` of row ``i`` is ``rngs[i].random(A)[k] < sigmoid(logit)``."""
        outputs = _as_outputs(outputs)
        size = self._size(outputs)
        _check_rngs(rngs, len(outputs))
        draws = np.stack([rng.random(size) for rng in rngs]) if len(rngs) else np.empty((0, size))
        log_one, _ = self._log_p(outputs)
        bits = (draws < np.exp(log_one)).astype(np.int8).reshape(len(outputs), *self._row_shape(size))
        return bits, self.log_prob(outputs, bits).astype(np.float32)

    def log_prob(self, outputs: np.ndarray, actions: np.ndarray) -> np.ndarray:
        """``Σ_k log P(bit_k)``."""
        outputs = _as_outputs(outputs)
        self._size(outputs)
        log_one, log_zero = self._log_p(outputs)
        bits = np.asarray(actions).reshape(outputs.shape)
        return np.where(bits == 1, log_one, log_zero).sum(axis=-1)

    def kl(self, p_outputs: np.ndarray, q_outputs: np.ndarray) -> np.ndarray:
        """``Σ_k p_k log(p_k / q_k) + (1 − p_k) log((1 − p_k) / (1 − q_k))``, in log space."""
        p_outputs, q_outputs = _as_outputs(p_outputs), _as_outputs(q_outputs)
        self._size(p_outputs)
        (p_one, p_zero), (q_one, q_zero) = self._log_p(p_outputs), self._log_p(q_outputs)
        return (np.exp(p_one) * (p_one - q_one) + np.exp(p_zero) * (p_zero - q_zero)).sum(axis=-1)

    def to_env(self, actions: np.ndarray, action_space: spaces.Space) -> np.ndarray:
        """The bits, in the space's dtype."""
        self.output_width(action_space)
        return np.asarray(actions).astype(action_space.dtype)


@dataclass(frozen=True)
class Gaussian(_FlatHead):
    """A diagonal normal for ``Box`` actions, as CleanRL's ``ppo_continuous_action.py`` acts.

    The outputs are ``A`` means, then ``A`` log standard deviations (``2A`` wide). CleanRL's
    state-independent ``actor_logstd`` parameter fits by expanding it next to the means::

        def forward(self, x):
            mean = self.actor_mean(x)
            return torch.cat([mean, self.actor_logstd.expand_as(mean)], dim=-1)

    The head does not bound the log standard deviations; a module that needs to (SAC) does.
    :meth:`to_env` clips the sample to ``[low, high]`` as CleanRL's ``ClipAction`` wrapper
    does, while the sample itself, unclipped, is what :meth:`act` returns and what the
    log-probabilities are of. The KL is the closed form between diagonal normals.

    Args:
        shape: the action shape when the ``Box`` has several dimensions; None for ``(A,)``.
    """

    name: ClassVar[str] = "gaussian"
    layout: ClassVar[str] = "the means, then the log standard deviations"
    space_type: ClassVar[type[spaces.Space]] = spaces.Box
    per_action: ClassVar[int] = 2
    shape: tuple[int, ...] | None = None

    def output_width(self, action_space: spaces.Space) -> int:
        """``2 * prod(action_space.shape)`` for a floating-point ``Box`` of the head's ``shape``."""
        width = super().output_width(action_space)
        if not np.issubdtype(action_space.dtype, np.floating):
            raise PolicyError(
                f"{type(self).__name__} samples real numbers; the Box must be floating-point, got {action_space}."
            )
        return width

    def _normal(self, outputs: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        outputs = _as_outputs(outputs)
        size = self._size(outputs)
        return outputs[:, :size], outputs[:, size:], size

    def _pre_squash(self, outputs: np.ndarray, rngs: Sequence[np.random.Generator]) -> tuple[np.ndarray, int]:
        """``mean + std * z`` with ``z = rngs[i].standard_normal(A)`` for row ``i``."""
        mean, log_std, size = self._normal(outputs)
        _check_rngs(rngs, len(mean))
        noise = np.stack([rng.standard_normal(size) for rng in rngs]) if len(rngs) else np.empty((0, size))
        return mean + np.exp(log_std) * noise, size

    def _normal_log_prob(self, outputs: np.ndarray, values: np.ndarray) -> np.ndarray:
        mean, log_std, _ = self._normal(outputs)
        z = (np.asarray(values, dtype=np.float64).reshape(mean.shape) - mean) * np.exp(-log_std)
        return (-0.5 * z**2 - log_std - _LOG_SQRT_2PI).sum(axis=-1)

    def act(self, outputs: np.ndarray, rngs: Sequence[np.random.Generator]) -> tuple[np.ndarray, np.ndarray]:
        """Samples ``(B, *shape)`` float32, unclipped; the log-probabilities are of the float32 values."""
        sample, size = self._pre_squash(outputs, rngs)
        actions = sample.astype(np.float32).reshape(len(sample), *self._row_shape(size))
        return actions, self.log_prob(outputs, actions).astype(np.float32)

    def log_prob(self, outputs: np.ndarray, actions: np.ndarray) -> np.ndarray:
        """``Σ_k log N(a_k; mean_k, std_k)``."""
        return self._normal_log_prob(outputs, actions)

    def kl(self, p_outputs: np.ndarray, q_outputs: np.ndarray) -> np.ndarray:
        """``Σ_k log(σq/σp) + (σp² + (μp − μq)²) / (2σq²) − 1/2``."""
        p_mean, p_log_std, _ = self._normal(p_outputs)
        q_mean, q_log_std, _ = self._normal(q_outputs)
        ratio = np.exp(2 * (p_log_std - q_log_std))
        gap = (p_mean - q_mean) ** 2 * np.exp(-2 * q_log_std)
        return (q_log_std - p_log_std + 0.5 * (ratio + gap - 1.0)).sum(axis=-1)

    def to_env(self, actions: np.ndarray, action_space: spaces.Space) -> np.ndarray:
        """Clipped to ``[low, high]`` (CleanRL's ``ClipAction``), in the space's dtype."""
        self.output_width(action_space)
        low, high = action_space.low, action_space.high  # type: ignore[attr-defined]
        return np.clip(np.asarray(actions), low, high).astype(action_space.dtype)


@dataclass(frozen=True)
class TanhGaussian(Gaussian):
    """SAC's squashed normal: ``a = tanh(u)``, ``u ~ N(mean, std)``, with the same ``2A`` outputs as :class:`Gaussian`.

    ``log π(a) = log N(u) − Σ_k log(1 − tanh(u_k)²)``, the correction in the stable form
    ``log(1 − tanh(u)²) = 2 (log 2 − u − softplus(−2u))`` (as ``torch``'s ``TanhTransform``).
    :meth:`act` returns ``a`` in [-1, 1] and computes its log-probability from ``u``;
    :meth:`log_prob` recovers ``u = atanh(a)``, clipping ``a`` just inside (-1, 1).
    :meth:`to_env` rescales [-1, 1] to ``[low, high]`` as CleanRL's ``sac_continuous_action.py``
    does (``a * (high − low) / 2 + (high + low) / 2``), so the space needs finite bounds. The
    log-probabilities are of ``a`` before that rescaling: it only adds a constant, which
    cancels in ratios and in the KL.

    The KL is the closed-form Gaussian KL of the pre-squash normals: ``tanh`` is a bijection,
    and the KL between two distributions is unchanged by mapping both through one.
    """

    name: ClassVar[str] = "tanh_gaussian"

    def output_width(self, action_space: spaces.Space) -> int:
        """As :meth:`Gaussian.output_width`; the ``Box`` must also have finite bounds."""
        width = super().output_width(action_space)
        bounded = action_space.is_bounded("both")  # type: ignore[attr-defined]
        if not bounded:
            raise PolicyError(
                f"TanhGaussian rescales [-1, 1] to [low, high], so the Box needs finite bounds, got {action_space}; "
                "use Gaussian, which clips, for unbounded actions."
            )
        return width

    def act(self, outputs: np.ndarray, rngs: Sequence[np.random.Generator]) -> tuple[np.ndarray, np.ndarray]:
        """Squashed samples ``(B, *shape)`` float32 in [-1, 1], log-probabilities from the unsquashed ``u``."""
        sample, size = self._pre_squash(outputs, rngs)
        log_prob = self._normal_log_prob(outputs, sample) - self._log_det(sample)
        actions = np.tanh(sample).astype(np.float32).reshape(len(sample), *self._row_shape(size))
        return actions, log_prob.astype(np.float32)

    @staticmethod
    def _log_det(u: np.ndarray) -> np.ndarray:
        """``Σ_k log(1 − tanh(u_k)²)``, without cancellation for large ``|u|``."""
        return (2.0 * (math.log(2.0) - u - np.logaddexp(0.0, -2.0 * u))).sum(axis=-1)

    def log_prob(self, outputs: np.ndarray, actions: np.ndarray) -> np.ndarray:
        """``log N(atanh(a)) − Σ_k log(1 − a_k²)``."""
        squashed = np.clip(np.asarray(actions, dtype=np.float64), -_TANH_LIMIT, _TANH_LIMIT)
        u = np.arctanh(squashed).reshape(len(squashed), -1)
        return self._normal_log_prob(outputs, u) - self._log_det(u)

    def to_env(self, actions: np.ndarray, action_space: spaces.Space) -> np.ndarray:
        """Rescaled from [-1, 1] to ``[low, high]``, in the space's dtype."""
        self.output_width(action_space)
        low, high = action_space.low, action_space.high  # type: ignore[attr-defined]
        scaled = np.asarray(actions, dtype=np.float64) * (high - low) / 2.0 + (high + low) / 2.0
        return np.clip(scaled, low, high).astype(action_space.dtype)


_HEADS: dict[str, type[Head]] = {
    cls.name: cls for cls in (Categorical, Greedy, EpsilonGreedy, MultiCategorical, Bernoulli, Gaussian, TanhGaussian)
}


def default_head(action_space: spaces.Space) -> Head:
    """The usual actor head for ``action_space``.

    ``Discrete`` → :class:`Categorical`, ``Box`` → :class:`Gaussian`, ``MultiDiscrete`` →
    :class:`MultiCategorical`, ``MultiBinary`` → :class:`Bernoulli`.

    Raises:
        PolicyError: for any other space.
    """
    if isinstance(action_space, spaces.Discrete):
        return Categorical()
    if isinstance(action_space, spaces.MultiDiscrete):
        return MultiCategorical(nvec=action_space.nvec.tolist())
    if isinstance(action_space, (spaces.Box, spaces.MultiBinary)):
        shape = tuple(action_space.shape)
        cls = Gaussian if isinstance(action_space, spaces.Box) else Bernoulli
        return cls(shape=None if len(shape) == 1 else shape)
    raise PolicyError(
        f"No action head for action space {action_space}; expected Discrete, Box, MultiDiscrete or MultiBinary."
    )


def head_from_meta(meta: Mapping[str, Any]) -> Head:
    """Rebuild a head from :meth:`Head.to_meta`."""
    fields = dict(meta)
    name = fields.pop("name")
    if name not in _HEADS:
        raise PolicyError(f"Unknown action head {name!r}; expected one of {sorted(_HEADS)}.")
    return _HEADS[name](**fields)
