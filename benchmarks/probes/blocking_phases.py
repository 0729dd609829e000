"""Where a blocking lockstep step goes, against the bare floor's: before the envs, the envs, after them.

With two workers on two cores nobody spins: each step wakes both workers and is woken back.
Here every env records, on the host's monotonic clock, when each of its calls (a step, or the
reset of a ``NEXT_STEP`` autoreset) starts and ends, and the learner records when each
``step`` call starts and returns. Per batch step that gives three phases, the same for
clusterenv (its default, the shared step path) and for the floor
(:class:`support.shm_floor.ShmFloor`):

* **before the envs**: from the call until the first env starts (the learner's command, the
  wake-up, the worker's way to its envs);
* **the envs**: from the first env's start to the last one's end (both workers' envs, in
  parallel; the slower worker sets it);
* **after the envs**: from the last env's end until the call returns (the worker's reply, the
  learner's wake-up, the batch it builds).

The envs' own time, summed per worker, is reported too: a worker woken cold steps its envs
slower than ``SyncVectorEnv`` does warm, the floor's worker as much as clusterenv's. So is
where the first env ran: how often on the core the learner began the step on. With three
processes on two cores, a worker woken there waits until the learner blocks, so the learner's
work between the wake-ups and its blocking read delays it. The recording costs each env call
two clock reads and a ``sched_getcpu``, on every backend alike. Rounds alternate the
backends, each run in a fresh process; the medians are reported.

    python benchmarks/probes/blocking_phases.py
    python benchmarks/probes/blocking_phases.py --quick

Writes ``results/blocking_phases.md`` and ``results/blocking_phases.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import tyro

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(BENCHMARKS))  # support.report, one level up
from support.report import command_line, write_report  # noqa: E402

#: cell -> (env, number of envs); two workers each.
CELLS = {"cartpole_x16": ("CartPole-v1", 16), "halfcheetah_x16": ("HalfCheetah-v5", 16), "null_x16": ("NullEnv", 16)}
BACKENDS = ("floor", "clusterenv")
PHASES = ("step", "before the envs", "the envs", "after the envs", "a worker's envs, summed")
#: The share of steps whose first env ran on the core the learner began the step on.
ON_LEARNER_CORE = "first env on the learner's core"


@dataclasses.dataclass
class Args:
    cells: tuple[str, ...] = tuple(CELLS)
    rounds: int = 3
    steps: int = 3000
    """timed batch steps per run, after 300 untimed ones"""
    quick: bool = False
    """one round of 500 steps"""


# One run, in a fresh process: every env call is timed into a file of its own, read back here.
_RUN = r"""
import ctypes, json, os, sys, tempfile, time
sys.path.insert(0, {benchmarks!r})
core = ctypes.CDLL(None).sched_getcpu  # glibc's, through the vDSO: a few ns
import gymnasium as gym, numpy as np
env_id, num_envs, backend, steps, warm = {env!r}, {num_envs}, {backend!r}, {steps}, {warm}
calls_per_env = steps + warm
folder = tempfile.mkdtemp(prefix="blocking-phases-")

class Timed(gym.Wrapper):
    # Records (start, end) of each call, saved when the run's last one ends (workers may never close it).
    def __init__(self, index):
        if env_id == "NullEnv":
            from support.bench_envs import NullEnv
            env = NullEnv()
        else:
            env = gym.make(env_id, max_episode_steps=10**9) if env_id.startswith("HalfCheetah") else gym.make(env_id)
        super().__init__(env)
        self.index, self.calls = index, []
        self.core = ctypes.CDLL(None).sched_getcpu  # made where the env runs: a ctypes function does not pickle
    def _timed(self, call, *args, **kwargs):
        started, on = time.perf_counter_ns(), self.core()
        result = call(*args, **kwargs)
        self.calls.append((started, time.perf_counter_ns(), on))
        if len(self.calls) == calls_per_env + 1:  # the first reset, then one call per batch step
            np.save(os.path.join(folder, f"{{self.index}}.npy"), np.array(self.calls[1:]))
        return result
    def step(self, action):
        return self._timed(self.env.step, action)
    def reset(self, **kwargs):
        return self._timed(self.env.reset, **kwargs)

