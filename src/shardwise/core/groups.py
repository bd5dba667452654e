"""Launch and process groups: torchrun's environment, the backend, the device of each rank."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import addresses
from .errors import ShardwiseError

DEFAULT_TIMEOUT_S = 300.0

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init(*, backend: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Start the default process group from torchrun's environment.

    Picks ``nccl`` when CUDA is available and ``gloo`` otherwise, binds each process to
    ``cuda:LOCAL_RANK``, and sets the collective timeout (seconds) after which a collective
    that cannot complete (a rank died or took another path) raises on every rank instead of
    hanging, naming where each rank was (flight.py). Without torchrun's variables it starts a
    world of size 1. A no-op when a default group already exists. The group it starts is
    destroyed when the script ends normally, if the script has not done so (Note [exit]).
    """
    global _timeout_s
    if dist.is_initialized():
        return
    _timeout_s = timeout
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    pg_timeout = timedelta(seconds=timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):  # (torchrun's default)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = _attempt_store(rank, world, pg_timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=pg_timeout)
    elif all(v in os.environ for v in _TORCHRUN_VARS):
        dist.init_process_group(backend, timeout=pg_timeout)
    else:
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=pg_timeout
        )
    atexit.register(_leave, dist.group.WORLD.group_name)


# Note [a restarted job's store]: torchrun's agent hosts the store its workers rendezvous in
# (MASTER_ADDR:MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True) and keeps it across the restarts
# of --max-restarts. torch's env:// rendezvous writes the same keys in it at every attempt, so a
# restarted worker may read the addresses of the dead attempt's ranks (seen: 4 restarts in 5
# failed, Gloo's connectFullMesh refused or timed out), unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# gives every attempt a fresh store. TORCHELASTIC_RESTART_COUNT cannot name the attempt: on a
# job of several nodes, a node restarted for a peer's failure does not count it. So rank 0 names
# the attempt with a fresh token, and every other rank proves the token it read is this
# attempt's: it writes a nonce of its own under the token and waits for rank 0 to echo it; a
# token left by a dead attempt gets no echo, and the rank reads the token again. The default
# group and every group made from it then keep their keys under the token.
def _attempt_store(rank: int, world: int, timeout: timedelta) -> dist.Store:
    """The agent's store, under a prefix that names this attempt of the job alone (Note [a
    restarted job's store])."""
    shared = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    if rank == 0:
        token = uuid.uuid4().hex
        shared.set("shardwise/attempt", token)
        hellos = [f"shardwise/{token}/hello/{r}" for r in range(1, world)]
        if hellos:
            _wait(shared, hellos, timeout, "the job's other ranks did not join this attempt")
        for key in hellos:
            shared.set(f"{key}/{shared.get(key).decode()}", "")
        return dist.PrefixStore(f"shardwise/{token}/", shared)
    nonce, deadline = uuid.uuid4().hex, time.monotonic() + timeout.total_seconds()
    while True:
        token = shared.get("shardwise/attempt").decode()
        hello = f"shardwise/{token}/hello/{rank}"
        shared.set(hello, nonce)
        try:
            shared.wait([f"{hello}/{nonce}"], timedelta(seconds=1))
            return dist.PrefixStore(f"shardwise/{token}/", shared)
        except dist.DistStoreError:
            if time.monotonic() > deadline:
                raise ShardwiseError(
                    f"rank {rank}: rank 0 of this attempt did not answer in the job's store at "
                    f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} within {timeout}: "
                    "is rank 0 running? (torchrun starts every rank of an attempt together)"
                ) from None


