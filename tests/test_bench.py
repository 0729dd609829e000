"""``python -m clusterenv.bench``: the exactness check, the report and its JSON, and errors on bad input.

Runs use a fraction of a second of timing, so nothing here asserts a speed: only what is
reported and how it is shaped.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from clusterenv.bench.candidates import clusterenv_options, worker_counts
from clusterenv.bench.cli import main
from clusterenv.bench.exactness import check_exact, first_difference
from clusterenv.bench.report import Row, recommend
from clusterenv.learner.layout import workers_and_learner
from tests.envs import ProcessCounterEnv

ROOT = Path(__file__).resolve().parents[1]


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clusterenv.bench", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_clusterenv_returns_what_sync_returns_for_cartpole() -> None:
    outcome = check_exact(functools.partial(gym.make, "CartPole-v1"), 4, 200, 0, {"num_workers": 2})
    assert outcome.exact and outcome.steps == 200


def test_an_env_that_counts_steps_per_process_shows_its_first_difference() -> None:
    """Env 2 is the first in the second worker: its count starts again at 1 where Sync's is at 3."""
    outcome = check_exact(ProcessCounterEnv, 4, 20, 0, {"num_workers": 2})
    assert not outcome.exact
    difference = outcome.difference
    assert (difference.step, difference.field, difference.env_index) == (1, "rewards", 2)
    assert (difference.expected, difference.got) == ("np.float64(3.0)", "np.float64(1.0)")


def test_a_difference_in_a_dict_names_its_key_and_env() -> None:
    expected = {"lives": np.array([3, 3, 2]), "_lives": np.array([True, True, True])}
    got = {"lives": np.array([3, 3, 3]), "_lives": np.array([True, True, True])}
    assert first_difference("infos", expected, got)[:2] == ("infos['lives']", 2)
    assert first_difference("infos", {"a": np.zeros(2)}, {"b": np.zeros(2)})[:2] == ("infos keys", None)
    assert first_difference("observations", np.array([np.nan, 1.0]), np.array([np.nan, 1.0])) is None


ACTING = {"rollout_steps": 32}


def row(label: str, backend: str, rate: float, options: dict | None = None) -> Row:
    return Row(label, backend, options or {}, rate, rate / 100.0)


SYNC_ROW = row("SyncVectorEnv", "SyncVectorEnv", 100)


@pytest.mark.parametrize(
    ("rows", "text"),
    [
        ([SYNC_ROW, row("clusterenv", "ClusterEnv", 40)], "stay on SyncVectorEnv"),
        (
            [SYNC_ROW, row("w=2", "ClusterEnv", 170, {"num_workers": 2})],
            "use clusterenv with these arguments, ClusterEnv(env_fns, num_workers=2): 1.70x",
        ),
        (
            [SYNC_ROW, row("defaults", "ClusterEnv", 150), row("w=2", "ClusterEnv", 170, {"num_workers": 2})],
            "use clusterenv with these arguments, ClusterEnv(env_fns, num_workers=2): 1.70x",
        ),
        ([SYNC_ROW, row("act", "ClusterEnv+PolicyRunner", 210, {"rollout_steps": 32})], "workers acting pays: 2.10x"),
    ],
    ids=["sync", "clusterenv", "defaults-too-slow", "acting"],
)
def test_the_recommendation_is_the_fastest_row(rows: list[Row], text: str) -> None:
    advice = recommend(rows)
    fastest = max(rows, key=lambda r: r.env_steps_per_s)
    assert (advice.backend, advice.options, advice.vs_sync) == (fastest.backend, fastest.options, fastest.vs_sync)
    assert advice.text.startswith(text)


@pytest.mark.parametrize("rate", [170, 162, 161.5], ids=["fastest", "4.7%-behind", "5%-behind"])
def test_the_defaults_are_recommended_within_5_percent_of_the_fastest_clusterenv_row(rate: float) -> None:
    rows = [SYNC_ROW, row("defaults", "ClusterEnv", rate), row("w=2", "ClusterEnv", 170, {"num_workers": 2})]
    advice = recommend(rows)
    assert (advice.backend, advice.options, advice.vs_sync) == ("ClusterEnv", {}, rate / 100)
    assert advice.text.startswith(f"use clusterenv with the defaults (ClusterEnv(env_fns)): {rate / 100:.2f}x")
    assert ("within 5% of the fastest, `w=2` (1.70x)" in advice.text) == (rate != 170)


