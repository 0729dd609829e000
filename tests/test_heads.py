"""Action heads: exact KLs, log-probs that agree with torch.distributions, actions shaped as the space."""

from __future__ import annotations

import itertools
import math
import re

import msgpack
import numpy as np
import pytest
import torch
from gymnasium import spaces
from torch.distributions import Bernoulli as TorchBernoulli
from torch.distributions import Categorical as TorchCategorical
from torch.distributions import Normal, TanhTransform, TransformedDistribution

from clusterenv import (
    Bernoulli,
    Categorical,
    EpsilonGreedy,
    Gaussian,
    Greedy,
    MultiCategorical,
    PolicyError,
    TanhGaussian,
    default_head,
)
from clusterenv.policy.heads import head_from_meta
from clusterenv.policy.strategies import mean_kl

BOX = spaces.Box(-2.0, 3.0, shape=(2,), dtype=np.float32)

# (id, head, action space): every head on a space it acts in.
CASES = [
    ("Categorical-Discrete(4,start=2)", Categorical(temperature=0.7), spaces.Discrete(4, start=2)),
    ("Greedy-Discrete(3)", Greedy(), spaces.Discrete(3)),
    ("EpsilonGreedy-Discrete(3)", EpsilonGreedy(0.2), spaces.Discrete(3)),
    (
        "MultiCategorical-MultiDiscrete([3,2,4],start)",
        MultiCategorical(nvec=[3, 2, 4]),
        spaces.MultiDiscrete([3, 2, 4], start=[1, 0, -2]),
    ),
    (
        "MultiCategorical-MultiDiscrete(2x2)",
        MultiCategorical(nvec=[[2, 3], [4, 2]]),
        spaces.MultiDiscrete([[2, 3], [4, 2]]),
    ),
    ("Bernoulli-MultiBinary(3)", Bernoulli(), spaces.MultiBinary(3)),
    ("Bernoulli-MultiBinary(2x3)", Bernoulli(shape=(2, 3)), spaces.MultiBinary([2, 3])),
    ("Gaussian-Box(2)", Gaussian(), BOX),
    ("Gaussian-Box(2x2,float64)", Gaussian(shape=(2, 2)), spaces.Box(-1.0, 1.0, shape=(2, 2), dtype=np.float64)),
    ("TanhGaussian-Box(2)", TanhGaussian(), BOX),
]
IDS = [case[0] for case in CASES]
# The dtype each head samples in, before to_env casts to the space's dtype.
SAMPLE_DTYPES = {Categorical: np.int64, Greedy: np.int64, EpsilonGreedy: np.int64, MultiCategorical: np.int64}
SAMPLE_DTYPES |= {Bernoulli: np.int8, Gaussian: np.float32, TanhGaussian: np.float32}


def random_outputs(head, space, rows, seed, scale=1.0):
    """Outputs of the head's width; log standard deviations kept in [-1, 0.5] so samples stay moderate."""
    rng = np.random.default_rng(seed)
    out = rng.normal(scale=scale, size=(rows, head.output_width(space)))
    if isinstance(head, Gaussian):
        half = out.shape[1] // 2
        out[:, half:] = rng.uniform(-1.0, 0.5, size=(rows, half))
    return out


def generators(seed, rows):
    return [np.random.default_rng([seed, i]) for i in range(rows)]


# -- references from torch.distributions -----------------------------------------------------
def torch_distribution(head, outputs):
    """The same distribution as ``head`` on ``outputs``, built by torch, with a flat event per row."""
    x = torch.as_tensor(outputs, dtype=torch.float64)
    if isinstance(head, Categorical):
        return TorchCategorical(logits=x / head.temperature)
    if isinstance(head, Greedy):
        return TorchCategorical(logits=x)
    if isinstance(head, EpsilonGreedy):
        n = x.shape[1]
        probs = torch.full_like(x, head.epsilon / n)
        probs.scatter_(1, x.argmax(1, keepdim=True), 1 - head.epsilon + head.epsilon / n)
        return TorchCategorical(probs=probs)
    if isinstance(head, Bernoulli):
        return TorchBernoulli(logits=x)
    half = x.shape[1] // 2
    normal = Normal(x[:, :half], x[:, half:].exp())
    return TransformedDistribution(normal, TanhTransform()) if isinstance(head, TanhGaussian) else normal


