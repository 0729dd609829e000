"""Starting and stopping worker processes.

clusterenv does not manage clusters: locally it starts plain subprocesses; on several
hosts, workers are started by an existing engine (Ray, or SLURM's ``srun`` running
``clusterenv-worker``) and connect back to the learner.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Protocol

from clusterenv.wire.cleanup import kill_tree
from clusterenv.wire.pipes import pipe_pair, wake_pair
from clusterenv.wire.processes import child_environment
from clusterenv.wire.transport import SECRET_ENV_VAR

__all__ = ["ExternalLauncher", "Launcher", "LocalLauncher", "resolve_launcher"]

logger = logging.getLogger(__name__)


class Launcher(Protocol):
    """What ClusterEnv needs from whatever starts its workers.

    Under ``ClusterEnv(encrypt=True)`` the launcher must also have an ``encrypt`` attribute,
    which the pool sets before ``start``: its workers must then connect with encryption
    (``clusterenv-worker --encrypt``, ``serve(..., encrypt=True)``).
    """

    def start(self, worker_ids: list[int], address: str, key: bytes) -> None:
        """Start one worker per id, each connecting to ``address``."""

    def exit_code(self, worker_id: int) -> int | None:
        """The worker's exit code if it is known to have exited, else ``None``."""

    def describe(self, worker_id: int) -> str:
        """Where the worker runs, for error messages."""

    def kill(self, worker_id: int) -> None:
        """End one worker now, if this launcher can (before a replacement is started)."""

    def stop(self, grace: float) -> None:
        """Make sure every worker is gone, waiting up to ``grace`` seconds before killing."""


