"""The worker's side of the shared step path (:mod:`clusterenv.wire.step_region`): SHARE_STEP and WAKE_UP.

After SHARE_STEP, the worker's envs write their observations into the learner's batch in
the region, and a wake-up byte from the learner is a STEP whose actions are in the
worker's rows. The worker steps its envs exactly as for a STEP message, writes rewards and
flags into its rows and wakes the learner; only a step with something the region has no
place for (infos, a usage report) sends a message first, with the infos the message path
would have sent. An error is an ERROR message, as on the message path, also followed by a
wake-up.
"""

from __future__ import annotations

import os

from clusterenv.wire.infos import pack_infos
from clusterenv.wire.leaves import unflatten
from clusterenv.wire.messages import ResultMeta, StepRegionMeta, ValueMeta, meta_of
from clusterenv.wire.protocol import Kind, Message
from clusterenv.wire.step_region import (
    DONE,
    INFOS,
    MESSAGE,
    InfoLayout,
    WorkerRows,
    attach_rows,
    info_layout,
    write_infos,
)
from clusterenv.worker.commands import Worker
from clusterenv.worker.failures import EnvFailure, error_reply
from clusterenv.worker.recording_env import RecordingVectorEnv, dumps
from clusterenv.worker.units import UnitsVectorEnv

__all__ = ["ends_with_wake_up", "install_step_handlers"]


class _SharedStepper:
    """One worker's rows of the region, and the handlers that use them."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.rows: WorkerRows | None = None
        self.layout: InfoLayout | None = None  # the info layout the learner was last told

    def share(self, msg: Message) -> Message:
        """Map the region whose file came on the wake socket; reply whether this worker steps through it now."""
        worker = self.worker
        meta = meta_of(msg, StepRegionMeta)
        fd = worker.mailbox.channel.take_fd()
        envs = worker.envs
        self.rows, self.layout = None, None
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
        return Message(Kind.VALUE, ValueMeta(attached=rows is not None))

    def step(self, msg: Message) -> Message | None:
        """Step with the actions in this worker's rows; the reply message, if the rows cannot hold it all.

        The process wakes the learner after any reply message (:data:`~clusterenv.wire.step_region.MESSAGE`)
        or none (:data:`~clusterenv.wire.step_region.DONE`): see :func:`ends_with_wake_up`.
        """
        rows, worker = self.rows, self.worker
        if rows is None:
            return error_reply(EnvFailure(None, "ProtocolError", "A shared-memory step before SHARE_STEP.", ""))
        counter, call = int(rows.command[0]), int(rows.command[1])
        worker.mailbox.seq = call  # what any message about this step (infos, an error) carries
        envs = worker.envs
        assert isinstance(envs, (RecordingVectorEnv, UnitsVectorEnv))
        rows.reply[1] = MESSAGE  # until the results are in: an error's reply is a message
        rows.reply[0] = counter
        # Copies: env code may write into its action, and the rows are the learner's to write next.
        actions = unflatten(envs.single_action_space, [row.copy() for row in rows.actions])
        _, rewards, terminations, truncations, _ = envs.step(actions)
        rows.rewards[:] = rewards
        rows.terminations[:] = terminations
        rows.truncations[:] = truncations
        log, envs.info_log = envs.info_log, []
        usage = envs.step_clock.report()  # once a second at most
        if not log and usage is None:
            rows.reply[1] = DONE
            return None
        payload = pack_infos(log, envs.num_envs, min_envs=1) if log else None
        layout = None if payload is None else info_layout(payload)
        if usage is None and layout is not None and layout == self.layout:
            write_infos(rows.infos, payload)  # type: ignore[arg-type]
            rows.reply[1] = INFOS
            return None
        meta = ResultMeta(step=counter)
        if usage is not None:
            meta["usage"] = usage
        if layout is not None and layout != self.layout:  # from the next step on, such infos go in the region
            meta["info_layout"] = [list(key) for key in layout]
            self.layout = layout
        return Message(Kind.RESULT, meta, [], [dumps(payload) if payload is not None else b""])


def ends_with_wake_up(msg: Message) -> bool:
    """Whether handling ``msg`` ends with a wake-up for the learner, after its reply message if any."""
    return msg.kind is Kind.WAKE_UP


def install_step_handlers(worker: Worker) -> None:
    """Add the shared step path's handlers to ``worker``."""
    stepper = _SharedStepper(worker)
    worker.handlers[Kind.SHARE_STEP] = stepper.share
    worker.handlers[Kind.WAKE_UP] = stepper.step
