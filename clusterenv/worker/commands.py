"""A worker's command handlers: the ``Worker`` (its envs and the handler per message kind) and its ``Mailbox``.

The process around them (joining, the receive loop, the heartbeat) is
:mod:`clusterenv.worker.process`; the local-policy commands add their handlers from
:mod:`clusterenv.worker.local_policy`.
"""

from __future__ import annotations

import logging
import pickle
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import cloudpickle
import numpy as np
import zmq
from gymnasium.vector import AutoresetMode

from clusterenv.stepping.failures import EnvFailure, EnvTracker, error_reply
from clusterenv.stepping.recording_env import RecordingVectorEnv, dumps, learner_registry, reset_envs
from clusterenv.wire.infos import pack_infos
from clusterenv.wire.leaves import batch_of_items, is_array_tree, leaf_arrays, unflatten
from clusterenv.wire.messages import (
    CallMeta,
    InitMeta,
    PlaceMeta,
    ResetMeta,
    ResultMeta,
    ShareObsMeta,
    ValueMeta,
    meta_of,
)
from clusterenv.wire.pipes import PipeClosed
from clusterenv.wire.protocol import Kind, Message
from clusterenv.wire.transport import Channel
from clusterenv.worker.env_processes import ChildEnvError, ProcVectorEnv
from clusterenv.worker.units import UnitsVectorEnv, build_worker_envs

__all__ = ["Mailbox", "Waiter", "Worker"]

logger = logging.getLogger(__name__)


# How long a worker waits for a command before its loop checks that its learner still exists.
IDLE_CHECK_INTERVAL_S = 0.5


class Waiter(Protocol):
    """What the mailbox tells before and after it blocks (the shared step path's *waits* word)."""

    def sleep(self) -> Message | None:
        """About to block: a message to handle at once instead (a command that came meanwhile), if any."""

    def awake(self) -> None:
        """The blocking receive returned."""


class Mailbox:
    """The worker process's side of the channel, with a queue so that a long command can read what arrives meanwhile.

    A prefetched rollout calls :meth:`poll` between steps: kinds in ``urgent`` (new
    weights, the learner's probe outputs) are handled at once; a CLOSE jumps the queue
    and sets ``closing``; anything else waits its turn.

    A process serves its own worker's envs, and (``on_worker_failure="rehome"``) those of lost
    workers that the learner moved onto it, each as a :class:`Worker` of its own: a message
    whose meta names a ``slot`` is for that worker, and its replies name the slot back.
    """

    def __init__(self, channel: Channel, make_worker: Callable[[int], Worker]) -> None:
        self.channel = channel
        self._make_worker = make_worker
        #: The process's own worker (the one it joined as; its id comes with its INIT).
        self.worker = self._new_worker(-1)
        #: The workers re-homed onto this process, by slot.
        self.hosted: dict[int, Worker] = {}
        self.queue: deque[Message] = deque()
        self.closing = False
        self.seq: Any = None  # of the command being handled: the learner matches replies by it
        #: Told before and after each blocking receive (the shared step path, while this process is on it).
        self.waiter: Waiter | None = None

    def worker_for(self, msg: Message) -> Worker:
        """The worker whose envs ``msg`` is for; an INIT naming a new slot creates it."""
        slot = msg.meta.get("slot")
        if slot is None:
            return self.worker
        worker = self.hosted.get(slot)
        if worker is None:
            worker = self._new_worker(slot)
            worker.tag = {"slot": slot}
            if msg.kind is Kind.INIT:
                self.hosted[slot] = worker
        return worker

    def _new_worker(self, worker_id: int) -> Worker:
        worker = self._make_worker(worker_id)
        worker.mailbox = self
        return worker

    def drop(self, slot: int) -> None:
        """Close the envs this process steps for worker ``slot``: the learner moved them to another process."""
        worker = self.hosted.pop(slot, None)
        if worker is not None:
            worker.close()

    @property
    def workers(self) -> list[Worker]:
        """Every worker this process serves."""
        return [self.worker, *self.hosted.values()]

    def take(self, timeout: float) -> Message | None:
        """The next command: queued first, else from the socket within ``timeout`` seconds."""
        if self.queue:
            return self.queue.popleft()
        waiter = self.waiter
        if waiter is None:
            received = self.channel.recv(timeout, routed=False)
        else:
            ready = waiter.sleep()
            if ready is not None:
                return ready
            try:
                received = self.channel.recv(timeout, routed=False)
            finally:
                waiter.awake()
        return None if received is None else received[1]

    def await_wake_up(self) -> bool:
        """Block for a wake-up alone, as :meth:`take` would block: whether one came.

        ``False`` when anything else is to be read first (a queued or arriving message, or none
        within :data:`IDLE_CHECK_INTERVAL_S`): :meth:`take` returns it next. The shared step
        path waits here between its steps, without a turn of the worker's loop.
        """
        return not self.queue and self.channel.await_wakes(IDLE_CHECK_INTERVAL_S)

    def poll(self) -> None:
        """Read what has arrived, without waiting."""
        while (received := self.channel.recv(0, routed=False)) is not None:
            msg = received[1]
            if msg.kind is Kind.CLOSE and "slot" not in msg.meta:
                self.closing = True
                self.queue.appendleft(msg)
                continue
            worker = self.worker_for(msg)
            if msg.kind in worker.urgent:
                worker.handle(msg)
            else:
                self.queue.append(msg)

    def send(self, reply: Message, sender: Worker) -> None:
        """Send ``sender``'s reply to the command being handled (or a message of its own, a weight pull)."""
        self.channel.send(reply.kind, {**reply.meta, **sender.tag, "seq": self.seq}, reply.arrays, reply.blobs)


