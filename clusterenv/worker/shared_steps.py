"""The worker's side of the shared step path (:mod:`clusterenv.wire.step_region`): SHARE_STEP and WAKE_UP.

After SHARE_STEP, the worker's envs write their observations into the learner's batch in
the region, and a new command counter in its header is a STEP whose actions are in the
worker's rows. The worker steps its envs exactly as for a STEP message, writes rewards and
flags (and infos that fit the layout it named) into its rows and sets its reply status;
only a step with something the region has no place for (other infos, a new layout, a usage
report) sends a message first, with the infos the message path would have sent. An error
is an ERROR message, as on the message path.

Between steps the worker spins on its command counter for a while
(:class:`~clusterenv.wire.waiting.SpinBudget`) and steps again as soon as it changes, with
no system call at all; past the bound it raises the header's *waits* word
(:meth:`_SharedStepper.sleep`) and blocks in one read of its pipe, where the learner's
messages and its wake-ups (records of no frames) come, in order. A read that brings
wake-ups alone steps again at once; anything else (a message, nothing within the mailbox's
bound) goes back to the mailbox, which reads it in order. A wake-up only says "read the
counter": one that finds no new command is ignored.
"""

from __future__ import annotations

import os
import time

import numpy as np

from clusterenv.stepping.failures import EnvFailure, error_reply
from clusterenv.stepping.recording_env import RecordingVectorEnv, dumps
from clusterenv.wire.infos import pack_infos
from clusterenv.wire.leaves import unflatten
from clusterenv.wire.messages import ResultMeta, StepRegionMeta, ValueMeta, meta_of
from clusterenv.wire.protocol import Kind, Message
from clusterenv.wire.step_region import (
    CALL,
    COUNTER,
    DONE,
    INFOS,
    LEARNER_WAITS,
    MESSAGE,
    MESSAGES,
    STATUS,
    STEPPING,
    WORKER_WAITS,
    InfoLayout,
    ScalarInfos,
    WorkerRows,
    attach_rows,
    fence,
    info_layout,
    scalar_infos,
    write_infos,
)
from clusterenv.wire.transport import WAKE_UP
from clusterenv.wire.waiting import SpinBudget, yield_core
from clusterenv.worker.commands import Worker
from clusterenv.worker.units import UnitsVectorEnv

__all__ = ["install_step_handlers"]

# Spin iterations between two reads of the clock (a read costs about as much as ten iterations).
_POLLS_PER_CLOCK = 16