def _wait(store: dist.Store, keys: list[str], timeout: timedelta, problem: str) -> None:
    try:
        store.wait(keys, timeout)
    except dist.DistStoreError:
        raise ShardwiseError(f"{problem} within {timeout} (the job's store at "
                             f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']})") from None


# Note [exit]: a Gloo collective's work, with the tensors it holds, is often released by the
# backend's worker thread a little after the waiter woke up, and releasing a tensor Python has
# seen takes the GIL. A script that ends right after a collective (plan()'s broadcast, a logged
# all-reduce) without destroy_process_group() can reach interpreter shutdown first: the worker
# thread is then ended while it waits for the GIL, inside a C++ destructor, and the process
# aborts ("terminate called without an active exception", SIGABRT; seen 2 exits in 12 at N=2).
# Destroying the group joins its worker threads while the interpreter still runs, as torch asks
# of every script; init() does it at exit for the group it started, unless the script already
# did, or is ending on an uncaught exception (a peer may be gone, and joining a worker blocked
# on it would hold the exit up to the collective timeout).
def _leave(name: str) -> None:
    failed = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if failed is None and dist.is_initialized() and dist.group.WORLD.group_name == name:
        dist.destroy_process_group()


_timeout_s: float | None = None  # set by init()


def timeout_s() -> float:
    """The collective timeout: the one ``init()`` set; else that of the default group, where
    torch tells it (a group started by ``init_process_group``); else ``DEFAULT_TIMEOUT_S``.
    The groups shardwise makes (shard and replicate groups, host groups) take it too: torch
    would give them its own default of 30 minutes."""
    if _timeout_s is not None:
        return _timeout_s
    try:  # private: not every release or backend tells it
        backend = dist.distributed_c10d._get_default_group()._get_backend(device())
        return backend.options._timeout.total_seconds()
    except Exception:
        return DEFAULT_TIMEOUT_S


_host_groups: dict = {}


def host_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A Gloo group over the ranks of ``group`` (None: the world) for small host-side
    agreements (one per group and process; None for one rank). Its own group, so that its
    collectives never meet the data collectives, and on the host, so that reading its result
    never waits for a GPU (in a fake world, a fake group). Collective: every rank of ``group``
    calls it in the same order."""
    if dist.get_world_size(group) == 1:
        return None
    key = group if group is not None else dist.group.WORLD
    if key not in _host_groups:
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        fake = dist.get_backend() == "fake"
        _host_groups[key] = dist.new_group(
            ranks,
            backend="fake" if fake else "gloo",
            timeout=timedelta(seconds=timeout_s()),
            # (a name from the ranks could be a real group's: Note [a world beside the real one])
            use_local_synchronization=ranks is not None and not fake,
        )
    return _host_groups[key]


def background_group(ranks: list[int] | None = None) -> dist.ProcessGroup:
    """A new Gloo group over ``ranks`` (None: the world) for collectives issued on a thread of
    their own (a background checkpoint save, a weight push), apart from every other group so
    that they never interleave with the training thread's. Collective: every rank calls it, on
    its main thread."""
    return dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=DEFAULT_TIMEOUT_S))


@dataclass(frozen=True)
class Mesh:
    """The ranks one model trains on: parameters are sharded within ``shard`` and, for hybrid
    sharding, replicated across the shard groups, whose same-position ranks form ``replicate``
    (a 2-D mesh of shape (replicate, shard)). ``whole`` spans every rank of the mesh (None: the
    world): values are broadcast and ranks agree over it."""

    shard: dist.ProcessGroup | None
    replicate: dist.ProcessGroup | None = None
    whole: dist.ProcessGroup | None = None

    def in_first_shard_group(self) -> bool:
        """Whether this rank's shard group is the one holding global rank 0 (always, without
        hybrid sharding): the replica that alone writes or gathers what is needed once
        (checkpoint shards, a full state dict for rank 0, a Hugging Face export)."""
        return self.replicate is None or 0 in dist.get_process_group_ranks(self.shard)


_meshes: dict = {}


def mesh_of(group, mesh, *, hybrid: bool, shard_size: int | None) -> Mesh:
    """Check the caller's layout and build the groups it names (collective).

    Hybrid: a ``torch.distributed.device_mesh.DeviceMesh`` of shape (replicate, shard), or the
    world in groups of ``shard_size`` consecutive ranks (default: torchrun's
    LOCAL_WORLD_SIZE, one node). Otherwise ``group`` (or a 1-D ``mesh``; default the world).
    """
    if group is not None and mesh is not None:
        raise ShardwiseError("pass group= or mesh=, not both: a mesh already names its groups")
    if mesh is not None and not hasattr(mesh, "get_group"):
        raise ShardwiseError(f"mesh= takes a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if not hybrid:
        if shard_size is not None:
            raise ShardwiseError(
                f"shard_size={shard_size} is for hybrid sharding: use strategy='hybrid_shard' "
                "(or 'hybrid_shard_grad_op'), or drop shard_size to shard over the whole group."
            )
        if mesh is not None:
            if mesh.ndim != 1:
                raise ShardwiseError(
                    f"a {mesh.ndim}-D mesh {tuple(mesh.shape)} is for hybrid sharding: use "
                    "strategy='hybrid_shard' with a mesh of shape (replicate, shard), or a 1-D mesh."
                )
            group = mesh.get_group()
        return Mesh(group, None, group)
    if mesh is not None:
        if mesh.ndim != 2:
            raise ShardwiseError(
                f"hybrid sharding takes a 2-D mesh of shape (replicate, shard); got a {mesh.ndim}-D "
                f"mesh {tuple(mesh.shape)}: build it with init_device_mesh(device, (replicas, shard_size))."
            )
        if shard_size is not None and shard_size != mesh.shape[1]:
            raise ShardwiseError(f"shard_size={shard_size} contradicts the mesh's shard dimension {mesh.shape[1]}: pass one of them")
        if mesh.mesh.numel() != dist.get_world_size():
            raise ShardwiseError(
                f"the mesh {tuple(mesh.shape)} spans {mesh.mesh.numel()} of the {dist.get_world_size()} "
                "ranks: hybrid sharding takes a mesh over the whole world."
            )
        return Mesh(mesh.get_group(1), mesh.get_group(0) if mesh.shape[0] > 1 else None, None)
    if group is not None:
        raise ShardwiseError("hybrid sharding over a group: pass mesh= (a 2-D DeviceMesh of shape (replicate, shard)) instead of group=")
    world = dist.get_world_size()
    if shard_size is None:
        shard_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if not isinstance(shard_size, int) or shard_size < 1 or world % shard_size:
        raise ShardwiseError(
            f"shard_size={shard_size!r} must divide the world size {world}: the world is split into "
            f"groups of shard_size consecutive ranks (one node each, typically: torchrun's --nproc_per_node)."
        )
    key = (world, shard_size, dist.group.WORLD)
    if key not in _meshes:
        rows = [list(range(r * shard_size, (r + 1) * shard_size)) for r in range(world // shard_size)]
        cols = [list(range(c, world, shard_size)) for c in range(shard_size)]
        timeout = timedelta(seconds=timeout_s())  # (torch's default for new groups: 30 minutes)
        shard_group, _ = dist.new_subgroups_by_enumeration(rows, timeout=timeout, backend=dist.get_backend())
        replicate_group, _ = dist.new_subgroups_by_enumeration(cols, timeout=timeout, backend=dist.get_backend())
        _meshes[key] = Mesh(shard_group, replicate_group if len(rows) > 1 else None, None)
    return _meshes[key]


_stands_for: str | None = None  # the backend torch's "fake" group stands for (Note [fake world])


def stands_for() -> str | None:
    """In the fake world, the backend whose collective paths its "fake" group takes ("gloo" or
    "nccl"); elsewhere None (Note [fake world] in collectives.py)."""
    return _stands_for


@contextlib.contextmanager
def fake_world(world_size: int, backend: str) -> Iterator[None]:
    """A world of ``world_size`` ranks inside this process, which is rank 0, over torch's
    "fake" process group (nothing is sent; torchtitan estimates memory the same way): the
    planner runs the real runtime in it on fake tensors. Its collectives take ``backend``'s
    paths (``stands_for``); the planner counts them apart with ``collectives.apart()`` (Note
    [fake world] in collectives.py). It stands in for this process's own world, if any, which
    is as it was afterwards (Note [a world beside the real one]); the groups made in it go
    with it."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    global _stands_for
    saved = dict(_host_groups), dict(_meshes), _stands_for
    with _world_swapped():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        _stands_for = backend
        try:
            yield
        finally:
            for cache, before in zip((_host_groups, _meshes), saved):
                cache.clear()
                cache.update(before)
            _stands_for = saved[2]


