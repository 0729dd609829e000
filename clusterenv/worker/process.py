"""The worker process: owns a slice of the environments and serves learner commands.

Run by the local launcher as ``python -m clusterenv.worker``, or by hand / ``srun`` on
another host as ``clusterenv-worker --connect tcp://HOST:PORT``. A worker steps its
slice as one :class:`gymnasium.vector.SyncVectorEnv` (``clusterenv.worker.recording_env``), or with
``procs_per_worker=N`` (``--procs N``) as N of them in child processes
(``clusterenv.worker.env_processes``), so every per-env semantic (autoreset modes, seeding, info
batching) is Gymnasium's own code, not a re-implementation.
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
from collections import deque
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np
import zmq
from gymnasium.vector import AutoresetMode

from clusterenv.wire.leaves import batch_of_items, is_array_tree, leaf_arrays, unflatten
from clusterenv.wire.liveness import LEARNER_LOST_EXIT_CODE, Heartbeat
from clusterenv.wire.protocol import Kind, Message
from clusterenv.wire.transport import SECRET_ENV_VAR, Channel, Curve, new_identity, resolve_secret
from clusterenv.worker.env_processes import ENV_PROCESS_LOST_EXIT_CODE, ChildEnvError, EnvProcessLost, ProcVectorEnv
from clusterenv.worker.failures import EnvFailure, EnvTracker, error_reply
from clusterenv.worker.heartbeat import HeartbeatClient
from clusterenv.worker.local_policy import RolloutAborted
from clusterenv.worker.local_policy import install as install_policy_handlers
from clusterenv.worker.recording_env import RecordingVectorEnv, build, dumps, install_registry

__all__ = ["Mailbox", "Worker", "main", "serve"]

logger = logging.getLogger(__name__)

# How often an idle worker wakes up to check that its learner still exists.
IDLE_CHECK_INTERVAL_S = 0.5
# Lets the last reply (CLOSED) leave before the socket goes; bounded for a learner that is gone.
_EXIT_LINGER_MS = 500


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

    def __init__(self, worker_id: int, procs: int | None = None) -> None:
        self.worker_id = worker_id
        self.procs = procs  # env processes asked for on the command line (else the learner's procs_per_worker)
        self.env_offset = 0
        self.envs: RecordingVectorEnv | ProcVectorEnv | None = None
        self.array_obs = True
        self.tracker = EnvTracker()  # which env the command being handled reached, should one raise
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
        """Build this worker's envs from the pickled factories and describe their spaces.

        The first blob is the context the factories need: the learner's env registry, and
        the single observation space when the learner was given one (``observation_mode``
        as a ``(batch space, single space)`` tuple). The factories follow.
        """
        self.env_offset = int(msg.meta["env_offset"])
        procs = self.procs if self.procs is not None else int(msg.meta.get("procs_per_worker", 1))
        context = pickle.loads(msg.blobs[0])
        install_registry(context["registry"])
        mode = (
            context["observation_space"] if msg.meta["observation_mode"] == "custom" else msg.meta["observation_mode"]
        )
        autoreset_mode, env_blobs = AutoresetMode(msg.meta["autoreset_mode"]), list(msg.blobs[1:])
        if procs > 1:
            self.envs = ProcVectorEnv(
                env_blobs,
                procs,
                observation_mode=mode,
                autoreset_mode=autoreset_mode,
                env_offset=self.env_offset,
                registry=context["registry"],
            )
        else:
            self.envs = build(env_blobs, mode, autoreset_mode, self.tracker)
        if msg.meta.get("replacement") and self.envs.autoreset_mode is AutoresetMode.NEXT_STEP:
            # A replacement for a lost worker: its envs' episodes were cut short, so under
            # NEXT_STEP their next step is the autoreset step (see docs/guides/fault-tolerance.md).
            self.envs.mark_autoreset_pending()
        self.array_obs = is_array_tree(self.envs.single_observation_space)
        return Message(Kind.READY, blobs=[cloudpickle.dumps(self.envs.description())])

    # -- stepping --------------------------------------------------------------------------
    def _result(self, obs: Any, extra: list[np.ndarray]) -> Message:
        assert self.envs is not None
        log, self.envs.info_log = self.envs.info_log, []
        framed = self.array_obs and not self.shared_obs
        arrays = (leaf_arrays(self.envs.single_observation_space, obs) if framed else []) + extra
        blobs = [b""] if not log else [dumps(log)]
        if not self.array_obs:
            blobs.append(dumps(self.envs.env_observations()))
        return Message(Kind.RESULT, {}, arrays, blobs)

    def reset(self, msg: Message) -> Message:
        """Reset the envs (those in the mask, if any) with their seeds, and one options dict or one per env."""
        assert self.envs is not None
        options = pickle.loads(msg.blobs[0]) if msg.blobs else None
        mask = msg.meta.get("mask")
        if isinstance(options, list):
            obs, _ = self.envs.reset_each(msg.meta["seeds"], options, mask)
        else:
            if mask is not None:
                options = dict(options or {}, reset_mask=np.array(mask, dtype=np.bool_))
            obs, _ = self.envs.reset(seed=msg.meta["seeds"], options=options)
        self.never_reset = False
        return self._result(obs, [])

    def step(self, msg: Message) -> Message:
        """Step every env with its slice of the actions: leaf arrays, or pickled per-env actions."""
        assert self.envs is not None
        if msg.blobs:  # actions without a fixed array form: each env gets the very object the learner was given
            actions = batch_of_items(self.envs.action_space, pickle.loads(msg.blobs[0]))
        else:
            # Copies: env code may write into its action, and received frames are read-only.
            actions = unflatten(self.envs.single_action_space, [a.copy() for a in msg.arrays])
        obs, rewards, terminations, truncations, _ = self.envs.step(actions)
        return self._result(obs, [rewards, terminations, truncations])

    def share_obs(self, msg: Message) -> Message:
        """Write observations into the learner's shared batch from now on, if it can be mapped here."""
        assert self.envs is not None
        if self.array_obs and int(msg.meta["stop"]) - int(msg.meta["start"]) == self.envs.num_envs:
            self.shared_obs = self.envs.share_observations(msg.meta) or self.shared_obs
        return Message(Kind.VALUE, {"attached": self.shared_obs})

    # -- attributes ------------------------------------------------------------------------
    def call(self, msg: Message) -> Message:
        """Call (or read) an attribute of the envs in ``indices`` (all: ``None``), or apply a function to them."""
        assert self.envs is not None
        args, kwargs = pickle.loads(msg.blobs[0])
        results = self.envs.call_at(msg.meta.get("indices"), msg.meta["name"], args, kwargs)
        return Message(Kind.VALUE, blobs=[cloudpickle.dumps(results)])

    def set_attr(self, msg: Message) -> Message:
        """Set an attribute on the envs in ``indices`` (all: ``None``), one value each."""
        assert self.envs is not None
        self.envs.set_attr_at(msg.meta.get("indices"), msg.meta["name"], list(pickle.loads(msg.blobs[0])))
        return Message(Kind.VALUE, blobs=[cloudpickle.dumps(None)])

    def close(self) -> None:
        """Close the envs."""
        if self.envs is not None:
            self.envs.close()

    def terminate(self) -> None:
        """End the env processes now, if any, without closing their envs (the learner is gone)."""
        if isinstance(self.envs, ProcVectorEnv):
            self.envs.terminate()

    def handle(self, msg: Message) -> Message | None:
        """Run the handler for ``msg`` and return the reply."""
        handler = self.handlers.get(msg.kind)
        if handler is None:
            return error_reply(EnvFailure(None, "ProtocolError", f"Worker cannot handle {msg.kind.name}.", ""))
        if msg.kind is not Kind.INIT and self.envs is None:
            return error_reply(EnvFailure(None, "ProtocolError", f"{msg.kind.name} before INIT.", ""))
        return handler(msg)


