"""What the parts of the worker pool share: its state, and the calls they make on each other, declared once.

The learner's :class:`~clusterenv.learner.pool.WorkerPool` is one object built from three
parts, one module each: messaging and lifecycle (``pool``), membership (``membership``: who
joined, which process serves which worker, rebalancing) and recovery (``recovery``: lost
workers, restarts, re-homing, remote errors). :class:`PoolState` declares the state they
share and the methods one part calls on another, so that each part is type-checked against
the same declaration; ``WorkerPool.__init__`` sets the state.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from clusterenv.launch.launchers import Launcher
from clusterenv.learner.heartbeat_monitor import HeartbeatMonitor
from clusterenv.wire.liveness import Heartbeat
from clusterenv.wire.messages import EnvsMeta, UsageReport
from clusterenv.wire.protocol import Kind, Message
from clusterenv.wire.transport import Channel

if TYPE_CHECKING:
    from clusterenv.errors import WorkerLostError

__all__ = ["LIVENESS_POLL_S", "Command", "OnLoss", "PoolState", "SentCommand"]

# While waiting for replies, wake this often to notice a worker process that died.
LIVENESS_POLL_S = 0.05
#: One worker's command: ``(meta, arrays, blobs)``.
Command = tuple[Mapping[str, Any] | None, Sequence[np.ndarray], Sequence[bytes]]


class OnLoss(enum.Enum):
    """What a command still unanswered by a lost worker means for its replacement; declared by its sender."""

    #: Send it again: on the fresh envs it does what was asked (a seeded reset returns the
    #: same observations, an attribute read the same value, a lockstep rollout a fresh one).
    REPLAY = "replay"
    #: The envs' episodes were cut: the worker joins :meth:`~clusterenv.learner.pool.WorkerPool.take_interrupted`, and
    #: the sender reports the cut (a lockstep step: truncated, flagged ``worker_restarted``).
    INTERRUPT = "interrupt"
    #: The sender's restart hook re-issues what it needs (first-ready steps, prefetched rollouts).
    REISSUE = "reissue"
    #: Nothing can stand in for it (building the envs, installing a policy): ``WorkerLostError``.
    RAISE = "raise"


class SentCommand(NamedTuple):
    """A worker's latest command, kept to replay it to a replacement (a tuple: one is made per worker and step)."""

    kind: Kind
    meta: Mapping[str, Any] | None
    arrays: Sequence[np.ndarray]
    blobs: Sequence[bytes]
    on_loss: OnLoss


class PoolState:
    """The worker pool's shared state (set by ``WorkerPool.__init__``) and its parts' calls on each other."""

    num_workers: int
    heartbeat: Heartbeat
    on_worker_failure: str
    min_workers: int
    start_timeout: float
    describe_work: Callable[[int], str]
    launcher: Launcher
    loads: Callable[[bytes], Any]
    address: str
    seq: int
    on_fatal: Callable[[bool], None]
    #: Worker → the process serving it, named by the id it joined as (itself, unless re-homed).
    serving: dict[int, int]
    _env_counts: list[int]
    _channel: Channel
    _monitor: HeartbeatMonitor
    # Worker → the routing id of the process serving it; routing id → that process (its own worker id).
    _identities: dict[int, bytes]
    _peers: dict[bytes, int]
    _retired: dict[int, str]  # processes lost for good (rehome), with how they were lost
    _watched: set[int]  # processes whose heartbeats the monitor watches (from their first INIT)
    _info: dict[int, Mapping[str, Any]]  # each process's HELLO
    _init_commands: dict[int, tuple[EnvsMeta, list[bytes]]]
    _last_sent: dict[int, SentCommand]
    _latencies: collections.defaultdict[int, collections.deque[float]]  # seconds from command to reply
    _usage: dict[int, UsageReport]  # each worker's last report of what its process uses
    _restart_hooks: list[Callable[[int], None]]
    _interrupted: set[int]
    _awaiting: set[int]  # workers whose latest command has had no reply yet
    _failed: set[int]
    _early_hellos: list[tuple[bytes | None, Message]]
    _stash: list[tuple[int, Message]]  # replies of the current call that arrived while a gather waited for others
    _unread: collections.deque[tuple[bytes | None, Message]]  # messages that arrived while a replacement joined
    _recovering: bool

    if TYPE_CHECKING:  # defined by the parts; declared here for the others

        @property
        def key(self) -> bytes:
            """The shared secret (``pool``)."""

        # messaging (pool)
        def send(
            self,
            worker_id: int,
            kind: Kind,
            meta: Mapping[str, Any] | None = None,
            arrays: Sequence[np.ndarray] = (),
            blobs: Sequence[bytes] = (),
            on_loss: OnLoss | None = None,
        ) -> None:
            """Send one command of the current call (``pool``)."""

        def gather(
            self,
            worker_ids: Iterable[int],
            doing: str,
            timeout: float | None,
            on_request: Callable[[int, Message], bool] | None = None,
            errors_close: bool = True,
        ) -> dict[int, Message]:
            """One reply per worker to the current call (``pool``)."""

        def _worker_of(self, sender: bytes, msg: Message) -> int | None: ...

        # membership
        def _join(self, worker_ids: list[int], timeout: float, at_least: int | None = None) -> list[int]: ...
        def _send_init(self, worker_id: int, *, replacement: bool) -> None: ...
        def _live_processes(self) -> list[int]: ...
        def _least_loaded(self, processes: list[int]) -> int: ...
        def _rebuild_in(self, worker_id: int, target: int) -> None: ...

        # recovery
        def _gone(self, processes: Iterable[int]) -> set[int]: ...
        def _lost(self, worker_id: int, doing: str, why: str = "") -> WorkerLostError: ...
