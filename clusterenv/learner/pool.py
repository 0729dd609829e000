"""``WorkerPool``: the learner's side of its worker processes.

The pool carries commands and replies; it knows nothing of environments. It owns the
ROUTER channel, the heartbeat monitor, the launcher, which routing id is which worker,
the per-call sequence number (a reply counts only if it answers the current call), and
the translation of remote errors, timeouts and lost workers into exceptions.
:class:`~clusterenv.learner.vector_env.ClusterEnv` builds the commands and reads the replies.

Restarts (``on_worker_failure="restart"``) have one path, :meth:`WorkerPool._recover`.
When a worker is lost (its process exited, or its heartbeat connection dropped), a
:meth:`~WorkerPool.gather` first collects every other worker's reply, so no other env's
data is lost or duplicated (:meth:`~WorkerPool.receive`, for streaming calls, recovers at
once). Then, for each lost worker, the pool ends the old process if it can, starts a
replacement through the launcher, waits for it to join, replays its INIT (the same env
factories, flagged ``replacement``), runs the restart hooks (a policy runner re-installs
its policy there), and does what the issuer of the lost worker's pending command declared
when it sent it (:class:`OnLoss`): replay it, report it interrupted, leave its re-issue to
the hooks, or raise ``WorkerLostError``. A replacement that fails in turn raises:
restarts do not loop.

Re-homing (``on_worker_failure="rehome"``) takes the same path with no new process: each
lost worker's envs are rebuilt, from the same INIT, in the surviving process that carries
the fewest envs. A *worker* (ids ``0 .. num_workers - 1``, one slice of envs each) is then
served by a *process* other than its own: the pool maps each worker to the process that
serves it (:attr:`WorkerPool.serving`), and messages for a moved worker name it (meta
``slot``) so that its host hands them to the right envs. Liveness is the process's.
"""

from __future__ import annotations

import collections
import enum
import itertools
import logging
import secrets
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import zmq

from clusterenv.errors import (
    RemoteEnvError,
    WorkerLostError,
    WorkerStartError,
    WorkerTimeoutError,
    builtin_exception_type,
    remote_error_type,
)
from clusterenv.launch.launchers import Launcher, LocalLauncher, resolve_launcher
from clusterenv.learner.heartbeat_monitor import HeartbeatMonitor
from clusterenv.wire.cleanup import remove_stale_dirs
from clusterenv.wire.liveness import Heartbeat, heartbeat_address
from clusterenv.wire.messages import EnvsMeta, ErrorMeta, HelloMeta, InitMeta, meta_of
from clusterenv.wire.protocol import Kind, Message
from clusterenv.wire.safe_pickle import loader
from clusterenv.wire.transport import Channel, Curve, is_loopback, resolve_secret

__all__ = ["Command", "OnLoss", "WorkerPool", "weak_callback"]

logger = logging.getLogger(__name__)

# While waiting for replies, wake this often to notice a worker process that died.
LIVENESS_POLL_S = 0.05
# HELLOs kept while busy, for external replacement workers; the peers are authenticated, the bound is a safeguard.
_MAX_EARLY_HELLOS = 64
# Messages dropped (strays, replies to earlier calls) in one receive step before the caller checks its deadline.
_MAX_DROPS_PER_WAIT = 64
# How long a worker whose connection dropped may take to report its exit status (it lingers up to 0.5 s).
_EXIT_STATUS_WAIT_S = 1.0
# Lets a CLOSE queued for a connected worker leave before the socket goes; peers that are gone hold nothing up.
_CLOSE_LINGER_MS = 500
#: How many of each worker's recent replies ``worker_info``'s latency percentiles cover.
LATENCY_WINDOW = 256
#: One worker's command: ``(meta, arrays, blobs)``.
Command = tuple[Mapping[str, Any] | None, Sequence[np.ndarray], Sequence[bytes]]


class OnLoss(enum.Enum):
    """What a command still unanswered by a lost worker means for its replacement; declared by its sender."""

    #: Send it again: on the fresh envs it does what was asked (a seeded reset returns the
    #: same observations, an attribute read the same value, a lockstep rollout a fresh one).
    REPLAY = "replay"
    #: The envs' episodes were cut: the worker joins :meth:`WorkerPool.take_interrupted`, and
    #: the sender reports the cut (a lockstep step: truncated, flagged ``worker_restarted``).
    INTERRUPT = "interrupt"
    #: The sender's restart hook re-issues what it needs (first-ready steps, prefetched rollouts).
    REISSUE = "reissue"
    #: Nothing can stand in for it (building the envs, installing a policy): ``WorkerLostError``.
    RAISE = "raise"


