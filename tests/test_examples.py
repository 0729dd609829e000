"""The bundled examples train end to end, log their episodes, match Gymnasium exactly, and reject bad input."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import gymnasium as gym
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CSV_COLUMNS = ["global_step", "env", "episodic_return", "episodic_length", "wall_time_s"]
RUN_TIMEOUT_S = 100  # a tiny run takes a few seconds; this is for a heavily loaded CI machine

# Budgets small enough for a few seconds per run, large enough for several finished episodes.
TINY = {
    "ppo_cartpole": ("ppo_cartpole.py", "--total-timesteps", "1024", "--num-envs", "4", "--num-steps", "128"),
    "ppo_cartpole --learner-envs": (
        "ppo_cartpole.py",
        *("--total-timesteps", "1024", "--num-envs", "4", "--num-steps", "128"),
        *("--num-workers", "1", "--learner-envs", "2", "--spin-us", "200"),
    ),
    "ppo_cartpole --local-policy": (
        "ppo_cartpole.py",
        "--total-timesteps",
        "1024",
        "--num-envs",
        "4",
        "--num-steps",
        "128",
        "--local-policy",
        "--aps-threshold",
        "0.01",
        "--cuda",  # CUDA if this torch can use it, else the CPU: the flag must work either way
    ),
    "dqn_cartpole": (
        "dqn_cartpole.py",
        "--total-timesteps",
        "1200",
        "--num-envs",
        "2",
        "--learning-starts",
        "400",
        "--no-cuda",
        "--torch-threads",
        "2",
    ),
    # Pendulum-v1 (200-step episodes) stands in for HalfCheetah, which needs MuJoCo.
    "ppo_continuous": (
        "ppo_continuous.py",
        *("--env-id", "Pendulum-v1", "--total-timesteps", "1024", "--num-envs", "2", "--num-steps", "512"),
    ),
    "ppo_continuous --local-policy": (
        "ppo_continuous.py",
        *("--env-id", "Pendulum-v1", "--total-timesteps", "1536", "--num-envs", "2", "--num-steps", "256"),
        *("--local-policy", "--prefetch", "1"),
    ),
    # ALE truncates each game after 400 frames (100 agent steps), so 2 envs x 128 steps finish episodes.
    "ppo_atari": (
        "ppo_atari.py",
        "--total-timesteps",
        "256",
        "--num-envs",
        "2",
        "--num-steps",
        "128",
        "--num-minibatches",
        "2",
        "--update-epochs",
        "1",
        "--max-episode-frames",
        "400",
    ),
    "ppo_atari --local-policy": (
        "ppo_atari.py",
        *("--total-timesteps", "512", "--num-envs", "2", "--num-steps", "128", "--num-minibatches", "2"),
        *("--update-epochs", "1", "--max-episode-frames", "400", "--local-policy", "--prefetch", "1"),
    ),
}


@dataclass
class Run:
    result: subprocess.CompletedProcess
    run_dir: Path | None

    def episodes(self) -> list[dict[str, str]]:
        assert self.run_dir is not None
        with open(self.run_dir / "episodes.csv", newline="") as f:
            return list(csv.DictReader(f))

    def returns(self) -> list[tuple[str, str, str, str]]:
        """Everything in episodes.csv except the wall-clock column."""
        return [(e["global_step"], e["env"], e["episodic_return"], e["episodic_length"]) for e in self.episodes()]


def run_example(script: str, *args: str, cwd: Path, timeout: float = RUN_TIMEOUT_S) -> Run:
    """Run ``examples/<script>`` in a subprocess with its logs under ``cwd/runs``."""
    cwd.mkdir(parents=True, exist_ok=True)
    runs = cwd / "runs"
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--runs-dir", str(runs), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    run_dirs = sorted(runs.iterdir()) if runs.exists() else []
    assert len(run_dirs) <= 1, f"expected at most one run directory, got {run_dirs}"
    return Run(result, run_dirs[0] if run_dirs else None)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """``tiny_run(name, backend)``: the example's tiny run, started once per module and backend."""
    cache: dict[tuple[str, str], Run] = {}

    def run(name: str, backend: str = "clusterenv") -> Run:
        if (name, backend) not in cache:
            script, *args = TINY[name]
            cwd = tmp_path_factory.mktemp(f"{script[:-3]}-{backend}")
            cache[name, backend] = run_example(script, *args, "--backend", backend, cwd=cwd)
        return cache[name, backend]

    return run


