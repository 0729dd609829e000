"""``Outbox``: the pool's commands on their way out, and the record of each worker's latest one.

A call's commands are encoded all at once, then recorded, then delivered: a value that
cannot travel raises while no worker has received anything (a reset that reached some
workers only would silently desynchronize the envs), and a send interrupted anywhere
(Ctrl-C) leaves every command recorded, for the gather that follows to deliver the rest.
A plain STEP to a worker on the shared step path goes into the step region instead of
onto the wire. What each worker was last sent is what recovery reads when it is lost
(:meth:`~clusterenv.learner.recovery.Recovery.plan`); when, what its reply latency counts from.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import zmq

from clusterenv.errors import ClusterEnvError, ProtocolError
from clusterenv.learner.commands import Command, OnLoss, SentCommand
from clusterenv.learner.membership import Membership
from clusterenv.learner.recovery import Recovery
from clusterenv.learner.shared_steps import SharedSteps
from clusterenv.learner.timing import StepTiming
from clusterenv.wire.protocol import Kind
from clusterenv.wire.transport import Channel

__all__ = ["SHARED", "Outbox"]

logger = logging.getLogger(__name__)

#: What :meth:`Outbox.encode` returns for a command that goes into the step region, not onto the wire.
SHARED: list[Any] = []
# What send_shared() records as each worker's command: a lockstep step, whose loss cuts the episodes; its actions
# are the batch's, kept once (Outbox._shared_actions) for an interrupted send.
_SHARED_STEP = SentCommand(Kind.STEP, None, (), (), OnLoss.INTERRUPT)


class Outbox:
    """The commands a pool sends: encoded all or nothing, recorded before they leave, delivered even if interrupted.

    Args:
        channel: the pool's channel.
        members: who serves which worker (where its commands go).
        recovery: the failure policy: whether a worker found unreachable raises, or is lost.
        timing: the pool's batch step timing (a STEP starts a batch step).
        fatal: returns its error once the workers it leaves unusable are closed (the pool's).
        lost: told of each worker found lost on the way (its process given up, or unreachable).
        step_path: the pool's shared step path now, if any.
        num_workers: how many workers.
    """

    def __init__(
        self,
        channel: Channel,
        members: Membership,
        recovery: Recovery,
        timing: StepTiming,
        fatal: Callable[[ClusterEnvError], ClusterEnvError],
        lost: Callable[[int], None],
        step_path: Callable[[], SharedSteps | None],
        num_workers: int,
    ) -> None:
        self._channel = channel
        self._members = members
        self._recovery = recovery
        self._timing = timing
        self._fatal = fatal
        self._lost = lost
        self._step_path = step_path
        #: Each worker's latest command, for recovery should the worker be lost before answering it.
        self.last_sent: dict[int, SentCommand] = {}
        # When each worker was last sent a command; a worker not here was last sent the lockstep step recorded at
        # _shared_sent_at (record_shared() stamps every worker at once), if any.
        self._sent_at: dict[int, float] = {}
        #: Workers whose latest command has had no reply yet.
        self.awaiting: set[int] = set()
        # The current call's commands recorded but not yet delivered. Worker → the channel's count of messages
        # sent to it before its command (None: into the step region).
        self._unsent: dict[int, int | None] = {}
        self._shared_actions: Sequence[np.ndarray] = ()  # the batch's actions of the last send_shared()
        self._shared_sent_at: float | None = None
        ids = range(num_workers)
        # What send_shared() records for every worker, made once rather than per step.
        self._every_worker = ids
        self._shared_steps = dict.fromkeys(ids, _SHARED_STEP)
        self._into_region: dict[int, int | None] = dict.fromkeys(ids)

    def new_call(self) -> None:
        """A new call: what an earlier one left undelivered is given up."""
        self._unsent.clear()

    def send_each(self, kind: Kind, commands: Mapping[int, Command], on_loss: OnLoss | None, seq: int) -> None:
        """Send one command of call ``seq`` to each worker in ``commands``.

        See :meth:`WorkerPool.send_each <clusterenv.learner.pool.WorkerPool.send_each>`.
        """
        members = self._members
        encoded = [
            # None: its process was given up (rehome): the gather that follows moves the worker
            (w, None if members.serving[w] in members.retired else self.encode(w, kind, meta, arrays, blobs, seq))
            for w, (meta, arrays, blobs) in commands.items()
        ]
        sent_at = time.monotonic()
        if kind is Kind.STEP:
            self._timing.start()
        # Every command is recorded before the first leaves: if sending is interrupted (Ctrl-C), the gather
        # that follows delivers the rest (deliver_unsent).
        for (worker_id, frames), (meta, arrays, blobs) in zip(encoded, commands.values(), strict=True):
            if on_loss is not None:  # a command, not a message that serves one (weights, probe outputs)
                self.last_sent[worker_id] = SentCommand(kind, meta, arrays, blobs, on_loss)
                self._sent_at[worker_id] = sent_at
                self.awaiting.add(worker_id)
            if frames is None:
                self._lost(worker_id)
            else:
                self._unsent[worker_id] = (
                    None if frames is SHARED else self._channel.sent[members.identities[worker_id]]
                )
        for (worker_id, frames), (_, arrays, _) in zip(encoded, commands.values(), strict=True):
            if frames is not None:
                self._deliver(worker_id, frames, kind, arrays, seq)

    def _deliver(self, worker_id: int, frames: list[Any], kind: Kind, arrays: Sequence[np.ndarray], seq: int) -> None:
        """Send one encoded command (``SHARED``: its ``arrays`` into the step region); a worker found gone is lost."""
        path, members = self._step_path(), self._members
        try:
            if frames is SHARED:
                assert path is not None
                path.send(worker_id, arrays, seq)
            else:
                self._channel.send_frames(frames, to=members.identities[worker_id])
                if path is not None:
                    path.announce(members.serving[worker_id])
        except ProtocolError as exc:  # a worker that does not drain its wake channel
            raise self._fatal(exc) from None
        except zmq.ZMQError as exc:
            if self._recovery.on_worker_failure == "raise":
                raise self._fatal(self._recovery.lost_error(worker_id, f"sending {kind.name}")) from exc
            logger.warning("Worker %d is unreachable (%s); it is taken as lost.", worker_id, str(exc))
            self._lost(worker_id)
        self._unsent.pop(worker_id, None)

    def _went_out(self, worker_id: int, seq: int) -> bool:
        """Whether worker ``worker_id``'s unsent command went out after all: on the channel, or into the region."""
        mark, path = self._unsent[worker_id], self._step_path()
        if mark is None:  # into the step region: finished there if it was recorded
            return path is not None and path.resume(worker_id, seq)
        return self._channel.sent[self._members.identities[worker_id]] > mark

    def deliver_unsent(self, worker_ids: set[int], seq: int) -> None:
        """Deliver the commands of ``worker_ids`` that an interrupted send left recorded but not sent."""
        if not self._unsent:
            return
        for worker_id in sorted(worker_ids & self._unsent.keys()):
            if self._went_out(worker_id, seq):
                self._unsent.pop(worker_id)
                continue
            sent = self.last_sent[worker_id]
            arrays = sent.arrays
            if sent is _SHARED_STEP:  # a lockstep step on the shared path: its actions are the batch's
                path = self._step_path()
                assert path is not None
                arrays = [leaf[path.region.slices[worker_id]] for leaf in self._shared_actions]
            frames = self.encode(worker_id, sent.kind, sent.meta, arrays, sent.blobs, seq)
            self._deliver(worker_id, frames, sent.kind, arrays, seq)

    def encode(
        self,
        worker_id: int,
        kind: Kind,
        meta: Mapping[str, Any] | None,
        arrays: Sequence[np.ndarray],
        blobs: Sequence[bytes],
        seq: int,
    ) -> list[Any]:
        """A command's frames, or ``SHARED`` for a plain step that goes into the step region."""
        path = self._step_path()
        if (
            kind is Kind.STEP
            and path is not None
            and worker_id in path.on_path
            and not blobs
            and not meta
            and path.takes(arrays, worker_id)
        ):
            return SHARED
        return self._channel.frames(
            kind, self._header(worker_id, meta, seq), arrays, blobs, to=self._members.identities[worker_id]
        )

    def send_shared(self, actions: Sequence[np.ndarray], seq: int) -> None:
        """A lockstep STEP of call ``seq`` to every worker, all through the step region.

        See :meth:`WorkerPool.send_shared <clusterenv.learner.pool.WorkerPool.send_shared>`.
        """
        self.record_shared(actions)
        self.command_shared(seq)

    def record_shared(self, actions: Sequence[np.ndarray]) -> None:
        """Record a lockstep STEP of every worker through the step region, before the call that sends it is pending.

        Recorded first, then pending, then sent (:meth:`command_shared`): an interrupt before
        the call is pending leaves nothing sent, one after it leaves the commands to deliver.
        """
        self._timing.start()
        self._shared_actions = actions
        every = self._every_worker
        self.last_sent.update(self._shared_steps)
        self._sent_at.clear()  # every worker is sent this step: one stamp serves them all
        self._shared_sent_at = time.monotonic()
        self.awaiting.update(every)
        self._unsent.update(self._into_region)

    def command_shared(self, seq: int) -> None:
        """Send what :meth:`record_shared` recorded: the actions into the region, every worker commanded."""
        path = self._step_path()
        assert path is not None
        path.write_actions(self._shared_actions)
        try:
            unreachable = path.command_all(seq)
        except ProtocolError as exc:  # a worker that does not drain its wake channel
            raise self._fatal(exc) from None
        self._unsent.clear()  # the call's only commands
        for worker_id in unreachable:
            if self._recovery.on_worker_failure == "raise":
                raise self._fatal(self._recovery.lost_error(worker_id, "sending STEP"))
            logger.warning("Worker %d is unreachable; it is taken as lost.", worker_id)
            self._lost(worker_id)

    def replied(self, worker_id: int) -> float | None:
        """Worker ``worker_id`` replied: no longer awaited; the seconds since its latest command (``None``: none)."""
        self.awaiting.discard(worker_id)
        sent_at = self._sent_at.get(worker_id, self._shared_sent_at)
        return None if sent_at is None else time.monotonic() - sent_at

    def replied_all(self) -> float:
        """Every worker answered a lockstep step: none is awaited any more; the seconds since it was recorded.

        Every worker of a lockstep step was sent its command at the same moment (:meth:`record_shared`).
        """
        self.awaiting.difference_update(self._every_worker)
        assert self._shared_sent_at is not None
        return time.monotonic() - self._shared_sent_at

    def _header(self, worker_id: int, meta: Mapping[str, Any] | None, seq: int) -> dict[str, Any]:
        """A command's meta as sent: the call number, and the worker's slot if another process serves it."""
        header = {**(meta or {}), "seq": seq}
        if self._members.serving[worker_id] != worker_id:
            header["slot"] = worker_id
        return header
