"""Layout bookkeeping, without any process group."""

import itertools

import pytest
import torch

from shardwise.core.layout import Layout

SHAPES = [("w", (7, 3)), ("b", (7,)), ("s", ()), ("one", (1,)), ("few", (2, 5))]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_partition_every_parameter(world):
    lay = Layout.build(SHAPES, world)
    for slot in lay.slots:
        rows = [slot.row_range(r) for r in range(world)]
        assert rows[0][0] == 0 and rows[-1][1] == slot.rows
        assert all(a[1] == b[0] for a, b in itertools.pairwise(rows))  # contiguous, disjoint
        assert slot.rows_per_rank == -(-slot.rows // world)
    # per-rank shard is 1/N of the model plus padding, never more
    padding = sum(s.rows_per_rank * world * s.row_numel - s.numel for s in lay.slots)
    assert lay.uniform and set(lay.sizes) == {lay.sizes[0]}
    assert lay.sizes[0] * world == lay.numel + padding


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_pack_gather_unpack_round_trip(world):
    lay = Layout.build(SHAPES, world)
    full = [torch.randn(shape) for _, shape in SHAPES]
    packed = torch.full((world, lay.sizes[0]), float("nan"))  # pack must write every element
    lay.pack(full, list(packed))  # row r is rank r's flat shard
    for r in range(world):
        for slot, view, t in zip(lay.slots, lay.shard_views(packed[r], r), full):
            start, stop = slot.row_range(r)
            assert view.shape == slot.local_shape(r)
            assert torch.equal(view.reshape(-1), t.reshape(slot.rows, -1)[start:stop].reshape(-1))
    # a gather yields every rank's row: unpack must rebuild every parameter exactly
    for rows in (list(packed), packed):  # Gloo's rows, or NCCL's one rank-major tensor
        flat_full = torch.full((lay.unsharded_numel,), float("nan"))
        lay.unpack(rows, flat_full)
        for v, t in zip(lay.unsharded_views(flat_full), full):
            assert v.shape == t.shape and torch.equal(v, t)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_pack_into_one_rank_major_tensor_equals_rank_by_rank(world):
    """NCCL's rows are one rank-major tensor, packed slot by slot: the same bytes as packing
    rank by rank (casts, zero padding and ranks holding none of a parameter included)."""
    shapes = [*SHAPES, ("tall", (9, 2)), ("wide", (3, 16))]
    lay = Layout.build(shapes, world)
    full = [torch.randn(shape) for _, shape in shapes]
    for dtype in (torch.float32, torch.bfloat16):
        by_rank = torch.full((world, lay.sizes[0]), float("nan"), dtype=dtype)
        lay.pack(full, list(by_rank))
        whole = torch.full((world, lay.sizes[0]), float("nan"), dtype=dtype)
        lay.pack(full, list(whole), whole)
        assert torch.equal(whole, by_rank), (world, dtype)


def test_subset_keeps_shapes_and_recomputes_offsets():
    lay = Layout.build(SHAPES, 3)
    sub = lay.subset([True, False, True, False, True])
    assert [s.name for s in sub.slots] == ["w", "s", "few"]
    assert [s.offsets for s in sub.slots] == [(0, 0, 0), (9, 9, 9), (10, 10, 10)]
    assert sub.sizes == (9 + 1 + 5,) * 3


def test_padding_rows_are_zero():
    lay = Layout.build([("p", (5, 2))], 4)  # 2 rows per rank; rank 2 has 1, rank 3 none
    packed = torch.full((4, lay.sizes[0]), float("nan"))
    lay.pack([torch.ones(5, 2)], list(packed))
    assert packed.sum().item() == 10
    assert lay.slots[0].local_shape(3) == (0, 2)
    assert torch.equal(packed[3], torch.zeros(4))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_owned_parameters_round_trip(world):
    # "w" and "few" owned whole by ranks 0 and 1 (mod world), the rest in rows
    owners = [0, None, None, None, 1 % world]
    lay = Layout.build(SHAPES, world, owners)
    full = [torch.randn(shape) for _, shape in SHAPES]
    rows = [torch.full((n,), float("nan")) for n in lay.sizes]
    lay.pack(full, rows)
    for r in range(world):
        for slot, view, t in zip(lay.slots, lay.shard_views(rows[r], r), full):
            held = slot.numel if slot.owner == r else 0 if slot.owned else None
            if held is not None:  # an owned parameter: whole on its owner, nothing elsewhere
                assert view.numel() == held
            start, stop = slot.row_range(r)
            assert torch.equal(view.reshape(-1), t.reshape(slot.rows, -1)[start:stop].reshape(-1))
    rows_only = Layout.build(SHAPES, world)
    assert sum(lay.sizes) == sum(rows_only.sizes) - sum(  # owned: no padding rows
        world * s.rows_per_rank * s.row_numel - s.numel for s, o in zip(rows_only.slots, owners) if o is not None
    )
    # Gloo's ragged rows, and NCCL's rank-major tensor padded to the largest rank's size
    padded = torch.zeros(world, max(lay.sizes))
    for r, row in enumerate(rows):
        padded[r, : row.numel()] = row
    for gathered in (rows, padded):
        flat_full = torch.full((lay.unsharded_numel,), float("nan"))
        lay.unpack(gathered, flat_full)
        for v, t in zip(lay.unsharded_views(flat_full), full):
            assert torch.equal(v, t)
    sub = lay.subset([True, False, True, False, True])
    assert [s.owner for s in sub.slots] == [0, None, 1 % world]
    assert sub.sizes[0] == rows[0].numel() - lay.slots[1].numel_on(0) - lay.slots[3].numel_on(0)
