"""A worker's own CPU per step of 8 CartPoles, on the shared step path and on the message path, against Sync.

The worker's CPU time is read from ``/proc`` (``ClusterEnv.worker_info["cpu_s"]``) over the
timed steps: its envs' steps, reading the command and writing the results, and its wake-ups.
``SyncVectorEnv`` stepping the same 8 CartPoles in this process gives the envs' own cost. A
fourth row is the worker's step alone: its ``_SharedStepper._step`` driven in this process
against a region of its own, with no learner and no wait, so that the step and its wait can
be told apart (it reaches into private names: a benchmark, not an API). Rounds alternate the
four, and the medians are reported.

    python benchmarks/probes/worker_step.py             # 3 rounds of 10,000 steps
    python benchmarks/probes/worker_step.py --quick

Writes ``results/worker_step.json`` and ``results/worker_step.md``.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import cloudpickle
import gymnasium as gym
import numpy as np
import tyro
from gymnasium.vector import AutoresetMode

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # support (report, bench_envs), one level up
from support.report import command_line, write_report  # noqa: E402

from clusterenv import ClusterEnv  # noqa: E402
from clusterenv.wire.leaves import unflatten  # noqa: E402
from clusterenv.wire.step_region import COUNTER, StepRegion, attach_rows  # noqa: E402
from clusterenv.worker.commands import Worker  # noqa: E402
from clusterenv.worker.shared_steps import _SharedStepper  # noqa: E402
from clusterenv.worker.units import build_worker_envs  # noqa: E402

NUM_ENVS = 8


@dataclasses.dataclass
class Args:
    rounds: int = 3
    steps: int = 10000
    quick: bool = False
    """one round of 500 steps: to try the script"""


def _actions(steps: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 2, NUM_ENVS) for _ in range(steps)]


def sync_us_per_step(steps: int) -> float:
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * NUM_ENVS)
    envs.reset(seed=0)
    actions = _actions(steps)
    started = time.process_time()
    for action in actions:
        envs.step(action)
    cpu = time.process_time() - started
    envs.close()
    return cpu / steps * 1e6


class _Mailbox:
    """What ``_SharedStepper._step`` uses of a mailbox: a reply is dropped, a wake-up is not needed."""

    seq = None

    def send(self, reply: object, sender: object) -> None:
        pass

    class channel:  # noqa: N801
        @staticmethod
        def wake() -> None:
            pass


def step_alone_us_per_step(steps: int) -> float:
    """The worker's ``_step`` in this process: commands written straight into a region, no wait between them."""
    worker = Worker(0)
    blobs = [cloudpickle.dumps(lambda: gym.make("CartPole-v1"))] * NUM_ENVS
    worker.envs = envs = build_worker_envs(blobs, "same", AutoresetMode.NEXT_STEP, worker.tracker, None, 0)
    worker.mailbox = _Mailbox()  # type: ignore[assignment]
    envs.reset(seed=0)
    region = StepRegion(envs.single_observation_space, envs.single_action_space, [slice(0, NUM_ENVS)])
    rows = attach_rows(os.dup(region.fd), region.meta(0, 0.0), envs.single_observation_space, envs.single_action_space)
    assert rows is not None
    envs.observe_into(unflatten(envs.single_observation_space, rows.observations))
    stepper = _SharedStepper(worker)
    stepper.rows = rows
    actions = _actions(steps)
    started = time.process_time()
    for counter, action in enumerate(actions, start=1):
        region.actions[0][:] = action
        rows.command[COUNTER] = counter
        stepper._step(rows)
    cpu = time.process_time() - started
    envs.close()
    region.close()
    return cpu / steps * 1e6


def worker_us_per_step(steps: int, shared_memory: bool) -> float:
    with ClusterEnv([lambda: gym.make("CartPole-v1")] * NUM_ENVS, num_workers=1, shared_memory=shared_memory) as envs:
        assert envs.worker_info[0]["step_path"] == ("shared memory" if shared_memory else "messages")
        envs.reset(seed=0)
        actions = _actions(steps)
        for action in actions[:200]:  # warm up
            envs.step(action)
        started = envs.worker_info[0]["cpu_s"]
        for action in actions:
            envs.step(action)
        cpu = envs.worker_info[0]["cpu_s"] - started
    return cpu / steps * 1e6


def main(args: Args) -> None:
    if args.quick:
        args.rounds, args.steps = 1, 500
    runs: dict[str, list[float]] = {"sync": [], "shared memory": [], "messages": [], "step alone": []}
    for _ in range(args.rounds):
        runs["sync"].append(sync_us_per_step(args.steps))
        runs["step alone"].append(step_alone_us_per_step(args.steps))
        runs["shared memory"].append(worker_us_per_step(args.steps, shared_memory=True))
        runs["messages"].append(worker_us_per_step(args.steps, shared_memory=False))
    medians = {name: statistics.median(values) for name, values in runs.items()}
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    sync = medians["sync"]
    lines = [
        f"`{command_line(__file__)}`, {date}, {os.cpu_count()} cores: CPU per step of {NUM_ENVS} CartPole-v1 envs, "
        f"medians of {args.rounds} alternated rounds of {args.steps:,} steps. The worker's CPU is its process's, "
        "from /proc (clock ticks: 10 ms granularity over the whole run).",
        "",
        "| who steps the 8 envs | CPU per step (µs) | per env (µs) | against Sync |",
        "|---|---:|---:|---:|",
        f"| `SyncVectorEnv`, in the process | {sync:.1f} | {sync / NUM_ENVS:.2f} | 1.00x |",
    ]
    for name in ("shared memory", "messages"):
        value = medians[name]
        lines.append(
            f"| a clusterenv worker, {name} path | {value:.1f} | {value / NUM_ENVS:.2f} | {value / sync:.2f}x |"
        )
    alone = medians["step alone"]
    lines.append(
        f"| the worker's step alone (`_SharedStepper._step`, in the process, no wait) | {alone:.1f} "
        f"| {alone / NUM_ENVS:.2f} | {alone / sync:.2f}x |"
    )
    text = "\n".join(lines) + "\n"
    payload = {"date": date, "cores": os.cpu_count(), "args": dataclasses.asdict(args), "medians_us": medians}
    write_report("worker_step", text, {**payload, "runs": runs})


if __name__ == "__main__":
    main(tyro.cli(Args))
