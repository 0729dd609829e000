"""Cheap envs on one host: clusterenv against Sync, Async, EnvPool and the bare shared-memory floor, same run.

Each cell steps ``num_envs`` envs in lockstep for ``--seconds`` per backend, in a fresh
process per run; backends take turns, cell by cell, for ``--rounds`` rounds, and the
medians are reported. ``floor`` is :class:`support.shm_floor.ShmFloor`, the bare shared-memory
lockstep loop: what this machine allows such a step path (its wake-ups included). For
clusterenv and the floor the learner's CPU per worker message is measured too: the
learner process's CPU time (all its threads) over the timed steps, divided by the
messages (workers x batch steps). Before timing, the floor is checked bit-identical to
``SyncVectorEnv`` on CartPole-v1 (and on HalfCheetah-v5 and ALE/Pong-v5 with their infos, where
MuJoCo and ale-py are installed). ``spin_floor`` is :class:`support.spin_floor.SpinFloor`: the learner steps half the envs
and one forked worker the other half, both spinning, never a wake-up (infos dropped);
``split`` is clusterenv in that shape (``num_workers=1, learner_envs=n // 2``, its default
spin). For Sync, clusterenv and the floor, the CPU each env step costs in the process that
steps it (the workers', from ``/proc``) is reported too. ``pong_x16`` is raw ``ALE/Pong-v5``
(210x160x3 frames, ale-py's ``lives``/``episode_frame_number``/``frame_number`` infos, which the
floor carries too and checks exact); EnvPool's Pong beside it differs as the table's note says.

Before timing, clusterenv is also checked as each cell runs it: bit-identical to
``SyncVectorEnv`` (infos included) over lockstep steps, its workers on the shared step path,
and what each step's replies were (:class:`support.step_paths.PathCount`: results and infos in the
region, or a message, and why).

    pip install -e ".[bench]"
    python benchmarks/onehost.py                 # every cell, 3 rounds of 3 s
    python benchmarks/onehost.py --quick         # one round of 1 s, to try it

Writes ``results/onehost.json`` and ``results/onehost.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import tyro
from support.report import command_line, write_report

HERE = Path(__file__).resolve().parent
CORES = os.cpu_count() or 1

#: cell -> (env, number of envs, workers); env is a Gymnasium id or a support.bench_envs class.
CELLS: dict[str, tuple[str, int, int]] = {
    "cartpole_x16": ("CartPole-v1", 16, 2),
    "cartpole_x64": ("CartPole-v1", 64, 2),
    "halfcheetah_x16": ("HalfCheetah-v5", 16, 2),
    "burn50us_x16": ("BurnEnv", 16, 2),
    "null_x16": ("NullEnv", 16, 2),
    "cartpole_x8": ("CartPole-v1", 8, 2),
    "pong_x16": ("ALE/Pong-v5", 16, 2),
}
#: env -> (EnvPool's id, its options). Pong's ask EnvPool for raw ALE v5 as closely as it goes: full-size RGB,
#: no stacking, no resets on life loss, no reward clipping, sticky actions 0.25, frameskip 4, at most one no-op at
#: reset. What still differs (the table says so): channel-first (3, 210, 160) frames, max-pooled over the last 2
#: frames of each frameskip, and no infos in the region's sense (EnvPool's own info dict).
ENVPOOL: dict[str, tuple[str, dict[str, Any]]] = {
    "CartPole-v1": ("CartPole-v1", {}),
    "HalfCheetah-v5": ("HalfCheetah-v5", {}),
    "ALE/Pong-v5": (
        "Pong-v5",
        {
            "img_height": 210,
            "img_width": 160,
            "gray_scale": False,
            "stack_num": 1,
            "frame_skip": 4,
            "noop_max": 1,
            "episodic_life": False,
            "reward_clip": False,
            "use_fire_reset": False,
            "repeat_action_probability": 0.25,
            "max_episode_steps": 27000,
        },
    ),
}
HALFCHEETAH_INFOS = ("x_position", "x_velocity", "reward_forward", "reward_ctrl")
#: What an ale-py env reports in its infos, every step and reset: numbers, so they travel in the step region.
ATARI_INFOS = ("lives", "episode_frame_number", "frame_number")
#: env -> the info keys the floor carries (in the order the env reports them); other envs report none.
INFO_KEYS = {"HalfCheetah-v5": HALFCHEETAH_INFOS, "ALE/Pong-v5": ATARI_INFOS}


@dataclasses.dataclass
class Args:
    cells: tuple[str, ...] = tuple(CELLS)
    """which cells to run"""
    backends: tuple[str, ...] = (
        "sync",
        "async",
        "envpool",
        "envpool_1t",
        "floor",
        "clusterenv",
        "messages",
        "spin_floor",
        "split",
    )
    """backends, in the order each round runs them (``messages``: clusterenv with ``shared_memory=False``;
    ``split``: clusterenv with ``num_workers=1, learner_envs=n // 2``)"""
    rounds: int = 3
    seconds: float = 3.0
    quick: bool = False
    """one round of 1 s: to try the script"""


# One run, in a fresh process: build the backend, warm up, time lockstep steps, print a JSON line.
_RUN = r"""
import json, os, sys, time
sys.path.insert(0, {benchmarks!r})
import gymnasium as gym, numpy as np
env, num_envs, workers, backend, seconds = {env!r}, {num_envs}, {workers}, {backend!r}, {seconds}

def factory():
    if env == "BurnEnv":
        from support.bench_envs import BurnEnv
        return lambda: BurnEnv(step_cpu_ms=0.05)
    if env == "NullEnv":
        from support.bench_envs import NullEnv
        return NullEnv
    if env.startswith("ALE/"):
        from support.bench_envs import make_atari
        return lambda: make_atari(env)
    return lambda: gym.make(env)

info_keys = {info_keys!r}
messages_per_step = 0
if backend == "sync":
    envs = gym.vector.SyncVectorEnv([factory()] * num_envs)
elif backend == "async":
    envs = gym.vector.AsyncVectorEnv([factory()] * num_envs)
elif backend.startswith("envpool"):
    import envpool
    threads = 1 if backend == "envpool_1t" else min(num_envs, os.cpu_count() or 1)
    envpool_id, envpool_options = {envpool!r}
    envs = envpool.make_gymnasium(envpool_id, num_envs=num_envs, num_threads=threads, seed=0, **envpool_options)
elif backend == "floor":
    from support.shm_floor import ShmFloor
    envs = ShmFloor([factory()] * num_envs, workers, info_keys)
    messages_per_step = workers
elif backend == "spin_floor":
    from support.spin_floor import SpinFloor
    envs = SpinFloor([factory()] * num_envs)
    messages_per_step = 1
elif backend == "split":  # clusterenv as the spinning floor splits the envs
    from clusterenv import ClusterEnv
    envs = ClusterEnv([factory()] * num_envs, num_workers=1, learner_envs=num_envs // 2)
    messages_per_step = 1
else:  # clusterenv: its default (the shared step path for these local workers), or the message path
    from clusterenv import ClusterEnv
    envs = ClusterEnv([factory()] * num_envs, num_workers=workers, shared_memory=backend == "clusterenv")
    assert {{w["step_path"] for w in envs.worker_info}} == {{"shared memory" if backend == "clusterenv" else "messages"}}
    messages_per_step = workers

def worker_pids():  # the processes that step the workers' envs, and how many envs they step
    if backend in ("clusterenv", "messages", "split"):
        return [w["pid"] for w in envs.worker_info], num_envs - envs.learner_envs
    if backend == "floor":
        return envs._pids, num_envs
    return [], num_envs

def cpu_s(pids):
    total = 0.0
    for pid in pids:
        with open(f"/proc/{{pid}}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total
rng = np.random.default_rng(0)
probe = factory()()
space = probe.action_space
probe.close()
actions = np.stack([space.sample() for _ in range(num_envs)]) if hasattr(space, "shape") and space.shape else np.zeros(num_envs, np.int64)
if backend.startswith("envpool"):
    envs.reset()
else:
    envs.reset(seed=0)
for _ in range(50):
    envs.step(actions)
pids, worker_envs = worker_pids()
steps, cpu0, started, workers_cpu0 = 0, time.process_time(), time.perf_counter(), cpu_s(pids)
while time.perf_counter() - started < seconds:
    envs.step(actions)
    steps += 1
wall, cpu = time.perf_counter() - started, time.process_time() - cpu0
workers_cpu = cpu_s(pids) - workers_cpu0
envs.close()
per_msg = None if not messages_per_step else cpu / (steps * messages_per_step) * 1e6
# The CPU of one env step where the envs step: the workers' processes, or (Sync) the learner's own.
per_env = (workers_cpu if pids else cpu) / (steps * worker_envs) * 1e6 if backend in ("sync", "floor", "clusterenv", "messages") else None
print(json.dumps({{"rate": steps * num_envs / wall, "cpu_us_per_msg": per_msg, "cpu_us_per_env": per_env}}))
"""


def run_once(cell: str, backend: str, seconds: float) -> dict[str, float | None] | None:
    env, num_envs, workers = CELLS[cell]
    if backend.startswith("envpool") and env not in ENVPOOL:
        return None
    code = _RUN.format(
        benchmarks=str(HERE),
        env=env,
        num_envs=num_envs,
        workers=workers,
        backend=backend,
        seconds=seconds,
        info_keys=INFO_KEYS.get(env, ()),
        envpool=ENVPOOL.get(env),
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=HERE.parent, capture_output=True, text=True, timeout=300, check=False
    )
    if done.returncode != 0:
        print(f"{cell} {backend} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_floor_exact() -> list[str]:
    """The floor returns exactly what SyncVectorEnv returns (CartPole-v1; HalfCheetah-v5 with infos if installed)."""
    sys.path.insert(0, str(HERE))
    import gymnasium as gym
    import numpy as np
    from support.bench_envs import make_atari
    from support.shm_floor import ShmFloor

    checked = []
    cases = [("CartPole-v1", ())]
    try:
        gym.make("HalfCheetah-v5").close()
        cases.append(("HalfCheetah-v5", HALFCHEETAH_INFOS))
    except Exception as exc:  # MuJoCo missing: the CartPole check is the one the floor must pass
        print(f"HalfCheetah-v5 not checked: {exc}", file=sys.stderr)
    try:
        make_atari("ALE/Pong-v5").close()
        cases.append(("ALE/Pong-v5", ATARI_INFOS))
    except Exception as exc:  # ale-py missing
        print(f"ALE/Pong-v5 not checked: {exc}", file=sys.stderr)
    for env_id, keys in cases:
        fns = [_maker(env_id)] * 8
        sync, floor = gym.vector.SyncVectorEnv(fns), ShmFloor(fns, 2, keys)
        try:
            rng = np.random.default_rng(1)
            obs, infos = sync.reset(seed=3)
            # ale-py's seeded reset also reports the seeds it used, a pair per env: no number the floor's region
            # carries. The floor's claim is its steps (and the observations and ALE infos of this reset).
            infos = {key: value for key, value in infos.items() if key.lstrip("_") != "seeds"}
            _assert_same((obs, infos), floor.reset(seed=3), env_id)
            ended = np.zeros(8, np.bool_)
            # Past episode ends: CartPole's, HalfCheetah's 1,000-step limit, every Pong game (about 800 steps).
            for _ in range({"CartPole-v1": 300, "HalfCheetah-v5": 1100}.get(env_id, 3000)):
                if env_id.startswith("ALE/") and ended.all():
                    break
                actions = np.stack([sync.single_action_space.sample() for _ in range(8)])
                if isinstance(sync.single_action_space, gym.spaces.Discrete):
                    actions = rng.integers(0, sync.single_action_space.n, 8)
                expected = sync.step(actions)
                _assert_same(expected, floor.step(actions), env_id)
                ended |= expected[2] | expected[3]
            assert ended.all(), f"{env_id}: not every env ended an episode in the check"
        finally:
            sync.close()
            floor.close()
        checked.append(env_id)
    from support.spin_floor import SpinFloor

    fns = [lambda: gym.make("CartPole-v1")] * 8
    sync, floor = gym.vector.SyncVectorEnv(fns), SpinFloor(fns)
    try:
        rng = np.random.default_rng(2)
        _assert_same(sync.reset(seed=5), floor.reset(seed=5), "spin_floor")
        for _ in range(300):
            actions = rng.integers(0, 2, 8)
            _assert_same(sync.step(actions), floor.step(actions), "spin_floor")
    finally:
        sync.close()
        floor.close()
    checked.append("CartPole-v1 (spin_floor)")
    return checked


def check_clusterenv_cell(cell: str, steps: int) -> dict[str, Any]:
    """ClusterEnv as the cell runs it, against SyncVectorEnv (infos included), and the path its steps took.

    ``steps`` lockstep steps of seeded random actions; the counts are :class:`support.step_paths.PathCount`'s,
    over all but the first step (whose infos name their layout in a message).
    """
    sys.path.insert(0, str(HERE))
    import gymnasium as gym
    import numpy as np
    from support.step_paths import PathCount

    from clusterenv import ClusterEnv

    env, num_envs, workers = CELLS[cell]
    fns = [_maker(env)] * num_envs
    sync, envs = gym.vector.SyncVectorEnv(fns), ClusterEnv(fns, num_workers=workers)
    try:
        space = sync.single_action_space
        space.seed(4)
        _assert_same(sync.reset(seed=7), envs.reset(seed=7), f"{cell} reset")
        actions = np.stack([space.sample() for _ in range(num_envs)])
        _assert_same(sync.step(actions), envs.step(actions), f"{cell} step 0")
        count = PathCount(envs)
        try:
            for t in range(1, steps):
                actions = np.stack([space.sample() for _ in range(num_envs)])
                _assert_same(sync.step(actions), envs.step(actions), f"{cell} step {t}")
                count.replied()
        finally:
            paths = count.close()
    finally:
        sync.close()
        envs.close()
    return {"exact_steps": steps, **paths}


def _maker(env_id: str) -> Any:
    """A factory for ``env_id``: a ``support.bench_envs`` class, or ``gym.make`` (ale-py's envs registered first for ``ALE/``)."""
    import gymnasium as gym
    from support.bench_envs import BurnEnv, NullEnv, make_atari

    if env_id == "BurnEnv":
        return functools.partial(BurnEnv, step_cpu_ms=0.05)
    if env_id == "NullEnv":
        return NullEnv
    return functools.partial(make_atari if env_id.startswith("ALE/") else gym.make, env_id)


def _assert_same(a: object, b: object, where: str) -> None:
    import numpy as np

    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: info keys {list(a)} != {list(b)}"
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key}]")
    elif isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, where  # type: ignore[union-attr]
        np.testing.assert_array_equal(a, b, err_msg=where)


