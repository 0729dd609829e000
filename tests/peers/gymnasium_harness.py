"""A pytest plugin that runs Gymnasium's own vector tests against ClusterEnv.

Loaded with ``-p gymnasium_harness`` (this folder on ``PYTHONPATH``) by a pytest run over
``../shared/peer-tests/gymnasium-1.4.0/tests/{vector,wrappers/vector}``. Before any test
module is imported it makes the names ``gymnasium.vector.SyncVectorEnv`` and
``gymnasium.vector.AsyncVectorEnv`` (and so ``gymnasium.make_vec``) build a
:class:`clusterenv.ClusterEnv` over two workers, with each class's own keyword arguments.
"""

from __future__ import annotations

import gymnasium
import gymnasium.vector
import pytest

from clusterenv import ClusterEnv

REAL_SYNC = gymnasium.vector.SyncVectorEnv
REAL_ASYNC = gymnasium.vector.AsyncVectorEnv


# AsyncVectorEnv's arguments about its own processes and pipes; ClusterEnv has its own workers.
ASYNC_ONLY = ("shared_memory", "context", "daemon")


def _workers(env_fns) -> int:
    return min(2, len(env_fns))


class SyncVectorEnvOnClusterEnv(ClusterEnv):
    """``SyncVectorEnv``'s signature, a ClusterEnv underneath."""

    def __init__(self, env_fns, **sync_kwargs) -> None:
        super().__init__(env_fns, num_workers=_workers(env_fns), **sync_kwargs)


class AsyncVectorEnvOnClusterEnv(ClusterEnv):
    """``AsyncVectorEnv``'s signature, a ClusterEnv underneath."""

    def __init__(self, env_fns, **async_kwargs) -> None:
        kwargs = {key: value for key, value in async_kwargs.items() if key not in ASYNC_ONLY}
        super().__init__(env_fns, num_workers=_workers(env_fns), **kwargs)


#: Tests that inspect what only Gymnasium's own classes have; each is skipped with its reason (listed in the docs).
NOT_APPLICABLE = {
    "test_sync_vector_env.py::test_metadata_sync_vector_env": (
        "reads `envs.envs[0].metadata`, the sub-env objects inside SyncVectorEnv; ClusterEnv's envs live in "
        "worker processes (the property itself is tested in tests/test_dropin.py)"
    ),
    "test_normalize_reward.py::test_equivalence_with_wrapper": (
        "reads `per_env.envs[0].return_rms`, a sub-env object inside SyncVectorEnv; ClusterEnv's envs live in "
        "worker processes"
    ),
    "test_async_vector_env.py::test_async_vector_subenv_error": (
        "pins the text of the warnings AsyncVectorEnv's worker processes log; ClusterEnv raises the error "
        "with its remote traceback instead (the error types are tested)"
    ),
    "test_async_vector_env.py::test_custom_space_async_vector_env_shared_memory": (
        "expects AsyncVectorEnv(shared_memory=True) to refuse a custom space for its shared-memory buffers; "
        "ClusterEnv has no such option and steps custom spaces"
    ),
}


def pytest_configure(config: pytest.Config) -> None:
    gymnasium.vector.SyncVectorEnv = SyncVectorEnvOnClusterEnv
    gymnasium.vector.AsyncVectorEnv = AsyncVectorEnvOnClusterEnv


def mujoco_renders() -> bool:
    """Whether MuJoCo can render in this process: it needs an OpenGL platform (EGL, OSMesa or a display)."""
    try:
        env = gymnasium.make("Ant-v4", render_mode="rgb_array")
        env.reset(seed=0)
        env.render()
        env.close()
    except Exception:
        return False
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    renders = None
    for item in items:
        test = item.nodeid.split("/")[-1].split("[")[0]
        if test in NOT_APPLICABLE:
            item.add_marker(pytest.mark.skip(reason=f"not applicable to ClusterEnv: {NOT_APPLICABLE[test]}"))
        elif test == "test_human_rendering.py::test_num_envs_screen_size" and "Ant-v" in item.nodeid:
            renders = mujoco_renders() if renders is None else renders
            if not renders:  # Gymnasium's own classes fail these the same way on such a machine
                item.add_marker(pytest.mark.skip(reason="MuJoCo cannot render here: no OpenGL platform library"))
