"""Scale-out: env-steps per second as a fraction of the ideal, and the learner's CPU, per mode.

The env is ``SleepEnv``: a step waits ``--step-ms`` (lognormal jitter ``sigma``, mean kept)
without using CPU, like a remote simulator, so the ideal is ``num_envs / step time`` and
what is lost is lost to waiting and to the learner. Modes, on the same workers, alternated:

* ``lockstep``: ``envs.step`` (every step waits for the slowest worker);
* ``first-ready 1/2``, ``1/4``: ``recv``/``send`` with ``batch_size`` = that fraction of the envs;
* ``rollout``: ``PolicyRunner.rollout`` (local policies, lockstep per rollout);
* ``prefetch``: ``PolicyRunner(prefetch=1).rollout`` (workers collect ahead).

The RTT part puts a delaying TCP proxy (a separate process, half the RTT each way)
between the learner and its workers, at each ``--rtts-ms``, itself included at 0 ms.

    python benchmarks/probes/scale.py            # the full grid, about 10 minutes on 2 cores
    python benchmarks/probes/scale.py --quick    # a smoke run

Writes ``results/scale.md``, ``results/scale.json`` and ``results/scale.png``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import tyro
from torch import nn
from tqdm import tqdm

# This folder, then benchmarks/ (support.bench_envs, support.report): the workers inherit the path.
sys.path[:0] = [str(folder) for folder in Path(__file__).resolve().parents[:2]]
from support.bench_envs import SleepEnv  # noqa: E402

from clusterenv import ClusterEnv, Never, PolicyRunner  # noqa: E402
from clusterenv.launch.launchers import LocalLauncher  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
STEP_MODES = ("lockstep", "first-ready 1/2", "first-ready 1/4")
ROLLOUT_MODES = ("rollout", "prefetch")
FRACTIONS = {"first-ready 1/2": 0.5, "first-ready 1/4": 0.25}


@dataclasses.dataclass
class Args:
    quick: bool = False
    """smoke run: small grid, short cells, one repeat"""
    step_ms: float = 5.0
    """mean env step time"""
    sigmas: tuple[float, ...] = (0.0, 0.5)
    """lognormal jitter of the step time (0: none)"""
    workers: tuple[int, ...] = (4, 16, 64)
    """worker counts for the scaling part (one env each)"""
    rollout_max_workers: int = 16
    """rollout modes load torch in every worker: above this many workers they are skipped"""
    rollout_steps: int = 32
    """T, steps per env per rollout"""
    rtts_ms: tuple[float, ...] = (0.0, 1.0, 5.0)
    """emulated round-trip times for the RTT part"""
    rtt_workers: int = 4
    """workers in the RTT part"""
    rtt_envs_per_worker: int = 4
    """envs per worker in the RTT part"""
    seconds: float = 2.0
    """timed seconds per cell, after a warm-up"""
    repeats: int = 3
    """runs per cell; the median is reported"""


# -- the RTT emulator -------------------------------------------------------------------------
async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Forward bytes, each chunk ``delay`` seconds after it arrived, in order."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    task = asyncio.create_task(deliver())
    try:
        while data := await reader.read(1 << 16):
            queue.put_nowait((loop.time() + delay, data))
    except ConnectionError:
        pass
    queue.put_nowait((0.0, b""))
    await task


def _serve_proxy(target_port: int, one_way_s: float, ready: Any) -> None:
    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target_port)
        for writer in (client_writer, server_writer):
            writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(
            _pipe(client_reader, server_writer, one_way_s), _pipe(server_reader, client_writer, one_way_s)
        )

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        ready.send(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(main())


class ProxiedLauncher(LocalLauncher):
    """Local workers that reach the learner through a proxy delaying each direction by half ``rtt_ms``."""

    requires_tcp = True

    def __init__(self, rtt_ms: float) -> None:
        super().__init__()
        self.rtt_ms = rtt_ms
        self.proxy: Any = None
        self.front = ""

    def start(self, worker_ids: list[int], address: str, key: bytes) -> None:
        if self.proxy is None:
            receive, send = mp.get_context("spawn").Pipe(duplex=False)
            port = int(address.rsplit(":", 1)[1])
            self.proxy = mp.get_context("spawn").Process(
                target=_serve_proxy, args=(port, self.rtt_ms / 2000.0, send), daemon=True
            )
            self.proxy.start()
            if not receive.poll(30):
                raise RuntimeError("the RTT proxy did not start")
            self.front = f"tcp://127.0.0.1:{receive.recv()}"
        super().start(worker_ids, self.front, key)

    def stop(self, grace: float) -> None:
        super().stop(grace)
        if self.proxy is not None:
            self.proxy.kill()
            self.proxy.join()
            self.proxy = None


# -- the modes --------------------------------------------------------------------------------
def actor() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 2)


def measure(envs: ClusterEnv, mode: str, args: Args) -> tuple[float, float]:
    """(env-steps per second, learner CPU seconds per batch step) of one mode for ``args.seconds``."""
    n = envs.num_envs
    loop: Callable[[], int]
    runner = None
    if mode == "lockstep":
        envs.reset(seed=0)
        actions = np.zeros(n, np.int64)

        def loop() -> int:
            envs.step(actions)
            return n

    elif mode.startswith("first-ready"):
        envs.batch_size = max(1, round(n * FRACTIONS[mode]))
        envs.async_reset(seed=0)
        for _ in range(n // envs.batch_size):
            *_, env_ids = envs.recv()  # the reset observations
            envs.send(np.zeros(len(env_ids), np.int64), env_ids)

        def loop() -> int:
            *_, env_ids = envs.recv()
            envs.send(np.zeros(len(env_ids), np.int64), env_ids)
            return len(env_ids)

    else:
        runner = PolicyRunner(envs, actor(), Never(), seed=0, prefetch=1 if mode == "prefetch" else 0)

        def loop() -> int:
            runner.rollout(args.rollout_steps)
            return n * args.rollout_steps

    try:
        deadline = time.perf_counter() + min(1.0, args.seconds / 2)
        while time.perf_counter() < deadline:  # warm-up
            loop()
        steps, wall, cpu = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - wall < args.seconds:
            steps += loop()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        if runner is not None:
            runner.stop()
        if mode.startswith("first-ready"):
            while True:
                try:
                    envs.recv()
                except Exception:  # NoAsyncCallError: nothing left in flight
                    break
    return steps / wall, cpu / (steps / n)


def cluster(workers: int, envs_per_worker: int, args: Args, **kwargs: Any) -> ClusterEnv:
    n = workers * envs_per_worker
    env_fn = functools.partial(SleepEnv, args.step_ms)
    return ClusterEnv([env_fn] * n, num_workers=workers, start_timeout=600, **kwargs)


def scaling(args: Args, cells: dict[str, list[list[float]]]) -> None:
    for workers in args.workers:
        modes = STEP_MODES + (ROLLOUT_MODES if workers <= args.rollout_max_workers else ())
        with cluster(workers, 1, args) as envs:
            jobs = [(s, m) for _ in range(args.repeats) for s in args.sigmas for m in modes]
            for sigma, mode in tqdm(jobs, desc=f"{workers} workers"):
                envs.set_attr("jitter_sigma", sigma)
                cells.setdefault(f"scale:{workers}:{sigma}:{mode}", []).append(list(measure(envs, mode, args)))


def rtt(args: Args, cells: dict[str, list[list[float]]]) -> None:
    for rtt_ms in args.rtts_ms:
        launcher = ProxiedLauncher(rtt_ms)
        with cluster(args.rtt_workers, args.rtt_envs_per_worker, args, launcher=launcher) as envs:
            jobs = [m for _ in range(args.repeats) for m in STEP_MODES + ROLLOUT_MODES]
            for mode in tqdm(jobs, desc=f"RTT {rtt_ms:g} ms"):
                cells.setdefault(f"rtt:{rtt_ms}:{mode}", []).append(list(measure(envs, mode, args)))


def k_of_n_bound(n: int, k: int, sigma: float, rounds: int = 20000) -> float:
    """The fraction of ideal that first-ready batches of ``k`` of ``n`` workers reach with a free learner.

    A discrete-event simulation: workers step (lognormal times, mean 1), the learner takes the
    first ``k`` to finish and restarts them at once. Waiting for the k-th finisher is the loss.
    """
    rng = np.random.default_rng(0)

    def step_time() -> float:
        return float(rng.lognormal(-(sigma**2) / 2, sigma)) if sigma else 1.0

    finish = sorted(step_time() for _ in range(n))
    now, done = 0.0, 0
    for _ in range(rounds):
        now = max(now, finish[k - 1])
        finish = sorted(finish[k:] + [now + step_time() for _ in range(k)])
        done += k
    return done / now / n


def median(cells: dict[str, list[list[float]]], key: str, i: int) -> float:
    return statistics.median(run[i] for run in cells[key])


def report(args: Args, cells: dict[str, list[list[float]]]) -> str:
    command = "python benchmarks/probes/scale.py" + (" --quick" if args.quick else "")
    modes = STEP_MODES + ROLLOUT_MODES
    lines = [
        f"`{command}` — SleepEnv {args.step_ms:g} ms; {args.seconds:g} s per cell, median of {args.repeats} "
        f"(modes alternated on the same workers); rollouts of T={args.rollout_steps}; first-ready batch = half "
        f"the envs; {os.cpu_count()} cores, Python {platform.python_version()}.",
        "",
        "Fraction of the ideal env-steps/s (envs / mean step time), one env per worker. The k-of-n bound is what "
        "first-ready batches reach with stragglers and a learner that costs nothing (a simulation, in this file):",
        "",
        "| workers | σ | " + " | ".join(modes) + " |",
        "|---|---|" + "---|" * len(modes),
    ]
    for workers in args.workers:
        for sigma in args.sigmas:
            ideal = workers / (args.step_ms / 1000)
            row = [
                f"{median(cells, key, 0) / ideal:.2f}" if (key := f"scale:{workers}:{sigma}:{m}") in cells else "—"
                for m in modes
            ]
            lines.append(f"| {workers} | {sigma:g} | " + " | ".join(row) + " |")
            if sigma:
                bounds = [
                    f"≤{k_of_n_bound(workers, max(1, round(workers * FRACTIONS[m])), sigma):.2f}"
                    if m in FRACTIONS
                    else ""
                    for m in modes
                ]
                lines.append("| | k-of-n bound | " + " | ".join(bounds) + " |")
    lines += [
        "",
        "Learner CPU per batch step (one step of every env), σ = 0:",
        "",
        "| workers | " + " | ".join(modes) + " |",
        "|---|" + "---|" * len(modes),
    ]
    for workers in args.workers:
        key0 = args.sigmas[0]
        row = [
            f"{median(cells, key, 1) * 1e6:,.0f} µs" if (key := f"scale:{workers}:{key0}:{m}") in cells else "—"
            for m in modes
        ]
        lines.append(f"| {workers} | " + " | ".join(row) + " |")
    ideal_rtt = args.rtt_workers / (args.step_ms / 1000)  # a worker steps its envs one after another
    lines += [
        "",
        f"Emulated round-trip time ({args.rtt_workers} workers x {args.rtt_envs_per_worker} envs, σ = 0, through a "
        "delaying TCP proxy; fraction of the same mode's throughput at 0 ms through the proxy, and in brackets of "
        "the ideal, workers x envs per worker / (envs per worker x step time)):",
        "",
        "| RTT | " + " | ".join(modes) + " |",
        "|---|" + "---|" * len(modes),
    ]
    for rtt_ms in args.rtts_ms:
        row = []
        for m in modes:
            speed, base = median(cells, f"rtt:{rtt_ms}:{m}", 0), median(cells, f"rtt:{args.rtts_ms[0]}:{m}", 0)
            row.append(f"{speed / base:.2f} ({speed / ideal_rtt:.2f})")
        lines.append(f"| {rtt_ms:g} ms | " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(args: Args, cells: dict[str, list[list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ideal_ax, cpu_ax, rtt_ax) = plt.subplots(1, 3, figsize=(15, 4.2))
    for mode in STEP_MODES + ROLLOUT_MODES:
        for sigma, style in zip(args.sigmas, ("-", "--", ":"), strict=False):
            points = [
                (w, median(cells, f"scale:{w}:{sigma}:{mode}", 0) / (w / (args.step_ms / 1000)))
                for w in args.workers
                if f"scale:{w}:{sigma}:{mode}" in cells
            ]
            if points:
                ideal_ax.plot(*zip(*points, strict=True), style, marker="o", label=f"{mode}, σ={sigma:g}")
        points = [
            (w, median(cells, f"scale:{w}:{args.sigmas[0]}:{mode}", 1) * 1e3)
            for w in args.workers
            if f"scale:{w}:{args.sigmas[0]}:{mode}" in cells
        ]
        cpu_ax.plot(*zip(*points, strict=True), marker="o", label=mode)
        base = median(cells, f"rtt:{args.rtts_ms[0]}:{mode}", 0)
        rtt_ax.plot(
            args.rtts_ms, [median(cells, f"rtt:{r}:{mode}", 0) / base for r in args.rtts_ms], marker="o", label=mode
        )
    ideal_ax.set(xscale="log", xlabel="workers (one env each)", ylabel="fraction of ideal env-steps/s", ylim=(0, 1.05))
    cpu_ax.set(xscale="log", yscale="log", xlabel="workers", ylabel="learner CPU per batch step (ms)")
    rtt_ax.set(xlabel="emulated RTT (ms)", ylabel="throughput / throughput at 0 ms", ylim=(0, 1.1))
    for ax in (ideal_ax, cpu_ax, rtt_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"SleepEnv {args.step_ms:g} ms on {os.cpu_count()} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args: Args) -> None:
    if args.quick:
        args = dataclasses.replace(args, workers=(4, 16), rtts_ms=(0.0, 5.0), seconds=0.6, repeats=1)
    cells: dict[str, list[list[float]]] = {}
    scaling(args, cells)
    rtt(args, cells)
    table = report(args, cells)
    print(table)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "scale.md").write_text(table + "\n")
    (RESULTS_DIR / "scale.json").write_text(json.dumps({"args": dataclasses.asdict(args), "cells": cells}) + "\n")
    plot(args, cells, RESULTS_DIR / "scale.png")


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args)))
