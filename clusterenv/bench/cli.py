"""The command line: ``python -m clusterenv.bench ENV_ID`` (or ``clusterenv-bench``), and :func:`run` behind it.

Progress goes to stderr as it happens, the report to stdout, the JSON to ``--json``. Bad input
ends with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from clusterenv.bench.candidates import SYNC, candidates
from clusterenv.bench.exactness import check_exact
from clusterenv.bench.measurement import env_step_us, measure
from clusterenv.bench.report import Report, Row, format_report, recommend, to_json
from clusterenv.bench.target import BenchInputError, EnvTarget, resolve_target
from clusterenv.cores import usable_cores
from clusterenv.errors import ClusterEnvError

__all__ = ["main", "run"]

PROG = "clusterenv-bench"


def run(
    target: EnvTarget,
    *,
    num_envs: int = 16,
    seconds: float = 20.0,
    rounds: int = 3,
    check_steps: int = 300,
    seed: int = 0,
    progress: Callable[[str], None] = lambda message: None,
) -> Report:
    """Check exactness, then time every row in alternating rounds; the report with its recommendation.

    Args:
        target: the env (:func:`~clusterenv.bench.target.resolve_target`).
        num_envs: envs in every backend.
        seconds: timed stepping, shared by all rows and rounds (starting the backends is extra).
        rounds: turns each row gets; its figure is the median.
        check_steps: batch steps of the exactness check.
        seed: the seed of the resets and of the random actions.
        progress: called with a line at each stage.

    Raises:
        BenchInputError: clusterenv cannot run this env (its spaces or its factory cannot reach the workers).
    """
    cores = usable_cores()
    load = _load_average()
    progress(f"checking that clusterenv returns what SyncVectorEnv returns ({check_steps} steps)")
    try:
        exactness = check_exact(target.make, num_envs, check_steps, seed, {})
    except ClusterEnvError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BenchInputError(f"clusterenv cannot run `{target.name}`: {first}") from exc
    progress("exact" if exactness.exact else f"NOT exact: {exactness.difference}")
    step_us = env_step_us(target.make, seconds=0.5, seed=seed)
    progress(f"one env step: {step_us:,.1f} µs")
    rows, skipped = candidates(target, num_envs, cores, seed)
    rates = measure(rows, seconds, rounds, progress)
    sync = rates[SYNC]
    measured = [Row(c.label, c.backend, c.options, rates[c.label], rates[c.label] / sync) for c in rows]
    return Report(target.name, num_envs, cores, step_us, load, exactness, measured, recommend(measured), skipped)


def _load_average() -> float | None:
    """The system's one-minute load average: how busy the cores were before this run, by other jobs."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows has none
        return None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line and exit status 2, as for every other bad input."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Does clusterenv pay for this env on this machine? Lockstep env-steps/s of SyncVectorEnv, "
        "AsyncVectorEnv, EnvPool and clusterenv (several worker counts, workers acting), after checking that "
        "clusterenv returns exactly what SyncVectorEnv returns.",
    )
    parser.add_argument("env_id", nargs="?", help="a registered Gymnasium env id, e.g. CartPole-v1")
    parser.add_argument("--entry-point", help="`module:function` making the env, for an env that is not registered")
    parser.add_argument("--num-envs", type=int, default=16, help="envs in every backend (default 16)")
    parser.add_argument("--seconds", type=float, default=20.0, help="timed stepping over all rows (default 20)")
    parser.add_argument("--rounds", type=int, default=3, help="turns per row; the median is reported (default 3)")
    parser.add_argument("--check-steps", type=int, default=300, help="batch steps of the exactness check")
    parser.add_argument("--seed", type=int, default=0, help="seed of the resets and the random actions")
    parser.add_argument("--json", type=Path, help="also write the report as JSON to this path")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bench from the command line; 0 when it ran, 2 on bad input."""
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("num_envs", "rounds", "check_steps"):
        if getattr(args, name) < 1:
            parser.error(f"`--{name.replace('_', '-')}` must be at least 1, got {getattr(args, name)}")
    if not (math.isfinite(args.seconds) and args.seconds > 0):  # inf would never end; nan compares false
        parser.error(f"`--seconds` must be a positive, finite number, got {args.seconds}")

    def progress(message: str) -> None:
        print(f"{PROG}: {message}", file=sys.stderr, flush=True)

    try:
        target = resolve_target(args.env_id, args.entry_point)
        import torch

        torch.set_num_threads(1)  # the learner-side MLP is tiny; threads would only contend with the workers
        report = run(
            target,
            num_envs=args.num_envs,
            seconds=args.seconds,
            rounds=args.rounds,
            check_steps=args.check_steps,
            seed=args.seed,
            progress=progress,
        )
    except BenchInputError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.json is not None:
        args.json.write_text(json.dumps(to_json(report), indent=2) + "\n")
    return 0
