"""Weight deltas: lossless rebuilds bit for bit, lossy ones stay within their error and are guarded, fallbacks."""

from __future__ import annotations

import functools
import logging
import os
import signal

import gymnasium as gym
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from torch import nn

from clusterenv import APS, ClusterEnv, EveryUpdate, FixedInterval, LossyWeights, Never, PolicyError, PolicyRunner
from clusterenv.learner.weight_shipments import WeightShipments
from clusterenv.policy.deltas import apply_delta, digest, encode_delta
from clusterenv.policy.strategies import Telemetry, WorkerTelemetry
from clusterenv.wire.messages import WeightsRequestMeta
from tests.conftest import assert_same

CARTPOLE = functools.partial(gym.make, "CartPole-v1")


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# -- the codec ---------------------------------------------------------------------------------
tensor_dtypes = st.sampled_from([np.float32, np.float64, np.float16, np.int64, np.int32, np.uint8, np.bool_])


@st.composite
def version_pairs(draw):
    """Two versions of one tensor: any bit patterns (NaN, infinities, -0.0 included)."""
    dtype = np.dtype(draw(tensor_dtypes))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6))
    return draw(hnp.arrays(dtype, shape)), draw(hnp.arrays(dtype, shape))


@settings(max_examples=200, deadline=None)
@given(st.lists(version_pairs(), min_size=1, max_size=4))
def test_a_lossless_delta_rebuilds_every_tensor_bit_for_bit(pairs):
    held, new = [a for a, _ in pairs], [b for _, b in pairs]
    frames, scales, rebuilt = encode_delta(held, new, bits=None)
    assert scales == [None] * len(new) and rebuilt is not held
    out = apply_delta(held, frames, scales, bits=None)
    assert all(same_bits(o, n) for o, n in zip(out, new, strict=True))
    assert digest(out) == digest(new)


@pytest.mark.parametrize("bits", [2, 4, 8, 16])
def test_a_lossy_delta_rebuilds_what_the_learner_records_within_half_a_step(bits):
    rng = np.random.default_rng(bits)
    held = [rng.normal(size=(64, 32)).astype(np.float32), np.arange(5)]
    new = [held[0] + rng.normal(scale=0.01, size=held[0].shape).astype(np.float32), np.arange(5) + 3]
    frames, scales, rebuilt = encode_delta(held, new, bits)
    out = apply_delta(held, frames, scales, bits)
    assert digest(out) == digest(rebuilt), "the worker rebuilds exactly what the learner records"
    assert same_bits(out[1], new[1]) and scales[1] is None, "integer tensors stay exact"
    error = np.abs(out[0] - new[0]).max()
    if bits == 16:
        assert error <= np.abs(new[0] - held[0]).max() * 2**-10
    else:
        assert scales[0] is not None and error <= scales[0] / 2 * 1.001
    assert not same_bits(out[0], new[0])


def test_error_feedback_keeps_the_rebuild_error_from_accumulating_over_versions():
    """Each delta is taken from what the worker rebuilt, so the error after k versions is one step's, not k."""
    rng = np.random.default_rng(0)
    versions = [rng.normal(size=4096).astype(np.float32)]
    for _ in range(30):  # a drift: every update moves the weights the same way, as momentum does
        versions.append(versions[-1] + np.float32(0.01) + rng.normal(scale=0.002, size=4096).astype(np.float32))
    shipments = WeightShipments(LossyWeights(bits=2), Telemetry([WorkerTelemetry(0)]), lambda w: None)
    shipments.installed(0, 0, [versions[0]])
    worker = [versions[0]]  # what the worker holds, rebuilt as it would
    naive = [versions[0]]  # quantizing version-to-version differences instead, without feedback
    for version, weights in enumerate(versions[1:], start=1):
        meta, frames = shipments.shipment(0, version, [weights], guarded=True)
        assert meta["encoding"] == "lossy" and meta["base"] == digest(worker)
        worker = apply_delta(worker, frames, meta["scales"], meta["bits"])
        assert digest(worker) == meta["digest"]
        step, scale, _ = encode_delta([versions[version - 1]], [weights], 2)
        naive = apply_delta(naive, step, scale, 2)
        assert np.abs(worker[0] - weights).max() <= meta["scales"][0] / 2 * 1.001
    assert np.abs(naive[0] - versions[-1]).max() > 5 * np.abs(worker[0] - versions[-1]).max()