class Worker:
    """Command handlers for one worker; each returns the reply to send (``None``: no reply)."""

    def __init__(self, worker_id: int, procs: int | None = None) -> None:
        self.worker_id = worker_id
        self.procs = procs  # env processes asked for on the command line (else the learner's procs_per_worker)
        self.env_offset = 0
        self.envs: RecordingVectorEnv | UnitsVectorEnv | ProcVectorEnv | None = None
        self.array_obs = True
        self.tracker = EnvTracker()  # which env the command being handled reached, should one raise
        self.handlers: dict[Kind, Callable[[Message], Message | None]] = {
            Kind.INIT: self.init,
            Kind.RESET: self.reset,
            Kind.STEP: self.step,
            Kind.CALL: self.call,
            Kind.SET_ATTR: self.set_attr,
            Kind.SHARE_OBS: self.share_obs,
            Kind.PLACE: self.place,
        }
        self.shared_obs = False  # observations are written into the learner's shared batch
        self.never_reset = True  # a fresh (or replacement) worker's envs have no observation yet
        self.urgent: set[Kind] = set()  # kinds a long command handles as soon as they arrive (Mailbox.poll)
        self.tag: dict[str, int] = {}  # what its messages carry to name it: a re-homed worker's slot
        self.mailbox: Mailbox

    # -- lifecycle -------------------------------------------------------------------------
    def init(self, msg: Message) -> Message:
        """Build this worker's envs from the pickled factories and describe their spaces.

        The first blob is the context the factories need: the learner's env registry, and
        the single observation space when the learner was given one (``observation_mode``
        as a ``(batch space, single space)`` tuple). The factories follow.
        """
        meta = meta_of(msg, InitMeta)
        self.env_offset = meta["env_offset"]
        procs = self.procs if self.procs is not None else meta["procs_per_worker"]
        context = pickle.loads(msg.blobs[0])
        mode = context["observation_space"] if meta["observation_mode"] == "custom" else meta["observation_mode"]
        autoreset_mode, env_blobs = AutoresetMode(meta["autoreset_mode"]), list(msg.blobs[1:])
        with learner_registry(context["registry"]):
            if procs > 1:  # each env process installs the registry too, and builds its part
                self.envs = ProcVectorEnv(
                    env_blobs,
                    procs,
                    observation_mode=mode,
                    autoreset_mode=autoreset_mode,
                    env_offset=self.env_offset,
                    registry=context["registry"],
                    max_env_errors=meta["max_env_errors"],
                )
            else:  # single envs, or units (vector envs) among them
                self.envs = build_worker_envs(
                    env_blobs, mode, autoreset_mode, self.tracker, meta["max_env_errors"], meta["entry_offset"]
                )
        if meta["replacement"] and self.envs.autoreset_mode is AutoresetMode.NEXT_STEP:
            # A replacement for a lost worker: its envs' episodes were cut short, so under
            # NEXT_STEP their next step is the autoreset step (see docs/guides/fault-tolerance.md).
            self.envs.mark_autoreset_pending()
        self.array_obs = is_array_tree(self.envs.single_observation_space)
        return Message(Kind.READY, blobs=[cloudpickle.dumps(self.envs.description())])

    def place(self, msg: Message) -> Message:
        """Learn the global index of this worker's first env (its units' sizes were unknown at INIT)."""
        self.env_offset = meta_of(msg, PlaceMeta)["env_offset"]
        return Message(Kind.VALUE)

    # -- stepping --------------------------------------------------------------------------
    def _result(self, obs: Any, extra: list[np.ndarray]) -> Message:
        assert self.envs is not None
        log, self.envs.info_log = self.envs.info_log, []
        framed = self.array_obs and not self.shared_obs
        arrays = (leaf_arrays(self.envs.single_observation_space, obs) if framed else []) + extra
        blobs = [b""] if not log else [dumps(pack_infos(log, self.envs.num_envs))]
        if not self.array_obs:
            blobs.append(dumps(self.envs.env_observations()))
        usage = self.envs.step_clock.report()  # once a second at most
        return Message(Kind.RESULT, {} if usage is None else ResultMeta(usage=usage), arrays, blobs)

    def reset(self, msg: Message) -> Message:
        """Reset the envs (those in the mask, if any) with their seeds, and one options dict or one per env."""
        assert self.envs is not None
        meta = meta_of(msg, ResetMeta)
        options = pickle.loads(msg.blobs[0]) if msg.blobs else None
        obs = reset_envs(self.envs, meta["seeds"], options, meta["mask"])
        self.never_reset = False
        return self._result(obs, [])

    def step(self, msg: Message) -> Message:
        """Step every env with its slice of the actions: leaf arrays, or pickled per-env actions."""
        assert self.envs is not None
        if msg.blobs:  # actions without a fixed array form: each env gets the very object the learner was given
            actions = batch_of_items(self.envs.action_space, pickle.loads(msg.blobs[0]))
        else:
            # Copies: env code may write into its action, and received frames are read-only.
            actions = unflatten(self.envs.single_action_space, [a.copy() for a in msg.arrays])
        obs, rewards, terminations, truncations, _ = self.envs.step(actions)
        return self._result(obs, [rewards, terminations, truncations])

    def share_obs(self, msg: Message) -> Message:
        """Write observations into the learner's shared batch from now on, if it can be mapped here."""
        assert self.envs is not None
        meta = meta_of(msg, ShareObsMeta)
        if self.array_obs and meta["stop"] - meta["start"] == self.envs.num_envs:
            self.shared_obs = self.envs.share_observations(meta) or self.shared_obs
        return Message(Kind.VALUE, ValueMeta(attached=self.shared_obs))

    # -- attributes ------------------------------------------------------------------------
    def call(self, msg: Message) -> Message:
        """Call (or read) an attribute of the envs in ``indices`` (all: ``None``), or apply a function to them."""
        assert self.envs is not None
        args, kwargs = pickle.loads(msg.blobs[0])
        meta = meta_of(msg, CallMeta)
        results = self.envs.call_at(meta["indices"], meta["name"], args, kwargs)
        return Message(Kind.VALUE, blobs=[cloudpickle.dumps(results)])

    def set_attr(self, msg: Message) -> Message:
        """Set an attribute on the envs in ``indices`` (all: ``None``), one value each."""
        assert self.envs is not None
        meta = meta_of(msg, CallMeta)
        assert meta["name"] is not None
        self.envs.set_attr_at(meta["indices"], meta["name"], list(pickle.loads(msg.blobs[0])))
        return Message(Kind.VALUE, blobs=[cloudpickle.dumps(None)])

    def send(self, reply: Message) -> None:
        """Send a message of this worker's own (a weight pull) outside the command-reply pattern."""
        self.mailbox.send(reply, self)

    def failure_reply(self, exc: BaseException) -> Message:
        """The ERROR reply for ``exc``, raised by env code while this worker handled a command."""
        if isinstance(exc, ChildEnvError):  # raised in an env process, which captured it
            failure = exc.failure
        else:
            misfit = self.envs.misfit_observation if isinstance(self.envs, RecordingVectorEnv) else None
            failure = EnvFailure.capture(exc, self.tracker, misfit)
        return error_reply(failure.shifted(self.env_offset))

    def send_reply(self, reply: Message) -> None:
        """Send a reply; one that cannot be encoded is answered by an ERROR saying so: it must not end the worker."""
        try:
            self.mailbox.send(reply, self)
        except (PipeClosed, zmq.ZMQError):
            raise
        except Exception as exc:
            if reply.kind is Kind.ERROR:
                raise  # error replies are bounded (stepping/failures.py): this would be a bug, not an env's doing
            logger.warning("Worker %d: its %s reply could not be sent: %s", self.worker_id, reply.kind.name, exc)
            self.mailbox.send(self.failure_reply(exc), self)

    def close(self) -> None:
        """Close the envs."""
        if self.envs is not None:
            self.envs.close()

    def terminate(self) -> None:
        """End the env processes now, if any, without closing their envs (the learner is gone)."""
        if isinstance(self.envs, ProcVectorEnv):
            self.envs.terminate()

    def handle(self, msg: Message) -> Message | None:
        """Run the handler for ``msg`` and return the reply."""
        handler = self.handlers.get(msg.kind)
        if handler is None:
            return error_reply(EnvFailure(None, "ProtocolError", f"Worker cannot handle {msg.kind.name}.", ""))
        if msg.kind is not Kind.INIT and self.envs is None:
            return error_reply(EnvFailure(None, "ProtocolError", f"{msg.kind.name} before INIT.", ""))
        return handler(msg)