def torch_log_prob(head, outputs, actions):
    """Joint log-probability per row, summing independent components as torch leaves them."""
    rows = len(outputs)
    if isinstance(head, MultiCategorical):
        flat = torch.as_tensor(actions.reshape(rows, -1))
        sizes = np.ravel(head.nvec).tolist()
        parts = torch.split(torch.as_tensor(outputs, dtype=torch.float64), sizes, dim=1)
        return sum(TorchCategorical(logits=p).log_prob(flat[:, j]) for j, p in enumerate(parts)).numpy()
    value = torch.as_tensor(np.asarray(actions, dtype=np.float64).reshape(rows, -1))
    if isinstance(head, (Categorical, Greedy, EpsilonGreedy)):
        return torch_distribution(head, outputs).log_prob(value[:, 0].long()).numpy()
    return torch_distribution(head, outputs).log_prob(value).sum(-1).numpy()


def enumerated_kl(head, space, p_outputs, q_outputs):
    """Σ over every joint action of p(a) (log p(a) − log q(a)), with torch's log-probabilities: exact."""
    if isinstance(space, spaces.Discrete):
        values = [np.array([a]) for a in range(space.n)]
    elif isinstance(space, spaces.MultiBinary):
        values = [
            np.array(bits).reshape(space.shape) for bits in itertools.product([0, 1], repeat=math.prod(space.shape))
        ]
    else:
        values = [np.array(a).reshape(space.shape) for a in itertools.product(*(range(n) for n in space.nvec.ravel()))]
    total = np.zeros(len(p_outputs))
    for value in values:
        actions = np.repeat(value[None], len(p_outputs), axis=0)
        log_p = torch_log_prob(head, p_outputs, actions)
        log_q = torch_log_prob(head, q_outputs, actions)
        total += np.where(log_p > -np.inf, np.exp(log_p) * (log_p - log_q), 0.0)
    return total


def monte_carlo_kl(head, p_outputs, q_outputs, samples):
    """E_p[log p(a) − log q(a)] from torch samples and torch log-probs, with its standard error, per row."""
    torch.manual_seed(0)
    p, q = torch_distribution(head, p_outputs), torch_distribution(head, q_outputs)
    a = p.sample((samples,))
    ratio = (p.log_prob(a) - q.log_prob(a)).sum(-1).numpy()
    return ratio.mean(axis=0), ratio.std(axis=0) / math.sqrt(samples)


# -- the KL ------------------------------------------------------------------------------------
DISCRETE = [case for case in CASES if not isinstance(case[1], Gaussian)]


@pytest.mark.parametrize("name, head, space", DISCRETE, ids=[c[0] for c in DISCRETE])
def test_kl_equals_the_sum_over_every_action(name, head, space):
    p, q = random_outputs(head, space, 5, seed=1, scale=2.0), random_outputs(head, space, 5, seed=2, scale=2.0)
    np.testing.assert_allclose(head.kl(p, q), enumerated_kl(head, space, p, q), rtol=1e-9, atol=1e-12)
    assert head.kl(p, q).min() >= 0 and head.kl(p, q).max() > 0.5, "a KL of zero everywhere would pass vacuously"


CONTINUOUS = [case for case in CASES if isinstance(case[1], Gaussian) and case[2] is BOX]


@pytest.mark.parametrize("name, head, space", CONTINUOUS, ids=[c[0] for c in CONTINUOUS])
def test_continuous_kl_equals_a_monte_carlo_estimate_in_the_learner_to_local_direction(name, head, space):
    #           means        log stds
    p = np.array([[0.3, -0.5, 0.4, 0.3], [1.0, 0.0, 0.4, -0.6]])
    q = np.array([[-0.4, 0.2, -0.3, -0.2], [0.2, 0.5, -0.1, 0.2]])
    exact = head.kl(p, q)
    estimate, stderr = monte_carlo_kl(head, p, q, samples=400_000)
    tolerance = 5 * stderr
    assert (tolerance < 0.03 * exact).all(), "the estimate must be precise enough to tell a wrong formula apart"
    np.testing.assert_array_less(np.abs(exact - estimate), tolerance)
    reverse = head.kl(q, p)
    assert (np.abs(reverse - exact) > 10 * tolerance).all(), "the test must tell KL(p||q) from KL(q||p)"


