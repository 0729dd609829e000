"""The default layout: what a ClusterEnv built with no layout argument runs, and why it says so.

The rule (clusterenv.learner.layout): on local workers stepping in lockstep, one worker per
usable core but one, and the learner stepping one worker's share itself; one worker per core
and no learner share wherever the learner could not serve its envs. An explicit argument wins.
"""

from __future__ import annotations

import functools
import logging
from contextlib import closing
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import clusterenv
from clusterenv import ClusterEnv, PolicyRunner
from clusterenv.cores import cgroup_quota_cores
from clusterenv.learner.layout import choose_layout
from clusterenv.learner.layout_hint import StepCosts, hint_for
from tests.conftest import assert_same

CARTPOLE = functools.partial(gym.make, "CartPole-v1")


# -- the rule ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "entries, cores, workers, learner_envs",
    [
        (16, 2, 1, 8),
        (64, 2, 1, 32),
        (16, 16, 15, 1),
        (64, 16, 15, 4),
        (8, 4, 3, 2),
        (3, 8, 2, 1),  # at most one worker per env the learner does not step
        (2, 2, 1, 1),
        (1, 2, 1, 0),  # a single env goes to a worker
        (16, 1, 1, 8),  # one core: nobody spins, the learner still halves the envs a worker wakes for
    ],
)
def test_local_lockstep_envs_get_a_worker_per_core_but_one_and_the_learner_one_share(
    entries, cores, workers, learner_envs
):
    layout = choose_layout(entries, cores)
    assert (layout.num_workers, layout.learner_envs) == (workers, learner_envs)
    assert layout.by_default


@pytest.mark.parametrize(
    "mode, why",
    [
        ({"local": False}, "remote workers"),
        ({"first_ready": True}, "first-ready batches"),
        ({"replaces_workers": True}, "worker processes are replaced"),
        ({"procs_per_worker": 4}, "procs_per_worker"),
        ({"units": True}, "units"),
    ],
)
def test_where_the_learner_cannot_serve_envs_it_steps_none_and_says_why(mode, why):
    layout = choose_layout(16, 4, **mode)
    assert (layout.num_workers, layout.learner_envs) == (4, 0)
    assert why in layout.reason


@pytest.mark.parametrize(
    "given, expected",
    [
        ({"num_workers": 2}, (2, 0)),
        ({"learner_envs": 4}, (1, 4)),  # the workers: a core each but the learner's
        ({"learner_envs": 0}, (2, 0)),
        ({"num_workers": 2, "learner_envs": 4}, (2, 4)),
    ],
)
def test_an_explicit_argument_always_wins(given, expected):
    layout = choose_layout(16, 2, **given)
    assert (layout.num_workers, layout.learner_envs) == expected
    assert not layout.by_default and layout.reason.startswith("as given: ")