# -- which shipment a worker gets ------------------------------------------------------------------
def request(held: bytes | None, exact: bool = False) -> WeightsRequestMeta:
    return WeightsRequestMeta(kl=None, version=0, held=held, exact=exact)


@pytest.fixture
def two_versions():
    rng = np.random.default_rng(1)
    first = [rng.normal(size=100).astype(np.float32)]
    return first, [first[0] + np.float32(0.1)]


def test_a_worker_whose_weights_are_unknown_gets_a_full_copy(two_versions, caplog):
    first, second = two_versions
    telemetry = Telemetry([WorkerTelemetry(0)])
    shipments = WeightShipments("lossless", telemetry, lambda w: None)
    held = shipments.installed(0, 0, first)
    assert shipments.shipment(0, 1, second, request=request(held))[0]["encoding"] == "lossless"
    assert shipments.shipment(0, 1, second, request=request(None))[0]["encoding"] == "full", "it asked for one"
    with caplog.at_level(logging.WARNING):
        meta, frames = shipments.shipment(0, 1, second, request=request(b"another version"))
    assert meta["encoding"] == "full" and frames == second and "other weights" in caplog.text
    fresh = WeightShipments("lossless", Telemetry([WorkerTelemetry(0)]), lambda w: None)
    assert fresh.shipment(0, 1, second, request=request(held))[0]["encoding"] == "full", "never installed"
    total = telemetry.total
    assert (total.pulls, total.full_pulls, total.delta_pulls) == (3, 2, 1)


def test_a_pull_sent_while_a_push_was_on_its_way_gets_a_delta_from_the_push(two_versions):
    first, second = two_versions
    third = [second[0] * np.float32(1.5)]
    shipments = WeightShipments("lossless", Telemetry([WorkerTelemetry(0)]), lambda w: None)
    held = shipments.installed(0, 0, first)
    pushed = shipments.shipment(0, 1, second)[0]  # a push: from the record
    assert pushed["base"] == held
    meta = shipments.shipment(0, 2, third, request=request(held))[0]  # asked before the push arrived
    assert meta["encoding"] == "lossless" and meta["base"] == pushed["digest"]


def test_workers_at_the_same_version_share_one_encoding_of_their_lossless_delta(two_versions):
    first, second = two_versions
    third = [second[0] * np.float32(1.5)]
    shipments = WeightShipments("lossless", Telemetry([WorkerTelemetry(w) for w in range(3)]), lambda w: None)
    for w in range(3):
        shipments.installed(w, 0, first)
    to_second = [shipments.shipment(w, 1, second)[1] for w in range(3)]
    assert all(frames is to_second[0] for frames in to_second), "one encoding of the delta from 0 to 1"
    to_third = [shipments.shipment(w, 2, third)[1] for w in range(3)]
    assert all(frames is to_third[0] for frames in to_third) and to_third[0] is not to_second[0]


def test_a_lossy_delta_goes_only_where_the_guard_can_check_it(two_versions):
    first, second = two_versions
    telemetry = Telemetry([WorkerTelemetry(0)])
    shipments = WeightShipments(LossyWeights(bits=4, guard_kl=0.5), telemetry, lambda w: None)
    held = shipments.installed(0, 0, first)
    meta = shipments.shipment(0, 1, second, request=request(held), guarded=False)[0]
    assert meta["encoding"] == "lossless" and "guard_kl" not in meta
    shipments.installed(0, 0, first)
    meta = shipments.shipment(0, 1, second, request=request(held), guarded=True)[0]
    assert meta["encoding"] == "lossy" and meta["bits"] == 4 and meta["guard_kl"] == 0.5
    meta = shipments.shipment(0, 1, second, request=request(meta["digest"], exact=True), guarded=True)[0]
    assert meta["encoding"] == "lossless" and meta["digest"] == digest(second), "the guard's answer is exact"
    assert telemetry.total.guard_trips == 1


