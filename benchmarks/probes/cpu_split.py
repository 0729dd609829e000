"""Where the CPU of a batch step goes, process by process and thread by thread.

On a machine with few cores every process competes for the same CPU: the envs, the
learner, each worker process's own Python and each process's ZeroMQ I/O thread. This
runs a workload for ``--seconds``, reads every thread's CPU time (user + system, in ns,
from ``/proc/<pid>/task/<tid>/schedstat``) before and after (Linux only), and reports it
per batch step (one step of every env), for:

* ``SyncVectorEnv`` in this process: the envs' own work (CPU-bound workloads);
* ``ClusterEnv``: the learner's main thread, its ZeroMQ I/O thread and its other threads
  (the heartbeat monitor), then the same for the workers;
* ``bare pyzmq`` (``SleepEnv`` cases): the same exchange with no clusterenv code, a
  msgpack header, the action and a keyed BLAKE2b MAC each way (``learner_cpu.py``'s floor),
  so that what any one-process-per-worker design pays per step on this machine shows.

From these, the CPU limit on ClusterEnv's speed-up over ``SyncVectorEnv``: cores x Sync's
CPU per batch step / ClusterEnv's. Backends alternate; medians of ``--repeats``.

    python benchmarks/probes/cpu_split.py                  # the three cells, ~4 minutes on 2 cores
    python benchmarks/probes/cpu_split.py --cases sleep16-quarter --seconds 3

Writes ``results/cpu_split.md`` and ``results/cpu_split.json``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import platform
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import gymnasium as gym
import numpy as np
import tyro
from tqdm import tqdm

# This folder, then benchmarks/ (support.bench_envs, support.report): the workers inherit the path.
sys.path[:0] = [str(folder) for folder in Path(__file__).resolve().parents[:2]]
from learner_cpu import _check, _frames, floor_worker, worker_router  # noqa: E402
from support.bench_envs import BurnEnv, NullEnv, SleepEnv, make_atari  # noqa: E402
from support.report import command_line, write_report  # noqa: E402

from clusterenv import ClusterEnv  # noqa: E402
from clusterenv.wire.processes import descendants  # noqa: E402

CORES = len(os.sched_getaffinity(0))
COLUMNS = (
    "learner main",
    "learner ZeroMQ I/O",
    "learner other",
    "workers main",
    "workers ZeroMQ I/O",
    "workers other",
)


@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    make: Callable[[], gym.Env]
    num_envs: int
    num_workers: int
    batch_size: int | None = None  # first-ready batches of this many envs; None: lockstep ``step``
    sync: bool = False  # also measure SyncVectorEnv (CPU-bound envs)
    sleep_ms: float = 0.0  # SleepEnv cases: the bare-pyzmq floor sleeps as long
    sigma: float = 0.0


CASES = {
    "pong16": Case(
        "ALE/Pong-v5 x16, 2 workers, lockstep", functools.partial(make_atari, "ALE/Pong-v5"), 16, 2, sync=True
    ),
    "burn16": Case(
        "BurnEnv (1 ms CPU) x16, 2 workers, lockstep", functools.partial(BurnEnv, step_cpu_ms=1.0), 16, 2, sync=True
    ),
    # The many-core cells (benchmarks/manycore.py): 64 envs on one worker per core.
    "burn64": Case(
        f"BurnEnv (1 ms CPU) x64, {CORES} workers, lockstep",
        functools.partial(BurnEnv, step_cpu_ms=1.0),
        64,
        CORES,
        sync=True,
    ),
    "burn64-quarter": Case(
        f"BurnEnv (1 ms CPU) x64, {CORES} workers, first-ready batches of 16",
        functools.partial(BurnEnv, step_cpu_ms=1.0),
        64,
        CORES,
        batch_size=16,
    ),
    "null64": Case(f"NullEnv x64, {CORES} workers, lockstep", NullEnv, 64, CORES),
    "pong64": Case(
        f"ALE/Pong-v5 x64, {CORES} workers, lockstep",
        functools.partial(make_atari, "ALE/Pong-v5"),
        64,
        CORES,
        sync=True,
    ),
    "sleep16-quarter": Case(
        "SleepEnv (5 ms, sigma 0.5) x16, 16 workers, first-ready batches of 4",
        functools.partial(SleepEnv, 5.0, 0.5),
        16,
        16,
        batch_size=4,
        sleep_ms=5.0,
        sigma=0.5,
    ),
}


@dataclasses.dataclass
class Args:
    cases: tuple[str, ...] = ("pong16", "burn16", "sleep16-quarter")
    """which cells: pong16, burn16, sleep16-quarter; on many cores burn64, burn64-quarter, null64, pong64"""
    seconds: float = 6.0
    """measured seconds per run, after a warm-up"""
    repeats: int = 3
    """runs per backend and case, alternated; medians are reported"""
    quick: bool = False
    """smoke run: 1 s, one repeat"""


# -- reading /proc ----------------------------------------------------------------------------
def _thread_cpu(pid: int) -> dict[tuple[int, int], tuple[str, float]]:
    """``{(pid, tid): (column, CPU seconds)}`` for every thread of process ``pid`` (``schedstat``: nanoseconds)."""
    owner = "learner" if pid == os.getpid() else "workers"
    threads = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                on_cpu_ns = int(f.read().split()[0])
        except FileNotFoundError:  # ended in between
            continue
        tid = int(task)
        kind = "main" if tid == pid else "ZeroMQ I/O" if name.startswith("ZMQbg/IO") else "other"
        threads[(pid, tid)] = (f"{owner} {kind}", on_cpu_ns * 1e-9)
    return threads


@contextmanager
def cpu_by_column() -> Iterator[dict[str, float]]:
    """CPU seconds per column used inside the ``with`` block, by this process and its descendants."""

    def snapshot() -> dict[tuple[int, int], tuple[str, float]]:
        threads: dict[tuple[int, int], tuple[str, float]] = {}
        for pid in [os.getpid(), *descendants(os.getpid())]:
            try:
                threads.update(_thread_cpu(pid))
            except FileNotFoundError:
                pass
        return threads

    used: dict[str, float] = {}
    before = snapshot()
    yield used
    after = snapshot()
    totals: collections.Counter[str] = collections.Counter()
    for key, (column, seconds) in after.items():
        totals[column] += seconds - before.get(key, (column, 0.0))[1]
    used.update(totals)


# -- the backends -----------------------------------------------------------------------------
def _timed_loop(step: Callable[[], int], num_envs: int, seconds: float) -> tuple[float, dict[str, float]]:
    """``(wall s per batch step, {column: CPU s per batch step})`` of ``step`` (returns env-steps done)."""
    with cpu_by_column() as used:
        env_steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            env_steps += step()
        elapsed = time.perf_counter() - start
    batches = env_steps / num_envs
    return elapsed / batches, {column: value / batches for column, value in used.items()}


def run_sync(case: Case, seconds: float) -> tuple[float, dict[str, float]]:
    envs = gym.vector.SyncVectorEnv([case.make] * case.num_envs)
    try:
        envs.reset(seed=0)
        actions = np.zeros(case.num_envs, np.int64)
        for _ in range(50):
            envs.step(actions)

        def step() -> int:
            envs.step(actions)
            return case.num_envs

        return _timed_loop(step, case.num_envs, seconds)
    finally:
        envs.close()


def run_clusterenv(case: Case, seconds: float) -> tuple[float, dict[str, float]]:
    with ClusterEnv([case.make] * case.num_envs, num_workers=case.num_workers) as envs:
        if case.batch_size is None:
            envs.reset(seed=0)
            actions = np.zeros(case.num_envs, np.int64)

            def step() -> int:
                envs.step(actions)
                return case.num_envs
        else:
            envs.batch_size = case.batch_size
            envs.async_reset(seed=0)

            def step() -> int:
                *_, env_ids = envs.recv()
                envs.send(np.zeros(len(env_ids), np.int64), env_ids)
                return len(env_ids)

        for _ in range(100):
            step()
        wall, used = _timed_loop(step, case.num_envs, seconds)
        # Send to reply, on the learner's clock, over each worker's last 256 replies: a lockstep step waits
        # for the slower worker.
        for name in ("p50", "p95"):
            used[f"reply {name}"] = statistics.median(w["latency_ms"][name] / 1000 for w in envs.worker_info)
        return wall, used


def run_floor(case: Case, seconds: float) -> tuple[float, dict[str, float]]:
    """The bare-pyzmq exchange: lockstep, or first-ready batches of ``case.batch_size`` replies."""
    key = secrets.token_bytes(32)
    workers = worker_router(case.num_workers, floor_worker, key, case.sleep_ms / 1000, case.sigma)
    with workers as (router, identities):
        obs = np.zeros((case.num_workers, 4), np.float32)
        index = {identity: i for i, identity in enumerate(identities)}
        action = np.zeros(1, np.int64)
        batch = case.batch_size or case.num_workers

        def send(to: list[bytes]) -> None:
            for identity in to:
                router.send_multipart([identity, *_frames(key, 3, [action])], copy=False)

        def step() -> int:
            ready = []
            for _ in range(batch):
                sender, *frames = router.recv_multipart(copy=False)
                obs[index[sender.bytes]] = _check(key, frames)[0][0]
                ready.append(sender.bytes)
            send(ready)
            return batch

        send(identities)
        for _ in range(100):
            step()
        return _timed_loop(step, case.num_workers, seconds)


BACKENDS = {"SyncVectorEnv": run_sync, "ClusterEnv": run_clusterenv, "bare pyzmq": run_floor}


def backends_of(case: Case) -> list[str]:
    return ["SyncVectorEnv"] * case.sync + ["ClusterEnv"] + ["bare pyzmq"] * (case.sleep_ms > 0)


# -- report -----------------------------------------------------------------------------------
def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}"


def table(cells: dict[str, dict[str, list[tuple[float, dict[str, float]]]]], args: Args) -> str:
    command = command_line(__file__)
    lines = [
        f"`{command}` — CPU time (user + system) of every thread per batch step (one step of every env), "
        f"read from /proc/.../schedstat; {args.seconds:g} s per run, median of {args.repeats} (backends alternated); "
        f"{CORES} cores, Python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        "| cell | backend | wall | " + " | ".join(COLUMNS) + " | all CPU | cores busy |",
        "|---|---|---:|" + "---:|" * (len(COLUMNS) + 2),
    ]
    limits = []
    for name, by_backend in cells.items():
        case = CASES[name]
        medians = {}
        for backend, runs in by_backend.items():
            wall = statistics.median(w for w, _ in runs)
            columns = {c: statistics.median(used.get(c, 0.0) for _, used in runs) for c in COLUMNS}
            total = statistics.median(sum(used.get(c, 0.0) for c in COLUMNS) for _, used in runs)
            replies = {q: statistics.median(used.get(f"reply {q}", 0.0) for _, used in runs) for q in ("p50", "p95")}
            medians[backend] = (wall, total, replies)
            parts = [_us(columns[c]) if columns[c] else "" for c in COLUMNS]
            lines.append(
                f"| {case.label} | {backend} | {_us(wall)} | " + " | ".join(parts) + f" | {_us(total)} | "
                f"{total / wall:.2f} |"
            )
        if "SyncVectorEnv" in medians:
            (sync_wall, sync_cpu, _), (ours_wall, ours_cpu, replies) = medians["SyncVectorEnv"], medians["ClusterEnv"]
            limits.append(
                f"- {case.label}: measured {sync_wall / ours_wall:.2f}x SyncVectorEnv; the CPU allows "
                f"{CORES} x {_us(sync_cpu)} / {_us(ours_cpu)} = {CORES * sync_cpu / ours_cpu:.2f}x. A worker's "
                f"reply took {_us(replies['p50'])} µs (median) and {_us(replies['p95'])} µs (95th percentile) "
                f"after its command, against a batch step of {_us(ours_wall)} µs."
            )
    return "\n".join([*lines, "", "All times in µs per batch step.", "", *limits]) + "\n"


def main(args: Args) -> None:
    if args.quick:
        args = dataclasses.replace(args, seconds=1.0, repeats=1)
    unknown = set(args.cases) - set(CASES)
    if unknown:
        raise SystemExit(f"Unknown cases {sorted(unknown)}; expected some of {sorted(CASES)}.")
    jobs = [(name, backend) for _ in range(args.repeats) for name in args.cases for backend in backends_of(CASES[name])]
    cells: dict[str, dict[str, list[tuple[float, dict[str, float]]]]] = {}
    for name, backend in tqdm(jobs, desc="cpu split"):
        result = BACKENDS[backend](CASES[name], args.seconds)
        cells.setdefault(name, {}).setdefault(backend, []).append(result)
    text = table(cells, args)
    write_report("cpu_split", text, {"args": dataclasses.asdict(args), "cells": cells})


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args)))
