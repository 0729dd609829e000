"""One host, many cores: SyncVectorEnv, AsyncVectorEnv and ClusterEnv (lockstep and first-ready) in one run.

Three workloads of ``--num-envs`` envs each: ``BurnEnv`` (1 ms of CPU per step), ALE Pong with
raw 210x160x3 frames, and ``NullEnv`` (a step that does nothing: transport and bookkeeping
only). Backends: ``SyncVectorEnv``, ``AsyncVectorEnv(shared_memory=True)``, ``ClusterEnv`` with
one worker per core (``--num-workers``) stepping in lockstep, and the same ``ClusterEnv`` in
first-ready mode, ``recv``/``send`` over batches of ``--first-ready-fraction`` of the envs.
Every backend gets the same seeded random actions; each run builds its backend, steps
``--warmup-steps`` untimed batches, then times ``--seconds``; backends alternate within each
of ``--repeats`` rounds and the medians are reported.

    python benchmarks/manycore.py            # 64 envs, 16 workers: ~5 minutes on 16 cores
    python benchmarks/manycore.py --quick    # 16 envs on 4 workers, 1 s runs: a smoke run on 2 cores

Writes ``results/manycore.md`` and ``results/manycore.json``, the latter in env-steps/s::

    {"cores": 16, "date": "...", "cells": {"burn1ms_x64": {"sync": .., "async": .., "clusterenv": ..,
     "clusterenv_first_ready": ..}, "pong_x64": {...}, "null_x64": {...}}}
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import tyro
from gymnasium.error import NoAsyncCallError
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # workers import support.bench_envs from here
from support.bench_envs import BurnEnv, NullEnv, make_atari  # noqa: E402
from support.report import command_line  # noqa: E402

from clusterenv import ClusterEnv  # noqa: E402
from clusterenv.launch.launchers import LocalLauncher  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CORES = len(os.sched_getaffinity(0))
BACKENDS = ("sync", "async", "clusterenv", "clusterenv_first_ready")
LABELS = {
    "sync": "SyncVectorEnv",
    "async": "AsyncVectorEnv",
    "clusterenv": "ClusterEnv lockstep",
    "clusterenv_first_ready": "ClusterEnv first-ready",
    "clusterenv_zmq": "ClusterEnv lockstep, workers on ZeroMQ, no batch scheduling",
}


@dataclasses.dataclass
class Args:
    quick: bool = False
    """smoke run: 16 envs on 4 workers, 1 s runs, one round"""
    num_envs: int = 64
    """envs per workload"""
    num_workers: int = CORES
    """ClusterEnv's workers (one per core by default)"""
    first_ready_fraction: float = 0.25
    """first-ready batches: this fraction of the envs (a whole number of workers' slices)"""
    seconds: float = 3.0
    """timed seconds per run"""
    warmup_steps: int = 10
    """untimed batch steps per run"""
    repeats: int = 2
    """rounds; backends alternate within each, medians are reported"""
    workloads: tuple[str, ...] = ("burn1ms", "pong", "null")
    """which workloads to run"""
    zmq_column: bool = False
    """also ClusterEnv lockstep as it started local workers before pipes and batch scheduling
    (``LocalLauncher(pipes=False, batch_scheduling=False)``): what they change, in the same run"""


def workload_env(name: str) -> Callable[[], gym.Env]:
    if name == "burn1ms":
        return functools.partial(BurnEnv, step_cpu_ms=1.0)
    if name == "pong":
        return functools.partial(make_atari, "ALE/Pong-v5")
    if name == "null":
        return NullEnv
    raise ValueError(f"Unknown workload {name!r}; expected burn1ms, pong or null.")


