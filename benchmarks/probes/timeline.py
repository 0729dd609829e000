"""Where the wall time of a lockstep batch step goes, on a host with many cores.

Two parts, run in one go:

* **Timeline.** ``TracedBurnEnv`` (1 ms of CPU per step) records when each env step starts
  and ends on the host's monotonic clock; the learner records when each ``step`` call starts
  and returns. Per batch step this gives, for every process that steps envs: when it started
  its first env after the learner's call began (the send path and the wake-up), how long it took
  for its envs (against their CPU: stretched when it was preempted), and how long the learner
  took to return after the last env finished (replies and assembly).
* **Transport floors.** ``--num-workers`` processes that each burn a worker's share of CPU
  (its envs x 1 ms) per message, driven in lockstep by a bare ZeroMQ ROUTER over ``ipc://``
  and by ``multiprocessing`` pipes (AsyncVectorEnv's carrier), and the same with no CPU:
  what any design built on each carrier can reach on this host.

    python benchmarks/probes/timeline.py
    python benchmarks/probes/timeline.py --quick     # 16 envs on 4 workers, 1 s runs (2 cores)

Writes ``results/timeline.md`` and ``results/timeline.json``.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import tyro
import zmq

# This folder, then benchmarks/ (support.bench_envs, support.report): the workers inherit the path.
sys.path[:0] = [str(folder) for folder in Path(__file__).resolve().parents[:2]]
from learner_cpu import hello_dealer, worker_router  # noqa: E402
from support.bench_envs import TracedBurnEnv  # noqa: E402
from support.report import command_line, write_report  # noqa: E402

from clusterenv import ClusterEnv  # noqa: E402
from clusterenv.launch.launchers import LocalLauncher  # noqa: E402

CORES = len(os.sched_getaffinity(0))


@dataclasses.dataclass
class Args:
    quick: bool = False
    """smoke run: 16 envs on 4 workers, 1 s runs"""
    num_envs: int = 64
    num_workers: int = CORES
    step_cpu_ms: float = 1.0
    seconds: float = 3.0
    """timed seconds per run"""
    configs: tuple[str, ...] = ("async", "clusterenv", "clusterenv-pipes", "clusterenv-zmq")
    """timeline backends: async; clusterenv (one worker per core, as it starts them by default); clusterenv-pipes
    (workers scheduled as any process, ``LocalLauncher(batch_scheduling=False)``); clusterenv-zmq (that, on the
    learner's ZeroMQ socket instead of pipes); clusterenv-minus1 (one core left to the learner);
    clusterenv-procs4 (a quarter of the workers, 4 env processes each)"""
    repeats: int = 1
    """rounds of the timeline configs, alternated; medians"""
    floors: bool = True
    """also run the transport floors"""


# -- timeline -----------------------------------------------------------------------------------
def build(config: str, env_fns: list[Callable[[], gym.Env]], args: Args) -> Any:
    if config == "async":
        return gym.vector.AsyncVectorEnv(env_fns, shared_memory=True)
    if config == "clusterenv":
        return ClusterEnv(env_fns, num_workers=args.num_workers)
    if config == "clusterenv-zmq":  # before the pipes
        return ClusterEnv(
            env_fns, num_workers=args.num_workers, launcher=LocalLauncher(pipes=False, batch_scheduling=False)
        )
    if config == "clusterenv-pipes":  # pipes, workers scheduled as any process
        return ClusterEnv(env_fns, num_workers=args.num_workers, launcher=LocalLauncher(batch_scheduling=False))
    if config == "clusterenv-minus1":
        return ClusterEnv(env_fns, num_workers=args.num_workers - 1)
    if config == "clusterenv-procs4":
        return ClusterEnv(env_fns, num_workers=max(1, args.num_workers // 4), procs_per_worker=4)
    raise ValueError(f"Unknown config {config!r}.")


def timeline(config: str, args: Args) -> dict[str, float]:
    """Median µs per batch step of each phase (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="timeline-") as trace_dir:
        env_fns = [functools.partial(TracedBurnEnv, trace_dir, args.step_cpu_ms)] * args.num_envs
        envs = build(config, env_fns, args)
        calls = []
        try:
            envs.reset(seed=0)
            actions = np.zeros(args.num_envs, np.int64)
            started = time.perf_counter()
            while time.perf_counter() - started < args.seconds:
                begin = time.monotonic_ns()
                envs.step(actions)
                calls.append((begin, time.monotonic_ns()))
        finally:
            envs.close()
        by_process: dict[str, list[np.ndarray]] = {}
        for path in glob.glob(f"{trace_dir}/*.npy"):
            by_process.setdefault(os.path.basename(path).split("-")[0], []).append(np.load(path))
    steps = np.array(calls[5:])  # the first steps include the workers' start-up
    offset = 5
    # starts[p, k], ends[p, k]: process p's first env start and last env end in batch step k.
    starts = np.stack([np.min([t[offset:, 0] for t in traces], axis=0) for traces in by_process.values()])
    ends = np.stack([np.max([t[offset:, 1] for t in traces], axis=0) for traces in by_process.values()])
    busy = np.stack([np.sum([t[offset:, 1] - t[offset:, 0] for t in traces], axis=0) for traces in by_process.values()])
    n = min(len(steps), starts.shape[1])
    steps, starts, ends, busy = steps[:n], starts[:, :n], ends[:, :n], busy[:, :n]
    per_env_cpu = args.step_cpu_ms * 1e3
    envs_per_process = args.num_envs / len(by_process)

    def med(x: np.ndarray) -> float:
        return float(np.median(x)) / 1e3  # ns -> µs

    return {
        "processes": len(by_process),
        "batch_steps": n,
        "wall": med(steps[:, 1] - steps[:, 0]),
        "first process starts": med(starts.min(axis=0) - steps[:, 0]),
        "last process starts": med(starts.max(axis=0) - steps[:, 0]),
        "envs' own time per process": med(busy.mean(axis=0)),
        "ideal per process": envs_per_process * per_env_cpu,
        "span per process (median)": med(np.median(ends - starts, axis=0)),
        "span per process (max)": med((ends - starts).max(axis=0)),
        "last env end to return": med(steps[:, 1] - ends.max(axis=0)),
    }


# -- transport floors ---------------------------------------------------------------------------
def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _serve_burning(recv: Callable[[], bytes], send: Callable[[bytes], Any], burn_s: float) -> None:
    """Answer each message with itself after ``burn_s`` of CPU, until ``b"stop"``."""
    while (message := recv()) != b"stop":
        _burn(burn_s)
        send(message)


def zmq_burn_worker(address: str, identity: bytes, burn_s: float) -> None:
    context, socket = hello_dealer(address, identity)
    _serve_burning(socket.recv, socket.send, burn_s)
    socket.close()
    context.term()


def pipe_burn_worker(connection: Any, burn_s: float) -> None:
    _serve_burning(connection.recv_bytes, connection.send_bytes, burn_s)


def floor_zmq(n: int, burn_s: float, seconds: float) -> float:
    """Lockstep round trips per second: one message to each of ``n`` workers, one reply from each."""
    payload = bytes(64)
    with worker_router(n, zmq_burn_worker, burn_s) as (router, identities):
        router.setsockopt(zmq.RCVTIMEO, 10_000)
        rounds, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            for identity in identities:
                router.send_multipart([identity, payload])
            for _ in identities:
                router.recv_multipart()
            rounds += 1
        return rounds / (time.perf_counter() - started)


def floor_pipes(n: int, burn_s: float, seconds: float) -> float:
    payload = bytes(64)
    spawn = mp.get_context("spawn")
    pairs = [spawn.Pipe() for _ in range(n)]
    processes = [spawn.Process(target=pipe_burn_worker, args=(child, burn_s)) for _, child in pairs]
    for p in processes:
        p.start()
    try:
        for parent, _ in pairs:  # everyone up
            parent.send_bytes(payload)
        for parent, _ in pairs:
            if not parent.poll(30):
                raise TimeoutError("a pipe worker did not start")
            parent.recv_bytes()
        rounds, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            for parent, _ in pairs:
                parent.send_bytes(payload)
            for parent, _ in pairs:
                if not parent.poll(10):
                    raise TimeoutError("a pipe worker did not reply")
                parent.recv_bytes()
            rounds += 1
        return rounds / (time.perf_counter() - started)
    finally:
        for parent, _ in pairs:
            try:
                parent.send_bytes(b"stop")
            except OSError:
                pass
        for p in processes:
            p.join(5)
            if p.is_alive():
                p.kill()


def main(args: Args) -> None:
    if args.quick:
        args = dataclasses.replace(args, num_envs=16, num_workers=4, seconds=1.0)
    results: dict[str, Any] = {"timeline": {}, "floors": {}}
    for config in args.configs * args.repeats:
        row = timeline(config, args)
        results.setdefault("runs", {}).setdefault(config, []).append(row)
        print(config, {k: round(v) for k, v in row.items()}, flush=True)
    for config, rows in results["runs"].items():
        results["timeline"][config] = {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
    if args.floors:
        burn_s = args.num_envs / args.num_workers * args.step_cpu_ms / 1000
        for name, floor in (("zmq ipc", floor_zmq), ("pipes", floor_pipes)):
            for label, seconds in (("burn", burn_s), ("null", 0.0)):
                rate = floor(args.num_workers, seconds, args.seconds)
                results["floors"][f"{name}, {label}"] = rate
                print(name, label, f"{rate:,.0f} rounds/s", flush=True)
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    columns = list(next(iter(results["timeline"].values())))
    lines = [
        f"`{command_line(__file__)}` on {platform.node()}, {CORES} cores, {date}; {args.num_envs} TracedBurnEnv "
        f"({args.step_cpu_ms:g} ms CPU per step), lockstep; µs per batch step, medians over {args.seconds:g} s.",
        "",
        "| backend | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * len(columns),
        *(
            f"| {config} | " + " | ".join(f"{row[c]:,.0f}" for c in columns) + " |"
            for config, row in results["timeline"].items()
        ),
    ]
    if results["floors"]:
        burn_ms = args.num_envs / args.num_workers * args.step_cpu_ms
        lines += [
            "",
            f"Transport floors, {args.num_workers} worker processes in lockstep, round trips/s "
            f"(burn: {burn_ms:g} ms of CPU per worker per round; null: none):",
            "",
            "| carrier | round trips/s |",
            "|---|---:|",
            *(f"| {name} | {rate:,.0f} |" for name, rate in results["floors"].items()),
        ]
    text = "\n".join(lines) + "\n"
    results.update(cores=CORES, date=date, args=dataclasses.asdict(args))
    write_report("timeline", text, results)


if __name__ == "__main__":
    main(tyro.cli(Args))
