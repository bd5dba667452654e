"""What the vLLM tests share: tiny models written as vLLM loads them, ``vllm serve`` processes
(one per model kind, started once, running the "shardwise" weight-transfer backend), the
jobs the trainer ranks run, and the reference transformers computes on the gathered model.

Engines run in fp32 so that their tokens and logprobs can be held to transformers' on the
same weights; head dimension 32 (vLLM's CPU attention refuses some smaller ones).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import shardwise
import shardwise.rl
from shardwise.bench.vllm_link import SHUTDOWN_TIMEOUT_S, stop_process

PROMPTS = [[5, 17, 3, 42], [9, 9, 60, 2, 31]]
NEW_TOKENS = 6
LOGPROB_TOL = 1e-4  # an fp32 engine against fp32 transformers on the same weights (seen: 5e-7)


# one tiny random model per decoder family (name -> transformers config class, its own fields):
# the RL test matrix. Hidden size 64, two layers, head dimension 32 (vLLM's CPU attention
# refuses some smaller ones); "llama" and "moe" are the engines test_rl.py shares.
FAMILIES = {
    "llama": ("LlamaConfig", dict(intermediate_size=128)),
    "llama3": ("LlamaConfig", dict(intermediate_size=128, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "mistral": ("MistralConfig", dict(intermediate_size=128)),
    "qwen2": ("Qwen2Config", dict(intermediate_size=128, tie_word_embeddings=True)),  # q/k/v biases
    "qwen3": ("Qwen3Config", dict(intermediate_size=128)),
    "qwen3_tied": ("Qwen3Config", dict(intermediate_size=128, tie_word_embeddings=True)),
    "gemma2": ("Gemma2Config", dict(intermediate_size=128, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", dict(intermediate_size=128, tie_word_embeddings=True)),
    "phi3": ("Phi3Config", dict(intermediate_size=128, pad_token_id=0)),
    "olmo2": ("Olmo2Config", dict(intermediate_size=128, pad_token_id=0)),
    "gpt_neox": ("GPTNeoXConfig", dict(intermediate_size=128, num_key_value_heads=2)),  # biases, partial rotary; no GQA
    "moe": ("Qwen3MoeConfig", dict(  # experts stored fused, as transformers 5 holds them
        intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)),
}


def config(kind: str):
    """The tiny config of a family in ``FAMILIES`` (untied embeddings unless it says so)."""
    import transformers as tf

    cls, own = FAMILIES[kind]
    common = dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=64, tie_word_embeddings=False,
    )
    return getattr(tf, cls)(**{**common, **own})


def build(kind: str, seed: int, lora: bool = False):
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config(kind))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        for name, p in model.named_parameters():  # B = 0 at first: make the adapters count
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
    return model


def _die_with_parent() -> None:
    """In the server's process before exec: SIGTERM when pytest dies, however it dies (a killed
    run's teardown never stops its servers)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Server:
    """One ``vllm serve`` (its OpenAI server module: the ``vllm`` command needs the package
    named vllm) on a model directory, in a session of its own so that it is stopped whole."""

    def __init__(self, kind: str, root: Path, port: int):
        self.kind, self.port = kind, port
        self.url = f"http://127.0.0.1:{port}"
        self.path = root / kind
        if not self.path.exists():
            build(kind, seed=0).save_pretrained(self.path)
        self.log = root / f"{kind}-{port}.log"
        self.proc = None

    def start(self) -> None:
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.path),
            "--port", str(self.port), "--host", "127.0.0.1", "--skip-tokenizer-init",
            "--dtype", "float32", "--max-model-len", "64", "--enforce-eager", "--enable-scale-out",
            "--max-num-seqs", "8", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
            "--weight-transfer-config", '{"backend": "shardwise"}',
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=_die_with_parent
            )

    def wait(self, timeout: float = 400) -> None:
        from shardwise.bench.vllm_link import wait_healthy

        def running() -> None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve ({self.kind}) exited {self.proc.returncode}:\n{self.tail()}")

        try:
            wait_healthy(self.url, timeout, check=running)
        except TimeoutError as e:
            raise TimeoutError(f"{e}:\n{self.tail()}") from None

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def engine_pid(self) -> int:
        """The engine-core process (what dies when an engine dies)."""
        import psutil

        for child in psutil.Process(self.proc.pid).children(recursive=True):
            if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name():
                return child.pid
        raise RuntimeError("no EngineCore process under the server")

    def stop(self) -> None:
        """The server shuts its engine down (its shared memory unlinked), then anything left
        of its session is killed."""
        if self.proc is None:
            return
        stop_process(self.proc)
        self.proc = None

    def generate(self, prompts=PROMPTS) -> list[dict]:
        """Greedy tokens, their logprobs and the weight versions that produced them."""
        import requests

        out = []
        for p in prompts:
            r = requests.post(
                f"{self.url}/inference/v1/generate",
                json={"token_ids": p, "sampling_params": {"max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 0}},
                timeout=60,
            )
            r.raise_for_status()
            c = r.json()["choices"][0]
            out.append({
                "tokens": c["token_ids"],
                "logprobs": [x["logprob"] for x in c["logprobs"]["content"]],
                "versions": sorted({v["version"] for v in c["weight_versions"]}),
            })
        return out


_running: dict[str, Server] = {}


def start_servers() -> dict[str, Server]:
    """One ``vllm serve`` per model kind and a second of the Llama (several engines take one
    push), started together (once): they boot in about a minute on two cores, so conftest starts them as soon as it knows the session needs them,
    and they boot while the tests before this file run."""
    if not _running:
        root = Path(tempfile.mkdtemp(prefix="shardwise-vllm-"))
        for name, kind in (("llama", "llama"), ("llama_b", "llama"), ("moe", "moe")):  # llama_b: a second replica
            _running[name] = Server(kind, root, free_port())
            _running[name].start()
    return _running


def stop_servers() -> None:
    for server in _running.values():
        server.stop()
    _running.clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference(model, prompts=PROMPTS) -> list[dict]:
    """transformers' greedy tokens and their logprobs (fp32)."""
    model = model.float().eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            g = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               output_scores=True, return_dict_in_generate=True, pad_token_id=0)
            toks = g.sequences[0, len(p):].tolist()
            lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(g.scores, toks)]
            out.append({"tokens": toks, "logprobs": lps})
    return out


