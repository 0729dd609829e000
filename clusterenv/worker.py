"""The worker process: owns a slice of the environments and serves learner commands.

Run by the local launcher as ``python -m clusterenv.worker``, or by hand / ``srun`` on
another host as ``clusterenv-worker --connect tcp://HOST:PORT``. A worker steps its
slice as one :class:`gymnasium.vector.SyncVectorEnv`, so every per-env semantic
(autoreset modes, seeding, info batching) is Gymnasium's own code, not a re-implementation.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import pickle
import signal
import socket as pysocket
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np
import zmq
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from clusterenv import shared_obs
from clusterenv.batching import InfoRecord, is_array_tree, leaf_arrays, unflatten
from clusterenv.liveness import LEARNER_LOST_EXIT_CODE, Heartbeat, HeartbeatClient
from clusterenv.protocol import Kind, Message
from clusterenv.transport import SECRET_ENV_VAR, Channel, Curve, new_identity, resolve_secret
from clusterenv.worker_policy import RolloutAborted
from clusterenv.worker_policy import install as install_policy_handlers

__all__ = ["Mailbox", "Worker", "main", "serve"]

logger = logging.getLogger(__name__)

# How often an idle worker wakes up to check that its learner still exists.
IDLE_CHECK_INTERVAL_S = 0.5
# Lets the last reply (CLOSED) leave before the socket goes; bounded for a learner that is gone.
_EXIT_LINGER_MS = 500


class _RecordingVectorEnv(SyncVectorEnv):
    """A SyncVectorEnv that records each per-env info instead of batching it.

    The learner replays the records with global env indices through Gymnasium's own
    ``VectorEnv._add_info``, so the batched infos are exactly what one SyncVectorEnv
    over all envs would have built (same keys, order, dtypes and masks).
    """

    info_log: list[InfoRecord]

    def _add_info(self, vector_infos: dict[str, Any], env_info: dict[str, Any], env_num: int) -> dict[str, Any]:
        if env_info:
            self.info_log.append((env_num, env_info))
        return vector_infos

    # The one place that reaches into SyncVectorEnv's internals.
    @property
    def current_observations(self) -> Any:
        """The batch of current observations (the buffer ``step`` writes into, ``copy=False``)."""
        return self._observations

    def env_observations(self) -> list[Any]:
        """The current per-env observations, for spaces without a fixed array form."""
        return self._env_obs

    def autoresetting(self) -> np.ndarray:
        """Under NEXT_STEP, which envs' next step is an autoreset step (a copy)."""
        return self._autoreset_envs.copy()

    def mark_autoreset_pending(self) -> None:
        """Make every env's next step an autoreset step, as after a truncation (a replacement's envs)."""
        self._autoreset_envs = np.ones(self.num_envs, dtype=np.bool_)

    def write_observations_into(self, view: Any) -> None:
        """From now on, write observations into ``view`` (shared memory), starting from the current ones."""
        space = self.single_observation_space
        for new, old in zip(leaf_arrays(space, view), leaf_arrays(space, self._observations), strict=True):
            new[...] = old
        self._observations = view  # SyncVectorEnv's concatenate(..., out=) now fills it


def _failing_env_index(exc: BaseException) -> int | None:
    """The local index of the env that raised, read from the loop variables of the frames it passed."""
    index_loops = {SyncVectorEnv.step.__code__, SyncVectorEnv.reset.__code__, _make_envs.__code__}
    env_loops = {SyncVectorEnv.call.__code__, SyncVectorEnv.set_attr.__code__}
    index = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        local = frame.f_locals
        if frame.f_code in index_loops and isinstance(local.get("i"), int):
            index = local["i"]
        elif frame.f_code in env_loops and isinstance(local.get("self"), SyncVectorEnv):
            index = next((i for i, env in enumerate(local["self"].envs) if env is local.get("env")), index)
    return index


def _make_envs(env_fns: list[Callable[[], Any]]) -> list[Any]:
    """Build the envs one by one, so that a constructor that raises is known by its index."""
    envs = []
    for i, env_fn in enumerate(env_fns):  # noqa: B007 (`i` is read by _failing_env_index)
        envs.append(env_fn())
    return envs


