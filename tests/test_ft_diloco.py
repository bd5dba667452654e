"""DiLoCo across replica groups (shardwise.ft.Torchft.diloco): two real torchrun jobs of 2
ranks each (full_shard inside each), on a lighthouse in this process, each reading its own
batches, take 3 rounds of 3 inner AdamW steps. With fp32 pseudo-gradients both jobs end with
the same parameters, within 1e-5 of one process that runs each group's inner steps on an
unsharded copy of the model and the same outer Nesterov step on the groups' averaged
pseudo-gradient (shard index r of each job exchanges only its shard). With top-k + 2-bit
messages and error feedback (one round) they end bitwise equal to each other, having moved
the elements the messages carried, and the residual and outer optimizer state of each rank come
back from a shardwise checkpoint. Hybrid sharding inside the jobs equals the one process too,
bf16 and fp16 mixed precision within their rounding; streaming DiLoCo with int8 messages
checkpointed and resumed in new jobs ends bitwise where a run in one go does. Error feedback itself (what a message drops is sent later: the
sum over rounds converges) and the top-k message are tested on one process. This file's main
is one rank of a job.

Skips, naming the extra, where torchft is not installed."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("RUST_LOG", "warn")
pytest.importorskip("torchft", reason="fault tolerance needs torchft: pip install -e '.[ft]'")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_ft import jobs, lighthouse, wait_for  # noqa: F401 (fixtures)

H, ROUNDS, LR, OUTER = 3, 3, 1e-2, {"lr": 0.7, "momentum": 0.9, "nesterov": True}


def test_diloco_of_two_sharded_jobs_equals_one_process_of_the_same_rounds(jobs, lighthouse):  # noqa: F811
    jobs.lighthouse = lighthouse
    procs = [jobs.start(g, restarts=0, script=__file__, steps=H * ROUNDS) for g in (0, 1)]
    assert [jobs.wait(p, 240) for p in procs] == [0, 0], jobs.logs()
    got = [torch.load(jobs.out / f"g{g}-full.pt") for g in (0, 1)]
    (ref, _), moved, _ = reference()
    assert moved > 0.05, moved  # (training moved the parameters)
    for g in (0, 1):
        assert got[g]["step"] == H * ROUNDS
        assert ref.keys() <= got[g]["params"].keys()  # (and the tied head.weight)
        diff = max((got[g]["params"][n] - ref[n]).abs().max().item() for n in ref)
        assert diff <= 1e-5, f"group {g} differs from one process by {diff}"
    for n in ref:  # (the groups hold the same global parameters)
        assert torch.allclose(got[0]["params"][n], got[1]["params"][n], rtol=0, atol=1e-6), n


@pytest.mark.parametrize("delay", [0, 1])
def test_streaming_diloco_of_two_sharded_jobs_equals_one_process_of_the_same_fragment_syncs(jobs, lighthouse, delay):  # noqa: F811
    """Two fragments, a round of 4 inner steps (a fragment sync every 2), 2 rounds: each
    group's parameters (its fragments synced at different steps) equal one process's."""
    jobs.lighthouse = lighthouse
    cfg = {"steps": 8, "h": 4, "fragments": 2, "delay": delay}
    procs = [jobs.start(g, restarts=0, script=__file__, **cfg) for g in (0, 1)]
    assert [jobs.wait(p, 240) for p in procs] == [0, 0], jobs.logs()
    got = [torch.load(jobs.out / f"g{g}-full.pt") for g in (0, 1)]
    refs, moved, pieces = reference(h=4, rounds=2, fragments=2, delay=delay)
    assert moved > 0.05, moved
    assert got[0]["pieces"] == pieces and all(pieces), got[0]["pieces"]  # (the same split, in whole parameters)
    for g in (0, 1):
        assert got[g]["step"] == 8
        diff = max((got[g]["params"][n] - refs[g][n]).abs().max().item() for n in refs[g])
        assert diff <= 1e-5, f"group {g} differs from one process by {diff}"
    # the fragment synced 2 steps before the end differs between the groups; the last one does
    # not where it replaced the local parameters (delay 0)
    last, earlier = pieces[-1], pieces[0]
    assert any(not torch.allclose(got[0]["params"][n], got[1]["params"][n]) for n in earlier)
    assert all(torch.allclose(got[0]["params"][n], got[1]["params"][n], rtol=0, atol=1e-6) for n in last) == (delay == 0)


@pytest.mark.parametrize(
    ("variant", "rtol"),
    [
        ({"strategy": "hybrid_shard", "shard_size": 1}, 1e-5),  # (each rank a whole copy; one replica talks to torchft)
        ({"mixed_precision": "bf16"}, 0.05),  # (bf16 forward and backward: AdamW's steps differ from fp32's by rounding)
        ({"mixed_precision": "fp16"}, 0.02),  # (with shardwise's GradScaler)
    ],
    ids=["hybrid", "bf16", "fp16"],
)
def test_diloco_under_hybrid_sharding_and_mixed_precision_equals_one_process(jobs, lighthouse, variant, rtol):  # noqa: F811
    """The same 3 rounds as the first test, with the jobs' strategy or precision changed: how
    far each group's parameters are from one process's fp32 ones, over how far those moved
    (the norms over the whole model), is within ``rtol``: hybrid sharding exactly one
    process's; bf16 and fp16 within their rounding (a wrong pseudo-gradient or outer step
    is off by the order of the motion itself)."""
    from nets import make

    jobs.lighthouse = lighthouse
    procs = [jobs.start(g, restarts=0, script=__file__, steps=H * ROUNDS, **variant) for g in (0, 1)]
    assert [jobs.wait(p, 240) for p in procs] == [0, 0], jobs.logs()
    got = [torch.load(jobs.out / f"g{g}-full.pt") for g in (0, 1)]
    (ref, _), _, _ = reference()
    start = {n: p.detach() for n, p in make("tied").named_parameters()}
    moved = sum(((ref[n] - start[n]) ** 2).sum() for n in ref).sqrt().item()
    for g in (0, 1):
        assert got[g]["step"] == H * ROUNDS
        off = sum(((got[g]["params"][n].float() - ref[n]) ** 2).sum() for n in ref).sqrt().item()
        assert off <= rtol * moved, f"group {g} is {off} from one process, which moved {moved}"
    for n in ref:  # (the groups hold the same global parameters)
        assert torch.equal(got[0]["params"][n], got[1]["params"][n]), n


def test_streaming_diloco_with_int8_messages_resumes_from_a_checkpoint_as_if_never_stopped(jobs, lighthouse):  # noqa: F811
    """Two fragments (a sync every 2 of a round's 4 steps, issued 1 step early), int8
    pseudo-gradients with error feedback: 8 steps in one go stay near one process's fp32
    fragment syncs (int8's error), and 4 steps, a checkpoint (model, both optimizers: the
    global parameters and residuals in the outer one's state, torchft's count), then 4 more
    steps in new jobs end bitwise where the run in one go does."""
    jobs.lighthouse = lighthouse
    cfg = {"h": 4, "fragments": 2, "delay": 1, "comm": "int8"}
    runs = [{"steps": 8}, {"steps": 4, "save": True}, {"steps": 8, "resume": True}]
    got = []
    for run in runs:
        procs = [jobs.start(g, restarts=0, script=__file__, **cfg, **run) for g in (0, 1)]
        assert [jobs.wait(p, 240) for p in procs] == [0, 0], jobs.logs()
        got.append([torch.load(jobs.out / f"g{g}-full.pt") for g in (0, 1)])
    whole, resumed = got[0], got[2]
    refs, moved, _ = reference(h=4, rounds=2, fragments=2, delay=1)
    assert moved > 0.05, moved
    for g in (0, 1):
        assert whole[g]["step"] == resumed[g]["step"] == 8 and got[1][g]["step"] == 4
        diff = max((whole[g]["params"][n] - refs[g][n]).abs().max().item() for n in refs[g])
        assert diff <= moved / 20, f"group {g} differs from one process's fp32 syncs by {diff} (moved {moved})"
        for n, v in whole[g]["params"].items():
            assert torch.equal(v, resumed[g]["params"][n]), f"group {g}'s {n} differs after resuming"


def test_diloco_of_jobs_of_2_and_4_ranks_sharding_within_2_equals_one_process_weighting_by_ranks(jobs, lighthouse):  # noqa: F811
    """Hybrid sharding over 2 ranks in both jobs, one of 2 ranks (one replica) and one of 4
    (two replicas, whose second follows its first: Note [jobs of different sizes]): each
    group's parameters equal one process's whose average weighs each group's
    pseudo-gradient by its ranks (its tokens), 1:2."""
    jobs.lighthouse = lighthouse
    variant = {"strategy": "hybrid_shard", "shard_size": 2, "steps": H * ROUNDS}
    procs = [jobs.start(g, nproc=n, restarts=0, script=__file__, **variant) for g, n in ((0, 2), (1, 4))]
    assert [jobs.wait(p, 300) for p in procs] == [0, 0], jobs.logs()
    got = [torch.load(jobs.out / f"g{g}-full.pt") for g in (0, 1)]
    refs, moved, _ = reference(ranks=(2, 4))
    (unweighted, _), _, _ = reference()
    assert moved > 0.05, moved
    for g in (0, 1):
        assert got[g]["step"] == H * ROUNDS
        diff = max((got[g]["params"][n] - refs[g][n]).abs().max().item() for n in refs[g])
        assert diff <= 1e-5, f"group {g} differs from one process by {diff}"
    # (the weights matter: an equal average of the same groups is far off)
    assert max((refs[0][n] - unweighted[n]).abs().max().item() for n in unweighted) > 100 * 1e-5


def test_diloco_job_sharding_over_other_ranks_is_refused_naming_the_fix_while_the_other_goes_on(jobs, lighthouse):  # noqa: F811
    """A job of 2 ranks trains (full_shard); a job of 1 rank (full_shard too) joins: its shards
    are not the others' rows, so no pseudo-gradient could be averaged row for row. It ends at
    its first quorum with CannotHeal naming the difference and the fix (hybrid sharding within
    a node); the first job goes on and ends its run normally, none hangs."""
    jobs.lighthouse = lighthouse
    cfg = {"steps": H, "min_replicas": 1, "timeout": 5, "pause": 0.1, "until": "g1-ended"}
    a = jobs.start(0, nproc=2, restarts=0, script=__file__, **cfg)
    wait_for(jobs, lambda: (jobs.out / "g0-step").exists() and int((jobs.out / "g0-step").read_text()) >= H, [a])
    b = jobs.start(1, nproc=1, restarts=0, script=__file__, **{**cfg, "min_replicas": 2})
    assert jobs.wait(b, 120) != 0, jobs.logs()
    (jobs.out / "g1-ended").touch()
    assert jobs.wait(a, 120) == 0, jobs.logs()
    log = (jobs.out / "g1.log").read_text()
    for says in ("CannotHeal", "its group runs 2 as ranks, this group 1", "hybrid sharding over the same shard size"):
        assert says in log, log[-3000:]
    assert torch.load(jobs.out / "g0-full.pt")["step"] >= H and not (jobs.out / "g1-full.pt").exists()


@pytest.mark.parametrize(
    ("pieces", "h", "fragments", "delay", "says"),
    [
        (4, 4, 5, 0, "fragments <= 4"),
        (4, 4, 0, 0, "an int >= 1"),
        (4, 6, 4, 0, "multiple of fragments"),
        (4, 4, 2, 2, "[0, sync_every / fragments = 2)"),
        (4, 4, 2, -1, "[0, sync_every / fragments = 2)"),
    ],
)
def test_bad_fragments_are_named(pieces, h, fragments, delay, says):
    from shardwise.core.errors import ShardwiseError
    from shardwise.ft.diloco import fragments_of

    with pytest.raises(ShardwiseError, match=re.escape(says)):
        fragments_of(pieces, h, fragments, delay)
    assert fragments_of(5, 4, 2, 1) == [range(2), range(2, 5)]


def test_diloco_with_topk_messages_keeps_groups_equal_and_its_state_survives_a_checkpoint(jobs, lighthouse):  # noqa: F811
    jobs.lighthouse = lighthouse
    procs = [jobs.start(g, restarts=0, script=__file__, steps=H, comm="topk") for g in (0, 1)]
    assert [jobs.wait(p, 240) for p in procs] == [0, 0], jobs.logs()
    got = [torch.load(jobs.out / f"g{g}-full.pt") for g in (0, 1)]
    from nets import make

    from shardwise.ft.topk import CHUNK, K

    start = dict(make("tied").named_parameters())
    for n in start:
        assert torch.equal(got[0]["params"][n], got[1]["params"][n]), n
    # a round moves the K elements per chunk each group sent: on each rank (here under one
    # chunk, and more than K elements) at least one group's K
    changed = sum(int((got[0]["params"][n] != p.detach()).sum()) for n, p in start.items())
    total = sum(p.numel() for p in start.values())
    assert K < total // 2 < CHUNK and changed >= 2 * K, (changed, total)
    for g in (0, 1):
        assert got[g]["residual"] > 0 and not got[g]["reloaded"], got[g]["reloaded"]  # (what differs)


@pytest.fixture
def slow_lighthouse():
    """A lighthouse whose quorum waits for a live group to end its round (join timeout 30 s):
    a group that comes back mid-round meets the others at their round's end."""
    from shardwise.ft.lighthouse import serve

    server = serve(port=0, bind="127.0.0.1", join_timeout_ms=30_000)
    yield "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]
    server.shutdown()


def test_a_group_killed_mid_round_is_dropped_and_comes_back_with_the_global_model(jobs, slow_lighthouse):  # noqa: F811
    jobs.lighthouse = slow_lighthouse
    cfg = {"steps": 6 * H, "pause": 0.3, "min_replicas": 1, "kill_in": 1}
    a = jobs.start(0, restarts=0, script=__file__, **cfg)
    b = jobs.start(1, restarts=1, script=__file__, kill=[H + 1, 1], **cfg)  # rank 1, round 2's 2nd step
    assert [jobs.wait(a, 300), jobs.wait(b, 300)] == [0, 0], jobs.logs()
    got = [torch.load(jobs.out / f"g{g}-full.pt") for g in (0, 1)]
    alone = [r for r in got[0]["rounds"] if r[1] == 1 and r[2]]
    assert alone, got[0]["rounds"]  # group 0 went on alone while group 1 was away
    assert got[1]["heal"] is not None and got[1]["heal"][1] > 0, got[1]["heal"]  # (from memory)
    assert got[1]["run"] == "1" and got[1]["rounds"][0][0] > H + 1, got[1]["rounds"]  # (killed, back later)
    assert got[0]["rounds"][-1][1:] == (2, True) and got[0]["step"] == got[1]["step"] >= 6 * H
    for n, v in got[0]["params"].items():  # one global model again
        assert torch.equal(v, got[1]["params"][n]), n


def test_streaming_diloco_group_killed_mid_round_comes_back_with_each_fragments_global_and_outer_state(jobs, slow_lighthouse):  # noqa: F811
    """Two fragments (a sync every 2 of a round's 4 steps, issued 1 step early), int8 messages:
    a rank of group 1 SIGKILLed between two fragment syncs; group 0 goes on alone, group 1 comes
    back and heals at a fragment sync. It sits that sync out and holds the global parameters
    of every fragment (not mixed with the old ones), and at the end every rank of both groups
    holds bitwise the same global parameters and outer momentum, fragment by fragment, and
    error feedback residuals of its own for both fragments."""
    jobs.lighthouse = slow_lighthouse
    every, meet = 2, 8  # (a fragment sync every 2 steps; group 0 waits for group 1 after step 8's)
    cfg = {"steps": 16, "h": 4, "fragments": 2, "delay": 1, "comm": "int8", "pause": 0.3, "min_replicas": 1,
           "kill_in": 1, "meet_at": meet}
    a = jobs.start(0, restarts=0, script=__file__, **cfg)
    b = jobs.start(1, restarts=1, script=__file__, kill=[5, 1], **cfg)  # rank 1, the 2nd round's 2nd step
    assert [jobs.wait(a, 300), jobs.wait(b, 300)] == [0, 0], jobs.logs()
    got = [torch.load(jobs.out / f"g{g}-full.pt") for g in (0, 1)]
    assert (meet, 1, True) in got[0]["rounds"], got[0]["rounds"]  # (group 0 alone at the sync before it waits)
    assert got[1]["run"] == "1" and got[1]["heal"] is not None and got[1]["heal"][1] > 0, got[1]
    # group 1 heals at a sync of group 0 after ``meet`` (its first, unless group 1 asked for its
    # quorum only after group 0 had: torchft then forms group 0's alone): torchft's count there
    # is the syncs group 0 committed (the first, before any inner step, and one every ``every``
    # steps), and group 1 sits that sync out
    back = got[1]["rounds"][0][0]
    assert back >= meet + every and got[1]["rounds"][0] == (back, 2, True), got[1]["rounds"]
    assert got[1]["heal"][0] == back // every, got[1]["heal"]
    assert got[0]["step"] == got[1]["step"] >= 16, (got[0]["step"], got[1]["step"])
    for rank in (0, 1):
        mine, theirs = (torch.load(jobs.out / f"g{g}-outer{rank}.pt") for g in (0, 1))
        assert theirs["fresh"], "the healed group's parameters are not the global ones after the sync it sat out"
        assert mine["outer"].keys() == theirs["outer"].keys()
        for n, st in mine["outer"].items():
            for k in ("global", "momentum_buffer"):
                assert torch.equal(st[k], theirs["outer"][n][k]), f"rank {rank}: the groups' {k} of {n} differ"
            # (each rank's own: what its messages dropped, in both fragments since it came back)
            assert st["residual"].abs().sum() > 0 and not torch.equal(st["residual"], theirs["outer"][n]["residual"]), n


class _OneGroup:
    """The groups as a rank alone in its quorum sees them: the all-gather, issued, hands back
    this group's message once waited for."""

    def gather(self, message):
        return _InFlight(message.clone())


class _InFlight:
    def __init__(self, message):
        self.message = message

    def wait(self):
        return [self.message]


@pytest.mark.parametrize("comm", ["int8", "topk"])
def test_error_feedback_sends_what_a_message_drops_later(comm):
    """DiLoCo's own exchange (``_exchange_encoded``) of one pseudo-gradient, round after
    round: the mean of what arrived tends to it (the residual stays bounded), while one
    message alone is off by far more (norms over the pseudo-gradient's: the hundreds of top-k
    values at each of a chunk's two magnitudes pay a value far from their mean back slowly,
    so the largest value's error falls far slower than the whole's)."""
    from shardwise.ft.feedback import Feedback, codec_of

    torch.manual_seed(0)
    params = [torch.zeros(300, 40), torch.zeros(2000)]
    feedback = Feedback(codec_of(comm), torch.optim.SGD(params, lr=1.0), params)
    pseudo = torch.randn(14000) * torch.rand(14000) ** 4  # (magnitudes spread over decades)
    arrived, errors = torch.zeros_like(pseudo), {}
    for t in range(1, 201):
        flat = pseudo.clone()
        assert feedback.exchange(_OneGroup(), flat, None, sitting_out=False).wait()
        arrived += flat
        if t in (1, 200):
            errors[t] = (((arrived / t) - pseudo).norm() / pseudo.norm()).item()
    # sum of arrivals = t * pseudo - residual_t: the mean's error is the residual over t
    assert torch.allclose(arrived, 200 * pseudo - feedback.residual(), atol=1e-3)
    assert errors[200] < errors[1] / 5, errors


def test_an_encoded_exchange_is_in_flight_until_the_apply_waits_for_it():
    """Streaming DiLoCo's delayed sync: the exchange issued leaves the pseudo-gradient as it
    is (the residual kept already) while the inner steps go on; its wait leaves there
    bitwise what the blocking exchange did (the decoded average of the messages)."""
    from shardwise.ft.feedback import Feedback, codec_of

    torch.manual_seed(0)
    params = [torch.zeros(5000)]
    codec = codec_of("int8")
    feedback = Feedback(codec, torch.optim.SGD(params, lr=1.0), params)
    pseudo = torch.randn(5000)
    flat = pseudo.clone()
    exchange = feedback.exchange(_OneGroup(), flat, None, sitting_out=False)
    assert torch.equal(flat, pseudo)  # (in flight: untouched)
    assert torch.equal(feedback.residual(), pseudo - codec.decode(codec.encode(pseudo), 5000))
    assert exchange.wait() and torch.equal(flat, codec.decode(codec.encode(pseudo), 5000))


class _BesideAnother:
    """The groups as a rank sees them whose all-reduce (max) meets another group holding ``theirs``."""

    def __init__(self, theirs: torch.Tensor):
        self.theirs, self.replica_id = theirs, "g1"

    def average(self, t: torch.Tensor, reduce_op=None):
        t.copy_(torch.maximum(t, self.theirs))
        return _Done()

    def errored(self) -> bool:
        return False


class _Done:
    def wait(self):
        return True


def test_groups_holding_other_global_parameters_are_named_not_averaged():
    from shardwise.ft.diloco import DiLoCo

    d = DiLoCo.__new__(DiLoCo)
    d.params = [torch.zeros(3), torch.zeros(2)]
    d.outer = torch.optim.SGD(d.params, lr=1.0)
    for p, g in zip(d.params, [torch.full((3,), 0.5), torch.ones(2)], strict=True):
        d.outer.state[p]["global"] = g  # checksum 3.5
    for theirs, differs in ((3.5, False), (3.25, True)):
        d.ft = _BesideAnother(torch.tensor([theirs, -theirs], dtype=torch.float64))
        problem = d._check_global()
        assert (problem is not None) == differs and (not differs or "other global parameters" in problem), problem


def test_an_outer_state_saved_without_global_parameters_takes_the_parameters():
    """An outer checkpoint saved before the outer state held the global parameters (at a
    round's end, one fragment: the parameters were the global ones) loads as that."""
    from shardwise.ft.diloco import DiLoCo

    d = DiLoCo.__new__(DiLoCo)
    d.params = [torch.arange(3.0)]
    d.outer = torch.optim.SGD(d.params, lr=1.0)
    d.outer.load_state_dict({"state": {0: {"momentum_buffer": torch.ones(3)}}, "param_groups": d.outer.state_dict()["param_groups"]})
    (kept,) = d._globals(d.params)
    assert torch.equal(kept, d.params[0]) and kept is not d.params[0] and d.outer.state[d.params[0]]["global"] is kept
    d.params[0].data.add_(1.0)  # (training moves the parameters, not the global ones)
    assert torch.equal(d._globals(d.params)[0], torch.arange(3.0))


@pytest.mark.parametrize("comm, momentum", [(None, 0.9), ("int8", 0.9), ("topk", 0.8)])
def test_the_default_outer_optimizer_takes_top_k_messages_recipe(comm, momentum):
    """Without ``outer_optimizer``, ``ft.diloco`` steps Nesterov SGD at lr 0.7, with momentum
    0.8 under top-k messages (docs/fault_tolerance.md, "Top-k's recipe") and 0.9 otherwise."""
    from shardwise.ft.diloco import nesterov

    group = nesterov(comm)([torch.zeros(2, requires_grad=True)]).param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.7, momentum, True)


