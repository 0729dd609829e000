"""What one wake-up each way costs the learner: a Unix socket pair, a pipe, or an eventfd, same run.

The shared step path signals a command and a reply with one byte each way. This times that
signal alone, as the learner pays it: two forked workers block on their wake-up, burn
``--work-us`` of CPU (a cheap env's step), and wake the learner, which wakes both, burns half
as much and then blocks reading both replies (no spinning anywhere). Reported: wall time per
round and the learner's CPU per round beyond its own burn, medians of alternated rounds.

Two more rows give the worker's wait the shape it has in clusterenv: ``select`` over two
descriptors and then a read (how a worker waited on its pipe and its wake socket together),
against one read bounded by ``SO_RCVTIMEO`` (how it waits now, on its pipe alone, where the
learner's wake-ups come as records).

    python benchmarks/probes/wakeups.py

Writes ``results/wakeups.md``.
"""

from __future__ import annotations

import dataclasses
import os
import select
import socket
import statistics
import struct
import sys
import time
from pathlib import Path

import tyro

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # support (report, bench_envs), one level up
from support.report import command_line, write_report  # noqa: E402


@dataclasses.dataclass
class Args:
    rounds: int = 5
    steps: int = 5000
    work_us: float = 30.0


def _burn(us: float) -> None:
    until = time.perf_counter() + us * 1e-6
    while time.perf_counter() < until:
        pass


SELECT_THEN_READ = "socket pair, the worker's select over 2 descriptors, then a read"
BOUNDED_READ = "socket pair, one read bounded by SO_RCVTIMEO each side"
_BOUND = (0, 50_000)  # 50 ms, as the learner's wait


def _channel(kind: str) -> tuple[int, int, int, int, object]:
    """(learner writes, learner reads, worker reads, worker writes, what keeps them open)."""
    if kind in (SELECT_THEN_READ, BOUNDED_READ):
        ours, theirs = socket.socketpair()
        idle = socket.socketpair()  # the worker's second descriptor, on which nothing comes
        if kind == BOUNDED_READ:
            for end in (ours, theirs):
                end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", *_BOUND))
        return ours.fileno(), ours.fileno(), theirs.fileno(), theirs.fileno(), (ours, theirs, *idle)
    if kind == "pipe":
        command_r, command_w = os.pipe()
        reply_r, reply_w = os.pipe()
        return command_w, reply_r, command_r, reply_w, None
    if kind == "eventfd":
        command, reply = os.eventfd(0), os.eventfd(0)
        return command, reply, command, reply, None
    ours, theirs = socket.socketpair()
    return ours.fileno(), ours.fileno(), theirs.fileno(), theirs.fileno(), (ours, theirs)


def _signal(kind: str, fd: int) -> None:
    if kind == "eventfd":
        os.eventfd_write(fd, 1)
    else:
        os.write(fd, b"w")


def _wait(kind: str, fd: int, keep: object = None) -> None:
    if kind == "eventfd":
        os.eventfd_read(fd)
        return
    if kind == SELECT_THEN_READ and keep is not None:  # the worker's wait
        select.select([fd, keep[2].fileno()], [], [])  # type: ignore[index]
    os.read(fd, 64)


def run(kind: str, steps: int, work_us: float) -> tuple[float, float]:
    channels = [_channel(kind) for _ in range(2)]
    pids = []
    for _, _, worker_reads, worker_writes, keep in channels:
        pid = os.fork()
        if pid == 0:
            for _ in range(steps):
                _wait(kind, worker_reads, keep)
                _burn(work_us)
                _signal(kind, worker_writes)
            os._exit(0)
        pids.append(pid)
    started, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        for learner_writes, *_ in channels:
            _signal(kind, learner_writes)
        _burn(work_us / 2)
        for _, learner_reads, *_ in channels:
            _wait(kind, learner_reads)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    for pid in pids:
        os.waitpid(pid, 0)
    for channel in channels:
        for fd in {channel[0], channel[1], channel[2], channel[3]} if channel[4] is None else ():
            os.close(fd)
    return wall / steps * 1e6, cpu / steps * 1e6 - work_us / 2


def main(args: Args) -> None:
    kinds = ("socket pair", "pipe", "eventfd", SELECT_THEN_READ, BOUNDED_READ)
    results: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            results[kind].append(run(kind, args.steps, args.work_us))
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"`{command_line(__file__)}`, {date}, {os.cpu_count()} cores: one round = the learner wakes 2 workers, each "
        f"burns {args.work_us:g} µs and wakes it back; medians of {args.rounds} alternated runs of {args.steps:,} "
        "rounds.",
        "",
        "| wake-up | wall per round (µs) | learner CPU per round beyond its own work (µs) |",
        "|---|---:|---:|",
    ]
    for kind, values in results.items():
        wall = statistics.median(v[0] for v in values)
        cpu = statistics.median(v[1] for v in values)
        lines.append(f"| {kind} | {wall:.1f} | {cpu:.1f} |")
    text = "\n".join(lines) + "\n"
    write_report("wakeups", text)


if __name__ == "__main__":
    main(tyro.cli(Args))
