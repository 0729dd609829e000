"""A run that loses a quarter of its workers for good, and one that freezes: throughput before and after.

``ClusterEnv(on_worker_failure="rehome")`` with 8 workers of 2 ``SleepEnv`` each (a step
waits ``--step-ms`` without using CPU, as a remote simulator does). During the run, one
worker is SIGKILLed, one SIGKILLed while stepping, and one frozen with SIGSTOP (lost once
its heartbeats stop); their envs move to the survivors. The table compares the steps/s
after the losses with what the survivors' share of the workers predicts
(``before × survivors / workers``), measured in the same run; it also checks that every
cut episode was flagged.

    python benchmarks/elastic.py                 # 20,000 batch steps, 3 runs, a few minutes
    python benchmarks/elastic.py --quick         # a smoke run
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import signal
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import tyro
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # workers import bench_envs from here
from bench_envs import SleepEnv  # noqa: E402

from clusterenv import ClusterEnv  # noqa: E402
from clusterenv.wire.liveness import Heartbeat  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


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
    """Steps/s before the first loss and after the last, and the cuts flagged."""
    num_envs = args.workers * args.envs_per_worker
    quarter = args.steps // 4
    # step -> (worker, how): a quarter of the run in, three losses a few hundred steps apart.
    casualties = {quarter: (1, "kill"), quarter + 300: (4, "kill mid-step"), quarter + 600: (6, "freeze")}
    fns = [functools.partial(SleepEnv, args.step_ms)] * num_envs
    heartbeat = Heartbeat(interval=0.1, liveness=10)  # a frozen worker is lost after 1 s
    marks: dict[int, float] = {}
    flagged = 0
    with ClusterEnv(fns, num_workers=args.workers, on_worker_failure="rehome", heartbeat=heartbeat) as envs:
        envs.reset(seed=0)
        actions = np.zeros(num_envs, dtype=np.int64)
        for t in range(args.steps):
            marks[t] = time.perf_counter()
            if t in casualties:
                victim, how = casualties[t]
                pid = envs.worker_info[victim]["pid"]
                os.kill(pid, signal.SIGSTOP if how == "freeze" else signal.SIGKILL)
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
        lost = [w["worker_id"] for w in envs.worker_info if w["state"] == "lost"]
    # Windows clear of the start (warm-up) and of the losses (detection, rebuilding the envs).
    before = (quarter - quarter // 4) / (marks[quarter] - marks[quarter // 4])
    after_start = quarter + 600 + (args.steps - quarter - 600) // 4
    after = (args.steps - after_start) / (marks[args.steps] - marks[after_start])
    survivors = args.workers - len(lost)
    predicted = before * survivors / args.workers
    return {
        "before": before,
        "after": after,
        "predicted": predicted,
        "ratio": after / predicted,
        "lost": len(lost),
        "flagged": flagged,
        "expected_flags": len(casualties) * args.envs_per_worker,
    }


def main(args: Args) -> None:
    if args.quick:
        args = dataclasses.replace(args, steps=4000, repeats=1)
    runs = [one_run(args) for _ in tqdm(range(args.repeats), desc="elastic")]
    command = "python benchmarks/elastic.py" + "".join(f" {a}" for a in sys.argv[1:])
    median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    lines = [
        f"`{command}` — {args.workers} workers × {args.envs_per_worker} SleepEnv ({args.step_ms:g} ms), "
        f'{args.steps:,} batch steps, `on_worker_failure="rehome"`; 3 workers lost a quarter of the way in '
        f"(SIGKILL, SIGKILL mid-step, SIGSTOP); median of {args.repeats} runs; {os.cpu_count()} cores, "
        f"Python {platform.python_version()}.",
        "",
        "| steps/s before | steps/s after | predicted by the survivors' share | after / predicted | cut envs flagged |",
        "|---|---|---|---|---|",
        f"| {median['before']:,.0f} | {median['after']:,.0f} | {median['predicted']:,.0f} | "
        f"{median['ratio']:.2f} | {min(r['flagged'] for r in runs)} of {runs[0]['expected_flags']} |",
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
