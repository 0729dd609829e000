"""What each worker's policy copy holds, and the shipment that brings it to the learner's latest version.

The :class:`~clusterenv.learner.rollouts.PolicyRunner` asks :class:`WeightShipments` for every
weight shipment after the first: a full copy, a lossless delta or a lossy one
(:mod:`clusterenv.policy.deltas`). The record of a worker is what it holds once it has taken
everything sent to it (a worker's channel is in order): the version, the arrays (the
learner's snapshot of that version, or the worker's own lossy rebuild), and their digest.

A full copy goes wherever the base is unknown: a new, restarted or re-homed worker (its
SET_POLICY is full), a worker whose pull names weights that were never sent to it (it
refused a delta, or lost one), and every worker under ``weights="full"``. A pull that names
weights sent to it before the record's (a prefetching worker asks while a push is on its
way) gets a delta from the record: the worker takes the push first. A lossy delta goes only
to a worker that can check it (the learner sends it outputs on its probe states), and an
exact one whenever the worker's guard asked for it.
"""

from __future__ import annotations

import logging
import socket
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from clusterenv.policy.deltas import LossyWeights, WeightsSpec, digest, encode_delta
from clusterenv.policy.strategies import PullReason, Telemetry
from clusterenv.wire.messages import WeightsMeta, WeightsRequestMeta

__all__ = ["WeightShipments"]

logger = logging.getLogger(__name__)

# States a worker may still name in a pull while newer shipments are on their way to it.
_PASSED_KEPT = 16


@dataclass(frozen=True)
class _Held:
    """The weights a worker holds once it has taken everything sent to it."""

    version: int
    arrays: list[np.ndarray] | None  # None where only full copies go: nothing to take a delta from
    digest: bytes | None  # None where only full copies go: the worker never checks one
    exact: bool  # the learner's own snapshot of ``version``, not a lossy rebuild