class _SharedStepper:
    """One worker's rows of the region, and the handlers that use them."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.rows: WorkerRows | None = None
        self.layout: InfoLayout | None = None  # the info layout the learner was last told
        # That layout as typed fields of the info rows, if it is all scalars, and the rows seen through them.
        self.scalar_infos: tuple[ScalarInfos, np.ndarray] | None = None
        self.answered = 0  # the counter of the last command answered
        self.messages = 0  # the learner's message count when this worker last turned to its pipe
        self.spin = SpinBudget(0.0)

    def share(self, msg: Message) -> Message:
        """Map the region whose file came on the wake socket; reply whether this worker steps through it now."""
        worker = self.worker
        meta = meta_of(msg, StepRegionMeta)
        fd = worker.mailbox.channel.take_fd()
        envs = worker.envs
        self.leave()
        if fd is None:
            return Message(Kind.VALUE, ValueMeta(attached=False))
        # One process stepping exactly the rows named: env processes (procs_per_worker > 1) and
        # re-homed workers keep the message path.
        if (
            not isinstance(envs, (RecordingVectorEnv, UnitsVectorEnv))
            or worker.tag
            or meta["stop"] - meta["start"] != envs.num_envs
        ):
            os.close(fd)
            return Message(Kind.VALUE, ValueMeta(attached=False))
        try:
            rows = attach_rows(fd, meta, envs.single_observation_space, envs.single_action_space)
        except (KeyError, TypeError, ValueError, OSError):
            rows = None
        if rows is not None:
            envs.observe_into(unflatten(envs.single_observation_space, rows.observations))
            worker.shared_obs = True
            self.rows = rows
            spin_us = meta["spin_us"]
            self.spin = SpinBudget(None if spin_us is None else max(0.0, float(spin_us)) * 1e-6)
            worker.mailbox.waiter = self
        return Message(Kind.VALUE, ValueMeta(attached=rows is not None))

    def leave(self) -> None:
        """Off the path (a new SHARE_STEP, or none): counters from zero, the mailbox blocks as it did."""
        self.rows, self.layout, self.scalar_infos = None, None, None
        self.answered = self.messages = 0
        if self.worker.mailbox.waiter is self:
            self.worker.mailbox.waiter = None

    # -- waiting, with the mailbox ---------------------------------------------------------
    def sleep(self) -> Message | None:
        """Before the mailbox blocks: raise the *waits* word; a WAKE_UP if a command came meanwhile."""
        rows = self.rows
        assert rows is not None
        self.messages = rows.command[MESSAGES]  # the mailbox reads every message sent so far
        rows.reply[WORKER_WAITS] = 1
        fence()  # the learner's counter, read after our word is visible (it writes, fences, reads ours)
        if rows.command[COUNTER] != self.answered:
            rows.reply[WORKER_WAITS] = 0
            return WAKE_UP
        return None

    def awake(self) -> None:
        """The mailbox returned: the learner need not wake this worker."""
        if self.rows is not None:
            self.rows.reply[WORKER_WAITS] = 0

    def _await_command(self) -> bool:
        """Spin until a new command (True), or until a message waits or the bound passes (False)."""
        rows = self.rows
        assert rows is not None
        spin = self.spin
        bound = spin.bound()
        if bound <= 0:
            return False
        command, answered, messages = rows.command, self.answered, self.messages
        clock = time.perf_counter
        deadline = spin.begin() + bound  # the wait ends with the next command, however it comes (:meth:`step`)
        polls = 0
        while True:
            if command[COUNTER] != answered:
                spin.end(caught=True)
                return True
            if command[MESSAGES] != messages:
                return False
            polls += 1
            if polls % _POLLS_PER_CLOCK == 0:
                if clock() > deadline:
                    return False
                yield_core()

    def _sleep_until_command(self, rows: WorkerRows) -> bool:
        """Block for the next command as the mailbox would, without a turn of the worker's loop: whether it came.

        It came when a wake-up alone arrived and the counter moved; anything else (a message,
        a wake-up that found nothing new, no wake-up within the mailbox's bound) goes back to
        the mailbox, which reads it in order.
        """
        if self.sleep() is not None:  # it came meanwhile
            return True
        try:
            woken = self.worker.mailbox.await_wake_up()
        finally:
            self.awake()
        return woken and rows.command[COUNTER] != self.answered

    # -- stepping --------------------------------------------------------------------------
    def step(self, msg: Message) -> Message | None:
        """A wake-up, or a command seen while waiting: serve every command that comes while spinning or blocked.

        Replies are sent here, each before its status; nothing is left for the mailbox to send.
        """
        rows = self.rows
        if rows is None:
            return error_reply(EnvFailure(None, "ProtocolError", "A shared-memory step before SHARE_STEP.", ""))
        while rows.command[COUNTER] != self.answered:  # else a wake-up that found nothing new
            self.spin.end(caught=False)  # a wait that outlasted its spin counts whole: blocked, or in the mailbox
            self._step(rows)
            if not self._await_command() and not self._sleep_until_command(rows):
                break
        return None

    def _step(self, rows: WorkerRows) -> None:
        """Answer the command in the rows: results written, a message if they need one, the status, a wake-up."""
        worker = self.worker
        counter = rows.command[COUNTER]
        worker.mailbox.seq = rows.command[CALL]  # what any message about this step (infos, an error) carries
        worker.tracker.forget()
        # The learner takes the observations it received last from here, should this process die mid-step.
        rows.save_observations()
        rows.reply[STATUS] = STEPPING
        rows.reply[COUNTER] = counter
        try:
            reply = self._results(rows, counter)
        except Exception as exc:
            reply = worker.failure_reply(exc)
        status = DONE if reply is None else INFOS if reply is _IN_ROWS else MESSAGE
        if status == MESSAGE:
            assert isinstance(reply, Message)
            worker.send_reply(reply)
        self.answered = counter
        rows.reply[STATUS] = status
        fence()  # our status, visible before we read whether the learner sleeps (it raises, fences, reads ours)
        if rows.command[LEARNER_WAITS]:
            worker.mailbox.channel.wake()

    def _results(self, rows: WorkerRows, counter: int) -> Message | object | None:
        """Step the envs with the rows' actions; ``None``: all in the rows; ``_IN_ROWS``: infos too; else a RESULT."""
        envs = self.worker.envs
        assert isinstance(envs, (RecordingVectorEnv, UnitsVectorEnv))
        # Copies: env code may write into its action, and the rows are the learner's to write next.
        actions = unflatten(envs.single_action_space, [row.copy() for row in rows.actions])
        envs.step_into(actions, rows.rewards, rows.terminations, rows.truncations)
        log = envs.info_log
        if log:
            envs.info_log = []
        usage = envs.step_clock.report()  # once a second at most
        if not log and usage is None:
            return None
        scalars = self.scalar_infos
        if usage is None and scalars is not None and type(log) is list and scalars[0].write(scalars[1], log):
            return _IN_ROWS  # the layout's scalars, env by env, written straight into the rows
        payload = pack_infos(log, envs.num_envs, min_envs=1) if log else None
        layout = None if payload is None else info_layout(payload)
        if usage is None and layout is not None and layout == self.layout:
            write_infos(rows.infos, payload)  # type: ignore[arg-type]
            return _IN_ROWS
        meta = ResultMeta(step=counter)
        if usage is not None:
            meta["usage"] = usage
        if layout is not None and layout != self.layout:  # from the next step on, such infos go in the region
            meta["info_layout"] = layout  # msgpack writes its tuples as lists; the learner checks them
            self.layout = layout
            fields = scalar_infos(layout)
            self.scalar_infos = None if fields is None else (fields, fields.rows(rows.infos))
        return Message(Kind.RESULT, meta, [], [dumps(payload) if payload is not None else b""])


# ``_results``' answer for a step whose infos went into the info rows.
_IN_ROWS = object()


def install_step_handlers(worker: Worker) -> None:
    """Add the shared step path's handlers to ``worker``."""
    stepper = _SharedStepper(worker)
    worker.handlers[Kind.SHARE_STEP] = stepper.share
    worker.handlers[Kind.WAKE_UP] = stepper.step
