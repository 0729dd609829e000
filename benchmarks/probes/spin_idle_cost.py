"""What spinning costs each side of the shared step path per step, when steps come 4 ms apart and when they do not.

A training loop steps its envs, then computes (a policy's forward pass, logging, a learning
update) before it steps again. The learner spins for its workers' replies, and each worker
for its next command, before they block (``spin_us``, adapted by default): while steps come
faster than the cap (1 ms) the spin catches them, and when they come further apart it must
cost next to nothing. Here 16 CartPoles are stepped by ``num_workers=1, learner_envs=8`` and
by ``num_workers=1``, with ``--gap-ms`` of work between steps (a sleep, or ``--busy``: the
learner's own thread computing) and with none, for a few seconds per case, spinning (the
default) and blocking (``spin_us=0``), alternated.

Per step: the learner's CPU (its main thread, ``time.thread_time``, less the gap's own CPU)
and the worker's (every thread of its process, from ``/proc/<pid>/task/*/schedstat``, in ns;
``/proc/<pid>/stat``'s clock ticks where there is no schedstat). What spinning costs is the
spinning run's CPU less the blocking run's: a blocked wait has its own cost (the system calls
and the wake-up), which the spin saves.

    python benchmarks/probes/spin_idle_cost.py                # 2 s per case, 8 cases
    python benchmarks/probes/spin_idle_cost.py --busy         # the gap computes instead of sleeping
    python benchmarks/probes/spin_idle_cost.py --seconds 0.5  # to try it

Writes ``results/spin_idle_cost.md`` and ``results/spin_idle_cost.json``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.report import command_line, machine, write_report  # noqa: E402  (benchmarks/support/report.py)

from clusterenv import ClusterEnv  # noqa: E402

NUM_ENVS = 16
LAYOUTS = {"num_workers=1, learner_envs=8": {"num_workers": 1, "learner_envs": 8}, "num_workers=1": {"num_workers": 1}}


@dataclasses.dataclass
class Args:
    seconds: float = 2.0
    """timed seconds per case (after a warm-up of a tenth of that)"""
    gap_ms: float = 4.0
    """the work between two steps, in ms (the cases with no gap are always run too)"""
    busy: bool = False
    """the gap computes on the learner's thread instead of sleeping"""


def worker_cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has used so far, all its threads (nanoseconds; clock ticks without schedstat)."""
    total_ns, read = 0, False
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total_ns += int(f.read().split()[0])
            read = True
        except (FileNotFoundError, ValueError, IndexError):  # a thread that ended meanwhile; no schedstat
            continue
    if read:
        return total_ns * 1e-9
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()  # the name before ")" may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def gap(seconds: float, busy: bool) -> float:
    """The work between two steps; the CPU it used on this thread (to be left out of the learner's)."""
    if seconds <= 0:
        return 0.0
    started = time.thread_time()
    if busy:
        deadline, x = time.perf_counter() + seconds, 0
        while time.perf_counter() < deadline:
            for i in range(50):
                x += i * i
    else:
        time.sleep(seconds)
    return time.thread_time() - started


def run_case(layout: dict[str, int], spin_us: float | None, gap_s: float, args: Args) -> dict[str, Any]:
    """CPU per step of each side, stepping for ``args.seconds`` with ``gap_s`` of work between steps."""
    fns = [functools.partial(gym.make, "CartPole-v1")] * NUM_ENVS
    with ClusterEnv(fns, spin_us=spin_us, **layout) as envs:
        (worker,) = envs.worker_info
        assert worker["step_path"] == "shared memory", worker["step_path"]
        pid = worker["pid"]
        envs.reset(seed=0)
        rng = np.random.default_rng(0)
        actions = [rng.integers(0, 2, NUM_ENVS) for _ in range(256)]
        warm_until = time.perf_counter() + args.seconds / 10
        steps = 0
        while time.perf_counter() < warm_until:  # the adaptive bounds learn the gap
            envs.step(actions[steps % 256])
            gap(gap_s, args.busy)
            steps += 1
        learner_before, worker_before = time.thread_time(), worker_cpu_s(pid)
        gaps_cpu, steps = 0.0, 0
        ends = time.perf_counter() + args.seconds
        while time.perf_counter() < ends:
            envs.step(actions[steps % 256])
            gaps_cpu += gap(gap_s, args.busy)
            steps += 1
        learner_cpu = time.thread_time() - learner_before - gaps_cpu
        worker_cpu = worker_cpu_s(pid) - worker_before
        info = envs.learner_info
    return {
        "steps": steps,
        "learner_us": learner_cpu / steps * 1e6,
        "worker_us": worker_cpu / steps * 1e6,
        "spin": info.get("spin"),
        "spin_rule": info.get("spin_rule"),
        "learner_bound_us": info.get("spin_us"),
        "learner_caught": f"{info.get('caught_spinning', 0)}/{info.get('waits', 0)}",
    }


def main(args: Args) -> None:
    gaps = {f"{args.gap_ms:g} ms {'busy' if args.busy else 'sleeping'}": args.gap_ms * 1e-3, "none": 0.0}
    settings = {"spinning": None, "blocking": 0.0}
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    for layout_name, layout in LAYOUTS.items():
        for gap_name, gap_s in gaps.items():
            case = f"{layout_name} | {gap_name}"
            runs[case] = {name: run_case(layout, spin_us, gap_s, args) for name, spin_us in settings.items()}
            print(case, {name: (round(r["learner_us"]), round(r["worker_us"])) for name, r in runs[case].items()})
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"`{command_line(__file__)}`, {date}, {machine()}: CPU per step of {NUM_ENVS} CartPole-v1 envs, "
        f"{args.seconds:g} s per case, spinning (`spin_us=None`, adaptive) then blocking (`spin_us=0`). The "
        "learner's is its main thread's (`time.thread_time`) less the gap's own CPU; the worker's is its "
        "process's, every thread, from `/proc/<pid>/task/*/schedstat`. *Spin* is spinning less blocking.",
        "",
        "| layout | gap between steps | learner spinning (µs) | blocking | spin | worker spinning (µs) | blocking "
        "| spin | learner's waits caught spinning | learner's bound at the end (µs) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case, result in runs.items():
        spinning, blocking = result["spinning"], result["blocking"]
        lines.append(
            f"| {case} | {spinning['learner_us']:.0f} | {blocking['learner_us']:.0f} "
            f"| {spinning['learner_us'] - blocking['learner_us']:.0f} | {spinning['worker_us']:.0f} "
            f"| {blocking['worker_us']:.0f} | {spinning['worker_us'] - blocking['worker_us']:.0f} "
            f"| {spinning['learner_caught']} | {spinning['learner_bound_us']} |"
        )
    rules = {result["spinning"]["spin_rule"] for result in runs.values()}
    lines += ["", f"Spin rule: {', '.join(sorted(str(r) for r in rules))}."]
    text = "\n".join(lines) + "\n"
    write_report("spin_idle_cost", text, {"date": date, "args": dataclasses.asdict(args), "runs": runs})


if __name__ == "__main__":
    main(tyro.cli(Args))