class WeightShipments:
    """Per worker, its held weights; builds each shipment and counts it in the telemetry.

    Args:
        spec: the runner's ``weights`` (checked by :func:`~clusterenv.policy.deltas.check_weights_spec`).
        telemetry: where shipments are counted.
        host_of: the host a worker runs on (``None`` if unknown), for ``spec=None``.
    """

    def __init__(self, spec: WeightsSpec, telemetry: Telemetry, host_of: Callable[[int], str | None]) -> None:
        self.spec = spec
        self._telemetry = telemetry
        self._host_of = host_of
        self._host = socket.gethostname()
        self._held: dict[int, _Held] = {}
        self._passed: dict[int, deque[bytes]] = {}  # per worker, the digests of the states before its record
        self._latest: tuple[int, bytes] | None = None  # the digest of the latest version's snapshot
        # The latest version, and its lossless delta frames by the exact base version they apply to.
        self._lossless: tuple[int, dict[int, list[np.ndarray]]] = (-1, {})

    def encoding_for(self, worker_id: int) -> WeightsSpec:
        """The encoding worker ``worker_id`` gets: ``spec``, or by default lossless to another host, else full."""
        if self.spec is not None:
            return self.spec
        host = self._host_of(worker_id)
        return "lossless" if host is not None and host != self._host else "full"

    def installed(self, worker_id: int, version: int, weights: list[np.ndarray]) -> bytes | None:
        """A SET_POLICY with ``weights`` went to the worker: it holds them, whatever it held before.

        Returns:
            Their digest, the base of the worker's first delta; ``None`` for a worker that gets full copies.
        """
        self._held[worker_id] = self._full(worker_id, version, weights)
        self._passed[worker_id] = deque(maxlen=_PASSED_KEPT)
        return self._held[worker_id].digest

    def _full(self, worker_id: int, version: int, weights: list[np.ndarray]) -> _Held:
        """What a worker holds after a full copy: the snapshot and its digest, unless it only ever gets full copies."""
        if self.encoding_for(worker_id) == "full":
            return _Held(version, None, None, exact=True)
        return _Held(version, weights, self._digest(version, weights), exact=True)

    def shipment(
        self,
        worker_id: int,
        version: int,
        weights: list[np.ndarray],
        *,
        request: WeightsRequestMeta | None = None,
        guarded: bool = False,
    ) -> tuple[WeightsMeta, list[np.ndarray]]:
        """The meta and frames that bring worker ``worker_id`` from what it holds to ``weights`` (version ``version``).

        Args:
            worker_id: the worker.
            version: the latest version.
            weights: its snapshot.
            request: the worker's pull, naming the weights it holds (``held=None``: it needs a full copy)
                and whether its guard asks for an exact copy; ``None`` for a push, from the record.
            guarded: the worker can check a lossy delta (it has the learner's outputs at ``version``).
        """
        record, encoding = self._held.get(worker_id), self.encoding_for(worker_id)
        if request is not None:  # a pull names what the worker holds
            held, exact = request["held"], request["exact"]
        else:  # a push goes from the record
            held, exact = (None if record is None else record.digest), False
        telemetry = self._telemetry.workers[worker_id]
        if exact:
            telemetry.guard_trips += 1
        passed = self._passed.setdefault(worker_id, deque(maxlen=_PASSED_KEPT))
        known = record is not None and record.arrays is not None and (held == record.digest or held in passed)
        if record is not None and record.arrays is not None and held is not None and not known:
            logger.warning("Worker %d holds other weights than were sent to it; it gets a full copy.", worker_id)
        if encoding == "full" or record is None or record.arrays is None or not known:
            state = self._full(worker_id, version, weights)
            meta = WeightsMeta(version=version, encoding="full", digest=state.digest, base=None)
            frames = weights
            telemetry.full_pulls += 1
        else:
            bits = encoding.bits if isinstance(encoding, LossyWeights) and guarded and not exact else None
            frames, scales, rebuilt = self._delta(record, version, weights, bits)
            lossy = any(scale is not None for scale in scales)  # integer tensors alone stay exact
            bits = bits if lossy else None
            state = _Held(version, rebuilt, digest(rebuilt) if lossy else self._digest(version, weights), not lossy)
            meta = WeightsMeta(
                version=version,
                encoding="lossy" if lossy else "lossless",
                digest=state.digest,
                base=record.digest,
                scales=scales,
                bits=bits,
            )
            if isinstance(encoding, LossyWeights) and lossy:
                meta["guard_kl"] = encoding.guard_kl
            telemetry.delta_pulls += 1
        if record is not None and record.digest is not None:
            passed.append(record.digest)
        self._held[worker_id] = state
        telemetry.pulls += 1
        telemetry.pull_reasons[PullReason.PUSH.value if request is None else request.get("reason", "unknown")] += 1
        telemetry.weight_bytes += sum(frame.nbytes for frame in frames)
        return meta, frames

    def _delta(
        self, record: _Held, version: int, weights: list[np.ndarray], bits: int | None
    ) -> tuple[list[np.ndarray], list[float | None], list[np.ndarray]]:
        """A delta from ``record``; lossless deltas from an exact base are encoded once per version and base."""
        assert record.arrays is not None
        if bits is not None or not record.exact:
            return encode_delta(record.arrays, weights, bits)
        cached_version, by_base = self._lossless
        if cached_version != version:  # a new version: the older ones' deltas are never sent again
            by_base = {}
            self._lossless = (version, by_base)
        frames = by_base.get(record.version)
        if frames is None:
            frames = by_base[record.version] = encode_delta(record.arrays, weights, None)[0]
        return frames, [None] * len(frames), weights

    def _digest(self, version: int, weights: list[np.ndarray]) -> bytes:
        """The digest of the learner's snapshot of ``version``, computed once per version."""
        if self._latest is None or self._latest[0] != version:
            self._latest = (version, digest(weights))
        return self._latest[1]
