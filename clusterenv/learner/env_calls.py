"""``EnvCalls``: a ``ClusterEnv``'s calls split into their parts' shares, and the answers put back in env order.

The envs of a ``ClusterEnv`` are in parts: the learner's own (``learner_envs``), then each
worker's slice. A reset or step gives each part its slice of the seeds, options, mask or
actions; an attribute call (``call``, ``get_attr``, ``apply``, ``set_attr``) asks each part
holding any of the envs chosen, with the indices within that part, and the learner's own
envs answer first, so that an error of theirs is raised before any worker is asked.
``ClusterEnv`` keeps the call's state (:class:`~clusterenv.learner.call_state.CallState`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
from gymnasium import spaces

from clusterenv.learner.own_envs import LearnerEnvs
from clusterenv.learner.pool import Command, OnLoss, WorkerPool
from clusterenv.learner.validation import pickle_argument
from clusterenv.wire.contract import by_part, in_index_order, values_by_part
from clusterenv.wire.leaves import batch_of_items, unflatten
from clusterenv.wire.messages import CallMeta, ResetMeta
from clusterenv.wire.protocol import Kind, Message

__all__ = ["OWN", "EnvCalls"]

#: The key of the learner's own envs among the parts of a call (workers are 0, 1, ...).
OWN = -1
_NONE: Any = object()  # no part of a call for the learner's own envs
_V = TypeVar("_V")


class EnvCalls:
    """The calls of one ``ClusterEnv``: each part's share, and the answers in env order.

    Args:
        pool: the env's pool, which carries the workers' commands.
        slices: the envs of each worker (global indices).
        own: the envs the learner steps itself, if any.
    """

    def __init__(self, pool: WorkerPool, slices: list[slice], own: LearnerEnvs | None) -> None:
        self._pool = pool
        self._slices = slices
        self._own = own
        #: The envs of each part: the learner's own (if any), then each worker's.
        self.parts = slices if own is None else [own.slice, *slices]
        self._own_results: list[Any] | None = None  # the learner's own envs' part of a call in progress
        self._indices: list[int] | None = None  # the envs a pending call asked, in order

    def reset_commands(self, seeds: list[int | None], options: Any, mask: np.ndarray | None) -> dict[int, Command]:
        """Each worker's RESET: its seeds, options (one dict, or one per env) and ``mask``; none if it resets no env."""
        commands: dict[int, Command] = {}
        for w, sl in enumerate(self._slices):
            if mask is not None and not mask[sl].any():
                continue
            mine = options[sl] if isinstance(options, list) else options
            blobs = [] if mine is None else [pickle_argument(mine, "`options` of reset")]
            commands[w] = (ResetMeta(seeds=seeds[sl], mask=None if mask is None else mask[sl].tolist()), (), blobs)
        return commands

    def expect_own_reset(self, seeds: list[int | None], options: Any, mask: np.ndarray | None) -> None:
        """The learner's own envs' reset, as :meth:`reset_commands` has the workers', recorded before they leave."""
        own = self._own
        if own is None:
            return
        if mask is not None and not mask[own.slice].any():
            own.forget()  # no part in this call (nor what an interrupted one left expected)
            return
        mine = options[own.slice] if isinstance(options, list) else options
        own_mask = None if mask is None else mask[own.slice].tolist()
        own.expect(lambda: own.reset(seeds[own.slice], mine, own_mask))

    def step_commands(
        self, workers: list[int], leaves: list[np.ndarray] | None, items: list[Any] | None = None
    ) -> dict[int, Command]:
        """Each of ``workers``' STEP: its slice of the checked action ``leaves``, or else of ``items`` (pickled)."""
        if leaves is not None:
            return {w: (None, [leaf[self._slices[w]] for leaf in leaves], ()) for w in workers}
        assert items is not None  # actions without a fixed array form: each env's, pickled
        return {w: (None, (), [pickle_argument(items[self._slices[w]], "actions")]) for w in workers}

    def expect_own_step(self, leaves: list[np.ndarray] | None, items: list[Any] | None, space: spaces.Space) -> None:
        """The learner's own envs' step (``space``: one env's), recorded before the workers' commands leave.

        Their actions are sliced as :meth:`step_commands` slices the workers' (:meth:`LearnerEnvs.expect`).
        """
        own = self._own
        if own is None:
            return
        if leaves is not None:
            actions = unflatten(space, [leaf[own.slice] for leaf in leaves])
        else:
            assert items is not None
            actions = batch_of_items(own.envs.action_space, items[own.slice])
        own.expect(lambda: own.step(actions))

    def replies_in_order(self, replies: dict[int, Message]) -> list[tuple[slice, Message]]:
        """The workers' ``replies`` to a reset or step, and the learner's own envs' (if due), each with its envs."""
        parts = [(self._slices[w], replies[w]) for w in sorted(replies)]
        own = self._own
        if own is not None and own.due:
            parts.insert(0, (own.slice, own.take_reply()))
        return parts

    def send_call(self, indices: list[int] | None, name: str | None, args: tuple, kwargs: dict, what: str) -> list[int]:
        """Ask the envs ``indices`` (``None``: all) for ``name`` (``None``: ``args[0]`` applied); the workers asked.

        ``what`` names the arguments in the error raised if they cannot be pickled.
        """
        blob = pickle_argument((args, kwargs), what)
        by_worker = self._by_worker(by_part(indices, self.parts))
        own_indices = by_worker.pop(OWN, _NONE)
        # The learner's own envs answer first: an error of theirs is raised before any worker is asked.
        self._own_results = None if own_indices is _NONE else self._own_envs().call(own_indices, name, blob)
        commands: dict[int, Command] = {
            w: (CallMeta(name=name, indices=local), (), [blob]) for w, local in by_worker.items()
        }
        self._pool.send_each(Kind.CALL, commands, OnLoss.REPLAY)
        self._indices = indices
        return list(commands)

    def results(self, replies: dict[int, Message]) -> tuple[Any, ...]:
        """The per-env results of the call :meth:`send_call` sent, in the order it asked; ``replies``: the workers'."""
        offset = len(self.parts) - len(self._slices)  # the parts before the workers': the learner's own envs
        results = {w + offset: self._pool.loads(reply.blobs[0]) for w, reply in replies.items()}
        if self._own_results is not None:
            results[0], self._own_results = self._own_results, None
        return tuple(in_index_order(self._indices, self.parts, results))

    def send_set_attr(self, name: str, values: Sequence[Any], chosen: list[int] | None) -> list[int]:
        """Set ``name`` on the envs ``chosen`` (``None``: all), one value each; the workers asked.

        ``values`` are checked (:func:`~clusterenv.wire.contract.per_env_values`).
        """
        by_worker = self._by_worker(values_by_part(chosen, self.parts, values))
        what = f"values of set_attr({name!r})"
        own = by_worker.pop(OWN, _NONE)
        commands: dict[int, Command] = {
            w: (CallMeta(name=name, indices=local), (), [pickle_argument(mine, what)])
            for w, (local, mine) in by_worker.items()
        }
        if own is not _NONE:  # once every value pickled; first, as for a call; pickled as the workers' values are
            self._own_envs().set_attr(own[0], name, pickle_argument(own[1], what))
        self._pool.send_each(Kind.SET_ATTR, commands, OnLoss.REPLAY)
        return list(commands)

    def _by_worker(self, routed: dict[int, _V]) -> dict[int, _V]:
        """What :func:`by_part` routed to each part of :attr:`parts`, by worker id (``OWN``: the learner's envs)."""
        if self._own is None:
            return routed
        return {(OWN if part == 0 else part - 1): value for part, value in routed.items()}

    def _own_envs(self) -> LearnerEnvs:
        assert self._own is not None
        return self._own