def test_topk_message_keeps_the_largest_of_the_message_with_sign_and_two_magnitudes_a_chunk():
    from shardwise.ft.topk import CHUNK, K, TopK2Bit

    codec = TopK2Bit()
    torch.manual_seed(0)
    # (the last chunk padded; the first chunk's values larger, so it sends more than K of them)
    x = torch.cat([4 * torch.randn(CHUNK), torch.randn(CHUNK - 1000)]) * torch.rand(2 * CHUNK - 1000)
    message = codec.encode(x)
    assert message.dtype == torch.uint8 and message.numel() == codec.nbytes(x.numel()) == 2 * (8 + CHUNK // 8 + K // 4)
    y = codec.decode(message, x.numel())
    kept = y != 0
    assert kept.sum() == 2 * K and torch.equal(kept, x.abs() >= x.abs().topk(2 * K).values[-1])
    assert kept[:CHUNK].sum() > K  # (the top-k is the message's, not each chunk's)
    assert torch.equal(y[kept].sign(), x[kept].sign())
    for chunk in (slice(0, CHUNK), slice(CHUNK, None)):
        xs, ys = x[chunk][kept[chunk]].abs(), y[chunk][kept[chunk]].abs()
        low, high = ys.min(), ys.max()
        assert low < high and torch.equal(ys == high, xs >= xs[ys == high].min())  # (two groups, split by magnitude)
        for part in (ys == high, ys == low):  # each group sent as its mean magnitude
            assert torch.allclose(ys[part], xs[part].mean().expand(int(part.sum())))
        # Lloyd's split: no more error than the median's (the former split)
        median = xs >= xs.median()
        by_median = torch.where(median, xs[median].mean(), xs[~median].mean())
        assert (ys - xs).norm() <= (by_median - xs).norm(), ((ys - xs).norm(), (by_median - xs).norm())
    assert CHUNK * 4 / codec.nbytes(CHUNK) > 18  # (fp32 bytes over the message's, a whole chunk)
    small = torch.randn(100)  # (fewer values than K: all sent)
    assert torch.equal(codec.decode(codec.encode(small), 100).sign(), small.sign())


def reference(
    h: int = H, rounds: int = ROUNDS, fragments: int = 1, delay: int = 0, ranks: tuple[int, int] = (2, 2)
) -> tuple[list[dict], float, list]:
    """One process: each group's inner steps on its own copy (with its own AdamW state, on the
    batch of its ``ranks``); each fragment's sync (every ``h / fragments`` inner steps, the
    fragments in turn) takes the groups' mean pseudo-gradient of that fragment, weighted by
    their ranks, ``delay`` steps before it is applied, steps
    the global parameters with Nesterov SGD, and sets each copy's fragment to them (mixed
    halfway with the copy's own where ``delay`` > 0). Returns each group's parameters, how far
    the global ones moved, and the fragments' names."""
    from nets import loss_of, make
    from plain_groups import group_batch

    from shardwise.ft.diloco import MIX, fragments_of

    global_model = make("tied")
    named = list(global_model.named_parameters())
    start = {n: p.detach().clone() for n, p in named}
    outer = torch.optim.SGD(global_model.parameters(), **OUTER)
    copies = [make("tied") for _ in (0, 1)]
    for c in copies:
        c.load_state_dict(global_model.state_dict())
    inner = [torch.optim.AdamW(c.parameters(), lr=LR) for c in copies]
    pieces = [[named[i][0] for i in piece] for piece in fragments_of(len(named), h, fragments, delay)]
    every, sent = h // fragments, {}
    for step in range(h * rounds):
        for g, (model, opt) in enumerate(zip(copies, inner, strict=True)):
            x, y = group_batch("tied", step, g, 2, ranks[g])
            loss_of(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        local, names = step % every + 1, pieces[(step // every) % fragments]
        mine = [dict(c.named_parameters()) for c in copies]
        if local == every - delay:
            sent = {n: sum(r * (dict(named)[n].detach() - m[n].detach()) for r, m in zip(ranks, mine, strict=True)) / sum(ranks) for n in names}
        if local == every:
            for n in names:
                dict(named)[n].grad = sent[n]
            outer.step()
            outer.zero_grad()
            with torch.no_grad():
                for m in mine:
                    for n in names:
                        trained = m[n].detach().clone()
                        m[n].copy_(dict(named)[n])
                        if delay:
                            m[n].lerp_(trained, MIX)
    moved = max((p.detach() - start[n]).abs().max().item() for n, p in named)
    return [{n: p.detach().clone() for n, p in c.named_parameters()} for c in copies], moved, pieces


def main(cfg: dict) -> None:
    """One rank of job ``cfg['group']``: DiLoCo with the test's rounds, then its full
    parameters (rank 0) in ``out/g<group>-full.pt``."""
    import torch.distributed as dist
    from plain_groups import build, forward_backward

    import shardwise
    import shardwise.ft
    from shardwise.ft.quorum import Phase

    shardwise.init(timeout=60)
    rank, world = dist.get_rank(), dist.get_world_size()
    ft = shardwise.ft.Torchft(
        lighthouse=os.environ["TORCHFT_LIGHTHOUSE"], replica_id=f"g{cfg['group']}",
        min_replicas=cfg.get("min_replicas", 2), timeout=cfg.get("timeout", 30), quorum_timeout=60,
        max_failed_steps=200,  # (the first quorum waits for the other job to start)
    )
    options = {k: cfg[k] for k in ("strategy", "shard_size", "mixed_precision") if k in cfg}
    model, inner = build(ft, lr=LR, **options)
    scaler = shardwise.GradScaler(model) if cfg.get("mixed_precision") == "fp16" else None
    outer = lambda ps: torch.optim.SGD(ps, **OUTER)  # noqa: E731
    h = cfg.get("h", H)
    opt = ft.diloco(inner, sync_every=h, outer_optimizer=outer, comm=cfg.get("comm"),
                    fragments=cfg.get("fragments", 1), fragment_sync_delay=cfg.get("delay", 0))
    saved = Path(cfg["out"]) / f"resume{cfg['group']}"
    if cfg.get("resume"):  # a checkpoint of the last run (model, both optimizers, torchft's count)
        shardwise.load(saved, model, opt)
        shardwise.load(saved.with_suffix(".outer"), model, opt.outer)
        ft.load_state_dict(torch.load(saved.with_suffix(f".ft{rank}")))
    kill, first_run = cfg.get("kill"), os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    every = h // cfg.get("fragments", 1)
    rounds = []  # (ft.step, groups in the (fragment) sync's quorum, committed) at each sync
    # (with a kill, the jobs go on past ``steps`` until a sync of every fragment after one of
    # both groups (where a group that healed sits out): the same on both)
    both = cfg.get("fragments", 1) + 1
    out, met = Path(cfg["out"]), False
    if "meet_at" in cfg and kill and not first_run:  # (back: meet group 0 where it waits)
        _wait_for_file(out / "g0-waiting")
        if rank == 0:
            (out / "g1-back").touch()
    while (
        ft.step < cfg["steps"]
        or ("kill_in" in cfg and [r[1:] for r in rounds[-both:]] != [(2, True)] * both)
        or ("until" in cfg and not (Path(cfg["out"]) / cfg["until"]).exists())  # (the test says when)
    ):
        assert ft.step < 40 * h or "until" in cfg, "the groups never trained together again"
        if "meet_at" in cfg and not kill and ft.step == cfg["meet_at"] and not met:  # (the live group)
            (out / "g0-waiting").touch()
            _wait_for_file(out / "g1-back")
            met = True
        opt.zero_grad()
        if not rounds:  # (the first quorum is a round's end too)
            rounds.append((ft.step, ft.participants, True))
            # (where no group contributed, or this group healed and sat the sync out: the global ones)
            fresh = all(torch.equal(p, opt.outer.state[p]["global"]) for p in opt.params)
        # (mid-round, mid-backward; without a meeting point, beside the other group: a group that
        # started late and healed past kill[0] dies at the same step of a later round)
        due = kill and (ft.step == kill[0] if "meet_at" in cfg else
                        ft.step >= kill[0] and ft.step % h == kill[0] % h and ft.participants == 2)
        if first_run and due and rank == kill[1]:
            model.blocks[1].register_full_backward_hook(lambda *_: os.kill(os.getpid(), signal.SIGKILL))
        forward_backward(model, "tied", ft.step, cfg["group"], rank, world, scale=scaler)
        if scaler is not None:  # (a step it skips for inf/NaN is taken again: ft.step stays)
            scaler.step(opt)
            scaler.update()
            committed = ft._phase is Phase.COMMITTED  # (the last round's vote)
        else:
            committed = opt.step()
        if ft.step % every == 0 or not committed:
            rounds.append((ft.step, ft.participants, committed))
            if rank == 0:
                (Path(cfg["out"]) / f"g{cfg['group']}-step").write_text(str(ft.step))
        assert committed or "kill_in" in cfg or "until" in cfg, f"a round did not commit (errored: {ft.leads and ft.errored()})"
        time.sleep(cfg.get("pause", 0.0))
    if cfg.get("save"):  # after a (fragment) sync
        assert ft.step % (h // cfg.get("fragments", 1)) == 0, ft.step
        shardwise.save(saved, model, opt)
        shardwise.save(saved.with_suffix(".outer"), model, opt.outer)
        torch.save(ft.state_dict(), saved.with_suffix(f".ft{rank}"))
    outer_state = {opt.names[id(p)]: {k: v.clone() for k, v in opt.outer.state[p].items()} for p in opt.params}
    torch.save({"outer": outer_state, "fresh": fresh}, Path(cfg["out"]) / f"g{cfg['group']}-outer{rank}.pt")
    full = shardwise.full_state_dict(model)
    residual, reloaded = 0.0, []
    if cfg.get("comm"):  # the outer state (its residual too) through a checkpoint
        path = Path(cfg["out"]) / f"ck{cfg['group']}"
        shardwise.save(path, model, opt)
        shardwise.save(path.with_suffix(".outer"), model, opt.outer)
        fresh, again = build(None, lr=LR)
        again_outer = outer([p for g in again.param_groups for p in g["params"]])
        shardwise.load(path, fresh, again)
        shardwise.load(path.with_suffix(".outer"), fresh, again_outer)
        mine = [opt.outer.state[p] for p in opt.params]
        theirs = [again_outer.state[p] for g in again.param_groups for p in g["params"]]
        residual = sum(st["residual"].abs().sum().item() for st in mine)
        reloaded = [
            (i, sorted(a), sorted(b)) for i, (a, b) in enumerate(zip(mine, theirs, strict=True))
            if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a)
        ]
    if rank == 0:
        heal = ft.last_heal and (ft.last_heal.step, ft.last_heal.bytes)
        pieces = [[opt.names[id(opt.params[i])] for i in piece] for piece in opt.pieces]
        torch.save({"params": full, "step": ft.step, "pieces": pieces, "residual": residual, "reloaded": reloaded, "rounds": rounds,
                    "heal": heal, "run": os.environ.get("TORCHELASTIC_RESTART_COUNT")},
                   Path(cfg["out"]) / f"g{cfg['group']}-full.pt")
    ft.shutdown()
    dist.destroy_process_group()


def _wait_for_file(path: Path, seconds: float = 270.0) -> None:
    # (under the tests' 300 s a job: a group that torchrun restarts after a SIGKILL took over
    # 180 s to come back when CI ran beside the quick start's tests)
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never came"
        time.sleep(0.1)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