class _Sent(NamedTuple):
    """A worker's latest command, kept to replay it to a replacement (a tuple: one is made per worker and step)."""

    kind: Kind
    meta: Mapping[str, Any] | None
    arrays: Sequence[np.ndarray]
    blobs: Sequence[bytes]
    on_loss: OnLoss


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
        if encrypt:
            if not hasattr(self.launcher, "encrypt"):
                raise ValueError(
                    f"`encrypt=True` needs a launcher with an `encrypt` attribute, to start its workers with "
                    f"encryption; {type(self.launcher).__name__} has none."
                )
            self.launcher.encrypt = True
        key = key or secrets.token_hex(32).encode()
        curve = Curve.from_secret(key) if encrypt else None
        self._context = zmq.Context()
        self._channel = Channel.bind_router(self._context, bind, key, curve=curve, compression=compression)
        self.address = self._channel.endpoint
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
        self._last_sent: dict[int, _Sent] = {}
        self._sent_at: dict[int, float] = {}  # when each worker was last sent a command
        # Seconds from that command to the reply, per worker.
        self._latencies: collections.defaultdict[int, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=LATENCY_WINDOW)
        )
        self._restart_hooks: list[Callable[[int], None]] = []
        self._interrupted: set[int] = set()
        self._awaiting: set[int] = set()  # workers whose latest command has had no reply yet
        self._failed: set[int] = set()
        self._early_hellos: list[tuple[bytes | None, Message]] = []
        # Replies of the current call that arrived while a gather waited for others (streaming calls).
        self._stash: list[tuple[int, Message]] = []
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

    # -- joining ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start every worker through the launcher and wait for each to join.

        Under ``"rehome"`` the run may start with fewer processes: if at least
        ``min_workers`` joined within ``start_timeout``, the missing workers' envs go to
        them (least loaded first), and processes that connect later join through
        :meth:`rebalance`.
        """
        ids = list(range(self.num_workers))
        self.launcher.start(ids, self.address, self.key)
        elastic = self.on_worker_failure == "rehome"
        missing = self._join(ids, self.start_timeout, at_least=self.min_workers if elastic else None)
        for w in missing:
            target = self._least_loaded(list(self._peers.values()))
            self.serving[w], self._identities[w] = target, self._identities[target]

    def _join(self, worker_ids: list[int], timeout: float, at_least: int | None = None) -> list[int]:
        """Wait for a HELLO for each id; a worker asking for no id (``clusterenv-worker`` by hand) gets a free one.

        Unauthenticated peers never get here (the channel drops them); authenticated ones
        asking for an id that is taken or not expected are told to CLOSE. With ``at_least``,
        a timeout with that many joined returns the ids still missing instead of raising.
        """
        wanted = set(worker_ids)
        deadline = time.monotonic() + timeout
        while wanted:
            for w in sorted(wanted):
                code = self.launcher.exit_code(w)
                if code is not None:
                    raise WorkerStartError(
                        f"{self.launcher.describe(w)} exited with code {code} before joining {self.address}."
                    )
            if time.monotonic() > deadline:
                if at_least is not None and len(worker_ids) - len(wanted) >= at_least:
                    logger.warning(
                        "Starting with %d of %d worker processes; the envs of workers %s go to them until more join.",
                        len(worker_ids) - len(wanted),
                        len(worker_ids),
                        sorted(wanted),
                    )
                    return sorted(wanted)
                hint = getattr(self.launcher, "join_hint", None)
                raise WorkerStartError(
                    f"{len(worker_ids) - len(wanted)} of {len(worker_ids)} workers joined {self.address} within "
                    f"start_timeout={timeout} s; worker ids {sorted(wanted)} are missing."
                    + (f" {hint(self.address)}" if hint is not None else "")
                )
            received = self._early_hellos.pop(0) if self._early_hellos else None
            received = received or self._channel.recv(LIVENESS_POLL_S, routed=True)
            if received is None:
                continue
            sender, msg = received
            if sender in self._peers and msg.meta.get("seq") == self.seq and msg.kind is not Kind.HELLO:
                worker = self._worker_of(sender, msg)
                if worker is not None:  # a streaming call goes on while one worker is replaced
                    self._stash.append((worker, msg))
                continue
            if msg.kind is not Kind.HELLO or sender is None or sender in self._peers:
                logger.warning("Ignored %s from peer %r while waiting for workers to join.", msg.kind.name, sender)
                continue
            hello = meta_of(msg, HelloMeta)
            asked = hello["worker_id"]
            if asked in wanted or asked is None:
                worker_id = min(wanted) if asked is None else int(asked)
            else:
                logger.warning(
                    "Turned away a worker on %s (pid %s) asking for id %r: expected ids %s.",
                    hello["host"],
                    hello["pid"],
                    asked,
                    sorted(wanted),
                )
                try:
                    self._channel.send(Kind.CLOSE, {"seq": self.seq}, to=sender)
                except zmq.ZMQError:
                    pass
                continue
            wanted.discard(worker_id)
            self._identities[worker_id], self._peers[sender] = sender, worker_id
            self.serving[worker_id] = worker_id
            self._info[worker_id] = msg.meta
        return []

    # -- joining mid-run (rehome) -------------------------------------------------------------
    def rebalance(self, wait: float) -> list[int]:
        """Admit the worker processes that connected since, then move workers' envs to even the load; the moved workers.

        A process that joins asking for the id of a worker whose envs another process
        carries gets them back first. Then, while moving one worker from the most loaded
        process to the least loaded one lowers the larger of the two loads, it is moved
        (a process's own worker stays). A moved worker's envs are closed where they were
        and rebuilt, from the same INIT, in their new process, whose restart hooks run.

        Args:
            wait: if no process has connected yet, wait up to this many seconds for one.
        """
        self._admit(wait)
        live = self._live_processes()
        moves = [(p, p) for p in sorted(live) if p in self.serving and self.serving[p] != p]  # coming home
        moved = []
        for worker_id, target in moves:
            self._move(worker_id, target)
            moved.append(worker_id)
        while True:
            load = self._loads(live)
            heaviest = max(live, key=lambda p: (load[p], -p))
            lightest = self._least_loaded(live)
            guests = [w for w, p in self.serving.items() if p == heaviest and w != heaviest]
            if not guests:
                break
            worker_id = min(guests, key=lambda w: (self._env_counts[w], w))
            if load[lightest] + self._env_counts[worker_id] >= load[heaviest]:
                break  # moving it would not lower the larger load
            self._move(worker_id, lightest)
            moved.append(worker_id)
        return moved

    def _admit(self, wait: float) -> None:
        """Take the HELLOs of processes that connected (kept while busy, or arriving within ``wait`` s if none has)."""
        deadline = time.monotonic() + wait
        admitted = 0
        while True:
            received: tuple[bytes | None, Message] | None
            if self._early_hellos:
                received = self._early_hellos.pop(0)
            else:
                # Once one joined, only what else is already there (or completing its handshake).
                remaining = LIVENESS_POLL_S if admitted else max(0.0, deadline - time.monotonic())
                received = self._channel.recv(min(remaining, LIVENESS_POLL_S), routed=True)
                if received is None:
                    if admitted or time.monotonic() >= deadline:
                        return
                    continue
            sender, msg = received
            if msg.kind is not Kind.HELLO or sender is None or sender in self._peers:
                continue  # a late reply to an earlier call, or a stray
            hello = meta_of(msg, HelloMeta)
            live = set(self._peers.values())
            asked = hello["worker_id"]
            if asked is not None and (asked in live or asked < 0):
                logger.warning(
                    "Turned away a worker on %s (pid %s) asking for id %r: a live worker has it.",
                    hello["host"],
                    hello["pid"],
                    asked,
                )
                try:
                    self._channel.send(Kind.CLOSE, {"seq": self.seq}, to=sender)
                except zmq.ZMQError:
                    pass
                continue
            # Without an id, a new one past the workers': never one that a worker's own host may ask for later.
            # Also instead of a lost process's id while some of its workers have not been moved yet.
            fresh = next(i for i in itertools.count(self.num_workers) if i not in self._info)
            unmoved = asked is not None and asked in self._retired and asked in self.serving.values()
            process = int(asked) if asked is not None and not unmoved else fresh
            self._peers[sender] = process
            self._info[process] = msg.meta
            self._retired.pop(process, None)  # a lost worker's id, asked for again (say, by SLURM_PROCID)
            self._watched.discard(process)
            admitted += 1
            logger.info("Worker process %d (%s, pid %s) joined.", process, hello["host"], hello["pid"])

    def _move(self, worker_id: int, target: int) -> None:
        """Close worker ``worker_id``'s envs where they are and rebuild them, from its INIT, in process ``target``."""
        logger.info(
            "Moving worker %d's envs (%s) to worker process %d.", worker_id, self.describe_work(worker_id), target
        )
        # A CLOSE naming a worker the process serves for another: it closes those envs and stays.
        self.send(worker_id, Kind.CLOSE)
        self._rebuild_in(worker_id, target)
        for hook in self._restart_hooks:
            hook(worker_id)

    def _rebuild_in(self, worker_id: int, target: int) -> None:
        """Worker ``worker_id``'s envs built anew, from its INIT, in process ``target``, which serves it from now on."""
        self.serving[worker_id] = target
        self._identities[worker_id] = next(i for i, p in self._peers.items() if p == target)
        self._failed.discard(worker_id)
        self._send_init(worker_id, replacement=True)
        self.gather([worker_id], f"rebuilding the envs of worker {worker_id} in worker {target}", self.start_timeout)

    def _live_processes(self) -> list[int]:
        """The worker processes that have joined and are not lost."""
        processes = set(self._peers.values())
        return sorted(processes - self._gone(processes))

    def _loads(self, processes: Iterable[int]) -> collections.Counter[int]:
        """How many envs each of ``processes`` steps."""
        load = collections.Counter(dict.fromkeys(processes, 0))
        for w, p in self.serving.items():
            if p in load:
                load[p] += self._env_counts[w]
        return load

    def _least_loaded(self, processes: list[int]) -> int:
        """The process among ``processes`` that steps the fewest envs (the lowest id among equals)."""
        load = self._loads(processes)
        return min(processes, key=lambda p: (load[p], p))

    def send_init(self, worker_id: int, meta: EnvsMeta, blobs: list[bytes]) -> None:
        """Send a worker its INIT (kept, to build a replacement the same way) and start watching its heartbeats."""
        self._init_commands[worker_id] = (meta, blobs)
        self._send_init(worker_id, replacement=False)

    def _send_init(self, worker_id: int, *, replacement: bool) -> None:
        meta, blobs = self._init_commands[worker_id]
        identity = self._identities[worker_id]
        process = self.serving[worker_id]
        if process not in self._watched:
            # The process starts beating on its first INIT, with the heartbeat keys agreed when it joined.
            self._monitor.watch(process, identity, self._channel.heartbeat_session(identity))
            self._watched.add(process)
        init = InitMeta(
            **meta,
            worker_id=worker_id,
            heartbeat=self.heartbeat.to_meta(),
            heartbeat_endpoint=self._monitor.endpoint,
            replacement=replacement,
        )
        self.send(worker_id, Kind.INIT, init, blobs=blobs, on_loss=OnLoss.RAISE)

    def host(self, worker_id: int) -> str | None:
        """The host name of the process serving worker ``worker_id``, as it reported when it joined."""
        return self._info[self.serving[worker_id]].get("host")

    @property
    def worker_info(self) -> list[dict[str, Any]]:
        """What :attr:`ClusterEnv.worker_info <clusterenv.ClusterEnv.worker_info>` shows, per worker process."""
        described = []
        for process, info in sorted(self._info.items()):
            serves = [] if process in self._retired else [w for w, p in self.serving.items() if p == process]
            latencies = [t for w in serves for t in self._latencies.get(w, ())]
            described.append(
                {
                    "worker_id": process,
                    "host": info.get("host"),
                    "pid": info.get("pid"),
                    "state": "lost" if process in self._retired else "active" if serves else "idle",
                    "serves": sorted(serves),
                    "lost_because": self._retired.get(process),
                    "silent_s": None if process in self._retired else self._monitor.silence(process),
                    "latency_ms": _percentiles(latencies),
                }
            )
        return described

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
        for (worker_id, frames), (meta, arrays, blobs) in zip(encoded, commands.values(), strict=True):
            if on_loss is not None:  # a command, not a message that serves one (weights, probe outputs)
                self._last_sent[worker_id] = _Sent(kind, meta, arrays, blobs, on_loss)
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
            received = self._channel.recv(wait, routed=True)
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
            self._awaiting.discard(worker_id)
            return worker_id, msg
        return None

    # -- restarts --------------------------------------------------------------------------
    def on_restart(self, hook: Callable[[int], None]) -> None:
        """Call ``hook(worker_id)`` once each replacement is built, before its pending command is recovered."""
        self._restart_hooks.append(hook)

    def take_interrupted(self) -> list[int]:
        """The workers whose :attr:`OnLoss.INTERRUPT` command a restart cut, since the last call (the sender reports them)."""
        interrupted, self._interrupted = sorted(self._interrupted), set()
        return interrupted

    # -- failures --------------------------------------------------------------------------
    def _how_lost(self, process: int) -> str:
        """Why a worker process is gone: its exit status, else what its heartbeat connection showed."""
        if process in self._retired:
            return self._retired[process]
        code = self.launcher.exit_code(process)
        # A worker that exits closes its connections first: give its exit status, the better cause, a moment.
        deadline = time.monotonic() + _EXIT_STATUS_WAIT_S
        while code is None and self._monitor.reason(process) is not None and time.monotonic() < deadline:
            time.sleep(0.02)
            code = self.launcher.exit_code(process)
        if code is not None:
            return f"exited with code {code}"
        return self._monitor.reason(process) or "is unreachable"

    def _lost(self, worker_id: int, doing: str, why: str = "") -> WorkerLostError:
        process = self.serving.get(worker_id, worker_id)
        where = self.launcher.describe(process)
        if process != worker_id:
            where += f" (serving worker {worker_id})"
        error = WorkerLostError(
            f"{where}, running {self.describe_work(worker_id)}, {self._how_lost(process)} while {doing}.{why}"
        )
        self.on_fatal(True)
        return error

    def _gone(self, processes: Iterable[int]) -> set[int]:
        """The processes among ``processes`` that are lost: retired, exited, or silent past the heartbeat window."""
        expired = self._monitor.expired()
        return {p for p in processes if p in self._retired or p in expired or self.launcher.exit_code(p) is not None}

    def _check_alive(self, worker_ids: set[int], doing: str) -> set[int]:
        """Workers among ``worker_ids`` whose process is lost: raised, or (restart, rehome) returned and marked failed."""
        gone = self._gone({self.serving[w] for w in worker_ids})
        lost = {w for w in worker_ids if self.serving[w] in gone}
        if lost and (self.on_worker_failure == "raise" or self._recovering):
            raise self._lost(min(lost), doing)
        action = "moving its envs to the other workers" if self.on_worker_failure == "rehome" else "replacing it"
        for w in sorted(lost):
            if not self._restartable(w):
                raise self._lost(w, doing)
            logger.warning("%s was lost while %s; %s.", self.launcher.describe(self.serving[w]), doing, action)
        self._failed |= lost
        return lost

    def _restartable(self, worker_id: int) -> bool:
        """Whether a replacement can take over: its envs were built once (a crash while building them would recur)."""
        last = self._last_sent.get(worker_id)
        return last is not None and last.kind is not Kind.INIT

    def _remote_error(self, worker_id: int, msg: Message, doing: str, close: bool = True) -> RemoteEnvError:
        """The ``RemoteEnvError`` (also of the original exception's type) for an ERROR reply.

        ``close``: the env's state is unknown after the error, so the workers are closed.
        """
        meta = meta_of(msg, ErrorMeta)
        cause: BaseException | None = None
        if msg.blobs:
            try:
                cause = self.loads(msg.blobs[0])
            except Exception as exc:
                logger.debug("Could not unpickle the remote exception: %s", exc)
        original = type(cause) if isinstance(cause, BaseException) else builtin_exception_type(meta["exc_type"])
        where = f"env {meta['env_index']}" if meta["env_index"] is not None else "an env"
        error = remote_error_type(original)(
            f"{where} on worker {worker_id} raised {meta['exc_type']} while {doing}: {meta['message']}\n\n"
            f"Remote traceback:\n{meta['traceback']}",
            env_index=meta["env_index"],
            worker_id=worker_id,
            exc_type=meta["exc_type"],
            remote_traceback=meta["traceback"],
        )
        if isinstance(cause, BaseException):
            error.__cause__ = cause
        if close:
            self.on_fatal(False)
        return error

    def _recover(
        self, lost: list[int], replies: dict[int, Message], doing: str, idle: frozenset[int] = frozenset()
    ) -> None:
        """The one recovery path: replace each lost worker, then do what its pending command's sender declared.

        ``idle``: workers among ``lost`` that had answered their last command (streaming calls
        notice losses of workers they are not waiting for): nothing is pending, so nothing is
        replayed or reported here; the restart hooks decide what their envs' loss means.
        """
        self._recovering = True
        try:
            for worker_id in lost:
                sent = self._last_sent[worker_id]
                if sent.on_loss is OnLoss.RAISE and worker_id not in idle:
                    raise self._lost(
                        worker_id, f"{doing} ({sent.kind.name} cannot be recovered on a replacement worker)"
                    )
                if self.on_worker_failure == "rehome":
                    self._rehome(worker_id, doing)
                else:
                    self._restart(worker_id)
                for hook in self._restart_hooks:
                    hook(worker_id)
                if worker_id in idle:
                    continue
                if sent.on_loss is OnLoss.INTERRUPT:
                    self._interrupted.add(worker_id)
                elif sent.on_loss is OnLoss.REPLAY:
                    self.send(worker_id, sent.kind, sent.meta, sent.arrays, sent.blobs, sent.on_loss)
                    replies[worker_id] = self.gather([worker_id], doing, self.start_timeout)[worker_id]
        finally:
            self._recovering = False

    def _restart(self, worker_id: int) -> None:
        """A replacement for ``worker_id``, joined, its envs rebuilt, and the restart hooks run."""
        logger.warning("Starting a replacement for worker %d (%s).", worker_id, self.describe_work(worker_id))
        self.launcher.kill(worker_id)
        self._monitor.forget(worker_id)
        self._watched.discard(worker_id)
        old = self._identities.pop(worker_id, None)
        self._peers.pop(old or b"", None)
        if old is not None:
            self._channel.forget(old)
        self.launcher.start([worker_id], self.address, self.key)
        self._join([worker_id], self.start_timeout)
        self._failed.discard(worker_id)
        self._send_init(worker_id, replacement=True)
        self.gather([worker_id], f"rebuilding the envs of worker {worker_id}", self.start_timeout)

    def _rehome(self, worker_id: int, doing: str) -> None:
        """Rebuild a lost worker's envs in the surviving process that carries the fewest envs."""
        process = self.serving[worker_id]
        if process not in self._retired:
            self._retire(process)
        survivors = self._live_processes()
        if len(survivors) < self.min_workers:
            raise self._lost(
                worker_id,
                doing,
                f" {len(survivors)} worker processes survive, fewer than min_workers={self.min_workers}.",
            )
        target = self._least_loaded(survivors)
        logger.warning(
            "Moving worker %d's envs (%s) to worker process %d (%s).",
            worker_id,
            self.describe_work(worker_id),
            target,
            self.launcher.describe(target),
        )
        self._rebuild_in(worker_id, target)

    def _retire(self, process: int) -> None:
        """Give up on a lost process for good: end it if possible, and accept nothing more from it."""
        self._retired[process] = self._how_lost(process)
        self.launcher.kill(process)
        self._monitor.forget(process)
        self._watched.discard(process)
        identity = next(i for i, p in self._peers.items() if p == process)
        del self._peers[identity]
        self._channel.forget(identity)

    # -- shutdown --------------------------------------------------------------------------
    def close_after_error(self, terminate: bool) -> None:
        """The default ``on_fatal``: close the pool (ClusterEnv replaces it with its own ``close``)."""
        self.close(terminate=terminate)

    def close(self, grace: float = 5.0, terminate: bool = False) -> None:
        """Ask workers to exit (after closing their envs); kill those that do not within ``grace`` seconds.

        ``grace`` bounds the whole wait: confirming CLOSE and then waiting for the processes
        to exit share it, so a worker that ignores CLOSE costs one grace period, not two.
        """
        if self.closed:
            return
        self.closed = True
        deadline = time.monotonic() + grace
        # Also on terminate: workers this process cannot kill (external, remote) must hear it.
        # Without blocking: a frozen worker's full queue must not hang close().
        self._channel.socket.setsockopt(zmq.SNDTIMEO, 0)
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
    monitor.close()
    channel.close(linger=_CLOSE_LINGER_MS)
    context.term()


def _percentiles(latencies: Iterable[float] | None) -> dict[str, float] | None:
    """The median, 95th percentile and maximum of a worker's recent reply latencies, in milliseconds."""
    if not latencies:
        return None
    values = np.fromiter(latencies, dtype=np.float64) * 1000.0
    p50, p95 = np.percentile(values, [50, 95]).tolist()
    return {"p50": p50, "p95": p95, "max": float(values.max()), "replies": len(values)}