class LocalLauncher:
    """Workers as child processes of the learner: ``python -m clusterenv.worker``.

    Children get the learner's ``sys.path`` (so env classes defined in the user's modules
    unpickle), the secret through the environment (never on a command line, which ``ps``
    shows), and one BLAS/OpenMP thread each unless the user set otherwise.

    Args:
        pipes: each child talks to the learner over a pipe of its own instead of the learner's
            ZeroMQ socket (:mod:`clusterenv.wire.pipes`; not under ``encrypt=True``): faster when
            every core is busy. The learner passes its end to :attr:`attach_pipe`; the child
            inherits its own as ``--connect pipe://FD``, with a wake socket (``--wake FD``) for
            the shared step path (:mod:`clusterenv.wire.step_region`) where a file descriptor can
            be passed over a socket (``SCM_RIGHTS``).
        batch_scheduling: start the workers as CPU-bound processes (Linux's ``SCHED_BATCH``,
            ``clusterenv-worker --batch-scheduling``), so that a worker woken by the learner waits
            for a free core instead of preempting the learner; their share of CPU is unchanged.
            Workers that inherit another policy (``SCHED_IDLE``) keep it, and a policy the kernel
            refuses is logged once; the workers run either way.

    One launcher may start the workers of one ``ClusterEnv`` after another, plain or encrypted:
    each ``ClusterEnv`` sets what it needs before starting them.
    """

    def __init__(self, pipes: bool = True, batch_scheduling: bool = True) -> None:
        self.processes: dict[int, subprocess.Popen] = {}
        self.encrypt = False
        self.pipes = pipes
        self.batch_scheduling = batch_scheduling
        self.attach_pipe: Callable[[socket.socket, socket.socket | None], None] | None = None

    def start(self, worker_ids: list[int], address: str, key: bytes) -> None:
        """Spawn ``python -m clusterenv.worker`` once per id."""
        env = child_environment(key)
        for worker_id in worker_ids:
            self.kill(worker_id)  # a replacement: never lose track of the process it replaces
            ours = theirs = wake_ours = wake_theirs = None
            if self.pipes and self.attach_pipe is not None:
                ours, theirs = pipe_pair()
                wake = wake_pair()
                if wake is not None:
                    wake_ours, wake_theirs = wake
                else:
                    logger.info(
                        "Worker %d keeps the message path: this Python cannot pass a file descriptor over a socket "
                        "(no SCM_RIGHTS), which the shared step path needs.",
                        worker_id,
                    )
            command = [
                sys.executable,
                "-m",
                "clusterenv.worker",
                "--connect",
                address if theirs is None else f"pipe://{theirs.fileno()}",
                *([] if wake_theirs is None else ["--wake", str(wake_theirs.fileno())]),
                "--worker-id",
                str(worker_id),
                "--parent-pid",
                str(os.getpid()),
                *(["--encrypt"] if self.encrypt else []),
                *(["--batch-scheduling"] if self.batch_scheduling else []),
            ]
            try:
                passed = tuple(end.fileno() for end in (theirs, wake_theirs) if end is not None)
                self.processes[worker_id] = subprocess.Popen(
                    command, env=env, stdin=subprocess.DEVNULL, pass_fds=passed
                )
            except BaseException:
                for end in (ours, wake_ours):
                    if end is not None:
                        end.close()
                raise
            finally:
                for end in (theirs, wake_theirs):
                    if end is not None:
                        end.close()  # the child holds it now
            if ours is not None and self.attach_pipe is not None:
                self.attach_pipe(ours, wake_ours)

    def exit_code(self, worker_id: int) -> int | None:
        """``Popen.poll()`` of the worker."""
        process = self.processes.get(worker_id)
        return None if process is None else process.poll()

    def describe(self, worker_id: int) -> str:
        """``worker 3 (pid 1234)``."""
        process = self.processes.get(worker_id)
        return f"worker {worker_id}" + ("" if process is None else f" (pid {process.pid})")

    def kill(self, worker_id: int) -> None:
        """SIGKILL the worker (also when it is stopped) and its env processes, and reap it."""
        process = self.processes.pop(worker_id, None)
        if process is not None and process.poll() is None:
            kill_tree(process.pid)  # with its env processes, which would otherwise outlive it
            process.wait()

    def stop(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for every child to exit, then kill the rest (with their env processes)."""
        deadline = time.monotonic() + grace
        late = []
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if grace > 0:
                    logger.warning("Worker pid %d did not exit within %.1f s; killing it.", process.pid, grace)
                late.append(process)
        kill_tree(*(process.pid for process in late))
        for process in late:
            process.wait()
        self.processes.clear()  # all reaped: the launcher may start another ClusterEnv's workers


class ExternalLauncher:
    """Workers started by someone else: by hand, by ``srun``, by a job script.

    ``start`` only says how to start them; ``ClusterEnv`` then waits up to ``start_timeout``
    for them to connect. No exit status is known, so lost workers are found by heartbeats,
    and with ``on_worker_failure="restart"`` a replacement is awaited the same way (whoever
    started the worker must start a new one, e.g. ``srun --kill-on-bad-exit=0`` in a loop).
    """

    needs_shared_secret = True  # the workers are told the secret out of band: a random one cannot work

    def __init__(self) -> None:
        self.encrypt = False

    def _command(self, address: str) -> str:
        return f"{SECRET_ENV_VAR}=<secret> clusterenv-worker --connect {address}" + (
            " --encrypt" if self.encrypt else ""
        )

    def start(self, worker_ids: list[int], address: str, key: bytes) -> None:
        """Log the command that workers must run."""
        logger.info(
            "Waiting for %d external worker(s) %s to connect to %s: run `%s`.",
            len(worker_ids),
            worker_ids,
            address,
            self._command(address),
        )

    def join_hint(self, address: str) -> str:
        """What to tell a user whose workers did not join."""
        return (
            f"Start them on the worker hosts with `{self._command(address)}` "
            "(or under `srun`), with the same secret, and check that the hosts can reach this address."
        )

    def exit_code(self, worker_id: int) -> int | None:
        """Always ``None``: the process is not ours."""
        return None

    def describe(self, worker_id: int) -> str:
        """``external worker 3``."""
        return f"external worker {worker_id}"

    def kill(self, worker_id: int) -> None:
        """Nothing to do: heartbeats stop answering it, so it exits by itself."""

    def stop(self, grace: float) -> None:
        """Nothing to do: workers exit on CLOSE, or when the learner's heartbeats stop."""


def resolve_launcher(launcher: Launcher | str | None) -> Launcher:
    """A launcher from ``ClusterEnv(launcher=...)``: an instance, or ``"local"``, ``"external"``, ``"ray"``."""
    if launcher is None or launcher == "local":
        return LocalLauncher()
    if launcher == "external":
        return ExternalLauncher()
    if launcher == "ray":
        from clusterenv.launch.ray import RayLauncher

        return RayLauncher()
    if isinstance(launcher, str):
        raise ValueError(f"`launcher` must be 'local', 'external', 'ray' or a Launcher instance, got {launcher!r}.")
    return launcher
