"""A fleet of served pools on Ray Serve: N pool deployments (one LocalPool and its server each;
one GPU each where there are GPUs) behind one front door that speaks Tinker's wire protocol on
one URL (the routing: trio_widgets/http/fleet.py). The door is `fleet.FrontDoor`, run by the
process that calls `serve_fleet` (Serve's own HTTP proxy is off): it holds what `serve` holds
(guard.py: Host/Origin checks, header and idle timeouts, connections per address and per key,
bodies bounded per connection, per key and in all). Pool replicas listen on loopback when the
Ray cluster is one machine, and on their node's address (their server authenticating every
request: keys are required there) only when the door may be on another node.

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

from .fleet import FrontDoor, Members, PoolState, describe, pool_tag

__all__ = ["Fleet", "serve_fleet"]

#: serve_fleet's settings that are the front door's (the others go to every pool's server)
_DOOR_SETTINGS = ("allowed_hosts", "allowed_origins", "header_timeout_s", "body_timeout_s",
                  "max_waiting_connections", "max_connections_per_address", "max_connections_per_key",
                  "max_connections", "max_new_connections_per_address_s", "max_inflight_bytes_per_key",
                  "max_inflight_bytes")

APP = "trio-fleet"


@dataclass
class Fleet:
    """A fleet running on Ray Serve: its URL, its pools' names, and `stop()`."""

    url: str
    pools: int
    checkpoint_dir: str
    door: FrontDoor | None = field(default=None, repr=False)
    _owns_ray: bool = field(default=False, repr=False)
    _stopped: bool = field(default=False, repr=False)

    def stop(self) -> None:
        """Close the front door, delete the pools' applications (each pool answers its pending
        futures, then closes) and, when this call started Ray, shut it down."""
        if self._stopped:
            return
        self._stopped = True
        if self.door is not None:
            self.door.stop()
        import ray
        from ray import serve

        if ray.is_initialized():
            try:
                for k in range(self.pools):
                    serve.delete(f"{APP}-pool-{k}")
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
        from .server import Server, freeze_heap

        self.index = index
        self.epoch = secrets.token_hex(3)  # new each time Ray (re)starts this replica
        keys = [*server_settings.get("api_keys", ()), *server_settings.get("observer_keys", ())]
        # loopback where the cluster is one machine (the door is on it) or without keys; else the node's
        # address, for a door on another node, every request authenticated by the pool's server
        self.node = _node_ip() if keys and not _one_machine() else "127.0.0.1"
        self.pool = LocalPool(name=f"pool-{index}", owned_by_cell=False, **pool_settings)
        for name in models:
            self.pool.get_base_model(name)
        self.server = Server(self.pool, host=self.node, port=0, models=models, owns_pool=True,
                             id_tag=pool_tag(index, self.epoch), **server_settings).start()
        freeze_heap()  # a replica's process serves this pool alone, as `trio serve`'s does

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


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _one_machine() -> bool:
    import ray

    return len({n.get("NodeManagerAddress") for n in ray.nodes() if n.get("Alive")}) <= 1


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
    door_settings = {k: server_settings.pop(k) for k in _DOOR_SETTINGS if k in server_settings}
    settings = {"api_keys": keys, "observer_keys": observers, "session_timeout_s": session_timeout_s,
                "max_body_bytes": max_body_bytes, **server_settings, **door_settings}
    # the pools' own servers keep the door's limits too (allowed_hosts aside: they are asked by the door)
    settings.pop("allowed_hosts", None)
    door = FrontDoor(_RayMembers([]), host=host, port=port, api_keys=keys, observer_keys=observers,
                     max_body_bytes=max_body_bytes, **door_settings)  # checks the settings before Ray works
    serve.start(proxy_location="Disabled")  # the door is ours (FrontDoor), not Serve's HTTP proxy
    replica: Any = serve.deployment(PoolReplica)  # (typed as a decorator factory)
    handles = [serve.run(replica.options(name=f"pool-{k}", num_replicas=1, max_ongoing_requests=64,
                                         health_check_period_s=2.0, health_check_timeout_s=10.0,
                                         ray_actor_options={"num_cpus": cpus_per_pool, "num_gpus": gpus_per_pool,
                                                            "runtime_env": {"env_vars": {
                                                                "TRIO_TORCH_THREADS": str(threads)}}}
                                         ).bind(k, pool_settings, settings, models),
                         name=f"{APP}-pool-{k}", route_prefix=None)
               for k in range(pools)]
    members = _RayMembers(handles)
    door.ingress.members = members
    door.ingress.placements = [0] * members.size
    door.start()
    return Fleet(url=door.url, pools=pools, checkpoint_dir=shared, door=door, _owns_ray=owns)
