"""shardwise.rl's pieces that need no engine: the bucket format (packed and decoded back),
a parameter read from gathered rows (``Layout.segments``), a push's gather into its mapped
scratch memory, and the delta mode's change detection. The engine itself runs in
tests/test_rl.py."""

from __future__ import annotations

import math

import pytest
import torch
from nets import make, wrap_policy

import shardwise
from shardwise.core import collectives as C
from shardwise.core.layout import Layout
from shardwise.rl import packing
from shardwise.rl.delta import Shadow
from shardwise.rl.source import Export, Gathered, Scratch


def pack(tensors, bucket_bytes, dtype):
    """Pack ``tensors`` (name -> tensor) densely into buckets of ``bucket_bytes``; return the
    buckets as (bytes, entries), each a copy (the packer reuses its two buffers)."""
    buffers = [torch.zeros(bucket_bytes, dtype=torch.uint8) for _ in range(2)]
    shipped, free = [], [0, 1]

    def acquire():
        i = free.pop(0)
        return packing.Bucket(buffers[i], i)

    def ship(bucket):
        shipped.append((bucket.data[: bucket.used].clone(), list(bucket.entries)))
        free.append(bucket.index)

    packer = packing.Packer(acquire, ship)
    for name, t in tensors.items():
        flat = t.reshape(-1)
        half = flat.numel() // 2  # two segments, as two ranks' rows would come
        packer.dense(name, dtype, tuple(t.shape), [(0, flat[:half]), (half, flat[half:])])
    packer.flush()
    return shipped


def unpack(shipped):
    out = {}
    for data, entries in shipped:
        for p in packing.decode(data, entries):
            flat = out.setdefault(p.name, torch.full((math.prod(p.shape),), float("nan"), dtype=p.dtype))
            flat[p.start : p.start + p.values.numel()] = p.values
            out[p.name] = flat
    return out


def test_dense_tensors_round_trip_across_buckets():
    g = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": torch.randn(s, generator=g) for i, s in enumerate([(7, 5), (300,), (3, 4, 5), ()])}
    shipped = pack(tensors, 512, torch.bfloat16)  # 792 bytes: w1 continues in a second bucket
    assert len(shipped) == 2 and all(any(e["name"] == "w1" for e in entries) for _, entries in shipped)
    got = unpack(shipped)
    for name, t in tensors.items():
        assert torch.equal(got[name].view(t.shape), t.to(torch.bfloat16)), name
    # a tensor's two segments in one bucket are one entry, not two padded apart
    assert sum(e["name"] == "w0" for _, entries in shipped for e in entries) == 1


def test_sparse_patch_round_trips():
    buffers = [torch.zeros(256, dtype=torch.uint8) for _ in range(2)]
    shipped = []
    packer = packing.Packer(lambda: packing.Bucket(buffers[len(shipped) % 2], len(shipped) % 2),
                         lambda b: shipped.append((b.data[: b.used].clone(), list(b.entries))))
    for idx in (torch.arange(0, 120, 3), torch.tensor([1, 2, 400, 401, 9000, 70000])):
        shipped.clear()
        vals = torch.linspace(-1, 1, idx.numel()).to(torch.bfloat16)
        packer.sparse("w", torch.bfloat16, (300, 300), idx, vals)
        packer.flush()
        pieces = [p for data, entries in shipped for p in packing.decode(data, entries)]
        assert torch.equal(torch.cat([p.indices for p in pieces]), idx)
        assert torch.equal(torch.cat([p.values for p in pieces]), vals)
    # gaps of 3 go as one byte each; 100 changes (300 bytes) need more than a 256-byte bucket
    shipped.clear()
    packer.sparse("w", torch.bfloat16, (10, 30), torch.arange(0, 300, 3), torch.ones(100, dtype=torch.bfloat16))
    packer.flush()
    assert len(shipped) > 1 and {e["gap_dtype"] for _, es in shipped for e in es} == {"uint8"}


