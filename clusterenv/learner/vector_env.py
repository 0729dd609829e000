"""``ClusterEnv``: a Gymnasium ``VectorEnv`` whose sub-environments live in worker processes."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium
import numpy as np
from gymnasium import Env, spaces
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, ResetNeeded
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.async_vector_env import AsyncState

from clusterenv.cores import usable_cores
from clusterenv.launch.launchers import Launcher, LocalLauncher, resolve_launcher
from clusterenv.learner.building import build_envs, envs_served
from clusterenv.learner.call_state import CallState
from clusterenv.learner.cuts import Cut
from clusterenv.learner.env_calls import EnvCalls
from clusterenv.learner.first_ready import FirstReady, Ready
from clusterenv.learner.layout import Layout, choose_layout, workers_only_layout
from clusterenv.learner.layout_hint import LayoutHint, measured_costs
from clusterenv.learner.lockstep import Lockstep
from clusterenv.learner.own_envs import LearnerEnvs, UnitsInLearnerShare
from clusterenv.learner.pool import Command, FollowUp, OnLoss, WorkerPool, weak_callback
from clusterenv.learner.recycling import Recycle, Recycler
from clusterenv.learner.step_buffers import WORKER_RESTARTED_KEY, BatchBuffers, report_cuts
from clusterenv.learner.validation import (
    action_items,
    check_actions,
    check_attribute_name,
    check_autoreset_mode,
    check_batch_size,
    check_choice,
    check_count,
    check_env_fns,
    check_first_ready,
    check_flag,
    check_indices,
    check_learner_envs,
    check_min_workers,
    check_num_workers,
    check_observation_mode,
    check_procs_per_worker,
    check_reset_options,
    check_seconds,
    check_seeds,
    check_spin_us,
    pickle_env_fn,
)
from clusterenv.wire.codecs import check_codec
from clusterenv.wire.contract import (
    per_env_values,
    split_evenly,
)
from clusterenv.wire.leaves import is_array_tree, leaf_specs
from clusterenv.wire.liveness import Heartbeat
from clusterenv.wire.protocol import Kind, Message

__all__ = ["WORKER_RESTARTED_KEY", "ClusterEnv"]

logger = logging.getLogger(__name__)

_FIRST_READY = "first-ready batches (async_reset/send/recv)"


@dataclass(frozen=True)
class _StartWith:
    """What starting the workers and building the envs takes, checked once (kept for a move of the envs)."""

    pickled_fns: list[bytes]
    autoreset_mode: AutoresetMode | None
    spin_us: float | None
    start_timeout: float
    min_workers: int
    batch_size: int | None
    recycle: Recycle | None
    pool_kwargs: dict[str, Any]
    #: Whether the workers are this process's children (``LocalLauncher``), and the cores it may use.
    local: bool
    cores: int


class ClusterEnv(VectorEnv):
    """A vector env whose ``reset``/``step`` run in worker processes.

    Each worker steps a contiguous slice of the envs as a ``SyncVectorEnv`` (or several, in its own child
    processes), so results are bit-identical to ``gymnasium.vector.SyncVectorEnv`` with the same seeds and
    actions, in every autoreset mode. Env factories travel once, cloudpickled, to authenticated workers.

    Examples:
        >>> import gymnasium as gym
        >>> from clusterenv import ClusterEnv
        >>> envs = ClusterEnv([lambda: gym.make("CartPole-v1")] * 4)
        >>> obs, infos = envs.reset(seed=42)
        >>> obs.shape
        (4, 4)
        >>> envs.close()
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], Env | VectorEnv]],
        *,
        num_workers: int | None = None,
        procs_per_worker: int = 1,
        autoreset_mode: str | AutoresetMode | None = None,
        copy: bool = True,
        observation_mode: str | tuple[spaces.Space, spaces.Space] = "same",
        timeout: float | None = 60.0,
        start_timeout: float = 120.0,
        bind: str | None = None,
        secret: str | bytes | None = None,
        launcher: Launcher | str | None = None,
        on_worker_failure: str = "raise",
        on_env_error: str = "raise",
        max_env_errors: int = 10,
        min_workers: int = 1,
        heartbeat: Heartbeat | None = None,
        batch_size: int | None = None,
        trusted_classes: Sequence[type | str] = (),
        encrypt: bool = False,
        shared_memory: bool = True,
        compression: str | None = "lz4",
        recycle: Recycle | None = None,
        spin_us: float | None = None,
        learner_envs: int | None = None,
    ) -> None:
        """Start the workers and build the envs in them.

        Args:
            env_fns: zero-argument callables creating the environments, as for ``AsyncVectorEnv``. A
                callable may create a vector env instead (EnvPool, SuperSuit, a ``SyncVectorEnv``): a
                *unit*, which fills as many slots as it has envs, stepped whole by one worker
                (docs/guides/units.md). ``num_envs`` and the spaces are then what the units report.
            num_workers: worker processes, each one peer of the learner. With neither ``num_workers``
                nor ``learner_envs`` given, the default layout decides both (:mod:`clusterenv.learner.layout`):
                with local workers, one per usable core but one, the learner stepping one worker's
                share of the envs itself; one per usable core where the learner cannot step envs
                (remote workers, ``batch_size``, ``"rehome"``, units). ``repr(envs)`` and
                ``learner_info["layout"]`` say what it chose and why.
            procs_per_worker: env processes per worker. With ``N > 1`` each worker splits its
                slice over ``min(N, slice size)`` child processes that step in parallel, so one
                worker per host can use all its cores while the learner talks to one peer per
                host (its cost grows with hosts, not processes). Results are unchanged. A
                worker started with ``clusterenv-worker --procs N`` uses its own ``N``.
            autoreset_mode: Gymnasium's autoreset mode, applied inside the workers (``None``: ``NEXT_STEP``,
                or with units, the units' own ``metadata["autoreset_mode"]``).
            copy: return fresh observation arrays from ``reset``/``step`` (else a reused buffer).
            observation_mode: ``"same"``, ``"different"``, or ``(observation_space, single_observation_space)``,
                as for ``SyncVectorEnv``.
            timeout: seconds to wait for a reply before raising ``WorkerTimeoutError`` (None: forever).
                A timeout closes the env: the late workers are still busy with a call whose
                result nobody will read, so their envs are in an unknown state.
            start_timeout: seconds to wait for workers to join and build their envs.
            bind: learner address; ``None`` is a private ``ipc://`` socket. Non-loopback
                addresses require a ``secret``.
            secret: the shared secret that keys every connection (or ``$CLUSTERENV_SECRET``); random
                when workers are local.
            launcher: what starts the workers: ``"local"`` child processes (default), ``"external"``
                (started by hand or ``srun``, see docs/guides/multi-node.md), ``"ray"``, or a ``Launcher``.
            on_worker_failure: ``"raise"`` a ``WorkerLostError``; ``"restart"`` the worker (a new
                process); or ``"rehome"``: rebuild its envs in the surviving worker process that
                carries the fewest envs, with no new process. Either way the rebuilt envs report
                the interrupted episode as truncated, with ``infos["worker_restarted"]`` set (exact
                semantics in docs/guides/fault-tolerance.md).
            on_env_error: ``"raise"`` an env's exception, or ``"reset"``: end only its episode (truncated,
                ``infos["env_error"]``) and rebuild the env from its factory (docs/guides/flaky-envs.md).
            max_env_errors: under ``"reset"``, the errors one env may raise within 1,000 of its steps.
            min_workers: with ``"rehome"``, the fewest worker processes to go on with: a loss that
                leaves fewer raises ``WorkerLostError``, naming who was lost and why; and if fewer
                than ``num_workers`` but at least this many joined within ``start_timeout``, the
                run starts with them (the missing workers' envs spread over them) and the others
                can join later (:meth:`rebalance`).
            heartbeat: heartbeat constants; a worker whose heartbeat connection carried nothing for
                ``interval * liveness`` seconds (dead or frozen, not busy) is lost.
            batch_size: how many envs :meth:`recv` returns (default ``num_envs``): those of the
                ``batch_size // envs_per_worker`` workers that are ready first. Needs equal slices
                (``num_envs`` a multiple of ``num_workers``) and a multiple of the envs per worker.
            trusted_classes: classes (or ``"module.Name"`` strings) that infos, observations, call
                results and errors from workers the learner did not start itself (``launcher="external"``,
                Ray) may contain beyond plain data; anything else raises ``UntrustedPickleError``
                (see docs/guides/security.md). Workers it starts itself are not restricted.
            encrypt: encrypt all traffic with CurveZMQ, keys derived from the secret; a peer
                without the secret then cannot even connect. External workers need
                ``clusterenv-worker --encrypt``.
            shared_memory: workers on this host write large observations (64 KB or more per worker)
                into the learner's batch in shared memory; ``False``: frames always (a small ``/dev/shm``).
            compression: ``"lz4"`` (default), ``"zstd"`` or ``None``: lossless compression of array
                frames of 4 KB or more on tcp (observations, rollouts, weights, both ways); zstd for
                slow links (docs/guides/multi-node.md). ``ipc://`` never compresses.
            recycle: replace a worker's process after so many env steps or past a memory bound, between
                steps (:class:`~clusterenv.learner.recycling.Recycle`; local workers; docs/guides/flaky-envs.md).
                The default layout then keeps every env in a worker: the learner's own are never recycled.
            spin_us: on the shared step path, how long the learner waiting for a reply, and a worker
                waiting for its next command, read the other's words in a loop before they block,
                in µs. ``None`` (default): adapted to how long recent waits took (up to 1 ms, none
                once waits outlast that), where the learner and every local worker have a core each,
                counting the spinning workers of every ClusterEnv in this process (else this env's
                block); ``0``: never; a number: that bound, within the same rule (docs/guides/dropin.md).
            learner_envs: the first ``learner_envs`` envs are stepped by the learner itself, in its
                own process, while the workers step theirs. ``None`` (default): the default layout
                decides (with local lockstep workers, one worker's share; see ``num_workers``); ``0``:
                every env in a worker. The learner's envs behave as a worker's (the same
                ``RemoteEnvError``, ``on_env_error``, warnings shown and never raised, call results
                copied) but have no process of their own: an env that kills its process (a segfault,
                ``os._exit``) kills the learner, and recycling, usage reports, ``timeout`` and worker
                recovery do not apply to them. The default layout's share moves to the workers once
                when a ``PolicyRunner`` or first-ready batches start (:meth:`place_every_env_in_workers`);
                a share given here refuses them (docs/guides/dropin.md, "The default layout").
        """
        super().__init__()
        self._call = CallState()
        self.closed = True  # until the workers are up, close() has nothing to do
        check_env_fns(env_fns)
        self.num_envs = entries = len(env_fns)  # until the workers report how many envs each entry made (units)
        own_given = check_learner_envs(learner_envs, entries, batch_size)
        if num_workers is not None:
            check_num_workers(num_workers, entries - (own_given or 0))
        self.procs_per_worker = check_procs_per_worker(procs_per_worker)
        self.copy = copy
        self.shared_memory = check_flag("shared_memory", shared_memory)
        self.timeout = check_seconds("timeout", timeout, allow_none=True)
        self.on_worker_failure = check_choice("on_worker_failure", on_worker_failure, ["raise", "restart", "rehome"])
        self.on_env_error = check_choice("on_env_error", on_env_error, ["raise", "reset"])
        self.heartbeat = Heartbeat() if heartbeat is None else heartbeat
        max_errors = check_count("max_env_errors", max_env_errors) if on_env_error == "reset" else None
        self._max_env_errors = max_errors
        self._observation_mode = observation_mode = check_observation_mode(observation_mode)
        launcher = resolve_launcher(launcher)
        self._start_with = given = _StartWith(
            pickled_fns=[pickle_env_fn(i, fn) for i, fn in enumerate(env_fns)],
            autoreset_mode=check_autoreset_mode(autoreset_mode),
            spin_us=check_spin_us(spin_us),
            start_timeout=check_seconds("start_timeout", start_timeout, allow_none=False),
            min_workers=min_workers,
            batch_size=batch_size,
            recycle=recycle,
            pool_kwargs={
                "bind": bind,
                "secret": secret,
                "launcher": launcher,
                "heartbeat": self.heartbeat,
                "on_worker_failure": on_worker_failure,
                "trusted_classes": trusted_classes,
                "encrypt": encrypt,
                "compression": check_codec(compression),
            },
            local=isinstance(launcher, LocalLauncher),
            cores=usable_cores(),
        )
        self._layout_choice = functools.partial(
            choose_layout,
            entries,
            given.cores,
            num_workers=num_workers,
            learner_envs=own_given,
            local=given.local,
            first_ready=batch_size is not None,
            replaces_workers=on_worker_failure != "raise" or recycle is not None,
            procs_per_worker=self.procs_per_worker,
        )
        self._start(self._layout_choice())

    def _start(self, layout: Layout) -> None:
        """Start the workers of ``layout`` and build the envs: the learner's own share, then the workers'."""
        given = self._start_with
        entries = len(given.pickled_fns)
        self._own: LearnerEnvs | None = None
        self._lockstep: Lockstep | None = None
        if layout.learner_envs:
            try:
                self._own = self._learner_share(layout.learner_envs)
            except UnitsInLearnerShare:
                if not layout.by_default:
                    raise
                layout = self._layout_choice(units=True)
        self.layout = layout
        self.learner_envs = own = layout.learner_envs
        self.num_workers = num_workers = check_num_workers(layout.num_workers, entries - own)
        min_workers = check_min_workers(given.min_workers, num_workers)
        # Of entries, until the envs are built; the workers' follow the learner's own.
        self._slices = [slice(own + sl.start, own + sl.stop) for sl in split_evenly(entries - own, num_workers)]
        self._units = [slice(i, i + 1) for i in range(entries)]
        self._batch_size = self.num_envs  # checked once the envs are built: units decide the workers' shares
        self._first_ready = FirstReady(self._slices, self.num_envs)
        try:
            self._pool = WorkerPool(
                num_workers,
                start_timeout=given.start_timeout,
                min_workers=min_workers,
                env_counts=[sl.stop - sl.start for sl in self._slices],
                describe_work=lambda w: f"envs {self._slices[w].start}..{self._slices[w].stop - 1}",
                **given.pool_kwargs,
            )
        except BaseException:
            if self._own is not None:
                self._own.close()
            raise
        # Weak: the pool must not keep the env alive (its finalizer ends the workers).
        self._pool.on_fatal = weak_callback(self._close_after_error)
        self.address = self._pool.address
        self._needs_reset = True
        self.closed = False
        try:
            self._recycler = None if given.recycle is None else Recycler(given.recycle, self._pool)
            self._pool.start()
            built = build_envs(
                self._pool,
                self._slices,
                given.pickled_fns,
                autoreset_mode=given.autoreset_mode,
                observation_mode=self._observation_mode,
                procs_per_worker=self.procs_per_worker,
                max_env_errors=self._max_env_errors,
                shared_memory=self.shared_memory,
                spin_us=given.spin_us,
                timeout=given.start_timeout,
                own=self._own,
            )
            self._place_units(built.slices, built.units, given.batch_size)
        except BaseException:
            self.close(terminate=True)
            raise
        self.autoreset_mode = built.autoreset_mode
        self.metadata, self.render_mode = built.metadata, built.render_mode
        # As SyncVectorEnv: env 0 refusing a step before reset (gym.make's OrderEnforcing) refuses it before any
        # env steps; envs built without that wrapper are stepped.
        self._steps_need_reset = built.first_env_enforces_order
        self.single_observation_space, self.observation_space = built.single_observation_space, built.observation_space
        self.single_action_space, self.action_space = built.single_action_space, built.action_space
        self._buffers = built.buffers
        self._action_specs = leaf_specs(self.single_action_space) if is_array_tree(self.single_action_space) else None
        self._pool.on_restart(weak_callback(self._reset_replacement_in_flight))
        self._hint = None if layout.by_default or not given.local else LayoutHint(layout, self.num_envs, given.cores)
        if self._pool.step_path is not None and self._action_specs is not None:
            self._lockstep = Lockstep(
                self._pool,
                self._buffers,
                self._call,
                self._first_ready,
                self._own,
                self._env_calls,
                self.single_action_space,
                self._action_specs,
                self.copy,
            )

    def _learner_share(self, count: int) -> LearnerEnvs:
        """Build envs ``0..count-1`` in this process, as the workers build theirs."""
        mode = self._observation_mode
        single = mode[1] if isinstance(mode, tuple) else mode
        asked = self._start_with.autoreset_mode
        own_mode = AutoresetMode.NEXT_STEP if asked is None else asked  # single envs' mode
        return LearnerEnvs(self._start_with.pickled_fns[:count], single, own_mode, self._max_env_errors)

    def place_every_env_in_workers(self, mode: str) -> None:
        """Move the envs the learner steps to the workers, for ``mode``, which needs every env in a worker.

        A ``PolicyRunner`` (the workers act) and first-ready batches (whole workers come back as
        they are ready) call this before they start. Only the default layout moves: it put a share
        of the envs in the learner because nothing then asked for such a mode. The workers are
        started anew with every env, which needs a reset afterwards (``needs_reset``); an explicit
        ``learner_envs`` raises instead.

        Args:
            mode: what needs it, for the error and the layout's reason (``"a PolicyRunner"``).
        """
        if self._own is None:
            return
        if not self.layout.by_default:
            raise ValueError(
                f"{mode[0].upper()}{mode[1:]}: every env must be in a worker, but the learner steps "
                f"{self.learner_envs} envs itself (`learner_envs={self.learner_envs}`): use `learner_envs=0`."
            )
        self._assert_is_running()
        if self._call.state is not AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                f"Cannot move the envs to the workers for {mode} while a call to `{self._call.state.value}` is "
                "pending.",
                self._call.state.value,
            )
        was_reset, moved = not self._needs_reset, self.learner_envs
        self.close_extras(terminate=False)
        given = self._start_with
        self._start(workers_only_layout(self.layout, len(given.pickled_fns), given.cores, mode))
        logger.info(
            "%s: every env must be in a worker; the %d envs the learner stepped moved to the workers%s.",
            mode[0].upper() + mode[1:],
            moved,
            "; the episodes in progress ended, and the envs need a reset" if was_reset else "",
        )

    def _place_units(self, slices: list[slice], units: list[slice], batch_size: int | None) -> None:
        """The envs' slices, once the workers reported how many envs each entry of ``env_fns`` made."""
        self._slices, self._units = slices, units
        self.num_envs = slices[-1].stop
        self._batch_size = check_batch_size(batch_size, [sl.stop - sl.start for sl in slices])
        self._first_ready = FirstReady(self._slices, self.num_envs)
        self._env_calls = EnvCalls(self._pool, slices, self._own)
        self._pool.members.env_counts[:] = [sl.stop - sl.start for sl in slices]

    @property
    def batch_size(self) -> int:
        """How many envs :meth:`recv` returns; may be changed while no env is in flight."""
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        if self._first_ready.busy_workers():
            raise AlreadyPendingCallError(
                "Cannot change `batch_size` while envs are in flight: recv() them first.", "step"
            )
        self._batch_size = check_batch_size(value, [sl.stop - sl.start for sl in self._slices])

    # -- the seam for extensions (PolicyRunner) ---------------------------------------------
    @property
    def pool(self) -> WorkerPool:
        """The worker pool, for extensions that send their own commands inside :meth:`pending_call`."""
        return self._pool

    @property
    def worker_slices(self) -> tuple[slice, ...]:
        """The envs of each worker: worker ``w`` steps envs ``worker_slices[w]`` (global indices)."""
        return tuple(self._slices)

    @property
    def needs_reset(self) -> bool:
        """True until the first ``reset`` (stepping before it raises ``ResetNeeded`` where env 0 enforces order)."""
        return self._needs_reset

    def _check_reset_before_step(self) -> None:
        """``ResetNeeded`` where ``SyncVectorEnv`` would raise it: env 0 refuses a step before its first reset."""
        if self._needs_reset and self._steps_need_reset:
            raise ResetNeeded("Cannot call `step` before `reset`: the environments have not been reset yet.")

    @contextlib.contextmanager
    def pending_call(self, holder: str | None = None) -> Iterator[WorkerPool]:
        """Hold the env's one pending call while an extension talks to the workers through the pool.

        Inside, ``reset``/``step``/``call`` raise ``AlreadyPendingCallError`` (naming ``holder``, if given);
        the pool's sequence number is new, so replies to earlier calls are ignored.
        """
        if self._own is not None:
            raise ValueError(
                "Extensions such as PolicyRunner talk to the workers through their pool, which cannot reach the "
                f"{self.learner_envs} envs the learner steps itself (`learner_envs`): call "
                "place_every_env_in_workers() first, or use `learner_envs=0`."
            )
        self._begin(AsyncState.WAITING_CALL, "pending_call")
        with self._call.held(AsyncState.WAITING_CALL, holder):
            yield self._pool

    def _begin(self, state: AsyncState, name: str) -> None:
        """Start a call of method ``name`` (named in errors as ``AsyncVectorEnv`` names it), entering ``state``."""
        self._assert_is_running()
        self._call.check_free(name, self._first_ready.busy_workers())
        self._pool.new_call()

    def _end(self, state: AsyncState, name: str) -> None:
        self._assert_is_running()
        self._call.check_pending(state, name)

    def _assert_is_running(self) -> None:
        if self.closed:
            raise ClosedEnvironmentError(f"Trying to operate on `{type(self).__name__}`, after a call to `close()`.")

    # -- reset -----------------------------------------------------------------------------
    def reset(
        self,
        *,
        seed: int | list[int | None] | None = None,
        options: dict[str, Any] | Sequence[dict[str, Any] | None] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset the envs (all, or those in ``options["reset_mask"]``), like ``SyncVectorEnv.reset``.

        Args:
            seed: ``None``; an int (env ``i`` gets ``seed + i``); or one seed (or ``None``) per env.
            options: passed to every env's ``reset`` (``reset_mask``, a boolean array, picks the
                envs to reset); or a list with one options dict (or ``None``) per env, which
                ``SyncVectorEnv`` cannot express: env ``i`` is then reset with ``options[i]``.

        Returns:
            The batched observations and infos.
        """
        self.reset_async(seed=seed, options=options)
        return self.reset_wait()

    def reset_async(
        self,
        seed: int | list[int | None] | None = None,
        options: dict[str, Any] | Sequence[dict[str, Any] | None] | None = None,
    ) -> None:
        """Send the reset to the workers without waiting for the observations (:meth:`reset_wait` returns them).

        Args:
            seed: as for :meth:`reset`.
            options: as for :meth:`reset`.
        """
        self._begin(AsyncState.WAITING_RESET, "reset_async")
        seeds = check_seeds(seed, self.num_envs)
        options, mask = check_reset_options(options, self.num_envs)
        commands = self._env_calls.reset_commands(seeds, options, mask)
        self._env_calls.expect_own_reset(seeds, options, mask)
        # Pending before anything is sent: a send interrupted (Ctrl-C) is finished by reset_wait().
        self._send_pending(AsyncState.WAITING_RESET, Kind.RESET, commands, OnLoss.REPLAY)
        self._run_own()  # while the workers reset theirs
        # Envs reset whole start new episodes: their cuts need no report.
        self._pool.cuts.settle(w for w in commands if mask is None or mask[self._slices[w]].all())
        if mask is None:
            self._buffers.rewards[:] = 0.0

    def _send_pending(self, state: AsyncState, kind: Kind, commands: dict[int, Command], on_loss: OnLoss) -> None:
        """Send ``commands`` as the pending call ``state``, which is pending before anything leaves.

        A send interrupted (Ctrl-C) is then finished by the ``*_wait`` call. Nothing leaves
        unless every command encodes (a partial reset would desynchronize the envs), and a
        command that cannot leaves no call pending.
        """
        self._call.pending, self._call.state = list(commands), state
        try:
            self._pool.send_each(kind, commands, on_loss)
        except Exception:
            if not self.closed:
                self._call.state = AsyncState.DEFAULT
            raise

    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        """Wait for the observations of a ``reset_async``.

        Args:
            timeout: seconds to wait; ``None``: the env's ``timeout``.

        Returns:
            The batched observations and infos, as :meth:`reset` returns them.
        """
        self._end(AsyncState.WAITING_RESET, "reset_wait")
        self._run_own()  # if an interrupt came before it
        replies = self._pool.gather(self._call.pending, "resetting", self.timeout if timeout is None else timeout)
        self._call.state = AsyncState.DEFAULT
        self._needs_reset = False
        infos = self._collect(replies, step=False)
        return self._buffers.observation_batch(self.copy), infos

    # -- step ------------------------------------------------------------------------------
    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step every env with its action, exactly as ``SyncVectorEnv.step`` does.

        Args:
            actions: one action per env, batched as ``action_space`` describes.

        Returns:
            The batched ``(obs, rewards, terminations, truncations, infos)``.
        """
        lockstep = self._lockstep
        if lockstep is not None and self._recycler is None and not self.closed and not self._needs_reset:
            result = lockstep.step(actions, self._run_own)
            if isinstance(result, tuple):
                if self._hint is not None:
                    self._look_at_layout()
                return result
            if result is None:  # started, and left to the pool's receive loop
                return self.step_wait()
        self.step_async(actions)  # not a lockstep step (NOT_LOCKSTEP): the general path
        return self.step_wait()

    def _look_at_layout(self) -> None:
        """Count a lockstep step for the layout hint (a layout the user gave only), which may look at the costs."""
        assert self._hint is not None
        self._hint.step(lambda: measured_costs(self.learner_info, self.worker_info))
        if self._hint.done:
            self._hint = None

    def step_async(self, actions: Any) -> None:
        """Send the actions to the workers without waiting for the results (:meth:`step_wait` returns them).

        Args:
            actions: one action per env, as for :meth:`step`.
        """
        self._begin(AsyncState.WAITING_STEP, "step_async")  # a pending reset is reported first, as Async does
        self._check_reset_before_step()
        cuts = self._pool.cuts
        if self._recycler is not None:  # a recycled worker's fresh envs join the moved ones
            self._recycler.before_step(range(self.num_workers), cuts, self._slices)
        # The fresh envs of workers cut since the last step do not step: this step reports their cut episodes.
        stepping = [w for w in range(self.num_workers) if w not in cuts]
        leaves = items = None
        if self._action_specs is None:  # no fixed array form (Text, Graph, ...): each env's action, pickled
            items = action_items(actions, self.action_space, self.num_envs)
        else:
            leaves = check_actions(actions, self.single_action_space, self._action_specs, self.num_envs)
        commands = self._env_calls.step_commands(stepping, leaves, items)
        self._env_calls.expect_own_step(leaves, items, self.single_action_space)
        # The cut episodes are reported as truncated.
        self._send_pending(AsyncState.WAITING_STEP, Kind.STEP, commands, OnLoss.INTERRUPT)
        self._run_own()

    def _run_own(self) -> None:
        """Run the learner's own envs' part of the call, if not yet: an env error closes, as a worker's does."""
        if self._own is None:
            return
        try:
            self._own.run()
        except Exception:
            self._close_after_error(terminate=False)
            raise

    def step_wait(self, timeout: float | None = None) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Wait for the results of a ``step_async``.

        Args:
            timeout: seconds to wait; ``None``: the env's ``timeout``.

        Returns:
            The batched ``(obs, rewards, terminations, truncations, infos)``, as :meth:`step` returns them.
        """
        self._end(AsyncState.WAITING_STEP, "step_wait")
        self._run_own()  # if an interrupt came before it
        replies = self._pool.gather(self._call.pending, "stepping", self.timeout if timeout is None else timeout)
        self._call.state = AsyncState.DEFAULT
        return self._step_result(replies)

    def _step_result(
        self, replies: dict[int, Message]
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """What ``step`` returns for the workers' ``replies``, with the episodes cut meanwhile reported."""
        infos = self._collect(replies, step=True)
        interrupted = list(self._pool.cuts.take())  # cut before this step, or while it ran
        if interrupted:
            same_step = self.autoreset_mode is AutoresetMode.SAME_STEP
            infos = report_cuts(self._buffers, self._pool, self._slices, infos, interrupted, same_step, self.timeout)
        result = self._buffers.step_batch(self.copy, infos)
        self._pool.timing.finish()
        return result

    def _collect(self, replies: dict[int, Message], step: bool) -> dict[str, Any]:
        return self._buffers.collect(self._env_calls.replies_in_order(replies), step)

    # -- first-ready batches (EnvPool's async_reset / send / recv) --------------------------
    def async_reset(self, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None) -> None:
        """Reset every env without waiting; :meth:`recv` returns them ``batch_size`` at a time, first ready first.

        Each env's trajectory is exactly that of the same env stepped alone with its seed
        (``seed + i`` for env ``i``) and the actions :meth:`send` gives it.

        Args:
            seed: as for :meth:`reset`.
            options: passed to every env's ``reset`` (no ``reset_mask``: every env is reset).
        """
        self.place_every_env_in_workers(_FIRST_READY)
        check_first_ready(self._observation_mode, self.autoreset_mode)
        if options is not None and "reset_mask" in options:
            raise ValueError("async_reset() resets every env; `options['reset_mask']` is for reset().")
        self.reset_async(seed=seed, options=options)
        self._call.state, self._needs_reset = AsyncState.WAITING_STEP, False
        self._first_ready.in_flight = dict.fromkeys(self._call.pending, "reset")

    def send(self, actions: Any, env_ids: Any) -> None:
        """Step the envs ``env_ids`` (whole workers, as :meth:`recv` returned them) with ``actions``, without waiting.

        Args:
            actions: ``actions[j]`` is the action of env ``env_ids[j]``.
            env_ids: the envs to step: whole workers' envs, as :meth:`recv` returned them.
        """
        self._assert_is_running()
        self.place_every_env_in_workers(_FIRST_READY)
        check_first_ready(self._observation_mode)
        if self._needs_reset:
            raise ResetNeeded("Cannot call `send` before a reset: call async_reset() (or reset()) first.")
        if self._action_specs is None:
            raise TypeError(
                f"send()/recv() need an action space with a fixed array form; {self.single_action_space} has "
                "none. Use step(), which supports every space."
            )
        n, plan = self._first_ready.plan(env_ids)
        leaves = check_actions(actions, self.single_action_space, self._action_specs, n)
        if not self._first_ready.busy_workers():
            self._begin(AsyncState.WAITING_STEP, "send")
            self._call.state = AsyncState.WAITING_STEP
        self._first_ready.send(self._pool, leaves, plan, self._recycler)

    def recv(self, timeout: float | None = None) -> Ready:
        """The results of the first ``batch_size`` envs to be ready.

        That is the envs of the first ``batch_size // envs_per_worker`` workers to reply, in the
        order they replied; row ``j`` is env ``env_ids[j]``, and infos are batched over the rows.
        After :meth:`async_reset`, rewards are 0 and terminations and truncations False.

        Args:
            timeout: seconds to wait (``None``: the env's ``timeout``); past it,
                ``WorkerTimeoutError`` is raised and the envs stay in flight.

        Returns:
            ``(obs, rewards, terminations, truncations, infos, env_ids)``.
        """
        self._assert_is_running()
        needed = self.num_workers * self._batch_size // self.num_envs  # exact: whole workers
        timeout = self.timeout if timeout is None else timeout
        ready = self._first_ready.wait(self._pool, needed, self._batch_size, timeout)
        if not self._first_ready.busy_workers():
            self._call.state = AsyncState.DEFAULT
        batch = self._first_ready.assemble(ready, self._buffers)
        self._pool.timing.finish()
        return batch

    # -- elastic fleet (on_worker_failure="rehome") ---------------------------------------------
    def rebalance(self, wait: float = 0.0) -> list[int]:
        """Let worker processes that connected mid-run take envs; returns the workers whose envs moved.

        A process started with ``clusterenv-worker --connect ...`` (on a new host, or one that came back)
        after the start is admitted here, after the same authentication as at the start. It first takes
        back the envs of the worker whose id it asked for, if another process carries them; then whole
        workers' envs move from the most loaded processes to the least loaded ones while that lowers the
        larger load. Nothing moves on its own: call this between steps (or rollouts).

        A moved worker's envs are rebuilt from their factories in the new process and start new episodes:
        the next ``step`` (or ``recv``, or ``PolicyRunner`` rollout) reports the cut episodes truncated and
        flagged ``infos["worker_restarted"]``, as a restart does. Needs ``on_worker_failure="rehome"``.

        Args:
            wait: if no process has connected yet, wait up to this many seconds for one.

        Returns:
            The workers whose envs moved.
        """
        if self.on_worker_failure != "rehome":
            raise ValueError(
                "rebalance() moves envs between worker processes, which needs on_worker_failure='rehome', got "
                f"{self.on_worker_failure!r}."
            )
        if wait != 0:
            wait = check_seconds("wait", wait, allow_none=False)
        self._begin(AsyncState.WAITING_CALL, "rebalance")
        with self._call.held(AsyncState.WAITING_CALL):
            return self._pool.rebalance(wait)

    def note_cuts_reported(self, worker_ids: Iterable[int]) -> None:
        """For extensions: these workers' cut envs had their cut reported another way (a rollout on fresh envs)."""
        self._pool.cuts.settle(worker_ids)

    def _reset_replacement_in_flight(self, worker_id: int) -> list[FollowUp]:
        """A restart hook for first-ready batches: report the cut episodes of a replaced (or re-homed) worker."""
        cut = Cut.REHOMED if self.on_worker_failure == "rehome" else Cut.RESTARTED
        return self._first_ready.restart_hook(worker_id, self._pool.cuts, cut)

    # -- attributes ------------------------------------------------------------------------
    # An exception raised by an attribute or a called method is the caller's business (SB3's
    # ``has_attr`` probes with ``except AttributeError``): it is raised as its own type (also a
    # ``RemoteEnvError``) and the envs stay usable, as with ``SyncVectorEnv``.
    def call_async(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Ask every env for ``name`` without waiting (:meth:`call_wait` returns the results).

        Args:
            name: an attribute of the envs; called with the arguments if it is callable.
            *args: positional arguments of the call.
            **kwargs: keyword arguments of the call.
        """
        self._call_async("call_async", None, check_attribute_name(name), args, kwargs, f"arguments of call({name!r})")

    def _call_async(
        self, method: str, indices: list[int] | None, name: str | None, args: tuple, kwargs: dict, what: str
    ) -> None:
        self._begin(AsyncState.WAITING_CALL, method)
        self._call.pending = self._env_calls.send_call(indices, name, args, kwargs, what)
        self._call.state = AsyncState.WAITING_CALL

    def call_wait(self, timeout: float | None = None) -> tuple[Any, ...]:
        """The per-env results of a ``call_async``, in env order.

        Args:
            timeout: seconds to wait; ``None``: the env's ``timeout``.
        """
        self._end(AsyncState.WAITING_CALL, "call_wait")
        try:
            replies = self._pool.gather(
                self._call.pending, "calling", self.timeout if timeout is None else timeout, errors_close=False
            )
        finally:
            self._call.state = AsyncState.DEFAULT
        return self._env_calls.results(replies)

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call ``name`` on every env (or read it, if not callable); results in env order.

        Args:
            name: an attribute of the envs.
            *args: positional arguments of the call.
            **kwargs: keyword arguments of the call.
        """
        self.call_async(name, *args, **kwargs)
        return self.call_wait()

    def get_attr(self, name: str, indices: Any = None) -> tuple[Any, ...]:
        """Read attribute ``name`` of every env, as ``SyncVectorEnv.get_attr`` does (a method is called).

        Args:
            name: the attribute.
            indices: only these envs (an int or ints; negative ones count from the end), in
                this order; ``None``: all, in env order.
        """
        self._call_async(
            "get_attr", check_indices(indices, self.num_envs), check_attribute_name(name), (), {}, "get_attr"
        )
        return self.call_wait()

    def apply(self, fn: Callable[[Env], Any], indices: Any = None) -> tuple[Any, ...]:
        """``fn(env)`` for every env (or those in ``indices``), run in the env's own process; the results.

        ``fn`` travels cloudpickled, like the env factories; its results travel back pickled.
        It sees each env as its factory made it (wrappers included), e.g.
        ``envs.apply(lambda env: env.spec.id)``.

        Args:
            fn: a picklable callable taking one env.
            indices: as for :meth:`get_attr`.
        """
        if not callable(fn):
            raise TypeError(f"`fn` must be a callable taking one env, got {type(fn).__name__}.")
        self._call_async("apply", check_indices(indices, self.num_envs), None, (fn,), {}, "function given to apply()")
        return self.call_wait()

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | Any, indices: Any = None) -> None:
        """Set attribute ``name`` on every env (or those in ``indices``).

        Args:
            name: the attribute.
            values: one value per env chosen (a list or tuple), or one value for all of them.
            indices: as for :meth:`get_attr`.
        """
        name = check_attribute_name(name)
        chosen = check_indices(indices, self.num_envs)
        values = per_env_values(values, self.num_envs if chosen is None else len(chosen))
        self._begin(AsyncState.WAITING_CALL, "set_attr")
        with self._call.held(AsyncState.WAITING_CALL):
            asked = self._env_calls.send_set_attr(name, values, chosen)
            self._pool.gather(asked, "setting attributes", self.timeout, errors_close=False)

    def render(self) -> tuple[Any, ...] | None:
        """The frames rendered by every env, in env order."""
        return self.call("render")

    @property
    def np_random_seed(self) -> tuple[int, ...]:  # type: ignore[override]
        """The seed of each env's random number generator."""
        return self.get_attr("np_random_seed")

    @property  # type: ignore[misc]
    def np_random(self) -> tuple[np.random.Generator, ...]:  # type: ignore[override]
        """A copy of each env's random number generator (the originals stay in the workers)."""
        return self.get_attr("np_random")

    # -- shutdown --------------------------------------------------------------------------
    def close_extras(self, timeout: float | None = None, terminate: bool = False, **kwargs: Any) -> None:
        """Ask workers to close their envs and exit; kill those that do not within the grace period.

        Args:
            timeout: the grace period, in seconds (``None``: 5 s).
            terminate: kill the workers at once, without asking.
            **kwargs: ignored (``VectorEnv.close`` passes its own).
        """
        in_flight = bool(self._first_ready.busy_workers())
        pending = self._call.state is not AsyncState.DEFAULT and self._call.holder is None and not in_flight
        abandoned = self._call.state.value
        self._call.state = AsyncState.DEFAULT
        self._pool.close(timeout, terminate=terminate)
        if self._own is not None:
            self._own.close()
        buffers: BatchBuffers | None = getattr(self, "_buffers", None)  # none if building the envs failed
        if buffers is not None:
            buffers.detach()  # the shared memory the workers wrote goes once no one else holds a view of it
        self._lockstep = None  # with it, its views of the step region
        if pending:
            # As AsyncVectorEnv warns; after closing, so that under warnings-as-errors the workers are gone already.
            gymnasium.logger.warn(f"Calling `close` while waiting for a pending call to `{abandoned}` to complete.")

    def _close_after_error(self, terminate: bool) -> None:
        self._call.state = AsyncState.DEFAULT  # the failed call is over
        self.close(terminate=terminate)

    @property
    def worker_info(self) -> list[dict[str, Any]]:
        """What each worker process does and uses, one dict per process.

        Keys: ``worker_id, host, pid, state, serves, env_ids, units, lost_because, silent_s, latency_ms,
        env_step_ms, cpu_s, rss_mb, step_path`` (``"shared memory"`` or ``"messages"``). ``units`` lists the
        ``(first, last)`` env ids of each entry of ``env_fns`` the process steps: a vector env's, or a single
        env's (``(i, i)``).

        Each field is explained in docs/guides/fault-tolerance.md ("Watching the workers"): where its
        envs are, whether it is alive, how fast it replies, and what CPU and memory it uses.
        """
        return [{**info, **envs_served(info["serves"], self._slices, self._units)} for info in self._pool.worker_info]

    @property
    def learner_info(self) -> dict[str, Any]:
        """Per batch step, the learner's own time against its time waiting for workers (fault-tolerance guide).

        ``learner_envs`` is how many envs the learner steps itself, and ``layout`` why: the
        default rule's reasoning, or the arguments given (:mod:`clusterenv.learner.layout`).
        With workers on the shared step path, also how the learner waits for them: ``spin``
        (``"adaptive"``, ``"fixed"`` or ``"never"``), ``spin_us`` (the bound now), ``spin_rule``
        (why), and how many ``waits`` ended while spinning (``caught_spinning``).
        """
        return {**self._pool.learner_info, "learner_envs": self.learner_envs, "layout": self.layout.reason}

    def __enter__(self) -> ClusterEnv:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        """``ClusterEnv(CartPole-v1, num_envs=8, num_workers=1, learner_envs=4: <why the default layout chose it>)``."""
        name = "" if self.spec is None else f"{self.spec.id}, "
        procs = "" if self.procs_per_worker == 1 else f", procs_per_worker={self.procs_per_worker}"
        own = f", learner_envs={self.learner_envs}" if self.learner_envs else ""
        layout = self.__dict__.get("layout")  # none while the envs are being built
        why = f": {layout.reason}" if layout is not None and layout.by_default else ""
        return f"{type(self).__name__}({name}num_envs={self.num_envs}, num_workers={self.num_workers}{procs}{own}{why})"
