"""Starting and stopping worker processes.

clusterenv does not manage clusters: locally it starts plain subprocesses; on several
hosts, workers are started by an existing engine (Ray, or SLURM's ``srun`` running
``clusterenv-worker``) and connect back to the learner.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from typing import Protocol

from clusterenv.transport import SECRET_ENV_VAR

__all__ = ["Launcher", "LocalLauncher"]

logger = logging.getLogger(__name__)


class Launcher(Protocol):
    """What ClusterEnv needs from whatever starts its workers."""

    def start(self, worker_ids: list[int], address: str, key: bytes) -> None:
        """Start one worker per id, each connecting to ``address``."""

    def exit_code(self, worker_id: int) -> int | None:
        """The worker's exit code if it is known to have exited, else ``None``."""

    def describe(self, worker_id: int) -> str:
        """Where the worker runs, for error messages."""

    def stop(self, grace: float) -> None:
        """Make sure every worker is gone, waiting up to ``grace`` seconds before killing."""


class LocalLauncher:
    """Workers as child processes of the learner: ``python -m clusterenv.worker``.

    Children get the learner's ``sys.path`` (so env classes defined in the user's modules
    unpickle), the secret through the environment (never on a command line, which ``ps``
    shows), and one BLAS/OpenMP thread each unless the user set otherwise.
    """

    def __init__(self) -> None:
        self.processes: dict[int, subprocess.Popen] = {}

    def start(self, worker_ids: list[int], address: str, key: bytes) -> None:
        """Spawn ``python -m clusterenv.worker`` once per id."""
        env = dict(os.environ)
        env[SECRET_ENV_VAR] = key.decode()
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env.setdefault(var, "1")
        for worker_id in worker_ids:
            command = [
                sys.executable,
                "-m",
                "clusterenv.worker",
                "--connect",
                address,
                "--worker-id",
                str(worker_id),
                "--parent-pid",
                str(os.getpid()),
            ]
            self.processes[worker_id] = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)

    def exit_code(self, worker_id: int) -> int | None:
        """``Popen.poll()`` of the worker."""
        process = self.processes.get(worker_id)
        return None if process is None else process.poll()

    def describe(self, worker_id: int) -> str:
        """``worker 3 (pid 1234)``."""
        process = self.processes.get(worker_id)
        return f"worker {worker_id}" + ("" if process is None else f" (pid {process.pid})")

    def stop(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for every child to exit, then kill the rest."""
        deadline = time.monotonic() + grace
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if grace > 0:
                    logger.warning("Worker pid %d did not exit within %.1f s; killing it.", process.pid, grace)
                process.kill()
                process.wait()
