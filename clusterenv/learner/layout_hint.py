"""One line, logged once per env, when a layout the user asked for measurably loses against the default rule's.

``num_workers=cores`` on cheap envs is the usual case: every process waits for a core, so
nobody spins, and every step pays a wake-up (tens of µs on a VM) for a few µs of env work.
After a few hundred lockstep steps, once the workers have reported how long their envs' steps
take, :class:`LayoutHint` compares the measured step with what the rule's layout would take:
the envs' CPU spread over every usable core, plus the learner's own work besides its envs and
its waits (its bookkeeping, which the rule's layout pays too). Where the measured step is more
than :data:`MARGIN` times that, it logs the figures and the arguments that would do better, as
PyTorch's DataLoader warns about its worker count. Never for the defaults: they are the rule's.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clusterenv.learner.layout import Layout, workers_and_learner

__all__ = ["MARGIN", "LayoutHint", "StepCosts", "hint_for", "measured_costs"]

logger = logging.getLogger(__name__)

#: How many times slower than the rule's predicted step a measured step must be for a hint.
MARGIN = 1.25
#: The lockstep steps before the first look; then each look doubles it, until the workers reported.
FIRST_LOOK = 300
#: The last look: past it, a layout that never reported its env step times gets no hint.
LAST_LOOK = 300 * 2**8
#: The env steps each worker must have timed before its median counts (one batch step in 8 is timed).
MIN_SAMPLES = 64


@dataclass(frozen=True)
class StepCosts:
    """What a layout measured per lockstep step, in µs."""

    #: A batch step's wall time (the learner busy plus waiting for workers), median.
    step_us: float
    #: The learner's time not waiting, median: its own envs' steps and its share of the step's work.
    learner_busy_us: float
    #: One env's step, median over the workers' reports.
    env_step_us: float
    #: Whether the learner's waits mostly ended while it spun (its busy time then holds its waits).
    spins: bool


def hint_for(layout: Layout, costs: StepCosts, num_envs: int, cores: int) -> str | None:
    """The line to log where ``layout`` (the user's) loses against the rule's by more than :data:`MARGIN`."""
    rule = workers_and_learner(num_envs, cores)
    if (rule.num_workers, rule.learner_envs) == (layout.num_workers, layout.learner_envs):
        return None
    own_envs_us = layout.learner_envs * costs.env_step_us
    if costs.spins:  # it spun while the workers stepped theirs
        workers_envs_us = (num_envs - layout.learner_envs) / layout.num_workers * costs.env_step_us
        own_envs_us = max(own_envs_us, workers_envs_us)
    learner_overhead = max(0.0, costs.learner_busy_us - own_envs_us)
    predicted = num_envs * costs.env_step_us / cores + learner_overhead
    if costs.step_us <= MARGIN * predicted:
        return None
    arguments = f"num_workers={rule.num_workers}" + (f", learner_envs={rule.learner_envs}" if rule.learner_envs else "")
    return (
        f"ClusterEnv({layout.reason.removeprefix('as given: ')}): a step of {num_envs} envs takes "
        f"{costs.step_us:.0f} µs (one env's step: {costs.env_step_us:.1f} µs in the workers); the default layout "
        f"on {cores} cores ({arguments}) would take about {predicted:.0f} µs. Leave "
        "`num_workers` and `learner_envs` out to use it (docs/guides/dropin.md)."
    )


class LayoutHint:
    """Looks at a user's layout a few times during its first lockstep steps, and logs :func:`hint_for` once.

    Args:
        layout: the user's layout.
        num_envs: the envs.
        cores: the usable cores.
    """

    def __init__(self, layout: Layout, num_envs: int, cores: int) -> None:
        self._layout, self._num_envs, self._cores = layout, num_envs, cores
        self._steps = 0
        self._next_look = FIRST_LOOK
        #: Whether it is done: logged, or found nothing to say.
        self.done = False

    def step(self, measure: Callable[[], StepCosts | None]) -> None:
        """A lockstep step was taken; ``measure`` gives the costs so far (``None`` until the workers reported)."""
        self._steps += 1
        if self._steps < self._next_look:
            return
        costs = measure()
        if costs is None:
            self._next_look *= 2
            self.done = self._next_look > LAST_LOOK
            return
        self.done = True
        line = hint_for(self._layout, costs, self._num_envs, self._cores)
        if line is not None:
            logger.warning(line)


def measured_costs(learner_info: dict[str, Any], worker_info: list[dict[str, Any]]) -> StepCosts | None:
    """:class:`StepCosts` from ``ClusterEnv.learner_info`` and ``worker_info``; ``None`` until every worker reported.

    A worker's report counts once it timed :data:`MIN_SAMPLES` env steps.
    """
    busy, waiting = learner_info.get("busy_ms"), learner_info.get("waiting_ms")
    env_steps = [info.get("env_step_ms") for info in worker_info]
    if busy is None or waiting is None or not env_steps:
        return None
    if any(step is None or step["samples"] < MIN_SAMPLES for step in env_steps):
        return None
    return StepCosts(
        step_us=(busy["p50"] + waiting["p50"]) * 1e3,
        learner_busy_us=busy["p50"] * 1e3,
        env_step_us=statistics.median(step["p50"] for step in env_steps) * 1e3,  # type: ignore[index]
        spins=2 * learner_info.get("caught_spinning", 0) > learner_info.get("waits", 0) > 0,
    )