def test_decode_rejects_entries_outside_the_bucket_or_the_shape():
    data = torch.zeros(64, dtype=torch.uint8)
    bad = [
        {"name": "w", "dtype": "float32", "shape": [4], "kind": "dense", "start": 0, "count": 32, "offset": 0},
        {"name": "w", "dtype": "float32", "shape": [4], "kind": "dense", "start": 2, "count": 4, "offset": 0},
        {"name": "w", "dtype": "nonsense", "shape": [4], "kind": "dense", "start": 0, "count": 1, "offset": 0},
    ]
    for entry in bad:
        try:
            packing.decode(data, [entry])
        except ValueError as e:  # named
            assert "'w'" in str(e) or "nonsense" in str(e)
        else:
            raise AssertionError(f"accepted {entry}")


def test_segments_of_gathered_rows_are_the_parameters():
    """Rows placement (padded last rank) and an owned parameter, read from every rank's flat
    shard without unpacking the unit."""
    shapes = [(5, 3), (4,), (2, 2)]
    full = [torch.arange(math.prod(s), dtype=torch.float32).view(s) + 100 * i for i, s in enumerate(shapes)]
    layout = Layout.build([(f"p{i}", s) for i, s in enumerate(shapes)], 3, owners=[None, None, 1])
    rows = [torch.empty(layout.sizes[r]) for r in range(3)]
    layout.pack(full, rows)
    for i, t in enumerate(full):
        out = torch.full((t.numel(),), float("nan"))
        for start, seg in layout.segments(rows, i):
            out[start : start + seg.numel()] = seg
        assert torch.equal(out.view(t.shape), t)


def gather_every_unit(placement):
    """Every sharded unit gathered into one ``Scratch`` (reused unit after unit), in bf16 and
    in the master dtype, against the parameters before sharding: as the units are (``Live``)
    and from the copy a push beside training takes (``Frozen``, over its own groups), which
    keeps the values of when it was taken while the shards change; then an ``into`` that does
    not hold the shard is refused on every rank before anything is sent."""
    from shardwise.core.runtime import runtime_of
    from shardwise.core.unit import ShardedUnit
    from shardwise.rl.source import Frozen, Live, PushGroups

    model = make("tied")
    before = {k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)}
    shardwise.shard(model, wrap=wrap_policy("by_class", "tied"), placement=placement)
    rt = runtime_of(model)
    sharded = [i for i, u in enumerate(rt.units) if isinstance(u, ShardedUnit)]
    push_groups = PushGroups.create(rt)
    scratch, checked = Scratch(), 0
    for dtype in (torch.bfloat16, torch.float32):
        by_unit = [(i, [Export(s.name, dtype, s.shape, i, k) for k, s in enumerate(rt.units[i].layout.slots)])
                   for i in sharded]
        frozen = Frozen(rt, by_unit, push_groups)
        with torch.no_grad():
            for i in sharded:
                rt.units[i].flat_shard.add_(1.0)  # as an optimizer step would, after the copy
        for i, exps in by_unit:
            for view, shift in ((Live(rt), 1.0), (frozen, 0.0)):
                gathered = Gathered(view, i, exps, scratch)
                for k, slot in enumerate(rt.units[i].layout.slots):
                    assert torch.equal(gathered.full(k), (before[slot.name] + shift).to(dtype)), slot.name
                    checked += 1
        for k in before:
            before[k] += 1.0
    unit = rt.units[sharded[0]]
    wrong = torch.empty(sum(unit.layout.sizes), dtype=unit.flat_shard.dtype)
    with pytest.raises(ValueError, match="with the shard at element"):
        C.all_gather(unit.flat_shard, unit.group, "test", unit.channel, unit.layout.sizes, into=wrong)
    return checked


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.parametrize("placement", [None, shardwise.placement.matrices], ids=["rows", "owned"])
def test_gather_into_scratch_is_the_parameters(pool, placement):
    checked = pool.run(gather_every_unit, placement)
    assert checked[0] == checked[-1] > 0


