"""Env-steps per second of SyncVectorEnv, AsyncVectorEnv, EnvPool and ClusterEnv, in one run.

Three workloads: CartPole-v1 (a step of a few microseconds, so transport dominates), an
Atari game from ale-py (raw 210x160x3 uint8 frames, ~100 KB per env per step) and a
synthetic env whose step burns a fixed amount of CPU. Every backend gets the same
random actions; warm-up steps are not timed; each cell runs for a fixed time.

    python benchmarks/throughput.py            # the full table, a few minutes on 2 cores
    python benchmarks/throughput.py --quick    # a smoke run, well under a minute

Writes ``results/throughput.md`` (the table, the command and the machine) and
``results/throughput.png`` (bars per workload) next to this file, and prints the table.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import tyro
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # workers import support.bench_envs from here
from support.bench_envs import BurnEnv, make_atari  # noqa: E402
from support.report import command_line  # noqa: E402

from clusterenv import ClusterEnv  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclasses.dataclass
class Args:
    quick: bool = False
    """smoke run: fewer configurations and 1 s cells"""
    seconds: float = 3.0
    """timed seconds per cell (``--quick``: 1)"""
    warmup_steps: int = 20
    """batch steps before timing starts (worker start-up, caches, first-step checks)"""
    repeats: int = 1
    """timed runs per cell; the median is reported (use 3 on a noisy machine)"""
    workloads: tuple[str, ...] = ("cartpole", "atari", "burn")
    """which workloads to run"""
    backends: tuple[str, ...] = ("sync", "async", "envpool", "cluster")
    """which backends to run (sync always runs: it is the reference for the ratios)"""
    atari_id: str = "ALE/Pong-v5"
    """ale-py env id; EnvPool runs the same game (``Pong-v5``/``Breakout-v5``)"""
    burn_ms: float = 1.0
    """CPU milliseconds burned by each step of the synthetic env"""
    seed: int = 0
    """seed of the envs and of the action sequence"""
    out_dir: Path = RESULTS_DIR
    """where the markdown table and the plot go"""


@dataclasses.dataclass(frozen=True)
class Workload:
    """One env family and the vector sizes to run it at."""

    name: str
    label: str
    make: Callable[[], gym.Env]
    num_envs: tuple[int, ...]
    cluster_workers: tuple[int, ...]
    envpool_id: str | None = None
    envpool_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    envpool_note: str = ""


@dataclasses.dataclass
class Cell:
    """One measured (workload, num_envs, backend) combination."""

    workload: str
    num_envs: int
    backend: str
    workers: int | None
    steps_per_s: float | None = None
    ratio: float | None = None
    note: str = ""


def workloads(args: Args) -> list[Workload]:
    quick = args.quick
    game = args.atari_id.split("/")[-1]
    return [
        Workload(
            "cartpole",
            "CartPole-v1",
            functools.partial(gym.make, "CartPole-v1"),
            num_envs=(16,),
            cluster_workers=(1, 2),
            envpool_id="CartPole-v1",
        ),
        Workload(
            "atari",
            f"{args.atari_id} (210x160x3 uint8)",
            functools.partial(make_atari, args.atari_id),
            num_envs=(8,) if quick else (8, 16),
            cluster_workers=(2,),
            envpool_id=game,
            # As close to raw ALE v5 as EnvPool goes: full-size RGB, no stacking, no resets on
            # life loss, sticky actions 0.25, frameskip 4, at most one no-op at reset.
            envpool_kwargs=dict(
                img_height=210,
                img_width=160,
                gray_scale=False,
                stack_num=1,
                frame_skip=4,
                noop_max=1,
                episodic_life=False,
                reward_clip=False,
                use_fire_reset=False,
                repeat_action_probability=0.25,
                max_episode_steps=27000,
            ),
            envpool_note="EnvPool: channel-first (3,210,160) frames max-pooled over the last 2 of each frameskip",
        ),
        Workload(
            "burn",
            f"BurnEnv ({args.burn_ms:g} ms CPU per step)",
            functools.partial(BurnEnv, step_cpu_ms=args.burn_ms),
            num_envs=(8,) if quick else (8, 16),
            cluster_workers=(2,),
        ),
    ]


def make_backend(workload: Workload, backend: str, num_envs: int, workers: int | None, seed: int) -> Any:
    env_fns = [workload.make] * num_envs
    if backend == "sync":
        return gym.vector.SyncVectorEnv(env_fns)
    if backend == "async":
        return gym.vector.AsyncVectorEnv(env_fns, shared_memory=True)
    if backend == "cluster":
        return ClusterEnv(env_fns, num_workers=workers)
    if backend == "envpool":
        import envpool

        assert workload.envpool_id is not None
        return envpool.make_gymnasium(
            workload.envpool_id,
            num_envs=num_envs,
            batch_size=num_envs,
            num_threads=CORES,
            seed=seed,
            **workload.envpool_kwargs,
        )
    raise ValueError(f"Unknown backend {backend!r}; expected sync, async, envpool or cluster.")


def measure(envs: Any, backend: str, actions: np.ndarray, args: Args, seconds: float) -> float:
    """Env-steps per second over ``seconds`` after ``args.warmup_steps`` untimed batch steps."""
    if backend == "envpool":
        envs.reset()  # EnvPool seeds at construction
    else:
        envs.reset(seed=args.seed)
    num_envs = actions.shape[1]
    for i in range(args.warmup_steps):
        envs.step(actions[i % len(actions)])
    steps, start = 0, time.perf_counter()
    while True:
        envs.step(actions[(args.warmup_steps + steps) % len(actions)])
        steps += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return steps * num_envs / elapsed


def plan(args: Args, loads: list[Workload]) -> list[tuple[Workload, Cell]]:
    cells = []
    for load in loads:
        if load.name not in args.workloads:
            continue
        for n in load.num_envs:
            cells.append((load, Cell(load.name, n, "sync", None)))
            if "async" in args.backends:
                cells.append((load, Cell(load.name, n, "async", n)))
            if "envpool" in args.backends and load.envpool_id is not None:
                cells.append((load, Cell(load.name, n, "envpool", CORES, note=load.envpool_note)))
            if "cluster" in args.backends:
                cells.extend((load, Cell(load.name, n, "cluster", w)) for w in load.cluster_workers if w <= n)
    return cells


BACKEND_LABELS = {
    "sync": "SyncVectorEnv",
    "async": "AsyncVectorEnv(shared_memory=True)",
    "envpool": "EnvPool",
    "cluster": "ClusterEnv",
}


def run(args: Args) -> list[Cell]:
    seconds = 1.0 if args.quick and args.seconds == Args.seconds else args.seconds
    loads = workloads(args)
    cells = plan(args, loads)
    action_counts = {load.name: load.make().action_space.n for load in loads if load.name in args.workloads}
    rng = np.random.default_rng(args.seed)
    actions = {
        (load.name, n): rng.integers(0, action_counts[load.name], size=(256, n))
        for load in loads
        if load.name in args.workloads
        for n in load.num_envs
    }
    for load, cell in tqdm(cells, desc="throughput", unit="cell"):
        label = f"{load.name} x{cell.num_envs} {cell.backend}" + (f" w={cell.workers}" if cell.workers else "")
        tqdm.write(f"running {label}")
        try:
            envs = make_backend(load, cell.backend, cell.num_envs, cell.workers, args.seed)
        except ImportError as exc:
            cell.note = f"not run: {exc}"
            continue
        try:
            rates = [
                measure(envs, cell.backend, actions[(load.name, cell.num_envs)], args, seconds)
                for _ in range(args.repeats)
            ]
        finally:
            envs.close()
        cell.steps_per_s = statistics.median(rates)
    reference = {(c.workload, c.num_envs): c.steps_per_s for _, c in cells if c.backend == "sync"}
    for _, cell in cells:
        ref = reference.get((cell.workload, cell.num_envs))
        if cell.steps_per_s is not None and ref:
            cell.ratio = cell.steps_per_s / ref
    return [cell for _, cell in cells]


def table(cells: list[Cell], loads: dict[str, Workload]) -> str:
    rows = [
        "| workload | envs | backend | workers | steps/s | × Sync | notes |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    for c in cells:
        rate = "n/a" if c.steps_per_s is None else f"{c.steps_per_s:,.0f}"
        ratio = "" if c.ratio is None else f"{c.ratio:.2f}"
        workers = "" if c.workers is None else str(c.workers)
        if c.backend == "envpool":
            workers = f"{c.workers} threads"
        elif c.backend == "async":
            workers = f"{c.workers} procs"
        rows.append(
            f"| {loads[c.workload].label} | {c.num_envs} | {BACKEND_LABELS[c.backend]} | {workers} "
            f"| {rate} | {ratio} | {c.note} |"
        )
    return "\n".join(rows)


def plot(cells: list[Cell], loads: dict[str, Workload], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[str, int], list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.workload, c.num_envs), []).append(c)
    colors = {"sync": "#888888", "async": "#d9a441", "envpool": "#5b8bd0", "cluster": "#3a9d5d"}
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups), 3.8), squeeze=False)
    for ax, ((name, n), group) in zip(axes[0], groups.items(), strict=True):
        labels = [c.backend + (f"\nw={c.workers}" if c.backend == "cluster" else "") for c in group]
        values = [c.steps_per_s or 0.0 for c in group]
        bars = ax.bar(range(len(group)), values, color=[colors[c.backend] for c in group])
        for bar, c in zip(bars, group, strict=True):
            if c.ratio is not None:
                ax.annotate(
                    f"{c.ratio:.2f}x",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        ax.set_xticks(range(len(group)), labels, fontsize=8)
        ax.set_title(f"{loads[name].label.split(' (')[0]}, {n} envs", fontsize=9)
        ax.set_ylabel("env steps / s")
        ax.margins(y=0.15)
    fig.suptitle(f"Throughput on {CORES} cores (ratios to SyncVectorEnv)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def versions() -> str:
    import zmq

    parts = [f"python {platform.python_version()}", f"gymnasium {gym.__version__}", f"pyzmq {zmq.__version__}"]
    try:
        import envpool

        parts.append(f"envpool {envpool.__version__}")
    except ImportError:
        pass
    return ", ".join(parts)


def main(args: Args) -> None:
    cells = run(args)
    loads = {load.name: load for load in workloads(args)}
    text = table(cells, loads)
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    command = command_line(__file__)
    machine = f"{CORES} cores ({platform.processor() or platform.machine()}), {platform.system()}; {versions()}"
    (args.out_dir / "throughput.md").write_text(
        f"{text}\n\nCommand: `{command}`  \nMachine: {machine}  \n"
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n"
    )
    (args.out_dir / "throughput.json").write_text(json.dumps([dataclasses.asdict(c) for c in cells], indent=1))
    plot(cells, loads, args.out_dir / "throughput.png")
    print(f"\nWrote {args.out_dir / 'throughput.md'} and {args.out_dir / 'throughput.png'}")


if __name__ == "__main__":
    main(tyro.cli(Args))
