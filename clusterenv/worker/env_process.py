"""An env process: one of the child processes that step a worker's slice (``procs_per_worker > 1``).

Worker side. Started by :class:`clusterenv.worker.env_processes.ProcVectorEnv` as
``python -m clusterenv.worker.env_process --fd FD --parent-pid PID``; it builds its part of the
worker's envs as a :class:`~clusterenv.stepping.recording_env.RecordingVectorEnv` and answers the
worker's commands on its end of their socketpair until the worker says close or is gone.
Each reply is ``("ok", value)`` or ``("error", (env index, type name, message,
traceback, pickled exception))``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import pickle
import signal
import sys
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode

from clusterenv.stepping.failures import EnvFailure, EnvTracker
from clusterenv.stepping.recording_env import RecordingVectorEnv, build, dumps, learner_registry
from clusterenv.wire.leaves import batch_of_items, is_array_tree, unflatten

__all__ = ["main"]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class _ChildEnvs:
    """A child's command handlers, over the RecordingVectorEnv of its part."""

    def __init__(self) -> None:
        self.envs: RecordingVectorEnv | None = None
        self.array_obs = True
        self.tracker = EnvTracker()

    def init(self, payload: tuple[list[bytes], Any, str, dict[str, bytes], int | None]) -> dict[str, Any]:
        env_blobs, observation_mode, autoreset_mode, registry, max_env_errors = payload
        with learner_registry(registry):
            self.envs = build(env_blobs, observation_mode, AutoresetMode(autoreset_mode), self.tracker, max_env_errors)
        self.array_obs = is_array_tree(self.envs.single_observation_space)
        return self.envs.description()

    def share(self, meta: Mapping[str, Any]) -> bool:
        assert self.envs is not None
        return self.envs.share_observations(meta)

    def reset(self, payload: tuple[list[int | None], dict[str, Any] | None]) -> tuple[Any, ...]:
        assert self.envs is not None
        seeds, options = payload
        self.envs.reset(seed=seeds, options=options)
        return self._report(None)

    def reset_each(self, payload: tuple[list[int | None], list[Any], Any]) -> tuple[Any, ...]:
        assert self.envs is not None
        self.envs.reset_each(*payload)
        return self._report(None)

    def step(self, leaves: list[np.ndarray]) -> tuple[Any, ...]:
        assert self.envs is not None
        return self._stepped(unflatten(self.envs.single_action_space, leaves))

    def step_items(self, items: list[Any]) -> tuple[Any, ...]:
        assert self.envs is not None
        return self._stepped(batch_of_items(self.envs.action_space, items))

    def _stepped(self, actions: Any) -> tuple[Any, ...]:
        assert self.envs is not None
        _, rewards, terminations, truncations, _ = self.envs.step(actions)
        return self._report((rewards, terminations, truncations))

    def _report(self, arrays: tuple[np.ndarray, ...] | None) -> tuple[Any, ...]:
        assert self.envs is not None
        records, self.envs.info_log = self.envs.info_log, []
        env_obs = None if self.array_obs else self.envs.env_observations()
        return arrays, self.envs.autoresetting(), records, env_obs, self.envs.step_clock.take()

    def call(self, payload: tuple[list[int] | None, str | None, tuple[Any, ...], dict[str, Any]]) -> list[Any]:
        assert self.envs is not None
        return self.envs.call_at(*payload)

    def set_attr(self, payload: tuple[list[int] | None, str, list[Any]]) -> None:
        assert self.envs is not None
        self.envs.set_attr_at(*payload)

    def mark_autoreset_pending(self, _: None) -> None:
        assert self.envs is not None
        self.envs.mark_autoreset_pending()

    def close(self) -> None:
        if self.envs is not None:
            self.envs.close()


def _serve(conn: Connection) -> None:
    """Answer the worker's commands until it says close, or its socket closes."""
    state = _ChildEnvs()
    handlers: dict[str, Callable[[Any], Any]] = {
        "init": state.init,
        "share": state.share,
        "reset": state.reset,
        "reset_each": state.reset_each,
        "step": state.step,
        "step_items": state.step_items,
        "call": state.call,
        "set_attr": state.set_attr,
        "mark_autoreset_pending": state.mark_autoreset_pending,
    }
    try:
        while True:
            try:
                command, payload = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return  # the worker is gone
            if command == "close":
                try:
                    state.close()
                except Exception:
                    logger.exception("Closing the envs failed.")
                return
            state.tracker.forget()
            try:
                reply = dumps(("ok", handlers[command](payload)))
            except Exception as exc:
                misfit = None if state.envs is None else state.envs.misfit_observation
                reply = dumps(("error", EnvFailure.capture(exc, state.tracker, misfit)))
            try:
                conn.send_bytes(reply)
            except OSError:
                return
    finally:
        conn.close()


def _die_with(parent_pid: int) -> None:
    """Have the kernel kill this process when the worker dies, however it dies (Linux)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(0)  # the worker died before the request took effect


def main(argv: list[str] | None = None) -> None:
    """Entry point of an env process (``python -m clusterenv.worker.env_process``), started by its worker."""
    parser = argparse.ArgumentParser(description="An env process of a clusterenv worker.")
    parser.add_argument("--fd", type=int, required=True, help="this process's end of the worker's socketpair")
    parser.add_argument("--parent-pid", type=int, required=True, help="the worker's pid")
    args = parser.parse_args(argv)
    _die_with(args.parent_pid)
    # Ctrl-C in the terminal reaches the whole process group; the learner decides when envs stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"[clusterenv env process {os.getpid()}] %(message)s")
    _serve(Connection(args.fd))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skips interpreter teardown: the envs are closed, and the worker may be waiting


if __name__ == "__main__":
    main(sys.argv[1:])
