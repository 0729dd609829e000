"""The worker process: owns a slice of the environments and serves learner commands.

Run by the local launcher as ``python -m clusterenv.worker``, or by hand / ``srun`` on
another host as ``clusterenv-worker --connect tcp://HOST:PORT``. A worker steps its
slice as one :class:`gymnasium.vector.SyncVectorEnv` (``clusterenv.stepping.recording_env``), or with
``procs_per_worker=N`` (``--procs N``) as N of them in child processes
(``clusterenv.worker.env_processes``), so every per-env semantic (autoreset modes, seeding, info
batching) is Gymnasium's own code, not a re-implementation.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket as pysocket
import sys
import time

import zmq

from clusterenv.wire.cleanup import remove_stale_dirs
from clusterenv.wire.liveness import LEARNER_LOST_EXIT_CODE, Heartbeat
from clusterenv.wire.messages import HelloMeta, InitMeta, meta_of
from clusterenv.wire.pipes import PipeClosed
from clusterenv.wire.protocol import Kind
from clusterenv.wire.transport import SECRET_ENV_VAR, Channel, Curve, new_identity, resolve_secret
from clusterenv.worker.commands import IDLE_CHECK_INTERVAL_S, Mailbox, Worker
from clusterenv.worker.env_processes import ENV_PROCESS_LOST_EXIT_CODE, EnvProcessLost
from clusterenv.worker.heartbeat import HeartbeatClient
from clusterenv.worker.local_policy import RolloutAborted
from clusterenv.worker.local_policy import install as install_policy_handlers
from clusterenv.worker.shared_steps import install_step_handlers

__all__ = ["main", "serve", "use_batch_scheduling"]

logger = logging.getLogger(__name__)

#: ``--connect pipe://FD``: a pipe inherited from the learner (local workers; :mod:`clusterenv.wire.pipes`).
PIPE_SCHEME = "pipe://"
# Lets the last reply (CLOSED) leave before the socket goes; bounded for a learner that is gone.
_EXIT_LINGER_MS = 500


def _learner_lost(mailbox: Mailbox) -> int:
    """Close the envs of a worker whose learner is gone, and what the learner left on this host; the exit status.

    Nobody is left to report a failure to. The learner's scratch directories (ipc sockets,
    shared observations) are removed once its process is gone: it could not remove them itself.
    """
    for worker in mailbox.workers:
        try:
            worker.close()
        except Exception:
            logger.warning("Closing the envs failed.", exc_info=True)
    remove_stale_dirs()
    return LEARNER_LOST_EXIT_CODE


def serve(
    address: str,
    worker_id: int | None,
    key: bytes,
    *,
    parent_pid: int | None = None,
    join_timeout: float | None = None,
    procs: int | None = None,
    encrypt: bool = False,
    wake_fd: int | None = None,
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
        wake_fd: with a ``pipe://`` address, the wake socket of the shared step path.

    Returns:
        The exit status for the process: 0 after CLOSE, ``LEARNER_LOST_EXIT_CODE`` when the
        learner went away (process gone, heartbeats stopped, never sent work),
        ``ENV_PROCESS_LOST_EXIT_CODE`` when one of its env processes died.
    """
    context = zmq.Context()
    identity = new_identity(worker_id)
    curve = Curve.from_secret(key) if encrypt else None
    if address.startswith(PIPE_SCHEME):  # a pipe from the learner that started this process
        channel = Channel.connect_pipe(int(address.removeprefix(PIPE_SCHEME)), key, identity, wake_fd=wake_fd)
    else:
        channel = Channel.connect_dealer(context, address, key, identity, curve=curve)

    def make_worker(slot: int) -> Worker:
        worker = Worker(slot, procs)
        install_policy_handlers(worker)  # the local-policy commands (SET_POLICY, SET_WEIGHTS, ROLLOUT)
        install_step_handlers(worker)  # the shared step path (SHARE_STEP, WAKE_UP)
        return worker

    mailbox = Mailbox(channel, make_worker)
    own = mailbox.worker
    own.worker_id = -1 if worker_id is None else worker_id
    heart: HeartbeatClient | None = None
    join_deadline = None if join_timeout is None else time.monotonic() + join_timeout
    try:
        channel.send(Kind.HELLO, HelloMeta(worker_id=worker_id, pid=os.getpid(), host=pysocket.gethostname()))
        while True:
            msg = mailbox.take(IDLE_CHECK_INTERVAL_S)
            if heart is not None and heart.learner_lost.is_set():
                return _learner_lost(mailbox)  # while the watchdog waits: if closing hangs, it ends the process
            if msg is None:
                if parent_pid is not None and os.getppid() != parent_pid:
                    logger.warning("Worker %d: learner process %d is gone; exiting.", own.worker_id, parent_pid)
                    return _learner_lost(mailbox)
                if heart is None and join_deadline is not None and time.monotonic() > join_deadline:
                    logger.error("No learner at %s sent work within %.1f s; exiting.", address, join_timeout)
                    return LEARNER_LOST_EXIT_CODE
                continue
            if msg.kind is Kind.INIT and "slot" not in msg.meta:
                own.worker_id = meta_of(msg, InitMeta)["worker_id"]
            if msg.kind is Kind.INIT and heart is None:
                init = meta_of(msg, InitMeta)
                # Started before the envs are built: building them may take long.
                config = Heartbeat(**init["heartbeat"])
                endpoint, session = init["heartbeat_endpoint"], channel.heartbeat_session()
                heart = HeartbeatClient(
                    context, address, endpoint, session, identity, config, parent_pid=parent_pid, curve=curve
                )
            if msg.kind is Kind.CLOSE and "slot" in msg.meta:
                mailbox.drop(msg.meta["slot"])  # the learner moved that worker's envs to another process
                continue
            if msg.kind is Kind.CLOSE:
                for worker in mailbox.workers:
                    worker.close()
                channel.send(Kind.CLOSED)
                return 0
            mailbox.seq = msg.meta.get("seq")
            worker = mailbox.worker_for(msg)
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
                reply = worker.failure_reply(exc)
            if reply is not None:
                worker.send_reply(reply)
    except PipeClosed:
        logger.warning("Worker %d: the learner closed its pipe; exiting.", own.worker_id)
        return _learner_lost(mailbox)
    finally:
        for worker in mailbox.workers:
            worker.terminate()  # after a CLOSE there is nothing left to end
        if heart is not None:
            heart.close()
        channel.close(linger=_EXIT_LINGER_MS)
        context.term()


