"""A run that loses workers for good, one of them frozen, then gains two: throughput in each phase.

``ClusterEnv(on_worker_failure="rehome")`` with 8 workers of 2 ``SleepEnv`` each (a step
waits ``--step-ms`` without using CPU, as a remote simulator does). A quarter of the way
in, one worker is SIGKILLed, one SIGKILLed while stepping, and one frozen with SIGSTOP
(lost once its heartbeats stop); their envs move to the survivors. Halfway, two new
worker processes connect (``clusterenv-worker --connect``) and ``envs.rebalance()`` gives
them envs. The table compares the steps/s of each phase with what its share of live
workers predicts (``before × live / workers``), measured in the same run, and checks that
every cut episode (lost, then moved to a joiner) was flagged.

    python benchmarks/elastic.py                 # 20,000 batch steps, 3 runs, a few minutes
    python benchmarks/elastic.py --quick         # a smoke run
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tyro
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # workers import support.bench_envs from here
from support.bench_envs import SleepEnv  # noqa: E402
from support.report import command_line  # noqa: E402

from clusterenv import ClusterEnv  # noqa: E402
from clusterenv.wire.liveness import Heartbeat  # noqa: E402
from clusterenv.wire.transport import SECRET_ENV_VAR  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def leftovers(pids: list[int]) -> tuple[int, int]:
    """Worker processes still running among ``pids``, and this learner's scratch directories still there."""
    running = sum(Path(f"/proc/{pid}").exists() and "Z" not in _state(pid) for pid in pids)
    dirs = sum(
        len(glob.glob(os.path.join(base, f"clusterenv-*{os.getpid()}-*")))
        for base in {tempfile.gettempdir(), "/dev/shm"}
    )
    return running, dirs


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


@dataclasses.dataclass
class Args:
    quick: bool = False
    """smoke run: 4,000 steps, one run"""
    steps: int = 20_000
    """batch steps per run"""
    workers: int = 8
    envs_per_worker: int = 2
    step_ms: float = 1.0
    """each env step waits this long"""
    repeats: int = 3
    """runs; the median ratio is reported"""


