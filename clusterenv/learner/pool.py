"""``WorkerPool``: the learner's side of its worker processes.

The pool carries commands and replies; it knows nothing of environments. It owns the
channel (ROUTER socket and local pipes), the heartbeat monitor, the launcher, the per-call
sequence number (a reply counts only if it answers the current call), and the translation
of remote errors, timeouts and lost workers into exceptions.
:class:`~clusterenv.learner.vector_env.ClusterEnv` builds the commands and reads the replies.

It holds three parts, each with its own state: :attr:`WorkerPool.members`
(:class:`~clusterenv.learner.membership.Membership`: joining, which process serves which
worker, where envs should move), :attr:`WorkerPool.recovery`
(:class:`~clusterenv.learner.recovery.Recovery`: what a lost worker means, as a plan) and
:attr:`WorkerPool.outbox` (:class:`~clusterenv.learner.outbox.Outbox`: commands on their way
out, each worker's latest). The pool receives itself, in one loop (:meth:`WorkerPool._await`)
that serves ``gather``, ``receive`` and the carrying out of recovery plans and moves; no call
re-enters it. Closing is :mod:`clusterenv.learner.shutdown`'s.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import secrets
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import zmq

from clusterenv.errors import ClusterEnvError, ProtocolError, WorkerStartError, WorkerTimeoutError
from clusterenv.launch.launchers import Launcher, LocalLauncher, resolve_launcher
from clusterenv.learner.commands import Command, FollowUp, OnLoss
from clusterenv.learner.cuts import Cut, CutLedger
from clusterenv.learner.heartbeat_monitor import LIVENESS_POLL_S, HeartbeatMonitor
from clusterenv.learner.membership import Membership, Received
from clusterenv.learner.outbox import Outbox
from clusterenv.learner.recovery import LOST_AGAIN, Action, Recovery, Step, remote_error
from clusterenv.learner.shared_steps import NOT_YET, SharedSteps
from clusterenv.learner.shutdown import close_workers, shutdown
from clusterenv.learner.timing import StepTiming
from clusterenv.wire.cleanup import remove_stale_dirs
from clusterenv.wire.liveness import Heartbeat, heartbeat_address
from clusterenv.wire.messages import EnvsMeta, UsageReport, usage_report
from clusterenv.wire.pipes import WAKE_READ_TIMEOUT_S
from clusterenv.wire.protocol import Kind, Message
from clusterenv.wire.safe_pickle import loader
from clusterenv.wire.step_region import StepRegion
from clusterenv.wire.transport import WAKE_UP, Channel, Curve, is_loopback, resolve_secret

__all__ = [
    "LATENCY_WINDOW",
    "Command",
    "FollowUp",
    "OnLoss",
    "RestartHook",
    "WorkerPool",
    "weak_callback",
]

logger = logging.getLogger(__name__)

# HELLOs kept while busy, for external replacement workers; the peers are authenticated, the bound is a safeguard.
_MAX_EARLY_HELLOS = 64
# Messages dropped (strays, replies to earlier calls) in one receive step before the caller checks its deadline.
_MAX_DROPS_PER_WAIT = 64
#: How many of each worker's recent replies ``worker_info``'s latency percentiles cover.
LATENCY_WINDOW = 256

#: Called with a worker's id once its envs were rebuilt in a new process or another host; returns
#: what that process needs before the worker's pending command is recovered (see ``FollowUp``).
RestartHook = Callable[[int], Iterable[FollowUp] | None]
_R = TypeVar("_R")


class WorkerPool:
    """The learner's workers: start and join, send and gather, liveness, errors, close, restart.

    Args:
        num_workers: how many workers (ids ``0 .. num_workers - 1``).
        bind: learner address; ``None`` is a private ``ipc://`` socket. Non-loopback addresses require a secret.
        secret: the shared secret that keys every connection (or ``$CLUSTERENV_SECRET``); random when workers are local.
        launcher: ``"local"``, ``"external"``, ``"ray"`` or a :class:`~clusterenv.launch.launchers.Launcher`.
        heartbeat: heartbeat constants; a worker whose heartbeat connection drops (dead or frozen) is lost.
        on_worker_failure: ``"raise"``, ``"restart"`` (a new process per lost one) or ``"rehome"``
            (the lost workers' envs move to the surviving processes).
        start_timeout: seconds for workers to join and build their envs.
        min_workers: under ``"rehome"``, the fewest surviving processes to go on with; a loss
            that leaves fewer raises ``WorkerLostError``.
        env_counts: how many envs each worker steps (re-homing balances them); default one each.
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
        self.start_timeout = start_timeout
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
        # Messages from joined workers that arrived while the pool waited for a replacement to join:
        # read by the one receive step (_next_reply) before the channel, and checked there like any other.
        self._unread: collections.deque[Received] = collections.deque()
        #: Who joined, which process serves which worker, where envs should move.
        self.members = Membership(
            num_workers,
            list(env_counts) if env_counts is not None else [1] * num_workers,
            launcher=self.launcher,
            channel=self._channel,
            monitor=self._monitor,
            heartbeat=heartbeat,
            defer=self._unread.append,
        )
        #: What a lost worker means, decided as a plan that :meth:`_carry_out` follows.
        self.recovery = Recovery(
            on_worker_failure,
            min_workers,
            members=self.members,
            launcher=self.launcher,
            monitor=self._monitor,
            describe_work=describe_work,
        )
        # Seconds from each worker's latest command to its reply.
        self._latencies: collections.defaultdict[int, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=LATENCY_WINDOW)
        )
        self._usage: dict[int, UsageReport] = {}  # each worker's last report of what its process uses
        self._restart_hooks: list[RestartHook] = []
        #: The workers whose envs' episodes were cut and not yet reported (a lost worker's
        #: interrupted step here; recycling and rebalancing there), for the stepping modes to report.
        self.cuts = CutLedger()
        # The replies taken but not yet returned: a gather interrupted anywhere (Ctrl-C) leaves them here (and the
        # outbox the commands not yet delivered), and the next one goes on from them.
        self._replies: dict[int, Message] = {}
        self._failed: set[int] = set()  # workers found lost, until recovery gives them a new host
        #: The commands on their way out, and each worker's latest one (what recovery reads).
        self.outbox = Outbox(
            self._channel,
            self.members,
            self.recovery,
            self.timing,
            self._fatal,
            self._failed.add,
            lambda: self.step_path,
            num_workers,
        )
        # Replies of the current call that arrived while a gather waited for others (streaming calls).
        self._stash: list[tuple[int, Message]] = []
        self._liveness_due = 0.0  # when receive() next checks every worker's liveness
        self._socket_due = 0.0  # when gather() next leaves a whole call to _await, which reads the socket too
        #: The shared step path of the workers on this host (:meth:`share_steps`), if there is one.
        self.step_path: SharedSteps | None = None
        self._finalizer = weakref.finalize(self, shutdown, self.launcher, self._monitor, self._channel, self._context)

    @property
    def heartbeat_endpoint(self) -> str:
        """Where the learner's heartbeat socket listens (workers learn it from their INIT)."""
        return self._monitor.endpoint

    @property
    def key(self) -> bytes:
        """The shared secret the channel authenticates with."""
        return self._channel.key

    @property
    def worker_info(self) -> list[dict[str, Any]]:
        """What :attr:`ClusterEnv.worker_info <clusterenv.ClusterEnv.worker_info>` shows, per worker process."""
        described = self.members.describe(self._latencies, self._usage)
        for info in described:
            info["step_path"] = "messages" if self.step_path is None else self.step_path.path_of(info["serves"])
        return described

    @property
    def learner_info(self) -> dict[str, Any]:
        """What :attr:`ClusterEnv.learner_info <clusterenv.ClusterEnv.learner_info>` shows."""
        info = self.timing.summary()
        if self.step_path is not None:
            info.update(self.step_path.describe())
        return info

    def can_wake(self, worker_id: int) -> bool:
        """Whether worker ``worker_id``'s process has a wake socket: the shared step path can reach it."""
        return self._channel.can_wake(self.members.identities.get(worker_id))

    def share_steps(self, region: StepRegion, timeout: float | None, spin_us: float | None = None) -> set[int]:
        """Put every worker that can on the shared step path through ``region``; the workers that joined it.

        Restarted and moved workers join it again once their envs are rebuilt (a restart hook
        that runs before any other). If none joined, the pool has no step path. ``spin_us``:
        how each side waits (:class:`~clusterenv.learner.shared_steps.SharedSteps`).
        """
        path = SharedSteps(region, self._channel, self.members, timeout, spin_us)
        try:
            offers = {w: offer for w in range(self.num_workers) if (offer := path.offer(w)) is not None}
            if offers:
                self.new_call()
                commands = {w: (offer.meta, (), ()) for w, offer in offers.items()}
                self.send_each(Kind.SHARE_STEP, commands, OnLoss.RAISE)
                for worker_id, reply in self.gather(offers, "mapping the shared step region", timeout).items():
                    path.joined(worker_id, reply)
        except BaseException:
            path.close()
            raise
        if path.on_path:
            self.step_path = path
        else:  # none could (env processes, say): the region goes
            path.close()
        return path.on_path

    # -- joining and moving ----------------------------------------------------------------
    def start(self) -> None:
        """Start every worker through the launcher and wait for each to join.

        Under ``"rehome"`` the run may start with fewer processes: if at least ``min_workers``
        joined within ``start_timeout``, the missing workers' envs go to them, and processes
        that connect later join through :meth:`rebalance`.
        """
        elastic = self.recovery.on_worker_failure == "rehome"
        at_least = self.recovery.min_workers if elastic else None
        self.members.start(self.address, self.key, self.start_timeout, self.seq, at_least)

    def send_init(self, worker_id: int, meta: EnvsMeta, blobs: list[bytes]) -> None:
        """Send a worker its INIT (kept, to build a replacement the same way); its heartbeats are watched."""
        self.members.keep_init(worker_id, meta, blobs)
        self._send_init(worker_id, replacement=False)

    def _send_init(self, worker_id: int, *, replacement: bool) -> None:
        init, blobs = self.members.init_command(worker_id, replacement=replacement)
        self.send(worker_id, Kind.INIT, init, blobs=blobs, on_loss=OnLoss.RAISE)

    def rebalance(self, wait: float) -> list[int]:
        """Admit the worker processes that connected since, then move workers' envs to even the load; the moved workers.

        A process that joins asking for the id of a worker whose envs another process carries
        gets them back first; then workers move from the most to the least loaded process
        while that lowers the larger load (:meth:`Membership.moves_to_balance`). A moved
        worker's envs are closed where they were and rebuilt, from the same INIT, in their new
        process, whose restart hooks run.

        Args:
            wait: if no process has connected yet, wait up to this many seconds for one.
        """
        self.members.admit(wait, self.seq)
        moved = []
        # One move at a time, each planned on the map as the last one (or a loss during it) left it.
        while moves := self.members.moves_to_balance():
            worker_id, target = moves[0]
            logger.info(
                "Moving worker %d's envs (%s) to worker process %d.",
                worker_id,
                self.recovery.describe_work(worker_id),
                target,
            )
            # A CLOSE naming a worker the process serves for another: it closes those envs and stays.
            self.send(worker_id, Kind.CLOSE)
            self.members.assign(worker_id, target)
            doing = f"rebuilding the envs of worker {worker_id} in worker {target}"
            lost = self._rebuild(worker_id, doing)
            if lost:  # the new host was lost while building them: recovered as any loss, nothing pending
                self._carry_out(self.recovery.plan(lost, self.outbox.last_sent, idle=lost), {}, doing)
            self.cuts.record(worker_id, Cut.MOVED)
            moved.append(worker_id)
        return moved

    # -- commands --------------------------------------------------------------------------
    def new_call(self) -> int:
        """Start a new call: replies to earlier ones are ignored from now on."""
        self.seq += 1
        self._stash.clear()
        self.outbox.new_call()
        self._replies.clear()
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
        self.outbox.send_each(kind, commands, on_loss, self.seq)

    def can_step_shared(self) -> bool:
        """Whether a lockstep step of every worker can go through the shared step path alone (:meth:`send_shared`)."""
        path = self.step_path
        return path is not None and path.everyone and not self._failed and not self._unread and not self.cuts

    def send_shared(self, actions: Sequence[np.ndarray]) -> None:
        """A lockstep STEP to every worker, all on the shared step path: what ``send_each`` would do.

        The batch's actions go into the region at once, and the command each worker would be
        sent is recorded for recovery (a lost worker's episodes are cut, :data:`OnLoss.INTERRUPT`)
        and for an interrupted send. :meth:`gather` waits for the replies (or
        :class:`~clusterenv.learner.lockstep.Lockstep` reads them from the words).
        """
        self.outbox.send_shared(actions, self.seq)

    def may_wait_on_words(self) -> bool:
        """Whether a lockstep step may read its replies from the words alone (else :meth:`gather` reads the socket).

        Not while messages wait unread, or once every ``LIVENESS_POLL_S``, when the receive
        loop reads the socket (joins, remote workers' messages) and checks liveness.
        """
        return not self._unread and not self._failed and time.monotonic() < self._socket_due

    def took_shared_step(self) -> None:
        """A lockstep step's replies were all read from the words: its latencies are noted, its batch step ends."""
        latency = self.outbox.replied_all()
        for worker_id in range(self.num_workers):
            self._latencies[worker_id].append(latency)
        self.timing.finish()

    def _worker_of(self, sender: bytes, msg: Message) -> int | None:
        """The worker a message from process ``sender`` speaks for: its own, or the slot it names (if it serves it)."""
        slot = msg.meta.get("slot")
        if slot is None:
            return self.members.peers.get(sender)
        return slot if self.members.identities.get(slot) == sender else None

    def gather(
        self,
        worker_ids: Iterable[int],
        doing: str,
        timeout: float | None,
        on_request: Callable[[int, Message], bool] | None = None,
        errors_close: bool = True,
    ) -> dict[int, Message]:
        """One reply per worker to the current call; raises on a remote error, a lost worker or a timeout.

        Every other worker's reply is collected first, so that no env's data is lost or
        duplicated; then lost workers are recovered as :meth:`Recovery.plan` decides (a
        replayed command's reply is among those returned).

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
        started, replies = time.monotonic(), self._replies
        pending = {w for w in worker_ids if w not in replies}
        self.outbox.deliver_unsent(pending, self.seq)
        if self.step_path is not None and on_request is None:
            self._await_shared(pending, replies)
        lost = self._await(pending, replies, doing, timeout, on_request, errors_close, started) if pending else set()
        if lost:
            self._carry_out(self.recovery.plan(lost, self.outbox.last_sent), replies, doing)
        gathered, self._replies = replies, {}
        return gathered

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
                lost = self._check_alive(set(self.members.identities), doing)
                if lost:
                    replayed: dict[int, Message] = {}
                    plan = self.recovery.plan(lost, self.outbox.last_sent, idle=lost - self.outbox.awaiting)
                    self._carry_out(plan, replayed, doing)
                    self._stash.extend(replayed.items())
                continue
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            in_flight = set() if self.step_path is None else set(self.step_path.in_flight_workers())
            with self._woken_by(in_flight):
                if self._take_shared(in_flight):
                    continue  # the words of a worker on the shared step path said it answered
                received = self._next_reply(
                    doing, LIVENESS_POLL_S if remaining is None else min(LIVENESS_POLL_S, remaining)
                )
            if received is not None:
                self._taken(*received)
                return received
            if deadline is not None and time.monotonic() >= deadline and not self._stash:
                return None

    # -- the one receive loop ---------------------------------------------------------------
    def _await(
        self,
        worker_ids: set[int],
        replies: dict[int, Message],
        doing: str,
        timeout: float | None,
        on_request: Callable[[int, Message], bool] | None = None,
        errors_close: bool = True,
        started: float | None = None,
    ) -> set[int]:
        """Wait for one reply from each of ``worker_ids`` into ``replies``; the workers among them found lost.

        ``timeout`` counts from ``started`` (``time.monotonic()``; default: now).

        Replies of other workers to the current call are stashed for :meth:`receive`. A loss
        raises at once where :meth:`Recovery.raises_at_once` says so; otherwise the worker is
        marked failed and returned, for the caller's recovery plan.
        """
        lost = worker_ids & self._failed  # e.g. a send that found its pipe closed
        pending = worker_ids - lost
        deadline = None if timeout is None else (time.monotonic() if started is None else started) + timeout
        while pending:
            # Checked before every receive, not only when idle, so that stray messages cannot postpone it.
            if deadline is not None and time.monotonic() > deadline:
                raise self._fatal(
                    WorkerTimeoutError(
                        f"Workers {sorted(pending)} did not reply within {timeout} s while {doing}. Their envs are "
                        "now in an unknown state, so the ClusterEnv was closed. Raise `timeout` if the "
                        "environments are this slow."
                    )
                )
            with self._woken_by(pending):
                if self._take_shared(pending, replies):
                    continue  # the words of a worker on the shared step path said it answered
                received = self._next_reply(doing, LIVENESS_POLL_S, errors_close)
            if received is None:
                found = self._check_alive(pending, doing)
                pending -= found
                lost |= found
                continue
            worker_id, msg = received
            if on_request is not None and worker_id in pending and on_request(worker_id, msg):
                continue
            if worker_id in pending:
                self._take(worker_id, msg, replies, pending)
            else:
                self._stash.append(received)  # a streaming call's reply, for receive()
                self._taken(worker_id, msg)
        return lost

    def _take(self, worker_id: int, msg: Message, replies: dict[int, Message], pending: set[int]) -> None:
        """Take ``msg`` as worker ``worker_id``'s reply: kept in ``replies`` before anything else forgets it."""
        replies[worker_id] = msg
        pending.discard(worker_id)
        self._taken(worker_id, msg)

    def _taken(self, worker_id: int, msg: Message) -> None:
        """A reply is kept by its caller: the step path's record of it can go, its latency and usage are noted."""
        if self.step_path is not None:
            self.step_path.taken(worker_id, msg)
        self._note_reply(worker_id, msg)

    def _take_shared(self, pending: set[int], replies: dict[int, Message] | None = None) -> bool:
        """Take the replies that the words of ``pending`` workers on the shared step path show; whether any.

        Into ``replies``; ``None``: onto the stash, for :meth:`receive`.
        """
        path = self.step_path
        if path is None:
            return False
        took = False
        for worker_id in sorted(w for w in pending if path.in_flight(w)):
            msg = self._shared_reply(worker_id, WAKE_UP)
            if msg is None:
                continue
            if msg.meta["seq"] != self.seq:  # a step of a call given up earlier: over, and nobody's reply
                path.taken(worker_id, msg)
                continue
            if replies is None:
                self._stash.append((worker_id, msg))
                self._taken(worker_id, msg)
            else:
                self._take(worker_id, msg, replies, pending)
            took = True
        return took

    @contextlib.contextmanager
    def _woken_by(self, worker_ids: Iterable[int]) -> Iterator[None]:
        """While the learner blocks: the workers of ``worker_ids`` on the shared step path wake it when they answer."""
        path = self.step_path
        asked = [] if path is None else path.ask_wake_ups(worker_ids)
        try:
            yield
        finally:
            if asked:
                assert path is not None
                path.stop_wake_ups(asked)

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
            if (
                worker_id is None
                and msg.kind is Kind.HELLO
                and self.members.keep_early_hello(received, _MAX_EARLY_HELLOS)
            ):
                continue
            if worker_id is not None and (msg.kind is Kind.WAKE_UP or "step" in msg.meta):
                shared = self._shared_reply(worker_id, msg)
                if shared is None:
                    continue  # a wake-up whose worker has no reply in the region (yet, or its message is it)
                msg = shared
            if worker_id is None or msg.meta.get("seq") != self.seq:
                continue  # a reply to a call that timed out earlier, or a stray peer
            if msg.kind is Kind.ERROR:
                error = remote_error(worker_id, msg, doing, self.loads)
                # The env's state is unknown after its error, so the workers are closed (unless the caller says not).
                raise self._fatal(error, terminate=False) if errors_close else error
            return worker_id, msg
        return None

    def _note_reply(self, worker_id: int, msg: Message) -> None:
        """What a reply to the current call tells: its latency, the worker's usage report; it is no longer awaited."""
        if (latency := self.outbox.replied(worker_id)) is not None:
            self._latencies[worker_id].append(latency)
        if "usage" in msg.meta and (usage := usage_report(msg.meta["usage"])) is not None:
            self._usage[worker_id] = usage

    def _await_shared(self, pending: set[int], replies: dict[int, Message]) -> None:
        """Take the replies of ``pending`` workers on the shared step path by waiting on their words alone.

        The shared step path's receive: every step there ends with the worker's reply words, so
        reading them (spinning, then a blocking read of its wake socket) is the whole wait.
        Replies that are messages, a worker not on the path, nothing within
        ``WAKE_READ_TIMEOUT_S``: :meth:`_await` goes on from there. Once every ``LIVENESS_POLL_S``
        it leaves the whole call to :meth:`_await`, which also reads the socket (joins, remote
        workers' messages) and checks liveness.
        """
        path = self.step_path
        assert path is not None
        if self._unread or time.monotonic() >= self._socket_due:
            self._socket_due = time.monotonic() + LIVENESS_POLL_S
            return
        for worker_id in sorted(pending):
            if not path.in_flight(worker_id):
                return
            try:
                msg = path.await_reply(worker_id, WAKE_READ_TIMEOUT_S)
            except ProtocolError as exc:  # words no worker of ours writes
                raise self._fatal(exc) from None
            if msg is NOT_YET or msg is None or msg.meta["seq"] != self.seq:
                return  # _await takes it from here (and forgets a step of an earlier call)
            self._take(worker_id, msg, replies, pending)

    def _shared_reply(self, worker_id: int, msg: Message) -> Message | None:
        """The RESULT a shared step path reply stands for (``None``: a message follows); fatal if it answers nothing."""
        path = self.step_path
        try:
            if path is None or worker_id not in path.on_path:
                raise ProtocolError(f"Worker {worker_id} sent a shared-memory step reply, but it is not on that path.")
            return path.woken(worker_id) if msg.kind is Kind.WAKE_UP else path.completed(worker_id, msg)
        except ProtocolError as exc:
            raise self._fatal(exc) from None

    def _check_alive(self, worker_ids: set[int], doing: str) -> set[int]:
        """Workers among ``worker_ids`` whose process is lost: raised, or returned and marked failed (restart)."""
        lost = self.recovery.lost_among(worker_ids)
        for w in sorted(lost):
            if self.recovery.raises_at_once(w, self.outbox.last_sent.get(w)):
                raise self._fatal(self.recovery.lost_error(w, doing))
        rehome = self.recovery.on_worker_failure == "rehome"
        action = "moving its envs to the other workers" if rehome else "replacing it"
        for w in sorted(lost):
            logger.warning("%s was lost while %s; %s.", self.launcher.describe(self.members.serving[w]), doing, action)
        self._failed |= lost
        return lost

    def _fatal(self, error: ClusterEnvError, terminate: bool = True) -> ClusterEnvError:
        """``error``, once the workers it leaves unusable are closed (``terminate``: killed, not waited for)."""
        self.on_fatal(terminate)
        return error

    # -- recovery: carrying out the plan ------------------------------------------------------
    def on_restart(self, hook: RestartHook) -> None:
        """Call ``hook(worker_id)`` once a worker's envs are rebuilt elsewhere, before its pending command is recovered.

        The hook returns the :class:`~clusterenv.learner.commands.FollowUp` messages the
        new process needs (a policy runner's weights), which the pool sends, in order.
        """
        self._restart_hooks.append(hook)

    def replace(self, worker_id: int, why: str) -> None:
        """A new process for a healthy worker whose envs are not in flight (recycling), as a restart starts one."""
        logger.info("Worker %d: %s.", worker_id, why)
        self._carry_out([Step(worker_id, Action.RESTART, None)], {}, why)

    def _carry_out(self, plan: list[Step], replies: dict[int, Message], doing: str) -> None:
        """Follow a recovery plan: put each lost worker's envs on a new host, then recover its pending command.

        A worker lost again on the way (its replacement, or its new host) becomes one more step
        of the plan, :meth:`Recovery.lost_again`. Replies of replayed commands go into ``replies``.
        """
        steps = collections.deque(plan)
        while steps:
            step = steps.popleft()
            worker_id = step.worker_id
            if step.action is Action.RAISE:
                raise self._fatal(self.recovery.lost_error(worker_id, doing, step.why))
            self._move_lost(step, doing)
            if self._rebuild(worker_id, f"rebuilding the envs of worker {worker_id}"):
                steps.appendleft(self.recovery.lost_again(step))
                continue
            pending = step.pending
            if pending is None:
                continue  # it had answered: the restart hooks decided what its envs' loss means
            if pending.on_loss is OnLoss.INTERRUPT:
                self.cuts.record(worker_id, Cut.REHOMED if step.action is Action.REHOME else Cut.RESTARTED)
            elif pending.on_loss is OnLoss.REPLAY:
                self.send(worker_id, pending.kind, pending.meta, pending.arrays, pending.blobs, pending.on_loss)
                if self._await({worker_id}, replies, doing, self.start_timeout):
                    steps.appendleft(self.recovery.lost_again(step))

    def _move_lost(self, step: Step, doing: str) -> None:
        """Give a lost worker a new host: a new process (restart) or the least loaded survivor (rehome)."""
        worker_id = step.worker_id
        if step.action is Action.RESTART:
            logger.warning(
                "Starting a replacement for worker %d (%s).", worker_id, self.recovery.describe_work(worker_id)
            )
            try:
                self.members.restart(worker_id, self.address, self.key, self.start_timeout, self.seq)
            except WorkerStartError as exc:  # the replacement exited, or never joined
                why = f"{LOST_AGAIN} ({exc})"
                raise self._fatal(self.recovery.lost_error(worker_id, doing, why)) from exc
        else:
            too_few = self.recovery.rehome(worker_id)
            if too_few:
                raise self._fatal(self.recovery.lost_error(worker_id, doing, too_few))

    def _rebuild(self, worker_id: int, doing: str) -> set[int]:
        """Build worker ``worker_id``'s envs where it is served now, send its hooks' follow-ups; the workers lost."""
        self._failed.discard(worker_id)  # its new host: a send that failed to the old one says nothing of it
        self._send_init(worker_id, replacement=True)
        lost = self._await({worker_id}, {}, doing, self.start_timeout)
        # The step path's first: what the others send may step the rebuilt envs.
        hooks = ([] if self.step_path is None else [self.step_path.restart_hook]) + self._restart_hooks
        for hook in hooks:
            for follow_up in (hook(worker_id) or ()) if not lost else ():
                self.send(worker_id, *follow_up[:4], on_loss=follow_up.on_loss)
                if follow_up.awaited is not None:
                    replies: dict[int, Message] = {}
                    lost = self._await({worker_id}, replies, follow_up.awaited, follow_up.timeout)
                    if lost:
                        break
                    if follow_up.on_reply is not None:
                        follow_up.on_reply(replies[worker_id])
        return lost or ({worker_id} & self._failed)  # a follow-up whose send found the new host gone

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
        self.seq += 1
        close_workers(
            self._channel, self.members, self._monitor, self.launcher, self.step_path, self.seq, grace, terminate
        )
        self.step_path = None  # closed there; with it go the pool's views of the region (and replies kept)
        self._replies, self._stash = {}, []
        self._finalizer()


def weak_callback(method: Callable[..., _R]) -> Callable[..., _R | None]:
    """Call the bound ``method`` while its object lives, else return ``None``: hooks must not keep their owner alive."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> _R | None:
        bound = ref()
        return None if bound is None else bound(*args)

    return call