def test_by_default_workers_on_other_hosts_get_lossless_deltas_and_local_ones_full_copies():
    import socket

    hosts = {0: socket.gethostname(), 1: "another-host", 2: None}
    shipments = WeightShipments(None, Telemetry([WorkerTelemetry(w) for w in hosts]), hosts.get)
    assert [shipments.encoding_for(w) for w in hosts] == ["full", "lossless", "full"]


@pytest.mark.parametrize("weights", ["delta", 8, LossyWeights])
def test_an_unknown_weights_option_is_refused(weights):
    with ClusterEnv([CARTPOLE] * 2, num_workers=1) as envs:
        with pytest.raises(PolicyError, match="`weights` must be None .* 'full', 'lossless', 'lossy'"):
            PolicyRunner(envs, nn.Linear(4, 2), weights=weights)


@pytest.mark.parametrize(
    ("value", "match"), [({"bits": 9}, "`bits`"), ({"bits": 1}, "`bits`"), ({"guard_kl": 0}, "`guard_kl`")]
)
def test_lossy_settings_out_of_range_are_refused(value, match):
    with pytest.raises(PolicyError, match=match):
        LossyWeights(**value)


def test_lossy_weights_need_the_probes_their_guard_reads():
    with ClusterEnv([CARTPOLE] * 2, num_workers=1) as envs:
        with pytest.raises(PolicyError, match="KL guard .* `measure_kl=True`"):
            PolicyRunner(envs, nn.Linear(4, 2), EveryUpdate(), measure_kl=False, weights="lossy")


# -- through the runner ------------------------------------------------------------------------------
def actor() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2))


def train(envs, weights, *, sync=None, updates=6, prefetch=0, kill_at=None, noise=0.05):
    """Rollouts under ``weights``, the actor nudged by seeded noise between them (a stand-in for an update)."""
    policy = actor()
    runner = PolicyRunner(
        envs, policy, EveryUpdate() if sync is None else sync, seed=3, weights=weights, prefetch=prefetch
    )
    rng = torch.Generator().manual_seed(7)
    batches = []
    for update in range(updates):
        if update == kill_at:
            os.kill(envs.worker_info[1]["pid"], signal.SIGKILL)
        batches.append(runner.rollout(8))
        with torch.no_grad():
            for parameter in policy.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=rng) * noise)
        runner.publish()
    runner.stop()
    return batches, runner.telemetry.total


def cartpoles(**kwargs):
    return ClusterEnv([CARTPOLE] * 4, num_workers=2, **kwargs)


def assert_same_batches(got, expected):
    for a, b in zip(got, expected, strict=True):
        for field in ("obs", "actions", "logprobs", "logits", "rewards", "policy_versions"):
            assert_same(getattr(a, field), getattr(b, field))


@pytest.fixture(scope="module")
def full_run():
    with cartpoles() as envs:
        return train(envs, "full")


def test_full_weights_send_every_tensor_on_every_pull(full_run):
    _, total = full_run
    assert total.pulls == 2 * 5, "each worker pulls before each rollout but the first"
    assert total.full_pulls == total.pulls and total.delta_pulls == 0
    assert total.weight_bytes == total.pulls * sum(p.numel() * 4 for p in actor().parameters())


def test_lossless_deltas_act_exactly_as_full_weights_do(full_run):
    with cartpoles() as envs:
        batches, total = train(envs, "lossless")
    assert_same_batches(batches, full_run[0])
    assert total.delta_pulls == total.pulls == full_run[1].pulls and total.full_pulls == 0, "every rebuild matched"
    assert 0 < total.weight_bytes < full_run[1].weight_bytes


def test_lossy_deltas_whose_guard_always_trips_act_exactly_as_full_weights_do(full_run):
    """Two-bit deltas move the policy past a tiny guard: every pull is then completed by an exact copy."""
    with cartpoles() as envs:
        batches, total = train(envs, LossyWeights(bits=2, guard_kl=1e-12))
    assert_same_batches(batches, full_run[0])
    pulls = full_run[1].pulls  # each one lossy first, then exact
    assert total.guard_trips == pulls and total.delta_pulls == total.pulls == 2 * pulls
    assert total.pull_reasons["repair"] == pulls, "each exact copy is counted as a repair"


