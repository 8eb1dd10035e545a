"""A fleet of served pools on Ray Serve: N pool deployments (one LocalPool and its server each;
one GPU each where there are GPUs) behind one ingress deployment that speaks Tinker's wire
protocol on one URL (the routing: trio_widgets/http/fleet.py).

>>> fleet = serve_fleet(pools=2, api_keys=["tml-..."], checkpoint_dir="/shared/ckpt")
>>> fleet.url                     # tinker.ServiceClient(base_url=fleet.url, api_key=...)
>>> fleet.stop()

The same code runs on a laptop (a local Ray instance, started here) and on a cluster
(`address="auto"` inside it, or `ray://head:10001`). Ray restarts a pool replica that dies;
its sessions are told so by the ingress (fleet.py), checkpoints stay in `checkpoint_dir`, which
every node must mount at the same path. Needs the `cluster` extra (`pip install
trio-widgets[cluster]`).
"""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .fleet import Ingress, Members, PoolState, describe, pool_tag

__all__ = ["Fleet", "serve_fleet"]

APP = "trio-fleet"


@dataclass
class Fleet:
    """A fleet running on Ray Serve: its URL, its pools' names, and `stop()`."""

    url: str
    pools: int
    checkpoint_dir: str
    _owns_ray: bool = field(default=False, repr=False)
    _stopped: bool = field(default=False, repr=False)

    def stop(self) -> None:
        """Delete the application (each pool answers its pending futures, then closes) and, when
        this call started Ray, shut it down."""
        if self._stopped:
            return
        self._stopped = True
        import ray
        from ray import serve

        if ray.is_initialized():
            try:
                serve.delete(APP)
                if self._owns_ray:
                    serve.shutdown()
            finally:
                if self._owns_ray:
                    ray.shutdown()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class PoolReplica:
    """One pool of the fleet: a LocalPool served on this node, its ids tagged p<index>r<epoch>."""

    def __init__(self, index: int, pool_settings: dict, server_settings: dict, models: list[str]) -> None:
        from ..engine import LocalPool
        from .server import Server

        self.index = index
        self.epoch = secrets.token_hex(3)  # new each time Ray (re)starts this replica
        keys = [*server_settings.get("api_keys", ()), *server_settings.get("observer_keys", ())]
        # Reachable from the ingress on another node when keys guard it; loopback (one machine) without
        self.node = _node_ip() if keys else "127.0.0.1"
        self.pool = LocalPool(name=f"pool-{index}", owned_by_cell=False, **pool_settings)
        for name in models:
            self.pool.get_base_model(name)
        self.server = Server(self.pool, host=self.node, port=0, models=models, owns_pool=True,
                             id_tag=pool_tag(index, self.epoch), **server_settings).start()

    def describe(self) -> PoolState:
        return describe(self.index, self.epoch, self.server, self.node)

    def check_health(self) -> None:  # Ray Serve: a replica whose server stopped is replaced
        if not self.server.running:
            raise RuntimeError(f"pool-{self.index}'s server is not running")

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()


class _RayMembers(Members):
    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles
        self.size = len(handles)

    async def ask(self, index: int) -> PoolState | None:
        return await self.handles[index].describe.remote()


class FleetIngress:
    """The fleet's one URL (Ray Serve's HTTP proxy hands it every request)."""

    def __init__(self, *pools: Any, max_body_bytes: int = 16 << 20) -> None:
        self.ingress = Ingress(_RayMembers(list(pools)), max_body_bytes=max_body_bytes)

    async def __call__(self, request: Any) -> Any:
        return await self.ingress(request)


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def serve_fleet(pools: int = 2, *, host: str = "127.0.0.1", port: int = 8000, address: str | None = None,
                gpus_per_pool: float | None = None, cpus_per_pool: float = 1.0, torch_threads: int | None = None,
                models: Iterable[str] | None = None, checkpoint_dir: str | os.PathLike | None = None,
                api_keys: Iterable[str] | None = None, observer_keys: Iterable[str] | None = None,
                min_cycle_s: float = 0.05, device: str = "auto", session_timeout_s: float = 60.0,
                max_body_bytes: int = 16 << 20, **server_settings: Any) -> Fleet:
    """Deploy `pools` served pools behind one URL on Ray Serve and return the running Fleet.

    `address`: an existing Ray cluster ("auto" from a node of it, or "ray://head:10001");
    None starts a local instance (stopped by `Fleet.stop()`). `gpus_per_pool`: GPUs per pool
    replica (default: 1 where the cluster has GPUs, else 0 and the pool runs on CPU).
    `checkpoint_dir`: a directory every node mounts at this path (default: a new temporary
    directory, which suits one machine only). `torch_threads`: torch threads per CPU pool
    (default: `cpus_per_pool`). The other settings are `trio.serve`'s, for every pool.
    """
    import ray
    from ray import serve

    from ..engine.models import DEFAULT_MODEL
    from .server import check_bind

    if not isinstance(pools, int) or not 1 <= pools <= 1024:
        raise ValueError(f"pools must be an integer from 1 to 1024, got {pools!r}")
    # (a {key: participant name} mapping keeps its names: each pool labels that key's sessions by them)
    keys: Any = dict(api_keys) if isinstance(api_keys, Mapping) else list(api_keys or ())
    observers = list(observer_keys or ())
    check_bind(host, [*keys, *observers])
    models = list(models or [DEFAULT_MODEL])
    shared = os.fspath(checkpoint_dir) if checkpoint_dir is not None else tempfile.mkdtemp(prefix="trio-fleet-")
    owns = not ray.is_initialized()
    if owns:
        if address is None:
            # "local": a new instance, never one another process of this machine started
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(pools * cpus_per_pool) + 1),
                     include_dashboard=False, log_to_driver=False, configure_logging=False)
        else:
            ray.init(address=address, log_to_driver=False)
    if gpus_per_pool is None:
        gpus_per_pool = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
    threads = torch_threads or max(1, int(cpus_per_pool))
    pool_settings = {"min_cycle_s": min_cycle_s, "device": device if gpus_per_pool or device != "auto" else "cpu",
                     "checkpoint_dir": shared, "torch_threads": threads}
    settings = {"api_keys": keys, "observer_keys": observers, "session_timeout_s": session_timeout_s,
                "max_body_bytes": max_body_bytes, **server_settings}
    serve.start(http_options={"host": host, "port": port})
    replica: Any = serve.deployment(PoolReplica)  # (typed as a decorator factory)
    bound = [replica.options(name=f"pool-{k}", num_replicas=1, max_ongoing_requests=64,
                             health_check_period_s=2.0, health_check_timeout_s=10.0,
                             ray_actor_options={"num_cpus": cpus_per_pool, "num_gpus": gpus_per_pool,
                                                "runtime_env": {"env_vars": {"TRIO_TORCH_THREADS": str(threads)}}}
                             ).bind(k, pool_settings, settings, models)
             for k in range(pools)]
    deployment: Any = serve.deployment(FleetIngress)
    ingress = deployment.options(name="ingress", num_replicas=1, max_ongoing_requests=10_000,
                                                     ray_actor_options={"num_cpus": 0})
    serve.run(ingress.bind(*bound, max_body_bytes=max_body_bytes), name=APP, route_prefix="/")
    shown = f"[{host}]" if ":" in host else host
    return Fleet(url=f"http://{shown}:{port}", pools=pools, checkpoint_dir=shared, _owns_ray=owns)
