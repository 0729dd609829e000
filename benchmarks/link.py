"""Workers on another host over a real, rate-limited link: env-steps/s with compression off and on.

The other host is a network namespace with its own hostname (``tests/netns.py``), joined to
the learner's by a veth pair limited to ``--rates`` with ``tc qdisc ... tbf`` on both ends;
its workers (``clusterenv-worker``, ``launcher="external"``) reach the learner only over that
link. Needs root and iproute2; the namespace and the link are removed at the end, whatever
happens. Two workloads, with compression ``none``, ``lz4`` and ``zstd`` alternated within each rate:

* **Breakout frames, the learner acting**: ``ClusterEnv.step`` over ``--num-envs`` envs that
  replay recorded 84x84x4 Breakout stacks (``FrameReplayEnv``: no CPU per step, so the link and
  the learner are what is measured).
* **Rollouts with local policies**: ``PolicyRunner.rollout(--rollout-steps)`` over the same envs,
  a small actor in each worker (a rollout carries ``obs`` and ``next_obs`` frames), then
  ``publish()`` of the unchanged actor, as a training loop does.

Reported: env-steps/s (medians of ``--repeats``), and bytes that crossed the link per env
step (the veth pair's counters, both directions, headers included).

    sudo python benchmarks/link.py            # ~3 minutes on 2 cores
    sudo python benchmarks/link.py --quick    # a smoke run

Writes ``results/link.md`` and ``results/link.json``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import tyro
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT.parent)]  # support.bench_envs for the workers; tests.netns for the namespace
from support.bench_envs import FrameReplayEnv, record_breakout  # noqa: E402
from support.report import command_line  # noqa: E402

from clusterenv import APS, ClusterEnv, PolicyRunner  # noqa: E402
from tests import netns  # noqa: E402

RESULTS_DIR = ROOT / "results"
SECRET = "the link benchmark's own secret"
OFFSET_STRIDE = 37


@dataclasses.dataclass
class Args:
    quick: bool = False
    """smoke run: one rate, 1 s runs, one round"""
    rates: tuple[str, ...] = ("1gbit", "10gbit")
    """link rates (tc's units)"""
    num_envs: int = 32
    """envs, all on the other host"""
    num_workers: int = 2
    """worker processes on the other host"""
    rollout_steps: int = 32
    """steps per rollout"""
    seconds: float = 4.0
    """timed seconds per run"""
    repeats: int = 3
    """rounds (compression settings alternate within each); medians are reported"""
    codecs: tuple[str, ...] = ("none", "lz4", "zstd")
    """compression settings"""


class Actor(torch.nn.Module):
    """A small actor over 84x84x4 uint8 frames: what the workers act with (its cost is not the point)."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = torch.nn.AvgPool2d(6)
        self.head = torch.nn.Linear(4 * 14 * 14, 4)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(obs.float() / 255.0).flatten(1))


def run_cell(host: netns.OtherHost, env_fns: list, workload: str, codec: str, args: Args) -> tuple[float, float]:
    """``(env-steps/s, link bytes per env step)`` of one run, its workers started on the other host."""
    with netns.external_workers(host, args.num_workers, SECRET) as address:
        with ClusterEnv(
            env_fns,
            num_workers=args.num_workers,
            bind=address,
            secret=SECRET,
            launcher="external",
            compression=None if codec == "none" else codec,
        ) as envs:
            envs.reset(seed=0)
            actions = np.zeros(envs.num_envs, dtype=np.int64)
            actor = Actor()
            runner = PolicyRunner(envs, actor, APS(threshold=0.01), seed=0) if workload == "rollout" else None

            def step() -> int:
                """One batch step (the learner acts), or one rollout and a publish: the env steps it took."""
                if runner is None:
                    envs.step(actions)
                    return envs.num_envs
                runner.rollout(args.rollout_steps)
                runner.publish(actor)
                return args.rollout_steps * envs.num_envs

            for _ in range(3):
                step()
            env_steps, moved, started = 0, host.rx_bytes() + host.tx_bytes(), time.perf_counter()
            while time.perf_counter() - started < args.seconds:
                env_steps += step()
            elapsed = time.perf_counter() - started
            moved = host.rx_bytes() + host.tx_bytes() - moved
    return env_steps / elapsed, moved / env_steps


def main(args: Args) -> None:
    if reason := netns.unavailable():
        sys.exit(f"Cannot make another host here: {reason}.")
    if args.quick:
        args = dataclasses.replace(args, rates=args.rates[:1], seconds=1.0, repeats=1)
    torch.set_num_threads(1)
    cells: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="clusterenv-link-") as scratch:
        path = os.path.join(scratch, "breakout.npy")
        record_breakout(path)
        env_fns = [functools.partial(FrameReplayEnv, path, i * OFFSET_STRIDE) for i in range(args.num_envs)]
        jobs = [
            (rate, workload, codec)
            for rate in args.rates
            for _ in range(args.repeats)
            for workload in ("step", "rollout")
            for codec in args.codecs
        ]
        progress = tqdm(total=len(jobs), desc="link")
        for rate in args.rates:
            with netns.other_host(rate) as host:
                for job in [j for j in jobs if j[0] == rate]:
                    cells.setdefault(":".join(job), []).append(run_cell(host, env_fns, job[1], job[2], args))
                    progress.update()
        progress.close()
    lines = [
        f"`{command_line(__file__)}` on {platform.node()}, {len(os.sched_getaffinity(0))} cores, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.num_envs} envs replaying Breakout frames "
        f"(84x84x4 uint8) on {args.num_workers} workers in another network namespace, a veth link limited with tbf; "
        f"medians of {args.repeats} alternated runs of {args.seconds:g} s.",
        "",
        "| link | workload | compression | env-steps/s | link bytes per env step |",
        "|---|---|---|---|---|",
    ]
    for key, runs in cells.items():
        rate, workload, codec = key.split(":")
        label = "learner acts (`step`)" if workload == "step" else f"local policies (`rollout({args.rollout_steps})`)"
        lines.append(
            f"| {rate} | {label} | {codec} | {statistics.median(r[0] for r in runs):,.0f} | "
            f"{statistics.median(r[1] for r in runs):,.0f} |"
        )
    table = "\n".join(lines)
    print(table)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "link.md").write_text(table + "\n")
    (RESULTS_DIR / "link.json").write_text(
        json.dumps({"args": dataclasses.asdict(args), "cells": cells}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main(tyro.cli(Args))