def _close_quietly(worker: Worker) -> None:
    """Close the envs of a worker whose learner is gone: nobody is left to report a failure to."""
    try:
        worker.close()
    except Exception:
        logger.warning("Closing the envs failed.", exc_info=True)


def _error_reply(worker: Worker, exc: BaseException) -> Message:
    if isinstance(exc, ChildEnvError):  # raised in an env process, which captured it
        failure = exc.failure
    else:
        misfit = worker.envs.misfit_observation if isinstance(worker.envs, RecordingVectorEnv) else None
        failure = EnvFailure.capture(exc, worker.tracker, misfit)
    return error_reply(failure.shifted(worker.env_offset))


def serve(
    address: str,
    worker_id: int | None,
    key: bytes,
    *,
    parent_pid: int | None = None,
    join_timeout: float | None = None,
    procs: int | None = None,
    encrypt: bool = False,
) -> int:
    """Connect to the learner at ``address`` and serve commands until CLOSE or learner death.

    Args:
        address: the learner's address.
        worker_id: the id to ask for (``None``: any; the learner assigns it at HELLO).
        key: the shared secret.
        parent_pid: exit when this process is gone (local workers).
        join_timeout: give up if the learner has not sent INIT within this many seconds.
        procs: env processes to step the slice with (``None``: the learner's ``procs_per_worker``).
        encrypt: connect with CurveZMQ, as a learner with ``ClusterEnv(encrypt=True)`` expects.

    Returns:
        The exit status for the process: 0 after CLOSE, ``LEARNER_LOST_EXIT_CODE`` when the
        learner went away (process gone, heartbeats stopped, never sent work),
        ``ENV_PROCESS_LOST_EXIT_CODE`` when one of its env processes died.
    """
    context = zmq.Context()
    identity = new_identity(worker_id)
    curve = Curve.from_secret(key) if encrypt else None
    channel = Channel.connect_dealer(context, address, key, identity, curve=curve)
    worker = Worker(-1 if worker_id is None else worker_id, procs)
    worker.mailbox = mailbox = Mailbox(channel, worker)
    install_policy_handlers(worker)  # the local-policy commands (SET_POLICY, SET_WEIGHTS, ROLLOUT)
    heart: HeartbeatClient | None = None
    join_deadline = None if join_timeout is None else time.monotonic() + join_timeout
    try:
        channel.send(Kind.HELLO, {"worker_id": worker_id, "pid": os.getpid(), "host": pysocket.gethostname()})
        while True:
            msg = mailbox.take(IDLE_CHECK_INTERVAL_S)
            if heart is not None and heart.learner_lost.is_set():
                _close_quietly(worker)  # while the watchdog waits: if closing hangs, it ends the process
                return LEARNER_LOST_EXIT_CODE
            if msg is None:
                if parent_pid is not None and os.getppid() != parent_pid:
                    logger.warning("Worker %d: learner process %d is gone; exiting.", worker.worker_id, parent_pid)
                    _close_quietly(worker)
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
                    heart = HeartbeatClient(
                        context, address, endpoint, session, identity, config, parent_pid=parent_pid, curve=curve
                    )
            if msg.kind is Kind.CLOSE:
                worker.close()
                channel.send(Kind.CLOSED)
                return 0
            seq = mailbox.seq = msg.meta.get("seq")
            worker.tracker.forget()
            try:
                reply = worker.handle(msg)
            except RolloutAborted:
                continue  # the CLOSE that aborted it is next in the queue
            except EnvProcessLost as exc:
                # Its envs are gone with it: exit, so that the learner reports or replaces this worker.
                logger.error("Worker %d: %s; exiting.", worker.worker_id, exc)
                return ENV_PROCESS_LOST_EXIT_CODE
            except Exception as exc:
                reply = _error_reply(worker, exc)
            if reply is not None:
                channel.send(reply.kind, {**reply.meta, "seq": seq}, reply.arrays, reply.blobs)
    finally:
        worker.terminate()  # after a CLOSE there is nothing left to end
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
    parser.add_argument(
        "--procs",
        type=int,
        default=None,
        help="env processes that step this worker's envs (default: the learner's procs_per_worker)",
    )
    parser.add_argument("--encrypt", action="store_true", help="for a learner with ClusterEnv(encrypt=True)")
    args = parser.parse_args(argv)
    if args.procs is not None and args.procs < 1:
        parser.error(f"argument --procs: must be at least 1, got {args.procs}")
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
        procs=args.procs,
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