def test_clusterenv_rows_are_the_defaults_then_other_worker_counts() -> None:
    assert worker_counts(16, 64) == [1, 4, 8, 16]
    assert worker_counts(2, 16) == [1, 2]
    assert worker_counts(16, 2) == [1, 2]
    for num_envs, cores in [(16, 2), (64, 16), (16, 1), (1, 4)]:
        rows = clusterenv_options(num_envs, cores)
        assert rows[0] == ("clusterenv (defaults)", {})
        # The defaults' layout is the split (a worker per core but one, the learner a share): no row repeats it.
        default = workers_and_learner(num_envs, cores)
        others = [(options["num_workers"], options.get("learner_envs", 0)) for _, options in rows[1:]]
        assert (default.num_workers, default.learner_envs) not in others
    assert clusterenv_options(16, 2)[1:] == [
        ("clusterenv num_workers=1", {"num_workers": 1}),
        ("clusterenv num_workers=2", {"num_workers": 2}),
    ]
    assert clusterenv_options(1, 4) == [("clusterenv (defaults)", {})]  # one env: one worker is the defaults


def test_a_run_writes_the_report_and_its_json(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    done = bench(
        "CartPole-v1",
        "--num-envs",
        "2",
        "--seconds",
        "0.5",
        "--rounds",
        "1",
        "--check-steps",
        "20",
        "--json",
        str(path),
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(path.read_text())
    assert set(report) >= {"env_id", "num_envs", "cores", "env_step_us", "exact", "rows", "recommendation"}
    assert (report["env_id"], report["num_envs"], report["exact"]) == ("CartPole-v1", 2, True)
    assert report["cores"] >= 1 and report["env_step_us"] > 0 and report["load_average"] >= 0
    backends = [r["backend"] for r in report["rows"]]
    assert backends[0] == "SyncVectorEnv" and report["rows"][0]["vs_sync"] == 1.0
    assert {"AsyncVectorEnv", "ClusterEnv", "ClusterEnv+PolicyRunner"} <= set(backends)
    for r in report["rows"]:
        assert set(r) >= {"backend", "options", "env_steps_per_s", "vs_sync"} and isinstance(r["options"], dict)
        assert r["vs_sync"] == pytest.approx(r["env_steps_per_s"] / report["rows"][0]["env_steps_per_s"])
    assert [r["label"] for r in report["rows"] if r["backend"] == "ClusterEnv"][0] == "clusterenv (defaults)"
    fastest = max(report["rows"], key=lambda r: r["env_steps_per_s"])
    defaults = next(r for r in report["rows"] if r["label"] == "clusterenv (defaults)")
    if fastest["backend"] == "ClusterEnv" and defaults["env_steps_per_s"] >= 0.95 * fastest["env_steps_per_s"]:
        fastest = defaults
    advice = report["recommendation"]
    assert (advice["backend"], advice["options"], advice["vs_sync"]) == (
        fastest["backend"],
        fastest["options"],
        fastest["vs_sync"],
    )
    assert advice["text"] in done.stdout and "exact: clusterenv returned what SyncVectorEnv returned" in done.stdout
    assert "round 1/1" in done.stderr  # progress while measuring


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["NoSuchEnv-v0"], "unknown env id `NoSuchEnv-v0`"),
        (["--entry-point", "no_such_module:make"], "module `no_such_module` does not import"),
        (["--entry-point", "tests.envs:NoSuchEnv"], "`tests.envs` has no attribute `NoSuchEnv`"),
        (
            ["--entry-point", "tests.envs:LockedSpaceEnv", "--num-envs", "2"],
            "clusterenv cannot run `tests.envs:LockedSpaceEnv`",
        ),
        (
            ["--entry-point", "os:getcwd"],
            "`os:getcwd` must return a `gymnasium.Env`, but it returned a str (",
        ),
        (
            ["--entry-point", "tests.envs:make_without_return"],
            "`tests.envs:make_without_return` must return a `gymnasium.Env`, but it returned None (does the factory "
            "miss a `return`?)",
        ),
        ([], "give an env id or `--entry-point module:function`"),
        (["CartPole-v1", "--num-envs", "0"], "`--num-envs` must be at least 1, got 0"),
    ],
    ids=[
        "unknown-id",
        "entry-point-not-importing",
        "entry-point-missing",
        "spaces-not-carried",
        "not-an-env",
        "none",
        "nothing",
        "num-envs",
    ],
)
def test_bad_input_ends_with_one_line_and_status_2(args: list[str], message: str) -> None:
    done = bench(*args)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error" in line]  # progress lines may come before
    assert len(errors) == 1 and message in errors[0] and errors[0] == done.stderr.strip().splitlines()[-1], done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("seconds", ["inf", "nan", "-1", "0"])
def test_seconds_that_would_never_end_or_never_start_are_refused(
    seconds: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["CartPole-v1", f"--seconds={seconds}"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"clusterenv-bench: error: `--seconds` must be a positive, finite number, got {float(seconds)}"
    ]