def build(backend: str, env_fns: list, args: Args) -> Any:
    if backend == "sync":
        return gym.vector.SyncVectorEnv(env_fns)
    if backend == "async":
        return gym.vector.AsyncVectorEnv(env_fns, shared_memory=True)
    before = backend == "clusterenv_zmq"  # workers on the ZeroMQ socket, scheduled as any process
    launcher = LocalLauncher(pipes=not before, batch_scheduling=not before)
    envs = ClusterEnv(env_fns, num_workers=args.num_workers, launcher=launcher)
    if backend == "clusterenv_first_ready":
        envs.batch_size = round(args.num_envs * args.first_ready_fraction)
    return envs


def env_steps_per_second(backend: str, envs: Any, actions: np.ndarray, args: Args) -> float:
    """Env-steps/s over ``args.seconds``, after ``args.warmup_steps`` untimed batch steps."""
    t = 0

    def lockstep() -> int:
        nonlocal t
        envs.step(actions[t % len(actions)])
        t += 1
        return args.num_envs

    def first_ready() -> int:
        nonlocal t
        *_, env_ids = envs.recv()
        envs.send(actions[t % len(actions)][env_ids], env_ids)
        t += 1
        return len(env_ids)

    if backend == "clusterenv_first_ready":
        envs.async_reset(seed=0)
        for _ in range(args.num_envs // envs.batch_size):  # the reset observations, answered with a step
            first_ready()
        step = first_ready
    else:
        envs.reset(seed=0)
        step = lockstep
    for _ in range(args.warmup_steps):
        step()
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < args.seconds:
        steps += step()
    rate = steps / (time.perf_counter() - started)
    if backend == "clusterenv_first_ready":
        while True:  # take back what is still in flight before closing
            try:
                envs.recv()
            except NoAsyncCallError:
                break
    return rate


def main(args: Args) -> None:
    if args.quick:
        args = dataclasses.replace(args, num_envs=16, num_workers=4, seconds=1.0, warmup_steps=3, repeats=1)
    runs: dict[str, dict[str, list[float]]] = {}
    backends = [*BACKENDS, *(["clusterenv_zmq"] if args.zmq_column else [])]
    jobs = [(w, b) for _ in range(args.repeats) for w in args.workloads for b in backends]
    for workload, backend in tqdm(jobs, desc="manycore"):
        env_fns = [workload_env(workload)] * args.num_envs
        envs = build(backend, env_fns, args)
        try:
            space = envs.single_action_space
            space.seed(0)
            actions = np.array([[space.sample() for _ in range(args.num_envs)] for _ in range(64)])
            rate = env_steps_per_second(backend, envs, actions, args)
        finally:
            envs.close()
        runs.setdefault(f"{workload}_x{args.num_envs}", {}).setdefault(backend, []).append(rate)
    cells = {cell: {b: statistics.median(r) for b, r in by_backend.items()} for cell, by_backend in runs.items()}
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"`{command_line(__file__)}` on {platform.node()} ({platform.processor() or platform.machine()}), {CORES} cores, "
        f"{date}; {args.num_envs} envs, ClusterEnv on {args.num_workers} workers, first-ready batches of "
        f"{round(args.num_envs * args.first_ready_fraction)}; env-steps/s, medians of {args.repeats} alternated runs "
        f"of {args.seconds:g} s; ratios to SyncVectorEnv and AsyncVectorEnv of the same run.",
        "",
        "| cell | " + " | ".join(LABELS[b] for b in backends) + " | lockstep / Async | first-ready / Async |",
        "|---|" + "---|" * (len(backends) + 2),
    ]
    for cell, rates in cells.items():
        sync, async_ = rates["sync"], rates["async"]
        shown = [f"{rates[b]:,.0f} ({rates[b] / sync:.2f}x)" for b in backends]
        lines.append(
            f"| {cell} | {' | '.join(shown)} | {rates['clusterenv'] / async_:.2f}x | "
            f"{rates['clusterenv_first_ready'] / async_:.2f}x |"
        )
    table = "\n".join(lines)
    print(table)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "manycore.md").write_text(table + "\n")
    report = {"cores": CORES, "date": date, "cells": cells, "runs": runs, "args": dataclasses.asdict(args)}
    (RESULTS_DIR / "manycore.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main(tyro.cli(Args))
