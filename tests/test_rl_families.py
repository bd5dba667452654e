"""Every decoder family transformers and vLLM both load takes a push: one tiny random model per
family (``rl_engines.FAMILIES``, written by ``save_pretrained``), served by ``vllm serve`` in
fp32, trained at N=2 full_shard for a few steps, pushed with the default wire dtype (the
engine's), and then the engine's greedy tokens and their logprobs must be transformers' on the
gathered model (within 1e-4) and differ from what it generated before the push. A biased
family (Qwen2) and a tied one (Qwen3, tied) are also pushed into two replicas of their engine
at once, each fed by its own rank (``TWO_ENGINES``).

Slow (marked ``slow``, run in CI): one engine boot per family, 20-30 s each on two cores. The
engines boot one ahead: the next family's starts while the current one is tested, so that at
most three run at once (a family of ``TWO_ENGINES`` and the next, or a family and the next's
two)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason='needs the vllm extra: pip install -e ".[vllm]"')

import rl_engines as E

pytestmark = pytest.mark.slow
KINDS = ["llama3", "mistral", "qwen2", "qwen3", "qwen3_tied", "gemma2", "gemma3", "phi3", "olmo2", "gpt_neox",
         "moe", "mixtral"]
TWO_ENGINES = {"qwen2", "qwen3_tied"}  # each also served by a second replica: one push into both


class OneAhead:
    """The matrix's engines in the order the session runs the families: asking for a family's
    (one, or two replicas for ``TWO_ENGINES``) stops the ones before and starts the next's."""

    def __init__(self, kinds: list[str]):
        self.kinds, self.root = kinds, Path(tempfile.mkdtemp(prefix="shardwise-vllm-families-"))
        self.up: dict[str, list[E.Server]] = {}

    def serve(self, kind: str) -> list[E.Server]:
        for k in [k for k in self.up if k != kind]:
            for server in self.up.pop(k):
                server.stop()
        self._start(kind)
        i = self.kinds.index(kind)
        if i + 1 < len(self.kinds):
            self._start(self.kinds[i + 1])
        for server in self.up[kind]:
            server.wait()
        return self.up[kind]

    def _start(self, kind: str) -> None:
        if kind not in self.up:
            self.up[kind] = [E.Server(kind, self.root, E.free_port()) for _ in range(1 + (kind in TWO_ENGINES))]
            for server in self.up[kind]:
                server.start()

    def stop(self) -> None:
        for servers in self.up.values():
            for server in servers:
                server.stop()
        self.up.clear()


@pytest.fixture(scope="module")
def engines(request):
    selected = [item.callspec.params["kind"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")]
    one_ahead = OneAhead(selected)
    yield one_ahead
    one_ahead.stop()


@pytest.mark.parametrize("kind", KINDS)
def test_family_takes_a_push(pools, engines, kind):
    servers = engines.serve(kind)
    server = servers[0]
    before = server.generate()
    ranks = pools(2)
    ranks.run(E.warm)
    results = ranks.run(E.push_job, server.url, kind, seed=40, steps_between=3)
    E.check_push(server, results[0], kind, before=before)
    if len(servers) > 1:  # one push into both replicas, rank 0 feeding one and rank 1 the other
        before = [s.generate() for s in servers]
        results = ranks.run(E.push_job, [s.url for s in servers], kind, seed=41, steps_between=3)
        for s, was in zip(servers, before):
            E.check_push(s, results[0], kind, before=was)
        for r in results:
            sent, payload = r["sent"][-1]
            assert payload <= sent < 1.01 * payload, r["sent"]  # the model once, to its own engine
