"""Does a learning update run slower beside spinning workers than beside blocking ones?

After each step a worker spins for its next command before it blocks (``spin_us``); a PPO
update between two rollouts must not lose its cores to that. Here a learner steps 8 CartPoles
(``num_workers=1, learner_envs=4``) for a rollout of 128 steps, then times a PPO-sized update
on the CPU (CleanRL's CartPole agent: 4 epochs of 4 minibatches over 1,024 samples), with the
workers spinning (the default) and blocking (``spin_us=0``), alternated, medians.

    python benchmarks/probes/update_beside_spinning.py              # 5 rounds of 10 updates
    python benchmarks/probes/update_beside_spinning.py --rounds 1   # to try it

Writes ``results/update_beside_spinning.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.report import command_line, write_report  # noqa: E402  (benchmarks/support/report.py)

from clusterenv import ClusterEnv  # noqa: E402


@dataclasses.dataclass
class Args:
    rounds: int = 5
    """alternated rounds; each times ``updates`` updates per setting"""
    updates: int = 10


def agent() -> torch.nn.Module:
    """CleanRL's CartPole actor and critic, as one module."""
    return torch.nn.ModuleDict(
        {
            name: torch.nn.Sequential(
                torch.nn.Linear(4, 64),
                torch.nn.Tanh(),
                torch.nn.Linear(64, 64),
                torch.nn.Tanh(),
                torch.nn.Linear(64, out),
            )
            for name, out in (("actor", 2), ("critic", 1))
        }
    )


def update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, obs: torch.Tensor) -> None:
    """4 epochs of 4 minibatches, as ``examples/ppo_cartpole.py`` does with 8 envs x 128 steps."""
    for _ in range(4):
        for batch in torch.randperm(len(obs)).chunk(4):
            logits, values = model["actor"](obs[batch]), model["critic"](obs[batch])
            loss = torch.distributions.Categorical(logits=logits).entropy().mean() + values.pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def time_updates(spin_us: float | None, updates: int) -> list[float]:
    """Seconds per update, each right after a rollout of 128 lockstep steps."""
    torch.manual_seed(0)
    model = agent()
    optimizer = torch.optim.Adam(model.parameters(), lr=2.5e-4)
    fns = [functools.partial(gym.make, "CartPole-v1")] * 8
    times = []
    with ClusterEnv(fns, num_workers=1, learner_envs=4, spin_us=spin_us) as envs:
        obs, _ = envs.reset(seed=0)
        rng = np.random.default_rng(0)
        for _ in range(updates):
            rollout = []
            for _ in range(128):
                obs = envs.step(rng.integers(0, 2, 8))[0]
                rollout.append(obs)
            batch = torch.as_tensor(np.concatenate(rollout))
            started = time.perf_counter()
            update(model, optimizer, batch)
            times.append(time.perf_counter() - started)
        spin = envs.learner_info["spin"]
    print(f"spin_us={spin_us} ({spin}): median update {statistics.median(times) * 1e3:.1f} ms", flush=True)
    return times


def main(args: Args) -> None:
    torch.set_num_threads(1)  # the learner's one core: the update competes with a spinning worker for the other
    settings = {"spinning (default)": None, "blocking (spin_us=0)": 0.0}
    runs: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(args.rounds):
        for name, spin_us in settings.items():
            runs[name].extend(time_updates(spin_us, args.updates))
    medians = {name: statistics.median(times) * 1e3 for name, times in runs.items()}
    ratio = medians["spinning (default)"] / medians["blocking (spin_us=0)"]
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = (
        f"`{command_line(__file__)}`, {date}: a PPO update (4 x 4 minibatches of 1,024 CartPole samples, torch on 1 "
        f"thread) right after 128 steps of 8 envs (`num_workers=1, learner_envs=4`), {args.rounds} alternated rounds "
        f"of {args.updates} updates, medians.\n\n| workers | update (ms) |\n|---|---:|\n"
        + "".join(f"| {name} | {value:.1f} |\n" for name, value in medians.items())
        + f"\nbeside spinning / beside blocking: {ratio:.3f}x\n"
    )
    write_report("update_beside_spinning", text)


if __name__ == "__main__":
    main(tyro.cli(Args))
