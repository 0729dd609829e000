"""Units on one host: EnvPool alone against clusterenv over EnvPool units; SuperSuit against clusterenv on PettingZoo.

Cells (docs/guides/units.md):

* ``cartpole256``, ``pong32``: EnvPool alone (one pool, every core's threads) against
  ``clusterenv.make_vec(id, n, vector_kwargs={"units": "envpool", "num_workers": 2})`` (two
  EnvPools, each with half the cores), stepped in lockstep with random actions.
* ``pistonball8``: 8 copies of ``pistonball_v6``: SuperSuit's ``concat_vec_envs_v1`` with
  processes (``num_cpus`` = cores) against ``clusterenv.pettingzoo.make_vec(game, 8,
  num_workers=cores)``.

Each run times ``--steps`` batch steps after 10 untimed ones and records env steps per
second (one env step: one env's, or one agent's, step) and the learner process's CPU time per
batch step (``time.process_time``: all its threads; for EnvPool alone that includes EnvPool's
threads, which run in the learner's process). Backends alternate within each repeat; the
report gives medians and clusterenv's ratio to the baseline.

    python benchmarks/units.py                 # every cell, 5 repeats, a few minutes on 2 cores
    python benchmarks/units.py --quick         # a smoke run
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent))
from support.report import command_line  # noqa: E402

import clusterenv  # noqa: E402
import clusterenv.pettingzoo  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"

warnings.filterwarnings("ignore", message=".*precision lowered by casting to float32")


@dataclasses.dataclass
class Args:
    quick: bool = False
    """smoke run: few steps, one repeat"""
    cells: tuple[str, ...] = ("cartpole256", "pong32", "pistonball8")
    """which comparisons to run"""
    repeats: int = 5
    """runs per backend and cell, alternated; medians are reported"""
    steps: int = 0
    """timed batch steps per run (0: each cell's default)"""


def cores() -> int:
    return len(os.sched_getaffinity(0))


def pistonball() -> Any:
    import pettingzoo

    return pettingzoo.make("parallel", "butterfly/pistonball-v6")


def envpool_alone(task_id: str, num_envs: int) -> Any:
    import envpool

    return envpool.make(task_id, env_type="gymnasium", num_envs=num_envs, seed=0, num_threads=cores())


def envpool_units(task_id: str, num_envs: int) -> Any:
    return clusterenv.make_vec(task_id, num_envs, vector_kwargs={"units": "envpool", "num_workers": 2}, seed=0)


def supersuit_processes(num_envs: int) -> Any:
    import supersuit

    vec = supersuit.pettingzoo_env_to_vec_env_v1(pistonball())
    return supersuit.concat_vec_envs_v1(vec, num_envs, num_cpus=cores(), base_class="gymnasium")


def pettingzoo_units(num_envs: int) -> Any:
    return clusterenv.pettingzoo.make_vec(pistonball, num_envs, num_workers=cores())


# cell: (baseline name, baseline, clusterenv, default steps, sample actions)
CELLS: dict[str, tuple[str, Callable[[], Any], Callable[[], Any], int]] = {
    "cartpole256": (
        "EnvPool alone",
        functools.partial(envpool_alone, "CartPole-v1", 256),
        functools.partial(envpool_units, "CartPole-v1", 256),
        2000,
    ),
    "pong32": (
        "EnvPool alone",
        functools.partial(envpool_alone, "Pong-v5", 32),
        functools.partial(envpool_units, "Pong-v5", 32),
        300,
    ),
    "pistonball8": (
        "SuperSuit concat_vec_envs_v1, processes",
        functools.partial(supersuit_processes, 8),
        functools.partial(pettingzoo_units, 8),
        60,
    ),
}


def actions_for(envs: Any, steps: int) -> list[np.ndarray]:
    space = getattr(envs, "single_action_space", None) or envs.action_space
    space.seed(0)
    return [np.stack([space.sample() for _ in range(envs.num_envs)]) for _ in range(steps)]


def run_once(make: Callable[[], Any], steps: int) -> dict[str, float]:
    """One run: env steps per second and the learner's CPU ms per batch step."""
    envs = make()
    try:
        actions = actions_for(envs, steps + 10)
        envs.reset(seed=0)
        for a in actions[:10]:
            envs.step(a)
        cpu, wall = time.process_time(), time.perf_counter()
        for a in actions[10:]:
            envs.step(a)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return {"env_steps_per_s": envs.num_envs * steps / wall, "learner_cpu_ms_per_step": 1000 * cpu / steps}
    finally:
        envs.close()


def main(args: Args) -> None:
    repeats = 1 if args.quick else args.repeats
    started = datetime.datetime.now(datetime.timezone.utc)
    results: dict[str, Any] = {
        "command": command_line(__file__),
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "host": {"cores": cores(), "machine": platform.machine(), "python": platform.python_version()},
        "cells": {},
    }
    for cell in args.cells:
        baseline_name, baseline, candidate, default_steps = CELLS[cell]
        steps = args.steps or (default_steps // 10 if args.quick else default_steps)
        runs: dict[str, list[dict[str, float]]] = {"baseline": [], "clusterenv": []}
        for r in range(repeats):
            order = [("baseline", baseline), ("clusterenv", candidate)]
            for name, make in order if r % 2 == 0 else order[::-1]:
                runs[name].append(run_once(make, steps))
                print(f"{cell} {name} run {r}: {runs[name][-1]}", flush=True)
        medians = {name: {key: statistics.median(run[key] for run in rs) for key in rs[0]} for name, rs in runs.items()}
        ratio = medians["clusterenv"]["env_steps_per_s"] / medians["baseline"]["env_steps_per_s"]
        results["cells"][cell] = {
            "baseline": baseline_name,
            "steps": steps,
            "runs": runs,
            "medians": medians,
            "ratio": ratio,
        }
    if not args.quick:
        RESULTS_DIR.mkdir(exist_ok=True)
        (RESULTS_DIR / "units.json").write_text(json.dumps(results, indent=1))
        (RESULTS_DIR / "units.md").write_text(report(results))
    print(report(results))


def report(results: dict[str, Any]) -> str:
    lines = [
        f"`{results['command']}`, {results['date']}, {results['host']['cores']} cores; medians of "
        f"{len(next(iter(results['cells'].values()))['runs']['baseline'])} alternated runs per backend.",
        "",
        "| cell | baseline | baseline env steps/s | clusterenv env steps/s | ratio | learner CPU ms/step (baseline / clusterenv) |",
        "|---|---|---|---|---|---|",
    ]
    for cell, c in results["cells"].items():
        b, k = c["medians"]["baseline"], c["medians"]["clusterenv"]
        lines.append(
            f"| {cell} | {c['baseline']} | {b['env_steps_per_s']:,.0f} | {k['env_steps_per_s']:,.0f} | "
            f"{c['ratio']:.2f}x | {b['learner_cpu_ms_per_step']:.2f} / {k['learner_cpu_ms_per_step']:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(tyro.cli(Args))
