"""The outcome of a run: rows against ``SyncVectorEnv``, one recommendation, as a table or as JSON.

The recommendation is the fastest row, by the same medians the table shows, so the advice
and the numbers never disagree; where that is a lockstep clusterenv row, it is the defaults
instead when their row is within :data:`DEFAULTS_WITHIN` of it: a difference that small is
the noise between runs, and the defaults follow the machine they run on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clusterenv.bench.exactness import Exactness

__all__ = ["DEFAULTS_WITHIN", "Recommendation", "Report", "Row", "format_report", "recommend", "to_json"]

#: How far below the fastest clusterenv row the defaults' row may be and still be recommended.
DEFAULTS_WITHIN = 0.05


@dataclass(frozen=True)
class Row:
    """One measured backend: env-steps/s (median of the rounds) and its ratio to ``SyncVectorEnv``'s."""

    label: str
    backend: str
    options: dict[str, Any]
    env_steps_per_s: float
    vs_sync: float


@dataclass(frozen=True)
class Recommendation:
    """What to use, from the fastest row: its backend, options, ratio to ``SyncVectorEnv`` and the advice."""

    backend: str
    options: dict[str, Any]
    vs_sync: float
    text: str


@dataclass(frozen=True)
class Report:
    """Everything a run found; :func:`to_json` and :func:`format_report` write it out."""

    env_id: str
    num_envs: int
    cores: int
    env_step_us: float
    load_average: float | None
    exactness: Exactness
    rows: list[Row]
    recommendation: Recommendation
    skipped: list[str]


def _call(name: str, options: dict[str, Any]) -> str:
    arguments = ["env_fns", *(f"{key}={value!r}" for key, value in options.items())]
    return f"{name}({', '.join(arguments)})"


def recommend(rows: list[Row]) -> Recommendation:
    """The advice of the fastest row ("stay on SyncVectorEnv", "use clusterenv with these arguments: ...").

    Where the fastest row is a lockstep clusterenv row, the defaults' row (``ClusterEnv`` with
    no options) is recommended instead when it is within :data:`DEFAULTS_WITHIN` of it.
    """
    best = max(rows, key=lambda row: row.env_steps_per_s)
    ratio = f"{best.vs_sync:.2f}x"
    defaults = next((row for row in rows if row.backend == "ClusterEnv" and not row.options), None)
    if (
        best.backend == "ClusterEnv"
        and defaults is not None
        and defaults.env_steps_per_s >= (1 - DEFAULTS_WITHIN) * best.env_steps_per_s
    ):
        close = "" if defaults is best else f", within {DEFAULTS_WITHIN:.0%} of the fastest, `{best.label}` ({ratio})"
        text = f"use clusterenv with the defaults ({_call('ClusterEnv', {})}): {defaults.vs_sync:.2f}x{close}"
        return Recommendation(defaults.backend, {}, defaults.vs_sync, text)
    if best.backend == "SyncVectorEnv":
        others = [row for row in rows if row is not best]
        runner_up = max(others, key=lambda row: row.env_steps_per_s) if others else None
        behind = f": the next fastest, {runner_up.label}, ran at {runner_up.vs_sync:.2f}x" if runner_up else ""
        text = f"stay on SyncVectorEnv{behind}"
    elif best.backend == "ClusterEnv":
        text = f"use clusterenv with these arguments, {_call('ClusterEnv', best.options)}: {ratio}"
    elif best.backend == "ClusterEnv+PolicyRunner":
        cluster = {key: value for key, value in best.options.items() if key != "rollout_steps"}
        text = (
            f"workers acting pays: {ratio} (clusterenv.PolicyRunner over {_call('ClusterEnv', cluster)}, "
            f"rollouts of {best.options['rollout_steps']} steps; see the local-policies guide)"
        )
    elif best.backend == "EnvPool":
        text = f"use EnvPool (its own implementation of the env, not the same code): {ratio}"
    else:
        text = f"use {_call(best.backend, best.options)}: {ratio}"
    return Recommendation(best.backend, dict(best.options), best.vs_sync, text)


def to_json(report: Report) -> dict[str, Any]:
    """The report as the documented JSON object (``env_id``, ``rows``, ``recommendation``, ...)."""
    difference = report.exactness.difference
    return {
        "env_id": report.env_id,
        "num_envs": report.num_envs,
        "cores": report.cores,
        "env_step_us": report.env_step_us,
        "load_average": report.load_average,
        "exact": report.exactness.exact,
        "exact_steps": report.exactness.steps,
        "first_difference": None if difference is None else str(difference),
        "rows": [
            {
                "backend": row.backend,
                "label": row.label,
                "options": row.options,
                "env_steps_per_s": row.env_steps_per_s,
                "vs_sync": row.vs_sync,
            }
            for row in report.rows
        ],
        "recommendation": {
            "backend": report.recommendation.backend,
            "options": report.recommendation.options,
            "vs_sync": report.recommendation.vs_sync,
            "text": report.recommendation.text,
        },
        "skipped": report.skipped,
    }


def _load_line(report: Report) -> str:
    if report.load_average is None:
        return "load average: unknown on this system"
    line = f"load average before the run: {report.load_average:.1f} on {report.cores} cores"
    if report.load_average > report.cores / 2:
        line += (
            " (other jobs were running: rows with more processes lose most to them; run it again on a quiet machine)"
        )
    return line


def format_report(report: Report) -> str:
    """The report as text: what was run, exactness, the table (ratios to Sync), the recommendation."""
    exactness = report.exactness
    lines = [
        f"{report.env_id}: {report.num_envs} envs, {report.cores} usable cores, "
        f"one env step takes {report.env_step_us:,.1f} µs in this process",
        _load_line(report),
        (
            f"exact: clusterenv returned what SyncVectorEnv returned for {exactness.steps} steps "
            "(same seeds and actions)"
            if exactness.exact
            else f"NOT exact: first difference at {exactness.difference}"
        ),
        "",
    ]
    width = max(len(row.label) for row in report.rows)
    lines.append(f"| {'backend'.ljust(width)} | env-steps/s | vs Sync |")
    lines.append(f"|{'-' * (width + 2)}|------------:|--------:|")
    for row in report.rows:
        lines.append(f"| {row.label.ljust(width)} | {row.env_steps_per_s:11,.0f} | {row.vs_sync:6.2f}x |")
    lines += [f"(left out: {note})" for note in report.skipped]
    lines += ["", f"recommendation: {report.recommendation.text}"]
    return "\n".join(lines)
