"""The environment of the Python processes clusterenv starts: workers (on this host) and env processes."""

from __future__ import annotations

import os
import sys

from clusterenv.wire.transport import SECRET_ENV_VAR

__all__ = ["child_environment"]

# The processes are the parallelism: a math library's own threads in each only oversubscribe the cores.
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def child_environment(secret: bytes | None) -> dict[str, str]:
    """This process's environment for a child, with the shared secret only for a child that talks to the learner.

    The child gets this process's import path and one thread per math library (unless set);
    an env process never talks to the learner, so it gets no secret (``secret=None``).
    """
    env = {name: value for name, value in os.environ.items() if name != SECRET_ENV_VAR}
    if secret is not None:
        env[SECRET_ENV_VAR] = secret.decode()
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    for var in _THREAD_VARS:
        env.setdefault(var, "1")
    return env
