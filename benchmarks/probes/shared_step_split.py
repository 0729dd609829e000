"""Where the learner's CPU per step goes on the shared step path: the signal alone, the pool, the whole ``step``.

One ClusterEnv (16 null envs or CartPoles on 2 workers) is stepped three ways in the same
process, against the same workers, alternated for ``--rounds`` rounds:

- ``signal``: the actions written into the region and each worker's command words (a wake-up
  byte to a worker that sleeps), then each worker's reply words waited for (spinning, then a
  blocking read of its wake socket): what any design of this shape pays;
- ``pool``: ``WorkerPool.send_shared`` and ``gather`` (the above plus the pool's bookkeeping:
  the commands kept for recovery and interrupts, reply checks, latencies, the receive loop);
- ``step``: ``ClusterEnv.step`` (the above plus the VectorEnv's: validating the actions,
  call state, collecting the batch, the copies it returns).

It reaches into private attributes to time the layers apart: a benchmark, not an API.

    python benchmarks/probes/shared_step_split.py

Writes ``results/shared_step_split.md``.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import gymnasium as gym
import numpy as np
import tyro

# This folder, then benchmarks/ (support.bench_envs, support.report): the workers inherit the path.
sys.path[:0] = [str(folder) for folder in Path(__file__).resolve().parents[:2]]
from support.bench_envs import NullEnv  # noqa: E402
from support.report import command_line, write_report  # noqa: E402

from clusterenv import ClusterEnv  # noqa: E402
from clusterenv.learner.shared_steps import NOT_YET  # noqa: E402


@dataclasses.dataclass
class Args:
    rounds: int = 5
    steps: int = 3000


def measure(name: str, factory: Callable[[], gym.Env], args: Args) -> str:
    """The table row of one env: the three layers' learner CPU per step, alternated."""
    with ClusterEnv([factory] * 16, num_workers=2) as envs:
        pool = envs._pool
        path = pool.step_path
        assert path is not None and path.everyone
        actions = np.zeros(16, np.int64)
        envs.reset(seed=0)
        for _ in range(200):
            envs.step(actions)

        def signal(steps: int) -> None:
            for _ in range(steps):
                path.write_actions([actions])
                path.command_all(pool.seq)
                for w in range(2):
                    reply = path.await_reply(w, 10.0)
                    while reply is NOT_YET:
                        reply = path.await_reply(w, 10.0)
                    if reply is None:  # its reply is a message (a usage report, once a second)
                        pool._await({w}, {}, "stepping", 10.0)
                    else:
                        path.taken(w, reply)

        def pooled(steps: int) -> None:
            for _ in range(steps):
                pool.send_shared([actions])
                pool.gather(range(2), "stepping", 10.0)

        def stepped(steps: int) -> None:
            for _ in range(steps):
                envs.step(actions)

        cpu: dict[str, list[float]] = {"signal": [], "pool": [], "step": []}
        wall: list[float] = []
        for _ in range(args.rounds):
            for label, run in (("signal", signal), ("pool", pooled), ("step", stepped)):
                started, cpu_started = time.perf_counter(), time.process_time()
                run(args.steps)
                cpu[label].append((time.process_time() - cpu_started) / args.steps * 1e6)
                if label == "step":
                    wall.append((time.perf_counter() - started) / args.steps * 1e6)
    medians = {label: statistics.median(values) for label, values in cpu.items()}
    return (
        f"| {name} | {medians['signal']:.1f} | {medians['pool']:.1f} | {medians['step']:.1f} "
        f"| {statistics.median(wall):.1f} |"
    )


def main(args: Args) -> None:
    lines = [
        f"`{command_line(__file__)}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores: "
        f"the learner's CPU per batch step (µs), 16 envs on 2 workers, medians of {args.rounds} alternated rounds "
        f"of {args.steps:,} steps.",
        "",
        "| env | signal only | + the pool | + ClusterEnv.step | wall per step of the whole `step` (µs) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, factory in (("null env", NullEnv), ("CartPole-v1", lambda: gym.make("CartPole-v1"))):
        lines.append(measure(name, factory, args))
    text = "\n".join(lines) + "\n"
    write_report("shared_step_split", text)


if __name__ == "__main__":
    main(tyro.cli(Args))