def reference_model(kind: str, state: dict, lora: bool = False, round_to: torch.dtype | None = None):
    """The gathered model as transformers runs it (peft: merged), optionally with every
    floating-point weight rounded through ``round_to`` (what a bf16 push delivers)."""
    model = build(kind, seed=0, lora=lora)
    if round_to is not None:
        state = {k: v.to(round_to).float() if v.is_floating_point() else v for k, v in state.items()}
    model.load_state_dict(state)
    return model.merge_and_unload() if lora else model


def check_push(server: Server, result: dict, kind: str, *, lora=False, round_to=None, before=None) -> None:
    """The engine now generates transformers' tokens and logprobs on the gathered model,
    under the version just pushed, and something else than before the push."""
    after = server.generate()
    ref = reference(reference_model(kind, result["state"], lora=lora, round_to=round_to))
    for got, want in zip(after, ref):
        assert got["tokens"] == want["tokens"], (got, want)
        assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])) < LOGPROB_TOL, (got, want)
        assert got["versions"] == [str(result["versions"][-1])]
    if before is not None:
        assert any(
            a["tokens"] != b["tokens"] or max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) > 1e-3
            for a, b in zip(after, before)
        ), "the push changed nothing the engine generates"


# --- what the trainer ranks run (tests/pool.py workers)
def warm() -> None:
    """Import vLLM's trainer side and transformers' models in a pool's workers (tens of
    seconds on a busy machine: a task of its own, within the pool's task timeout)."""
    import transformers  # noqa: F401

    from shardwise.rl.sync import VLLMSync  # noqa: F401


