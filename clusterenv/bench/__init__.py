"""``python -m clusterenv.bench ENV_ID``: does clusterenv pay for this env, on this machine?

It first checks that clusterenv returns exactly what ``SyncVectorEnv`` returns for the env
(:mod:`~clusterenv.bench.exactness`), then times lockstep env-steps/s of every backend that
could run it (:mod:`~clusterenv.bench.candidates`, :mod:`~clusterenv.bench.backends`),
alternating them in rounds and keeping medians (:mod:`~clusterenv.bench.measurement`), and
prints a table against ``SyncVectorEnv`` with one recommendation, the fastest row, or
clusterenv's defaults where they are within 5% of the fastest clusterenv row
(:mod:`~clusterenv.bench.report`). The command line is :mod:`~clusterenv.bench.cli`.

This package sits above the learner: nothing in clusterenv imports it, and workers never load it.
"""

from __future__ import annotations

from clusterenv.bench.cli import main, run
from clusterenv.bench.report import Recommendation, Report, Row
from clusterenv.bench.target import BenchInputError, EnvTarget, resolve_target

__all__ = ["BenchInputError", "EnvTarget", "Recommendation", "Report", "Row", "main", "resolve_target", "run"]
