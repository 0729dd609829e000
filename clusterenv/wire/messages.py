"""The meta of each message kind, declared once: what a sender must put in a header, and all it may.

Every message's header carries a small map (``meta``) beside its array frames and blobs.
Each :class:`~clusterenv.wire.protocol.Kind` has one ``TypedDict`` here; senders build the
map through it (a type checker then checks the keys), receivers read it through
:func:`meta_of`, and the decoder refuses a header whose keys do not match its kind's
declaration (:func:`check_meta`), before any handler sees it.

``seq`` may be in any message: the learner numbers each call and workers echo the number,
so that a reply to an abandoned call is told apart. ``slot`` names the worker whose envs a
message is for (or from) when the process that receives (or sends) it runs more than one
worker's envs: the envs of lost workers re-homed onto it (``on_worker_failure="rehome"``).
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar, cast

from typing_extensions import NotRequired, TypedDict

from clusterenv.errors import ProtocolError
from clusterenv.wire.protocol import Kind, Message

__all__ = [
    "CallMeta",
    "Empty",
    "EnvsMeta",
    "ErrorMeta",
    "HelloMeta",
    "InitMeta",
    "PlaceMeta",
    "ProbeMeta",
    "ResetMeta",
    "RolloutAheadMeta",
    "RolloutMeta",
    "ResultMeta",
    "UsageReport",
    "usage_report",
    "RolloutResultMeta",
    "SetPolicyMeta",
    "ShareObsMeta",
    "StepRegionMeta",
    "ValueMeta",
    "WeightsMeta",
    "WeightsRequestMeta",
    "WelcomeMeta",
    "check_meta",
    "meta_of",
]


class Empty(TypedDict):
    """No meta but the call number (and the slot, for a worker's envs re-homed onto another process)."""

    seq: NotRequired[int | None]
    slot: NotRequired[int]


# -- learner → worker --------------------------------------------------------------------------
class EnvsMeta(TypedDict):
    """The envs' part of INIT, as the VectorEnv gives it (the pool adds the rest)."""

    env_offset: int  # global index of the worker's first env (for a first INIT of units: its first entry's)
    entry_offset: int  # index in env_fns of the worker's first factory
    autoreset_mode: str
    observation_mode: str  # "same", "different", or "custom" (the space is in the context blob)
    procs_per_worker: int
    max_env_errors: int | None  # on_env_error="reset": errors allowed per env (None: "raise")


class InitMeta(Empty, EnvsMeta):
    """INIT: build the envs from the factories in the blobs (the first blob is their context)."""

    worker_id: int
    heartbeat: dict[str, Any]  # a Heartbeat, as a map
    heartbeat_endpoint: str
    replacement: bool  # a replacement for a lost worker: its envs' episodes were cut short


class PlaceMeta(Empty):
    """PLACE: the global index of the worker's first env, sent once the units' sizes are known."""

    env_offset: int


class ResetMeta(Empty):
    """RESET: seeds per env (``None``: unseeded); a blob holds the options, per env or shared."""

    seeds: list[int | None] | None
    mask: list[bool] | None


class CallMeta(Empty):
    """CALL and SET_ATTR: the attribute (``None``: apply the function in the blob) on the envs ``indices``."""

    name: str | None
    indices: list[int] | None


class ShareObsMeta(Empty):
    """SHARE_OBS: the learner's shared observation batch, for a worker on its host to map."""

    path: str
    token: str  # hex: the file's first bytes, proving it is this learner's batch
    size: int
    leaves: list[list[Any]]  # [offset, dtype, shape] per observation leaf
    start: int  # the worker's slice of the batch
    stop: int


class StepRegionMeta(Empty):
    """SHARE_STEP: the layout of the shared step region (its file travels on the wake socket) and the worker's rows."""

    token: str  # hex: the region's first bytes, proving the file that came with it is this region
    size: int
    fields: list[list[Any]]  # [name, offset, dtype, batched shape] per field
    worker: int  # whose header the worker uses
    workers: int
    start: int  # the worker's rows
    stop: int
    # How long the worker spins for its next command before blocking, in µs: a fixed bound (0: never),
    # or None: adapted to the gaps between commands (clusterenv.wire.waiting.SpinBudget).
    spin_us: float | None


class SetPolicyMeta(Empty):
    """SET_POLICY: the architecture and strategy in the blobs, the weights as arrays named ``names``."""

    names: list[str]
    version: int
    seed: int | None
    digest: bytes | None  # of the weights (clusterenv.policy.deltas.digest), the base of a first delta; None: no deltas


class WeightsMeta(Empty):
    """SET_WEIGHTS (the answer to a pull; the worker then acts) and PUSH_WEIGHTS (a prefetching worker's pull).

    The arrays are the weights (``encoding="full"``) or a delta's frames (``"lossless"``, ``"lossy"``:
    see :mod:`clusterenv.policy.deltas`), which apply to the weights of digest ``base``.
    """

    version: int
    encoding: str  # "full", "lossless" or "lossy"
    digest: bytes | None  # of the weights the worker holds once it has taken these (None: no deltas will follow)
    base: bytes | None  # a delta's: the digest of the weights it applies to
    scales: NotRequired[list[float | None]]  # a delta's, per tensor: None where the tensor is exact (XOR)
    bits: NotRequired[int | None]  # a lossy delta's quantization
    guard_kl: NotRequired[float]  # a lossy delta's: the KL above which the worker asks for an exact copy


class RolloutMeta(Empty):
    """ROLLOUT: act ``num_steps`` steps with the local policy (learner outputs on the probe states in an array)."""

    num_steps: int
    learner_version: int
    head: dict[str, Any]
    probe_steps: int
    movement: NotRequired[float]  # the learner's movement on the worker's probe states, where the strategy needs it


class RolloutAheadMeta(RolloutMeta):
    """ROLLOUT_AHEAD: a rollout queued ahead by a prefetching runner, answered whenever it is done."""

    rollout_id: int
    keep_probes: int  # how many rollouts' probe states the worker keeps for later PROBEs


class ProbeMeta(Empty):
    """PROBE: the learner's outputs (an array) on the probe states of rollout ``rollout_id``."""

    rollout_id: int
    version: int
    movement: NotRequired[float]  # as in RolloutMeta


class WelcomeMeta(Empty):
    """WELCOME: the learner's answer to a HELLO, echoing its nonce; ``compression``: the connection's codec."""

    nonce: bytes
    echo: bytes
    compression: str | None


# -- worker → learner --------------------------------------------------------------------------
class HelloMeta(Empty):
    """HELLO: a worker asks to join (``worker_id``: the id it asks for, ``None``: any)."""

    worker_id: int | None
    pid: int
    host: str
    nonce: NotRequired[bytes]  # added by the channel, which checks it


class ValueMeta(Empty):
    """VALUE: a command's result (pickled in a blob, if any); ``attached`` answers SHARE_OBS."""

    attached: NotRequired[bool]


class ErrorMeta(Empty):
    """ERROR: env code raised (the pickled exception in a blob, when it pickles)."""

    env_index: int | None
    exc_type: str
    message: str
    traceback: str


class UsageReport(TypedDict):
    """What a worker process uses, sent with a reply at most once a second (``None``: not known there)."""

    env_step_ms: list[float] | None  # [p50, p95, samples] of its recent env steps
    cpu_s: float | None  # CPU seconds so far, with its env processes
    rss_mb: float | None  # resident memory now, with its env processes


def usage_report(value: Any) -> UsageReport | None:
    """``value`` if it is a well-formed :class:`UsageReport` (numbers where numbers go), else ``None``.

    Reports come from workers, some started elsewhere: a malformed one is ignored, never shown.
    """

    def number(x: Any) -> bool:
        return x is None or (type(x) in (int, float) and math.isfinite(x))

    if not isinstance(value, dict) or set(value) != {"env_step_ms", "cpu_s", "rss_mb"}:
        return None
    step_ms = value["env_step_ms"]
    if step_ms is not None and not (isinstance(step_ms, list) and len(step_ms) == 3 and all(map(number, step_ms))):
        return None
    if step_ms is not None and None in step_ms:
        return None
    return cast(UsageReport, value) if number(value["cpu_s"]) and number(value["rss_mb"]) else None


class ResultMeta(Empty):
    """RESULT: observations, rewards and flags are the arrays; infos in a blob."""

    usage: NotRequired[UsageReport]
    # On the shared step path: the command counter of the step whose results are in the region.
    step: NotRequired[int]
    # On the shared step path: the layout in which the worker's next steps may put infos like these
    # in the region ([key, python type, dtype char, shape] per key, [key, "dict", layout] per nested
    # dict; see wire/step_region.py).
    info_layout: NotRequired[Sequence[Any]]


class RolloutResultMeta(Empty):
    """ROLLOUT_RESULT: the transitions are the arrays; infos in a blob."""

    version: int  # the policy version that acted last
    kl: float | None  # the KL measured at the rollout's start
    restarted: bool  # the envs are a replacement's: their episodes started anew
    rollout_id: NotRequired[int]  # for ROLLOUT_AHEAD
    usage: NotRequired[UsageReport]  # as in ResultMeta


class WeightsRequestMeta(Empty):
    """WEIGHTS_REQUEST: a worker's pull."""

    kl: float | None
    version: int
    held: bytes | None  # the digest of the weights the worker holds (None: it cannot take a delta)
    exact: bool  # a lossy delta tripped the worker's guard: it wants exact weights
    reason: NotRequired[str]  # a PullReason value: why the worker pulls


_META: dict[Kind, type] = {
    Kind.INIT: InitMeta,
    Kind.RESET: ResetMeta,
    Kind.STEP: Empty,
    Kind.CALL: CallMeta,
    Kind.SET_ATTR: CallMeta,
    Kind.CLOSE: Empty,
    Kind.SET_POLICY: SetPolicyMeta,
    Kind.SET_WEIGHTS: WeightsMeta,
    Kind.PUSH_WEIGHTS: WeightsMeta,
    Kind.ROLLOUT: RolloutMeta,
    Kind.ROLLOUT_AHEAD: RolloutAheadMeta,
    Kind.SHARE_OBS: ShareObsMeta,
    Kind.SHARE_STEP: StepRegionMeta,
    Kind.WAKE_UP: Empty,
    Kind.PLACE: PlaceMeta,
    Kind.PROBE: ProbeMeta,
    Kind.WELCOME: WelcomeMeta,
    Kind.HELLO: HelloMeta,
    Kind.READY: Empty,
    Kind.RESULT: ResultMeta,
    Kind.VALUE: ValueMeta,
    Kind.ERROR: ErrorMeta,
    Kind.CLOSED: Empty,
    Kind.ROLLOUT_RESULT: RolloutResultMeta,
    Kind.HEARTBEAT: Empty,
    Kind.WEIGHTS_REQUEST: WeightsRequestMeta,
    Kind.JOIN: Empty,
}
# Per kind: the keys it requires, and all it allows.
_KEYS = {
    kind: (frozenset(d.__required_keys__), frozenset(d.__required_keys__ | d.__optional_keys__))  # type: ignore[attr-defined]
    for kind, d in _META.items()
}

MetaT = TypeVar("MetaT")


def check_meta(kind: Kind, meta: Mapping[str, Any]) -> None:
    """Raise ``ProtocolError`` unless ``meta`` has every key ``kind`` requires and no key it does not declare."""
    required, allowed = _KEYS[kind]
    keys = meta.keys()
    if required <= keys <= allowed:
        return
    missing, unknown = sorted(required - keys), sorted(keys - allowed)
    raise ProtocolError(
        f"A {kind.name} message must have meta keys {sorted(required)} (and may have {sorted(allowed - required)}); "
        f"missing {missing}, unknown {unknown}."
    )


def meta_of(msg: Message, declaration: type[MetaT]) -> MetaT:
    """``msg.meta`` as its kind's declaration, or a part of it (the decoder checked its keys)."""
    required, allowed = _KEYS[msg.kind]
    if not declaration.__required_keys__ <= required or not declaration.__optional_keys__ <= allowed:  # type: ignore[attr-defined]
        raise ProtocolError(f"A {msg.kind.name} message does not carry {declaration.__name__}.")
    return cast(MetaT, msg.meta)
