"""``WorkerPool``: the learner's side of its worker processes.

The pool carries commands and replies; it knows nothing of environments. It owns the
ROUTER channel, the heartbeat monitor, the launcher, which routing id is which worker,
the per-call sequence number (a reply counts only if it answers the current call), and
the translation of remote errors, timeouts and lost workers into exceptions.
:class:`~clusterenv.learner.vector_env.ClusterEnv` builds the commands and reads the replies.

It is built from three parts, one module each: messaging and lifecycle (here), membership
(:mod:`~clusterenv.learner.membership`: joining, which process serves which worker,
rebalancing) and recovery (:mod:`~clusterenv.learner.recovery`: lost workers, restarts,
re-homing, remote errors), which share the state declared in :mod:`~clusterenv.learner.pool_state`.
"""

from __future__ import annotations

import collections
import logging
import secrets
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import zmq

from clusterenv.errors import WorkerTimeoutError
from clusterenv.launch.launchers import Launcher, LocalLauncher, resolve_launcher
from clusterenv.learner.heartbeat_monitor import HeartbeatMonitor
from clusterenv.learner.membership import Membership
from clusterenv.learner.pool_state import LIVENESS_POLL_S, Command, OnLoss, SentCommand
from clusterenv.learner.recovery import Recovery
from clusterenv.learner.timing import StepTiming
from clusterenv.wire.cleanup import remove_stale_dirs
from clusterenv.wire.liveness import Heartbeat, heartbeat_address
from clusterenv.wire.messages import EnvsMeta, UsageReport, usage_report
from clusterenv.wire.protocol import Kind, Message
from clusterenv.wire.safe_pickle import loader
from clusterenv.wire.transport import Channel, Curve, is_loopback, resolve_secret

__all__ = ["LATENCY_WINDOW", "LIVENESS_POLL_S", "Command", "OnLoss", "WorkerPool", "weak_callback"]

logger = logging.getLogger(__name__)

# HELLOs kept while busy, for external replacement workers; the peers are authenticated, the bound is a safeguard.
_MAX_EARLY_HELLOS = 64
# Messages dropped (strays, replies to earlier calls) in one receive step before the caller checks its deadline.
_MAX_DROPS_PER_WAIT = 64
# How long close() waits for workers to exit before killing them, unless told otherwise.
_CLOSE_GRACE_S = 5.0
# Lets a CLOSE queued for a connected worker leave before the socket goes; peers that are gone hold nothing up.
_CLOSE_LINGER_MS = 500
#: How many of each worker's recent replies ``worker_info``'s latency percentiles cover.
LATENCY_WINDOW = 256


