"""Timing: the env's own step in this process, and the rows' env-steps/s in alternating rounds.

Rows take turns within each round (in a rotated order, so no row always follows the same
one), and each row's figure is the median of its rounds: on a shared machine a slow moment
then costs one sample of one row, not a whole row.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import gymnasium as gym

from clusterenv.bench.backends import Loop
from clusterenv.bench.candidates import Candidate

__all__ = ["WARMUP_SECONDS", "env_step_us", "measure"]

# Untimed stepping of each row before its first timed slice: caches, lazy imports, first episodes.
WARMUP_SECONDS = 0.2


def env_step_us(make: Callable[[], gym.Env], seconds: float, seed: int) -> float:
    """Microseconds per ``step`` of one env in this process, random actions, resets not counted."""
    env = make()
    try:
        env.reset(seed=seed)
        env.action_space.seed(seed)
        actions = [env.action_space.sample() for _ in range(64)]
        steps, busy = 0, 0.0
        deadline = time.perf_counter() + seconds
        while steps < 10 or time.perf_counter() < deadline:
            start = time.perf_counter()
            _, _, terminated, truncated, _ = env.step(actions[steps % 64])
            busy += time.perf_counter() - start
            steps += 1
            if terminated or truncated:
                env.reset()
        return busy / steps * 1e6
    finally:
        env.close()


def _timed(loop: Loop, seconds: float) -> float:
    """Env steps per second of ``loop`` over at least ``seconds`` (and at least one call)."""
    steps = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        steps += loop.step()
        now = time.perf_counter()
        if now >= deadline:
            return steps / (now - start)


def measure(
    rows: Sequence[Candidate],
    seconds: float,
    rounds: int,
    progress: Callable[[str], None],
) -> dict[str, float]:
    """Median env-steps/s of each row (by label), ``seconds`` of timed stepping shared by all rows and rounds.

    Every row is started first and kept until the end, so that rounds compare warm backends.
    """
    loops: dict[str, Loop] = {}
    samples: dict[str, list[float]] = {row.label: [] for row in rows}
    slice_s = seconds / (rounds * len(rows))
    try:
        for row in rows:
            progress(f"starting {row.label}")
            loops[row.label] = loop = row.start()
            _timed(loop, WARMUP_SECONDS)
        for r in range(rounds):
            order = [*rows[r % len(rows) :], *rows[: r % len(rows)]]
            for row in order:
                rate = _timed(loops[row.label], slice_s)
                samples[row.label].append(rate)
                progress(f"round {r + 1}/{rounds}: {row.label}: {rate:,.0f} env-steps/s")
    finally:
        for loop in loops.values():
            loop.close()
    return {label: statistics.median(values) for label, values in samples.items()}
