"""A learner policy on a GPU: CPU copies for the workers, one host copy per snapshot, probes on its device.

The device tests run on every device this machine has: CPU always, CUDA and MPS where torch
can use them (elsewhere they are skipped, with the reason in the summary). On each, rollouts,
publishes and APS probes must give exactly what the default CPU path gives.
"""

from __future__ import annotations

import functools
import re

import gymnasium as gym
import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from clusterenv import APS, ClusterEnv, PolicyError, PolicyRunner
from clusterenv.policy.shipping import build_module, pack_architecture, policy_tensors, snapshot_weights
from tests.conftest import assert_same
from tests.envs import RichSpacesEnv
from tests.policies import DictPolicy

CARTPOLE = functools.partial(gym.make, "CartPole-v1")
HAS_CUDA = torch.cuda.is_available()
HAS_MPS = torch.backends.mps.is_available()
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=pytest.mark.skipif(
            not HAS_CUDA, reason=f"no CUDA here: torch {torch.__version__} has torch.cuda.is_available() False"
        ),
    ),
    pytest.param(
        "mps",
        id="mps",
        marks=pytest.mark.skipif(
            not HAS_MPS, reason=f"no MPS here: torch {torch.__version__} has torch.backends.mps.is_available() False"
        ),
    ),
]
ARRAY_FIELDS = ("obs", "actions", "logprobs", "logits", "rewards", "terminations", "truncations", "autoreset")
ARRAY_FIELDS += ("policy_versions", "next_obs", "env_ids")


def make_actor() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))


def new_weights(actor: nn.Module, version: int) -> dict[str, torch.Tensor]:
    """Seeded CPU weights, far from the previous version's: loading them is exact on any device."""
    generator = torch.Generator().manual_seed(100 + version)
    return {name: 2 * torch.randn(t.shape, generator=generator) for name, t in actor.state_dict().items()}


def collect(device: str | None) -> tuple[list, object, torch.device]:
    """Three rollouts around two publishes, APS deciding the pulls from the learner's probe outputs."""
    actor = make_actor()
    if device is not None:
        actor.to(device)
    with ClusterEnv([CARTPOLE] * 4, num_workers=2) as envs:
        runner = PolicyRunner(envs, actor, APS(threshold=0.05), seed=3, device=device)
        batches = [runner.rollout(12)]
        for version in (1, 2):
            actor.load_state_dict(new_weights(actor, version))
            assert runner.publish() == version
            batches.append(runner.rollout(12))
        return batches, runner.telemetry, runner.device


@pytest.fixture(scope="module")
def default_path():
    """The reference: a CPU policy, no `device` given."""
    return collect(None)


@pytest.fixture(scope="module")
def cartpole():
    """Four CartPole envs on two workers, for the tests that fail before anything is shipped."""
    with ClusterEnv([CARTPOLE] * 4, num_workers=2) as envs:
        yield envs


# -- the device path -------------------------------------------------------------------------
def test_the_default_device_is_where_the_policy_lives(default_path):
    _, telemetry, device = default_path
    assert device == torch.device("cpu")
    assert telemetry.total.pulls == 4, "both publishes should move the policy far enough for both workers to pull"


