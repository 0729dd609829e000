"""The worker process: owns a slice of the environments and serves learner commands.

Run by the local launcher as ``python -m clusterenv.worker``, or by hand / ``srun`` on
another host as ``clusterenv-worker --connect tcp://HOST:PORT``. A worker steps its
slice as one :class:`gymnasium.vector.SyncVectorEnv`, so every per-env semantic
(autoreset modes, seeding, info batching) is Gymnasium's own code, not a re-implementation.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import signal
import socket as pysocket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np
import zmq
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from clusterenv.batching import is_array_tree, leaf_arrays, unflatten
from clusterenv.protocol import Kind, Message
from clusterenv.transport import SECRET_ENV_VAR, Channel, resolve_secret, worker_identity

__all__ = ["main", "serve"]

logger = logging.getLogger(__name__)

# How often an idle worker wakes up to check that its learner still exists.
IDLE_CHECK_INTERVAL_S = 0.5


class _RecordingVectorEnv(SyncVectorEnv):
    """A SyncVectorEnv that records each per-env info instead of batching it.

    The learner replays the records with global env indices through Gymnasium's own
    ``VectorEnv._add_info``, so the batched infos are exactly what one SyncVectorEnv
    over all envs would have built (same keys, order, dtypes and masks).
    """

    info_log: list[tuple[int, dict[str, Any]]]

    def _add_info(self, vector_infos: dict[str, Any], env_info: dict[str, Any], env_num: int) -> dict[str, Any]:
        if env_info:
            self.info_log.append((env_num, env_info))
        return vector_infos


def _failing_env_index(exc: BaseException) -> int | None:
    """The local index of the env that raised, read from SyncVectorEnv's loop variable."""
    loops = {SyncVectorEnv.step.__code__, SyncVectorEnv.reset.__code__}
    index = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        if frame.f_code in loops and isinstance(frame.f_locals.get("i"), int):
            index = frame.f_locals["i"]
    return index


class Worker:
    """Command handlers for one worker; each returns the reply to send."""

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        self.env_offset = 0
        self.envs: _RecordingVectorEnv | None = None
        self.array_obs = True
        self.handlers: dict[Kind, Callable[[Message], tuple]] = {
            Kind.INIT: self.init,
            Kind.RESET: self.reset,
            Kind.STEP: self.step,
            Kind.CALL: self.call,
            Kind.SET_ATTR: self.set_attr,
        }

    # -- lifecycle -------------------------------------------------------------------------
    def init(self, msg: Message) -> tuple:
        env_fns = [pickle.loads(blob) for blob in msg.blobs]
        self.env_offset = int(msg.meta["env_offset"])
        self.envs = _RecordingVectorEnv(
            env_fns,
            copy=False,
            observation_mode=msg.meta["observation_mode"],
            autoreset_mode=AutoresetMode(msg.meta["autoreset_mode"]),
        )
        self.envs.info_log = []
        self.array_obs = is_array_tree(self.envs.single_observation_space)
        description = {
            "observation_spaces": [env.observation_space for env in self.envs.envs],
            "action_spaces": [env.action_space for env in self.envs.envs],
            "metadata": self.envs.envs[0].metadata,
            "render_mode": self.envs.render_mode,
        }
        return Kind.READY, {}, [], [cloudpickle.dumps(description)]

    # -- stepping --------------------------------------------------------------------------
    def _result(self, obs: Any, extra: list[np.ndarray]) -> tuple:
        assert self.envs is not None
        log, self.envs.info_log = self.envs.info_log, []
        arrays = (leaf_arrays(self.envs.single_observation_space, obs) if self.array_obs else []) + extra
        blobs = [b""] if not log else [cloudpickle.dumps(log)]
        if not self.array_obs:
            blobs.append(cloudpickle.dumps(self.envs._env_obs))
        return Kind.RESULT, {}, arrays, blobs

    def reset(self, msg: Message) -> tuple:
        assert self.envs is not None
        options = pickle.loads(msg.blobs[0]) if msg.blobs else None
        if msg.meta.get("mask") is not None:
            options = dict(options or {}, reset_mask=np.array(msg.meta["mask"], dtype=np.bool_))
        obs, _ = self.envs.reset(seed=msg.meta["seeds"], options=options)
        return self._result(obs, [])

    def step(self, msg: Message) -> tuple:
        assert self.envs is not None
        # Copies: env code may write into its action, and received frames are read-only.
        actions = unflatten(self.envs.action_space, [a.copy() for a in msg.arrays])
        obs, rewards, terminations, truncations, _ = self.envs.step(actions)
        return self._result(obs, [rewards, terminations, truncations])

    # -- attributes ------------------------------------------------------------------------
    def call(self, msg: Message) -> tuple:
        assert self.envs is not None
        args, kwargs = pickle.loads(msg.blobs[0])
        results = self.envs.call(msg.meta["name"], *args, **kwargs)
        return Kind.VALUE, {}, [], [cloudpickle.dumps(list(results))]

    def set_attr(self, msg: Message) -> tuple:
        assert self.envs is not None
        self.envs.set_attr(msg.meta["name"], list(pickle.loads(msg.blobs[0])))
        return Kind.VALUE, {}, [], [cloudpickle.dumps(None)]

    def close(self) -> None:
        if self.envs is not None:
            self.envs.close()

    def handle(self, msg: Message) -> tuple:
        """Run the handler for ``msg`` and return ``(kind, meta, arrays, blobs)`` to reply."""
        handler = self.handlers.get(msg.kind)
        if handler is None:
            return Kind.ERROR, _error_meta(None, "ProtocolError", f"Worker cannot handle {msg.kind.name}.", ""), [], []
        if msg.kind is not Kind.INIT and self.envs is None:
            return Kind.ERROR, _error_meta(None, "ProtocolError", f"{msg.kind.name} before INIT.", ""), [], []
        return handler(msg)