class WorkerPool(Membership, Recovery):
    """The learner's workers: start and join, send and gather, liveness, errors, close, restart.

    Args:
        num_workers: how many workers (ids ``0 .. num_workers - 1``).
        bind: learner address; ``None`` is a private ``ipc://`` socket. Non-loopback addresses require a secret.
        secret: the shared secret that keys every connection (or ``$CLUSTERENV_SECRET``); random when workers are local.
        launcher: ``"local"``, ``"external"``, ``"ray"`` or a :class:`~clusterenv.launch.launchers.Launcher`.
        heartbeat: heartbeat constants; a worker whose heartbeat connection drops (dead or frozen) is lost.
        on_worker_failure: ``"raise"``, ``"restart"`` (a new process per lost one) or ``"rehome"``
            (the lost workers' envs move to the surviving processes).
        min_workers: under ``"rehome"``, the fewest surviving processes to go on with; a loss
            that leaves fewer raises ``WorkerLostError``.
        env_counts: how many envs each worker steps (re-homing balances them); default one each.
        start_timeout: seconds for workers to join and build their envs.
        describe_work: names what a worker was running in a lost-worker error, e.g. ``"envs 4..7"``.
        trusted_classes: classes (or ``"module.Name"``) that replies from workers this pool did not
            start itself may contain, beyond data (see :mod:`clusterenv.wire.safe_pickle`).
        encrypt: CurveZMQ on both sockets, keys derived from the secret (see :mod:`clusterenv.wire.transport`).
        compression: the codec for large array frames on tcp connections (:mod:`clusterenv.wire.codecs`).
    """

    def __init__(
        self,
        num_workers: int,
        *,
        bind: str | None,
        secret: str | bytes | None,
        launcher: Launcher | str | None,
        heartbeat: Heartbeat,
        on_worker_failure: str,
        start_timeout: float,
        min_workers: int = 1,
        env_counts: Sequence[int] | None = None,
        describe_work: Callable[[int], str] = lambda worker_id: f"worker {worker_id}",
        trusted_classes: Iterable[type | str] = (),
        encrypt: bool = False,
        compression: str | None = None,
    ) -> None:
        key = resolve_secret(secret)
        if bind is not None and not is_loopback(bind) and key is None:
            raise ValueError(
                f"Refusing to bind {bind!r} without a shared secret: anyone who can reach it could "
                "send pickled code to workers. Pass `secret=` or set $CLUSTERENV_SECRET, or bind a "
                "loopback address."
            )
        self.num_workers = num_workers
        self.heartbeat = heartbeat
        self.on_worker_failure = on_worker_failure
        self.min_workers = min_workers
        self._env_counts = list(env_counts) if env_counts is not None else [1] * num_workers
        self.start_timeout = start_timeout
        self.describe_work = describe_work
        self.launcher: Launcher = resolve_launcher(launcher)
        if key is None and getattr(self.launcher, "needs_shared_secret", False):
            raise ValueError(
                "Workers started by hand or by `srun` (launcher='external') must know the learner's secret, "
                "and none was given: a random one would lock them all out. Pass `secret=` or set "
                "$CLUSTERENV_SECRET, and give the workers the same value."
            )
        #: Unpickles what workers send: plain pickle for our own child processes, else data and trusted classes only.
        self.loads: Callable[[bytes], Any] = loader(
            trusted_classes, restricted=not isinstance(self.launcher, LocalLauncher)
        )
        if bind is None and getattr(self.launcher, "requires_tcp", False):
            bind = "tcp://127.0.0.1:*"  # workers connect from other processes that Ray starts, on this host
        remove_stale_dirs()  # of learners that were killed: a learner starting is when someone is there to do it
        if encrypt and not hasattr(self.launcher, "encrypt"):
            raise ValueError(
                f"`encrypt=True` needs a launcher with an `encrypt` attribute, to start its workers with "
                f"encryption; {type(self.launcher).__name__} has none."
            )
        if hasattr(self.launcher, "encrypt"):  # set either way: a launcher may serve one ClusterEnv after another
            self.launcher.encrypt = encrypt
        key = key or secrets.token_hex(32).encode()
        curve = Curve.from_secret(key) if encrypt else None
        self._context = zmq.Context()
        self._channel = Channel.bind_router(self._context, bind, key, curve=curve, compression=compression)
        self.address = self._channel.endpoint
        #: Each batch step's learner time, busy against waiting (:mod:`clusterenv.learner.timing`).
        self.timing = StepTiming(lambda: self._channel.waited_s)
        if isinstance(self.launcher, LocalLauncher):  # its children talk over pipes (wire/pipes.py), unless encrypted
            self.launcher.attach_pipe = self._channel.add_pipe if self.launcher.pipes and not encrypt else None
        try:
            self._monitor = HeartbeatMonitor(
                self._context, heartbeat_address(bind) if bind else None, key, heartbeat, curve=curve
            )
        except BaseException:
            self._channel.close()
            self._context.term()
            raise
        self.seq = 0
        #: Called once on an error that leaves the workers unusable (``terminate``: kill, don't wait).
        self.on_fatal: Callable[[bool], None] = self.close_after_error
        self.closed = False
        # Worker → the routing id of the process serving it; routing id → that process (its own worker id).
        self._identities: dict[int, bytes] = {}
        self._peers: dict[bytes, int] = {}
        #: Worker → the process serving it, named by the id it joined as (itself, unless re-homed).
        self.serving: dict[int, int] = {}
        self._retired: dict[int, str] = {}  # processes lost for good (rehome), with how they were lost
        self._watched: set[int] = set()  # processes whose heartbeats the monitor watches (from their first INIT)
        self._info: dict[int, Mapping[str, Any]] = {}  # each process's HELLO
        self._init_commands: dict[int, tuple[EnvsMeta, list[bytes]]] = {}
        self._last_sent: dict[int, SentCommand] = {}
        self._sent_at: dict[int, float] = {}  # when each worker was last sent a command
        # Seconds from that command to the reply, per worker.
        self._latencies: collections.defaultdict[int, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=LATENCY_WINDOW)
        )
        self._usage: dict[int, UsageReport] = {}
        self._restart_hooks: list[Callable[[int], None]] = []
        self._interrupted: set[int] = set()
        self._awaiting: set[int] = set()  # workers whose latest command has had no reply yet
        self._failed: set[int] = set()
        self._early_hellos: list[tuple[bytes | None, Message]] = []
        # Replies of the current call that arrived while a gather waited for others (streaming calls).
        self._stash: list[tuple[int, Message]] = []
        # Messages from joined workers that arrived while the pool waited for a replacement to join:
        # read by the one receive step (_next_reply) before the channel, and checked there like any other.
        self._unread: collections.deque[tuple[bytes | None, Message]] = collections.deque()
        self._recovering = False
        self._liveness_due = 0.0  # when receive() next checks every worker's liveness
        self._finalizer = weakref.finalize(self, _shutdown, self.launcher, self._monitor, self._channel, self._context)

    @property
    def heartbeat_endpoint(self) -> str:
        """Where the learner's heartbeat socket listens (workers learn it from their INIT)."""
        return self._monitor.endpoint

    @property
    def key(self) -> bytes:
        """The shared secret the channel authenticates with."""
        return self._channel.key

    # -- commands --------------------------------------------------------------------------
    def new_call(self) -> int:
        """Start a new call: replies to earlier ones are ignored from now on."""
        self.seq += 1
        self._stash.clear()
        return self.seq

    def send(
        self,
        worker_id: int,
        kind: Kind,
        meta: Mapping[str, Any] | None = None,
        arrays: Sequence[np.ndarray] = (),
        blobs: Sequence[bytes] = (),
        on_loss: OnLoss | None = None,
    ) -> None:
        """Send one command of the current call to worker ``worker_id``; ``on_loss``: see :meth:`send_each`."""
        self.send_each(kind, {worker_id: (meta, arrays, blobs)}, on_loss)

    def send_each(self, kind: Kind, commands: Mapping[int, Command], on_loss: OnLoss | None = None) -> None:
        """Send one command of the current call to each worker in ``commands`` (``{worker_id: (meta, arrays, blobs)}``).

        All or nothing: every message is encoded before the first one leaves, so a value
        that cannot travel raises while no worker has received anything. (A reset that
        reached some workers only would silently desynchronize the envs.)

        ``on_loss`` says what the command means for a replacement, should a worker be lost
        before answering it. ``None``: the message serves the worker's pending command (the
        weights answering its pull, the learner's probe outputs), which is recovered as that
        command declared.
        """
        frames_for, serving, identities = self._channel.frames, self.serving, self._identities
        encoded = [
            (
                w,
                None  # its process was given up (rehome): the gather that follows moves the worker
                if serving[w] in self._retired
                else frames_for(kind, self._header(w, meta), arrays, blobs, to=identities[w]),
            )
            for w, (meta, arrays, blobs) in commands.items()
        ]
        sent_at = time.monotonic()
        if kind is Kind.STEP:
            self.timing.start()
        for (worker_id, frames), (meta, arrays, blobs) in zip(encoded, commands.values(), strict=True):
            if on_loss is not None:  # a command, not a message that serves one (weights, probe outputs)
                self._last_sent[worker_id] = SentCommand(kind, meta, arrays, blobs, on_loss)
                self._sent_at[worker_id] = sent_at
                self._awaiting.add(worker_id)
            if frames is None:
                self._failed.add(worker_id)
                continue
            try:
                self._channel.send_frames(frames, to=self._identities[worker_id])
            except zmq.ZMQError as exc:
                if self.on_worker_failure != "raise" and not self._recovering:
                    logger.warning("Worker %d is unreachable (%s); it is taken as lost.", worker_id, exc)
                    self._failed.add(worker_id)
                    continue
                raise self._lost(worker_id, f"sending {kind.name}") from exc

    def _header(self, worker_id: int, meta: Mapping[str, Any] | None) -> dict[str, Any]:
        """A command's meta as sent: the call number, and the worker's slot if another process serves it."""
        header = {**(meta or {}), "seq": self.seq}
        if self.serving[worker_id] != worker_id:
            header["slot"] = worker_id
        return header

    def _worker_of(self, sender: bytes, msg: Message) -> int | None:
        """The worker a message from process ``sender`` speaks for: its own, or the slot it names if it serves that one."""
        slot = msg.meta.get("slot")
        if slot is None:
            return self._peers.get(sender)
        return slot if self._identities.get(slot) == sender else None

    def gather(
        self,
        worker_ids: Iterable[int],
        doing: str,
        timeout: float | None,
        on_request: Callable[[int, Message], bool] | None = None,
        errors_close: bool = True,
    ) -> dict[int, Message]:
        """One reply per worker to the current call; raises on a remote error, a lost worker or a timeout.

        Args:
            worker_ids: the workers to wait for.
            doing: what the call does, for error messages ("stepping").
            timeout: seconds for all replies (``None``: forever).
            on_request: may answer a mid-call request (a weight pull during a rollout) and
                return True: that worker's final reply is then still to come.
            errors_close: whether a remote error leaves the workers unusable (a failed step or
                reset does); ``False`` for calls whose exception is the caller's business
                (an attribute read), which leave every env as it was.
        """
        worker_ids = list(worker_ids)
        pending = set(worker_ids) - self._failed
        replies: dict[int, Message] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            # Checked before every receive, not only when idle, so that stray messages cannot postpone it.
            if deadline is not None and time.monotonic() > deadline:
                error = WorkerTimeoutError(
                    f"Workers {sorted(pending)} did not reply within {timeout} s while {doing}. Their envs are "
                    "now in an unknown state, so the ClusterEnv was closed. Raise `timeout` if the "
                    "environments are this slow."
                )
                self.on_fatal(True)
                raise error
            received = self._next_reply(doing, LIVENESS_POLL_S, errors_close)
            if received is None:
                pending -= self._check_alive(pending, doing)
                continue
            worker_id, msg = received
            if on_request is not None and worker_id in pending and on_request(worker_id, msg):
                continue
            if worker_id in pending:
                pending.discard(worker_id)
                replies[worker_id] = msg
            else:
                self._stash.append(received)  # a streaming call's reply, for receive()
        lost = self._failed.intersection(worker_ids)
        if lost:
            self._recover(sorted(lost), replies, doing)
        return replies

    def request(
        self,
        worker_ids: Iterable[int],
        kind: Kind,
        meta: Mapping[str, Any],
        doing: str,
        timeout: float | None,
        on_loss: OnLoss = OnLoss.REPLAY,
    ) -> dict[int, Message]:
        """Send the same small command to ``worker_ids`` and gather their replies (within the current call)."""
        worker_ids = list(worker_ids)
        self.send_each(kind, dict.fromkeys(worker_ids, (meta, (), ())), on_loss)
        return self.gather(worker_ids, doing, timeout)

    def receive(self, doing: str, timeout: float | None) -> tuple[int, Message] | None:
        """The next reply of the current call from any worker, for calls that stream (first-ready, prefetch).

        Returns ``None`` after ``timeout`` seconds without one (``0``: only what has arrived).
        Errors raise as in :meth:`gather`; a lost worker raises, or under ``"restart"`` is
        recovered at once (its replayed reply, if any, is among the next ones returned).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._stash:
                return self._stash.pop(0)
            # Every LIVENESS_POLL_S, also while replies keep coming: a dead worker must not go unnoticed
            # behind busy ones.
            if time.monotonic() >= self._liveness_due:
                self._liveness_due = time.monotonic() + LIVENESS_POLL_S
                lost = self._check_alive(set(self._identities), doing)
                if lost:
                    replayed: dict[int, Message] = {}
                    self._recover(sorted(lost), replayed, doing, frozenset(lost - self._awaiting))
                    self._stash.extend(replayed.items())
                continue
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            received = self._next_reply(
                doing, LIVENESS_POLL_S if remaining is None else min(LIVENESS_POLL_S, remaining)
            )
            if received is not None:
                return received
            if deadline is not None and time.monotonic() >= deadline and not self._stash:
                return None

    def _next_reply(self, doing: str, wait: float, errors_close: bool = True) -> tuple[int, Message] | None:
        """The one receive step: the next reply to the current call, or ``None`` if ``wait`` s passed without one.

        Drops replies to earlier calls and strays (then takes only what has already arrived,
        and at most ``_MAX_DROPS_PER_WAIT`` of them, so that a flood cannot postpone a
        caller's deadline), keeps early HELLOs (replacements that joined before their
        predecessor's loss was seen), and raises a worker's ERROR.
        """
        for _ in range(_MAX_DROPS_PER_WAIT):
            received = self._unread.popleft() if self._unread else self._channel.recv(wait, routed=True)
            if received is None:
                return None
            wait = 0.0
            sender, msg = received
            worker_id = None if sender is None else self._worker_of(sender, msg)
            if worker_id is None and msg.kind is Kind.HELLO and len(self._early_hellos) < _MAX_EARLY_HELLOS:
                self._early_hellos.append(received)
                continue
            if worker_id is None or msg.meta.get("seq") != self.seq:
                continue  # a reply to a call that timed out earlier, or a stray peer
            if msg.kind is Kind.ERROR:
                raise self._remote_error(worker_id, msg, doing, close=errors_close)
            if worker_id in self._sent_at:
                self._latencies[worker_id].append(time.monotonic() - self._sent_at[worker_id])
            if "usage" in msg.meta and (usage := usage_report(msg.meta["usage"])) is not None:
                self._usage[worker_id] = usage
            self._awaiting.discard(worker_id)
            return worker_id, msg
        return None

    # -- shutdown --------------------------------------------------------------------------
    def close_after_error(self, terminate: bool) -> None:
        """The default ``on_fatal``: close the pool (ClusterEnv replaces it with its own ``close``)."""
        self.close(terminate=terminate)

    def close(self, grace: float | None = None, terminate: bool = False) -> None:
        """Ask workers to exit (after closing their envs); kill those that do not within ``grace`` seconds (default 5).

        ``grace`` bounds the whole wait: confirming CLOSE and then waiting for the processes
        to exit share it, so a worker that ignores CLOSE costs one grace period, not two.
        """
        if self.closed:
            return
        self.closed = True
        deadline = time.monotonic() + (_CLOSE_GRACE_S if grace is None else grace)
        # Also on terminate: workers this process cannot kill (external, remote) must hear it.
        # Without blocking: a frozen worker's full queue must not hang close().
        self._channel.zmq_socket.setsockopt(zmq.SNDTIMEO, 0)
        self.seq += 1
        for identity in self._peers:
            try:
                self._channel.send(Kind.CLOSE, {"seq": self.seq}, to=identity)
            except zmq.ZMQError:
                pass  # already gone
        if not terminate:
            self._await_closed(deadline)
        self.launcher.stop(0.0 if terminate else max(0.0, deadline - time.monotonic()))
        self._finalizer()

    def _await_closed(self, deadline: float) -> None:
        """Wait until ``deadline`` (``time.monotonic()``) for CLOSED from every worker not known to be gone."""
        pending = set(self._peers.values())
        while pending and time.monotonic() < deadline:
            received = self._channel.recv(LIVENESS_POLL_S, routed=True)
            if received is not None:
                worker_id = None if received[0] is None else self._peers.get(received[0])
                if received[1].kind is Kind.CLOSED and worker_id is not None:
                    pending.discard(worker_id)
                continue
            expired = self._monitor.expired()
            pending = {w for w in pending if w not in expired and self.launcher.exit_code(w) is None}
        if pending:
            logger.warning("Workers %s did not confirm CLOSE within the grace period; ending them.", sorted(pending))


def weak_callback(method: Callable[..., None]) -> Callable[..., None]:
    """Call the bound ``method`` while its object lives, a no-op after: hooks must not keep their owner alive."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


def _shutdown(launcher: Launcher, monitor: HeartbeatMonitor, channel: Channel, context: zmq.Context) -> None:
    """Last-resort cleanup, also run at interpreter exit for pools never closed."""
    launcher.stop(0.0)
    if isinstance(launcher, LocalLauncher):
        launcher.attach_pipe = None  # this channel's: a later ClusterEnv on the same launcher sets its own
    monitor.close()
    channel.close(linger=_CLOSE_LINGER_MS)
    context.term()
