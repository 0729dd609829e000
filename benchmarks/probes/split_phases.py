"""Where a lockstep step of the split (``num_workers=1, learner_envs=n // 2``) goes, phase by phase, against the spinning floor.

``ClusterEnv.step``'s lockstep path is replayed here with a clock between its phases (it
reaches into private names: a benchmark, not an API): starting the call, checking the
actions, recording the step (the learner's own part and the workers' commands), commanding
the worker, stepping the learner's own envs, waiting for the worker's words, and building the
results. The bare spinning split (``benchmarks/support/spin_floor.py``) runs the same envs, its own
half timed inside its loop. A step that leaves the lockstep path (about once a second, when
the pool reads its socket) is finished by ``step_wait`` and not counted. Rounds alternate the
two, and the medians are reported.

    python benchmarks/probes/split_phases.py             # CartPole-v1 and NullEnv, 16 envs, 3 rounds
    python benchmarks/probes/split_phases.py --quick

Writes ``results/split_phases.md``.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import tyro

# This folder, then benchmarks/ (support: bench_envs, report, spin_floor): the workers inherit the path.
sys.path[:0] = [str(folder) for folder in Path(__file__).resolve().parents[:2]]
from support.bench_envs import NullEnv  # noqa: E402
from support.report import command_line, write_report  # noqa: E402
from support.spin_floor import SpinFloor  # noqa: E402

from clusterenv import ClusterEnv  # noqa: E402
from clusterenv.learner.call_state import AsyncState  # noqa: E402

PHASES = ("start", "actions", "record", "command", "own envs", "wait", "results")
ENVS = {"cartpole": lambda: gym.make("CartPole-v1"), "null": NullEnv}


@dataclasses.dataclass
class Args:
    envs: tuple[str, ...] = ("cartpole", "null")
    num_envs: int = 16
    steps: int = 20_000
    """timed steps per run, after 2,000 untimed ones"""
    rounds: int = 3
    quick: bool = False
    """one round of 2,000 steps"""


class _Unusual(Exception):
    """The step left the lockstep path: ``step_wait`` finishes it, uncounted."""


def _timed_step(env: ClusterEnv, actions: np.ndarray, totals: np.ndarray) -> None:
    """``Lockstep.step`` (learner/lockstep.py) with a clock between its phases."""
    clock = time.perf_counter_ns
    t0 = clock()
    lockstep = env._lockstep
    if lockstep is None or env._needs_reset:
        raise _Unusual
    call, pool = env._call, env._pool
    if call.state is not AsyncState.DEFAULT or env._first_ready.busy_workers() or not pool.can_step_shared():
        raise _Unusual
    t1 = clock()
    leaves = lockstep._leaves(actions)
    if leaves is None:
        raise _Unusual
    t2 = clock()
    seq = pool.new_call()
    env._env_calls.expect_own_step(leaves, None, env.single_action_space)
    pool.outbox.record_shared(leaves)
    call.state, call.pending = AsyncState.WAITING_STEP, lockstep.workers
    t3 = clock()
    pool.outbox.command_shared(seq)
    t4 = clock()
    env._run_own()
    t5 = clock()
    answers = lockstep._answers()
    if answers is None:
        raise _Unusual
    t6 = clock()
    call.state = AsyncState.DEFAULT
    lockstep._results(answers)
    t7 = clock()
    totals += np.array([t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6])


def run_split(name: str, num_envs: int, steps: int) -> dict[str, float]:
    """µs per phase of the split's lockstep step, and per whole step."""
    with ClusterEnv([ENVS[name]] * num_envs, num_workers=1, learner_envs=num_envs // 2) as env:
        env.reset(seed=0)
        actions = np.zeros(num_envs, dtype=env.single_action_space.dtype)
        for _ in range(2_000):
            env.step(actions)
        totals, counted = np.zeros(len(PHASES)), 0
        started = time.perf_counter()
        for _ in range(steps):
            try:
                _timed_step(env, actions, totals)
                counted += 1
            except _Unusual:
                if env._call.state is not AsyncState.DEFAULT:
                    env.step_wait()
        whole = (time.perf_counter() - started) / steps * 1e6
    return {**dict(zip(PHASES, (totals / counted / 1000).tolist(), strict=True)), "step": whole}


def run_floor(name: str, num_envs: int, steps: int) -> dict[str, float]:
    """µs per step of the spinning floor, and of its own half inside its loop."""
    floor = SpinFloor([ENVS[name]] * num_envs)
    try:
        floor.reset(0)
        actions = np.zeros(num_envs, dtype=np.int64)
        own_step, own = floor._own.step, [0]

        def timed(batch: Any) -> Any:
            begun = time.perf_counter_ns()
            result = own_step(batch)
            own[0] += time.perf_counter_ns() - begun
            return result

        floor._own.step = timed
        for _ in range(2_000):
            floor.step(actions)
        own[0] = 0
        started = time.perf_counter()
        for _ in range(steps):
            floor.step(actions)
        whole = (time.perf_counter() - started) / steps * 1e6
    finally:
        floor.close()
    return {"own envs": own[0] / steps / 1000, "step": whole}


def main(args: Args) -> None:
    rounds, steps = (1, 2_000) if args.quick else (args.rounds, args.steps)
    runs: dict[str, dict[str, list[dict[str, float]]]] = {name: {"split": [], "floor": []} for name in args.envs}
    for _ in range(rounds):
        for name in args.envs:
            runs[name]["split"].append(run_split(name, args.num_envs, steps))
            runs[name]["floor"].append(run_floor(name, args.num_envs, steps))
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"`{command_line(__file__)}`, {date}, {os.cpu_count()} cores: µs per lockstep step of {args.num_envs} envs, "
        f"the learner stepping {args.num_envs // 2} and one worker the rest, medians of {rounds} alternated runs of "
        f"{steps:,} steps; the phases of clusterenv's step as the learner's clock sees them (`wait`: for the worker's "
        "words), the floor's own half timed inside its loop.",
        "",
        f"| env | backend | {' | '.join(PHASES)} | whole step |",
        "|---|---|" + "---:|" * (len(PHASES) + 1),
    ]
    for name, backends in runs.items():
        for backend, values in backends.items():
            cells = [
                f"{statistics.median(v[phase] for v in values):.1f}" if phase in values[0] else "—"
                for phase in (*PHASES, "step")
            ]
            lines.append(
                f"| {name} | {'clusterenv split' if backend == 'split' else 'spin_floor'} | {' | '.join(cells)} |"
            )
    text = "\n".join(lines) + "\n"
    write_report("split_phases", text)


if __name__ == "__main__":
    main(tyro.cli(Args))
