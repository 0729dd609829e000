"""Which path a ClusterEnv's steps took, the shared step region or messages (benchmark-only: it reads private state).

A :class:`PathCount` counts, over the steps a benchmark takes, the messages the learner sent
(its channel's counters), what the pool encoded each STEP command as (into the region, or a
message), and the final status word each worker's reply left in the step region: ``DONE``
(results in the region, no infos), ``INFOS`` (infos in the region's info rows too) or
``MESSAGE`` (a message carried the reply: infos of a layout the learner was not told yet, or
the usage report a worker sends once a second; also ``STEPPING``, when the learner took the
message before the worker wrote its final word). A step with no message either way stayed on
the shared path. Lockstep ``step`` writes every worker's command into the region at once
(``send_shared``), without encoding any; first-ready ``send`` encodes one STEP per worker.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from clusterenv import ClusterEnv
from clusterenv.learner.outbox import SHARED
from clusterenv.wire.protocol import Kind
from clusterenv.wire.step_region import DONE, INFOS, MESSAGE, STATUS, STEPPING

__all__ = ["PathCount"]

# A worker sends a message reply before it writes its final status, and the learner may take the message first:
# a status still STEPPING after the reply was taken is a message reply.
_STATUS = {DONE: "region", INFOS: "region_with_infos", MESSAGE: "message", STEPPING: "message"}


class PathCount:
    """Counts the paths of ``envs``' steps from now until :meth:`close`; :meth:`replied` after each batch."""

    def __init__(self, envs: ClusterEnv) -> None:
        self._envs = envs
        self._pool = pool = envs._pool
        self.replies: Counter[str] = Counter()
        self.step_commands: Counter[str] = Counter()
        self._sent = sum(pool._channel.sent.values())
        encode = pool.outbox.encode

        def counted(worker_id: int, kind: Kind, *rest: Any) -> Any:
            frames = encode(worker_id, kind, *rest)
            if kind is Kind.STEP:
                self.step_commands["region" if frames is SHARED else "message"] += 1
            return frames

        pool.outbox.encode = counted  # an instance attribute: send_each finds it first
        #: Why replies were messages: ``usage`` (the once-a-second report), ``info_layout`` (infos of a new layout).
        self.message_reasons: Counter[str] = Counter()
        path = pool.step_path
        if path is not None:
            completed = path.completed

            def noted(worker_id: int, msg: Any) -> Any:
                reasons = [key for key in ("usage", "info_layout") if key in msg.meta]
                self.message_reasons["+".join(reasons) or "other"] += 1
                return completed(worker_id, msg)

            path.completed = noted

    def replied(self, env_ids: np.ndarray | None = None) -> None:
        """The workers of ``env_ids`` (``None``: all) just replied to a step: note each one's final status word."""
        path = self._pool.step_path
        if path is None:
            self.replies["off_path"] += 1 if env_ids is None else len(env_ids)
            return
        per_worker = self._envs.num_envs // len(path.region.workers)
        workers = range(len(path.region.workers)) if env_ids is None else np.unique(env_ids // per_worker).tolist()
        for w in workers:
            if w in path.on_path:
                self.replies[_STATUS.get(int(path.region.workers[w].reply[STATUS]), "other")] += 1
            else:
                self.replies["off_path"] += 1

    def close(self) -> dict[str, Any]:
        """Stop counting; the counts: worker replies by status, STEP commands by path, messages the learner sent."""
        del self._pool.outbox.encode
        if self._pool.step_path is not None:
            del self._pool.step_path.completed
        return {
            "worker_replies": dict(self.replies),
            "message_replies_carried": dict(self.message_reasons),
            "step_commands_encoded": dict(self.step_commands),
            "messages_sent": sum(self._pool._channel.sent.values()) - self._sent,
            "step_path": sorted({w["step_path"] for w in self._envs.worker_info}),
        }
