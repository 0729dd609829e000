"""First-ready batches against lockstep ``step`` of the same ClusterEnv: 64 CartPoles, local workers, one host.

Each cell is one ClusterEnv configuration (envs, workers, ``batch_size``), run two ways:
``lockstep`` (``reset``, then ``step`` over every env) and ``first_ready`` (``async_reset``,
then ``recv`` of the first ``batch_size`` ready envs and ``send`` of their actions, in a
loop: EnvPool's loop). ``sync`` (``SyncVectorEnv`` of the same envs) is the reference. Each
run is a fresh process that builds its backend, takes ``--warmup`` untimed batches, then
counts env steps for ``--seconds``; backends take turns, cell by cell, for ``--rounds``
rounds, and the medians are reported as env-steps/s. ``recv`` returns whole workers, so a
quarter of 64 envs is one batch of a worker's 16 on 4 workers (``cartpole_x64_w4``); on 2
workers the smallest batch is a half (``cartpole_x64_w2``), and on 8 workers a quarter is 2
of them (``cartpole_x64_w8``).

Before timing, each cell's first-ready loop is checked exact (every env's observations,
rewards and flags those of the same CartPole stepped alone with its seed and actions,
Gymnasium's ``NEXT_STEP`` autoreset) and the path its steps take is counted
(:class:`support.step_paths.PathCount`): whether ``send`` wrote its STEPs into the shared step
region or sent messages, and whether each reply ``recv`` took was the worker's words in the
region or a message.

    pip install -e ".[bench]"
    python benchmarks/first_ready.py             # every cell, 3 rounds of 3 s
    python benchmarks/first_ready.py --quick     # one round of 1 s, to try it

Writes ``results/first_ready.json`` and ``results/first_ready.md``.
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
from typing import Any

import tyro
from support.report import command_line, write_report

HERE = Path(__file__).resolve().parent
CORES = len(os.sched_getaffinity(0))

#: cell -> (Gymnasium id, number of envs, workers, batch_size).
CELLS: dict[str, tuple[str, int, int, int]] = {
    "cartpole_x64_w4": ("CartPole-v1", 64, 4, 16),
    "cartpole_x64_w2": ("CartPole-v1", 64, 2, 32),
    "cartpole_x64_w8": ("CartPole-v1", 64, 8, 16),
}
BACKENDS = ("sync", "lockstep", "first_ready")


@dataclasses.dataclass
class Args:
    cells: tuple[str, ...] = tuple(CELLS)
    """which cells to run"""
    backends: tuple[str, ...] = BACKENDS
    """backends, in the order each round runs them"""
    rounds: int = 3
    seconds: float = 3.0
    warmup: int = 50
    """untimed batches per run (first-ready: after the reset's batches)"""
    check_batches: int = 400
    """first-ready batches of the exactness and path check, per cell"""
    quick: bool = False
    """one round of 1 s, a shorter check: to try the script"""


# One run, in a fresh process: build the backend, warm up, count env steps, print a JSON line.
_RUN = r"""
import json, sys, time
import gymnasium as gym, numpy as np
from gymnasium.error import NoAsyncCallError
env, num_envs, workers, batch_size, backend, seconds, warmup = (
    {env!r}, {num_envs}, {workers}, {batch_size}, {backend!r}, {seconds}, {warmup}
)
fns = [lambda: gym.make(env)] * num_envs
if backend == "sync":
    envs = gym.vector.SyncVectorEnv(fns)
else:
    from clusterenv import ClusterEnv
    envs = ClusterEnv(fns, num_workers=workers, batch_size=batch_size if backend == "first_ready" else None)
    assert {{w["step_path"] for w in envs.worker_info}} == {{"shared memory"}}, envs.worker_info
actions = np.random.default_rng(0).integers(0, 2, (64, num_envs))
t = 0

def lockstep():
    global t
    envs.step(actions[t % 64])
    t += 1
    return num_envs

def first_ready():
    global t
    *_, env_ids = envs.recv()
    envs.send(actions[t % 64][env_ids], env_ids)
    t += 1
    return len(env_ids)

if backend == "first_ready":
    envs.async_reset(seed=0)
    for _ in range(num_envs // batch_size):  # the reset's observations, answered with a step
        first_ready()
    step = first_ready
else:
    envs.reset(seed=0)
    step = lockstep
for _ in range(warmup):
    step()
steps, batches, started = 0, 0, time.perf_counter()
while time.perf_counter() - started < seconds:
    steps += step()
    batches += 1
wall = time.perf_counter() - started
if backend == "first_ready":
    while True:  # take back what is still in flight before closing
        try:
            envs.recv()
        except NoAsyncCallError:
            break
envs.close()
print(json.dumps({{"rate": steps / wall, "batches_per_s": batches / wall}}))
"""


def run_once(cell: str, backend: str, args: Args) -> dict[str, float] | None:
    env, num_envs, workers, batch_size = CELLS[cell]
    code = _RUN.format(
        env=env,
        num_envs=num_envs,
        workers=workers,
        batch_size=batch_size,
        backend=backend,
        seconds=args.seconds,
        warmup=args.warmup,
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=HERE.parent, capture_output=True, text=True, timeout=300, check=False
    )
    if done.returncode != 0:
        print(f"{cell} {backend} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_first_ready(cell: str, batches: int) -> dict[str, Any]:
    """The cell's first-ready loop, exact against each env stepped alone; the path its steps took.

    Every env ``i`` is the same env reset with seed ``i`` and given the actions ``send`` gave it,
    its episodes restarting on the step after they end (``NEXT_STEP``), as ``recv`` promises.
    The counts are over every batch after the reset's.
    """
    sys.path.insert(0, str(HERE))
    import gymnasium as gym
    import numpy as np
    from gymnasium.error import NoAsyncCallError
    from support.step_paths import PathCount

    from clusterenv import ClusterEnv

    env, num_envs, workers, batch_size = CELLS[cell]
    singles = [gym.make(env) for _ in range(num_envs)]
    expected: list[tuple[Any, float, bool, bool]] = [
        (e.reset(seed=i)[0], 0.0, False, False) for i, e in enumerate(singles)
    ]
    envs = ClusterEnv([lambda: gym.make(env)] * num_envs, num_workers=workers, batch_size=batch_size)
    rng = np.random.default_rng(3)
    count: PathCount | None = None
    try:
        envs.async_reset(seed=0)
        for b in range(batches):
            if b == num_envs // batch_size:  # the reset's batches are over: every step from here is counted
                count = PathCount(envs)
            obs, rewards, terminations, truncations, _, env_ids = envs.recv()
            if count is not None:
                count.replied(env_ids)
            for j, i in enumerate(env_ids.tolist()):
                want = expected[i]
                got = (obs[j], rewards[j], terminations[j], truncations[j])
                assert all(np.array_equal(w, g) for w, g in zip(want, got, strict=True)), f"{cell}: env {i}"
            actions = rng.integers(0, 2, len(env_ids))
            envs.send(actions, env_ids)
            for j, i in enumerate(env_ids.tolist()):
                if expected[i][2] or expected[i][3]:  # NEXT_STEP: the step after an episode's end resets
                    expected[i] = (singles[i].reset()[0], 0.0, False, False)
                else:
                    expected[i] = singles[i].step(int(actions[j]))[:4]
        paths = count.close() if count is not None else {}
        while True:
            try:
                envs.recv()
            except NoAsyncCallError:
                break
    finally:
        envs.close()
        for e in singles:
            e.close()
    return {"exact_batches": batches, **paths}


def main(args: Args) -> None:
    if args.quick:
        args.rounds, args.seconds, args.check_batches = 1, 1.0, 100
    checks = {cell: check_first_ready(cell, args.check_batches) for cell in args.cells}
    runs: dict[str, dict[str, list[dict]]] = {cell: {b: [] for b in args.backends} for cell in args.cells}
    for _ in range(args.rounds):
        for cell in args.cells:
            for backend in args.backends:
                result = run_once(cell, backend, args)
                if result is not None:
                    runs[cell][backend].append(result)
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cells_out = {
        cell: {b: statistics.median(r["rate"] for r in rs) for b, rs in by.items() if rs} for cell, by in runs.items()
    }
    lines = [
        f"`{command_line(__file__)}`, {date}, {CORES} cores: env-steps/s, medians of {args.rounds} alternated runs "
        f"of {args.seconds:g} s per backend, each in a fresh process, after {args.warmup} untimed batches. "
        "`lockstep`: ClusterEnv's `step` over every env; `first_ready`: the same ClusterEnv with `batch_size`, "
        "`async_reset` then `recv` → `send(actions, env_ids)` in a loop; `sync`: `SyncVectorEnv`.",
        "",
        "| cell | envs | workers | batch_size | Sync | lockstep | first-ready | first-ready / lockstep "
        "| lockstep / Sync | first-ready / Sync |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cell, c in cells_out.items():
        _, num_envs, workers, batch_size = CELLS[cell]

        def ratio(a: str, b: str, c: dict = c) -> str:
            return f"{c[a] / c[b]:.2f}x" if c.get(a) and c.get(b) else "—"

        def rate(name: str, c: dict = c) -> str:
            return f"{c[name]:,.0f}" if c.get(name) else "—"

        lines.append(
            f"| {cell} | {num_envs} | {workers} | {batch_size} | {rate('sync')} | {rate('lockstep')} | "
            f"{rate('first_ready')} | {ratio('first_ready', 'lockstep')} | {ratio('lockstep', 'sync')} | "
            f"{ratio('first_ready', 'sync')} |"
        )
    lines += ["", "Each cell's first-ready loop, checked in this run before timing:", ""]
    for cell, check in checks.items():
        replies = ", ".join(f"{n} {s.replace('_', ' ')}" for s, n in sorted(check["worker_replies"].items()))
        commands = ", ".join(f"{n} {s}" for s, n in sorted(check["step_commands_encoded"].items()))
        if check["message_replies_carried"]:
            carried = ", ".join(f"{k.replace('_', ' ')}: {n}" for k, n in check["message_replies_carried"].items())
            replies += f" (the messages carried {carried})"
        lines.append(
            f"* {cell}: exact against each env stepped alone over {check['exact_batches']} batches; step path "
            f"{' / '.join(check['step_path'])}; after the reset's batches, `send`'s STEP commands: {commands}; the "
            f"replies `recv` took: {replies}; messages the learner sent: {check['messages_sent']}."
        )
    text = "\n".join(lines) + "\n"
    payload = {"date": date, "cores": CORES, "args": dataclasses.asdict(args), "checks": checks}
    write_report("first_ready", text, {**payload, "cells": cells_out, "runs": runs})


if __name__ == "__main__":
    main(tyro.cli(Args))