def one_run(args: Args) -> dict[str, float]:
    """Steps/s before the losses, after them, and after two processes joined; the cuts flagged."""
    num_envs = args.workers * args.envs_per_worker
    quarter, half = args.steps // 4, args.steps // 2
    # step -> (worker, how): three losses a few hundred steps apart, a quarter of the run in.
    casualties = {quarter: (1, "kill"), quarter + 300: (4, "kill mid-step"), quarter + 600: (6, "freeze")}
    fns = [functools.partial(SleepEnv, args.step_ms)] * num_envs
    heartbeat = Heartbeat(interval=0.1, liveness=10)  # a frozen worker is lost after 1 s
    secret = os.urandom(16).hex()
    marks: dict[int, float] = {}
    flagged, joiners, moved = 0, [], []
    envs = ClusterEnv(
        fns,
        num_workers=args.workers,
        on_worker_failure="rehome",
        heartbeat=heartbeat,
        bind="tcp://127.0.0.1:*",
        secret=secret,
    )
    try:
        envs.reset(seed=0)
        actions = np.zeros(num_envs, dtype=np.int64)
        for t in range(args.steps):
            marks[t] = time.perf_counter()
            if t == half:  # two hosts join: they take envs at the next rebalance()
                joiners = [
                    subprocess.Popen(
                        [sys.executable, "-m", "clusterenv.worker", "--connect", envs.address],
                        env={**os.environ, SECRET_ENV_VAR: secret, "PYTHONPATH": os.pathsep.join(sys.path)},
                    )
                    for _ in range(2)
                ]
                deadline = time.monotonic() + 60
                while len(moved) < 2 and time.monotonic() < deadline:
                    moved += envs.rebalance(wait=1.0)
                marks[t] = time.perf_counter()  # the joiners' start-up is not the run's throughput
            if t in casualties:
                victim, how = casualties[t]
                os.kill(envs.worker_info[victim]["pid"], signal.SIGSTOP if how == "freeze" else signal.SIGKILL)
                if how == "kill mid-step":
                    envs.step_async(actions)
                    result = envs.step_wait()
                else:
                    result = envs.step(actions)
            else:
                result = envs.step(actions)
            infos = result[4]
            if "worker_restarted" in infos:
                flagged += int(infos["worker_restarted"].sum())
        marks[args.steps] = time.perf_counter()
        states = [w["state"] for w in envs.worker_info]
        pids = [w["pid"] for w in envs.worker_info]
    finally:
        envs.close()
        for process in joiners:
            process.wait(timeout=30)
    time.sleep(1.0)  # the workers' own exit
    running, dirs = leftovers(pids)

    def rate(start: int, stop: int) -> float:
        return (stop - start) / (marks[stop] - marks[start])

    # Windows clear of the warm-up, of the losses (detection, rebuilding) and of the moves.
    before = rate(quarter // 4, quarter)
    after_loss = rate(quarter + 600 + (half - quarter - 600) // 2, half)
    after_join = rate(half + (args.steps - half) // 4, args.steps)
    lost, live = states.count("lost"), states.count("active")
    return {
        "before": before,
        "after_loss": after_loss,
        "predicted_after_loss": before * (args.workers - lost) / args.workers,
        "after_join": after_join,
        "predicted_after_join": before * live / args.workers,
        "lost": lost,
        "live_at_end": live,
        "moved_to_joiners": len(moved),
        "flagged": flagged,
        "expected_flags": (len(casualties) + len(moved)) * args.envs_per_worker,
        "processes_left": running,
        "dirs_left": dirs,
    }


def main(args: Args) -> None:
    if args.quick:
        args = dataclasses.replace(args, steps=4000, repeats=1)
    runs = [one_run(args) for _ in tqdm(range(args.repeats), desc="elastic")]
    command = command_line(__file__)
    median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    lines = [
        f"`{command}` — {args.workers} workers × {args.envs_per_worker} SleepEnv ({args.step_ms:g} ms), "
        f'{args.steps:,} batch steps, `on_worker_failure="rehome"`: 3 workers lost a quarter of the way in '
        f"(SIGKILL, SIGKILL mid-step, SIGSTOP), 2 joined halfway (`rebalance()`); median of {args.repeats} runs; "
        f"{os.cpu_count()} cores, Python {platform.python_version()}.",
        "",
        "| phase | live workers | steps/s | predicted by the live share | measured / predicted |",
        "|---|---|---|---|---|",
        f"| before | {args.workers} | {median['before']:,.0f} | | |",
        f"| after the losses | {args.workers - median['lost']:.0f} | {median['after_loss']:,.0f} | "
        f"{median['predicted_after_loss']:,.0f} | {median['after_loss'] / median['predicted_after_loss']:.2f} |",
        f"| after 2 joined | {median['live_at_end']:.0f} | {median['after_join']:,.0f} | "
        f"{median['predicted_after_join']:,.0f} | {median['after_join'] / median['predicted_after_join']:.2f} |",
        "",
        f"Cut envs flagged `worker_restarted`: {min(r['flagged'] for r in runs)} of {runs[0]['expected_flags']} "
        f"(each run; {runs[0]['moved_to_joiners']} workers' envs moved to the joiners). Left behind after "
        f"`close()`: {max(r['processes_left'] for r in runs)} worker processes, "
        f"{max(r['dirs_left'] for r in runs)} scratch directories.",
    ]
    table = "\n".join(lines)
    print(table)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "elastic.md").write_text(table + "\n")
    (RESULTS_DIR / "elastic.json").write_text(
        json.dumps({"args": dataclasses.asdict(args), "runs": runs}, indent=1) + "\n"
    )


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args)))
