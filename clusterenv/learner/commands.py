"""What the pool sends, and what each command means should its worker be lost before answering.

Every command the learner sends declares its :class:`OnLoss`; the pool keeps each worker's
latest one (:class:`SentCommand`) and, when recovery replaces the worker, does what it says.
A restart hook (``WorkerPool.on_restart``) returns the :class:`FollowUp` messages that the
replacement needs before its pending command is recovered (a policy runner's weights).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from clusterenv.wire.protocol import Kind, Message

__all__ = ["Command", "FollowUp", "OnLoss", "SentCommand"]

#: One worker's command: ``(meta, arrays, blobs)``.
Command = tuple[Mapping[str, Any] | None, Sequence[np.ndarray], Sequence[bytes]]


class OnLoss(enum.Enum):
    """What a command still unanswered by a lost worker means for its replacement; declared by its sender."""

    #: Send it again: on the fresh envs it does what was asked (a seeded reset returns the
    #: same observations, an attribute read the same value, a lockstep rollout a fresh one).
    REPLAY = "replay"
    #: The envs' episodes were cut: recorded in the pool's :class:`~clusterenv.learner.cuts.CutLedger`,
    #: for the sender to report (a lockstep step: truncated, flagged ``worker_restarted``).
    INTERRUPT = "interrupt"
    #: The sender's restart hook re-issues what it needs (first-ready steps, prefetched rollouts).
    REISSUE = "reissue"
    #: Nothing can stand in for it (building the envs, installing a policy): ``WorkerLostError``.
    RAISE = "raise"


class SentCommand(NamedTuple):
    """A worker's latest command, kept to replay it to a replacement (a tuple: one is made per worker and step)."""

    kind: Kind
    meta: Mapping[str, Any] | None
    arrays: Sequence[np.ndarray]
    blobs: Sequence[bytes]
    on_loss: OnLoss


class FollowUp(NamedTuple):
    """A message a restart hook has the pool send to a replacement once its envs are built.

    Attributes:
        kind, meta, arrays, blobs: the message.
        on_loss: what it means should the replacement be lost in turn.
        awaited: what it does, if the pool waits for its reply before going on ("installing
            the local policy"); ``None``: its reply (if any) comes to the caller's stream.
        timeout: seconds to wait for that reply (``None``: forever).
        on_reply: called with that reply, if the pool waited for it.
    """

    kind: Kind
    meta: Mapping[str, Any] | None = None
    arrays: Sequence[np.ndarray] = ()
    blobs: Sequence[bytes] = ()
    on_loss: OnLoss = OnLoss.RAISE
    awaited: str | None = None
    timeout: float | None = None
    on_reply: Callable[[Message], None] | None = None
