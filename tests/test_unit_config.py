"""Per-unit settings (``UnitConfig``) applied by ``shard(plan=...)``: a plan that mixes them
trains exactly like one process, and contradictions are refused."""

import dataclasses

import pytest
from nets import TiedTransformer, counted_steps, train_pair

import shardwise
from shardwise.core.policies import Settings, UnitConfig
from shardwise.observer.accounting import theory_bytes_per_step

BLOCK = shardwise.wrap.by_class(TiedTransformer().blocks[0].__class__)
MIXED = Settings(
    strategy="full_shard",
    wrap=BLOCK,
    units=(
        ("blocks.0", UnitConfig(reshard_after_forward=True, checkpoint="full")),
        ("blocks.1", UnitConfig(reshard_after_forward=False, offload=True)),
        ("blocks.2", UnitConfig(reshard_after_forward=True, checkpoint="full", offload=True)),
        ("", UnitConfig(reshard_after_forward=False)),
    ),
)


# activation offload on the root and a block, not on the blocks between (they keep their own)
OFFLOADED = Settings(
    strategy="full_shard",
    wrap=BLOCK,
    units=(
        ("blocks.0", UnitConfig(offload_activations=True)),
        ("blocks.1", UnitConfig(checkpoint="full")),
        ("blocks.2", UnitConfig(reshard_after_forward=False)),
        ("", UnitConfig(offload_activations=True)),
    ),
)


# selective checkpointing (keep the products, recompute the rest) beside full
SELECTIVE = Settings(
    strategy="full_shard",
    wrap=BLOCK,
    units=(
        ("blocks.0", UnitConfig(checkpoint="selective")),
        ("blocks.1", UnitConfig(checkpoint="full")),
        ("blocks.2", UnitConfig(reshard_after_forward=False, checkpoint="selective")),
        ("", UnitConfig(reshard_after_forward=False)),
    ),
)


@pytest.mark.parametrize(
    "settings", [MIXED, OFFLOADED, SELECTIVE], ids=["mixed", "activation_offload", "selective"]
)
@pytest.mark.parametrize("world_size", [1, 2])
def test_mixed_plan_trains_like_one_process(pools, world_size, settings):
    losses, ref_losses, diff, moved = pools(world_size).run(
        train_pair, "tied", None, None, plan=settings
    )[0]
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert a == pytest.approx(b, rel=1e-5), f"step {step}: sharded {a} vs reference {b}"
    assert moved > 0.05 and diff <= 1e-5


def offloaded_bytes(settings) -> tuple[int, int]:
    """Bytes the activation offload copied in one step, and the same with blocks.0 alone."""
    import torch
    from nets import batch, loss_of

    out = []
    for s in (
        settings,
        Settings(
            settings.strategy,
            settings.wrap,
            ((n, UnitConfig(offload_activations=n == "blocks.0")) for n, _ in settings.units),
        ),
    ):
        model = shardwise.shard(
            TiedTransformer(), plan=Settings(s.strategy, s.wrap, tuple(s.units))
        )
        x, y = batch("tied", 0, 2)
        loss_of(model, x, y).backward()
        with torch.no_grad():  # no grad: nothing saved, nothing copied
            model(x)
        out.append(model._shardwise.activations.bytes_out)
    return tuple(out)


def test_activation_offload_copies_what_is_saved(pools):
    both, block = pools(1).run(offloaded_bytes, OFFLOADED)[0]
    assert 0 < block < both  # the root's own activations too, not the blocks' that keep theirs


def applied(settings):
    """What shard(plan=settings) made of each unit: (reshards after forward, recomputes,
    offloads its state)."""
    model = shardwise.shard(TiedTransformer(), plan=settings)
    return {
        u.label: (
            u.reshard_after_forward,
            getattr(u.module, "_shardwise_checkpointed", False),
            u.offloaded,
        )
        for u in shardwise.units(model)
    }