class Mailbox:
    """The worker's side of the channel, with a queue so that a long command can read what arrives meanwhile.

    A prefetched rollout calls :meth:`poll` between steps: kinds in ``urgent`` (new
    weights, the learner's probe outputs) are handled at once; a CLOSE jumps the queue
    and sets ``closing``; anything else waits its turn.
    """

    def __init__(self, channel: Channel, worker: Worker) -> None:
        self.channel, self.worker = channel, worker
        self.queue: deque[Message] = deque()
        self.closing = False
        self.seq: Any = None  # of the command being handled: the learner matches replies by it

    def take(self, timeout: float) -> Message | None:
        """The next command: queued first, else from the socket within ``timeout`` seconds."""
        if self.queue:
            return self.queue.popleft()
        received = self.channel.recv(timeout, routed=False)
        return None if received is None else received[1]

    def poll(self) -> None:
        """Read what has arrived, without waiting."""
        while (received := self.channel.recv(0, routed=False)) is not None:
            msg = received[1]
            if msg.kind is Kind.CLOSE:
                self.closing = True
                self.queue.appendleft(msg)
            elif msg.kind in self.worker.urgent:
                self.worker.handle(msg)
            else:
                self.queue.append(msg)

    def send(self, reply: Message) -> None:
        """Send a message of the worker's own (a weight pull) outside the command-reply pattern."""
        self.channel.send(reply.kind, {**reply.meta, "seq": self.seq}, reply.arrays, reply.blobs)


class Worker:
    """Command handlers for one worker; each returns the reply to send (``None``: no reply)."""

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        self.env_offset = 0
        self.envs: _RecordingVectorEnv | None = None
        self.array_obs = True
        self.handlers: dict[Kind, Callable[[Message], Message | None]] = {
            Kind.INIT: self.init,
            Kind.RESET: self.reset,
            Kind.STEP: self.step,
            Kind.CALL: self.call,
            Kind.SET_ATTR: self.set_attr,
            Kind.SHARE_OBS: self.share_obs,
        }
        self.shared_obs = False  # observations are written into the learner's shared batch
        self.never_reset = True  # a fresh (or replacement) worker's envs have no observation yet
        self.urgent: set[Kind] = set()  # kinds a long command handles as soon as they arrive (Mailbox.poll)
        self.mailbox: Mailbox

    # -- lifecycle -------------------------------------------------------------------------
    def init(self, msg: Message) -> Message:
        """Build this worker's envs from the pickled factories and describe their spaces."""
        env_fns = [pickle.loads(blob) for blob in msg.blobs]
        self.env_offset = int(msg.meta["env_offset"])
        self.envs = _RecordingVectorEnv(
            [functools.partial(_identity, env) for env in _make_envs(env_fns)],
            copy=False,
            observation_mode=msg.meta["observation_mode"],
            autoreset_mode=AutoresetMode(msg.meta["autoreset_mode"]),
        )
        self.envs.info_log = []
        if msg.meta.get("replacement") and self.envs.autoreset_mode is AutoresetMode.NEXT_STEP:
            # A replacement for a lost worker: its envs' episodes were cut short, so under
            # NEXT_STEP their next step is the autoreset step (see docs/cluster.md).
            self.envs.mark_autoreset_pending()
        self.array_obs = is_array_tree(self.envs.single_observation_space)
        description = {
            "observation_spaces": [env.observation_space for env in self.envs.envs],
            "action_spaces": [env.action_space for env in self.envs.envs],
            "metadata": self.envs.envs[0].metadata,
            "render_mode": self.envs.render_mode,
        }
        return Message(Kind.READY, blobs=[cloudpickle.dumps(description)])

    # -- stepping --------------------------------------------------------------------------
    def _result(self, obs: Any, extra: list[np.ndarray]) -> Message:
        assert self.envs is not None
        log, self.envs.info_log = self.envs.info_log, []
        framed = self.array_obs and not self.shared_obs
        arrays = (leaf_arrays(self.envs.single_observation_space, obs) if framed else []) + extra
        blobs = [b""] if not log else [_dumps(log)]
        if not self.array_obs:
            blobs.append(_dumps(self.envs.env_observations()))
        return Message(Kind.RESULT, {}, arrays, blobs)

    def reset(self, msg: Message) -> Message:
        """Reset the envs (those in the mask, if any) with their seeds."""
        assert self.envs is not None
        options = pickle.loads(msg.blobs[0]) if msg.blobs else None
        if msg.meta.get("mask") is not None:
            options = dict(options or {}, reset_mask=np.array(msg.meta["mask"], dtype=np.bool_))
        obs, _ = self.envs.reset(seed=msg.meta["seeds"], options=options)
        self.never_reset = False
        return self._result(obs, [])

    def step(self, msg: Message) -> Message:
        """Step every env with its slice of the actions."""
        assert self.envs is not None
        # Copies: env code may write into its action, and received frames are read-only.
        actions = unflatten(self.envs.action_space, [a.copy() for a in msg.arrays])
        obs, rewards, terminations, truncations, _ = self.envs.step(actions)
        return self._result(obs, [rewards, terminations, truncations])

    def share_obs(self, msg: Message) -> Message:
        """Write observations into the learner's shared batch from now on, if it can be mapped here."""
        assert self.envs is not None
        view = None
        if self.array_obs and int(msg.meta["stop"]) - int(msg.meta["start"]) == self.envs.num_envs:
            view = shared_obs.attach(msg.meta, self.envs.single_observation_space)
        if view is not None:
            self.envs.write_observations_into(view)
            self.shared_obs = True
        return Message(Kind.VALUE, {"attached": self.shared_obs})

    # -- attributes ------------------------------------------------------------------------
    def call(self, msg: Message) -> Message:
        """Call (or read) an attribute of every env."""
        assert self.envs is not None
        args, kwargs = pickle.loads(msg.blobs[0])
        results = self.envs.call(msg.meta["name"], *args, **kwargs)
        return Message(Kind.VALUE, blobs=[cloudpickle.dumps(list(results))])

    def set_attr(self, msg: Message) -> Message:
        """Set an attribute on every env, one value each."""
        assert self.envs is not None
        self.envs.set_attr(msg.meta["name"], list(pickle.loads(msg.blobs[0])))
        return Message(Kind.VALUE, blobs=[cloudpickle.dumps(None)])

    def close(self) -> None:
        """Close the envs."""
        if self.envs is not None:
            self.envs.close()

    def handle(self, msg: Message) -> Message | None:
        """Run the handler for ``msg`` and return the reply."""
        handler = self.handlers.get(msg.kind)
        if handler is None:
            return Message(Kind.ERROR, _error_meta(None, "ProtocolError", f"Worker cannot handle {msg.kind.name}.", ""))
        if msg.kind is not Kind.INIT and self.envs is None:
            return Message(Kind.ERROR, _error_meta(None, "ProtocolError", f"{msg.kind.name} before INIT.", ""))
        return handler(msg)


