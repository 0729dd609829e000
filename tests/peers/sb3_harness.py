"""A pytest plugin that runs Stable-Baselines3's own VecEnv tests against ``clusterenv.sb3.ClusterVecEnv``.

Loaded with ``-p sb3_harness`` (this folder on ``PYTHONPATH``) by a pytest run over
``tests/test_vec_envs.py`` of SB3's source distribution. Before the test module is
imported it makes the name ``SubprocVecEnv`` build a ``ClusterVecEnv`` over two workers,
so every test parametrized over ``[DummyVecEnv, SubprocVecEnv]`` runs against both the
reference and the adapter.
"""

from __future__ import annotations

import pytest
import stable_baselines3.common.vec_env as vec_env

from clusterenv.sb3 import ClusterVecEnv


class SubprocVecEnvOnClusterEnv(ClusterVecEnv):
    """``SubprocVecEnv``'s signature, a ClusterVecEnv underneath."""

    def __init__(self, env_fns, start_method=None) -> None:
        super().__init__(env_fns, start_method=start_method, num_workers=min(2, len(env_fns)))


def pytest_configure(config: pytest.Config) -> None:
    vec_env.SubprocVecEnv = SubprocVecEnvOnClusterEnv