def _error_meta(env_index: int | None, exc_type: str, message: str, tb: str) -> dict[str, Any]:
    return {"env_index": env_index, "exc_type": exc_type, "message": message, "traceback": tb}


def _error_reply(worker: Worker, exc: BaseException) -> tuple:
    local = _failing_env_index(exc)
    env_index = None if local is None else worker.env_offset + local
    try:
        blobs = [cloudpickle.dumps(exc)]
    except Exception:
        blobs = []
    meta = _error_meta(env_index, type(exc).__name__, str(exc), traceback.format_exc())
    return Kind.ERROR, meta, [], blobs


def serve(address: str, worker_id: int, key: bytes, *, parent_pid: int | None = None) -> None:
    """Connect to the learner at ``address`` and serve commands until CLOSE or learner death."""
    context = zmq.Context()
    channel = Channel.connect_dealer(context, address, key, worker_identity(worker_id))
    worker = Worker(worker_id)
    _install_policy_extensions(worker)
    try:
        channel.send(Kind.HELLO, {"worker_id": worker_id, "pid": os.getpid(), "host": pysocket.gethostname()})
        while True:
            received = channel.recv(IDLE_CHECK_INTERVAL_S, routed=False)
            if received is None:
                if parent_pid is not None and os.getppid() != parent_pid:
                    logger.warning("Worker %d: learner process %d is gone; exiting.", worker_id, parent_pid)
                    return
                continue
            _, msg = received
            if msg.kind is Kind.CLOSE:
                worker.close()
                channel.send(Kind.CLOSED)
                return
            seq = msg.meta.get("seq")
            try:
                kind, meta, arrays, blobs = worker.handle(msg)
            except Exception as exc:
                kind, meta, arrays, blobs = _error_reply(worker, exc)
            channel.send(kind, {**meta, "seq": seq}, arrays, blobs)
    finally:
        channel.close()
        context.term()


def _install_policy_extensions(worker: Worker) -> None:
    """Hook for the local-policy commands; a no-op until a policy module registers them."""
    try:
        from clusterenv.rollout import install as install_rollout
    except ImportError:
        return
    install_rollout(worker)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (``clusterenv-worker``)."""
    parser = argparse.ArgumentParser(description="Serve clusterenv environments to a learner.")
    parser.add_argument("--connect", required=True, help="learner address, e.g. tcp://10.0.0.1:5555")
    parser.add_argument("--worker-id", type=int, default=int(os.environ.get("SLURM_PROCID", 0)))
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[clusterenv worker {args.worker_id}] %(message)s")
    key = resolve_secret(None)
    if key is None:
        parser.exit(2, f"error: the shared secret must be set in ${SECRET_ENV_VAR}.\n")
    # The learner decides when workers stop; Ctrl-C in the terminal reaches it, not us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    started = time.monotonic()
    serve(args.connect, args.worker_id, key, parent_pid=args.parent_pid)
    logger.debug("Worker %d served for %.1f s.", args.worker_id, time.monotonic() - started)


if __name__ == "__main__":
    main(sys.argv[1:])