@pytest.mark.parametrize("device", DEVICES)
def test_rollouts_publishes_and_probes_on_a_device_match_the_default_path(device, default_path):
    expected_batches, expected, _ = default_path
    batches, telemetry, resolved = collect(device)
    assert resolved.type == device
    for got, want in zip(batches, expected_batches, strict=True):
        for name in ARRAY_FIELDS:
            assert_same(getattr(got, name), getattr(want, name), name)
        assert_same(got.infos, want.infos, "infos")
        assert got.learner_version == want.learner_version
    for got_worker, want_worker in zip(telemetry.workers, expected.workers, strict=True):
        assert (got_worker.pulls, got_worker.kl_checks) == (want_worker.pulls, want_worker.kl_checks)
        assert got_worker.lag_counts == want_worker.lag_counts
        assert got_worker.weight_bytes == want_worker.weight_bytes
        if device == "cpu":  # the same code on the same device: bit for bit
            assert got_worker.kl_sum == want_worker.kl_sum
        else:  # the learner's probe outputs come from another device's kernels
            assert got_worker.kl_sum == pytest.approx(want_worker.kl_sum, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_prefetching_runner_measures_kl_with_a_device_policy(device):
    actor = make_actor().to(device)
    with ClusterEnv([CARTPOLE] * 4, num_workers=2) as envs:
        runner = PolicyRunner(envs, actor, APS(threshold=0.05), seed=3, prefetch=1, device=device)
        first = runner.rollout(8)
        actor.load_state_dict(new_weights(actor, 1))
        runner.publish()
        second = runner.rollout(8)
        leftovers = runner.stop()
    assert first.obs.shape == second.obs.shape == (8, 4, 4)
    assert len(leftovers) == 1
    assert runner.telemetry.total.kl_checks > 0


def dict_rollouts(device: str) -> tuple[list, object]:
    """Two rollouts of Dict observations around a publish, with the learner's probes on ``device``."""
    actor = DictPolicy(3, seed=6).to(device)
    with ClusterEnv([RichSpacesEnv] * 4, num_workers=2) as envs:
        runner = PolicyRunner(envs, actor, APS(threshold=1e-9), seed=2, device=device)
        batches = [runner.rollout(6)]
        with torch.no_grad():
            actor.box.bias.add_(torch.tensor([1.0, 0.0, -1.0], device=device))
        runner.publish()
        batches.append(runner.rollout(6))
        return batches, runner.telemetry


@pytest.mark.parametrize("device", DEVICES)
def test_dict_observations_go_to_a_device_policy_leaf_by_leaf(device):
    batches, telemetry = dict_rollouts(device)
    expected_batches, expected = dict_rollouts("cpu")
    for got, want in zip(batches, expected_batches, strict=True):
        for name in ("obs", "actions", "rewards", "policy_versions", "next_obs"):
            assert_same(getattr(got, name), getattr(want, name), name)
    for got_worker, want_worker in zip(telemetry.workers, expected.workers, strict=True):
        assert got_worker.pulls == want_worker.pulls == 1
        assert got_worker.kl_sum == pytest.approx(want_worker.kl_sum, rel=1e-4, abs=1e-6)
    tensors = batches[0].as_tensors(device)
    image, (box, index) = tensors["obs"]["image"], tensors["obs"]["state"]
    assert image.device.type == box.device.type == device
    assert (image.dtype, box.dtype, index.dtype) == (torch.uint8, torch.float64, torch.int64)


@pytest.mark.parametrize("device", DEVICES)
def test_a_snapshot_copies_to_the_host_once_whatever_the_number_of_tensors(device):
    module = nn.Sequential(*[nn.Linear(3, 3) for _ in range(6)], nn.BatchNorm1d(3)).to(device)
    assert len(policy_tensors(module)) == 17

    class Calls(TorchFunctionMode):
        """Records the tensor methods that can move data off a device, with the size of the tensor."""

        def __init__(self) -> None:
            super().__init__()
            self.moves: list[tuple[str, int]] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in ("cpu", "to", "numpy", "tolist", "item") and args and isinstance(args[0], torch.Tensor):
                self.moves.append((name, args[0].numel()))
            return func(*args, **(kwargs or {}))

    with Calls() as calls:
        snapshot_weights(module)
    size = sum(-(-t.numel() * t.element_size() // 64) * 64 for t in policy_tensors(module).values())
    # numpy() of empty tensors only looks up dtypes; the packed buffer crosses once, then is viewed.
    assert [move for move in calls.moves if move[1]] == [("cpu", size), ("numpy", size)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_snapshot_keeps_every_dtype_and_shape_and_ignores_later_training(device):
    module = nn.Module()
    module.f16 = nn.Parameter(torch.arange(5, dtype=torch.float16))
    module.f64 = nn.Parameter(torch.linspace(0, 1, 6, dtype=torch.float64).reshape(2, 3))
    module.transposed = nn.Parameter(torch.arange(12.0).reshape(3, 4).t())  # not contiguous
    module.register_buffer("count", torch.tensor(7))  # 0-d int64, like BatchNorm's
    module.register_buffer("mask", torch.tensor([True, False, True]))
    module.register_buffer("empty", torch.zeros(0, 3))
    if device == "mps":  # MPS has no float64
        del module.f64
    module.to(device)
    expected = {name: t.detach().cpu().numpy().copy() for name, t in policy_tensors(module).items()}

    names, arrays = snapshot_weights(module)
    with torch.no_grad():
        for tensor in policy_tensors(module).values():
            tensor.zero_()

    assert names == list(expected)
    for name, array in zip(names, arrays, strict=True):
        assert_same(array, expected[name], name)
        assert array.flags.c_contiguous and array.flags.aligned, name


@pytest.mark.parametrize("device", [*DEVICES, pytest.param("meta", id="meta")])
def test_the_architecture_holds_cpu_placeholders_wherever_the_policy_lives(device):
    module = make_actor().to(device)
    rebuilt = build_module(pack_architecture(module))
    assert {t.device for t in policy_tensors(rebuilt).values()} == {torch.device("cpu")}


# -- bad input ---------------------------------------------------------------------------------
@pytest.mark.skipif(HAS_CUDA, reason="this machine has CUDA")
def test_cuda_without_cuda_names_both_devices(cartpole):
    message = (
        f"`device='cuda'` cannot be used by this learner: this torch {torch.__version__} has no usable CUDA "
        "(`torch.cuda.is_available()` is False). The policy lives on cpu; pass `device='cpu'` (or leave "
        "`device` unset) to keep it there."
    )
    with pytest.raises(PolicyError, match=re.escape(message)):
        PolicyRunner(cartpole, make_actor(), device="cuda")


@pytest.mark.skipif(HAS_MPS, reason="this machine has MPS")
def test_mps_without_mps_names_both_devices(cartpole):
    with pytest.raises(PolicyError, match=r"`device='mps'` cannot be used by this learner: .* lives on cpu"):
        PolicyRunner(cartpole, make_actor(), device=torch.device("mps"))


@pytest.mark.skipif(not HAS_CUDA, reason=f"no CUDA here: torch {torch.__version__} has torch.cuda.is_available() False")
def test_a_device_other_than_the_policys_is_refused(cartpole):
    with pytest.raises(PolicyError, match=re.escape("`device='cpu'`, but the policy lives on cuda:0")):
        PolicyRunner(cartpole, make_actor().cuda(), device="cpu")
    with pytest.raises(PolicyError, match=re.escape("`device='cuda:0'`, but the policy lives on cpu")):
        PolicyRunner(cartpole, make_actor(), device="cuda:0")
    missing = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(PolicyError, match=re.escape(f"`device='{missing}'` cannot be used by this learner")):
        PolicyRunner(cartpole, make_actor().cuda(), device=missing)


def test_a_device_string_torch_does_not_know_is_refused(cartpole):
    with pytest.raises(PolicyError, match=re.escape("`device='gpu'` is not a torch device")):
        PolicyRunner(cartpole, make_actor(), device="gpu")


def test_a_device_of_the_wrong_type_is_refused(cartpole):
    with pytest.raises(TypeError, match=re.escape("`device` must be a str or torch.device such as 'cuda' or 'cpu'")):
        PolicyRunner(cartpole, make_actor(), device=0)  # type: ignore[arg-type]


def test_the_meta_device_is_refused_as_device_and_as_the_policys(cartpole):
    with pytest.raises(PolicyError, match=re.escape("`device='meta'` cannot be used by this learner")):
        PolicyRunner(cartpole, make_actor(), device="meta")
    with pytest.raises(PolicyError, match=re.escape("The policy's tensors are on the `meta` device")):
        PolicyRunner(cartpole, make_actor().to("meta"))


def test_a_policy_spread_over_devices_is_refused(cartpole):
    actor = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2).to("meta"))
    with pytest.raises(PolicyError, match=re.escape("The policy's tensors are on several devices (cpu, meta)")):
        PolicyRunner(cartpole, actor)


def test_publishing_something_other_than_a_module_is_refused(cartpole):
    runner = PolicyRunner(cartpole, make_actor(), device="cpu")
    with pytest.raises(
        PolicyError, match=re.escape("`policy` must be a torch.nn.Module to publish, got OrderedDict; to publish")
    ):
        runner.publish(make_actor().state_dict())  # type: ignore[arg-type]
    assert runner.version == 0
