"""Membership: which worker processes joined, which process serves which worker, and where envs should move.

A part the :class:`~clusterenv.learner.pool.WorkerPool` holds. A *worker* (ids
``0 .. num_workers - 1``, one slice of envs each) is served by its own process, or under
``on_worker_failure="rehome"`` by another one (:attr:`Membership.serving`): the envs of a lost
worker, of one that never joined (``min_workers``), or moved by
:meth:`~clusterenv.learner.pool.WorkerPool.rebalance` to even the load once processes join
mid-run. Membership reads HELLOs and decides; it sends nothing but the CLOSE that turns an
unexpected peer away. The pool sends the commands (INIT, the CLOSE of a moved worker).
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import zmq

from clusterenv.errors import WorkerStartError
from clusterenv.launch.launchers import Launcher, LocalLauncher
from clusterenv.learner.heartbeat_monitor import LIVENESS_POLL_S, HeartbeatMonitor
from clusterenv.wire.liveness import Heartbeat
from clusterenv.wire.messages import EnvsMeta, HelloMeta, InitMeta, UsageReport, meta_of
from clusterenv.wire.processes import resource_usage
from clusterenv.wire.protocol import Kind, Message
from clusterenv.wire.transport import Channel

__all__ = ["Membership", "Received"]

logger = logging.getLogger(__name__)

#: A message as the channel gives it: ``(routing id of its sender, message)``.
Received = tuple[bytes | None, Message]


class Membership:
    """Joining (at the start and mid-run), the worker-to-process map, liveness of processes, and ``worker_info``.

    Args:
        num_workers: how many workers (ids ``0 .. num_workers - 1``).
        env_counts: how many envs each worker steps (re-homing balances them).
        launcher: starts and ends worker processes.
        channel: the learner's channel, read here for HELLOs only.
        monitor: the learner's heartbeat monitor (a process is watched from its first INIT).
        heartbeat: the heartbeat constants sent to workers in their INIT.
        defer: takes a message from a joined worker that arrived while waiting for HELLOs;
            the pool reads it later, in its one receive step.
    """

    def __init__(
        self,
        num_workers: int,
        env_counts: list[int],
        *,
        launcher: Launcher,
        channel: Channel,
        monitor: HeartbeatMonitor,
        heartbeat: Heartbeat,
        defer: Callable[[Received], None],
    ) -> None:
        self.num_workers = num_workers
        self.env_counts = env_counts
        self.launcher = launcher
        self.heartbeat = heartbeat
        self._channel = channel
        self._monitor = monitor
        self._defer = defer
        #: Worker → the process serving it, named by the id it joined as (itself, unless re-homed).
        self.serving: dict[int, int] = {}
        #: Worker → the routing id of the process serving it.
        self.identities: dict[int, bytes] = {}
        #: Routing id → that process (its own worker id).
        self.peers: dict[bytes, int] = {}
        #: Processes lost for good (rehome), with how they were lost.
        self.retired: dict[int, str] = {}
        self._watched: set[int] = set()  # processes whose heartbeats the monitor watches (from their first INIT)
        self._info: dict[int, Mapping[str, Any]] = {}  # each process's HELLO
        self._init_commands: dict[int, tuple[EnvsMeta, list[bytes]]] = {}
        self._early_hellos: list[Received] = []

    # -- joining -------------------------------------------------------------------------------
    def start(self, address: str, key: bytes, timeout: float, seq: int, at_least: int | None) -> None:
        """Start every worker through the launcher and wait up to ``timeout`` s for each to join.

        With ``at_least`` (``"rehome"``), the run may start with fewer processes: if that many
        joined, the missing workers' envs go to them (least loaded first), and processes that
        connect later join through :meth:`admit`.
        """
        ids = list(range(self.num_workers))
        self.launcher.start(ids, address, key)
        missing = self.join(ids, address, timeout, seq, at_least=at_least)
        for w in missing:
            target = self.least_loaded(list(self.peers.values()))
            self.serving[w], self.identities[w] = target, self.identities[target]

    def join(
        self, worker_ids: list[int], address: str, timeout: float, seq: int, at_least: int | None = None
    ) -> list[int]:
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
                        f"{self.launcher.describe(w)} exited with code {code} before joining {address}."
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
                    f"{len(worker_ids) - len(wanted)} of {len(worker_ids)} workers joined {address} within "
                    f"start_timeout={timeout} s; worker ids {sorted(wanted)} are missing."
                    + (f" {hint(address)}" if hint is not None else "")
                )
            received = self._early_hellos.pop(0) if self._early_hellos else None
            received = received or self._channel.recv(LIVENESS_POLL_S, routed=True)
            if received is None:
                continue
            sender, msg = received
            # A reply of the shared step path, of any call: the pool's bookkeeping must see every one.
            current = msg.meta.get("seq") == seq or _shared_step_reply(msg)
            if sender in self.peers and current and msg.kind is not Kind.HELLO:
                self._defer(received)  # a streaming call goes on while one worker is replaced
                continue
            if msg.kind is not Kind.HELLO or sender is None or sender in self.peers:
                logger.warning("Ignored %s from peer %r while waiting for workers to join.", msg.kind.name, sender)
                continue
            hello = meta_of(msg, HelloMeta)
            asked = hello["worker_id"]
            if asked not in wanted and asked is not None:
                self._turn_away(sender, hello, seq, f"expected ids {sorted(wanted)}")
                continue
            worker_id = min(wanted) if asked is None else int(asked)
            wanted.discard(worker_id)
            self.identities[worker_id], self.peers[sender] = sender, worker_id
            self.serving[worker_id] = worker_id
            self._info[worker_id] = msg.meta
        return []

    def keep_early_hello(self, received: Received, limit: int) -> bool:
        """Keep a HELLO that arrived while the pool waited for replies (a replacement, or a process joining)."""
        if len(self._early_hellos) >= limit:
            return False
        self._early_hellos.append(received)
        return True

    def admit(self, wait: float, seq: int) -> None:
        """Take the HELLOs of processes that connected (kept while busy, or arriving within ``wait`` s if none has)."""
        deadline = time.monotonic() + wait
        admitted = 0
        while True:
            received: Received | None
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
            if sender in self.peers and _shared_step_reply(msg):
                self._defer(received)  # the pool's shared step bookkeeping must see every one
                continue
            if msg.kind is not Kind.HELLO or sender is None or sender in self.peers:
                continue  # a late reply to an earlier call, or a stray
            hello = meta_of(msg, HelloMeta)
            asked = hello["worker_id"]
            if asked is not None and (asked in set(self.peers.values()) or asked < 0):
                self._turn_away(sender, hello, seq, "a live worker has it")
                continue
            # Without an id, a new one past the workers': never one that a worker's own host may ask for later.
            # Also instead of a lost process's id while some of its workers have not been moved yet.
            fresh = next(i for i in itertools.count(self.num_workers) if i not in self._info)
            unmoved = asked is not None and asked in self.retired and asked in self.serving.values()
            process = int(asked) if asked is not None and not unmoved else fresh
            self.peers[sender] = process
            self._info[process] = msg.meta
            self.retired.pop(process, None)  # a lost worker's id, asked for again (say, by SLURM_PROCID)
            self._watched.discard(process)
            admitted += 1
            logger.info("Worker process %d (%s, pid %s) joined.", process, hello["host"], hello["pid"])

    def _turn_away(self, sender: bytes, hello: HelloMeta, seq: int, why: str) -> None:
        logger.warning(
            "Turned away a worker on %s (pid %s) asking for id %r: %s.",
            hello["host"],
            hello["pid"],
            hello["worker_id"],
            why,
        )
        try:
            self._channel.send(Kind.CLOSE, {"seq": seq}, to=sender)
        except zmq.ZMQError:
            pass

    # -- where envs go -------------------------------------------------------------------------
    def moves_to_balance(self) -> list[tuple[int, int]]:
        """The ``(worker, process)`` moves that even the load, in order: workers coming home first.

        Then, while moving one worker from the most loaded process to the least loaded one
        lowers the larger of the two loads, it is moved (a process's own worker stays).
        """
        live = self.live_processes()
        serving = dict(self.serving)
        moves = [(p, p) for p in sorted(live) if p in serving and serving[p] != p]  # coming home
        serving.update(moves)
        while True:
            load = self._loads(live, serving)
            heaviest = max(live, key=lambda p: (load[p], -p))
            lightest = min(live, key=lambda p: (load[p], p))
            guests = [w for w, p in serving.items() if p == heaviest and w != heaviest]
            if not guests:
                return moves
            worker_id = min(guests, key=lambda w: (self.env_counts[w], w))
            if load[lightest] + self.env_counts[worker_id] >= load[heaviest]:
                return moves  # moving it would not lower the larger load
            moves.append((worker_id, lightest))
            serving[worker_id] = lightest

    def assign(self, worker_id: int, process: int) -> None:
        """From now on, process ``process`` serves worker ``worker_id``."""
        self.serving[worker_id] = process
        self.identities[worker_id] = next(i for i, p in self.peers.items() if p == process)

    def least_loaded(self, processes: list[int]) -> int:
        """The process among ``processes`` that steps the fewest envs (the lowest id among equals)."""
        load = self._loads(processes, self.serving)
        return min(processes, key=lambda p: (load[p], p))

    def _loads(self, processes: Iterable[int], serving: Mapping[int, int]) -> collections.Counter[int]:
        """How many envs each of ``processes`` steps."""
        load = collections.Counter(dict.fromkeys(processes, 0))
        for w, p in serving.items():
            if p in load:
                load[p] += self.env_counts[w]
        return load

    # -- liveness of processes -----------------------------------------------------------------
    def gone(self, processes: Iterable[int]) -> set[int]:
        """The processes among ``processes`` that are lost: retired, exited, or silent past the heartbeat window."""
        expired = self._monitor.expired()
        return {p for p in processes if p in self.retired or p in expired or self.launcher.exit_code(p) is not None}

    def live_processes(self) -> list[int]:
        """The worker processes that have joined and are not lost."""
        processes = set(self.peers.values())
        return sorted(processes - self.gone(processes))

    def forget_process(self, process: int) -> None:
        """End a lost process if the launcher can, and accept nothing more from it."""
        self.launcher.kill(process)
        self._monitor.forget(process)
        self._watched.discard(process)
        identity = next((i for i, p in self.peers.items() if p == process), None)
        if identity is not None:
            del self.peers[identity]
            self._channel.forget(identity)

    def retire(self, process: int, how_lost: str) -> None:
        """Give up on a lost process for good (rehome): its workers' envs move to the others."""
        self.retired[process] = how_lost
        self.forget_process(process)

    def restart(self, worker_id: int, address: str, key: bytes, timeout: float, seq: int) -> None:
        """A new process for worker ``worker_id`` (the old one ended), joined; its envs are still to be built."""
        self.forget_process(worker_id)
        self.identities.pop(worker_id, None)
        self.launcher.start([worker_id], address, key)
        self.join([worker_id], address, timeout, seq)

    # -- INIT ----------------------------------------------------------------------------------
    def keep_init(self, worker_id: int, meta: EnvsMeta, blobs: list[bytes]) -> None:
        """Keep a worker's INIT, to build a replacement (or the worker's new host) the same way."""
        self._init_commands[worker_id] = (meta, blobs)

    def init_command(self, worker_id: int, *, replacement: bool) -> tuple[InitMeta, list[bytes]]:
        """The INIT that builds worker ``worker_id``'s envs where it is served; its process is watched from now on."""
        meta, blobs = self._init_commands[worker_id]
        process = self.serving[worker_id]
        if process not in self._watched:
            # The process starts beating on its first INIT, with the heartbeat keys agreed when it joined.
            identity = self.identities[worker_id]
            self._monitor.watch(process, identity, self._channel.heartbeat_session(identity))
            self._watched.add(process)
        init = InitMeta(
            **meta,
            worker_id=worker_id,
            heartbeat=self.heartbeat.to_meta(),
            heartbeat_endpoint=self._monitor.endpoint,
            replacement=replacement,
        )
        return init, blobs

    # -- what the user sees --------------------------------------------------------------------
    def host(self, worker_id: int) -> str | None:
        """The host name of the process serving worker ``worker_id``, as it reported when it joined."""
        return self._info[self.serving[worker_id]].get("host")

    def describe(
        self, latencies: Mapping[int, Iterable[float]], usage: Mapping[int, UsageReport]
    ) -> list[dict[str, Any]]:
        """What :attr:`ClusterEnv.worker_info <clusterenv.ClusterEnv.worker_info>` shows, per worker process.

        Args:
            latencies: each worker's recent reply latencies, in seconds.
            usage: each worker's last report of what its process uses.
        """
        described = []
        for process, info in sorted(self._info.items()):
            serves = [] if process in self.retired else [w for w, p in self.serving.items() if p == process]
            described.append(
                {
                    "worker_id": process,
                    "host": info.get("host"),
                    "pid": info.get("pid"),
                    "state": "lost" if process in self.retired else "active" if serves else "idle",
                    "serves": sorted(serves),
                    "lost_because": self.retired.get(process),
                    "silent_s": None if process in self.retired else self._monitor.silence(process),
                    "latency_ms": _percentiles([t for w in serves for t in latencies.get(w, ())]),
                    "env_step_ms": _env_step_times([usage[w] for w in serves if w in usage]),
                    **self._resources(process, usage),
                }
            )
        return described

    def _resources(self, process: int, usage: Mapping[int, UsageReport]) -> dict[str, float | None]:
        """CPU seconds and resident MB of a worker process with its env processes.

        Read now from ``/proc`` for a process this learner started, else as the process last reported
        them (``None`` before its first report, or where it has no ``/proc``).
        """
        pid = self.local_pids().get(process)
        measured = None if pid is None else resource_usage(pid)
        if measured is not None:
            return {"cpu_s": measured.cpu_s, "rss_mb": measured.rss_mb}
        report = usage.get(process)
        return {
            "cpu_s": None if report is None else report["cpu_s"],
            "rss_mb": None if report is None else report["rss_mb"],
        }

    @property
    def starts_local_workers(self) -> bool:
        """Whether the worker processes are this learner's children (``LocalLauncher``)."""
        return isinstance(self.launcher, LocalLauncher)

    def local_pids(self) -> dict[int, int]:
        """``{worker id: pid}`` of the live worker processes this learner started, as each joined."""
        launcher = self.launcher
        if not isinstance(launcher, LocalLauncher):
            return {}
        started = {p.pid for p in launcher.processes.values()}
        pids = {process: info.get("pid") for process, info in self._info.items() if process not in self.retired}
        return {process: pid for process, pid in pids.items() if isinstance(pid, int) and pid in started}

    def serves_only_itself(self, worker_id: int) -> bool:
        """Whether worker ``worker_id``'s envs are in its own process, and nobody else's are."""
        return self.serving.get(worker_id) == worker_id and list(self.serving.values()).count(worker_id) == 1


def _env_step_times(reports: list[UsageReport]) -> dict[str, float] | None:
    """A process's env step times from its workers' last reports (the slowest, if it serves several)."""
    times = [report["env_step_ms"] for report in reports if report["env_step_ms"] is not None]
    if not times:
        return None
    p50, p95, samples = max(times, key=lambda t: t[1])
    return {"p50": p50, "p95": p95, "samples": int(samples)}


def _percentiles(latencies: list[float]) -> dict[str, float] | None:
    """The median, 95th percentile and maximum of a worker's recent reply latencies, in milliseconds."""
    if not latencies:
        return None
    values = np.fromiter(latencies, dtype=np.float64) * 1000.0
    p50, p95 = np.percentile(values, [50, 95]).tolist()
    return {"p50": p50, "p95": p95, "max": float(values.max()), "replies": len(values)}


def _shared_step_reply(msg: Message) -> bool:
    """Whether ``msg`` is a reply of the shared step path: a wake-up, or a RESULT naming its step."""
    return msg.kind is Kind.WAKE_UP or (msg.kind is Kind.RESULT and "step" in msg.meta)
