"""Recovery: lost workers, remote errors, restarts and re-homing, on one path.

A part of :class:`~clusterenv.learner.pool.WorkerPool` (see :mod:`clusterenv.learner.pool_state`).
Restarts (``on_worker_failure="restart"``) have one path, :meth:`Recovery._recover`. When a
worker is lost (its process exited, or its heartbeat connection dropped), a
:meth:`~clusterenv.learner.pool.WorkerPool.gather` first collects every other worker's reply,
so no other env's data is lost or duplicated (``receive``, for streaming calls, recovers at
once). Then, for each lost worker, the pool ends the old process if it can, starts a
replacement through the launcher, waits for it to join, replays its INIT (the same env
factories, flagged ``replacement``), runs the restart hooks (a policy runner re-installs
its policy there), and does what the issuer of the lost worker's pending command declared
when it sent it (:class:`~clusterenv.learner.pool_state.OnLoss`): replay it, report it
interrupted, leave its re-issue to the hooks, or raise ``WorkerLostError``. A replacement
that fails in turn raises: restarts do not loop.

Re-homing (``on_worker_failure="rehome"``) takes the same path with no new process: each
lost worker's envs are rebuilt, from the same INIT, in the surviving process that carries
the fewest envs; messages for a moved worker name it (meta ``slot``) so that its host hands
them to the right envs. Liveness is the process's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from clusterenv.errors import RemoteEnvError, WorkerLostError, builtin_exception_type, remote_error_type
from clusterenv.learner.pool_state import OnLoss, PoolState
from clusterenv.wire.messages import ErrorMeta, meta_of
from clusterenv.wire.protocol import Kind, Message

__all__ = ["Recovery"]

logger = logging.getLogger(__name__)

# How long a worker whose connection dropped may take to report its exit status (it lingers up to 0.5 s).
_EXIT_STATUS_WAIT_S = 1.0


class Recovery(PoolState):
    """Telling lost workers and remote errors apart, and replacing or re-homing what was lost."""

    # -- restarts --------------------------------------------------------------------------
    def on_restart(self, hook: Callable[[int], None]) -> None:
        """Call ``hook(worker_id)`` once each replacement is built, before its pending command is recovered."""
        self._restart_hooks.append(hook)

    def take_interrupted(self) -> list[int]:
        """The workers whose :attr:`OnLoss.INTERRUPT` command a restart cut, since the last call (the sender reports them)."""
        interrupted, self._interrupted = sorted(self._interrupted), set()
        return interrupted

    # -- failures --------------------------------------------------------------------------
    def _how_lost(self, process: int) -> str:
        """Why a worker process is gone: its exit status, else what its heartbeat connection showed."""
        if process in self._retired:
            return self._retired[process]
        code = self.launcher.exit_code(process)
        # A worker that exits closes its connections first: give its exit status, the better cause, a moment.
        deadline = time.monotonic() + _EXIT_STATUS_WAIT_S
        while code is None and self._monitor.reason(process) is not None and time.monotonic() < deadline:
            time.sleep(0.02)
            code = self.launcher.exit_code(process)
        if code is not None:
            return f"exited with code {code}"
        return self._monitor.reason(process) or "is unreachable"

    def _lost(self, worker_id: int, doing: str, why: str = "") -> WorkerLostError:
        process = self.serving.get(worker_id, worker_id)
        where = self.launcher.describe(process)
        if process != worker_id:
            where += f" (serving worker {worker_id})"
        error = WorkerLostError(
            f"{where}, running {self.describe_work(worker_id)}, {self._how_lost(process)} while {doing}.{why}"
        )
        self.on_fatal(True)
        return error

    def _gone(self, processes: Iterable[int]) -> set[int]:
        """The processes among ``processes`` that are lost: retired, exited, or silent past the heartbeat window."""
        expired = self._monitor.expired()
        return {p for p in processes if p in self._retired or p in expired or self.launcher.exit_code(p) is not None}

    def _check_alive(self, worker_ids: set[int], doing: str) -> set[int]:
        """Workers among ``worker_ids`` whose process is lost: raised, or (restart, rehome) returned and marked failed."""
        gone = self._gone({self.serving[w] for w in worker_ids})
        lost = {w for w in worker_ids if self.serving[w] in gone}
        if lost and (self.on_worker_failure == "raise" or self._recovering):
            raise self._lost(min(lost), doing)
        action = "moving its envs to the other workers" if self.on_worker_failure == "rehome" else "replacing it"
        for w in sorted(lost):
            if not self._restartable(w):
                raise self._lost(w, doing)
            logger.warning("%s was lost while %s; %s.", self.launcher.describe(self.serving[w]), doing, action)
        self._failed |= lost
        return lost

    def _restartable(self, worker_id: int) -> bool:
        """Whether a replacement can take over: its envs were built once (a crash while building them would recur)."""
        last = self._last_sent.get(worker_id)
        return last is not None and last.kind is not Kind.INIT

    def _remote_error(self, worker_id: int, msg: Message, doing: str, close: bool = True) -> RemoteEnvError:
        """The ``RemoteEnvError`` (also of the original exception's type) for an ERROR reply.

        ``close``: the env's state is unknown after the error, so the workers are closed.
        """
        meta = meta_of(msg, ErrorMeta)
        cause: BaseException | None = None
        if msg.blobs:
            try:
                cause = self.loads(msg.blobs[0])
            except Exception as exc:
                logger.debug("Could not unpickle the remote exception: %s", exc)
        original = type(cause) if isinstance(cause, BaseException) else builtin_exception_type(meta["exc_type"])
        where = f"env {meta['env_index']}" if meta["env_index"] is not None else "an env"
        error = remote_error_type(original)(
            f"{where} on worker {worker_id} raised {meta['exc_type']} while {doing}: {meta['message']}\n\n"
            f"Remote traceback:\n{meta['traceback']}",
            env_index=meta["env_index"],
            worker_id=worker_id,
            exc_type=meta["exc_type"],
            remote_traceback=meta["traceback"],
        )
        if isinstance(cause, BaseException):
            error.__cause__ = cause
        if close:
            self.on_fatal(False)
        return error

    def _recover(
        self, lost: list[int], replies: dict[int, Message], doing: str, idle: frozenset[int] = frozenset()
    ) -> None:
        """The one recovery path: replace each lost worker, then do what its pending command's sender declared.

        ``idle``: workers among ``lost`` that had answered their last command (streaming calls
        notice losses of workers they are not waiting for): nothing is pending, so nothing is
        replayed or reported here; the restart hooks decide what their envs' loss means.
        """
        self._recovering = True
        try:
            for worker_id in lost:
                sent = self._last_sent[worker_id]
                if sent.on_loss is OnLoss.RAISE and worker_id not in idle:
                    raise self._lost(
                        worker_id, f"{doing} ({sent.kind.name} cannot be recovered on a replacement worker)"
                    )
                if self.on_worker_failure == "rehome":
                    self._rehome(worker_id, doing)
                else:
                    self._restart(worker_id)
                for hook in self._restart_hooks:
                    hook(worker_id)
                if worker_id in idle:
                    continue
                if sent.on_loss is OnLoss.INTERRUPT:
                    self._interrupted.add(worker_id)
                elif sent.on_loss is OnLoss.REPLAY:
                    self.send(worker_id, sent.kind, sent.meta, sent.arrays, sent.blobs, sent.on_loss)
                    replies[worker_id] = self.gather([worker_id], doing, self.start_timeout)[worker_id]
        finally:
            self._recovering = False

    def _restart(self, worker_id: int) -> None:
        """A replacement for ``worker_id``, joined, its envs rebuilt, and the restart hooks run."""
        logger.warning("Starting a replacement for worker %d (%s).", worker_id, self.describe_work(worker_id))
        self.launcher.kill(worker_id)
        self._monitor.forget(worker_id)
        self._watched.discard(worker_id)
        old = self._identities.pop(worker_id, None)
        self._peers.pop(old or b"", None)
        if old is not None:
            self._channel.forget(old)
        self.launcher.start([worker_id], self.address, self.key)
        self._join([worker_id], self.start_timeout)
        self._failed.discard(worker_id)
        self._send_init(worker_id, replacement=True)
        self.gather([worker_id], f"rebuilding the envs of worker {worker_id}", self.start_timeout)

    def replace(self, worker_id: int, why: str) -> None:
        """A new process for a healthy worker whose envs are not in flight (recycling), as a restart starts one."""
        logger.info("Worker %d: %s.", worker_id, why)
        self._restart(worker_id)

    def _rehome(self, worker_id: int, doing: str) -> None:
        """Rebuild a lost worker's envs in the surviving process that carries the fewest envs."""
        process = self.serving[worker_id]
        if process not in self._retired:
            self._retire(process)
        survivors = self._live_processes()
        if len(survivors) < self.min_workers:
            raise self._lost(
                worker_id,
                doing,
                f" {len(survivors)} worker processes survive, fewer than min_workers={self.min_workers}.",
            )
        target = self._least_loaded(survivors)
        logger.warning(
            "Moving worker %d's envs (%s) to worker process %d (%s).",
            worker_id,
            self.describe_work(worker_id),
            target,
            self.launcher.describe(target),
        )
        self._rebuild_in(worker_id, target)

    def _retire(self, process: int) -> None:
        """Give up on a lost process for good: end it if possible, and accept nothing more from it."""
        self._retired[process] = self._how_lost(process)
        self.launcher.kill(process)
        self._monitor.forget(process)
        self._watched.discard(process)
        identity = next(i for i, p in self._peers.items() if p == process)
        del self._peers[identity]
        self._channel.forget(identity)
