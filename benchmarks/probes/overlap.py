"""How much prefetched rollouts overlap collection with learning.

A rollout loop with a simulated learner update: after each ``runner.rollout(T)`` the
learner "trains" for ``U`` seconds (``time.sleep``: a learner on a GPU, or on cores of
its own, takes no CPU from the workers). ``U`` is 0.5x, 1x and 2x the measured
collection time ``C`` of one lockstep rollout. With ``prefetch=0`` the workers idle
during ``U``, so an iteration costs ``C + U``; with ``prefetch=1`` they collect the next
rollout meanwhile, so it costs ``max(C, U)`` plus overhead: at ``U = C`` the limit is 2x.
With ``prefetch=2`` a second rollout is queued, so that a worker that finishes early does not
wait through the learner's ``publish()`` and batch assembly (one more version of policy lag).

    python benchmarks/probes/overlap.py             # the table, ~2 min on 2 cores
    python benchmarks/probes/overlap.py --quick     # a smoke run

Backends alternate within each repeat; the medians of ``--repeats`` runs are reported.
Writes ``results/overlap.md`` and ``results/overlap.json`` next to this file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import gymnasium as gym
import torch
import tyro
from torch import nn
from tqdm import tqdm

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # support (report, bench_envs), one level up
from support.report import command_line  # noqa: E402

from clusterenv import APS, ClusterEnv, PolicyRunner  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


@dataclasses.dataclass
class Args:
    quick: bool = False
    """smoke run: few rollouts, one repeat"""
    num_envs: int = 32
    """CartPole envs"""
    num_workers: int = 2
    """worker processes"""
    num_steps: int = 128
    """steps per env per rollout (T)"""
    rollouts: int = 12
    """timed rollouts per cell, after two untimed ones"""
    repeats: int = 3
    """runs per cell; the median is reported"""
    ratios: tuple[float, ...] = (0.5, 1.0, 2.0)
    """simulated update times U as multiples of the collection time C"""
    prefetch: tuple[int, ...] = (0, 1, 2)
    """prefetch depths compared (0: lockstep, the baseline of the speed-ups)"""
    torch_threads: int = 1
    """the learner's torch threads, as in the examples (its probe forward passes are tiny; more threads contend with the workers)"""


def actor() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))


def run(args: Args, prefetch: int, update_s: float) -> float:
    """Env-steps per second of a rollout-then-update loop."""
    envs = ClusterEnv([lambda: gym.make("CartPole-v1")] * args.num_envs, num_workers=args.num_workers)
    try:
        policy = actor()
        runner = PolicyRunner(envs, policy, APS(threshold=0.01), seed=0, prefetch=prefetch)
        for _ in range(2):  # untimed: worker start-up, torch import, first pulls, and the prefetch pipeline filling
            runner.rollout(args.num_steps)
            time.sleep(update_s)
            runner.publish(policy)
        started = time.perf_counter()
        for _ in range(args.rollouts):
            runner.rollout(args.num_steps)
            time.sleep(update_s)
            runner.publish(policy)
        elapsed = time.perf_counter() - started
        runner.stop()
        return args.rollouts * args.num_steps * args.num_envs / elapsed
    finally:
        envs.close()


def collection_time(args: Args) -> float:
    """C: seconds per lockstep rollout with no update in between."""
    return args.num_steps * args.num_envs / run(dataclasses.replace(args, rollouts=max(4, args.rollouts // 2)), 0, 0.0)


def main(args: Args) -> None:
    if args.quick:
        args = dataclasses.replace(args, rollouts=4, repeats=1)
    torch.set_num_threads(args.torch_threads)
    collect_s = statistics.median(collection_time(args) for _ in range(args.repeats))
    cells: dict[str, list[float]] = {}
    depths = sorted(set(args.prefetch) | {0})
    jobs = [(ratio, prefetch) for _ in range(args.repeats) for ratio in args.ratios for prefetch in depths]
    for ratio, prefetch in tqdm(jobs, desc="overlap"):
        cells.setdefault(f"{ratio}:{prefetch}", []).append(run(args, prefetch, ratio * collect_s))
    ahead = [depth for depth in depths if depth]
    rows = []
    for ratio in args.ratios:
        lockstep = statistics.median(cells[f"{ratio}:0"])
        ideal = (1 + ratio) / max(1.0, ratio)  # (C + U) / max(C, U)
        cols = [f"{lockstep:,.0f}"]
        for depth in ahead:
            prefetched = statistics.median(cells[f"{ratio}:{depth}"])
            cols.append(f"{prefetched:,.0f} ({prefetched / lockstep:.2f}x)")
        rows.append(f"| {ratio} | {' | '.join(cols)} | {ideal:.2f}x |")
    command = command_line(__file__)
    lines = [
        f"`{command}` — CartPole-v1, {args.num_envs} envs, {args.num_workers} workers, 64x64 MLP actor, "
        f"T={args.num_steps}, C = {collect_s * 1000:.0f} ms per lockstep rollout, {args.torch_threads} torch thread(s) "
        f"in the learner; median of {args.repeats} "
        f"(backends alternated); {os.cpu_count()} cores, Python {platform.python_version()}.",
        "",
        "| U / C | prefetch=0 steps/s | "
        + " | ".join(f"prefetch={depth} steps/s (speed-up)" for depth in ahead)
        + " | limit (C+U)/max(C,U) |",
        "|---" * (len(ahead) + 3) + "|",
        *rows,
    ]
    table = "\n".join(lines)
    print(table)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "overlap.md").write_text(table + "\n")
    raw = {"args": dataclasses.asdict(args), "collect_s": collect_s, "cells": cells}
    (RESULTS_DIR / "overlap.json").write_text(json.dumps(raw, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args)))