def _dumps(value: Any) -> bytes:
    """Per-step payloads (infos, non-array observations): plain pickle, else cloudpickle.

    Infos are plain data almost always, which pickle serializes several times faster;
    a lambda or a class defined in the learner's script needs cloudpickle.
    """
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return cloudpickle.dumps(value)


def _identity(value: Any) -> Any:
    return value


def _error_meta(env_index: int | None, exc_type: str, message: str, tb: str) -> dict[str, Any]:
    return {"env_index": env_index, "exc_type": exc_type, "message": message, "traceback": tb}


def _error_reply(worker: Worker, exc: BaseException) -> Message:
    local = _failing_env_index(exc)
    env_index = None if local is None else worker.env_offset + local
    try:
        blobs = [cloudpickle.dumps(exc)]
    except Exception:
        blobs = []
    meta = _error_meta(env_index, type(exc).__name__, str(exc), traceback.format_exc())
    return Message(Kind.ERROR, meta, [], blobs)


def serve(
    address: str,
    worker_id: int | None,
    key: bytes,
    *,
    parent_pid: int | None = None,
    join_timeout: float | None = None,
    encrypt: bool = False,
) -> int:
    """Connect to the learner at ``address`` and serve commands until CLOSE or learner death.

    Args:
        address: the learner's address.
        worker_id: the id to ask for (``None``: any; the learner assigns it at HELLO).
        key: the shared secret.
        parent_pid: exit when this process is gone (local workers).
        join_timeout: give up if the learner has not sent INIT within this many seconds.
        encrypt: connect with CurveZMQ, as a learner with ``ClusterEnv(encrypt=True)`` expects.

    Returns:
        The exit status for the process: 0 after CLOSE, ``LEARNER_LOST_EXIT_CODE`` when the
        learner went away (process gone, heartbeats stopped, never sent work).
    """
    context = zmq.Context()
    identity = new_identity(worker_id)
    curve = Curve.from_secret(key) if encrypt else None
    channel = Channel.connect_dealer(context, address, key, identity, curve=curve)
    worker = Worker(-1 if worker_id is None else worker_id)
    worker.mailbox = mailbox = Mailbox(channel, worker)
    install_policy_handlers(worker)  # the local-policy commands (SET_POLICY, SET_WEIGHTS, ROLLOUT)
    heart: HeartbeatClient | None = None
    join_deadline = None if join_timeout is None else time.monotonic() + join_timeout
    try:
        channel.send(Kind.HELLO, {"worker_id": worker_id, "pid": os.getpid(), "host": pysocket.gethostname()})
        while True:
            msg = mailbox.take(IDLE_CHECK_INTERVAL_S)
            if heart is not None and heart.learner_lost.is_set():
                return LEARNER_LOST_EXIT_CODE
            if msg is None:
                if parent_pid is not None and os.getppid() != parent_pid:
                    logger.warning("Worker %d: learner process %d is gone; exiting.", worker.worker_id, parent_pid)
                    return LEARNER_LOST_EXIT_CODE
                if heart is None and join_deadline is not None and time.monotonic() > join_deadline:
                    logger.error("No learner at %s sent work within %.1f s; exiting.", address, join_timeout)
                    return LEARNER_LOST_EXIT_CODE
                continue
            if msg.kind is Kind.INIT and heart is None:
                worker.worker_id = int(msg.meta.get("worker_id", worker.worker_id))
                if "heartbeat" in msg.meta:
                    # Started before the envs are built: building them may take long.
                    config = Heartbeat(**msg.meta["heartbeat"])
                    endpoint, session = msg.meta["heartbeat_endpoint"], channel.heartbeat_session()
                    heart = HeartbeatClient(context, address, endpoint, session, identity, config, curve=curve)
            if msg.kind is Kind.CLOSE:
                worker.close()
                channel.send(Kind.CLOSED)
                return 0
            seq = mailbox.seq = msg.meta.get("seq")
            try:
                reply = worker.handle(msg)
            except RolloutAborted:
                continue  # the CLOSE that aborted it is next in the queue
            except Exception as exc:
                reply = _error_reply(worker, exc)
            if reply is not None:
                channel.send(reply.kind, {**reply.meta, "seq": seq}, reply.arrays, reply.blobs)
    finally:
        if heart is not None:
            heart.close()
        channel.close(linger=_EXIT_LINGER_MS)
        context.term()


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (``clusterenv-worker``)."""
    parser = argparse.ArgumentParser(description="Serve clusterenv environments to a learner.")
    parser.add_argument("--connect", required=True, help="learner address, e.g. tcp://10.0.0.1:5555")
    slurm_id = os.environ.get("SLURM_PROCID")
    parser.add_argument(
        "--worker-id",
        type=int,
        default=None if slurm_id is None else int(slurm_id),
        help="id to ask the learner for (default: $SLURM_PROCID, else any free id)",
    )
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    parser.add_argument(
        "--join-timeout", type=float, default=None, help="exit if no learner sends work within this many seconds"
    )
    parser.add_argument("--encrypt", action="store_true", help="for a learner with ClusterEnv(encrypt=True)")
    args = parser.parse_args(argv)
    name = "?" if args.worker_id is None else args.worker_id
    logging.basicConfig(level=logging.INFO, format=f"[clusterenv worker {name}] %(message)s")
    key = resolve_secret(None)
    if key is None:
        parser.exit(2, f"error: the shared secret must be set in ${SECRET_ENV_VAR}.\n")
    # Env code (and any process it starts) must not read the secret: it signs commands to workers.
    os.environ.pop(SECRET_ENV_VAR, None)
    # The learner decides when workers stop; Ctrl-C in the terminal reaches it, not us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    started = time.monotonic()
    status = serve(
        args.connect,
        args.worker_id,
        key,
        parent_pid=args.parent_pid,
        join_timeout=args.join_timeout,
        encrypt=args.encrypt,
    )
    logger.debug("Worker %s served for %.1f s.", name, time.monotonic() - started)
    # os._exit, not sys.exit: it skips interpreter teardown, which takes 1.5-5 s once a local
    # policy has loaded torch, and the learner's close() waits for this process to exit.
    # Sockets and envs are closed by now; only the log and std streams need flushing.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main(sys.argv[1:])
