"""``SharedSteps``: the learner's side of the shared step path, for the workers it started on its own host.

A plain STEP to a worker on this path is its actions written into its rows of the
:class:`~clusterenv.wire.step_region.StepRegion`, a command counter, and one wake-up byte;
its reply is a wake-up byte back (or, when the step has infos or a usage report, a small
message), after which its observations, rewards and flags are in the region. The pool
calls :meth:`SharedSteps.send` and :meth:`SharedSteps.reply` in place of encoding and
decoding those messages; everything else (other commands, errors, liveness, recovery) is
the message path's. Which workers are on the path is decided per worker: a worker whose
process has a wake socket and whose own spaces give the region's layout.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import zmq

from clusterenv.errors import ProtocolError
from clusterenv.learner.commands import FollowUp, OnLoss
from clusterenv.learner.membership import Membership
from clusterenv.wire.messages import ValueMeta, meta_of
from clusterenv.wire.protocol import Kind, Message
from clusterenv.wire.step_region import DONE, INFOS, MESSAGE, InfoLayout, StepRegion, check_layout, read_infos
from clusterenv.wire.transport import Channel

__all__ = ["SHARED_MEMORY", "MESSAGES", "SharedSteps"]

logger = logging.getLogger(__name__)

#: ``worker_info``'s ``step_path`` of a worker on the shared step path.
SHARED_MEMORY = "shared memory"
#: ``worker_info``'s ``step_path`` of any other worker.
MESSAGES = "messages"

_NO_INFOS = [b""]


class SharedSteps:
    """Which workers step through the region, and their commands in flight.

    Args:
        region: the region of all envs (its observations are the learner's batch).
        channel: the pool's channel (wake sockets, passing the region's file).
        members: who serves which worker (only a worker served by its own process is on the path).
        timeout: seconds a worker has to map the region.
    """

    def __init__(self, region: StepRegion, channel: Channel, members: Membership, timeout: float | None) -> None:
        self.region = region
        self.timeout = timeout
        self._channel = channel
        self._members = members
        #: The workers on the path now.
        self.on_path: set[int] = set()
        self._counters = [0] * len(region.slices)  # each worker's last command counter: never reused
        self._in_flight: dict[int, tuple[int, int]] = {}  # worker → (command counter, call number)
        self._wakers: dict[int, Callable[[], None]] = {}  # worker → what wakes its process
        # A step whose reply is a message ends with the message, then a wake-up; the learner may read
        # either first. The workers whose wake-up came first; and each worker's wake-ups still to come
        # after messages that came first (in order, before any later step's; they pile up while
        # messages keep coming first).
        self._message_due: set[int] = set()
        self._wake_ups_due: collections.Counter[int] = collections.Counter()
        self._layouts: dict[int, InfoLayout] = {}  # the info layout each worker named last
        # Each worker's rewards, terminations and truncations: views of the batch's own arrays.
        self._fields = [[rows.rewards, rows.terminations, rows.truncations] for rows in region.workers]

    # -- joining the path ------------------------------------------------------------------
    def can_join(self, worker_id: int) -> bool:
        """Whether worker ``worker_id`` is served by its own process, which has a wake socket."""
        members = self._members
        identity = members.identities.get(worker_id)
        return members.serving.get(worker_id) == worker_id and self._channel.can_wake(identity)

    def offer(self, worker_id: int) -> FollowUp | None:
        """Pass the region's file to worker ``worker_id`` and return the SHARE_STEP that maps it; ``None``: it cannot.

        The worker starts from a cleared header. Its reply goes to :meth:`joined`.
        """
        self.on_path.discard(worker_id)
        self._in_flight.pop(worker_id, None)
        self._message_due.discard(worker_id)
        del self._wake_ups_due[worker_id]
        self._layouts.pop(worker_id, None)
        if not self.can_join(worker_id):
            return None
        self.region.workers[worker_id].clear()
        identity = self._members.identities[worker_id]
        try:
            self._channel.pass_fd(self.region.fd, identity)
            self._wakers[worker_id] = self._channel.waker(identity)
        except ProtocolError as exc:  # it has not read its wake socket: it keeps the message path
            logger.warning("Worker %d keeps the message path: the step region could not be passed: %s.", worker_id, exc)
            return None
        except Exception as exc:  # the process is gone: liveness checks find it
            logger.debug("Worker %d: the step region could not be passed (%s).", worker_id, str(exc))
            return None
        return FollowUp(
            Kind.SHARE_STEP,
            self.region.meta(worker_id),
            on_loss=OnLoss.REPLAY,
            awaited="mapping the shared step region",
            timeout=self.timeout,
            on_reply=lambda reply: self.joined(worker_id, reply),
        )

    def joined(self, worker_id: int, reply: Message) -> None:
        """Worker ``worker_id``'s answer to its SHARE_STEP: on the path if it mapped the region."""
        if reply.kind is Kind.VALUE and meta_of(reply, ValueMeta).get("attached"):
            self.on_path.add(worker_id)
        else:
            logger.info("Worker %d keeps the message path: it could not map the step region.", worker_id)

    def restart_hook(self, worker_id: int) -> list[FollowUp]:
        """A worker's envs were rebuilt (restart, recycling, a move): it joins the path again if it can."""
        offer = self.offer(worker_id)
        return [] if offer is None else [offer]

    def path_of(self, worker_ids: Iterable[int]) -> str:
        """``worker_info``'s ``step_path`` of a process serving ``worker_ids``."""
        served = list(worker_ids)
        return SHARED_MEMORY if served and all(w in self.on_path for w in served) else MESSAGES

    # -- a step ----------------------------------------------------------------------------
    def send(self, worker_id: int, actions: Sequence[np.ndarray], call: int) -> None:
        """Write worker ``worker_id``'s actions into its rows and wake it.

        Raises:
            zmq.ZMQError: its process is gone.
            ProtocolError: naming the worker, if it has not read the wake-ups sent before (a full
                wake channel: never more than one is in flight, so the worker misbehaves).
        """
        rows = self.region.workers[worker_id]
        for row, action in zip(rows.actions, actions, strict=True):
            row[...] = action
        self._command(worker_id, call)

    def _command(self, worker_id: int, call: int) -> None:
        """Worker ``worker_id``'s actions are in its rows: a fresh counter, the call, and the wake-up."""
        rows = self.region.workers[worker_id]
        counter = self._counters[worker_id] = self._counters[worker_id] + 1
        rows.command[1] = call
        rows.command[0] = counter
        self._in_flight[worker_id] = (counter, call)
        try:
            self._wakers[worker_id]()  # never blocks
        except ProtocolError as exc:
            raise ProtocolError(f"Worker {worker_id} cannot be woken: {exc}.") from None

    @property
    def everyone(self) -> bool:
        """Whether every worker is on the path (a lockstep step then needs no message at all)."""
        return len(self.on_path) == len(self.region.workers)

    def takes(self, actions: Sequence[np.ndarray], worker_id: int | None = None) -> bool:
        """Whether ``actions`` (of worker ``worker_id``, or the batch's) have the region's dtypes and shapes.

        Others (floats for a ``Discrete`` space, say) reach the envs as they are, in a message,
        as ``SyncVectorEnv`` hands them over.
        """
        rows = self.region.actions if worker_id is None else self.region.workers[worker_id].actions
        return len(rows) == len(actions) and all(
            row.dtype == action.dtype and row.shape == action.shape for row, action in zip(rows, actions, strict=True)
        )

    def send_all(self, actions: Sequence[np.ndarray], call: int) -> list[int]:
        """:meth:`send` to every worker at once (all on the path): the batch's actions in one copy per leaf.

        Returns the workers whose process could not be woken (gone); raises as :meth:`send`
        for a worker whose wake channel is full.
        """
        for batch, action in zip(self.region.actions, actions, strict=True):
            batch[...] = action
        unreachable = []
        for worker_id in range(len(self.region.workers)):
            try:
                self._command(worker_id, call)
            except zmq.ZMQError:
                unreachable.append(worker_id)
        return unreachable

    def in_flight(self, worker_id: int) -> bool:
        """Whether worker ``worker_id`` has a step on the path that it has not answered yet."""
        return worker_id in self._in_flight

    def woken(self, worker_id: int) -> Message | None:
        """The RESULT a wake-up from worker ``worker_id`` stands for; ``None``: its reply is a message, sent before.

        Its rewards and flags are views of the worker's rows, its observations already in the
        batch, and its infos (status ``INFOS``) read from its info rows. Raises ``ProtocolError``
        naming the worker unless the reply's counter is the command's and its status is known.
        """
        if self._wake_ups_due[worker_id]:  # the end of a step whose reply message came first
            self._wake_ups_due[worker_id] -= 1
            return None
        sent = self._in_flight.get(worker_id)
        rows = self.region.workers[worker_id]
        counter, status = int(rows.reply[0]), int(rows.reply[1])
        layout = self._layouts.get(worker_id)
        if (
            sent is None
            or counter != sent[0]
            or status not in (DONE, MESSAGE, INFOS)
            or (status == INFOS and layout is None)
            or worker_id in self._message_due
        ):
            raise self._stray(worker_id, f"a wake-up with counter {counter} and status {status}", sent)
        if status == MESSAGE:
            self._message_due.add(worker_id)
            return None
        del self._in_flight[worker_id]
        infos = None if status == DONE else read_infos(rows.infos, layout)  # type: ignore[arg-type]
        return Message(Kind.RESULT, {"seq": sent[1]}, self._fields[worker_id], _NO_INFOS, infos)

    def completed(self, worker_id: int, msg: Message) -> Message:
        """The RESULT that a message naming a step (its infos) from worker ``worker_id`` completes."""
        sent = self._in_flight.pop(worker_id, None)
        if sent is None or msg.meta["step"] != sent[0]:
            raise self._stray(worker_id, f"a message for step {msg.meta['step']}", sent)
        if worker_id in self._message_due:
            self._message_due.discard(worker_id)
        else:
            self._wake_ups_due[worker_id] += 1
        if "info_layout" in msg.meta:
            try:
                self._layouts[worker_id] = check_layout(msg.meta["info_layout"])
            except ValueError as exc:
                raise ProtocolError(f"Worker {worker_id} named an invalid info layout: {exc}") from None
        meta = {key: value for key, value in msg.meta.items() if key not in ("step", "info_layout")}
        return Message(Kind.RESULT, meta, self._fields[worker_id], msg.blobs)

    @staticmethod
    def _stray(worker_id: int, what: str, sent: tuple[int, int] | None) -> ProtocolError:
        expected = "no step in flight" if sent is None else f"its step in flight is {sent[0]}"
        return ProtocolError(
            f"Worker {worker_id} sent a shared-memory step reply that answers no command of its: {what}; {expected}."
        )

    def close(self) -> None:
        """Close the region's file (the batch stays readable while views of it live)."""
        self.region.close()
