"""The learner's cost of batching a step's infos: per-env replay against placing packed slices.

Atari's infos (``lives``, ``episode_frame_number``, ``frame_number``: three Python ints per env)
for a batch of envs split into equal worker slices. Per batch step, the learner either unpickles
each worker's per-env records and replays them through Gymnasium's ``VectorEnv._add_info``
(what it did before), or unpickles each worker's packed slice and places its columns
(``clusterenv.wire.infos``). The workers' cost of packing is reported too: it runs in parallel,
on the workers. Medians of ``--repeats`` timings of ``--number`` batch steps.

    python benchmarks/probes/info_merge.py
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import statistics
import sys
import timeit
from pathlib import Path
from typing import Any

import tyro

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # support (report, bench_envs), one level up
from support.report import command_line  # noqa: E402

from clusterenv.wire.infos import merge_infos, pack_infos, replay_infos  # noqa: E402


@dataclasses.dataclass
class Args:
    splits: tuple[str, ...] = ("16x1", "8x2", "4x4", "2x8", "4x16", "4x64")
    """batches as WORKERSxENVS_PER_WORKER"""
    number: int = 2000
    """batch steps per timing"""
    repeats: int = 5
    """timings per cell; the median is reported"""


def atari_records(first: int, count: int) -> list[tuple[int, dict[str, Any]]]:
    return [
        (i, {"lives": 3, "episode_frame_number": 4 * (first + i), "frame_number": 100 + first + i})
        for i in range(count)
    ]


def replay(blobs: list[bytes], num_envs: int, per_worker: int) -> None:
    infos: dict[str, Any] = {}
    for w, blob in enumerate(blobs):
        infos = replay_infos(infos, pickle.loads(blob), num_envs, w * per_worker)


def place(blobs: list[bytes], num_envs: int, per_worker: int) -> None:
    infos: dict[str, Any] = {}
    for w, blob in enumerate(blobs):
        infos = merge_infos(infos, pickle.loads(blob), num_envs, w * per_worker)


def pack(records: list[tuple[int, dict[str, Any]]], per_worker: int) -> None:
    pickle.dumps(pack_infos(records, per_worker, min_envs=1))


def main(args: Args) -> None:
    print(f"`{command_line(__file__)}` — Atari infos, µs per batch step\n")
    print("| workers x envs | learner: replay records | learner: place packed | worker: pack (per worker) |")
    print("|---|---:|---:|---:|")
    for split in args.splits:
        workers, per_worker = map(int, split.split("x"))
        num_envs = workers * per_worker
        records = [atari_records(w * per_worker, per_worker) for w in range(workers)]
        as_records = [pickle.dumps(r) for r in records]
        as_packed = [pickle.dumps(pack_infos(r, per_worker, min_envs=1)) for r in records]
        jobs = [
            functools.partial(replay, as_records, num_envs, per_worker),
            functools.partial(place, as_packed, num_envs, per_worker),
            functools.partial(pack, records[0], per_worker),
        ]
        cells = [
            statistics.median(timeit.repeat(job, number=args.number, repeat=args.repeats)) / args.number * 1e6
            for job in jobs
        ]
        print(f"| {workers} x {per_worker} | {cells[0]:,.1f} | {cells[1]:,.1f} | {cells[2]:,.1f} |")


if __name__ == "__main__":
    main(tyro.cli(Args))