def test_shadow_sends_steps_values_or_rows():
    """What changed since the last push: the steps a value moved where it moved a few, its new
    value where it moved far (here: across zero), the rows where that is no smaller; applied
    to what was sent before, the patches give the new rows bit for bit."""
    shadow = Shadow()
    rows = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    shadow.store(0, rows, torch.bfloat16)
    sent = rows.reshape(-1).to(torch.bfloat16).clone()
    assert shadow.patch(0, 32, rows, torch.bfloat16) == []  # nothing changed
    moved = rows.clone()
    moved[3, 5] *= 1.01  # a few steps
    moved[6, 0] = -moved[6, 0]  # across zero: far
    patches = shadow.patch(0, 32, moved, torch.bfloat16)
    steps, values = sorted(patches, key=lambda p: not p.steps)
    assert steps.steps and steps.indices.tolist() == [32 + 3 * 16 + 5] and steps.values.dtype == torch.int8
    assert 0 < abs(int(steps.values[0])) < 128
    assert not values.steps and values.indices.tolist() == [32 + 6 * 16]
    bits = sent.view(torch.int16)  # as the engine applies them
    bits[steps.indices - 32] += steps.values.to(torch.int16)
    sent[values.indices - 32] = values.values
    assert torch.equal(sent, moved.reshape(-1).to(torch.bfloat16))
    assert shadow.patch(0, 32, moved, torch.bfloat16) == []  # remembered
    (p,) = shadow.patch(0, 32, moved + 1.0, torch.bfloat16)  # everything: the rows are smaller
    assert p.indices is None and p.first == 32 and torch.equal(p.values, (moved + 1.0).reshape(-1).to(torch.bfloat16))


def test_steps_round_trip_through_a_bucket():
    buffers = [torch.zeros(1024, dtype=torch.uint8) for _ in range(2)]
    shipped = []
    packer = packing.Packer(lambda: packing.Bucket(buffers[0], 0), lambda b: shipped.append((b.data[: b.used].clone(), list(b.entries))))
    idx, steps = torch.tensor([3, 7, 300]), torch.tensor([1, -2, 127], dtype=torch.int8)
    packer.sparse("w", torch.bfloat16, (20, 20), idx, steps, steps=True)
    packer.flush()
    (piece,) = [p for data, entries in shipped for p in packing.decode(data, entries)]
    assert piece.steps and torch.equal(piece.indices, idx) and torch.equal(piece.values, steps)


def test_import_shardwise_does_not_import_vllm():
    import subprocess
    import sys

    code = "import sys, shardwise, shardwise.rl; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_transports_are_registered_objects_and_shm_reaches_the_reader():
    """One registry of transports by name; shared memory: what rank 0 writes into a staging
    buffer is what the engine's reader receives, with the update call made once per bucket."""
    from types import SimpleNamespace

    from shardwise.rl.transport import TRANSPORTS, transport

    assert set(TRANSPORTS) == {"shm", "tcp", "nccl", "ipc"}
    assert [n for n, t in TRANSPORTS.items() if t.delta] == ["shm", "tcp"]
    with pytest.raises(ValueError, match=r"unknown transport 'udp': one of \['ipc', 'nccl', 'shm', 'tcp'\]"):
        transport("udp")
    shm = transport("shm")
    writer = shm.writer(SimpleNamespace(bucket_bytes=1 << 16))
    try:
        reader = shm.reader(SimpleNamespace(**writer.init_info()), rank=1)
        writer.connected()  # the files are gone, the mappings stay
        data = torch.arange(100, dtype=torch.uint8)
        writer.buffers[1][:100].copy_(data)
        calls = []
        writer.deliver(lambda: calls.append(reader.receive(1, 100).clone()), 1, 100)
        assert len(calls) == 1 and torch.equal(calls[0], data)
    finally:
        writer.close()


class FakeLLM:
    """An in-process engine as ``VLLMSync``'s handshake sees it: it reports ``dtype``,
    records the tensors the trainer declares, then refuses (nothing further is needed)."""

    def __init__(self, dtype):
        from types import SimpleNamespace as NS

        config = NS(model_config=NS(dtype=dtype), parallel_config=NS(world_size_across_dp=1))
        self.llm_engine = NS(vllm_config=config)
        self.declared: list = []

    def init_weight_transfer_engine(self, request) -> None:
        self.declared += request["init_info"]["tensors"]
        raise RuntimeError("a fake engine stops here")