def gathered_bytes(settings, steps=2) -> tuple[int, int]:
    """Gather bytes per step: measured, and in theory (``theory_bytes_per_step``)."""
    model = shardwise.shard(TiedTransformer(), plan=settings)
    measured = counted_steps(model, steps)["all_gather"].bytes // steps
    return measured, theory_bytes_per_step(model, settings.strategy)["within"]


def test_theory_counts_units_kept_gathered(pools):
    # blocks.1 kept gathered from forward to backward: one gather less of its parameters,
    # in theory as measured (the root's gather and padding rows are the same in both runs)
    resharded = dataclasses.replace(
        MIXED, units=tuple((n, dataclasses.replace(c, reshard_after_forward=n != "")) for n, c in MIXED.units)
    )
    (kept, kept_theory), (all_, all_theory) = (pools(2).run(gathered_bytes, s)[0] for s in (MIXED, resharded))
    block = sum(p.numel() for p in TiedTransformer().blocks[1].parameters())
    assert all_ - kept == all_theory - kept_theory == 4 * block // 2 > 0


def test_plan_is_applied_as_it_is(pools):
    units = pools(1).run(applied, MIXED)[0]
    assert units == {
        "blocks.0": (True, True, False),
        "blocks.1": (False, False, True),
        "blocks.2": (True, True, True),
        "<root>": (False, False, False),
    }


def refused(settings, **kwargs):
    with pytest.raises((shardwise.ShardwiseError, TypeError)) as e:
        shardwise.shard(TiedTransformer(), plan=settings, **kwargs)
    return str(e.value)


def test_contradictions_are_refused(pools):
    pool = pools(1)
    assert "strategy='no_shard'" in pool.run(refused, MIXED, strategy="no_shard")[0]
    assert "drop it" in pool.run(refused, MIXED, cpu_offload=True)[0]
    with pytest.raises(shardwise.ShardwiseError, match="choose one"):
        UnitConfig(checkpoint="full", offload_activations=True)
    root_ckpt = Settings(
        "full_shard", BLOCK, MIXED.units[:3] + (("", UnitConfig(checkpoint="full")),)
    )
    assert "root unit" in pool.run(refused, root_ckpt)[0]
    missing = Settings("full_shard", BLOCK, MIXED.units[1:])
    assert "no settings for unit 'blocks.0'" in pool.run(refused, missing)[0]
    extra = Settings("full_shard", BLOCK, MIXED.units + (("head", UnitConfig()),))
    assert "['head']" in pool.run(refused, extra)[0]
    assert "policies.Settings" in pool.run(refused, "fast")[0]
    with pytest.raises(shardwise.ShardwiseError, match="'none', 'selective' or 'full'"):
        UnitConfig(checkpoint="half")


def test_settings_travel_and_compare_by_what_they_select():
    """plan() broadcasts its plan to every rank: settings pickle, wrap policies included (a
    used by_size's cache stays behind), and equal policies make equal settings."""
    import pickle

    sized = shardwise.wrap.by_size(150)
    sized(TiedTransformer(), "")  # fills its cache
    for settings in (MIXED, Settings("full_shard", sized, (("", UnitConfig()),))):
        assert pickle.loads(pickle.dumps(settings)) == settings
    assert shardwise.wrap.by_class(TiedTransformer().blocks[0].__class__) == BLOCK


def test_recomputation_is_typed_and_users_names_still_work():
    import pickle

    from shardwise.core.policies import Recompute

    by_name, by_member = UnitConfig(checkpoint="selective"), UnitConfig(checkpoint=Recompute.SELECTIVE)
    assert by_name == by_member and by_name.checkpoint is Recompute.SELECTIVE
    assert UnitConfig().checkpoint is Recompute.NONE and f"{Recompute.FULL}" == "full"  # prints as its name
    assert pickle.loads(pickle.dumps(by_name)) == by_name
