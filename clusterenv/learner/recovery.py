"""Recovery: what a lost worker means, decided as a plan that the pool carries out.

A part the :class:`~clusterenv.learner.pool.WorkerPool` holds. When a gather or a streaming
receive finds workers lost (a process that exited, or whose heartbeat connection dropped),
:meth:`Recovery.plan` returns one :class:`Step` per worker: restart it in a new process
(``on_worker_failure="restart"``), re-home its envs to the surviving process that carries
the fewest (``"rehome"``), or raise ``WorkerLostError``. Each step carries the worker's
pending command, whose sender declared what a loss means for it
(:class:`~clusterenv.learner.commands.OnLoss`: replay, interrupt, re-issue, raise).

The pool carries the plan out in its own receive loop: it starts the new host (or has
:meth:`Recovery.rehome` pick one), sends the INIT that rebuilds the envs (flagged
``replacement``), the restart hooks' follow-ups (a policy runner's weights), and then
replays the pending command or records the cut. A replacement lost while any of that is
under way is one more step of the same plan, :meth:`Recovery.lost_again`, which raises:
restarts do not loop.

This module also turns an ERROR reply into the exception the caller sees.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from clusterenv.errors import RemoteEnvError, WorkerLostError, builtin_exception_type, remote_error_type
from clusterenv.launch.launchers import Launcher
from clusterenv.learner.commands import OnLoss, SentCommand
from clusterenv.learner.heartbeat_monitor import HeartbeatMonitor
from clusterenv.learner.membership import Membership
from clusterenv.wire.messages import ErrorMeta, meta_of
from clusterenv.wire.protocol import Kind, Message

__all__ = ["LOST_AGAIN", "Action", "Recovery", "Step", "remote_error"]

logger = logging.getLogger(__name__)

#: What a lost-worker error adds when the worker's replacement (or new host) was lost too.
LOST_AGAIN = " Its replacement was lost too; restarts do not loop."
# How long a worker whose connection dropped may take to report its exit status (it lingers up to 0.5 s).
_EXIT_STATUS_WAIT_S = 1.0


class Action(enum.Enum):
    """What is done for one lost worker."""

    RESTART = "restart"  # a new process, its envs rebuilt from the same INIT
    REHOME = "rehome"  # its envs rebuilt in the surviving process that carries the fewest
    RAISE = "raise"  # nothing can stand in for it: WorkerLostError


@dataclass(frozen=True)
class Step:
    """One entry of a recovery plan.

    Attributes:
        worker_id: the lost worker.
        action: what is done for it.
        pending: its command still unanswered, to recover as its sender declared (``None``:
            it had answered; the restart hooks decide what its envs' loss means).
        why: for :attr:`Action.RAISE`, what the error says.
    """

    worker_id: int
    action: Action
    pending: SentCommand | None
    why: str = ""


class Recovery:
    """Tells lost workers apart and decides, per worker, what their loss means.

    Args:
        on_worker_failure: ``"raise"``, ``"restart"`` or ``"rehome"``.
        min_workers: under ``"rehome"``, the fewest surviving processes to go on with.
        members: who serves which worker, and which processes are gone.
        launcher: exit statuses and names of worker processes.
        monitor: what the heartbeat connections showed.
        describe_work: names what a worker was running, e.g. ``"envs 4..7"``.
    """

    def __init__(
        self,
        on_worker_failure: str,
        min_workers: int,
        *,
        members: Membership,
        launcher: Launcher,
        monitor: HeartbeatMonitor,
        describe_work: Callable[[int], str],
    ) -> None:
        self.on_worker_failure = on_worker_failure
        self.min_workers = min_workers
        self.describe_work = describe_work
        self._members = members
        self._launcher = launcher
        self._monitor = monitor

    # -- detection -----------------------------------------------------------------------------
    def lost_among(self, worker_ids: Iterable[int]) -> set[int]:
        """The workers among ``worker_ids`` whose process is lost."""
        serving = self._members.serving
        gone = self._members.gone({serving[w] for w in worker_ids})
        return {w for w in worker_ids if serving[w] in gone}

    def raises_at_once(self, worker_id: int, last: SentCommand | None) -> bool:
        """Whether a loss of ``worker_id`` raises as soon as it is seen, without waiting for the other replies.

        So under ``"raise"``, and for a worker whose envs were never built: a crash while
        building them would recur in a replacement.
        """
        return self.on_worker_failure == "raise" or last is None or last.kind is Kind.INIT

    # -- the plan ------------------------------------------------------------------------------
    def plan(self, lost: Iterable[int], last_sent: Mapping[int, SentCommand], idle: Iterable[int] = ()) -> list[Step]:
        """One :class:`Step` per lost worker, in worker order.

        Args:
            lost: the lost workers.
            last_sent: each worker's latest command.
            idle: workers among ``lost`` that had answered it (streaming calls notice losses
                of workers they are not waiting for): nothing of theirs is pending.
        """
        idle = set(idle)
        steps = []
        for worker_id in sorted(lost):
            sent = last_sent[worker_id]
            pending = None if worker_id in idle else sent
            if pending is not None and pending.on_loss is OnLoss.RAISE:
                why = f" {sent.kind.name} cannot be recovered on a replacement worker."
                steps.append(Step(worker_id, Action.RAISE, pending, why))
            elif self.on_worker_failure == "rehome":
                steps.append(self._rehome_step(worker_id, pending))
            else:
                steps.append(Step(worker_id, Action.RESTART, pending))
        return steps

    def _rehome_step(self, worker_id: int, pending: SentCommand | None) -> Step:
        too_few = self.too_few_survivors(self._members.serving[worker_id])
        return Step(worker_id, Action.RAISE, pending, too_few) if too_few else Step(worker_id, Action.REHOME, pending)

    def too_few_survivors(self, lost_process: int) -> str:
        """Why the run cannot go on without ``lost_process`` (fewer than ``min_workers`` survive), or ``""``."""
        survivors = [p for p in self._members.live_processes() if p != lost_process]
        if len(survivors) >= self.min_workers:
            return ""
        return f" {len(survivors)} worker processes survive, fewer than min_workers={self.min_workers}."

    def lost_again(self, step: Step) -> Step:
        """The step for a worker whose replacement (or new host) was lost while it was being recovered."""
        return Step(step.worker_id, Action.RAISE, step.pending, LOST_AGAIN)

    def rehome(self, worker_id: int) -> str:
        """Give worker ``worker_id``'s envs to the surviving process that carries the fewest; why it cannot, or ``""``.

        Its lost process is retired first; the survivors are counted again (another may have
        been lost since the plan). The pool then rebuilds the envs there.
        """
        process = self._members.serving[worker_id]
        if process not in self._members.retired:
            self._members.retire(process, self.how_lost(process))
        too_few = self.too_few_survivors(process)
        if too_few:
            return too_few
        target = self._members.least_loaded(self._members.live_processes())
        logger.warning(
            "Moving worker %d's envs (%s) to worker process %d (%s).",
            worker_id,
            self.describe_work(worker_id),
            target,
            self._launcher.describe(target),
        )
        self._members.assign(worker_id, target)
        return ""

    # -- explaining a loss ---------------------------------------------------------------------
    def how_lost(self, process: int) -> str:
        """Why a worker process is gone: its exit status, else what its heartbeat connection showed."""
        if process in self._members.retired:
            return self._members.retired[process]
        code = self._launcher.exit_code(process)
        # A worker that exits closes its connections first: give its exit status, the better cause, a moment.
        deadline = time.monotonic() + _EXIT_STATUS_WAIT_S
        while code is None and self._monitor.reason(process) is not None and time.monotonic() < deadline:
            time.sleep(0.02)
            code = self._launcher.exit_code(process)
        if code is not None:
            return f"exited with code {code}"
        return self._monitor.reason(process) or "is unreachable"

    def lost_error(self, worker_id: int, doing: str, why: str = "") -> WorkerLostError:
        """The ``WorkerLostError`` for worker ``worker_id``, lost while ``doing``."""
        process = self._members.serving.get(worker_id, worker_id)
        where = self._launcher.describe(process)
        if process != worker_id:
            where += f" (serving worker {worker_id})"
        return WorkerLostError(
            f"{where}, running {self.describe_work(worker_id)}, {self.how_lost(process)} while {doing}.{why}"
        )


def remote_error(worker_id: int | None, msg: Message, doing: str, loads: Callable[[bytes], Any]) -> RemoteEnvError:
    """The ``RemoteEnvError`` (also of the original exception's type, where it can be rebuilt) for an ERROR reply.

    ``worker_id``: the worker that sent it; ``None``: the learner's own envs (``learner_envs``), whose
    errors are encoded as a worker's (:mod:`clusterenv.learner.worker_like`).
    """
    meta = meta_of(msg, ErrorMeta)
    cause: BaseException | None = None
    if msg.blobs:
        try:
            cause = loads(msg.blobs[0])
        except Exception as exc:
            logger.debug("Could not unpickle the remote exception: %s", exc)
    original = type(cause) if isinstance(cause, BaseException) else builtin_exception_type(meta["exc_type"])
    where = f"env {meta['env_index']}" if meta["env_index"] is not None else "an env"
    where += " in the learner" if worker_id is None else f" on worker {worker_id}"
    error = remote_error_type(original)(
        f"{where} raised {meta['exc_type']} while {doing}: {meta['message']}\n\nRemote traceback:\n{meta['traceback']}",
        env_index=meta["env_index"],
        worker_id=worker_id,
        exc_type=meta["exc_type"],
        remote_traceback=meta["traceback"],
    )
    if isinstance(cause, BaseException):
        error.__cause__ = cause
    return error
