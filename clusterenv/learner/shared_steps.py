"""``SharedSteps``: the learner's side of the shared step path, for the workers it started on its own host.

A plain STEP to a worker on this path is its actions written into its rows of the
:class:`~clusterenv.wire.step_region.StepRegion` and a command counter (a wake-up byte only
if the worker sleeps); its reply is the reply counter and a final status in its header (a
small message first, when the step has infos or a usage report), after which its
observations, rewards and flags are in the region. The learner waits for a reply by reading
the worker's words, spinning for a while and then blocking on its wake socket
(:meth:`SharedSteps.await_reply`); what the words say is the truth, so a wait interrupted
anywhere (Ctrl-C) loses nothing that the next wait would not find. Everything else (other
commands, errors, liveness, recovery) is the message path's. Which workers are on the path
is decided per worker: a worker whose process has a wake socket and whose own spaces give
the region's layout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import zmq

from clusterenv.errors import ProtocolError
from clusterenv.learner.commands import FollowUp, OnLoss
from clusterenv.learner.membership import Membership
from clusterenv.wire.infos import PackedInfos
from clusterenv.wire.messages import ValueMeta, meta_of
from clusterenv.wire.protocol import Kind, Message
from clusterenv.wire.step_region import (
    CALL,
    COUNTER,
    DONE,
    INFOS,
    LEARNER_WAITS,
    MESSAGE,
    STATUS,
    STEPPING,
    WORKER_WAITS,
    InfoLayout,
    ScalarInfos,
    StepRegion,
    check_layout,
    fence,
    read_infos,
    scalar_infos,
)
from clusterenv.wire.step_region import (
    MESSAGES as MESSAGES_SENT,
)
from clusterenv.wire.transport import Channel
from clusterenv.wire.waiting import SPIN_SEATS, SpinBudget, yield_core

__all__ = ["NOT_YET", "SHARED_MEMORY", "MESSAGES", "SharedSteps"]

logger = logging.getLogger(__name__)

#: ``worker_info``'s ``step_path`` of a worker on the shared step path.
SHARED_MEMORY = "shared memory"
#: ``worker_info``'s ``step_path`` of any other worker.
MESSAGES = "messages"

_NO_INFOS = [b""]
#: :meth:`SharedSteps.reply` of a worker whose reply is not final yet.
NOT_YET: Message = Message(Kind.WAKE_UP, {"not_yet": True})
# Spin iterations between two reads of the clock.
_POLLS_PER_CLOCK = 16


class SharedSteps:
    """Which workers step through the region, and their commands in flight.

    Args:
        region: the region of all envs (its observations are the learner's batch).
        channel: the pool's channel (wake sockets, passing the region's file).
        members: who serves which worker (only a worker served by its own process is on the path).
        timeout: seconds a worker has to map the region.
        spin_us: how long each side spins before it blocks, in µs (``0``: never; ``None``: adapted), where
            the learner and every local worker have a core each, beside those of every other ClusterEnv
            in this process (:data:`~clusterenv.wire.waiting.SPIN_SEATS`); else neither side spins.
    """

    def __init__(
        self,
        region: StepRegion,
        channel: Channel,
        members: Membership,
        timeout: float | None,
        spin_us: float | None = None,
    ) -> None:
        self.region = region
        self.timeout = timeout
        self._channel = channel
        self._members = members
        #: The workers on the path now.
        self.on_path: set[int] = set()
        # Spinning needs a core per spinner: this process once, and each worker offered the path, of every
        # ClusterEnv in this process. A rule for any bound, the default's and a user's.
        self._seats = seats = SPIN_SEATS.claim(len(region.slices)) if spin_us != 0 else None
        if seats is None:
            self.spin_reason = "set by `spin_us`"
        elif not seats.granted:
            spin_us = 0.0  # what the workers are told too: they block
            self.spin_reason = seats.reason
        else:
            self.spin_reason = seats.reason if spin_us is None else "set by `spin_us`"
        self._spin_us = spin_us
        #: How long the learner spins for a reply before it blocks.
        self.spin = SpinBudget(None if spin_us is None else spin_us * 1e-6)
        self._counters = [0] * len(region.slices)  # each worker's last command counter: never reused
        self._in_flight: dict[int, tuple[int, int]] = {}  # worker → (command counter, call number)
        self._replies: dict[int, Message] = {}  # worker → the RESULT built for its step in flight, until taken
        self._wakers: dict[int, Callable[[], None]] = {}  # worker → what wakes its process
        self._layouts: dict[int, InfoLayout] = {}  # the info layout each worker named last
        self._scalar_infos: dict[int, ScalarInfos | None] = {}  # that layout as typed fields, if all scalars
        # The scalar layout every worker named, if they all named the same, with the batch's info rows seen through it.
        self._batch_infos: tuple[ScalarInfos, np.ndarray] | None = None
        # Each worker's rewards, terminations and truncations: views of the batch's own arrays.
        self._fields = [[rows.rewards, rows.terminations, rows.truncations] for rows in region.workers]
        self._workers = range(len(region.workers))

    # -- joining the path ------------------------------------------------------------------
    def can_join(self, worker_id: int) -> bool:
        """Whether worker ``worker_id`` is served by its own process, which has a wake socket."""
        members = self._members
        identity = members.identities.get(worker_id)
        return members.serving.get(worker_id) == worker_id and self._channel.can_wake(identity)

    def offer(self, worker_id: int) -> FollowUp | None:
        """Pass the region's file to worker ``worker_id`` and return the SHARE_STEP that maps it; ``None``: it cannot.

        A worker lost mid-step may have written that step's observations into the batch: the
        ones it last answered with are put back first. The worker starts from a cleared header.
        Its reply goes to :meth:`joined`.
        """
        sent = self._in_flight.pop(worker_id, None)
        self._replies.pop(worker_id, None)
        rows = self.region.workers[worker_id]
        if sent is not None and worker_id in self.on_path and rows.began(sent[0]):
            rows.restore_observations()
        self.on_path.discard(worker_id)
        self._layouts.pop(worker_id, None)
        self._scalar_infos.pop(worker_id, None)
        self._batch_infos = None
        if not self.can_join(worker_id):
            return None
        rows.clear()
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
            self.region.meta(worker_id, self._spin_us),
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

    def describe(self) -> dict[str, object]:
        """``learner_info``'s account of how the learner waits for the workers on the path."""
        return {**self.spin.describe(), "spin_rule": self.spin_reason}

    # -- commands --------------------------------------------------------------------------
    def announce(self, process: int) -> None:
        """A message went to worker process ``process`` on its pipe: a worker spinning on its header turns to it."""
        if process in self.on_path:
            words = self.region.workers[process].command
            words[MESSAGES_SENT] += 1

    def send(self, worker_id: int, actions: Sequence[np.ndarray], call: int) -> None:
        """Write worker ``worker_id``'s actions into its rows and command it.

        Raises:
            zmq.ZMQError: its process is gone.
            ProtocolError: naming the worker, if it has not read the wake-ups sent before (a full
                wake channel: a worker wakes only after it asked to, so it misbehaves).
        """
        rows = self.region.workers[worker_id]
        for row, action in zip(rows.actions, actions, strict=True):
            row[...] = action
        self._command(worker_id, call)

    def _command(self, worker_id: int, call: int) -> None:
        """Worker ``worker_id``'s actions are in its rows: a fresh counter and the call; a wake-up if it sleeps.

        The command is recorded before it is written, and written before the counter is
        counted: wherever an interrupt lands, :meth:`resume` finishes it with the same counter,
        so the worker steps exactly once.
        """
        counter = self._counters[worker_id] + 1
        self._in_flight[worker_id] = (counter, call)
        self._publish(worker_id, counter, call)

    def _publish(self, worker_id: int, counter: int, call: int) -> None:
        self._write_command(worker_id, counter, call)
        fence()  # our counter, visible before we read whether the worker sleeps (it raises, fences, reads ours)
        self._wake_if_waiting(worker_id)

    def _write_command(self, worker_id: int, counter: int, call: int) -> None:
        """The command's words: the worker may start from here on."""
        command = self.region.workers[worker_id].command
        command[CALL] = call
        command[COUNTER] = counter
        self._counters[worker_id] = counter

    def _wake_if_waiting(self, worker_id: int) -> None:
        """A wake-up for worker ``worker_id`` (on its pipe) if it raised its *waits* word (after our fence)."""
        if self.region.workers[worker_id].reply[WORKER_WAITS]:
            try:
                self._wakers[worker_id]()  # never blocks
            except ProtocolError as exc:
                raise ProtocolError(f"Worker {worker_id} cannot be woken: {exc}.") from None

    def command_all(self, call: int) -> list[int]:
        """Command every worker with the actions already in its rows; the workers whose process is gone.

        Every command is recorded and written first, then one fence serves them all, then the
        workers that sleep are woken: a batch of 16 workers pays one barrier, not 16.
        """
        counters, in_flight = self._counters, self._in_flight
        for worker_id in self._workers:
            counter = counters[worker_id] + 1
            in_flight[worker_id] = (counter, call)
            self._write_command(worker_id, counter, call)
        fence()
        unreachable = []
        for worker_id in self._workers:
            try:
                self._wake_if_waiting(worker_id)
            except zmq.ZMQError:
                unreachable.append(worker_id)
        return unreachable

    def resume(self, worker_id: int, call: int) -> bool:
        """Finish worker ``worker_id``'s command of ``call`` after an interrupted send; False if none was recorded."""
        sent = self._in_flight.get(worker_id)
        if sent is None or sent[1] != call:
            return False
        self._publish(worker_id, *sent)
        return True

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

    def write_actions(self, actions: Sequence[np.ndarray]) -> None:
        """The batch's actions into the region, one copy per leaf (then :meth:`command_all`)."""
        region_actions = self.region.actions
        if len(region_actions) == 1:  # the common case, without a loop
            region_actions[0][...] = actions[0]
            return
        for batch, action in zip(region_actions, actions, strict=True):
            batch[...] = action

    def in_flight(self, worker_id: int) -> bool:
        """Whether worker ``worker_id`` has a step on the path that it has not answered yet."""
        return worker_id in self._in_flight

    # -- replies ---------------------------------------------------------------------------
    def reply(self, worker_id: int) -> Message | None:
        """What worker ``worker_id``'s words say now: its RESULT, ``None`` (a message is its reply), or ``NOT_YET``.

        Its rewards and flags are views of the worker's rows, its observations already in the
        batch, and its infos (status ``INFOS``) read from its info rows. Raises ``ProtocolError``
        naming the worker for words no worker of ours writes.
        """
        sent = self._in_flight.get(worker_id)
        if sent is None:
            return NOT_YET
        rows = self.region.workers[worker_id]
        reply = rows.reply
        counter = reply[COUNTER]
        if counter != sent[0]:
            if counter > sent[0]:
                raise self._stray(worker_id, f"a reply with counter {counter}", sent)
            return NOT_YET
        status = reply[STATUS]
        if status == STEPPING:
            return NOT_YET
        if status == MESSAGE:
            return None
        layout = self._layouts.get(worker_id)
        if status not in (DONE, INFOS) or (status == INFOS and layout is None):
            raise self._stray(worker_id, f"a reply with status {status}", sent)
        infos = None if status == DONE else read_infos(rows.infos, layout)  # type: ignore[arg-type]
        msg = self._replies[worker_id] = Message(
            Kind.RESULT, {"seq": sent[1]}, self._fields[worker_id], _NO_INFOS, infos
        )
        return msg

    def taken(self, worker_id: int, msg: Message) -> None:
        """A reply of worker ``worker_id`` was taken (kept by the pool first): if it is its step's, the step is over."""
        if self._replies.get(worker_id) is msg:
            del self._replies[worker_id]
            self._in_flight.pop(worker_id, None)

    def await_reply(self, worker_id: int, wait: float) -> Message | None:
        """:meth:`reply`, waited for (:meth:`await_words`) within ``wait`` seconds.

        Returns ``NOT_YET`` when ``wait`` passed, or when anything else needs the pool's receive
        loop (a message arrived, the wake socket closed).
        """
        reply = self.reply(worker_id)
        if reply is NOT_YET and self.await_words(worker_id, wait):
            reply = self.reply(worker_id)
        return reply

    def await_words(self, worker_id: int, wait: float) -> bool:
        """Wait until worker ``worker_id``'s words answer its step in flight: spin, then block on its wake socket.

        Whether they do, within ``wait`` seconds (False also when anything else needs the
        pool's receive loop: a message arrived, the wake socket closed). Words past the step
        in flight end the wait too: :meth:`reply` names them.
        """
        counter = self._in_flight[worker_id][0]
        words = self.region.workers[worker_id].reply
        if _answered(words, counter):
            return True
        spin = self.spin
        clock = time.perf_counter
        started = spin.begin()
        bound = spin.bound()
        if bound > 0:
            deadline, polls = started + bound, 0
            while True:
                if _answered(words, counter):
                    spin.end(caught=True)
                    return True
                polls += 1
                if polls % _POLLS_PER_CLOCK == 0:
                    if clock() >= deadline:
                        break
                    yield_core()
        command = self.region.workers[worker_id].command
        command[LEARNER_WAITS] = 1
        try:
            fence()  # our word, visible before we read the worker's status (it writes, fences, reads ours)
            blocked_until = started + wait
            identity = self._members.identities[worker_id]
            while not (answered := _answered(words, counter)) and clock() < blocked_until:
                if not self._channel.await_wake_up(identity):
                    break
        finally:
            command[LEARNER_WAITS] = 0
        if answered:
            spin.end(caught=False)
        return answered

    # -- the lockstep step (clusterenv.learner.lockstep) ------------------------------------
    def final_status(self, worker_id: int) -> int | None:
        """``DONE`` or ``INFOS`` if worker ``worker_id``'s words answer its step in flight with its results in the rows.

        ``None`` for anything else (a message follows, not answered yet, words to be named
        as strays): the pool's receive loop reads those as it reads every reply.
        """
        words = self.region.workers[worker_id].reply
        # The counter first: a worker starting this step writes STEPPING before it, so a status read after the
        # counter matched is this step's (read before, it may be the previous step's final one).
        if words[COUNTER] != self._in_flight[worker_id][0]:
            return None
        status = words[STATUS]
        return status if status == DONE or (status == INFOS and worker_id in self._layouts) else None

    def infos_in_rows(self, worker_id: int) -> PackedInfos:
        """The infos worker ``worker_id`` wrote into its info rows (its status is ``INFOS``)."""
        return read_infos(self.region.workers[worker_id].infos, self._layouts[worker_id])

    def batch_infos(self) -> dict[str, Any] | None:
        """The batch's infos straight from the info rows, when every worker's layout is the same scalars; else ``None``.

        For a step every worker answered with ``INFOS``: each env then reported every key.
        """
        shared = self._batch_infos
        return None if shared is None else shared[0].batch(shared[1])

    def _share_scalar_infos(self) -> None:
        """After a worker named a layout: the one every worker named, if all named the same scalars."""
        scalars = self._scalar_infos.get(0)
        if scalars is None or any(self._scalar_infos.get(w) != scalars for w in self._workers):
            self._batch_infos = None
        else:
            self._batch_infos = (scalars, scalars.rows(self.region.infos))

    def all_taken(self) -> None:
        """Every worker's step in flight was read from its words (:meth:`final_status`): every step is over."""
        self._in_flight.clear()
        self._replies.clear()

    def in_flight_workers(self) -> list[int]:
        """The workers with a step on the path not answered yet."""
        return list(self._in_flight)

    def ask_wake_ups(self, worker_ids: Iterable[int]) -> list[int]:
        """Raise the *waits* word of those of ``worker_ids`` with a step in flight (the learner is about to block).

        Fenced: a worker that answers after this sees the word and wakes the learner; one that
        answered before shows it in its words, which the caller reads next.
        """
        asked = [w for w in worker_ids if w in self._in_flight]
        for worker_id in asked:
            self.region.workers[worker_id].command[LEARNER_WAITS] = 1
        if asked:
            fence()
        return asked

    def stop_wake_ups(self, worker_ids: Iterable[int]) -> None:
        """Lower the *waits* words that :meth:`ask_wake_ups` raised."""
        for worker_id in worker_ids:
            self.region.workers[worker_id].command[LEARNER_WAITS] = 0

    def woken(self, worker_id: int) -> Message | None:
        """A wake-up the pool read for worker ``worker_id``: its RESULT if its words say so, else ``None``."""
        reply = self.reply(worker_id)
        return None if reply is NOT_YET else reply

    def completed(self, worker_id: int, msg: Message) -> Message:
        """The RESULT that a message naming a step (its infos) from worker ``worker_id`` completes."""
        sent = self._in_flight.get(worker_id)
        if sent is None or msg.meta["step"] != sent[0]:
            raise self._stray(worker_id, f"a message for step {msg.meta['step']}", sent)
        if "info_layout" in msg.meta:
            try:
                self._layouts[worker_id] = layout = check_layout(msg.meta["info_layout"])
                self._scalar_infos[worker_id] = scalar_infos(layout)
                self._share_scalar_infos()
            except ValueError as exc:
                raise ProtocolError(f"Worker {worker_id} named an invalid info layout: {exc}") from None
        meta = {key: value for key, value in msg.meta.items() if key not in ("step", "info_layout")}
        result = self._replies[worker_id] = Message(Kind.RESULT, meta, self._fields[worker_id], msg.blobs)
        return result

    @staticmethod
    def _stray(worker_id: int, what: str, sent: tuple[int, int] | None) -> ProtocolError:
        expected = "no step in flight" if sent is None else f"its step in flight is {sent[0]}"
        return ProtocolError(
            f"Worker {worker_id} sent a shared-memory step reply that answers no command of its: {what}; {expected}."
        )

    def close(self) -> None:
        """Close the region's file (the batch stays readable while views of it live); give back the spinners' seats."""
        if self._seats is not None:
            self._seats.release()
        self.region.close()


def _answered(words: memoryview, counter: int) -> bool:
    """Whether a worker's reply ``words`` answer step ``counter`` (or name a later one, a stray), its status final."""
    answered = words[COUNTER]
    return answered > counter or (answered == counter and words[STATUS] != STEPPING)
