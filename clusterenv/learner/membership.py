"""Membership: which worker processes joined, which process serves which worker, and moving workers' envs.

A part of :class:`~clusterenv.learner.pool.WorkerPool` (see :mod:`clusterenv.learner.pool_state`).
A *worker* (ids ``0 .. num_workers - 1``, one slice of envs each) is served by its own
process, or under ``on_worker_failure="rehome"`` by another one (:attr:`PoolState.serving`):
the envs of a lost worker, of one that never joined (``min_workers``), or moved by
:meth:`Membership.rebalance` to even the load once processes join mid-run.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import zmq

from clusterenv.errors import WorkerStartError
from clusterenv.launch.launchers import LocalLauncher
from clusterenv.learner.pool_state import LIVENESS_POLL_S, OnLoss, PoolState
from clusterenv.wire.messages import EnvsMeta, HelloMeta, InitMeta, UsageReport, meta_of
from clusterenv.wire.processes import resource_usage
from clusterenv.wire.protocol import Kind, Message

__all__ = ["Membership"]

logger = logging.getLogger(__name__)


class Membership(PoolState):
    """Joining (at the start and mid-run), the worker-to-process map, rebalancing, and what ``worker_info`` shows."""

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
                # A streaming call goes on while one worker is replaced: its replies (and errors) are read
                # after the join, by the pool's one receive step.
                self._unread.append(received)
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
                    "env_step_ms": _env_step_times([self._usage[w] for w in serves if w in self._usage]),
                    **self._resources(process),
                }
            )
        return described

    def _resources(self, process: int) -> dict[str, float | None]:
        """CPU seconds and resident MB of a worker process with its env processes.

        Read now from ``/proc`` for a process this learner started, else as the process last reported
        them (``None`` before its first report, or where it has no ``/proc``).
        """
        pid = self.local_pids().get(process)
        usage = None if pid is None else resource_usage(pid)
        if usage is not None:
            return {"cpu_s": usage.cpu_s, "rss_mb": usage.rss_mb}
        report = self._usage.get(process)
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
        pids = {process: info.get("pid") for process, info in self._info.items() if process not in self._retired}
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


def _percentiles(latencies: Iterable[float] | None) -> dict[str, float] | None:
    """The median, 95th percentile and maximum of a worker's recent reply latencies, in milliseconds."""
    if not latencies:
        return None
    values = np.fromiter(latencies, dtype=np.float64) * 1000.0
    p50, p95 = np.percentile(values, [50, 95]).tolist()
    return {"p50": p50, "p95": p95, "max": float(values.max()), "replies": len(values)}
