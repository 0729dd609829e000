"""What observations from another host cost the learner: CPU per env step, against bare pyzmq, with compression.

Workers on another host send every observation as frames over tcp. Here they connect over
tcp loopback with shared memory off (``shared_memory=False``), which is what the learner sees
of them. Two cells:

* **Atari-size frames**: 84x84x4 uint8 stacks, real ones (Breakout, preprocessed and stacked as
  CleanRL's PPO sees them, recorded once and replayed: ``FrameReplayEnv`` costs no CPU per step),
  ``--atari-envs`` envs on ``--atari-workers`` workers. Backends: the floor (bare pyzmq: per
  reply a keyed BLAKE3 MAC over every frame, a msgpack header, the frames copied into the batch
  and the batch copied out, as ``copy=True`` does), and ClusterEnv without compression, with
  ``"lz4"`` and with ``"zstd"``.
* **Small observations**: 4 floats, ``--small-envs`` envs on ``--small-workers`` workers, with the
  default compression (``"lz4"``: their rewards and observation frames are over 4 KB per worker).

Each run starts its backend, steps 20 untimed batches, then times ``--seconds``; backends
alternate, ``--repeats`` rounds, medians. Reported per env step: the learner process's CPU
(``time.process_time``: every thread, ZeroMQ's I/O thread included), and the bytes that
crossed loopback (``/proc/net/dev``, both directions, TCP/IP headers included); and env-steps/s.

    python benchmarks/probes/ingest.py            # ~2 minutes on 2 cores
    python benchmarks/probes/ingest.py --quick    # a smoke run

Writes ``results/ingest.md`` and ``results/ingest.json``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tyro
from tqdm import tqdm

# This folder, then benchmarks/ (support.bench_envs, support.report): the workers inherit the path.
sys.path[:0] = [str(folder) for folder in Path(__file__).resolve().parents[:2]]
from learner_cpu import _check, _frames, hello_dealer, worker_router  # noqa: E402
from support.bench_envs import FrameReplayEnv, SleepEnv, record_breakout  # noqa: E402
from support.report import command_line  # noqa: E402

from clusterenv import ClusterEnv  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
# Env i replays the recording from here on, so that a batch holds different frames, as from different envs.
OFFSET_STRIDE = 37


@dataclasses.dataclass
class Args:
    quick: bool = False
    """smoke run: 1 s runs, one round"""
    atari_envs: int = 64
    """envs with 84x84x4 uint8 observations"""
    atari_workers: int = 2
    """their workers (each reply carries atari_envs / atari_workers frames)"""
    small_envs: int = 4096
    """envs with 4-float observations"""
    small_workers: int = 4
    """their workers"""
    seconds: float = 3.0
    """timed seconds per run"""
    repeats: int = 3
    """rounds (backends alternate within each); medians are reported"""
    codecs: tuple[str, ...] = ("none", "lz4", "zstd")
    """ClusterEnv's compression settings to run"""


@dataclasses.dataclass
class Run:
    cpu_us: float  # learner CPU per env step
    rate: float  # env-steps/s
    wire_bytes: float  # loopback bytes per env step