# Note [a world beside the real one]: torch.distributed keeps its groups in one object,
# distributed_c10d._world, which torch names an extension point to override and replaces itself
# for its multi-threaded test groups (testing/_internal/distributed/multi_threaded_pg.py). The
# fake world is made in an empty one swapped in for the duration, so it can be the default
# group (as the runtime, the tracer and the hybrid mesh expect: they use the world) inside a
# training run that has its own; nothing of the run's is touched. Three things live outside
# that object and are put back: the C++ registry of groups by name (the fake groups take names
# no group of the run has, numbers from the run's count on, and are unregistered after; not
# destroy_process_group(), which empties the registry), the C++ global rank, and what
# init_process_group sets on the module and in sys.excepthook. Other threads see the fake world
# while it stands: plan() is not for the middle of a step whose collectives are in flight, nor
# for while a background checkpoint save is under way (wait for its handle first).
class _PrivateWorld(c10d._World):
    """A ``_World`` whose maps and group count are its own (torch's own ``_World`` keeps them in
    module globals, which every instance would share), naming its groups by numbers from
    ``first_name`` on."""

    def __init__(self, first_name: int):
        super().__init__()
        self._count = first_name
        names = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "tags_to_pg", "pg_to_tag")
        self._maps: dict[str, dict] = {k: {} for k in names}

    pg_map = property(lambda self: self._maps["pg_map"])
    pg_names = property(lambda self: self._maps["pg_names"])
    pg_group_ranks = property(lambda self: self._maps["pg_group_ranks"])
    pg_backend_config = property(lambda self: self._maps["pg_backend_config"])
    tags_to_pg = property(lambda self: self._maps["tags_to_pg"])
    pg_to_tag = property(lambda self: self._maps["pg_to_tag"])

    @property
    def group_count(self) -> int:
        return self._count

    @group_count.setter
    def group_count(self, value: int) -> None:
        self._count = value