def make(index):
    return lambda: Timed(index)

fns = [make(i) for i in range(num_envs)]
if backend == "floor":
    from support.shm_floor import ShmFloor
    from onehost import INFO_KEYS
    envs = ShmFloor(fns, 2, INFO_KEYS.get(env_id, ()))
else:
    from clusterenv import ClusterEnv
    envs = ClusterEnv(fns, num_workers=2)
probe = make(-1)()
actions = np.stack([probe.action_space.sample() for _ in range(num_envs)])
envs.reset(seed=0)
calls = []
for _ in range(calls_per_env):
    on, started = core(), time.perf_counter_ns()
    envs.step(actions)
    calls.append((started, time.perf_counter_ns(), on))
deadline = time.monotonic() + 30
while len(os.listdir(folder)) < num_envs and time.monotonic() < deadline:
    time.sleep(0.01)
envs.close()
env_calls = np.stack([np.load(os.path.join(folder, f"{{i}}.npy")) for i in range(num_envs)])[:, warm:]  # env, step, 3
calls = np.array(calls[warm:])
first_start, last_end = env_calls[:, :, 0].min(0), env_calls[:, :, 1].max(0)
own = (env_calls[:, :, 1] - env_calls[:, :, 0])
half = num_envs // 2
per_worker = np.maximum(own[:half].sum(0), own[half:].sum(0))
first = env_calls[:, :, 0].argmin(0)
first_core = env_calls[first, np.arange(env_calls.shape[1]), 2]
us = lambda ns: float(np.median(ns) / 1e3)
print(json.dumps({{
    "step": us(calls[:, 1] - calls[:, 0]),
    "before the envs": us(first_start - calls[:, 0]),
    "the envs": us(last_end - first_start),
    "after the envs": us(calls[:, 1] - last_end),
    "a worker's envs, summed": us(per_worker),
    "first env on the learner's core": float(np.mean(first_core == calls[:, 2])),
}}))
"""


def run(cell: str, backend: str, steps: int) -> dict[str, float]:
    env, num_envs = CELLS[cell]
    code = _RUN.format(benchmarks=str(BENCHMARKS), env=env, num_envs=num_envs, backend=backend, steps=steps, warm=300)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True, cwd=BENCHMARKS.parent
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(args: Args) -> None:
    if args.quick:
        args.rounds, args.steps = 1, 500
    runs: dict[str, dict[str, list[dict[str, float]]]] = {c: {b: [] for b in BACKENDS} for c in args.cells}
    for _ in range(args.rounds):
        for cell in args.cells:
            for backend in BACKENDS:
                runs[cell][backend].append(run(cell, backend, args.steps))
    medians = {
        cell: {
            b: {p: statistics.median(r[p] for r in rs) for p in (*PHASES, ON_LEARNER_CORE)}
            for b, rs in by_backend.items()
        }
        for cell, by_backend in runs.items()
    }
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"`{command_line(__file__)}`, {date}, {os.cpu_count()} cores: a lockstep batch step of 16 envs on 2 "
        f"workers, nobody spinning, split at the envs' own calls; medians over {args.steps:,} steps per run, "
        f"then of {args.rounds} alternated runs (µs).",
        "",
        "| cell | backend | step | before the envs | the envs | after the envs | a worker's envs, summed "
        "| first env on the learner's core |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for cell, by_backend in medians.items():
        for backend, phases in by_backend.items():
            shares = f"{phases[ON_LEARNER_CORE]:.0%}"
            lines.append(f"| {cell} | {backend} | " + " | ".join(f"{phases[p]:.1f}" for p in PHASES) + f" | {shares} |")
        floor, ours = by_backend["floor"], by_backend["clusterenv"]
        lines.append(
            f"| {cell} | clusterenv − floor | " + " | ".join(f"{ours[p] - floor[p]:+.1f}" for p in PHASES) + " | |"
        )
    text = "\n".join(lines) + "\n"
    payload = {"date": date, "cores": os.cpu_count(), "args": dataclasses.asdict(args), "medians_us": medians}
    write_report("blocking_phases", text, {**payload, "runs": runs})


if __name__ == "__main__":
    main(tyro.cli(Args))
