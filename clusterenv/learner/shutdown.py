"""Ending a pool's workers: ask each to close its envs and exit, wait for their word, end the rest.

Closing asks every worker process, the learner's own children and workers it cannot kill
(external, remote) alike, then waits within one grace period for their CLOSED, and has the
launcher end whoever is left. The sockets and the context go last, in :func:`shutdown`, which
also runs at interpreter exit for pools never closed.
"""

from __future__ import annotations

import logging
import time

import zmq

from clusterenv.launch.launchers import Launcher, LocalLauncher
from clusterenv.learner.heartbeat_monitor import LIVENESS_POLL_S, HeartbeatMonitor
from clusterenv.learner.membership import Membership
from clusterenv.learner.shared_steps import SharedSteps
from clusterenv.wire.protocol import Kind
from clusterenv.wire.transport import Channel

__all__ = ["close_workers", "shutdown"]

logger = logging.getLogger(__name__)

# How long close() waits for workers to exit before killing them, unless told otherwise.
_CLOSE_GRACE_S = 5.0
# Lets a CLOSE queued for a connected worker leave before the socket goes; peers that are gone hold nothing up.
_CLOSE_LINGER_MS = 500


def close_workers(
    channel: Channel,
    members: Membership,
    monitor: HeartbeatMonitor,
    launcher: Launcher,
    step_path: SharedSteps | None,
    seq: int,
    grace: float | None,
    terminate: bool,
) -> None:
    """Ask every worker to exit (after closing its envs); end those that do not within ``grace`` seconds (default 5).

    ``seq``: the CLOSE's call number. ``terminate``: end them at once, without waiting. The
    step path, if any, is closed with them.
    """
    deadline = time.monotonic() + (_CLOSE_GRACE_S if grace is None else grace)
    # Also on terminate: workers this process cannot kill (external, remote) must hear it.
    # Without blocking: a frozen worker's full queue must not hang close().
    channel.zmq_socket.setsockopt(zmq.SNDTIMEO, 0)
    for identity, process in members.peers.items():
        try:
            channel.send(Kind.CLOSE, {"seq": seq}, to=identity)
        except zmq.ZMQError:
            continue  # already gone
        if step_path is not None:  # a worker spinning on its header turns to its pipe at once
            step_path.announce(process)
    if not terminate:
        _await_closed(channel, members, monitor, launcher, deadline)
    launcher.stop(0.0 if terminate else max(0.0, deadline - time.monotonic()))
    if step_path is not None:
        step_path.close()


def _await_closed(
    channel: Channel, members: Membership, monitor: HeartbeatMonitor, launcher: Launcher, deadline: float
) -> None:
    """Wait until ``deadline`` (``time.monotonic()``) for CLOSED from every worker not known to be gone."""
    pending = set(members.peers.values())
    while pending and time.monotonic() < deadline:
        received = channel.recv(LIVENESS_POLL_S, routed=True)
        if received is not None:
            worker_id = None if received[0] is None else members.peers.get(received[0])
            if received[1].kind is Kind.CLOSED and worker_id is not None:
                pending.discard(worker_id)
            continue
        expired = monitor.expired()
        pending = {w for w in pending if w not in expired and launcher.exit_code(w) is None}
    if pending:
        logger.warning("Workers %s did not confirm CLOSE within the grace period; ending them.", sorted(pending))


def shutdown(launcher: Launcher, monitor: HeartbeatMonitor, channel: Channel, context: zmq.Context) -> None:
    """Last-resort cleanup, also run at interpreter exit for pools never closed."""
    launcher.stop(0.0)
    if isinstance(launcher, LocalLauncher):
        launcher.attach_pipe = None  # this channel's: a later ClusterEnv on the same launcher sets its own
    monitor.close()
    channel.close(linger=_CLOSE_LINGER_MS)
    context.term()
