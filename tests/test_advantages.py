"""The PPO examples' advantages under NEXT_STEP autoreset, against values worked out by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parent.parent / "examples" / "advantages.py"
_SPEC = importlib.util.spec_from_file_location("advantages", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
advantages_module = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(advantages_module)
compute_advantages = advantages_module.compute_advantages

GAMMA, LAMBDA = 0.9, 0.5


def column(*values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)[:, None]


@pytest.fixture
def rollout():
    """Six steps of two envs. Env 0: a termination at t=1, a truncation at t=4, each followed by a reset step.

    Env 1 never ends an episode and bootstraps from the value after the rollout.
    """
    bools = {"dtype": torch.bool}
    return {
        "rewards": torch.cat([column(1, 2, 0, 3, 4, 0), column(1, 1, 1, 1, 1, 1)], 1),
        "values": torch.cat([column(10, 20, 30, 40, 50, 60), column(0, 0, 0, 0, 0, 0)], 1),
        # V(obs[t + 1]); obs[5] of env 0 is the true final observation of the truncated episode.
        "next_values": torch.cat([column(20, 30, 40, 50, 60, 70), column(0, 0, 0, 0, 0, 10)], 1),
        "terminations": torch.cat([column(0, 1, 0, 0, 0, 0, **bools), column(0, 0, 0, 0, 0, 0, **bools)], 1),
        "truncations": torch.cat([column(0, 0, 0, 0, 1, 0, **bools), column(0, 0, 0, 0, 0, 0, **bools)], 1),
        "autoreset": torch.cat([column(0, 0, 1, 0, 0, 1, **bools), column(0, 0, 0, 0, 0, 0, **bools)], 1),
    }


def test_termination_truncation_and_reset_rows_by_hand(rollout):
    advantages, returns, mask = compute_advantages(**rollout, gamma=GAMMA, gae_lambda=LAMBDA)
    # Env 0, from the end:
    #   t=5 reset step                          A = 0
    #   t=4 truncated: 4 + 0.9 * 60 - 50 = 8     A = 8            (bootstraps from the final observation)
    #   t=3: delta 3 + 0.9 * 50 - 40 = 8         A = 8 + 0.45 * 8 = 11.6
    #   t=2 reset step                          A = 0
    #   t=1 terminated: 2 + 0 - 20 = -18         A = -18          (no bootstrap)
    #   t=0: delta 1 + 0.9 * 20 - 10 = 9         A = 9 + 0.45 * -18 = 0.9
    torch.testing.assert_close(advantages[:, 0], torch.tensor([0.9, -18.0, 0.0, 11.6, 8.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(returns[:, 0], torch.tensor([10.9, 2.0, 30.0, 51.6, 58.0, 60.0], dtype=torch.float64))
    assert mask[:, 0].tolist() == [True, True, False, True, True, False]
    # Env 1: A5 = 1 + 0.9 * 10 = 10, then A_t = 1 + 0.45 * A_{t+1}.
    expected = [10.0]
    for _ in range(5):
        expected.insert(0, 1 + 0.45 * expected[0])
    torch.testing.assert_close(advantages[:, 1], torch.tensor(expected, dtype=torch.float64))
    assert mask[:, 1].all()


def test_a_truncation_is_not_a_termination(rollout):
    advantages, _, _ = compute_advantages(**rollout, gamma=GAMMA, gae_lambda=LAMBDA)
    as_terminated = dict(rollout, terminations=rollout["terminations"] | rollout["truncations"])
    truncation_as_termination, _, _ = compute_advantages(**as_terminated, gamma=GAMMA, gae_lambda=LAMBDA)
    assert advantages[4, 0] == 8.0 and truncation_as_termination[4, 0] == 4.0 - 50.0


def test_float_done_flags_as_the_examples_store_them(rollout):
    as_floats = {k: v.to(torch.float32) for k, v in rollout.items()}
    advantages, returns, mask = compute_advantages(**as_floats, gamma=GAMMA, gae_lambda=LAMBDA)
    expected, _, _ = compute_advantages(**rollout, gamma=GAMMA, gae_lambda=LAMBDA)
    torch.testing.assert_close(advantages, expected.to(torch.float32))
    assert mask.dtype == torch.bool and returns.dtype == torch.float32
