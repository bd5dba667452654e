"""shardwise.rl with vLLM really running: ``vllm serve`` engines (one per model kind, started
once for the session, fp32) receive pushes from trainer ranks at N=1, 2, 3 and 4 (hybrid),
through the "shardwise" weight-transfer backend. After each push the engine's greedy tokens
and logprobs must be transformers' on the gathered model, and differ from what it generated
before. Slow: the two engines start in about a minute on two cores; the whole file is
marked ``slow`` (it runs in CI; ``-m "not slow"`` leaves it out locally)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason='needs the vllm extra: pip install -e ".[vllm]"')
pytest.importorskip("peft", reason='needs the hf extra: pip install -e ".[hf]"')

import rl_engines as E

pytestmark = pytest.mark.slow


@pytest.fixture
def ranks(pools):
    """``ranks(n)``: the session's pool of n workers, vLLM's trainer side imported."""

    def get(n: int):
        pool = pools(n)
        pool.run(E.warm)
        return pool

    return get


@pytest.fixture(scope="module")
def servers():
    """``servers[kind]``: a running ``vllm serve`` per model kind (started by conftest when
    the session began, so that they boot while other tests run; stopped with this file, so
    that the family matrix's engines boot beside none of them)."""
    started = E.start_servers()
    try:
        for s in started.values():
            s.wait()
        yield started
    finally:
        E.stop_servers()


def test_mixture_of_experts_push(ranks, servers):
    server = servers["moe"]
    before = server.generate()
    results = ranks(2).run(E.push_job, server.url, "moe", seed=24, pushes=2)
    E.check_push(server, results[0], "moe", before=before)


def test_delta_push_of_fused_experts(ranks, servers):
    """The experts travel as the checkpoint's per-expert tensors, each a range of a fused
    parameter (whole experts per shard): a delta push sends each rank's own rows of them and
    the engine ends with the trained model."""
    server = servers["moe"]
    before = server.generate()
    results = ranks(2).run(E.push_job, server.url, "moe", seed=25, delta=True, pushes=2)
    (full, payload), (sent, pay) = results[0]["sent"]
    assert pay == payload and 0 < sent <= full, results[0]["sent"]
    E.check_push(server, results[0], "moe", before=before)


def test_wrong_shapes_fail_before_anything_moves(ranks, servers):
    """A model the engine does not hold: every rank gets the engine's verdict, naming the
    tensors, and the engine still serves what it had."""
    from pool import WorkerError

    server = servers["moe"]
    before = server.generate()
    with pytest.raises(WorkerError) as info:
        ranks(2).run(E.push_job, server.url, "llama", seed=27)
    outcomes = info.value.outcomes
    assert all(o.error_type == "shardwise.rl.clients.EngineError" for o in outcomes), outcomes
    assert all("do not fit this engine's model" in o.error_message for o in outcomes)
    assert "mlp.gate_proj.weight" in outcomes[0].error_message
    assert server.generate() == before


def test_an_engine_that_is_not_there_is_named_on_every_rank(ranks):
    """Rank 0 asks the engine for its dtype before the handshake: an engine that does not
    answer is an EngineError on every rank at once, not a rank waiting for rank 0."""
    results = ranks(2).run(E.unreachable_job, f"http://127.0.0.1:{E.free_port()}")
    assert results[0][0].startswith("the engine could not be asked for its dtype: "), results
    assert results[1][0].startswith("the engine could not be asked for its dtype (reported by rank 0): "), results
    assert "server_info" in results[0][0] or "Connection" in results[0][0], results
    assert max(seconds for _, seconds in results) < 20, results


def test_engine_death_is_named_on_every_rank(ranks, servers):
    """The engine dies mid-training: every rank raises EngineError within seconds (again at
    a retry, no hang), and training goes on exactly as without the failed push."""
    server = servers["moe"]
    results = ranks(2).run(E.death_job, server.url, server.engine_pid())
    seconds = [r["error_after"] for r in results]
    assert all(r["error"].startswith("push of version 2 failed") for r in results), results
    assert max(seconds) < 10, seconds
    assert all(r["same_training"] for r in results)
    assert all(r["again"].startswith("the engine refused the handshake") for r in results)  # no hang
    server.stop()
    server.start()  # back while the dense tests run; test_restarted_engine_takes_a_new_handshake


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_push_gives_the_engine_the_trained_model(ranks, servers, world_size):
    server = servers["llama"]
    before = server.generate()
    results = ranks(world_size).run(E.push_job, server.url, "llama", seed=10 + world_size, pushes=2)
    assert [r["versions"] for r in results] == [[1, 2]] * world_size
    E.check_push(server, results[0], "llama", before=before)
    sent, payload = results[0]["sent"][-1]
    assert payload == 4 * sum(t.numel() for t in results[0]["state"].values())  # the engine's fp32 by default
    assert payload <= sent < 1.01 * payload  # every byte of the fp32 model once (and alignment)


@pytest.mark.parametrize("world_size, delta", [(2, False), (3, True)], ids=["N2-full", "N3-delta"])
def test_several_engines_take_one_push(ranks, servers, world_size, delta):
    """Two replicas of the engine from one ``push()``: rank 0 feeds one and rank 1 the other
    (at N=3 rank 2 feeds none), each sending the model once; both serve the trained model
    under the same version. Delta (bf16, lr 1e-5): every change reaches both feeding ranks
    and both engines."""
    engines = [servers["llama"], servers["llama_b"]]
    before = [s.generate() for s in engines]
    pushes, wire = (3, torch.bfloat16) if delta else (2, None)
    results = ranks(world_size).run(E.push_job, [s.url for s in engines], "llama", seed=40 + world_size,
                                    delta=delta, dtype=wire and "bfloat16", lr=1e-5 if delta else 1e-2, pushes=pushes)
    assert [r["versions"] for r in results] == [list(range(1, pushes + 1))] * world_size
    for server, was in zip(engines, before):
        E.check_push(server, results[0], "llama", round_to=wire, before=was)
    payload = (2 if delta else 4) * sum(t.numel() for t in results[0]["state"].values())
    for rank, r in enumerate(results):
        for i, (sent, pay) in enumerate(r["sent"]):
            if rank >= 2:
                assert sent == pay == 0, r["sent"]  # feeds no engine
            elif i == 0 or not delta:
                assert pay == payload <= sent < 1.01 * payload, r["sent"]  # the model once, to its engine
            else:
                assert pay == payload and 0 < sent < 0.35 * payload, r["sent"]


@pytest.mark.parametrize("delta,transport", [(False, "shm"), (True, "shm"), (False, "tcp")],
                         ids=["full", "delta", "full-tcp"])
def test_push_beside_training_sends_the_weights_at_the_push(ranks, servers, delta, transport):
    """``push(wait=False)`` at N=2, each handle waited for after two more optimizer steps:
    the engine serves the weights as they were at the push (fp32; delta: bf16 at lr 1e-5),
    not those of the steps that ran while they streamed, and training is bitwise the same as
    without any push; over shared memory and over the tcp link (its Gloo group to the
    engine driven from the push's thread)."""
    server = servers["llama"]
    before = server.generate()
    pool = ranks(2)
    results = pool.run(E.overlap_job, server.url, seed=50 + delta, delta=delta, transport=transport)
    assert [r["versions"] for r in results] == [[1, 2]] * 2 and not any(r["errors"] for r in results)
    pushed = results[0]["pushed"]
    E.check_push(server, {"state": pushed[-1], "versions": [2]}, "llama", before=before,
                 round_to=torch.bfloat16 if delta else None)
    final = results[0]["state"]
    assert any(not torch.equal(final[k], pushed[-1][k]) for k in final)  # it did train on meanwhile
    alone = pool.run(E.overlap_job, server.url, seed=50 + delta, delta=delta, push=False)[0]["state"]
    assert all(torch.equal(final[k], alone[k]) for k in final)


def test_push_beside_training_under_hybrid_sharding(ranks, servers):
    """hybrid_shard 2x2: the push's own groups copy rank 0's shard group (the other replica
    sends nothing but takes part in the push's agreement); the engine serves the weights at
    the push and training is bitwise as without any push."""
    server = servers["llama"]
    pool = ranks(4)
    kw = dict(seed=53, strategy="hybrid_shard", shard_size=2)
    results = pool.run(E.overlap_job, server.url, **kw)
    assert [r["versions"] for r in results] == [[1, 2]] * 4 and not any(r["errors"] for r in results)
    E.check_push(server, {"state": results[0]["pushed"][-1], "versions": [2]}, "llama")
    alone = pool.run(E.overlap_job, server.url, push=False, **kw)[0]["state"]
    assert all(torch.equal(results[0]["state"][k], alone[k]) for k in alone)


def test_push_beside_training_fails_at_wait_on_every_rank(ranks, servers):
    """The engine refuses a bucket of a ``push(wait=False)``: ``wait()`` raises the
    EngineError on every rank (no hang), training goes on unchanged, and the next push (a new
    handshake) gives the engine the trained model."""
    server = servers["llama"]
    pool = ranks(2)
    results = pool.run(E.overlap_job, server.url, seed=52, fail_first=True)
    for rank, r in enumerate(results):
        assert r["versions"] == [1], r
        assert len(r["errors"]) == 1 and r["errors"][0].startswith("push of version 1 failed"), r
        assert "injected: the engine refused a bucket" in r["errors"][0], r
        assert rank == 0 or "(reported by rank 0)" in r["errors"][0], r
    E.check_push(server, {"state": results[0]["pushed"][-1], "versions": [1]}, "llama")
    alone = pool.run(E.overlap_job, server.url, seed=52, push=False)[0]["state"]
    assert all(torch.equal(results[0]["state"][k], alone[k]) for k in alone)


def test_one_engine_refusing_fails_the_push_on_every_rank(ranks, servers):
    """Of two engines, the second holds another model: every rank gets its verdict, naming
    the engine, and neither engine changes what it serves."""
    from pool import WorkerError

    engines = [servers["llama"], servers["moe"]]
    engines[1].wait()  # restarted by test_engine_death_is_named_on_every_rank
    before = [s.generate() for s in engines]
    with pytest.raises(WorkerError) as info:
        ranks(2).run(E.push_job, [s.url for s in engines], "llama", seed=27)
    for o in info.value.outcomes:
        assert o.error_type == "shardwise.rl.clients.EngineError", o
        assert f"engine 1 ({engines[1].url}): " in o.error_message and "do not fit this engine's model" in o.error_message
    assert "(reported by rank 1)" in info.value.outcomes[0].error_message
    assert [s.generate() for s in engines] == before


def test_hybrid_bf16_push(ranks, servers):
    """hybrid_shard 2x2, bf16 compute, a bf16 wire into the fp32 engine (narrower than the
    engine's dtype: the user's choice): the engine serves the fp32 master weights rounded to
    bf16."""
    server = servers["llama"]
    before = server.generate()
    results = ranks(4).run(E.push_job, server.url, "llama", seed=21, strategy="hybrid_shard", shard_size=2,
                           mixed_precision="bf16", dtype="bfloat16")
    E.check_push(server, results[0], "llama", round_to=torch.bfloat16, before=before)


def test_owned_placement_push(ranks, servers):
    server = servers["llama"]
    before = server.generate()
    results = ranks(2).run(E.push_job, server.url, "llama", seed=22, placement="matrices")
    E.check_push(server, results[0], "llama", before=before)


def test_lora_is_merged_into_the_base_weights(ranks, servers):
    """A peft model: the engine gets the base model's names with the adapters folded in, as
    merge_and_unload() computes them."""
    server = servers["llama"]
    before = server.generate()
    results = ranks(2).run(E.push_job, server.url, "llama", seed=23, lora=True)
    E.check_push(server, results[0], "llama", lora=True, before=before)


def test_push_over_tcp(ranks, servers):
    """The Gloo link (the engine on other machines), here over the loopback."""
    server = servers["llama"]
    before = server.generate()
    results = ranks(2).run(E.push_job, server.url, "llama", seed=25, transport="tcp", pushes=2)
    E.check_push(server, results[0], "llama", before=before)


def test_delta_sends_only_what_changed(ranks, servers):
    """bf16 wire, AdamW at lr 1e-5: after the first (full) push only the values whose bf16
    rounding changed travel (gaps of a byte and the values), and the engine ends with exactly
    the weights a full push would give it. (A random tiny model after one Adam step is a
    worst case: about one value in six changes; ``shardwise bench --vllm`` measures a GPT.)"""
    server = servers["llama"]
    results = ranks(2).run(E.push_job, server.url, "llama", seed=26, dtype="bfloat16", delta=True, lr=1e-5, pushes=3)
    (full, payload), *deltas = results[0]["sent"]
    assert payload <= full < 1.01 * payload
    for sent, pay in deltas:
        assert pay == payload and 0 < sent < 0.35 * payload, results[0]["sent"]
    E.check_push(server, results[0], "llama", round_to=torch.bfloat16)


def test_restarted_engine_takes_a_new_handshake(ranks, servers):
    """The engine killed above, started again at the same URL: a new VLLMSync handshakes and
    its push gives the engine the trained model."""
    server = servers["moe"]
    server.wait()
    results = ranks(2).run(E.push_job, server.url, "moe", seed=28)
    E.check_push(server, results[0], "moe")


def test_grpo_example_colocated(tmp_path):
    """examples/rl_grpo.py at N=2 with vLLM beside rank 0 (an in-process LLM): every step's
    rollouts come from the weights pushed after the step before, and the reward rises."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "rl_grpo.py"
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(example),
         "--steps", "20", "--workdir", str(tmp_path), "--plot", str(tmp_path / "reward.png")],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    steps = re.findall(r"step +(\d+)  reward ([\d.]+)  rollouts from version (\d+)", run.stdout)
    assert len(steps) == 20, run.stdout
    assert all(int(v) == int(s) + 1 for s, _, v in steps)  # push 1 before the loop, one per step
    rewards = [float(r) for _, r, _ in steps]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.05, rewards
    assert (tmp_path / "reward.png").stat().st_size > 0
