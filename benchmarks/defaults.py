"""What a user who swaps one line gets: ``ClusterEnv(env_fns)`` with no layout argument, against Sync and EnvPool.

Each cell steps its envs in lockstep (``step()`` with random actions drawn beforehand: the
learner picks the actions) for ``--seconds`` per backend, in a fresh process per run; the
backends take turns, cell by cell, for ``--rounds`` rounds, and the medians are reported as
ratios to ``SyncVectorEnv`` measured in the same run. Backends:

- ``sync``: ``gymnasium.vector.SyncVectorEnv``;
- ``defaults``: ``ClusterEnv(env_fns)``, the default layout (its ``repr`` is reported);
- ``workers``: ``ClusterEnv(env_fns, num_workers=cores)``, every env in a worker, one per core;
- ``one_worker``: ``ClusterEnv(env_fns, num_workers=1)``;
- ``split``: ``ClusterEnv(env_fns, num_workers=1, learner_envs=n // 2)``;
- ``envpool``: EnvPool with a thread per core, where it has the env (CartPole, HalfCheetah, Pong).

    python benchmarks/defaults.py                # every cell, 3 rounds of 2 s
    python benchmarks/defaults.py --quick        # one round of 0.5 s, to try it

Writes ``results/defaults.md`` and ``results/defaults.json``.
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
from onehost import ENVPOOL  # the sibling benchmark: EnvPool's ids and options for each env
from support.report import command_line, machine, write_report

HERE = Path(__file__).resolve().parent
CORES = len(os.sched_getaffinity(0))

#: cell -> (env, number of envs); env is a Gymnasium id, or a support.bench_envs class with its step cost.
CELLS: dict[str, tuple[str, int]] = {
    "CartPole x16": ("CartPole-v1", 16),
    "CartPole x64": ("CartPole-v1", 64),
    "50 µs env x16": ("BurnEnv:0.05", 16),
    "1 ms env x16": ("BurnEnv:1.0", 16),
    "HalfCheetah-v5 x16": ("HalfCheetah-v5", 16),
    "Pong x16 (raw ALE v5)": ("ALE/Pong-v5", 16),
    "null env x16": ("NullEnv", 16),
}
BACKENDS = ("sync", "defaults", "workers", "one_worker", "envpool")


@dataclasses.dataclass
class Args:
    cells: tuple[str, ...] = tuple(CELLS)
    """which cells to run"""
    backends: tuple[str, ...] = BACKENDS
    """backends, in the order each round runs them"""
    rounds: int = 3
    seconds: float = 2.0
    quick: bool = False
    """one round of 0.5 s: to try the script"""


# One run, in a fresh process: build the backend, warm up, time lockstep steps, print a JSON line.
_RUN = r"""
import json, sys, time
sys.path.insert(0, {benchmarks!r})
import gymnasium as gym, numpy as np
env, num_envs, backend, seconds, cores = {env!r}, {num_envs}, {backend!r}, {seconds}, {cores}

def factory():
    if env.startswith("BurnEnv:"):
        from support.bench_envs import BurnEnv
        step_ms = float(env.split(":")[1])
        return lambda: BurnEnv(step_cpu_ms=step_ms)
    if env == "NullEnv":
        from support.bench_envs import NullEnv
        return NullEnv
    if env.startswith("ALE/"):
        from support.bench_envs import make_atari
        return lambda: make_atari(env)
    return lambda: gym.make(env)

layouts = {{"defaults": {{}}, "workers": {{"num_workers": cores}}, "one_worker": {{"num_workers": 1}},
           "split": {{"num_workers": 1, "learner_envs": num_envs // 2}}}}
described = backend
if backend == "sync":
    envs = gym.vector.SyncVectorEnv([factory()] * num_envs)
elif backend == "envpool":
    import envpool
    envpool_id, options = {envpool!r}
    envs = envpool.make_gymnasium(envpool_id, num_envs=num_envs, num_threads=cores, seed=0, **options)
else:
    from clusterenv import ClusterEnv
    envs = ClusterEnv([factory()] * num_envs, **layouts[backend])
    described = repr(envs)
single = envs.single_action_space
single.seed(0)
actions = [np.stack([single.sample() for _ in range(num_envs)]) for _ in range(64)]
envs.reset() if backend == "envpool" else envs.reset(seed=0)  # EnvPool is seeded when made
for i in range(100):
    envs.step(actions[i % 64])
steps, started = 0, time.perf_counter()
while time.perf_counter() - started < seconds:
    envs.step(actions[steps % 64])
    steps += 1
rate = steps * num_envs / (time.perf_counter() - started)
envs.close()
print(json.dumps({{"env_steps_per_s": rate, "described": described}}))
"""


def run_once(cell: str, backend: str, seconds: float) -> dict | None:
    """One timed run; ``None`` where the backend has no such env (EnvPool)."""
    env, num_envs = CELLS[cell]
    envpool = ENVPOOL.get(env)
    if backend == "envpool" and envpool is None:
        return None
    code = _RUN.format(
        benchmarks=str(HERE), env=env, num_envs=num_envs, backend=backend, seconds=seconds, cores=CORES, envpool=envpool
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(args: Args) -> None:
    rounds, seconds = (1, 0.5) if args.quick else (args.rounds, args.seconds)
    runs: dict[str, dict[str, list[float]]] = {cell: {b: [] for b in args.backends} for cell in args.cells}
    described: dict[str, dict[str, str]] = {cell: {} for cell in args.cells}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for _ in range(rounds):
        for cell in args.cells:
            for backend in args.backends:
                result = run_once(cell, backend, seconds)
                if result is not None:
                    runs[cell][backend].append(result["env_steps_per_s"])
                    described[cell][backend] = result["described"]
    medians = {cell: {b: statistics.median(v) for b, v in by.items() if v} for cell, by in runs.items()}
    shown = [b for b in args.backends if b != "sync"]
    lines = [
        f"`{command_line(__file__)}`, started {started}, on {machine()}: lockstep `step()` with random actions drawn beforehand, "
        f"env-steps/s as a ratio to `SyncVectorEnv` in the same run, medians of {rounds} alternated runs of "
        f"{seconds:g} s each in a fresh process.",
        "",
        "| cell | Sync env-steps/s | " + " | ".join(_HEADINGS[b] for b in shown) + " |",
        "|---|---:|" + "---:|" * len(shown),
    ]
    for cell, by in medians.items():
        sync = by["sync"]
        ratios = [f"{by[b] / sync:.2f}x" if b in by else "" for b in shown]
        lines.append(f"| {cell} | {sync:,.0f} | " + " | ".join(ratios) + " |")
    lines += ["", "What the defaults chose, per cell:", ""]
    lines += [f"- {cell}: `{described[cell].get('defaults', '')}`" for cell in args.cells]
    text = "\n".join(lines) + "\n"
    write_report("defaults", text, {"started": started, "args": dataclasses.asdict(args), "runs": runs})


_HEADINGS = {
    "defaults": "defaults",
    "workers": f"`num_workers={CORES}`",
    "one_worker": "`num_workers=1`",
    "split": "`num_workers=1, learner_envs=n//2`",
    "envpool": f"EnvPool ({CORES} threads)",
}


if __name__ == "__main__":
    main(tyro.cli(Args))
