"""The learner's CPU per batch step grows with peers, not with env processes (issue 10, item 3).

``procs_per_worker=N`` makes each worker step its slice in N env processes, so a host of
many cores is one ZeroMQ peer of the learner. This measures what the learner process
itself spends per batch step (``time.process_time()``: all its threads, ZeroMQ's I/O
thread and the heartbeat monitor included; not the workers) on ``SleepEnv``s, whose steps
take wall time but no CPU, so that only the cost of moving steps around is left:

* ``2 peers x 16 procs``: 32 envs behind 2 workers with ``procs_per_worker=16``;
* ``2 peers x 1 env``: 2 envs behind 2 workers, the floor that 2 peers cost (the target
  is ``2 peers x 16 procs`` at most 1.5x this);
* ``32 peers x 1 env``: the same 32 envs as 32 workers, for comparison.

    python benchmarks/probes/procs.py            # ~2 min on 2 cores
    python benchmarks/probes/procs.py --quick    # a smoke run

Configurations alternate within each repeat; medians of ``--repeats`` runs are reported.
Writes ``results/procs.md`` and ``results/procs.json`` next to this file.
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
from pathlib import Path

import numpy as np
import tyro
from tqdm import tqdm

# This folder, then benchmarks/ (support.bench_envs, support.report): the workers inherit the path.
sys.path[:0] = [str(folder) for folder in Path(__file__).resolve().parents[:2]]
from support.bench_envs import SleepEnv  # noqa: E402
from support.report import command_line  # noqa: E402

from clusterenv import ClusterEnv  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclasses.dataclass
class Args:
    quick: bool = False
    """smoke run: few steps, one repeat, no 32-peer row"""
    num_envs: int = 32
    """envs of the many-envs configurations"""
    peers: int = 2
    """workers (ZeroMQ peers) of the two main configurations"""
    step_ms: float = 2.0
    """wall-clock milliseconds each SleepEnv step sleeps"""
    steps: int = 300
    """timed batch steps per run, after ``warmup_steps`` untimed ones"""
    warmup_steps: int = 30
    """batch steps before timing (start-up, caches, first-step checks)"""
    repeats: int = 3
    """runs per configuration; the median is reported"""
    many_peers: bool = True
    """also run the ``num_envs`` envs as ``num_envs`` peers of one env each"""


@dataclasses.dataclass(frozen=True)
class Config:
    label: str
    num_envs: int
    num_workers: int
    procs_per_worker: int


def configs(args: Args) -> list[Config]:
    main = [
        Config(
            f"{args.peers} peers x {args.num_envs // args.peers} procs",
            args.num_envs,
            args.peers,
            args.num_envs // args.peers,
        ),
        Config(f"{args.peers} peers x 1 env", args.peers, args.peers, 1),
    ]
    if args.many_peers and not args.quick:
        main.append(Config(f"{args.num_envs} peers x 1 env", args.num_envs, args.num_envs, 1))
    return main


def run(config: Config, args: Args) -> tuple[float, float]:
    """Learner CPU and wall time per batch step, in milliseconds."""
    env_fn = functools.partial(SleepEnv, args.step_ms)
    with ClusterEnv(
        [env_fn] * config.num_envs, num_workers=config.num_workers, procs_per_worker=config.procs_per_worker
    ) as envs:
        envs.reset(seed=0)
        actions = np.random.default_rng(0).integers(0, 2, size=(args.warmup_steps + args.steps, config.num_envs))
        for t in range(args.warmup_steps):
            envs.step(actions[t])
        cpu, wall = time.process_time(), time.perf_counter()
        for t in range(args.warmup_steps, args.warmup_steps + args.steps):
            envs.step(actions[t])
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return 1000 * cpu / args.steps, 1000 * wall / args.steps


def main(args: Args) -> None:
    if args.quick:
        args = dataclasses.replace(args, steps=50, warmup_steps=10, repeats=1)
    plan = configs(args)
    cells: dict[str, list[tuple[float, float]]] = {c.label: [] for c in plan}
    for _, config in tqdm([(r, c) for r in range(args.repeats) for c in plan], desc="procs"):
        cells[config.label].append(run(config, args))
    cpu = {label: statistics.median(c for c, _ in runs) for label, runs in cells.items()}
    wall = {label: statistics.median(w for _, w in runs) for label, runs in cells.items()}
    floor = cpu[plan[1].label]
    command = command_line(__file__)
    lines = [
        f"`{command}` — SleepEnv ({args.step_ms} ms sleep per step, no CPU), {args.steps} timed batch steps, "
        f"median of {args.repeats} (configurations alternated); {CORES} cores, Python {platform.python_version()}.",
        "",
        "| configuration | envs | env processes | learner CPU per batch step | vs 2 peers x 1 env | wall per batch step |",
        "|---|---|---|---|---|---|",
        *(
            f"| {c.label} | {c.num_envs} | {c.num_workers * c.procs_per_worker if c.procs_per_worker > 1 else c.num_workers} "
            f"| {cpu[c.label]:.3f} ms | {cpu[c.label] / floor:.2f}x | {wall[c.label]:.2f} ms |"
            for c in plan
        ),
        "",
        f"Target: `{plan[0].label}` at most 1.5x `{plan[1].label}`: "
        f"{'met' if cpu[plan[0].label] <= 1.5 * floor else 'missed'} ({cpu[plan[0].label] / floor:.2f}x).",
    ]
    table = "\n".join(lines)
    print(table)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "procs.md").write_text(table + "\n")
    raw = {"args": dataclasses.asdict(args), "configs": [dataclasses.asdict(c) for c in plan], "cells": cells}
    (RESULTS_DIR / "procs.json").write_text(json.dumps(raw, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args)))
