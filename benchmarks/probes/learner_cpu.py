"""The learner's CPU per batch step against its floor: bare pyzmq with msgpack headers and MACs.

Each worker holds one ``SleepEnv`` (a step waits ``--step-ms`` without using CPU), so the
learner is idle between steps, as with a remote simulator. The floor is the same message
exchange written directly on pyzmq: per step, a msgpack header, the action frame and a
keyed BLAKE3 MAC (the one ClusterEnv uses) to each worker; per reply, a MAC check, a
msgpack parse and the observation, reward, termination and truncation frames copied into
batch arrays. Both run in one
process run, alternated, repeated; the table gives medians of the learner process's CPU
time (all its threads, ZeroMQ's I/O thread included) per batch step.

    python benchmarks/probes/learner_cpu.py                    # 2 and 16 workers, a few minutes
    python benchmarks/probes/learner_cpu.py --quick            # a smoke run
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hmac
import json
import multiprocessing as mp
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import blake3
import msgpack
import numpy as np
import tyro
import zmq
from tqdm import tqdm

# This folder, then benchmarks/ (support.bench_envs, support.report): the workers inherit the path.
sys.path[:0] = [str(folder) for folder in Path(__file__).resolve().parents[:2]]
from support.bench_envs import SleepEnv  # noqa: E402
from support.report import command_line  # noqa: E402

from clusterenv import ClusterEnv  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


@dataclasses.dataclass
class Args:
    quick: bool = False
    """smoke run: few steps, one repeat"""
    workers: tuple[int, ...] = (2, 16)
    """worker counts (one env each)"""
    step_ms: float = 20.0
    """each env step waits this long"""
    steps: int = 150
    """timed batch steps per run, after 20 untimed ones"""
    repeats: int = 5
    """runs per cell; the median is reported"""
    procs_per_worker: int = 1
    """(clusterenv) env processes per worker; the floor ignores it"""


def _frames(key: bytes, kind: int, arrays: list[np.ndarray]) -> list[bytes | memoryview]:
    header = msgpack.packb([1, kind, {}, [(a.dtype.str, a.shape) for a in arrays], 0])
    mac = blake3.blake3(header, key=key)
    for a in arrays:
        mac.update(memoryview(a).cast("B"))
    return [header, *(memoryview(a).cast("B") for a in arrays), mac.digest()]


def _check(key: bytes, frames: list[zmq.Frame]) -> list[np.ndarray]:
    header = frames[0].bytes
    mac = blake3.blake3(header, key=key)
    for frame in frames[1:-1]:
        mac.update(frame.buffer)
    if not hmac.compare_digest(mac.digest(), frames[-1].bytes):
        raise RuntimeError("bad MAC")
    _, _, _, specs, _ = msgpack.unpackb(header)
    return [np.frombuffer(f.buffer, dtype=d).reshape(s) for (d, s), f in zip(specs, frames[1:-1], strict=True)]


def hello_dealer(address: str, identity: bytes) -> tuple[zmq.Context, zmq.Socket]:
    """A bare-pyzmq worker's DEALER, connected to ``address`` as ``identity``, its hello sent."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, identity)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    socket.send(b"hello")
    return context, socket


def floor_worker(address: str, identity: bytes, key: bytes, step_s: float, sigma: float = 0.0) -> None:
    """One bare-pyzmq worker: check the command's MAC, sleep ``step_s`` (lognormal spread ``sigma``, mean kept), reply."""
    context, socket = hello_dealer(address, identity)
    obs, reward = np.zeros((1, 4), np.float32), np.ones(1)
    done = np.zeros(1, np.bool_)
    rng = np.random.default_rng()
    while True:
        frames = socket.recv_multipart(copy=False)
        if frames[0].bytes == b"stop":
            break
        _check(key, frames)
        time.sleep(float(rng.lognormal(np.log(step_s) - sigma**2 / 2, sigma)) if sigma else step_s)
        socket.send_multipart(_frames(key, 103, [obs, reward, done, done]), copy=False)
    socket.close()
    context.term()


