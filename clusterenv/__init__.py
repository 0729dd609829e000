"""clusterenv: Gymnasium vector environments whose envs run in worker processes.

Swap ``gymnasium.make_vec`` for :func:`clusterenv.make_vec` and ``reset``/``step`` run in
ZeroMQ worker processes, on this machine or others, behind the unchanged ``VectorEnv`` API.
"""

from __future__ import annotations

from clusterenv.env import ClusterEnv
from clusterenv.errors import (
    AuthenticationError,
    ClusterEnvError,
    PolicyError,
    ProtocolError,
    RemoteEnvError,
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
from clusterenv.make import make_vec
from clusterenv.rollout import PolicyRunner, RolloutBatch
from clusterenv.sync import APS, EveryUpdate, FixedInterval, Never, SyncStrategy, Telemetry, WorkerTelemetry

__all__ = [
    "APS",
    "AuthenticationError",
    "Bernoulli",
    "Categorical",
    "ClusterEnv",
    "ClusterEnvError",
    "EpsilonGreedy",
    "EveryUpdate",
    "FixedInterval",
    "Gaussian",
    "Greedy",
    "Head",
    "MultiCategorical",
    "Never",
    "PolicyError",
    "PolicyRunner",
    "ProtocolError",
    "RemoteEnvError",
    "RolloutBatch",
    "SyncStrategy",
    "TanhGaussian",
    "Telemetry",
    "WorkerLostError",
    "WorkerStartError",
    "WorkerTelemetry",
    "WorkerTimeoutError",
    "default_head",
    "make_vec",
]

__version__ = "0.1.0"