def handshake_with(engine_dtype, dtype):
    """What a rank sees building ``VLLMSync`` against a fake engine holding ``engine_dtype``:
    (the error's type and message, the wire dtypes declared to the engine by rank 0)."""
    import torch.distributed as dist

    import shardwise.rl

    model = make("tied")
    shardwise.shard(model, wrap=wrap_policy("by_class", "tied"))
    engine = FakeLLM(engine_dtype) if dist.get_rank() == 0 else None
    try:
        shardwise.rl.VLLMSync(model, engine, dtype=dtype)
    except Exception as e:
        return type(e).__name__, str(e), sorted({d for _, d, _ in engine.declared}) if engine else None
    raise AssertionError("the fake engine accepted the handshake")


@pytest.mark.parametrize(
    "engine_dtype, dtype, wire_dtypes",
    [(torch.bfloat16, None, ["bfloat16"]), (torch.float32, None, ["float32"]), ("float32", None, ["float32"]),
     (torch.float32, torch.bfloat16, ["bfloat16"]), ("mystery", torch.float16, ["float16"])],
)
def test_the_wire_dtype_is_the_engines_unless_given(pool, engine_dtype, dtype, wire_dtypes):
    """Every floating-point tensor is declared at the handshake in the engine's dtype by
    default (bf16 into a bf16 engine, fp32 into an fp32 one), in ``dtype`` when given (then
    whatever the engine reports does not matter)."""
    pytest.importorskip("vllm", reason='needs the vllm extra: pip install -e ".[vllm]"')
    pool.run(import_trainer_side)
    results = pool.run(handshake_with, engine_dtype, dtype)
    assert all(r[0] == "EngineError" and "a fake engine stops here" in r[1] for r in results), results
    assert results[0][2] == wire_dtypes


@pytest.mark.parametrize("engine_dtype", ["mystery", torch.float8_e4m3fn])
def test_an_engine_dtype_shardwise_does_not_send_asks_for_dtype(pool, engine_dtype):
    """An engine reporting a dtype shardwise does not know (or cannot send in) is refused on
    every rank before anything moves, naming the dtype and the fix."""
    pytest.importorskip("vllm", reason='needs the vllm extra: pip install -e ".[vllm]"')
    pool.run(import_trainer_side)
    results = pool.run(handshake_with, engine_dtype, None)
    name = str(engine_dtype).removeprefix("torch.")
    for kind, message, declared in results:
        assert kind == "ShardwiseError", message
        assert f"holds its weights in '{name}'" in message and "dtype=torch.bfloat16" in message
        assert not declared  # nothing reached the engine


def build_with_a_mistake_on_rank_1(mistake: str):
    """(error type, message) on each rank building ``VLLMSync`` where rank 1 alone got an
    argument wrong."""
    import torch.distributed as dist

    import shardwise.rl

    model = make("tied")
    shardwise.shard(model, wrap=wrap_policy("by_class", "tied"))
    rank = dist.get_rank()
    engine = FakeLLM(torch.float32) if rank == 0 or mistake == "engine" else None
    bucket_bytes = 1024 if rank == 1 and mistake == "bucket_bytes" else 64 << 20
    try:
        shardwise.rl.VLLMSync(model, engine, bucket_bytes=bucket_bytes)
    except Exception as e:
        return type(e).__name__, str(e)
    raise AssertionError("VLLMSync took the arguments")


@pytest.mark.parametrize("mistake, problem", [
    ("engine", "rank 1 passed engine=FakeLLM: rank 0 passes the vllm.LLM"),
    ("bucket_bytes", "bucket_bytes=1024: give at least 64 KiB"),
])
def test_a_mistake_on_one_rank_raises_on_every_rank(pool, mistake, problem):
    """An argument wrong on one rank only raises the same error on every rank at once, not on
    that rank alone while the others wait in the handshake's collectives."""
    pytest.importorskip("vllm", reason='needs the vllm extra: pip install -e ".[vllm]"')
    pool.run(import_trainer_side)
    results = pool.run(build_with_a_mistake_on_rank_1, mistake)
    assert [kind for kind, _ in results] == ["ShardwiseError"] * 2, results
    assert all(message.startswith(problem) for _, message in results), results