@contextlib.contextmanager
def worker_router(
    n: int, target: Callable[..., None], *args: Any, tcp: bool = False
) -> Iterator[tuple[zmq.Socket, list[bytes]]]:
    """A ROUTER on a private ``ipc://`` socket (``tcp``: a loopback port) and ``n`` spawned ``target(address, identity, *args)`` workers.

    Yields once every worker has said hello; sends each ``b"stop"`` and ends them on exit.
    """
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    scratch = tempfile.TemporaryDirectory(prefix="bare-pyzmq-")  # removed with the socket file at the end
    router.bind("tcp://127.0.0.1:*" if tcp else f"ipc://{scratch.name}/router.sock")
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)
    identities = [b"w%d" % i for i in range(n)]
    spawn = mp.get_context("spawn")
    processes = [spawn.Process(target=target, args=(address, i, *args)) for i in identities]
    for p in processes:
        p.start()
    try:
        for _ in identities:
            router.recv_multipart()
        yield router, identities
    finally:
        for identity in identities:
            router.send_multipart([identity, b"stop"])
        for p in processes:
            p.join(5)
            if p.is_alive():
                p.kill()
        router.close()
        context.term()
        scratch.cleanup()


def floor_cpu(n: int, args: Args) -> float:
    """Learner CPU seconds per batch step of the bare exchange."""
    key = secrets.token_bytes(32)
    with worker_router(n, floor_worker, key, args.step_ms / 1000) as (router, identities):
        obs = np.zeros((n, 4), np.float32)
        rewards, terminations, truncations = np.zeros(n), np.zeros(n, np.bool_), np.zeros(n, np.bool_)
        index = {identity: i for i, identity in enumerate(identities)}
        actions = np.zeros((n,), np.int64)

        def step() -> None:
            for i, identity in enumerate(identities):
                router.send_multipart([identity, *_frames(key, 3, [actions[i : i + 1]])], copy=False)
            for _ in identities:
                sender, *frames = router.recv_multipart(copy=False)
                i = index[sender.bytes]
                o, r, te, tr = _check(key, frames)
                obs[i], rewards[i], terminations[i], truncations[i] = o[0], r[0], te[0], tr[0]

        return _timed(step, args.steps)


def clusterenv_cpu(n: int, args: Args) -> float:
    """Learner CPU seconds per batch step of ``ClusterEnv.step``."""
    env_fn = functools.partial(SleepEnv, args.step_ms)
    kwargs = {"procs_per_worker": args.procs_per_worker} if args.procs_per_worker > 1 else {}
    with ClusterEnv([env_fn] * n, num_workers=n, **kwargs) as envs:
        envs.reset(seed=0)
        actions = np.zeros((n,), np.int64)
        return _timed(lambda: envs.step(actions), args.steps)


def _timed(step, steps: int) -> float:
    for _ in range(20):
        step()
    started = time.process_time()
    for _ in range(steps):
        step()
    return (time.process_time() - started) / steps


def main(args: Args) -> None:
    if args.quick:
        args = dataclasses.replace(args, steps=40, repeats=1)
    cells: dict[str, list[float]] = {}
    jobs = [(n, backend) for _ in range(args.repeats) for n in args.workers for backend in ("floor", "clusterenv")]
    for n, backend in tqdm(jobs, desc="learner CPU"):
        run = floor_cpu if backend == "floor" else clusterenv_cpu
        cells.setdefault(f"{n}:{backend}", []).append(run(n, args))
    command = command_line(__file__)
    lines = [
        f"`{command}` — one SleepEnv ({args.step_ms:g} ms) per worker, {args.steps} timed batch steps, median of "
        f"{args.repeats} (backends alternated); learner process CPU per batch step; {os.cpu_count()} cores, "
        f"Python {platform.python_version()}.",
        "",
        "| workers | floor (pyzmq + msgpack + MAC) | ClusterEnv.step | ratio | per worker, ClusterEnv |",
        "|---|---|---|---|---|",
    ]
    for n in args.workers:
        floor = statistics.median(cells[f"{n}:floor"])
        ours = statistics.median(cells[f"{n}:clusterenv"])
        lines.append(
            f"| {n} | {floor * 1e6:,.0f} µs | {ours * 1e6:,.0f} µs | {ours / floor:.2f}x | {ours / n * 1e6:,.0f} µs |"
        )
    table = "\n".join(lines)
    print(table)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "learner_cpu.md").write_text(table + "\n")
    (RESULTS_DIR / "learner_cpu.json").write_text(
        json.dumps({"args": dataclasses.asdict(args), "cells": cells}, indent=1) + "\n"
    )


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args)))