# -- usable cores: affinity within every cgroup quota ------------------------------------------
def fake_proc(tmp_path: Path, membership: str, mounts: list[tuple[str, str, str, str]]) -> Path:
    """A /proc/self with ``cgroup`` and ``mountinfo``; ``mounts``: (root, mount point, fs type, options)."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(membership)
    lines = [
        f"{30 + i} 23 0:{i} {root} {point} rw - {fs} {fs} {opts}" for i, (root, point, fs, opts) in enumerate(mounts)
    ]
    (proc / "mountinfo").write_text("\n".join(lines) + "\n")
    return proc


def test_a_cgroup_v2_quota_of_a_parent_binds_its_children(tmp_path):
    root = tmp_path / "cg2"
    job = root / "slurm" / "job_7"
    job.mkdir(parents=True)
    (root / "slurm" / "cpu.max").write_text("300000 100000\n")  # 3 cores for every job below
    (job / "cpu.max").write_text("max 100000\n")
    proc = fake_proc(tmp_path, "0::/slurm/job_7\n", [("/", str(root), "cgroup2", "rw")])
    assert cgroup_quota_cores(proc) == 3


def test_a_cgroup_v1_quota_counts_in_whole_cores_and_minus_one_is_none(tmp_path):
    mount = tmp_path / "cpu,cpuacct"
    own = mount / "docker" / "abc"
    own.mkdir(parents=True)
    (own / "cpu.cfs_quota_us").write_text("150000\n")  # 1.5 cores: one whole core to spin on
    (own / "cpu.cfs_period_us").write_text("100000\n")
    (mount / "docker" / "cpu.cfs_quota_us").write_text("-1\n")
    (mount / "docker" / "cpu.cfs_period_us").write_text("100000\n")
    proc = fake_proc(
        tmp_path, "4:cpu,cpuacct:/docker/abc\n1:memory:/\n", [("/", str(mount), "cgroup", "rw,cpu,cpuacct")]
    )
    assert cgroup_quota_cores(proc) == 1


def test_inside_a_container_the_mount_root_is_the_containers_own_cgroup(tmp_path):
    mount = tmp_path / "cpu"
    mount.mkdir()
    (mount / "cpu.cfs_quota_us").write_text("200000\n")
    (mount / "cpu.cfs_period_us").write_text("100000\n")
    proc = fake_proc(tmp_path, "3:cpu:/docker/abc\n", [("/docker/abc", str(mount), "cgroup", "rw,cpu")])
    assert cgroup_quota_cores(proc) == 2


def test_no_quota_anywhere_is_none(tmp_path):
    root = tmp_path / "cg2"
    root.mkdir()
    (root / "cpu.max").write_text("max 100000\n")
    proc = fake_proc(tmp_path, "0::/\n", [("/", str(root), "cgroup2", "rw")])
    assert cgroup_quota_cores(proc) is None
    assert cgroup_quota_cores(tmp_path / "no-such-proc") is None


# -- what a default-built ClusterEnv runs --------------------------------------------------------
def test_a_default_built_env_says_what_it_chose_and_why(monkeypatch):
    monkeypatch.setattr("clusterenv.learner.vector_env.usable_cores", lambda: 2)
    with ClusterEnv([CARTPOLE] * 8) as envs:
        assert (envs.num_workers, envs.learner_envs) == (1, 4)
        assert repr(envs) == (
            "ClusterEnv(num_envs=8, num_workers=1, learner_envs=4: 2 cores: 1 worker and the learner, which steps 4 "
            "of 8 envs itself)"
        )
        assert envs.learner_info["layout"] == envs.layout.reason


@pytest.mark.parametrize("mode", ["NextStep", "SameStep", "Disabled"])
def test_a_default_built_env_is_exact(mode):
    fns = [CARTPOLE] * 6
    actions = np.random.default_rng(0).integers(0, 2, size=(60, 6))
    with (
        ClusterEnv(fns, autoreset_mode=mode) as envs,
        closing(gym.vector.SyncVectorEnv(fns, autoreset_mode=gym.vector.AutoresetMode(mode))) as reference,
    ):
        assert envs.learner_envs > 0
        for got, expected in zip(envs.reset(seed=3), reference.reset(seed=3), strict=True):
            assert_same(got, expected)
        for step_actions in actions:
            results = envs.step(step_actions)
            expected_results = reference.step(step_actions)
            for got, expected in zip(results, expected_results, strict=True):
                assert_same(got, expected)
            done = np.logical_or(expected_results[2], expected_results[3])
            if mode == "Disabled" and done.any():  # the user resets what ended
                options = {"reset_mask": done}
                for got, expected in zip(envs.reset(options=options), reference.reset(options=options), strict=True):
                    assert_same(got, expected)


def test_a_policy_runner_moves_the_default_share_to_the_workers_and_acts_for_every_env(caplog):
    import torch

    with ClusterEnv([CARTPOLE] * 4) as envs:
        assert envs.learner_envs > 0
        with caplog.at_level(logging.INFO, logger="clusterenv.learner.vector_env"):
            runner = PolicyRunner(envs, torch.nn.Linear(4, 2), clusterenv.Never(), seed=0)
        assert envs.learner_envs == 0 and "PolicyRunner" in envs.layout.reason
        assert "moved to the workers" in caplog.text
        batch = runner.rollout(5)
        assert batch.obs.shape == (5, 4, 4)


def test_first_ready_batches_move_the_default_share_to_the_workers():
    with ClusterEnv([CARTPOLE] * 4) as envs, closing(gym.vector.SyncVectorEnv([CARTPOLE] * 4)) as reference:
        envs.reset(seed=0)
        envs.step(np.zeros(4, dtype=np.int64))
        envs.async_reset(seed=5)
        obs, *_, env_ids = envs.recv()
        assert envs.learner_envs == 0
        expected, _ = reference.reset(seed=5)
        assert_same(obs[np.argsort(env_ids)], expected)


def test_an_explicit_learner_share_is_not_moved():
    with ClusterEnv([CARTPOLE] * 4, num_workers=1, learner_envs=2) as envs:
        with pytest.raises(ValueError, match=r"`learner_envs=2`\): use `learner_envs=0`"):
            envs.async_reset(seed=0)
        assert envs.learner_envs == 2


def test_units_at_the_front_keep_every_env_in_the_workers():
    unit = functools.partial(gym.vector.SyncVectorEnv, [CARTPOLE] * 2)
    with ClusterEnv([unit, unit, unit]) as envs:
        assert envs.learner_envs == 0 and "units" in envs.layout.reason
        assert envs.num_envs == 6


# -- the hint when an explicit layout loses ----------------------------------------------------------
def test_a_hint_names_the_better_layout_when_a_given_one_pays_wake_ups():
    layout = choose_layout(16, 2, num_workers=2)
    costs = StepCosts(step_us=120.0, learner_busy_us=20.0, env_step_us=3.0, spins=False)
    line = hint_for(layout, costs, 16, 2)
    assert line is not None
    assert line.startswith("ClusterEnv(num_workers=2): a step of 16 envs takes 120 µs")
    assert "(num_workers=1, learner_envs=8) would take about 44 µs" in line


def test_no_hint_where_the_given_layout_holds_its_own_or_is_the_rules():
    slow_envs = StepCosts(step_us=8_100.0, learner_busy_us=30.0, env_step_us=1_000.0, spins=False)
    assert hint_for(choose_layout(16, 2, num_workers=2), slow_envs, 16, 2) is None
    cheap = StepCosts(step_us=120.0, learner_busy_us=20.0, env_step_us=3.0, spins=False)
    assert hint_for(choose_layout(16, 2, num_workers=1, learner_envs=8), cheap, 16, 2) is None


def test_the_defaults_never_log_a_hint(caplog):
    with caplog.at_level(logging.WARNING, logger="clusterenv.learner.layout_hint"), ClusterEnv([CARTPOLE] * 4) as envs:
        envs.reset(seed=0)
        for _ in range(400):
            envs.step(np.zeros(4, dtype=np.int64))
    assert caplog.records == []