class RecordingEngine:
    """An engine's control plane that keeps what it is sent: it maps the shared-memory
    buffers at the handshake and decodes every bucket into whole tensors; ``fail_at``: the
    update call (counted from 1) that raises."""

    def __init__(self, fail_at: int = 0):
        self.fail_at, self.calls, self.events = fail_at, 0, []
        self.tensors: dict[str, torch.Tensor] = {}
        self.reader = None

    def init_weight_transfer_engine(self, payload) -> None:
        from shardwise.rl.transport import ShmReader

        self.reader = ShmReader(payload["paths"])

    def start_weight_update(self, pause: bool = True) -> None:
        self.events.append("start")

    def update_weights(self, update) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("this engine fails")
        data = self.reader.receive(update["bucket"], update["nbytes"])
        for p in packing.decode(data, update["entries"]):
            flat = self.tensors.setdefault(p.name, torch.full((math.prod(p.shape),), float("nan"), dtype=p.dtype))
            flat[p.start : p.start + p.values.numel()] = p.values

    def finish_weight_update(self, version, pause: bool = False) -> None:
        self.events.append(f"finish {version}")

    def abort(self, version, resume) -> None:
        self.events.append("abort")


def push_to_two_engines(fail_at: int):
    """Ranks 0 and 1 each feed a recording engine (shm) in one push of a sharded model: what
    each engine got, its calls, the error each rank raised, and the model's state dict."""
    import torch.distributed as dist

    from shardwise.rl.clients import EngineError
    from shardwise.rl.sender import Feed, ShardwiseSource, ShardwiseTrainerInitInfo
    from shardwise.rl.sender import ShardwiseTrainerWeightTransferEngine as Trainer

    model = make("tied", seed=3)
    shardwise.shard(model, wrap=wrap_policy("by_class", "tied"))
    rank = dist.get_rank()
    engine = RecordingEngine(fail_at if rank == 1 else 0)
    info = ShardwiseTrainerInitInfo(rank=rank, transport="shm", bucket_bytes=1 << 16, workers=(1,), feeders=2)
    feeds = [Feed(engine, label=f"engine {rank}: ")] if rank < 2 else []
    trainer = Trainer.trainer_init(info, client=feeds, source=ShardwiseSource(model, torch.float32))
    error = ""
    try:
        trainer.send_weights(version=1)
    except EngineError as e:
        error = str(e)
    trainer.shutdown()
    state = shardwise.full_state_dict(model)
    return {"tensors": engine.tensors, "events": engine.events, "error": error, "state": state}


def import_trainer_side() -> None:
    """vLLM's trainer side, imported in a task of its own (tens of seconds on a busy machine)."""
    import shardwise.rl.sender  # noqa: F401


def test_two_engines_each_get_the_whole_model_from_their_own_rank(pool):
    """Rank 1 packs its engine's buckets from the rows it gathers, as rank 0 does: both
    engines receive every tensor of the model, exactly, and both commit the version."""
    pytest.importorskip("vllm", reason='needs the vllm extra: pip install -e ".[vllm]"')
    pool.run(import_trainer_side)
    results = pool.run(push_to_two_engines, 0)
    state = results[0]["state"]
    for r in results:
        assert r["error"] == "" and r["events"] == ["start", "finish 1"], r["events"]
        assert set(r["tensors"]) == set(state) - {"head.weight"}  # tied: sent once, as the embedding
        for name, flat in r["tensors"].items():
            assert torch.equal(flat.view(state[name].shape), state[name]), name


def test_one_engine_failing_aborts_every_engine(pool):
    """The second engine fails on its update (after the first engine has taken the model):
    neither engine commits (the first is aborted too), and every rank raises EngineError
    naming the engine that failed."""
    pytest.importorskip("vllm", reason='needs the vllm extra: pip install -e ".[vllm]"')
    pool.run(import_trainer_side)
    results = pool.run(push_to_two_engines, 1)
    assert results[0]["events"] == ["start", "abort"] and results[1]["events"] == ["start", "abort"]
    for r in results:
        assert r["error"].startswith("push of version 1 failed"), r["error"]
        assert "engine 1: RuntimeError: this engine fails" in r["error"]
        assert "engine 0: another engine's update failed" in r["error"]
