"""Wall-clock to train `examples/ppo_cartpole.py` (or `dqn_cartpole.py`) with each backend, alternated, over seeds.

Every run is the example itself in a subprocess (its own start-up included), with the same
seed and budget; the configurations take turns seed by seed, so a noisy machine slows them
alike. Two times are reported: the whole process, and its training loop (what the example
prints as "N episodes in X s", from its first reset to its last step). The return is the mean
over the last 100 training episodes (``episodes.csv``).

    python benchmarks/ppo_wallclock.py                  # 5 configurations x 5 seeds, ~15 min on 2 cores
    python benchmarks/ppo_wallclock.py --seeds 1 --total-timesteps 20000   # a smoke run
    python benchmarks/ppo_wallclock.py --example dqn_cartpole.py --configs gym clusterenv --total-timesteps 20000

Writes ``results/ppo_wallclock.md`` and ``.json``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tyro
from support.report import command_line, machine

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
CONFIGS = {
    "gym": ["--backend", "gym"],
    # The learner picks the actions (the example as it stands), with clusterenv's defaults, then with the learner
    # stepping half of the 8 envs itself beside one worker (the drop-in guide's advice for cheap envs), spinning
    # by default and never.
    "clusterenv": [],
    "clusterenv --num-workers 1 --learner-envs 4": ["--num-workers", "1", "--learner-envs", "4"],
    "clusterenv --num-workers 1 --learner-envs 4 --spin-us 0": [
        "--num-workers",
        "1",
        "--learner-envs",
        "4",
        "--spin-us",
        "0",
    ],
    "clusterenv --local-policy": ["--local-policy"],
    "clusterenv --local-policy --prefetch 1": ["--local-policy", "--prefetch", "1"],
    "clusterenv --local-policy --prefetch 2": ["--local-policy", "--prefetch", "2"],
    # With prefetch the learner trains while the workers collect: one worker fewer than cores leaves it one.
    "clusterenv --local-policy --prefetch 1 --num-workers 1": [
        "--local-policy",
        "--prefetch",
        "1",
        "--num-workers",
        "1",
    ],
}


@dataclasses.dataclass
class Args:
    seeds: tuple[int, ...] = (1, 2, 3, 4, 5)
    """one run per seed and configuration"""
    configs: tuple[str, ...] = tuple(CONFIGS)
    """which configurations (names as in the table, or ``"clusterenv FLAGS..."`` for the example's flags)"""
    total_timesteps: int = 300_000
    """env steps per run (the example's default)"""
    name: str = "ppo_wallclock"
    """the results' file name in results/ (``NAME.md``, ``NAME.json``)"""
    example: str = "ppo_cartpole.py"
    """the example to run, in examples/ (``ppo_cartpole.py`` or ``dqn_cartpole.py``)"""


def flags_of(name: str) -> list[str]:
    """The example's flags for a configuration: a name of :data:`CONFIGS`, or ``clusterenv`` and its flags."""
    if name in CONFIGS:
        return CONFIGS[name]
    backend, *flags = name.split()
    if backend != "clusterenv":
        raise SystemExit(f"error: configuration {name!r}: expected one of {list(CONFIGS)}, or 'clusterenv FLAGS...'")
    return flags


#: What the examples print last: "... N episodes in X s; ...", X the training loop's time.
_TRAINED = re.compile(r"episodes in ([0-9.]+) s")


def run(example: str, flags: list[str], seed: int, total_timesteps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as runs:
        command = [sys.executable, example, "--seed", str(seed), "--runs-dir", runs, *flags]
        command += ["--total-timesteps", str(total_timesteps)]
        started = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT / "examples", check=True, capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - started
        trained = _TRAINED.findall(done.stdout)
        (csv_path,) = Path(runs).glob("*/episodes.csv")
        with open(csv_path) as f:
            returns = [float(row["episodic_return"]) for row in csv.DictReader(f)]
    last = returns[-100:]
    return {"wall_s": wall, "train_s": float(trained[-1]), "final_return": sum(last) / len(last)}


def main(args: Args) -> None:
    results: dict[str, list[dict[str, float]]] = {name: [] for name in args.configs}
    for seed in args.seeds:
        for name in args.configs:
            outcome = run(args.example, flags_of(name), seed, args.total_timesteps)
            results[name].append({"seed": seed, **outcome})
            print(
                f"seed {seed} {name}: {outcome['wall_s']:.1f} s ({outcome['train_s']:.1f} s training), "
                f"return {outcome['final_return']:.1f}",
                flush=True,
            )
    base = (
        {key: statistics.median(r[key] for r in results["gym"]) for key in ("wall_s", "train_s")}
        if "gym" in results
        else None
    )
    command = command_line(__file__)
    lines = [
        f"`{command}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} (finished) — `examples/{args.example}`'s "
        f"defaults, {args.total_timesteps:,} steps, seeds {list(args.seeds)}, configurations alternated; {machine()}, "
        f"Python {platform.python_version()}.",
        "",
        "| configuration | median wall-clock | speed-up vs gym | median training loop | speed-up vs gym | mean return, "
        "last 100 episodes (per seed) | ≥ 475 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        wall, train = (statistics.median(r[key] for r in runs) for key in ("wall_s", "train_s"))
        finals = [r["final_return"] for r in runs]
        speedup = f"{base['wall_s'] / wall:.2f}x" if base else "n/a"
        train_speedup = f"{base['train_s'] / train:.2f}x" if base else "n/a"
        per_seed = ", ".join(f"{f:.0f}" for f in finals)
        solved = sum(f >= 475 for f in finals)
        lines.append(
            f"| {name} | {wall:.1f} s | {speedup} | {train:.1f} s | {train_speedup} | {per_seed} | {solved}/{len(finals)} |"
        )
    table = "\n".join(lines)
    print(table)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{args.name}.md").write_text(table + "\n")
    (RESULTS_DIR / f"{args.name}.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args)))