def push_job(url: str, kind: str, *, seed: int, lora: bool = False, strategy: str = "full_shard",
             shard_size: int | None = None, placement: str | None = None, mixed_precision: str | None = None,
             dtype: str | None = None, transport: str = "auto", delta: bool = False, lr: float = 1e-2,
             pushes: int = 1, steps_between: int = 1) -> dict:
    """Build, shard and train a model, pushing after every ``steps_between`` optimizer steps;
    every rank returns the versions pushed and the bytes it sent (and the payload) in each push,
    rank 0 also the gathered state dict. ``url``: one engine or a list."""
    model = build(kind, seed=seed, lora=lora)
    kw = {}
    if shard_size is not None:
        kw["shard_size"] = shard_size
    if placement is not None:
        kw["placement"] = getattr(shardwise.placement, placement)
    shardwise.shard(model, wrap=shardwise.wrap.auto(model), strategy=strategy, mixed_precision=mixed_precision, **kw)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    shardwise.reset_comm_stats()
    sync = shardwise.rl.VLLMSync(model, url if dist.get_rank() == 0 else None, dtype=dtype and getattr(torch, dtype),
                                 transport=transport, delta=delta, address="127.0.0.1",
                                 bucket_bytes=1 << 17)  # several buckets, tensors split across them
    versions, sent = [], []
    g = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    for _ in range(pushes):
        for _ in range(steps_between):
            ids = torch.randint(3, 128, (2, 12), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        before = shardwise.comm_stats()["weight_sync"]
        versions.append(sync.push())
        after = shardwise.comm_stats()["weight_sync"]
        sent.append((after.bytes - before.bytes, after.payload_bytes - before.payload_bytes))
    sync.close()
    state = shardwise.full_state_dict(model)
    return {"state": state, "versions": versions, "sent": sent} if dist.get_rank() == 0 else {"versions": versions,
                                                                                            "sent": sent}


def unreachable_job(url: str) -> tuple[str, float]:
    """Build a ``VLLMSync`` for an engine that is not there: the error each rank gets, and
    after how many seconds."""
    model = build("llama", seed=31)
    shardwise.shard(model, wrap=shardwise.wrap.auto(model))
    t0 = time.monotonic()
    try:
        shardwise.rl.VLLMSync(model, url if dist.get_rank() == 0 else None, timeout=30)
    except shardwise.rl.EngineError as e:
        return str(e), time.monotonic() - t0
    return "", time.monotonic() - t0


def death_job(url: str, engine_pid: int) -> dict:
    """Push once, then rank 0 kills the engine's process and every rank pushes again: each
    returns the error it got and how long it took, and whether its shards and optimizer state
    came through the failed push untouched (and the next step ran)."""
    model = build("moe", seed=30)
    shardwise.shard(model, wrap=shardwise.wrap.auto(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sync = shardwise.rl.VLLMSync(model, url if dist.get_rank() == 0 else None, timeout=60)

    def step(seed: int) -> None:
        ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(seed))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    def snapshot():
        state = [v.clone() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
        return [p.detach().clone() for p in model.parameters()] + state

    step(1)
    sync.push()
    step(2)
    held = snapshot()
    if dist.get_rank() == 0:
        os.kill(engine_pid, signal.SIGKILL)
    t0 = time.monotonic()
    try:
        sync.push()
        error = ""
    except shardwise.rl.EngineError as e:
        error = str(e)
    error_after = time.monotonic() - t0
    same = all(torch.equal(a, b) for a, b in zip(held, snapshot()))
    step(3)  # training goes on
    try:
        sync.push()  # the engine is still dead: a new handshake fails as fast
        again = ""
    except shardwise.rl.EngineError as e:
        again = str(e)
    return {"error": error, "error_after": error_after, "same_training": same, "again": again}


def overlap_job(url: str, *, seed: int, delta: bool = False, fail_first: bool = False, push: bool = True,
                strategy: str = "full_shard", shard_size: int | None = None, transport: str = "auto") -> dict:
    """Train with ``push(wait=False)`` after steps 1 and 3, each push's handle waited for only
    after the next two optimizer steps. Rank 0 returns the gathered state at each push (what
    the engine must serve) and at the end. ``fail_first``: rank 0's first ``update_weights``
    call to the engine raises, so that the first push fails in its thread; the second (a new
    handshake) then goes through. ``transport``: the sync's (``auto``: shm here). ``push=False``: the same
    training without any sync (the parity reference)."""
    model = build("llama", seed=seed)
    kw = {} if shard_size is None else {"shard_size": shard_size}
    shardwise.shard(model, wrap=shardwise.wrap.auto(model), strategy=strategy, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5 if delta else 1e-2)
    sync = None
    if push:
        sync = shardwise.rl.VLLMSync(model, url if dist.get_rank() == 0 else None, delta=delta, bucket_bytes=1 << 17,
                                     dtype=torch.bfloat16 if delta else None, address="127.0.0.1",
                                     transport=transport)
    if fail_first and sync.feeds:
        client, calls = sync.feeds[0].client, []

        def update_weights(update, _real=client.update_weights):
            calls.append(1)
            if len(calls) == 1:
                raise shardwise.rl.EngineError("injected: the engine refused a bucket")
            return _real(update)

        client.update_weights = update_weights
    g = torch.Generator().manual_seed(seed * 100 + dist.get_rank())

    def step() -> None:
        ids = torch.randint(3, 128, (2, 12), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    out = {"pushed": [], "versions": [], "errors": [], "done_early": []}
    for _ in range(2):
        step()
        if sync is None:
            step()
            step()
            continue
        out["pushed"].append(shardwise.full_state_dict(model))
        handle = sync.push(wait=False)
        step()
        out["done_early"].append(handle.done())
        step()
        try:
            out["versions"].append(handle.wait())
        except shardwise.rl.EngineError as e:
            out["errors"].append(str(e))
    if sync is not None:
        sync.close()
    out["state"] = shardwise.full_state_dict(model)
    return out if dist.get_rank() == 0 else {k: v for k, v in out.items() if k not in ("pushed", "state")}
