"""Layout bookkeeping, without any process group."""

import pytest
import torch

from shardwise.layout import Layout

SHAPES = [("w", (7, 3)), ("b", (7,)), ("s", ()), ("one", (1,)), ("few", (2, 5))]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_partition_every_parameter(world):
    lay = Layout.build(SHAPES, world)
    for slot in lay.slots:
        rows = [slot.row_range(r) for r in range(world)]
        assert rows[0][0] == 0 and rows[-1][1] == slot.rows
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))  # contiguous, disjoint
        assert slot.rows_per_rank == -(-slot.rows // world)
    # per-rank shard is 1/N of the model plus padding, never more
    padding = sum(s.rows_per_rank * world * s.row_numel - s.numel for s in lay.slots)
    assert lay.shard_numel * world == lay.numel + padding


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_pack_gather_unpack_round_trip(world):
    lay = Layout.build(SHAPES, world)
    full = [torch.randn(shape) for _, shape in SHAPES]
    packed = torch.full((world, lay.shard_numel), float("nan"))  # pack must write every element
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


def test_subset_keeps_shapes_and_recomputes_offsets():
    lay = Layout.build(SHAPES, 3)
    sub = lay.subset([True, False, True, False, True])
    assert [s.name for s in sub.slots] == ["w", "s", "few"]
    assert [s.offset for s in sub.slots] == [0, 9, 10]
    assert sub.shard_numel == 9 + 1 + 5


def test_padding_rows_are_zero():
    lay = Layout.build([("p", (5, 2))], 4)  # 2 rows per rank; rank 2 has 1, rank 3 none
    packed = torch.full((4, lay.shard_numel), float("nan"))
    lay.pack([torch.ones(5, 2)], list(packed))
    assert packed.sum().item() == 10
    assert lay.slots[0].local_shape(3) == (0, 2)
    assert torch.equal(packed[3], torch.zeros(4))