def test_lossy_deltas_within_their_guard_act_with_the_rebuilt_policy(full_run):
    with cartpoles() as envs:
        batches, total = train(envs, LossyWeights(bits=2, guard_kl=10.0))
    assert total.guard_trips == 0 and total.delta_pulls == total.pulls == full_run[1].pulls
    assert not np.array_equal(batches[-1].logits, full_run[0][-1].logits), "the copies are not the learner's"
    assert total.weight_bytes < full_run[1].weight_bytes / 4


def test_a_restarted_worker_gets_a_full_copy_and_deltas_from_it_after(full_run):
    with cartpoles(on_worker_failure="restart") as envs:
        _, total = train(envs, "lossless", kill_at=3)
    # The replacement started at the latest version, so it had nothing to pull for the rollout it replayed.
    assert total.full_pulls == 0 and total.delta_pulls == total.pulls == full_run[1].pulls - 1
    assert total.initial_bytes > full_run[1].initial_bytes, "the replacement got the policy again, whole"


def corrupt_once(monkeypatch, what: str) -> None:
    """Make the learner's next delta wrong: a flipped bit in its first frame, or a base the worker does not hold."""
    from clusterenv.learner import weight_shipments

    real = weight_shipments.WeightShipments.shipment
    done = []

    def shipment(self, *args, **kwargs):
        meta, frames = real(self, *args, **kwargs)
        if meta["encoding"] != "full" and not done:
            done.append(True)
            if what == "frame":
                frame = frames[2].copy()
                frame[len(frame) // 2] ^= 1
                frames = [*frames[:2], frame, *frames[3:]]
            else:
                meta = {**meta, "base": b"not what it holds"}
        return meta, frames

    monkeypatch.setattr(weight_shipments.WeightShipments, "shipment", shipment)


@pytest.mark.parametrize("what", ["frame", "base"])
def test_a_worker_refuses_a_delta_that_does_not_rebuild_what_it_names_and_gets_a_full_copy(full_run, monkeypatch, what):
    corrupt_once(monkeypatch, what)
    with cartpoles() as envs:
        batches, total = train(envs, "lossless")
    assert_same_batches(batches, full_run[0])
    assert total.full_pulls == 1 and total.pulls == full_run[1].pulls + 1


def test_local_workers_get_full_copies_by_default(full_run):
    with cartpoles() as envs:
        batches, total = train(envs, None)
    assert_same_batches(batches, full_run[0])
    assert total.full_pulls == total.pulls == full_run[1].pulls


@pytest.mark.parametrize("weights", ["lossless", LossyWeights(bits=2, guard_kl=1e-12)], ids=["lossless", "lossy"])
def test_prefetching_workers_take_deltas_and_guard_them(weights):
    with cartpoles() as envs:
        batches, total = train(envs, weights, prefetch=1, updates=8)
    assert total.full_pulls == 0 and total.delta_pulls == total.pulls > 0
    if isinstance(weights, LossyWeights):
        assert total.guard_trips > 0
    assert all(batch.obs.shape == (8, 4, 4) for batch in batches)


def test_prefetching_workers_keep_pulling_deltas_after_the_runner_stops_and_starts_again():
    """Pulls and guard requests go out between a runner's stop() and its next rollout: none may be lost for good."""
    with cartpoles() as envs:
        policy = actor()
        lossy = LossyWeights(bits=2, guard_kl=1e-12)
        runner = PolicyRunner(envs, policy, FixedInterval(1), seed=3, weights=lossy, prefetch=1)
        pulls, rng = [], torch.Generator().manual_seed(7)
        for _ in range(4):
            for _ in range(3):
                runner.rollout(8)
                with torch.no_grad():
                    policy[0].weight.add_(torch.randn(policy[0].weight.shape, generator=rng) * 0.05)
                runner.publish()
            runner.stop()
            pulls.append(runner.telemetry.total.pulls)
        total = runner.telemetry.total
    assert pulls == sorted(set(pulls)), f"every round pulls: {pulls}"
    assert total.full_pulls == 0 and total.guard_trips > 0


def test_aps_pulls_deltas_too():
    with cartpoles() as envs:
        _, total = train(envs, "lossy", sync=APS(threshold=1e-3), noise=0.02)
        _, never = train(envs, "lossy", sync=Never())
    assert total.pulls > 0 and total.delta_pulls == total.pulls and total.full_pulls == 0
    assert never.pulls == 0 and never.weight_bytes == 0
