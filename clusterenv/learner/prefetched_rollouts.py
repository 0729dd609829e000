"""Prefetched rollouts: each worker keeps collecting, up to ``prefetch`` rollouts ahead of the learner.

See :mod:`clusterenv.learner.rollouts` for the flow of messages per worker. The runner holds
the envs (their one pending call) from its first rollout until :meth:`PrefetchingRunner.stop`.
A worker lost meanwhile is replaced, gets the policy again, and is asked again for the
rollouts it still owed (the restart hook re-issues them); its envs start new episodes there.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from clusterenv.errors import PolicyError, ProtocolError, WorkerTimeoutError
from clusterenv.learner.pool import FollowUp, OnLoss
from clusterenv.learner.rollout_batch import RolloutBatch
from clusterenv.learner.runner_base import PolicyRunner, check_prefetch
from clusterenv.policy.heads import Head
from clusterenv.wire.leaves import unflatten
from clusterenv.wire.messages import (
    ProbeMeta,
    RolloutAheadMeta,
    RolloutResultMeta,
    WeightsRequestMeta,
    meta_of,
)
from clusterenv.wire.protocol import Kind, Message

__all__ = ["PrefetchingRunner"]


class PrefetchingRunner(PolicyRunner, prefetching=True):
    """The :class:`~clusterenv.learner.rollouts.PolicyRunner` of ``prefetch >= 1``."""

    probes_from_batches = False  # kept from each result as it arrives

    def __init__(self, *args: Any, prefetch: int = 1, **kwargs: Any) -> None:
        """Ship the policy, as :class:`~clusterenv.learner.rollouts.PolicyRunner` does; nothing is collected yet."""
        if check_prefetch(prefetch) < 1:
            raise PolicyError(f"A PrefetchingRunner collects ahead: `prefetch` must be at least 1, got {prefetch}.")
        super().__init__(*args, prefetch=prefetch, **kwargs)
        self._stream = _Stream(self.envs.num_workers)

    @property
    def prefetch_backlog(self) -> list[tuple[int, int]]:
        """Per worker, ``(held, in_flight)``: results received but not returned yet, and rollouts being collected."""
        stream = self._stream
        return [(len(stream.results[w]), len(stream.sent[w])) for w in range(len(stream.sent))]

    def _reinstall(self, worker_id: int) -> list[FollowUp]:
        """A restart hook: the policy again, then the rollouts that were lost with the worker."""
        ahead = self._stream.in_flight(worker_id)
        again = [FollowUp(Kind.ROLLOUT_AHEAD, meta, on_loss=OnLoss.REISSUE) for meta in ahead]
        return [*super()._reinstall(worker_id), *again]

    def _published(self) -> None:
        """Answer the pulls waiting for the new version, and send each worker its outputs on its probe states."""
        if not self._stream.started:
            return
        # Outputs (and the learner's movement) first: the probes sent while pumping carry this version's movement.
        outputs = self._probe_outputs(self._stream.head) if self.send_probes else [None] * self.envs.num_workers
        answered = set(self._pump(0.0))  # their results got this version's probe outputs already
        for w in range(self.envs.num_workers):
            if self.sync.pulls_every_version:
                # The worker would ask for it at once; sending it now saves the request's
                # round trip, which would wait for the learner's next rollout() call.
                self._send_weights(w, Kind.PUSH_WEIGHTS)
                self._stream.pushed[w] = self._version
            if w not in answered:
                self._send_probe(w, outputs=outputs[w])

    def rollout(self, num_steps: int, *, head: Head | None = None) -> RolloutBatch:
        """The oldest complete batch, and one more rollout asked of each worker (see :meth:`PolicyRunner.rollout`)."""
        self._check_steps(num_steps)
        head = self.head if head is None else head
        stream = self._stream
        if stream.mode == "fragments":
            raise PolicyError("This runner is streaming fragments(); call stop() before rollout().")
        stream.mode = "batches"
        self._refill(range(self.envs.num_workers), num_steps, head)
        wanted = stream.consumed.copy()
        deadline = self._deadline()
        while any(wanted[w] not in stream.results[w] for w in range(self.envs.num_workers)):
            self._pump(self._remaining(deadline, "waiting for a prefetched rollout"))
        replies = {w: stream.results[w].pop(wanted[w]) for w in range(self.envs.num_workers)}
        for w in replies:
            stream.consumed[w] += 1
        return self._assemble(replies, num_steps)

    def fragments(self, num_steps: int, *, head: Head | None = None) -> Iterator[RolloutBatch]:
        """Each worker's rollouts as they arrive, ``prefetch`` kept ahead (see :meth:`PolicyRunner.fragments`)."""
        self._check_steps(num_steps)
        stream = self._stream
        if stream.mode == "batches":
            raise PolicyError("This runner is serving rollout(); call stop() before fragments().")
        stream.mode = "fragments"
        self._refill(range(self.envs.num_workers), num_steps, self.head if head is None else head)
        while True:
            deadline = self._deadline()
            ready = [w for w in range(self.envs.num_workers) if stream.consumed[w] in stream.results[w]]
            while not ready:
                arrived = self._pump(self._remaining(deadline, "waiting for a rollout fragment"))
                ready = [w for w in arrived if stream.consumed[w] in stream.results[w]]
            w = ready[0]
            msg = stream.results[w].pop(stream.consumed[w])
            stream.consumed[w] += 1
            self._refill([w], num_steps, self.head if head is None else head)
            yield self._assemble({w: msg}, num_steps)

    def stop(self) -> list[RolloutBatch]:
        """End prefetching: wait for the rollouts collected ahead and return them, oldest first.

        Nothing is lost: the returned batches (fragments, after :meth:`fragments`) hold every
        step the workers took ahead. Afterwards the envs accept ``step``/``reset`` again, and
        the next ``rollout`` starts prefetching anew.
        """
        stream = self._stream
        if not stream.started:
            return []
        deadline = self._deadline()
        while any(stream.in_flight(w) for w in range(self.envs.num_workers)):
            self._pump(self._remaining(deadline, "finishing the prefetched rollouts"))
        leftovers: list[RolloutBatch] = []
        steps = stream.num_steps
        if stream.mode == "batches":
            while all(stream.consumed[w] in stream.results[w] for w in range(self.envs.num_workers)):
                replies = {w: stream.results[w].pop(stream.consumed[w]) for w in range(self.envs.num_workers)}
                stream.consumed = [c + 1 for c in stream.consumed]
                leftovers.append(self._assemble(replies, steps))
        else:
            for w in range(self.envs.num_workers):
                while stream.consumed[w] in stream.results[w]:
                    leftovers.append(self._assemble({w: stream.results[w].pop(stream.consumed[w])}, steps))
                    stream.consumed[w] += 1
        stream.hold.close()
        # The workers' latest probe states stay the ones named: a publish before their next result probes them.
        self._stream = _Stream(self.envs.num_workers, next_id=max(stream.next_id), probe_id=stream.probe_id)
        return leftovers

    def _check_steps(self, num_steps: int) -> None:
        super()._check_steps(num_steps)
        stream = self._stream
        if stream.started and num_steps != stream.num_steps:
            raise PolicyError(
                f"A prefetching runner collects rollouts of a fixed length: it was started with num_steps="
                f"{stream.num_steps}, got {num_steps}. Call stop() first to change it."
            )

    def _refill(self, worker_ids: Any, num_steps: int, head: Head) -> None:
        """Keep ``prefetch`` rollouts queued ahead of the one being consumed, per worker."""
        stream = self._stream
        if not stream.started:
            if self.envs.needs_reset:
                self.envs.reset(seed=self.seed)
            stream.hold = contextlib.ExitStack()
            stream.hold.enter_context(self.envs.pending_call("a prefetching PolicyRunner; call runner.stop() first"))
            self.envs.note_cuts_reported(range(self.envs.num_workers))  # the first rollouts start new episodes there
            stream.num_steps, stream.started = num_steps, True
        stream.head = head
        pool = self.envs.pool
        for w in worker_ids:
            # rollout() refills before taking the oldest batch, fragments() after taking one: either
            # way at most `prefetch` results per worker wait while the learner works.
            while stream.next_id[w] - stream.consumed[w] < self.prefetch + (stream.mode == "batches"):
                meta = RolloutAheadMeta(
                    num_steps=num_steps,
                    learner_version=self._version,
                    head=head.to_meta(),
                    probe_steps=self.probe_steps,
                    rollout_id=stream.next_id[w],
                    keep_probes=self.prefetch + 2,
                )
                # A replacement gets the policy again, then these rollouts (the restart hook re-issues them).
                pool.send(w, Kind.ROLLOUT_AHEAD, meta, on_loss=OnLoss.REISSUE)
                stream.sent[w][stream.next_id[w]] = meta
                stream.next_id[w] += 1

    def _pump(self, timeout: float) -> list[int]:
        """Handle what the workers sent within ``timeout`` seconds: results, pulls. Returns who sent a result."""
        stream = self._stream
        pool, arrived = self.envs.pool, []
        while (received := pool.receive("running the local policies", timeout)) is not None:
            w, msg = received
            timeout = 0.0  # after the first message, take only what has already arrived
            if msg.kind is Kind.WEIGHTS_REQUEST:
                request = meta_of(msg, WeightsRequestMeta)
                if request["version"] < stream.pushed[w] and request["held"] is not None and not request["exact"]:
                    continue  # asked before a pushed version reached it: that push is the answer
                self._send_weights(w, Kind.PUSH_WEIGHTS, request)
            elif msg.kind is Kind.ROLLOUT_RESULT:
                rollout_id = meta_of(msg, RolloutResultMeta)["rollout_id"]
                if stream.sent[w].pop(rollout_id, None) is None:
                    continue  # already answered before its worker was replaced
                stream.results[w][rollout_id] = msg
                self._keep_probe_states(w, self._frames(w, msg)[0])
                self._send_probe(w, rollout_id)
                arrived.append(w)
            else:
                raise ProtocolError(f"Worker {w} sent {msg.kind.name} during a prefetched rollout.")
        return arrived

    def _send_probe(self, worker_id: int, rollout_id: int | None = None, outputs: np.ndarray | None = None) -> None:
        """Send the latest version's outputs on the worker's latest probe states (prefetch mode).

        ``outputs``: already computed (``publish`` computes every worker's in one forward pass).
        """
        stream = self._stream
        obs = self._probe_obs[worker_id]
        if obs is None or not self.send_probes:
            return
        rollout_id = stream.probe_id[worker_id] if rollout_id is None else rollout_id
        stream.probe_id[worker_id] = rollout_id
        if outputs is None:
            outputs = self._learner.outputs(unflatten(self.envs.single_observation_space, obs))
        meta = ProbeMeta(rollout_id=rollout_id, version=self._version)
        if (movement := self._movement_of(worker_id)) is not None:
            meta["movement"] = movement
        self.envs.pool.send(worker_id, Kind.PROBE, meta, [outputs])
        self._telemetry.workers[worker_id].probe_bytes += outputs.nbytes

    def _deadline(self) -> float | None:
        timeout = self._timeout()
        return None if timeout is None else time.monotonic() + timeout

    def _remaining(self, deadline: float | None, doing: str) -> float:
        if deadline is None:
            return 1.0
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            self.envs.close(terminate=True)
            raise WorkerTimeoutError(
                f"No rollout arrived within {self._timeout()} s while {doing}; the ClusterEnv was closed. "
                "Raise `timeout` if rollouts take this long."
            )
        return remaining


class _Stream:
    """The prefetch bookkeeping of a runner: per worker, rollout ids sent, consumed, and results held."""

    def __init__(self, num_workers: int, next_id: int = 0, probe_id: list[int] | None = None) -> None:
        self.started = False
        self.mode: str | None = None  # "batches" (rollout) or "fragments"
        self.num_steps = 0
        self.hold = contextlib.ExitStack()  # the env's pending call, held while prefetching
        self.next_id = [next_id] * num_workers
        self.consumed = [next_id] * num_workers
        self.sent: list[dict[int, dict[str, Any]]] = [{} for _ in range(num_workers)]
        self.results: list[dict[int, Message]] = [{} for _ in range(num_workers)]
        self.probe_id = [0] * num_workers if probe_id is None else list(probe_id)
        self.pushed = [-1] * num_workers  # the latest version pushed to each worker (EveryUpdate)
        self.head: Head | None = None  # the head the workers act with (their KL checks use it too)

    def in_flight(self, worker_id: int) -> list[dict[str, Any]]:
        """The ROLLOUT_AHEAD commands of a worker whose results have not arrived, oldest first."""
        return [self.sent[worker_id][r] for r in sorted(self.sent[worker_id])]
