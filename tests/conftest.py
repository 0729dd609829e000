"""Fixtures shared by the suite: every process a test starts is gone when it ends."""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest

from clusterenv.learner.shared_steps import SharedSteps


def child_pids(parent: int | None = None) -> set[int]:
    """Live (non-zombie) direct children of ``parent`` (default: this process), from /proc."""
    parent = os.getpid() if parent is None else parent
    children = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[1]) == parent:
            children.add(int(entry))
    return children


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def kill_mid_step(envs, actions: np.ndarray, worker_ids) -> list[int]:
    """``envs.step_async(actions)`` with workers ``worker_ids`` killed while their step is in flight; their pids.

    Each is frozen before the step goes out, so that none can answer before its kill lands.
    """
    pids = [envs.worker_info[w]["pid"] for w in worker_ids]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    envs.step_async(actions)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids


@pytest.fixture(autouse=True, scope="session")
def sb3_logs_in_pytest_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Stable-Baselines3's log folders go in pytest's temp dir, which pytest cleans, not in the system's.

    SB3 makes one for every training run, in the temp dir unless ``$SB3_LOGDIR`` names one;
    the examples the suite runs inherit it.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SB3_LOGDIR", str(tmp_path_factory.mktemp("sb3-logs")))
        yield


@pytest.fixture(autouse=True)
def no_leaked_workers() -> Iterator[None]:
    """Fail any test that leaves a worker process of its own running."""
    before = child_pids()
    yield
    leaked = lambda: child_pids() - before  # noqa: E731
    if not wait_until(lambda: not leaked(), timeout=10):
        pids = leaked()
        for pid in pids:
            os.kill(pid, 9)
        pytest.fail(f"Test leaked worker processes {sorted(pids)}")


class StepMessages:
    """How many messages completed a step on the shared step path (infos, usage reports, layouts), since when."""

    def __init__(self) -> None:
        self.count = 0
        self.started = time.monotonic()
        self._completed = SharedSteps.completed

    def __call__(self, path, worker_id, msg):
        self.count += 1
        return self._completed(path, worker_id, msg)

    def without_one_per_step(self, workers: int) -> int:
        """The most that workers whose steps need no message send: a layout each, a usage report each second."""
        return workers * (2 + math.ceil(time.monotonic() - self.started))


@contextmanager
def counting_step_messages() -> Iterator[StepMessages]:
    """Count the messages that complete a step on the shared step path while the block runs."""
    counter = StepMessages()
    with mock.patch.object(SharedSteps, "completed", autospec=True, side_effect=counter):
        yield counter


def assert_same(a, b, path: str = "") -> None:
    """Recursive exact equality, dtypes and key order included."""
    if isinstance(a, dict):
        assert isinstance(b, dict), path
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), f"{path}: {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        if a.dtype == object:
            for i, (x, y) in enumerate(zip(a, b, strict=False)):
                assert_same(x, y, f"{path}[{i}]")
        else:
            np.testing.assert_array_equal(a, b, err_msg=path)
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} != {b!r}"
