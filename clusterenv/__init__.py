"""clusterenv: Gymnasium vector environments whose envs run in worker processes.

Swap ``gymnasium.make_vec`` for :func:`clusterenv.make_vec` and ``reset``/``step`` run in
ZeroMQ worker processes, on this machine or others, behind the unchanged ``VectorEnv`` API.

The public names are imported on first use: a worker process (``python -m
clusterenv.worker``) imports this package too, and must not load the learner's modules.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from clusterenv.batch import RolloutBatch
    from clusterenv.env import ClusterEnv
    from clusterenv.errors import (
        AuthenticationError,
        ClusterEnvError,
        PolicyError,
        ProtocolError,
        RemoteEnvError,
        UntrustedPickleError,
        WorkerLostError,
        WorkerStartError,
        WorkerTimeoutError,
    )
    from clusterenv.heads import (
        Bernoulli,
        Categorical,
        EpsilonGreedy,
        Gaussian,
        Greedy,
        Head,
        MultiCategorical,
        TanhGaussian,
        default_head,
    )
    from clusterenv.launch import ExternalLauncher, Launcher, LocalLauncher
    from clusterenv.liveness import Heartbeat
    from clusterenv.make import make_vec
    from clusterenv.ray_launcher import RayLauncher
    from clusterenv.rollout import PolicyRunner
    from clusterenv.sync import APS, EveryUpdate, FixedInterval, Never, SyncStrategy, Telemetry, WorkerTelemetry

_MODULE_OF = {
    "ClusterEnv": "env",
    **dict.fromkeys(
        [
            "AuthenticationError",
            "ClusterEnvError",
            "PolicyError",
            "ProtocolError",
            "RemoteEnvError",
            "UntrustedPickleError",
            "WorkerLostError",
            "WorkerStartError",
            "WorkerTimeoutError",
        ],
        "errors",
    ),
    **dict.fromkeys(
        [
            "Bernoulli",
            "Categorical",
            "EpsilonGreedy",
            "Gaussian",
            "Greedy",
            "Head",
            "MultiCategorical",
            "TanhGaussian",
            "default_head",
        ],
        "heads",
    ),
    "make_vec": "make",
    **dict.fromkeys(["ExternalLauncher", "Launcher", "LocalLauncher"], "launch"),
    "Heartbeat": "liveness",
    "RayLauncher": "ray_launcher",
    "PolicyRunner": "rollout",
    "RolloutBatch": "batch",
    **dict.fromkeys(
        ["APS", "EveryUpdate", "FixedInterval", "Never", "SyncStrategy", "Telemetry", "WorkerTelemetry"], "sync"
    ),
}

__all__ = [
    "APS",
    "AuthenticationError",
    "Bernoulli",
    "Categorical",
    "ClusterEnv",
    "ClusterEnvError",
    "EpsilonGreedy",
    "EveryUpdate",
    "ExternalLauncher",
    "FixedInterval",
    "Gaussian",
    "Greedy",
    "Head",
    "Heartbeat",
    "Launcher",
    "LocalLauncher",
    "MultiCategorical",
    "Never",
    "PolicyError",
    "PolicyRunner",
    "ProtocolError",
    "RayLauncher",
    "RemoteEnvError",
    "RolloutBatch",
    "SyncStrategy",
    "TanhGaussian",
    "Telemetry",
    "UntrustedPickleError",
    "WorkerLostError",
    "WorkerStartError",
    "WorkerTelemetry",
    "WorkerTimeoutError",
    "default_head",
    "make_vec",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> _typing.Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'clusterenv' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"clusterenv.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