@pytest.mark.parametrize("name", TINY.keys())
def test_example_trains_and_writes_episode_csv_and_learning_curve(tiny_run, name):
    run = tiny_run(name)
    assert run.result.returncode == 0, run.result.stderr[-3000:]
    assert run.run_dir is not None
    episodes = run.episodes()
    assert episodes, "no episode finished, so episodes.csv has no rows"
    assert list(episodes[0]) == CSV_COLUMNS
    assert all(math.isfinite(float(e["episodic_return"])) and int(e["episodic_length"]) > 0 for e in episodes)
    steps = [int(e["global_step"]) for e in episodes]
    assert steps == sorted(steps)
    assert (run.run_dir / "learning_curve.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert f"{len(episodes)} episodes in" in run.result.stdout
    with open(run.run_dir / "workers.csv", newline="") as f:  # the fleet and its usage, at every progress update
        fleet = list(csv.DictReader(f))
    assert fleet and int(fleet[0]["live_workers"]) >= 1 and fleet[0]["lost_workers"] == "0"
    assert float(fleet[-1]["workers_rss_mb"]) > 0
    waiting = float(fleet[-1]["learner_waiting_ms"])  # NaN where the workers act (rollouts are not batch steps)
    assert math.isnan(waiting) == ("--local-policy" in name) and not waiting < 0


def test_the_sb3_example_gives_dummy_vec_envs_episodes(tmp_path):
    pytest.importorskip("stable_baselines3")
    returns = {}
    for backend in ("clusterenv", "dummy"):
        args = ("--total-timesteps", "1024", "--num-envs", "4", "--n-steps", "64", "--backend", backend)
        run = run_example("sb3_ppo.py", *args, cwd=tmp_path / backend)
        assert run.result.returncode == 0, run.result.stderr[-3000:]
        returns[backend] = run.returns()
    assert returns["dummy"] and returns["clusterenv"] == returns["dummy"]


@pytest.mark.parametrize("name", ["ppo_cartpole", "dqn_cartpole", "ppo_atari", "ppo_continuous"])
def test_gymnasium_version_of_the_script_gives_the_same_episodes(tiny_run, name):
    ours, gymnasium = tiny_run(name, "clusterenv"), tiny_run(name, "gym")
    assert gymnasium.result.returncode == 0, gymnasium.result.stderr[-3000:]
    assert ours.result.returncode == 0, ours.result.stderr[-3000:]
    assert ours.returns() == gymnasium.returns()


def test_the_learner_stepping_half_the_envs_itself_gives_the_same_episodes(tiny_run):
    ours, gymnasium = tiny_run("ppo_cartpole --learner-envs"), tiny_run("ppo_cartpole", "gym")
    assert ours.result.returncode == 0, ours.result.stderr[-3000:]
    assert ours.returns() and ours.returns() == gymnasium.returns()


@pytest.mark.parametrize("name", ["ppo_cartpole", "dqn_cartpole"])
def test_asyncvectorenv_version_of_the_script_gives_the_same_episodes(tiny_run, name):
    ours, gymnasium_async = tiny_run(name, "clusterenv"), tiny_run(name, "async")
    assert gymnasium_async.result.returncode == 0, gymnasium_async.result.stderr[-3000:]
    assert ours.returns() == gymnasium_async.returns()


def test_local_policy_progress_bar_reports_weight_pulls(tiny_run):
    run = tiny_run("ppo_cartpole --local-policy")
    assert run.result.returncode == 0, run.result.stderr[-3000:]
    assert "pulls=" in run.result.stderr


BAD_INPUT = {
    "unknown env id": (
        ("ppo_cartpole.py", "--env-id", "CartPoel-v1"),
        "error: --env-id 'CartPoel-v1': Environment `CartPoel` doesn't exist. Did you mean: `CartPole`?",
    ),
    "zero envs": (("dqn_cartpole.py", "--num-envs", "0"), "error: --num-envs must be at least 1, got 0"),
    "zero torch threads": (
        ("ppo_atari.py", "--torch-threads", "0"),
        "error: --torch-threads must be at least 1, got 0",
    ),
    "not an Atari env": (
        ("ppo_atari.py", "--env-id", "CartPole-v1"),
        "error: --env-id 'CartPole-v1' is not an Atari (ale-py) environment",
    ),
    "local policy without workers": (
        ("ppo_cartpole.py", "--local-policy", "--backend", "gym"),
        "error: --local-policy runs the actor in clusterenv workers; it needs --backend clusterenv",
    ),
}


@pytest.mark.parametrize("argv,message", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_cli_input_exits_with_a_one_line_error(tmp_path, argv, message):
    run = run_example(*argv, cwd=tmp_path)
    assert run.result.returncode != 0
    assert run.result.stderr.strip().splitlines() == [message]
    assert run.run_dir is None, "nothing should be written for rejected input"


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_readme_first_command_solves_cartpole(tmp_path):
    # The README's quick start: local policies with APS and prefetch. That the gymnasium backend
    # gives the very same episodes as the per-step clusterenv backend is pinned on a short budget above.
    # Its workers pull weights when their policy drifts, which depends on timing: runs differ, and
    # one on a loaded machine held 500 for 170k steps, then ended at 466.6. So the check is
    # Gymnasium's own "solved": CartPole-v1's reward threshold over 100 consecutive episodes.
    ours = run_example("ppo_cartpole.py", "--local-policy", "--prefetch", "1", cwd=tmp_path, timeout=1200)
    assert ours.result.returncode == 0, ours.result.stderr[-3000:]
    returns = [float(ret) for _, _, ret, _ in ours.returns()]
    means = [sum(returns[i : i + 100]) / 100 for i in range(len(returns) - 99)]
    threshold = gym.spec("CartPole-v1").reward_threshold  # 475
    assert means and max(means) >= threshold, f"best mean return over 100 consecutive episodes: {max(means)}"
