"""This checkout against another one of clusterenv, alternated: did a change cost the learner anything per step?

Each run is a fresh process that imports clusterenv from one checkout (its workers too) and
steps one cell in lockstep for ``--seconds``; the two checkouts take turns, cell by cell, for
``--rounds`` rounds, and the medians are compared. Cells: ``cartpole16`` (16 CartPoles on 2
workers, where the learner's per-step cost shows most), ``null64`` (64 ``NullEnv`` on 16
workers: transport and bookkeeping only) and, when asked for, ``halfcheetah16`` (16
HalfCheetah-v5 on 2 workers: MuJoCo steps and infos in the region), ``split_cartpole16`` and
``split_null16`` (16 CartPoles or null envs, the learner stepping 8 beside one worker, both
spinning where they fit: ``num_workers=1, learner_envs=8``).

    git worktree add /tmp/base <commit>
    python benchmarks/ab.py --base /tmp/base --label "worker_info usage, learner_info, env step times"

Writes ``results/ab.md`` and ``results/ab.json``.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import tyro
from support.report import command_line, write_report

HERE = Path(__file__).resolve().parent

_RUN = """
import json, sys, time
sys.path.insert(0, {benchmarks!r})
import gymnasium as gym, numpy as np
from support.bench_envs import NullEnv
from clusterenv import ClusterEnv
SPLIT = {{"num_workers": 1, "learner_envs": 8}}
fns, kwargs = {{
    "cartpole16": ([lambda: gym.make("CartPole-v1")] * 16, {{"num_workers": 2}}),
    "halfcheetah16": ([lambda: gym.make("HalfCheetah-v5")] * 16, {{"num_workers": 2}}),
    "null64": ([NullEnv] * 64, {{"num_workers": 16}}),
    "split_cartpole16": ([lambda: gym.make("CartPole-v1")] * 16, SPLIT),
    "split_null16": ([NullEnv] * 16, SPLIT),
}}[{cell!r}]
with ClusterEnv(fns, **kwargs) as envs:
    actions = np.zeros(envs.action_space.shape, envs.action_space.dtype)
    envs.reset(seed=0)
    for _ in range(100):
        envs.step(actions)
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < {seconds}:
        envs.step(actions)
        steps += len(fns)
    print(json.dumps(steps / (time.perf_counter() - started)))
"""


@dataclasses.dataclass
class Args:
    base: str
    """the other checkout (a git worktree of the commit to compare against)"""
    label: str = "this checkout"
    """what this checkout changes, for the report"""
    cells: tuple[str, ...] = ("cartpole16", "null64")
    rounds: int = 5
    seconds: float = 3.0


def env_steps_per_second(checkout: Path, cell: str, seconds: float) -> float:
    code = _RUN.format(benchmarks=str(HERE), cell=cell, seconds=seconds)
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=checkout, env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return float(done.stdout.strip().splitlines()[-1])


def main(args: Args) -> None:
    checkouts = {"base": Path(args.base).resolve(), "this": HERE.parent}
    runs: dict[str, dict[str, list[float]]] = {cell: {"base": [], "this": []} for cell in args.cells}
    for _ in range(args.rounds):
        for cell in args.cells:
            for name, checkout in checkouts.items():
                runs[cell][name].append(env_steps_per_second(checkout, cell, args.seconds))
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"`{command_line(__file__)}`, {date}, {os.cpu_count()} cores: env-steps/s of lockstep `step`, medians of "
        f"{args.rounds} alternated runs of {args.seconds:g} s; this checkout: {args.label}.",
        "",
        "| cell | base | this | this / base | runs (base; this) |",
        "|---|---:|---:|---:|---|",
    ]
    for cell, by in runs.items():
        base, this = statistics.median(by["base"]), statistics.median(by["this"])
        spread = f"{', '.join(f'{v:,.0f}' for v in by['base'])}; {', '.join(f'{v:,.0f}' for v in by['this'])}"
        lines.append(f"| {cell} | {base:,.0f} | {this:,.0f} | {this / base:.3f} | {spread} |")
    text = "\n".join(lines) + "\n"
    write_report("ab", text, {"date": date, "args": dataclasses.asdict(args), "runs": runs})


if __name__ == "__main__":
    main(tyro.cli(Args))