def loopback_bytes() -> int:
    """Bytes received on the loopback interface so far (each byte sent on it is received once)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[0])
    raise RuntimeError("No loopback interface in /proc/net/dev.")


def timed(step: Callable[[], None], num_envs: int, seconds: float) -> Run:
    for _ in range(20):
        step()
    steps, cpu, wall, wire = 0, time.process_time(), time.perf_counter(), loopback_bytes()
    while time.perf_counter() - wall < seconds:
        step()
        steps += 1
    cpu, wall, wire = time.process_time() - cpu, time.perf_counter() - wall, loopback_bytes() - wire
    env_steps = steps * num_envs
    return Run(cpu / env_steps * 1e6, env_steps / wall, wire / env_steps)


def clusterenv_run(env_fns: list, num_workers: int, codec: str, seconds: float) -> Run:
    compression = None if codec == "none" else codec
    with ClusterEnv(
        env_fns, num_workers=num_workers, bind="tcp://127.0.0.1:*", shared_memory=False, compression=compression
    ) as envs:
        envs.reset(seed=0)
        actions = np.zeros(envs.num_envs, dtype=np.int64)
        return timed(lambda: envs.step(actions), envs.num_envs, seconds)


def floor_worker(address: str, identity: bytes, key: bytes, path: str, offsets: list[int]) -> None:
    """One bare-pyzmq worker: check the command's MAC, gather its envs' next frames, reply with them."""
    context, socket = hello_dealer(address, identity)
    recording = np.load(path)
    rows = np.array(offsets)
    obs = np.empty((len(offsets), *recording.shape[1:]), np.uint8)
    reward, done = np.zeros(len(offsets)), np.zeros(len(offsets), np.bool_)
    while True:
        frames = socket.recv_multipart(copy=False)
        if frames[0].bytes == b"stop":
            break
        _check(key, frames)
        rows += 1
        np.take(recording, rows % len(recording), axis=0, out=obs)
        socket.send_multipart(_frames(key, 103, [obs, reward, done, done]), copy=False)
    socket.close()
    context.term()


def floor_run(path: str, num_envs: int, num_workers: int, seconds: float) -> Run:
    key = secrets.token_bytes(32)
    per = num_envs // num_workers
    offsets = [[(w * per + i) * OFFSET_STRIDE for i in range(per)] for w in range(num_workers)]
    shape = np.load(path, mmap_mode="r").shape[1:]
    # Each worker gets its own envs' offsets: worker_router passes the same arguments to all, so index by identity.
    with worker_router(num_workers, _floor_worker_by_identity, key, path, offsets, tcp=True) as (router, identities):
        batch = np.zeros((num_envs, *shape), np.uint8)
        rewards, terminations, truncations = (
            np.zeros(num_envs),
            np.zeros(num_envs, np.bool_),
            np.zeros(num_envs, np.bool_),
        )
        index = {identity: i for i, identity in enumerate(identities)}
        action = np.zeros((per,), np.int64)

        def step() -> None:
            for identity in identities:
                router.send_multipart([identity, *_frames(key, 3, [action])], copy=False)
            for _ in identities:
                sender, *frames = router.recv_multipart(copy=False)
                sl = slice(index[sender.bytes] * per, (index[sender.bytes] + 1) * per)
                batch[sl], rewards[sl], terminations[sl], truncations[sl] = _check(key, frames)
            batch.copy()  # what copy=True returns

        return timed(step, num_envs, seconds)


def _floor_worker_by_identity(address: str, identity: bytes, key: bytes, path: str, offsets: list[list[int]]) -> None:
    floor_worker(address, identity, key, path, offsets[int(identity[1:])])


def main(args: Args) -> None:
    if args.quick:
        args = dataclasses.replace(args, seconds=1.0, repeats=1)
    runs: dict[str, list[Run]] = {}
    with tempfile.TemporaryDirectory(prefix="clusterenv-ingest-") as scratch:
        path = os.path.join(scratch, "breakout.npy")
        record_breakout(path)
        atari_fns = [functools.partial(FrameReplayEnv, path, i * OFFSET_STRIDE) for i in range(args.atari_envs)]
        small_fns = [functools.partial(SleepEnv, 0.0)] * args.small_envs
        jobs: dict[str, Callable[[], Run]] = {
            "atari:floor": lambda: floor_run(path, args.atari_envs, args.atari_workers, args.seconds)
        }
        for codec in args.codecs:
            jobs[f"atari:{codec}"] = functools.partial(
                clusterenv_run, atari_fns, args.atari_workers, codec, args.seconds
            )
        jobs["small:lz4"] = functools.partial(clusterenv_run, small_fns, args.small_workers, "lz4", args.seconds)
        for name, job in tqdm([(n, j) for _ in range(args.repeats) for n, j in jobs.items()], desc="ingest"):
            runs.setdefault(name, []).append(job())
    medians = {
        name: Run(*(statistics.median(getattr(r, f.name) for r in rs) for f in dataclasses.fields(Run)))
        for name, rs in runs.items()
    }
    floor = medians["atari:floor"]
    cores = len(os.sched_getaffinity(0))
    lines = [
        f"`{command_line(__file__)}` on {platform.node()}, {cores} cores, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; tcp loopback, shared memory off; medians of "
        f"{args.repeats} alternated runs of {args.seconds:g} s.",
        "",
        f"84x84x4 uint8 observations (Breakout frames), {args.atari_envs} envs on {args.atari_workers} workers:",
        "",
        "| backend | learner CPU per env step | vs floor | env-steps/s | bytes on the wire per env step |",
        "|---|---|---|---|---|",
    ]
    for name, run in medians.items():
        if name.startswith("atari:"):
            label = (
                "bare pyzmq + BLAKE3 MAC (floor)" if name == "atari:floor" else f"ClusterEnv, compression={name[6:]}"
            )
            lines.append(
                f"| {label} | {run.cpu_us:.1f} µs | {run.cpu_us / floor.cpu_us:.2f}x | {run.rate:,.0f} | "
                f"{run.wire_bytes:,.0f} |"
            )
    small = medians["small:lz4"]
    lines += [
        "",
        f"4-float observations, {args.small_envs} envs on {args.small_workers} workers, compression=lz4: learner CPU "
        f"{small.cpu_us:.2f} µs per env step, {small.rate:,.0f} env-steps/s, {small.wire_bytes:.0f} bytes per env step.",
    ]
    table = "\n".join(lines)
    print(table)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "ingest.md").write_text(table + "\n")
    raw = {name: [dataclasses.asdict(r) for r in rs] for name, rs in runs.items()}
    (RESULTS_DIR / "ingest.json").write_text(
        json.dumps({"args": dataclasses.asdict(args), "cores": cores, "runs": raw}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main(tyro.cli(Args))
