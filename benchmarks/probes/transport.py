"""Per-step cost of tcp (loopback) against ipc between the learner and its workers.

Workers on other hosts talk tcp, and on tcp the MAC also covers every observation
frame (on ipc the 0700 socket directory authenticates the peer, so arrays are not
hashed). This measures what that costs, on one machine: each worker has its own tcp
connection to the learner (its own ephemeral port on loopback), against the default
private ipc socket. A trivial env returning a fixed observation of a chosen size keeps
the env's own cost out of the numbers; three sizes span CartPole (16 B), an 84x84x4
Atari stack (28 KB) and a raw Atari frame (100 KB) per env.

Both ends are on one host here, where large observations would otherwise go through shared
memory on both transports; the run switches that off (``shared_memory=False``) so that what
is measured is what crosses the wire between hosts. tcp runs with the default
``compression="lz4"``.

Two tables: end-to-end vector steps per second, and the encode+decode cost of one
worker reply with and without array MACs (pure functions, no sockets: the MAC's share).

    python benchmarks/probes/transport.py            # ~1 minute on 2 cores
    python benchmarks/probes/transport.py --quick    # a smoke run

Writes ``results/transport.md`` and prints it.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import tyro

from clusterenv import ClusterEnv
from clusterenv.wire.protocol import NONCE_BYTES, Kind, decode, pack, session_pair

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
SIZES = {"16 B (CartPole)": (4,), "28 KB (84x84x4)": (84, 84, 4), "100 KB (210x160x3)": (210, 160, 3)}


@dataclasses.dataclass
class Args:
    quick: bool = False
    """smoke run: 1 s cells, one repeat"""
    seconds: float = 3.0
    """timed seconds per cell"""
    repeats: int = 3
    """timed runs per cell; the median is reported"""
    num_envs: int = 8
    """envs in the vector env"""
    num_workers: int = 2
    """worker processes (each with its own connection)"""


class PayloadEnv(gym.Env):
    """Returns the same observation of ``shape`` every step; episodes never end."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, shape: tuple[int, ...]) -> None:
        dtype = np.float32 if len(shape) == 1 else np.uint8
        self.observation_space = gym.spaces.Box(0, 1, shape=shape, dtype=dtype)
        self.action_space = gym.spaces.Discrete(2)
        self._obs = np.zeros(shape, dtype=dtype)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        return self._obs, {}

    def step(self, action):
        return self._obs, 0.0, False, False, {}


def timed_rate(envs: ClusterEnv, seconds: float) -> float:
    actions = np.zeros(envs.num_envs, dtype=np.int64)
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            envs.step(actions)
        steps += 20
    return steps / (time.perf_counter() - start)


def steps_per_second(shape: tuple[int, ...], args: Args) -> tuple[float, float]:
    """Median vector steps/s over ipc and over tcp, timed alternately so that load drift hits both alike."""
    fns = [lambda: PayloadEnv(shape)] * args.num_envs
    with (
        ClusterEnv(fns, num_workers=args.num_workers, shared_memory=False) as ipc,
        ClusterEnv(fns, num_workers=args.num_workers, bind="tcp://127.0.0.1:*", shared_memory=False) as tcp,
    ):
        rates: dict[str, list[float]] = {"ipc": [], "tcp": []}
        for envs in (ipc, tcp):
            envs.reset(seed=0)
            timed_rate(envs, 0.2)  # warm-up
        for _ in range(args.repeats):
            for name, envs in (("ipc", ipc), ("tcp", tcp)):
                rates[name].append(timed_rate(envs, args.seconds))
    return statistics.median(rates["ipc"]), statistics.median(rates["tcp"])


def codec_microseconds(shape: tuple[int, ...], envs_per_worker: int, cover_arrays: bool) -> float:
    """Packing and decoding one worker's step reply (obs, rewards, terminations, truncations)."""
    learner, worker = session_pair(b"k" * 32, b"w" * NONCE_BYTES, b"l" * NONCE_BYTES, b"worker-0")
    obs = np.zeros((envs_per_worker, *shape), dtype=np.float32 if len(shape) == 1 else np.uint8)
    arrays = [obs, np.zeros(envs_per_worker), np.zeros(envs_per_worker, bool), np.zeros(envs_per_worker, bool)]
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.5:
        n += 1
        message = pack(
            Kind.RESULT, {"seq": n}, arrays, [b""], key=worker.send_key, counter=n, cover_arrays=cover_arrays
        )
        decode(message, key=learner.recv_key, cover_arrays=cover_arrays)
    return (time.perf_counter() - start) / n * 1e6


def main(args: Args) -> None:
    if args.quick:
        args = dataclasses.replace(args, seconds=1.0, repeats=1)
    rows = []
    for label, shape in SIZES.items():
        ipc, tcp = steps_per_second(shape, args)
        extra_us = (1 / tcp - 1 / ipc) * 1e6
        rows.append(f"| {label} | {ipc:,.0f} | {tcp:,.0f} | {tcp / ipc:.2f} | {extra_us:+.0f} |")
        print(rows[-1], flush=True)
    per_worker = args.num_envs // args.num_workers
    codec_rows = []
    for label, shape in SIZES.items():
        plain = codec_microseconds(shape, per_worker, cover_arrays=False)
        covered = codec_microseconds(shape, per_worker, cover_arrays=True)
        codec_rows.append(f"| {label} | {plain:.1f} | {covered:.1f} | {covered - plain:+.1f} |")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    report = "\n".join(
        [
            "# tcp (loopback) vs ipc transport",
            "",
            f"`python benchmarks/probes/transport.py{' --quick' if args.quick else ''}` on {platform.node()}, "
            f"{cores} cores, Python {platform.python_version()}; {args.num_envs} envs on {args.num_workers} workers, "
            f"median of {args.repeats} × {args.seconds:g} s, ipc and tcp timed alternately.",
            "",
            "## Vector steps per second (whole `ClusterEnv.step`, trivial env)",
            "",
            "| observation per env | ipc | tcp | tcp/ipc | tcp extra µs per step |",
            "|---|---|---|---|---|",
            *rows,
            "",
            f"## One worker reply ({per_worker} envs): encode + decode, µs",
            "",
            "| observation per env | arrays not MACed (ipc) | arrays MACed (tcp) | MAC cost |",
            "|---|---|---|---|",
            *codec_rows,
            "",
        ]
    )
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "transport.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main(tyro.cli(Args))