@contextlib.contextmanager
def _world_swapped() -> Iterator[None]:
    """Inside, torch.distributed sees an empty world of its own (Note [a world beside the real
    one]); afterwards the process's own, as it was."""
    real = c10d._world
    globals_set = ("_default_pg_init_method", "_backend")  # by init_process_group
    module_state = {k: getattr(c10d, k) for k in globals_set if hasattr(c10d, k)}
    hook = sys.excepthook
    c10d._world = private = _PrivateWorld(first_name=real.group_count)
    try:
        yield
    finally:
        c10d._world = real
        for name in private.pg_names.values():
            c10d._unregister_process_group(name)
        c10d._update_default_pg(real.default_pg)  # (the C++ global rank)
        for k, v in module_state.items():
            setattr(c10d, k, v)
        sys.excepthook = hook


def backend(group: dist.ProcessGroup | None = None) -> str:
    """The backend that carries ``group``'s tensors: its name ("gloo", "nccl", "fake"), or for
    a group made with one backend per device ("cpu:gloo,cuda:nccl", which
    ``init_process_group()`` without a backend makes and names "undefined"), the one for the
    device shardwise computes on: CUDA's where there is a GPU, else the CPU's."""
    name = str(dist.get_backend(group))
    if ":" not in name and name != "undefined":
        return name
    per_device = dict(part.split(":") for part in dist.get_backend_config(group).split(","))
    if torch.cuda.is_available() and "cuda" in per_device:
        return per_device["cuda"]
    return per_device.get("cpu", name)


def device() -> torch.device:
    """The device this rank computes on: its local GPU under NCCL, else the CPU."""
    if dist.is_initialized() and backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size (requires an initialised group)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "no process group: call shardwise.init() (or torch.distributed.init_process_group) "
            "before shardwise.shard()"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def launch_local(nproc: int, entry: Callable, *args) -> dict[int, object]:
    """Run ``entry(*args)`` in ``nproc`` local ranks through torch's elastic launcher (the
    engine behind torchrun), rendezvous on a free loopback port; returns each rank's result."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    port = addresses.free_port()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"shardwise-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{port}",
        max_restarts=0,
        monitor_interval=0.5,
    )
    return elastic_launch(config, entry)(*args)
