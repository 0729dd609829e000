"""clusterenv: Gymnasium vector environments whose envs run in worker processes.

Swap ``gymnasium.make_vec`` for :func:`clusterenv.make_vec` and ``reset``/``step`` run in
ZeroMQ worker processes, on this machine or others, behind the unchanged ``VectorEnv`` API.

The public names are imported on first use: a worker process (``python -m
clusterenv.worker``) imports this package too, and must not load the learner's modules.
"""

from __future__ import annotations

import ast as _ast
import importlib as _importlib
import pathlib as _pathlib
import typing as _typing

if _typing.TYPE_CHECKING:  # the public names, each written once (``X as X``: re-exported, for type checkers)
    from clusterenv.errors import AuthenticationError as AuthenticationError
    from clusterenv.errors import ClusterEnvError as ClusterEnvError
    from clusterenv.errors import PolicyError as PolicyError
    from clusterenv.errors import ProtocolError as ProtocolError
    from clusterenv.errors import RemoteEnvError as RemoteEnvError
    from clusterenv.errors import UntrustedPickleError as UntrustedPickleError
    from clusterenv.errors import WorkerLostError as WorkerLostError
    from clusterenv.errors import WorkerStartError as WorkerStartError
    from clusterenv.errors import WorkerTimeoutError as WorkerTimeoutError
    from clusterenv.launch.launchers import ExternalLauncher as ExternalLauncher
    from clusterenv.launch.launchers import Launcher as Launcher
    from clusterenv.launch.launchers import LocalLauncher as LocalLauncher
    from clusterenv.launch.ray import RayLauncher as RayLauncher
    from clusterenv.learner.recycling import Recycle as Recycle
    from clusterenv.learner.rollout_batch import RolloutBatch as RolloutBatch
    from clusterenv.learner.rollouts import PolicyRunner as PolicyRunner
    from clusterenv.learner.vector_env import ClusterEnv as ClusterEnv
    from clusterenv.make import make_vec as make_vec
    from clusterenv.policy.deltas import LossyWeights as LossyWeights
    from clusterenv.policy.heads import Bernoulli as Bernoulli
    from clusterenv.policy.heads import Categorical as Categorical
    from clusterenv.policy.heads import EpsilonGreedy as EpsilonGreedy
    from clusterenv.policy.heads import Gaussian as Gaussian
    from clusterenv.policy.heads import Greedy as Greedy
    from clusterenv.policy.heads import Head as Head
    from clusterenv.policy.heads import MultiCategorical as MultiCategorical
    from clusterenv.policy.heads import TanhGaussian as TanhGaussian
    from clusterenv.policy.heads import default_head as default_head
    from clusterenv.policy.strategies import APS as APS
    from clusterenv.policy.strategies import EveryUpdate as EveryUpdate
    from clusterenv.policy.strategies import FixedInterval as FixedInterval
    from clusterenv.policy.strategies import Never as Never
    from clusterenv.policy.strategies import PullReason as PullReason
    from clusterenv.policy.strategies import SyncStrategy as SyncStrategy
    from clusterenv.policy.strategies import Telemetry as Telemetry
    from clusterenv.policy.strategies import WorkerTelemetry as WorkerTelemetry
    from clusterenv.wire.liveness import Heartbeat as Heartbeat


def _public_names() -> dict[str, str]:
    """``{name: module}`` read from the imports above, so that the list of public names has one writer."""
    tree = _ast.parse(_pathlib.Path(__file__).read_text(encoding="utf-8"))
    block = next(node for node in tree.body if isinstance(node, _ast.If) and "TYPE_CHECKING" in _ast.unparse(node.test))
    return {
        alias.name: node.module
        for node in block.body
        if isinstance(node, _ast.ImportFrom) and node.module is not None
        for alias in node.names
    }


_MODULE_OF = _public_names()
__all__ = sorted(_MODULE_OF)  # noqa: PLE0605

__version__ = "0.1.0"


def __getattr__(name: str) -> _typing.Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'clusterenv' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