def main(args: Args) -> None:
    if args.quick:
        args.rounds, args.seconds = 1, 1.0
    checked = check_floor_exact()
    path_checks = {
        cell: check_clusterenv_cell(cell, 50 if args.quick else 200)
        for cell in args.cells
        if "clusterenv" in args.backends
    }
    runs: dict[str, dict[str, list[dict]]] = {cell: {b: [] for b in args.backends} for cell in args.cells}
    for _ in range(args.rounds):
        for cell in args.cells:
            for backend in args.backends:
                result = run_once(cell, backend, args.seconds)
                if result is not None:
                    runs[cell][backend].append(result)
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cells_out: dict[str, dict] = {}
    for cell, by in runs.items():
        rates = {b: statistics.median(r["rate"] for r in rs) for b, rs in by.items() if rs}
        cpu = {
            b: statistics.median(r["cpu_us_per_msg"] for r in rs)
            for b, rs in by.items()
            if rs and b in ("floor", "clusterenv", "messages")
        }
        per_env = {
            b: statistics.median(r["cpu_us_per_env"] for r in rs)
            for b, rs in by.items()
            if rs and rs[0].get("cpu_us_per_env") is not None
        }
        cells_out[cell] = {
            **{b.replace("envpool_1t", "envpool_1thread"): v for b, v in rates.items()},
            "learner_cpu_us_per_worker_msg": cpu.get("clusterenv"),
            "floor_learner_cpu_us_per_worker_msg": cpu.get("floor"),
            "messages_learner_cpu_us_per_worker_msg": cpu.get("messages"),
            "cpu_us_per_env_step": per_env,
        }
    lines = [
        f"`{command_line(__file__)}`, {date}, {CORES} cores: env-steps/s of lockstep `step`, medians of {args.rounds} "
        f"alternated runs of {args.seconds:g} s per backend, each in a fresh process; 2 workers for clusterenv and "
        f"the floor; EnvPool with {min(16, CORES)} threads and with 1. The floor was checked bit-identical to "
        f"`SyncVectorEnv` on {', '.join(checked)} in this run.",
        "",
        "`clusterenv` is the default (its local workers on the shared step path); `messages` is clusterenv with "
        "`shared_memory=False` (every step a message per worker); `spin_floor` the bare spinning split (the learner "
        "steps half the envs, one forked worker the rest, no infos) and `split` clusterenv in that shape "
        "(`num_workers=1, learner_envs=n // 2`, default spin). The CPU per env step is measured where the envs step: "
        "the workers' processes for clusterenv and the floor, the learner's for Sync.",
        "",
        "| cell | Sync | Async / Sync | EnvPool / Sync (N threads; 1) | floor / Sync | clusterenv / Sync | clusterenv / floor "
        "| messages / Sync | learner CPU per worker message: clusterenv / floor / messages (µs) "
        "| CPU per env step: clusterenv / Sync | spin_floor / Sync | split / Sync | split / spin_floor |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cell, c in cells_out.items():
        sync = c.get("sync")
        if not sync:
            continue

        def ratio(name: str, c: dict = c, sync: float = sync) -> str:
            return f"{c[name] / sync:.2f}x" if c.get(name) else "—"

        floor_share = f"{c['clusterenv'] / c['floor']:.2f}" if c.get("clusterenv") and c.get("floor") else "—"
        cpu_values = [
            c["learner_cpu_us_per_worker_msg"],
            c["floor_learner_cpu_us_per_worker_msg"],
            c["messages_learner_cpu_us_per_worker_msg"],
        ]
        cpu_text = " / ".join("—" if v is None else f"{v:.1f}" for v in cpu_values)
        per_env = c["cpu_us_per_env_step"]
        per_env_text = (
            f"{per_env['clusterenv']:.1f} / {per_env['sync']:.1f} µs ({per_env['clusterenv'] / per_env['sync']:.2f}x)"
            if per_env.get("clusterenv") and per_env.get("sync")
            else "—"
        )
        split_share = f"{c['split'] / c['spin_floor']:.2f}" if c.get("split") and c.get("spin_floor") else "—"
        lines.append(
            f"| {cell} | {sync:,.0f} | {ratio('async')} | {ratio('envpool')}; {ratio('envpool_1thread')} | "
            f"{ratio('floor')} | {ratio('clusterenv')} | {floor_share} | {ratio('messages')} | {cpu_text} | "
            f"{per_env_text} | {ratio('spin_floor')} | {ratio('split')} | {split_share} |"
        )
    if any(CELLS[cell][0] in ENVPOOL and CELLS[cell][0].startswith("ALE/") for cell in cells_out):
        lines += [
            "",
            "EnvPool's Pong is asked for raw ALE v5 as closely as it goes (210x160 RGB, no frame stack, no episodic "
            "life, no reward clipping, no fire reset, frameskip 4, sticky actions 0.25, at most one no-op at reset); "
            "it still differs: channel-first (3, 210, 160) frames, each max-pooled over the last 2 frames of its "
            "frameskip, and its own infos.",
        ]
    if path_checks:
        lines += ["", "ClusterEnv as each cell runs it (lockstep, default settings), checked in this run:", ""]
        for cell, check in path_checks.items():
            replies = check["worker_replies"]
            shown = ", ".join(f"{n} {status.replace('_', ' ')}" for status, n in sorted(replies.items()))
            if check["message_replies_carried"]:
                carried = ", ".join(f"{k.replace('_', ' ')}: {n}" for k, n in check["message_replies_carried"].items())
                shown += f" (the messages carried {carried})"
            lines.append(
                f"* {cell}: bit-identical to `SyncVectorEnv` over {check['exact_steps']} steps (infos included); "
                f"step path {' / '.join(check['step_path'])}; worker replies after the first step: {shown}; "
                f"messages the learner sent: {check['messages_sent']}."
            )
    text = "\n".join(lines) + "\n"
    payload = {
        "date": date,
        "cores": CORES,
        "args": dataclasses.asdict(args),
        "floor_exact_on": checked,
        "clusterenv_checks": path_checks,
    }
    write_report("onehost", text, {**payload, "cells": cells_out, "runs": runs})


if __name__ == "__main__":
    main(tyro.cli(Args))