def test_tanh_gaussian_kl_is_the_kl_of_the_pre_squash_normals():
    p, q = np.array([[0.3, 2.0, -0.2, 0.1]]), np.array([[-0.4, 1.5, 0.3, -0.3]])
    assert TanhGaussian().kl(p, q) == pytest.approx(Gaussian().kl(p, q), rel=1e-15)


@pytest.mark.parametrize("name, head, space", CASES, ids=IDS)
def test_kl_is_zero_between_equal_outputs_and_positive_otherwise(name, head, space):
    p = random_outputs(head, space, 64, seed=3, scale=3.0)
    q = random_outputs(head, space, 64, seed=4, scale=3.0)
    np.testing.assert_allclose(head.kl(p, p), 0.0, atol=1e-12)
    kl = head.kl(p, q)
    assert kl.shape == (64,) and kl.dtype == np.float64
    assert (kl >= 0).all()
    assert mean_kl(head, p, q) == pytest.approx(kl.mean(), rel=1e-12)


# -- log-probabilities and actions -------------------------------------------------------------
@pytest.mark.parametrize("name, head, space", CASES, ids=IDS)
def test_log_probs_of_sampled_actions_match_torch_distributions(name, head, space):
    outputs = random_outputs(head, space, 32, seed=5)
    actions, log_probs = head.act(outputs, generators(0, 32))
    expected = torch_log_prob(head, outputs, actions)
    np.testing.assert_allclose(log_probs, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(head.log_prob(outputs, actions), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name, head, space", CASES, ids=IDS)
def test_actions_have_the_space_shape_and_reach_the_env_inside_it(name, head, space):
    outputs = random_outputs(head, space, 16, seed=6, scale=4.0)
    actions, log_probs = head.act(outputs, generators(1, 16))
    assert (actions.shape, actions.dtype) == ((16, *space.shape), np.dtype(SAMPLE_DTYPES[type(head)]))
    assert (log_probs.shape, log_probs.dtype) == ((16,), np.float32)
    env_actions = head.to_env(actions, space)
    assert (env_actions.shape, env_actions.dtype) == ((16, *space.shape), space.dtype)
    assert all(space.contains(a) for a in env_actions)


def test_gaussian_samples_are_clipped_only_on_their_way_to_the_env():
    outputs = np.array([[10.0, -10.0, -5.0, -5.0]])  # means far outside [-2, 3], tiny std
    actions, _ = Gaussian().act(outputs, generators(0, 1))
    np.testing.assert_allclose(actions, [[10.0, -10.0]], atol=0.1)
    np.testing.assert_array_equal(Gaussian().to_env(actions, BOX), [[3.0, -2.0]])


def test_tanh_gaussian_rescales_minus_one_to_one_onto_the_bounds():
    space = spaces.Box(np.array([-2.0, 0.0], np.float32), np.array([3.0, 1.0], np.float32))
    squashed = np.array([[-1.0, -1.0], [0.0, 0.0], [1.0, 1.0]], dtype=np.float32)
    np.testing.assert_allclose(TanhGaussian().to_env(squashed, space), [[-2.0, 0.0], [0.5, 0.5], [3.0, 1.0]])


def test_tanh_gaussian_log_prob_stays_finite_where_tanh_saturates():
    outputs = np.array([[30.0, -30.0, 0.0, 0.0]])
    actions, log_probs = TanhGaussian().act(outputs, generators(0, 1))
    np.testing.assert_array_equal(actions, [[1.0, -1.0]])
    assert np.isfinite(log_probs).all() and np.isfinite(TanhGaussian().log_prob(outputs, actions)).all()


@pytest.mark.parametrize("name, head, space", CASES, ids=IDS)
def test_each_row_depends_only_on_its_outputs_and_its_own_generator(name, head, space):
    outputs = random_outputs(head, space, 5, seed=7, scale=2.0)
    batch_rngs = generators(3, 5)
    batch_actions, batch_log_probs = head.act(outputs, batch_rngs)
    alone_rng = generators(3, 5)[2]
    alone, alone_log_prob = head.act(outputs[2:3], [alone_rng])
    np.testing.assert_array_equal(alone[0], batch_actions[2])
    np.testing.assert_array_equal(alone_log_prob[0], batch_log_probs[2])
    assert alone_rng.bit_generator.state == batch_rngs[2].bit_generator.state, "the same draws, batch or not"
    # Row 2 again, now last in a batch with other rows and other generators before it.
    mixed = np.concatenate([random_outputs(head, space, 3, seed=8), outputs[2:3]])
    shuffled, _ = head.act(mixed, [*generators(9, 3), generators(3, 5)[2]])
    np.testing.assert_array_equal(shuffled[-1], batch_actions[2])


SAMPLING = [case for case in CASES if not isinstance(case[1], (Gaussian, Greedy))]


@pytest.mark.parametrize("name, head, space", SAMPLING, ids=[c[0] for c in SAMPLING])
def test_discrete_samples_follow_the_distribution(name, head, space):
    n = 4000
    outputs = np.repeat(random_outputs(head, space, 1, seed=10, scale=1.5), n, axis=0)
    actions, log_probs = head.act(outputs, generators(4, n))
    _, index, counts = np.unique(actions.reshape(n, -1), axis=0, return_index=True, return_counts=True)
    expected = np.exp(log_probs[index].astype(np.float64)) * n
    assert expected.sum() > 0.99 * n, "every likely outcome must have been sampled"
    # Pearson's chi-square, against its mean plus five standard deviations.
    chi2 = ((counts - expected) ** 2 / expected).sum()
    dof = max(len(counts) - 1, 1)
    assert chi2 < dof + 5 * math.sqrt(2 * dof), f"chi-square {chi2:.1f} with {dof} degrees of freedom"


def test_gaussian_samples_have_the_output_means_and_standard_deviations():
    n, outputs = 20_000, np.array([[0.5, -1.0, math.log(0.3), math.log(2.0)]])
    actions, _ = Gaussian().act(np.repeat(outputs, n, axis=0), generators(5, n))
    std = np.array([0.3, 2.0])
    np.testing.assert_array_less(np.abs(actions.mean(0) - [0.5, -1.0]), 5 * std / math.sqrt(n))
    np.testing.assert_allclose(actions.std(0), std, rtol=5 / math.sqrt(2 * n))
    squashed, _ = TanhGaussian().act(np.repeat(outputs, n, axis=0), generators(5, n))
    np.testing.assert_allclose(squashed, np.tanh(actions), rtol=1e-6, atol=1e-6)


# -- choosing a head, its width, and bad input -------------------------------------------------
DEFAULTS = {
    "Discrete": (spaces.Discrete(5), Categorical(), 5),
    "Box(3)": (spaces.Box(-1.0, 1.0, shape=(3,)), Gaussian(), 6),
    "Box(2x2)": (spaces.Box(-1.0, 1.0, shape=(2, 2)), Gaussian(shape=(2, 2)), 8),
    "MultiDiscrete([3,2])": (spaces.MultiDiscrete([3, 2]), MultiCategorical(nvec=(3, 2)), 5),
    "MultiBinary(4)": (spaces.MultiBinary(4), Bernoulli(), 4),
}


@pytest.mark.parametrize("space, head, width", DEFAULTS.values(), ids=DEFAULTS.keys())
def test_default_head_for_each_space_and_its_output_width(space, head, width):
    assert default_head(space) == head
    assert head.output_width(space) == width
    head.check_width(space, width)


def test_no_default_head_for_composite_spaces():
    with pytest.raises(PolicyError, match=re.escape("No action head for action space Tuple(Discrete(2)); expected")):
        default_head(spaces.Tuple([spaces.Discrete(2)]))


WRONG_WIDTH = {
    "Gaussian": (
        Gaussian(),
        spaces.Box(-1.0, 1.0, shape=(3,)),
        3,
        "The Gaussian head needs 6 outputs per observation for action space Box(-1.0, 1.0, (3,), float32) "
        "(the means, then the log standard deviations), but the policy outputs 3.",
    ),
    "Categorical": (
        Categorical(),
        spaces.Discrete(4),
        2,
        "The Categorical head needs 4 outputs per observation for action space Discrete(4) (one output per action), "
        "but the policy outputs 2.",
    ),
    "MultiCategorical": (
        MultiCategorical(nvec=[3, 2]),
        spaces.MultiDiscrete([3, 2]),
        4,
        "The MultiCategorical head needs 5 outputs per observation for action space MultiDiscrete([3 2]) "
        "(the logits of each sub-action, concatenated), but the policy outputs 4.",
    ),
    "Bernoulli": (
        Bernoulli(),
        spaces.MultiBinary(4),
        5,
        "The Bernoulli head needs 4 outputs per observation for action space MultiBinary(4) (one logit per bit), "
        "but the policy outputs 5.",
    ),
}


@pytest.mark.parametrize("head, space, width, message", WRONG_WIDTH.values(), ids=WRONG_WIDTH.keys())
def test_a_module_of_the_wrong_width_gets_both_widths_in_the_error(head, space, width, message):
    with pytest.raises(PolicyError, match=f"^{re.escape(message)}$"):
        head.check_width(space, width)


WRONG_SPACE = {
    "Categorical on a Box": (
        Categorical(),
        spaces.Box(-1.0, 1.0, shape=(3,)),
        "Categorical acts in Discrete action spaces, got Box(-1.0, 1.0, (3,), float32).",
    ),
    "other nvec": (
        MultiCategorical(nvec=[3, 2]),
        spaces.MultiDiscrete([3, 3]),
        "MultiCategorical(nvec=(3, 2)) does not match the action space's nvec [3, 3]; "
        "build the head with default_head(action_space).",
    ),
    "TanhGaussian unbounded": (
        TanhGaussian(),
        spaces.Box(-np.inf, np.inf, shape=(3,)),
        "TanhGaussian rescales [-1, 1] to [low, high], so the Box needs finite bounds, got "
        "Box(-inf, inf, (3,), float32); use Gaussian, which clips, for unbounded actions.",
    ),
    "flat Gaussian on a 2-D Box": (
        Gaussian(),
        spaces.Box(-1.0, 1.0, shape=(2, 2)),
        "Gaussian(shape=None) makes actions of shape (A,), but the action space Box(-1.0, 1.0, (2, 2), float32) "
        "has shape (2, 2); build the head with default_head(action_space).",
    ),
    "Gaussian on an integer Box": (
        Gaussian(),
        spaces.Box(-1, 1, shape=(2,), dtype=np.int64),
        "Gaussian samples real numbers; the Box must be floating-point, got Box(-1, 1, (2,), int64).",
    ),
}


@pytest.mark.parametrize("head, space, message", WRONG_SPACE.values(), ids=WRONG_SPACE.keys())
def test_a_head_refuses_a_space_it_cannot_act_in(head, space, message):
    with pytest.raises(PolicyError, match=f"^{re.escape(message)}$"):
        head.output_width(space)


def test_outputs_of_the_wrong_width_or_generators_of_the_wrong_count_are_refused():
    with pytest.raises(PolicyError, match=re.escape("Gaussian needs a multiple of 2 outputs per row")):
        Gaussian().act(np.zeros((2, 3)), generators(0, 2))
    with pytest.raises(PolicyError, match=re.escape("MultiCategorical(nvec=(3, 2)) needs sum(nvec) = 5 outputs")):
        MultiCategorical(nvec=[3, 2]).kl(np.zeros((1, 4)), np.zeros((1, 4)))
    with pytest.raises(PolicyError, match=re.escape("`act` needs one np.random.Generator per row: got 3 for 2 rows.")):
        Bernoulli().act(np.zeros((2, 4)), generators(0, 3))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Gaussian(shape=3), "`shape` must be None or a tuple of positive integers, got 3."),
        (lambda: MultiCategorical(nvec=[0, 2]), "`nvec` must be a non-empty nesting of positive integers, got [0, 2]."),
    ],
    ids=["shape not a tuple", "nvec with a zero"],
)
def test_bad_head_parameters_are_refused(make, message):
    with pytest.raises(PolicyError, match=f"^{re.escape(message)}$"):
        make()


@pytest.mark.parametrize("name, head, space", CASES, ids=IDS)
def test_a_head_survives_the_wire_as_its_meta_map(name, head, space):
    meta = msgpack.unpackb(msgpack.packb(head.to_meta()))
    assert head_from_meta(meta) == head
    assert head_from_meta(meta).output_width(space) == head.output_width(space)
