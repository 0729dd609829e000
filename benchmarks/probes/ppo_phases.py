"""Where the PPO example's time goes, with the learner picking actions: each phase timed from inside.

Each run is ``examples/ppo_cartpole.py`` itself (its own process, its own start-up), with
``ClusterEnv.__init__``, ``ClusterEnv.step``, ``SyncVectorEnv.step``, the learner's own envs'
step (``LearnerEnvs.step``), the lockstep step's wait for each worker's words
(``SharedSteps.await_words``), ``Tensor.backward`` and ``Adam.step`` wrapped with a clock; the
loop's own work is the rest of the run. Configurations alternate, run by run.

    python benchmarks/probes/ppo_phases.py                  # 4 configurations x 2 runs, about 2 minutes
    python benchmarks/probes/ppo_phases.py --runs 1         # a smoke run

Writes ``results/ppo_phases.md``.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.report import command_line, write_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {
    "gym": ["--backend", "gym"],
    "the defaults": [],
    "--num-workers 1": ["--num-workers", "1"],
    "--num-workers 2": ["--num-workers", "2"],
    "--spin-us 0": ["--spin-us", "0"],
}

# One run: the example under wrapped phases; prints the seconds per phase as one JSON line.
_RUN = r"""
import collections, json, runpy, sys, tempfile, time
import gymnasium as gym, torch
import clusterenv
from clusterenv.learner.own_envs import LearnerEnvs
from clusterenv.learner.shared_steps import SharedSteps
spent = collections.Counter()

def timed(owner, name, label):
    original = getattr(owner, name)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - started
    setattr(owner, name, wrapper)

timed(clusterenv.ClusterEnv, "__init__", "build")
timed(clusterenv.ClusterEnv, "step", "clusterenv step")
timed(gym.vector.SyncVectorEnv, "step", "SyncVectorEnv step")
timed(LearnerEnvs, "step", "the learner's own envs")
timed(SharedSteps, "await_words", "waiting for the worker")
timed(torch.Tensor, "backward", "backward")
timed(torch.optim.Adam, "step", "optimizer")
with tempfile.TemporaryDirectory() as runs:
    sys.argv = ["ppo_cartpole.py", "--runs-dir", runs, *json.loads(sys.argv[1])]
    started = time.perf_counter()
    runpy.run_path("ppo_cartpole.py", run_name="__main__")
    spent["total"] = time.perf_counter() - started
print(json.dumps(spent))
"""


@dataclasses.dataclass
class Args:
    runs: int = 2
    """runs per configuration, alternated"""
    total_timesteps: int = 98_304
    seed: int = 1


def run_once(flags: list[str], args: Args) -> dict[str, float]:
    example = [*flags, "--seed", str(args.seed), "--total-timesteps", str(args.total_timesteps)]
    done = subprocess.run(
        [sys.executable, "-c", _RUN, json.dumps(example)],
        cwd=ROOT / "examples",
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def row(name: str, runs: list[dict[str, float]], steps: int) -> str:
    """The table row of one configuration: medians, seconds and µs per env step of the batch."""

    def median(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in runs)

    total, build = median("total"), median("build")
    step = median("clusterenv step") or median("SyncVectorEnv step")
    stepped_by_clusterenv = bool(median("clusterenv step"))
    own = median("the learner's own envs") if stepped_by_clusterenv else None
    update = median("backward") + median("optimizer")
    rest = total - build - step - update
    own_cell = "—" if own is None else f"{own:.2f} s ({own / steps * 1e6:.0f} µs)"
    wait = median("waiting for the worker") if stepped_by_clusterenv else None
    wait_cell = "—" if wait is None else f"{wait:.2f} s ({wait / steps * 1e6:.0f} µs)"
    return (
        f"| {name} | {total:.2f} s | {build:.2f} s | {step:.2f} s ({step / steps * 1e6:.0f} µs) | {own_cell} "
        f"| {wait_cell} | {update:.2f} s | {rest:.2f} s ({rest / steps * 1e6:.0f} µs) |"
    )


def main(args: Args) -> None:
    results: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    for _ in range(args.runs):
        for name, flags in CONFIGS.items():
            results[name].append(run_once(flags, args))
            print(name, json.dumps(results[name][-1]), flush=True)
    steps = args.total_timesteps // 8  # the example's 8 envs: one batch step per 8 env steps
    lines = [
        f"`{command_line(__file__)}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
        f"`examples/ppo_cartpole.py`, {args.total_timesteps:,} steps, seed {args.seed}, the learner picking "
        f"actions; medians of {args.runs} alternated runs; per batch step in brackets ({steps:,} steps).",
        "",
        "| configuration | run | building the ClusterEnv | `step` | the learner's own envs, within `step` "
        "| waiting for the worker's words, within `step` | update (backward, optimizer) | the loop's own work "
        "(the rest) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *(row(name, runs, steps) for name, runs in results.items()),
    ]
    text = "\n".join(lines) + "\n"
    write_report("ppo_phases", text)


if __name__ == "__main__":
    main(tyro.cli(Args))
