"""Workers as Ray actors, spread over a Ray cluster (``pip install "clusterenv-rl[ray]"``).

Ray only places and supervises the worker processes; the data path stays ZeroMQ: each
actor runs :func:`clusterenv.worker.process.serve`, which connects back to the learner's tcp
address. So the learner must bind an address the Ray nodes can reach (with a secret when
it is not loopback); on a single-node Ray instance, the default loopback tcp bind works.
The secret travels to the actors as a task argument, inside Ray's own cluster traffic.
The worker hosts need clusterenv (and the envs' packages) installed, or a ``runtime_env``.
"""

from __future__ import annotations

import logging
from typing import Any

from clusterenv.errors import WorkerStartError
from clusterenv.wire.transport import is_loopback

__all__ = ["RayLauncher"]

logger = logging.getLogger(__name__)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError(
            "ClusterEnv(launcher='ray') needs Ray; install it with `pip install 'clusterenv-rl[ray]'`."
        ) from None
    return ray


def _nodes_on_other_hosts(ray: Any) -> set[str]:
    """Addresses of live Ray nodes that are not this host (several nodes of one host share its address)."""
    here = {ray.util.get_node_ip_address(), "127.0.0.1", "localhost"}
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    return {str(node.get("NodeManagerAddress")) for node in nodes} - here


class _WorkerActor:
    """The actor body: one clusterenv worker per actor process."""

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def serve(self, address: str, worker_id: int, key: bytes, encrypt: bool = False) -> int:
        from clusterenv.worker.process import serve

        return serve(address, worker_id, key, encrypt=encrypt)


class RayLauncher:
    """Start each worker as a Ray actor; Ray chooses the node, within the resources asked for.

    Args:
        address: Ray cluster to join (``"auto"``, ``"ray://host:10001"``...); ``None`` uses an
            already initialised Ray, else ``ray.init()``'s default (a local instance).
        num_cpus_per_worker: CPUs reserved by each worker actor.
        resources: extra Ray resources per worker, e.g. ``{"env_host": 1}``.
        runtime_env: Ray runtime environment of the actors (packages, env vars).
        spread: ask Ray to spread the workers over nodes (``SPREAD`` scheduling).
        **init_kwargs: passed to ``ray.init`` when this launcher initialises Ray; it then
            also shuts Ray down in ``stop``.

    Examples:
        ``ClusterEnv(env_fns, launcher=RayLauncher(address="auto"), bind="tcp://10.0.0.1:5555", secret=...)``
    """

    requires_tcp = True

    def __init__(
        self,
        address: str | None = None,
        *,
        num_cpus_per_worker: float = 1,
        resources: dict[str, float] | None = None,
        runtime_env: dict[str, Any] | None = None,
        spread: bool = True,
        **init_kwargs: Any,
    ) -> None:
        self.address = address
        self.options: dict[str, Any] = {"num_cpus": num_cpus_per_worker, "max_restarts": 0}
        if resources:
            self.options["resources"] = dict(resources)
        if runtime_env:
            self.options["runtime_env"] = dict(runtime_env)
        if spread:
            self.options["scheduling_strategy"] = "SPREAD"
        self.init_kwargs = init_kwargs
        self._owns_ray = False
        self._actors: dict[int, Any] = {}
        self._runs: dict[int, Any] = {}
        self._nodes: dict[int, Any] = {}
        self.encrypt = False  # set by the pool under ClusterEnv(encrypt=True)

    def _ray(self) -> Any:
        ray = _import_ray()
        if not ray.is_initialized():
            ray.init(address=self.address, **self.init_kwargs)
            self._owns_ray = True
        return ray

    def start(self, worker_ids: list[int], address: str, key: bytes) -> None:
        """Create one actor per id and start its serve loop."""
        ray = self._ray()
        if is_loopback(address) or address.startswith("ipc://"):
            remote = _nodes_on_other_hosts(ray)
            if remote:
                raise WorkerStartError(
                    f"The Ray cluster has nodes on other hosts ({', '.join(sorted(remote))}) but the learner "
                    f"listens on {address}, which only this host can reach. Pass "
                    "`bind='tcp://<an address of this host>:<port>'` and a `secret`."
                )
        actor_class = ray.remote(_WorkerActor)
        for worker_id in worker_ids:
            self.kill(worker_id)
            actor = actor_class.options(name=None, **self.options).remote()
            self._actors[worker_id] = actor
            self._nodes[worker_id] = actor.node_id.remote()  # asked first: the actor is busy serving after
            self._runs[worker_id] = actor.serve.remote(address, worker_id, key, self.encrypt)

    def exit_code(self, worker_id: int) -> int | None:
        """The serve loop's status once it returned, 1 if it raised, -9 if the actor died; ``None`` while running."""
        run = self._runs.get(worker_id)
        if run is None:
            return None
        ray = _import_ray()
        ready, _ = ray.wait([run], timeout=0)
        if not ready:
            return None
        try:
            return int(ray.get(run))
        except ray.exceptions.RayActorError:
            return -9
        except Exception:
            return 1

    def node_id(self, worker_id: int, timeout: float = 30.0) -> str:
        """The Ray node that worker ``worker_id``'s actor runs on (for tests and diagnostics)."""
        ray = _import_ray()
        return str(ray.get(self._nodes[worker_id], timeout=timeout))

    def describe(self, worker_id: int) -> str:
        """``Ray worker 3 (actor 1a2b3c4d)``."""
        actor = self._actors.get(worker_id)
        where = "" if actor is None else f" (actor {actor._actor_id.hex()[:8]})"
        return f"Ray worker {worker_id}{where}"

    def kill(self, worker_id: int) -> None:
        """Kill the worker's actor (its process ends; Ray does not restart it)."""
        actor = self._actors.pop(worker_id, None)
        self._runs.pop(worker_id, None)
        self._nodes.pop(worker_id, None)
        if actor is not None:
            _import_ray().kill(actor, no_restart=True)

    def stop(self, grace: float) -> None:
        """Let the serve loops return for up to ``grace`` seconds, kill the actors, and shut Ray down if ours."""
        if not self._actors and not self._owns_ray:
            return
        ray = _import_ray()
        runs = list(self._runs.values())
        if runs and grace > 0:
            ray.wait(runs, num_returns=len(runs), timeout=grace)
        for worker_id in list(self._actors):
            self.kill(worker_id)
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
