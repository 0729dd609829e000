"""Off Linux, or in a sandbox: each Linux-only call of the default path has a fallback, and the envs step exactly.

Each case takes calls away (``tests/platform_patches.py``) in the learner and in every
process it starts, before clusterenv loads there, and checks that a ``ClusterEnv`` still
steps bit-identically to ``SyncVectorEnv``, on the step path the fallback says. The table of
these calls and their fallbacks is in docs/design.md ("Platform support").
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import tempfile
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import pytest
from gymnasium import spaces
from gymnasium.vector import SyncVectorEnv

from clusterenv import ClusterEnv
from clusterenv.wire import cleanup
from clusterenv.wire.pipes import wake_pair
from clusterenv.wire.processes import resource_usage
from clusterenv.wire.step_region import StepRegion
from clusterenv.worker.process import use_batch_scheduling
from tests import platform_patches
from tests.test_equivalence import run_lockstep

CARTPOLES = [functools.partial(gym.make, "CartPole-v1")] * 4
SHARED, MESSAGES = "shared memory", "messages"
# What the learner logs when its region is not a sealed memfd, or when there is no region at all.
UNLINKED_FILE = "the shared step region is an unlinked file in {where} instead"
NO_REGION = "The shared step region could not be made here"
NO_FD_PASSING = "this Python cannot pass a file descriptor over a socket"
SCRATCH = cleanup.shared_memory_base() or tempfile.gettempdir()  # where an unlinked region file goes
_sched_getscheduler = os.sched_getscheduler  # the learner's own, to look at its workers while os's is gone


@dataclass
class Case:
    """Calls taken away, the step path the workers then take, and the line the learner logs about it."""

    patches: list[str]
    step_path: str
    logged: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


CASES = {
    "no memfd_create (macOS)": Case(["no_memfd"], SHARED, UNLINKED_FILE.format(where=SCRATCH)),
    "memfd_create refused (seccomp)": Case(["memfd_refused"], SHARED, UNLINKED_FILE.format(where=SCRATCH)),
    "no file seals": Case(["no_seals"], SHARED, UNLINKED_FILE.format(where=SCRATCH)),
    "no memfd and no room for a file": Case(["no_room"], MESSAGES, NO_REGION),
    "no memfd, no posix_fallocate": Case(
        ["no_memfd", "no_posix_fallocate"], SHARED, UNLINKED_FILE.format(where=SCRATCH)
    ),
    "no memfd, no /dev/shm": Case(
        ["no_memfd", "no_dev_shm"], SHARED, UNLINKED_FILE.format(where=tempfile.gettempdir())
    ),
    "no /proc": Case(["no_proc"], SHARED),
    "no os.sched_* (SCHED_BATCH, affinity)": Case(["no_sched"], SHARED),
    "SCHED_BATCH refused": Case(["sched_refused"], SHARED),
    "no sched_yield, affinity or cgroup, spinning": Case(
        ["no_sched", "no_sched_yield", "no_cgroup"],
        SHARED,
        options={"num_workers": 1, "learner_envs": 2, "spin_us": 200.0},
    ),
    "no SCM_RIGHTS": Case(["no_scm_rights"], MESSAGES, NO_FD_PASSING),
    "socket buffer sizes refused": Case(["buffer_sizes_refused"], SHARED),
    "no prctl (env processes)": Case(["no_prctl"], MESSAGES, options={"procs_per_worker": 2}),
    "as on macOS": Case(
        ["no_memfd", "no_seals", "no_posix_fallocate", "no_dev_shm", "no_proc", "no_sched"],
        SHARED,
        UNLINKED_FILE.format(where=tempfile.gettempdir()),
    ),
}


def take_away(names: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path) -> str:
    """Apply the patches ``names`` here and in every process started from now on; the folder their pids go to."""
    marks = tmp_path / "started"
    marks.mkdir()
    (tmp_path / "sitecustomize.py").write_text(platform_patches.sitecustomize(names, marks))
    monkeypatch.syspath_prepend(str(tmp_path))  # workers inherit the learner's sys.path
    for name in names:
        platform_patches.PATCHES[name](monkeypatch)
    return str(marks)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_without_a_linux_only_call_a_cluster_env_steps_exactly(case, monkeypatch, tmp_path, caplog):
    marks = take_away(case.patches, monkeypatch, tmp_path)
    caplog.set_level(logging.INFO, logger="clusterenv")
    with (
        ClusterEnv(CARTPOLES, **{"num_workers": 2, **case.options}) as envs,
        closing(SyncVectorEnv(CARTPOLES)) as reference,
    ):
        assert [worker["step_path"] for worker in envs.worker_info] == [case.step_path] * envs.num_workers
        assert run_lockstep(reference, envs, steps=60, seed=5) >= 4  # across autoresets
        pids = [worker["pid"] for worker in envs.worker_info]
        assert {str(pid) for pid in pids} <= set(os.listdir(marks)), "the workers ran without the patches"
        if "no_sched" in case.patches or "sched_refused" in case.patches:
            assert [_sched_getscheduler(pid) for pid in pids] == [os.SCHED_OTHER] * len(pids)
        if "no_sched_yield" in case.patches:  # without affinity the cores are os.cpu_count()'s: both spin where 2
            assert envs.learner_info["spin"] == ("fixed" if (os.cpu_count() or 1) >= 2 else "never")
        if "no_proc" in case.patches:  # the learner cannot read the workers' usage, nor can they
            assert [worker["cpu_s"] for worker in envs.worker_info] == [None] * len(pids)
    if case.logged is not None:
        assert case.logged in caplog.text


# -- learner-side fallbacks, one call at a time ------------------------------------------------------
def region() -> StepRegion:
    return StepRegion(spaces.Box(-1, 1, (3,), "float32"), spaces.Discrete(2), [slice(0, 2), slice(2, 4)])


@pytest.mark.parametrize("patch", ["no_memfd", "memfd_refused", "no_seals"])
def test_without_a_sealed_memfd_the_region_is_a_file_that_nothing_names(patch, monkeypatch, caplog):
    platform_patches.PATCHES[patch](monkeypatch)
    with caplog.at_level(logging.INFO, logger="clusterenv.wire.region_file"):
        made = region()
    assert not made.sealed
    assert os.fstat(made.fd).st_nlink == 0 and os.fstat(made.fd).st_size == made.size
    assert os.readlink(f"/proc/self/fd/{made.fd}").endswith("/region (deleted)")
    assert "cannot be sealed" in caplog.text
    made.close()


def test_where_no_region_can_be_made_the_error_says_why(monkeypatch):
    platform_patches.no_room(monkeypatch)
    with pytest.raises(OSError) as raised:
        region()
    assert raised.value.errno == errno.ENOSPC
    assert not [name for name in os.listdir(SCRATCH) if name.startswith(f"clusterenv-steps-{os.getpid()}-")]


def test_without_fd_passing_there_is_no_wake_socket(monkeypatch):
    platform_patches.no_scm_rights(monkeypatch)
    assert wake_pair() is None


# -- worker-side fallbacks, in this process ----------------------------------------------------------
@pytest.mark.parametrize("patch", ["no_sched", "sched_refused"])
def test_a_worker_without_sched_batch_logs_it_and_goes_on(patch, monkeypatch, caplog):
    platform_patches.PATCHES[patch](monkeypatch)
    if patch == "sched_refused":  # as under the default policy, which a test runner may not have
        monkeypatch.setattr(os, "sched_getscheduler", lambda pid: os.SCHED_OTHER)
    with caplog.at_level(logging.INFO, logger="clusterenv.worker.process"):
        assert use_batch_scheduling() is False
    assert "SCHED_BATCH could not be set" in caplog.text


def test_without_proc_usage_is_unknown_and_a_process_tree_is_the_process_alone(monkeypatch):
    platform_patches.no_proc(monkeypatch)
    assert resource_usage(os.getpid()) is None
    assert cleanup.descendants(os.getpid()) == []
