"""Where the learner's time goes in one lockstep batch step, by part of the code.

Runs ``ClusterEnv.step`` on one workload twice: unprofiled, for the learner process's CPU
(``time.process_time()``, all its threads) and wall time per batch step, then under
cProfile, for the split of the learner thread's own time between the parts below
(cProfile's overhead inflates every part alike; the shares are what it is for).
Waiting for replies is blocking time, not CPU: it is reported apart.

    python benchmarks/probes/profile_step.py --workload pong --num-envs 16     # the Atari cell
    python benchmarks/probes/profile_step.py --workload sleep --num-envs 16    # the learner-CPU cell

Prints a markdown table. ``PYTHONPATH=<another checkout>`` profiles another version of clusterenv.
"""

from __future__ import annotations

import cProfile
import dataclasses
import functools
import pstats
import sys
import time
from pathlib import Path
from typing import Literal

import gymnasium as gym
import numpy as np
import tyro

# This folder, then benchmarks/ (support.bench_envs, support.report): the workers inherit the path.
sys.path[:0] = [str(folder) for folder in Path(__file__).resolve().parents[:2]]
from support.bench_envs import SleepEnv  # noqa: E402
from support.report import command_line  # noqa: E402

import clusterenv  # noqa: E402
from clusterenv import ClusterEnv  # noqa: E402

# (part, test on "file:function"), first match wins.
PARTS: list[tuple[str, tuple[str, ...]]] = [
    ("waiting for replies (blocking, not CPU)", ("carriers.py:recv", "carriers.py:take", "pipes.py:recv")),
    ("ZeroMQ send", ("socket.py:send",)),
    (
        "framing, MACs, msgpack",
        ("protocol.py:", "hmac.py:", "msgpack", "_hashlib", "blake3", "messages.py:", "codecs.py:"),
    ),
    ("infos (unpickle, merge)", ("infos.py:", "leaves.py:replay", "_pickle.loads", "vector_env.py:_add_info")),
    ("copy=True observation copy", ("method 'copy' of 'numpy.ndarray'", "step_buffers.py:observation_batch")),
    ("action checks", ("validation.py:",)),
]


@dataclasses.dataclass
class Args:
    workload: Literal["pong", "sleep"] = "pong"
    """pong: ALE/Pong-v5 raw frames; sleep: SleepEnv (20 ms, no CPU), one per worker"""
    num_envs: int = 16
    num_workers: int = 2
    """workers (sleep: one env each, so num_envs)"""
    steps: int = 400
    """timed batch steps per pass, after 50 untimed ones"""


def part_of(key: tuple[str, int, str]) -> str:
    filename, _, function = key
    name = f"{Path(filename).name}:{function}" if filename != "~" else function
    for part, patterns in PARTS:
        if any(pattern in name for pattern in patterns):
            return part
    return "other learner Python (ClusterEnv, pool, buffers)"


def main(args: Args) -> None:
    if args.workload == "pong":
        import ale_py

        gym.register_envs(ale_py)
        factory = functools.partial(gym.make, "ALE/Pong-v5")
        workers = args.num_workers
    else:
        factory = functools.partial(SleepEnv, 20.0)
        workers = args.num_envs
    envs = ClusterEnv([factory] * args.num_envs, num_workers=workers)
    try:
        envs.reset(seed=0)
        rng = np.random.default_rng(0)
        actions = [envs.action_space.sample() if args.workload == "sleep" else rng.integers(0, 6, args.num_envs)]
        for _ in range(50):
            envs.step(actions[0])
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            envs.step(actions[0])
        wall, cpu = (time.perf_counter() - wall) / args.steps, (time.process_time() - cpu) / args.steps
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.steps):
            envs.step(actions[0])
        profile.disable()
    finally:
        envs.close()
    totals: dict[str, float] = {}
    for key, (_, _, own, _, _) in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        totals[part_of(key)] = totals.get(part_of(key), 0.0) + own
    busy = sum(seconds for part, seconds in totals.items() if not part.startswith("waiting"))
    print(
        f"`{command_line(__file__)}` — clusterenv {clusterenv.__file__}; "
        f"{args.workload}, {args.num_envs} envs, {workers} workers: learner process CPU {cpu * 1e6:,.0f} µs and "
        f"wall {wall * 1e6:,.0f} µs per batch step (unprofiled)\n"
    )
    print("| part of the learner thread (cProfile) | µs per step | share of busy time |")
    print("|---|---:|---:|")
    for part, seconds in sorted(totals.items(), key=lambda item: -item[1]):
        share = "" if part.startswith("waiting") else f"{seconds / busy:.0%}"
        print(f"| {part} | {seconds / args.steps * 1e6:,.0f} | {share} |")


if __name__ == "__main__":
    main(tyro.cli(Args))
