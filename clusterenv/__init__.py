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
from clusterenv.heads import Categorical, EpsilonGreedy, Greedy, Head
from clusterenv.make import make_vec
from clusterenv.rollout import PolicyRunner, RolloutBatch
from clusterenv.sync import APS, EveryUpdate, FixedInterval, Never, SyncStrategy, Telemetry, WorkerTelemetry

__all__ = [
    "APS",
    "AuthenticationError",
    "Categorical",
    "ClusterEnv",
    "ClusterEnvError",
    "EpsilonGreedy",
    "EveryUpdate",
    "FixedInterval",
    "Greedy",
    "Head",
    "Never",
    "PolicyError",
    "PolicyRunner",
    "ProtocolError",
    "RemoteEnvError",
    "RolloutBatch",
    "SyncStrategy",
    "Telemetry",
    "WorkerLostError",
    "WorkerStartError",
    "WorkerTelemetry",
    "WorkerTimeoutError",
    "make_vec",
]

__version__ = "0.1.0"