def use_batch_scheduling() -> bool:
    """Mark this process (and the threads and env processes it starts) as CPU-bound for Linux's scheduler.

    Under ``SCHED_BATCH`` a worker woken by its learner's command does not preempt the learner
    on the learner's core (where the kernel tends to put a task woken by a pipe write): it
    waits for a free core while the learner goes on sending. Its share of CPU is unchanged.
    Measured on 16 cores (64 envs of 1 ms): the last of 16 workers started 0.7 ms after the
    learner's call instead of 1.2 ms.

    A wish, not a requirement: a process under another policy than the default (``SCHED_IDLE``
    from ``chrt -i`` or a job wrapper, a real-time one) keeps it, and a refusal (no such policy,
    a kernel or sandbox that says no) is logged once; the worker goes on either way. Returns
    whether the policy was set.
    """
    try:
        if os.sched_getscheduler(0) != os.SCHED_OTHER:
            logger.info("Keeping the scheduling policy this worker inherited (%d).", os.sched_getscheduler(0))
            return False
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError) as exc:  # AttributeError: not Linux (no sched_* or no SCHED_BATCH)
        logger.info("Running at the inherited scheduling policy: SCHED_BATCH could not be set (%s).", exc)
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (``clusterenv-worker``)."""
    parser = argparse.ArgumentParser(description="Serve clusterenv environments to a learner.")
    parser.add_argument(
        "--connect", required=True, help="learner address, e.g. tcp://10.0.0.1:5555 (pipe://FD: started by the learner)"
    )
    slurm_id = os.environ.get("SLURM_PROCID")
    parser.add_argument(
        "--worker-id",
        type=int,
        default=None if slurm_id is None else int(slurm_id),
        help="id to ask the learner for (default: $SLURM_PROCID, else any free id)",
    )
    parser.add_argument(
        "--wake",
        type=int,
        default=None,
        help="with pipe://FD: the wake socket of the shared step path (started by the learner)",
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
    parser.add_argument(
        "--batch-scheduling",
        action="store_true",
        help="run as a CPU-bound (SCHED_BATCH) process on Linux, so that waking it never preempts the learner",
    )
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
    if args.batch_scheduling:
        use_batch_scheduling()
    started = time.monotonic()
    status = serve(
        args.connect,
        args.worker_id,
        key,
        parent_pid=args.parent_pid,
        join_timeout=args.join_timeout,
        procs=args.procs,
        encrypt=args.encrypt,
        wake_fd=args.wake,
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
